"""Predicted vs reported cache hits: a routed request's prediction meets the prefix its worker reports
(MockClock; SimCluster on a MemoryNetwork; every actor real, the dispatch to the worker made by the test
as a frontend would)."""

from __future__ import annotations

import gc
import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio
import trio.testing

from actors.hit_accuracy import WARNING_MIN_COMPARISONS, AccuracyHealth, HitAccuracy
from actors.metrics_sink import MetricsSink
from kvroute_sim.demo import key_family
from kvroute_sim.sim.cluster import SimCluster
from router.api import open_router
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig, MetricsConfig
from router.keys import block_keys
from router.supervisor import RouterHandle
from router.transport.errors import GarbledReply
from router.transport.memory_adapter import MemoryNetwork
from router.types import KeyFamily, RouteRequest, RouteSource, WorkerStatus
from router.wire import engine_status_pb2 as engine_pb
from router.wire.decode import decode_worker_status

BLOCK = 16
PROMPT = tuple(range(5000, 5000 + 8 * BLOCK))
KEYS = block_keys(PROMPT, BLOCK, KeyFamily.RTP)


def sample(handle: RouterHandle, name: str, **labels: str) -> float | None:
    value = handle.metrics.registry.get_sample_value(name, labels)
    return None if value is None else float(value)


