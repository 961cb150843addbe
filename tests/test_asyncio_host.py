"""Way in #2, the asyncio host, from real asyncio programs against SimCluster over loopback gRPC.

The cluster is served from the test's trio run (real clock, absolute trio.fail_after); each asyncio
program runs with ``asyncio.run`` on a worker thread (``trio.to_thread``), the way a frontend's
event loop would run beside kvroute's trio thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import httpx
import outcome
import pytest
import trio

from kvroute_sim.sim.cluster import SimCluster, SimClusterAddresses
from kvroute_sim.sim.kvcm import KvcmFaults
from router import asyncio_host
from router.admission import InFlightLimit
from router.api import RouterHandle, open_router
from router.asyncio_host import AnswerTimeout, AsyncioRouterHost, HostStats, HostStopped
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig, RouterConfig
from router.keys import block_keys
from router.problems import ConfigError
from router.receipt import INITIAL_IN_FLIGHT_LIMIT, HandOffGate
from router.replay import load_log
from router.types import KeyFamily, Reason, Role, RouteDecision, RouteRequest, RouteSource

BLOCK = 16
PROMPT = tuple(range(3000, 3000 + 6 * BLOCK))
# The routers' cap, and the budget of every call that must be KVCM's: on a busy machine admission
# sheds a call whose budget cannot cover the expected pipeline (answered domain/overloaded).
CAP_MS = 1000.0


def _config(addrs: SimClusterAddresses) -> KvrouteConfig:
    return KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK, kvcm_instance_id="test"),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
        router=RouterConfig(budget_cap_ms=CAP_MS),
    )


def _left_since(baseline: set[threading.Thread]) -> set[threading.Thread]:
    """Threads started since ``baseline`` still alive once grpcio's have ended: a closed channel's spin
    thread (grpcio names its threads "Thread-N (_run)") exits on its own shortly after the close, so
    the threads not named by kvroute are joined first, 5 s at most; one left behind stays in the result."""
    deadline = time.monotonic() + 5.0
    for thread in _threads() - baseline:
        if not thread.name.startswith("kvroute"):
            thread.join(max(0.0, deadline - time.monotonic()))
    return _threads() - baseline


def _threads() -> set[threading.Thread]:
    """Live threads, except the simulated peers' gRPC handler pools (they grow on demand) and trio's
    process-wide cache of idle worker threads ("Trio thread N": any ``trio.to_thread`` call, such as a
    serial refresh round, leaves one for reuse, and it exits by itself after 10 s idle)."""
    return {
        t
        for t in threading.enumerate()
        if not t.name.startswith("kvroute-grpc-server") and not t.name.startswith("Trio thread")
    }


async def _run_asyncio(program: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``program`` as its own asyncio program (asyncio.run) on a thread; abandoned on cancel, so a
    test's ``fail_after`` ends a program that hangs instead of hanging the run."""
    await trio.to_thread.run_sync(lambda: asyncio.run(program()), abandon_on_cancel=True)


def _hold(token: trio.lowlevel.TrioToken) -> threading.Event:
    """Hold the host's trio thread (in a callback it runs) until the returned event is set; the hold
    is running when this returns."""
    holding, gate = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait(10.0)

    token.run_sync_soon(hold)
    assert holding.wait(10.0)
    return gate


@contextlib.asynccontextmanager
async def _warm_with_its_thread_held(
    addrs: SimClusterAddresses,
) -> AsyncIterator[tuple[AsyncioRouterHost, threading.Event]]:
    """A started host, warmed by one call, whose trio thread is then held (``_hold``) until the body
    sets the gate or ends."""
    async with AsyncioRouterHost(_config(addrs)) as host:
        await host.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=500))
        token = host._token
        assert token is not None
        gate = _hold(token)
        try:
            yield host, gate
        finally:
            gate.set()


async def _seeded_cluster(nursery: trio.Nursery) -> tuple[SimCluster, SimClusterAddresses]:
    cluster = SimCluster(workers=4, kvcm_replicas=2, block_size=BLOCK)
    addrs = await nursery.start(cluster.serve_grpc)
    cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
    return cluster, addrs


