"""Pure policy for the WorkerProber: the probe rate budget and outlier ejection.

No I/O and no clock reads: every function takes the time it needs. The prober
(actors/worker_prober.py) owns the state and passes ``trio.current_time()`` in.
"""

from __future__ import annotations

import math

from router.config import ProberConfig
from router.problems import Problem, range_problems


class TokenBucket:
    """A token bucket that hands out *reservations*: "your token is ready at time t".

    Tokens accrue at ``rate_per_s`` up to ``burst``. ``reserve`` takes one token
    now, going into debt when the bucket is empty; the debt fixes when the token
    becomes usable, so waiting for it is one ``sleep_until``, never a poll. A
    reservation that would be ready only after the caller's deadline is refused
    and costs nothing. Over any window of length w at most ``burst + rate × w``
    reservations become ready, and an unused reservation is given back with
    ``refund``. Created with ``now=-inf`` it is full at whatever time it is first used.
    """

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s: must be > 0, got {rate_per_s}")
        if burst < 1:
            raise ValueError(f"burst: must be >= 1, got {burst}")
        self._rate = rate_per_s
        self._burst = float(burst)
        self._tokens = float(burst)  # negative = reserved ahead (debt)
        self._updated = now

    def _refill(self, now: float) -> None:
        if now > self._updated:
            self._tokens = min(self._burst, self._tokens + (now - self._updated) * self._rate)
            self._updated = now

    def tokens(self, now: float) -> float:
        """Tokens available at ``now``; negative when tokens are already reserved ahead."""
        self._refill(now)
        return self._tokens

    def reserve(self, now: float, deadline: float) -> float | None:
        """Take one token; return when it is usable (>= now), or None if that is after ``deadline``."""
        self._refill(now)
        self._tokens -= 1.0
        if self._tokens >= 0.0:
            return now
        ready_at = now + (-self._tokens) / self._rate
        if ready_at > deadline:
            self._tokens += 1.0
            return None
        return ready_at

    def peek(self, now: float) -> float:
        """Like :meth:`tokens`, without changing the bucket (for readers other than its owner)."""
        if now > self._updated:
            return min(self._burst, self._tokens + (now - self._updated) * self._rate)
        return self._tokens

    def take(self, now: float) -> bool:
        """Take one token only if it is in the bucket now; never a debt."""
        self._refill(now)
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def refund(self, now: float) -> None:
        """Give back one reserved token that was not used."""
        self._refill(now)
        self._tokens = min(self._burst, self._tokens + 1.0)


def ejection_duration_s(times_ejected: int, base_s: float, max_s: float) -> float:
    """Envoy-style: the n-th ejection lasts base × n, capped at max."""
    return min(base_s * max(1, times_ejected), max_s)


def decayed_ejection_count(times_ejected: int, healthy_for_s: float, base_s: float) -> int:
    """Forget one past ejection per ``base_s`` a worker stayed out of ejection (Envoy decrements its
    multiplier the same way), so a worker that flapped once long ago starts again from base × 1."""
    if healthy_for_s <= 0.0:
        return times_ejected
    return max(0, times_ejected - math.floor(healthy_for_s / base_s))


def ejection_cap(known_workers: int, max_fraction: float) -> int:
    """Most workers ejected at once: ``floor(max_fraction × known)``, but at least one when two or
    more are known, as Envoy ejects at least one host whatever its percentage (with 10 % and a
    fleet of 4, an outlier could otherwise never be ejected). A lone worker is never ejected: with
    no healthy peer it is no outlier. ``max_fraction`` 0 turns ejection off."""
    if max_fraction <= 0.0 or known_workers < 2:
        return 0
    return max(1, math.floor(max_fraction * known_workers + 1e-9))


def ejection_allowed(ejected_now: int, known_workers: int, max_fraction: float) -> bool:
    """True when one more ejection stays within :func:`ejection_cap`."""
    return ejected_now < ejection_cap(known_workers, max_fraction)


def collective_failure(failing: int, known_workers: int, max_fraction: float) -> bool:
    """More workers failing than may be ejected: a shared cause (a network partition, a frozen
    fleet), not outliers. Ejecting them would keep healthy workers out long after the cause ends."""
    return failing > ejection_cap(known_workers, max_fraction)


def prober_problems(config: ProberConfig) -> list[Problem]:
    """Every reason the prober cannot work with ``config`` (empty when it can)."""
    problems = range_problems(config)
    if config.fresh_ttl_s > config.max_status_age_s:
        # A status fresh enough to skip a probe must still be young enough to score with.
        problems.append(
            Problem(
                ("fresh_ttl_s", "max_status_age_s"),
                f"the freshness TTL ({config.fresh_ttl_s} s) is above the max status age "
                f"({config.max_status_age_s} s)",
            )
        )
    if config.hot_window_s < config.refresh_interval_s:
        # A worker must stay hot for at least one refresh, or wanting it would poll it never.
        problems.append(
            Problem(
                ("hot_window_s", "refresh_interval_s"),
                f"the hot window ({config.hot_window_s} s) is shorter than the refresh interval "
                f"({config.refresh_interval_s} s)",
            )
        )
    if config.eject_base_s > config.eject_max_s:
        problems.append(
            Problem(
                ("eject_base_s", "eject_max_s"), f"{config.eject_base_s} is above the maximum {config.eject_max_s}"
            )
        )
    return problems
