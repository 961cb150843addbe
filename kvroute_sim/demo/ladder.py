"""TTFT versus load: every policy replayed at several loads of the same workload.

Each rung scales the workload's arrival times so its ``load.offered_load`` on the cluster is
the rung's load (the requests and their order stay the same), then runs every policy on a fresh
cluster: the baselines in memory as in the comparison, kvroute through the real router (its full
chain and actors) on an in-memory network under a ``trio.testing.MockClock``. As in the
comparison, the cluster's clock stands at each request's arrival while the router decides
(``run_kvroute_in_memory``).

The label is checked on the simulated clock: each rung reports the share of the bulk window the
oracle's workers spent prefilling (the oracle does about the best-reuse work and balances it, so
its busy share is what the label claims, a few points less near saturation, where the last
arrivals' work spills past the window); every policy's own busy share is in the table beside it
(a policy that copies prefixes or ignores the cache works more).

Per policy and load: mean / p50 / p99 TTFT, hit rate, imbalance, busy share, and goodput: the
share of the requests whose TTFT is within the SLO. The default SLO is ``SLO_IDLE_MULTIPLE`` times the median
request's full prefill on an idle worker (a TTFT a user notices as slow), printed with the table.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import trio
import trio.testing

from kvroute_sim.demo.figures import png
from kvroute_sim.demo.lineup import (
    COST_AWARE_SETTINGS,
    KVROUTE,
    KVROUTE_COST_AWARE,
    LINEUP,
    ORACLE,
    lineup_baselines,
    run_lineup_baseline,
)
from kvroute_sim.demo.load import offered_load, scale_to_load
from kvroute_sim.demo.report import PolicySummary, summarize
from kvroute_sim.demo.runner import (
    ClusterSpec,
    PolicyRun,
    Progress,
    RequestRecord,
    SimClock,
    _prefill,
    _Tally,
    build_cluster,
    measured_window,
    open_kvroute,
    route_request,
)
from kvroute_sim.demo.workload import Workload
from kvroute_sim.sim.cluster import SimCluster
from router.api import RouterHandle
from router.transport.memory_adapter import MemoryNetwork

DEFAULT_LOADS = (0.3, 0.5, 0.7, 0.9, 1.1)
SLO_IDLE_MULTIPLE = 5.0
LADDER_CHART_FILE = "demo-ladder.png"
_SETTLE_S = 1.0  # simulated time the routers get to find KVCM and the workers before the first arrival


def default_slo_ms(workload: Workload, cluster: ClusterSpec) -> float:
    """``SLO_IDLE_MULTIPLE`` x the median request's uncached prefill on an idle worker, in ms."""
    median = statistics.median(r.input_tokens for r in workload.requests)
    return SLO_IDLE_MULTIPLE * 1000.0 * median / cluster.prefill_tokens_per_s


def goodput(run: PolicyRun, slo_ms: float) -> float:
    """Share of all requests (unrouted ones count as missed) with a simulated TTFT within ``slo_ms``."""
    if not run.records:
        return math.nan
    good = sum(1 for r in run.records if r.worker >= 0 and r.ttft_s * 1000.0 <= slo_ms)
    return good / len(run.records)


