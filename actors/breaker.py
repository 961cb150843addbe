"""KVCM circuit breaker: a pure state machine. Time is passed in; nothing here does I/O.

Its owners are the LeaderResolver (KVCM) and the master source, each changing it only in its own
task and passing ``trio.current_time()``; callers act on the :class:`BreakerView` the owner
publishes, and ask the owner only for a trial. The *caller* decides what is a failure: only
transport failures (unreachable, reset), deadline expiries (including a call cut off by the
request's deadline) and error codes (a gRPC status, a KVCM error code, a garbled reply) are recorded
as failures. Business outcomes — "no positive match", an empty host list — are answers
from a healthy KVCM and are recorded as successes.

Transitions:
- CLOSED → OPEN: ``failure_threshold`` consecutive failures, or a failure rate
  >= ``failure_rate`` over the sliding window (``window_s``, at least ``window_min_calls``).
  With ``overlapping_failures_count_once`` (the KVCM breaker's default), consecutive means one
  after another in time: a failure counts towards the run only if its call went out after the last
  failure counted. Calls in flight together fail together when one spell slows the peer (or this
  process), and that spell is one failure, not one per call; the window's rate still counts every
  call.
- OPEN → HALF_OPEN: the first ``admit`` once the cooldown has passed; it gets the TRIAL.
  The cooldown is ``cooldown_s × 2^reopens`` (``reopens`` counts failed trials since the
  breaker last closed), capped at ``cooldown_max_s``.
- HALF_OPEN admits exactly one trial at a time; everyone else is rejected.
  Trial success → CLOSED (counts and cooldown reset). Trial failure → OPEN, longer cooldown.
  A trial that ends without a verdict (the request was cancelled before the call went
  out) must call ``release_trial``; a trial never reported within ``trial_timeout_s``
  counts as failed, so the breaker cannot stay HALF_OPEN forever.

Outcomes of calls admitted in an earlier state are ignored once the state has moved on:
a non-trial result arriving while OPEN or HALF_OPEN (admitted before the trip) and a trial
result when no trial is outstanding change nothing.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from router.config import BreakerConfig
from router.policy.deadline_split import RecentQuantile
from router.problems import Problem, range_problems, refuse

# How long a healthy peer takes to answer: this quantile of the last calls it answered. A tail (not
# the median), so that a request given as long as its slower answers is still not judged for one.
ANSWERED_WINDOW = 64
ANSWERED_QUANTILE = 0.9


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Admission(enum.Enum):
    ALLOW = "allow"  # CLOSED: call KVCM, then record the outcome with trial=False
    TRIAL = "trial"  # the one half-open trial: call, then record with trial=True (or release_trial)
    REJECT = "reject"  # do not call KVCM: fall back now


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    state: BreakerState
    consecutive_failures: int
    window_calls: int  # outcomes in the sliding window (CLOSED only; cleared on every transition)
    window_failures: int
    reopens: int  # failed trials since the breaker last closed
    open_until: float | None  # OPEN: the earliest time a trial is admitted
    trial_started_at: float | None  # HALF_OPEN: when the outstanding trial was admitted
    opened_total: int
    closed_total: int
    rejected_total: int
    trial_timeouts_total: int


@dataclass(frozen=True, slots=True)
class BreakerView:
    """The part of the breaker a caller may act on without asking its owner, published by the owner
    after every change: a CLOSED breaker admits, an OPEN one in its cooldown and a HALF_OPEN one
    whose trial is out reject. Anything else is the trial, which only the owner may hand out."""

    state: BreakerState
    open_until: float
    trial_started_at: float | None
    trial_timeout_s: float

    def admits(self, now: float) -> Admission | None:
        """ALLOW or REJECT when the view decides alone; None when the owner must (a trial may be due)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return Admission.ALLOW
        if state is BreakerState.OPEN:
            return Admission.REJECT if now < self.open_until else None
        started = self.trial_started_at
        if started is not None and now - started < self.trial_timeout_s:
            return Admission.REJECT
        return None


