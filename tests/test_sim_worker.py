"""SimWorker core: queueing and TTFT, generation-K status replies, status versions, faults.

Replies are checked through the real decoder (router.wire.decode.decode_worker_status).
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kvroute_sim.sim.faults import Garble
from kvroute_sim.sim.memory_server import memory_handler
from kvroute_sim.sim.worker import SimWorker, SimWorkerOverloaded, WorkerFaults, WorkerSpec
from router.transport.clients import WorkerStatusClient
from router.transport.errors import GarbledReply, RpcStatus, Unavailable
from router.transport.memory_adapter import MemoryNetwork
from router.types import KvCacheGroupMode, Role, WorkerStatus
from router.wire import decode, paths
from router.wire import engine_status_pb2 as engine_pb

TPS = 1000.0  # tokens per second: 1 token = 1 ms


def _worker(**spec: object) -> SimWorker:
    return SimWorker("w", WorkerSpec(prefill_tokens_per_s=TPS, **spec))  # type: ignore[arg-type]


def _status(worker: SimWorker, now: float, latest_finished_version: int = -1) -> WorkerStatus:
    return decode.decode_worker_status(worker.status_reply(latest_finished_version, now), "w")


# ---- queueing and TTFT ----


def test_ttft_is_queue_wait_plus_uncached_prefill() -> None:
    worker = _worker()
    assert worker.submit("a", 1000, 0, 10.0) == pytest.approx(1.0)
    assert worker.submit("b", 600, 200, 10.0) == pytest.approx(1.0 + 0.4)  # waits for a
    assert worker.submit("c", 100, 0, 10.5) == pytest.approx(0.9 + 0.1)  # a has 0.5 s left, then b
    assert worker.submit("d", 100, 0, 20.0) == pytest.approx(0.1)  # idle again


def test_fully_cached_prompt_still_computes_one_token() -> None:
    worker = _worker()
    assert worker.submit("a", 500, 500, 0.0) == pytest.approx(1 / TPS)


def test_outstanding_tokens_and_queue_length_drain_with_time() -> None:
    worker = _worker()
    worker.submit("a", 1000, 0, 0.0)
    worker.submit("b", 1000, 400, 0.0)
    assert worker.outstanding_tokens(0.0) == 1600
    assert worker.outstanding_tokens(0.25) == 1350
    assert worker.queue_length(1.0) == 1
    assert worker.outstanding_tokens(1.0) == 600
    assert worker.queue_length(1.6) == 0
    assert (worker.requests_submitted, worker.prefill_tokens_submitted) == (2, 1600)


def test_submit_rejects_bad_input_and_a_full_queue() -> None:
    worker = _worker(max_tasks=2)
    with pytest.raises(ValueError, match="input_tokens"):
        worker.submit("x", 0, 0, 0.0)
    with pytest.raises(ValueError, match="cached_tokens"):
        worker.submit("x", 10, 11, 0.0)
    worker.submit("a", 10, 0, 0.0)
    worker.submit("b", 10, 0, 0.0)
    with pytest.raises(SimWorkerOverloaded):
        worker.submit("c", 10, 0, 0.0)
    worker.advance(1.0)
    worker.submit("c", 10, 0, 1.0)


def test_time_never_goes_back() -> None:
    worker = _worker()
    worker.submit("a", 1000, 0, 5.0)
    assert worker.outstanding_tokens(5.5) == 500
    assert worker.outstanding_tokens(1.0) == 500  # an earlier "now" is the latest seen
    assert worker.submit("b", 100, 0, 1.0) == pytest.approx(0.5 + 0.1)


# ---- status replies ----


def test_status_reports_running_and_waiting_tasks_with_remaining_prefill() -> None:
    worker = _worker()
    worker.submit("a", 1000, 100, 0.0)
    worker.submit("b", 300, 50, 0.0)
    status = _status(worker, 0.4)
    assert status.alive and status.role is Role.PREFILL and status.role_reported == "RoleType.PREFILL"
    assert [t.request_id for t in status.running] == ["a"]
    assert [t.request_id for t in status.waiting] == ["b"]
    running, waiting = status.running[0], status.waiting[0]
    assert (running.input_length, running.prefix_length) == (1000, 100)
    assert (running.remaining_prefill_tokens, running.completed_prefill_tokens) == (500, 400)
    assert (waiting.input_length, waiting.prefix_length, waiting.remaining_prefill_tokens) == (300, 50, None)
    assert (status.waiting_query_len, status.running_query_len) == (1, 1)
    assert status.outstanding_uncached_tokens == 500 + 250
    assert status.block_size == 64 and status.lookahead_tokens == 0
    assert status.kv_cache_group_mode is KvCacheGroupMode.FULL_ATTENTION_ONLY


def test_status_version_increases_on_every_change_only() -> None:
    worker = _worker()
    v0 = _status(worker, 0.0).status_version
    assert v0 >= 1
    worker.submit("a", 100, 0, 0.0)  # queued and started
    v1 = _status(worker, 0.0).status_version
    assert _status(worker, 0.05).status_version == v1  # only remaining tokens moved
    worker.submit("b", 100, 0, 0.05)  # queued
    v2 = _status(worker, 0.05).status_version
    v3 = _status(worker, 0.15).status_version  # a finished, b started
    v4 = _status(worker, 1.0).status_version  # b finished
    assert v0 < v1 < v2 < v3 < v4
    assert _status(worker, 2.0).status_version == v4


def test_finished_tasks_newer_than_the_callers_version() -> None:
    worker = _worker()
    worker.submit("a", 100, 0, 0.0)
    worker.submit("b", 100, 0, 0.0)
    first = _status(worker, 0.15)  # a finished
    assert first.latest_finished_version > 0
    raw = engine_pb.WorkerStatusPB.FromString(worker.status_reply(-1, 0.15))
    assert [t.request_id for t in raw.finished_task_list] == ["a"]
    raw = engine_pb.WorkerStatusPB.FromString(worker.status_reply(first.latest_finished_version, 0.3))
    assert [t.request_id for t in raw.finished_task_list] == ["b"]  # a was already seen
    assert raw.latest_finished_version > first.latest_finished_version


def _raw_status(worker: SimWorker, now: float, latest_finished_version: int = -1) -> engine_pb.WorkerStatusPB:
    """The reply to a status call, as the engine's message (its presence bits unread by the decoder)."""
    request = engine_pb.StatusVersionPB(latest_cache_version=-1, latest_finished_version=latest_finished_version)
    return engine_pb.WorkerStatusPB.FromString(worker.answer(paths.WORKER_GET_STATUS, request.SerializeToString(), now))


