"""``kvroute serve --processes 2`` as real processes on loopback: one port, both answer, a killed
process is replaced, SIGTERM drains both.

The simulated cluster runs in the test's trio run (real clock, loopback gRPC); ``kvroute serve`` runs
as a subprocess with its two children; clients are plain grpcio clients on threads, each call on a
connection of its own (SO_REUSEPORT spreads connections, not calls, over the processes).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
import trio

from kvroute_sim.sim.cluster import SimCluster, SimClusterAddresses
from kvroute_sim.sim.kvcm import KvcmFaults
from router import serve_cli, serve_processes
from router.cli import build_parser
from router.config import SEED_MAX
from router.keys import block_keys
from router.replay import load_log
from router.serve_processes import (
    ADDRESS_LINE,
    EXIT_CHILD_FAILED,
    EXIT_OK,
    RESTART_BACKOFF_MAX_S,
    RESTART_BACKOFF_MIN_S,
    STABLE_AFTER_S,
    STARTUP_TIMEOUT_S,
    STOP_MARGIN_S,
    ProcessSupervisor,
    child_debug_listen,
    reserve_port,
    startup_timeout,
)
from router.settings import load_config, load_or_report
from router.targets import HostPort
from router.types import KeyFamily
from router.wire import router_v1_pb2
from router.wire.paths import KVCM_GET_HOST_CACHE_STATE, ROUTER_ROUTE

BLOCK = 16
PROMPT = tuple(range(7000, 7000 + 8 * BLOCK))
BUDGET_MS = 2000
SPREAD_CALLS = 40  # one fresh connection each: all on one of two processes has odds 2**-39
IN_FLIGHT = 6  # calls held in the routers (KVCM hangs) when SIGTERM comes
_ANNOUNCED = re.compile(
    r"Route gRPC on (\S+), debug HTTP on http://(\S+) \(process 0\), http://(\S+) \(process 1\)"
)
_SERVING = re.compile(r"process (\d) serving: pid (\d+), debug HTTP on http://(\S+) \(start (\d+)\)")
_SUMMARY = re.compile(
    r"kvroute serve \(process (\d)\): stopped; Route calls answered=(\d+) invalid=(\d+) refused=(\d+) "
    r"timed_out=(\d+) failed=(\d+) cut_at_drain_deadline=(\d+)"
)
_DRAINING = re.compile(r"draining: (\d+) Route call\(s\) in flight")
_CHILD_DRAINING = re.compile(r"SIGTERM: draining process=")


def _serve_command(addrs: SimClusterAddresses, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-P", "-m", "router.cli", "serve"),
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


class Lines:
    """The lines a stream has produced so far; ``wait_for`` wakes on each new line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._grew = trio.Event()

    async def collect(self, stream: trio.abc.ReceiveStream) -> None:
        pending = b""
        while chunk := await stream.receive_some(65536):
            *complete, pending = (pending + chunk).split(b"\n")
            self.lines.extend(line.decode(errors="replace") for line in complete)
            self._grew.set()
            self._grew = trio.Event()

    async def wait_for(self, pattern: re.Pattern[str], count: int = 1) -> list[re.Match[str]]:
        while True:
            found = [m for m in map(pattern.search, self.lines) if m]
            if len(found) >= count:
                return found
            await self._grew.wait()

    def text(self) -> str:
        return "\n".join(self.lines)


