"""Companion role addresses: with prefill/decode separation an answer needs one worker per companion
role (DECODE, VIT) beside the prefill worker the chain chose.

A worker's role is what it reports in its status, so only workers the prober holds a usable status
for can be named: the least loaded by that status (outstanding uncached tokens, then waiting tasks),
exact ties broken at random. It reads the prober's cache and never probes on the request path; it
walks the fleet once per answer, which only deployments with companion roles pay.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from actors.sources.base import FleetView
from actors.worker_prober import WorkerProber
from router.config import KvrouteConfig
from router.types import Role, RoleAddr


class CompanionPicker:
    def __init__(self, config: KvrouteConfig, *, fleet: FleetView, prober: WorkerProber) -> None:
        self._fleet = fleet
        self._prober = prober
        self._rng = random.Random(config.scorer.seed)

    def fill(
        self, given: tuple[RoleAddr, ...], companions: Sequence[Role], *, rng: random.Random | None = None
    ) -> tuple[RoleAddr, ...]:
        """``given`` plus one address for each companion role it lacks (none when no worker of that
        role has a usable status). ``rng``: break ties with it instead of the picker's own generator."""
        missing = [role for role in companions if all(a.role is not role for a in given)]
        if not missing:
            return given
        rng = self._rng if rng is None else rng
        best: dict[Role, tuple[tuple[int, int, float], RoleAddr]] = {}
        for worker in self._fleet.workers():
            status = self._prober.cached(worker)
            if status is None or not status.alive or status.role not in missing:
                continue
            load = (status.outstanding_uncached_tokens, status.waiting_count, rng.random())
            held = best.get(status.role)
            if held is None or load < held[0]:
                best[status.role] = (load, RoleAddr(status.role, worker.ip, worker.http_port, worker.grpc_port))
        return given + tuple(best[role][1] for role in missing if role in best)
