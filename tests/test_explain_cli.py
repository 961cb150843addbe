"""``kvroute explain``'s outcomes: why each candidate lost, read under the policy that decided."""

from __future__ import annotations

from pathlib import Path

from router.config import ScorerConfig
from router.explain_cli import outcome, render_table
from router.replay import load_log, replay_config
from router.types import CandidateExplain, Reason, ScorerPolicy
from tests.test_decision_log import on_mock_clock, record_cost_aware_run


def _rows(table: str) -> dict[str, str]:
    """The candidate rows by worker: each row's outcome, after the six columns before it."""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("worker"))
    return {line.split()[0]: line.split(maxsplit=6)[6] for line in lines[header + 1 :]}


def test_cost_aware_losses_are_put_down_to_cost_not_the_extra_work_bound(tmp_path: Path) -> None:
    """Worker 0 has the least work and the same hit, but its five queued requests cost more: explain read
    it in cache-affinity's order and blamed the extra-work bound or a concurrent claim (no claim can
    fail: the Scorer's one task makes every pick)."""
    log = tmp_path / "decisions.log"
    decisions, worker0 = on_mock_clock(record_cost_aware_run, log)
    scorer = replay_config(load_log([str(log)]), {}).config.scorer  # the policy the log's header names
    assert scorer.policy is ScorerPolicy.COST_AWARE and scorer.request_cost_tokens == 1000
    first = decisions[0]
    winner = next(c for c in first.candidates if c.chosen)
    zero = next(c for c in first.candidates if c.target == worker0)
    assert zero.hit_tokens == winner.hit_tokens and zero.work_tokens is not None and winner.work_tokens is not None
    assert zero.work_tokens < winner.work_tokens  # less work, yet it lost: on its cost
    table = render_table(first, scorer)
    assert "policy: cost-aware: ranks cost = work + 1000 x (waiting requests + 1)" in table
    assert _rows(table)[worker0].startswith("lost on cost: ")
    assert f"within {scorer.near_tie_tokens} tokens of it and near-tie spreading" in _rows(table)[worker0]
    for decision in decisions:
        for row in _rows(render_table(decision, scorer)).values():
            assert "claim" not in row and "max-extra-work" not in row, row


def test_a_cheaper_candidate_with_another_hit_is_told_spreading_passed_it_over() -> None:
    """Spreading draws among the first pick's near-ties, which hold its hit: it can move the choice to
    a costlier worker past a cheaper one holding another hit, which explain told 'its cost was over
    the winner's'."""
    scorer = ScorerConfig(policy=ScorerPolicy.COST_AWARE, near_tie_tokens=10)
    winner = CandidateExplain("w:4", "cold", 0, 0, 103, "PREFILL", None, chosen=True)
    cache_holder = CandidateExplain("w:2", "hot", 5, 50, 101, "PREFILL", None)  # cheaper, another hit
    said = outcome(cache_holder, winner, Reason.SHORTEST_TTFT, scorer)
    assert said.startswith("lost on cost: ") and "draws only among workers holding the first pick's hit (0" in said
    same_hit = CandidateExplain("w:1", "cold", 0, 0, 100, "PREFILL", None)
    assert "near-tie spreading drew the winner" in outcome(same_hit, winner, Reason.SHORTEST_TTFT, scorer)
    unspread = ScorerConfig(policy=ScorerPolicy.COST_AWARE, near_tie_tokens=0)
    assert "spreading" not in outcome(cache_holder, winner, Reason.SHORTEST_TTFT, unspread)


def test_cache_affinity_losses_name_no_concurrent_claim() -> None:
    """A loss cache-affinity's order does not explain is not put down to a claim that cannot happen."""
    scorer = ScorerConfig()
    winner = CandidateExplain("w:1", "hot", 4, 64, 100, "PREFILL", None, chosen=True)
    less_work = CandidateExplain("w:2", "hot", 4, 64, 50, "PREFILL", None)
    for reason in (Reason.CACHE_LEADER, Reason.SHORTEST_TTFT):
        said = outcome(less_work, winner, reason, scorer)
        assert "claim" not in said and said.startswith("not chosen"), said
    assert "lost on cost" not in outcome(less_work, winner, Reason.CACHE_LEADER, scorer)
