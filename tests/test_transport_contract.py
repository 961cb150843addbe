"""One contract suite, two adapters: what a client sees from the simulated peers must not depend on
the transport.

- ``memory``: MemoryNetwork + the sim's in-memory handlers, under MockClock(autojump_threshold=0).
- ``grpc``: the sim's real gRPC servers on 127.0.0.1:0 + GrpcRawRpc over the ChannelPool, with
  the real clock.

Autojump and real sockets never meet: the ``clock`` fixture is a MockClock only for ``memory``.
Every test body runs under an absolute ``trio.fail_after(10)`` (virtual seconds in memory).
The last section is the gRPC sim server's own: when it reads its clock, and ``CallStats``' waits.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial

import grpc
import pytest
import trio
import trio.testing

from actors.channel_pool import ChannelPool
from kvroute_sim.sim.cluster import SimCluster, SimClusterAddresses
from kvroute_sim.sim.faults import CallStats, Garble
from kvroute_sim.sim.grpc_server import serve_endpoint
from kvroute_sim.sim.kvcm import KvcmFaults
from kvroute_sim.sim.worker import SimWorker, WorkerFaults, WorkerSpec
from router.config import ChannelPoolConfig
from router.transport.clients import KvcmClient, WorkerStatusClient
from router.transport.errors import DeadlineExceeded, GarbledReply, NotLeader, NotSent, RemoteError, Unavailable
from router.transport.grpc_adapter import GrpcRawRpc
from router.transport.memory_adapter import MemoryNetwork
from router.transport.ports import LEAST_IN_TURN_CALL_S, RawRpc, WorkerStatusAsk
from router.types import CacheQuery, HostMatch, QueryType, Role, WorkerStatus
from router.wire import kvcm_meta_pb2 as kvcm_pb
from router.wire import paths

KEYS = tuple(range(1000, 1016))
INSTANCE = "demo_64"
LIMIT_S = 10  # absolute bound per test


@dataclass
class Harness:
    adapter: str
    cluster: SimCluster
    addresses: SimClusterAddresses
    rpc: RawRpc
    kvcm: KvcmClient
    status: WorkerStatusClient
    refused_target: str  # nothing answers here

    def node(self, i: int) -> tuple[str, str]:
        return self.addresses.kvcm_nodes[i]

    def query(self, p2p_host_count: int = 0) -> CacheQuery:
        return CacheQuery(
            INSTANCE, QueryType.PREFIX_MATCH, KEYS, trace_id="t-1", p2p_host_count=p2p_host_count
        )

    async def until_in_flight(self, stats: CallStats, method_path: str, count: int) -> None:
        """Wait until the server holds ``count`` calls of ``method_path`` (without polling)."""
        if self.adapter == "memory":
            await trio.testing.wait_all_tasks_blocked()
            assert stats.get(method_path).in_flight == count
        else:
            assert await trio.to_thread.run_sync(stats.wait_in_flight, method_path, count, 5.0)


@pytest.fixture(params=["memory", "grpc"])
def adapter(request: pytest.FixtureRequest) -> str:
    param: str = request.param
    return param


@pytest.fixture
def clock(adapter: str) -> trio.testing.MockClock | None:
    """pytest-trio runs a test on the Clock among its arguments: MockClock in memory only."""
    return trio.testing.MockClock(autojump_threshold=0) if adapter == "memory" else None


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port bound but not listening: connections to it are refused for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
async def harness(adapter: str, nursery: trio.Nursery, request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    cluster = SimCluster(
        [WorkerSpec(prefill_tokens_per_s=1000.0), WorkerSpec(role="RoleType.PDFUSION", block_size=None)],
        kvcm_replicas=3,
        instance_id=INSTANCE,
    )
    if adapter == "memory":
        network = MemoryNetwork()
        addresses = cluster.serve_memory(network)
        rpc: RawRpc = network
        yield Harness(
            adapter, cluster, addresses, rpc, KvcmClient(rpc), WorkerStatusClient(rpc), "127.9.9.9:1"
        )
        return
    addresses = await nursery.start(cluster.serve_grpc)
    pool = ChannelPool(ChannelPoolConfig())
    await nursery.start(pool.run)
    rpc = GrpcRawRpc(pool, start_off_loop=True)
    refusing_port: int = request.getfixturevalue("refusing_port")  # real adapters only: no socket under MockClock
    refused = f"127.0.0.1:{refusing_port}"
    yield Harness(adapter, cluster, addresses, rpc, KvcmClient(rpc), WorkerStatusClient(rpc), refused)
    await pool.aclose()


# ---- GetClusterInfo ----


async def test_cluster_info_names_the_leader_from_every_replica(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        leader_node, leader_target = harness.node(0)
        for node, target in harness.addresses.kvcm_nodes:
            info = await harness.kvcm.get_cluster_info(target, INSTANCE)
            assert info.self_node_id == node
            assert info.leader is not None
            assert (info.leader.node_id, info.leader.target) == (leader_node, leader_target)


async def test_cluster_info_without_a_leader(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        node1, target1 = harness.node(1)
        harness.cluster.kvcm.set_faults(node1, KvcmFaults(no_leader_elected=True))
        assert (await harness.kvcm.get_cluster_info(target1, INSTANCE)).leader is None
        assert (await harness.kvcm.get_cluster_info(harness.node(2)[1], INSTANCE)).leader is not None
        harness.cluster.kvcm.set_leader(None)
        assert (await harness.kvcm.get_cluster_info(harness.node(0)[1], INSTANCE)).leader is None


# ---- GetHostCacheState ----


async def test_cache_state_matches(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        w0, w1 = (w.http_target for w in harness.addresses.workers)
        harness.cluster.run_prefill(0, "seed-0", KEYS, 16 * 64, trio.current_time())
        harness.cluster.run_prefill(1, "seed-1", KEYS[:5], 5 * 64, trio.current_time())
        leader = harness.node(0)[1]
        state = await harness.kvcm.get_host_cache_state(leader, harness.query())
        assert state.hosts == (HostMatch(w0, 16, 0, 16), HostMatch(w1, 5, 0, 5))
        state = await harness.kvcm.get_host_cache_state(leader, harness.query(p2p_host_count=2))
        assert state.hosts == (HostMatch(w0, 16, 0, 16), HostMatch(w1, 5, 11, 16))
        other = CacheQuery(INSTANCE, QueryType.PREFIX_MATCH, (1, 2, 3))
        assert (await harness.kvcm.get_host_cache_state(leader, other)).hosts == ()


async def test_follower_says_not_leader_until_it_leads(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        node1, follower = harness.node(1)
        with pytest.raises(NotLeader) as caught:
            await harness.kvcm.get_host_cache_state(follower, harness.query())
        assert caught.value.code == kvcm_pb.SERVER_NOT_LEADER and caught.value.target == follower
        harness.cluster.kvcm.set_leader(node1)
        assert (await harness.kvcm.get_host_cache_state(follower, harness.query())).hosts == ()
        with pytest.raises(NotLeader):
            await harness.kvcm.get_host_cache_state(harness.node(0)[1], harness.query())


async def test_error_code_is_a_remote_error(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        node, target = harness.node(0)
        harness.cluster.kvcm.set_faults(node, KvcmFaults(error_code=kvcm_pb.INTERNAL_ERROR))
        with pytest.raises(RemoteError) as caught:
            await harness.kvcm.get_host_cache_state(target, harness.query())
        assert not isinstance(caught.value, NotLeader)
        assert (caught.value.code, caught.value.code_name) == (kvcm_pb.INTERNAL_ERROR, "INTERNAL_ERROR")
        with pytest.raises(RemoteError, match="INTERNAL_ERROR"):
            await harness.kvcm.get_cluster_info(target, INSTANCE)


@pytest.mark.parametrize("garble", list(Garble))
async def test_garbled_reply(clock: object, harness: Harness, garble: Garble) -> None:
    with trio.fail_after(LIMIT_S):
        node, target = harness.node(0)
        harness.cluster.kvcm.set_faults(node, KvcmFaults(garbled=garble))
        with pytest.raises(GarbledReply):
            await harness.kvcm.get_cluster_info(target, INSTANCE)
        with pytest.raises(GarbledReply):
            await harness.kvcm.get_host_cache_state(target, harness.query())
        harness.cluster.workers[0].set_faults(WorkerFaults(garbled=garble))
        with pytest.raises(GarbledReply):
            await harness.status.get_worker_status(harness.addresses.workers[0].status_target, -1)


async def test_dead_peer_is_unavailable(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        node, target = harness.node(0)
        harness.cluster.kvcm.set_faults(node, KvcmFaults(dead=True))
        with pytest.raises(Unavailable):
            await harness.kvcm.get_cluster_info(target, INSTANCE)
        harness.cluster.workers[1].set_faults(WorkerFaults(dead=True))
        with pytest.raises(Unavailable):
            await harness.status.get_worker_status(harness.addresses.workers[1].status_target, -1)
        with pytest.raises(Unavailable):
            await harness.kvcm.get_cluster_info(harness.refused_target, INSTANCE)
        harness.cluster.kvcm.clear_faults()
        assert (await harness.kvcm.get_cluster_info(target, INSTANCE)).leader is not None


async def test_unknown_method_is_unimplemented(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        with pytest.raises(RemoteError) as caught:
            await harness.rpc.call(harness.node(0)[1], paths.WORKER_GET_STATUS, b"")
        assert caught.value.code_name == "grpc:UNIMPLEMENTED"


# ---- delays and hangs against the caller's deadline ----


async def test_delay_is_observed(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        node, target = harness.node(0)
        harness.cluster.kvcm.set_faults(node, KvcmFaults(delay_s=0.2))
        start = trio.current_time()
        await harness.kvcm.get_host_cache_state(target, harness.query())
        elapsed = trio.current_time() - start
        assert elapsed >= 0.2
        if harness.adapter == "memory":
            assert elapsed == pytest.approx(0.2)


async def test_hang_ends_at_the_callers_deadline(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        node, target = harness.node(0)
        harness.cluster.kvcm.set_faults(node, KvcmFaults(hang=True))
        stats = harness.cluster.kvcm.stats(node)
        budget = 0.3
        start = trio.current_time()
        deadline_error = False
        with trio.move_on_after(budget) as scope:
            try:
                await harness.kvcm.get_host_cache_state(target, harness.query())
            except DeadlineExceeded:
                deadline_error = True  # gRPC's own timeout (= the remaining deadline) fired first
        elapsed = trio.current_time() - start
        assert scope.cancelled_caught or deadline_error
        assert elapsed >= budget - 0.01
        # At the deadline, not later: asserted on virtual time only (the real clock's lateness is
        # the machine's; the test's own limit catches a call that waits for the hang).
        if harness.adapter == "memory":
            assert elapsed == pytest.approx(budget)
        # The server saw the caller go away: the hung handler ended although the fault is still on.
        await harness.until_in_flight(stats, paths.KVCM_GET_HOST_CACHE_STATE, 0)
        assert harness.cluster.kvcm.faults(node).hang


async def test_a_call_whose_deadline_has_passed_is_not_sent(clock: object, harness: Harness) -> None:
    """NotSent, a DeadlineExceeded the peer never saw: a caller may retry it elsewhere, and a fake peer
    that answered it would hide from MockClock tests what the real adapter does."""
    with trio.fail_after(LIMIT_S):
        node, target = harness.node(0)
        stats = harness.cluster.kvcm.stats(node)
        await harness.kvcm.get_cluster_info(target, INSTANCE)  # the channel is open: only the deadline stops it
        with trio.CancelScope(deadline=trio.current_time() - 1) as scope:
            with pytest.raises(NotSent):
                await harness.kvcm.get_cluster_info(target, INSTANCE)
            with pytest.raises(NotSent):  # before the target is looked at
                await harness.kvcm.get_cluster_info(harness.refused_target, INSTANCE)
        assert not scope.cancelled_caught
        assert stats.get(paths.KVCM_GET_CLUSTER_INFO).calls == 1
        if isinstance(harness.rpc, MemoryNetwork):
            assert harness.rpc.call_count(method_path=paths.KVCM_GET_CLUSTER_INFO) == 1


async def test_hang_is_answered_when_the_fault_clears(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        node, target = harness.node(0)
        harness.cluster.run_prefill(0, "seed", KEYS, 16 * 64, trio.current_time())
        harness.cluster.kvcm.set_faults(node, KvcmFaults(hang=True))
        stats = harness.cluster.kvcm.stats(node)
        answers = []

        async def query() -> None:
            answers.append(await harness.kvcm.get_host_cache_state(target, harness.query()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(query)
            await harness.until_in_flight(stats, paths.KVCM_GET_HOST_CACHE_STATE, 1)
            assert answers == []
            harness.cluster.kvcm.clear_faults()
        assert [s.hosts for s in answers] == [
            (HostMatch(harness.addresses.workers[0].http_target, 16, 0, 16),)
        ]


async def test_a_hung_call_follows_the_fault_it_changes_to(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        worker = harness.cluster.workers[1]
        target = harness.addresses.workers[1].status_target
        worker.set_faults(WorkerFaults(hang=True))

        async def ask() -> None:
            with pytest.raises(Unavailable):
                await harness.status.get_worker_status(target, -1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await harness.until_in_flight(worker.stats, paths.WORKER_GET_STATUS, 1)
            worker.set_faults(WorkerFaults(dead=True))  # the hang becomes a dead peer, not an answer


async def test_a_delayed_call_ends_on_the_server_when_the_caller_leaves(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        worker = harness.cluster.workers[1]
        target = harness.addresses.workers[1].status_target
        worker.set_faults(WorkerFaults(delay_s=30.0))  # far longer than the test waits
        with trio.move_on_after(0.3):
            with contextlib.suppress(DeadlineExceeded):  # gRPC's own timeout may fire first
                await harness.status.get_worker_status(target, -1)
        # The handler (a thread under gRPC) is free again although the delay has not run out.
        await harness.until_in_flight(worker.stats, paths.WORKER_GET_STATUS, 0)


# ---- GetWorkerStatus ----


async def test_worker_status_decodes(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        prefill, pdfusion = harness.addresses.workers
        worker = harness.cluster.workers[0]
        now = trio.current_time()
        # An hour of prefill at 1000 tokens/s: on the real clock it is still running (and r-2
        # waiting) however long the machine stalls before the status is read.
        uncached = 3600 * 1000
        worker.submit("r-1", uncached + 1000, 1000, now)
        worker.submit("r-2", 500, 0, now)
        status = await harness.status.get_worker_status(prefill.status_target, -1)
        assert status.role is Role.PREFILL and status.role_reported == "RoleType.PREFILL"
        assert status.alive and status.status_version == worker.status_version > 1
        assert [t.request_id for t in status.running] == ["r-1"]
        assert [(t.request_id, t.input_length, t.prefix_length) for t in status.waiting] == [("r-2", 500, 0)]
        remaining = status.running[0].remaining_prefill_tokens
        assert remaining is not None and 0 < remaining <= uncached
        assert status.block_size == 64

        other = await harness.status.get_worker_status(pdfusion.status_target, -1)
        assert other.role is Role.PDFUSION and other.block_size is None
        assert (other.running, other.waiting) == ((), ())

        harness.cluster.workers[1].set_faults(WorkerFaults(status_version_zero=True, not_alive=True))
        other = await harness.status.get_worker_status(pdfusion.status_target, -1)
        assert (other.status_version, other.alive) == (0, False)


async def test_a_batch_in_turn_has_threads_of_its_own(clock: object, harness: Harness) -> None:
    """Every thread of trio's default limiter held (as hung DNS lookups of a scheduler's name hold
    them): a batch of status calls in turn still runs at once, not after the lookups give up."""
    if harness.adapter == "memory":
        pytest.skip("threads are the gRPC adapter's")
    release = threading.Event()
    default = trio.to_thread.current_default_thread_limiter()
    with trio.fail_after(LIMIT_S):
        async with trio.open_nursery() as holders:
            for _ in range(int(default.total_tokens)):
                holders.start_soon(partial(trio.to_thread.run_sync, release.wait, abandon_on_cancel=True))
            await trio.testing.wait_all_tasks_blocked()
            assert default.borrowed_tokens == default.total_tokens
            try:
                prefill = harness.addresses.workers[0].status_target
                (reply,) = await harness.status.get_worker_statuses([WorkerStatusAsk(prefill, -1)], 5.0)
                assert isinstance(reply.status, WorkerStatus)
            finally:
                release.set()


async def test_calls_in_turn_share_the_allowance_and_each_begins_where_the_one_before_ended(
    clock: object, harness: Harness
) -> None:
    """A hung call after a slow one gets what the slow one left of the allowance, not an allowance of
    its own, and its start is its own, not the batch's."""
    with trio.fail_after(LIMIT_S):
        prefill, pdfusion = (w.status_target for w in harness.addresses.workers)
        harness.cluster.workers[0].set_faults(WorkerFaults(delay_s=0.2))
        harness.cluster.workers[1].set_faults(WorkerFaults(hang=True))
        within_s = 1.0
        start = trio.current_time()
        slow, hung = await harness.status.get_worker_statuses(
            [WorkerStatusAsk(prefill, -1), WorkerStatusAsk(pdfusion, -1)], within_s
        )
        elapsed = trio.current_time() - start
        assert isinstance(slow.status, WorkerStatus) and isinstance(hung.status, DeadlineExceeded)
        assert hung.began_after_s is not None and slow.ended_after_s >= 0.2
        assert hung.began_after_s >= slow.ended_after_s and hung.ended_after_s >= within_s - 0.01
        if harness.adapter == "memory":
            assert slow.ended_after_s == pytest.approx(0.2) and hung.began_after_s == pytest.approx(0.2)
            assert hung.ended_after_s == pytest.approx(within_s) and elapsed == pytest.approx(within_s)