async def test_asyncio_program_routes_concurrently_and_leaves_no_thread(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        cluster, addrs = await _seeded_cluster(nursery)
        holder = cluster.worker_addr(1)
        decisions: list[RouteDecision] = []
        threads: list[set[threading.Thread]] = []  # before start, while running, after stop

        async def program() -> None:
            threads.append(_threads())
            async with AsyncioRouterHost(_config(addrs)) as host:
                threads.append(_threads())
                decisions.append(await host.route(RouteRequest("first", token_ids=PROMPT, budget_ms=CAP_MS)))
                decisions.extend(
                    await asyncio.gather(
                        *(host.route(RouteRequest(f"r{i}", token_ids=PROMPT, budget_ms=CAP_MS)) for i in range(50))
                    )
                )
            threads.append(_threads())

        await _run_asyncio(program)
        assert [d.request_id for d in decisions] == ["first"] + [f"r{i}" for i in range(50)]
        # The first request, alone, finds the seeded holder through KVCM by cache affinity.
        first = decisions[0]
        assert (first.route_source, first.reason) == (RouteSource.KVCM, Reason.CACHE_LEADER), first
        assert first.worker == holder
        # Every call of the burst is answered with a worker; which source answered each is the
        # machine's (on a starved one some are shed or decided at their deadline without KVCM).
        assert all(isinstance(d, RouteDecision) and d.worker is not None for d in decisions), decisions
        baseline, during, after = threads
        assert {t.name for t in during - baseline} >= {"kvroute-router"}  # the router's thread ran ...
        assert not _left_since(baseline), after - baseline  # ... and nothing of it is left


async def test_a_deadline_on_the_callers_loop_clock_bounds_the_decision(nursery: trio.Nursery) -> None:
    """The caller's own deadline reaches the router: one already past is answered at once by the
    deadline fallback (not by KVCM, which would have answered within the budget)."""
    with trio.fail_after(20):
        _cluster, addrs = await _seeded_cluster(nursery)
        decisions: list[RouteDecision] = []

        async def program() -> None:
            async with AsyncioRouterHost(_config(addrs)) as host:
                request = RouteRequest("warm", token_ids=PROMPT, budget_ms=CAP_MS)
                decisions.append(await host.route(request))
                now = asyncio.get_running_loop().time()
                request = RouteRequest("late", token_ids=PROMPT, budget_ms=500)
                decisions.append(await host.route(request, deadline=now - 1.0))
                # -inf is as past as a deadline gets; NaN is no deadline at all, refused at the call.
                decisions.append(await host.route(request, deadline=-math.inf))
                with pytest.raises(ValueError, match="deadline: NaN"):
                    await host.route(request, deadline=math.nan)
                # Not a time at all: refused naming the argument, not with the error reading it raised.
                for odd in ("soon", True, 10**400):
                    with pytest.raises(ValueError, match=r"^deadline: "):
                        await host.route(request, deadline=odd)  # type: ignore[arg-type]

        await _run_asyncio(program)
        warm, late, past = decisions
        assert warm.route_source is RouteSource.KVCM, warm
        for answer in (late, past):
            assert (answer.route_source, answer.reason) == (RouteSource.DOMAIN, Reason.DEADLINE)
            assert answer.worker is not None


async def test_the_earlier_of_the_requests_deadline_and_the_callers_bounds_the_decision(
    nursery: trio.Nursery,
) -> None:
    """A request may carry its own deadline on the router's clock beside the one route() is given on
    the caller's: the earlier one wins, here the request's (long past), answered at once by the
    deadline fallback while the caller's would have left KVCM its whole budget."""
    with trio.fail_after(20):
        _cluster, addrs = await _seeded_cluster(nursery)
        decisions: list[RouteDecision] = []

        async def program() -> None:
            async with AsyncioRouterHost(_config(addrs)) as host:
                decisions.append(await host.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=CAP_MS)))
                later = asyncio.get_running_loop().time() + 30.0
                past = RouteRequest("past", token_ids=PROMPT, budget_ms=CAP_MS, deadline=-1e9)  # past on any clock
                decisions.append(await host.route(past, deadline=later))

        await _run_asyncio(program)
        warm, past = decisions
        assert warm.route_source is RouteSource.KVCM, warm
        assert (past.route_source, past.reason) == (RouteSource.DOMAIN, Reason.DEADLINE), past


async def test_route_from_another_event_loop_thread(nursery: trio.Nursery) -> None:
    """route() is thread-safe: a second asyncio loop in another thread shares the same host."""
    with trio.fail_after(20):
        _cluster, addrs = await _seeded_cluster(nursery)
        from_other_loop: list[RouteDecision] = []

        async def program() -> None:
            async with AsyncioRouterHost(_config(addrs)) as host:

                async def other() -> None:
                    from_other_loop.extend(
                        await asyncio.gather(
                            *(host.route(RouteRequest(f"o{i}", token_ids=PROMPT, budget_ms=CAP_MS)) for i in range(10))
                        )
                    )

                other_thread = threading.Thread(target=lambda: asyncio.run(other()))
                other_thread.start()
                mine = await asyncio.gather(
                    *(host.route(RouteRequest(f"m{i}", token_ids=PROMPT, budget_ms=CAP_MS)) for i in range(10))
                )
                await asyncio.get_running_loop().run_in_executor(None, other_thread.join)
                assert [d.request_id for d in mine] == [f"m{i}" for i in range(10)]

        await _run_asyncio(program)
        assert [d.request_id for d in from_other_loop] == [f"o{i}" for i in range(10)]
        # Answered, each with a worker (which source answered is the machine's: 20 calls at once).
        assert all(d.worker is not None for d in from_other_loop), from_other_loop


