"""The load axis: how much of the cluster's prefill capacity a workload needs (simulation only, no I/O).

Definition. ``offered_load(workload, cluster)`` is, over the workload's *bulk window*, the prefill
work the best cache reuse leaves, as a share of the cluster's prefill capacity
(``workers x prefill_tokens_per_s`` tokens per simulated second, the simulator's cost model: a
request costs its uncached tokens, at least one):

- the work: each request placed on the worker holding its longest cached prefix, on the cluster's
  own finite LRU caches, ties to the worker given the least work so far (``BestReusePlacement``,
  which looks at no clock, so the work does not change when arrivals are scaled); its uncached
  tokens are what the best reuse the cluster's caches allow leaves to compute. A policy that
  copies prefixes to spread load does more work than this, and shows a higher busy share.
- the bulk window: the shortest span of arrivals holding ``BULK_SHARE`` of the requests. A workload
  of sessions starts them for a while and then trails off with their last follow-up turns;
  averaging over the whole span would call a workload whose bulk overloads the cluster lightly
  loaded.

The load scales exactly with the arrival rate (``scale_to_load``). The ladder checks the label by
measuring, on the simulated clock, the share of the bulk window the oracle's workers spent
prefilling (its ``PolicyRun.busy_share``).
"""

from __future__ import annotations

import math
from dataclasses import replace

from kvroute_sim.demo.request_view import RequestView
from kvroute_sim.demo.runner import ClusterSpec, run_baseline
from kvroute_sim.demo.workload import Workload, bulk_span, bulk_window

BEST_REUSE = "best-reuse"
_MAX_WORKERS = 4096


class BestReusePlacement:
    """The reference placement of the load axis (module doc): longest cached prefix, then least work so far."""

    name = BEST_REUSE

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._assigned: list[int] = []

    def choose(self, keys: object, view: RequestView) -> int:
        n = len(view.hosts)
        if len(self._assigned) != n:
            self._assigned = [0] * n
        request = view.request
        cached = [view.cached_blocks(i, request.keys) for i in range(n)]
        worker = min(range(n), key=lambda i: (-cached[i], self._assigned[i], i))
        # The tally only orders ties; the simulator decides what the request really costs.
        self._assigned[worker] += max(1, request.input_tokens - cached[worker] * self._block_size)
        return worker


def best_reuse_prefill_tokens(workload: Workload, cluster: ClusterSpec) -> tuple[int, ...]:
    """Per request, the uncached tokens ``BestReusePlacement`` leaves on ``cluster`` (in arrival order)."""
    run = run_baseline(BestReusePlacement(workload.spec.block_size), workload, cluster)
    return tuple(max(1, r.input_tokens - r.cached_tokens) for r in run.records)


def offered_load(workload: Workload, cluster: ClusterSpec) -> float:
    """The bulk window's best-reuse prefill work over the cluster's prefill capacity (module doc)."""
    start, end = bulk_span(workload)
    if not end > start:
        return math.inf
    first, stop = bulk_window([r.arrival_s for r in workload.requests])
    work = sum(best_reuse_prefill_tokens(workload, cluster)[first:stop])
    return work / ((end - start) * cluster.workers * cluster.prefill_tokens_per_s)


def scale_arrivals(workload: Workload, factor: float) -> Workload:
    """The same requests arriving ``factor`` times faster (load x factor)."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor: must be > 0, got {factor}")
    requests = tuple(replace(r, arrival_s=r.arrival_s / factor) for r in workload.requests)
    return replace(workload, requests=requests)


def scale_to_load(workload: Workload, cluster: ClusterSpec, load: float, *, base: float | None = None) -> Workload:
    """``workload`` with its arrivals scaled so that its ``offered_load`` on ``cluster`` is ``load``.

    ``base``: the workload's offered load on ``cluster`` when already known."""
    current = offered_load(workload, cluster) if base is None else base
    if not (math.isfinite(current) and current > 0):
        raise ValueError("the workload needs arrivals at two different times at least to set a load")
    return scale_arrivals(workload, load / current)


def workers_for_load(workload: Workload, cluster: ClusterSpec, target_load: float) -> int:
    """The fewest workers (at least 1) that keep ``workload``'s offered load at or below ``target_load``."""
    low, high = 1, 1
    while offered_load(workload, replace(cluster, workers=high)) > target_load:
        if high >= _MAX_WORKERS:
            return _MAX_WORKERS
        low, high = high + 1, min(_MAX_WORKERS, 2 * high)
    while low < high:  # more workers, more capacity (and more cache): the load falls
        middle = (low + high) // 2
        if offered_load(workload, replace(cluster, workers=middle)) <= target_load:
            high = middle
        else:
            low = middle + 1
    return low