async def test_a_call_in_turn_with_under_a_millisecond_left_is_not_made(clock: object, harness: Harness) -> None:
    """It could only time out. Only virtual time leaves exactly that little: the gRPC adapter's rule,
    which the in-memory network follows, is shown here on the in-memory one."""
    if harness.adapter != "memory":
        pytest.skip("a real clock cannot leave a batch exactly half a millisecond")
    with trio.fail_after(LIMIT_S):
        prefill, pdfusion = (w.status_target for w in harness.addresses.workers)
        within_s = 1.0
        harness.cluster.workers[0].set_faults(WorkerFaults(delay_s=within_s - LEAST_IN_TURN_CALL_S / 2))
        slow, skipped = await harness.status.get_worker_statuses(
            [WorkerStatusAsk(prefill, -1), WorkerStatusAsk(pdfusion, -1)], within_s
        )
        assert isinstance(slow.status, WorkerStatus)
        assert skipped.status is None and skipped.began_after_s is None
        assert harness.cluster.workers[1].stats.get(paths.WORKER_GET_STATUS).calls == 0


async def test_a_batch_in_turn_whose_deadline_has_passed_is_cancelled_with_no_call_made(
    clock: object, harness: Harness
) -> None:
    with trio.fail_after(LIMIT_S):
        prefill = harness.addresses.workers[0].status_target
        with trio.CancelScope(deadline=trio.current_time() - 1) as scope:
            await harness.status.get_worker_statuses([WorkerStatusAsk(prefill, -1)], 1.0)
        assert scope.cancelled_caught
        assert harness.cluster.workers[0].stats.get(paths.WORKER_GET_STATUS).calls == 0