def test_a_decoding_task_is_running_with_nothing_left_to_prefill() -> None:
    worker = _worker(decode_tokens_per_s=40.0)
    worker.submit("a", 1500, 500, 0.0, output_tokens=40)  # prefill ends at 1.0, decoding at 2.0
    raw = _raw_status(worker, 1.5)
    assert [t.request_id for t in raw.running_task_info] == ["a"]
    task = raw.running_task_info[0]
    assert not task.is_waiting and task.prefix_length_valid and task.prefix_length == 500
    assert task.HasField("remaining_prefill_tokens") and task.remaining_prefill_tokens == 0
    assert (raw.waiting_query_len, raw.running_query_len) == (0, 1)


def test_queued_tasks_say_their_prefix_is_valid() -> None:
    worker = _worker()
    worker.submit("a", 1000, 0, 0.0)
    worker.submit("b", 1000, 200, 0.0)
    raw = _raw_status(worker, 0.1)
    assert [(t.request_id, t.is_waiting, t.prefix_length_valid) for t in raw.running_task_info] == [
        ("a", False, True),
        ("b", True, True),
    ]


def test_latest_finished_version_is_the_newest_finished_tasks_and_the_request_filters() -> None:
    worker = _worker()
    worker.submit("a", 100, 0, 0.0)  # finishes at 0.1
    first = _raw_status(worker, 0.2)
    assert [t.request_id for t in first.finished_task_list] == ["a"]
    worker.submit("b", 1000, 0, 0.3)  # a change, but no task finishing
    later = _raw_status(worker, 0.31, first.latest_finished_version)
    assert later.latest_finished_version == first.latest_finished_version < later.status_version
    assert list(later.finished_task_list) == []  # a was already seen
    assert [t.request_id for t in _raw_status(worker, 0.31).finished_task_list] == ["a"]


def test_finished_tasks_kept_are_bounded() -> None:
    worker = _worker(finished_kept=3)
    for i in range(10):
        worker.submit(f"r{i}", 10, 0, 0.0)
    raw = engine_pb.WorkerStatusPB.FromString(worker.status_reply(-1, 5.0))
    assert [t.request_id for t in raw.finished_task_list] == ["r7", "r8", "r9"]


