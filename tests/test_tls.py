"""TLS on every connection kvroute makes or accepts, against real servers on 127.0.0.1 with the real clock.

Certificates come from a throwaway CA made in each test (trustme). The sidecar's Route service with
TLS and with mTLS, kvroute's gRPC channels (ChannelPool credentials) to a simulated worker served over
TLS, and the master's HTTP client to an HTTPS server; each also fails the way it must without TLS.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import trio
import trustme

from actors.channel_pool import ChannelPool
from kvroute_sim.sim.grpc_server import serve_endpoint
from kvroute_sim.sim.worker import SimWorker
from router.api import open_router
from router.config import (
    ChannelPoolConfig,
    DiscoveryConfig,
    GrpcTlsConfig,
    KvrouteConfig,
    MasterConfig,
    RouterConfig,
    ServeConfig,
    UpstreamTlsConfig,
)
from router.settings import load_config
from router.sidecar import Sidecar
from router.targets import HostPort
from router.transport.clients import WorkerStatusClient
from router.transport.errors import Unavailable
from router.transport.grpc_adapter import GrpcRawRpc
from router.transport.master_http import HttpMasterTransport
from router.transport.tls import (
    MAX_PEM_BYTES,
    MAX_SYSTEM_CA_BYTES,
    channel_credentials,
    client_ssl_context,
    pem_file_problem,
    server_credentials,
    system_ca_bundle,
)
from router.wire import router_v1_pb2
from router.wire.paths import ROUTER_ROUTE
from tests.test_master_http_limits import http_server

TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all as PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed none of them


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("kvroute-client@example.test")

    def write(name: str, data: bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(data)
        return path

    return Pki(
        ca=write("ca.pem", ca.cert_pem.bytes()),
        server_cert=write("server.pem", b"".join(p.bytes() for p in server.cert_chain_pems)),
        server_key=write("server.key", server.private_key_pem.bytes()),
        client_cert=write("client.pem", b"".join(p.bytes() for p in client.cert_chain_pems)),
        client_key=write("client.key", client.private_key_pem.bytes()),
        other_ca=write("other-ca.pem", trustme.CA().cert_pem.bytes()),
    )


# ---- the sidecar's server ------------------------------------------------------------------------


@asynccontextmanager
async def sidecar(tls: GrpcTlsConfig) -> AsyncIterator[HostPort]:
    # Domain routing to a listed worker that does not exist: route blind, so a Route call is answered
    # without any peer.
    config = KvrouteConfig(
        router=RouterConfig(kvcm_fallback=False, budget_cap_ms=1000.0, route_blind=True),
        discovery=DiscoveryConfig(workers="127.0.0.1:18000"),
        serve=ServeConfig(grpc_listen="127.0.0.1:0"),
        grpc_tls=tls,
    )
    async with open_router(config) as handle, trio.open_nursery() as nursery:
        bound: HostPort = await nursery.start(Sidecar(handle, config).run)
        yield bound
        nursery.cancel_scope.cancel()


def route_once(channel: grpc.Channel) -> router_v1_pb2.RouteDecision | grpc.RpcError:
    """One blocking Route call (run on a thread): the decision, or the call's error."""
    call = channel.unary_unary(
        ROUTER_ROUTE,
        request_serializer=router_v1_pb2.RouteRequest.SerializeToString,
        response_deserializer=router_v1_pb2.RouteDecision.FromString,
    )
    try:
        reply: router_v1_pb2.RouteDecision = call(
            router_v1_pb2.RouteRequest(request_id="tls", token_ids=list(range(64))), timeout=TIMEOUT_S
        )
    except grpc.RpcError as exc:
        return exc
    return reply


def client_credentials(pki: Pki, *, with_cert: bool) -> grpc.ChannelCredentials:
    if not with_cert:
        return grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    return grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=pki.client_key.read_bytes(),
        certificate_chain=pki.client_cert.read_bytes(),
    )


async def call_with(target: HostPort, credentials: grpc.ChannelCredentials | None) -> object:
    def call() -> object:
        if credentials is None:
            channel = grpc.insecure_channel(str(target))
        else:
            channel = grpc.secure_channel(str(target), credentials)
        with channel:
            return route_once(channel)

    return await trio.to_thread.run_sync(call)


def assert_refused(outcome: object) -> None:
    assert isinstance(outcome, grpc.RpcError), f"expected the call to fail, got {outcome!r}"
    assert outcome.code() is grpc.StatusCode.UNAVAILABLE, outcome


async def test_sidecar_with_a_certificate_answers_tls_clients_and_refuses_plaintext(pki: Pki) -> None:
    with trio.fail_after(20):
        async with sidecar(GrpcTlsConfig(cert=str(pki.server_cert), key=str(pki.server_key))) as bound:
            answered = await call_with(bound, client_credentials(pki, with_cert=False))
            assert isinstance(answered, router_v1_pb2.RouteDecision), answered
            assert (answered.request_id, answered.http_port) == ("tls", 18000)
            assert_refused(await call_with(bound, None))


