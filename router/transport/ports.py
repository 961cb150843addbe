"""The ports actors depend on. Adapters: gRPC (grpc_adapter) and in-memory (memory_adapter); the
scheduler's: master_http, master_grpc and master_memory.

Deadlines are never arguments: every call is bounded by the caller's trio cancel
scope, and the gRPC adapter passes the remaining time as the RPC's ``timeout=``. The one
exception is a batch made in turn (``call_in_turn``), whose calls share one time allowance.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import NamedTuple, Protocol, TypeVar

from router.transport.errors import TransportError
from router.types import CacheQuery, CacheState, ClusterInfo, WorkerStatus
from router.wire.master import MasterInfo, MasterReply, MasterScheduleRequest

ChannelT_co = TypeVar("ChannelT_co", covariant=True)


class ChannelLeaser(Protocol[ChannelT_co]):
    """What the gRPC adapter needs from the channel pool (actors.channel_pool.ChannelPool).

    ``async with lease(target)`` yields the target's channel, which stays open until the lease is
    released; entering waits only for a target without a channel yet (within the caller's
    deadline), and raises ``router.targets.TargetError`` naming a malformed target.
    ``lease_nowait`` is the no-wait path alone: None when it would have to wait.
    """

    def lease(self, target: str) -> AbstractAsyncContextManager[ChannelT_co]: ...

    def lease_nowait(self, target: str) -> AbstractContextManager[ChannelT_co] | None: ...

    def invalidate(self, target: str, channel: object | None = None) -> None:
        """Drop ``target``'s channel after a transport failure (only if it is still ``channel``, if given)."""
        ...


# A call of a batch made in turn with less time left than this is not made (it could only time out).
LEAST_IN_TURN_CALL_S = 0.001


class InTurnCall(NamedTuple):
    """One call of a batch made in turn."""

    target: str
    method_path: str
    request: bytes


class InTurnReply(NamedTuple):
    """One call of a batch made in turn: its reply, its failure, or None when the time ran out before
    it was made; and when it ended, in seconds from the batch's start (a reply that waited for the
    rest of the batch is as old as that)."""

    outcome: bytes | TransportError | None
    ended_after_s: float
    # When the call itself began, from the same start (None: not made): the first call of a batch
    # begins after the batch's leases and its wait for a thread, which are not that worker's time.
    began_after_s: float | None = None


class RawRpc(Protocol):
    """A unary call carrying serialized bytes on a pinned method path."""

    async def call(
        self,
        target: str,
        method_path: str,
        request: bytes,
        *,
        on_sent: Callable[[], None] | None = None,
        sent_timeout_s: float | None = None,
        background: bool = False,
    ) -> bytes:
        """Raise a ``TransportError`` on failure; ``trio.Cancelled`` if the caller's scope ends.
        ``on_sent``: called once the request is on its way to the peer; a call that ends before (its
        deadline passed waiting for a channel or a thread) never reached it.
        ``sent_timeout_s``: the peer's time, counted from the sending, for a caller whose own bound moves
        to the sending (``on_sent``); None: what the caller's scope leaves. The checks before sending
        (``NotSent``) still go by the caller's scope.
        ``background``: no request waits for the reply; the adapter may start the call where it holds
        up the event loop least (over gRPC, off it), at the cost of a hand-off."""
        ...

    async def call_in_turn(self, calls: Sequence[InTurnCall], within_s: float) -> list[InTurnReply]:
        """Make ``calls`` one after another, each bounded by what is left of ``within_s`` from the start:
        per call its ``InTurnReply``. An adapter may honour the caller's cancel scope only after the
        batch (over gRPC the batch is one worker thread's blocking calls, which finish within
        ``within_s``)."""
        ...

    def invalidate(self, target: str) -> None:
        """Forget any connection to ``target`` after a transport failure."""
        ...


class WorkerStatusAsk(NamedTuple):
    """One status poll of a batch: the worker's status target and the version last seen there."""

    target: str
    latest_finished_version: int


class WorkerStatusReply(NamedTuple):
    """One status poll of a batch: the status, its failure, or None when the time ran out before it
    was asked; and when its call ended, in seconds from the batch's start."""

    status: WorkerStatus | TransportError | None
    ended_after_s: float
    began_after_s: float | None = None  # when its call began, from the batch's start (None: not made)


class KvcmTransport(Protocol):
    async def get_cluster_info(self, target: str, instance_id: str, trace_id: str = "") -> ClusterInfo: ...

    async def get_host_cache_state(
        self, target: str, query: CacheQuery, *, on_answered: Callable[[], None] | None = None
    ) -> CacheState:
        """``on_answered``: called once the reply's bytes are in, before they are decoded (a large
        reply on a thread): a caller whose time runs out after it knows the peer answered in time."""
        ...


class WorkerStatusTransport(Protocol):
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
        """``background``, ``on_sent`` and ``sent_timeout_s``: as ``RawRpc.call``'s; ``on_answered``: as
        ``KvcmTransport.get_host_cache_state``'s."""
        ...

    async def get_worker_statuses(self, asks: Sequence[WorkerStatusAsk], within_s: float) -> list[WorkerStatusReply]:
        """The statuses in turn (see ``RawRpc.call_in_turn``): per ask its ``WorkerStatusReply``."""
        ...


class MasterTransport(Protocol):
    """The central scheduler, addressed by a replica's HTTP address (``host:port``).

    ``schedule`` returns a ``MasterReply`` for every answer given in the scheduler's protocol
    (routed, 8600 fallback, a business error code) and raises a ``TransportError`` when the
    attempt got no usable reply (refused, reset, the caller's deadline, a garbled or non-JSON body).
    """

    async def schedule(self, host: str, request: MasterScheduleRequest) -> MasterReply: ...

    async def master_info(self, host: str) -> MasterInfo:
        """``POST /rtp_llm/master/info``; raises a ``TransportError`` unless it is a success."""
        ...
