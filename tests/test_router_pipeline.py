"""The routing pipeline end to end under MockClock with in-memory peers (SimCluster on a MemoryNetwork).

Only the remote peers are simulated; every actor, the deadline logic and the decoders are real.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from actors import router_actor
from actors.breaker import BreakerState
from actors.metrics_sink import MetricsSink
from actors.router_actor import RestOwed
from actors.scorer import Decided, DecideRequest, Scorer, ScorerHealth
from actors.shadow_index import ShadowHealth, ShadowIndex, ShadowIndexActor
from actors.sources.base import FellThrough, RequestContext, RequestSplit
from actors.sources.kvcm import KvcmSource
from actors.sources.shadow import ShadowSource
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.kvcm import KvcmFaults, SimKvcmCluster
from kvroute_sim.sim.memory_server import memory_handler
from kvroute_sim.sim.worker import WorkerFaults, WorkerSpec
from router.admission import AdmissionEstimate
from router.api import open_router
from router.config import (
    DeploymentConfig,
    DiscoveryConfig,
    KvrouteConfig,
    LimitsConfig,
    MetricsConfig,
    ProberConfig,
    RouterConfig,
    ShadowConfig,
)
from router.decision_pack import unpack_decision
from router.keys import block_keys
from router.logs import AggregatingLogger
from router.policy.cache_affinity import CacheAffinityFirst
from router.policy.deadline_split import SplitWindows
from router.request import CheckedRequest, key_slices, prepare_request, sheddable
from router.sidecar import decision_to_proto
from router.supervisor import RouterHandle
from router.transport.clients import LARGE_REPLY_BYTES
from router.transport.errors import Unavailable
from router.transport.memory_adapter import MemoryNetwork
from router.types import (
    BadRequest,
    DropReason,
    KeyFamily,
    QueryType,
    Reason,
    Role,
    RouteDecision,
    RouterClosed,
    RouteRequest,
    RouteSource,
    SourceOutcome,
    SplitMode,
    Stage,
    WorkerAddr,
    WorkerStatus,
)
from router.wire import kvcm_meta_pb2 as kvcm_pb
from router.wire import paths

BLOCK = 16
PROMPT = tuple(range(1000, 1000 + 8 * BLOCK))  # 8 blocks
KEYS = block_keys(PROMPT, BLOCK, KeyFamily.RTP)


def make_config(cluster_addrs_bootstrap: str, workers: str, **router_kw: object) -> KvrouteConfig:
    deployment_roles = router_kw.pop("roles", (Role.PREFILL,))
    health_interval_s = router_kw.pop("health_interval_s", 0.0)
    background_refresh = router_kw.pop("background_refresh", False)
    serial_refresh = router_kw.pop("serial_refresh", False)
    return KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK, roles=deployment_roles),  # type: ignore[arg-type]
        router=RouterConfig(**router_kw),  # type: ignore[arg-type]
        discovery=DiscoveryConfig(kvcm_bootstrap=cluster_addrs_bootstrap, workers=workers),
        # The request path's own probes are under test: background health probes and refresh (which
        # warm the status cache) are off unless a test asks for them.
        prober=ProberConfig(
            health_interval_s=health_interval_s,  # type: ignore[arg-type]
            background_refresh=background_refresh,  # type: ignore[arg-type]
            serial_refresh=serial_refresh,  # type: ignore[arg-type]
        ),
    )


@asynccontextmanager
async def routed(
    cluster: SimCluster, network: MemoryNetwork | None = None, **router_kw: object
) -> AsyncIterator[tuple[RouterHandle, MemoryNetwork, KvrouteConfig]]:
    network = MemoryNetwork() if network is None else network
    addrs = cluster.serve_memory(network)
    metrics_inbox = router_kw.pop("metrics_inbox", None)
    scorer = router_kw.pop("scorer", None)  # ScorerConfig fields to override
    metrics = router_kw.pop("metrics", None)  # MetricsConfig fields to override
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg, **router_kw)
    if isinstance(metrics_inbox, int):
        config = replace(config, metrics=MetricsConfig(inbox_size=metrics_inbox))
    if isinstance(scorer, dict):
        config = replace(config, scorer=replace(config.scorer, **scorer))
    if isinstance(metrics, dict):
        config = replace(config, metrics=replace(config.metrics, **metrics))
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.move_on_after(1):
            await resolver.leader()
        yield handle, network, config


def padded(reply: bytes, to_bytes: int) -> bytes:
    """``reply`` with an unknown length-delimited field (number 1000) appended: the same message to a
    decoder, ``to_bytes`` long or more on the wire."""
    tag = bytes([(1000 << 3 | 2) & 0x7F | 0x80, (1000 << 3 | 2) >> 7])
    size = max(0, to_bytes - len(reply))
    length = bytearray()
    rest = size
    while True:
        byte, rest = rest & 0x7F, rest >> 7
        length.append(byte | (0x80 if rest else 0))
        if not rest:
            break
    return reply + tag + bytes(length) + b"x" * size


class CallWatched(MemoryNetwork):
    """A MemoryNetwork whose calls made alone pass ``before`` on their way out and ``after`` with their
    reply: the hooks a test overrides, the call's signature written once."""

    async def before(self, target: str, method_path: str, background: bool) -> None:
        return None

    def after(self, method_path: str, reply: bytes) -> bytes:
        return reply

    async def call(
        self,
        target: str,
        method_path: str,
        request: bytes,
        *,
        on_sent: Callable[[], None] | None = None,
        sent_timeout_s: float | None = None,
        background: bool = False,
    ) -> bytes:
        await self.before(target, method_path, background)
        reply = await super().call(
            target, method_path, request, on_sent=on_sent, sent_timeout_s=sent_timeout_s, background=background
        )
        return self.after(method_path, reply)


class StalledOnTheReply(CallWatched):
    """Each reply on ``method_path`` (any, when None) comes in padded to ``reply_bytes`` and this
    thread then stalls for ``stall_s`` (a collection, a long step elsewhere), the reply in hand."""

    def __init__(
        self, clock: trio.testing.MockClock, reply_bytes: int, stall_s: float, method_path: str | None = None
    ) -> None:
        super().__init__()
        self.clock = clock
        self.reply_bytes = reply_bytes
        self.stall_s = stall_s
        self.method_path = method_path

    def after(self, method_path: str, reply: bytes) -> bytes:
        if self.method_path is not None and method_path != self.method_path:
            return reply
        self.clock.jump(self.stall_s)
        return padded(reply, self.reply_bytes)


def fault_the_leader(cluster: SimCluster, faults: KvcmFaults) -> str:
    """Give the KVCM leader ``faults``; its target."""
    leader = cluster.kvcm.leader
    assert leader is not None
    cluster.kvcm.set_faults(leader, faults)
    return leader


def seed(cluster: SimCluster, worker: int, blocks: int) -> None:
    cluster.kvcm.record_prefill(cluster.worker_addr(worker).http_target, KEYS[:blocks])


async def test_workers_discovery_drops_are_forgotten_by_the_scorer(autojump_clock: trio.testing.MockClock) -> None:
    """The prober was told which workers discovery lists, the Scorer not: its ledger entries and
    scoring views of departed workers stayed until as many newer workers pushed them out."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)
        for i in range(4):
            await handle.route(RouteRequest(f"r{i}", token_ids=PROMPT, budget_ms=50))
        await trio.testing.wait_all_tasks_blocked()
        before = handle.actors()["scorer"]["health"]
        assert isinstance(before, ScorerHealth) and before.policy.observed_statuses > 2
        kept = [cluster.worker_addr(i) for i in (1, 2)]
        handle.discovery().set_static_workers(",".join(f"{w.ip}:{w.http_port}" for w in kept))
        await handle.route(RouteRequest("after", token_ids=PROMPT, budget_ms=50))
        await trio.testing.wait_all_tasks_blocked()
        after = handle.actors()["scorer"]["health"]
        assert isinstance(after, ScorerHealth)
        assert after.policy.observed_statuses <= 2 and after.policy.tracked_workers <= 2


async def test_kvcm_routes_to_the_cache_holder(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)
        decision = await handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.KVCM
        assert decision.reason is Reason.CACHE_LEADER
        assert decision.worker == cluster.worker_addr(2)
        assert decision.local_blocks == 8
        assert decision.hit_tokens == len(PROMPT)
        assert decision.role is Role.PREFILL
        assert {"keys", "leader", "cache_query", "plan", "probe", "score", "total"} <= set(decision.stage_ms)
        assert decision.elapsed_ms <= 50


class RequestId(str):
    """An application's own id type: a ``str`` to every check."""


async def test_a_request_id_of_a_str_subclass_is_kept_by_the_metrics_sink(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The sink packs each decision it keeps with ``marshal``, which refused the id (only built-in
    types): the sink crashed on every such request, its ring and the decision's carried events lost.
    The id is kept as its plain text."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 1, 8)
        decision = await handle.route(RouteRequest(RequestId("sub-1"), token_ids=PROMPT, budget_ms=50))
        assert decision.worker == cluster.worker_addr(1)
        assert type(decision.request_id) is str and decision.request_id == "sub-1"
        # Refused before its deadline is computed (a budget that is no number) as well.
        refused = await handle.route(RouteRequest(RequestId("sub-2"), token_ids=PROMPT, budget_ms=math.nan))
        assert refused.reason is Reason.BAD_REQUEST
        await trio.testing.wait_all_tasks_blocked()
        assert handle.actors()["metrics_sink"]["restarts"] == 0
        kept = [unpack_decision(packed)[0] for packed in handle.metrics.recent_decisions(10)]
        assert [d.request_id for d in kept] == ["sub-2", "sub-1"]


async def test_what_is_no_route_request_raises_a_type_error_naming_it(autojump_clock: trio.testing.MockClock) -> None:
    """A caller's bug, not a bad request: it raised an AttributeError from deep in the checks."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        with pytest.raises(TypeError, match="route\\(\\) takes a RouteRequest, got a dict"):
            await handle.route({"request_id": "r", "token_ids": PROMPT})  # type: ignore[arg-type]
        assert (await handle.route(RouteRequest("after", token_ids=PROMPT, budget_ms=50))).worker is not None


async def test_a_prompt_shorter_than_one_block_is_no_match_without_a_query(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A prompt with no whole block has no keys: KVCM cannot hold any of it, so the source falls
    through as no match at once, without a query, and the decision routes by load on the cold set
    as for a prompt KVCM says nobody holds. It fell to the domain's uniform draw, half of these
    prompts to a worker with a long queue."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    for i in range(20):  # worker 0 busy
        cluster.workers[0].submit(f"queued{i}", 8000, 0, trio.current_time())
    async with routed(cluster) as (handle, _, _):
        leader = cluster.kvcm.leader
        assert leader is not None
        for i in range(12):
            short = tuple(range(50_000 * (i + 1), 50_000 * (i + 1) + BLOCK - 1))
            d = await handle.route(RouteRequest(f"short{i}", token_ids=short, budget_ms=50))
            assert (d.sources[0].source, d.sources[0].outcome) == (RouteSource.KVCM, SourceOutcome.FELL_THROUGH)
            assert d.sources[0].reason is Reason.NO_POSITIVE_MATCH
            assert (d.route_source, d.worker) == (RouteSource.SHADOW, cluster.worker_addr(1)), d
            await trio.testing.wait_all_tasks_blocked()
        assert cluster.kvcm.stats(leader).get(paths.KVCM_GET_HOST_CACHE_STATE).calls == 0


@pytest.mark.parametrize(("every", "routes", "compared", "ratio"), [(1, 5, 5, 0.8), (4, 9, 3, 2 / 3)])
async def test_shadow_agreement_is_measured_before_the_decision_is_learned(
    autojump_clock: trio.testing.MockClock, every: int, routes: int, compared: int, ratio: float
) -> None:
    """A compared KVCM answer is compared with the shadow index as it stood before that decision: the
    first request finds the shadow empty (0.0), later ones the first one's record (1.0 each). The first
    answer is compared, then one in ``shadow_compare_every`` (every one with 1; with 4 the fifth and the
    ninth); the answers between are routed and counted as ever."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, metrics={"shadow_compare_every": every}) as (handle, _, _):
        seed(cluster, 2, 8)
        for i in range(routes):
            d = await handle.route(RouteRequest(f"a{i}", token_ids=PROMPT, budget_ms=50))
            assert d.route_source is RouteSource.KVCM and d.worker == cluster.worker_addr(2)
        await trio.testing.wait_all_tasks_blocked()
        registry = handle.metrics.registry
        assert registry.get_sample_value("kvroute_shadow_comparisons_total") == compared
        assert registry.get_sample_value("kvroute_shadow_agreement_ratio") == pytest.approx(ratio)
        # The sources' observations travel with each decision and are counted as before.
        ok = {"method": "GetHostCacheState", "outcome": "ok"}
        assert registry.get_sample_value("kvroute_kvcm_requests_total", ok) == routes


async def test_every_decision_within_deadline_when_kvcm_hangs(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster, budget_cap_ms=50.0) as (handle, _, _):
        seed(cluster, 1, 8)
        fault_the_leader(cluster, KvcmFaults(hang=True))
        decisions = []
        for i in range(8):
            start = trio.current_time()
            d = await handle.route(RouteRequest(f"h{i}", token_ids=PROMPT, budget_ms=20))
            decisions.append((trio.current_time() - start, d))
        for took, d in decisions:
            assert took <= 0.020 + 1e-9
            assert d.worker is not None
            assert d.route_source in (RouteSource.DOMAIN, RouteSource.SHADOW)
        first = decisions[0][1]
        assert first.reason is Reason.DEADLINE
        # After the breaker opens, requests skip KVCM at once (no time spent).
        last_took, last = decisions[-1]
        assert last.reason is Reason.BREAKER_OPEN or last.route_source is RouteSource.SHADOW
        assert last_took < 0.005


async def test_queries_cut_short_by_tight_budgets_do_not_open_the_breaker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """KVCM answers in 8 ms; requests with 5 ms budgets cannot wait for it. That says nothing about
    KVCM: the breaker stays closed and the leader is kept, so requests with room still get its answer."""
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster, budget_cap_ms=50.0) as (handle, _, config):
        seed(cluster, 1, 8)
        fault_the_leader(cluster, KvcmFaults(delay_s=0.008))
        resolver = handle.leader_resolver()
        assert resolver is not None
        for i in range(4 * config.breaker.failure_threshold):
            start = trio.current_time()
            d = await handle.route(RouteRequest(f"tight{i}", token_ids=PROMPT, budget_ms=5))
            assert trio.current_time() - start <= 0.005 + 1e-9
            assert d.route_source is not RouteSource.KVCM and d.worker is not None
        snap = resolver.snapshot()
        assert snap.breaker.state is BreakerState.CLOSED and snap.breaker.window_failures == 0
        assert snap.invalidations_total == 0
        assert snap.queries_cut_short_total == 4 * config.breaker.failure_threshold
        d = await handle.route(RouteRequest("roomy", token_ids=PROMPT, budget_ms=30))
        assert d.route_source is RouteSource.KVCM and d.worker == cluster.worker_addr(1)


