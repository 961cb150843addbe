"""A decision packed for the sink's ring: read back equal, and one object the collector never walks."""

from __future__ import annotations

import gc

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from actors.metrics_sink import DecisionMade, DecisionRecord, MetricsSink
from router.config import MetricsConfig
from router.decision_pack import pack_decision, unpack_decision
from router.types import (
    CandidateExplain,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouteSource,
    SourceOutcome,
    SourceStep,
    SplitMode,
    Stage,
    StageWindow,
    WorkerAddr,
)

# Any str a caller may pass as an id (lone surrogates too: a JSON body can carry them), NUL included.
_text = st.text(st.characters(exclude_categories=()), max_size=12)
_count = st.integers(min_value=0, max_value=1 << 40)
_ms = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
_port = st.integers(min_value=1, max_value=65535)

_decisions = st.builds(
    RouteDecision,
    request_id=_text,
    worker=st.none() | st.builds(WorkerAddr, ip=_text, http_port=_port, grpc_port=_port, status_port=_port),
    role=st.none() | st.sampled_from(Role),
    route_source=st.sampled_from(RouteSource),
    reason=st.sampled_from(Reason),
    hit_tokens=_count,
    local_blocks=_count,
    elapsed_ms=_ms,
    stage_ms=st.dictionaries(st.sampled_from(Stage), _ms),
    candidates=st.lists(
        st.builds(
            CandidateExplain,
            target=_text,
            source=st.sampled_from(("hot", "cold", "shadow")),
            local_blocks=_count,
            hit_tokens=_count,
            work_tokens=st.none() | _count,
            role=st.none() | _text,
            dropped=st.none() | _text,
            chosen=st.booleans(),
        ),
        max_size=5,
    ).map(tuple),
    error=st.none() | _text,
    sources=st.lists(
        st.builds(
            SourceStep,
            source=st.sampled_from(RouteSource),
            outcome=st.sampled_from(SourceOutcome),
            reason=st.none() | st.sampled_from(Reason),
            elapsed_ms=_ms,
        ),
        max_size=4,
    ).map(tuple),
    role_addrs=st.lists(
        st.builds(RoleAddr, role=st.sampled_from(Role), ip=_text, http_port=_port, grpc_port=_port), max_size=3
    ).map(tuple),
    error_code=st.integers(min_value=-(1 << 31), max_value=1 << 31),
    split=st.none() | st.sampled_from(SplitMode),
    windows=st.lists(
        st.builds(StageWindow, stage=st.sampled_from(Stage), end_ms=_ms, cut=st.booleans()), max_size=3
    ).map(tuple),
)


@given(decision=_decisions, at=st.floats(allow_nan=False))
def test_a_packed_decision_reads_back_equal_with_the_time_it_was_kept(decision: RouteDecision, at: float) -> None:
    back, kept_at = unpack_decision(pack_decision(decision, at))
    assert back == decision and kept_at == at
    # Equal is not enough where the type carries meaning: members, not their values; addresses whole.
    assert [type(stage) for stage in back.stage_ms] == [Stage] * len(back.stage_ms)
    assert back.worker is None or hash(back.worker) == hash(decision.worker)


async def test_the_ring_keeps_each_decision_as_one_object_the_collector_does_not_track(
    autojump_clock: trio.testing.MockClock,
) -> None:
    decision = RouteDecision(
        "r1",
        WorkerAddr("10.0.0.1", 8000, 8001, 8001),
        Role.PREFILL,
        RouteSource.KVCM,
        Reason.CACHE_LEADER,
        stage_ms={Stage.TOTAL: 1.5},
        candidates=(CandidateExplain("10.0.0.1:8000", "hot", 3, 192, 0, "PREFILL", None, True),),
        sources=(SourceStep(RouteSource.KVCM, SourceOutcome.ANSWERED, Reason.CACHE_LEADER, 1.2),),
        windows=(StageWindow(Stage.CACHE_QUERY, 45.0, False),),
    )
    sink = MetricsSink(MetricsConfig(decision_ring_size=4))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for _ in range(6):
            sink.emit(DecisionMade(decision))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    kept = sink.recent_decisions(10)
    assert len(kept) == 4
    assert not any(gc.is_tracked(entry) for entry in kept)
    assert DecisionRecord.unpacked(kept[0]).decision == decision
