"""Pure prober policy: the reserve-ahead token bucket, ejection arithmetic, config validation."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.probe_budget import (
    TokenBucket,
    decayed_ejection_count,
    ejection_allowed,
    ejection_duration_s,
    prober_problems,
)
from router.config import ProberConfig


def test_bucket_burst_then_rate() -> None:
    bucket = TokenBucket(rate_per_s=100.0, burst=3, now=0.0)
    assert [bucket.reserve(0.0, 1.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.reserve(0.0, 1.0) == pytest.approx(0.01)
    assert bucket.reserve(0.0, 1.0) == pytest.approx(0.02)
    assert bucket.tokens(0.0) == pytest.approx(-2.0)  # two reserved ahead
    assert bucket.tokens(0.02) == pytest.approx(0.0)


def test_bucket_refuses_past_deadline_without_cost() -> None:
    bucket = TokenBucket(rate_per_s=100.0, burst=1, now=0.0)
    assert bucket.reserve(0.0, 0.0) == 0.0
    assert bucket.reserve(0.0, 0.005) is None  # ready at 0.01 > deadline
    assert bucket.tokens(0.0) == 0.0  # the refusal took nothing
    assert bucket.reserve(0.0, 0.01) == pytest.approx(0.01)


def test_bucket_refund_and_cap() -> None:
    bucket = TokenBucket(rate_per_s=10.0, burst=2, now=0.0)
    bucket.refund(0.0)
    assert bucket.tokens(0.0) == 2.0  # never above burst
    bucket.reserve(0.0, 1.0)
    bucket.reserve(0.0, 1.0)
    ready = bucket.reserve(0.0, 1.0)
    assert ready == pytest.approx(0.1)
    bucket.refund(0.05)  # the reservation was not used
    assert bucket.reserve(0.05, 1.0) == pytest.approx(0.1)
    assert bucket.tokens(100.0) == 2.0


@given(
    rate=st.floats(min_value=1.0, max_value=10_000.0),
    burst=st.integers(min_value=1, max_value=50),
    gaps=st.lists(st.floats(min_value=0.0, max_value=0.01), min_size=1, max_size=300),
)
def test_bucket_window_bound(rate: float, burst: int, gaps: list[float]) -> None:
    """Over any window [a, b] of ready times, at most burst + rate × (b − a) tokens."""
    bucket = TokenBucket(rate, burst, now=0.0)
    now = 0.0
    ready: list[float] = []
    for gap in gaps:
        now += gap
        at = bucket.reserve(now, now + 1.0)
        if at is not None:
            assert at >= now
            ready.append(at)
    ready.sort()
    for i in range(len(ready)):
        for j in range(i, len(ready)):
            assert j - i + 1 <= burst + rate * (ready[j] - ready[i]) + 1e-6


def test_ejection_duration_grows_and_caps() -> None:
    assert [ejection_duration_s(n, 30.0, 300.0) for n in (1, 2, 3, 10, 11, 50)] == [
        30.0,
        60.0,
        90.0,
        300.0,
        300.0,
        300.0,
    ]


def test_ejection_count_decays_per_base_period() -> None:
    assert decayed_ejection_count(3, 0.0, 30.0) == 3
    assert decayed_ejection_count(3, 29.9, 30.0) == 3
    assert decayed_ejection_count(3, 30.0, 30.0) == 2
    assert decayed_ejection_count(3, 95.0, 30.0) == 0
    assert decayed_ejection_count(3, 1e9, 30.0) == 0


@pytest.mark.parametrize(
    ("ejected", "known", "allowed"),
    [(0, 1, False), (0, 2, True), (1, 2, False), (1, 3, False), (0, 3, True), (4, 10, True), (5, 10, False)],
)
def test_ejection_cap(ejected: int, known: int, allowed: bool) -> None:
    assert ejection_allowed(ejected, known, 0.5) is allowed


def test_config_defaults_valid_and_every_bad_field_named() -> None:
    assert prober_problems(ProberConfig()) == []
    bad = dataclasses.replace(
        ProberConfig(),
        inflight_cap=0,
        rate_per_s=0.0,
        rate_burst=0,
        probe_timeout_s=0.0,
        eject_after_failures=0,
        eject_max_s=1.0,
        max_ejected_fraction=1.5,
        max_tracked_workers=0,
    )
    problems = prober_problems(bad)
    for name in (
        "inflight_cap",
        "rate_per_s",
        "rate_burst",
        "probe_timeout_s",
        "eject_after_failures",
        "eject_max_s",
        "max_ejected_fraction",
        "max_tracked_workers",
    ):
        assert any(name in p.fields for p in problems), name
    assert len(problems) == 8
