"""LeaderResolver under MockClock(autojump) with the in-memory network.

Only the remote KVCM peers are faked (handlers that speak the wire bytes); the resolver,
the typed client, the decoders and the breaker are the real ones. RPCs are counted at the
network (``MemoryNetwork.call_count``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable

import pytest
import trio
import trio.testing

from actors.breaker import ANSWERED_WINDOW, Admission, BreakerState
from actors.inbox import ask
from actors.leader_resolver import (
    ANSWERED_SAMPLE_EVERY,
    LeaderResolver,
    LeaderState,
    LeaderUnavailable,
    UnavailableReason,
    _AskLeader,
    _Invalidate,
    _LookupResult,
    _Outcome,
    leader_problems,
)
from actors.metrics_sink import MetricsSink
from router.config import BreakerConfig, LeaderConfig, MetricsConfig
from router.transport.clients import KvcmClient
from router.transport.errors import (
    DeadlineExceeded,
    GarbledReply,
    NotLeader,
    PeerAbort,
    RemoteError,
    RpcStatus,
    TransportError,
    Unavailable,
)
from router.transport.memory_adapter import Handler, MemoryNetwork
from router.types import CacheQuery, QueryType
from router.wire import kvcm_meta_pb2 as kvcm_pb
from router.wire import paths

NODES = ("10.0.0.1:6381", "10.0.0.2:6381", "10.0.0.3:6381")
LEADER_CFG = LeaderConfig(
    refresh_interval_s=10.0,
    max_staleness_s=30.0,
    lookup_timeout_s=0.5,
    backoff_initial_s=0.05,
    backoff_max_s=5.0,
    backoff_jitter_s=0.05,
    no_leader_retry_s=0.2,
)
BREAKER_CFG = BreakerConfig(failure_threshold=5, cooldown_s=1.0, cooldown_max_s=30.0)
INSTANCE = "deploy_64"


def cluster_info_reply(leader: str | None, self_node: str = "n", code: int = kvcm_pb.OK) -> bytes:
    reply = kvcm_pb.GetClusterInfoResponse(self_node_id=self_node)
    reply.header.status.code = code  # type: ignore[assignment]
    if leader is not None:
        host, _, port = leader.rpartition(":")
        reply.leader_node_id = f"node-{leader}"
        reply.leader_endpoint.node_id = f"node-{leader}"
        reply.leader_endpoint.host = host
        reply.leader_endpoint.meta_rpc_port = int(port)
    return reply.SerializeToString()


def cache_state_reply(code: int = kvcm_pb.OK) -> bytes:
    reply = kvcm_pb.GetHostCacheStateResponse()
    reply.header.status.code = code  # type: ignore[assignment]
    return reply.SerializeToString()


class FakeKvcm:
    """The remote KVCM replicas: any node answers GetClusterInfo with the cluster's current leader.

    ``delay`` per node (virtual time), ``hang`` nodes never answer (and record being cancelled),
    ``no_leader`` makes every node answer "no leader elected".
    """

    def __init__(self, network: MemoryNetwork, nodes: tuple[str, ...] = NODES) -> None:
        self.nodes = nodes
        self.leader: str | None = nodes[0]
        self.delay: dict[str, float] = {}
        self.hang: set[str] = set()
        self.cancelled: list[str] = []
        self.query_code = kvcm_pb.OK
        self.query_hang = False
        self.instance_ids: list[str] = []
        for node in nodes:
            network.serve(node, functools.partial(self._handle, node))

    async def _handle(self, node: str, method: str, request: bytes) -> bytes:
        if method == paths.KVCM_GET_CLUSTER_INFO:
            self.instance_ids.append(kvcm_pb.GetClusterInfoRequest.FromString(request).instance_id)
        try:
            if node in self.hang:
                await trio.sleep_forever()
            await trio.sleep(self.delay.get(node, 0.0))
            if method == paths.KVCM_GET_CLUSTER_INFO:
                return cluster_info_reply(self.leader, node)
            assert method == paths.KVCM_GET_HOST_CACHE_STATE
            if self.query_hang:
                await trio.sleep_forever()
            if node != self.leader:
                return cache_state_reply(kvcm_pb.SERVER_NOT_LEADER)
            return cache_state_reply(self.query_code)
        except trio.Cancelled:
            self.cancelled.append(node)
            raise


def cluster_info_calls(network: MemoryNetwork, target: str | None = None) -> int:
    return network.call_count(target, paths.KVCM_GET_CLUSTER_INFO)


async def start_resolver(
    nursery: trio.Nursery,
    network: MemoryNetwork,
    bootstrap: Callable[[], tuple[str, ...]] = lambda: NODES,
    config: LeaderConfig = LEADER_CFG,
    breaker: BreakerConfig = BREAKER_CFG,
) -> LeaderResolver:
    resolver = LeaderResolver(config, breaker, KvcmClient(network), bootstrap, instance_id=INSTANCE, inbox_size=64)
    await nursery.start(resolver.run)
    return resolver


async def timed_leader(resolver: LeaderResolver) -> tuple[float, str | UnavailableReason]:
    """(trio seconds spent, leader target or failure reason)."""
    start = trio.current_time()
    try:
        target: str | UnavailableReason = (await resolver.leader()).target
    except LeaderUnavailable as exc:
        target = exc.reason
    return trio.current_time() - start, target


# --- required test 1: all bootstrap targets dead at start --------------------------------------


async def test_dead_bootstrap_first_lookup_fails_then_backoff_is_free(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()  # no server at any bootstrap target: connection refused
    resolver = await start_resolver(nursery, network)
    with trio.fail_after(0.05):  # the request's own deadline
        elapsed, first = await timed_leader(resolver)
    assert first in (UnavailableReason.FAILED, UnavailableReason.BACKING_OFF)
    assert elapsed < 0.05
    assert cluster_info_calls(network) == len(NODES)  # exactly one concurrent round
    assert all(cluster_info_calls(network, t) == 1 for t in NODES)

    for _ in range(1000):
        elapsed, outcome = await timed_leader(resolver)
        assert outcome is UnavailableReason.BACKING_OFF
        assert elapsed < 0.001
    assert cluster_info_calls(network) == len(NODES)  # zero RPCs while backing off
    snap = resolver.snapshot()
    assert snap.state is LeaderState.BACKING_OFF
    assert snap.consecutive_failures == 1
    # Each of the 1,000 a fast failure, once (and the first request's too when it found the backoff).
    assert snap.fast_failures_total == 1000 + (first is UnavailableReason.BACKING_OFF)
    assert snap.last_error is not None and all(t in snap.last_error for t in NODES)


async def test_every_cluster_info_call_is_counted_by_outcome(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    fake = FakeKvcm(network)
    network.stop(NODES[2])  # one bootstrap target refuses connections
    fake.delay[NODES[1]] = 0.01  # answers after the leader's own answer won the round
    sink = MetricsSink(MetricsConfig(inbox_size=64))
    await nursery.start(sink.run)
    resolver = LeaderResolver(
        LEADER_CFG, BREAKER_CFG, KvcmClient(network), lambda: NODES, instance_id=INSTANCE, inbox_size=64, metrics=sink
    )
    await nursery.start(resolver.run)
    assert (await resolver.leader()).target == NODES[0]
    await trio.testing.wait_all_tasks_blocked()
    counted = {
        outcome: sink.registry.get_sample_value(
            "kvroute_kvcm_requests_total", {"method": "GetClusterInfo", "outcome": outcome}
        )
        for outcome in ("ok", "unavailable", "cancelled")
    }
    assert counted == {"ok": 1.0, "unavailable": 1.0, "cancelled": 1.0}


async def test_blackholed_bootstrap_caller_leaves_at_its_deadline_then_fast_fail(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.hang = set(NODES)  # accept, never answer
    resolver = await start_resolver(nursery, network)
    start = trio.current_time()
    with trio.move_on_after(0.02) as request_scope:
        await resolver.leader()
    assert request_scope.cancelled_caught
    assert trio.current_time() - start == pytest.approx(0.02)  # its own deadline, not the lookup's
    assert resolver.snapshot().state is LeaderState.RESOLVING

    # The shared lookup is bounded by lookup_timeout_s, then the failure is cached.
    await trio.sleep(LEADER_CFG.lookup_timeout_s)
    assert sorted(kvcm.cancelled) == sorted(NODES)
    assert resolver.snapshot().state is LeaderState.BACKING_OFF
    calls = cluster_info_calls(network)
    assert calls == len(NODES)
    for _ in range(1000):
        elapsed, outcome = await timed_leader(resolver)
        assert outcome is UnavailableReason.BACKING_OFF
        assert elapsed < 0.001
    assert cluster_info_calls(network) == calls


async def test_backoff_grows_with_jitter_and_recovers_in_background(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    rounds: list[float] = []

    async def refusing(method: str, request: bytes) -> bytes:
        rounds.append(trio.current_time())
        raise PeerAbort(RpcStatus.UNAVAILABLE, "down")

    network.serve(NODES[0], refusing)
    resolver = await start_resolver(nursery, network, bootstrap=lambda: NODES[:1])
    await trio.sleep(20.0)
    gaps = [b - a for a, b in itertools.pairwise(rounds)]
    assert len(gaps) >= 8
    for n, gap in enumerate(gaps, start=1):
        base = min(LEADER_CFG.backoff_initial_s * 2 ** (n - 1), LEADER_CFG.backoff_max_s)
        ceiling = min(base + LEADER_CFG.backoff_jitter_s, LEADER_CFG.backoff_max_s)
        assert base - 1e-9 <= gap <= ceiling + 1e-9, n
    assert gaps[-1] == pytest.approx(LEADER_CFG.backoff_max_s)  # capped
    assert resolver.snapshot().consecutive_failures == len(rounds)

    # KVCM comes back: the background retry finds the leader without any request waiting.
    kvcm = FakeKvcm(network, NODES[:1])
    await trio.sleep(LEADER_CFG.backoff_max_s + LEADER_CFG.backoff_jitter_s)
    snap = resolver.snapshot()
    assert snap.state is LeaderState.LEADER
    assert snap.leader_target == kvcm.leader
    assert snap.consecutive_failures == 0
    elapsed, outcome = await timed_leader(resolver)
    assert (elapsed, outcome) == (0.0, NODES[0])


async def test_a_leader_change_is_counted_and_sent_once_and_an_invalidated_leader_found_again_is_none(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    sink = MetricsSink(MetricsConfig())
    await nursery.start(sink.run)
    resolver = LeaderResolver(
        LEADER_CFG, BREAKER_CFG, KvcmClient(network), lambda: NODES, instance_id=INSTANCE, inbox_size=64, metrics=sink
    )
    await nursery.start(resolver.run)
    assert (await resolver.leader()).target == NODES[0]
    stepped_down = NotLeader(NODES[0], "stepped down", kvcm_pb.SERVER_NOT_LEADER, "SERVER_NOT_LEADER")
    resolver.report_failure(NODES[0], stepped_down)
    await trio.testing.wait_all_tasks_blocked()
    assert (await resolver.leader()).target == NODES[0]  # the same leader, found again
    kvcm.leader = NODES[1]
    resolver.report_failure(NODES[0], NotLeader(NODES[0], "moved", kvcm_pb.SERVER_NOT_LEADER, "SERVER_NOT_LEADER"))
    await trio.testing.wait_all_tasks_blocked()
    assert (await resolver.leader()).target == NODES[1]
    await trio.testing.wait_all_tasks_blocked()
    snap = resolver.snapshot()
    assert (snap.leader_changes_total, snap.invalidations_total) == (2, 2)  # the first leader, then NODES[1]
    assert sink.registry.get_sample_value("kvroute_kvcm_leader_changes_total") == 2
    assert sink.snapshot().last_leader == NODES[1]


# --- required test 2: leader moves ---------------------------------------------------------------


async def test_not_leader_invalidates_and_next_request_finds_new_leader_in_one_round(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    for node in NODES:
        kvcm.delay[node] = 0.001
    resolver = await start_resolver(nursery, network)
    assert (await resolver.leader()).target == NODES[0]
    assert kvcm.instance_ids == [INSTANCE] * len(NODES)
    before = cluster_info_calls(network)

    kvcm.leader = NODES[2]  # election: the leader moves
    client = KvcmClient(network)
    query = CacheQuery(INSTANCE, QueryType.PREFIX_MATCH, (1, 2, 3))
    with pytest.raises(NotLeader) as info:
        await client.get_host_cache_state(NODES[0], query)
    resolver.report_failure(NODES[0], info.value)
    await trio.testing.wait_all_tasks_blocked()  # the resolver's task applies the report and starts the lookup

    elapsed, outcome = await timed_leader(resolver)
    assert outcome == NODES[2]
    assert elapsed == pytest.approx(0.001)  # one round: the fastest valid answer's RTT
    assert cluster_info_calls(network) - before == len(NODES)  # exactly one concurrent round
    await client.get_host_cache_state(NODES[2], query)  # the new leader answers
    snap = resolver.snapshot()
    assert (snap.leader_changes_total, snap.invalidations_total) == (2, 1)
    assert snap.lookups_by_trigger["invalidated"] == 1
    assert sum(snap.lookups_by_trigger.values()) == snap.lookups_total == 2

    # A late report about the old leader is stale: no invalidation, no RPC.
    resolver.report_failure(NODES[0], info.value)
    await trio.testing.wait_all_tasks_blocked()
    assert cluster_info_calls(network) - before == len(NODES)
    assert (await resolver.leader()).target == NODES[2]


async def test_a_lookup_in_flight_at_an_invalidation_does_not_bring_the_old_leader_back(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The scheduled refresh is in flight when the leader moves and a query reports NotLeader: the
    replicas it asked answered with the leader they knew then, the invalidated one. Installed, the
    next request would query it again; a fresh lookup finds the new one."""
    network = MemoryNetwork()
    seen = {"leader": NODES[0]}

    async def replica(node: str, method: str, request: bytes) -> bytes:
        known = seen["leader"]  # what the replica knows when asked
        await trio.sleep(0.1)
        return cluster_info_reply(known, node)

    for node in NODES:
        network.serve(node, functools.partial(replica, node))
    resolver = await start_resolver(nursery, network)
    assert (await resolver.leader()).target == NODES[0]
    await trio.sleep_until(LEADER_CFG.refresh_interval_s + 0.15)  # the refresh is asking the replicas
    assert resolver.snapshot().lookups_total == 1
    seen["leader"] = NODES[2]
    resolver.report_failure(NODES[0], NotLeader(NODES[0], "moved", kvcm_pb.SERVER_NOT_LEADER, "SERVER_NOT_LEADER"))
    await trio.testing.wait_all_tasks_blocked()  # the resolver's task applies the report
    assert (await resolver.leader()).target == NODES[2]
    snap = resolver.snapshot()
    assert snap.leader_target == NODES[2] and snap.lookups_by_trigger["invalidated"] == 1


