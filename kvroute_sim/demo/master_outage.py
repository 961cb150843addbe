"""The master-outage comparison: what the KVCM path is worth while the central scheduler is down.

The same workload is replayed three times on a fresh cluster with a SimMaster in front of it
(routing with the cluster's exact cache and queue knowledge). The scheduler is taken down for
the middle third of the requests (every replica refuses) and brought back afterwards, except in
the first arm:

- ``master healthy``: no outage (the upper bound: a good central scheduler all along);
- ``kvroute``: the outage, with kvroute's default chain (master → KVCM → shadow → domain);
- ``pre-change``: the outage, with the KVCM fallback off, as the frontend was before the
  KVCM path existed (a failing master means domain routing).

Figures (hit rate, simulated TTFT) are over the requests that arrived during the outage window.

Time. Unlike the policy comparison, the arms run on the in-memory transports under a
``MockClock``: the replay sleeps until each arrival, so the router, the scheduler and the sims
all read the simulated time, and the scheduler's discovery, breaker and the probers run on it
too. Decisions therefore take no simulated time; no decision latency is reported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio
import trio.testing

from kvroute_sim.demo.figures import png
from kvroute_sim.demo.report import PolicySummary, source_mix, summarize
from kvroute_sim.demo.runner import (
    COMPARISON_SETTINGS,
    ClusterSpec,
    PolicyRun,
    RequestRecord,
    build_cluster,
    open_kvroute,
    prefix_group,
    route_request,
)
from kvroute_sim.demo.workload import Workload
from kvroute_sim.sim.cluster_master import cluster_decide
from kvroute_sim.sim.master import MasterFaults, SimMaster
from router.transport.memory_adapter import MemoryNetwork

OUTAGE_CHART_FILE = "demo-master-outage.png"
MASTER_REPLICAS = 2
OUTAGE_START = 1 / 3  # of the workload's requests, in arrival order
OUTAGE_END = 2 / 3

MASTER_HEALTHY = "master healthy"
KVROUTE_KVCM_PATH = "master down: kvroute KVCM path"
PRE_CHANGE = "master down: pre-change domain"
ARMS = (MASTER_HEALTHY, KVROUTE_KVCM_PATH, PRE_CHANGE)
_ARM_SETTINGS: Mapping[str, Mapping[str, object]] = {
    MASTER_HEALTHY: {},
    KVROUTE_KVCM_PATH: {},
    PRE_CHANGE: {"kvcm_fallback": False},
}

Progress = Callable[[str, int, int, float], None]  # (arm, requests done, total, hit rate so far)


@dataclass(frozen=True, slots=True)
class OutageWindow:
    """The outage, in simulated seconds on the workload's timeline: from the arrival of the request a
    third of the way through to the one two thirds of the way through."""

    start_s: float
    end_s: float

    @classmethod
    def of(cls, workload: Workload) -> OutageWindow:
        requests = workload.requests
        if not requests:
            return cls(0.0, 0.0)
        last = len(requests) - 1
        return cls(requests[round(OUTAGE_START * last)].arrival_s, requests[round(OUTAGE_END * last)].arrival_s)

    def holds(self, arrival_s: float) -> bool:
        return self.start_s <= arrival_s < self.end_s


@dataclass(frozen=True, slots=True)
class OutageResult:
    """One arm: its summary over the outage window, and its route sources over the whole run."""

    arm: str
    during: PolicySummary
    whole_run_sources: Mapping[str, int]

    def to_json(self) -> dict[str, object]:
        return {
            "arm": self.arm,
            "during_outage": self.during.to_json(),
            "whole_run_sources": dict(self.whole_run_sources),
        }


async def run_arm(
    arm: str,
    workload: Workload,
    cluster_spec: ClusterSpec,
    progress: Progress | None = None,
    router_overrides: Mapping[str, object] | None = None,
) -> tuple[PolicyRun, PolicyRun]:
    """Replay ``workload`` for one arm on in-memory transports; the trio clock must be a MockClock
    (the replay sleeps until each arrival). Returns (the whole run, the outage window's requests).
    ``router_overrides`` apply to every arm, under the arm's own setting."""
    cluster = build_cluster(cluster_spec, workload)
    master = SimMaster(
        replicas=MASTER_REPLICAS, decide=cluster_decide(cluster, trio.current_time, workload.spec.key_family)
    )
    settings = dict(COMPARISON_SETTINGS) | dict(router_overrides or {}) | dict(_ARM_SETTINGS[arm])
    window = OutageWindow.of(workload)
    outage = arm != MASTER_HEALTHY
    records: list[RequestRecord] = []
    cached = total_input = 0
    every = max(1, len(workload.requests) // 10)
    async with open_kvroute(
        cluster, workload.spec, extra_settings=settings, network=MemoryNetwork(), master=master
    ) as setup:
        origin = trio.current_time()
        down = False
        for done, request in enumerate(workload.requests, start=1):
            await trio.sleep_until(origin + request.arrival_s)
            if outage and down != window.holds(request.arrival_s) and request.arrival_s >= window.start_s:
                down = not down
                for index in range(len(master.replicas)):
                    master.set_faults(index, MasterFaults(refuse=down))
            decision = await setup.handle.route(route_request(request, workload.spec.block_size))
            now = trio.current_time()
            source, reason = decision.route_source.value, decision.reason.value
            group = prefix_group(request)
            unmeasured = math.nan  # no decision time on this clock (module doc): null, not 0, in the JSON
            if decision.worker is None:
                unrouted = (request.request_id, -1, request.input_tokens, 0, math.nan, unmeasured, source, reason)
                records.append(RequestRecord(*unrouted, group=group))
            else:
                worker = cluster.worker_index(decision.worker.http_target)
                # Before the prefill stores the request's keys: what any worker held for it on arrival.
                best_blocks = max(
                    (cluster.kvcm.local_prefix(a.http_target, request.keys) for a in cluster.addresses.workers),
                    default=0,
                )
                # As the comparison runs it: the answer's decode holds running KV after the prefill.
                outcome = cluster.run_prefill(
                    worker, request.request_id, request.keys, request.input_tokens, now, request.output_tokens
                )
                records.append(
                    RequestRecord(
                        request.request_id,
                        worker,
                        request.input_tokens,
                        outcome.cached_tokens,
                        outcome.ttft_s,
                        unmeasured,
                        source,
                        reason,
                        group=group,
                        best_cached_tokens=min(best_blocks * cluster.block_size, request.input_tokens),
                    )
                )
                cached += outcome.cached_tokens
                total_input += request.input_tokens
            if progress is not None and (done % every == 0 or done == len(workload.requests)):
                progress(arm, done, len(workload.requests), cached / total_input if total_input else 0.0)
    loads = tuple(w.prefill_tokens_submitted for w in cluster.workers)
    in_window = tuple(r for r, q in zip(records, workload.requests, strict=True) if window.holds(q.arrival_s))
    # The window's own load: the uncached tokens its requests sent each worker (not the whole run's).
    window_loads = [0] * len(cluster.workers)
    for record in in_window:
        if record.worker >= 0:
            window_loads[record.worker] += record.input_tokens - record.cached_tokens
    return PolicyRun(arm, tuple(records), loads), PolicyRun(arm, in_window, tuple(window_loads))


def run_master_outage(
    workload: Workload,
    cluster_spec: ClusterSpec,
    progress: Progress | None = None,
    router_overrides: Mapping[str, object] | None = None,
) -> tuple[OutageResult, ...]:
    """Every arm, each in its own ``trio.run`` under a fresh ``MockClock`` (call from outside trio)."""
    results = []
    for arm in ARMS:
        whole, during = trio.run(
            partial(run_arm, arm, workload, cluster_spec, progress, router_overrides),
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
        results.append(OutageResult(arm, summarize(during), summarize(whole).route_sources))
    return tuple(results)


# ---- the table, the JSON and the chart --------------------------------------------------------------


def format_outage_table(results: Sequence[OutageResult], window: OutageWindow) -> str:
    header = (
        f"master outage from {window.start_s:.1f} s to {window.end_s:.1f} s (simulated; every scheduler replica "
        "refuses); figures over the requests arriving in it"
    )
    titles = ("arm", "hit rate", "TTFT mean", "p50", "p99 ms", "route_source during")
    rows = [
        (
            r.arm,
            _fmt(100 * r.during.hit_rate, ".1f") + "%",
            _fmt(r.during.ttft_mean_ms, ".1f"),
            _fmt(r.during.ttft_p50_ms, ".1f"),
            _fmt(r.during.ttft_p99_ms, ".1f"),
            source_mix(r.during),
        )
        for r in results
    ]
    widths = [max(len(title), *(len(row[i]) for row in rows)) for i, title in enumerate(titles)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            f"{cell:<{w}}" if i in (0, len(cells) - 1) else f"{cell:>{w}}"
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([header, line(titles), "  ".join("-" * w for w in widths), *(line(row) for row in rows)])


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "n/a"


def outage_json(results: Sequence[OutageResult], window: OutageWindow) -> dict[str, object]:
    return {
        "window_s": [round(window.start_s, 3), round(window.end_s, 3)],
        "master_replicas": MASTER_REPLICAS,
        "arms": [r.to_json() for r in results],
    }


def write_outage_chart(out_dir: Path, results: Sequence[OutageResult]) -> Path:
    """A 1×2 PNG: hit rate and simulated TTFT (mean/p50/p99) of each arm during the outage."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / OUTAGE_CHART_FILE
    names = [r.arm for r in results]
    palette = {MASTER_HEALTHY: "tab:gray", KVROUTE_KVCM_PATH: "tab:green", PRE_CHANGE: "tab:red"}
    colors = [palette.get(n, "tab:blue") for n in names]
    x = list(range(len(names)))
    title = "kvroute demo: the central scheduler down for the middle third of the requests"
    with png(path, title, 1, 2, figsize=(12, 4.5)) as (_, axes):
        ax = axes[0]
        ax.bar(x, [100 * r.during.hit_rate for r in results], color=colors)
        ax.set_title("prefix hit rate during the outage (%)")
        ax = axes[1]
        width = 0.27
        for offset, label, values in (
            (-width, "mean", [r.during.ttft_mean_ms for r in results]),
            (0.0, "p50", [r.during.ttft_p50_ms for r in results]),
            (width, "p99", [r.during.ttft_p99_ms for r in results]),
        ):
            ax.bar([i + offset for i in x], values, width, label=label)
        ax.set_title("simulated TTFT during the outage (ms)")
        ax.legend()
        for ax in axes:
            ax.set_xticks(x)
            ax.set_xticklabels(names, rotation=10, ha="right")
    return path
