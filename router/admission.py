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
once: it grows while they are answered well within their time and shrinks when they are not. A
request that finds the limit reached may wait for a place as long as :func:`slot_wait_s` allows.
"""

from __future__ import annotations

import math
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


def slot_wait_s(view: AdmissionView, left_s: float) -> float:
    """How long a request with ``left_s`` to go may wait for a place among the requests in flight:
    at most a quarter of it, so that the chain still has the time its remote calls need once it is
    handed over, and never beyond what leaves the expected cost covered (0: it may not wait)."""
    return max(0.0, min(left_s / 4, left_s - view.expected_s))


# The limit's steps: a late answer multiplies it by _DECREASE; below one, an answer in time by _REGROWTH.
_DECREASE = 0.9
_REGROWTH = 1.1


class InFlightLimit:
    """How many requests may be in the router at once: additive increase while they fill it and are
    answered within the time they had, multiplicative decrease (``_DECREASE``) when one is not (the
    congestion signal of a saturated loop: requests queue for the CPU and come back late; the
    router answers by its deadline, so one answered later than that waited for the CPU).

    Every late answer shrinks it, also the several one slow spell brings back together: a
    once-per-round decrease routed more calls under a closed loop but answered fewer of them in
    time, and a shed is never late.

    Below one it is a duty cycle: the share of the time one request is in the router. After each
    answer the router is left idle for (1/limit - 1) times that request's time, so a loop whose
    lone requests come back late (the CPU taken by other threads) gets fewer of them, down to
    ``floor``. Down there an answer in time multiplies it by ``_REGROWTH`` instead of adding to it:
    a lone request alone on time is no proof the next will be, and adding one would undo every
    decrease at once. Times are passed in (one clock for ``handed_at`` and ``now``). Not
    thread-safe: its owner serialises the calls."""

    __slots__ = ("_ceiling", "_floor", "_idle_until", "_limit")

    def __init__(self, *, initial: int, ceiling: int, floor: float) -> None:
        self._ceiling = float(max(1, ceiling))
        self._limit = min(float(max(1, initial)), self._ceiling)
        self._floor = min(1.0, floor)
        self._idle_until = -math.inf

    @property
    def limit(self) -> int:
        """Whole requests at once (0: below one, a duty cycle)."""
        return int(self._limit)

    @property
    def share(self) -> float:
        return self._limit

    @property
    def idle_until(self) -> float:
        """Below one: when the router, once empty, takes the next request (-inf: at once)."""
        return self._idle_until

    def has_place(self, in_router: int, now: float) -> bool:
        """Whether one more request may be handed to the router now, with ``in_router`` there."""
        if in_router < int(self._limit):
            return True
        return in_router == 0 and now >= self._idle_until

    def observe(
        self,
        *,
        handed_at: float,
        now: float,
        had_s: float,
        in_router: int,
        answered: bool = True,
        crowded: bool = False,
    ) -> None:
        """One admitted request, handed to the router at ``handed_at`` with ``had_s`` to spare, came
        back at ``now`` (``answered`` False: it never did, which is late); ``in_router``: the most
        requests in the router since the previous answer, itself included. ``crowded``: before it
        was taken it had waited for more than half its caller's deadline — the process is short of
        CPU, and a routed request is what costs the most of it, so that counts as late too.

        The limit grows only while it binds (``in_router`` reached its whole part): a light load,
        every answer on time, says nothing of what more requests at once would cost, and a limit
        grown far past what it ever held would take one late answer per tenth of it to come down when
        the load came."""
        limit = self._limit
        if answered and not crowded and now - handed_at <= had_s:
            if in_router >= int(limit):
                limit = min(self._ceiling, limit + 1.0 / limit if limit >= 1.0 else min(1.0, limit * _REGROWTH))
        else:
            limit = max(self._floor, limit * _DECREASE)
        self._limit = limit
        self._idle_until = now + (now - handed_at) * (1.0 / limit - 1.0) if limit < 1.0 else -math.inf


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

    def observe_lag(self, seconds: float, *, intervals: float = 1.0) -> None:
        """One measured lag of the routing loop (how late a timer fired); ages an own time no
        admitted request has refreshed since the previous lag sample.

        ``intervals``: the probe intervals the timer stood for (an idle loop probes less often). The
        averages move as that many probes would have moved them: the ones before this sample found
        nothing due, so they count as no lag, and each ages a stale own time. ``seconds`` 0 with
        fewer intervals than one ages the averages by that part of a probe (a request cut the wait
        short)."""
        keep = self._decay ** max(0.0, intervals)
        sample_weight = 1 - self._decay if intervals >= 1.0 else 1 - keep
        self._lag_s = self._lag_s * keep + max(0.0, seconds) * sample_weight
        if not self._own_fresh:
            self._own_s *= keep
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
