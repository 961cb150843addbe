"""Request-path cost of the LeaderResolver: per call, in trio time and in real wall time.

Cases (each N calls, after one warm-up round):
- backing off: every bootstrap target dead, the first lookup failed → ``leader()`` fails fast;
- breaker open: ``admit()`` rejects;
- steady state: ``leader()`` returns the cached leader.
RPCs issued during the measured calls are counted at the in-memory network (must be 0).

Run: ``python bench/bench_leader.py [--calls N] [--targets T]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable

import trio
import trio.testing

from actors.breaker import Admission
from actors.leader_resolver import LeaderResolver, LeaderUnavailable
from kvroute_sim.stats import percentile
from router.config import BreakerConfig, LeaderConfig
from router.transport.clients import KvcmClient
from router.transport.errors import Unavailable
from router.transport.memory_adapter import MemoryNetwork
from router.wire import kvcm_meta_pb2 as kvcm_pb


async def _measure(call: Callable[[], Awaitable[None]], calls: int) -> tuple[list[float], list[float]]:
    trio_us: list[float] = []
    wall_us: list[float] = []
    for _ in range(calls):
        t0 = trio.current_time()
        w0 = time.perf_counter()
        await call()
        wall_us.append((time.perf_counter() - w0) * 1e6)
        trio_us.append((trio.current_time() - t0) * 1e6)
    return trio_us, wall_us


def _row(name: str, trio_us: list[float], wall_us: list[float], rpcs: int) -> str:
    return (
        f"{name:<24} trio µs/call p50 {percentile(trio_us, 50):7.2f} max {max(trio_us):7.2f} | "
        f"wall µs/call p50 {percentile(wall_us, 50):6.2f} p99 {percentile(wall_us, 99):6.2f} "
        f"max {max(wall_us):7.2f} | RPCs {rpcs}"
    )


def _leader_reply(host: str, port: int) -> bytes:
    reply = kvcm_pb.GetClusterInfoResponse()
    reply.header.status.code = kvcm_pb.OK
    reply.leader_endpoint.host = host
    reply.leader_endpoint.meta_rpc_port = port
    return reply.SerializeToString()


async def main(calls: int, targets: int) -> None:
    bootstrap = tuple(f"10.0.0.{i + 1}:6381" for i in range(targets))
    leader_cfg = LeaderConfig(backoff_initial_s=60.0, backoff_max_s=60.0)  # stay backing off during the run
    dead = MemoryNetwork()
    live = MemoryNetwork()
    reply = _leader_reply("10.0.0.1", 6381)

    async def answer(method: str, request: bytes) -> bytes:
        return reply

    for target in bootstrap:
        live.serve(target, answer)
    async with trio.open_nursery() as nursery:
        backing_off = LeaderResolver(
            leader_cfg, BreakerConfig(), KvcmClient(dead), lambda: bootstrap, instance_id="bench", inbox_size=1024
        )
        await nursery.start(backing_off.run)
        try:
            await backing_off.leader()
        except LeaderUnavailable as first:
            print(f"first lookup: {first.reason.value} after {dead.call_count()} RPCs (one round)")

        async def fail_fast() -> None:
            try:
                await backing_off.leader()
            except LeaderUnavailable:
                return
            raise AssertionError("expected LeaderUnavailable while backing off")

        await _measure(fail_fast, 100)
        before = dead.call_count()
        trio_us, wall_us = await _measure(fail_fast, calls)
        print(_row("leader() backing off", trio_us, wall_us, dead.call_count() - before))

        for _ in range(BreakerConfig().failure_threshold):
            backing_off.record_kvcm(Unavailable("x", "down"), trial=False, given_s=0.5)
        await trio.testing.wait_all_tasks_blocked()  # the resolver's task applies the reports

        async def rejected() -> None:
            assert await backing_off.admit() is Admission.REJECT

        before = dead.call_count()
        trio_us, wall_us = await _measure(rejected, calls)
        print(_row("admit() breaker open", trio_us, wall_us, dead.call_count() - before))

        steady = LeaderResolver(
            leader_cfg, BreakerConfig(), KvcmClient(live), lambda: bootstrap, instance_id="bench", inbox_size=1024
        )
        await nursery.start(steady.run)
        await steady.leader()

        async def cached() -> None:
            await steady.leader()

        await _measure(cached, 100)
        before = live.call_count()
        trio_us, wall_us = await _measure(cached, calls)
        print(_row("leader() cached", trio_us, wall_us, live.call_count() - before))
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--targets", type=int, default=3)
    args = parser.parse_args()
    trio.run(main, args.calls, args.targets)
