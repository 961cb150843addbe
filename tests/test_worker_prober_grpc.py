"""WorkerProber over real loopback gRPC against SimWorkers (issue 3, required test 9 for test 5).

REAL clock, never MockClock: each test bounds itself with ``trio.fail_after``. Every
worker is a SimWorker on its own gRPC server on 127.0.0.1:0; the only test-side
addition is one fleet-wide CallStats, so concurrency is counted across all servers.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
import trio

from actors.channel_pool import ChannelPool
from actors.worker_prober import ProbeOutcome, SkipReason, WorkerProber
from kvroute_sim.sim.faults import CallPlan, CallStats
from kvroute_sim.sim.grpc_server import serve_endpoint
from kvroute_sim.sim.worker import WORKER_METHODS, SimWorker, WorkerFaults
from router.config import ChannelPoolConfig, ProberConfig
from router.transport.clients import WorkerStatusClient
from router.transport.grpc_adapter import GrpcRawRpc
from router.types import WorkerAddr
from router.wire import paths

FLEET = 200
CAP = 16
# Generous: on a loaded machine the first probes also set up 200 connections, and a probe held at a
# server (hang) must outlast the request window it is held through.
PROBE_TIMEOUT_S = 10.0
DELAY_S = 0.05  # every live worker answers after 50 ms, so 16 slots stay busy
HELD = slice(4, 4 + CAP)  # healthy workers (0-3 carry faults) whose probes hold every slot


class FleetCounted:
    """A SimWorker served unchanged, its calls counted in one CallStats shared by the fleet."""

    def __init__(self, worker: SimWorker, fleet_stats: CallStats) -> None:
        self._worker = worker
        self._fleet_stats = fleet_stats

    @property
    def methods(self) -> frozenset[str]:
        return self._worker.methods

    @property
    def stats(self) -> CallStats:
        return self._fleet_stats

    def plan(self, method_path: str, now: float) -> CallPlan:
        return self._worker.plan(method_path, now)

    def answer(self, method_path: str, request: bytes, now: float) -> bytes:
        return self._worker.answer(method_path, request, now)

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        return self._worker.subscribe(wake)


@dataclass
class Fleet:
    addrs: list[WorkerAddr]
    sims: list[SimWorker]
    stats: CallStats
    prober: WorkerProber


@pytest.fixture
async def fleet(nursery: trio.Nursery) -> AsyncIterator[Fleet]:
    stats = CallStats(WORKER_METHODS)
    sims = [SimWorker(f"worker-{i}") for i in range(FLEET)]
    for sim in sims:
        sim.set_faults(WorkerFaults(delay_s=DELAY_S))
    # Faults switched on: two dead workers, one answering without a status, one not alive.
    sims[0].set_faults(WorkerFaults(dead=True))
    sims[1].set_faults(WorkerFaults(dead=True))
    sims[2].set_faults(WorkerFaults(delay_s=DELAY_S, status_version_zero=True))
    sims[3].set_faults(WorkerFaults(delay_s=DELAY_S, not_alive=True))
    addrs: list[WorkerAddr | None] = [None] * FLEET

    async def serve(i: int) -> None:
        endpoint = FleetCounted(sims[i], stats)
        server = await nursery.start(functools.partial(serve_endpoint, endpoint, max_threads=2))
        addrs[i] = WorkerAddr.from_http(server.host, server.port - 1)  # status port = http + 1

    with trio.fail_after(30):
        async with trio.open_nursery() as starting:
            for i in range(FLEET):
                starting.start_soon(serve, i)
    pool: ChannelPool[grpc.Channel] = ChannelPool(ChannelPoolConfig())
    await nursery.start(pool.run)
    config = ProberConfig(
        inflight_cap=CAP,
        rate_per_s=1e6,
        rate_burst=1000,
        probe_timeout_s=PROBE_TIMEOUT_S,
        background_refresh=False,  # the requests' own probes are under test
    )
    prober = WorkerProber(config, WorkerStatusClient(GrpcRawRpc(pool, start_off_loop=True)))
    await nursery.start(prober.run)
    yield Fleet([a for a in addrs if a is not None], sims, stats, prober)
    await pool.aclose()


async def test_inflight_cap_is_exact_at_real_servers(fleet: Fleet) -> None:
    # The held workers answer only once the servers have seen every slot taken: 50 ms answers alone
    # let the first probes end before a loaded machine has started the sixteenth. A deadline far
    # beyond them: a probe skipped at it would change the counts this test is about.
    held_sims = fleet.sims[HELD]
    for sim in held_sims:
        sim.set_faults(WorkerFaults(hang=True))
    with trio.fail_after(PROBE_TIMEOUT_S + 20.0):
        handle = fleet.prober.probe(fleet.addrs, trio.current_time() + PROBE_TIMEOUT_S + 15.0)
        reached = await trio.to_thread.run_sync(fleet.stats.wait_in_flight, paths.WORKER_GET_STATUS, CAP, 15.0)
        assert reached  # every slot is taken by a call at its server
        for sim in held_sims:
            sim.set_faults(WorkerFaults(delay_s=DELAY_S))
        await handle.wait_all()
    outcomes: dict[object, int] = {}
    for r in handle.results():
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    assert outcomes == {ProbeOutcome.OK: FLEET - 3, ProbeOutcome.FAILED: 2, ProbeOutcome.NO_STATUS: 1}
    assert {r.error_kind for r in handle.results() if r.outcome is ProbeOutcome.FAILED} == {"unavailable"}
    status = handle.statuses()[fleet.addrs[3]]
    assert not status.alive and status.status_version > 0
    served = fleet.stats.get(paths.WORKER_GET_STATUS)
    assert served.calls == FLEET
    assert served.peak_in_flight == CAP  # both bounds, counted at the servers
    assert fleet.prober.snapshot().peak_inflight == CAP


async def test_request_waiting_for_budget_is_skipped_at_its_deadline(fleet: Fleet) -> None:
    """A request whose workers wait for an in-flight slot is answered at its deadline: those probes are
    skipped (no budget) and never reach a server; probes already in flight go on and are counted once.

    Every slot is held by a first request's probes, which hang at their servers until released, so
    the second request's window cannot free one however fast or slow the machine runs; the window's
    length only gives a stalled process time to hand the request to the prober. Exact on-time
    bounds are asserted under MockClock in test_worker_prober.py.
    """
    held_sims, held = fleet.sims[HELD], fleet.addrs[HELD]
    with trio.fail_after(30):
        for sim in held_sims:
            sim.set_faults(WorkerFaults(hang=True))
        holder = fleet.prober.probe(held, trio.current_time() + 8.0)
        reached = await trio.to_thread.run_sync(fleet.stats.wait_in_flight, paths.WORKER_GET_STATUS, CAP, 5.0)
        assert reached  # every slot is taken by a call held at its server
        before = fleet.prober.snapshot()
        assert (before.inflight, before.waiting_for_budget) == (CAP, 0)

        deadline = trio.current_time() + 1.0
        handle = fleet.prober.probe(fleet.addrs, deadline)
        with trio.move_on_at(deadline) as window:
            await handle.wait_all()
        assert window.cancelled_caught
        results = handle.results()
        answered = sum(r.outcome is not ProbeOutcome.SKIPPED for r in results)
        no_budget = {r.worker for r in results if r.skip_reason is SkipReason.NO_BUDGET}
        in_flight = {r.worker for r in results if r.skip_reason is SkipReason.DEADLINE}
        print(f"at the deadline: {answered} answered, {len(in_flight)} in flight, {len(no_budget)} skipped (no budget)")
        assert answered == 0
        assert in_flight == set(held)  # joined the held probes, in flight at the deadline
        assert no_budget == set(fleet.addrs) - set(held)

        # The waiting probes end at the deadline by themselves, while every slot is still held.
        skipped = 0
        async for result in handle:
            if result.skip_reason is SkipReason.NO_BUDGET:
                skipped += 1
                if skipped == FLEET - CAP:
                    break
        health = fleet.prober.snapshot()
        assert (health.inflight, health.waiting_for_budget) == (CAP, 0)
        assert fleet.stats.get(paths.WORKER_GET_STATUS).in_flight == CAP

        for sim in held_sims:
            sim.set_faults(WorkerFaults(delay_s=DELAY_S))  # release the held calls: they answer now
        await holder.wait_all()
        await handle.wait_all()  # the prober is idle: every probe landed

    assert [r.outcome for r in holder.results()] == [ProbeOutcome.OK] * CAP
    assert {r.worker for r in handle.results() if r.outcome is ProbeOutcome.OK} == set(held)  # the same probes
    health = fleet.prober.snapshot()
    served = fleet.stats.get(paths.WORKER_GET_STATUS)
    # Every probe that got budget made one RPC; the rest never reached a server.
    assert (served.calls, served.in_flight, served.peak_in_flight) == (CAP, 0, CAP)
    assert health.probes_ok - before.probes_ok == CAP
    assert health.probes_started == FLEET  # the held workers' probes were shared, not started twice
    skipped_total = health.skipped[SkipReason.NO_BUDGET.value] - before.skipped.get(SkipReason.NO_BUDGET.value, 0)
    assert skipped_total == FLEET - CAP
    assert (health.inflight, health.waiting_for_budget, health.peak_inflight) == (0, 0, CAP)


class SlowToLease:
    """The real pool, each lease taking ``wait_s`` first: a channel slow to open."""

    def __init__(self, pool: ChannelPool[grpc.Channel], wait_s: float) -> None:
        self._pool = pool
        self._wait_s = wait_s

    @asynccontextmanager
    async def lease(self, target: str) -> AsyncIterator[grpc.Channel]:
        await trio.sleep(self._wait_s)
        async with self._pool.lease(target) as channel:
            yield channel

    def lease_nowait(self, target: str) -> AbstractContextManager[grpc.Channel] | None:
        return None

    def invalidate(self, target: str, channel: object | None = None) -> None:
        self._pool.invalidate(target, channel)


async def test_a_probe_that_waited_for_its_channel_gives_the_worker_its_whole_timeout(nursery: trio.Nursery) -> None:
    """The prober gives a worker ``probe_timeout_s`` from the probe's sending, but grpc's own deadline
    was set from what was left after the lease: 4.9 s of a 5 s timeout spent opening the channel left
    the worker 0.1 s on the wire, and a worker answering in 0.2 s was counted failed (``deadline``).
    With the fix it has 5 s from the sending: room for a busy machine's stalls."""
    sim = SimWorker("slow-to-reach")
    sim.set_faults(WorkerFaults(delay_s=0.2))
    server = await nursery.start(functools.partial(serve_endpoint, sim, max_threads=2))
    worker = WorkerAddr.from_http(server.host, server.port - 1)
    pool: ChannelPool[grpc.Channel] = ChannelPool(ChannelPoolConfig())
    await nursery.start(pool.run)
    config = ProberConfig(probe_timeout_s=5.0, background_refresh=False)
    rpc = GrpcRawRpc(SlowToLease(pool, wait_s=4.9), start_off_loop=True)
    prober = WorkerProber(config, WorkerStatusClient(rpc))
    await nursery.start(prober.run)
    with trio.fail_after(30):
        handle = prober.probe([worker], trio.current_time() + 10.0)
        await handle.wait_all()
    [result] = handle.results()
    await pool.aclose()
    assert result.outcome is ProbeOutcome.OK, (result, prober.snapshot().last_errors)
