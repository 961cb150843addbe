"""Large upstream replies are decoded off the routing thread (``router.transport.clients.decoded``): a
KVCM answer near the message cap, or a worker reporting many tasks, took up to a second of Python on
the trio thread. Small ones decode at once."""

from __future__ import annotations

import threading

import trio
import trio.lowlevel

from router.transport.clients import LARGE_REPLY_BYTES, decoded


async def test_a_small_reply_decodes_on_the_trio_thread_and_a_large_one_on_another() -> None:
    threads = trio.CapacityLimiter(1)
    here = threading.get_ident()
    assert await decoded(threading.get_ident, LARGE_REPLY_BYTES, threads) == here
    assert await decoded(threading.get_ident, LARGE_REPLY_BYTES + 1, threads) != here


async def test_a_large_decode_leaves_the_trio_thread_free_for_other_tasks() -> None:
    """While a large reply decodes, other tasks run: the decoding waits on an event only another trio
    task sets, which an inline decode would never let run."""
    released = threading.Event()

    def decode_reply() -> bool:
        return released.wait(10.0)

    async def release_soon() -> None:
        await trio.lowlevel.checkpoint()
        released.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_soon)
        assert await decoded(decode_reply, 10 * LARGE_REPLY_BYTES, trio.CapacityLimiter(1))
