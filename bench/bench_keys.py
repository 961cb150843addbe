"""Block-key hashing cost: µs per 8K-token prompt at block size 16, each family (p50 of repeats).

Run: ``python bench/bench_keys.py [--tokens N] [--block-size BS] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import random
import time

from kvroute_sim.stats import percentile
from router.keys import block_keys
from router.types import KeyFamily

# (family, lookahead) cases; the vllm/sglang lookahead-1 rows show what lookahead costs.
CASES: tuple[tuple[KeyFamily, int], ...] = (
    (KeyFamily.RTP, 0),
    (KeyFamily.VLLM, 0),
    (KeyFamily.VLLM, 1),
    (KeyFamily.SGLANG, 0),
    (KeyFamily.SGLANG, 1),
)


def measure_us(
    tokens: tuple[int, ...], block_size: int, family: KeyFamily, lookahead: int, repeats: int
) -> list[float]:
    samples: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        block_keys(tokens, block_size, family, lookahead)
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length in tokens")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    # Realistic vocabulary ids (a 152K-token vocabulary), as a tuple like RouteRequest.token_ids.
    tokens = tuple(rng.randrange(152_064) for _ in range(args.tokens))
    print(f"{args.tokens} tokens, block size {args.block_size}, {args.repeats} repeats")
    print(f"{'family':<8} {'lookahead':>9} {'keys':>5} {'p50 µs':>9} {'p99 µs':>9} {'min µs':>9}")
    for family, lookahead in CASES:
        n_keys = len(block_keys(tokens, args.block_size, family, lookahead))  # also warms up
        samples = measure_us(tokens, args.block_size, family, lookahead, args.repeats)
        p50, p99 = percentile(samples, 50), percentile(samples, 99)
        print(f"{family.value:<8} {lookahead:>9} {n_keys:>5} {p50:>9.0f} {p99:>9.0f} {min(samples):>9.0f}")


if __name__ == "__main__":
    main()
