"""CacheAffinityFirst (router/policy/cache_affinity.py): the reference scheduler's worked examples, exact rounding,
filters, reasons, tie-breaks, pre-charge and the selection ledger."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import DeploymentConfig, ScorerConfig
from router.policy.cache_affinity import (
    CONTRACT_DROPS,
    CacheAffinityFirst,
    FilteredPlan,
    ObservedStatus,
    Selection,
    TtftRow,
    expected_group_mode,
    hit_tokens,
    round_half_up,
    score,
    scorer_problems,
)
from router.policy.ledger import SelectionLedger
from router.policy.plan import Candidate, CandidatePlan, CandidateSource
from router.problems import ConfigError
from router.types import (
    CandidateExplain,
    DropReason,
    HostMatch,
    KvCacheGroupMode,
    QueryType,
    Reason,
    Role,
    TaskInfo,
    WorkerAddr,
    WorkerStatus,
)

SEQ = 50_000
BS = 2000


def addr(i: int) -> WorkerAddr:
    return WorkerAddr.from_http(f"10.0.{i // 200}.{i % 200 + 1}", 8000)


def status(
    queued: int = 0,
    *,
    alive: bool = True,
    role: Role = Role.PREFILL,
    waiting_tasks: int | None = None,
    block_size: int | None = None,
    lookahead: int | None = None,
    group_mode: KvCacheGroupMode = KvCacheGroupMode.UNSPECIFIED,
) -> WorkerStatus:
    """A status whose outstanding uncached tokens are ``queued`` (one waiting task)."""
    tasks = (TaskInfo("q", input_length=queued, prefix_length=0, is_waiting=True),) if queued else ()
    return WorkerStatus(
        role=role,
        role_reported=f"RoleType.{role.value}",
        alive=alive,
        status_version=1,
        latest_finished_version=0,
        waiting=tasks,
        waiting_query_len=len(tasks) if waiting_tasks is None else waiting_tasks,
        block_size=block_size,
        lookahead_tokens=lookahead,
        kv_cache_group_mode=group_mode,
    )


def plan_of(*rows: tuple[WorkerAddr, int | None]) -> CandidatePlan:
    """Candidates with ``local`` matched blocks (None: a cold candidate without a match)."""
    return CandidatePlan(
        tuple(
            Candidate(
                w,
                w.http_target,
                None if local is None else HostMatch(w.http_target, local),
                CandidateSource.COLD if local is None else CandidateSource.HOT,
            )
            for w, local in rows
        )
    )


def observed(
    statuses: dict[WorkerAddr, WorkerStatus], taken_at: float = 0.0
) -> dict[WorkerAddr, ObservedStatus]:
    return {w: ObservedStatus(s, taken_at) for w, s in statuses.items()}


def run(
    plan: CandidatePlan,
    statuses: dict[WorkerAddr, WorkerStatus],
    *,
    config: ScorerConfig | None = None,
    ledger: SelectionLedger | None = None,
    roles: tuple[Role, ...] = (Role.PREFILL,),
    seq_len: int = SEQ,
    block_size: int = BS,
    lookahead: int | None = 0,
    seed: int = 0,
    query_type: QueryType = QueryType.PREFIX_MATCH,
) -> Selection:
    config = config or ScorerConfig()
    return score(
        plan,
        observed(statuses),
        ledger or SelectionLedger(64, 64, status_horizon_s=0.0),
        config=config,
        roles=roles,
        seq_len=seq_len,
        block_size=block_size,
        lookahead_tokens=lookahead,
        tie_rng=random.Random(seed),
        group_mode=expected_group_mode(query_type),
    )


# --- selection.md §2 worked examples ----------------------------------------------------------

LEADER, SHORTEST, THIRD = addr(1), addr(2), addr(3)
WORKED_PLAN = plan_of((THIRD, 15), (LEADER, 16), (SHORTEST, 15))
WORKED_STATUSES = {LEADER: status(6000), SHORTEST: status(0), THIRD: status(1000)}


def test_worked_example_cache_leader_within_max_extra() -> None:
    sel = run(WORKED_PLAN, WORKED_STATUSES, config=replace(ScorerConfig(), max_extra_work_tokens=25_000))
    assert (sel.worker, sel.reason) == (LEADER, Reason.CACHE_LEADER)
    assert (sel.hit_tokens, sel.work_tokens, sel.local_blocks, sel.uncached_tokens) == (
        32_000,
        24_000,
        16,
        18_000,
    )
    works = {row.target: row.work_tokens for row in sel.explain()}
    assert works == {LEADER.http_target: 24_000, SHORTEST.http_target: 20_000, THIRD.http_target: 21_000}


def test_worked_example_shortest_ttft_with_zero_max_extra() -> None:
    sel = run(WORKED_PLAN, WORKED_STATUSES, config=replace(ScorerConfig(), max_extra_work_tokens=0))
    assert (sel.worker, sel.reason) == (SHORTEST, Reason.SHORTEST_TTFT)
    assert (sel.hit_tokens, sel.work_tokens) == (30_000, 20_000)


def test_worked_example_bound_is_inclusive() -> None:
    """extra = 24000 - 20000 = 4000: a bound of exactly 4000 still takes the leader, 3999 does not."""
    assert (
        run(WORKED_PLAN, WORKED_STATUSES, config=replace(ScorerConfig(), max_extra_work_tokens=4000)).worker
        == LEADER
    )
    assert (
        run(WORKED_PLAN, WORKED_STATUSES, config=replace(ScorerConfig(), max_extra_work_tokens=3999)).worker
        == SHORTEST
    )


@pytest.mark.parametrize(
    ("seq_len", "min_hit_rate", "expected"),
    [
        (50_000, 5.0, (SHORTEST, Reason.SHORTEST_TTFT_LOW_CACHE_HIT)),  # 2000 / 50000 = 4 %
        (40_000, 5.0, (LEADER, Reason.CACHE_LEADER)),  # 2000 / 40000 = 5 %: the gate is >=
        (50_000, 0.0, (LEADER, Reason.CACHE_LEADER)),  # gate off
    ],
)
def test_worked_example_min_hit_gate(
    seq_len: int, min_hit_rate: float, expected: tuple[WorkerAddr, Reason]
) -> None:
    # The leader holds one block (hit 2000) behind 10000 queued tokens; the other is idle.
    plan = plan_of((LEADER, 1), (SHORTEST, None))
    statuses = {LEADER: status(10_000), SHORTEST: status(0)}
    config = replace(ScorerConfig(), max_extra_work_tokens=25_000, min_hit_rate=min_hit_rate)
    sel = run(plan, statuses, config=config, seq_len=seq_len)
    assert (sel.worker, sel.reason) == expected
    assert {row.target: row.hit_tokens for row in sel.explain()}[LEADER.http_target] == 2000


# --- outstanding guard (§2.5, §2.6) -------------------------------------------------------------


def guarded(threshold: int) -> ScorerConfig:
    """The worked example's config with the outstanding-work guard at ``threshold`` (extra work allowed
    up to 25,000 tokens, so only the guard stops the leader)."""
    return replace(ScorerConfig(), max_extra_work_tokens=25_000, outstanding_uncached_tokens_threshold=threshold)


def test_guard_off_by_default_and_when_not_positive() -> None:
    for threshold in (0, -5):
        config = guarded(threshold)
        assert run(WORKED_PLAN, WORKED_STATUSES, config=config).reason is Reason.CACHE_LEADER


def test_guard_leader_not_eligible_takes_shortest() -> None:
    # Works: leader 24000, shortest 20000, third 21000. Threshold 22000 excludes only the leader.
    config = guarded(22_000)
    sel = run(WORKED_PLAN, WORKED_STATUSES, config=config)
    assert (sel.worker, sel.reason) == (SHORTEST, Reason.SHORTEST_TTFT_OUTSTANDING_GUARD)


def test_guard_none_eligible_falls_back_to_ttft_order() -> None:
    config = guarded(19_999)
    sel = run(WORKED_PLAN, WORKED_STATUSES, config=config)
    assert (sel.worker, sel.reason) == (SHORTEST, Reason.SHORTEST_TTFT_OUTSTANDING_GUARD_FALLBACK)


def test_guard_threshold_is_inclusive() -> None:
    config = guarded(24_000)
    assert run(WORKED_PLAN, WORKED_STATUSES, config=config).reason is Reason.CACHE_LEADER


def test_a_worker_exactly_at_the_threshold_is_eligible_for_the_guards_pick() -> None:
    # Works: leader 24000, shortest 20000, third 21000. The shortest sits exactly at the threshold.
    config = guarded(20_000)
    sel = run(WORKED_PLAN, WORKED_STATUSES, config=config)
    assert (sel.worker, sel.reason) == (SHORTEST, Reason.SHORTEST_TTFT_OUTSTANDING_GUARD)


def test_a_leader_below_the_min_hit_rate_is_reported_so_even_when_beyond_the_guard() -> None:
    # The leader's hit is 32000 / 50000 = 64 %, under an 80 % gate, and its work (24000) is over the
    # threshold too: the gate is checked first, so the reason names the low hit.
    config = replace(guarded(20_000), min_hit_rate=80.0)
    sel = run(WORKED_PLAN, WORKED_STATUSES, config=config)
    assert (sel.worker, sel.reason) == (SHORTEST, Reason.SHORTEST_TTFT_LOW_CACHE_HIT)


def test_the_claim_order_passes_over_affinity_workers_beyond_the_guard() -> None:
    # Threshold 21000: the shortest (20000) and the third (21000) are eligible, the leader (24000) is
    # not; within the bound and holding more than the shortest, it would otherwise be tried first.
    config = guarded(21_000)
    sel = run(WORKED_PLAN, WORKED_STATUSES, config=config)
    assert (sel.worker, sel.reason) == (SHORTEST, Reason.SHORTEST_TTFT_OUTSTANDING_GUARD)
    assert sel.alternates() == ((THIRD, Reason.SHORTEST_TTFT_FALLBACK), (LEADER, Reason.SHORTEST_TTFT_FALLBACK))


CLAIM_A, CLAIM_E, CLAIM_B, CLAIM_F = addr(1), addr(5), addr(2), addr(6)
# bs 2000, seq_len 10000: hits a 6000, e 4000, b 0, f 2000.
CLAIM_PLAN = plan_of((CLAIM_A, 3), (CLAIM_E, 2), (CLAIM_B, None), (CLAIM_F, 1))


@pytest.mark.parametrize(
    ("a_queued", "claim_config", "expected", "alternates"),
    [
        # works a 11000, e 11000, b 10000 (shortest), f 12000. Leader a: extra 1000 ≤ 1000.
        (
            7000,
            replace(ScorerConfig(), min_hit_rate=0.0),
            (CLAIM_A, Reason.CACHE_LEADER),
            (
                (CLAIM_E, Reason.CACHE_AFFINITY_FALLBACK),
                (CLAIM_B, Reason.SHORTEST_TTFT_FALLBACK),
                (CLAIM_F, Reason.SHORTEST_TTFT_FALLBACK),
            ),
        ),
        # works a 13000: extra 3000 > 1000 → the shortest b; e stays affinity-tolerant, f and a do not.
        (
            9000,
            replace(ScorerConfig(), min_hit_rate=0.0),
            (CLAIM_B, Reason.SHORTEST_TTFT),
            (
                (CLAIM_E, Reason.CACHE_AFFINITY_FALLBACK),
                (CLAIM_F, Reason.SHORTEST_TTFT_FALLBACK),
                (CLAIM_A, Reason.SHORTEST_TTFT_FALLBACK),
            ),
        ),
        # Hit rate 60 % below a 70 % gate → the shortest; the same spread order.
        (
            7000,
            replace(ScorerConfig(), min_hit_rate=70.0),
            (CLAIM_B, Reason.SHORTEST_TTFT_LOW_CACHE_HIT),
            (
                (CLAIM_A, Reason.CACHE_AFFINITY_FALLBACK),
                (CLAIM_E, Reason.CACHE_AFFINITY_FALLBACK),
                (CLAIM_F, Reason.SHORTEST_TTFT_FALLBACK),
            ),
        ),
        # Nobody within the guard → TTFT order, every alternate a plain fallback.
        (
            9000,
            replace(ScorerConfig(), min_hit_rate=0.0, outstanding_uncached_tokens_threshold=9000),
            (CLAIM_B, Reason.SHORTEST_TTFT_OUTSTANDING_GUARD_FALLBACK),
            (
                (CLAIM_E, Reason.SHORTEST_TTFT_FALLBACK),
                (CLAIM_F, Reason.SHORTEST_TTFT_FALLBACK),
                (CLAIM_A, Reason.SHORTEST_TTFT_FALLBACK),
            ),
        ),
    ],
)
def test_alternates_follow_the_claim_order(
    a_queued: int,
    claim_config: ScorerConfig,
    expected: tuple[WorkerAddr, Reason],
    alternates: tuple[tuple[WorkerAddr, Reason], ...],
) -> None:
    """§2.7: after the preferred worker, eligible workers with more hit than the shortest and
    extra work within the bound (leader order), then the shortest, then the rest (TTFT order)."""
    statuses = {CLAIM_A: status(a_queued), CLAIM_E: status(5000), CLAIM_B: status(0), CLAIM_F: status(4000)}
    config = replace(claim_config, max_extra_work_tokens=1000)
    sel = run(CLAIM_PLAN, statuses, config=config, seq_len=10_000)
    assert (sel.worker, sel.reason) == expected
    assert sel.alternates() == alternates


# --- hit: exact round half up (§2.2) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        (0.49999999999999994, 0),  # floor(x + 0.5) in doubles gives 1
        (0.5, 1),
        (1.5, 2),
        (2.5, 3),
        (-0.5, 0),
        (-1.5, -1),
        (-2.5, -2),
        (-0.49999999999999994, 0),
        (4503599627370495.5, 4503599627370496),
        (4503599627370497.0, 4503599627370497),  # 2^52 + 1: x + 0.5 would round to even
        (1e300, int(1e300)),
        (0.0, 0),
    ],
)
def test_round_half_up_matches_java(x: float, expected: int) -> None:
    assert round_half_up(x) == expected


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_round_half_up_is_exact_floor_of_x_plus_half(x: float) -> None:
    assert round_half_up(x) == math.floor(Fraction(x) + Fraction(1, 2))


def test_hit_tokens_edges() -> None:
    m = HostMatch("h:1", local=16)
    assert hit_tokens(m, 2000, SEQ, 0.2) == 32_000
    assert hit_tokens(m, 2000, 20_000, 0.2) == 20_000  # capped at seq_len
    assert hit_tokens(None, 2000, SEQ, 0.2) == 0
    assert hit_tokens(m, 0, SEQ, 0.2) == 0  # block size <= 0
    assert hit_tokens(HostMatch("h:1", local=0), 2000, SEQ, 0.2) == 0
    # P2P: 3 local + (8 - 3) × 0.2 = 4.0 blocks.
    assert hit_tokens(HostMatch("h:1", local=3, p2p_total=8), 64, SEQ, 0.2) == 256
    assert hit_tokens(HostMatch("h:1", local=3, p2p_total=8), 64, SEQ, -1.0) == 192  # discount clamped at 0
    # Half-way products round up; just below half rounds down (exactly, like Math.round).
    assert hit_tokens(HostMatch("h:1", local=0, p2p_total=1), 3, SEQ, 0.5) == 2  # 1.5
    assert hit_tokens(HostMatch("h:1", local=0, p2p_total=1), 1, SEQ, 0.49999999999999994) == 0
    assert hit_tokens(HostMatch("h:1", local=0, p2p_total=1), 1, SEQ, 0.5) == 1


@given(
    local=st.integers(0, 10_000),
    extra=st.integers(0, 10_000),
    discount=st.floats(0, 2, allow_nan=False),
    block_size=st.integers(1, 4096),
    seq_len=st.integers(0, 10**8),
)
def test_hit_tokens_equals_reference_formula(
    local: int, extra: int, discount: float, block_size: int, seq_len: int
) -> None:
    """Doubles in the reference's order, then Math.round exactly, then the cap."""
    effective = local + max(0, (local + extra) - local) * max(0.0, discount)
    expected = (
        0 if effective <= 0 else min(seq_len, math.floor(Fraction(effective * block_size) + Fraction(1, 2)))
    )
    assert (
        hit_tokens(HostMatch("h:1", local, p2p_total=local + extra), block_size, seq_len, discount)
        == expected
    )


