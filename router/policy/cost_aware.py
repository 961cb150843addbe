"""CostAware: CacheAffinityFirst's steps over a cost that prices what a choice does to the fleet.

Pure: values in, values out; time is passed in. Per candidate that passes the same filters
(:func:`~router.policy.cache_affinity.filter_candidate`):

- work (tokens to prefill before this request's first token, as CacheAffinityFirst counts it):
  outstanding uncached tokens + the ledger's pre-charge since the status was taken + (seq_len − hit);
- fixed cost: ``request_cost_tokens`` for this request and for each task waiting ahead of it
  (a request costs a scheduling step whatever its length; the ledger's pre-charge carries it too);
- copy price: ``copy_cost_weight`` × pressure × (the best hit among the candidates − this one's
  hit). A candidate holding less of the prompt than another would prefill that prefix again
  (counted in its work) and store a second copy, which evicts other prefixes that later requests
  then prefill again: that eviction is what the weight prices. The pressure (:func:`copy_pressure`)
  scales it with the least loaded candidate's queue: an eviction costs queueing only once no
  candidate is idle.

cost = work + fixed cost + copy price. The orders, the guard, the minimum-hit gate and the
extra-work bound are CacheAffinityFirst's (:func:`~router.policy.cache_affinity.choose`) over
the cost: with both prices zero and no near-tie spreading it chooses from a plan exactly as
CacheAffinityFirst does.

Its cold set is ``cost_aware_cold_set_size`` workers (``cold_set_size`` is CacheAffinityFirst's):
a priced copy is made only when it pays, so looking wider for an idle worker finds more of them
without spreading prefixes further.

Near-tie spreading (``near_tie_tokens`` > 0): routers that share nothing read the same statuses
between refreshes and would all take the same cheapest worker. The candidates whose cost is within
the margin of the preferred one's, holding as much of the prompt, are near-ties; of them, the two
with the lowest tie draws (a random pair) are compared and the cheaper taken (the power of two
choices). The draws are the
per-candidate tie draws the decision already made, so a replay that hands them back chooses
identically.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from router.config import DeploymentConfig, ScorerConfig
from router.policy.base import PolicyHealth
from router.policy.cache_affinity import (
    ObservedStatus,
    PassedRow,
    ScoreSheet,
    Selection,
    StatusViews,
    TtftRow,
    choose,
    claim_order,
    filter_candidate,
    hit_tokens,
    orders,
    scorer_problems,
)
from router.policy.ledger import SelectionLedger
from router.policy.plan import CandidatePlan, CandidateSource, Fleet, plan_candidates
from router.problems import Problem, refuse
from router.types import PREFILL_CAPABLE_ROLES, DropReason, HostMatch, Reason, Role, WorkerAddr, WorkerStatus

# The guard's fallbacks are not spread: they are the least bad of workers already over the threshold.
_SPREAD_REASONS = frozenset({Reason.CACHE_LEADER, Reason.SHORTEST_TTFT, Reason.SHORTEST_TTFT_LOW_CACHE_HIT})


def candidate_cost(work: int, waiting: int, hit: int, best_hit: int, pressure: float, *, config: ScorerConfig) -> int:
    """A candidate's cost in tokens: its work, the fixed cost of this request and of the ``waiting``
    tasks ahead, and the price of copying the ``best_hit − hit`` tokens another candidate holds,
    scaled by the fleet's ``pressure`` (0..1, :func:`copy_pressure`)."""
    fixed = config.request_cost_tokens * (waiting + 1)
    copy = round(config.copy_cost_weight * pressure * max(0, best_hit - hit))
    return work + fixed + copy


def copy_pressure(least_load: int, seq_len: int) -> float:
    """How much an eviction costs now, 0..1: the least loaded candidate's queued work (outstanding
    and pre-charged tokens) over this request's length. While a candidate is idle, the prefixes a
    copy evicts are prefilled again on idle capacity, delaying no one else; once even the least
    loaded candidate has a request's worth queued, every re-prefill waits behind work."""
    if least_load <= 0:
        return 0.0
    return min(1.0, least_load / max(1, seq_len))


