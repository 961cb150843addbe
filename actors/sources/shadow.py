"""The shadow source: when no cache source named a holder of the prompt's prefix, the router-local
shadow index (what this router itself sent where) stands in for KVCM's answer.

It also keeps the index: every decision with a worker records (worker, keys) after the reply
(write-on-route), through the index actor's bounded inbox; a dropped record is counted.
"""

from __future__ import annotations

import trio

from actors.metrics_sink import MetricsSink, ShadowRecordDropped
from actors.shadow_index import ShadowIndexActor
from actors.sources.base import FellThrough, RequestContext, Skipped, SourceResult
from actors.sources.scoring import CandidateScoring
from router.config import KvrouteConfig
from router.logs import AggregatingLogger
from router.policy.plan import CandidateSource
from router.types import Reason, RouteDecision, RouteSource


def scores_unmatched(ctx: RequestContext, enabled: bool) -> bool:
    """Whether the shadow source, matching nothing, scores the cold set: KVCM answered that nobody
    holds the prompt (not that it failed), so affinity has nothing to keep and the load decides. A
    failing KVCM still degrades to the domain's draw at once."""
    return enabled and ctx.cache_hosts == ()


class ShadowSource:
    kind = RouteSource.SHADOW
    needs_keys = True

    def __init__(
        self,
        config: KvrouteConfig,
        *,
        shadow: ShadowIndexActor,
        scoring: CandidateScoring,
        metrics: MetricsSink,
        warn: AggregatingLogger,
    ) -> None:
        self._hot_set_size = config.scorer.hot_set_size
        self._score_unmatched = config.router.score_unmatched
        self._shadow = shadow
        self._scoring = scoring
        self._metrics = metrics
        self._warn = warn

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        if ctx.cache_hosts:
            return Skipped()  # a cache source named holders; standing in for it would only repeat it
        now = trio.current_time()
        # Records of workers that left or are ejected would fill the places of live holders.
        hosts = self._shadow.match(ctx.prepared.keys, now, limit=self._hot_set_size, usable=self._scoring.plannable())
        if ctx.record is not None:
            ctx.record.shadow_hosts = tuple(hosts)
        if not hosts:
            if scores_unmatched(ctx, self._score_unmatched):
                return await self._scoring.choose(ctx, (), CandidateSource.SHADOW)
            why = ctx.fallthrough or Reason.NO_POSITIVE_MATCH
            # Aggregated: the cache path failing is not one line per request.
            self._warn.note(
                why.value,
                now,
                "the shadow index matched no worker either: the domain source answers",
                request_id=ctx.request.request_id,
            )
            return FellThrough(why)
        return await self._scoring.choose(ctx, hosts, CandidateSource.SHADOW)

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        if decision.worker is None or decision.reason is Reason.BAD_REQUEST:
            return
        if not self._shadow.record_nowait(decision.worker.http_target, ctx.prepared.keys, trio.current_time()):
            self._metrics.emit(ShadowRecordDropped())
