"""Request/reply over an actor's bounded inbox, waited for only within the caller's own deadline.

The caller puts an :class:`Ask` in the owner's inbox (``send_nowait``; ``await send`` when the
inbox is full) and waits for the owner to :meth:`Ask.answer` it. A caller that leaves first (its
deadline passed, or it was cancelled) marks the ask ``abandoned``; the owner skips abandoned asks
and ``on_abandoned`` lets the caller undo what an answer it never took would have left behind
(a trial slot, a lease). Fire-and-forget reports need none of this: they are ``send_nowait``,
dropped and counted by the actor when its inbox is full.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import trio

T = TypeVar("T")
M = TypeVar("M")


class Ask(Generic[T]):
    """One request to an actor; ``reply`` is set by the owner before ``done`` fires."""

    __slots__ = ("abandoned", "done", "reply")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: T | None = None
        self.abandoned = False

    def answer(self, reply: T) -> None:
        """Called by the owner's task only."""
        self.reply = reply
        self.done.set()


async def ask(
    send: trio.MemorySendChannel[Any], message: Ask[T], on_abandoned: Callable[[T], None] | None = None
) -> T:
    """Send ``message`` to the owner and wait for its reply, both under the caller's deadline.

    When the caller leaves after the owner answered, ``on_abandoned(reply)`` undoes the answer.
    """
    try:
        try:
            send.send_nowait(message)  # the common case: room in the inbox, no extra schedule point
        except trio.WouldBlock:
            await send.send(message)
        await message.done.wait()
    except BaseException:
        message.abandoned = True
        if message.reply is not None and on_abandoned is not None:
            on_abandoned(message.reply)
        raise
    reply = message.reply
    assert reply is not None  # set before done fires
    return reply


class Alarm:
    """A wake-up at a time the owner sets, delivered into the owner's inbox as ``message``, so the
    owner's loop waits on its inbox alone instead of entering a cancel scope for every batch.

    ``run`` is a child task of the owner's ``run``; ``set`` is called by the owner only. With
    ``credits``, the alarm takes one before it sends, like every other sender to that inbox.
    """

    def __init__(
        self, send: trio.MemorySendChannel[Any], message: object, credits: trio.Semaphore | None = None
    ) -> None:
        self._send = send
        self._message = message
        self._credits = credits
        self._at = math.inf
        self._scope: trio.CancelScope | None = None

    def set(self, at: float) -> None:
        """Ring at trio time ``at`` (inf: not at all), replacing the time set before."""
        if at != self._at:
            self._at = at
            if self._scope is not None:
                self._scope.deadline = at

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                with trio.CancelScope(deadline=self._at) as scope:
                    self._scope = scope
                    await trio.sleep_forever()
                self._scope = None
                self._at = math.inf  # rung: the owner sets the next time when it takes the message
                if self._credits is not None:
                    await self._credits.acquire()
                    # A credit is a place in the inbox, so this never waits: no checkpoint between the
                    # two where a cancellation would keep the credit from ever being given back.
                    self._send.send_nowait(self._message)
                else:
                    await self._send.send(self._message)
        finally:
            self._scope = None


def take_queued(receive: trio.MemoryReceiveChannel[M]) -> list[M]:
    """Every message waiting in an inbox now, without waiting: what a stopped actor still owes an
    answer, or keeps for its next run (put back, they find the room they left)."""
    queued: list[M] = []
    while True:
        try:
            queued.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return queued