def spread_near_ties(preferred: int, eligible: Sequence[TtftRow], margin: int, hits: Sequence[int]) -> int:
    """The power of two choices among the near-ties of ``preferred`` (plan index): the eligible rows
    with the same hit whose cost is within ``margin`` of the preferred one's (spreading never makes
    a copy). Of the two with the lowest tie draws the cheaper is taken (then the lower draw);
    ``preferred`` itself when it has no near-tie."""
    if margin <= 0:
        return preferred
    cost = next((row[0] for row in eligible if row[3] == preferred), None)
    if cost is None:
        return preferred
    hit = hits[preferred]
    near = [row for row in eligible if abs(row[0] - cost) <= margin and hits[row[3]] == hit]
    if len(near) < 2:
        return preferred
    first, second = sorted(near, key=lambda row: row[2])[:2]
    return min(first, second, key=lambda row: (row[0], row[2]))[3]


def score_costs(
    plan: CandidatePlan,
    statuses: Mapping[WorkerAddr, ObservedStatus],
    ledger: SelectionLedger,
    *,
    config: ScorerConfig,
    roles: Collection[Role],
    seq_len: int,
    block_size: int,
    lookahead_tokens: int | None,
    tie_rng: random.Random,
    missing: Mapping[WorkerAddr, DropReason] | None = None,
) -> Selection:
    """CostAware over one plan (see the module docstring). Reads the ledger; changes nothing but
    ``tie_rng``'s state. ``work_tokens`` in the selection and the explanation is the work (no prices)."""
    if seq_len < 0:
        raise ValueError(f"seq_len: must be >= 0, got {seq_len}")
    candidates = plan.candidates
    n = len(candidates)
    hits = [0] * n
    works: list[int | None] = [None] * n
    drops: list[DropReason | None] = [None] * n
    observed_by_index: list[ObservedStatus | None] = [None] * n
    drop_totals: dict[DropReason, int] = {}
    for explained in plan.dropped:
        if explained.dropped is not None:
            plan_drop = DropReason(explained.dropped)
            drop_totals[plan_drop] = drop_totals.get(plan_drop, 0) + 1

    scored: list[tuple[str, int, int, float, int, int]] = []  # (target, index, work, last selected, hit, waiting)
    for index, (worker, target, match, _) in enumerate(candidates):
        hit = hits[index] = hit_tokens(match, block_size, seq_len, config.p2p_hit_discount)
        observed = observed_by_index[index] = statuses.get(worker)
        drop: DropReason | None
        if observed is None:
            drop = DropReason.NO_STATUS if missing is None else missing.get(worker, DropReason.NO_STATUS)
        else:
            drop = filter_candidate(
                observed,
                roles=roles,
                queue_threshold=config.prefill_queue_size_threshold,
                block_size=block_size,
                lookahead_tokens=lookahead_tokens,
            )
        if drop is None:
            assert observed is not None
            pending, last_selected = ledger.view(target, observed.taken_at)
            work = works[index] = observed.outstanding_uncached_tokens + pending + (seq_len - hit)
            scored.append((target, index, work, last_selected, hit, observed.waiting_count))
        else:
            drops[index] = drop
            drop_totals[drop] = drop_totals.get(drop, 0) + 1
    drop_counts = tuple(sorted(drop_totals.items(), key=lambda item: item[0].value))

    if not scored:
        return Selection(
            worker=None,
            role=None,
            reason=Reason.NO_CANDIDATES,
            hit_tokens=0,
            local_blocks=0,
            work_tokens=0,
            uncached_tokens=0,
            status_taken_at=None,
            drop_counts=drop_counts,
            sheet=ScoreSheet(plan, hits, works, drops, observed_by_index, None, tuple),
        )

    best_hit = max(row[4] for row in scored)
    pressure = copy_pressure(min(work - (seq_len - hit) for _, _, work, _, hit, _ in scored), seq_len)
    passed: list[PassedRow] = [
        (target, index, candidate_cost(work, waiting, hit, best_hit, pressure, config=config), last_selected, hit)
        for target, index, work, last_selected, hit, waiting in scored
    ]
    cost_order, leader_order = orders(passed, tie_rng)
    preferred, reason, eligible = choose(cost_order, leader_order, hits, seq_len=seq_len, config=config)
    if reason in _SPREAD_REASONS and config.near_tie_tokens > 0:
        # A near-tie has the preferred one's hit, so the reason stands.
        preferred = spread_near_ties(preferred, eligible, config.near_tie_tokens, hits)
    max_extra = max(0, config.max_extra_work_tokens)
    chosen_index = preferred

    def claim() -> tuple[tuple[WorkerAddr, Reason], ...]:
        return claim_order(candidates, chosen_index, eligible, hits, leader_order, cost_order, max_extra)

    chosen = candidates[preferred]
    chosen_observed = observed_by_index[preferred]
    chosen_work = works[preferred]
    assert chosen_observed is not None and chosen_work is not None
    return Selection(
        worker=chosen.worker,
        role=chosen_observed.status.role,
        reason=reason,
        hit_tokens=hits[preferred],
        local_blocks=0 if chosen.match is None else chosen.match.local,
        work_tokens=chosen_work,
        uncached_tokens=seq_len - hits[preferred],
        status_taken_at=chosen_observed.taken_at,
        drop_counts=drop_counts,
        sheet=ScoreSheet(plan, hits, works, drops, observed_by_index, preferred, claim, cost_order, seq_len),
    )


