"""The debug HTTP endpoint against a real hypercorn server on 127.0.0.1:0 with a real HTTP client."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import socket
from collections.abc import AsyncIterator, Mapping, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics_sink import DecisionMade, DecisionRecord, MetricsSink
from router.config import MetricsConfig
from router.debug_http import (
    DEBUG_REST_RATIO,
    DECISIONS_PER_PIECE,
    METRICS_MAX_AGE_S,
    DebugApp,
    DebugServer,
    decisions_body,
    to_jsonable,
)
from router.decision_pack import pack_decision
from router.settings import LoadedConfig, load_config
from router.targets import TargetError
from router.types import CandidateExplain, Reason, Role, RouteDecision, RouteSource, Stage, WorkerAddr

GOOD = {"kvcm_bootstrap": "10.0.0.1", "kvcm_instance_id": "ns", "workers": "10.1.0.1:8000"}


class Breaker(enum.Enum):
    OPEN = "open"


@dataclasses.dataclass(frozen=True)
class LeaderHealth:
    target: str | None
    breaker: Breaker
    next_attempt: float


class Sources:
    """The supervisor's side of the DebugSources protocol, scripted by the test."""

    def __init__(self) -> None:
        self.is_ready = (True, "leader 10.0.0.1:6381 known; 1 worker discovered")
        self.fail_actors = False

    def ready(self) -> tuple[bool, str]:
        return self.is_ready

    def actors(self) -> Mapping[str, Mapping[str, object]]:
        if self.fail_actors:
            raise RuntimeError("snapshot exploded")
        return {
            "leader_resolver": {
                "state": "running",
                "restarts": 1,
                "last_error": None,
                "health": LeaderHealth(None, Breaker.OPEN, math.inf),
            }
        }


def decision(n: int) -> RouteDecision:
    return RouteDecision(
        request_id=f"r{n}",
        worker=WorkerAddr.from_http("10.1.0.1", 8000),
        role=Role.PREFILL,
        route_source=RouteSource.KVCM,
        reason=Reason.CACHE_LEADER,
        hit_tokens=128,
        local_blocks=2,
        elapsed_ms=1.5,
        stage_ms={Stage.PROBE: 1.0},
        candidates=(CandidateExplain("10.1.0.1:8000", "hot", 2, 128, 40, "PREFILL", None, chosen=True),),
    )


@asynccontextmanager
async def serving(
    sources: Sources, sink: MetricsSink, loaded: LoadedConfig, *, metrics_max_age_s: float = METRICS_MAX_AGE_S
) -> AsyncIterator[tuple[httpx.AsyncClient, DebugServer]]:
    server = DebugServer(sources, sink, loaded, "127.0.0.1:0", metrics_max_age_s=metrics_max_age_s)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        bound = await nursery.start(server.run)
        async with httpx.AsyncClient(base_url=f"http://{bound}", trust_env=False) as client:
            yield client, server
        nursery.cancel_scope.cancel()


async def test_binds_a_free_loopback_port_and_serves_health() -> None:
    with trio.fail_after(10):
        sources = Sources()
        async with serving(sources, MetricsSink(MetricsConfig()), load_config(GOOD, {})) as (client, server):
            assert server.bound is not None
            assert server.bound.host == "127.0.0.1" and server.bound.port > 0
            health = await client.get("/healthz")
            assert (health.status_code, health.text) == (200, "ok\n")
            ready = await client.get("/readyz")
            assert (ready.status_code, ready.text) == (
                200,
                "ready: leader 10.0.0.1:6381 known; 1 worker discovered\n",
            )
            sources.is_ready = (False, "discovery has no worker")
            not_ready = await client.get("/readyz")
            assert (not_ready.status_code, not_ready.text) == (503, "not ready: discovery has no worker\n")