async def test_calls_left_pending_on_a_closed_loop_give_their_places_back(nursery: trio.Nursery) -> None:
    """A loop on another thread closed with route() calls pending, not cancelled: their answers found it
    closed and were dropped, and their places in the in-flight limit were never freed, so once the
    limit's worth were held every later call from any loop was answered overloaded, the router idle."""
    with trio.fail_after(30):
        _cluster, addrs = await _seeded_cluster(nursery)
        seen: dict[str, Any] = {}

        async def program() -> None:
            # The calls below reach the router while its thread is held.
            async with _warm_with_its_thread_held(addrs) as (host, gate):

                def closed_with_calls_pending() -> None:
                    loop = asyncio.new_event_loop()
                    loop.set_exception_handler(lambda _loop, _context: None)  # its tasks die pending, as meant
                    calls = [
                        loop.create_task(host.route(RouteRequest(f"x{i}", token_ids=PROMPT, budget_ms=CAP_MS)))
                        for i in range(40)
                    ]
                    loop.run_until_complete(asyncio.sleep(0.01))  # handed over, pending
                    loop.close()
                    seen["pending"] = sum(not call.done() for call in calls)
                    seen["tasks"] = calls  # alive until collected, below

                other = threading.Thread(target=closed_with_calls_pending)
                other.start()
                await asyncio.get_running_loop().run_in_executor(None, other.join)
                seen["held"] = host.stats().in_router
                gate.set()
                for _ in range(200):  # a hang guard: the router answers them (to a closed loop) at once
                    if host.stats().in_router == 0:
                        break
                    await asyncio.sleep(0.05)
                seen["after"] = host.stats().in_router
                # Collected, each task's coroutine is closed where it waited (GeneratorExit): its place,
                # freed when the router answered to the closed loop, was freed again.
                del seen["tasks"]
                gc.collect()
                seen["collected"] = host.stats().in_router
                seen["later"] = [
                    await host.route(RouteRequest(f"y{i}", token_ids=PROMPT, budget_ms=CAP_MS)) for i in range(5)
                ]

        await _run_asyncio(program)
        assert seen["pending"] > 0 and seen["held"] > 0
        assert seen["after"] == 0 and seen["collected"] == 0
        assert all(d.reason is not Reason.OVERLOADED for d in seen["later"]), seen["later"]


async def test_calls_their_callers_cancelled_on_a_loop_then_closed_give_their_places_back_once(
    nursery: trio.Nursery,
) -> None:
    """Calls cancelled by their callers keep their places until the router settles them; their loop
    then closed before it did, and the settling freed each place twice (once for the caller gone, once
    for the answer the closed loop could not take): the gate counted fewer calls in the router than
    there were, below zero, and let as many more through for good."""
    with trio.fail_after(30):
        _cluster, addrs = await _seeded_cluster(nursery)
        seen: dict[str, int] = {}

        async def program() -> None:
            # The calls below reach the router while its thread is held.
            async with _warm_with_its_thread_held(addrs) as (host, gate):

                async def cancelled_then_closed() -> None:  # asyncio.run cancels, then closes the loop
                    calls = [
                        asyncio.create_task(host.route(RouteRequest(f"x{i}", token_ids=PROMPT, budget_ms=CAP_MS)))
                        for i in range(10)
                    ]
                    await asyncio.sleep(0.01)  # handed over
                    for call in calls:
                        call.cancel()
                    await asyncio.gather(*calls, return_exceptions=True)

                other = threading.Thread(target=lambda: asyncio.run(cancelled_then_closed()))
                other.start()
                await asyncio.get_running_loop().run_in_executor(None, other.join)
                seen["held"] = host.stats().in_router
                gate.set()
                for _ in range(200):  # a hang guard: the router settles them at once
                    if host.stats().in_router <= 0:
                        break
                    await asyncio.sleep(0.05)
                await host.route(RouteRequest("after", token_ids=PROMPT, budget_ms=CAP_MS))  # a round after
                seen["after"] = host.stats().in_router

        await _run_asyncio(program)
        assert seen == {"held": 10, "after": 0}


