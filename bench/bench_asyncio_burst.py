"""A burst of concurrent calls through the asyncio host (router/asyncio_host.py): how many are
answered after their budget, and where.

One asyncio program starts ``--calls`` ``route()`` calls at once (each with ``--budget-ms`` and a
caller deadline ``--deadline-ms`` after its start) against a router with the KVCM fallback off and
static workers (domain routing, no RPC), after a short warm-up. Per burst: the wall time, the
calls' latency from their start to their caller resuming (p50/p99/max), how many were answered
more than 5 ms past their budget, the answers by reason, and the host's counts (handed to the trio
thread, shed on the caller's loop). A late answer to a call that was handed over is mostly the
caller's own loop resuming it behind the burst's other tasks.

Run: ``python bench/bench_asyncio_burst.py [--calls 2000 20000] [--budget-ms 30] [--deadline-ms 100]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

from kvroute_sim.stats import percentile
from router.asyncio_host import AsyncioRouterHost
from router.config import DiscoveryConfig, KvrouteConfig, RouterConfig
from router.types import RouteRequest

LATE_SLACK_S = 0.005
WARM_CALLS = 200


async def burst(calls: int, budget_ms: float, deadline_ms: float) -> str:
    config = KvrouteConfig(
        router=RouterConfig(kvcm_fallback=False),
        discovery=DiscoveryConfig(workers="10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"),
    )
    async with AsyncioRouterHost(config) as host:
        loop = asyncio.get_running_loop()
        for i in range(WARM_CALLS):
            await host.route(RouteRequest(f"w{i}", token_ids=(1, 2, 3, 4), budget_ms=budget_ms))
        before = host.stats()
        latencies: list[float] = []
        reasons: collections.Counter[str] = collections.Counter()

        async def one(i: int) -> None:
            started = loop.time()
            request = RouteRequest(f"b{i}", token_ids=(1, 2, 3, 4), budget_ms=budget_ms)
            decision = await host.route(request, deadline=started + deadline_ms / 1000.0)
            latencies.append(loop.time() - started)
            reasons[decision.reason.value] += 1

        began = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(calls)))
        wall = time.monotonic() - began
        after = host.stats()
    late = sum(1 for s in latencies if s > budget_ms / 1000.0 + LATE_SLACK_S)
    ms = [s * 1000.0 for s in latencies]
    return (
        f"{calls:>7} | {wall * 1000:7.0f} | {percentile(ms, 50):6.1f} / {percentile(ms, 99):6.1f} / {max(ms):6.1f} | "
        f"{late:>6} | {after.handed - before.handed:>6} | {after.shed_before_hop - before.shed_before_hop:>6} | "
        + ", ".join(f"{reason} {n}" for reason, n in sorted(reasons.items()))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--budget-ms", type=float, default=30.0)
    parser.add_argument("--deadline-ms", type=float, default=100.0)
    args = parser.parse_args()
    print(f"budget {args.budget_ms:g} ms, caller deadline {args.deadline_ms:g} ms; late: > budget + 5 ms")
    print("  calls | wall ms | p50 / p99 / max ms     |   late | handed |   shed | reasons")
    for calls in args.calls:
        print(asyncio.run(burst(calls, args.budget_ms, args.deadline_ms)))


if __name__ == "__main__":
    main()
