"""The deadline split: the pure rule and estimates, and its gain over the fixed split under MockClock."""

from __future__ import annotations

import io
from dataclasses import replace

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from actors.metrics_sink import DecisionMade, MetricsSink
from kvroute_sim.demo import split_budget
from router.config import DeadlineSplit, MetricsConfig, RouterConfig
from router.policy.deadline_split import COLD, SplitEstimates, SplitEstimator, StageLatency, split_windows
from router.transport.memory_adapter import MemoryNetwork
from router.types import Reason, RouteDecision, RouteSource, SplitMode, Stage, StageWindow

LEARNED = RouterConfig(deadline_split=DeadlineSplit.LEARNED)
FIXED = RouterConfig(deadline_split=DeadlineSplit.FIXED)
WARM = SplitEstimates(query=0.010, probe=0.003, score=0.0005, tail=0.0015)


def test_the_fixed_split_ends_every_wait_at_decide_at() -> None:
    w = split_windows(10.0, 10.050, WARM, FIXED)
    assert w.mode is SplitMode.FIXED
    assert w.leader_end == w.query_end == w.probe_end == 10.050 - 0.005  # reserve max(1 ms, 10 %)


def test_the_learned_split_without_estimates_is_the_fixed_one() -> None:
    cold = split_windows(10.0, 10.050, COLD, LEARNED)
    assert cold.mode is SplitMode.COLD
    assert (cold.leader_end, cold.query_end, cold.probe_end) == (10.045, 10.045, 10.045)


def test_the_learned_split_leaves_each_later_stage_its_estimate_and_never_ends_before_decide_at() -> None:
    fast = SplitEstimates(query=0.002, probe=0.001, score=0.0005, tail=0.0015)
    w = split_windows(10.0, 10.050, fast, LEARNED)
    assert w.mode is SplitMode.LEARNED
    assert w.probe_end == 10.050 - 0.0015  # the tail: from the probes' end to the reply leaving
    assert w.query_end == w.probe_end - 0.001
    assert w.leader_end == w.query_end - 0.002
    slow = split_windows(10.0, 10.050, WARM, LEARNED)  # the later stages need more than the reserve
    assert slow.leader_end == 10.045 and slow.query_end > 10.045  # the fixed split's end at the least


def test_the_last_window_leaves_at_least_reserve_min_and_a_cold_tail_is_the_fixed_split() -> None:
    quick = split_windows(10.0, 10.050, replace(WARM, tail=0.0001), LEARNED)
    assert quick.probe_end == 10.050 - 0.001  # reserve_min, not the 0.1 ms tail
    slow = split_windows(10.0, 10.050, replace(WARM, tail=0.008), LEARNED)  # longer than the fixed 5 ms
    assert slow.leader_end == slow.query_end == slow.probe_end == 10.050 - 0.008  # the reply must leave by then
    cold = split_windows(10.0, 10.050, replace(WARM, tail=None), LEARNED)
    assert cold.mode is SplitMode.COLD
    assert cold.leader_end == cold.query_end == cold.probe_end == 10.045  # the fixed reserve


@given(
    st.floats(0, 1, allow_nan=False),
    st.floats(0, 1, allow_nan=False),
    st.floats(0, 1, allow_nan=False),
    st.floats(0, 10, allow_nan=False),
)
def test_a_window_only_ever_shortens_the_deadline(query: float, probe: float, tail: float, budget: float) -> None:
    for config in (LEARNED, FIXED):
        estimates = SplitEstimates(query=query, probe=probe, score=tail, tail=tail)
        w = split_windows(5.0, 5.0 + budget, estimates, config)
        assert w.leader_end <= w.query_end <= w.probe_end <= 5.0 + budget
        reserve_min = config.reserve_min_ms / 1000.0
        assert 5.0 + budget - w.probe_end >= min(budget, reserve_min) - 1e-12  # never below reserve_min


def test_an_estimate_follows_a_sudden_change_within_a_few_samples() -> None:
    latency = StageLatency(RouterConfig().split_estimate_weight, RouterConfig().split_deviations)
    for _ in range(20):
        latency.observe(0.002)
    assert abs(latency.high - 0.002) < 0.0001  # the first sample's guessed deviation has decayed
    for _ in range(3):
        latency.observe(0.020)
    assert latency.high >= 0.015  # three slow samples moved it most of the way (and past the mean)
    for _ in range(20):  # back down: the slow samples fade
        latency.observe(0.002)
    assert latency.high < 0.003


