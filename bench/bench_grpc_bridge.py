"""gRPC-from-trio bridge cost: unary echo over loopback to a server in a separate process.

Rows, measured in the same run and interleaved over rounds:
  sync stub         plain blocking grpcio calls (sequential) and .future() with a window
                    of in-flight calls (concurrent) — no trio: the floor
  future bridge     kvroute's GrpcRawRpc: ChannelPool lease + sync stub .future() whose
                    done-callback wakes trio via the trio token (grpcio starts a thread for
                    every call on a channel with none in flight)
  future (bare)     the same bridge on bare channels (``--channels``, in turn): no pool
  outbound loop     grpc.aio on one asyncio loop on its own thread, shared by bare channels
                    (``--channels``): the call handed over with call_soon_threadsafe, its
                    completion waking trio via the trio token; no thread start per call
  aio/trio-asyncio  grpc.aio called from trio through trio-asyncio
  to_thread         the blocking call in trio.to_thread (not cancellable at the server)
  thread pool       persistent threads, each consuming a single-threaded unary-stream call
                    (cancellable from trio): no per-call thread start, one handoff instead

Per row: sequential latency p50/p99 (ms), concurrent throughput (calls/s) with
``--concurrency`` calls in flight, and this process's CPU per call over both parts
(``time.process_time``: every thread, so grpcio's and the loop's threads too).
Bounded: about 45 s with the defaults on 2 cores.

Run: ``python bench/bench_grpc_bridge.py [--calls N] [--concurrent-calls N] [--concurrency C] [--rounds R]
[--channels N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import cast

import grpc
import grpc.aio
import grpc.experimental
import trio
import trio_asyncio

from actors.channel_pool import ChannelPool
from kvroute_sim.stats import percentile
from router.config import ChannelPoolConfig
from router.transport.grpc_adapter import GrpcRawRpc, channel_options, wait_future
from router.transport.grpc_server import start_grpc_server

ECHO = "/kvroute.bench.Echo/Echo"
PAYLOAD = bytes(range(100))
CALL_TIMEOUT_S = 10.0
CHANNELS = 1  # bare-channel rows: calls go to this many channels in turn (--channels)
Call = Callable[[], Awaitable[bytes]]


def serve() -> None:
    """Child process: serve the echo method, print the port, exit when stdin closes."""
    server = start_grpc_server({ECHO: lambda request, context: request}, max_workers=16)
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


class Result:
    def __init__(self) -> None:
        self.latencies_ms: list[float] = []
        self.calls = 0
        self.seconds = 0.0
        self.cpu_s = 0.0  # this process, every thread, over the measured parts
        self.cpu_calls = 0

    def p(self, q: float) -> float:
        """Nearest-rank percentile, ``q`` in 0..1."""
        return percentile(self.latencies_ms, q * 100)


# ---- the floor: plain grpcio, no trio ----


def sync_stub(target: str, calls: int, concurrent_calls: int, concurrency: int, result: Result) -> None:
    channel = grpc.insecure_channel(target, options=channel_options(ChannelPoolConfig()))
    stub = channel.unary_unary(ECHO, None, None)
    for _ in range(calls // 10):  # warm-up
        stub(PAYLOAD, timeout=CALL_TIMEOUT_S)
    cpu_before = time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        stub(PAYLOAD, timeout=CALL_TIMEOUT_S)
        result.latencies_ms.append((time.perf_counter() - start) * 1e3)

    # Concurrent: keep `concurrency` futures in flight; a completion frees a slot for the next call.
    slots = threading.BoundedSemaphore(concurrency)
    futures: list[grpc.Future[bytes]] = []

    def on_done(future: grpc.Future[bytes]) -> None:
        slots.release()

    start = time.perf_counter()
    for _ in range(concurrent_calls):
        slots.acquire()
        in_flight = stub.future(PAYLOAD, timeout=CALL_TIMEOUT_S)
        in_flight.add_done_callback(on_done)
        futures.append(in_flight)
    for done in futures:
        done.result()
    result.seconds += time.perf_counter() - start
    result.calls += concurrent_calls
    result.cpu_s += time.process_time() - cpu_before
    result.cpu_calls += calls + concurrent_calls
    channel.close()


# ---- trio rows: one harness, the call differs ----


async def measure(call: Call, calls: int, concurrent_calls: int, concurrency: int, result: Result) -> None:
    with trio.fail_after(300):  # every call carries a deadline, as in production
        for _ in range(calls // 10):
            await call()
        cpu_before = time.process_time()
        for _ in range(calls):
            start = time.perf_counter()
            await call()
            result.latencies_ms.append((time.perf_counter() - start) * 1e3)

        async def worker(n: int) -> None:
            for _ in range(n):
                await call()

        share, extra = divmod(concurrent_calls, concurrency)
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(worker, share + (1 if i < extra else 0))
        result.seconds += time.perf_counter() - start
        result.calls += concurrent_calls
        result.cpu_s += time.process_time() - cpu_before
        result.cpu_calls += calls + concurrent_calls


async def future_bridge(
    target: str, calls: int, concurrent_calls: int, concurrency: int, result: Result
) -> None:
    pool = ChannelPool(ChannelPoolConfig())
    rpc = GrpcRawRpc(pool, start_off_loop=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        await measure(lambda: rpc.call(target, ECHO, PAYLOAD), calls, concurrent_calls, concurrency, result)
        await pool.aclose()


async def sync_future_bare(
    target: str, calls: int, concurrent_calls: int, concurrency: int, result: Result
) -> None:
    channels = [grpc.insecure_channel(target, options=channel_options(ChannelPoolConfig())) for _ in range(CHANNELS)]
    stubs = [channel.unary_unary(ECHO, None, None) for channel in channels]
    turn = itertools.count()

    async def call() -> bytes:
        deadline = trio.current_effective_deadline()
        future = stubs[next(turn) % CHANNELS].future(PAYLOAD, timeout=deadline - trio.current_time())
        await wait_future(future)
        reply: bytes = future.result()
        return reply

    await measure(call, calls, concurrent_calls, concurrency, result)
    for channel in channels:
        channel.close()


class _OutboundLoop:
    """One asyncio loop on a daemon thread carrying grpc.aio calls for trio tasks."""

    def __init__(self) -> None:
        self.loop = asyncio.SelectorEventLoop()  # not new_event_loop(): trio-asyncio's policy refuses in trio
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, job: Callable[[], Awaitable[object]]) -> object:
        """Run ``job()`` on the loop and wait for it (set-up and tear-down only)."""

        async def wrapped() -> object:
            return await job()

        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(CALL_TIMEOUT_S)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CALL_TIMEOUT_S)
        self.loop.close()


async def outbound_loop_bare(
    target: str, calls: int, concurrent_calls: int, concurrency: int, result: Result
) -> None:
    outbound = _OutboundLoop()

    async def open_channels() -> list[grpc.aio.Channel]:
        options = channel_options(ChannelPoolConfig())
        return [grpc.aio.insecure_channel(target, options=options) for _ in range(CHANNELS)]

    channels = cast(list[grpc.aio.Channel], outbound.run(open_channels))
    stubs = [channel.unary_unary(ECHO, None, None) for channel in channels]
    turn = itertools.count()
    token = trio.lowlevel.current_trio_token()

    async def aio_call(stub: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes], seconds_left: float) -> bytes:
        reply: bytes = await stub(PAYLOAD, timeout=seconds_left)
        return reply

    async def call() -> bytes:
        task = trio.lowlevel.current_task()
        stub = stubs[next(turn) % CHANNELS]
        seconds_left = trio.current_effective_deadline() - trio.current_time()
        done: list[asyncio.Future[bytes]] = []

        def finished(future: asyncio.Future[bytes]) -> None:  # on the loop's thread
            done.append(future)
            token.run_sync_soon(trio.lowlevel.reschedule, task)

        def begin() -> None:  # on the loop's thread
            asyncio.ensure_future(aio_call(stub, seconds_left)).add_done_callback(finished)

        outbound.loop.call_soon_threadsafe(begin)
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return done[0].result()

    await measure(call, calls, concurrent_calls, concurrency, result)

    async def close_channels() -> None:
        for channel in channels:
            await channel.close()

    outbound.run(close_channels)
    outbound.stop()


async def aio_trio_asyncio(
    target: str, calls: int, concurrent_calls: int, concurrency: int, result: Result
) -> None:
    async with trio_asyncio.open_loop():
        # grpc.aio objects must be created and used on the asyncio loop.
        async def open_channel() -> grpc.aio.Channel:
            return grpc.aio.insecure_channel(target, options=channel_options(ChannelPoolConfig()))

        channel = await trio_asyncio.aio_as_trio(open_channel)()
        stub = channel.unary_unary(ECHO, None, None)

        async def aio_call(seconds_left: float) -> bytes:
            reply: bytes = await stub(PAYLOAD, timeout=seconds_left)
            return reply

        bridged = trio_asyncio.aio_as_trio(aio_call)

        async def call() -> bytes:
            reply: bytes = await bridged(trio.current_effective_deadline() - trio.current_time())
            return reply

        await measure(call, calls, concurrent_calls, concurrency, result)
        await trio_asyncio.aio_as_trio(channel.close)()


async def blocking_to_thread(
    target: str, calls: int, concurrent_calls: int, concurrency: int, result: Result
) -> None:
    channel = grpc.insecure_channel(target, options=channel_options(ChannelPoolConfig()))
    stub = channel.unary_unary(ECHO, None, None)
    limiter = trio.CapacityLimiter(concurrency)

    async def call() -> bytes:
        seconds_left = trio.current_effective_deadline() - trio.current_time()
        reply: bytes = await trio.to_thread.run_sync(
            lambda: stub(PAYLOAD, timeout=seconds_left), limiter=limiter
        )
        return reply

    await measure(call, calls, concurrent_calls, concurrency, result)
    channel.close()


class _RpcThreads:
    """Persistent threads taking jobs from one queue; a new one only when none is idle (capped)."""

    def __init__(self, cap: int) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._cap = cap

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._idle == 0 and self._threads < self._cap:
                self._threads += 1
                threading.Thread(target=self._loop, daemon=True).start()
        self._jobs.put(job)

    def close(self) -> None:
        for _ in range(self._threads):
            self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
            if job is None:
                return
            job()


async def thread_pool(target: str, calls: int, concurrent_calls: int, concurrency: int, result: Result) -> None:
    single_threaded = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)
    channel = grpc.insecure_channel(target, options=[*channel_options(ChannelPoolConfig()), single_threaded])
    stub = channel.unary_stream(ECHO, None, None)  # a unary method answers a one-message stream
    threads = _RpcThreads(concurrency)
    token = trio.lowlevel.current_trio_token()

    async def call() -> bytes:
        responses = stub(PAYLOAD, timeout=trio.current_effective_deadline() - trio.current_time())
        task = trio.lowlevel.current_task()
        replies: list[bytes] = []
        waiting = True

        def wake() -> None:
            if waiting:
                trio.lowlevel.reschedule(task)

        def job() -> None:
            with contextlib.suppress(grpc.RpcError):
                replies.extend(responses)
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(wake)

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            nonlocal waiting
            waiting = False
            responses.cancel()  # type: ignore[no-untyped-call]
            return trio.lowlevel.Abort.SUCCEEDED

        threads.submit(job)
        await trio.lowlevel.wait_task_rescheduled(abort)
        (reply,) = replies
        return reply

    await measure(call, calls, concurrent_calls, concurrency, result)
    threads.close()
    channel.close()


ROWS = (
    "sync stub (floor)",
    "future bridge (GrpcRawRpc)",
    "future bridge, bare channels",
    "outbound asyncio loop thread, bare channels",
    "grpc.aio via trio-asyncio",
    "blocking call in trio.to_thread",
    "persistent threads, single-threaded stream",
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1500, help="sequential calls per row per round")
    parser.add_argument(
        "--concurrent-calls", type=int, default=3000, help="calls per row per round, concurrent"
    )
    parser.add_argument("--concurrency", type=int, default=64, help="calls in flight in the concurrent part")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; rows are interleaved within each")
    parser.add_argument(
        "--channels", type=int, default=1, help="bare-channel rows: channels the calls go to in turn (the router's "
        "calls spread over one channel per worker, each idle between its calls)"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    for flag, value in (
        ("--calls", args.calls),
        ("--concurrent-calls", args.concurrent_calls),
        ("--concurrency", args.concurrency),
        ("--rounds", args.rounds),
        ("--channels", args.channels),
    ):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")

    global CHANNELS
    CHANNELS = args.channels
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        target = f"127.0.0.1:{int(server.stdout.readline())}"
        results = {row: Result() for row in ROWS}
        sizes = (args.calls, args.concurrent_calls, args.concurrency)
        began = time.perf_counter()
        for _ in range(args.rounds):
            sync_stub(target, *sizes, results[ROWS[0]])
            trio.run(future_bridge, target, *sizes, results[ROWS[1]])
            trio.run(sync_future_bare, target, *sizes, results[ROWS[2]])
            trio.run(outbound_loop_bare, target, *sizes, results[ROWS[3]])
            trio.run(aio_trio_asyncio, target, *sizes, results[ROWS[4]])
            trio.run(blocking_to_thread, target, *sizes, results[ROWS[5]])
            trio.run(thread_pool, target, *sizes, results[ROWS[6]])
        elapsed = time.perf_counter() - began
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=10)

    floor = results[ROWS[0]]
    print(
        f"loopback unary echo ({len(PAYLOAD)} B), server in a separate process; {args.rounds} rounds × "
        f"{args.calls} sequential + {args.concurrent_calls} concurrent calls (in flight: {args.concurrency}) "
        f"per row; bare-channel rows over {CHANNELS} channel(s); {elapsed:.0f} s"
    )
    print()
    print("| bridge | seq p50 ms | seq p99 ms | p50 vs floor | concurrent calls/s | vs floor | CPU µs/call |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    floor_rate = floor.calls / floor.seconds
    for row in ROWS:
        r = results[row]
        rate = r.calls / r.seconds
        print(
            f"| {row} | {r.p(0.5):.3f} | {r.p(0.99):.3f} | {r.p(0.5) / floor.p(0.5):.2f}× "
            f"| {rate:,.0f} | {rate / floor_rate:.2f}× | {r.cpu_s * 1e6 / max(1, r.cpu_calls):,.0f} |"
        )


if __name__ == "__main__":
    main()
