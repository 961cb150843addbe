"""Typed clients for the upstream services over any ``RawRpc`` adapter.

The gRPC and in-memory adapters differ only in how bytes travel; encoding and
decoding are shared here, so one contract test suite covers both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

import trio

from router.transport.errors import TransportError
from router.transport.ports import InTurnCall, RawRpc, WorkerStatusAsk, WorkerStatusReply
from router.types import CacheQuery, CacheState, ClusterInfo, EngineGeneration, WorkerStatus
from router.wire import decode, paths

_T = TypeVar("_T")

# A reply larger than this is decoded on a thread: decoding is Python work per entry (a KVCM answer's
# hosts, a worker's tasks), and a reply near the message cap would hold the routing thread for a
# second. A reply of a few entries decodes at once, as a hop to a thread costs more than it.
LARGE_REPLY_BYTES = 16 * 1024
DECODE_THREADS = 2  # threads of their own: trio's default ones may all be held (hung name lookups)


async def decoded(decode_reply: Callable[[], _T], size: int, threads: trio.CapacityLimiter) -> _T:
    """``decode_reply()``, here for a small reply, on one of ``threads`` for a large one (``size``
    bytes). Abandoned on cancel: decoding touches nothing but the reply. A large reply's hop is a
    checkpoint, so a caller's time can run out here with the reply in hand: the callers' ``on_answered``
    tells them so."""
    if size <= LARGE_REPLY_BYTES:
        return decode_reply()
    return await trio.to_thread.run_sync(decode_reply, limiter=threads, abandon_on_cancel=True)


class KvcmClient:
    """``KvcmTransport`` over a ``RawRpc``."""

    def __init__(self, rpc: RawRpc) -> None:
        self._rpc = rpc
        self._decode_threads = trio.CapacityLimiter(DECODE_THREADS)

    async def get_cluster_info(self, target: str, instance_id: str, trace_id: str = "") -> ClusterInfo:
        reply = await self._rpc.call(
            target, paths.KVCM_GET_CLUSTER_INFO, decode.encode_cluster_info_request(instance_id, trace_id)
        )
        return decode.decode_cluster_info(reply, target)

    async def get_host_cache_state(
        self, target: str, query: CacheQuery, *, on_answered: Callable[[], None] | None = None
    ) -> CacheState:
        reply = await self._rpc.call(target, paths.KVCM_GET_HOST_CACHE_STATE, decode.encode_cache_query(query))
        if on_answered is not None:
            on_answered()
        state = partial(decode.decode_cache_state, reply, target, len(query.block_keys))
        return await decoded(state, len(reply), self._decode_threads)


class WorkerStatusClient:
    """``WorkerStatusTransport`` over a ``RawRpc``, with the deployment's engine generation."""

    def __init__(self, rpc: RawRpc, generation: EngineGeneration = EngineGeneration.K) -> None:
        self._rpc = rpc
        self._generation = generation
        self._decode_threads = trio.CapacityLimiter(DECODE_THREADS)

    async def get_worker_status(
        self,
        target: str,
        latest_finished_version: int,
        *,
        background: bool = False,
        on_sent: Callable[[], None] | None = None,
        sent_timeout_s: float | None = None,
        on_answered: Callable[[], None] | None = None,
    ) -> WorkerStatus:
        reply = await self._rpc.call(
            target,
            paths.WORKER_GET_STATUS,
            decode.encode_status_version(latest_finished_version),
            on_sent=on_sent,
            sent_timeout_s=sent_timeout_s,
            background=background,
        )
        if on_answered is not None:
            on_answered()
        status = partial(decode.decode_worker_status, reply, target, self._generation)
        return await decoded(status, len(reply), self._decode_threads)

    async def get_worker_statuses(self, asks: Sequence[WorkerStatusAsk], within_s: float) -> list[WorkerStatusReply]:
        calls = [
            InTurnCall(ask.target, paths.WORKER_GET_STATUS, decode.encode_status_version(ask.latest_finished_version))
            for ask in asks
        ]
        replies = await self._rpc.call_in_turn(calls, within_s)

        def batch() -> list[WorkerStatusReply]:
            return [
                WorkerStatusReply(self._decoded(reply.outcome, ask.target), reply.ended_after_s, reply.began_after_s)
                for reply, ask in zip(replies, asks, strict=True)
            ]

        # Judged by its largest reply: a round of many ordinary statuses decodes at once, as each would.
        largest = max((len(reply.outcome) for reply in replies if isinstance(reply.outcome, bytes)), default=0)
        return await decoded(batch, largest, self._decode_threads)

    def _decoded(self, reply: bytes | TransportError | None, target: str) -> WorkerStatus | TransportError | None:
        if not isinstance(reply, bytes):
            return reply
        try:
            return decode.decode_worker_status(reply, target, self._generation)
        except TransportError as exc:  # a garbled reply fails its own ask, not the batch
            return exc
