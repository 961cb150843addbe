"""WorkerProber: worker statuses for requests, under one global probe budget.

A request calls ``probe(workers, deadline)``, which returns at once a
``ProbeHandle`` holding the fresh cached statuses and receiving every other
result as it completes; the request waits on it under its own cancel scope and
decides with what it has (an "anytime" decision).

Design (review-lessons §4, §12; wire-contract §2, §3):

- **State and tasks.** The prober has no inbox: ``probe``, ``cached``,
  ``is_routable``, ``retain`` and ``snapshot`` are synchronous, non-awaiting
  methods, so under trio each is atomic; probe tasks touch the state only in
  synchronous sections between their awaits. Probe tasks run in the prober's
  own nursery (started by ``run``), never in a request's, so a request that
  leaves does not cancel a probe others wait for.
- **Budget, acquired within the request's deadline.** A probe first reserves a
  token from the rate bucket: if the token would be ready only after the
  deadline, the probe is skipped at once (``no_budget``); otherwise it sleeps
  until the token (one ``sleep_until``) and then takes an in-flight slot
  (``trio.CapacityLimiter``, FIFO), both under a cancel scope whose deadline is
  the latest deadline among the requests waiting for that worker. If that
  passes first, the token is refunded and the probe is skipped
  (``no_budget``): nothing waits for budget past its requesters' deadlines.
- **A started RPC is bounded by ``probe_timeout_s`` only**, not by the waiting
  requests' deadlines: a slow or black-holed worker must still accrue failures
  (and be ejected) when every request's budget is shorter than the probe
  timeout, and a late answer refreshes the cache for the next request. It holds
  its in-flight slot at most ``probe_timeout_s``.
- **Coalescing.** At most one probe per worker is pending; a request for a worker
  with a pending probe joins it (extending the budget deadline to its own if
  later) and gets the same result; its own deadline bounds only its own wait.
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
  and readmitted by its first good probe instead of staying out for
  ``eject_base_s`` after the cause has gone.
- **Usable status** (``cached``): the last valid status, younger than
  ``max_status_age_s`` (older = unknown for scoring), the worker not ejected and
  its last probe not failed (any RPC error marks the worker not usable until a
  valid status, as in the reference scheduler). **Routable** (``is_routable``):
  not known to be unreachable, i.e. not ejected and its last probe was not
  refused (``unavailable``: a closed port, a reset). A worker never probed is
  routable: nothing says it is down; nor is one whose status probe was slow
  (``probe_timeout``) or garbled, which is unusable for scoring but may well
  serve, until repeated failures eject it.
- **Background health probes** (with a ``fleet`` and ``health_interval_s`` > 0):
  every interval the next ``health_max_probes`` discovered workers not heard
  from for an interval are probed, taking only the rate tokens already in the
  bucket, so routability is known in domain routing too and never costs a
  request a probe.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field

import trio

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
from router.transport.errors import TransportError, Unavailable
from router.transport.ports import WorkerStatusTransport
from router.types import Role, WorkerAddr, WorkerStatus

_NEVER = float("-inf")
PROBE_TIMEOUT_KIND = "probe_timeout"  # failure kind when a started RPC outlives probe_timeout_s


class ProbeOutcome(enum.Enum):
    OK = "ok"  # a valid status (fresh from the cache, or just probed)
    NO_STATUS = "no_status"  # the worker answered with status_version 0
    FAILED = "failed"  # transport error or no answer within probe_timeout_s; see error_kind
    SKIPPED = "skipped"  # no probe was made for this request; see skip_reason


class SkipReason(enum.Enum):
    """Values double as metric labels (``kvroute_probe_skipped_total{reason}``)."""

    NO_BUDGET = "no_budget"  # no token or in-flight slot before the deadline
    EJECTED = "ejected"
    DEADLINE = "deadline"  # the deadline had passed, or came while the RPC was in flight
    STOPPED = "stopped"  # the prober is not running (e.g. being restarted)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    worker: WorkerAddr
    outcome: ProbeOutcome
    status: WorkerStatus | None = None  # set exactly when outcome is OK
    from_cache: bool = False  # OK without an RPC for this request
    observed_at: float | None = None  # trio time the status was received
    error_kind: str | None = None  # TransportError.kind or PROBE_TIMEOUT_KIND, when FAILED
    skip_reason: SkipReason | None = None  # when SKIPPED

    def age_s(self, now: float) -> float | None:
        return None if self.observed_at is None else now - self.observed_at


class _Phase(enum.Enum):
    BUDGET = "budget"  # waiting for a token or an in-flight slot
    RPC = "rpc"


@dataclass(eq=False, slots=True)
class _WorkerState:
    status: WorkerStatus | None = None  # last valid status (status_version != 0)
    status_at: float = _NEVER
    latest_finished_version: int = -1  # echoed on the next probe
    checked_at: float = _NEVER  # the last probe's end: an answer or a failure
    last_error: str = ""  # the last failure's kind
    unreachable: bool = False  # the last probe was refused: known unreachable until a good probe
    consecutive_failures: int = 0
    times_ejected: int = 0
    ejected_until: float = _NEVER
    flight: _Flight | None = None


@dataclass(eq=False, slots=True)
class _Flight:
    """One pending probe of one worker, shared by every request waiting for it."""

    worker: WorkerAddr
    state: _WorkerState
    token_at: float
    budget_scope: trio.CancelScope  # deadline = the latest deadline among waiters
    waiters: list[ProbeHandle] = field(default_factory=list)
    phase: _Phase = _Phase.BUDGET


class ProbeHandle:
    """One request's probes: results in hand now, the rest arriving as they complete.

    Wait under your own cancel scope (``async for result in handle`` or
    ``await handle.wait_all()``), then read ``results()``. Waiting never extends
    the request's deadline; nothing is queued for the request past it.
    """

    def __init__(self, workers: tuple[WorkerAddr, ...], deadline: float) -> None:
        self.workers = workers
        self.deadline = deadline
        self._delivered: dict[WorkerAddr, ProbeResult] = {}
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
        skipped: ``no_budget`` if it is waiting for budget, ``deadline`` if its RPC is in flight."""
        out: list[ProbeResult] = []
        for worker in self.workers:
            result = self._delivered.get(worker)
            if result is None:
                flight = self._flights[worker]
                reason = SkipReason.NO_BUDGET if flight.phase is _Phase.BUDGET else SkipReason.DEADLINE
                result = ProbeResult(worker, ProbeOutcome.SKIPPED, skip_reason=reason)
            out.append(result)
        return tuple(out)

    def statuses(self) -> dict[WorkerAddr, WorkerStatus]:
        """The valid statuses in hand now (fresh cache hits and probes answered so far)."""
        return {w: r.status for w, r in self._delivered.items() if r.status is not None}

    def _attach(self, flight: _Flight) -> None:
        self._flights[flight.worker] = flight
        flight.waiters.append(self)

    def _deliver(self, result: ProbeResult) -> None:
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
    probes_started: int  # probes this prober started (each makes at most one RPC)
    coalesced: int  # lookups that joined a pending probe
    cache_hit_ratio: float  # cache_hits / (cache_hits + cache_misses)
    probes_ok: int
    probes_failed: int
    probes_no_status: int  # replies with status_version 0 (ignored)
    failed_by_kind: dict[str, int]
    skipped: dict[str, int]  # per requested worker, by SkipReason value
    ejected_until: dict[str, float]  # status target → trio time the ejection ends
    failing: int  # tracked workers with eject_after_failures or more consecutive failures
    collective_failure: bool  # more failing than may be ejected: nobody is ejected now
    collective_failures: int  # collective failures seen (each ended the ejections in force)
    health_probes: int  # background health probes started


