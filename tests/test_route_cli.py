"""``kvroute route`` and ``kvroute explain`` as subprocesses against ``kvroute sim-cluster`` in a subprocess.

The cluster prints one JSON line with its addresses and the seeded prefixes (token ids are
``first_token .. first_token + tokens - 1``; block keys in the default family); the commands are
pointed at it with the operator flags.
"""

from __future__ import annotations

import json
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router import route_cli
from router.cli import build_parser, main
from router.route_cli import InputError, flag_of, parse_ints, request_from_args
from router.wire import router_v1_pb2

CLI = [sys.executable, "-P", "-m", "router.cli"]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    command = [*CLI, "sim-cluster", "--workers", "4", "--kvcm-replicas", "2", "--groups", "2", "--print-json"]
    proc = subprocess.Popen([*command, "--duration", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            assert selector.select(30), "sim-cluster printed nothing in time"
        document: dict[str, Any] = json.loads(proc.stdout.readline())
        yield document
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def _operator_flags(document: dict[str, Any]) -> list[str]:
    return [
        "--kvcm-bootstrap",
        ",".join(document["kvcm_bootstrap"]),
        "--workers",
        ",".join(w["host_ip_port"] for w in document["workers"]),
        "--kvcm-instance-id",
        "test",
    ]


# A generous budget for the commands that must print KVCM's answer: a cold subprocess on a loaded
# machine would miss the default 50 ms cap (or be shed by admission) and fall back; what is checked is
# what the command prints, not how fast it decides.
GENEROUS_BUDGET = ["--budget-ms", "2000", "--budget-cap-ms", "2000"]


def _tokens(prefix: dict[str, Any]) -> str:
    return ",".join(str(prefix["first_token"] + i) for i in range(prefix["tokens"]))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def test_route_json_prints_the_kvcm_decision_for_a_seeded_prefix(cluster: dict[str, Any]) -> None:
    prefix = cluster["seeded_prefixes"][0]
    flags = [*_operator_flags(cluster), *GENEROUS_BUDGET]
    result = _run("route", *flags, "--tokens", _tokens(prefix), "--request-id", "r1", "--json")
    assert result.returncode == 0, result.stderr
    decision = json.loads(result.stdout)
    proto_fields = {f.name for f in router_v1_pb2.RouteDecision.DESCRIPTOR.fields}
    assert proto_fields | {"stage_ms", "error", "candidates", "sources", "split", "windows"} == set(decision)
    assert [s["source"] for s in decision["sources"]] == ["kvcm"] and decision["sources"][0]["outcome"] == "answered"
    assert (decision["request_id"], decision["route_source"], decision["reason"]) == ("r1", "kvcm", "CACHE_LEADER")
    assert f"{decision['ip']}:{decision['http_port']}" in prefix["workers"]
    assert decision["grpc_port"] == decision["http_port"] + 1
    assert (decision["local_blocks"], decision["hit_tokens"]) == (len(prefix["block_keys"]), prefix["tokens"])
    assert decision["error"] is None
    chosen = [c for c in decision["candidates"] if c["chosen"]]
    assert [c["target"] for c in chosen] == [f"{decision['ip']}:{decision['http_port']}"]
    # Every seeded holder was a hot candidate with the whole prefix cached.
    hot = {c["target"]: c["local_blocks"] for c in decision["candidates"] if c["source"] == "hot"}
    assert hot == dict.fromkeys(prefix["workers"], len(prefix["block_keys"]))
    assert "cache_query" in [w["stage"] for w in decision["windows"]]  # the deadline split's wait for KVCM


def test_route_by_keys_file_and_plain_output(cluster: dict[str, Any], tmp_path: Path) -> None:
    prefix = cluster["seeded_prefixes"][1]
    keys = ",".join(str(k) for k in prefix["block_keys"])
    result = _run("route", *_operator_flags(cluster), *GENEROUS_BUDGET, "--keys", keys)
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith("kvroute-cli: kvcm CACHE_LEADER -> ")
    assert line.split(" -> ")[1].split(" ")[0] in prefix["workers"]

    tokens_file = tmp_path / "prompt.txt"
    tokens_file.write_text(_tokens(prefix).replace(",", "\n"))
    result = _run("route", *_operator_flags(cluster), *GENEROUS_BUDGET, "--tokens-file", str(tokens_file), "--json")
    assert result.returncode == 0, result.stderr
    assert f"{json.loads(result.stdout)['ip']}:{json.loads(result.stdout)['http_port']}" in prefix["workers"]


def test_explain_prints_every_candidate_and_why(cluster: dict[str, Any]) -> None:
    prefix = cluster["seeded_prefixes"][0]
    result = _run("explain", *_operator_flags(cluster), *GENEROUS_BUDGET, "--tokens", _tokens(prefix))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("request kvroute-cli: kvcm / CACHE_LEADER -> ")
    # The default fixed split: each wait the request ran, with its end.
    split = next(line for line in lines if line.startswith("split: "))
    assert split.startswith("split: fixed: ") and "cache_query until " in split and "probe until " in split
    header = next(i for i, line in enumerate(lines) if line.startswith("worker"))
    assert lines[header].split() == ["worker", "from", "role", "blocks", "hit", "work", "outcome"]
    rows = {line.split()[0]: line for line in lines[header + 1 :]}
    winners = [target for target, row in rows.items() if "WON: CACHE_LEADER" in row]
    assert len(winners) == 1 and winners[0] in prefix["workers"]
    for holder in prefix["workers"]:
        assert rows[holder].split()[1:5] == ["hot", "PREFILL", str(len(prefix["block_keys"])), str(prefix["tokens"])]
    # The cold picks hold nothing of the prefix and lose on hit.
    cold = [row for row in rows.values() if row.split()[1] == "cold"]
    assert cold and all("lost: smaller hit (0 <" in row for row in cold)


def test_bad_input_and_fatal_configuration_exit_2_naming_the_flag() -> None:
    result = _run("route", "--workers", "127.0.0.1:9", "--kvcm-fallback", "false", "--tokens", "1,two,3")
    assert result.returncode == 2
    assert "--tokens: entry 2 ('two') is not an integer" in result.stderr
    result = _run("explain", "--budget-cap-ms", "-5", "--grpc-listen", "nowhere", "--keys", "1")
    assert result.returncode == 2
    assert "--budget-cap-ms" in result.stderr and "--grpc-listen" in result.stderr
    assert result.stdout == ""


def test_a_token_file_that_is_not_text_and_an_endless_warm_up_exit_2_naming_the_flag(tmp_path: Path) -> None:
    binary = tmp_path / "tokens.bin"
    binary.write_bytes(b"\xff\xfe1,2")
    base = ("route", "--workers", "127.0.0.1:9", "--kvcm-fallback", "false")
    result = _run(*base, "--tokens-file", str(binary))
    assert result.returncode == 2 and "--tokens-file" in result.stderr and "not UTF-8" in result.stderr
    for warmup in ("nan", "1e12", "-1"):
        result = _run(*base, "--tokens", "1,2", "--warmup-ms", warmup)
        assert result.returncode == 2 and "--warmup-ms" in result.stderr, (warmup, result.stderr)


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    [
        ("route", ["--tokens", "1,2,3", "--seq-len", "5"], "--seq-len: 5 differs from the 3 token ids given"),
        ("route", ["--tokens", "1,2,3", "--budget-ms", "nan"], "--budget-ms: must be finite and not negative"),
        ("explain", ["--tokens", "1,2,3", "--request-id", " "], "--request-id: must not be blank"),
        ("route", ["--tokens", f"1,{2**64}"], "--tokens: every token id must be a 64-bit integer"),
        ("explain", ["--keys", "1,2", "--seq-len", "3"], "--seq-len: 3 is shorter than the 128 tokens"),
    ],
)
def test_a_request_the_router_would_refuse_exits_2_naming_the_flag_before_anything_starts(
    command: str, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The request was checked only by the router, once it had started and warmed up against the
    bootstrap, and the error named the request's field, not the flag."""
    with socket.create_server(("127.0.0.1", 0)) as hung_kvcm:  # accepts connections, never answers
        host, port = hung_kvcm.getsockname()
        argv = [
            command,
            *("--kvcm-bootstrap", f"{host}:{port}", "--workers", "127.0.0.1:9", "--kvcm-instance-id", "x"),
            *("--block-size", "64", "--warmup-ms", "600000"),  # a warm-up the test would not outlive
            *flags,
        ]
        exit_codes: list[int] = []
        thread = threading.Thread(target=lambda: exit_codes.append(main(argv)), daemon=True)
        thread.start()
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "the command is still warming up against the hung KVCM"
        assert exit_codes == [2]
        assert select.select([hung_kvcm], [], [], 0)[0] == [], "a router connected to the bootstrap"
    err = capsys.readouterr().err
    assert f"kvroute {command}: {message}" in err, err


def test_a_token_id_the_key_family_cannot_hash_exits_2_naming_the_flag_once() -> None:
    """Found only by the routing's hashing (any 64-bit id passes the checks before it): the message
    named the field twice, "--tokens: tokens: token id ..."."""
    result = _run(
        "route",
        *("--kvcm-bootstrap", "127.0.0.1:9", "--kvcm-instance-id", "x", "--workers", "127.0.0.1:9"),
        *("--key-family", "sglang", "--block-size", "4", "--tokens", "1,2,3,-1", "--warmup-ms", "0"),
    )
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("kvroute route: bad request: ")]
    assert line.startswith("kvroute route: bad request: --tokens: token id -1 is not a uint32"), line


def test_a_token_file_longer_than_the_bound_is_refused_naming_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(route_cli, "TOKENS_FILE_MAX_CHARS", 16)
    tokens_file = tmp_path / "prompt.txt"
    tokens_file.write_text("1," * 8)  # 16 characters: at the bound
    args = build_parser("route").parse_args(["route", "--tokens-file", str(tokens_file)])
    assert request_from_args(args).token_ids == (1,) * 8
    tokens_file.write_text("1," * 20)
    with pytest.raises(InputError, match=f"^--tokens-file: {tokens_file} is longer than 16 characters$"):
        request_from_args(args)


def test_token_ids_may_be_given_in_brackets() -> None:
    assert parse_ints("[1, 2, 3]", "--tokens") == (1, 2, 3)
    assert parse_ints(" [4 5]\n", "--tokens") == (4, 5)


def test_token_ids_are_decimal_as_every_integer_flag_is() -> None:
    assert parse_ints("010, -7", "--tokens") == (10, -7)
    with pytest.raises(InputError, match=r"^--tokens: entry 2 \(.0x10.\) is not an integer$"):
        parse_ints("1 0x10", "--tokens")


def test_the_token_ids_field_is_named_by_the_flag_that_gave_it() -> None:
    by_file = build_parser("route").parse_args(["route", "--tokens-file", "prompt.txt"])
    assert flag_of("token_ids", by_file) == "--tokens-file"
    by_flag = build_parser("route").parse_args(["route", "--tokens", "1,2"])
    assert flag_of("token_ids", by_flag) == "--tokens"


def test_log_level_is_honoured_only_when_given() -> None:
    """route and explain print the decision: they log only problems unless a level is asked for."""
    base = ("route", "--kvcm-fallback", "false", "--tokens", "1,2,3", "--warmup-ms", "0")
    result = _run(*base, "--log-level", "INFO")
    assert result.returncode == 1, result.stderr  # no worker known
    assert " INFO kvroute.route: " in result.stderr
    result = _run(*base)
    assert result.returncode == 1, result.stderr
    assert " INFO " not in result.stderr and " WARNING kvroute.route: " in result.stderr


def test_a_cluster_that_is_down_is_not_routed_and_exits_1() -> None:
    """Every peer refused: the warm-up ended at the failed leader lookup, and the fallback's pick named
    a worker never heard from (so routable), and the command said routed, exit 0."""
    dead: list[str] = []
    for _ in range(5):
        with socket.socket() as closed:  # a port nothing listens on any more
            closed.bind(("127.0.0.1", 0))
            dead.append(f"127.0.0.1:{closed.getsockname()[1]}")
    result = _run(
        "route", "--kvcm-bootstrap", ",".join(dead[:3]), "--workers", ",".join(dead[3:]), "--kvcm-instance-id",
        "test", "--tokens", ",".join(map(str, range(1024))), "--json", "--warmup-ms", "10000",
        # Without the background health probes, which may or may not have reached the workers by then.
        "--prober-health-interval-s", "0",
    )
    assert result.returncode == 1, (result.stdout, result.stderr)
    decision = json.loads(result.stdout)
    assert (decision["route_source"], decision["ip"]) == ("none", "")
    assert "not routed" in result.stderr


def test_no_worker_known_prints_route_source_none_and_exits_1() -> None:
    result = _run("route", "--kvcm-fallback", "false", "--tokens", "1,2,3", "--json", "--warmup-ms", "0")
    assert result.returncode == 1, result.stderr
    decision = json.loads(result.stdout)
    assert (decision["route_source"], decision["ip"]) == ("none", "")
    assert "no worker" in decision["error"]
    assert "not routed" in result.stderr
