"""Baseline pickers for the comparison (pure: values in, a worker index out).

These are what kvroute is measured against, not policies of the router (``router.policy``).

Each baseline sees the cluster through a :class:`ClusterView` taken at the request's
arrival on the simulated timeline, and returns the index of the worker to use. Every
baseline is deterministic for its seed, so a rerun reproduces its choices exactly.

- ``random``: a uniformly random worker.
- ``round-robin``: workers in turn.
- ``least-loaded``: the least outstanding prefill work (uncached tokens still queued);
  exact ties by a seeded random choice.
- ``max-local-affinity``: the seed's first version — the largest KVCM local match, ties by
  address (the lowest ``ip:port`` string, a tie-break that sends every tie to one worker and
  hot-spots it); with no positive match, a random worker (domain fallback).
- ``max-hit``: knows every worker's cache exactly: the longest cached prefix, then the
  least outstanding work, then a seeded random choice. It maximises hits, not TTFT.

The request-aware baselines (the TTFT oracle, the SGLang router's cache-aware policy,
power-of-two choices) and the full line-up are in ``lineup``.

kvroute itself is not here: it routes through the real router (``runner.run_kvroute``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from router.types import HostMatch

KVROUTE = "kvroute"
RANDOM = "random"
ROUND_ROBIN = "round-robin"
LEAST_LOADED = "least-loaded"
MAX_LOCAL_AFFINITY = "max-local-affinity"
MAX_HIT = "max-hit"
BASELINE_NAMES = (RANDOM, ROUND_ROBIN, LEAST_LOADED, MAX_LOCAL_AFFINITY, MAX_HIT)
POLICY_NAMES = (KVROUTE, *BASELINE_NAMES)


class ClusterView(Protocol):
    """What a baseline may ask about the cluster at one instant."""

    @property
    def hosts(self) -> Sequence[str]:
        """Each worker's ``ip:http_port`` (its KVCM identity), by worker index."""
        ...

    def outstanding_tokens(self, worker: int) -> int:
        """Uncached prefill tokens the worker still has to compute."""
        ...

    def cached_blocks(self, worker: int, keys: Sequence[int]) -> int:
        """The worker's exact contiguous cached prefix of ``keys``, in blocks."""
        ...

    def kvcm_matches(self, keys: Sequence[int]) -> Sequence[HostMatch]:
        """KVCM's answer for ``keys`` (workers with a positive local match)."""
        ...


class BaselinePicker(Protocol):
    """A baseline picker: ``choose`` returns a worker index for a request's block keys."""

    @property
    def name(self) -> str: ...

    def choose(self, keys: Sequence[int], view: ClusterView) -> int: ...


class RandomBaseline:
    name = RANDOM

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, keys: Sequence[int], view: ClusterView) -> int:
        return self._rng.randrange(len(view.hosts))


class RoundRobinBaseline:
    name = ROUND_ROBIN

    def __init__(self) -> None:
        self._next = 0

    def choose(self, keys: Sequence[int], view: ClusterView) -> int:
        worker = self._next % len(view.hosts)
        self._next = worker + 1
        return worker


class LeastLoadedBaseline:
    name = LEAST_LOADED

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, keys: Sequence[int], view: ClusterView) -> int:
        loads = [view.outstanding_tokens(i) for i in range(len(view.hosts))]
        least = min(loads)
        return self._rng.choice([i for i, load in enumerate(loads) if load == least])


class MaxLocalAffinityBaseline:
    name = MAX_LOCAL_AFFINITY

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, keys: Sequence[int], view: ClusterView) -> int:
        index = {host: i for i, host in enumerate(view.hosts)}
        best: tuple[int, str] | None = None  # (-local, host): max local, then lowest address
        for match in view.kvcm_matches(keys):
            if match.local >= 1 and match.host_ip_port in index:
                candidate = (-match.local, match.host_ip_port)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return self._rng.randrange(len(view.hosts))
        return index[best[1]]


class MaxHitBaseline:
    name = MAX_HIT

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, keys: Sequence[int], view: ClusterView) -> int:
        n = len(view.hosts)
        cached = [view.cached_blocks(i, keys) for i in range(n)]
        most = max(cached)
        holders = [i for i in range(n) if cached[i] == most]
        loads = {i: view.outstanding_tokens(i) for i in holders}
        least = min(loads.values())
        return self._rng.choice([i for i in holders if loads[i] == least])


def baseline_pickers(seed: int) -> tuple[BaselinePicker, ...]:
    """One fresh instance of every baseline, in ``BASELINE_NAMES`` order."""
    return (
        RandomBaseline(seed),
        RoundRobinBaseline(),
        LeastLoadedBaseline(seed),
        MaxLocalAffinityBaseline(seed),
        MaxHitBaseline(seed),
    )
