"""KvcmBreaker: every transition in both directions, with time passed in (the breaker is pure).

The resolver-level tests (tests/test_leader_resolver.py) check the same machine under
MockClock through its owner, including that OPEN costs no RPC.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.breaker import Admission, BreakerState, KvcmBreaker, breaker_problems
from router.config import BreakerConfig, KvrouteConfig
from router.problems import ConfigError

CFG = BreakerConfig(
    failure_threshold=3,
    window_s=10.0,
    window_min_calls=10,
    failure_rate=0.5,
    window_buckets=10,
    cooldown_s=1.0,
    cooldown_max_s=5.0,
    trial_timeout_s=2.0,
)


def state(b: KvcmBreaker) -> BreakerState:
    """The breaker's state, read through a call so mypy does not narrow it across transitions."""
    return b.state


def opened(at: float = 100.0, config: BreakerConfig = CFG) -> KvcmBreaker:
    b = KvcmBreaker(config)
    for _ in range(config.failure_threshold):
        b.record_failure(at, trial=False, started_at=at)
    assert state(b) is BreakerState.OPEN
    return b


def half_open(at: float = 100.0) -> KvcmBreaker:
    """Opened at ``at``, trial admitted at at + cooldown."""
    b = opened(at)
    assert b.admit(at + CFG.cooldown_s) is Admission.TRIAL
    assert state(b) is BreakerState.HALF_OPEN
    return b


# --- CLOSED ------------------------------------------------------------------------------


def test_closed_allows_and_stays_closed_below_threshold() -> None:
    b = KvcmBreaker(CFG)
    assert b.admit(0.0) is Admission.ALLOW
    for _ in range(CFG.failure_threshold - 1):
        b.record_failure(0.0, trial=False, started_at=0.0)
    assert state(b) is BreakerState.CLOSED
    assert b.admit(0.0) is Admission.ALLOW
    assert b.snapshot(0.0).consecutive_failures == CFG.failure_threshold - 1


def test_closed_to_open_exactly_at_consecutive_threshold() -> None:
    b = KvcmBreaker(CFG)
    for i in range(CFG.failure_threshold):
        assert state(b) is BreakerState.CLOSED, i
        b.record_failure(5.0, trial=False, started_at=5.0)
    assert state(b) is BreakerState.OPEN
    snap = b.snapshot(5.0)
    assert snap.open_until == 5.0 + CFG.cooldown_s
    assert snap.opened_total == 1


def test_success_resets_the_consecutive_count() -> None:
    b = KvcmBreaker(dataclasses.replace(CFG, window_min_calls=10**6))  # isolate the consecutive rule
    for _ in range(5):
        for _ in range(CFG.failure_threshold - 1):
            b.record_failure(0.0, trial=False, started_at=0.0)
        b.record_success(0.0, trial=False)
    assert state(b) is BreakerState.CLOSED
    assert b.snapshot(0.0).consecutive_failures == 0


def test_closed_to_open_on_failure_rate_over_the_window() -> None:
    # Failures never consecutive (threshold unreachable), but half of all calls fail.
    b = KvcmBreaker(CFG)
    t = 0.0
    for i in range(CFG.window_min_calls - 1):
        if i % 2:
            b.record_failure(t, trial=False, started_at=t)
        else:
            b.record_success(t, trial=False)
        t += 0.01
    assert state(b) is BreakerState.CLOSED  # 9 calls: below window_min_calls
    b.record_failure(t, trial=False, started_at=t)  # 10 calls, 5 failures: rate 0.5 >= 0.5
    assert state(b) is BreakerState.OPEN


def test_failure_rate_below_threshold_keeps_closed() -> None:
    b = KvcmBreaker(CFG)
    for i in range(1000):
        if i % 3 == 0:  # one in three fails: rate 0.33 < 0.5
            b.record_failure(i * 0.001, trial=False, started_at=i * 0.001)
        else:
            b.record_success(i * 0.001, trial=False)
    assert state(b) is BreakerState.CLOSED
    snap = b.snapshot(1.0)
    assert snap.window_calls == 1000
    assert snap.window_failures == 334


