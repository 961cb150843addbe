"""MetricsSink: exact counts after scripted event sequences, drops when full, scrape-time gauges, the ring."""

from __future__ import annotations

from dataclasses import replace

import pytest
import trio
import trio.testing
from prometheus_client import generate_latest

from actors.breaker import BreakerState
from actors.metrics_sink import (
    BREAKER_STATE_VALUES,
    SOURCE_GAUGES,
    BackgroundProbes,
    CandidatesDropped,
    ChannelEvicted,
    DecisionMade,
    DecisionRecord,
    HitObserved,
    KvcmRequest,
    LeaderChanged,
    MetricEvent,
    MetricsSink,
    ProbeSkipped,
    RepliesSent,
    ShadowAgreement,
    StatusLookups,
    retained_decision,
)
from router.config import MetricsConfig, RouterConfig
from router.types import (
    CandidateExplain,
    Reason,
    Role,
    RouteDecision,
    RouteSource,
    SourceOutcome,
    SourceStep,
    Stage,
    StageWindow,
    WorkerAddr,
    cut_text,
)

W1 = WorkerAddr.from_http("10.0.0.1", 8000)


def decision(
    n: int,
    source: RouteSource = RouteSource.KVCM,
    reason: Reason = Reason.CACHE_LEADER,
    stage_ms: dict[Stage, float] | None = None,
    dropped: tuple[str, ...] = (),
    elapsed_ms: float = 3.0,
    sources: tuple[SourceStep, ...] = (),
) -> RouteDecision:
    candidates = tuple(
        CandidateExplain(f"10.0.0.{i + 2}:8000", "hot", 0, 0, None, None, dropped=reason_word)
        for i, reason_word in enumerate(dropped)
    )
    return RouteDecision(
        request_id=f"r{n}",
        worker=W1,
        role=Role.PREFILL,
        route_source=source,
        reason=reason,
        elapsed_ms=elapsed_ms,
        stage_ms=stage_ms if stage_ms is not None else {},
        candidates=candidates,
        sources=sources,
    )


def kept(sink: MetricsSink, limit: int) -> list[DecisionRecord]:
    """The sink's last ``limit`` kept decisions, unpacked, newest first."""
    return [DecisionRecord.unpacked(packed) for packed in sink.recent_decisions(limit)]


def sample(sink: MetricsSink, name: str, **labels: str) -> float | None:
    return sink.registry.get_sample_value(name, labels)


