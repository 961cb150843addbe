"""SimCluster façade, seeded traffic, and ``kvroute sim-cluster`` queried by a plain grpc client."""

from __future__ import annotations

import argparse
import json
import selectors
import signal
import subprocess
import sys
from typing import Any

import grpc
import httpx
import pytest
import trio
import trio.testing

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.cluster_cli import build_cluster, configure
from kvroute_sim.sim.traffic import TrafficSpec, TrafficStats, run_traffic, seed_prefixes, system_prompt
from kvroute_sim.sim.worker import SimWorkerOverloaded, WorkerFaults, WorkerSpec
from router.keys import block_keys
from router.transport.clients import KvcmClient, WorkerStatusClient
from router.transport.errors import NotLeader, RemoteError
from router.transport.memory_adapter import MemoryNetwork
from router.types import CacheQuery, HostMatch, KeyFamily, QueryType, WorkerAddr
from router.wire import decode, paths

KEYS = tuple(range(50, 60))


def test_memory_addresses_follow_the_conventions() -> None:
    cluster = SimCluster(3, kvcm_replicas=2)
    addresses = cluster.serve_memory(MemoryNetwork())
    assert addresses.kvcm_targets == ("127.0.1.1:6381", "127.0.1.2:6381")
    assert addresses.leader == "kvcm-0"
    assert addresses.workers == tuple(WorkerAddr.from_http(f"127.1.0.{i}", 8000) for i in (1, 2, 3))
    assert addresses.workers[0].status_target == "127.1.0.1:8001"
    assert addresses.kvcm_bootstrap == "127.0.1.1:6381,127.0.1.2:6381"
    assert addresses.workers_arg == "127.1.0.1:8000,127.1.0.2:8000,127.1.0.3:8000"
    assert json.loads(addresses.dumps())["workers"][2]["status_target"] == "127.1.0.3:8001"
    with pytest.raises(RuntimeError, match="already served"):
        cluster.serve_memory(MemoryNetwork())


def test_run_prefill_hits_the_cache_and_records_the_prompt() -> None:
    cluster = SimCluster([WorkerSpec(prefill_tokens_per_s=1000.0, kv_capacity_blocks=12)] * 2, block_size=10)
    cluster.serve_memory(MemoryNetwork())
    first = cluster.run_prefill(0, "a", KEYS, 105, 0.0)
    assert (first.cached_tokens, first.local_blocks, first.evicted_blocks) == (0, 0, 0)
    assert first.ttft_s == pytest.approx(0.105)
    host0 = cluster.worker_addr(0).http_target
    second = cluster.run_prefill(host0, "b", KEYS, 105, 1.0)
    assert (second.cached_tokens, second.local_blocks) == (100, 10)
    assert second.ttft_s == pytest.approx(0.005)
    third = cluster.run_prefill(0, "c", tuple(range(200, 205)), 50, 2.0)
    assert third.evicted_blocks == 3  # 15 blocks into a 12-block LRU
    assert cluster.kvcm.match(KEYS) == (HostMatch(host0, 7, 0, 7),)
    with pytest.raises(ValueError, match="worker"):
        cluster.run_prefill("10.0.0.1:1", "d", KEYS, 10, 3.0)


def test_a_rejected_prefill_is_not_recorded_in_the_index() -> None:
    cluster = SimCluster([WorkerSpec(max_tasks=1)])
    cluster.serve_memory(MemoryNetwork())
    cluster.run_prefill(0, "a", (1, 2), 2 * cluster.block_size, 0.0)
    with pytest.raises(SimWorkerOverloaded):
        cluster.run_prefill(0, "b", (7, 8), 2 * cluster.block_size, 0.0)
    assert cluster.kvcm.match((7, 8)) == ()


async def test_followers_answer_queries_when_the_cluster_says_so(autojump_clock: trio.testing.MockClock) -> None:
    for followers_answer in (False, True):
        cluster = SimCluster(2, kvcm_replicas=2, followers_answer_queries=followers_answer)
        network = MemoryNetwork()
        addresses = cluster.serve_memory(network)
        cluster.run_prefill(0, "seed", KEYS, len(KEYS) * cluster.block_size, 0.0)
        follower = next(target for node, target in addresses.kvcm_nodes if node != addresses.leader)
        query = KvcmClient(network).get_host_cache_state(follower, CacheQuery("", QueryType.PREFIX_MATCH, KEYS))
        if not followers_answer:
            with pytest.raises(NotLeader):
                await query
            continue
        state = await query
        assert [(h.host_ip_port, h.local) for h in state.hosts] == [(addresses.workers[0].http_target, len(KEYS))]