def test_old_outcomes_leave_the_window() -> None:
    b = KvcmBreaker(CFG)
    for _ in range(4):  # 4 failures among 9 calls at t=0: below window_min_calls (10)
        b.record_failure(0.0, trial=False, started_at=0.0)
        b.record_success(0.0, trial=False)
    b.record_success(0.0, trial=False)
    assert b.snapshot(0.0).window_calls == 9
    # Had they stayed, one more failure would make 5 of 10 and trip; a full window later they are gone.
    later = CFG.window_s + 0.001
    assert b.snapshot(later).window_calls == 0
    b.record_failure(later, trial=False, started_at=later)
    assert state(b) is BreakerState.CLOSED
    snap = b.snapshot(later)
    assert (snap.window_calls, snap.window_failures) == (1, 1)
    # Control: the same failure inside the window trips.
    c = KvcmBreaker(CFG)
    for _ in range(4):
        c.record_failure(0.0, trial=False, started_at=0.0)
        c.record_success(0.0, trial=False)
    c.record_success(0.0, trial=False)
    c.record_failure(CFG.window_s / 2, trial=False, started_at=CFG.window_s / 2)
    assert state(c) is BreakerState.OPEN


def test_window_bounds_memory_at_any_call_rate() -> None:
    b = KvcmBreaker(dataclasses.replace(CFG, window_min_calls=10**9))
    for i in range(100_000):
        b.record_success(i * 1e-4, trial=False)
    snap = b.snapshot(10.0)
    # Window is between (n-1)/n and 1 × window_s: 9..10 s of the 10 s of calls.
    assert 89_990 <= snap.window_calls <= 100_000


def test_closing_forgets_the_window_near_clock_zero() -> None:
    """A breaker opened on the failure rate early in the clock's life (MockClock starts at 0) closes
    on a good trial with an empty window: one failure after that is one call of a fresh window."""
    config = dataclasses.replace(CFG, failure_threshold=1000)  # isolate the rate rule
    b = KvcmBreaker(config)
    t = 0.5  # inside the first of the window's buckets
    for _ in range(config.window_min_calls):
        b.record_failure(t, trial=False, started_at=t)
    assert state(b) is BreakerState.OPEN
    assert b.snapshot(t).window_calls == 0
    t += config.cooldown_s
    assert b.admit(t) is Admission.TRIAL
    b.record_success(t, trial=True)
    assert state(b) is BreakerState.CLOSED
    assert b.snapshot(t).window_calls == 0
    b.record_failure(t, trial=False, started_at=t)
    assert state(b) is BreakerState.CLOSED
    snap = b.snapshot(t)
    assert (snap.window_calls, snap.window_failures) == (1, 1)


# --- OPEN ----------------------------------------------------------------------------


def test_open_rejects_until_cooldown_then_one_trial() -> None:
    b = opened(at=100.0)
    assert b.admit(100.0) is Admission.REJECT
    assert b.admit(100.0 + CFG.cooldown_s - 1e-6) is Admission.REJECT
    assert state(b) is BreakerState.OPEN
    assert b.admit(100.0 + CFG.cooldown_s) is Admission.TRIAL
    assert state(b) is BreakerState.HALF_OPEN
    assert b.snapshot(101.0).rejected_total == 2


def test_open_ignores_late_outcomes_of_calls_admitted_before_the_trip() -> None:
    b = opened(at=100.0)
    for _ in range(50):
        b.record_failure(100.5, trial=False, started_at=100.5)
    b.record_success(100.5, trial=False)
    assert state(b) is BreakerState.OPEN
    assert b.snapshot(100.5).open_until == 100.0 + CFG.cooldown_s  # not extended, not closed


