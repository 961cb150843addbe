"""Instructions per decision of the in-memory pipeline: a CPU measure the machine's noise leaves alone.

On a shared machine a decision's CPU time moves by a third from one minute to the next, more than
any cut of a few percent in the router's own work; the count of instructions it executes does not
move. This runs the P3 memory workload (the simulated cluster on a MemoryNetwork in this process,
8 routes in flight) under trio's ``MockClock`` — no timer fires, no deadline passes: every run
does exactly the same work — inside ``valgrind --tool=callgrind``, once with a warm-up only and
once with ``--decisions`` more routes, and prints the difference per decision. Start-up and
imports cancel out. ``PYTHONHASHSEED`` is fixed, so dict layouts repeat too.

Two runs of the same build agree to within a few hundred instructions per decision of about two
million; so a change of a fraction of a percent is seen. The count weighs every instruction alike:
a cache miss costs time the count does not show, so a cut is confirmed in ``kvroute bench`` as
well before it is claimed.

Run: ``python bench/bench_instructions.py [--decisions N] [--repeat K]`` (about a minute per run
under valgrind; the two runs of a repeat go side by side). Needs ``valgrind`` on the PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import trio
import trio.testing

from kvroute_sim.bench.harness import ClusterShape, Requests, concurrent, prime, router_config
from router.api import open_router

WARM_UP = 200
CONCURRENCY = 8
HASH_SEED = "0"
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


async def _drive(decisions: int) -> None:
    _, network, view = ClusterShape().in_memory()
    async with open_router(router_config(view, status_ttl_s=None), rpc=network) as router:
        requests = Requests(view, "instructions")
        await prime(router, requests, WARM_UP)
        if decisions:
            _, outcomes = await concurrent(router, requests, decisions, CONCURRENCY)
            if outcomes.fraction_from("kvcm") < 1.0:  # the count must be of the path it claims
                raise SystemExit(f"not every decision came via KVCM: {outcomes.to_json()}")
        if trio.current_time() != 0.0:
            raise SystemExit("the mock clock moved: timers ran, and the count is not repeatable")


def _child(decisions: int) -> None:
    trio.run(_drive, decisions, clock=trio.testing.MockClock(autojump_threshold=0))


def _instructions(decisions: int) -> int:
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--child",
        str(decisions),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run of {decisions} decisions failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=2000, help="routes measured after the warm-up (default 2000)")
    parser.add_argument("--repeat", type=int, default=1, help="measure this many times (default 1)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child)
        return
    if args.decisions < 1:
        parser.error("--decisions: must be at least 1")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on the PATH (Debian: apt install valgrind)")
    with ThreadPoolExecutor(max_workers=2) as pool:
        for _ in range(max(1, args.repeat)):
            base, measured = pool.map(_instructions, (0, args.decisions))
            per = (measured - base) / args.decisions
            print(f"{per:,.0f} instructions per decision ({args.decisions} decisions; warm-up run {base:,})")


if __name__ == "__main__":
    main()
