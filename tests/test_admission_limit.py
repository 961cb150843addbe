"""The in-flight limit under a closed loop and an open one, on a model of one CPU shared by every call
in flight (processor sharing: a routed call needs ``routed_cpu``, a shed one ``shed_cpu``; each of the
k calls in flight gets 1/k of the CPU). Times are simulated and passed in: no clock is read. A routed
call reports the routed calls ahead of it times ``routed_cpu`` as the router's own work queued ahead."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import InFlightLimit

BUDGET_S = 0.030


@dataclass(slots=True)
class _Call:
    work_s: float  # CPU still needed
    routed: bool
    handed_at: float
    queued_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _Done:
    routed: bool
    handed_at: float
    answered_at: float


class _SharedCpu:
    """Calls in flight on one processor-shared CPU; the limit admits or sheds each new call."""

    def __init__(self, limit: InFlightLimit, routed_cpu: float, shed_cpu: float) -> None:
        self.limit = limit
        self.routed_cpu = routed_cpu
        self.shed_cpu = shed_cpu
        self.now = 0.0
        self.calls: list[_Call] = []
        self.done: list[_Done] = []

    def arrive(self) -> None:
        ahead = sum(c.routed for c in self.calls)
        if ahead < self.limit.limit:
            self.calls.append(_Call(self.routed_cpu, True, self.now, ahead * self.routed_cpu))
        else:
            self.calls.append(_Call(self.shed_cpu, False, self.now))

    def run_until(self, until: float) -> int:
        """Serve until ``until`` or the next answer, whichever is first; the number answered (0 or 1)."""
        if not self.calls:
            self.now = until
            return 0
        first = min(self.calls, key=lambda c: c.work_s)
        share = len(self.calls)
        step = min(first.work_s * share, until - self.now)
        for call in self.calls:
            call.work_s -= step / share
        self.now += step
        if first.work_s > 1e-12:
            return 0
        self.calls.remove(first)
        if first.routed:
            self.limit.observe(handed_at=first.handed_at, now=self.now, had_s=BUDGET_S, queued_s=first.queued_s)
        self.done.append(_Done(first.routed, first.handed_at, self.now))
        return 1


def _closed_loop(limit: InFlightLimit, callers: int, routed_cpu: float, shed_cpu: float, calls: int) -> list[_Done]:
    """``callers`` callers, each calling again as soon as it is answered."""
    cpu = _SharedCpu(limit, routed_cpu, shed_cpu)
    for _ in range(callers):
        cpu.arrive()
    while len(cpu.done) < calls:
        if cpu.run_until(float("inf")):
            cpu.arrive()
    return cpu.done


def _open_loop(
    limit: InFlightLimit, rate_per_s: float, routed_cpu: float, shed_cpu: float, seconds: float
) -> list[_Done]:
    """Calls arriving every 1/rate_per_s whether or not earlier ones were answered."""
    cpu = _SharedCpu(limit, routed_cpu, shed_cpu)
    due = 0.0
    while due < seconds:
        while cpu.run_until(due):
            pass
        cpu.arrive()
        due += 1.0 / rate_per_s
    return cpu.done


@settings(max_examples=10, deadline=None)
@given(
    callers=st.integers(min_value=2, max_value=32),
    routed_cpu=st.floats(min_value=0.001, max_value=0.005),
    shed_share=st.floats(min_value=0.1, max_value=0.3),
)
def test_a_closed_loop_keeps_routing_its_share_of_the_cpu(callers: int, routed_cpu: float, shed_share: float) -> None:
    # Every shed caller calls again at once, so the sheds take the CPU the admitted calls would have
    # had: a smaller limit cannot make those on time, it only routes fewer. The limit must keep
    # routing what fits its budget, not collapse to one call while the rest spin on sheds.
    limit = InFlightLimit(initial=16, ceiling=256)
    done = _closed_loop(limit, callers, routed_cpu, routed_cpu * shed_share, calls=20 * callers + 1_000)
    steady = done[len(done) // 2 :]
    routed = [d for d in steady if d.routed]
    assert routed  # a routed share > 0
    span = steady[-1].answered_at - min(d.handed_at for d in steady)
    assert len(routed) <= span / routed_cpu * 1.01  # never more than the CPU can route
    # It keeps as many in the router as its own queue leaves in time (the late mark over one call's
    # CPU), or every caller, less one decrease: the late answers past that came from waiting on the sheds.
    fits = min(callers, 0.7 * BUDGET_S / routed_cpu)
    assert limit.limit >= 0.8 * fits
    if callers * routed_cpu <= 0.6 * BUDGET_S:  # everyone fits well within the budget: nothing to shed
        assert len(routed) == len(steady)


def test_an_open_loop_past_capacity_routes_about_what_the_cpu_can_in_time() -> None:
    routed_cpu, shed_cpu = 0.0025, 0.0005
    capacity = 1 / routed_cpu  # 400 routed decisions/s with the CPU to themselves
    limit = InFlightLimit(initial=16, ceiling=256)
    done = _open_loop(limit, 2 * capacity, routed_cpu, shed_cpu, seconds=6.0)
    steady = [d for d in done if d.handed_at >= 3.0]
    routed = [d for d in steady if d.routed]
    on_time = [d for d in routed if d.answered_at - d.handed_at <= BUDGET_S]
    assert len(on_time) >= 0.9 * len(routed)  # the limit came down to where routed calls are in time
    assert 0.5 * capacity * 3.0 <= len(routed) <= capacity * 3.0  # and still routes most of what the CPU can


def test_the_in_flight_limit_shrinks_on_late_answers_and_grows_back_on_timely_ones() -> None:
    limit = InFlightLimit(initial=16, ceiling=64, late_share=1.0)
    now = 0.0
    for _ in range(30):  # one call at a time, each answered after its deadline: it waited for the CPU
        limit.observe(handed_at=now, now=now + 0.040, had_s=0.030, queued_s=0.030)
        now += 0.040
    assert limit.limit < 1 + 16 * 0.9**25
    low = limit.limit
    for _ in range(200):
        limit.observe(handed_at=now, now=now + 0.005, had_s=0.030, queued_s=0.030)
        now += 0.005
    assert low < limit.limit <= 64
    for _ in range(100_000):
        limit.observe(handed_at=now, now=now + 0.001, had_s=0.030, queued_s=0.030)
    assert limit.limit == 64  # never beyond the ceiling
    limit.observe(handed_at=now, now=now + 0.1, had_s=0.030, queued_s=0.030, answered=False)
    assert limit.limit == int(64 * 0.9)  # a call never answered is late


def test_a_stall_shrinks_the_limit_once_and_ages_out() -> None:
    limit = InFlightLimit(initial=20, ceiling=64)
    for i in range(20):  # twenty calls in flight when the loop stalls for 100 ms: all come back late
        limit.observe(handed_at=0.0, now=0.100 + i * 1e-4, had_s=0.030, queued_s=0.030)
    assert limit.limit == 18  # one round, one decrease
    now = 0.2
    for _ in range(40):  # the loop is on time again
        limit.observe(handed_at=now, now=now + 0.005, had_s=0.030, queued_s=0.030)
        now += 0.001
    assert limit.limit >= 20
    late_again = now + 0.1
    limit.observe(handed_at=now, now=late_again, had_s=0.030, queued_s=0.030)  # handed off after the decrease: news
    assert limit.limit < 20


def test_a_late_answer_with_little_of_the_routers_own_work_ahead_leaves_the_limit_alone() -> None:
    # Late with 5 ms of the router's own work ahead of it out of 30: it waited for CPU others took
    # (sheds, a collection, another process), which a smaller limit does not give back.
    limit = InFlightLimit(initial=8, ceiling=64)
    now = 0.0
    for _ in range(50):
        limit.observe(handed_at=now, now=now + 0.040, had_s=0.030, queued_s=0.005)
        now += 0.040
    assert limit.limit == 8
    limit.observe(handed_at=now, now=now + 0.040, had_s=0.030, queued_s=0.021)  # its own queue: shrink
    assert limit.limit == 7
