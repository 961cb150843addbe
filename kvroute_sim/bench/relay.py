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
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from router.config import ChannelPoolConfig, DeploymentConfig
from router.targets import TargetError, parse_target
from router.transport.errors import TransportError
from router.transport.grpc_adapter import channel_options
from router.transport.grpc_server import method_handlers
from router.types import CacheQuery, Reason, RouteSource
from router.wire import decode, paths, router_v1_pb2

THREAD_PREFIX = "p8-relay"


class RelayFloor:
    """Started on construction (a loopback port of its own, ``target``); ``stop()`` ends it."""

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
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix=THREAD_PREFIX),
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
        query = decode.encode_cache_query(CacheQuery(self._instance_id, self._query_type, keys))
        try:
            reply = self._kvcm(query, timeout=query_timeout_s(request.budget_ms, self._budget_cap_ms))
            state = decode.decode_cache_state(reply, self._kvcm_target, len(keys))
            best = max(state.hosts, key=lambda host: host.local, default=None)
            host = parse_target(best.host_ip_port) if best is not None and best.local > 0 else None
        except (grpc.RpcError, TransportError, TargetError):  # failed, garbled, an error in the reply's header
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


def query_timeout_s(budget_ms: float, budget_cap_ms: float) -> float:
    """What the router would give the query: the request's budget (0: none given), at most the cap."""
    return (min(budget_ms, budget_cap_ms) if budget_ms > 0 else budget_cap_ms) / 1e3


def _fallback(request: router_v1_pb2.RouteRequest, reason: Reason) -> router_v1_pb2.RouteDecision:
    return router_v1_pb2.RouteDecision(
        request_id=request.request_id, route_source=RouteSource.DOMAIN.value, reason=reason.value
    )
