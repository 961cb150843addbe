"""The hand-off gate both ways in share: the requests handed to the router under the learnt in-flight
limit, with the real threads that wait on it (no clock is read by the assertions); and the sheds they
answer, recorded on the routing thread."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable, Mapping
from typing import cast

import outcome
import trio
import trio.testing

from actors.router_actor import RouterActor
from router.admission import InFlightLimit
from router.asyncio_host import _Handed
from router.config import RouterConfig
from router.receipt import HandOffGate, ShedRecords
from router.types import Reason, RouteDecision, RouteRequest, RouteSource, WorkerAddr


class _WaitSeen(threading.Condition):
    """A condition that tells when a thread first waits on it."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.entered = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.entered.set()
        return super().wait(timeout)


def _gate(*, waiters: int) -> HandOffGate:
    return HandOffGate(InFlightLimit(initial=1, ceiling=1, floor=RouterConfig().admission_duty_floor), waiters=waiters)


def test_a_call_that_finds_the_limit_reached_waits_for_the_place_an_answer_frees() -> None:
    gate = _gate(waiters=1)
    assert gate.hand_off(0.0)  # the one place
    place_freed = gate._place_freed = _WaitSeen(gate._lock)  # the waiter waits on it for a place
    placed: list[bool] = []
    waiter = threading.Thread(target=lambda: placed.append(gate.hand_off(60.0)))
    waiter.start()
    try:
        assert place_freed.entered.wait(10.0), "the call never waited for a place"
        assert gate.waits() == (1, 0)
        assert not gate.hand_off(60.0)  # beyond the waiters' bound: answered at once
        assert placed == []
        gate.answered(handed_at=time.monotonic(), had_s=60.0, answered=True)
    finally:
        waiter.join(timeout=60.0)
    assert placed == [True]
    assert gate.in_router() == 1  # the waiter took the freed place
    assert not gate.hand_off(0.0)  # no time to wait: answered at once
    assert not gate.hand_off(0.001)  # nothing is answered meanwhile: the wait ends in a shed
    assert gate.waits() == (2, 1)


def test_with_no_waiters_allowed_a_full_router_sheds_at_once() -> None:
    gate = _gate(waiters=0)
    assert gate.hand_off(60.0)
    assert not gate.hand_off(60.0)
    assert gate.waits() == (0, 0)


def test_an_answer_in_time_grows_the_limit_only_if_the_router_held_as_many_since_the_answer_before() -> None:
    gate = HandOffGate(InFlightLimit(initial=2, ceiling=8, floor=RouterConfig().admission_duty_floor), waiters=0)
    share = gate._limit.share
    assert gate.hand_off(0.0)
    gate.answered(handed_at=time.monotonic(), had_s=60.0, answered=True)  # alone in two places
    assert gate._limit.share == share
    assert gate.hand_off(0.0) and gate.hand_off(0.0)
    gate.answered(handed_at=time.monotonic(), had_s=60.0, answered=True)  # both places held
    assert gate._limit.share == share + 1 / share
    share = gate._limit.share
    # One in the router since that answer: the next answer says nothing of two at once.
    gate.answered(handed_at=time.monotonic(), had_s=60.0, answered=True)
    assert gate._limit.share == share
    assert gate.hand_off(0.0) and gate.hand_off(0.0)
    gate.withdrawn()  # a place held meanwhile counts, though its call left without an answer
    gate.answered(handed_at=time.monotonic(), had_s=60.0, answered=True)
    assert gate._limit.share == share + 1 / share
    assert gate.in_router() == 0


def test_a_withdrawn_call_frees_its_place_and_leaves_the_limit_as_it_was() -> None:
    """A caller giving up says nothing of the router's pace: an answer that never came would shrink
    the limit (as a late one does), a withdrawal does not."""
    late = _gate(waiters=0)
    assert late.hand_off(0.0)
    late.answered(handed_at=time.monotonic(), had_s=60.0, answered=False)
    assert late._limit.share < 1.0  # shrunk below one: a duty cycle

    gate = _gate(waiters=0)
    assert gate.hand_off(0.0)
    assert not gate.hand_off(0.0)
    gate.withdrawn()
    assert gate.in_router() == 0 and gate._limit.share == 1.0
    assert gate.hand_off(0.0)  # the place is free again at once


def test_a_withdrawal_wakes_a_waiter() -> None:
    gate = _gate(waiters=1)
    assert gate.hand_off(0.0)
    place_freed = gate._place_freed = _WaitSeen(gate._lock)
    placed: list[bool] = []
    waiter = threading.Thread(target=lambda: placed.append(gate.hand_off(60.0)))
    waiter.start()
    try:
        assert place_freed.entered.wait(10.0), "the call never waited for a place"
        gate.withdrawn()
    finally:
        waiter.join(timeout=60.0)
    assert placed == [True] and gate.in_router() == 1


