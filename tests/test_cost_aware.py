"""CostAware (router/policy/cost_aware.py): pure values in, values out.

Its invariants against CacheAffinityFirst (same filters; with no prices and no spreading the same
choice), the copy price and its pressure, the fixed cost, near-tie spreading, and the policy chosen
by the ``scorer_policy`` setting."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import DeploymentConfig, ScorerConfig
from router.policy.cache_affinity import CacheAffinityFirst, LedgerPolicy, Selection, score
from router.policy.choice import make_policy
from router.policy.cost_aware import CostAware, candidate_cost, copy_pressure, score_costs, spread_near_ties
from router.policy.ledger import SelectionLedger
from router.policy.plan import CandidatePlan, CandidateSource, Fleet
from router.settings import load_config
from router.types import Reason, Role, ScorerPolicy, WorkerAddr, WorkerStatus
from tests.test_scorer import BS, SEQ, Scenario, addr, observed, passes_filters, plan_of, scenarios, status

COST = replace(ScorerConfig(), policy=ScorerPolicy.COST_AWARE)
NO_PRICES = replace(COST, copy_cost_weight=0.0, request_cost_tokens=0, near_tie_tokens=0)


def run_costs(
    plan: CandidatePlan,
    statuses: dict[WorkerAddr, WorkerStatus],
    *,
    config: ScorerConfig = COST,
    ledger: SelectionLedger | None = None,
    roles: tuple[Role, ...] = (Role.PREFILL,),
    seq_len: int = SEQ,
    seed: int = 0,
) -> Selection:
    return score_costs(
        plan,
        observed(statuses),
        ledger or SelectionLedger(64, 64, status_horizon_s=0.0),
        config=config,
        roles=roles,
        seq_len=seq_len,
        block_size=BS,
        lookahead_tokens=0,
        tie_rng=random.Random(seed),
    )


@st.composite
def priced(draw: st.DrawFn) -> tuple[Scenario, ScorerConfig]:
    plan, statuses, config, roles, seq_len = draw(scenarios())
    cost = replace(
        config,
        policy=ScorerPolicy.COST_AWARE,
        copy_cost_weight=draw(st.sampled_from([0.0, 0.5, 1.0, 4.0])),
        request_cost_tokens=draw(st.sampled_from([0, 64, 5000])),
        near_tie_tokens=draw(st.sampled_from([0, 100, 20_000])),
    )
    return (plan, statuses, config, roles, seq_len), cost


@settings(deadline=None)  # the machine is shared: no per-example time limit
@given(priced(), st.integers(0, 1000))
def test_never_chooses_a_worker_that_fails_the_filters(case: tuple[Scenario, ScorerConfig], seed: int) -> None:
    (plan, statuses, _, roles, seq_len), config = case
    sel = run_costs(plan, statuses, config=config, roles=roles, seq_len=seq_len, seed=seed)
    passing = [c.worker for c in plan.candidates if c.worker in statuses and passes_filters(statuses[c.worker], roles)]
    if not passing:
        assert (sel.worker, sel.reason) == (None, Reason.NO_CANDIDATES)
        return
    assert sel.worker in passing
    assert statuses[sel.worker].alive
    assert sel.role is statuses[sel.worker].role and sel.role in roles


@settings(deadline=None)
@given(scenarios(), st.integers(0, 1000))
def test_with_no_prices_and_no_spreading_it_chooses_as_cache_affinity_first(scenario: Scenario, seed: int) -> None:
    plan, statuses, config, roles, seq_len = scenario
    reference = score(
        plan,
        observed(statuses),
        SelectionLedger(64, 64, status_horizon_s=0.0),
        config=config,
        roles=roles,
        seq_len=seq_len,
        block_size=BS,
        lookahead_tokens=0,
        tie_rng=random.Random(seed),
    )
    no_prices = replace(config, policy=ScorerPolicy.COST_AWARE, copy_cost_weight=0.0, request_cost_tokens=0)
    mine = run_costs(plan, statuses, config=no_prices, roles=roles, seq_len=seq_len, seed=seed)
    assert (mine.worker, mine.reason, mine.hit_tokens, mine.work_tokens) == (
        reference.worker,
        reference.reason,
        reference.hit_tokens,
        reference.work_tokens,
    )
    assert mine.alternates() == reference.alternates()
    assert mine.sheet.ledger_view() == reference.sheet.ledger_view()


def test_copy_price_keeps_a_busy_fleet_on_the_prefix_holder() -> None:
    holder, other = addr(0), addr(1)
    plan = plan_of((holder, 10), (other, None))  # the holder has 20,000 of the 50,000 tokens cached
    # Everyone busy: the holder's queue is 24,000 tokens, the other's 15,000 (work 44,000 vs 65,000).
    busy = {holder: status(24_000 + 15_000), other: status(15_000)}
    reference = run_costs(plan, busy, config=NO_PRICES)
    assert reference.worker == other  # without a price, the copy looks cheaper (work 65,000 vs 59,000)
    priced = run_costs(plan, busy, config=replace(COST, copy_cost_weight=1.0))
    assert (priced.worker, priced.reason) == (holder, Reason.CACHE_LEADER)
    assert priced.work_tokens == 39_000 + SEQ - 20_000  # the reported work carries no price


def test_copy_costs_nothing_while_a_candidate_is_idle() -> None:
    holder, idle = addr(0), addr(1)
    plan = plan_of((holder, 10), (idle, None))
    sel = run_costs(plan, {holder: status(40_000), idle: status(0)}, config=replace(COST, copy_cost_weight=100.0))
    assert sel.worker == idle  # the eviction is re-prefilled on idle capacity: no price
    assert copy_pressure(0, SEQ) == 0.0
    assert copy_pressure(SEQ // 2, SEQ) == 0.5
    assert copy_pressure(10 * SEQ, SEQ) == 1.0


def test_an_empty_prompt_is_priced_at_full_pressure_once_no_candidate_is_idle() -> None:
    assert copy_pressure(5, 0) == 1.0  # any queued work is a request's worth of an empty one
    w = addr(0)
    assert run_costs(plan_of((w, None)), {w: status(5)}, seq_len=0).worker == w


def test_fixed_cost_counts_each_waiting_request() -> None:
    few, many = addr(0), addr(1)
    plan = plan_of((few, None), (many, None))
    # Equal tokens queued; one queue holds one request, the other fifty small ones.
    statuses = {few: status(10_000, waiting_tasks=1), many: status(10_000, waiting_tasks=50)}
    for seed in range(20):
        sel = run_costs(plan, statuses, config=replace(COST, request_cost_tokens=100), seed=seed)
        assert sel.worker == few


def test_the_fixed_cost_counts_this_request_as_well_as_those_waiting() -> None:
    # Not only a difference between candidates: the guard's threshold compares the cost itself.
    config = replace(COST, request_cost_tokens=10, copy_cost_weight=0.0)
    assert candidate_cost(100, 0, 0, 0, 0.0, config=config) == 110
    assert candidate_cost(100, 2, 0, 0, 0.0, config=config) == 130


def test_the_pre_charge_carries_the_fixed_cost() -> None:
    policy = CostAware(replace(COST, request_cost_tokens=300), DeploymentConfig(block_size=BS), status_horizon_s=0.0)
    w = addr(0)
    plan = plan_of((w, None))
    sel = policy.decide(plan, observed({w: status(0)}), seq_len=1000, block_size=BS, now=1.0)
    assert sel.worker == w
    assert policy.ledger.view(w.http_target, 0.0)[0] == 1000 + 300
    policy.record(w, 500, 2.0)
    assert policy.ledger.view(w.http_target, 0.0)[0] == 1000 + 300 + 500 + 300
    # Sheds come in sums: each of them carries the fixed cost (one charge for four used to carry one).
    policy.record(w, 4 * 96, 3.0, requests=4)
    assert policy.ledger.view(w.http_target, 2.5)[0] == 4 * 96 + 4 * 300


def test_spread_near_ties_takes_the_cheaper_of_the_two_lowest_draws_with_the_same_hit() -> None:
    rows = [(100, 0.0, 0.9, 0), (150, 0.0, 0.1, 1), (120, 0.0, 0.2, 2), (900, 0.0, 0.0, 3)]
    same = [0, 0, 0, 0, 0, 0]
    assert spread_near_ties(0, rows, 0, same) == 0  # off
    assert spread_near_ties(0, rows, 60, same) == 2  # near: 0, 1, 2; lowest draws 1 and 2; 2 is cheaper
    assert spread_near_ties(0, rows, 10, same) == 0  # no near-tie
    assert spread_near_ties(5, rows, 60, same) == 5  # not among the rows: unchanged
    # 2 holds less of the prompt: not a near-tie; of 0 and 1 the cheaper is 0
    assert spread_near_ties(0, rows, 60, [64, 64, 0, 0]) == 0
    assert spread_near_ties(1, rows, 60, [0, 64, 64, 0]) == 2


def test_a_candidate_exactly_the_margin_away_is_a_near_tie() -> None:
    rows = [(100, 0.0, 0.5, 0), (110, 0.0, 0.1, 1), (105, 0.0, 0.2, 2)]
    # 1 is 10 away, within a margin of 10: the two lowest draws are 1 and 2, and 2 is the cheaper.
    assert spread_near_ties(0, rows, 10, [5, 5, 5]) == 2


@settings(deadline=None)
@given(st.integers(0, 2**32))
def test_near_ties_spread_over_seeds_and_far_ones_do_not(seed: int) -> None:
    workers = [addr(i) for i in range(4)]
    plan = plan_of(*((w, None) for w in workers))
    near = {w: status(1000 + 10 * i) for i, w in enumerate(workers)}
    sel = run_costs(plan, near, config=replace(COST, near_tie_tokens=100), seed=seed)
    assert sel.worker in workers
    far = {w: status(1000 + 10_000 * i) for i, w in enumerate(workers)}
    assert run_costs(plan, far, config=replace(COST, near_tie_tokens=100), seed=seed).worker == workers[0]


def test_near_ties_reach_more_than_one_worker() -> None:
    workers = [addr(i) for i in range(4)]
    plan = plan_of(*((w, None) for w in workers))
    near = {w: status(1000 + 10 * i) for i, w in enumerate(workers)}
    picks = {run_costs(plan, near, config=replace(COST, near_tie_tokens=100), seed=s).worker for s in range(40)}
    assert len(picks) >= 3
    plain = {run_costs(plan, near, seed=s).worker for s in range(40)}
    assert plain == {workers[0]}


def test_the_guards_redirect_spreads_over_near_ties_too() -> None:
    """The holder over the outstanding-tokens threshold: the guard sends the request to the shortest
    worker under it, and that choice is as herd-prone as any shortest pick (its fallbacks, the least
    bad of workers all over the threshold, are not spread)."""
    workers = [addr(i) for i in range(5)]
    plan = plan_of((workers[0], 10), *((w, None) for w in workers[1:]))
    statuses = {workers[0]: status(40_000), **{w: status(100 * i) for i, w in enumerate(workers[1:], 1)}}
    guarded = replace(
        COST,
        copy_cost_weight=0.0,
        outstanding_uncached_tokens_threshold=60_000,  # the others: 50,000 to prefill and 100-400 queued
        max_extra_work_tokens=10**6,
        near_tie_tokens=1_000,
    )
    picks = [run_costs(plan, statuses, config=guarded, seed=s) for s in range(40)]
    assert {sel.reason for sel in picks} == {Reason.SHORTEST_TTFT_OUTSTANDING_GUARD}
    assert len({sel.worker for sel in picks}) >= 3 and workers[0] not in {sel.worker for sel in picks}
    unspread = {run_costs(plan, statuses, config=replace(guarded, near_tie_tokens=0), seed=s).worker for s in range(40)}
    assert unspread == {workers[1]}


def test_cost_aware_plans_its_own_cold_set_size() -> None:
    config = replace(COST, cold_set_size=2, cost_aware_cold_set_size=6)
    fleet = Fleet.of(addr(i) for i in range(10))

    def cold(policy: LedgerPolicy) -> int:
        p = policy.plan([], fleet, request_id="r", source=CandidateSource.HOT, ejected=frozenset())
        return sum(c.source is CandidateSource.COLD for c in p.candidates)

    assert cold(CostAware(config, DeploymentConfig(), status_horizon_s=0.0)) == 6
    assert cold(CacheAffinityFirst(config, DeploymentConfig(), status_horizon_s=0.0)) == 2


def test_the_setting_chooses_the_policy() -> None:
    deployment = DeploymentConfig(block_size=BS)
    assert isinstance(make_policy(ScorerConfig(), deployment, status_horizon_s=0.0), CacheAffinityFirst)  # the default
    assert isinstance(make_policy(COST, deployment, status_horizon_s=0.0), CostAware)
    loaded = load_config({"scorer_policy": "cost-aware", "scorer_near_tie_tokens": "128"}, {})
    assert loaded.effective.scorer.policy is ScorerPolicy.COST_AWARE
    assert loaded.effective.scorer.near_tie_tokens == 128


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("scorer_policy", "cheapest"),
        ("scorer_copy_cost_weight", "-1"),
        ("scorer_copy_cost_weight", "101"),
        ("scorer_near_tie_tokens", "-5"),
        ("scorer_request_cost_tokens", "2000000"),
    ],
)
def test_bad_policy_settings_name_the_setting(name: str, value: str) -> None:
    loaded = load_config({name: value}, {})
    assert any(name in problem.settings for problem in loaded.errors), loaded.errors