async def test_cancelled_call_and_calls_around_start_and_stop(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        cluster, addrs = await _seeded_cluster(nursery)
        outcomes: dict[str, object] = {}

        async def program() -> None:
            host = AsyncioRouterHost(_config(addrs))
            with pytest.raises(HostStopped):
                await host.route(RouteRequest("early", token_ids=PROMPT))
            await host.start()
            leader = cluster.kvcm.leader
            assert leader is not None
            cluster.kvcm.set_faults(leader, KvcmFaults(hang=True))
            # A caller that gives up cancels its routing task; the host keeps serving.
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(host.route(RouteRequest("gave-up", token_ids=PROMPT, budget_ms=1000)), 0.05)
            cluster.kvcm.clear_faults()
            outcomes["after"] = await host.route(RouteRequest("after", token_ids=PROMPT, budget_ms=CAP_MS))
            # Calls already submitted when stop() begins are answered; later calls are refused.
            pending = asyncio.ensure_future(host.route(RouteRequest("pending", token_ids=PROMPT, budget_ms=500)))
            await asyncio.sleep(0)  # let it submit
            await host.stop()
            outcomes["pending"] = await pending
            with pytest.raises(HostStopped):
                await host.route(RouteRequest("late", token_ids=PROMPT))
            await host.stop()  # idempotent

        await _run_asyncio(program)
        after, pending = outcomes["after"], outcomes["pending"]
        assert isinstance(after, RouteDecision) and after.route_source is RouteSource.KVCM, after
        assert isinstance(pending, RouteDecision) and pending.request_id == "pending"


async def test_start_failure_is_raised_and_leaves_no_thread() -> None:
    with trio.fail_after(20):
        raised: list[BaseException] = []
        before: list[set[threading.Thread]] = []
        left: list[set[threading.Thread]] = []

        async def program() -> None:
            before.append(_threads())
            host = AsyncioRouterHost(KvrouteConfig(discovery=DiscoveryConfig(workers="10.0.0.1:notaport")))
            try:
                await host.start()
            except Exception as exc:
                raised.append(exc)
            left.append(_left_since(before[0]))
            with pytest.raises(HostStopped):
                await host.route(RouteRequest("x", token_ids=(1, 2, 3)))

        await _run_asyncio(program)
        assert len(raised) == 1
        assert "notaport" in str(raised[0])
        assert left == [set()]


async def test_each_answers_way_back_to_the_callers_loop_reaches_the_split_tail(nursery: trio.Nursery) -> None:
    """The host times each answer from the trio thread settling it to the caller's loop resuming; the
    next call hands those times to the metrics sink (the ``reply`` stage, part of the split's tail)."""
    with trio.fail_after(20):
        _cluster, addrs = await _seeded_cluster(nursery)
        exposition: list[str] = []

        async def program() -> None:
            async with AsyncioRouterHost(_config(addrs), debug_http=True) as host:
                for i in range(3):
                    await host.route(RouteRequest(f"w{i}", token_ids=PROMPT, budget_ms=500))
                async with httpx.AsyncClient(base_url=f"http://{host.debug_address}") as http:
                    exposition.append((await http.get("/metrics")).text)

        await _run_asyncio(program)
        wanted = 'kvroute_route_duration_seconds_count{stage="reply"} '
        counts = [line[len(wanted) :] for line in exposition[0].splitlines() if line.startswith(wanted)]
        assert counts == ["2.0"]  # the last one's time waits for the next call


async def test_the_routing_budget_counts_the_wait_for_the_routing_task_to_start(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, addrs = await _seeded_cluster(nursery)
    log = tmp_path / "decisions.log"
    config = dataclasses.replace(_config(addrs), router=RouterConfig(budget_cap_ms=10_000.0, decision_log=str(log)))

    async def program() -> None:
        async with AsyncioRouterHost(config) as host:
            await host.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=500))
            token = host._token
            assert token is not None
            # Hold the host's loop until the hand-off and a 200 ms stall are both queued behind it, so
            # the stall runs between the hand-off and the routing task's start (the callbacks run in order).
            # The hold must already be running before the hand-off is queued: trio runs its queued
            # callbacks in batches with a checkpoint between them, and a hand-off caught in the hold's
            # batch would let the routing task start before the stall.
            gate = _hold(token)
            lagged = asyncio.ensure_future(host.route(RouteRequest("lagged", token_ids=PROMPT, budget_ms=5000)))
            await asyncio.sleep(0)  # route() hands the request over
            token.run_sync_soon(time.sleep, 0.2)
            gate.set()
            await lagged

    with trio.fail_after(30):
        await _run_asyncio(program)
    (case,) = [c for c in load_log([str(log)]).cases if c.request_id == "lagged"]
    # What the router was given is what was left when its task started, not at the hand-off: at most
    # the 5 s budget less the 200 ms stall, and not nothing (seconds of slack, however busy the machine).
    assert case.request.budget_ms is not None and 0.0 < case.request.budget_ms <= 4800.0


