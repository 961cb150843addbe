"""Soak: N requests through the router over in-memory transports; does anything grow?

Requests carry a seeded 8K-token prompt plus a few keys no other request has, so the
shadow index keeps meeting new prompts (and must evict), request ids are all new, and the
status cache is refreshed at its normal rate. After a warm-up (a tenth of N, at least
1,000 routes but at most half of N) the process's RSS, open file descriptors and live trio tasks are read; again
at the end (after a garbage collection both times). The channel pool does not exist with
in-memory transports: the bounded maps the routes do touch are reported instead.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import psutil
import trio

from kvroute_sim.bench.harness import ClusterShape, ClusterView, Outcomes, Requests, concurrent, prime, router_config
from kvroute_sim.bench.results import BenchReport, Figure, Verdict, at_most
from kvroute_sim.stats import shown_against
from router.api import RouterHandle, open_router
from router.transport.memory_adapter import MemoryNetwork

SOAK_TARGET_RSS_GROWTH_MB = 20.0
# Descriptors and live trio tasks at the end of the run against after the warm-up: background work
# (a probe in flight at one reading) moves them by a few; a leak per request, by thousands.
SOAK_TARGET_FD_GROWTH = 16
SOAK_TARGET_TASK_GROWTH = 16
UNIQUE_TAIL_KEYS = 8
MIN_WARM_UP = 1_000
SAMPLES = 10  # RSS read this many times over the measured part
SLOWEST_RATE = 50.0  # decisions/s: the soak's deadline allows N at this rate ...
STARTUP_ALLOWANCE_S = 60.0  # ... plus this


@dataclass(frozen=True, slots=True)
class Reading:
    rss_mb: float
    open_fds: int
    live_tasks: int

    def to_json(self) -> dict[str, float]:
        return {"rss_mb": self.rss_mb, "open_fds": self.open_fds, "live_tasks": self.live_tasks}


def _count_tasks(task: trio.lowlevel.Task) -> int:
    return 1 + sum(_count_tasks(child) for nursery in task.child_nurseries for child in nursery.child_tasks)


def _read(process: psutil.Process) -> Reading:
    gc.collect()
    root = trio.lowlevel.current_root_task()
    assert root is not None, "called inside trio.run"
    return Reading(rss_mb=process.memory_info().rss / 2**20, open_fds=process.num_fds(), live_tasks=_count_tasks(root))


def _plain(value: object) -> object:
    """A health snapshot as JSON-ready data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _bounded_maps(router: RouterHandle) -> dict[str, object]:
    health = router.actors_health()
    prober = router.prober().snapshot()
    return {
        "prober_tracked_workers": prober.tracked_workers,
        "shadow_index": _plain(health["shadow_index"].get("health")),
        "metrics_sink": _plain(health["metrics_sink"].get("health")),
        "router": _plain(health["router"].get("health")),
        "channel_pool": "none (in-memory transport)",
    }


@dataclass(frozen=True, slots=True)
class SoakResult:
    requests: int
    warm_up: int
    seconds: float  # the measured part
    start: Reading
    end: Reading
    rss_samples_mb: tuple[float, ...]
    outcomes: Outcomes
    maps: dict[str, object]
    metrics_processed: int
    metrics_dropped: int  # events the MetricsSink's full inbox refused (counted, by design never waited for)

    def to_json(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "warm_up": self.warm_up,
            "seconds": self.seconds,
            "decisions_per_s": (self.requests - self.warm_up) / self.seconds,
            "after_warm_up": self.start.to_json(),
            "end": self.end.to_json(),
            "rss_growth_mb": self.end.rss_mb - self.start.rss_mb,
            "rss_samples_mb": list(self.rss_samples_mb),
            "outcomes": self.outcomes.to_json(),
            "bounded_maps": self.maps,
            "metrics_events_processed": self.metrics_processed,
            "metrics_events_dropped": self.metrics_dropped,
        }


async def _soak(shape: ClusterShape, requests_total: int, concurrency: int) -> SoakResult:
    warm_up = max(min(MIN_WARM_UP, requests_total // 2), requests_total // 10)
    measured = requests_total - warm_up
    _, network, view = shape.in_memory()
    # Bounded: a soak slower than SLOWEST_RATE decisions/s is broken, not slow.
    with trio.fail_after(STARTUP_ALLOWANCE_S + requests_total / SLOWEST_RATE):
        return await _soak_router(view, network, requests_total, warm_up, measured, concurrency)


async def _soak_router(
    view: ClusterView, network: MemoryNetwork, requests_total: int, warm_up: int, measured: int, concurrency: int
) -> SoakResult:
    process = psutil.Process()
    async with open_router(router_config(view, status_ttl_s=None), rpc=network) as router:
        requests = Requests(view, "soak", unique_tail=UNIQUE_TAIL_KEYS)
        await prime(router, requests, 0)
        await concurrent(router, requests, warm_up, concurrency)
        start = _read(process)
        samples, outcomes, seconds = [], Outcomes.empty(), 0.0
        chunk = max(1, measured // SAMPLES)
        done = 0
        while done < measured:
            step = min(chunk, measured - done)
            elapsed, got = await concurrent(router, requests, step, concurrency)
            seconds += elapsed
            outcomes.merge(got)
            done += step
            samples.append(process.memory_info().rss / 2**20)
        end = _read(process)
        maps = _bounded_maps(router)
        sink = router.metrics.snapshot()
    return SoakResult(
        requests_total, warm_up, seconds, start, end, tuple(samples), outcomes, maps, sink.processed, sink.dropped
    )


def soak_verdict(result: SoakResult) -> Verdict:
    """Met when neither memory, descriptors nor live tasks grew past their bound over the run."""
    bounded = (
        at_most(result.end.open_fds - result.start.open_fds, SOAK_TARGET_FD_GROWTH) is Verdict.MET
        and at_most(result.end.live_tasks - result.start.live_tasks, SOAK_TARGET_TASK_GROWTH) is Verdict.MET
    )
    rss = at_most(result.end.rss_mb - result.start.rss_mb, SOAK_TARGET_RSS_GROWTH_MB)
    return rss if bounded else Verdict.MISSED


def measure(report: BenchReport, shape: ClusterShape, requests_total: int, concurrency: int, *, default: bool) -> None:
    result = trio.run(_soak, shape, requests_total, concurrency)
    growth = result.end.rss_mb - result.start.rss_mb
    label = f"{requests_total:,} requests" + (" (the default run's soak; --soak N for more)" if default else "")
    report.figures.append(
        Figure(
            "soak",
            f"{label}, in-memory transports, {concurrency} in flight; after a {result.warm_up:,}-route warm-up",
            f"RSS {result.start.rss_mb:.1f} → {result.end.rss_mb:.1f} MB "
            f"({shown_against(growth, 1, at_least=False):+.1f} MB); open fds "
            f"{result.start.open_fds} → {result.end.open_fds}; live tasks {result.start.live_tasks} → "
            f"{result.end.live_tasks}; pool: none (in-memory); "
            f"{(requests_total - result.warm_up) / result.seconds:,.0f} decisions/s, "
            f"{result.outcomes.fraction_from('kvcm'):.0%} via kvcm; metrics events dropped "
            f"{result.metrics_dropped:,} of {result.metrics_dropped + result.metrics_processed:,}",
            f"RSS growth ≤ {SOAK_TARGET_RSS_GROWTH_MB:.0f} MB; open fds and live tasks growth ≤ "
            f"{SOAK_TARGET_FD_GROWTH} and {SOAK_TARGET_TASK_GROWTH}",
            soak_verdict(result),
            result.to_json(),
        )
    )
