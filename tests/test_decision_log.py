"""The decision log and replay: record MockClock runs of the whole router (in-memory peers), replay them.

Recording runs every actor for real against SimCluster/SimMaster; replay re-runs each decision through
the real router chain and policy from the log alone, and must come out identical.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import IO, Any, TypeVar, cast

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from actors.decision_log import _BATCH, STOP_WRITE_S, DecisionLog, LogFileWriter
from actors.sources.base import FellThrough, RequestContext
from actors.sources.kvcm import KvcmSource
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.faults import Garble
from kvroute_sim.sim.kvcm import KvcmFaults
from kvroute_sim.sim.master import MasterFaults, SimMaster
from kvroute_sim.sim.worker import WorkerFaults, WorkerSpec
from router import decision_record
from router.api import open_router
from router.cli import main
from router.config import (
    DeadlineSplit,
    DeploymentConfig,
    DiscoveryConfig,
    KvrouteConfig,
    LimitsConfig,
    MasterConfig,
    ProberConfig,
    RouterConfig,
    ScorerConfig,
)
from router.decision_record import (
    KIND_DECISION,
    KIND_FLEET,
    KIND_HEADER,
    MAGIC,
    DecisionRecord,
    LogFormatError,
    ProbeRecord,
    ScoringRecord,
    frame,
    parse_frames,
)
from router.keys import block_keys
from router.policy.plan import CandidateSource, Fleet
from router.problems import ConfigError
from router.replay import (
    Case,
    LogReader,
    Outcome,
    RecordedLog,
    ReplayEngine,
    WhatIf,
    difference,
    load_log,
    replay_config,
)
from router.request import PreparedRequest
from router.supervisor import RouterHandle, decision_log_header
from router.transport.master_memory import MemoryMasterNetwork
from router.transport.memory_adapter import MemoryNetwork
from router.types import (
    DropReason,
    HostMatch,
    KeyFamily,
    KvCacheGroupMode,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouteRequest,
    RouteSource,
    ScorerPolicy,
    SourceOutcome,
    SplitMode,
    Stage,
    WorkerAddr,
    WorkerStatus,
)
from router.wire import paths

BLOCK = 16
PROMPT = tuple(range(1000, 1000 + 8 * BLOCK))
OTHER = tuple(range(5000, 5000 + 8 * BLOCK))
UNSEEN = tuple(range(9000, 9000 + 8 * BLOCK))
KEYS = block_keys(PROMPT, BLOCK, KeyFamily.RTP)
T = TypeVar("T")


def _leader(cluster: SimCluster) -> str:
    leader = cluster.kvcm.leader
    assert leader is not None, "the simulated KVCM elected a leader"
    return leader


def _config(
    addrs_bootstrap: str, workers: str, log: Path, *, scorer_seed: int = 0, **router_kw: object
) -> KvrouteConfig:
    return KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK, roles=(Role.PREFILL,), kvcm_instance_id="ns"),
        router=RouterConfig(decision_log=str(log), **router_kw),  # type: ignore[arg-type]
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs_bootstrap, workers=workers),
        scorer=ScorerConfig(seed=scorer_seed),
    )


@asynccontextmanager
async def cluster_router(
    log: Path, workers: int = 4, scorer_seed: int = 0, **router_kw: object
) -> AsyncIterator[tuple[RouterHandle, SimCluster]]:
    cluster = SimCluster(workers=workers, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = _config(addrs.kvcm_bootstrap, addrs.workers_arg, log, scorer_seed=scorer_seed, **router_kw)
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.move_on_after(1):
            await resolver.leader()
        yield handle, cluster


async def record_cache_run(log: Path, scorer_seed: int = 0) -> list[RouteDecision]:
    """Every cache-path source and fallback reason: KVCM leader and shortest-TTFT picks, the shadow
    index standing in, domain answers for no_positive_match / deadline / bad_request / overloaded,
    probes cut off at decide_at, no_candidates."""
    decisions: list[RouteDecision] = []
    async with cluster_router(log, max_in_flight=2, scorer_seed=scorer_seed) as (handle, cluster):
        cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
        route = handle.route
        for i in range(4):  # cache leader, then pre-charges spread the burst
            decisions.append(await route(RouteRequest(f"leader{i}", token_ids=PROMPT, budget_ms=50)))
        decisions.append(await route(RouteRequest("cold", token_ids=OTHER, budget_ms=50)))  # no_positive_match
        decisions.append(await route(RouteRequest("bad", budget_ms=50)))  # bad_request
        decisions.append(await route(RouteRequest("keys", block_cache_keys=(1, 2, 3), block_size=BLOCK)))
        cluster.workers[1].set_faults(WorkerFaults(delay_s=0.5))  # its probe misses decide_at
        decisions.append(await route(RouteRequest("slow-worker", token_ids=PROMPT, budget_ms=50)))
        cluster.workers[1].set_faults(WorkerFaults())
        leader = _leader(cluster)
        cluster.kvcm.set_faults(leader, KvcmFaults(hang=True))  # deadline: the shadow index stands in
        decisions.append(await route(RouteRequest("hang", token_ids=PROMPT, budget_ms=50)))
        decisions.append(await route(RouteRequest("hang-unseen", token_ids=UNSEEN, budget_ms=20)))
        cluster.kvcm.set_faults(leader, KvcmFaults(delay_s=0.010))
        async with trio.open_nursery() as nursery:  # three at once over a cap of two: one is overloaded

            async def one(rid: str) -> None:
                decisions.append(await route(RouteRequest(rid, token_ids=PROMPT, budget_ms=50)))

            for rid in ("burst0", "burst1", "burst2"):
                nursery.start_soon(one, rid)
        cluster.kvcm.set_faults(leader, KvcmFaults())
        for w in cluster.workers:  # every probe misses decide_at, past the statuses' usable age
            w.set_faults(WorkerFaults(delay_s=0.5))
        await trio.sleep(ProberConfig().max_status_age_s + 0.5)
        fresh = tuple(range(7000, 7000 + len(PROMPT)))  # nobody holds it, nor has the shadow seen it
        decisions.append(await route(RouteRequest("all-slow", token_ids=fresh, budget_ms=50)))  # no_positive_match
        for w in cluster.workers:
            w.set_faults(WorkerFaults(not_alive=True))
        await trio.sleep(1)  # past the fresh status TTL: the next probes see not_alive
        decisions.append(await route(RouteRequest("none-alive", token_ids=PROMPT, budget_ms=50)))
        long_keys = tuple(range(100, 140))  # recorded as a digest and a length
        decisions.append(await route(RouteRequest("long", block_cache_keys=long_keys, block_size=BLOCK)))
    return decisions


@asynccontextmanager
async def master_cluster_router(log: Path) -> AsyncIterator[tuple[RouterHandle, SimCluster, SimMaster]]:
    """A router asking a one-replica master first, then KVCM (which has the prompt on worker 2)."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
    prefill = cluster.worker_addr(1)
    decode = RoleAddr(Role.DECODE, "10.9.9.9", 9000, 9001)
    master = SimMaster([RoleAddr(Role.PREFILL, prefill.ip, prefill.http_port, prefill.grpc_port), decode], replicas=1)
    masters = MemoryMasterNetwork()
    hosts = master.serve_memory(masters)
    config = replace(
        _config(addrs.kvcm_bootstrap, addrs.workers_arg, log),
        master=MasterConfig(hosts=",".join(hosts.hosts)),
    )
    async with open_router(config, rpc=network, master=masters) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.move_on_after(1):
            await resolver.leader()
        yield handle, cluster, master


async def record_master_run(log: Path) -> list[RouteDecision]:
    decisions: list[RouteDecision] = []
    async with master_cluster_router(log) as (handle, _cluster, master):
        route = handle.route
        decisions.append(await route(RouteRequest("m-routed", token_ids=PROMPT, budget_ms=50)))
        for faults, rid in (
            (MasterFaults(fallback=True), "m-8600"),
            (MasterFaults(business_error=8402), "m-error"),
            (MasterFaults(hang=True), "m-hang"),
            (MasterFaults(slow_ms=5), "m-slow"),
        ):
            master.set_faults(0, faults)
            decisions.append(await route(RouteRequest(rid, token_ids=PROMPT, budget_ms=50)))
    return decisions


def _written(tmp_path: Path, data: bytes) -> Path:
    """``data`` in a file of its own."""
    path = tmp_path / f"cut-{len(data)}.log"
    path.write_bytes(data)
    return path


def on_mock_clock(record: Callable[[Path], Awaitable[T]], log: Path) -> T:
    """Record in its own trio run (replay starts a trio run per decision, so it cannot run inside one)."""
    return trio.run(record, log, clock=trio.testing.MockClock(autojump_threshold=0))


def replay_all(*logs: Path, overrides: dict[str, str] | None = None) -> tuple[int, int]:
    recorded = load_log([str(p) for p in logs])
    setup = replay_config(recorded, overrides or {})
    assert not setup.problems and setup.digest_matches
    outcomes = ReplayEngine(setup.config).replay_all(recorded.cases)
    return sum(o.identical for o in outcomes), len(outcomes)


def test_a_request_whose_time_was_gone_on_arrival_replays_as_it_was_decided(tmp_path: Path) -> None:
    """With no time left when it came (a budget of 0, a deadline past or within the reply margin) its
    query is refused unsent with no checkpoint, and the whole chain runs to the domain's answer; replay
    waited for the query instead, met the request's expired scope, and ended on the first source."""
    log = tmp_path / "gone.log"

    async def record(log: Path) -> None:
        async with cluster_router(log) as (handle, cluster):
            cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
            await handle.route(RouteRequest("b0", token_ids=PROMPT, budget_ms=0))
            await handle.route(RouteRequest("past", token_ids=PROMPT, deadline=trio.current_time() - 0.001))
            await handle.route(RouteRequest("keys-b0", block_cache_keys=(1, 2, 3), block_size=BLOCK, budget_ms=0))
            refused = await handle.route(RouteRequest("bad-b0", token_ids=(), budget_ms=0))  # its checks refuse it
            assert refused.reason is Reason.BAD_REQUEST
            await handle.route(RouteRequest("ok", token_ids=PROMPT, budget_ms=50))

    on_mock_clock(record, log)
    assert replay_all(log) == (5, 5)


def test_a_request_the_deadline_ends_in_its_probe_wait_replays_as_recorded(tmp_path: Path) -> None:
    """A stall across the probe window's end and past the deadline: the request's tail is learnt, and
    its probe window, which the deadline and not the window ended, is not recorded cut (a replay reads
    a cut window as the decision's own moment to score, and scored it)."""
    log = tmp_path / "decisions.log"
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def record(log: Path) -> RouteDecision:
        async with cluster_router(log) as (handle, cluster):
            cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
            for i in range(3):
                await handle.route(RouteRequest(f"warm{i}", token_ids=PROMPT, budget_ms=50))
            for worker in cluster.workers:
                worker.set_faults(WorkerFaults(delay_s=0.5))  # the probes run to their window
            await trio.sleep(4.0)  # the statuses in hand are stale
            probe_end = trio.current_time() + 0.045  # the fixed split: decide_at = deadline - 5 ms

            async def stall() -> None:
                await trio.sleep_until(probe_end - 0.0001)
                clock.jump(0.007)  # the loop stalls across the window's end and past the deadline

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stall)
                return await handle.route(RouteRequest("stalled", token_ids=PROMPT, budget_ms=50))

    stalled = trio.run(record, log, clock=clock)
    assert stalled.reason is Reason.DEADLINE
    assert not {w.stage: w.cut for w in stalled.windows}.get(Stage.PROBE, False)
    assert replay_all(log) == (4, 4)


def _ended(chain: list[list[str]], windows: list[list[object]]) -> Case:
    """A recorded decision the deadline ended, with its chain and stage windows as the log keeps them."""
    expected = {"r": "deadline", "rs": "domain", "ch": chain, "sw": windows}
    return Case("log", 0, "r", 0.0, RouteRequest("r", token_ids=PROMPT), False, None, None, None, (), None, expected)


def test_a_query_cut_in_kvcms_source_says_nothing_of_where_the_shadow_sources_time_went() -> None:
    """Recorded: KVCM's query cut by its window, then the loop stalled in the shadow source past the
    deadline. Any cut window counted, so replay took the shadow source's time as seen, scored, and
    found no candidates where the recording ran out of time (live logs of `serve --processes 2`)."""
    kvcm_cut = ["kvcm", "fell_through", "deadline"]
    shadow_cut = ["shadow", "fell_through", "deadline"]
    assert _ended([kvcm_cut, shadow_cut], [["cache_query", 0.357, 1]]).ran_out_unseen()
    # The shadow source's own probe wait cut: its time is seen, as before.
    assert not _ended([kvcm_cut, shadow_cut], [["cache_query", 0.357, 1], ["probe", 9.0, 1]]).ran_out_unseen()
    # Ended in KVCM's source itself by its cut query: seen, as before.
    assert not _ended([kvcm_cut], [["cache_query", 0.357, 1]]).ran_out_unseen()


