"""P3: decisions/s through the full actor pipeline with a warm status cache, on one core.

Two rows, each with the default configuration (status freshness 50 ms, so the cache stays
warm under load and a worker is re-probed about 20 times a second):

- in memory: SimCluster served on a MemoryNetwork in this process, real clock — the
  pipeline's own overhead (the simulators' handlers run on the same trio thread);
- loopback gRPC: the simulators in the separate process; compared with the raw grpcio
  client's concurrent GetHostCacheState throughput (what a warm route issues per
  decision) at the same number of calls in flight, measured in the same run, interleaved.

Both rows report this process's CPU per decision (``time.process_time``: every thread, the
trio thread and grpc's alike); the gRPC row the raw client's CPU per call beside it, and a round's
decisions made through the sidecar ``kvroute serve`` runs: as many callers in a child process (on
the simulators' CPUs) in a closed loop against a Sidecar in this process, its CPU per decision with
grpc's server and the hand-offs to the trio thread in it.

The prober's rate budget (2,000 probes/s by default) is reported: probes started per
second and probes skipped for want of budget during the measured window.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field, replace

import trio

from kvroute_sim.bench.callers import Level, caller_process
from kvroute_sim.bench.harness import ClusterShape, ClusterView, Outcomes, Requests, concurrent, prime, router_config
from kvroute_sim.bench.overload import SETTLE_S, reply_outcomes, route_requests, serving_sidecar
from kvroute_sim.bench.profiling import WindowProfile
from kvroute_sim.bench.raw_grpc import RawClient
from kvroute_sim.bench.results import BenchReport, Figure, Verdict, at_least, kvcm_share_note, kvcm_share_text, via_kvcm
from kvroute_sim.stats import shown_against
from router.api import RouterHandle, open_router
from router.config import ProberConfig
from router.transport.ports import RawRpc

P3_MEMORY_TARGET = 3000.0
P3_GRPC_TARGET_RATIO = 0.8
FIGURE_TIMEOUT_S = 600.0
BUDGET_NEAR = 0.9  # a probe rate at 90 % of the rate budget counts as binding
# The sidecar pass's calls carry no budget (the router's default) and a client deadline no decision
# comes near: a closed loop at the figure's concurrency, every call waited for.
SIDECAR_CLIENT_DEADLINE_S = 2.0


@dataclass(frozen=True, slots=True)
class ThroughputSizes:
    rounds: int
    decisions_per_round: int  # per row and round
    concurrency: int  # routes (and raw calls) in flight
    warm_up: int


@dataclass(slots=True)
class _Run:
    decisions: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0  # this process's CPU over the measured windows (every thread: trio, grpc, the router)
    probes_started: int = 0
    skipped_no_budget: int = 0
    status_hits: int = 0  # status lookups answered from the prober's cache
    status_lookups: int = 0
    outcomes: Outcomes = field(default_factory=Outcomes.empty)

    @property
    def rate(self) -> float:
        return self.decisions / self.seconds

    @property
    def cpu_ms_per_decision(self) -> float:
        return self.cpu_s * 1e3 / self.decisions if self.decisions else 0.0

    @property
    def cache_hit_ratio(self) -> float:
        return self.status_hits / self.status_lookups if self.status_lookups else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "decisions": self.decisions,
            "seconds": self.seconds,
            "decisions_per_s": self.rate,
            "process_cpu_ms_per_decision": self.cpu_ms_per_decision,
            "probes_started_per_s": self.probes_started / self.seconds,
            "probes_skipped_no_budget": self.skipped_no_budget,
            "status_cache_hit_ratio": self.cache_hit_ratio,
            "outcomes": self.outcomes.to_json(),
        }

    def budget_note(self) -> str:
        budget = ProberConfig().rate_per_s
        probes = self.probes_started / self.seconds
        # Binding: the rate nears the budget, or more than 1 % of the probes were refused budget.
        binding = probes >= BUDGET_NEAR * budget or self.skipped_no_budget > 0.01 * max(1, self.probes_started)
        return (
            f"probe rate {probes:,.0f}/s of the {budget:,.0f}/s budget ({'BINDING' if binding else 'not binding'}; "
            f"{self.skipped_no_budget} probes skipped for want of budget)"
        )


async def _drive(router: RouterHandle, requests: Requests, count: int, concurrency: int, into: _Run) -> None:
    """One measured window: decisions, time and the prober's counters over it."""
    before = router.prober().snapshot()
    cpu_before = time.process_time()
    seconds, outcomes = await concurrent(router, requests, count, concurrency)
    into.cpu_s += time.process_time() - cpu_before
    after = router.prober().snapshot()
    into.decisions += count
    into.seconds += seconds
    into.probes_started += after.probes_started - before.probes_started
    into.skipped_no_budget += after.skipped.get("no_budget", 0) - before.skipped.get("no_budget", 0)
    hits = after.cache_hits - before.cache_hits
    into.status_hits += hits
    into.status_lookups += hits + after.cache_misses - before.cache_misses
    into.outcomes.merge(outcomes)


