"""Admission where requests are received, before the hop to the routing thread.

The sidecar's gRPC handler threads and the asyncio host's callers' loops hand each request to the
trio thread that routes it. A hand-off costs that thread a callback and a task: under a storm the
hand-offs queue there, and every answer, ``overloaded`` ones included, comes after its deadline.
Both ways in therefore decide on their own thread, from what the router publishes
(:class:`~actors.router_actor.OverloadAnswers`), whether to hand a request over at all:

- :class:`HandOffGate` counts the requests handed to the router and not yet answered, under an
  :class:`~router.admission.InFlightLimit` that learns from how late they come back;
- a request it turns away is answered at once with one of the published ``overloaded`` answers;
- :class:`ShedRecords` queues those answers to be counted and recorded on the routing thread later,
  in batches: a storm of them wakes that thread once per batch, not once per shed.

Both are thread-safe: any number of receiving threads use them at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Generic, TypeVar

import trio

from actors.router_actor import RouterActor
from router.admission import InFlightLimit
from router.types import RouteDecision, RouteRequest, WorkerAddr

M = TypeVar("M")  # a request as its way in received it

# Sheds are recorded on the trio thread in batches at most this long after the first of them (the
# metrics and the decision log see them that much later); each batch costs one wakeup of the thread.
SHED_RECORD_BATCH_S = 0.005
# Sheds answered and not yet recorded at most: a trio thread stalled under a shed storm leaves the
# ones beyond unrecorded (counted by the way in); each holds its whole request.
SHED_RECORDS_MAX = 4096
SHED_RECORD_TURN = 64  # sheds recorded between two checkpoints of the routing thread
INITIAL_IN_FLIGHT_LIMIT = 16  # requests handed to the router at once before any has been answered


class HandOffGate:
    """The requests handed to the router and not yet answered, under a learnt in-flight limit.

    A request that finds the limit reached may wait (without the GIL) for a place, at most
    ``waiters`` requests at once: under a closed loop a request answered ``overloaded`` at once comes
    back at once, and the sheds then take the CPU the routed requests need; a waiting request costs
    nothing until a routed one is answered. A caller on an event loop must never wait (``wait_s`` 0)."""

    def __init__(self, limit: InFlightLimit, *, waiters: int) -> None:
        self._lock = threading.Lock()
        self._place_freed = threading.Condition(self._lock)
        self._limit = limit
        self._max_waiters = waiters
        self._in_router = 0  # handed to the router and not yet answered
        self._in_router_peak = 0  # the most there since the last answer: what that answer shared it with
        self._waiting = 0  # waiting for a place in the router
        self._waited = 0
        self._shed_after_wait = 0

    def hand_off(self, wait_s: float) -> bool:
        """Count a request handed to the router, waiting at most ``wait_s`` for the in-flight limit to
        leave a place; False (nothing counted) when none came."""
        with self._lock:
            if self._limit.has_place(self._in_router, time.monotonic()):
                self._enter()
                return True
            if wait_s <= 0.0 or self._waiting >= self._max_waiters:
                return False
            self._waiting += 1
            self._waited += 1
            try:
                return self._wait_for_place(time.monotonic() + wait_s)
            finally:
                self._waiting -= 1

    def _wait_for_place(self, until: float) -> bool:
        # Holding the lock; woken by an answer, or when the limit's idle time below one ends.
        limit = self._limit
        while True:
            now = time.monotonic()
            if limit.has_place(self._in_router, now):
                self._enter()
                return True
            if now >= until:
                self._shed_after_wait += 1
                if not self._in_router:
                    # Below one place, one waiter is woken for the idle time's end: leaving without
                    # the place, it passes the wake-up on, or the next sleeps while the router is empty.
                    self._place_freed.notify()
                return False
            wake = until if self._in_router else min(until, max(limit.idle_until, now))
            self._place_freed.wait(max(0.0, wake - now))

    def hand_off_anyway(self) -> None:
        """Count a request handed to the router whatever the limit (one that must reach it: it names
        roles, or nothing has been published to shed it with)."""
        with self._lock:
            self._enter()

    def _enter(self) -> None:  # holding the lock
        self._in_router += 1
        self._in_router_peak = max(self._in_router_peak, self._in_router)

    def in_router(self) -> int:
        return self._in_router  # one int read: no lock needed for a momentary view

    def answered(
        self, *, handed_at: float, had_s: float, answered: bool, crowded: bool = False, at: float | None = None
    ) -> None:
        """A request handed to the router at ``handed_at`` (``time.monotonic()``) with ``had_s`` to
        spare came back now (``answered`` False: it did not; ``crowded``: see ``InFlightLimit.observe``).
        ``at``: when its caller stopped waiting, for one whose place was kept until the router was done
        with it: the call's time is what the caller waited, or one stall's length would set how long the
        router is then left idle below one place. A request with no time to spare from the start
        (``had_s`` ≤ 0: one naming roles goes to the router anyway) says nothing of the router's pace:
        however fast it came back it would count as late, and shrink the limit."""
        if had_s <= 0:
            self.withdrawn()
            return
        with self._lock:
            self._limit.observe(
                handed_at=handed_at,
                now=time.monotonic() if at is None else at,
                had_s=had_s,
                in_router=max(self._in_router_peak, self._in_router),
                answered=answered,
                crowded=crowded,
            )
            self._in_router -= 1
            self._in_router_peak = self._in_router
            self._wake_waiters()

    def withdrawn(self) -> None:
        """A request handed to the router whose caller gave up on it: its place is free, and it says
        nothing of the router's pace."""
        with self._lock:
            self._in_router -= 1
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        if self._waiting:
            # Whole places for waiters; below one, one waiter learns when the idle time ends.
            self._place_freed.notify(max(1, self._limit.limit - self._in_router))

    def waits(self) -> tuple[int, int]:
        """Requests that found the limit reached and waited for a place, and of them those that got
        none in the time they could wait."""
        with self._lock:
            return self._waited, self._shed_after_wait


