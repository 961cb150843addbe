"""The HTTP master client against a real HTTP server on 127.0.0.1:0 (hypercorn, the real clock): a reply
larger than MAX_REPLY_BYTES is read no further and is garbled, a compressed one is garbled without being
inflated; a normal one is decoded, and so is one of exactly MAX_REPLY_BYTES. The client has no timeout of
its own, takes no proxy from the environment and keeps idle connections as long as configured."""

from __future__ import annotations

import functools
import gzip
import json
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import hypercorn.config
import hypercorn.trio
import pytest
import trio

from kvroute_sim.sim.master import MasterFaults, SimMaster, SimMasterAddresses
from router.config import MasterConfig
from router.transport.errors import GarbledReply
from router.transport.master_http import HttpMasterTransport
from router.types import Role, RoleAddr
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


@pytest.mark.parametrize("extra", [0, 1])
async def test_a_reply_of_exactly_the_bound_is_decoded_and_one_byte_more_is_garbled(extra: int) -> None:
    padding = MAX_REPLY_BYTES - len(_routed(1)) + extra
    body = _routed(1, padding=padding)
    assert len(body) == MAX_REPLY_BYTES + extra
    with trio.fail_after(20):
        async with http_server(body) as host, HttpMasterTransport(MasterConfig()) as transport:
            if extra == 0:
                assert isinstance(await transport.schedule(host, REQUEST), MasterRouted)
            else:
                with pytest.raises(GarbledReply, match=f"larger than {MAX_REPLY_BYTES} bytes"):
                    await transport.schedule(host, REQUEST)


async def test_a_slow_scheduler_is_waited_for_within_the_callers_deadline(nursery: trio.Nursery) -> None:
    """The caller's trio deadline is the only bound: the client sets no timeout of its own (httpx's
    default would end a call the caller still waits for)."""
    sim = SimMaster([RoleAddr(Role.PREFILL, "10.0.0.1", 8000, 8001)], replicas=1)
    addresses: SimMasterAddresses = await nursery.start(sim.run)
    sim.set_faults(0, MasterFaults(slow_ms=800))
    with trio.fail_after(5):
        async with HttpMasterTransport(MasterConfig()) as transport:
            assert transport._client.timeout == httpx.Timeout(None)
            assert isinstance(await transport.schedule(addresses.hosts[0], REQUEST), MasterRouted)


async def test_proxies_in_the_environment_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.socket.socket() as refusing:  # bound, never listening: a proxy there refuses
        await refusing.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{refusing.getsockname()[1]}"
        for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy)
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        with trio.fail_after(20):
            async with http_server(_routed(1)) as host, HttpMasterTransport(MasterConfig()) as transport:
                assert isinstance(await transport.schedule(host, REQUEST), MasterRouted)


@pytest.mark.parametrize("keepalive_s", [0.01, 3600.0])
async def test_an_idle_connection_is_kept_as_long_as_configured(keepalive_s: float) -> None:
    seen: list[Message] = []
    config = MasterConfig(http_keepalive_expiry_s=keepalive_s)
    with trio.fail_after(20):
        async with http_server(_routed(1), seen=seen) as host, HttpMasterTransport(config) as transport:
            await transport.schedule(host, REQUEST)
            await trio.sleep(0.2)  # idle far longer than the short expiry, far shorter than the long one
            await transport.schedule(host, REQUEST)
    first, second = (scope["client"] for scope in seen)
    assert (first == second) is (keepalive_s > 0.2)  # the same connection (client port) only if kept
