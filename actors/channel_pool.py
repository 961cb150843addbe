"""ChannelPool actor: owns every gRPC channel, keyed by the normalised ``host:port`` target.

Every RPC leases a channel, so a lease on a warm channel must not pay a hop. The map, the lease
counts, the LRU order and the counters are changed only by ``run``'s task; callers read the
immutable map it publishes after every batch of changes, and tell it what they did:

- ``lease(target)`` (async context manager). Warm target (in the published map): no hop and no
  wait — the lease is reported (``_Leased``) and its return too (``_Returned``). Cold target: a
  request/reply (``_Open``) that waits only within the caller's deadline; the task opens the channel
  (one per target, however many callers ask at once), counts the lease and answers.
- ``lease_nowait(target)``: the warm path alone, for callers that cannot wait (None when cold).
- ``invalidate(target, channel)``: a report (``_Invalidate``); dropped and counted when the inbox
  is full.

Flow control: every message takes one credit of a semaphore sized like the inbox before it is
sent, and the task gives the credit back when it takes the message, so a send never finds the
inbox full. A lease takes two credits at once (its lease and its return), so a return is never
dropped. A warm lease that finds no credit left waits for one like a cold one.

Lease safety: a leased channel is never closed. Eviction (LRU, idle, invalidation, shutdown)
removes it from the map at once — later leases get a fresh channel — and it is closed when its last
lease returns. A caller that read the map before an eviction has its ``_Leased`` in the inbox
ahead of the task's next batch (nothing runs between the read and the send), so the task closes
what it evicted only at the end of a batch, after counting those leases.

``aclose()`` hands the shutdown to ``run`` (or does it itself when ``run`` is no longer running):
every channel evicted, unleased ones closed; from then on no task owns the pool, further leases
raise, and a lease returned later closes its channel when it is the last.
"""

from __future__ import annotations

import enum
import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, Protocol, TypeVar, overload

import grpc
import trio

from actors.inbox import Alarm, Ask
from router.config import ChannelPoolConfig
from router.problems import Problem, range_problems, refuse
from router.targets import parse_target
from router.transport.errors import Unavailable
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
    leased: int  # leases currently held (as far as the task has been told)
    draining: int  # evicted channels waiting for their last lease to return
    opened: int
    evicted: Mapping[str, int]  # by EvictReason value
    closed: int
    invalidations_dropped: int  # invalidations the full inbox refused
    inbox_depth: int
    inbox_capacity: int


def _normalise(target: str) -> str:
    return str(parse_target(target))


class _Entry(Generic[ChannelT]):
    """A channel and its bookkeeping. ``key`` and ``channel`` never change; the rest is the task's."""

    __slots__ = ("channel", "closed", "evicted", "key", "last_used", "leases")

    def __init__(self, key: str, channel: ChannelT) -> None:
        self.key = key
        self.channel = channel
        self.leases = 0
        self.last_used = 0.0  # trio time of the last return; meaningful only while leases == 0
        self.evicted = False
        self.closed = False


class _Lease(Generic[ChannelT]):
    """``async with``: a warm lease on enter without awaiting, a cold one through the task; the
    return is reported on exit (never awaits, so it is safe under cancellation)."""

    __slots__ = ("_entry", "_pool", "_target")

    def __init__(self, pool: ChannelPool[ChannelT], target: str) -> None:
        self._pool = pool
        self._target = target

    async def __aenter__(self) -> ChannelT:
        pool = self._pool
        key = pool._normalise(self._target)
        entry = pool._take_warm(key)
        if entry is None:
            entry = await pool._take_slow(key)
        self._entry = entry
        return entry.channel

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool._return(self._entry)


class _HeldLease(Generic[ChannelT]):
    """A warm lease already taken (``lease_nowait``): ``with`` gives its channel and returns it."""

    __slots__ = ("_entry", "_pool")

    def __init__(self, pool: ChannelPool[ChannelT], entry: _Entry[ChannelT]) -> None:
        self._pool = pool
        self._entry = entry

    def __enter__(self) -> ChannelT:
        return self._entry.channel

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool._return(self._entry)


@dataclass(frozen=True, slots=True)
class _Leased(Generic[ChannelT]):
    entry: _Entry[ChannelT]


@dataclass(frozen=True, slots=True)
class _Returned(Generic[ChannelT]):
    entry: _Entry[ChannelT]


