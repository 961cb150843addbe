"""WorkerProber under MockClock over the in-memory network (issue 3, required tests 5, 6 and 8).

Only the worker peers are fake: handlers written here decode the real
StatusVersionPB request and encode real WorkerStatusPB replies; the prober talks
to them through the real WorkerStatusClient over MemoryNetwork.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from actors.worker_prober import PROBE_TIMEOUT_KIND, ProbeHandle, ProbeOutcome, ProbeResult, SkipReason, WorkerProber
from router.config import ProberConfig
from router.transport.clients import WorkerStatusClient
from router.transport.errors import PeerAbort, RpcStatus
from router.transport.memory_adapter import MemoryNetwork
from router.types import Role, WorkerAddr
from router.wire import engine_status_pb2 as engine_pb
from router.wire import paths
from tests.test_supervision import run_until_it_crashes


class FakeWorkers:
    """The worker peers: one handler per target, counting concurrent handler executions."""

    def __init__(self, net: MemoryNetwork, latency_s: float = 0.0) -> None:
        self.net = net
        self.latency_s = latency_s
        self.active = 0
        self.peak = 0
        self.rpc_starts: list[float] = []
        self.echoed: dict[str, list[int]] = {}  # target → latest_finished_version sent, in order
        self.failing: set[str] = set()
        self.hanging: set[str] = set()
        self.slow: dict[str, float] = {}  # target → its own latency, in place of latency_s
        self.version_zero: set[str] = set()
        self.not_alive: set[str] = set()  # targets whose statuses say alive=false
        self._versions: dict[str, int] = {}
        self.replied_at: dict[tuple[str, int], float] = {}  # (target, version) → when that reply was made

    def add(self, worker: WorkerAddr) -> WorkerAddr:
        self.net.serve(worker.status_target, functools.partial(self._handle, worker.status_target))
        return worker

    def rpcs(self, worker: WorkerAddr | None = None) -> int:
        return self.net.call_count(None if worker is None else worker.status_target, paths.WORKER_GET_STATUS)

    async def _handle(self, target: str, method_path: str, request: bytes) -> bytes:
        assert method_path == paths.WORKER_GET_STATUS
        version_request = engine_pb.StatusVersionPB()
        version_request.ParseFromString(request)
        assert version_request.latest_cache_version == -1
        self.echoed.setdefault(target, []).append(version_request.latest_finished_version)
        self.rpc_starts.append(trio.current_time())
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if target in self.hanging:
                await trio.sleep_forever()
            await trio.sleep(self.slow.get(target, self.latency_s))
            if target in self.failing:
                raise PeerAbort(RpcStatus.UNAVAILABLE, "worker down")
            if target in self.version_zero:
                return engine_pb.WorkerStatusPB(role="RoleType.PREFILL", alive=True).SerializeToString()
            version = self._versions[target] = self._versions.get(target, 0) + 1
            self.replied_at[target, version] = trio.current_time()
            return engine_pb.WorkerStatusPB(
                role="RoleType.PREFILL",
                alive=target not in self.not_alive,
                status_version=version,
                latest_finished_version=100 + version,
                waiting_query_len=version,
            ).SerializeToString()
        finally:
            self.active -= 1


def workers(n: int) -> list[WorkerAddr]:
    return [WorkerAddr.from_http(f"10.0.{i // 200}.{i % 200 + 1}", 8000) for i in range(n)]


async def start_prober(nursery: trio.Nursery, fake: FakeWorkers, **overrides: object) -> WorkerProber:
    """A prober probing on demand only (background refresh off unless asked for)."""
    overrides.setdefault("background_refresh", False)
    config = dataclasses.replace(ProberConfig(), **overrides)  # type: ignore[arg-type]
    prober: WorkerProber = await nursery.start(WorkerProber(config, WorkerStatusClient(fake.net)).run)
    return prober


def by_outcome(results: tuple[ProbeResult, ...]) -> dict[object, int]:
    counts: dict[object, int] = {}
    for r in results:
        key: object = r.skip_reason if r.outcome is ProbeOutcome.SKIPPED else r.outcome
        counts[key] = counts.get(key, 0) + 1
    return counts


# --- required test 5: the global budget ---------------------------------------------------------


async def test_inflight_cap_is_exact_at_the_server(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.01)
    fleet = [fake.add(w) for w in workers(200)]
    prober = await start_prober(nursery, fake, inflight_cap=16, rate_per_s=1e6, rate_burst=1000)
    start = trio.current_time()
    handle = prober.probe(fleet, deadline=start + 10.0)
    await handle.wait_all()
    assert by_outcome(handle.results()) == {ProbeOutcome.OK: 200}
    assert fake.rpcs() == 200
    assert fake.peak == 16  # both bounds: never above the cap, and the cap is actually used
    assert prober.snapshot().peak_inflight == 16
    # 200 probes in waves of 16 at 10 ms each: ceil(200 / 16) = 13 waves, not serial, not all at once.
    assert trio.current_time() - start == pytest.approx(0.13)


async def test_a_full_inbox_skips_the_probes_it_refuses_and_counts_them(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """The owner's inbox is bounded (max_tracked_workers): probe() calls made faster than the owner
    runs, beyond that room, are answered at once as no_budget and counted, not queued without bound."""
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(7)]
    prober = await start_prober(nursery, fake, max_tracked_workers=4)
    deadline = trio.current_time() + 1.0
    # No checkpoint between: the owner, waiting, takes the first hand to hand; four wait in the inbox.
    handles = [prober.probe([worker], deadline) for worker in fleet]
    assert prober.snapshot().wanted_dropped == 2
    for refused in handles[5:]:
        assert by_outcome(refused.results()) == {SkipReason.NO_BUDGET: 1}


async def test_requests_waiting_for_budget_are_skipped_at_their_deadline(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.01)
    fleet = [fake.add(w) for w in workers(200)]
    prober = await start_prober(nursery, fake, inflight_cap=16, rate_per_s=1e6, rate_burst=1000)
    start = trio.current_time()
    deadline = start + 0.025
    handles = [prober.probe(fleet[i::4], deadline) for i in range(4)]  # 4 requests, 50 workers each
    for handle in handles:
        with trio.move_on_at(deadline):
            await handle.wait_all()
        assert trio.current_time() == deadline  # on time, not later
    results = tuple(r for h in handles for r in h.results())
    # Waves start at 0, 10 and 20 ms: 32 answered, 16 RPCs in flight at 25 ms, 152 never got a slot.
    assert by_outcome(results) == {
        ProbeOutcome.OK: 32,
        SkipReason.DEADLINE: 16,
        SkipReason.NO_BUDGET: 152,
    }
    assert tuple(r for h in handles for r in h.results()) == results  # read again: the same, not recounted
    await trio.sleep(1.0)
    assert fake.rpcs() == 48
    assert max(fake.rpc_starts) < deadline  # nothing started for a request past its deadline
    health = prober.snapshot()
    # Counted once per worker and request, also those still pending when the request read its
    # results (the RPCs in flight then, whose answers came after the deadline).
    assert {reason: n for reason, n in health.skipped.items() if n} == {
        SkipReason.NO_BUDGET.value: 152,
        SkipReason.DEADLINE.value: 16,
    }
    assert (health.inflight, health.waiting_for_budget, health.probes_ok) == (0, 0, 48)
    assert health.budget_tokens == 1000  # the 152 unused tokens were refunded


async def _the_only_slot_held(
    nursery: trio.Nursery, fake: FakeWorkers
) -> tuple[WorkerProber, WorkerAddr, WorkerAddr, ProbeHandle]:
    """A prober with one in-flight slot, held by a probe of a hanging worker (``held``); ``target``
    is the other worker, whose probes wait for that slot. The holding probe's handle last."""
    held, target = workers(2)
    fake.add(held)
    fake.add(target)
    fake.hanging.add(held.status_target)
    prober = await start_prober(nursery, fake, inflight_cap=1)
    holder = prober.probe([held], trio.current_time() + 10.0)  # takes the only slot and keeps it
    await trio.testing.wait_all_tasks_blocked()
    assert fake.active == 1
    return prober, held, target, holder


