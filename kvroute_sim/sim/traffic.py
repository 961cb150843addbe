"""Background activity for a standalone SimCluster: seeded cached prefixes and optional traffic.

Prompts are reproducible: group g's shared system prompt is the token ids
``g * 1_000_000 + i`` for i in 0..system_prompt_tokens-1, so a client can rebuild it
(``kvroute route --tokens ...``) and get matches; its block keys in the chosen family
are printed by ``kvroute sim-cluster --print-json``.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.worker import SimWorkerOverloaded
from router.config import DeploymentConfig
from router.keys import block_keys
from router.types import KeyFamily

_GROUP_STRIDE = 1_000_000
_QUESTION_BASE = 900_000  # question tokens sit in each group's id range, after the system prompt
MAX_SYSTEM_PROMPT_TOKENS = _QUESTION_BASE  # a system prompt ends before its group's question ids


@dataclass(frozen=True, slots=True)
class TrafficSpec:
    groups: int = 4
    system_prompt_tokens: int = 1024
    question_tokens: int = 128
    holders_per_group: int = 2  # workers seeded with each group's system prompt
    rate_per_s: float = 0.0  # background requests per second (Poisson); 0 = seed only
    affinity: float = 0.8  # probability a request goes to the worker with the longest cached prefix
    key_family: KeyFamily = DeploymentConfig().key_family
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in (("groups", self.groups), ("system_prompt_tokens", self.system_prompt_tokens)):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.system_prompt_tokens > MAX_SYSTEM_PROMPT_TOKENS:
            raise ValueError(
                f"system_prompt_tokens: must be <= {MAX_SYSTEM_PROMPT_TOKENS}, got {self.system_prompt_tokens}"
            )
        if self.question_tokens < 0 or self.holders_per_group < 1:
            raise ValueError("question_tokens must be >= 0 and holders_per_group >= 1")
        if not self.rate_per_s >= 0:
            raise ValueError(f"rate_per_s: must be >= 0, got {self.rate_per_s}")
        if not 0 <= self.affinity <= 1:
            raise ValueError(f"affinity: must be in 0..1, got {self.affinity}")


@dataclass(frozen=True, slots=True)
class SeededPrefix:
    group: int
    tokens: int  # the system prompt is token ids group * 1_000_000 + 0..tokens-1
    block_keys: tuple[int, ...]
    workers: tuple[str, ...]  # ip:http_port of the workers holding it

    def to_json(self) -> dict[str, object]:
        return {
            "group": self.group,
            "first_token": self.group * _GROUP_STRIDE,
            "tokens": self.tokens,
            "block_keys": list(self.block_keys),
            "workers": list(self.workers),
        }


def system_prompt(group: int, tokens: int) -> list[int]:
    return list(range(group * _GROUP_STRIDE, group * _GROUP_STRIDE + tokens))


def seed_prefixes(cluster: SimCluster, spec: TrafficSpec) -> tuple[SeededPrefix, ...]:
    """Store each group's system prompt at ``holders_per_group`` workers (seeded choice)."""
    rng = random.Random(spec.seed)
    n_workers = len(cluster.workers)
    seeded = []
    for group in range(spec.groups):
        keys = block_keys(
            system_prompt(group, spec.system_prompt_tokens), cluster.block_size, spec.key_family
        )
        holders = rng.sample(range(n_workers), min(spec.holders_per_group, n_workers))
        hosts = tuple(cluster.worker_addr(i).http_target for i in sorted(holders))
        for host in hosts:
            cluster.kvcm.record_prefill(host, keys)
        seeded.append(SeededPrefix(group, spec.system_prompt_tokens, keys, hosts))
    return tuple(seeded)


def _pick_worker(cluster: SimCluster, keys: Sequence[int], affinity: float, rng: random.Random) -> int:
    n = len(cluster.workers)
    if rng.random() >= affinity:
        return rng.randrange(n)
    hits = [cluster.kvcm.local_prefix(cluster.worker_addr(i).http_target, keys) for i in range(n)]
    best = max(hits)
    return rng.choice([i for i, hit in enumerate(hits) if hit == best])


@dataclass(slots=True)
class TrafficStats:
    sent: int = 0
    rejected: int = 0  # the chosen worker's queue was full (SimWorkerOverloaded)


async def run_traffic(cluster: SimCluster, spec: TrafficSpec, stats: TrafficStats | None = None) -> None:
    """Poisson arrivals of group prompts (system prompt + a fresh question) until cancelled.

    Each request goes to the longest-prefix worker with probability ``affinity``, else to a
    random one; its prefill is simulated on the trio clock (``cluster.run_prefill``).
    """
    if spec.rate_per_s <= 0:
        return
    counts = TrafficStats() if stats is None else stats
    rng = random.Random(spec.seed + 1)
    for serial in itertools.count():  # a service loop: runs until its caller cancels it
        await trio.sleep(rng.expovariate(spec.rate_per_s))
        group = rng.randrange(spec.groups)
        question_start = group * _GROUP_STRIDE + _QUESTION_BASE + rng.randrange(50_000)
        tokens = system_prompt(group, spec.system_prompt_tokens) + list(
            range(question_start, question_start + spec.question_tokens)
        )
        keys = block_keys(tokens, cluster.block_size, spec.key_family)
        worker = _pick_worker(cluster, keys, spec.affinity, rng)
        try:
            cluster.run_prefill(worker, f"traffic-{serial}", keys, len(tokens), trio.current_time())
        except SimWorkerOverloaded:
            counts.rejected += 1
        else:
            counts.sent += 1