async def test_a_restarted_server_listens_where_the_first_run_announced() -> None:
    """Bound to port 0, a restarted server (the supervisor runs the same object again after a crash)
    took a fresh port: the address announced at start went dark."""
    with trio.fail_after(10):
        sink = MetricsSink(MetricsConfig())
        server = DebugServer(Sources(), sink, load_config(GOOD, {}), "127.0.0.1:0")
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            async with trio.open_nursery() as first_run:
                announced = await first_run.start(server.run)
                first_run.cancel_scope.cancel()  # as a crash ends it
            async with trio.open_nursery() as second_run:
                assert await second_run.start(server.run) == announced
                async with httpx.AsyncClient(base_url=f"http://{announced}", trust_env=False) as client:
                    assert (await client.get("/healthz")).status_code == 200
                second_run.cancel_scope.cancel()
            # Taken meanwhile by another process: the error names the port tried, not the configured 0.
            with socket.socket() as taker:
                taker.bind((announced.host, announced.port))
                taker.listen()
                with pytest.raises(OSError, match=rf"cannot bind {announced} \(the address announced"):
                    await nursery.start(server.run)
            nursery.cancel_scope.cancel()


async def test_readyz_and_config_report_a_fallback_disabled_by_configuration() -> None:
    loaded = load_config({**GOOD, "block_size": "0", "kvcm_instance_id": ""}, {})
    with trio.fail_after(10):
        async with serving(Sources(), MetricsSink(MetricsConfig()), loaded) as (client, _):
            ready = await client.get("/readyz")
            assert ready.status_code == 200
            assert ready.text.splitlines() == [
                "ready: leader 10.0.0.1:6381 known; 1 worker discovered",
                "KVCM fallback disabled by configuration problems (routing by domain):",
                "  - --block-size (KVROUTE_BLOCK_SIZE): must be > 0, got 0 (from flag --block-size)",
                "  - --kvcm-instance-id (KVROUTE_KVCM_INSTANCE_ID): required when --kvcm-fallback is on",
            ]
            config = await client.get("/debug/config")
            assert config.headers["content-type"] == "application/json"
            body = config.json()
            assert body["kvcm_fallback_disabled_by_errors"] is True
            assert body["effective"]["router"]["kvcm_fallback"] is False
            assert body["effective"]["deployment"]["block_size"] == 64
            assert body["sources"]["deployment.block_size"] == "flag --block-size"
            assert len(body["errors"]) == 2


async def test_metrics_scrape_parses_and_moves_with_events() -> None:
    sink = MetricsSink(MetricsConfig())
    sink.register_gauge_source("kvroute_probe_inflight", lambda: 3)
    with trio.fail_after(10):
        # Built afresh for every read: this test reads the moves at once (the reuse has its own test).
        async with serving(Sources(), sink, load_config(GOOD, {}), metrics_max_age_s=0) as (client, _):
            for n in range(3):
                sink.emit(DecisionMade(decision(n)))
            await trio.testing.wait_all_tasks_blocked()
            scrape = await client.get("/metrics")
            assert scrape.status_code == 200
            assert scrape.headers["content-type"].startswith("text/plain; version=")
            families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
            decisions = {
                (s.labels["route_source"], s.labels["reason"]): s.value
                for s in families["kvroute_route_decisions"].samples
                if s.name == "kvroute_route_decisions_total"
            }
            assert decisions == {("kvcm", "CACHE_LEADER"): 3.0}
            assert [s.value for s in families["kvroute_probe_inflight"].samples] == [3.0]
            probe_count = [
                s.value
                for s in families["kvroute_route_duration_seconds"].samples
                if s.name.endswith("_count") and s.labels["stage"] == "probe"
            ]
            assert probe_count == [3.0]
            sink.emit(DecisionMade(decision(3)))
            await trio.testing.wait_all_tasks_blocked()
            again = await client.get("/metrics")
            assert (
                'kvroute_route_decisions_total{reason="CACHE_LEADER",route_source="kvcm"} 4.0' in again.text
            )
            om = await client.get(
                "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
            )
            assert om.headers["content-type"].startswith("application/openmetrics-text")
            assert om.text.endswith("# EOF\n")
            # A version prometheus_client cannot compare raised in its encoder choice: a 500 and a
            # traceback logged per scrape. An Accept we cannot read is ignored, as HTTP allows.
            for accept in ("application/openmetrics-text; version=abc", "text/plain; version=1.x"):
                odd = await client.get("/metrics", headers={"accept": accept})
                assert odd.status_code == 200, accept
                assert odd.headers["content-type"].startswith("text/plain; version=0.0.4"), accept
                assert 'kvroute_route_decisions_total{reason="CACHE_LEADER",route_source="kvcm"} 4.0' in odd.text


