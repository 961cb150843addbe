"""The shadow index (actors/shadow_index.py): prefix matching like KVCM, TTL, capacity (LRU),
agreement, and its owner actor's bounded inbox."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from actors.shadow_index import (
    TIDY_STEP,
    ShadowIndex,
    ShadowIndexActor,
    agreement,
    best_holders,
    hit_error_tokens,
)
from router.config import ScorerConfig, ShadowConfig
from router.keys import block_keys
from router.policy.plan import CandidateSource, Fleet, plan_candidates
from router.types import HostMatch, KeyFamily, WorkerAddr

W1, W2, W3 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def chained(tokens: Sequence[int]) -> tuple[int, ...]:
    """Block keys of one-token blocks, chained like every key family (rtp, bs 1)."""
    return tuple(block_keys(tuple(tokens), 1, KeyFamily.RTP, 0))


def exact_prefix(query: Sequence[int], keys: Sequence[int]) -> int:
    n = 0
    while n < min(len(query), len(keys)) and query[n] == keys[n]:
        n += 1
    return n


PROMPT = chained(range(100))


def test_match_reports_each_workers_contiguous_prefix_longest_first() -> None:
    index = ShadowIndex(300.0, 10_000)
    index.record(W1, PROMPT[:10], now=1.0)
    index.record(W2, PROMPT[:4], now=1.0)
    index.record(W3, chained([7, 8, 9]), now=1.0)  # another prompt: no common first block
    assert index.match(PROMPT[:20], now=2.0) == (HostMatch(W1, 10), HostMatch(W2, 4))
    assert index.match(PROMPT[:3], now=2.0) == (HostMatch(W1, 3), HostMatch(W2, 3))
    assert index.match(chained([1, 2]), now=2.0) == ()
    assert index.match((), now=2.0) == ()


def test_holders_found_at_one_position_come_out_longest_first() -> None:
    """Holders whose prefixes end between the same two probed positions are found together, and
    still come out longest first (the order the shadow source's hot set and the decision log read)."""
    index = ShadowIndex(300.0, 10_000)
    index.record(W1, PROMPT[:5], now=1.0)
    index.record(W2, PROMPT[:7], now=1.0)
    assert index.match(PROMPT[:20], now=2.0) == (HostMatch(W2, 7), HostMatch(W1, 5))


def test_match_finds_every_length_exactly_with_one_record_per_worker() -> None:
    index = ShadowIndex(300.0, 100_000)
    for length in range(1, 100):
        index.record(f"10.1.0.{length}:8000", PROMPT[:length], now=1.0)
    found = dict((m.host_ip_port, m.local) for m in index.match(PROMPT, now=1.0))
    assert found == {f"10.1.0.{length}:8000": length for length in range(1, 100)}


@st.composite
def prompt_forest(draw: st.DrawFn) -> list[tuple[str, tuple[int, ...]]]:
    """Records of prompts that share prefixes (a random tree of token sequences)."""
    prompts: list[tuple[int, ...]] = [()]
    records: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(draw(st.integers(1, 12))):
        parent = draw(st.sampled_from(prompts))
        tail = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=40)))
        prompt = parent + tail
        prompts.append(prompt)
        records.append((f"10.2.0.{draw(st.integers(1, 5))}:8000", chained(prompt)))
    return records


@given(prompt_forest(), st.lists(st.integers(0, 3), max_size=80), st.integers(0, 11))
def test_match_agrees_with_a_brute_force_index(
    records: list[tuple[str, tuple[int, ...]]], query_tail: list[int], base: int
) -> None:
    index = ShadowIndex(300.0, 1_000_000)
    for t, (worker, keys) in enumerate(records):
        index.record(worker, keys, now=float(t))
    # Query: a recorded prompt (or none) extended by a random tail.
    query = (records[base % len(records)][1] + chained(query_tail))[: 40 + base * 7]
    exact: dict[str, int] = {}
    for worker, keys in records:
        exact[worker] = max(exact.get(worker, 0), exact_prefix(query, keys))
    expected = {w: n for w, n in exact.items() if n >= 1}
    got = {m.host_ip_port: m.local for m in index.match(query, now=float(len(records)))}
    assert set(got) == set(expected)  # exactly the workers holding the first block
    for worker, n in got.items():
        # Measured against one record: exact, or (with several diverging records) more than half.
        assert expected[worker] / 2 < n <= expected[worker]
    single = {w for w in expected if sum(1 for rw, _ in records if rw == w) == 1}
    for worker in single:
        assert got[worker] == expected[worker]