def test_a_source_the_deadline_ended_after_its_cut_probe_wait_is_known_to_have_scored_nothing() -> None:
    """Recorded: KVCM answered, the probe window ended cut, and the loop stalled past the deadline
    before the Scorer decided, so no scoring was recorded. Replay scored nothing in its place, no
    statuses and so no candidates, where the recording ran out of time (live logs of `serve
    --processes 2`); it now ends there by the deadline too (``ended_unscored_in``)."""
    ended = _ended([["kvcm", "fell_through", "deadline"]], [["cache_query", 13.154, 0], ["probe", 13.154, 1]])
    assert ended.ended_unscored_in(RouteSource.KVCM)
    assert not ended.ended_unscored_in(RouteSource.SHADOW)
    answered = replace(ended, expected={**ended.expected, "r": "CACHE_LEADER", "ch": [["kvcm", "answered", "x"]]})
    assert not answered.ended_unscored_in(RouteSource.KVCM)


def test_cold_walks_that_passed_over_decode_workers_replay_as_recorded(tmp_path: Path) -> None:
    """Prefill/decode: the cold walk passed over the decode workers by their reported roles, which the
    log does not hold; it holds the workers passed over, so replay walks the same way."""
    log = tmp_path / "decisions.log"

    async def record(log: Path) -> list[RouteDecision]:
        specs = [WorkerSpec(role="RoleType.PREFILL", block_size=BLOCK)] * 3
        specs += [WorkerSpec(role="RoleType.DECODE", block_size=BLOCK)] * 5
        cluster = SimCluster(specs, kvcm_replicas=1, block_size=BLOCK)
        network = MemoryNetwork()
        addrs = cluster.serve_memory(network)
        config = _config(addrs.kvcm_bootstrap, addrs.workers_arg, log)
        config = replace(
            config,
            deployment=replace(config.deployment, roles=(Role.PREFILL, Role.DECODE)),
            prober=replace(config.prober, health_interval_s=0.5),
        )
        cluster.kvcm.record_prefill(cluster.worker_addr(0).http_target, KEYS[:2])
        cluster.kvcm.record_prefill(cluster.worker_addr(5).http_target, KEYS[:3])  # a decode holder: unfit
        async with open_router(config, rpc=network) as handle:
            await trio.sleep(2.0)  # health probes: every worker's role is known
            return [await handle.route(RouteRequest(f"pd{i}", token_ids=PROMPT, budget_ms=50)) for i in range(6)]

    decisions = on_mock_clock(record, log)
    assert all(d.route_source is RouteSource.KVCM for d in decisions)
    decode_holder = {(c.target, c.dropped) for d in decisions for c in d.candidates if c.target.startswith("127.1.0.6")}
    assert decode_holder == {("127.1.0.6:8000", "unfit")}, decode_holder
    recorded = load_log([str(log)])
    assert any(s.other_roles for case in recorded.cases for s in case.scorings)
    assert replay_all(log) == (6, 6)


def test_a_probed_status_is_scored_as_taken_when_its_call_was_sent(tmp_path: Path) -> None:
    """The status a decision scores is dated by its call's send time (the pre-charge cut): a dispatch
    decided while the call was in flight may be missing from it. Its arrival is later by the reply's
    delay, and it replays as recorded."""
    log = tmp_path / "decisions.log"
    delay_s = 0.004

    async def record(log: Path) -> list[RouteDecision]:
        async with cluster_router(log) as (handle, cluster):
            cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
            for worker in cluster.workers:
                worker.set_faults(WorkerFaults(delay_s=delay_s))
            await trio.sleep(0.2)  # the start-up's statuses are stale: the request probes its candidates
            return [await handle.route(RouteRequest("cold-statuses", token_ids=PROMPT, budget_ms=50))]

    (decision,) = on_mock_clock(record, log)
    assert decision.route_source is RouteSource.KVCM
    (case,) = load_log([str(log)]).cases
    probed = [p for s in case.scorings for p in s.probes.values() if p.status is not None]
    assert probed
    for probe in probed:
        assert probe.arrived is not None and probe.taken is not None
        assert probe.arrived - probe.taken == pytest.approx(delay_s), probe
    assert replay_all(log) == (1, 1)


