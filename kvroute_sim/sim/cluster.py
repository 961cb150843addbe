"""SimCluster: KVCM replicas + workers, exposed on a MemoryNetwork or as real gRPC servers.

Addresses:

- in memory, fake loopback addresses: KVCM replica i at ``127.0.1.<i+1>:6381``; worker i
  at ``127.1.0.0 + i + 1`` with http port 8000 (gRPC = status port 8001).
- over gRPC, every replica and every worker gets its own server on ``127.0.0.1:0``. A
  worker's status server binds port P and the worker declares ``http_port = P - 1``, so
  ``WorkerAddr.from_http(ip, P - 1)`` (gRPC port = http + 1, status port = gRPC port)
  reaches it, and its KVCM identity is ``127.0.0.1:<P - 1>``. Nothing listens on P - 1.

A worker's KVCM identity (``WorkerAddr.http_target``) is registered in the shared index
with the worker's ``kv_capacity_blocks`` when the cluster is served.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from kvroute_sim.sim.faults import CallStats
from kvroute_sim.sim.grpc_server import Clock, serve_endpoint
from kvroute_sim.sim.kvcm import SimKvcmCluster
from kvroute_sim.sim.memory_server import memory_handler
from kvroute_sim.sim.worker import WORKER_METHODS, PlannedTask, SimWorker, WorkerSpec
from router.config import KVCM_DEFAULT_PORT, DeploymentConfig
from router.targets import format_target
from router.transport.memory_adapter import MemoryNetwork
from router.types import WorkerAddr

DEFAULT_WORKERS = 8
DEFAULT_KVCM_REPLICAS = 3
MEMORY_KVCM_BASE = ipaddress.IPv4Address("127.0.1.0")
MEMORY_WORKER_BASE = ipaddress.IPv4Address("127.1.0.0")
MEMORY_WORKER_HTTP_PORT = 8000


@dataclass(frozen=True, slots=True)
class SimClusterAddresses:
    """Where a served cluster can be reached."""

    kvcm_nodes: tuple[tuple[str, str], ...]  # (node_id, target)
    leader: str | None  # node id at serve time
    workers: tuple[WorkerAddr, ...]

    @property
    def kvcm_targets(self) -> tuple[str, ...]:
        return tuple(target for _, target in self.kvcm_nodes)

    @property
    def kvcm_bootstrap(self) -> str:
        """The ``--kvcm-bootstrap`` value."""
        return ",".join(self.kvcm_targets)

    @property
    def workers_arg(self) -> str:
        """The ``--workers`` value (``ip:http_port`` entries)."""
        return ",".join(w.http_target for w in self.workers)

    def to_json(self) -> dict[str, object]:
        return {
            "kvcm_bootstrap": list(self.kvcm_targets),
            "kvcm_nodes": [{"node_id": node, "target": target} for node, target in self.kvcm_nodes],
            "kvcm_leader": self.leader,
            "workers": [
                {
                    "host_ip_port": w.http_target,
                    "ip": w.ip,
                    "http_port": w.http_port,
                    "grpc_port": w.grpc_port,
                    "status_target": w.status_target,
                }
                for w in self.workers
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What one simulated request cost on the worker it was routed to."""

    ttft_s: float
    cached_tokens: int  # local prefix hit (blocks × block size, capped at the input)
    local_blocks: int
    evicted_blocks: int  # blocks the worker's LRU evicted to store this prompt


