"""Predicted vs reported cache hits: a routed request's prediction meets the prefix its worker reports
(MockClock; SimCluster on a MemoryNetwork; every actor real, the dispatch to the worker made by the test
as a frontend would)."""

from __future__ import annotations

import io
from functools import partial

import trio
import trio.testing

from actors.hit_accuracy import AccuracyHealth
from kvroute_sim.demo import key_family
from kvroute_sim.sim.cluster import SimCluster
from router.api import open_router
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig
from router.keys import block_keys
from router.supervisor import RouterHandle
from router.transport.memory_adapter import MemoryNetwork
from router.types import KeyFamily, RouteRequest, RouteSource

BLOCK = 16
PROMPT = tuple(range(5000, 5000 + 8 * BLOCK))
KEYS = block_keys(PROMPT, BLOCK, KeyFamily.RTP)


def sample(handle: RouterHandle, name: str, **labels: str) -> float | None:
    value = handle.metrics.registry.get_sample_value(name, labels)
    return None if value is None else float(value)


async def test_a_prediction_is_compared_with_the_prefix_the_worker_reports(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = SimCluster(workers=3, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    holder = cluster.worker_addr(1)
    cluster.kvcm.record_prefill(holder.http_target, KEYS)  # KVCM says worker 1 holds all 8 blocks
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.fail_after(1):
            await resolver.leader()
        decisions = []
        for i, cached in enumerate((len(PROMPT), 0)):  # the engine finds the whole prefix, then none of it
            d = await handle.route(RouteRequest(f"acc{i}", token_ids=PROMPT, budget_ms=50))
            assert d.route_source is RouteSource.KVCM and d.worker == holder and d.hit_tokens == len(PROMPT)
            decisions.append(d)
            # The frontend dispatches it; the worker's next status lists the task with what it found cached.
            cluster.workers[1].submit(d.request_id, len(PROMPT), cached, trio.current_time(), output_tokens=64)
            await trio.sleep(0.2)  # past the status TTL: the next route probes the worker again
            handle.prober().probe([holder], trio.current_time() + 0.05)
            await trio.sleep(0.1)
        await trio.testing.wait_all_tasks_blocked()
        health = handle.actors()["hit_accuracy"]["health"]
        assert isinstance(health, AccuracyHealth)
        assert (health.matched, health.silent_zero, health.pending) == (2, 1, 0)
        assert health.recent_by_worker[holder.http_target] == 0.5
        assert sample(handle, "kvroute_hit_silent_zero_total", route_source="kvcm") == 1
        assert sample(handle, "kvroute_hit_actual_over_predicted_count", route_source="kvcm") == 2
        assert sample(handle, "kvroute_hit_error_tokens_sum", route_source="kvcm") == len(PROMPT)


async def test_readiness_warns_while_predicted_hits_keep_finding_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A mismatch between kvroute's keys and the engines' (here: every dispatch finds nothing cached)
    shows in /readyz's reason once enough comparisons agree; routing itself stays ready."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    holder = cluster.worker_addr(0)
    cluster.kvcm.record_prefill(holder.http_target, KEYS)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.fail_after(1):
            await resolver.leader()
        assert "warning" not in handle.ready()[1]
        for i in range(25):
            d = await handle.route(RouteRequest(f"miss{i}", token_ids=PROMPT, budget_ms=50))
            assert d.worker == holder and d.hit_tokens > 0
            cluster.workers[0].submit(d.request_id, len(PROMPT), 0, trio.current_time(), output_tokens=64)
            await trio.sleep(0.2)
            handle.prober().probe([holder], trio.current_time() + 0.05)
            await trio.sleep(0.1)
        await trio.testing.wait_all_tasks_blocked()
        ready, why = handle.ready()
        assert ready and "warning: 100% of the last 25 routed requests found no cached prefix" in why


def test_a_wrong_key_family_fires_the_silent_zero_signal_and_the_right_one_does_not() -> None:
    """The demo's wrong-key-family runs under MockClock: the engines match the router's forwarded keys
    against blocks registered under their own family."""
    runs = {
        family: trio.run(
            partial(key_family.measure_family, family, network=MemoryNetwork(), requests=30),
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
        for family in (key_family.ENGINE_FAMILY, key_family.WRONG_FAMILY)
    }
    right, wrong = runs[key_family.ENGINE_FAMILY], runs[key_family.WRONG_FAMILY]
    assert right.predicted > 0 and right.silent_zero == 0 and right.warning is None
    assert right.actual_over_predicted == 1.0
    assert wrong.predicted > 0 and wrong.silent_zero == wrong.compared > 0
    assert wrong.silent_zero_metric == wrong.silent_zero and right.silent_zero_metric == 0
    assert wrong.warning is not None and "key family" in wrong.warning


def test_the_wrong_key_family_scenario_prints_both_families_and_passes() -> None:
    out = io.StringIO()
    status = key_family.run(out, clock=trio.testing.MockClock(autojump_threshold=0), in_memory=True, requests=25)
    text = out.getvalue()
    assert status == 0, text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("rtp ", "vllm "))}
    assert rows["rtp"][-1] == "no" and rows["vllm"][-1] == "yes"
    assert "readiness warning (wrong family)" in text