def test_prompts_nobody_holds_scored_by_load_replay_as_recorded(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"

    async def record(log: Path) -> list[RouteDecision]:
        async with cluster_router(log, score_unmatched=True) as (handle, cluster):
            cluster.workers[0].submit("bg", 8000, 0, trio.current_time())
            return [
                await handle.route(RouteRequest(f"u{i}", token_ids=tuple(range(9000 * i, 9000 * i + 64)), budget_ms=50))
                for i in range(1, 7)
            ]

    decisions = on_mock_clock(record, log)
    assert {d.reason for d in decisions} == {Reason.SHORTEST_TTFT_LOW_CACHE_HIT}
    assert replay_all(log) == (6, 6)


def test_requests_whose_leader_lookup_failed_replay_without_a_query(tmp_path: Path) -> None:
    """KVCM elects no leader: each request waits for the lookup, which fails inside its window, and
    sends no query; replay puts back the lookup's wait and no query's."""
    log = tmp_path / "decisions.log"

    async def record(log: Path) -> list[RouteDecision]:
        cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
        cluster.kvcm.set_faults(_leader(cluster), KvcmFaults(no_leader_elected=True))
        network = MemoryNetwork()
        addrs = cluster.serve_memory(network)
        async with open_router(_config(addrs.kvcm_bootstrap, addrs.workers_arg, log), rpc=network) as handle:
            return [await handle.route(RouteRequest(f"n{i}", token_ids=PROMPT, budget_ms=50)) for i in range(3)]

    decisions = on_mock_clock(record, log)
    assert [d.sources[0].reason for d in decisions] == [Reason.NO_LEADER] * 3
    recorded = load_log([str(log)])
    assert all(case.waited_for_leader() == (True, False) and not case.queried() for case in recorded.cases)
    assert replay_all(log) == (3, 3)


def test_decisions_that_named_no_worker_replay_identically(tmp_path: Path) -> None:
    """Every worker refuses its probes (KVCM fallback off: domain routing only), so the domain names no
    worker (no_candidates), and a bad request with no worker to name stays bad_request: replay ends
    them the same way (it used to replay every one of them as no_workers)."""
    log = tmp_path / "decisions.log"

    async def record(log: Path) -> list[RouteDecision]:
        cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
        network = MemoryNetwork()
        addrs = cluster.serve_memory(network)
        for worker in cluster.workers:
            worker.set_faults(WorkerFaults(dead=True))
        config = replace(
            _config(addrs.kvcm_bootstrap, addrs.workers_arg, log, kvcm_fallback=False),
            prober=ProberConfig(health_interval_s=0.5),
        )
        async with open_router(config, rpc=network) as handle:
            await trio.sleep(2.0)  # the health probes have been refused by every worker
            routed = [await handle.route(RouteRequest(f"d{i}", token_ids=PROMPT, budget_ms=50)) for i in range(3)]
            return [*routed, await handle.route(RouteRequest("", token_ids=PROMPT, budget_ms=50))]

    decisions = on_mock_clock(record, log)
    assert [(d.route_source, d.reason) for d in decisions] == [(RouteSource.NONE, Reason.NO_CANDIDATES)] * 3 + [
        (RouteSource.NONE, Reason.BAD_REQUEST)
    ]
    assert replay_all(log) == (4, 4)


def test_a_recorded_cache_run_replays_identically(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"
    decisions = on_mock_clock(record_cache_run, log)
    by_reason = {(d.route_source, d.reason) for d in decisions}
    assert {
        (RouteSource.KVCM, Reason.CACHE_LEADER),
        (RouteSource.SHADOW, Reason.CACHE_LEADER),
        (RouteSource.DOMAIN, Reason.NO_POSITIVE_MATCH),
        (RouteSource.DOMAIN, Reason.BAD_REQUEST),
        (RouteSource.DOMAIN, Reason.OVERLOADED),
        (RouteSource.DOMAIN, Reason.DEADLINE),
        (RouteSource.NONE, Reason.NO_CANDIDATES),  # every worker says it is not alive: none to name
    } <= by_reason, by_reason
    identical, total = replay_all(log)
    assert (identical, total) == (len(decisions), len(decisions))


def test_keys_recorded_as_a_digest_are_held_as_their_count_and_replay_identically(tmp_path: Path) -> None:
    """Long keys are recorded as a digest and their count; a loaded case held zeros of that count (8 bytes
    a key, per case held), where its count is all replay needs: the stand-in keys are made when it
    replays."""
    log = tmp_path / "decisions.log"
    long_prompt = tuple(range(20_000, 20_000 + 40 * BLOCK))
    long_keys = block_keys(long_prompt, BLOCK, KeyFamily.RTP)

    async def record(log: Path) -> list[RouteDecision]:
        async with cluster_router(log) as (handle, cluster):
            cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, long_keys)
            return [await handle.route(RouteRequest(f"long{i}", token_ids=long_prompt, budget_ms=50)) for i in range(3)]

    decisions = on_mock_clock(record, log)
    assert {d.route_source for d in decisions} == {RouteSource.KVCM}
    cases = load_log([str(log)]).cases
    assert [(c.request.block_cache_keys, c.digested_keys) for c in cases] == [(None, 40)] * 3
    assert all(c.replayed_request().block_cache_keys == (0,) * 40 for c in cases)
    assert replay_all(log) == (3, 3)


def test_a_worker_dropped_for_its_kv_cache_group_mode_replays_dropped(tmp_path: Path) -> None:
    """The filter drops a worker whose KV cache group mode does not fit the query type; the status rows
    left the mode out, so replay read every status as unspecified and chose the worker dropped live. A
    version 4 log (rows without the mode) still replays."""
    log = tmp_path / "decisions.log"

    async def record(log: Path) -> list[RouteDecision]:
        specs = [WorkerSpec(block_size=BLOCK, kv_cache_group_mode=KvCacheGroupMode.WITH_MAMBA)]
        specs += [WorkerSpec(block_size=BLOCK)] * 3
        cluster = SimCluster(specs, kvcm_replicas=1, block_size=BLOCK)
        network = MemoryNetwork()
        addrs = cluster.serve_memory(network)
        mamba = cluster.worker_addr(0).http_target
        cluster.kvcm.record_prefill(mamba, KEYS)  # the cache leader is the worker the filter drops
        async with open_router(_config(addrs.kvcm_bootstrap, addrs.workers_arg, log), rpc=network) as handle:
            await trio.sleep(1.0)  # discovery and the leader
            decisions = [
                await handle.route(RouteRequest(f"g{i}", token_ids=PROMPT, budget_ms=50)) for i in range(3)
            ]
        for d in decisions:
            assert d.worker is not None and d.worker.http_target != mamba
            assert [c.dropped for c in d.candidates if c.target == mamba] == [DropReason.QUERY_TYPE_MISMATCH.value]
        return decisions

    on_mock_clock(record, log)
    assert replay_all(log) == (3, 3)

    cache_log = tmp_path / "cache.log"
    cache_decisions = on_mock_clock(record_cache_run, cache_log)
    old = tmp_path / "v4.log"
    body = bytearray(MAGIC[:-1] + bytes([4]))
    for f in parse_frames(str(cache_log), cache_log.read_bytes()):
        payload = dict(f.payload)
        if f.kind == KIND_HEADER:
            payload["v"] = 4
        for scoring in payload.get("sc", ()):
            for probe in scoring["p"]:
                if probe[2] is not None:
                    assert len(probe[2]) == 7
                    probe[2] = probe[2][:6]
        body += frame(f.kind, payload)
    old.write_bytes(bytes(body))
    assert replay_all(old) == (len(cache_decisions), len(cache_decisions))


async def record_cost_aware_run(log: Path) -> tuple[list[RouteDecision], str]:
    """CostAware with a fixed cost and near-tie spreading: every worker holds the prompt's prefix;
    worker 0 has the fewest tokens queued but in many requests (CacheAffinityFirst's pick, not
    this policy's), the others near-tie queues, so the picks depend on the policy and its draws."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    scorer = ScorerConfig(policy=ScorerPolicy.COST_AWARE, near_tie_tokens=2 * BLOCK, request_cost_tokens=1000, seed=5)
    config = replace(_config(addrs.kvcm_bootstrap, addrs.workers_arg, log), scorer=scorer)
    decisions: list[RouteDecision] = []
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.move_on_after(1):
            await resolver.leader()
        now = trio.current_time()
        for i in range(4):
            cluster.run_prefill(i, f"prefix{i}", KEYS, len(PROMPT), now)
        for j in range(5):  # worker 0: the fewest tokens queued, but in five requests
            cluster.run_prefill(0, f"small{j}", (), 2000, now)
        for i in range(1, 4):  # near-tie queues of one request each
            cluster.run_prefill(i, f"big{i}", (), 11_000 + i, now)
        await trio.sleep(0.1)  # past the statuses the router already holds
        for i in range(12):
            prompt = PROMPT + tuple(range(20_000 + i * BLOCK, 20_000 + (i + 1) * BLOCK))
            decisions.append(await handle.route(RouteRequest(f"near{i}", token_ids=prompt, budget_ms=50)))
    return decisions, cluster.worker_addr(0).http_target


def test_a_recorded_cost_aware_run_replays_identically(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"
    decisions, worker0 = on_mock_clock(record_cost_aware_run, log)
    assert all(d.route_source is RouteSource.KVCM for d in decisions), [d.reason for d in decisions]
    assert decisions[0].worker is not None and decisions[0].worker.http_target != worker0
    assert len({d.worker for d in decisions}) >= 2
    assert load_log([str(log)]).settings["scorer_policy"] == "cost-aware"
    identical, total = replay_all(log)
    assert (identical, total) == (len(decisions), len(decisions))


def test_a_recorded_master_run_replays_identically(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"
    decisions = on_mock_clock(record_master_run, log)
    reasons = {d.reason for d in decisions}
    assert {Reason.MASTER, Reason.MASTER_FALLBACK, Reason.MASTER_ERROR} <= reasons
    assert any(s.reason is Reason.MASTER_UNAVAILABLE for d in decisions for s in d.sources)
    assert replay_all(log) == (len(decisions), len(decisions))


async def record_learned_split_run(log: Path) -> list[RouteDecision]:
    """The learned split warm after a few quick KVCM answers, then KVCM answering close to the budget."""
    decisions: list[RouteDecision] = []
    async with cluster_router(log, deadline_split=DeadlineSplit.LEARNED, split_min_samples=2) as (handle, cluster):
        cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
        leader = _leader(cluster)
        only_query = frozenset({paths.KVCM_GET_HOST_CACHE_STATE})
        for i, delay in enumerate((0.002, 0.002, 0.003, 0.044, 0.047, 0.060, 0.002)):
            cluster.kvcm.set_faults(leader, KvcmFaults(delay_s=delay, methods=only_query))
            decisions.append(await handle.route(RouteRequest(f"split{i}", token_ids=PROMPT, budget_ms=50)))
    return decisions


def test_a_learned_split_run_replays_its_windows_identically(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"
    decisions = on_mock_clock(record_learned_split_run, log)
    assert decisions[0].split is SplitMode.COLD and decisions[-1].split is SplitMode.LEARNED
    assert decisions[4].route_source is RouteSource.KVCM  # 47 ms: past the fixed split's 45 ms, in the learned one
    assert any(w.cut for d in decisions for w in d.windows)  # the 60 ms answer came after its window
    assert replay_all(log) == (len(decisions), len(decisions))
    # What-if: the fixed split cuts the 47 ms answer (and changes every learned window).
    identical, total = replay_all(log, overrides={"deadline_split": "fixed"})
    assert identical < total


def test_a_version_2_log_still_replays_with_the_split_it_was_recorded_under(tmp_path: Path) -> None:
    """Version 2 recorded no tail: its learned split left reserve_min + lag + score after the probes."""
    log = tmp_path / "decisions.log"
    decisions = on_mock_clock(record_learned_split_run, log)
    assert any(Stage.TAIL in d.stage_ms for d in decisions)  # the probes ran: the tail was measured
    old = tmp_path / "v2.log"
    body = bytearray(MAGIC[:-1] + bytes([2]))
    for f in parse_frames(str(log), log.read_bytes()):
        payload = dict(f.payload)
        if f.kind == KIND_DECISION:
            assert "tl" in payload or "sc" not in payload  # a request that scored has its tail recorded
            payload.pop("tl", None)
            if "se" in payload:
                assert len(payload["se"]) == 5
                payload["se"] = payload["se"][:4]
        if f.kind == KIND_HEADER:
            payload["v"] = 2
        body += frame(f.kind, payload)
    old.write_bytes(bytes(body))
    recorded = load_log([str(old)])
    router = RouterConfig()
    warm = [c for c in recorded.cases if c.split.score is not None]
    assert warm and all(c.split_without_tail for c in recorded.cases)
    for case in warm:
        e = case.split_estimates(router)
        assert e.tail is not None and e.score is not None
        assert e.tail == pytest.approx(router.reserve_min_ms / 1000.0 + e.lag + e.score)
    identical, total = replay_all(old)
    assert total == len(decisions) and identical >= 1  # readable and replayed (the cold decisions as recorded)


@pytest.mark.parametrize("kvcm_fallback", [True, False])
def test_long_prompts_the_deadline_cut_while_hashing_replay_as_deadline(tmp_path: Path, kvcm_fallback: bool) -> None:
    """A prompt longer than hash_slice_tokens is hashed (without the KVCM fallback: its ids checked) in
    slices with awaits; a deadline passing there answers ``deadline`` before the request has keys or a
    context. Its record held no keys and replayed as a request refused by its checks (bad_request); it
    now holds the prompt's length, and a version 3 log without it still loads."""
    log = tmp_path / "decisions.log"
    long_prompt = tuple(range(1000, 1000 + 3000))
    assert len(long_prompt) > LimitsConfig().hash_slice_tokens

    async def record(log: Path) -> list[RouteDecision]:
        cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
        network = MemoryNetwork()
        addrs = cluster.serve_memory(network)
        config = _config(addrs.kvcm_bootstrap, addrs.workers_arg, log, kvcm_fallback=kvcm_fallback)
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        async with open_router(config, rpc=network) as handle:
            await trio.sleep(1.0)  # discovery and the leader
            decisions = [await handle.route(RouteRequest("long-ok", token_ids=long_prompt, budget_ms=50))]
            async with trio.open_nursery() as nursery:

                async def slow_machine() -> None:
                    # The mock clock hashes in no time: each scheduling round here takes 10 ms instead.
                    while True:
                        await trio.lowlevel.checkpoint()
                        clock.jump(0.010)

                nursery.start_soon(slow_machine)
                decisions.append(await handle.route(RouteRequest("long-b5", token_ids=long_prompt, budget_ms=5)))
                soon = trio.current_time() + 0.005 + config.router.reply_margin_ms / 1000.0
                decisions.append(await handle.route(RouteRequest("long-dl", token_ids=long_prompt, deadline=soon)))
                nursery.cancel_scope.cancel()
            return decisions

    decisions = on_mock_clock(record, log)
    assert [(d.reason, d.sources) for d in decisions[1:]] == [(Reason.DEADLINE, ())] * 2
    recorded = load_log([str(log)])
    assert [c.hashing_cut for c in recorded.cases] == [None, len(long_prompt), len(long_prompt)]
    assert replay_all(log) == (3, 3)
    frames = list(parse_frames(str(log), log.read_bytes()))
    # On the real clock the hashing itself can outlast a budget (MockClock hashes in no time): the
    # stand-in prompt must not be hashed at once and walk the chain (without the KVCM fallback, straight
    # to the domain's answer), it is cut where it was.
    slow = tmp_path / "slow.log"
    body = bytearray(MAGIC)
    for f in frames:
        payload = dict(f.payload)
        if f.kind == KIND_DECISION and payload.get("b") == 5:
            payload["b"] = 50
        body += frame(f.kind, payload)
    slow.write_bytes(bytes(body))
    assert replay_all(slow) == (3, 3)
    # A version 3 log (no ``hc``) still loads: its decisions with keys replay as before.
    old = tmp_path / "v3.log"
    body = bytearray(MAGIC[:-1] + bytes([3]))
    for f in frames:
        payload = dict(f.payload)
        if f.kind == KIND_HEADER:
            payload["v"] = 3
        if f.kind == KIND_DECISION and "hc" in payload:
            continue
        body += frame(f.kind, payload)
    old.write_bytes(bytes(body))
    assert replay_all(old) == (1, 1)


def test_the_replay_command_reports_and_exits_by_identity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "decisions.log"
    decisions = on_mock_clock(record_cache_run, log)
    assert main(["replay", str(log)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"{len(decisions)} of {len(decisions)} decisions identical"
    # What-if: no minimum hit gate and a generous extra-work bound: the cache leader keeps more requests.
    assert main(["replay", str(log), "--router-setting", "scorer_max_extra_work_tokens=100000"]) == 0
    out = capsys.readouterr().out
    assert "what-if scorer_max_extra_work_tokens=100000" in out and "decisions change" in out
    assert main(["replay", str(log), "--router-setting", "no_such_setting=1"]) == 2
    assert "no_such_setting" in capsys.readouterr().err
    # A bad value for a fallback setting is refused too: served, it would turn the fallback off, and
    # the what-if reported every decision changing to domain routing for a typo.
    assert main(["replay", str(log), "--router-setting", "deadline_split=fixd"]) == 2
    err = capsys.readouterr().err
    assert "--deadline-split" in err and "(from flag --router-setting)" in err  # as typed, not its own flag
    # A what-if on a setting replay takes from the recording says so, rather than a bare "0 change".
    assert main(["replay", str(log), "--quiet", "--router-setting", "prober_fresh_ttl_s=1"]) == 0
    captured = capsys.readouterr()
    assert "prober_fresh_ttl_s: replay takes its effect from the recording" in captured.err
    assert "0 of" in captured.out
    assert main(["replay", str(log), "--quiet", "--router-setting", "scorer_max_extra_work_tokens=100000"]) == 0
    assert "from the recording" not in capsys.readouterr().err


def test_the_replay_command_reads_each_decision_as_it_replays_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The files were read whole, every decision of every file held, before the first replay: a log set
    took many times its size. They are read as they are replayed, so a fault in a later file is found
    after the decisions before it have replayed; it still exits 2, naming the fault's byte offset."""
    first, second = tmp_path / "decisions.log.1", tmp_path / "decisions.log"
    on_mock_clock(record_cache_run, first)
    ids = [c.request_id for c in load_log([str(first)]).cases]
    body = bytearray(MAGIC)
    fault = 0
    for f in parse_frames(str(first), first.read_bytes()):
        if f.kind == KIND_DECISION and not fault:
            fault = len(body)
            body += frame(f.kind, {**f.payload, "d": {}})  # intact frame, a decision replay cannot compare
        else:
            body += frame(f.kind, f.payload)
    second.write_bytes(bytes(body))

    reader = LogReader([str(first), str(second)])
    cases = reader.cases()
    assert [c.request_id for c in itertools.islice(cases, len(ids))] == ids  # taken before the fault is read
    with pytest.raises(LogFormatError, match=f"byte offset {fault}: malformed frame payload"):
        next(cases)

    assert main(["replay", str(first), str(second)]) == 2
    captured = capsys.readouterr()
    before_the_fault = f"{len(ids)} of {len(ids)} decisions identical (the decisions before the fault)"
    assert captured.out.splitlines() == [*(f"identical {i}" for i in ids), before_the_fault]
    assert f"{second}: byte offset {fault}" in captured.err
    assert f"replay stopped there, after {len(ids)} decisions" in captured.err
    # A what-if stopped by the fault reports what the decisions before it came to: it printed nothing
    # but the errors, though they were counted.
    setting = "scorer_max_extra_work_tokens=100000"
    assert main(["replay", "--quiet", str(first), str(second), "--router-setting", setting]) == 2
    captured = capsys.readouterr()
    assert f"what-if {setting}: " in captured.out
    assert f" of {len(ids)} decisions change (the decisions before the fault)" in captured.out
    assert f" of {len(ids)} decisions identical (the decisions before the fault)" in captured.out.splitlines()[-1]
    assert f"replay stopped there, after {len(ids)} decisions" in captured.err


def test_a_later_file_that_one_read_finds_unreadable_is_refused_before_any_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read as they replay, the files' faults were found only when every earlier file had replayed,
    even those their first frame shows (a wrong path, no header, a header of another version or
    configuration), which were refused at once when the files were read whole. Each file's header is
    read and checked before the first decision replays."""
    first = tmp_path / "decisions.log.1"
    on_mock_clock(record_cache_run, first)
    frames = list(parse_frames(str(first), first.read_bytes()))
    header = frames[0]
    assert header.kind == KIND_HEADER

    def written(name: str, data: bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(data)
        return path

    def with_header(**changed: Any) -> bytes:
        rest = b"".join(frame(f.kind, f.payload) for f in frames[1:])
        return MAGIC + frame(KIND_HEADER, {**header.payload, **changed}) + rest

    later = {
        "cannot read the file": tmp_path / "missing.log",
        f"byte offset {len(MAGIC)}: no header frame": written("empty.log", MAGIC),
        f"byte offset {len(MAGIC)}: a frame before the header": written(
            "headless.log", MAGIC + b"".join(frame(f.kind, f.payload) for f in frames[1:])
        ),
        f"byte offset {len(MAGIC)}: recorded with another configuration": written(
            "other.log", with_header(digest="another")
        ),
        f"byte offset {len(MAGIC) - 1}: format version 99": written(
            "future.log", MAGIC[:-1] + bytes([99]) + with_header()[len(MAGIC) :]
        ),
        f"byte offset {len(MAGIC)}: header format version 99": written("future-header.log", with_header(v=99)),
    }
    for why, path in later.items():
        with pytest.raises(LogFormatError, match=why):
            LogReader([str(first), str(path)])
        assert main(["replay", str(first), str(path)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # no decision replayed
        assert f"{path}: " in captured.err and why in captured.err


def test_logs_of_processes_that_differ_only_in_where_they_log_replay_together(tmp_path: Path) -> None:
    """The digest covered every setting: the logs of two --processes children (each its own
    PATH.p<i>, and since 2026-12-07 its own seed, whose draws the log records) were refused together as
    "recorded with another configuration"."""
    first, second = tmp_path / "decisions.log.p0", tmp_path / "decisions.log.p1"
    on_mock_clock(record_cache_run, first)
    on_mock_clock(partial(record_cache_run, scorer_seed=1), second)
    identical, total = replay_all(first, second)
    assert identical == total > 0

    async def other_cap(log: Path) -> None:  # a setting decisions depend on
        async with cluster_router(log, max_in_flight=3) as (handle, _):
            await handle.route(RouteRequest("one", token_ids=PROMPT, budget_ms=50))

    third = tmp_path / "other.log"
    on_mock_clock(other_cap, third)
    with pytest.raises(LogFormatError, match="another configuration"):
        load_log([str(first), str(third)])


def test_each_file_says_when_it_was_opened_and_how_its_decisions_read_as_times_of_day(tmp_path: Path) -> None:
    """Decisions carry their receipt on the trio clock, whose origin differs per run: without the
    wall clock beside it an operator could not find the decisions behind an incident by time."""
    log = tmp_path / "decisions.log"
    before = time.time()
    on_mock_clock(record_cache_run, log)
    after = time.time()
    (header,) = [f.payload for f in parse_frames(str(log), log.read_bytes()) if f.kind == KIND_HEADER]
    assert before - 1 <= header["opened_wall_s"] <= after + 1
    # The actor's start on both clocks (a mock clock here, which jumps: with the real clock, a
    # decision's t plus this is its time of day).
    assert isinstance(header["wall_minus_trio_s"], float)
    assert load_log([str(log)]).cases  # readers take the new fields in their stride
    # The mock clock starts at 0 and the actor with the run, so the offset is the run's time of day
    # (an offset from another clock, such as the monotonic one, is not).
    assert before - 1 <= header["wall_minus_trio_s"] <= after + 1


def test_a_what_if_changes_decisions(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"
    on_mock_clock(record_cache_run, log)
    identical, total = replay_all(log, overrides={"kvcm_fallback": "false"})
    assert identical < total  # every cache decision becomes a domain one


def _logged_case(tmp_path: Path, record: DecisionRecord, header: dict[str, object] | None = None) -> Path:
    """``record`` alone in a log file, under ``header`` (this kvroute's defaults' when None)."""
    path = tmp_path / "d.log"
    writer = LogFileWriter(str(path), max_bytes=1 << 20, files=2, header=header or decision_log_header(KvrouteConfig()))
    writer.open()
    writer.drain(deque([[record]]), close_generation=writer.generation)
    return path


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("w", "10.0.0.9:8000"),
        ("r", Reason.CACHE_LEADER.value),
        ("rs", RouteSource.KVCM.value),
        ("ra", [["PREFILL", "10.0.0.9", 8000, 8001]]),
        ("ch", [["kvcm", "fell_through", "deadline"]]),
        ("c", [["10.0.0.9:8000", "hot", 2, 32, 100, "PREFILL", None, 1]]),
        ("hit", 32),
        ("ec", 3),
        ("sm", SplitMode.FIXED.value),
        ("sw", [["cache_query", 5.0, 1]]),
    ],
)
def test_a_decision_that_differs_in_any_compared_field_is_not_identical(
    tmp_path: Path, field: str, value: object
) -> None:
    """Identical means equal in every compared field: a replay that moved only the candidate rows, the
    split's windows or the role addresses is a changed decision, not a pass."""
    (case,) = load_log([str(_logged_case(tmp_path, _overloaded(0)))]).cases
    assert field in case.expected and case.expected[field] != value
    assert Outcome(case, dict(case.expected)).identical
    assert not Outcome(case, {**case.expected, field: value}).identical


def test_a_what_if_counts_the_hit_change_with_its_sign_and_the_workers_it_moved(tmp_path: Path) -> None:
    (case,) = load_log([str(_logged_case(tmp_path, _overloaded(0)))]).cases
    what_if = WhatIf()
    what_if.add(Outcome(case, dict(case.expected)))
    what_if.add(Outcome(case, {**case.expected, "hit": int(case.expected["hit"]) + 32, "w": "10.0.0.9:8000"}))
    assert (what_if.total, what_if.changed, what_if.hit_delta, what_if.workers_changed) == (2, 1, 32, 1)


def _as_version_1(log: Path, old: Path) -> Path:
    """``log`` rewritten as a version 1 log (its decisions without the split mode and stage windows) at ``old``."""
    body = bytearray(MAGIC)
    for f in parse_frames(str(log), log.read_bytes()):
        payload = dict(f.payload)
        if f.kind == KIND_HEADER:
            payload["v"] = 1
        if f.kind == KIND_DECISION:
            payload["d"] = {k: v for k, v in payload["d"].items() if k not in ("sm", "sw")}
        body += frame(f.kind, payload)
    old.write_bytes(bytes(body))
    return old


def test_a_version_1_log_replays_identically(tmp_path: Path) -> None:
    """Its decisions compare without the split they never recorded."""
    log = tmp_path / "d.log"
    decisions = on_mock_clock(record_cache_run, log)
    old = _as_version_1(log, tmp_path / "v1.log")
    assert replay_all(old) == (len(decisions), len(decisions))


def test_a_changed_decision_of_a_version_1_log_names_only_the_fields_it_recorded(tmp_path: Path) -> None:
    """A what-if that changes a version 1 decision names what differs of what it recorded: what the same
    decision recorded with its split names, less the split mode and stage windows."""
    log = tmp_path / "d.log"
    on_mock_clock(record_cache_run, log)
    old = _as_version_1(log, tmp_path / "v1.log")

    def differences(path: Path) -> dict[str, str]:
        recorded = load_log([str(path)])
        engine = ReplayEngine(replay_config(recorded, {"budget_cap_ms": "20"}).config)
        return {o.case.request_id: difference(o) for o in engine.replay_all(recorded.cases) if not o.identical}

    now, then = differences(log), differences(old)
    split_parts = {"split differ", "stage windows differ"}
    assert any(split_parts & set(named.split("; ")) for named in now.values())
    without_split = {rid: "; ".join(p for p in named.split("; ") if p not in split_parts) for rid, named in now.items()}
    assert then and then == {rid: named for rid, named in without_split.items() if named}


def test_a_what_if_counts_each_change_by_its_transition_worker_hit_and_chosen_work(tmp_path: Path) -> None:
    """One changed decision keeps its worker (only its chain moved); the other moves from the KVCM cache
    leader to the domain on another worker, losing its hit, its chosen worker's work 100 -> 300 (the
    work read from the chosen row, not the first)."""
    (case,) = load_log([str(_logged_case(tmp_path, _overloaded(0)))]).cases

    def row(target: str, hit: int, work: int, chosen: bool) -> list[object]:
        return [target, "hot", 2, hit, work, "PREFILL", None, int(chosen)]

    before = {
        **case.expected,
        "rs": "kvcm",
        "r": "cache_leader",
        "w": "10.0.0.1:8000",
        "hit": 64,
        "c": [row("10.0.0.2:8000", 16, 900, False), row("10.0.0.1:8000", 64, 100, True)],
    }
    case = replace(case, expected=before)
    what_if = WhatIf()
    what_if.add(Outcome(case, {**before, "ch": [["kvcm", "fell_through", "deadline"]]}))
    moved = [row("10.0.0.2:8000", 0, 300, True), row("10.0.0.1:8000", 64, 100, False)]
    after = {**before, "rs": "domain", "r": "no_positive_match", "w": "10.0.0.2:8000", "hit": 0, "c": moved}
    what_if.add(Outcome(case, after))
    assert (what_if.total, what_if.changed, what_if.workers_changed) == (2, 2, 1)
    assert (what_if.hit_delta, what_if.work_delta) == (-64, 300 - 100)
    assert what_if.transitions == {
        ("kvcm/cache_leader", "kvcm/cache_leader"): 1,
        ("kvcm/cache_leader", "domain/no_positive_match"): 1,
    }


def test_a_recorded_digest_this_kvroute_does_not_compute_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The settings were read differently when recorded (defaults changed between versions): the
    decisions still replay, and the command warns that they may differ for that reason."""
    header = decision_log_header(KvrouteConfig())
    right = _logged_case(tmp_path, _overloaded(0), header)
    (tmp_path / "other").mkdir()
    wrong = _logged_case(tmp_path / "other", _overloaded(0), {**header, "digest": "0123456789abcdef"})
    # The exit status is the decisions' (this record's fleet was never logged): only the warning is looked at.
    main(["replay", str(right)])
    assert "digest differs" not in capsys.readouterr().err
    main(["replay", str(wrong)])
    assert "configuration digest differs" in capsys.readouterr().err


def test_a_what_if_that_turns_on_a_source_the_log_never_asked_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replayed, a source that never answered in the recording never does: a master turned on made
    every request wait it out ("7 x kvcm/CACHE_LEADER -> domain/deadline"), KVCM turned on found
    nothing, both reported as what the change would do."""
    log = tmp_path / "decisions.log"
    on_mock_clock(record_cache_run, log)  # no master
    assert main(["replay", str(log), "--router-setting", "master_hosts=127.0.0.1:1"]) == 2
    assert "the log was recorded without a master" in capsys.readouterr().err

    async def record_without_kvcm(log: Path) -> None:
        cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
        network = MemoryNetwork()
        addrs = cluster.serve_memory(network)
        config = _config(addrs.kvcm_bootstrap, addrs.workers_arg, log, kvcm_fallback=False)
        async with open_router(config, rpc=network) as handle:
            await trio.sleep(1.0)  # discovery
            await handle.route(RouteRequest("off", token_ids=PROMPT, budget_ms=50))

    off = tmp_path / "off.log"
    on_mock_clock(record_without_kvcm, off)
    assert main(["replay", str(off), "--router-setting", "kvcm_fallback=true"]) == 2
    assert "recorded with the KVCM fallback off" in capsys.readouterr().err
    assert main(["replay", str(off), "--router-setting", "block_size=32"]) == 0  # replayed from the recorded keys
    assert "--router-setting block_size: replay takes its effect from the recording" in capsys.readouterr().err


def test_corrupted_and_truncated_logs_name_the_byte_offset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "decisions.log"
    on_mock_clock(record_cache_run, log)
    data = log.read_bytes()
    truncated = tmp_path / "truncated.log"
    truncated.write_bytes(data[:-7])  # a writer that stopped mid-frame: read up to the torn frame
    whole, torn = load_log([str(log)]), load_log([str(truncated)])
    assert [c.request_id for c in torn.cases] == [c.request_id for c in whole.cases][:-1]
    (tail,) = torn.torn
    assert 0 < tail.offset < len(data) and "truncated frame" in str(tail)
    assert load_log([str(truncated), str(log)]).cases[len(torn.cases) :] == whole.cases  # and the next file
    assert main(["replay", str(truncated)]) == 0
    assert "the decisions before it are replayed" in capsys.readouterr().err
    with pytest.raises(LogFormatError, match="byte offset"):  # torn inside its header: nothing to read
        load_log([str(_written(tmp_path, data[:10]))])
    flipped = bytearray(data)
    flipped[len(MAGIC) + 20] ^= 0xFF  # inside the header frame's payload
    corrupted = tmp_path / "corrupted.log"
    corrupted.write_bytes(bytes(flipped))
    with pytest.raises(LogFormatError, match=f"byte offset {len(MAGIC)}: frame checksum mismatch"):
        load_log([str(corrupted)])
    not_a_log = tmp_path / "other.log"
    not_a_log.write_bytes(b"hello world, not a log")
    assert main(["replay", str(not_a_log)]) == 2
    err = capsys.readouterr().err
    assert "byte offset 0" in err and "Traceback" not in err
    if os.path.exists("/dev/zero"):  # endless: refused before any read, never read whole
        assert main(["replay", "/dev/zero"]) == 2
        assert "not a regular file (a character device)" in capsys.readouterr().err
    nested_payload = b"[" * 3000  # past json's recursion limit: RecursionError, which is no ValueError
    nested = tmp_path / "nested.log"
    head = struct.pack(">IBI", len(nested_payload), KIND_HEADER, zlib.crc32(nested_payload))
    nested.write_bytes(MAGIC + head + nested_payload)
    with pytest.raises(LogFormatError, match=f"byte offset {len(MAGIC)}: frame payload is not JSON"):
        load_log([str(nested)])
    huge = tmp_path / "huge.log"
    huge.write_bytes(MAGIC + struct.pack(">IBI", 2**31, ord("D"), 0))
    assert main(["replay", str(huge)]) == 2
    assert f"byte offset {len(MAGIC)}" in capsys.readouterr().err


def test_a_file_whose_last_write_left_zero_bytes_is_read_up_to_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system can extend a file before the data lands: a crash then leaves zero bytes where the
    last frames were to be, which read as "unknown frame kind 0" or a checksum mismatch and made the
    whole file unreplayable. Zeros running to the end of the file are a torn tail; a corrupt frame
    with anything but zeros after it is still refused."""
    monkeypatch.setattr(decision_record, "ZERO_TAIL_CHUNK", 7)  # the tails below take many pieces
    log = tmp_path / "decisions.log"
    on_mock_clock(record_cache_run, log)
    data = log.read_bytes()
    whole = load_log([str(log)])
    *_, last = parse_frames(str(log), data)
    ids = [c.request_id for c in whole.cases]

    def torn(body: bytes) -> tuple[list[str], int]:
        read = load_log([str(_written(tmp_path, body))])
        (tail,) = read.torn
        assert "zero bytes from inside this frame" in str(tail)
        return [c.request_id for c in read.cases], tail.offset

    assert torn(data + bytes(4096)) == (ids, len(data))  # frame headers of zeros
    # The header's length landed, the rest of it (kind, checksum) did not.
    assert torn(data + struct.pack(">I", 596) + bytes(100)) == (ids, len(data))
    # The last frame's header and the start of its payload landed: zeros from inside it on.
    cut = last.offset + 9 + 20
    assert torn(data[:cut] + bytes(len(data) - cut + 50)) == (ids[:-1], last.offset)
    assert main(["replay", str(_written(tmp_path, data[:cut] + bytes(len(data) - cut + 50)))]) == 0
    assert "the decisions before it are replayed" in capsys.readouterr().err
    # Not zeros to the end: corrupt, and the file is refused.
    with pytest.raises(LogFormatError, match=f"byte offset {len(data)}: unknown frame kind 0"):
        load_log([str(_written(tmp_path, data + bytes(100) + b"x"))])
    with pytest.raises(LogFormatError, match=f"byte offset {last.offset}: frame checksum mismatch"):
        load_log([str(_written(tmp_path, data[:cut] + bytes(len(data) - cut - 1) + b"x"))])
    flipped = bytearray(data)
    flipped[-2] ^= 0xFF  # the last frame corrupted, not zeroed, at the end of the file
    with pytest.raises(LogFormatError, match=f"byte offset {last.offset}: frame checksum mismatch"):
        load_log([str(_written(tmp_path, bytes(flipped)))])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda p: {**p, "d": {}}, "the decision lacks"),
        (lambda p: {**p, "k": "sha256-prefix:100000000000"}, "recorded key count"),
        (lambda p: {**p, "t": 10**400}, "OverflowError"),  # a number no float holds: a traceback, exit 1
        # Fields the what-if reads (a traceback, exit 1, until 2026-12-07):
        (lambda p: {**p, "d": {**p["d"], "hit": "12x"}}, "the decision's 'hit' is not an integer"),
        (lambda p: {**p, "d": {**p["d"], "c": [[1]]}}, "the decision's 'c' is not a list of 8-field rows"),
        (lambda p: {**p, "d": {**p["d"], "ch": [5]}}, "the decision's 'ch' is not a list of 3-field rows"),
        (lambda p: {**p, "d": {**p["d"], "hit": None}}, "the decision's 'hit' is not an integer"),
        (lambda p: {**p, "d": {**p["d"], "ra": [["PREFILL"]]}}, "the decision's 'ra' is not a list of 4-field rows"),
        (lambda p: {**p, "d": {**p["d"], "ra": [["BOGUS", "10.0.0.1", 1, 2]]}}, "'BOGUS' is not a valid Role"),
    ],
)
def test_a_decision_record_garbled_inside_valid_frames_exits_2_naming_its_offset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Callable[[dict[str, Any]], dict[str, Any]], named: str
) -> None:
    """Checksums that match over a record that does not: replay names the frame's byte offset and exits
    2 (it raised KeyError, or tried to build 10^11 keys, with a traceback and exit 1)."""
    log = tmp_path / "decisions.log"
    on_mock_clock(record_cache_run, log)
    garbled = tmp_path / "garbled.log"
    body = bytearray(MAGIC)
    offsets: list[int] = []
    for f in parse_frames(str(log), log.read_bytes()):
        payload = dict(f.payload)
        if f.kind == KIND_DECISION and not offsets and "k" in payload:
            payload = change(payload)
            offsets.append(len(body))
        body += frame(f.kind, payload)
    garbled.write_bytes(bytes(body))
    assert main(["replay", str(garbled)]) == 2
    err = capsys.readouterr().err
    assert f"byte offset {offsets[0]}" in err and named in err and "Traceback" not in err


def test_a_frame_length_garbled_mid_file_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    """A length over what a reader takes, with frames after it, is not a write a crash cut short: read as
    a torn tail it would be a warning, and the decisions after it silently not replayed."""
    path = _logged_case(tmp_path, _overloaded(0))
    data = bytearray(path.read_bytes())
    first = next(f.offset for f in parse_frames(str(path), bytes(data)) if f.kind == KIND_DECISION)
    struct.pack_into(">I", data, first, decision_record.MAX_FRAME_BYTES + 1)
    data += frame(KIND_DECISION, {"pad": "x" * 64})
    path.write_bytes(bytes(data))
    with pytest.raises(LogFormatError) as raised:
        load_log([str(path)])
    assert not isinstance(raised.value, decision_record.TornTail)
    assert raised.value.offset == first
    # A length within what a reader takes that runs past the end of the file over the frames after it:
    # it read as a write cut short, and the decisions after it were dropped with a warning, exit 0.
    struct.pack_into(">I", data, first, len(data))
    path.write_bytes(bytes(data))
    with pytest.raises(LogFormatError, match="runs over the frames after it") as raised:
        load_log([str(path)])
    assert not isinstance(raised.value, decision_record.TornTail)
    assert raised.value.offset == first


@pytest.mark.parametrize(
    ("count", "inline"), [(decision_record.KEYS_INLINE_MAX, True), (decision_record.KEYS_INLINE_MAX + 1, False)]
)
def test_every_recorded_input_reads_back_as_it_was_recorded(tmp_path: Path, count: int, inline: bool) -> None:
    """A replay starts from what the request had: its deadline (given absolute, as the sidecar gives it,
    and logged relative to receipt), its roles, its keys (as given up to KEYS_INLINE_MAX, else their
    count), the shadow's match, and each scoring's decide time and probes."""
    fleet = Fleet.of([WorkerAddr("10.0.0.1", 8000, 8001, 8002)])
    received = 1000.0
    request = RouteRequest("q", budget_ms=80.0, deadline=received + 0.05, roles=(Role.PREFILL,))
    status = WorkerStatus(
        role=Role.PREFILL, role_reported="PREFILL", alive=True, status_version=1, latest_finished_version=0,
        waiting_query_len=3,
    )
    keys = tuple(range(1, count + 1))
    match = (HostMatch("10.0.0.1:8000", 2),)
    probe = ProbeRecord("10.0.0.1:8000", 0.004, status, 0.001, None)
    record = DecisionRecord(
        request, received, overloaded=True,
        decision=RouteDecision("q", None, None, RouteSource.DOMAIN, Reason.OVERLOADED),
        prepared=PreparedRequest(keys, BLOCK, count * BLOCK, (Role.PREFILL,)), shadow_hosts=match,
        scorings=[ScoringRecord(CandidateSource.SHADOW, match, fleet, (), probes=(probe,), decided=0.007)],
    )
    (case,) = load_log([str(_logged_case(tmp_path, record))]).cases
    assert case.request.deadline == pytest.approx(received + 0.05, abs=1e-9)
    assert (case.request.budget_ms, case.request.roles, case.overloaded) == (80.0, (Role.PREFILL,), True)
    if inline:
        assert (case.request.block_cache_keys, case.digested_keys) == (keys, None)
    else:
        assert (case.request.block_cache_keys, case.digested_keys) == (None, count)
    assert case.shadow_hosts == match
    (scoring,) = case.scorings
    assert scoring.decided == 0.007
    read = scoring.probes["10.0.0.1:8000"]
    assert (read.arrived, read.taken, read.status and read.status.waiting_query_len) == (0.004, 0.001, 3)


def test_rotation_keeps_the_size_bound_and_each_file_replays(tmp_path: Path) -> None:
    log = tmp_path / "decisions.log"
    max_bytes, files = 8192, 3

    async def record(log: Path) -> None:
        async with cluster_router(log, decision_log_max_bytes=max_bytes, decision_log_files=files) as (handle, cluster):
            cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
            for i in range(120):
                await handle.route(RouteRequest(f"r{i}", token_ids=PROMPT, budget_ms=50))
                await trio.sleep(0.01)

    on_mock_clock(record, log)
    kept = sorted(p for p in tmp_path.iterdir() if p.name.startswith("decisions.log"))
    assert [p.name for p in kept] == ["decisions.log", "decisions.log.1", "decisions.log.2"]
    assert all(os.path.getsize(p) <= max_bytes for p in kept)
    for path in kept:  # every file carries its header (and its fleet): each replays on its own
        identical, total = replay_all(path)
        assert identical == total > 0


def _record_faulted_run(
    log: Path,
    prefix: str,
    requests: Sequence[tuple[float, tuple[int, ...], KvcmFaults]],
    *,
    worker_faults: Sequence[WorkerFaults],
    blocks: int,
) -> int:
    """Route ``requests`` (budget, prompt, KVCM leader's faults from then on) one after another on
    MockClock with the decision log at ``log``, worker 1 holding ``blocks`` of the prompt's blocks
    and the workers' faults fixed; the number of decisions."""

    async def record(log: Path) -> int:
        async with cluster_router(log) as (handle, cluster):
            if blocks:
                cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, KEYS[:blocks])
            for worker, faults in zip(cluster.workers, worker_faults, strict=True):
                worker.set_faults(faults)
            current: KvcmFaults | None = None
            for i, (budget, prompt, kvcm_faults) in enumerate(requests):
                if kvcm_faults != current:
                    cluster.kvcm.set_faults(_leader(cluster), kvcm_faults)
                    current = kvcm_faults
                await handle.route(RouteRequest(f"{prefix}{i}", token_ids=prompt, budget_ms=budget))
        return len(requests)

    return on_mock_clock(record, log)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Slow queries open the breaker; the last request is refused by it before any wait, and its replay
# must not wait for a query either (it once replayed with a query window the run never had).
@example(budgets=[30.0, 30.0, 30.0, 12.0, 50.0, 5.0], delays=[0.0, 0.0, 0.0, 0.0], kvcm_delay=0.03, blocks=0)
@given(
    budgets=st.lists(st.sampled_from([5.0, 12.0, 30.0, 50.0]), min_size=1, max_size=6),
    delays=st.lists(st.sampled_from([0.0, 0.002, 0.02, 0.2]), min_size=4, max_size=4),
    kvcm_delay=st.sampled_from([0.0, 0.004, 0.03]),
    blocks=st.integers(min_value=0, max_value=8),
)
def test_replay_is_deterministic_for_any_recorded_run(
    tmp_path_factory: pytest.TempPathFactory, budgets: list[float], delays: list[float], kvcm_delay: float, blocks: int
) -> None:
    log = tmp_path_factory.mktemp("prop") / "decisions.log"
    kvcm_faults = KvcmFaults(delay_s=kvcm_delay)
    n = _record_faulted_run(
        log,
        "p",
        [(budget, PROMPT, kvcm_faults) for budget in budgets],
        worker_faults=[WorkerFaults(delay_s=delay) for delay in delays],
        blocks=blocks,
    )
    first = replay_all(log)
    assert first == (n, n)
    assert replay_all(log) == first


_KVCM_FAULTS = st.one_of(
    st.builds(KvcmFaults, delay_s=st.sampled_from([0.0, 0.004, 0.03])),
    st.sampled_from(
        [KvcmFaults(dead=True), KvcmFaults(hang=True), KvcmFaults(no_leader_elected=True)]
        + [KvcmFaults(garbled=garble) for garble in Garble]
    ),
)
_WORKER_FAULTS = st.one_of(
    st.builds(WorkerFaults, delay_s=st.sampled_from([0.0, 0.002, 0.02, 0.2])), st.just(WorkerFaults(not_alive=True))
)
_MASTER_FAULTS = st.one_of(
    st.builds(MasterFaults, slow_ms=st.sampled_from([0.0, 1.0, 5.0, 20.0, 60.0])),
    st.sampled_from(
        [
            MasterFaults(refuse=True),
            MasterFaults(hang=True),
            MasterFaults(fallback=True),
            MasterFaults(business_error=8402),
            MasterFaults(garbled=True),
            MasterFaults(server_error=True),
        ]
    ),
)
_BUDGETS = st.sampled_from([5.0, 12.0, 30.0, 50.0])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(st.tuples(_BUDGETS, st.booleans(), _KVCM_FAULTS), min_size=1, max_size=8),
    worker_faults=st.lists(_WORKER_FAULTS, min_size=4, max_size=4),
    blocks=st.integers(min_value=0, max_value=8),
)
def test_replay_is_deterministic_whatever_kvcm_and_the_workers_do(
    tmp_path_factory: pytest.TempPathFactory,
    steps: list[tuple[float, bool, KvcmFaults]],
    worker_faults: list[WorkerFaults],
    blocks: int,
) -> None:
    """KVCM's leader changing its fault before each request (dead, hung, garbled, electing no leader,
    slow), dead or slow workers, prompts it holds or not: every decision replays identically."""
    log = tmp_path_factory.mktemp("faults") / "decisions.log"
    requests = [(budget, OTHER if other else PROMPT, kvcm_faults) for budget, other, kvcm_faults in steps]
    n = _record_faulted_run(log, "f", requests, worker_faults=worker_faults, blocks=blocks)
    assert replay_all(log) == (n, n)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(_BUDGETS, _MASTER_FAULTS, _KVCM_FAULTS), min_size=1, max_size=8))
