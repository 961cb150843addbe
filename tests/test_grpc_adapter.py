"""GrpcRawRpc against real gRPC servers on 127.0.0.1:0, with the REAL clock (never MockClock here).

Each test bounds itself with ``trio.fail_after(10)``. The servers are the real server helper
(router.transport.grpc_server) with handlers that play the remote peer.
"""

from __future__ import annotations

import json
import math
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, cast

import grpc
import pytest
import trio
import trio.testing

from actors.channel_pool import ChannelPool, ChannelPoolSnapshot
from router.config import ChannelPoolConfig
from router.transport.errors import (
    DeadlineExceeded,
    NotSent,
    PeerAbort,
    RemoteError,
    RpcStatus,
    TransportError,
    Unavailable,
)
from router.transport.grpc_adapter import GrpcRawRpc, channel_options, remaining_timeout
from router.transport.grpc_server import GrpcServer, method_handlers, serve_grpc, start_grpc_server
from router.transport.ports import ChannelLeaser, InTurnCall

ECHO = "/kvroute.test.Peer/Echo"
REMAINING = "/kvroute.test.Peer/Remaining"
HANG = "/kvroute.test.Peer/Hang"
ABORT = "/kvroute.test.Peer/Abort"
DENY = "/kvroute.test.Peer/Deny"
CRASH = "/kvroute.test.Peer/Crash"
FLAKY = "/kvroute.test.Peer/Flaky"
BIG = "/kvroute.test.Peer/Big"
SLOW = "/kvroute.test.Peer/Slow"


class Peer:
    """The remote peer's behaviour and what it observed (handlers run on server threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, int] = {}
        self.hang_started = threading.Event()
        self.hang_ended = threading.Event()
        self.hang_ended_at = 0.0

    def count(self, path: str) -> None:
        with self.lock:
            self.calls[path] = self.calls.get(path, 0) + 1

    def echo(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.count(ECHO)
        return request

    def remaining(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return repr(context.time_remaining()).encode()

    def hang(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        def on_termination() -> None:
            self.hang_ended_at = time.monotonic()
            self.hang_ended.set()

        context.add_callback(on_termination)
        self.hang_started.set()
        self.hang_ended.wait(10)
        return b""

    def abort(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise PeerAbort(RpcStatus[request.decode()], "scripted")

    def deny(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not you")

    def crash(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        raise RuntimeError("handler bug")

    def big(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"x" * int(request)

    def slow(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        time.sleep(float(request))
        return b"slow"

    def flaky(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.count(FLAKY)
        if self.calls[FLAKY] == 1:
            raise PeerAbort(RpcStatus.UNAVAILABLE, "first attempt fails")
        return request


@pytest.fixture
def peer() -> Iterator[tuple[Peer, GrpcServer]]:
    state = Peer()
    routes = {
        ECHO: state.echo,
        REMAINING: state.remaining,
        HANG: state.hang,
        ABORT: state.abort,
        DENY: state.deny,
        CRASH: state.crash,
        FLAKY: state.flaky,
        BIG: state.big,
        SLOW: state.slow,
    }
    server = start_grpc_server(routes)
    yield state, server
    server.stop()


@pytest.fixture(params=[True, False], ids=["start-off-loop", "start-on-loop"])
def start_off_loop(request: pytest.FixtureRequest) -> bool:
    """Both ways of starting a call: every adapter test holds for each."""
    value: bool = request.param
    return value


@asynccontextmanager
async def hanging_call(rpc: GrpcRawRpc, server: GrpcServer, state: Peer) -> AsyncIterator[trio.CancelScope]:
    """A HANG call in flight (the server has it) for the block; cancelled, by its scope, when the block ends."""
    scope = trio.CancelScope()

    async def caller() -> None:
        with scope:
            await rpc.call(server.target, HANG, b"")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller)
        assert await trio.to_thread.run_sync(state.hang_started.wait, 5)
        yield scope
        scope.cancel()
    assert scope.cancelled_caught


async def settled(pool: ChannelPool[grpc.Channel]) -> ChannelPoolSnapshot:
    """The pool's snapshot once its task has applied what the calls reported (every task blocked)."""
    await trio.testing.wait_all_tasks_blocked()
    return pool.snapshot()


