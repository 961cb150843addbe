"""CPU placement: the measuring process on one core, the simulator child on the others.

"Decisions/s on one core" (P3) means the router's process — its trio thread and gRPC's C
threads alike — shares one core; the raw client runs in the same process, so its figure
is taken under the same constraint. Linux only; elsewhere (or with a single allowed CPU)
nothing is pinned and the table says so.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    bench: frozenset[int] | None  # CPUs this process is pinned to; None = not pinned
    child: frozenset[int] | None  # CPUs the simulator child gets

    def describe(self) -> str:
        if self.bench is None:
            return "not pinned (one allowed CPU, or no sched_setaffinity)"
        return f"bench process on CPU {sorted(self.bench)}, simulator child on CPUs {sorted(self.child or ())}"


def _pin_all_threads(cpus: Set[int]) -> None:
    # sched_setaffinity(0) would pin only the calling thread; gRPC's threads already exist.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


@contextmanager
def pinned_bench_process() -> Iterator[Placement]:
    """Pin this process (every thread, and those it starts meanwhile) to its last allowed CPU;
    give every thread the original set back on exit."""
    if not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"):
        yield Placement(None, None)
        return
    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        yield Placement(None, None)
        return
    mine = frozenset({max(allowed)})
    _pin_all_threads(mine)
    try:
        yield Placement(mine, allowed - mine)
    finally:
        _pin_all_threads(allowed)
