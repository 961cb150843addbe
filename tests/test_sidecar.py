"""Way in #3, the gRPC sidecar, end to end: a plain grpcio client → Sidecar → router → SimCluster.

Everything is real loopback gRPC with the real clock (an absolute trio.fail_after per test); the
client runs its blocking calls on worker threads, like a frontend process would.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import logging
import math
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import trio
import trio.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from actors.metrics_sink import REPLY_STAGE_LABEL
from kvroute_sim.sim.cluster import SimCluster, SimClusterAddresses
from kvroute_sim.sim.faults import CallStats
from kvroute_sim.sim.kvcm import KvcmFaults
from router.admission import InFlightLimit
from router.api import RouterHandle, open_router
from router.config import (
    DeploymentConfig,
    DiscoveryConfig,
    GrpcTlsConfig,
    KvrouteConfig,
    LimitsConfig,
    RouterConfig,
    ServeConfig,
)
from router.decision_record import without_prompt
from router.keys import block_keys
from router.problems import ConfigError
from router.receipt import INITIAL_IN_FLIGHT_LIMIT, HandOffGate
from router.replay import load_log
from router.request import budget_left_ms, caller_deadline, check_request, sheddable
from router.sidecar import (
    ERROR_METADATA_CHARS,
    ERROR_METADATA_KEY,
    ROUTER_SERVICE,
    CallTiming,
    Sidecar,
    _call_timing,
    _CallHops,
    _RouterHealth,
    _Stopped,
    _ThreadWait,
    _TimedPool,
    _timing_row,
    check_proto_bounds,
    converted,
    crowded,
    decision_to_proto,
    metadata_text,
    next_path_cost,
    request_from_proto,
    shed_reply,
    shed_reply_body,
)
from router.targets import HostPort
from router.transport.errors import PeerAbort, RpcStatus
from router.transport.memory_adapter import MemoryNetwork
from router.types import (
    BadRequest,
    KeyFamily,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouteSource,
    WireRouteRequest,
    WorkerAddr,
)
from router.wire import router_v1_pb2
from router.wire.decode import encode_block_keys
from router.wire.paths import KVCM_GET_HOST_CACHE_STATE, ROUTER_ROUTE
from tests.test_asyncio_host import _hold

BLOCK = 16
LIMITS = LimitsConfig()
PROMPT = tuple(range(7000, 7000 + 8 * BLOCK))
CLIENT_TIMEOUT_S = 5.0
# A call held "in the router" keeps its handler thread until the test lets the hung KVCM answer: its
# budget, the cap, the KVCM query timeout and its client deadline all outlast the test's fail_after.
HOLD_S = 60.0
HOLDING = RouterConfig(budget_cap_ms=HOLD_S * 1000, kvcm_query_timeout_ms=HOLD_S * 1000)


@dataclass
class Rig:
    cluster: SimCluster
    handle: RouterHandle
    sidecar: Sidecar
    channel: grpc.Channel
    stopped: trio.Event  # set when sidecar.run() has returned

    def route(self, request: router_v1_pb2.RouteRequest, timeout: float | None = CLIENT_TIMEOUT_S) -> object:
        """One blocking Route call (run it on a thread; ``timeout`` None: no deadline); returns the
        decision or the grpc.RpcError."""
        call = self.channel.unary_unary(
            ROUTER_ROUTE,
            request_serializer=router_v1_pb2.RouteRequest.SerializeToString,
            response_deserializer=router_v1_pb2.RouteDecision.FromString,
        )
        try:
            reply: router_v1_pb2.RouteDecision = call(request, timeout=timeout)
        except grpc.RpcError as exc:
            return exc
        return reply

    def health(self, service: str) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        status: int = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CLIENT_TIMEOUT_S).status
        return status


def served_config(
    addrs: SimClusterAddresses,
    *,
    serve: ServeConfig | None = None,
    router: RouterConfig | None = None,
    limits: LimitsConfig | None = None,
    workers: str | None = None,
    key_family: KeyFamily = KeyFamily.RTP,
) -> KvrouteConfig:
    """A router over the cluster at ``addrs`` (``workers``: what discovery is given instead of its
    workers), its Route service to listen on a free loopback port."""
    return KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK, kvcm_instance_id="test", key_family=key_family),
        discovery=DiscoveryConfig(
            kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg if workers is None else workers
        ),
        router=router or RouterConfig(budget_cap_ms=1000.0),
        serve=serve or ServeConfig(grpc_listen="127.0.0.1:0"),
        limits=limits or LimitsConfig(),
    )


@asynccontextmanager
async def rig(
    nursery: trio.Nursery,
    *,
    serve: ServeConfig | None = None,
    router: RouterConfig | None = None,
    limits: LimitsConfig | None = None,
    workers: str | None = None,
    key_family: KeyFamily = KeyFamily.RTP,
) -> AsyncIterator[Rig]:
    """``workers``: what discovery is given (default: the cluster's workers)."""
    cluster = SimCluster(workers=4, kvcm_replicas=2, block_size=BLOCK)
    addrs = await nursery.start(cluster.serve_grpc)
    config = served_config(addrs, serve=serve, router=router, limits=limits, workers=workers, key_family=key_family)
    async with open_router(config) as handle, trio.open_nursery() as inner:
        resolver = handle.leader_resolver()
        assert resolver is not None
        await resolver.leader()  # warm: the router is ready
        sidecar = Sidecar(handle, config, keep_call_timings=True)
        stopped = trio.Event()

        async def run_sidecar(*, task_status: trio.TaskStatus[HostPort] = trio.TASK_STATUS_IGNORED) -> None:
            await sidecar.run(task_status=task_status)
            stopped.set()

        bound = await inner.start(run_sidecar)
        channel = grpc.insecure_channel(str(bound), options=[("grpc.enable_retries", 0)])
        try:
            yield Rig(cluster, handle, sidecar, channel, stopped)
        finally:
            channel.close()
            inner.cancel_scope.cancel()


def _status(outcome: object) -> grpc.StatusCode:
    assert isinstance(outcome, grpc.RpcError), f"expected an error, got {outcome!r}"
    code: grpc.StatusCode = outcome.code()
    return code


def _details(outcome: object) -> str:
    assert isinstance(outcome, grpc.RpcError)
    return outcome.details() or ""


async def _in_thread(fn: Callable[[], object]) -> object:
    return await trio.to_thread.run_sync(fn)


async def test_a_request_past_grpcs_default_size_reaches_the_limits_checks(nursery: trio.Nursery) -> None:
    """grpc's default 4 MiB receive cap refused a request before the handler ran (RESOURCE_EXHAUSTED,
    naming no field), also one within limits an operator had raised: the cap now follows the limits."""
    limits = LimitsConfig(max_block_keys=500_000)
    keys = [2**62 + i for i in range(500_001)]  # 9 bytes each on the wire: 4.5 MB, one key past the limit
    over = router_v1_pb2.RouteRequest(request_id="big", block_cache_keys=keys, block_size=BLOCK)
    assert over.ByteSize() > 4 * 1024 * 1024
    with trio.fail_after(60):
        async with rig(nursery, limits=limits) as r:
            outcome = await _in_thread(lambda: r.route(over, timeout=30.0))
            assert _status(outcome) is grpc.StatusCode.INVALID_ARGUMENT
            assert "block_cache_keys" in _details(outcome) and "500000" in _details(outcome)


async def test_a_sidecar_serving_past_its_routers_close_refuses_unavailable_and_is_not_serving(
    nursery: trio.Nursery,
) -> None:
    """A sidecar in a task outside the ``open_router`` block, still serving when the block ends: the
    router refuses new requests (``RouterClosed``). The call was answered INTERNAL "router error" and
    counted failed, not UNAVAILABLE (not routed, as in a drain), which clients retry elsewhere; and the
    health service kept answering SERVING, the load balancer sending it calls that all failed."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    config = served_config(await nursery.start(cluster.serve_grpc))
    with trio.fail_after(60):
        async with trio.open_nursery() as outside:
            async with open_router(config) as handle:
                sidecar = Sidecar(handle, config)
                bound = await outside.start(sidecar.run)
            channel = grpc.insecure_channel(str(bound), options=[("grpc.enable_retries", 0)])
            try:
                r = Rig(cluster, handle, sidecar, channel, trio.Event())
                request = router_v1_pb2.RouteRequest(request_id="late", token_ids=PROMPT)
                outcome = await _in_thread(lambda: r.route(request))
                assert _status(outcome) is grpc.StatusCode.UNAVAILABLE, _details(outcome)
                assert (sidecar.stats().unavailable, sidecar.stats().failed) == (1, 0)

                def until_not_serving() -> None:
                    stream = health_pb2_grpc.HealthStub(channel).Watch(
                        health_pb2.HealthCheckRequest(service=""), timeout=30.0
                    )
                    try:
                        while next(stream).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                            pass
                    finally:
                        stream.cancel()

                await _in_thread(until_not_serving)  # a deadline error if it never comes
                assert "the router is closed" in handle.ready()[1]
            finally:
                channel.close()
                outside.cancel_scope.cancel()


async def test_a_sidecar_given_mtls_without_a_certificate_in_code_is_refused_not_served_plaintext(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A configuration built in code is validated by no loader: a client CA (mTLS asked) and a key
    without the certificate made no server credentials, and the sidecar served plaintext to anyone."""
    network = MemoryNetwork()
    addrs = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK).serve_memory(network)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
        grpc_tls=GrpcTlsConfig(key="/etc/kvroute/server.key", client_ca="/etc/kvroute/clients.pem"),
    )
    async with open_router(config, rpc=network) as handle:
        with pytest.raises(ConfigError, match=r"grpc_tls\.client_ca, grpc_tls\.cert: client certificates"):
            Sidecar(handle, config)


async def test_health_watch_streams_follow_readiness_and_do_not_hold_a_drain(nursery: trio.Nursery) -> None:
    """A Watch stream (what clients' health checking uses) learnt a readiness change only when someone
    sent a Check; and an open one held every drain to its whole grace (it never ends by itself)."""
    serve = ServeConfig(grpc_listen="127.0.0.1:0", drain_lame_duck_s=0.1, drain_timeout_s=60.0)
    with trio.fail_after(30):  # against a hang; the drain's grace alone is twice that
        async with rig(nursery, serve=serve) as r:
            stub = health_pb2_grpc.HealthStub(r.channel)
            stream = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60.0)
            seen: list[int] = []

            def next_status() -> None:
                seen.append(next(stream).status)

            await _in_thread(next_status)
            assert seen == [health_pb2.HealthCheckResponse.SERVING]
            r.sidecar._publish(False)  # as the readiness loop publishes a change: no Check is sent
            await _in_thread(next_status)
            r.sidecar._publish(True)
            await _in_thread(next_status)
            assert seen[1:] == [health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING]
            r.sidecar.drain()  # no Route call in flight: the drain ends after its lame duck
            await r.stopped.wait()
            stream.cancel()