async def test_a_prediction_is_compared_with_the_prefix_the_worker_reports(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = SimCluster(workers=3, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    holder = cluster.worker_addr(1)
    cluster.kvcm.record_prefill(holder.http_target, KEYS)  # KVCM says worker 1 holds all 8 blocks
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.fail_after(1):
            await resolver.leader()
        decisions = []
        for i, cached in enumerate((len(PROMPT), 0)):  # the engine finds the whole prefix, then none of it
            d = await handle.route(RouteRequest(f"acc{i}", token_ids=PROMPT, budget_ms=50))
            assert d.route_source is RouteSource.KVCM and d.worker == holder and d.hit_tokens == len(PROMPT)
            decisions.append(d)
            # The frontend dispatches it; the worker's next status lists the task with what it found cached.
            cluster.workers[1].submit(d.request_id, len(PROMPT), cached, trio.current_time(), output_tokens=64)
            await trio.sleep(0.2)  # past the status TTL: the next route probes the worker again
            handle.prober().probe([holder], trio.current_time() + 0.05)
            await trio.sleep(0.1)
        await trio.testing.wait_all_tasks_blocked()
        health = handle.actors()["hit_accuracy"]["health"]
        assert isinstance(health, AccuracyHealth)
        assert (health.matched, health.silent_zero, health.pending) == (2, 1, 0)
        assert health.recent_by_worker[holder.http_target] == 0.5
        assert sample(handle, "kvroute_hit_silent_zero_total", route_source="kvcm") == 1
        assert sample(handle, "kvroute_hit_actual_over_predicted_count", route_source="kvcm") == 2
        assert sample(handle, "kvroute_hit_error_tokens_sum", route_source="kvcm") == len(PROMPT)


async def test_readiness_warns_while_predicted_hits_keep_finding_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A mismatch between kvroute's keys and the engines' (here: every dispatch finds nothing cached)
    shows in /readyz's reason once enough comparisons agree; routing itself stays ready."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    holder = cluster.worker_addr(0)
    cluster.kvcm.record_prefill(holder.http_target, KEYS)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()
        assert resolver is not None
        with trio.fail_after(1):
            await resolver.leader()
        assert "warning" not in handle.ready()[1]
        for i in range(25):
            d = await handle.route(RouteRequest(f"miss{i}", token_ids=PROMPT, budget_ms=50))
            assert d.worker == holder and d.hit_tokens > 0
            cluster.workers[0].submit(d.request_id, len(PROMPT), 0, trio.current_time(), output_tokens=64)
            await trio.sleep(0.2)
            handle.prober().probe([holder], trio.current_time() + 0.05)
            await trio.sleep(0.1)
        await trio.testing.wait_all_tasks_blocked()
        ready, why = handle.ready()
        assert ready and "warning: 100% of the last 25 routed requests found no cached prefix" in why


def test_a_wrong_key_family_fires_the_silent_zero_signal_and_the_right_one_does_not() -> None:
    """The demo's wrong-key-family runs under MockClock: the engines match the router's forwarded keys
    against blocks registered under their own family."""
    runs = {
        family: trio.run(
            partial(key_family.measure_family, family, network=MemoryNetwork(), requests=30),
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
        for family in (key_family.ENGINE_FAMILY, key_family.WRONG_FAMILY)
    }
    right, wrong = runs[key_family.ENGINE_FAMILY], runs[key_family.WRONG_FAMILY]
    assert right.predicted > 0 and right.silent_zero == 0 and right.warning is None
    assert right.actual_over_predicted == 1.0
    assert wrong.predicted > 0 and wrong.silent_zero == wrong.compared > 0
    assert wrong.silent_zero_metric == wrong.silent_zero and right.silent_zero_metric == 0
    assert wrong.warning is not None and "key family" in wrong.warning


def test_the_wrong_key_family_scenario_prints_both_families_and_passes() -> None:
    out = io.StringIO()
    status = key_family.run(out, clock=trio.testing.MockClock(autojump_threshold=0), in_memory=True, requests=25)
    text = out.getvalue()
    assert status == 0, text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("rtp ", "vllm "))}
    assert rows["rtp"][-1] == "no" and rows["vllm"][-1] == "yes"
    assert "readiness warning (wrong family)" in text


def test_the_wrong_key_family_scenario_at_its_smallest_scale_still_fires_and_takes_overrides() -> None:
    """--scenario-scale takes the runs down to MIN_REQUESTS at most: enough compared predictions for the
    readiness warning. A --router-setting reaches both runs' routers: with the warning off it cannot fire."""
    requests = key_family.requests_at(0.01)
    fired = key_family.run(
        io.StringIO(), clock=trio.testing.MockClock(autojump_threshold=0), in_memory=True, requests=requests
    )
    assert fired == 0
    out = io.StringIO()
    silenced = {"metrics_accuracy_warn_silent_share": 0.0}
    status = key_family.run(
        out, clock=trio.testing.MockClock(autojump_threshold=0), in_memory=True, requests=requests, overrides=silenced
    )
    text = out.getvalue()
    assert status == 1, text
    assert "router settings: budget_cap_ms=50.0, metrics_accuracy_warn_silent_share=0.0" in text.splitlines()[0]


def _running(worker: str, request_id: str, *, prefix: int, version: int, input_length: int = 8192) -> WorkerStatus:
    """``worker``'s status listing ``request_id`` running, with ``prefix`` tokens found cached."""
    task = engine_pb.TaskInfoPB(
        request_id=request_id, input_length=input_length, prefix_length=prefix, prefix_length_valid=True
    )
    reply = engine_pb.WorkerStatusPB(role="PREFILL", alive=True, status_version=version, running_task_info=[task])
    return decode_worker_status(reply.SerializeToString(), worker)


@asynccontextmanager
async def running_accuracy(config: MetricsConfig) -> AsyncIterator[HitAccuracy]:
    """A HitAccuracy actor and its metrics sink, both running for the block."""
    sink = MetricsSink(config)
    accuracy = HitAccuracy(config, sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await nursery.start(accuracy.run)
        yield accuracy
        nursery.cancel_scope.cancel()


async def test_a_queued_task_whose_prefix_is_not_matched_yet_leaves_the_prediction_pending(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A queued task reports prefix_length 0 with prefix_length_valid false: taken as the actual hit,
    it counted a silent zero (the readiness warning of a key-family mismatch) and dropped the
    prediction before the running task reported the prefix the engine really reused."""
    worker = "10.0.0.1:8000"

    def status(*, waiting: bool, prefix: int, valid: bool) -> WorkerStatus:
        task = engine_pb.TaskInfoPB(
            request_id="req-1", input_length=8192, prefix_length=prefix, is_waiting=waiting, prefix_length_valid=valid
        )
        reply = engine_pb.WorkerStatusPB(role="PREFILL", alive=True, status_version=1, running_task_info=[task])
        return decode_worker_status(reply.SerializeToString(), worker)

    async with running_accuracy(MetricsConfig()) as accuracy:
        accuracy.predict("req-1", worker, 4096, RouteSource.KVCM, trio.current_time())
        accuracy.status_seen(worker, status(waiting=True, prefix=0, valid=False))
        await trio.testing.wait_all_tasks_blocked()
        assert (accuracy.health().matched, accuracy.health().pending) == (0, 1)
        accuracy.status_seen(worker, status(waiting=False, prefix=4096, valid=True))
        await trio.testing.wait_all_tasks_blocked()
        health = accuracy.health()
        assert (health.matched, health.silent_zero, health.pending) == (1, 0, 0)
        assert health.recent_by_worker[worker] == 1.0
        # A status right after a prediction, before the owner took it (handed over unbuffered), is
        # compared too: it used to be dropped as if nothing were waiting for it.
        accuracy.predict("req-2", worker, 4096, RouteSource.KVCM, trio.current_time())
        accuracy.status_seen(worker, _running(worker, "req-2", prefix=2048, version=2))
        await trio.testing.wait_all_tasks_blocked()
        assert (accuracy.health().matched, accuracy.health().pending) == (2, 0)


async def test_a_prediction_expires_on_time_with_no_traffic_and_a_late_status_is_not_compared(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Predictions expired only when a newer one arrived: once traffic stopped they stayed pending for
    ever, and a status listing one an hour later was still compared (a silent zero, here)."""
    worker = "10.0.0.1:8000"
    async with running_accuracy(MetricsConfig(accuracy_ttl_s=60.0, accuracy_pending_max=2)) as accuracy:
        for i in range(3):  # one more than the bound: the first is evicted, not expired
            accuracy.predict(f"req-{i}", worker, 4096, RouteSource.KVCM, trio.current_time())
        await trio.testing.wait_all_tasks_blocked()
        health = accuracy.health()
        assert (health.pending, health.evicted, health.expired) == (2, 1, 0)
        await trio.sleep(59.0)
        assert accuracy.health().pending == 2
        await trio.sleep(2.0)  # no message arrives: the owner's timer expires them
        health = accuracy.health()
        assert (health.pending, health.evicted, health.expired) == (0, 1, 2)
        accuracy.status_seen(worker, _running(worker, "req-2", prefix=0, version=1))
        await trio.testing.wait_all_tasks_blocked()
        assert (accuracy.health().matched, accuracy.health().silent_zero) == (0, 0)


async def test_predictions_held_across_a_restart_still_expire_with_no_traffic(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A restarted task made a new expiry alarm but set it only on a change: the predictions it took
    over stayed pending, with no traffic, for good."""
    worker = "10.0.0.1:8000"
    sink = MetricsSink(MetricsConfig())
    accuracy = HitAccuracy(MetricsConfig(accuracy_ttl_s=60.0), sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        async with trio.open_nursery() as first_run:
            await first_run.start(accuracy.run)
            accuracy.predict("req-1", worker, 4096, RouteSource.KVCM, trio.current_time())
            await trio.testing.wait_all_tasks_blocked()
            assert accuracy.health().pending == 1
            first_run.cancel_scope.cancel()  # its task ends, as a crash ends it
        await nursery.start(accuracy.run)  # as a supervisor restarts it
        await trio.sleep(61.0)
        assert (accuracy.health().pending, accuracy.health().expired) == (0, 1)
        nursery.cancel_scope.cancel()


async def test_a_prediction_after_a_compared_one_still_expires_on_time_with_no_traffic(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The expiry alarm is set at the oldest prediction's TTL; when that one is compared first, the alarm
    rings early, finds nothing due, and is set again for the next."""
    worker = "10.0.0.1:8000"
    async with running_accuracy(MetricsConfig(accuracy_ttl_s=60.0)) as accuracy:
        accuracy.predict("req-a", worker, 4096, RouteSource.KVCM, trio.current_time())
        await trio.sleep(10.0)
        accuracy.predict("req-b", worker, 4096, RouteSource.KVCM, trio.current_time())
        await trio.sleep(10.0)
        accuracy.status_seen(worker, _running(worker, "req-a", prefix=4096, version=1))
        await trio.testing.wait_all_tasks_blocked()
        assert (accuracy.health().matched, accuracy.health().pending) == (1, 1)
        await trio.sleep(49.0)  # t = 69: req-b was made at 10
        assert (accuracy.health().pending, accuracy.health().expired) == (1, 0)
        await trio.sleep(2.0)
        assert (accuracy.health().pending, accuracy.health().expired) == (0, 1)


async def test_a_batch_leaves_no_cancel_scope_behind(autojump_clock: trio.testing.MockClock) -> None:
    """A decision's prediction is a batch of its own at a few hundred decisions a second. Waiting for
    the next with a deadline scope left one scope a batch in trio's deadline heap until the TTL passed:
    the heap drops an exited scope's entry only once it is at the top, and a router always has an
    earlier deadline there (a request's, the lag probe's), so thousands of them waited to be pruned."""
    worker = "10.0.0.1:8000"
    async with running_accuracy(MetricsConfig(accuracy_ttl_s=60.0)) as accuracy:
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        scopes_before = sum(isinstance(o, trio.CancelScope) for o in gc.get_objects())
        with trio.CancelScope(deadline=trio.current_time() + 30.0):  # the earlier deadline on top
            for i in range(300):
                accuracy.predict(f"req-{i}", worker, 4096, RouteSource.KVCM, trio.current_time())
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(0.01)
            gc.collect()
            scopes_after = sum(isinstance(o, trio.CancelScope) for o in gc.get_objects())
        assert accuracy.health().pending == 300
        assert scopes_after - scopes_before < 30


async def test_a_full_inbox_drops_and_counts_the_messages_it_refuses(autojump_clock: trio.testing.MockClock) -> None:
    """The inbox is bounded by accuracy_inbox_size: predictions sent while the owner cannot keep up
    are dropped and counted, not queued without bound."""
    config = MetricsConfig(accuracy_inbox_size=2)
    sink = MetricsSink(config)
    accuracy = HitAccuracy(config, sink)
    for i in range(5):  # before the owner runs: only the inbox's room is taken
        accuracy.predict(f"req-{i}", "10.0.0.1:8000", 4096, RouteSource.KVCM, trio.current_time())
    # Seen before the owner publishes anything: the senders' count and the inbox as it is.
    health = accuracy.health()
    assert (health.dropped, health.inbox_depth, health.inbox_capacity) == (3, 2, 2)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        await nursery.start(accuracy.run)
        await trio.testing.wait_all_tasks_blocked()
        assert (accuracy.health().pending, accuracy.health().dropped) == (2, 3)
        nursery.cancel_scope.cancel()


def test_the_wrong_key_family_verdict_needs_the_right_family_judged_as_often_as_the_warning_needs() -> None:
    """A right-family run with no comparison has no silent zero either: a router that predicted nothing
    passed."""

    def figures(family: KeyFamily, *, compared: int, silent_zero: int, warning: str | None) -> key_family.FamilyFigures:
        return key_family.FamilyFigures(family, 30, compared, 100 * compared, 0, silent_zero, compared, 0.0, warning)

    wrong = figures(key_family.WRONG_FAMILY, compared=26, silent_zero=26, warning="check the key family")
    judged = figures(key_family.ENGINE_FAMILY, compared=WARNING_MIN_COMPARISONS, silent_zero=0, warning=None)
    assert key_family.passes(judged, wrong)
    unjudged = figures(key_family.ENGINE_FAMILY, compared=WARNING_MIN_COMPARISONS - 1, silent_zero=0, warning=None)
    assert not key_family.passes(unjudged, wrong)
    assert not key_family.passes(judged, figures(key_family.WRONG_FAMILY, compared=26, silent_zero=26, warning=None))


async def test_a_prefill_finished_between_two_polls_is_compared_from_the_finished_list(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request whose prefill began and ended between two status polls is only in the finished task
    list, which kvroute did not read: its prediction expired uncompared, so the accuracy
    figures and the silent-zero warning came from longer prefills alone."""
    worker = "10.0.0.1:8000"
    finished = engine_pb.TaskInfoPB(request_id="short", input_length=1024, prefix_length=512, prefix_length_valid=True)
    reply = engine_pb.WorkerStatusPB(role="PREFILL", alive=True, status_version=3, finished_task_list=[finished])
    status = decode_worker_status(reply.SerializeToString(), worker)
    assert status.finished[0].request_id == "short" and status.running == status.waiting == ()
    assert status.outstanding_uncached_tokens == 0  # finished: no load any more
    async with running_accuracy(MetricsConfig()) as accuracy:
        accuracy.predict("short", worker, 512, RouteSource.KVCM, trio.current_time())
        accuracy.status_seen(worker, status)
        await trio.testing.wait_all_tasks_blocked()
        health = accuracy.health()
        assert (health.matched, health.silent_zero, health.pending) == (1, 0, 0)


def test_a_finished_task_with_a_negative_length_is_garbled() -> None:
    bad = engine_pb.TaskInfoPB(request_id="x", input_length=-1, prefix_length=0)
    reply = engine_pb.WorkerStatusPB(role="PREFILL", alive=True, status_version=1, finished_task_list=[bad])
    with pytest.raises(GarbledReply, match=r"finished_task_list\[0\]: negative length"):
        decode_worker_status(reply.SerializeToString(), "10.0.0.1:8000")


async def test_the_same_request_listed_by_another_worker_is_not_compared(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The comparison is with the prefix the predicted worker reports: the id on another worker's status
    (the frontend sent it elsewhere) is not what the prediction was about, and must not count as a
    silent zero."""
    routed, other = "10.0.0.1:8000", "10.0.0.2:8000"
    async with running_accuracy(MetricsConfig()) as accuracy:
        accuracy.predict("r1", routed, 4096, RouteSource.KVCM, trio.current_time())
        accuracy.status_seen(other, _running(other, "r1", prefix=0, version=1))
        await trio.testing.wait_all_tasks_blocked()
        health = accuracy.health()
        assert (health.pending, health.matched, health.silent_zero) == (1, 0, 0)
        accuracy.status_seen(routed, _running(routed, "r1", prefix=4096, version=1))
        await trio.testing.wait_all_tasks_blocked()
        health = accuracy.health()
        assert (health.pending, health.matched, health.silent_zero) == (0, 1, 0)
        assert health.recent_by_worker == {routed: 1.0}


async def test_a_reported_prefix_longer_than_the_prompt_counts_as_the_whole_prompt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The hit is at most the prompt: an engine reporting a prefix past its input must not show an
    accuracy above what could have been cached."""
    worker = "10.0.0.1:8000"
    async with running_accuracy(MetricsConfig()) as accuracy:
        accuracy.predict("r1", worker, 200, RouteSource.KVCM, trio.current_time())
        accuracy.status_seen(worker, _running(worker, "r1", prefix=9000, version=1, input_length=100))
        await trio.testing.wait_all_tasks_blocked()
        health = accuracy.health()
        assert health.matched == 1 and health.recent_by_worker == {worker: 0.5}


async def _compared(accuracy: HitAccuracy, silent: list[bool]) -> AccuracyHealth:
    """One prediction compared per entry (a silent zero where True); the health after them."""
    worker = "10.0.0.1:8000"
    for zero in silent:
        rid = f"r{accuracy.health().matched}"
        accuracy.predict(rid, worker, 4096, RouteSource.KVCM, trio.current_time())
        accuracy.status_seen(worker, _running(worker, rid, prefix=0 if zero else 4096, version=1))
        await trio.testing.wait_all_tasks_blocked()
    return accuracy.health()


async def test_the_silent_zero_warning_needs_at_least_its_minimum_of_comparisons_and_comes_at_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A few unlucky dispatches at start-up are no key-family mismatch; WARNING_MIN_COMPARISONS are."""
    async with running_accuracy(MetricsConfig()) as accuracy:
        before = await _compared(accuracy, [True] * (WARNING_MIN_COMPARISONS - 1))
        assert before.silent_zero == WARNING_MIN_COMPARISONS - 1 and before.warning is None
        assert (await _compared(accuracy, [True])).warning is not None


async def test_a_silent_zero_share_of_exactly_the_threshold_does_not_warn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The warning is for a share above accuracy_warn_silent_share: at it, readiness still says nothing."""
    async with running_accuracy(MetricsConfig(accuracy_warn_silent_share=0.25)) as accuracy:
        exactly = await _compared(accuracy, [True] * 5 + [False] * 15)
        assert exactly.silent_zero_share == 0.25 and exactly.warning is None
        assert (await _compared(accuracy, [True])).warning is not None


async def test_the_silent_zero_share_is_of_the_last_200_comparisons_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The window moves: the first 100 comparisons (silent zeros) leave it as 300 more come, the silent
    ones among those counted as they enter and again as they leave; the all-time count keeps them all."""
    async with running_accuracy(MetricsConfig(accuracy_warn_silent_share=0.5)) as accuracy:
        full = await _compared(accuracy, [True] * 100 + [False, True] * 50)
        assert full.silent_zero_share == 0.75 and full.warning is not None
        moved = await _compared(accuracy, [False] * 150)  # the last 50 alternating remain: 25 silent
        assert moved.silent_zero_share == 0.125 and moved.warning is None and moved.silent_zero == 150
        cleared = await _compared(accuracy, [False] * 50)
        assert cleared.silent_zero_share == 0.0 and cleared.matched == 400


async def test_the_snapshot_shows_the_64_workers_compared_most_recently(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """/debug/actors' recent_by_worker is bounded: a large fleet shows its latest compared workers."""
    workers = [f"10.0.{i}.1:8000" for i in range(70)]
    async with running_accuracy(MetricsConfig()) as accuracy:
        for i, worker in enumerate(workers):
            accuracy.predict(f"r{i}", worker, 4096, RouteSource.KVCM, trio.current_time())
            accuracy.status_seen(worker, _running(worker, f"r{i}", prefix=4096, version=1))
            await trio.testing.wait_all_tasks_blocked()
        assert list(accuracy.health().recent_by_worker) == workers[-64:]


async def test_predictions_waiting_out_their_ttl_cost_the_collector_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Where no engine lists request ids, every prediction waits out the TTL: thousands at a time. Kept
    as tuples of strings and numbers, which the collector stops tracking, they add no object the
    collector walks (objects of their own would add one each)."""
    metrics = MetricsSink(MetricsConfig())
    accuracy = HitAccuracy(MetricsConfig(accuracy_inbox_size=4096), metrics)
    async with trio.open_nursery() as nursery:
        await nursery.start(accuracy.run)
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        tracked_before = len(gc.get_objects())
        for i in range(2000):
            accuracy.predict(f"r{i}", "10.0.0.1:8000", 512, RouteSource.KVCM, trio.current_time())
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        tracked_after = len(gc.get_objects())
        assert accuracy.health().pending == 2000
        assert tracked_after - tracked_before < 200
        nursery.cancel_scope.cancel()
