"""The in-flight limit: one stall, and an open loop past capacity on a model of one CPU shared by every call
in flight (processor sharing: a routed call needs ``routed_cpu``, a shed one ``shed_cpu``; each of the
k calls in flight gets 1/k of the CPU). Times are simulated and passed in: no clock is read."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.admission import InFlightLimit
from router.config import RouterConfig

FLOOR = RouterConfig().admission_duty_floor  # the shipped floor, 1/32

BUDGET_S = 0.030


@dataclass(slots=True)
class _Call:
    work_s: float  # CPU still needed
    routed: bool
    handed_at: float


@dataclass(frozen=True, slots=True)
class _Done:
    routed: bool
    handed_at: float
    answered_at: float


class _SharedCpu:
    """Calls in flight on one processor-shared CPU; the limit admits or sheds each new call."""

    def __init__(self, limit: InFlightLimit, routed_cpu: float, shed_cpu: float, budget_s: float = BUDGET_S) -> None:
        self.limit = limit
        self.budget_s = budget_s
        self.routed_cpu = routed_cpu
        self.shed_cpu = shed_cpu
        self.now = 0.0
        self.calls: list[_Call] = []
        self.done: list[_Done] = []
        self.peak = 0  # the most routed calls in flight since the last routed answer, as the gate counts

    def routed_in_flight(self) -> int:
        return sum(c.routed for c in self.calls)

    def arrive(self) -> None:
        ahead = self.routed_in_flight()
        if self.limit.has_place(ahead, self.now):
            self.calls.append(_Call(self.routed_cpu, True, self.now))
            self.peak = max(self.peak, ahead + 1)
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
        in_router = self.routed_in_flight()  # the answered one included
        self.calls.remove(first)
        if first.routed:
            self.limit.observe(
                handed_at=first.handed_at, now=self.now, had_s=self.budget_s, in_router=max(self.peak, in_router)
            )
            self.peak = in_router - 1
        self.done.append(_Done(first.routed, first.handed_at, self.now))
        return 1


def _open_loop(
    limit: InFlightLimit, rate_per_s: float, routed_cpu: float, shed_cpu: float, seconds: float
) -> list[_Done]:
    """Calls arriving every 1/rate_per_s whether or not earlier ones were answered."""
    cpu = _SharedCpu(limit, routed_cpu, shed_cpu)
    _arrive_every(cpu, 1.0 / rate_per_s, seconds)
    return cpu.done


def _arrive_every(cpu: _SharedCpu, gap_s: float, until: float) -> None:
    due = cpu.now
    while due < until:
        while cpu.run_until(due):
            pass
        cpu.arrive()
        due += gap_s


@settings(max_examples=50, deadline=None)
@given(
    initial=st.integers(min_value=1, max_value=256),
    in_flight=st.integers(min_value=1, max_value=60),
    stall_s=st.floats(min_value=0.031, max_value=2.0),
)
def test_each_call_a_stall_made_late_shrinks_the_limit_and_timely_answers_grow_it_back(
    initial: int, in_flight: int, stall_s: float
) -> None:
    limit = InFlightLimit(initial=initial, ceiling=256, floor=FLOOR)
    for i in range(in_flight):  # every call in flight when the loop stalled comes back late, together
        limit.observe(handed_at=0.0, now=stall_s + i * 1e-6, had_s=0.030, in_router=in_flight - i)
    expected = float(initial)
    for _ in range(in_flight):
        expected = max(FLOOR, expected * 0.9)
    assert limit.share == pytest.approx(expected)
    now = stall_s + 1.0
    # Below one, x1.1 each (at most 37 from the floor); then 1/limit each: about half the limit's square.
    most = initial * initial // 2 + 2 + math.ceil(math.log(1 / FLOOR) / math.log(1.1))
    for _ in range(most):  # the loop is on time again, and as many calls as it may take in it
        limit.observe(handed_at=now, now=now + 0.005, had_s=0.030, in_router=max(1, limit.limit))
        now += 0.001
        if limit.limit >= initial:
            break
    assert limit.limit >= initial, f"not grown back after {most} timely answers"


def test_steady_over_offer_converges_to_a_routed_share_bounded_by_capacity() -> None:
    routed_cpu, shed_cpu = 0.0025, 0.0005
    capacity = 1 / routed_cpu  # 400 routed decisions/s with the CPU to themselves
    limit = InFlightLimit(initial=16, ceiling=256, floor=FLOOR)
    done = _open_loop(limit, 2 * capacity, routed_cpu, shed_cpu, seconds=6.0)
    steady = [d for d in done if d.handed_at >= 3.0]
    routed = [d for d in steady if d.routed]
    assert 0.5 * capacity * 3.0 <= len(routed) <= capacity * 3.0  # most of what the CPU can, never more
    assert len(routed) <= 0.7 * len(steady)  # the rest of the over-offer is shed
    assert 2 <= limit.limit < 16


def test_the_in_flight_limit_shrinks_on_late_answers_and_grows_back_on_timely_ones() -> None:
    limit = InFlightLimit(initial=16, ceiling=64, floor=FLOOR)
    now = 0.0
    for _ in range(30):  # one call at a time, each answered after its deadline: it waited for the CPU
        limit.observe(handed_at=now, now=now + 0.040, had_s=0.030, in_router=1)
        now += 0.040
    assert limit.limit < 1 + 16 * 0.9**25
    low = limit.limit
    for _ in range(200):  # timely, as many at once as the limit takes
        limit.observe(handed_at=now, now=now + 0.005, had_s=0.030, in_router=max(1, limit.limit))
        now += 0.005
    assert low < limit.limit <= 64
    for _ in range(100_000):
        limit.observe(handed_at=now, now=now + 0.001, had_s=0.030, in_router=limit.limit)
    assert limit.limit == 64  # never beyond the ceiling
    limit.observe(handed_at=now, now=now + 0.1, had_s=0.030, in_router=64, answered=False)
    assert limit.limit == int(64 * 0.9)  # a call never answered is late


def test_a_call_never_answered_shrinks_the_limit_even_within_the_time_it_had() -> None:
    limit = InFlightLimit(initial=4, ceiling=64, floor=FLOOR)
    limit.observe(handed_at=0.0, now=0.001, had_s=0.030, in_router=4, answered=False)
    assert limit.share == pytest.approx(4 * 0.9)


def test_the_limit_grows_by_one_a_round_of_timely_answers_not_one_an_answer() -> None:
    limit = InFlightLimit(initial=4, ceiling=64, floor=FLOOR)
    limit.observe(handed_at=0.0, now=0.001, had_s=0.030, in_router=4)
    assert limit.share == pytest.approx(4.25)  # 1/limit an answer: one more place for each round of four


def test_the_limit_grows_only_while_it_binds() -> None:
    limit = InFlightLimit(initial=4, ceiling=64, floor=FLOOR)
    for _ in range(1000):  # three at a time, each on time: the fourth place is never taken
        limit.observe(handed_at=0.0, now=0.001, had_s=0.030, in_router=3)
    assert limit.share == 4.0
    limit.observe(handed_at=0.0, now=0.001, had_s=0.030, in_router=4)
    assert limit.share == pytest.approx(4.25)


def test_a_long_light_load_leaves_the_limit_where_an_overload_costs_one_burst_of_late_answers() -> None:
    """A minute of light load, every answer on time with about one call in the router, then twice
    what the CPU can route: the overload's first late answers are the one burst the limit let in
    before any came back, where a limit grown by every light answer (to about 110) let in several
    times that before it had come down."""
    routed_cpu, shed_cpu = 0.0025, 0.0005
    limit = InFlightLimit(initial=16, ceiling=256, floor=FLOOR)
    cpu = _SharedCpu(limit, routed_cpu, shed_cpu)
    _arrive_every(cpu, 0.010, 60.0)
    assert all(d.answered_at - d.handed_at <= BUDGET_S for d in cpu.done)
    assert limit.limit == 16
    overload_at = cpu.now
    _arrive_every(cpu, routed_cpu / 2, overload_at + 1.0)
    late = [
        d
        for d in cpu.done
        if d.routed and overload_at <= d.handed_at < overload_at + 0.2 and d.answered_at - d.handed_at > BUDGET_S
    ]
    assert 0 < len(late) <= 16


def test_an_answer_in_time_for_a_call_that_queued_for_most_of_its_deadline_shrinks_the_limit() -> None:
    limit = InFlightLimit(initial=16, ceiling=64, floor=FLOOR)
    limit.observe(handed_at=0.0, now=0.001, had_s=0.030, in_router=16, crowded=True)  # in time, but crowded
    assert limit.share == pytest.approx(16 * 0.9)
    for _ in range(100):
        limit.observe(handed_at=0.0, now=0.001, had_s=0.030, in_router=16, crowded=True)
    assert limit.share == FLOOR  # never below the floor
    # The same answer, uncrowded, grows it back.
    limit.observe(handed_at=0.0, now=0.001, had_s=0.030, in_router=1)
    assert limit.share > FLOOR


def test_below_one_the_limit_is_a_duty_cycle_that_leaves_the_router_idle_after_each_late_answer() -> None:
    limit = InFlightLimit(initial=1, ceiling=64, floor=FLOOR)
    now = 0.0
    for _ in range(7):  # lone calls, each 40 ms for its 30: the CPU is taken by something else
        assert limit.has_place(0, now)
        limit.observe(handed_at=now, now=now + 0.040, had_s=0.030, in_router=1)
        now += 0.040
        assert not limit.has_place(0, now)  # idle now: (1/limit - 1) x 40 ms
        now = limit.idle_until
    share = limit.share
    assert share == pytest.approx(0.9**7)
    assert limit.limit == 0
    assert limit.idle_until == pytest.approx(now)  # set from the last late call: 40 ms x (1/share - 1)
    assert not limit.has_place(1, now + 10.0)  # one in the router is the whole duty cycle
    assert limit.has_place(0, now)
    limit.observe(handed_at=now, now=now + 0.010, had_s=0.030, in_router=1)  # in time: x1.1, not +1/limit
    assert limit.share == pytest.approx(share * 1.1)
    assert limit.idle_until == pytest.approx(now + 0.010 + 0.010 * (1 / limit.share - 1))
    for _ in range(1000):  # never below the floor
        limit.observe(handed_at=0.0, now=1.0, had_s=0.030, in_router=1, answered=False)
    assert limit.share == pytest.approx(FLOOR)
    for _ in range(math.ceil(math.log(1 / FLOOR) / math.log(1.1))):  # back to whole places in time
        limit.observe(handed_at=5.0, now=5.001, had_s=0.030, in_router=1)
    assert limit.limit == 1
    assert limit.has_place(0, 5.001)


def test_lone_calls_slowed_by_a_cpu_hog_are_routed_less_than_one_at_a_time() -> None:
    """Processor sharing with a hog that always runs: a routed call (5 ms of CPU) alone with it takes
    10 ms, so with a 4 ms budget every routed call is late. Whole places would keep one routed call in
    flight all the time; the duty cycle keeps the router mostly idle and sheds the rest."""
    limit = InFlightLimit(initial=4, ceiling=64, floor=FLOOR)
    cpu = _SharedCpu(limit, routed_cpu=0.005, shed_cpu=0.0001, budget_s=0.004)
    cpu.calls.append(_Call(work_s=1e9, routed=False, handed_at=0.0))  # the hog: never ends
    due = 0.0
    while due < 20.0:
        while cpu.run_until(due):
            pass
        cpu.arrive()
        due += 0.001
    late = [d for d in cpu.done if d.routed and d.handed_at >= 10.0]
    busy_s = sum(d.answered_at - d.handed_at for d in late)
    assert late  # it still tries now and then
    assert busy_s < 0.25 * 10.0  # whole places: busy all 10 s
    assert limit.share < 0.25
