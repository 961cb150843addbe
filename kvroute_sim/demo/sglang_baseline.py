"""The SGLang router's cache-aware policy (v0.3.2, as observed), re-created as a baseline.

It is what a user would otherwise deploy, so the comparison replays it on the same arrivals:

- it keeps one approximate radix tree of the prompts it routed, each node tagged with the
  workers ("tenants") it sent that prefix to; it never learns what a worker really cached or
  evicted (the tree's size bound, 2^26 characters per tenant by default, is far above any run
  here, so nothing is evicted);
- it counts requests in flight per worker (routed, not finished);
- if ``max_load - min_load > balance_abs_threshold`` and ``max_load > balance_rel_threshold *
  min_load``, the request goes to the least loaded worker; otherwise, if the prompt's best
  prefix match in the tree is above ``cache_threshold`` of its length, to that match's worker;
  otherwise to the worker whose part of the tree is smallest (the fewest units routed to it, its
  "smallest tenant": the most cache room, as the router sees it). Ties of either kind go to the
  first registered worker (the router takes whichever its map yields). Either way the prompt is
  inserted into the tree for the chosen worker.

The router matches prompt characters. Here a prompt is its token ids (one unit per token) when
the workload has them, or its block keys when only those are known (a replayed trace: sharing
is only defined per block there, so a block-level match is what a character match would find,
give or take the last partial block). The match fraction is matched tokens / prompt tokens.
Among the workers holding the deepest matched node, the most recently chosen one wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute_sim.demo.request_view import RequestView

SGLANG_CACHE_AWARE = "sglang-cache-aware"
DEFAULT_CACHE_THRESHOLD = 0.3
DEFAULT_BALANCE_ABS_THRESHOLD = 64
DEFAULT_BALANCE_REL_THRESHOLD = 1.5


@dataclass(slots=True)
class _Node:
    edge: tuple[int, ...]
    children: dict[int, _Node] = field(default_factory=dict)
    tenants: dict[int, int] = field(default_factory=dict)  # worker -> last time it was chosen (a counter)


def _common(edge: tuple[int, ...], units: Sequence[int], at: int) -> int:
    n = min(len(edge), len(units) - at)
    if tuple(units[at : at + n]) == edge[:n]:
        return n
    i = 0
    while i < n and edge[i] == units[at + i]:
        i += 1
    return i


class ApproxRadixTree:
    """Prefixes routed per worker (pure, single-threaded): insert after routing, match before."""

    def __init__(self) -> None:
        self._root = _Node(())
        self._clock = 0
        self._units: dict[int, int] = {}  # worker -> units of the nodes it is a tenant of

    def units(self, worker: int) -> int:
        """The units of the tree's nodes ``worker`` is a tenant of (a split keeps the sum)."""
        return self._units.get(worker, 0)

    def smallest(self, workers: int) -> int:
        """Of workers ``0..workers-1``, the one with the fewest units (ties: the lowest index)."""
        return min(range(workers), key=self.units)

    def match(self, units: Sequence[int]) -> tuple[int, int | None]:
        """(units matched, the worker of the deepest matched node or None)."""
        node, at, worker = self._root, 0, None
        while at < len(units):
            child = node.children.get(units[at])
            if child is None:
                break
            common = _common(child.edge, units, at)
            at += common
            if child.tenants:
                worker = max(child.tenants.items(), key=lambda item: item[1])[0]
            if common < len(child.edge):
                break
            node = child
        return at, worker

    def insert(self, units: Sequence[int], worker: int) -> None:
        self._clock += 1
        node, at = self._root, 0
        while at < len(units):
            child = node.children.get(units[at])
            if child is None:
                leaf = _Node(tuple(units[at:]), tenants={worker: self._clock})
                node.children[units[at]] = leaf
                self._units[worker] = self.units(worker) + len(leaf.edge)
                return
            common = _common(child.edge, units, at)
            if common < len(child.edge):  # split the edge: the shared part keeps every tenant
                head = _Node(child.edge[:common], tenants=dict(child.tenants))
                child.edge = child.edge[common:]
                head.children[child.edge[0]] = child
                node.children[units[at]] = head
                child = head
            if worker not in child.tenants:
                self._units[worker] = self.units(worker) + len(child.edge)
            child.tenants[worker] = self._clock
            at += common
            node = child


class SglangCacheAwareBaseline:
    name = SGLANG_CACHE_AWARE

    def __init__(
        self,
        block_size: int,
        *,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
    ) -> None:
        self._block_size = block_size
        self._cache_threshold = cache_threshold
        self._abs = balance_abs_threshold
        self._rel = balance_rel_threshold
        self._tree = ApproxRadixTree()

    def choose(self, keys: object, view: RequestView) -> int:
        request = view.request
        loads = [view.requests_in_flight(i) for i in range(len(view.hosts))]
        least = loads.index(min(loads))  # ties: the first registered
        most = max(loads)
        units: Sequence[int] = request.tokens or request.keys
        chosen = least
        if not (most - loads[least] > self._abs and most > self._rel * loads[least]):
            matched, worker = self._tree.match(units)
            per_unit = 1 if request.tokens else self._block_size
            if worker is not None and min(matched * per_unit, request.input_tokens) > (
                self._cache_threshold * request.input_tokens
            ):
                chosen = worker
            else:
                chosen = self._tree.smallest(len(loads))
        self._tree.insert(units, chosen)
        return chosen
