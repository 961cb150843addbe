"""ChannelPool actor: owns every gRPC channel, keyed by the normalised ``host:port`` target.

Every RPC leases a channel, so leasing must be cheap. The pool's state is mutated only in
its synchronous, non-awaiting methods; trio is cooperative, so each of them is atomic and
the map has one owner without locks or a request/reply round trip. Leasing and releasing
never await: nothing on the request path can outlive the caller's deadline, and releasing
is safe under cancellation without a shield. ``run()`` does the work that must stay off
the request path: closing evicted channels (a bounded inbox) and idle sweeps.

Lease safety: a leased channel is never closed. Eviction (LRU, idle, invalidation,
shutdown) removes it from the map at once — new leases get a fresh channel — and it is
closed when its last lease returns.
"""

from __future__ import annotations

import enum
import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, Protocol, TypeVar, overload

import grpc
import trio

from router.config import ChannelPoolConfig
from router.problems import Problem, range_problems, refuse
from router.targets import parse_target
from router.transport.grpc_adapter import open_channel


class ClosableChannel(Protocol):
    def close(self) -> None: ...


ChannelT = TypeVar("ChannelT", bound=ClosableChannel)


class EvictReason(enum.Enum):
    LRU = "lru"
    IDLE = "idle"
    INVALIDATED = "invalidated"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class ChannelPoolSnapshot:
    """Health of the pool, for the debug endpoint and metrics."""

    size: int  # channels in the map
    capacity: int
    leased: int  # leases currently held
    draining: int  # evicted channels waiting for their last lease to return
    pending_close: int  # evicted channels queued for run() to close
    opened: int
    evicted: Mapping[str, int]  # by EvictReason value
    closed: int
    closed_inline: int  # closed on a request path because the close inbox was full


def _normalise(target: str) -> str:
    return str(parse_target(target))


class _Entry(Generic[ChannelT]):
    __slots__ = ("channel", "evicted", "key", "last_used", "leases")

    def __init__(self, key: str, channel: ChannelT) -> None:
        self.key = key
        self.channel = channel
        self.leases = 0
        self.last_used = 0.0  # trio time of the last release; meaningful only while leases == 0
        self.evicted = False


class _Lease(Generic[ChannelT]):
    """Synchronous context manager: acquire on enter, release on exit; neither awaits."""

    __slots__ = ("_entry", "_pool", "_target")

    def __init__(self, pool: ChannelPool[ChannelT], target: str) -> None:
        self._pool = pool
        self._target = target

    def __enter__(self) -> ChannelT:
        self._entry = self._pool._acquire(self._target)
        return self._entry.channel

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool._release(self._entry)


def channel_pool_problems(config: ChannelPoolConfig) -> list[Problem]:
    """Every reason the pool cannot work with ``config`` (empty when it can)."""
    return range_problems(config)