# --- filters (§2.1) ------------------------------------------------------------------------


def test_dead_worker_never_chosen_even_when_best() -> None:
    a, b = addr(1), addr(2)
    sel = run(plan_of((a, 20), (b, None)), {a: status(0, alive=False), b: status(40_000)})
    assert sel.worker == b
    assert dict(sel.drop_counts) == {DropReason.NOT_ALIVE: 1}


def test_pdfusion_only_deployment_never_picks_a_prefill_worker() -> None:
    a, b = addr(1), addr(2)
    plan = plan_of((a, 20), (b, None))
    statuses = {a: status(0, role=Role.PREFILL), b: status(30_000, role=Role.PDFUSION)}
    sel = run(plan, statuses, roles=(Role.PDFUSION,))
    assert (sel.worker, sel.role) == (b, Role.PDFUSION)
    assert dict(sel.drop_counts) == {DropReason.ROLE_NOT_ROUTED: 1}
    only_prefill = run(plan_of((a, 20)), {a: status(0, role=Role.PREFILL)}, roles=(Role.PDFUSION,))
    assert (only_prefill.worker, only_prefill.reason) == (None, Reason.NO_CANDIDATES)


def test_mixed_deployment_reports_the_workers_real_role() -> None:
    a, b = addr(1), addr(2)
    plan = plan_of((a, 20), (b, 5))
    for role_a, role_b in ((Role.PDFUSION, Role.PREFILL), (Role.PREFILL, Role.PDFUSION)):
        sel = run(
            plan, {a: status(0, role=role_a), b: status(0, role=role_b)}, roles=(Role.PREFILL, Role.PDFUSION)
        )
        assert (sel.worker, sel.role) == (a, role_a)
        assert [row.role for row in sel.explain()] == [role_a.value, role_b.value]


