"""LeaderResolver actor: the single owner of KVCM control state — the leader cache and the breaker.

All of that state is changed by one task, ``run``; requests never write it. They read the
immutable :class:`_View` the task publishes after every change, and send it what they learnt:

Snapshot reads (no hop, never wait):
- ``cached_leader()`` and the common case of ``leader()``: the published leader while it is not
  older than ``max_staleness_s``; the fast failures (backing off, "no leader elected", no bootstrap
  target) also come from the view.
- ``admit()`` while the breaker is CLOSED (ALLOW), or OPEN in its cooldown / HALF_OPEN with its
  trial out (REJECT): the published :class:`BreakerView` decides.

Request/reply through the bounded inbox, waited for only within the caller's cancel scope:
- ``leader()`` with no usable leader: the task answers at once from newer state, or adds the caller
  to the waiters of the one lookup (starting it if none runs); a caller that gives up does not
  cancel the lookup for the others.
- ``admit()`` when a trial may be due: only the task hands out the breaker's one trial.

Reports (``send_nowait``; dropped and counted when the inbox is full):
- ``record_kvcm()`` / ``record_leader_miss()`` / ``release_kvcm_trial()``: breaker outcomes (the
  caller works out whether the outcome is judged, from ``given_s``, and gets that answer at once);
  a leader a request waited for and did not get is a KVCM failure.
- ``report_failure()``: SERVER_NOT_LEADER, UNAVAILABLE or DEADLINE_EXCEEDED from a query
  invalidates that leader and starts a lookup.

A report reaches the task at its next step, so a request running in the same scheduling round as
a failure may still be admitted by the view that failure is about to change (its outcome is then
ignored by the breaker, which has moved on).

Lookups (``run``'s child task; only ``run`` starts one, so refresh is single-flight by
construction): the first at once, then a refresh ``refresh_interval_s`` after the last success (so
in steady state no request waits), failures retried after a tenacity backoff with jitter, "no
leader" and "no bootstrap target" (not failures) after ``no_leader_retry_s``. A lookup calls
GetClusterInfo on all bootstrap targets concurrently; the first valid leader wins and the other
calls are cancelled; the round is bounded by ``lookup_timeout_s``; its result comes back through
the inbox. A leader invalidated in the last ``invalidated_suspect_s`` is suspect: a replica naming
it (other than itself) does not win at once; the round takes it only if no other replica names
another leader or "no leader" before it ends. A failed refresh keeps the previous leader for up to
``max_staleness_s`` after it was last confirmed. All policy time is ``trio.current_time()``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

import tenacity
import trio

from actors.breaker import ANSWERED_WINDOW, Admission, AnsweredWithin, BreakerSnapshot, BreakerView, KvcmBreaker
from actors.inbox import Alarm, Ask, ask
from actors.metrics_sink import KvcmRequest, LeaderChanged, MetricsSink
from router.config import BreakerConfig, LeaderConfig
from router.problems import Problem, range_problems, refuse
from router.transport.errors import DeadlineExceeded, NotLeader, TransportError, Unavailable
from router.transport.ports import KvcmTransport
from router.types import ClusterInfo, LeaderEndpoint

# Query errors that mean "the cached leader may be wrong": look it up again.
_INVALIDATING_ERRORS = (NotLeader, Unavailable, DeadlineExceeded)

# Suspect leaders remembered at once: a cluster has a handful of nodes, so more means leadership
# moving faster than the suspicion lasts; the oldest is forgotten first.
_SUSPECTS_MAX = 8


class LeaderState(enum.Enum):
    UNKNOWN = "unknown"  # never resolved, nothing in flight
    RESOLVING = "resolving"  # a lookup is in flight and requests wait for it
    LEADER = "leader"  # a usable leader is cached
    NO_LEADER = "no_leader"  # the cluster answered: no leader elected yet
    NO_BOOTSTRAP = "no_bootstrap"  # the last lookup had no KVCM target to ask; looked for again soon
    BACKING_OFF = "backing_off"  # lookups are failing; requests fail fast until one succeeds


class UnavailableReason(enum.Enum):
    BACKING_OFF = "backing_off"
    NO_LEADER = "no_leader"
    NO_BOOTSTRAP = "no_bootstrap"
    FAILED = "failed"  # the lookup this caller waited for failed


class LeaderUnavailable(Exception):
    """No usable KVCM leader; ``reason`` says why (its value doubles as a metric label)."""

    def __init__(
        self, reason: UnavailableReason, detail: str, retry_at: float | None = None, *, waited: bool = False
    ) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.retry_at = retry_at  # trio time of the next lookup, when one is scheduled
        self.waited = waited  # the caller waited for a lookup that found no leader (not a fast failure)


@dataclass(frozen=True, slots=True)
class LeaderSnapshot:
    """Health of the resolver, for the debug endpoint and metrics."""

    state: LeaderState
    leader_target: str | None  # a usable leader only
    leader_node_id: str | None
    age_s: float | None  # since the leader was last confirmed
    consecutive_failures: int
    next_attempt_at: float | None  # trio time of the next scheduled lookup (None: a request starts it)
    last_error: str | None  # the last lookup's failure
    last_error_at: float | None
    # The last judged failure of a cache query to the leader (its peer and what it said: a wrong
    # instance id, say, which the lookups never see).
    last_query_error: str | None
    last_query_error_at: float | None
    last_lookup_s: float | None  # duration of the last lookup round
    lookups_total: int
    lookups_by_trigger: Mapping[str, int]  # by Trigger value
    lookup_rpcs_total: int
    leader_changes_total: int
    invalidations_total: int
    queries_cut_short_total: int  # queries and leader waits cut off by a tight request budget: not judged
    # How long KVCM's answered queries took, the recent high quantile (None before the first): a query a
    # request's budget cut in less is not judged.
    answered_within_s: float | None
    leader_misses_total: int  # requests that waited for a leader and found none: breaker failures
    fast_failures_total: int  # leader() calls answered LeaderUnavailable without waiting
    reports_dropped_total: int  # outcomes and invalidations the full inbox refused
    inbox_depth: int
    inbox_capacity: int
    breaker: BreakerSnapshot


@dataclass(frozen=True, slots=True)
class _LookupResult:
    leader: LeaderEndpoint | None
    no_leader: bool  # some node answered "no leader elected" and none named a leader
    error: str | None  # why no leader was found
    rpcs: int
    no_bootstrap: bool = False  # discovery knew no KVCM target: nobody was asked, and nothing failed


class _Round:
    """What the concurrent GetClusterInfo calls of one lookup found (written by its tasks)."""

    __slots__ = ("errors", "leader", "no_leader_from", "suspect", "suspects")

    def __init__(self, suspects: frozenset[str]) -> None:
        self.suspects = suspects  # targets of leaders recently invalidated
        self.leader: LeaderEndpoint | None = None
        self.suspect: LeaderEndpoint | None = None  # the first suspect named: the round's answer if nothing else comes
        self.no_leader_from: list[str] = []
        self.errors: dict[str, str] = {}


class Trigger(enum.Enum):
    """Why a lookup ran (snapshot label)."""

    SCHEDULED = "scheduled"  # start-up, refresh before expiry, retry after backoff or "no leader"
    REQUEST = "request"  # a caller needed a leader and none was cached
    INVALIDATED = "invalidated"  # a query said the cached leader is wrong


def leader_problems(config: LeaderConfig) -> list[Problem]:
    """Every reason the resolver cannot work with ``config`` (empty when it can)."""
    problems = range_problems(config)
    if config.backoff_initial_s > config.backoff_max_s:
        problems.append(
            Problem(
                ("backoff_initial_s", "backoff_max_s"),
                f"{config.backoff_initial_s} is above the maximum {config.backoff_max_s}",
            )
        )
    if config.max_staleness_s < config.refresh_interval_s:
        # A leader must stay usable until its next refresh, or requests would look it up themselves.
        problems.append(
            Problem(
                ("max_staleness_s", "refresh_interval_s"),
                f"a leader is usable for {config.max_staleness_s} s, less than the {config.refresh_interval_s} s "
                "between refreshes: requests would wait for lookups",
            )
        )
    return problems


@dataclass(frozen=True, slots=True)
class _View:
    """What requests read without a hop; replaced by ``run`` after every change it makes."""

    leader: LeaderEndpoint | None
    usable_until: float  # trio time after which ``leader`` is too stale to use
    breaker: BreakerView
    backing_off: bool  # lookups are failing: requests fail fast until one succeeds
    no_leader: bool  # the cluster answered: no leader elected
    last_error: str | None
    next_attempt_at: float | None


class _Verdict(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    NOT_JUDGED = "not_judged"  # releases a trial slot, judges nothing


@dataclass(frozen=True, slots=True)
class _Outcome:
    """A request's breaker outcome (report)."""

    verdict: _Verdict
    trial: bool
    cut_short: bool = False  # a query or leader wait a tight budget cut off
    leader_miss: bool = False  # a request that waited for a leader and found none
    started_at: float = -math.inf  # a failure: when its call (or leader wait) began
    error: str | None = None  # a failed query: what failed
    took_s: float | None = None  # an answered query: how long it took (one in ANSWERED_SAMPLE_EVERY)