class ChannelPool(Generic[ChannelT]):
    """LRU of channels with a size cap and idle expiry (trio clock). Implements ``ChannelLeaser``."""

    @overload
    def __init__(
        self: ChannelPool[grpc.Channel],
        config: ChannelPoolConfig,
        factory: None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None: ...

    @overload
    def __init__(self, config: ChannelPoolConfig, factory: Callable[[str], ChannelT]) -> None: ...

    def __init__(
        self,
        config: ChannelPoolConfig,
        factory: Callable[[str], ChannelT] | None = None,
        *,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """Without ``factory``, real gRPC channels: TLS with ``credentials``, plaintext without."""
        refuse("channel_pool", channel_pool_problems(config))
        self._config = config
        self._evict_listener: Callable[[EvictReason], None] | None = None
        # Without a factory ChannelT is grpc.Channel (first overload).
        self._factory: Callable[[str], ChannelT] = factory or functools.partial(  # type: ignore[assignment]
            open_channel, config=config, credentials=credentials
        )
        # parse_target costs ~10 µs; live targets number at most max_channels, so a cache that size hits.
        self._normalise = functools.lru_cache(maxsize=config.max_channels)(_normalise)
        self._entries: OrderedDict[str, _Entry[ChannelT]] = OrderedDict()  # LRU first
        # Close work for run(); capacity max_channels. When full, the channel is closed inline (~16 µs).
        self._close_send, self._close_recv = trio.open_memory_channel[ChannelT](config.max_channels)
        self._next_sweep_at = -float("inf")  # never later than the earliest idle expiry
        self._closed = False
        self._leased = 0
        self._draining = 0
        self._opened = 0
        self._evicted = dict.fromkeys(EvictReason, 0)
        self._closed_count = 0
        self._closed_inline = 0

    # ---- request path: synchronous, atomic under trio's cooperative scheduling ----

    def lease(self, target: str) -> _Lease[ChannelT]:
        """``with pool.lease("host:port") as channel: ...`` — raises TargetError naming a malformed target."""
        return _Lease(self, target)

    def invalidate(self, target: str, channel: object | None = None) -> None:
        """Drop ``target``'s channel after a transport failure; it closes when its last lease returns.

        With ``channel``, only that channel is dropped: a failure seen on an old channel must not
        discard the fresh one another caller opened since.
        """
        key = self._normalise(target)
        entry = self._entries.get(key)
        if entry is not None and (channel is None or entry.channel is channel):
            self._evict(entry, EvictReason.INVALIDATED)

    def snapshot(self) -> ChannelPoolSnapshot:
        return ChannelPoolSnapshot(
            size=len(self._entries),
            capacity=self._config.max_channels,
            leased=self._leased,
            draining=self._draining,
            pending_close=self._close_send.statistics().current_buffer_used,
            opened=self._opened,
            evicted={reason.value: n for reason, n in self._evicted.items()},
            closed=self._closed_count,
            closed_inline=self._closed_inline,
        )

    def _acquire(self, target: str) -> _Entry[ChannelT]:
        if self._closed:
            raise trio.ClosedResourceError("channel pool is closed")
        key = self._normalise(target)
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(key, self._factory(key))
            self._opened += 1
            if len(self._entries) >= self._config.max_channels:
                self._evict(next(iter(self._entries.values())), EvictReason.LRU)
            self._entries[key] = entry
        else:
            self._entries.move_to_end(key)
        entry.leases += 1
        self._leased += 1
        return entry

    def _release(self, entry: _Entry[ChannelT]) -> None:
        entry.leases -= 1
        self._leased -= 1
        if entry.evicted:
            if entry.leases == 0:
                self._draining -= 1
                self._close_soon(entry.channel)
        elif entry.leases == 0:
            entry.last_used = trio.current_time()
            self._entries.move_to_end(entry.key)

    def on_evict(self, listener: Callable[[EvictReason], None]) -> None:
        """Tell ``listener`` (synchronous, non-blocking — e.g. a metrics emit) of every eviction."""
        self._evict_listener = listener

    def _evict(self, entry: _Entry[ChannelT], reason: EvictReason) -> None:
        del self._entries[entry.key]
        entry.evicted = True
        self._evicted[reason] += 1
        if self._evict_listener is not None:
            self._evict_listener(reason)
        if entry.leases:
            self._draining += 1
        else:
            self._close_soon(entry.channel)

    def _close_soon(self, channel: ChannelT) -> None:
        if self._closed:  # run() has ended: nobody else will close it
            self._close_now(channel)
            return
        try:
            self._close_send.send_nowait(channel)
        except trio.WouldBlock:
            self._closed_inline += 1
            self._close_now(channel)

    def _close_now(self, channel: ChannelT) -> None:
        channel.close()
        self._closed_count += 1

    # ---- background work ----

    def _sweep(self, now: float) -> None:
        """Evict channels idle for idle_expiry_s; set the next sweep time.

        Unleased entries sit in the LRU order of their last release, so the scan stops at the
        first unleased entry that has not expired; leased entries are skipped.
        """
        expiry = self._config.idle_expiry_s
        expired: list[_Entry[ChannelT]] = []
        self._next_sweep_at = now + expiry
        for entry in self._entries.values():
            if entry.leases:
                continue
            if entry.last_used + expiry > now:
                self._next_sweep_at = entry.last_used + expiry
                break
            expired.append(entry)
        for entry in expired:
            self._evict(entry, EvictReason.IDLE)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Close evicted channels and sweep idle ones until ``aclose()``.

        A crash or cancellation of this task leaves the channels in place (the supervisor
        restarts it and the map survives); only ``aclose()`` — called by the owner at
        shutdown — closes the pool.
        """
        task_status.started()
        while True:
            with trio.move_on_at(self._next_sweep_at):
                try:
                    channel = await self._close_recv.receive()
                except trio.EndOfChannel:
                    return
                self._close_now(channel)
                continue
            self._sweep(trio.current_time())

    def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_send.close()
        for entry in list(self._entries.values()):
            self._evict(entry, EvictReason.SHUTDOWN)  # leased ones close when their last lease returns
        while True:
            try:
                self._close_now(self._close_recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break

    async def aclose(self) -> None:
        """Close every channel (leased ones when their last lease returns); further leases raise."""
        self._shutdown()
        await trio.lowlevel.checkpoint()