async def test_watch_streams_leave_nothing_behind_once_they_end(nursery: trio.Nursery) -> None:
    """grpc_health's reference servicer kept a set for every service name ever watched (any string,
    as long as a request may be), so a client looping over names grew the sidecar without bound."""
    name_chars = 64 * 1024
    watches = 40
    with trio.fail_after(60):
        async with rig(nursery) as r:
            stub = health_pb2_grpc.HealthStub(r.channel)

            def watch(service: str) -> int:
                stream = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=30.0)
                try:
                    status: int = next(stream).status
                finally:
                    stream.cancel()
                return status

            assert await _in_thread(lambda: watch("")) == health_pb2.HealthCheckResponse.SERVING
            listed = await trio.to_thread.run_sync(
                lambda: stub.List(health_pb2.HealthListRequest(), timeout=CLIENT_TIMEOUT_S)
            )
            assert {name: reply.status for name, reply in listed.statuses.items()} == {
                "": health_pb2.HealthCheckResponse.SERVING,
                ROUTER_SERVICE: health_pb2.HealthCheckResponse.SERVING,
            }
            tracemalloc.start()
            try:
                before, _ = tracemalloc.get_traced_memory()
                for i in range(watches):
                    name = f"{i:08d}" + "x" * (name_chars - 8)
                    status = await _in_thread(functools.partial(watch, name))
                    assert status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                gc.collect()
                kept = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            # Kept for good, the names alone were 2.5 MiB (40 × 64 KiB).
            assert kept < watches * name_chars // 4, f"{kept} bytes kept after {watches} watches"


def test_a_watch_stream_that_ended_before_its_close_callback_is_not_sent_to() -> None:
    """A client cancelling right after the first answer ends the stream before the servicer adds its
    close callback: grpc's context then refuses the callback (``add_callback`` returns False) and never
    runs it. The reference servicer ignored that and kept sending every publication to the dead
    stream, each send holding the publisher (1,398 left after 3,000 such watches)."""
    health = _RouterHealth(lambda: True)
    health.set_serving(True)

    class _Ended:
        def add_callback(self, callback: Callable[[], None]) -> bool:
            return False  # what grpc answers for an RPC already terminated

    sent: list[int] = []
    ended = cast(grpc.ServicerContext, _Ended())
    health.Watch(health_pb2.HealthCheckRequest(service=""), ended, lambda reply: sent.append(reply.status))
    assert sent == [health_pb2.HealthCheckResponse.SERVING]  # the first answer, before the end was seen
    health.set_serving(False)
    assert sent == [health_pb2.HealthCheckResponse.SERVING]


class _DiscardSeen(set[Callable[[Any], None]]):
    """The health service's open streams, telling when one is forgotten (its close callback ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.discarded = threading.Event()

    def discard(self, element: object) -> None:
        super().discard(element)
        self.discarded.set()


def test_a_watch_answered_while_another_stream_ends_does_not_wait_on_grpcs_event_thread() -> None:
    """A Watch's first send waits for grpc's one event thread, which also runs an ended stream's close
    callback: sent under the lock that callback takes, each waited for the other for good, and no
    call was answered again (three clients opening and cancelling Watch streams wedged a
    sidecar). Here the first send waits until the other stream's callback has run."""
    first_send_waited: list[bool] = []
    sending = threading.Event()
    sent = threading.Event()

    class _Held(_RouterHealth):
        def Watch(self, request: Any, context: grpc.ServicerContext, send: Callable[[Any], None]) -> None:
            if ("held", "1") not in tuple(context.invocation_metadata()):
                return super().Watch(request, context, send)

            def send_after_the_other_ended(reply: Any) -> None:
                sending.set()
                ran = streams.discarded.wait(10.0)
                first_send_waited.append(ran)
                if ran:  # else not sent: the held lock is let go, or grpc stays wedged past the test
                    send(reply)
                sent.set()

            return super().Watch(request, context, send_after_the_other_ended)

        Watch.experimental_non_blocking = True  # type: ignore[attr-defined]

    health = _Held(lambda: True)
    health.set_serving(True)
    streams = health._streams = _DiscardSeen()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            other = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30.0)
            assert next(other).status == health_pb2.HealthCheckResponse.SERVING
            held = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30.0, metadata=(("held", "1"),))
            assert sending.wait(10.0)
            other.cancel()
            assert sent.wait(20.0)
            assert first_send_waited == [True], "the ended stream's callback waited for the Watch's lock"
            assert next(held).status == health_pb2.HealthCheckResponse.SERVING
            held.cancel()
    finally:
        server.stop(grace=None)


async def test_a_watch_stream_learns_a_stuck_routing_thread_is_not_serving(nursery: trio.Nursery) -> None:
    """A stuck routing thread publishes nothing: a Check found its publication stale, but a Watch
    stream (a load balancer's health checking) kept the last SERVING for the whole stall."""
    with trio.fail_after(60):
        async with rig(nursery) as r:
            stub = health_pb2_grpc.HealthStub(r.channel)
            stream = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=60.0)
            assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
            told = threading.Event()
            statuses: list[int] = []

            def watch() -> None:
                for reply in stream:
                    statuses.append(reply.status)
                    told.set()
                    return

            watcher = threading.Thread(target=watch)
            watcher.start()
            # The routing thread stuck until the stream has been told (no Check is sent meanwhile).
            held_until_told = told.wait(30.0)  # blocks the trio thread: the stall
            watcher.join(10.0)
            stream.cancel()
            assert held_until_told and statuses == [health_pb2.HealthCheckResponse.NOT_SERVING]


async def test_readiness_is_logged_as_it_changes(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """A whole outage left one line in the log: readiness turning false, and back, was on the health
    endpoints alone."""
    caplog.set_level(logging.INFO, logger="router.sidecar")
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    addrs = await nursery.start(cluster.serve_grpc)
    config = served_config(addrs, workers="")  # no worker: not ready
    with trio.fail_after(30):
        async with open_router(config) as handle, trio.open_nursery() as inner:
            await inner.start(Sidecar(handle, config).run)
            handle.discovery().set_static_workers(addrs.workers_arg)
            resolver = handle.leader_resolver()
            assert resolver is not None
            await resolver.leader()
            while sum("ready: leader" in r.getMessage() for r in caplog.records) == 0:  # noqa: ASYNC110
                await trio.sleep(0.05)  # the next publication (every READY_PUBLISH_S)
            inner.cancel_scope.cancel()
    told = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "router.sidecar" and "ready:" in r.msg]
    assert told[0] == (logging.WARNING, "not ready: discovery has no worker")
    assert told[1][0] == logging.INFO and told[1][1].startswith("ready: leader") and len(told) == 2, told


async def test_the_route_service_binds_its_address_off_the_trio_thread(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc resolves a host name to bind with a blocking lookup: on the trio thread a slow resolver
    held the router's actors, already running, for as long."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    addrs = await nursery.start(cluster.serve_grpc)
    bound_on_trio_thread: list[bool] = []
    real_server = grpc.server

    class Binding:
        """The real server, its binds watched."""

        def __init__(self, server: grpc.Server) -> None:
            self._server = server

        def add_insecure_port(self, address: str) -> int:
            bound_on_trio_thread.append(trio.lowlevel.in_trio_run())
            return self._server.add_insecure_port(address)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._server, name)

    monkeypatch.setattr(grpc, "server", lambda *args, **kwargs: Binding(real_server(*args, **kwargs)))
    config = served_config(addrs, serve=ServeConfig(grpc_listen="localhost:0"))
    with trio.fail_after(30):
        async with open_router(config) as handle, trio.open_nursery() as inner:
            bound: HostPort = await inner.start(Sidecar(handle, config).run)
            inner.cancel_scope.cancel()
    assert bound_on_trio_thread == [False]
    assert bound.port > 0


