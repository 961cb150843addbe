"""In-memory adapter: a fake network carrying bytes between clients and server handlers.

Used with ``trio.testing.MockClock`` (real sockets and autojump do not mix). A
handler is the same server-side code the gRPC sim servers run; faults (delay,
hang) are trio sleeps, so they run on virtual time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from router.transport.errors import (
    DeadlineExceeded,
    NotSent,
    PeerAbort,
    TransportError,
    Unavailable,
    status_to_error,
)
from router.transport.ports import LEAST_IN_TURN_CALL_S, InTurnCall, InTurnReply

Handler = Callable[[str, bytes], Awaitable[bytes]]


class MemoryNetwork:
    """``RawRpc`` over a dict of target → handler. An unknown target is a dead peer (Unavailable)."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self.calls: dict[tuple[str, str], int] = {}  # (target, method) → count, for tests and benches

    def serve(self, target: str, handler: Handler) -> None:
        self._handlers[target] = handler

    def stop(self, target: str) -> None:
        self._handlers.pop(target, None)

    def call_count(self, target: str | None = None, method_path: str | None = None) -> int:
        return sum(
            n
            for (t, m), n in self.calls.items()
            if (target is None or t == target) and (method_path is None or m == method_path)
        )

    async def call(
        self,
        target: str,
        method_path: str,
        request: bytes,
        *,
        on_sent: Callable[[], None] | None = None,
        sent_timeout_s: float | None = None,
        background: bool = False,
    ) -> bytes:
        """``background`` changes nothing here: a call in memory starts no thread. Nor does
        ``sent_timeout_s``: a call in memory has no deadline of its own, only the caller's scope, which
        the caller moves to the sending itself."""
        # As GrpcRawRpc: a call whose deadline has passed is neither sent nor counted.
        if trio.current_effective_deadline() <= trio.current_time():
            raise NotSent(target, "deadline already passed; not sent")
        key = (target, method_path)
        self.calls[key] = self.calls.get(key, 0) + 1
        if on_sent is not None:
            on_sent()
        handler = self._handlers.get(target)
        if handler is None:
            raise Unavailable(target, "connection refused (no server at this target)")
        try:
            return await handler(method_path, request)
        except PeerAbort as abort:
            raise status_to_error(target, abort.status, abort.details) from abort

    async def call_in_turn(self, calls: Sequence[InTurnCall], within_s: float) -> list[InTurnReply]:
        """The calls one after another, each bounded by what is left of ``within_s`` (virtual time); as
        over gRPC, a call with less than LEAST_IN_TURN_CALL_S left is not made."""
        started = trio.current_time()
        ends_at = started + within_s
        replies: list[InTurnReply] = []
        for call in calls:
            if ends_at - trio.current_time() < LEAST_IN_TURN_CALL_S:
                replies.append(InTurnReply(None, trio.current_time() - started))
                continue
            # The caller's own deadline passed: cancelled, as the gRPC adapter's leases are, not a
            # NotSent reply per call.
            await trio.lowlevel.checkpoint_if_cancelled()
            reply: bytes | TransportError = DeadlineExceeded(call.target, "no reply within the batch's time")
            began = trio.current_time() - started
            with trio.move_on_at(ends_at):
                try:
                    reply = await self.call(call.target, call.method_path, call.request)
                except TransportError as exc:
                    reply = exc
            replies.append(InTurnReply(reply, trio.current_time() - started, began))
        return replies

    def invalidate(self, target: str) -> None:
        """Nothing is cached per target in memory."""
