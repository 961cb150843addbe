"""Driving a router for a figure: its configuration over a simulated cluster, requests, timed loops.

Requests carry caller keys (a seeded prompt's block keys, so KVCM answers with matches)
and a fresh request id each. Every loop runs a fixed number of requests; callers bound the
whole figure with a trio deadline.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import trio

from kvroute_sim.sim.cluster import SimCluster, SimClusterAddresses
from kvroute_sim.sim.traffic import TrafficSpec, seed_prefixes
from kvroute_sim.sim.worker import WorkerSpec
from router.api import RouteDecision, RouteRequest, RouterHandle
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig, ProberConfig
from router.settings import with_value
from router.transport.memory_adapter import MemoryNetwork

WARM_TTL_S = 600.0  # "warm": a status probed once stays fresh for the whole figure
PRIME_TIMEOUT_S = 5.0
UNIQUE_KEY_TAG = 0x8000  # a unique tail key is (request serial << 16) | (this + position)


@dataclass(frozen=True, slots=True)
class ClusterView:
    """What a router needs to know of a simulated cluster, however it is served."""

    kvcm_bootstrap: str
    workers_arg: str
    block_size: int
    prompts: tuple[tuple[int, ...], ...]  # block keys of the seeded prompts
    # Router settings every figure's router gets on top of the defaults (``--router-setting``), parsed.
    router_settings: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True, slots=True)
class ClusterShape:
    """The simulated cluster every figure uses (in a child process, in memory or in process)."""

    workers: int = 8
    kvcm_replicas: int = 3
    block_size: int = 16
    prompt_tokens: int = 8192  # each seeded group's system prompt
    groups: int = 4
    holders_per_group: int = 2
    router_settings: tuple[tuple[str, object], ...] = ()  # passed on to every view (ClusterView)

    def build(self) -> SimCluster:
        spec = replace(WorkerSpec(), block_size=self.block_size)
        return SimCluster([spec] * self.workers, self.kvcm_replicas, block_size=self.block_size)

    def seed(self, cluster: SimCluster, addresses: SimClusterAddresses) -> ClusterView:
        """Store each group's prompt at its holders; the view requests are built from."""
        traffic = replace(
            TrafficSpec(),
            groups=self.groups,
            system_prompt_tokens=self.prompt_tokens,
            holders_per_group=self.holders_per_group,
        )
        seeded = seed_prefixes(cluster, traffic)
        return ClusterView(
            addresses.kvcm_bootstrap,
            addresses.workers_arg,
            self.block_size,
            tuple(p.block_keys for p in seeded),
            router_settings=self.router_settings,
        )

    def in_memory(self) -> tuple[SimCluster, MemoryNetwork, ClusterView]:
        """Served on a fresh MemoryNetwork (the router's ``rpc``), seeded."""
        cluster, network = self.build(), MemoryNetwork()
        view = self.seed(cluster, cluster.serve_memory(network))
        return cluster, network, view


def router_config(cluster: ClusterView, *, status_ttl_s: float | None) -> KvrouteConfig:
    """The default configuration pointed at ``cluster``; ``status_ttl_s`` overrides the status freshness."""
    prober = ProberConfig()
    if status_ttl_s is not None:
        prober = replace(prober, fresh_ttl_s=status_ttl_s, max_status_age_s=max(status_ttl_s, prober.max_status_age_s))
    config = KvrouteConfig(
        deployment=replace(DeploymentConfig(), block_size=cluster.block_size),
        discovery=replace(DiscoveryConfig(), kvcm_bootstrap=cluster.kvcm_bootstrap, workers=cluster.workers_arg),
        prober=prober,
    )
    for name, value in cluster.router_settings:
        config = with_value(config, name, value)
    return config


class Requests:
    """Route requests over the seeded prompts in turn, each with a new request id.

    ``unique_tail``: append that many keys no other request has (a fresh question after the
    shared prompt), so per-prompt state — the shadow index — keeps meeting new entries.
    """

    def __init__(self, cluster: ClusterView, label: str, unique_tail: int = 0) -> None:
        self._prompts = cluster.prompts
        self._block_size = cluster.block_size
        self._label = label
        self._tail = unique_tail
        self._serial = itertools.count()

    def next(self) -> RouteRequest:
        n = next(self._serial)
        keys = self._prompts[n % len(self._prompts)]
        if self._tail:
            keys += tuple((n << 16) | (UNIQUE_KEY_TAG + i) for i in range(self._tail))
        return RouteRequest(request_id=f"{self._label}-{n}", block_cache_keys=keys, block_size=self._block_size)


@dataclass(slots=True)
class Outcomes:
    """Route sources and reasons of the decisions a loop received."""

    counts: Counter[str]

    @classmethod
    def empty(cls) -> Outcomes:
        return cls(Counter())

    def add(self, decision: RouteDecision) -> None:
        self.counts[f"{decision.route_source.value}/{decision.reason.value}"] += 1

    def merge(self, other: Outcomes) -> None:
        self.counts.update(other.counts)

    def fraction_from(self, source: str) -> float:
        total = sum(self.counts.values())
        return sum(n for key, n in self.counts.items() if key.startswith(source + "/")) / total if total else 0.0

    def to_json(self) -> dict[str, int]:
        return dict(self.counts.most_common())


async def prime(router: RouterHandle, requests: Requests, warm_up: int) -> None:
    """Probe every known worker once and route ``warm_up`` requests (leader, channels, caches)."""
    workers = router.discovery().workers().workers
    await router.prober().probe(workers, trio.current_time() + PRIME_TIMEOUT_S).wait_all()
    for _ in range(warm_up):
        await router.route(requests.next())


async def sequential(router: RouterHandle, requests: Requests, count: int) -> tuple[list[float], Outcomes]:
    """``count`` routes one after another: wall-clock ms each."""
    latencies: list[float] = []
    outcomes = Outcomes.empty()
    for _ in range(count):
        request = requests.next()
        start = time.perf_counter()
        decision = await router.route(request)
        latencies.append((time.perf_counter() - start) * 1e3)
        outcomes.add(decision)
    return latencies, outcomes


async def concurrent(router: RouterHandle, requests: Requests, count: int, concurrency: int) -> tuple[float, Outcomes]:
    """``count`` routes from ``concurrency`` tasks: elapsed wall seconds."""
    outcomes = Outcomes.empty()

    async def client(share: int) -> None:
        for _ in range(share):
            outcomes.add(await router.route(requests.next()))

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for share in split_evenly(count, concurrency):
            nursery.start_soon(client, share)
    return time.perf_counter() - start, outcomes


def split_evenly(total: int, parts: int) -> Sequence[int]:
    """``total`` as ``parts`` shares differing by at most one."""
    share, extra = divmod(total, parts)
    return [share + (1 if i < extra else 0) for i in range(parts)]
