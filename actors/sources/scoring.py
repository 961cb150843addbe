"""Plan, probe and score the candidates of a cache answer: the shared work of the cache sources.

The policy (owned by the Scorer actor) plans the candidates; the WorkerProber brings their
statuses under the one global probe budget until ``decide_at`` (the split's probe window); the Scorer decides with what
arrived. Every stage is timed into the request's ``stage_ms``; the Scorer's own work on the
decision (without its inbox wait, which the SCORE stage holds) goes to ``scorer_work_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from actors.metrics_sink import CandidatesDropped, MetricsSink, ProbeSkipped, StatusLookups
from actors.scorer import DecideRequest, Scorer
from actors.sources.base import Answered, FellThrough, FleetView, RequestContext, SourceResult, ms
from actors.worker_prober import ProbeOutcome, SkipReason, WorkerProber
from router.decision_record import ProbeRecord, ScoringRecord
from router.policy.cache_affinity import Selection
from router.policy.ledger import NEVER
from router.policy.plan import CandidateSource
from router.types import DropReason, HostMatch, Reason, Stage, WorkerAddr, WorkerStatus

_SKIP_DROPS = {
    SkipReason.EJECTED: DropReason.EJECTED,
    SkipReason.NO_BUDGET: DropReason.PROBE_SKIPPED,
    SkipReason.DEADLINE: DropReason.PROBE_SKIPPED,
    SkipReason.STOPPED: DropReason.PROBE_SKIPPED,
    SkipReason.GONE: DropReason.PROBE_SKIPPED,
    SkipReason.QUEUED: DropReason.PROBE_SKIPPED,
}


def selection_result(selection: Selection) -> SourceResult:
    """A cache source's result for the policy's selection: the pick, or NO_CANDIDATES."""
    if selection.worker is None or selection.role is None:
        return FellThrough(Reason.NO_CANDIDATES)
    return Answered(
        worker=selection.worker,
        role=selection.role,
        reason=selection.reason,
        hit_tokens=selection.hit_tokens,
        local_blocks=selection.local_blocks,
        candidates=selection.explain(),
    )


def _noting(skip: Callable[[WorkerAddr], bool], skipped: list[str]) -> Callable[[WorkerAddr], bool]:
    """``skip``, noting the target of each worker it skips in ``skipped``."""

    def noted(worker: WorkerAddr) -> bool:
        if skip(worker):
            skipped.append(worker.http_target)
            return True
        return False

    return noted


class CandidateScoring:
    def __init__(self, *, scorer: Scorer, prober: WorkerProber, fleet: FleetView, metrics: MetricsSink) -> None:
        self._scorer = scorer
        self._prober = prober
        self._fleet = fleet
        self._metrics = metrics

    def plannable(self) -> Callable[[str], bool]:
        """Whether a host (``ip:port``) can take a hot place in a plan now: a discovered worker, not
        ejected (the plan drops the others)."""
        by_target = self._fleet.current().by_http_target
        ejected = self._prober.ejected()

        def usable(host: str) -> bool:
            worker = by_target.get(host)
            return worker is not None and not (ejected and worker in ejected)

        return usable

    async def choose(self, ctx: RequestContext, hosts: Sequence[HostMatch], source: CandidateSource) -> SourceResult:
        """The chosen worker for ``hosts``, or a fall-through with NO_CANDIDATES."""
        prepared = ctx.prepared
        t = trio.current_time()
        fleet = self._fleet.current()
        ejected = self._prober.ejected()
        # A place on a worker of another role (a decode worker beside the prefill ones, or holding the
        # prefix too), or on one that says it is not alive, would be dropped after its probe: a usable
        # idle worker of the request's roles would seldom be found, and a holder that can serve the
        # request could lose its hot slot.
        other_role = self._prober.unfit_for(prepared.roles)
        passed_over: list[str] = []
        if ctx.record is not None:  # replay needs the workers passed over, not their roles
            other_role = _noting(other_role, passed_over)
        plan = self._scorer.plan(
            hosts,
            fleet,
            request_id=ctx.request.request_id,
            source=source,
            ejected=ejected,  # an ejected holder takes no hot slot
            unfit=other_role,
        )
        ctx.stages[Stage.PLAN] = ms(trio.current_time() - t)

        t = trio.current_time()
        handle = self._prober.probe([c.worker for c in plan.candidates], ctx.decide_at)
        arrivals: dict[WorkerAddr, float] | None = None
        cut: bool | None = None  # whether the probe window ended the wait (None: the wait raised)
        try:
            if ctx.record is not None:  # the decision log wants each result's arrival time
                arrivals = {}
                with trio.move_on_at(ctx.decide_at) as waiting:
                    async for arrived in handle:
                        arrivals[arrived.worker] = trio.current_time() - ctx.record.received_at
                cut = waiting.cancelled_caught
            elif handle.pending:  # all fresh from the cache (the warm case): nothing to wait for
                with trio.move_on_at(ctx.decide_at) as waiting:
                    await handle.wait_all()
                cut = waiting.cancelled_caught
            else:
                cut = False
        finally:
            # However the wait ends: a task woken after the request's deadline is cancelled by the deadline
            # here, not by the window, and its lateness is the tail the split exists to leave room for.
            # Its window is not marked cut: the deadline, not the window, ended it (as a replay reads it).
            if cut is not None:
                ctx.split.waited(Stage.PROBE, cut)
            ctx.split.probes_ended(trio.current_time())
        statuses: dict[WorkerAddr, tuple[WorkerStatus, float]] = {}
        missing: dict[WorkerAddr, DropReason] = {}
        cache_hits = from_background = 0
        skipped: dict[str, int] = {}
        for result in handle.results():
            worker = result.worker
            if result.status is not None and result.sent_at is not None:
                cache_hits += result.from_cache
                from_background += result.background
                statuses[worker] = (result.status, result.sent_at)
                continue
            if result.outcome is ProbeOutcome.SKIPPED and result.skip_reason is not None:
                skipped[result.skip_reason.value] = skipped.get(result.skip_reason.value, 0) + 1
            observed = self._prober.cached_observed(worker)  # an older, still usable status in hand
            if observed is not None:
                statuses[worker] = observed
            elif result.outcome is ProbeOutcome.SKIPPED and result.skip_reason is not None:
                missing[worker] = _SKIP_DROPS[result.skip_reason]
            elif result.outcome is ProbeOutcome.FAILED:
                missing[worker] = DropReason.PROBE_FAILED
        not_asked = skipped.get(SkipReason.EJECTED.value, 0) + skipped.get(SkipReason.GONE.value, 0)
        probed = len(handle.workers) - cache_hits - not_asked
        ctx.events.append(StatusLookups(cache_hits, from_background, probed))
        for reason, n in skipped.items():
            ctx.events.append(ProbeSkipped(reason, n))
        ctx.stages[Stage.PROBE] = ms(trio.current_time() - t)

        t = trio.current_time()
        selection, work_s = await self._scorer.decide(
            DecideRequest(
                plan=plan,
                statuses=statuses,
                missing=missing,
                seq_len=prepared.seq_len,
                block_size=prepared.block_size,
                roles=prepared.roles,
                now=t,
            )
        )
        ctx.stages[Stage.SCORE] = ms(trio.current_time() - t)
        ctx.scorer_work_s = work_s + (ctx.scorer_work_s or 0.0)  # a second cache source may score too
        # Counted from every scoring, not from the decision's candidates: a selection that dropped them
        # all falls through, and a second source's candidates replace the first's in the decision.
        for drop, n in selection.drop_counts:
            ctx.events.append(CandidatesDropped(drop.value, n))
        if ctx.record is not None and arrivals is not None:
            r = ctx.record.received_at
            ledger_view = selection.sheet.ledger_view()
            ctx.record.scorings.append(
                ScoringRecord(
                    source=source,
                    hosts=tuple(hosts),
                    fleet=fleet,
                    ejected=tuple(w.http_target for w in ejected),
                    other_roles=tuple(passed_over),
                    probes=tuple(
                        ProbeRecord(
                            c.target,
                            arrivals.get(c.worker),
                            statuses[c.worker][0] if c.worker in statuses else None,
                            statuses[c.worker][1] - r if c.worker in statuses else None,
                            missing.get(c.worker),
                        )
                        for c in plan.candidates
                    ),
                    decided=t - r,
                    ledger=tuple(
                        (target, pending, None if last == NEVER else last, tie)
                        for target, pending, last, tie in ledger_view
                    ),
                )
            )
        return selection_result(selection)