RunCheck = Callable[[_Run], bool]


@dataclass(frozen=True, slots=True)
class SidecarRun:
    """P3 gRPC's decisions made through the sidecar: answered calls, the level's time and this process's
    CPU over it (the sidecar, the router and grpc's threads)."""

    calls: int
    answered: int
    seconds: float
    cpu_s: float
    kvcm_share: float  # of the answered calls

    @property
    def rate(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    @property
    def cpu_ms_per_decision(self) -> float:
        return self.cpu_s * 1e3 / self.answered if self.answered else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "calls": self.calls,
            "answered": self.answered,
            "decisions_per_s": self.rate,
            "process_cpu_ms_per_decision": self.cpu_ms_per_decision,
            "kvcm_share": self.kvcm_share,
        }


async def _sidecar_run(view: ClusterView, sizes: ThroughputSizes, caller_cpus: Set[int] | None) -> SidecarRun:
    """A round's decisions, through a Sidecar in this process, from ``sizes.concurrency`` callers in a
    child process (pinned to ``caller_cpus``)."""
    calls = sizes.decisions_per_round
    async with serving_sidecar(view, "p3-sidecar", sizes.warm_up) as (sidecar, bound, _):
        with caller_process(caller_cpus) as callers:
            warm = Level(
                str(bound),
                route_requests(view, "p3-sidecar-warm", sizes.warm_up, budget_ms=0),
                sizes.concurrency,
                FIGURE_TIMEOUT_S,
                SIDECAR_CLIENT_DEADLINE_S,
            )
            await trio.to_thread.run_sync(callers.run, warm)
            level = Level(
                str(bound),
                route_requests(view, "p3-sidecar", calls, budget_ms=0),
                sizes.concurrency,
                FIGURE_TIMEOUT_S,
                SIDECAR_CLIENT_DEADLINE_S,
            )
            cpu_before = time.process_time()
            run = await trio.to_thread.run_sync(callers.run, level)
            await trio.to_thread.run_sync(sidecar.wait_idle, SETTLE_S)
            cpu_s = time.process_time() - cpu_before
    outcomes = reply_outcomes(raw for r in run.results for raw in r.replies)
    answered = sum(outcomes.values())
    via = sum(n for key, n in outcomes.items() if key.split("/", 1)[0] == "kvcm")
    return SidecarRun(calls, answered, run.seconds, cpu_s, via / answered if answered else 0.0)


