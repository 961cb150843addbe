"""Running one policy over a workload against a fresh simulated cluster, and accounting for it.

Every policy gets a FRESH ``SimCluster`` built from the same ``ClusterSpec``, so caches and
queues start equal, and replays the same ``Workload`` (identical arrivals).

Time. The workload lives on a simulated timeline; the real router needs real time for its
RPCs. The runner drives a :class:`SimClock` from the arrivals: before each request the
clock is set to the request's arrival time, the policy decides, and the chosen worker
queues the prefill at that same simulated instant (``SimCluster.run_prefill``), which
gives the request's simulated TTFT (queue wait + uncached tokens / prefill throughput).
For kvroute the decision is a real ``route()`` call over loopback gRPC, taking real
milliseconds, while the simulated clock stands still at the arrival: the sim servers read
the simulated clock (``serve_grpc(clock=sim_clock.now)``), so every worker status the
router probes describes the queue at the request's arrival. Requests are decided one
after another in arrival order (a replay, not a load test), so a decision never sees a
later arrival's effects and a rerun gives the same choices. The router's status cache
is real-time: the comparison's router config sets a freshness TTL of 1 ms so each
decision probes statuses at its own arrival instead of reusing one from an earlier
arrival (``COMPARISON_SETTINGS``). Decision latency (real) is reported separately and is
not added to the simulated TTFT.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial

import trio

from kvroute_sim.demo.baselines import KVROUTE, BaselinePicker
from kvroute_sim.demo.request_view import RequestBaselinePicker
from kvroute_sim.demo.workload import DemoRequest, Workload, WorkloadSpec, bulk_span
from kvroute_sim.sim.cluster import DEFAULT_KVCM_REPLICAS, DEFAULT_WORKERS, SimCluster, SimClusterAddresses
from kvroute_sim.sim.grpc_server import Clock
from kvroute_sim.sim.master import SimMaster, SimMasterAddresses
from kvroute_sim.sim.worker import PlannedTask, WorkerSpec
from router.api import RouteRequest, RouterHandle, open_router
from router.settings import ROUTER_SETTING_OPTION, LoadedConfig, load_config
from router.transport.master_memory import MemoryMasterNetwork
from router.transport.memory_adapter import MemoryNetwork
from router.types import HostMatch

DEMO_INSTANCE_ID = "kvroute-demo"
NO_SOURCE = "-"  # a baseline has no route source

# The comparison replays arrivals back to back on a simulated clock (module docstring): a status
# cached for the default 50 ms of real time would describe a queue many simulated arrivals old.
COMPARISON_SETTINGS: Mapping[str, object] = {"prober_fresh_ttl_s": 0.001}

Progress = Callable[[str, int, int, float], None]  # (policy, requests done, total, hit rate so far)


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The simulated fleet every policy runs against (a fresh one per policy)."""

    workers: int = DEFAULT_WORKERS
    kvcm_replicas: int = DEFAULT_KVCM_REPLICAS
    prefill_tokens_per_s: float = WorkerSpec().prefill_tokens_per_s
    # Per worker: below the default workload's shared prefixes (32 groups x 16 blocks = 512), so a
    # policy spreading every group over every worker thrashes, while affinity keeps its groups.
    kv_capacity_blocks: int = 384
    decode_tokens_per_s: float = WorkerSpec().decode_tokens_per_s
    running_kv_blocks: int | None = WorkerSpec().running_kv_blocks  # per worker; None: unbounded

    def __post_init__(self) -> None:
        for name, value in (
            ("workers", self.workers),
            ("kvcm_replicas", self.kvcm_replicas),
            ("kv_capacity_blocks", self.kv_capacity_blocks),
        ):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if not (math.isfinite(self.prefill_tokens_per_s) and self.prefill_tokens_per_s > 0):
            raise ValueError(f"prefill_tokens_per_s: must be > 0, got {self.prefill_tokens_per_s}")
        if not (math.isfinite(self.decode_tokens_per_s) and self.decode_tokens_per_s > 0):
            raise ValueError(f"decode_tokens_per_s: must be > 0, got {self.decode_tokens_per_s}")
        if self.running_kv_blocks is not None and self.running_kv_blocks < 1:
            raise ValueError(f"running_kv_blocks: must be >= 1, got {self.running_kv_blocks}")

    @classmethod
    def full_size(cls) -> ClusterSpec:
        """For ``WorkloadSpec.full_size()``: twice the groups with twice the blocks per system prompt,
        so four times the capacity keeps the same ratio of capacity to shared prefixes."""
        scaled = cls()
        return replace(scaled, kv_capacity_blocks=scaled.kv_capacity_blocks * 4)

    def to_json(self) -> dict[str, object]:
        return {
            "workers": self.workers,
            "kvcm_replicas": self.kvcm_replicas,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "kv_capacity_blocks": self.kv_capacity_blocks,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "running_kv_blocks": self.running_kv_blocks,
        }


