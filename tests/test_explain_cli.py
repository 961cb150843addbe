"""``kvroute explain``'s outcomes: why each candidate lost, read under the policy that decided."""

from __future__ import annotations

from pathlib import Path

from router.config import ScorerConfig
from router.explain_cli import outcome, render_table
from router.replay import load_log, replay_config
from router.types import (
    CandidateExplain,
    DropReason,
    Reason,
    Role,
    RouteDecision,
    RouteSource,
    ScorerPolicy,
    SourceOutcome,
    SourceStep,
    WorkerAddr,
)
from tests.test_decision_log import on_mock_clock, record_cost_aware_run


def _rows(table: str) -> dict[str, str]:
    """The candidate rows by worker: each row's outcome, after the six columns before it."""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("worker"))
    return {line.split()[0]: line.split(maxsplit=6)[6] for line in lines[header + 1 :]}


def _columns(table: str) -> dict[str, list[str]]:
    """The candidate rows by worker, split into the seven columns (the outcome kept whole)."""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("worker"))
    return {line.split()[0]: line.split(maxsplit=6) for line in lines[header + 1 :]}


def _decision(
    reason: Reason, *candidates: CandidateExplain, error: str | None = None, sources: tuple[SourceStep, ...] = ()
) -> RouteDecision:
    """A KVCM decision for worker ``10.0.0.1:8000`` (PREFILL) with ``candidates`` in the given order."""
    worker = WorkerAddr("10.0.0.1", 8000, 8001, 8002)
    return RouteDecision(
        request_id="r1",
        worker=worker,
        role=Role.PREFILL,
        route_source=RouteSource.KVCM,
        reason=reason,
        candidates=candidates,
        error=error,
        sources=sources,
    )


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


def test_losers_are_compared_with_the_chosen_candidate_not_the_first_row() -> None:
    """The winner is the candidate marked chosen wherever it sits: read against the first row, a loser
    listed first was compared with itself and shown as a tie."""
    loser = CandidateExplain("w:2", "hot", 4, 64, 150, "PREFILL", None)
    winner = CandidateExplain("w:1", "hot", 4, 64, 100, "PREFILL", None, chosen=True)
    rows = _rows(render_table(_decision(Reason.SHORTEST_TTFT, loser, winner), ScorerConfig()))
    assert rows["w:2"] == "lost: more work (150 > 100 tokens)"
    assert rows["w:1"] == "WON: SHORTEST_TTFT"


def test_a_dropped_candidate_shows_its_drop_reason_and_no_hit() -> None:
    """A dropped candidate was never scored: its hit column is '-' (its plan's hit would read as one it
    competed with) and its outcome names the drop reason, not a loss or 'scored, not chosen'."""
    winner = CandidateExplain("w:1", "hot", 4, 64, 100, "PREFILL", None, chosen=True)
    dropped = CandidateExplain("w:3", "hot", 6, 96, None, "PREFILL", DropReason.QUEUE_FULL.value)
    columns = _columns(render_table(_decision(Reason.CACHE_LEADER, winner, dropped), ScorerConfig()))
    assert columns["w:3"][3:] == ["6", "-", "-", "dropped: queue_full"]
    assert columns["w:1"][3:] == ["4", "64", "100", "WON: CACHE_LEADER"]


def test_shortest_ttft_fallback_losses_are_read_in_work_order() -> None:
    """SHORTEST_TTFT_FALLBACK picks the least work: a loser with more hit and more work lost on its work;
    read in the cache-leader order its bigger hit left the loss unexplained."""
    winner = CandidateExplain("w:1", "cold", 0, 0, 100, "PREFILL", None, chosen=True)
    loser = CandidateExplain("w:2", "hot", 4, 64, 150, "PREFILL", None)
    table = render_table(_decision(Reason.SHORTEST_TTFT_FALLBACK, winner, loser), ScorerConfig())
    assert _rows(table)["w:2"] == "lost: more work (150 > 100 tokens)"


def test_equal_work_under_a_ttft_reason_is_a_tie_not_more_work() -> None:
    """Equal work is not more work: under a TTFT order the loser lost the tie-break, and the table must
    not claim '100 > 100'."""
    winner = CandidateExplain("w:1", "hot", 4, 64, 100, "PREFILL", None, chosen=True)
    loser = CandidateExplain("w:2", "hot", 4, 64, 100, "PREFILL", None)
    for reason in (Reason.SHORTEST_TTFT, Reason.SHORTEST_TTFT_LOW_CACHE_HIT):
        said = _rows(render_table(_decision(reason, winner, loser), ScorerConfig()))["w:2"]
        assert said.startswith("lost a tie: spread to the least recently selected worker"), said
        assert "more work" not in said


def test_an_answered_decision_with_an_error_prints_a_note_line() -> None:
    """An error beside a worker (the answer stands) gets its own 'note:' line; without a worker the error
    is the target itself and no note repeats it."""
    winner = CandidateExplain("w:1", "hot", 4, 64, 100, "PREFILL", None, chosen=True)
    answered = _decision(Reason.CACHE_LEADER, winner, error="shadow index stale")
    assert "note: shadow index stale" in render_table(answered, ScorerConfig()).splitlines()
    unanswered = RouteDecision("r2", None, None, RouteSource.NONE, Reason.NO_CANDIDATES, error="no workers")
    table = render_table(unanswered, ScorerConfig())
    assert "-> no worker (no workers)" in table.splitlines()[0]
    assert not any(line.startswith("note:") for line in table.splitlines())


def test_a_decision_with_sources_prints_the_chain_in_order() -> None:
    """The chain line lists each source the request walked, its outcome, reason and time, in order."""
    winner = CandidateExplain("w:1", "hot", 4, 64, 100, "PREFILL", None, chosen=True)
    sources = (
        SourceStep(RouteSource.MASTER, SourceOutcome.FELL_THROUGH, Reason.MASTER_BREAKER_OPEN, 0.02),
        SourceStep(RouteSource.KVCM, SourceOutcome.ANSWERED, Reason.CACHE_LEADER, 1.5),
    )
    lines = render_table(_decision(Reason.CACHE_LEADER, winner, sources=sources), ScorerConfig()).splitlines()
    chain = "chain: master fell_through (master_breaker_open) 0.02 ms -> kvcm answered (CACHE_LEADER) 1.50 ms"
    assert chain in lines


def test_cost_aware_smaller_hit_is_named_only_in_the_cache_leader_order() -> None:
    """Under cost-aware, a smaller hit explains a loss only where the order ranks hit first (the cache-
    leader reasons); the shortest-TTFT order ranks cost alone, so there the loss is put down to cost."""
    scorer = ScorerConfig(policy=ScorerPolicy.COST_AWARE, near_tie_tokens=0)
    winner = CandidateExplain("w:1", "hot", 4, 64, 100, "PREFILL", None, chosen=True)
    loser = CandidateExplain("w:2", "cold", 0, 0, 90, "PREFILL", None)
    leader = _rows(render_table(_decision(Reason.CACHE_LEADER, winner, loser), scorer))["w:2"]
    assert leader == "lost: smaller hit (0 < 64 tokens)"
    for reason in (Reason.SHORTEST_TTFT, Reason.SHORTEST_TTFT_FALLBACK):
        said = _rows(render_table(_decision(reason, winner, loser), scorer))["w:2"]
        assert said.startswith("lost on cost: ") and "smaller hit" not in said, said
