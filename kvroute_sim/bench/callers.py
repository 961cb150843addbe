"""Closed-loop gRPC callers in a child process, so a figure measures the server, not its own clients.

Client threads in the measuring process would share its core and its GIL with the sidecar they
measure: at hundreds of callers their own Python would be most of that process's CPU. Here
they run in a spawned child (pinned where the placement says), driven over a pipe: one level
per command, each caller calling again as soon as it is answered, until the requests are used
up or the level's time has passed. The child exits when the pipe closes.

The callers are coroutines on grpc's asyncio client (one channel): hundreds of blocking
client threads cost more Python per call than the sidecar answering them, so at 256 callers
most calls ran out their deadline inside the client before they were sent.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import time
from collections.abc import Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import grpc

from router.wire.paths import ROUTER_ROUTE

STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Level:
    """One closed loop against ``target``: ``callers`` callers sharing ``requests`` (serialised Route requests)."""

    target: str
    requests: tuple[bytes, ...]
    callers: int
    max_s: float
    client_deadline_s: float


@dataclass(slots=True)
class CallerResults:
    """What one caller saw."""

    replies: list[bytes] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # grpc status names


@dataclass(frozen=True, slots=True)
class LevelRun:
    seconds: float
    results: tuple[CallerResults, ...]
    cpu_s: float  # the child's own CPU over the level (its callers and grpc)


async def drive_level(channel: grpc.aio.Channel, level: Level) -> tuple[float, list[CallerResults]]:
    """Run ``level`` on ``channel``: the elapsed seconds and each caller's results."""
    call = channel.unary_unary(ROUTER_ROUTE, None, None)
    serial = itertools.count()
    results = [CallerResults() for _ in range(level.callers)]
    stop_at = time.monotonic() + level.max_s
    requests = level.requests

    async def caller(into: CallerResults) -> None:
        while time.monotonic() < stop_at:
            i = next(serial)
            if i >= len(requests):
                return
            start = time.perf_counter()
            try:
                reply: bytes = await call(requests[i], timeout=level.client_deadline_s)
            except grpc.aio.AioRpcError as exc:
                into.errors.append(exc.code().name)
            else:
                into.client_ms.append((time.perf_counter() - start) * 1e3)
                into.replies.append(reply)

    began = time.perf_counter()
    await asyncio.gather(*(caller(r) for r in results))
    return time.perf_counter() - began, results


async def _serve_levels(conn: Connection) -> None:
    channels: dict[str, grpc.aio.Channel] = {}  # one per target, kept across levels
    try:
        while True:
            try:
                level: Level = conn.recv()  # blocks the loop: nothing else runs between levels
            except EOFError:
                return
            channel = channels.get(level.target)
            if channel is None:
                channel = channels[level.target] = grpc.aio.insecure_channel(
                    level.target, options=[("grpc.enable_retries", 0)]
                )
            cpu_before = time.process_time()
            seconds, results = await drive_level(channel, level)
            conn.send(LevelRun(seconds, tuple(results), time.process_time() - cpu_before))
    finally:
        for channel in channels.values():
            await channel.close(None)


def _child_main(conn: Connection, cpus: frozenset[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        asyncio.run(_serve_levels(conn))
    finally:
        conn.close()


class CallerProcess:
    """The child, from the parent's side: :meth:`run` one level at a time (blocking)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def run(self, level: Level) -> LevelRun:
        self._conn.send(level)
        run: LevelRun = self._conn.recv()
        return run


@contextmanager
def caller_process(cpus: Set[int] | None) -> Iterator[CallerProcess]:
    """A spawned child that runs levels (pinned to ``cpus`` when given); always stopped on exit."""
    context = multiprocessing.get_context("spawn")  # never fork a process that runs grpc
    parent, child_end = context.Pipe()
    child = context.Process(
        target=_child_main, args=(child_end, None if cpus is None else frozenset(cpus)), daemon=True
    )
    child.start()
    child_end.close()
    try:
        yield CallerProcess(parent)
    finally:
        parent.close()  # the child's recv sees EOF and it returns
        child.join(STOP_TIMEOUT_S)
        if child.is_alive():
            child.kill()
            child.join()
