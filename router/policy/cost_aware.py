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
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from router.config import DeploymentConfig, ScorerConfig
from router.policy.cache_affinity import FilteredPlan, LedgerPolicy, PassedRow, TtftRow, score
from router.policy.ledger import SelectionLedger
from router.types import Reason

# The guard's redirect (the shortest under the threshold) is spread as any shortest pick; its fallbacks
# are not: they are the least bad of workers already over the threshold.
SPREAD_REASONS = frozenset(
    {
        Reason.CACHE_LEADER,
        Reason.SHORTEST_TTFT,
        Reason.SHORTEST_TTFT_LOW_CACHE_HIT,
        Reason.SHORTEST_TTFT_OUTSTANDING_GUARD,
    }
)


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


def cost_rows(filtered: FilteredPlan, config: ScorerConfig, seq_len: int) -> list[PassedRow]:
    """The passed candidates with their cost (:func:`candidate_cost`) in the work's place."""
    passed = filtered.passed
    if not passed:
        return []
    observed = filtered.observed
    best_hit = filtered.best_hit
    pressure = copy_pressure(min(work - (seq_len - hit) for _, _, work, _, hit in passed), seq_len)
    ranked: list[PassedRow] = []
    for target, index, work, last_selected, hit in passed:
        status = observed[index]
        assert status is not None  # every passed candidate was scored on a status
        cost = candidate_cost(work, status.waiting_count, hit, best_hit, pressure, config=config)
        ranked.append((target, index, cost, last_selected, hit))
    return ranked


def respread_near_ties(
    preferred: int, reason: Reason, eligible: list[TtftRow], filtered: FilteredPlan, config: ScorerConfig
) -> int:
    """Near-tie spreading (:func:`spread_near_ties`) of a choice whose reason allows it: a near-tie
    has the preferred one's hit, so the reason stands."""
    if reason not in SPREAD_REASONS:
        return preferred
    return spread_near_ties(preferred, eligible, config.near_tie_tokens, filtered.hits)


# CostAware over one plan (the module docstring): CacheAffinityFirst's steps over the cost, then
# near-tie spreading. ``work_tokens`` in the selection and the explanation is the work (no prices).
score_costs = partial(score, rank=cost_rows, respread=respread_near_ties)


class CostAware(LedgerPolicy):
    """The cost-aware policy (``score_costs``): its plan takes ``cost_aware_cold_set_size`` cold
    candidates, and its pre-charge carries a request's fixed cost as well as its tokens."""

    name = "cost_aware"

    def __init__(
        self,
        config: ScorerConfig,
        deployment: DeploymentConfig,
        *,
        status_horizon_s: float,
        tie_rng: random.Random | None = None,
        ledger: SelectionLedger | None = None,
    ) -> None:
        super().__init__(
            config,
            deployment,
            status_horizon_s=status_horizon_s,
            tie_rng=tie_rng,
            ledger=ledger,
            plan_config=replace(config, cold_set_size=config.cost_aware_cold_set_size),
            charge_tokens=config.request_cost_tokens,
            rank=cost_rows,
            respread=respread_near_ties,
        )