def build_cluster(spec: ClusterSpec, workload: Workload) -> SimCluster:
    """A fresh cluster for replaying ``workload``: its workers report the workload's block size (so
    the router keeps them), and a queue bound no replay can reach (every request fits one queue)."""
    block_size = workload.spec.block_size
    worker = WorkerSpec(
        prefill_tokens_per_s=spec.prefill_tokens_per_s,
        block_size=block_size,
        kv_capacity_blocks=spec.kv_capacity_blocks,
        max_tasks=max(WorkerSpec().max_tasks, len(workload.requests)),
        decode_tokens_per_s=spec.decode_tokens_per_s,
        running_kv_blocks=spec.running_kv_blocks,
        kv_block_tokens=block_size,
    )
    return SimCluster([worker] * spec.workers, spec.kvcm_replicas, block_size=block_size)


class SimClock:
    """The simulated clock the sim servers read (``now``); set by the runner, never goes back.

    Read from gRPC handler threads and written by the trio thread: a float attribute is
    read and replaced atomically in CPython, and readers need no more than the latest value.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def set(self, now: float) -> None:
        self._now = max(self._now, now)


class SimClusterView:
    """A ``ClusterView`` of a served ``SimCluster`` at simulated time ``now``; with ``request``, also
    the exact look-ahead the request-aware baselines use (``request_view.RequestView``)."""

    def __init__(
        self, cluster: SimCluster, hosts: Sequence[str], now: float, request: DemoRequest | None = None
    ) -> None:
        self._cluster = cluster
        self._hosts = hosts
        self._now = now
        self._request = request

    @property
    def request(self) -> DemoRequest:
        if self._request is None:
            raise RuntimeError("this view was taken without a request")
        return self._request

    def ttft_if_routed(self, worker: int) -> float:
        """The exact simulated TTFT of the request on ``worker`` now (nothing changes)."""
        r = self.request
        return self._cluster.ttft_if_routed(worker, r.keys, r.input_tokens, self._now, r.output_tokens)

    def plan_if_routed(self, worker: int) -> PlannedTask:
        """When the request's prefill would start and end on ``worker`` if routed now (nothing changes)."""
        r = self.request
        return self._cluster.plan_if_routed(worker, r.keys, r.input_tokens, self._now, r.output_tokens)

    def requests_in_flight(self, worker: int) -> int:
        """Requests routed to ``worker`` and not finished (queued, in prefill or decoding)."""
        return self._cluster.workers[worker].in_flight(self._now)

    @property
    def hosts(self) -> Sequence[str]:
        return self._hosts

    def outstanding_tokens(self, worker: int) -> int:
        return self._cluster.workers[worker].outstanding_tokens(self._now)

    def cached_blocks(self, worker: int, keys: Sequence[int]) -> int:
        return self._cluster.kvcm.local_prefix(self._hosts[worker], keys)

    def kvcm_matches(self, keys: Sequence[int]) -> Sequence[HostMatch]:
        return self._cluster.kvcm.match(keys)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request cost under one policy."""

    request_id: str
    worker: int  # -1: the policy gave no worker (kvroute route_source=none)
    input_tokens: int
    cached_tokens: int
    ttft_s: float  # simulated; NaN when unrouted
    decision_s: float  # real
    route_source: str
    reason: str
    predicted_tokens: int | None = None  # the hit the policy predicted (kvroute's hit_tokens; None: no prediction)
    group: int = -1  # the request's prefix group (see ``prefix_group``); -1: unknown
    best_cached_tokens: int = 0  # the longest prefix any worker held for it at its arrival


def prefix_group(request: DemoRequest) -> int:
    """The shared prefix a request belongs to: its workload group, or for a trace request (group
    unknown) its first block key; -1 when it has neither."""
    if request.group >= 0:
        return request.group
    return request.keys[0] if request.keys else -1


@dataclass(frozen=True, slots=True)
class PolicyRun:
    """One policy's records, in arrival order, and each worker's total prefill (uncached) tokens.

    ``busy_share``: the share of the workload's bulk window (``workload.bulk_span``) the workers spent
    prefilling, measured on the simulated clock (NaN when not measured).
    """

    policy: str
    records: tuple[RequestRecord, ...]
    worker_prefill_tokens: tuple[int, ...]
    busy_share: float = math.nan


class _Tally:
    """Records plus the running hit rate for live progress."""

    def __init__(self, policy: str, total: int, progress: Progress | None) -> None:
        self.policy = policy
        self.records: list[RequestRecord] = []
        self._total = total
        self._progress = progress
        self._cached = 0
        self._input = 0
        self._every = max(1, total // 50)

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self._cached += record.cached_tokens
        self._input += record.input_tokens
        done = len(self.records)
        if self._progress is not None and (done % self._every == 0 or done == self._total):
            self._progress(self.policy, done, self._total, self._cached / self._input if self._input else 0.0)

    def finish(self, cluster: SimCluster, window: tuple[float, float]) -> PolicyRun:
        """The run; ``window``: the first and last arrival on the cluster's clock (for ``busy_share``)."""
        loads = tuple(w.prefill_tokens_submitted for w in cluster.workers)
        return PolicyRun(self.policy, tuple(self.records), loads, cluster.busy_share(*window))