def test_unreported_fields_keep_presence() -> None:
    worker = _worker(
        block_size=None, lookahead_tokens=1, report_remaining_prefill=False, role="RoleType.PDFUSION"
    )
    worker.submit("a", 100, 0, 0.0)
    status = _status(worker, 0.01)
    assert status.block_size is None and status.lookahead_tokens is None
    assert status.running[0].remaining_prefill_tokens is None
    assert status.role is Role.PDFUSION
    mamba = _worker(kv_cache_group_mode=KvCacheGroupMode.WITH_MAMBA, lookahead_tokens=1, block_size=16)
    status = _status(mamba, 0.0)
    assert (status.kv_cache_group_mode, status.block_size, status.lookahead_tokens) == (
        KvCacheGroupMode.WITH_MAMBA,
        16,
        1,
    )


def test_spec_validation_names_the_field() -> None:
    for field, value in (
        ("prefill_tokens_per_s", 0.0),
        ("block_size", 0),
        ("lookahead_tokens", -1),
        ("kv_capacity_blocks", 0),
        ("max_tasks", 0),
    ):
        with pytest.raises(ValueError, match=field):
            WorkerSpec(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flap_period_s"):
        WorkerFaults(flap_period_s=-1.0)
    with pytest.raises(ValueError, match="garbled: must be a Garble"):
        WorkerFaults(garbled="undecodable")  # type: ignore[arg-type]


# ---- the running KV pool, busy time and load ----


def _pooled_worker() -> SimWorker:
    """A 10-block running pool of 100-token blocks; a sequence decodes 10 tokens a second."""
    return _worker(decode_tokens_per_s=10.0, running_kv_blocks=10, kv_block_tokens=100)


def test_a_prompt_that_fills_the_pool_exactly_starts_at_once() -> None:
    worker = _pooled_worker()
    worker.submit("a", 500, 0, 0.0, output_tokens=100)  # 6 blocks, held until 0.5 + 10 s
    assert worker.submit("b", 300, 0, 1.0, output_tokens=100) == pytest.approx(0.3)  # 4 more: exactly 10
    assert worker.held_kv_blocks(1.1) == 10


def test_a_request_larger_than_the_pool_waits_for_the_pool_to_empty_then_runs_alone() -> None:
    worker = _pooled_worker()
    worker.submit("a", 50, 0, 0.0, output_tokens=50)  # 1 block, held until 0.05 + 5 s
    # 20 blocks can never fit beside anything: it starts when "a" leaves, at 5.05, and prefills 2 s.
    assert worker.submit("big", 2000, 0, 1.0) == pytest.approx(5.05 - 1.0 + 2.0)


def test_held_kv_counts_only_the_prefills_that_started() -> None:
    worker = _worker(kv_block_tokens=100)
    worker.submit("a", 1000, 0, 0.0)  # 10 blocks, prefill 0..1
    worker.submit("b", 500, 0, 0.0)  # 5 blocks, waits until 1
    assert worker.held_kv_blocks(0.0) == 10
    assert worker.held_kv_blocks(0.5) == 10
    assert worker.held_kv_blocks(1.2) == 5


def test_busy_time_counts_a_prefill_straddling_the_window_start() -> None:
    worker = _worker()
    worker.submit("a", 1000, 0, 0.0)  # prefill 0..1
    worker.submit("b", 1000, 0, 0.0)  # prefill 1..2
    assert worker.busy_s(0.5, 1.5) == pytest.approx(1.0)
    assert worker.busy_s(0.25, 0.75) == pytest.approx(0.5)


def test_available_concurrency_falls_with_the_tasks_in_flight() -> None:
    worker = _worker(max_tasks=4)
    assert _raw_status(worker, 0.0).available_concurrency == 4
    worker.submit("a", 1000, 0, 0.0)
    worker.submit("b", 1000, 0, 0.0)
    assert _raw_status(worker, 0.1).available_concurrency == 2


def test_a_finished_tasks_end_time_is_when_it_left_after_its_decode() -> None:
    """A task that decoded reported the end of its prefill as its end time."""
    worker = _worker(decode_tokens_per_s=40.0)
    worker.submit("decoded", 1000, 0, 0.0, output_tokens=40)  # prefill 0..1, decode 1..2
    worker.submit("prefill-only", 500, 0, 0.0)  # prefill 1..1.5, no decode
    assert {t.request_id: t.end_time_ms for t in _raw_status(worker, 3.0).finished_task_list} == {
        "prefill-only": 1500,
        "decoded": 2000,
    }


# ---- faults ----


def test_dead_and_flapping_plans() -> None:
    worker = _worker()
    assert worker.plan(paths.WORKER_GET_STATUS, 0.0).abort is None
    worker.set_faults(WorkerFaults(dead=True))
    abort = worker.plan(paths.WORKER_GET_STATUS, 0.0).abort
    assert abort is not None and abort.status is RpcStatus.UNAVAILABLE
    worker.set_faults(WorkerFaults(flap_period_s=2.0, flap_origin_s=10.0))
    reachable = [worker.reachable(t) for t in (10.0, 11.9, 12.0, 13.9, 14.0, 16.5)]
    assert reachable == [True, True, False, False, True, False]
    assert worker.plan(paths.WORKER_GET_STATUS, 12.5).abort is not None
    assert worker.plan(paths.WORKER_GET_STATUS, 14.5).abort is None


def test_hang_and_delay_plans() -> None:
    worker = _worker()
    worker.set_faults(WorkerFaults(hang=True))
    assert worker.plan(paths.WORKER_GET_STATUS, 0.0).hang
    worker.set_faults(WorkerFaults(delay_s=0.3))
    plan = worker.plan(paths.WORKER_GET_STATUS, 0.0)
    assert (plan.hang, plan.delay_s) == (False, 0.3)


def test_status_version_zero_and_not_alive() -> None:
    worker = _worker()
    worker.set_faults(WorkerFaults(status_version_zero=True, not_alive=True))
    status = _status(worker, 0.0)
    assert (status.status_version, status.alive) == (0, False)
    worker.set_faults(WorkerFaults())
    status = _status(worker, 0.0)
    assert status.status_version > 0 and status.alive


@pytest.mark.parametrize("garble", list(Garble))
def test_garbled_status_fails_decoding(garble: Garble) -> None:
    worker = _worker()
    worker.set_faults(WorkerFaults(garbled=garble))
    with pytest.raises(GarbledReply):
        _status(worker, 0.0)


# ---- in-memory server ----


async def test_memory_server_delay_flap_and_peak_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    worker = _worker()
    network = MemoryNetwork()
    network.serve("w", memory_handler(worker))
    client = WorkerStatusClient(network)
    worker.set_faults(WorkerFaults(delay_s=0.2))
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(client.get_worker_status, "w", -1)
    assert trio.current_time() - start == pytest.approx(0.2)
    stats = worker.stats.get(paths.WORKER_GET_STATUS)
    assert (stats.calls, stats.in_flight, stats.peak_in_flight) == (5, 0, 5)
    now = trio.current_time()
    worker.set_faults(WorkerFaults(flap_period_s=1.0, flap_origin_s=now))
    assert (await client.get_worker_status("w", -1)).alive
    await trio.sleep(1.0)
    with pytest.raises(Unavailable):
        await client.get_worker_status("w", -1)
    await trio.sleep(1.0)
    assert (await client.get_worker_status("w", -1)).alive


async def test_memory_server_status_follows_the_trio_clock(autojump_clock: trio.testing.MockClock) -> None:
    worker = _worker()
    network = MemoryNetwork()
    network.serve("w", memory_handler(worker))
    client = WorkerStatusClient(network)
    worker.submit("a", 1000, 0, trio.current_time())
    await trio.sleep(0.25)
    status = await client.get_worker_status("w", -1)
    assert status.running[0].remaining_prefill_tokens == 750


async def test_clearing_a_hang_answers_every_hung_call(autojump_clock: trio.testing.MockClock) -> None:
    worker = _worker()
    network = MemoryNetwork()
    network.serve("w", memory_handler(worker))
    client = WorkerStatusClient(network)
    worker.set_faults(WorkerFaults(hang=True))
    answered: list[WorkerStatus] = []

    async def call() -> None:
        answered.append(await client.get_worker_status("w", -1))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            assert worker.stats.get(paths.WORKER_GET_STATUS).in_flight == 3 and answered == []
            worker.set_faults(WorkerFaults())
    assert len(answered) == 3