async def _get(app: DebugApp, path: str, accept: str = "") -> tuple[int, bytes]:
    """One GET through the ASGI app itself (no server): its status and body."""
    status, body, _ = await _get_with_headers(app, path, accept)
    return status, body


async def _get_with_headers(app: DebugApp, path: str, accept: str = "") -> tuple[int, bytes, dict[bytes, bytes]]:
    """One GET through the ASGI app itself (no server): its status, body and headers."""
    sent: list[Mapping[str, object]] = []

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, object]) -> None:
        sent.append(message)

    headers = [(b"accept", accept.encode())] if accept else []
    await app({"type": "http", "method": "GET", "path": path, "headers": headers}, receive, send)
    status, body, raw_headers = sent[0]["status"], sent[1]["body"], sent[0].get("headers", [])
    assert isinstance(status, int) and isinstance(body, bytes) and isinstance(raw_headers, list)
    return status, body, {bytes(k): bytes(v) for k, v in raw_headers}


async def test_metrics_are_built_at_most_once_per_max_age(autojump_clock: trio.testing.MockClock) -> None:
    """Every read built the exposition on the routing thread: a client reading in a loop held it."""
    inflight = [1.0]
    sink = MetricsSink(MetricsConfig())
    sink.register_gauge_source("kvroute_probe_inflight", lambda: inflight[0])
    app = DebugApp(Sources(), sink, load_config(GOOD, {}))
    openmetrics = "application/openmetrics-text; version=1.0.0"
    assert b"kvroute_probe_inflight 1.0" in (await _get(app, "/metrics"))[1]
    inflight[0] = 2.0
    await trio.sleep(METRICS_MAX_AGE_S / 2)
    assert b"kvroute_probe_inflight 1.0" in (await _get(app, "/metrics"))[1]  # the same build
    assert b"kvroute_probe_inflight 2.0" in (await _get(app, "/metrics", openmetrics))[1]  # each format its own
    await trio.sleep(METRICS_MAX_AGE_S / 2)
    assert b"kvroute_probe_inflight 2.0" in (await _get(app, "/metrics"))[1]  # built again
    inflight[0] = 3.0
    assert b"kvroute_probe_inflight 2.0" in (await _get(app, "/metrics", openmetrics))[1]


