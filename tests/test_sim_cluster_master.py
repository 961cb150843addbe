"""cluster_decide: SimMaster scheduling with the SimCluster's exact cache and queue knowledge (pure, no clock)."""

from __future__ import annotations

import pytest

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.cluster_master import cluster_decide
from kvroute_sim.sim.master import NoWorkerForRole, SimMaster
from kvroute_sim.sim.worker import WorkerFaults, WorkerSpec
from router.transport.memory_adapter import MemoryNetwork
from router.types import Role
from router.wire.master import MasterScheduleRequest

BLOCK = 16
KEYS = tuple(range(100, 110))  # 10 blocks = 160 tokens
NOW = 5.0


def _cluster(roles: list[str]) -> SimCluster:
    specs = [WorkerSpec(role=role, block_size=BLOCK, prefill_tokens_per_s=1000.0) for role in roles]
    cluster = SimCluster(specs, block_size=BLOCK)
    cluster.serve_memory(MemoryNetwork())
    return cluster


def _request(name: str = "r") -> MasterScheduleRequest:
    return MasterScheduleRequest(name, block_cache_keys=KEYS, block_size=BLOCK, seq_len=len(KEYS) * BLOCK)


def test_the_worker_holding_the_prefix_wins_while_its_queue_is_short() -> None:
    cluster = _cluster(["RoleType.PREFILL"] * 4)
    holder = cluster.worker_addr(2)
    cluster.kvcm.record_prefill(holder.http_target, KEYS)
    decide = cluster_decide(cluster, lambda: NOW)
    [pick] = decide(_request())
    assert (pick.role, pick.ip, pick.http_port, pick.grpc_port) == (
        Role.PREFILL,
        holder.ip,
        holder.http_port,
        holder.grpc_port,
    )
    # Deterministic: the same state always gives the same answer, whatever the request id.
    assert all(list(decide(_request(f"r{i}"))) == [pick] for i in range(20))


def test_a_long_queue_outweighs_the_cached_prefix() -> None:
    cluster = _cluster(["RoleType.PREFILL"] * 3)
    cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, KEYS)
    cluster.workers[1].submit("busy", 5000, 0, NOW)  # 5000 queued tokens > the 160 a cold worker computes
    [pick] = cluster_decide(cluster, lambda: NOW)(_request())
    assert pick.http_target == cluster.worker_addr(0).http_target  # cold and idle; ties go to the lowest index


def test_unreachable_workers_are_never_named() -> None:
    cluster = _cluster(["RoleType.PREFILL"] * 2)
    cluster.kvcm.record_prefill(cluster.worker_addr(0).http_target, KEYS)
    cluster.workers[0].set_faults(WorkerFaults(dead=True))
    decide = cluster_decide(cluster, lambda: NOW)
    assert [a.http_target for a in decide(_request())] == [cluster.worker_addr(1).http_target]
    cluster.workers[1].set_faults(WorkerFaults(dead=True))
    assert list(decide(_request())) == []  # SimMaster answers 8400


def test_prefill_decode_separation_names_one_worker_per_role() -> None:
    cluster = _cluster(["RoleType.PREFILL", "RoleType.PREFILL", "RoleType.DECODE", "RoleType.DECODE"])
    cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, KEYS)
    cluster.workers[2].submit("busy", 300, 0, NOW)
    picks = cluster_decide(cluster, lambda: NOW)(_request())
    assert [(a.role, a.http_target) for a in picks] == [
        (Role.DECODE, cluster.worker_addr(3).http_target),  # the least queued decode worker
        (Role.PREFILL, cluster.worker_addr(1).http_target),  # the prefix holder
    ]


def test_a_role_the_cluster_has_with_no_reachable_worker_is_the_schedulers_routing_failure() -> None:
    """A real scheduler answers 8402 (no prefill worker) rather than a routed reply without the role,
    which the frontend would fill from the role's domain and route."""
    cluster = _cluster(["RoleType.PREFILL", "RoleType.PREFILL", "RoleType.DECODE"])
    for i in (0, 1):
        cluster.workers[i].set_faults(WorkerFaults(dead=True))
    decide = cluster_decide(cluster, lambda: NOW)
    with pytest.raises(NoWorkerForRole) as missing:
        decide(_request())
    assert (missing.value.role, missing.value.code) == (Role.PREFILL, 8402)
    master = SimMaster(replicas=1, decide=decide)
    assert master._schedule_answer(_request())[:2] == (8402, "no available PREFILL worker")


def test_the_clock_is_read_per_decision() -> None:
    cluster = _cluster(["RoleType.PREFILL"] * 2)
    cluster.kvcm.record_prefill(cluster.worker_addr(0).http_target, KEYS)
    cluster.workers[0].submit("busy", 2000, 0, NOW)  # done 2 s after NOW at 1000 tokens/s
    now = [NOW]
    decide = cluster_decide(cluster, lambda: now[0])
    assert decide(_request())[0].http_target == cluster.worker_addr(1).http_target
    now[0] = NOW + 3.0  # the queue has drained: the holder wins again
    assert decide(_request())[0].http_target == cluster.worker_addr(0).http_target
