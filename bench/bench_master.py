"""The master source over loopback: its latency per protocol, and what a hanging master costs
before and after its breaker opens.

    python bench/bench_master.py [--requests 1000]

SimMaster replicas (HTTP and gRPC) and SimCluster's workers serve on loopback in this process; the
router routes each request through the chain with the KVCM fallback on (KVCM answers when the master
cannot). Prints p50/p99 of the master source's own step (SourceStep.elapsed_ms) and of the whole
decision, per protocol; then, with the elected master hanging, the decision latency of the requests
before the breaker opens and after. Bounded: a fixed number of requests, each under its budget.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import trio

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.master import MasterFaults, SimMaster
from kvroute_sim.stats import percentile
from router.api import open_router
from router.config import (
    BreakerConfig,
    DeploymentConfig,
    DiscoveryConfig,
    KvrouteConfig,
    MasterConfig,
    MasterProtocol,
)
from router.keys import block_keys
from router.types import KeyFamily, Role, RoleAddr, RouteRequest, RouteSource

BLOCK = 16
BUDGET_MS = 50.0


def _row(label: str, values: list[float]) -> str:
    return f"{label:<42}{percentile(values, 50):>10.3f}{percentile(values, 99):>10.3f}{len(values):>8}"


async def _main(requests: int) -> None:
    prompt = tuple(range(2048))
    keys = block_keys(prompt, BLOCK, KeyFamily.RTP)
    async with trio.open_nursery() as nursery:
        cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, keys)
        workers = [cluster.worker_addr(i) for i in range(4)]
        master = SimMaster([RoleAddr(Role.PREFILL, w.ip, w.http_port, w.grpc_port) for w in workers], replicas=2)
        hosts = await nursery.start(master.run)
        print(f"{'':<42}{'p50 ms':>10}{'p99 ms':>10}{'n':>8}")
        for protocol in (MasterProtocol.HTTP, MasterProtocol.GRPC):
            config = KvrouteConfig(
                deployment=DeploymentConfig(block_size=BLOCK),
                discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
                master=MasterConfig(hosts=",".join(hosts.hosts), protocol=protocol, transport_timeout_ms=20.0),
                master_breaker=replace(BreakerConfig(), failure_threshold=5),
            )
            async with open_router(config) as handle:
                resolver = handle.leader_resolver()
                assert resolver is not None
                with trio.fail_after(10):
                    await resolver.leader()
                await trio.sleep(1.5)  # the master client's first discovery rounds (every 1 s)
                master_ms: list[float] = []
                total_ms: list[float] = []
                for i in range(requests):
                    d = await handle.route(
                        RouteRequest(f"{protocol.value}-{i}", block_cache_keys=keys, budget_ms=BUDGET_MS)
                    )
                    if d.route_source is RouteSource.MASTER:
                        master_ms.append(d.sources[0].elapsed_ms)
                        total_ms.append(d.elapsed_ms)
                print(_row(f"{protocol.value}: master step", master_ms))
                print(_row(f"{protocol.value}: whole decision", total_ms))
                if protocol is MasterProtocol.HTTP:
                    master.set_faults(0, MasterFaults(hang=True))
                    master.set_faults(1, MasterFaults(hang=True))
                    hanging: list[tuple[float, str]] = []
                    for i in range(50):
                        d = await handle.route(RouteRequest(f"hang-{i}", block_cache_keys=keys, budget_ms=BUDGET_MS))
                        hanging.append((d.elapsed_ms, d.route_source.value))
                    master.clear_faults()
                    before = [ms for ms, _ in hanging[:5]]
                    after = [ms for ms, _ in hanging[5:]]
                    sources = sorted({s for _, s in hanging})
                    print(_row("hanging master: first 5 (breaker closed)", before))
                    print(_row("hanging master: next 45 (breaker open)", after))
                    print(f"  answered by {sources}; window 20 ms, threshold 5")
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    trio.run(_main, args.requests)


if __name__ == "__main__":
    main()