class CostAware:
    """The cost-aware policy: its selection ledger, tie-break RNG and per-status scoring views.

    Like CacheAffinityFirst it holds state but does no I/O and reads no clock; the Scorer actor
    owns the one instance. Its pre-charge carries a request's fixed cost as well as its tokens.
    """

    name = "cost_aware"

    def __init__(
        self,
        config: ScorerConfig,
        deployment: DeploymentConfig,
        *,
        tie_rng: random.Random | None = None,
        ledger: SelectionLedger | None = None,
    ) -> None:
        refuse("scorer", scorer_problems(config))
        if not deployment.roles:
            refuse("deployment", [Problem(("roles",), "the deployment routes to no role")])
        self.config = config
        self.deployment = deployment
        self._plan_config = replace(config, cold_set_size=config.cost_aware_cold_set_size)
        self.ledger = (
            SelectionLedger(config.max_tracked_workers, config.max_pending_charges) if ledger is None else ledger
        )
        self._prefill_roles = tuple(r for r in deployment.roles if r in PREFILL_CAPABLE_ROLES)
        self._tie_rng = random.Random(config.seed) if tie_rng is None else tie_rng
        self._observed = StatusViews(config.max_tracked_workers)

    def plan(
        self,
        hosts: Sequence[HostMatch],
        fleet: Fleet,
        *,
        request_id: str,
        source: CandidateSource,
        ejected: Collection[WorkerAddr],
    ) -> CandidatePlan:
        return plan_candidates(
            hosts,
            fleet,
            request_id=request_id,
            namespace=self.deployment.kvcm_instance_id,
            config=self._plan_config,
            hot_source=source,
            ejected=ejected,
        )

    def observe(self, worker: WorkerAddr, status: WorkerStatus, taken_at: float) -> ObservedStatus:
        """The scoring view of a status in hand (:class:`StatusViews`)."""
        return self._observed.observe(worker, status, taken_at)

    def decide(
        self,
        plan: CandidatePlan,
        statuses: Mapping[WorkerAddr, ObservedStatus],
        *,
        seq_len: int,
        block_size: int,
        now: float,
        roles: Collection[Role] | None = None,
        missing: Mapping[WorkerAddr, DropReason] | None = None,
    ) -> Selection:
        """Score ``plan`` by cost and record the selection (its tokens and fixed cost) at ``now``."""
        selection = score_costs(
            plan,
            statuses,
            self.ledger,
            config=self.config,
            roles=self._prefill_roles if roles is None else roles,
            seq_len=seq_len,
            block_size=block_size,
            lookahead_tokens=self.deployment.lookahead_tokens,
            tie_rng=self._tie_rng,
            missing=missing,
        )
        if selection.worker is not None:
            self.ledger.record(
                plan.candidates[selection.sheet.chosen_index].target,
                selection.uncached_tokens + self.config.request_cost_tokens,
                now,
                status_taken_at=selection.status_taken_at,
            )
        return selection

    def record(
        self, worker: WorkerAddr, uncached_tokens: int, now: float, status_taken_at: float | None = None
    ) -> None:
        """Charge a dispatch the policy did not decide (its tokens and fixed cost) to the ledger."""
        self.ledger.record(worker.http_target, uncached_tokens + self.config.request_cost_tokens, now, status_taken_at)

    def health(self) -> PolicyHealth:
        return PolicyHealth(
            policy=self.name,
            tracked_workers=len(self.ledger),
            pending_charges=self.ledger.pending_charges(),
            observed_statuses=len(self._observed),
        )
