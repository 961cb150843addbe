"""The sidecar's bounds: the sheds waiting to be recorded, and health Checks that never wait for the trio thread.

The shed queue and the readiness publication run on the MockClock against an in-memory cluster, the
sidecar not serving (its handler-thread and trio-thread methods called directly); the health Check
under a blocked trio thread is real loopback gRPC with the real clock.
"""

from __future__ import annotations

import threading
import time
from typing import cast

import grpc
import pytest
import trio
import trio.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc

from actors.scorer import ScorerHealth
from kvroute_sim.sim.cluster import SimCluster
from router.api import RouterHandle, open_router
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig
from router.receipt import SHED_RECORD_BATCH_S, SHED_RECORD_TURN, SHED_RECORDS_MAX
from router.sidecar import READY_PUBLISH_S, READY_STALE_S, ROUTER_SERVICE, Sidecar
from router.targets import HostPort
from router.transport.errors import PeerAbort, RpcStatus
from router.transport.memory_adapter import MemoryNetwork
from router.types import Reason, RouteSource
from router.wire import router_v1_pb2
from tests.test_sidecar import served_config

BLOCK = 16
CLIENT_TIMEOUT_S = 5.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _memory_config(network: MemoryNetwork) -> KvrouteConfig:
    addrs = SimCluster(workers=3, kvcm_replicas=1, block_size=BLOCK).serve_memory(network)
    return KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )


async def test_sheds_beyond_the_bound_are_answered_and_counted_not_queued(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryNetwork()
    config = _memory_config(network)
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)  # the router has published its overloaded answers
        router = handle.router_actor()
        published = router.overload_answers()
        assert published is not None and published.answers
        # Not serving: no trio token, so nothing drains the queue, as when the trio thread stalls.
        sidecar = Sidecar(handle, config)
        context = cast(grpc.ServicerContext, object())  # a domain answer carries no trailing metadata
        calls = SHED_RECORDS_MAX + 3
        records = sidecar._sheds
        records._due = True  # as the first shed sets it (not opened: no trio token here to schedule a recorder)

        # Handler threads shed these; here the trio thread does, so the mock clock stands still meanwhile
        # (on a worker thread the router's background tasks ran for however long the clock jumped).
        requests = [router_v1_pb2.RouteRequest(request_id=f"s{i}", token_ids=range(32)) for i in range(calls)]
        replies = [sidecar._shed(r, published, 0.01, time.monotonic(), context, 32)[0] for r in requests]
        last = router_v1_pb2.RouteDecision.FromString(replies[-1])
        assert len(replies) == calls  # every shed is answered, recorded or not
        assert (last.request_id, last.route_source, last.reason) == (
            f"s{calls - 1}",
            RouteSource.DOMAIN.value,
            Reason.OVERLOADED.value,
        )
        assert records.pending() == SHED_RECORDS_MAX
        stats = sidecar.stats()
        assert (stats.shed_at_receipt, stats.sheds_unrecorded) == (calls, 3)
        before = router.health().overloaded
        charged = _scorer(handle)
        # The recording task works in turns of SHED_RECORD_TURN with a checkpoint between them: the
        # routing thread's other tasks run in between (this one sees the queue shrink turn by turn).
        async with trio.open_nursery() as recording:
            records.open(router, recording)
            recording.start_soon(records._record_after_batch)
            await trio.sleep(SHED_RECORD_BATCH_S)
            seen = []
            due = []  # while sheds are left the flag stays up: a handler thread starts no second recorder
            for _ in range(2 * SHED_RECORDS_MAX // SHED_RECORD_TURN):
                await trio.lowlevel.checkpoint()
                seen.append(records.pending())
                due.append(records._due)
                if not records.pending():
                    break
        assert router.health().overloaded == before + SHED_RECORDS_MAX
        assert not records.pending() and not records._due
        # Their workers get them: charged, a sum per worker and turn (the answers were drawn among a few).
        await trio.testing.wait_all_tasks_blocked()
        after = _scorer(handle)
        assert after.records - charged.records == SHED_RECORDS_MAX  # each shed charged (in sums)
        assert after.records_dropped == charged.records_dropped
        assert len([n for n in seen if 0 < n < SHED_RECORDS_MAX]) >= SHED_RECORDS_MAX // SHED_RECORD_TURN // 2
        assert all(flag for n, flag in zip(seen, due, strict=True) if n > 0)


def _scorer(handle: RouterHandle) -> ScorerHealth:
    health = handle.actors()["scorer"]["health"]
    assert isinstance(health, ScorerHealth)
    return health


def _check(sidecar: Sidecar, service: str) -> int:
    """A health Check as a handler thread makes it (the service is known: the context is not touched)."""
    request = health_pb2.HealthCheckRequest(service=service)
    status: int = sidecar._health.Check(request, cast(grpc.ServicerContext, object())).status
    return status


async def _one_publication() -> None:
    await trio.sleep(READY_PUBLISH_S)
    await trio.testing.wait_all_tasks_blocked()  # the publisher, woken at the same time, has run


async def test_health_answers_the_readiness_the_trio_thread_publishes(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    network = MemoryNetwork()
    config = _memory_config(network)
    async with open_router(config, rpc=network) as handle, trio.open_nursery() as nursery:
        ready = [True]
        monkeypatch.setattr(handle, "ready", lambda: (ready[0], "as the test says"))
        sidecar = Sidecar(handle, config)
        assert _check(sidecar, "") == NOT_SERVING  # nothing published yet
        nursery.start_soon(sidecar._publish_readiness, trio.CancelScope())
        await _one_publication()
        assert (_check(sidecar, ""), _check(sidecar, ROUTER_SERVICE)) == (SERVING, SERVING)
        ready[0] = False
        await _one_publication()
        assert _check(sidecar, ROUTER_SERVICE) == NOT_SERVING
        ready[0] = True
        await _one_publication()
        assert _check(sidecar, "") == SERVING
        # A routing thread that stopped publishing (stuck) is not serving, whatever it last said.
        published = sidecar._published
        sidecar._published = (published[0], published[1] - READY_STALE_S)
        assert _check(sidecar, "") == NOT_SERVING
        sidecar._published = published
        sidecar.drain()  # not ready from the drain on, at once
        assert _check(sidecar, "") == NOT_SERVING
        await _one_publication()
        assert _check(sidecar, "") == NOT_SERVING
        nursery.cancel_scope.cancel()


def _block_trio_thread_until(answered: threading.Event, prober: threading.Thread) -> bool:
    """Hold the calling (trio) thread until ``answered`` is set, or twice the client's timeout."""
    came = answered.wait(2 * CLIENT_TIMEOUT_S)
    prober.join()
    return came


async def test_a_health_check_is_answered_while_the_trio_thread_is_blocked(nursery: trio.Nursery) -> None:
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    config = served_config(await nursery.start(cluster.serve_grpc))
    with trio.fail_after(15):
        async with open_router(config) as handle, trio.open_nursery() as inner:
            await _warm(handle)
            bound: HostPort = await inner.start(Sidecar(handle, config).run)
            channel = grpc.insecure_channel(str(bound), options=[("grpc.enable_retries", 0)])
            try:
                replies: list[object] = []
                answered = threading.Event()

                def probe() -> None:
                    stub = health_pb2_grpc.HealthStub(channel)
                    try:
                        request = health_pb2.HealthCheckRequest(service=ROUTER_SERVICE)
                        replies.append(stub.Check(request, timeout=CLIENT_TIMEOUT_S).status)
                    except grpc.RpcError as exc:
                        replies.append(exc.code())
                    finally:
                        answered.set()

                prober = threading.Thread(target=probe)
                prober.start()
                # The trio thread is held (not awaiting) until the reply has come: a Check that waited
                # for this thread would end at the client's deadline instead.
                assert _block_trio_thread_until(answered, prober)
                assert replies == [SERVING]
            finally:
                channel.close()
                inner.cancel_scope.cancel()


async def _warm(handle: RouterHandle) -> None:
    resolver = handle.leader_resolver()
    assert resolver is not None
    await resolver.leader()  # the router is ready before the sidecar publishes its first readiness


class _NoDeadline:
    """A grpc context of a client that set no deadline: grpcio reports about 9.2e18 s left."""

    def time_remaining(self) -> float:
        return 9.2e18


async def test_a_large_request_without_a_client_deadline_waits_for_its_turn_at_most_the_cap() -> None:
    """Two large requests overlap and the second client set no deadline: its wait for the reading turn
    is bounded by the cap (it used to pass grpcio's 9.2e18 s to the semaphore, which raised
    OverflowError, and a None deadline meant no wait at all). The wait is a handler thread's, on the
    real clock: the cap's 50 ms plus the answer slack; so is the test's (no mock clock jumping while it
    waits)."""
    network = MemoryNetwork()
    config = _memory_config(network)
    async with open_router(config, rpc=network) as handle:
        sidecar = Sidecar(handle, config)
        size = sidecar._large_request_bytes + 1
        context = cast(grpc.ServicerContext, _NoDeadline())
        outcome: list[BaseException | None] = []

        def second_reader() -> None:
            try:
                with sidecar._reading_turn(size, context):
                    outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        with sidecar._reading_turn(size, context):  # the first large request is being read
            await trio.to_thread.run_sync(second_reader)
        (result,) = outcome
        assert isinstance(result, PeerAbort) and result.status is RpcStatus.DEADLINE_EXCEEDED, result
        with sidecar._reading_turn(size, context):  # free again: no wait
            pass
