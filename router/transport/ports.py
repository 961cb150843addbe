"""The ports actors depend on. Adapters: gRPC (grpc_adapter) and in-memory (memory_adapter).

Deadlines are never arguments: every call is bounded by the caller's trio cancel
scope, and the gRPC adapter passes the remaining time as the RPC's ``timeout=``.
"""

from __future__ import annotations

from typing import Protocol

from router.types import CacheQuery, CacheState, ClusterInfo, WorkerStatus


class RawRpc(Protocol):
    """A unary call carrying serialized bytes on a pinned method path."""

    async def call(self, target: str, method_path: str, request: bytes) -> bytes:
        """Raise a ``TransportError`` on failure; ``trio.Cancelled`` if the caller's scope ends."""
        ...

    def invalidate(self, target: str) -> None:
        """Forget any connection to ``target`` after a transport failure."""
        ...


class KvcmTransport(Protocol):
    async def get_cluster_info(self, target: str, instance_id: str, trace_id: str = "") -> ClusterInfo: ...

    async def get_host_cache_state(self, target: str, query: CacheQuery) -> CacheState: ...


class WorkerStatusTransport(Protocol):
    async def get_worker_status(self, target: str, latest_finished_version: int) -> WorkerStatus: ...