def test_trial_outcome_without_an_outstanding_trial_is_ignored() -> None:
    b = opened(at=100.0)
    b.record_success(100.2, trial=True)
    assert state(b) is BreakerState.OPEN
    c = KvcmBreaker(CFG)
    c.record_failure(0.0, trial=True, started_at=0.0)
    c.record_failure(0.0, trial=True, started_at=0.0)
    c.record_failure(0.0, trial=True, started_at=0.0)
    assert state(c) is BreakerState.CLOSED
    assert c.snapshot(0.0).consecutive_failures == 0


# --- HALF_OPEN ----------------------------------------------------------------------------


def test_half_open_admits_exactly_one_trial() -> None:
    b = half_open(at=100.0)
    for dt in (0.0, 0.5, 1.0, CFG.trial_timeout_s - 1e-6):
        assert b.admit(101.0 + dt) is Admission.REJECT
    assert state(b) is BreakerState.HALF_OPEN


def test_half_open_trial_success_closes_and_resets() -> None:
    b = half_open(at=100.0)
    b.record_failure(101.0, trial=True, started_at=101.0)  # re-open once: cooldown doubles
    assert b.admit(101.0 + 2 * CFG.cooldown_s) is Admission.TRIAL
    b.record_success(103.5, trial=True)
    assert state(b) is BreakerState.CLOSED
    snap = b.snapshot(103.5)
    assert snap.reopens == 0
    assert snap.closed_total == 1
    assert b.admit(103.5) is Admission.ALLOW
    # The next open starts again from the base cooldown.
    for _ in range(CFG.failure_threshold):
        b.record_failure(200.0, trial=False, started_at=200.0)
    assert b.snapshot(200.0).open_until == 200.0 + CFG.cooldown_s


def test_half_open_non_trial_outcomes_do_not_decide() -> None:
    b = half_open(at=100.0)
    b.record_success(101.1, trial=False)
    assert state(b) is BreakerState.HALF_OPEN
    b.record_failure(101.1, trial=False, started_at=101.1)
    assert state(b) is BreakerState.HALF_OPEN
    assert b.admit(101.2) is Admission.REJECT


def test_half_open_trial_failure_reopens_with_exponential_capped_cooldown() -> None:
    b = opened(at=0.0)
    t = CFG.cooldown_s
    expected = [2.0, 4.0, 5.0, 5.0]  # 1 × 2^n, capped at cooldown_max_s = 5
    for cooldown in expected:
        assert b.admit(t) is Admission.TRIAL
        b.record_failure(t, trial=True, started_at=t)
        assert state(b) is BreakerState.OPEN
        snap = b.snapshot(t)
        assert snap.open_until == pytest.approx(t + cooldown)
        assert b.admit(t + cooldown - 1e-6) is Admission.REJECT
        t += cooldown
    assert b.snapshot(t).reopens == len(expected)


def test_cooldown_exponent_cannot_overflow() -> None:
    b = opened(at=0.0, config=dataclasses.replace(CFG, cooldown_max_s=86_400.0))  # the largest allowed
    t = 1.0
    for _ in range(2000):
        assert b.admit(t) is Admission.TRIAL
        b.record_failure(t, trial=True, started_at=t)
        until = b.snapshot(t).open_until
        assert until is not None
        t = until
    assert state(b) is BreakerState.OPEN


def test_released_trial_frees_the_slot() -> None:
    # A trial cancelled by the request's deadline before KVCM answered: without release the
    # breaker would reject everything until the trial timeout.
    b = half_open(at=100.0)
    b.release_trial()
    assert state(b) is BreakerState.HALF_OPEN
    assert b.admit(101.0) is Admission.TRIAL
    assert b.admit(101.0) is Admission.REJECT
    b.record_success(101.0, trial=True)
    assert state(b) is BreakerState.CLOSED


