"""Summarize a py-spy raw profile (``py-spy record -f raw``): where the samples go, by function.

Each raw line is ``frame;frame;...;frame COUNT``. Printed: the functions holding the most
samples on their stack (inclusive) and at the top of it (own), as shares of all samples; with
``--under NAME``, the direct callees of the function NAME (as printed, e.g.
``RouterActor._pipeline``) and their shares. Samples of every thread are counted.

    python bench/spy_summary.py p3.raw [--top 30] [--under RouterActor._score]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LOCATION = re.compile(r" \(.*\)$")  # "name (file:line)" → "name"


def _stacks(path: Path) -> list[tuple[list[str], int]]:
    stacks: list[tuple[list[str], int]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise SystemExit(f"{path}:{number}: not a py-spy raw line (want 'frame;...;frame COUNT')")
        # py-spy writes an empty stack for a thread sampled outside any Python frame.
        frames = [_LOCATION.sub("", frame) for frame in stack.split(";")] if stack.strip() else ["(no Python frame)"]
        stacks.append((frames, int(count)))
    return stacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="py-spy record -f raw output")
    parser.add_argument("--top", type=int, default=30, help="rows per listing")
    parser.add_argument("--under", help="list the direct callees of this function")
    args = parser.parse_args()
    if args.top < 1:
        parser.error(f"--top must be >= 1, got {args.top}")
    stacks = _stacks(args.raw)
    total = sum(count for _, count in stacks)
    if not total:
        raise SystemExit(f"{args.raw}: no samples")
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    callees: Counter[str] = Counter()
    for frames, count in stacks:
        for name in set(frames):
            inclusive[name] += count
        own[frames[-1]] += count
        if args.under in frames:
            at = len(frames) - 1 - frames[::-1].index(args.under)
            callees[frames[at + 1] if at + 1 < len(frames) else "(own)"] += count
    print(f"{total:,} samples")
    for title, counts in (("inclusive", inclusive), ("own", own), (f"under {args.under}", callees)):
        if not counts:
            continue
        print(f"\n{title}:")
        for name, count in counts.most_common(args.top):
            print(f"  {100 * count / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