def test_replay_is_deterministic_whatever_the_master_and_kvcm_do(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[float, MasterFaults, KvcmFaults]]
) -> None:
    log = tmp_path_factory.mktemp("master-faults") / "decisions.log"

    async def record(log: Path) -> int:
        async with master_cluster_router(log) as (handle, cluster, master):
            for i, (budget, master_faults, kvcm_faults) in enumerate(steps):
                master.set_faults(0, master_faults)
                cluster.kvcm.set_faults(_leader(cluster), kvcm_faults)
                await handle.route(RouteRequest(f"m{i}", token_ids=PROMPT, budget_ms=budget))
        return len(steps)

    n = on_mock_clock(record, log)
    assert replay_all(log) == (n, n)


def _stalled_like_a_real_run(payload: dict[str, object], kind: str) -> dict[str, object] | None:
    """``payload`` (a recorded KVCM decision that scored) rewritten the way a run whose routing task
    resumed late records it; None when the decision does not fit ``kind``."""
    recorded = payload["d"]
    assert isinstance(recorded, dict)
    decision = dict(recorded)
    windows = [list(w) for w in decision.get("sw", [])]
    if decision.get("rs") != RouteSource.KVCM.value or not windows or "sc" not in payload:
        return None
    end_s = float(windows[0][1]) / 1000.0
    out = dict(payload)
    if kind == "query kept":  # the answer was in before the cut; the task saw it 3 ms after the window
        kv = list(out["kv"])  # type: ignore[call-overload]
        kv[1] = end_s + 0.003
        out["kv"] = kv
    elif kind == "probe in hand":  # a probe landed after decide_at but before the late task scored
        scoring = dict(out["sc"][0])  # type: ignore[index]
        probes = [list(p) for p in scoring["p"]]
        if not probes or probes[0][2] is None:
            return None
        probes[0][1] = end_s + 0.002
        scoring["p"], scoring["at"] = probes, end_s + 0.005
        out["sc"] = [scoring]
        decision["sw"] = [[stage, end_ms, 1 if stage == Stage.PROBE.value else cut] for stage, end_ms, cut in windows]
    elif kind.startswith("ran out unseen"):  # the task did not run again before the deadline after the answer
        out.pop("sc")
        out.pop("tl", None)
        # The KVCM source's step says the deadline ended it there; a log written before such steps
        # were kept has none.
        ran_out = [RouteSource.KVCM.value, SourceOutcome.FELL_THROUGH.value, Reason.DEADLINE.value]
        chain = [] if kind.endswith("old log") else [ran_out]
        decision.update(r=Reason.DEADLINE.value, rs=RouteSource.DOMAIN.value, ch=chain, c=[], hit=0)
        decision["sw"] = [w for w in windows if w[0] == Stage.CACHE_QUERY.value]
    out["d"] = decision
    return out


