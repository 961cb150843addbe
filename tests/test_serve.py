"""``kvroute serve`` as a real process: addresses printed, debug HTTP up, graceful SIGTERM under load.

The simulated cluster runs in the test's trio run (real clock, loopback gRPC, absolute
trio.fail_after); ``kvroute serve`` runs as a subprocess; clients are plain grpcio clients on threads.
"""

from __future__ import annotations

import gc
import itertools
import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import grpc
import httpx
import pytest
import trio
import trio.testing

from kvroute_sim.sim.cluster import SimCluster, SimClusterAddresses
from kvroute_sim.sim.kvcm import KvcmFaults
from router import serve_cli
from router.cli import build_parser
from router.keys import block_keys
from router.serve_cli import SERVE_FULL_COLLECTION_EVERY, freeze_start_up
from router.serve_processes import STOP_NOW_SIGNAL
from router.sidecar import SidecarStats
from router.types import KeyFamily
from router.wire import router_v1_pb2
from router.wire.paths import KVCM_GET_HOST_CACHE_STATE, ROUTER_ROUTE

BLOCK = 16
PROMPT = tuple(range(5000, 5000 + 8 * BLOCK))
CLIENTS = 8
ANSWERED_BEFORE_SIGTERM = 40
BUDGET_MS = 2000
MAX_CALLS_PER_CLIENT = 5000  # a bound: clients normally stop at the first refusal after SIGTERM
_ADDRESSES = re.compile(r"Route gRPC on (\S+), debug HTTP on http://(\S+)")
_SUMMARY = re.compile(
    r"answered=(\d+) invalid=(\d+) refused=(\d+) timed_out=(\d+) failed=(\d+) cut_at_drain_deadline=(\d+)"
)
_DRAINING = re.compile(r"draining: (\d+) Route call\(s\) in flight")


CLI_SERVE = [sys.executable, "-P", "-m", "router.cli", "serve"]


def _serve_command(addrs: SimClusterAddresses, *extra: str) -> list[str]:
    return [
        *CLI_SERVE,
        "--grpc-listen=127.0.0.1:0",
        "--debug-listen=127.0.0.1:0",
        f"--kvcm-bootstrap={addrs.kvcm_bootstrap}",
        f"--workers={addrs.workers_arg}",
        "--kvcm-instance-id=test",
        f"--block-size={BLOCK}",
        *extra,
    ]


async def _read_line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(4096)
        assert chunk, f"kvroute serve closed stdout before printing its addresses: {data!r}"
        data += chunk
    return data.decode()


