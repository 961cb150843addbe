"""Answering a caller that waits in another thread for work done in the trio thread.

The caller holds a future (``concurrent.futures`` for gRPC's handler threads, ``asyncio`` for an
asyncio loop); the trio side produces exactly one outcome for it. A caller that gave up first
(cancelled its future) is not waiting any more, so its outcome is dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import TypeVar

import outcome

T = TypeVar("T")

# The router answers at most a few ms after a call's deadline; a caller in another thread waits this
# much longer for the answer before it gives the call up (only a stuck trio thread gets there).
ANSWER_SLACK_S = 0.05


def settle(future: concurrent.futures.Future[T] | asyncio.Future[T], result: outcome.Outcome[T]) -> None:
    """Complete ``future`` with ``result`` unless its waiter cancelled it first.

    A ``concurrent.futures`` future may be settled from any thread; an asyncio future only on its
    own loop (``settle_on_loop`` gets there from another thread).
    """
    if isinstance(future, concurrent.futures.Future):
        if not future.set_running_or_notify_cancel():  # atomic with a cancel from the waiting thread
            return
    elif future.done():
        return
    if isinstance(result, outcome.Value):
        future.set_result(result.value)
    else:
        assert isinstance(result, outcome.Error)
        future.set_exception(result.error)


def answer_within(answer: concurrent.futures.Future[T], timeout_s: float) -> T:
    """``answer``'s result, waited for ``timeout_s``; then it is cancelled, and TimeoutError raised. One
    being settled at that moment (``settle`` took it first, and the cancel failed) is waited for and
    returned: thrown away, the client got no answer and the decision made was counted unanswered."""
    try:
        return answer.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        if answer.cancel():
            raise
        # ``settle`` sets the result right after taking the future: it is there, or a moment away.
        return answer.result(timeout=ANSWER_SLACK_S)


def settle_on_loop(loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], result: outcome.Outcome[T]) -> bool:
    """``settle`` an asyncio future on its own loop, from any thread; False when the loop is closed (nobody
    is waiting there, nor will resume to do what a waiter does after)."""
    try:
        loop.call_soon_threadsafe(settle, future, result)
    except RuntimeError:
        return False
    return True


async def deliver_outcome(
    call: Callable[[], Awaitable[T]], deliver: Callable[[outcome.Outcome[T]], None], cancelled: Exception
) -> None:
    """Await ``call`` and hand its outcome to ``deliver`` exactly once.

    The caller gets the call's value or its error (an ``Exception``; the trio side keeps serving);
    if this task is cancelled first, it gets ``cancelled`` and the cancellation goes on.
    """
    try:
        result: outcome.Outcome[T] = outcome.Value(await call())
    except Exception as exc:
        result = outcome.Error(exc)
    except BaseException:
        deliver(outcome.Error(cancelled))
        raise
    # Once, outside the try: a deliver that raised was called again with ``cancelled`` (its caller told
    # the call was cancelled after its value), and that second raise replaced the first.
    deliver(result)
