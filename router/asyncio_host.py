"""The asyncio way in: the trio router runs in its own thread; asyncio code awaits its decisions.

    async with AsyncioRouterHost(config) as host:
        decision = await host.route(request)

``start()`` starts one thread running ``trio.run``, opens the router there (``open_router``) and
returns once it is ready (or raises what opening it raised). ``route()`` may be awaited from any
asyncio event loop in any thread, concurrently. ``stop()`` refuses new calls, lets the calls already
submitted finish (each ends by its own routing deadline), closes the router and joins the thread;
begun while ``start()`` is still opening the router, it waits for the opening, then stops it.
A call waits for its answer as long as the router may take (min(budget, cap), or the caller's
deadline) and ``ANSWER_SLACK_S``; beyond that, only reached while the trio thread is stalled, it is
given up and raises ``AnswerTimeout``, as the sidecar answers DEADLINE_EXCEEDED.

Admission before the hop: a call whose time left (its budget or the cap, and the caller's deadline
less ``--reply-margin-ms``) cannot cover the router's published admission estimate, or that finds as
many calls handed to the trio thread and not yet answered as the learnt in-flight limit allows
(``router/receipt.py``, as the sidecar's handler threads do; it never waits), is answered at once on
the caller's loop with one of the router's published ``overloaded`` answers, and counted and recorded
on the trio thread afterwards, in batches. Under a burst of calls the hand-offs would otherwise queue
on the trio thread and every answer would come after its deadline. A call naming roles, or one the
router will refuse (its fields, sizes, shape, geometry, roles or ids wrong: ``RouterActor.sheddable``), always goes
to the router.

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
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from types import TracebackType

import outcome
import trio

from actors.metrics_sink import RepliesSent
from actors.router_actor import OverloadAnswers, RouterActor
from router.admission import InFlightLimit, admits
from router.api import RouterHandle, open_router
from router.config import KvrouteConfig
from router.exception_groups import sole_leaf
from router.problems import refuse
from router.receipt import INITIAL_IN_FLIGHT_LIMIT, HandOffGate, HeldPlace, ShedRecords
from router.request import (
    budget_deadline,
    budget_left_ms,
    caller_deadline,
    check_admissible,
    check_fields,
    with_plain_id,
)
from router.settings import LoadedConfig, section_problems
from router.targets import HostPort
from router.thread_bridge import ANSWER_SLACK_S, deliver_outcome, settle_on_loop
from router.types import BadRequest, RouteDecision, RouteRequest

REPLY_SAMPLES = 256  # answers' way-back times kept until the next call hands them to the metrics sink


class HostStopped(RuntimeError):
    """The host is not running (never started, stopping, stopped, or its router crashed)."""


class AnswerTimeout(TimeoutError):
    """No answer came from the router's thread within the call's time (min(budget, cap), or the
    caller's deadline, whichever is first) and ``ANSWER_SLACK_S``. The router answers a few ms after a
    deadline at most, so only a stalled trio thread gets here: the call was given up, and its routing
    task is cancelled if it ever starts."""


@dataclass(frozen=True, slots=True)
class HostStats:
    """The host's calls by where they were answered (counted as they are, from any caller's loop)."""

    # Reached the router: a routing task started on the trio thread (counted there, so not the calls
    # still queued for it, nor those refused as the host stops).
    handed: int
    shed_before_hop: int  # answered ``overloaded`` on the caller's loop, never handed over
    # Of shed_before_hop: answered, but not counted by the router nor written to the decision log
    # (SHED_RECORDS_MAX were waiting for the trio thread).
    sheds_unrecorded: int
    in_router: int  # handed to the trio thread (queued for it or routing) and not yet answered, now
    # Raised AnswerTimeout: the router's thread gave no answer within the call's time and the slack.
    answer_timeouts: int = 0


class AsyncioRouterHost:
    """A trio router in a dedicated thread, for asyncio programs. Start and stop it from one loop."""

    def __init__(self, config: KvrouteConfig, *, loaded: LoadedConfig | None = None, debug_http: bool = False) -> None:
        self._config = config
        self._loaded = loaded
        self._debug_http = debug_http
        self._thread: threading.Thread | None = None
        self._ready: asyncio.Future[None] | None = None
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
        # Admission before the hop, used by the callers' loops (thread-safe). A loop never waits for a place.
        # Its settings are read here, before open_router checks them: checked here first, naming them.
        refuse("router", section_problems("router", config.router))
        router = config.router
        self._gate = HandOffGate(
            InFlightLimit(
                initial=min(INITIAL_IN_FLIGHT_LIMIT, router.max_in_flight),
                ceiling=router.max_in_flight,
                floor=router.admission_duty_floor,
            ),
            waiters=0,
        )
        self._sheds: ShedRecords[RouteRequest] = ShedRecords(_as_is, _request_id)
        self._shed_rng = random.Random()  # callers' loops draw from it (each draw is atomic under the GIL)
        self._counts_lock = threading.Lock()
        self._handed = 0
        self._shed_count = 0
        self._unrecorded = 0
        self._answer_timeouts = 0
        self._router: RouterActor | None = None  # set by the trio thread before the token is

    # --- lifecycle (asyncio side) -----------------------------------------------------------------

    async def start(self) -> None:
        """Start the router thread and wait until the router is open; raises what opening raised."""
        if self._thread is not None:
            raise RuntimeError("AsyncioRouterHost.start: already started")
        loop = asyncio.get_running_loop()
        ready = self._ready = loop.create_future()
        self._finished = loop.create_future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(loop, ready, self._finished), name="kvroute-router", daemon=True
        )
        self._thread.start()
        try:
            await asyncio.shield(ready)
        except asyncio.CancelledError:
            # Let the opening finish, then close it: the thread must not outlive a cancelled start().
            # Shielded, and waited out through further cancellations: a second one cancelled ``ready``
            # itself, skipped the close, and left the router serving and a later stop() waiting for good.
            while not ready.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(ready)
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
        thread, ready, finished = self._thread, self._ready, self._finished
        assert thread is not None and ready is not None and finished is not None
        if not ready.done():
            # Stopping while start() opens the router: the token to stop it with comes before
            # ``ready``; without it the stop would never reach the trio thread.
            with contextlib.suppress(Exception):  # start() raises what opening raised
                await asyncio.shield(ready)
        token, self._token = self._token, None
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

    def stats(self) -> HostStats:
        """The calls so far by where they were answered; callable from any thread."""
        with self._counts_lock:
            return HostStats(
                self._handed, self._shed_count, self._unrecorded, self._gate.in_router(), self._answer_timeouts
            )

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

        Raises ``HostStopped`` when the host is not running, and ``AnswerTimeout`` when the router's
        thread gave no answer within the call's time and ``ANSWER_SLACK_S`` (it is stalled): a call
        handed over is not answered on this loop, since the router may still decide and record it.
        """
        token = self._token
        if token is None:
            raise HostStopped("the router host is not running")
        request = with_plain_id(request)  # a shed answers here, and its decision is recorded as the router's
        if deadline is not None:
            deadline = _loop_time(deadline)
        loop = asyncio.get_running_loop()
        sent_at = time.monotonic()
        started = loop.time()
        # -inf is a deadline long past (nothing left); +inf is none, ignored on the trio side.
        remaining_s = None if deadline is None else max(0.0, deadline - started)
        routing_s, left_s = self._time_left(request, remaining_s)
        router = self._router
        published = None if router is None else router.overload_answers()
        if left_s is None or request.roles or published is None or not published.answers:
            self._gate.hand_off_anyway()
        elif (left_s > 0 and not admits(published.estimate, left_s, in_flight=self._gate.in_router())) or (
            not self._gate.hand_off(0.0)
        ):
            # As the router admits: a call with nothing left is its to answer (reason deadline), unless
            # there is no place to hand it to. One the router refuses (an id outside its key family's
            # range) is handed over all the same, to be told so.
            assert router is not None  # the answers were its
            tokens = router.sheddable(request)
            if tokens is not None:
                return self._shed(request, published, left_s, sent_at, tokens)
            self._gate.hand_off_anyway()
        handed = _Handed(self._gate, loop, sent_at, left_s)
        scope = trio.CancelScope()  # cancelled from this side through the trio token only
        try:
            token.run_sync_soon(self._spawn, partial(self._spawn_call, request, remaining_s, scope, handed), handed)
        except trio.RunFinishedError:
            self._gate.withdrawn()  # never handed over
            raise HostStopped("the router host has stopped") from None
        # The answer is awaited as long as the router may take, counted from route(), and a slack.
        wait_s = routing_s if remaining_s is None else min(routing_s, remaining_s)
        timer = loop.call_at(started + wait_s + ANSWER_SLACK_S, handed.time_out, wait_s + ANSWER_SLACK_S)
        try:
            decision = await handed.future
        except (asyncio.CancelledError, AnswerTimeout) as exc:
            # Its caller gave up, or the router's thread is stalled: the call is not waited for any more.
            handed.give_up()
            if isinstance(exc, AnswerTimeout):
                with self._counts_lock:
                    self._answer_timeouts += 1
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(scope.cancel)
            raise
        except BaseException:
            handed.resumed(decided=False)
            raise
        finally:
            timer.cancel()
        handed.resumed(decided=True)
        settled_at = handed.settled_at
        if settled_at is not None:  # set before the future was settled
            self._reply_times.append(time.monotonic() - settled_at)
        return decision

    def _time_left(self, request: RouteRequest, remaining_s: float | None) -> tuple[float, float | None]:
        """The request's own routing time, min(budget, cap) (the cap for one the router will refuse),
        and what the router will have for it: that and the caller's time less the reply margin, in
        seconds from now. None: the router will refuse it (its fields, sizes, shape, geometry or roles
        are wrong), which it must be told, not shed."""
        router = self._config.router
        try:
            check_admissible(request, self._config.deployment, self._config.limits)
        except BadRequest:
            return router.budget_cap_ms / 1000.0, None
        routing_s = budget_deadline(request.budget_ms, 0.0, router.budget_cap_ms)
        left_s = routing_s
        if remaining_s is not None and math.isfinite(remaining_s):
            left_s = min(left_s, remaining_s - router.reply_margin_ms / 1000.0)
        return routing_s, left_s

    def _shed(
        self, request: RouteRequest, published: OverloadAnswers, left_s: float, sent_at: float, tokens: int
    ) -> RouteDecision:
        """One of the router's published ``overloaded`` answers, given on the caller's loop and
        recorded on the trio thread later."""
        answers = published.answers
        drawn = answers[self._shed_rng.randrange(len(answers))]
        elapsed_ms = (time.monotonic() - sent_at) * 1000.0
        recorded = self._sheds.add(request, drawn, elapsed_ms, left_s, tokens)
        with self._counts_lock:
            self._shed_count += 1
            self._unrecorded += not recorded
        return drawn.answering(request.request_id, elapsed_ms)

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
        async with open_router(self._config, loaded=self._loaded, debug_http=self._debug_http) as handle:
            try:
                async with trio.open_nursery() as calls:
                    self._handle = handle
                    self._calls = calls
                    self._router = handle.router_actor()
                    self._sheds.open(self._router, calls)
                    self._token = trio.lowlevel.current_trio_token()
                    settle_on_loop(loop, ready, outcome.Value(None))
                    await self._stop_requested.wait()
                    # Leaving the nursery waits for the calls already accepted; _closing refuses later ones.
            finally:
                self._router = None  # nothing to shed with any more: later calls find the host stopped
                self._sheds.close()  # the router is still open: every shed answered so far is recorded

    def _begin_stop(self) -> None:
        # Runs in the trio thread (run_sync_soon): synchronous, so atomic with _spawn.
        self._closing = True
        if self._stop_requested is not None:
            self._stop_requested.set()

    @staticmethod
    def _spawn(spawn: Callable[[], None], handed: _Handed) -> None:
        # Runs in the trio thread (run_sync_soon), in submission order. An exception raised here would
        # end the trio run (and leave this call's future unsettled): whatever fails settles the future.
        try:
            spawn()
        except Exception as exc:
            handed.settle(outcome.Error(exc))

    def _spawn_call(
        self, request: RouteRequest, remaining_s: float | None, scope: trio.CancelScope, handed: _Handed
    ) -> None:
        calls, handle = self._calls, self._handle
        if self._closing or calls is None or handle is None:
            handed.settle(outcome.Error(HostStopped("the router host is stopping")))
            return
        sent_at = handed.sent_at
        routing: tuple[float, float] | None = None
        try:
            check_fields(request)
        except BadRequest:
            pass  # the router answers it bad_request; nothing here may read its fields
        else:
            arrived = time.monotonic()
            # The request's own min(budget, cap) in seconds from route(), before a caller's deadline joins it.
            routing = (sent_at, budget_deadline(request.budget_ms, 0.0, self._config.router.budget_cap_ms))
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
            calls.start_soon(self._call, handle, request, routing, scope, handed)
        except RuntimeError:  # the calls' nursery closed as the router stopped
            handed.settle(outcome.Error(HostStopped("the router host has stopped")))
            return
        with self._counts_lock:
            self._handed += 1

    @staticmethod
    async def _call(
        handle: RouterHandle,
        request: RouteRequest,
        routing: tuple[float, float] | None,
        scope: trio.CancelScope,
        handed: _Handed,
    ) -> None:
        # The budget counts from route(): the hop to this thread and the wait for this task to start
        # are already spent. (None: a request whose fields cannot be read, which the router refuses.)
        if routing is not None:
            sent_at, routing_s = routing
            request = replace(request, budget_ms=budget_left_ms(routing_s, sent_at, time.monotonic()))

        # Cancelled by its caller (who no longer waits) or by a crashing router: HostStopped.
        with scope:
            await deliver_outcome(
                partial(handle.route, request), handed.settle, HostStopped("the route call was cancelled")
            )


