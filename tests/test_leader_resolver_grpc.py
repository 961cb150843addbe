"""LeaderResolver over real loopback gRPC against SimKvcm replicas (issue 3, required test 9 for 1, 2, 3).

REAL clock, never MockClock: each test bounds itself with ``trio.fail_after``. The
replicas are the simulator's real gRPC servers with their fault knobs switched on;
calls are counted at the servers (``SimKvcmCluster.stats``). The resolver uses the real
``GrpcRawRpc`` over the ``ChannelPool``. No test asserts on wall-clock speed: "did not
wait" is shown by calling under an already-expired deadline, where any wait would raise
``trio.Cancelled`` instead of the expected answer. A round that must reach every replica is held
there by the ``hang`` knob until ``wait_in_flight`` has seen each call arrive; clearing the knob
then answers them, so no count depends on how fast a loaded machine runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import pytest
import trio
import trio.testing

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
# Rounds here end when the replicas answer or fail: the lookup timeout only guards against a hang.
CONFIG = LeaderConfig(lookup_timeout_s=5.0, backoff_initial_s=30.0, backoff_max_s=30.0, backoff_jitter_s=0.0)
# A round of black-holed calls ends only at the lookup timeout: room for its calls to reach the servers.
BLACKHOLE_CONFIG = dataclasses.replace(CONFIG, lookup_timeout_s=1.0)
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
        """Connect the pool's channel to every replica (one GetClusterInfo each); returns the call counts."""
        for target in self.targets:
            await self.client.get_cluster_info(target, "")
        return self.cluster_info_calls()

    async def wait_cluster_info_in_flight(self, count: int) -> None:
        """Until every replica has ``count`` GetClusterInfo calls in flight (counted at the servers)."""
        for node in self.node_ids():
            stats = self.cluster.kvcm.stats(node)
            reached = await trio.to_thread.run_sync(stats.wait_in_flight, paths.KVCM_GET_CLUSTER_INFO, count, 5.0)
            assert reached, f"{node}: never {count} GetClusterInfo in flight"

    def set_faults(self, faults: KvcmFaults) -> None:
        for node in self.node_ids():
            self.cluster.kvcm.set_faults(node, faults)

    def resolver(
        self, bootstrap: Callable[[], tuple[str, ...]] | None = None, config: LeaderConfig = CONFIG
    ) -> LeaderResolver:
        targets = self.targets
        return LeaderResolver(
            config, BreakerConfig(), self.client, bootstrap or (lambda: targets), instance_id="", inbox_size=64
        )

    async def start_resolver(self, bootstrap: Callable[[], tuple[str, ...]] | None = None) -> LeaderResolver:
        resolver = self.resolver(bootstrap)
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
        resolver = kvcm.resolver(config=BLACKHOLE_CONFIG)
        joined: list[UnavailableReason] = []

        async def hasty() -> None:
            with trio.move_on_after(0.05) as request_scope:
                await resolver.leader()
            assert request_scope.cancelled_caught  # left at its own deadline

        async def patient() -> None:
            with trio.fail_after(5), pytest.raises(LeaderUnavailable) as failed:
                await resolver.leader()
            joined.append(failed.value.reason)

        # Both callers ask before the resolver runs, so both wait for its first round: the hasty one
        # leaves at its deadline, the patient one stays in the round, which is cut at lookup_timeout_s ...
        async with trio.open_nursery() as callers:
            callers.start_soon(hasty)
            callers.start_soon(patient)
            await trio.testing.wait_all_tasks_blocked()  # both asks wait in the resolver's inbox
            await kvcm.nursery.start(resolver.run)
        assert joined == [UnavailableReason.FAILED]  # the round failed; not a fast failure after it
        snap = resolver.snapshot()
        assert (snap.state, snap.lookups_total) == (LeaderState.BACKING_OFF, 1)
        # ... and the servers see every call of that round go away.
        await kvcm.wait_cluster_info_in_flight(0)
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

        # GetClusterInfo hangs at every replica, so each call of the next round reaches its server
        # (seen below) before the first answer cancels the others.
        kvcm.set_faults(KvcmFaults(hang=True, methods=CLUSTER_INFO_ONLY))
        kvcm.cluster.kvcm.set_leader(kvcm.node_ids()[2])
        query = CacheQuery("", QueryType.PREFIX_MATCH, (1, 2, 3))
        with pytest.raises(NotLeader) as not_leader:
            await kvcm.client.get_host_cache_state(old, query)
        resolver.report_failure(old, not_leader.value)  # the resolver's task applies it and looks up
        await kvcm.wait_cluster_info_in_flight(1)
        kvcm.cluster.kvcm.clear_faults()  # the held calls are answered now

        assert (await resolver.leader()).target == new
        after = kvcm.cluster_info_calls()
        assert [b - a for a, b in zip(before, after, strict=True)] == [1] * REPLICAS  # one round ...
        assert resolver.snapshot().lookups_total == lookups + 1  # ... of concurrent calls
        await kvcm.client.get_host_cache_state(new, query)  # the new leader answers
        assert resolver.snapshot().leader_changes_total == 2


async def test_thousand_concurrent_callers_one_call_per_replica(kvcm: Kvcm) -> None:
    # GetClusterInfo hangs until the crowd has arrived, so all of it waits for the first lookup.
    results: list[str] = []
    with trio.fail_after(10):
        base = await kvcm.warm_up()
        kvcm.set_faults(KvcmFaults(hang=True, methods=CLUSTER_INFO_ONLY))
        resolver = await kvcm.start_resolver()

        async def caller() -> None:
            with trio.fail_after(5):
                results.append((await resolver.leader()).target)

        async with trio.open_nursery() as callers:
            for _ in range(1000):
                callers.start_soon(caller)
            await kvcm.wait_cluster_info_in_flight(1)  # the first lookup's calls are at every replica
            await trio.testing.wait_all_tasks_blocked()  # every caller waits for that lookup
            assert not results
            kvcm.cluster.kvcm.clear_faults()
    assert results == [kvcm.targets[0]] * 1000
    assert kvcm.cluster_info_calls() == [n + 1 for n in base]
    assert resolver.snapshot().lookups_total == 1