def measured_window(workload: Workload, origin: float = 0.0) -> tuple[float, float]:
    """The bulk window of ``workload`` (``workload.bulk_span``) on a clock where it starts at ``origin``."""
    start, end = bulk_span(workload)
    return (origin + start, origin + end)


def run_baseline(
    policy: BaselinePicker | RequestBaselinePicker,
    workload: Workload,
    cluster_spec: ClusterSpec,
    progress: Progress | None = None,
) -> PolicyRun:
    """Replay ``workload`` with a baseline ``policy`` on a fresh in-memory cluster (synchronous, CPU only)."""
    cluster = build_cluster(cluster_spec, workload)
    # Served on a throwaway in-memory network only to give the workers their addresses.
    hosts = tuple(addr.http_target for addr in cluster.serve_memory(MemoryNetwork()).workers)
    tally = _Tally(policy.name, len(workload.requests), progress)
    for request in workload.requests:
        view = SimClusterView(cluster, hosts, request.arrival_s, request)
        started = time.perf_counter()  # measures the policy's own cost; not policy time
        worker = policy.choose(request.keys, view)
        decision_s = time.perf_counter() - started
        tally.add(_prefill(cluster, request, worker, decision_s, NO_SOURCE, NO_SOURCE))
    return tally.finish(cluster, measured_window(workload))


