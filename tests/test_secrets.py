"""Secrets stay secret: credentials in addresses, TLS key paths and tokens never reach a reader, and the
debug endpoint's bearer token. The endpoint runs on a real hypercorn server on 127.0.0.1:0."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest
import trio
import trustme
from cryptography.hazmat.primitives import serialization

from actors.metrics_sink import MetricsSink
from router.check_config_cli import render
from router.config import MetricsConfig
from router.debug_http import DebugServer
from router.logs import setup_logging
from router.settings import BY_NAME, SETTINGS, LoadedConfig, assess, load_config, log_startup_report
from router.targets import redact_userinfo

SECRET = "s3cr3t"
# A credential in an address: the KVCM fallback's settings refuse it, and kvroute starts without them.
LEAKY = {"kvcm_bootstrap": f"admin:{SECRET}@127.0.0.1:1", "kvcm_instance_id": "ns", "workers": "10.1.0.1:8000"}
TOKEN = "debug-token-0123456789"


class Sources:
    def __init__(self, why: str = "leader known") -> None:
        self.why = why

    def ready(self) -> tuple[bool, str]:
        return True, self.why

    def actors(self) -> Mapping[str, Mapping[str, object]]:
        return {"discovery": {"state": "running", "last_error": f"bad entry 'ops:{SECRET}@10.0.0.9:80'"}}


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("admin:s3cr3t@127.0.0.1:1", "<redacted>@127.0.0.1:1"),
        ("http://u:p@h:80/x", "http://<redacted>@h:80/x"),
        ("--workers=a:b@h:1,c:d@[::1]:2", "--workers=<redacted>@h:1,<redacted>@[::1]:2"),
        (
            "bad port 's3cr3t@127.0.0.1:1' in target 'admin:s3cr3t@127.0.0.1:1'",
            "bad port '<redacted>@127.0.0.1:1' in target '<redacted>@127.0.0.1:1'",
        ),
        ('{"k": "admin:pw@h"}', '{"k": "<redacted>@h"}'),
        ("10.0.0.1:80, no credentials", "10.0.0.1:80, no credentials"),
        # A password may hold any of RFC 3986's sub-delimiters, and ':'.
        ("admin:pa;ss@10.0.0.1:80", "<redacted>@10.0.0.1:80"),
        ("admin:p(ss)@10.0.0.1:80", "<redacted>@10.0.0.1:80"),
        ("target 'admin:Tr0ub4dor&3;x=,y@h:1'", "target '<redacted>@h:1'"),
        ("http://admin:pa'ss:x@h:80/x", "http://<redacted>@h:80/x"),
        ("user@[::1]:80,v:w@h2:1", "<redacted>@[::1]:80,<redacted>@h2:1"),
    ],
)
def test_redact_userinfo(text: str, shown: str) -> None:
    assert redact_userinfo(text) == shown


def test_redact_userinfo_takes_time_linear_in_the_text() -> None:
    """Each '@' looks back only as far as the previous one: a long text of list items and colons is
    one pass, however its '@'s fall (a scan from every start would take hours on these). Run in a
    process of its own under a bound many times one pass, so a regression fails rather than hangs."""
    program = (
        "from router.targets import redact_userinfo\n"
        "for text in (('a:,' * 200_000) + '@h', '@a:' * 200_000, 'a' * 400_000 + '@h'):\n"
        "    assert redact_userinfo(text).endswith(('@h', '@a:'))\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, timeout=120)


def test_tls_keys_and_tokens_are_secret_and_certificates_are_not() -> None:
    secret = {s.name for s in SETTINGS if s.secret}
    assert {"grpc_tls_key", "upstream_tls_key", "debug_token", "debug_token_file"} <= secret
    assert not {"grpc_tls_cert", "grpc_tls_client_ca", "upstream_tls_ca", "upstream_tls_cert"} & secret
    assert BY_NAME["upstream_tls_key"].flag == "--upstream-tls-key"
    assert BY_NAME["upstream_tls_key"].env == "KVROUTE_UPSTREAM_TLS_KEY"
    assert BY_NAME["grpc_tls_client_ca"].toml_key == "grpc_tls.client_ca"


def test_check_config_shows_no_credential_key_path_or_token(tmp_path: Path) -> None:
    key = tmp_path / "very-private.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    cert = tmp_path / "server.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    loaded = load_config({**LEAKY, "grpc_tls_cert": str(cert), "grpc_tls_key": str(key), "debug_token": TOKEN}, {})
    report = render(loaded, assess(loaded))
    assert SECRET not in report and "very-private" not in report and TOKEN not in report
    assert "<redacted>@127.0.0.1:1" in report


def test_a_token_given_as_another_type_is_refused_without_repeating_it(tmp_path: Path) -> None:
    """A token written as a TOML number (or list) is still the token: the refusal names its type."""
    for value in ("918273645546372819", '["s3cr3t-tok3n"]'):
        config = tmp_path / "kvroute.toml"
        config.write_text(f"[serve]\ndebug_token = {value}\n")
        loaded = load_config({**LEAKY, "config": str(config)}, {})
        problems = [str(p) for p in loaded.errors if "debug-token" in str(p)]
        assert problems and "expected a string" in problems[0]
        shown = value.strip('[]"')
        assert all(shown not in p for p in problems) and shown not in render(loaded, assess(loaded))


def test_the_log_shows_no_credential() -> None:
    stream = io.StringIO()
    handler = setup_logging("INFO", "text", stream)
    try:
        log_startup_report(load_config(LEAKY, {}), logging.getLogger("kvroute.test"))
        logging.getLogger("kvroute.test").warning("peer %s failed", f"ops:{SECRET}@10.0.0.9:80")
    finally:
        logging.getLogger().removeHandler(handler)
    text = stream.getvalue()
    assert "KVCM fallback disabled" in text and "<redacted>@" in text
    assert SECRET not in text


async def get_all(
    loaded: LoadedConfig, sources: Sources, paths: list[str], headers: dict[str, str] | None = None, **auth: str
) -> dict[str, httpx.Response]:
    sink = MetricsSink(MetricsConfig())
    server = DebugServer(
        sources, sink, loaded, "127.0.0.1:0", token=auth.get("token", ""), token_file=auth.get("token_file", "")
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        bound = await nursery.start(server.run)
        async with httpx.AsyncClient(base_url=f"http://{bound}", trust_env=False, headers=headers) as client:
            answers = {path: await client.get(path) for path in paths}
        nursery.cancel_scope.cancel()
    return answers


async def test_debug_endpoint_shows_no_credential() -> None:
    loaded = load_config({**LEAKY, "debug_token": TOKEN}, {})
    assert loaded.fallback_disabled_by_errors  # the bootstrap entry was refused, quoting it
    with trio.fail_after(10):
        answers = await get_all(
            loaded,
            Sources(f"no KVCM leader (last error: {LEAKY['kvcm_bootstrap']} unreachable)"),
            ["/readyz", "/debug/config", "/debug/actors"],
            {"authorization": f"Bearer {TOKEN}"},
            token=TOKEN,
        )
    for path, answer in answers.items():
        assert answer.status_code in (200, 503), (path, answer.text)
        assert SECRET not in answer.text and TOKEN not in answer.text, path
        assert "<redacted>@" in answer.text, path
    config = answers["/debug/config"].json()
    assert any("'<redacted>@127.0.0.1:1'" in error for error in config["errors"])
    assert config["effective"]["serve"]["debug_token"] == "<redacted>"


ALL_PATHS = ["/healthz", "/readyz", "/metrics", "/debug/actors", "/debug/decisions", "/debug/config", "/nowhere"]


async def test_without_a_token_every_path_is_open() -> None:
    with trio.fail_after(10):
        answers = await get_all(load_config({}, {}), Sources(), ALL_PATHS)
    assert {path: a.status_code for path, a in answers.items()} == {
        **dict.fromkeys(ALL_PATHS, 200),
        "/nowhere": 404,
    }


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer", f"bearer{TOKEN}"],
)
@pytest.mark.parametrize("given", ["token", "token_file"])
async def test_with_a_token_every_path_but_healthz_needs_it(
    authorization: str | None, given: str, tmp_path: Path
) -> None:
    # A token from --debug-token-file is required as much as one given inline: a file never read would
    # leave the endpoint open while the deployment believes it closed.
    headers = {} if authorization is None else {"authorization": authorization}
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    auth = {"token": TOKEN} if given == "token" else {"token_file": str(token_file)}
    with trio.fail_after(10):
        answers = await get_all(load_config({}, {}), Sources(), ALL_PATHS, headers, **auth)
    assert answers["/healthz"].status_code == 200
    for path in ALL_PATHS[1:]:
        assert answers[path].status_code == 401, path
        assert answers[path].headers["www-authenticate"].startswith("Bearer")
        assert TOKEN not in answers[path].text


async def test_the_right_token_opens_every_path_and_may_come_from_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    with trio.fail_after(10):
        given = await get_all(
            load_config({}, {}), Sources(), ALL_PATHS, {"authorization": f"Bearer {TOKEN}"}, token=TOKEN
        )
        from_file = await get_all(
            load_config({}, {}), Sources(), ALL_PATHS, {"authorization": f"bearer {TOKEN}"}, token_file=str(token_file)
        )
    for answers in (given, from_file):
        assert {path: a.status_code for path, a in answers.items()} == {
            **dict.fromkeys(ALL_PATHS, 200),
            "/nowhere": 404,
        }


# ---- validation: the same for check-config and serve ----------------------------------------------


def _errors(loaded: LoadedConfig) -> list[str]:
    return [str(p) for p in loaded.errors]


@pytest.fixture
def pems(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    paths = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem"}
    paths["ca"].write_bytes(ca.cert_pem.bytes())
    paths["cert"].write_bytes(leaf.cert_chain_pems[0].bytes())
    paths["key"].write_bytes(leaf.private_key_pem.bytes())
    (tmp_path / "not.pem").write_text("hello\n")
    (tmp_path / "other.key").write_bytes(ca.issue_cert("127.0.0.2").private_key_pem.bytes())  # another leaf's key
    # The leaf's own key behind a passphrase (an empty one decrypts with "": still refused).
    key = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), password=None)
    (tmp_path / "locked.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")
        )
    )
    return {name: str(path) for name, path in paths.items()} | {
        "other_key": str(tmp_path / "other.key"),
        "locked_key": str(tmp_path / "locked.key"),
        "garbage": str(tmp_path / "not.pem"),
        "missing": str(tmp_path / "missing.pem"),
    }


def test_valid_tls_settings_have_no_problem(pems: dict[str, str]) -> None:
    loaded = load_config(
        {
            "grpc_tls_cert": pems["cert"],
            "grpc_tls_key": pems["key"],
            "grpc_tls_client_ca": pems["ca"],
            "upstream_tls_ca": pems["ca"],
            "upstream_tls_cert": pems["cert"],
            "upstream_tls_key": pems["key"],
        },
        {},
    )
    assert [e for e in _errors(loaded) if "tls" in e] == []


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            {"grpc_tls_key": "key"},
            "--grpc-tls-key (KVROUTE_GRPC_TLS_KEY) / --grpc-tls-cert (KVROUTE_GRPC_TLS_CERT): "
            "a private key without its certificate",
        ),
        (
            {"grpc_tls_cert": "cert"},
            "--grpc-tls-cert (KVROUTE_GRPC_TLS_CERT) / --grpc-tls-key (KVROUTE_GRPC_TLS_KEY): "
            "a certificate without its private key",
        ),
        ({"grpc_tls_client_ca": "ca"}, "--grpc-tls-client-ca (KVROUTE_GRPC_TLS_CLIENT_CA) / --grpc-tls-cert"),
        ({"upstream_tls_key": "key"}, "--upstream-tls-key (KVROUTE_UPSTREAM_TLS_KEY) / --upstream-tls-cert"),
        (
            {"upstream_tls_ca": "missing"},
            "--upstream-tls-ca (KVROUTE_UPSTREAM_TLS_CA): {missing}: cannot read the file",
        ),
        ({"upstream_tls_ca": "garbage"}, "--upstream-tls-ca (KVROUTE_UPSTREAM_TLS_CA): {garbage}: not a PEM file"),
        (
            {"grpc_tls_cert": "cert", "grpc_tls_key": "missing"},
            "--grpc-tls-key (KVROUTE_GRPC_TLS_KEY): cannot read the file",
        ),
        (
            {"grpc_tls_cert": "cert", "grpc_tls_key": "other_key"},
            "--grpc-tls-cert (KVROUTE_GRPC_TLS_CERT) / --grpc-tls-key (KVROUTE_GRPC_TLS_KEY): "
            "the certificate and key cannot be used together",
        ),
        (
            {"grpc_tls_cert": "key", "grpc_tls_key": "cert"},  # swapped
            "--grpc-tls-cert (KVROUTE_GRPC_TLS_CERT) / --grpc-tls-key (KVROUTE_GRPC_TLS_KEY): "
            "the certificate and key cannot be used together",
        ),
        (
            {"grpc_tls_cert": "cert", "grpc_tls_key": "key", "grpc_tls_client_ca": "key"},
            "--grpc-tls-client-ca (KVROUTE_GRPC_TLS_CLIENT_CA): {key}: not a bundle of CA certificates",
        ),
        (
            {"upstream_tls_cert": "cert", "upstream_tls_key": "other_key"},
            "--upstream-tls-cert (KVROUTE_UPSTREAM_TLS_CERT) / --upstream-tls-key (KVROUTE_UPSTREAM_TLS_KEY): "
            "the certificate and key cannot be used together",
        ),
        ({"upstream_tls_ca": "key"}, "--upstream-tls-ca (KVROUTE_UPSTREAM_TLS_CA): {key}: not a bundle of CA"),
        (
            {"upstream_tls_cert": "cert", "upstream_tls_key": "locked_key"},
            "--upstream-tls-cert (KVROUTE_UPSTREAM_TLS_CERT) / --upstream-tls-key (KVROUTE_UPSTREAM_TLS_KEY): "
            "the key is passphrase-protected",
        ),
        ({"debug_token_file": "missing"}, "--debug-token-file (KVROUTE_DEBUG_TOKEN_FILE): cannot read the file"),
        ({"debug_token": "has space"}, "--debug-token (KVROUTE_DEBUG_TOKEN): must be printable ASCII without spaces"),
        ({"debug_token": "x", "debug_token_file": "ca"}, "--debug-token (KVROUTE_DEBUG_TOKEN) / --debug-token-file"),
    ],
)
def test_tls_and_token_problems_name_the_flag_and_stop_serve(
    pems: dict[str, str], flags: dict[str, str], expected: str
) -> None:
    given = {name: pems.get(value, value) for name, value in flags.items()}
    loaded = load_config(given, {})
    errors = _errors(loaded)
    assert any(e.startswith(expected.format(**pems)) for e in errors), errors
    assert loaded.fatal_errors  # a broken TLS or token setting never falls back to plaintext or no token
    assert "has space" not in json.dumps(errors)  # a token is never quoted


def test_check_config_warns_when_route_grpc_listens_beyond_loopback_without_tls(pems: dict[str, str]) -> None:
    wide = assess(load_config({"grpc_listen": "0.0.0.0:50051"}, {}))
    assert any("not loopback, without TLS" in line for line in wide.will_not_work)
    with_tls = assess(
        load_config({"grpc_listen": "0.0.0.0:50051", "grpc_tls_cert": pems["cert"], "grpc_tls_key": pems["key"]}, {})
    )
    assert not any("without TLS" in line for line in with_tls.will_not_work)
    assert any("Route gRPC uses TLS" in line for line in with_tls.works)
    loopback = assess(load_config({}, {}))
    assert not any("without TLS" in line for line in loopback.will_not_work)
    debug_wide = assess(load_config({"debug_listen": "0.0.0.0:9090"}, {}))
    assert any("without --debug-token" in line for line in debug_wide.will_not_work)
    debug_token = assess(load_config({"debug_listen": "0.0.0.0:9090", "debug_token": TOKEN}, {}))
    assert not any("debug HTTP binds" in line for line in debug_token.will_not_work)
