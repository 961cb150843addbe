"""The KVCM source: ask the KV Cache Manager's leader which workers hold the prompt's prefix,
then plan, probe and score those holders.

Admission goes through the KVCM breaker (open: fall through at once). The leader comes from the
resolver's cache without waiting in the common case; otherwise the lookup waits at most until
the split's leader window. The query is bounded by ``kvcm_query_timeout_ms`` and the split's query
window, whichever is first (the deadline split: router/policy/deadline_split.py). Every failure
falls through with its reason, so the next source (the shadow index) can stand in without
spending the rest of the budget.
"""

from __future__ import annotations

import math

import trio

from actors.breaker import Admission
from actors.leader_resolver import LeaderResolver, LeaderUnavailable, UnavailableReason
from actors.metrics_sink import CandidatesDropped, KvcmRequest, MetricsSink, ShadowAgreement
from actors.shadow_index import ShadowIndexActor
from actors.sources.base import FellThrough, RequestContext, SourceResult, ms
from actors.sources.scoring import CandidateScoring
from router.config import KvrouteConfig
from router.decision_record import KvcmAnswer
from router.logs import AggregatingLogger
from router.policy.plan import CandidateSource
from router.transport.errors import DeadlineExceeded, TransportError
from router.transport.ports import KvcmTransport
from router.types import CacheQuery, CacheState, DropReason, HostMatch, Reason, RouteDecision, RouteSource, Stage


