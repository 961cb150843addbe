"""The P3 workload alone, for a sampling profiler: routes through the full actor pipeline.

``kvroute bench`` measures P3 and prints a cProfile listing when it misses; cProfile's per-call
overhead inflates small functions. This script runs the same work with nothing else attached, so
an external sampler sees the real shares:

    py-spy record -r 1000 -f raw -o p3.raw -- python bench/pipeline_load.py --decisions 20000
    python bench/spy_summary.py p3.raw

``--transport memory`` (default): the simulated cluster on a MemoryNetwork in this process, as
P3 memory. ``--transport grpc``: the simulators in a child process on loopback gRPC, as P3 gRPC.
Prints decisions/s and the route outcomes. Bounded: ``--decisions`` routes after a warm-up.
"""

from __future__ import annotations

import argparse
import time

import trio

from kvroute_sim.bench.harness import ClusterShape, ClusterView, Requests, concurrent, prime, router_config
from kvroute_sim.bench.simproc import sim_process
from router.api import open_router
from router.transport.ports import RawRpc

WARM_UP = 500
TIMEOUT_S = 600.0


async def drive(view: ClusterView, rpc: RawRpc | None, decisions: int, concurrency: int) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with open_router(router_config(view, status_ttl_s=None), rpc=rpc) as router:
            requests = Requests(view, "load")
            await prime(router, requests, WARM_UP)
            seconds, outcomes = await concurrent(router, requests, decisions, concurrency)
    print(f"{decisions / seconds:,.0f} decisions/s ({decisions} in {seconds:.2f} s, {concurrency} in flight)")
    print(f"outcomes: {outcomes.to_json()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=20_000, help="routes measured after the warm-up")
    parser.add_argument("--concurrency", type=int, default=8, help="routes in flight")
    parser.add_argument("--transport", choices=("memory", "grpc"), default="memory")
    args = parser.parse_args()
    for flag, value in (("--decisions", args.decisions), ("--concurrency", args.concurrency)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    shape = ClusterShape()
    began = time.perf_counter()
    if args.transport == "memory":
        _, network, view = shape.in_memory()
        trio.run(drive, view, network, args.decisions, args.concurrency)
    else:
        with sim_process(shape, TIMEOUT_S) as sim:
            trio.run(drive, sim.view, None, args.decisions, args.concurrency)
    print(f"total {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
