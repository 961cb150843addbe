"""P2: end-to-end route latency on loopback gRPC vs the raw floor, against the same servers.

The simulators run in a separate process (``simproc``). Measured in the same run, in
interleaved rounds so machine noise hits every row alike:

- raw floor: a plain grpcio client's bare GetHostCacheState RTT + bare GetWorkerStatus RTT;
- router, warm status cache: statuses stay fresh for the whole figure, so a route is one
  cache query to KVCM plus the decision;
- router, cold status cache: ``fresh_ttl_s = 0``, so every route also probes each of its
  candidates (concurrently) before deciding;
- for context on the cold row: the raw client making the same RPCs as a cold route (the
  query, then one bare probe to each of as many workers as a cold route has candidates).

Each route is sequential (one in flight), caller keys of an 8K-token seeded prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from kvroute_sim.bench.harness import WARM_TTL_S, ClusterView, Outcomes, Requests, prime, router_config, sequential
from kvroute_sim.bench.profiling import WindowProfile
from kvroute_sim.bench.raw_grpc import FloorSamples, RawClient
from kvroute_sim.bench.results import BenchReport, Figure, at_most, kvcm_share_note, kvcm_share_text, via_kvcm
from kvroute_sim.stats import Summary, shown_against
from router.api import open_router

P2_TARGET_RATIO = 1.3
FIGURE_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class LatencySizes:
    rounds: int
    routes_per_round: int  # per row and round
    warm_up: int


@dataclass(slots=True)
class _Row:
    latencies_ms: list[float] = field(default_factory=list)
    outcomes: Outcomes = field(default_factory=Outcomes.empty)

    def add(self, latencies: list[float], outcomes: Outcomes) -> None:
        self.latencies_ms += latencies
        self.outcomes.merge(outcomes)


@dataclass(slots=True)
class _Fanout:
    """The raw client doing a cold route's RPCs: the query, then ``width`` probes at once."""

    width: int = 0
    ms: list[float] = field(default_factory=list)


async def _measure(
    cluster: ClusterView, raw: RawClient, sizes: LatencySizes
) -> tuple[FloorSamples, _Fanout, dict[str, _Row], dict[str, WindowProfile]]:
    """Interleaved rounds; then a cProfile window of each row that missed its target."""
    floor = FloorSamples()
    fanout = _Fanout()
    rows = {"warm": _Row(), "cold": _Row()}
    profiles: dict[str, WindowProfile] = {}
    with trio.fail_after(FIGURE_TIMEOUT_S):
        await trio.to_thread.run_sync(raw.warm_up, sizes.warm_up)
        async with (
            open_router(router_config(cluster, status_ttl_s=WARM_TTL_S)) as warm,
            open_router(router_config(cluster, status_ttl_s=0.0)) as cold,
        ):
            routers = {"warm": (warm, Requests(cluster, "p2-warm")), "cold": (cold, Requests(cluster, "p2-cold"))}
            for router, requests in routers.values():
                await prime(router, requests, sizes.warm_up)
            fanout.width = len((await cold.route(routers["cold"][1].next())).candidates)
            for _ in range(sizes.rounds):
                # The floor first in each round: a blocking client, off the trio thread.
                await trio.to_thread.run_sync(raw.floor, sizes.routes_per_round, floor)
                await trio.to_thread.run_sync(raw.fanout, sizes.routes_per_round, fanout.width, fanout.ms)
                for name, (router, requests) in routers.items():
                    rows[name].add(*await sequential(router, requests, sizes.routes_per_round))
            floor_p50 = Summary.of(floor.pair_ms).p50
            for name, (router, requests) in routers.items():
                if Summary.of(rows[name].latencies_ms).p50 / floor_p50 > P2_TARGET_RATIO:
                    profiles[name] = WindowProfile()
                    with profiles[name]:
                        await sequential(router, requests, sizes.routes_per_round)
    return floor, fanout, rows, profiles


def measure(report: BenchReport, cluster: ClusterView, raw: RawClient, sizes: LatencySizes) -> None:
    floor, fanout, rows, profiles = trio.run(_measure, cluster, raw, sizes)
    floor_p50 = Summary.of(floor.pair_ms).p50
    fanout_p50 = Summary.of(fanout.ms).p50
    query_p50 = Summary.of(floor.cache_query_ms).p50
    for name, row in rows.items():
        summary = Summary.of(row.latencies_ms)
        ratio = summary.p50 / floor_p50
        # Context, not the target: what the raw client takes for the same RPCs as the route. A cold route
        # makes the query and its probes; a warm one the query alone (its statuses are cached), so the
        # pair floor the target names is lenient for it.
        context = (
            f"; the raw client's query + {fanout.width} concurrent probes p50 {fanout_p50:.3f} ms → "
            f"{summary.p50 / fanout_p50:.2f}×"
            if name == "cold"
            else f"; the raw client's query alone (the one RPC a warm route makes) p50 {query_p50:.3f} ms → "
            f"{summary.p50 / query_p50:.2f}×"
        )
        kvcm_share = row.outcomes.fraction_from("kvcm")
        verdict = via_kvcm(at_most(ratio, P2_TARGET_RATIO), kvcm_share)
        report.figures.append(
            Figure(
                f"P2 {name}",
                f"route on loopback gRPC, {name} status cache, sims in a separate process, "
                "vs raw floor (bare GetHostCacheState + bare GetWorkerStatus RTT)",
                f"p50 {summary.p50:.3f} ms, p99 {summary.p99:.3f} ms; floor p50 {floor_p50:.3f} ms → "
                f"{shown_against(ratio, 2, at_least=False):.2f}×; {kvcm_share_text(kvcm_share)}{context}"
                + kvcm_share_note(kvcm_share),
                f"p50 ≤ {P2_TARGET_RATIO}× floor",
                verdict,
                {
                    "unit": "ms",
                    "route": summary.to_json(),
                    "floor": floor.to_json(),
                    "ratio_p50": ratio,
                    "outcomes": row.outcomes.to_json(),
                    **(
                        {"raw_fanout": {"probes": fanout.width, "ms": Summary.of(fanout.ms).to_json()}}
                        if name == "cold"
                        else {}
                    ),
                },
            )
        )
        if name in profiles:
            report.profiles[f"P2 {name}"] = profiles[name].top()
    report.notes.append(
        f"P2 floor: bare GetHostCacheState {Summary.of(floor.cache_query_ms).p50:.3f} ms + bare GetWorkerStatus "
        f"{Summary.of(floor.worker_status_ms).p50:.3f} ms (p50 each); a cold route probes all its candidates "
        f"concurrently after the cache query ({fanout.width} here); the raw client's query followed by "
        f"{fanout.width} concurrent bare probes takes p50 {fanout_p50:.3f} ms."
    )
