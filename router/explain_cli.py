"""``kvroute explain``: route one request like ``kvroute route`` and show every candidate and why.

Same input and exit status as ``kvroute route``. The table lists each candidate the decision
considered: where it came from (KVCM's hot set, discovery's cold picks, the shadow index), its role,
cached blocks, hit and work in tokens, and its outcome: WON (with the decision's reason), dropped
(with the drop reason), or why it lost against the winner in the order the reason used, under the
configured ``--scorer-policy``: cache-affinity orders by hit and work; cost-aware by a cost the table
does not show (work plus a fixed cost per request queued and a copy price), then may spread near-ties.
"""

from __future__ import annotations

import argparse

from router.config import ScorerConfig
from router.logs import shown
from router.policy.cost_aware import SPREAD_REASONS
from router.route_cli import configure_input, run_command
from router.types import CandidateExplain, Reason, RouteDecision, ScorerPolicy, SourceStep, StageWindow

# Reasons whose winner is the first in TTFT order (least work); the others follow the cache-leader
# order (most hit, then least work) — the policy's leader order.
_TTFT_ORDER = frozenset(
    {
        Reason.SHORTEST_TTFT,
        Reason.SHORTEST_TTFT_LOW_CACHE_HIT,
        Reason.SHORTEST_TTFT_OUTSTANDING_GUARD,
        Reason.SHORTEST_TTFT_OUTSTANDING_GUARD_FALLBACK,
        Reason.SHORTEST_TTFT_FALLBACK,
    }
)
_TIE = "lost a tie: spread to the least recently selected worker (then a seeded random choice)"
# Every decision is made in the Scorer's one task and its pick is the answer: no claim can take a worker
# from under it, so a loss these orders do not explain is not put down to one.
_UNEXPLAINED = "not chosen, though its hit and work rank it ahead of the winner in this order"


def configure(parser: argparse.ArgumentParser) -> None:
    configure_input(parser)


def outcome(
    candidate: CandidateExplain, winner: CandidateExplain | None, reason: Reason, scorer: ScorerConfig
) -> str:
    """Why ``candidate`` won, was dropped, or lost to ``winner`` under ``scorer``'s policy (pure)."""
    if candidate.chosen:
        return f"WON: {reason.value}"
    if candidate.dropped is not None:
        return f"dropped: {candidate.dropped}"
    if winner is None or winner.work_tokens is None or candidate.work_tokens is None:
        return "scored, not chosen"
    if scorer.policy is ScorerPolicy.COST_AWARE:
        return _cost_outcome(candidate, winner, reason, scorer)
    more_work = candidate.work_tokens > winner.work_tokens
    work = f"more work ({candidate.work_tokens} > {winner.work_tokens} tokens)"
    if reason in _TTFT_ORDER:
        if more_work:
            return f"lost: {work}"
        if candidate.work_tokens == winner.work_tokens:
            return _TIE
        return _UNEXPLAINED
    if candidate.hit_tokens < winner.hit_tokens:
        return f"lost: smaller hit ({candidate.hit_tokens} < {winner.hit_tokens} tokens)"
    if candidate.hit_tokens == winner.hit_tokens:
        if more_work:
            return f"lost: same hit, {work}"
        if candidate.work_tokens == winner.work_tokens:
            return _TIE
    return _UNEXPLAINED