@dataclass(frozen=True, slots=True)
class _Invalidate:
    key: str
    channel: object | None


class _Open(Ask[_Entry[ChannelT]]):
    """A cold target: open (or find) its channel and count this lease (request/reply); ``failure``
    when opening it raised."""

    __slots__ = ("failure", "key")

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.failure: str | None = None

    def fail(self, failure: str) -> None:
        """Called by the owner's task only: the open raised (``failure`` names the error)."""
        self.failure = failure
        self.done.set()


class _Shutdown(Ask[bool]):
    """``aclose()``: evict everything and stop (request/reply)."""


class _Sweep:
    """The alarm: idle channels may have expired."""


_SWEEP = _Sweep()


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
        self._send, self._receive = trio.open_memory_channel[
            "_Leased[ChannelT] | _Returned[ChannelT] | _Invalidate | _Open[ChannelT] | _Shutdown | _Sweep"
        ](config.inbox_size)
        self._credits = trio.Semaphore(config.inbox_size)  # one per message in the inbox or promised to it
        # A cold lease takes two credits in two waits: one taker at a time, or as many takers as free
        # credits would each hold one and wait for ever for a second.
        self._taking_two = trio.Lock()

        # Published by run() after every batch that changed the map (never mutated once published):
        self._published: Mapping[str, _Entry[ChannelT]] = {}
        # Set once the pool is shut down (or shutting down): leases raise from then on.
        self._closing = False
        self._finished = False  # no task owns the pool any more: returns close their own channels

        # Owned by run() (by aclose() once run() has stopped for good):
        self._entries: OrderedDict[str, _Entry[ChannelT]] = OrderedDict()  # LRU first
        self._to_close: list[_Entry[ChannelT]] = []  # evicted this batch: closed at its end if unleased
        self._map_changed = False  # the map differs from the published one
        self._next_sweep_at = math.inf  # never later than the earliest idle expiry
        self._running = False
        self._leased = 0
        self._draining = 0
        self._opened = 0
        self._evicted = dict.fromkeys(EvictReason, 0)
        self._closed_count = 0

        self._invalidations_dropped = 0  # kept by callers (a count only)

    # ---- callers ----

    def lease(self, target: str) -> _Lease[ChannelT]:
        """``async with pool.lease("host:port") as channel: ...`` — raises TargetError naming a malformed
        target, ``trio.ClosedResourceError`` once the pool is closed, ``Unavailable`` when opening the
        channel raised. Waits (a cold target, or no credit left) only within the caller's deadline."""
        return _Lease(self, target)

    def lease_nowait(self, target: str) -> _HeldLease[ChannelT] | None:
        """The warm path of :meth:`lease` alone: None when the target has no channel yet or no credit
        is left (the caller goes without). Never waits."""
        entry = self._take_warm(self._normalise(target))
        return None if entry is None else _HeldLease(self, entry)

    def invalidate(self, target: str, channel: object | None = None) -> None:
        """Drop ``target``'s channel after a transport failure; it closes when its last lease returns.

        With ``channel``, only that channel is dropped: a failure seen on an old channel must not
        discard the fresh one another caller opened since. A report: never waits.
        """
        key = self._normalise(target)
        entry = self._published.get(key)
        if entry is None or (channel is not None and entry.channel is not channel) or self._closing:
            return
        try:
            self._credits.acquire_nowait()
        except trio.WouldBlock:
            self._invalidations_dropped += 1
            return
        self._send.send_nowait(_Invalidate(key, channel))

    def on_evict(self, listener: Callable[[EvictReason], None]) -> None:
        """Tell ``listener`` (synchronous, non-blocking — e.g. a metrics emit) of every eviction."""
        self._evict_listener = listener

    def snapshot(self) -> ChannelPoolSnapshot:
        """A copy of the task's counters for /debug/actors and gauges (never the request path)."""
        return ChannelPoolSnapshot(
            size=len(self._entries),
            capacity=self._config.max_channels,
            leased=self._leased,
            draining=self._draining,
            opened=self._opened,
            evicted={reason.value: n for reason, n in self._evicted.items()},
            closed=self._closed_count,
            invalidations_dropped=self._invalidations_dropped,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._config.inbox_size,
        )

    async def aclose(self) -> None:
        """Close every channel (leased ones when their lease returns); further leases raise."""
        if self._closing:
            await trio.lowlevel.checkpoint()
            return
        self._closing = True
        self._published = {}
        if self._running:
            await self._credits.acquire()
            if self._running and not self._finished:
                message = _Shutdown()
                self._send.send_nowait(message)
                await message.done.wait()  # answered by run(), or by its finally if it stops first
                return
            self._credits.release()
        if not self._finished:  # run() has stopped (the services were cancelled first): this task takes over
            self._drain_inline()
            self._shutdown()
        await trio.lowlevel.checkpoint()

    def _take_warm(self, key: str) -> _Entry[ChannelT] | None:
        """A lease on the published channel of ``key``, reported with a credit kept for its return."""
        if self._closing:
            raise trio.ClosedResourceError("channel pool is closed")
        entry = self._published.get(key)
        if entry is None:
            return None
        credits = self._credits
        try:
            credits.acquire_nowait()
        except trio.WouldBlock:
            return None
        try:
            credits.acquire_nowait()
        except trio.WouldBlock:
            credits.release()
            return None
        self._send.send_nowait(_Leased(entry))  # room: every message in the inbox holds a credit
        return entry

    async def _take_slow(self, key: str) -> _Entry[ChannelT]:
        credits = self._credits
        async with self._taking_two:
            await credits.acquire()
            try:
                await credits.acquire()
            except BaseException:
                credits.release()
                raise
        # Read the map again now (no await until the send), never an entry seen before the waits.
        if self._closing:
            credits.release()
            credits.release()
            raise trio.ClosedResourceError("channel pool is closed")
        entry = self._published.get(key)
        if entry is not None:
            self._send.send_nowait(_Leased(entry))
            return entry
        message: _Open[ChannelT] = _Open(key)
        self._send.send_nowait(message)
        try:
            await message.done.wait()
        except BaseException:
            message.abandoned = True
            if message.reply is not None:
                self._return(message.reply)  # answered as we left: give the lease back
            else:
                credits.release()  # the credit kept for a return that will not come
            raise
        if message.failure is not None:
            credits.release()  # the credit kept for a return that will not come
            raise Unavailable(key, f"channel not opened: {message.failure}")
        assert message.reply is not None  # set before done fires
        return message.reply

    def _return(self, entry: _Entry[ChannelT]) -> None:
        if self._finished:  # nobody owns the pool any more: the last lease out closes the channel
            self._credits.release()
            entry.leases -= 1
            self._leased -= 1
            if entry.leases == 0:
                self._close(entry)
            return
        self._send.send_nowait(_Returned(entry))  # room: the lease kept a credit for this

    # ---- the owner's task ----

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply the inbox a batch at a time, sweep idle channels when due, close what the batch
        evicted and nobody leases, publish the map; until ``aclose()``.

        A crash or cancellation of this task leaves the channels in place (the supervisor restarts
        it and the map survives); only ``aclose()`` closes the pool.
        """
        if self._finished:
            task_status.started()
            return
        self._running = True
        alarm = Alarm(self._send, _SWEEP, self._credits)
        try:
            async with trio.open_nursery() as children:
                await children.start(alarm.run)
                alarm.set(self._next_sweep_at)
                task_status.started()
                receive = self._receive
                while True:
                    message = await receive.receive()
                    while True:
                        if self._handle(message):
                            children.cancel_scope.cancel()
                            return
                        try:
                            message = receive.receive_nowait()
                        except trio.WouldBlock:
                            break
                    self._end_batch()
                    alarm.set(self._next_sweep_at)
        finally:
            self._running = False
            if self._closing and not self._finished:  # stopped during aclose(): finish the shutdown here
                self._drain_inline()
                if not self._finished:
                    self._shutdown()
            elif self._map_changed and not self._closing:
                # Crashed in the middle of a batch: publish the map it changed, or warm leases would take
                # the channels it evicted (invalidated, say) until the restarted task's first batch.
                # What it evicted is closed at that batch's end, once the leases queued for it are counted.
                self._map_changed = False
                self._published = dict(self._entries)

    def _handle(self, message: object) -> bool:
        """Apply one message; True when it was the shutdown (done, the task stops)."""
        self._credits.release()
        if isinstance(message, _Leased):
            self._count_lease(message.entry)
        elif isinstance(message, _Returned):
            self._count_return(message.entry)
        elif isinstance(message, _Open):
            if not message.abandoned:  # (an abandoning caller gave back the credit kept for its return)
                try:
                    opened = self._open(message.key)
                except Exception as exc:
                    # Answered before the task fails and restarts: the message is gone with it, and a
                    # caller waiting with no deadline of its own would wait for good. While closing the
                    # shutdown goes on: raised, it would leave every channel open.
                    message.fail(repr(exc))
                    if not self._closing:
                        raise
                else:
                    if isinstance(opened, str):
                        message.fail(opened)  # that target's failure (its caller's Unavailable), not the task's
                    else:
                        message.answer(opened)
        elif isinstance(message, _Invalidate):
            entry = self._entries.get(message.key)
            if entry is not None and (message.channel is None or entry.channel is message.channel):
                self._evict(entry, EvictReason.INVALIDATED)
        elif message is _SWEEP:
            now = trio.current_time()
            if now >= self._next_sweep_at:
                self._sweep(now)
        elif isinstance(message, _Shutdown):
            self._drain_inline()
            self._shutdown()
            message.answer(True)
            return True
        return False

    def _open(self, key: str) -> _Entry[ChannelT] | str:
        """The leased entry of ``key``, opened if need be; or what the factory raised: that target's
        failure, its lease's to report (raised, it crashed the task, and a target the factory always
        refused kept it restarting, every other cold lease waiting out the backoff)."""
        entry = self._entries.get(key)
        if entry is None:
            try:
                channel = self._factory(key)
            except Exception as exc:
                return repr(exc)
            entry = _Entry(key, channel)
            self._opened += 1
            if len(self._entries) >= self._config.max_channels:
                self._evict(next(iter(self._entries.values())), EvictReason.LRU)
            self._entries[key] = entry
            self._map_changed = True
        self._count_lease(entry)
        return entry

    def _count_lease(self, entry: _Entry[ChannelT]) -> None:
        entry.leases += 1
        self._leased += 1
        if not entry.evicted:
            self._entries.move_to_end(entry.key)

    def _count_return(self, entry: _Entry[ChannelT]) -> None:
        entry.leases -= 1
        self._leased -= 1
        if entry.leases:
            return
        if entry.evicted:
            self._to_close.append(entry)
        else:
            entry.last_used = trio.current_time()
            self._entries.move_to_end(entry.key)
            self._next_sweep_at = min(self._next_sweep_at, entry.last_used + self._config.idle_expiry_s)

    def _evict(self, entry: _Entry[ChannelT], reason: EvictReason) -> None:
        del self._entries[entry.key]
        entry.evicted = True
        self._evicted[reason] += 1
        self._draining += 1
        self._to_close.append(entry)
        self._map_changed = True
        if self._evict_listener is not None:
            self._evict_listener(reason)

    def _end_batch(self) -> None:
        """Every lease taken from the old map is counted now: close what was evicted and is unleased."""
        for entry in self._to_close:
            if entry.leases == 0 and not entry.closed:
                self._close(entry)
        self._to_close.clear()
        if self._map_changed:
            self._map_changed = False
            self._published = {} if self._closing else dict(self._entries)

    def _close(self, entry: _Entry[ChannelT]) -> None:
        entry.closed = True
        self._draining -= 1
        entry.channel.close()
        self._closed_count += 1

    def _sweep(self, now: float) -> None:
        """Evict channels idle for idle_expiry_s; set the next sweep time.

        Unleased entries sit in the LRU order of their last return, so the scan stops at the first
        unleased entry that has not expired; leased entries are skipped.
        """
        expiry = self._config.idle_expiry_s
        expired: list[_Entry[ChannelT]] = []
        self._next_sweep_at = math.inf
        for entry in self._entries.values():
            if entry.leases:
                continue
            if entry.last_used + expiry > now:
                self._next_sweep_at = entry.last_used + expiry
                break
            expired.append(entry)
        for entry in expired:
            self._evict(entry, EvictReason.IDLE)

    def _drain_inline(self) -> None:
        while True:
            try:
                message = self._receive.receive_nowait()
            except trio.WouldBlock:
                return
            self._handle(message)

    def _shutdown(self) -> None:
        for entry in list(self._entries.values()):
            self._evict(entry, EvictReason.SHUTDOWN)  # leased ones close when their last lease returns
        self._end_batch()
        self._published = {}
        self._finished = True
