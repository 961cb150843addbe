"""The deadline split: the pure rule and estimates, and its gain over the fixed split under MockClock."""

from __future__ import annotations

import io
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from actors.metrics_sink import DecisionMade, MetricsSink
from actors.sources.base import RequestSplit
from kvroute_sim.demo import split_budget
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.kvcm import KvcmFaults
from kvroute_sim.sim.worker import WorkerFaults
from router.api import open_router
from router.config import DeadlineSplit, DeploymentConfig, DiscoveryConfig, KvrouteConfig, MetricsConfig, RouterConfig
from router.keys import block_keys
from router.policy.deadline_split import (
    COLD,
    TAIL_QUANTILE,
    TAIL_WINDOW,
    RecentQuantile,
    SplitEstimates,
    SplitEstimator,
    StageLatency,
    WithLag,
    split_windows,
)
from router.supervisor import RouterHandle
from router.transport.memory_adapter import MemoryNetwork
from router.types import (
    KeyFamily,
    Reason,
    RouteDecision,
    RouteRequest,
    RouteSource,
    SplitMode,
    Stage,
    StageWindow,
)
from router.wire import paths

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
    assert slow.leader_end == slow.query_end == slow.probe_end == 10.045  # the fixed ends: never earlier
    cold = split_windows(10.0, 10.050, replace(WARM, tail=None), LEARNED)
    assert cold.mode is SplitMode.COLD
    assert cold.leader_end == cold.query_end == cold.probe_end == 10.045  # the fixed reserve


def test_the_lag_reserve_takes_at_most_half_the_budget() -> None:
    # Twice a 30 ms lag would end every wait before the request was received; half of 40 ms is left.
    w = split_windows(0.0, 0.040, SplitEstimates(lag=0.030), LEARNED)
    assert (w.leader_end, w.query_end, w.probe_end) == pytest.approx((0.020, 0.020, 0.020))


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


def test_a_first_sample_brings_a_deviation_of_half_itself() -> None:
    # One sample says nothing of the spread: the estimate leaves room above it until more come.
    latency = StageLatency(0.1, 2.0)
    latency.observe(0.010)
    assert latency.high == pytest.approx(0.020)


def test_a_censored_sample_below_the_estimate_keeps_the_mean_and_one_above_raises_it() -> None:
    latency = StageLatency(0.25, 2.0)
    for _ in range(10):
        latency.observe(0.010)
    before = latency.high
    for _ in range(100):  # cut after 1 ms: at least that slow, which says nothing of the mean
        latency.observe(0.001, censored=True)
    assert 0.010 <= latency.high <= before  # no runaway down: only the spread may fade
    latency.observe(0.030, censored=True)  # cut after 30 ms: at least that slow
    assert latency.high > before
    for _ in range(100):  # a stage that hangs, cut after the same 47 ms every time
        latency.observe(0.047, censored=True)
    assert 0.047 <= latency.high < 0.07  # at least what it was given, and no ratchet beyond


def test_cut_queries_never_lower_the_query_estimate() -> None:
    estimator = SplitEstimator(replace(LEARNED, split_min_samples=1))
    estimator.observe({Stage.CACHE_QUERY: 20.0}, (StageWindow(Stage.CACHE_QUERY, 100.0, False),))
    for _ in range(20):  # cut after 5 ms: at least that slow, which says nothing of how slow
        estimator.observe({Stage.CACHE_QUERY: 5.0}, (StageWindow(Stage.CACHE_QUERY, 5.0, True),))
    query = estimator.estimates().query
    assert query is not None and query >= 0.020


def _probes_cut_at(estimator: SplitEstimator, probe_ms: float, *, cut: bool) -> None:
    """One decision of a 50 ms request under the estimator's current windows, its probes taking ``probe_ms``."""
    w = split_windows(0.0, 0.050, estimator.estimates(), LEARNED)
    estimator.observe(
        {Stage.KEYS: 0.1, Stage.CACHE_QUERY: 2.0, Stage.PLAN: 0.1, Stage.PROBE: probe_ms, Stage.SCORE: 0.3,
         Stage.TAIL: 1.0},
        (
            StageWindow(Stage.CACHE_QUERY, w.query_end * 1000.0, False),
            StageWindow(Stage.PROBE, w.probe_end * 1000.0, cut),
        ),
    )


