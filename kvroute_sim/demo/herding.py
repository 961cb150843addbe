"""Several independent routers on one cluster: do they herd onto the same worker between status refreshes?

Each router is a whole kvroute (its own prober, status cache, ledger and tie-break RNG, seeded
``scorer_seed xor i``), as N processes behind a load balancer would be; they share only the
simulated KVCM and workers. Requests go to the routers in turn (request k to router k mod N), at
their arrival times on a ``trio.testing.MockClock`` driving an in-memory network, so the simulated
clock is trio's clock. The statuses are refreshed as configured (the prober's freshness TTL is not
shortened as in the comparison): a router sees another's dispatches only when it next reads a
worker's status, and until then only its own pre-charges, which is where herding comes from.

Per policy variant and router count: hit rate, TTFT, imbalance, workers per group, missed elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio
import trio.testing

from kvroute_sim.demo.ladder import replay_through
from kvroute_sim.demo.report import PolicySummary, summarize
from kvroute_sim.demo.runner import (
    ClusterSpec,
    PolicyRun,
    Progress,
    SimClock,
    _Tally,
    build_cluster,
    load_router_config,
    router_settings,
)
from kvroute_sim.demo.workload import Workload, WorkloadSpec
from kvroute_sim.sim.cluster import SimCluster
from router.api import RouterHandle, open_router
from router.transport.memory_adapter import MemoryNetwork

HERDING_FILE = "demo-herding.json"
DEFAULT_ROUTER_COUNTS = (1, 2, 4)
DEFAULT_NEAR_TIE_TOKENS = 512  # the spreading row's margin when the settings give none


@dataclass(frozen=True, slots=True)
class Variant:
    """A policy configuration the herding table compares (its label and router settings)."""

    label: str
    settings: Mapping[str, object]


def default_variants(overrides: Mapping[str, object]) -> tuple[Variant, ...]:
    """cache-affinity, cost-aware without spreading, cost-aware with near-tie spreading; each over
    ``overrides`` (whose policy and margin the variant replaces)."""
    margin = overrides.get("scorer_near_tie_tokens")
    margin = DEFAULT_NEAR_TIE_TOKENS if margin in (None, 0, "0") else margin
    base = {k: v for k, v in overrides.items() if k not in ("scorer_policy", "scorer_near_tie_tokens")}
    return (
        Variant("cache-affinity", base | {"scorer_policy": "cache-affinity"}),
        Variant("cost-aware", base | {"scorer_policy": "cost-aware", "scorer_near_tie_tokens": 0}),
        Variant(
            f"cost-aware, spread {margin}", base | {"scorer_policy": "cost-aware", "scorer_near_tie_tokens": margin}
        ),
    )


@dataclass(frozen=True, slots=True)
class HerdingRow:
    variant: str
    routers: int
    summary: PolicySummary

    def to_json(self) -> dict[str, object]:
        full = self.summary.to_json()
        keep = (
            "hit_rate",
            "ttft_mean_ms",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "load_imbalance",
            "workers_per_group",
            "missed_elsewhere",
            "unrouted",
        )
        return {"variant": self.variant, "routers": self.routers} | {k: full[k] for k in keep}


@asynccontextmanager
async def open_routers(
    cluster: SimCluster,
    workload: WorkloadSpec,
    settings: Mapping[str, object],
    routers: int,
    network: MemoryNetwork,
    *,
    clock: SimClock | None = None,
) -> AsyncIterator[tuple[RouterHandle, ...]]:
    """Serve ``cluster`` on ``network`` and open ``routers`` independent routers on it, router ``i``
    seeded ``scorer_seed xor i`` (as each process of a fleet would be, so their tie draws differ;
    the xor with a small index stays within the seed's range). ``clock``: what the cluster's replies
    read as now (default trio's clock)."""
    if routers < 1:
        raise ValueError(f"routers: must be >= 1, got {routers}")
    addresses = cluster.serve_memory(network, clock=None if clock is None else clock.now)
    base = router_settings(addresses.kvcm_bootstrap, addresses.workers_arg, workload) | dict(settings)
    seed = load_router_config(base).effective.scorer.seed
    async with AsyncExitStack() as stack:
        handles = []
        for i in range(routers):
            loaded = load_router_config(base | {"scorer_seed": seed ^ i})
            handles.append(await stack.enter_async_context(open_router(loaded.effective, rpc=network, loaded=loaded)))
        yield tuple(handles)


async def run_routers(
    workload: Workload,
    cluster_spec: ClusterSpec,
    settings: Mapping[str, object],
    routers: int,
    progress: Progress | None = None,
    label: str = "kvroute",
) -> PolicyRun:
    """Replay ``workload`` through ``routers`` independent routers in turn; run under a MockClock."""
    cluster = build_cluster(cluster_spec, workload)
    clock = SimClock(trio.current_time())
    async with open_routers(cluster, workload.spec, settings, routers, MemoryNetwork(), clock=clock) as handles:
        return await replay_through(handles, cluster, clock, workload, _Tally(label, len(workload.requests), progress))


def run_herding(
    workload: Workload,
    cluster_spec: ClusterSpec,
    variants: Sequence[Variant],
    counts: Sequence[int] = DEFAULT_ROUTER_COUNTS,
    progress: Progress | None = None,
) -> tuple[HerdingRow, ...]:
    """Every variant with every router count on the same arrivals (synchronous; a trio run each)."""
    rows = []
    for variant in variants:
        for n in counts:
            replay = partial(
                run_routers, workload, cluster_spec, variant.settings, n, progress, f"{variant.label} x{n}"
            )
            run = trio.run(replay, clock=trio.testing.MockClock(autojump_threshold=0))
            rows.append(HerdingRow(variant.label, n, summarize(run)))
    return tuple(rows)


def format_herding(rows: Sequence[HerdingRow]) -> str:
    head = (
        f"{'policy':<26}  {'routers':>7}  {'hit rate':>8}  {'mean':>7}  {'p50':>7}  {'p99 ms':>7}  "
        f"{'imbalance':>9}  {'workers/group':>13}  {'missed elsewhere':>16}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        s = row.summary
        lines.append(
            f"{row.variant:<26}  {row.routers:>7}  {100 * s.hit_rate:>7.1f}%  {s.ttft_mean_ms:>7.1f}  "
            f"{s.ttft_p50_ms:>7.1f}  {s.ttft_p99_ms:>7.1f}  {s.load_imbalance:>9.2f}  "
            f"{s.workers_per_group:>13.2f}  {100 * s.missed_elsewhere:>15.1f}%"
        )
    return "\n".join(lines)


def write_herding(out_dir: Path, workload: Workload, cluster: ClusterSpec, rows: Sequence[HerdingRow]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / HERDING_FILE
    payload = {"workload": workload.to_json(), "cluster": cluster.to_json(), "routers": [r.to_json() for r in rows]}
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path