async def test_a_request_whose_fields_cannot_be_read_is_refused_and_the_host_keeps_serving(
    nursery: trio.Nursery,
) -> None:
    """A budget of the wrong type (or NaN) used to raise on the trio thread inside run_sync_soon, which
    ended the router's run and left the caller waiting for ever."""
    with trio.fail_after(20):
        _cluster, addrs = await _seeded_cluster(nursery)
        outcomes: list[RouteDecision] = []

        async def program() -> None:
            async with AsyncioRouterHost(_config(addrs)) as host:
                for budget in ("50", math.nan, -1.0):
                    request = RouteRequest("odd", token_ids=PROMPT, budget_ms=budget)  # type: ignore[arg-type]
                    outcomes.append(await asyncio.wait_for(host.route(request), 10))
                outcomes.append(await host.route(RouteRequest("fine", token_ids=PROMPT, budget_ms=CAP_MS)))
                # A caller deadline without end adds nothing (it is not the request's own field).
                endless = RouteRequest("endless", token_ids=PROMPT, budget_ms=CAP_MS)
                outcomes.append(await host.route(endless, deadline=math.inf))

        await _run_asyncio(program)
        *odd, fine, endless = outcomes
        assert all(d.reason is Reason.BAD_REQUEST and (d.error or "").startswith("budget_ms:") for d in odd), odd
        assert fine.worker is not None and fine.reason is not Reason.BAD_REQUEST
        assert endless.worker is not None and endless.reason is not Reason.BAD_REQUEST, endless.error


class RequestId(str):
    """An application's own id type: a ``str`` to every check."""


async def test_a_burst_beyond_the_in_flight_limit_is_answered_overloaded_on_the_callers_loop(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """With the trio thread held, hand-offs cannot be answered: the calls beyond the learnt limit are
    answered ``overloaded`` at once on the caller's loop (before the hold ends), each with a worker;
    after it the handed calls are answered by the router, and every shed is recorded in the decision
    log. A call naming roles and a malformed one always go to the router, whatever the limit. The
    burst's ids are of a ``str`` subclass, answered as plain ``str``."""
    _, addrs = await _seeded_cluster(nursery)
    log = tmp_path / "decisions.log"
    config = dataclasses.replace(_config(addrs), router=RouterConfig(budget_cap_ms=CAP_MS, decision_log=str(log)))
    burst = 40
    seen: dict[str, object] = {}

    async def program() -> None:
        async with AsyncioRouterHost(config) as host:
            await host.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=500))
            token, router = host._token, host._router
            assert token is not None and router is not None
            published = router.overload_answers()
            assert published is not None and published.answers  # the router has published what to shed with
            gate = _hold(token)
            try:
                calls = [
                    asyncio.ensure_future(host.route(RouteRequest(RequestId(f"b{i}"), token_ids=PROMPT, budget_ms=500)))
                    for i in range(burst)
                ]
                named = asyncio.ensure_future(
                    host.route(RouteRequest("named", token_ids=PROMPT, budget_ms=500, roles=(Role.PREFILL,)))
                )
                malformed = asyncio.ensure_future(host.route(RouteRequest("", token_ids=PROMPT, budget_ms=500)))
                await asyncio.sleep(0)  # each call has run up to its hand-off, or been answered
                shed = [c.result() for c in calls if c.done()]
                waiting = [c for c in calls if not c.done()]
                seen["stats"] = host.stats()
                seen["pending"] = len(waiting) + (not named.done()) + (not malformed.done())
            finally:
                gate.set()
            seen["shed"] = shed
            seen["handed"] = await asyncio.gather(*waiting)
            seen["named"], seen["malformed"] = await named, await malformed

    with trio.fail_after(30):
        await _run_asyncio(program)
    shed = cast(list[RouteDecision], seen["shed"])
    stats = cast(HostStats, seen["stats"])
    # The warm call answered on time: the limit is the initial one plus a little.
    assert 0 < len(shed) < burst
    assert all((d.route_source, d.reason) == (RouteSource.DOMAIN, Reason.OVERLOADED) for d in shed), shed
    assert all(d.worker is not None and d.request_id.startswith("b") for d in shed)
    # Each shed's decision goes to the metrics sink's ring, which packs it with marshal: plain ids only.
    assert all(type(d.request_id) is str for d in shed)
    assert stats.shed_before_hop == len(shed) and stats.sheds_unrecorded == 0 and stats.answer_timeouts == 0
    assert stats.in_router == burst - len(shed) + 2 == seen["pending"]
    assert cast(RouteDecision, seen["named"]).reason is not Reason.OVERLOADED
    malformed = cast(RouteDecision, seen["malformed"])
    assert malformed.reason is Reason.BAD_REQUEST and (malformed.error or "").startswith("request_id")
    cases = {c.request_id: c for c in load_log([str(log)]).cases}
    assert all(cases[d.request_id].overloaded for d in shed)  # recorded on the trio thread afterwards


