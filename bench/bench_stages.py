"""Per-stage latency of one route decision over loopback gRPC (p50/p99 per stage).

    python bench/bench_stages.py [--requests 2000] [--workers 8]

The simulated KVCM replicas and workers run in this process (their gRPC servers on threads), so the
figures include their service time; `kvroute bench` P2 measures against a separate process.
Bounded: a fixed number of requests, each under its own 50 ms budget cap.
"""

from __future__ import annotations

import argparse
import statistics

import trio

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.stats import percentile
from router.api import open_router
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig
from router.keys import block_keys
from router.types import KeyFamily, RouteRequest

BLOCK = 16
STAGES = ("keys", "leader", "cache_query", "plan", "probe", "score", "total")


async def _main(requests: int, workers: int) -> None:
    prompt = tuple(range(8192))
    keys = block_keys(prompt, BLOCK, KeyFamily.RTP)
    async with trio.open_nursery() as nursery:
        cluster = SimCluster(workers=workers, kvcm_replicas=3, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        for i in range(workers):
            cluster.kvcm.record_prefill(cluster.worker_addr(i).http_target, keys[: 64 * (i + 1)])
        config = KvrouteConfig(
            deployment=DeploymentConfig(block_size=BLOCK),
            discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
        )
        async with open_router(config) as handle:
            resolver = handle.leader_resolver()
            assert resolver is not None
            with trio.fail_after(5):
                await resolver.leader()
            for label, gap in (("warm status cache", 0.0), ("cold status cache", 0.06)):
                per_stage: dict[str, list[float]] = {s: [] for s in STAGES}
                sources: dict[str, int] = {}
                for i in range(requests):
                    if gap:
                        await trio.sleep(gap)  # past the 50 ms freshness TTL: every route probes
                    d = await handle.route(RouteRequest(f"{label}-{i}", block_cache_keys=keys, block_size=BLOCK))
                    sources[d.route_source.value] = sources.get(d.route_source.value, 0) + 1
                    for stage in STAGES:
                        if stage in d.stage_ms:
                            per_stage[stage].append(d.stage_ms[stage])
                print(f"\n{label}: {requests} routes, 8K-token prompt as 512 caller keys, {workers} workers; {sources}")
                print(f"{'stage':<12}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
                for stage, values in per_stage.items():
                    if values:
                        print(
                            f"{stage:<12}{percentile(values, 50):>10.3f}{percentile(values, 99):>10.3f}"
                            f"{statistics.fmean(values):>10.3f}"
                        )
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    trio.run(_main, args.requests, args.workers)


if __name__ == "__main__":
    main()