def test_unknown_and_decode_roles_are_dropped() -> None:
    a, b, c = addr(1), addr(2), addr(3)
    sel = run(
        plan_of((a, 20), (b, 20), (c, None)),
        {a: status(0, role=Role.UNKNOWN), b: status(0, role=Role.DECODE), c: status(0)},
    )
    assert sel.worker == c and dict(sel.drop_counts) == {DropReason.ROLE_NOT_ROUTED: 2}


def test_a_dead_worker_is_dropped_as_not_alive_whatever_its_role() -> None:
    a, b = addr(1), addr(2)
    sel = run(plan_of((a, 20), (b, None)), {a: status(0, alive=False, role=Role.DECODE), b: status(0)})
    assert sel.worker == b and dict(sel.drop_counts) == {DropReason.NOT_ALIVE: 1}


def test_queue_threshold_is_exclusive() -> None:
    a, b = addr(1), addr(2)
    plan = plan_of((a, 20), (b, None))
    full = run(plan, {a: status(0, waiting_tasks=1024), b: status(0)})
    assert full.worker == b and dict(full.drop_counts) == {DropReason.QUEUE_FULL: 1}
    below = run(plan, {a: status(0, waiting_tasks=1023), b: status(0)})
    assert below.worker == a and below.drop_counts == ()


