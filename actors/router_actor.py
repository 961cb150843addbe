"""Router actor: one request in, one decision out, always, within the request's deadline.

``route()`` puts the request on a bounded inbox (full → an immediate domain decision, reason
``overloaded``) and waits for the reply under the caller's own deadline. ``run()`` takes requests
off the inbox and runs each as its own task in the handler nursery, inside ONE cancel scope whose
deadline is ``now + min(budget, cap)``. That one deadline bounds every stage together:

    keys → leader → GetHostCacheState → plan → probes → score

Stages only ever shorten it. A reserve before the deadline is kept for the decision itself: at
``decide_at = deadline − reserve`` the request stops waiting and decides with what is in hand
(statuses probed so far or cached). When KVCM cannot help (breaker open, no leader, error, no
positive match) the request goes straight to the next source — the shadow index, then domain
routing — without spending the rest of its budget.

State: the inbox and counters belong to this actor; decisions are serialized through the Scorer's
synchronous ``decide`` (no await inside, so no two decisions interleave on trio's one thread).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from actors.breaker import Admission
from actors.discovery import Discovery
from actors.leader_resolver import LeaderResolver, LeaderUnavailable, UnavailableReason
from actors.metrics_sink import (
    DecisionMade,
    KvcmRequest,
    LeaderChanged,
    MetricsSink,
    ProbeSkipped,
    ShadowAgreement,
    ShadowRecordDropped,
    StatusCacheHits,
)
from actors.scorer import CandidateSource, Fleet, ObservedStatus, Scorer, plan_candidates
from actors.shadow_index import ShadowIndexActor, agreement
from actors.worker_prober import ProbeOutcome, SkipReason, WorkerProber
from router.config import DeploymentConfig, KvrouteConfig
from router.keys import block_keys
from router.logs import AggregatingLogger
from router.transport.errors import DeadlineExceeded, TransportError
from router.transport.ports import KvcmTransport
from router.types import (
    BadRequest,
    CacheQuery,
    CandidateExplain,
    DropReason,
    HostMatch,
    Reason,
    Role,
    RouteDecision,
    RouteRequest,
    RouteSource,
    WorkerAddr,
)

log = logging.getLogger(__name__)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_GRACE_S = 0.002  # how long route() waits past the deadline for the handler before answering itself

_SKIP_DROPS = {
    SkipReason.EJECTED: DropReason.EJECTED,
    SkipReason.NO_BUDGET: DropReason.PROBE_SKIPPED,
    SkipReason.DEADLINE: DropReason.PROBE_SKIPPED,
    SkipReason.STOPPED: DropReason.PROBE_SKIPPED,
}


# --- pure request preparation ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request: the block keys to query, their block size, seq_len and roles."""

    keys: tuple[int, ...]
    block_size: int
    seq_len: int
    roles: tuple[Role, ...]


def prepare_request(
    request: RouteRequest, deployment: DeploymentConfig, *, hash_tokens: bool = True
) -> PreparedRequest:
    """Validate ``request`` and compute its block keys (pure). Raise BadRequest naming the field.

    Caller keys are used exactly as given (no re-hashing); tokens are hashed with the deployment's
    family, block size and lookahead — the one source of the key geometry. ``hash_tokens=False``
    (KVCM fallback off: nothing uses keys) skips hashing, a few ms of CPU for a long prompt, and
    gives no keys.
    """
    if not request.request_id:
        raise BadRequest("request_id", "must not be empty")
    has_tokens = request.token_ids is not None
    has_keys = request.block_cache_keys is not None
    if has_tokens == has_keys:
        raise BadRequest("token_ids", "give exactly one of token_ids or block_cache_keys")
    if request.block_size is not None and request.block_size <= 0:
        raise BadRequest("block_size", f"must be positive, got {request.block_size}")
    if request.seq_len is not None and request.seq_len < 0:
        raise BadRequest("seq_len", f"must not be negative, got {request.seq_len}")
    if request.budget_ms is not None and not math.isfinite(request.budget_ms):
        raise BadRequest("budget_ms", f"must be finite, got {request.budget_ms}")
    roles = deployment.roles if not request.roles else request.roles
    foreign = [r.value for r in roles if r not in deployment.roles]
    if foreign:
        raise BadRequest("roles", f"{','.join(foreign)} not routed by this deployment ({_names(deployment.roles)})")
    if request.block_cache_keys is not None:
        keys = tuple(request.block_cache_keys)
        block_size = request.block_size if request.block_size is not None else deployment.block_size
        if keys and (min(keys) < _INT64_MIN or max(keys) > _INT64_MAX):
            raise BadRequest("block_cache_keys", "every key must be a signed 64-bit integer")
        seq_len = request.seq_len if request.seq_len is not None else len(keys) * block_size
    else:
        assert request.token_ids is not None
        tokens = request.token_ids
        if not tokens:
            raise BadRequest("token_ids", "must not be empty")
        if request.block_size is not None and request.block_size != deployment.block_size:
            raise BadRequest(
                "block_size",
                f"{request.block_size} differs from the deployment's {deployment.block_size}, "
                "which token ids are hashed with; send block_cache_keys to use another",
            )
        block_size = deployment.block_size
        try:
            keys = (
                block_keys(tokens, block_size, deployment.key_family, deployment.lookahead_tokens)
                if hash_tokens
                else ()
            )
        except ValueError as exc:
            raise BadRequest("token_ids", str(exc)) from exc
        seq_len = request.seq_len if request.seq_len is not None else len(tokens)
    return PreparedRequest(keys=keys, block_size=block_size, seq_len=seq_len, roles=tuple(roles))


