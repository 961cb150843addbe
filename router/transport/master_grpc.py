"""gRPC adapter of ``MasterTransport``: ``/FlexlbService/Schedule`` on the scheduler's HTTP port + 2.

Calls go through ``GrpcRawRpc`` (the future bridge and the channel pool), so the caller's trio
deadline is the RPC's ``timeout=`` and cancelling the caller's scope cancels the RPC. A schedule
call that is abandoned (cancelled, or past its deadline) is followed by a best-effort
``/FlexlbService/Cancel`` that nobody waits for, with reason DEADLINE_EXCEEDED when the deadline had
passed and CLIENT_CANCELLED otherwise. The gRPC API has no master/info: discovery
goes through the HTTP adapter given as ``info``. TLS is the leaser's: a ChannelPool built with
channel credentials (``router.transport.tls.channel_credentials``) opens secure channels.
"""

from __future__ import annotations

import contextlib

import grpc
import trio

from router.config import MASTER_GRPC_PORT_OFFSET
from router.targets import TargetError, format_target, parse_target
from router.transport.errors import DeadlineExceeded, GarbledReply, NotSent, Unavailable
from router.transport.grpc_adapter import GrpcRawRpc
from router.transport.ports import ChannelLeaser, MasterTransport
from router.wire import paths
from router.wire.master import (
    MAX_REPLY_BYTES,
    MasterInfo,
    MasterReply,
    MasterScheduleRequest,
    decode_schedule_pb,
    encode_cancel_pb,
    encode_schedule_pb,
)

# How long an unawaited best-effort Cancel may take before gRPC gives up on it.
CANCEL_TIMEOUT_S = 1.0


def grpc_target(host: str) -> str:
    """The scheduler's gRPC address for its HTTP address ``host``."""
    try:
        target = parse_target(host)
    except TargetError as exc:
        raise Unavailable(host, f"not a HOST:PORT scheduler address ({exc})") from exc
    return format_target(target.host, target.port + MASTER_GRPC_PORT_OFFSET)


class GrpcMasterTransport:
    def __init__(self, leaser: ChannelLeaser[grpc.Channel], info: MasterTransport, *, start_off_loop: bool) -> None:
        self._leaser = leaser
        self._rpc = GrpcRawRpc(leaser, start_off_loop=start_off_loop)
        self._info = info
        # grpc cancels a call whose future is garbage-collected: unawaited Cancels are held here until done.
        self._pending_cancels: set[grpc.Future[bytes]] = set()

    async def schedule(self, host: str, request: MasterScheduleRequest) -> MasterReply:
        target = grpc_target(host)
        deadline = trio.current_effective_deadline()
        sent = False

        def mark_sent() -> None:
            nonlocal sent
            sent = True

        try:
            reply = await self._rpc.call(target, paths.MASTER_SCHEDULE, encode_schedule_pb(request), on_sent=mark_sent)
        except trio.Cancelled:
            # Cancelled while it waited for its channel or a start thread, the call never left: the
            # scheduler would be told of a request it never saw.
            if sent:
                # gRPC's timeout= is the same instant as the caller's deadline and the caller's scope
                # usually fires first: the reason is whether the deadline has passed, not which fired.
                past_deadline = trio.current_time() >= deadline
                self._cancel_nowait(target, request.request_id, deadline_exceeded=past_deadline)
            raise
        except NotSent:  # the scheduler never saw it: nothing to cancel
            raise
        except DeadlineExceeded:
            self._cancel_nowait(target, request.request_id, deadline_exceeded=True)
            raise
        # The shared channel takes messages up to max_message_bytes (for KVCM's replies); parsing one that
        # long would hold the routing thread.
        if len(reply) > MAX_REPLY_BYTES:
            too_long = f"reply of {len(reply)} bytes, more than {MAX_REPLY_BYTES}"
            raise GarbledReply(target, f"{paths.MASTER_SCHEDULE}: {too_long}")
        return decode_schedule_pb(reply, target)

    async def master_info(self, host: str) -> MasterInfo:
        return await self._info.master_info(host)

    def _cancel_nowait(self, target: str, request_id: str, *, deadline_exceeded: bool) -> None:
        """Send Cancel without waiting (we may be inside a cancelled scope): fire and forget."""
        request = encode_cancel_pb(request_id, deadline_exceeded)
        # Best effort by definition: a closed pool, a broken channel or a channel that would have to be
        # waited for (the schedule call just used it, so it rarely is) only means no Cancel is sent.
        with contextlib.suppress(Exception):
            lease = self._leaser.lease_nowait(target)
            if lease is None:
                return
            with lease as channel:
                future = channel.unary_unary(paths.MASTER_CANCEL, None, None).future(
                    request, timeout=CANCEL_TIMEOUT_S
                )
                self._pending_cancels.add(future)
                # On a grpc thread; set.discard is atomic.
                future.add_done_callback(self._pending_cancels.discard)
