"""The hostile-input attacks against `kvroute serve` on loopback, with before/after figures.

    python bench/bench_hostile.py [--serve-venv PATH]

Starts `kvroute sim-cluster` (8 workers) and `kvroute serve` as child processes of the kvroute
found on PATH (or in --serve-venv, to measure another build), then, with a plain grpcio client:

- normal-request latency (1,024 tokens, 30 ms budget, sequential) alone and while one, then four,
  maximal legal requests (262,144 tokens each) are resent in a loop;
- the share of calls answered (not DEADLINE_EXCEEDED) with 5 ms and 20 ms client deadlines, 8 threads;
- normal-request latency while /debug/decisions?limit=1024 is read in a loop;
- the serve process's RSS after 300 requests with a 3.9 MB request_id.

Prints one table. Bounded: fixed request counts, every call with a client deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable

import grpc

from kvroute_sim.stats import percentile
from router.wire import router_v1_pb2

ROUTE = "/kvroute.v1.Router/Route"
BUDGET_MS = 30


def _p(values: list[float], q: float) -> float:
    return percentile(values, q)  # the one definition (nearest rank)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Client:
    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
        self.call = self.channel.unary_unary(ROUTE, None, None)

    def route(
        self, request_id: str, tokens: list[int], timeout: float, budget_ms: int = BUDGET_MS
    ) -> tuple[float, str]:
        body = router_v1_pb2.RouteRequest(request_id=request_id, token_ids=tokens, budget_ms=budget_ms)
        start = time.perf_counter()
        try:
            reply = router_v1_pb2.RouteDecision.FromString(self.call(body.SerializeToString(), timeout=timeout))
            outcome = f"{reply.route_source}/{reply.reason}"
        except grpc.RpcError as exc:
            outcome = exc.code().name
        return (time.perf_counter() - start) * 1000, outcome


def _normal(client: Client, n: int, label: str) -> list[float]:
    tokens = list(range(1024))
    return [client.route(f"{label}-{i}", tokens, timeout=1.0)[0] for i in range(n)]


def _in_background(work: Callable[[], None], threads: int) -> tuple[threading.Event, list[threading.Thread]]:
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    started = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for thread in started:
        thread.start()
    return stop, started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-venv", default=None, help="a venv whose kvroute runs serve (default: PATH's)")
    args = parser.parse_args()
    kvroute = os.path.join(args.serve_venv, "bin", "kvroute") if args.serve_venv else "kvroute"
    sim = subprocess.Popen(
        [kvroute, "sim-cluster", "--workers", "8", "--kvcm-replicas", "1", "--duration", "300", "--print-json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    serve: subprocess.Popen[str] | None = None
    try:
        assert sim.stdout is not None
        cluster = json.loads(sim.stdout.readline())
        workers = ",".join(w["host_ip_port"] for w in cluster["workers"])
        serve = subprocess.Popen(
            [
                kvroute,
                "serve",
                "--kvcm-bootstrap",
                ",".join(cluster["kvcm_bootstrap"]),
                "--workers",
                workers,
                "--kvcm-instance-id",
                "demo_64",  # sim-cluster accepts any instance id by default
                "--grpc-listen",
                "127.0.0.1:0",
                "--debug-listen",
                "127.0.0.1:0",
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert serve.stdout is not None
        line = serve.stdout.readline()
        found = re.search(r"Route gRPC on (\S+), debug HTTP on (http://\S+)", line)
        if found is None:
            raise SystemExit(f"serve did not start: {line!r}")
        grpc_target, debug = found.group(1), found.group(2)
        client = Client(grpc_target)
        _normal(client, 200, "warm")
        rows: list[tuple[str, str]] = []

        alone = _normal(client, 300, "alone")
        rows.append(("normal route alone, p50 / p99 ms", f"{_p(alone, 50):.2f} / {_p(alone, 99):.2f}"))

        # Serialised once: building a 262,144-id message per call would hold the client's own GIL and
        # slow the client's measuring thread, not the server.
        huge = router_v1_pb2.RouteRequest(request_id="huge", token_ids=range(262_144), budget_ms=1000)
        huge_bytes = huge.SerializeToString()

        def send_huge() -> None:
            with contextlib.suppress(grpc.RpcError):
                client.call(huge_bytes, timeout=5.0)

        for senders in (1, 4):
            stop, threads = _in_background(send_huge, senders)
            loaded = _normal(client, 300, f"beside-huge-{senders}")
            stop.set()
            for thread in threads:
                thread.join(10)
            late = sum(ms > BUDGET_MS + 5 for ms in loaded) / len(loaded)
            rows.append(
                (
                    f"beside {senders} maximal request(s) resent in a loop, p50 / p99 ms, late",
                    f"{_p(loaded, 50):.2f} / {_p(loaded, 99):.2f}, {late:.0%}",
                )
            )

        for deadline_ms in (5, 20):
            answered: list[bool] = []
            lock = threading.Lock()

            def caller(
                deadline_s: float = deadline_ms / 1000,
                answered: list[bool] = answered,
                lock: threading.Lock = lock,
            ) -> None:
                for i in range(100):
                    _, outcome = client.route(f"short-{i}", list(range(1024)), timeout=deadline_s)
                    with lock:
                        answered.append(outcome != "DEADLINE_EXCEEDED")

            callers = [threading.Thread(target=caller) for _ in range(8)]
            for thread in callers:
                thread.start()
            for thread in callers:
                thread.join(60)
            rows.append(
                (f"answered with a {deadline_ms} ms client deadline, 8 threads", f"{sum(answered) / len(answered):.1%}")
            )

        _normal(client, 1100, "fill-ring")

        def read_decisions() -> None:
            with urllib.request.urlopen(f"{debug}/debug/decisions?limit=1024", timeout=30) as reply:
                reply.read()

        stop, threads = _in_background(read_decisions, 1)
        during = _normal(client, 300, "during-debug")
        stop.set()
        for thread in threads:
            thread.join(30)
        late = sum(ms > BUDGET_MS + 5 for ms in during) / len(during)
        rows.append(("during /debug/decisions?limit=1024 reads, p99 ms, late", f"{_p(during, 99):.2f}, {late:.0%}"))

        before = _rss_mb(serve.pid)
        big_id = "x" * 3_900_000
        outcomes: dict[str, int] = {}
        for i in range(300):
            body = router_v1_pb2.RouteRequest(request_id=f"{i}{big_id}", token_ids=range(64), budget_ms=BUDGET_MS)
            try:
                client.call(body.SerializeToString(), timeout=5.0)
                outcome = "OK"
            except grpc.RpcError as exc:
                outcome = exc.code().name
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        rows.append(
            (
                "RSS before / after 300 requests with a 3.9 MB id",
                f"{before:.0f} / {_rss_mb(serve.pid):.0f} MB {outcomes}",
            )
        )

        width = max(len(k) for k, _ in rows)
        print(f"kvroute from {kvroute}")
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
    finally:
        for process in (serve, sim):
            if process is not None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()


if __name__ == "__main__":
    main()
