"""The domain fallback keeps to the deployment's roles on mixed fleets, and labels a worker with the role it
reported (hypothesis over fleets; MockClock with in-memory workers, every actor real)."""

from __future__ import annotations

from collections.abc import Collection

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.sources.domain import _KNOWN_SCAN, _REDRAWS
from actors.worker_prober import WorkerProber
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.worker import WorkerSpec
from router.api import open_router
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig, ProberConfig, RouterConfig
from router.transport.memory_adapter import MemoryNetwork
from router.types import Role, RouteRequest, RouteSource, WorkerAddr

BLOCK = 16
ROLES = {Role.PREFILL: "RoleType.PREFILL", Role.PDFUSION: "RoleType.PDFUSION", Role.DECODE: "RoleType.DECODE"}


def _route_all(
    fleet: list[Role], deployment: tuple[Role, ...], seed: int, *, route_blind: bool = False, unreachable: int = 0
) -> list[tuple[Role | None, Role | None]]:
    """(reported role of the chosen worker, label in the answer) for domain answers after start-up; the
    first ``unreachable`` workers stop answering probes once they have reported their role."""
    cluster = SimCluster(
        workers=[WorkerSpec(role=ROLES[r], block_size=BLOCK) for r in fleet], kvcm_replicas=1, block_size=BLOCK
    )
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    reported = {cluster.worker_addr(i): fleet[i] for i in range(len(fleet))}
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK, roles=deployment),
        router=RouterConfig(kvcm_fallback=False, route_blind=route_blind),
        discovery=DiscoveryConfig(workers=addrs.workers_arg),
        prober=ProberConfig(health_interval_s=0.5),
    )
    out: list[tuple[Role | None, Role | None]] = []

    async def main() -> None:
        async with open_router(config, rpc=network) as handle:
            await trio.sleep(2.0)  # background health probes have heard from every worker
            for i in range(unreachable):
                network.stop(cluster.worker_addr(i).status_target)
            if unreachable:
                await trio.sleep(2.0)
                assert not any(handle.prober().is_routable(cluster.worker_addr(i)) for i in range(unreachable))
            for i in range(12):
                d = await handle.route(RouteRequest(f"r{seed}-{i}", token_ids=tuple(range(64)), budget_ms=20))
                assert d.route_source in (RouteSource.DOMAIN, RouteSource.NONE)
                out.append((None if d.worker is None else reported[d.worker], d.role))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return out


@settings(max_examples=12, deadline=None)
@given(
    fleet=st.lists(st.sampled_from([Role.PREFILL, Role.PDFUSION, Role.DECODE]), min_size=1, max_size=8),
    deployment=st.sampled_from([(Role.PDFUSION,), (Role.PREFILL,), (Role.PREFILL, Role.DECODE)]),
    seed=st.integers(0, 1000),
)
def test_domain_answers_never_name_a_foreign_role(fleet: list[Role], deployment: tuple[Role, ...], seed: int) -> None:
    prefill_roles = {r for r in deployment if r in (Role.PREFILL, Role.PDFUSION)}
    for reported, label in _route_all(fleet, deployment, seed):
        if reported is None:  # no worker of the deployment's prefill roles in the fleet: no answer
            assert not prefill_roles & set(fleet)
            continue
        assert reported in prefill_roles  # never a foreign role (a decode worker is no prefill pick)
        assert label is reported  # labelled with the role it reported


@settings(max_examples=12, deadline=None)
@given(
    fleet=st.lists(st.sampled_from([Role.PREFILL, Role.PDFUSION, Role.DECODE]), min_size=1, max_size=8),
    deployment=st.sampled_from([(Role.PDFUSION,), (Role.PREFILL,), (Role.PREFILL, Role.DECODE)]),
    seed=st.integers(0, 1000),
    unreachable=st.integers(0, 8),
)
def test_route_blind_ignores_reachability_not_the_role(
    fleet: list[Role], deployment: tuple[Role, ...], seed: int, unreachable: int
) -> None:
    """--route-blind drew uniformly from the whole fleet and labelled the worker with the request's
    first role: a decode worker was answered as PREFILL while a prefill worker was there. It skips only
    what the prober knows of reachability: a worker of another role is drawn only when none may serve
    the request, and every worker is labelled with the role it reported."""
    prefill_roles = {r for r in deployment if r in (Role.PREFILL, Role.PDFUSION)}
    answers = _route_all(fleet, deployment, seed, route_blind=True, unreachable=min(unreachable, len(fleet)))
    for reported, label in answers:
        assert reported is not None  # blind: always a worker
        if prefill_roles & set(fleet):
            assert reported in prefill_roles, (fleet, deployment, reported)
        assert label is reported


def test_route_blind_routes_to_an_unreachable_worker_of_the_role_not_to_a_live_one_of_another() -> None:
    fleet = [Role.PREFILL, Role.DECODE, Role.DECODE]
    answers = _route_all(fleet, (Role.PREFILL, Role.DECODE), 0, route_blind=True, unreachable=1)
    assert answers == [(Role.PREFILL, Role.PREFILL)] * 12


def _domain_only(cluster: SimCluster, network: MemoryNetwork) -> KvrouteConfig:
    """A router over ``cluster`` served on ``network`` with the KVCM fallback off and no health probes:
    the prober holds only the statuses a test asks for."""
    addrs = cluster.serve_memory(network)
    return KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        router=RouterConfig(kvcm_fallback=False),
        discovery=DiscoveryConfig(workers=addrs.workers_arg),
        prober=ProberConfig(health_interval_s=0.0),
    )


async def test_a_pick_looks_at_a_bounded_number_of_workers_when_statuses_are_stale(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large fleet whose statuses the prober does not hold (no health probes): each domain pick takes
    a routable worker of unknown role after a bounded look, not a walk of the whole fleet."""
    workers = 400
    cluster = SimCluster(workers=workers, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    config = _domain_only(cluster, network)
    looked: list[int] = []
    real = WorkerProber.is_routable

    def counted(self: WorkerProber, worker: WorkerAddr, roles: Collection[Role] | None = None) -> bool:
        looked.append(1)
        return real(self, worker, roles)

    async with open_router(config, rpc=network) as handle:
        monkeypatch.setattr(WorkerProber, "is_routable", counted)
        for i in range(10):
            looked.clear()
            d = await handle.route(RouteRequest(f"r{i}", token_ids=tuple(range(64)), budget_ms=20))
            assert d.route_source is RouteSource.DOMAIN and d.worker is not None
            assert 0 < len(looked) <= _REDRAWS + 1 + _KNOWN_SCAN  # the draws, then the bounded look


async def test_a_pick_prefers_workers_known_to_serve_the_role_over_never_probed_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two of eight workers have reported their role (prefill), the others were never probed: every
    domain pick is one of the two, whose answer is labelled with a role they said they serve."""
    cluster = SimCluster(workers=8, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    config = _domain_only(cluster, network)
    known = {cluster.worker_addr(0), cluster.worker_addr(1)}
    async with open_router(config, rpc=network) as handle:
        await handle.prober().probe(list(known), trio.current_time() + 0.05).wait_all()
        for i in range(30):
            d = await handle.route(RouteRequest(f"r{i}", token_ids=tuple(range(64)), budget_ms=20))
            assert d.route_source is RouteSource.DOMAIN and d.worker in known and d.role is Role.PREFILL, d