class SimCluster:
    """KVCM replicas sharing one index, plus workers; serve once, in memory or over gRPC.

    ``workers``: a count of default workers, or one ``WorkerSpec`` per worker.
    ``block_size``: the simulation's real block size (what a block of keys costs in
    tokens); what a worker *reports* is its spec's ``block_size``.
    """

    def __init__(
        self,
        workers: int | Sequence[WorkerSpec] = DEFAULT_WORKERS,
        kvcm_replicas: int = DEFAULT_KVCM_REPLICAS,
        *,
        block_size: int = DeploymentConfig().block_size,
        followers_answer_queries: bool = False,
        instance_id: str = "",
    ) -> None:
        # Workers given by count report the simulation's block size (a real fleet agrees with itself).
        specs = [WorkerSpec(block_size=block_size)] * workers if isinstance(workers, int) else list(workers)
        if not specs:
            raise ValueError("workers: at least one worker is required")
        if kvcm_replicas < 1:
            raise ValueError(f"kvcm_replicas: must be >= 1, got {kvcm_replicas}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.kvcm = SimKvcmCluster(
            [f"kvcm-{i}" for i in range(kvcm_replicas)],
            followers_answer_queries=followers_answer_queries,
            instance_id=instance_id,
        )
        # Every worker's calls, counted together (e.g. peak probe concurrency across the fleet).
        self.worker_fleet_stats = CallStats(WORKER_METHODS)
        self.workers = tuple(
            SimWorker(f"worker-{i}", spec, fleet_stats=self.worker_fleet_stats) for i, spec in enumerate(specs)
        )
        self._addrs: tuple[WorkerAddr, ...] = ()
        self._by_host: dict[str, int] = {}
        self._addresses: SimClusterAddresses | None = None

    # ---- serving ----

    @property
    def addresses(self) -> SimClusterAddresses:
        if self._addresses is None:
            raise RuntimeError("the cluster is not served yet (serve_memory or serve_grpc)")
        return self._addresses

    def serve_memory(self, network: MemoryNetwork, *, clock: Clock | None = None) -> SimClusterAddresses:
        """Serve every replica and worker on ``network`` at fake 127.0.0.0/8 addresses.

        ``clock``: what the replies read as now (default the trio clock, as ``memory_handler``)."""
        for i, node in enumerate(self.kvcm.node_ids):
            host = str(MEMORY_KVCM_BASE + i + 1)
            self.kvcm.set_endpoint(node, host, KVCM_DEFAULT_PORT)
            network.serve(format_target(host, KVCM_DEFAULT_PORT), memory_handler(self.kvcm.replica(node), clock))
        addrs = []
        for i, worker in enumerate(self.workers):
            addr = WorkerAddr.from_http(str(MEMORY_WORKER_BASE + i + 1), MEMORY_WORKER_HTTP_PORT)
            network.serve(addr.status_target, memory_handler(worker, clock))
            addrs.append(addr)
        return self._publish(addrs)

    async def serve_grpc(
        self,
        *,
        host: str = "127.0.0.1",
        clock: Clock | None = None,
        max_threads: int = 8,
        task_status: trio.TaskStatus[SimClusterAddresses] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve every replica and worker on its own gRPC server until cancelled.

        ``addresses = await nursery.start(cluster.serve_grpc)``. ``clock`` is what handler
        threads read as "now" (default: the running trio clock; see ``grpc_server``).
        """
        read_clock = clock or trio.lowlevel.current_clock().current_time
        serve = functools.partial(serve_endpoint, clock=read_clock, host=host, max_threads=max_threads)
        async with trio.open_nursery() as nursery:
            for node in self.kvcm.node_ids:
                server = await nursery.start(serve, self.kvcm.replica(node))
                self.kvcm.set_endpoint(node, server.host, server.port)
            addrs = []
            for worker in self.workers:
                server = await nursery.start(serve, worker)
                addrs.append(WorkerAddr.from_http(server.host, server.port - 1))
            task_status.started(self._publish(addrs))

    def _publish(self, addrs: Sequence[WorkerAddr]) -> SimClusterAddresses:
        if self._addresses is not None:
            raise RuntimeError("the cluster is already served")
        self._addrs = tuple(addrs)
        self._by_host = {addr.http_target: i for i, addr in enumerate(self._addrs)}
        for addr, worker in zip(self._addrs, self.workers, strict=True):
            self.kvcm.add_worker(addr.http_target, worker.spec.kv_capacity_blocks)
        nodes = []
        for node in self.kvcm.node_ids:
            endpoint = self.kvcm.endpoint(node)
            assert endpoint is not None  # set just before
            nodes.append((node, endpoint.target))
        self._addresses = SimClusterAddresses(tuple(nodes), self.kvcm.leader, self._addrs)
        return self._addresses

    # ---- the simulation ----

    def worker_index(self, worker: int | str) -> int:
        """Index of a worker given as an index or its ``ip:http_port`` identity."""
        if isinstance(worker, int):
            if not 0 <= worker < len(self.workers):
                raise ValueError(f"worker: index {worker} not in 0..{len(self.workers) - 1}")
            return worker
        index = self._by_host.get(worker)
        if index is None:
            raise ValueError(f"worker: unknown host {worker!r}")
        return index

    def worker_addr(self, worker: int | str) -> WorkerAddr:
        index = self.worker_index(worker)
        if not self._addrs:
            raise RuntimeError("the cluster is not served yet (serve_memory or serve_grpc)")
        return self._addrs[index]

    def run_prefill(
        self,
        worker: int | str,
        request_id: str,
        keys: Sequence[int],
        input_tokens: int,
        now: float,
        output_tokens: int = 0,
    ) -> PrefillOutcome:
        """A request routed to ``worker`` at ``now``: its cached prefix per the index, its simulated
        TTFT from the worker's queue, then its keys stored at the worker (as KVCM learns of a prefill).
        ``output_tokens``: its decode, which holds the worker's running KV after the prefill.
        """
        host = self.worker_addr(worker).http_target
        local = self.kvcm.local_prefix(host, keys)
        cached = min(local * self.block_size, input_tokens)
        ttft = self.workers[self.worker_index(worker)].submit(request_id, input_tokens, cached, now, output_tokens)
        evicted = self.kvcm.record_prefill(host, keys)
        return PrefillOutcome(ttft, cached, local, evicted)

    def ttft_if_routed(
        self, worker: int | str, keys: Sequence[int], input_tokens: int, now: float, output_tokens: int = 0
    ) -> float:
        """The TTFT ``run_prefill`` would give at ``now`` on ``worker``, changing nothing (exact)."""
        host = self.worker_addr(worker).http_target
        cached = min(self.kvcm.local_prefix(host, keys) * self.block_size, input_tokens)
        return self.workers[self.worker_index(worker)].ttft_if_submitted(input_tokens, cached, now, output_tokens)

    def plan_if_routed(
        self, worker: int | str, keys: Sequence[int], input_tokens: int, now: float, output_tokens: int = 0
    ) -> PlannedTask:
        """When ``run_prefill`` at ``now`` on ``worker`` would start and end the prefill, changing nothing."""
        host = self.worker_addr(worker).http_target
        cached = min(self.kvcm.local_prefix(host, keys) * self.block_size, input_tokens)
        return self.workers[self.worker_index(worker)].plan_if_submitted(input_tokens, cached, now, output_tokens)

    def busy_share(self, start: float, end: float) -> float:
        """The share of ``[start, end]`` the workers spent prefilling, over all workers (NaN if empty)."""
        if not end > start:
            return math.nan
        return sum(w.busy_s(start, end) for w in self.workers) / (len(self.workers) * (end - start))
