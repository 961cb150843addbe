"""The candidate plan (router/policy/plan.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import overload

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import ScorerConfig
from router.policy.plan import CandidatePlan, CandidateSource, Fleet, plan_candidates
from router.types import HostMatch, WorkerAddr


def addr(i: int) -> WorkerAddr:
    return WorkerAddr.from_http(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8000)


def fleet_of(n: int) -> Fleet:
    return Fleet.of(addr(i) for i in range(n))


def plan(
    hosts: Sequence[HostMatch],
    fleet: Fleet,
    request_id: str = "req-1",
    *,
    hot: int = 8,
    cold: int = 2,
    ejected: frozenset[WorkerAddr] = frozenset(),
    source: CandidateSource = CandidateSource.HOT,
    unfit: Callable[[WorkerAddr], bool] | None = None,
) -> CandidatePlan:
    config = replace(ScorerConfig(), hot_set_size=hot, cold_set_size=cold)
    return plan_candidates(
        hosts,
        fleet,
        request_id=request_id,
        namespace="ns",
        config=config,
        hot_source=source,
        ejected=ejected,
        unfit=unfit,
    )


def hot_targets(p: CandidatePlan) -> list[str]:
    return [c.target for c in p.candidates if c.source is not CandidateSource.COLD]


def cold_workers(p: CandidatePlan) -> list[WorkerAddr]:
    return [c.worker for c in p.candidates if c.source is CandidateSource.COLD]


# --- hot set --------------------------------------------------------------------------------


def test_hot_set_sorted_by_effective_blocks_then_local_top_h() -> None:
    fleet = fleet_of(20)
    w = [addr(i) for i in range(20)]
    hosts = [
        HostMatch(w[0].http_target, local=2),
        HostMatch(w[1].http_target, local=5),
        HostMatch(w[2].http_target, local=3, p2p_total=13),  # 3 + 10 × 0.2 = 5 blocks, fewer local than w1
        HostMatch(w[3].http_target, local=0, p2p_total=30),  # 6 effective blocks from P2P alone
        HostMatch(w[4].http_target, local=0, p2p_total=0),  # no match: never hot
        HostMatch(w[5].http_target, local=1),
    ]
    p = plan(hosts, fleet, hot=4, cold=0)
    assert hot_targets(p) == [w[3].http_target, w[1].http_target, w[2].http_target, w[0].http_target]
    assert [c.match for c in p.candidates] == [hosts[3], hosts[1], hosts[2], hosts[0]]
    assert all(c.source is CandidateSource.HOT for c in p.candidates)


def test_of_two_hosts_with_equal_effective_blocks_the_one_holding_more_locally_takes_the_last_slot() -> None:
    fleet = fleet_of(4)
    a, b = addr(1), addr(2)
    # a: 2 local + 5 P2P-only × 0.2 = 3 effective blocks; b: 3 local, none of them to fetch.
    hosts = [HostMatch(a.http_target, local=2, p2p_total=7), HostMatch(b.http_target, local=3)]
    for r in range(16):
        assert hot_targets(plan(hosts, fleet, f"req-{r}", hot=1)) == [b.http_target]


def test_hot_set_default_size_is_eight() -> None:
    fleet = fleet_of(40)
    hosts = [HostMatch(addr(i).http_target, local=100 - i) for i in range(30)]
    p = plan_candidates(hosts, fleet, request_id="r", namespace="ns", config=ScorerConfig())
    assert hot_targets(p) == [addr(i).http_target for i in range(8)]
    assert len(cold_workers(p)) == 2


def test_hot_set_deduplicates_by_grpc_target_and_normalises_hosts() -> None:
    a = WorkerAddr.from_http("worker-a.example", 8000)
    b = WorkerAddr.from_http("worker-b.example", 8000)
    fleet = Fleet.of([a, b])
    hosts = [
        HostMatch("worker-a.example:8000", local=9),
        HostMatch("WORKER-A.example:8000", local=4),  # the same worker, spelled differently
        HostMatch(" worker-b.example:8000", local=3),
    ]
    p = plan(hosts, fleet, cold=0)
    assert [(c.worker, c.target) for c in p.candidates] == [(a, a.http_target), (b, b.http_target)]
    assert p.candidates[0].match == hosts[0]  # the better entry wins
    assert p.dropped == ()


def test_unknown_malformed_and_ejected_hosts_are_dropped_and_take_no_slot() -> None:
    fleet = fleet_of(10)
    w = [addr(i) for i in range(10)]
    hosts = [
        HostMatch("10.9.9.9:8000", local=50),  # not in discovery
        HostMatch("not a host", local=40),
        HostMatch("10.0.0.1:99999", local=35),  # port out of range
        HostMatch(w[1].http_target, local=30),  # ejected
        HostMatch(w[2].http_target, local=20),
        HostMatch(w[3].http_target, local=10),
    ]
    p = plan(hosts, fleet, hot=2, cold=0, ejected=frozenset({w[1]}))
    assert hot_targets(p) == [w[2].http_target, w[3].http_target]
    assert [(d.target, d.dropped, d.local_blocks) for d in p.dropped] == [
        ("10.9.9.9:8000", "unknown_host", 50),
        ("not a host", "malformed_host", 40),
        ("10.0.0.1:99999", "malformed_host", 35),
        (w[1].http_target, "ejected", 30),
    ]


def test_exact_ties_at_the_cut_are_ranked_per_request_not_by_address_or_answer_order() -> None:
    fleet = fleet_of(12)
    hosts = [HostMatch(addr(i).http_target, local=7) for i in range(6)] + [
        HostMatch(addr(6).http_target, local=9)
    ]
    firsts: Counter[str] = Counter()
    for r in range(300):
        p = plan(hosts, fleet, f"req-{r}", hot=3, cold=0)
        hot = hot_targets(p)
        assert hot[0] == addr(6).http_target and len(hot) == 3
        assert hot == hot_targets(plan(list(reversed(hosts)), fleet, f"req-{r}", hot=3, cold=0))
        assert hot == hot_targets(plan(hosts, fleet, f"req-{r}", hot=3, cold=0))  # reproducible
        firsts.update(hot[1:])
    # Each of the six tied holders gets a fair share of the two remaining slots (~100 of 600).
    assert set(firsts) == {addr(i).http_target for i in range(6)}
    assert min(firsts.values()) >= 60 and max(firsts.values()) <= 140


def test_a_tie_at_the_cut_is_among_hosts_with_as_many_local_blocks_too() -> None:
    fleet = fleet_of(8)
    a, b, c = addr(1), addr(2), addr(3)
    # a and b hold 3 local blocks each, tied at the cut; c's 2 local + 5 P2P-only × 0.2 are worth as
    # many, but it holds fewer locally: it ranks below the tie and never takes the slot.
    hosts = [HostMatch(a.http_target, 3), HostMatch(b.http_target, 3), HostMatch(c.http_target, 2, p2p_total=7)]
    for r in range(16):
        assert hot_targets(plan(hosts, fleet, f"req-{r}", hot=1, cold=0))[0] in {a.http_target, b.http_target}


def test_tied_holders_left_out_of_the_hot_set_may_still_be_cold_with_their_match() -> None:
    fleet = fleet_of(4)
    hosts = [HostMatch(addr(i).http_target, local=5) for i in range(4)]
    p = plan(hosts, fleet, hot=2, cold=2)
    assert len(p.candidates) == 4 and len({c.worker for c in p.candidates}) == 4
    assert all(c.match is not None and c.match.local == 5 for c in p.candidates)
    assert [c.source for c in p.candidates] == [CandidateSource.HOT] * 2 + [CandidateSource.COLD] * 2


def test_shadow_answer_labels_its_candidates() -> None:
    fleet = fleet_of(5)
    p = plan([HostMatch(addr(1).http_target, local=3)], fleet, source=CandidateSource.SHADOW)
    assert [c.source for c in p.candidates] == [
        CandidateSource.SHADOW,
        CandidateSource.COLD,
        CandidateSource.COLD,
    ]


# --- cold set -------------------------------------------------------------------------------


def test_cold_candidates_exclude_hot_and_ejected_and_keep_reported_matches() -> None:
    fleet = fleet_of(6)
    w = [addr(i) for i in range(6)]
    # w0 is hot; w1..w3 are reported beyond the hot set (H = 1); w4 is ejected.
    hosts = [HostMatch(w[i].http_target, local=10 - i) for i in range(4)]
    p = plan(hosts, fleet, hot=1, cold=10, ejected=frozenset({w[4]}))
    assert hot_targets(p) == [w[0].http_target]
    cold = cold_workers(p)
    assert sorted(cold, key=lambda x: x.http_target) == sorted(
        [w[1], w[2], w[3], w[5]], key=lambda x: x.http_target
    )
    matches = {c.worker: c.match for c in p.candidates if c.source is CandidateSource.COLD}
    assert matches[w[5]] is None
    assert [matches[w[i]] for i in (1, 2, 3)] == [hosts[1], hosts[2], hosts[3]]


@given(n=st.integers(1, 40), cold=st.integers(0, 10), others=st.integers(0, 2**40))
def test_the_cold_set_passes_over_workers_of_another_role(n: int, cold: int, others: int) -> None:
    """A decode worker beside the prefill ones takes no cold place: it would be dropped after its probe."""
    fleet = fleet_of(n)
    other = {addr(i) for i in range(n) if others >> i & 1}
    for r in range(5):
        p = plan([], fleet, f"req-{r}", cold=cold, unfit=other.__contains__)
        picked = cold_workers(p)
        assert not set(picked) & other
        assert len(picked) == min(cold, n - len(other))


def test_a_holder_of_another_role_takes_no_hot_slot_from_one_that_can_serve() -> None:
    """Decode workers holding the prefix (KVCM lists them too) filled the hot set and pushed the
    prefill holder out, to be dropped for their role after their probes; now they are passed over."""
    fleet = fleet_of(12)
    w = fleet.workers
    decode = {w[0], w[1]}
    hosts = [
        HostMatch(w[0].http_target, local=10),
        HostMatch(w[1].http_target, local=10),
        HostMatch(w[2].http_target, local=9),
        HostMatch(w[3].http_target, local=8),
    ]
    assert hot_targets(plan(hosts, fleet, hot=2)) == [w[0].http_target, w[1].http_target]
    p = plan(hosts, fleet, hot=2, cold=4, unfit=decode.__contains__)
    assert hot_targets(p) == [w[2].http_target, w[3].http_target]
    assert not {c.worker for c in p.candidates} & decode  # nor a cold place
    assert [(d.target, d.dropped) for d in p.dropped] == [(w[0].http_target, "unfit"), (w[1].http_target, "unfit")]


def test_cold_order_reproducible_per_request_and_different_across_requests() -> None:
    fleet = fleet_of(50)
    orders = {tuple(cold_workers(plan([], fleet, f"req-{r}", cold=3))) for r in range(40)}
    assert len(orders) >= 35  # 50 × 49 × 48 possible orders
    for r in range(10):
        assert cold_workers(plan([], fleet, f"req-{r}", cold=3)) == cold_workers(
            plan([], fleet, f"req-{r}", cold=3)
        )
    # The namespace is part of the seed.
    config = replace(ScorerConfig(), cold_set_size=3)
    per_ns = {
        tuple(cold_workers(plan_candidates([], fleet, request_id="same", namespace=ns, config=config)))
        for ns in ("a", "b", "c", "d", "e")
    }
    assert len(per_ns) >= 4


def test_cold_order_does_not_depend_on_discovery_order() -> None:
    workers = [addr(i) for i in range(30)]
    shuffled = Fleet.of(reversed(workers))
    assert cold_workers(plan([], fleet_of(30), "r", cold=5)) == cold_workers(plan([], shuffled, "r", cold=5))


def test_of_workers_sharing_a_grpc_target_the_fleet_keeps_the_lowest_http_target() -> None:
    # The first in the canonical order (by HTTP target) is kept, whatever order discovery listed them in.
    low = WorkerAddr("10.0.0.1", 8000, 9000, 9000)
    high = WorkerAddr("10.0.0.1", 8010, 9000, 9000)
    assert Fleet.of([high, low]).workers == (low,)
    assert Fleet.of([low, high]).workers == (low,)


def test_cold_first_pick_is_spread_uniformly() -> None:
    fleet = fleet_of(10)
    firsts = Counter(cold_workers(plan([], fleet, f"r{r}", cold=1))[0] for r in range(2000))
    assert len(firsts) == 10
    assert min(firsts.values()) >= 150 and max(firsts.values()) <= 250  # 200 each expected


@given(n=st.integers(1, 60), hot=st.integers(0, 10), cold=st.integers(0, 70), ejected=st.integers(0, 60))
def test_cold_walk_takes_every_available_worker_once(n: int, hot: int, cold: int, ejected: int) -> None:
    fleet = fleet_of(n)
    hosts = [HostMatch(addr(i).http_target, local=1) for i in range(min(hot, n))]
    out = frozenset(addr(i) for i in range(n - min(ejected, n), n))
    p = plan(hosts, fleet, hot=hot, cold=cold, ejected=out)
    workers = [c.worker for c in p.candidates]
    assert len(workers) == len(set(workers))
    assert not set(workers) & out
    available = n - len(out | {addr(i) for i in range(min(hot, n))})
    assert len(cold_workers(p)) == min(cold, available)


def test_empty_fleet_and_empty_answer() -> None:
    assert plan([], Fleet.of([])).candidates == ()
    p = plan([HostMatch("10.0.0.1:8000", local=3)], Fleet.of([]))
    assert p.candidates == () and [d.dropped for d in p.dropped] == ["unknown_host"]


# --- cost independent of fleet size (P6) ----------------------------------------------------


class CountingSeq(Sequence[WorkerAddr]):
    def __init__(self, items: Sequence[WorkerAddr]) -> None:
        self.items = items
        self.reads = 0

    @overload
    def __getitem__(self, index: int) -> WorkerAddr: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[WorkerAddr]: ...
    def __getitem__(self, index: int | slice) -> WorkerAddr | Sequence[WorkerAddr]:
        if isinstance(index, slice):
            raise AssertionError("the plan must not slice the fleet")
        self.reads += 1
        return self.items[index]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[WorkerAddr]:
        raise AssertionError("the plan must not iterate the fleet")


class CountingMap(Mapping[str, WorkerAddr]):
    def __init__(self, entries: Mapping[str, WorkerAddr]) -> None:
        self.entries = entries
        self.reads = 0

    def __getitem__(self, key: str) -> WorkerAddr:
        self.reads += 1
        return self.entries[key]

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("the plan must not iterate the fleet")


@pytest.mark.parametrize("n", [8, 1000, 20_000])
def test_plan_examines_a_bounded_number_of_fleet_entries(n: int) -> None:
    base = fleet_of(n)
    workers = CountingSeq(base.workers)
    by_target = CountingMap(base.by_http_target)
    fleet = Fleet(workers, base.targets, by_target)
    # 6 hot holders, 1 of them ejected; 2 cold picks.
    hosts = [HostMatch(addr(i).http_target, local=10 + i) for i in range(6)]
    ejected = frozenset({addr(0)})
    for r in range(200):
        workers.reads = by_target.reads = 0
        p = plan(hosts, fleet, f"req-{r}", hot=8, cold=2, ejected=ejected)
        assert len(p.candidates) == min(7, n)
        # A lookup per reported host for the hot set and one for the cold set's matches, none per fleet worker.
        assert by_target.reads == 2 * len(hosts)
        # The walk reads the 2 picks plus the hot or ejected workers it steps on (at most 6),
        # whatever the fleet size.
        assert 2 <= workers.reads <= min(n, 2 + 6)


def test_a_cold_worker_the_answer_names_in_another_spelling_keeps_its_match() -> None:
    """The cold walk names workers by canonical target; the answer may spell one otherwise (an IPv6
    address written out in full): the cold candidate lost its match, and was scored with no hit."""
    workers = [WorkerAddr.from_http(f"2001:db8::{i}", 8000) for i in range(1, 5)]
    fleet = Fleet.of(workers)
    spelled_out = "[2001:0db8:0000:0000:0000:0000:0000:0002]:8000"
    hosts = (HostMatch("[2001:db8::1]:8000", 10, 0, 10), HostMatch(spelled_out, 9, 0, 9))
    plan = plan_candidates(
        hosts, fleet, request_id="r1", namespace="ns", config=ScorerConfig(hot_set_size=1, cold_set_size=3)
    )
    by_target = {c.target: c for c in plan.candidates}
    second = by_target["[2001:db8::2]:8000"]
    assert second.source is CandidateSource.COLD
    assert second.match is not None and second.match.local == 9


def test_a_cold_worker_named_twice_in_two_spellings_keeps_the_first_entry() -> None:
    workers = [WorkerAddr.from_http(f"2001:db8::{i}", 8000) for i in range(1, 5)]
    fleet = Fleet.of(workers)
    first = HostMatch("[2001:0db8:0000:0000:0000:0000:0000:0002]:8000", 7, 0, 7)
    later = HostMatch("[2001:db8::2]:8000", 3, 0, 3)
    hosts = (HostMatch("[2001:db8::1]:8000", 10, 0, 10), first, later)
    plan = plan_candidates(
        hosts, fleet, request_id="r1", namespace="ns", config=ScorerConfig(hot_set_size=1, cold_set_size=3)
    )
    second = {c.target: c for c in plan.candidates}["[2001:db8::2]:8000"]
    assert second.source is CandidateSource.COLD and second.match == first



def test_a_cold_worker_the_answer_lists_twice_keeps_the_first_entry() -> None:
    fleet = fleet_of(3)
    hot, twice = addr(0), addr(1)
    first = HostMatch(twice.http_target, 2)
    hosts = [HostMatch(hot.http_target, 5), first, HostMatch(twice.http_target, 1)]
    p = plan(hosts, fleet, hot=1, cold=2)
    cold = {c.target: c.match for c in p.candidates if c.source is CandidateSource.COLD}
    assert cold[twice.http_target] == first