def test_unserved_cluster_and_bad_sizes() -> None:
    with pytest.raises(RuntimeError, match="not served"):
        _ = SimCluster(1).addresses
    with pytest.raises(ValueError, match="workers"):
        SimCluster([])
    with pytest.raises(ValueError, match="kvcm_replicas"):
        SimCluster(1, kvcm_replicas=0)


def test_seeded_prefixes_match_for_their_holders() -> None:
    cluster = SimCluster(4)
    cluster.serve_memory(MemoryNetwork())
    spec = TrafficSpec(groups=3, system_prompt_tokens=256, holders_per_group=2, seed=7)
    seeded = seed_prefixes(cluster, spec)
    assert [s.group for s in seeded] == [0, 1, 2]
    for prefix in seeded:
        keys = block_keys(system_prompt(prefix.group, 256), cluster.block_size, KeyFamily.RTP)
        assert prefix.block_keys == keys and len(keys) == 4
        assert len(prefix.workers) == 2
        assert {h.host_ip_port: h.local for h in cluster.kvcm.match(keys)} == dict.fromkeys(prefix.workers, 4)


async def test_traffic_loads_workers_and_caches(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(3)
    network = MemoryNetwork()
    addresses = cluster.serve_memory(network)
    spec = TrafficSpec(groups=2, system_prompt_tokens=512, rate_per_s=100.0, seed=3)
    seed_prefixes(cluster, spec)
    stats = TrafficStats()
    with trio.move_on_after(1.0):
        await run_traffic(cluster, spec, stats)
    assert stats.sent > 50 and stats.rejected == 0
    assert sum(w.requests_submitted for w in cluster.workers) == stats.sent
    keys = block_keys(system_prompt(0, 512), cluster.block_size, KeyFamily.RTP)
    state = await KvcmClient(network).get_host_cache_state(
        addresses.kvcm_targets[0], CacheQuery("", QueryType.PREFIX_MATCH, keys)
    )
    assert state.hosts and all(h.local == len(keys) for h in state.hosts)
    status = await WorkerStatusClient(network).get_worker_status(addresses.workers[0].status_target, -1)
    assert status.status_version > 1


async def test_full_affinity_traffic_goes_to_the_holder(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(4)
    cluster.serve_memory(MemoryNetwork())
    spec = TrafficSpec(groups=1, system_prompt_tokens=512, holders_per_group=1, rate_per_s=100.0, affinity=1.0)
    [seeded] = seed_prefixes(cluster, spec)
    stats = TrafficStats()
    with trio.move_on_after(1.0):
        await run_traffic(cluster, spec, stats)
    holder = cluster.worker_index(seeded.workers[0])
    assert stats.sent > 50 and stats.rejected == 0
    assert [w.requests_submitted for w in cluster.workers] == [stats.sent if i == holder else 0 for i in range(4)]


async def test_traffic_arrives_on_the_trio_clock(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster([WorkerSpec(prefill_tokens_per_s=1e9)] * 2)
    cluster.serve_memory(MemoryNetwork())
    spec = TrafficSpec(groups=1, system_prompt_tokens=128, rate_per_s=200.0)
    with trio.move_on_after(1.0):
        await run_traffic(cluster, spec)
    # Each prefill takes under a microsecond: the workers were busy in the second half of the run
    # only if requests arrived then, at the trio time they were sent.
    assert cluster.busy_share(0.5, 1.0) > 0


async def test_grpc_serving_stops_cleanly_on_cancel() -> None:
    with trio.fail_after(10):
        cluster = SimCluster(2, kvcm_replicas=2)
        async with trio.open_nursery() as nursery:
            addresses = await nursery.start(cluster.serve_grpc)
            nursery.cancel_scope.cancel()
        # Every server is stopped: a fresh plain client is refused.
        reply = await trio.to_thread.run_sync(_plain_call, addresses.kvcm_targets[0], paths.KVCM_GET_CLUSTER_INFO, b"")
        assert reply == grpc.StatusCode.UNAVAILABLE


def _plain_call(target: str, method_path: str, request: bytes) -> Any:
    """A plain grpcio client call on a pinned path; returns the reply bytes or the failure code."""
    with grpc.insecure_channel(target) as channel:
        try:
            return channel.unary_unary(method_path, None, None)(request, timeout=5)
        except grpc.RpcError as exc:
            return exc.code()


def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        assert selector.select(timeout_s), "sim-cluster printed nothing in time"
    return proc.stdout.readline()


def _start_cli(*extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-P", "-m", "router.cli", "sim-cluster", "--workers", "2", "--print-json", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_cli_is_queried_by_a_plain_grpc_client_and_exits_0_on_sigterm() -> None:
    proc = _start_cli("--duration", "60", "--groups", "1")
    try:
        document = json.loads(_read_line(proc, 30))
        leader = next(n["target"] for n in document["kvcm_nodes"] if n["node_id"] == document["kvcm_leader"])
        assert leader in document["kvcm_bootstrap"] and len(document["kvcm_bootstrap"]) == 3

        info = decode.decode_cluster_info(
            _plain_call(leader, paths.KVCM_GET_CLUSTER_INFO, decode.encode_cluster_info_request("")), leader
        )
        assert info.leader is not None and info.leader.target == leader

        seeded = document["seeded_prefixes"][0]
        query = CacheQuery("", QueryType.PREFIX_MATCH, tuple(seeded["block_keys"]))
        raw = _plain_call(leader, paths.KVCM_GET_HOST_CACHE_STATE, decode.encode_cache_query(query))
        state = decode.decode_cache_state(raw, leader, len(query.block_keys))
        assert {h.host_ip_port: h.local for h in state.hosts} == dict.fromkeys(
            seeded["workers"], len(seeded["block_keys"])
        )

        worker = document["workers"][0]
        raw = _plain_call(worker["status_target"], paths.WORKER_GET_STATUS, decode.encode_status_version(-1))
        status = decode.decode_worker_status(raw, worker["status_target"])
        assert status.alive and status.status_version >= 1
        assert worker["grpc_port"] == worker["http_port"] + 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr.decode()


def test_cli_stops_by_itself_after_duration() -> None:
    proc = _start_cli("--duration", "0.5", "--no-seed")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()
    document = json.loads(stdout.splitlines()[0])
    assert document["seeded_prefixes"] == [] and len(document["workers"]) == 2


def test_cli_serves_the_master_routing_to_a_prefix_holder() -> None:
    proc = _start_cli("--duration", "60", "--groups", "1", "--holders-per-group", "1", "--master-replicas", "2")
    try:
        document = json.loads(_read_line(proc, 30))
        hosts = document["master_hosts"]
        assert len(hosts) == 2 and document["master_elected"] == hosts[0]
        seeded = document["seeded_prefixes"][0]
        body = {"request_id": "r1", "block_cache_keys": seeded["block_keys"], "block_size": 64, "seq_len": 640}
        with httpx.Client(trust_env=False, timeout=10) as client:
            info = client.post(f"http://{hosts[1]}/rtp_llm/master/info", json={}).json()
            assert info["real_master_host"] == hosts[0]
            reply = client.post(f"http://{hosts[0]}/rtp_llm/schedule", json=body).json()
        assert reply["success"] is True
        [status] = reply["server_status"]
        assert [f"{status['server_ip']}:{status['http_port']}"] == seeded["workers"]  # the holder, all idle
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr.decode()


def test_cli_prints_ready_to_paste_flags_with_and_without_a_master() -> None:
    command = [sys.executable, "-P", "-m", "router.cli", "sim-cluster", "--workers", "2", "--duration", "0.5"]
    with_master = subprocess.run([*command, "--master-replicas", "1"], capture_output=True, timeout=60, check=False)
    assert with_master.returncode == 0, with_master.stderr.decode()
    lines = with_master.stdout.decode().splitlines()
    [master_line] = [line for line in lines if line.startswith("--master-hosts ")]
    assert master_line.startswith("--master-hosts 127.0.0.1:") and "," not in master_line
    assert any(line.startswith("--kvcm-bootstrap ") for line in lines)
    assert any(line.startswith("--workers ") for line in lines)
    without = subprocess.run([*command, "--master-replicas", "0"], capture_output=True, timeout=60, check=False)
    assert without.returncode == 0, without.stderr.decode()
    assert "--master-hosts" not in without.stdout.decode() and "master " not in without.stdout.decode()


def test_cli_rejects_bad_flags_naming_them() -> None:
    result = subprocess.run(
        [sys.executable, "-P", "-m", "router.cli", "sim-cluster", "--kvcm-replicas", "0"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert b"--kvcm-replicas" in result.stderr
    negative = subprocess.run(
        [sys.executable, "-P", "-m", "router.cli", "sim-cluster", "--master-replicas", "-1"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert negative.returncode == 2 and b"--master-replicas" in negative.stderr


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("-1", "must be a finite number > 0, got -1"),
        ("0", "must be a finite number > 0, got 0"),
        ("inf", "must be a finite number > 0, got inf"),
        ("soon", "'soon' is not a number"),
    ],
)
def test_a_positive_flag_says_what_it_takes(
    given: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--duration -1 was refused as not ">= 0", while 0 too is refused."""
    parser = argparse.ArgumentParser()
    configure(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--duration", given])
    assert f"argument --duration: {message}\n" in capsys.readouterr().err
    assert parser.parse_args(["--duration", "0.5"]).duration == 0.5


async def test_sim_cluster_flags_reach_the_cluster_and_traffic(autojump_clock: trio.testing.MockClock) -> None:
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(
        [
            *("--workers", "2", "--role", "PDFUSION", "--no-report-block-size", "--block-size", "16"),
            *("--followers-answer-queries", "--instance-id", "dep_16", "--key-family", "vllm"),
            *("--traffic-rate", "5", "--kv-capacity-blocks", "99", "--prefill-tokens-per-s", "1234"),
        ]
    )
    cluster, traffic = build_cluster(args)
    assert cluster.block_size == 16
    assert {w.spec for w in cluster.workers} == {
        WorkerSpec(role="RoleType.PDFUSION", block_size=None, kv_capacity_blocks=99, prefill_tokens_per_s=1234.0)
    }
    assert (traffic.rate_per_s, traffic.key_family) == (5.0, KeyFamily.VLLM)
    network = MemoryNetwork()
    addresses = cluster.serve_memory(network)
    kvcm = KvcmClient(network)
    # A follower answers a query under the instance id; the leader refuses another instance id.
    follower = next(target for node, target in addresses.kvcm_nodes if node != addresses.leader)
    state = await kvcm.get_host_cache_state(follower, CacheQuery("dep_16", QueryType.PREFIX_MATCH, KEYS))
    assert state.hosts == ()
    leader = dict(addresses.kvcm_nodes)[addresses.leader or ""]
    with pytest.raises(RemoteError, match="instance_id"):
        await kvcm.get_host_cache_state(leader, CacheQuery("other", QueryType.PREFIX_MATCH, KEYS))


def test_cli_names_a_host_it_cannot_bind_in_one_line() -> None:
    """It printed a 73-line ExceptionGroup traceback."""
    host = "192.0.2.1"  # a documentation address: not this machine's
    result = subprocess.run(
        [sys.executable, "-P", "-m", "router.cli", "sim-cluster", "--duration", "1", "--host", host],
        capture_output=True,
        timeout=60,
        check=False,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert result.stdout == b""  # no address announced
    assert "Traceback" not in stderr
    # gRPC's own logger may add a line of its own; the command says it once, naming the flag.
    [line] = [line for line in stderr.splitlines() if line.startswith("kvroute sim-cluster:")]
    assert line.startswith(f"kvroute sim-cluster: --host {host}: cannot bind"), stderr


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("localhost", "must be an IP address"),
        ("no-such-host.invalid", "must be an IP address"),
        ("0.0.0.0", "not the wildcard 0.0.0.0"),
        ("::", "not the wildcard ::"),
    ],
)
def test_a_host_name_or_wildcard_is_refused_naming_the_flag(
    host: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--host`` is advertised as the replicas' and workers' ip:port: a name or a wildcard was
    advertised as it was given (localhost:41001, 0.0.0.0:41001)."""
    parser = argparse.ArgumentParser()
    configure(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--host", host])
    [error] = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "argument --host: must be " in error and message in error
    assert parser.parse_args(["--host", "::1"]).host == "::1"
    assert parser.parse_args([]).host == "127.0.0.1"


async def test_fleet_stats_count_peak_concurrency_across_workers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = SimCluster(6)
    network = MemoryNetwork()
    addresses = cluster.serve_memory(network)
    client = WorkerStatusClient(network)
    for worker in cluster.workers:
        worker.set_faults(WorkerFaults(delay_s=0.1))
    async with trio.open_nursery() as nursery:
        for addr in addresses.workers[:4]:
            for _ in range(2):
                nursery.start_soon(client.get_worker_status, addr.status_target, -1)
    fleet = cluster.worker_fleet_stats.get(paths.WORKER_GET_STATUS)
    assert (fleet.calls, fleet.in_flight, fleet.peak_in_flight) == (8, 0, 8)
    one = cluster.workers[0].stats.get(paths.WORKER_GET_STATUS)
    assert (one.calls, one.peak_in_flight) == (2, 2)
    assert cluster.workers[5].stats.get(paths.WORKER_GET_STATUS).calls == 0
