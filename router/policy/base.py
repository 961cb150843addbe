"""The policy seam: what the router asks of a selection policy.

A policy plans the candidates for a cache answer, decides from the statuses observed for them,
and records each choice (its own and the fallbacks'), so later decisions see the load it adds.
It does no I/O and reads no clock (time is passed in); the Scorer actor owns the one instance.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from router.types import DropReason, HostMatch, Role, WorkerAddr, WorkerStatus

if TYPE_CHECKING:
    from router.policy.cache_affinity import ObservedStatus, Selection
    from router.policy.plan import CandidatePlan, CandidateSource, Fleet


@dataclass(frozen=True, slots=True)
class PolicyHealth:
    policy: str
    tracked_workers: int  # workers in the selection ledger
    # Pre-charges not yet compacted: a charge a newer status covers no longer counts in scoring, but
    # leaves this count only when its worker is selected again (or forgotten).
    pending_charges: int
    observed_statuses: int  # per-status scoring views kept for reuse


class Policy(Protocol):
    name: str

    def plan(
        self,
        hosts: Sequence[HostMatch],
        fleet: Fleet,
        *,
        request_id: str,
        source: CandidateSource,
        ejected: Collection[WorkerAddr],
        unfit: Callable[[WorkerAddr], bool] | None = None,
    ) -> CandidatePlan:
        """The candidates to probe and score for a cache answer's ``hosts`` (``unfit``: workers the
        plan passes over, hot or cold, those known to serve another role or to be down)."""
        ...

    def observe(self, worker: WorkerAddr, status: WorkerStatus, taken_at: float) -> ObservedStatus:
        """The scoring view of a status in hand."""
        ...

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
        """Choose from ``plan`` given the statuses observed, and record the choice at ``now``."""
        ...

    def record(
        self,
        worker: WorkerAddr,
        uncached_tokens: int,
        now: float,
        status_taken_at: float | None = None,
        *,
        requests: int = 1,
    ) -> None:
        """Record dispatches the policy did not decide (a fallback's): ``requests`` of them (sheds are
        charged in sums), ``uncached_tokens`` in all."""
        ...

    def retain(self, workers: Collection[WorkerAddr]) -> None:
        """Forget what is kept of every worker not in ``workers`` (those discovery lists no more)."""
        ...

    def health(self) -> PolicyHealth: ...