def test_block_size_unreported_is_accepted_and_mismatch_dropped_and_counted() -> None:
    a, b, c = addr(1), addr(2), addr(3)
    plan = plan_of((a, 20), (b, 19), (c, 5))
    statuses = {a: status(0, block_size=64), b: status(0, block_size=None), c: status(0, block_size=BS)}
    sel = run(plan, statuses)
    assert sel.worker == b
    assert dict(sel.drop_counts) == {DropReason.BLOCK_SIZE_MISMATCH: 1}
    assert [row.dropped for row in sel.explain()] == ["block_size_mismatch", None, None]


def test_lookahead_mismatch_dropped_unless_unknown() -> None:
    a, b = addr(1), addr(2)
    plan = plan_of((a, 20), (b, None))
    statuses = {a: status(0, lookahead=1), b: status(0, lookahead=0)}
    sel = run(plan, statuses, lookahead=0)
    assert sel.worker == b and dict(sel.drop_counts) == {DropReason.LOOKAHEAD_MISMATCH: 1}
    assert run(plan, statuses, lookahead=None).worker == a  # the keys' lookahead unknown: not checked
    assert run(plan, {a: status(0, lookahead=None), b: status(0)}, lookahead=0).worker == a


def test_a_worker_whose_cache_groups_need_another_query_type_is_dropped() -> None:
    """KVCM's answer to a prefix-match query does not describe a Mamba worker's cache (nor the reverse):
    such a worker is dropped as a contract mismatch; one reporting no mode is accepted."""
    full, mamba, silent = addr(1), addr(2), addr(3)
    plan = plan_of((mamba, 20), (full, 10), (silent, None))
    statuses = {
        full: status(0, group_mode=KvCacheGroupMode.FULL_ATTENTION_ONLY),
        mamba: status(0, group_mode=KvCacheGroupMode.WITH_MAMBA),
        silent: status(0),
    }
    sel = run(plan, statuses, query_type=QueryType.PREFIX_MATCH)
    assert sel.worker == full and dict(sel.drop_counts) == {DropReason.QUERY_TYPE_MISMATCH: 1}
    assert [row.dropped for row in sel.explain()] == ["query_type_mismatch", None, None]
    sel = run(plan, statuses, query_type=QueryType.PREFIX_MATCH_WITH_MAMBA)
    assert sel.worker == mamba and dict(sel.drop_counts) == {DropReason.QUERY_TYPE_MISMATCH: 1}
    # A query type that implies no mode (the server's default) checks none.
    assert run(plan, statuses, query_type=QueryType.UNSPECIFIED).worker == mamba
    assert DropReason.QUERY_TYPE_MISMATCH in CONTRACT_DROPS  # warned once per worker, like block size


def test_missing_statuses_use_the_callers_reason() -> None:
    a, b, c = addr(1), addr(2), addr(3)
    plan = plan_of((a, 20), (b, 10), (c, None))
    sel = score(
        plan,
        observed({c: status(0)}),
        SelectionLedger(8, 8, status_horizon_s=0.0),
        config=ScorerConfig(),
        roles=(Role.PREFILL,),
        seq_len=SEQ,
        block_size=BS,
        lookahead_tokens=0,
        tie_rng=random.Random(0),
        missing={a: DropReason.EJECTED},
    )
    assert sel.worker == c
    assert dict(sel.drop_counts) == {DropReason.EJECTED: 1, DropReason.NO_STATUS: 1}


