"""The master source at the head of the chain, under MockClock with in-memory schedulers, KVCM and workers.

Only the remote peers are simulated (SimMaster on a MemoryMasterNetwork, SimCluster on a MemoryNetwork);
discovery, the breaker, the chain and every other actor are real.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import pytest
import trio
import trio.testing

from actors.breaker import ANSWERED_WINDOW, Admission, BreakerState
from actors.sources.master import MasterClientHealth, MasterSource, _AskTrial, _Attempted, _Verdict
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.master import MasterFaults, SimMaster
from router.api import open_router
from router.config import (
    BreakerConfig,
    DeploymentConfig,
    DiscoveryConfig,
    KvrouteConfig,
    MasterConfig,
    MasterProtocol,
    RouterConfig,
)
from router.keys import block_keys
from router.problems import ConfigError
from router.supervisor import RouterHandle
from router.transport.master_memory import MemoryMasterNetwork
from router.transport.memory_adapter import MemoryNetwork
from router.types import KeyFamily, Reason, Role, RoleAddr, RouteDecision, RouteRequest, RouteSource, SourceOutcome
from router.wire import paths
from router.wire.master import CODE_FALLBACK, MasterScheduleRequest, error_json, info_json

BLOCK = 16
PROMPT = tuple(range(1000, 1000 + 8 * BLOCK))
KEYS = block_keys(PROMPT, BLOCK, KeyFamily.RTP)


@dataclass
class Rig:
    handle: RouterHandle
    cluster: SimCluster
    master: SimMaster
    network: MemoryNetwork
    masters: MemoryMasterNetwork

    def kvcm_queries(self) -> int:
        return self.network.call_count(method_path=paths.KVCM_GET_HOST_CACHE_STATE)

    def schedules_seen(self) -> list[MasterScheduleRequest]:
        """Have the scheduler name worker 1 (PREFILL) for every request; the requests it gets, as it gets them."""
        seen: list[MasterScheduleRequest] = []
        prefill = self.cluster.worker_addr(1)

        def decide(request: MasterScheduleRequest) -> list[RoleAddr]:
            seen.append(request)
            return [RoleAddr(Role.PREFILL, prefill.ip, prefill.http_port, prefill.grpc_port)]

        self.master.set_decide(decide)
        return seen

    async def route(self, rid: str, budget_ms: float = 50) -> RouteDecision:
        return await self.handle.route(RouteRequest(rid, token_ids=PROMPT, budget_ms=budget_ms))

    async def timed_route(self, rid: str, budget_ms: float = 50) -> tuple[float, RouteDecision]:
        """(the trio seconds the route took, its decision)."""
        start = trio.current_time()
        decision = await self.route(rid, budget_ms)
        return trio.current_time() - start, decision


@asynccontextmanager
async def rig(
    *,
    kvcm_fallback: bool = True,
    replicas: int = 2,
    max_in_flight: int = 256,
    roles: tuple[Role, ...] = (Role.PREFILL,),
    **master_kw: object,
) -> AsyncIterator[Rig]:
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
    decode = RoleAddr(Role.DECODE, "10.9.9.9", 9000, 9001)
    prefill = cluster.worker_addr(1)
    master = SimMaster(
        [RoleAddr(Role.PREFILL, prefill.ip, prefill.http_port, prefill.grpc_port), decode], replicas=replicas
    )
    masters = MemoryMasterNetwork()
    hosts = master.serve_memory(masters)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK, roles=roles),
        router=RouterConfig(kvcm_fallback=kvcm_fallback, max_in_flight=max_in_flight),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
        master=replace(MasterConfig(hosts=",".join(hosts.hosts)), **master_kw),  # type: ignore[arg-type]
        master_breaker=replace(BreakerConfig(), failure_threshold=3, cooldown_s=1.0),
    )
    async with open_router(config, rpc=network, master=masters) as handle:
        resolver = handle.leader_resolver()
        if resolver is not None:
            with trio.move_on_after(1):
                await resolver.leader()
        yield Rig(handle, cluster, master, network, masters)


async def test_a_routed_answer_is_the_masters_and_kvcm_is_not_asked(autojump_clock: trio.testing.MockClock) -> None:
    async with rig() as r:
        before = r.kvcm_queries()
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.MASTER and decision.reason is Reason.MASTER
        assert decision.worker == r.cluster.worker_addr(1) and decision.role is Role.PREFILL
        by_role = {a.role: a for a in decision.role_addrs}  # as the master gave them, in its order
        assert set(by_role) == {Role.PREFILL, Role.DECODE} and by_role[Role.DECODE].ip == "10.9.9.9"
        assert [(s.source, s.outcome) for s in decision.sources] == [(RouteSource.MASTER, SourceOutcome.ANSWERED)]
        assert r.kvcm_queries() == before


async def test_8600_routes_by_domain_without_asking_kvcm(autojump_clock: trio.testing.MockClock) -> None:
    async with rig() as r:
        r.master.set_faults(0, MasterFaults(fallback=True))
        before = r.kvcm_queries()
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.DOMAIN and decision.reason is Reason.MASTER_FALLBACK
        assert [s.outcome for s in decision.sources] == [
            SourceOutcome.FELL_THROUGH,
            SourceOutcome.SKIPPED,
            SourceOutcome.SKIPPED,
            SourceOutcome.ANSWERED,
        ]
        assert r.kvcm_queries() == before


async def test_a_business_error_ends_the_request_with_its_code(autojump_clock: trio.testing.MockClock) -> None:
    async with rig() as r:
        r.master.set_faults(0, MasterFaults(business_error=8402))
        before = r.kvcm_queries()
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.worker is None and decision.route_source is RouteSource.NONE
        assert (decision.reason, decision.error_code) == (Reason.MASTER_ERROR, 8402)
        assert decision.error is not None and "8402" in decision.error
        assert r.kvcm_queries() == before


async def test_8600_inside_a_200_is_a_business_error_not_a_fallback(autojump_clock: trio.testing.MockClock) -> None:
    """The reference frontend falls back only on an 8600 in a non-200 reply; inside a 200 it fails the
    request with the code, and no cache source is asked."""
    async with rig(replicas=1) as r:
        host = r.master.addresses().elected

        async def fallback_in_200(path: str, body: bytes) -> tuple[int, bytes]:
            if path == paths.MASTER_HTTP_INFO:
                return 200, info_json(host, 0, host.rpartition(":")[0])
            return 200, error_json(CODE_FALLBACK, "x")

        r.masters.serve(host, fallback_in_200)
        before = r.kvcm_queries()
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.worker is None and decision.route_source is RouteSource.NONE
        assert (decision.reason, decision.error_code) == (Reason.MASTER_ERROR, CODE_FALLBACK)
        assert [(s.source, s.outcome) for s in decision.sources] == [(RouteSource.MASTER, SourceOutcome.ENDED)]
        assert r.kvcm_queries() == before


async def test_a_refused_master_tries_the_slave_in_the_same_window(autojump_clock: trio.testing.MockClock) -> None:
    async with rig() as r:
        r.masters.stop(r.master.addresses().elected)  # refuses: the slave answers
        took, decision = await r.timed_route("r1")
        assert decision.route_source is RouteSource.MASTER
        assert r.masters.call_count(r.master.addresses().hosts[1], paths.MASTER_HTTP_SCHEDULE) == 1
        assert took < 0.001


async def test_refused_master_and_slave_fall_to_kvcm_at_once(autojump_clock: trio.testing.MockClock) -> None:
    async with rig() as r:
        for host in r.master.addresses().hosts:
            r.masters.stop(host)
        took, decision = await r.timed_route("r1")
        assert decision.route_source is RouteSource.KVCM and decision.worker == r.cluster.worker_addr(2)
        assert decision.sources[0].reason is Reason.MASTER_UNAVAILABLE
        assert took < 0.005


async def test_a_hanging_master_costs_its_window_until_the_breaker_opens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(replicas=1, transport_timeout_ms=10) as r:
        r.master.set_faults(0, MasterFaults(hang=True))
        waits = []
        for i in range(6):
            took, decision = await r.timed_route(f"h{i}")
            waits.append(took)
            assert decision.route_source is RouteSource.KVCM  # the KVCM path kept its time
            assert took <= 0.050
        assert all(w == pytest.approx(0.010) for w in waits[:3])  # the threshold's worth of requests pay the window
        assert all(w < 0.002 for w in waits[3:])  # then nothing: the breaker is open
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        assert health.breaker.state.value == "open"
        assert health.breaker.rejected_total == 3  # turned away by the published view: counted too


@pytest.mark.parametrize("early_ms", [0.0, 0.5, 1.0, 3.0])
async def test_a_queueing_masters_queue_timeout_at_its_window_falls_through_to_kvcm(
    autojump_clock: trio.testing.MockClock, early_ms: float
) -> None:
    """The scheduler is told the window's end as generate_timeout, and a queueing one answers 8503 when
    it passes, on its own clock: at the window's end or a little before it (request_time_ms is
    rounded down; its clock may be ahead). That answer is no routing within the window, not the
    request's failure: the time kept for KVCM is still there."""
    async with rig(replicas=1, transport_timeout_ms=30) as r:
        r.master.set_faults(0, MasterFaults(queue_timeout_early_ms=early_ms))
        for i in range(4):
            took, decision = await r.timed_route(f"q{i}", budget_ms=50)
            assert decision.route_source is RouteSource.KVCM and not decision.error_code, decision
            assert decision.sources[0].reason is (Reason.MASTER_UNAVAILABLE if i < 3 else Reason.MASTER_BREAKER_OPEN)
            assert took <= 0.050
        registry = r.handle.metrics.registry
        queued = registry.get_sample_value("kvroute_master_requests_total", {"outcome": "queue_timeout"}) or 0
        cut = registry.get_sample_value("kvroute_master_requests_total", {"outcome": "deadline"}) or 0
        assert queued + cut == 3  # each attempt counted once; the breaker (threshold 3) then skips the master
        assert queued == (3 if early_ms > 0 else 0)
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth) and health.breaker.state.value == "open"
        if early_ms > 0:
            host = r.master.addresses().hosts[0]
            assert (health.last_error or "").startswith(f"{host}: deadline: QUEUE_TIMEOUT (8503)")


