"""asyncio → trio bridge cost, for the asyncio host (router/asyncio_host.py).

Rows, measured in the same run and interleaved over rounds:
  executor + from_thread.run     loop.run_in_executor(trio.from_thread.run(fn, trio_token=...))
  run_sync_soon + call_soon_ts   TrioToken.run_sync_soon spawns a task in a nursery; the task
                                 completes an asyncio future with loop.call_soon_threadsafe
  AsyncioRouterHost.route        the real host (second mechanism) over a router with the KVCM
                                 fallback off and static workers: domain routing, no RPC

The first two bridge a trivial trio function (one checkpoint), so they show the bridge alone.
Per row: sequential latency p50/p99 (µs) and throughput with ``--concurrency`` calls in flight.

Run: ``python bench/bench_asyncio_bridge.py [--calls N] [--concurrency C] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import statistics
import threading
import time
from collections.abc import Awaitable, Callable

import trio

from kvroute_sim.stats import percentile
from router.asyncio_host import AsyncioRouterHost
from router.config import DiscoveryConfig, KvrouteConfig, RouterConfig
from router.types import RouteRequest

Call = Callable[[int], Awaitable[object]]


class TrioThread:
    """trio.run in a thread with one nursery for bridged calls."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,))
        self._thread.start()
        self._ready.wait()

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self.token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            self._ready.set()
            await self._stop.wait()

    def close(self) -> None:
        self.token.run_sync_soon(self._stop.set)
        self._thread.join()


async def _work(x: int) -> int:
    await trio.lowlevel.checkpoint()
    return x


def executor_bridge(tt: TrioThread, pool: concurrent.futures.ThreadPoolExecutor) -> Call:
    async def call(x: int) -> object:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, functools.partial(trio.from_thread.run, _work, x, trio_token=tt.token))

    return call


def soon_bridge(tt: TrioThread) -> Call:
    async def call(x: int) -> object:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()

        def settle(value: int) -> None:
            if not future.done():
                future.set_result(value)

        async def task() -> None:
            loop.call_soon_threadsafe(settle, await _work(x))

        tt.token.run_sync_soon(tt.nursery.start_soon, task)
        return await future

    return call


def host_call(host: AsyncioRouterHost) -> Call:
    async def call(x: int) -> object:
        return await host.route(RouteRequest(f"b{x}", token_ids=(1, 2, 3, 4)))

    return call


async def measure(call: Call, calls: int, concurrency: int) -> tuple[float, float, float]:
    latencies = []
    for i in range(calls):
        start = time.perf_counter()
        await call(i)
        latencies.append((time.perf_counter() - start) * 1e6)
    start = time.perf_counter()
    await asyncio.gather(*(call(i) for i in range(concurrency)))
    rate = concurrency / (time.perf_counter() - start)
    return percentile(latencies, 50), percentile(latencies, 99), rate


async def main(args: argparse.Namespace) -> None:
    tt = TrioThread()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=32)
    config = KvrouteConfig(
        router=RouterConfig(kvcm_fallback=False),
        discovery=DiscoveryConfig(workers="10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"),
    )
    rows: dict[str, list[tuple[float, float, float]]] = {}
    try:
        async with AsyncioRouterHost(config) as host:
            bridges = {
                "executor + from_thread.run": executor_bridge(tt, pool),
                "run_sync_soon + call_soon_ts": soon_bridge(tt),
                "AsyncioRouterHost.route": host_call(host),
            }
            for _ in range(args.rounds):
                for name, call in bridges.items():
                    rows.setdefault(name, []).append(await measure(call, args.calls, args.concurrency))
    finally:
        tt.close()
        pool.shutdown()
    print(f"{'bridge':32s} {'p50 µs':>8s} {'p99 µs':>8s} {'calls/s @' + str(args.concurrency):>14s}")
    for name, results in rows.items():
        # Each column is the median over the rounds of that round's figure (its nearest-rank p50/p99).
        p50 = statistics.median(r[0] for r in results)
        p99 = statistics.median(r[1] for r in results)
        rate = statistics.median(r[2] for r in results)
        print(f"{name:32s} {p50:8.1f} {p99:8.1f} {rate:14.0f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="sequential calls per round and row")
    parser.add_argument("--concurrency", type=int, default=2000, help="calls in flight for the throughput figure")
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