def breaker_problems(config: BreakerConfig) -> list[Problem]:
    """Every reason the breaker cannot work with ``config`` (empty when it can)."""
    problems = range_problems(config)
    if config.cooldown_s > config.cooldown_max_s:
        problems.append(
            Problem(
                ("cooldown_s", "cooldown_max_s"), f"{config.cooldown_s} is above the maximum {config.cooldown_max_s}"
            )
        )
    return problems


class _Window:
    """Call and failure counts over the last ``window_s``, in a fixed ring of time buckets.

    Bucket i covers [i × width, (i + 1) × width); the window is the current bucket and the
    ones before it, so it spans between (n - 1) × width and n × width of history.
    """

    __slots__ = ("_calls", "_epochs", "_failures", "_n", "_width")

    def __init__(self, window_s: float, buckets: int) -> None:
        self._n = buckets
        self._width = window_s / buckets
        self._epochs = [-1] * buckets  # which bucket number each slot currently holds
        self._calls = [0] * buckets
        self._failures = [0] * buckets

    def add(self, now: float, failed: bool) -> None:
        epoch = math.floor(now / self._width)
        slot = epoch % self._n
        if self._epochs[slot] != epoch:
            self._epochs[slot] = epoch
            self._calls[slot] = 0
            self._failures[slot] = 0
        self._calls[slot] += 1
        if failed:
            self._failures[slot] += 1

    def totals(self, now: float) -> tuple[int, int]:
        """(calls, failures) in the window ending at ``now``."""
        epoch = math.floor(now / self._width)
        calls = failures = 0
        for slot in range(self._n):
            if 0 <= epoch - self._epochs[slot] < self._n:
                calls += self._calls[slot]
                failures += self._failures[slot]
        return calls, failures

    def clear(self) -> None:
        # The counts go too: an epoch of -1 is still inside the window while the clock is below
        # (n - 1) × width, so stale counts left behind would be summed again.
        self._epochs = [-1] * self._n
        self._calls = [0] * self._n
        self._failures = [0] * self._n