class Load:
    """Client threads calling Route back to back until refused (or told to stop)."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._lock = threading.Lock()
        self.answered: list[router_v1_pb2.RouteDecision] = []
        self.failures: list[grpc.StatusCode] = []
        self.details: list[str] = []
        self.warmed = threading.Event()
        self.stop = threading.Event()

    def client(self, index: int) -> None:
        with grpc.insecure_channel(self._target, options=[("grpc.enable_retries", 0)]) as channel:
            call = channel.unary_unary(
                ROUTER_ROUTE,
                request_serializer=router_v1_pb2.RouteRequest.SerializeToString,
                response_deserializer=router_v1_pb2.RouteDecision.FromString,
            )
            for n in itertools.islice(itertools.count(), MAX_CALLS_PER_CLIENT):
                if self.stop.is_set():
                    return
                request = router_v1_pb2.RouteRequest(request_id=f"c{index}-{n}", token_ids=PROMPT, budget_ms=BUDGET_MS)
                try:
                    reply = call(request, timeout=10.0)
                except grpc.RpcError as exc:
                    with self._lock:
                        self.failures.append(exc.code())
                        self.details.append(f"{exc.code()} {exc.details()}")
                    return
                with self._lock:
                    self.answered.append(reply)
                    if len(self.answered) >= ANSWERED_BEFORE_SIGTERM:
                        self.warmed.set()


async def _stop_process(proc: trio.Process) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


async def test_sigterm_under_load_drains_every_request_and_exits_0(nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.fail_after(40):
        cluster = SimCluster(workers=4, kvcm_replicas=2, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        cluster.kvcm.record_prefill(cluster.worker_addr(0).http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
        leader = cluster.kvcm.leader
        assert leader is not None
        kvcm_calls = cluster.kvcm.stats(leader)
        stderr_path = tmp_path / "serve.stderr"
        with stderr_path.open("wb") as stderr:
            proc = await trio.lowlevel.open_process(
                _serve_command(
                    addrs,
                    f"--budget-cap-ms={BUDGET_MS}",
                    f"--router-kvcm-query-timeout-ms={BUDGET_MS}",
                    "--drain-timeout-s=10",
                ),
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        load: Load | None = None
        try:
            assert proc.stdout is not None
            found = _ADDRESSES.search(await _read_line(proc.stdout))
            assert found, "kvroute serve did not print its addresses"
            grpc_target, debug_target = found.groups()
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"http://{debug_target}/healthz")).status_code == 200

            load = Load(grpc_target)
            async with trio.open_nursery() as clients:
                for i in range(CLIENTS):
                    clients.start_soon(trio.to_thread.run_sync, load.client, i)
                assert await trio.to_thread.run_sync(load.warmed.wait, 20.0)
                # Now KVCM stops answering: each client's next call waits in the router until its
                # reserve (~90 % of BUDGET_MS), so all of them are in flight when SIGTERM comes.
                cluster.kvcm.set_faults(leader, KvcmFaults(hang=True, methods=frozenset({KVCM_GET_HOST_CACHE_STATE})))
                all_hung = await trio.to_thread.run_sync(
                    kvcm_calls.wait_in_flight, KVCM_GET_HOST_CACHE_STATE, CLIENTS, 10.0
                )
                assert all_hung
                proc.send_signal(signal.SIGTERM)
                returncode = await proc.wait()
            # Every client ran until the server refused it.
        finally:
            if load is not None:
                load.stop.set()
            await _stop_process(proc)
        log = stderr_path.read_text()
        assert returncode == 0, log
        assert load is not None
        # The drain began with every client's call in flight ...
        draining = _DRAINING.search(log)
        assert draining, log
        assert int(draining.group(1)) == CLIENTS
        # ... and no request was lost: each was answered with a decision or refused (UNAVAILABLE: not
        # routed, safe to send elsewhere) — never cut off, timed out or cancelled.
        assert set(load.failures) == {grpc.StatusCode.UNAVAILABLE}, load.details
        assert len(load.failures) == CLIENTS
        assert len(load.answered) >= ANSWERED_BEFORE_SIGTERM + CLIENTS
        assert all(d.route_source in ("kvcm", "shadow", "domain") and d.ip for d in load.answered)
        summary = _SUMMARY.search(log)
        assert summary, log
        answered, invalid, refused, timed_out, failed, cut = map(int, summary.groups())
        assert answered == len(load.answered)  # the server answered exactly what the clients received
        assert (invalid, timed_out, failed, cut) == (0, 0, 0, 0)
        assert refused <= CLIENTS  # refused while draining; the others found the server gone


async def _run_to_end(command: Sequence[str], signum: signal.Signals | None = None) -> tuple[int, str, str]:
    proc = await trio.lowlevel.open_process(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = ""
        if signum is not None:
            first = await _read_line(proc.stdout)
            proc.send_signal(signum)
        stdout = first + (await _read_all(proc.stdout))
        stderr = await _read_all(proc.stderr)
        return await proc.wait(), stdout, stderr
    finally:
        await _stop_process(proc)


async def _read_all(stream: trio.abc.ReceiveStream) -> str:
    chunks = []
    while chunk := await stream.receive_some(65536):
        chunks.append(chunk)
    return b"".join(chunks).decode()


async def test_a_stop_during_start_up_ends_it_at_once_and_it_never_says_it_serves() -> None:
    """Signals were read only once serving: a SIGTERM while start-up waited on a scheduler that
    accepts and never answers took effect after the discovery timeout, and the process printed its
    serving line first."""
    with trio.fail_after(60), trio.socket.socket() as blackhole:  # the discovery timeout is twice that
        await blackhole.bind(("127.0.0.1", 0))
        blackhole.listen()
        command = [
            *CLI_SERVE,
            "--grpc-listen=127.0.0.1:0",
            "--debug-listen=127.0.0.1:0",
            "--workers=127.0.0.1:9",
            "--kvcm-fallback=false",
            f"--master-hosts=127.0.0.1:{blackhole.getsockname()[1]}",
            "--master-discovery-timeout-s=120",
        ]
        proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            connection, _ = await blackhole.accept()  # start-up waits on this poll now
            with connection:
                proc.send_signal(signal.SIGTERM)
                code = await proc.wait()
            stdout, stderr = await _read_all(proc.stdout), await _read_all(proc.stderr)
        finally:
            await _stop_process(proc)
    assert code == 0, stderr
    assert stdout == ""  # it never announced an address
    assert "SIGTERM during start-up: stopped before serving" in stderr


async def _signalled_once_serving(stops: Sequence[signal.Signals], *, supervised: bool) -> tuple[int, str]:
    """A serve process (a supervised child when ``supervised``) whose drain outlasts the test's bound,
    sent ``stops`` once it serves: its exit status and stderr."""
    command = [
        *CLI_SERVE,
        "--grpc-listen=127.0.0.1:0",
        "--debug-listen=127.0.0.1:0",
        "--workers=127.0.0.1:9",
        "--kvcm-fallback=false",
        "--drain-lame-duck-s=600",  # a drain outlasts the test's bound: only a stop at once ends in it
        "--drain-timeout-s=600",
        *(["--supervised-process=0", "--supervised-processes=1"] if supervised else []),
    ]
    with trio.fail_after(60):
        proc = await trio.lowlevel.open_process(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            assert _ADDRESSES.search(await _read_line(proc.stdout))
            for stop in stops:
                proc.send_signal(stop)
            stderr = await _read_all(proc.stderr)
            code = await proc.wait()
        finally:
            await _stop_process(proc)
    return code, stderr


async def test_a_supervised_child_stops_at_once_when_the_stop_now_is_the_first_signal_it_reads() -> None:
    """The parent sends a child its drain signal (SIGTERM) and, on a second stop, STOP_NOW_SIGNAL
    (SIGUSR1) right after it. Pending together, a process handles signals in number order, so the
    child read SIGUSR1 first: it took it for its drain signal, then ignored the SIGTERM as a second
    drain signal from a service manager, and drained out its whole lame duck."""
    code, stderr = await _signalled_once_serving((STOP_NOW_SIGNAL,), supervised=True)
    assert code == 0, stderr
    assert "SIGUSR1: stopping now" in stderr, stderr
    assert "draining" not in stderr.replace("SIGUSR1: stopping now", ""), stderr
    assert _SUMMARY.search(stderr), stderr


@pytest.mark.parametrize(
    "stops",
    [
        # A third stop: the first drains, the second stops at once, the third is never read.
        pytest.param((signal.SIGHUP, signal.SIGINT, signal.SIGTERM), id="three-stops"),
        # What a supervising parent sends a child on a second stop: both pending, the stop-now read first.
        pytest.param((signal.SIGTERM, STOP_NOW_SIGNAL), id="drain-and-stop-now"),
    ],
)
async def test_a_stop_signal_never_read_does_not_kill_the_process_as_it_stops(
    stops: tuple[signal.Signals, ...],
) -> None:
    """trio's signal receiver sends a signal it never handed out again as it closes, to the handler in
    place before it: the default one, which killed the process with its stop under way, before its
    drain summary (exit 143, or -15 in a supervising parent's count)."""
    code, stderr = await _signalled_once_serving(stops, supervised=STOP_NOW_SIGNAL in stops)
    assert code == 0, stderr
    assert "stopping now" in stderr, stderr
    assert _SUMMARY.search(stderr), stderr


async def test_a_stop_signal_before_the_receiver_opens_is_read_by_it_and_one_after_it_closes_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stop that came between the handlers being set and trio's receiver opening was lost (its
    handler ignored it), and one sent again as the receiver closed ended the process."""
    previous = signal.getsignal(signal.SIGUSR2)
    opened = trio.open_signal_receiver

    def opened_late(*signums: int) -> object:
        signal.raise_signal(signal.SIGUSR2)  # after the held handler is set, before the receiver's
        return opened(*signums)

    monkeypatch.setattr(trio, "open_signal_receiver", opened_late)
    try:
        with serve_cli.stop_signal_receiver((signal.SIGUSR2,)) as signals, trio.fail_after(5):
            assert await signals.__anext__() == signal.SIGUSR2
            signal.raise_signal(signal.SIGUSR2)  # never read: sent again as the receiver closes
        # trio hands a signal to its receiver from its loop: the one sent again comes now, to the held handler.
        await trio.testing.wait_all_tasks_blocked()
        signal.raise_signal(signal.SIGUSR2)  # and one after: held, not the default action (the end)
    finally:
        signal.signal(signal.SIGUSR2, previous)


async def test_fatal_configuration_lists_every_problem_and_exits_2() -> None:
    with trio.fail_after(30):
        code, stdout, stderr = await _run_to_end([*CLI_SERVE, "--grpc-listen=nowhere", "--budget-cap-ms=-5"])
    assert code == 2, stderr
    assert stdout == ""
    assert "--grpc-listen" in stderr and "--budget-cap-ms" in stderr
    assert "not starting" in stderr


async def test_unreadable_config_file_is_listed_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "latin1.toml"
    config.write_bytes("[deployment]\nkvcm_instance_id = 'café'\n".encode("latin-1"))
    with trio.fail_after(30):
        code, stdout, stderr = await _run_to_end([*CLI_SERVE, "--config", str(config)])
    assert code == 2, stderr  # the documented configuration status, not a traceback's 1
    assert stdout == ""
    assert f"--config {config}: not UTF-8 text" in stderr
    assert "Traceback" not in stderr


async def test_fallback_only_problems_start_with_fallback_off_and_sigint_exits_0(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        # A negative leader refresh interval is a KVCM-fallback problem: kvroute starts, routing by domain.
        command = [*_serve_command(addrs), "--leader-refresh-interval-s=-1"]
        code, stdout, stderr = await _run_to_end(command, signal.SIGINT)
    assert code == 0, stderr
    assert _ADDRESSES.search(stdout), stdout
    fallback_errors = [line for line in stderr.splitlines() if "KVCM fallback disabled" in line]
    assert len(fallback_errors) == 1, stderr
    assert "--leader-refresh-interval-s" in fallback_errors[0]


@pytest.mark.parametrize("flag", ["--grpc-listen", "--debug-listen"])
async def test_listen_address_in_use_exits_1_naming_the_flag(flag: str) -> None:
    with trio.fail_after(30):
        with trio.socket.socket() as taken:
            await taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            listen = {"--grpc-listen": "127.0.0.1:0", "--debug-listen": "127.0.0.1:0", flag: f"127.0.0.1:{port}"}
            command = [
                *CLI_SERVE,
                *(f"{name}={value}" for name, value in listen.items()),
                "--workers=127.0.0.1:9",
                "--kvcm-fallback=false",
            ]
            code, stdout, stderr = await _run_to_end(command)
    assert code == 1, stderr
    assert stdout == ""  # never announced an address
    assert f"{flag}: cannot bind 127.0.0.1:{port}" in stderr


def _json_records(stderr: str) -> list[dict[str, object]]:
    """Every stderr line as a JSON object: a line that is not one fails the test, naming it."""
    records = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line on stderr: {line!r}") from None
        assert isinstance(record, dict), line
        records.append(record)
    return records


async def test_with_json_logs_the_stop_summary_is_a_json_record_too() -> None:
    """The summary was a plain "kvroute serve: stopped; ..." line among the JSON ones."""
    command = [
        *CLI_SERVE,
        "--grpc-listen=127.0.0.1:0",
        "--debug-listen=127.0.0.1:0",
        "--workers=127.0.0.1:9",
        "--kvcm-fallback=false",
        "--log-format=json",
        "--log-level=error",  # the summary is written at every level, as the text line is
    ]
    with trio.fail_after(30):
        code, stdout, stderr = await _run_to_end(command, signal.SIGTERM)
    assert code == 0, stderr
    assert _ADDRESSES.search(stdout), stdout
    [summary] = [r for r in _json_records(stderr) if str(r["msg"]).startswith("stopped; Route calls")]
    assert summary["logger"] == "kvroute.serve" and summary["level"] == "INFO"
    assert _SUMMARY.search(str(summary["msg"])), summary
    assert summary["answered"] == summary["cut_at_drain_deadline"] == 0


def _blocked_signals(pid: int) -> int:
    """The signal mask of process ``pid``'s main thread (bit n - 1: signal n)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)