async def _router_run(
    view: ClusterView,
    rpc: RawRpc | None,
    sizes: ThroughputSizes,
    between_rounds: Callable[[], None] | None,
    missed: RunCheck,
) -> tuple[_Run, WindowProfile | None]:
    """The measured rounds; then, if ``missed(run)``, one more (half) window under cProfile."""
    run = _Run()
    profile: WindowProfile | None = None
    with trio.fail_after(FIGURE_TIMEOUT_S):
        async with open_router(router_config(view, status_ttl_s=None), rpc=rpc) as router:
            requests = Requests(view, "p3")
            await prime(router, requests, sizes.warm_up)
            for _ in range(sizes.rounds):
                if between_rounds is not None:
                    await trio.to_thread.run_sync(between_rounds)
                await _drive(router, requests, sizes.decisions_per_round, sizes.concurrency, run)
            if missed(run):
                profile = WindowProfile()
                with profile:
                    await concurrent(router, requests, max(1, sizes.decisions_per_round // 2), sizes.concurrency)
    return run, profile


async def _memory_run(shape: ClusterShape, sizes: ThroughputSizes) -> tuple[_Run, WindowProfile | None]:
    _, network, view = shape.in_memory()
    return await _router_run(view, network, sizes, None, lambda run: run.rate < P3_MEMORY_TARGET)


def _rate_row(
    key: str, measured: str, run: _Run, extra: str, target: str, verdict: Verdict, data: dict[str, object]
) -> Figure:
    kvcm = run.outcomes.fraction_from("kvcm")
    return Figure(
        key,
        measured,
        f"{shown_against(run.rate, 0, at_least=True):,.0f} decisions/s{extra}; process CPU "
        f"{run.cpu_ms_per_decision:.3f} ms/decision; {kvcm_share_text(kvcm)}{kvcm_share_note(kvcm)}; status hit ratio "
        f"{run.cache_hit_ratio:.3f}; {run.budget_note()}",
        target,
        via_kvcm(verdict, kvcm),
        {**run.to_json(), **data},
    )


def measure_memory(report: BenchReport, shape: ClusterShape, sizes: ThroughputSizes) -> None:
    run, profile = trio.run(_memory_run, shape, sizes)
    verdict = at_least(run.rate, P3_MEMORY_TARGET)
    report.figures.append(
        _rate_row(
            "P3 memory",
            f"decisions/s, full actor pipeline, in-memory transports, {sizes.concurrency} in flight, one core",
            run,
            "",
            f"≥ {P3_MEMORY_TARGET:,.0f}/s",
            verdict,
            {"concurrency": sizes.concurrency},
        )
    )
    if profile is not None:
        report.profiles["P3 memory"] = profile.top()
        busy = profile.busy_s()
        sim_share = profile.cumulative_s("kvroute_sim/sim/memory_server.py", "handle") / busy
        kvcm_share = profile.cumulative_s("kvroute_sim/sim/kvcm.py", "_answer_cache_state") / busy
        report.notes.append(
            f"P3 memory: the simulated KVCM and workers run on the same trio thread; in the profiled window "
            f"their handlers took {sim_share:.0%} of its busy CPU, of which the KVCM's cache-state answers "
            f"{kvcm_share:.0%} (the router alone: ≈ {run.rate / (1 - sim_share):,.0f} decisions/s)."
        )


def rounds_rate(rates: Sequence[float]) -> float:
    """The rate over rounds of as many calls each, at ``rates``: all the calls over all the rounds'
    time (their harmonic mean), as the router's rate is taken. Their plain mean is never lower, and
    put the raw client ahead by the rounds' spread alone."""
    return statistics.harmonic_mean(rates)


def measure_grpc(
    report: BenchReport, view: ClusterView, raw: RawClient, sizes: ThroughputSizes, caller_cpus: Set[int] | None
) -> None:
    raw_rates: list[float] = []
    raw_cpu_s: list[float] = []

    def raw_round() -> None:
        cpu_before = time.process_time()
        raw_rates.append(raw.concurrent_rate(sizes.decisions_per_round, sizes.concurrency))
        raw_cpu_s.append(time.process_time() - cpu_before)

    def missed(run: _Run) -> bool:
        return run.rate / rounds_rate(raw_rates) < P3_GRPC_TARGET_RATIO

    raw.warm_up(sizes.warm_up)
    run, profile = trio.run(_router_run, view, None, sizes, raw_round, missed)
    raw_rate = rounds_rate(raw_rates)
    ratio = run.rate / raw_rate
    raw_cpu_ms = sum(raw_cpu_s) * 1e3 / (sizes.decisions_per_round * len(raw_cpu_s))
    sidecar = trio.run(_sidecar_run, view, sizes, caller_cpus)
    row = _rate_row(
        "P3 gRPC",
        f"decisions/s over loopback gRPC (sims in a separate process), {sizes.concurrency} in flight, "
        "vs raw concurrent GetHostCacheState calls/s; then through the sidecar, "
        f"{sizes.concurrency} callers in a child process",
        run,
        f" vs raw {raw_rate:,.0f} calls/s ({raw_cpu_ms:.3f} ms CPU/call) → "
        f"{shown_against(ratio, 2, at_least=True):.2f}×",
        f"≥ {P3_GRPC_TARGET_RATIO}× raw",
        at_least(ratio, P3_GRPC_TARGET_RATIO),
        {
            "concurrency": sizes.concurrency,
            "raw_calls_per_s": raw_rates,
            "raw_process_cpu_ms_per_call": raw_cpu_ms,
            "ratio": ratio,
            "sidecar": sidecar.to_json(),
        },
    )
    report.figures.append(
        replace(
            row,
            result=f"{row.result}; through the sidecar {sidecar.rate:,.0f} decisions/s, sidecar process CPU "
            f"{sidecar.cpu_ms_per_decision:.3f} ms/decision ({sidecar.answered:,} of {sidecar.calls:,} answered, "
            f"{sidecar.kvcm_share:.0%} via kvcm)",
        )
    )
    if profile is not None:
        report.profiles["P3 gRPC"] = profile.top()
