"""The shared vocabulary: immutable values passed between actors and adapters.

Everything here is a frozen value; nothing does I/O or reads a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from router.slot_init import slot_init
from router.targets import format_target
from router.text import cut_text as cut_text  # where the product has long kept it


class Role(enum.Enum):
    PREFILL = "PREFILL"
    PDFUSION = "PDFUSION"
    DECODE = "DECODE"
    VIT = "VIT"
    FRONTEND = "FRONTEND"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def parse(cls, reported: str) -> Role:
        """Map an engine's reported role ("RoleType.PREFILL" or "PREFILL") to a Role; unknown → UNKNOWN."""
        # ASCII alone: str.upper() maps a dotless "ı" to "I", and "prefıll" read as PREFILL.
        text = reported.strip()
        name = text.rpartition(".")[2].upper() if text.isascii() else ""
        try:
            return cls(name)
        except ValueError:
            return cls.UNKNOWN


# Roles that take a prompt's prefill: alternatives for the cache-aware pick.
PREFILL_CAPABLE_ROLES = frozenset({Role.PREFILL, Role.PDFUSION})
# Roles an answer needs beside the prefill worker (prefill/decode separation): one address each.
COMPANION_ROLES = frozenset({Role.DECODE, Role.VIT})


class KvCacheGroupMode(enum.Enum):
    UNSPECIFIED = 0
    FULL_ATTENTION_ONLY = 1
    WITH_MAMBA = 2


class QueryType(enum.Enum):
    """KVCM query types (values are the wire enum numbers)."""

    UNSPECIFIED = 0
    BATCH_GET = 1
    PREFIX_MATCH = 2
    REVERSE_ROLL_SW_MATCH = 3
    PREFIX_MATCH_WITH_MAMBA = 4


class EngineGeneration(enum.Enum):
    """Which worker-status decoder a deployment uses (engine generations differ in their status message)."""

    K = "K"


class _HashSlot:
    """The slot that holds ``WorkerAddr``'s hash. A base class of its own, not a dataclass field,
    so that ``fields``/``asdict``/``repr`` (and every JSON made from them) see only the address."""

    __slots__ = ("_hash",)
    _hash: int


