"""``kvroute serve --processes N``: N router processes on one gRPC port, supervised by this one.

Each child is a plain ``kvroute serve`` process (``--processes 1``) started by this parent with the
same settings, a resolved gRPC address and its own debug address: an independent router (its own
actors, channels, metrics) that shares nothing with its siblings but the cluster it routes to. The
children bind the gRPC port with SO_REUSEPORT; the kernel spreads new connections over them (one
connection, and so one client channel, stays with one process).

Why children are subprocesses of the same command, not ``multiprocessing`` workers:

- each starts in its own process group, so a terminal's Ctrl-C reaches only the parent, which
  tells each child to drain with one SIGTERM and to stop at once with STOP_NOW_SIGNAL (a supervised
  child ignores a second SIGTERM: a service manager signalling the whole group, as systemd's default
  KillMode=control-group does, must not cut its drain short);
- a child's stdin is a pipe from the parent: when the parent dies however it dies, the child reads
  end-of-file and drains, so no orphan keeps serving;
- the child reports its addresses on stdout, exactly as a single ``kvroute serve`` does, and its
  exit status keeps serve's meaning (1 cannot listen, 2 configuration);
- the child is the very code path of ``kvroute serve``; nothing is pickled across.

Port: the parent first binds the gRPC address itself (without SO_REUSEPORT: an address another
process holds, or shares, is an error naming ``--grpc-listen``), then keeps a socket bound with
SO_REUSEPORT on that port (not listening: it receives no connections) for its whole life, so port 0
resolves once and a restarted child gets the same port back. Debug HTTP: process i listens on the
debug port + i, or on its own free port when the debug port is 0; ``/metrics`` is per process on its
own debug port.

Supervision: a child that exits while the parent is not stopping is restarted after a backoff
(doubling from RESTART_BACKOFF_MIN_S to RESTART_BACKOFF_MAX_S, back to the minimum once a child has
served STABLE_AFTER_S), counted and logged. A child that fails its very first start stops the whole
command with that child's exit status. On SIGTERM, SIGINT or SIGHUP every child gets SIGTERM and
drains; the parent waits at most ``--drain-timeout-s`` + STOP_MARGIN_S, then kills what is left. A
second signal to the parent sends the children STOP_NOW_SIGNAL (they stop at once), however soon it
follows the first: one read before the drain signal went out is sent right after it. Exit status 0
when every child drained and exited 0 (or, still starting, ended by the SIGTERM; or, restarting after
a crash, had none running), else 1.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import tenacity
import trio

from router.logs import ctx
from router.targets import HostPort, format_target

log = logging.getLogger("kvroute.serve")

ADDRESS_LINE = "kvroute serve: Route gRPC on {grpc}, debug HTTP on http://{debug}"
_ADDRESS = re.compile(r"Route gRPC on (\S+), debug HTTP on http://(\S+)")

RESTART_BACKOFF_MIN_S = 0.5
RESTART_BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a child that served this long restarts after the shortest backoff again
# A child that has not printed its addresses by this long (beyond discovery's first refresh, which its
# start waits for: startup_timeout_s) is killed, a failed start.
STARTUP_TIMEOUT_S = 60.0
STOP_MARGIN_S = 10.0  # beyond the children's drain: their actors stop and their channels close

EXIT_OK = 0
EXIT_CHILD_FAILED = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops a serve process (a drain)
DRAIN_SIGNAL = signal.SIGTERM  # what the parent sends a child to drain, whatever signal it got
STOP_NOW_SIGNAL = signal.SIGUSR1  # what the parent sends a child to stop at once (a second signal)


def unblock_stop_signals() -> list[signal.Signals]:
    """Let this process's stop signals (STOP_SIGNALS and STOP_NOW_SIGNAL) reach it; the ones that were
    blocked. A signal mask passes through fork and exec: a process started with them blocked (by a
    service manager, a shell or a supervisor whose spawning thread had them blocked) would leave every
    SIGTERM pending, and never drain. Threads started after this call inherit the mask it leaves."""
    wanted = {*STOP_SIGNALS, STOP_NOW_SIGNAL}
    was = signal.pthread_sigmask(signal.SIG_UNBLOCK, wanted)
    return sorted(wanted & was)


# How long a parent waits for closed connections to leave its port: a server that had the port
# without SO_REUSEPORT leaves them in TIME_WAIT for a minute (Linux), and until then the held socket
# cannot bind. A single serve binds through them (SO_REUSEADDR), so N processes wait instead of failing.
CLOSING_CONNECTIONS_WAIT_S = 65.0
CLOSING_CONNECTIONS_RETRY_S = 0.5


class _OnlyClosingConnections(OSError):
    """The port has no owner (a plain bind takes it), yet the held socket cannot bind: what is left
    there are closed connections waiting out TIME_WAIT."""


def reserve_port(
    listen: HostPort,
    flag: str,
    *,
    wait_closing_s: float = CLOSING_CONNECTIONS_WAIT_S,
    on_wait: Callable[[str], None] | None = None,
) -> socket.socket:
    """A socket bound with SO_REUSEPORT to ``listen`` (port 0: a free port), held while the children run.

    Raises OSError naming ``flag`` when the address is taken (also when taken by a socket that would
    share it: the children must never join a stranger's port group). An address held only by closed
    connections is retried for up to ``wait_closing_s`` (blocking: the parent has nothing else to do
    yet), ``on_wait`` told why once.
    """
    told = False

    def waiting(state: tenacity.RetryCallState) -> None:
        nonlocal told
        if on_wait is not None and not told:
            told = True
            on_wait(
                f"{flag}: {format_target(listen.host, listen.port)} has closed connections still in TIME_WAIT "
                f"(a server without SO_REUSEPORT had it): waiting up to {wait_closing_s:g} s for them to leave"
            )

    try:
        for attempt in tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_OnlyClosingConnections),
            stop=tenacity.stop_after_delay(wait_closing_s),
            wait=tenacity.wait_fixed(CLOSING_CONNECTIONS_RETRY_S),
            before_sleep=waiting,
            reraise=True,
        ):
            with attempt:
                return _bind_held(listen)
    except _OnlyClosingConnections as exc:
        raise OSError(
            f"{flag}: cannot bind {format_target(listen.host, listen.port)}: only closed connections hold it "
            f"(TIME_WAIT, left by a server that had it without SO_REUSEPORT), still there after "
            f"{wait_closing_s:g} s: {exc}"
        ) from exc
    except OSError as exc:
        raise OSError(f"{flag}: cannot bind {format_target(listen.host, listen.port)}: {exc}") from exc
    raise AssertionError("tenacity either returned or raised")  # pragma: no cover


def _bind_held(listen: HostPort) -> socket.socket:
    infos = socket.getaddrinfo(listen.host, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no owner
        probe.bind(address)
        port: int = probe.getsockname()[1]
    held = socket.socket(family, kind, proto)
    try:
        # SO_REUSEPORT alone: with SO_REUSEADDR too, any SO_REUSEADDR socket (another parent's
        # probe, a stranger's server) could bind the port while no child listens on it.
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((address[0], port, *address[2:]))
    except OSError as exc:
        held.close()
        if exc.errno == errno.EADDRINUSE:
            raise _OnlyClosingConnections(exc.errno, exc.strerror) from exc
        raise
    return held


def startup_timeout(discovery_refresh_timeout_s: float) -> float:
    """How long a child may take to print its addresses: its own start, plus discovery's first refresh
    (a slow source holds the start for up to ``--discovery-refresh-timeout-s``)."""
    return STARTUP_TIMEOUT_S + discovery_refresh_timeout_s


def child_debug_listen(debug: HostPort, index: int) -> str:
    """Process ``index``'s debug address: the base port + index, or a free port of its own for port 0."""
    return format_target(debug.host, debug.port + index if debug.port else 0)



def print_line(line: str) -> OSError | None:
    """Print ``line`` to standard output; the error when it cannot be written (its reader gone:
    BrokenPipeError, as a parent that died or ``| head -1``; a full disk; a hung-up terminal).
    Standard output then goes to /dev/null, or the interpreter's own flush at exit fails the same way."""
    try:
        print(line, flush=True)
    except OSError as exc:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
        return exc
    return None

@dataclass(slots=True)
class _Slot:
    """One child position: the process now in it, and its history. Owned by the supervisor's tasks."""

    index: int
    process: trio.Process | None = None
    pid: int | None = None
    debug_address: str = ""
    starts: int = 0
    restarts: int = 0
    ever_served: bool = False
    returncode: int | None = None  # the last child's status once the supervisor stops
    # Between a child's exit (logged, counted as a restart) and its replacement's start: a stop then
    # finds no child in the slot, and the slot's stop is clean whatever that exit was.
    restart_pending: bool = False
    killed: bool = False
    ready: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)
    backoff: trio.CancelScope | None = None


