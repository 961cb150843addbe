"""One contract suite, three adapters of MasterTransport, against SimMaster.

- ``memory``: MemoryMasterNetwork + SimMaster.serve_memory, under MockClock(autojump_threshold=0).
- ``http``: SimMaster's real replicas on 127.0.0.1:0 + HttpMasterTransport, real clock.
- ``grpc``: the same replicas (gRPC on HTTP + 2) + GrpcMasterTransport over the ChannelPool, real clock.

Every test body runs under ``trio.fail_after(LIMIT_S)`` (virtual seconds in memory).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from functools import partial

import pytest
import trio
import trio.testing

from actors.channel_pool import ChannelPool
from kvroute_sim.sim.master import MasterFaults, SimMaster, SimMasterAddresses, SimMasterReplica
from router.config import ChannelPoolConfig, LimitsConfig, MasterConfig
from router.transport.errors import DeadlineExceeded, GarbledReply, NotSent, RemoteError, TransportError, Unavailable
from router.transport.master_body import SCHEDULE_JSON_SLICE_ITEMS
from router.transport.master_grpc import GrpcMasterTransport
from router.transport.master_http import HttpMasterTransport
from router.transport.master_memory import MemoryMasterNetwork
from router.transport.ports import MasterTransport
from router.types import Role, RoleAddr
from router.wire import paths
from router.wire.master import (
    CODE_NO_AVAILABLE_WORKER,
    MAX_REPLY_BYTES,
    MasterBusinessError,
    MasterFallback,
    MasterRouted,
    MasterScheduleRequest,
    grpc_request_id,
)

LIMIT_S = 10
PREFILL = RoleAddr(Role.PREFILL, "10.0.0.1", 8000, 8001)
DECODE = RoleAddr(Role.DECODE, "10.0.0.2", 9000, 9001)
REQUEST = MasterScheduleRequest("req-1", (11, 12, 13), 64, 192)


@dataclass
class Harness:
    adapter: str
    sim: SimMaster
    addresses: SimMasterAddresses
    transport: MasterTransport
    refused_host: str

    def host(self, i: int) -> str:
        return self.addresses.hosts[i]

    @property
    def schedule_path(self) -> str:
        return paths.MASTER_SCHEDULE if self.adapter == "grpc" else paths.MASTER_HTTP_SCHEDULE

    async def until_in_flight(self, replica: SimMasterReplica, count: int) -> None:
        """Wait (without polling) until ``replica`` holds ``count`` schedule calls."""
        if self.adapter == "memory":
            await trio.testing.wait_all_tasks_blocked()
            assert replica.stats.get(self.schedule_path).in_flight == count
        else:
            assert await trio.to_thread.run_sync(replica.stats.wait_in_flight, self.schedule_path, count, 5.0)

    async def set_refusing(self, index: int, faults: MasterFaults) -> None:
        self.sim.set_faults(index, faults)
        if self.adapter != "memory":
            await self.sim.replicas[index].wait_listening(False)

    async def clear(self) -> None:
        self.sim.clear_faults()
        if self.adapter != "memory":
            for replica in self.sim.replicas:
                await replica.wait_listening(True)


@pytest.fixture(params=["memory", "http", "grpc"])
def adapter(request: pytest.FixtureRequest) -> str:
    param: str = request.param
    return param


@pytest.fixture
def clock(adapter: str) -> trio.testing.MockClock | None:
    return trio.testing.MockClock(autojump_threshold=0) if adapter == "memory" else None


@pytest.fixture
def refusing_port() -> Iterator[int]:
    """A loopback port bound but not listening: connections to it are refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
