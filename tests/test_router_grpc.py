"""Way in #1 (trio, in process) over REAL loopback gRPC to SimKvcm + SimWorkers, with the debug endpoint.

Real clock, servers on 127.0.0.1:0, an absolute trio.fail_after per test; never MockClock here.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from actors.channel_pool import ChannelPool
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.kvcm import KvcmFaults
from router import supervisor
from router.api import open_router
from router.config import (
    DeploymentConfig,
    DiscoveryConfig,
    KvrouteConfig,
    LeaderConfig,
    MasterConfig,
    RouterConfig,
    ServeConfig,
)
from router.keys import block_keys
from router.supervisor import RouterHandle
from router.transport.master_http import HttpMasterTransport
from router.types import KeyFamily, Reason, RouteRequest, RouteSource, Stage
from router.wire import paths

BLOCK = 16
PROMPT = tuple(range(500, 500 + 8 * BLOCK))
BUDGET_CAP_MS = 1000.0
CLUSTER_INFO_ONLY = frozenset({paths.KVCM_GET_CLUSTER_INFO})


def _decisions_total(text: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "kvroute_route_decisions":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[(sample.labels["route_source"], sample.labels["reason"])] = sample.value
    return out


@asynccontextmanager
async def seeded_router(
    nursery: trio.Nursery, *, kvcm_replicas: int, debug_http: bool = False
) -> AsyncIterator[tuple[SimCluster, RouterHandle]]:
    """A router over real loopback gRPC to a simulated cluster whose worker 2 holds PROMPT, its leader known."""
    cluster = SimCluster(workers=4, kvcm_replicas=kvcm_replicas, block_size=BLOCK)
    addrs = await nursery.start(cluster.serve_grpc)
    cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
        # The requests' own budgets, not the default 50 ms cap: on a busy machine a stalled loop's
        # lag can make admission shed a call with little budget, and these must reach KVCM.
        router=RouterConfig(budget_cap_ms=BUDGET_CAP_MS),
    )
    async with open_router(config, debug_http=debug_http) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        await resolver.leader()
        yield cluster, handle


async def test_route_over_grpc_with_debug_endpoint(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        async with seeded_router(nursery, kvcm_replicas=3, debug_http=True) as (cluster, handle):
            assert handle.debug_address is not None
            base = f"http://{handle.debug_address}"
            async with httpx.AsyncClient(base_url=base) as http:
                ready = await http.get("/readyz")
                assert ready.status_code == 200
                # A configuration built in code is what the debug views describe, not the defaults.
                assert "configuration problems" not in ready.text
                shown = (await http.get("/debug/config")).json()
                assert shown["effective"]["deployment"]["block_size"] == BLOCK
                assert shown["effective"]["router"]["kvcm_fallback"] is True
                assert (shown["errors"], shown["kvcm_fallback_disabled_by_errors"]) == ([], False)
                assert shown["sources"]["deployment.block_size"] == "given in code"
                assert shown["sources"]["router.kvcm_query_timeout_ms"] == "default"
                decisions = [
                    await handle.route(RouteRequest(f"g{i}", token_ids=PROMPT, budget_ms=BUDGET_CAP_MS))
                    for i in range(5)
                ]
                assert all(d.route_source is RouteSource.KVCM for d in decisions)
                assert decisions[0].worker == cluster.worker_addr(2)
                assert decisions[0].reason is Reason.CACHE_LEADER
                await trio.testing.wait_all_tasks_blocked(cushion=0.002)  # sink drained; lag timer ticks every 10 ms
                metrics = (await http.get("/metrics")).text
                counted = sum(v for (src, _), v in _decisions_total(metrics).items() if src == "kvcm")
                assert counted == 5
                actors = (await http.get("/debug/actors")).json()["actors"]
                expected = {"channel_pool", "metrics_sink", "discovery", "leader_resolver", "worker_prober"}
                assert expected | {"shadow_index", "scorer", "hit_accuracy", "router", "debug_http"} == set(actors)
                assert {a["state"] for a in actors.values()} == {"running"}
                recent = (await http.get("/debug/decisions", params={"limit": 3})).json()
                assert len(recent["decisions"] if isinstance(recent, dict) else recent) == 3

                # A crashed channel pool restarts with its channels intact; routing goes on.
                pool = handle._pool
                assert pool is not None
                handle.supervisor.inject_crash("channel_pool")
                await trio.testing.wait_all_tasks_blocked()  # crashed: the supervisor waits out its backoff
                assert handle.actors_health()["channel_pool"]["restarts"] == 1
                # Only the pool's own task answers a lease of a target it has no channel for: this
                # returns once the restarted incarnation serves.
                async with pool.lease("127.0.0.1:9"):  # never called: gRPC channels connect on first use
                    pass
                health = handle.actors_health()["channel_pool"]
                assert (health["state"], health["restarts"]) == ("running", 1)
                d = await handle.route(RouteRequest("after-crash", token_ids=PROMPT, budget_ms=BUDGET_CAP_MS))
                assert d.route_source is RouteSource.KVCM

                # KVCM leader blackholed: answers fall back (that they come at the deadline is
                # asserted on virtual time, in test_router_pipeline.py; the test's limit catches a wait).
                leader = cluster.kvcm.leader
                assert leader is not None
                cluster.kvcm.set_faults(leader, KvcmFaults(hang=True))
                for i in range(3):
                    d = await handle.route(RouteRequest(f"bh{i}", token_ids=PROMPT, budget_ms=30))
                    assert d.route_source in (RouteSource.DOMAIN, RouteSource.SHADOW)
                cluster.kvcm.clear_faults()


async def test_leader_is_resolved_in_the_background_before_any_request(nursery: trio.Nursery) -> None:
    """Regression: on a real clock the resolver's loop compared two clock reads and spun without ever
    looking up until a request asked; readiness stayed false on an idle router.

    GetClusterInfo hangs at every replica until each has seen the idle router's call (no request
    made); released, the round answers and readiness follows without any other lookup.
    """
    with trio.fail_after(10):
        cluster = SimCluster(workers=2, kvcm_replicas=3, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        for node in cluster.kvcm.node_ids:
            cluster.kvcm.set_faults(node, KvcmFaults(hang=True, methods=CLUSTER_INFO_ONLY))
        config = KvrouteConfig(
            deployment=DeploymentConfig(block_size=BLOCK),
            discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
            leader=LeaderConfig(lookup_timeout_s=5.0),  # the held round is not cut while the test looks
        )
        async with open_router(config) as handle:
            resolver = handle.leader_resolver()
            assert resolver is not None
            for node in cluster.kvcm.node_ids:  # no request, no leader() call yet
                stats = cluster.kvcm.stats(node)
                reached = await trio.to_thread.run_sync(stats.wait_in_flight, paths.KVCM_GET_CLUSTER_INFO, 1, 5.0)
                assert reached, node
            assert not handle.ready()[0]  # its round is in flight
            cluster.kvcm.clear_faults()
            await resolver.leader()  # joins the round in flight (or finds its leader): starts none
            snap = resolver.snapshot()
            assert (snap.lookups_total, snap.lookups_by_trigger["scheduled"]) == (1, 1)  # the background round
            ready, why = handle.ready()
            assert ready, why
            calls = [cluster.kvcm.stats(node).get(paths.KVCM_GET_CLUSTER_INFO).calls for node in cluster.kvcm.node_ids]
            assert calls == [1, 1, 1]  # one concurrent round over the bootstrap targets, not a storm


async def test_a_query_whose_window_passed_before_it_was_sent_counts_as_cut(nursery: trio.Nursery) -> None:
    """A 1 ms budget leaves the KVCM query a window that ends at once: the gRPC adapter refuses to
    send it (DeadlineExceeded, no checkpoint, so no scope catches anything), and the split must still
    learn it as a cut wait, not as a query that answered in no time."""
    with trio.fail_after(20):
        async with seeded_router(nursery, kvcm_replicas=1) as (_, handle):
            for i in range(50):  # a loop lagging on a busy machine may have admission shed a 1 ms budget
                d = await handle.route(RouteRequest(f"tiny{i}", token_ids=PROMPT, budget_ms=1))
                if d.reason is not Reason.OVERLOADED:
                    break
            windows = {w.stage: w for w in d.windows}
            assert d.sources[0].reason is Reason.DEADLINE
            assert windows[Stage.CACHE_QUERY].cut


async def test_a_start_up_that_fails_closes_the_channels_it_opened(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The debug port is taken: open_router fails after the leader lookups and health probes opened
    channels, and the pool was never closed (its channels and sockets left for the collector)."""
    pools: list[ChannelPool[Any]] = []

    class Seen(ChannelPool[Any]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(supervisor, "ChannelPool", Seen)
    cluster = SimCluster(workers=4, kvcm_replicas=2, block_size=BLOCK)
    addrs = await nursery.start(cluster.serve_grpc)
    with socket.socket() as taken, trio.fail_after(30):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = KvrouteConfig(
            deployment=DeploymentConfig(block_size=BLOCK),
            discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
            serve=ServeConfig(debug_listen=f"127.0.0.1:{taken.getsockname()[1]}"),
        )
        with pytest.raises(OSError, match="--debug-listen"):
            async with open_router(config, debug_http=True):
                pass
    (pool,) = pools
    snapshot = pool.snapshot()
    assert pool._closing and snapshot.size == 0 and snapshot.closed == snapshot.opened, snapshot


async def test_the_schedulers_http_client_is_built_off_the_trio_thread(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building httpx's client loads the CA bundle even for plain http: done on the trio thread, it
    held every actor started before it (the leader lookups, the probes) for as long."""
    built_on_trio_thread: list[bool] = []

    class Seen(HttpMasterTransport):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built_on_trio_thread.append(trio.lowlevel.in_trio_run())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(supervisor, "HttpMasterTransport", Seen)
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    addrs = await nursery.start(cluster.serve_grpc)
    with socket.socket() as closed:  # a scheduler address nothing answers on
        closed.bind(("127.0.0.1", 0))
        scheduler = f"127.0.0.1:{closed.getsockname()[1]}"
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
        master=MasterConfig(hosts=scheduler),
    )
    with trio.fail_after(30):
        async with open_router(config) as handle:
            decision = await handle.route(RouteRequest("m", token_ids=PROMPT, budget_ms=1000))
    assert built_on_trio_thread == [False]
    assert decision.worker is not None  # no scheduler answers: routed by KVCM or the domain