class KvcmSource:
    kind = RouteSource.KVCM
    needs_keys = True

    def __init__(
        self,
        config: KvrouteConfig,
        *,
        resolver: LeaderResolver,
        kvcm: KvcmTransport,
        scoring: CandidateScoring,
        shadow: ShadowIndexActor,
        metrics: MetricsSink,
        warn: AggregatingLogger,
    ) -> None:
        self._deployment = config.deployment
        self._query_timeout_s = config.router.kvcm_query_timeout_ms / 1000.0
        self._hot_set_size = config.scorer.hot_set_size
        self._compare_every = config.metrics.shadow_compare_every
        # KVCM answers to pass before the next comparison: a count the requests' tasks step on the trio
        # thread with no await between its read and its write, as the domain source's draws are.
        self._answers_until_compare = 0
        self._resolver = resolver
        self._kvcm = kvcm
        self._scoring = scoring
        self._shadow = shadow
        self._metrics = metrics
        self._warn = warn

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline  # it stops each wait at the split's window by itself, and decides in the reserve

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        started = trio.current_time()
        hosts = await self._query(ctx)
        if ctx.record is not None:
            r = ctx.record.received_at
            answered = ctx.cache_hosts if isinstance(hosts, FellThrough) else hosts
            why = hosts.reason if isinstance(hosts, FellThrough) else None
            ctx.record.kvcm = KvcmAnswer(started - r, trio.current_time() - r, answered, why)
        if isinstance(hosts, FellThrough):
            return hosts
        ctx.cache_hosts = hosts
        return await self._scoring.choose(ctx, hosts, CandidateSource.HOT)

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        if ctx.cache_hosts is None or not ctx.prepared.keys:  # no answer, or none asked: nothing to compare
            return
        if self._answers_until_compare:
            self._answers_until_compare -= 1
            return
        self._answers_until_compare = self._compare_every - 1
        # How well the shadow index would have answered: no await since the decision, so the shadow
        # index has not yet applied this request's own record.
        ratio, error_tokens = self._shadow.compare(
            ctx.cache_hosts, ctx.prepared.keys, trio.current_time(), self._hot_set_size, ctx.prepared.block_size
        )
        ctx.events.append(ShadowAgreement(ratio, error_tokens))

    def _release_unreported(self, trial: bool) -> None:
        """The request left (cancelled by its caller, or its own deadline's scope took the wait's
        cancellation) before the outcome was recorded: a trial admitted for it must not hold the
        breaker's trial slot until the slot times out."""
        if trial:
            self._resolver.release_kvcm_trial()

    async def _query(self, ctx: RequestContext) -> tuple[HostMatch, ...] | FellThrough:
        """KVCM's positive hosts, or why KVCM could not help this request."""
        resolver = self._resolver
        if not ctx.prepared.keys:  # no whole block: nobody holds any of it, known without asking
            ctx.cache_hosts = ()  # as KVCM's own empty answer: the load decides (the shadow's cold set)
            return FellThrough(Reason.NO_POSITIVE_MATCH)
        admission = await resolver.admit(ctx.decide_at)
        if admission is Admission.REJECT:
            return FellThrough(Reason.BREAKER_OPEN)
        trial = admission is Admission.TRIAL
        t = trio.current_time()
        leader = resolver.cached_leader()  # the common case: known, no wait and no scope needed
        if leader is None:
            failure: LeaderUnavailable | None = None
            leader_end = ctx.split.windows.leader_end
            try:
                with trio.move_on_at(leader_end) as waiting:
                    try:
                        leader = await resolver.leader()
                    except LeaderUnavailable as exc:
                        failure = exc
            except BaseException:
                self._release_unreported(trial)
                raise
            ctx.split.waited(Stage.LEADER, waiting.cancelled_caught)
            ctx.stages[Stage.LEADER] = ms(trio.current_time() - t)
            if leader is None:
                # A leader not found is a KVCM failure for the breaker (a fast failure and a wait a
                # tight budget cut short are not judged), so a KVCM that stops answering opens it
                # and later requests stop paying the wait.
                resolver.record_leader_miss(failure, trial=trial, given_s=leader_end - t, started_at=t)
                if failure is None:
                    return FellThrough(Reason.DEADLINE)
                no_leader = failure.reason in (UnavailableReason.NO_LEADER, UnavailableReason.NO_BOOTSTRAP)
                return FellThrough(Reason.NO_LEADER if no_leader else Reason.KVCM_ERROR)
        ctx.stages[Stage.LEADER] = ms(trio.current_time() - t)

        t = trio.current_time()
        query = CacheQuery(
            instance_id=self._deployment.kvcm_instance_id,
            query_type=self._deployment.query_type,
            block_keys=ctx.prepared.keys,
            trace_id=ctx.request.request_id,
            p2p_host_count=self._deployment.p2p_host_count,
            encoded_keys=ctx.prepared.encoded_keys,
        )
        query_end = ctx.split.windows.query_end
        query_deadline = min(query_end, t + self._query_timeout_s)
        error: TransportError | None = None
        state: CacheState | None = None
        answered = False

        def mark_answered() -> None:
            nonlocal answered
            answered = True

        try:
            with trio.move_on_at(query_deadline) as waiting:
                try:
                    state = await self._kvcm.get_host_cache_state(leader.target, query, on_answered=mark_answered)
                except TransportError as exc:
                    error = exc
        except BaseException:
            self._release_unreported(trial)
            raise
        by_budget = query_end <= query_deadline
        # Cut by the window whichever deadline fired first: the scope's, or the transport's own (a gRPC
        # timeout, or a call not sent because the window had already passed), which the scope never sees.
        cut = waiting.cancelled_caught or (isinstance(error, DeadlineExceeded) and trio.current_time() >= query_end)
        ctx.split.waited(Stage.CACHE_QUERY, cut and by_budget)
        ctx.stages[Stage.CACHE_QUERY] = ms(trio.current_time() - t)
        if state is None and error is None:
            bound = "the request's budget" if by_budget else "kvcm_query_timeout_ms"
            what = "answered, but its reply was not decoded" if answered else "did not answer"
            error = DeadlineExceeded(leader.target, f"GetHostCacheState {what} within {bound}")
        # Only a window the request's budget cut may be spared judging (when shorter than slow_query_ms
        # or than KVCM's answers recently took: record_kvcm): the configured timeout is the operator's
        # own bound on a healthy answer, however short. A reply that was in when the time
        # ran out (a large one waiting to be decoded, or this thread stalled) is not judged at all:
        # as a query given no time.
        given_s = query_deadline - t if by_budget else math.inf
        if answered and state is None:
            given_s = 0.0
        judged = resolver.record_kvcm(error, trial=trial, given_s=given_s, started_at=t)
        if error is not None:
            if judged:  # a query cut short by a tight budget does not make the leader suspect
                resolver.report_failure(leader.target, error)
            if not isinstance(error, DeadlineExceeded):
                # What KVCM said (a wrong instance id, say) reaches the log, not only a count: once per
                # interval, with the total of the rest.
                self._warn.note("kvcm_query_failed", trio.current_time(), str(error))
            ctx.events.append(KvcmRequest("GetHostCacheState", error.kind))
            return FellThrough(Reason.DEADLINE if isinstance(error, DeadlineExceeded) else Reason.KVCM_ERROR)
        assert state is not None
        if state.blank_hosts:  # never candidates, so never in the decision: counted here
            ctx.events.append(CandidatesDropped(DropReason.MALFORMED_HOST.value, state.blank_hosts))
        positive = tuple(h for h in state.hosts if h.local >= 1 or h.p2p_total >= 1)
        ctx.events.append(KvcmRequest("GetHostCacheState", "ok" if positive else "no_positive_match"))
        if not positive:
            ctx.cache_hosts = ()
            return FellThrough(Reason.NO_POSITIVE_MATCH)
        return positive
