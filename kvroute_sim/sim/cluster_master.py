"""A SimMaster that schedules like a good central scheduler: with the SimCluster's exact knowledge.

``cluster_decide(cluster, clock)`` is a ``Decide`` for :class:`SimMaster`: for every role the
cluster's workers report, the reachable worker with the least cost at ``clock()``, where

- a prefill-capable role (PREFILL, PDFUSION) costs the request's uncached prefill tokens on
  that worker (its exact cached prefix in the KVCM sim's index) plus the worker's queued tokens;
- a companion role (DECODE, VIT) costs its queued tokens.

Ties go to the lowest worker index, so the same cluster state always gives the same answer.
A role the cluster has with no reachable worker: the scheduler's routing failure for it (8402–8405,
``NoWorkerForRole``), as a real one answers; no worker at all: 8400.

A request that carries token ids and no keys is hashed here in ``family`` (the scheduler's own hash
family, the deployment's), as the real scheduler hashes ``input_ids``.

``clock`` is what "now" means to the workers' queues: the trio clock the sims read, or the demo's
simulated clock. ``decide`` may run on a gRPC handler thread, so ``clock`` must be safe to call there
(the cluster's own reads are locked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.master import Decide, NoWorkerForRole
from router.keys import block_keys
from router.types import KeyFamily, Role, RoleAddr
from router.wire.master import MASTER_ROLES, MasterScheduleRequest

PREFILL_CAPABLE = frozenset({Role.PREFILL, Role.PDFUSION})


def cluster_decide(cluster: SimCluster, clock: Callable[[], float], family: KeyFamily = KeyFamily.RTP) -> Decide:
    """A deterministic ``Decide`` minimising (uncached prefill tokens + queued tokens) per role."""
    roles = [Role.parse(worker.spec.role) for worker in cluster.workers]

    def decide(request: MasterScheduleRequest) -> Sequence[RoleAddr]:
        now = clock()
        addrs = cluster.addresses.workers
        keys = request.block_cache_keys
        if not keys and request.input_ids:
            keys = block_keys(request.input_ids, cluster.block_size, family)
        chosen: list[RoleAddr] = []
        any_reachable = any(worker.reachable(now) for worker in cluster.workers)  # none: 8400, not a role's code
        for role in MASTER_ROLES:
            best: tuple[int, int] | None = None  # (cost, worker index)
            for index, worker in enumerate(cluster.workers):
                if roles[index] is not role or not worker.reachable(now):
                    continue
                cost = worker.outstanding_tokens(now)
                if role in PREFILL_CAPABLE:
                    cost += uncached_tokens(cluster, addrs[index].http_target, keys, request.seq_len)
                if best is None or (cost, index) < best:
                    best = (cost, index)
            if best is not None:
                addr = addrs[best[1]]
                chosen.append(RoleAddr(role, addr.ip, addr.http_port, addr.grpc_port))
            elif role in roles and any_reachable:
                raise NoWorkerForRole(role)
        return chosen

    return decide


def uncached_tokens(cluster: SimCluster, host: str, keys: Sequence[int], seq_len: int) -> int:
    """The prompt tokens of a request with these block ``keys`` that ``host`` has not cached (its exact
    prefix in the index)."""
    seq_len = max(seq_len, len(keys) * cluster.block_size)
    if not keys:
        return seq_len
    cached = cluster.kvcm.local_prefix(host, keys) * cluster.block_size
    return max(0, seq_len - cached)