@pytest.mark.parametrize("kind", ["query kept", "probe in hand", "ran out unseen", "ran out unseen, old log"])
def test_a_run_whose_task_resumed_late_replays_as_recorded(tmp_path: Path, kind: str) -> None:
    """On the real clock a stalled loop lets a request keep an answer that was in before its window
    was cut, score with probes that landed before it resumed, or run out of time between steps the
    log does not time. Replay reproduces each from what the record holds."""
    log = tmp_path / "decisions.log"
    on_mock_clock(record_cache_run, log)
    stalled = tmp_path / "stalled.log"
    body = bytearray(MAGIC)
    rewritten = 0
    for f in parse_frames(str(log), log.read_bytes()):
        payload = dict(f.payload)
        if f.kind == KIND_DECISION and (late := _stalled_like_a_real_run(payload, kind)) is not None:
            payload, rewritten = late, rewritten + 1
        body += frame(f.kind, payload)
    stalled.write_bytes(bytes(body))
    assert rewritten >= 1
    identical, total = replay_all(stalled)
    assert identical == total


def test_a_what_if_that_moves_decide_at_scores_with_the_probes_in_hand_by_the_new_one(tmp_path: Path) -> None:
    """Recorded under a 40 ms cap (decide_at at 36 ms), the probes landed at 30 ms, late in their window,
    and the decision scored them then. A 30 ms cap ends the window at 27 ms, before they land: none is
    in hand, every candidate is dropped (KVCM finds none), none scored with a status that came after
    decide_at.
    A 50 ms cap (45 ms) keeps every one as recorded."""
    log = tmp_path / "decisions.log"

    async def record(log: Path) -> RouteDecision:
        async with cluster_router(log, budget_cap_ms=40.0) as (handle, cluster):
            cluster.kvcm.record_prefill(cluster.worker_addr(2).http_target, KEYS)
            for worker in cluster.workers:
                worker.set_faults(WorkerFaults(delay_s=0.030))
            await trio.sleep(5.0)  # past the statuses' usable age: the request probes each candidate
            return await handle.route(RouteRequest("late-probes", token_ids=PROMPT, budget_ms=50))

    decision = on_mock_clock(record, log)
    probe_end_ms = {w.stage: w.end_ms for w in decision.windows}[Stage.PROBE]
    assert decision.reason is Reason.CACHE_LEADER and probe_end_ms == pytest.approx(36.0)
    (case,) = load_log([str(log)]).cases
    (scoring,) = case.scorings
    assert scoring.probes and all(p.arrived == pytest.approx(0.030) for p in scoring.probes.values())
    assert replay_all(log) == (1, 1)

    def replayed(cap_ms: str) -> Outcome:
        (outcome,) = ReplayEngine(replay_config(load_log([str(log)]), {"budget_cap_ms": cap_ms}).config).replay_all(
            [case]
        )
        return outcome

    shortened = replayed("30")
    assert shortened.replayed["ch"][0] == [RouteSource.KVCM.value, "fell_through", Reason.NO_CANDIDATES.value]
    assert (shortened.replayed["rs"], shortened.replayed["r"]) == ("domain", Reason.NO_CANDIDATES.value)
    lengthened = replayed("50")
    assert lengthened.replayed["c"] == case.expected["c"] and lengthened.replayed["w"] == case.expected["w"]