def test_the_filtered_plan_a_policy_respreads_with_keeps_its_passed_rows_in_plan_order() -> None:
    # The plan lists targets out of order: the tie draws go by target, the rows a policy reads stay as planned.
    a, b, c = addr(3), addr(1), addr(2)
    plan = plan_of((a, 5), (b, 5), (c, None))
    seen: list[list[int]] = []

    def respread(
        preferred: int, reason: Reason, eligible: list[TtftRow], filtered: FilteredPlan, config: ScorerConfig
    ) -> int:
        seen.append([row[1] for row in filtered.passed])
        return preferred

    score(
        plan,
        observed({a: status(0), b: status(0), c: status(0)}),
        SelectionLedger(8, 8, status_horizon_s=0.0),
        config=ScorerConfig(),
        roles=(Role.PREFILL,),
        seq_len=SEQ,
        block_size=BS,
        lookahead_tokens=0,
        tie_rng=random.Random(0),
        respread=respread,
    )
    assert seen == [[0, 1, 2]]


def test_no_candidate_left_is_no_candidates_with_explanation() -> None:
    a = addr(1)
    plan = CandidatePlan(
        (Candidate(a, a.http_target, HostMatch(a.http_target, 3), CandidateSource.HOT),),
        (CandidateExplain("9.9.9.9:1", "hot", 7, 0, None, None, "unknown_host"),),
    )
    sel = run(plan, {a: status(0, alive=False)})
    assert (sel.worker, sel.role, sel.reason, sel.status_taken_at) == (None, None, Reason.NO_CANDIDATES, None)
    assert dict(sel.drop_counts) == {DropReason.UNKNOWN_HOST: 1, DropReason.NOT_ALIVE: 1}
    assert [(row.target, row.dropped) for row in sel.explain()] == [
        ("9.9.9.9:1", "unknown_host"),
        (a.http_target, "not_alive"),
    ]
    assert sel.alternates() == ()


def test_explain_marks_the_chosen_candidate() -> None:
    sel = run(WORKED_PLAN, WORKED_STATUSES, config=replace(ScorerConfig(), max_extra_work_tokens=25_000))
    chosen = [row.target for row in sel.explain() if row.chosen]
    assert chosen == [LEADER.http_target]
    assert {row.source for row in sel.explain()} == {"hot"}
    assert [row.local_blocks for row in sel.explain()] == [15, 16, 15]


# --- tie-breaks and spreading (§2.4, review-lessons §13) ---------------------------------------


def test_exact_ties_are_not_broken_by_address() -> None:
    workers = [addr(i) for i in range(4)]
    plan = plan_of(*((w, 10) for w in workers))
    statuses = {w: status(0) for w in workers}
    firsts = Counter(run(plan, statuses, seed=seed).worker for seed in range(400))
    assert set(firsts) == set(workers)
    assert min(firsts.values()) >= 60 and max(firsts.values()) <= 140  # ~100 each


def test_least_recently_selected_wins_an_exact_work_tie() -> None:
    a, b, c = addr(1), addr(2), addr(3)
    plan = plan_of((a, 10), (b, 10), (c, 10))
    scorer = CacheAffinityFirst(ScorerConfig(), DeploymentConfig(block_size=BS), status_horizon_s=0.0)
    chosen = []
    for step in range(9):
        now = float(step)
        # Fresh statuses taken just before each decision clear the pre-charge: work ties exactly,
        # and only the last-selected times tell the workers apart.
        statuses = observed({a: status(0), b: status(0), c: status(0)}, taken_at=now)
        chosen.append(scorer.decide(plan, statuses, seq_len=SEQ, block_size=BS, now=now).worker)
    assert chosen[3:6] == chosen[0:3] and chosen[6:9] == chosen[0:3]  # strict rotation
    assert set(chosen[0:3]) == {a, b, c}


@given(seed=st.integers(0, 2**32), data=st.data())
def test_result_invariant_under_input_order(seed: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 8))
    workers = [addr(i) for i in range(n)]
    locals_ = data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    queued = data.draw(st.lists(st.sampled_from([0, 1000, 5000]), min_size=n, max_size=n))
    rows = list(zip(workers, locals_, strict=True))
    statuses = {w: status(q) for w, q in zip(workers, queued, strict=True)}
    ledger_ops = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 20_000)), max_size=6))

    def ledger() -> SelectionLedger:
        built = SelectionLedger(64, 64, status_horizon_s=0.0)
        for t, (i, tokens) in enumerate(ledger_ops):
            built.record(workers[i].http_target, tokens, now=float(t))
        return built

    config = replace(ScorerConfig(), max_extra_work_tokens=data.draw(st.integers(0, 30_000)))
    first = run(plan_of(*rows), statuses, config=config, ledger=ledger(), seed=seed)
    shuffled = data.draw(st.permutations(rows))
    second = run(plan_of(*shuffled), statuses, config=config, ledger=ledger(), seed=seed)
    assert (second.worker, second.reason, second.hit_tokens, second.work_tokens) == (
        first.worker,
        first.reason,
        first.hit_tokens,
        first.work_tokens,
    )
    assert second.alternates() == first.alternates()


# --- hypothesis: the policy's invariants ------------------------------------------------------

ROLES_SEEN = (Role.PREFILL, Role.PDFUSION, Role.DECODE, Role.UNKNOWN)


