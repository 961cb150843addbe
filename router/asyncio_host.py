"""The asyncio way in: the trio router runs in its own thread; asyncio code awaits its decisions.

    async with AsyncioRouterHost(config) as host:
        decision = await host.route(request)

``start()`` starts one thread running ``trio.run``, opens the router there (``open_router``) and
returns once it is ready (or raises what opening it raised). ``route()`` may be awaited from any
asyncio event loop in any thread, concurrently. ``stop()`` refuses new calls, lets the calls already
submitted finish (each ends by its own routing deadline), closes the router and joins the thread.

Bridge: each call is handed to trio with ``TrioToken.run_sync_soon``, runs as a task in the host's
call nursery, and completes an asyncio future with ``loop.call_soon_threadsafe``. The call's budget
counts from ``route()``: the hop to the trio thread is taken off it. Each answer's way back (settled
on the trio thread to resumed on the caller's loop) is timed and handed to the metrics sink with a
later call (the deadline split's tail). That beat
``loop.run_in_executor(trio.from_thread.run)``, which also parks an executor thread per call
(``bench/bench_asyncio_bridge.py`` measures both; docs/design.md §9 has the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from types import TracebackType

import outcome
import trio

from actors.metrics_sink import RepliesSent
from router.api import RouterHandle, open_router
from router.config import KvrouteConfig
from router.exception_groups import sole_leaf
from router.request import budget_left_ms, caller_deadline, check_fields, request_deadline
from router.settings import LoadedConfig
from router.targets import HostPort
from router.thread_bridge import deliver_outcome, settle_on_loop
from router.types import BadRequest, RouteDecision, RouteRequest

REPLY_SAMPLES = 256  # answers' way-back times kept until the next call hands them to the metrics sink


class HostStopped(RuntimeError):
    """The host is not running (never started, stopping, stopped, or its router crashed)."""


class AsyncioRouterHost:
    """A trio router in a dedicated thread, for asyncio programs. Start and stop it from one loop."""

    def __init__(self, config: KvrouteConfig, *, loaded: LoadedConfig | None = None, debug_http: bool = False) -> None:
        self._config = config
        self._loaded = loaded
        self._debug_http = debug_http
        self._thread: threading.Thread | None = None
        self._finished: asyncio.Future[None] | None = None
        # Set by the trio thread before start() returns; cleared by stop() (asyncio side) so that no
        # new call is submitted once stopping began.
        self._token: trio.lowlevel.TrioToken | None = None
        self._handle: RouterHandle | None = None
        # Owned by the trio thread (touched only in callbacks it runs and in its tasks).
        self._calls: trio.Nursery | None = None
        self._closing = False
        self._stop_requested: trio.Event | None = None
        # Each answer's way back: appended by the callers' loops, handed to the metrics sink by the trio thread.
        self._reply_times: deque[float] = deque(maxlen=REPLY_SAMPLES)

    # --- lifecycle (asyncio side) -----------------------------------------------------------------

    async def start(self) -> None:
        """Start the router thread and wait until the router is open; raises what opening raised."""
        if self._thread is not None:
            raise RuntimeError("AsyncioRouterHost.start: already started")
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._finished = loop.create_future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(loop, ready, self._finished), name="kvroute-router", daemon=True
        )
        self._thread.start()
        try:
            await asyncio.shield(ready)
        except asyncio.CancelledError:
            # Let the opening finish, then close it: the thread must not outlive a cancelled start().
            with contextlib.suppress(Exception):
                await ready
            await self._shut_down()
            raise
        except Exception:
            with contextlib.suppress(Exception):  # the same error, reported on ``finished`` too
                await self._shut_down()  # opening failed: the thread is ending by itself
            raise

    async def stop(self) -> None:
        """Refuse new calls, finish the submitted ones, close the router, join the thread. Idempotent.

        Re-raises an error the router crashed with after it started.
        """
        if self._thread is None:
            return
        await self._shut_down()

    async def _shut_down(self) -> None:
        thread, finished, token = self._thread, self._finished, self._token
        assert thread is not None and finished is not None
        self._token = None
        if token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._begin_stop)
        try:
            # Shielded: a cancelled stop() must not cancel the future the thread reports its end on.
            await asyncio.shield(finished)
        finally:
            if finished.done():
                thread.join()  # its last act was reporting ``finished``: returns at once

    async def __aenter__(self) -> AsyncioRouterHost:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- the request path (asyncio side) --------------------------------------------------------------

    @property
    def debug_address(self) -> HostPort | None:
        """Where the debug HTTP endpoint listens (None when it was not started)."""
        if self._handle is None:
            raise HostStopped("the router host is not started")
        return self._handle.debug_address

    async def route(self, request: RouteRequest, *, deadline: float | None = None) -> RouteDecision:
        """The router's decision for ``request``; cancelling the await cancels the routing task.

        ``deadline`` is when this caller needs the answer, on its own loop's clock (``loop.time()``):
        the router decides ``--reply-margin-ms`` before it, leaving that for the way back to this loop.
        (``request.deadline``, by contrast, is on the trio thread's clock.)
        """
        token = self._token
        if token is None:
            raise HostStopped("the router host is not running")
        if deadline is not None and math.isnan(deadline):
            raise ValueError("deadline: NaN is no time on the loop's clock")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RouteDecision] = loop.create_future()
        scope = trio.CancelScope()  # cancelled from this side through the trio token only
        # -inf is a deadline long past (nothing left); +inf is none, ignored on the trio side.
        remaining_s = None if deadline is None else max(0.0, deadline - loop.time())
        settled_at: list[float] = []  # written by the trio thread before it settles ``future``
        try:
            spawn = partial(self._spawn_call, request, remaining_s, time.monotonic(), scope, loop, future, settled_at)
            token.run_sync_soon(self._spawn, spawn, loop, future)
        except trio.RunFinishedError:
            raise HostStopped("the router host has stopped") from None
        try:
            decision = await future
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(scope.cancel)
            raise
        if settled_at:
            self._reply_times.append(time.monotonic() - settled_at[0])
        return decision

    # --- the trio thread --------------------------------------------------------------------------

    def _thread_main(
        self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[None], finished: asyncio.Future[None]
    ) -> None:
        try:
            trio.run(self._trio_main, loop, ready)
        except BaseException as exc:
            # Before ready: start() raises it. After: stop() re-raises it.
            sole = sole_leaf(exc)
            error = outcome.Error(exc if sole is None else sole)
            settle_on_loop(loop, ready, error)
            settle_on_loop(loop, finished, error)
        else:
            settle_on_loop(loop, ready, outcome.Error(HostStopped("the router stopped while starting")))
            settle_on_loop(loop, finished, outcome.Value(None))

    async def _trio_main(self, loop: asyncio.AbstractEventLoop, ready: asyncio.Future[None]) -> None:
        self._stop_requested = trio.Event()
        async with (
            open_router(self._config, loaded=self._loaded, debug_http=self._debug_http) as handle,
            trio.open_nursery() as calls,
        ):
            self._handle = handle
            self._calls = calls
            self._token = trio.lowlevel.current_trio_token()
            settle_on_loop(loop, ready, outcome.Value(None))
            await self._stop_requested.wait()
            # Leaving the nursery waits for the calls already accepted; _closing refuses later ones.

    def _begin_stop(self) -> None:
        # Runs in the trio thread (run_sync_soon): synchronous, so atomic with _spawn.
        self._closing = True
        if self._stop_requested is not None:
            self._stop_requested.set()

    @staticmethod
    def _spawn(
        spawn: Callable[[], None], loop: asyncio.AbstractEventLoop, future: asyncio.Future[RouteDecision]
    ) -> None:
        # Runs in the trio thread (run_sync_soon), in submission order. An exception raised here would
        # end the trio run (and leave this call's future unsettled): whatever fails settles the future.
        try:
            spawn()
        except Exception as exc:
            settle_on_loop(loop, future, outcome.Error(exc))

    def _spawn_call(
        self,
        request: RouteRequest,
        remaining_s: float | None,
        sent_at: float,
        scope: trio.CancelScope,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[RouteDecision],
        settled_at: list[float],
    ) -> None:
        calls, handle = self._calls, self._handle
        if self._closing or calls is None or handle is None:
            settle_on_loop(loop, future, outcome.Error(HostStopped("the router host is stopping")))
            return
        routing: tuple[float, float] | None = None
        try:
            check_fields(request)
        except BadRequest:
            pass  # the router answers it bad_request; nothing here may read its fields
        else:
            arrived = time.monotonic()
            # The request's own min(budget, cap) in seconds from route(), before a caller's deadline joins it.
            routing = (sent_at, request_deadline(request, 0.0, self._config.router.budget_cap_ms))
            if remaining_s is not None and math.isfinite(remaining_s):  # an endless deadline adds nothing
                deadline = caller_deadline(trio.current_time(), remaining_s, sent_at, arrived)
                if request.deadline is not None:
                    deadline = min(deadline, request.deadline)
                request = replace(request, deadline=deadline)
        if self._reply_times:
            taken = []
            with contextlib.suppress(IndexError):
                while True:
                    taken.append(self._reply_times.popleft())
            handle.metrics.emit(RepliesSent(tuple(taken)))
        try:
            calls.start_soon(self._call, handle, request, routing, scope, loop, future, settled_at)
        except RuntimeError:  # the calls' nursery closed as the router stopped
            settle_on_loop(loop, future, outcome.Error(HostStopped("the router host has stopped")))

    @staticmethod
    async def _call(
        handle: RouterHandle,
        request: RouteRequest,
        routing: tuple[float, float] | None,
        scope: trio.CancelScope,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[RouteDecision],
        settled_at: list[float],
    ) -> None:
        # The budget counts from route(): the hop to this thread and the wait for this task to start
        # are already spent. (None: a request whose fields cannot be read, which the router refuses.)
        if routing is not None:
            sent_at, routing_s = routing
            request = replace(request, budget_ms=budget_left_ms(routing_s, sent_at, time.monotonic()))

        # Cancelled by its caller (who no longer waits) or by a crashing router: HostStopped.
        def deliver(result: outcome.Outcome[RouteDecision]) -> None:
            settled_at.append(time.monotonic())  # the answer's way back starts here
            settle_on_loop(loop, future, result)

        with scope:
            await deliver_outcome(partial(handle.route, request), deliver, HostStopped("the route call was cancelled"))
