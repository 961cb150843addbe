"""SimWorker: an engine's prefill queue and its GetWorkerStatus replies, generation K (core; time passed in).

Model: one FIFO prefill queue served at ``prefill_tokens_per_s``. A request costs its
uncached tokens (input − cached; a fully cached prompt still recomputes its last token,
as engines do to produce logits). Its simulated TTFT is the queue wait plus its own
prefill time. The head of the queue is running (``remaining_prefill_tokens`` shrinks
with time); the rest are waiting. ``status_version`` starts at 1 and increases on every
change (a task queued, started or finished); each finished task gets the version of its
finish, and a reply lists the finished tasks newer than the caller's
``latest_finished_version`` (the last ``finished_kept`` are remembered).

Time is the simulation's clock, passed in; it never goes back (an earlier ``now`` is
treated as the latest seen). Thread safety: public methods take the worker's lock.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvroute_sim.sim.codec import parse_request
from kvroute_sim.sim.faults import UNDECODABLE_REPLY, CallPlan, CallStats, ChangeNotifier, Garble
from router.config import DeploymentConfig
from router.types import KvCacheGroupMode
from router.wire import engine_status_pb2 as engine_pb
from router.wire import paths

WORKER_METHODS = frozenset({paths.WORKER_GET_STATUS})
_DEPLOYMENT = DeploymentConfig()


class SimWorkerOverloaded(RuntimeError):
    """``submit`` on a worker whose queue holds ``max_tasks`` tasks."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A simulated worker's fixed properties.

    ``role`` is the reported string ("RoleType.PREFILL", "RoleType.PDFUSION", ...).
    ``block_size`` None leaves the field unset (a stock generation-K engine: "not
    reported"); the lookahead is reported alongside it. ``kv_capacity_blocks`` is the
    LRU capacity the cluster gives this worker in the KVCM index.
    """

    role: str = "RoleType.PREFILL"
    prefill_tokens_per_s: float = 20_000.0
    block_size: int | None = _DEPLOYMENT.block_size
    lookahead_tokens: int = _DEPLOYMENT.lookahead_tokens
    kv_cache_group_mode: KvCacheGroupMode = KvCacheGroupMode.FULL_ATTENTION_ONLY
    kv_capacity_blocks: int = 16_384
    report_remaining_prefill: bool = True
    max_tasks: int = 4096
    finished_kept: int = 256
    step_latency_ms: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prefill_tokens_per_s) and self.prefill_tokens_per_s > 0):
            raise ValueError(f"prefill_tokens_per_s: must be > 0, got {self.prefill_tokens_per_s}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1 or None (not reported), got {self.block_size}")
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens: must be >= 0, got {self.lookahead_tokens}")
        for name, value in (
            ("kv_capacity_blocks", self.kv_capacity_blocks),
            ("max_tasks", self.max_tasks),
            ("finished_kept", self.finished_kept),
        ):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")


@dataclass(frozen=True, slots=True)
class WorkerFaults:
    """Fault knobs; replace the whole value with ``SimWorker.set_faults``.

    ``dead``: calls end UNAVAILABLE. ``hang``: accepted, never answered until the fault
    clears or the caller goes away. ``delay_s``: slow replies. ``flap_period_s`` > 0:
    alive for one period, dead the next, and so on, counted from ``flap_origin_s`` (the
    simulation clock). ``status_version_zero``: replies carry status_version 0 (no
    status). ``not_alive``: replies say alive=false. ``garbled``: undecodable bytes, or a
    reply with a negative task length.
    """

    dead: bool = False
    hang: bool = False
    delay_s: float = 0.0
    flap_period_s: float = 0.0
    flap_origin_s: float = 0.0
    status_version_zero: bool = False
    not_alive: bool = False
    garbled: Garble | None = None

    def __post_init__(self) -> None:
        for name, value in (("delay_s", self.delay_s), ("flap_period_s", self.flap_period_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be finite and >= 0, got {value}")

    def reachable(self, now: float) -> bool:
        if self.dead:
            return False
        if self.flap_period_s > 0:
            return math.floor((now - self.flap_origin_s) / self.flap_period_s) % 2 == 0
        return True


NO_WORKER_FAULTS = WorkerFaults()


@dataclass(frozen=True, slots=True)
class _Task:
    request_id: str
    input_length: int
    cached: int
    uncached: int
    enqueued_at: float
    start_at: float
    finish_at: float


@dataclass(frozen=True, slots=True)
class _Finished:
    version: int
    task: _Task


class SimWorker:
    """One simulated engine worker. ``name`` labels it in messages; its address (and KVCM identity)
    is given by whoever serves it (``SimCluster``)."""

    def __init__(
        self, name: str, spec: WorkerSpec | None = None, *, fleet_stats: CallStats | None = None
    ) -> None:
        """``fleet_stats``: a ``CallStats`` shared by several workers, also counting this one's calls."""
        self.name = name
        self.spec = WorkerSpec() if spec is None else spec
        self._lock = threading.Lock()
        self._changes = ChangeNotifier()
        self._stats = CallStats(WORKER_METHODS, parent=fleet_stats)
        self._faults = NO_WORKER_FAULTS
        self._now = -math.inf
        self._tasks: deque[_Task] = deque()  # FIFO; the head is running
        self._busy_until = -math.inf
        self._version = 1
        self._running: str | None = None
        self._finished: deque[_Finished] = deque(maxlen=self.spec.finished_kept)
        self._latest_finished_version = 0
        self._requests = 0
        self._prefill_tokens = 0

    # ---- the simulation ----

    def submit(self, request_id: str, input_tokens: int, cached_tokens: int, now: float) -> float:
        """Queue a request at ``now``; returns its simulated TTFT in seconds (queue wait + own prefill)."""
        if input_tokens < 1:
            raise ValueError(f"input_tokens: must be >= 1, got {input_tokens}")
        if not 0 <= cached_tokens <= input_tokens:
            raise ValueError(
                f"cached_tokens: must be in 0..input_tokens ({input_tokens}), got {cached_tokens}"
            )
        with self._lock:
            now = self._advance_locked(now)
            if len(self._tasks) >= self.spec.max_tasks:
                raise SimWorkerOverloaded(f"{self.name}: {len(self._tasks)} tasks queued (max_tasks)")
            uncached = max(1, input_tokens - cached_tokens)
            start = max(now, self._busy_until)
            finish = start + uncached / self.spec.prefill_tokens_per_s
            self._busy_until = finish
            self._tasks.append(_Task(request_id, input_tokens, cached_tokens, uncached, now, start, finish))
            self._version += 1
            self._requests += 1
            self._prefill_tokens += uncached
            self._advance_locked(now)
        return finish - now

    def advance(self, now: float) -> None:
        """Retire the work finished by ``now``."""
        with self._lock:
            self._advance_locked(now)

    def outstanding_tokens(self, now: float) -> int:
        """Uncached prefill tokens still to compute at ``now`` (the least-loaded baseline's view)."""
        with self._lock:
            now = self._advance_locked(now)
            return sum(self._remaining(t, now) for t in self._tasks)

    def queue_length(self, now: float) -> int:
        with self._lock:
            self._advance_locked(now)
            return len(self._tasks)

    @property
    def status_version(self) -> int:
        with self._lock:
            return self._version

    @property
    def requests_submitted(self) -> int:
        with self._lock:
            return self._requests

    @property
    def prefill_tokens_submitted(self) -> int:
        """Uncached tokens submitted in total (for load-imbalance figures)."""
        with self._lock:
            return self._prefill_tokens

    def reachable(self, now: float) -> bool:
        """Whether a call at ``now`` would reach the worker (not dead, not in a flap's dead phase)."""
        with self._lock:
            return self._faults.reachable(now)

    # ---- fault knobs ----

    @property
    def faults(self) -> WorkerFaults:
        with self._lock:
            return self._faults

    def set_faults(self, faults: WorkerFaults) -> None:
        with self._lock:
            self._faults = faults
        self._changes.notify()

    # ---- serving (SimEndpoint) ----

    @property
    def methods(self) -> frozenset[str]:
        return WORKER_METHODS

    @property
    def stats(self) -> CallStats:
        return self._stats

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        return self._changes.subscribe(wake)

    def plan(self, method_path: str, now: float) -> CallPlan:
        with self._lock:
            faults = self._faults
        if not faults.reachable(now):
            return CallPlan.dead(f"worker {self.name} is down")
        if faults.hang:
            return CallPlan(hang=True)
        return CallPlan(delay_s=faults.delay_s)

    def answer(self, method_path: str, request: bytes, now: float) -> bytes:
        version = parse_request(engine_pb.StatusVersionPB, request)
        return self.status_reply(version.latest_finished_version, now)

    def status_reply(self, latest_finished_version: int, now: float) -> bytes:
        """The serialized WorkerStatusPB (generation K) at ``now``."""
        with self._lock:
            now = self._advance_locked(now)
            faults = self._faults
            if faults.garbled is Garble.UNDECODABLE:
                return UNDECODABLE_REPLY
            reply = self._status_locked(latest_finished_version, now)
        if faults.status_version_zero:
            reply.status_version = 0
        if faults.not_alive:
            reply.alive = False
        if faults.garbled is Garble.CONTRACT:
            reply.running_task_info.add(request_id="garbled", input_length=-1, is_waiting=True)
        return reply.SerializeToString()

    # ---- internals (lock held) ----

    def _advance_locked(self, now: float) -> float:
        now = max(now, self._now)
        self._now = now
        tasks = self._tasks
        while tasks and tasks[0].finish_at <= now:
            task = tasks.popleft()
            self._version += 1
            self._finished.append(_Finished(self._version, task))
            self._latest_finished_version = self._version
        running = tasks[0].request_id if tasks and tasks[0].start_at <= now else None
        if running != self._running:
            self._running = running
            if running is not None:
                self._version += 1
        return now

    def _remaining(self, task: _Task, now: float) -> int:
        if task.start_at > now:
            return task.uncached
        return min(task.uncached, max(0, math.ceil((task.finish_at - now) * self.spec.prefill_tokens_per_s)))

    def _status_locked(self, latest_finished_version: int, now: float) -> engine_pb.WorkerStatusPB:
        spec = self.spec
        reply = engine_pb.WorkerStatusPB(
            role=spec.role,
            available_concurrency=max(0, spec.max_tasks - len(self._tasks)),
            step_latency_ms=spec.step_latency_ms,
            iterate_count=self._version,
            dp_size=1,
            tp_size=1,
            status_version=self._version,
            alive=True,
            precision="fp16",
            latest_finished_version=self._latest_finished_version,
            block_size=spec.block_size or 0,
            block_hash_lookahead_tokens=spec.lookahead_tokens if spec.block_size is not None else 0,
            kv_cache_group_mode=spec.kv_cache_group_mode.value,  # type: ignore[arg-type]
        )
        waiting = 0
        for task in self._tasks:
            is_waiting = task.start_at > now
            waiting += is_waiting
            info = reply.running_task_info.add(
                request_id=task.request_id,
                input_length=task.input_length,
                prefix_length=task.cached,
                prefix_length_valid=True,
                is_waiting=is_waiting,
                waiting_time_ms=round(((task.start_at if not is_waiting else now) - task.enqueued_at) * 1000),
            )
            if not is_waiting and spec.report_remaining_prefill:
                remaining = self._remaining(task, now)
                info.remaining_prefill_tokens = remaining
                info.completed_prefill_tokens = task.uncached - remaining
        reply.waiting_query_len = waiting
        reply.running_query_len = len(self._tasks) - waiting
        for done in self._finished:
            if done.version > latest_finished_version:
                reply.finished_task_list.add(
                    request_id=done.task.request_id,
                    input_length=done.task.input_length,
                    prefix_length=done.task.cached,
                    prefix_length_valid=True,
                    end_time_ms=round(done.task.finish_at * 1000),
                )
        return reply