class KvcmBreaker:
    """The breaker's state. Every method is synchronous and takes the time it needs."""

    def __init__(self, config: BreakerConfig, *, section: str = "breaker") -> None:
        """``section``: the configuration section ``config`` is, named in a refusal."""
        refuse(section, breaker_problems(config))
        self._config = config
        self._state = BreakerState.CLOSED
        self._consecutive_failures = 0
        self._last_counted_at = -math.inf  # when the last failure counted towards the run was recorded
        self._window = _Window(config.window_s, config.window_buckets)
        self._reopens = 0
        self._open_until = 0.0
        self._trial_started_at: float | None = None
        self._opened_total = 0
        self._closed_total = 0
        self._rejected_total = 0
        self._trial_timeouts_total = 0
        self._changes = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def changes(self) -> int:
        """Counts every change of what :meth:`view` shows (its owner republishes when it moves)."""
        return self._changes

    def view(self) -> BreakerView:
        """What callers may decide alone until the next change (see :class:`BreakerView`)."""
        return BreakerView(self._state, self._open_until, self._trial_started_at, self._config.trial_timeout_s)

    def admit(self, now: float) -> Admission:
        """May a KVCM call go out at ``now``? TRIAL moves OPEN → HALF_OPEN and takes the one trial slot."""
        if self._state is BreakerState.CLOSED:
            return Admission.ALLOW
        if self._state is BreakerState.HALF_OPEN and self._trial_started_at is not None:
            if now - self._trial_started_at < self._config.trial_timeout_s:
                self._rejected_total += 1
                return Admission.REJECT
            # The trial was never reported back: count it as failed rather than stay half-open forever.
            self._trial_timeouts_total += 1
            self._reopen(now)
        if self._state is BreakerState.OPEN and now < self._open_until:
            self._rejected_total += 1
            return Admission.REJECT
        self._state = BreakerState.HALF_OPEN
        self._trial_started_at = now
        self._changes += 1
        return Admission.TRIAL

    def record_success(self, now: float, trial: bool) -> None:
        """KVCM answered (whatever the answer said)."""
        if trial:
            if self._trial_outstanding():
                self._close()
        elif self._state is BreakerState.CLOSED:
            self._consecutive_failures = 0
            self._last_counted_at = -math.inf
            self._window.add(now, failed=False)

    def record_failure(self, now: float, trial: bool, *, started_at: float) -> None:
        """A transport failure, a deadline expiry or an error code, of a call that went out at
        ``started_at``."""
        if trial:
            if self._trial_outstanding():
                self._reopen(now)
        elif self._state is BreakerState.CLOSED:
            # Counted unless it was in flight when the last counted one failed (and that is one spell).
            if not self._config.overlapping_failures_count_once or started_at >= self._last_counted_at:
                self._consecutive_failures += 1
                self._last_counted_at = now
            self._window.add(now, failed=True)
            if self._consecutive_failures >= self._config.failure_threshold or self._rate_tripped(now):
                self._open(now)

    def release_trial(self) -> None:
        """The trial ended without a verdict (cancelled before KVCM could answer): free the slot."""
        if self._trial_outstanding():
            self._trial_started_at = None
            self._changes += 1

    def snapshot(self, now: float) -> BreakerSnapshot:
        calls, failures = self._window.totals(now)
        return BreakerSnapshot(
            state=self._state,
            consecutive_failures=self._consecutive_failures,
            window_calls=calls,
            window_failures=failures,
            reopens=self._reopens,
            open_until=self._open_until if self._state is BreakerState.OPEN else None,
            trial_started_at=self._trial_started_at,
            opened_total=self._opened_total,
            closed_total=self._closed_total,
            rejected_total=self._rejected_total,
            trial_timeouts_total=self._trial_timeouts_total,
        )

    def _trial_outstanding(self) -> bool:
        return self._state is BreakerState.HALF_OPEN and self._trial_started_at is not None

    def _rate_tripped(self, now: float) -> bool:
        calls, failures = self._window.totals(now)
        return calls >= self._config.window_min_calls and failures >= self._config.failure_rate * calls

    def _cooldown_s(self) -> float:
        # The exponent is capped before the power so a long outage cannot overflow a float.
        exponent = min(self._reopens, 64)
        return min(self._config.cooldown_s * 2.0**exponent, self._config.cooldown_max_s)

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._open_until = now + self._cooldown_s()
        self._trial_started_at = None
        self._consecutive_failures = 0
        self._last_counted_at = -math.inf
        self._window.clear()
        self._opened_total += 1
        self._changes += 1

    def _reopen(self, now: float) -> None:
        self._reopens += 1
        self._open(now)

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        self._trial_started_at = None
        self._reopens = 0
        self._consecutive_failures = 0
        self._last_counted_at = -math.inf
        self._window.clear()
        self._closed_total += 1
        self._changes += 1


class AnsweredWithin:
    """How long the calls a peer answered recently took (``ANSWERED_QUANTILE`` of the last
    ``ANSWERED_WINDOW``; 0.0 before the first), kept by the task that owns the breaker. A call the
    request's budget cut in less than that says nothing of the peer's health: judged, requests with
    budgets shorter than a healthy answer opened the breaker for the requests with room for it."""

    __slots__ = ("_recent",)

    def __init__(self) -> None:
        self._recent = RecentQuantile(ANSWERED_WINDOW, ANSWERED_QUANTILE)

    @property
    def samples(self) -> int:
        return self._recent.samples

    @property
    def within_s(self) -> float:
        return self._recent.high  # an index into the window's ordered samples: callers read it as they judge

    def observe(self, took_s: float) -> None:
        """One answered call's duration (from the owning task)."""
        self._recent.observe(took_s)

    def pass_over(self) -> None:
        """A call spared judging, with no answer (from the owning task): it takes a place in the window,
        so a peer that stops answering while only tight budgets reach it has its answers age out, and
        its cuts are judged again once the window holds none."""
        self._recent.pass_over()

    def spares(self, given_s: float, slow_query_s: float) -> bool:
        """Whether a call cut by its request's budget after ``given_s`` is spared judging: less than
        ``slow_query_s`` (the configured floor), or than the peer's answers recently took."""
        return given_s < max(slow_query_s, self.within_s)
