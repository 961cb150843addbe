"""``kvroute serve``: the router as a gRPC sidecar (kvroute.v1 Router/Route + health) with debug HTTP.

Configuration comes from the settings table (flags, ``KVROUTE_*`` variables, ``--config`` TOML):

- problems outside the KVCM fallback stop it: every problem is listed and the exit status is 2;
- problems confined to the KVCM fallback start it with the fallback off (domain routing) and one
  clear error in the log (also on /readyz and /debug/config).

Once serving it prints one line with the Route gRPC and debug HTTP addresses. On SIGTERM, SIGINT or
SIGHUP it drains: health turns NOT_SERVING, new calls are refused, calls in flight finish within
``--drain-timeout-s``; then every actor stops and every channel closes, a summary of the calls goes
to stderr (with ``--log-format json`` as a log record, like every other line there), and the exit
status is 0. A second signal during the drain stops at once. A signal
during start-up (which can wait as long as a peer's discovery timeout) stops it at once, before it
serves or prints its addresses, also with status 0.

With ``--processes N`` (N > 1) this process supervises N such router processes sharing the gRPC port
(``router.serve_processes``) and prints the one line once all of them serve. Each child runs this
module with ``--processes 1`` and the hidden ``--supervised-process I``: it binds with SO_REUSEPORT
and also drains when its stdin (a pipe from the parent) reaches end-of-file; during its drain only
its parent's STOP_NOW_SIGNAL stops it at once, also when it is the first stop read (a second SIGTERM
from a service manager signalling the whole group does not).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import replace
from types import FrameType

import trio

from router.api import open_router
from router.config import SEED_MAX
from router.decision_record import child_log_path
from router.exception_groups import leaves
from router.logs import ctx, setup_logging, tag_records
from router.serve_processes import (
    ADDRESS_LINE,
    STOP_MARGIN_S,
    STOP_NOW_SIGNAL,
    STOP_SIGNALS,
    ProcessSupervisor,
    child_debug_listen,
    print_line,
    reserve_port,
    startup_timeout,
    unblock_stop_signals,
)
from router.settings import (
    SETTINGS,
    LoadedConfig,
    Origin,
    SourceKind,
    SupervisedProcess,
    add_arguments,
    load_or_report,
    log_startup_report,
    parse_listen,
)
from router.sidecar import Sidecar, SidecarStats
from router.targets import format_target

log = logging.getLogger("kvroute.serve")

EXIT_OK = 0
EXIT_CANNOT_SERVE = 1  # e.g. a listen address already in use
EXIT_CONFIG = 2
PARENT_GONE = "the supervising parent is gone"  # why a supervised child drains when its parent has died


# Second-generation collections between two full ones once serving (CPython's default: 10).
SERVE_FULL_COLLECTION_EVERY = 1000


def freeze_start_up() -> None:
    """Move everything allocated so far out of the collector's view, so a full collection walks only
    what requests allocate: long gen-2 pauses over the start-up heap otherwise stall the routing
    thread. Then make full collections rarer (SERVE_FULL_COLLECTION_EVERY): each still costs
    milliseconds with the GIL held and, under load, finds nothing, while the younger generations
    collect the garbage requests leave. For a process that is the router's own (``gc.unfreeze()``
    and ``gc.set_threshold`` give the defaults back)."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, SERVE_FULL_COLLECTION_EVERY)