@dataclass(frozen=True, slots=True)
class WorkerAddr(_HashSlot):
    """A worker as discovery knows it: ``ip:http_port``, plus derived ports.

    Hashed once, when built: the routing path keys the prober's status cache and the statuses
    maps on addresses, several times per candidate, and the generated ``__hash__`` builds and
    hashes the field tuple at each. The value is the generated one's, so equal addresses still
    hash equal and sets and dicts of addresses behave as before.
    """

    ip: str
    http_port: int
    grpc_port: int
    status_port: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.ip, self.http_port, self.grpc_port, self.status_port)))

    # Kept by @dataclass: an explicit __hash__ on a frozen, eq class is not replaced.
    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[WorkerAddr], tuple[str, int, int, int]]:
        """Pickle and copy by construction, so the copy computes its own hash (the state that
        ``slots=True`` pickles holds the fields only)."""
        return (WorkerAddr, (self.ip, self.http_port, self.grpc_port, self.status_port))

    @classmethod
    def from_http(
        cls, ip: str, http_port: int, grpc_port_offset: int = 1, status_port: int | None = None
    ) -> WorkerAddr:
        grpc_port = http_port + grpc_port_offset
        return cls(ip, http_port, grpc_port, grpc_port if status_port is None else status_port)

    @property
    def http_target(self) -> str:
        """The worker's KVCM identity (``host_ip_port``)."""
        return format_target(self.ip, self.http_port)

    @property
    def grpc_target(self) -> str:
        return format_target(self.ip, self.grpc_port)

    @property
    def status_target(self) -> str:
        return format_target(self.ip, self.status_port)


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """One task a worker reports. Optional fields keep presence: None means absent, not 0."""

    request_id: str
    input_length: int
    prefix_length: int
    is_waiting: bool
    remaining_prefill_tokens: int | None = None
    completed_prefill_tokens: int | None = None
    # False: the engine has not matched the task's prefix yet (a queued task reports 0 then).
    prefix_length_valid: bool = True

    @property
    def uncached_tokens(self) -> int:
        """Prefill tokens this task still costs the worker (its uncached part, or what remains of it)."""
        if not self.is_waiting and self.remaining_prefill_tokens is not None:
            return max(0, self.remaining_prefill_tokens)
        return max(0, self.input_length - min(self.input_length, self.prefix_length))


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One decoded worker-status reply, whatever the engine generation."""

    role: Role
    role_reported: str
    alive: bool
    status_version: int
    latest_finished_version: int
    waiting: tuple[TaskInfo, ...] = ()
    running: tuple[TaskInfo, ...] = ()
    waiting_query_len: int = 0
    running_query_len: int = 0
    available_concurrency: int = 0
    step_latency_ms: float = 0.0
    # None = not reported by the engine (never 0 standing for a real value).
    block_size: int | None = None
    lookahead_tokens: int | None = None
    kv_cache_group_mode: KvCacheGroupMode = KvCacheGroupMode.UNSPECIFIED
    available_kv_cache: int | None = None
    total_kv_cache: int | None = None
    # Tasks the engine finished since the version the poll acknowledged: no load any more, but each the
    # prefix it found (hit accuracy compares a prefill that began and ended between two polls).
    finished: tuple[TaskInfo, ...] = ()

    @property
    def waiting_count(self) -> int:
        return max(self.waiting_query_len, len(self.waiting))

    @property
    def outstanding_uncached_tokens(self) -> int:
        return sum(t.uncached_tokens for t in self.waiting) + sum(t.uncached_tokens for t in self.running)


@dataclass(frozen=True, slots=True)
class LeaderEndpoint:
    node_id: str
    host: str
    port: int

    @property
    def target(self) -> str:
        return format_target(self.host, self.port)


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """A valid GetClusterInfo answer. ``leader`` is None when no leader is elected yet."""

    self_node_id: str
    leader: LeaderEndpoint | None


@slot_init
@dataclass(frozen=True, slots=True)
class CacheQuery:
    instance_id: str
    query_type: QueryType
    block_keys: tuple[int, ...]
    trace_id: str = ""
    p2p_host_count: int = 0
    # ``block_keys`` as the wire sends them (``encode_block_keys``), when the request's checks already
    # encoded them; None: the query encodes them. Derived from block_keys: not shown, not compared.
    encoded_keys: bytes | None = field(default=None, repr=False, compare=False)


@slot_init
@dataclass(frozen=True, slots=True)
class HostMatch:
    """One host of a GetHostCacheState answer (``host_ip_port`` is ``ip:http_port``)."""

    host_ip_port: str
    local: int
    p2p_fetch: int = 0
    p2p_total: int = 0


@slot_init
@dataclass(frozen=True, slots=True)
class CacheState:
    hosts: tuple[HostMatch, ...]
    blank_hosts: int = 0  # entries with a blank host_ip_port, skipped (counted as malformed hosts)


class RouteSource(enum.Enum):
    MASTER = "master"
    KVCM = "kvcm"
    SHADOW = "shadow"
    DOMAIN = "domain"
    NONE = "none"


class Stage(enum.StrEnum):
    """A timed stage of a request: the keys of ``RouteDecision.stage_ms`` and the ``stage`` label of
    the route-duration metric. One enum for both, so an unknown stage cannot exist."""

    KEYS = "keys"
    LEADER = "leader"
    CACHE_QUERY = "cache_query"
    PLAN = "plan"
    PROBE = "probe"
    SCORE = "score"
    TOTAL = "total"
    # From the end of the last wait (the probes') to the decision leaving the router: it includes
    # SCORE and runs on past TOTAL (the decision's elapsed time, taken when it was built).
    TAIL = "tail"


class SourceOutcome(enum.Enum):
    """What one source of the chain did with a request."""

    ANSWERED = "answered"  # it chose the worker
    FELL_THROUGH = "fell_through"  # it could not help; the next source was asked
    ENDED = "ended"  # it ended the request with an error (no later source is asked)
    SKIPPED = "skipped"  # not asked: what an earlier source found makes it moot


class Reason(enum.Enum):
    """Why a decision went where it went. Values double as metric label values."""

    # Scorer reasons, verbatim from the reference scheduler.
    CACHE_LEADER = "CACHE_LEADER"
    SHORTEST_TTFT = "SHORTEST_TTFT"
    SHORTEST_TTFT_LOW_CACHE_HIT = "SHORTEST_TTFT_LOW_CACHE_HIT"
    SHORTEST_TTFT_OUTSTANDING_GUARD = "SHORTEST_TTFT_OUTSTANDING_GUARD"
    SHORTEST_TTFT_OUTSTANDING_GUARD_FALLBACK = "SHORTEST_TTFT_OUTSTANDING_GUARD_FALLBACK"
    CACHE_AFFINITY_FALLBACK = "CACHE_AFFINITY_FALLBACK"
    SHORTEST_TTFT_FALLBACK = "SHORTEST_TTFT_FALLBACK"
    # The central scheduler ("master") chose.
    MASTER = "master"
    # Fallback reasons.
    NO_MASTER = "no_master"  # no scheduler host is known healthy: not a connection failure
    MASTER_UNAVAILABLE = "master_unavailable"  # master (and slave) gave no usable reply in the window
    MASTER_BREAKER_OPEN = "master_breaker_open"
    MASTER_FALLBACK = "master_fallback"  # the scheduler asked the frontend to route by itself (8600)
    MASTER_ERROR = "master_error"  # a business error from the scheduler: the request fails with its code
    MASTER_QUEUE_FULL = "master_queue_full"  # the master's queue is over the threshold: rejected up front
    BREAKER_OPEN = "breaker_open"
    NO_LEADER = "no_leader"
    KVCM_ERROR = "kvcm_error"
    NO_POSITIVE_MATCH = "no_positive_match"
    NO_CANDIDATES = "no_candidates"
    DEADLINE = "deadline"
    OVERLOADED = "overloaded"
    FEATURE_OFF = "feature_off"
    BAD_REQUEST = "bad_request"
    NO_WORKERS = "no_workers"
    INTERNAL_ERROR = "internal_error"


class DropReason(enum.Enum):
    """Why a candidate was dropped before scoring (metric label values)."""

    NOT_ALIVE = "not_alive"
    NO_STATUS = "no_status"
    EJECTED = "ejected"
    ROLE_NOT_ROUTED = "role_not_routed"
    # A cache holder the plan passed over: known to serve another role, or lately reported down (which
    # of the two is not kept: a decision log's replay must give the same reason).
    UNFIT = "unfit"
    QUEUE_FULL = "queue_full"
    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    LOOKAHEAD_MISMATCH = "lookahead_mismatch"
    QUERY_TYPE_MISMATCH = "query_type_mismatch"  # the worker's KV cache groups need another query type
    UNKNOWN_HOST = "unknown_host"
    MALFORMED_HOST = "malformed_host"
    PROBE_SKIPPED = "probe_skipped"
    PROBE_FAILED = "probe_failed"


class KeyFamily(enum.Enum):
    RTP = "rtp"
    VLLM = "vllm"
    SGLANG = "sglang"


class ScorerPolicy(enum.Enum):
    """The selection policy the Scorer runs (the values are the setting's words)."""

    CACHE_AFFINITY = "cache-affinity"  # the reference scheduler's CacheAffinityFirst, exactly
    COST_AWARE = "cost-aware"  # prices a prefix copy and a request's fixed cost (router.policy.cost_aware)


class RouterClosed(RuntimeError):
    """``route()`` on a router whose ``open_router`` block has ended (or is ending)."""


class BadRequest(ValueError):
    """A malformed route request; the message names the field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name
        self.detail = message  # what is wrong, without the field's name (a CLI names its flag instead)


@slot_init
@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a frontend asks. Either ``token_ids`` or ``block_cache_keys`` (used as given: the chained
    keys of the prompt's full blocks, key i standing for the whole prefix up to block i)."""

    request_id: str
    token_ids: tuple[int, ...] | None = None
    block_cache_keys: tuple[int, ...] | None = None
    block_size: int | None = None
    seq_len: int | None = None
    budget_ms: float | None = None  # remaining TTFT budget
    deadline: float | None = None  # absolute trio deadline for the answer (with budget_ms: the earlier one)
    roles: tuple[Role, ...] | None = None  # None: the deployment's roles


@slot_init
@dataclass(frozen=True, slots=True)
class WireRouteRequest(RouteRequest):
    """A RouteRequest read off the wire (the sidecar's), with its block keys already encoded as the KVCM
    query sends them: encoded from protobuf's own list, which is cheaper than encoding the Python ints
    copied from it, and on the handler thread that read them instead of the routing thread.
    ``encoded_keys`` holds the keys tuple it was encoded from beside the bytes, and is kept only while
    ``block_cache_keys`` is that very tuple: a copy made with other keys or none (``replace``) has
    none, and its keys are encoded again when checked. Not shown, not compared."""

    encoded_keys: tuple[tuple[int, ...], bytes] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A copy with other keys or none (``replace``: the decision log's record drops the prompt) keeps
        # no encoding of the keys it no longer has, nor the keys themselves through it.
        if self.encoded_keys is not None and self.encoded_keys[0] is not self.block_cache_keys:
            object.__setattr__(self, "encoded_keys", None)


@slot_init
@dataclass(frozen=True, slots=True)
class CandidateExplain:
    """One candidate as the decision saw it (for explain and /debug/decisions)."""

    target: str
    source: str  # "hot" | "cold" | "shadow"
    local_blocks: int
    hit_tokens: int
    work_tokens: int | None
    role: str | None
    dropped: str | None  # DropReason value, or None if scored
    chosen: bool = False


@slot_init
@dataclass(frozen=True, slots=True)
class SourceStep:
    """One source's part in a decision: what it did, why, and the time it took."""

    source: RouteSource
    outcome: SourceOutcome
    reason: Reason | None  # why it fell through or ended; the pick's reason when it answered
    elapsed_ms: float


class SplitMode(enum.StrEnum):
    """How a request's waits were ended: the fixed split, the learned one, or cold (the learned split
    without estimates yet, so the fixed one)."""

    FIXED = "fixed"
    LEARNED = "learned"
    COLD = "cold"


@slot_init
@dataclass(frozen=True, slots=True)
class StageWindow:
    """One waiting stage's window: its end, in ms after the request's receipt, and whether the split's
    window (not the stage finishing, nor another bound) ended it."""

    stage: Stage
    end_ms: float
    cut: bool


@slot_init
@dataclass(frozen=True, slots=True)
class RouteDecision:
    request_id: str
    worker: WorkerAddr | None
    role: Role | None
    route_source: RouteSource
    reason: Reason
    hit_tokens: int = 0
    local_blocks: int = 0
    elapsed_ms: float = 0.0
    stage_ms: dict[Stage, float] = field(default_factory=dict)
    candidates: tuple[CandidateExplain, ...] = ()
    error: str | None = None  # a clear message for route_source=none or bad_request
    sources: tuple[SourceStep, ...] = ()  # the chain as this request walked it, in order
    role_addrs: tuple[RoleAddr, ...] = ()  # one worker per role the answer needs (the master's, as given)
    error_code: int = 0  # the scheduler's error code when the request fails with it (0: none)
    split: SplitMode | None = None  # None: no cache source waited (the windows were not used)
    windows: tuple[StageWindow, ...] = ()  # the waiting stages the request ran, their windows

    def answering(self, request_id: str, elapsed_ms: float) -> RouteDecision:
        """This answer given to request ``request_id`` after ``elapsed_ms`` (its one stage, the total):
        what a drawn ``overloaded`` answer becomes for each request shed with it. Every other field is
        passed on by name: half the cost of ``dataclasses.replace``, paid once per shed request (a
        test checks that no field is left behind)."""
        return RouteDecision(
            request_id=request_id,
            worker=self.worker,
            role=self.role,
            route_source=self.route_source,
            reason=self.reason,
            hit_tokens=self.hit_tokens,
            local_blocks=self.local_blocks,
            elapsed_ms=elapsed_ms,
            stage_ms={Stage.TOTAL: elapsed_ms},
            candidates=self.candidates,
            error=self.error,
            sources=self.sources,
            role_addrs=self.role_addrs,
            error_code=self.error_code,
            split=self.split,
            windows=self.windows,
        )


@slot_init
@dataclass(frozen=True, slots=True)
class RoleAddr:
    """One role's worker in an answer (prefill/decode separation names one per role)."""

    role: Role
    ip: str
    http_port: int
    grpc_port: int

    @property
    def http_target(self) -> str:
        return format_target(self.ip, self.http_port)
