"""The sidecar end to end with a scheduler: a plain grpcio client → Sidecar → router → SimMaster → SimCluster.

Real loopback servers and the real clock (an absolute trio.fail_after per test), the scheduler
over HTTP JSON and over gRPC. Liveness and content only: a routed answer is the scheduler's (its
route_source and role addresses), and KVCM is not asked while the scheduler answers.
"""

from __future__ import annotations

import grpc
import pytest
import trio

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.cluster_master import cluster_decide
from kvroute_sim.sim.master import SimMaster, SimMasterAddresses
from router.api import open_router
from router.config import (
    DeploymentConfig,
    DiscoveryConfig,
    KvrouteConfig,
    MasterConfig,
    MasterProtocol,
    RouterConfig,
    ServeConfig,
)
from router.keys import block_keys
from router.sidecar import Sidecar
from router.targets import HostPort
from router.types import KeyFamily
from router.wire import paths, router_v1_pb2

BLOCK = 16
PROMPT = tuple(range(9000, 9000 + 8 * BLOCK))
CLIENT_TIMEOUT_S = 10.0
BUDGET_MS = 5000  # generous: this test is about the path, not its speed


def _route(channel: grpc.Channel, request: router_v1_pb2.RouteRequest) -> router_v1_pb2.RouteDecision:
    call = channel.unary_unary(
        paths.ROUTER_ROUTE,
        request_serializer=router_v1_pb2.RouteRequest.SerializeToString,
        response_deserializer=router_v1_pb2.RouteDecision.FromString,
    )
    reply: router_v1_pb2.RouteDecision = call(request, timeout=CLIENT_TIMEOUT_S)
    return reply


def _kvcm_queries(cluster: SimCluster) -> int:
    return sum(cluster.kvcm.stats(node).get(paths.KVCM_GET_HOST_CACHE_STATE).calls for node in cluster.kvcm.node_ids)


@pytest.mark.parametrize("protocol", [MasterProtocol.HTTP, MasterProtocol.GRPC], ids=["http", "grpc"])
async def test_a_routed_answer_through_the_sidecar_is_the_schedulers(
    protocol: MasterProtocol, nursery: trio.Nursery
) -> None:
    with trio.fail_after(30):
        cluster = SimCluster(workers=4, kvcm_replicas=2, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        sim_master = SimMaster(replicas=2, decide=cluster_decide(cluster, trio.lowlevel.current_clock().current_time))
        masters: SimMasterAddresses = await nursery.start(sim_master.run)
        holder = cluster.worker_addr(2)
        cluster.kvcm.record_prefill(holder.http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
        config = KvrouteConfig(
            deployment=DeploymentConfig(block_size=BLOCK, kvcm_instance_id="test"),
            discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
            router=RouterConfig(budget_cap_ms=float(BUDGET_MS)),
            serve=ServeConfig(grpc_listen="127.0.0.1:0"),
            master=MasterConfig(
                hosts=",".join(masters.hosts),
                protocol=protocol,
                transport_timeout_ms=float(BUDGET_MS) / 2,
                discovery_timeout_s=5.0,
            ),
        )
        async with open_router(config) as handle, trio.open_nursery() as inner:
            sidecar = Sidecar(handle, config)
            bound: HostPort = await inner.start(sidecar.run)
            channel = grpc.insecure_channel(str(bound), options=[("grpc.enable_retries", 0)])
            try:
                queries_before = _kvcm_queries(cluster)
                request = router_v1_pb2.RouteRequest(request_id="m1", token_ids=PROMPT, budget_ms=BUDGET_MS)
                reply = await trio.to_thread.run_sync(_route, channel, request)
            finally:
                channel.close()
                inner.cancel_scope.cancel()
        assert (reply.request_id, reply.route_source, reply.error_code) == ("m1", "master", 0)
        assert sidecar.take_call_timings() == []  # as `kvroute serve` makes it: the bench's timings are not kept
        # The scheduler knows the cache exactly: the idle holder of the prefix, as it named it.
        assert [(a.role, a.ip, a.http_port, a.grpc_port) for a in reply.role_addrs] == [
            ("PREFILL", holder.ip, holder.http_port, holder.grpc_port)
        ]
        assert (reply.ip, reply.http_port, reply.role) == (holder.ip, holder.http_port, "PREFILL")
        assert sim_master.schedules == 1
        wire = paths.MASTER_SCHEDULE if protocol is MasterProtocol.GRPC else paths.MASTER_HTTP_SCHEDULE
        assert sim_master.elected.stats.get(wire).calls == 1  # over the protocol asked for, at the master
        assert _kvcm_queries(cluster) == queries_before  # KVCM is not asked while the master answers
