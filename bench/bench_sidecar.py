"""Sidecar cost: a plain grpcio client's Route call vs the router's own decision time.

One process: SimCluster (loopback gRPC), the router, the Sidecar; the client calls Route
sequentially from a thread with a seeded prefix (KVCM hit, warm channels and status cache).
Rows: client-observed Route latency, the decision's own elapsed_ms (inside the router), and
their difference (proto decode/encode, the grpc handler thread, the hop into trio and back).

Run: ``python bench/bench_sidecar.py [--calls N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc
import trio

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.stats import percentile
from router.api import open_router
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig, ServeConfig
from router.keys import block_keys
from router.sidecar import Sidecar
from router.types import KeyFamily
from router.wire import router_v1_pb2
from router.wire.paths import ROUTER_ROUTE

BLOCK = 64
PROMPT = tuple(range(10_000, 10_000 + 32 * BLOCK))


def client_calls(target: str, calls: int) -> tuple[list[float], list[float]]:
    observed, inside = [], []
    with grpc.insecure_channel(target, options=[("grpc.enable_retries", 0)]) as channel:
        route = channel.unary_unary(
            ROUTER_ROUTE,
            request_serializer=router_v1_pb2.RouteRequest.SerializeToString,
            response_deserializer=router_v1_pb2.RouteDecision.FromString,
        )
        for i in range(calls):
            request = router_v1_pb2.RouteRequest(request_id=f"b{i}", token_ids=PROMPT, budget_ms=50)
            start = time.perf_counter()
            reply = route(request, timeout=5)
            observed.append((time.perf_counter() - start) * 1000)
            inside.append(reply.elapsed_ms)
    return observed, inside


async def main(calls: int) -> None:
    async with trio.open_nursery() as nursery:
        cluster = SimCluster(workers=8, kvcm_replicas=3, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        cluster.kvcm.record_prefill(cluster.worker_addr(3).http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
        config = KvrouteConfig(
            deployment=DeploymentConfig(block_size=BLOCK, kvcm_instance_id="bench"),
            discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
            serve=ServeConfig(grpc_listen="127.0.0.1:0"),
        )
        async with open_router(config) as handle, trio.open_nursery() as inner:
            resolver = handle.leader_resolver()
            assert resolver is not None
            await resolver.leader()
            sidecar = Sidecar(handle, config)
            bound = await inner.start(sidecar.run)
            await trio.to_thread.run_sync(client_calls, str(bound), 200)  # warm-up
            observed, inside = await trio.to_thread.run_sync(client_calls, str(bound), calls)
            inner.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    overhead = [o - i for o, i in zip(observed, inside, strict=True)]
    print(f"{calls} sequential Route calls, 32-block prompt, KVCM hit, warm")
    for name, values in (("client Route", observed), ("router elapsed_ms", inside), ("sidecar + grpc", overhead)):
        print(
            f"{name:18s} p50 {percentile(values, 50):6.3f} ms  p99 {percentile(values, 99):6.3f} ms  "
            f"mean {statistics.fmean(values):6.3f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    trio.run(main, parser.parse_args().calls)