Scenario = tuple[CandidatePlan, dict[WorkerAddr, WorkerStatus], ScorerConfig, tuple[Role, ...], int]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    n = draw(st.integers(1, 10))
    rows: list[tuple[WorkerAddr, int | None]] = []
    statuses: dict[WorkerAddr, WorkerStatus] = {}
    for i in range(n):
        w = addr(i)
        rows.append((w, draw(st.one_of(st.none(), st.integers(0, 40)))))
        if draw(st.integers(0, 9)) == 0:
            continue  # no status
        statuses[w] = status(
            draw(st.sampled_from([0, 500, 4000, 30_000])),
            alive=draw(st.booleans()) or draw(st.booleans()),
            role=draw(st.sampled_from(ROLES_SEEN)),
            waiting_tasks=draw(st.sampled_from([0, 1, 1023, 1024, 5000])),
            block_size=draw(st.sampled_from([None, BS, 64])),
            lookahead=draw(st.sampled_from([None, 0, 1])),
        )
    config = replace(
        ScorerConfig(),
        max_extra_work_tokens=draw(st.sampled_from([0, 1000, 25_000, 10**6])),
        min_hit_rate=draw(st.sampled_from([0.0, 5.0, 50.0])),
        outstanding_uncached_tokens_threshold=draw(st.sampled_from([0, 0, 30_000, 60_000])),
    )
    roles = draw(st.sampled_from([(Role.PREFILL,), (Role.PDFUSION,), (Role.PREFILL, Role.PDFUSION)]))
    seq_len = draw(st.integers(1, 100_000))
    return plan_of(*rows), statuses, config, roles, seq_len


def passes_filters(s: WorkerStatus, roles: tuple[Role, ...]) -> bool:
    return (
        s.alive
        and s.role in roles
        and s.waiting_count < 1024
        and s.block_size in (None, BS)
        and s.lookahead_tokens in (None, 0)
    )


@given(scenarios(), st.integers(0, 1000))
def test_chosen_worker_always_passes_the_filters(scenario: Scenario, seed: int) -> None:
    plan, statuses, config, roles, seq_len = scenario
    sel = run(plan, statuses, config=config, roles=roles, seq_len=seq_len, seed=seed)
    passing = [
        c.worker
        for c in plan.candidates
        if c.worker in statuses and passes_filters(statuses[c.worker], roles)
    ]
    if not passing:
        assert (sel.worker, sel.reason) == (None, Reason.NO_CANDIDATES)
        return
    assert sel.worker in passing
    assert statuses[sel.worker].alive  # never a dead worker
    assert sel.role is statuses[sel.worker].role and sel.role in roles
    assert sum(count for _, count in sel.drop_counts) == len(plan.candidates) - len(passing)


@given(scenarios(), st.integers(0, 1000))
def test_leader_chosen_whenever_within_bound_and_gate(scenario: Scenario, seed: int) -> None:
    plan, statuses, config, roles, seq_len = scenario
    config = replace(config, outstanding_uncached_tokens_threshold=0)
    sel = run(plan, statuses, config=config, roles=roles, seq_len=seq_len, seed=seed)
    scored = []
    for c in plan.candidates:
        s = statuses.get(c.worker)
        if s is not None and passes_filters(s, roles):
            hit = hit_tokens(c.match, BS, seq_len, config.p2p_hit_discount)
            scored.append((c.worker, hit, s.outstanding_uncached_tokens + seq_len - hit))
    if not scored:
        return
    best_hit = max(hit for _, hit, _ in scored)
    leader_work = min(work for _, hit, work in scored if hit == best_hit)
    shortest_work = min(work for _, _, work in scored)
    gate_passes = config.min_hit_rate <= 0 or best_hit * 100 / seq_len >= config.min_hit_rate
    by_worker = {w: (hit, work) for w, hit, work in scored}
    assert sel.worker is not None
    if gate_passes and leader_work - shortest_work <= config.max_extra_work_tokens:
        assert sel.reason is Reason.CACHE_LEADER
        assert by_worker[sel.worker] == (best_hit, leader_work)
    else:
        assert sel.reason in (Reason.SHORTEST_TTFT, Reason.SHORTEST_TTFT_LOW_CACHE_HIT)
        assert by_worker[sel.worker][1] == shortest_work


# --- pre-charge and the burst (§2.3, §2.8) ------------------------------------------------------


def test_selection_pre_charges_until_a_newer_status_arrives() -> None:
    a, b = addr(1), addr(2)
    plan = plan_of((a, 16), (b, 15))
    scorer = CacheAffinityFirst(
        replace(ScorerConfig(), max_extra_work_tokens=0),
        DeploymentConfig(block_size=BS),
        status_horizon_s=0.0,
    )
    first = scorer.decide(
        plan, observed({a: status(0), b: status(0)}, taken_at=0.0), seq_len=SEQ, block_size=BS, now=1.0
    )
    assert (first.worker, first.work_tokens) == (a, 18_000)
    # Same statuses (taken at 0, before the charge at 1): a carries 18000 more → b (20000) wins.
    second = scorer.decide(
        plan, observed({a: status(0), b: status(0)}, taken_at=0.0), seq_len=SEQ, block_size=BS, now=2.0
    )
    assert (second.worker, second.work_tokens) == (b, 20_000)
    assert {r.target: r.work_tokens for r in second.explain()}[a.http_target] == 36_000
    # A status of a taken at 1.5 (after its charge at 1.0) clears it; b's charge at 2.0 stays.
    statuses = {a: ObservedStatus(status(0), 1.5), b: ObservedStatus(status(0), 0.0)}
    third = scorer.decide(plan, statuses, seq_len=SEQ, block_size=BS, now=3.0)
    assert (third.worker, third.work_tokens) == (a, 18_000)
    assert {r.target: r.work_tokens for r in third.explain()}[b.http_target] == 20_000 + 20_000


def test_a_decision_clears_the_charges_its_status_covers() -> None:
    w = addr(1)
    plan = plan_of((w, 5))  # each decision charges its 40000 uncached tokens
    scorer = CacheAffinityFirst(ScorerConfig(), DeploymentConfig(block_size=BS), status_horizon_s=0.0)
    first = scorer.decide(plan, {w: ObservedStatus(status(0), 0.0)}, seq_len=SEQ, block_size=BS, now=1.0)
    assert first.status_taken_at == 0.0
    # A status taken at 1.5 already reflects the dispatch at 1.0: recording the next one drops it.
    scorer.decide(plan, {w: ObservedStatus(status(0), 1.5)}, seq_len=SEQ, block_size=BS, now=2.0)
    assert scorer.health().pending_charges == 1
    # A status older than the newest one recorded with is charged only what remains.
    assert scorer.ledger.view(w.http_target, 0.0)[0] == 40_000


