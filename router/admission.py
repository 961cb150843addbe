"""What admitting a request will cost: a running estimate of the router's own time per request and
of the routing loop's lag (pure; times are passed in).

A request whose remaining budget cannot cover ``expected_s()`` would only be answered late: the
router answers it at admission instead (domain fallback, reason ``overloaded``), before hashing,
querying or probing. Both are exponentially weighted averages: a sustained lag (the loop saturated)
raises the estimate within a few samples, while one isolated stall (a collection) moves it little.
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

    __slots__ = ("_decay", "_lag_s", "_own_s")

    def __init__(self, config: RouterConfig) -> None:
        self._decay = config.admission_decay
        self._own_s = 0.0
        self._lag_s = 0.0

    def observe_own(self, seconds: float) -> None:
        """One request's own time (its CPU-bound stages and the Scorer hop)."""
        self._own_s = self._own_s * self._decay + max(0.0, seconds) * (1 - self._decay)

    def observe_lag(self, seconds: float) -> None:
        """One measured lag of the routing loop (how late a timer fired)."""
        self._lag_s = self._lag_s * self._decay + max(0.0, seconds) * (1 - self._decay)

    def expected_s(self) -> float:
        return self._own_s + self._lag_s

    def admits(self, remaining_s: float, *, alone: bool = False) -> bool:
        """Whether ``remaining_s`` covers the expected cost. ``alone`` (no other request in flight):
        the own-time estimate is not asked, only the loop's lag. The own time is learnt only from
        admitted requests, so after one stall pushed it past every budget nothing would be admitted
        to correct it; a request alone is admitted to take that fresh sample."""
        return remaining_s >= (self._lag_s if alone else self.expected_s())

    def view(self) -> AdmissionView:
        return AdmissionView(self._own_s, self._lag_s, self.expected_s())