_SUCCESS = _Outcome(_Verdict.SUCCESS, trial=False)  # the common report, made once
_TRIAL_SUCCESS = _Outcome(_Verdict.SUCCESS, trial=True)
# After the first ANSWERED_WINDOW, one answered query in this many carries its duration to
# AnsweredWithin (whose window then spans the last 512 answers); the others are the report made once.
ANSWERED_SAMPLE_EVERY = 8


@dataclass(frozen=True, slots=True)
class _Invalidate:
    """A query to ``target`` failed in a way that makes it suspect as the leader (report)."""

    target: str


class _AskTrial(Ask[Admission]):
    """May this request be the breaker's trial? (request/reply)"""


class _AskLeader(Ask["LeaderEndpoint | LeaderUnavailable"]):
    """No usable leader in the view: answer from newer state, or after the next lookup (request/reply)."""


@dataclass(frozen=True, slots=True)
class _LookupDone:
    """What the lookup child task found (never dropped: it waits for room)."""

    trigger: Trigger
    started: float
    result: _LookupResult


class _Due:
    """The alarm: a scheduled lookup may be due."""


_DUE = _Due()

_Message = _Outcome | _Invalidate | _AskTrial | _AskLeader | _LookupDone | _Due


class LeaderResolver:
    def __init__(
        self,
        config: LeaderConfig,
        breaker_config: BreakerConfig,
        transport: KvcmTransport,
        bootstrap: Callable[[], tuple[str, ...]],
        *,
        instance_id: str,
        inbox_size: int,
        metrics: MetricsSink | None = None,
    ) -> None:
        """``bootstrap`` returns the current KVCM targets (Discovery.kvcm_bootstrap); ``instance_id`` is the
        deployment's KVCM namespace (DeploymentConfig.kvcm_instance_id), sent in GetClusterInfo;
        ``inbox_size`` bounds the messages waiting for ``run`` (beyond it reports are dropped and
        counted, asks wait for room); ``metrics`` receives one KvcmRequest("GetClusterInfo", outcome)
        per call made."""
        refuse("leader", leader_problems(config))
        if inbox_size < 1:
            raise ValueError(f"inbox_size: must be >= 1, got {inbox_size}")
        self._config = config
        self._metrics = metrics
        self._instance_id = instance_id
        self._transport = transport
        self._bootstrap = bootstrap
        self._breaker = KvcmBreaker(breaker_config)
        self._slow_query_s = breaker_config.slow_query_ms / 1000.0
        # tenacity computes the delay; we only feed it the attempt number (its own clock is unused).
        self._backoff = tenacity.wait_exponential_jitter(
            multiplier=config.backoff_initial_s, max=config.backoff_max_s, jitter=config.backoff_jitter_s
        )
        self._retry_state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        self._send, self._receive = trio.open_memory_channel[_Message](inbox_size)
        self._inbox_size = inbox_size

        # Owned by run():
        self._leader: LeaderEndpoint | None = None
        self._confirmed_at = 0.0  # trio time the cached leader was last confirmed
        self._consecutive_failures = 0
        self._no_leader = False
        self._no_bootstrap = False  # the last lookup had no target to ask
        self._next_attempt_at: float | None = None
        self._lookup: Trigger | None = None  # the trigger of the lookup in flight
        # The result of the lookup in flight once its round ended (set by its child task as it queues
        # it): a run() stopped with it still queued applies it in its finally, and the queued copy is
        # then skipped by the restarted run(), not applied a second time.
        self._lookup_done: _LookupDone | None = None
        # A leader invalidated while a lookup was in flight: that lookup asked replicas before the
        # failure and may name it again, so its answer must not bring it back.
        self._invalidated_in_flight: str | None = None
        # Targets of leaders invalidated recently, with the trio time each stops being suspect (in the
        # order they were invalidated): a replica that has not yet seen the leader go still names it.
        self._suspects: dict[str, float] = {}
        self._waiters: list[_AskLeader] = []  # callers waiting for the lookup in flight
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._last_query_error: str | None = None
        self._last_query_error_at: float | None = None
        self._last_lookup_s: float | None = None
        self._lookups_total = 0
        self._lookups_by_trigger = dict.fromkeys((t.value for t in Trigger), 0)
        self._lookup_rpcs_total = 0
        self._leader_changes_total = 0
        self._last_found: str | None = None  # the target of the last leader a lookup found
        self._invalidations_total = 0
        self._cut_short_total = 0
        # How long KVCM's answered queries took: written here, read by callers (record_kvcm).
        self._answered = AnsweredWithin()
        self._leader_misses_total = 0
        self._changed = False  # something the view shows changed since it was published
        self._published_breaker_changes = -1
        self._view = self._publish()

        self._answers_seen = 0  # answered queries reported, by callers: which carries its duration
        # Kept by callers themselves (counts only; nothing reads them to decide):
        self._fast_failures_total = 0
        self._view_rejections_total = 0  # admit() rejected by the view, without a hop
        self._reports_dropped_total = 0

    # --- request path ------------------------------------------------------------------

    def cached_leader(self) -> LeaderEndpoint | None:
        """The leader if :meth:`leader` would return it at once (known and not too stale), else None."""
        view = self._view
        if view.leader is not None and trio.current_time() <= view.usable_until:
            return view.leader
        return None

    async def leader(self) -> LeaderEndpoint:
        """The KVCM leader, or ``LeaderUnavailable``. Waits only within the caller's cancel scope."""
        cached = self.cached_leader()
        if cached is not None:
            return cached
        view = self._view
        if not self._bootstrap():
            raise self._fail_fast(UnavailableReason.NO_BOOTSTRAP, "no KVCM bootstrap target is known")
        if view.backing_off:
            raise self._fail_fast(UnavailableReason.BACKING_OFF, view.last_error or "lookups failing")
        if view.no_leader:
            raise self._fail_fast(UnavailableReason.NO_LEADER, "the KVCM cluster has no leader elected")
        reply = await ask(self._send, _AskLeader())
        if isinstance(reply, LeaderUnavailable):
            if not reply.waited:
                self._fast_failures_total += 1
            raise reply
        return reply

    async def admit(self, until: float = math.inf) -> Admission:
        """May this request call KVCM? REJECT costs nothing: fall back at once. Only a possible trial
        asks ``run``, waiting at most until ``until`` (then REJECT); a trial whose caller left is
        released."""
        admission = self._view.breaker.admits(trio.current_time())
        if admission is Admission.REJECT:
            self._view_rejections_total += 1
        if admission is not None:
            return admission
        with trio.move_on_at(until):
            return await ask(self._send, _AskTrial(), self._release_unclaimed)
        return Admission.REJECT

    def report_failure(self, target: str, error: TransportError) -> None:
        """A query to ``target`` failed: NotLeader / Unavailable / DeadlineExceeded invalidate that leader.

        Reports about a target that is no longer the cached leader are stale and ignored.
        Never blocks: ``run`` applies it and starts the lookup.
        """
        if not isinstance(error, _INVALIDATING_ERRORS):
            return
        cached = self._view.leader
        if cached is not None and cached.target == target:
            self._report(_Invalidate(target))

    def record_kvcm(
        self, error: TransportError | None, *, trial: bool, given_s: float, started_at: float
    ) -> bool:
        """Record a KVCM call admitted by ``admit``: None for any decoded answer, else its error.

        The caller decides: a business outcome ("no positive match") is None; a transport
        failure, an error code or a deadline expiry (also a call cut off by the request's
        deadline while waiting for KVCM) is the error. ``given_s`` is how long the call was
        allowed, ``started_at`` when it went out. A deadline expiry with less allowed than
        ``slow_query_ms``, or than KVCM's answered queries recently took (``AnsweredWithin``),
        is not judged (a trial slot is released): returns False, and the caller should not blame
        the leader. A request whose budget is shorter than a healthy KVCM's answer says nothing of
        KVCM's health: judged, such requests opened the breaker and invalidated the leader over and
        over for the requests with room for the answer.
        """
        if error is None:
            self._answers_seen += 1
            if self._answers_seen > ANSWERED_WINDOW and self._answers_seen % ANSWERED_SAMPLE_EVERY:
                self._report(_TRIAL_SUCCESS if trial else _SUCCESS)
            else:
                self._report(_Outcome(_Verdict.SUCCESS, trial, took_s=trio.current_time() - started_at))
        elif isinstance(error, DeadlineExceeded) and self._answered.spares(given_s, self._slow_query_s):
            self._report(_Outcome(_Verdict.NOT_JUDGED, trial, cut_short=True))
            return False
        else:
            self._report(_Outcome(_Verdict.FAILURE, trial, started_at=started_at, error=str(error)))
        return True

    def record_leader_miss(
        self, failure: LeaderUnavailable | None, *, trial: bool, given_s: float, started_at: float
    ) -> bool:
        """Record a request admitted by ``admit`` that found no leader: ``failure`` is what
        :meth:`leader` raised, None when the request's own deadline ended the wait.

        A leader that cannot be found is a KVCM failure for the breaker, so a KVCM that does not
        answer opens it and later requests stop waiting for lookups: a lookup the caller waited
        for that found none, or a wait the request's deadline ended after at least
        ``slow_query_ms`` (``given_s`` is how long the wait was allowed). Not judged (the trial
        slot is released): a fast failure, which cost the request nothing (backing off, no
        bootstrap target), and a wait cut short by a tight budget. Returns whether it judged.
        """
        if failure is None and given_s < self._slow_query_s:
            self._report(_Outcome(_Verdict.NOT_JUDGED, trial, cut_short=True))
            return False
        if failure is None or failure.waited:
            self._report(_Outcome(_Verdict.FAILURE, trial, leader_miss=True, started_at=started_at))
            return True
        if trial:
            self._report(_Outcome(_Verdict.NOT_JUDGED, trial))
        return False

    def release_kvcm_trial(self) -> None:
        """The admitted trial never reached KVCM (the request was cancelled first): free the slot."""
        self._report(_Outcome(_Verdict.NOT_JUDGED, True))

    def snapshot(self) -> LeaderSnapshot:
        """A copy of the task's state for /debug/actors, gauges and readiness (never the request path)."""
        now = trio.current_time()
        usable = self._leader if self._leader is not None and self._usable(now) else None
        breaker = self._breaker.snapshot(now)
        return LeaderSnapshot(
            state=self._state(now),
            leader_target=usable.target if usable is not None else None,
            leader_node_id=usable.node_id if usable is not None else None,
            age_s=now - self._confirmed_at if usable is not None else None,
            consecutive_failures=self._consecutive_failures,
            next_attempt_at=self._next_due(now) if self._lookup is None else None,
            last_error=self._last_error,
            last_error_at=self._last_error_at,
            last_query_error=self._last_query_error,
            last_query_error_at=self._last_query_error_at,
            last_lookup_s=self._last_lookup_s,
            lookups_total=self._lookups_total,
            lookups_by_trigger=MappingProxyType(dict(self._lookups_by_trigger)),
            lookup_rpcs_total=self._lookup_rpcs_total,
            leader_changes_total=self._leader_changes_total,
            invalidations_total=self._invalidations_total,
            queries_cut_short_total=self._cut_short_total,
            answered_within_s=self._answered.within_s if self._answered.samples else None,
            leader_misses_total=self._leader_misses_total,
            fast_failures_total=self._fast_failures_total,
            reports_dropped_total=self._reports_dropped_total,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._inbox_size,
            breaker=replace(breaker, rejected_total=breaker.rejected_total + self._view_rejections_total),
        )

    def _report(self, message: _Outcome | _Invalidate) -> None:
        try:
            self._send.send_nowait(message)
        except trio.WouldBlock:
            self._reports_dropped_total += 1

    def _release_unclaimed(self, admission: Admission) -> None:
        if admission is Admission.TRIAL:
            self.release_kvcm_trial()

    def _fail_fast(self, reason: UnavailableReason, detail: str) -> LeaderUnavailable:
        self._fast_failures_total += 1
        return LeaderUnavailable(reason, detail, self._view.next_attempt_at)

    # --- the owner's task ------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the state: apply what the inbox brings, a batch at a time, publish the view after a batch
        that changed it, and start each lookup (at once, when due, or when asked) in a child task."""
        receive = self._receive
        alarm = Alarm(self._send, _DUE)
        try:
            async with trio.open_nursery() as children:
                await children.start(alarm.run)
                alarm.set(self._next_due(trio.current_time()))
                task_status.started()
                while True:
                    message = await receive.receive()
                    while True:
                        self._handle(message, children)
                        try:
                            message = receive.receive_nowait()
                        except trio.WouldBlock:
                            break
                    self._end_batch(alarm)
        finally:
            # Stopped or crashed: a lookup in flight is cancelled with the nursery; its waiters get an
            # answer now instead of waiting out their deadlines, and a restarted run() starts afresh.
            # A result already queued (a crash in the middle of the batch that would have applied it)
            # is the lookup's answer: its waiters get it, and it is applied here, once.
            if self._lookup is not None:
                now = trio.current_time()
                done = self._lookup_done
                if done is None or self._stale(done):
                    rpcs = 0 if done is None else done.result.rpcs
                    result = _LookupResult(None, False, "resolver stopped during the lookup", rpcs)
                    done = _LookupDone(self._lookup, now, result)
                self._finish(done, now)
                self._view = self._publish()

    def _end_batch(self, alarm: Alarm) -> None:
        if self._breaker.changes != self._published_breaker_changes:
            self._changed = True
        if self._changed:
            self._changed = False
            self._view = self._publish()
        alarm.set(math.inf if self._lookup is not None else self._next_due(trio.current_time()))

    def _handle(self, message: _Message, lookups: trio.Nursery) -> None:
        if isinstance(message, _Outcome):
            self._apply_outcome(message)
        elif message is _DUE:
            now = trio.current_time()
            if self._lookup is None and now >= self._next_due(now):
                self._start_lookup(Trigger.SCHEDULED, lookups)
        elif isinstance(message, _AskLeader):
            if not message.abandoned:
                self._want_leader(message, lookups)
        elif isinstance(message, _AskTrial):
            if not message.abandoned:
                message.answer(self._breaker.admit(trio.current_time()))
        elif isinstance(message, _Invalidate):
            self._invalidate(message.target, lookups)
        elif isinstance(message, _LookupDone):
            if message is not self._lookup_done:
                return  # already applied by the finally of the run() that stopped with it queued
            if self._stale(message):
                # Stale: the replicas it asked had not yet seen the failure. Ask again; the waiters
                # join the new lookup. (Counted as a lookup made, not applied.)
                self._lookups_total += 1
                self._lookup_rpcs_total += message.result.rpcs
                self._lookups_by_trigger[message.trigger.value] += 1
                self._lookup = None
                self._invalidated_in_flight = None
                self._start_lookup(Trigger.INVALIDATED, lookups)
            else:
                self._finish(message, trio.current_time())

    def _apply_outcome(self, outcome: _Outcome) -> None:
        if outcome.verdict is _Verdict.SUCCESS:
            self._breaker.record_success(trio.current_time(), outcome.trial)
            if outcome.took_s is not None:
                self._answered.observe(outcome.took_s)  # published as it changes: a float callers read
        elif outcome.verdict is _Verdict.FAILURE:
            if outcome.leader_miss:
                self._leader_misses_total += 1
            if outcome.error is not None:
                self._last_query_error, self._last_query_error_at = outcome.error, trio.current_time()
            self._breaker.record_failure(trio.current_time(), outcome.trial, started_at=outcome.started_at)
        else:
            if outcome.cut_short:
                self._cut_short_total += 1
                if self._cut_short_total % ANSWERED_SAMPLE_EVERY == 0:  # as the answers are sampled
                    self._answered.pass_over()
            if outcome.trial:
                self._breaker.release_trial()

    def _want_leader(self, message: _AskLeader, lookups: trio.Nursery) -> None:
        # Answers from state or joins the lookup: changes nothing the view shows.
        now = trio.current_time()
        if self._leader is not None and self._usable(now):
            message.answer(self._leader)
        elif not self._bootstrap():
            message.answer(self._unavailable(UnavailableReason.NO_BOOTSTRAP, "no KVCM bootstrap target is known"))
        elif self._consecutive_failures > 0:
            message.answer(self._unavailable(UnavailableReason.BACKING_OFF, self._last_error or "lookups failing"))
        elif self._no_leader:
            message.answer(self._unavailable(UnavailableReason.NO_LEADER, "the KVCM cluster has no leader elected"))
        else:
            self._waiters.append(message)
            if self._lookup is None:
                self._start_lookup(Trigger.REQUEST, lookups)

    def _invalidate(self, target: str, lookups: trio.Nursery) -> None:
        cached = self._leader
        if cached is None or cached.target != target:
            return  # stale: about a leader already replaced or dropped
        self._leader = None
        self._invalidations_total += 1
        self._changed = True
        self._suspect(target, trio.current_time())
        if self._lookup is not None:
            self._invalidated_in_flight = target
        elif self._consecutive_failures == 0:
            self._start_lookup(Trigger.INVALIDATED, lookups)
        # While backing off, the lookup runs at the scheduled time; requests fail fast until then.

    def _stale(self, done: _LookupDone) -> bool:
        """The lookup names the leader invalidated while it was in flight."""
        leader = done.result.leader
        return leader is not None and leader.target == self._invalidated_in_flight

    def _start_lookup(self, trigger: Trigger, lookups: trio.Nursery) -> None:
        self._lookup = trigger
        self._lookup_done = None
        now = trio.current_time()
        lookups.start_soon(self._lookup_task, trigger, now, self._current_suspects(now))

    async def _lookup_task(self, trigger: Trigger, started: float, suspects: frozenset[str]) -> None:
        result = await self._lookup_round(self._bootstrap(), suspects)
        self._lookup_done = done = _LookupDone(trigger, started, result)
        await self._send.send(done)

    def _finish(self, done: _LookupDone, now: float) -> None:
        self._lookup_done = None
        self._invalidated_in_flight = None
        self._last_lookup_s = now - done.started
        self._apply(done.result, now)
        self._lookups_by_trigger[done.trigger.value] += 1
        self._lookup = None
        self._changed = True
        result = done.result
        for waiter in self._waiters:
            if result.leader is not None:
                waiter.answer(result.leader)
            elif result.no_bootstrap:
                # Discovery lost the targets between this caller's check and the lookup's own read:
                # nobody was asked, so it is the fast failure a caller a moment earlier got (not waited,
                # so not judged as a KVCM failure).
                waiter.answer(self._unavailable(UnavailableReason.NO_BOOTSTRAP, "no KVCM bootstrap target is known"))
            elif result.no_leader:
                waiter.answer(
                    LeaderUnavailable(
                        UnavailableReason.NO_LEADER,
                        "the KVCM cluster has no leader elected",
                        self._next_attempt_at,
                        waited=True,
                    )
                )
            else:
                waiter.answer(
                    LeaderUnavailable(
                        UnavailableReason.FAILED, result.error or "lookup failed", self._next_attempt_at, waited=True
                    )
                )
        self._waiters.clear()

    def _unavailable(self, reason: UnavailableReason, detail: str) -> LeaderUnavailable:
        return LeaderUnavailable(reason, detail, self._next_attempt_at)

    def _publish(self) -> _View:
        self._published_breaker_changes = self._breaker.changes
        leader = self._leader
        return _View(
            leader=leader,
            usable_until=self._confirmed_at + self._config.max_staleness_s if leader is not None else -math.inf,
            breaker=self._breaker.view(),
            backing_off=self._consecutive_failures > 0,
            no_leader=self._no_leader,
            last_error=self._last_error,
            next_attempt_at=self._next_attempt_at,
        )

    # --- lookups (the child task) and state (run only) ---------------------------------------

    async def _lookup_round(self, targets: tuple[str, ...], suspects: frozenset[str]) -> _LookupResult:
        """One round: GetClusterInfo on every bootstrap target at once; the first valid leader wins,
        unless it is one of ``suspects`` named by another node: then the round goes on, and takes it
        only if no other answer names a leader or "no leader" before every call ends or times out."""
        if not targets:
            return _LookupResult(None, False, "no KVCM bootstrap target is known", 0, no_bootstrap=True)
        found = _Round(suspects)
        with trio.move_on_after(self._config.lookup_timeout_s):
            async with trio.open_nursery() as nursery:
                for target in targets:
                    nursery.start_soon(self._ask, target, found, nursery.cancel_scope)
        if found.leader is not None:
            return _LookupResult(found.leader, False, None, len(targets))
        if found.no_leader_from:
            return _LookupResult(None, True, None, len(targets))
        if found.suspect is not None:
            return _LookupResult(found.suspect, False, None, len(targets))
        unanswered = [t for t in targets if t not in found.errors]
        parts = [f"{t}: {why}" for t, why in found.errors.items()]
        parts += [f"{t}: no answer within {self._config.lookup_timeout_s}s" for t in unanswered]
        return _LookupResult(None, False, "; ".join(parts), len(targets))

    async def _ask(self, target: str, found: _Round, round_scope: trio.CancelScope) -> None:
        try:
            info = await self._transport.get_cluster_info(target, self._instance_id)
        except TransportError as exc:
            found.errors[target] = f"{exc.kind}: {exc.detail}"
            self._count(exc.kind)
            return
        except trio.Cancelled:
            self._count("cancelled")  # another target answered first, or the round timed out
            raise
        self._count("ok" if info.leader is not None else "no_leader")
        if info.leader is None:
            found.no_leader_from.append(target)
        elif info.leader.target in found.suspects and not _names_itself(info):
            # Maybe a replica that has not yet seen this leader go: the others may know better.
            if found.suspect is None:
                found.suspect = info.leader
        elif found.leader is None:
            found.leader = info.leader
            round_scope.cancel()  # first valid leader wins; the other calls are cancelled

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.emit(KvcmRequest("GetClusterInfo", outcome))

    # --- state (synchronous, atomic) ---------------------------------------------------------

    def _apply(self, result: _LookupResult, now: float) -> None:
        self._lookups_total += 1
        self._lookup_rpcs_total += result.rpcs
        if result.leader is not None:
            # Against the last leader found, not the one held: an invalidated leader found again is
            # no change.
            if result.leader.target != self._last_found:
                self._last_found = result.leader.target
                self._leader_changes_total += 1
                if self._metrics is not None:
                    self._metrics.emit(LeaderChanged(result.leader.target))
            self._leader = result.leader
            self._confirmed_at = now
            self._consecutive_failures = 0
            self._no_leader = False
            self._no_bootstrap = False
            self._next_attempt_at = None
        elif result.no_leader:
            # Not a failure: an election is in progress. Retry soon, without backoff.
            self._leader = None
            self._consecutive_failures = 0
            self._no_leader = True
            self._no_bootstrap = False
            self._next_attempt_at = now + self._config.no_leader_retry_s
        elif result.no_bootstrap:
            # Not a KVCM failure either: discovery has found no target yet. Looked for as soon as
            # "no leader" is, so targets that appear are used then, not after a backoff grown meanwhile.
            self._consecutive_failures = 0
            self._no_leader = False
            self._no_bootstrap = True
            self._next_attempt_at = now + self._config.no_leader_retry_s
        else:
            self._consecutive_failures += 1
            self._no_leader = False
            self._no_bootstrap = False
            self._last_error = result.error
            self._last_error_at = now
            self._retry_state.attempt_number = self._consecutive_failures
            self._next_attempt_at = now + self._backoff(self._retry_state)

    def _suspect(self, target: str, now: float) -> None:
        self._current_suspects(now)
        suspects = self._suspects
        suspects.pop(target, None)
        if len(suspects) >= _SUSPECTS_MAX:
            del suspects[next(iter(suspects))]  # the oldest: every entry lasts as long, so the first in expires first
        suspects[target] = now + self._config.invalidated_suspect_s

    def _current_suspects(self, now: float) -> frozenset[str]:
        """The targets still suspect at ``now`` (the expired ones are forgotten)."""
        self._suspects = {target: until for target, until in self._suspects.items() if until > now}
        return frozenset(self._suspects)

    def _usable(self, now: float) -> bool:
        return now - self._confirmed_at <= self._config.max_staleness_s

    def _next_due(self, now: float) -> float:
        """When run() should start the next lookup by itself."""
        if self._next_attempt_at is not None:
            return self._next_attempt_at
        if self._leader is not None:
            return self._confirmed_at + self._config.refresh_interval_s
        return now  # never resolved, or invalidated: at once

    def _state(self, now: float) -> LeaderState:
        if self._leader is not None and self._usable(now):
            return LeaderState.LEADER
        if self._no_leader:
            return LeaderState.NO_LEADER
        if self._no_bootstrap:
            return LeaderState.NO_BOOTSTRAP
        if self._consecutive_failures > 0:
            return LeaderState.BACKING_OFF
        if self._lookup is not None:
            return LeaderState.RESOLVING
        return LeaderState.UNKNOWN


def _names_itself(info: ClusterInfo) -> bool:
    """The answering node says it is the leader: its own word, not a relay of what it last heard."""
    return info.leader is not None and bool(info.self_node_id) and info.self_node_id == info.leader.node_id