async def test_a_made_up_openmetrics_version_neither_grows_the_cache_nor_forces_a_build(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The cache was keyed by the content type, which carried the client's version: each made-up
    version added an entry holding a whole exposition, and was built on the routing thread."""
    sink = MetricsSink(MetricsConfig())
    app = DebugApp(Sources(), sink, load_config(GOOD, {}))
    content_types = set()
    for i in range(200):
        status, _, headers = await _get_with_headers(app, "/metrics", f"application/openmetrics-text; version=1.0.{i}")
        assert status == 200
        content_types.add(headers[b"content-type"])
    assert content_types == {b"application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"}
    assert len(app._expositions) == 1
    for version, escaping in (("2.7.1", "allow-utf-8"), ("3.0.0", "values"), ("2.1", "dots"), ("1.9", "bogus")):
        await _get(app, "/metrics", f"application/openmetrics-text; version={version}; escaping={escaping}")
    # 2.0.0 with allow-utf-8, 2.0.0 with values and dots (both written as underscores); 1.9 with an
    # unknown escaping is 1.0.0 with underscores again.
    assert len(app._expositions) == 3


@pytest.mark.parametrize("escaping", ["values", "dots"])
@pytest.mark.parametrize("version", ["1.0.0", "2.0.0"])
async def test_an_exposition_asked_with_values_or_dots_escaping_parses(version: str, escaping: str) -> None:
    """prometheus-client escapes each whole sample name under "values" and "dots", its suffix with it,
    but not their families': types lost, and its own parser refused the exposition ("Clashing name");
    our names need no escaping, and are served under underscores escaping, which leaves them as they are."""
    sink = MetricsSink(MetricsConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        sink.emit(DecisionMade(decision(1)))  # a histogram with samples
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    app = DebugApp(Sources(), sink, load_config(GOOD, {}))
    asked = f"application/openmetrics-text; version={version}; escaping={escaping}"
    status, body, headers = await _get_with_headers(app, "/metrics", asked)
    assert status == 200 and headers[b"content-type"].endswith(b"; escaping=underscores")
    parsed = openmetrics_parser.text_string_to_metric_families(body.decode())  # type: ignore[no-untyped-call]
    types = {f.name: f.type for f in parsed}
    assert types["kvroute_route_duration_seconds"] == "histogram"
    # The text format as well: each family keeps its samples and its type.
    status, body, headers = await _get_with_headers(app, "/metrics", f"text/plain; version=1.0.0; escaping={escaping}")
    assert status == 200 and headers[b"content-type"].endswith(b"; escaping=underscores")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["kvroute_route_duration_seconds"].type == "histogram"
    assert families["kvroute_route_duration_seconds"].samples


async def test_debug_actors_and_decisions() -> None:
    sink = MetricsSink(MetricsConfig(decision_ring_size=3))
    with trio.fail_after(10):
        async with serving(Sources(), sink, load_config(GOOD, {})) as (client, _):
            before = trio.current_time()
            actors = (await client.get("/debug/actors")).json()
            after = trio.current_time()
            # The snapshots' times are trio clock readings, with an arbitrary zero: now, the same
            # clock at the read, is what relates them (the server runs in this trio run).
            assert before <= actors.pop("now") <= after
            assert actors == {
                "actors": {
                    "leader_resolver": {
                        "state": "running",
                        "restarts": 1,
                        "last_error": None,
                        "health": {"target": None, "breaker": "open", "next_attempt": "inf"},
                    }
                }
            }
            for n in range(5):
                sink.emit(DecisionMade(decision(n)))
            await trio.testing.wait_all_tasks_blocked()
            body = (await client.get("/debug/decisions", params={"limit": "2"})).json()
            assert (body["limit"], body["count"]) == (2, 2)
            assert [d["decision"]["request_id"] for d in body["decisions"]] == ["r4", "r3"]
            first = body["decisions"][0]
            assert 0 <= first["age_s"] < 10  # an age, not a time: no older than the test (its fail_after)
            assert first["decision"]["worker"] == {
                "ip": "10.1.0.1",
                "http_port": 8000,
                "grpc_port": 8001,
                "status_port": 8001,
            }
            assert first["decision"]["candidates"][0]["chosen"] is True
            assert first["decision"]["route_source"] == "kvcm"
            everything = (await client.get("/debug/decisions")).json()
            assert everything["count"] == 3  # the ring holds 3
            for bad in ("abc", "0", "-1", "", "\u00b2", "1" * 5000, "nan"):
                response = await client.get("/debug/decisions", params={"limit": bad})
                assert response.status_code == 400
                assert response.text == f"limit: must be a positive integer, got {bad[:40]!r}\n"
            typo = await client.get("/debug/decisions", params={"limt": "5"})
            assert (typo.status_code, typo.text) == (400, "'limt': unknown parameter (only limit is)\n")


async def test_unknown_paths_other_methods_and_failing_sources() -> None:
    sources = Sources()
    with trio.fail_after(10):
        async with serving(sources, MetricsSink(MetricsConfig()), load_config(GOOD, {})) as (client, _):
            missing = await client.get("/debug/nope")
            assert (missing.status_code, missing.text) == (404, "no such path: /debug/nope\n")
            post = await client.post("/healthz", content=b"x")
            assert post.status_code == 405 and post.headers["allow"] == "GET, HEAD"
            assert (await client.delete("/metrics")).status_code == 405
            # HEAD, as load balancers' health checks may send it: GET's status and headers, no body.
            get, head = await client.get("/healthz"), await client.head("/healthz")
            assert (head.status_code, head.content) == (200, b"")
            assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))
            assert (await client.head("/debug/nope")).status_code == 404
            sources.fail_actors = True
            broken = await client.get("/debug/actors")
            assert broken.status_code == 500 and "snapshot exploded" in broken.text
            assert (await client.get("/healthz")).status_code == 200  # still serving


async def _upgrade(port: int, path: str, authorization: str | None = None) -> bytes:
    """A WebSocket upgrade request for ``path``; the answer's head and body as received."""
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
    ]
    if authorization is not None:
        lines.append(f"Authorization: {authorization}")
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while True:
            head, _, body = answer.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
            if length is not None and len(body) >= int(length[1]):
                return answer
            chunk = await stream.receive_some()
            if not chunk:
                return answer
            answer += chunk


