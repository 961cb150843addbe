"""The TTFT oracle: the ceiling for a per-request router (a baseline, not a router policy).

Exact: at each request's arrival it asks the simulator when the request's prefill would start
and end on every worker, from that worker's exact cache, queue, decodes and running KV at that
instant (``RequestView.plan_if_routed``, the simulator's own look-ahead, changing nothing).

Greedy on the request's own TTFT is not a ceiling. A placement also costs the requests that come
after it: its prefill delays every later request queued behind it on that worker, and the blocks
it stores evict prefixes later requests would have hit. A greedy choice that saves one request a
millisecond by prefilling a long prompt on a cold, idle worker can cost the next requests much
more (under load it spends capacity the cluster does not have; ``tests/test_demo_evidence.py``
holds a two-worker case where it loses). So the oracle is a small family of exact placements,
each minimising, per request,

    cost(worker) = TTFT(worker) + delay_weight x prefill_s(worker) x later(worker) / workers

where ``prefill_s`` is the request's own prefill time there and ``later`` the number of requests
of the workload known to arrive before that prefill ends (the oracle knows the arrivals; on
average one in ``workers`` of them lands behind it). ``delay_weight`` 0 is the plain greedy TTFT
choice. Every weight of ``DELAY_WEIGHTS`` is replayed on a fresh cluster and the run with the
lowest mean TTFT is the oracle's (``run_oracle``): the best of exact placements in hindsight.
Ties (equal to the nanosecond) go to the longest cached prefix, then the least outstanding work,
then a seeded random choice.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import replace

from kvroute_sim.demo.request_view import RequestView
from kvroute_sim.demo.runner import ClusterSpec, PolicyRun, Progress, run_baseline
from kvroute_sim.demo.workload import Workload

ORACLE = "oracle"
DELAY_WEIGHTS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)
_TIE_S = 1e-9


class TtftOracleBaseline:
    """One exact placement of the family (module doc); ``delay_weight`` 0 is the greedy TTFT choice."""

    name = ORACLE

    def __init__(self, seed: int, *, delay_weight: float = 0.0, arrivals: Sequence[float] = ()) -> None:
        """``arrivals``: the workload's arrival times, sorted (needed when ``delay_weight`` > 0)."""
        if not (math.isfinite(delay_weight) and delay_weight >= 0):
            raise ValueError(f"delay_weight: must be >= 0, got {delay_weight}")
        if delay_weight > 0 and not arrivals:
            raise ValueError("arrivals: needed when delay_weight > 0")
        self._seed = seed
        self._rng = random.Random(seed)
        self._delay_weight = delay_weight
        self._arrivals = tuple(arrivals)

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def delay_weight(self) -> float:
        return self._delay_weight

    def choose(self, keys: object, view: RequestView) -> int:
        n = len(view.hosts)
        now = view.request.arrival_s
        costs = []
        for i in range(n):
            plan = view.plan_if_routed(i)
            cost = plan.finish_at - now
            if self._delay_weight > 0:
                later = bisect.bisect_left(self._arrivals, plan.finish_at) - bisect.bisect_right(self._arrivals, now)
                cost += self._delay_weight * (plan.finish_at - plan.start_at) * later / n
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
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)


def oracle_family(seed: int, workload: Workload) -> tuple[TtftOracleBaseline, ...]:
    """One fresh placement per weight of ``DELAY_WEIGHTS`` for ``workload``."""
    arrivals = tuple(r.arrival_s for r in workload.requests)
    return tuple(TtftOracleBaseline(seed, delay_weight=w, arrivals=arrivals) for w in DELAY_WEIGHTS)


def run_oracle(seed: int, workload: Workload, cluster_spec: ClusterSpec, progress: Progress | None = None) -> PolicyRun:
    """Every placement of the family on a fresh cluster; the run with the lowest mean TTFT (the first on a tie)."""
    best: tuple[float, PolicyRun] | None = None
    for placement in oracle_family(seed, workload):
        run = run_baseline(placement, workload, cluster_spec, _variant_progress(progress, placement.delay_weight))
        ttfts = [r.ttft_s for r in run.records if r.worker >= 0]
        mean = sum(ttfts) / len(ttfts) if ttfts else math.inf
        if best is None or mean < best[0]:
            best = (mean, run)
    assert best is not None  # DELAY_WEIGHTS is not empty
    return replace(best[1], policy=ORACLE)


def _variant_progress(progress: Progress | None, delay_weight: float) -> Progress | None:
    if progress is None:
        return None
    inner = progress

    def labelled(policy: str, done: int, total: int, hit_rate: float) -> None:
        inner(f"{policy} (delay weight {delay_weight:g})", done, total, hit_rate)

    return labelled