class ProcessSupervisor:
    """Runs ``count`` children (``command(i)`` is child i's command line) until a signal; see the module."""

    def __init__(
        self,
        *,
        count: int,
        command: Callable[[int], Sequence[str]],
        grpc_address: str,
        stop_wait_s: float,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self._command = command
        self._grpc_address = grpc_address
        self._stop_wait_s = stop_wait_s
        self._startup_timeout_s = startup_timeout_s
        self._slots = [_Slot(i) for i in range(count)]
        self._stop = trio.Event()
        self._stopping = False
        # A second signal read before the shutdown sent the drain signal: the shutdown sends it on.
        self._stop_now_asked = False
        self._failed_start: int | None = None  # a first start's exit status, when one failed

    async def run(self, signals: AsyncIterator[int]) -> int:
        async with trio.open_nursery() as nursery:
            for slot in self._slots:
                nursery.start_soon(self._keep_running, slot)
            nursery.start_soon(self._announce)
            nursery.start_soon(self._watch_signals, signals)
            await self._stop.wait()
            await self._shutdown()
            nursery.cancel_scope.cancel()
        if self._failed_start is not None:
            return self._failed_start
        clean = all(self._stopped_cleanly(slot) for slot in self._slots)
        return EXIT_OK if clean else EXIT_CHILD_FAILED

    def _stopped_cleanly(self, slot: _Slot) -> bool:
        """Drained (status 0), or ended by a signal this parent sent it: a child still starting, before
        its handlers were installed, or already past them at its end, stops that way, which is a stop,
        not a failure. A slot waiting to restart a child when the stop came had nothing to stop: its
        child's exit was a crash already logged and counted, whenever the stop came after it."""
        if slot.killed:
            return False
        if self._stopping and slot.restart_pending:
            return True
        sent = (-int(DRAIN_SIGNAL), -int(STOP_NOW_SIGNAL))
        return slot.returncode == 0 or (self._stopping and slot.returncode in sent)

    # --- tasks ---------------------------------------------------------------------------------------

    async def _announce(self) -> None:
        for slot in self._slots:
            await slot.ready.wait()
        debug = ", ".join(f"http://{s.debug_address} (process {s.index})" for s in self._slots)
        # The first debug address stays where a single process prints its own: readers of that line work.
        failed = print_line(f"kvroute serve: Route gRPC on {self._grpc_address}, debug HTTP on {debug}")
        if failed is not None:  # nobody can read it: the processes serve on all the same
            log.warning("the address line could not be printed (%s): %s", self._grpc_address, failed)

    async def _watch_signals(self, signals: AsyncIterator[int]) -> None:
        signalled = False
        async for signum in signals:
            name = signal.Signals(signum).name
            # First or second by the signals read, not by the shutdown begun: two signals together (a
            # quick double Ctrl-C, SIGTERM with SIGINT) are both read before run() resumes into it, and
            # a drain a failed start began is no operator's first stop.
            if not signalled:
                signalled = True
                if self._stop.is_set():
                    log.info("%s: the processes are draining already", name, extra=ctx(reason="drain"))
                else:
                    log.info("%s: draining %d processes", name, len(self._slots), extra=ctx(reason="drain"))
                    self._stop.set()
            else:
                log.warning("%s during the drain: the processes stop now", name, extra=ctx(reason="drain"))
                if self._stopping:
                    self._send_all(STOP_NOW_SIGNAL)
                else:  # the drain signal has not gone out yet: the stop-now follows it
                    self._stop_now_asked = True

    async def _keep_running(self, slot: _Slot) -> None:
        backoff = RESTART_BACKOFF_MIN_S
        try:
            while not self._stopping:
                try:
                    served_s = await self._run_child(slot)
                except OSError as exc:  # could not even start it (e.g. the interpreter is gone)
                    log.error("process %d: cannot start: %s", slot.index, exc, extra=ctx(process=slot.index))
                    slot.returncode, served_s = None, 0.0
                if self._stopping:
                    return
                if not slot.ever_served:
                    self._failed_start = slot.returncode if slot.returncode in (1, 2) else EXIT_CHILD_FAILED
                    log.error(
                        "process %d could not start (exit status %s): stopping every process",
                        slot.index,
                        slot.returncode,
                        extra=ctx(process=slot.index),
                    )
                    self._stop.set()
                    return
                if served_s >= STABLE_AFTER_S:
                    backoff = RESTART_BACKOFF_MIN_S
                slot.restarts += 1
                log.warning(
                    "process %d (pid %s) exited with status %s: restart %d in %.1f s",
                    slot.index,
                    slot.pid,
                    slot.returncode,
                    slot.restarts,
                    backoff,
                    extra=ctx(process=slot.index, restarts=slot.restarts),
                )
                slot.restart_pending = True
                with trio.CancelScope() as slot.backoff:
                    await trio.sleep(backoff)
                slot.backoff = None
                if self._stopping:
                    return
                slot.restart_pending = False
                backoff = min(2 * backoff, RESTART_BACKOFF_MAX_S)
        finally:
            slot.ended.set()

    async def _run_child(self, slot: _Slot) -> float:
        """Start the slot's child, wait for its addresses and then for its exit; how long it served."""
        process = await trio.lowlevel.open_process(
            list(self._command(slot.index)),
            stdin=subprocess.PIPE,  # never written: its end-of-file tells the child this parent is gone
            stdout=subprocess.PIPE,
            process_group=0,  # a terminal's signals reach the parent only; it forwards them
        )
        slot.process, slot.pid = process, process.pid
        slot.starts += 1
        served_s = 0.0
        began = 0.0
        try:
            if self._stopping:  # the stop began while it was being started: it missed the forwarded signal
                process.send_signal(DRAIN_SIGNAL)
            assert process.stdout is not None
            async with trio.open_nursery() as output:
                debug = await self._address_of(slot, process.stdout)
                if debug is None:
                    process.kill()
                else:
                    began = trio.current_time()
                    slot.debug_address = debug
                    slot.ever_served = True
                    log.info(
                        "process %d serving: pid %d, debug HTTP on http://%s (start %d)",
                        slot.index,
                        process.pid,
                        debug,
                        slot.starts,
                        extra=ctx(process=slot.index),
                    )
                    slot.ready.set()
                    output.start_soon(_pass_on, process.stdout)
                slot.returncode = await process.wait()
            if debug is not None:
                served_s = trio.current_time() - began
        finally:
            if process.returncode is None:
                process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
                for pipe in (process.stdin, process.stdout):
                    if pipe is not None:
                        await pipe.aclose()
            slot.process = None
        return served_s

    async def _address_of(self, slot: _Slot, stdout: trio.abc.ReceiveStream) -> str | None:
        """The debug address from the child's address line; None when it exits or stalls first."""
        data = b""
        with trio.move_on_after(self._startup_timeout_s):
            while not data.endswith(b"\n"):
                chunk = await stdout.receive_some(4096)
                if not chunk:
                    return None
                data += chunk
            found = _ADDRESS.search(data.decode(errors="replace"))
            if found is None:
                log.error("process %d printed no addresses: %r", slot.index, data[:200], extra=ctx(process=slot.index))
                return None
            return found.group(2)
        log.error(
            "process %d gave no addresses within %.0f s",
            slot.index,
            self._startup_timeout_s,
            extra=ctx(process=slot.index),
        )
        return None

    # --- stopping ------------------------------------------------------------------------------------

    def _send_all(self, signum: signal.Signals) -> None:
        for slot in self._slots:
            if slot.process is not None and slot.process.returncode is None:
                slot.process.send_signal(signum)

    async def _shutdown(self) -> None:
        self._stopping = True
        for slot in self._slots:
            if slot.backoff is not None:
                slot.backoff.cancel()
        self._send_all(DRAIN_SIGNAL)
        if self._stop_now_asked:
            self._send_all(STOP_NOW_SIGNAL)
        with trio.move_on_after(self._stop_wait_s):
            for slot in self._slots:
                await slot.ended.wait()
        for slot in self._slots:
            if not slot.ended.is_set() and slot.process is not None:
                log.error(
                    "process %d (pid %s) still running %.0f s after the stop: killed",
                    slot.index,
                    slot.pid,
                    self._stop_wait_s,
                    extra=ctx(process=slot.index),
                )
                slot.killed = True
                slot.process.kill()
        with trio.CancelScope(shield=True):
            for slot in self._slots:
                await slot.ended.wait()
        restarts = sum(slot.restarts for slot in self._slots)
        log.info(
            "all %d processes stopped (%d restarts); exit statuses %s",
            len(self._slots),
            restarts,
            [slot.returncode for slot in self._slots],
            extra=ctx(reason="drain"),
        )


async def _pass_on(stdout: trio.abc.ReceiveStream) -> None:
    """Whatever a child prints after its address line goes to stderr (the parent's stdout has one line)."""
    while chunk := await stdout.receive_some(4096):
        sys.stderr.write(chunk.decode(errors="replace"))
        sys.stderr.flush()