@pytest.mark.parametrize("early_ms", [0.0, 1.0])
async def test_a_queue_timeout_in_a_window_the_requests_budget_cut_short_is_not_judged(
    autojump_clock: trio.testing.MockClock, early_ms: float
) -> None:
    """As a call cut there would not be: a 25 ms budget leaves the master 5 ms, less than a slow answer,
    and three such 8503s opened the breaker on a master that then answered a longer request."""
    async with rig(replicas=1, transport_timeout_ms=30, later_sources_ms=20) as r:
        r.master.set_faults(0, MasterFaults(queue_timeout_early_ms=early_ms))
        for i in range(4):
            decision = await r.route(f"q{i}", budget_ms=25)
            assert decision.sources[0].reason is Reason.MASTER_UNAVAILABLE and decision.route_source is RouteSource.KVCM
        r.master.clear_faults()
        decision = await r.route("long", budget_ms=200)
        assert decision.route_source is RouteSource.MASTER
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth) and health.breaker.state.value == "closed"


async def test_requests_whose_budget_is_shorter_than_the_masters_answers_leave_it_to_those_with_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The master healthy but answering in 20 ms; of every four requests three have 35 ms budgets (the
    master's window 15 ms, past slow_query_ms but short of its answer) and one 50 ms (30 ms). The tight
    ones' cut attempts were judged and opened the breaker for the requests with room for the answer."""
    async with rig(replicas=1, later_sources_ms=20) as r:
        r.master.set_faults(0, MasterFaults(slow_ms=20.0))
        roomy: list[RouteSource] = []
        for i in range(40):
            roomy_one = i % 4 == 0 or i < 2  # two roomy ones first: answers teach how long one takes
            decision = await r.route(f"m{i}", budget_ms=50 if roomy_one else 35)
            if roomy_one:
                roomy.append(decision.route_source)
            await trio.sleep(0.02)
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        assert health.breaker.state.value == "closed" and health.breaker.opened_total == 0, health.breaker
        assert roomy == [RouteSource.MASTER] * len(roomy)
        # Then the master's schedule answers slow to 60 ms (its master/info too, within discovery's
        # timeout) while only tight budgets reach it: its answers age out as the cuts take their
        # places, and the cuts are judged again (they were spared for good).
        r.master.set_faults(0, MasterFaults(slow_ms=60.0))
        for i in range(ANSWERED_WINDOW + 2 * 3):  # the window, then the breaker's threshold (3) and more
            await r.route(f"h{i}", budget_ms=35)
            await trio.sleep(0.02)
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        assert health.breaker.opened_total >= 1, health.breaker


async def test_a_slave_cut_at_the_windows_end_after_the_masters_queue_timeout_is_counted_and_named(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(transport_timeout_ms=30, slave_window_share=0.5) as r:
        slave = r.master.addresses().hosts[1]
        r.master.set_faults(0, MasterFaults(queue_timeout_early_ms=1.0))
        r.master.set_faults(1, MasterFaults(hang=True))
        decision = await r.route("q", budget_ms=100)
        assert decision.route_source is RouteSource.KVCM
        registry = r.handle.metrics.registry
        for outcome in ("queue_timeout", "deadline"):  # the master's 8503, then the slave's cut
            assert registry.get_sample_value("kvroute_master_requests_total", {"outcome": outcome}) == 1, outcome
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        assert (health.last_error or "").startswith(f"{slave}: deadline: no schedule reply within the master's window")


async def test_a_hanging_master_leaves_the_slave_its_share_of_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With a share for the slave (off by default): the master accepts /schedule and never answers
    while its master/info still does (discovery keeps it); its call would take every request's whole
    window, the slave never asked, and the breaker then skip the source, slave and all. (The
    simulated slave answers by itself; a real one forwards to the master first.)"""
    async with rig(transport_timeout_ms=30, later_sources_ms=10, slave_window_share=0.5) as r:
        hosts = r.master.addresses().hosts
        r.master.set_faults(0, MasterFaults(hang=True))
        seen = r.schedules_seen()
        for i in range(8):
            took, decision = await r.timed_route(f"h{i}")
            assert decision.route_source is RouteSource.MASTER, decision  # the slave's answer
            assert took == pytest.approx(0.015)  # the master's half of the 30 ms window, then the slave at once
        assert r.masters.call_count(hosts[1], paths.MASTER_HTTP_SCHEDULE) == 8
        assert {request.generate_timeout_ms for request in seen} == {30}  # the slave is told the whole window
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        assert health.breaker.state.value == "closed"  # the source answers: nothing to break


async def test_a_window_too_short_to_share_and_slow_answers_keep_the_master_its_whole_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Split, a 12 ms window would give each host 6 ms, under a slow answer (slow_query_ms 10): a
    master and a slave both answering in 8 ms would both be cut, judged failed, and open the breaker."""
    async with rig(transport_timeout_ms=12, slave_window_share=0.5) as r:
        r.master.set_faults(0, MasterFaults(slow_ms=8.0))
        r.master.set_faults(1, MasterFaults(slow_ms=8.0))
        for i in range(6):
            took, decision = await r.timed_route(f"s{i}")
            assert decision.route_source is RouteSource.MASTER and took == pytest.approx(0.008), decision
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        assert health.breaker.state.value == "closed"


async def test_by_default_a_hanging_master_takes_the_whole_window(autojump_clock: trio.testing.MockClock) -> None:
    async with rig(transport_timeout_ms=10) as r:
        r.master.set_faults(0, MasterFaults(hang=True))
        for i in range(3):
            took, decision = await r.timed_route(f"h{i}")
            assert decision.route_source is RouteSource.KVCM and took == pytest.approx(0.010)
        assert r.masters.call_count(r.master.addresses().hosts[1], paths.MASTER_HTTP_SCHEDULE) == 0
        # The window's end cut the master's call: the master is named, not the slave nobody called.
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        master = r.master.addresses().hosts[0]
        assert (health.last_error or "").startswith(f"{master}: deadline: no schedule reply within the master's window")


async def test_with_the_kvcm_fallback_off_a_hanging_master_is_judged_and_opens_the_breaker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No cache source follows and the transport timeout (200 ms) outlasts the 50 ms budget: the
    master's own window still ends before the request's deadline, so each hung call is judged a
    failure (not the request's deadline), and the breaker opens after its threshold."""
    async with rig(kvcm_fallback=False, replicas=1) as r:
        r.master.set_faults(0, MasterFaults(hang=True))
        waits = []
        for i in range(5):
            took, decision = await r.timed_route(f"h{i}")
            waits.append(took)
            assert decision.route_source is RouteSource.DOMAIN
            assert decision.reason is (Reason.MASTER_UNAVAILABLE if i < 3 else Reason.MASTER_BREAKER_OPEN)
            assert [s.source for s in decision.sources] == [RouteSource.MASTER, RouteSource.DOMAIN]
            await trio.testing.wait_all_tasks_blocked()  # the master's task has taken the attempt's report
        assert all(0.045 <= w < 0.050 for w in waits[:3])  # the window, ended before the deadline
        assert all(w < 0.002 for w in waits[3:]), waits  # then nothing: the breaker is open
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        assert health.breaker.state.value == "open"
        assert r.kvcm_queries() == 0


async def test_with_nothing_kept_for_kvcm_a_hanging_master_is_still_judged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``later_sources_ms`` 0 keeps nothing for KVCM: the window still ends the domain's reserve
    before the deadline, so the request's own scope never takes the hung call's cancellation and
    leaves it unjudged (which would cost every request its whole budget with the breaker closed)."""
    async with rig(replicas=1, later_sources_ms=0) as r:
        r.master.set_faults(0, MasterFaults(hang=True))
        for i in range(5):
            took, decision = await r.timed_route(f"h{i}")
            assert decision.sources[0].source is RouteSource.MASTER
            assert decision.sources[0].reason is (Reason.MASTER_UNAVAILABLE if i < 3 else Reason.MASTER_BREAKER_OPEN)
            assert took < 0.050
            await trio.testing.wait_all_tasks_blocked()
        health = r.handle.actors()["master_client"]["health"]
        assert isinstance(health, MasterClientHealth)
        assert health.breaker.state.value == "open"


async def test_a_decode_first_answer_routes_the_prefill_worker(autojump_clock: trio.testing.MockClock) -> None:
    """A prefill/decode cluster answers [DECODE, PREFILL]; with both roles routed the request's worker is
    the prefill one, and the decode address rides along as the master gave it."""
    async with rig(roles=(Role.PREFILL, Role.DECODE)) as r:
        prefill = r.cluster.worker_addr(1)
        answer = [
            RoleAddr(Role.DECODE, "10.9.9.9", 9000, 9001),
            RoleAddr(Role.PREFILL, prefill.ip, prefill.http_port, prefill.grpc_port),
        ]
        r.master.set_decide(lambda request: answer)
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.MASTER
        assert decision.worker == prefill and decision.role is Role.PREFILL
        assert [a.role for a in decision.role_addrs] == [Role.DECODE, Role.PREFILL]


async def test_the_scheduler_is_told_the_window_and_the_time_of_receipt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """generate_timeout is the master's window, so the scheduler never queues the request longer than
    the frontend waits; request_time_ms is the wall clock at the request's receipt, not at the call."""
    async with rig(replicas=1, transport_timeout_ms=200, later_sources_ms=20) as r:
        seen = r.schedules_seen()
        wall_before_ms = time.time() * 1000
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        wall_after_ms = time.time() * 1000
        assert decision.route_source is RouteSource.MASTER
        (request,) = seen
        assert request.generate_timeout_ms == 30  # 50 ms budget − 20 ms kept for KVCM
        assert wall_before_ms - 1 <= request.request_time_ms <= wall_after_ms


@pytest.mark.parametrize("kvcm_fallback", [True, False], ids=["kvcm-on", "kvcm-off"])
@pytest.mark.parametrize("protocol", [MasterProtocol.HTTP, MasterProtocol.GRPC], ids=["http", "grpc"])
async def test_what_the_scheduler_is_sent_does_not_depend_on_the_kvcm_switch(
    autojump_clock: trio.testing.MockClock, protocol: MasterProtocol, kvcm_fallback: bool
) -> None:
    """Token ids over HTTP (the scheduler hashes them itself); over gRPC, which has no field for them,
    the keys this router hashes. Caller's keys are sent as given either way."""
    async with rig(replicas=1, kvcm_fallback=kvcm_fallback, protocol=protocol) as r:
        seen = r.schedules_seen()
        await r.handle.route(RouteRequest("tokens", token_ids=PROMPT, budget_ms=50))
        caller_keys = (7, 8, 9)
        await r.handle.route(RouteRequest("keys", block_cache_keys=caller_keys, block_size=BLOCK, budget_ms=50))
        by_tokens, by_keys = seen
        if protocol is MasterProtocol.HTTP:
            assert (by_tokens.input_ids, by_tokens.block_cache_keys, by_tokens.block_size) == (PROMPT, (), None)
        else:
            assert (by_tokens.input_ids, by_tokens.block_cache_keys, by_tokens.block_size) == (None, KEYS, BLOCK)
        assert (by_keys.input_ids, by_keys.block_cache_keys, by_keys.block_size) == (None, caller_keys, BLOCK)
        assert by_tokens.seq_len == len(PROMPT)


async def test_the_master_window_leaves_the_later_sources_their_time(autojump_clock: trio.testing.MockClock) -> None:
    async with rig(replicas=1, transport_timeout_ms=200, later_sources_ms=20) as r:
        r.master.set_faults(0, MasterFaults(hang=True))
        took, decision = await r.timed_route("r1", budget_ms=30)
        assert decision.route_source is RouteSource.KVCM
        assert decision.sources[0].elapsed_ms == pytest.approx(10.0, abs=0.5)  # 30 ms budget − 20 ms kept
        assert took <= 0.030


async def test_with_the_kvcm_fallback_off_a_failing_master_means_domain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(kvcm_fallback=False) as r:
        for host in r.master.addresses().hosts:
            r.masters.stop(host)
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.DOMAIN and decision.reason is Reason.MASTER_UNAVAILABLE
        assert [s.source for s in decision.sources] == [RouteSource.MASTER, RouteSource.DOMAIN]
        assert r.kvcm_queries() == 0


@pytest.mark.parametrize("token_ids", [(1.5, 2.0), (None,), ("a",), (float("nan"),), (2**64,)], ids=repr)
async def test_token_ids_nobody_hashes_are_still_checked_before_the_scheduler_sees_them(
    autojump_clock: trio.testing.MockClock, token_ids: tuple[object, ...]
) -> None:
    """With the KVCM fallback off and an HTTP scheduler nothing hashes the ids: they went to the
    scheduler as given (invalid JSON for NaN) and came back as its 8406, not as our bad_request."""
    async with rig(kvcm_fallback=False) as r:
        seen = r.schedules_seen()
        request = RouteRequest("odd", token_ids=token_ids, budget_ms=50)  # type: ignore[arg-type]
        decision = await r.handle.route(request)
        assert decision.reason is Reason.BAD_REQUEST and (decision.error or "").startswith("token_ids"), decision
        assert seen == []


async def test_no_master_known_is_its_own_outcome(autojump_clock: trio.testing.MockClock) -> None:
    async with rig() as r:
        for host in r.master.addresses().hosts:
            r.masters.stop(host)
        await trio.sleep(5)  # discovery marks every host unhealthy
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.sources[0].reason is Reason.NO_MASTER
        assert decision.route_source is RouteSource.KVCM
        sample = r.handle.metrics.registry.get_sample_value("kvroute_master_requests_total", {"outcome": "no_master"})
        assert sample == 1


async def test_without_master_hosts_the_chain_starts_at_kvcm(autojump_clock: trio.testing.MockClock) -> None:
    async with rig(hosts="") as r:
        decision = await r.handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.KVCM
        assert [s.source for s in decision.sources] == [RouteSource.KVCM]
        assert "master_client" not in r.handle.actors()


async def test_a_crashed_master_client_restarts_and_requests_keep_their_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig() as r:
        r.handle.supervisor.inject_crash("master_client")
        await trio.sleep(1)  # past the restart backoff
        view = r.handle.actors()["master_client"]
        assert (view["state"], view["restarts"]) == ("running", 1)
        decision = await r.handle.route(RouteRequest("after", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.MASTER


async def test_a_queue_over_the_threshold_rejects_up_front_with_429(autojump_clock: trio.testing.MockClock) -> None:
    async with rig(queue_length_reject_threshold=100) as r:
        r.master.queue_length = 500
        await trio.sleep(2)  # discovery's next round reads the new queue length
        before = r.masters.call_count(path=paths.MASTER_HTTP_SCHEDULE)
        decision = await r.handle.route(RouteRequest("q", token_ids=PROMPT, budget_ms=50))
        assert (decision.reason, decision.error_code, decision.worker) == (Reason.MASTER_QUEUE_FULL, 429, None)
        assert r.masters.call_count(path=paths.MASTER_HTTP_SCHEDULE) == before  # rejected before any call
        gauge = r.handle.metrics.registry.get_sample_value("kvroute_master_queue_length")
        assert gauge == 500


# --- the master source as an actor: its task owns the breaker, last error and counters -------------


def master_health(r: Rig) -> MasterClientHealth:
    health = r.handle.actors()["master_client"]["health"]
    assert isinstance(health, MasterClientHealth)
    return health


async def test_reports_wait_for_the_masters_task_and_a_full_inbox_drops_and_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(max_in_flight=1) as r:  # an inbox of 2: a report and a trial ask per request in flight
        await r.route("warm")
        await trio.testing.wait_all_tasks_blocked()
        assert master_health(r).requests == 1
        r.handle.supervisor.inject_crash("master_client")
        await trio.testing.wait_all_tasks_blocked()  # the task is down until its restart backoff ends
        for i in range(3):  # a CLOSED breaker admits from the published view: no hop, no wait
            decision = await r.handle.route(RouteRequest(f"down{i}", token_ids=PROMPT, budget_ms=50))
            assert decision.route_source is RouteSource.MASTER
        health = master_health(r)
        assert (health.requests, health.routed, health.inbox_depth, health.reports_dropped) == (1, 1, 2, 1)
        await trio.sleep(1)  # restarted: it applies what waited for it
        health = master_health(r)
        assert (health.requests, health.routed, health.inbox_depth, health.reports_dropped) == (3, 3, 0, 1)


async def open_the_breaker_until_a_trial_is_due(r: Rig) -> None:
    """The scheduler hangs until the breaker opens; then its cooldown passes: the next request is the trial."""
    r.schedules_seen()
    r.master.set_faults(0, MasterFaults(hang=True))
    for i in range(3):
        await r.route(f"hang{i}")
    await trio.testing.wait_all_tasks_blocked()
    assert master_health(r).breaker.state is BreakerState.OPEN
    await trio.sleep(1.0)


async def test_a_trials_success_is_applied_under_a_burst_the_breaker_refuses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The requests the half-open breaker refused sent a report each into the same bounded inbox as the
    trial's: a burst filled it, the trial's success was dropped, and the breaker held half-open until
    the trial timed out, then reopened though the master had answered. Now the refused requests are
    only counted, and the trial's report is never dropped."""
    async with rig(kvcm_fallback=False, max_in_flight=16, transport_timeout_ms=10) as r:  # an inbox of 32
        await open_the_breaker_until_a_trial_is_due(r)
        r.master.set_faults(0, MasterFaults(slow_ms=5.0))
        trial: list[RouteDecision] = []

        answers_at = trio.current_time() + 0.005
        decisions: list[RouteDecision] = []

        async def burst(i: int) -> None:
            await trio.sleep_until(answers_at)  # arriving as the master answers the trial
            for j in range(20):
                decisions.append(await r.route(f"b{i}-{j}"))
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(trial, r.route("trial")))
            await trio.testing.wait_all_tasks_blocked()  # the trial is admitted and waits for the master
            for i in range(100):
                nursery.start_soon(burst, i)
        await trio.testing.wait_all_tasks_blocked()
        assert trial[0].route_source is RouteSource.MASTER
        health = master_health(r)
        assert health.breaker.state is BreakerState.CLOSED, health.breaker
        assert health.reports_dropped == 0
        # Every request that reached the master source is counted, the refused ones by their callers
        # (the router's admission shed the rest: they never reach a source).
        shed = sum(d.reason is Reason.OVERLOADED for d in decisions)
        assert len(decisions) == 2000 and 0 < shed < 2000
        assert health.requests == 3 + 1 + 2000 - shed
        assert health.requests == health.routed + health.fell_through + health.ended


async def test_a_trials_report_is_applied_when_it_finds_the_inbox_full(autojump_clock: trio.testing.MockClock) -> None:
    """The trial ends while the master source's task is down and its inbox full (reports of requests
    that asked the master, waiting for it): its report used to be dropped there, and the breaker held
    half-open until the trial timed out. It is kept aside and applied once the task is back."""
    async with rig(kvcm_fallback=False, max_in_flight=1, transport_timeout_ms=30) as r:  # an inbox of 2
        await open_the_breaker_until_a_trial_is_due(r)
        r.master.set_faults(0, MasterFaults(slow_ms=20.0))
        source = next(s for s in r.handle.router_actor()._chain if isinstance(s, MasterSource))
        trial: list[RouteDecision] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(trial, r.route("trial")))
            await trio.testing.wait_all_tasks_blocked()  # admitted: the master answers in 20 ms
            r.handle.supervisor.inject_crash("master_client")
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(2):  # the task is down: reports wait for it and fill its inbox
                source._send.send_nowait(_Attempted(_Verdict.NOT_JUDGED, False, None, None, -math.inf))
        assert trial[0].route_source is RouteSource.MASTER
        await trio.sleep(1.0)  # restarted: it applies what waited for it
        health = master_health(r)
        assert health.breaker.state is BreakerState.CLOSED, health.breaker
        assert health.reports_dropped == 0


async def test_requests_with_no_time_for_the_master_are_counted_without_a_report(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An admitted request whose window leaves the master no time is not called: counted by its caller,
    as the other requests that never ask the master, not sent (and dropped) as a report."""
    async with rig(max_in_flight=1, later_sources_ms=20) as r:  # an inbox of 2
        await r.route("warm")
        await trio.testing.wait_all_tasks_blocked()
        r.handle.supervisor.inject_crash("master_client")
        await trio.testing.wait_all_tasks_blocked()  # the task is down: a report would wait, or be dropped
        for i in range(3):
            decision = await r.handle.route(RouteRequest(f"no-time{i}", token_ids=PROMPT, budget_ms=15))
            assert decision.sources[0].reason is Reason.DEADLINE
        health = master_health(r)
        assert (health.requests, health.fell_through, health.inbox_depth, health.reports_dropped) == (4, 3, 0, 0)


async def _append(into: list[RouteDecision], decision: Awaitable[RouteDecision]) -> None:
    into.append(await decision)


async def test_a_trial_ask_waits_only_within_the_masters_window(autojump_clock: trio.testing.MockClock) -> None:
    async with rig(replicas=1, transport_timeout_ms=10, later_sources_ms=20) as r:
        r.master.set_faults(0, MasterFaults(hang=True))
        for i in range(3):  # the breaker's threshold
            await r.route(f"h{i}")
        await trio.testing.wait_all_tasks_blocked()
        assert master_health(r).breaker.state.value == "open"
        await trio.sleep(1.0)  # the cooldown: the next request may be the trial, which only the task hands out
        r.master.set_faults(0, MasterFaults())
        r.handle.supervisor.inject_crash("master_client")
        await trio.testing.wait_all_tasks_blocked()
        took, decision = await r.timed_route("asks", budget_ms=30)
        assert decision.sources[0].reason is Reason.MASTER_BREAKER_OPEN  # no answer within its window: as if open
        assert decision.route_source is RouteSource.KVCM  # the later sources kept their 20 ms
        assert decision.sources[0].elapsed_ms == pytest.approx(10.0, abs=0.5)
        assert took <= 0.030
        await trio.sleep(1)  # restarted; the abandoned ask took no trial slot
        decision = await r.handle.route(RouteRequest("trial", token_ids=PROMPT, budget_ms=30))
        assert decision.route_source is RouteSource.MASTER
        await trio.testing.wait_all_tasks_blocked()
        assert master_health(r).breaker.state.value == "closed"


@pytest.mark.parametrize("how", ["budget", "cancelled"])
async def test_a_trial_that_ends_unjudged_frees_its_slot_at_once(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    """A trial whose window the request's own budget cut short (under a slow answer), or whose caller
    cancelled it mid-call, says nothing of the master: the slot is free for the next request at once,
    where it would hold the breaker half-open until the trial timed out and then reopen it."""
    async with rig(replicas=1, transport_timeout_ms=30, later_sources_ms=20) as r:
        await open_the_breaker_until_a_trial_is_due(r)  # the master still hangs
        if how == "budget":
            decision = await r.route("short", budget_ms=25)  # leaves the master 5 ms, under slow_query_ms
            assert decision.sources[0].reason is Reason.MASTER_UNAVAILABLE
        else:
            with trio.move_on_after(0.005):
                await r.route("cancelled")
        await trio.testing.wait_all_tasks_blocked()
        breaker = master_health(r).breaker
        assert (breaker.state, breaker.trial_started_at) == (BreakerState.HALF_OPEN, None)
        r.master.clear_faults()
        decision = await r.route("trial")
        assert decision.route_source is RouteSource.MASTER
        await trio.testing.wait_all_tasks_blocked()
        breaker = master_health(r).breaker
        assert (breaker.state, breaker.trial_timeouts_total, breaker.opened_total) == (BreakerState.CLOSED, 0, 1)


async def test_a_caller_cancelling_during_the_masters_call_is_no_failure_of_the_master(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with rig(replicas=1, transport_timeout_ms=30) as r:
        r.master.set_faults(0, MasterFaults(hang=True))
        for i in range(3):  # the breaker's threshold, had they counted
            with trio.move_on_after(0.005):
                await r.route(f"cancelled{i}")
        await trio.testing.wait_all_tasks_blocked()
        health = master_health(r)
        breaker = health.breaker
        assert (breaker.state, breaker.opened_total, breaker.consecutive_failures) == (BreakerState.CLOSED, 0, 0)
        assert health.requests == 3


async def test_a_bad_master_breaker_built_in_code_is_refused_naming_its_own_section(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The breaker refused it as ``breaker.cooldown_s``: the KVCM breaker's section, which was fine."""
    masters = MemoryMasterNetwork()
    hosts = SimMaster([RoleAddr(Role.PREFILL, "10.0.0.1", 8000, 8001)]).serve_memory(masters)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        router=RouterConfig(kvcm_fallback=False),
        discovery=DiscoveryConfig(workers="10.0.0.1:8000"),
        master=MasterConfig(hosts=",".join(hosts.hosts)),
        master_breaker=replace(BreakerConfig(), cooldown_s=-1.0),
    )
    with pytest.raises(ConfigError, match=r"master_breaker\.cooldown_s: must be > 0"):
        async with open_router(config, rpc=MemoryNetwork(), master=masters):
            raise AssertionError("the router started")


async def test_a_trial_its_asker_left_as_it_was_granted_is_released_not_counted_as_a_request(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request asks to be the breaker's trial and is cancelled in the round the grant comes: the
    grant is released for the next request, and its release was counted as a request beside the
    caller's own report of the same one: one request, two in ``requests``."""
    async with rig(kvcm_fallback=False, transport_timeout_ms=30) as r:
        await open_the_breaker_until_a_trial_is_due(r)
        r.master.set_faults(0, MasterFaults())
        before = master_health(r)
        caller = trio.CancelScope()
        grant = _AskTrial.answer

        def answered_as_the_caller_leaves(ask: _AskTrial, admission: Admission) -> None:
            caller.cancel()
            grant(ask, admission)

        monkeypatch.setattr(_AskTrial, "answer", answered_as_the_caller_leaves)
        with caller:
            await r.route("left-as-it-was-granted")
        monkeypatch.undo()
        await trio.testing.wait_all_tasks_blocked()
        after = master_health(r)
        assert caller.cancelled_caught
        assert after.requests - before.requests == 1
        # Released: the next request is the trial, and the scheduler answering it closes the breaker.
        assert (await r.route("the-trial")).route_source is RouteSource.MASTER
        await trio.testing.wait_all_tasks_blocked()
        assert master_health(r).breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize("crashing", ["the_trials_report", "a_report_after_its_wake_up"])
async def test_a_crash_applying_a_batch_does_not_hold_the_breaker_half_open_until_the_trial_times_out(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, crashing: str
) -> None:
    """The master answered the trial, and the task crashed applying its report (popped, then lost) or a
    report behind its wake-up in the same batch (the report kept aside, but the restarted task waited
    for a message, which the half-open view kept from coming): the breaker held half-open until the
    trial timed out, then reopened though the master had answered. Now the restarted task applies a
    report left aside at once, and one whose application crashed frees the trial's slot at least."""
    async with rig(kvcm_fallback=False, transport_timeout_ms=30) as r:
        await open_the_breaker_until_a_trial_is_due(r)
        r.master.set_faults(0, MasterFaults())
        source = next(s for s in r.handle.router_actor()._chain if isinstance(s, MasterSource))
        assert await source._admit(math.inf) is Admission.TRIAL
        apply = source._apply
        crashes = [RuntimeError("a bug applying a report")]

        def crash_once(attempted: _Attempted) -> None:
            if crashes and attempted.trial == (crashing == "the_trials_report"):
                raise crashes.pop()
            apply(attempted)

        monkeypatch.setattr(source, "_apply", crash_once)
        # One batch: the trial's wake-up (taken by the waiting task), then a report queued behind it.
        source._report(_Attempted(_Verdict.SUCCESS, True, None, None, trio.current_time()))
        source._send.send_nowait(_Attempted(_Verdict.NOT_JUDGED, False, None, None, -math.inf))
        await trio.testing.wait_all_tasks_blocked()
        assert not crashes
        await trio.sleep(1.0)  # restarted (well within the trial's 5 s timeout)
        view = r.handle.actors_health()["master_client"]
        assert (view["state"], view["restarts"]) == ("running", 1)
        decision = await r.route("after")
        assert decision.route_source is RouteSource.MASTER, decision.reason
        await trio.testing.wait_all_tasks_blocked()
        breaker = master_health(r).breaker
        assert (breaker.state, breaker.trial_timeouts_total, breaker.opened_total) == (BreakerState.CLOSED, 0, 1)