async def test_requests_whose_budget_is_shorter_than_kvcms_answers_leave_it_to_those_with_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """KVCM healthy but answering in 30 ms, above slow_query_ms; traffic alternates 20 ms budgets (no
    room for its answer) and 50 ms ones. The tight requests' cut queries were judged: the breaker
    opened again and again and the leader was invalidated, and the roomy requests got KVCM's answer
    about one time in ten."""
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster, budget_cap_ms=50.0) as (handle, _, _):
        seed(cluster, 1, 8)
        slow_queries = KvcmFaults(delay_s=0.030, methods=frozenset({paths.KVCM_GET_HOST_CACHE_STATE}))
        for node in cluster.kvcm.node_ids:
            cluster.kvcm.set_faults(node, slow_queries)
        resolver = handle.leader_resolver()
        assert resolver is not None
        roomy: Counter[RouteSource] = Counter()
        for i in range(200):
            budget = 50 if i % 2 else 20
            d = await handle.route(RouteRequest(f"q{i}", token_ids=PROMPT, budget_ms=budget))
            if budget == 50:
                roomy[d.route_source] += 1
            await trio.sleep(0.02)
        snap = resolver.snapshot()
        # The first tight one came before any answer taught how long one takes: judged, as any cut is then.
        assert snap.breaker.opened_total == 0 and snap.invalidations_total <= 1, snap
        assert roomy[RouteSource.KVCM] >= 90, roomy


async def test_queries_cut_by_a_query_timeout_below_slow_query_ms_are_judged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The operator's own kvcm_query_timeout_ms (5 ms) bounds a healthy answer, however short: a
    query it cuts is a KVCM failure, not a tight budget, so a hung KVCM opens the breaker and
    later requests stop paying the timeout."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, kvcm_query_timeout_ms=5.0) as (handle, _, config):
        seed(cluster, 1, 8)
        fault_the_leader(cluster, KvcmFaults(hang=True))
        resolver = handle.leader_resolver()
        assert resolver is not None
        first = await handle.route(RouteRequest("cut0", token_ids=PROMPT, budget_ms=50))
        assert first.sources[0].reason is Reason.DEADLINE
        assert first.sources[0].elapsed_ms == pytest.approx(5.0)  # the query timeout ended it, not the budget
        await trio.testing.wait_all_tasks_blocked()
        assert resolver.snapshot().queries_cut_short_total == 0
        assert resolver.snapshot().invalidations_total == 1
        for i in range(4 * config.breaker.failure_threshold):
            await handle.route(RouteRequest(f"cut{i + 1}", token_ids=PROMPT, budget_ms=50))
            await trio.testing.wait_all_tasks_blocked()
        snap = resolver.snapshot()
        assert snap.breaker.state is BreakerState.OPEN and snap.queries_cut_short_total == 0


async def test_a_kvcm_reply_in_hand_when_the_querys_time_ran_out_is_not_judged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A reply larger than LARGE_REPLY_BYTES is decoded on a thread, and the hop there is a checkpoint:
    with the query's time gone meanwhile (this thread stalled with KVCM's answer in hand) the answer was
    dropped and judged a KVCM failure, and the leader that had answered in time was invalidated."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = StalledOnTheReply(autojump_clock, LARGE_REPLY_BYTES + 1, 0.0, paths.KVCM_GET_HOST_CACHE_STATE)
    async with routed(cluster, network, kvcm_query_timeout_ms=5.0) as (handle, _, _):
        seed(cluster, 1, 8)
        resolver = handle.leader_resolver()
        assert resolver is not None
        network.stall_s = 0.01  # past the query's timeout, well within the request's budget
        stalled = await handle.route(RouteRequest("stalled", token_ids=PROMPT, budget_ms=50))
        assert stalled.route_source is not RouteSource.KVCM and stalled.worker is not None
        assert stalled.sources[0].reason is Reason.DEADLINE
        await trio.testing.wait_all_tasks_blocked()
        snap = resolver.snapshot()
        assert snap.invalidations_total == 0 and snap.breaker.window_failures == 0
        assert snap.queries_cut_short_total == 1
        network.stall_s, network.reply_bytes = 0.0, 0  # a large one's wait for its thread would let the clock jump
        d = await handle.route(RouteRequest("after", token_ids=PROMPT, budget_ms=50))
        assert d.route_source is RouteSource.KVCM and d.worker == cluster.worker_addr(1)


async def test_one_kvcm_stall_failing_every_query_in_flight_is_one_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """KVCM stalls while eight requests wait on it: all eight queries time out together. That is one
    spell, not eight failures in a row: the breaker stays closed and the next request, KVCM well
    again, gets KVCM's answer instead of falling to the shadow index for a cooldown."""
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster, budget_cap_ms=50.0) as (handle, _, config):
        seed(cluster, 1, 8)
        leader = cluster.kvcm.leader
        assert leader is not None
        resolver = handle.leader_resolver()
        assert resolver is not None
        assert (
            await handle.route(RouteRequest("warm", token_ids=PROMPT, budget_ms=30))
        ).route_source is RouteSource.KVCM
        cluster.kvcm.set_faults(leader, KvcmFaults(hang=True))
        stalled: list[RouteDecision] = []

        async def one(i: int) -> None:
            stalled.append(await handle.route(RouteRequest(f"stall{i}", token_ids=PROMPT, budget_ms=30)))

        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(one, i)
        assert len(stalled) == 8 > config.breaker.failure_threshold
        assert all(d.route_source is not RouteSource.KVCM and d.worker is not None for d in stalled)
        await trio.testing.wait_all_tasks_blocked()  # the resolver applies the eight reports
        snap = resolver.snapshot()
        assert snap.breaker.state is BreakerState.CLOSED
        assert (snap.breaker.consecutive_failures, snap.breaker.window_failures) == (1, 8)
        cluster.kvcm.clear_faults()
        d = await handle.route(RouteRequest("after", token_ids=PROMPT, budget_ms=30))
        assert d.route_source is RouteSource.KVCM and d.worker == cluster.worker_addr(1)


async def test_kvcm_slow_answers_within_budget(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 3, 8)
        fault_the_leader(cluster, KvcmFaults(delay_s=0.030))
        start = trio.current_time()
        d = await handle.route(RouteRequest("slow", token_ids=PROMPT, budget_ms=10))
        assert trio.current_time() - start <= 0.010 + 1e-9
        assert d.reason is Reason.DEADLINE
        assert d.route_source is RouteSource.DOMAIN
        # A budget that covers the delay gets the affinity answer.
        d2 = await handle.route(RouteRequest("slow2", token_ids=PROMPT, budget_ms=45))
        assert d2.route_source is RouteSource.KVCM and d2.worker == cluster.worker_addr(3)


async def test_all_workers_slow_decides_at_deadline(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 0, 8)
        for w in cluster.workers:
            w.set_faults(WorkerFaults(delay_s=0.5))
        start = trio.current_time()
        d = await handle.route(RouteRequest("ws", token_ids=PROMPT, budget_ms=20))
        # At decide_at: the budget less its reserve (0.1 of it), neither later nor at once.
        assert trio.current_time() - start == pytest.approx(0.020 - 0.002)
        assert d.worker is not None
        assert d.route_source is RouteSource.DOMAIN
        assert d.reason is Reason.NO_CANDIDATES


async def test_leader_lost_mid_request(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)
        old = cluster.kvcm.leader
        assert old is not None
        new = next(n for n in cluster.kvcm.node_ids if n != old)
        cluster.kvcm.set_leader(new)  # the old leader now answers SERVER_NOT_LEADER
        d = await handle.route(RouteRequest("moved", token_ids=PROMPT, budget_ms=20))
        assert d.reason is Reason.KVCM_ERROR
        assert d.route_source in (RouteSource.DOMAIN, RouteSource.SHADOW)
        assert d.elapsed_ms <= 20
        resolver = handle.leader_resolver()
        assert resolver is not None
        await trio.testing.wait_all_tasks_blocked()  # the resolver's task applies the invalidation
        with trio.fail_after(1):
            await resolver.leader()
        d2 = await handle.route(RouteRequest("moved2", token_ids=PROMPT, budget_ms=20))
        assert d2.route_source is RouteSource.KVCM and d2.worker == cluster.worker_addr(2)