def test_a_serve_started_with_its_stop_signals_blocked_unblocks_them_and_drains_on_sigterm() -> None:
    """A signal mask passes through fork and exec: started from a thread with SIGTERM blocked, the
    process left every SIGTERM pending and never drained."""
    command = [*CLI_SERVE, "--grpc-listen=127.0.0.1:0", "--debug-listen=127.0.0.1:0", "--workers=127.0.0.1:9"]
    command.append("--kvcm-fallback=false")
    started: list[subprocess.Popen[bytes]] = []

    def start_blocked() -> None:  # on a thread of its own, so that no thread kept afterwards has the mask
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        started.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE))

    starter = threading.Thread(target=start_blocked)
    starter.start()
    starter.join()
    [proc] = started
    hang_guard = threading.Timer(60.0, proc.kill)  # a stop that never comes fails the test, not the run
    hang_guard.start()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert _ADDRESSES.search(line), line
        assert not _blocked_signals(proc.pid) & (1 << (signal.SIGTERM - 1))
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate()
    finally:
        hang_guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = stderr.decode()
    assert proc.returncode == 0, text
    assert "started with SIGINT, SIGTERM blocked (a mask inherited from its parent): unblocked" in text
    assert _SUMMARY.search(text), text


@pytest.mark.parametrize("log_format", ["json", "JSON"])  # any case, as --log-format takes it
async def test_with_json_logs_a_bind_failure_is_a_json_record_naming_the_flag(log_format: str) -> None:
    with trio.fail_after(30):
        with trio.socket.socket() as taken:
            await taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            command = [
                *CLI_SERVE,
                "--grpc-listen=127.0.0.1:0",
                f"--debug-listen=127.0.0.1:{port}",
                "--workers=127.0.0.1:9",
                "--kvcm-fallback=false",
                f"--log-format={log_format}",
            ]
            code, stdout, stderr = await _run_to_end(command)
    assert code == 1, stderr
    assert stdout == ""
    errors = [r for r in _json_records(stderr) if r["level"] == "ERROR"]
    assert any(f"--debug-listen: cannot bind 127.0.0.1:{port}" in str(r["msg"]) for r in errors), stderr