def test_status_taken_at_the_charge_instant_keeps_the_charge() -> None:
    ledger = SelectionLedger(4, 8, status_horizon_s=0.0)
    ledger.record("w:1", 100, now=5.0)
    assert ledger.view("w:1", 5.0) == (100, 5.0)
    assert ledger.view("w:1", 5.000001) == (0, 5.0)
    assert ledger.view("w:2", 0.0) == (0, -math.inf)


def test_ledger_clears_charges_made_before_a_status() -> None:
    ledger = SelectionLedger(4, 64, status_horizon_s=0.0)
    for t in range(1, 6):
        ledger.record("w:1", 10 * t, now=float(t))  # 10, 20, 30, 40, 50 at t = 1..5
    assert ledger.view("w:1", 0.0)[0] == 150
    assert ledger.view("w:1", 3.0)[0] == 120
    ledger.record("w:1", 60, now=6.0, status_taken_at=4.0)  # clears t=1..3
    assert ledger.view("w:1", 0.0)[0] == 150  # 40 + 50 + 60: the cleared ones are gone for good
    assert ledger.view("w:1", 5.5)[0] == 60


def test_ledger_merges_old_charges_beyond_the_cap_without_losing_tokens() -> None:
    ledger = SelectionLedger(4, 3, status_horizon_s=0.0)
    for t in range(1, 11):
        ledger.record("w:1", 1, now=float(t))
    assert ledger.view("w:1", 0.0)[0] == 10  # nothing lost
    assert ledger.view("w:1", 9.0)[0] == 2  # the recent ones keep their times
    # The merged charges clear only with the oldest kept time (8.0): over-, never under-counted.
    assert ledger.view("w:1", 7.5)[0] == 10
    assert ledger.view("w:1", 8.5)[0] == 2
    entry_lengths = [len(e.times) - e.head for e in ledger._entries.values()]
    assert entry_lengths == [3]


def test_ledger_keeps_charges_a_horizon_before_a_status_and_drops_covered_ones_at_the_cap() -> None:
    ledger = SelectionLedger(4, 64, status_horizon_s=2.0)
    for t in range(1, 6):
        ledger.record("w:1", 10 * t, now=float(t))  # 10, 20, 30, 40, 50 at t = 1..5
    ledger.record("w:1", 60, now=6.0, status_taken_at=4.5)  # clears only t=1..2 (before 4.5 - 2.0)
    # A request still holding a status taken at 3.0 is charged every dispatch since: 30 + 40 + 50 + 60.
    assert ledger.view("w:1", 3.0)[0] == 180
    assert ledger.view("w:1", 4.5)[0] == 110
    # At the cap the oldest kept charge goes; covered by the newest status (4.5), its tokens go with it,
    # or a status older than every kept charge would be charged every token since the last clear.
    capped = SelectionLedger(4, 3, status_horizon_s=100.0)
    capped.record("w:1", 1, now=1.0, status_taken_at=0.0)
    for t in range(2, 11):
        capped.record("w:1", 1, now=float(t), status_taken_at=float(t) - 0.5)  # each status covers the last
    assert capped.view("w:1", 9.5)[0] == 1
    assert capped.view("w:1", 0.0)[0] == 3  # the kept charges (8, 9, 10), not all ten


def test_ledger_is_bounded_lru_over_workers() -> None:
    ledger = SelectionLedger(3, 8, status_horizon_s=0.0)
    for i in range(10):
        ledger.record(f"w:{i}", 5, now=float(i))
    assert len(ledger) == 3
    ledger.record("w:7", 5, now=11.0)  # touch w:7: w:8 is now the least recent
    ledger.record("w:10", 5, now=12.0)
    assert ledger.view("w:8", 0.0) == (0, -math.inf)
    assert ledger.view("w:7", 0.0) == (10, 11.0)
    assert len(ledger) == 3


def test_a_charge_recorded_out_of_order_still_counts() -> None:
    """A decision made at 3.0 recorded after one made at 5.0 (a caller's clock stepped back): the charge
    is kept as made at 5.0, so a status taken at 4.0 clears neither — over-, never under-counted."""
    ledger = SelectionLedger(4, 8, status_horizon_s=0.0)
    ledger.record("w:1", 100, now=5.0)
    ledger.record("w:1", 50, now=3.0)
    assert ledger.view("w:1", 4.0)[0] == 150
    assert ledger.view("w:1", 5.5)[0] == 0


def test_the_last_selected_time_never_moves_back() -> None:
    # A selection recorded late does not make the worker look less recently selected than it is.
    ledger = SelectionLedger(4, 8, status_horizon_s=0.0)
    ledger.record("w:1", 100, now=5.0)
    ledger.record("w:1", 50, now=3.0)
    assert ledger.view("w:1", 0.0) == (150, 5.0)


def test_the_pending_charges_gauge_forgets_the_charges_of_an_evicted_worker() -> None:
    ledger = SelectionLedger(1, 8, status_horizon_s=0.0)
    ledger.record("w:1", 10, now=1.0)
    ledger.record("w:1", 10, now=2.0)
    ledger.record("w:2", 10, now=3.0)  # evicts w:1 and its two charges
    assert ledger.view("w:1", 0.0) == (0, -math.inf)
    assert ledger.pending_charges() == 1


