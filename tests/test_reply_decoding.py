"""Large upstream replies are decoded off the routing thread (``router.transport.clients.decoded``): a
KVCM answer near the message cap, or a worker reporting many tasks, took up to a second of Python on
the trio thread. Small ones decode at once. And the KVCM client holds a reply to the query it answers:
a host matching more blocks than the query asked about is garbled."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import cast

import pytest
import trio
import trio.lowlevel
import trio.testing

from router.transport.clients import LARGE_REPLY_BYTES, KvcmClient, WorkerStatusClient, decoded
from router.transport.errors import GarbledReply
from router.transport.memory_adapter import MemoryNetwork
from router.transport.ports import InTurnCall, InTurnReply, RawRpc, WorkerStatusAsk
from router.types import CacheQuery, QueryType, WorkerStatus
from router.wire import engine_status_pb2 as engine_pb
from router.wire import kvcm_meta_pb2 as kvcm_pb


async def test_a_small_reply_decodes_on_the_trio_thread_and_a_large_one_on_another() -> None:
    threads = trio.CapacityLimiter(1)
    here = threading.get_ident()
    assert await decoded(threading.get_ident, LARGE_REPLY_BYTES, threads) == here
    assert await decoded(threading.get_ident, LARGE_REPLY_BYTES + 1, threads) != here


async def test_a_large_decode_leaves_the_trio_thread_free_for_other_tasks() -> None:
    """While a large reply decodes, other tasks run: the decoding waits on an event only another trio
    task sets, which an inline decode would never let run."""
    released = threading.Event()

    def decode_reply() -> bool:
        return released.wait(10.0)

    async def release_soon() -> None:
        await trio.lowlevel.checkpoint()
        released.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(release_soon)
        assert await decoded(decode_reply, 10 * LARGE_REPLY_BYTES, trio.CapacityLimiter(1))


class _RoundOf:
    """A ``RawRpc`` whose serial round returns ``replies`` at once (no checkpoint)."""

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = replies

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
        raise AssertionError("only rounds here")

    async def call_in_turn(self, calls: Sequence[InTurnCall], within_s: float) -> list[InTurnReply]:
        return [InTurnReply(reply, 0.001, 0.0) for reply in self.replies]

    def invalidate(self, target: str) -> None:
        pass


def _status_with_tasks(tasks: int) -> bytes:
    running = [
        engine_pb.TaskInfoPB(request_id=f"request-{i:06d}", input_length=4096, prefix_length=1024) for i in range(tasks)
    ]
    status = engine_pb.WorkerStatusPB(role="PREFILL", alive=True, status_version=1, running_task_info=running)
    return status.SerializeToString()


async def test_a_round_of_ordinary_statuses_decodes_at_once_whatever_their_total() -> None:
    """A round is judged by its largest reply: eight ordinary statuses of a few KiB each, more than
    LARGE_REPLY_BYTES together, went to a thread, and under a mock clock the time jumped meanwhile
    (the demo's simulated runs lost their determinism)."""
    replies = [_status_with_tasks(200) for _ in range(8)]
    assert max(map(len, replies)) <= LARGE_REPLY_BYTES < sum(map(len, replies))
    client = WorkerStatusClient(cast(RawRpc, _RoundOf(replies)))
    asks = [WorkerStatusAsk(f"10.0.0.{i}:8001", 0) for i in range(8)]
    with trio.testing.assert_no_checkpoints():
        statuses = await client.get_worker_statuses(asks, 0.1)
    assert all(len(cast(WorkerStatus, s.status).running) == 200 for s in statuses)


async def test_a_kvcm_host_matching_more_blocks_than_the_query_has_keys_is_garbled() -> None:
    def matching(local: int) -> bytes:
        reply = kvcm_pb.GetHostCacheStateResponse(
            header=kvcm_pb.CommonResponseHeader(status=kvcm_pb.Status(code=kvcm_pb.OK))
        )
        reply.hosts.add(host_ip_port="10.0.0.1:8000", local=local)
        return reply.SerializeToString()

    local = 10
    network = MemoryNetwork()

    async def answer(method_path: str, request: bytes) -> bytes:
        return matching(local)

    network.serve("kvcm:1", answer)
    client = KvcmClient(network)
    query = CacheQuery("instance", QueryType.PREFIX_MATCH, (1, 2, 3))
    with pytest.raises(GarbledReply, match=r"local: 10 blocks, not in 0\.\.3"):
        await client.get_host_cache_state("kvcm:1", query)
    local = 3  # all three keys: a whole match
    state = await client.get_host_cache_state("kvcm:1", query)
    assert [(h.host_ip_port, h.local) for h in state.hosts] == [("10.0.0.1:8000", 3)]
