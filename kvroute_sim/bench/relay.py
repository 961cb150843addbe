"""P8's relay floor: a router with no routing in it, on the sidecar's core.

A grpcio server built as the sidecar's is (a pool of ``grpc_max_workers`` handler threads, the same
concurrency limit), whose Route handler makes the one remote call a steady-state decision makes — a
blocking GetHostCacheState to the KVCM leader for the request's block keys — and answers with the
host that holds the most of them. No trio, no admission, no probing, no scoring, no bookkeeping: what
grpcio's server and client cost per routed call on this core. Its knee under P8's schedule is the
highest any router built on grpcio's sync server and client could show here, so where it lies beyond
the sidecar's, the gap is the router's own work, not the transport's.

Each call is timed from its handler's start to its serialised reply, as the sidecar's are. The query
gets the request's ``budget_ms``, or the router's cap when it names none. A request without block keys,
or a query that fails (refused, timed out, garbled, or naming a host that is no ``host:port``), is
answered from the domain with the failure's reason (a fallback, as P8 counts them).

``BridgedRelayFloor`` is the same relay with the sidecar's way through trio: its handler threads hand
each call to the trio thread (``run_sync_soon``, a task in a nursery, a ``concurrent.futures`` future
the handler waits on), where the query is made as the router makes it (``.future()`` and the router's
``wait_future`` bridge, under a trio deadline) and answered from the reply. It shares the trio thread
with the router, whose background work goes on. Where its knee lies beyond the sidecar's, the gap is
the router's own work and not the hand-off any trio-hosted router pays.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import outcome
import trio

from router.config import ChannelPoolConfig, DeploymentConfig
from router.request import budget_deadline
from router.targets import TargetError, parse_target
from router.thread_bridge import ANSWER_SLACK_S, settle
from router.transport.errors import TransportError
from router.transport.grpc_adapter import channel_options, wait_future
from router.transport.grpc_server import method_handlers
from router.types import CacheQuery, Reason, RouteSource
from router.wire import decode, paths, router_v1_pb2

THREAD_PREFIX = "p8-relay"
BRIDGED_THREAD_PREFIX = "p8-bridged"


class RelayFloor:
    """Started on construction (a loopback port of its own, ``target``); ``stop()`` ends it."""

    thread_prefix = THREAD_PREFIX

    def __init__(self, kvcm_target: str, *, workers: int, max_concurrent_rpcs: int, budget_cap_ms: float) -> None:
        deployment = DeploymentConfig()
        self._budget_cap_ms = budget_cap_ms
        self._instance_id = deployment.kvcm_instance_id
        self._query_type = deployment.query_type
        self._kvcm_target = kvcm_target
        self._channel = grpc.insecure_channel(kvcm_target, options=channel_options(ChannelPoolConfig()))
        self._kvcm = self._channel.unary_unary(paths.KVCM_GET_HOST_CACHE_STATE, None, None)
        self._lock = threading.Lock()
        self._elapsed_ms: list[float] = []
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.thread_prefix),
            handlers=[method_handlers({paths.ROUTER_ROUTE: self._route})],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=[("grpc.so_reuseport", 0)],
        )
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.target = f"127.0.0.1:{port}"

    def stop(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()

    def take_ms(self) -> list[float]:
        """Receipt to reply (ms) of each call answered since the last take."""
        with self._lock:
            taken, self._elapsed_ms = self._elapsed_ms, []
        return taken

    def _route(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        received = time.perf_counter()
        request = router_v1_pb2.RouteRequest.FromString(data)
        reply = self.decide(request).SerializeToString()
        elapsed_ms = (time.perf_counter() - received) * 1e3
        with self._lock:
            self._elapsed_ms.append(elapsed_ms)
        return reply

    def decide(self, request: router_v1_pb2.RouteRequest) -> router_v1_pb2.RouteDecision:
        """The host holding the most of the request's blocks, by one blocking query."""
        keys = tuple(request.block_cache_keys)
        if not keys:
            return _fallback(request, Reason.BAD_REQUEST)
        try:
            reply = self._kvcm(self._query(keys), timeout=self._timeout_s(request))
        except grpc.RpcError:  # failed, refused or timed out
            return _fallback(request, Reason.KVCM_ERROR)
        return self._answer(request, keys, reply)

    def _query(self, keys: tuple[int, ...]) -> bytes:
        return decode.encode_cache_query(CacheQuery(self._instance_id, self._query_type, keys))

    def _timeout_s(self, request: router_v1_pb2.RouteRequest) -> float:
        return query_timeout_s(request.budget_ms, self._budget_cap_ms)

    def _answer(
        self, request: router_v1_pb2.RouteRequest, keys: tuple[int, ...], reply: bytes
    ) -> router_v1_pb2.RouteDecision:
        """The decision KVCM's ``reply`` makes: its best holder, or the fallback its failure makes."""
        try:
            state = decode.decode_cache_state(reply, self._kvcm_target, len(keys))
            best = max(state.hosts, key=lambda host: host.local, default=None)
            host = parse_target(best.host_ip_port) if best is not None and best.local > 0 else None
        except (TransportError, TargetError):  # garbled, an error in the reply's header, a host not host:port
            return _fallback(request, Reason.KVCM_ERROR)
        if best is None or host is None:
            return _fallback(request, Reason.NO_POSITIVE_MATCH)
        return router_v1_pb2.RouteDecision(
            request_id=request.request_id,
            ip=host.host,
            http_port=host.port,
            route_source=RouteSource.KVCM.value,
            reason=Reason.CACHE_LEADER.value,
            local_blocks=best.local,
        )