async def test_a_websocket_upgrade_is_refused_with_a_4xx_saying_why() -> None:
    """Returning without answering a WebSocket scope made the server answer 500."""
    sink = MetricsSink(MetricsConfig())
    with trio.fail_after(10):
        for token in ("", "s3cret"):
            server = DebugServer(Sources(), sink, load_config(GOOD, {}), "127.0.0.1:0", token=token)
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(server.run)
                auth = f"Bearer {token}" if token else None
                known = await _upgrade(bound.port, "/metrics", auth)
                assert known.startswith(b"HTTP/1.1 400 "), known
                assert known.endswith(b"\r\n\r\nno WebSocket here: GET /metrics as plain HTTP\n"), known
                unknown = await _upgrade(bound.port, "/ws", auth)
                assert unknown.startswith(b"HTTP/1.1 404 "), unknown
                if token:
                    refused = await _upgrade(bound.port, "/metrics")
                    assert refused.startswith(b"HTTP/1.1 401 "), refused
                    assert b"www-authenticate: Bearer" in refused, refused
                assert (await _upgrade(bound.port, "/healthz")).startswith(b"HTTP/1.1 400 ")
                nursery.cancel_scope.cancel()


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="the kernel's unacked send timeout is Linux's")
async def test_a_client_that_stops_reading_cannot_hold_the_endpoint_open() -> None:
    """hypercorn writes a response shielded from cancellation, with no timeout of its own: a client
    that never reads its responses would hold its connection, and the endpoint's stop, for ever. The
    kernel aborts such a connection once its sent bytes stay unacknowledged past the timeout."""
    sink = MetricsSink(MetricsConfig())
    server = DebugServer(Sources(), sink, load_config(GOOD, {}), "127.0.0.1:0", unacked_send_timeout_ms=300)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            bound = await nursery.start(server.run)
            await trio.to_thread.run_sync(stalled.connect, (bound.host, bound.port))
            # Far more response than the two sockets' buffers hold, and never read.
            await trio.to_thread.run_sync(stalled.sendall, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n" * 300)
            async with httpx.AsyncClient(base_url=f"http://{bound}", trust_env=False) as client:
                assert (await client.get("/healthz")).status_code == 200  # the others are still served
            nursery.cancel_scope.cancel()  # returns once the stalled connection is aborted
    stalled.close()


async def test_a_client_that_sends_an_http2_preface_and_nothing_more_is_closed() -> None:
    """The preface stops hypercorn's idle timer: without a read timeout such connections, which need
    no token, were held for ever, each an open descriptor of the router's process."""
    sink = MetricsSink(MetricsConfig())
    server = DebugServer(Sources(), sink, load_config(GOOD, {}), "127.0.0.1:0", read_timeout_s=1)
    silent = socket.socket()
    with trio.fail_after(60):  # a guard against a hang: the read timeout closes it after about 1 s
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            bound = await nursery.start(server.run)
            await trio.to_thread.run_sync(silent.connect, (bound.host, bound.port))
            preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
            await trio.to_thread.run_sync(silent.sendall, preface)

            def read_until_closed() -> None:
                while silent.recv(65536):
                    pass

            await trio.to_thread.run_sync(read_until_closed)  # returns when the server closes it
            nursery.cancel_scope.cancel()
    silent.close()


def test_bad_listen_address_is_rejected_before_serving() -> None:
    with pytest.raises(TargetError, match="HOST:PORT"):
        DebugServer(Sources(), MetricsSink(MetricsConfig()), load_config(GOOD, {}), "8080")


def test_to_jsonable() -> None:
    value = {
        Role.PREFILL: (1, 2.5, float("nan"), -math.inf),
        "set": frozenset({"b", "a"}),
        "bytes": b"\x01\xff",
        7: LeaderHealth("10.0.0.1:6381", Breaker.OPEN, 1.0),
    }
    out = to_jsonable(value)
    assert out == {
        "PREFILL": [1, 2.5, "nan", "-inf"],
        "set": ["a", "b"],
        "bytes": "01ff",
        "7": {"target": "10.0.0.1:6381", "breaker": "open", "next_attempt": 1.0},
    }
    json.dumps(out, allow_nan=False)


# --- /debug/decisions: bounded, and serialised in pieces ------------------------------------------


def _record(n: int, request_id: str | None = None) -> bytes:
    return pack_decision(replace(decision(n), request_id=request_id or f"r{n}"), 0.0)


async def test_decisions_are_serialised_in_pieces_with_routing_running_between() -> None:
    records = [_record(n) for n in range(1024)]
    ticks = 0
    done = False

    async def routing() -> None:  # stands for any other task of the routing thread
        nonlocal ticks
        while not done:
            await trio.lowlevel.checkpoint()
            ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(routing)
        await trio.lowlevel.checkpoint()
        before = ticks
        body = await decisions_body(records, 0.0, 1024, 64 * 1024 * 1024)
        during = ticks - before
        done = True
    parsed = json.loads(body)
    assert (parsed["count"], parsed["truncated"]) == (1024, False)
    assert [d["decision"]["request_id"] for d in parsed["decisions"][:2]] == ["r0", "r1"]
    # The other task ran between every two pieces: the serialisation never held the thread throughout.
    assert during >= 1024 // DECISIONS_PER_PIECE // 2


async def test_a_decisions_error_quoting_an_address_with_its_userinfo_is_redacted() -> None:
    """/debug/actors and /debug/config were redacted, /debug/decisions not: a scheduler's error quoting
    a configured address carried its password out."""
    quoted = replace(decision(1), error="10.9.0.1:7001: unavailable: connect to admin:s3cr3t@10.9.0.1:7001 refused")
    body = await decisions_body([pack_decision(quoted, 0.0)], 0.0, 1, 1 << 20)
    assert b"s3cr3t" not in body and b"<redacted>@10.9.0.1:7001" in body


def _each_dump_takes_a_millisecond(monkeypatch: pytest.MonkeyPatch, clock: trio.testing.MockClock) -> float:
    """Make serialising one decision (and the body's head) cost 1 ms of the trio clock; returns 1 ms."""
    real_dumps = json.dumps

    def costly_dumps(value: object, **kwargs: Any) -> str:
        clock.jump(0.001)
        return real_dumps(value, **kwargs)

    monkeypatch.setattr(json, "dumps", costly_dumps)  # what debug_http serialises each decision with
    return 0.001


async def test_the_decisions_body_rests_its_ratio_after_each_piece(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [_record(n) for n in range(2 * DECISIONS_PER_PIECE + 1)]
    ms = _each_dump_takes_a_millisecond(monkeypatch, autojump_clock)
    start = trio.current_time()
    body = await decisions_body(records, 0.0, len(records), 1 << 20)
    elapsed = trio.current_time() - start
    assert json.loads(body)["count"] == len(records)
    # Three pieces (8, 8 and 1 decisions) and the head: after each of the first two, a rest of
    # DEBUG_REST_RATIO times its work, so the endpoint holds its share of the routing thread.
    work = (len(records) + 1) * ms
    assert elapsed == pytest.approx(work + 2 * DECISIONS_PER_PIECE * ms * DEBUG_REST_RATIO)


async def test_concurrent_decisions_reads_take_turns(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One body at a time: two readers' pieces interleaved, one's rest would be the other's work, and
    together they would hold more than the paced share of the routing thread."""
    sink = MetricsSink(MetricsConfig())
    app = DebugApp(Sources(), sink, load_config(GOOD, {}))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for n in range(2 * DECISIONS_PER_PIECE + 1):
            sink.emit(DecisionMade(decision(n)))
        await trio.testing.wait_all_tasks_blocked()
        _each_dump_takes_a_millisecond(monkeypatch, autojump_clock)
        start = trio.current_time()
        status, body = await _get(app, "/debug/decisions")
        alone = trio.current_time() - start
        assert (status, json.loads(body)["count"]) == (200, 2 * DECISIONS_PER_PIECE + 1)
        start = trio.current_time()
        async with trio.open_nursery() as readers:
            for _ in range(2):
                readers.start_soon(_get, app, "/debug/decisions")
        together = trio.current_time() - start
        nursery.cancel_scope.cancel()
    assert together == pytest.approx(2 * alone)


async def test_decisions_are_json_and_openmetrics_2_is_served_as_asked() -> None:
    app = DebugApp(Sources(), MetricsSink(MetricsConfig()), load_config(GOOD, {}))
    status, _, headers = await _get_with_headers(app, "/debug/decisions")
    assert (status, headers[b"content-type"]) == (200, b"application/json")
    status, body, headers = await _get_with_headers(app, "/metrics", "application/openmetrics-text; version=2.0.0")
    assert status == 200 and body.endswith(b"# EOF\n")
    openmetrics_2 = b"application/openmetrics-text; version=2.0.0; charset=utf-8; escaping=underscores"
    assert headers[b"content-type"] == openmetrics_2


async def test_decisions_body_stops_at_its_byte_bound_and_says_so() -> None:
    records = [_record(n, request_id="x" * 200) for n in range(100)]
    body = await decisions_body(records, 0.0, 100, 8192)
    parsed = json.loads(body)
    assert parsed["truncated"] is True and 0 < parsed["count"] < 100
    assert len(body) <= 8192 + 100  # the bound, plus the envelope


async def test_a_huge_request_id_is_kept_cut_in_the_ring_and_served_bounded() -> None:
    sink = MetricsSink(MetricsConfig(decision_ring_size=4))
    with trio.fail_after(10):
        async with serving(Sources(), sink, load_config(GOOD, {})) as (client, _):
            for n in range(4):
                sink.emit(DecisionMade(replace(decision(n), request_id="i" * 4_000_000)))
            await trio.testing.wait_all_tasks_blocked()
            kept = [DecisionRecord.unpacked(packed) for packed in sink.recent_decisions(4)]
            assert all(len(r.decision.request_id) <= MetricsConfig().decision_text_chars for r in kept)
            response = await client.get("/debug/decisions", params={"limit": "1024"})
            assert response.status_code == 200
            assert len(response.content) < 16_000
            request_id = response.json()["decisions"][0]["decision"]["request_id"]
            assert request_id.startswith("iii") and request_id.endswith("[cut: 4000000 chars]")
