"""HTTP JSON adapter of ``MasterTransport``: one httpx.AsyncClient on trio (through anyio/httpcore).

One client serves every scheduler host, with a bounded keep-alive pool. It has no timeouts of
its own: the caller's trio cancel scope bounds each call, and cancelling it closes the
request's connection, so the scheduler sees the disconnect (and drops a queued request).
Close it with ``aclose()`` or use it as an async context manager. Given an SSL context (see
``router.transport.tls.client_ssl_context``), it speaks HTTPS to every host and checks their
certificates with it; without one, plain HTTP.
"""

from __future__ import annotations

import ssl
from types import TracebackType

import httpx

from router.config import MasterConfig
from router.targets import TargetError, parse_target
from router.transport.errors import DeadlineExceeded, GarbledReply, TransportError, Unavailable
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

# identity: a compressed reply is inflated as it is read, a few kilobytes sent becoming megabytes on the
# routing thread before MAX_REPLY_BYTES could stop it; the bound is on the bytes the scheduler sends.
_HEADERS = {"content-type": "application/json", "accept": "application/json", "accept-encoding": "identity"}


def http_base(host: str, scheme: str = "http") -> str:
    """``scheme://host:port`` for a configured scheduler address; raises ``Unavailable`` naming a bad one."""
    try:
        return f"{scheme}://{parse_target(host)}"
    except TargetError as exc:
        raise Unavailable(host, f"not a HOST:PORT scheduler address ({exc})") from exc


def _transport_error(host: str, error: httpx.HTTPError) -> TransportError:
    if isinstance(error, httpx.TimeoutException):
        return DeadlineExceeded(host, f"{type(error).__name__}: {_reason(error)}")
    if isinstance(error, httpx.ConnectError):
        return Unavailable(host, f"connection failed: {_reason(error)}")
    # Reset, closed without a reply, protocol violations: no usable reply.
    return Unavailable(host, f"{type(error).__name__}: {_reason(error)}")


def _reason(error: BaseException) -> str:
    """The error's own text, or its cause's: under trio a failed TLS handshake is a ConnectError with
    no text, the certificate's fault (an unknown issuer, a name mismatch) only in its chain."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        text = str(link)
        if text:
            return text if link is error else f"{type(link).__name__}: {text}"
        link = link.__cause__ or link.__context__
    return type(error).__name__


class HttpMasterTransport:
    def __init__(self, config: MasterConfig, tls: ssl.SSLContext | None = None, *, calls_at_once: int = 0) -> None:
        """``calls_at_once``: how many calls the router may make at once (its admission cap and the
        discovery polls); the connections kept are at least that many."""
        # No cap on connections at once: calls are already bounded by the router's admission cap, and
        # a call that waited here for a connection would spend its window in our own queue and be
        # judged a failure of the scheduler, opening its breaker under a burst it answered in time.
        # Kept connections: httpcore closes an idle one whenever more connections are open than it
        # keeps, busy ones counted, so keeping fewer than the calls at once would make most calls of a
        # burst open a connection of their own.
        limits = httpx.Limits(
            max_connections=None,
            max_keepalive_connections=max(config.http_max_connections, calls_at_once),
            keepalive_expiry=config.http_keepalive_expiry_s,
        )
        # timeout=None: the caller's trio deadline is the only bound; trust_env=False: no proxies
        # from the environment between us and the scheduler.
        self._scheme = "https" if tls is not None else "http"
        self._client = httpx.AsyncClient(
            limits=limits, timeout=None, trust_env=False, headers=_HEADERS, verify=tls if tls is not None else True
        )

    async def __aenter__(self) -> HttpMasterTransport:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _post(self, host: str, path: str, body: bytes) -> tuple[int, bytes]:
        url = http_base(host, self._scheme) + path
        try:
            async with self._client.stream("POST", url, content=body) as response:
                encodings = [e for e in response.headers.get_list("content-encoding", split_commas=True) if e]
                if any(e.lower() != "identity" for e in encodings):  # leaving the block closes the connection
                    raise GarbledReply(
                        host, f"{path}: reply in Content-Encoding {', '.join(encodings)}, where identity was asked for"
                    )
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_raw():  # as sent: never decompressed
                    size += len(chunk)
                    if size > MAX_REPLY_BYTES:  # leaving the block closes the connection
                        raise GarbledReply(host, f"{path}: reply body larger than {MAX_REPLY_BYTES} bytes")
                    chunks.append(chunk)
                return response.status_code, b"".join(chunks)
        except httpx.HTTPError as exc:
            raise _transport_error(host, exc) from exc

    async def schedule(self, host: str, request: MasterScheduleRequest) -> MasterReply:
        status, body = await self._post(host, paths.MASTER_HTTP_SCHEDULE, await schedule_body(request))
        return decode_schedule_json(status, body, host)

    async def master_info(self, host: str) -> MasterInfo:
        status, body = await self._post(host, paths.MASTER_HTTP_INFO, b"{}")
        return decode_info_json(status, body, host)