@pytest.fixture
def dead_target() -> Iterator[str]:
    """A loopback port bound but not listening: connections to it are refused for the whole test (a
    port closed again could be taken by another server meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


async def test_round_trip_carries_raw_bytes(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    state, server = peer
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        payload = bytes(range(256)) * 4
        assert await rpc.call(server.target, ECHO, payload) == payload
        assert await rpc.call(server.target, ECHO, b"") == b""
    assert state.calls[ECHO] == 2
    assert (await settled(pool)).opened == 1
    assert (await settled(pool)).leased == 0


async def test_serve_grpc_reports_its_address_and_stops_when_cancelled(
    start_off_loop: bool,
    pool: ChannelPool[grpc.Channel],
) -> None:
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server: GrpcServer = await nursery.start(serve_grpc, {ECHO: Peer().echo})
            assert server.host == "127.0.0.1"
            assert server.port > 0
            assert await rpc.call(server.target, ECHO, b"up") == b"up"
            nursery.cancel_scope.cancel()
        with pytest.raises(Unavailable):
            await rpc.call(server.target, ECHO, b"down")


def test_a_second_server_on_a_taken_port_is_refused() -> None:
    """An explicit port already served is an OSError naming it, not a second server sharing the port."""
    first = start_grpc_server({ECHO: Peer().echo})
    try:
        with pytest.raises(OSError, match=f"cannot bind gRPC server to 127.0.0.1:{first.port}"):
            start_grpc_server({ECHO: Peer().echo}, port=first.port).stop()
    finally:
        first.stop()


@pytest.mark.parametrize("path", ["Peer/Echo", "/Echo", "/a.Peer/Echo/extra"])
def test_method_paths_must_be_full(path: str) -> None:
    with pytest.raises(ValueError, match="is not a full"):
        method_handlers({path: Peer().echo})


async def test_concurrent_calls_share_one_channel(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    _, server = peer
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    replies: dict[int, bytes] = {}

    async def one(i: int) -> None:
        replies[i] = await rpc.call(server.target, ECHO, str(i).encode())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(one, i)
    assert replies == {i: str(i).encode() for i in range(50)}
    assert (await settled(pool)).opened == 1


async def test_timeout_passed_is_the_callers_remaining_deadline(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    assert remaining_timeout() is None  # no scope: no timeout is passed
    _, server = peer
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        # Part of the budget spent first: the server must see what is left when the call starts,
        # not the budget. C-core deadlines have millisecond resolution and round up: 2 ms allowance.
        seen: float | None = None
        with trio.move_on_after(2.0) as scope:
            await trio.sleep(1.0)
            left = scope.deadline - trio.current_time()
            seen = float(await rpc.call(server.target, REMAINING, b""))
        assert seen is not None, "the loop stalled past the whole budget"
        assert 0 < seen <= left + 0.002
        seen = float(await rpc.call(server.target, REMAINING, b""))
        assert 5.0 < seen <= 10.0  # the outer fail_after(10) alone


class _SlowLeaser:
    """A lease that takes ``delay_s`` (as a cold target's does while its channel opens), then yields
    the pool's channel."""

    def __init__(self, pool: ChannelPool[grpc.Channel], delay_s: float) -> None:
        self.pool = pool
        self.delay_s = delay_s
        self.leased_at: float | None = None

    @asynccontextmanager
    async def lease(self, target: str) -> AsyncIterator[grpc.Channel]:
        await trio.sleep(self.delay_s)
        async with self.pool.lease(target) as channel:
            self.leased_at = trio.current_time()
            yield channel

    def lease_nowait(self, target: str) -> None:
        return None

    def invalidate(self, target: str, channel: object | None = None) -> None:
        self.pool.invalidate(target, channel)


class _StartsSeen:
    """The pool's channels behind a wrapper that notes the thread each call is started on."""

    def __init__(self, pool: ChannelPool[grpc.Channel]) -> None:
        self.pool = pool
        self.started_on: list[int] = []
        self.watched: dict[grpc.Channel, _Watched] = {}  # one per channel: the adapter keys its calls on it

    @asynccontextmanager
    async def lease(self, target: str) -> AsyncIterator[_Watched]:
        async with self.pool.lease(target) as channel:
            yield self.watched.setdefault(channel, _Watched(channel, self.started_on))

    def lease_nowait(self, target: str) -> None:
        return None

    def invalidate(self, target: str, channel: object | None = None) -> None:
        self.pool.invalidate(target)


class _Watched:
    def __init__(self, channel: grpc.Channel, started_on: list[int]) -> None:
        self.channel = channel
        self.started_on = started_on

    def unary_unary(self, method_path: str, serializer: None, deserializer: None) -> _WatchedCall:
        return _WatchedCall(self.channel.unary_unary(method_path, serializer, deserializer), self.started_on)


class _WatchedCall:
    def __init__(self, call: grpc.UnaryUnaryMultiCallable[bytes, bytes], started_on: list[int]) -> None:
        self.call = call
        self.started_on = started_on

    def future(self, request: bytes, timeout: float | None = None) -> grpc.Future[bytes]:
        self.started_on.append(threading.get_ident())
        return self.call.future(request, timeout=timeout)


async def test_a_background_call_on_an_idle_channel_is_started_off_the_event_loop(
    peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    """A background poll's start held the event loop, with every request on it, until the thread grpcio
    starts for a call on an idle channel had the GIL: milliseconds under a shed storm."""
    state, server = peer
    leaser = _StartsSeen(pool)
    rpc = GrpcRawRpc(cast("ChannelLeaser[grpc.Channel]", leaser), start_off_loop=False)
    loop = threading.get_ident()
    with trio.fail_after(10):
        assert await rpc.call(server.target, ECHO, b"a") == b"a"
        assert await rpc.call(server.target, ECHO, b"b", background=True) == b"b"
        async with hanging_call(rpc, server, state):  # a call of ours in flight: grpcio's thread runs
            assert await rpc.call(server.target, ECHO, b"c", background=True) == b"c"
    # A request's call on the loop; the background one on a starter thread, but beside a call in flight
    # (no thread to start), where the hand-off would cost more than the start.
    assert [on == loop for on in leaser.started_on] == [True, False, True, True]


def _sent_as(timeout_s: float) -> float:
    """The most a server may see left of ``timeout_s``: grpc sends a timeout rounded up to its
    encoding's unit, three significant digits (20.04 s goes as 20.1 s, 0.999 s as 1.00 s)."""
    return timeout_s * 1.01 + 0.002


async def test_the_timeout_passed_counts_the_wait_for_the_channel(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    """The server is told what is left once the channel is leased, not what was left before."""
    _, server = peer
    leaser = _SlowLeaser(pool, delay_s=1.0)
    rpc = GrpcRawRpc(leaser, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        seen: float | None = None
        with trio.move_on_after(2.0) as scope:
            seen = float(await rpc.call(server.target, REMAINING, b""))
        assert seen is not None, "the loop stalled past the whole budget"
        assert leaser.leased_at is not None
        assert 0 < seen <= _sent_as(scope.deadline - leaser.leased_at)


async def test_a_caller_whose_bound_moves_to_the_sending_gives_the_servers_time_itself(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    """A caller that moves its own bound to the sending (the prober, by ``on_sent``) passes the peer's
    time from the sending: grpc's deadline was what the scope left after the lease, and cut the call
    short of the time its caller gave it."""
    _, server = peer
    rpc = GrpcRawRpc(_SlowLeaser(pool, delay_s=1.0), start_off_loop=start_off_loop)
    with trio.fail_after(30):
        with trio.move_on_after(5.0) as bound:  # room for a busy machine's stalls before the sending

            def moved() -> None:
                bound.deadline = trio.current_time() + 20.0

            seen = float(await rpc.call(server.target, REMAINING, b"", on_sent=moved, sent_timeout_s=20.0))
        assert not bound.cancelled_caught
        assert 5.0 < seen <= _sent_as(20.0)  # past all the scope ever had before the sending


class _LateLeaser(_SlowLeaser):
    """A lease that hands its channel over ``delay_s`` late with no checkpoint that could be
    cancelled, as one whose answer was queued while the loop stalled."""

    @asynccontextmanager
    async def lease(self, target: str) -> AsyncIterator[grpc.Channel]:
        async with self.pool.lease(target) as channel:
            with trio.CancelScope(shield=True):
                await trio.sleep(self.delay_s)
            yield channel


async def test_a_call_whose_lease_came_back_past_its_deadline_is_not_sent(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    state, server = peer
    rpc = GrpcRawRpc(_LateLeaser(pool, delay_s=0.5), start_off_loop=start_off_loop)
    with trio.fail_after(10):
        with pytest.raises(NotSent), trio.move_on_after(0.2):
            await rpc.call(server.target, ECHO, b"x")
    assert state.calls.get(ECHO, 0) == 0


async def test_expired_deadline_raises_without_sending(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    state, server = peer
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        with pytest.raises(DeadlineExceeded), trio.CancelScope(deadline=trio.current_time() - 0.001):
            await rpc.call(server.target, ECHO, b"x")
    assert state.calls.get(ECHO, 0) == 0
    assert (await settled(pool)).opened == 0


async def test_deadline_during_the_call(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    """Both outcomes are acceptable: gRPC's DEADLINE_EXCEEDED (timeout= is the same instant as the
    caller's deadline) or the caller's own scope cancelled first — observed here every time, as
    C-core rounds its deadline up to the millisecond. Either way the server sees the call end."""
    state, server = peer
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    outcome = "none"
    with trio.fail_after(10):
        with trio.move_on_after(0.2) as scope:
            try:
                await rpc.call(server.target, HANG, b"")
            except DeadlineExceeded:
                outcome = "deadline_exceeded"
        if scope.cancelled_caught:
            outcome = "scope_cancelled"
        assert outcome in {"deadline_exceeded", "scope_cancelled"}
        assert await trio.to_thread.run_sync(state.hang_ended.wait, 5)
    assert (await settled(pool)).leased == 0
    assert (await settled(pool)).size == 1  # a deadline says nothing about the channel: kept


async def test_a_reply_that_arrived_while_the_loop_was_stalled_is_kept(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], nursery: trio.Nursery
) -> None:
    """The deadline passes while another task blocks the trio thread (as a GC pause does) and the
    reply arrives meanwhile: the caller gets the reply, not a cancellation that would count the
    peer as failed for the router's own stall."""
    state, server = peer
    recording_pool, channels = await _recording_pool(nursery)
    rpc = GrpcRawRpc(recording_pool, start_off_loop=start_off_loop)
    reply: bytes | None = None
    deadline = math.inf
    with trio.fail_after(10):
        assert await rpc.call(server.target, ECHO, b"warm") == b"warm"  # connection up first
        (channel,) = channels
        channel.futures.get_nowait()  # the warm call's

        async def caller() -> None:
            nonlocal reply, deadline
            with trio.move_on_after(0.2) as scope:
                deadline = scope.deadline
                reply = await rpc.call(server.target, ECHO, b"kept")

        async with trio.open_nursery() as calls:
            calls.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()  # the call is started (or handed to a starter)
            # The stall itself: blocking calls on the trio thread, so the loop runs nothing until the
            # reply is in and the caller's deadline has passed.
            future = channel.futures.get(timeout=5)
            assert future.result(5) == b"kept"
            time.sleep(max(0.0, deadline - trio.current_time()) + 0.01)  # noqa: ASYNC251
    assert reply == b"kept"
    assert state.calls[ECHO] == 2
    await recording_pool.aclose()


class _RecordingLeaser:
    """The pool's leases, noting each channel leased and each invalidate() asked for."""

    def __init__(self, pool: ChannelPool[grpc.Channel]) -> None:
        self.pool = pool
        self.leased: list[grpc.Channel] = []
        self.invalidated: list[tuple[str, object | None]] = []

    @asynccontextmanager
    async def lease(self, target: str) -> AsyncIterator[grpc.Channel]:
        async with self.pool.lease(target) as channel:
            self.leased.append(channel)
            yield channel

    def lease_nowait(self, target: str) -> None:
        return None

    def invalidate(self, target: str, channel: object | None = None) -> None:
        self.invalidated.append((target, channel))
        self.pool.invalidate(target, channel)


async def test_dead_port_is_unavailable_and_invalidates_the_channel(
    start_off_loop: bool, pool: ChannelPool[grpc.Channel], dead_target: str
) -> None:
    target = dead_target
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        with pytest.raises(Unavailable) as info:
            await rpc.call(target, ECHO, b"x")
    assert info.value.target == target
    snap = await settled(pool)
    assert (snap.size, snap.opened, snap.evicted["invalidated"]) == (0, 1, 1)


async def test_unavailable_invalidates_only_the_channel_the_call_failed_on(
    start_off_loop: bool, pool: ChannelPool[grpc.Channel], dead_target: str
) -> None:
    """A channel another call reopened to the recovered peer meanwhile is not dropped with it."""
    leaser = _RecordingLeaser(pool)
    rpc = GrpcRawRpc(leaser, start_off_loop=start_off_loop)
    with trio.fail_after(10), pytest.raises(Unavailable):
        await rpc.call(dead_target, ECHO, b"x")
    assert leaser.invalidated == [(dead_target, leaser.leased[0])]


def test_channel_options_carry_the_configured_keepalive() -> None:
    options = dict(channel_options(ChannelPoolConfig(keepalive_time_ms=12_345, keepalive_timeout_ms=678)))
    assert options["grpc.keepalive_time_ms"] == 12_345
    assert options["grpc.keepalive_timeout_ms"] == 678


def test_channel_options_bound_messages_and_keep_subchannels_per_channel() -> None:
    options = dict(channel_options(ChannelPoolConfig(max_message_bytes=65_536)))
    assert options["grpc.max_send_message_length"] == options["grpc.max_receive_message_length"] == 65_536
    assert options["grpc.use_local_subchannel_pool"] == 1


async def test_a_reply_over_max_message_bytes_is_refused_by_our_channel(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], nursery: trio.Nursery
) -> None:
    """The bound on a peer's reply, which is parsed on the routing thread, is our config's, not grpc's."""
    _, server = peer
    config = ChannelPoolConfig(max_message_bytes=65_536)
    channels = ChannelPool(config)
    await nursery.start(channels.run)
    rpc = GrpcRawRpc(channels, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        assert len(await rpc.call(server.target, BIG, b"1000")) == 1000
        with pytest.raises(RemoteError) as info:
            await rpc.call(server.target, BIG, str(4 * config.max_message_bytes).encode())
    assert info.value.code_name == "grpc:RESOURCE_EXHAUSTED"
    await channels.aclose()


@pytest.mark.parametrize(
    ("path", "request_bytes", "error", "code_name"),
    [
        (ABORT, b"NOT_FOUND", RemoteError, "grpc:NOT_FOUND"),
        (ABORT, b"INVALID_ARGUMENT", RemoteError, "grpc:INVALID_ARGUMENT"),
        (ABORT, b"RESOURCE_EXHAUSTED", RemoteError, "grpc:RESOURCE_EXHAUSTED"),
        (ABORT, b"UNAVAILABLE", Unavailable, None),
        (ABORT, b"DEADLINE_EXCEEDED", DeadlineExceeded, None),
        (DENY, b"", RemoteError, "grpc:UNKNOWN"),  # a code RpcStatus does not name: kept in the detail
        (CRASH, b"", RemoteError, "grpc:UNKNOWN"),
        ("/kvroute.test.Peer/Missing", b"", RemoteError, "grpc:UNIMPLEMENTED"),
    ],
)
async def test_server_status_codes_map_to_our_errors(
    start_off_loop: bool,
    peer: tuple[Peer, GrpcServer],
    pool: ChannelPool[grpc.Channel],
    path: str,
    request_bytes: bytes,
    error: type[TransportError],
    code_name: str | None,
) -> None:
    _, server = peer
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        with pytest.raises(TransportError) as info:
            await rpc.call(server.target, path, request_bytes)
    assert type(info.value) is error
    assert info.value.target == server.target
    if code_name is not None:
        assert isinstance(info.value, RemoteError)
        assert info.value.code_name == code_name
    if path == DENY:
        assert "PERMISSION_DENIED: not you" in info.value.detail
    # Only UNAVAILABLE drops the channel.
    assert (await settled(pool)).evicted["invalidated"] == (1 if error is Unavailable else 0)


async def test_cancelling_the_scope_cancels_the_rpc_at_the_server(
    start_off_loop: bool, peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    state, server = peer
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    with trio.fail_after(10):
        async with hanging_call(rpc, server, state) as scope:
            cancelled_at = time.monotonic()
            scope.cancel()
        # The handler holds the call for 10 s: its end within this 5 s wait is our cancellation.
        assert await trio.to_thread.run_sync(state.hang_ended.wait, 5)
    assert state.hang_ended_at > cancelled_at
    assert (await settled(pool)).leased == 0


# A retry policy as a resolver could deliver it: UNAVAILABLE retried up to 3 attempts.
_RETRYING_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "kvroute.test.Peer"}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.01s",
                    "maxBackoff": "0.05s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


@pytest.mark.parametrize("retries_disabled", [True, False])
async def test_grpc_retries_are_disabled_on_our_channels(
    peer: tuple[Peer, GrpcServer], nursery: trio.Nursery, retries_disabled: bool
) -> None:
    """Our options make a retry policy inert; the control (our options minus enable_retries=0)
    shows the same policy does retry, so the test can fail."""
    state, server = peer
    config = ChannelPoolConfig()
    options = [option for option in channel_options(config) if retries_disabled or option[0] != "grpc.enable_retries"]

    def factory(target: str) -> grpc.Channel:
        return grpc.insecure_channel(target, options=[*options, ("grpc.service_config", _RETRYING_SERVICE_CONFIG)])

    channels = ChannelPool(config, factory)
    await nursery.start(channels.run)
    rpc = GrpcRawRpc(channels, start_off_loop=True)
    with trio.fail_after(10):
        if retries_disabled:
            with pytest.raises(Unavailable):
                await rpc.call(server.target, FLAKY, b"x")
            assert state.calls[FLAKY] == 1
        else:
            assert await rpc.call(server.target, FLAKY, b"x") == b"x"
            assert state.calls[FLAKY] == 2
    await channels.aclose()


if TYPE_CHECKING:
    _BytesFuture = grpc.Future[bytes]
else:  # grpc.Future is generic in its stubs only
    _BytesFuture = grpc.Future


class _AwaitedFuture(_BytesFuture):
    """A call's real future that sets ``awaited`` when the adapter starts waiting for it (it adds its
    done-callback in the trio thread, after counting the call in flight)."""

    def __init__(self, inner: grpc.Future[bytes], awaited: trio.Event) -> None:
        self.inner = inner
        self.awaited = awaited

    def add_done_callback(self, fn: Callable[[grpc.Future[bytes]], None]) -> None:
        self.inner.add_done_callback(lambda _: fn(self))
        self.awaited.set()

    def cancel(self) -> bool:
        return self.inner.cancel()

    def cancelled(self) -> bool:
        return self.inner.cancelled()

    def running(self) -> bool:
        return self.inner.running()

    def done(self) -> bool:
        return self.inner.done()

    def result(self, timeout: float | None = None) -> bytes:
        return self.inner.result(timeout)

    def exception(self) -> Exception | None:
        return self.inner.exception()

    def traceback(self, timeout: float | None = None) -> Any:
        return self.inner.traceback(timeout)


class _StartRecordingChannel(grpc.Channel):
    """A real channel that notes which thread starts each unary call (``.future()``), hands each call's
    real future to ``futures``, and sets ``awaited`` once the adapter waits for one of them."""

    def __init__(self, inner: grpc.Channel) -> None:
        self.inner = inner
        self.started_on: list[int] = []
        self.awaited = trio.Event()
        self.futures: queue.SimpleQueue[grpc.Future[bytes]] = queue.SimpleQueue()  # each call's, as started

    def unary_unary(self, method: str, *args: object, **kwargs: object) -> grpc.UnaryUnaryMultiCallable:  # type: ignore[type-arg]
        inner = self.inner.unary_unary(method, None, None)
        started_on, awaited, futures = self.started_on, self.awaited, self.futures

        class Call:
            def future(self, request: bytes, timeout: float | None = None) -> grpc.Future[bytes]:
                started_on.append(threading.get_ident())
                future = inner.future(request, timeout=timeout)
                futures.put(future)
                return _AwaitedFuture(future, awaited)

        return Call()  # type: ignore[return-value]

    def unary_stream(self, *args: object, **kwargs: object) -> grpc.UnaryStreamMultiCallable:  # type: ignore[type-arg]
        raise NotImplementedError

    def stream_unary(self, *args: object, **kwargs: object) -> grpc.StreamUnaryMultiCallable:  # type: ignore[type-arg]
        raise NotImplementedError

    def stream_stream(self, *args: object, **kwargs: object) -> grpc.StreamStreamMultiCallable:  # type: ignore[type-arg]
        raise NotImplementedError

    def subscribe(self, callback: object, try_to_connect: bool = False) -> None:
        raise NotImplementedError

    def unsubscribe(self, callback: object) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.inner.close()


async def _recording_pool(nursery: trio.Nursery) -> tuple[ChannelPool[grpc.Channel], list[_StartRecordingChannel]]:
    """A running channel pool whose channels are :class:`_StartRecordingChannel`s, and those channels."""
    channels: list[_StartRecordingChannel] = []

    def factory(target: str) -> grpc.Channel:
        channel = _StartRecordingChannel(grpc.insecure_channel(target, options=channel_options(ChannelPoolConfig())))
        channels.append(channel)
        return channel

    pool = ChannelPool(ChannelPoolConfig(), factory)
    await nursery.start(pool.run)
    return pool, channels


async def test_a_call_on_an_idle_channel_starts_off_the_event_loop_and_one_beside_it_inline(
    peer: tuple[Peer, GrpcServer], nursery: trio.Nursery, start_off_loop: bool
) -> None:
    """grpcio's thread start blocks whoever starts the first call on an idle channel: with
    ``start_off_loop`` that is a starter thread; a call beside one in flight starts on the loop."""
    state, server = peer
    pool, channels = await _recording_pool(nursery)
    rpc = GrpcRawRpc(pool, start_off_loop=start_off_loop)
    loop_thread = threading.get_ident()
    with trio.fail_after(10):
        async with hanging_call(rpc, server, state):
            # Started on a starter thread, the hanging call reaches the server before its task
            # resumes and counts it in flight: the call beside it must wait for that.
            await channels[0].awaited.wait()
            assert await rpc.call(server.target, ECHO, b"beside") == b"beside"
        assert await rpc.call(server.target, ECHO, b"idle again") == b"idle again"
    (channel,) = channels
    first, beside, idle_again = channel.started_on
    assert beside == loop_thread
    assert (first != loop_thread) is start_off_loop
    assert (idle_again != loop_thread) is start_off_loop
    await pool.aclose()



async def test_a_batch_whose_leases_took_its_whole_allowance_makes_no_call(pool: ChannelPool[grpc.Channel]) -> None:
    """Each reply None, as for calls the allowance did not reach, not a crash of the prober's task."""
    rpc = GrpcRawRpc(_SlowLeaser(pool, 0.3), start_off_loop=False)
    with trio.fail_after(10):
        replies = await rpc.call_in_turn([InTurnCall("127.0.0.1:1", "/kvroute.test.Echo/Echo", b"")], within_s=0.1)
    assert [reply.outcome for reply in replies] == [None]


async def test_a_batch_whose_leases_cannot_all_be_had_within_its_allowance_makes_no_call(
    peer: tuple[Peer, GrpcServer], dead_target: str, nursery: trio.Nursery
) -> None:
    """The leases used to be taken with no deadline: a pool whose inbox has room for one lease and its
    return (the smallest ``channel_pool.inbox_size``) left the second lease waiting for a credit the
    first holds until the batch ends, and the prober's refresh round never ended."""
    _, server = peer
    pool = ChannelPool(ChannelPoolConfig(inbox_size=2))
    await nursery.start(pool.run)
    rpc = GrpcRawRpc(pool, start_off_loop=False)
    calls = [InTurnCall(server.target, ECHO, b"first"), InTurnCall(dead_target, ECHO, b"second")]
    with trio.fail_after(10):
        replies = await rpc.call_in_turn(calls, within_s=0.2)
    assert [reply.outcome for reply in replies] == [None, None]
    await trio.testing.wait_all_tasks_blocked()  # the pool's task has counted the leases given back
    assert pool.snapshot().leased == 0
    await pool.aclose()


async def test_a_batch_whose_channel_cannot_be_opened_fails_that_call_and_makes_none(
    peer: tuple[Peer, GrpcServer], dead_target: str, nursery: trio.Nursery
) -> None:
    """A lease raising (the pool answers a failed open with Unavailable) went out of the batch and
    took the prober's task down with it, every round, for as long as the open failed."""
    _, server = peer

    def opens(target: str) -> grpc.Channel:
        if target == dead_target:
            raise RuntimeError("cannot open " + target)
        return grpc.insecure_channel(target, options=channel_options(ChannelPoolConfig()))

    pool = ChannelPool(ChannelPoolConfig(), opens)

    async def run_pool(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await pool.run(task_status=task_status)
        except* RuntimeError:  # the pool's task fails after answering (its supervisor would restart it)
            pass

    await nursery.start(run_pool)
    rpc = GrpcRawRpc(pool, start_off_loop=False)
    calls = [InTurnCall(target, ECHO, b"") for target in (server.target, dead_target, server.target)]
    with trio.fail_after(10):
        replies = await rpc.call_in_turn(calls, within_s=5.0)
    first, failed, last = (reply.outcome for reply in replies)
    assert first is None and last is None  # not made
    assert isinstance(failed, Unavailable) and "channel not opened" in failed.detail


async def test_an_unreachable_peer_in_a_batch_forgets_the_channel_the_call_failed_on(
    pool: ChannelPool[grpc.Channel], dead_target: str
) -> None:
    leaser = _RecordingLeaser(pool)
    rpc = GrpcRawRpc(leaser, start_off_loop=False)
    with trio.fail_after(10):
        (reply,) = await rpc.call_in_turn([InTurnCall(dead_target, ECHO, b"")], within_s=5.0)
    assert isinstance(reply.outcome, Unavailable)
    assert leaser.invalidated == [(dead_target, leaser.leased[0])]


# A batch's allowance, and the part of it a slow step used up (a slow machine only uses up more).
WITHIN_S = 5.0
USED_S = 1.0


async def test_a_later_call_of_a_batch_is_given_what_the_earlier_ones_left(
    peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    _, server = peer
    rpc = GrpcRawRpc(pool, start_off_loop=False)
    calls = [InTurnCall(server.target, SLOW, str(USED_S).encode()), InTurnCall(server.target, REMAINING, b"")]
    with trio.fail_after(10):
        slow, later = await rpc.call_in_turn(calls, within_s=WITHIN_S)
    assert slow.outcome == b"slow" and isinstance(later.outcome, bytes)
    assert 0 < float(later.outcome) <= WITHIN_S - USED_S + 0.3  # not the whole allowance


async def test_a_batchs_leases_count_in_its_allowance(
    peer: tuple[Peer, GrpcServer], pool: ChannelPool[grpc.Channel]
) -> None:
    _, server = peer
    rpc = GrpcRawRpc(_SlowLeaser(pool, delay_s=USED_S), start_off_loop=False)
    with trio.fail_after(10):
        (reply,) = await rpc.call_in_turn([InTurnCall(server.target, REMAINING, b"")], within_s=WITHIN_S)
    assert isinstance(reply.outcome, bytes)
    assert 0 < float(reply.outcome) <= WITHIN_S - USED_S + 0.3  # the time from the batch's start, not the thread's