class _WaitsSeen(threading.Condition):
    """A condition that counts the threads waiting on it."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.waits = 0
        self.second = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.waits >= 2:
            self.second.set()
        return super().wait(timeout)


def test_below_one_place_a_waiter_leaving_without_it_passes_the_wake_up_on() -> None:
    """One late answer leaves the limit below one: the router stays empty for a short idle time, and
    one waiter is woken for its end. That one's own wait ends first; it leaves without the place and
    must wake the next, or the next sleeps through the idle time's end while the router is empty."""
    gate = _gate(waiters=2)
    assert gate.hand_off(0.0)
    waits = gate._place_freed = _WaitsSeen(gate._lock)
    placed: dict[str, bool] = {}
    impatient = threading.Thread(target=lambda: placed.setdefault("impatient", gate.hand_off(0.1)))
    patient = threading.Thread(target=lambda: placed.setdefault("patient", gate.hand_off(60.0)))
    impatient.start()
    patient.start()
    try:
        assert waits.second.wait(10.0), "the calls never waited for a place"
        now = time.monotonic()
        # Late: idle (1/0.9 − 1) × 18 s = 2 s, long past the impatient call's 0.1 s however slow the
        # machine (a thread descheduled past the idle time's end would rightly take the place).
        gate.answered(handed_at=now - 18.0, had_s=0.1, answered=True)
        impatient.join(timeout=10.0)
        patient.join(timeout=10.0)  # a guard against a hang: without the pass-on it sleeps its whole 60 s
    finally:
        gate.withdrawn()  # ends a patient call still waiting, when it failed
        patient.join()
    assert placed == {"impatient": False, "patient": True}


def test_a_call_given_up_on_is_timed_to_when_its_caller_gave_up_not_to_the_routers_settling() -> None:
    """Its place is kept until the router is done with it, but its time is what its caller waited:
    timed to the settling, one stall's length would leave the router idle for many times that."""
    gate = _gate(waiters=0)
    assert gate.hand_off(0.0)
    handed_at = time.monotonic() - 2.0  # handed two seconds ago, given up after 0.1 s, settled now
    gate.answered(handed_at=handed_at, had_s=0.05, answered=False, at=handed_at + 0.1)
    assert gate._limit.share < 1.0 and gate._limit.idle_until < time.monotonic()


def test_a_held_place_makes_no_reference_cycle() -> None:
    """Each routed call makes one: a call bound to itself would be freed only by the collector."""
    loop = asyncio.new_event_loop()
    gate = _gate(waiters=0)
    try:
        gc.collect()  # no _Handed of an earlier test left
        gc.disable()
        try:
            handed = _Handed(gate, loop, time.monotonic(), 0.05)
            handed.give_up()
            del handed
            # Freed by its reference count alone (other threads' garbage does not matter here).
            assert not any(type(o) is _Handed for o in gc.get_objects())
        finally:
            gc.enable()
    finally:
        loop.close()


def test_a_call_the_router_settled_before_its_caller_gave_up_frees_its_place_at_the_give_up() -> None:
    """The router may settle a call just before its caller stops waiting (its deadline, a cancel): the
    caller then never resumes with the outcome, and the give-up is the last chance to free the place."""
    loop = asyncio.new_event_loop()
    gate = _gate(waiters=0)
    try:
        gate.hand_off_anyway()
        handed = _Handed(gate, loop, time.monotonic(), 60.0)
        handed.settle(outcome.Value(cast(RouteDecision, object())))  # the routing thread is done with it
        assert gate.in_router() == 1  # the caller may still resume with it
        handed.give_up()
        assert gate.in_router() == 0
        assert gate.hand_off(0.0)  # the one place is free again
    finally:
        loop.close()


class _RecordingRouter:
    """What the shed records give the router: each shed recorded, and the charges summed per worker."""

    def __init__(self) -> None:
        self.recorded: list[tuple[str, float]] = []  # request id, deadline
        self.charged: dict[WorkerAddr, tuple[int, int]] = {}

    def record_shed(self, request: Callable[[], RouteRequest], decision: RouteDecision, deadline: float) -> None:
        assert request().request_id == decision.request_id
        self.recorded.append((decision.request_id, deadline))

    def charge_sheds(self, sent: Mapping[WorkerAddr, tuple[int, int]]) -> None:
        for worker, (tokens, requests) in sent.items():
            charged, counted = self.charged.get(worker, (0, 0))
            self.charged[worker] = (charged + tokens, counted + requests)


async def test_sheds_are_recorded_with_their_deadline_and_charged_to_their_worker_by_prompt_length(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A shed answered off the routing thread is charged to the worker its answer names as the router
    charges its own: the prompt's tokens and one request each (uncharged, sheds pile onto the workers
    the drawn answers name); an answer naming no worker charges nobody. Its record's deadline is the
    time it had to go, not the moment it is recorded."""
    a, b = WorkerAddr("10.0.0.1", 8000, 8001, 8001), WorkerAddr("10.0.0.2", 8000, 8001, 8001)

    def overloaded(worker: WorkerAddr | None) -> RouteDecision:
        source = RouteSource.NONE if worker is None else RouteSource.DOMAIN
        return RouteDecision("", worker, None, source, Reason.OVERLOADED)

    router = _RecordingRouter()
    sheds: ShedRecords[RouteRequest] = ShedRecords(lambda request: request, lambda request: request.request_id)
    async with trio.open_nursery() as nursery:
        sheds.open(cast(RouterActor, router), nursery)
        for request_id, worker, left_s, tokens in [
            ("a1", a, 0.25, 100),
            ("b1", b, 0.5, 30),
            ("a2", a, 0.75, 50),
            ("none", None, 1.0, 70),
        ]:
            assert sheds.add(RouteRequest(request_id), overloaded(worker), 1.0, left_s, tokens)
        now = trio.current_time()
        sheds.close()  # records what is queued, now
    assert router.recorded == [("a1", now + 0.25), ("b1", now + 0.5), ("a2", now + 0.75), ("none", now + 1.0)]
    assert router.charged == {a: (150, 2), b: (30, 1)}