def test_one_stalled_probe_wait_counts_only_what_its_window_left_it_and_cut_samples_bring_it_down() -> None:
    """A 5 s stall in a probe wait is the task running late, not the probes: the sample is at most what
    the window left the stage (49 ms less the 2.2 ms before it), and probes cut at their window after
    it (one candidate that never answers) bring the estimate down to what they were given."""
    estimator = SplitEstimator(LEARNED)
    for _ in range(30):
        _probes_cut_at(estimator, 3.0, cut=False)
    settled = estimator.estimates().probe
    assert settled is not None and settled == pytest.approx(0.0031, abs=1e-5)
    _probes_cut_at(estimator, 5000.0, cut=True)
    stalled = estimator.estimates().probe
    assert stalled is not None and settled < stalled < 0.0468  # raised, within what the window left
    for _ in range(100):
        _probes_cut_at(estimator, 20.0, cut=True)
    recovered = estimator.estimates().probe
    assert recovered == pytest.approx(0.0201, abs=1e-4)  # at least what they were given, and no more


def test_a_cut_probe_wait_counts_what_its_window_left_after_the_keys_and_the_query() -> None:
    config = replace(LEARNED, split_min_samples=1)
    estimator = SplitEstimator(config)
    # Keys 5 ms and the query 20 ms, then probes cut by a window ending 45 ms after receipt: 20 ms were
    # theirs, though the stalled task noticed only after 30.
    estimator.observe(
        {Stage.KEYS: 5.0, Stage.CACHE_QUERY: 20.0, Stage.PLAN: 0.0, Stage.PROBE: 30.0, Stage.TAIL: 1.0},
        (StageWindow(Stage.CACHE_QUERY, 40.0, False), StageWindow(Stage.PROBE, 45.0, True)),
    )
    assert estimator.estimates().probe == pytest.approx(0.020 * (1 + config.split_deviations / 2))


def test_a_query_wait_after_the_masters_counts_what_its_window_left_after_the_master() -> None:
    """The master took 30 ms of its window before the KVCM source; the query's window ended 45 ms
    after receipt, leaving it 15, and a stalled task noticed its reply only after 45: the sample was
    capped at 45 ms (keys and leader alone counted before it), raising the estimate by the master's
    time on every such stall."""
    config = replace(LEARNED, split_min_samples=1)
    estimator = SplitEstimator(config)
    estimator.observe(
        {Stage.KEYS: 0.0, Stage.LEADER: 0.0, Stage.CACHE_QUERY: 45.0, Stage.TAIL: 1.0},
        (StageWindow(Stage.CACHE_QUERY, 45.0, False),),
        ahead_ms=30.0,
    )
    assert estimator.estimates().query == pytest.approx(0.015 * (1 + config.split_deviations / 2))


@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 1e7), st.floats(0.0, 1e7), st.floats(0.0, 50.0), st.floats(0.0, 50.0), st.booleans()
        ),
        min_size=1,
        max_size=40,
    )
)
def test_no_sample_lifts_a_waits_estimate_past_what_its_window_allowed(
    samples: list[tuple[float, float, float, float, bool]],
) -> None:
    """Whatever the stages took (a stalled loop: up to hours), a wait's estimate stays within what a
    window ending at most 50 ms after receipt could have let the stage take (the mean plus
    ``split_deviations`` deviations of samples at most that long)."""
    config = replace(LEARNED, split_min_samples=1)
    estimator = SplitEstimator(config)
    for query, probe, query_end, probe_end, cut in samples:
        estimator.observe(
            {Stage.CACHE_QUERY: query, Stage.PLAN: 0.1, Stage.PROBE: probe, Stage.TAIL: 1.0},
            (StageWindow(Stage.CACHE_QUERY, query_end, cut), StageWindow(Stage.PROBE, probe_end, cut)),
        )
    e = estimator.estimates()
    bound = (1 + config.split_deviations) * 0.050
    assert e.query is not None and e.query <= bound + 1e-12
    assert e.probe is not None and e.probe <= bound + 1e-12


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