async def test_a_call_its_caller_gave_up_on_keeps_its_place_until_the_router_is_done_with_it(
    nursery: trio.Nursery,
) -> None:
    """Freed at the caller's timeout, the places let callers that time out (the storm the gate is
    for) hand over call after call to a trio thread that had not started the first ones."""
    _, addrs = await _seeded_cluster(nursery)
    seen: dict[str, HostStats] = {}

    async def program() -> None:
        async with _warm_with_its_thread_held(addrs) as (host, _):

            async def impatient(i: int) -> None:
                request = RouteRequest(f"i{i}", token_ids=PROMPT, budget_ms=500)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(host.route(request), 0.005)

            for round_ in range(2):  # the first round's callers all gave up before the second
                await asyncio.gather(*(impatient(100 * round_ + i) for i in range(50)))
                seen[f"round {round_}"] = host.stats()
        seen["stopped"] = host.stats()

    with trio.fail_after(30):
        await _run_asyncio(program)
    first, second, stopped = seen["round 0"], seen["round 1"], seen["stopped"]
    # The warm call came back; the calls handed over since hold their places (queued for the held
    # thread, none has reached the router); the rest were shed.
    assert first.handed == 1 and 0 < first.in_router < 50
    assert first.shed_before_hop == 50 - first.in_router
    assert second.handed == first.handed and second.in_router == first.in_router  # no place freed: all shed
    assert second.shed_before_hop == first.shed_before_hop + 50
    # Once the thread ran again each reached the router, which was then done with it: freed.
    assert stopped.handed == 1 + first.in_router and stopped.in_router == 0


@pytest.mark.parametrize(
    ("router_took_s", "decided", "limit_moves"),
    [
        (0.0, False, "stays"),  # a user's abort: the router dropped the call in time
        (0.0, True, "grows"),  # the router answered in time, after its caller had left
        (5.0, False, "shrinks"),  # the router was late for it (a stalled thread): the congestion signal
        (5.0, True, "shrinks"),
    ],
)
def test_a_call_its_caller_cancelled_teaches_the_limit_only_the_routers_own_pace(
    router_took_s: float, decided: bool, limit_moves: str
) -> None:
    """Every cancelled call counted as late: 40 user aborts took the limit from 16 to 0.7, and the idle
    router then shed 39 of 40 calls overloaded."""
    # One place: the call fills it, so an answer in time grows it (a limit nothing fills stays).
    gate = HandOffGate(InFlightLimit(initial=1, ceiling=256, floor=0.05), waiters=0)
    loop = asyncio.new_event_loop()
    try:
        gate.hand_off_anyway()
        handed = asyncio_host._Handed(gate, loop, time.monotonic() - router_took_s, 1.0)
        before = gate._limit.share
        handed.give_up()  # its caller stops waiting first
        settled: outcome.Outcome[RouteDecision] = (
            outcome.Value(cast(RouteDecision, object())) if decided else outcome.Error(HostStopped("cancelled"))
        )
        handed.settle(settled)  # then the routing thread is done with it: the place is freed
        assert gate.in_router() == 0
        after = gate._limit.share
        assert {"stays": after == before, "grows": after > before, "shrinks": after < before}[limit_moves], after
    finally:
        loop.close()


