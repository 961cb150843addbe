"""Exception-group leaves and the one-outcome hand-off to a future another thread waits on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import outcome
import pytest
import trio
import trio.testing

from router.exception_groups import leaves, sole_leaf
from router.thread_bridge import answer_within, deliver_outcome, settle, settle_on_loop


def test_leaves_flatten_nested_groups_in_order() -> None:
    a, b, c = ValueError("a"), KeyError("b"), OSError("c")
    nested = BaseExceptionGroup("outer", [ExceptionGroup("inner", [a, b]), c])
    assert leaves(nested) == [a, b, c]
    assert leaves(a) == [a]


def test_sole_leaf_is_the_one_error_or_none() -> None:
    a = ValueError("a")
    assert sole_leaf(BaseExceptionGroup("x", [ExceptionGroup("y", [a])])) is a
    assert sole_leaf(a) is a
    assert sole_leaf(ExceptionGroup("two", [a, KeyError("b")])) is None


def test_settle_a_concurrent_future_with_a_value_or_an_error() -> None:
    value: concurrent.futures.Future[int] = concurrent.futures.Future()
    settle(value, outcome.Value(7))
    assert value.result(timeout=0) == 7
    failed: concurrent.futures.Future[int] = concurrent.futures.Future()
    error = RuntimeError("boom")
    settle(failed, outcome.Error(error))
    assert failed.exception(timeout=0) is error


def test_settle_drops_the_outcome_when_the_waiter_cancelled_or_was_answered_first() -> None:
    gone: concurrent.futures.Future[int] = concurrent.futures.Future()
    assert gone.cancel()
    settle(gone, outcome.Value(7))  # no InvalidStateError: nobody waits
    assert gone.cancelled()

    loop = asyncio.new_event_loop()
    try:
        future: asyncio.Future[int] = loop.create_future()
        future.cancel()
        settle(future, outcome.Value(7))
        assert future.cancelled()
        answered: asyncio.Future[int] = loop.create_future()
        settle(answered, outcome.Value(3))
        assert answered.result() == 3
        settle(answered, outcome.Value(4))  # answered first (the host's timer): kept, no InvalidStateError
        assert answered.result() == 3
    finally:
        loop.close()



class _CancelledJustAfterALook(concurrent.futures.Future[int]):
    """A waiter whose cancel, from its own thread, lands right after any look at whether the future
    is cancelled or done: between a look and a set, where it can always land."""

    def cancelled(self) -> bool:
        looked = super().cancelled()
        self.cancel()
        return looked

    def done(self) -> bool:
        looked = super().done()
        self.cancel()
        return looked


def test_settle_takes_a_concurrent_future_atomically_against_its_waiters_cancel() -> None:
    """A look, then a set, raised InvalidStateError on the trio thread when the cancel came between."""
    future = _CancelledJustAfterALook()
    settle(future, outcome.Value(7))
    assert future.result(timeout=0) == 7  # settled first: the later cancel finds it running, and fails

def test_settle_on_loop_reaches_a_running_loop_from_another_thread_and_a_closed_one_is_a_no_op() -> None:
    async def waiter() -> int:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        threading.Thread(target=settle_on_loop, args=(loop, future, outcome.Value(5))).start()
        return await asyncio.wait_for(future, 5)

    assert asyncio.run(waiter()) == 5
    loop = asyncio.new_event_loop()
    orphan: asyncio.Future[int] = loop.create_future()
    loop.close()
    settle_on_loop(loop, orphan, outcome.Value(1))  # nobody waits on a closed loop: no RuntimeError
    assert not orphan.done()


async def test_deliver_outcome_hands_over_the_value_or_the_error_once() -> None:
    got: list[outcome.Outcome[int]] = []

    async def seven() -> int:
        return 7

    async def broken() -> int:
        raise ValueError("bad")

    await deliver_outcome(seven, got.append, RuntimeError("cancelled"))
    await deliver_outcome(broken, got.append, RuntimeError("cancelled"))
    assert len(got) == 2
    assert got[0] == outcome.Value(7)
    assert isinstance(got[1], outcome.Error) and isinstance(got[1].error, ValueError)


async def test_a_deliver_that_raises_is_not_called_again_with_the_cancelled_error() -> None:
    """The outcome was marked delivered only after ``deliver`` returned: one that raised (a future
    settled twice) was called again with ``cancelled``, telling its caller the call was cancelled after
    its value, and that second raise replaced the first."""
    got: list[outcome.Outcome[int]] = []

    def refuses(result: outcome.Outcome[int]) -> None:
        got.append(result)
        raise RuntimeError("already settled")

    async def seven() -> int:
        return 7

    with pytest.raises(RuntimeError, match="already settled"):
        await deliver_outcome(seven, refuses, ValueError("cancelled"))
    assert got == [outcome.Value(7)]


async def test_a_cancelled_delivery_hands_over_the_cancelled_error_and_stays_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    got: list[outcome.Outcome[int]] = []
    stopped = RuntimeError("stopped")

    async def never() -> int:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    with trio.move_on_after(1) as scope:
        await deliver_outcome(never, got.append, stopped)
    assert scope.cancelled_caught
    assert len(got) == 1 and isinstance(got[0], outcome.Error) and got[0].error is stopped


class _SettledAsTheWaitEnds(concurrent.futures.Future[str]):
    """The trio thread settles it between the waiter's timeout and its cancel (``settle`` took it first)."""

    def result(self, timeout: float | None = None) -> str:
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            if self.set_running_or_notify_cancel():
                self.set_result("decided")
            raise


def test_an_answer_settled_as_the_wait_ends_is_taken_not_thrown_away() -> None:
    """The cancel after the wait's end failed, the answer was about to be set, and the waiter gave the
    call up all the same: the client got DEADLINE_EXCEEDED for a decision made in time."""
    assert answer_within(_SettledAsTheWaitEnds(), 0.0) == "decided"


def test_an_answer_that_never_came_is_cancelled_and_a_timeout_raised() -> None:
    answer: concurrent.futures.Future[str] = concurrent.futures.Future()
    with pytest.raises(concurrent.futures.TimeoutError):
        answer_within(answer, 0.0)
    assert answer.cancelled()
