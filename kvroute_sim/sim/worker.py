"""SimWorker: an engine's prefill queue and its GetWorkerStatus replies, generation K (core; time passed in).

Model: one FIFO prefill queue served at ``prefill_tokens_per_s``. A request costs its
uncached tokens (input − cached; a fully cached prompt still recomputes its last token,
as engines do to produce logits). Its simulated TTFT is the queue wait plus its own
prefill time. The head of the queue is running (``remaining_prefill_tokens`` shrinks
with time); the rest are waiting.

Decode and held KV: after its prefill a request with ``output_tokens`` decodes for
``output_tokens / decode_tokens_per_s`` seconds (each sequence decodes at that speed,
batched with the others). From the start of its prefill to the end of its decode it holds
``ceil((input + output) / kv_block_tokens)`` blocks of the worker's running KV pool
(``running_kv_blocks``; None: unbounded). A request whose blocks do not fit waits at the
head of the queue until enough running requests end (FIFO, no overtaking), which is how a
worker full of long decodes queues new prompts. A request larger than the whole pool runs
alone. Decoding requests are reported as running tasks with nothing left to prefill and
finish when their decode ends; with ``output_tokens`` 0 a request finishes with its prefill. A
finished task's ``end_time_ms`` is when it finished (left the worker), on the simulation's clock.

``status_version`` starts at 1 and increases on every
change (a task queued, started or finished); each finished task gets the version of its
finish, and a reply lists the finished tasks newer than the caller's
``latest_finished_version`` (the last ``finished_kept`` are remembered).

Time is the simulation's clock, passed in; it never goes back (an earlier ``now`` is
treated as the latest seen). Thread safety: public methods take the worker's lock.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvroute_sim.sim.codec import parse_request
from kvroute_sim.sim.faults import (
    ANSWER_NOW,
    UNDECODABLE_REPLY,
    CallPlan,
    CallStats,
    ChangeNotifier,
    Garble,
    check_garble,
)
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
    decode_tokens_per_s: float = 40.0  # per sequence
    running_kv_blocks: int | None = None  # KV pool of running requests, in blocks; None: unbounded
    kv_block_tokens: int = _DEPLOYMENT.block_size  # tokens per block of the running KV pool

    def __post_init__(self) -> None:
        for name, rate in (
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("decode_tokens_per_s", self.decode_tokens_per_s),
        ):
            if not (math.isfinite(rate) and rate > 0):
                raise ValueError(f"{name}: must be > 0, got {rate}")
        if self.running_kv_blocks is not None and self.running_kv_blocks < 1:
            raise ValueError(f"running_kv_blocks: must be >= 1 or None (unbounded), got {self.running_kv_blocks}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1 or None (not reported), got {self.block_size}")
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens: must be >= 0, got {self.lookahead_tokens}")
        for name, value in (
            ("kv_capacity_blocks", self.kv_capacity_blocks),
            ("max_tasks", self.max_tasks),
            ("finished_kept", self.finished_kept),
            ("kv_block_tokens", self.kv_block_tokens),
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
        check_garble(self.garbled)

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
    finish_at: float  # prefill done (the first token)
    release_at: float  # decode done: the task leaves and frees its KV
    kv_blocks: int


@dataclass(frozen=True, slots=True)
class PlannedTask:
    """When a request submitted now would start and end its prefill and free its KV."""

    uncached: int
    start_at: float
    finish_at: float
    release_at: float
    kv_blocks: int


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
        self._tasks: deque[_Task] = deque()  # FIFO prefill queue; the head is running
        self._decoding: list[tuple[float, int, _Task]] = []  # heap by release time (then submit order)
        self._serial = 0
        self._busy_until = -math.inf
        self._version = 1
        self._running: str | None = None
        self._finished: deque[_Finished] = deque(maxlen=self.spec.finished_kept)
        self._latest_finished_version = 0
        self._requests = 0
        self._prefill_tokens = 0
        self._prefill_spans: list[tuple[float, float]] = []  # (start, finish) of every prefill, in order

    # ---- the simulation ----

    def submit(
        self, request_id: str, input_tokens: int, cached_tokens: int, now: float, output_tokens: int = 0
    ) -> float:
        """Queue a request at ``now``; returns its simulated TTFT in seconds (queue wait + own prefill)."""
        _check_lengths(input_tokens, cached_tokens, output_tokens)
        with self._lock:
            now = self._advance_locked(now)
            if self._in_flight_locked() >= self.spec.max_tasks:
                raise SimWorkerOverloaded(f"{self.name}: {self._in_flight_locked()} tasks queued (max_tasks)")
            plan = self._plan_locked(input_tokens, cached_tokens, output_tokens, now)
            self._busy_until = plan.finish_at
            self._tasks.append(
                _Task(
                    request_id,
                    input_tokens,
                    cached_tokens,
                    plan.uncached,
                    now,
                    plan.start_at,
                    plan.finish_at,
                    plan.release_at,
                    plan.kv_blocks,
                )
            )
            self._version += 1
            self._requests += 1
            self._prefill_tokens += plan.uncached
            self._prefill_spans.append((plan.start_at, plan.finish_at))
            self._advance_locked(now)
        return plan.finish_at - now

    def ttft_if_submitted(self, input_tokens: int, cached_tokens: int, now: float, output_tokens: int = 0) -> float:
        """The TTFT ``submit`` would return at ``now``, without submitting (an exact look-ahead)."""
        _check_lengths(input_tokens, cached_tokens, output_tokens)
        with self._lock:
            now = self._advance_locked(now)
            return self._plan_locked(input_tokens, cached_tokens, output_tokens, now).finish_at - now

    def plan_if_submitted(
        self, input_tokens: int, cached_tokens: int, now: float, output_tokens: int = 0
    ) -> PlannedTask:
        """When ``submit`` at ``now`` would start and end the prefill, without submitting (exact)."""
        _check_lengths(input_tokens, cached_tokens, output_tokens)
        with self._lock:
            now = self._advance_locked(now)
            return self._plan_locked(input_tokens, cached_tokens, output_tokens, now)

    def busy_s(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` the worker spent prefilling (the submitted prefills' spans; prefills
        never overlap on one worker, so the overlaps add up)."""
        with self._lock:
            spans = self._prefill_spans
            # In submit order, starts and ends both non-decreasing: only the span just before the first
            # one starting at ``start`` can still reach into the window.
            first = bisect.bisect_left(spans, (start, -math.inf))
            if first > 0 and spans[first - 1][1] > start:
                first -= 1
            busy = 0.0
            for span_start, span_end in itertools.islice(spans, first, None):
                if span_start >= end:
                    break
                busy += max(0.0, min(end, span_end) - max(start, span_start))
            return busy

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
        """Requests queued or in prefill at ``now`` (decoding ones not counted)."""
        with self._lock:
            self._advance_locked(now)
            return len(self._tasks)

    def in_flight(self, now: float) -> int:
        """Requests not finished at ``now``: queued, in prefill or decoding."""
        with self._lock:
            self._advance_locked(now)
            return self._in_flight_locked()

    def held_kv_blocks(self, now: float) -> int:
        """Running-pool blocks held at ``now`` by requests whose prefill has started."""
        with self._lock:
            now = self._advance_locked(now)
            return sum(t.kv_blocks for t in self._tasks if t.start_at <= now) + sum(
                t.kv_blocks for _, _, t in self._decoding
            )

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
        return CallPlan(delay_s=faults.delay_s) if faults.delay_s > 0 else ANSWER_NOW

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
        tasks, decoding = self._tasks, self._decoding
        # Retire prefills and decodes in time order, so finished versions follow finish times.
        while True:
            prefill_at = tasks[0].finish_at if tasks else math.inf
            decode_at = decoding[0][0] if decoding else math.inf
            if min(prefill_at, decode_at) > now:
                break
            if prefill_at <= decode_at:
                task = tasks.popleft()
                if task.release_at > task.finish_at:
                    self._serial += 1
                    heapq.heappush(decoding, (task.release_at, self._serial, task))
                    self._version += 1
                    continue
            else:
                task = heapq.heappop(decoding)[2]
            self._version += 1
            self._finished.append(_Finished(self._version, task))
            self._latest_finished_version = self._version
        running = tasks[0].request_id if tasks and tasks[0].start_at <= now else None
        if running != self._running:
            self._running = running
            if running is not None:
                self._version += 1
        return now

    def _in_flight_locked(self) -> int:
        return len(self._tasks) + len(self._decoding)

    def _plan_locked(self, input_tokens: int, cached_tokens: int, output_tokens: int, now: float) -> PlannedTask:
        spec = self.spec
        uncached = max(1, input_tokens - cached_tokens)
        kv_blocks = -(-(input_tokens + output_tokens) // spec.kv_block_tokens)
        start = max(now, self._busy_until)
        if spec.running_kv_blocks is not None:
            # Every task ahead has started by ``start``; it holds its blocks until its release.
            need = min(kv_blocks, spec.running_kv_blocks)
            releases = sorted(
                (t.release_at, t.kv_blocks)
                for t in itertools.chain(self._tasks, (entry[2] for entry in self._decoding))
                if t.release_at > start
            )
            held = sum(blocks for _, blocks in releases)
            for release_at, blocks in releases:
                if held + need <= spec.running_kv_blocks:
                    break
                held -= blocks
                start = max(start, release_at)
        finish = start + uncached / spec.prefill_tokens_per_s
        release = finish + output_tokens / spec.decode_tokens_per_s
        return PlannedTask(uncached, start, finish, release, kv_blocks)

    def _remaining(self, task: _Task, now: float) -> int:
        if task.start_at > now:
            return task.uncached
        return min(task.uncached, max(0, math.ceil((task.finish_at - now) * self.spec.prefill_tokens_per_s)))

    def _status_locked(self, latest_finished_version: int, now: float) -> engine_pb.WorkerStatusPB:
        spec = self.spec
        reply = engine_pb.WorkerStatusPB(
            role=spec.role,
            available_concurrency=max(0, spec.max_tasks - self._in_flight_locked()),
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
        for _, _, task in sorted(self._decoding):
            info = reply.running_task_info.add(
                request_id=task.request_id,
                input_length=task.input_length,
                prefix_length=task.cached,
                prefix_length_valid=True,
                is_waiting=False,
                waiting_time_ms=round((task.start_at - task.enqueued_at) * 1000),
            )
            if spec.report_remaining_prefill:
                info.remaining_prefill_tokens = 0
                info.completed_prefill_tokens = task.uncached
        reply.waiting_query_len = waiting
        reply.running_query_len = self._in_flight_locked() - waiting
        for done in self._finished:
            if done.version > latest_finished_version:
                reply.finished_task_list.add(
                    request_id=done.task.request_id,
                    input_length=done.task.input_length,
                    prefix_length=done.task.cached,
                    prefix_length_valid=True,
                    end_time_ms=round(done.task.release_at * 1000),  # when it left: after its decode, if any
                )
        return reply


def _check_lengths(input_tokens: int, cached_tokens: int, output_tokens: int) -> None:
    if input_tokens < 1:
        raise ValueError(f"input_tokens: must be >= 1, got {input_tokens}")
    if not 0 <= cached_tokens <= input_tokens:
        raise ValueError(f"cached_tokens: must be in 0..input_tokens ({input_tokens}), got {cached_tokens}")
    if output_tokens < 0:
        raise ValueError(f"output_tokens: must be >= 0, got {output_tokens}")
