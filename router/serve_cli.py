"""``kvroute serve``: the router as a gRPC sidecar (kvroute.v1 Router/Route + health) with debug HTTP.

Configuration comes from the settings table (flags, ``KVROUTE_*`` variables, ``--config`` TOML):

- problems outside the KVCM fallback stop it: every problem is listed and the exit status is 2;
- problems confined to the KVCM fallback start it with the fallback off (domain routing) and one
  clear error in the log (also on /readyz and /debug/config).

Once serving it prints one line with the Route gRPC and debug HTTP addresses. On SIGTERM or SIGINT
it drains: health turns NOT_SERVING, new calls are refused, calls in flight finish within
``--drain-timeout-s``; then every actor stops and every channel closes, a summary of the calls goes
to stderr, and the exit status is 0. A second signal during the drain stops at once.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator

import trio

from router.api import open_router
from router.exception_groups import leaves
from router.logs import ctx, setup_logging
from router.settings import LoadedConfig, add_arguments, load_or_report, log_startup_report
from router.sidecar import Sidecar, SidecarStats

log = logging.getLogger("kvroute.serve")

EXIT_OK = 0
EXIT_CANNOT_SERVE = 1  # e.g. a listen address already in use
EXIT_CONFIG = 2


def configure(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    loaded = load_or_report(args, "serve")
    if loaded is None:
        return EXIT_CONFIG
    serve = loaded.effective.serve
    setup_logging(serve.log_level, serve.log_format)
    log_startup_report(loaded, log)
    bind_errors: list[BaseException] = []
    try:
        stats = trio.run(_serve, loaded)
    except* OSError as group:  # a listen address in use or not assignable
        bind_errors.extend(leaves(group))
    if bind_errors:
        for error in bind_errors:
            print(f"kvroute serve: {error}", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    print(
        f"kvroute serve: stopped; Route calls answered={stats.answered} invalid={stats.invalid} "
        f"refused={stats.unavailable} timed_out={stats.timed_out} failed={stats.failed} "
        f"cut_at_drain_deadline={stats.in_flight}",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_OK


async def _next_signal(signals: AsyncIterator[int]) -> int:
    async for signum in signals:
        return signum
    raise AssertionError("signal receivers never end")


async def _stop_on_signal(signals: AsyncIterator[int], serving: trio.CancelScope) -> None:
    signum = await _next_signal(signals)
    log.warning("%s during the drain: stopping now", signal.Signals(signum).name, extra=ctx(reason="drain"))
    serving.cancel()


async def _serve(loaded: LoadedConfig) -> SidecarStats:
    config = loaded.effective
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_router(config, loaded=loaded, debug_http=True) as handle, trio.open_nursery() as watch:
            sidecar = Sidecar(handle, config)
            async with trio.open_nursery() as serving:
                grpc_address = await serving.start(sidecar.run)
                # The process is ours: move everything start-up allocated out of the collector's view,
                # so a full collection walks only what requests allocate (long gen-2 pauses otherwise
                # stall the routing thread). Embedders decide this for their own process.
                gc.collect()
                gc.freeze()
                print(
                    f"kvroute serve: Route gRPC on {grpc_address}, debug HTTP on http://{handle.debug_address}",
                    flush=True,
                )
                signum = await _next_signal(signals)
                log.info("%s: draining", signal.Signals(signum).name, extra=ctx(reason="drain"))
                sidecar.drain()
                watch.start_soon(_stop_on_signal, signals, serving.cancel_scope)
            watch.cancel_scope.cancel()  # drained (sidecar.run returned): no more signals to watch
        # open_router's exit stopped every actor and closed every channel.
    return sidecar.stats()
