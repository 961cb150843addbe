"""What admitting a request will cost: a running estimate of the router's own time per request and
of the routing loop's lag (pure; times are passed in).

A request whose remaining budget cannot cover ``expected_s()`` would only be answered late: the
router answers it at admission instead (domain fallback, reason ``overloaded``), before hashing,
querying or probing. Both are exponentially weighted averages: a sustained lag (the loop saturated)
raises the estimate within a few samples, while one isolated stall (a collection) moves it little.

The own-time average is fed only by admitted requests, so while everything is shed it would keep
its last value forever: a latch that sheds every request after one slow spell. Each lag sample
with no own-time sample since the previous one ages it instead, so shedding ends once the loop is
on time again.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.config import RouterConfig


@dataclass(frozen=True, slots=True)
class AdmissionView:
    own_s: float  # the router's own time per request (hashing, planning, scoring, hops)
    lag_s: float  # how late the routing loop runs a task that is due
    expected_s: float  # what a request needs at least: own + lag


class AdmissionEstimate:
    """Exponentially weighted averages of the per-request own time and of the loop lag."""

    __slots__ = ("_decay", "_lag_s", "_own_fresh", "_own_s")

    def __init__(self, config: RouterConfig) -> None:
        self._decay = config.admission_decay
        self._own_s = 0.0
        self._lag_s = 0.0
        self._own_fresh = False  # an own-time sample arrived since the last lag sample

    def observe_own(self, seconds: float) -> None:
        """One request's own time (its CPU-bound stages and the Scorer hop)."""
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

    def admits(self, remaining_s: float) -> bool:
        return remaining_s >= self.expected_s()

    @property
    def lag_s(self) -> float:
        """The routing loop's average lag: how late a due task runs."""
        return self._lag_s

    def view(self) -> AdmissionView:
        return AdmissionView(self._own_s, self._lag_s, self.expected_s())
