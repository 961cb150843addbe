"""LeaderResolver actor: the single owner of KVCM control state — the leader cache and the breaker.

Request path (never queues, never waits beyond the caller's own deadline):
- ``leader()`` returns the cached leader at once. With no usable leader it fails fast
  (no RPC, no await) while lookups are failing (backing off), while the cluster reports
  "no leader elected", or when there is no bootstrap target. Otherwise (first lookup at
  start-up, or after an invalidation) it joins the one in-flight lookup and waits on its
  Event inside the caller's cancel scope: there is no lock to queue behind, and a caller
  that gives up does not cancel the lookup for the others.
- ``admit()`` / ``record_kvcm()`` / ``record_leader_miss()`` / ``release_kvcm_trial()`` drive
  the KVCM breaker; a leader a request waited for and did not get is a KVCM failure.
- ``report_failure()`` invalidates the leader after SERVER_NOT_LEADER, UNAVAILABLE or
  DEADLINE_EXCEEDED from a query and wakes the background task (bounded inbox, send_nowait).

Background (``run``): the only task that performs lookups, so refresh is single-flight by
construction. It refreshes the leader ``refresh_interval_s`` after the last success (so in
steady state no request waits), retries failures after a tenacity backoff with jitter, and
retries "no leader" after ``no_leader_retry_s``. A lookup calls GetClusterInfo on all
bootstrap targets concurrently; the first valid leader wins and the other calls are
cancelled; the round is bounded by ``lookup_timeout_s``. A failed refresh keeps the previous
leader for up to ``max_staleness_s`` after it was last confirmed.

State is mutated only by this actor's synchronous, non-awaiting methods and by ``run``
between awaits; trio is cooperative, so each of those is atomic. All policy time is
``trio.current_time()``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import tenacity
import trio

from actors.breaker import Admission, BreakerSnapshot, KvcmBreaker
from actors.metrics_sink import KvcmRequest, MetricsSink
from router.config import BreakerConfig, LeaderConfig
from router.problems import Problem, range_problems, refuse
from router.transport.errors import DeadlineExceeded, NotLeader, TransportError, Unavailable
from router.transport.ports import KvcmTransport
from router.types import LeaderEndpoint

# Query errors that mean "the cached leader may be wrong": look it up again.
_INVALIDATING_ERRORS = (NotLeader, Unavailable, DeadlineExceeded)


class LeaderState(enum.Enum):
    UNKNOWN = "unknown"  # never resolved, nothing in flight
    RESOLVING = "resolving"  # a lookup is in flight and requests wait for it
    LEADER = "leader"  # a usable leader is cached
    NO_LEADER = "no_leader"  # the cluster answered: no leader elected yet
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
    last_error: str | None
    last_error_at: float | None
    last_lookup_s: float | None  # duration of the last lookup round
    lookups_total: int
    lookups_by_trigger: Mapping[str, int]  # by Trigger value
    lookup_rpcs_total: int
    leader_changes_total: int
    invalidations_total: int
    queries_cut_short_total: int  # queries and leader waits cut off by a tight request budget: not judged
    leader_misses_total: int  # requests that waited for a leader and found none: breaker failures
    fast_failures_total: int  # leader() calls answered LeaderUnavailable without waiting
    wakes_coalesced_total: int  # wake-ups merged into one already pending
    breaker: BreakerSnapshot


@dataclass(frozen=True, slots=True)
class _LookupResult:
    leader: LeaderEndpoint | None
    no_leader: bool  # some node answered "no leader elected" and none named a leader
    error: str | None  # why no leader was found, when it is a failure
    rpcs: int


class _Round:
    """What the concurrent GetClusterInfo calls of one lookup found (written by its tasks)."""

    __slots__ = ("errors", "leader", "no_leader_from")

    def __init__(self) -> None:
        self.leader: LeaderEndpoint | None = None
        self.no_leader_from: list[str] = []
        self.errors: dict[str, str] = {}


class Trigger(enum.Enum):
    """Why a lookup ran (snapshot label)."""

    SCHEDULED = "scheduled"  # start-up, refresh before expiry, retry after backoff or "no leader"
    REQUEST = "request"  # a caller needed a leader and none was cached
    INVALIDATED = "invalidated"  # a query said the cached leader is wrong


class _Attempt:
    """One single-flight lookup: callers wait on ``done``; ``result`` is set before it fires."""

    __slots__ = ("done", "result", "trigger")

    def __init__(self, trigger: Trigger) -> None:
        self.trigger = trigger
        self.done = trio.Event()
        self.result: _LookupResult | None = None


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
    return problems


class LeaderResolver:
    def __init__(
        self,
        config: LeaderConfig,
        breaker_config: BreakerConfig,
        transport: KvcmTransport,
        bootstrap: Callable[[], tuple[str, ...]],
        *,
        instance_id: str,
        metrics: MetricsSink | None = None,
    ) -> None:
        """``bootstrap`` returns the current KVCM targets (Discovery.kvcm_bootstrap); ``instance_id`` is the
        deployment's KVCM namespace (DeploymentConfig.kvcm_instance_id), sent in GetClusterInfo;
        ``metrics`` receives one KvcmRequest("GetClusterInfo", outcome) per call made."""
        refuse("leader", leader_problems(config))
        self._config = config
        self._metrics = metrics
        self._instance_id = instance_id
        self._transport = transport
        self._bootstrap = bootstrap
        self._breaker = KvcmBreaker(breaker_config)
        self._breaker_config = breaker_config
        # tenacity computes the delay; we only feed it the attempt number (its own clock is unused).
        self._backoff = tenacity.wait_exponential_jitter(
            multiplier=config.backoff_initial_s, max=config.backoff_max_s, jitter=config.backoff_jitter_s
        )
        self._retry_state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        # The inbox: wake-ups for run(), which then reads the attempt to perform. Capacity 1: a
        # wake-up carries no data, so a second one while one is pending is merged (and counted).
        self._wake_send, self._wake_receive = trio.open_memory_channel[None](1)

        self._leader: LeaderEndpoint | None = None
        self._confirmed_at = 0.0  # trio time the cached leader was last confirmed
        self._consecutive_failures = 0
        self._no_leader = False
        self._next_attempt_at: float | None = None
        self._attempt: _Attempt | None = None
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._last_lookup_s: float | None = None
        self._lookups_total = 0
        self._lookups_by_trigger = dict.fromkeys((t.value for t in Trigger), 0)
        self._lookup_rpcs_total = 0
        self._leader_changes_total = 0
        self._invalidations_total = 0
        self._cut_short_total = 0
        self._leader_misses_total = 0
        self._fast_failures_total = 0
        self._wakes_coalesced_total = 0

    # --- request path ------------------------------------------------------------------

    def cached_leader(self) -> LeaderEndpoint | None:
        """The leader if :meth:`leader` would return it at once (known and not too stale), else None."""
        cached = self._leader
        if cached is not None and self._usable(trio.current_time()):
            return cached
        return None

    async def leader(self) -> LeaderEndpoint:
        """The KVCM leader, or ``LeaderUnavailable``. Waits only within the caller's cancel scope."""
        cached = self.cached_leader()
        if cached is not None:
            return cached
        if not self._bootstrap():
            raise self._fail_fast(UnavailableReason.NO_BOOTSTRAP, "no KVCM bootstrap target is known")
        if self._consecutive_failures > 0:
            raise self._fail_fast(UnavailableReason.BACKING_OFF, self._last_error or "lookups failing")
        if self._no_leader:
            raise self._fail_fast(UnavailableReason.NO_LEADER, "the KVCM cluster has no leader elected")
        attempt = self._ensure_attempt(Trigger.REQUEST)
        await attempt.done.wait()
        result = attempt.result
        assert result is not None  # set before done fires
        if result.leader is not None:
            return result.leader
        if result.no_leader:
            raise LeaderUnavailable(
                UnavailableReason.NO_LEADER,
                "the KVCM cluster has no leader elected",
                self._next_attempt_at,
                waited=True,
            )
        raise LeaderUnavailable(
            UnavailableReason.FAILED, result.error or "lookup failed", self._next_attempt_at, waited=True
        )

    def report_failure(self, target: str, error: TransportError) -> None:
        """A query to ``target`` failed: NotLeader / Unavailable / DeadlineExceeded invalidate that leader.

        Reports about a target that is no longer the cached leader are stale and ignored.
        Never blocks: the lookup runs in the background task.
        """
        if not isinstance(error, _INVALIDATING_ERRORS):
            return
        cached = self._leader
        if cached is None or cached.target != target:
            return
        self._leader = None
        self._invalidations_total += 1
        if self._consecutive_failures == 0:
            self._ensure_attempt(Trigger.INVALIDATED)
        # While backing off, run() retries at the scheduled time; requests fail fast until then.

    def admit(self) -> Admission:
        """May this request call KVCM? REJECT costs nothing: fall back at once."""
        return self._breaker.admit(trio.current_time())

    def record_kvcm(self, error: TransportError | None, *, trial: bool, given_s: float) -> bool:
        """Record a KVCM call admitted by ``admit``: None for any decoded answer, else its error.

        The caller decides: a business outcome ("no positive match") is None; a transport
        failure, an error code or a deadline expiry (also a call cut off by the request's
        deadline while waiting for KVCM) is the error. ``given_s`` is how long the call was
        allowed. A deadline expiry with less than ``slow_query_ms`` allowed is not judged (a
        trial slot is released): returns False, and the caller should not blame the leader.
        """
        now = trio.current_time()
        if error is None:
            self._breaker.record_success(now, trial)
        elif isinstance(error, DeadlineExceeded) and given_s * 1000.0 < self._breaker_config.slow_query_ms:
            self._cut_short_total += 1
            if trial:
                self._breaker.release_trial()
            return False
        else:
            self._breaker.record_failure(now, trial)
        return True

    def record_leader_miss(self, failure: LeaderUnavailable | None, *, trial: bool, given_s: float) -> bool:
        """Record a request admitted by ``admit`` that found no leader: ``failure`` is what
        :meth:`leader` raised, None when the request's own deadline ended the wait.

        A leader that cannot be found is a KVCM failure for the breaker, so a KVCM that does not
        answer opens it and later requests stop waiting for lookups: a lookup the caller waited
        for that found none, or a wait the request's deadline ended after at least
        ``slow_query_ms`` (``given_s`` is how long the wait was allowed). Not judged (the trial
        slot is released): a fast failure, which cost the request nothing (backing off, no
        bootstrap target), and a wait cut short by a tight budget. Returns whether it judged.
        """
        now = trio.current_time()
        if failure is None and given_s * 1000.0 < self._breaker_config.slow_query_ms:
            self._cut_short_total += 1
        elif failure is None or failure.waited:
            self._leader_misses_total += 1
            self._breaker.record_failure(now, trial)
            return True
        if trial:
            self._breaker.release_trial()
        return False

    def release_kvcm_trial(self) -> None:
        """The admitted trial never reached KVCM (the request was cancelled first): free the slot."""
        self._breaker.release_trial()

    def snapshot(self) -> LeaderSnapshot:
        now = trio.current_time()
        usable = self._leader if self._leader is not None and self._usable(now) else None
        return LeaderSnapshot(
            state=self._state(now),
            leader_target=usable.target if usable is not None else None,
            leader_node_id=usable.node_id if usable is not None else None,
            age_s=now - self._confirmed_at if usable is not None else None,
            consecutive_failures=self._consecutive_failures,
            next_attempt_at=self._next_due(now) if self._attempt is None else None,
            last_error=self._last_error,
            last_error_at=self._last_error_at,
            last_lookup_s=self._last_lookup_s,
            lookups_total=self._lookups_total,
            lookups_by_trigger=MappingProxyType(dict(self._lookups_by_trigger)),
            lookup_rpcs_total=self._lookup_rpcs_total,
            leader_changes_total=self._leader_changes_total,
            invalidations_total=self._invalidations_total,
            queries_cut_short_total=self._cut_short_total,
            leader_misses_total=self._leader_misses_total,
            fast_failures_total=self._fast_failures_total,
            wakes_coalesced_total=self._wakes_coalesced_total,
            breaker=self._breaker.snapshot(now),
        )

    # --- background ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Perform every lookup: the first at once, then refreshes and retries when due, or when woken."""
        task_status.started()
        while True:
            attempt = self._attempt
            if attempt is None:
                with trio.move_on_at(self._next_due(trio.current_time())):
                    await self._wake_receive.receive()
                attempt = self._attempt
                if attempt is None:
                    now = trio.current_time()  # read once: two reads on a real clock always differ
                    if now < self._next_due(now):
                        continue  # a wake-up whose lookup already ran
                    attempt = self._attempt = _Attempt(Trigger.SCHEDULED)
            await self._perform(attempt)

    async def _perform(self, attempt: _Attempt) -> None:
        started = trio.current_time()
        result = _LookupResult(None, False, "resolver stopped during the lookup", 0)
        try:
            result = await self._lookup(self._bootstrap())
        finally:
            # Also on cancellation (shutdown): waiters get an answer instead of waiting out their deadline.
            now = trio.current_time()
            self._last_lookup_s = now - started
            self._apply(result, now)
            self._lookups_by_trigger[attempt.trigger.value] += 1
            attempt.result = result
            self._attempt = None
            attempt.done.set()

    async def _lookup(self, targets: tuple[str, ...]) -> _LookupResult:
        """One round: GetClusterInfo on every bootstrap target at once; the first valid leader wins."""
        if not targets:
            return _LookupResult(None, False, "no KVCM bootstrap target is known", 0)
        found = _Round()
        with trio.move_on_after(self._config.lookup_timeout_s):
            async with trio.open_nursery() as nursery:
                for target in targets:
                    nursery.start_soon(self._ask, target, found, nursery.cancel_scope)
        if found.leader is not None:
            return _LookupResult(found.leader, False, None, len(targets))
        if found.no_leader_from:
            return _LookupResult(None, True, None, len(targets))
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
            if self._leader is None or self._leader.target != result.leader.target:
                self._leader_changes_total += 1
            self._leader = result.leader
            self._confirmed_at = now
            self._consecutive_failures = 0
            self._no_leader = False
            self._next_attempt_at = None
        elif result.no_leader:
            # Not a failure: an election is in progress. Retry soon, without backoff.
            self._leader = None
            self._consecutive_failures = 0
            self._no_leader = True
            self._next_attempt_at = now + self._config.no_leader_retry_s
        else:
            self._consecutive_failures += 1
            self._no_leader = False
            self._last_error = result.error
            self._last_error_at = now
            self._retry_state.attempt_number = self._consecutive_failures
            self._next_attempt_at = now + self._backoff(self._retry_state)

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
        if self._consecutive_failures > 0:
            return LeaderState.BACKING_OFF
        if self._attempt is not None:
            return LeaderState.RESOLVING
        return LeaderState.UNKNOWN

    def _ensure_attempt(self, trigger: Trigger) -> _Attempt:
        attempt = self._attempt
        if attempt is None:
            attempt = self._attempt = _Attempt(trigger)
            try:
                self._wake_send.send_nowait(None)
            except trio.WouldBlock:
                self._wakes_coalesced_total += 1  # run() is already due to wake and will see the attempt
        return attempt

    def _fail_fast(self, reason: UnavailableReason, detail: str) -> LeaderUnavailable:
        self._fast_failures_total += 1
        return LeaderUnavailable(reason, detail, self._next_attempt_at)
