"""What admitting a request will cost: a running estimate of the router's own time per request and
of the routing loop's lag, and a limit on requests in flight learnt from how late they are
answered (pure; times are passed in).

A request whose remaining budget cannot cover ``expected_s()`` would only be answered late: the
router answers it at admission instead (domain fallback, reason ``overloaded``), before hashing,
querying or probing. Both are exponentially weighted averages: a sustained lag (the loop
saturated) raises the estimate within a few samples, while one isolated stall (a collection)
moves it little. The own-time average is fed only by admitted requests, so while everything is shed
it would keep its last value forever: each lag sample with no own-time sample since the previous one
ages it instead, and shedding ends once the loop is on time again.

:class:`InFlightLimit` bounds how many requests a receiving thread hands to the routing loop at
once: it grows while they are answered well within their time and shrinks when they are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.config import RouterConfig


@dataclass(frozen=True, slots=True)
class AdmissionView:
    own_s: float  # the router's own time per request (hashing, planning, the Scorer's work; no waits)
    lag_s: float  # how late the routing loop runs a task that is due
    expected_s: float  # what a request needs at least: own + lag


def admits(view: AdmissionView, remaining_s: float, *, in_flight: int) -> bool:
    """Whether ``remaining_s`` covers the expected cost. A request alone (``in_flight`` 0) is judged
    by the loop's lag only: the own time is learnt from admitted requests, so after one stall pushed
    it past every budget nothing would be admitted to correct it; a request alone is admitted to
    take that fresh sample."""
    return _covers(remaining_s, view.lag_s, view.own_s, in_flight)


def _covers(remaining_s: float, lag_s: float, own_s: float, in_flight: int) -> bool:
    return remaining_s >= (lag_s if in_flight <= 0 else own_s + lag_s)


class InFlightLimit:
    """How many requests may be in the router at once: additive increase while they are answered
    within ``late_share`` of the time they had, multiplicative decrease when one is not (the
    congestion signal of a saturated loop: requests queue for the CPU and come back late; the
    router answers by its deadline, so one answered later than that waited for the CPU).

    Every late answer shrinks it, also the several one slow spell brings back together: a
    once-per-round decrease routed more calls under a closed loop but answered fewer of them in
    time, and a shed is never late. Times are passed in (one clock for ``handed_at`` and ``now``).
    Not thread-safe: its owner serialises the calls."""

    __slots__ = ("_ceiling", "_decrease", "_late_share", "_limit")

    def __init__(self, *, initial: int, ceiling: int, late_share: float = 1.0, decrease: float = 0.9) -> None:
        self._ceiling = float(max(1, ceiling))
        self._limit = min(float(max(1, initial)), self._ceiling)
        self._late_share = late_share
        self._decrease = decrease

    @property
    def limit(self) -> int:
        return int(self._limit)

    def observe(self, *, handed_at: float, now: float, had_s: float, answered: bool = True) -> None:
        """One admitted request, handed to the router at ``handed_at`` with ``had_s`` to spare, came
        back at ``now`` (``answered`` False: it never did, which is late)."""
        if answered and now - handed_at <= self._late_share * had_s:
            self._limit = min(self._ceiling, self._limit + 1.0 / self._limit)
        else:
            self._limit = max(1.0, self._limit * self._decrease)


class AdmissionEstimate:
    """Exponentially weighted averages of the per-request own time and of the loop lag."""

    __slots__ = ("_decay", "_lag_s", "_own_fresh", "_own_s")

    def __init__(self, config: RouterConfig) -> None:
        self._decay = config.admission_decay
        self._own_s = 0.0
        self._lag_s = 0.0
        self._own_fresh = False  # an own-time sample arrived since the last lag sample

    def observe_own(self, seconds: float) -> None:
        """One request's own time: its CPU-bound stages (hashing, planning) and the Scorer's work on its
        decision, without the wait in the Scorer's inbox (that is the loop's lag, observed apart)."""
        self._own_s = self._own_s * self._decay + max(0.0, seconds) * (1 - self._decay)
        self._own_fresh = True

    def observe_lag(self, seconds: float) -> None:
        """One measured lag of the routing loop (how late a timer fired); ages an own time no
        admitted request has refreshed since the previous lag sample."""
        self._lag_s = self._lag_s * self._decay + max(0.0, seconds) * (1 - self._decay)
        if not self._own_fresh:
            self._own_s *= self._decay
        self._own_fresh = False

    def expected_s(self) -> float:
        return self._own_s + self._lag_s

    @property
    def lag_s(self) -> float:
        """The routing loop's average lag: how late a due task runs."""
        return self._lag_s

    def admits(self, remaining_s: float, *, in_flight: int = 1) -> bool:
        """:func:`admits` on the current estimate (without building a view: it runs for every request)."""
        return _covers(remaining_s, self._lag_s, self._own_s, in_flight)

    def view(self) -> AdmissionView:
        return AdmissionView(self._own_s, self._lag_s, self.expected_s())
