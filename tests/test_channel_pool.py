"""ChannelPool under MockClock with a factory of fake closable channels (the pool's logic is under test).

The pool's task applies what callers report at its next step: ``settle()`` (every task blocked) is
the point where it has.
"""

from __future__ import annotations

import math
import random

import pytest
import trio
import trio.testing

from actors.channel_pool import ChannelPool, EvictReason
from router.config import ChannelPoolConfig
from router.targets import TargetError
from router.transport.errors import Unavailable


class FakeChannel:
    def __init__(self, target: str) -> None:
        self.target = target
        self.closes = 0
        self.closed_at: float | None = None

    def close(self) -> None:
        self.closes += 1
        self.closed_at = trio.current_time()


class FakeFactory:
    def __init__(self) -> None:
        self.opened: list[FakeChannel] = []

    def __call__(self, target: str) -> FakeChannel:
        channel = FakeChannel(target)
        self.opened.append(channel)
        return channel


def make_pool(
    max_channels: int = 256, idle_expiry_s: float = 60.0, inbox_size: int = 4096
) -> tuple[ChannelPool[FakeChannel], FakeFactory]:
    factory = FakeFactory()
    config = ChannelPoolConfig(max_channels=max_channels, idle_expiry_s=idle_expiry_s, inbox_size=inbox_size)
    return ChannelPool(config, factory), factory


settle = trio.testing.wait_all_tasks_blocked


# cap 8 < 16 concurrent callers: leased channels are evicted too and must drain before closing.
@pytest.mark.parametrize("cap", [8, 64])
async def test_cap_respected_with_10000_distinct_targets(autojump_clock: trio.testing.MockClock, cap: int) -> None:
    pool, factory = make_pool(max_channels=cap)
    targets = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:7000" for i in range(10_000)]
    rng = random.Random(7)
    peak_size = 0

    async def worker(mine: list[str]) -> None:
        nonlocal peak_size
        for target in mine:
            async with pool.lease(target) as channel:
                peak_size = max(peak_size, pool.snapshot().size)
                await trio.sleep(rng.random() * 0.01)  # a call in flight; other workers evict meanwhile
                assert channel.closes == 0, "a leased channel was closed"

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with trio.open_nursery() as workers:
            for k in range(16):
                workers.start_soon(worker, targets[k::16])
        await settle()
        snap = pool.snapshot()
        assert peak_size == cap  # reached, never exceeded
        assert snap.size == cap
        assert snap.opened == len(factory.opened) == 10_000
        assert snap.evicted["lru"] == 10_000 - cap
        assert snap.leased == snap.draining == snap.inbox_depth == 0
        assert snap.closed == 10_000 - cap
        assert sorted({c.closes for c in factory.opened}) == [0, 1]  # evicted ones closed exactly once
        assert sum(c.closes for c in factory.opened) == 10_000 - cap
        await pool.aclose()
    assert all(c.closes == 1 for c in factory.opened)
    assert pool.snapshot().evicted["shutdown"] == cap