async def test_route_returns_kvcm_decision_for_seeded_prefix_and_health_serving(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        async with rig(nursery) as r:
            holder = r.cluster.worker_addr(2)
            r.cluster.kvcm.record_prefill(holder.http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
            assert await _in_thread(lambda: r.health("")) == health_pb2.HealthCheckResponse.SERVING
            assert await _in_thread(lambda: r.health(ROUTER_SERVICE)) == health_pb2.HealthCheckResponse.SERVING

            # The cap's whole budget: on a busy machine admission sheds a call with little budget
            # (answered domain/overloaded), and this one must be KVCM's.
            request = router_v1_pb2.RouteRequest(request_id="seeded", token_ids=PROMPT, budget_ms=1000)
            reply = await _in_thread(lambda: r.route(request))
            assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            assert reply.request_id == "seeded"
            assert (reply.route_source, reply.reason) == ("kvcm", "CACHE_LEADER"), "overloaded = shed"
            assert (reply.ip, reply.http_port, reply.grpc_port) == (holder.ip, holder.http_port, holder.grpc_port)
            assert reply.role == "PREFILL"
            assert (reply.local_blocks, reply.hit_tokens) == (8, 8 * BLOCK)
            assert reply.elapsed_ms > 0  # how fast is the machine's on the real clock: not asserted

            # Caller keys are used as given: the same prefix by its keys lands on the same holder.
            keys = block_keys(PROMPT, BLOCK, KeyFamily.RTP)
            by_keys = router_v1_pb2.RouteRequest(request_id="keys", block_cache_keys=keys, budget_ms=1000)
            reply = await _in_thread(lambda: r.route(by_keys))
            assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            assert (reply.route_source, reply.ip, reply.http_port) == ("kvcm", holder.ip, holder.http_port)
            assert r.sidecar.stats().answered == 2
            # Each KVCM answer was planned, probed and scored within the router's time, beside its query.
            timings = r.sidecar.take_call_timings()
            assert len(timings) == 2
            for timing in timings:
                assert timing.query_s is not None and timing.scoring_s is not None
                assert 0 < timing.scoring_s <= timing.router_s - timing.query_s


async def test_each_answered_call_leaves_one_timing_against_its_deadline_and_a_take_empties_them(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(15):
        async with rig(nursery) as r:
            # Budgets no loop lag on a busy machine makes admission shed (a shed call has no hops to time).
            short = router_v1_pb2.RouteRequest(request_id="short", token_ids=PROMPT, budget_ms=600)
            assert isinstance(await _in_thread(lambda: r.route(short)), router_v1_pb2.RouteDecision)
            # The client's deadline is tighter than this one's budget (the cap): it is the call's deadline.
            tight = router_v1_pb2.RouteRequest(request_id="tight", token_ids=PROMPT)
            assert isinstance(await _in_thread(lambda: r.route(tight, timeout=0.8)), router_v1_pb2.RouteDecision)
            bad = router_v1_pb2.RouteRequest(request_id="bad", token_ids=[1, 2], block_cache_keys=[3])
            assert _status(await _in_thread(lambda: r.route(bad))) == grpc.StatusCode.INVALID_ARGUMENT

            first, second = r.sidecar.take_call_timings()  # the refused call left none
            assert 0.0 < first.allowed_s <= 0.6  # its budget, less its wait for a handler thread
            assert 0.0 < second.allowed_s <= 0.85  # below the 1 s cap (grpc rounds the deadline)
            # The client's own time left at receipt rides along (what the bench counts a call reaching
            # the sidecar too late by, not allowed_s, which a wait for a handler thread can empty).
            assert first.client_left_s is not None and 0.0 < first.client_left_s <= CLIENT_TIMEOUT_S + 0.05
            assert second.client_left_s is not None and 0.0 < second.client_left_s <= 0.85
            for timing in (first, second):
                assert timing.elapsed_s > 0 and timing.lateness_s == timing.elapsed_s - timing.allowed_s
                # The router's own time rides along: it is part of the call's, the rest is the
                # sidecar's own path; each call queried KVCM.
                assert 0 < timing.router_s <= timing.elapsed_s
                assert timing.query_s is not None and 0 < timing.query_s <= timing.router_s
                assert timing.own_path_s == pytest.approx(timing.elapsed_s - timing.router_s)
                # Handed to the router: the hop there and the way back are parts of the call's time.
                assert timing.handed_s is not None and timing.way_back_s is not None
                assert timing.handed_s > 0 and timing.way_back_s > 0
                assert timing.handed_s + timing.router_s + timing.way_back_s <= timing.elapsed_s
            assert r.sidecar.take_call_timings() == []
            # A client that sets no deadline: grpc reports about 9.2e18 s left, which is none.
            no_deadline = router_v1_pb2.RouteRequest(request_id="open", token_ids=PROMPT, budget_ms=600)
            call = _route_call(r.channel)
            await _in_thread(lambda: call(no_deadline))
            (open_ended,) = r.sidecar.take_call_timings()
            assert open_ended.client_left_s is None


async def test_the_sidecars_call_outcomes_are_on_metrics(nursery: trio.Nursery) -> None:
    """A call refused from its message alone never reaches the router's decision counts: the sidecar's
    counts were only in the summary printed at its stop, not on /metrics."""
    with trio.fail_after(15):
        async with rig(nursery) as r:
            good = router_v1_pb2.RouteRequest(request_id="good", token_ids=PROMPT, budget_ms=600)
            assert isinstance(await _in_thread(lambda: r.route(good)), router_v1_pb2.RouteDecision)
            for i in range(2):
                bad = router_v1_pb2.RouteRequest(request_id=f"bad{i}", token_ids=[1, 2], block_cache_keys=[3])
                assert _status(await _in_thread(functools.partial(r.route, bad))) == grpc.StatusCode.INVALID_ARGUMENT
            registry = r.handle.metrics.registry

            def calls(outcome: str) -> float | None:
                return registry.get_sample_value("kvroute_sidecar_calls_total", {"outcome": outcome})

            assert (calls("answered"), calls("invalid"), calls("timed_out")) == (1.0, 2.0, 0.0)
            assert registry.get_sample_value("kvroute_sidecar_calls_in_flight") == 0.0
            decisions = registry.get_sample_value(
                "kvroute_route_decisions_total", {"route_source": "domain", "reason": "bad_request"}
            )
            assert decisions is None  # the router never saw them


async def test_a_decision_made_after_its_client_cancelled_is_counted_client_gone_not_answered(
    nursery: trio.Nursery,
) -> None:
    """A reply nobody received was counted answered: a client that cancelled (or whose deadline passed)
    while the router was still deciding."""
    with trio.fail_after(30):
        async with rig(nursery, router=HOLDING) as r:
            kvcm = _hang_the_kvcm_leader(r.cluster)
            call = _route_call(r.channel)
            pending: grpc.Future[router_v1_pb2.RouteDecision] = call.future(_slow_request("gone"), timeout=HOLD_S)
            try:
                assert await _in_thread(lambda: kvcm.wait_in_flight(KVCM_GET_HOST_CACHE_STATE, 1, 10.0))
                pending.cancel()
                # The RPC has ended on the server (its close callback ran); the router still waits on KVCM.
                assert await _in_thread(lambda: r.sidecar.wait_idle(10.0))
                assert r.sidecar.stats().in_flight == 1
            finally:
                r.cluster.kvcm.clear_faults()  # the router decides, and the handler returns its reply
            for _ in range(1000):
                if not r.sidecar.stats().in_flight:
                    break
                await trio.sleep(0.01)
            gone = r.sidecar.stats()
            assert (gone.in_flight, gone.answered, gone.client_gone) == (0, 0, 1)
            registry = r.handle.metrics.registry
            assert registry.get_sample_value("kvroute_sidecar_calls_total", {"outcome": "client_gone"}) == 1.0
            assert registry.get_sample_value("kvroute_sidecar_calls_total", {"outcome": "answered"}) == 0.0
            # A client that waits for its reply is answered, as before.
            kept = router_v1_pb2.RouteRequest(request_id="kept", token_ids=PROMPT, budget_ms=600)
            assert isinstance(await _in_thread(lambda: r.route(kept)), router_v1_pb2.RouteDecision)
            assert (r.sidecar.stats().answered, r.sidecar.stats().client_gone) == (1, 1)


@pytest.mark.parametrize(
    ("reply_margin_ms", "shed"),
    [(RouterConfig().reply_margin_ms, False), (30_000.0, True)],  # past the deadline: shed at receipt
    ids=["routed", "shed"],
)
async def test_an_answer_routing_nowhere_carries_its_error_in_the_trailing_metadata(
    nursery: trio.Nursery, reply_margin_ms: float, shed: bool
) -> None:
    """``route_source=none`` is a reply, not a gRPC error: why nothing was routed (here, no worker is
    known) reaches the client only in the trailing metadata, whether the router answered the call or
    the handler thread shed it."""
    router = RouterConfig(budget_cap_ms=1000.0, reply_margin_ms=reply_margin_ms)
    with trio.fail_after(15):
        async with rig(nursery, router=router, workers="") as r:
            request = router_v1_pb2.RouteRequest(request_id="nowhere", token_ids=PROMPT, budget_ms=1000)
            reply, call = await trio.to_thread.run_sync(
                lambda: _route_call(r.channel).with_call(request, timeout=10.0)
            )
            assert (reply.request_id, reply.route_source, reply.ip) == ("nowhere", "none", "")
            assert r.sidecar.stats().shed_at_receipt == int(shed)
            trailer = dict(call.trailing_metadata() or ())
            error = trailer.get(ERROR_METADATA_KEY)
            assert isinstance(error, str) and error.startswith("discovery has no worker"), trailer


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"token_ids": [1, 2, 3], "block_cache_keys": [4, 5]}, "token_ids"),  # both given
        ({}, "token_ids"),  # neither given
        ({"token_ids": [1] * 40, "roles": ["PREFILL", "MANAGER"]}, "roles"),  # unknown role name
        ({"token_ids": [1] * 40, "roles": ["DECODE"]}, "roles"),  # a role this deployment does not route
        ({"request_id": "", "token_ids": [1] * 40}, "request_id"),
        ({"block_cache_keys": [4, 5], "block_size": 0, "seq_len": 40}, None),  # 0 = not given: accepted
        # Beyond a bound (the defaults): refused from the sizes, naming the field and the bound.
        ({"request_id": "r" * 257, "token_ids": [1] * 40}, "request_id"),
        ({"token_ids": [1] * 262_145}, "token_ids"),
        ({"block_cache_keys": [1] * 16_385}, "block_cache_keys"),
        ({"token_ids": [1] * 40, "roles": ["PREFILL"] * 9}, "roles"),
        # seq_len must be the prompt's length.
        ({"token_ids": [1] * 1024, "seq_len": 5}, "seq_len"),
        ({"token_ids": [1] * 40, "seq_len": 2**32 - 1}, "seq_len"),
        ({"block_cache_keys": [4, 5], "seq_len": 5}, "seq_len"),
    ],
)
async def test_bad_request_is_invalid_argument_naming_the_field(
    nursery: trio.Nursery, fields: dict[str, object], named: str | None
) -> None:
    with trio.fail_after(15):
        async with rig(nursery) as r:
            request = router_v1_pb2.RouteRequest(**{"request_id": "bad", **fields})  # type: ignore[arg-type]
            outcome = await _in_thread(lambda: r.route(request))
            if named is None:
                assert isinstance(outcome, router_v1_pb2.RouteDecision), outcome
                return
            assert _status(outcome) is grpc.StatusCode.INVALID_ARGUMENT
            assert _details(outcome).startswith(f"{named}:"), _details(outcome)
            assert r.sidecar.stats().invalid == 1
            assert r.sidecar.stats().answered == 0