async def test_anytime_decision_uses_the_answers_in_hand(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        for i, delay in enumerate((0.001, 0.002, 0.003, 0.100)):
            seed(cluster, i, 8 - i)  # every worker is a hot candidate
            cluster.workers[i].set_faults(WorkerFaults(delay_s=delay))
        d = await handle.route(RouteRequest("any", token_ids=PROMPT, budget_ms=10))
        assert d.elapsed_ms <= 10
        assert d.route_source is RouteSource.KVCM
        scored = [c for c in d.candidates if c.dropped is None]
        dropped = {c.target: c.dropped for c in d.candidates if c.dropped is not None}
        assert len(scored) == 3
        assert dropped == {cluster.worker_addr(3).http_target: "probe_skipped"}
        assert d.worker == cluster.worker_addr(0)


async def test_a_candidate_whose_probe_is_cut_is_scored_with_the_status_in_hand(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The holder's status is no longer fresh, so it is probed, and that probe is still in flight at
    decide_at; the status in hand is younger than max_status_age_s and still scores it: the holder
    keeps its hit instead of being dropped for the missing answer."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, config):
        seed(cluster, 2, 8)
        holder = cluster.worker_addr(2)
        prober = handle.prober()
        await prober.probe([holder], trio.current_time() + 0.05).wait_all()
        await trio.sleep(config.prober.fresh_ttl_s)
        assert prober.cached(holder) is not None  # not fresh, yet usable for scoring
        cluster.workers[2].set_faults(WorkerFaults(delay_s=0.5))
        d = await handle.route(RouteRequest("cut", token_ids=PROMPT, budget_ms=20))
        assert d.route_source is RouteSource.KVCM and d.worker == holder and d.hit_tokens == len(PROMPT), d


def shadow_index(handle: RouterHandle) -> ShadowIndex:
    """The router's shadow index, written to directly to set up what it holds."""
    (shadow_source,) = [s for s in handle.router_actor()._chain if isinstance(s, ShadowSource)]
    return shadow_source._shadow.index


async def _ejected(handle: RouterHandle, network: MemoryNetwork, cluster: SimCluster, worker: WorkerAddr) -> None:
    """The fleet heard from, then ``worker`` stops answering probes and is probed until it is ejected
    (an outlier among workers known to answer, not a collective failure)."""
    prober = handle.prober()
    fleet = [cluster.worker_addr(i) for i in range(len(cluster.workers))]
    await prober.probe(fleet, trio.current_time() + 0.05).wait_all()
    await trio.sleep(1.0)  # the statuses in hand are no longer fresh: probed again
    network.stop(worker.status_target)
    for _ in range(3):
        await prober.probe([worker], trio.current_time() + 0.05).wait_all()
    assert worker.status_target in prober.snapshot().ejected_until


async def test_an_ejected_holder_leaves_the_only_hot_place_to_the_next_holder(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With one hot place and KVCM naming two holders, the deeper one ejected: the plan passes it over
    for the other, which is chosen with its hit (the ejected one in the place would be dropped after
    its probe was skipped, leaving no candidate)."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, scorer={"hot_set_size": 1, "cold_set_size": 0}) as (handle, network, _):
        seed(cluster, 1, 8)
        seed(cluster, 2, 4)
        await _ejected(handle, network, cluster, cluster.worker_addr(1))
        d = await handle.route(RouteRequest("ej", token_ids=PROMPT, budget_ms=50))
        assert d.route_source is RouteSource.KVCM, d
        assert d.worker == cluster.worker_addr(2) and d.hit_tokens == 4 * BLOCK


async def test_an_ejected_holder_leaves_the_only_hot_place_to_the_next_holder_in_the_shadow_index(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same when KVCM is down and the shadow index answers: its match takes only hosts that can
    take a hot place, so the ejected deeper holder does not crowd out the other."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, scorer={"hot_set_size": 1, "cold_set_size": 0}) as (handle, network, _):
        index, now = shadow_index(handle), trio.current_time()
        index.record(cluster.worker_addr(1).http_target, KEYS, now)
        index.record(cluster.worker_addr(2).http_target, KEYS[:4], now)
        await _ejected(handle, network, cluster, cluster.worker_addr(1))
        fault_the_leader(cluster, KvcmFaults(dead=True))
        d = await handle.route(RouteRequest("ej", token_ids=PROMPT, budget_ms=50))
        assert d.route_source is RouteSource.SHADOW, d
        assert d.worker == cluster.worker_addr(2) and d.hit_tokens == 4 * BLOCK


async def test_every_shadow_holder_up_to_the_hot_set_size_is_a_candidate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """KVCM is down and the shadow index answers: its match fills the whole hot set, not only the
    deepest holder, so the load still decides among the holders."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, scorer={"hot_set_size": 3, "cold_set_size": 0}) as (handle, _, _):
        index, now = shadow_index(handle), trio.current_time()
        for worker, blocks in ((1, 8), (2, 6), (3, 4)):
            index.record(cluster.worker_addr(worker).http_target, KEYS[:blocks], now)
        fault_the_leader(cluster, KvcmFaults(dead=True))
        d = await handle.route(RouteRequest("r", token_ids=PROMPT, budget_ms=50))
        assert d.route_source is RouteSource.SHADOW, d
        assert {c.target: c.local_blocks for c in d.candidates} == {
            cluster.worker_addr(1).http_target: 8,
            cluster.worker_addr(2).http_target: 6,
            cluster.worker_addr(3).http_target: 4,
        }


async def test_pdfusion_only_deployment_never_gets_prefill(autojump_clock: trio.testing.MockClock) -> None:
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 2 + [
        WorkerSpec(role="RoleType.PDFUSION", block_size=BLOCK)
    ] * 2
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PDFUSION,)) as (handle, _, _):
        seed(cluster, 0, 8)  # the best cache holder is a PREFILL worker
        seed(cluster, 2, 4)
        sources = set()
        passed_over: list[bool] = []
        for i in range(20):
            d = await handle.route(RouteRequest(f"p{i}", token_ids=PROMPT, budget_ms=20))
            sources.add(d.route_source)
            assert d.worker is not None
            # Whatever source answered, never a PREFILL worker.
            assert d.role is Role.PDFUSION
            assert d.worker in (cluster.worker_addr(2), cluster.worker_addr(3))
            dropped_roles = [c for c in d.candidates if c.dropped == "role_not_routed"]
            assert all(c.target != d.worker.http_target for c in dropped_roles)
            prefill_holder = cluster.worker_addr(0).http_target
            if d.route_source is RouteSource.KVCM:
                # The PREFILL holder of the longest prefix: dropped for its role after its probe while
                # its role was unknown; once known, by the plan (no hot slot, no probe): unfit.
                dropped = {c.target: c.dropped for c in d.candidates}[prefill_holder]
                assert dropped in ("role_not_routed", "unfit"), dropped
                passed_over.append(dropped == "unfit")
        assert RouteSource.KVCM in sources
        assert passed_over and passed_over[-1]


async def test_mixed_deployment_reports_the_workers_real_role(autojump_clock: trio.testing.MockClock) -> None:
    specs = [
        WorkerSpec(role="RoleType.PDFUSION", block_size=BLOCK),
        WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK),
    ]
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PREFILL, Role.PDFUSION)) as (handle, _, _):
        seed(cluster, 0, 8)
        d = await handle.route(RouteRequest("mixed", token_ids=PROMPT, budget_ms=20))
        assert d.route_source is RouteSource.KVCM
        assert d.worker == cluster.worker_addr(0) and d.role is Role.PDFUSION


async def test_answers_made_outside_the_chain_keep_the_roles_the_request_names(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A deadline or an overloaded answer drew from the deployment's roles: a request limited to
    PDFUSION was sent to a PREFILL worker exactly when the router was short of time."""
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 2
    specs += [WorkerSpec(role="RoleType.PDFUSION", block_size=BLOCK)] * 2
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PREFILL, Role.PDFUSION), max_in_flight=1) as (handle, _, _):
        workers = [cluster.worker_addr(i) for i in range(4)]
        handle.prober().probe(workers, trio.current_time() + 0.05)
        await trio.sleep(0.02)  # every worker's role is known
        pdfusion = set(workers[2:])
        answers = []
        for i in range(20):
            late = RouteRequest(f"z{i}", token_ids=PROMPT, budget_ms=0, roles=(Role.PDFUSION,))
            answers.append(await handle.route(late))
        async with trio.open_nursery() as burst:  # one place: the others are shed at once
            for i in range(20):

                async def one(i: int = i) -> None:
                    request = RouteRequest(f"o{i}", token_ids=PROMPT, budget_ms=50, roles=(Role.PDFUSION,))
                    answers.append(await handle.route(request))

                burst.start_soon(one)
        reasons = {d.reason for d in answers}
        assert {Reason.DEADLINE, Reason.OVERLOADED} <= reasons, reasons
        assert all(d.worker in pdfusion and d.role is Role.PDFUSION for d in answers), [
            (d.reason, d.role, d.worker) for d in answers if d.worker not in pdfusion
        ]


@asynccontextmanager
async def pdfusion_only_router() -> AsyncIterator[tuple[RouterHandle, list[WorkerAddr]]]:
    """A router for PDFUSION only, over two PREFILL workers and two PDFUSION ones (in that order),
    every worker's role known to it."""
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 2
    specs += [WorkerSpec(role="RoleType.PDFUSION", block_size=BLOCK)] * 2
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PDFUSION,)) as (handle, _, _):
        workers = [cluster.worker_addr(i) for i in range(4)]
        handle.prober().probe(workers, trio.current_time() + 0.05)
        await trio.sleep(0.02)  # every worker's role is known
        yield handle, workers


