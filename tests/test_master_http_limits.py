"""The HTTP master client against a real HTTP server on 127.0.0.1:0 (hypercorn, the real clock): a reply
larger than MAX_REPLY_BYTES is read no further and is garbled, a compressed one is garbled without being
inflated; a normal one is decoded."""

from __future__ import annotations

import functools
import gzip
import json
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import hypercorn.config
import hypercorn.trio
import pytest
import trio

from router.config import MasterConfig
from router.transport.errors import GarbledReply
from router.transport.master_http import HttpMasterTransport
from router.wire.master import MAX_REPLY_BYTES, MasterRouted, MasterScheduleRequest

Message = dict[str, Any]
REQUEST = MasterScheduleRequest("r-1", (11, 12), 64, 128)


def json_app(
    body: bytes, headers: tuple[tuple[bytes, bytes], ...] = (), seen: list[Message] | None = None
) -> Callable[..., Awaitable[None]]:
    """An HTTP server's ASGI app answering every request 200 with ``body`` as JSON (and ``headers``), each
    request's scope appended to ``seen``."""

    async def app(
        scope: Message, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if seen is not None:
            seen.append(scope)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), *headers],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


@asynccontextmanager
async def http_server(
    body: bytes,
    tls: tuple[str, str] | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    seen: list[Message] | None = None,
) -> AsyncIterator[str]:
    """A loopback server answering every request with ``body`` and ``headers`` (``tls``: its certificate
    and key files; ``seen``: gets each request's ASGI scope): its HOST:PORT while the block runs."""
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    if tls is not None:
        config.certfile, config.keyfile = tls
    async with trio.open_nursery() as nursery:
        serve = functools.partial(hypercorn.trio.serve, json_app(body, headers, seen), config)
        binds: list[str] = await nursery.start(serve)
        yield binds[0].partition("://")[2]
        nursery.cancel_scope.cancel()


def _routed(entries: int, padding: int = 0) -> bytes:
    status = [{"role": "PREFILL", "server_ip": "10.0.0.1", "http_port": 8000}] * entries
    return json.dumps({"success": True, "code": 200, "server_status": status, "pad": "x" * padding}).encode()


async def test_a_normal_reply_is_decoded() -> None:
    with trio.fail_after(20):
        async with http_server(_routed(1)) as host, HttpMasterTransport(MasterConfig()) as transport:
            reply = await transport.schedule(host, REQUEST)
            assert isinstance(reply, MasterRouted) and len(reply.role_addrs) == 1


async def test_a_reply_larger_than_the_bound_is_garbled_and_read_no_further() -> None:
    with trio.fail_after(20):
        async with http_server(_routed(1, padding=MAX_REPLY_BYTES)) as host, HttpMasterTransport(
            MasterConfig()
        ) as transport:
            with pytest.raises(GarbledReply, match=f"larger than {MAX_REPLY_BYTES} bytes"):
                await transport.schedule(host, REQUEST)
            # The client is still usable after the connection it gave up.
            with pytest.raises(GarbledReply):
                await transport.master_info(host)


async def test_a_compressed_reply_is_garbled_without_being_inflated() -> None:
    # A scheduler (or a proxy) that compresses whatever the client asked for: kilobytes on the wire, each
    # a thousand times larger inflated.
    inflated = 32 << 20
    compressed = gzip.compress(b"\0" * inflated, compresslevel=9)
    assert len(compressed) < MAX_REPLY_BYTES
    seen: list[Message] = []
    with trio.fail_after(20):
        async with (
            http_server(compressed, headers=((b"content-encoding", b"gzip"),), seen=seen) as host,
            HttpMasterTransport(MasterConfig()) as transport,
        ):
            tracemalloc.start()
            try:
                with pytest.raises(GarbledReply, match="Content-Encoding gzip"):
                    await transport.schedule(host, REQUEST)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    assert [dict(scope["headers"]).get(b"accept-encoding") for scope in seen] == [b"identity"]
    # The reply was refused as sent: nothing near its inflated size was ever held.
    assert peak < inflated // 4, peak