@given(prompt_forest(), st.integers(1, 6))
def test_limit_returns_exactly_the_longest(records: list[tuple[str, tuple[int, ...]]], limit: int) -> None:
    index = ShadowIndex(300.0, 1_000_000)
    for t, (worker, keys) in enumerate(records):
        index.record(worker, keys, now=float(t))
    query = max((keys for _, keys in records), key=len)
    full = index.match(query, now=100.0)
    top = index.match(query, now=100.0, limit=limit)
    assert len(top) >= min(limit, len(full))
    assert set(top) <= set(full)
    left_out = [m.local for m in full if m not in top]
    assert all(m.local > n for m in top for n in left_out)


def test_limit_stops_the_walk_early() -> None:
    index = ShadowIndex(300.0, 10_000)
    for i, length in enumerate((99, 50, 20, 5, 1)):
        index.record(f"10.5.0.{i}:8000", PROMPT[:length], now=1.0)
    assert [m.local for m in index.match(PROMPT, now=1.0)] == [99, 50, 20, 5, 1]
    assert [m.local for m in index.match(PROMPT, now=1.0, limit=2)] == [99, 50]
    assert [m.local for m in index.match(PROMPT, now=1.0, limit=3)] == [99, 50, 20]


@given(prompt_forest(), st.integers(1, 6), st.integers(0, 2**16))
def test_workers_not_usable_neither_show_nor_take_a_place(
    records: list[tuple[str, tuple[int, ...]]], limit: int, mask: int
) -> None:
    """Records of workers that left discovery, or are ejected, live until their TTL: with ``usable``
    they are passed over, and the limit still returns the longest of the usable ones."""
    index = ShadowIndex(300.0, 1_000_000)
    for t, (worker, keys) in enumerate(records):
        index.record(worker, keys, now=float(t))
    workers = sorted({worker for worker, _ in records})
    gone = {w for i, w in enumerate(workers) if mask >> (i % 16) & 1}

    def usable(worker: str) -> bool:
        return worker not in gone

    query = max((keys for _, keys in records), key=len)
    full = [m for m in index.match(query, now=100.0) if m.host_ip_port not in gone]
    top = index.match(query, now=100.0, limit=limit, usable=usable)
    assert not {m.host_ip_port for m in top} & gone
    assert len(top) >= min(limit, len(full))
    assert set(top) <= set(full)
    left_out = [m.local for m in full if m not in top]
    assert all(m.local > n for m in top for n in left_out)


# --- TTL and capacity --------------------------------------------------------------------------


def test_ttl_expiry_and_refresh() -> None:
    index = ShadowIndex(300.0, 10_000)
    index.record(W1, PROMPT[:8], now=0.0)
    index.record(W2, PROMPT[:8], now=100.0)
    assert {m.host_ip_port for m in index.match(PROMPT, now=299.9)} == {W1, W2}
    assert {m.host_ip_port for m in index.match(PROMPT, now=300.1)} == {W2}  # W1 expired (not yet purged)
    assert index.records == 2
    index.record(W2, PROMPT[:8], now=350.0)  # refresh W2; purges W1
    assert index.records == 1 and index.blocks == 8
    assert {m.host_ip_port for m in index.match(PROMPT, now=649.9)} == {W2}
    assert index.match(PROMPT, now=650.1) == ()
    index.expire(now=651.0)
    assert (index.records, index.blocks, index.indexed_keys) == (0, 0, 0)


