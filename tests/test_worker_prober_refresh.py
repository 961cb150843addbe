"""WorkerProber as a single-owner actor, and its background refresh of hot workers (MockClock).

The worker peers are the fake handlers of test_worker_prober.py over the in-memory network; the
prober is the real one with the real WorkerStatusClient.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from actors.probe_budget import prober_problems
from actors.worker_prober import ProbeKind, ProbeOutcome, ProbeResult, ProberHealth, SkipReason, WorkerProber
from kvroute_sim.sim.cluster import SimCluster
from router.api import RouteRequest
from router.config import ProberConfig
from router.transport.clients import LARGE_REPLY_BYTES, WorkerStatusClient
from router.transport.memory_adapter import MemoryNetwork
from router.transport.ports import InTurnCall, InTurnReply
from router.types import RouteSource, Stage, WorkerAddr
from router.wire import paths
from tests.test_router_pipeline import BLOCK, PROMPT, CallWatched, StalledOnTheReply, routed, seed
from tests.test_worker_prober import FakeWorkers, workers

FRESH_TTL_S = 0.05
INTERVAL_S = 0.025
HOT_WINDOW_S = 0.5


def refreshing(**overrides: object) -> ProberConfig:
    base = dataclasses.replace(
        ProberConfig(),
        background_refresh=True,
        fresh_ttl_s=FRESH_TTL_S,
        refresh_interval_s=INTERVAL_S,
        hot_window_s=HOT_WINDOW_S,
        health_interval_s=0.0,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


async def start(nursery: trio.Nursery, fake: FakeWorkers, config: ProberConfig, **kw: object) -> WorkerProber:
    prober: WorkerProber = await nursery.start(WorkerProber(config, WorkerStatusClient(fake.net), **kw).run)  # type: ignore[arg-type]
    return prober


async def want(prober: WorkerProber, fleet: list[WorkerAddr], within_s: float = 0.01) -> tuple[int, int]:
    """One request naming ``fleet``: (answered fresh from the cache, of them from a background poll)."""
    handle = prober.probe(fleet, trio.current_time() + within_s)
    with trio.move_on_at(handle.deadline):
        await handle.wait_all()
    results = handle.results()
    return sum(r.from_cache for r in results), sum(r.background for r in results)


@pytest.mark.parametrize("serial", [False, True], ids=["task-per-poll", "serial-rounds"])
async def test_a_hot_worker_stays_fresh_without_probes_of_its_own(
    nursery: trio.Nursery, autojump_clock: MockClock, serial: bool
) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = [fake.add(w) for w in workers(3)]
    polls: list[tuple[ProbeKind, int]] = []
    config = refreshing(serial_refresh=serial)
    prober = await start(nursery, fake, config, on_probes=lambda kind, n: polls.append((kind, n)))
    await want(prober, fleet)  # the first request probes on demand: nothing is known yet
    assert prober.snapshot().probes_started == 3
    fake.peak = 0  # from here on, background polls only
    fresh = background = 0
    for _ in range(100):  # one request every 7 ms for 0.7 s (statuses are fresh for 50 ms)
        await trio.sleep(0.007)
        hits, from_background = await want(prober, fleet)
        fresh += hits
        background += from_background
    health = prober.snapshot()
    assert health.probes_started == 3  # not one more on-demand probe
    assert fresh == 300
    # All but the first few requests' (3 workers each), still answered by the on-demand probe's status;
    # a serial round's statuses land together at its end, one request later.
    assert background >= 300 - 3 * (4 if serial else 3)
    assert health.fresh_from_background == background
    assert health.hot_workers == 3 and health.refresh_active
    # Each worker polled about every refresh interval (+ its 2 ms RPC), never faster; a serial round
    # makes its polls one at a time, the others all at once.
    per_worker = fake.rpcs(fleet[0]) - 1
    assert 0.7 / (INTERVAL_S + 0.01) <= per_worker <= 0.7 / INTERVAL_S + 1
    assert fake.peak == (1 if serial else 3)
    assert sum(n for kind, n in polls if kind is ProbeKind.REFRESH) == health.refresh_polls
    # Every poll started was made, but for those of a serial round in flight that wait for their turn.
    made = fake.rpcs() - 3
    assert made <= health.refresh_polls <= made + (health.inflight if serial else 0)


async def test_a_background_status_the_owner_answers_from_its_cache_says_so_and_is_counted(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A request asks the owner for a worker its snapshot had no fresh status of (published before a
    poll landed): the owner's cache answers it, and marks and counts a background poll's status as the
    snapshot's own answers are (it once said ``background=False`` and left it out of the count)."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    [worker] = [fake.add(w) for w in workers(1)]
    prober = await start(nursery, fake, refreshing())
    await want(prober, [worker])  # probed on demand; hot from here on
    for _ in range(5):  # statuses from background polls only
        await trio.sleep(0.007)
        await want(prober, [worker])
    assert prober._workers[worker].status_background
    before = prober.snapshot().fresh_from_background
    prober._view = dataclasses.replace(prober._view, workers={})  # a snapshot from before the poll landed
    handle = prober.probe([worker], trio.current_time() + 0.01)
    await handle.wait_all()
    [result] = handle.results()
    assert result.from_cache and result.background
    assert prober.snapshot().fresh_from_background == before + 1


@pytest.mark.parametrize("serial", [False, True], ids=["task-per-poll", "serial-rounds"])
async def test_background_refresh_stops_polling_a_worker_gone_cold(
    nursery: trio.Nursery, autojump_clock: MockClock, serial: bool
) -> None:
    fake = FakeWorkers(MemoryNetwork())
    hot, cooling = [fake.add(w) for w in workers(2)]
    prober = await start(nursery, fake, refreshing(serial_refresh=serial))
    await want(prober, [hot, cooling])
    end = trio.current_time() + 2.0
    while trio.current_time() < end:  # only `hot` is named after the first request
        await trio.sleep(0.02)
        await want(prober, [hot])
    # `cooling` was polled only while it was hot (hot_window_s after its last request).
    assert fake.rpcs(cooling) <= HOT_WINDOW_S / INTERVAL_S + 2
    assert fake.rpcs(hot) >= 2.0 / (INTERVAL_S + 0.001) - 2
    assert prober.snapshot().hot_workers == 1
    # Nobody asks any more: both go cold and the owner stops polling (no timer left to run).
    await trio.sleep(HOT_WINDOW_S + INTERVAL_S)
    rpcs = fake.rpcs()
    await trio.sleep(10.0)
    assert fake.rpcs() == rpcs
    assert prober.snapshot().hot_workers == 0


async def test_a_refused_poll_makes_a_status_still_within_its_ttl_unusable(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A poll refused since the last status says more than that status's age: a request reading the
    worker within fresh_ttl_s is not answered from the cache with it but probes the worker itself."""
    fake = FakeWorkers(MemoryNetwork())
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start(nursery, fake, refreshing(serial_refresh=False))
    start_at = trio.current_time()
    assert await want(prober, [worker]) == (0, 0)  # probed on demand: the status the poll follows
    fake.failing.add(worker.status_target)
    await trio.sleep_until(start_at + INTERVAL_S + 0.005)  # the poll after one interval was refused
    assert prober.snapshot().probes_failed == 1
    assert trio.current_time() - start_at < FRESH_TTL_S  # the status is still within its ttl
    handle = prober.probe([worker], trio.current_time() + 0.01)
    await handle.wait_all()
    (result,) = handle.results()
    assert result.outcome is ProbeOutcome.FAILED and not result.from_cache