@pytest.mark.parametrize("min_samples", [TAIL_WINDOW, TAIL_WINDOW + 1, 100])
def test_more_samples_asked_than_the_tails_window_holds_warm_once_it_is_full(min_samples: int) -> None:
    """The setting allows up to 100,000, the tail's window holds TAIL_WINDOW: above it the learned
    split stayed cold for the life of the process, and ``--deadline-split learned`` did nothing."""
    estimator = SplitEstimator(replace(RouterConfig(), split_min_samples=min_samples))
    stages = {Stage.CACHE_QUERY: 10.0, Stage.PLAN: 0.1, Stage.PROBE: 2.0, Stage.SCORE: 0.2, Stage.TAIL: 0.5}
    for _ in range(min_samples - 1):
        estimator.observe(stages, ())
    assert not estimator.estimates().warm  # the other stages still count every sample asked
    estimator.observe(stages, ())
    e = estimator.estimates()
    assert e.warm and e.tail == pytest.approx(0.0005)
    for i in range(10 * TAIL_WINDOW):  # a query cut now and then brings no tail: the split stays warm
        cut = i % 5 == 0
        estimator.observe({Stage.CACHE_QUERY: 30.0} if cut else stages, ())
        assert estimator.estimates().warm, i


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
    fixed, learned = trio.run(
        lambda: split_budget.measure_splits(split_budget.SPLITS, network=MemoryNetwork(), requests=40),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert (fixed.split, learned.split) == split_budget.SPLITS
    assert learned.kvcm > fixed.kvcm
    assert learned.hits > fixed.hits
    assert learned.within_budget == fixed.within_budget == 40  # the same deadline adherence: all in time


def test_router_setting_overrides_reach_both_splits_routers() -> None:
    """A learned split that needs more samples than the run has stays cold: it splits as the fixed one."""
    fixed, learned = trio.run(
        lambda: split_budget.measure_splits(
            split_budget.SPLITS, network=MemoryNetwork(), requests=20, overrides={"split_min_samples": 100_000}
        ),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    assert (learned.kvcm, learned.hits, learned.within_budget) == (fixed.kvcm, fixed.hits, fixed.within_budget)
    out = io.StringIO()
    split_budget.run(
        out,
        clock=trio.testing.MockClock(autojump_threshold=0),
        in_memory=True,
        requests=4,
        overrides={"split_min_samples": 100_000},
    )
    assert "router settings: budget_cap_ms=50.0, breaker_slow_query_ms=51.0, split_min_samples=100000" in out.getvalue()


def test_on_the_simulated_clock_a_learned_split_that_does_no_better_fails_and_so_does_the_scenario() -> None:
    """On the simulated clock only the split's rule differs: a learned split held cold (as the fixed
    one) tied and passed, and a simulated FAIL left the scenario's exit 0."""
    cold = {"split_min_samples": 100_000}
    out = io.StringIO()
    status = split_budget.run(
        out, clock=trio.testing.MockClock(autojump_threshold=0), in_memory=True, requests=4, overrides=cold, better=True
    )
    assert status == 1 and out.getvalue().rstrip().endswith("FAIL kvcm-slow-budget")
    both = io.StringIO()
    assert split_budget.run_both(both, requests=4, overrides=cold) == 1  # whatever the real clock's run says
    assert "FAIL kvcm-slow-budget" in both.getvalue().split("real clock, loopback gRPC:")[0]


def test_the_demo_scenario_prints_both_splits_side_by_side() -> None:
    out = io.StringIO()
    status = split_budget.run(out, clock=trio.testing.MockClock(autojump_threshold=0), in_memory=True, requests=20)
    text = out.getvalue()
    assert status == 0, text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("fixed ", "learned "))}
    assert set(rows) == {"fixed", "learned"}
    assert text.rstrip().endswith("PASS kvcm-slow-budget")


def test_with_lag_is_the_published_estimates_with_the_lag_and_rebuilt_only_on_a_change() -> None:
    with_lag = WithLag()
    published = SplitEstimates(query=0.004, probe=0.002, score=0.0005, lag=0.0)
    first = with_lag(published, 0.001)
    assert first == replace(published, lag=0.001)
    assert with_lag(published, 0.001) is first  # nothing changed: the same object, no rebuild
    assert with_lag(published, 0.002) == replace(published, lag=0.002)
    republished = SplitEstimates(query=0.005, probe=0.002, score=0.0005)
    assert with_lag(republished, 0.002) == replace(republished, lag=0.002)
    assert with_lag(COLD, 0.0) == COLD


# --- the tail: from the end of the probe wait to the reply leaving kvroute ------------------------


def _warm_estimator(config: RouterConfig, tail_ms: float) -> SplitEstimator:
    estimator = SplitEstimator(config)
    for _ in range(config.split_min_samples):
        estimator.observe({Stage.CACHE_QUERY: 5.0, Stage.PROBE: 0.5, Stage.SCORE: 0.2, Stage.TAIL: tail_ms}, ())
    return estimator


