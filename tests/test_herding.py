"""Several independent routers on one simulated cluster (kvroute_sim/demo/herding.py), under a MockClock.

Two routers sharing nothing read the same worker statuses between refreshes: without near-tie
spreading they take the same cheapest worker; with it, their own tie draws spread near-ties."""

from __future__ import annotations

from dataclasses import replace

import trio
import trio.testing

from kvroute_sim.demo.herding import default_variants, format_herding, open_routers, run_herding
from kvroute_sim.demo.runner import ClusterSpec, build_cluster, route_request
from kvroute_sim.demo.workload import DemoRequest, Workload, WorkloadSpec, build_workload
from router.keys import block_keys
from router.transport.memory_adapter import MemoryNetwork

SPEC = WorkloadSpec()
ROUNDS = 8


PREFIX = tuple(range(128))  # cached on every worker: the candidates tie on hits


def _request(n: int, fresh: int = 128) -> DemoRequest:
    """The shared prefix and ``fresh`` tokens no worker has seen."""
    ids = PREFIX + tuple(range(900_000_000 + n * fresh, 900_000_000 + (n + 1) * fresh))
    keys = block_keys(ids, SPEC.block_size, SPEC.key_family)
    return DemoRequest(f"r{n}", 0.0, -1, n, 0, ids, keys, len(ids))


async def _picks(near_tie_tokens: int) -> list[tuple[str, str]]:
    """Each round, both routers route one fresh request at the same instant: the workers they pick."""
    workload = Workload(SPEC, ())
    cluster = build_cluster(ClusterSpec(workers=4), workload)
    settings = {"scorer_policy": "cost-aware", "scorer_near_tie_tokens": near_tie_tokens}
    picks = []
    async with open_routers(cluster, SPEC, settings, 2, MemoryNetwork()) as (first, second):
        await trio.sleep(1.0)  # the routers find KVCM and the workers
        now = trio.current_time()
        prefix_keys = block_keys(PREFIX, SPEC.block_size, SPEC.key_family)
        for i in range(4):  # every worker holds the prefix; near-tie queues of 2,000 + 20·i tokens
            cluster.run_prefill(i, f"load-{i}", prefix_keys, 2000 + 20 * i, now)
        for r in range(ROUNDS):
            a = await first.route(route_request(_request(2 * r), SPEC.block_size))
            b = await second.route(route_request(_request(2 * r + 1), SPEC.block_size))
            assert a.worker is not None and b.worker is not None, (a.error, b.error)
            picks.append((a.worker.http_target, b.worker.http_target))
    return picks


async def test_two_routers_herd_on_near_ties_without_spreading_and_not_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    herded = await _picks(0)
    assert all(a == b for a, b in herded)  # the same statuses, the same own pre-charges: the same pick
    spread = await _picks(500)
    assert any(a != b for a, b in spread)
    assert len({w for pair in spread for w in pair}) >= 3  # the near-ties are shared out


def test_herding_table_on_a_tiny_workload() -> None:
    workload = build_workload(replace(SPEC, groups=4, prompts_per_group=4, rate_per_s=50.0, seed=3))
    rows = run_herding(workload, ClusterSpec(workers=3), default_variants({}), counts=(1, 2))
    assert [(r.variant, r.routers) for r in rows] == [
        ("cache-affinity", 1),
        ("cache-affinity", 2),
        ("cost-aware", 1),
        ("cost-aware", 2),
        ("cost-aware, spread 512", 1),
        ("cost-aware, spread 512", 2),
    ]
    for row in rows:
        assert row.summary.requests == len(workload.requests)
        assert row.summary.unrouted == 0
        assert 1.0 <= row.summary.workers_per_group <= 3.0
    table = format_herding(rows)
    assert "routers" in table and "workers/group" in table and "cost-aware, spread 512" in table
