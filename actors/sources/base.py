"""What a source of the chain is, and what a request carries along it.

A request walks the chain in order. Each source gets the request's context and the time it may
spend (its window, a deadline that only ever shortens the request's own), and returns one of:

- :class:`Answered` — it chose the worker; the chain stops;
- :class:`FellThrough` — it could not help, with the reason; the next source is asked;
- :class:`Ended` — it ended the request with an error (no worker); the chain stops.

The last source of every chain is the domain fallback, which always answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from actors.discovery import Discovery
from actors.metrics_sink import MetricEvent
from actors.scorer import Scorer
from actors.worker_prober import WorkerProber
from router.decision_record import DecisionRecord, SourceAnswer
from router.policy.deadline_split import SplitWindows
from router.policy.plan import Fleet
from router.request import PreparedRequest
from router.slot_init import slot_init
from router.types import (
    CandidateExplain,
    HostMatch,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouteRequest,
    RouteSource,
    Stage,
    StageWindow,
    WorkerAddr,
)


@dataclass(slots=True)
class RequestSplit:
    """One request's deadline split: the wait ends it got, and the waits it ran (stage → the split's
    window ended it). Created before the chain, so a request the deadline ended still reports it."""

    windows: SplitWindows
    waits: dict[Stage, bool] = field(default_factory=dict)
    # When the last probe wait ended, however it ended (trio time; its window's end when the window or,
    # past it, the deadline cut it, since the task then runs late by the loop's lag): the tail is
    # measured from here.
    probes_ended_at: float | None = None

    def waited(self, stage: Stage, cut: bool) -> None:
        self.waits[stage] = cut or self.waits.get(stage, False)

    def probes_ended(self, now: float) -> None:
        """The probe wait is over at ``now``; the tail starts at the earlier of ``now`` and its window end."""
        self.probes_ended_at = min(now, self.windows.probe_end)

    def stage_windows(self, received_at: float) -> tuple[StageWindow, ...]:
        """The windows of the waits the request ran, in ms after its receipt."""
        w = self.windows
        return tuple(
            StageWindow(stage, (w.end(stage) - received_at) * 1000.0, cut) for stage, cut in self.waits.items()
        )


@dataclass(slots=True)
class RequestContext:
    """One request on its way along the chain; owned by the request's task.

    ``split`` says when each wait stops (``decide_at``: the last of them) so the decision itself
    fits before ``deadline``.
    ``cache_hosts`` is the positive part of the answer a cache source got (None: no cache
    answered; empty: it answered that nobody holds the prefix). A later source reads it to know
    whether it must stand in for the cache.
    """

    request: RouteRequest
    prepared: PreparedRequest
    received_at: float
    deadline: float
    split: RequestSplit
    stages: dict[Stage, float] = field(default_factory=dict)
    cache_hosts: tuple[HostMatch, ...] | None = None
    fallthrough: Reason | None = None  # the first reason the chain fell through with
    record: DecisionRecord | None = None  # filled by the sources when the decision log is on
    # What the sources observed for the metrics, sent with the decision (one message, not several).
    events: list[MetricEvent] = field(default_factory=list)
    # The Scorer's own time on this request's decisions (seconds; None: none reached it). The SCORE
    # stage is the hop's wall time, which also holds the wait in the Scorer's inbox behind the loop's
    # other tasks: admission counts that wait as the loop's lag, not as the request's own time.
    scorer_work_s: float | None = None

    def __post_init__(self) -> None:
        if self.record is not None:
            self.record.prepared = self.prepared

    @property
    def decide_at(self) -> float:
        """When the last wait (the probes) stops."""
        return self.split.windows.probe_end


@slot_init
@dataclass(frozen=True, slots=True)
class Answered:
    worker: WorkerAddr
    role: Role
    reason: Reason
    hit_tokens: int = 0
    local_blocks: int = 0
    candidates: tuple[CandidateExplain, ...] = ()
    error: str | None = None
    role_addrs: tuple[RoleAddr, ...] = ()  # empty: the chosen worker under its role


@slot_init
@dataclass(frozen=True, slots=True)
class FellThrough:
    reason: Reason
    to_last: bool = False  # skip the sources in between: only the last (domain) may answer


@dataclass(frozen=True, slots=True)
class Ended:
    reason: Reason
    error: str
    code: int = 0  # an upstream error code the request fails with (0: none)


@dataclass(frozen=True, slots=True)
class Skipped:
    """Not attempted: what an earlier source found makes this one moot."""


SourceResult = Answered | FellThrough | Ended | Skipped


class Source(Protocol):
    """One link of the chain."""

    kind: RouteSource  # the decision's route_source when this source answers
    needs_keys: bool  # whether it uses the request's block keys (hashing is skipped when none does)

    def window(self, ctx: RequestContext) -> float:
        """The deadline of this source's attempt (trio time), at most ``ctx.deadline``."""
        ...

    async def attempt(self, ctx: RequestContext) -> SourceResult: ...

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        """Work that must not delay the answer (observability, write-on-route); no awaits."""
        ...


class FleetView:
    """The discovery snapshot indexed for planning, rebuilt only when discovery publishes anew.

    Shared by the sources of one router; rebuilding also tells the prober and the Scorer which
    workers to keep.
    """

    __slots__ = ("_discovery", "_fleet", "_prober", "_scorer", "_version")

    def __init__(self, discovery: Discovery, prober: WorkerProber, scorer: Scorer) -> None:
        self._discovery = discovery
        self._prober = prober
        self._scorer = scorer
        self._version = -1
        self._fleet = Fleet.of(())

    def current(self) -> Fleet:
        snapshot = self._discovery.workers()
        if snapshot.version != self._version:
            self._fleet = Fleet.of(snapshot.workers)
            self._version = snapshot.version
            self._prober.retain(snapshot.workers)
            self._scorer.retain(snapshot.workers)
        return self._fleet

    def workers(self) -> Sequence[WorkerAddr]:
        return self.current().workers


def recorded_answer(record: DecisionRecord, started: float, arrived: float, result: SourceResult) -> SourceAnswer:
    """An opaque source's result as the decision log keeps it (times relative to the request's receipt)."""
    r = record.received_at
    if isinstance(result, Answered):
        return SourceAnswer(started - r, arrived - r, "answered", result.reason, role_addrs=result.role_addrs)
    if isinstance(result, FellThrough):
        return SourceAnswer(started - r, arrived - r, "fell_through", result.reason, to_last=result.to_last)
    if isinstance(result, Ended):
        return SourceAnswer(started - r, arrived - r, "ended", result.reason, error=result.error, code=result.code)
    return SourceAnswer(started - r, arrived - r, "skipped", Reason.FEATURE_OFF)


def ms(seconds: float) -> float:
    return seconds * 1000.0
