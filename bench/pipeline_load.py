"""The P3 workload alone, for a sampling profiler: routes through the full actor pipeline.

``kvroute bench`` measures P3 and prints a cProfile listing when it misses; cProfile's per-call
overhead inflates small functions. This script runs the same work with nothing else attached, so
an external sampler sees the real shares:

    py-spy record -r 1000 -f raw -o p3.raw -- python bench/pipeline_load.py --decisions 20000
    python bench/spy_summary.py p3.raw

``--transport memory`` (default): the simulated cluster on a MemoryNetwork in this process, as
P3 memory. ``--transport grpc``: the simulators in a child process on loopback gRPC, as P3 gRPC.
Prints decisions/s and the route outcomes. Bounded: ``--decisions`` routes after a warm-up.

``--rate R``: an open loop instead of ``--concurrency`` routes in flight: route i starts at
start + i / R, each in a task of its own, whether or not earlier ones have finished (P8's schedule).
``--steps``: also print the trio loop's CPU per decision (``time.thread_time``, the loop's thread
only), split by the task whose steps spent it, with the steps each takes per decision; what is left
is the scheduler's own work and the wait for I/O. Pinned to one CPU as the bench pins its process:

    taskset -c 1 python bench/pipeline_load.py --rate 400 --decisions 2000 --steps
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import trio
import trio.lowlevel

from kvroute_sim.bench.harness import (
    ClusterShape,
    ClusterView,
    Outcomes,
    Requests,
    concurrent,
    prime,
    router_config,
)
from kvroute_sim.bench.simproc import sim_process
from router.api import RouterHandle, open_router
from router.transport.ports import RawRpc

WARM_UP = 500
TIMEOUT_S = 600.0
TOP_TASKS = 14


class StepCpu(trio.abc.Instrument):
    """The loop thread's CPU per task (by name) over the steps taken while ``on``; and its total."""

    def __init__(self) -> None:
        self.on = False
        self.cpu_s: dict[str, float] = {}
        self.steps: Counter[str] = Counter()
        self._step_began = 0.0
        self._began = 0.0
        self.total_s = 0.0

    def start(self) -> None:
        self.on = True
        self._began = time.thread_time()

    def stop(self) -> None:
        self.on = False
        self.total_s = time.thread_time() - self._began

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step_began = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.on:
            self.cpu_s[task.name] = self.cpu_s.get(task.name, 0.0) + time.thread_time() - self._step_began
            self.steps[task.name] += 1

    def report(self, decisions: int) -> str:
        stepped = sum(self.cpu_s.values())
        lines = [
            f"trio loop CPU per decision: {self.total_s * 1e6 / decisions:,.0f} µs, of it task steps "
            f"{stepped * 1e6 / decisions:,.0f} µs ({sum(self.steps.values()) / decisions:.1f} steps), "
            f"the rest (the scheduler, waiting for I/O) {(self.total_s - stepped) * 1e6 / decisions:,.0f} µs",
            "µs/decision | steps/decision | task",
        ]
        for name, seconds in sorted(self.cpu_s.items(), key=lambda item: -item[1])[:TOP_TASKS]:
            lines.append(f"{seconds * 1e6 / decisions:>11,.1f} | {self.steps[name] / decisions:>14.2f} | {name}")
        return "\n".join(lines)


async def open_loop(router: RouterHandle, requests: Requests, count: int, rate: float) -> tuple[float, Outcomes]:
    """``count`` routes, route i started at start + i / ``rate`` in a task of its own: elapsed wall seconds."""
    outcomes = Outcomes.empty()

    async def one() -> None:
        outcomes.add(await router.route(requests.next()))

    start = time.perf_counter()
    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(count):
            await trio.sleep_until(began + i / rate)
            nursery.start_soon(one)
    return time.perf_counter() - start, outcomes


async def drive(
    view: ClusterView, rpc: RawRpc | None, decisions: int, concurrency: int, rate: float | None, steps: StepCpu | None
) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with open_router(router_config(view, status_ttl_s=None), rpc=rpc) as router:
            requests = Requests(view, "load")
            await prime(router, requests, WARM_UP)
            if steps is not None:
                steps.start()
            if rate is None:
                seconds, outcomes = await concurrent(router, requests, decisions, concurrency)
                shape = f"{concurrency} in flight"
            else:
                seconds, outcomes = await open_loop(router, requests, decisions, rate)
                shape = f"open loop at {rate:g}/s"
            if steps is not None:
                steps.stop()
    print(f"{decisions / seconds:,.0f} decisions/s ({decisions} in {seconds:.2f} s, {shape})")
    print(f"outcomes: {outcomes.to_json()}")
    if steps is not None:
        print(steps.report(decisions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=20_000, help="routes measured after the warm-up")
    parser.add_argument("--concurrency", type=int, default=8, help="routes in flight (a closed loop)")
    parser.add_argument(
        "--rate", type=float, default=None, help="an open loop at this many routes/s instead of --concurrency"
    )
    parser.add_argument("--steps", action="store_true", help="the trio loop's CPU per decision, by task")
    parser.add_argument("--transport", choices=("memory", "grpc"), default="memory")
    args = parser.parse_args()
    for flag, value in (("--decisions", args.decisions), ("--concurrency", args.concurrency)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.rate is not None and not args.rate > 0:  # NaN too
        parser.error(f"--rate must be > 0, got {args.rate}")
    steps = StepCpu() if args.steps else None
    instruments = [steps] if steps is not None else []
    shape = ClusterShape()
    began = time.perf_counter()
    if args.transport == "memory":
        _, network, view = shape.in_memory()
        trio.run(drive, view, network, args.decisions, args.concurrency, args.rate, steps, instruments=instruments)
    else:
        with sim_process(shape, TIMEOUT_S) as sim:
            trio.run(drive, sim.view, None, args.decisions, args.concurrency, args.rate, steps, instruments=instruments)
    print(f"total {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
