"""P1 (decision CPU) and P6 (its fleet-size scaling): candidate plan + Scorer, µs per decision.

Each timed decision does what the Router does once it holds the cache answer and warm
statuses: ``plan_candidates`` for a fresh request id (so the cold draw varies), the
scoring view of each candidate's cached status (``Scorer.observe``), and ``Scorer.decide``
(which also records the selection in the ledger). The prompt is 8K tokens given as
caller keys (block size 16 → 512 keys); the plan and the Scorer read the answer's matches
and seq_len, not the keys. Every worker's status holds 4 waiting and 4 running tasks.

P1: 16 candidates (14 hot + 2 cold) among 100 known workers.
P6: the same 8 candidates (6 hot + 2 cold) among 8, 100 and 1,000 known workers (8 is
the most a fleet of 8 can offer). Cases run interleaved in rounds so machine noise hits
them alike. ``bench/bench_scorer.py`` reuses this setup for its own extra rows.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import replace

from kvroute_sim.bench.profiling import WindowProfile
from kvroute_sim.bench.results import BenchReport, Figure, Verdict, at_most
from kvroute_sim.stats import Summary, shown_against
from router.config import DeploymentConfig, KvrouteConfig, ScorerConfig
from router.policy.cache_affinity import CacheAffinityFirst, Selection
from router.policy.choice import status_horizon_s
from router.policy.plan import CandidatePlan, Fleet, plan_candidates
from router.types import HostMatch, Role, TaskInfo, WorkerAddr, WorkerStatus

PROMPT_TOKENS = 8192
BLOCK_SIZE = 16
N_KEYS = PROMPT_TOKENS // BLOCK_SIZE
ROUND_CHUNK = 500  # decisions per case per round
P1_TARGET_US = 100.0
P6_TARGET_RATIO = 1.2


def make_status(rng: random.Random) -> WorkerStatus:
    def task(i: int, waiting: bool) -> TaskInfo:
        length = rng.randrange(256, 8192)
        return TaskInfo(
            request_id=f"t{i}",
            input_length=length,
            prefix_length=rng.randrange(0, length),
            is_waiting=waiting,
            remaining_prefill_tokens=None if waiting else rng.randrange(0, length),
        )

    return WorkerStatus(
        role=Role.PREFILL,
        role_reported="RoleType.PREFILL",
        alive=True,
        status_version=1,
        latest_finished_version=1,
        waiting=tuple(task(i, True) for i in range(4)),
        running=tuple(task(i, False) for i in range(4, 8)),
        block_size=BLOCK_SIZE,
    )


class Case:
    """One fleet with warm statuses and one KVCM answer; ``step`` times one decision."""

    def __init__(self, n_workers: int, hot: int, cold: int, seed: int) -> None:
        rng = random.Random(seed)
        workers = [WorkerAddr.from_http(f"10.{i // 250}.{i % 250}.1", 8000) for i in range(n_workers)]
        self.n_workers, self.candidates = n_workers, min(hot + cold, n_workers)
        self.fleet = Fleet.of(workers)
        self.config = replace(ScorerConfig(), hot_set_size=hot, cold_set_size=cold, seed=seed)
        self.scorer = CacheAffinityFirst(
            self.config,
            replace(DeploymentConfig(), block_size=BLOCK_SIZE),
            status_horizon_s=status_horizon_s(KvrouteConfig()),
        )
        self.cache = {w: make_status(rng) for w in workers}  # the prober's warm cache
        holders = rng.sample(workers, min(hot, n_workers))
        self.hosts = tuple(HostMatch(w.http_target, local=rng.randrange(1, N_KEYS + 1)) for w in holders)
        self.decisions = 0
        self.samples: list[float] = []  # µs per recorded decision
        self.last: tuple[CandidatePlan, Selection] | None = None

    def step(self, record: bool) -> None:
        self.decisions += 1
        now = self.decisions * 0.001
        start = time.perf_counter()
        plan = plan_candidates(
            self.hosts, self.fleet, request_id=f"req-{self.decisions}", namespace="ns", config=self.config
        )
        observe, cache = self.scorer.observe, self.cache
        statuses = {c.worker: observe(c.worker, cache[c.worker], 0.0) for c in plan.candidates}
        selection = self.scorer.decide(plan, statuses, seq_len=PROMPT_TOKENS, block_size=BLOCK_SIZE, now=now)
        elapsed = time.perf_counter() - start
        if record:
            self.samples.append(elapsed * 1e6)
        self.last = (plan, selection)
        assert selection.worker is not None and len(plan.candidates) == self.candidates


def decision_cases(seed: int) -> dict[str, Case]:
    return {
        "P1": Case(100, 14, 2, seed),
        "P6-8": Case(8, 6, 2, seed),
        "P6-100": Case(100, 6, 2, seed),
        "P6-1000": Case(1000, 6, 2, seed),
    }


def run_interleaved(cases: Iterable[Case], repeats: int) -> None:
    """One warm-up round (ledger, caches, allocator), then ``repeats`` recorded decisions per case."""
    cases = tuple(cases)
    for case in cases:
        for _ in range(ROUND_CHUNK):
            case.step(record=False)
    for _ in range(max(1, repeats // ROUND_CHUNK)):
        for case in cases:
            for _ in range(ROUND_CHUNK):
                case.step(record=True)


def measure(report: BenchReport, *, p1: bool, p6: bool, repeats: int, seed: int) -> None:
    """Append the P1 and/or P6 rows; profile a missed target's case."""
    cases = decision_cases(seed)
    run_interleaved(cases.values() if p6 else (cases["P1"],), repeats)
    if p1:
        case = cases["P1"]
        summary = Summary.of(case.samples)
        verdict = at_most(summary.p50, P1_TARGET_US)
        report.figures.append(
            Figure(
                "P1",
                f"plan + Scorer, {case.candidates} candidates / {case.n_workers} workers, "
                f"{PROMPT_TOKENS}-token prompt as {N_KEYS} caller keys, warm statuses",
                f"p50 {shown_against(summary.p50, 1, at_least=False):.1f} µs, p99 {summary.p99:.1f} µs",
                f"p50 ≤ {P1_TARGET_US:.0f} µs",
                verdict,
                {"unit": "us", **summary.to_json()},
            )
        )
        if verdict is Verdict.MISSED:
            with WindowProfile() as profile:
                run_interleaved((case,), ROUND_CHUNK * 4)
            report.profiles["P1"] = profile.top()
    if p6:
        by_size = {name: Summary.of(cases[name].samples) for name in ("P6-8", "P6-100", "P6-1000")}
        ratio = by_size["P6-1000"].p50 / by_size["P6-8"].p50
        verdict = at_most(ratio, P6_TARGET_RATIO)
        report.figures.append(
            Figure(
                "P6",
                f"P1 with {cases['P6-8'].candidates} candidates among 8 / 100 / 1,000 workers, p50 ratio 1,000/8",
                f"{shown_against(ratio, 2, at_least=False):.2f}× ("
                + " / ".join(f"{s.p50:.1f}" for s in by_size.values())
                + " µs p50)",
                f"≤ {P6_TARGET_RATIO}×",
                verdict,
                {"ratio_1000_over_8": ratio, "unit": "us", **{k: s.to_json() for k, s in by_size.items()}},
            )
        )
        if verdict is Verdict.MISSED:
            with WindowProfile() as profile:
                run_interleaved((cases["P6-1000"],), ROUND_CHUNK * 4)
            report.profiles["P6 (1,000 workers)"] = profile.top()
