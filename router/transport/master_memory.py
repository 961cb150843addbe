"""In-memory adapter of ``MasterTransport``: HTTP-shaped exchanges with handlers, for MockClock tests.

A handler answers ``(path, body) -> (http status, body)`` exactly as the scheduler's HTTP API
would, and the replies go through the same bound and decoders as the HTTP adapter's, so a body
longer than ``MAX_REPLY_BYTES``, a garbled body, a non-JSON 500 or an 8600 means the same thing
here. A host with no handler refuses the connection (``Unavailable``); a handler raising
``PeerAbort(UNAVAILABLE)`` is a reset. Delays and hangs are the handler's trio sleeps, so they run
on virtual time and end at the caller's deadline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from router.transport.errors import GarbledReply, PeerAbort, Unavailable, status_to_error
from router.transport.master_body import schedule_body
from router.wire import paths
from router.wire.master import (
    MAX_REPLY_BYTES,
    MasterInfo,
    MasterReply,
    MasterScheduleRequest,
    decode_info_json,
    decode_schedule_json,
)

MasterHttpHandler = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]


class MemoryMasterNetwork:
    """``MasterTransport`` over a dict of host → handler; counts calls per (host, path)."""

    def __init__(self) -> None:
        self._handlers: dict[str, MasterHttpHandler] = {}
        self.calls: dict[tuple[str, str], int] = {}

    def serve(self, host: str, handler: MasterHttpHandler) -> None:
        self._handlers[host] = handler

    def stop(self, host: str) -> None:
        """From now on ``host`` refuses connections."""
        self._handlers.pop(host, None)

    def call_count(self, host: str | None = None, path: str | None = None) -> int:
        return sum(n for (h, p), n in self.calls.items() if (host is None or h == host) and (path is None or p == path))

    async def _post(self, host: str, path: str, body: bytes) -> tuple[int, bytes]:
        key = (host, path)
        self.calls[key] = self.calls.get(key, 0) + 1
        handler = self._handlers.get(host)
        if handler is None:
            raise Unavailable(host, "connection refused (no server at this host)")
        try:
            status, reply = await handler(path, body)
        except PeerAbort as abort:
            raise status_to_error(host, abort.status, abort.details) from abort
        if len(reply) > MAX_REPLY_BYTES:  # as the HTTP adapter: refused unread
            raise GarbledReply(host, f"{path}: reply body larger than {MAX_REPLY_BYTES} bytes")
        return status, reply

    async def schedule(self, host: str, request: MasterScheduleRequest) -> MasterReply:
        status, body = await self._post(host, paths.MASTER_HTTP_SCHEDULE, await schedule_body(request))
        return decode_schedule_json(status, body, host)

    async def master_info(self, host: str) -> MasterInfo:
        status, body = await self._post(host, paths.MASTER_HTTP_INFO, b"{}")
        return decode_info_json(status, body, host)
