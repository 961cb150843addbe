"""actors.inbox.Alarm under MockClock: a rung alarm's credit always comes with its message."""

from __future__ import annotations

import trio
import trio.testing

from actors.inbox import Alarm


async def test_an_alarm_cancelled_as_it_gets_its_credit_still_delivers_the_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The credit (a place in the inbox) is handed to the rung alarm and its task is cancelled before it
    runs again: the message must be in the inbox, else the credit is never given back (one place
    fewer in the owner's inbox for good)."""
    send, receive = trio.open_memory_channel[str](1)
    credits = trio.Semaphore(1)
    await credits.acquire()  # another sender holds the only credit
    alarm = Alarm(send, "due", credits)
    async with trio.open_nursery() as nursery:
        await nursery.start(alarm.run)
        alarm.set(trio.current_time())
        await trio.testing.wait_all_tasks_blocked()  # rung, parked for a credit
        credits.release()  # the credit goes to the alarm's task ...
        nursery.cancel_scope.cancel()  # ... which is cancelled before it runs again
    assert receive.receive_nowait() == "due"
    assert credits.value == 0  # the credit rides with the message: the owner gives it back on receipt