async def test_a_call_with_no_time_left_is_the_routers_to_answer_when_there_is_a_place(nursery: trio.Nursery) -> None:
    """As the router admits: nothing left is reason ``deadline`` (its answer), not ``overloaded``."""
    with trio.fail_after(20):
        _cluster, addrs = await _seeded_cluster(nursery)
        decisions: list[RouteDecision] = []

        async def program() -> None:
            async with AsyncioRouterHost(_config(addrs)) as host:
                await host.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=500))
                stalled = 0
                for i in range(20):
                    while True:
                        try:
                            request = RouteRequest(f"none{i}", token_ids=PROMPT, budget_ms=0.0)
                            decisions.append(await host.route(request))
                            break
                        except AnswerTimeout:
                            # Nothing left waits only the slack for the answer: a trio thread starved
                            # that long (a loaded machine) leaves it unanswered. Handed all the same.
                            stalled += 1
                            assert stalled <= 20
                stats = host.stats()
                assert (stats.shed_before_hop, stats.handed) == (0, 21 + stalled)
                assert stalled or stats.in_router == 0  # a stalled call's place is freed once it settles
                # Late from the start, they teach the in-flight limit nothing (as late answers they
                # would have shrunk it below two).
                assert host._gate._limit.limit >= INITIAL_IN_FLIGHT_LIMIT

        await _run_asyncio(program)
        assert all(d.reason is Reason.DEADLINE for d in decisions), decisions


async def test_a_call_whose_caller_left_less_than_the_reply_margin_teaches_the_limit_nothing(
    nursery: trio.Nursery,
) -> None:
    """The reply margin comes off the caller's time before the call is judged: a caller whose deadline
    is within the margin left the router nothing, so its call (answered ``deadline``) says nothing of
    the router's pace. Judged on the caller's whole time, each quick answer would grow the limit."""
    with trio.fail_after(20):
        _cluster, addrs = await _seeded_cluster(nursery)
        router = RouterConfig(budget_cap_ms=CAP_MS, reply_margin_ms=30_000.0)
        config = dataclasses.replace(_config(addrs), router=router)
        decisions: list[RouteDecision] = []
        shares: list[float] = []

        async def program() -> None:
            async with AsyncioRouterHost(config) as host:
                await host.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=500))
                shares.append(host._gate._limit.share)
                loop = asyncio.get_running_loop()
                for i in range(5):
                    request = RouteRequest(f"m{i}", token_ids=PROMPT, budget_ms=CAP_MS)
                    decisions.append(await host.route(request, deadline=loop.time() + 10.0))
                shares.append(host._gate._limit.share)
                stats = host.stats()
                assert (stats.shed_before_hop, stats.handed, stats.in_router) == (0, 6, 0)

        await _run_asyncio(program)
        assert all(d.reason is Reason.DEADLINE for d in decisions), decisions
        before, after = shares
        assert after == before


async def test_a_call_to_a_stalled_router_thread_ends_by_its_time_not_the_stall(nursery: trio.Nursery) -> None:
    """The answer is awaited for the call's time (its budget, or its caller's deadline) and a slack:
    with the trio thread held until the calls have returned, each raises AnswerTimeout, the host keeps
    serving once the thread runs again, and each given-up call's place is freed when the router is
    done with it."""
    _, addrs = await _seeded_cluster(nursery)
    seen: dict[str, object] = {}

    async def program() -> None:
        async with _warm_with_its_thread_held(addrs) as (host, gate):
            loop = asyncio.get_running_loop()
            by_budget = host.route(RouteRequest("budget", token_ids=PROMPT, budget_ms=50))
            with pytest.raises(AnswerTimeout, match="no decision from the router's thread"):
                await asyncio.wait_for(by_budget, 30)
            patient = RouteRequest("deadline", token_ids=PROMPT, budget_ms=CAP_MS)
            by_deadline = host.route(patient, deadline=loop.time() + 0.05)
            with pytest.raises(AnswerTimeout):
                await asyncio.wait_for(by_deadline, 30)
            seen["held"] = gate.is_set()  # the calls returned while the thread was still held
            gate.set()
            seen["after"] = await host.route(RouteRequest("after", token_ids=PROMPT, budget_ms=CAP_MS))
        seen["stopped"] = host.stats()

    with trio.fail_after(30):
        await _run_asyncio(program)
    assert seen["held"] is False
    after = cast(RouteDecision, seen["after"])
    assert after.request_id == "after" and after.worker is not None
    stopped = cast(HostStats, seen["stopped"])
    assert stopped.in_router == 0 and stopped.answer_timeouts == 2


