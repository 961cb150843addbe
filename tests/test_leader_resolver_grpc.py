"""LeaderResolver over real loopback gRPC against SimKvcm replicas (issue 3, required test 9 for 1, 2, 3).

REAL clock, never MockClock: each test bounds itself with ``trio.fail_after``. The
replicas are the simulator's real gRPC servers with their fault knobs switched on;
calls are counted at the servers (``SimKvcmCluster.stats``). The resolver uses the real
``GrpcRawRpc`` over the ``ChannelPool``. No test asserts on wall-clock speed: "did not
wait" is shown by calling under an already-expired deadline, where any wait would raise
``trio.Cancelled`` instead of the expected answer.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest
import trio

from actors.channel_pool import ChannelPool
from actors.leader_resolver import LeaderResolver, LeaderState, LeaderUnavailable, UnavailableReason
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.kvcm import KvcmFaults
from router.config import BreakerConfig, ChannelPoolConfig, LeaderConfig
from router.transport.clients import KvcmClient
from router.transport.errors import NotLeader
from router.transport.grpc_adapter import GrpcRawRpc
from router.types import CacheQuery, QueryType
from router.wire import paths

REPLICAS = 3
CONFIG = LeaderConfig(lookup_timeout_s=0.3, backoff_initial_s=30.0, backoff_max_s=30.0, backoff_jitter_s=0.0)
CLUSTER_INFO_ONLY = frozenset({paths.KVCM_GET_CLUSTER_INFO})


@dataclass
class Kvcm:
    cluster: SimCluster
    targets: tuple[str, ...]  # bootstrap targets, in node order
    client: KvcmClient
    nursery: trio.Nursery

    def node_ids(self) -> tuple[str, ...]:
        return self.cluster.kvcm.node_ids

    def cluster_info_calls(self) -> list[int]:
        return [self.cluster.kvcm.stats(n).get(paths.KVCM_GET_CLUSTER_INFO).calls for n in self.node_ids()]

    async def warm_up(self) -> list[int]:
        """Connect the pool's channel to every replica (one GetClusterInfo each); returns the call counts.

        Counts at the servers are exact only for calls that reach them: with channels already
        connected, every call of a round arrives well before the round's first answer.
        """
        for target in self.targets:
            await self.client.get_cluster_info(target, "")
        return self.cluster_info_calls()

    def set_faults(self, faults: KvcmFaults) -> None:
        for node in self.node_ids():
            self.cluster.kvcm.set_faults(node, faults)

    async def start_resolver(self, bootstrap: Callable[[], tuple[str, ...]] | None = None) -> LeaderResolver:
        targets = self.targets
        resolver = LeaderResolver(
            CONFIG, BreakerConfig(), self.client, bootstrap or (lambda: targets), instance_id="", inbox_size=64
        )
        await self.nursery.start(resolver.run)
        return resolver


@pytest.fixture
async def kvcm(nursery: trio.Nursery) -> AsyncIterator[Kvcm]:
    cluster = SimCluster(workers=1, kvcm_replicas=REPLICAS)
    pool: ChannelPool[grpc.Channel] = ChannelPool(ChannelPoolConfig())
    with trio.fail_after(10):
        addresses = await nursery.start(functools.partial(cluster.serve_grpc, max_threads=4))
        await nursery.start(pool.run)
    yield Kvcm(cluster, addresses.kvcm_targets, KvcmClient(GrpcRawRpc(pool, start_off_loop=True)), nursery)
    await pool.aclose()


async def answer_without_waiting(resolver: LeaderResolver) -> UnavailableReason | str:
    """Call leader() under an already-expired deadline: any wait would raise Cancelled."""
    with trio.CancelScope(deadline=-float("inf")):
        try:
            return (await resolver.leader()).target
        except LeaderUnavailable as exc:
            return exc.reason
    raise AssertionError("leader() waited (it was cancelled) instead of answering at once")


async def test_dead_replicas_first_lookup_fails_then_backoff_costs_no_rpc(kvcm: Kvcm) -> None:
    with trio.fail_after(10):
        base = await kvcm.warm_up()
        kvcm.set_faults(KvcmFaults(dead=True))  # every replica answers UNAVAILABLE
        resolver = await kvcm.start_resolver()
        with trio.fail_after(2), pytest.raises(LeaderUnavailable) as first:  # the request's deadline
            await resolver.leader()
        assert first.value.reason in (UnavailableReason.FAILED, UnavailableReason.BACKING_OFF)
        assert kvcm.cluster_info_calls() == [n + 1 for n in base]  # one concurrent round
        for _ in range(1000):
            assert await answer_without_waiting(resolver) is UnavailableReason.BACKING_OFF
        assert kvcm.cluster_info_calls() == [n + 1 for n in base]  # zero RPCs while backing off
        snap = resolver.snapshot()
        assert (snap.state, snap.consecutive_failures) == (LeaderState.BACKING_OFF, 1)
        assert snap.last_error is not None and "unavailable" in snap.last_error


async def test_blackholed_replicas_caller_leaves_at_deadline_and_calls_are_cancelled(kvcm: Kvcm) -> None:
    with trio.fail_after(10):
        base = await kvcm.warm_up()
        kvcm.set_faults(KvcmFaults(hang=True))  # accept, never answer
        resolver = await kvcm.start_resolver()
        with trio.move_on_after(0.05) as request_scope:
            await resolver.leader()
        assert request_scope.cancelled_caught  # left at its own deadline
        # A patient caller joins the same round, which is cut at lookup_timeout_s ...
        with trio.fail_after(2), pytest.raises(LeaderUnavailable) as joined:
            await resolver.leader()
        assert joined.value.reason is UnavailableReason.FAILED
        assert resolver.snapshot().state is LeaderState.BACKING_OFF
        # ... and the servers see every call of that round go away.
        for node in kvcm.node_ids():
            stats = kvcm.cluster.kvcm.stats(node)
            gone = await trio.to_thread.run_sync(stats.wait_in_flight, paths.KVCM_GET_CLUSTER_INFO, 0, 5.0)
            assert gone, node
        for _ in range(1000):
            assert await answer_without_waiting(resolver) is UnavailableReason.BACKING_OFF
        assert kvcm.cluster_info_calls() == [n + 1 for n in base]


async def test_leader_moves_found_with_one_concurrent_round(kvcm: Kvcm) -> None:
    old, new = kvcm.targets[0], kvcm.targets[2]
    bootstrap: tuple[str, ...] = (old,)  # the first lookup asks the leader only: counted exactly
    with trio.fail_after(10):
        resolver = await kvcm.start_resolver(lambda: bootstrap)
        assert (await resolver.leader()).target == old
        before = await kvcm.warm_up()
        bootstrap = kvcm.targets
        lookups = resolver.snapshot().lookups_total

        # Every replica answers GetClusterInfo after 0.2 s, so each call of the next round reaches
        # its server before the first answer cancels the others.
        kvcm.set_faults(KvcmFaults(delay_s=0.2, methods=CLUSTER_INFO_ONLY))
        kvcm.cluster.kvcm.set_leader(kvcm.node_ids()[2])
        query = CacheQuery("", QueryType.PREFIX_MATCH, (1, 2, 3))
        with pytest.raises(NotLeader) as not_leader:
            await kvcm.client.get_host_cache_state(old, query)
        resolver.report_failure(old, not_leader.value)
        await trio.testing.wait_all_tasks_blocked()  # the resolver's task applies the report

        assert (await resolver.leader()).target == new
        after = kvcm.cluster_info_calls()
        assert [b - a for a, b in zip(before, after, strict=True)] == [1] * REPLICAS  # one round ...
        assert resolver.snapshot().lookups_total == lookups + 1  # ... of concurrent calls
        await kvcm.client.get_host_cache_state(new, query)  # the new leader answers
        assert resolver.snapshot().leader_changes_total == 2


async def test_thousand_concurrent_callers_one_call_per_replica(kvcm: Kvcm) -> None:
    # Slow GetClusterInfo, so the crowd arrives while the first lookup is in flight.
    results: list[str] = []
    with trio.fail_after(10):
        base = await kvcm.warm_up()
        kvcm.set_faults(KvcmFaults(delay_s=0.2, methods=CLUSTER_INFO_ONLY))
        resolver = await kvcm.start_resolver()

        async def caller() -> None:
            with trio.fail_after(5):
                results.append((await resolver.leader()).target)

        async with trio.open_nursery() as callers:
            for _ in range(1000):
                callers.start_soon(caller)
    assert results == [kvcm.targets[0]] * 1000
    assert kvcm.cluster_info_calls() == [n + 1 for n in base]