def test_an_older_record_expiring_leaves_the_entries_of_the_workers_newer_one() -> None:
    """A worker's two prompts share their head: the newer record owns those entries now, so the older
    one expiring must not take them (the newer would stop matching at its own head)."""
    index = ShadowIndex(100.0, 10_000)
    older, newer = PROMPT[:4], chained([0, 1, 7])
    assert newer[:2] == older[:2] and newer[2] != older[2]
    index.record(W1, older, now=0.0)
    index.record(W1, newer, now=50.0)
    index.expire(120.0)  # the older record expires, the newer one lives
    assert index.records == 1
    assert index.match(newer, now=120.0) == (HostMatch(W1, 3),)


def test_capacity_evicts_least_recently_recorded() -> None:
    index = ShadowIndex(300.0, 100)
    a, b, c = chained([1] * 40), chained([2] * 40), chained([3] * 40)
    index.record(W1, a, now=1.0)
    index.record(W2, b, now=2.0)
    index.record(W1, a, now=3.0)  # touch a: b is now the least recent
    index.record(W3, c, now=4.0)
    assert index.blocks == 80 and index.records == 2
    assert index.match(b, now=5.0) == ()
    assert index.match(a, now=5.0) == (HostMatch(W1, 40),)
    assert index.match(c, now=5.0) == (HostMatch(W3, 40),)


def test_a_prompt_longer_than_the_capacity_keeps_its_head() -> None:
    index = ShadowIndex(300.0, 30)
    index.record(W1, PROMPT, now=1.0)
    assert index.blocks == 30
    assert index.match(PROMPT, now=1.0) == (HostMatch(W1, 30),)


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 5), st.integers(1, 60)), max_size=60))
def test_memory_stays_bounded_and_the_index_never_leaks(ops: list[tuple[int, int, int]]) -> None:
    index = ShadowIndex(50.0, 120)
    live: dict[tuple[str, int], tuple[int, ...]] = {}
    for t, (worker_id, prompt_id, length) in enumerate(ops):
        keys = chained([prompt_id] * 3 + list(range(length)))
        index.record(f"10.3.0.{worker_id}:8000", keys, now=float(t * 7))
        assert index.blocks <= 120
        live[(f"10.3.0.{worker_id}:8000", keys[-1])] = keys
    # Every indexed key belongs to a live record, so the index is bounded by the records.
    assert index.indexed_keys <= sum(len(k).bit_length() for k in live.values())
    index.expire(now=1e9)
    assert (index.records, index.blocks, index.indexed_keys) == (0, 0, 0)