def _prefill(
    cluster: SimCluster, request: DemoRequest, worker: int, decision_s: float, source: str, reason: str
) -> RequestRecord:
    # Measured before the prefill stores the request's keys: what the policy could have reused.
    best_blocks = max(
        (cluster.kvcm.local_prefix(addr.http_target, request.keys) for addr in cluster.addresses.workers), default=0
    )
    outcome = cluster.run_prefill(
        worker, request.request_id, request.keys, request.input_tokens, request.arrival_s, request.output_tokens
    )
    return RequestRecord(
        request.request_id,
        worker,
        request.input_tokens,
        outcome.cached_tokens,
        outcome.ttft_s,
        decision_s,
        source,
        reason,
        group=prefix_group(request),
        best_cached_tokens=min(best_blocks * cluster.block_size, request.input_tokens),
    )


# ---- kvroute: the real router over loopback gRPC --------------------------------------------------


class DemoConfigError(ValueError):
    """The router settings built for the demo do not validate (the message lists every problem)."""


def router_settings(kvcm_bootstrap: str, workers: str, workload: WorkloadSpec) -> dict[str, object]:
    """The settings pointing a router at a sim cluster's addresses (setting name → value)."""
    return {
        "kvcm_bootstrap": kvcm_bootstrap,
        "workers": workers,
        "block_size": workload.block_size,
        "key_family": workload.key_family,
        "kvcm_instance_id": DEMO_INSTANCE_ID,
    }


# What points a scenario's router at the simulated cluster it serves (``router_settings`` and the
# scheduler's replicas): overridden, the router would ask peers, or hash blocks, the simulators do not have.
CLUSTER_SETTINGS: Mapping[str, str] = {
    name: "the scenario points the router at its simulated cluster with it"
    for name in ("kvcm_bootstrap", "workers", "master_hosts", "block_size", "key_family")
}


def refuse_fixed_settings(scenario: str, overrides: Mapping[str, object], fixed: Mapping[str, str]) -> None:
    """Raise ``DemoConfigError`` naming ``--router-setting`` and ``--scenario`` when ``overrides`` set
    one of ``CLUSTER_SETTINGS`` or of ``fixed`` (setting name -> why the scenario sets it itself)."""
    reasons = dict(CLUSTER_SETTINGS) | dict(fixed)
    clashes = [
        f"--router-setting {name} cannot be combined with --scenario {scenario}: {reasons[name]}"
        for name in overrides
        if name in reasons
    ]
    if clashes:
        raise DemoConfigError("; ".join(clashes))


def check_router_settings(workload: WorkloadSpec, extra_settings: Mapping[str, object]) -> None:
    """Validate ``extra_settings`` before anything is served (placeholder addresses); raise
    ``DemoConfigError`` listing every problem, so a bad override fails fast and clearly."""
    load_router_config(router_settings("127.0.0.1:1", "127.0.0.1:1", workload) | dict(extra_settings))


def load_router_config(settings: Mapping[str, object], *, strict: bool = True) -> LoadedConfig:
    """Validate ``settings`` through the settings table (environment ignored, so runs are reproducible).

    ``strict``: any problem raises ``DemoConfigError`` listing all of them; otherwise the caller
    gets the fail-soft result (``.effective``) and the problems.
    """
    loaded = load_config(settings, {}, flags_given_as=dict.fromkeys(settings, ROUTER_SETTING_OPTION))
    if strict and loaded.errors:
        raise DemoConfigError("router settings: " + "; ".join(str(p) for p in loaded.errors))
    return loaded


@dataclass(frozen=True, slots=True)
class KvrouteSetup:
    """A served sim cluster and a real router pointed at it (from ``open_kvroute``)."""

    cluster: SimCluster
    addresses: SimClusterAddresses
    handle: RouterHandle
    loaded: LoadedConfig
    master: SimMaster | None = None  # the scheduler the router asks first, when the demo serves one
    master_addresses: SimMasterAddresses | None = None