@given(st.integers(0, 7), st.floats(0, 40, allow_nan=False))
def test_until_the_tail_has_its_samples_the_learned_split_is_the_fixed_one(seen: int, tail_ms: float) -> None:
    config = replace(LEARNED, split_min_samples=8)
    estimator = SplitEstimator(config)
    for i in range(8):  # query and probes warm; the tail seen only ``seen`` times
        stages = {Stage.CACHE_QUERY: 5.0, Stage.PROBE: 0.5}
        estimator.observe(stages | ({Stage.TAIL: tail_ms} if i < seen else {}), ())
    estimates = estimator.estimates()
    assert estimates.tail is None and not estimates.warm
    cold = split_windows(10.0, 10.050, estimates, config)
    fixed = split_windows(10.0, 10.050, estimates, FIXED)
    assert cold.mode is SplitMode.COLD
    assert (cold.leader_end, cold.query_end, cold.probe_end) == (fixed.leader_end, fixed.query_end, fixed.probe_end)


@given(st.floats(0, 3, allow_nan=False), st.floats(2, 20, allow_nan=False))
def test_a_sudden_longer_tail_moves_the_last_window_within_three_requests(base_ms: float, jump_ms: float) -> None:
    step_ms = base_ms + jump_ms
    estimator = _warm_estimator(LEARNED, base_ms)
    before = estimator.estimates()
    assert before.tail is not None and before.tail < (base_ms + jump_ms / 2) / 1000.0
    for _ in range(3):  # the machine gets busy: every reply now leaves step_ms after the probes
        estimator.observe({Stage.CACHE_QUERY: 5.0, Stage.PROBE: 0.5, Stage.TAIL: step_ms}, ())
    after = estimator.estimates()
    assert after.tail is not None and after.tail >= step_ms / 1000.0
    w = split_windows(10.0, 10.050, after, LEARNED)
    # The probes end early enough for the reply, or at the fixed split's end when the tail needs it all.
    assert w.probe_end == max(10.045, 10.050 - step_ms / 1000.0)
    for _ in range(TAIL_WINDOW):  # and back, once the long tails have left the window
        estimator.observe({Stage.CACHE_QUERY: 5.0, Stage.PROBE: 0.5, Stage.TAIL: base_ms}, ())
    settled = estimator.estimates()
    assert settled.tail == pytest.approx(base_ms / 1000.0)


def test_the_tails_estimate_covers_all_but_the_longest_few_of_the_recent_ones() -> None:
    tail = RecentQuantile(TAIL_WINDOW, TAIL_QUANTILE)
    assert tail.high == 0.0
    for i in range(TAIL_WINDOW):
        tail.observe(0.001 * (i + 1))  # 1 .. 40 ms
    assert tail.high == pytest.approx(0.039)  # 97 % of 40: the second longest
    for _ in range(TAIL_WINDOW - 2):  # the oldest leave first: 39 and 40 ms are still in the window
        tail.observe(0.0005)
    assert tail.samples == TAIL_WINDOW and tail.high == pytest.approx(0.039)
    tail.observe(0.0005)  # the 39 ms one leaves: one long tail among the recent ones is not enough
    assert tail.high == pytest.approx(0.0005)


@given(
    window=st.integers(1, 12),
    quantile=st.sampled_from((0.5, 0.9, TAIL_QUANTILE, 1.0)),
    entries=st.lists(st.one_of(st.none(), st.sampled_from((0.0, 0.001, 0.002)), st.floats(0.0, 1.0)), max_size=60),
)
def test_the_recent_quantile_kept_in_order_reads_as_the_sorted_window(
    window: int, quantile: float, entries: list[float | None]
) -> None:
    """After any mix of samples (repeats among them) and passes, the quantile read from the ordered copy is
    the nearest-rank quantile of the samples among the last ``window`` entries, and so is the count."""
    recent = RecentQuantile(window, quantile)
    for i, entry in enumerate(entries):
        if entry is None:
            recent.pass_over()
        else:
            recent.observe(entry)
        in_window = sorted(e for e in entries[max(0, i + 1 - window) : i + 1] if e is not None)
        assert recent.samples == len(in_window)
        expected = in_window[max(0, math.ceil(quantile * len(in_window)) - 1)] if in_window else 0.0
        assert recent.high == expected