@pytest.mark.parametrize("why", ["a lull past the ttl", "a long prompt into short records"])
def test_one_record_drops_a_bounded_step_and_the_owner_tidies_the_rest_in_steps(why: str) -> None:
    """One record used to expire, or evict to make room, every record due at once: after a lull, an
    index of 131,072 one-block records held the routing thread for 163 ms (on the real
    clock). A record now drops at most TIDY_STEP; ``tidy`` the rest, a step at a time."""
    n = 4 * TIDY_STEP
    index = ShadowIndex(300.0, n)
    for i in range(n):
        index.record(f"10.5.{i // 250}.{i % 250}:8000", (i + 1,), now=1.0)
    assert (index.records, index.blocks) == (n, n)
    keys: tuple[int, ...]
    if why == "a lull past the ttl":
        now, keys = 1000.0, (10**9,)
    else:
        now, keys = 2.0, tuple(range(10**9, 10**9 + n // 2))
    index.record(W1, keys, now=now)  # a step before it is added (expired ones), a step after (capacity)
    dropped = 2 * TIDY_STEP if why == "a lull past the ttl" else TIDY_STEP
    assert index.records == n + 1 - dropped
    assert index.match(keys, now=now) == (HostMatch(W1, len(keys)),)
    steps = 1  # the calls, the last (False) one included
    while index.tidy(now, TIDY_STEP):
        steps += 1
    kept = 0 if why == "a lull past the ttl" else n // 2  # the newest short records fit beside it
    assert (index.records, index.blocks) == (kept + 1, kept + len(keys))
    assert steps == (n - kept - dropped) // TIDY_STEP


async def test_the_owner_tidies_what_a_record_left_without_a_further_record(
    autojump_clock: trio.testing.MockClock,
) -> None:
    actor = ShadowIndexActor(ShadowConfig(inbox_size=8, capacity_blocks=4 * TIDY_STEP))
    for i in range(4 * TIDY_STEP):
        actor.index.record(f"10.6.{i // 250}.{i % 250}:8000", (i + 1,), now=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        assert actor.record_nowait(W1, PROMPT[:12], now=1000.0)  # every other record expired
        await trio.testing.wait_all_tasks_blocked()
        assert (actor.index.records, actor.index.blocks) == (1, 12)
        nursery.cancel_scope.cancel()


@given(
    st.floats(0.0, 1e9, allow_nan=False),
    st.floats(1e-6, 604_800.0, allow_nan=False),
)
def test_the_next_expiry_is_the_first_time_a_record_is_dropped(recorded_at: float, ttl_s: float) -> None:
    """The owner wakes at ``next_expiry``: a record matches until just before it and is dropped at it
    (sooner, the tidy would drop nothing and the timer fire again at once), whatever the float sum rounds."""
    index = ShadowIndex(ttl_s, 100)
    index.record(W1, PROMPT[:4], now=recorded_at)
    at = index.next_expiry()
    assert at >= recorded_at + ttl_s
    assert index.match(PROMPT, now=math.nextafter(at, -math.inf)) == (HostMatch(W1, 4),)
    assert index.match(PROMPT, now=at) == ()
    assert not index.tidy(at, TIDY_STEP) and index.records == 0
    assert index.next_expiry() == math.inf


async def test_the_owner_drops_records_as_they_expire_without_traffic(autojump_clock: trio.testing.MockClock) -> None:
    """Expired records were dropped only when a further record came: an idle router held them, and
    /debug/actors counted them, for good. The owner wakes at the oldest record's expiry."""
    actor = ShadowIndexActor(ShadowConfig(ttl_s=10.0, inbox_size=8))
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        start = trio.current_time()
        assert actor.record_nowait(W1, PROMPT[:12], now=start)
        await trio.sleep(4.0)
        assert actor.record_nowait(W2, PROMPT[:8], now=trio.current_time())
        await trio.sleep_until(start + 10.0)  # W1's last moment
        assert (actor.health().records, actor.health().blocks) == (2, 20)
        await trio.sleep_until(start + 10.001)
        assert (actor.health().records, actor.health().blocks) == (1, 8)
        await trio.sleep(3600.0)  # an hour without traffic (a timer that fired again at once would hang here)
        health = actor.health()
        assert (health.records, health.blocks, health.indexed_keys, health.applied) == (0, 0, 0, 2)
        assert actor.record_nowait(W3, PROMPT[:4], now=trio.current_time())  # and it records on
        await trio.testing.wait_all_tasks_blocked()
        assert actor.match(PROMPT, now=trio.current_time()) == (HostMatch(W3, 4),)
        nursery.cancel_scope.cancel()


async def test_a_record_into_an_empty_index_wakes_the_owner_at_its_expiry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The owner's expiry alarm is set for the oldest record's expiry, and with none, never: a record
    into an empty index is the one way that expiry gets earlier, and must set it again."""
    actor = ShadowIndexActor(ShadowConfig(ttl_s=10.0, inbox_size=8))
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        for _ in range(2):  # and again, once it has emptied the index
            await trio.sleep(100.0)  # idle, empty: the expiry task sleeps with no deadline
            start = trio.current_time()
            assert actor.record_nowait(W1, PROMPT[:4], now=start)
            await trio.sleep_until(start + 10.0)
            assert actor.health().records == 1
            await trio.sleep_until(start + 10.001)
            assert (actor.health().records, actor.health().blocks) == (0, 0)
        nursery.cancel_scope.cancel()


async def test_only_the_owners_task_writes_the_index(autojump_clock: trio.testing.MockClock) -> None:
    """Records and expiries alike: the expiry alarm only wakes the owner (its child task once dropped
    expired records itself, a second writer of the index)."""
    actor = ShadowIndexActor(ShadowConfig(ttl_s=10.0, inbox_size=8))
    writers: set[str] = set()
    index = actor.index
    record, tidy = index.record, index.tidy

    def recording(worker: str, keys: Sequence[int], now: float) -> None:
        writers.add(trio.lowlevel.current_task().name)
        record(worker, keys, now)

    def tidying(now: float, most: int) -> bool:
        writers.add(trio.lowlevel.current_task().name)
        return tidy(now, most)

    index.record = recording  # type: ignore[method-assign]
    index.tidy = tidying  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        assert actor.record_nowait(W1, PROMPT[:12], now=trio.current_time())
        await trio.sleep(60.0)  # expired with no traffic
        assert actor.record_nowait(W2, PROMPT[:8], now=trio.current_time())
        await trio.sleep(60.0)
        assert actor.health().records == 0
        nursery.cancel_scope.cancel()
    assert len(writers) == 1 and next(iter(writers)).endswith("ShadowIndexActor.run"), writers


def test_bad_configuration_names_every_field() -> None:
    with pytest.raises(ValueError, match=r"ttl_s.*capacity_blocks"):
        ShadowIndex(0.0, 0)
    with pytest.raises(ValueError, match="inbox_size"):
        ShadowIndexActor(ShadowConfig(inbox_size=0))


# --- agreement --------------------------------------------------------------------------------


def hosts(**locals_: int) -> tuple[HostMatch, ...]:
    return tuple(HostMatch(f"{name}:1", local) for name, local in locals_.items())


@pytest.mark.parametrize(
    ("kvcm", "shadow", "k", "expected"),
    [
        (hosts(a=9, b=3), hosts(a=5, c=1), 1, 1.0),  # same best holder, lengths may differ
        (hosts(a=9, b=3), hosts(b=5), 1, 0.0),
        (hosts(a=9, b=9), hosts(a=4), 1, 0.5),  # a tie counts both
        (hosts(a=9, b=3, c=1), hosts(b=8, a=2, d=1), 2, 1.0),
        (hosts(a=9, b=3, c=1), hosts(a=8, d=2), 2, 1 / 3),
        (hosts(), hosts(), 1, 1.0),
        (hosts(a=0), hosts(), 1, 1.0),  # no positive match on either side
        (hosts(a=3), hosts(), 1, 0.0),
        (hosts(), hosts(a=3), 1, 0.0),
    ],
)
def test_agreement(
    kvcm: tuple[HostMatch, ...], shadow: tuple[HostMatch, ...], k: int, expected: float
) -> None:
    assert agreement(kvcm, shadow, k) == pytest.approx(expected)
    assert agreement(tuple(reversed(kvcm)), tuple(reversed(shadow)), k) == pytest.approx(expected)


def test_agreement_rejects_bad_k() -> None:
    with pytest.raises(ValueError, match="k"):
        agreement((), (), 0)


# --- the shadow answer feeds the same plan ------------------------------------------------------


def test_shadow_answer_becomes_the_hot_set() -> None:
    workers = [WorkerAddr.from_http(f"10.0.0.{i}", 8000) for i in range(1, 6)]
    index = ShadowIndex(300.0, 10_000)
    index.record(workers[0].http_target, PROMPT[:50], now=1.0)
    index.record(workers[2].http_target, PROMPT[:70], now=1.0)
    plan = plan_candidates(
        index.match(PROMPT, now=2.0),
        Fleet.of(workers),
        request_id="r",
        namespace="ns",
        config=ScorerConfig(),
        hot_source=CandidateSource.SHADOW,
    )
    hot = [
        (c.worker, c.match.local if c.match else None)
        for c in plan.candidates
        if c.source is CandidateSource.SHADOW
    ]
    assert hot == [(workers[2], 70), (workers[0], 50)]


# --- the owner actor ----------------------------------------------------------------------------


async def test_actor_applies_records_and_answers_matches(autojump_clock: trio.testing.MockClock) -> None:
    actor = ShadowIndexActor(ShadowConfig(inbox_size=8))
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        assert actor.record_nowait(W1, PROMPT[:12], now=1.0)
        assert actor.match(PROMPT, now=1.0) == ()  # not applied yet: the actor's task applies it
        await trio.testing.wait_all_tasks_blocked()
        assert actor.match(PROMPT, now=2.0) == (HostMatch(W1, 12),)
        health = actor.health()
        assert (health.applied, health.dropped, health.records, health.blocks, health.inbox_depth) == (
            1,
            0,
            1,
            12,
            0,
        )
        nursery.cancel_scope.cancel()


async def test_actor_inbox_is_bounded_and_drops_are_counted(autojump_clock: trio.testing.MockClock) -> None:
    actor = ShadowIndexActor(ShadowConfig(inbox_size=4))
    accepted = [actor.record_nowait(f"10.4.0.{i}:8000", PROMPT[: i + 1], now=1.0) for i in range(10)]
    assert accepted == [True] * 4 + [False] * 6
    assert (actor.health().inbox_depth, actor.health().inbox_capacity, actor.health().dropped) == (4, 4, 6)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        await trio.testing.wait_all_tasks_blocked()
        assert (actor.health().applied, actor.health().inbox_depth, actor.index.records) == (4, 0, 4)
        nursery.cancel_scope.cancel()


def test_record_key_sequence_is_not_copied_for_tuples() -> None:
    """Records share the caller's keys tuple (memory is per record, not per block copy)."""
    index = ShadowIndex(300.0, 1000)
    keys = PROMPT[:40]
    index.record(W1, keys, now=1.0)
    assert next(iter(index._records.values())).keys is keys


def test_hit_error_tokens_at_kvcms_best_holder() -> None:
    kvcm = [HostMatch("a:1", local=8), HostMatch("b:1", local=3)]
    assert hit_error_tokens(kvcm, [HostMatch("a:1", local=8)], 16) == 0  # the shadow agrees
    assert hit_error_tokens(kvcm, [HostMatch("a:1", local=5), HostMatch("b:1", local=3)], 16) == 48
    assert hit_error_tokens(kvcm, [HostMatch("b:1", local=3)], 16) == 128  # the shadow misses the holder
    assert hit_error_tokens([], [HostMatch("b:1", local=2)], 16) == 32  # a hit KVCM does not know of
    assert hit_error_tokens([], [], 16) == 0
    # Hosts holding the prefix only through p2p are no holders: the shadow's 4 local blocks are all error.
    p2p_only = [HostMatch("a:1", local=0, p2p_fetch=5, p2p_total=5)]
    assert hit_error_tokens(p2p_only, [HostMatch("b:1", local=4)], 64) == 256
    # Of holders KVCM names with the same prefix, the one the shadow knows: KVCM's order decided it, and
    # a shadow that saw only the second (a second router's does) counted the whole prefix as error.
    tied = [HostMatch("a:1", local=8), HostMatch("b:1", local=8)]
    for kvcm_order in (tied, tied[::-1]):
        assert hit_error_tokens(kvcm_order, [HostMatch("b:1", local=8)], 16) == 0
        assert hit_error_tokens(kvcm_order, [HostMatch("a:1", local=6)], 16) == 32


def test_the_comparison_finds_kvcms_best_holder_even_when_the_views_limit_leaves_it_out() -> None:
    """Compared under the hot set's limit, a KVCM holder the shadow holds with fewer blocks than that
    many other workers was cut from the view, and its error read as KVCM's whole hit."""
    index = ShadowIndex(300.0, 10_000)
    keys = tuple(range(1, 17))
    index.record("10.0.0.100:8000", keys[:4], now=1.0)  # KVCM's holder: here too with its 4 blocks
    for i in range(8):  # eight workers the shadow thinks hold the whole prompt
        index.record(f"10.0.0.{i + 1}:8000", keys, now=1.0)
    kvcm = (HostMatch("10.0.0.100:8000", 4),)
    assert all(h.host_ip_port != "10.0.0.100:8000" for h in index.match(keys, 2.0, limit=8))
    ratio, error = index.compare(kvcm, keys, 2.0, 8, 64)
    assert (ratio, error) == (0.0, 0)  # the best holders differ; the holder's own prefix agrees
    assert index.compare((HostMatch("10.0.0.100:8000", 6),), keys, 2.0, 8, 64) == (0.0, 2 * 64)
    # A holder the shadow never saw is its whole prefix of error, looked up or not.
    assert index.compare((HostMatch("10.0.0.200:8000", 5),), keys, 2.0, 8, 64) == (0.0, 5 * 64)
    # One in the view is read from it (one of the shadow's eight tied best holders: 1/8 agreement).
    assert index.compare((HostMatch("10.0.0.1:8000", 16),), keys, 2.0, 8, 64) == (0.125, 0)


@given(
    prompt_forest(),
    st.lists(st.integers(0, 3), max_size=80),
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 30)), max_size=6),
    st.integers(1, 4),
)
def test_the_comparison_is_agreement_and_hit_error_of_its_views(
    records: list[tuple[str, tuple[int, ...]]],
    query_tokens: list[int],
    kvcm_answer: list[tuple[int, int]],
    limit: int,
) -> None:
    """``compare`` fuses the two measures for speed: it must equal them, taken on its views (``match``
    with ``limit``; for the hit error, KVCM's best holders looked up alone when the view left one out)."""
    index = ShadowIndex(capacity_blocks=10_000, ttl_s=100.0)
    for worker, keys in records:
        index.record(worker, keys, 1.0)
    query = chained(query_tokens)
    # KVCM's answer: hosts the shadow knows (and some it does not), spelled as the shadow spells them.
    locals_by_host = {f"10.2.0.{host}:8000": local for host, local in kvcm_answer}  # one entry per host
    kvcm = tuple(HostMatch(host, local) for host, local in locals_by_host.items())
    view = index.match(query, 2.0, limit=limit)
    best = {h.host_ip_port for h in best_holders(kvcm)}
    error_view = view if best <= {h.host_ip_port for h in view} else index.match(query, 2.0, usable=best.__contains__)
    ratio, error = index.compare(kvcm, query, 2.0, limit, 16)
    assert ratio == pytest.approx(agreement(kvcm, view))
    assert error == hit_error_tokens(kvcm, error_view, 16)