@asynccontextmanager
async def open_kvroute(
    cluster: SimCluster,
    workload: WorkloadSpec,
    *,
    clock: Clock | None = None,
    extra_settings: Mapping[str, object] | None = None,
    debug_http: bool = False,
    strict: bool = True,
    network: MemoryNetwork | None = None,
    master: SimMaster | None = None,
) -> AsyncIterator[KvrouteSetup]:
    """Serve ``cluster`` over loopback gRPC (reading ``clock``; default the trio clock) and open the
    real router on it (``open_router(..., rpc=None)``: ChannelPool + gRPC) for the block's duration.

    With ``network``, the cluster is served on that in-memory network instead and the router calls it
    (``rpc=network``; the sims read ``clock``, default trio time, so a MockClock drives everything).
    With ``master``, that scheduler is served too (its real HTTP and gRPC servers on loopback, or with
    ``network`` on an in-memory scheduler network) and the router's ``master_hosts`` name its replicas.
    ``extra_settings`` override the generated ones (setting name → value, validated).
    """
    async with trio.open_nursery() as nursery:
        if network is None:
            addresses: SimClusterAddresses = await nursery.start(partial(cluster.serve_grpc, clock=clock))
        else:
            addresses = cluster.serve_memory(network, clock=clock)
        master_addresses: SimMasterAddresses | None = None
        master_network: MemoryMasterNetwork | None = None
        if master is not None:
            if network is None:
                master_addresses = await nursery.start(master.run)
            else:
                master_network = MemoryMasterNetwork()
                master_addresses = master.serve_memory(master_network)
        settings = router_settings(addresses.kvcm_bootstrap, addresses.workers_arg, workload)
        if master_addresses is not None:
            settings["master_hosts"] = ",".join(master_addresses.hosts)
        settings |= dict(extra_settings or {})
        loaded = load_router_config(settings, strict=strict)
        async with open_router(
            loaded.effective, rpc=network, master=master_network, loaded=loaded, debug_http=debug_http
        ) as handle:
            yield KvrouteSetup(cluster, addresses, handle, loaded, master, master_addresses)
        nursery.cancel_scope.cancel()


def route_request(request: DemoRequest, block_size: int, budget_ms: float | None = None) -> RouteRequest:
    """The router's request for a workload request: its block keys as caller keys (hashed once, up front).

    Only the keys of the prompt's full blocks: caller keys name full blocks (what an engine caches),
    and the router refuses keys covering more tokens than ``seq_len``. A trace's ``hash_ids`` also
    name the last, partial block, and passing them all turned every trace request into a bad
    request routed by the domain fallback.
    """
    return RouteRequest(
        request_id=request.request_id,
        block_cache_keys=request.keys[: request.input_tokens // block_size],
        block_size=block_size,
        seq_len=request.input_tokens,
        budget_ms=budget_ms,
    )


async def run_kvroute(
    setup: KvrouteSetup, clock: SimClock, workload: Workload, progress: Progress | None = None, label: str = KVROUTE
) -> PolicyRun:
    """Replay ``workload`` through the real router, the sim clock following the arrivals (module doc).

    ``setup`` must serve a fresh cluster reading ``clock``.
    """
    cluster = setup.cluster
    tally = _Tally(label, len(workload.requests), progress)
    block_size = workload.spec.block_size
    for request in workload.requests:
        clock.set(request.arrival_s)
        started = trio.current_time()
        decision = await setup.handle.route(route_request(request, block_size))
        decision_s = trio.current_time() - started
        source, reason = decision.route_source.value, decision.reason.value
        if decision.worker is None:
            tally.add(
                RequestRecord(request.request_id, -1, request.input_tokens, 0, math.nan, decision_s, source, reason)
            )
            continue
        worker = cluster.worker_index(decision.worker.http_target)
        record = _prefill(cluster, request, worker, decision_s, source, reason)
        tally.add(replace(record, predicted_tokens=decision.hit_tokens))
    return tally.finish(cluster, measured_window(workload))
