"""The policy a configuration names (``scorer.policy``): one place that maps the setting to a class."""

from __future__ import annotations

import random

from router.config import DeploymentConfig, ScorerConfig
from router.policy.base import Policy
from router.policy.cache_affinity import CacheAffinityFirst
from router.policy.cost_aware import CostAware
from router.policy.ledger import SelectionLedger
from router.types import ScorerPolicy


def make_policy(
    config: ScorerConfig,
    deployment: DeploymentConfig,
    *,
    tie_rng: random.Random | None = None,
    ledger: SelectionLedger | None = None,
) -> Policy:
    """A fresh instance of the configured policy (a replay hands in the recorded ledger and tie draws)."""
    if config.policy is ScorerPolicy.COST_AWARE:
        return CostAware(config, deployment, tie_rng=tie_rng, ledger=ledger)
    return CacheAffinityFirst(config, deployment, tie_rng=tie_rng, ledger=ledger)
