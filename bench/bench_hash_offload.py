"""Hashing a maximal prompt while the loop serves short requests: in slices on the loop, or in a worker thread.

    python bench/bench_hash_offload.py [--tokens 262144] [--slice-tokens 4096] [--family rtp]

For each way, a long prompt is hashed while a heartbeat task checkpoints continuously; it reports how
long the long prompt took and the largest gap the heartbeat saw (the longest the loop was held), plus
the time a short 1,024-token prompt took when hashed on the loop meanwhile.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Awaitable, Callable

import trio
import trio.lowlevel

from kvroute_sim.stats import percentile
from router.keys import block_key_slices, block_keys
from router.types import KeyFamily


async def _measure(
    name: str, long_hash: Callable[[], Awaitable[None]], short: tuple[int, ...], family: KeyFamily
) -> None:
    gaps: list[float] = []
    short_times: list[float] = []
    done = trio.Event()

    async def heartbeat() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await trio.lowlevel.checkpoint()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async def shorts() -> None:
        while not done.is_set():
            t = time.perf_counter()
            block_keys(short, 64, family)
            short_times.append(time.perf_counter() - t)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        nursery.start_soon(shorts)
        await trio.sleep(0.01)  # both running
        t = time.perf_counter()
        await long_hash()
        took = time.perf_counter() - t
        done.set()
    short_times.sort()
    print(
        f"{name:>8}: long prompt {took * 1000:7.1f} ms; loop held at most {max(gaps) * 1000:6.2f} ms; "
        f"short prompt p50 {percentile(short_times, 50) * 1e6:6.0f} us, max {short_times[-1] * 1e6:6.0f} us "
        f"({len(short_times)} hashed meanwhile)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=262_144)
    parser.add_argument("--slice-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--family", choices=[f.value for f in KeyFamily], default="rtp")
    args = parser.parse_args()
    family = KeyFamily(args.family)
    rng = random.Random(1)
    long = tuple(rng.randrange(0, 150_000) for _ in range(args.tokens))
    short = long[:1024]
    slice_blocks = max(1, args.slice_tokens // args.block_size)

    async def sliced() -> None:
        for _ in block_key_slices(long, args.block_size, family, 0, slice_blocks):
            await trio.lowlevel.checkpoint()

    async def threaded() -> None:
        await trio.to_thread.run_sync(block_keys, long, args.block_size, family, 0)

    async def inline() -> None:
        block_keys(long, args.block_size, family, 0)

    async def run_all() -> None:
        for name, way in (("inline", inline), ("sliced", sliced), ("thread", threaded)):
            await _measure(name, way, short, family)

    trio.run(run_all)


if __name__ == "__main__":
    main()
