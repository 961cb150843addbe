"""Summarize a py-spy raw profile (``py-spy record -f raw``): where the samples go, by function.

Each raw line is ``frame;frame;...;frame COUNT``. Printed: the functions holding the most
samples on their stack (inclusive) and at the top of it (own), as shares of all samples; with
``--under NAME``, the direct callees of the function NAME (as printed, e.g.
``RouterActor._pipeline``) and their shares; with ``--by-package``, each sample charged to the
package of its innermost frame outside the standard library (grpcio, trio, protobuf,
prometheus-client, kvroute, the simulators and harness), stacks made only of standard-library
frames to CPython, so ``Thread.start`` called by grpcio counts as grpcio's. Samples of every
thread are counted.

``--exclude NAME`` (repeatable) drops the samples with NAME on their stack first, e.g. the
start-up (``--exclude prime --exclude _find_and_load``); ``--within NAME`` keeps only those with
NAME on their stack (shares stay of all samples), e.g. the request path (``--within
RouterHandle.route``) or the prober (``--within WorkerProber.run``).

    python bench/spy_summary.py p3.raw [--top 30] [--under RouterActor._score] [--by-package]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LOCATION = re.compile(r" \(.*\)$")  # "name (file:line)" → "name"
_FILE = re.compile(r" \(([^:()]*)(?::\d+)?\)$")  # "name (file:line)" → "file"
# The file prefixes py-spy prints (relative to the import root) → the package they belong to.
PACKAGES = (
    ("grpc/", "grpcio"),
    ("trio/", "trio"),
    ("outcome/", "trio"),
    ("google/protobuf/", "protobuf"),
    ("prometheus_client/", "prometheus-client"),
    ("router/", "kvroute"),
    ("actors/", "kvroute"),
    ("kvroute_sim/", "simulators and harness"),
    ("pipeline_load.py", "simulators and harness"),
)
CPYTHON = "CPython (standard library only)"
NO_FRAME = "(no Python frame)"


def package_of(frame: str) -> str | None:
    """The package of a raw frame ("name (file:line)"); None for the standard library and generated code."""
    found = _FILE.search(frame)
    path = found.group(1) if found else ""
    for prefix, package in PACKAGES:
        if path.startswith(prefix) or f"/{prefix}" in path:
            return package
    return None


def charged_package(raw_frames: list[str]) -> str:
    """The package of the innermost frame outside the standard library."""
    for frame in reversed(raw_frames):
        package = package_of(frame)
        if package is not None:
            return package
    return CPYTHON


def _stacks(path: Path, *, raw: bool = False) -> list[tuple[list[str], int]]:
    """Each stack's frames (names only; with ``raw``, as py-spy wrote them) and its sample count."""
    stacks: list[tuple[list[str], int]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise SystemExit(f"{path}:{number}: not a py-spy raw line (want 'frame;...;frame COUNT')")
        # py-spy writes an empty stack for a thread sampled outside any Python frame.
        if not stack.strip():
            frames = [NO_FRAME]
        elif raw:
            frames = stack.split(";")
        else:
            frames = [_LOCATION.sub("", frame) for frame in stack.split(";")]
        stacks.append((frames, int(count)))
    return stacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="py-spy record -f raw output")
    parser.add_argument("--top", type=int, default=30, help="rows per listing")
    parser.add_argument("--under", help="list the direct callees of this function")
    parser.add_argument(
        "--exclude", action="append", default=[], metavar="NAME", help="drop samples with NAME on their stack"
    )
    parser.add_argument("--within", metavar="NAME", help="keep only samples with NAME on their stack")
    parser.add_argument(
        "--by-package", action="store_true", help="charge each sample to the package of its innermost non-stdlib frame"
    )
    args = parser.parse_args()
    if args.top < 1:
        parser.error(f"--top must be >= 1, got {args.top}")
    excluded = set(args.exclude)

    def kept(names: list[str]) -> bool:
        return not excluded.intersection(names) and (args.within is None or args.within in names)

    all_samples = sum(count for _, count in _stacks(args.raw))
    stacks = [(frames, count) for frames, count in _stacks(args.raw) if kept(frames)]
    raw_stacks = [
        (frames, count)
        for frames, count in _stacks(args.raw, raw=True)
        if kept([_LOCATION.sub("", f) for f in frames])
    ]
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
    if args.within is not None:  # shares of everything the filters before it kept
        total = sum(count for frames, count in _stacks(args.raw) if not excluded.intersection(frames))
    print(f"{total:,} samples ({all_samples:,} recorded)")
    if args.by_package:
        packages: Counter[str] = Counter()
        for frames, count in raw_stacks:
            packages[NO_FRAME if frames == [NO_FRAME] else charged_package(frames)] += count
        print("\nby package (innermost frame outside the standard library):")
        for name, count in packages.most_common():
            print(f"  {100 * count / total:5.1f} %  {name}")
    for title, counts in (("inclusive", inclusive), ("own", own), (f"under {args.under}", callees)):
        if not counts:
            continue
        print(f"\n{title}:")
        for name, count in counts.most_common(args.top):
            print(f"  {100 * count / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
