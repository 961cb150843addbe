"""What a short stretch of Python costs right after the process was idle, against back to back.

P8 offers one call every 10 ms at 100 calls/s: each call finds the routing thread asleep, and its
path (the hop to the trio thread, the routing task's rounds, the Scorer's hop, the way back) runs
right after that sleep. This measures the same kinds of step on their own, per idle gap before
each step (0: back to back):

  python work     a fixed few microseconds of dict, list and json work, after ``time.sleep(gap)``
  trio hop        one actor-style round trip inside trio (send to a task's memory channel, that
                  task sends it back): two scheduling rounds, after ``trio.sleep(gap)``
  thread wake     a ``concurrent.futures.Future`` settled by another thread after ``gap``: the
                  waiting thread's wake, as the sidecar's handler thread waits for its decision

Per row and gap: the p50 and p90 in microseconds over ``--samples`` steps. No assertion: the
figures are the machine's (docs/design.md, Routing latency).

``--keep-awake`` runs the same steps with a spinning process at ``SCHED_IDLE`` on each CPU this
process may run on (Linux only): it yields to any other task at once, so it takes no CPU the steps
want, but an idle gap no longer halts the CPU. What the steps lose then is what the halt cost them
(on a virtual machine the host may run another guest there meanwhile); what they keep is the rest of
the cold path. The spinners are stopped when the script ends.

Run: ``python bench/bench_idle_wake.py [--samples N] [--keep-awake]`` (about 15 s with the defaults).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import statistics
import threading
import time

import trio

from kvroute_sim.bench.cpus import KeepAwakeError, cpus_kept_awake
from kvroute_sim.stats import percentile

GAPS_S = (0.0, 0.001, 0.01)

_DATA = {str(i): list(range(20)) for i in range(2000)}


def _python_work() -> int:
    total = 0
    for key in ("1", "5", "77", "1999", "300"):
        total += sum(_DATA[key])
    json.dumps({"a": [1, 2, 3], "b": "x" * 50})
    return total


def python_work(gap_s: float, samples: int) -> list[float]:
    took = []
    for _ in range(samples):
        if gap_s:
            time.sleep(gap_s)
        started = time.perf_counter()
        _python_work()
        took.append(time.perf_counter() - started)
    return took


def trio_hop(gap_s: float, samples: int) -> list[float]:
    took: list[float] = []

    async def main() -> None:
        to_echo, echo_inbox = trio.open_memory_channel[int](1)
        to_caller, caller_inbox = trio.open_memory_channel[int](1)

        async def echo() -> None:
            async for message in echo_inbox:
                to_caller.send_nowait(message)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            for i in range(samples):
                await trio.sleep(gap_s)
                started = time.perf_counter()
                to_echo.send_nowait(i)
                await caller_inbox.receive()
                took.append(time.perf_counter() - started)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return took


def thread_wake(gap_s: float, samples: int) -> list[float]:
    took = []
    for _ in range(samples):
        answer: concurrent.futures.Future[float] = concurrent.futures.Future()

        def settle(answer: concurrent.futures.Future[float] = answer) -> None:
            time.sleep(gap_s)
            answer.set_result(time.perf_counter())

        settler = threading.Thread(target=settle)
        settler.start()
        settled_at = answer.result()
        took.append(time.perf_counter() - settled_at)
        settler.join()
    return took


def _us(values: list[float], pct: int) -> str:
    return f"{percentile(values, pct) * 1e6:8.1f}"  # the one definition (nearest rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300, help="steps per row and gap (default 300)")
    parser.add_argument(
        "--keep-awake", action="store_true", help="a SCHED_IDLE spinner on each allowed CPU while measuring"
    )
    args = parser.parse_args()
    if args.samples < 10:
        parser.error("--samples: at least 10")
    if not args.keep_awake:
        _measure(args.samples)
        return
    with contextlib.ExitStack() as stack:
        try:
            cpus = stack.enter_context(cpus_kept_awake())
        except KeepAwakeError as exc:
            parser.error(f"--keep-awake: {exc}")
        print(f"CPUs {cpus} kept awake by SCHED_IDLE spinners")
        _measure(args.samples)


def _measure(samples: int) -> None:
    rows = (("python work", python_work), ("trio hop", trio_hop), ("thread wake", thread_wake))
    print("step        | gap ms | p50 us   | p90 us")
    for name, measure in rows:
        for gap_s in GAPS_S:
            took = measure(gap_s, samples)
            mean = statistics.fmean(took) * 1e6
            print(f"{name:<11} | {gap_s * 1e3:6.0f} | {_us(took, 50)} | {_us(took, 90)}  (mean {mean:.1f})")


if __name__ == "__main__":
    main()
