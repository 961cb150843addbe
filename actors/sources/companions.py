"""Companion role addresses: with prefill/decode separation an answer needs one worker per companion
role (DECODE, VIT) beside the prefill worker the chain chose.

A worker's role is what it reports in its status, so only workers the prober holds a usable status
for can be named: the least loaded by that status (outstanding uncached tokens, then waiting tasks),
exact ties broken at random. It reads the prober's cache and never probes on the request path.

Finding the least loaded walks the fleet, summing every worker's tasks: the walk's result (each
role's least loaded workers) is kept for as long as the fleet and the prober's published view are
the same objects (both are replaced, never changed) and no ejection ends, so the overloaded answers
drawn ahead and a burst of sheds walk it once, not once per answer. A kept worker whose status has
since aged out is noticed when it is picked, and the fleet is walked again.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import trio

from actors.sources.base import FleetView
from actors.worker_prober import ProberView, WorkerProber
from router.config import KvrouteConfig
from router.policy.plan import Fleet
from router.types import COMPANION_ROLES, Role, RoleAddr, WorkerAddr


@dataclass(frozen=True, slots=True)
class _Least:
    """One walk of ``fleet`` under ``view``: each companion role's least loaded workers (exact ties, in
    fleet order)."""

    fleet: Fleet
    view: ProberView
    until: float  # the first ejection end after the walk: an ejected worker may then be the least loaded
    tied: Mapping[Role, tuple[WorkerAddr, ...]]


class CompanionPicker:
    def __init__(self, config: KvrouteConfig, *, fleet: FleetView, prober: WorkerProber) -> None:
        self._fleet = fleet
        self._prober = prober
        self._rng = random.Random(config.scorer.seed)
        self._least: _Least | None = None

    def fill(
        self, given: tuple[RoleAddr, ...], companions: Sequence[Role], *, rng: random.Random | None = None
    ) -> tuple[RoleAddr, ...]:
        """``given`` plus one address for each companion role it lacks (none when no worker of that
        role has a usable status). ``rng``: break ties with it instead of the picker's own generator."""
        missing = [role for role in companions if all(a.role is not role for a in given)]
        if not missing:
            return given
        rng = self._rng if rng is None else rng
        picks: list[RoleAddr] = []
        for role in missing:
            for fresh in (False, True):
                tied = self._tied(role, fresh=fresh)
                if not tied:
                    break
                worker = tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]
                if self._prober.cached(worker) is not None:  # its status may have aged out since the walk
                    picks.append(RoleAddr(role, worker.ip, worker.http_port, worker.grpc_port))
                    break
        return given + tuple(picks)

    def _tied(self, role: Role, *, fresh: bool) -> tuple[WorkerAddr, ...]:
        fleet = self._fleet.current()
        view = self._prober.view()
        now = trio.current_time()
        least = self._least
        if fresh or least is None or least.fleet is not fleet or least.view is not view or now >= least.until:
            least = self._least = self._walk(fleet, view, now)
        return least.tied.get(role, ())

    def _walk(self, fleet: Fleet, view: ProberView, now: float) -> _Least:
        until = math.inf
        # The walk runs whenever the prober's view changed (on the request path, most times): it keeps
        # the bare workers, and an address is made only for the one picked.
        best: dict[Role, tuple[tuple[int, int], list[WorkerAddr]]] = {}
        for worker in fleet.workers:
            status = self._prober.cached(worker)
            if status is None:
                seen = view.workers.get(worker)
                if seen is not None and seen.ejected_until > now:
                    until = min(until, seen.ejected_until)
                continue
            if not status.alive or status.role not in COMPANION_ROLES:
                continue
            load = (status.outstanding_uncached_tokens, status.waiting_count)
            held = best.get(status.role)
            if held is None or load < held[0]:
                best[status.role] = (load, [worker])
            elif load == held[0]:
                held[1].append(worker)
        return _Least(fleet, view, until, {role: tuple(tied) for role, (_, tied) in best.items()})