def test_a_censored_sample_below_the_estimate_changes_nothing_and_one_above_raises_it() -> None:
    latency = StageLatency(0.25, 2.0)
    for _ in range(10):
        latency.observe(0.010)
    before = latency.high
    for _ in range(100):  # cut after 1 ms, or exactly at the estimate: no runaway either way
        latency.observe(0.001, censored=True)
    assert latency.high == before
    latency.observe(0.030, censored=True)  # cut after 30 ms: at least that slow
    assert latency.high > before
    for _ in range(100):  # a stage that hangs, cut after the same 47 ms every time
        latency.observe(0.047, censored=True)
    assert 0.047 <= latency.high < 0.07  # at least what it was given, and no ratchet beyond


def test_a_stage_no_request_reaches_is_forgotten_so_the_split_goes_cold() -> None:
    config = replace(RouterConfig(), split_min_samples=2)
    estimator = SplitEstimator(config)
    full = {Stage.CACHE_QUERY: 10.0, Stage.PLAN: 0.1, Stage.PROBE: 30.0, Stage.SCORE: 0.2, Stage.TAIL: 0.5}
    for _ in range(2):
        estimator.observe(full, ())
    assert estimator.estimates().warm
    cut_query = {Stage.CACHE_QUERY: 15.0}  # the split cut the query: probes and score never ran
    for _ in range(SplitEstimator.STALE_AFTER * config.split_min_samples):
        estimator.observe(cut_query, (StageWindow(Stage.CACHE_QUERY, 15.0, True),))
    assert estimator.estimates().warm
    estimator.observe(cut_query, (StageWindow(Stage.CACHE_QUERY, 15.0, True),))
    assert not estimator.estimates().warm  # cold: the fixed split lets the next requests reach the probes


def test_each_stage_needs_its_samples_before_the_split_uses_it() -> None:
    estimator = SplitEstimator(replace(RouterConfig(), split_min_samples=3))
    stages = {Stage.CACHE_QUERY: 10.0, Stage.PLAN: 0.1, Stage.PROBE: 2.0, Stage.SCORE: 0.2, Stage.TAIL: 0.5}
    for _ in range(2):
        estimator.observe(stages, ())
    assert not estimator.estimates().warm
    estimator.observe(stages, ())
    e = estimator.estimates()
    assert e.warm and e.probe is not None and e.probe >= 0.0021  # plan + probes, at least as observed


async def test_the_sink_counts_cuts_per_stage_and_publishes_estimates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sink = MetricsSink(MetricsConfig(), split=replace(RouterConfig(), split_min_samples=1))
    assert sink.split_estimates() == COLD
    decision = RouteDecision(
        "r",
        None,
        None,
        RouteSource.DOMAIN,
        Reason.DEADLINE,
        stage_ms={Stage.CACHE_QUERY: 45.0, Stage.PLAN: 0.0, Stage.PROBE: 2.0, Stage.SCORE: 0.1, Stage.TAIL: 0.3},
        split=SplitMode.FIXED,
        windows=(StageWindow(Stage.CACHE_QUERY, 45.0, True), StageWindow(Stage.PROBE, 45.0, False)),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        sink.emit(DecisionMade(decision))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    cuts = "kvroute_deadline_split_cuts_total"
    assert sink.registry.get_sample_value(cuts, {"stage": "cache_query"}) == 1
    assert sink.registry.get_sample_value(cuts, {"stage": "probe"}) == 0
    assert sink.split_estimates().warm


def test_with_kvcm_near_the_budget_the_learned_split_keeps_more_requests_on_kvcm() -> None:
    """Both splits on the same seeded requests, KVCM answering at 42-48 ms of a 50 ms budget."""
    figures = {}
    for split in split_budget.SPLITS:
        figures[split] = trio.run(
            lambda s=split: split_budget.measure_split(s, network=MemoryNetwork(), requests=40),
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
    fixed, learned = figures["fixed"], figures["learned"]
    assert learned.kvcm > fixed.kvcm
    assert learned.hits > fixed.hits
    assert learned.within_budget == fixed.within_budget == 40  # the same deadline adherence: all in time


def test_the_demo_scenario_prints_both_splits_side_by_side() -> None:
    out = io.StringIO()
    status = split_budget.run(out, clock=trio.testing.MockClock(autojump_threshold=0), in_memory=True, requests=20)
    text = out.getvalue()
    assert status == 0, text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("fixed ", "learned "))}
    assert set(rows) == {"fixed", "learned"}
    assert text.rstrip().endswith("PASS kvcm-slow-budget")
