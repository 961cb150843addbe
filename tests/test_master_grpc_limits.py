"""The gRPC master client against a real gRPC server on 127.0.0.1:0 (the real clock): a schedule reply
longer than MAX_REPLY_BYTES is refused as garbled before it is decoded; one of exactly that length is
decoded."""

from __future__ import annotations

import grpc
import pytest
import trio

from actors.channel_pool import ChannelPool
from router.config import MASTER_GRPC_PORT_OFFSET, MasterConfig
from router.transport.errors import GarbledReply
from router.transport.grpc_server import start_grpc_server
from router.transport.master_grpc import GrpcMasterTransport
from router.transport.master_http import HttpMasterTransport
from router.wire import master_flexlb_pb2 as flexlb_pb
from router.wire import paths
from router.wire.master import MAX_REPLY_BYTES, MasterBusinessError, MasterScheduleRequest

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