def test_burst_sharing_one_prefix_spreads_once_pre_charge_makes_workers_comparable() -> None:
    """1,000 requests, one prefix held by one worker (hit 75 % of the prompt), 8 idle workers,
    statuses never refreshed during the burst. Each pick of the holder costs 2,000 uncached
    tokens, of another worker 8,000: balancing work gives the holder about 4 / 11 of the
    requests and each other worker about 1 / 11."""
    workers = [addr(i) for i in range(8)]
    holder = workers[3]
    seq_len, block = 8000, 16
    plan = plan_of(*((w, 375 if w == holder else None) for w in workers))
    statuses = observed({w: status(0) for w in workers}, taken_at=0.0)
    scorer = CacheAffinityFirst(ScorerConfig(), DeploymentConfig(block_size=block), status_horizon_s=0.0)
    counts: Counter[WorkerAddr | None] = Counter()
    for i in range(1000):
        selection = scorer.decide(plan, statuses, seq_len=seq_len, block_size=block, now=1.0 + i * 1e-4)
        counts[selection.worker] += 1
    share = counts[holder] / 1000
    assert 0.33 <= share <= 0.40  # ≈ 4/11 = 0.364: affinity kept, yet bounded
    others = [counts[w] for w in workers if w != holder]
    assert len(others) == 7 and min(others) >= 85 and max(others) <= 95  # ≈ 91 each


def test_burst_over_equal_holders_spreads_evenly() -> None:
    workers = [addr(i) for i in range(4)]
    plan = plan_of(*((w, 100) for w in workers))
    statuses = observed({w: status(0) for w in workers}, taken_at=0.0)
    scorer = CacheAffinityFirst(ScorerConfig(), DeploymentConfig(block_size=16), status_horizon_s=0.0)
    counts = Counter(
        scorer.decide(plan, statuses, seq_len=4000, block_size=16, now=1.0 + i).worker for i in range(1000)
    )
    assert sorted(counts.values()) == [250, 250, 250, 250]


# --- the policy object ---------------------------------------------------------------------------


def test_policy_record_charges_fallback_dispatches() -> None:
    a, b = addr(1), addr(2)
    plan = plan_of((a, None), (b, None))
    scorer = CacheAffinityFirst(ScorerConfig(), DeploymentConfig(block_size=BS), status_horizon_s=0.0)
    scorer.record(a, 5000, now=1.0)  # e.g. a domain-fallback dispatch
    sel = scorer.decide(plan, observed({a: status(0), b: status(0)}), seq_len=SEQ, block_size=BS, now=2.0)
    assert sel.worker == b


def test_policy_roles_default_to_the_deployments_and_can_be_overridden() -> None:
    a = addr(1)
    plan = plan_of((a, 5))
    statuses = observed({a: status(0, role=Role.PDFUSION)})
    scorer = CacheAffinityFirst(
        ScorerConfig(),
        DeploymentConfig(roles=(Role.PREFILL,), block_size=BS),
        status_horizon_s=0.0,
    )
    assert scorer.decide(plan, statuses, seq_len=SEQ, block_size=BS, now=0.0).worker is None
    assert (
        scorer.decide(plan, statuses, seq_len=SEQ, block_size=BS, now=0.0, roles=(Role.PDFUSION,)).worker == a
    )


def test_the_policys_default_roles_leave_out_the_deployments_decode_role() -> None:
    """A deployment with prefill/decode separation lists its decode role too, yet a decode worker
    never takes the prefill, however much of the prompt it holds."""
    d, p = addr(1), addr(2)
    plan = plan_of((d, 20), (p, None))
    statuses = observed({d: status(0, role=Role.DECODE), p: status(0)})
    scorer = CacheAffinityFirst(
        ScorerConfig(),
        DeploymentConfig(roles=(Role.PREFILL, Role.DECODE), block_size=BS),
        status_horizon_s=0.0,
    )
    sel = scorer.decide(plan, statuses, seq_len=SEQ, block_size=BS, now=0.0)
    assert sel.worker == p and dict(sel.drop_counts) == {DropReason.ROLE_NOT_ROUTED: 1}


def test_policy_rejects_bad_config_naming_every_field() -> None:
    bad = replace(
        ScorerConfig(),
        prefill_queue_size_threshold=0,
        p2p_hit_discount=math.nan,
        hot_set_size=0,
        cold_set_size=0,
        max_pending_charges=0,
    )
    problems = scorer_problems(bad)
    assert [p.fields for p in problems] == [
        ("prefill_queue_size_threshold",),
        ("p2p_hit_discount",),
        ("hot_set_size",),
        ("max_pending_charges",),
        ("hot_set_size", "cold_set_size"),
    ]
    with pytest.raises(ConfigError, match=r"scorer.prefill_queue_size_threshold.*scorer.max_pending_charges"):
        CacheAffinityFirst(bad, DeploymentConfig(), status_horizon_s=0.0)
    with pytest.raises(ConfigError, match="roles"):
        CacheAffinityFirst(ScorerConfig(), DeploymentConfig(roles=()), status_horizon_s=0.0)
    assert scorer_problems(ScorerConfig()) == []


def test_negative_seq_len_is_rejected() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        run(WORKED_PLAN, WORKED_STATUSES, seq_len=-1)


def test_observe_reuses_the_view_of_an_unchanged_status_and_is_bounded() -> None:
    scorer = CacheAffinityFirst(
        replace(ScorerConfig(), max_tracked_workers=2),
        DeploymentConfig(block_size=BS),
        status_horizon_s=0.0,
    )
    a, b, c = addr(1), addr(2), addr(3)
    st_a = status(7000)
    first = scorer.observe(a, st_a, 1.0)
    assert first.outstanding_uncached_tokens == 7000
    assert scorer.observe(a, st_a, 1.0) is first  # same status object, same time: reused
    assert scorer.observe(a, st_a, 2.0) is not first  # taken again: a new view
    assert scorer.observe(a, status(7000), 2.0).status is not st_a  # a new status object
    scorer.observe(b, status(0), 1.0)
    scorer.observe(c, status(0), 1.0)  # over the bound: a (least recently new) is forgotten
    kept = scorer.observe(b, scorer._observed[b].status, 1.0)
    assert kept is scorer._observed[b] and len(scorer._observed) == 2 and a not in scorer._observed