def _route_on_fresh_connection(target: str, request_id: str) -> router_v1_pb2.RouteDecision:
    # A local subchannel pool: a new connection, never one another channel to the same target opened.
    options = [("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(target, options=options) as channel:
        call = channel.unary_unary(
            ROUTER_ROUTE,
            request_serializer=router_v1_pb2.RouteRequest.SerializeToString,
            response_deserializer=router_v1_pb2.RouteDecision.FromString,
        )
        request = router_v1_pb2.RouteRequest(request_id=request_id, token_ids=PROMPT, budget_ms=BUDGET_MS)
        reply: router_v1_pb2.RouteDecision = call(request, timeout=15.0)
        return reply


async def test_two_processes_share_the_port_replace_a_killed_one_and_drain_on_sigterm(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    with trio.fail_after(120):
        cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        cluster.kvcm.record_prefill(cluster.worker_addr(0).http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
        leader = cluster.kvcm.leader
        assert leader is not None
        kvcm_calls = cluster.kvcm.stats(leader)
        command = _serve_command(
            addrs,
            "--processes=2",
            f"--budget-cap-ms={BUDGET_MS}",
            f"--router-kvcm-query-timeout-ms={BUDGET_MS}",
            "--drain-timeout-s=10",
            f"--decision-log={tmp_path / 'decisions.log'}",
        )
        proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        log = Lines()
        try:
            assert proc.stdout is not None and proc.stderr is not None
            nursery.start_soon(log.collect, proc.stderr)
            announced = _ANNOUNCED.search(await _read_line(proc.stdout))
            assert announced, log.text()
            grpc_target, debug_0, debug_1 = announced.groups()
            assert grpc_target.startswith("127.0.0.1:") and not grpc_target.endswith(":0")
            assert debug_0 != debug_1
            first = {int(m.group(1)): int(m.group(2)) for m in await log.wait_for(_SERVING, 2)}
            assert set(first) == {0, 1}
            # Each process's debug endpoint says which of the two it is (its own processes is 1).
            async with httpx.AsyncClient(trust_env=False) as http:
                for index, debug in enumerate((debug_0, debug_1)):
                    shown = (await http.get(f"http://{debug}/debug/config")).json()
                    assert shown["process"] == f"process {index} of 2 (serve --processes 2)"
                    assert f"this is process {index} of 2" in (await http.get(f"http://{debug}/readyz")).text

            # A killed process is replaced, on the same port.
            os.kill(first[1], signal.SIGKILL)
            restarted = [m for m in await log.wait_for(_SERVING, 3) if m.group(4) == "2"]
            assert [int(m.group(1)) for m in restarted] == [1], log.text()
            assert int(restarted[0].group(2)) != first[1]
            assert any("process 1 (pid" in line and "restart 1" in line for line in log.lines), log.text()

            # Fresh connections spread over both processes; every call is answered.
            for i in range(SPREAD_CALLS):
                reply = await trio.to_thread.run_sync(_route_on_fresh_connection, grpc_target, f"spread-{i}")
                assert reply.ip and reply.route_source in ("kvcm", "shadow", "domain")

            # Calls in flight when SIGTERM comes are answered by the drain, not cut off.
            cluster.kvcm.set_faults(leader, KvcmFaults(hang=True, methods=frozenset({KVCM_GET_HOST_CACHE_STATE})))
            held: list[router_v1_pb2.RouteDecision] = []
            failures: list[str] = []

            def held_call(i: int) -> None:
                try:
                    held.append(_route_on_fresh_connection(grpc_target, f"held-{i}"))
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code()} {exc.details()}")

            threads = [threading.Thread(target=held_call, args=(i,)) for i in range(IN_FLIGHT)]
            for thread in threads:
                thread.start()
            wait_held = kvcm_calls.wait_in_flight
            assert await trio.to_thread.run_sync(wait_held, KVCM_GET_HOST_CACHE_STATE, IN_FLIGHT, 20.0)
            proc.send_signal(signal.SIGTERM)
            returncode = await proc.wait()
            for thread in threads:
                await trio.to_thread.run_sync(thread.join)
            await log.wait_for(re.compile(r"all 2 processes stopped"))
        finally:
            if proc.returncode is None:  # a failed test: the children drain when they see the parent gone
                proc.kill()
                await proc.wait()
        assert returncode == 0, log.text()
        assert failures == [] and len(held) == IN_FLIGHT
        drained = [int(m.group(1)) for m in map(_DRAINING.search, log.lines) if m]
        assert len(drained) == 2 and sum(drained) == IN_FLIGHT, log.text()
        summaries = {int(m.group(1)): tuple(map(int, m.groups()[1:])) for m in map(_SUMMARY.search, log.lines) if m}
        assert set(summaries) == {0, 1}, log.text()  # the killed process printed none; its replacement did
        for index in (0, 1):  # the children's log lines say whose they are
            assert any("Route gRPC service listening" in line and f"process={index}" in line for line in log.lines)
        answered = {index: counts[0] for index, counts in summaries.items()}
        assert all(n > 0 for n in answered.values()), answered  # both processes answered, the replacement too
        assert sum(answered.values()) == SPREAD_CALLS + IN_FLIGHT
        # none invalid, refused, timed out, failed or cut off at the drain deadline
        assert all(counts[1:] == (0, 0, 0, 0, 0) for counts in summaries.values()), summaries
        # Each process wrote its own decision log (one writer per file), and each replays.
        logged = {index: load_log([str(tmp_path / f"decisions.log.p{index}")]).cases for index in (0, 1)}
        assert all(logged.values()), logged
        ids = [{case.request_id for case in cases} for cases in logged.values()]
        assert not ids[0] & ids[1]


def test_reserved_port_is_shared_by_reuseport_sockets_and_refused_when_taken() -> None:
    with reserve_port(HostPort("127.0.0.1", 0), "--grpc-listen") as held:
        port = held.getsockname()[1]
        assert port != 0
        with socket.socket() as child:  # as a child binds it: SO_REUSEPORT joins the reserved port
            child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            child.bind(("127.0.0.1", port))
            child.listen()
            # Taken now (listening): a second parent must not share it.
            with pytest.raises(OSError, match=rf"--grpc-listen: cannot bind 127.0.0.1:{port}"):
                reserve_port(HostPort("127.0.0.1", port), "--grpc-listen")


def test_a_reserved_port_no_child_listens_on_is_taken_for_another_parent_and_for_strangers() -> None:
    """While every child is starting or in its restart backoff, only the held socket is on the port:
    a second ``serve`` on it, or any server binding with SO_REUSEADDR, must be refused, not join it."""
    with reserve_port(HostPort("127.0.0.1", 0), "--grpc-listen") as held:
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=rf"--grpc-listen: cannot bind 127.0.0.1:{port}"):
            reserve_port(HostPort("127.0.0.1", port), "--grpc-listen")
        with socket.socket() as stranger, pytest.raises(OSError):
            stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            stranger.bind(("127.0.0.1", port))


def _port_left_in_time_wait() -> int:
    """A loopback port whose server (bound without SO_REUSEPORT) closed a connection first and then
    its listener: only that connection, in TIME_WAIT, is left on the port."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port: int = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server's side closes first: its end waits out TIME_WAIT
            assert client.recv(1) == b""
    return port


def test_a_port_left_only_closed_connections_is_waited_for_and_named_when_they_outlast_the_wait() -> None:
    """A server without SO_REUSEPORT that died on the port leaves closed connections there for a
    minute, which the held socket cannot bind through, though no process holds the port: the parent
    waits for them (saying why), and past its wait says what holds the port, not a bare EADDRINUSE."""
    port = _port_left_in_time_wait()
    said: list[str] = []
    with pytest.raises(OSError, match="only closed connections hold it") as info:
        reserve_port(HostPort("127.0.0.1", port), "--grpc-listen", wait_closing_s=1.0, on_wait=said.append)
    assert f"--grpc-listen: cannot bind 127.0.0.1:{port}" in str(info.value)
    assert len(said) == 1 and "TIME_WAIT" in said[0] and "waiting up to 1 s" in said[0]
    with socket.socket() as single:  # what a single serve does binds at once
        single.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        single.bind(("127.0.0.1", port))


def test_the_parent_binds_once_what_only_a_plain_bind_could_share_has_left() -> None:
    """The retry's way out, with a leftover the test can end: a socket bound with SO_REUSEADDR and not
    listening blocks the held socket as TIME_WAIT does, and lets a plain bind through; once it closes,
    the waiting parent binds the port."""
    leftover = socket.socket()
    leftover.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    leftover.bind(("127.0.0.1", 0))
    port = leftover.getsockname()[1]
    said: list[str] = []
    closer = threading.Timer(0.3, leftover.close)
    closer.start()
    try:
        reserved = reserve_port(HostPort("127.0.0.1", port), "--grpc-listen", wait_closing_s=60.0, on_wait=said.append)
        with reserved as held:
            assert held.getsockname()[1] == port
    finally:
        closer.cancel()
        leftover.close()
    assert len(said) == 1


def test_each_process_gets_its_own_debug_port() -> None:
    assert child_debug_listen(HostPort("127.0.0.1", 9000), 3) == "127.0.0.1:9003"
    assert child_debug_listen(HostPort("127.0.0.1", 0), 3) == "127.0.0.1:0"


def test_the_supervisor_waits_for_a_childs_drain_and_for_discoverys_first_refresh(
    monkeypatch: pytest.MonkeyPatch, restore_root_logging: None
) -> None:
    supervisors: list[dict[str, object]] = []

    class Recorded:
        def __init__(self, **kwargs: object) -> None:
            supervisors.append(kwargs)

    monkeypatch.setattr(serve_cli, "ProcessSupervisor", Recorded)
    monkeypatch.setattr(trio, "run", lambda *_: EXIT_OK)  # supervised, and all stopped
    flags = ["--workers=127.0.0.1:9", "--kvcm-fallback=false", "--grpc-listen=127.0.0.1:0"]
    flags += ["--debug-listen=127.0.0.1:0", "--drain-timeout-s=7", "--discovery-refresh-timeout-s=3"]
    args = build_parser("serve").parse_args(["serve", "--processes=2", *flags])
    assert serve_cli.run(args) == EXIT_OK
    [supervisor] = supervisors
    assert supervisor["count"] == 2
    assert supervisor["stop_wait_s"] == 7 + STOP_MARGIN_S  # a child's whole drain, then its stop
    assert supervisor["startup_timeout_s"] == startup_timeout(3)


def test_each_child_reads_the_copy_of_the_config_file_the_parent_took(tmp_path: Path) -> None:
    """A child read the operator's file at every start: an edit made while serving reached a restarted
    child alone, and a broken one failed each of its restarts with exit 2."""
    config = tmp_path / "kvroute.toml"
    config.write_text("[serve]\ndrain_timeout_s = 3\n")
    args = build_parser("serve").parse_args(["serve", "--config", str(config), "--processes", "2"])
    with serve_cli.ConfigCopy.read(str(config)) as copy:
        config.write_text("[serve]\ndrain_timeout_s = banana\n")  # edited while serving
        path = copy.path()
        assert path != str(config) and Path(path).read_text() == "[serve]\ndrain_timeout_s = 3\n"
        command = serve_cli._child_command(
            args, 1, 2, "127.0.0.1:5000", "127.0.0.1:0", "", 1, origins={}, config_path=path
        )
        assert f"--config={path}" in command
        assert command[-3:-1] == ["--supervised-process=1", "--supervised-processes=2"]
        # A temporary-files cleaner took it under a long-running parent: the next child's start writes it again.
        shutil.rmtree(Path(path).parent)
        assert copy.path() == path and Path(path).read_text() == "[serve]\ndrain_timeout_s = 3\n"
    assert not Path(path).exists()  # removed with the supervision
    # No file read (none given, or --config= whatever KVROUTE_CONFIG says): the children read none either.
    command = serve_cli._child_command(args, 1, 2, "127.0.0.1:5000", "127.0.0.1:0", "", 1, origins={}, config_path="")
    assert "--config=" in command


def test_each_child_draws_from_a_seed_of_its_own() -> None:
    """With the parent's one seed the children's tie, near-tie and domain draws came in the same order:
    routers that share nothing, herding alike. Child 0 keeps the seed given, the others the next ones,
    in place of the parent's flag."""
    assert [serve_cli.child_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert serve_cli.child_seed(SEED_MAX, 1) == 0  # within the setting's range
    args = build_parser("serve").parse_args(["serve", "--processes", "2", "--scorer-seed", "7"])
    command = serve_cli._child_command(
        args, 1, 2, "127.0.0.1:5000", "127.0.0.1:0", "", serve_cli.child_seed(7, 1), origins={}, config_path=""
    )
    assert [flag for flag in command if flag.startswith("--scorer-seed")] == ["--scorer-seed=8"]


def test_a_childs_config_names_where_the_values_its_parent_resolved_came_from(tmp_path: Path) -> None:
    """The parent passes a child its listen addresses, decision log and seed as flags: the child's
    /debug/config named each `flag --grpc-listen`, a seed nobody gave among them."""
    config = tmp_path / "kvroute.toml"
    config.write_text('[serve]\ngrpc_listen = "127.0.0.1:0"\ndrain_timeout_s = 3\n')
    argv = ["serve", "--config", str(config), "--processes", "2", "--workers=127.0.0.1:9", "--kvcm-fallback=false"]
    parent = load_or_report(build_parser("serve").parse_args(argv), "serve")
    assert parent is not None
    with serve_cli.ConfigCopy.read(str(config)) as copy:
        command = serve_cli._child_command(
            build_parser("serve").parse_args(argv),
            1,
            2,
            "127.0.0.1:5000",
            "127.0.0.1:0",
            "",
            8,
            origins=parent.sources,
            config_path=copy.path(),
        )
        child_args = build_parser("serve").parse_args(command[command.index("serve") :])
        child = load_or_report(child_args, "serve")
    assert child is not None
    child = serve_cli.with_parent_origins(child, child_args.supervised_origins)
    assert str(child.sources["grpc_listen"]) == (
        f"config file {config} [serve] grpc_listen, as the supervising parent resolved it for this process"
    )
    # Read from the parent's copy of the file, named by the operator's.
    assert child.effective.serve.drain_timeout_s == 3
    assert str(child.sources["drain_timeout_s"]) == (
        f"config file {config} [serve] drain_timeout_s, as the supervising parent resolved it for this process"
    )
    assert str(child.sources["scorer_seed"]) == "default, as the supervising parent resolved it for this process"
    assert str(child.sources["workers"]) == "flag --workers"  # given to the parent as it is to the child


def test_debug_ports_of_all_processes_are_checked() -> None:
    base = {"workers": "10.0.0.1:80", "kvcm_fallback": "false"}
    beyond = load_config({**base, "processes": "4", "debug_listen": "127.0.0.1:65534"}, {})
    assert any("4 processes need debug ports 65534..65537" in str(p) for p in beyond.errors), beyond.errors
    overlapping = load_config(
        {**base, "processes": "3", "debug_listen": "127.0.0.1:9000", "grpc_listen": "127.0.0.1:9002"}, {}
    )
    assert any("include the gRPC port 9002" in str(p) for p in overlapping.errors), overlapping.errors
    assert load_config({**base, "processes": "65"}, {}).errors  # above the bound
    assert load_config({**base, "processes": "64", "debug_listen": "127.0.0.1:0"}, {}).errors == ()


def test_debug_ports_up_to_the_last_port_and_beside_another_grpc_address_are_accepted() -> None:
    base = {"workers": "10.0.0.1:80", "kvcm_fallback": "false"}
    # Two processes from 65534: the second's debug port is 65535, the last port there is.
    assert load_config({**base, "processes": "2", "debug_listen": "127.0.0.1:65534"}, {}).errors == ()
    # The debug ports may take the gRPC port's number on another address.
    beside = {"processes": "3", "debug_listen": "127.0.0.1:9000", "grpc_listen": "10.0.0.1:9002"}
    assert load_config({**base, **beside}, {}).errors == ()


async def test_children_drain_and_exit_when_the_parent_dies(nursery: trio.Nursery) -> None:
    with trio.fail_after(90):
        cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        proc = await trio.lowlevel.open_process(
            _serve_command(addrs, "--processes=2"), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        log = Lines()
        try:
            assert proc.stdout is not None and proc.stderr is not None
            nursery.start_soon(log.collect, proc.stderr)
            assert _ANNOUNCED.search(await _read_line(proc.stdout)), log.text()
            children = [psutil.Process(int(m.group(2))) for m in await log.wait_for(_SERVING, 2)]
            proc.kill()  # no signal to forward: the children see their stdin end
            await proc.wait()
            gone, alive = await trio.to_thread.run_sync(lambda: psutil.wait_procs(children, timeout=60))
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for child in alive:
            child.kill()
        assert alive == [] and len(gone) == 2, log.text()
        await log.wait_for(_SUMMARY, 2)  # each drained and printed its summary (its exit status is not ours to read)
        assert sum("the supervising parent is gone: draining" in line for line in log.lines) == 2


@pytest.mark.parametrize("how", ["the whole group gets SIGTERM", "the parent gets SIGHUP", "the parent gets SIGINT"])
async def test_a_service_managers_stop_drains_every_process(nursery: trio.Nursery, how: str) -> None:
    """systemd's default KillMode=control-group sends SIGTERM to the parent and every child at once:
    with the parent's own SIGTERM a child saw two, and the second stopped it without its drain. A
    terminal's hangup (SIGHUP) used to kill the parent outright, leaving the children as orphans."""
    with trio.fail_after(90):
        cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        command = _serve_command(addrs, "--processes=2", "--drain-lame-duck-s=2")
        proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        log = Lines()
        try:
            assert proc.stdout is not None and proc.stderr is not None
            nursery.start_soon(log.collect, proc.stderr)
            assert _ANNOUNCED.search(await _read_line(proc.stdout)), log.text()
            children = [int(m.group(2)) for m in await log.wait_for(_SERVING, 2)]
            if how.startswith("the whole group"):
                # The worst order of the group's signals: the children's own first (two signals that
                # arrive together may merge into one), then the parent's, which it passes on.
                for pid in children:
                    os.kill(pid, signal.SIGTERM)
                await log.wait_for(_CHILD_DRAINING, 2)
                proc.send_signal(signal.SIGTERM)
            else:  # either is passed on as SIGTERM (a child still starting dies of a SIGINT with status 1)
                proc.send_signal(signal.SIGHUP if how.endswith("SIGHUP") else signal.SIGINT)
            returncode = await proc.wait()
            await log.wait_for(re.compile(r"all 2 processes stopped"))
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert returncode == 0, log.text()
    assert len([m for m in map(_SUMMARY.search, log.lines) if m]) == 2, log.text()
    assert not any("stopping now" in line for line in log.lines), log.text()


async def _listening_above_a_free_port() -> trio.socket.SocketType:
    """A socket listening on a loopback port whose neighbour below could be bound just now."""
    for _ in range(100):
        taken = trio.socket.socket()
        await taken.bind(("127.0.0.1", 0))
        with trio.socket.socket() as below:
            try:
                await below.bind(("127.0.0.1", taken.getsockname()[1] - 1))
            except OSError:
                taken.close()
                continue
        taken.listen()
        return taken
    raise AssertionError("no loopback port with a free neighbour in 100 tries")


async def test_a_process_that_cannot_start_stops_all_and_the_parent_exits_with_its_status() -> None:
    # Process 1's debug port (the base + 1) is taken; process 0's (the base) must be free.
    with trio.fail_after(60), await _listening_above_a_free_port() as taken:
        port = taken.getsockname()[1]
        command = [
            *(sys.executable, "-P", "-m", "router.cli", "serve"),
            "--processes=2",
            "--grpc-listen=127.0.0.1:0",
            f"--debug-listen=127.0.0.1:{port - 1}",
            "--workers=127.0.0.1:9",
            "--kvcm-fallback=false",
        ]
        result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert result.stdout == b""  # never announced
    assert f"--debug-listen: cannot bind 127.0.0.1:{port}" in stderr
    assert "could not start (exit status 1): stopping every process" in stderr


def test_a_child_ended_by_the_forwarded_signal_while_starting_is_a_clean_stop() -> None:
    """A SIGTERM that reaches a child before its handlers are installed ends it with -15: that child
    was stopped, not failed (the parent used to exit 1 for a stop during start-up)."""
    supervisor = ProcessSupervisor(count=3, command=lambda i: ["true"], grpc_address="127.0.0.1:1", stop_wait_s=1.0)
    drained, starting, crashed = supervisor._slots
    drained.returncode, starting.returncode, crashed.returncode = 0, -int(signal.SIGTERM), 1
    assert not supervisor._stopped_cleanly(starting)  # no stop was asked for: a signal from elsewhere
    supervisor._stopping = True
    assert supervisor._stopped_cleanly(drained) and supervisor._stopped_cleanly(starting)
    assert not supervisor._stopped_cleanly(crashed)
    # Told to stop at once (a second signal to the parent) after its handlers were gone, at its end.
    crashed.returncode = -int(signal.SIGUSR1)
    assert supervisor._stopped_cleanly(crashed)
    starting.killed = True  # killed by the parent after the stop's wait: not clean
    assert not supervisor._stopped_cleanly(starting)


# What every stand-in child does first, as `kvroute serve` does (unblock_stop_signals): no signal mask it
# inherits keeps the parent's signals pending.
_UNBLOCK_AS_SERVE = (
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1))\n"
)

# A child that announces itself, then on its first start dies by SIGKILL; restarted, it serves until SIGTERM.
_CRASHING_ONCE = "import os, signal, sys, time\n" + _UNBLOCK_AS_SERVE + """
sys.stdout.write("kvroute serve: Route gRPC on 127.0.0.1:1, debug HTTP on http://127.0.0.1:2\\n")
sys.stdout.flush()
marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(60)
"""


async def test_a_stop_during_a_restarts_backoff_is_as_clean_as_one_just_after_it(tmp_path: Path) -> None:
    """One crash, restarted, then a stop: the status used to depend on when the stop came. During the
    backoff the slot kept the crash's -9 and the parent exited 1; a moment later the restarted child
    drained and it exited 0."""
    marker = tmp_path / "crashed-once"
    supervisor = ProcessSupervisor(
        count=1,
        command=lambda i: [sys.executable, "-c", _CRASHING_ONCE, str(marker)],
        grpc_address="127.0.0.1:1",
        stop_wait_s=10.0,
    )
    (slot,) = supervisor._slots
    send, receive = trio.open_memory_channel[int](1)

    async def signals() -> AsyncIterator[int]:
        async for signum in receive:
            yield signum

    restart_logged = trio.Event()

    class OnRestart(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:  # on the trio thread, just before the backoff
            if "restart 1 in" in record.getMessage():
                restart_logged.set()

    handler = OnRestart()
    logging.getLogger("kvroute.serve").addHandler(handler)
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                status: list[int] = []

                async def run() -> None:
                    status.append(await supervisor.run(signals()))

                nursery.start_soon(run)
                await restart_logged.wait()
                assert slot.backoff is not None  # in its backoff (0.5 s): no child in the slot
                assert slot.restarts == 1 and slot.returncode == -int(signal.SIGKILL)
                await send.send(int(signal.SIGTERM))
    finally:
        logging.getLogger("kvroute.serve").removeHandler(handler)
    assert status == [0]


# A child that announces itself and drains for longer than any test waits: SIGTERM is only noted (in
# argv[1]); STOP_NOW_SIGNAL ends it at once, with status 0.
_DRAINING_FOR_LONG = "import signal, sys, time\n" + _UNBLOCK_AS_SERVE + """
marker = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *_: open(marker, "w").close())
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
sys.stdout.write("kvroute serve: Route gRPC on 127.0.0.1:1, debug HTTP on http://127.0.0.1:2\\n")
sys.stdout.flush()
time.sleep(120)
"""


async def test_a_second_signal_during_the_drain_stops_the_children_at_once(tmp_path: Path) -> None:
    """The operator's second Ctrl-C (or a second SIGTERM) means stop now: the children are told with
    STOP_NOW_SIGNAL, not sent the drain again, which a child draining long requests would let wait out
    the whole stop wait before being killed."""
    draining = tmp_path / "draining"
    supervisor = ProcessSupervisor(
        count=1,
        command=lambda i: [sys.executable, "-c", _DRAINING_FOR_LONG, str(draining)],
        grpc_address="127.0.0.1:1",
        stop_wait_s=120.0,  # past the hang guard: only the stop-now signal ends this child in time
    )
    (slot,) = supervisor._slots
    send, receive = trio.open_memory_channel[int](2)

    async def signals() -> AsyncIterator[int]:
        async for signum in receive:
            yield signum

    status: list[int] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                status.append(await supervisor.run(signals()))

            nursery.start_soon(run)
            await slot.ready.wait()
            await send.send(int(signal.SIGTERM))
            while not draining.exists():  # noqa: ASYNC110 (a file the child writes: no event to wait on)
                await trio.sleep(0.05)
            await send.send(int(signal.SIGINT))
    assert status == [0]
    assert slot.returncode == 0 and not slot.killed


async def test_two_signals_read_before_the_shutdown_began_are_a_drain_then_a_stop_now(tmp_path: Path) -> None:
    """SIGTERM and SIGINT together (or a quick double Ctrl-C): both can be read before run() resumes
    into its shutdown. The second was taken for another first one and dropped, and the children
    drained for the whole stop wait and were killed (exit status 1)."""
    supervisor = ProcessSupervisor(
        count=1,
        command=lambda i: [sys.executable, "-c", _DRAINING_FOR_LONG, str(tmp_path / "draining")],
        grpc_address="127.0.0.1:1",
        stop_wait_s=1000.0,  # past the hang guard: only the stop-now signal ends this child in time
    )
    (slot,) = supervisor._slots

    async def signals() -> AsyncIterator[int]:
        await slot.ready.wait()
        # No checkpoint between the two: the watcher reads both before run() can resume.
        yield int(signal.SIGTERM)
        yield int(signal.SIGINT)
        await trio.sleep_forever()

    with trio.fail_after(15):
        assert await supervisor.run(signals()) == 0
    assert slot.returncode == 0 and not slot.killed


async def test_the_first_signal_during_a_drain_a_failed_start_began_is_not_a_stop_now(tmp_path: Path) -> None:
    """A child whose first start fails stops every process (a drain). The operator's (or service
    manager's) one SIGTERM then was taken for a second signal: the serving sibling was told to stop
    now and its calls were cut, where a first signal drains."""
    supervisor = ProcessSupervisor(
        count=2,
        command=lambda i: (
            [sys.executable, "-c", _DRAINING_FOR_LONG, str(tmp_path / "draining")]
            if i == 0
            else _stand_in("signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n" + "time.sleep(1.0)\nsys.exit(1)\n")
        ),
        grpc_address="127.0.0.1:1",
        stop_wait_s=6.0,  # the draining sibling outlasts it: killed, unless told to stop now
    )
    serving = supervisor._slots[0]

    async def signals() -> AsyncIterator[int]:
        await supervisor._stop.wait()  # the failed start's drain is under way
        yield int(signal.SIGTERM)
        await trio.sleep_forever()

    with trio.fail_after(30):
        assert await supervisor.run(signals()) == 1  # the failed start's status
    assert serving.killed  # drained for the whole stop wait: no stop-now reached it


async def test_a_child_may_take_discoverys_refresh_timeout_on_top_of_its_own_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A child's start waits for discovery's first refresh, up to --discovery-refresh-timeout-s (up to
    an hour): the parent's wait for its addresses counts that in, where a fixed 60 s killed a child
    a single serve would have started."""
    limit = startup_timeout(120.0)
    assert limit == STARTUP_TIMEOUT_S + 120.0
    supervisor = ProcessSupervisor(
        count=1, command=lambda i: ["true"], grpc_address="127.0.0.1:1", stop_wait_s=1.0, startup_timeout_s=limit
    )
    line = ADDRESS_LINE.format(grpc="127.0.0.1:1", debug="127.0.0.1:2") + "\n"
    for after_s, expected in ((150.0, "127.0.0.1:2"), (limit + 1.0, None)):
        send, receive = trio.testing.memory_stream_one_way_pair()

        async def slow_start(after_s: float = after_s, send: trio.abc.SendStream = send) -> None:
            await trio.sleep(after_s)
            await send.send_all(line.encode())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_start)
            assert await supervisor._address_of(supervisor._slots[0], receive) == expected
            nursery.cancel_scope.cancel()



@pytest.mark.parametrize(
    "case", ["a supervised child", "a standalone serve", "a standalone serve on a full disk", "a parent of 2"]
)
async def test_a_serve_whose_address_line_cannot_be_written_is_not_a_listen_failure(
    nursery: trio.Nursery, case: str
) -> None:
    """The address line's write error (BrokenPipeError with its reader gone, ENOSPC on /dev/full) was
    caught by the listen-failure handler: "[Errno 32] Broken pipe", status 1, no drain; a parent of
    ``--processes`` died of it with a traceback and took its children along. A supervised child
    whose parent died during its start-up is gone: it drains, as at its stdin's end. Any other serve
    says so and goes on serving until it is stopped."""
    with trio.fail_after(90):
        cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        extra = {
            "a supervised child": ("--supervised-process=0", "--supervised-processes=1"),
            "a parent of 2": ("--processes=2",),
        }.get(case, ())
        full_disk = case.endswith("full disk")
        stdout = os.open("/dev/full", os.O_WRONLY) if full_disk else subprocess.PIPE
        try:
            proc = await trio.lowlevel.open_process(
                _serve_command(addrs, *extra), stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.PIPE
            )
        finally:
            if full_disk:
                os.close(stdout)
        log = Lines()
        try:
            assert proc.stdin is not None and proc.stderr is not None
            nursery.start_soon(log.collect, proc.stderr)
            if proc.stdout is not None:
                await proc.stdout.aclose()  # nobody reads the address line
            await log.wait_for(re.compile("the address line could not be printed"))
            if case == "a supervised child":
                await log.wait_for(re.compile("the supervising parent is gone: draining"))
            else:
                assert proc.returncode is None, log.text()
                proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0, log.text()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        summaries = 2 if case == "a parent of 2" else 1
        await log.wait_for(_SUMMARY if extra else re.compile(r"kvroute serve: stopped; Route calls"), summaries)
        failure = re.compile(r"kvroute serve(?: \(process \d\))?: \[Errno|Traceback")  # as a listen failure said it
        assert not any(failure.search(line) for line in log.lines), log.text()


# --- supervision, with stand-in children ------------------------------------------------------------

_ANNOUNCE = 'sys.stdout.write("kvroute serve: Route gRPC on 127.0.0.1:1, debug HTTP on http://127.0.0.1:2\\n")\n'


def _stand_in(body: str) -> list[str]:
    """A child that runs ``body`` (``os``, ``signal``, ``sys`` and ``time`` imported); it sleeps far
    past any hang guard, so only what the parent does to it ends it in time."""
    return [
        sys.executable,
        "-c",
        "import os, signal, sys, time\n" + _UNBLOCK_AS_SERVE + body + "sys.stdout.flush()\ntime.sleep(1000)\n",
    ]


async def _signals_once_serving(ready: trio.Event, *signums: signal.Signals) -> AsyncIterator[int]:
    """The parent's signals: none until ``ready`` (a slot's child serving), then ``signums``."""
    await ready.wait()
    for signum in signums:
        yield int(signum)
    await trio.sleep_forever()


def _script_children(
    supervisor: ProcessSupervisor, monkeypatch: pytest.MonkeyPatch, served_s: list[float]
) -> list[float]:
    """Replace the supervisor's children with a script: start i served ``served_s[i]`` and exited 1;
    the last one asks for the stop. Returns the (clock) times of the starts, filled in as they come."""
    starts: list[float] = []

    async def scripted_child(slot: serve_processes._Slot) -> float:
        starts.append(trio.current_time())
        slot.ever_served, slot.returncode = True, 1
        if len(starts) == len(served_s):
            supervisor._stop.set()
        return served_s[len(starts) - 1]

    monkeypatch.setattr(supervisor, "_run_child", scripted_child)
    return starts


async def test_restart_backoff_doubles_to_its_cap_and_is_short_again_after_a_stable_run(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    supervisor = ProcessSupervisor(count=1, command=lambda i: ["true"], grpc_address="127.0.0.1:1", stop_wait_s=1.0)
    crashes = 8  # enough doublings to reach the cap and stay there
    starts = _script_children(supervisor, monkeypatch, [1.0] * crashes + [STABLE_AFTER_S, 1.0, 1.0])
    assert await supervisor.run(_signals_once_serving(trio.Event())) == EXIT_OK
    doubling = [min(RESTART_BACKOFF_MIN_S * 2**n, RESTART_BACKOFF_MAX_S) for n in range(crashes)]
    assert doubling[-2:] == [RESTART_BACKOFF_MAX_S] * 2  # capped, not doubled past it
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert gaps == [*doubling, RESTART_BACKOFF_MIN_S, 2 * RESTART_BACKOFF_MIN_S]


async def test_a_stop_during_a_restart_backoff_does_not_wait_it_out(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve_processes, "RESTART_BACKOFF_MIN_S", 1000.0)
    supervisor = ProcessSupervisor(count=1, command=lambda i: ["true"], grpc_address="127.0.0.1:1", stop_wait_s=1.0)
    starts = _script_children(supervisor, monkeypatch, [1.0, 1.0])
    stopped_at: list[float] = []

    async def signals() -> AsyncIterator[int]:
        await trio.sleep(1.0)  # the child crashed at 0: its slot waits out a 1000 s backoff
        stopped_at.append(trio.current_time())
        yield int(signal.SIGTERM)
        await trio.sleep_forever()

    assert await supervisor.run(signals()) == EXIT_OK  # nothing was running: a clean stop
    assert len(starts) == 1 and trio.current_time() == stopped_at[0]


async def test_a_first_start_that_fails_with_a_configuration_error_exits_2() -> None:
    supervisor = ProcessSupervisor(
        count=1, command=lambda i: _stand_in("sys.exit(2)\n"), grpc_address="127.0.0.1:1", stop_wait_s=10.0
    )
    with trio.fail_after(15):
        assert await supervisor.run(_signals_once_serving(supervisor._slots[0].ready)) == 2


@pytest.mark.parametrize("start_up", ["print('no addresses here')\n", ""], ids=["garbage", "nothing"])
async def test_a_child_without_its_address_line_is_killed_and_fails_the_start(start_up: str) -> None:
    supervisor = ProcessSupervisor(
        count=1,
        command=lambda i: _stand_in(start_up),
        grpc_address="127.0.0.1:1",
        stop_wait_s=10.0,
        startup_timeout_s=1.0,
    )
    (slot,) = supervisor._slots
    with trio.fail_after(15):  # not killed, the child sleeps 1000 s
        assert await supervisor.run(_signals_once_serving(slot.ready)) == EXIT_CHILD_FAILED
    assert slot.returncode == -int(signal.SIGKILL) and not slot.ever_served


async def test_a_child_started_while_stopping_is_told_to_drain_at_once() -> None:
    """It missed the drain signal sent to the children running when the stop began."""
    supervisor = ProcessSupervisor(
        count=1,
        command=lambda i: _stand_in("signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n" + _ANNOUNCE),
        grpc_address="127.0.0.1:1",
        stop_wait_s=10.0,
    )
    (slot,) = supervisor._slots
    supervisor._stopping = True
    with trio.fail_after(15):  # not signalled, the child sleeps 1000 s
        await supervisor._run_child(slot)
    # Drained, or ended by the signal before its handler was in place.
    assert slot.returncode in (0, -int(signal.SIGTERM))


async def test_a_child_that_does_not_drain_within_the_stop_wait_is_killed_and_the_exit_says_so() -> None:
    supervisor = ProcessSupervisor(
        count=1,
        command=lambda i: _stand_in("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + _ANNOUNCE),
        grpc_address="127.0.0.1:1",
        stop_wait_s=0.5,
    )
    (slot,) = supervisor._slots
    with trio.fail_after(15):  # not killed, the child sleeps 1000 s
        assert await supervisor.run(_signals_once_serving(slot.ready, signal.SIGTERM)) == EXIT_CHILD_FAILED
    assert slot.killed and slot.returncode == -int(signal.SIGKILL)


async def test_a_child_whose_drain_fails_makes_the_exit_status_1_and_is_not_restarted() -> None:
    supervisor = ProcessSupervisor(
        count=1,
        command=lambda i: _stand_in("signal.signal(signal.SIGTERM, lambda *_: os._exit(3))\n" + _ANNOUNCE),
        grpc_address="127.0.0.1:1",
        stop_wait_s=10.0,
    )
    (slot,) = supervisor._slots
    with trio.fail_after(15):
        assert await supervisor.run(_signals_once_serving(slot.ready, signal.SIGTERM)) == EXIT_CHILD_FAILED
    assert slot.returncode == 3 and slot.restarts == 0 and slot.starts == 1
