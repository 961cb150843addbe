"""Supervision: each actor crashed once is recorded and restarted, and decisions keep coming in time;
the channel pool (started only with real gRPC) crashed with leases out keeps counting them.

MockClock + MemoryNetwork (in-memory SimCluster); the crash is raised inside the actor's own task tree.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from actors.channel_pool import ChannelPool
from kvroute_sim.sim.cluster import SimCluster
from router.api import open_router
from router.config import ChannelPoolConfig, DeploymentConfig, DiscoveryConfig, KvrouteConfig
from router.keys import block_keys
from router.supervisor import RouterHandle, Supervisor
from router.transport.memory_adapter import MemoryNetwork
from router.types import KeyFamily, Reason, RouteRequest, RouteSource

BLOCK = 16
PROMPT = tuple(range(4 * BLOCK))
ACTORS = (
    "metrics_sink",
    "discovery",
    "leader_resolver",
    "worker_prober",
    "shadow_index",
    "scorer",
    "hit_accuracy",
    "router",
)


@asynccontextmanager
async def _routing() -> AsyncIterator[RouterHandle]:
    """A router over an in-memory cluster whose worker 1 holds PROMPT, its KVCM leader known."""
    cluster = SimCluster(workers=3, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.fail_after(1):
            await resolver.leader()
        yield handle


async def run_until_it_crashes(
    run: Callable[..., Awaitable[object]],
    crashed: list[BaseException],
    *,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED,
) -> None:
    """An actor's ``run`` started as the supervisor starts it (``nursery.start``), the RuntimeErrors a
    crash raises out of its nursery kept in ``crashed`` rather than raised."""
    try:
        await run(task_status=task_status)
    except* RuntimeError as group:
        crashed.extend(group.exceptions)


async def _until_the_router_runs(handle: RouterHandle) -> None:
    while handle.actors_health()["router"]["state"] != "running":  # noqa: ASYNC110 (no event for it)
        await trio.sleep(0.001)
    await trio.testing.wait_all_tasks_blocked()


async def _crash_the_router_in_a_row(handle: RouterHandle, times: int) -> None:
    """Crash the router's task ``times`` times, each as soon as it runs again: its backoff grows."""
    for _ in range(times):
        await _until_the_router_runs(handle)
        handle.supervisor.inject_crash("router")
        await trio.testing.wait_all_tasks_blocked()


@pytest.mark.parametrize("actor", ACTORS)
async def test_crashed_actor_restarts_and_routing_continues(actor: str, autojump_clock: trio.testing.MockClock) -> None:
    async with _routing() as handle:
        assert handle.actors_health()[actor]["state"] == "running"
        handle.supervisor.inject_crash(actor)
        sources = []
        for i in range(40):
            start = trio.current_time()
            decision = await handle.route(RouteRequest(f"{actor}-{i}", token_ids=PROMPT, budget_ms=20))
            # deadline + the route() grace at most, and always a worker.
            assert trio.current_time() - start <= 0.020 + 0.002 + 1e-9
            assert decision.worker is not None
            sources.append(decision.route_source)
            await trio.sleep(0.01)
        view = handle.actors_health()[actor]
        assert view["restarts"] == 1
        assert view["state"] == "running"
        assert "injected crash" in str(view["last_error"])
        # Back to cache-aware routing once the actor is up again.
        assert sources[-1] is RouteSource.KVCM
        others = {name: v["restarts"] for name, v in handle.actors_health().items() if name != actor}
        assert set(others.values()) == {0}


async def test_requests_while_the_scorer_restarts_fall_back_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """Between a Scorer crash and its restart (its backoff), a decision was queued in an inbox nobody
    read: every cache-path request waited out its whole budget, then fell back. It fails at once now,
    as a request finding the prober or the resolver down does."""
    async with _routing() as handle:
        handle.supervisor.inject_crash("scorer")
        await trio.testing.wait_all_tasks_blocked()
        assert handle.actors_health()["scorer"]["state"] == "restarting"
        start = trio.current_time()
        decision = await handle.route(RouteRequest("while-down", token_ids=PROMPT, budget_ms=30))
        assert trio.current_time() == start  # not its 30 ms budget
        assert decision.worker is not None and decision.reason is Reason.INTERNAL_ERROR
        await trio.sleep(1.0)  # past the restart's backoff
        assert handle.actors_health()["scorer"]["state"] == "running"
        after = await handle.route(RouteRequest("after", token_ids=PROMPT, budget_ms=30))
        assert after.route_source is RouteSource.KVCM