def test_release_outside_half_open_changes_nothing() -> None:
    b = KvcmBreaker(CFG)
    b.release_trial()
    assert state(b) is BreakerState.CLOSED
    o = opened(at=0.0)
    o.release_trial()
    assert state(o) is BreakerState.OPEN
    assert o.admit(0.5) is Admission.REJECT


def test_trial_never_reported_counts_as_failed_after_timeout() -> None:
    b = half_open(at=100.0)  # trial admitted at 101
    assert b.admit(101.0 + CFG.trial_timeout_s - 1e-6) is Admission.REJECT
    # At the timeout: the lost trial re-opens the breaker (cooldown doubled), so still REJECT ...
    at = 101.0 + CFG.trial_timeout_s
    assert b.admit(at) is Admission.REJECT
    assert state(b) is BreakerState.OPEN
    snap = b.snapshot(at)
    assert snap.trial_timeouts_total == 1
    assert snap.open_until == at + 2 * CFG.cooldown_s
    # ... and a new trial goes after the new cooldown.
    assert b.admit(at + 2 * CFG.cooldown_s) is Admission.TRIAL


def test_view_leaves_a_timed_out_trial_to_the_owner() -> None:
    """The published view rejects while the trial is out, but once it is overdue only the owner may
    decide (count it failed and reopen): a view that went on rejecting would hold HALF_OPEN for good."""
    config = BreakerConfig(failure_threshold=1)
    b = opened(at=100.0, config=config)
    trial_at = 100.0 + config.cooldown_s
    assert b.admit(trial_at) is Admission.TRIAL
    view = b.view()
    assert view.admits(trial_at + config.trial_timeout_s - 0.1) is Admission.REJECT
    assert view.admits(trial_at + config.trial_timeout_s) is None
    assert b.admit(trial_at + config.trial_timeout_s) is Admission.REJECT
    assert state(b) is BreakerState.OPEN
    assert b.snapshot(trial_at + config.trial_timeout_s).trial_timeouts_total == 1


def test_full_cycle_both_directions() -> None:
    b = KvcmBreaker(CFG)
    seen = [b.state]
    for _ in range(CFG.failure_threshold):
        b.record_failure(0.0, trial=False, started_at=0.0)
    seen.append(b.state)
    b.admit(1.0)
    seen.append(b.state)
    b.record_failure(1.0, trial=True, started_at=1.0)
    seen.append(b.state)
    b.admit(3.0)
    seen.append(b.state)
    b.record_success(3.0, trial=True)
    seen.append(b.state)
    assert seen == [
        BreakerState.CLOSED,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]
    snap = b.snapshot(3.0)
    assert (snap.opened_total, snap.closed_total) == (2, 1)


def test_calls_in_flight_together_that_fail_together_are_one_failure_of_the_run() -> None:
    """Eight calls out at once, all failing in one spell: one failure towards the consecutive run,
    eight in the window. Calls that went out after it each count again."""
    b = KvcmBreaker(dataclasses.replace(CFG, window_min_calls=10**6))  # isolate the consecutive rule
    for i in range(8):
        b.record_failure(0.030 + i * 1e-4, trial=False, started_at=0.0)
    snap = b.snapshot(0.031)
    assert (snap.state, snap.consecutive_failures, snap.window_failures) == (BreakerState.CLOSED, 1, 8)
    now = 0.031
    for n in range(2, CFG.failure_threshold + 1):  # each went out after the last counted failure
        b.record_failure(now + 0.030, trial=False, started_at=now)
        now += 0.030
        if n < CFG.failure_threshold:
            assert (state(b), b.snapshot(now).consecutive_failures) == (BreakerState.CLOSED, n)
    assert state(b) is BreakerState.OPEN


def test_with_overlapping_failures_counted_each_a_concurrent_burst_opens_at_the_threshold() -> None:
    config = dataclasses.replace(CFG, window_min_calls=10**6, overlapping_failures_count_once=False)
    b = KvcmBreaker(config)
    for i in range(config.failure_threshold):
        assert state(b) is BreakerState.CLOSED
        b.record_failure(0.030 + i * 1e-4, trial=False, started_at=0.0)
    assert state(b) is BreakerState.OPEN