def test_a_scoring_is_past_its_window_by_more_than_the_window_ends_rounding(tmp_path: Path) -> None:
    """The window's end is logged to the µs: a scoring at the end it was cut at reads as on time, one
    a stalled loop let run 2 ms later as past it, and one of a record with no probe window as recorded."""
    (case,) = load_log([str(_logged_case(tmp_path, _overloaded(0)))]).cases
    windowed = replace(case, expected={**case.expected, "sw": [["cache_query", 36.0, 0], ["probe", 36.0, 1]]})
    assert not windowed.scored_past_its_window(0.0360004)  # 36.0004 ms, logged as 36.0
    assert windowed.scored_past_its_window(0.038)
    assert not windowed.scored_past_its_window(0.030)
    assert replace(case, expected={**case.expected, "sw": []}).scored_past_its_window(0.030)


# How long a hung disk's write waits for the test before it goes on by itself: a backstop that ends
# a failing test instead of hanging it, well past the stop's bound; a passing test lets the disk
# back as soon as the stop has ended.
DISK_BACK_S = 5 * STOP_WRITE_S


class HungDisk:
    """The log's open file, each write held until the test lets the disk come ``back``."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.back = threading.Event()
        self.writing = threading.Event()  # a write reached the disk
        self.closed = threading.Event()

    def write(self, data: bytes) -> int:
        self.writing.set()
        self.back.wait(DISK_BACK_S)
        self.back.set()  # the backstop passed once is passed for every later write
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._file.close()
        self.closed.set()


def _overloaded(i: int) -> DecisionRecord:
    decision = RouteDecision(f"q{i}", None, None, RouteSource.DOMAIN, Reason.OVERLOADED)
    return DecisionRecord(RouteRequest(f"q{i}", block_cache_keys=(1, 2)), 0.0, overloaded=True, decision=decision)


def test_a_problem_the_recording_had_stays_as_served_and_only_an_overrides_is_named_by_its_option() -> None:
    """The recorded settings and the overrides are resolved together: labelled all as --router-setting,
    a recorded value this kvroute refuses read as one the overrides brought, and replay stopped."""
    settings = {"workers": "10.0.0.1:8000", "kvcm_instance_id": "i", "kvcm_bootstrap": "10.0.0.2:6381"}
    recorded = RecordedLog(settings={**settings, "deadline_split": "fixd"}, digest="", seed=0, cases=())
    assert replay_config(recorded, {}).problems == ()
    assert replay_config(recorded, {"scorer_max_extra_work_tokens": "100000"}).problems == ()
    (brought,) = replay_config(RecordedLog(settings, "", 0, ()), {"deadline_split": "fixd"}).problems
    assert "--deadline-split" in str(brought) and "(from flag --router-setting)" in str(brought)


def test_a_recorded_setting_this_kvroute_finds_fatal_stops_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Served under this kvroute the recording's settings would not start: there is no configuration to
    replay its decisions under, so replay refuses rather than replay them under another."""
    settings = {"workers": "10.0.0.1:8000", "kvcm_instance_id": "i", "kvcm_bootstrap": "10.0.0.2:6381"}
    (problem,) = replay_config(RecordedLog({**settings, "budget_cap_ms": "-5"}, "", 0, ()), {}).problems
    assert "--budget-cap-ms" in str(problem)
    header = decision_log_header(KvrouteConfig())
    log = _logged_case(tmp_path, _overloaded(0), {**header, "settings": {**settings, "budget_cap_ms": "-5"}})
    assert main(["replay", str(log)]) == 2
    assert "--budget-cap-ms" in capsys.readouterr().err


@pytest.mark.parametrize("hung", ["at the stop", "in a batch"])
def test_a_stop_on_a_hung_disk_ends_by_its_bound_and_counts_what_the_disk_did_not_take(
    tmp_path: Path, hung: str
) -> None:
    """The disk hangs with records queued: the stop still ends (after STOP_WRITE_S, real time: a
    MockClock does not shorten the disk's chance). The piece the disk holds is written when the disk
    comes back, and the file is closed after it; the rest is dropped and counted."""
    path = tmp_path / "decisions.log"
    router = RouterConfig(decision_log=str(path), decision_log_inbox_size=4 * _BATCH)
    queued = 2 * _BATCH + 10
    # Hung at the stop: the stop's first piece (a whole batch) is on the disk. In a batch: the one
    # record the actor was writing when it was stopped.
    held = _BATCH if hung == "at the stop" else 1
    total = queued if hung == "at the stop" else queued + 1

    async def stop_on_a_hung_disk() -> tuple[int, int]:
        log = DecisionLog(router, decision_log_header(KvrouteConfig(router=router)))
        async with trio.open_nursery() as nursery:
            await nursery.start(log.run)
            assert log._writer._file is not None
            disk = HungDisk(log._writer._file)
            log._writer._file = cast(IO[bytes], disk)
            if hung == "in a batch":
                log.submit(_overloaded(0))
                assert await trio.to_thread.run_sync(partial(disk.writing.wait, DISK_BACK_S))  # a failure, not a hang
            for i in range(total - queued, total):
                assert log.submit(_overloaded(i))
            nursery.cancel_scope.cancel()
        dropped = log.health().dropped
        assert not disk.back.is_set()  # the stop ended with the disk still hung
        disk.back.set()
        assert await trio.to_thread.run_sync(partial(disk.closed.wait, DISK_BACK_S))  # closed after its piece
        return dropped, log.health().written

    dropped, written = trio.run(stop_on_a_hung_disk, clock=trio.testing.MockClock(autojump_threshold=0))
    assert (dropped, written) == (total - held, held)
    assert [case.request_id for case in load_log([str(path)]).cases] == [f"q{i}" for i in range(held)]


