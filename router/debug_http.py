"""The debug HTTP endpoint: a small hand-written ASGI app served by hypercorn on trio.

Routes (GET, and HEAD for its status and headers alone; anything else 405, unknown paths 404; a
WebSocket upgrade 400, or 404 on an unknown path):

- ``/healthz``            200 while the process runs.
- ``/readyz``             200 when the router can route, else 503; the body says why (and lists any
                          configuration problems that turned the KVCM fallback off).
- ``/metrics``            Prometheus exposition of the MetricsSink's registry (OpenMetrics on request),
                          built at most once per ``METRICS_MAX_AGE_S`` per format: a read within that
                          of the last build gets the same bytes.
- ``/debug/actors``       ``{"now": ..., "actors": {name: ...}}``: JSON per actor, from the supervisor's
                          :class:`DebugSources`. Its times (``last_error_at``, ``ejected_until``, ...)
                          are trio clock readings, whose zero is arbitrary: ``now`` is the same clock
                          at the read, so ``now - t`` is an age and ``t - now`` a wait.
- ``/debug/decisions``    the last N decisions with their explanation (``?limit=N``, default 20),
                          newest first, up to ``--metrics-decisions-body-max-bytes`` of JSON
                          (``truncated`` says when decisions were left out). Serialised in pieces
                          of a few decisions with a checkpoint between two, so routing runs in between.
- ``/debug/config``       the effective configuration, each value's source, the problems; redacted.

Binds 127.0.0.1 by default; port 0 picks a free port, and the bound address is logged and handed to
the starter through ``task_status``. With a bearer token (``--debug-token`` or ``--debug-token-file``)
every path except ``/healthz`` answers 401 unless the request carries ``Authorization: Bearer <token>``
(compared in constant time). Addresses' userinfo is redacted in /readyz and every /debug/ path.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import json
import logging
import math
import re
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any, Protocol
from urllib.parse import parse_qs

import hypercorn.config
import hypercorn.trio
import trio
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

from actors.metrics_sink import DecisionRecord, MetricsSink
from router.exception_groups import leaves
from router.logs import ctx
from router.settings import LoadedConfig, debug_config_view, parse_listen, read_token_file
from router.targets import HostPort, parse_target, redact_userinfo

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_DECISIONS_LIMIT = 20
# Decisions serialised between two checkpoints (a few hundred µs of the routing thread at most).
DECISIONS_PER_PIECE = 8
Answer = tuple[int, str, bytes]  # status, content type, body
_TEXT = "text/plain; charset=utf-8"
_JSON = "application/json"


class DebugSources(Protocol):
    """What the supervisor provides to the endpoint. Both methods are synchronous and cheap."""

    def ready(self) -> tuple[bool, str]:
        """(can the router route now, why or why not) — e.g. (False, "discovery has no worker")."""
        ...

    def actors(self) -> Mapping[str, Mapping[str, object]]:
        """Per actor: state, inbox depth / capacity / peak, last error and when, restarts, uptime,
        and its own health snapshot (dataclasses and enums are fine: they are JSON-encoded here)."""
        ...


def to_jsonable(value: object) -> object:
    """A JSON-ready copy: dataclasses → dicts, enums → values, sequences → lists, inf/nan → strings."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else str(to_jsonable(k)): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | deque):
        return [to_jsonable(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((to_jsonable(v) for v in value), key=str)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def decision_entry(record: DecisionRecord, now: float) -> object:
    """A decision as a JSON entry, with its age in seconds (trio clock)."""
    return {"age_s": round(now - record.at, 6), "decision": to_jsonable(record.decision)}


async def decisions_body(records: Sequence[bytes], now: float, limit: int, max_bytes: int) -> bytes:
    """The /debug/decisions JSON for ``records`` (packed, as the sink's ring keeps them; newest first),
    at most about ``max_bytes`` long.

    Each decision is unpacked and serialised on its own, a checkpoint after every few: the records
    are immutable, so the decisions recorded meanwhile change nothing, and the routing thread is held
    for one piece at a time. Decisions that would take the body past ``max_bytes`` are left out
    (``truncated``).
    """
    entries: list[str] = []
    size = 0
    truncated = False
    piece_started = trio.current_time()
    for index, record in enumerate(records):
        if index and index % DECISIONS_PER_PIECE == 0:
            # Pace the work: after a piece that took t, rest DEBUG_REST_RATIO × t, so however often
            # the endpoint is read it holds at most 1 / (1 + DEBUG_REST_RATIO) of the routing thread.
            await trio.sleep((trio.current_time() - piece_started) * DEBUG_REST_RATIO)
            piece_started = trio.current_time()
        # A decision's error may quote a peer's message, and that an address with its userinfo.
        text = redact_userinfo(json.dumps(decision_entry(DecisionRecord.unpacked(record), now), indent=2))
        size += len(text) + 2
        if size > max_bytes:
            truncated = True
            break
        entries.append(text)
    head = json.dumps({"limit": limit, "count": len(entries), "truncated": truncated})[:-1]
    return (head + ', "decisions": [\n' + ",\n".join(entries) + "\n]}\n").encode()


DEBUG_REST_RATIO = 9  # /debug/decisions takes at most a tenth of the routing thread
# The exposition is built on the routing thread, all at once: reused for this long, a client reading
# /metrics in a loop costs one build a second, not one a read. Scrapes come every several seconds.
METRICS_MAX_AGE_S = 1.0
_OPENMETRICS = "application/openmetrics-text"


def metrics_format(accept: str) -> tuple[Callable[[Any], bytes], str]:
    """The exposition's encoder and content type for an Accept header, from a small fixed set: the
    client's OpenMetrics version is taken as 1.0.0 or 2.0.0 (by its major number), its escaping is
    allow-utf-8 or underscores. The content type keys the cache of built expositions: a version the
    client made up must neither add an entry nor force a build."""
    try:
        encoder, content_type = choose_encoder(accept)
    except (TypeError, ValueError):  # a version it cannot compare ("version=abc"): the default format
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4
    if "; escaping=" not in content_type:
        return encoder, content_type  # a fixed default
    params = dict(p.split("=", 1) for p in content_type.split("; ")[1:] if "=" in p)
    escaping = params.get("escaping", "")
    if escaping in ("values", "dots"):
        # Every name of ours is a valid legacy name, which every escaping leaves as it is; prometheus-client
        # escapes each whole sample name under these all the same, its suffix with it (a histogram's
        # `_bucket` as `__bucket`), so the samples leave their families: types lost, and a parser refuses
        # OpenMetrics 2.0.0. Underscores escaping writes the same names as they are, and says so.
        escaping = "underscores"
    if not content_type.startswith(_OPENMETRICS):
        return choose_encoder(f"text/plain; version={params.get('version', '1.0.0')}; escaping={escaping}")
    try:
        major = int(params.get("version", "1").split(".", 1)[0])
    except ValueError:
        major = 1
    canonical = "2.0.0" if major >= 2 else "1.0.0"
    return choose_encoder(f"{_OPENMETRICS}; version={canonical}; escaping={escaping}")


class _BadRequest(Exception):
    pass


class DebugApp:
    """The ASGI application (HTTP and lifespan scopes; WebSocket ones are refused)."""

    def __init__(
        self,
        sources: DebugSources,
        sink: MetricsSink,
        loaded: LoadedConfig,
        token: str = "",
        *,
        metrics_max_age_s: float = METRICS_MAX_AGE_S,
    ) -> None:
        self._sources = sources
        self._metrics_max_age_s = metrics_max_age_s
        self._expositions: dict[str, tuple[float, bytes]] = {}  # content type → (built at, body)
        self._sink = sink
        self._loaded = loaded
        self._token = token.encode("ascii") if token else None  # None: no token asked for
        self._decisions_turn = trio.Lock()
        self._routes: dict[str, Callable[[Scope], Answer | Awaitable[Answer]]] = {
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/metrics": self._metrics,
            "/debug/actors": self._actors,
            "/debug/decisions": self._decisions,
            "/debug/config": self._config,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            await self._refuse_websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        route = self._routes.get(scope["path"])
        headers: list[tuple[bytes, bytes]] = []
        if not self._authorized(scope):
            status, content_type, body = 401, _TEXT, _UNAUTHORIZED
            headers.append(_WWW_AUTHENTICATE)
        elif route is None:
            status, content_type, body = 404, _TEXT, _no_such_path(scope)
        elif scope["method"] not in ("GET", "HEAD"):
            status, content_type, body = (
                405,
                _TEXT,
                f"method {scope['method']} not allowed; use GET\n".encode(),
            )
            headers.append((b"allow", b"GET, HEAD"))
        else:
            try:
                answer = route(scope)
                status, content_type, body = answer if isinstance(answer, tuple) else await answer
            except _BadRequest as exc:
                status, content_type, body = 400, _TEXT, f"{exc}\n".encode()
            except Exception as exc:  # a broken source must not take the endpoint down
                logger.exception("debug endpoint %s failed", scope["path"], extra=ctx(target=scope["path"]))
                status, content_type, body = (
                    500,
                    _TEXT,
                    f"internal error: {type(exc).__name__}: {exc}\n".encode(),
                )
        headers += [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        # HEAD: GET's status and headers, no body (load balancers' health checks may ask so).
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    async def _refuse_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """No path speaks WebSocket: the upgrade is refused with a 4xx saying why (401 and 404 as for
        a plain GET), where returning without an answer made the server send a 500."""
        message = await receive()
        if message["type"] != "websocket.connect":  # the client went away first
            return
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close"})  # the server answers 403
            return
        headers = [(b"content-type", _TEXT.encode())]
        if not self._authorized(scope):
            status, body = 401, _UNAUTHORIZED
            headers.append(_WWW_AUTHENTICATE)
        elif scope["path"] not in self._routes:
            status, body = 404, _no_such_path(scope)
        else:
            status, body = 400, f"no WebSocket here: GET {scope['path']} as plain HTTP\n".encode()
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        """Without a token, or for /healthz (liveness probes carry none): yes. Else the bearer token must match."""
        if self._token is None or scope["path"] == "/healthz":
            return True
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, given = bytes(value).partition(b" ")
                # compare_digest: the time taken does not tell how much of the token was right.
                return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._token)
        return False

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _healthz(self, scope: Scope) -> tuple[int, str, bytes]:
        return 200, _TEXT, b"ok\n"

    def _readyz(self, scope: Scope) -> tuple[int, str, bytes]:
        ready, why = self._sources.ready()
        lines = [f"{'ready' if ready else 'not ready'}: {why}"]
        if self._loaded.supervised is not None:
            lines.append(f"this is {self._loaded.supervised}")
        if self._loaded.fallback_disabled_by_errors:
            lines.append("KVCM fallback disabled by configuration problems (routing by domain):")
            lines += [f"  - {p}" for p in self._loaded.fallback_errors]
        if self._loaded.fatal_errors:
            lines.append("configuration problems:")
            lines += [f"  - {p}" for p in self._loaded.fatal_errors]
        return (200 if ready else 503), _TEXT, redact_userinfo("\n".join(lines) + "\n").encode()

    def _metrics(self, scope: Scope) -> tuple[int, str, bytes]:
        accept = ", ".join(
            value.decode("latin-1") for name, value in scope.get("headers", ()) if name.lower() == b"accept"
        )
        encoder, content_type = metrics_format(accept)
        now = trio.current_time()
        built = self._expositions.get(content_type)
        if built is None or now - built[0] >= self._metrics_max_age_s:
            built = self._expositions[content_type] = (now, encoder(self._sink.registry))
        return 200, content_type, built[1]

    def _actors(self, scope: Scope) -> tuple[int, str, bytes]:
        # The snapshots' times are trio clock readings (an arbitrary zero): now is what relates them.
        body = {"now": trio.current_time(), "actors": self._sources.actors()}
        return _json(body, redact=True)  # last errors may quote a configured address

    async def _decisions(self, scope: Scope) -> Answer:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        unknown = sorted(set(query) - {"limit"})
        if unknown:
            raise _BadRequest(f"{unknown[0][:40]!r}: unknown parameter (only limit is)")
        limit = DEFAULT_DECISIONS_LIMIT
        if "limit" in query:
            text = query["limit"][-1]
            # ASCII digits only (str.isdigit also takes '²'), and few of them: the ring is far smaller.
            if _LIMIT_TEXT.fullmatch(text) is None or int(text) < 1:
                raise _BadRequest(f"limit: must be a positive integer, got {text[:40]!r}")
            limit = int(text)
        # A snapshot of references (the ring holds at most its size): cheap, and nothing awaits before it.
        records = self._sink.recent_decisions(limit)
        async with self._decisions_turn:  # one body at a time: readers together keep to the paced share
            body = await decisions_body(
                records, trio.current_time(), limit, self._sink.config.decisions_body_max_bytes
            )
        return 200, _JSON, body

    def _config(self, scope: Scope) -> tuple[int, str, bytes]:
        return _json(debug_config_view(self._loaded))


_LIMIT_TEXT = re.compile(r"[0-9]{1,9}")
_UNAUTHORIZED = b"unauthorized: send Authorization: Bearer <token>\n"
_WWW_AUTHENTICATE = (b"www-authenticate", b'Bearer realm="kvroute debug"')


def _no_such_path(scope: Scope) -> bytes:
    return f"no such path: {scope['path']}\n".encode()


def _json(value: object, *, redact: bool = False) -> tuple[int, str, bytes]:
    text = json.dumps(to_jsonable(value), indent=2) + "\n"
    return 200, _JSON, (redact_userinfo(text) if redact else text).encode()


# A connection whose sent bytes stay unacknowledged this long (its client stopped reading) is aborted
# by the kernel. hypercorn writes a response with no timeout, shielded from cancellation: without this,
# one client that stops reading would hold its connection, and the router's stop, for ever.
UNACKED_SEND_TIMEOUT_MS = 10_000
# A connection whose client sends nothing for this long is closed (hypercorn's read timeout).
DEBUG_READ_TIMEOUT_S = 10


def listening_fd(listen: HostPort, unacked_send_timeout_ms: int = UNACKED_SEND_TIMEOUT_MS) -> int:
    """A TCP socket bound to ``listen`` for hypercorn (``fd://``), whose connections inherit the unacked
    send timeout where the platform has it; its file descriptor, now hypercorn's."""
    sock = socket.socket(socket.AF_INET6 if listen.is_ipv6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, unacked_send_timeout_ms)
        sock.bind((listen.host, listen.port))
    except BaseException:
        sock.close()
        raise
    return sock.detach()


class DebugServer:
    """Serves :class:`DebugApp` on ``listen`` (HOST:PORT; port 0 = a free port) until cancelled."""

    def __init__(
        self,
        sources: DebugSources,
        sink: MetricsSink,
        loaded: LoadedConfig,
        listen: str,
        *,
        token: str = "",
        token_file: str = "",
        unacked_send_timeout_ms: int = UNACKED_SEND_TIMEOUT_MS,
        read_timeout_s: int = DEBUG_READ_TIMEOUT_S,
        metrics_max_age_s: float = METRICS_MAX_AGE_S,
    ) -> None:
        parse_listen(listen)  # a bad address fails here, naming the input, not inside hypercorn
        self._unacked_send_timeout_ms = unacked_send_timeout_ms
        self._read_timeout_s = read_timeout_s
        self._sources, self._sink, self._loaded = sources, sink, loaded
        self._token, self._token_file = token, token_file
        self._metrics_max_age_s = metrics_max_age_s
        self.app = DebugApp(sources, sink, loaded, token, metrics_max_age_s=metrics_max_age_s)
        self._listen = listen
        self.bound: HostPort | None = None

    def _tried(self, listen: HostPort) -> str:
        """The address a bind tried, as an error names it: a restart's is the one first announced."""
        if listen is self.bound:
            return f"{listen} (the address announced at the first start; held by another process now?)"
        return self._listen

    async def run(self, *, task_status: trio.TaskStatus[HostPort] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the bound address through ``task_status.started(HostPort)``, serve until cancelled."""
        if self._token_file:
            # Read at start (not at construction): the token file may be written by the same deployment step.
            token = await trio.to_thread.run_sync(read_token_file, self._token_file)
            self.app = DebugApp(
                self._sources, self._sink, self._loaded, token, metrics_max_age_s=self._metrics_max_age_s
            )
        # A restart binds the address the first run bound and announced: with port 0 a fresh port would
        # leave everyone scraping the announced one refused.
        listen = self.bound if self.bound is not None else parse_listen(self._listen)
        try:
            # Bound here (a name in it may need resolving: off the trio thread), handed over by fd.
            fd = await trio.to_thread.run_sync(listening_fd, listen, self._unacked_send_timeout_ms)
        except OSError as exc:
            raise OSError(f"--debug-listen: cannot bind {self._tried(listen)}: {exc}") from exc
        config = hypercorn.config.Config()
        config.bind = [f"fd://{fd}"]
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")  # through our logging setup
        config.include_server_header = False
        # A client that sends nothing is closed: an HTTP/2 preface stops hypercorn's idle timer, and
        # without a read timeout such connections were held for ever, each an open descriptor.
        config.read_timeout = self._read_timeout_s

        serving = False

        async def serve(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                # hypercorn types scopes as TypedDicts; the app takes the same messages as plain mappings.
                await hypercorn.trio.serve(self.app, config, task_status=task_status)  # type: ignore[arg-type]
            except* OSError as group:
                if serving:  # not a bind error
                    raise
                first = leaves(group)[0]
                raise OSError(f"--debug-listen: cannot bind {self._tried(listen)}: {first}") from first

        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(serve)
            serving = True
            self.bound = parse_target(binds[0].partition("://")[2])
            logger.info("debug HTTP listening on http://%s", self.bound, extra=ctx(target=str(self.bound)))
            task_status.started(self.bound)