def test_the_master_breaker_counts_every_failure_and_the_kvcm_breaker_one_per_spell() -> None:
    config = KvrouteConfig()
    assert config.breaker.overlapping_failures_count_once is True
    assert config.master_breaker.overlapping_failures_count_once is False


def test_a_success_starts_the_run_again_for_calls_already_in_flight() -> None:
    b = KvcmBreaker(CFG)
    b.record_failure(1.0, trial=False, started_at=0.9)
    b.record_success(1.0, trial=False)
    b.record_failure(1.01, trial=False, started_at=0.95)  # out before the failure above, after the success
    assert b.snapshot(1.01).consecutive_failures == 1


def test_the_window_rate_counts_every_call_of_a_concurrent_burst() -> None:
    config = BreakerConfig(failure_threshold=1000, window_min_calls=20, failure_rate=0.5)
    b = KvcmBreaker(config)
    for i in range(19):
        b.record_failure(0.03, trial=False, started_at=0.0)
        assert state(b) is BreakerState.CLOSED, i
    b.record_failure(0.03, trial=False, started_at=0.0)  # 20 calls, all failed: the rate trips it
    assert state(b) is BreakerState.OPEN


# --- properties --------------------------------------------------------------------------

_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "success", "failure", "release"]),
        st.floats(min_value=0.0, max_value=3.0),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_never_more_than_one_trial_outstanding(ops: list[tuple[str, float]]) -> None:
    """Model check: a TRIAL is never handed out while another is outstanding (and not timed out)."""
    b = KvcmBreaker(CFG)
    now = 0.0
    outstanding_since: float | None = None
    for op, dt in ops:
        now += dt
        if op == "admit":
            verdict = b.admit(now)
            if verdict is Admission.TRIAL:
                assert outstanding_since is None or now - outstanding_since >= CFG.trial_timeout_s
                outstanding_since = now
            elif verdict is Admission.ALLOW:
                assert state(b) is BreakerState.CLOSED
            else:
                assert state(b) is not BreakerState.CLOSED
        elif op in ("success", "failure"):
            trial = outstanding_since is not None
            if op == "success":
                b.record_success(now, trial)
            else:
                b.record_failure(now, trial, started_at=now)
            outstanding_since = None if trial else outstanding_since
        else:
            b.release_trial()
            outstanding_since = None
        assert (state(b) is BreakerState.HALF_OPEN) or b.snapshot(now).trial_started_at is None


def test_config_validation_names_every_bad_field() -> None:
    bad = BreakerConfig(
        failure_threshold=0,
        window_s=0.0,
        window_min_calls=0,
        failure_rate=1.5,
        window_buckets=0,
        cooldown_s=0.0,
        cooldown_max_s=-1.0,
        trial_timeout_s=0.0,
    )
    with pytest.raises(ValueError) as info:
        KvcmBreaker(bad)  # the constructor refuses with the same problems
    named = {field for problem in breaker_problems(bad) for field in problem.fields}
    for name in (
        "failure_threshold",
        "window_s",
        "window_min_calls",
        "failure_rate",
        "window_buckets",
        "cooldown_s",
        "cooldown_max_s",
        "trial_timeout_s",
    ):
        assert name in str(info.value) and name in named
    assert breaker_problems(BreakerConfig()) == []  # defaults are valid


def test_cooldown_above_its_maximum_is_refused() -> None:
    bad = BreakerConfig(cooldown_s=60.0, cooldown_max_s=30.0)  # each within its own range
    with pytest.raises(ConfigError) as info:
        KvcmBreaker(bad)
    assert [problem.fields for problem in info.value.problems] == [("cooldown_s", "cooldown_max_s")]
    assert "breaker.cooldown_s" in str(info.value) and "breaker.cooldown_max_s" in str(info.value)
