"""P9: the sidecar across cores — ``kvroute serve --processes N`` for N = 1, then 2, in one run.

Each level is a real ``kvroute serve`` process tree (on every CPU the run was allowed, not the bench
process's one) against the same simulator child. A closed loop of CALLERS grpcio client threads in
this process, each on a connection of its own (SO_REUSEPORT spreads connections, not calls, over
the router processes), sends a fixed number of Route calls with the default budget; the figure is
answered decisions per second, and the ratio N = 2 over N = 1. Each router process's share of the
calls comes from its own drain summary; the tree's CPU time per answered call is read before and
after the measured window.

The client threads share this process's one core, so at some rate they, not the routers, are the
limit; the CPUs the run had are reported beside the ratio.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, field

import grpc
import psutil

from kvroute_sim.bench.harness import ClusterView
from kvroute_sim.bench.results import BenchReport, Figure, Verdict
from router.settings import BY_NAME
from router.wire import router_v1_pb2
from router.wire.paths import ROUTER_ROUTE

PROCESS_COUNTS = (1, 2)
CALLERS = 16
CLIENT_DEADLINE_S = 2.0  # generous: this figure counts answers, lateness is P7's
WARM_CALLS_PER_CALLER = 5
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_ADDRESS = re.compile(r"Route gRPC on (\S+), debug HTTP on")
_SUMMARY = re.compile(r"kvroute serve(?: \(process (\d+)\))?: stopped; Route calls answered=(\d+)")


@dataclass(frozen=True, slots=True)
class ProcessSizes:
    calls: int  # measured calls per level
    max_level_s: float  # a level stops starting calls after this long, whatever is left


@dataclass(slots=True)
class _CallerResults:
    answered: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)  # "route_source/reason"
    errors: Counter[str] = field(default_factory=Counter)  # grpc status names


@dataclass(frozen=True, slots=True)
class LevelResult:
    processes: int
    seconds: float
    answered: int
    errors: Counter[str]
    outcomes: Counter[str]
    answered_by_process: tuple[int, ...]  # from each router process's drain summary (warm-up included)
    cpu_s: float  # the serve process tree's CPU time in the measured window

    @property
    def rate(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "processes": self.processes,
            "seconds": self.seconds,
            "answered": self.answered,
            "decisions_per_s": self.rate,
            "errors": dict(self.errors.most_common()),
            "outcomes": dict(self.outcomes.most_common()),
            "answered_by_process": list(self.answered_by_process),
            "cpu_ms_per_decision": self.cpu_s * 1e3 / self.answered if self.answered else None,
        }


def _serve_command(view: ClusterView, processes: int) -> list[str]:
    """``kvroute serve`` with the bench's router settings as flags, then the figure's own (which win:
    the processes compared, the listeners, the simulated cluster, the handler threads)."""
    settings = [f"{BY_NAME[name].flag}={BY_NAME[name].format(value)}" for name, value in view.router_settings]
    return [
        sys.executable,
        "-P",  # the installed package, never a source checkout in the working directory
        "-m",
        "router.cli",
        "serve",
        *settings,
        f"--processes={processes}",
        "--grpc-listen=127.0.0.1:0",
        "--debug-listen=127.0.0.1:0",
        f"--kvcm-bootstrap={view.kvcm_bootstrap}",
        f"--workers={view.workers_arg}",
        "--kvcm-instance-id=bench",
        f"--block-size={view.block_size}",
        f"--grpc-max-workers={max(64, 2 * CALLERS)}",
    ]


def _requests(view: ClusterView, label: str, count: int) -> list[bytes]:
    return [
        router_v1_pb2.RouteRequest(
            request_id=f"{label}-{i}", block_cache_keys=view.prompts[i % len(view.prompts)], block_size=view.block_size
        ).SerializeToString()
        for i in range(count)
    ]


def _drive(
    target: str, requests: Sequence[bytes], warm: Sequence[bytes], max_s: float, at_start: Callable[[], None]
) -> tuple[float, list[_CallerResults]]:
    """CALLERS threads, each on its own connection: warm calls first, then all start together and
    call back to back until the requests are used up or ``max_s`` has passed. ``at_start`` runs once
    all are warm, before any measured call."""
    serial = itertools.count()  # next() on it is atomic under the GIL
    results = [_CallerResults() for _ in range(CALLERS)]
    clock: dict[str, float] = {}

    def all_warm() -> None:  # the barrier's action: runs once, before any caller is let go
        at_start()  # the measured window starts here: the warm calls and connections are outside it
        clock["began"] = time.perf_counter()
        clock["stop_at"] = time.monotonic() + max_s

    start = threading.Barrier(CALLERS, action=all_warm, timeout=STARTUP_TIMEOUT_S)

    def caller(index: int, into: _CallerResults) -> None:
        options = [("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
        with grpc.insecure_channel(target, options=options) as channel:
            call = channel.unary_unary(ROUTER_ROUTE, None, None)
            for request in warm[index::CALLERS]:
                with contextlib.suppress(grpc.RpcError):  # warm-up: its outcome is not measured
                    call(request, timeout=CLIENT_DEADLINE_S)
            start.wait()
            while time.monotonic() < clock["stop_at"]:
                i = next(serial)
                if i >= len(requests):
                    return
                try:
                    reply: bytes = call(requests[i], timeout=CLIENT_DEADLINE_S)
                except grpc.RpcError as exc:
                    into.errors[exc.code().name] += 1
                else:
                    decision = router_v1_pb2.RouteDecision.FromString(reply)
                    into.outcomes[f"{decision.route_source}/{decision.reason}"] += 1
                    into.answered += 1

    threads = [threading.Thread(target=caller, args=(n, r), name=f"p9-caller-{n}") for n, r in enumerate(results)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - clock["began"], results


def _tree_cpu_s(root: psutil.Process) -> float:
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _level(view: ClusterView, processes: int, sizes: ProcessSizes, cpus: Set[int] | None) -> LevelResult:
    with tempfile.TemporaryFile(mode="w+") as errors:
        serve = subprocess.Popen(_serve_command(view, processes), stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            if cpus:  # at once, while it imports: its router processes and their threads inherit it
                os.sched_setaffinity(serve.pid, cpus)
            assert serve.stdout is not None
            ready, _, _ = select.select([serve.stdout], [], [], STARTUP_TIMEOUT_S)
            found = _ADDRESS.search(serve.stdout.readline() if ready else "")
            if found is None:
                errors.seek(0)
                raise RuntimeError(f"kvroute serve --processes {processes} did not start: {errors.read()[-2000:]}")
            target = found.group(1)
            tree = psutil.Process(serve.pid)
            warm = _requests(view, f"p9-{processes}-warm", CALLERS * WARM_CALLS_PER_CALLER)
            requests = _requests(view, f"p9-{processes}", sizes.calls)
            cpu_before: list[float] = []
            seconds, results = _drive(
                target, requests, warm, sizes.max_level_s, at_start=lambda: cpu_before.append(_tree_cpu_s(tree))
            )
            cpu_s = _tree_cpu_s(tree) - cpu_before[0]
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=STOP_TIMEOUT_S)
        finally:
            if serve.poll() is None:
                serve.kill()
                serve.wait()
            if serve.stdout is not None:
                serve.stdout.close()
        errors.seek(0)
        by_process = {int(m.group(1) or 0): int(m.group(2)) for m in _SUMMARY.finditer(errors.read())}
    return LevelResult(
        processes=processes,
        seconds=seconds,
        answered=sum(r.answered for r in results),
        errors=sum((r.errors for r in results), Counter()),
        outcomes=sum((r.outcomes for r in results), Counter()),
        answered_by_process=tuple(by_process.get(i, 0) for i in range(processes)),
        cpu_s=cpu_s,
    )


def _share(outcomes: Counter[str], source: str) -> float:
    total = sum(outcomes.values())
    return sum(n for key, n in outcomes.items() if key.split("/", 1)[0] == source) / total if total else 0.0


def measure(report: BenchReport, view: ClusterView, sizes: ProcessSizes, cpus: Set[int] | None) -> None:
    """``cpus``: where the serve processes run (every CPU the run was allowed); None = inherited."""
    levels = [_level(view, n, sizes, cpus) for n in PROCESS_COUNTS]
    one, two = levels
    ratio = two.rate / one.rate if one.rate else 0.0
    cores = sorted(cpus) if cpus else sorted(os.sched_getaffinity(0))
    result = (
        f"{one.rate:,.0f} decisions/s with 1 process, {two.rate:,.0f} with 2 → {ratio:.2f}×; "
        f"{len(cores)} CPUs shared with the simulators and the client; per-process calls "
        + " / ".join(str(n) for n in two.answered_by_process)
        + "; via kvcm "
        + " / ".join(f"{_share(lv.outcomes, 'kvcm'):.0%}" for lv in levels)
        + "; unanswered "
        + " / ".join(str(sum(lv.errors.values())) for lv in levels)
    )
    report.figures.append(
        Figure(
            "P9",
            f"kvroute serve --processes 1 vs 2 on one port (sims in a separate process), closed loop of {CALLERS} "
            "callers on their own connections, answered decisions/s",
            result,
            "reported: the ratio and the CPUs",
            Verdict.NO_TARGET,
            {
                "callers": CALLERS,
                "cpus": cores,
                "ratio": ratio,
                "levels": [lv.to_json() for lv in levels],
            },
        )
    )