async def harness(adapter: str, nursery: trio.Nursery, request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    sim = SimMaster([PREFILL, DECODE], replicas=3, elected=1, queue_length=7)
    if adapter == "memory":
        network = MemoryMasterNetwork()
        yield Harness(adapter, sim, sim.serve_memory(network), network, "10.99.0.1:7001")
        return
    addresses = await nursery.start(sim.run)
    refusing_port: int = request.getfixturevalue("refusing_port")  # real adapters only: no socket under MockClock
    refused = f"127.0.0.1:{refusing_port - 2}" if adapter == "grpc" else f"127.0.0.1:{refusing_port}"
    async with HttpMasterTransport(MasterConfig()) as http:
        if adapter == "http":
            yield Harness(adapter, sim, addresses, http, refused)
        else:
            pool = ChannelPool(ChannelPoolConfig())
            await nursery.start(pool.run)
            yield Harness(adapter, sim, addresses, GrpcMasterTransport(pool, http, start_off_loop=True), refused)
            await pool.aclose()


# ---- answers ----


async def test_routed_names_every_role_and_the_elected_master(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        for i in range(3):
            reply = await harness.transport.schedule(harness.host(i), REQUEST)
            assert reply == MasterRouted((DECODE, PREFILL), harness.host(1), 7)
        assert harness.sim.schedules == 3


async def test_a_long_prompts_ids_arrive_whole_over_http(clock: object, harness: Harness) -> None:
    """The longest prompt the limits allow, as token ids (no keys: KVCM off), encoded in slices."""
    if harness.adapter == "grpc":
        pytest.skip("the gRPC schedule API carries no token ids")
    ids = tuple(range(100_000, 100_000 + LimitsConfig().max_prompt_tokens))
    seen: list[MasterScheduleRequest] = []

    def decide(request: MasterScheduleRequest) -> list[RoleAddr]:
        seen.append(request)
        return [PREFILL]

    harness.sim.set_decide(decide)
    with trio.fail_after(LIMIT_S):
        request = MasterScheduleRequest("long", seq_len=len(ids), input_ids=ids)
        reply = await harness.transport.schedule(harness.host(1), request)
    assert isinstance(reply, MasterRouted)
    assert [request.input_ids for request in seen] == [ids]


async def test_a_long_prompts_body_is_encoded_in_slices_other_tasks_running_between(
    clock: object, harness: Harness
) -> None:
    if harness.adapter != "memory":
        pytest.skip("counted in scheduling rounds, on virtual time")
    ids = tuple(range(LimitsConfig().max_prompt_tokens))
    ticks = 0
    done = trio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await trio.lowlevel.checkpoint()

    with trio.fail_after(LIMIT_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.lowlevel.checkpoint()  # the ticker is running
            started = ticks
            request = MasterScheduleRequest("long", seq_len=len(ids), input_ids=ids)
            reply = await harness.transport.schedule(harness.host(1), request)
            done.set()
    assert isinstance(reply, MasterRouted)
    assert ticks - started >= len(ids) // SCHEDULE_JSON_SLICE_ITEMS  # it ran between every two slices


async def test_single_role_and_default_grpc_port(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        fused = RoleAddr(Role.PDFUSION, "10.0.0.3", 8100, 8101)
        harness.sim.set_decide(lambda request: [fused])
        reply = await harness.transport.schedule(harness.host(0), MasterScheduleRequest("no-keys", seq_len=10))
        assert isinstance(reply, MasterRouted) and reply.role_addrs == (fused,)


async def test_fallback_8600(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        harness.sim.set_faults(0, MasterFaults(fallback=True))
        reply = await harness.transport.schedule(harness.host(0), REQUEST)
        assert isinstance(reply, MasterFallback) and reply.code == 8600
        assert reply.http_status == (None if harness.adapter == "grpc" else 500)


@pytest.mark.parametrize("code", [8400, 8402, 8403, 8404, 8405, 8406, 8502, 8503, 8504, 9999])
async def test_business_error_codes(clock: object, harness: Harness, code: int) -> None:
    with trio.fail_after(LIMIT_S):
        harness.sim.set_faults(2, MasterFaults(business_error=code))
        reply = await harness.transport.schedule(harness.host(2), REQUEST)
        assert isinstance(reply, MasterBusinessError)
        assert reply.code == code and str(code) in reply.message


async def test_a_queueing_scheduler_answers_8503_once_generate_timeout_passes(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        harness.sim.set_faults(0, MasterFaults(queue_timeout_early_ms=0.0))
        start = trio.current_time()
        reply = await harness.transport.schedule(harness.host(0), replace(REQUEST, generate_timeout_ms=20))
        assert isinstance(reply, MasterBusinessError) and reply.code == 8503
        assert trio.current_time() - start >= 0.020


async def test_no_worker_is_8400(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        harness.sim.set_decide(lambda request: [])
        reply = await harness.transport.schedule(harness.host(0), REQUEST)
        assert isinstance(reply, MasterBusinessError) and reply.code == 8400


async def test_invalid_request_is_8406(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        bad = MasterScheduleRequest("no-block-size", (1, 2), None, 128)
        reply = await harness.transport.schedule(harness.host(0), bad)
        assert isinstance(reply, MasterBusinessError) and reply.code == 8406
        assert "block_size" in reply.message


async def test_master_info_from_every_replica_names_the_elected_one(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        for i in range(3):
            info = await harness.transport.master_info(harness.host(i))
            assert (info.real_master_host, info.queue_length) == (harness.host(1), 7)
        harness.sim.elect(2)
        harness.sim.queue_length = 50
        info = await harness.transport.master_info(harness.host(0))
        assert (info.real_master_host, info.queue_length) == (harness.host(2), 50)


# ---- no usable reply: exceptions ----


async def test_garbled_body_is_garbled(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        harness.sim.set_faults(0, MasterFaults(garbled=True))
        with pytest.raises(GarbledReply):
            await harness.transport.schedule(harness.host(0), REQUEST)
        if harness.adapter != "grpc":  # gRPC's master_info goes over HTTP as well
            with pytest.raises(GarbledReply):
                await harness.transport.master_info(harness.host(0))


async def test_a_reply_longer_than_the_bound_is_garbled_naming_the_bound(clock: object, harness: Harness) -> None:
    """A well-formed reply past MAX_REPLY_BYTES is refused unread: decoded, it would hold the routing thread."""
    with trio.fail_after(LIMIT_S):
        harness.sim.set_faults(0, MasterFaults(oversized=True))
        with pytest.raises(GarbledReply, match=f"{harness.schedule_path}: .*{MAX_REPLY_BYTES}"):
            await harness.transport.schedule(harness.host(0), REQUEST)
        with pytest.raises(GarbledReply, match=f"{paths.MASTER_HTTP_INFO}: .*{MAX_REPLY_BYTES}"):
            await harness.transport.master_info(harness.host(0))  # over HTTP for the gRPC adapter too
        harness.sim.clear_faults()
        assert isinstance(await harness.transport.schedule(harness.host(0), REQUEST), MasterRouted)


async def test_a_server_exception_is_no_available_worker_over_http_and_internal_over_grpc(
    clock: object, harness: Harness
) -> None:
    """Over HTTP the scheduler's exception is a plain-text 500: a usable reply, which the reference
    frontend fails with NO_AVAILABLE_WORKER. Over gRPC it is the INTERNAL status: no reply."""
    with trio.fail_after(LIMIT_S):
        harness.sim.set_faults(0, MasterFaults(server_error=True))
        if harness.adapter == "grpc":
            with pytest.raises(RemoteError) as caught:
                await harness.transport.schedule(harness.host(0), REQUEST)
            assert caught.value.code_name == "grpc:INTERNAL"
        else:
            reply = await harness.transport.schedule(harness.host(0), REQUEST)
            assert isinstance(reply, MasterBusinessError)
            assert (reply.code, reply.http_status) == (CODE_NO_AVAILABLE_WORKER, 500)
            assert "not JSON" in reply.message


async def test_refused_is_unavailable_and_recovers(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        with pytest.raises(Unavailable):
            await harness.transport.schedule(harness.refused_host, REQUEST)
        await harness.set_refusing(0, MasterFaults(refuse=True))
        with pytest.raises(Unavailable):
            await harness.transport.schedule(harness.host(0), REQUEST)
        with pytest.raises(Unavailable):
            await harness.transport.master_info(harness.host(0))
        await harness.clear()
        assert isinstance(await harness.transport.schedule(harness.host(0), REQUEST), MasterRouted)


async def test_flapping_alternates_refusing_and_answering(clock: object, harness: Harness) -> None:
    """In memory the periods pass on the virtual clock. The real servers flap with a period longer
    than the test, the test moving each into the middle of its next half (its period started 1.5 or
    2.5 periods ago): a phase never ends between the listeners' change and the call."""
    with trio.fail_after(LIMIT_S):
        replica = harness.sim.replicas[0]

        async def next_half(refusing: bool) -> None:
            if harness.adapter == "memory":
                await trio.sleep(0.5)
            else:
                period = 3600.0
                started = trio.current_time() - (1.5 if refusing else 2.5) * period
                replica.set_faults(MasterFaults(flapping_period_s=period), started)
                await replica.wait_listening(not refusing)

        if harness.adapter == "memory":
            harness.sim.set_faults(0, MasterFaults(flapping_period_s=0.5))
        outcomes: list[str] = []
        for _ in range(2):
            await next_half(refusing=True)
            with pytest.raises(Unavailable):
                await harness.transport.schedule(harness.host(0), REQUEST)
            outcomes.append("refused")
            await next_half(refusing=False)
            assert isinstance(await harness.transport.schedule(harness.host(0), REQUEST), MasterRouted)
            outcomes.append("routed")
        assert outcomes == ["refused", "routed"] * 2


async def test_a_call_to_a_host_nothing_serves_is_counted_in_memory(clock: object, harness: Harness) -> None:
    """Tests count the calls a host was sent, refused ones too (discovery's polls of a dead replica)."""
    if not isinstance(harness.transport, MemoryMasterNetwork):
        pytest.skip("call counts are the in-memory network's")
    with trio.fail_after(LIMIT_S):
        with pytest.raises(Unavailable):
            await harness.transport.schedule(harness.refused_host, REQUEST)
        with pytest.raises(Unavailable):
            await harness.transport.master_info(harness.refused_host)
    assert harness.transport.call_count(harness.refused_host, paths.MASTER_HTTP_SCHEDULE) == 1
    assert harness.transport.call_count(harness.refused_host, paths.MASTER_HTTP_INFO) == 1


async def test_bad_host_is_unavailable_naming_it(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S), pytest.raises(Unavailable, match="no-port"):
        await harness.transport.schedule("no-port", REQUEST)


# ---- time ----


async def test_slow_is_observed(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        harness.sim.set_faults(0, MasterFaults(slow_ms=200))
        start = trio.current_time()
        assert isinstance(await harness.transport.schedule(harness.host(0), REQUEST), MasterRouted)
        elapsed = trio.current_time() - start
        assert elapsed >= 0.2
        if harness.adapter == "memory":
            assert elapsed == pytest.approx(0.2)


async def test_hang_ends_at_the_callers_deadline_and_the_server_sees_it(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        replica = harness.sim.replicas[0]
        harness.sim.set_faults(0, MasterFaults(hang=True))
        budget = 0.3
        start = trio.current_time()
        deadline_error = False
        with trio.move_on_after(budget) as scope:
            try:
                await harness.transport.schedule(harness.host(0), REQUEST)
            except DeadlineExceeded:
                deadline_error = True  # gRPC's own timeout (= the remaining deadline) fired first
        elapsed = trio.current_time() - start
        assert scope.cancelled_caught or deadline_error
        assert elapsed >= budget - 0.01
        # At the deadline, not later: asserted on virtual time only (the real clock's lateness is
        # the machine's; the test's own limit catches a call that waits for the hang).
        if harness.adapter == "memory":
            assert elapsed == pytest.approx(budget)
        # The server saw the caller go away: the hung call ended although the fault is still on.
        await harness.until_in_flight(replica, 0)
        assert replica.faults.hang
        if harness.adapter == "http":
            assert replica.disconnects == 1
        if harness.adapter == "grpc":  # the abandoned call is followed by a best-effort Cancel
            assert await trio.to_thread.run_sync(replica.wait_cancels, 1, 5.0)
            # Past the deadline the reason is DEADLINE_EXCEEDED, whichever of the caller's scope and
            # gRPC's own timeout fired first.
            assert replica.cancels == [(grpc_request_id(REQUEST.request_id), True)]


async def test_a_schedule_cancelled_before_its_deadline_is_cancelled_by_the_client(
    clock: object, harness: Harness
) -> None:
    if harness.adapter != "grpc":
        pytest.skip("the best-effort Cancel and its reason are the gRPC protocol's")
    with trio.fail_after(LIMIT_S):
        replica = harness.sim.replicas[0]
        harness.sim.set_faults(0, MasterFaults(hang=True))
        with trio.CancelScope(deadline=trio.current_time() + LIMIT_S) as scope:

            async def schedule() -> None:
                await harness.transport.schedule(harness.host(0), REQUEST)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(schedule)
                await harness.until_in_flight(replica, 1)
                scope.cancel()  # long before the deadline: the caller went away
        assert await trio.to_thread.run_sync(replica.wait_cancels, 1, 5.0)
        assert replica.cancels == [(grpc_request_id(REQUEST.request_id), False)]


async def test_a_schedule_never_sent_is_never_cancelled(clock: object, harness: Harness) -> None:
    """Over gRPC a call whose deadline had passed before it could be sent was followed by a Cancel
    naming a request the scheduler never saw (a review)."""
    if harness.adapter != "grpc":
        pytest.skip("the best-effort Cancel is the gRPC protocol's")
    with trio.fail_after(LIMIT_S):
        replica = harness.sim.replicas[0]
        await harness.transport.schedule(harness.host(0), REQUEST)  # the channel is open: only the deadline stops it
        with trio.CancelScope(deadline=trio.current_time() - 1), pytest.raises(NotSent):  # already passed
            await harness.transport.schedule(harness.host(0), REQUEST)
        # A Cancel for it would be an RPC of its own: one call's worth of time for it to arrive.
        assert not await trio.to_thread.run_sync(replica.wait_cancels, 1, 0.5)


async def test_a_schedule_cancelled_while_it_waited_to_start_is_never_cancelled(
    clock: object, harness: Harness
) -> None:
    """A caller cancelled while its call waited for a start thread (every one busy): the request never
    left, and the Cancel that followed named a request the scheduler never saw."""
    if harness.adapter != "grpc":
        pytest.skip("the best-effort Cancel is the gRPC protocol's")
    transport = harness.transport
    assert isinstance(transport, GrpcMasterTransport)
    with trio.fail_after(LIMIT_S):
        replica = harness.sim.replicas[0]
        await transport.schedule(harness.host(0), REQUEST)  # the channel is open: only the start waits
        sent_before = replica.stats.get(harness.schedule_path).calls
        starters = transport._rpc._starters
        holders = [object() for _ in range(int(starters.total_tokens))]
        for holder in holders:
            starters.acquire_on_behalf_of_nowait(holder)
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(transport.schedule, harness.host(0), REQUEST)
                    await trio.testing.wait_all_tasks_blocked()
                    assert starters.statistics().tasks_waiting == 1  # the call waits for a start thread
                    scope.cancel()
        finally:
            for holder in holders:
                starters.release_on_behalf_of(holder)
        assert scope.cancelled_caught
        assert replica.stats.get(harness.schedule_path).calls == sent_before
        # A Cancel for it would be an RPC of its own: one call's worth of time for it to arrive.
        assert not await trio.to_thread.run_sync(replica.wait_cancels, 1, 0.5)


async def test_hang_is_answered_when_the_fault_clears(clock: object, harness: Harness) -> None:
    with trio.fail_after(LIMIT_S):
        replica = harness.sim.replicas[0]
        harness.sim.set_faults(0, MasterFaults(hang=True))
        replies = []

        async def schedule() -> None:
            replies.append(await harness.transport.schedule(harness.host(0), REQUEST))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(schedule)
            await harness.until_in_flight(replica, 1)
            assert replies == []
            harness.sim.clear_faults()
        assert replies == [MasterRouted((DECODE, PREFILL), harness.host(1), 7)]


# ---- cancel and connections ----


async def test_http_calls_never_wait_for_a_connection_of_the_client(clock: object, harness: Harness) -> None:
    """More calls at once than the connections kept for reuse all reach the scheduler: a call left
    waiting for one of ours would spend its window in our queue and be judged a failure of the
    scheduler (its breaker opening under a burst the scheduler answered in time)."""
    if harness.adapter != "http":
        pytest.skip("the HTTP client's connection pool")
    replica = harness.sim.replicas[1]
    harness.sim.set_faults(1, MasterFaults(hang=True))
    replies: list[object] = []
    with trio.fail_after(LIMIT_S):
        async with HttpMasterTransport(MasterConfig(http_max_connections=2)) as http:

            async def schedule() -> None:
                replies.append(await http.schedule(harness.host(1), REQUEST))

            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(schedule)
                await harness.until_in_flight(replica, 6)  # all six at the scheduler at once
                harness.sim.clear_faults()
    assert len(replies) == 6 and all(isinstance(r, MasterRouted) for r in replies)


async def test_http_keeps_one_connection_alive(clock: object, harness: Harness) -> None:
    if harness.adapter != "http":
        pytest.skip("connection reuse is the HTTP adapter's")
    with trio.fail_after(LIMIT_S):
        for _ in range(5):
            await harness.transport.schedule(harness.host(0), REQUEST)
            await harness.transport.master_info(harness.host(0))
        assert len(harness.sim.replicas[0].http_clients) == 1


async def test_every_failure_is_a_transport_error(clock: object, harness: Harness) -> None:
    """What the caller sends to the slave and then KVCM: one exception type, whatever the adapter (a
    plain-text 500 over HTTP is a reply, not a failure: see the server-exception test)."""
    faults_of_no_reply = [MasterFaults(garbled=True)]
    if harness.adapter == "grpc":
        faults_of_no_reply.append(MasterFaults(server_error=True))
    with trio.fail_after(LIMIT_S):
        for faults in faults_of_no_reply:
            harness.sim.set_faults(0, faults)
            with pytest.raises(TransportError):
                await harness.transport.schedule(harness.host(0), REQUEST)


async def test_http_keeps_as_many_connections_as_calls_at_once_so_a_burst_reuses_them() -> None:
    """httpcore closes an idle connection whenever more are open than it keeps, busy ones counted:
    keeping fewer than the calls at once made most calls of a steady burst open a connection."""
    body = b'{"success":true,"code":200,"queue_length":0,"real_master_host":"127.0.0.1:1"}'
    accepted = 0

    async def keep_alive_server(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        pending = b""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while True:
                while b"\r\n\r\n" not in pending:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    pending += data
                head, _, pending = pending.partition(b"\r\n\r\n")
                length = next(
                    (int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
                     if k.strip().lower() == b"content-length"),
                    0,
                )
                while len(pending) < length:
                    pending += await stream.receive_some(65536)
                pending = pending[length:]
                await trio.sleep(0.002)  # the scheduler's time to answer: the six overlap
                reply = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
                await stream.send_all(reply + body)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, keep_alive_server, 0, host="127.0.0.1"))
            host = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            config = MasterConfig(hosts=host, http_max_connections=2)
            async with HttpMasterTransport(config, calls_at_once=8) as http:

                async def caller() -> None:
                    for _ in range(20):
                        await http.master_info(host)

                async with trio.open_nursery() as callers:
                    for _ in range(6):
                        callers.start_soon(caller)
            nursery.cancel_scope.cancel()
    assert accepted <= 6  # one per caller at most: every connection reused
