"""Every policy the comparison runs, in table order, and the baselines that need the request.

kvroute (through the real router, its default policy), kvroute with the cost-aware policy
(``kvroute-cost-aware``), then the baselines: ``policies``' simple ones, ``power-of-two``
(two workers drawn at random, the one with less outstanding prefill work; ties to the first drawn),
the SGLang router's cache-aware policy (``sglang_baseline``) and the TTFT oracle (``oracle``), the
ceiling, last. ``run_lineup_baseline`` replays one of them (the oracle: its whole family, ``run_oracle``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from kvroute_sim.demo.baselines import (
    BASELINE_NAMES,
    KVROUTE,
    LEAST_LOADED,
    MAX_HIT,
    MAX_LOCAL_AFFINITY,
    RANDOM,
    ROUND_ROBIN,
    BaselinePicker,
    baseline_pickers,
)
from kvroute_sim.demo.oracle import ORACLE, TtftOracleBaseline, run_oracle
from kvroute_sim.demo.request_view import RequestBaselinePicker, RequestView
from kvroute_sim.demo.runner import ClusterSpec, PolicyRun, Progress, run_baseline
from kvroute_sim.demo.sglang_baseline import SGLANG_CACHE_AWARE, SglangCacheAwareBaseline
from kvroute_sim.demo.workload import Workload

POWER_OF_TWO = "power-of-two"
LINEUP_BASELINES = (*BASELINE_NAMES, POWER_OF_TWO, SGLANG_CACHE_AWARE, ORACLE)
# kvroute again with the cost-aware policy (the first row runs the default policy, cache-affinity).
KVROUTE_COST_AWARE = "kvroute-cost-aware"
COST_AWARE_SETTINGS: Mapping[str, object] = {"scorer_policy": "cost-aware"}
LINEUP = (KVROUTE, KVROUTE_COST_AWARE, *LINEUP_BASELINES)
# The baselines kvroute must beat (the oracle is a ceiling, max-hit a hit-rate bound).
PRACTICAL_BASELINES = (RANDOM, ROUND_ROBIN, LEAST_LOADED, POWER_OF_TWO, MAX_LOCAL_AFFINITY, SGLANG_CACHE_AWARE)
__all__ = [
    "COST_AWARE_SETTINGS",
    "KVROUTE",
    "KVROUTE_COST_AWARE",
    "LINEUP",
    "LINEUP_BASELINES",
    "MAX_HIT",
    "ORACLE",
    "POWER_OF_TWO",
    "PRACTICAL_BASELINES",
]


class PowerOfTwoBaseline:
    name = POWER_OF_TWO

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, keys: object, view: RequestView) -> int:
        n = len(view.hosts)
        if n == 1:
            return 0
        first, second = self._rng.sample(range(n), 2)
        return second if view.outstanding_tokens(second) < view.outstanding_tokens(first) else first


def lineup_baselines(seed: int, block_size: int) -> tuple[BaselinePicker | RequestBaselinePicker, ...]:
    """One fresh instance of every baseline, in ``LINEUP_BASELINES`` order."""
    return (
        *baseline_pickers(seed),
        PowerOfTwoBaseline(seed),
        SglangCacheAwareBaseline(block_size),
        TtftOracleBaseline(seed),
    )


def run_lineup_baseline(
    policy: BaselinePicker | RequestBaselinePicker,
    workload: Workload,
    cluster_spec: ClusterSpec,
    progress: Progress | None = None,
) -> PolicyRun:
    """Replay one baseline of ``lineup_baselines`` on a fresh cluster (synchronous, CPU only)."""
    if isinstance(policy, TtftOracleBaseline):
        return run_oracle(policy.seed, workload, cluster_spec, progress)
    return run_baseline(policy, workload, cluster_spec, progress)
