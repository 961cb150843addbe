"""Companion role addresses: with prefill/decode separation an answer needs one worker per companion
role (DECODE, VIT) beside the prefill worker the chain chose.

A worker's role is what it reports in its status, so only workers the prober holds a usable status
for can be named: of two drawn at random among them, the less loaded by that status (outstanding
uncached tokens, then waiting tasks, then running tasks: a decode worker's load is its running
requests, which have no uncached tokens left). Not the least loaded of all: a companion is named by
no cache answer, so its status is refreshed only by the health probes (``prober.health_interval_s``),
and every request between two refreshes would go to the one worker least loaded at the last. It
reads the prober's cache and never probes on the request path.

Ranking walks the fleet, summing every worker's tasks: the walk's result (each role's usable
workers and their loads) is kept for as long as the fleet and the prober's published view are the
same objects (both are replaced, never changed) and no ejection ends, so the overloaded answers
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

_Load = tuple[int, int, int]  # outstanding uncached tokens, waiting tasks, running tasks


@dataclass(frozen=True, slots=True)
class _Usable:
    """One walk of ``fleet`` under ``view``: each companion role's usable workers with their loads, in
    fleet order."""

    fleet: Fleet
    view: ProberView
    until: float  # the first ejection end after the walk: an ejected worker may then be usable
    ranked: Mapping[Role, tuple[tuple[_Load, WorkerAddr], ...]]


def less_loaded_of_two(usable: Sequence[tuple[_Load, WorkerAddr]], rng: random.Random) -> WorkerAddr:
    """Of two distinct workers drawn at random from ``usable`` (not empty), the less loaded; the first
    drawn on a tie (pure)."""
    if len(usable) == 1:
        return usable[0][1]
    first = rng.randrange(len(usable))
    second = rng.randrange(len(usable) - 1)
    if second >= first:
        second += 1
    (load_a, a), (load_b, b) = usable[first], usable[second]
    return b if load_b < load_a else a


class CompanionPicker:
    def __init__(self, config: KvrouteConfig, *, fleet: FleetView, prober: WorkerProber) -> None:
        self._fleet = fleet
        self._prober = prober
        self._rng = random.Random(config.scorer.seed)
        self._usable: _Usable | None = None

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
                usable = self._ranked(role, fresh=fresh)
                if not usable:
                    break
                worker = less_loaded_of_two(usable, rng)
                if self._prober.cached(worker) is not None:  # its status may have aged out since the walk
                    picks.append(RoleAddr(role, worker.ip, worker.http_port, worker.grpc_port))
                    break
        return given + tuple(picks)

    def _ranked(self, role: Role, *, fresh: bool) -> tuple[tuple[_Load, WorkerAddr], ...]:
        fleet = self._fleet.current()
        view = self._prober.view()
        now = trio.current_time()
        usable = self._usable
        if fresh or usable is None or usable.fleet is not fleet or usable.view is not view or now >= usable.until:
            usable = self._usable = self._walk(fleet, view, now)
        return usable.ranked.get(role, ())

    def _walk(self, fleet: Fleet, view: ProberView, now: float) -> _Usable:
        until = math.inf
        # The walk runs whenever the prober's view changed (on the request path, most times): it keeps
        # the bare workers, and an address is made only for the one picked.
        ranked: dict[Role, list[tuple[_Load, WorkerAddr]]] = {}
        for worker in fleet.workers:
            status = self._prober.cached(worker)
            if status is None:
                seen = view.workers.get(worker)
                if seen is not None and seen.ejected_until > now:
                    until = min(until, seen.ejected_until)
                continue
            if not status.alive or status.role not in COMPANION_ROLES:
                continue
            load = (status.outstanding_uncached_tokens, status.waiting_count, len(status.running))
            ranked.setdefault(status.role, []).append((load, worker))
        return _Usable(fleet, view, until, {role: tuple(workers) for role, workers in ranked.items()})