@dataclass(frozen=True, slots=True)
class LadderEntry:
    summary: PolicySummary
    goodput: float
    busy_share: float  # of the bulk window, measured on the simulated clock

    def to_json(self) -> dict[str, object]:
        full = self.summary.to_json()
        keep = ("policy", "hit_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "load_imbalance", "unrouted")
        out = {k: full[k] for k in keep}
        out["goodput"] = _rounded(self.goodput)
        out["busy_share"] = _rounded(self.busy_share)
        return out


def _rounded(value: float) -> float | None:
    return round(value, 6) if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class LadderRung:
    load: float  # the label: ``load.offered_load`` of the rung's arrivals
    measured_load: float  # the oracle's busy share of the bulk window (simulated clock; NaN without the oracle)
    entries: tuple[LadderEntry, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "load": self.load,
            "measured_load": _rounded(self.measured_load),
            "policies": [e.to_json() for e in self.entries],
        }


async def run_kvroute_in_memory(
    workload: Workload,
    cluster_spec: ClusterSpec,
    settings: Mapping[str, object],
    progress: Progress | None = None,
    label: str = KVROUTE,
) -> PolicyRun:
    """Replay ``workload`` through the real router on an in-memory network; run under a MockClock.

    The cluster reads a ``SimClock`` held at each request's arrival while the router decides, as in
    the comparison: the router's own waits (a probe waiting for the probe budget's next token) take
    trio time, and must neither delay the request's prefill nor the next arrivals' (a replay that let
    them would run kvroute at a lower load than the baselines, which decide in no time).
    """
    network = MemoryNetwork()
    cluster = build_cluster(cluster_spec, workload)
    clock = SimClock(trio.current_time())
    async with open_kvroute(cluster, workload.spec, clock=clock.now, extra_settings=settings, network=network) as setup:
        return await replay_through(
            (setup.handle,), cluster, clock, workload, _Tally(label, len(workload.requests), progress)
        )


async def replay_through(
    routers: Sequence[RouterHandle], cluster: SimCluster, clock: SimClock, workload: Workload, tally: _Tally
) -> PolicyRun:
    """Route ``workload``'s requests through ``routers`` in turn (request k to router k mod n), each
    at its arrival on trio's clock, and prefill each on ``cluster``, whose replies read ``clock``:
    held at the request's arrival while the router decides, so the router's own waits delay neither
    the prefill nor later arrivals."""
    block_size = workload.spec.block_size
    origin = trio.current_time() + _SETTLE_S
    for k, request in enumerate(workload.requests):
        await trio.sleep_until(origin + request.arrival_s)
        clock.set(origin + request.arrival_s)
        started = time.perf_counter()  # the real cost of the decision; simulated time stands still
        decision = await routers[k % len(routers)].route(route_request(request, block_size))
        decision_s = time.perf_counter() - started
        source, reason = decision.route_source.value, decision.reason.value
        if decision.worker is None:
            tally.add(
                RequestRecord(request.request_id, -1, request.input_tokens, 0, math.nan, decision_s, source, reason)
            )
            continue
        worker = cluster.worker_index(decision.worker.http_target)
        shifted = replace(request, arrival_s=origin + request.arrival_s)
        tally.add(_prefill(cluster, shifted, worker, decision_s, source, reason))
    return tally.finish(cluster, measured_window(workload, origin))


def run_ladder(
    workload: Workload,
    cluster_spec: ClusterSpec,
    policies: Sequence[str],
    *,
    loads: Sequence[float],
    slo_ms: float,
    router_settings: Mapping[str, object],
    progress: Progress | None = None,
    rung_started: Callable[[int, float], None] | None = None,
) -> tuple[LadderRung, ...]:
    """Every policy at every load (synchronous; runs its own trio loop per kvroute replay).

    ``rung_started(index, load)`` is called as each rung begins (progress for the caller)."""
    base = offered_load(workload, cluster_spec)
    if not math.isfinite(base) or base <= 0:
        raise ValueError("the workload needs at least two arrivals at different times to set a load")
    rungs = []
    order = {name: i for i, name in enumerate(LINEUP)}
    for index, load in enumerate(loads):
        if rung_started is not None:
            rung_started(index, load)
        scaled = scale_to_load(workload, cluster_spec, load, base=base)
        runs: list[PolicyRun] = []
        for label, settings in ((KVROUTE, {}), (KVROUTE_COST_AWARE, COST_AWARE_SETTINGS)):
            if label in policies:
                replay = partial(
                    run_kvroute_in_memory,
                    scaled,
                    cluster_spec,
                    dict(router_settings) | dict(settings),
                    _labelled(progress, load),
                    label,
                )
                runs.append(trio.run(replay, clock=trio.testing.MockClock(autojump_threshold=0)))
        for policy in lineup_baselines(scaled.spec.seed, scaled.spec.block_size):
            if policy.name in policies:
                runs.append(run_lineup_baseline(policy, scaled, cluster_spec, _labelled(progress, load)))
        runs.sort(key=lambda r: order[r.policy])
        entries = tuple(LadderEntry(summarize(r), goodput(r, slo_ms), r.busy_share) for r in runs)
        measured = next((r.busy_share for r in runs if r.policy == ORACLE), math.nan)
        rungs.append(LadderRung(load, measured, entries))
    return tuple(rungs)


def _labelled(progress: Progress | None, load: float) -> Progress | None:
    if progress is None:
        return None
    inner = progress

    def labelled(policy: str, done: int, total: int, hit_rate: float) -> None:
        inner(f"load {load:.0%} {policy}", done, total, hit_rate)

    return labelled


def format_ladder(rungs: Sequence[LadderRung], slo_ms: float) -> str:
    """The table: per rung, the label and its measured busy share, then one row per policy."""
    head = (
        f"{'load':>5}  {'policy':<18}  {'hit rate':>8}  {'mean':>8}  {'p50':>8}  {'p99 ms':>8}  "
        f"{'imbalance':>9}  {'busy':>6}  {'goodput@' + format(slo_ms, '.0f') + 'ms':>14}  {'mean/oracle':>11}"
    )
    lines = [head, "-" * len(head)]
    for rung in rungs:
        if math.isfinite(rung.measured_load):
            lines.append(f"{rung.load:>5.0%}  (measured: the oracle keeps the workers {rung.measured_load:.1%} busy)")
        oracle = next((e.summary for e in rung.entries if e.summary.policy == ORACLE), None)
        for e in rung.entries:
            s = e.summary
            ratio = s.ttft_mean_ms / oracle.ttft_mean_ms if oracle and oracle.ttft_mean_ms > 0 else math.nan
            lines.append(
                f"{rung.load:>5.0%}  {s.policy:<18}  {100 * s.hit_rate:>7.1f}%  {s.ttft_mean_ms:>8.1f}  "
                f"{s.ttft_p50_ms:>8.1f}  {s.ttft_p99_ms:>8.1f}  {s.load_imbalance:>9.2f}  {100 * e.busy_share:>5.1f}%  "
                f"{100 * e.goodput:>13.1f}%  {ratio:>10.2f}x"
            )
    return "\n".join(lines)


def ladder_targets(rungs: Sequence[LadderRung], up_to_load: float = 0.9) -> tuple[str, ...]:
    """One line per rung up to ``up_to_load``: kvroute vs the oracle (1.15x mean, 1.3x p99) and the baselines."""
    from kvroute_sim.demo.report import check_targets

    lines = []
    for rung in rungs:
        if rung.load > up_to_load + 1e-9:
            continue
        for check in check_targets([e.summary for e in rung.entries]):
            lines.append(f"load {rung.load:.0%}: {check.line()}")
    return tuple(lines)


def write_ladder_chart(out_dir: Path, rungs: Sequence[LadderRung], slo_ms: float, title: str) -> Path:
    """Mean TTFT, p99 TTFT (log) and goodput against load, one line per policy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LADDER_CHART_FILE
    loads = [100 * r.load for r in rungs]
    names = [e.summary.policy for e in rungs[0].entries] if rungs else []
    with png(path, title, 1, 3, figsize=(16, 5)) as (_, axes):
        for name in names:
            entries = [next(e for e in r.entries if e.summary.policy == name) for r in rungs]
            style = {"linewidth": 2.5, "color": "tab:green"} if name == KVROUTE else {}
            style |= {"linestyle": "--", "color": "black"} if name == ORACLE else {}
            axes[0].plot(loads, [e.summary.ttft_mean_ms for e in entries], marker="o", label=name, **style)
            axes[1].plot(loads, [e.summary.ttft_p99_ms for e in entries], marker="o", label=name, **style)
            axes[2].plot(loads, [100 * e.goodput for e in entries], marker="o", label=name, **style)
        for ax, label in zip(
            axes, ("mean TTFT (ms, log)", "p99 TTFT (ms, log)", f"goodput (% within {slo_ms:.0f} ms)"), strict=True
        ):
            ax.set_xlabel("load (best-reuse prefill work, % of prefill capacity)")
            ax.set_title(label)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        axes[2].legend(fontsize=8)
    return path