async def test_a_request_with_time_left_does_not_join_a_probe_whose_budget_wait_was_cancelled(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A probe waiting for an in-flight slot whose requesters' deadline passed lands no_budget; a request
    asking for the same worker in between, with time left, gets a probe of its own, not that skip."""
    fake = FakeWorkers(MemoryNetwork())
    prober, held, target, holder = await _the_only_slot_held(nursery, fake)
    now = trio.current_time()
    first = prober.probe([target], now + 0.005)  # waits for the slot
    await trio.testing.wait_all_tasks_blocked()
    flight = prober._workers[target].flight
    assert flight is not None and flight.phase.value == "budget"
    # As at the first request's deadline: trio has cancelled the probe's wait, which has not yet run.
    flight.budget_scope.cancel()
    second = prober.probe([target], trio.current_time() + 1.0)
    fake.hanging.discard(held.status_target)  # the slot frees up once the held call ends
    with trio.move_on_after(10.0):
        await holder.wait_all()
    await first.wait_all()
    await second.wait_all()
    assert by_outcome(first.results()) == {SkipReason.NO_BUDGET: 1}
    assert by_outcome(second.results()) == {ProbeOutcome.OK: 1}


async def test_a_skip_read_before_the_probe_gives_up_is_counted_once(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A request may stop waiting before its deadline and decide: the worker still waiting for budget
    reads as skipped no_budget, and when that probe gives up at the deadline its skip is not counted
    for the same request again."""
    prober, _, target, _ = await _the_only_slot_held(nursery, FakeWorkers(MemoryNetwork()))
    handle = prober.probe([target], trio.current_time() + 0.02)
    await trio.sleep(0.01)  # the request decides before its deadline
    assert by_outcome(handle.results()) == {SkipReason.NO_BUDGET: 1}
    await trio.sleep(0.02)  # the probe gave up at the deadline
    assert by_outcome(handle.results()) == {SkipReason.NO_BUDGET: 1}
    assert prober.snapshot().skipped[SkipReason.NO_BUDGET.value] == 1


async def test_a_skip_read_before_the_owner_took_the_request_is_counted_once(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A request may read its results before the prober's owner has taken it: the pending worker reads
    as skipped ``queued`` (nothing was decided about its probe, the budget included) and is counted
    then; the owner's own skip for it (no token before the deadline) was counted a second time."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    first, second = [fake.add(w) for w in workers(2)]
    prober = await start_prober(nursery, fake, health_interval_s=0.0, rate_per_s=1.0, rate_burst=1)
    await prober.probe([first], trio.current_time() + 1.0).wait_all()  # takes the one token
    handle = prober.probe([second], trio.current_time() + 0.05)
    assert by_outcome(handle.results()) == {SkipReason.QUEUED: 1}  # read before the owner ran
    await trio.sleep(0.1)
    assert by_outcome(handle.results()) == {SkipReason.NO_BUDGET: 1}  # the owner's verdict, delivered since
    assert {k: v for k, v in prober.snapshot().skipped.items() if v} == {SkipReason.QUEUED.value: 1}


async def test_a_probe_read_after_the_owner_took_it_waiting_for_budget_is_skipped_no_budget(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Taken by the owner and waiting for a rate token when the request stops waiting: ``no_budget``,
    the budget's verdict, not ``queued``."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    first, second = [fake.add(w) for w in workers(2)]
    prober = await start_prober(nursery, fake, health_interval_s=0.0, rate_per_s=10.0, rate_burst=1)
    await prober.probe([first], trio.current_time() + 1.0).wait_all()  # takes the one token
    handle = prober.probe([second], trio.current_time() + 1.0)  # the next token comes within the deadline
    await trio.testing.wait_all_tasks_blocked()  # the owner took it: its probe waits for the token
    flight = prober._workers[second].flight
    assert flight is not None and flight.phase.value == "budget"
    assert by_outcome(handle.results()) == {SkipReason.NO_BUDGET: 1}


async def test_on_demand_probes_pending_at_once_are_bounded(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    """Probes started and not yet landed (in flight or waiting for a slot) are at most
    max_tracked_workers: beyond that a request's workers are skipped no_budget at once, not queued
    without bound behind hanging workers."""
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(8)]
    fake.hanging.update(w.status_target for w in fleet)
    prober = await start_prober(nursery, fake, max_tracked_workers=4, inflight_cap=1, rate_per_s=1e6, rate_burst=1000)
    prober.probe(fleet, trio.current_time() + 1.0)
    await trio.testing.wait_all_tasks_blocked()
    health = prober.snapshot()
    assert (health.probes_started, health.inflight, health.waiting_for_budget) == (4, 1, 3)
    assert {reason: n for reason, n in health.skipped.items() if n} == {SkipReason.NO_BUDGET.value: 4}


async def test_a_slot_handed_over_after_the_deadline_starts_no_rpc(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """trio hands a freed slot to a parked waiter without a checkpoint after it, so a probe whose task
    runs late gets its slot with the deadline already past; it must give the slot back, not call.
    White-box: only a release made in the same tick as the clock passes the deadline reaches this, and
    no worker's reply can be timed into that tick, so the slot is held and handed over by hand."""
    fake = FakeWorkers(MemoryNetwork())
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start_prober(nursery, fake, inflight_cap=1)
    holder = object()
    prober._limiter.acquire_on_behalf_of_nowait(holder)  # the only slot, as another probe holds it
    handle = prober.probe([worker], trio.current_time() + 0.01)
    await trio.testing.wait_all_tasks_blocked()  # the probe waits for the slot
    autojump_clock.jump(0.02)  # the loop runs late: the deadline passes ...
    prober._limiter.release_on_behalf_of(holder)  # ... as the slot is handed over, in the same tick
    await trio.sleep(0.5)
    assert fake.rpcs(worker) == 0
    assert by_outcome(handle.results()) == {SkipReason.NO_BUDGET: 1}
    assert prober.snapshot().inflight == 0  # the slot was given back


async def test_rate_budget_over_a_window(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(600)]
    rate, burst = 1000.0, 10
    prober = await start_prober(nursery, fake, inflight_cap=1000, rate_per_s=rate, rate_burst=burst)
    start = trio.current_time()
    handle = prober.probe(fleet, deadline=start + 0.2005)  # off the 0.2 s token boundary
    await trio.testing.wait_all_tasks_blocked()  # the owner took the request (no time passes)
    # Tokens that could only be ready after the deadline are refused at once, not waited for.
    assert handle.pending == 200  # the burst answered at once (no latency); 200 wait for their tokens
    assert prober.snapshot().skipped[SkipReason.NO_BUDGET.value] == 600 - burst - 200
    await handle.wait_all()
    assert fake.rpcs() == burst + 200
    times = sorted(t - start for t in fake.rpc_starts)
    for t in times:
        # Started by time t: at most burst + rate × t (the budget holds), at least one fewer (it is used).
        started = bisect.bisect_right(times, t)
        assert burst + rate * t - 1 - 1e-6 <= started <= burst + rate * t + 1e-6
    for i in range(0, len(times), 7):
        for j in range(i, len(times), 5):
            assert j - i + 1 <= burst + rate * (times[j] - times[i]) + 1e-6


async def test_tokens_of_probes_that_never_started_are_refunded(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.01)
    fleet = [fake.add(w) for w in workers(5)]
    prober = await start_prober(nursery, fake, inflight_cap=1, rate_per_s=10.0, rate_burst=5)
    handle = prober.probe(fleet, trio.current_time() + 0.005)
    await trio.testing.wait_all_tasks_blocked()
    assert prober.snapshot().budget_tokens == 0.0
    with trio.move_on_at(handle.deadline):
        await handle.wait_all()
    await trio.testing.wait_all_tasks_blocked()
    # One probe holds the slot; the four that never got it gave their tokens back (plus 5 ms of refill).
    assert prober.snapshot().budget_tokens == pytest.approx(4.05)
    assert fake.rpcs() == 1


# --- required test 6: coalescing and the status cache --------------------------------------------


async def test_concurrent_requests_for_one_stale_worker_share_one_rpc(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.005)
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start_prober(nursery, fake)
    primer = prober.probe([worker], trio.current_time() + 1.0)
    await primer.wait_all()
    await trio.sleep(0.1)  # the status is now stale (older than fresh_ttl_s)
    before = prober.snapshot()
    got: list[ProbeResult] = []

    async def request() -> None:
        handle = prober.probe([worker], trio.current_time() + 0.05)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        got.extend(handle.results())

    async with trio.open_nursery() as requests:
        for _ in range(100):
            requests.start_soon(request)
    assert fake.rpcs(worker) == 2  # the primer's and exactly one for the 100 requests
    assert len(got) == 100
    assert all(r.outcome is ProbeOutcome.OK and not r.from_cache for r in got)
    assert len({id(r.status) for r in got}) == 1
    wave = prober.snapshot()
    assert wave.probes_started - before.probes_started == 1
    assert wave.coalesced - before.coalesced == 99
    # A second wave within the freshness TTL: answered from the cache, no RPC at all.
    got.clear()
    async with trio.open_nursery() as requests:
        for _ in range(100):
            requests.start_soon(request)
    assert fake.rpcs(worker) == 2
    assert all(r.from_cache for r in got)
    after = prober.snapshot()
    hits = after.cache_hits - before.cache_hits
    lookups = hits + after.cache_misses - before.cache_misses
    print(
        f"test 6: 200 requests, 1 RPC; cache hit ratio {hits / lookups:.2f} (hits {hits} / lookups {lookups})"
    )
    assert (hits, lookups) == (100, 200)


async def test_coalesced_probe_outlives_its_first_requester(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """The first requester leaves at its deadline; a later one with a longer deadline still gets the
    answer from the same probe, started once budget frees up."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.02)
    blocker, worker = [fake.add(w) for w in workers(2)]
    prober = await start_prober(nursery, fake, inflight_cap=1)
    now = trio.current_time()
    prober.probe([blocker], now + 1.0)  # holds the only in-flight slot from 0 to 20 ms
    await trio.sleep(0.001)
    first = prober.probe([worker], now + 0.005)
    second = prober.probe([worker], now + 0.1)
    with trio.move_on_at(first.deadline):
        await first.wait_all()
    assert first.results()[0].skip_reason is SkipReason.NO_BUDGET
    with trio.move_on_at(second.deadline):
        await second.wait_all()
    assert trio.current_time() == pytest.approx(now + 0.04)
    assert second.results()[0].outcome is ProbeOutcome.OK
    assert fake.rpcs(worker) == 1


async def test_a_status_is_taken_when_its_call_was_sent_and_ages_from_its_arrival(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """The pre-charge cut is the call's send time: a dispatch decided while the call was in flight
    may be missing from the status, so its charge must outlive it. Freshness counts from the arrival."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.01)
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.05)
    sent_at = trio.current_time()
    probe = prober.probe([worker], sent_at + 1.0)
    await probe.wait_all()
    arrived_at = trio.current_time()
    assert arrived_at > sent_at
    (result,) = probe.results()
    assert (result.sent_at, result.observed_at) == (sent_at, arrived_at)
    assert prober.cached_observed(worker) == (result.status, sent_at)
    await trio.sleep(0.049)
    (cached,) = prober.probe([worker], trio.current_time() + 1.0).results()
    assert cached.from_cache and (cached.sent_at, cached.observed_at) == (sent_at, arrived_at)


async def test_fresh_cache_hit_issues_no_rpc(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.05)
    first = prober.probe([worker], trio.current_time() + 1.0)
    await first.wait_all()
    answered_at = trio.current_time()
    await trio.sleep(0.049)
    hit = prober.probe([worker], trio.current_time() + 1.0)
    assert hit.pending == 0  # in hand at once
    (result,) = hit.results()
    assert result.from_cache and result.status is first.results()[0].status
    assert result.age_s(trio.current_time()) == pytest.approx(0.049)
    assert result.observed_at == answered_at
    assert fake.rpcs(worker) == 1
    await trio.sleep(0.001)  # now 50 ms old: no longer fresh
    miss = prober.probe([worker], trio.current_time() + 1.0)
    assert miss.pending == 1
    await miss.wait_all()
    assert fake.rpcs(worker) == 2
    assert not miss.results()[0].from_cache


async def test_latest_finished_version_is_echoed(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.0)
    for _ in range(3):
        await prober.probe([worker], trio.current_time() + 1.0).wait_all()
    fake.version_zero.add(worker.status_target)  # a reply without a status must not reset it
    await prober.probe([worker], trio.current_time() + 1.0).wait_all()
    fake.version_zero.clear()
    await prober.probe([worker], trio.current_time() + 1.0).wait_all()
    assert fake.echoed[worker.status_target] == [-1, 101, 102, 103, 103]


async def test_status_version_zero_is_ignored_not_a_failure(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork())
    (worker,) = [fake.add(w) for w in workers(1)]
    fake.version_zero.add(worker.status_target)
    prober = await start_prober(nursery, fake, eject_after_failures=1)
    for _ in range(5):
        handle = prober.probe([worker], trio.current_time() + 1.0)
        await handle.wait_all()
        assert handle.results()[0].outcome is ProbeOutcome.NO_STATUS
        assert handle.results()[0].status is None
    assert prober.cached(worker) is None
    assert prober.is_routable(worker)  # it answers: nothing says it is down
    health = prober.snapshot()
    assert (health.probes_no_status, health.probes_failed, health.probes_ok) == (5, 0, 0)
    assert health.ejected_until == {}
    fake.version_zero.clear()
    await prober.probe([worker], trio.current_time() + 1.0).wait_all()
    assert prober.is_routable(worker)
    status = prober.cached(worker)
    assert status is not None and status.status_version == 1


async def test_status_cache_is_bounded_lru(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(20)]
    prober = await start_prober(nursery, fake, max_tracked_workers=8)
    for worker in fleet:
        await prober.probe([worker], trio.current_time() + 1.0).wait_all()
        assert prober.snapshot().tracked_workers <= 8
    assert prober.snapshot().tracked_workers == 8
    assert [w for w in fleet if prober.cached(w) is not None] == fleet[-8:]
    # A lookup refreshes recency: fleet[12] survives the next eviction, fleet[13] does not. (A request
    # whose statuses are all fresh tells the owner only once per eighth of the hot window.)
    await trio.sleep(ProberConfig().hot_window_s / 8)
    prober.probe([fleet[12]], trio.current_time() + 1.0)
    await prober.probe([fake.add(workers(21)[20])], trio.current_time() + 1.0).wait_all()
    assert prober.cached(fleet[12]) is not None
    assert prober.cached(fleet[13]) is None


async def test_the_cache_keeps_a_failing_workers_history_over_older_healthy_ones(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(12)]
    prober = await start_prober(nursery, fake, max_tracked_workers=4, eject_after_failures=2)
    fake.failing.add(fleet[0].status_target)
    await prober.probe([fleet[0]], trio.current_time() + 1.0).wait_all()  # one failure: not yet ejected
    for worker in fleet[1:]:  # healthy workers tracked after it, more than the cache holds
        await prober.probe([worker], trio.current_time() + 1.0).wait_all()
    assert prober.snapshot().tracked_workers == 4
    await trio.sleep(0.1)
    await prober.probe([fleet[0]], trio.current_time() + 1.0).wait_all()  # its second failure in a row
    assert fleet[0] in prober.ejected()


async def test_a_fleet_larger_than_the_cache_keeps_a_dead_worker_ejected(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Health passes track every worker in turn: a dead worker, skipped by requests and passes alike,
    was always the oldest entry, forgotten with its ejection a second after it (fleet 120, cache 100)."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = [fake.add(w) for w in workers(120)]
    dead = fleet[0]
    fake.failing.add(dead.status_target)
    config = dataclasses.replace(ProberConfig(), max_tracked_workers=100, background_refresh=False)
    actor = WorkerProber(config, WorkerStatusClient(fake.net), fleet=lambda: fleet)
    prober: WorkerProber = await nursery.start(actor.run)
    for _ in range(3):  # requests name the dead worker until it is ejected
        await prober.probe([dead], trio.current_time() + 0.5).wait_all()
        await trio.sleep(0.01)
    assert dead in prober.ejected()
    ejected_at = trio.current_time()
    eject_s = config.eject_base_s
    await trio.sleep(eject_s - 1.0)
    assert dead in prober.ejected() and not prober.is_routable(dead), trio.current_time() - ejected_at
    assert prober.snapshot().tracked_workers == 100


async def test_a_worker_whose_fresh_status_says_not_alive_is_not_routable(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Routability read only refusals and ejections: a worker reporting alive=false was drawn by the
    domain source (preferred, as one with a status) and filled cold places the Scorer then dropped."""
    fake = FakeWorkers(MemoryNetwork())
    down, up = fake.add(workers(2)[0]), fake.add(workers(2)[1])
    fake.not_alive.add(down.status_target)
    prober = await start_prober(nursery, fake)
    await prober.probe([down, up], trio.current_time() + 1.0).wait_all()
    assert not prober.is_routable(down) and prober.is_routable(up)
    assert prober.unfit_for({Role.PREFILL})(down) and not prober.unfit_for({Role.PREFILL})(up)
    assert prober.unroutable_reason([up], (Role.PREFILL,)) is None
    why = prober.unroutable_reason([down], (Role.PREFILL,))
    assert why is not None and "1 reporting themselves not alive" in why
    # A status older than max_status_age_s says nothing now: with no probe since, it would keep a
    # recovered worker out for good.
    await trio.sleep(ProberConfig().max_status_age_s)
    assert prober.is_routable(down) and not prober.unfit_for({Role.PREFILL})(down)


async def test_retain_prunes_dropped_workers(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(6)]
    prober = await start_prober(nursery, fake, eject_after_failures=1)
    await prober.probe(fleet, trio.current_time() + 1.0).wait_all()
    fake.failing.add(fleet[0].status_target)
    await trio.sleep(0.1)
    await prober.probe([fleet[0]], trio.current_time() + 1.0).wait_all()
    assert list(prober.snapshot().ejected_until) == [fleet[0].status_target]
    prober.retain(frozenset(fleet[3:]))
    assert prober.snapshot().tracked_workers == 6  # the owner applies it, not the caller
    await trio.testing.wait_all_tasks_blocked()
    health = prober.snapshot()
    assert health.tracked_workers == 3
    assert health.ejected_until == {}
    assert prober.is_routable(fleet[0])  # forgotten: nothing is known against it any more


# --- required test 8: failure accrual and ejection -----------------------------------------------


async def probe_one(prober: WorkerProber, worker: WorkerAddr) -> ProbeResult:
    handle = prober.probe([worker], trio.current_time() + 1.0)
    await handle.wait_all()
    (result,) = handle.results()
    return result


async def test_flapping_worker_is_ejected_and_readmitted_per_backoff(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(4)]
    flappy = fleet[0]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.0, eject_base_s=30.0, eject_max_s=300.0)
    await prober.probe(fleet, trio.current_time() + 1.0).wait_all()

    async def fail_until_ejected() -> float:
        fake.failing.add(flappy.status_target)
        for _ in range(2):
            assert (await probe_one(prober, flappy)).error_kind == "unavailable"
            assert not prober.is_routable(flappy) and prober.cached(flappy) is None  # last probe refused
        assert (await probe_one(prober, flappy)).outcome is ProbeOutcome.FAILED
        return trio.current_time()

    async def ejected_until(ejected_at: float, duration: float) -> None:
        assert prober.snapshot().ejected_until == {flappy.status_target: ejected_at + duration}
        rpcs = fake.rpcs(flappy)
        await trio.sleep_until(ejected_at + duration - 0.001)
        result = await probe_one(prober, flappy)
        assert result.skip_reason is SkipReason.EJECTED
        assert fake.rpcs(flappy) == rpcs  # an ejected worker is not probed
        assert not prober.is_routable(flappy) and prober.cached(flappy) is None
        await trio.sleep_until(ejected_at + duration)
        assert prober.snapshot().ejected_until == {}
        assert prober.cached(flappy) is None  # on probation until a valid status

    async def readmit() -> None:
        fake.failing.discard(flappy.status_target)
        assert (await probe_one(prober, flappy)).outcome is ProbeOutcome.OK
        assert prober.is_routable(flappy) and prober.cached(flappy) is not None

    await ejected_until(await fail_until_ejected(), 30.0)  # 1st ejection: base × 1
    await readmit()
    await ejected_until(await fail_until_ejected(), 60.0)  # 2nd: base × 2
    fake.failing.add(flappy.status_target)
    assert (await probe_one(prober, flappy)).outcome is ProbeOutcome.FAILED  # probation: one failure
    await ejected_until(trio.current_time(), 90.0)  # 3rd: base × 3
    await readmit()
    await trio.sleep(65.0)  # two base periods out of ejection forgive two past ejections
    await ejected_until(await fail_until_ejected(), 60.0)
    assert prober.snapshot().failed_by_kind == {"unavailable": 10}


async def test_an_ejected_worker_is_skipped_at_once_from_the_view(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """probe() answers an ejected worker skipped(ejected) itself, before any hop to the owner: the
    request neither waits for it nor sends the owner work for it."""
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(4)]
    dead = fleet[0]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.0)
    await prober.probe(fleet, trio.current_time() + 1.0).wait_all()
    fake.failing.add(dead.status_target)
    for _ in range(3):
        await probe_one(prober, dead)
    assert dead.status_target in prober.snapshot().ejected_until
    handle = prober.probe([dead], trio.current_time() + 1.0)
    assert handle.pending == 0
    assert by_outcome(handle.results()) == {SkipReason.EJECTED: 1}


async def test_outliers_are_ejected_up_to_the_cap(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(10)]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.0, max_ejected_fraction=0.3)
    await prober.probe(fleet, trio.current_time() + 1.0).wait_all()
    outliers = fleet[:3]  # exactly the cap (floor(0.3 × 10)): outliers, not a collective failure
    fake.failing.update(w.status_target for w in outliers)
    for _ in range(3):
        await prober.probe(fleet, trio.current_time() + 1.0).wait_all()
        await trio.sleep(1.0)
    health = prober.snapshot()
    assert set(health.ejected_until) == {w.status_target for w in outliers}
    assert not health.collective_failure and health.collective_failures == 0
    assert [w for w in fleet if not prober.is_routable(w)] == outliers
    rpcs = fake.rpcs()
    await prober.probe(fleet, trio.current_time() + 1.0).wait_all()
    assert fake.rpcs() - rpcs == 7  # the ejected ones are not probed


async def test_one_outlier_may_be_ejected_from_a_small_fleet(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """10 % of 4 workers rounds down to none; at least one may still be ejected (as Envoy does)."""
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(4)]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.0)
    assert prober.snapshot().ejected_until == {}
    fake.failing.add(fleet[0].status_target)
    for _ in range(3):
        await prober.probe(fleet, trio.current_time() + 1.0).wait_all()
    assert list(prober.snapshot().ejected_until) == [fleet[0].status_target]


async def test_collective_failure_ejects_nobody_and_readmits_on_the_first_good_probe(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """The whole fleet frozen for 8 s, then back: nobody stays out after the cause has gone.

    The whole fleet fails in the same round, so nobody is ejected before the failure shows itself
    as collective (test_a_collective_failure_gives_back_the_ejections_it_ends has the ejections
    that come first).
    """
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(8)]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.0, max_ejected_fraction=0.5, probe_timeout_s=0.2)
    await prober.probe(fleet, trio.current_time() + 1.0).wait_all()
    fake.hanging.update(w.status_target for w in fleet)
    frozen_until = trio.current_time() + 8.0
    while trio.current_time() < frozen_until:
        await prober.probe(fleet, trio.current_time() + 1.0).wait_all()
        await trio.sleep(0.5)
    health = prober.snapshot()
    assert health.collective_failure and health.collective_failures == 1
    assert health.ejected_until == {}
    assert not any(prober.cached(w) for w in fleet)  # unusable for scoring meanwhile
    fake.hanging.clear()
    handle = prober.probe(fleet, trio.current_time() + 1.0)
    await handle.wait_all()
    assert by_outcome(handle.results()) == {ProbeOutcome.OK: 8}
    assert all(prober.is_routable(w) and prober.cached(w) is not None for w in fleet)
    health = prober.snapshot()
    assert not health.collective_failure and health.failing == 0
    # An outlier after the event is ejected as one: for base × 1.
    fake.failing.add(fleet[0].status_target)
    for _ in range(3):
        await prober.probe([fleet[0]], trio.current_time() + 1.0).wait_all()
    assert prober.snapshot().ejected_until == {fleet[0].status_target: trio.current_time() + 30.0}


async def test_a_collective_failure_gives_back_the_ejections_it_ends(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """The workers ejected as a collective failure began were its first signs, not outliers: their
    ejection counts are given back, so the next time one of them fails alone it is out for base × 1,
    not base × 2."""
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(10)]
    first, second = fleet[:2]
    prober = await start_prober(nursery, fake, fresh_ttl_s=0.0, eject_base_s=30.0, eject_max_s=300.0)
    await prober.probe(fleet, trio.current_time() + 1.0).wait_all()

    async def fail_three_times(worker: WorkerAddr) -> None:
        fake.failing.add(worker.status_target)
        for _ in range(3):
            await probe_one(prober, worker)

    await fail_three_times(first)
    assert first.status_target in prober.snapshot().ejected_until
    await fail_three_times(second)  # over the cap: a collective failure, which ends the ejection
    health = prober.snapshot()
    assert health.collective_failure and health.ejected_until == {}
    for worker in (first, second):
        fake.failing.discard(worker.status_target)
        assert (await probe_one(prober, worker)).outcome is ProbeOutcome.OK
    await fail_three_times(first)
    assert prober.snapshot().ejected_until == {first.status_target: trio.current_time() + 30.0}


async def test_background_health_probes_find_dead_workers_without_requests(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.01)
    fleet = [fake.add(w) for w in workers(6)]
    config = dataclasses.replace(ProberConfig(), health_interval_s=1.0, health_max_probes=4)
    prober = WorkerProber(config, WorkerStatusClient(fake.net), fleet=lambda: fleet)
    await nursery.start(prober.run)
    await trio.testing.wait_all_tasks_blocked()
    assert fake.rpcs() == 4  # the pass's first step: at most health_max_probes
    await trio.sleep(0.5)  # the pass went on as those landed: every worker heard from
    assert fake.rpcs() == 6 and all(fake.rpcs(w) == 1 for w in fleet)
    assert all(prober.cached(w) is not None for w in fleet)
    fake.failing.update(w.status_target for w in fleet[:2])
    await trio.sleep(2.0)
    assert [w for w in fleet if not prober.is_routable(w)] == fleet[:2]
    assert prober.unroutable_reason(fleet[:2], (Role.PREFILL,)) == (
        "no routable worker: none of the 2 discovered workers can take a request (2 refusing probes; last errors: "
        "unavailable)"
    )
    assert prober.unroutable_reason(fleet, (Role.PREFILL,)) is None
    # Each worker once per interval, at most.
    before = fake.rpcs()
    await trio.sleep(10.0)
    assert fake.rpcs() - before <= 6 * 10 and prober.snapshot().health_probes == fake.rpcs()


async def _fleet_with_hot_reads(
    nursery: trio.Nursery,
    fleet: list[WorkerAddr],
    hot: int,
    each_read: Callable[[WorkerProber, ProbeHandle], None],
) -> WorkerProber:
    """A prober over a fleet of 400 (filled into ``fleet``) with the default settings, its health
    passes left 5 s to cover it; then for 3 s a request every 10 ms reads the first ``hot`` workers,
    ``each_read`` called after each."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    fleet.extend(fake.add(w) for w in workers(400))
    prober = WorkerProber(ProberConfig(), WorkerStatusClient(fake.net), fleet=lambda: fleet)
    await nursery.start(prober.run)
    await trio.sleep(5.0)
    for _ in range(300):
        handle = prober.probe(fleet[:hot], trio.current_time() + 0.02)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        each_read(prober, handle)
        await trio.sleep(0.01)
    return prober


async def test_health_passes_keep_a_fleet_larger_than_their_slots_usable(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A sweep stopped at the first probe refused for want of a slot, once per interval: with the
    defaults 32 probes a second, so in a fleet of 400 most statuses nobody requests (a DECODE
    companion's, read only from the cache) were older than max_status_age_s. A pass goes on as its
    probes land, and never takes the tokens or slots a refresh round needs."""
    fleet: list[WorkerAddr] = []
    hot = 8
    fresh = 0

    def each_read(prober: WorkerProber, handle: ProbeHandle) -> None:
        nonlocal fresh
        fresh += sum(r.from_cache for r in handle.results())
        assert all(prober.cached(w) is not None for w in fleet)

    prober = await _fleet_with_hot_reads(nursery, fleet, hot, each_read)
    assert fresh >= 300 * hot - 2 * hot  # after their first probes, answered from the refresh
    assert prober.snapshot().refresh_short_of_budget == 0


async def test_health_passes_go_on_with_as_many_hot_workers_as_the_refresh_share_holds(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A health probe left a token per hot worker for the next refresh round: with 32 hot workers and
    the defaults that asked for more than the bucket ever holds, health probes stopped for good and the
    statuses nobody requests grew too old to use."""
    fleet: list[WorkerAddr] = []
    hot = 32
    before: list[int] = []

    def each_read(prober: WorkerProber, handle: ProbeHandle) -> None:
        if not before:
            before.append(prober.snapshot().health_probes)

    prober = await _fleet_with_hot_reads(nursery, fleet, hot, each_read)
    assert prober.snapshot().health_probes - before[0] >= len(fleet) - hot  # a pass over the rest at least
    assert all(prober.cached(w) is not None for w in fleet[hot:])


async def test_background_health_probes_take_only_tokens_in_the_bucket(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(50)]
    config = dataclasses.replace(
        ProberConfig(), health_interval_s=1.0, health_max_probes=64, rate_per_s=5.0, rate_burst=4
    )
    prober = WorkerProber(config, WorkerStatusClient(fake.net), fleet=lambda: fleet)
    await nursery.start(prober.run)
    await trio.testing.wait_all_tasks_blocked()
    # The burst less the part kept for requests (the refresh share's complement), never a debt.
    assert fake.rpcs() == 2
    assert prober.snapshot().budget_tokens == 2


async def test_the_health_pass_goes_on_past_a_window_requests_keep_fresh(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Half the fleet is probed by requests (no background refresh), so a health step whose window
    holds only those workers starts nothing; with no health probe out to land, the pass waited for the
    next interval, and the other half went unheard from past max_status_age_s."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = [fake.add(w) for w in workers(64)]
    hot, cold = fleet[:32], fleet[32:]
    probed: dict[str, list[float]] = {w.status_target: [] for w in fleet}

    def recording(target: str) -> Callable[[str, bytes], Awaitable[bytes]]:
        async def handle(method_path: str, request: bytes) -> bytes:
            probed[target].append(trio.current_time())
            return await fake._handle(target, method_path, request)

        return handle

    for worker in fleet:
        fake.net.serve(worker.status_target, recording(worker.status_target))
    config = dataclasses.replace(ProberConfig(), background_refresh=False, health_max_probes=4)
    prober = WorkerProber(config, WorkerStatusClient(fake.net), fleet=lambda: fleet)
    await nursery.start(prober.run)
    end = trio.current_time() + 20.0
    while trio.current_time() < end:
        await prober.probe(hot, trio.current_time() + 0.03).wait_all()
        await trio.sleep(0.1)
    gaps = [b - a for w in cold for a, b in itertools.pairwise(probed[w.status_target])]
    # Heard from every one or two intervals (a probe's own latency beside), within max_status_age_s.
    assert gaps and max(gaps) <= 2 * config.health_interval_s + 0.05 < config.max_status_age_s, max(gaps)


def _with_hanging(fake: FakeWorkers, fleet: list[WorkerAddr], hanging: int) -> list[WorkerAddr]:
    """``fleet`` served by ``fake``, its first ``hanging`` workers accepting and never answering."""
    served = [fake.add(w) for w in fleet]
    for worker in served[:hanging]:
        fake.hanging.add(worker.status_target)
    return served


async def _a_request_probe_gets_a_status(prober: WorkerProber, worker: WorkerAddr, *, within: float) -> None:
    handle = prober.probe([worker], trio.current_time() + within)
    with trio.move_on_at(handle.deadline):
        await handle.wait_all()
    (result,) = handle.results()
    assert result.status is not None, result


async def test_a_health_pass_skips_workers_heard_from_within_the_interval(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A health pass probes only workers not heard from for health_interval_s: those a request's
    probe heard from lately are known alive already and cost no second probe."""
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(4)]
    config = dataclasses.replace(ProberConfig(), background_refresh=False, health_interval_s=1.0)
    start = trio.current_time()
    prober = WorkerProber(config, WorkerStatusClient(fake.net), fleet=lambda: fleet)
    await nursery.start(prober.run)
    await trio.sleep_until(start + 0.9)
    assert [fake.rpcs(w) for w in fleet] == [1, 1, 1, 1]  # the first pass
    await prober.probe(fleet[:2], trio.current_time() + 0.05).wait_all()  # a request hears from two
    await trio.sleep_until(start + 1.5)  # past the second pass
    assert [fake.rpcs(w) for w in fleet] == [2, 2, 2, 2]


async def test_health_probes_hold_at_most_half_of_the_background_slots(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Hanging health probes hold at most half of the refresh share of the slots, so a health pass that
    goes on as slots free never leaves a refresh round without one."""
    fake = FakeWorkers(MemoryNetwork())
    fleet = _with_hanging(fake, workers(10), 10)
    config = dataclasses.replace(
        ProberConfig(), background_refresh=False, health_interval_s=1.0, inflight_cap=8, refresh_budget_share=0.5
    )
    prober = WorkerProber(config, WorkerStatusClient(fake.net), fleet=lambda: fleet)
    await nursery.start(prober.run)
    await trio.sleep(0.1)
    assert fake.active == 2  # half of the 4 slots of the refresh share


async def test_health_probes_of_hanging_workers_leave_requests_their_slots(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Health probes used to take every free slot; when the workers a sweep picks hang (the ones not
    heard from lately, in a partial partition), they held them all to the timeout and a request's
    probe of a healthy worker was skipped for want of budget."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = _with_hanging(fake, workers(200), 64)
    config = dataclasses.replace(ProberConfig(), background_refresh=False)
    prober = WorkerProber(config, WorkerStatusClient(fake.net), fleet=lambda: fleet)
    await nursery.start(prober.run)
    await trio.sleep(0.01)
    snapshot = prober.snapshot()
    assert snapshot.health_probes > 0 and snapshot.inflight <= snapshot.inflight_cap // 2  # the refresh share
    await _a_request_probe_gets_a_status(prober, fleet[-1], within=0.05)


async def test_refresh_polls_and_health_probes_together_leave_requests_their_slots(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Each kind had the refresh share of the slots to itself: with hanging workers kept hot (refresh)
    and others not heard from (health), they held every slot between them."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = _with_hanging(fake, workers(300), 120)
    hanging = fleet[:120]
    prober = WorkerProber(ProberConfig(), WorkerStatusClient(fake.net), fleet=lambda: fleet)
    await nursery.start(prober.run)
    for _ in range(100):  # requests keep 40 hanging workers hot, not waiting for them
        prober.probe(hanging[:40], trio.current_time())
        await trio.sleep(0.01)
    assert prober.snapshot().inflight <= prober.snapshot().inflight_cap // 2  # the refresh share, both kinds
    await _a_request_probe_gets_a_status(prober, fleet[250], within=0.02)


@pytest.mark.parametrize("serial", [False, True], ids=["task-per-poll", "serial-rounds"])
async def test_a_garbled_replys_detail_is_kept_for_the_debug_snapshot(
    nursery: trio.Nursery, autojump_clock: MockClock, serial: bool
) -> None:
    """A garbled reply's detail (which field broke the contract) was thrown away: only its kind was kept."""
    net = MemoryNetwork()
    broken, verbose = workers(2)

    async def garbled(method_path: str, request: bytes) -> bytes:
        return engine_pb.WorkerStatusPB(status_version=1, block_size=-5).SerializeToString()

    async def refusing_at_length(method_path: str, request: bytes) -> bytes:
        raise PeerAbort(RpcStatus.UNAVAILABLE, "x" * 1000)

    net.serve(broken.status_target, garbled)
    net.serve(verbose.status_target, refusing_at_length)
    config = dataclasses.replace(ProberConfig(), serial_refresh=serial, health_interval_s=0.0)
    prober: WorkerProber = await nursery.start(WorkerProber(config, WorkerStatusClient(net)).run)
    for _ in range(5):  # on demand, then by the refresh (serial rounds, if on)
        handle = prober.probe([broken, verbose], trio.current_time() + 0.05)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        await trio.sleep(0.1)
    view = prober.view().workers
    assert view[broken].last_error == "garbled" and "block_size" in view[broken].last_error_detail
    assert 0 < len(view[verbose].last_error_detail) <= 200  # a peer's text does not grow the state
    last_errors = prober.snapshot().last_errors
    assert set(last_errors) == {broken.status_target, verbose.status_target}
    assert last_errors[broken.status_target] == "garbled: " + view[broken].last_error_detail


async def test_hanging_worker_is_ejected_even_with_short_request_deadlines(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A started RPC runs to probe_timeout_s, whoever waits, so a black hole still accrues failures."""
    fake = FakeWorkers(MemoryNetwork())
    worker, other = [fake.add(w) for w in workers(2)]
    prober = await start_prober(nursery, fake, probe_timeout_s=0.2)
    await prober.probe([worker, other], trio.current_time() + 1.0).wait_all()
    fake.hanging.add(worker.status_target)
    for _ in range(3):
        await trio.sleep(0.1)
        handle = prober.probe([worker], trio.current_time() + 0.01)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        assert handle.results()[0].skip_reason is SkipReason.DEADLINE
        await trio.sleep(0.2)
    assert prober.snapshot().failed_by_kind == {PROBE_TIMEOUT_KIND: 3}
    assert not prober.is_routable(worker)
    assert fake.rpcs(worker) == 4


async def test_new_and_stale_workers_are_not_usable(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start_prober(nursery, fake, max_status_age_s=3.0)
    assert prober.cached(worker) is None
    assert prober.is_routable(worker)  # never probed: not known to be down, so routable
    await prober.probe([worker], trio.current_time() + 1.0).wait_all()
    assert prober.cached(worker) is not None
    await trio.sleep(2.999)
    assert prober.cached(worker) is not None
    await trio.sleep(0.001)
    assert prober.cached(worker) is None  # older than max_status_age_s: unknown for scoring
    assert prober.is_routable(worker)


async def test_the_probes_asked_when_a_bug_ends_the_run_end_stopped_at_once(
    autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while applying a request's probes ended the run with that request in hand: its workers
    not yet reached, and the requests queued behind it, waited out their deadlines although the
    prober was known down (only the probes already in flight ended ``stopped``)."""
    fake = FakeWorkers(MemoryNetwork())
    a, b, c = [fake.add(w) for w in workers(3)]
    prober = WorkerProber(ProberConfig(), WorkerStatusClient(fake.net))
    real_lookup = prober._lookup

    def lookup(worker: WorkerAddr, handle: ProbeHandle, now: float) -> ProbeResult | None:
        if worker == b:
            raise RuntimeError("a bug while probing")
        return real_lookup(worker, handle, now)

    monkeypatch.setattr(prober, "_lookup", lookup)
    crashed: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(run_until_it_crashes, prober.run, crashed)
        start = trio.current_time()
        in_hand = prober.probe([a, b], start + 1.0)  # handed to the owner, which is waiting for it
        queued = prober.probe([c], start + 1.0)  # behind it in the inbox
        with trio.fail_after(1):
            await in_hand.wait_all()
            await queued.wait_all()
        assert trio.current_time() == start
    reasons = {r.worker: r.skip_reason for r in (*in_hand.results(), *queued.results())}
    assert reasons == {a: SkipReason.STOPPED, b: SkipReason.STOPPED, c: SkipReason.STOPPED}
    assert [str(exc) for exc in crashed] == ["a bug while probing"]
    # What the queued request said of its worker (wanted) is the next run's, as before.
    monkeypatch.undo()
    async with trio.open_nursery() as nursery:
        await nursery.start(prober.run)
        await trio.testing.wait_all_tasks_blocked()
        assert prober.snapshot().tracked_workers == 3  # a and b, of the request in hand, and c
        nursery.cancel_scope.cancel()


async def test_probe_before_run_or_after_deadline_is_skipped(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork())
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = WorkerProber(ProberConfig(), WorkerStatusClient(fake.net))
    assert prober.probe([worker], trio.current_time() + 1.0).results()[0].skip_reason is SkipReason.STOPPED
    await nursery.start(prober.run)
    handle = prober.probe([worker, worker], trio.current_time())
    assert handle.workers == (worker,)
    assert handle.results()[0].skip_reason is SkipReason.DEADLINE
    assert fake.rpcs() == 0


def test_bad_config_is_rejected_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"prober\.inflight_cap"):
        WorkerProber(ProberConfig(inflight_cap=0), WorkerStatusClient(MemoryNetwork()))


async def test_results_stream_as_they_complete(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(4)]
    prober = await start_prober(nursery, fake)
    await prober.probe(fleet[:1], trio.current_time() + 1.0).wait_all()
    fake.latency_s = 0.01
    handle = prober.probe(fleet, trio.current_time() + 1.0)
    assert list(handle.statuses()) == [fleet[0]]  # the fresh one is in hand at once
    arrivals: list[tuple[WorkerAddr, bool]] = [(r.worker, r.from_cache) async for r in handle]
    assert arrivals[0] == (fleet[0], True)
    assert sorted(w.ip for w, _ in arrivals[1:]) == sorted(w.ip for w in fleet[1:])


async def test_a_stop_gives_back_the_tokens_of_probes_still_waiting_for_budget(autojump_clock: MockClock) -> None:
    """Their calls will not be made: kept, the debt they reserved held the next run's probes back."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = [fake.add(w) for w in workers(5)]
    config = dataclasses.replace(ProberConfig(), background_refresh=False, rate_per_s=0.01, rate_burst=1)
    prober = WorkerProber(config, WorkerStatusClient(fake.net))
    async with trio.open_nursery() as run:
        await run.start(prober.run)
        prober.probe(fleet, trio.current_time() + 1000.0)  # one token: four wait, each reserving one ahead
        await trio.testing.wait_all_tasks_blocked()
        assert prober._bucket.peek(trio.current_time()) < -3
        run.cancel_scope.cancel()  # the prober stops
    assert prober._bucket.peek(trio.current_time()) == pytest.approx(0.0, abs=0.01)