async def test_answers_made_outside_the_chain_draw_from_the_deployments_roles(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request naming no roles, answered outside the chain (its deadline gone, or a bad request), goes
    to a worker of the deployment's roles: a PDFUSION-only deployment never gets a PREFILL worker."""
    async with pdfusion_only_router() as (handle, workers):
        answers = [await handle.route(RouteRequest(f"z{i}", token_ids=PROMPT, budget_ms=0)) for i in range(20)]
        answers.append(await handle.route(RouteRequest("bad", budget_ms=50)))  # no prompt: bad_request
        assert {d.reason for d in answers} == {Reason.DEADLINE, Reason.BAD_REQUEST}
        assert all(d.worker in set(workers[2:]) and d.role is Role.PDFUSION for d in answers), [
            (d.reason, d.role, d.worker) for d in answers
        ]


async def test_answers_made_outside_the_chain_keep_only_the_named_roles_the_deployment_routes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request naming a role the deployment does not route is refused, late (no budget) or with no
    prompt, and its answer, made outside the chain, draws from the deployment's roles: the role it
    names is no worker's to give here."""
    async with pdfusion_only_router() as (handle, workers):
        answers = []
        for i in range(10):
            late = RouteRequest(f"z{i}", token_ids=PROMPT, budget_ms=0, roles=(Role.PREFILL,))
            answers.append(await handle.route(late))
            answers.append(await handle.route(RouteRequest(f"b{i}", token_ids=(), roles=(Role.PREFILL,))))
        assert {d.reason for d in answers} == {Reason.BAD_REQUEST}  # the role is not routed here
        assert all(d.worker in set(workers[2:]) and d.role is Role.PDFUSION for d in answers), [
            (d.reason, d.role, d.worker) for d in answers
        ]


async def test_a_domain_answer_labels_a_worker_with_its_last_reported_role_however_old(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Routability read the last status of any age, the label only a status young enough to score
    with: past max_status_age_s a PDFUSION worker was answered as the deployment's first role."""
    cluster = SimCluster(
        workers=[WorkerSpec(role="RoleType.PDFUSION", block_size=BLOCK)] * 3, kvcm_replicas=1, block_size=BLOCK
    )
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    roles = (Role.PREFILL, Role.PDFUSION)
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg, kvcm_fallback=False, roles=roles)
    async with open_router(config, rpc=network) as handle:
        workers = [cluster.worker_addr(i) for i in range(3)]
        handle.prober().probe(workers, trio.current_time() + 0.05)
        await trio.sleep(0.02)
        await trio.sleep(config.prober.max_status_age_s + 0.5)  # no probe since: too old to score with
        assert all(handle.prober().cached(w) is None for w in workers)
        for i in range(10):
            decision = await handle.route(RouteRequest(f"s{i}", token_ids=PROMPT, budget_ms=20))
            assert decision.route_source is RouteSource.DOMAIN and decision.role is Role.PDFUSION, decision


@pytest.mark.parametrize("score_unmatched", [False, True])
async def test_a_prompt_nobody_holds_goes_to_the_less_loaded_cold_worker_when_scored(
    autojump_clock: trio.testing.MockClock, score_unmatched: bool
) -> None:
    """KVCM answers that nobody holds the prompt and the shadow index has none: with the switch the
    cold set is scored (both workers of two, so the idle one wins); without it the domain draws."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    for i in range(20):  # worker 0 has a long queue
        cluster.workers[0].submit(f"bg{i}", 8000, 0, trio.current_time())
    async with routed(cluster, score_unmatched=score_unmatched) as (handle, _, _):
        picks = []
        for i in range(12):
            prompt = tuple(range(50_000 * (i + 1), 50_000 * (i + 1) + 8 * BLOCK))  # new every time
            d = await handle.route(RouteRequest(f"u{i}", token_ids=prompt, budget_ms=50))
            assert d.sources[0].reason is Reason.NO_POSITIVE_MATCH
            picks.append(d.worker)
            if score_unmatched:
                assert (d.route_source, d.reason) == (RouteSource.SHADOW, Reason.SHORTEST_TTFT_LOW_CACHE_HIT), d
            else:
                assert (d.route_source, d.reason) == (RouteSource.DOMAIN, Reason.NO_POSITIVE_MATCH)
        idle = picks.count(cluster.worker_addr(1))
        if score_unmatched:
            assert idle == len(picks)
        else:
            assert 0 < idle < len(picks)  # the domain's seeded draws take both


async def test_feature_off_is_plain_domain_routing(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg, kvcm_fallback=False)
    seed(cluster, 1, 8)
    async with open_router(config, rpc=network) as handle:
        assert handle.leader_resolver() is None
        chosen = []
        for i in range(200):
            d = await handle.route(RouteRequest(f"off{i}", token_ids=PROMPT, budget_ms=20))
            assert d.route_source is RouteSource.DOMAIN and d.reason is Reason.FEATURE_OFF
            chosen.append(d.worker)
        # No RPC of any kind: not to KVCM, not to a worker.
        assert network.call_count() == 0
        counts = {w: chosen.count(w) for w in set(chosen)}
        assert len(counts) == 4 and min(counts.values()) >= 25  # uniform random over discovery


async def test_a_request_with_no_time_left_on_arrival_is_answered_deadline_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No time at all (a budget of 0, the caller's deadline past) is answered ``deadline`` outside the
    chain, not hashed or walked: a source answering without a wait made it look routed in time (the
    domain's ``feature_off`` with the fallback off), and with the cap full it was shed ``overloaded``.
    A request its checks refuse is still told so."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg, kvcm_fallback=False)
    answers: list[RouteDecision] = []
    async with open_router(config, rpc=network) as handle:
        answers.append(await handle.route(RouteRequest("b0", token_ids=PROMPT, budget_ms=0)))
        past = trio.current_time() - 1.0
        answers.append(await handle.route(RouteRequest("past", token_ids=PROMPT, deadline=past)))
        refused = await handle.route(RouteRequest("bad", token_ids=(), budget_ms=0))
        assert refused.reason is Reason.BAD_REQUEST and (refused.error or "").startswith("token_ids")
    hung = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(hung, max_in_flight=1) as (handle, _, _):
        fault_the_leader(hung, KvcmFaults(hang=True))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.route, RouteRequest("holds-the-place", token_ids=PROMPT, budget_ms=1000))
            await trio.testing.wait_all_tasks_blocked()
            assert handle.router_actor().in_flight() == 1  # the cap is full
            answers.append(await handle.route(RouteRequest("full", token_ids=PROMPT, budget_ms=0)))
            health = handle.router_actor().health()
            nursery.cancel_scope.cancel()
        assert (health.deadline_fallbacks, health.overloaded) == (1, 0)
    for d in answers:
        assert (d.route_source, d.reason, d.sources) == (RouteSource.DOMAIN, Reason.DEADLINE, ()), d
        assert d.worker is not None


async def test_a_long_prompt_its_checks_refuse_is_refused_with_no_time_left_or_the_cap_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Refused outside the chain from the checks themselves, not by walking it: a long prompt is hashed
    in slices with checkpoints, and a deadline already past cut the hashing before it reached the bad
    id, so the request was answered ``deadline``. Under a full cap the walk ran without a place."""
    long_bad = (*range(1000, 1000 + 4095), 2**70)  # past hash_slice_tokens: hashed in slices
    hung = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(hung, max_in_flight=1) as (handle, _, _):
        router = handle.router_actor()
        assert len(long_bad) > LimitsConfig().hash_slice_tokens
        answers = [
            await handle.route(RouteRequest("b0", token_ids=long_bad, budget_ms=0)),
            await handle.route(RouteRequest("past", token_ids=long_bad, deadline=trio.current_time() - 1.0)),
        ]
        fault_the_leader(hung, KvcmFaults(hang=True))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(handle.route, RouteRequest("holds-the-place", token_ids=PROMPT, budget_ms=1000))
            await trio.testing.wait_all_tasks_blocked()
            assert router.in_flight() == 1  # the cap is full
            answers.append(await handle.route(RouteRequest("full", token_ids=long_bad, budget_ms=1000)))
            health = router.health()
            nursery.cancel_scope.cancel()
    for d in answers:
        assert (d.reason, d.sources) == (Reason.BAD_REQUEST, ()), d
        assert (d.error or "").startswith("token_ids: "), d
    assert (health.deadline_fallbacks, health.overloaded) == (0, 0)


async def test_a_loop_of_answers_made_without_io_lets_the_other_tasks_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With the fallback off every answer is the domain's, made without awaiting anything: a caller
    routing in a loop in one task must still yield every ANSWERS_PER_ROUND answers, or the metrics
    sink (and every other actor) waits for the whole loop (2,000 routes once made no round)."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg, kvcm_fallback=False)
    rounds = 4
    routes = rounds * router_actor.ANSWERS_PER_ROUND
    ran = 0
    done = trio.Event()

    async def another_task() -> None:
        nonlocal ran
        for _ in range(10 * routes):  # bounded: ends with the loop, or after this many rounds
            if done.is_set():
                return
            ran += 1
            await trio.lowlevel.checkpoint()

    async with open_router(config, rpc=network) as handle, trio.open_nursery() as nursery:
        nursery.start_soon(another_task)
        await trio.lowlevel.checkpoint()  # it has started
        before = ran
        for i in range(routes):
            d = await handle.route(RouteRequest(f"loop{i}", token_ids=PROMPT, budget_ms=20))
            assert d.route_source is RouteSource.DOMAIN and d.reason is Reason.FEATURE_OFF
        during = ran - before
        done.set()
        await trio.testing.wait_all_tasks_blocked()  # the sink has taken what the loop left
        peak = handle.metrics.snapshot().inbox_peak
    # A round every ANSWERS_PER_ROUND answers: neither none (the loop held the thread) nor one per
    # answer (each answer made after a wait would then wait a batch more).
    assert rounds - 1 <= during <= rounds + 1
    assert peak <= 2 * router_actor.ANSWERS_PER_ROUND  # the sink kept up: not the loop's all at once


async def test_a_cancelled_caller_gets_cancelled_before_anything_is_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A caller already cancelled is told so before its request is refused, shed or routed: the shed
    and the early refusal once counted the request and then raised Cancelled, losing the answer they
    had counted; made shielded, they then ran on for a cancelled caller looping over route() (two
    reviews). Nothing is counted, and the caller's scope catches its cancellation."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg, kvcm_fallback=False)
    async with open_router(config, rpc=network) as handle:
        for request in (
            RouteRequest("nan", token_ids=PROMPT, budget_ms=math.nan),  # refused before admission
            RouteRequest("ok", token_ids=PROMPT, budget_ms=20),  # the domain's answer
        ):
            with trio.CancelScope() as scope:
                scope.cancel()
                await handle.route(request)
                raise AssertionError("route() returned to a cancelled caller")  # pragma: no cover
            assert scope.cancelled_caught
        health = handle.router_actor().health()
        assert (health.handled, health.overloaded) == (0, 0)


@pytest.mark.parametrize("query_type", [QueryType.PREFIX_MATCH, QueryType.PREFIX_MATCH_WITH_MAMBA])
async def test_each_cache_query_carries_the_deployments_namespace_query_type_and_p2p_count(
    query_type: QueryType, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulated KVCM accepted any namespace and query type, so the step building each query from
    the configuration was checked by no test (wrong values there passed every test). A spy on
    the simulator reads what it was asked; a KVCM serving one namespace refuses another."""
    asked: list[kvcm_pb.GetHostCacheStateRequest] = []
    answer = SimKvcmCluster.answer

    def spy(self: SimKvcmCluster, node_id: str, method_path: str, request: bytes) -> bytes:
        if method_path == paths.KVCM_GET_HOST_CACHE_STATE:
            asked.append(kvcm_pb.GetHostCacheStateRequest.FromString(request))
        return answer(self, node_id, method_path, request)

    monkeypatch.setattr(SimKvcmCluster, "answer", spy)
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK, instance_id="ns_16")
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    base = make_config(addrs.kvcm_bootstrap, addrs.workers_arg)
    config = replace(
        base,
        deployment=replace(base.deployment, kvcm_instance_id="ns_16", query_type=query_type, p2p_host_count=3),
    )
    seed(cluster, 1, 8)
    async with open_router(config, rpc=network) as handle:
        decision = await handle.route(RouteRequest("asked", token_ids=PROMPT, budget_ms=50))
    (query,) = asked
    assert (query.instance_id, query.query_type, query.p2p_host_count, query.trace_id) == (
        "ns_16",
        query_type.value,
        3,
        "asked",
    )
    assert list(query.block_cache_keys) == list(KEYS)
    assert decision.sources[0].source is RouteSource.KVCM
    if query_type is QueryType.PREFIX_MATCH:  # the simulated workers' mode: full attention only
        assert decision.route_source is RouteSource.KVCM
    # Another deployment's namespace: the KVCM refuses it, and the request falls through.
    other = replace(config, deployment=replace(config.deployment, kvcm_instance_id="other_16"))
    async with open_router(other, rpc=network) as handle:
        refused = await handle.route(RouteRequest("other", token_ids=PROMPT, budget_ms=50))
    assert refused.route_source is not RouteSource.KVCM
    assert refused.sources[0].reason is Reason.KVCM_ERROR


async def test_what_kvcm_said_when_it_refused_a_query_is_shown_and_logged(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong instance id: KVCM refuses every query. Its words used to reach only a count (the
    breaker opening, the decisions saying kvcm_error); the resolver's snapshot now holds them, and
    the first of each logging interval is logged."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK, instance_id="ns_16")
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    base = make_config(addrs.kvcm_bootstrap, addrs.workers_arg)
    config = replace(base, deployment=replace(base.deployment, kvcm_instance_id="other_16"))
    with caplog.at_level(logging.WARNING, logger="actors.router_actor"):
        async with open_router(config, rpc=network) as handle:
            resolver = handle.leader_resolver()
            assert resolver is not None
            assert resolver.snapshot().last_query_error is None
            for i in range(3):
                decision = await handle.route(RouteRequest(f"wrong{i}", token_ids=PROMPT, budget_ms=50))
                assert decision.sources[0].reason is Reason.KVCM_ERROR
            await trio.testing.wait_all_tasks_blocked()
            snapshot = resolver.snapshot()
    assert snapshot.last_query_error is not None and "'other_16' does not exist" in snapshot.last_query_error
    assert snapshot.last_query_error_at is not None
    logged = [r.getMessage() for r in caplog.records if "kvcm_query_failed" in r.getMessage()]
    assert len(logged) == 1 and "'other_16' does not exist" in logged[0], logged


async def test_closing_answers_the_requests_in_flight_and_refuses_new_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Requests routing from tasks outside the ``open_router`` block when it ends used to meet the
    actors' teardown (their probes' waits, the Scorer gone) and be answered internal_error ("the
    Scorer is restarting"), counted as bugs; a request after the close was still answered. Now the
    close waits for those in flight (they end by their deadlines) and a request after it raises
    RouterClosed."""
    cluster = SimCluster(workers=3, kvcm_replicas=1, block_size=BLOCK)
    decisions: list[RouteDecision] = []
    async with trio.open_nursery() as callers:
        async with routed(cluster) as (handle, _, _):
            for worker in cluster.workers:
                worker.set_faults(WorkerFaults(delay_s=0.005))  # each request waits for its probes
            await trio.sleep(0.5)  # the statuses in hand are stale by now

            async def caller(i: int) -> None:
                decisions.append(await handle.route(RouteRequest(f"c{i}", token_ids=PROMPT, budget_ms=40)))

            for i in range(10):
                callers.start_soon(caller, i)
            await trio.sleep(0.002)
            assert handle.router_actor().in_flight() == 10
            closed_at = trio.current_time()
        assert trio.current_time() - closed_at <= 0.04  # no longer than their deadlines
    assert len(decisions) == 10 and all(d.worker is not None for d in decisions), decisions
    assert Reason.INTERNAL_ERROR not in {d.reason for d in decisions}, decisions
    assert handle.router_actor().health().internal_errors == 0
    with pytest.raises(RouterClosed, match="the router is closed"):
        await handle.route(RouteRequest("after", token_ids=PROMPT, budget_ms=40))


def test_feature_off_does_not_hash_token_ids() -> None:
    """Nothing uses keys with the fallback off, so a long prompt costs no hashing; the request is
    still validated and its length still counts (seq_len feeds the domain pre-charge)."""
    deployment = replace(DeploymentConfig(), block_size=BLOCK)
    request = RouteRequest("off", token_ids=PROMPT)
    hashed = prepare_request(request, deployment)
    skipped = prepare_request(request, deployment, hash_tokens=False)
    assert hashed.keys and skipped.keys == ()
    assert skipped.seq_len == hashed.seq_len == len(PROMPT)
    with pytest.raises(BadRequest, match="token_ids"):
        prepare_request(RouteRequest("off", token_ids=()), deployment, hash_tokens=False)


async def test_a_shadow_miss_is_logged_with_its_reason_what_it_means_and_the_request(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    shadow = ShadowIndexActor(ShadowConfig())  # empty: it matches nothing
    warn = AggregatingLogger(logging.getLogger("t.shadow"), interval_s=60.0, max_keys=8)
    class NothingToScore:
        def plannable(self) -> Callable[[str], bool]:
            return lambda host: True

    scoring: Any = NothingToScore()
    sink = MetricsSink(MetricsConfig())
    source = ShadowSource(KvrouteConfig(), shadow=shadow, scoring=scoring, metrics=sink, warn=warn)
    prepared = prepare_request(RouteRequest("r7", token_ids=PROMPT), DeploymentConfig(block_size=BLOCK))
    windows = SplitWindows(0.045, 0.045, 0.045, SplitMode.FIXED)
    ctx = RequestContext(RouteRequest("r7", token_ids=PROMPT), prepared, 0.0, 0.05, RequestSplit(windows))
    ctx.fallthrough = Reason.BREAKER_OPEN
    with caplog.at_level(logging.WARNING, logger="t.shadow"):
        result = await source.attempt(ctx)
    assert isinstance(result, FellThrough) and result.reason is Reason.BREAKER_OPEN
    (record,) = caplog.records
    assert record.getMessage() == "breaker_open: the shadow index matched no worker either: the domain source answers"
    assert record.__dict__["kvroute_context"] == {"reason": "breaker_open", "request_id": "r7"}


async def test_shadow_records_of_workers_gone_from_discovery_do_not_crowd_out_a_live_holder(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """KVCM is unreachable, so the shadow index answers. Workers that left discovery (a rolling
    restart with new addresses) still hold the whole prompt there until their records expire; a live
    worker holds its first blocks. They must not take the hot places of the live holder."""
    cluster = SimCluster(workers=6, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config("10.99.0.1:6381", addrs.workers_arg)  # nothing serves KVCM there
    config = replace(config, scorer=replace(config.scorer, hot_set_size=2, cold_set_size=1))
    async with open_router(config, rpc=network) as handle:
        index, now = shadow_index(handle), trio.current_time()
        live = cluster.worker_addr(4)
        index.record(live.http_target, KEYS[:3], now)
        for i in range(3):  # deeper holders that left discovery
            index.record(f"10.9.0.{i + 1}:8000", KEYS, now)
        d = await handle.route(RouteRequest("r", token_ids=PROMPT, budget_ms=50))
        assert d.route_source is RouteSource.SHADOW and d.worker == live and d.hit_tokens == 3 * BLOCK, d


async def test_records_the_shadow_index_cannot_take_are_counted(autojump_clock: trio.testing.MockClock) -> None:
    shadow = ShadowIndexActor(replace(ShadowConfig(), inbox_size=1))  # not running: its inbox holds one record
    sink = MetricsSink(MetricsConfig())
    warn = AggregatingLogger(logging.getLogger("t"), interval_s=60.0, max_keys=8)
    scoring: Any = None  # the shadow's write-on-route never scores
    source = ShadowSource(KvrouteConfig(), shadow=shadow, scoring=scoring, metrics=sink, warn=warn)
    prepared = prepare_request(RouteRequest("r", token_ids=PROMPT), DeploymentConfig(block_size=BLOCK))
    windows = SplitWindows(0.045, 0.045, 0.045, SplitMode.FIXED)
    ctx = RequestContext(RouteRequest("r", token_ids=PROMPT), prepared, 0.0, 0.05, RequestSplit(windows))
    worker = WorkerAddr.from_http("10.0.0.1", 8000)
    answered = RouteDecision("r", worker, Role.PREFILL, RouteSource.DOMAIN, Reason.BREAKER_OPEN)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for _ in range(4):  # write-on-route after each reply: the first fits, three are dropped
            source.after_reply(ctx, answered)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert shadow.health().dropped == 3
    assert sink.registry.get_sample_value("kvroute_shadow_records_dropped_total") == 3


async def test_over_the_admission_cap_answers_at_once(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, max_in_flight=1) as (handle, _, _):
        fault_the_leader(cluster, KvcmFaults(delay_s=0.010))
        seed(cluster, 0, 8)
        results = []

        async def one(i: int) -> None:
            start = trio.current_time()
            d = await handle.route(RouteRequest(f"o{i}", token_ids=PROMPT, budget_ms=40))
            results.append((trio.current_time() - start, d))

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(one, i)
        overloaded = [(t, d) for t, d in results if d.reason is Reason.OVERLOADED]
        assert 1 <= len(overloaded) <= 9
        assert all(t == 0 and d.route_source is RouteSource.DOMAIN for t, d in overloaded)
        assert len(results) == 10


async def test_bad_request_still_gets_an_answer(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        d = await handle.route(RouteRequest("bad", token_ids=PROMPT, block_cache_keys=KEYS))
        assert d.reason is Reason.BAD_REQUEST and d.route_source is RouteSource.DOMAIN
        assert d.worker is not None and d.error is not None and "token_ids" in d.error
        d = await handle.route(RouteRequest("bad2", block_cache_keys=(2**63,), block_size=16))
        assert d.reason is Reason.BAD_REQUEST and d.error is not None and "block_cache_keys" in d.error
        d = await handle.route(RouteRequest("bad3", token_ids=PROMPT, roles=(Role.DECODE,)))
        assert d.reason is Reason.BAD_REQUEST and d.error is not None and "roles" in d.error


class _NoTruthValue:
    """A value whose truth is undefined (as a numpy array of two elements): asking raises."""

    def __bool__(self) -> bool:
        raise ValueError("the truth value is ambiguous")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"budget_ms": "50"}, "budget_ms"),
        ({"budget_ms": math.nan}, "budget_ms"),
        ({"budget_ms": math.inf}, "budget_ms"),
        ({"budget_ms": -5.0}, "budget_ms"),
        ({"budget_ms": 10**400}, "budget_ms"),
        ({"budget_ms": 10**5000}, "budget_ms"),
        ({"deadline": 10**400}, "deadline"),
        ({"block_size": 10**5000}, "block_size"),
        ({"roles": (Role.PREFILL,) * 65}, "roles"),
        ({"token_ids": range(8)}, "token_ids"),
        ({"deadline": "soon"}, "deadline"),
        ({"deadline": math.nan}, "deadline"),
        ({"request_id": None}, "request_id"),
        ({"seq_len": 12.5}, "seq_len"),
        ({"token_ids": "abc"}, "token_ids"),
        ({"roles": ("PREFILL",)}, "roles"),
        ({"roles": _NoTruthValue()}, "roles"),
        ({"request_id": "lone\udc80surrogate"}, "request_id"),
        # Hashed with the fallback on: an id beyond 64 bits (the rtp family truncates to 32), and one
        # after the last whole block (hashed by no key) passed as a well-formed prompt.
        ({"token_ids": (2**70,) * (2 * BLOCK)}, "token_ids"),
        ({"token_ids": (*range(BLOCK), "x")}, "token_ids"),
        ({"token_ids": (*range(BLOCK), -(2**80))}, "token_ids"),
    ],
)
async def test_a_field_of_the_wrong_type_or_value_is_refused_naming_it(
    autojump_clock: trio.testing.MockClock, fields: dict[str, object], named: str
) -> None:
    """A caller of the Python API can pass anything: the answer is bad_request naming the field, at once,
    never an exception (the deadline itself is computed from these fields)."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        request = replace(RouteRequest("typed", token_ids=PROMPT), **fields)  # type: ignore[arg-type]
        start = trio.current_time()
        d = await handle.route(request)
        assert d.reason is Reason.BAD_REQUEST and d.error is not None and d.error.startswith(f"{named}:"), d.error
        assert isinstance(d.request_id, str)
        assert trio.current_time() == start


@pytest.mark.parametrize("length", [BLOCK - 1, BLOCK, 2 * BLOCK])
async def test_with_a_lookahead_the_ids_no_key_covers_are_checked_too(
    autojump_clock: trio.testing.MockClock, length: int
) -> None:
    """sglang with a lookahead of one hashes (N - 1) // block_size pages: at a whole number of blocks the
    last block's ids after its first were neither hashed nor checked (one block: none of them)."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg)
    config = replace(config, deployment=replace(config.deployment, key_family=KeyFamily.SGLANG, lookahead_tokens=1))
    async with open_router(config, rpc=network) as handle:
        d = await handle.route(RouteRequest("odd", token_ids=(*range(length - 1), "x"), budget_ms=50))  # type: ignore[arg-type]
        assert d.reason is Reason.BAD_REQUEST and (d.error or "").startswith("token_ids:"), d


async def test_a_bad_request_with_no_worker_to_name_is_still_bad_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryNetwork()
    config = make_config("", "", kvcm_fallback=False)
    async with open_router(config, rpc=network) as handle:
        d = await handle.route(RouteRequest("", token_ids=PROMPT))
        assert d.reason is Reason.BAD_REQUEST and d.route_source is RouteSource.NONE
        assert d.error is not None and d.error.startswith("request_id:") and "no worker" in d.error


async def test_caller_keys_pass_through(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=3, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 1, 8)
        d = await handle.route(RouteRequest("keys", block_cache_keys=KEYS, block_size=BLOCK, budget_ms=20))
        assert d.route_source is RouteSource.KVCM and d.worker == cluster.worker_addr(1)
        assert d.hit_tokens == 8 * BLOCK


async def test_no_workers_is_route_source_none(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=1, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config(addrs.kvcm_bootstrap, "")
    async with open_router(config, rpc=network) as handle:
        d = await handle.route(RouteRequest("none", token_ids=PROMPT, budget_ms=10))
        assert d.route_source is RouteSource.NONE and d.worker is None
        assert d.error is not None and "discovery" in d.error
        assert handle.ready() == (False, "discovery has no worker")


async def test_readiness_with_no_worker_says_which_worker_source_fails_and_why(tmp_path: Path) -> None:
    """It said "discovery has no worker" alone: a workers file with a bad entry had emptied the list,
    and only /debug/actors showed why."""
    cluster = SimCluster(workers=1, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    bad = tmp_path / "workers.txt"
    bad.write_text("not-an-addr:xx\n")
    config = make_config(addrs.kvcm_bootstrap, "")
    config = replace(config, discovery=replace(config.discovery, workers_file=str(bad)))
    with trio.fail_after(10):
        async with open_router(config, rpc=network) as handle:
            ready, why = handle.ready()
    assert not ready and why.startswith(f"discovery has no worker (workers.file {bad}: "), why
    assert "xx" in why and why.count(str(bad)) == 1, why


async def test_burst_spreads_with_precharge(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    # The Scorer decides what is queued in one batch, so up to all 200 decisions (several events each) can
    # land in one scheduling round: the inbox holds a round's events and the sink drains them in batches.
    async with routed(cluster, metrics_inbox=1024) as (handle, _, _):
        for i in range(4):
            seed(cluster, i, 8)
        chosen = []
        async with trio.open_nursery() as nursery:

            async def one(i: int) -> None:
                d = await handle.route(RouteRequest(f"b{i}", token_ids=PROMPT, budget_ms=40))
                chosen.append(d.worker)

            for i in range(200):
                nursery.start_soon(one, i)
        counts = {w: chosen.count(w) for w in set(chosen)}
        assert len(counts) == 4
        assert max(counts.values()) <= 80 and min(counts.values()) >= 20
        # Telemetry kept up with the burst (several events per decision, none dropped).
        await trio.testing.wait_all_tasks_blocked()
        sink = handle.metrics.snapshot()
        assert sink.dropped == 0
        assert sink.processed >= 200


async def test_bootstrap_dead_at_start_is_ready_for_domain_routing(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    for target in addrs.kvcm_targets:
        network.stop(target)  # every bootstrap target refuses
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg)
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)  # the first lookup round fails in the background
        ready, why = handle.ready()
        assert ready and "domain fallback" in why
        before = network.call_count()
        start = trio.current_time()
        d = await handle.route(RouteRequest("dead", token_ids=PROMPT, budget_ms=20))
        assert trio.current_time() - start == 0  # backing off: no RPC, no wait
        assert network.call_count() == before
        assert d.route_source is RouteSource.DOMAIN and d.reason is Reason.KVCM_ERROR


async def test_a_leader_failover_leaves_the_router_ready_while_it_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Unready while the leader was looked up again (every router sees the same failover, so the whole
    fleet would go NOT_SERVING at once), though every request was answered within its budget."""
    cluster = SimCluster(workers=3, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 1, 8)
        assert handle.ready()[0]
        fault_the_leader(cluster, KvcmFaults(hang=True))
        seen: set[str] = set()
        unready: list[str] = []

        async def watch(stop: trio.Event) -> None:
            while not stop.is_set():
                ready, why = handle.ready()
                seen.add(why.split(" (")[0])
                if not ready:
                    unready.append(why)
                await trio.sleep(0.001)

        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            nursery.start_soon(watch, stop)
            for i in range(40):
                started = trio.current_time()
                await handle.route(RouteRequest(f"f{i}", token_ids=PROMPT, budget_ms=30))
                assert trio.current_time() - started <= 0.030
                await trio.sleep(0.01)
            stop.set()
        assert not unready, unready
        assert "KVCM leader being looked up again" in seen  # the failover was watched through


async def test_a_decode_worker_does_not_make_a_router_ready_whose_prefill_workers_cannot_serve(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Readiness asked for a routable worker of the deployment's roles, DECODE included, though a
    request's worker is always a prefill-capable one: live decode workers kept it ready while every
    request ended no_candidates."""
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 2 + [
        WorkerSpec(role="RoleType.DECODE", block_size=BLOCK)
    ] * 2
    cluster = SimCluster(specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PREFILL, Role.DECODE), health_interval_s=0.5) as (handle, _, _):
        await trio.sleep(1.2)
        assert handle.ready()[0]
        for i in (0, 1):
            cluster.workers[i].set_faults(WorkerFaults(not_alive=True))
        await trio.sleep(1.2)
        ready, why = handle.ready()
        assert not ready and "2 reporting themselves not alive, 2 reporting another role" in why, why
        d = await handle.route(RouteRequest("r", token_ids=PROMPT, budget_ms=50))
        assert d.reason is Reason.NO_CANDIDATES and d.worker is None
        for i in (0, 1):
            cluster.workers[i].set_faults(WorkerFaults())
        await trio.sleep(1.2)
        assert handle.ready()[0]


@asynccontextmanager
async def no_bootstrap_router(tmp_path: Path) -> AsyncIterator[RouterHandle]:
    """A router whose KVCM bootstrap file is not written yet (discovery knows no KVCM target), its
    first discovery round done."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config("", addrs.workers_arg)
    discovery = replace(config.discovery, kvcm_bootstrap_file=str(tmp_path / "kvcm.txt"))
    async with open_router(replace(config, discovery=discovery), rpc=network) as handle:
        await trio.sleep(1.0)
        yield handle


async def test_no_bootstrap_target_yet_is_ready_for_domain_routing(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    async with no_bootstrap_router(tmp_path) as handle:
        ready, why = handle.ready()
        assert ready and "no_bootstrap" in why and "domain fallback" in why


async def test_no_bootstrap_target_falls_through_kvcm_as_no_leader(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """No KVCM target known yet is no leader elected, as the decision records it: not a KVCM error."""
    async with no_bootstrap_router(tmp_path) as handle:
        d = await handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        kvcm_step = d.sources[0]
        assert (kvcm_step.source, kvcm_step.outcome) == (RouteSource.KVCM, SourceOutcome.FELL_THROUGH)
        assert kvcm_step.reason is Reason.NO_LEADER
        assert d.worker is not None


async def test_companions_are_the_less_loaded_of_two_drawn_and_a_redraw_walks_the_fleet_once(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overloaded answers drawn ahead name, for the decode role, the less loaded of two decode
    workers drawn at random: never the most loaded of all, and their sixteen draws read each worker's
    status once, not once per draw."""
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 2 + [
        WorkerSpec(role="RoleType.DECODE", block_size=BLOCK, prefill_tokens_per_s=1.0)
    ] * 6
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PREFILL, Role.DECODE)) as (handle, _, _):
        router = handle.router_actor()
        prober = handle.prober()
        fleet = [cluster.worker_addr(i) for i in range(8)]
        decode = set(fleet[2:])

        async def loaded(tasks: dict[int, int]) -> None:
            """Give decode worker ``i`` ``tasks[i]`` requests (a minute of prefill each) and bring every status
            afresh."""
            for i, n in tasks.items():
                for j in range(n):
                    cluster.workers[i].submit(f"w{i}-{j}", 64, 0, trio.current_time())
            await trio.sleep(1.0)  # the statuses in hand are no longer fresh: probed again
            await prober.probe(fleet, trio.current_time() + 0.05).wait_all()

        def picked(answers: tuple[RouteDecision, ...]) -> set[str]:
            return {f"{a.ip}:{a.http_port}" for d in answers for a in d.role_addrs if a.role is Role.DECODE}

        reads = 0
        cached = prober.cached
        aged: set[WorkerAddr] = set()  # statuses aged out since (the view the walk was kept for unchanged)

        def counted(worker: WorkerAddr) -> WorkerStatus | None:
            nonlocal reads
            reads += worker in decode  # the domain draw reads prefill workers' only
            return None if worker in aged else cached(worker)

        monkeypatch.setattr(prober, "cached", counted)
        await loaded({2: 3, 3: 1, 4: 2, 5: 1})  # 6 and 7 idle
        reads = 0
        answers = router._draw_overload_answers()
        assert len(answers) == router_actor.OVERLOAD_DRAWS
        assert reads <= len(decode) + router_actor.OVERLOAD_DRAWS  # one walk, then one check per pick
        names = picked(answers)
        assert fleet[2].http_target not in names  # the most loaded loses every pair it is drawn in
        assert names & {fleet[6].http_target, fleet[7].http_target}  # 16 draws: an idle one was drawn
        # Not only the idle two: the next refresh of these statuses is a health probe's, and a burst
        # until then would all go to them.
        assert names - {fleet[6].http_target, fleet[7].http_target}
        aged.update(fleet[i] for i in (2, 3, 4, 5, 7))  # aged out since: the kept walk still names them
        assert picked(router._draw_overload_answers()) == {fleet[6].http_target}  # noticed at the pick


async def test_a_decode_worker_with_requests_running_is_not_the_companion_beside_an_idle_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A decode worker's requests are running (decoding) with no uncached tokens left and none waiting:
    ranked by uncached tokens and waiting tasks alone, one with twenty running tied with an idle one and
    was named as often."""
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 2 + [
        WorkerSpec(role="RoleType.DECODE", block_size=BLOCK)
    ] * 2
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PREFILL, Role.DECODE)) as (handle, _, _):
        busy, idle = cluster.worker_addr(2), cluster.worker_addr(3)
        for j in range(20):  # long outputs: decoding for the whole test
            cluster.workers[2].submit(f"busy{j}", 64, 0, trio.current_time(), output_tokens=1_000_000)
        await trio.sleep(1.0)
        await handle.prober().probe([busy, idle], trio.current_time() + 0.05).wait_all()
        running = handle.prober().cached(busy)
        assert running is not None and len(running.running) == 20
        assert (running.outstanding_uncached_tokens, running.waiting_count) == (0, 0)
        seed(cluster, 1, 8)
        for n in range(10):
            d = await handle.route(RouteRequest(f"pd{n}", token_ids=PROMPT, budget_ms=50))
            (decode,) = [a for a in d.role_addrs if a.role is Role.DECODE]
            assert (decode.ip, decode.http_port) == (idle.ip, idle.http_port), d


async def test_prefill_decode_separation_names_a_decode_worker_beside_the_cache_pick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 3 + [
        WorkerSpec(role="RoleType.DECODE", block_size=BLOCK)
    ] * 2
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PREFILL, Role.DECODE)) as (handle, _, _):
        seed(cluster, 1, 8)
        decode_workers = {cluster.worker_addr(3), cluster.worker_addr(4)}
        prober = handle.prober()
        for _ in range(20):  # statuses arrive as probes are made; the decode workers are known once probed
            handle.prober().probe(list(decode_workers), trio.current_time() + 0.05)
            await trio.sleep(0.01)
            if all(prober.cached(w) is not None for w in decode_workers):
                break
        decision = await handle.route(RouteRequest("pd1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.KVCM and decision.worker == cluster.worker_addr(1)
        roles = {a.role: a for a in decision.role_addrs}
        assert set(roles) == {Role.PREFILL, Role.DECODE}
        decode = roles[Role.DECODE]
        assert (decode.ip, decode.http_port) in {(w.ip, w.http_port) for w in decode_workers}
        # A companion role named twice is one address (it used to come back twice).
        twice = RouteRequest("pd3", token_ids=PROMPT, budget_ms=50, roles=(Role.PREFILL, Role.DECODE, Role.DECODE))
        assert [a.role for a in (await handle.route(twice)).role_addrs] == [Role.PREFILL, Role.DECODE]
        # A request may not ask for a companion role alone.
        bad = await handle.route(RouteRequest("pd2", token_ids=PROMPT, budget_ms=50, roles=(Role.DECODE,)))
        assert bad.reason is Reason.BAD_REQUEST and bad.error is not None and "prefill-capable" in bad.error


async def test_a_request_naming_prefill_and_vit_gets_a_vit_worker_beside_the_cache_pick(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """VIT is a companion role as DECODE is: one address of it beside the prefill pick."""
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 3 + [
        WorkerSpec(role="RoleType.DECODE", block_size=BLOCK),
        WorkerSpec(role="RoleType.VIT", block_size=BLOCK),
    ]
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PREFILL, Role.DECODE, Role.VIT)) as (handle, _, _):
        seed(cluster, 1, 8)
        vit_worker = cluster.worker_addr(4)
        prober = handle.prober()
        for _ in range(20):  # the VIT worker is known once probed
            prober.probe([vit_worker], trio.current_time() + 0.05)
            await trio.sleep(0.01)
            if prober.cached(vit_worker) is not None:
                break
        request = RouteRequest("pv1", token_ids=PROMPT, budget_ms=50, roles=(Role.PREFILL, Role.VIT))
        decision = await handle.route(request)
        assert decision.route_source is RouteSource.KVCM and decision.worker == cluster.worker_addr(1)
        assert [a.role for a in decision.role_addrs] == [Role.PREFILL, Role.VIT]
        vit = decision.role_addrs[1]
        assert (vit.ip, vit.http_port) == (vit_worker.ip, vit_worker.http_port)


async def test_a_decode_worker_saying_it_is_not_alive_is_never_the_companion_however_idle(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The idle decode worker says alive=false, the other has a task: the decode address beside the
    prefill pick names the live one, not the least loaded."""
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 3 + [
        WorkerSpec(role="RoleType.DECODE", block_size=BLOCK, prefill_tokens_per_s=1.0)
    ] * 2
    cluster = SimCluster(workers=specs, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, roles=(Role.PREFILL, Role.DECODE)) as (handle, _, _):
        idle, busy = cluster.worker_addr(3), cluster.worker_addr(4)
        cluster.workers[3].set_faults(WorkerFaults(not_alive=True))
        cluster.workers[4].submit("busy", 64, 0, trio.current_time())
        await handle.prober().probe([idle, busy], trio.current_time() + 0.05).wait_all()
        seed(cluster, 1, 8)
        for n in range(5):
            d = await handle.route(RouteRequest(f"pd{n}", token_ids=PROMPT, budget_ms=50))
            (decode,) = [a for a in d.role_addrs if a.role is Role.DECODE]
            assert (decode.ip, decode.http_port) == (busy.ip, busy.http_port), d


# --- readiness and routing tell the truth about workers ------------------------------------------


async def test_cold_places_go_to_workers_of_the_requests_roles_not_to_decode_workers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Prefill/decode: two prefill workers, six decode ones, every role known from health probes. The
    cache holder is busy; the idle prefill worker must be found cold, not crowded out by decode workers
    that the Scorer would drop after their probes."""
    specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 2
    specs += [WorkerSpec(role="RoleType.DECODE", block_size=BLOCK)] * 6
    cluster = SimCluster(specs, kvcm_replicas=1, block_size=BLOCK)
    for i in range(40):  # prefill worker 0, the holder, has a long queue
        cluster.workers[0].submit(f"bg{i}", 8000, 0, trio.current_time())
    async with routed(cluster, roles=(Role.PREFILL, Role.DECODE), health_interval_s=0.5) as (handle, _, _):
        await trio.sleep(2.0)  # health probes: every worker's role is known
        seed(cluster, 0, 2)
        d = await handle.route(RouteRequest("r", token_ids=PROMPT, budget_ms=50))
        assert d.worker == cluster.worker_addr(1) and d.reason is Reason.SHORTEST_TTFT, d
        assert not [c for c in d.candidates if c.dropped == DropReason.ROLE_NOT_ROUTED.value]


async def test_every_worker_dead_is_no_candidates_and_not_ready(autojump_clock: trio.testing.MockClock) -> None:
    """Closed ports everywhere: no decision names a dead worker, and readiness says why."""
    cluster = SimCluster(workers=3, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, health_interval_s=1.0) as (handle, network, _):
        await trio.sleep(1.0)  # the background health probes have heard from every worker
        assert handle.ready()[0]
        for i in range(3):
            network.stop(cluster.worker_addr(i).status_target)
        await trio.sleep(2.0)
        ready, why = handle.ready()
        assert not ready
        assert why.startswith("no routable worker: none of the 3 discovered workers can take a request")
        assert "--route-blind" in why
        seed(cluster, 0, 8)
        for i in range(5):
            d = await handle.route(RouteRequest(f"dead{i}", token_ids=PROMPT, budget_ms=20))
            assert d.worker is None and d.route_source is RouteSource.NONE
            assert d.reason is Reason.NO_CANDIDATES
            assert d.error is not None and "no routable worker" in d.error
        d = await handle.route(RouteRequest("bad", token_ids=PROMPT, roles=(Role.DECODE,)))
        assert d.reason is Reason.BAD_REQUEST and d.error is not None and "roles" in d.error
        for i in range(3):  # back: the next good health probe readmits each
            network.serve(cluster.worker_addr(i).status_target, memory_handler(cluster.workers[i]))
        await trio.sleep(2.0)  # heard from within the last interval are not due: at most two intervals
        assert handle.ready()[0]
        d = await handle.route(RouteRequest("back", token_ids=PROMPT, budget_ms=20))
        assert d.worker is not None


async def test_workers_reporting_themselves_not_alive_get_no_request_while_one_alive_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Three of four workers say alive=false: the domain source drew them (most of the domain
    answers), as they counted routable, and the cold set filled with them, to be dropped."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, health_interval_s=0.5) as (handle, _, _):
        for i in (0, 1, 2):
            cluster.workers[i].set_faults(WorkerFaults(not_alive=True))
        await trio.sleep(1.2)  # the health passes have read every status
        targets: list[str] = []
        for phase in ("kvcm answers", "kvcm down"):
            if phase == "kvcm down":
                fault_the_leader(cluster, KvcmFaults(dead=True))
            for n in range(20):
                prompt = tuple(range(n * 1000, n * 1000 + 8 * BLOCK))  # nobody holds it
                decision = await handle.route(RouteRequest(f"{phase}{n}", token_ids=prompt, budget_ms=50))
                assert decision.worker is not None
                targets.append(decision.worker.http_target)
                await trio.sleep(0.01)
        assert set(targets) == {cluster.worker_addr(3).http_target}


async def test_feature_off_avoids_dead_workers_found_by_health_probes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg, kvcm_fallback=False, health_interval_s=1.0)
    async with open_router(config, rpc=network) as handle:
        dead = cluster.worker_addr(1)
        network.stop(dead.status_target)
        await trio.sleep(1.5)
        before = network.call_count()
        chosen = [(await handle.route(RouteRequest(f"off{i}", token_ids=PROMPT))).worker for i in range(100)]
        assert network.call_count() == before  # nothing probed on the request path
        assert dead not in chosen and len(set(chosen)) == 3
        assert handle.ready() == (True, "domain routing (KVCM fallback off)")


async def test_unprobed_workers_are_routed_to_at_start(autojump_clock: trio.testing.MockClock) -> None:
    """Before any probe nothing says a worker is down: it is routable and the router is ready."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = make_config(addrs.kvcm_bootstrap, addrs.workers_arg, kvcm_fallback=False)
    async with open_router(config, rpc=network) as handle:
        assert handle.ready()[0]
        d = await handle.route(RouteRequest("early", token_ids=PROMPT))
        assert d.worker is not None and d.route_source is RouteSource.DOMAIN


async def test_route_blind_routes_to_dead_workers_and_stays_ready(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, health_interval_s=1.0, route_blind=True) as (handle, network, _):
        for i in range(2):
            network.stop(cluster.worker_addr(i).status_target)
        await trio.sleep(2.0)
        prober = handle.prober()
        assert not any(prober.is_routable(cluster.worker_addr(i)) for i in range(2))
        assert handle.ready()[0]
        d = await handle.route(RouteRequest("blind", token_ids=PROMPT, budget_ms=20))
        assert d.route_source is RouteSource.DOMAIN and d.worker is not None


async def test_kvcm_freeze_opens_the_breaker_through_leader_waits(autojump_clock: trio.testing.MockClock) -> None:
    """KVCM frozen: the first query times out and invalidates the leader; the requests that then
    wait for a lookup that cannot succeed count as KVCM failures, so the breaker opens and later
    requests no longer wait for the leader."""
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 0, 8)
        for node in cluster.kvcm.node_ids:
            cluster.kvcm.set_faults(node, KvcmFaults(hang=True))
        decisions = []
        for i in range(12):  # 12 × 30 ms: well within one lookup round (lookup_timeout_s 0.5 s)
            decisions.append(await handle.route(RouteRequest(f"frozen{i}", token_ids=PROMPT, budget_ms=30)))
            await trio.testing.wait_all_tasks_blocked()  # the next request comes after the resolver applied this one
        resolver = handle.leader_resolver()
        assert resolver is not None
        snap = resolver.snapshot()
        assert snap.breaker.state is BreakerState.OPEN
        assert snap.leader_misses_total == 4  # with the timed-out query, the failure threshold (5)
        waited = [d for d in decisions if Stage.LEADER in d.stage_ms and d.stage_ms[Stage.LEADER] > 0]
        assert [d.reason for d in waited] == [Reason.DEADLINE] * 4
        for d in decisions[5:]:  # the KVCM source falls through at once: no leader wait
            assert d.sources[0].reason is Reason.BREAKER_OPEN and Stage.LEADER not in d.stage_ms
        assert all(d.elapsed_ms == 0 for d in decisions[5:])