async def test_sidecar_with_a_client_ca_requires_a_client_certificate(pki: Pki) -> None:
    tls = GrpcTlsConfig(cert=str(pki.server_cert), key=str(pki.server_key), client_ca=str(pki.ca))
    with trio.fail_after(20):
        async with sidecar(tls) as bound:
            answered = await call_with(bound, client_credentials(pki, with_cert=True))
            assert isinstance(answered, router_v1_pb2.RouteDecision), answered
            assert_refused(await call_with(bound, client_credentials(pki, with_cert=False)))
            assert_refused(await call_with(bound, None))


async def test_sidecar_without_tls_settings_stays_plaintext(pki: Pki) -> None:
    with trio.fail_after(20):
        async with sidecar(GrpcTlsConfig()) as bound:
            answered = await call_with(bound, None)
            assert isinstance(answered, router_v1_pb2.RouteDecision), answered
            assert_refused(await call_with(bound, client_credentials(pki, with_cert=False)))


def test_server_credentials_name_the_setting_of_a_missing_file(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"^grpc_tls\.cert: .*nope\.pem: cannot read the file"):
        server_credentials(GrpcTlsConfig(cert=str(tmp_path / "nope.pem"), key=str(pki.server_key)))
    # A key's path is a secret's: named by its setting only.
    with pytest.raises(OSError, match=r"^grpc_tls\.key: cannot read the file") as refused:
        server_credentials(GrpcTlsConfig(cert=str(pki.server_cert), key=str(tmp_path / "hidden.key")))
    assert "hidden" not in str(refused.value)


# ---- kvroute's gRPC channels ---------------------------------------------------------------------


@asynccontextmanager
async def tls_worker(pki: Pki, *, client_ca: bool = False) -> AsyncIterator[str]:
    """A SimWorker served over TLS; yields its status target."""
    ca = pki.ca.read_bytes() if client_ca else None
    credentials = grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            functools.partial(serve_endpoint, SimWorker("tls-worker"), credentials=credentials)
        )
        yield server.target
        nursery.cancel_scope.cancel()


async def probe_through_pool(target: str, upstream: UpstreamTlsConfig) -> object:
    """One GetWorkerStatus through a ChannelPool built as the supervisor builds it; the status or the error."""
    credentials = await trio.to_thread.run_sync(channel_credentials, upstream)
    pool = ChannelPool(ChannelPoolConfig(), credentials=credentials)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        try:
            with trio.fail_after(TIMEOUT_S):
                return await WorkerStatusClient(GrpcRawRpc(pool, start_off_loop=True)).get_worker_status(target, 0)
        except Unavailable as exc:
            return exc
        finally:
            await pool.aclose()
            nursery.cancel_scope.cancel()


async def test_upstream_channels_reach_a_tls_server_with_the_ca_and_fail_without(pki: Pki) -> None:
    with trio.fail_after(20):
        async with tls_worker(pki) as target:
            status = await probe_through_pool(target, UpstreamTlsConfig(ca=str(pki.ca)))
            assert not isinstance(status, Exception), status
            assert isinstance(await probe_through_pool(target, UpstreamTlsConfig()), Unavailable)
            # TLS, but the server's certificate is not signed by the CA given.
            assert isinstance(await probe_through_pool(target, UpstreamTlsConfig(ca=str(pki.other_ca))), Unavailable)


async def test_upstream_client_certificate_is_presented_to_a_server_that_requires_one(pki: Pki) -> None:
    with trio.fail_after(20):
        async with tls_worker(pki, client_ca=True) as target:
            with_cert = UpstreamTlsConfig(ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key))
            status = await probe_through_pool(target, with_cert)
            assert not isinstance(status, Exception), status
            assert isinstance(await probe_through_pool(target, UpstreamTlsConfig(ca=str(pki.ca))), Unavailable)


# ---- the master's HTTP client ----------------------------------------------------------------------


# A scheduler stand-in: every request is answered with a master/info naming no master yet (queue 7).
INFO_BODY = b'{"success": true, "code": 200, "real_master_host": null, "queue_length": 7}'


async def test_master_http_client_speaks_https_with_the_ca_and_fails_without(pki: Pki) -> None:
    with trio.fail_after(20):
        async with http_server(INFO_BODY, tls=(str(pki.server_cert), str(pki.server_key))) as host:
            context = client_ssl_context(UpstreamTlsConfig(ca=str(pki.ca)))
            async with HttpMasterTransport(MasterConfig(), context) as tls:
                info = await tls.master_info(host)
            assert (info.real_master_host, info.queue_length) == (None, 7)  # the reply came through TLS
            async with HttpMasterTransport(MasterConfig()) as plain:
                with pytest.raises(Unavailable):
                    await plain.master_info(host)
            wrong = client_ssl_context(UpstreamTlsConfig(ca=str(pki.other_ca)))
            async with HttpMasterTransport(MasterConfig(), wrong) as untrusted:
                with pytest.raises(Unavailable) as refused:  # the server answers others: this is the handshake
                    await untrusted.master_info(host)
            # The operator is told why: under trio httpx's error has no text, the handshake's is its cause.
            assert "certificate" in refused.value.detail.lower(), refused.value.detail