class WorkerProber:
    """Probes worker statuses for requests under one global budget (see the module docstring)."""

    def __init__(
        self,
        config: ProberConfig,
        transport: WorkerStatusTransport,
        *,
        fleet: Callable[[], Sequence[WorkerAddr]] | None = None,
    ) -> None:
        """``fleet`` returns the discovered workers (the background health probes' subjects)."""
        refuse("prober", prober_problems(config))
        self._config = config
        self._transport = transport
        self._fleet = fleet
        self._limiter = trio.CapacityLimiter(config.inflight_cap)
        # Created full: its first refill, at whatever trio time, tops it up to the burst.
        self._bucket = TokenBucket(config.rate_per_s, config.rate_burst, now=float("-inf"))
        self._nursery: trio.Nursery | None = None
        self._workers: OrderedDict[WorkerAddr, _WorkerState] = OrderedDict()  # LRU, bounded
        self._ejected: dict[WorkerAddr, float] = {}  # tracked workers only → ejection end
        self._failing: set[WorkerAddr] = set()  # tracked workers at eject_after_failures or more
        self._collective_failures = 0
        self._health_probes = 0
        self._health_cursor = 0
        self._pending_probes = 0
        self._peak_inflight = 0
        self._cache_hits = 0
        self._probes_started = 0
        self._coalesced = 0
        self._probes_ok = 0
        self._status_listeners: list[Callable[[WorkerAddr, WorkerStatus], None]] = []
        self._probes_no_status = 0
        self._failed_by_kind: dict[str, int] = {}
        self._skipped: dict[SkipReason, int] = dict.fromkeys(SkipReason, 0)

    async def run(self, *, task_status: trio.TaskStatus[WorkerProber] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the probe tasks' nursery until cancelled. The cache and ejections survive a restart."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self)
                if self._fleet is not None and self._config.health_interval_s > 0:
                    await self._health_loop(self._fleet, self._config.health_interval_s)
                await trio.sleep_forever()
        finally:
            self._nursery = None

    # --- request path (synchronous: atomic under trio) ------------------------------------

    def probe(self, workers: Sequence[WorkerAddr], deadline: float) -> ProbeHandle:
        """Start (or join) probes for ``workers``; return at once.

        ``deadline`` is an absolute trio time: budget is acquired only before it
        (pass the time by which a result is still useful to the decision).
        Duplicates in ``workers`` are probed once.
        """
        now = trio.current_time()
        handle = ProbeHandle(tuple(dict.fromkeys(workers)), deadline)
        for worker in handle.workers:
            result = self._lookup(worker, handle, now)
            if result is not None:
                handle._deliver(result)
        return handle

    def cached(self, worker: WorkerAddr) -> WorkerStatus | None:
        """The worker's status if usable for scoring now (see the module docstring), else None."""
        observed = self.cached_observed(worker)
        return None if observed is None else observed[0]

    def cached_observed(self, worker: WorkerAddr) -> tuple[WorkerStatus, float] | None:
        """Like :meth:`cached`, with the trio time the status was received (for pre-charge clearing)."""
        state = self._workers.get(worker)
        if state is None or state.status is None or state.consecutive_failures:
            return None
        now = trio.current_time()
        if state.ejected_until > now or now - state.status_at >= self._config.max_status_age_s:
            return None
        return state.status, state.status_at

    def is_routable(self, worker: WorkerAddr, roles: Collection[Role] | None = None) -> bool:
        """Not known to be unreachable (not ejected, last probe not refused) and, with ``roles``,
        not known to serve another role. A worker never probed is routable."""
        return self._routable(self._workers.get(worker), roles, trio.current_time())

    def unroutable_reason(self, workers: Sequence[WorkerAddr], roles: Collection[Role]) -> str | None:
        """None when one of ``workers`` is routable for ``roles``; else why none is.

        Stops at the first routable worker, so it costs a full scan only when most are down.
        """
        now = trio.current_time()
        states = self._workers
        if any(self._routable(states.get(w), roles, now) for w in workers):
            return None
        ejected = failing = other_role = 0
        kinds: set[str] = set()
        for worker in workers:
            state = states.get(worker)
            if state is None:
                continue  # unreachable: a never-probed worker is routable
            if state.ejected_until > now:
                ejected += 1
            elif state.unreachable:
                failing += 1
            else:
                other_role += 1
                continue
            kinds.add(state.last_error)
        parts = []
        if ejected:
            parts.append(f"{ejected} ejected")
        if failing:
            parts.append(f"{failing} refusing probes")
        if other_role:
            parts.append(f"{other_role} reporting a role not routed")
        detail = ", ".join(parts) + (f"; last errors: {', '.join(sorted(kinds))}" if kinds else "")
        return f"no routable worker: none of the {len(workers)} discovered workers can be reached ({detail})"

    def ejected(self) -> Collection[WorkerAddr]:
        """The workers ejected now (a live read-only view, for the candidate plan to skip)."""
        self._prune_ejections(trio.current_time())
        return self._ejected.keys()

    def on_status(self, listener: Callable[[WorkerAddr, WorkerStatus], None]) -> None:
        """Call ``listener`` with every new valid status (synchronously: it must not block)."""
        self._status_listeners.append(listener)

    def retain(self, workers: Collection[WorkerAddr]) -> None:
        """Forget every worker not in ``workers`` (call on discovery changes)."""
        keep = workers if isinstance(workers, set | frozenset) else set(workers)
        for worker in [w for w in self._workers if w not in keep]:
            self._forget(worker)

    def snapshot(self) -> ProberHealth:
        now = trio.current_time()
        self._prune_ejections(now)
        misses = self._probes_started + self._coalesced
        lookups = self._cache_hits + misses
        inflight = self._limiter.borrowed_tokens
        return ProberHealth(
            running=self._nursery is not None,
            inflight=inflight,
            peak_inflight=self._peak_inflight,
            inflight_cap=self._config.inflight_cap,
            waiting_for_budget=self._pending_probes - inflight,
            budget_tokens=self._bucket.tokens(now),
            tracked_workers=len(self._workers),
            cache_hits=self._cache_hits,
            cache_misses=misses,
            probes_started=self._probes_started,
            coalesced=self._coalesced,
            cache_hit_ratio=self._cache_hits / lookups if lookups else 0.0,
            probes_ok=self._probes_ok,
            probes_failed=sum(self._failed_by_kind.values()),
            probes_no_status=self._probes_no_status,
            failed_by_kind=dict(self._failed_by_kind),
            skipped={reason.value: n for reason, n in self._skipped.items()},
            ejected_until={w.status_target: until for w, until in self._ejected.items()},
            failing=len(self._failing),
            collective_failure=self._collective(),
            collective_failures=self._collective_failures,
            health_probes=self._health_probes,
        )

    @staticmethod
    def _routable(state: _WorkerState | None, roles: Collection[Role] | None, now: float) -> bool:
        if state is None:
            return True
        if state.unreachable or state.ejected_until > now:
            return False
        return roles is None or state.status is None or state.status.role in roles

    def _collective(self) -> bool:
        return collective_failure(len(self._failing), len(self._workers), self._config.max_ejected_fraction)

    def _lookup(self, worker: WorkerAddr, handle: ProbeHandle, now: float) -> ProbeResult | None:
        """A result known now, or None after attaching ``handle`` to a (new or pending) probe."""
        state = self._touch(worker)
        if (
            state.status is not None
            and not state.consecutive_failures
            and now - state.status_at < self._config.fresh_ttl_s
        ):
            self._cache_hits += 1
            return ProbeResult(worker, ProbeOutcome.OK, state.status, from_cache=True, observed_at=state.status_at)
        if state.ejected_until > now:
            return self._skip(worker, SkipReason.EJECTED)
        flight = state.flight
        if flight is not None:
            self._coalesced += 1
            if flight.phase is _Phase.BUDGET and handle.deadline > flight.budget_scope.deadline:
                flight.budget_scope.deadline = handle.deadline
            handle._attach(flight)
            return None
        if self._nursery is None:
            return self._skip(worker, SkipReason.STOPPED)
        if handle.deadline <= now:
            return self._skip(worker, SkipReason.DEADLINE)
        if self._pending_probes >= self._config.max_tracked_workers:
            return self._skip(worker, SkipReason.NO_BUDGET)
        token_at = self._bucket.reserve(now, handle.deadline)
        if token_at is None:
            return self._skip(worker, SkipReason.NO_BUDGET)
        flight = _Flight(worker, state, token_at, trio.CancelScope(deadline=handle.deadline))
        state.flight = flight
        handle._attach(flight)
        self._probes_started += 1
        self._pending_probes += 1
        self._nursery.start_soon(self._fly, flight)
        return None

    def _skip(self, worker: WorkerAddr, reason: SkipReason) -> ProbeResult:
        self._skipped[reason] += 1
        return ProbeResult(worker, ProbeOutcome.SKIPPED, skip_reason=reason)

    def _touch(self, worker: WorkerAddr) -> _WorkerState:
        state = self._workers.get(worker)
        if state is None:
            state = self._workers[worker] = _WorkerState()
            while len(self._workers) > self._config.max_tracked_workers:
                self._forget(next(iter(self._workers)))
        else:
            self._workers.move_to_end(worker)
        return state

    def _forget(self, worker: WorkerAddr) -> None:
        # A pending probe of a forgotten worker still completes, updating only its orphaned state.
        del self._workers[worker]
        self._ejected.pop(worker, None)
        self._failing.discard(worker)

    # --- background health probes -------------------------------------------------------------

    async def _health_loop(self, fleet: Callable[[], Sequence[WorkerAddr]], interval_s: float) -> None:
        """One sweep per interval, for as long as the prober runs."""
        while True:
            self._health_sweep(fleet(), trio.current_time())
            await trio.sleep(interval_s)

    def _health_sweep(self, workers: Sequence[WorkerAddr], now: float) -> None:
        """Probe the next few workers not heard from for an interval (round robin over the fleet).

        Bounded whatever the fleet's size: it looks at most at ``8 × health_max_probes`` workers,
        probes at most ``health_max_probes``, and takes only tokens already in the bucket, so it
        never makes requests' probes wait for budget.
        """
        n = len(workers)
        if not n:
            return
        limit = min(self._config.health_max_probes, int(self._bucket.tokens(now)))
        look = min(n, 8 * self._config.health_max_probes)
        start = self._health_cursor % n
        due: list[WorkerAddr] = []
        looked = 0
        while looked < look and len(due) < limit:
            worker = workers[(start + looked) % n]
            looked += 1
            state = self._workers.get(worker)
            if state is None or (
                state.flight is None
                and state.ejected_until <= now
                and now - state.checked_at >= self._config.health_interval_s
            ):
                due.append(worker)
        self._health_cursor = (start + looked) % n
        if due:
            self._health_probes += len(due)
            self.probe(due, now + self._config.probe_timeout_s)  # results land in the cache

    # --- probe tasks ------------------------------------------------------------------------

    async def _fly(self, flight: _Flight) -> None:
        try:
            if not await self._take_budget(flight):
                self._bucket.refund(trio.current_time())
                self._finish(flight, self._outcome_skipped(flight, SkipReason.NO_BUDGET))
                return
            try:
                flight.phase = _Phase.RPC
                self._peak_inflight = max(self._peak_inflight, self._limiter.borrowed_tokens)
                status, error_kind = await self._call(flight)
            finally:
                self._limiter.release()
            if status is not None:
                self._finish(flight, self._record_status(flight, status))
            else:
                self._finish(flight, self._record_failure(flight, error_kind))
        finally:
            self._pending_probes -= 1
            if flight.state.flight is flight:
                flight.state.flight = None

    async def _take_budget(self, flight: _Flight) -> bool:
        """Wait for the flight's token, then an in-flight slot, before its requesters' latest deadline."""
        with flight.budget_scope:
            # Without waiting when the token is due and a slot is free: each avoided checkpoint is a
            # scheduler round trip off the request's latency.
            if flight.token_at > trio.current_time():
                await trio.sleep_until(flight.token_at)
            try:
                self._limiter.acquire_nowait()  # refuses while others queue: FIFO is kept
            except trio.WouldBlock:
                await self._limiter.acquire()
            # A slot handed over as the deadline passes still arrives (trio's acquire does not
            # checkpoint after parking), and this task may start late: never start past the deadline.
            if trio.current_time() < flight.budget_scope.deadline:
                return True
            self._limiter.release()
        return False

    async def _call(self, flight: _Flight) -> tuple[WorkerStatus | None, str]:
        """The RPC, bounded by probe_timeout_s alone (see the module docstring)."""
        with trio.move_on_after(self._config.probe_timeout_s):
            try:
                return (
                    await self._transport.get_worker_status(
                        flight.worker.status_target, flight.state.latest_finished_version
                    ),
                    "",
                )
            except TransportError as exc:
                return None, exc.kind
        return None, PROBE_TIMEOUT_KIND

    # --- state updates (synchronous) ------------------------------------------------------

    def _outcome_skipped(self, flight: _Flight, reason: SkipReason) -> ProbeResult:
        self._skipped[reason] += len(flight.waiters)
        return ProbeResult(flight.worker, ProbeOutcome.SKIPPED, skip_reason=reason)

    def _record_status(self, flight: _Flight, status: WorkerStatus) -> ProbeResult:
        now = trio.current_time()
        state = flight.state
        state.checked_at = now  # it answered: reachable, whatever the answer
        if status.status_version == 0:
            self._probes_no_status += 1
            return ProbeResult(flight.worker, ProbeOutcome.NO_STATUS)
        state.status = status
        state.status_at = now
        state.latest_finished_version = status.latest_finished_version
        state.consecutive_failures = 0
        state.unreachable = False
        if self._workers.get(flight.worker) is state:
            self._failing.discard(flight.worker)
        self._probes_ok += 1
        for listener in self._status_listeners:
            listener(flight.worker, status)
        return ProbeResult(flight.worker, ProbeOutcome.OK, status, observed_at=now)

    def _record_failure(self, flight: _Flight, kind: str) -> ProbeResult:
        state = flight.state
        now = trio.current_time()
        state.consecutive_failures += 1
        state.checked_at = now
        state.last_error = kind
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
        return ProbeResult(worker, ProbeOutcome.FAILED, error_kind=kind)

    def _end_ejections(self, now: float) -> None:
        """A collective failure: the ejections in force were its first signs, not outliers. End
        them now and give their count back; each worker stays unroutable until a good probe."""
        for worker in self._ejected:
            state = self._workers[worker]
            state.ejected_until = now
            state.times_ejected = max(0, state.times_ejected - 1)
        self._ejected.clear()

    def _eject(self, worker: WorkerAddr, state: _WorkerState, now: float) -> None:
        self._prune_ejections(now)
        if not ejection_allowed(len(self._ejected), len(self._workers), self._config.max_ejected_fraction):
            return  # over the cap: keeps failing, stays unusable (cached() is None), and retries ejection
        healthy_for = now - state.ejected_until if state.times_ejected else 0.0
        n = decayed_ejection_count(state.times_ejected, healthy_for, self._config.eject_base_s) + 1
        state.times_ejected = n
        state.ejected_until = now + ejection_duration_s(n, self._config.eject_base_s, self._config.eject_max_s)
        self._ejected[worker] = state.ejected_until

    def _prune_ejections(self, now: float) -> None:
        for worker in [w for w, until in self._ejected.items() if until <= now]:
            del self._ejected[worker]

    def _finish(self, flight: _Flight, result: ProbeResult) -> None:
        if flight.state.flight is flight:
            flight.state.flight = None  # the next request starts a new probe
        for handle in flight.waiters:
            handle._deliver(result)
        flight.waiters.clear()
