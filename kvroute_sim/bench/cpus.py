"""CPU placement: the measuring process on one core, the simulator child on the others.

"Decisions/s on one core" (P3) means the router's process — its trio thread and gRPC's C
threads alike — shares one core; the raw client runs in the same process, so its figure
is taken under the same constraint. Linux only; elsewhere (or with a single allowed CPU)
nothing is pinned and the table says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
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


class KeepAwakeError(Exception):
    """The CPUs cannot be kept awake here (not Linux, or a spinner could not start)."""


# A process of its own: a spinning thread in the measuring process would hold the GIL its steps need.
_SPIN = (
    "import os, sys\n"
    "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
    "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "while True: pass"
)
_SPINNER_START_S = 0.2  # long enough for a spinner that cannot pin itself or lower its priority to end


@contextmanager
def cpus_kept_awake() -> Iterator[list[int]]:
    """One spinning process at ``SCHED_IDLE`` pinned to each CPU this process may run on, for the
    block's duration; yields the CPUs, sorted. A ``SCHED_IDLE`` task yields to any other at once, so
    it takes no CPU time anyone else wants, but an idle CPU never halts: what a measurement loses with
    the spinners is what the halt between two calls cost it (on a virtual machine the host may run
    another guest on the CPU meanwhile). Raises KeepAwakeError before the block when it cannot."""
    if not hasattr(os, "SCHED_IDLE") or not hasattr(os, "sched_getaffinity"):
        raise KeepAwakeError("needs Linux (SCHED_IDLE and sched_setaffinity)")
    cpus = sorted(os.sched_getaffinity(0))
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        for cpu in cpus:
            spin = [sys.executable, "-c", _SPIN, str(cpu)]
            spinners.append(
                subprocess.Popen(spin, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            )
        time.sleep(_SPINNER_START_S)
        for spinner in spinners:
            if spinner.poll() is not None and spinner.stderr is not None:
                error = spinner.stderr.read().decode(errors="replace").strip()
                raise KeepAwakeError(f"a spinner ended at once: {error}")
        yield cpus
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
            if spinner.stderr is not None:
                spinner.stderr.close()