class _Handed(HeldPlace):
    """A call handed to the trio thread: its future, and its place in the gate (``HeldPlace``): freed
    by its caller when it resumes with the outcome, or, if the caller gave up waiting first, by the
    trio thread when it settles the outcome, since only then is the router done with the call."""

    __slots__ = ("_gate", "_left_s", "decided", "future", "loop", "sent_at", "settled_at")

    def __init__(
        self, gate: HandOffGate, loop: asyncio.AbstractEventLoop, sent_at: float, left_s: float | None
    ) -> None:
        super().__init__()
        self._gate = gate
        self._left_s = left_s  # None: unreadable, the router refuses it
        self.loop = loop
        self.future: asyncio.Future[RouteDecision] = loop.create_future()
        self.sent_at = sent_at  # time.monotonic() at route()
        self.settled_at: float | None = None  # written by the trio thread before it settles ``future``
        self.decided = False  # and whether it settles it with a decision

    def settle(self, result: outcome.Outcome[RouteDecision]) -> None:
        """From the trio thread, once: the outcome, on its way to the caller's loop."""
        self.settled_at = time.monotonic()  # the answer's way back starts here
        self.decided = isinstance(result, outcome.Value)
        self.router_done()
        if not settle_on_loop(self.loop, self.future, result):
            # The caller's loop was closed with this call pending: it never resumes to free the place,
            # and places so held, once the in-flight limit's worth, shed every later call from any loop.
            self.give_up()

    def time_out(self, waited_s: float) -> None:
        """On the caller's loop, when the answer's wait ends: ``AnswerTimeout``, unless it came."""
        if not self.future.done():
            message = f"no decision from the router's thread within {waited_s * 1000:.1f} ms"
            self.future.set_exception(AnswerTimeout(message))

    def _release_unanswered(self, gave_up_at: float) -> None:
        settled_at, left_s = self.settled_at, self._left_s
        if settled_at is None or left_s is None or settled_at - self.sent_at > left_s:
            self._release(answered=False, at=gave_up_at)  # the router was late for it
        elif self.decided:  # its caller left first, and the router answered in time: its pace
            self._release(answered=True, at=settled_at)
        else:  # its caller left (a user's abort), and the router dropped the call in time: nothing learnt
            self._gate.withdrawn()

    def resumed(self, *, decided: bool) -> None:
        """From the caller's loop, the outcome in hand (``decided``: a decision, not an error); or closed
        unresumed (its loop closed: a ``GeneratorExit``), the place perhaps freed already."""
        if not self.take_the_place_back():
            return
        if decided:
            self._release(answered=True)
        else:  # refused or failed: nothing learnt of the router's pace
            self._gate.withdrawn()

    def _release(self, *, answered: bool, at: float | None = None) -> None:
        """A decision that reached its caller, or one its caller no longer waited for (too late for it:
        the congestion signal, timed at ``at``, when the caller gave up), teaches the limit; a call with
        no time left from the start does not (the gate's rule)."""
        left_s = self._left_s
        if left_s is None:
            self._gate.withdrawn()
        else:
            self._gate.answered(handed_at=self.sent_at, had_s=left_s, answered=answered, at=at)


def _loop_time(deadline: object) -> float:
    """``route()``'s ``deadline`` as a time on the loop's clock; a ValueError naming it otherwise, as a
    bad request field is named (a caller can pass anything). -inf is long past, +inf none."""
    if isinstance(deadline, bool) or not isinstance(deadline, int | float):
        raise ValueError(f"deadline: must be a time on the loop's clock, got {type(deadline).__name__}")
    try:
        value = float(deadline)
    except OverflowError:  # an int too large for a float
        raise ValueError("deadline: an integer beyond any time on the loop's clock") from None
    if math.isnan(value):
        raise ValueError("deadline: NaN is no time on the loop's clock")
    return value


def _as_is(request: RouteRequest) -> RouteRequest:
    return request


def _request_id(request: RouteRequest) -> str:
    return request.request_id