def _names(roles: Sequence[Role]) -> str:
    return ",".join(r.value for r in roles)


def request_deadline(request: RouteRequest, now: float, cap_ms: float) -> float:
    """``now + min(budget, cap)``; an absolute deadline counts as a budget. Never later than the cap."""
    cap = now + cap_ms / 1000.0
    if request.deadline is not None:
        return min(request.deadline, cap)
    if request.budget_ms is not None and math.isfinite(request.budget_ms):
        return min(now + max(0.0, request.budget_ms) / 1000.0, cap)
    return cap


# --- the actor ---------------------------------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Reply:
    event: trio.Event = field(default_factory=trio.Event)
    decision: RouteDecision | None = None


@dataclass(slots=True)
class _KvcmAnswer:
    """What KVCM answered a request, kept for the shadow-agreement metric computed after the reply."""

    hosts: tuple[HostMatch, ...] | None = None  # positive hosts; None when KVCM gave no answer
    keys: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Job:
    request: RouteRequest
    received_at: float
    deadline: float
    reply: _Reply


@dataclass(frozen=True, slots=True)
class RouterHealth:
    inbox_depth: int
    inbox_capacity: int
    inbox_peak: int
    in_flight: int
    handled: int
    overloaded: int
    answered_by_caller: int
    internal_errors: int
    kvcm_fallback: bool


