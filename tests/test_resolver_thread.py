"""No name is resolved on the event loop's thread.

A blocking ``getaddrinfo`` on the trio thread would stall every request in flight for as long as the
resolver takes (seconds, for a DNS server that does not answer). Real loopback servers and the real
clock: KVCM, the scheduler and the workers are all named ``localhost:<port>``, so every lookup of
them is a real one, and a spy on ``socket.getaddrinfo`` notes the thread each ran on: the lookups
Python makes (the scheduler's discovery and calls over HTTP, discovery's DNS sources). gRPC's C core
resolves the names its channels use (KVCM, the workers, the scheduler over gRPC) on threads of its
own, which the spy does not see. trio first tries a name as a numeric address on the calling thread
(``AI_NUMERICHOST``, which never blocks); those tries are not lookups.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, NamedTuple

import pytest
import trio

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.cluster_master import cluster_decide
from kvroute_sim.sim.master import SimMaster, SimMasterAddresses
from router.api import open_router
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig, MasterConfig, MasterProtocol, RouterConfig
from router.types import RouteRequest, RouteSource

BLOCK = 16
BUDGET_MS = 5000  # generous: this test is about where lookups run, not their speed


class Lookup(NamedTuple):
    thread: int
    host: str


def _named(targets: str) -> str:
    """A comma-separated target list with each loopback address spelled ``localhost``."""
    return ",".join(t.replace("127.0.0.1", "localhost") for t in targets.split(","))


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[Lookup]:
    """Every real (not numeric-only) ``getaddrinfo`` from now on, with its thread."""
    seen: list[Lookup] = []
    resolve = socket.getaddrinfo

    def spy(host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0) -> Any:
        if not flags & socket.AI_NUMERICHOST:
            name = host.decode() if isinstance(host, bytes) else str(host)  # trio passes it IDNA-encoded
            seen.append(Lookup(threading.get_ident(), name))
        return resolve(host, port, family, type, proto, flags)

    monkeypatch.setattr(socket, "getaddrinfo", spy)
    return seen


@pytest.mark.parametrize("protocol", [MasterProtocol.HTTP, MasterProtocol.GRPC], ids=["http", "grpc"])
async def test_names_are_resolved_off_the_event_loop(
    protocol: MasterProtocol, lookups: list[Lookup], nursery: trio.Nursery
) -> None:
    loop_thread = threading.get_ident()
    with trio.fail_after(30):
        cluster = SimCluster(workers=2, kvcm_replicas=2, block_size=BLOCK)
        addrs = await nursery.start(cluster.serve_grpc)
        sim_master = SimMaster(replicas=2, decide=cluster_decide(cluster, trio.lowlevel.current_clock().current_time))
        masters: SimMasterAddresses = await nursery.start(sim_master.run)
        config = KvrouteConfig(
            deployment=DeploymentConfig(block_size=BLOCK, kvcm_instance_id="test"),
            discovery=DiscoveryConfig(kvcm_bootstrap=_named(addrs.kvcm_bootstrap), workers=_named(addrs.workers_arg)),
            router=RouterConfig(budget_cap_ms=float(BUDGET_MS)),
            master=MasterConfig(
                hosts=_named(",".join(masters.hosts)),
                protocol=protocol,
                transport_timeout_ms=float(BUDGET_MS) / 2,
                discovery_timeout_s=5.0,
            ),
        )
        async with open_router(config) as handle:
            for i in range(3):
                request = RouteRequest(f"r{i}", token_ids=tuple(range(8 * BLOCK)), budget_ms=BUDGET_MS)
                decision = await handle.route(request)
                assert decision.route_source is RouteSource.MASTER, decision
    # The names were looked up (the spy saw them: this test can fail), and never on the loop's thread.
    assert any(lookup.host == "localhost" for lookup in lookups)
    assert [lookup for lookup in lookups if lookup.thread == loop_thread] == []