async def test_scripted_events_give_exact_counts(autojump_clock: trio.testing.MockClock) -> None:
    sink = MetricsSink(MetricsConfig(inbox_size=64))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        sink.emit(
            DecisionMade(
                decision(
                    1,
                    stage_ms={
                        Stage.KEYS: 0.05,
                        Stage.LEADER: 0.2,
                        Stage.CACHE_QUERY: 2.0,
                        Stage.PROBE: 7.0,
                        Stage.SCORE: 0.08,
                    },
                    dropped=("block_size_mismatch", "not_alive", "block_size_mismatch"),
                    elapsed_ms=9.5,
                ),
                # The scoring counts its drops (the decision's candidates are only what it explains).
                (CandidatesDropped("block_size_mismatch", 2), CandidatesDropped("not_alive", 1)),
            )
        )
        sink.emit(DecisionMade(decision(2, RouteSource.DOMAIN, Reason.BREAKER_OPEN, {Stage.TOTAL: 0.3})))
        sink.emit(DecisionMade(decision(3, RouteSource.DOMAIN, Reason.BREAKER_OPEN)))
        chain = (
            SourceStep(RouteSource.KVCM, SourceOutcome.FELL_THROUGH, Reason.KVCM_ERROR, 1.0),
            SourceStep(RouteSource.SHADOW, SourceOutcome.ANSWERED, Reason.CACHE_LEADER, 2.0),
        )
        sink.emit(DecisionMade(decision(4, RouteSource.SHADOW, Reason.KVCM_ERROR, sources=chain)))
        for outcome in ("ok", "ok", "not_leader"):
            sink.emit(KvcmRequest("GetHostCacheState", outcome))
        sink.emit(KvcmRequest("GetClusterInfo", "unavailable"))
        sink.emit(ProbeSkipped("deadline", 3))
        sink.emit(ProbeSkipped("deadline"))
        sink.emit(ProbeSkipped("ejected", 2))
        sink.emit(StatusLookups(5, from_background=4, probed=2))
        sink.emit(StatusLookups())
        sink.emit(BackgroundProbes("refresh", 3))
        sink.emit(LeaderChanged("10.0.0.9:6381"))
        sink.emit(LeaderChanged("10.0.0.8:6381"))
        sink.emit(ChannelEvicted("lru"))
        sink.emit(ChannelEvicted("idle", 4))
        for ratio, error in ((1.0, 0), (0.0, 128), (1.0, 16), (1.0, 0)):
            sink.emit(ShadowAgreement(ratio, error))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()

    decisions = "kvroute_route_decisions_total"
    assert sample(sink, decisions, route_source="kvcm", reason="CACHE_LEADER") == 1
    assert sample(sink, decisions, route_source="domain", reason="breaker_open") == 2
    assert sample(sink, decisions, route_source="shadow", reason="kvcm_error") == 1
    assert sample(sink, decisions, route_source="kvcm", reason="SHORTEST_TTFT") is None

    hist = "kvroute_route_duration_seconds"
    for stage in ("keys", "leader", "cache_query", "probe", "score"):
        assert sample(sink, f"{hist}_count", stage=stage) == 1, stage
    assert sample(sink, f"{hist}_bucket", stage="keys", le="0.0001") == 1  # 50 µs
    assert sample(sink, f"{hist}_bucket", stage="leader", le="0.0001") == 0  # 200 µs
    assert sample(sink, f"{hist}_bucket", stage="leader", le="0.00025") == 1
    assert sample(sink, f"{hist}_bucket", stage="probe", le="0.005") == 0
    assert sample(sink, f"{hist}_bucket", stage="probe", le="0.01") == 1
    # total: elapsed_ms of decisions 1, 3, 4 (no "total" stage) + the explicit total of decision 2.
    assert sample(sink, f"{hist}_count", stage="total") == 4
    assert sample(sink, f"{hist}_sum", stage="total") == pytest.approx((9.5 + 0.3 + 3.0 + 3.0) / 1000)
    stages = {"keys", "leader", "cache_query", "plan", "probe", "score", "total", "tail"}
    assert {stage.value for stage in Stage} == stages

    steps = "kvroute_source_outcomes_total"
    assert sample(sink, steps, source="kvcm", outcome="fell_through", reason="kvcm_error") == 1
    assert sample(sink, steps, source="shadow", outcome="answered", reason="CACHE_LEADER") == 1
    assert sample(sink, steps, source="domain", outcome="answered", reason="breaker_open") is None

    assert sample(sink, "kvroute_candidates_dropped_total", reason="block_size_mismatch") == 2
    assert sample(sink, "kvroute_candidates_dropped_total", reason="not_alive") == 1
    kvcm = "kvroute_kvcm_requests_total"
    assert sample(sink, kvcm, method="GetHostCacheState", outcome="ok") == 2
    assert sample(sink, kvcm, method="GetHostCacheState", outcome="not_leader") == 1
    assert sample(sink, kvcm, method="GetClusterInfo", outcome="unavailable") == 1
    assert sample(sink, "kvroute_probe_skipped_total", reason="deadline") == 4
    assert sample(sink, "kvroute_probe_skipped_total", reason="ejected") == 2
    assert sample(sink, "kvroute_worker_status_cache_hits_total") == 6
    assert sample(sink, "kvroute_worker_status_fresh_from_background_total") == 4
    assert sample(sink, "kvroute_probes_per_request_count") == 2
    assert sample(sink, "kvroute_probes_per_request_sum") == 2
    assert sample(sink, "kvroute_probe_background_total", kind="refresh") == 3
    assert sample(sink, "kvroute_kvcm_leader_changes_total") == 2
    assert sample(sink, "kvroute_channel_pool_evictions_total", reason="lru") == 1
    assert sample(sink, "kvroute_channel_pool_evictions_total", reason="idle") == 4
    assert sample(sink, "kvroute_shadow_agreement_ratio") == 0.75
    assert sample(sink, "kvroute_shadow_hit_error_tokens_sum") == 144
    assert sample(sink, "kvroute_shadow_hit_error_tokens_bucket", le="16.0") == 3
    assert sample(sink, "kvroute_shadow_comparisons_total") == 4
    assert sample(sink, "kvroute_metrics_events_dropped_total") == 0
    snap = sink.snapshot()
    assert (snap.processed, snap.dropped, snap.last_leader, snap.decisions_kept) == (22, 0, "10.0.0.8:6381", 4)


