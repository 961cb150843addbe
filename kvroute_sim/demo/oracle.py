"""The TTFT oracle: the ceiling for a per-request router (a baseline, not a router policy).

Exact: at each request's arrival it asks the simulator when the request's prefill would start
and end on every worker, from that worker's exact cache, queue, decodes and running KV at that
instant (``RequestView.plan_if_routed``, the simulator's own look-ahead, changing nothing).

Greedy on the request's own TTFT is not a ceiling. A placement also costs the requests that come
after it, in three ways the greedy choice does not see:

- its prefill delays every later request queued behind it on that worker;
- the blocks a copy stores (a prefix another worker already holds) evict prefixes later requests
  would have hit, which they then prefill again, behind other work once no worker is idle;
- a request that waits behind its own prefix group's work on the one worker holding the prefix
  tells that the group is hot: the next requests of the group wait there too, and a copy on
  another worker (a second home) would have served them.

A greedy choice that saves one request a millisecond can cost the next requests much more
(``tests/test_demo_evidence.py`` holds a two-worker case where it loses). So the oracle is a
family of exact placements (``FAMILY``), each minimising, per request,

    cost(worker) = TTFT(worker)
                 + delay x prefill_s(worker) x later(worker) / workers
                 + copy x pressure x copied_s(worker)
                 + wait x wait_s(worker)

where ``prefill_s`` is the request's own prefill time there, ``later`` the number of requests of
the workload known to arrive before that prefill ends (the oracle knows the arrivals; on average
one in ``workers`` of them lands behind it); ``copied_s`` the time to prefill the part of the
prompt another worker holds and this one does not (the copy), ``pressure`` the least loaded
worker's outstanding prefill over the request's length, capped at 1 (an eviction costs queueing
only once no worker is idle); ``wait_s`` the time the request would queue there before its prefill
starts. All weights 0 is the plain greedy TTFT choice. Every member of ``FAMILY`` is replayed on a
fresh cluster and the run with the lowest mean TTFT is the oracle's (``run_oracle``): the best of
exact per-request placements in hindsight. Ties (equal to the nanosecond) go to the longest cached
prefix, then the least outstanding work, then (``spread_ties``) the worker it chose least recently,
then a seeded random choice.

Results are sensitive to small changes of early placements (a different copy early on changes which
prefixes later requests find): a member's mean moves by a few percent with its tie-breaking alone.
The family's spread of members is what keeps the best of them below every router on every rung.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvroute_sim.demo.request_view import RequestView
from kvroute_sim.demo.runner import ClusterSpec, PolicyRun, Progress, run_baseline
from kvroute_sim.demo.workload import Workload

ORACLE = "oracle"
_TIE_S = 1e-9


@dataclass(frozen=True, slots=True)
class OracleWeights:
    """One member of the family: the weights of the module doc's cost (all 0: greedy TTFT)."""

    delay: float = 0.0
    copy: float = 0.0
    wait: float = 0.0
    spread_ties: bool = False  # exact ties go to the worker chosen least recently (else a seeded draw)

    def __post_init__(self) -> None:
        for name, value in (("delay", self.delay), ("copy", self.copy), ("wait", self.wait)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be >= 0, got {value}")

    def label(self) -> str:
        ties = ", spread ties" if self.spread_ties else ""
        return f"delay {self.delay:g}, copy {self.copy:g}, wait {self.wait:g}{ties}"


# Every member is an exact placement; more members only raise the ceiling, at the cost of a replay
# each. The members are those that gave the lowest mean somewhere on the synthetic ladder and the
# generated traces' ladders (seeds 0-2, 30-110 % load): delay (and a copy price) on the loaded rungs,
# the wait weight (with a copy price) on the light ones, where hot prefix groups want a second home
# early. Spreading exact ties matters most on light rungs, where many workers are idle at once.
FAMILY = (
    OracleWeights(),
    OracleWeights(delay=0.5),
    OracleWeights(copy=2.0),
    OracleWeights(copy=1.0, spread_ties=True),
    OracleWeights(delay=0.05, copy=2.0),
    OracleWeights(delay=0.05, copy=2.0, spread_ties=True),
    OracleWeights(delay=0.25, copy=2.0),
    OracleWeights(delay=0.25, copy=2.0, spread_ties=True),
    OracleWeights(copy=2.0, wait=0.25, spread_ties=True),
    OracleWeights(delay=0.1, copy=2.0, wait=0.25, spread_ties=True),
    OracleWeights(copy=2.0, wait=0.5),
    OracleWeights(copy=2.0, wait=0.5, spread_ties=True),
    OracleWeights(delay=0.05, copy=2.0, wait=0.5),
    OracleWeights(delay=0.05, copy=2.0, wait=0.5, spread_ties=True),
    OracleWeights(copy=2.0, wait=0.75),
    OracleWeights(copy=2.0, wait=0.75, spread_ties=True),
)


class TtftOracleBaseline:
    """One exact placement of the family (module doc); default weights: the greedy TTFT choice."""

    name = ORACLE

    def __init__(self, seed: int, *, weights: OracleWeights = OracleWeights(), arrivals: Sequence[float] = ()) -> None:
        """``arrivals``: the workload's arrival times, sorted (needed when ``weights.delay`` > 0)."""
        if weights.delay > 0 and not arrivals:
            raise ValueError("arrivals: needed when the delay weight is > 0")
        self._seed = seed
        self._rng = random.Random(seed)
        self._weights = weights
        self._arrivals = tuple(arrivals)
        self._last_chosen: dict[int, float] = {}

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def weights(self) -> OracleWeights:
        return self._weights

    def choose(self, keys: object, view: RequestView) -> int:
        n = len(view.hosts)
        now = view.request.arrival_s
        weights = self._weights
        plans = [view.plan_if_routed(i) for i in range(n)]
        least_uncached = min(plan.uncached for plan in plans)
        pressure = 0.0
        if weights.copy > 0:
            least_load = min(view.outstanding_tokens(i) for i in range(n))
            pressure = min(1.0, least_load / max(1, view.request.input_tokens))
        costs = []
        for plan in plans:
            prefill_s = plan.finish_at - plan.start_at
            cost = plan.finish_at - now + weights.wait * (plan.start_at - now)
            if pressure > 0 and plan.uncached > least_uncached:
                cost += weights.copy * pressure * prefill_s * (plan.uncached - least_uncached) / plan.uncached
            if weights.delay > 0:
                later = bisect.bisect_left(self._arrivals, plan.finish_at) - bisect.bisect_right(self._arrivals, now)
                cost += weights.delay * prefill_s * later / n
            costs.append(cost)
        best = min(costs)
        tied = [i for i in range(n) if costs[i] - best <= _TIE_S]
        if len(tied) > 1:
            request_keys: Sequence[int] = view.request.keys
            cached = {i: view.cached_blocks(i, request_keys) for i in tied}
            most = max(cached.values())
            tied = [i for i in tied if cached[i] == most]
        if len(tied) > 1:
            loads = {i: view.outstanding_tokens(i) for i in tied}
            least = min(loads.values())
            tied = [i for i in tied if loads[i] == least]
        if len(tied) > 1 and weights.spread_ties:
            oldest = min(self._last_chosen.get(i, -math.inf) for i in tied)
            tied = [i for i in tied if self._last_chosen.get(i, -math.inf) == oldest]
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        self._last_chosen[chosen] = now
        return chosen


def oracle_family(
    seed: int, workload: Workload, family: Sequence[OracleWeights] = FAMILY
) -> tuple[TtftOracleBaseline, ...]:
    """One fresh placement per member of ``family`` for ``workload``."""
    arrivals = tuple(r.arrival_s for r in workload.requests)
    return tuple(TtftOracleBaseline(seed, weights=w, arrivals=arrivals) for w in family)


def run_oracle(
    seed: int,
    workload: Workload,
    cluster_spec: ClusterSpec,
    progress: Progress | None = None,
    family: Sequence[OracleWeights] = FAMILY,
) -> PolicyRun:
    """Every placement of ``family`` on a fresh cluster; the run with the lowest mean TTFT (the first on a tie)."""
    if not family:
        raise ValueError("family: the oracle needs at least one member")
    best: tuple[float, PolicyRun] | None = None
    for placement in oracle_family(seed, workload, family):
        run = run_baseline(placement, workload, cluster_spec, _variant_progress(progress, placement.weights))
        ttfts = [r.ttft_s for r in run.records if r.worker >= 0]
        mean = sum(ttfts) / len(ttfts) if ttfts else math.inf
        if best is None or mean < best[0]:
            best = (mean, run)
    assert best is not None
    return replace(best[1], policy=ORACLE)


def _variant_progress(progress: Progress | None, weights: OracleWeights) -> Progress | None:
    if progress is None:
        return None
    inner = progress

    def labelled(policy: str, done: int, total: int, hit_rate: float) -> None:
        inner(f"{policy} ({weights.label()})", done, total, hit_rate)

    return labelled
