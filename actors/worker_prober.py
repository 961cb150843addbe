"""WorkerProber: worker statuses for requests, under one global probe budget.

A request calls ``probe(workers, deadline)``, which returns at once a
``ProbeHandle`` holding the fresh statuses and receiving every other result as
it completes; the request waits on it under its own cancel scope and decides
with what it has (an "anytime" decision).

- **One owner.** ``run``'s task alone changes the prober's state: per-worker
  statuses, failures, ejections, pending probes, the LRU, the hot set, the token
  bucket and its counters. Others reach it through a bounded inbox: ``probe``
  sends one ``_Wanted`` per call (``send_nowait``: when the inbox is full the
  workers it would have probed are skipped ``no_budget``, counted); probe tasks
  send their outcome as a ``_Landed`` (they wait for room: an outcome is never
  lost); ``retain`` leaves the worker set in a one-slot mailbox, latest wins.
  The owner applies what is queued without yielding, then publishes an
  immutable ``ProberView`` once per batch that changed something.
- **Hot-path reads are snapshot reads.** ``probe`` answers a worker whose
  status in the view is fresh without waiting for the owner; ``cached``,
  ``cached_observed``, ``is_routable``, ``unroutable_reason`` and ``ejected``
  read only the view. ``snapshot`` reads the owner's counters (a read, no
  change) plus the callers' own (fresh answers, dropped messages).
- **Budget, acquired within the request's deadline.** The owner reserves a
  token from the rate bucket: if it would be ready only after the deadline, the
  probe is skipped (``no_budget``); otherwise the probe task sleeps until the
  token (one ``sleep_until``) and then takes an in-flight slot
  (``trio.CapacityLimiter``, FIFO), both under a cancel scope whose deadline is
  the latest deadline among the requests waiting for that worker (the owner
  extends it when a later request joins). If that passes first, the token is
  given back and the probe is skipped (``no_budget``).
- **A started RPC is bounded by ``probe_timeout_s`` only**, not by the waiting
  requests' deadlines: a slow or black-holed worker must still accrue failures
  (and be ejected) when every request's budget is shorter than the probe
  timeout, and a late answer refreshes the cache for the next request. The
  worker has that long from the request's sending: a wait before it (for the
  channel, for a thread to start it on) is not the worker's time.
- **Coalescing.** At most one probe per worker is pending; a request for a worker
  with a pending probe joins it and gets the same result; its own deadline
  bounds only its own wait.
- **Status cache.** A valid status younger than ``fresh_ttl_s`` is answered
  without an RPC. The ``latest_finished_version`` of the last valid status is
  sent on the next probe. A reply with ``status_version == 0`` carries no status:
  it is counted and changes nothing (neither success nor failure). The cache is
  an LRU of at most ``max_tracked_workers`` entries, pruned by ``retain``.
- **Ejection (Envoy-style, for outliers only).** ``eject_after_failures``
  consecutive failures (transport errors, or no answer within
  ``probe_timeout_s``) make a worker *failing*; a failing worker is ejected for
  ``eject_base_s × n`` (n = its ejections, decayed by one per ``eject_base_s``
  spent out of ejection), capped at ``eject_max_s``, while at most
  ``ejection_cap`` workers (``max_ejected_fraction`` of the tracked ones, at
  least one when two or more are tracked) are ejected. **An ejected worker is
  not probed**: requests get ``skipped(ejected)`` at once. When its ejection
  ends it is on probation: the next probe decides; a valid status readmits it,
  one more failure ejects it again (n + 1).
- **Collective failure.** More failing workers than the cap is a shared cause,
  not outliers: nobody is ejected while it lasts, and the ejections in force
  end at once (their count is given back), so every failing worker is probed
  and readmitted by its first good probe.
- **Usable status** (``cached``): the last valid status, younger than
  ``max_status_age_s``, the worker not ejected and its last probe not failed.
  **Routable** (``is_routable``): not ejected, its last probe was not refused
  (``unavailable``), and no status younger than ``max_status_age_s`` says it is
  not alive. A worker never probed is routable; so is one whose probe was slow
  or garbled (unusable for scoring, not known to be down).
- **Background refresh** (``background_refresh``, while ``refresh_interval_s <
  fresh_ttl_s``): a worker a request named as a candidate within
  ``hot_window_s`` is *hot*; the owner polls each hot worker every
  ``refresh_interval_s``, so requests find its status fresh and make one remote
  call (the cache query) instead of a probe too — but only while requests read
  it: a hot worker not read within ``refresh_idle_gaps`` of its usual gaps
  between reads (at least two intervals, at most the hot window) is not polled
  until it is read again. A round also polls the hot workers due within a
  quarter interval, so polls that drifted apart start together again. A worker
  nobody names goes cold and is no longer polled. A poll never waits for budget: it takes an
  in-flight slot only when one is free with nobody queued, and a token only when
  the bucket holds more than the ``1 − refresh_budget_share`` part of its burst
  kept for requests' probes, and at most ``refresh_budget_share`` of the rate.
  With ``serial_refresh`` a round's polls are one transport call made in turn
  (``_fly_in_turn``) instead of a task each; a worker whose last probe failed, or
  whose last call took more than half of ``fresh_ttl_s − refresh_interval_s``, is
  polled on its own, since the round's replies land only when the round returns.
  A poll or health probe made on its own is a background call to the transport
  (``background=True``: nobody waits for it, so over gRPC its start on an idle
  channel is made off the event loop); a request's probe is not.
- **Background health probes** (with a ``fleet`` and ``health_interval_s`` > 0):
  every interval a pass over the discovered workers probes those not heard from
  for an interval, in steps of at most ``health_max_probes``, each step going on
  where the last stopped as background probes land; they take only the rate
  tokens already in the bucket beyond a refresh round's, and at most half of the
  background slots, so routability (and a status to read from the cache) is
  known in domain routing too.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import trio

from actors.inbox import take_queued
from actors.probe_budget import (
    TokenBucket,
    collective_failure,
    decayed_ejection_count,
    ejection_allowed,
    ejection_duration_s,
    prober_problems,
)
from router.config import ProberConfig
from router.problems import refuse
from router.slot_init import slot_init
from router.transport.errors import NotSent, TransportError, Unavailable
from router.transport.ports import WorkerStatusAsk, WorkerStatusTransport
from router.types import Role, WorkerAddr, WorkerStatus

_NEVER = float("-inf")
_FOREVER = float("inf")
# Of the hot window: how stale the published wanted_at of a worker may get before a request whose
# statuses were all fresh tells the owner again (others say nothing: no message, no wake-up).
_TOUCH_EVERY = 1 / 8
# Of the refresh interval: a round also polls the hot workers due within this much of it, so polls
# that drifted apart (a request's on-demand probe, a late round) start together again and share the
# owner's wake-ups (measured cheaper than the same polls one by one).
_ALIGN_WITHIN = 1 / 4
# Weight of the newest gap in a worker's running mean of the gaps between reads.
_GAP_WEIGHT = 1 / 4
# A worker is polled while read within at least this many refresh intervals, whatever its usual gap:
# a stall of the event loop (a long collection) delays reads of every worker at once.
_MIN_KEEP_INTERVALS = 2
# Of the time a polled status has to spare (fresh_ttl_s − refresh_interval_s): a worker whose last call
# took longer is polled on its own, outside the serial round. The round's replies land only when it
# returns, so one slow answer would age every other status of the round past that spare.
_SLOW_CALL_OF_SPARE = 1 / 2
PROBE_TIMEOUT_KIND = "probe_timeout"  # failure kind when a started RPC outlives probe_timeout_s
# A health pass refused a probe with none of its own out to land retries no sooner than this (a slot
# refused frees with a request's probe, which does not wake the pass).
HEALTH_RETRY_MIN_S = 0.005
# A failure's detail (a garbled reply's names the broken field) is kept to this many characters a worker:
# a peer's text must not grow the owner's state or the debug snapshot.
_DETAIL_CHARS = 200
# A full status cache looks this far from its least recently used end for a worker to forget (_evictable).
_EVICTION_SCAN = 32
# The snapshot lists the failures of at most this many workers, those checked most recently.
_ERRORS_SHOWN = 16


class ProbeOutcome(enum.Enum):
    OK = "ok"  # a valid status (fresh from the cache, or just probed)
    NO_STATUS = "no_status"  # the worker answered with status_version 0
    FAILED = "failed"  # transport error or no answer within probe_timeout_s; see error_kind
    SKIPPED = "skipped"  # no probe was made for this request; see skip_reason


class SkipReason(enum.Enum):
    """Values double as metric labels (``kvroute_probe_skipped_total{reason}``)."""

    # No token or in-flight slot before the deadline (or no room in the inbox), or the probe's time ran out
    # before its request was on its way to the worker (waiting for its channel or a thread).
    NO_BUDGET = "no_budget"
    # The request stopped waiting before the prober's task had taken it from the inbox: nothing was
    # decided about its probe (the loop was busy), so nothing is said about the budget.
    QUEUED = "queued"
    EJECTED = "ejected"
    # The deadline had passed, or came while the RPC was in flight; or the worker answered within
    # probe_timeout_s and the time ran out decoding its reply.
    DEADLINE = "deadline"
    STOPPED = "stopped"  # the prober is not running (e.g. being restarted)
    GONE = "gone"  # left discovery (a later retain) while the request that named it was on its way


class _Unjudged(enum.Enum):
    """Why a probe's call ended with nothing to hold for or against its worker."""

    NOT_SENT = "not_sent"  # its time ran out before the request was on its way (a channel, a thread)
    ANSWERED_LATE = "answered_late"  # answered in time; the time ran out decoding the reply