class HeldPlace:
    """A call handed to the router keeps its place in the gate until the router is done with it: when
    its caller stops waiting first (its deadline, a cancel), the place is freed once the router
    settles the call, else by the caller on resuming. A subclass's ``_release_unanswered`` frees it as
    unanswered, given when the caller gave up (``time.monotonic()``): the call's time is what its
    caller waited. (A method, not a stored callable: one bound to the call would make each call a
    reference cycle, freed only by the collector.)"""

    __slots__ = ("_freed", "_gave_up_at", "_lock", "_settled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gave_up_at: float | None = None
        self._settled = False
        # Whichever path frees the place takes this first: a caller giving up, then its loop closing as
        # the router settled, freed it twice, and the gate's count went below the calls in the router.
        self._freed = False

    def router_done(self) -> None:
        """From the routing thread, once, as it settles the call."""
        with self._lock:
            self._settled = True
            gave_up_at = self._gave_up_at
            free = gave_up_at is not None and self._take_the_freeing()
        if free:
            assert gave_up_at is not None
            self._release_unanswered(gave_up_at)

    def give_up(self) -> None:
        """From the caller, which stops waiting (again, harmlessly: the first time counts): the place is
        freed now if the router is done with the call, else when it is."""
        now = time.monotonic()
        with self._lock:
            if self._gave_up_at is None:
                self._gave_up_at = now
            gave_up_at = self._gave_up_at
            free = self._settled and self._take_the_freeing()
        if free:
            self._release_unanswered(gave_up_at)

    def take_the_place_back(self) -> bool:
        """For a caller resuming with its outcome: True, once, when no other path has freed the place."""
        with self._lock:
            return self._take_the_freeing()

    def _take_the_freeing(self) -> bool:
        """Under ``_lock``: True the first time only."""
        if self._freed:
            return False
        self._freed = True
        return True

    def _release_unanswered(self, gave_up_at: float) -> None:
        raise NotImplementedError


class ShedRecords(Generic[M]):
    """Sheds answered on receiving threads, waiting to be counted and recorded on the routing thread.

    ``add`` (any thread) queues one; the first since the last recording wakes the trio thread, which
    records everything queued by then ``SHED_RECORD_BATCH_S`` later, ``SHED_RECORD_TURN`` at a time
    with a checkpoint between turns (with the decision log on, each record converts its request).
    ``convert`` turns a received request into the router's; it runs only where a record keeps it."""

    def __init__(self, convert: Callable[[M], RouteRequest], request_id: Callable[[M], str]) -> None:
        self._convert = convert
        self._request_id = request_id
        # Each: the request, the answer drawn, the elapsed ms, the time the request had left and its
        # prompt's length (charged to the worker the answer names).
        self._queue: deque[tuple[M, RouteDecision, float, float, int]] = deque()
        self._due = False
        # Set on the trio thread by open(); read by receiving threads.
        self._token: trio.lowlevel.TrioToken | None = None
        self._router: RouterActor | None = None
        self._nursery: trio.Nursery | None = None

    def open(self, router: RouterActor, nursery: trio.Nursery) -> None:
        """Start recording into ``router``, the batch tasks in ``nursery``. Call from the trio thread."""
        self._router = router
        self._nursery = nursery
        self._token = trio.lowlevel.current_trio_token()

    def close(self) -> None:
        """Record what is queued now; a shed added later is recorded as it comes. Call from the trio
        thread as ``nursery`` closes."""
        self._nursery = None
        self.record()

    def add(self, message: M, drawn: RouteDecision, elapsed_ms: float, left_s: float, tokens: int) -> bool:
        """Queue one shed (``drawn``, the published answer it was given, ``elapsed_ms`` after receipt,
        with ``left_s`` to go); False: SHED_RECORDS_MAX are waiting, and this one is not recorded."""
        # Length and append are two steps: threads racing past a full queue overshoot it by one each
        # at most, still a bound.
        if len(self._queue) >= SHED_RECORDS_MAX:
            return False
        self._queue.append((message, drawn, elapsed_ms, left_s, tokens))
        if not self._due:  # a lost race costs one empty recording, never a missed one
            self._due = True
            token = self._token
            if token is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(self._record_soon)
        return True

    def pending(self) -> int:
        return len(self._queue)

    def _record_soon(self) -> None:
        """Runs in the trio thread (run_sync_soon), woken by the first shed since the last recording."""
        nursery = self._nursery
        if nursery is not None:
            try:
                nursery.start_soon(self._record_after_batch)
                return
            except RuntimeError:  # the nursery closed as the way in stopped at once: record now
                pass
        self.record()

    async def _record_after_batch(self) -> None:
        try:
            await trio.sleep(SHED_RECORD_BATCH_S)
            # One recorder at a time: the flag stays up until the queue is found empty, then the queue
            # is looked at once more (a shed added between the two found the flag up and started none).
            while True:
                if not self.record(SHED_RECORD_TURN):
                    self._due = False
                    if not self._queue:
                        break
                await trio.lowlevel.checkpoint()
        finally:  # also when the way in stops at once: a shed answered is a shed recorded
            self.record()

    def record(self, most: int | None = None) -> bool:
        """Record the queued sheds, ``most`` of them at most (None: all); True when some are left.
        Call from the trio thread."""
        router = self._router
        if router is None:
            return bool(self._queue)
        if most is None:
            self._due = False
        now = trio.current_time()
        recorded = 0
        # Charged in a sum per worker: the answers were drawn among a few (OVERLOAD_DRAWS).
        sent: dict[WorkerAddr, tuple[int, int]] = {}  # tokens and requests per worker
        try:
            while most is None or recorded < most:
                try:
                    message, drawn, elapsed_ms, left_s, tokens = self._queue.popleft()
                except IndexError:
                    return False
                decision = drawn.answering(self._request_id(message), elapsed_ms)
                router.record_shed(partial(self._convert, message), decision, now + left_s)
                if decision.worker is not None:
                    charged, requests = sent.get(decision.worker, (0, 0))
                    sent[decision.worker] = (charged + tokens, requests + 1)
                recorded += 1
            return bool(self._queue)
        finally:
            router.charge_sheds(sent)