async def test_only_a_predicted_hit_the_worker_did_not_find_is_a_silent_zero(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The silent-zero signal (a wrong key family or block size: the router predicts hits no worker
    finds) counts a predicted hit the worker reported none of; a cold request (none predicted, none
    found) is no such sign, and counted it would raise the alarm on every cold prompt."""
    sink = MetricsSink(MetricsConfig(inbox_size=64))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for predicted, actual in ((64, 0), (0, 0), (64, 32), (0, 16), (128, 0)):
            sink.emit(HitObserved("kvcm", predicted, actual))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert sample(sink, "kvroute_hit_silent_zero_total", route_source="kvcm") == 2
    assert sample(sink, "kvroute_hit_actual_over_predicted_count", route_source="kvcm") == 5  # every one seen


async def test_full_inbox_drops_and_counts_and_never_waits(autojump_clock: trio.testing.MockClock) -> None:
    sink = MetricsSink(MetricsConfig(inbox_size=4))
    start = trio.current_time()
    for n in range(10):  # no consumer yet: 4 fit, 6 are dropped
        sink.emit(DecisionMade(decision(n)))
    assert trio.current_time() == start
    assert sample(sink, "kvroute_metrics_events_dropped_total") == 6
    assert sink.inbox_depth() == 4
    assert sample(sink, "kvroute_inbox_depth", actor="metrics_sink") == 4  # read at scrape time
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await trio.testing.wait_all_tasks_blocked()
        assert sample(sink, "kvroute_route_decisions_total", route_source="kvcm", reason="CACHE_LEADER") == 4
        assert [r.decision.request_id for r in kept(sink, 10)] == ["r3", "r2", "r1", "r0"]
        # The consumer is waiting now: one more event is handed over, not dropped.
        sink.emit(StatusLookups())
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    snap = sink.snapshot()
    assert (snap.processed, snap.dropped, snap.inbox_peak, snap.inbox_depth, snap.inbox_capacity) == (
        5,
        6,
        4,
        0,
        4,
    )
    assert sample(sink, "kvroute_metrics_events_dropped_total") == 6
    assert sample(sink, "kvroute_inbox_depth", actor="metrics_sink") == 0


async def test_run_can_be_restarted_and_keeps_its_state(autojump_clock: trio.testing.MockClock) -> None:
    sink = MetricsSink(MetricsConfig(inbox_size=8))
    for _ in range(2):
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            sink.emit(StatusLookups(2))
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        sink.emit(StatusLookups(1))  # queued while no run() is alive; the next run applies it
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert sample(sink, "kvroute_worker_status_cache_hits_total") == 6


async def test_a_decision_of_seconds_lands_in_a_bucket_of_its_own(autojump_clock: trio.testing.MockClock) -> None:
    """The buckets stopped at 250 ms while the budget cap may be seconds: a deployment whose master
    answers in 400 ms had every decision in +Inf, every quantile read as 250 ms."""
    sink = MetricsSink(MetricsConfig())
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        sink.emit(DecisionMade(decision(1, stage_ms={Stage.TOTAL: 400.0}, elapsed_ms=400.0)))
        sink.emit(DecisionMade(decision(2, stage_ms={Stage.TOTAL: 3000.0}, elapsed_ms=3000.0)))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    name = "kvroute_route_duration_seconds_bucket"
    assert sample(sink, name, stage="total", le="0.25") == 0
    assert sample(sink, name, stage="total", le="0.5") == 1
    assert sample(sink, name, stage="total", le="2.5") == 1
    assert sample(sink, name, stage="total", le="10.0") == 2


async def test_decision_ring_is_bounded_newest_first(autojump_clock: trio.testing.MockClock) -> None:
    sink = MetricsSink(MetricsConfig(inbox_size=16, decision_ring_size=3))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for n in range(5):
            sink.emit(DecisionMade(decision(n)))
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    records = kept(sink, 10)
    assert [r.decision.request_id for r in records] == ["r4", "r3", "r2"]
    assert records[0].at - records[1].at == 1.0
    assert [r.decision.request_id for r in kept(sink, 2)] == ["r4", "r3"]
    assert sink.recent_decisions(0) == []


async def test_shadow_agreement_is_a_sliding_window(autojump_clock: trio.testing.MockClock) -> None:
    sink = MetricsSink(MetricsConfig(shadow_agreement_window=2))
    assert sample(sink, "kvroute_shadow_agreement_ratio") == 0.0  # before the first comparison
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        sink.emit(ShadowAgreement(1.0))
        sink.emit(ShadowAgreement(0.0))
        await trio.testing.wait_all_tasks_blocked()
        assert sample(sink, "kvroute_shadow_agreement_ratio") == 0.5
        sink.emit(ShadowAgreement(0.0))
        await trio.testing.wait_all_tasks_blocked()
        assert sample(sink, "kvroute_shadow_agreement_ratio") == 0.0
        sink.emit(ShadowAgreement(7.0))  # clamped to 1
        await trio.testing.wait_all_tasks_blocked()
        assert sample(sink, "kvroute_shadow_agreement_ratio") == 0.5
        nursery.cancel_scope.cancel()


def test_gauge_sources_are_read_at_scrape_time() -> None:
    sink = MetricsSink(MetricsConfig())
    state = {"inflight": 3, "ejected": 1}
    sink.register_gauge_source("kvroute_probe_inflight", lambda: state["inflight"])
    sink.register_gauge_source("kvroute_workers_ejected", lambda: state["ejected"])
    sink.register_gauge_source("kvroute_inbox_depth", lambda: 7, actor="router")
    sink.register_gauge_source("kvroute_kvcm_breaker_state", lambda: 2)
    assert sample(sink, "kvroute_probe_inflight") == 3
    state["inflight"] = 16
    assert sample(sink, "kvroute_probe_inflight") == 16
    assert sample(sink, "kvroute_inbox_depth", actor="router") == 7
    assert sample(sink, "kvroute_inbox_depth", actor="metrics_sink") == 0
    # Re-registering (an actor restarted) replaces the source.
    sink.register_gauge_source("kvroute_workers_ejected", lambda: 0)
    assert sample(sink, "kvroute_workers_ejected") == 0
    # The four registered here, and the sink's own two (its inbox depth, the shadow agreement ratio).
    assert sink.snapshot().gauge_sources == 6
    assert sample(sink, "kvroute_channel_pool_channels") is None  # declared, no source yet
    assert b"# TYPE kvroute_channel_pool_channels gauge" in generate_latest(sink.registry)


def test_a_failing_gauge_source_is_left_out_of_the_scrape() -> None:
    sink = MetricsSink(MetricsConfig())

    def broken() -> float:
        raise RuntimeError("snapshot failed")

    sink.register_gauge_source("kvroute_channel_pool_channels", broken)
    sink.register_gauge_source("kvroute_probe_inflight", lambda: 1)
    text = generate_latest(sink.registry).decode()
    assert "kvroute_probe_inflight 1.0" in text
    assert "\nkvroute_channel_pool_channels " not in text


def test_gauge_registration_rejects_unknown_names_and_labels() -> None:
    sink = MetricsSink(MetricsConfig())
    for name, labels in (
        ("kvroute_nope", {}),
        ("kvroute_inbox_depth", {}),
        ("kvroute_probe_inflight", {"actor": "x"}),
    ):
        try:
            sink.register_gauge_source(name, lambda: 0, **labels)
        except ValueError as exc:
            assert name in str(exc)
        else:
            raise AssertionError(f"{name} {labels} accepted")


def test_registries_are_per_sink() -> None:
    a, b = MetricsSink(MetricsConfig(inbox_size=1)), MetricsSink(MetricsConfig(inbox_size=1))
    a.emit(StatusLookups())
    a.emit(StatusLookups())  # dropped: full
    assert sample(a, "kvroute_metrics_events_dropped_total") == 1
    assert sample(b, "kvroute_metrics_events_dropped_total") == 0


# --- what the ring keeps -----------------------------------------------------------------------------


def test_cut_text_keeps_short_text_and_marks_what_it_cut() -> None:
    assert cut_text("abc", 32) == "abc"
    cut = cut_text("x" * 1000, 32)
    assert len(cut) == 32 and cut.endswith("…[cut: 1000 chars]") and cut.startswith("xxxx")


def test_retained_decision_cuts_ids_and_errors_and_caps_candidates_keeping_the_chosen() -> None:
    d = decision(1, dropped=("busy",) * 40)
    chosen = replace(d.candidates[-1], dropped=None, chosen=True)
    d = replace(d, request_id="i" * 10_000, error="e" * 10_000, candidates=(*d.candidates[:-1], chosen))
    kept = retained_decision(d, text_chars=64, max_candidates=8)
    assert len(kept.request_id) == 64 and kept.request_id.endswith("[cut: 10000 chars]")
    assert kept.error is not None and len(kept.error) == 64
    assert len(kept.candidates) == 8 and kept.candidates[-1] is chosen
    small = decision(2)
    assert retained_decision(small, text_chars=64, max_candidates=8) is small  # nothing over a bound: no copy


async def test_the_ring_keeps_decisions_cut_to_their_bounds(autojump_clock: trio.testing.MockClock) -> None:
    sink = MetricsSink(MetricsConfig(decision_ring_size=2, decision_text_chars=100, decision_max_candidates=3))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sink.run)
        huge = replace(decision(1, dropped=("busy",) * 50), request_id="i" * 4_000_000)
        sink.emit(DecisionMade(huge))
        await trio.testing.wait_all_tasks_blocked()
        [record] = kept(sink, 1)
        assert len(record.decision.request_id) == 100
        assert len(record.decision.candidates) == 3
        nursery.cancel_scope.cancel()


# --- pins: the estimates, the ring's bounds, the labels and buckets ----------------------------------


async def applied(sink: MetricsSink, *events: MetricEvent) -> MetricsSink:
    """``sink`` after its run() has applied ``events``, each in a drained batch of its own."""
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for event in events:
            sink.emit(event)
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return sink


async def test_reply_times_alone_republish_the_split_estimates(autojump_clock: trio.testing.MockClock) -> None:
    """A transport's first reply times make the tail cold until it has enough of them, and enough make
    it the router's part plus theirs: both published with no decision in the same batch."""
    sink = MetricsSink(MetricsConfig(), split=replace(RouterConfig(), split_min_samples=2))
    stages = {Stage.CACHE_QUERY: 5.0, Stage.PROBE: 0.5, Stage.SCORE: 0.2, Stage.TAIL: 1.0}
    await applied(sink, DecisionMade(decision(1, stage_ms=stages)), DecisionMade(decision(2, stage_ms=stages)))
    assert sink.split_estimates().tail == pytest.approx(0.001)
    await applied(sink, RepliesSent((0.002,)))
    assert sink.split_estimates().tail is None
    await applied(sink, RepliesSent((0.002,)))
    assert sink.split_estimates().tail == pytest.approx(0.003)


async def test_a_query_after_the_masters_attempt_is_learnt_within_what_its_window_left_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The master's attempt is no stage: the sink tells the split what it took, or a stalled query's
    sample was capped as though its window had the master's time too."""
    split = replace(RouterConfig(), split_min_samples=1)
    sink = MetricsSink(MetricsConfig(), split=split)
    master = SourceStep(RouteSource.MASTER, SourceOutcome.FELL_THROUGH, Reason.DEADLINE, 30.0)
    d = replace(
        decision(1, stage_ms={Stage.CACHE_QUERY: 45.0, Stage.TAIL: 1.0}, sources=(master,)),
        windows=(StageWindow(Stage.CACHE_QUERY, 45.0, False),),
    )
    await applied(sink, DecisionMade(d))
    assert sink.split_estimates().query == pytest.approx(0.015 * (1 + split.split_deviations / 2))


def test_retained_decision_cuts_a_long_error_alone() -> None:
    d = replace(decision(1), error="e" * 100_000)
    kept = retained_decision(d, text_chars=64, max_candidates=8)
    assert kept.error is not None and len(kept.error) == 64 and kept.error.endswith("[cut: 100000 chars]")
    assert kept.request_id == "r1"


def _candidates(n: int, chosen_at: int) -> tuple[CandidateExplain, ...]:
    return tuple(
        CandidateExplain(f"10.0.1.{i}:8000", "hot", 0, 0, None, None, None, chosen=i == chosen_at) for i in range(n)
    )


def test_retained_decision_keeps_the_chosen_candidate_just_past_the_cap() -> None:
    candidates = _candidates(5, chosen_at=3)
    kept = retained_decision(replace(decision(1), candidates=candidates), text_chars=64, max_candidates=3)
    assert kept.candidates == (*candidates[:2], candidates[3])


async def test_a_ring_keeping_no_candidates_keeps_a_decision_with_a_chosen_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sink = MetricsSink(MetricsConfig(decision_max_candidates=0))
    await applied(sink, DecisionMade(replace(decision(1), candidates=_candidates(3, chosen_at=2))), StatusLookups())
    [record] = kept(sink, 1)
    assert record.decision.request_id == "r1" and record.decision.candidates == ()
    assert sink.snapshot().processed == 2  # the sink went on to the next event


@pytest.mark.parametrize(
    ("state", "value"), [(BreakerState.CLOSED, 0), (BreakerState.HALF_OPEN, 1), (BreakerState.OPEN, 2)]
)
def test_a_breakers_state_scrapes_as_its_help_text_says(state: BreakerState, value: float) -> None:
    sink = MetricsSink(MetricsConfig())
    for name in ("kvroute_kvcm_breaker_state", "kvroute_master_breaker_state"):
        sink.register_gauge_source(name, lambda: BREAKER_STATE_VALUES[state.value])
        assert f"{value} {state.value.replace('_', '-')}" in SOURCE_GAUGES[name][0]
        assert f"\n{name} {float(value)}\n" in generate_latest(sink.registry).decode()


async def test_hit_accuracy_keeps_the_route_source_it_was_observed_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    observed = (HitObserved("shadow", 64, 0), HitObserved("shadow", 96, 0), HitObserved("shadow", 64, 80))
    sink = await applied(MetricsSink(MetricsConfig()), *observed)
    assert sample(sink, "kvroute_hit_silent_zero_total", route_source="shadow") == 2
    for name in ("kvroute_hit_silent_zero_total", "kvroute_hit_actual_over_predicted_count"):
        assert sample(sink, name, route_source="kvcm") is None, name
    assert sample(sink, "kvroute_hit_actual_over_predicted_count", route_source="shadow") == 3
    # One error observation per hit, a silent zero's the whole predicted hit.
    assert sample(sink, "kvroute_hit_error_tokens_count", route_source="shadow") == 3
    assert sample(sink, "kvroute_hit_error_tokens_sum", route_source="shadow") == 64 + 96 + 16


async def test_an_exact_hit_is_told_apart_from_a_small_miss(autojump_clock: trio.testing.MockClock) -> None:
    sink = await applied(MetricsSink(MetricsConfig()), HitObserved("master", 64, 64))
    bucket = "kvroute_hit_actual_over_predicted_bucket"
    assert sample(sink, bucket, route_source="master", le="0.9") == 0
    assert sample(sink, bucket, route_source="master", le="1.0") == 1


async def test_a_decision_of_minutes_lands_in_a_bucket_of_its_own(autojump_clock: trio.testing.MockClock) -> None:
    """The largest cap a setting allows is 600 s: a decision of minutes is not read as the 10 s bucket."""
    sink = await applied(
        MetricsSink(MetricsConfig()),
        DecisionMade(decision(1, stage_ms={Stage.TOTAL: 30_000.0})),
        DecisionMade(decision(2, stage_ms={Stage.TOTAL: 300_000.0})),
    )
    name = "kvroute_route_duration_seconds_bucket"
    assert sample(sink, name, stage="total", le="10.0") == 0
    assert sample(sink, name, stage="total", le="60.0") == 1
    assert sample(sink, name, stage="total", le="600.0") == 2


async def test_a_source_step_without_a_reason_has_an_empty_reason_label(
    autojump_clock: trio.testing.MockClock,
) -> None:
    step = SourceStep(RouteSource.MASTER, SourceOutcome.FELL_THROUGH, None, 1.0)
    sink = await applied(MetricsSink(MetricsConfig()), DecisionMade(decision(1, sources=(step,))))
    assert sample(sink, "kvroute_source_outcomes_total", source="master", outcome="fell_through", reason="") == 1


async def test_a_negative_agreement_counts_as_none_in_the_window(autojump_clock: trio.testing.MockClock) -> None:
    sink = MetricsSink(MetricsConfig(shadow_agreement_window=2))
    await applied(sink, ShadowAgreement(-1.0), ShadowAgreement(1.0))
    assert sample(sink, "kvroute_shadow_agreement_ratio") == 0.5