async def test_idle_channel_expires_on_the_trio_clock(autojump_clock: trio.testing.MockClock) -> None:
    pool, factory = make_pool(idle_expiry_s=60.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with pool.lease("a.example:1"):
            pass
        released_a = trio.current_time()
        await trio.sleep(30)
        async with pool.lease("b.example:1"):
            pass
        released_b = trio.current_time()
        a, b = factory.opened
        await trio.sleep_until(released_a + 59.999)
        assert a.closes == 0
        await trio.sleep_until(released_a + 60.001)
        assert a.closes == 1
        assert a.closed_at == pytest.approx(released_a + 60.0)
        assert b.closes == 0
        await trio.sleep_until(released_b + 60.001)
        assert b.closed_at == pytest.approx(released_b + 60.0)
        assert pool.snapshot().evicted["idle"] == 2
        assert pool.snapshot().size == 0
        nursery.cancel_scope.cancel()


async def test_use_restarts_the_idle_clock_and_a_leased_channel_never_expires(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, factory = make_pool(idle_expiry_s=60.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with pool.lease("a.example:1"):
            await trio.sleep(200)  # a long call: leased the whole time
        (a,) = factory.opened
        assert a.closes == 0
        await trio.sleep(50)
        async with pool.lease("a.example:1"):
            pass
        released = trio.current_time()
        await trio.sleep(59)
        assert a.closes == 0
        await trio.sleep_until(released + 60.001)
        assert a.closed_at == pytest.approx(released + 60.0)
        assert len(factory.opened) == 1
        nursery.cancel_scope.cancel()


async def test_a_leased_channel_skipped_by_the_sweep_does_not_shield_the_idle_ones_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A held lease on the oldest channel must not shield the idle ones after it from expiry."""
    pool, factory = make_pool(idle_expiry_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with pool.lease("a.example:1"):
            async with pool.lease("b.example:1"):
                pass
            await trio.sleep(2.0)
            a, b = factory.opened
            assert (a.closes, b.closes) == (0, 1)
            assert pool.snapshot().evicted["idle"] == 1
        nursery.cancel_scope.cancel()


async def test_a_lease_makes_its_channel_the_most_recently_used(autojump_clock: trio.testing.MockClock) -> None:
    """At the cap a new target evicts the channel least recently leased or returned: not one leased
    since the other was returned."""
    pool, factory = make_pool(max_channels=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for target in ("a.example:1", "b.example:1"):
            async with pool.lease(target):
                pass
        async with pool.lease("a.example:1") as held_a:
            await settle()  # the task has counted the lease
            async with pool.lease("c.example:1"):
                pass
            await settle()
            a, b, _ = factory.opened
            assert held_a is a
            assert (a.closes, b.closes) == (0, 1)
            assert pool.snapshot().evicted["lru"] == 1
            async with pool.lease("a.example:1") as again:
                assert again is a  # still in the map
        nursery.cancel_scope.cancel()


async def test_evicted_channel_closes_only_when_its_last_lease_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, factory = make_pool(max_channels=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        first = pool.lease("a.example:1")
        second = pool.lease("a.example:1")
        old_a = await first.__aenter__()
        assert await second.__aenter__() is old_a
        async with pool.lease("b.example:1"), pool.lease("c.example:1"):  # evicts a (LRU) while leased twice
            pass
        await settle()
        snap = pool.snapshot()
        assert (snap.size, snap.leased, snap.draining, snap.evicted["lru"]) == (2, 2, 1, 1)
        assert old_a.closes == 0
        async with pool.lease("a.example:1") as new_a:  # a fresh channel while the old one drains
            assert new_a is not old_a
        await first.__aexit__(None, None, None)
        await settle()
        assert old_a.closes == 0
        await second.__aexit__(None, None, None)
        await settle()
        assert old_a.closes == 1
        assert pool.snapshot().draining == 0
        nursery.cancel_scope.cancel()
    # Cancelling run() (a crash or restart) closes nothing; the owner's aclose() does.
    assert [c.closes for c in factory.opened] == [1, 0, 1, 0]  # the drained a and the evicted b
    await pool.aclose()
    assert [c.closes for c in factory.opened] == [1, 1, 1, 1]


async def test_lease_is_released_when_the_caller_is_cancelled(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    pool, factory = make_pool()
    await nursery.start(pool.run)
    with trio.move_on_after(1) as scope:
        async with pool.lease("a.example:1"):
            await settle()
            assert pool.snapshot().leased == 1
            await trio.sleep_forever()
    assert scope.cancelled_caught
    await settle()
    assert pool.snapshot().leased == 0
    pool.invalidate("a.example:1")
    await settle()
    assert (pool.snapshot().draining, factory.opened[0].closes) == (0, 1)  # no lease left: closed at once
    await pool.aclose()
    assert factory.opened[0].closes == 1


async def test_invalidate_drops_the_channel_and_the_next_lease_opens_a_new_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, factory = make_pool()
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with pool.lease("Host.Example:5") as first:
            pass
        pool.invalidate("host.example:5")  # another spelling of the same normalised target
        await settle()
        assert first.closes == 1
        async with pool.lease("host.example:5") as second:
            pool.invalidate("host.example:5", first)  # a failure seen on the old channel: ignored
            await settle()
            assert pool.snapshot().size == 1
            pool.invalidate("host.example:5", second)  # dropped now, closed when released
            await settle()
            assert pool.snapshot().size == 0
            assert second.closes == 0
        await settle()
        assert second.closes == 1
        pool.invalidate("unknown.example:5")  # nothing to drop
        await settle()
        snap = pool.snapshot()
        assert (snap.opened, snap.closed, snap.evicted["invalidated"]) == (2, 2, 2)
        assert [c.target for c in factory.opened] == ["host.example:5", "host.example:5"]
        nursery.cancel_scope.cancel()


async def test_concurrent_acquire_of_one_target_opens_one_channel(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    pool, factory = make_pool()
    await nursery.start(pool.run)
    peak_leased = 0
    seen: set[int] = set()

    async def caller() -> None:
        nonlocal peak_leased
        async with pool.lease("[::1]:9000") as channel:
            seen.add(id(channel))
            await settle()
            peak_leased = max(peak_leased, pool.snapshot().leased)
            await trio.sleep(1)

    async with trio.open_nursery() as callers:
        for _ in range(100):
            callers.start_soon(caller)
    assert peak_leased == 100  # all leases overlapped ...
    assert len(factory.opened) == len(seen) == 1  # ... on one channel
    assert factory.opened[0].target == "[::1]:9000"
    async with pool.lease("[0:0::1]:9000"):  # the same address spelled differently
        assert len(factory.opened) == 1


@pytest.mark.parametrize("callers", [63, 64, 65, 200])
async def test_as_many_cold_leases_at_once_as_there_are_credits_all_get_their_channels(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, callers: int
) -> None:
    """A cold lease takes two credits in two waits: 64 takers of 64 credits each holding one would
    wait for ever for a second (every caller timed out on an idle pool)."""
    pool, factory = make_pool(inbox_size=64)
    await nursery.start(pool.run)
    leased = 0

    async def caller(i: int) -> None:
        nonlocal leased
        with trio.move_on_after(1.0):
            async with pool.lease(f"10.0.{i // 250}.{i % 250 + 1}:9000"):
                leased += 1

    async with trio.open_nursery() as taking:
        for i in range(callers):
            taking.start_soon(caller, i)
    assert leased == callers and len(factory.opened) == callers
    assert trio.current_time() < 1.0  # none waited for its deadline


@pytest.mark.parametrize("target", ["host.example:99999", "host.example", "::1:80", "bad host:1", ""])
async def test_malformed_target_is_rejected_naming_it(target: str) -> None:
    pool, factory = make_pool()
    with pytest.raises(TargetError) as info:
        async with pool.lease(target):
            pass
    assert target == "" or repr(target) in str(info.value)
    assert factory.opened == []


async def test_a_warm_lease_takes_no_hop_and_a_cold_one_waits_only_within_the_callers_deadline(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    pool, factory = make_pool()
    await nursery.start(pool.run)
    async with pool.lease("a.example:1"):
        pass
    await settle()
    with trio.CancelScope(deadline=-math.inf):  # any wait would raise Cancelled at once
        async with pool.lease("a.example:1") as warm:
            assert warm is factory.opened[0]
        with pytest.raises(trio.Cancelled):
            async with pool.lease("b.example:1"):  # cold: asks the pool's task
                pass
    await settle()
    assert len(factory.opened) == 1  # the abandoned open opened nothing
    snap = pool.snapshot()
    assert (snap.leased, snap.inbox_depth) == (0, 0)


async def test_a_stopped_task_leaves_callers_to_their_deadlines_and_full_inbox_is_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, factory = make_pool(inbox_size=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with pool.lease("a.example:1"):
            pass
        await settle()
        nursery.cancel_scope.cancel()  # the task stops (as between a crash and its restart)
    # Two warm leases take the four credits (a lease and its return each): no hop, no wait.
    held = [pool.lease_nowait("a.example:1") for _ in range(2)]
    assert all(lease is not None for lease in held)
    assert pool.lease_nowait("a.example:1") is None  # no credit left: the no-wait path goes without
    pool.invalidate("a.example:1")  # a report: dropped and counted
    assert pool.snapshot().invalidations_dropped == 1
    start = trio.current_time()
    with trio.move_on_after(0.5):
        async with pool.lease("a.example:1"):  # waits for a credit, within its deadline only
            pytest.fail("leased without a credit")
    assert trio.current_time() - start == pytest.approx(0.5)
    for lease in held:
        assert lease is not None
        with lease:
            pass
    assert pool.snapshot().inbox_depth == 4
    async with trio.open_nursery() as nursery:  # restarted: the task applies what waited for it
        await nursery.start(pool.run)
        await settle()
        snap = pool.snapshot()
        assert (snap.leased, snap.inbox_depth, snap.size) == (0, 0, 1)
        async with pool.lease("a.example:1"):
            pass
        nursery.cancel_scope.cancel()
    assert len(factory.opened) == 1
    await pool.aclose()
    assert factory.opened[0].closes == 1


async def test_an_open_that_raises_fails_its_own_lease_not_the_task(autojump_clock: trio.testing.MockClock) -> None:
    """A factory raising for one target failed the task: restarted with a growing backoff by its
    supervisor, every cold lease of any other target waited out the restarts (1.6 s after six leases of
    the bad one). The bad target's lease fails (``Unavailable``), and the task goes on."""
    pool, factory = make_pool()

    def opens(target: str) -> FakeChannel:
        if target.startswith("bad"):
            raise OSError("cannot open " + target)
        return factory(target)

    pool._factory = opens
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for _ in range(3):
            with trio.fail_after(10), pytest.raises(Unavailable, match=r"bad\.example:1.*channel not opened: OSError"):
                async with pool.lease("bad.example:1"):  # no deadline of its own: never a wait for good
                    pass
        start = trio.current_time()
        async with pool.lease("good.example:1") as channel:  # the task still runs: no restart to wait for
            assert channel is factory.opened[0]
        assert trio.current_time() == start
        await settle()
        snap = pool.snapshot()
        assert (snap.leased, snap.inbox_depth, snap.size, snap.opened) == (0, 0, 1, 1)
        nursery.cancel_scope.cancel()
    await pool.aclose()
    assert factory.opened[0].closes == 1


async def test_a_crash_in_the_middle_of_a_batch_publishes_the_channels_it_evicted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The map was published only at a batch's end: a crash after an invalidation in the same batch
    left the invalidated channel published, and warm leases took it until the restarted task's first
    batch (for the whole restart backoff)."""
    pool, factory = make_pool()
    evictions: list[EvictReason] = []

    def listener(reason: EvictReason) -> None:
        evictions.append(reason)
        if len(evictions) == 2:
            raise RuntimeError("a bug in the eviction listener")

    pool.on_evict(listener)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for target in ("a.example:1", "b.example:1"):
            async with pool.lease(target):
                pass
        await settle()
        nursery.cancel_scope.cancel()  # the task stops: the two reports below wait for it, one batch
    pool.invalidate("a.example:1")
    pool.invalidate("b.example:1")  # its eviction fails the task, the batch unfinished
    with pytest.raises(BaseExceptionGroup):
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
    assert evictions == [EvictReason.INVALIDATED] * 2
    # Between the crash and the restart: no warm lease on either invalidated channel.
    assert pool.lease_nowait("a.example:1") is None
    assert pool.lease_nowait("b.example:1") is None
    async with trio.open_nursery() as nursery:  # restarted
        await nursery.start(pool.run)
        async with pool.lease("a.example:1") as fresh:
            assert fresh is factory.opened[2]
        await settle()
        assert [c.closes for c in factory.opened] == [1, 1, 0]  # the evicted ones, closed by its first batch
        nursery.cancel_scope.cancel()
    await pool.aclose()


async def test_aclose_closes_all_and_rejects_new_leases(autojump_clock: trio.testing.MockClock) -> None:
    pool, factory = make_pool()
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with pool.lease("a.example:1"):
            pass
        async with pool.lease("b.example:1") as b:
            await pool.aclose()
            assert factory.opened[0].closes == 1
            assert b.closes == 0  # leased: closes when returned
        assert b.closes == 1
        with pytest.raises(trio.ClosedResourceError):
            async with pool.lease("a.example:1"):
                pass
        await pool.aclose()  # idempotent
    # run() returned by itself after aclose().
    snap = pool.snapshot()
    assert (snap.size, snap.evicted["shutdown"], snap.closed) == (0, 2, 2)


async def test_aclose_after_the_task_was_cancelled_closes_everything(autojump_clock: trio.testing.MockClock) -> None:
    """The supervisor cancels the services, then calls aclose(): nothing waits for a task that is gone."""
    pool, factory = make_pool()
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with pool.lease("a.example:1"):
            pass
        nursery.cancel_scope.cancel()
        with trio.fail_after(1):
            await pool.aclose()
    assert [c.closes for c in factory.opened] == [1]


async def test_aclose_with_a_failing_open_still_waiting_closes_every_channel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The task is down (between a crash and its restart) with a cold open waiting whose factory
    raises: aclose() applies it inline, and its error used to stop the shutdown there and come out of
    aclose(), every channel left open (and a second aclose() returned at once)."""
    pool, factory = make_pool()

    def opens(target: str) -> FakeChannel:
        if target.startswith("bad"):
            raise OSError("cannot open " + target)
        return factory(target)

    pool._factory = opens
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with pool.lease("good.example:1"):
            pass
        await settle()
        nursery.cancel_scope.cancel()  # the task stops
    failed: list[BaseException] = []
    async with trio.open_nursery() as callers:

        async def cold() -> None:
            try:
                async with pool.lease("bad.example:1"):
                    pass
            except Unavailable as exc:
                failed.append(exc)

        callers.start_soon(cold)
        await settle()  # its open waits in the inbox
        assert pool.snapshot().inbox_depth == 1
        with trio.fail_after(1):
            await pool.aclose()
    assert [c.closes for c in factory.opened] == [1]
    assert pool.snapshot().size == 0
    assert len(failed) == 1 and "cannot open bad.example:1" in str(failed[0])


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"channel_pool\.max_channels"):
        ChannelPool(ChannelPoolConfig(max_channels=0), FakeFactory())
    with pytest.raises(ValueError, match=r"channel_pool\.idle_expiry_s"):
        ChannelPool(ChannelPoolConfig(idle_expiry_s=0.0), FakeFactory())
    with pytest.raises(ValueError, match=r"channel_pool\.inbox_size"):
        ChannelPool(ChannelPoolConfig(inbox_size=1), FakeFactory())
