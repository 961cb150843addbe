"""Decision CPU (P1) and its fleet-size scaling (P6): candidate plan + Scorer.decide, µs p50/p99.

Run: ``python bench/bench_scorer.py [--repeats R] [--seed S]``.

Each timed decision does what the Router does once it holds the cache answer and warm
statuses: ``plan_candidates`` for a fresh request id (so the cold draw varies), the
scoring view of each candidate's cached status (``Scorer.observe``), and ``Scorer.decide``
(which also records the selection in the ledger). The prompt is 8K tokens given as
caller keys (block size 16 → 512 keys); the plan and the Scorer read the answer's matches
and seq_len, not the keys. Every worker's status holds 4 waiting and 4 running tasks.

P1: 16 candidates (14 hot + 2 cold) among 100 known workers.
P6: the same 8 candidates (6 hot + 2 cold) among 8, 100 and 1,000 known workers; the
per-decision cost must stay within 1.2× from 8 to 1,000. Cases run interleaved in rounds
so machine noise hits them alike.

Also shown, not part of P1: building the explanation table (only for explain/debug), and
the shadow index's record and match for the same 512-key prompt (the KVCM-outage path).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

from actors.scorer import CandidatePlan, Fleet, Scorer, Selection, plan_candidates
from actors.shadow_index import ShadowIndex
from router.config import DeploymentConfig, ScorerConfig, ShadowConfig
from router.types import HostMatch, Role, TaskInfo, WorkerAddr, WorkerStatus

PROMPT_TOKENS = 8192
BLOCK_SIZE = 16
N_KEYS = PROMPT_TOKENS // BLOCK_SIZE


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
        self.scorer = Scorer(self.config, replace(DeploymentConfig(), block_size=BLOCK_SIZE))
        self.cache = {w: make_status(rng) for w in workers}  # the prober's warm cache
        holders = rng.sample(workers, min(hot, n_workers))
        self.hosts = tuple(HostMatch(w.http_target, local=rng.randrange(1, N_KEYS + 1)) for w in holders)
        self.decisions = 0
        self.samples: list[float] = []
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


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=20_000, help="timed decisions per case")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cases = {
        "P1": Case(100, 14, 2, args.seed),
        "P6-8": Case(8, 6, 2, args.seed),
        "P6-100": Case(100, 6, 2, args.seed),
        "P6-1000": Case(1000, 6, 2, args.seed),
    }
    chunk = 500
    for case in cases.values():  # warm-up: ledger, caches, allocator
        for _ in range(chunk):
            case.step(record=False)
    for _ in range(max(1, args.repeats // chunk)):
        for case in cases.values():
            for _ in range(chunk):
                case.step(record=True)

    print(f"plan + observe + decide; {PROMPT_TOKENS}-token prompt as {N_KEYS} caller keys; warm statuses")
    print(f"{'case':<10} {'workers':>7} {'candidates':>10} {'p50 µs':>8} {'p99 µs':>8}")
    for name, case in cases.items():
        print(
            f"{name:<10} {case.n_workers:>7} {case.candidates:>10} "
            f"{statistics.median(case.samples):>8.1f} {p99(case.samples):>8.1f}"
        )
    ratio = statistics.median(cases["P6-1000"].samples) / statistics.median(cases["P6-8"].samples)
    print(f"P6 p50 ratio, 1,000 / 8 workers: {ratio:.2f} (target <= 1.20)")

    p1 = cases["P1"]
    assert p1.last is not None
    selection = p1.last[1]
    explain = timed(selection.explain, 2000)
    print(f"explain table, 16 candidates (explain/debug only): p50 {statistics.median(explain):.1f} µs")

    rng = random.Random(args.seed)
    shadow = ShadowIndex(ShadowConfig().ttl_s, ShadowConfig().capacity_blocks)
    prompts = [tuple(rng.getrandbits(63) for _ in range(N_KEYS)) for _ in range(200)]
    for i, keys in enumerate(prompts):
        shadow.record(f"10.0.{i % 50}.1:8000", keys, now=1.0)
    record = timed(lambda: shadow.record("10.0.0.1:8000", prompts[-1], now=2.0), 2000)
    match = timed(lambda: shadow.match(prompts[-1], now=2.0, limit=p1.config.hot_set_size), 2000)
    print(
        f"shadow index, {N_KEYS} keys: record p50 {statistics.median(record):.1f} µs, "
        f"match p50 {statistics.median(match):.1f} µs"
    )


if __name__ == "__main__":
    main()
