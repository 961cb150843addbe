"""Worker-status probe latency on loopback gRPC: the WorkerProber against SimWorkers in another process.

Rows, measured in the same run (SimWorkers served by ``kvroute sim-cluster`` in a child process):
  raw floor        GrpcRawRpc.call of GetWorkerStatus (bytes only: no decode, no prober)
  client           WorkerStatusClient.get_worker_status (RPC + decode): the prober's floor
  probe 1 worker   prober.probe([w]).wait_all() with the cache off (fresh_ttl_s = 0): one RPC each
  probe fan-out    prober.probe(all W workers).wait_all(): W RPCs in parallel (a request's candidates)
  raw fan-out      the same W calls as GrpcRawRpc.call tasks in one nursery: the fan-out's floor
  cache hit        prober.probe([w]) answered from a fresh status: no RPC, in-process cost

Latency p50/p99 in ms (µs for the cache hit). Bounded: --count calls per row, a global trio
deadline, and a --duration on the child process.

Run: ``python bench/bench_probe.py [--count N] [--workers W]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable

import grpc
import trio

from actors.channel_pool import ChannelPool
from actors.worker_prober import ProbeOutcome, WorkerProber
from kvroute_sim.stats import percentile
from router.config import ChannelPoolConfig, ProberConfig
from router.transport.clients import WorkerStatusClient
from router.transport.grpc_adapter import GrpcRawRpc
from router.types import WorkerAddr
from router.wire import decode, paths

BENCH_DEADLINE_S = 300.0


async def timed(count: int, once: Callable[[int], Awaitable[None]]) -> list[float]:
    """Per-call latency in seconds, after count // 10 warm-up calls."""
    for i in range(count // 10):
        await once(i)
    out = []
    for i in range(count):
        start = trio.current_time()
        await once(i)
        out.append(trio.current_time() - start)
    return out


async def bench(workers: list[WorkerAddr], count: int) -> list[tuple[str, list[float], str]]:
    rows: list[tuple[str, list[float], str]] = []
    async with trio.open_nursery() as nursery:
        pool: ChannelPool[grpc.Channel] = ChannelPool(ChannelPoolConfig())
        await nursery.start(pool.run)
        rpc = GrpcRawRpc(pool, start_off_loop=ChannelPoolConfig().start_off_loop)
        request = decode.encode_status_version(-1)

        async def raw(i: int) -> None:
            await rpc.call(workers[i % len(workers)].status_target, paths.WORKER_GET_STATUS, request)

        rows.append(("raw floor (GrpcRawRpc)", await timed(count, raw), "ms"))
        client = WorkerStatusClient(rpc)

        async def typed(i: int) -> None:
            await client.get_worker_status(workers[i % len(workers)].status_target, -1)

        rows.append(("client (RPC + decode)", await timed(count, typed), "ms"))

        # Default budget (2,000 probes/s is not reached by one sequential caller); cache off.
        uncached = WorkerProber(dataclasses.replace(ProberConfig(), fresh_ttl_s=0.0), client)
        await nursery.start(uncached.run)

        async def probe_one(i: int) -> None:
            handle = uncached.probe([workers[i % len(workers)]], trio.current_time() + 1.0)
            await handle.wait_all()
            assert handle.results()[0].outcome is ProbeOutcome.OK, handle.results()

        rows.append(("probe 1 worker (RPC)", await timed(count, probe_one), "ms"))

        async def probe_all(i: int) -> None:
            handle = uncached.probe(workers, trio.current_time() + 1.0)
            await handle.wait_all()
            assert all(r.outcome is ProbeOutcome.OK for r in handle.results())

        rows.append((f"probe fan-out x{len(workers)} (RPCs)", await timed(count // 4, probe_all), "ms"))

        async def raw_all(i: int) -> None:
            async with trio.open_nursery() as calls:
                for worker in workers:
                    calls.start_soon(rpc.call, worker.status_target, paths.WORKER_GET_STATUS, request)

        rows.append((f"raw fan-out x{len(workers)} (GrpcRawRpc)", await timed(count // 4, raw_all), "ms"))

        # Statuses kept fresh for the whole row, so every lookup is a hit.
        long_ttl = dataclasses.replace(ProberConfig(), fresh_ttl_s=60.0, max_status_age_s=60.0)
        cached = WorkerProber(long_ttl, client)
        await nursery.start(cached.run)
        await cached.probe(workers, trio.current_time() + 1.0).wait_all()

        async def cache_hit(i: int) -> None:
            handle = cached.probe([workers[i % len(workers)]], trio.current_time() + 1.0)
            assert handle.pending == 0

        rows.append(("cache hit (no RPC)", await timed(count, cache_hit), "us"))
        health = uncached.snapshot()
        print(
            f"uncached prober: {health.probes_ok} ok, {health.probes_failed} failed, peak in-flight "
            f"{health.peak_inflight}; cached prober hit ratio {cached.snapshot().cache_hit_ratio:.3f}"
        )
        await pool.aclose()
        nursery.cancel_scope.cancel()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="calls per row (fan-out: count / 4)")
    parser.add_argument("--workers", type=int, default=8, help="simulated workers (the fan-out width)")
    args = parser.parse_args()
    if args.count < 10 or args.workers < 1:
        parser.error("--count must be >= 10 and --workers >= 1")
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "sim-cluster",
            "--workers",
            str(args.workers),
            "--kvcm-replicas",
            "1",
            "--print-json",
            "--duration",
            str(BENCH_DEADLINE_S),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        addresses = json.loads(child.stdout.readline())
        workers = [WorkerAddr.from_http(w["ip"], w["http_port"]) for w in addresses["workers"]]

        async def bounded() -> list[tuple[str, list[float], str]]:
            with trio.fail_after(BENCH_DEADLINE_S):
                return await bench(workers, args.count)

        rows = trio.run(bounded)
    finally:
        child.terminate()
        child.wait(timeout=10)
    print(f"{'row':<32} {'p50':>9} {'p99':>9}   (n, unit)")
    for name, samples, unit in rows:
        scale = 1e3 if unit == "ms" else 1e6
        p50, p99 = percentile(samples, 50) * scale, percentile(samples, 99) * scale
        print(f"{name:<32} {p50:>9.3f} {p99:>9.3f}   ({len(samples)}, {unit})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