async def test_background_polls_take_only_their_share_and_never_starve_requests(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """40 hot workers would want 1,600 polls/s; the budget is 200/s with half for background. Requests
    asking for 4 never-seen workers every 40 ms (100 probes/s) are never refused budget."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    fleet = [fake.add(w) for w in workers(440)]
    hot, cold = fleet[:40], fleet[40:]
    config = refreshing(rate_per_s=200.0, rate_burst=20, refresh_budget_share=0.5, hot_window_s=10.0)
    prober = await start(nursery, fake, config)
    await want(prober, hot, within_s=1.0)  # makes them hot (the burst answers 20 of them)
    await trio.sleep(0.2)
    before = prober.snapshot()
    start_at = trio.current_time()
    answered = 0
    for i in range(50):  # 2 s
        asked = cold[4 * i : 4 * i + 4]
        handle = prober.probe(asked, trio.current_time() + 0.02)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        answered += sum(r.outcome is ProbeOutcome.OK for r in handle.results())
        await want(prober, hot[:1])  # keeps the hot set hot
        await trio.sleep_until(start_at + 0.04 * (i + 1))
    seconds = trio.current_time() - start_at
    after = prober.snapshot()
    assert answered == 200  # every request's own probe got budget in time
    assert after.skipped[SkipReason.NO_BUDGET.value] == before.skipped[SkipReason.NO_BUDGET.value] == 0
    polls = after.refresh_polls - before.refresh_polls
    share = config.refresh_budget_share * config.rate_per_s
    # Background took its share of the rate (its own bucket bounds it from above: rate × share plus
    # its burst), no more, and went short of budget rather than take what requests needed.
    assert share * seconds * 0.8 <= polls <= share * seconds + config.rate_burst * config.refresh_budget_share
    assert after.refresh_short_of_budget > before.refresh_short_of_budget


async def test_requests_probes_go_first_in_the_budget(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    """With requests using the whole rate, background refresh gets no token at all."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    fleet = [fake.add(w) for w in workers(1010)]
    hot, cold = fleet[:10], fleet[10:]
    config = refreshing(rate_per_s=100.0, rate_burst=10, refresh_budget_share=0.5, hot_window_s=10.0)
    prober = await start(nursery, fake, config)
    await want(prober, hot, within_s=1.0)
    await trio.sleep(0.2)
    before = prober.snapshot()
    for i in range(100):  # 2 probes every 10 ms: twice what the budget refills
        handle = prober.probe(cold[2 * i : 2 * i + 2], trio.current_time() + 0.05)
        await want(prober, hot[:1])
        with trio.move_on_after(0.01):
            await handle.wait_all()
    after = prober.snapshot()
    assert after.probes_started - before.probes_started >= 100  # the whole refill went to requests
    assert after.refresh_polls - before.refresh_polls <= 1


async def test_the_owner_applies_state_and_hot_path_reads_use_its_published_view(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork())
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start(nursery, fake, refreshing(background_refresh=False))
    view = prober.view()
    handle = prober.probe([worker], trio.current_time() + 1.0)
    assert prober.view() is view  # the request only asked; nothing changed under it
    await handle.wait_all()
    published = prober.view()
    assert published is not view and published.workers[worker].status is not None
    assert prober.cached(worker) is published.workers[worker].status
    fresh = prober.probe([worker], trio.current_time() + 1.0)
    assert fresh.pending == 0 and fresh.results()[0].from_cache  # from the view, no wait for the owner
    await trio.testing.wait_all_tasks_blocked()
    assert prober.view() is published  # a batch that changed nothing publishes nothing


async def test_the_loop_stops_by_itself_on_cancellation(autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    fleet = [fake.add(w) for w in workers(2)]
    fake.hanging.add(fleet[1].status_target)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            prober = await start(nursery, fake, refreshing())
            await want(prober, fleet[:1])
            await trio.sleep(0.2)  # refreshing fleet[0] in the background
            waiting = prober.probe(fleet[1:], trio.current_time() + 10.0)  # an RPC that hangs
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    health = prober.snapshot()
    assert not health.running and not prober.view().running
    assert (health.inflight, health.waiting_for_budget) == (0, 0)
    assert waiting.results()[0].skip_reason is SkipReason.STOPPED  # the waiter was told, not left hanging
    assert prober.probe(fleet[:1], trio.current_time() + 1.0).pending == 0  # fresh from the last view
    await trio.sleep(1.0)
    assert prober.probe(fleet[:1], trio.current_time() + 1.0).results()[0].skip_reason is SkipReason.STOPPED


async def test_a_restarted_owner_keeps_the_cache_and_serves_again(autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork())
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = WorkerProber(
        refreshing(background_refresh=False, fresh_ttl_s=10.0, max_status_age_s=10.0), WorkerStatusClient(fake.net)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(prober.run)
        await prober.probe([worker], trio.current_time() + 1.0).wait_all()
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        await nursery.start(prober.run)
        assert prober.probe([worker], trio.current_time() + 1.0).results()[0].from_cache
        assert prober.snapshot().running
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("serial", [False, True], ids=["task-per-poll", "serial-rounds"])
async def test_in_steady_state_a_request_makes_one_remote_call(autojump_clock: MockClock, serial: bool) -> None:
    """Through the whole router: after the first request, candidates' statuses are kept fresh in the
    background and a request's only remote call is the KVCM query."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, background_refresh=True, serial_refresh=serial) as (handle, network, _):
        seed(cluster, 2, 8)
        for i in range(5):  # the first requests probe their candidates on demand: nothing is known yet
            await handle.route(RouteRequest(f"first{i}", token_ids=PROMPT, budget_ms=50))
        await trio.testing.wait_all_tasks_blocked()
        registry = handle.metrics.registry
        none_probed = registry.get_sample_value("kvroute_probes_per_request_bucket", {"le": "0.0"}) or 0.0
        prober = handle.prober()
        before = prober.snapshot()
        for i in range(40):
            await trio.sleep(0.01)
            d = await handle.route(RouteRequest(f"r{i}", token_ids=PROMPT, budget_ms=50))
            assert d.route_source is RouteSource.KVCM and d.worker == cluster.worker_addr(2)
            assert d.stage_ms[Stage.PROBE] == 0  # nothing to wait for
        await trio.testing.wait_all_tasks_blocked()
        after = prober.snapshot()
        assert after.probes_started == before.probes_started  # no request probed
        assert after.refresh_polls > before.refresh_polls
        per_request = registry.get_sample_value("kvroute_probes_per_request_bucket", {"le": "0.0"})
        assert per_request == none_probed + 40  # the 40 steady-state requests asked for no probe
        assert registry.get_sample_value("kvroute_worker_status_fresh_from_background_total") == (
            after.fresh_from_background
        )
        assert after.fresh_from_background >= 40 * 2 - 4
        assert registry.get_sample_value("kvroute_probe_background_total", {"kind": "refresh"}) == after.refresh_polls
        assert network.call_count(None, paths.WORKER_GET_STATUS) == before.probes_started + after.refresh_polls


def test_a_hot_window_shorter_than_the_refresh_interval_is_refused_naming_both() -> None:
    config = refreshing(hot_window_s=0.01, refresh_interval_s=0.03)
    assert [p.fields for p in prober_problems(config)] == [("hot_window_s", "refresh_interval_s")]
    with pytest.raises(ValueError, match=r"prober\.hot_window_s, prober\.refresh_interval_s"):
        WorkerProber(config, WorkerStatusClient(MemoryNetwork()))


async def read_every(prober: WorkerProber, fleet: list[WorkerAddr], gap_s: float, for_s: float) -> tuple[int, int]:
    """Requests naming ``fleet`` every ``gap_s`` for ``for_s``: (statuses answered fresh, requests made)."""
    fresh = asked = 0
    end = trio.current_time() + for_s
    while trio.current_time() < end:
        await trio.sleep(gap_s)
        hits, _ = await want(prober, fleet)
        fresh += hits
        asked += len(fleet)
    return fresh, asked


async def test_a_worker_read_often_is_polled_every_refresh_interval(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start(nursery, fake, refreshing(hot_window_s=10.0))
    await want(prober, [worker])  # probed on demand: nothing known yet
    fresh, asked = await read_every(prober, [worker], 0.005, 1.0)
    assert fresh == asked  # every read found a fresh status
    polls = prober.snapshot().refresh_polls
    assert 1.0 / (INTERVAL_S + 0.002) - 1 <= polls <= 1.0 / INTERVAL_S + 1  # the base interval, never faster
    assert prober.snapshot().refresh_idle_skips == 0


async def test_a_worker_no_longer_read_stops_being_polled_long_before_the_hot_window_ends(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    busy, quiet = [fake.add(w) for w in workers(2)]
    config = refreshing(hot_window_s=10.0, refresh_idle_gaps=8.0)
    prober = await start(nursery, fake, config)
    await want(prober, [busy, quiet])
    await read_every(prober, [busy, quiet], 0.005, 0.5)  # both read every 5 ms: usual gap 5 ms
    quiet_rpcs = fake.rpcs(quiet)
    fresh, asked = await read_every(prober, [busy], 0.005, 3.0)  # only `busy` is read now
    assert fresh == asked
    # `quiet`'s keep window is two refresh intervals (8 gaps of 5 ms are less): at most three more polls,
    # where the hot window alone would have polled it for 10 s.
    assert fake.rpcs(quiet) - quiet_rpcs <= 3
    health = prober.snapshot()
    assert health.hot_workers == 2  # still hot (named within the hot window), just not worth a poll
    assert health.refresh_idle_skips > 0
    assert fake.rpcs(busy) >= 3.5 / (INTERVAL_S + 0.002) - 2


async def test_a_worker_read_again_after_idling_gets_a_fresh_status_and_is_polled_again(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start(nursery, fake, refreshing(hot_window_s=10.0))
    await want(prober, [worker])
    await read_every(prober, [worker], 0.005, 0.3)
    await trio.sleep(1.0)  # idle: its polls stop, its status expires
    rpcs = fake.rpcs(worker)
    assert prober.cached(worker) is not None and prober.probe([worker], trio.current_time() + 1.0).pending == 1
    assert fake.rpcs(worker) == rpcs  # (no RPC yet: the probe above is on its way to the owner)
    hits, _ = await want(prober, [worker])  # that request's own probe gave it a fresh status
    assert hits == 0 and prober.snapshot().probes_started == 2
    fresh, asked = await read_every(prober, [worker], 0.005, 0.5)
    assert fresh == asked  # kept fresh in the background again
    assert prober.snapshot().probes_started == 2


async def test_a_worker_read_now_and_then_stays_polled_so_its_reads_find_a_fresh_status(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Reads 200 ms apart: the keep window (8 usual gaps, at most the hot window) covers the gap, so
    each read finds the status a poll fetched, as with the hot window alone."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    (worker,) = [fake.add(w) for w in workers(1)]
    prober = await start(nursery, fake, refreshing(hot_window_s=10.0))
    await want(prober, [worker])
    await read_every(prober, [worker], 0.2, 1.0)  # the usual gap settles near 200 ms
    before = prober.snapshot()
    fresh, asked = await read_every(prober, [worker], 0.2, 2.0)
    after = prober.snapshot()
    assert fresh == asked
    assert after.probes_started == before.probes_started
    assert after.fresh_from_background - before.fresh_from_background == asked


def test_the_keep_window_setting_is_refused_out_of_range_naming_it() -> None:
    problems = prober_problems(refreshing(refresh_idle_gaps=0.0))
    assert [p.fields for p in problems] == [("refresh_idle_gaps",)]


async def test_polls_that_drifted_apart_start_together_again(nursery: trio.Nursery, autojump_clock: MockClock) -> None:
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    first, second = [fake.add(w) for w in workers(2)]
    rounds: list[int] = []
    prober = await start(nursery, fake, refreshing(hot_window_s=10.0), on_probes=lambda kind, n: rounds.append(n))
    await want(prober, [first])
    await trio.sleep(INTERVAL_S / 5)  # the second worker's on-demand probe starts a fifth of an interval later
    await want(prober, [second])
    await read_every(prober, [first, second], 0.005, 0.5)
    # Its first poll was pulled forward into the first worker's round; from then on they share every round.
    assert rounds[:1] == [2]
    assert set(rounds) == {2}


async def test_a_serial_round_ends_within_the_probe_timeout_and_a_hung_worker_goes_last(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A worker that hangs fails by the probe timeout; once it has failed it is polled after the
    others, whose polls still land; polls the round's time did not reach count against nobody."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    fleet = [fake.add(w) for w in workers(3)]
    timeout_s = 0.02
    config = refreshing(serial_refresh=True, probe_timeout_s=timeout_s, hot_window_s=10.0, eject_after_failures=1000)
    prober = await start(nursery, fake, config)  # never ejected: it stays in every round
    await want(prober, fleet)
    hung = fleet[-1]  # the most recently read: first in a round by recency alone
    fake.hanging.add(hung.status_target)
    await read_every(prober, fleet, 0.005, 0.5)
    health = prober.snapshot()
    assert health.failed_by_kind.get("deadline", 0) >= 1
    # Every other worker kept a fresh status: it was polled before the hung one from its first failure on.
    for worker in fleet[:-1]:
        assert prober.cached(worker) is not None
        assert fake.rpcs(worker) >= 0.5 / (INTERVAL_S + timeout_s)
    assert prober.cached(hung) is None
    # The hung worker is not counted as failing more often than it was actually asked.
    assert health.failed_by_kind.get("deadline", 0) <= fake.rpcs(hung)


async def test_a_hung_worker_neither_holds_up_nor_ages_the_rounds_other_statuses(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A serial round waited for a hung worker to its timeout, then stamped every reply with the
    round's end: statuses up to several fresh_ttl_s old were served as fresh, and requests waiting on
    the round's polls waited with them. Two of seven hot workers hang from the start (over the ejection
    cap: nobody is ejected) and a third starts hanging while it is polled in the rounds; every status
    served as fresh must be fresh."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = [fake.add(w) for w in workers(7)]
    late, healthy = fleet[0], fleet[1:5]  # a round polls the most recently wanted first: ``late`` last
    for worker in fleet[5:]:
        fake.hanging.add(worker.status_target)
    prober = await start(nursery, fake, refreshing(serial_refresh=True))
    ages: list[float] = []
    for i in range(400):
        if i == 100:
            fake.hanging.add(late.status_target)  # its next round waits for it to the timeout
        now = trio.current_time()
        handle = prober.probe(fleet, now + 0.01)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        for result in handle.results():
            if result.from_cache and result.worker in healthy and result.status is not None:
                made = fake.replied_at[result.worker.status_target, result.status.waiting_query_len]
                ages.append(now - made)
        await trio.sleep(0.001)  # read often: a round's replies are read in the moment they land
    assert len(ages) > 400 * len(healthy) // 2  # most reads of a healthy worker are fresh from the cache
    assert max(ages) <= FRESH_TTL_S


async def test_a_slow_but_answering_worker_neither_holds_up_nor_ages_the_rounds_other_statuses(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Only a worker whose last poll failed was taken out of the serial round: one answering within
    probe_timeout_s, but slowly, stayed in, and the round's replies landed only when it returned, so
    the other workers' statuses arrived already older than fresh_ttl_s and requests joined to their
    flights were skipped at their deadline."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.001)
    fleet = [fake.add(w) for w in workers(10)]
    slow, fast = fleet[0], fleet[1:]
    fake.slow[slow.status_target] = 0.15  # answers, well within the 200 ms probe timeout
    prober = await start(nursery, fake, refreshing(serial_refresh=True))
    outcomes: dict[ProbeOutcome, int] = {}
    ages: list[float] = []
    for i in range(200):  # a request every 10 ms, each waiting 20 ms at most
        now = trio.current_time()
        handle = prober.probe(fleet, now + 0.02)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        if i >= 20:  # past the first probes on demand
            for result in handle.results():
                if result.worker in fast:
                    outcomes[result.outcome] = outcomes.get(result.outcome, 0) + 1
                    if result.observed_at is not None:
                        ages.append(now - result.observed_at)
        await trio.sleep(0.01)
    assert outcomes == {ProbeOutcome.OK: 180 * len(fast)}
    assert max(ages) < FRESH_TTL_S
    assert prober.cached(slow) is not None  # polled on its own, it is not failing


class _BackgroundNoted(CallWatched):
    """Notes, per call made alone, whether it was made as background work."""

    def __init__(self) -> None:
        super().__init__()
        self.background: list[bool] = []

    async def before(self, target: str, method_path: str, background: bool) -> None:
        self.background.append(background)


async def test_only_a_probe_a_request_waits_for_is_called_as_a_requests_call(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """Over gRPC a background poll's start on an idle channel held the event loop, with every request
    on it, until the thread grpcio starts for the call had the GIL: the transport starts a call it is
    told is background work off the loop."""
    network = _BackgroundNoted()
    fake = FakeWorkers(network, latency_s=0.002)
    fleet = [fake.add(w) for w in workers(3)]
    config = refreshing(serial_refresh=False, health_interval_s=1.0)
    prober: WorkerProber = await nursery.start(
        WorkerProber(config, WorkerStatusClient(fake.net), fleet=lambda: fleet).run
    )
    noted = network.background
    await trio.sleep(0.1)  # the first health pass, its statuses expired since
    assert noted == [True] * prober.snapshot().health_probes != []
    before = len(noted)
    await want(prober, fleet[:2])  # on demand: a request waits for them
    assert noted[before:] == [False, False]
    await trio.sleep(2.5)  # the two hot workers polled, the fleet's health probed again
    health = prober.snapshot()
    assert health.refresh_polls and health.health_probes > before
    assert noted[before + 2 :] == [True] * (health.refresh_polls + health.health_probes - before)


class _SlowToSend(CallWatched):
    """A call that waits ``wait_s`` before it is on its way (for its channel, or a thread to start it on)."""

    def __init__(self, wait_s: float) -> None:
        super().__init__()
        self.wait_s = wait_s

    async def before(self, target: str, method_path: str, background: bool) -> None:
        await trio.sleep(self.wait_s)


@pytest.mark.parametrize("sent_after_s", [0.3, 0.1], ids=["never-sent", "sent-then-hung"])
async def test_a_probe_whose_time_ran_out_before_it_reached_the_worker_is_not_held_against_it(
    nursery: trio.Nursery, autojump_clock: MockClock, sent_after_s: float
) -> None:
    """A background probe waits for a starter thread over gRPC, and any probe for its channel: a wait
    past probe_timeout_s counted as the worker's own timeout, and enough of them ejected a worker that
    was never asked."""
    network = _SlowToSend(sent_after_s)
    fake = FakeWorkers(network)
    [worker] = [fake.add(w) for w in workers(1)]
    fake.hanging.add(worker.status_target)  # once it has the request, it never answers
    config = dataclasses.replace(ProberConfig(), probe_timeout_s=0.2, eject_after_failures=1)
    prober = await start(nursery, fake, config)
    handle = prober.probe([worker], trio.current_time() + 1.0)
    await handle.wait_all()
    [result] = handle.results()
    health = prober.snapshot()
    if sent_after_s < config.probe_timeout_s:  # on its way, then no answer in time: the worker's timeout
        assert result.outcome is ProbeOutcome.FAILED and health.failed_by_kind == {"probe_timeout": 1}
        assert health.failing == 1
    else:  # its time ran out before it was sent: skipped as for want of budget, nothing held against it
        assert result.skip_reason is SkipReason.NO_BUDGET and health.probes_failed == 0
        assert health.failing == 0 and not health.ejected_until
        assert fake.rpcs(worker) == 0


async def _probe_one_worker(
    nursery: trio.Nursery, network: MemoryNetwork, *, latency_s: float
) -> tuple[ProbeResult, ProberHealth]:
    """One request's probe of one worker over ``network``, a 200 ms probe timeout and ejection at the
    first failure: its result, and the prober's health after it."""
    fake = FakeWorkers(network, latency_s=latency_s)
    [worker] = [fake.add(w) for w in workers(1)]
    config = dataclasses.replace(ProberConfig(), probe_timeout_s=0.2, eject_after_failures=1)
    prober = await start(nursery, fake, config)
    handle = prober.probe([worker], trio.current_time() + 1.0)
    await handle.wait_all()
    [result] = handle.results()
    return result, prober.snapshot()


@pytest.mark.parametrize("large", [False, True], ids=["small-reply", "large-reply"])
async def test_a_reply_in_hand_when_the_probes_time_ran_out_is_not_held_against_the_worker(
    nursery: trio.Nursery, autojump_clock: MockClock, large: bool
) -> None:
    """A reply larger than LARGE_REPLY_BYTES is decoded on a thread, and the hop there is a checkpoint:
    with probe_timeout_s gone meanwhile (this thread stalled with the reply in hand, or the reply waited
    for a decode thread) the reply was dropped and counted as the worker's probe_timeout, and
    eject_after_failures of them ejected a worker that had answered in time. A small reply decodes at
    once and is kept."""
    network = StalledOnTheReply(autojump_clock, LARGE_REPLY_BYTES + 1 if large else 0, stall_s=0.3)
    result, health = await _probe_one_worker(nursery, network, latency_s=0.002)
    assert health.probes_failed == 0 and health.failing == 0 and not health.ejected_until, health
    if large:  # no status to use, and nothing against the worker
        assert result.outcome is ProbeOutcome.SKIPPED and result.skip_reason is SkipReason.DEADLINE
        assert health.skipped[SkipReason.DEADLINE.value] == 1
    else:
        assert result.outcome is ProbeOutcome.OK


async def test_a_worker_has_probe_timeout_s_from_the_sending_however_long_the_wait_before_it(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A probe that waited most of probe_timeout_s for its channel or a starter thread left the worker
    the rest: a healthy worker answering in 10 ms after a 195 ms wait was counted timed out, and
    ejected at eject_after_failures."""
    result, health = await _probe_one_worker(nursery, _SlowToSend(0.195), latency_s=0.01)
    assert result.outcome is ProbeOutcome.OK, (result, health.failed_by_kind)
    assert health.probes_failed == 0


class _SlowRoundStart(CallWatched):
    """A serial round that waits ``setup_s`` before its first call (its leases, a thread to run on),
    timing each call from before that wait, as the gRPC adapter does; counts the calls made alone."""

    def __init__(self, setup_s: float) -> None:
        super().__init__()
        self.setup_s = setup_s
        self.alone = 0

    async def before(self, target: str, method_path: str, background: bool) -> None:
        self.alone += 1

    async def call_in_turn(self, calls: Sequence[InTurnCall], within_s: float) -> list[InTurnReply]:
        await trio.sleep(self.setup_s)
        replies = []
        for call in calls:  # the in-turn calls are not counted as made alone
            began = trio.current_time()
            outcome = await MemoryNetwork.call(self, call.target, call.method_path, call.request)
            replies.append((outcome, began))
        start = replies[0][1] - self.setup_s if replies else trio.current_time()
        ended = trio.current_time()
        return [InTurnReply(outcome, ended - start, began - start) for outcome, began in replies]


async def test_a_rounds_start_up_is_not_charged_to_its_first_worker(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A serial round's replies were timed from before its leases and its wait for a thread: the
    first worker's call took that too, read as slow, and the worker was polled alone the next round,
    then rejoined, and the next first worker went alone instead. The call's own start is used now."""
    network = _SlowRoundStart(setup_s=0.015)  # beyond the 12.5 ms a poll may take in the round here
    fake = FakeWorkers(network, latency_s=0.001)
    fleet = [fake.add(w) for w in workers(8)]
    prober = await start(nursery, fake, refreshing(serial_refresh=True))
    for i in range(100):  # a request every 10 ms
        if i == 20:  # past the first probes on demand
            network.alone = 0
        handle = prober.probe(fleet, trio.current_time() + 0.02)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        await trio.sleep(0.01)
    assert network.alone == 0
    assert prober.snapshot().refresh_polls > 0
    # A polled status is taken when its own call was sent (one after another, 1 ms apart), not when
    # the round began its 15 ms set-up; here every reply of a round lands at the round's end.
    polled = [r for r in handle.results() if r.background]
    sent = sorted(r.sent_at for r in polled if r.sent_at is not None)
    assert len(sent) == len(fleet) and all(b - a == pytest.approx(0.001) for a, b in itertools.pairwise(sent))
    longest = len(fleet) * 0.001 + 1e-9
    assert all(
        r.observed_at is not None and r.sent_at is not None and 0 < r.observed_at - r.sent_at <= longest for r in polled
    )


async def test_a_request_planned_before_a_retain_does_not_bring_back_the_workers_it_dropped(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """The retain mailbox is applied before the next message, so it overtook a request sent before it:
    two workers gone from discovery were tracked again, hot and failing, until the next discovery
    change, and on a fleet of ten that was a collective failure for good (no outlier ejected)."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = [fake.add(w) for w in workers(12)]
    live, gone = fleet[:10], fleet[10:]
    prober = await start(nursery, fake, refreshing())
    for worker in gone:
        fake.net.stop(worker.status_target)  # two workers die and leave discovery
    stale = prober.probe(live[:2] + gone, trio.current_time() + 0.05)  # planned on the old snapshot
    prober.retain(live)  # the next request sees the new snapshot, before the owner ran
    with trio.move_on_at(stale.deadline):
        await stale.wait_all()
    skipped = {r.worker: r.skip_reason for r in stale.results() if r.worker in gone}
    assert skipped == dict.fromkeys(gone, SkipReason.GONE)
    for _ in range(100):
        handle = prober.probe(live, trio.current_time() + 0.01)
        with trio.move_on_at(handle.deadline):
            await handle.wait_all()
        await trio.sleep(0.01)
    assert not any(worker in prober.view().workers for worker in gone)
    snapshot = prober.snapshot()
    assert (snapshot.failing, snapshot.collective_failure) == (0, False)


async def test_polls_a_round_did_not_reach_give_back_their_refresh_tokens_too(
    nursery: trio.Nursery, autojump_clock: MockClock
) -> None:
    """A poll the round's time did not reach took a token of the rate and one of the refresh share;
    only the first came back, so a hung worker first in a round drained the refresh share."""
    fake = FakeWorkers(MemoryNetwork(), latency_s=0.002)
    fleet = [fake.add(w) for w in workers(4)]
    # A slow refill, so what comes back shows: 0.05 tokens/s for refresh polls, a burst of 8.
    config = refreshing(serial_refresh=True, rate_per_s=0.1, rate_burst=16, refresh_budget_share=0.5)
    prober = await start(nursery, fake, config)
    prober.probe(fleet, trio.current_time() + 0.05)  # every worker hot, the last named polled first
    await trio.sleep(0.01)  # the on-demand probes landed
    fake.hanging.add(fleet[-1].status_target)  # the first of the next round takes all of its time
    before = prober._refresh_bucket.peek(trio.current_time())
    await trio.sleep(INTERVAL_S + config.probe_timeout_s + 0.01)  # one round, to its end
    after = prober._refresh_bucket.peek(trio.current_time())
    assert before - after == pytest.approx(1.0, abs=0.05)  # the hung poll's token; the three not made came back