def test_the_stop_summary_gives_each_count_its_own_label(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_root_logging: None
) -> None:
    stats = SidecarStats(
        answered=1,
        invalid=2,
        unavailable=3,
        timed_out=4,
        failed=5,
        in_flight=0,
        shed_at_receipt=0,
        cut_at_drain_deadline=6,
        client_gone=7,
        expired_at_receipt=8,
    )
    monkeypatch.setattr(trio, "run", lambda *_: stats)  # served, drained, and stopped with these
    args = build_parser("serve").parse_args(["serve", "--workers=127.0.0.1:9", "--kvcm-fallback=false"])
    assert serve_cli.run(args) == 0
    summary = (
        "answered=1 invalid=2 refused=3 timed_out=4 failed=5 cut_at_drain_deadline=6 client_gone=7 expired_at_receipt=8"
    )
    assert f"kvroute serve: stopped; Route calls {summary}\n" in capsys.readouterr().err


def test_serving_freezes_the_start_up_heap_and_makes_full_collections_rare() -> None:
    thresholds = gc.get_threshold()
    try:
        freeze_start_up()
        assert gc.get_freeze_count() > 0  # what start-up allocated is out of the collector's view
        assert gc.get_threshold() == (*thresholds[:2], SERVE_FULL_COLLECTION_EVERY)
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