def configure(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    # Set only by a supervising parent (--processes N) on its children; not an operator's setting.
    parser.add_argument("--supervised-process", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--supervised-processes", type=int, default=None, help=argparse.SUPPRESS)  # the parent's N
    parser.add_argument("--supervised-origins", default=None, help=argparse.SUPPRESS)  # JSON: name → origin


def run(args: argparse.Namespace) -> int:
    loaded = load_or_report(args, "serve")
    if loaded is None:
        return EXIT_CONFIG
    serve = loaded.effective.serve
    handler = setup_logging(serve.log_level, serve.log_format)
    unblocked = unblock_stop_signals()  # before any thread starts: they inherit the mask
    if unblocked:
        log.warning(
            "started with %s blocked (a mask inherited from its parent): unblocked, so a stop drains",
            ", ".join(s.name for s in unblocked),
        )
    supervised: int | None = args.supervised_process
    if supervised is not None:
        tag_records(handler, process=supervised)  # the children of one parent share the stream: whose line it is
        # Its own processes is 1: the debug views say which of the parent's N this is.
        loaded = replace(
            with_parent_origins(loaded, args.supervised_origins),
            supervised=SupervisedProcess(supervised, args.supervised_processes or 1),
        )
    say = _Say(
        "kvroute serve" if supervised is None else f"kvroute serve (process {supervised})",
        as_records=serve.log_format.lower() == "json",
    )
    # Taken before trio runs (it puts its own on SIGINT while it runs); put back once the command has
    # said how it ended: ``stop_signal_receiver`` leaves the stop signals held.
    stop_handlers = {signum: signal.getsignal(signum) for signum in _stop_signals(supervised)}
    try:
        if supervised is None:  # a supervising parent reports the settings once; its children do not
            log_startup_report(loaded, log)
            if serve.processes > 1:
                return _run_processes(args, loaded, say)
        return _serve_and_report(loaded, supervised, say)
    finally:
        for signum, previous in stop_handlers.items():
            if previous is not None:  # None: not set from Python, and it cannot be set back from here
                signal.signal(signum, previous)


def _serve_and_report(loaded: LoadedConfig, supervised: int | None, say: _Say) -> int:
    bind_errors: list[BaseException] = []
    try:
        stats = trio.run(_serve, loaded, supervised)
    except* OSError as group:  # a listen address in use or not assignable
        bind_errors.extend(leaves(group))
    if bind_errors:
        for error in bind_errors:
            say(str(error), logging.ERROR)
        return EXIT_CANNOT_SERVE
    if isinstance(stats, str):
        say(f"{stats} during start-up: stopped before serving", signal=stats)
        return EXIT_OK
    counts = {
        "answered": stats.answered,
        "invalid": stats.invalid,
        "refused": stats.unavailable,
        "timed_out": stats.timed_out,
        "failed": stats.failed,
        "cut_at_drain_deadline": stats.cut_at_drain_deadline,
        # Appended: the fields before each keep their places in the line.
        "client_gone": stats.client_gone,
        "expired_at_receipt": stats.expired_at_receipt,
    }
    say("stopped; Route calls " + " ".join(f"{name}={n}" for name, n in counts.items()), **counts)
    return EXIT_OK


class _Say:
    """The command's own lines on stderr (why it cannot serve, its stop): ``"kvroute serve: ..."`` with
    the text log format; with json, a record of this command's logger like every other line there, so
    a log shipper parses them all."""

    def __init__(self, who: str, *, as_records: bool) -> None:
        self._who = who
        self._as_records = as_records

    def __call__(self, message: str, level: int = logging.INFO, **fields: object) -> None:
        if self._as_records:
            # Handled whatever --log-level: the text line it stands for shows at every level.
            log.handle(log.makeRecord(log.name, level, __file__, 0, message, (), None, extra=ctx(**fields)))
            return
        # One write: sibling processes share the stream, and print() may write the newline separately,
        # letting another process's line land in between.
        sys.stderr.write(f"{self._who}: {message}\n")
        sys.stderr.flush()


STOP_NOW_NAME = signal.Signals(STOP_NOW_SIGNAL).name


async def _next_signal(signals: AsyncIterator[int]) -> int:
    async for signum in signals:
        return signum
    raise AssertionError("signal receivers never end")


async def _stop_on_signal(signals: AsyncIterator[int], serving: trio.CancelScope, supervised: bool) -> None:
    """During the drain: a second stop signal stops this process at once. A supervised child takes that
    only from its parent (STOP_NOW_SIGNAL): a service manager that signals the whole group sends it the
    parent's SIGTERM twice over, which must not cut its drain short."""
    async for signum in signals:
        name = signal.Signals(signum).name
        if supervised and signum != STOP_NOW_SIGNAL:
            log.info("%s during the drain: already draining", name, extra=ctx(reason="drain"))
            continue
        log.warning("%s during the drain: stopping now", name, extra=ctx(reason="drain"))
        serving.cancel()
        return


def _run_processes(args: argparse.Namespace, loaded: LoadedConfig, say: _Say) -> int:
    serve = loaded.effective.serve
    # The children read the configuration file as this process read it, at every start and restart:
    # an edit made while serving would otherwise reach a restarted child alone (a broken one failing
    # each restart with exit 2, a valid one running that child unlike its siblings). Read now, before
    # the port's wait.
    try:
        config = None if loaded.config_path is None else ConfigCopy.read(loaded.config_path)
    except OSError as error:
        say(f"{loaded.config_path}: cannot read the configuration file again for the children: {error}", logging.ERROR)
        return EXIT_CONFIG
    try:
        held = reserve_port(
            parse_listen(serve.grpc_listen), "--grpc-listen", on_wait=lambda why: say(why, logging.WARNING)
        )
    except OSError as error:
        say(str(error), logging.ERROR)
        return EXIT_CANNOT_SERVE
    with held, contextlib.ExitStack() as stack:
        if config is not None:
            stack.enter_context(config)
        port = held.getsockname()[1]
        grpc_address = format_target(parse_listen(serve.grpc_listen).host, port)
        debug = parse_listen(serve.debug_listen)
        log.info("serving with %d processes on %s", serve.processes, grpc_address, extra=ctx(target=grpc_address))

        decision_log = loaded.effective.router.decision_log
        seed = loaded.effective.scorer.seed

        def command(index: int) -> list[str]:
            return _child_command(
                args,
                index,
                serve.processes,
                grpc_address,
                child_debug_listen(debug, index),
                child_log_path(decision_log, index),
                child_seed(seed, index),
                origins=loaded.sources,
                config_path="" if config is None else config.path(),
            )

        supervisor = ProcessSupervisor(
            count=serve.processes,
            command=command,
            grpc_address=grpc_address,
            stop_wait_s=serve.drain_timeout_s + STOP_MARGIN_S,
            startup_timeout_s=startup_timeout(loaded.effective.discovery.refresh_timeout_s),
        )

        async def supervise() -> int:
            with stop_signal_receiver(STOP_SIGNALS) as signals:
                return await supervisor.run(signals)

        return trio.run(supervise)


def child_seed(seed: int, index: int) -> int:
    """Child ``index``'s ``scorer_seed`` under ``kvroute serve --processes N``: the given one for child 0,
    the next ones for the others (wrapping within the setting's range). With one seed the children's tie,
    near-tie and domain draws came in the same order, which makes routers that share nothing herd."""
    return (seed + index) % (SEED_MAX + 1)


class ConfigCopy:
    """The configuration file this process read, as its bytes, and a private file holding them for
    the children (a directory of its own, removed on exit). ``path()`` writes the file again if it
    is gone (a temporary-files cleaner may take it under a parent running for weeks)."""

    def __init__(self, name: str, data: bytes) -> None:
        self._name = name
        self._data = data
        self._directory: tempfile.TemporaryDirectory[str] | None = None

    @classmethod
    def read(cls, path: str) -> ConfigCopy:
        with open(path, "rb") as given:
            return cls(os.path.basename(path) or "config.toml", given.read())

    def __enter__(self) -> ConfigCopy:
        self._directory = tempfile.TemporaryDirectory(prefix="kvroute-serve-")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._directory is not None:
            self._directory.cleanup()
            self._directory = None

    def path(self) -> str:
        assert self._directory is not None, "path() outside the with block"
        os.makedirs(self._directory.name, mode=0o700, exist_ok=True)
        copy = os.path.join(self._directory.name, self._name)
        if not os.path.exists(copy):
            with open(copy, "wb") as written:
                written.write(self._data)
        return copy


def _child_command(
    args: argparse.Namespace,
    index: int,
    count: int,
    grpc_listen: str,
    debug_listen: str,
    decision_log: str,
    seed: int,
    *,
    origins: Mapping[str, Origin],
    config_path: str,
) -> list[str]:
    """``kvroute serve`` for child ``index``: this command's own flags (the environment reaches the child
    as it reached this process, the configuration file as ``config_path``, the copy of it this process
    took, "" when it read none), one process, the resolved addresses, its own decision log and seed,
    and where those and the file's settings came from to this process (``origins``: its sources),
    which the child shows as theirs, not as the flags or the copy they reach it by."""
    given = vars(args)
    # Always given: "" reads none, as this process read none, whatever KVROUTE_CONFIG says.
    flags: list[str] = [f"--config={config_path}"]
    overrides = {
        "processes": "1",
        "grpc_listen": grpc_listen,
        "debug_listen": debug_listen,
        "decision_log": decision_log,
        "scorer_seed": str(seed),
    }
    for setting in SETTINGS:
        value = overrides.get(setting.name, given.get(setting.name))
        if value is not None:
            flags.append(f"{setting.flag}={value}")
    named = [*overrides, *(name for name, origin in origins.items() if origin.kind is SourceKind.FILE)]
    resolved = json.dumps({name: str(origins[name]) for name in named if name in origins})
    return [
        *CHILD_INTERPRETER,
        "serve",
        *flags,
        f"--supervised-process={index}",
        f"--supervised-processes={count}",
        f"--supervised-origins={resolved}",
    ]


def with_parent_origins(loaded: LoadedConfig, origins_json: str | None) -> LoadedConfig:
    """A child's configuration with the settings its parent resolved for it named by where they came
    from to the parent (``--supervised-origins``), not as the flags they reached the child by."""
    if not origins_json:
        return loaded
    sources = dict(loaded.sources)
    for name, origin in json.loads(origins_json).items():
        if name in sources:
            sources[name] = Origin(SourceKind.PARENT, origin)
    return replace(loaded, sources=sources)


# -P: never import a same-named package from the working directory instead of the installed one.
CHILD_INTERPRETER: Sequence[str] = (sys.executable, "-P", "-m", "router.cli")


async def _wait_for_parent_gone() -> None:
    """Returns when stdin (a pipe from the supervising parent, never written) reaches end-of-file."""
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
        while await stdin.receive_some(4096):
            pass


async def _first_stop(signals: AsyncIterator[int], supervised: bool) -> str:
    """The name of what asks this process to drain: a signal, or (supervised) its parent's end."""
    reason = ""
    async with trio.open_nursery() as waiting:

        async def on_signal() -> None:
            nonlocal reason
            reason = signal.Signals(await _next_signal(signals)).name
            waiting.cancel_scope.cancel()

        async def on_parent_gone() -> None:
            nonlocal reason
            await _wait_for_parent_gone()
            reason = PARENT_GONE
            waiting.cancel_scope.cancel()

        waiting.start_soon(on_signal)
        if supervised:
            waiting.start_soon(on_parent_gone)
    return reason


def _stop_signals(supervised: int | None) -> tuple[signal.Signals, ...]:
    return (*STOP_SIGNALS, STOP_NOW_SIGNAL) if supervised is not None else STOP_SIGNALS


@contextlib.contextmanager
def stop_signal_receiver(stop_signals: Sequence[signal.Signals]) -> Iterator[AsyncIterator[int]]:
    """trio's signal receiver for ``stop_signals`` (call on the trio thread), losing no stop before it
    opens and killed by none after it closes; the caller puts the signals' earlier handlers back once
    it has said how it stopped.

    trio's receiver sends a signal it never handed out again as it closes, to the handler in place
    when it opened: the default one killed the process with its stop under way, before its drain
    summary (exit 143). A handler of ours is in place from just before it opens: a stop that comes
    before the receiver's own handler is held and sent again once the receiver is open, and one sent
    again at its close is held with nobody to read it, the stop being under way."""
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    for stop in stop_signals:
        signal.signal(stop, hold)
    with trio.open_signal_receiver(*stop_signals) as signals:
        early, held[:] = list(held), []
        for signum in early:
            signal.raise_signal(signum)  # to the receiver's handler now
        yield signals


async def _serve(loaded: LoadedConfig, supervised: int | None) -> SidecarStats | str:
    """The calls' counts once drained; or the name of the signal that stopped it during start-up (which
    can take as long as a peer's discovery timeout: a stop must not wait for it, nor see it serve).

    It leaves the stop signals held (``stop_signal_receiver``), for its caller to put their handlers
    back once it has reported the stop: a third stop, or the drain signal pending beside the stop-now
    one a supervising parent sends, is never read, and it killed the process as the receiver closed."""
    stopped_by: list[str] = []
    stats: SidecarStats | None = None
    with stop_signal_receiver(_stop_signals(supervised)) as signals:
        async with trio.open_nursery() as guard:
            starting = trio.CancelScope()
            watching = trio.CancelScope()

            async def stop_the_start_up() -> None:
                with watching:
                    stopped_by.append(signal.Signals(await _next_signal(signals)).name)
                    starting.cancel()

            guard.start_soon(stop_the_start_up)
            with starting:
                stats = await _serve_until_drained(loaded, supervised, signals, started=watching)
    if stopped_by:
        return stopped_by[0]
    assert stats is not None  # not stopped during start-up: served to its end
    return stats


async def _serve_until_drained(
    loaded: LoadedConfig, supervised: int | None, signals: AsyncIterator[int], *, started: trio.CancelScope
) -> SidecarStats:
    """Open the router, serve it, drain on the first stop; ``started`` is cancelled once serving (the
    start-up's own signal watch ends there)."""
    config = loaded.effective
    async with open_router(config, loaded=loaded, debug_http=True) as handle, trio.open_nursery() as watch:
        sidecar = Sidecar(handle, config, reuse_port=supervised is not None)
        async with trio.open_nursery() as serving:
            grpc_address = await serving.start(sidecar.run)
            started.cancel()  # from here on a signal drains (below)
            await trio.lowlevel.checkpoint()  # a stop that came with the start ends it here
            freeze_start_up()  # the process is ours; embedders decide this for their own
            failed = print_line(ADDRESS_LINE.format(grpc=grpc_address, debug=handle.debug_address))
            if failed is not None:
                log.warning("the address line could not be printed (%s): %s", grpc_address, failed)
            if isinstance(failed, BrokenPipeError) and supervised is not None:
                reason = PARENT_GONE  # the parent reading it is gone: as at its stdin's end
            else:
                reason = await _first_stop(signals, supervised is not None)
            if reason == STOP_NOW_NAME:
                # The parent sends its drain signal and then, for a second stop, this one; pending
                # together they are handled in signal-number order, so this one can be read first.
                log.warning("%s: stopping now", reason, extra=ctx(reason="drain"))
                serving.cancel_scope.cancel()
            else:
                log.info("%s: draining", reason, extra=ctx(reason="drain"))
                sidecar.drain()
                watch.start_soon(_stop_on_signal, signals, serving.cancel_scope, supervised is not None)
        watch.cancel_scope.cancel()  # drained (sidecar.run returned): no more signals to watch
    # open_router's exit stopped every actor and closed every channel.
    return sidecar.stats()