def test_kvcm_naming_a_holder_in_another_spelling_agrees_with_the_shadows_canonical_one() -> None:
    """KVCM may write a worker's address out in full; the shadow index names it by canonical target.
    The same holder with the same blocks read as full disagreement and a whole prefix of error."""
    kvcm = (HostMatch("[2001:0db8:0000:0000:0000:0000:0000:0002]:08000", 9, 0, 9),)
    shadow = (HostMatch("[2001:db8::2]:8000", 9, 0, 9),)
    assert agreement(kvcm, shadow) == 1.0
    assert hit_error_tokens(kvcm, shadow, 64) == 0


async def test_records_held_across_a_restart_still_expire_with_no_traffic(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A restarted task made a new expiry alarm but set it only on a change: the records it took over
    stayed in memory (and in the health's counts), with no traffic, for good."""
    shadow = ShadowIndexActor(ShadowConfig(ttl_s=10.0))
    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as first_run:
            await first_run.start(shadow.run)
            shadow.record_nowait("10.0.0.1:8000", [1, 2, 3], trio.current_time())
            await trio.testing.wait_all_tasks_blocked()
            assert shadow.health().records == 1
            first_run.cancel_scope.cancel()  # its task ends, as a crash ends it
        await nursery.start(shadow.run)  # as a supervisor restarts it
        await trio.sleep(11.0)
        assert shadow.health().records == 0
        nursery.cancel_scope.cancel()
