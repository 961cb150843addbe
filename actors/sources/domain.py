"""The domain source: a random routable worker from discovery, what a frontend without kvroute does.

It always answers, or ends the request with ``no_workers`` (discovery has none) or
``no_candidates`` (no discovered worker can take it: unreachable, not alive, another role), so it is the last link of
every chain, and the router's own answer when a request cannot walk the chain at all (bad
request, overloaded, deadline, internal error).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import trio

from actors.scorer import Scorer
from actors.sources.base import Answered, Ended, FleetView, RequestContext, SourceResult
from actors.worker_prober import WorkerProber
from router.config import KvrouteConfig
from router.request import PreparedRequest
from router.types import PREFILL_CAPABLE_ROLES, Reason, Role, RouteDecision, RouteSource, WorkerAddr

_REDRAWS = 3  # random draws for a routable worker before scanning the fleet for one
# Workers looked at in turn, after the draws, for one whose status the prober holds, before a
# routable worker of unknown role (no fresh status: at start-up, or a large fleet whose health
# probes come round less often than statuses expire) is taken. Unbounded, a pick would walk the
# whole fleet whenever most statuses are stale; the full walk is left for finding any routable one.
_KNOWN_SCAN = 64

ROUTE_BLIND_HINT = "--route-blind routes to them anyway"


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
    ) -> None:
        self._roles = tuple(r for r in config.deployment.roles if r in PREFILL_CAPABLE_ROLES)
        self._fleet = fleet
        self._prober = prober
        self._scorer = scorer
        self._route_blind = config.router.route_blind
        self._rng = random.Random(config.scorer.seed)

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        return self.pick(ctx.prepared, ctx.fallthrough or Reason.FEATURE_OFF)

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        return None

    def charge(self, worker: WorkerAddr, tokens: int, requests: int = 1) -> None:
        """Charge ``requests`` sent to ``worker``, ``tokens`` in all, answered ``overloaded`` (drawn
        here, ahead or not); never blocks, dropped when the Scorer's room for them is full."""
        if requests > 0:
            self._scorer.charge_nowait(worker, tokens, trio.current_time(), requests=requests)

    def pick(
        self,
        prepared: PreparedRequest | None,
        reason: Reason,
        error: str | None = None,
        *,
        rng: random.Random | None = None,
        roles: tuple[Role, ...] | None = None,
    ) -> Answered | Ended:
        """A random routable worker, synchronously (no await: usable when no time is left).

        A worker the prober knows to be unreachable (ejected, or its last probe refused), to say it is
        not alive (a status younger than ``max_status_age_s``) or to serve none of the request's roles
        is not drawn; what the prober knows comes from its
        cache (request probes and background health probes), never from a probe made here. With
        none left the request ends ``no_candidates`` naming why, unless the operator chose to
        route blind: then reachability and liveness are ignored, the role is not (``_draw_blind``).
        The answer's role is the worker's last reported one, else the first of ``roles``. ``rng``: draw
        from it instead of the source's own generator. ``roles``: the request's, when it has no
        ``prepared`` form (else the deployment's).
        """
        workers = self._fleet.workers()
        if not workers:
            if reason is Reason.BAD_REQUEST:  # the caller's mistake comes first
                return Ended(reason, f"{error}; discovery has no worker either")
            return Ended(Reason.NO_WORKERS, error or "discovery has no worker: nothing to route to")
        if prepared is not None:
            roles = prepared.roles
        elif roles is None:
            roles = self._roles
        worker = self._draw(workers, roles, self._rng if rng is None else rng)
        if worker is None:
            why = f"{self._prober.unroutable_reason(workers, roles) or 'no routable worker'}; {ROUTE_BLIND_HINT}"
            if reason is Reason.BAD_REQUEST:
                return Ended(reason, f"{error}; {why}")  # the caller's mistake comes first
            return Ended(Reason.NO_CANDIDATES, f"{why} (after {reason.value}{f': {error}' if error else ''})")
        # Labelled by its last reported role, which its routability was judged by: a status too old
        # to score with (or followed by one failed probe) still says what the worker serves. Only a
        # blind draw from a fleet none of whose workers may serve the roles gives one of another role.
        reported = self._prober.reported_role(worker)
        role = roles[0] if reported is None else reported
        if prepared is not None:
            self._scorer.record_nowait(worker, prepared.seq_len, trio.current_time())
        return Answered(worker=worker, role=role, reason=reason, error=error)

    def _draw(self, workers: Sequence[WorkerAddr], roles: tuple[Role, ...], rng: random.Random) -> WorkerAddr | None:
        """A uniformly drawn worker that is routable and reports one of ``roles``.

        A worker the prober has no status for yet (start-up) is routable but its role is unknown:
        it is taken only when no worker known to serve the roles is found among the draws and the
        next ``_KNOWN_SCAN`` workers, so the answer's role label is what the worker reported whenever
        the prober knows it. A few random draws first, then a scan from a random start (to its end
        only when no routable worker has been seen).
        """
        if self._route_blind:
            return self._draw_blind(workers, roles, rng)
        unknown: WorkerAddr | None = None
        give_up_at = -1  # where the look for a known one ends, once a routable unknown one is seen
        for looked, worker in enumerate(self._search_order(workers, rng)):
            if self._prober.is_routable(worker, roles):
                if self._prober.cached(worker) is not None:
                    return worker
                if unknown is None:
                    unknown = worker
                    give_up_at = max(looked, _REDRAWS) + _KNOWN_SCAN
            if looked == give_up_at:
                break
        return unknown

    def _draw_blind(self, workers: Sequence[WorkerAddr], roles: tuple[Role, ...], rng: random.Random) -> WorkerAddr:
        """A worker drawn whatever the prober knows of its reachability and liveness, but not of its
        role: one that may serve ``roles`` (its last reported role one of them, or none reported yet),
        in the order of ``_search_order``; any worker, uniformly, only when none may."""
        for worker in self._search_order(workers, rng):
            reported = self._prober.reported_role(worker)
            if reported is None or reported in roles:
                return worker
        return workers[rng.randrange(len(workers))]

    def _search_order(self, workers: Sequence[WorkerAddr], rng: random.Random) -> Iterator[WorkerAddr]:
        """A few uniform draws, then every worker once from a random start (drawn only if reached)."""
        n = len(workers)
        for _ in range(_REDRAWS + 1):
            yield workers[rng.randrange(n)]
        start = rng.randrange(n)
        for i in range(n):
            yield workers[(start + i) % n]