async def test_requests_while_the_router_task_restarts_take_no_lag_from_its_dead_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The router's own task, crashed while its lag probe waited as for an idle loop, left that wait
    published: a request during the restart's backoff took a lag sample from it (its due, however long
    ago), and nothing aged the estimate until the restart, so every request was shed overloaded."""
    async with _routing() as handle:
        first = await handle.route(RouteRequest("before", token_ids=PROMPT, budget_ms=30))
        assert first.route_source is RouteSource.KVCM
        await trio.sleep(1.0)  # idle: the lag probe waits as for an idle loop
        await _crash_the_router_in_a_row(handle, 5)  # the backoff grows to 0.8 s
        assert handle.actors_health()["router"]["state"] == "restarting"
        await trio.sleep(0.7)  # within the backoff
        decisions = [
            await handle.route(RouteRequest(f"during-{i}", token_ids=PROMPT, budget_ms=30)) for i in range(2)
        ]
        assert all(d.reason is not Reason.OVERLOADED for d in decisions), [d.reason for d in decisions]


async def test_while_the_router_task_restarts_requests_age_the_lag_a_stall_left(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only the lag probe aged the admission estimate, and it is down with the router's task: an
    estimate a stall had left high just before a crash shed every request until the restart, in a
    crash loop for seconds. The requests that come age it meanwhile, as the probes would have."""
    async with _routing() as handle:
        await handle.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=30))
        await _crash_the_router_in_a_row(handle, 5)  # the next backoff is 1.6 s
        await _until_the_router_runs(handle)
        autojump_clock.jump(2.0)  # the loop stalls: the lag probe's timer fires late by most of two seconds
        await trio.testing.wait_all_tasks_blocked()
        handle.supervisor.inject_crash("router")
        await trio.testing.wait_all_tasks_blocked()
        shed: list[int] = []
        for i in range(100):  # a request every 10 ms for a second, the router's task down throughout
            decision = await handle.route(RouteRequest(f"during-{i}", token_ids=PROMPT, budget_ms=30))
            if decision.reason is Reason.OVERLOADED:
                shed.append(i)
            await trio.sleep(0.01)
        assert handle.actors_health()["router"]["state"] == "restarting"
        # Aged at a running probe's pace (as many of these are shed with it running), not shed until the
        # restart.
        assert shed and max(shed) < 30, f"{len(shed)} shed, the last at {max(shed)}"


class _Channel:
    def __init__(self, target: str) -> None:
        self.target = target
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


async def test_crashed_channel_pool_restarts_with_its_leases_counted(autojump_clock: trio.testing.MockClock) -> None:
    """The pool is started only with real gRPC; here with fake channels, under the same supervisor."""
    opened: list[_Channel] = []

    def factory(target: str) -> _Channel:
        opened.append(_Channel(target))
        return opened[-1]

    pool = ChannelPool(ChannelPoolConfig(idle_expiry_s=60.0), factory)
    async with trio.open_nursery() as services:
        supervisor = Supervisor(services)
        await supervisor.start("channel_pool", pool.run, snapshot=pool.snapshot)
        held = pool.lease("a.example:1")
        channel = await held.__aenter__()
        supervisor.inject_crash("channel_pool")
        await trio.testing.wait_all_tasks_blocked()
        async with pool.lease("a.example:1") as again:  # warm: leased while the task is down, no wait
            assert again is channel
        pool.invalidate("a.example:1")  # waits in the inbox for the restarted task
        await trio.sleep(1)  # past the restart backoff
        view = supervisor.views()["channel_pool"]
        assert (view["state"], view["restarts"]) == ("running", 1)
        crashed_at = view["last_error_at"]
        assert isinstance(crashed_at, float)
        assert view["last_error_age_s"] == round(trio.current_time() - crashed_at, 3) >= 1  # slept 1 s since
        snap = pool.snapshot()
        assert (snap.leased, snap.draining, snap.size, snap.inbox_depth) == (1, 1, 0, 0)
        assert channel.closes == 0  # evicted, but still leased
        await held.__aexit__(None, None, None)
        await trio.testing.wait_all_tasks_blocked()
        assert channel.closes == 1
        async with pool.lease("a.example:1") as fresh:  # cold: opened by the restarted task
            assert fresh is not channel
        await trio.sleep(61)  # the restarted task still sweeps idle channels
        assert fresh.closes == 1
        services.cancel_scope.cancel()
    await pool.aclose()


async def test_restarts_failing_at_start_up_back_off_after_a_stable_run(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The backoff reset compared with the last start that succeeded: once it was 30 s old, every
    restart failing at start-up reset the backoff, and the actor was restarted 20 times a second."""
    attempts: list[float] = []

    async def actor(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        attempts.append(trio.current_time())
        if len(attempts) == 1:
            task_status.started()
            await trio.sleep(40)  # a stable run
            raise RuntimeError("crash after a stable run")
        raise RuntimeError("start-up failure")  # every restart fails before it has started

    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(nursery)
        await supervisor.start("flaky", actor)
        await trio.sleep(100)
        nursery.cancel_scope.cancel()
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts[1:])]
    assert all(later >= earlier - 1e-6 for earlier, later in itertools.pairwise(gaps)), gaps  # never reset
    assert len(attempts) < 40, len(attempts)



async def test_an_actor_crashing_right_after_each_start_restarts_with_a_growing_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only an incarnation that ran stably resets the backoff: one crashing right after each start is a
    crash loop, restarted less and less often, not at the initial backoff (20 times a second) for ever."""
    starts: list[float] = []

    async def actor(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        starts.append(trio.current_time())
        task_status.started()
        await trio.lowlevel.checkpoint()  # it runs, then crashes
        raise RuntimeError("crash right after starting")

    async with trio.open_nursery() as nursery:
        supervisor = Supervisor(nursery)
        await supervisor.start("crashing", actor)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert all(later > earlier for earlier, later in itertools.pairwise(gaps)), gaps  # doubling, never reset
    assert 3 <= len(starts) <= 6, starts
    assert supervisor.records["crashing"].restarts == len(starts)  # each start crashed


@pytest.mark.parametrize("leaving", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
async def test_a_body_leaving_by_a_base_exception_gets_it_back_unwrapped(
    leaving: BaseException, autojump_clock: trio.testing.MockClock
) -> None:
    """A frontend's sys.exit(3) inside open_router comes out as SystemExit(3), as an ordinary error
    does, not wrapped in the actors' nursery's BaseExceptionGroup."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    with pytest.raises(type(leaving)) as raised:
        async with open_router(config, rpc=network):
            await trio.sleep(0.05)
            raise leaving
    assert raised.value is leaving