async def test_worker_statuses_in_turn_fail_one_by_one_and_share_one_time_allowance(
    clock: object, harness: Harness
) -> None:
    with trio.fail_after(LIMIT_S):
        prefill, pdfusion = (w.status_target for w in harness.addresses.workers)
        harness.cluster.workers[1].set_faults(WorkerFaults(garbled=Garble.UNDECODABLE))
        asks = [
            WorkerStatusAsk(prefill, -1),
            WorkerStatusAsk(harness.refused_target, -1),
            WorkerStatusAsk(pdfusion, -1),
        ]
        replies = await harness.status.get_worker_statuses(asks, 5.0)
        first, refused, garbled = (reply.status for reply in replies)
        assert isinstance(first, WorkerStatus) and first.role is Role.PREFILL and first.alive
        assert isinstance(refused, Unavailable)
        assert isinstance(garbled, GarbledReply)
        ended = [reply.ended_after_s for reply in replies]  # each call's own end, one after another
        assert 0.0 <= ended[0] <= ended[1] <= ended[2]

        # A hung worker takes what is left of the allowance: the asks after it are not made.
        harness.cluster.workers[1].set_faults(WorkerFaults(hang=True))
        within_s = 0.3
        start = trio.current_time()
        hung, after = await harness.status.get_worker_statuses(
            [WorkerStatusAsk(pdfusion, -1), WorkerStatusAsk(prefill, -1)], within_s
        )
        elapsed = trio.current_time() - start
        assert isinstance(hung.status, DeadlineExceeded)
        assert after.status is None
        assert elapsed >= within_s - 0.01
        assert hung.ended_after_s >= within_s - 0.01
        if harness.adapter == "memory":
            assert elapsed == pytest.approx(within_s)

        # A reply made before a hung call is as old as its own end, not the batch's.
        first_reply, hung_after = await harness.status.get_worker_statuses(
            [WorkerStatusAsk(prefill, -1), WorkerStatusAsk(pdfusion, -1)], within_s
        )
        assert isinstance(first_reply.status, WorkerStatus) and isinstance(hung_after.status, DeadlineExceeded)
        assert first_reply.ended_after_s < hung_after.ended_after_s and hung_after.ended_after_s >= within_s - 0.01
        assert await harness.status.get_worker_statuses([], within_s) == []


