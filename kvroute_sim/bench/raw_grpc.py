"""The raw floor: a plain grpcio client (sync stubs, no trio, no router) against the same servers.

- ``floor``: one bare GetHostCacheState RTT (to the KVCM leader, with a seeded prompt's
  keys) followed by one bare GetWorkerStatus RTT (to a worker), sequentially: what a
  route with one cache query and one probe round cannot beat.
- ``fanout``: the same query, then one bare GetWorkerStatus to each of N workers at once —
  the RPCs a cold route makes when it probes N candidates (context for P2 cold, not its floor);
- ``concurrent_rate``: GetHostCacheState calls per second with a window of calls in
  flight (``.future()``; a completion frees a slot): what a warm-cache route issues per
  decision, at the concurrency the router is driven with.
- ``paced_cache_queries``: bare GetHostCacheState calls one at a time on an open-loop schedule
  (``paced``): P8's floor at each rate, the one remote call a steady-state decision makes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvroute_sim.bench.simproc import SimProcess
from kvroute_sim.stats import Summary
from router.config import ChannelPoolConfig, DeploymentConfig
from router.transport.grpc_adapter import channel_options
from router.types import CacheQuery
from router.wire import decode, paths

CALL_TIMEOUT_S = 10.0


def slot_wait(start: float, i: int, rate_per_s: float, now: float) -> float:
    """Seconds to wait at ``now`` before call ``i`` of a schedule begun at ``start`` (call i at
    start + i / rate): never negative, so a call after an overrun starts at once."""
    return max(0.0, start + i / rate_per_s - now)


def paced(
    calls: int,
    rate_per_s: float,
    call: Callable[[int], object],
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> list[float]:
    """``call(i)`` for each i, one at a time, call i at start + i / ``rate_per_s`` (or at once when
    the one before overran its slot); wall-clock ms of each from its start to its return, so a late
    start is not counted as the call's own time (as the sidecar's receipt-to-reply does not count
    gRPC's queueing)."""
    samples: list[float] = []
    start = clock()
    for i in range(calls):
        wait = slot_wait(start, i, rate_per_s, clock())
        if wait > 0:
            sleep(wait)
        began = clock()
        call(i)
        samples.append((clock() - began) * 1e3)
    return samples


@dataclass(slots=True)
class FloorSamples:
    """Wall-clock ms of each bare RTT, one entry per floor call; filled over several rounds."""

    cache_query_ms: list[float] = field(default_factory=list)
    worker_status_ms: list[float] = field(default_factory=list)

    @property
    def pair_ms(self) -> list[float]:
        """GetHostCacheState + GetWorkerStatus, back to back."""
        return [q + s for q, s in zip(self.cache_query_ms, self.worker_status_ms, strict=True)]

    def to_json(self) -> dict[str, object]:
        return {
            "pair_ms": Summary.of(self.pair_ms).to_json(),
            "cache_query_ms": Summary.of(self.cache_query_ms).to_json(),
            "worker_status_ms": Summary.of(self.worker_status_ms).to_json(),
        }


class RawClient:
    """Sync stubs on one channel per target, with the router's channel options."""

    def __init__(self, sim: SimProcess) -> None:
        options = channel_options(ChannelPoolConfig())
        self._channels: list[grpc.Channel] = []

        def stub(target: str, method: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
            channel = grpc.insecure_channel(target, options=options)
            self._channels.append(channel)
            return channel.unary_unary(method, None, None)

        deployment = DeploymentConfig()
        self._queries = [
            decode.encode_cache_query(CacheQuery(deployment.kvcm_instance_id, deployment.query_type, keys))
            for keys in sim.view.prompts
        ]
        self._status_request = decode.encode_status_version(-1)
        self.kvcm_target = sim.leader_target  # the KVCM leader its queries go to
        self._kvcm = stub(sim.leader_target, paths.KVCM_GET_HOST_CACHE_STATE)
        self._workers = [stub(w.status_target, paths.WORKER_GET_STATUS) for w in sim.workers]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def warm_up(self, calls: int) -> None:
        """Connections and server threads, before anything is timed."""
        for i in range(calls):
            self._kvcm(self._queries[i % len(self._queries)], timeout=CALL_TIMEOUT_S)
            self._workers[i % len(self._workers)](self._status_request, timeout=CALL_TIMEOUT_S)

    def floor(self, calls: int, into: FloorSamples) -> None:
        """``calls`` times: one bare GetHostCacheState, then one bare GetWorkerStatus (workers in turn)."""
        for i in range(calls):
            start = time.perf_counter()
            self._kvcm(self._queries[i % len(self._queries)], timeout=CALL_TIMEOUT_S)
            middle = time.perf_counter()
            self._workers[i % len(self._workers)](self._status_request, timeout=CALL_TIMEOUT_S)
            into.cache_query_ms.append((middle - start) * 1e3)
            into.worker_status_ms.append((time.perf_counter() - middle) * 1e3)

    def paced_cache_queries(self, calls: int, rate_per_s: float) -> list[float]:
        """``calls`` bare GetHostCacheState calls on ``paced``'s open-loop schedule; ms of each."""

        def query(i: int) -> object:
            return self._kvcm(self._queries[i % len(self._queries)], timeout=CALL_TIMEOUT_S)

        return paced(calls, rate_per_s, query)

    def fanout(self, calls: int, width: int, into: list[float]) -> None:
        """``calls`` times: one bare GetHostCacheState, then ``width`` bare GetWorkerStatus calls to
        distinct workers at once (the work of a cold route that probes ``width`` candidates);
        wall-clock ms of each, appended to ``into``."""
        width = max(1, min(width, len(self._workers)))
        for i in range(calls):
            start = time.perf_counter()
            self._kvcm(self._queries[i % len(self._queries)], timeout=CALL_TIMEOUT_S)
            probes = [
                self._workers[(i + j) % len(self._workers)].future(self._status_request, timeout=CALL_TIMEOUT_S)
                for j in range(width)
            ]
            for probe in probes:
                probe.result()
            into.append((time.perf_counter() - start) * 1e3)

    def concurrent_rate(self, calls: int, concurrency: int) -> float:
        """GetHostCacheState calls/s with ``concurrency`` in flight."""
        slots = threading.BoundedSemaphore(concurrency)
        futures: list[grpc.CallFuture[bytes]] = []
        start = time.perf_counter()
        for i in range(calls):
            slots.acquire()
            call = self._kvcm.future(self._queries[i % len(self._queries)], timeout=CALL_TIMEOUT_S)
            call.add_done_callback(lambda _: slots.release())
            futures.append(call)
        for call in futures:
            call.result()  # raises if any call failed: a failed call is no throughput
        return calls / (time.perf_counter() - start)