def test_the_https_clients_context_presents_its_client_certificate(pki: Pki) -> None:
    """To a scheduler that requires one (the gRPC channels' own test is above)."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(pki.server_cert, pki.server_key)
    server.load_verify_locations(pki.ca)
    server.verify_mode = ssl.CERT_REQUIRED
    seen: list[object] = []  # the client's certificate as the server checked it, or why it refused
    context = client_ssl_context(UpstreamTlsConfig(ca=str(pki.ca), cert=str(pki.client_cert), key=str(pki.client_key)))
    assert context is not None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(TIMEOUT_S)

        def accept_one() -> None:
            try:
                connection, _ = listener.accept()
                with server.wrap_socket(connection, server_side=True) as tls:
                    seen.append(tls.getpeercert())
            except OSError as exc:  # ssl.SSLError among them
                seen.append(exc)

        thread = threading.Thread(target=accept_one)
        thread.start()
        try:
            with (
                socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1"),
            ):
                pass
        finally:
            thread.join(TIMEOUT_S)
    assert len(seen) == 1 and isinstance(seen[0], dict) and seen[0], seen


# ---- the files' bounds ------------------------------------------------------------------------------


def test_a_pem_file_past_its_bound_is_refused_and_named(pki: Pki, tmp_path: Path) -> None:
    big = tmp_path / "big.pem"
    big.write_bytes(pki.ca.read_bytes() + b"\n" * MAX_PEM_BYTES)
    assert pem_file_problem(str(big)) == f"larger than {MAX_PEM_BYTES} bytes: not a PEM file"
    errors = [str(problem) for problem in load_config({"upstream_tls_ca": str(big)}, {}).errors]
    assert any("larger than" in error and "--upstream-tls-ca" in error for error in errors), errors


def test_a_ca_bundle_as_large_as_a_systems_is_accepted(tmp_path: Path) -> None:
    """Every public root is some hundred kilobytes of PEM: within the bound."""
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(b"".join(trustme.CA().cert_pem.bytes() for _ in range(400)))
    assert bundle.stat().st_size > 200_000
    assert pem_file_problem(str(bundle)) is None
    settings = {"workers": "10.0.0.1:80", "kvcm_fallback": "false", "upstream_tls_ca": str(bundle)}
    assert load_config(settings, {}).errors == ()


# ---- no CA given: the system's bundle, for both ----------------------------------------------------


async def test_without_a_ca_the_channels_and_the_https_client_trust_the_same_system_bundle(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The system's bundle is OpenSSL's default file, here named by the environment: the throwaway CA.
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
    upstream = UpstreamTlsConfig(cert=str(pki.client_cert), key=str(pki.client_key))  # TLS, and no CA given
    with trio.fail_after(20):
        async with tls_worker(pki) as target:
            status = await probe_through_pool(target, upstream)
            assert not isinstance(status, Exception), status
        async with http_server(INFO_BODY, tls=(str(pki.server_cert), str(pki.server_key))) as host:
            async with HttpMasterTransport(MasterConfig(), client_ssl_context(upstream)) as client:
                info = await client.master_info(host)
            assert info.queue_length == 7


async def test_without_a_readable_system_bundle_the_channels_fall_back_to_grpcs_roots(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "missing.pem"))
    with caplog.at_level(logging.WARNING, logger="router.transport.tls"):
        assert system_ca_bundle() is None
    assert "the gRPC channels check servers against grpc's own roots" in caplog.text
    assert str(tmp_path / "missing.pem") in caplog.text  # the file looked for, not OpenSSL's built-in one
    upstream = UpstreamTlsConfig(cert=str(pki.client_cert), key=str(pki.client_key))
    with trio.fail_after(20):
        async with tls_worker(pki) as target:
            # Credentials all the same; grpc's default roots do not hold the throwaway CA.
            assert isinstance(await probe_through_pool(target, upstream), Unavailable)


def test_a_system_bundle_past_its_bound_or_a_certificate_directory_is_said_not_silently_dropped(
    pki: Pki, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bundle over the bound fell back to grpc's roots unsaid; a directory of certificates, which the
    HTTPS client trusts, is not grpc's to take: both are logged."""
    big = tmp_path / "big.pem"
    big.write_bytes(pki.ca.read_bytes() + b"\n" * MAX_SYSTEM_CA_BYTES)
    monkeypatch.setenv("SSL_CERT_FILE", str(big))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="router.transport.tls"):
        assert system_ca_bundle() is None
    assert f"larger than {MAX_SYSTEM_CA_BYTES} bytes" in caplog.text
    assert "SSL_CERT_DIR=" in caplog.text and "HTTPS scheduler's only" in caplog.text
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
    assert system_ca_bundle() == pki.ca.read_bytes()
