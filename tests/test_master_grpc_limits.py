"""The gRPC master client against a real gRPC server on 127.0.0.1:0 (the real clock): a schedule reply
longer than MAX_REPLY_BYTES is refused as garbled before it is decoded; one of exactly that length is
decoded. And the best-effort Cancel after gRPC's own deadline fires, on a fake channel that records it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import cast

import grpc
import pytest
import trio

from actors.channel_pool import ChannelPool
from router.config import MASTER_GRPC_PORT_OFFSET, MasterConfig
from router.transport.errors import DeadlineExceeded, GarbledReply
from router.transport.grpc_adapter import GrpcRawRpc
from router.transport.grpc_server import start_grpc_server
from router.transport.master_grpc import CANCEL_TIMEOUT_S, GrpcMasterTransport
from router.transport.master_http import HttpMasterTransport
from router.wire import master_flexlb_pb2 as flexlb_pb
from router.wire import paths
from router.wire.master import MAX_REPLY_BYTES, MasterBusinessError, MasterScheduleRequest, encode_cancel_pb

REQUEST = MasterScheduleRequest("r-1", (11, 12), 64, 128)


def error_reply(size: int) -> bytes:
    """A well-formed business-error reply of exactly ``size`` bytes (its message the padding)."""
    reply = flexlb_pb.FlexlbScheduleResponsePB(success=False, code=8503, error_message="")
    reply.error_message = "e" * (size - reply.ByteSize())
    while reply.ByteSize() > size:  # the message's length prefix grew with it
        reply.error_message = reply.error_message[:-1]
    data = reply.SerializeToString()
    assert len(data) == size
    return data


@pytest.mark.parametrize("size", [MAX_REPLY_BYTES, MAX_REPLY_BYTES + 1])
async def test_a_reply_longer_than_the_bound_is_garbled_before_decoding(
    pool: ChannelPool[grpc.Channel], size: int
) -> None:
    answer = error_reply(size)
    server = start_grpc_server({paths.MASTER_SCHEDULE: lambda request, context: answer})
    try:
        with trio.fail_after(20):
            async with HttpMasterTransport(MasterConfig()) as info:
                transport = GrpcMasterTransport(pool, info, start_off_loop=True)
                host = f"127.0.0.1:{server.port - MASTER_GRPC_PORT_OFFSET}"
                if size <= MAX_REPLY_BYTES:
                    reply = await transport.schedule(host, REQUEST)
                    assert isinstance(reply, MasterBusinessError) and reply.code == 8503
                else:
                    with pytest.raises(GarbledReply, match=f"{size} bytes, more than {MAX_REPLY_BYTES}"):
                        await transport.schedule(host, REQUEST)
    finally:
        server.stop()


class _RecordedFuture:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[object], None]] = []

    def add_done_callback(self, callback: Callable[[object], None]) -> None:
        self.callbacks.append(callback)


class _RecordingChannel:
    """Records each call started with ``future``: (path, request, timeout, future)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, float | None, _RecordedFuture]] = []

    def unary_unary(self, path: str, _serializer: None, _deserializer: None) -> _RecordingMultiCallable:
        return _RecordingMultiCallable(self, path)


class _RecordingMultiCallable:
    def __init__(self, channel: _RecordingChannel, path: str) -> None:
        self._channel = channel
        self._path = path

    def future(self, request: bytes, timeout: float | None = None) -> _RecordedFuture:
        future = _RecordedFuture()
        self._channel.sent.append((self._path, request, timeout, future))
        return future


class _RecordingLeaser:
    def __init__(self) -> None:
        self.channel = _RecordingChannel()

    def lease(self, target: str) -> contextlib.AbstractAsyncContextManager[grpc.Channel]:
        raise AssertionError("the Cancel must not wait for a channel")

    def lease_nowait(self, target: str) -> contextlib.AbstractContextManager[grpc.Channel]:
        return contextlib.nullcontext(cast(grpc.Channel, self.channel))

    def invalidate(self, target: str, channel: object | None = None) -> None:
        pass


class _DeadlineRpc:
    """A schedule call that ends in gRPC's own DEADLINE_EXCEEDED (its timeout= fired first)."""

    async def call(
        self, target: str, method_path: str, request: bytes, *, on_sent: Callable[[], None] | None = None
    ) -> bytes:
        if on_sent is not None:
            on_sent()  # sent, then timed out by gRPC
        raise DeadlineExceeded(target, "DEADLINE_EXCEEDED")


async def test_a_schedule_past_grpcs_own_deadline_is_cancelled_with_reason_deadline() -> None:
    leaser = _RecordingLeaser()
    info = cast(HttpMasterTransport, None)  # master_info is not called
    transport = GrpcMasterTransport(leaser, info, start_off_loop=False)
    transport._rpc = cast(GrpcRawRpc, _DeadlineRpc())
    with pytest.raises(DeadlineExceeded):
        await transport.schedule("127.0.0.1:7001", REQUEST)
    [(path, body, timeout, future)] = leaser.channel.sent
    assert path == paths.MASTER_CANCEL
    assert body == encode_cancel_pb(REQUEST.request_id, deadline_exceeded=True)
    # Nobody waits for it: its own bound ends it.
    assert timeout == CANCEL_TIMEOUT_S
    # Held until done, since grpc cancels a call whose future is garbage-collected; dropped when done.
    assert cast(object, future) in transport._pending_cancels
    [done] = future.callbacks
    done(future)
    assert cast(object, future) not in transport._pending_cancels
