"""gRPC callers in a child process, so a figure measures the server, not its own clients: closed
loops (each caller calls again as soon as it is answered) or one open loop at a fixed rate.

Client threads in the measuring process would share its core and its GIL with the sidecar they
measure: at hundreds of callers their own Python would be most of that process's CPU. Here
they run in a child process (pinned where the placement says), driven over its stdin and
stdout: one level per command, each caller calling again as soon as it is answered, until the requests are used
up or the level's time has passed. The child exits when the pipe closes.

The callers are coroutines on grpc's asyncio client (one channel): hundreds of blocking
client threads cost more Python per call than the sidecar answering them, so at 256 callers
most calls ran out their deadline inside the client before they were sent.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator, Set
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import BinaryIO

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
    # > 0: an open loop instead; call i is sent at start + i / rate_per_s whether or not earlier
    # calls were answered (all results in one CallerResults; ``callers`` is ignored).
    rate_per_s: float = 0.0


NOT_SENT = "NOT_SENT"  # the status name of an open loop's call its stalled client never sent


@dataclass(slots=True)
class CallerResults:
    """What one caller saw."""

    replies: list[bytes] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # grpc status names

    async def call(self, call: grpc.aio.UnaryUnaryMultiCallable, request: bytes, deadline_s: float) -> None:  # type: ignore[type-arg]
        """One call, its reply and client time, or its status name."""
        start = time.perf_counter()
        try:
            reply: bytes = await call(request, timeout=deadline_s)
        except grpc.aio.AioRpcError as exc:
            self.errors.append(exc.code().name)
        else:
            self.client_ms.append((time.perf_counter() - start) * 1e3)
            self.replies.append(reply)


@dataclass(frozen=True, slots=True)
class LevelRun:
    seconds: float
    results: tuple[CallerResults, ...]
    cpu_s: float  # the child's own CPU over the level (its callers and grpc)
    not_started: int = 0  # a closed loop's calls still to start when ``max_s`` passed


async def drive_level(channel: grpc.aio.Channel, level: Level) -> tuple[float, list[CallerResults], int]:
    """Run ``level`` on ``channel``: the elapsed seconds, each caller's results and, for a closed loop,
    how many of its calls were never started (its callers stop starting them once ``max_s`` has
    passed; an open loop counts its unsent calls among its errors, as ``NOT_SENT``)."""
    if level.rate_per_s > 0:
        seconds, results = await _drive_open_loop(channel, level)
        return seconds, results, 0
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
            await into.call(call, requests[i], level.client_deadline_s)

    began = time.perf_counter()
    await asyncio.gather(*(caller(r) for r in results))
    # Every call started drew its index; callers that found none left drew one past the end each.
    started = min(next(serial), len(requests))
    return time.perf_counter() - began, results, len(requests) - started


async def _drive_open_loop(channel: grpc.aio.Channel, level: Level) -> tuple[float, list[CallerResults]]:
    """Send the requests on a fixed schedule (a send never waits for an earlier answer), sending
    none once ``max_s`` has passed (a client stalled behind its schedule stops, rather than sending
    its backlog at once); then wait for every answer."""
    call = channel.unary_unary(ROUTER_ROUTE, None, None)
    into = CallerResults()

    began = time.perf_counter()
    sends: list[asyncio.Task[None]] = []
    for i, request in enumerate(level.requests):
        due = began + i / level.rate_per_s
        if max(due, time.perf_counter()) - began > level.max_s:
            # Never sent: calls without an answer too, so a figure that needs every call answered misses.
            into.errors.extend([NOT_SENT] * (len(level.requests) - i))
            break
        pause = due - time.perf_counter()
        if pause > 0:
            await asyncio.sleep(pause)
        sends.append(asyncio.create_task(into.call(call, request, level.client_deadline_s)))
    await asyncio.gather(*sends)
    return time.perf_counter() - began, [into]


async def _serve_levels(commands: BinaryIO, replies: BinaryIO) -> None:
    channels: dict[str, grpc.aio.Channel] = {}  # one per target, kept across levels
    try:
        while True:
            try:
                level: Level = pickle.load(commands)  # blocks the loop: nothing else runs between levels
            except EOFError:
                return
            channel = channels.get(level.target)
            if channel is None:
                channel = channels[level.target] = grpc.aio.insecure_channel(
                    level.target, options=[("grpc.enable_retries", 0)]
                )
            cpu_before = time.process_time()
            seconds, results, not_started = await drive_level(channel, level)
            pickle.dump(LevelRun(seconds, tuple(results), time.process_time() - cpu_before, not_started), replies)
            replies.flush()
    finally:
        for channel in channels.values():
            await channel.close(None)


class CallerProcess:
    """The child, from the parent's side: :meth:`run` one level at a time (blocking)."""

    def __init__(self, child: subprocess.Popen[bytes]) -> None:
        assert child.stdin is not None and child.stdout is not None
        self._commands = child.stdin
        self._replies = child.stdout

    def run(self, level: Level) -> LevelRun:
        pickle.dump(level, self._commands)
        self._commands.flush()
        run: LevelRun = pickle.load(self._replies)  # the child is ours: its pickles are trusted
        return run


@contextmanager
def caller_process(cpus: Set[int] | None) -> Iterator[CallerProcess]:
    """A child process that runs levels (pinned to ``cpus`` when given); always stopped on exit.

    A plain subprocess speaking pickles over its stdin and stdout, not multiprocessing: its spawn
    mode would leave a resource-tracker process behind for the rest of this process's life.
    """
    child = subprocess.Popen(
        [sys.executable, "-m", "kvroute_sim.bench.callers"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        if cpus:
            os.sched_setaffinity(child.pid, cpus)
        yield CallerProcess(child)
    finally:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()  # the child's next load sees EOF and it exits
        try:
            child.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()


if __name__ == "__main__":
    # Through the package's name, so the pickled results name its classes, not __main__'s.
    from kvroute_sim.bench import callers

    asyncio.run(callers._serve_levels(sys.stdin.buffer, sys.stdout.buffer))
