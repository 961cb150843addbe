"""The shadow index: a router-local, approximate prefix index (a local standby for KVCM).

Each routing decision records (worker, the request's block keys): that worker will have
prefilled those blocks. When KVCM cannot be asked, :meth:`ShadowIndex.match` answers like
KVCM would — per worker, the length of its contiguous stored prefix of the query's keys —
as ``HostMatch`` values, so the same candidate plan and Scorer consume it. When both are
available, :func:`agreement` measures how well the shadow predicts KVCM.

Design (pure core, time passed in, memory bounded):

- **Records, not blocks.** A record is one (worker, keys) pair; recording the same prompt
  for the same worker again refreshes it. Records are an LRU bounded by the total number
  of blocks they hold (``capacity_blocks``) and expire ``ttl_s`` after they were last
  recorded. Records share the caller's keys tuple; nothing is copied per block.
- **Sparse index.** Block keys are chained hashes: key ``i`` stands
  for the whole prefix up to block ``i``, so two key sequences agree on a prefix exactly
  up to the first position where they differ, and that position can be found by
  bisection. Only positions 0, 1, 3, 7, … (2^j − 1) are indexed, mapping key → {worker:
  its most recent record holding that key there}: recording costs O(log n), not O(n).
- **Match.** Walking the indexed positions deepest first, every worker holding the
  query's key at position p has a common prefix of at least p + 1 blocks; its length is
  then found by bisection against that worker's most recent such record. A worker with
  several records that diverge between two indexed positions is measured against the
  most recent one (that is the approximation). Workers come out longest first, and a
  ``limit`` stops the walk once that many are found — exactly the top ``limit``.

:class:`ShadowIndexActor` owns an index: records arrive through a bounded inbox
(``record_nowait``: never blocks, drops are counted) and are applied by its ``run`` task, which
also drops a record once it expires, woken by an alarm in its inbox; ``match`` is a synchronous
read (no await, so it is atomic on trio's thread).
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from actors.inbox import Alarm
from router.config import ShadowConfig
from router.problems import Problem, range_problems, refuse
from router.slot_init import slot_init
from router.targets import TargetError, parse_target
from router.types import HostMatch

_DRAIN_BATCH = 31  # records applied after a received one without yielding (a bounded slice of the loop)
TIDY_STEP = 256  # records one step of the index's tidying drops at most (about a millisecond of work)
_RecordKey = tuple[str, int]  # (worker, the record's last key): one record per prompt per worker


@functools.lru_cache(maxsize=256)
def _indexed_positions(length: int) -> tuple[int, ...]:
    """0, 1, 3, 7, … below ``length`` (computed once per prompt length: every record, eviction and
    match walks them)."""
    positions: list[int] = []
    position = 0
    while position < length:
        positions.append(position)
        position = 2 * position + 1
    return tuple(positions)


@functools.lru_cache(maxsize=256)
def _positions_deepest_first(length: int) -> tuple[int, ...]:
    """The indexed positions below ``length``, deepest first (as :meth:`ShadowIndex.match` walks them)."""
    return _indexed_positions(length)[::-1]


def _common_prefix(query: Sequence[int], keys: Sequence[int], at_least: int) -> int:
    """Blocks shared by two chained key sequences known to agree on their first ``at_least``."""
    low, high = at_least, min(len(query), len(keys))  # invariant: agree up to low, not beyond high
    while low < high:
        middle = (low + high + 1) // 2
        if query[middle - 1] == keys[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low


class _Record:
    __slots__ = ("keys", "recorded_at", "worker")

    def __init__(self, worker: str, keys: tuple[int, ...], recorded_at: float) -> None:
        self.worker = worker
        self.keys = keys
        self.recorded_at = recorded_at


def shadow_problems(config: ShadowConfig) -> list[Problem]:
    """Every reason the shadow index cannot work with ``config`` (empty when it can)."""
    return range_problems(config)


class ShadowIndex:
    """The pure index. Not thread-safe; one owner mutates it (see ShadowIndexActor)."""

    def __init__(self, ttl_s: float, capacity_blocks: int) -> None:
        refuse("shadow", shadow_problems(ShadowConfig(ttl_s=ttl_s, capacity_blocks=capacity_blocks)))
        self.ttl_s = ttl_s
        self.capacity_blocks = capacity_blocks
        self._records: OrderedDict[_RecordKey, _Record] = OrderedDict()  # least recently recorded first
        self._index: dict[int, dict[str, _RecordKey]] = {}
        self._blocks = 0

    @property
    def blocks(self) -> int:
        """Blocks held by the records (above ``capacity_blocks`` only until ``tidy`` has caught up)."""
        return self._blocks

    @property
    def records(self) -> int:
        return len(self._records)

    @property
    def indexed_keys(self) -> int:
        return len(self._index)

    def record(self, worker: str, keys: Sequence[int], now: float) -> None:
        """``worker`` now holds the prefix ``keys`` (as of ``now``). A prompt longer than the
        whole capacity keeps its first ``capacity_blocks`` blocks. Drops at most ``TIDY_STEP`` records
        before adding it (expired ones) and as many after (beyond the capacity): ``tidy`` does the
        rest in steps (a match skips expired records)."""
        self.tidy(now, TIDY_STEP)
        if not keys:
            return
        kept = tuple(keys[: self.capacity_blocks])
        record_key = (worker, kept[-1])
        old = self._records.pop(record_key, None)
        if old is not None:
            self._forget(record_key, old)
        record = _Record(worker, kept, now)
        self._records[record_key] = record
        self._blocks += len(kept)
        for position in _indexed_positions(len(kept)):
            self._index.setdefault(kept[position], {})[worker] = record_key
        self.tidy(now, TIDY_STEP)

    def tidy(self, now: float, most: int) -> bool:
        """Drop at most ``most`` records, oldest first: those expired at ``now``, then those beyond the
        capacity. True when more are due. In steps, since after a lull longer than ``ttl_s``, or a long
        prompt into an index of short ones, the whole of it stalled its thread."""
        horizon = now - self.ttl_s
        for _ in range(most):
            if not self._records:
                return False
            oldest = next(iter(self._records.values()))
            if oldest.recorded_at >= horizon and self._blocks <= self.capacity_blocks:
                return False
            self._evict_oldest()
        return bool(self._records) and (
            self._blocks > self.capacity_blocks or next(iter(self._records.values())).recorded_at < horizon
        )

    def next_expiry(self) -> float:
        """The earliest time ``tidy`` drops the oldest record as expired (inf with none): the first past
        ``recorded_at + ttl_s``, where ``now - ttl_s`` passes the record's time (``match`` counts it
        until then). Waking sooner would drop nothing and wake again at once."""
        for oldest in self._records.values():
            at = oldest.recorded_at + self.ttl_s
            while at - self.ttl_s <= oldest.recorded_at:  # a few ulps at most: the float sum rounds
                at = math.nextafter(at, math.inf)
            return at
        return math.inf

    def expire(self, now: float) -> None:
        """Drop every record last recorded more than ``ttl_s`` before ``now`` (and any beyond the
        capacity), at once."""
        while self.tidy(now, TIDY_STEP):
            pass

    def _evict_oldest(self) -> None:
        self._forget(*self._records.popitem(last=False))

    def _forget(self, record_key: _RecordKey, record: _Record) -> None:
        """Account for a record just removed from ``_records`` and drop its index entries."""
        self._blocks -= len(record.keys)
        for position in _indexed_positions(len(record.keys)):
            key = record.keys[position]
            holders = self._index.get(key)
            # A newer record of the same worker holding this key owns the entry now; an older
            # one cannot exist (it would have been evicted first).
            if holders is not None and holders.get(record.worker) == record_key:
                del holders[record.worker]
                if not holders:
                    del self._index[key]

    def match(
        self,
        keys: Sequence[int],
        now: float,
        limit: int | None = None,
        usable: Callable[[str], bool] | None = None,
    ) -> tuple[HostMatch, ...]:
        """Per worker, its contiguous stored prefix of ``keys`` in blocks, longest first (read-only).

        Records older than ``ttl_s`` at ``now`` do not count. With ``usable``, only workers it
        accepts are returned: records of workers that left discovery or are ejected live until their
        TTL, and must not take the places of live holders. With ``limit``, the walk stops once at
        least ``limit`` workers are found: every worker left out holds strictly fewer blocks than
        every one returned.
        """
        horizon = now - self.ttl_s
        found: dict[str, int] = {}
        passed: set[str] = set()
        for position in _positions_deepest_first(len(keys)):
            if limit is not None and len(found) >= limit:
                break  # every worker not found yet holds at most `position + 1` blocks: fewer
            holders = self._index.get(keys[position])
            if not holders:
                continue
            for worker, record_key in holders.items():
                if worker in found or worker in passed:
                    continue
                record = self._records[record_key]
                if record.recorded_at < horizon:
                    continue  # expired (its older records too); not yet purged
                if position < len(record.keys) and record.keys[position] == keys[position]:
                    if usable is not None and not usable(worker):
                        passed.add(worker)
                        continue
                    found[worker] = _common_prefix(keys, record.keys, position + 1)
        ordered = sorted(found.items(), key=lambda item: -item[1])
        return tuple(HostMatch(worker, local) for worker, local in ordered)


    def compare(
        self, kvcm_hosts: Sequence[HostMatch], keys: Sequence[int], now: float, limit: int, block_size: int
    ) -> tuple[float, int]:
        """How this index would have answered a query KVCM answered with ``kvcm_hosts``: the
        ``agreement`` of the two and the ``hit_error_tokens`` (read-only). The view is ``match`` with
        ``limit``; KVCM's best holder, when that view left it out (more holders of longer prefixes
        here), is looked up alone, so its error is its own prefix's, not KVCM's whole hit."""
        # ``agreement`` (k = 1) and ``hit_error_tokens`` of the views from their shared parts: KVCM's
        # best holders are found once (its top-1 set, and where the error is measured). Many KVCM
        # answers are compared; the two calls each found the best holders and sorted KVCM's answer again.
        view = self.match(keys, now, limit=limit)
        best = best_holders(kvcm_hosts)
        kvcm_top = {canonical_host(h.host_ip_port) for h in best}
        shadow_local = {h.host_ip_port: h.local for h in view}
        error_local = shadow_local
        if not kvcm_top <= shadow_local.keys():
            error_local = {h.host_ip_port: h.local for h in self.match(keys, now, usable=kvcm_top.__contains__)}
        return _jaccard(kvcm_top, _top_hosts(view, 1)), _hit_error(best, error_local, block_size)


def _top_hosts(hosts: Sequence[HostMatch], k: int) -> set[str]:
    """Hosts whose ``local`` is at least the k-th largest positive ``local`` (ties included)."""
    positive = sorted((h.local for h in hosts if h.local >= 1), reverse=True)
    if not positive:
        return set()
    cut = positive[min(k, len(positive)) - 1]
    return {canonical_host(h.host_ip_port) for h in hosts if h.local >= cut}


@functools.lru_cache(maxsize=4096)
def canonical_host(host_ip_port: str) -> str:
    """``host_ip_port`` as the shadow index names its worker (the canonical target): KVCM may spell
    the same worker otherwise (an IPv6 address written out in full, a port with leading zeros). A
    host that does not parse stays as given. Cached: the compared KVCM answers' holders are the same
    few spellings each time, and parsing one costs more than the rest of the comparison."""
    try:
        return str(parse_target(host_ip_port))  # HostPort's text is format_target's one spelling
    except TargetError:
        return host_ip_port


def agreement(kvcm_hosts: Sequence[HostMatch], shadow_hosts: Sequence[HostMatch], k: int = 1) -> float:
    """How well the shadow's answer predicts KVCM's for one query, in [0, 1].

    Defined as the Jaccard overlap of the two top-k sets: the hosts whose matched prefix
    (``local`` ≥ 1) is at least the k-th longest, ties included, so neither answer's order
    nor any host name decides membership. With k = 1 it asks "do both name the same best
    holders?". 1.0 when both answers have no positive host; 0.0 when only one has.
    """
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    return _jaccard(_top_hosts(kvcm_hosts, k), _top_hosts(shadow_hosts, k))


def _jaccard(kvcm_top: set[str], shadow_top: set[str]) -> float:
    union = kvcm_top | shadow_top
    if not union:
        return 1.0
    return len(kvcm_top & shadow_top) / len(union)


def hit_error_tokens(kvcm_hosts: Sequence[HostMatch], shadow_hosts: Sequence[HostMatch], block_size: int) -> int:
    """How far the shadow's predicted hit is from KVCM's reported one, in tokens, for one query.

    Measured at KVCM's best holder (its longest ``local`` prefix): |KVCM's blocks − the shadow's
    blocks for that host| × block_size; of several holding it equally, the one the shadow knows best
    (which KVCM listed first decided it, and a shadow that saw only another of them, as a second
    router's does, counted the whole prefix as error). When KVCM names no holder, the shadow's best
    prefix is the whole error (it predicted a hit KVCM does not know of); so is it when KVCM's hosts
    hold the prefix only through p2p (no local block): none of them is a holder.
    """
    return _hit_error(best_holders(kvcm_hosts), {h.host_ip_port: h.local for h in shadow_hosts}, block_size)


def _hit_error(best: Sequence[HostMatch], shadow_local: Mapping[str, int], block_size: int) -> int:
    """``hit_error_tokens`` from KVCM's best holders and the shadow's blocks by host."""
    if not best:
        return max(shadow_local.values(), default=0) * block_size
    return min(abs(h.local - shadow_local.get(canonical_host(h.host_ip_port), 0)) for h in best) * block_size


def best_holders(kvcm_hosts: Sequence[HostMatch]) -> list[HostMatch]:
    """KVCM's best holders: the hosts with the longest ``local`` prefix (none: no local block)."""
    longest = max((h.local for h in kvcm_hosts), default=0)
    return [h for h in kvcm_hosts if h.local == longest] if longest >= 1 else []


@dataclass(frozen=True, slots=True)
class ShadowHealth:
    records: int
    blocks: int
    capacity_blocks: int
    indexed_keys: int
    inbox_depth: int
    inbox_capacity: int
    applied: int  # records applied since start
    dropped: int  # records dropped because the inbox was full


@slot_init
@dataclass(frozen=True, slots=True)
class _Recorded:
    worker: str
    keys: Sequence[int]
    now: float


@dataclass(frozen=True, slots=True)
class _Expire:
    """The expiry alarm's wake-up: the oldest record's expiry has come."""


_EXPIRE = _Expire()


class ShadowIndexActor:
    """Owns a ShadowIndex: records in through a bounded inbox, matches read synchronously.

    Only the ``run`` task mutates the index, each change between two awaits; its expiry alarm only
    posts a wake-up into the inbox. ``match``, ``compare`` and ``health`` never await, so on trio's
    single thread they read a consistent index between two applied records.
    """

    def __init__(self, config: ShadowConfig) -> None:
        refuse("shadow", shadow_problems(config))
        self.index = ShadowIndex(config.ttl_s, config.capacity_blocks)
        self._send, self._receive = trio.open_memory_channel[_Recorded | _Expire](config.inbox_size)
        self._inbox_size = config.inbox_size
        self._applied = 0
        self._dropped = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply records as they arrive, and drop each as it expires, until cancelled. With no traffic,
        expired records would otherwise stay in memory (and in the health's counts) until the next
        record: an alarm at the oldest one's expiry wakes this task for them."""
        async with trio.open_nursery() as nursery:
            alarm = Alarm(self._send, _EXPIRE)
            await nursery.start(alarm.run)
            if self.index.records:  # a restart's: set below only on a change, none might come
                alarm.set(self.index.next_expiry())
            task_status.started()
            async for message in self._receive:
                was_empty = not self.index.records
                rung = False
                now = -math.inf
                queued = 0
                while True:
                    if isinstance(message, _Expire):
                        rung = True
                        now = max(now, trio.current_time())
                    else:
                        self.index.record(message.worker, message.keys, message.now)
                        self._applied += 1
                        now = max(now, message.now)
                    # Apply what else is queued now too: a receive of a queued record still yields once each.
                    queued += 1
                    if queued > _DRAIN_BATCH:
                        break
                    try:
                        message = self._receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                # What the records left to drop, a step per scheduling round: requests run in between.
                while self.index.tidy(now, TIDY_STEP):
                    await trio.lowlevel.checkpoint()
                # The oldest record's expiry gets earlier only from none to one; a later one (its record
                # dropped or recorded again) rings early, finds nothing due, and is set again here.
                if rung or (was_empty and self.index.records):
                    alarm.set(self.index.next_expiry())
            nursery.cancel_scope.cancel()

    def record_nowait(self, worker: str, keys: Sequence[int], now: float) -> bool:
        """Queue a record (``worker``'s http target, the request's keys, trio time of the
        decision); never blocks. False (and counted) when the inbox is full."""
        try:
            self._send.send_nowait(_Recorded(worker, keys, now))
        except trio.WouldBlock:
            self._dropped += 1
            return False
        return True

    def match(
        self, keys: Sequence[int], now: float, limit: int | None = None, usable: Callable[[str], bool] | None = None
    ) -> tuple[HostMatch, ...]:
        return self.index.match(keys, now, limit, usable)

    def compare(
        self, kvcm_hosts: Sequence[HostMatch], keys: Sequence[int], now: float, limit: int, block_size: int
    ) -> tuple[float, int]:
        return self.index.compare(kvcm_hosts, keys, now, limit, block_size)

    def health(self) -> ShadowHealth:
        return ShadowHealth(
            records=self.index.records,
            blocks=self.index.blocks,
            capacity_blocks=self.index.capacity_blocks,
            indexed_keys=self.index.indexed_keys,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._inbox_size,
            applied=self._applied,
            dropped=self._dropped,
        )