def test_a_stalled_start_leaves_the_tails_window_with_the_requests_even_when_none_reaches_the_probes() -> None:
    """Two 256 ms tails at start (a first request's channel set-up, a full collection) must not hold the
    split at the fixed ends while the fixed split cuts every query and no request brings a new tail."""
    config = replace(LEARNED, split_min_samples=8)
    estimator = SplitEstimator(config)
    full = {Stage.CACHE_QUERY: 5.0, Stage.PROBE: 0.5, Stage.SCORE: 0.2}
    for tail_ms in (256.0, 256.0, *([0.5] * 10)):
        estimator.observe(full | {Stage.TAIL: tail_ms}, ())
    assert estimator.estimates().tail == pytest.approx(0.256)
    cut = (StageWindow(Stage.CACHE_QUERY, 45.0, True),)
    for _ in range(TAIL_WINDOW - 12):  # the window fills with queries cut before the probes
        estimator.observe({Stage.CACHE_QUERY: 45.0}, cut)
    assert estimator.estimates().tail == pytest.approx(0.256)
    estimator.observe({Stage.CACHE_QUERY: 45.0}, cut)
    estimator.observe({Stage.CACHE_QUERY: 45.0}, cut)  # both stalled tails have left
    assert estimator.estimates().tail == pytest.approx(0.0005)
    for _ in range(3):  # and the quick ones leave too: fewer than 8 in the window is cold again
        estimator.observe({Stage.CACHE_QUERY: 45.0}, cut)
    assert estimator.estimates().tail is None


def test_a_transports_way_back_adds_to_the_tail_once_it_has_its_samples() -> None:
    config = replace(LEARNED, split_min_samples=4)
    estimator = _warm_estimator(config, 1.0)
    assert estimator.estimates().tail == pytest.approx(0.001)
    assert estimator.observe_replies((0.002,) * 3)
    assert estimator.estimates().tail is None  # a transport reports its part: cold until it is known
    estimator.observe_replies((0.002,))
    assert estimator.estimates().tail == pytest.approx(0.003)
    assert not estimator.observe_replies(())


def test_the_probe_wait_ends_at_its_window_when_the_window_cut_it() -> None:
    split = RequestSplit(split_windows(10.0, 10.050, WARM, LEARNED))
    split.probes_ended(10.030)  # every probe answered early
    assert split.probes_ended_at == 10.030
    split.probes_ended(10.052)  # cut, and the task ran 3.5 ms late: that lateness is part of the tail
    assert split.probes_ended_at == split.windows.probe_end


def test_each_wait_reports_the_end_of_its_own_window() -> None:
    fast = SplitEstimates(query=0.002, probe=0.001, score=0.0005, tail=0.0015)
    split = RequestSplit(split_windows(10.0, 10.050, fast, LEARNED))
    split.waited(Stage.LEADER, True)
    split.waited(Stage.CACHE_QUERY, False)
    split.waited(Stage.PROBE, False)
    windows = split.stage_windows(10.0)
    assert [(w.stage, w.cut) for w in windows] == [
        (Stage.LEADER, True),
        (Stage.CACHE_QUERY, False),
        (Stage.PROBE, False),
    ]
    assert [w.end_ms for w in windows] == pytest.approx([45.5, 47.5, 48.5])


LEARNED_PROMPT = tuple(range(1000, 1000 + 8 * 16))


