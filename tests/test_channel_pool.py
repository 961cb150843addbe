"""ChannelPool under MockClock with a factory of fake closable channels (the pool's logic is under test)."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from actors.channel_pool import ChannelPool
from router.config import ChannelPoolConfig
from router.targets import TargetError


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


def make_pool(max_channels: int = 256, idle_expiry_s: float = 60.0) -> tuple[ChannelPool[FakeChannel], FakeFactory]:
    factory = FakeFactory()
    config = ChannelPoolConfig(max_channels=max_channels, idle_expiry_s=idle_expiry_s)
    return ChannelPool(config, factory), factory


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
            with pool.lease(target) as channel:
                peak_size = max(peak_size, pool.snapshot().size)
                await trio.sleep(rng.random() * 0.01)  # a call in flight; other workers evict meanwhile
                assert channel.closes == 0, "a leased channel was closed"

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        async with trio.open_nursery() as workers:
            for k in range(16):
                workers.start_soon(worker, targets[k::16])
        await trio.testing.wait_all_tasks_blocked()
        snap = pool.snapshot()
        assert peak_size == cap  # reached, never exceeded
        assert snap.size == cap
        assert snap.opened == len(factory.opened) == 10_000
        assert snap.evicted["lru"] == 10_000 - cap
        assert snap.leased == snap.draining == snap.pending_close == 0
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
        with pool.lease("a.example:1"):
            pass
        released_a = trio.current_time()
        await trio.sleep(30)
        with pool.lease("b.example:1"):
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
        with pool.lease("a.example:1"):
            await trio.sleep(200)  # a long call: leased the whole time
        released = trio.current_time()
        (a,) = factory.opened
        assert a.closes == 0
        await trio.sleep(50)
        with pool.lease("a.example:1"):
            pass
        released = trio.current_time()
        await trio.sleep(59)
        assert a.closes == 0
        await trio.sleep_until(released + 60.001)
        assert a.closed_at == pytest.approx(released + 60.0)
        assert len(factory.opened) == 1
        nursery.cancel_scope.cancel()


async def test_evicted_channel_closes_only_when_its_last_lease_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, factory = make_pool(max_channels=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        first = pool.lease("a.example:1")
        second = pool.lease("a.example:1")
        old_a = first.__enter__()
        assert second.__enter__() is old_a
        with pool.lease("b.example:1"), pool.lease("c.example:1"):  # evicts a (LRU) while leased twice
            pass
        await trio.testing.wait_all_tasks_blocked()
        snap = pool.snapshot()
        assert (snap.size, snap.leased, snap.draining, snap.evicted["lru"]) == (2, 2, 1, 1)
        assert old_a.closes == 0
        with pool.lease("a.example:1") as new_a:  # a fresh channel while the old one drains
            assert new_a is not old_a
        first.__exit__(None, None, None)
        await trio.testing.wait_all_tasks_blocked()
        assert old_a.closes == 0
        second.__exit__(None, None, None)
        await trio.testing.wait_all_tasks_blocked()
        assert old_a.closes == 1
        assert pool.snapshot().draining == 0
        assert pool.snapshot().closed_inline == 0  # closed by run(), not on the request path
        nursery.cancel_scope.cancel()
    # Cancelling run() (a crash or restart) closes nothing; the owner's aclose() does.
    assert [c.closes for c in factory.opened] == [1, 0, 1, 0]  # the drained a and the evicted b
    await pool.aclose()
    assert [c.closes for c in factory.opened] == [1, 1, 1, 1]


async def test_lease_is_released_when_the_caller_is_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    pool, factory = make_pool()
    with trio.move_on_after(1) as scope:
        with pool.lease("a.example:1"):
            assert pool.snapshot().leased == 1
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert pool.snapshot().leased == 0
    pool.invalidate("a.example:1")
    snap = pool.snapshot()
    assert (snap.draining, snap.pending_close) == (0, 1)  # no lease left: queued for closing at once
    await pool.aclose()
    assert factory.opened[0].closes == 1


async def test_invalidate_drops_the_channel_and_the_next_lease_opens_a_new_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, factory = make_pool()
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        with pool.lease("Host.Example:5") as first:
            pass
        pool.invalidate("host.example:5")  # another spelling of the same normalised target
        await trio.testing.wait_all_tasks_blocked()
        assert first.closes == 1
        with pool.lease("host.example:5") as second:
            pool.invalidate("host.example:5", first)  # a failure seen on the old channel: ignored
            assert pool.snapshot().size == 1
            pool.invalidate("host.example:5", second)  # dropped now, closed when released
            assert pool.snapshot().size == 0
            await trio.testing.wait_all_tasks_blocked()
            assert second.closes == 0
        await trio.testing.wait_all_tasks_blocked()
        assert second.closes == 1
        pool.invalidate("unknown.example:5")  # nothing to drop
        snap = pool.snapshot()
        assert (snap.opened, snap.closed, snap.evicted["invalidated"]) == (2, 2, 2)
        assert [c.target for c in factory.opened] == ["host.example:5", "host.example:5"]
        nursery.cancel_scope.cancel()


async def test_concurrent_acquire_of_one_target_opens_one_channel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pool, factory = make_pool()
    peak_leased = 0
    seen: set[int] = set()

    async def caller() -> None:
        nonlocal peak_leased
        with pool.lease("[::1]:9000") as channel:
            seen.add(id(channel))
            peak_leased = max(peak_leased, pool.snapshot().leased)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for _ in range(100):
            nursery.start_soon(caller)
    assert peak_leased == 100  # all leases overlapped ...
    assert len(factory.opened) == len(seen) == 1  # ... on one channel
    assert factory.opened[0].target == "[::1]:9000"
    with pool.lease("[0:0::1]:9000"):  # the same address spelled differently
        assert len(factory.opened) == 1


@pytest.mark.parametrize("target", ["host.example:99999", "host.example", "::1:80", "bad host:1", ""])
async def test_malformed_target_is_rejected_naming_it(target: str) -> None:
    pool, factory = make_pool()
    with pytest.raises(TargetError) as info, pool.lease(target):
        pass
    assert target == "" or repr(target) in str(info.value)
    assert factory.opened == []


async def test_full_close_inbox_closes_inline_and_counts_it(autojump_clock: trio.testing.MockClock) -> None:
    pool, factory = make_pool(max_channels=2)  # close inbox capacity = max_channels
    for name in "abcde":
        with pool.lease(f"{name}.example:1"):
            pass
    snap = pool.snapshot()  # run() not started: 3 evicted, 2 queued, 1 closed inline
    assert (snap.evicted["lru"], snap.pending_close, snap.closed_inline, snap.closed) == (3, 2, 1, 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        await trio.testing.wait_all_tasks_blocked()
        assert pool.snapshot().closed == 3
        assert pool.snapshot().pending_close == 0
        nursery.cancel_scope.cancel()
    await pool.aclose()
    assert [c.closes for c in factory.opened] == [1] * 5


async def test_aclose_closes_all_and_rejects_new_leases(autojump_clock: trio.testing.MockClock) -> None:
    pool, factory = make_pool()
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        with pool.lease("a.example:1"):
            pass
        with pool.lease("b.example:1") as b:
            await pool.aclose()
            assert factory.opened[0].closes == 1
            assert b.closes == 0  # leased: closes when returned
        assert b.closes == 1
        with pytest.raises(trio.ClosedResourceError), pool.lease("a.example:1"):
            pass
        await pool.aclose()  # idempotent
    # run() returned by itself after aclose().
    snap = pool.snapshot()
    assert (snap.size, snap.evicted["shutdown"], snap.closed) == (0, 2, 2)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"channel_pool\.max_channels"):
        ChannelPool(ChannelPoolConfig(max_channels=0), FakeFactory())
    with pytest.raises(ValueError, match=r"channel_pool\.idle_expiry_s"):
        ChannelPool(ChannelPoolConfig(idle_expiry_s=0.0), FakeFactory())