async def test_undecodable_request_is_invalid_argument(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        async with rig(nursery) as r:
            raw = r.channel.unary_unary(ROUTER_ROUTE, request_serializer=None, response_deserializer=None)

            def call() -> object:
                try:
                    return raw(b"\x0a\x7f", timeout=CLIENT_TIMEOUT_S)
                except grpc.RpcError as exc:
                    return exc

            outcome = await _in_thread(call)
            assert _status(outcome) is grpc.StatusCode.INVALID_ARGUMENT
            assert _details(outcome).startswith("request:")


@pytest.mark.parametrize(
    ("data", "details"),
    [
        (
            b"\x0a\x02a\xff" + router_v1_pb2.RouteRequest(token_ids=PROMPT).SerializeToString(),
            "request_id: not valid UTF-8 at byte 1",
        ),
        (
            router_v1_pb2.RouteRequest(request_id="r", token_ids=PROMPT, roles=["PREFILL"]).SerializeToString()
            + b"\x3a\x08\xffPREFILL",
            "roles: not valid UTF-8 at byte 0 of roles[1]",
        ),
    ],
)
async def test_a_string_that_is_not_utf8_is_invalid_argument_naming_its_field(
    nursery: trio.Nursery, data: bytes, details: str
) -> None:
    """protobuf's own error ("String field had bad UTF-8") named no field."""
    with trio.fail_after(15):
        async with rig(nursery) as r:
            raw = r.channel.unary_unary(ROUTER_ROUTE, request_serializer=None, response_deserializer=None)

            def call() -> object:
                try:
                    return raw(data, timeout=CLIENT_TIMEOUT_S)
                except grpc.RpcError as exc:
                    return exc

            outcome = await _in_thread(call)
            assert _status(outcome) is grpc.StatusCode.INVALID_ARGUMENT
            assert _details(outcome) == details
            assert r.sidecar.stats().invalid == 1


async def test_client_deadline_shorter_than_budget_bounds_the_decision(nursery: trio.Nursery) -> None:
    # A reply margin far above the default: the answer's way back must fit in it on a busy machine. The
    # hung query is not timed out before the budget: only the client's deadline can end the wait.
    router = RouterConfig(budget_cap_ms=5000.0, reply_margin_ms=300.0, kvcm_query_timeout_ms=60_000.0)
    with trio.fail_after(15):
        async with rig(nursery, router=router) as r:
            leader = r.cluster.kvcm.leader
            assert leader is not None
            r.cluster.kvcm.set_faults(leader, KvcmFaults(hang=True))
            # Budget 5 s but a 1 s client deadline: the router decides (without KVCM) the reply margin
            # before the client gives up, so the client gets an answer instead of DEADLINE_EXCEEDED.
            # (How close to its deadline it decided is the machine's on the real clock: not asserted.)
            request = router_v1_pb2.RouteRequest(request_id="short", token_ids=PROMPT, budget_ms=5000)
            reply = await _in_thread(lambda: r.route(request, timeout=1.0))
            assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            assert reply.route_source in ("domain", "shadow")
            r.cluster.kvcm.clear_faults()


async def test_a_call_beyond_the_handler_threads_waits_for_one_and_is_answered(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve = ServeConfig(grpc_listen="127.0.0.1:0", grpc_max_workers=2, grpc_max_concurrent_rpcs=8)
    with trio.fail_after(30):
        async with rig(nursery, serve=serve, router=HOLDING) as r:
            waiting_for_thread = _pool_waiting(r.sidecar, monkeypatch)
            third: list[object] = []

            async def call_a_third() -> None:
                async def third_call() -> None:
                    third.append(await _in_thread(lambda: r.route(_slow_request("third"), timeout=HOLD_S)))

                async with trio.open_nursery() as calls:
                    try:
                        calls.start_soon(third_call)
                        # Both threads are held: this call waits for one instead of being refused.
                        assert await _in_thread(lambda: waiting_for_thread(1)), "the third call never waited"
                    finally:
                        r.cluster.kvcm.clear_faults()  # the held calls are answered: their threads free up

            outcomes = await _with_calls_in_router(r, 2, call_a_third)
            assert all(isinstance(o, router_v1_pb2.RouteDecision) for o in [*outcomes, *third]), (outcomes, third)
            assert r.sidecar.stats().answered == 3


async def test_while_as_many_calls_wait_for_a_thread_as_there_are_threads_none_is_handed_to_the_router(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve = ServeConfig(grpc_listen="127.0.0.1:0", grpc_max_workers=1, grpc_max_concurrent_rpcs=8)
    # The call in the router holds the one thread (its KVCM query hangs) until both others wait for it.
    with trio.fail_after(30):
        async with rig(nursery, serve=serve, router=HOLDING) as r:
            waiting_for_thread = _pool_waiting(r.sidecar, monkeypatch)
            later: list[object] = []

            async def two_more() -> None:
                # Both wait for the one thread the call in the router holds. The first to get it
                # leaves the other waiting, so it is answered overloaded at once; the last finds no one
                # waiting and goes to the router (its time is ample: the admission takes it).
                async def one(request_id: str) -> None:
                    later.append(await _in_thread(lambda: r.route(_slow_request(request_id), timeout=HOLD_S)))

                async with trio.open_nursery() as both:
                    try:
                        both.start_soon(one, "b")
                        both.start_soon(one, "c")
                        assert await _in_thread(lambda: waiting_for_thread(2)), "b and c never both waited"
                    finally:
                        r.cluster.kvcm.clear_faults()  # the call in the router is answered: the thread frees up

            outcomes = await _with_calls_in_router(r, 1, two_more)
            assert all(isinstance(o, router_v1_pb2.RouteDecision) for o in [*outcomes, *later]), (outcomes, later)
            reasons = sorted(o.reason for o in later if isinstance(o, router_v1_pb2.RouteDecision))
            assert sorted(reason == "overloaded" for reason in reasons) == [False, True], reasons
            assert r.sidecar.stats().shed_at_receipt == 1


async def test_a_calls_wait_for_a_handler_thread_is_counted_against_its_budget(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget was counted from when a handler thread took the call: a call that waited behind a
    held thread longer than its budget got all of it again, and was routed long after it (one was
    answered 264 ms after it was sent with a budget of 100)."""
    serve = ServeConfig(grpc_listen="127.0.0.1:0", grpc_max_workers=1, grpc_max_concurrent_rpcs=8)
    with trio.fail_after(30):
        async with rig(nursery, serve=serve, router=HOLDING) as r:
            waiting_for_thread = _pool_waiting(r.sidecar, monkeypatch)
            short = router_v1_pb2.RouteRequest(request_id="short", token_ids=PROMPT, budget_ms=100)
            later: list[object] = []
            handled = r.handle.router_actor().health().handled

            async def behind_the_held_thread() -> None:
                async def one() -> None:
                    later.append(await _in_thread(lambda: r.route(short, timeout=HOLD_S)))

                async with trio.open_nursery() as calls:
                    try:
                        calls.start_soon(one)
                        assert await _in_thread(lambda: waiting_for_thread(1)), "the call never waited"
                        await trio.sleep(0.2)  # at least twice its budget waiting for the thread
                    finally:
                        r.cluster.kvcm.clear_faults()  # the held call is answered: the thread frees up

            await _with_calls_in_router(r, 1, behind_the_held_thread)
            (reply,) = later
            assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            assert reply.route_source == "domain", reply  # answered at once: not handed to the router
            assert r.handle.router_actor().health().handled == handled + 1  # the held call alone
            # Judged from its receipt: its wait took its whole budget, so it was owed an answer at once,
            # and its lateness is its time on the handler thread (the wait is gRPC's queueing, which P7
            # reports beside, as a budget gone at receipt).
            (waited,) = [t for t in r.sidecar.take_call_timings() if t.allowed_s == 0.0]
            assert waited.lateness_s == waited.elapsed_s


async def test_the_grpc_call_cap_refuses_the_call_beyond_it(nursery: trio.Nursery) -> None:
    serve = ServeConfig(grpc_listen="127.0.0.1:0", grpc_max_workers=2, grpc_max_concurrent_rpcs=2)
    with trio.fail_after(30):
        async with rig(nursery, serve=serve, router=HOLDING) as r:

            async def call_a_third() -> None:
                # Both calls hold a handler thread (their KVCM queries hang until this returns); a
                # third is refused at once.
                third = await _in_thread(lambda: r.route(_slow_request("third")))
                assert _status(third) is grpc.StatusCode.RESOURCE_EXHAUSTED

            outcomes = await _with_calls_in_router(r, 2, call_a_third)
            assert all(isinstance(o, router_v1_pb2.RouteDecision) for o in outcomes), outcomes


async def test_a_call_without_a_client_deadline_reaches_the_router_with_none(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """grpc reports about 9.2e18 s left for a call without a deadline, which is finite: it became the
    request's deadline, and the decision log wrote it as the call's ``dl``."""
    log = tmp_path / "decisions.log"
    router = RouterConfig(budget_cap_ms=1000.0, decision_log=str(log))
    serve = ServeConfig(grpc_listen="127.0.0.1:0", drain_lame_duck_s=0.0)
    with trio.fail_after(15):
        async with rig(nursery, router=router, serve=serve) as r:
            call = _route_call(r.channel)
            for request_id, timeout in (("open", None), ("timed", 5.0)):
                request = router_v1_pb2.RouteRequest(request_id=request_id, token_ids=PROMPT, budget_ms=600)
                await _in_thread(functools.partial(call, request, timeout=timeout))
            r.sidecar.drain()
            await r.stopped.wait()
    deadlines = {case.request_id: case.request.deadline for case in load_log([str(log)]).cases}
    assert deadlines["open"] is None
    assert deadlines["timed"] is not None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"token_ids": [1, 2, 3], "seq_len": 10**9}, "seq_len"),  # past --max-prompt-tokens
        ({"token_ids": [1, 2, 3], "block_size": 2 * BLOCK}, "block_size"),  # ids hashed with another size
        ({"token_ids": [1, 2, 3], "seq_len": 7}, "seq_len"),  # not the ids' count
        ({"block_cache_keys": [1, 2, 3], "block_size": 200_000}, "block_cache_keys"),  # covering past the limit
    ],
)
async def test_a_request_the_router_would_refuse_is_refused_when_it_would_be_shed(
    nursery: trio.Nursery, fields: dict[str, Any], named: str
) -> None:
    """Only the sizes and the shape were checked before a shed: under overload these got a worker
    (domain/overloaded) where at normal load they are refused, naming the field."""
    router = RouterConfig(budget_cap_ms=1000.0, reply_margin_ms=30_000.0)  # every call naming no roles is shed
    with trio.fail_after(15):
        async with rig(nursery, router=router) as r:
            request = router_v1_pb2.RouteRequest(request_id="odd", **fields)
            outcome = await _in_thread(lambda: r.route(request, timeout=10.0))
            assert _status(outcome) is grpc.StatusCode.INVALID_ARGUMENT
            assert _details(outcome).startswith(f"{named}:"), _details(outcome)
            assert r.sidecar.stats().shed_at_receipt == 0


async def test_a_token_id_the_family_does_not_hash_is_refused_when_the_call_would_be_shed(
    nursery: trio.Nursery,
) -> None:
    """A message's ids are 64-bit integers, and were shed as such: an sglang deployment's id past a
    uint32 got a worker (domain/overloaded) where at normal load it is refused, naming token_ids."""
    router = RouterConfig(budget_cap_ms=1000.0, reply_margin_ms=30_000.0)  # every call naming no roles is shed
    with trio.fail_after(15):
        async with rig(nursery, router=router, key_family=KeyFamily.SGLANG) as r:
            for at, token_id in ((0, 2**32), (len(PROMPT) - 1, -1)):
                tokens = list(PROMPT)
                tokens[at] = token_id
                request = router_v1_pb2.RouteRequest(request_id="odd", token_ids=tokens)
                outcome = await _in_thread(functools.partial(r.route, request, timeout=10.0))
                assert _status(outcome) is grpc.StatusCode.INVALID_ARGUMENT, outcome
                assert _details(outcome).startswith("token_ids:"), _details(outcome)
            assert r.sidecar.stats().shed_at_receipt == 0
            shed = await _in_thread(lambda: r.route(router_v1_pb2.RouteRequest(request_id="ok", token_ids=PROMPT)))
            assert isinstance(shed, router_v1_pb2.RouteDecision) and shed.reason == "overloaded", shed
            assert r.sidecar.stats().shed_at_receipt == 1


async def test_a_call_naming_a_role_not_routed_here_is_refused_when_the_router_would_shed_it(
    nursery: trio.Nursery,
) -> None:
    """A call naming roles goes to the router, whose shed checked no roles: with its one place taken,
    a role this deployment does not route got a worker (domain/overloaded), where at normal load it is
    INVALID_ARGUMENT naming roles."""
    with trio.fail_after(30):
        async with rig(nursery, router=dataclasses.replace(HOLDING, max_in_flight=1)) as r:
            kvcm = _hang_the_kvcm_leader(r.cluster)
            call = _route_call(r.channel)
            holding: grpc.Future[router_v1_pb2.RouteDecision] = call.future(_slow_request("holds"), timeout=HOLD_S)
            try:
                assert await _in_thread(lambda: kvcm.wait_in_flight(KVCM_GET_HOST_CACHE_STATE, 1, 10.0))
                named = router_v1_pb2.RouteRequest(request_id="named", token_ids=PROMPT, budget_ms=600)
                named.roles.append("PREFILL")
                shed = await _in_thread(lambda: r.route(named))
                assert isinstance(shed, router_v1_pb2.RouteDecision), shed
                assert shed.reason == "overloaded"  # the router's one place is taken
                foreign = router_v1_pb2.RouteRequest(request_id="foreign", token_ids=PROMPT, budget_ms=600)
                foreign.roles.extend(["PREFILL", "DECODE"])
                outcome = await _in_thread(lambda: r.route(foreign))
                assert _status(outcome) is grpc.StatusCode.INVALID_ARGUMENT
                assert _details(outcome).startswith("roles: DECODE not routed"), _details(outcome)
            finally:
                r.cluster.kvcm.clear_faults()  # the router decides, and the held call is answered
            assert isinstance(await _in_thread(holding.result), router_v1_pb2.RouteDecision)


async def test_a_call_shed_at_receipt_is_answered_counted_and_logged(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    log = tmp_path / "decisions.log"
    # A reply margin beyond the client's deadline leaves the router no time at all: every call
    # naming no roles is answered overloaded on the handler thread, before the trio thread sees it.
    router = RouterConfig(budget_cap_ms=1000.0, reply_margin_ms=30_000.0, decision_log=str(log))
    serve = ServeConfig(grpc_listen="127.0.0.1:0", drain_lame_duck_s=0.0)
    with trio.fail_after(15):
        async with rig(nursery, router=router, serve=serve) as r:
            keys = tuple(range(1, 65))
            request = router_v1_pb2.RouteRequest(request_id="shed-me", block_cache_keys=keys, block_size=BLOCK)
            before = r.handle.router_actor().health()
            reply = await _in_thread(lambda: r.route(request, timeout=10.0))
            assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            assert (reply.request_id, reply.route_source, reply.reason) == ("shed-me", "domain", "overloaded")
            assert reply.ip  # a routable worker, not an empty answer
            assert r.sidecar.stats().shed_at_receipt == 1
            # Recorded on the trio thread afterwards, in a batch: a stopping sidecar records what is
            # left before run() returns.
            r.sidecar.drain()
            await r.stopped.wait()
            after = r.handle.router_actor().health()
            assert after.overloaded == before.overloaded + 1
            assert after.handled == before.handled  # counted by the router, never routed by it
    cases = [c for c in load_log([str(log)]).cases if c.request_id == "shed-me"]
    assert len(cases) == 1 and cases[0].overloaded


async def test_readiness_reaches_watch_streams_from_a_thread_of_its_own(nursery: trio.Nursery) -> None:
    """grpc's health set sends to every Watch stream in turn and waits for each: with many streams
    that holds its caller for milliseconds, so the routing thread hands each publication over."""
    with trio.fail_after(20):
        async with rig(nursery) as r:
            published = threading.Event()
            ran_on: list[str] = []

            def set_serving(serving: bool) -> None:
                ran_on.append(threading.current_thread().name)
                published.set()

            r.sidecar._health.set_serving = set_serving  # type: ignore[method-assign]
            r.sidecar._publish(False)
            assert await trio.to_thread.run_sync(published.wait, 10.0)
            assert ran_on and ran_on[0].startswith("kvroute-health") and ran_on[0] != threading.current_thread().name


class _EndedByHand:
    """A handler context whose RPC ends when the test says: grpc sends a reply after the handler
    returns, and the call has ended only then."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.ended = False

    def time_remaining(self) -> float | None:
        return 30.0

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self.callbacks.append(callback)
        return True

    def set_trailing_metadata(self, metadata: object) -> None:
        pass

    def is_active(self) -> bool:
        return not self.ended

    def end(self) -> None:
        self.ended = True
        for callback in self.callbacks:
            callback()


async def test_a_drain_waits_for_replies_to_be_sent_not_for_handlers_to_return(nursery: trio.Nursery) -> None:
    """Stopping grpc once every handler had returned cancelled replies not yet sent: the router had
    decided, and the client was told UNAVAILABLE (a decision lost, seen under CPU load)."""
    with trio.fail_after(20):
        async with rig(nursery) as r:
            idle = r.sidecar._counters.idle
            context = _EndedByHand()
            request = router_v1_pb2.RouteRequest(request_id="sent-late", token_ids=PROMPT, budget_ms=500)
            as_grpc: Any = context  # the handler reads only what it defines
            reply = await trio.to_thread.run_sync(r.sidecar._route_rpc, request.SerializeToString(), as_grpc)
            assert router_v1_pb2.RouteDecision.FromString(reply).request_id == "sent-late"
            assert r.sidecar.stats().in_flight == 0 and not idle.is_set()  # returned, its reply not yet sent
            context.end()
            assert idle.is_set()


async def test_a_drain_ends_with_every_default_trio_thread_held(nursery: trio.Nursery) -> None:
    """Hung name lookups hold trio's default threads: the drain's waits have a thread of their own."""
    serve = ServeConfig(grpc_listen="127.0.0.1:0", drain_lame_duck_s=0.0, drain_timeout_s=60.0)
    release = threading.Event()
    default = trio.to_thread.current_default_thread_limiter()
    with trio.fail_after(30):  # against a hang; the drain's grace alone is twice that
        async with rig(nursery, serve=serve) as r, trio.open_nursery() as holders:
            for _ in range(int(default.total_tokens) - int(default.borrowed_tokens)):
                holders.start_soon(functools.partial(trio.to_thread.run_sync, release.wait, abandon_on_cancel=True))
            await trio.testing.wait_all_tasks_blocked()
            assert default.borrowed_tokens == default.total_tokens
            try:
                r.sidecar.drain()  # no Route call in flight: the drain ends after its lame duck
                await r.stopped.wait()
            finally:
                release.set()


async def test_a_call_whose_client_gave_up_keeps_its_place_until_the_router_is_done_with_it(
    nursery: trio.Nursery,
) -> None:
    """Freed at the handler's timeout, the places would let clients that time out (the storm the gate
    is for) hand over call after call to a trio thread that had not started the first ones."""
    with trio.fail_after(30):
        async with rig(nursery) as r:
            gate = r.sidecar._gate
            request = router_v1_pb2.RouteRequest(request_id="warm", token_ids=PROMPT, budget_ms=500)
            assert isinstance(await trio.to_thread.run_sync(r.route, request), router_v1_pb2.RouteDecision)
            token = trio.lowlevel.current_trio_token()

            def impatient_round(first: int) -> list[object]:
                calls = [
                    router_v1_pb2.RouteRequest(request_id=f"i{first + i}", token_ids=PROMPT, budget_ms=1000)
                    for i in range(8)
                ]
                with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:  # a second: room on a busy machine
                    return list(pool.map(functools.partial(r.route, timeout=1.0), calls))

            def two_rounds_while_held() -> tuple[list[object], int, list[object], int]:
                held = _hold(token)  # the trio thread runs nothing until this is set
                try:
                    first = impatient_round(0)
                    after_first = gate.in_router()
                    second = impatient_round(100)
                    return first, after_first, second, gate.in_router()
                finally:
                    held.set()

            first, after_first, second, after_second = await trio.to_thread.run_sync(two_rounds_while_held)
            timed_out = sum(isinstance(c, grpc.RpcError) for c in first)
            # Each handed call timed out, its place kept (on a busy machine a call can also time out in
            # grpc's queue, never handed: at least as many timed out as places are held).
            assert 0 < after_first <= timed_out
            assert after_second <= INITIAL_IN_FLIGHT_LIMIT  # never more handed over than the limit
            assert sum(isinstance(c, grpc.RpcError) for c in second) >= after_second - after_first
            for _ in range(1000):  # each place is freed once the router settles its call
                if not gate.in_router():
                    break
                await trio.sleep(0.01)
            assert gate.in_router() == 0
            # A handler that waited out its deadline for a decision counts it as timed out, not failed:
            # the two are told apart on the metrics. (A handler whose wait outlasted its client's by a
            # hair may get the decision once the thread runs again: its client is gone by then.)
            assert await _in_thread(lambda: _handlers_returned(r.sidecar))
            stats = r.sidecar.stats()
            assert stats.timed_out >= after_first and stats.failed == 0
            assert stats.timed_out + stats.client_gone == after_second


async def test_a_handed_call_that_got_no_reply_leaves_a_timing_marked_unanswered(nursery: trio.Nursery) -> None:
    """A latency taken over the replies alone leaves out the slowest calls, those the sidecar gave up
    on: each leaves a timing too, to the giving up, marked unanswered and never on time."""
    with trio.fail_after(30):
        async with rig(nursery) as r:
            request = router_v1_pb2.RouteRequest(request_id="warm", token_ids=PROMPT, budget_ms=500)
            assert isinstance(await trio.to_thread.run_sync(r.route, request), router_v1_pb2.RouteDecision)
            r.sidecar.take_call_timings()
            token = trio.lowlevel.current_trio_token()

            def round_while_held() -> list[object]:
                # The client waits longer than the budget (and its slack): the sidecar gives up first.
                calls = [
                    router_v1_pb2.RouteRequest(request_id=f"h{i}", token_ids=PROMPT, budget_ms=300) for i in range(4)
                ]
                held = _hold(token)  # the trio thread takes no call until this is set
                try:
                    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
                        return list(pool.map(functools.partial(r.route, timeout=5.0), calls))
                finally:
                    held.set()

            replies = await trio.to_thread.run_sync(round_while_held)
            assert await _in_thread(lambda: _handlers_returned(r.sidecar))
            stats = r.sidecar.stats()
            timings = r.sidecar.take_call_timings()
            unanswered = [t for t in timings if not t.answered]
            # Each call was shed, answered, or handed and given up on; the last leave unanswered timings.
            assert len(timings) == len(replies)
            assert len(unanswered) == stats.timed_out + stats.unavailable + stats.failed
            assert unanswered, "the held trio thread left some handed call unanswered"
            for timing in unanswered:
                assert timing.route_source is None and timing.handed_s is None  # the trio thread never took it
                assert timing.elapsed_s > 0 and timing.client_left_s is not None


async def test_a_call_whose_client_gave_up_is_timed_to_the_give_up_not_to_the_stall(nursery: trio.Nursery) -> None:
    """Below one place the router is left idle after each call for a multiple of that call's time. A
    call whose client timed out during a stall of the trio thread is timed to when its client gave up:
    timed to the settling, the stall's length would leave the router idle for several times it."""
    with trio.fail_after(30):
        async with rig(nursery) as r:
            gate = r.sidecar._gate
            request = router_v1_pb2.RouteRequest(request_id="warm", token_ids=PROMPT, budget_ms=1000)
            assert isinstance(await trio.to_thread.run_sync(r.route, request), router_v1_pb2.RouteDecision)
            gate._limit._limit = 0.25  # a duty cycle: idle three times each call's time after it
            token = trio.lowlevel.current_trio_token()

            def one_call_through_a_stall() -> object:
                held = _hold(token)
                try:
                    late = router_v1_pb2.RouteRequest(request_id="late", token_ids=PROMPT, budget_ms=1000)
                    return r.route(late, timeout=0.1)
                finally:
                    time.sleep(1.0)  # the stall goes on after the client gave up
                    held.set()

            assert isinstance(await trio.to_thread.run_sync(one_call_through_a_stall), grpc.RpcError)
            for _ in range(1000):  # the place is freed once the router settles the call
                if not gate.in_router():
                    break
                await trio.sleep(0.01)
            assert gate.in_router() == 0
            # Timed to the give-up, the idle time (three times about 0.1 s) ended during the stall.
            assert gate._limit.idle_until < time.monotonic()


async def test_a_hand_off_or_a_shed_racing_the_calls_nursery_closing_is_refused_or_recorded_not_a_crash(
    nursery: trio.Nursery,
) -> None:
    # When the sidecar is stopped at once its calls' nursery closes a moment before run() lets go of
    # it, and a handler thread's run_sync_soon may land in that moment: starting a task there raises,
    # and a raising callback would crash the whole trio run.
    with trio.fail_after(15):
        async with rig(nursery) as r:
            async with trio.open_nursery() as closed:
                pass
            sidecar, live = r.sidecar, r.sidecar._calls
            assert live is not None
            sidecar._calls = closed
            try:
                message = router_v1_pb2.RouteRequest(request_id="late", block_cache_keys=(1, 2), block_size=BLOCK)
                answer: concurrent.futures.Future[RouteDecision] = concurrent.futures.Future()
                now = time.monotonic()
                sidecar._spawn(converted(message), None, (now, 0.03), now, answer, _CallHops(lambda **_: None))
                assert isinstance(answer.exception(timeout=0), _Stopped)  # refused: UNAVAILABLE, not routed
                published = r.handle.router_actor().overload_answers()
                assert published is not None and published.answers
                before = r.handle.router_actor().health().overloaded
                sidecar._sheds.open(r.handle.router_actor(), closed)
                assert sidecar._sheds.add(message, published.answers[0], 0.05, 0.03, len(message.token_ids))
                sidecar._sheds._record_soon()  # the recorder's wake-up, as run_sync_soon runs it
                assert r.handle.router_actor().health().overloaded == before + 1  # recorded at once
            finally:
                sidecar._calls = live
                sidecar._sheds.open(r.handle.router_actor(), live)


async def test_the_routing_budget_counts_the_wait_for_the_routing_task_to_start(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    log = tmp_path / "decisions.log"
    router = RouterConfig(budget_cap_ms=5000.0, decision_log=str(log))
    with trio.fail_after(20):
        async with rig(nursery, router=router) as r:
            keys = tuple(range(1, 65))
            message = router_v1_pb2.RouteRequest(request_id="lagged", block_cache_keys=keys, block_size=BLOCK)
            answer: concurrent.futures.Future[RouteDecision] = concurrent.futures.Future()
            # Received 5 s ago with 8 s to route: 3 s left now, at most 2.8 s once the stall below has
            # passed, and (the wait counted twice: 10.4 s of 8) none if the wait were counted twice.
            received = time.monotonic() - 5.0
            hops = _CallHops(lambda **_: None)
            r.sidecar._spawn(converted(message), None, (received, 8.0), time.monotonic(), answer, hops)
            # The loop busy with other work before the routing task can start: blocking it is the point.
            time.sleep(0.2)  # noqa: ASYNC251
            decision = await trio.to_thread.run_sync(answer.result, 10.0)
            assert decision.request_id == "lagged"
    (case,) = [c for c in load_log([str(log)]).cases if c.request_id == "lagged"]
    # What the router was given is what was left when its task started, not at the hand-off.
    # Neither more than it had, nor nothing (the wait counted twice leaves none);
    # the seconds of slack below 2.8 s hold however busy the machine.
    assert case.request.budget_ms is not None and 0.0 < case.request.budget_ms <= 2800.0


def _route_call(
    channel: grpc.Channel,
) -> grpc.UnaryUnaryMultiCallable[router_v1_pb2.RouteRequest, router_v1_pb2.RouteDecision]:
    """The Route method on ``channel``, with messages (its futures can be cancelled)."""
    return channel.unary_unary(
        ROUTER_ROUTE,
        request_serializer=router_v1_pb2.RouteRequest.SerializeToString,
        response_deserializer=router_v1_pb2.RouteDecision.FromString,
    )


def _hang_the_kvcm_leader(cluster: SimCluster) -> CallStats:
    """The KVCM leader accepts calls and never answers; its call counts."""
    leader = cluster.kvcm.leader
    assert leader is not None
    cluster.kvcm.set_faults(leader, KvcmFaults(hang=True))
    return cluster.kvcm.stats(leader)


def _slow_request(request_id: str) -> router_v1_pb2.RouteRequest:
    return router_v1_pb2.RouteRequest(request_id=request_id, token_ids=PROMPT, budget_ms=int(HOLD_S * 1000))


def _pool_waiting(sidecar: Sidecar, monkeypatch: pytest.MonkeyPatch) -> Callable[[int], bool]:
    """A blocking wait (at most 10 s; False if it ran out) for ``count`` calls waiting for a handler
    thread, as the sidecar's pool counts them: every call the pool is given notifies the wait."""
    pool = sidecar._pool
    assert pool is not None
    changed = threading.Condition()
    submit = pool.submit

    def submitted(fn: Callable[..., object], /, *args: object, **kwargs: object) -> concurrent.futures.Future[object]:
        future = submit(fn, *args, **kwargs)
        with changed:
            changed.notify_all()
        return future

    monkeypatch.setattr(pool, "submit", submitted)

    def wait(count: int) -> bool:
        with changed:
            return changed.wait_for(lambda: pool.waiting >= count, 10.0)

    return wait


async def _with_calls_in_router(r: Rig, n: int, body: Callable[[], Awaitable[None]]) -> list[object]:
    """Start ``n`` calls that wait in the router, each holding its handler thread (KVCM hangs, and the
    rig's ``router=HOLDING`` lets them wait longer than the test), run ``body`` once all are in
    flight, then let KVCM answer them (``body`` may do it sooner with ``r.cluster.kvcm.clear_faults()``;
    a failing body does too, so no thread is left waiting); the calls' outcomes."""
    leader = r.cluster.kvcm.leader
    assert leader is not None
    r.cluster.kvcm.set_faults(leader, KvcmFaults(hang=True))
    stats = r.cluster.kvcm.stats(leader)
    slow = _slow_request("in-flight")
    outcomes: list[object] = []

    async def one() -> None:
        outcomes.append(await _in_thread(lambda: r.route(slow, timeout=HOLD_S)))

    async with trio.open_nursery() as clients:
        try:
            for _ in range(n):
                clients.start_soon(one)
            assert await _in_thread(lambda: stats.wait_in_flight(KVCM_GET_HOST_CACHE_STATE, n, 10.0))
            await body()
        finally:
            r.cluster.kvcm.clear_faults()
    assert len(outcomes) == n
    return outcomes


async def _drain_with_one_call_in_flight(r: Rig, body: Callable[[], Awaitable[None]]) -> object:
    """Start a call that waits in the router (KVCM hangs; the rig needs ``router=HOLDING``), drain, run
    ``body``, then let KVCM answer the call; the call's outcome."""

    async def drain_then_body() -> None:
        assert r.sidecar.stats().in_flight == 1
        r.sidecar.drain()
        await body()

    (outcome,) = await _with_calls_in_router(r, 1, drain_then_body)
    return outcome


async def test_drain_lame_duck_refuses_new_calls_and_says_not_serving(nursery: trio.Nursery) -> None:
    # A lame duck outlasting the test: it is still on when the test looks, however slow the machine.
    serve = ServeConfig(grpc_listen="127.0.0.1:0", drain_lame_duck_s=HOLD_S, drain_timeout_s=2 * HOLD_S)
    with trio.fail_after(30):
        async with rig(nursery, serve=serve, router=HOLDING) as r:
            refused: list[object] = []

            async def during_lame_duck() -> None:
                assert await _in_thread(lambda: r.health("")) == health_pb2.HealthCheckResponse.NOT_SERVING
                # Every readiness view agrees (the debug endpoint's /readyz reads this one).
                assert r.handle.ready() == (False, "draining: new calls are refused")
                late = router_v1_pb2.RouteRequest(request_id="late", token_ids=PROMPT)
                refused.append(await _in_thread(lambda: r.route(late)))

            in_flight = await _drain_with_one_call_in_flight(r, during_lame_duck)
            # The call in flight when the drain began got its decision; the new one was refused
            # (not routed, so safe to send elsewhere).
            assert isinstance(in_flight, router_v1_pb2.RouteDecision), in_flight
            assert _status(refused[0]) is grpc.StatusCode.UNAVAILABLE
            assert "draining" in _details(refused[0])
            final = r.sidecar.stats()
            assert (final.answered, final.unavailable, final.in_flight, final.timed_out) == (1, 1, 0, 0)
            assert not r.stopped.is_set()  # still within the lame duck


async def test_a_lame_duck_longer_than_the_drain_timeout_ends_with_the_timeout(nursery: trio.Nursery) -> None:
    """The lame duck is the first part of the drain, not added to it: a --drain-lame-duck-s beyond
    --drain-timeout-s is cut to it, and the drain ends within the timeout."""
    serve = ServeConfig(grpc_listen="127.0.0.1:0", drain_lame_duck_s=HOLD_S, drain_timeout_s=0.3)
    with trio.fail_after(30):
        async with rig(nursery, serve=serve) as r:
            r.sidecar.drain()
            with trio.fail_after(5):  # the timeout and ample room; the lame duck alone would outlast the test
                await r.stopped.wait()


async def test_drain_stops_the_server_once_calls_are_done(nursery: trio.Nursery) -> None:
    # The drain gives the call in flight (answered once the test lets KVCM answer) ample time.
    serve = ServeConfig(grpc_listen="127.0.0.1:0", drain_lame_duck_s=0.0, drain_timeout_s=HOLD_S)
    with trio.fail_after(30):
        async with rig(nursery, serve=serve, router=HOLDING) as r:

            async def nothing() -> None:
                pass

            in_flight = await _drain_with_one_call_in_flight(r, nothing)
            assert isinstance(in_flight, router_v1_pb2.RouteDecision), in_flight
            await r.stopped.wait()  # run() returned by itself after the drain
            late = await _in_thread(lambda: r.route(router_v1_pb2.RouteRequest(request_id="late", token_ids=PROMPT)))
            assert _status(late) is grpc.StatusCode.UNAVAILABLE
            final = r.sidecar.stats()
            assert (final.answered, final.in_flight, final.timed_out) == (1, 0, 0)


async def test_a_drain_ends_at_its_timeout_with_a_call_still_in_the_router(nursery: trio.Nursery) -> None:
    """The drain's grace bounds it: a call still waiting in the router (KVCM hangs, for longer than the
    test) when --drain-timeout-s runs out is cut, and run() returns while KVCM still hangs."""
    serve = ServeConfig(grpc_listen="127.0.0.1:0", drain_lame_duck_s=0.0, drain_timeout_s=0.5)
    with trio.fail_after(30):
        async with rig(nursery, serve=serve, router=HOLDING) as r:

            async def stopped_while_kvcm_hangs() -> None:
                await r.stopped.wait()  # the grace, not the call's end: KVCM answers only after this

            cut = await _drain_with_one_call_in_flight(r, stopped_while_kvcm_hangs)
            assert not isinstance(cut, router_v1_pb2.RouteDecision), cut
            # Counted as cut, not as refused: the stop's summary read 0 cut (it took the calls in
            # flight after they had ended) and the cut calls among the refused.
            assert await _in_thread(lambda: _handlers_returned(r.sidecar))
            stats = r.sidecar.stats()
            assert (stats.cut_at_drain_deadline, stats.unavailable, stats.in_flight) == (1, 0, 0), stats


def _handlers_returned(sidecar: Sidecar, within_s: float = 10.0) -> bool:
    """Whether every Route handler has returned within ``within_s`` (a cut call's handler returns just
    after the sidecar's run: its routing task is cancelled last)."""
    until = time.monotonic() + within_s
    while sidecar.stats().in_flight and time.monotonic() < until:
        time.sleep(0.001)
    return not sidecar.stats().in_flight


async def test_wait_idle_returns_once_no_route_call_is_open(nursery: trio.Nursery) -> None:
    """What a measurement waits on before reading the sidecar's timings: a call still in the router
    keeps it from returning true; once the call's reply is sent it does."""
    with trio.fail_after(30):
        async with rig(nursery, serve=ServeConfig(grpc_listen="127.0.0.1:0"), router=HOLDING) as r:

            async def while_held() -> None:
                assert not await _in_thread(lambda: r.sidecar.wait_idle(0.05))

            (answer,) = await _with_calls_in_router(r, 1, while_held)
            assert isinstance(answer, router_v1_pb2.RouteDecision), answer
            assert await _in_thread(lambda: r.sidecar.wait_idle(10.0))


class _LittleLeft(_EndedByHand):
    """A handler context whose client has ``left_s`` of its deadline."""

    def __init__(self, left_s: float) -> None:
        super().__init__()
        self.left_s = left_s

    def time_remaining(self) -> float | None:
        return self.left_s


class _RecordingGate(HandOffGate):
    def __init__(self) -> None:
        super().__init__(InFlightLimit(initial=16, ceiling=256, floor=RouterConfig().admission_duty_floor), waiters=0)
        self.had_s: list[float] = []

    def answered(
        self, *, handed_at: float, had_s: float, answered: bool, crowded: bool = False, at: float | None = None
    ) -> None:
        self.had_s.append(had_s)
        super().answered(handed_at=handed_at, had_s=had_s, answered=answered, crowded=crowded, at=at)


async def test_a_call_whose_client_gave_up_before_a_handler_took_it_is_ended_unread(nursery: trio.Nursery) -> None:
    """Under a shed storm calls reached the handler threads after their clients' deadlines had passed in
    gRPC's queues, and each was read, shed and recorded: CPU the calls queued behind it needed to be
    answered in time."""
    with trio.fail_after(30):
        async with rig(nursery) as r:
            registry = r.handle.metrics.registry
            handled = r.handle.router_actor().health().handled
            for left_s in (0.0, -0.010):
                as_grpc: Any = _LittleLeft(left_s)  # the handler reads only what it defines
                with pytest.raises(PeerAbort) as ended:
                    # Not a RouteRequest: read, it would be refused INVALID_ARGUMENT.
                    await trio.to_thread.run_sync(r.sidecar._route_rpc, b"\xff\xff\xff", as_grpc)
                assert ended.value.status is RpcStatus.DEADLINE_EXCEEDED
            stats = r.sidecar.stats()
            assert (stats.expired_at_receipt, stats.invalid, stats.timed_out, stats.shed_at_receipt) == (2, 0, 0, 0)
            assert stats.in_flight == 0
            expired = registry.get_sample_value("kvroute_sidecar_calls_total", {"outcome": "expired_at_receipt"})
            assert expired == 2.0
            assert r.sidecar.take_call_timings() == []
            # A call with a little of its client's deadline left is still answered, and timed.
            little = router_v1_pb2.RouteRequest(request_id="little", token_ids=PROMPT, budget_ms=100)
            as_grpc = _LittleLeft(0.0005)
            reply = await trio.to_thread.run_sync(r.sidecar._route_rpc, little.SerializeToString(), as_grpc)
            assert router_v1_pb2.RouteDecision.FromString(reply).request_id == "little"
            (timing,) = r.sidecar.take_call_timings()
            assert timing.client_left_s == 0.0005
            assert r.sidecar.stats().expired_at_receipt == 2
            assert r.handle.router_actor().health().handled <= handled + 1  # the router never saw the two


async def test_calls_naming_roles_with_no_time_left_teach_the_in_flight_limit_nothing(nursery: trio.Nursery) -> None:
    """A call naming roles goes to the router even with no time left; released as answered with no
    time to spare it counted as late however fast it came back, so forty of them shrank the limit to
    a fraction of a place and the next calls, with ample time, were shed on an idle router."""
    with trio.fail_after(30):
        async with rig(nursery, router=RouterConfig(budget_cap_ms=1000.0)) as r:

            async def call(request_id: str, left_s: float, roles: tuple[str, ...] = ()) -> str:
                message = router_v1_pb2.RouteRequest(request_id=request_id, token_ids=PROMPT, budget_ms=100)
                message.roles.extend(roles)
                as_grpc: Any = _LittleLeft(left_s)  # the handler reads only what it defines
                try:
                    reply = await trio.to_thread.run_sync(r.sidecar._route_rpc, message.SerializeToString(), as_grpc)
                except PeerAbort as abort:  # the handler waits no longer than the client's deadline
                    assert abort.status is RpcStatus.DEADLINE_EXCEEDED
                    return "deadline"
                return router_v1_pb2.RouteDecision.FromString(reply).reason

            gate = _RecordingGate()
            r.sidecar._gate = gate
            await call("warm", 5.0)
            share = gate._limit.share
            # The own path's allowance is no time to spare for a call that had none for the router.
            r.sidecar._path_cost_s = 0.010
            for i in range(40):  # 0.5 ms left: less than the reply margin
                assert await call(f"late-{i}", 0.0005, ("PREFILL",)) == "deadline"
            # A handler that gave up holds its place until the router answers, and the release comes
            # with that answer: the last one's may not have come when its handler returned.
            await trio.testing.wait_all_tasks_blocked()
            assert len(gate.had_s) == 41 and all(had_s <= 0 for had_s in gate.had_s[1:]), gate.had_s
            assert gate._limit.share >= share
            r.sidecar._path_cost_s = 0.0
            assert await call("ample", 5.0) != "overloaded"


async def test_a_large_requests_wait_for_its_reading_turn_counts_against_its_budget(nursery: trio.Nursery) -> None:
    """The router counts a call's budget from receipt, the wait to be read included; the sidecar's
    admission counted it from after that wait, so a call whose budget the wait had used up was handed
    over anyway (and answered deadline by the router) instead of shed at once."""
    with trio.fail_after(60):
        # The cap bounds the wait for a reading turn: far above the other reader's 100 ms, so a starved
        # machine's late timer thread still hands the turn over within it.
        async with rig(nursery, router=RouterConfig(budget_cap_ms=20_000.0)) as r:
            sidecar = r.sidecar
            prompt = tuple(range(100_000, 106_000))  # above the large-request size: read in turn
            message = router_v1_pb2.RouteRequest(request_id="big", token_ids=prompt, budget_ms=60)
            data = message.SerializeToString()
            assert len(data) > sidecar._large_request_bytes

            def read_after_another() -> router_v1_pb2.RouteDecision:
                sidecar._large_requests.acquire()  # another large request is being read ...
                threading.Timer(0.1, sidecar._large_requests.release).start()  # ... for longer than 60 ms
                as_grpc: Any = _EndedByHand()  # the handler reads only what it defines
                return router_v1_pb2.RouteDecision.FromString(sidecar._route_rpc(data, as_grpc))

            decision = await trio.to_thread.run_sync(read_after_another)
            assert decision.reason == "overloaded"
            assert sidecar.stats().shed_at_receipt == 1


def test_request_conversion_maps_zero_to_not_given_and_names_bad_roles() -> None:
    message = router_v1_pb2.RouteRequest(request_id="x", token_ids=[1, 2], roles=["pdfusion"])
    request = request_from_proto(message, LIMITS, BLOCK)
    assert request.token_ids == (1, 2)
    assert request.block_cache_keys is None
    assert (request.block_size, request.seq_len, request.budget_ms) == (None, None, None)
    assert request.roles == (Role.PDFUSION,)
    full = request_from_proto(
        router_v1_pb2.RouteRequest(request_id="y", block_cache_keys=[9], block_size=32, seq_len=40, budget_ms=7),
        LIMITS,
        BLOCK,
    )
    assert (full.block_cache_keys, full.block_size, full.seq_len, full.budget_ms) == ((9,), 32, 40, 7.0)
    # A dotless "ı" upper-cases to "I": "prefıll" was read as PREFILL.
    for bad in ("UNKNOWN", "nope", "", "prefıll", "vıt"):
        with pytest.raises(BadRequest) as info:
            request_from_proto(router_v1_pb2.RouteRequest(request_id="z", token_ids=[1], roles=[bad]), LIMITS, BLOCK)
        assert info.value.field_name == "roles"


@given(keys=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=600))
def test_keys_read_off_the_wire_reach_the_query_encoded_once(keys: list[int]) -> None:
    """The sidecar encodes a request's keys for the KVCM query from protobuf's own list, and the checks
    take that encoding as it is: the same bytes as encoding the keys as Python ints, made once."""
    message = router_v1_pb2.RouteRequest.FromString(
        router_v1_pb2.RouteRequest(request_id="k", block_cache_keys=keys).SerializeToString()
    )
    request = request_from_proto(message, LIMITS, BLOCK)
    assert isinstance(request, WireRouteRequest) and request.encoded_keys is not None
    carried = request.encoded_keys[1]
    assert carried == encode_block_keys(keys)
    deployment = DeploymentConfig(block_size=BLOCK)
    checked = check_request(request, deployment, LIMITS)
    assert checked.keys == tuple(keys)
    assert checked.encoded_keys is carried  # taken, not encoded again
    # A copy with the budget the sidecar sets keeps the keys, and their encoding with them.
    assert check_request(dataclasses.replace(request, budget_ms=5.0), deployment, LIMITS).encoded_keys is carried
    assert sheddable(request, deployment, LIMITS) == len(keys) * BLOCK


def test_a_copy_with_other_keys_is_encoded_again_and_one_without_them_keeps_none() -> None:
    message = router_v1_pb2.RouteRequest(request_id="k", block_cache_keys=[1, 2, 3])
    request = request_from_proto(message, LIMITS, BLOCK)
    other = dataclasses.replace(request, block_cache_keys=(7, 8))
    assert isinstance(other, WireRouteRequest) and other.encoded_keys is None
    checked = check_request(other, DeploymentConfig(block_size=BLOCK), LIMITS)
    assert checked.keys == (7, 8)
    assert checked.encoded_keys == encode_block_keys((7, 8))
    # The decision log's record drops the prompt, which a waiting record must not hold through its encoding.
    kept = without_prompt(request, LIMITS.max_request_id_bytes)
    assert kept.block_cache_keys is None
    assert isinstance(kept, WireRouteRequest) and kept.encoded_keys is None


def test_the_client_deadline_counts_the_wait_to_reach_the_trio_thread() -> None:
    # 5 ms left when the handler sent the call on; it reached the trio thread 2 ms later.
    assert caller_deadline(100.0, 0.005, sent_at=7.0, arrived_at=7.002) == pytest.approx(100.003)
    # Clocks that seem to go backwards never lengthen the deadline.
    assert caller_deadline(100.0, 0.005, sent_at=7.0, arrived_at=6.9) == pytest.approx(100.005)


def test_the_budget_counts_from_the_calls_receipt_not_its_hand_off() -> None:
    assert budget_left_ms(0.050, received_at=100.0, arrived_at=100.004) == pytest.approx(46.0)
    assert budget_left_ms(0.050, received_at=100.0, arrived_at=100.080) == 0.0  # spent waiting: nothing left
    assert budget_left_ms(0.050, received_at=100.0, arrived_at=99.9) == pytest.approx(50.0)  # clocks never add


async def test_each_replys_way_back_reaches_the_deadline_splits_tail(nursery: trio.Nursery) -> None:
    """The handler thread times each reply from the router's answer to its bytes; the next call hands
    those times to the metrics sink, whose split estimate adds them to the router's own tail."""
    with trio.fail_after(15):
        async with rig(nursery) as r:
            calls = 3
            for i in range(calls):
                request = router_v1_pb2.RouteRequest(request_id=f"c{i}", token_ids=PROMPT, budget_ms=500)
                reply = await _in_thread(functools.partial(r.route, request))
                assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            count = r.handle.metrics.registry.get_sample_value(
                "kvroute_route_duration_seconds_count", {"stage": REPLY_STAGE_LABEL}
            )
            assert count == calls - 1  # the last one's time waits for the next call


def test_a_huge_role_name_is_quoted_cut_short() -> None:
    with pytest.raises(BadRequest) as info:
        huge = router_v1_pb2.RouteRequest(request_id="z", token_ids=[1], roles=["X" * 100_000])
        request_from_proto(huge, LIMITS, BLOCK)
    assert info.value.field_name == "roles"
    assert len(str(info.value)) < 200 and "100000 chars" in str(info.value)


def test_oversized_fields_are_refused_from_their_sizes_naming_the_bound() -> None:
    limits = LimitsConfig(max_prompt_tokens=4, max_block_keys=2, max_roles=1, max_request_id_bytes=3)
    cases = [
        (router_v1_pb2.RouteRequest(request_id="abcd", token_ids=[1]), "request_id", "--max-request-id-bytes"),
        # Bytes, not characters: two 2-byte characters are 4 bytes.
        (router_v1_pb2.RouteRequest(request_id="éé", token_ids=[1]), "request_id", "3 UTF-8 bytes"),
        (router_v1_pb2.RouteRequest(request_id="a", token_ids=[1] * 5), "token_ids", "limit of 4"),
        (router_v1_pb2.RouteRequest(request_id="a", block_cache_keys=[1] * 3), "block_cache_keys", "limit of 2"),
        (router_v1_pb2.RouteRequest(request_id="a", token_ids=[1], roles=["PREFILL"] * 2), "roles", "--max-roles"),
    ]
    for message, field, says in cases:
        with pytest.raises(BadRequest) as info:
            request_from_proto(message, limits, BLOCK)
        assert info.value.field_name == field
        assert says in str(info.value), str(info.value)
    at_the_bounds = router_v1_pb2.RouteRequest(request_id="abc", token_ids=[1] * 4, roles=["PREFILL"])
    assert request_from_proto(at_the_bounds, limits, BLOCK).token_ids == (1, 1, 1, 1)


def test_decision_conversion_keeps_every_field() -> None:
    decision = RouteDecision(
        request_id="d",
        worker=WorkerAddr.from_http("10.0.0.7", 8000),
        role=Role.PDFUSION,
        route_source=RouteSource.SHADOW,
        reason=Reason.SHORTEST_TTFT,
        hit_tokens=128,
        local_blocks=2,
        elapsed_ms=1.25,
    )
    message = decision_to_proto(decision)
    assert (message.ip, message.http_port, message.grpc_port) == ("10.0.0.7", 8000, 8001)
    assert (message.role, message.route_source, message.reason) == ("PDFUSION", "shadow", "SHORTEST_TTFT")
    assert (message.hit_tokens, message.local_blocks, message.elapsed_ms) == (128, 2, 1.25)
    nowhere = decision_to_proto(
        dataclasses.replace(decision, worker=None, role=None, route_source=RouteSource.NONE, reason=Reason.NO_WORKERS)
    )
    assert (nowhere.ip, nowhere.http_port, nowhere.role, nowhere.route_source) == ("", 0, "", "none")


def test_a_call_is_crowded_when_it_waited_for_a_thread_more_than_half_its_deadline() -> None:
    share = ServeConfig().crowded_wait_share  # the default, a half
    assert crowded(0.06, 0.04, share) and not crowded(0.04, 0.06, share)
    assert not crowded(5.0, None, share) and not crowded(5.0, math.inf, share)  # no client deadline: never
    assert not crowded(0.06, 0.04, 0.7)


def test_the_handler_pool_counts_the_calls_waiting_for_a_thread_and_each_ones_wait() -> None:
    wait = _ThreadWait()
    pool = _TimedPool(wait, max_workers=1, thread_name_prefix="test-pool")
    try:
        holding, release = threading.Event(), threading.Event()

        def hold() -> float:
            holding.set()
            release.wait(10.0)
            return wait.waited_s

        first = pool.submit(hold)
        assert holding.wait(10.0)
        second = pool.submit(lambda: wait.waited_s)
        assert pool.waiting == 1  # the one thread is held: the second call waits for it
        release.set()
        assert first.result(10.0) >= 0.0
        assert second.result(10.0) > 0.0 and pool.waiting == 0
    finally:
        pool.shutdown(wait=True)


def test_a_shed_reply_spliced_from_the_drawn_answers_bytes_parses_as_the_whole_decision() -> None:
    drawn = RouteDecision(
        request_id="",
        worker=WorkerAddr.from_http("10.0.0.7", 8000),
        role=Role.PREFILL,
        route_source=RouteSource.DOMAIN,
        reason=Reason.OVERLOADED,
        role_addrs=(RoleAddr(Role.PREFILL, "10.0.0.7", 8000, 8001), RoleAddr(Role.DECODE, "10.0.0.8", 8000, 8001)),
        error_code=3,
        error="busy",
    )
    body = shed_reply_body(drawn)
    for request_id, elapsed_ms in (("r-1", 0.042), ("", 0.0), ("x" * 300, 12.5)):
        spliced = router_v1_pb2.RouteDecision.FromString(shed_reply(body, request_id, elapsed_ms))
        whole = decision_to_proto(dataclasses.replace(drawn, request_id=request_id, elapsed_ms=elapsed_ms))
        assert spliced == whole


async def test_the_sidecar_learns_its_own_path_cost_and_decides_that_much_earlier(nursery: trio.Nursery) -> None:
    """Every answered call measures what the sidecar's own path cost beyond the routing itself; a client
    deadline and the routing budget are shortened by that estimate before the router gets them
    (structural: no timing bound)."""
    with trio.fail_after(15):
        async with rig(nursery) as r:
            assert r.sidecar.path_cost_ms() == 0.0
            # The cap's whole budget: on a busy machine the loop's lag alone can make admission shed a
            # call with little budget, and a shed call measures no path.
            request = router_v1_pb2.RouteRequest(request_id="cost", token_ids=PROMPT, budget_ms=1000)
            for _ in range(5):
                reply = await _in_thread(lambda: r.route(request, timeout=5.0))
                assert isinstance(reply, router_v1_pb2.RouteDecision), reply
                assert reply.reason != "overloaded", "shed: no path cost to learn from this call"
            learned = r.sidecar.path_cost_ms()
            assert learned > 0.0  # the hand-offs between threads are never free
            # A client deadline shorter than the learned cost leaves the router nothing: the handler
            # answers overloaded at once, without handing the call to the router.
            r.sidecar._path_cost_s = 10.0  # an estimate larger than any deadline below
            shed_before = r.sidecar.stats().shed_at_receipt
            reply = await _in_thread(lambda: r.route(request, timeout=5.0))
            assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            assert (reply.reason, reply.route_source) == ("overloaded", "domain")
            assert r.sidecar.stats().shed_at_receipt == shed_before + 1
            shed_timing = r.sidecar.take_call_timings()[-1]
            assert (shed_timing.handed_s, shed_timing.way_back_s) == (None, None)  # never handed off
            # No client deadline: the budget alone, shortened by the same estimate, leaves the router no
            # time for KVCM (its whole budget would have routed the call via KVCM, as above).
            reply = await _in_thread(lambda: r.route(request, timeout=None))
            assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            assert reply.route_source == "domain" and reply.reason in ("overloaded", "deadline"), reply
            # Judged against the whole budget (less the call's wait for a thread), not less the estimate,
            # which would leave it none: no bound on that wait, which a busy machine makes long.
            assert r.sidecar.take_call_timings()[-1].allowed_s > 0.0


async def test_the_in_flight_limit_judges_a_call_by_its_budget_with_the_own_path_in_it(nursery: trio.Nursery) -> None:
    """The router decides the own-path estimate before the budget's end; the gate times the call to
    its release, that path included, so it is judged against the whole budget: taken off twice, the
    estimate made answers in time count late and shrank the limit (structural: no timing bound)."""
    with trio.fail_after(15):
        async with rig(nursery) as r:
            gate = _RecordingGate()
            r.sidecar._gate = gate
            r.sidecar._path_cost_s = 0.5  # half of the budget below
            request = router_v1_pb2.RouteRequest(request_id="had", token_ids=PROMPT, budget_ms=1000)
            reply = await _in_thread(lambda: r.route(request, timeout=None))
            assert isinstance(reply, router_v1_pb2.RouteDecision), reply
            assert reply.reason != "overloaded", reply  # routed: half the budget is plenty
            [had_s] = gate.had_s
            # The budget less the hand-off, not less the estimate as well: the call reached the trio
            # thread (handed_s) after its hand-off, so at least the budget less that.
            timing = r.sidecar.take_call_timings()[-1]
            assert timing.handed_s is not None
            assert had_s >= timing.allowed_s - timing.handed_s - 1e-9


def test_a_stall_counts_in_the_own_path_estimate_at_most_as_the_calls_routing_time() -> None:
    assert next_path_cost(0.001, 0.003, 0.030) == pytest.approx(0.9 * 0.001 + 0.1 * 0.003)
    # A 200 ms stall of a call with 30 ms to route: a tenth of 30 ms, not of 200.
    assert next_path_cost(0.001, 0.200, 0.030) == pytest.approx(0.9 * 0.001 + 0.1 * 0.030)
    assert next_path_cost(0.001, -0.5, 0.030) == pytest.approx(0.9 * 0.001)  # never below zero


def test_an_error_carried_in_metadata_is_printable_ascii_and_bounded() -> None:
    """A peer's error text (the master's message) may hold newlines or any character; gRPC refuses a
    metadata value that is not printable ASCII, which would turn the decision into INTERNAL."""
    text = metadata_text("the master said: café\nline two \x00 ✓")
    assert text.isascii() and all(0x20 <= ord(c) < 0x7F for c in text)
    assert "caf\\xe9" in text and "\\n" in text
    long = metadata_text("x" * 5000)
    assert len(long) == ERROR_METADATA_CHARS and long.endswith("~")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"request_id": "", "token_ids": [1, 2]}, "request_id"),
        ({"request_id": " \t", "token_ids": [1, 2]}, "request_id"),
        ({"request_id": "r"}, "token_ids"),
        ({"request_id": "r", "token_ids": [1], "block_cache_keys": [2]}, "token_ids"),
    ],
)
def test_a_malformed_shape_is_refused_before_the_call_could_be_shed(fields: dict[str, object], named: str) -> None:
    """Checked with the sizes, before admission may answer the call ``overloaded``: a malformed call is
    refused naming the field, never answered with a worker."""
    with pytest.raises(BadRequest, match=f"^{named}:"):
        check_proto_bounds(router_v1_pb2.RouteRequest(**fields), LIMITS, BLOCK)  # type: ignore[arg-type]
    check_proto_bounds(router_v1_pb2.RouteRequest(request_id="r", token_ids=[1, 2]), LIMITS, BLOCK)  # well formed


@given(
    timing=st.builds(
        CallTiming,
        elapsed_s=st.floats(allow_nan=False),
        allowed_s=st.floats(allow_nan=False),
        router_s=st.floats(allow_nan=False),
        query_s=st.none() | st.floats(allow_nan=False),
        handed_s=st.none() | st.floats(allow_nan=False),
        way_back_s=st.none() | st.floats(allow_nan=False),
        scoring_s=st.none() | st.floats(allow_nan=False),
        client_left_s=st.none() | st.floats(allow_nan=False),
        route_source=st.none() | st.sampled_from(RouteSource),
        answered=st.booleans(),
    )
)
def test_a_kept_call_timing_reads_back_equal_and_leaves_the_collectors_view(timing: CallTiming) -> None:
    """The timings a measurement keeps (every call of a rate) are rows the collector stops tracking at
    its first collection; taken, each is the CallTiming it was."""
    row = _timing_row(timing)
    gc.collect(1)  # the row is young: the collections of its generations untrack it
    assert not gc.is_tracked(row)
    assert _call_timing(row) == timing
