"""The TTFT oracle: a greedy, exact ceiling for a per-request router (a baseline, not a router policy).

At each request's arrival it asks the simulator what the request's TTFT would be on every
worker, from that worker's exact cache and queue at that instant (``RequestView.ttft_if_routed``),
and picks the minimum. Ties (equal to the nanosecond) go to the longest cached prefix, then the
least outstanding work, then a seeded random choice. It is greedy: it does not weigh what its
choice does to later requests (the cache it evicts, the queue it builds), so another policy can
beat it on a run only by luck of that kind, by about the noise of the run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvroute_sim.demo.request_view import RequestView

ORACLE = "oracle"
_TIE_S = 1e-9


class TtftOracleBaseline:
    name = ORACLE

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, keys: object, view: RequestView) -> int:
        n = len(view.hosts)
        ttfts = [view.ttft_if_routed(i) for i in range(n)]
        best = min(ttfts)
        tied = [i for i in range(n) if ttfts[i] - best <= _TIE_S]
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
