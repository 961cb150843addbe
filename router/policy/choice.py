"""The policy a configuration names (``scorer.policy``): one place that maps the setting to a class."""

from __future__ import annotations

import random

from router.config import DeploymentConfig, KvrouteConfig, ScorerConfig
from router.policy.base import Policy
from router.policy.cache_affinity import CacheAffinityFirst
from router.policy.cost_aware import CostAware
from router.policy.ledger import SelectionLedger
from router.types import ScorerPolicy


def make_policy(
    config: ScorerConfig,
    deployment: DeploymentConfig,
    *,
    status_horizon_s: float,
    tie_rng: random.Random | None = None,
    ledger: SelectionLedger | None = None,
) -> Policy:
    """A fresh instance of the configured policy (a replay hands in the recorded ledger and tie draws);
    ``status_horizon_s``: :func:`status_horizon_s`."""
    if config.policy is ScorerPolicy.COST_AWARE:
        return CostAware(config, deployment, status_horizon_s=status_horizon_s, tie_rng=tie_rng, ledger=ledger)
    return CacheAffinityFirst(config, deployment, status_horizon_s=status_horizon_s, tie_rng=tie_rng, ledger=ledger)


def status_horizon_s(config: KvrouteConfig) -> float:
    """How much older than a worker's newest status one it is scored with can be, in seconds: a request
    reads a status younger than ``prober.max_status_age_s`` and is decided within its budget (at most
    ``router.budget_cap_ms``). The ledger keeps the charges made that long before a status
    (:class:`SelectionLedger`)."""
    return config.prober.max_status_age_s + config.router.budget_cap_ms / 1000.0
