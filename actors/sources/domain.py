"""The domain source: a random routable worker from discovery, what a frontend without kvroute does.

It always answers (or ends the request with ``no_workers`` when discovery has none), so it is the
last link of every chain, and the router's own answer when a request cannot walk the chain at
all (bad request, overloaded, deadline, internal error).
"""

from __future__ import annotations

import random

import trio

from actors.scorer import Scorer
from actors.sources.base import Answered, Ended, FleetView, RequestContext, SourceResult
from actors.worker_prober import WorkerProber
from router.config import KvrouteConfig
from router.request import PreparedRequest
from router.types import Reason, Role, RouteDecision, RouteSource

_REDRAWS = 3  # bounded redraws for a routable worker before taking the draw as it is


class DomainSource:
    kind = RouteSource.DOMAIN
    needs_keys = False

    def __init__(
        self,
        config: KvrouteConfig,
        *,
        fleet: FleetView,
        prober: WorkerProber,
        scorer: Scorer,
        avoid_unroutable: bool,
    ) -> None:
        self._roles = config.deployment.roles
        self._fleet = fleet
        self._prober = prober
        self._scorer = scorer
        self._avoid_unroutable = avoid_unroutable
        self._rng = random.Random(config.scorer.seed)

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        return self.pick(ctx.prepared, ctx.fallthrough or Reason.FEATURE_OFF)

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        return None

    def pick(self, prepared: PreparedRequest | None, reason: Reason, error: str | None = None) -> Answered | Ended:
        """A random healthy worker, synchronously (no await: usable when no time is left).

        With ``avoid_unroutable`` (the KVCM fallback on), a worker the prober knows to be ejected
        or failing is skipped (a few bounded redraws); without it the draw is plain uniform,
        exactly as a frontend without kvroute draws.
        """
        workers = self._fleet.workers()
        if not workers:
            return Ended(Reason.NO_WORKERS, error or "discovery has no worker: nothing to route to")
        worker = workers[self._rng.randrange(len(workers))]
        if self._avoid_unroutable:
            for _ in range(_REDRAWS):
                if self._prober.is_routable(worker):
                    break
                worker = workers[self._rng.randrange(len(workers))]
        status = self._prober.cached(worker)
        roles: tuple[Role, ...] = prepared.roles if prepared is not None else self._roles
        role = status.role if status is not None and status.role in roles else roles[0]
        if prepared is not None:
            self._scorer.record_nowait(worker, prepared.seq_len, trio.current_time())
        return Answered(worker=worker, role=role, reason=reason, error=error)