def test_a_late_stop_closes_only_the_file_of_its_own_run(tmp_path: Path) -> None:
    """A stop that gave up on a hung disk returns late: by then a restarted run may have opened its own
    file, which the old stop's thread must not close (the next write would reopen and rotate it)."""
    writer = LogFileWriter(str(tmp_path / "d.log"), max_bytes=1 << 20, files=2, header={"v": 1})
    writer.open()
    old_run = writer.generation
    writer.open()  # the restarted run
    writer.drain(deque(), close_generation=old_run)  # the old stop, late
    assert writer._file is not None
    writer.drain(deque(), close_generation=writer.generation)  # the current run's own stop
    assert writer._file is None


def test_the_log_never_rotates_away_or_overwrites_what_is_not_a_decision_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory, or another file, at the log's path: left as it is (not renamed to PATH.1, not
    truncated), the failure said once, and each write counted."""
    folder = tmp_path / "mydir"
    folder.mkdir()
    (folder / "data.txt").write_text("keep")
    notes = tmp_path / "notes.txt"
    notes.write_text("important notes")
    for path, files in ((folder, 3), (notes, 1), (notes, 3)):
        writer = LogFileWriter(str(path), max_bytes=1 << 20, files=files, header={"v": 1})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="actors.decision_log"):
            writer.open()
            writer.drain(deque([[]]))
        assert writer.write_errors == 2 and writer.last_error is not None
        (warned,) = [r.getMessage() for r in caplog.records if r.name == "actors.decision_log"]
        assert "left as it is" in warned and str(path) in warned
    assert (folder / "data.txt").read_text() == "keep" and not (tmp_path / "mydir.1").exists()
    assert notes.read_text() == "important notes" and not (tmp_path / "notes.txt.1").exists()


def test_a_rotation_never_deletes_or_replaces_a_rotated_name_that_is_not_a_decision_log(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    first = LogFileWriter(str(path), max_bytes=1 << 20, files=4, header={"v": 1})
    first.open()  # a log of ours at PATH, with a decision in it (one without is not rotated)
    first.drain(deque([[_overloaded(0)]]), close_generation=first.generation)
    (tmp_path / "d.log.3").write_text("someone else's file")  # where the oldest rotation would go
    writer = LogFileWriter(str(path), max_bytes=1 << 20, files=4, header={"v": 1})
    writer.open()
    assert writer.write_errors == 1 and writer.last_error is not None and "d.log.3" in writer.last_error
    assert (tmp_path / "d.log.3").read_text() == "someone else's file"
    assert path.read_bytes().startswith(MAGIC[:-1]) and not (tmp_path / "d.log.1").exists()  # nothing moved


def test_a_run_that_logged_nothing_is_not_rotated_over_the_decisions_before_it(tmp_path: Path) -> None:
    """Each start rotated whatever was at PATH: a crash-looping process pushed the log of the run that
    failed out with header-only files."""
    path = tmp_path / "d.log"
    header = decision_log_header(KvrouteConfig())
    first = LogFileWriter(str(path), max_bytes=1 << 20, files=3, header=header)
    first.open()
    first.drain(deque([[_overloaded(i) for i in range(5)]]), close_generation=first.generation)
    for _ in range(4):  # restarts that log nothing
        writer = LogFileWriter(str(path), max_bytes=1 << 20, files=3, header=header)
        writer.open()
        writer.drain(deque(), close_generation=writer.generation)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["d.log", "d.log.1"]  # the first restart rotated the decisions once; the others overwrote
    assert [c.request_id for c in load_log([str(path) + ".1"]).cases] == [f"q{i}" for i in range(5)]


def test_a_restarted_run_writes_on_in_the_file_it_left_and_rotates_nothing(tmp_path: Path) -> None:
    """Each run of the actor rotated what was at PATH if it held a decision: every crash (one decision
    logged after each) rotated a file away, and with three files kept three crashes deleted the log
    of everything before them."""
    path = tmp_path / "d.log"
    writer = LogFileWriter(str(path), max_bytes=1 << 20, files=3, header=decision_log_header(KvrouteConfig()))
    writer.open()
    writer.drain(deque([[_overloaded(i) for i in range(5)]]), close_generation=writer.generation)
    for run in range(3):  # the actor restarted in the same process, each run logging one decision
        writer.open()
        writer.drain(deque([[_overloaded(5 + run)]]), close_generation=writer.generation)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.log"]
    assert [c.request_id for c in load_log([str(path)]).cases] == [f"q{i}" for i in range(8)]
    assert writer.rotations == 0
    # A file not as this writer left it (another's bytes, a write torn short) is rotated away, as a
    # previous process's is.
    with path.open("ab") as file:
        file.write(b"x")
    writer.open()
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.log", "d.log.1"]


def test_a_restarted_run_never_blocks_on_a_fifo_put_where_its_file_was(tmp_path: Path) -> None:
    """The resume opened PATH plainly: a FIFO there held the open (and the writer's lock) until
    something read it, so the restarted actor never started."""
    path = tmp_path / "d.log"
    writer = LogFileWriter(str(path), max_bytes=1 << 20, files=2, header=decision_log_header(KvrouteConfig()))
    writer.open()
    writer.drain(deque([[_overloaded(0)]]), close_generation=writer.generation)
    path.unlink()
    os.mkfifo(path)
    opened = threading.Thread(target=writer.open, daemon=True)
    opened.start()
    opened.join(10)  # the real clock: a blocked open never returns
    assert not opened.is_alive()
    assert writer.last_error is not None and "named pipe" in writer.last_error


def _kinds(path: Path) -> list[int]:
    return [f.kind for f in parse_frames(str(path), path.read_bytes())]


def test_a_started_log_and_each_batch_it_counts_written_are_on_disk_while_its_file_is_open(tmp_path: Path) -> None:
    """``written`` counts records that reached the file, and a run that dies before its first decision
    leaves a readable log: a reader (or a crash) while the log runs finds the header at once and each
    batch once it is counted, not in the writer's buffer."""
    path = tmp_path / "d.log"
    writer = LogFileWriter(str(path), max_bytes=1 << 20, files=2, header=decision_log_header(KvrouteConfig()))
    writer.open()
    assert _kinds(path) == [KIND_HEADER]
    writer.drain(deque([[_overloaded(0)]]))  # the file stays open for the next batch
    assert writer.written == 1
    assert _kinds(path) == [KIND_HEADER, KIND_DECISION]
    writer.close()


def test_no_file_grows_past_max_bytes_and_each_rotation_is_counted(tmp_path: Path) -> None:
    """A file never grows past decision_log_max_bytes, checked after every record of varying size over
    many rotations; /debug/actors' rotations are the files started for size."""
    path = tmp_path / "d.log"
    max_bytes = 4096
    writer = LogFileWriter(str(path), max_bytes=max_bytes, files=3, header=decision_log_header(KvrouteConfig()))
    writer.open()
    seen, size = 0, os.path.getsize(path)
    for i in range(600):
        rid = "r" * (1 + i % 97)
        decision = RouteDecision(rid, None, None, RouteSource.DOMAIN, Reason.OVERLOADED)
        record = DecisionRecord(RouteRequest(rid, block_cache_keys=(1, 2)), 0.0, overloaded=True, decision=decision)
        writer.drain(deque([[record]]))
        now = os.path.getsize(path)
        assert now <= max_bytes, i
        seen += now < size  # one record a batch: a file that shrank is a new one
        size = now
    writer.close()
    assert writer.rotations == seen > 10


def test_one_file_kept_means_one_file_on_disk(tmp_path: Path) -> None:
    """decision_log_files=1: a rotation replaces PATH, no PATH.1 beside it (the disk bound is files x
    max_bytes), and a restart overwrites what it finds."""
    path = tmp_path / "d.log"
    for _ in range(2):
        writer = LogFileWriter(str(path), max_bytes=4096, files=1, header=decision_log_header(KvrouteConfig()))
        writer.open()
        writer.drain(deque([[_overloaded(i) for i in range(60)]]), close_generation=writer.generation)
        assert writer.rotations >= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.log"]


def test_a_file_describes_each_fleet_once_not_before_every_decision(tmp_path: Path) -> None:
    """The fleet frame comes before the first decision that planned on a new fleet: decisions on the
    same fleet share it, or the file holds the fleet once a decision."""

    def planned_on(i: int, fleet: Fleet) -> DecisionRecord:
        decision = RouteDecision(f"q{i}", None, None, RouteSource.DOMAIN, Reason.NO_POSITIVE_MATCH)
        scoring = ScoringRecord(CandidateSource.HOT, (), fleet, ())
        return DecisionRecord(RouteRequest(f"q{i}", block_cache_keys=(1,)), 0.0, scorings=[scoring], decision=decision)

    one = Fleet.of([WorkerAddr("10.0.0.1", 8000, 8001, 8002), WorkerAddr("10.0.0.2", 8000, 8001, 8002)])
    other = Fleet.of([WorkerAddr("10.0.0.3", 8000, 8001, 8002)])
    path = tmp_path / "d.log"
    writer = LogFileWriter(str(path), max_bytes=1 << 20, files=2, header=decision_log_header(KvrouteConfig()))
    writer.open()
    records = [planned_on(0, one), planned_on(1, one), planned_on(2, other), planned_on(3, other)]
    writer.drain(deque([records]), close_generation=writer.generation)
    described = [KIND_FLEET, KIND_DECISION, KIND_DECISION]
    assert _kinds(path) == [KIND_HEADER, *described, *described]


def test_a_file_whose_header_a_crash_cut_short_is_rotated_away_not_overwritten(tmp_path: Path) -> None:
    """Cut inside its header it is still a decision log, perhaps the only trace of the run that crashed:
    kept as PATH.1 for a look, not truncated by the next start."""
    path = tmp_path / "d.log"
    torn = MAGIC + b"\x00\x00\x01"
    path.write_bytes(torn)
    writer = LogFileWriter(str(path), max_bytes=1 << 20, files=2, header=decision_log_header(KvrouteConfig()))
    writer.open()
    writer.close()
    assert (tmp_path / "d.log.1").read_bytes() == torn
    assert _kinds(path) == [KIND_HEADER]


class FullDisk:
    """A file whose disk fills after ``room`` bytes: the write that does not fit raises ENOSPC."""

    def __init__(self, file: IO[bytes], room: int) -> None:
        self._file = file
        self._room = room

    def fileno(self) -> int:
        return self._file.fileno()

    def write(self, data: bytes) -> int:
        if len(data) > self._room:
            self._file.write(data[: self._room])  # what fitted: the frame is torn
            self._room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._room -= len(data)
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def test_a_full_disk_loses_its_batch_counted_and_the_torn_file_is_read_up_to_the_tear(tmp_path: Path) -> None:
    """A write error dropped the rest of its batch uncounted and counted as written what never
    reached the disk; the file it tore could not be replayed."""
    path = tmp_path / "d.log"
    writer = LogFileWriter(str(path), max_bytes=1 << 20, files=3, header=decision_log_header(KvrouteConfig()))
    writer.open()
    writer.drain(deque([[_overloaded(i) for i in range(3)]]))
    assert writer._file is not None
    one = len(frame(KIND_DECISION, {"pad": ""}))  # about a frame's overhead: the disk fills inside a frame
    writer._file = cast(IO[bytes], FullDisk(writer._file, room=one))
    writer.drain(deque([[_overloaded(i) for i in range(3, 10)]]))
    assert (writer.written, writer.lost, writer.write_errors) == (3, 7, 1)
    writer.drain(deque([[_overloaded(i) for i in range(10, 12)]]), close_generation=writer.generation)
    assert (writer.written, writer.lost) == (5, 7)  # room again: a new file
    torn = load_log([str(path) + ".1"])
    assert [c.request_id for c in torn.cases] == ["q0", "q1", "q2"] and len(torn.torn) == 1
    assert [c.request_id for c in load_log([str(path)]).cases] == ["q10", "q11"]


def test_a_record_that_fits_only_without_its_fleet_is_not_written_past_the_size_bound(tmp_path: Path) -> None:
    """A record checked against the bound without its fleet frame (its fleet already described) was
    written after a rotation with the fleet again, past max_bytes."""
    max_bytes = 4096
    for n in range(80, 140, 4):
        folder = tmp_path / str(n)
        folder.mkdir()
        fleet = Fleet.of(WorkerAddr(f"10.0.{i // 250}.{i % 250}", 8000, 8001, 8002) for i in range(n))

        def record(rid: str, fleet: Fleet = fleet) -> DecisionRecord:
            decision = RouteDecision(rid, None, None, RouteSource.DOMAIN, Reason.NO_POSITIVE_MATCH)
            scoring = ScoringRecord(CandidateSource.HOT, (), fleet, ())
            return DecisionRecord(RouteRequest(rid, block_cache_keys=(1,)), 0.0, scorings=[scoring], decision=decision)

        header = decision_log_header(KvrouteConfig())
        writer = LogFileWriter(str(folder / "d.log"), max_bytes=max_bytes, files=3, header=header)
        writer.open()
        writer.drain(deque([[record("a"), record("b" * 600)]]), close_generation=writer.generation)
        assert all(p.stat().st_size <= max_bytes for p in folder.iterdir()), (n, writer.oversize)


def test_a_log_that_cannot_be_written_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = LogFileWriter(str(tmp_path / "nope" / "d.log"), max_bytes=1 << 20, files=2, header={"v": 1})
    with caplog.at_level(logging.WARNING, logger="actors.decision_log"):
        writer.open()
        writer.drain(deque([[]]))
        writer.drain(deque([[]]))
    assert writer.write_errors == 3
    warned = [r.getMessage() for r in caplog.records if r.name == "actors.decision_log"]
    assert len(warned) == 1 and "cannot write" in warned[0] and "nope" in warned[0]


def test_a_request_with_roles_of_the_wrong_type_is_refused_before_the_log_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Roles given as strings: refused naming the field before a record is made. The log's encoder
    expects Role values: such a record crashed the log actor, which rotated its file on restart."""
    log = tmp_path / "decisions.log"
    submitted: list[str] = []
    real_submit = DecisionLog.submit

    def submit(self: DecisionLog, record: DecisionRecord) -> bool:
        submitted.append(record.request.request_id)
        return real_submit(self, record)

    monkeypatch.setattr(DecisionLog, "submit", submit)

    async def record(log: Path) -> RouteDecision:
        async with cluster_router(log) as (handle, _):
            bad = RouteRequest("bad-roles", token_ids=PROMPT, roles=("PREFILL",))  # type: ignore[arg-type]
            decision = await handle.route(bad)
            await handle.route(RouteRequest("fine", token_ids=PROMPT, budget_ms=50))
        return decision

    decision = on_mock_clock(record, log)
    assert decision.reason is Reason.BAD_REQUEST and (decision.error or "").startswith("roles:")
    assert submitted == ["fine"]
    assert [case.request_id for case in load_log([str(log)]).cases] == ["fine"]


def test_a_full_inbox_drops_and_counts_each_record_it_refuses(tmp_path: Path) -> None:
    """The inbox is bounded by decision_log_inbox_size: what a full one refuses is dropped and counted,
    never queued without bound behind a slow disk."""
    router = RouterConfig(decision_log=str(tmp_path / "decisions.log"), decision_log_inbox_size=3)
    log = DecisionLog(router, decision_log_header(KvrouteConfig(router=router)))  # not running: nothing drains
    taken = [log.submit(_overloaded(i)) for i in range(5)]
    assert taken == [True, True, True, False, False]
    health = log.health()
    assert (health.dropped, health.inbox_depth, health.inbox_capacity) == (2, 3, 3)


def test_a_queued_record_keeps_no_prompt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log writes a request's id, budget, deadline and roles and its keys' digest; a record that
    kept the whole request held every token id while it waited in the log's inbox."""
    queued: list[DecisionRecord] = []
    submit = DecisionLog.submit

    def kept(self: DecisionLog, record: DecisionRecord) -> bool:
        queued.append(record)
        return submit(self, record)

    monkeypatch.setattr(DecisionLog, "submit", kept)

    async def route(log: Path) -> None:
        async with cluster_router(log, max_in_flight=1) as (handle, _):
            await handle.route(RouteRequest("prompt", token_ids=PROMPT, budget_ms=50))
            await handle.route(RouteRequest("keys", block_cache_keys=KEYS, block_size=BLOCK, budget_ms=50))

    on_mock_clock(route, tmp_path / "decisions.log")
    assert [r.request.request_id for r in queued] == ["prompt", "keys"]
    assert all(r.request.token_ids is None and r.request.block_cache_keys is None for r in queued)
    assert all(r.prepared is not None and r.prepared.keys == KEYS for r in queued)  # what the log writes


def test_a_request_refused_for_its_long_id_is_recorded_with_its_id_cut_and_the_file_replays(tmp_path: Path) -> None:
    """The id limit is checked on the routing path, after the record was made with the whole id: a
    17 MiB id made a frame over what a reader takes, and every decision of its file unreplayable."""
    log = tmp_path / "decisions.log"
    limit = LimitsConfig().max_request_id_bytes
    huge = "x" * (17 * 2**20)

    async def record(log: Path) -> list[RouteDecision]:
        async with cluster_router(log) as (handle, _):
            ids = ("before", huge, "after")
            return [await handle.route(RouteRequest(rid, token_ids=PROMPT, budget_ms=50)) for rid in ids]

    decisions = on_mock_clock(record, log)
    assert decisions[1].reason is Reason.BAD_REQUEST and (decisions[1].error or "").startswith("request_id:")
    assert [case.request_id for case in load_log([str(log)]).cases] == ["before", "x" * (limit + 1), "after"]
    assert replay_all(log) == (3, 3)  # the cut id is still refused as too long


def test_a_record_with_a_frame_over_what_a_reader_takes_is_counted_oversize_not_written(tmp_path: Path) -> None:
    """Checked only against the file's size bound (64 MiB by default), such a frame made the file
    unreadable from its offset on, the decisions before it included."""
    path = tmp_path / "d.log"
    writer = LogFileWriter(str(path), max_bytes=64 * 2**20, files=2, header=decision_log_header(KvrouteConfig()))
    writer.open()
    big = _overloaded(1)
    big.request = RouteRequest("y" * (17 * 2**20), block_cache_keys=(1, 2))  # past the record's own cut
    writer.drain(deque([[_overloaded(0), big, _overloaded(2)]]), close_generation=writer.generation)
    writer.close()
    assert writer.oversize == 1
    assert [case.request_id for case in load_log([str(path)]).cases] == ["q0", "q2"]


@pytest.mark.parametrize("gone", ["the file", "the directory"])
def test_a_log_file_deleted_under_the_writer_is_started_again_or_its_batches_counted_lost(
    tmp_path: Path, gone: str
) -> None:
    """Records went on into the deleted file, counted written, until the next rotation's rename failed
    and lost a whole batch."""
    folder = tmp_path / "logs"
    folder.mkdir()
    path = folder / "d.log"
    writer = LogFileWriter(str(path), max_bytes=64 * 2**20, files=2, header=decision_log_header(KvrouteConfig()))
    writer.open()
    writer.drain(deque([[_overloaded(0), _overloaded(1)]]))
    if gone == "the file":
        path.unlink()
    else:
        path.unlink()
        folder.rmdir()
    writer.drain(deque([[_overloaded(2), _overloaded(3)]]), close_generation=writer.generation)
    if gone == "the file":
        assert (writer.written, writer.lost) == (4, 0)
        assert [case.request_id for case in load_log([str(path)]).cases] == ["q2", "q3"]
    else:
        assert (writer.written, writer.lost, writer.write_errors) == (2, 2, 1)
        assert writer.last_error is not None and "d.log" in writer.last_error


def test_a_log_file_truncated_under_the_writer_starts_again_with_its_header(tmp_path: Path) -> None:
    """logrotate's copytruncate (or ``: > PATH``) keeps the inode: records went on at the old offset
    after a run of zero bytes and no header, counted written and read by nobody, and the next
    rotations refused to move the file, losing every batch after."""
    path = tmp_path / "t.log"
    writer = LogFileWriter(str(path), max_bytes=64 * 2**20, files=2, header=decision_log_header(KvrouteConfig()))
    writer.open()
    writer.drain(deque([[_overloaded(0), _overloaded(1)]]))
    os.truncate(path, 0)
    writer.drain(deque([[_overloaded(2), _overloaded(3)]]), close_generation=writer.generation)
    assert (writer.written, writer.lost, writer.write_errors) == (4, 0, 0)
    assert [case.request_id for case in load_log([str(path)]).cases] == ["q2", "q3"]


def test_prompts_shorter_than_a_block_replay_as_recorded_in_logs_from_before_they_were_scored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such a prompt is now scored on the cold set, KVCM's known empty answer recorded as (); a log
    written before, with no answer (None), sent it to the domain's draw and must replay so, not as
    a change (which a what-if would blame on its setting)."""
    new_log, old_log = tmp_path / "new.log", tmp_path / "old.log"

    async def record(log: Path) -> list[RouteDecision]:
        async with cluster_router(log) as (handle, cluster):
            for i in range(10):  # worker 0 busy: the load decides where the draw did not
                cluster.workers[0].submit(f"queued{i}", 8000, 0, trio.current_time())
            shorts = [tuple(range(50_000 * (i + 1), 50_000 * (i + 1) + BLOCK - 1)) for i in range(8)]
            return [await handle.route(RouteRequest(f"s{i}", token_ids=p, budget_ms=50)) for i, p in enumerate(shorts)]

    scored = on_mock_clock(record, new_log)
    assert {(d.route_source, d.reason) for d in scored} == {(RouteSource.SHADOW, Reason.SHORTEST_TTFT_LOW_CACHE_HIT)}
    assert replay_all(new_log) == (8, 8)
    query = KvcmSource._query

    async def as_before(self: KvcmSource, ctx: RequestContext) -> tuple[HostMatch, ...] | FellThrough:
        if not ctx.prepared.keys:  # the writer before: no answer set
            return FellThrough(Reason.NO_POSITIVE_MATCH)
        return await query(self, ctx)

    monkeypatch.setattr(KvcmSource, "_query", as_before)
    drawn = on_mock_clock(record, old_log)
    monkeypatch.undo()
    assert {(d.route_source, d.reason) for d in drawn} == {(RouteSource.DOMAIN, Reason.NO_POSITIVE_MATCH)}
    assert replay_all(old_log) == (8, 8)


async def test_a_file_size_the_header_alone_would_fill_is_refused_naming_the_setting(tmp_path: Path) -> None:
    """Each file's header records the settings given: with a long workers list it was larger than the
    smallest file size allowed, every file broke the bound at its first write, and every decision was
    dropped as oversize, with nothing said."""
    workers = ",".join(f"10.1.{i // 250}.{i % 250}:8000" for i in range(300))
    config = _config("10.0.0.1:6381", workers, tmp_path / "d.log", decision_log_max_bytes=4096)
    with pytest.raises(ConfigError, match=r"router\.decision_log_max_bytes: each file's header") as refused:
        async with open_router(config, rpc=MemoryNetwork()):
            raise AssertionError("the router started")
    assert not (tmp_path / "d.log").exists()
    needed = int(str(refused.value).rpartition(" ")[2])
    enough = replace(config, router=replace(config.router, decision_log_max_bytes=needed))
    async with open_router(enough, rpc=MemoryNetwork()):
        pass


async def test_every_actor_with_an_inbox_reports_its_depth_on_metrics(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The scorer's, the prober's, hit accuracy's and the decision log's inboxes were on /debug/actors
    only (hit accuracy's nowhere)."""
    async with cluster_router(tmp_path / "decisions.log") as (handle, _):
        await handle.route(RouteRequest("r", token_ids=PROMPT, budget_ms=50))
        registry = handle.metrics.registry
        reported = {
            actor
            for actor in ("router", "metrics_sink", "shadow_index", "leader_resolver", "scorer", "worker_prober",
                          "hit_accuracy", "decision_log")
            if registry.get_sample_value("kvroute_inbox_depth", {"actor": actor}) is not None
        }
        # And whether the router can route, as its readiness says, to alert on.
        assert registry.get_sample_value("kvroute_ready") == 1.0, handle.ready()
    assert reported == {
        "router", "metrics_sink", "shadow_index", "leader_resolver", "scorer", "worker_prober", "hit_accuracy",
        "decision_log",
    }
    assert registry.get_sample_value("kvroute_ready") == 0.0  # closed: it routes no more