class ProbeKind(enum.Enum):
    """Why a probe was made; values double as metric labels."""

    ON_DEMAND = "on_demand"  # a request wanted a worker without a fresh status
    REFRESH = "refresh"  # background refresh of a hot worker
    HEALTH = "health"  # background health probe of a discovered worker


@slot_init
@dataclass(frozen=True, slots=True)
class ProbeResult:
    worker: WorkerAddr
    outcome: ProbeOutcome
    status: WorkerStatus | None = None  # set exactly when outcome is OK
    from_cache: bool = False  # OK without an RPC for this request
    observed_at: float | None = None  # trio time the status was received (its age counts from here)
    # Trio time its call was sent: the status holds no dispatch decided after it, so pre-charges are
    # cleared only up to here (the reply's arrival would also clear those made while it was in flight).
    sent_at: float | None = None
    error_kind: str | None = None  # TransportError.kind or PROBE_TIMEOUT_KIND, when FAILED
    skip_reason: SkipReason | None = None  # when SKIPPED
    background: bool = False  # from the cache, and that status came from a background poll

    def age_s(self, now: float) -> float | None:
        return None if self.observed_at is None else now - self.observed_at


@slot_init
@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the owner last knew of one worker, as published (immutable)."""

    status: WorkerStatus | None  # the last valid status
    status_at: float
    status_sent_at: float  # when that status's call was sent (``ProbeResult.sent_at``)
    failed: bool  # a probe failed since that status: not usable for scoring
    unreachable: bool  # the last probe was refused
    ejected_until: float
    last_error: str
    last_error_detail: str  # what the last failure said (at most _DETAIL_CHARS)
    background: bool  # the status came from a background poll
    wanted_at: float  # a request named it then (the owner's record, renewed at most every _TOUCH_EVERY)
    # What a request reads of this status while it is fresh: built once per view, not per read.
    cached: ProbeResult | None


@dataclass(frozen=True, slots=True)
class ProberView:
    """The snapshot hot-path readers use; the owner replaces it, never changes it."""

    running: bool
    workers: Mapping[WorkerAddr, WorkerView]  # only workers something is known of
    ejected: Mapping[WorkerAddr, float]  # ejection ends (some may have passed: compare with now)


_EMPTY_VIEW = ProberView(running=False, workers={}, ejected={})
_NO_WORKERS: frozenset[WorkerAddr] = frozenset()


def _reported_down(seen: WorkerView, now: float, max_age_s: float) -> bool:
    """Its last status, younger than ``max_age_s``, says it is not alive (an older one says nothing
    now: without a probe since, it would keep a recovered worker out for good)."""
    return seen.status is not None and not seen.status.alive and now - seen.status_at < max_age_s


class _Phase(enum.Enum):
    BUDGET = "budget"  # waiting for a token or an in-flight slot
    RPC = "rpc"


@dataclass(eq=False, slots=True)
class _WorkerState:
    status: WorkerStatus | None = None  # last valid status (status_version != 0)
    status_at: float = _NEVER
    status_sent_at: float = _NEVER  # when that status's call was sent
    status_background: bool = False  # that status came from a background poll
    latest_finished_version: int = -1  # echoed on the next probe
    checked_at: float = _NEVER  # the last probe's end: an answer or a failure
    started_at: float = _NEVER  # the last probe's start (refresh is due a refresh interval after it)
    call_s: float = 0.0  # how long the last call made to it took (an answer or a failure)
    wanted_at: float = _NEVER  # the last time a request named it
    last_error: str = ""  # the last failure's kind
    last_error_detail: str = ""  # and what it said (at most _DETAIL_CHARS)
    unreachable: bool = False  # the last probe was refused: known unreachable until a good probe
    consecutive_failures: int = 0
    times_ejected: int = 0
    ejected_until: float = _NEVER
    flight: _Flight | None = None

    def cache_hit(self, worker: WorkerAddr, status: WorkerStatus) -> ProbeResult:
        """What a request reads of ``status`` (this worker's last valid one) while it is fresh."""
        return ProbeResult(
            worker,
            ProbeOutcome.OK,
            status,
            from_cache=True,
            observed_at=self.status_at,
            sent_at=self.status_sent_at,
            background=self.status_background,
        )

    def view(self, worker: WorkerAddr) -> WorkerView:
        cached = None if self.status is None else self.cache_hit(worker, self.status)
        return WorkerView(
            self.status,
            self.status_at,
            self.status_sent_at,
            self.consecutive_failures > 0,
            self.unreachable,
            self.ejected_until,
            self.last_error,
            self.last_error_detail,
            self.status_background,
            self.wanted_at,
            cached,
        )


@dataclass(eq=False, slots=True)
class _Reads:
    """When requests last read a worker's status, and the usual gap between their reads.

    The callers' record: ``probe`` updates it for each worker it names (no message, no hop); the owner
    creates it when it first learns the worker is wanted, reads it to decide a poll, and drops it
    when it forgets the worker."""

    at: float
    gap: float  # running mean of the gaps between reads (the newest weighted _GAP_WEIGHT)

    def read(self, now: float) -> None:
        self.gap += (now - self.at - self.gap) * _GAP_WEIGHT
        self.at = now


@dataclass(eq=False, slots=True)
class _Flight:
    """One pending probe of one worker, shared by every request waiting for it.

    The owner creates it, attaches waiters and extends ``budget_scope``; its probe task alone sets
    ``phase`` and ``slot``."""

    worker: WorkerAddr
    state: _WorkerState
    token_at: float
    budget_scope: trio.CancelScope  # deadline = the latest deadline among waiters
    kind: ProbeKind
    waiters: list[ProbeHandle] = field(default_factory=list)
    phase: _Phase = _Phase.BUDGET
    slot: bool = False  # holds an in-flight slot (taken by the owner for background polls)
    done: bool = False  # the owner has applied its outcome (or given up on it at a stop)


@dataclass(eq=False, slots=True)
class _Landed:
    """A probe task's outcome, for the owner to apply."""

    flight: _Flight
    at: float = 0.0
    status: WorkerStatus | None = None
    error_kind: str = ""  # set when the RPC failed
    error_detail: str = ""  # what the failure said
    no_budget: bool = False  # no slot before the deadline: the token goes back
    # The worker answered within probe_timeout_s, and the time ran out while its reply was decoded (a
    # large reply waiting for a decode thread, or this thread stalled): no status, nothing against it.
    answered_late: bool = False
    inflight: int = 0  # RPCs in flight when this one started
    call_s: float | None = None  # how long the call took (None: no call was made)
    sent_at: float = 0.0  # when the call was sent (set with call_s)


@dataclass(eq=False, slots=True)
class _Wanted:
    """A request named ``workers`` (they are hot); ``handle`` waits for those it could not answer."""

    workers: tuple[WorkerAddr, ...]
    handle: ProbeHandle | None
    ask: tuple[WorkerAddr, ...]
    epoch: int  # the retains made before it was sent: one made after it must not let it revive a worker


_Message = _Wanted | _Landed | None  # None: wake up (a retain was left in the mailbox)


class ProbeHandle:
    """One request's probes: results in hand now, the rest arriving as they complete.

    Wait under your own cancel scope (``async for result in handle`` or
    ``await handle.wait_all()``), then read ``results()``. Waiting never extends
    the request's deadline; nothing is queued for the request past it.
    """

    def __init__(self, workers: tuple[WorkerAddr, ...], deadline: float, skipped: dict[SkipReason, int]) -> None:
        """``skipped``: the prober's count of skips, to which ``results()`` adds those it reports."""
        self.workers = workers
        self.deadline = deadline
        self._skipped = skipped
        self._delivered: dict[WorkerAddr, ProbeResult] = {}
        # Pending workers results() reported as skipped (and counted): a skip the owner delivers them
        # later is not counted again.
        self._reported: set[WorkerAddr] = set()
        self._flights: dict[WorkerAddr, _Flight] = {}
        # Made on first iteration only: most requests just wait_all(), and a channel per request
        # is measurable on the hot path.
        self._send: trio.MemorySendChannel[ProbeResult] | None = None
        self._all_done = trio.Event()
        if not workers:
            self._all_done.set()

    @property
    def pending(self) -> int:
        return len(self.workers) - len(self._delivered)

    def __aiter__(self) -> AsyncIterator[ProbeResult]:
        """Every result (those in hand at once first), ending when none is pending. One consumer."""
        assert self._send is None, "a ProbeHandle has one consumer"
        # Each worker delivers exactly once, so a buffer of len(workers) never fills.
        self._send, receive = trio.open_memory_channel[ProbeResult](max(1, len(self.workers)))
        for result in self._delivered.values():  # in delivery order
            self._send.send_nowait(result)
        if self._all_done.is_set():
            self._send.close()
        return receive

    async def wait_all(self) -> None:
        """Return when every worker has a result; bound it with the caller's cancel scope."""
        await self._all_done.wait()

    def results(self) -> tuple[ProbeResult, ...]:
        """One result per requested worker, in request order. A probe still pending counts as
        skipped: ``deadline`` if its RPC is in flight, ``no_budget`` if it waits for budget, ``queued``
        if the prober has not taken the request yet; counted in the prober's ``skipped`` once per
        worker."""
        out: list[ProbeResult] = []
        for worker in self.workers:
            result = self._delivered.get(worker)
            if result is None:
                flight = self._flights.get(worker)
                if flight is None:
                    reason = SkipReason.QUEUED
                elif flight.phase is _Phase.RPC:
                    reason = SkipReason.DEADLINE
                else:
                    reason = SkipReason.NO_BUDGET
                result = ProbeResult(worker, ProbeOutcome.SKIPPED, skip_reason=reason)
                if worker not in self._reported:
                    self._reported.add(worker)
                    self._skipped[reason] += 1
            out.append(result)
        return tuple(out)

    def statuses(self) -> dict[WorkerAddr, WorkerStatus]:
        """The valid statuses in hand now (fresh cache hits and probes answered so far)."""
        return {w: r.status for w, r in self._delivered.items() if r.status is not None}

    def _attach(self, flight: _Flight) -> None:
        self._flights[flight.worker] = flight
        flight.waiters.append(self)

    def _deliver(self, result: ProbeResult) -> None:
        if result.worker in self._delivered:
            return
        self._delivered[result.worker] = result
        self._flights.pop(result.worker, None)
        if self._send is not None:
            self._send.send_nowait(result)
        if len(self._delivered) == len(self.workers):
            if self._send is not None:
                self._send.close()
            self._all_done.set()


@dataclass(frozen=True, slots=True)
class ProberHealth:
    """The prober's health snapshot (debug endpoint and metrics)."""

    running: bool
    inflight: int  # RPCs in flight now
    peak_inflight: int
    inflight_cap: int
    waiting_for_budget: int  # pending probes that have no in-flight slot yet
    budget_tokens: float  # rate-bucket tokens now; negative = reserved ahead by waiting probes
    tracked_workers: int  # status-cache entries
    cache_hits: int  # lookups answered from a fresh status, no RPC
    cache_misses: int  # lookups that needed a probe: probes_started + coalesced
    probes_started: int  # on-demand probes this prober started (each makes at most one RPC)
    coalesced: int  # lookups that joined a pending probe
    cache_hit_ratio: float  # cache_hits / (cache_hits + cache_misses)
    probes_ok: int
    probes_failed: int
    probes_no_status: int  # replies with status_version 0 (ignored)
    failed_by_kind: dict[str, int]
    # status target → "kind: detail" of the workers whose last probe failed (the _ERRORS_SHOWN checked last)
    last_errors: dict[str, str]
    skipped: dict[str, int]  # per requested worker, by SkipReason value (as each request's results() read)
    ejected_until: dict[str, float]  # status target → trio time the ejection ends
    failing: int  # tracked workers with eject_after_failures or more consecutive failures
    collective_failure: bool  # more failing than may be ejected: nobody is ejected now
    collective_failures: int  # collective failures seen (each ended the ejections in force)
    health_probes: int  # background health probes started
    refresh_active: bool  # background refresh on (the switch, and refresh_interval_s < fresh_ttl_s)
    refresh_polls: int  # background refresh polls started
    refresh_short_of_budget: int  # due refresh polls put off: no spare token or free slot
    refresh_idle_skips: int  # due refresh polls not made: no request read the worker within its keep window
    hot_workers: int  # workers named by a request within hot_window_s
    fresh_from_background: int  # cache hits whose status came from a background poll
    wanted_dropped: int  # probe() messages that found the inbox full
    inbox_depth: int
    inbox_capacity: int


StatusListener = Callable[[WorkerAddr, WorkerStatus], None]


class WorkerProber:
    """Probes worker statuses for requests under one global budget (see the module docstring)."""

    def __init__(
        self,
        config: ProberConfig,
        transport: WorkerStatusTransport,
        *,
        fleet: Callable[[], Sequence[WorkerAddr]] | None = None,
        on_probes: Callable[[ProbeKind, int], None] | None = None,
    ) -> None:
        """``fleet`` returns the discovered workers (the background health probes' subjects);
        ``on_probes`` is told of the background probes the owner starts (synchronously: it must
        not block)."""
        refuse("prober", prober_problems(config))
        self._config = config
        self._max_status_age_s = config.max_status_age_s
        self._transport = transport
        self._fleet = fleet
        self._on_probes = on_probes
        self._limiter = trio.CapacityLimiter(config.inflight_cap)
        # Created full: its first refill, at whatever trio time, tops it up to the burst.
        self._bucket = TokenBucket(config.rate_per_s, config.rate_burst, now=_NEVER)
        share = config.refresh_budget_share
        self._refresh_bucket = TokenBucket(
            share * config.rate_per_s, max(1, math.floor(share * config.rate_burst)), now=_NEVER
        )
        self._refresh_keep = math.floor((1.0 - share) * config.rate_burst)  # tokens kept for requests
        self._refresh_slots = max(1, math.floor(share * config.inflight_cap))
        # Health probes hold at most half of those, so a health pass that goes on as slots free never
        # leaves a refresh round without a slot.
        self._health_slots = max(1, self._refresh_slots // 2)
        # The most a health probe leaves for the next refresh round beyond the requests' part: half of
        # what the burst holds above it, so a health probe can still start with the bucket not full
        # (a token per hot worker with 32 or more hot ones could never be met, and health probes stopped).
        self._refresh_reserve_max = max(0, (math.floor(config.rate_burst) - self._refresh_keep) // 2)
        self._refresh_active = config.background_refresh and config.refresh_interval_s < config.fresh_ttl_s
        self._touch_every_s = _TOUCH_EVERY * config.hot_window_s
        self._min_keep_s = _MIN_KEEP_INTERVALS * config.refresh_interval_s
        self._slow_call_s = _SLOW_CALL_OF_SPARE * (config.fresh_ttl_s - config.refresh_interval_s)
        # The inbox: a _Wanted per probe() call, a _Landed per probe (at most max_tracked_workers pending).
        self._inbox_capacity = config.max_tracked_workers
        self._send, self._receive = trio.open_memory_channel[_Message](self._inbox_capacity)
        # The one-slot mailbox (latest wins) and the count of retains made, which each _Wanted carries.
        self._retain_next: tuple[int, frozenset[WorkerAddr]] | None = None
        self._retain_epoch = 0
        self._view = _EMPTY_VIEW
        # --- owned by run()'s task ---
        self._retained: frozenset[WorkerAddr] = frozenset()  # the last retain applied (none: epoch 0)
        self._retained_epoch = 0
        self._nursery: trio.Nursery | None = None
        self._workers: OrderedDict[WorkerAddr, _WorkerState] = OrderedDict()  # LRU, bounded
        self._views: dict[WorkerAddr, WorkerView] = {}  # published as ProberView.workers
        self._ejected: dict[WorkerAddr, float] = {}  # tracked workers only → ejection end
        self._failing: set[WorkerAddr] = set()  # tracked workers at eject_after_failures or more
        self._hot: OrderedDict[WorkerAddr, None] = OrderedDict()  # least recently wanted first
        # The callers' record of reads (see _Reads): the owner adds and drops entries, callers update them.
        self._reads: dict[WorkerAddr, _Reads] = {}
        self._flights: set[_Flight] = set()
        self._dirty = True
        self._next_refresh = _FOREVER
        self._next_health = _FOREVER
        self._collective_failures = 0
        self._health_probes = 0
        self._health_cursor = 0
        self._health_pass_at = _FOREVER  # when the next pass over the fleet starts (every health interval)
        self._health_left = 0  # workers this pass has still to look at: it goes on as slots free
        self._refresh_polls = 0
        self._refresh_short = 0
        self._refresh_idle = 0
        self._refresh_inflight = 0
        self._health_inflight = 0  # health probes holding a slot
        self._pending_probes = 0
        self._peak_inflight = 0
        self._cache_hits = 0
        self._probes_started = 0
        self._coalesced = 0
        self._probes_ok = 0
        self._status_listeners: list[StatusListener] = []
        self._probes_no_status = 0
        self._failed_by_kind: dict[str, int] = {}
        self._skipped: dict[SkipReason, int] = dict.fromkeys(SkipReason, 0)
        self._background_hits = 0  # the owner's cache hits whose status came from a background poll
        # --- the callers' own counters (each caller only adds) ---
        self._view_hits = 0
        self._view_background_hits = 0
        self._view_skipped: dict[SkipReason, int] = dict.fromkeys(SkipReason, 0)
        self._wanted_dropped = 0
        self._in_hand: _Wanted | None = None  # the request being applied (a bug there ends the run)

    # --- the owner ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[WorkerProber] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the inbox and the background timers until cancelled. The cache and ejections
        survive a restart; the probes pending at a stop end ``stopped`` for their waiters."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                now = trio.current_time()
                self._next_health = now if self._fleet is not None and self._config.health_interval_s > 0 else _FOREVER
                self._health_pass_at = self._next_health
                self._next_refresh = now if self._refresh_active else _FOREVER
                self._dirty = True
                self._publish()
                task_status.started(self)
                await self._serve()
        finally:
            self._nursery = None
            self._stop_flights()
            self._stop_wanted()
            self._dirty = True
            self._publish()

    async def _serve(self) -> None:
        """Apply what is queued without yielding (each message is short and nothing can add to the
        inbox meanwhile), publish once per batch, then wait for a message or the next timer."""
        receive = self._receive
        while True:
            now = trio.current_time()
            if now >= self._next_health or now >= self._next_refresh:
                self._background(now)
            try:
                message = receive.receive_nowait()
            except trio.WouldBlock:
                self._publish()
                wake_at = min(self._next_health, self._next_refresh)
                if wake_at == _FOREVER:
                    message = await receive.receive()
                else:
                    with trio.move_on_at(wake_at):
                        message = await receive.receive()
                        self._apply(message)
                    continue
            self._apply(message)

    def _apply(self, message: _Message) -> None:
        if self._retain_next is not None:
            (self._retained_epoch, keep), self._retain_next = self._retain_next, None
            self._retained = keep
            for worker in [w for w in self._workers if w not in keep]:
                self._forget(worker)
        if isinstance(message, _Landed):
            self._landed(message)
        elif isinstance(message, _Wanted):
            self._in_hand = message
            self._wanted(message)
            self._in_hand = None

    def _publish(self) -> None:
        if self._dirty:
            self._view = ProberView(self._nursery is not None, dict(self._views), dict(self._ejected))
            self._dirty = False

    def _stop_wanted(self) -> None:
        """At the task's end: the probes asked of it and not answered end ``stopped`` for their callers
        at once (those of the message in hand, if a bug ended the run there, and those queued behind
        it), instead of at their deadlines; the outcomes queued, and what the queued requests say of
        the workers they named (hot, wanted), are kept for the next run."""
        wanted = [] if self._in_hand is None else [self._in_hand]
        self._in_hand = None
        for message in take_queued(self._receive):
            if isinstance(message, _Wanted):
                wanted.append(message)
                message = _Wanted(message.workers, None, (), message.epoch)
            self._send.send_nowait(message)
        for message in wanted:
            handle = message.handle
            if handle is None:
                continue
            for worker in message.ask:
                if worker not in handle._delivered:
                    handle._deliver(self._skip(worker, SkipReason.STOPPED, handle))

    def _stop_flights(self) -> None:
        """The probe tasks died with the nursery: end their waits and free their workers, and give
        back the tokens of those still waiting for budget (their calls will not be made)."""
        now = trio.current_time()
        for flight in self._flights:
            if flight.phase is _Phase.BUDGET:
                self._give_back_tokens(flight, now)
            flight.done = True
            if flight.state.flight is flight:
                flight.state.flight = None
            self._finish(flight, self._outcome_skipped(flight, SkipReason.STOPPED))
        self._flights.clear()
        self._pending_probes = 0
        self._refresh_inflight = 0
        self._health_inflight = 0

    # --- request path ------------------------------------------------------------------------

    def probe(self, workers: Sequence[WorkerAddr], deadline: float) -> ProbeHandle:
        """Answer from the view what is fresh; ask the owner for the rest; return at once.

        ``deadline`` is an absolute trio time: budget is acquired only before it
        (pass the time by which a result is still useful to the decision).
        Duplicates in ``workers`` are probed once.
        """
        now = trio.current_time()
        handle = ProbeHandle(tuple(dict.fromkeys(workers)), deadline, self._view_skipped)
        view = self._view
        known = view.workers
        fresh_ttl = self._config.fresh_ttl_s
        ask: list[WorkerAddr] = []
        told_after = now - self._touch_every_s
        tell = False
        reads = self._reads
        for worker in handle.workers:
            read = reads.get(worker)
            if read is not None:
                read.read(now)
            seen = known.get(worker)
            if seen is None or seen.wanted_at < told_after:
                tell = True
            if seen is not None and seen.cached is not None and not seen.failed and now - seen.status_at < fresh_ttl:
                self._view_hits += 1
                self._view_background_hits += seen.background
                handle._deliver(seen.cached)
            elif seen is not None and seen.ejected_until > now:
                handle._deliver(self._view_skip(worker, SkipReason.EJECTED))
            elif not view.running:
                handle._deliver(self._view_skip(worker, SkipReason.STOPPED))
            elif deadline <= now:
                handle._deliver(self._view_skip(worker, SkipReason.DEADLINE))
            else:
                ask.append(worker)
        if not (ask or tell):
            return handle  # the owner knows these are wanted, and nothing is missing
        try:
            self._send.send_nowait(_Wanted(handle.workers, handle if ask else None, tuple(ask), self._retain_epoch))
        except trio.WouldBlock:
            self._wanted_dropped += 1
            for worker in ask:
                handle._deliver(self._view_skip(worker, SkipReason.NO_BUDGET))
        return handle

    def cached(self, worker: WorkerAddr) -> WorkerStatus | None:
        """The worker's status if usable for scoring now (see the module docstring), else None."""
        observed = self.cached_observed(worker)
        return None if observed is None else observed[0]

    def cached_observed(self, worker: WorkerAddr) -> tuple[WorkerStatus, float] | None:
        """Like :meth:`cached`, with the trio time the status's call was sent (for pre-charge clearing)."""
        seen = self._view.workers.get(worker)
        if seen is None or seen.status is None or seen.failed:
            return None
        now = trio.current_time()
        if seen.ejected_until > now or now - seen.status_at >= self._config.max_status_age_s:
            return None
        return seen.status, seen.status_sent_at

    def is_routable(self, worker: WorkerAddr, roles: Collection[Role] | None = None) -> bool:
        """Not known to be unreachable (not ejected, last probe not refused) and, with ``roles``,
        not known to serve another role. A worker never probed is routable."""
        return self._routable(self._view.workers.get(worker), roles, trio.current_time(), self._max_status_age_s)

    def reported_role(self, worker: WorkerAddr) -> Role | None:
        """The role the worker last reported, however old that status (what routability judged it
        by); None for a worker never heard from."""
        seen = self._view.workers.get(worker)
        return None if seen is None or seen.status is None else seen.status.role

    def unfit_for(self, roles: Collection[Role]) -> Callable[[WorkerAddr], bool]:
        """Whether a worker last reported a role outside ``roles``, or a status younger than
        ``max_status_age_s`` said it is not alive, from the published view (a worker never heard from
        is fit: it may serve them). A cold place given to one would be dropped after its probe."""
        known = self._view.workers
        now = trio.current_time()
        max_age_s = self._max_status_age_s

        def unfit(worker: WorkerAddr) -> bool:
            seen = known.get(worker)
            if seen is None or seen.status is None:
                return False
            return seen.status.role not in roles or _reported_down(seen, now, max_age_s)

        return unfit

    def unroutable_reason(self, workers: Sequence[WorkerAddr], roles: Collection[Role]) -> str | None:
        """None when one of ``workers`` is routable for ``roles``; else why none is.

        Stops at the first routable worker, so it costs a full scan only when most are down.
        """
        now = trio.current_time()
        known = self._view.workers
        max_age_s = self._max_status_age_s
        if any(self._routable(known.get(w), roles, now, max_age_s) for w in workers):
            return None
        ejected = failing = not_alive = other_role = 0
        kinds: set[str] = set()
        for worker in workers:
            seen = known.get(worker)
            if seen is None:
                continue  # unreachable: a never-probed worker is routable
            if seen.ejected_until > now:
                ejected += 1
            elif seen.unreachable:
                failing += 1
            elif _reported_down(seen, now, max_age_s):
                not_alive += 1
                continue
            else:
                other_role += 1
                continue
            kinds.add(seen.last_error)
        parts = []
        if ejected:
            parts.append(f"{ejected} ejected")
        if failing:
            parts.append(f"{failing} refusing probes")
        if not_alive:
            parts.append(f"{not_alive} reporting themselves not alive")
        if other_role:
            parts.append(f"{other_role} reporting another role")
        detail = ", ".join(parts) + (f"; last errors: {', '.join(sorted(kinds))}" if kinds else "")
        return f"no routable worker: none of the {len(workers)} discovered workers can take a request ({detail})"

    def ejected(self) -> Collection[WorkerAddr]:
        """The workers ejected now (for the candidate plan to skip)."""
        ejected = self._view.ejected
        if not ejected:
            return _NO_WORKERS
        now = trio.current_time()
        return frozenset(w for w, until in ejected.items() if until > now)

    def view(self) -> ProberView:
        """The snapshot the owner last published."""
        return self._view

    def on_status(self, listener: StatusListener) -> None:
        """Call ``listener`` with every new valid status (from the owner's task: it must not block)."""
        self._status_listeners.append(listener)

    def retain(self, workers: Collection[WorkerAddr]) -> None:
        """Forget every worker not in ``workers`` (call on discovery changes); the owner applies it
        before the next message it handles. A request sent before it and handled after it is held
        to it: the workers it named that left are answered GONE, not tracked again."""
        self._retain_epoch += 1
        self._retain_next = (self._retain_epoch, frozenset(workers))
        with contextlib.suppress(trio.WouldBlock):  # a full inbox wakes the owner anyway
            self._send.send_nowait(None)

    def snapshot(self) -> ProberHealth:
        now = trio.current_time()
        hits = self._cache_hits + self._view_hits
        misses = self._probes_started + self._coalesced
        lookups = hits + misses
        inflight = self._limiter.borrowed_tokens
        skipped = {reason.value: n + self._view_skipped[reason] for reason, n in self._skipped.items()}
        return ProberHealth(
            running=self._nursery is not None,
            inflight=inflight,
            peak_inflight=self._peak_inflight,
            inflight_cap=self._config.inflight_cap,
            waiting_for_budget=self._pending_probes - inflight,
            budget_tokens=self._bucket.peek(now),
            tracked_workers=len(self._workers),
            cache_hits=hits,
            cache_misses=misses,
            probes_started=self._probes_started,
            coalesced=self._coalesced,
            cache_hit_ratio=hits / lookups if lookups else 0.0,
            probes_ok=self._probes_ok,
            probes_failed=sum(self._failed_by_kind.values()),
            probes_no_status=self._probes_no_status,
            failed_by_kind=dict(self._failed_by_kind),
            last_errors=self._last_errors(),
            skipped=skipped,
            ejected_until={w.status_target: until for w, until in self._ejected.items() if until > now},
            failing=len(self._failing),
            collective_failure=self._collective(),
            collective_failures=self._collective_failures,
            health_probes=self._health_probes,
            refresh_active=self._refresh_active,
            refresh_polls=self._refresh_polls,
            refresh_short_of_budget=self._refresh_short,
            refresh_idle_skips=self._refresh_idle,
            hot_workers=len(self._hot),
            fresh_from_background=self._view_background_hits + self._background_hits,
            wanted_dropped=self._wanted_dropped,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._inbox_capacity,
        )

    def _last_errors(self) -> dict[str, str]:
        failed = [(worker, state) for worker, state in self._workers.items() if state.consecutive_failures]
        failed.sort(key=lambda entry: entry[1].checked_at, reverse=True)
        return {
            worker.status_target: f"{state.last_error}: {state.last_error_detail}"
            for worker, state in failed[:_ERRORS_SHOWN]
        }

    def _view_skip(self, worker: WorkerAddr, reason: SkipReason) -> ProbeResult:
        self._view_skipped[reason] += 1
        return ProbeResult(worker, ProbeOutcome.SKIPPED, skip_reason=reason)

    @staticmethod
    def _routable(seen: WorkerView | None, roles: Collection[Role] | None, now: float, max_age_s: float) -> bool:
        if seen is None:
            return True
        if seen.unreachable or seen.ejected_until > now or _reported_down(seen, now, max_age_s):
            return False
        return roles is None or seen.status is None or seen.status.role in roles

    # --- the owner's work (synchronous, in run()'s task) ------------------------------------

    def _collective(self) -> bool:
        return collective_failure(len(self._failing), len(self._workers), self._config.max_ejected_fraction)

    def _wanted(self, message: _Wanted) -> None:
        now = trio.current_time()
        refresh = self._refresh_active
        hot = self._hot
        if refresh and not hot and self._nursery is not None:
            self._next_refresh = min(self._next_refresh, now + self._config.refresh_interval_s)
        told_after = now - self._touch_every_s / 2
        reads = self._reads
        retained = self._retained if message.epoch < self._retained_epoch else None
        for worker in message.workers:
            if retained is not None and worker not in retained:
                continue  # planned before it left discovery: not tracked again
            state = self._touch(worker)
            if worker not in reads:  # from now on the callers record its reads
                reads[worker] = _Reads(now, self._config.refresh_interval_s)
            if state.wanted_at < told_after:  # else told just now: the hot order stays by wanted_at
                state.wanted_at = now
                self._changed(worker, state)
                if refresh:
                    hot[worker] = None
                    hot.move_to_end(worker)
        handle = message.handle
        if handle is None:
            return
        for worker in message.ask:
            if retained is not None and worker not in retained:
                handle._deliver(self._skip(worker, SkipReason.GONE, handle))
                continue
            result = self._lookup(worker, handle, now)
            if result is not None:
                handle._deliver(result)

    def _lookup(self, worker: WorkerAddr, handle: ProbeHandle, now: float) -> ProbeResult | None:
        """A result known now, or None after attaching ``handle`` to a (new or pending) probe."""
        state = self._touch(worker)
        if (
            state.status is not None
            and not state.consecutive_failures
            and now - state.status_at < self._config.fresh_ttl_s
        ):
            self._cache_hits += 1
            self._background_hits += state.status_background
            return state.cache_hit(worker, state.status)
        if state.ejected_until > now:
            return self._skip(worker, SkipReason.EJECTED, handle)
        flight = state.flight
        # A probe whose wait for its budget is over by its waiters' deadline (cancelled, or past it
        # and about to give up) lands no_budget whatever deadline is set now: a request with time
        # left gets a probe of its own.
        budget_over = flight is not None and (
            flight.budget_scope.cancel_called or now >= flight.budget_scope.deadline
        )
        if flight is not None and not (flight.phase is _Phase.BUDGET and budget_over):
            self._coalesced += 1
            if flight.phase is _Phase.BUDGET and handle.deadline > flight.budget_scope.deadline:
                flight.budget_scope.deadline = handle.deadline
            handle._attach(flight)
            return None
        if handle.deadline <= now:
            return self._skip(worker, SkipReason.DEADLINE, handle)
        if self._pending_probes >= self._config.max_tracked_workers:
            return self._skip(worker, SkipReason.NO_BUDGET, handle)
        token_at = self._bucket.reserve(now, handle.deadline)
        if token_at is None:
            return self._skip(worker, SkipReason.NO_BUDGET, handle)
        flight = self._start(worker, state, token_at, handle.deadline, ProbeKind.ON_DEMAND, now)
        handle._attach(flight)
        self._probes_started += 1
        return None

    def _start(
        self, worker: WorkerAddr, state: _WorkerState, token_at: float, deadline: float, kind: ProbeKind, now: float
    ) -> _Flight:
        flight = _Flight(worker, state, token_at, trio.CancelScope(deadline=deadline), kind)
        self._launch(flight, now)
        return flight

    def _launch(self, flight: _Flight, now: float, batch: list[_Flight] | None = None) -> None:
        """The worker's one flight from now on, counted and flying (with ``batch``: flown with the rest
        of the batch by one task, see ``_fly_in_turn``)."""
        assert self._nursery is not None
        flight.state.flight = flight
        flight.state.started_at = now
        self._flights.add(flight)
        self._pending_probes += 1
        if batch is None:
            self._nursery.start_soon(self._fly, flight)
        else:
            batch.append(flight)

    def _skip(self, worker: WorkerAddr, reason: SkipReason, handle: ProbeHandle) -> ProbeResult:
        """A skip, counted unless ``handle``'s ``results()`` already counted it for ``worker``."""
        if worker not in handle._reported:
            self._skipped[reason] += 1
        return ProbeResult(worker, ProbeOutcome.SKIPPED, skip_reason=reason)

    def _touch(self, worker: WorkerAddr) -> _WorkerState:
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _WorkerState()
            while len(self._workers) > self._config.max_tracked_workers:
                self._forget(self._evictable(worker))
        else:
            self._workers.move_to_end(worker)
        return state

    def _evictable(self, keep: WorkerAddr) -> WorkerAddr:
        """The least recently used worker whose history does not matter: not ejected, no failure in a
        row. A fleet larger than the cache has its health passes track every worker in turn, and a
        failing worker, skipped by requests and passes alike, was always the oldest: forgotten, its
        failures never added up to an ejection. Looked for among the ``_EVICTION_SCAN`` oldest only
        (a walk of the whole cache per new worker, in a collective failure of a fleet larger than
        the cache, took the routing thread's CPU; ejections are suspended then anyway); else the
        oldest. Never ``keep``, the worker being tracked (the newest)."""
        for worker, state in itertools.islice(self._workers.items(), _EVICTION_SCAN):
            if worker != keep and state.consecutive_failures == 0 and worker not in self._ejected:
                return worker
        return next(iter(self._workers))

    def _forget(self, worker: WorkerAddr) -> None:
        # A pending probe of a forgotten worker still completes, updating only its orphaned state.
        del self._workers[worker]
        self._views.pop(worker, None)
        self._ejected.pop(worker, None)
        self._failing.discard(worker)
        self._hot.pop(worker, None)
        self._reads.pop(worker, None)
        self._dirty = True

    def _changed(self, worker: WorkerAddr, state: _WorkerState) -> None:
        if self._workers.get(worker) is state:
            self._views[worker] = state.view(worker)
            self._dirty = True

    # --- background polls (the owner's timers) ---------------------------------------------------

    def _background(self, now: float) -> None:
        if now >= self._next_refresh:
            self._refresh(now)
        if now >= self._next_health and self._fleet is not None:
            fleet = self._fleet()
            if now >= self._health_pass_at:
                self._health_pass_at = now + self._config.health_interval_s
                self._health_left = len(fleet)
            self._next_health = self._health_sweep(fleet, now)

    def _refresh(self, now: float) -> None:
        """Poll every hot worker whose last probe started a refresh interval ago; forget the cold.

        The next round is when the earliest hot worker is due again (at most an interval away; at
        least an eighth of one, so a worker short of budget does not spin the owner)."""
        interval = self._config.refresh_interval_s
        hot = self._hot
        cold_before = now - self._config.hot_window_s
        while hot:
            worker = next(iter(hot))
            if self._workers[worker].wanted_at >= cold_before:
                break
            del hot[worker]
        if not hot:
            self._next_refresh = _FOREVER  # idle: the next wanted worker sets the timer again
            return
        next_due = now + interval
        pull_by = now + _ALIGN_WITHIN * interval
        polls = short = idle = 0
        batch: list[_Flight] | None = [] if self._config.serial_refresh else None
        for worker in reversed(hot):  # the most recently wanted first, should the budget run short
            state = self._workers[worker]
            due = state.started_at + interval
            if due <= pull_by and state.flight is None and state.ejected_until <= now:
                # A worker whose last probe failed or answered slowly is polled on its own: the round's
                # replies (and the requests waiting on them) land only when its last call returns.
                on_its_own = state.consecutive_failures > 0 or state.call_s > self._slow_call_s
                in_turn = None if on_its_own else batch
                if not self._in_use(worker, now):
                    idle += 1
                    due = now + interval  # looked at again then: a read meanwhile resumes its polls
                elif self._start_background(worker, ProbeKind.REFRESH, now, state=state, batch=in_turn):
                    polls += 1
                    due = now + interval
                else:
                    short += 1
            next_due = min(next_due, due)
        if batch:
            assert self._nursery is not None
            self._nursery.start_soon(self._fly_in_turn, batch)
        self._refresh_polls += polls
        self._refresh_short += short
        self._refresh_idle += idle
        self._next_refresh = max(next_due, now + interval / 8)
        if polls and self._on_probes is not None:
            self._on_probes(ProbeKind.REFRESH, polls)

    def _in_use(self, worker: WorkerAddr, now: float) -> bool:
        """Read within its keep window: ``refresh_idle_gaps`` of its usual gaps between reads, at least
        ``_MIN_KEEP_INTERVALS`` refresh intervals, at most the hot window. A poll is worth its cost only
        if a request is likely to read the status before it expires: a worker read every few
        milliseconds stops being polled soon after its reads stop; a worker read now and then has a
        long window, so its status is fresh when the next read comes."""
        read = self._reads.get(worker)
        if read is None:
            return True
        keep = min(max(self._config.refresh_idle_gaps * read.gap, self._min_keep_s), self._config.hot_window_s)
        return now - read.at <= keep

    def _start_background(
        self,
        worker: WorkerAddr,
        kind: ProbeKind,
        now: float,
        *,
        state: _WorkerState | None = None,
        batch: list[_Flight] | None = None,
    ) -> bool:
        """Start a refresh poll or a health probe only with what requests leave: a token beyond the
        part of the burst kept for them (a refresh poll also within the refresh share of the rate), and
        a free slot nobody queues for, refresh polls and health probes together holding at most the
        refresh share of the slots (health probes at most half of it, and leaving a token per hot worker
        for the next refresh round). False: nothing started, nothing taken. ``state``: the worker's
        (None: tracked now); ``batch``: see ``_launch``."""
        if self._refresh_inflight + self._health_inflight >= self._refresh_slots:
            return False
        refresh = kind is ProbeKind.REFRESH
        if not refresh and self._health_inflight >= self._health_slots:
            return False
        if self._pending_probes >= self._config.max_tracked_workers:
            return False
        # A health probe also leaves a refresh round its tokens (one per hot worker): a health pass that
        # goes on as slots free would otherwise take the spare tokens as they refill.
        keep = self._refresh_keep if refresh else self._refresh_keep + min(len(self._hot), self._refresh_reserve_max)
        if self._bucket.peek(now) < 1.0 + keep:
            return False
        if refresh and not self._refresh_bucket.take(now):
            return False
        scope = trio.CancelScope(deadline=now + self._config.probe_timeout_s)
        flight = _Flight(worker, self._touch(worker) if state is None else state, now, scope, kind)
        try:
            self._limiter.acquire_on_behalf_of_nowait(flight)
        except trio.WouldBlock:
            if refresh:
                self._refresh_bucket.refund(now)
            return False
        self._bucket.take(now)
        flight.slot = True
        if refresh:
            self._refresh_inflight += 1
        else:
            self._health_inflight += 1
        self._launch(flight, now, batch)
        return True

    def _give_back_tokens(self, flight: _Flight, now: float) -> None:
        """The tokens of a flight whose call was not made: one of the rate, and a refresh poll's one of
        the refresh share too."""
        self._bucket.refund(now)
        if flight.kind is ProbeKind.REFRESH:
            self._refresh_bucket.refund(now)

    def _health_sweep(self, workers: Sequence[WorkerAddr], now: float) -> float:
        """Probe the next few workers not heard from for an interval (round robin over the fleet);
        when the pass's next step is due.

        One step of the interval's pass over the fleet, bounded whatever the fleet's size: it looks
        at most at ``8 × health_max_probes`` workers, probes at most ``health_max_probes``, and stops
        at the first probe refused for want of a slot or a token. The pass goes on with the next step
        when a background probe lands (its slot free again), until it has looked at every worker once;
        with none in flight to land (a window whose workers were all heard from lately, or a refusal
        with no background probe out), the next step is due at once, or when the tokens it wanted are
        back: else the pass would wait for the next interval, and workers only requests' probes kept
        fresh in the window would leave the rest unheard from past ``max_status_age_s``.
        Like a refresh poll, a health probe takes only what requests leave: a token beyond the part of
        the burst kept for them, and a free slot nobody queues for, within the refresh share of the
        slots. So it never makes requests' probes wait for budget, also when the workers it probes
        hang and hold their slots to the timeout; and it leaves a refresh round its tokens and half of
        those slots (see ``_start_background``).
        """
        n = len(workers)
        if not n:
            self._health_left = 0
            return self._health_pass_at
        limit = self._config.health_max_probes
        look = min(n, self._health_left, 8 * self._config.health_max_probes)
        start = self._health_cursor % n
        started = 0
        looked = 0
        refused = False
        while looked < look and started < limit:
            worker = workers[(start + looked) % n]
            state = self._workers.get(worker)
            if state is None or (
                state.flight is None
                and state.ejected_until <= now
                and now - state.checked_at >= self._config.health_interval_s
            ):
                if not self._start_background(worker, ProbeKind.HEALTH, now):
                    refused = True
                    break  # refused: the pass's next step starts with it
                started += 1
            looked += 1
        self._health_cursor = (start + looked) % n
        self._health_left -= looked
        self._health_probes += started
        if started and self._on_probes is not None:
            self._on_probes(ProbeKind.HEALTH, started)
        if self._health_left <= 0 or started >= limit or self._health_inflight + self._refresh_inflight:
            return self._health_pass_at  # done, or a background probe's landing goes on with the pass
        if not refused:
            return now  # the whole window heard from lately: the next one at once (the pass shrank)
        # Refused with nothing out to land: again when a health probe's token is back (a slot refused
        # frees with a request's probe: at the floor's pace), never busy.
        keep = self._refresh_keep + min(len(self._hot), self._refresh_reserve_max)
        wanted = 1.0 + keep - self._bucket.peek(now)
        return min(self._health_pass_at, now + max(wanted / self._config.rate_per_s, HEALTH_RETRY_MIN_S))

    # --- probe tasks (they only wait and call; the owner applies what they bring back) -----------

    async def _fly(self, flight: _Flight) -> None:
        landed = _Landed(flight)
        try:
            if flight.slot or await self._take_budget(flight):
                flight.slot = True
                flight.phase = _Phase.RPC
                landed.inflight = self._limiter.borrowed_tokens
                landed.sent_at = called_at = trio.current_time()
                outcome = await self._call(flight)
                if outcome is _Unjudged.NOT_SENT:  # it never reached the worker: as for want of budget
                    landed.no_budget = True
                elif outcome is _Unjudged.ANSWERED_LATE:
                    landed.answered_late = True
                else:
                    landed.status, landed.error_kind, landed.error_detail = outcome
                    landed.call_s = trio.current_time() - called_at
            else:
                landed.no_budget = True
        finally:
            if flight.slot:
                self._limiter.release_on_behalf_of(flight)
        landed.at = trio.current_time()
        await self._land(landed)

    async def _land(self, landed: _Landed) -> None:
        try:
            self._send.send_nowait(landed)  # the common case: room in the inbox, no extra schedule point
        except trio.WouldBlock:
            await self._send.send(landed)  # never dropped: the owner drains the inbox without waiting

    async def _fly_in_turn(self, flights: list[_Flight]) -> None:
        """A refresh round's polls (each holding its slot and token already), made one after another
        by one transport call within probe_timeout_s; each lands as its own probe would have. A poll
        the round's time did not reach lands as no budget: its token goes back, nothing is counted
        against the worker."""
        inflight = self._limiter.borrowed_tokens
        for flight in flights:
            flight.phase = _Phase.RPC
        asks = [WorkerStatusAsk(f.worker.status_target, f.state.latest_finished_version) for f in flights]
        started = trio.current_time()
        try:
            replies = await self._transport.get_worker_statuses(asks, self._config.probe_timeout_s)
        finally:
            for flight in flights:
                self._limiter.release_on_behalf_of(flight)
        previous_end_s = 0.0
        for flight, reply in zip(flights, replies, strict=True):
            # Each status is as old as its call's end, not the round's: a reply that waited for the
            # rest of the round is read as that much older.
            landed = _Landed(flight, at=started + reply.ended_after_s, inflight=inflight)
            status = reply.status
            if status is None:
                landed.no_budget = True
            else:
                # The call's own time: from its start where the transport says it (the first call of a
                # round starts after the round's leases and its wait for a thread), else from the
                # previous call's end (the calls are made one after another).
                began = previous_end_s if reply.began_after_s is None else reply.began_after_s
                landed.call_s = reply.ended_after_s - began
                landed.sent_at = started + began
                previous_end_s = reply.ended_after_s
                if isinstance(status, TransportError):
                    landed.error_kind, landed.error_detail = status.kind, status.detail
                else:
                    landed.status = status
            await self._land(landed)

    async def _take_budget(self, flight: _Flight) -> bool:
        """Wait for the flight's token, then an in-flight slot, before its requesters' latest deadline."""
        with flight.budget_scope:
            # Without waiting when the token is due and a slot is free: each avoided checkpoint is a
            # scheduler round trip off the request's latency.
            if flight.token_at > trio.current_time():
                await trio.sleep_until(flight.token_at)
            try:
                self._limiter.acquire_on_behalf_of_nowait(flight)  # refuses while others queue: FIFO is kept
            except trio.WouldBlock:
                await self._limiter.acquire_on_behalf_of(flight)
            # A slot handed over as the deadline passes still arrives (trio's acquire does not
            # checkpoint after parking), and this task may start late: never start past the deadline.
            if trio.current_time() < flight.budget_scope.deadline:
                return True
            self._limiter.release_on_behalf_of(flight)
        return False

    async def _call(self, flight: _Flight) -> tuple[WorkerStatus | None, str, str] | _Unjudged:
        """The RPC, bounded by probe_timeout_s alone (see the module docstring): the status, or the
        failure's kind and detail; or why the worker is neither credited nor blamed: the request never
        reached it (its time ran out waiting for a channel, or for a thread to start it on), or it
        answered and the time ran out decoding the reply."""
        sent = answered = False
        timeout_s = self._config.probe_timeout_s

        def mark_sent() -> None:
            nonlocal sent
            sent = True
            # The worker is judged on the time it had: a wait for a channel or a starter thread that took
            # most of probe_timeout_s left a healthy worker milliseconds, and counted it timed out.
            bound.deadline = max(bound.deadline, trio.current_time() + timeout_s)

        def mark_answered() -> None:
            nonlocal answered
            answered = True

        with trio.move_on_after(timeout_s) as bound:
            try:
                return (
                    await self._transport.get_worker_status(
                        flight.worker.status_target,
                        flight.state.latest_finished_version,
                        background=flight.kind is not ProbeKind.ON_DEMAND,
                        on_sent=mark_sent,
                        sent_timeout_s=timeout_s,  # grpc's own deadline moves with ``bound``
                        on_answered=mark_answered,
                    ),
                    "",
                    "",
                )
            except NotSent:
                return _Unjudged.NOT_SENT
            except TransportError as exc:
                return None, exc.kind, exc.detail
        if not sent:
            return _Unjudged.NOT_SENT
        if answered:
            return _Unjudged.ANSWERED_LATE
        return None, PROBE_TIMEOUT_KIND, f"no answer within probe_timeout_s ({self._config.probe_timeout_s} s)"

    # --- applying outcomes (the owner) -------------------------------------------------------

    def _landed(self, landed: _Landed) -> None:
        flight = landed.flight
        if flight.done:
            return  # given up on at a stop
        flight.done = True
        self._flights.discard(flight)
        self._pending_probes -= 1
        if flight.kind is ProbeKind.REFRESH:
            self._refresh_inflight -= 1
        elif flight.kind is ProbeKind.HEALTH:
            self._health_inflight -= 1
        if flight.kind is not ProbeKind.ON_DEMAND and self._health_left > 0:
            self._next_health = landed.at  # the health pass was cut short, and a background slot is free again
        if flight.state.flight is flight:
            flight.state.flight = None  # the next request starts a new probe
        self._peak_inflight = max(self._peak_inflight, landed.inflight)
        if landed.call_s is not None:
            flight.state.call_s = landed.call_s
        if landed.no_budget:
            self._give_back_tokens(flight, landed.at)
            result = self._outcome_skipped(flight, SkipReason.NO_BUDGET)
        elif landed.status is not None:
            result = self._record_status(flight, landed.status, landed.at, landed.sent_at)
        elif landed.answered_late:
            flight.state.checked_at = landed.at  # it answered: reachable
            result = self._outcome_skipped(flight, SkipReason.DEADLINE)
        else:
            result = self._record_failure(flight, landed.error_kind, landed.error_detail, landed.at)
        self._finish(flight, result)

    def _outcome_skipped(self, flight: _Flight, reason: SkipReason) -> ProbeResult:
        # A waiter that read its results at its deadline has had this worker counted skipped already.
        self._skipped[reason] += sum(flight.worker not in handle._reported for handle in flight.waiters)
        return ProbeResult(flight.worker, ProbeOutcome.SKIPPED, skip_reason=reason)

    def _record_status(self, flight: _Flight, status: WorkerStatus, now: float, sent_at: float) -> ProbeResult:
        state = flight.state
        state.checked_at = now  # it answered: reachable, whatever the answer
        if status.status_version == 0:
            self._probes_no_status += 1
            return ProbeResult(flight.worker, ProbeOutcome.NO_STATUS)
        state.status = status
        state.status_at = now
        state.status_sent_at = sent_at
        state.status_background = flight.kind is not ProbeKind.ON_DEMAND
        state.latest_finished_version = status.latest_finished_version
        state.consecutive_failures = 0
        state.unreachable = False
        if self._workers.get(flight.worker) is state:
            self._failing.discard(flight.worker)
        self._changed(flight.worker, state)
        self._probes_ok += 1
        for listener in self._status_listeners:
            listener(flight.worker, status)
        return ProbeResult(flight.worker, ProbeOutcome.OK, status, observed_at=now, sent_at=sent_at)

    def _record_failure(self, flight: _Flight, kind: str, detail: str, now: float) -> ProbeResult:
        state = flight.state
        state.consecutive_failures += 1
        state.checked_at = now
        state.last_error = kind
        state.last_error_detail = detail[:_DETAIL_CHARS]
        state.unreachable = kind == Unavailable.kind
        self._failed_by_kind[kind] = self._failed_by_kind.get(kind, 0) + 1
        worker = flight.worker
        if state.consecutive_failures >= self._config.eject_after_failures and self._workers.get(worker) is state:
            was_collective = self._collective()
            self._failing.add(worker)
            if self._collective():
                if not was_collective:
                    self._collective_failures += 1
                self._end_ejections(now)
            else:
                self._eject(worker, state, now)
        self._changed(worker, state)
        return ProbeResult(worker, ProbeOutcome.FAILED, error_kind=kind)

    def _end_ejections(self, now: float) -> None:
        """A collective failure: the ejections in force were its first signs, not outliers. End
        them now and give their count back; each worker stays unroutable until a good probe."""
        for worker in self._ejected:
            state = self._workers[worker]
            state.ejected_until = now
            state.times_ejected = max(0, state.times_ejected - 1)
            self._changed(worker, state)
        self._ejected.clear()
        self._dirty = True

    def _eject(self, worker: WorkerAddr, state: _WorkerState, now: float) -> None:
        self._prune_ejections(now)
        if not ejection_allowed(len(self._ejected), len(self._workers), self._config.max_ejected_fraction):
            return  # over the cap: keeps failing, stays unusable (cached() is None), and retries ejection
        healthy_for = now - state.ejected_until if state.times_ejected else 0.0
        n = decayed_ejection_count(state.times_ejected, healthy_for, self._config.eject_base_s) + 1
        state.times_ejected = n
        state.ejected_until = now + ejection_duration_s(n, self._config.eject_base_s, self._config.eject_max_s)
        self._ejected[worker] = state.ejected_until
        self._dirty = True

    def _prune_ejections(self, now: float) -> None:
        for worker in [w for w, until in self._ejected.items() if until <= now]:
            del self._ejected[worker]
            self._dirty = True

    def _finish(self, flight: _Flight, result: ProbeResult) -> None:
        for handle in flight.waiters:
            handle._deliver(result)
        flight.waiters.clear()