class RouterActor:
    def __init__(
        self,
        config: KvrouteConfig,
        *,
        discovery: Discovery,
        resolver: LeaderResolver | None,
        kvcm: KvcmTransport | None,
        prober: WorkerProber,
        scorer: Scorer,
        shadow: ShadowIndexActor,
        metrics: MetricsSink,
    ) -> None:
        self._config = config
        self._deployment = config.deployment
        self._kvcm_enabled = config.router.kvcm_fallback and resolver is not None and kvcm is not None
        self._discovery = discovery
        self._resolver = resolver
        self._kvcm = kvcm
        self._prober = prober
        self._scorer = scorer
        self._shadow = shadow
        self._metrics = metrics
        self._send, self._receive = trio.open_memory_channel[_Job](config.router.inbox_size)
        self._capacity = config.router.inbox_size
        self._rng = random.Random(config.scorer.seed)
        self._fleet_version = -1
        self._fleet = Fleet.of(())
        self._last_leader: str | None = None
        self._warn = AggregatingLogger(
            log, interval_s=config.serve.log_aggregate_interval_s, max_keys=config.serve.log_max_keys
        )
        self._peak = 0
        self._in_flight = 0
        self._handled = 0
        self._overloaded = 0
        self._answered_by_caller = 0
        self._internal_errors = 0

    # -- entry points --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the inbox; each request is its own task in the handler nursery."""
        async with trio.open_nursery() as handlers:
            handlers.start_soon(self._warn.run)  # flushes aggregated hot-path warnings when due
            task_status.started()
            async for job in self._receive:
                handlers.start_soon(self._handle, job)

    async def route(self, request: RouteRequest) -> RouteDecision:
        """Always returns a decision, at the latest a few ms past the request's deadline."""
        now = trio.current_time()
        deadline = request_deadline(request, now, self._config.router.budget_cap_ms)
        reply = _Reply()
        try:
            self._send.send_nowait(_Job(request, now, deadline, reply))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self._overloaded += 1
            decision = self._domain(request, None, Reason.OVERLOADED, now, {})
            self._metrics.emit(DecisionMade(decision))
            return decision
        depth = self._send.statistics().current_buffer_used
        self._peak = max(self._peak, depth)
        with trio.move_on_at(deadline + _GRACE_S):
            await reply.event.wait()
        if reply.decision is not None:
            return reply.decision
        # The handler could not answer in time (crashed or starved): answer here, never lose it.
        self._answered_by_caller += 1
        decision = self._domain(request, None, Reason.DEADLINE, now, {})
        self._metrics.emit(DecisionMade(decision))
        return decision

    def health(self) -> RouterHealth:
        return RouterHealth(
            inbox_depth=self._send.statistics().current_buffer_used,
            inbox_capacity=self._capacity,
            inbox_peak=self._peak,
            in_flight=self._in_flight,
            handled=self._handled,
            overloaded=self._overloaded,
            answered_by_caller=self._answered_by_caller,
            internal_errors=self._internal_errors,
            kvcm_fallback=self._kvcm_enabled,
        )

    def inbox_depth(self) -> int:
        return self._send.statistics().current_buffer_used

    # -- one request -----------------------------------------------------------------------------

    async def _handle(self, job: _Job) -> None:
        self._in_flight += 1
        stages: dict[str, float] = {}
        answer = _KvcmAnswer()
        decision: RouteDecision | None = None
        try:
            with trio.CancelScope(deadline=job.deadline):
                decision = await self._pipeline(job, stages, answer)
        except Exception as exc:  # one request's bug must not take the router down: answer and count it
            self._internal_errors += 1
            log.exception("route pipeline failed request_id=%s", job.request.request_id)
            decision = self._domain(
                job.request,
                None,
                Reason.INTERNAL_ERROR,
                job.received_at,
                stages,
                error=f"internal error: {exc!r}",
            )
        finally:
            self._in_flight -= 1
        if decision is None:
            decision = self._domain(job.request, None, Reason.DEADLINE, job.received_at, stages)
        job.reply.decision = decision
        job.reply.event.set()
        self._handled += 1
        self._metrics.emit(DecisionMade(decision))
        if answer.hosts is not None:
            # Observability only, so after the reply: no await since the decision, so the shadow
            # index has not yet applied this request's own record.
            shadow_view = self._shadow.match(answer.keys, trio.current_time(), limit=self._config.scorer.hot_set_size)
            self._metrics.emit(ShadowAgreement(agreement(answer.hosts, shadow_view)))

    async def _pipeline(self, job: _Job, stages: dict[str, float], answer: _KvcmAnswer) -> RouteDecision:
        request = job.request
        t = trio.current_time()
        try:
            prepared = prepare_request(request, self._deployment, hash_tokens=self._kvcm_enabled)
        except BadRequest as exc:
            return self._domain(request, None, Reason.BAD_REQUEST, job.received_at, stages, error=str(exc))
        stages["keys"] = _ms(trio.current_time() - t)
        if not self._kvcm_enabled:
            return self._domain(request, prepared, Reason.FEATURE_OFF, job.received_at, stages)

        budget = max(0.0, job.deadline - job.received_at)
        reserve = max(self._config.router.reserve_min_ms / 1000.0, self._config.router.reserve_fraction * budget)
        decide_at = job.deadline - reserve

        hosts, failure = await self._query_kvcm(request, prepared, decide_at, stages, answer)
        source = RouteSource.KVCM
        if failure is not None:
            now = trio.current_time()
            hosts = self._shadow.match(prepared.keys, now, limit=self._config.scorer.hot_set_size)
            if not hosts:
                self._warn.note(failure.value, now)
                return self._domain(request, prepared, failure, job.received_at, stages)
            source = RouteSource.SHADOW
        return await self._score(job, prepared, hosts, source, failure, decide_at, stages)

    async def _query_kvcm(
        self,
        request: RouteRequest,
        prepared: PreparedRequest,
        decide_at: float,
        stages: dict[str, float],
        answer: _KvcmAnswer,
    ) -> tuple[tuple[HostMatch, ...], Reason | None]:
        """The KVCM answer's hosts, or the reason KVCM could not help this request."""
        resolver, kvcm = self._resolver, self._kvcm
        assert resolver is not None and kvcm is not None
        if not prepared.keys:
            return (), Reason.NO_POSITIVE_MATCH
        admission = resolver.admit()
        if admission is Admission.REJECT:
            return (), Reason.BREAKER_OPEN
        trial = admission is Admission.TRIAL
        t = trio.current_time()
        leader = resolver.cached_leader()  # the common case: known, no wait and no scope needed
        if leader is None:
            with trio.move_on_at(decide_at):
                try:
                    leader = await resolver.leader()
                except LeaderUnavailable as exc:
                    if trial:
                        resolver.release_kvcm_trial()
                    stages["leader"] = _ms(trio.current_time() - t)
                    no_leader = exc.reason in (UnavailableReason.NO_LEADER, UnavailableReason.NO_BOOTSTRAP)
                    return (), Reason.NO_LEADER if no_leader else Reason.KVCM_ERROR
        stages["leader"] = _ms(trio.current_time() - t)
        if leader is None:
            if trial:
                resolver.release_kvcm_trial()
            return (), Reason.DEADLINE
        if leader.target != self._last_leader:
            self._last_leader = leader.target
            self._metrics.emit(LeaderChanged(leader.target))

        t = trio.current_time()
        query = CacheQuery(
            instance_id=self._deployment.kvcm_instance_id,
            query_type=self._deployment.query_type,
            block_keys=prepared.keys,
            trace_id=request.request_id,
            p2p_host_count=self._deployment.p2p_host_count,
        )
        query_deadline = min(decide_at, t + self._config.router.kvcm_query_timeout_ms / 1000.0)
        error: TransportError | None = None
        state = None
        with trio.move_on_at(query_deadline):
            try:
                state = await kvcm.get_host_cache_state(leader.target, query)
            except TransportError as exc:
                error = exc
        stages["cache_query"] = _ms(trio.current_time() - t)
        if state is None and error is None:
            error = DeadlineExceeded(leader.target, "GetHostCacheState did not answer within the request's budget")
        judged = resolver.record_kvcm(error, trial=trial, given_s=query_deadline - t)
        if error is not None:
            if judged:  # a query cut short by a tight budget does not make the leader suspect
                resolver.report_failure(leader.target, error)
            self._metrics.emit(KvcmRequest("GetHostCacheState", error.kind))
            return (), Reason.DEADLINE if isinstance(error, DeadlineExceeded) else Reason.KVCM_ERROR
        assert state is not None
        positive = tuple(h for h in state.hosts if h.local >= 1 or h.p2p_total >= 1)
        self._metrics.emit(KvcmRequest("GetHostCacheState", "ok" if positive else "no_positive_match"))
        answer.hosts, answer.keys = positive, prepared.keys
        if not positive:
            return (), Reason.NO_POSITIVE_MATCH
        return positive, None

    async def _score(
        self,
        job: _Job,
        prepared: PreparedRequest,
        hosts: Sequence[HostMatch],
        source: RouteSource,
        failure: Reason | None,
        decide_at: float,
        stages: dict[str, float],
    ) -> RouteDecision:
        request = job.request
        t = trio.current_time()
        fleet = self._current_fleet()
        plan = plan_candidates(
            hosts,
            fleet,
            request_id=request.request_id,
            namespace=self._deployment.kvcm_instance_id,
            config=self._config.scorer,
            hot_source=CandidateSource.HOT if source is RouteSource.KVCM else CandidateSource.SHADOW,
            ejected=self._prober.ejected(),  # an ejected holder takes no hot slot
        )
        stages["plan"] = _ms(trio.current_time() - t)

        t = trio.current_time()
        handle = self._prober.probe([c.worker for c in plan.candidates], decide_at)
        if handle.pending:  # all fresh from the cache (the warm case): nothing to wait for
            with trio.move_on_at(decide_at):
                await handle.wait_all()
        statuses: dict[WorkerAddr, ObservedStatus] = {}
        missing: dict[WorkerAddr, DropReason] = {}
        cache_hits = 0
        skipped: dict[str, int] = {}
        for result in handle.results():
            worker = result.worker
            if result.status is not None and result.observed_at is not None:
                cache_hits += result.from_cache
                statuses[worker] = self._scorer.observe(worker, result.status, result.observed_at)
                continue
            if result.outcome is ProbeOutcome.SKIPPED and result.skip_reason is not None:
                skipped[result.skip_reason.value] = skipped.get(result.skip_reason.value, 0) + 1
            observed = self._prober.cached_observed(worker)  # an older, still usable status in hand
            if observed is not None:
                statuses[worker] = self._scorer.observe(worker, *observed)
            elif result.outcome is ProbeOutcome.SKIPPED and result.skip_reason is not None:
                missing[worker] = _SKIP_DROPS[result.skip_reason]
            elif result.outcome is ProbeOutcome.FAILED:
                missing[worker] = DropReason.PROBE_FAILED
        if cache_hits:
            self._metrics.emit(StatusCacheHits(cache_hits))
        for reason, n in skipped.items():
            self._metrics.emit(ProbeSkipped(reason, n))
        stages["probe"] = _ms(trio.current_time() - t)

        t = trio.current_time()
        selection = self._scorer.decide(
            plan,
            statuses,
            seq_len=prepared.seq_len,
            block_size=prepared.block_size,
            now=t,
            roles=prepared.roles,
            missing=missing,
        )
        stages["score"] = _ms(trio.current_time() - t)
        if selection.worker is None:
            return self._domain(request, prepared, failure or Reason.NO_CANDIDATES, job.received_at, stages)
        self._record_shadow(selection.worker, prepared.keys, t)
        return self._finish(
            request,
            job.received_at,
            stages,
            worker=selection.worker,
            role=selection.role,
            source=source,
            reason=selection.reason,
            hit_tokens=selection.hit_tokens,
            local_blocks=selection.local_blocks,
            candidates=selection.explain(),
        )

    def _record_shadow(self, worker: WorkerAddr, keys: Sequence[int], now: float) -> None:
        if not self._shadow.record_nowait(worker.http_target, keys, now):
            self._metrics.emit(ShadowRecordDropped())

    # -- domain fallback -------------------------------------------------------------------------

    def _current_fleet(self) -> Fleet:
        snapshot = self._discovery.workers()
        if snapshot.version != self._fleet_version:
            self._fleet = Fleet.of(snapshot.workers)
            self._fleet_version = snapshot.version
            self._prober.retain(snapshot.workers)
        return self._fleet

    def _domain(
        self,
        request: RouteRequest,
        prepared: PreparedRequest | None,
        reason: Reason,
        received_at: float,
        stages: dict[str, float],
        *,
        error: str | None = None,
    ) -> RouteDecision:
        """A random healthy worker from discovery: what a frontend without kvroute does.

        With the fallback on, a worker the prober knows to be ejected or failing is skipped
        (a few bounded redraws); with it off, the draw is plain uniform, exactly as before.
        """
        workers = self._current_fleet().workers
        if not workers:
            return self._finish(
                request,
                received_at,
                stages,
                worker=None,
                role=None,
                source=RouteSource.NONE,
                reason=Reason.NO_WORKERS,
                error=error or "discovery has no worker: nothing to route to",
            )
        worker = workers[self._rng.randrange(len(workers))]
        if self._kvcm_enabled:
            for _ in range(3):  # prefer a worker with a valid status and not ejected; bounded redraws
                if self._prober.is_routable(worker):
                    break
                worker = workers[self._rng.randrange(len(workers))]
        status = self._prober.cached(worker)
        roles = prepared.roles if prepared is not None else self._deployment.roles
        role = status.role if status is not None and status.role in roles else roles[0]
        if prepared is not None:
            self._scorer.record(worker, prepared.seq_len, trio.current_time())
            if self._kvcm_enabled:
                self._record_shadow(worker, prepared.keys, trio.current_time())
        return self._finish(
            request,
            received_at,
            stages,
            worker=worker,
            role=role,
            source=RouteSource.DOMAIN,
            reason=reason,
            error=error,
        )

    def _finish(
        self,
        request: RouteRequest,
        received_at: float,
        stages: dict[str, float],
        *,
        worker: WorkerAddr | None,
        role: Role | None,
        source: RouteSource,
        reason: Reason,
        hit_tokens: int = 0,
        local_blocks: int = 0,
        candidates: tuple[CandidateExplain, ...] = (),
        error: str | None = None,
    ) -> RouteDecision:
        elapsed = _ms(trio.current_time() - received_at)
        stages["total"] = elapsed
        return RouteDecision(
            request_id=request.request_id,
            worker=worker,
            role=role,
            route_source=source,
            reason=reason,
            hit_tokens=hit_tokens,
            local_blocks=local_blocks,
            elapsed_ms=elapsed,
            stage_ms=stages,
            candidates=candidates,
            error=error,
        )


def _ms(seconds: float) -> float:
    return seconds * 1000.0