def _hold_the_opening(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The host's open_router held before it opens until ``go`` is set; ``opening`` is set once it waits."""
    opening, go = threading.Event(), threading.Event()
    real_open = open_router

    @contextlib.asynccontextmanager
    async def held_open(config: KvrouteConfig, **kwargs: Any) -> AsyncIterator[RouterHandle]:
        opening.set()
        await trio.to_thread.run_sync(go.wait, 30.0)
        async with real_open(config, **kwargs) as handle:
            yield handle

    monkeypatch.setattr(asyncio_host, "open_router", held_open)
    return opening, go


async def test_stop_while_start_opens_the_router_stops_it_once_open(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop() begun while start() is still opening the router used to find no way to reach the
    trio thread yet, queue no stop and wait for ever, the host serving on."""
    _, addrs = await _seeded_cluster(nursery)
    opening, go = _hold_the_opening(monkeypatch)
    seen: dict[str, bool] = {}

    async def program() -> None:
        host = AsyncioRouterHost(_config(addrs))
        starting = asyncio.ensure_future(host.start())
        try:
            assert await asyncio.get_running_loop().run_in_executor(None, opening.wait, 30.0)
            stopping = asyncio.ensure_future(host.stop())
            await asyncio.sleep(0)  # stop() begins while the router is still opening
            seen["stop began while opening"] = not stopping.done() and not starting.done()
            go.set()
            await asyncio.wait_for(starting, 30)
            await asyncio.wait_for(stopping, 30)
            with pytest.raises(HostStopped):
                await host.route(RouteRequest("late", token_ids=PROMPT))
        finally:
            go.set()
            await host.stop()  # a second stop ends a host the first left running

    with trio.fail_after(60):
        await _run_asyncio(program)
    assert seen == {"stop began while opening": True}


async def test_a_start_cancelled_twice_while_opening_still_closes_the_router(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled start() waits for the opening and closes it; a second cancellation meanwhile (an
    outer scope, a second Ctrl-C) cancelled the opening's future itself, skipped the close, and left the
    thread serving, with a later stop() waiting for good."""
    _, addrs = await _seeded_cluster(nursery)
    opening, go = _hold_the_opening(monkeypatch)
    seen: dict[str, bool] = {}

    async def program() -> None:
        host = AsyncioRouterHost(_config(addrs))
        starting = asyncio.ensure_future(host.start())
        try:
            assert await asyncio.get_running_loop().run_in_executor(None, opening.wait, 30.0)
            starting.cancel()
            await asyncio.sleep(0.01)  # start() now waits for the opening
            starting.cancel()
            await asyncio.sleep(0.01)
            seen["start still closing"] = not starting.done()
            go.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(starting, 30)
            with pytest.raises(HostStopped):
                await host.route(RouteRequest("late", token_ids=PROMPT))
            await asyncio.wait_for(host.stop(), 30)
        finally:
            go.set()

    with trio.fail_after(60):
        await _run_asyncio(program)
    assert seen == {"start still closing": True}


async def test_only_calls_that_reached_the_router_count_as_handed(nursery: trio.Nursery) -> None:
    """A call queued for the trio thread and refused there as the host stops, and one whose hand-off
    finds the trio run over, are HostStopped and were never the router's."""
    _, addrs = await _seeded_cluster(nursery)
    seen: dict[str, HostStats] = {}

    async def program() -> None:
        host = AsyncioRouterHost(_config(addrs))
        await host.start()
        try:
            await host.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=500))
            token, thread = host._token, host._thread
            assert token is not None and thread is not None
            gate = _hold(token)
            try:
                # As a stop() from another loop does, after this loop's route() read the token.
                token.run_sync_soon(host._begin_stop)
                refused = asyncio.ensure_future(host.route(RouteRequest("refused", token_ids=PROMPT)))
                await asyncio.sleep(0)  # handed to the trio thread, behind the stop
            finally:
                gate.set()
            with pytest.raises(HostStopped, match="stopping"):
                await asyncio.wait_for(refused, 30)
            await asyncio.get_running_loop().run_in_executor(None, thread.join, 30.0)
            with pytest.raises(HostStopped, match="has stopped"):  # the trio run is over
                await host.route(RouteRequest("after", token_ids=PROMPT))
            seen["stats"] = host.stats()
        finally:
            await host.stop()

    with trio.fail_after(30):
        await _run_asyncio(program)
    stats = seen["stats"]
    assert (stats.handed, stats.shed_before_hop, stats.in_router) == (1, 0, 0)


@pytest.mark.parametrize(
    ("router", "named"),
    [
        (RouterConfig(max_in_flight=None), r"router\.max_in_flight: expected an integer, got None"),  # type: ignore[arg-type]
        (None, r"invalid router configuration: must be a RouterConfig"),
    ],
    ids=["none-for-int", "no-section"],
)
def test_a_host_built_on_a_mistyped_router_section_is_refused_naming_it(router: Any, named: str) -> None:
    """The host reads the router's in-flight cap as it is built, before open_router checks the
    configuration: a bare TypeError (or AttributeError) naming nothing."""
    config = dataclasses.replace(KvrouteConfig(), router=router)
    with pytest.raises(ConfigError, match=named):
        AsyncioRouterHost(config)