async def test_a_leader_invalidated_during_a_refresh_and_still_leader_is_found_again(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A passing failure invalidates the leader while the refresh is asking: the refresh names it
    again and is asked afresh. That fresh lookup's answer, the same leader, is the cluster's word
    after the failure and is taken; treated as stale again, every round would throw it away."""
    network = MemoryNetwork()
    for node in NODES:
        network.serve(node, _replica(node, NODES[0], 0.1))  # every node names NODES[0]; it names itself
    resolver = await start_resolver(nursery, network)
    assert (await resolver.leader()).target == NODES[0]
    await trio.sleep_until(LEADER_CFG.refresh_interval_s + 0.15)  # the refresh is asking
    resolver.report_failure(NODES[0], Unavailable(NODES[0], "reset"))  # passing: still the leader
    await trio.testing.wait_all_tasks_blocked()
    with trio.fail_after(1.0):
        assert (await resolver.leader()).target == NODES[0]
    await trio.sleep(1.0)
    assert resolver.snapshot().lookups_total == 3  # start-up, the refresh (stale), its fresh lookup


async def test_an_invalidation_about_a_replaced_leader_reaching_the_task_keeps_the_current_one(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A request that read the view before the leader was replaced reports the old one; the task
    checks again and ignores it. Sent as the private message: the public ``report_failure`` filters
    it on the newer view, and the interleaving where the view is still the old one when it is sent
    but the task has moved on by the time it reads it is not one the public API can schedule."""
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    resolver = await start_resolver(nursery, network)
    assert (await resolver.leader()).target == NODES[0]
    kvcm.leader = NODES[1]
    resolver.report_failure(NODES[0], Unavailable(NODES[0], "reset"))
    await trio.testing.wait_all_tasks_blocked()
    assert (await resolver.leader()).target == NODES[1]
    resolver._report(_Invalidate(NODES[0]))  # sent by a request that read the old view
    await trio.testing.wait_all_tasks_blocked()
    snap = resolver.snapshot()
    assert (snap.leader_target, snap.invalidations_total) == (NODES[1], 1)


async def test_an_invalidation_while_backing_off_waits_for_the_scheduled_retry(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)
    config = dataclasses.replace(LEADER_CFG, backoff_initial_s=3.0, backoff_jitter_s=0.0)
    resolver = await start_resolver(nursery, network, config=config)
    assert (await resolver.leader()).target == NODES[0]
    for node in NODES:
        network.stop(node)
    await trio.sleep_until(config.refresh_interval_s + 0.5)  # the refresh failed; the next try at 13 s
    assert resolver.snapshot().consecutive_failures == 1
    calls = cluster_info_calls(network)
    resolver.report_failure(NODES[0], NotLeader(NODES[0], "moved", kvcm_pb.SERVER_NOT_LEADER, "SERVER_NOT_LEADER"))
    await trio.testing.wait_all_tasks_blocked()
    assert resolver.snapshot().invalidations_total == 1
    assert cluster_info_calls(network) == calls  # no round before the backoff's


def _replica(node: str, names: str | None, delay: float) -> Handler:
    """A KVCM node that names ``names`` as leader in GetClusterInfo (as itself, when it is that node) and
    answers queries, after ``delay``."""
    self_node = f"node-{node}"  # the id cluster_info_reply gives a named leader

    async def handler(method: str, request: bytes) -> bytes:
        await trio.sleep(delay)
        if method == paths.KVCM_GET_CLUSTER_INFO:
            return cluster_info_reply(names, self_node)
        return cache_state_reply()

    return handler


async def test_a_replica_still_naming_the_invalidated_leader_does_not_keep_it(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The old leader is dead; the fastest replica has not seen it go and still names it, the others
    name the new one. Taken at its word after the invalidation, it would send every request to the
    dead leader again; one failed query is all it costs."""
    dead, stale, new, follower = "10.0.0.1:6381", "10.0.0.2:6381", "10.0.0.3:6381", "10.0.0.4:6381"
    network = MemoryNetwork()  # nothing serves the dead leader: connection refused
    network.serve(stale, _replica(stale, dead, 0.0))
    network.serve(new, _replica(new, new, 0.001))
    network.serve(follower, _replica(follower, new, 0.001))
    resolver = await start_resolver(nursery, network, bootstrap=lambda: (dead, stale, new, follower))
    client = KvcmClient(network)
    outcomes = [await query_kvcm(resolver, client) for _ in range(200)]  # one request every 50 ms ...
    assert outcomes == ["unavailable"] + ["ok"] * 199  # ... the first found the dead leader, the rest the new
    snap = resolver.snapshot()
    assert (snap.leader_target, snap.invalidations_total, snap.lookups_total) == (new, 1, 2)


async def test_a_suspect_leader_is_taken_when_it_names_itself_or_no_replica_names_another(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    hung: set[str] = set()

    def serve(node: str, delay: float) -> None:
        replica = _replica(node, NODES[0], delay)

        async def handler(method: str, request: bytes) -> bytes:
            if node in hung:
                await trio.sleep_forever()
            return await replica(method, request)

        network.serve(node, handler)

    serve(NODES[0], 0.003)  # the leader names itself, after the others
    serve(NODES[1], 0.001)
    serve(NODES[2], 0.002)
    resolver = await start_resolver(nursery, network)
    assert (await resolver.leader()).target == NODES[0]
    down = Unavailable(NODES[0], "reset")  # a passing failure: it is still the leader

    async def invalidated_then_found() -> float:
        resolver.report_failure(NODES[0], down)
        await trio.testing.wait_all_tasks_blocked()  # applied; the lookup is asking
        elapsed, outcome = await timed_leader(resolver)
        assert outcome == NODES[0]
        return elapsed

    hung.add(NODES[2])
    assert await invalidated_then_found() == pytest.approx(0.003)  # its own word, not the round's timeout
    network.stop(NODES[0])  # only the followers answer: both name it, one of them late ...
    hung.clear()
    assert await invalidated_then_found() == pytest.approx(0.002)
    hung.add(NODES[2])  # ... or never: the round ends at its timeout
    assert await invalidated_then_found() == pytest.approx(LEADER_CFG.lookup_timeout_s)
    assert resolver.snapshot().lookups_total == 4


async def test_a_leader_stays_suspect_for_a_bounded_time(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    network.serve(NODES[1], _replica(NODES[1], NODES[0], 0.001))  # still names the old leader
    network.serve(NODES[2], _replica(NODES[2], NODES[2], 0.002))
    config = dataclasses.replace(LEADER_CFG, refresh_interval_s=20.0, invalidated_suspect_s=25.0)
    resolver = await start_resolver(nursery, network, config=config)
    assert (await resolver.leader()).target == NODES[0]
    resolver.report_failure(NODES[0], Unavailable(NODES[0], "reset"))
    await trio.testing.wait_all_tasks_blocked()
    assert (await resolver.leader()).target == NODES[2]
    await trio.sleep_until(21.0)  # the refresh at 20 s is within the suspicion ...
    assert resolver.snapshot().leader_target == NODES[2]
    await trio.sleep_until(41.0)  # ... the one at 40 s after it: the first answer wins again
    assert resolver.snapshot().leader_target == NODES[0]


async def test_a_suspect_leader_loses_to_a_replica_answering_no_leader(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The leader dies and an election starts: one replica still names the dead leader, another
    says no leader is elected. The election is the newer news; the dead one is not taken back."""
    dead, stale, electing = NODES
    network = MemoryNetwork()
    network.serve(dead, _replica(dead, dead, 0.0))
    network.serve(stale, _replica(stale, dead, 0.001))
    resolver = await start_resolver(nursery, network)
    assert (await resolver.leader()).target == dead
    network.stop(dead)
    network.serve(electing, _fixed_reply(cluster_info_reply(None), delay=0.002))
    resolver.report_failure(dead, Unavailable(dead, "refused"))
    await trio.testing.wait_all_tasks_blocked()
    await trio.sleep(LEADER_CFG.lookup_timeout_s + 0.01)
    assert resolver.cached_leader() is None
    assert resolver.snapshot().state is LeaderState.NO_LEADER


@pytest.mark.parametrize(
    ("error", "invalidates"),
    [
        (NotLeader(NODES[0], "moved", kvcm_pb.SERVER_NOT_LEADER, "SERVER_NOT_LEADER"), True),
        (Unavailable(NODES[0], "reset"), True),
        (DeadlineExceeded(NODES[0], "slow"), True),
        (RemoteError(NODES[0], "boom", kvcm_pb.INTERNAL_ERROR, "INTERNAL_ERROR"), False),
        (GarbledReply(NODES[0], "hosts[0]: negative"), False),
    ],
)
async def test_which_query_errors_invalidate_the_leader(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, error: TransportError, invalidates: bool
) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)
    resolver = await start_resolver(nursery, network)
    await resolver.leader()
    before = cluster_info_calls(network)
    resolver.report_failure(NODES[0], error)
    await trio.testing.wait_all_tasks_blocked()
    assert cluster_info_calls(network) - before == (len(NODES) if invalidates else 0)
    assert resolver.snapshot().invalidations_total == int(invalidates)


# --- required test 3: single flight ------------------------------------------------------------


async def test_thousand_concurrent_callers_share_one_lookup(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    for node in NODES:
        kvcm.delay[node] = 0.005
    resolver = await start_resolver(nursery, network)
    results: list[str] = []

    async def caller() -> None:
        with trio.fail_after(0.05):
            results.append((await resolver.leader()).target)

    async with trio.open_nursery() as callers:
        for _ in range(1000):
            callers.start_soon(caller)
    assert results == [NODES[0]] * 1000
    assert [cluster_info_calls(network, t) for t in NODES] == [1, 1, 1]

    # The same after an invalidation: one more call per bootstrap target, whatever the crowd.
    kvcm.leader = NODES[1]
    resolver.report_failure(NODES[0], Unavailable(NODES[0], "reset"))
    await trio.testing.wait_all_tasks_blocked()  # applied by the resolver's task
    results.clear()
    async with trio.open_nursery() as callers:
        for _ in range(1000):
            callers.start_soon(caller)
    assert results == [NODES[1]] * 1000
    assert [cluster_info_calls(network, t) for t in NODES] == [2, 2, 2]
    assert resolver.snapshot().lookups_total == 2


async def test_a_cancelled_waiter_does_not_cancel_the_shared_lookup(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network, NODES[:1])
    kvcm.delay[NODES[0]] = 0.010
    resolver = await start_resolver(nursery, network, bootstrap=lambda: NODES[:1])
    outcomes: dict[str, object] = {}

    async def impatient() -> None:
        with trio.move_on_after(0.002) as scope:
            await resolver.leader()
        outcomes["impatient"] = scope.cancelled_caught

    async def patient() -> None:
        with trio.fail_after(0.05):
            outcomes["patient"] = (await resolver.leader()).target

    async with trio.open_nursery() as callers:
        callers.start_soon(impatient)
        callers.start_soon(patient)
    assert outcomes == {"impatient": True, "patient": NODES[0]}
    assert cluster_info_calls(network) == 1
    assert kvcm.cancelled == []  # the call the impatient caller gave up on ran to completion


# --- required test 4: one hanging bootstrap target ------------------------------------------------


async def test_hanging_target_does_not_delay_the_good_one(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network, NODES[:2])
    kvcm.hang = {NODES[0]}
    kvcm.delay[NODES[1]] = 0.003  # the good node's RTT
    kvcm.leader = NODES[1]
    resolver = await start_resolver(nursery, network, bootstrap=lambda: NODES[:2])
    elapsed, outcome = await timed_leader(resolver)
    assert outcome == NODES[1]
    assert elapsed == pytest.approx(0.003)  # the good one's RTT ...
    assert elapsed < LEADER_CFG.lookup_timeout_s  # ... not the slow one's timeout
    await trio.testing.wait_all_tasks_blocked()
    assert kvcm.cancelled == [NODES[0]]  # the loser was cancelled
    snap = resolver.snapshot()
    assert snap.last_lookup_s == pytest.approx(0.003)
    assert snap.state is LeaderState.LEADER


# --- no leader elected -----------------------------------------------------------------------


async def test_no_leader_is_its_own_state_and_retried_soon(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.leader = None
    resolver = await start_resolver(nursery, network)
    elapsed, outcome = await timed_leader(resolver)
    assert outcome is UnavailableReason.NO_LEADER
    snap = resolver.snapshot()
    assert snap.state is LeaderState.NO_LEADER
    assert snap.consecutive_failures == 0  # not a failure
    assert snap.last_error is None
    assert cluster_info_calls(network) == len(NODES)
    for _ in range(100):  # fails fast, zero RPCs, until the short retry
        elapsed, outcome = await timed_leader(resolver)
        assert (outcome, elapsed) == (UnavailableReason.NO_LEADER, 0.0)
    assert cluster_info_calls(network) == len(NODES)

    kvcm.leader = NODES[1]  # elected
    await trio.sleep(LEADER_CFG.no_leader_retry_s + 0.001)
    assert cluster_info_calls(network) == 2 * len(NODES)  # exactly one retry round, no backoff
    assert (await resolver.leader()).target == NODES[1]


async def test_a_named_leader_beats_a_node_that_knows_none(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    network.serve(NODES[0], _fixed_reply(cluster_info_reply(None), delay=0.001))
    network.serve(NODES[1], _fixed_reply(cluster_info_reply(NODES[1]), delay=0.004))
    resolver = await start_resolver(nursery, network, bootstrap=lambda: NODES[:2])
    elapsed, outcome = await timed_leader(resolver)
    assert outcome == NODES[1]
    assert elapsed == pytest.approx(0.004)


async def test_a_refresh_answered_no_leader_drops_the_cached_leader(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """An election started: the old leader is not the leader any more, however fresh it was."""
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    resolver = await start_resolver(nursery, network)
    assert (await resolver.leader()).target == NODES[0]
    kvcm.leader = None
    await trio.sleep(LEADER_CFG.refresh_interval_s + 0.01)  # the refresh hears "no leader"
    assert resolver.cached_leader() is None
    assert resolver.snapshot().state is LeaderState.NO_LEADER
    assert await timed_leader(resolver) == (0.0, UnavailableReason.NO_LEADER)


async def test_a_lookup_failing_after_no_leader_is_backing_off(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.leader = None
    resolver = await start_resolver(nursery, network)
    await trio.testing.wait_all_tasks_blocked()
    assert resolver.snapshot().state is LeaderState.NO_LEADER
    for node in NODES:
        network.stop(node)
    await trio.sleep(LEADER_CFG.no_leader_retry_s + 0.01)
    snap = resolver.snapshot()
    assert (snap.state, snap.consecutive_failures) == (LeaderState.BACKING_OFF, 1)
    assert await timed_leader(resolver) == (0.0, UnavailableReason.BACKING_OFF)


def _fixed_reply(reply: bytes, delay: float = 0.0) -> Handler:
    async def handler(method: str, request: bytes) -> bytes:
        await trio.sleep(delay)
        return reply

    return handler


@pytest.mark.parametrize(
    "bad_reply",
    [
        cluster_info_reply(NODES[1], code=kvcm_pb.SERVICE_NOT_READY),
        cluster_info_reply(NODES[1], code=kvcm_pb.INTERNAL_ERROR),
        cluster_info_reply("bad-host:0"),  # port out of range
        b"\xff\xff\xff",  # undecodable
    ],
)
async def test_invalid_answers_are_failures_not_leaders(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, bad_reply: bytes
) -> None:
    network = MemoryNetwork()
    network.serve(NODES[0], _fixed_reply(bad_reply))
    resolver = await start_resolver(nursery, network, bootstrap=lambda: NODES[:1])
    _, outcome = await timed_leader(resolver)
    assert outcome in (UnavailableReason.FAILED, UnavailableReason.BACKING_OFF)
    snap = resolver.snapshot()
    assert snap.state is LeaderState.BACKING_OFF
    assert snap.last_error is not None and NODES[0] in snap.last_error


# --- steady state and staleness --------------------------------------------------------------


async def test_background_refresh_means_requests_never_wait(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    for node in NODES:
        kvcm.delay[node] = 0.002
    resolver = await start_resolver(nursery, network)
    await resolver.leader()
    start = trio.current_time()
    waits: list[float] = []
    while trio.current_time() - start < 35.0:
        if trio.current_time() - start > 25.0:
            kvcm.leader = NODES[1]  # noticed by the background refresh at t=30
        elapsed, outcome = await timed_leader(resolver)
        waits.append(elapsed)
        assert outcome in (NODES[0], NODES[1])
        await trio.sleep(0.1)
    assert max(waits) == 0.0
    assert cluster_info_calls(network) == 4 * len(NODES)  # start + refreshes at 10, 20, 30 s
    snap = resolver.snapshot()
    assert snap.lookups_by_trigger["scheduled"] >= 3  # the refreshes ran on their own
    assert snap.leader_target == NODES[1]
    assert snap.leader_changes_total == 2
    assert snap.age_s is not None and 0.0 <= snap.age_s < 5.1


async def test_failed_refresh_keeps_leader_until_max_staleness(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)
    resolver = await start_resolver(nursery, network)
    assert resolver.cached_leader() is None  # nothing looked up yet: the router must wait
    await resolver.leader()
    confirmed = trio.current_time()
    for node in NODES:
        network.stop(node)  # the whole KVCM cluster goes away
    await trio.sleep_until(confirmed + LEADER_CFG.max_staleness_s - 0.001)
    snap = resolver.snapshot()
    assert snap.consecutive_failures >= 3  # refreshes failed ...
    assert snap.state is LeaderState.LEADER  # ... and the last leader is still served
    assert (await resolver.leader()).target == NODES[0]
    cached = resolver.cached_leader()  # the router's no-wait path agrees with leader()
    assert cached is not None and cached.target == NODES[0]
    await trio.sleep_until(confirmed + LEADER_CFG.max_staleness_s + 0.001)
    assert resolver.cached_leader() is None
    elapsed, outcome = await timed_leader(resolver)
    assert (outcome, elapsed) == (UnavailableReason.BACKING_OFF, 0.0)
    assert resolver.snapshot().state is LeaderState.BACKING_OFF


async def test_a_stale_leader_is_not_answered_while_its_refresh_is_in_flight(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """With ``max_staleness_s`` equal to ``refresh_interval_s`` (allowed), the leader goes stale while
    its refresh is asking: a request then waits for the refresh instead of taking the stale one."""
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    for node in NODES:
        kvcm.delay[node] = 0.1
    config = dataclasses.replace(LEADER_CFG, refresh_interval_s=10.0, max_staleness_s=10.0)
    resolver = await start_resolver(nursery, network, config=config)
    assert (await resolver.leader()).target == NODES[0]  # confirmed at 0.1 s
    kvcm.leader = NODES[1]
    await trio.sleep_until(10.15)  # the refresh started at 10.1 s, when the leader went stale
    elapsed, outcome = await timed_leader(resolver)
    assert outcome == NODES[1]  # the refresh's answer, not the stale leader
    assert elapsed == pytest.approx(0.05)


async def test_no_bootstrap_fails_fast_without_rpc(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)
    targets: tuple[str, ...] = ()
    resolver = await start_resolver(nursery, network, bootstrap=lambda: targets)
    elapsed, outcome = await timed_leader(resolver)
    assert (outcome, elapsed) == (UnavailableReason.NO_BOOTSTRAP, 0.0)
    assert network.call_count() == 0
    targets = NODES  # discovery finds the cluster: the background retry picks it up
    await trio.sleep(LEADER_CFG.backoff_max_s + LEADER_CFG.backoff_jitter_s)
    assert (await resolver.leader()).target == NODES[0]


async def test_bootstrap_targets_found_late_are_used_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Discovery finds no KVCM target for a minute (DNS or file not ready): nobody is asked, so nothing
    failed, and the targets are used once they appear, not after a backoff grown meanwhile."""
    network = MemoryNetwork()
    FakeKvcm(network)
    targets: list[tuple[str, ...]] = [()]
    asking = await start_resolver(nursery, network, bootstrap=lambda: targets[0])  # a request will ask
    waiting = await start_resolver(nursery, network, bootstrap=lambda: targets[0])  # no request
    await trio.sleep(60.0)
    for resolver in (asking, waiting):
        snap = resolver.snapshot()
        assert (snap.state, snap.consecutive_failures) == (LeaderState.NO_BOOTSTRAP, 0)
        assert snap.next_attempt_at is not None
        assert snap.next_attempt_at - trio.current_time() <= LEADER_CFG.no_leader_retry_s
    assert network.call_count() == 0
    assert await timed_leader(asking) == (0.0, UnavailableReason.NO_BOOTSTRAP)

    targets[0] = NODES
    assert await timed_leader(asking) == (0.0, NODES[0])  # the request's own lookup
    await trio.sleep(LEADER_CFG.no_leader_retry_s)
    assert waiting.snapshot().leader_target == NODES[0]  # the next scheduled one


async def test_losing_the_bootstrap_targets_ends_the_backoff(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """KVCM unreachable, then discovery loses its targets: a lookup with nobody to ask is not a
    failure, so targets that come back are looked up by the next request at once, not failed fast
    on a backoff grown before."""
    network = MemoryNetwork()  # nothing answers yet
    targets: list[tuple[str, ...]] = [NODES]
    resolver = await start_resolver(nursery, network, bootstrap=lambda: targets[0])
    await trio.sleep(1.0)
    assert resolver.snapshot().consecutive_failures > 1
    targets[0] = ()
    await trio.sleep(LEADER_CFG.backoff_max_s + LEADER_CFG.backoff_jitter_s + 0.01)
    snap = resolver.snapshot()
    assert (snap.state, snap.consecutive_failures) == (LeaderState.NO_BOOTSTRAP, 0)
    FakeKvcm(network)
    targets[0] = NODES
    assert await timed_leader(resolver) == (0.0, NODES[0])  # the request's own lookup


async def test_a_waiter_whose_lookup_finds_the_bootstrap_targets_gone_gets_no_bootstrap_not_judged(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Discovery loses the KVCM targets between the resolver's check of a request's ask and the
    lookup's own read a step later: nobody was asked, so the request gets what one a moment earlier
    got (NO_BOOTSTRAP, a fast failure the breaker does not judge), not a failed lookup it waited for."""
    network = MemoryNetwork()
    FakeKvcm(network)
    # Read by the start-up lookup, by the request's leader(), by the task's answer to its ask, and by
    # the lookup that answer starts.
    reads = iter([(), NODES, NODES])
    resolver = await start_resolver(nursery, network, bootstrap=lambda: next(reads, ()))
    await trio.testing.wait_all_tasks_blocked()  # the start-up lookup found no target
    with pytest.raises(LeaderUnavailable) as info:
        await resolver.leader()
    assert next(reads, None) is None  # every scripted read was made: the request did ask the task
    assert (info.value.reason, info.value.waited) == (UnavailableReason.NO_BOOTSTRAP, False)
    assert resolver.record_leader_miss(info.value, trial=False, given_s=1.0, started_at=0.0) is False
    await trio.testing.wait_all_tasks_blocked()
    snap = resolver.snapshot()
    assert (snap.state, snap.leader_misses_total, snap.fast_failures_total) == (LeaderState.NO_BOOTSTRAP, 0, 1)
    assert (snap.breaker.consecutive_failures, snap.breaker.window_failures) == (0, 0)
    assert network.call_count() == 0


async def test_waiters_are_released_when_the_resolver_stops(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.hang = set(NODES)
    outcomes: list[tuple[float, UnavailableReason | str]] = []

    async def waiter(resolver: LeaderResolver) -> None:
        with trio.fail_after(10):
            outcomes.append(await timed_leader(resolver))

    # The service nursery is nested inside the callers' one: cancelling it stops only the resolver.
    async with trio.open_nursery() as callers, trio.open_nursery() as service:
        resolver = await start_resolver(service, network)
        for _ in range(10):
            callers.start_soon(waiter, resolver)
        await trio.sleep(0.01)
        service.cancel_scope.cancel()  # shutdown during the lookup
    assert outcomes == [(0.01, UnavailableReason.FAILED)] * 10  # released at once, not at their deadline


async def test_snapshot_states(autojump_clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.delay[NODES[0]] = kvcm.delay[NODES[1]] = kvcm.delay[NODES[2]] = 0.01
    resolver = LeaderResolver(
        LEADER_CFG, BREAKER_CFG, KvcmClient(network), lambda: NODES, instance_id=INSTANCE, inbox_size=64
    )
    assert resolver.snapshot().state is LeaderState.UNKNOWN
    await nursery.start(resolver.run)
    await trio.sleep(0.005)
    assert resolver.snapshot().state is LeaderState.RESOLVING
    await trio.sleep(0.01)
    snap = resolver.snapshot()
    assert (snap.state, snap.leader_target, snap.leader_node_id) == (
        LeaderState.LEADER,
        NODES[0],
        f"node-{NODES[0]}",
    )
    assert snap.next_attempt_at == pytest.approx(trio.current_time() - 0.005 + LEADER_CFG.refresh_interval_s)
    assert snap.breaker.state is BreakerState.CLOSED


def test_config_validation_names_every_bad_field() -> None:
    bad = LeaderConfig(
        refresh_interval_s=0.0,
        max_staleness_s=-1.0,
        lookup_timeout_s=0.0,
        backoff_initial_s=0.0,
        backoff_max_s=-1.0,
        backoff_jitter_s=-0.1,
        no_leader_retry_s=0.0,
        invalidated_suspect_s=-1.0,
    )
    named = {name for problem in leader_problems(bad) for name in problem.fields}
    for field in dataclasses.fields(LeaderConfig):
        assert field.name in named
    assert leader_problems(LeaderConfig()) == []


# --- required test 7 (resolver level): the breaker in front of KVCM queries -------------------------


async def query_kvcm(resolver: LeaderResolver, client: KvcmClient) -> str:
    """What a request does with KVCM (the Router's stage, reduced): admit → leader → query → record;
    then, as before the next request arrives, the resolver's task applies what it was told."""
    try:
        return await _query_kvcm(resolver, client)
    finally:
        with trio.CancelScope(shield=True):
            await trio.testing.wait_all_tasks_blocked()


async def _query_kvcm(resolver: LeaderResolver, client: KvcmClient) -> str:
    admission = await resolver.admit()
    if admission is Admission.REJECT:
        return "breaker_open"
    trial = admission is Admission.TRIAL
    leader = await resolver.leader()
    started = trio.current_time()
    try:
        await client.get_host_cache_state(leader.target, CacheQuery(INSTANCE, QueryType.PREFIX_MATCH, (1, 2)))
    except TransportError as exc:
        resolver.record_kvcm(exc, trial=trial, given_s=math.inf, started_at=started)
        resolver.report_failure(leader.target, exc)
        return exc.kind
    except trio.Cancelled:
        if trial:
            resolver.release_kvcm_trial()
        raise
    resolver.record_kvcm(None, trial=trial, given_s=math.inf, started_at=started)
    return "ok"


async def test_breaker_open_costs_no_rpc_and_no_time(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.query_code = kvcm_pb.INTERNAL_ERROR
    resolver = await start_resolver(nursery, network)
    client = KvcmClient(network)
    outcomes = [await query_kvcm(resolver, client) for _ in range(BREAKER_CFG.failure_threshold)]
    assert outcomes == ["remote_error"] * BREAKER_CFG.failure_threshold
    assert resolver.snapshot().breaker.state is BreakerState.OPEN

    rpcs = network.call_count()
    for _ in range(1000):
        start = trio.current_time()
        assert await query_kvcm(resolver, client) == "breaker_open"
        assert trio.current_time() - start < 0.001
    assert network.call_count() == rpcs  # OPEN: no RPC at all
    assert resolver.snapshot().breaker.rejected_total == 1000

    # Cooldown over: exactly one trial; KVCM healthy again → closed.
    kvcm.query_code = kvcm_pb.OK
    await trio.sleep(BREAKER_CFG.cooldown_s)
    assert await resolver.admit() is Admission.TRIAL
    assert await resolver.admit() is Admission.REJECT
    resolver.release_kvcm_trial()
    await trio.testing.wait_all_tasks_blocked()
    assert await query_kvcm(resolver, client) == "ok"
    assert resolver.snapshot().breaker.state is BreakerState.CLOSED
    assert await query_kvcm(resolver, client) == "ok"


async def test_business_outcomes_never_open_the_breaker(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)  # answers OK with no hosts: "no positive match"
    resolver = await start_resolver(nursery, network)
    client = KvcmClient(network)
    for _ in range(100):
        assert await query_kvcm(resolver, client) == "ok"
    assert resolver.snapshot().breaker.state is BreakerState.CLOSED


async def half_open_breaker(nursery: trio.Nursery) -> tuple[FakeKvcm, LeaderResolver, KvcmClient]:
    """KVCM failing until the breaker opens, then its cooldown waited out: the next admit is the trial."""
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.query_code = kvcm_pb.INTERNAL_ERROR
    resolver = await start_resolver(nursery, network)
    client = KvcmClient(network)
    for _ in range(BREAKER_CFG.failure_threshold):
        await query_kvcm(resolver, client)
    await trio.sleep(BREAKER_CFG.cooldown_s)
    return kvcm, resolver, client


async def test_trial_cancelled_by_request_deadline_releases_the_slot(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    kvcm, resolver, client = await half_open_breaker(nursery)
    kvcm.query_hang = True
    with trio.move_on_after(0.01) as request_scope:  # the trial's request runs out of time
        await query_kvcm(resolver, client)
    assert request_scope.cancelled_caught
    snap = resolver.snapshot().breaker
    assert (snap.state, snap.trial_started_at) == (BreakerState.HALF_OPEN, None)
    # Not stuck: the next request is the new trial at once.
    kvcm.query_hang = False
    kvcm.query_code = kvcm_pb.OK
    assert await query_kvcm(resolver, client) == "ok"
    assert resolver.snapshot().breaker.state is BreakerState.CLOSED


async def test_a_cut_short_trial_is_not_judged_and_frees_its_slot(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    _, resolver, _ = await half_open_breaker(nursery)
    assert await resolver.admit() is Admission.TRIAL
    slow = BREAKER_CFG.slow_query_ms / 1000.0
    cut = DeadlineExceeded(NODES[0], "cut off by the request's deadline")
    assert resolver.record_kvcm(cut, trial=True, given_s=slow / 2, started_at=0.0) is False  # not judged ...
    await trio.testing.wait_all_tasks_blocked()  # applied by the resolver's task
    assert resolver.snapshot().breaker.state is BreakerState.HALF_OPEN
    assert await resolver.admit() is Admission.TRIAL  # ... and the trial slot is free again
    assert resolver.record_kvcm(cut, trial=True, given_s=slow, started_at=0.0) is True  # had long enough: a failure
    await trio.testing.wait_all_tasks_blocked()
    assert resolver.snapshot().breaker.state is BreakerState.OPEN
    assert resolver.snapshot().queries_cut_short_total == 1


async def test_a_trial_whose_leader_failed_fast_frees_its_slot(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A fast failure cost the trial nothing and judges nothing; kept, its slot would reject every
    request until ``trial_timeout_s``."""
    _, resolver, _ = await half_open_breaker(nursery)
    assert await resolver.admit() is Admission.TRIAL
    fast = LeaderUnavailable(UnavailableReason.BACKING_OFF, "lookups failing")
    assert resolver.record_leader_miss(fast, trial=True, given_s=1.0, started_at=trio.current_time()) is False
    await trio.testing.wait_all_tasks_blocked()
    assert resolver.snapshot().breaker.state is BreakerState.HALF_OPEN
    assert await resolver.admit() is Admission.TRIAL  # the slot is free again


async def test_a_leader_lookup_the_request_waited_for_and_that_found_none_is_judged(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()  # refused everywhere: the first lookup fails
    resolver = await start_resolver(nursery, network)
    with pytest.raises(LeaderUnavailable) as info:
        await resolver.leader()
    assert info.value.waited
    assert resolver.record_leader_miss(info.value, trial=False, given_s=1.0, started_at=0.0) is True
    await trio.testing.wait_all_tasks_blocked()
    snap = resolver.snapshot()
    assert (snap.leader_misses_total, snap.breaker.consecutive_failures) == (1, 1)


async def test_only_a_deadline_cut_below_slow_query_ms_is_spared_judging(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)
    resolver = await start_resolver(nursery, network)
    slow = BREAKER_CFG.slow_query_ms / 1000.0
    # A leader wait the request's deadline ended after exactly slow_query_ms had long enough.
    assert resolver.record_leader_miss(None, trial=False, given_s=slow, started_at=0.0) is True
    # A refused connection is a failure however tight the budget was: the budget did not cause it.
    for _ in range(BREAKER_CFG.failure_threshold - 1):
        assert resolver.record_kvcm(Unavailable(NODES[0], "refused"), trial=False, given_s=slow / 2, started_at=0.0)
    await trio.testing.wait_all_tasks_blocked()
    snap = resolver.snapshot()
    assert (snap.breaker.state, snap.queries_cut_short_total) == (BreakerState.OPEN, 0)


async def test_a_budget_cut_shorter_than_kvcms_answers_recently_took_is_not_judged(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """KVCM healthy but answering in 30 ms: a request whose budget left its query 15 ms said nothing of
    KVCM's health, but was judged (over slow_query_ms), and such requests opened the breaker and
    invalidated the leader over and over for the requests with room for the answer."""
    network = MemoryNetwork()
    FakeKvcm(network)
    resolver = await start_resolver(nursery, network)
    cut = DeadlineExceeded(NODES[0], "GetHostCacheState did not answer within the request's budget")
    await trio.sleep(1.0)
    # Before any answer the floor is slow_query_ms: a 15 ms cut is judged.
    assert resolver.record_kvcm(cut, trial=False, given_s=0.015, started_at=trio.current_time()) is True
    assert resolver.snapshot().answered_within_s is None
    for _ in range(ANSWERED_WINDOW):  # answers that took 30 ms
        resolver.record_kvcm(None, trial=False, given_s=0.050, started_at=trio.current_time() - 0.030)
    await trio.testing.wait_all_tasks_blocked()
    assert resolver.snapshot().answered_within_s == pytest.approx(0.030)
    for _ in range(2 * BREAKER_CFG.failure_threshold):
        assert resolver.record_kvcm(cut, trial=False, given_s=0.015, started_at=trio.current_time()) is False
    await trio.testing.wait_all_tasks_blocked()
    snap = resolver.snapshot()
    assert snap.breaker.state is BreakerState.CLOSED and snap.invalidations_total == 0
    assert snap.queries_cut_short_total == 2 * BREAKER_CFG.failure_threshold
    # Given longer than its answers take, and not answered: judged.
    assert resolver.record_kvcm(cut, trial=False, given_s=0.031, started_at=trio.current_time()) is True
    # KVCM hangs while only tight budgets reach it: the spared cuts take the answers' places, and once
    # none is left the cuts are judged again (they were spared for good).
    spared = 0
    while resolver.record_kvcm(cut, trial=False, given_s=0.015, started_at=trio.current_time()) is False:
        spared += 1
        await trio.testing.wait_all_tasks_blocked()
        assert spared <= ANSWERED_WINDOW * ANSWERED_SAMPLE_EVERY, "the answers never aged out"
    assert resolver.snapshot().answered_within_s is None  # no answer left in the window


async def test_the_last_failed_query_shows_in_the_snapshot(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The debug endpoint's only view of a query failure the lookups never see (a wrong instance id)."""
    network = MemoryNetwork()
    FakeKvcm(network)
    resolver = await start_resolver(nursery, network)
    await trio.sleep(1.0)
    resolver.record_kvcm(Unavailable(NODES[0], "refused"), trial=False, given_s=1.0, started_at=0.0)
    await trio.testing.wait_all_tasks_blocked()
    snap = resolver.snapshot()
    assert snap.last_query_error is not None and "refused" in snap.last_query_error
    assert snap.last_query_error_at == 1.0


# --- the inbox: state changed by the resolver's own task only ------------------------------------


async def test_reports_change_nothing_until_the_resolvers_task_applies_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)
    resolver = LeaderResolver(
        LEADER_CFG, BREAKER_CFG, KvcmClient(network), lambda: NODES, instance_id=INSTANCE, inbox_size=64
    )
    down = Unavailable(NODES[0], "reset")
    for _ in range(BREAKER_CFG.failure_threshold):  # judged: answered at once
        assert resolver.record_kvcm(down, trial=False, given_s=math.inf, started_at=0.0) is True
    snap = resolver.snapshot()
    assert (snap.breaker.state, snap.inbox_depth) == (BreakerState.CLOSED, BREAKER_CFG.failure_threshold)
    assert await resolver.admit() is Admission.ALLOW  # the published view: nothing applied yet
    async with trio.open_nursery() as nursery:
        await nursery.start(resolver.run)
        await trio.testing.wait_all_tasks_blocked()
        snap = resolver.snapshot()
        assert (snap.breaker.state, snap.inbox_depth) == (BreakerState.OPEN, 0)
        assert await resolver.admit() is Admission.REJECT  # from the view, no hop
        nursery.cancel_scope.cancel()


async def test_a_full_inbox_drops_reports_and_counts_them(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)
    resolver = LeaderResolver(
        LEADER_CFG, BREAKER_CFG, KvcmClient(network), lambda: NODES, instance_id=INSTANCE, inbox_size=2
    )
    for _ in range(5):
        resolver.record_kvcm(None, trial=False, given_s=math.inf, started_at=0.0)
    snap = resolver.snapshot()
    assert (snap.inbox_depth, snap.inbox_capacity, snap.reports_dropped_total) == (2, 2, 3)


async def test_a_trial_ask_waits_only_until_the_callers_limit_and_an_abandoned_one_takes_no_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.query_code = kvcm_pb.INTERNAL_ERROR
    async with trio.open_nursery() as service:
        resolver = await start_resolver(service, network)
        client = KvcmClient(network)
        for _ in range(BREAKER_CFG.failure_threshold):
            await query_kvcm(resolver, client)
        assert resolver.snapshot().breaker.state is BreakerState.OPEN
        service.cancel_scope.cancel()  # the resolver's task is down (as between a crash and its restart)
    await trio.sleep(BREAKER_CFG.cooldown_s)  # a trial is due: only the task may hand it out
    start = trio.current_time()
    assert await resolver.admit(until=start + 0.005) is Admission.REJECT  # gave up at its own limit
    assert trio.current_time() - start == pytest.approx(0.005)
    with trio.move_on_after(0.005) as scope:  # the request's own deadline ends the wait the same way
        await resolver.admit()
    assert scope.cancelled_caught
    async with trio.open_nursery() as service:
        await service.start(resolver.run)  # restarted: the abandoned asks are skipped, no slot taken
        assert await resolver.admit() is Admission.TRIAL
        assert await resolver.admit() is Admission.REJECT
        service.cancel_scope.cancel()


async def test_an_abandoned_leader_ask_starts_no_lookup(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    FakeKvcm(network)
    targets: list[tuple[str, ...]] = [()]
    resolver = LeaderResolver(
        LEADER_CFG, BREAKER_CFG, KvcmClient(network), lambda: targets[0], instance_id=INSTANCE, inbox_size=64
    )
    async with trio.open_nursery() as service:
        await service.start(resolver.run)
        await trio.testing.wait_all_tasks_blocked()  # no target: looked for again at no_leader_retry_s
        service.cancel_scope.cancel()  # the resolver's task is down (as between a crash and its restart)
    targets[0] = NODES
    with trio.move_on_after(0.005) as scope:  # the caller leaves before the task reads its ask
        await resolver.leader()
    assert scope.cancelled_caught
    async with trio.open_nursery() as service:
        await service.start(resolver.run)  # restarted before the scheduled lookup: the ask is skipped
        await trio.testing.wait_all_tasks_blocked()
        assert cluster_info_calls(network) == 0
        service.cancel_scope.cancel()


async def test_an_ask_reaching_the_task_after_lookups_began_failing_fails_fast_without_a_lookup(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A request that read the view before the failure it is about to show asks the task, which
    answers from its own state. Sent as the private ask: which of a request and a lookup result the
    task reads first within one scheduling round is not something the public API can arrange."""
    network = MemoryNetwork()  # refused everywhere
    resolver = await start_resolver(nursery, network, config=dataclasses.replace(LEADER_CFG, backoff_initial_s=3.0))
    await trio.testing.wait_all_tasks_blocked()
    calls = cluster_info_calls(network)
    reply = await ask(resolver._send, _AskLeader())
    assert isinstance(reply, LeaderUnavailable)
    assert (reply.reason, reply.waited) == (UnavailableReason.BACKING_OFF, False)
    await trio.testing.wait_all_tasks_blocked()
    assert cluster_info_calls(network) == calls


async def test_an_ask_reaching_the_task_after_the_bootstrap_targets_went_fails_fast_without_a_lookup(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """As above, with discovery losing the targets after the request read them: no lookup is started
    for nobody to ask. Sent as the private ask for the same reason."""
    network = MemoryNetwork()
    FakeKvcm(network)
    resolver = await start_resolver(nursery, network, bootstrap=lambda: ())
    await trio.testing.wait_all_tasks_blocked()
    lookups = resolver.snapshot().lookups_total
    reply = await ask(resolver._send, _AskLeader())
    assert isinstance(reply, LeaderUnavailable)
    assert (reply.reason, reply.waited) == (UnavailableReason.NO_BOOTSTRAP, False)
    await trio.testing.wait_all_tasks_blocked()
    snap = resolver.snapshot()
    assert (snap.lookups_total, snap.lookups_by_trigger["request"]) == (lookups, 0)


async def test_a_crashed_task_answers_its_waiters_and_the_restarted_one_resolves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    kvcm.hang = set(NODES)
    resolver = LeaderResolver(
        LEADER_CFG, BREAKER_CFG, KvcmClient(network), lambda: NODES, instance_id=INSTANCE, inbox_size=64
    )
    outcomes: list[tuple[float, UnavailableReason | str]] = []

    async def crash_soon() -> None:
        await trio.sleep(0.01)
        raise RuntimeError("a bug in the resolver")

    async with trio.open_nursery() as callers:
        for _ in range(3):
            callers.start_soon(lambda: _record(outcomes, resolver))
        with pytest.raises(BaseExceptionGroup):  # the crash ends the resolver's nursery
            async with trio.open_nursery() as service:
                await service.start(resolver.run)
                service.start_soon(crash_soon)
    assert outcomes == [(0.01, UnavailableReason.FAILED)] * 3  # answered by the crashing task, not left waiting
    retry_at = resolver.snapshot().next_attempt_at  # the crashed lookup counts as failed: backing off
    assert retry_at is not None
    kvcm.hang = set()
    async with trio.open_nursery() as service:
        await service.start(resolver.run)  # restarted as the supervisor would: state kept, lookups resume
        await trio.sleep_until(retry_at + 0.001)
        leader = resolver.cached_leader()
        assert leader is not None and leader.target == NODES[0]
        service.cancel_scope.cancel()


async def _record(outcomes: list[tuple[float, UnavailableReason | str]], resolver: LeaderResolver) -> None:
    with trio.fail_after(10):
        outcomes.append(await timed_leader(resolver))


async def test_a_lookup_result_queued_when_the_task_crashes_is_applied_once_and_answers_its_waiters(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash in the middle of a batch left the lookup's result queued behind the message that
    crashed: the finally failed the waiters ("resolver stopped during the lookup", judged as a leader
    miss) and backed off, then the restarted task applied the queued result as well (two lookups
    counted for one round). The finally applies the queued result, and the restarted task skips it."""
    network = MemoryNetwork()
    kvcm = FakeKvcm(network)
    for node in NODES:
        kvcm.delay[node] = 0.01
    resolver = LeaderResolver(
        LEADER_CFG, BREAKER_CFG, KvcmClient(network), lambda: NODES, instance_id=INSTANCE, inbox_size=64
    )
    apply_outcome = resolver._apply_outcome
    crashes = [RuntimeError("a bug in the resolver")]

    def crash_once(outcome: _Outcome) -> None:
        if crashes:
            raise crashes.pop()
        apply_outcome(outcome)

    lookup_round = resolver._lookup_round

    async def round_then_report(targets: tuple[str, ...], suspects: frozenset[str]) -> _LookupResult:
        result = await lookup_round(targets, suspects)
        # Taken by the waiting task at once; the result, queued next without a checkpoint, is in its batch.
        resolver.record_kvcm(None, trial=False, given_s=math.inf, started_at=0.0)
        return result

    monkeypatch.setattr(resolver, "_apply_outcome", crash_once)
    monkeypatch.setattr(resolver, "_lookup_round", round_then_report)
    outcomes: list[tuple[float, UnavailableReason | str]] = []
    async with trio.open_nursery() as callers:
        callers.start_soon(_record, outcomes, resolver)
        with pytest.raises(BaseExceptionGroup):  # the crash ends the resolver's nursery
            async with trio.open_nursery() as service:
                await service.start(resolver.run)
    assert outcomes == [(0.01, NODES[0])]  # the round's answer, not "resolver stopped during the lookup"
    snap = resolver.snapshot()
    assert (snap.state, snap.consecutive_failures, snap.inbox_depth) == (LeaderState.LEADER, 0, 1)
    async with trio.open_nursery() as service:
        await service.start(resolver.run)  # restarted: the queued result is skipped, not applied again
        await trio.testing.wait_all_tasks_blocked()
        snap = resolver.snapshot()
        assert (snap.lookups_total, sum(snap.lookups_by_trigger.values()), snap.lookup_rpcs_total) == (1, 1, len(NODES))
        assert (snap.state, snap.leader_target, snap.inbox_depth) == (LeaderState.LEADER, NODES[0], 0)
        assert cluster_info_calls(network) == len(NODES)
        service.cancel_scope.cancel()