@asynccontextmanager
async def learned_router() -> AsyncIterator[tuple[RouterHandle, SimCluster]]:
    """A router on the learned split (two samples warm it) over two simulated workers, its KVCM leader
    known and worker 1 holding LEARNED_PROMPT."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=16)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=16, kvcm_instance_id="ns"),
        router=replace(LEARNED, split_min_samples=2),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        await resolver.leader()
        keys = block_keys(LEARNED_PROMPT, 16, KeyFamily.RTP)
        cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, keys)
        yield handle, cluster


async def test_the_router_records_each_requests_tail_and_uses_the_learned_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A whole router under MockClock: each decision that probed records its tail; the sink learns it;
    after replies have taken 8 ms for three requests, the probes end 8 ms before the deadline."""
    prompt = LEARNED_PROMPT
    async with learned_router() as (handle, cluster):
        leader = cluster.kvcm.leader
        assert leader is not None
        cluster.kvcm.set_faults(leader, KvcmFaults(delay_s=0.002, methods=frozenset({paths.KVCM_GET_HOST_CACHE_STATE})))
        first = await handle.route(RouteRequest("cold", token_ids=prompt, budget_ms=50))
        assert first.split is SplitMode.COLD and first.stage_ms[Stage.TAIL] >= 0.0
        await handle.route(RouteRequest("warming", token_ids=prompt, budget_ms=50))
        await trio.testing.wait_all_tasks_blocked()
        warm = handle.metrics.split_estimates()
        assert warm.warm and warm.tail is not None and warm.tail < 0.001  # MockClock: no time passes after the wait
        quick = await handle.route(RouteRequest("quick-tail", token_ids=prompt, budget_ms=50))
        assert quick.split is SplitMode.LEARNED
        assert {w.stage: w.end_ms for w in quick.windows}[Stage.PROBE] == pytest.approx(49.0)  # reserve_min

        for tail_ms, probe_end_ms in ((3.0, 47.0), (8.0, 45.0)):  # 8 ms: all of the fixed 5 ms and more
            slow_reply = RouteDecision(
                "slow", None, None, RouteSource.KVCM, Reason.CACHE_LEADER, stage_ms={Stage.TAIL: tail_ms}
            )
            for _ in range(2):  # two long tails among the recent ones move the estimate
                handle.metrics.emit(DecisionMade(slow_reply))
            await trio.testing.wait_all_tasks_blocked()
            slow = await handle.route(RouteRequest(f"tail-{tail_ms:g}", token_ids=prompt, budget_ms=50))
            assert slow.split is SplitMode.LEARNED and slow.route_source is RouteSource.KVCM
            assert {w.stage: w.end_ms for w in slow.windows}[Stage.PROBE] == pytest.approx(probe_end_ms)


async def test_a_request_the_deadline_cuts_in_its_probe_wait_brings_its_tail_and_the_next_keep_a_reserve(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A loop stall across the probe window's end wakes the request's task after its deadline: the
    deadline cancels the wait, and the lateness past the window is still the request's tail, so the
    learned split learns it and leaves the requests after it that much before their deadline."""
    prompt = LEARNED_PROMPT
    async with learned_router() as (handle, cluster):
        for i in range(3):
            await handle.route(RouteRequest(f"warm-{i}", token_ids=prompt, budget_ms=50))
        await trio.testing.wait_all_tasks_blocked()
        assert handle.metrics.split_estimates().tail == 0.0  # MockClock: no time passes after the wait
        for worker in cluster.workers:  # every probe waits until its window ends
            worker.set_faults(WorkerFaults(delay_s=0.5))
        await trio.sleep(4.0)  # the cached statuses are too old to use

        start = trio.current_time()
        estimates = handle.metrics.split_estimates()
        probe_end = split_windows(start, start + 0.050, estimates, handle.config.router).probe_end
        assert probe_end - start == pytest.approx(0.049)  # reserve_min

        async def stall() -> None:
            await trio.sleep_until(probe_end - 0.0001)
            autojump_clock.jump(0.002)  # the loop stalls across the window's end and past the deadline

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stall)
            cut = await handle.route(RouteRequest("stalled", token_ids=prompt, budget_ms=50))
        assert cut.reason is Reason.DEADLINE
        assert cut.stage_ms[Stage.TAIL] == pytest.approx(1.9)  # from the window's end to the answer
        # The deadline ended the wait, not the window: not marked cut, as a replay of the log reads it.
        assert not {w.stage: w.cut for w in cut.windows}.get(Stage.PROBE, False)
        await trio.testing.wait_all_tasks_blocked()

        # The longest of the few recent tails (a window this short holds no longer one to leave out).
        assert handle.metrics.split_estimates().tail == pytest.approx(0.0019)
        after = await handle.route(RouteRequest("after", token_ids=prompt, budget_ms=50))
        assert after.split is SplitMode.LEARNED
        assert {w.stage: w.end_ms for w in after.windows}[Stage.PROBE] == pytest.approx(48.1)  # the tail's reserve


def test_the_demo_scenario_runs_on_both_clocks_and_exits_by_the_real_one() -> None:
    """Real loopback gRPC (no timing asserted): the simulated-clock table first, then the real one; with
    the simulated run passing, the exit status is the real one's."""
    out = io.StringIO()
    status = split_budget.run_both(out, requests=4)
    text = out.getvalue()
    simulated, real = text.split("real clock, loopback gRPC:")
    assert simulated.startswith("simulated clock, in-memory transports:")
    assert "PASS kvcm-slow-budget" in simulated  # the rule alone: deterministic
    verdict = real.rstrip().splitlines()[-1]
    assert verdict in ("PASS kvcm-slow-budget", "FAIL kvcm-slow-budget")
    assert status == (0 if verdict.startswith("PASS") else 1)
