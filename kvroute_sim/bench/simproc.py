"""The simulators in a separate process: ``kvroute sim-cluster --print-json`` as a child.

P2 and P3 measure the router and a plain grpcio client against the same servers, so the
servers' CPU is not the measuring process's. The child is bounded twice: its own
``--duration`` and ``terminate`` (then ``kill``) when the context exits, whatever happened.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from kvroute_sim.bench.harness import ClusterShape, ClusterView
from router.types import WorkerAddr

STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class SimProcess:
    """Where the child's servers listen, and the seeded prompts' block keys."""

    pid: int
    view: ClusterView
    leader_target: str
    workers: tuple[WorkerAddr, ...]


def _command(shape: ClusterShape, duration_s: float) -> list[str]:
    return [
        sys.executable,
        "-P",  # never import a source checkout from the working directory: the installed package
        "-m",
        "router.cli",
        "sim-cluster",
        "--print-json",
        f"--workers={shape.workers}",
        f"--kvcm-replicas={shape.kvcm_replicas}",
        f"--block-size={shape.block_size}",
        f"--prompt-tokens={shape.prompt_tokens}",
        f"--groups={shape.groups}",
        f"--holders-per-group={shape.holders_per_group}",
        f"--duration={duration_s}",
    ]


def _parse(pid: int, shape: ClusterShape, line: str) -> SimProcess:
    document = json.loads(line)
    nodes = {node["node_id"]: node["target"] for node in document["kvcm_nodes"]}
    workers = tuple(WorkerAddr.from_http(w["ip"], w["http_port"]) for w in document["workers"])
    view = ClusterView(
        kvcm_bootstrap=",".join(document["kvcm_bootstrap"]),
        workers_arg=",".join(w.http_target for w in workers),
        block_size=shape.block_size,
        prompts=tuple(tuple(p["block_keys"]) for p in document["seeded_prefixes"]),
        router_settings=shape.router_settings,
    )
    return SimProcess(pid=pid, view=view, leader_target=nodes[document["kvcm_leader"]], workers=workers)


@contextmanager
def sim_process(shape: ClusterShape, duration_s: float, cpus: Set[int] | None = None) -> Iterator[SimProcess]:
    """Start the child (it exits by itself after ``duration_s``), wait (bounded) for its address
    line, yield it; always stop the child.

    ``cpus``: pin the child there (set right after the spawn, while it is still importing,
    so the servers' threads inherit it).
    """
    # stderr to a file: a pipe nobody reads could fill and stall the child.
    with tempfile.TemporaryFile(mode="w+") as errors:
        child = subprocess.Popen(_command(shape, duration_s), stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            if cpus:
                os.sched_setaffinity(child.pid, cpus)
            yield _parse(child.pid, shape, _address_line(child, errors))
        finally:
            child.terminate()
            try:
                child.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()


def _address_line(child: subprocess.Popen[str], errors: IO[str]) -> str:
    """The child's first stdout line, waited for at most STARTUP_TIMEOUT_S."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], STARTUP_TIMEOUT_S)
    line = child.stdout.readline() if ready else ""
    if not line:
        child.kill()
        child.wait(timeout=STOP_TIMEOUT_S)
        errors.seek(0)
        raise RuntimeError(
            f"sim-cluster child gave no addresses within {STARTUP_TIMEOUT_S:.0f} s "
            f"(exit {child.returncode}): {errors.read()[-2000:]}"
        )
    return line
