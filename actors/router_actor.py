"""Router: one request in, one decision out, always, within the request's deadline.

``route()`` admits the request against a cap on requests in flight (full → an immediate domain
decision, reason ``overloaded``) and runs it in the caller's own task, inside ONE cancel scope
whose deadline is ``now + min(budget, cap)``. That deadline bounds every source of the chain
together; each source's window only ever shortens it:

    keys → source 1 → source 2 → … → domain

Each source answers, falls through with a reason (the next one is asked), or ends the request
with an error. The deadline split (router/policy/deadline_split.py) says when each wait of a cache
source stops — fixed: all at ``decide_at = deadline − reserve``; learned: each early enough to
leave the later stages their estimated time — and the sources decide with what is in hand.
Whatever happens — a source raises, the deadline passes first — the request is answered by the
domain fallback, never lost.

State: the admission limiter and counters, and the admission estimate. They are changed only by
synchronous sections (no await between read and write) of request tasks and, for the estimate's lag
samples, of ``run``'s lag task; the debug view reads :meth:`health`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import trio

from actors.decision_log import DecisionLog
from actors.hit_accuracy import HitAccuracy
from actors.metrics_sink import DRAIN_BATCH, DecisionMade, MetricEvent, MetricsSink
from actors.sources.base import (
    Answered,
    Ended,
    FellThrough,
    RequestContext,
    RequestSplit,
    Skipped,
    Source,
    SourceResult,
    ms,
)
from actors.sources.companions import CompanionPicker
from actors.sources.domain import DomainSource
from router.admission import AdmissionEstimate, AdmissionView
from router.config import KvrouteConfig
from router.decision_record import DecisionRecord, without_prompt
from router.keys import IntRange, join_slices
from router.logs import AggregatingLogger
from router.policy.deadline_split import SplitEstimates, WithLag, split_windows
from router.request import (
    CheckedRequest,
    PreparedRequest,
    accepted_token_ids,
    check_fields,
    check_request,
    is_sliced,
    key_slices,
    named_roles,
    request_deadline,
    shed_check,
    with_plain_id,
)
from router.types import (
    COMPANION_ROLES,
    BadRequest,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouterClosed,
    RouteRequest,
    RouteSource,
    SourceOutcome,
    SourceStep,
    Stage,
    WorkerAddr,
)

log = logging.getLogger(__name__)

_HASH_REST_RATIO = 1.0  # a long prompt's hashing takes at most half of the routing thread
_MIN_REST_S = 0.001  # the shortest rest the I/O wait can take (it sleeps whole milliseconds)


class RestOwed:
    """The rest a long prompt's hashing owes the routing thread: as long as its slices worked (times
    ``_HASH_REST_RATIO``), taken once ``_MIN_REST_S`` is owed, the I/O wait a rest blocks in sleeping
    whole milliseconds (a rest per sub-millisecond slice rested two to three times its work); a rest
    longer than owed is counted against the next. Pure: the times are passed in."""

    __slots__ = ("owed_s",)

    def __init__(self) -> None:
        self.owed_s = 0.0

    def after(self, worked_s: float) -> float:
        """The rest to take after a slice that worked ``worked_s`` (0: none yet, only a checkpoint)."""
        self.owed_s += worked_s * _HASH_REST_RATIO
        return self.owed_s if self.owed_s >= _MIN_REST_S else 0.0

    def rested(self, rested_s: float) -> None:
        self.owed_s -= rested_s


@dataclass(slots=True)
class WalkProgress:
    """How far a request's walk got, kept outside its scope for a deadline (or a bug) that cuts it:
    the checked request (for the ledger charge of the worker its deadline answer names), the keys'
    hashing time so far (for the admission estimate: the KEYS stage holds a long prompt's rests and
    its wait for the turn to hash too) and the context once made (the Scorer's work, and the sources'
    bookkeeping of a deadline answer)."""

    checked: CheckedRequest | None = None
    hashing_s: float = 0.0
    ctx: RequestContext | None = None

    def prepared(self) -> PreparedRequest | None:
        """The request as far as it was prepared, for the ledger charge of an answer outside the chain:
        with its keys once made, else (cut while hashing) by its length alone; None: not checked."""
        if self.ctx is not None:
            return self.ctx.prepared
        return None if self.checked is None else self.checked.with_keys(())
OVERLOAD_DRAWS = 16  # overloaded answers drawn ahead for threads that shed before the loop
OVERLOAD_REDRAW_EVERY = 10  # lag probe intervals between two draws (the estimate is published at each probe)


@dataclass(frozen=True, slots=True)
class OverloadAnswers:
    """What a thread that receives requests needs to shed one before it reaches the routing loop,
    published by the router's task after every lag measurement (read without a lock).

    ``estimate`` is the admission estimate at publication; ``answers`` are domain answers with
    reason ``overloaded``, each drawn as the router would for a request naming no roles (request
    id and elapsed time left to fill in). Shedding is recorded on the routing loop afterwards
    (:meth:`RouterActor.record_shed`).
    """

    estimate: AdmissionView
    answers: tuple[RouteDecision, ...]


@dataclass(frozen=True, slots=True)
class RouterHealth:
    in_flight: int
    in_flight_peak: int
    max_in_flight: int
    handled: int
    overloaded: int
    deadline_fallbacks: int  # requests whose deadline passed before a source answered (or on arrival): domain
    internal_errors: int
    chain: tuple[str, ...]  # the sources, in the order a request asks them
    admission: AdmissionView


_ANY_REQUEST = RouteRequest(request_id="")  # the drawn answers' placeholder; each shed fills in its own id

# Answers made in a row without the lag probe's task getting to run between them, after which the
# next one yields (``RouterActor._answered``). A caller answered without one await (the domain's pick,
# a refusal, a scheduler over an in-memory transport) then yields every this many, and each round lets
# the metrics sink take as many decisions as were made (one event each). On a loop that cycles the probe
# runs every lag interval: this many answers within one is beyond the routing rates measured.
ANSWERS_PER_ROUND = DRAIN_BATCH


class RouterActor:
    def __init__(
        self,
        config: KvrouteConfig,
        *,
        chain: Sequence[Source],
        domain: DomainSource,
        companions: CompanionPicker,
        metrics: MetricsSink,
        warn: AggregatingLogger,
        decision_log: DecisionLog | None = None,
        accuracy: HitAccuracy | None = None,
        split_estimates: Callable[[], SplitEstimates] | None = None,
    ) -> None:
        if not chain or chain[-1] is not domain:
            raise ValueError("chain: the domain source must be the last source of the chain")
        self._config = config
        self._deployment = config.deployment
        self._limits = config.limits
        self._chain = tuple(chain)
        self._domain = domain
        self._companions = companions
        self._needs_keys = any(source.needs_keys for source in chain)
        self._deployment_companions = tuple(r for r in config.deployment.roles if r in COMPANION_ROLES)
        self._metrics = metrics
        self._warn = warn
        self._decision_log = decision_log
        self._accuracy = accuracy
        # The learned split's estimates: the immutable snapshot the metrics sink publishes, with the loop's
        # lag (the fixed split's reserve covers it too: a task woken at the end of a wait runs that much
        # later). A replay passes the recorded ones as they were.
        self._split_estimates = self._live_split_estimates if split_estimates is None else split_estimates
        self._with_lag = WithLag()
        self._limiter = trio.CapacityLimiter(config.router.max_in_flight)
        self._long_hashing = trio.CapacityLimiter(1)
        self._estimate = AdmissionEstimate(config.router)
        # Its own generator: draws made ahead for other threads must not shift the domain source's.
        self._overload_rng = random.Random(config.scorer.seed)
        self._overload_answers: OverloadAnswers | None = None
        self._lag_down_since: float | None = None  # set while the router's own task is down
        self._lag_interval_s = config.router.lag_probe_interval_ms / 1000.0
        # 0: the probe keeps its interval when idle (``lag_probe_idle_ms`` not above it).
        idle_s = config.router.lag_probe_idle_ms / 1000.0
        self._lag_idle_s = idle_s if idle_s > self._lag_interval_s else 0.0
        self._last_arrival = -math.inf  # trio time of the last call to route()
        # The idle probe's wait, which a request cuts short, with when it began and is due (trio time).
        self._lag_wake: tuple[trio.CancelScope, float, float] | None = None
        self._peak = 0
        self._handled = 0
        self._overloaded = 0
        self._unyielded = 0  # answers since this actor's lag probe last ran (``_answered``)
        self._deadline_fallbacks = 0
        self._internal_errors = 0
        # Closing (``close_to_new``): new requests are refused; the last one out sets ``_idle``.
        self._closing = False
        self._idle: trio.Event | None = None

    # -- entry points --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The router's own tasks measure the loop's lag and flush aggregated warnings; requests run in
        their callers' tasks."""
        self._lag_down_since = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._warn.run)
                nursery.start_soon(self._measure_lag)
                task_status.started()
        finally:
            # Down (a crash, a stop): nothing ages the estimate but the requests that come meanwhile.
            self._lag_down_since = trio.current_time()

    async def _measure_lag(self) -> None:
        """How late a timer fires is how long a due task waits for the loop: feed the admission
        estimate and publish it. Once no request has come for ``lag_probe_idle_ms`` and none is in
        flight, probe that often instead until ``route`` wakes the probe: an idle loop has nothing
        due to be late, and the estimate ages as the skipped probes would have aged it."""
        answers: tuple[RouteDecision, ...] = ()
        since_draw = float(OVERLOAD_REDRAW_EVERY)  # probe intervals since the answers were drawn
        base_s = self._lag_interval_s
        while True:
            if since_draw >= OVERLOAD_REDRAW_EVERY:
                answers = self._draw_overload_answers()
                since_draw = 0.0
            self._overload_answers = OverloadAnswers(self._estimate.view(), answers)
            start = trio.current_time()
            idle = self._quiet(start)
            intervals = self._lag_idle_s / base_s if idle else 1.0  # the probes this wait stands for
            due = start + (self._lag_idle_s if idle else base_s)
            with trio.CancelScope() as wait:
                self._lag_wake = (wait, start, due) if idle else None
                try:
                    await trio.sleep_until(due)
                finally:
                    # Also when this task ends here (its actor crashed, a stop): a request meanwhile, the
                    # task down for a restart's backoff, took a lag sample from the dead wait, however
                    # long ago it was due, and the estimate it left shed every request until the restart.
                    self._lag_wake = None
            self._unyielded = 0  # the loop cycled: this task ran
            now = trio.current_time()
            if wait.cancel_called:  # a request came and took the sample (``_arrived``), due or not
                intervals = (now - start) / base_s
            else:
                self._estimate.observe_lag(now - due, intervals=intervals)
            since_draw += intervals

    def _arrived(self, now: float) -> None:
        """A request came: the lag probe, if it waits as for an idle loop, goes back to its interval, and
        the estimate takes the wait's sample now, before the request is judged by it: aged for the wait
        so far, and late only if the timer was already due (the loop stalled past it)."""
        self._last_arrival = now
        down_since = self._lag_down_since
        if down_since is not None:
            # The lag probe is down with the router's task (a restart's backoff, up to seconds in a
            # crash loop): age the estimate as the probes it misses would, none of them late, or an
            # estimate left high by a stall before the crash sheds every request until the restart.
            self._lag_down_since = now
            self._estimate.observe_lag(0.0, intervals=(now - down_since) / self._lag_interval_s)
            published = self._overload_answers
            if published is not None:  # the ways in shed by the published estimate: the aged one
                self._overload_answers = OverloadAnswers(self._estimate.view(), published.answers)
        if self._lag_wake is not None:
            wait, since, due = self._lag_wake
            self._lag_wake = None
            self._estimate.observe_lag(max(0.0, now - due), intervals=(now - since) / self._lag_interval_s)
            wait.cancel()

    def _quiet(self, now: float) -> bool:
        """Whether the lag probe may wait ``lag_probe_idle_ms``: no request for that long, none in flight."""
        return (
            self._lag_idle_s > 0.0
            and not self._limiter.borrowed_tokens
            and now - self._last_arrival >= self._lag_idle_s
        )

    def _draw_overload_answers(self) -> tuple[RouteDecision, ...]:
        now = trio.current_time()
        draws = []
        for _ in range(OVERLOAD_DRAWS):
            result = self._domain.pick(None, Reason.OVERLOADED, rng=self._overload_rng)
            source = RouteSource.DOMAIN if isinstance(result, Answered) else None
            draws.append(self._decision(_ANY_REQUEST, now, {}, (), source, result, None, None, rng=self._overload_rng))
        return tuple(draws)

    def overload_answers(self) -> OverloadAnswers | None:
        """The last published answers for shedding off the routing loop (None before the first)."""
        return self._overload_answers

    def record_shed(self, request: Callable[[], RouteRequest], decision: RouteDecision, deadline: float) -> None:
        """Count and record a request another thread answered ``overloaded`` from
        :meth:`overload_answers`, as :meth:`route` does its own sheds (their charges come in sums:
        :meth:`charge_sheds`). ``request`` builds the request: only the decision log keeps it, and a
        shed answer is cheap only if nothing else does."""
        self._overloaded += 1
        now = trio.current_time()
        self._arrived(now)  # calls shed elsewhere still load this process
        self._emit(decision)
        if self._decision_log is not None:
            record = DecisionRecord(self._recorded(request()), now, deadline, overloaded=True, decision=decision)
            self._decision_log.submit(record)

    def _recorded(self, request: RouteRequest) -> RouteRequest:
        return without_prompt(request, self._config.limits.max_request_id_bytes)

    def charge_sheds(self, sent: Mapping[WorkerAddr, tuple[int, int]]) -> None:
        """Charge the workers named by sheds other threads answered: (tokens, requests) each was sent
        (the prompts' lengths, as ``sheddable`` gave them), one charge per worker for a batch."""
        for worker, (tokens, requests) in sent.items():
            self._domain.charge(worker, tokens, requests)

    async def route(self, request: RouteRequest) -> RouteDecision:
        """Always returns a decision, at the latest at the request's deadline (plus the domain pick);
        raises Cancelled for a caller already cancelled, before anything is made or counted (what is
        made after is not lost: the rounds that follow a decision are shielded)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closing:
            raise RouterClosed("the router is closed: route() after its open_router block ended")
        now = trio.current_time()
        self._arrived(now)
        router = self._config.router
        request = with_plain_id(request)  # before any answer: a refusal's is recorded too
        try:
            check_fields(request)  # the deadline below reads the timing fields
        except BadRequest as exc:
            return await self._refuse(request, now, exc)
        deadline = request_deadline(request, now, router.budget_cap_ms, router.reply_margin_ms)
        remaining = deadline - now
        if remaining <= 0:
            # No time at all (a budget of 0, the caller's deadline past): answered ``deadline`` at once,
            # outside the chain, not shed; a source answering without a wait made it look routed in time.
            return await self._outside_or_refuse(request, now, deadline, Reason.DEADLINE)
        ticket = object()  # the limiter's borrower: one per request
        # Shed at once what would only be answered late (the admission estimate) or what the cap
        # has no room for.
        in_flight = int(self._limiter.borrowed_tokens)
        if not self._estimate.admits(remaining, in_flight=in_flight):
            return await self._outside_or_refuse(request, now, deadline, Reason.OVERLOADED)
        try:
            self._limiter.acquire_on_behalf_of_nowait(ticket)
        except trio.WouldBlock:
            return await self._outside_or_refuse(request, now, deadline, Reason.OVERLOADED)
        try:
            self._peak = max(self._peak, int(self._limiter.borrowed_tokens))
            decision = await self._handle(request, now, deadline)
        finally:
            self._limiter.release_on_behalf_of(ticket)
            if self._idle is not None and not self._limiter.borrowed_tokens:
                self._idle.set()
        return await self._answered(decision)

    def close_to_new(self) -> None:
        """Refuse every request from now on (``RouterClosed``); those in flight go on."""
        self._closing = True

    async def wait_idle(self) -> None:
        """Return once no request is being routed (after ``close_to_new``, none will be again)."""
        if self._limiter.borrowed_tokens:
            self._idle = trio.Event()
            await self._idle.wait()

    async def _answered(self, decision: RouteDecision) -> RouteDecision:
        """``decision``, after a scheduling round if ANSWERS_PER_ROUND answers came since the lag probe
        last ran: a caller routing in a loop in one task, answered without awaiting anything, would
        otherwise never let the other actors run (the metrics sink, the breakers' owners), and the probe,
        waiting for the loop, would count it all as lag and shed what follows. Only then: an answer made
        after a wait (a peer's reply, a deadline's cancellation) must not wait a batch more. Shielded: a
        decision made is not lost to a cancellation."""
        self._unyielded += 1
        if self._unyielded >= ANSWERS_PER_ROUND:
            self._unyielded = 0
            await trio.lowlevel.cancel_shielded_checkpoint()
        return decision

    async def _refuse(
        self, request: RouteRequest, now: float, problem: BadRequest, *, logged_until: float | None = None
    ) -> RouteDecision:
        """The answer ``bad_request``, outside the chain. ``logged_until`` (the request's deadline): its
        fields could be read, and it is written to the decision log as any decision; None for one whose
        fields cannot even be read (a wrong type, a budget that is not a finite number), not written,
        since the log's encoder expects the declared types."""
        if not isinstance(request.request_id, str):
            request = replace(request, request_id=repr(request.request_id))
        decision = self._emit(self._fallback(request, None, Reason.BAD_REQUEST, now, {}, (), error=str(problem)))
        if logged_until is not None and self._decision_log is not None:
            self._decision_log.submit(DecisionRecord(self._recorded(request), now, logged_until, decision=decision))
        await trio.lowlevel.cancel_shielded_checkpoint()  # made and counted: a cancellation must not lose it
        return decision

    async def _outside_or_refuse(
        self, request: RouteRequest, now: float, deadline: float, reason: Reason
    ) -> RouteDecision:
        """The answer outside the chain (``overloaded``: a shed; ``deadline``: no time on arrival), unless
        the checks refuse the request: then theirs (``bad_request``, naming the field, made and logged as
        any), which must not become a worker under overload."""
        checked = self.shed_check(request)
        if not isinstance(checked, BadRequest):
            return await self._outside(request, now, deadline, checked, reason)
        # Refused at once, from the same checks: not by walking the chain, where a long prompt's hashing
        # (in slices, with checkpoints) is cut by a deadline already past before it reaches the bad id.
        return await self._refuse(request, now, checked, logged_until=deadline)

    def accepted_token_ids(self) -> IntRange:
        """The token ids this router takes: its family's when a source hashes them, else any 64-bit
        integer (set at start: any thread may read it)."""
        return accepted_token_ids(self._deployment.key_family, hash_tokens=self._needs_keys)

    def sheddable(self, request: RouteRequest) -> int | None:
        """``request``'s length when it may be answered ``overloaded``, None when this router would
        refuse it: the one rule the ways in shed by, read from settings fixed at start (any thread)."""
        checked = self.shed_check(request)
        return None if isinstance(checked, BadRequest) else checked

    def shed_check(self, request: RouteRequest) -> int | BadRequest:
        """``request``'s length when it may be answered outside the chain, else this router's refusal."""
        return shed_check(request, self._deployment, self._limits, hash_tokens=self._needs_keys)

    async def _outside(
        self, request: RouteRequest, now: float, deadline: float, tokens: int, reason: Reason
    ) -> RouteDecision:
        """The domain answer ``reason`` (``overloaded`` or ``deadline``), before any work on the request
        (recorded like any decision; a replay finds a shed by its record's flag, no time by its times).

        Still a scheduling round: a caller looping over shed requests would otherwise never yield, the lag
        probe would wait for it, and the lag it measured would shed everything after. Shielded: the answer
        is counted, charged and logged, and a cancellation must not lose it."""
        shed = reason is Reason.OVERLOADED
        if shed:
            self._overloaded += 1
        else:
            self._deadline_fallbacks += 1
        decision = self._emit(self._fallback(request, None, reason, now, {}, ()))
        if decision.worker is not None:  # the worker gets it: the Scorer must see it (``tokens``, its length)
            self._domain.charge(decision.worker, tokens)
        if self._decision_log is not None:
            record = DecisionRecord(self._recorded(request), now, deadline, overloaded=shed, decision=decision)
            self._decision_log.submit(record)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return decision

    def health(self) -> RouterHealth:
        return RouterHealth(
            in_flight=int(self._limiter.borrowed_tokens),
            in_flight_peak=self._peak,
            max_in_flight=int(self._limiter.total_tokens),
            handled=self._handled,
            overloaded=self._overloaded,
            deadline_fallbacks=self._deadline_fallbacks,
            internal_errors=self._internal_errors,
            chain=tuple(source.kind.value for source in self._chain),
            admission=self._estimate.view(),
        )

    def in_flight(self) -> int:
        return int(self._limiter.borrowed_tokens)

    def _live_split_estimates(self) -> SplitEstimates:
        return self._with_lag(self._metrics.split_estimates(), self._estimate.lag_s)

    # -- one request -----------------------------------------------------------------------------

    async def _handle(self, request: RouteRequest, received_at: float, deadline: float) -> RouteDecision:
        stages: dict[Stage, float] = {}
        steps: list[SourceStep] = []
        events: list[MetricEvent] = []  # the sources' observations, sent with the decision
        ctx: RequestContext | None = None
        decision: RouteDecision | None = None
        record = None if self._decision_log is None else DecisionRecord(self._recorded(request), received_at, deadline)
        estimates = self._split_estimates()
        split = RequestSplit(split_windows(received_at, deadline, estimates, self._config.router))
        if record is not None:
            record.split = estimates
        # A walk the deadline (or a bug) ends returns no context, and the work it measured (hashing,
        # scoring) must still reach the estimate.
        progress = WalkProgress()
        try:
            with trio.CancelScope(deadline=deadline):
                ctx, decision = await self._walk(
                    request,
                    received_at,
                    deadline,
                    split,
                    stages,
                    steps,
                    events=events,
                    record=record,
                    progress=progress,
                )
        except Exception as exc:  # one request's bug must not take the router down: answer and count it
            self._internal_errors += 1
            # Aggregated: a bug on the request path would otherwise log a traceback per request.
            self._warn.note(
                Reason.INTERNAL_ERROR, trio.current_time(), f"route pipeline failed: {exc!r}",
                exc_info=exc, request_id=request.request_id,
            )
            # The worker still gets the request, as for a deadline answer below (a Scorer restarting
            # answers every scored request so: uncharged, the Scorer would not see them).
            ctx = progress.ctx
            decision = self._fallback(
                request,
                progress.prepared(),
                Reason.INTERNAL_ERROR,
                received_at,
                stages,
                tuple(steps),
                error=f"internal error: {exc!r}",
                split=split,
            )
        if decision is None:
            self._deadline_fallbacks += 1
            # The worker still gets the request: with a context made, its ledger charge and its
            # sources' bookkeeping (the shadow's write-on-route) follow as for an answer in the chain.
            ctx = progress.ctx
            decision = self._fallback(
                request, progress.prepared(), Reason.DEADLINE, received_at, stages, tuple(steps), split=split
            )
        self._handled += 1
        # The Scorer's work, not the SCORE stage's wall time (which holds the inbox wait, the loop lag
        # the estimate counts apart); the stage only where no context carried the work back.
        scorer_work_s = None if progress.ctx is None else progress.ctx.scorer_work_s
        score_ms = stages.get(Stage.SCORE, 0.0) if scorer_work_s is None else ms(scorer_work_s)
        # The hashing's own time, not the KEYS stage's wall time (which holds a long prompt's rests and
        # its wait for the turn to hash: with several long prompts, several times their work).
        own_ms = ms(progress.hashing_s) + stages.get(Stage.PLAN, 0.0) + score_ms
        self._estimate.observe_own(own_ms / 1000.0)
        try:
            if ctx is not None:
                for source in self._chain:
                    source.after_reply(ctx, decision)
            if self._accuracy is not None and decision.worker is not None and decision.hit_tokens > 0:
                self._accuracy.predict(
                    request.request_id,
                    decision.worker.http_target,
                    decision.hit_tokens,
                    decision.route_source,
                    received_at,
                )
        except Exception as exc:  # the bookkeeping's bug must not lose a decision already made
            self._internal_errors += 1
            # A key of its own: a bug here must not hide behind a pipeline bug's window (or the reverse).
            self._warn.note(
                "after_reply_error", trio.current_time(), f"after-reply work failed: {exc!r}",
                exc_info=exc, request_id=request.request_id,
            )
        if split.probes_ended_at is not None:
            # The tail, taken last: only the two non-blocking sends below follow before the return.
            # ``stages`` is the decision's own stage_ms, filled in place like TOTAL was.
            stages[Stage.TAIL] = ms(trio.current_time() - split.probes_ended_at)
        self._metrics.emit(DecisionMade(decision, tuple(events)))
        if record is not None and self._decision_log is not None:
            record.decision = decision
            self._decision_log.submit(record)
        return decision

    async def _walk(
        self,
        request: RouteRequest,
        received_at: float,
        deadline: float,
        split: RequestSplit,
        stages: dict[Stage, float],
        steps: list[SourceStep],
        *,
        events: list[MetricEvent],
        record: DecisionRecord | None = None,
        progress: WalkProgress,
    ) -> tuple[RequestContext | None, RouteDecision]:
        t = trio.current_time()
        try:
            checked = check_request(request, self._deployment, self._limits, hash_tokens=self._needs_keys)
            progress.checked = checked
            try:
                keys = await self._keys(checked, progress)
            except trio.Cancelled:
                # Cut while hashing a long prompt: no keys and no context, so the record says so itself,
                # or it would read as a request refused by its checks.
                if record is not None:
                    record.hashing_cut = checked.seq_len
                raise
            prepared = checked.with_keys(keys)
        except BadRequest as exc:
            return None, self._fallback(request, None, Reason.BAD_REQUEST, received_at, stages, (), error=str(exc))
        stages[Stage.KEYS] = ms(trio.current_time() - t)
        ctx = RequestContext(
            request=request,
            prepared=prepared,
            received_at=received_at,
            deadline=deadline,
            split=split,
            stages=stages,
            record=record,
            events=events,
        )
        progress.ctx = ctx
        skip_to_last = False
        for source in self._chain:
            if skip_to_last and source is not self._chain[-1]:
                steps.append(SourceStep(source.kind, SourceOutcome.SKIPPED, None, 0.0))
                continue
            started = trio.current_time()
            window_end = source.window(ctx)
            result: SourceResult
            try:
                if window_end < deadline:
                    with trio.CancelScope(deadline=window_end) as window:
                        result = await source.attempt(ctx)
                    if window.cancelled_caught:
                        result = FellThrough(Reason.DEADLINE)
                else:
                    # A window reaching the deadline ends with the request's own scope, which (cancelled at
                    # the same instant, and outer) takes the cancellation: a window scope would catch nothing.
                    result = await source.attempt(ctx)
            except BaseException as exc:
                # The request's deadline (or its caller, or a bug) ended it inside this source: the
                # decision made from the steps must still say which source the time went to.
                cut = Reason.DEADLINE if isinstance(exc, trio.Cancelled) else Reason.INTERNAL_ERROR
                elapsed = ms(trio.current_time() - started)
                steps.append(SourceStep(source.kind, SourceOutcome.FELL_THROUGH, cut, elapsed))
                raise
            elapsed = ms(trio.current_time() - started)
            if isinstance(result, Skipped):
                steps.append(SourceStep(source.kind, SourceOutcome.SKIPPED, None, elapsed))
                continue
            if isinstance(result, FellThrough):
                steps.append(SourceStep(source.kind, SourceOutcome.FELL_THROUGH, result.reason, elapsed))
                if ctx.fallthrough is None:
                    ctx.fallthrough = result.reason
                skip_to_last = skip_to_last or result.to_last
                continue
            if isinstance(result, Ended):
                steps.append(SourceStep(source.kind, SourceOutcome.ENDED, result.reason, elapsed))
                return ctx, self._decision(request, received_at, stages, tuple(steps), None, result, prepared, split)
            steps.append(SourceStep(source.kind, SourceOutcome.ANSWERED, result.reason, elapsed))
            return ctx, self._decision(
                request, received_at, stages, tuple(steps), source.kind, result, prepared, split
            )
        raise AssertionError("the domain source always answers or ends the request")  # pragma: no cover

    async def _keys(self, checked: CheckedRequest, progress: WalkProgress) -> tuple[int, ...]:
        """The request's block keys; the time their hashing took (without the rests between slices and
        the wait for the turn to hash, which the admission estimate must not count as work) is kept in
        ``progress.hashing_s`` as it grows, for a deadline that cuts it. A long
        prompt is hashed in slices with a checkpoint after each: other requests run in between, and the
        request's cancel scope (its deadline, or its caller giving up) stops the hashing there. One long
        prompt is hashed at a time (the others wait their turn under their own deadlines), so at most
        one slice of hashing runs per scheduling round however many long prompts arrive. A short one
        is hashed at once, without an await."""
        slice_tokens = self._limits.hash_slice_tokens
        slices = key_slices(checked, slice_tokens)
        started = trio.current_time()
        if not is_sliced(checked, slice_tokens):
            keys = join_slices(slices)
            progress.hashing_s = trio.current_time() - started
            return keys
        parts: list[tuple[int, ...]] = []
        rest = RestOwed()
        async with self._long_hashing:
            started = trio.current_time()
            for part in slices:
                parts.append(part)
                took = trio.current_time() - started
                progress.hashing_s += took
                # Rest as long as the slices took (``RestOwed``): the routing thread then blocks in its I/O
                # wait, which also hands the GIL to the threads delivering other requests' RPC replies; a
                # checkpoint between rests lets other requests run.
                owe = rest.after(took)
                if owe > 0:
                    rest_from = trio.current_time()
                    await trio.sleep(owe)
                    rest.rested(trio.current_time() - rest_from)
                else:
                    await trio.lowlevel.checkpoint()
                started = trio.current_time()
        return join_slices(iter(parts))

    # -- answers ------------------------------------------------------------------------------------

    def _fallback(
        self,
        request: RouteRequest,
        prepared: PreparedRequest | None,
        reason: Reason,
        received_at: float,
        stages: dict[Stage, float],
        steps: tuple[SourceStep, ...],
        *,
        error: str | None = None,
        split: RequestSplit | None = None,
    ) -> RouteDecision:
        """The domain source's answer outside the chain (bad request, overloaded, deadline, bug), for the
        roles the request names (checked or not) or else the deployment's."""
        named = None if prepared is not None else named_roles(request, self._deployment)
        roles, companions = (None, None) if named is None else named
        result = self._domain.pick(prepared, reason, error, roles=roles)
        source = RouteSource.DOMAIN if isinstance(result, Answered) else None
        return self._decision(
            request, received_at, stages, steps, source, result, prepared, split, companions=companions
        )

    def _decision(
        self,
        request: RouteRequest,
        received_at: float,
        stages: dict[Stage, float],
        steps: tuple[SourceStep, ...],
        source: RouteSource | None,
        result: Answered | Ended,
        prepared: PreparedRequest | None,
        split: RequestSplit | None,
        *,
        rng: random.Random | None = None,
        companions: tuple[Role, ...] | None = None,
    ) -> RouteDecision:
        """``companions``: the request's, when it has no ``prepared`` form (else the deployment's)."""
        elapsed = ms(trio.current_time() - received_at)
        stages[Stage.TOTAL] = elapsed
        mode = None if split is None or not split.waits else split.windows.mode
        windows = () if split is None else split.stage_windows(received_at)
        if isinstance(result, Ended):
            return RouteDecision(
                request_id=request.request_id,
                worker=None,
                role=None,
                route_source=RouteSource.NONE,
                reason=result.reason,
                elapsed_ms=elapsed,
                stage_ms=stages,
                error=result.error,
                sources=steps,
                error_code=result.code,
                split=mode,
                windows=windows,
            )
        assert source is not None
        role_addrs = result.role_addrs or (
            RoleAddr(result.role, result.worker.ip, result.worker.http_port, result.worker.grpc_port),
        )
        if prepared is not None:
            companions = prepared.companions
        elif companions is None:
            companions = self._deployment_companions
        if companions:
            role_addrs = self._companions.fill(role_addrs, companions, rng=rng)
        return RouteDecision(
            request_id=request.request_id,
            worker=result.worker,
            role=result.role,
            route_source=source,
            reason=result.reason,
            hit_tokens=result.hit_tokens,
            local_blocks=result.local_blocks,
            elapsed_ms=elapsed,
            stage_ms=stages,
            candidates=result.candidates,
            error=result.error,
            sources=steps,
            role_addrs=role_addrs,
            split=mode,
            windows=windows,
        )

    def _emit(self, decision: RouteDecision) -> RouteDecision:
        self._metrics.emit(DecisionMade(decision))
        return decision