# ---- the gRPC server's clock and its call counts ----


async def test_a_delayed_grpc_reply_reads_the_clock_when_it_answers(
    nursery: trio.Nursery, pool: ChannelPool[grpc.Channel]
) -> None:
    """The reply shows the worker as it is when the delay is over, not as it was when the call arrived."""
    with trio.fail_after(LIMIT_S):
        ticks = itertools.count(0.0, 10.0)  # each read of the server's clock is 10 s after the last
        worker = SimWorker("w", WorkerSpec(prefill_tokens_per_s=1000.0))
        worker.submit("a", 5000, 0, 0.0)  # prefill 0..5 s
        worker.set_faults(WorkerFaults(delay_s=0.05))
        server = await nursery.start(partial(serve_endpoint, worker, clock=lambda: next(ticks)))
        status = await WorkerStatusClient(GrpcRawRpc(pool, start_off_loop=True)).get_worker_status(server.target, -1)
        assert [t.request_id for t in status.finished] == ["a"] and status.running == ()


def test_wait_in_flight_waits_for_the_exact_count() -> None:
    method = paths.WORKER_GET_STATUS
    stats = CallStats(frozenset({method}))
    stats.begin(method)
    assert not stats.wait_in_flight(method, 0, 0.05)
    assert not stats.wait_in_flight(method, 2, 0.05)
    assert stats.wait_in_flight(method, 1, 0.05)
    stats.end(method)
    assert stats.wait_in_flight(method, 0, 0.05)