async def test_leader_waits_cut_short_by_tight_budgets_are_not_judged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=3, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 0, 8)
        for node in cluster.kvcm.node_ids:
            cluster.kvcm.set_faults(node, KvcmFaults(hang=True))
        await handle.route(RouteRequest("first", token_ids=PROMPT, budget_ms=30))  # invalidates the leader
        await trio.testing.wait_all_tasks_blocked()  # applied by the resolver's task
        for i in range(10):  # 5 ms budgets: each wait is allowed less than slow_query_ms (10 ms)
            d = await handle.route(RouteRequest(f"tight{i}", token_ids=PROMPT, budget_ms=5))
            assert d.reason is Reason.DEADLINE
        resolver = handle.leader_resolver()
        assert resolver is not None
        snap = resolver.snapshot()
        assert snap.breaker.state is BreakerState.CLOSED and snap.leader_misses_total == 0
        assert snap.queries_cut_short_total == 10


async def test_a_bug_on_the_request_path_is_answered_counted_and_logged_once_per_window(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy that raises: every request still gets the domain's answer (internal_error); the
    traceback is logged once per aggregation window, by the Scorer and by the router, not per request."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("policy bug")

    async with routed(cluster) as (handle, _, config):
        seed(cluster, 2, 8)
        monkeypatch.setattr(CacheAffinityFirst, "decide", broken)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            for i in range(5):
                d = await handle.route(RouteRequest(f"b{i}", token_ids=PROMPT, budget_ms=50))
                assert d.reason is Reason.INTERNAL_ERROR and d.worker is not None
        assert handle.router_actor().health().internal_errors == 5
        with_traceback = [r for r in caplog.records if r.exc_info is not None]
        assert sorted(r.name for r in with_traceback) == ["actors.router_actor", "actors.scorer"]
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            # No failure after those five: the totals are logged when the window ends, all the same.
            await trio.sleep(config.serve.log_aggregate_interval_s + 1)
            totals = {r.name: r.getMessage() for r in caplog.records}
            assert len(caplog.records) == 2
            assert totals == {
                "actors.router_actor": "5 internal_error in the last 60 s (the first: route pipeline failed: "
                'ScorerUnavailable("RuntimeError(\'policy bug\')"))',
                "actors.scorer": "5 scorer_failed in the last 60 s (the first: the policy failed on a decision, "
                "which falls back: RuntimeError('policy bug'))",
            }
            caplog.clear()
            await handle.route(RouteRequest("b-next", token_ids=PROMPT, budget_ms=50))
        # The next window's first failure is logged with its traceback again.
        assert sorted(r.name for r in caplog.records if r.exc_info is not None) == [
            "actors.router_actor",
            "actors.scorer",
        ]


def _stalled_past_every_deadline(
    decide: Callable[[Scorer, DecideRequest], Awaitable[Decided]],
) -> Callable[[Scorer, DecideRequest], Awaitable[Decided]]:
    """``Scorer.decide`` whose hop stalls a second first: past the deadline of any request here."""

    async def stalled(self: Scorer, request: DecideRequest) -> Decided:
        await trio.sleep(1)
        return await decide(self, request)

    return stalled


async def test_a_deadline_inside_a_source_still_names_that_source_in_the_decision(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVCM answered, then the Scorer's hop stalled past the request's deadline (whose scope, not a
    window's, ends it): the deadline answer still says the time went to the KVCM source."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)
        monkeypatch.setattr(Scorer, "decide", _stalled_past_every_deadline(Scorer.decide))
        d = await handle.route(RouteRequest("stalled", token_ids=PROMPT, budget_ms=50))
        assert d.route_source is RouteSource.DOMAIN and d.reason is Reason.DEADLINE
        assert [(s.source, s.outcome, s.reason) for s in d.sources] == [
            (RouteSource.KVCM, SourceOutcome.FELL_THROUGH, Reason.DEADLINE)
        ]
        assert d.sources[0].elapsed_ms == pytest.approx(50.0)


async def test_a_source_is_ended_at_its_windows_end_and_the_next_one_answers(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router holds each source to its window itself: a KVCM source whose attempt never returns
    falls through with DEADLINE when its window (10 ms here) ends, and the next source answers then,
    long before the request's deadline."""

    def window(self: KvcmSource, ctx: RequestContext) -> float:
        return ctx.received_at + 0.010

    async def attempt(self: KvcmSource, ctx: RequestContext) -> FellThrough:
        await trio.sleep_forever()

    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        monkeypatch.setattr(KvcmSource, "window", window)
        monkeypatch.setattr(KvcmSource, "attempt", attempt)
        start = trio.current_time()
        d = await handle.route(RouteRequest("hung", token_ids=PROMPT, budget_ms=50))
        assert trio.current_time() - start == pytest.approx(0.010)
        assert d.worker is not None and d.route_source is not RouteSource.KVCM
        kvcm, *later = d.sources
        assert (kvcm.source, kvcm.outcome, kvcm.reason) == (
            RouteSource.KVCM,
            SourceOutcome.FELL_THROUGH,
            Reason.DEADLINE,
        )
        assert kvcm.elapsed_ms == pytest.approx(10.0) and later, d.sources


async def test_a_deadline_answer_is_charged_and_written_into_the_shadow_as_a_chain_answer_is(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker a deadline answer names still gets the request: it was neither charged to the
    Scorer's ledger nor written into the shadow index, under exactly the load that brings such answers."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)

        def counts() -> tuple[int, int]:
            actors = handle.actors()
            scorer, shadow = actors["scorer"]["health"], actors["shadow_index"]["health"]
            assert isinstance(scorer, ScorerHealth) and isinstance(shadow, ShadowHealth)
            return scorer.records, shadow.applied

        before = counts()
        monkeypatch.setattr(Scorer, "decide", _stalled_past_every_deadline(Scorer.decide))
        for i in range(5):
            d = await handle.route(RouteRequest(f"late{i}", token_ids=PROMPT, budget_ms=50))
            assert d.reason is Reason.DEADLINE and d.worker is not None
        await trio.testing.wait_all_tasks_blocked()
        charged, written = counts()
        assert (charged - before[0], written - before[1]) == (5, 5)


def _charged_and_written(handle: RouterHandle) -> tuple[int, int]:
    actors = handle.actors()
    scorer, shadow = actors["scorer"]["health"], actors["shadow_index"]["health"]
    assert isinstance(scorer, ScorerHealth) and isinstance(shadow, ShadowHealth)
    return scorer.records, shadow.applied


async def test_an_internal_error_answer_is_charged_and_written_into_the_shadow_as_a_deadline_one_is(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug on the path (every scored request while the Scorer restarts is answered so) sent its
    request to the drawn worker uncharged and unrecorded: the Scorer did not see them."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)
        before = _charged_and_written(handle)

        async def broken(self: Scorer, request: DecideRequest) -> Decided:
            raise RuntimeError("a bug in the Scorer's path")

        monkeypatch.setattr(Scorer, "decide", broken)
        for i in range(5):
            d = await handle.route(RouteRequest(f"bug{i}", token_ids=PROMPT, budget_ms=50))
            assert d.reason is Reason.INTERNAL_ERROR and d.worker is not None
        monkeypatch.undo()
        await trio.testing.wait_all_tasks_blocked()
        charged, written = _charged_and_written(handle)
        assert (charged - before[0], written - before[1]) == (5, 5)


async def test_an_overloaded_answer_is_charged_to_the_worker_it_names(autojump_clock: trio.testing.MockClock) -> None:
    """A shed request goes to the domain's drawn worker all the same: uncharged, exactly when balance
    matters most the Scorer went on seeing those workers as idle until their next status."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, max_in_flight=1) as (handle, _, _):
        seed(cluster, 2, 8)
        before = _charged_and_written(handle)
        decisions: list[RouteDecision] = []

        async def one(i: int) -> None:
            decisions.append(await handle.route(RouteRequest(f"c{i}", token_ids=PROMPT, budget_ms=50)))

        async with trio.open_nursery() as callers:
            for i in range(8):
                callers.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()
        shed = [d for d in decisions if d.reason is Reason.OVERLOADED]
        assert shed and all(d.worker is not None for d in shed)
        assert _charged_and_written(handle)[0] - before[0] == len(shed)


async def test_a_request_its_checks_refuse_is_refused_not_shed_under_overload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only the fields' types were checked before a shed: under overload a seq_len past the limit, a
    key beyond 64 bits or a role the deployment does not route got a worker (domain/overloaded) where
    at normal load it is refused."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    bad = [
        RouteRequest("long-seq", token_ids=PROMPT, seq_len=10**9, budget_ms=50),
        RouteRequest("wide-key", block_cache_keys=(1, 2**70), budget_ms=50),
        RouteRequest("foreign-size", token_ids=PROMPT, block_size=2 * BLOCK, budget_ms=50),
        RouteRequest("foreign-role", token_ids=PROMPT, roles=(Role.PREFILL, Role.DECODE), budget_ms=50),
    ]
    async with routed(cluster, max_in_flight=1) as (handle, _, _):
        decisions: list[RouteDecision] = []

        async def one(request: RouteRequest) -> None:
            decisions.append(await handle.route(request))

        async with trio.open_nursery() as callers:
            callers.start_soon(one, RouteRequest("takes-the-place", token_ids=PROMPT, budget_ms=50))
            for request in bad * 3:
                callers.start_soon(one, request)
        refused = [d for d in decisions if d.request_id != "takes-the-place"]
        assert len(refused) == 12
        assert all(d.reason is Reason.BAD_REQUEST for d in refused), [
            (d.request_id, d.reason) for d in refused
        ]


def test_only_a_request_its_checks_pass_is_sheddable() -> None:
    limits, deployment = LimitsConfig(), DeploymentConfig(block_size=BLOCK)
    assert sheddable(RouteRequest("ok", token_ids=PROMPT), deployment, limits) == len(PROMPT)
    assert sheddable(RouteRequest("ok-keys", block_cache_keys=(1, 2, 3), seq_len=48), deployment, limits) == 48
    assert sheddable(RouteRequest("seq", token_ids=PROMPT, seq_len=10**9), deployment, limits) is None
    assert sheddable(RouteRequest("size", token_ids=PROMPT, block_size=2 * BLOCK), deployment, limits) is None
    assert sheddable(RouteRequest("wide", block_cache_keys=(1, 2**70)), deployment, limits) is None
    assert sheddable(RouteRequest("str", token_ids=("a", "b")), deployment, limits) is None  # type: ignore[arg-type]
    assert sheddable(RouteRequest("both", token_ids=PROMPT, block_cache_keys=(1,)), deployment, limits) is None
    assert sheddable(RouteRequest("decode", token_ids=PROMPT, roles=(Role.DECODE,)), deployment, limits) is None


@pytest.mark.parametrize("slice_ms", [0.3, 1.5])
async def test_a_long_prompts_hashing_rests_as_long_as_it_worked_and_a_cut_still_counts_its_work(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, slice_ms: float
) -> None:
    """Each slice of hashing made to take ``slice_ms`` on the mock clock. A rest per slice of under a
    millisecond lasted a whole millisecond (the I/O wait's step), so a long prompt took 2-3 times its
    work; and a hashing the deadline cut reached the admission estimate as 0 ms of own time."""
    real_slices = key_slices

    def timed(checked: CheckedRequest, slice_tokens: int) -> Iterator[tuple[int, ...]]:
        for part in real_slices(checked, slice_tokens):
            autojump_clock.jump(slice_ms / 1000)  # this slice's hashing, as the routing thread's time
            yield part

    monkeypatch.setattr(router_actor, "key_slices", timed)
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, budget_cap_ms=5000.0) as (handle, _, config):
        long_prompt = tuple(range(40 * config.limits.hash_slice_tokens))  # 40 slices
        work_ms = 40 * slice_ms
        d = await handle.route(RouteRequest("whole", token_ids=long_prompt, budget_ms=5000))
        keys_ms = d.stage_ms[Stage.KEYS]
        assert 2 * work_ms - 1e-6 <= keys_ms <= 2 * work_ms + 1.0 + 1e-6, keys_ms  # work, as much rest, one step
        observed: list[float] = []
        observe_own = AdmissionEstimate.observe_own

        def seen(self: AdmissionEstimate, seconds: float) -> None:
            observed.append(seconds)
            observe_own(self, seconds)

        monkeypatch.setattr(AdmissionEstimate, "observe_own", seen)
        scorer = handle.actors()["scorer"]["health"]
        assert isinstance(scorer, ScorerHealth)
        cut = await handle.route(RouteRequest("cut", token_ids=long_prompt, budget_ms=work_ms / 2))
        assert cut.reason is Reason.DEADLINE and cut.worker is not None
        assert observed[-1] >= work_ms / 8 / 1000, observed  # its hashing counted, not 0 ms
        await trio.testing.wait_all_tasks_blocked()
        charged = handle.actors()["scorer"]["health"]
        assert isinstance(charged, ScorerHealth) and charged.records == scorer.records + 1  # its worker, by length


def test_a_long_prompts_rest_is_taken_once_a_millisecond_is_owed() -> None:
    """The I/O wait a rest blocks in sleeps whole milliseconds: a rest per 0.3 ms slice lasted 1 ms."""
    rest = RestOwed()
    rests = []
    for _ in range(40):
        rests.append(rest.after(0.0003))
        rest.rested(rests[-1])  # taken as long as asked
    taken = [r for r in rests if r > 0]
    assert all(r >= 0.001 for r in taken) and sum(taken) == pytest.approx(0.012 - rest.owed_s)
    assert len(taken) == 10  # 40 x 0.3 ms of work owes 12 ms, taken as soon as a millisecond is due
    assert rests[:4] == [0.0, 0.0, 0.0, pytest.approx(0.0012)]
    over = RestOwed()
    assert over.after(0.001) == 0.001
    over.rested(0.0015)  # the I/O wait overslept by half a millisecond: counted against the next
    assert over.after(0.0005) == 0.0 and over.after(0.001) == pytest.approx(0.001)


async def test_a_bug_after_the_decision_is_logged_even_in_a_pipeline_bugs_window(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two different bugs within one aggregation window: each logs its own traceback."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)

    def policy_bug(*args: object, **kwargs: object) -> object:
        raise RuntimeError("policy bug")

    def after_reply_bug(self: ShadowSource, ctx: RequestContext, decision: object) -> None:
        raise KeyError("after-reply bug")

    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)
        with caplog.at_level(logging.WARNING, logger="actors.router_actor"):
            with monkeypatch.context() as patched:
                patched.setattr(CacheAffinityFirst, "decide", policy_bug)
                await handle.route(RouteRequest("p1", token_ids=PROMPT, budget_ms=50))
            monkeypatch.setattr(ShadowSource, "after_reply", after_reply_bug)
            await handle.route(RouteRequest("a1", token_ids=PROMPT, budget_ms=50))
        errors = [r.exc_info[1] for r in caplog.records if r.name == "actors.router_actor" and r.exc_info]
        assert [type(e).__name__ for e in errors] == ["ScorerUnavailable", "KeyError"]


async def test_a_bug_after_the_decision_does_not_lose_it(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work after the decision (the shadow's write-on-route) raising: the decision is still returned."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)

    def broken(self: ShadowSource, ctx: RequestContext, decision: object) -> None:
        raise RuntimeError("after-reply bug")

    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)
        monkeypatch.setattr(ShadowSource, "after_reply", broken)
        d = await handle.route(RouteRequest("a1", token_ids=PROMPT, budget_ms=50))
        assert d.route_source is RouteSource.KVCM and d.worker == cluster.worker_addr(2)
        assert handle.router_actor().health().internal_errors == 1


async def test_candidates_are_counted_by_drop_reason_also_when_every_one_is_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The whole fleet reports another block size: the KVCM source drops every candidate and falls
    through (the case the counter is for), and the domain answers; the drops are still counted."""
    cluster = SimCluster([WorkerSpec(block_size=2 * BLOCK)] * 4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, _):
        seed(cluster, 2, 8)
        decision = await handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.sources[0].reason is Reason.NO_CANDIDATES
        await trio.testing.wait_all_tasks_blocked()  # the metrics sink has applied the decision
        counted = handle.metrics.registry.get_sample_value(
            "kvroute_candidates_dropped_total", {"reason": "block_size_mismatch"}
        )
        assert counted == 3  # each candidate the plan sent, once


def serve_cache_answers_edited(
    cluster: SimCluster,
    network: MemoryNetwork,
    config: KvrouteConfig,
    edit: Callable[[kvcm_pb.GetHostCacheStateResponse], None],
) -> None:
    """Serve the one KVCM replica's answers with ``edit`` applied to each GetHostCacheState answer."""
    (node_target,) = config.discovery.kvcm_bootstrap.split(",")
    kvcm = memory_handler(cluster.kvcm.replica(cluster.kvcm.node_ids[0]))

    async def edited(method_path: str, request: bytes) -> bytes:
        reply = await kvcm(method_path, request)
        if method_path != paths.KVCM_GET_HOST_CACHE_STATE:
            return reply
        answer = kvcm_pb.GetHostCacheStateResponse.FromString(reply)
        edit(answer)
        return answer.SerializeToString()

    network.serve(node_target, edited)


async def test_a_blank_host_in_kvcms_answer_is_counted_as_a_malformed_host(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, network, config):
        seed(cluster, 2, 8)

        def with_a_blank_host(answer: kvcm_pb.GetHostCacheStateResponse) -> None:
            """A KVCM bug: the answer also lists an entry with no host."""
            answer.hosts.add(host_ip_port=" ", local=8)

        serve_cache_answers_edited(cluster, network, config, with_a_blank_host)
        decision = await handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is RouteSource.KVCM and decision.worker == cluster.worker_addr(2)
        await trio.testing.wait_all_tasks_blocked()  # the metrics sink has applied the decision
        registry = handle.metrics.registry
        assert registry.get_sample_value("kvroute_candidates_dropped_total", {"reason": "malformed_host"}) == 1


async def test_a_host_holding_the_prefix_only_through_a_peer_is_a_kvcm_candidate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A host with no local block whose peer-to-peer fetch would match is a positive holder: KVCM
    answers the request, where it fell through as no positive match."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, network, config):
        seed(cluster, 2, 8)

        def through_a_peer_only(answer: kvcm_pb.GetHostCacheStateResponse) -> None:
            (host,) = answer.hosts
            host.local = 0
            host.p2p_1_fetch = host.p2p_1_total_match = 8

        serve_cache_answers_edited(cluster, network, config, through_a_peer_only)
        decision = await handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        kvcm_step = decision.sources[0]
        assert (kvcm_step.source, kvcm_step.outcome, kvcm_step.reason) == (
            RouteSource.KVCM,
            SourceOutcome.ANSWERED,
            Reason.CACHE_LEADER,
        )
        assert (decision.route_source, decision.worker) == (RouteSource.KVCM, cluster.worker_addr(2))


async def test_a_kvcm_answer_claiming_more_blocks_than_asked_falls_through_as_garbled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A match is a prefix of the keys asked: more blocks than that is a broken answer, never a hit
    (nor a decision whose block count the sidecar's reply cannot carry)."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, network, config):
        seed(cluster, 2, 8)

        def claiming_too_much(answer: kvcm_pb.GetHostCacheStateResponse) -> None:
            for host in answer.hosts:
                host.local = host.p2p_1_total_match = 2**33

        serve_cache_answers_edited(cluster, network, config, claiming_too_much)
        decision = await handle.route(RouteRequest("r1", token_ids=PROMPT, budget_ms=50))
        assert decision.route_source is not RouteSource.KVCM
        assert decision.local_blocks <= len(PROMPT) // BLOCK
        kvcm_step = next(step for step in decision.sources if step.source is RouteSource.KVCM)
        assert kvcm_step.reason is Reason.KVCM_ERROR
        decision_to_proto(decision).SerializeToString()  # the sidecar can answer it


async def test_a_kvcm_trial_whose_caller_leaves_frees_the_breakers_trial_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The half-open breaker admits one trial; its caller gives up while the query hangs. The trial's
    slot must be free at once (not held until trial_timeout_s, which would then count a failure and
    reopen the breaker against a KVCM that has recovered)."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, config):
        seed(cluster, 2, 8)
        resolver = handle.leader_resolver()
        assert resolver is not None
        query_only = frozenset({paths.KVCM_GET_HOST_CACHE_STATE})
        node = cluster.kvcm.node_ids[0]
        cluster.kvcm.set_faults(node, KvcmFaults(error_code=kvcm_pb.INTERNAL_ERROR, methods=query_only))
        for i in range(config.breaker.failure_threshold):
            await handle.route(RouteRequest(f"fail{i}", token_ids=PROMPT, budget_ms=50))
        await trio.testing.wait_all_tasks_blocked()
        assert resolver.snapshot().breaker.state is BreakerState.OPEN
        await trio.sleep(config.breaker.cooldown_s)  # a trial is due
        cluster.kvcm.set_faults(node, KvcmFaults(hang=True, methods=query_only))
        with trio.move_on_after(0.005) as caller:  # gives up while its trial's query hangs
            await handle.route(RouteRequest("trial", token_ids=PROMPT, budget_ms=50))
        assert caller.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        breaker = resolver.snapshot().breaker
        assert (breaker.state, breaker.trial_started_at) == (BreakerState.HALF_OPEN, None)
        cluster.kvcm.clear_faults()
        d = await handle.route(RouteRequest("next", token_ids=PROMPT, budget_ms=50))  # the next trial, at once
        assert d.route_source is RouteSource.KVCM and d.worker == cluster.worker_addr(2)
        await trio.testing.wait_all_tasks_blocked()
        assert resolver.snapshot().breaker.state is BreakerState.CLOSED


async def test_a_kvcm_trial_whose_caller_leaves_while_it_waits_for_the_leader_frees_the_trial_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The same when the trial's caller gives up earlier, while it waits for a leader lookup."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as (handle, _, config):
        seed(cluster, 2, 8)
        resolver = handle.leader_resolver()
        assert resolver is not None
        node = cluster.kvcm.node_ids[0]
        query_only = frozenset({paths.KVCM_GET_HOST_CACHE_STATE})
        cluster.kvcm.set_faults(node, KvcmFaults(error_code=kvcm_pb.INTERNAL_ERROR, methods=query_only))
        for i in range(config.breaker.failure_threshold):
            await handle.route(RouteRequest(f"fail{i}", token_ids=PROMPT, budget_ms=50))
        await trio.testing.wait_all_tasks_blocked()
        assert resolver.snapshot().breaker.state is BreakerState.OPEN
        await trio.sleep(config.breaker.cooldown_s)  # a trial is due
        leader = resolver.cached_leader()
        assert leader is not None
        # The leader is reported wrong and its lookup hangs: the trial's request waits for it.
        cluster.kvcm.set_faults(node, KvcmFaults(hang=True, methods=frozenset({paths.KVCM_GET_CLUSTER_INFO})))
        resolver.report_failure(leader.target, Unavailable(leader.target, "reset"))
        await trio.testing.wait_all_tasks_blocked()
        assert resolver.cached_leader() is None
        with trio.move_on_after(0.005) as caller:  # gives up while its trial waits for the leader
            await handle.route(RouteRequest("trial", token_ids=PROMPT, budget_ms=50))
        assert caller.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        breaker = resolver.snapshot().breaker
        assert (breaker.state, breaker.trial_started_at) == (BreakerState.HALF_OPEN, None)