class BridgedRelayFloor(RelayFloor):
    """The relay floor through the sidecar's hand-off to trio (see the module's text). Made in the trio
    thread; ``nursery`` holds the calls' tasks and must outlive ``stop()``."""

    thread_prefix = BRIDGED_THREAD_PREFIX

    def __init__(
        self,
        kvcm_target: str,
        *,
        nursery: trio.Nursery,
        workers: int,
        max_concurrent_rpcs: int,
        budget_cap_ms: float,
    ) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._nursery = nursery
        super().__init__(
            kvcm_target, workers=workers, max_concurrent_rpcs=max_concurrent_rpcs, budget_cap_ms=budget_cap_ms
        )

    def decide(self, request: router_v1_pb2.RouteRequest) -> router_v1_pb2.RouteDecision:
        """Handed to the trio thread and waited for, as the sidecar's handler waits for its router."""
        answer: concurrent.futures.Future[router_v1_pb2.RouteDecision] = concurrent.futures.Future()
        timeout_s = self._timeout_s(request)
        try:
            self._token.run_sync_soon(self._spawn, request, timeout_s, answer)
            return answer.result(timeout=timeout_s + ANSWER_SLACK_S)
        except trio.RunFinishedError:  # the trio thread is gone: nobody to hand the call to
            return _fallback(request, Reason.INTERNAL_ERROR)
        except concurrent.futures.TimeoutError:  # only a stuck trio thread gets here
            answer.cancel()
            return _fallback(request, Reason.DEADLINE)

    def _spawn(
        self,
        request: router_v1_pb2.RouteRequest,
        timeout_s: float,
        answer: concurrent.futures.Future[router_v1_pb2.RouteDecision],
    ) -> None:
        try:
            self._nursery.start_soon(self._decide, request, timeout_s, answer)
        except RuntimeError:  # the nursery has closed (the bench is ending): answered, not lost
            settle(answer, outcome.Value(_fallback(request, Reason.INTERNAL_ERROR)))

    async def _decide(
        self,
        request: router_v1_pb2.RouteRequest,
        timeout_s: float,
        answer: concurrent.futures.Future[router_v1_pb2.RouteDecision],
    ) -> None:
        # Whatever happens here, the handler thread gets an answer (a bug still raises, after it).
        decision: router_v1_pb2.RouteDecision | None = None
        try:
            keys = tuple(request.block_cache_keys)
            if not keys:
                decision = _fallback(request, Reason.BAD_REQUEST)
                return
            try:
                future = self._kvcm.future(self._query(keys), timeout=timeout_s)
            except ValueError:  # the channel is closed: the relay has stopped
                return
            with trio.move_on_after(timeout_s):
                await wait_future(future)
            if future.cancelled() or not future.done() or future.exception() is not None:
                decision = _fallback(request, Reason.KVCM_ERROR)
            else:
                decision = self._answer(request, keys, future.result())
        finally:
            if decision is None:
                decision = _fallback(request, Reason.INTERNAL_ERROR)
            settle(answer, outcome.Value(decision))


def query_timeout_s(budget_ms: float, budget_cap_ms: float) -> float:
    """What the router would give the query: the request's budget (proto3's 0: none given), at most the
    cap, as the sidecar reads it."""
    return budget_deadline(float(budget_ms) or None, 0.0, budget_cap_ms)


def _fallback(request: router_v1_pb2.RouteRequest, reason: Reason) -> router_v1_pb2.RouteDecision:
    return router_v1_pb2.RouteDecision(
        request_id=request.request_id, route_source=RouteSource.DOMAIN.value, reason=reason.value
    )
