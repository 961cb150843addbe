"""Typed clients for the upstream services over any ``RawRpc`` adapter.

The gRPC and in-memory adapters differ only in how bytes travel; encoding and
decoding are shared here, so one contract test suite covers both.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.transport.errors import TransportError
from router.transport.ports import InTurnCall, RawRpc, WorkerStatusAsk, WorkerStatusReply
from router.types import CacheQuery, CacheState, ClusterInfo, EngineGeneration, WorkerStatus
from router.wire import decode, paths


class KvcmClient:
    """``KvcmTransport`` over a ``RawRpc``."""

    def __init__(self, rpc: RawRpc) -> None:
        self._rpc = rpc

    async def get_cluster_info(self, target: str, instance_id: str, trace_id: str = "") -> ClusterInfo:
        reply = await self._rpc.call(
            target, paths.KVCM_GET_CLUSTER_INFO, decode.encode_cluster_info_request(instance_id, trace_id)
        )
        return decode.decode_cluster_info(reply, target)

    async def get_host_cache_state(self, target: str, query: CacheQuery) -> CacheState:
        reply = await self._rpc.call(target, paths.KVCM_GET_HOST_CACHE_STATE, decode.encode_cache_query(query))
        return decode.decode_cache_state(reply, target)


class WorkerStatusClient:
    """``WorkerStatusTransport`` over a ``RawRpc``, with the deployment's engine generation."""

    def __init__(self, rpc: RawRpc, generation: EngineGeneration = EngineGeneration.K) -> None:
        self._rpc = rpc
        self._generation = generation

    async def get_worker_status(self, target: str, latest_finished_version: int) -> WorkerStatus:
        reply = await self._rpc.call(
            target, paths.WORKER_GET_STATUS, decode.encode_status_version(latest_finished_version)
        )
        return decode.decode_worker_status(reply, target, self._generation)

    async def get_worker_statuses(self, asks: Sequence[WorkerStatusAsk], within_s: float) -> list[WorkerStatusReply]:
        calls = [
            InTurnCall(ask.target, paths.WORKER_GET_STATUS, decode.encode_status_version(ask.latest_finished_version))
            for ask in asks
        ]
        replies = await self._rpc.call_in_turn(calls, within_s)
        return [
            WorkerStatusReply(self._decoded(reply.outcome, ask.target), reply.ended_after_s)
            for reply, ask in zip(replies, asks, strict=True)
        ]

    def _decoded(self, reply: bytes | TransportError | None, target: str) -> WorkerStatus | TransportError | None:
        if not isinstance(reply, bytes):
            return reply
        try:
            return decode.decode_worker_status(reply, target, self._generation)
        except TransportError as exc:  # a garbled reply fails its own ask, not the batch
            return exc
