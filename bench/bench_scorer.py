"""Decision CPU (P1) and its fleet-size scaling (P6): candidate plan + Scorer.decide, µs p50/p99.

Run: ``python bench/bench_scorer.py [--repeats R] [--seed S]``.

The cases and what one timed decision does are defined in ``kvroute_sim.bench.decision_cpu``
(shared with ``kvroute bench``, which reports the same P1/P6 rows in its table).

Also shown here, not part of P1: building the explanation table (only for explain/debug),
and the shadow index's record and match for the same 512-key prompt (the KVCM-outage path).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from actors.shadow_index import ShadowIndex
from kvroute_sim.bench.decision_cpu import N_KEYS, PROMPT_TOKENS, decision_cases, run_interleaved
from kvroute_sim.stats import Summary, percentile
from router.config import ShadowConfig


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20_000, help="timed decisions per case")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cases = decision_cases(args.seed)
    run_interleaved(cases.values(), args.repeats)

    print(f"plan + observe + decide; {PROMPT_TOKENS}-token prompt as {N_KEYS} caller keys; warm statuses")
    print(f"{'case':<10} {'workers':>7} {'candidates':>10} {'p50 µs':>8} {'p99 µs':>8}")
    for name, case in cases.items():
        summary = Summary.of(case.samples)
        print(f"{name:<10} {case.n_workers:>7} {case.candidates:>10} {summary.p50:>8.1f} {summary.p99:>8.1f}")
    ratio = percentile(cases["P6-1000"].samples, 50) / percentile(cases["P6-8"].samples, 50)
    print(f"P6 p50 ratio, 1,000 / 8 workers: {ratio:.2f} (target <= 1.20)")

    p1 = cases["P1"]
    assert p1.last is not None
    selection = p1.last[1]
    explain = timed(selection.explain, 2000)
    print(f"explain table, 16 candidates (explain/debug only): p50 {percentile(explain, 50):.1f} µs")

    rng = random.Random(args.seed)
    shadow = ShadowIndex(ShadowConfig().ttl_s, ShadowConfig().capacity_blocks)
    prompts = [tuple(rng.getrandbits(63) for _ in range(N_KEYS)) for _ in range(200)]
    for i, keys in enumerate(prompts):
        shadow.record(f"10.0.{i % 50}.1:8000", keys, now=1.0)
    record = timed(lambda: shadow.record("10.0.0.1:8000", prompts[-1], now=2.0), 2000)
    match = timed(lambda: shadow.match(prompts[-1], now=2.0, limit=p1.config.hot_set_size), 2000)
    print(
        f"shadow index, {N_KEYS} keys: record p50 {percentile(record, 50):.1f} µs, "
        f"match p50 {percentile(match, 50):.1f} µs"
    )


if __name__ == "__main__":
    main()