def _cost_outcome(candidate: CandidateExplain, winner: CandidateExplain, reason: Reason, scorer: ScorerConfig) -> str:
    """A loss under cost-aware: its orders rank the cost (:func:`policy_line`), not the work shown, so a
    candidate with less work (or more hit, in the shortest-TTFT order) lost on what the cost adds, or to
    near-tie spreading; a smaller hit still loses the cache-leader order."""
    if reason not in _TTFT_ORDER and candidate.hit_tokens < winner.hit_tokens:
        return f"lost: smaller hit ({candidate.hit_tokens} < {winner.hit_tokens} tokens)"
    why = "lost on cost: its cost was over the winner's (or equal, and the tie went to the winner)"
    if scorer.near_tie_tokens > 0 and reason in SPREAD_REASONS:
        if candidate.hit_tokens == winner.hit_tokens:
            why += f", or within {scorer.near_tie_tokens} tokens of it and near-tie spreading drew the winner"
        else:  # spreading moved the choice among the first pick's near-ties: they share its hit, the winner's
            why += (
                f", or cheaper than the winner, and near-tie spreading draws only among workers holding the "
                f"first pick's hit ({winner.hit_tokens} tokens)"
            )
    return why


def policy_line(scorer: ScorerConfig) -> str:
    """The policy the outcomes are read under, and for cost-aware what its cost is made of (pure)."""
    if scorer.policy is not ScorerPolicy.COST_AWARE:
        return f"policy: {scorer.policy.value}"
    return (
        f"policy: {scorer.policy.value}: ranks cost = work + {scorer.request_cost_tokens} x (waiting requests + 1)"
        f" + {scorer.copy_cost_weight:g} x pressure x (the best hit - its hit); the work column is the work alone"
    )


def render_table(decision: RouteDecision, scorer: ScorerConfig) -> str:
    """The decision summary, its stage timings, and one row per candidate, the outcomes under ``scorer``'s
    policy (pure)."""
    if decision.worker is not None:
        role = decision.role.value if decision.role is not None else "?"
        target = f"{decision.worker.http_target} ({role})"
    else:
        target = f"no worker ({decision.error or 'nothing to route to'})"
    lines = [
        f"request {shown(decision.request_id)}: {decision.route_source.value} / {decision.reason.value} -> {target}",
        f"hit {decision.hit_tokens} tokens ({decision.local_blocks} blocks) in {decision.elapsed_ms:.2f} ms",
    ]
    if decision.sources:
        lines.append("chain: " + " -> ".join(_step(step) for step in decision.sources))
    if decision.stage_ms:
        lines.append("stages: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in decision.stage_ms.items()))
    if decision.split is not None:
        lines.append(f"split: {decision.split.value}: " + ", ".join(_window(w) for w in decision.windows))
    if decision.error and decision.worker is not None:
        lines.append(f"note: {decision.error}")
    if not decision.candidates:
        lines.append("")
        lines.append(f"no candidates were scored: {decision.route_source.value} routing ({decision.reason.value})")
        return "\n".join(lines)
    lines.append(policy_line(scorer))
    lines.append("")
    winner = next((c for c in decision.candidates if c.chosen), None)
    header = ("worker", "from", "role", "blocks", "hit", "work", "outcome")
    rows = [
        (
            c.target,
            c.source,
            c.role or "-",
            str(c.local_blocks),
            str(c.hit_tokens) if c.dropped is None else "-",
            "-" if c.work_tokens is None else str(c.work_tokens),
            outcome(c, winner, decision.reason, scorer),
        )
        for c in decision.candidates
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header) - 1)]
    numeric = {3, 4, 5}
    for row in (header, *rows):
        cells = [row[i].rjust(w) if i in numeric else row[i].ljust(w) for i, w in enumerate(widths)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    return run_command(args, "explain", lambda decision, _args, config: render_table(decision, config.scorer))


def _window(window: StageWindow) -> str:
    """One wait's window, e.g. ``cache_query until 41.20 ms (cut)``: its end after the request's receipt."""
    return f"{window.stage.value} until {window.end_ms:.2f} ms" + (" (cut)" if window.cut else "")


def _step(step: SourceStep) -> str:
    """One source's part, e.g. ``kvcm fell_through (breaker_open) 0.02 ms``."""
    why = "" if step.reason is None else f" ({step.reason.value})"
    return f"{step.source.value} {step.outcome.value}{why} {step.elapsed_ms:.2f} ms"
