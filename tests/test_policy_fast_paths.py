"""The decision path's shortcuts against the straightforward rules they stand for (router/policy)."""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import given
from hypothesis import strategies as st

from router.config import ScorerConfig
from router.policy.cache_affinity import (
    ObservedStatus,
    StatusViews,
    TtftRow,
    cache_leader,
    hit_tokens,
    leader_order,
    score,
)
from router.policy.ledger import SelectionLedger
from router.policy.plan import Candidate, CandidatePlan, CandidateSource
from router.types import HostMatch, Role, WorkerAddr, WorkerStatus

ADDRESSES = [("10.0.0.1", 8000), ("10.0.0.2", 8000), ("10.0.0.3", 8000)]


def worker_status(version: int) -> WorkerStatus:
    return WorkerStatus(
        role=Role.PREFILL,
        role_reported="RoleType.PREFILL",
        alive=True,
        status_version=version,
        latest_finished_version=0,
    )


class WorkerKeyedViews:
    """The views looked up by worker alone: what StatusViews' index by status id must agree with."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.views: OrderedDict[WorkerAddr, ObservedStatus] = OrderedDict()

    def observe(self, worker: WorkerAddr, status: WorkerStatus, taken_at: float) -> ObservedStatus:
        cached = self.views.get(worker)
        if cached is not None and cached.status is status and cached.taken_at == taken_at:
            return cached
        fresh = ObservedStatus(status, taken_at)
        self.views.pop(worker, None)
        self.views[worker] = fresh
        if len(self.views) > self.bound:
            self.views.popitem(last=False)
        return fresh


# One call: (address, a fresh but equal address object?, status (one shared by every worker?), time).
calls = st.lists(
    st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 3), st.booleans(), st.sampled_from([0.0, 1.0])),
    max_size=40,
)


@given(bound=st.integers(1, 4), script=calls)
def test_status_views_reuse_exactly_what_a_lookup_by_worker_reuses(
    bound: int, script: list[tuple[int, bool, int, bool, float]]
) -> None:
    views, reference = StatusViews(bound), WorkerKeyedViews(bound)
    workers = [WorkerAddr.from_http(ip, port) for ip, port in ADDRESSES]
    statuses = {(w, s): worker_status(s) for w in range(3) for s in range(4)}
    shared = {s: worker_status(s) for s in range(4)}  # one status object passed for several workers
    seen: dict[int, int] = {}  # id(reference view) -> id(our view) of the call that made it
    made_by: dict[int, int] = {}  # the other way round
    kept: list[ObservedStatus] = []  # keeps every view alive, so ids stay unique in this test
    for w, fresh_address, s, is_shared, taken_at in script:
        worker = WorkerAddr.from_http(*ADDRESSES[w]) if fresh_address else workers[w]
        status = shared[s] if is_shared else statuses[(w, s)]
        ours, theirs = views.observe(worker, status, taken_at), reference.observe(worker, status, taken_at)
        kept += (ours, theirs)
        assert ours.status is status and ours.taken_at == taken_at
        assert ours.outstanding_uncached_tokens == theirs.outstanding_uncached_tokens
        # Reused when the reference reuses, and then the very view that call made.
        assert seen.setdefault(id(theirs), id(ours)) == id(ours)
        assert made_by.setdefault(id(ours), id(theirs)) == id(theirs)
        assert len(views) == len(reference.views)
        assert all(w in views and views[w].status is v.status for w, v in reference.views.items())


rows = st.lists(
    st.tuples(st.integers(0, 5), st.sampled_from([float("-inf"), 1.0, 2.0]), st.floats(0, 1), st.integers(0, 3)),
    min_size=1,
    max_size=8,
    unique_by=lambda row: row[3],
)


@given(ttft=rows, hits=st.lists(st.integers(0, 3), min_size=4, max_size=4))
def test_cache_leader_and_leader_order_are_the_full_leader_sort(ttft: list[TtftRow], hits: list[int]) -> None:
    ttft.sort()
    full = sorted(ttft, key=lambda row: (-hits[row[3]], *row))  # (−hit, work, last selected, tie, index)
    assert leader_order(ttft, hits) == full
    assert cache_leader(ttft, hits, max(hits[row[3]] for row in ttft)) == full[0]


@given(
    local=st.integers(-2, 40),
    p2p_extra=st.integers(-2, 40),
    block_size=st.integers(0, 32),
    seq_len=st.integers(0, 600),
    discount=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
)
def test_scored_hit_is_hit_tokens(local: int, p2p_extra: int, block_size: int, seq_len: int, discount: float) -> None:
    worker = WorkerAddr.from_http(*ADDRESSES[0])
    match = HostMatch(worker.http_target, local=local, p2p_total=local + p2p_extra)
    plan = CandidatePlan((Candidate(worker, worker.http_target, match, CandidateSource.HOT),))
    config = ScorerConfig(p2p_hit_discount=discount)
    selection = score(
        plan,
        {worker: ObservedStatus(worker_status(1), 0.0)},
        SelectionLedger(4, 4, status_horizon_s=0.0),
        config=config,
        roles=(Role.PREFILL,),
        seq_len=seq_len,
        block_size=block_size,
        lookahead_tokens=None,
        tie_rng=random.Random(0),
    )
    assert selection.hit_tokens == hit_tokens(match, block_size, seq_len, discount)
