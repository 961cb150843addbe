"""The gRPC way in: ``kvroute.v1.Router/Route`` and the standard gRPC health service.

A :class:`Sidecar` serves a running router (``open_router``) on ``--grpc-listen``:

- Route calls arrive on grpc's handler threads (``--grpc-max-workers`` of them). gRPC holds at
  most ``--grpc-max-concurrent-rpcs`` calls at once, health checks included (an open Watch stream holds no place): those
  beyond the threads wait for one (holding no thread), and a call beyond the cap is refused with
  RESOURCE_EXHAUSTED. A closed loop of more callers than threads is then answered, not refused:
  a call that waited reaches its thread with less time left and is answered ``overloaded`` at once
  when that cannot cover the router (below). Each is decoded, handed to the trio thread with
  ``TrioToken.run_sync_soon`` and runs there as a task; the handler thread waits for its decision
  no longer than the call's deadline: the client's gRPC deadline and the routing deadline
  (min(budget, ``--budget-cap-ms``)) plus a short slack. (``trio.from_thread.run`` could not bound that wait.)
- The client's gRPC deadline is the caller's deadline: the router decides ``--reply-margin-ms``
  before it (and by min(budget, cap) at the latest), keeping that margin to send the answer. The
  time a call waited to reach the trio thread is counted against it.
- Overload is answered on the handler thread, before the hop to the trio thread: a call whose
  time left (its routing deadline, the client's deadline less the reply margin and this
  sidecar's own path) cannot cover the router's published admission estimate, that finds as
  many calls waiting for a handler thread as there are threads, or that finds as many calls
  handed to the router and not yet answered as the learnt in-flight limit allows
  (``InFlightLimit``: it shrinks when handed-off calls come back late or had waited for their
  thread more than half their client's deadline, grows when they come back early, never beyond
  ``--router-max-in-flight``; below one it is a duty cycle), gets one of the
  router's published ``overloaded`` answers at once (a request naming roles always goes to the
  router). Up to ``--slot-waiters`` calls (default none) that find the limit reached wait for a place instead,
  each at most a quarter of its time left (and never past what leaves the estimate covered), and
  are answered ``overloaded`` if none comes: under a closed loop a caller answered at once calls
  again at once, and those sheds take the CPU the routed calls need.
  The shed is counted and recorded on the trio thread afterwards, in batches; at most
  ``SHED_RECORDS_MAX`` wait for it, and a shed beyond them is answered and counted, not recorded.
- A request larger than the ``limits`` settings allow is refused from its sizes, before it is
  converted or reaches the trio thread, with INVALID_ARGUMENT naming the field and the bound.
- A bad request ends with INVALID_ARGUMENT and a message naming the field; a decision with
  ``route_source=none`` (no worker known) is returned as is, with its error in the trailing
  metadata ``kvroute-error``.
- TLS with ``--grpc-tls-cert``/``--grpc-tls-key`` (plaintext without); with ``--grpc-tls-client-ca``
  every client must present a certificate that CA signed (mTLS), health calls included.
- Health (``grpc.health.v1.Health``, service "" and "kvroute.v1.Router"): SERVING while the router
  is ready, NOT_SERVING while it is not and from the start of a drain on. A Check answers from the
  readiness the trio thread last published (every ``READY_PUBLISH_S``): it never waits for that thread.

``run()`` serves until :meth:`Sidecar.drain` is called or it is cancelled (then it stops at once).
A drain lasts at most ``--drain-timeout-s``: health turns NOT_SERVING and new calls are refused with
UNAVAILABLE (not routed) for ``--drain-lame-duck-s`` while grpc keeps running, so calls it already
accepted still reach a handler; then grpc stops (refusing at the transport) and the calls in flight
get the rest of the drain deadline to finish.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ParamSpec, TypeVar

import grpc
import trio
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from outcome import Error, Outcome

from actors.metrics_sink import RepliesSent
from actors.router_actor import OverloadAnswers
from router.admission import InFlightLimit, admits, slot_wait_s
from router.api import RouterHandle
from router.config import KvrouteConfig, LimitsConfig
from router.keys import INT64
from router.logs import ctx
from router.problems import refuse
from router.receipt import INITIAL_IN_FLIGHT_LIMIT, HandOffGate, HeldPlace, ShedRecords
from router.request import (
    budget_deadline,
    budget_left_ms,
    caller_deadline,
    check_bounds,
    check_geometry,
    check_shape,
    quoted,
)
from router.settings import parse_listen, section_problems
from router.targets import HostPort, format_target, redact_userinfo
from router.thread_bridge import ANSWER_SLACK_S, answer_within, deliver_outcome, settle
from router.transport.errors import PeerAbort, RpcStatus
from router.transport.grpc_server import method_handlers
from router.transport.tls import server_credentials
from router.types import (
    BadRequest,
    Reason,
    Role,
    RouteDecision,
    RouterClosed,
    RouteRequest,
    RouteSource,
    Stage,
    WireRouteRequest,
)
from router.wire import router_v1_pb2
from router.wire.decode import encode_block_keys
from router.wire.paths import ROUTER_ROUTE
from router.wire.strings import first_bad_utf8

log = logging.getLogger(__name__)
_P = ParamSpec("_P")
_T = TypeVar("_T")

ROUTER_SERVICE = "kvroute.v1.Router"
ERROR_METADATA_KEY = "kvroute-error"
PATH_COST_DECAY = 0.9  # weight the own-path estimate keeps per call (a few calls follow a change)
CALL_TIMING_SAMPLES = 65_536  # the most recent calls' timings kept for take_call_timings()
# The trio thread publishes the router's readiness this often; a health Check answers from the last
# publication without waiting for the trio thread (this much stale at most, while that thread runs).
READY_PUBLISH_S = 0.5
READY_STALE_S = 4 * READY_PUBLISH_S  # a publication older than this means the routing thread is stuck
# An error carried in the trailing metadata is cut to this many characters (metadata is bounded).
ERROR_METADATA_CHARS = 1024
REPLY_SAMPLES = 256  # replies' way-back times kept until the next call hands them to the metrics sink
_HEALTH_SERVICES = ("", ROUTER_SERVICE)
_ROLE_NAMES = ", ".join(r.value for r in Role if r is not Role.UNKNOWN)
# RouteRequest's string fields by number (request_id, roles): what a refusal names when one is not UTF-8.
_STRING_FIELDS = {
    f.number: (f.name, f.is_repeated)
    for f in router_v1_pb2.RouteRequest.DESCRIPTOR.fields
    if f.type == f.TYPE_STRING
}
# The fields a message that does not parse is walked over to find a string that is not UTF-8: a
# message in field order holds its request id first and its roles after the two packed lists; a
# message of many unpacked fields stops the walk there, bounding the handler thread's work.
UTF8_WALK_MAX_FIELDS = 1024

# --- conversion (pure) ---------------------------------------------------------------------------


def _role(name: str) -> Role:
    text = name.strip()
    try:
        # ASCII alone: str.upper() maps a dotless "ı" to "I", and "prefıll" read as PREFILL.
        role = Role(text.upper()) if text.isascii() else Role.UNKNOWN
    except ValueError:
        role = Role.UNKNOWN
    if role is Role.UNKNOWN:
        raise BadRequest("roles", f"unknown role {quoted(name)} (known: {_ROLE_NAMES})")
    return role


def request_from_proto(
    message: router_v1_pb2.RouteRequest, limits: LimitsConfig, deployment_block_size: int
) -> RouteRequest:
    """The router's request for a ``kvroute.v1.RouteRequest``; raises BadRequest naming the field.

    A request larger than ``limits`` is refused from its sizes, and one without an id or without
    exactly one of the two lists from its shape, before anything is converted. proto3 cannot tell an
    unset scalar from 0: block_size, seq_len and budget_ms 0 mean "not given" (budget: use the cap),
    and an empty token_ids / block_cache_keys list is not given. Block size and seq_len against the
    lists are checked here too (``check_geometry``); the rest (roles the deployment routes, each id)
    by the router, which answers reason=bad_request with an error naming the field.
    """
    check_proto_bounds(message, limits, deployment_block_size)
    return converted(message)


GRPC_DEFAULT_MAX_RECEIVE_BYTES = 4 * 1024 * 1024


def max_request_bytes(limits: LimitsConfig) -> int:
    """The most bytes a RouteRequest can take on the wire that the limits might still allow, doubled:
    grpc refuses a larger message before the handler runs (RESOURCE_EXHAUSTED, naming no field), so
    it is set past the largest legal request, whose checks then name the field and its bound. Never
    below grpc's own default (pure)."""
    ids = 10 * (limits.max_prompt_tokens + limits.max_block_keys)  # a packed int64 takes 10 bytes at most
    legal = ids + 4 * limits.max_request_id_bytes + 32 * limits.max_roles + 64 * 1024
    return max(GRPC_DEFAULT_MAX_RECEIVE_BYTES, 2 * legal)


def check_proto_bounds(message: router_v1_pb2.RouteRequest, limits: LimitsConfig, deployment_block_size: int) -> int:
    """Raise BadRequest naming the field when ``message`` is larger than ``limits`` allow (from its sizes),
    malformed in its shape (no id, not exactly one prompt list) or in its geometry (block size and
    seq_len against its lists: ``check_geometry``): all before it may be shed, which would otherwise
    give a request the router refuses a worker under overload. Returns the prompt's length (what a
    shed charges its worker)."""
    n_tokens, n_keys = len(message.token_ids), len(message.block_cache_keys)
    check_bounds(limits, request_id=message.request_id, n_tokens=n_tokens, n_keys=n_keys, n_roles=len(message.roles))
    check_shape(message.request_id, has_tokens=n_tokens > 0, has_keys=n_keys > 0)
    _, seq_len = check_geometry(
        n_tokens=n_tokens,
        n_keys=n_keys if n_keys else None,
        block_size=message.block_size or None,  # 0: not given
        seq_len=message.seq_len or None,
        deployment_block_size=deployment_block_size,
        limits=limits,
    )
    return seq_len


def converted(message: router_v1_pb2.RouteRequest) -> WireRouteRequest:
    """The router's request for a message whose sizes were checked (:func:`check_proto_bounds`); raises
    BadRequest only for an unknown role. Most of its cost is the lists' copy into Python ints, which a
    request answered ``overloaded`` at receipt never needs. Block keys come with their encoding for
    the KVCM query, made here from protobuf's own list (``WireRouteRequest``)."""
    keys = tuple(message.block_cache_keys)
    return WireRouteRequest(
        request_id=message.request_id,
        token_ids=tuple(message.token_ids) or None,
        block_cache_keys=keys or None,
        block_size=message.block_size or None,
        seq_len=message.seq_len or None,
        budget_ms=budget_ms(message),
        roles=tuple(_role(name) for name in message.roles) or None,
        encoded_keys=(keys, encode_block_keys(message.block_cache_keys)) if keys else None,
    )


def budget_ms(message: router_v1_pb2.RouteRequest) -> float | None:
    return float(message.budget_ms) or None  # 0: not given


def decision_to_proto(decision: RouteDecision) -> router_v1_pb2.RouteDecision:
    worker = decision.worker
    return router_v1_pb2.RouteDecision(
        request_id=decision.request_id,
        ip=worker.ip if worker is not None else "",
        http_port=worker.http_port if worker is not None else 0,
        grpc_port=worker.grpc_port if worker is not None else 0,
        role=decision.role.value if decision.role is not None else "",
        route_source=decision.route_source.value,
        reason=decision.reason.value,
        hit_tokens=decision.hit_tokens,
        local_blocks=decision.local_blocks,
        elapsed_ms=decision.elapsed_ms,
        role_addrs=[
            router_v1_pb2.RoleAddr(role=a.role.value, ip=a.ip, http_port=a.http_port, grpc_port=a.grpc_port)
            for a in decision.role_addrs
        ],
        error_code=decision.error_code,
        error_message=decision.error or "" if decision.error_code else "",
    )


def shed_reply_body(decision: RouteDecision) -> bytes:
    """``decision`` serialised without its request id and elapsed time, for :func:`shed_reply`."""
    return decision_to_proto(replace(decision, request_id="", elapsed_ms=0.0)).SerializeToString()


def shed_reply(body: bytes, request_id: str, elapsed_ms: float) -> bytes:
    """A published answer's reply for one call: its request id and elapsed time serialised ahead of
    the answer's :func:`shed_reply_body`. A protobuf parser takes fields in any order, and the body
    leaves both at their defaults (not serialised), so the result parses as the whole decision."""
    return router_v1_pb2.RouteDecision(request_id=request_id, elapsed_ms=elapsed_ms).SerializeToString() + body


# --- the server ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SidecarStats:
    """Route calls by how they ended (counted when the handler returns) and those still in flight."""

    answered: int  # a decision was sent
    invalid: int  # INVALID_ARGUMENT
    unavailable: int  # refused: the sidecar was stopping or the router had stopped (not routed)
    timed_out: int  # DEADLINE_EXCEEDED: no decision before the call's deadline
    failed: int  # INTERNAL: the router raised
    in_flight: int
    # Of the answered (and client_gone): answered overloaded on the handler thread, never handed to the router.
    shed_at_receipt: int
    waited_for_place: int = 0  # calls that found the in-flight limit reached and waited for a place
    shed_after_wait: int = 0  # of those: no place came in the time they could wait (in shed_at_receipt too)
    # Of shed_at_receipt: answered, but not counted by the router nor written to the decision log
    # (SHED_RECORDS_MAX were waiting for the trio thread).
    sheds_unrecorded: int = 0
    # Calls still being routed when the drain's grace ended, not routed (not in ``unavailable``).
    cut_at_drain_deadline: int = 0
    # A decision was made, but the client had cancelled or its deadline had passed before the reply:
    # nobody received it (not in ``answered``; a shed's is in ``shed_at_receipt`` too).
    client_gone: int = 0
    # The client's deadline had passed before a handler thread took the call (it waited in gRPC's
    # queues): ended DEADLINE_EXCEEDED unread, neither routed nor shed (not in ``timed_out``).
    expired_at_receipt: int = 0


# The SidecarStats counts /metrics carries as kvroute_sidecar_calls_total{outcome}.
_SCRAPED_OUTCOMES: Mapping[str, Callable[[SidecarStats], int]] = {
    "answered": lambda stats: stats.answered,
    "invalid": lambda stats: stats.invalid,
    "unavailable": lambda stats: stats.unavailable,
    "timed_out": lambda stats: stats.timed_out,
    "failed": lambda stats: stats.failed,
    "shed_at_receipt": lambda stats: stats.shed_at_receipt,
    "sheds_unrecorded": lambda stats: stats.sheds_unrecorded,
    "cut_at_drain_deadline": lambda stats: stats.cut_at_drain_deadline,
    "client_gone": lambda stats: stats.client_gone,
    "expired_at_receipt": lambda stats: stats.expired_at_receipt,
}

_OUTCOME_BY_STATUS = {
    RpcStatus.INVALID_ARGUMENT: "invalid",
    RpcStatus.UNAVAILABLE: "unavailable",
    RpcStatus.DEADLINE_EXCEEDED: "timed_out",
}


@dataclass(frozen=True, slots=True)
class CallTiming:
    """One Route call the sidecar made a reply for (answered, or its client gone by then), seen by the
    sidecar: from its handler's start to the reply's bytes."""

    elapsed_s: float  # receipt (the handler thread started) to the serialised reply
    # The time the call had left at receipt: min(budget, --budget-cap-ms) less its wait for the handler
    # thread, or the client's remaining time if less; at least 0. The sidecar is judged from its receipt
    # (P7): a call whose wait for a thread took its whole budget is owed an answer at once, and the wait
    # itself is gRPC's queueing, reported beside (the client's latency; P7's "budget gone at receipt").
    allowed_s: float
    # The router's own time, from taking the request to deciding (the decision's stage total);
    # elapsed_s less it is this sidecar's own path: decoding, the hop to the trio thread and back,
    # encoding.
    router_s: float = 0.0
    query_s: float | None = None  # the decision's KVCM query stage (None: it made none)
    # A call handed to the router (None: answered overloaded at receipt): receipt to the trio thread
    # taking it (decoding, admission, the hop), and the decision settled there to the serialised reply.
    handed_s: float | None = None
    way_back_s: float | None = None
    # Of router_s: planning, probing and scoring the candidates (None: the decision scored none).
    scoring_s: float | None = None
    # The client's deadline left at receipt (None: it set none); always above 0: a call with none left is
    # ended unread and not timed (``SidecarStats.expired_at_receipt``).
    client_left_s: float | None = None
    # The answer's source (None: answered overloaded at receipt, on the handler thread, or not answered).
    route_source: RouteSource | None = None
    # False: handed to the router, the call got no reply: the handler gave up at its wait's end
    # (DEADLINE_EXCEEDED), the router stopped (UNAVAILABLE) or failed (INTERNAL); elapsed_s is its
    # receipt to that end. Kept, as the slowest calls are: a latency over the replies alone would
    # leave them out.
    answered: bool = True

    @property
    def own_path_s(self) -> float:
        """The sidecar's share of elapsed_s: everything but the router's decision."""
        return max(0.0, self.elapsed_s - self.router_s)

    @property
    def lateness_s(self) -> float:
        return self.elapsed_s - self.allowed_s


# A call's timing as the sidecar keeps it until taken: CallTiming's fields in order, the answer's
# source by its value. A tuple of numbers, strings and None, which the collector stops tracking at its
# first collection: a measurement keeps every call of a rate, up to CALL_TIMING_SAMPLES, and kept as
# objects they were what the process's young collections walked most.
_TimingRow = tuple[
    float, float, float, float | None, float | None, float | None, float | None, float | None, str | None, bool
]


def _timing_row(t: CallTiming) -> _TimingRow:
    source = None if t.route_source is None else t.route_source.value
    return (
        t.elapsed_s,
        t.allowed_s,
        t.router_s,
        t.query_s,
        t.handed_s,
        t.way_back_s,
        t.scoring_s,
        t.client_left_s,
        source,
        t.answered,
    )


def _call_timing(row: _TimingRow) -> CallTiming:
    elapsed_s, allowed_s, router_s, query_s, handed_s, way_back_s, scoring_s, client_left_s, source, answered = row
    return CallTiming(
        elapsed_s,
        allowed_s,
        router_s,
        query_s,
        handed_s,
        way_back_s,
        scoring_s,
        client_left_s,
        None if source is None else RouteSource(source),
        answered,
    )


_SCORING_STAGES = (Stage.PLAN, Stage.PROBE, Stage.SCORE)
_NO_DEADLINE_S = 1e9  # a client's time left beyond this is grpc's way of saying it set none


def client_time_left(context: grpc.ServicerContext) -> float | None:
    """The client's deadline left, in seconds; None when it set none (grpc then reports about 9.2e18 s,
    which is finite: taken as a deadline, it reached the decision log as the call's ``dl``)."""
    remaining = context.time_remaining()
    return remaining if remaining is not None and remaining < _NO_DEADLINE_S else None


def next_path_cost(estimate_s: float, sample_s: float, routing_s: float) -> float:
    """The sidecar's own-path estimate after one routed call's ``sample_s``: a running mean, each
    sample counted at most as the call's routing time. The estimate is taken off the next calls'
    budgets: a path longer than a whole budget was a stall of the process, not the path, and counted
    whole it would leave the next calls little of theirs."""
    return PATH_COST_DECAY * estimate_s + (1 - PATH_COST_DECAY) * min(max(0.0, sample_s), routing_s)


def allowed_at_receipt(routing_s: float, remaining_s: float | None) -> float:
    """A call's ``CallTiming.allowed_s``: its routing time, or the client's time left at receipt if
    less (a client already gone at receipt left nothing either: 0, not less)."""
    return routing_s if remaining_s is None else max(0.0, min(routing_s, remaining_s))


def crowded(waited_s: float, remaining_s: float | None, share: float) -> bool:
    """Whether a call that waited ``waited_s`` for a handler thread and then had ``remaining_s`` of its
    client's deadline left spent more than ``share`` of that deadline waiting (no deadline: never).
    A handed-off call that did counts as late for the in-flight limit (``serve.crowded_wait_share``):
    when calls queue that long for the CPU, the routed ones, each costing the CPU of many sheds, are
    what the queued calls are waiting behind."""
    if remaining_s is None or not math.isfinite(remaining_s):
        return False
    return waited_s > share * (waited_s + remaining_s)


class _ThreadWait(threading.local):
    """How long the call a handler thread runs waited for the thread (set by ``_TimedPool``)."""

    waited_s = 0.0


class _TimedPool(ThreadPoolExecutor):
    """grpc's handler threads, noting for each call how long it waited for one (``_ThreadWait``): the
    wait is queueing inside this process — the calls ahead of it were taking the CPU."""

    def __init__(self, wait: _ThreadWait, *, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._wait = wait
        self._count_lock = threading.Lock()
        self.waiting = 0  # calls submitted and not yet taken by a thread

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> concurrent.futures.Future[_T]:
        with self._count_lock:
            self.waiting += 1
        return super().submit(self._timed, time.monotonic(), partial(fn, *args, **kwargs))

    def _timed(self, submitted: float, call: Callable[[], _T]) -> _T:
        self._wait.waited_s = time.monotonic() - submitted
        with self._count_lock:
            self.waiting -= 1
        return call()


class _Counters:
    """Outcome counts and the calls in flight, written by grpc handler threads (hence the lock); the
    calls handed to the router are the gate's."""

    def __init__(self, gate: HandOffGate) -> None:
        self._lock = threading.Lock()
        self._gate = gate
        self._in_flight = 0
        # Calls whose RPC has not ended: grpc sends a reply after its handler returns, and stopping the
        # server before then would cancel a decision made (the client told UNAVAILABLE).
        self._unsent = 0
        self.idle = threading.Event()  # set while no Route call's RPC is open (a drain waits for it)
        self.idle.set()
        self._shed = 0
        self._unrecorded = 0
        self._ended = dict.fromkeys(
            ("answered", "invalid", "unavailable", "timed_out", "failed", "client_gone", "expired_at_receipt"), 0
        )
        self._past_drain_deadline = False
        self._cut = 0

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1
            self._unsent += 1
            self.idle.clear()

    def shed(self, *, recorded: bool) -> None:
        with self._lock:
            self._shed += 1
            if not recorded:
                self._unrecorded += 1

    def leave(self, outcome: str) -> None:
        """The handler returned (its reply not yet sent)."""
        with self._lock:
            self._in_flight -= 1
            if outcome == "unavailable" and self._past_drain_deadline:
                self._cut += 1  # its routing stopped with the sidecar: cut, not refused
            else:
                self._ended[outcome] += 1

    def drain_deadline_passed(self) -> int:
        """The drain's grace is over: the calls in flight now are cut. Their count."""
        with self._lock:
            self._past_drain_deadline = True
            return self._in_flight

    def ended(self) -> None:
        """The call's RPC ended: its reply was sent, or it was cancelled."""
        with self._lock:
            self._unsent -= 1
            if not self._unsent:
                self.idle.set()

    def snapshot(self) -> SidecarStats:
        waited, shed_after_wait = self._gate.waits()
        with self._lock:
            return SidecarStats(
                in_flight=self._in_flight,
                shed_at_receipt=self._shed,
                waited_for_place=waited,
                shed_after_wait=shed_after_wait,
                sheds_unrecorded=self._unrecorded,
                cut_at_drain_deadline=self._cut,
                **self._ended,
            )


class _CallHops(HeldPlace):
    """When the trio thread took a handed-off call and settled its answer (``time.monotonic()``);
    written there before the answer's future is settled, read by the handler thread after. Its place
    in the gate is held as for any handed call (``HeldPlace``): a place freed at the handler's timeout
    would let a storm of timing-out calls hand over call after call to a stalled thread."""

    __slots__ = ("_release", "arrived_at", "settled_at")

    def __init__(self, release: Callable[..., None]) -> None:
        super().__init__()
        self._release = release  # HandOffGate.answered with the call's own arguments bound
        self.arrived_at: float | None = None
        self.settled_at: float | None = None

    def _release_unanswered(self, gave_up_at: float) -> None:
        self._release(answered=False, at=gave_up_at)

    def settle(self, answer: concurrent.futures.Future[RouteDecision], result: Outcome[RouteDecision]) -> None:
        """From the trio thread, once: settle ``answer``, noting when (the reply's way back starts here)."""
        self.settled_at = time.monotonic()
        self.router_done()
        settle(answer, result)


class _Stopped(Exception):
    """The sidecar stopped before the call could be routed."""


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class _RouterHealth:
    """The standard health service (Check, List, Watch): "" and the Router both answer the readiness
    last published.

    Our own, not grpc_health's reference servicer, which kept state for good for every service name a
    client watched (any string, up to the request size) and went on sending every publication to a
    Watch stream that ended before its close callback was added. Here a name not served is answered
    SERVICE_UNKNOWN with nothing kept, and only open streams of the served names are held."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready  # called on grpc threads: reads, never waits
        self._serving_lock = threading.Lock()  # a publication: what ``ready`` says and its sending, together
        self._lock = threading.Lock()  # the open streams; never held across a send
        self._serving: bool | None = None
        self._status: int = _NOT_SERVING
        self._streams: set[Callable[[Any], None]] = set()
        self._shutting_down = False

    def set_serving(self, serving: bool) -> None:
        """Tell Check and every Watch stream, when it changed."""
        with self._serving_lock:
            self._set(serving)

    def refresh(self) -> None:
        """Set what ``ready`` says now, read under the lock: a value read before a publication and set
        after it would undo it until the next one."""
        with self._serving_lock:
            self._set(self._ready())

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for good (a drain): later publications are ignored."""
        with self._serving_lock:
            self._set(False)
            self._shutting_down = True

    def _set(self, serving: bool) -> None:  # holding the serving lock
        if self._shutting_down or serving == self._serving:
            return
        self._serving = serving
        status = self._status = _SERVING if serving else _NOT_SERVING
        with self._lock:
            streams = tuple(self._streams)
        reply = health_pb2.HealthCheckResponse(status=status)
        for send in streams:
            send(reply)

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.service not in _HEALTH_SERVICES:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        self.refresh()
        return health_pb2.HealthCheckResponse(status=self._status)

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.refresh()
        return health_pb2.HealthListResponse(
            statuses={service: health_pb2.HealthCheckResponse(status=self._status) for service in _HEALTH_SERVICES}
        )

    def Watch(self, request: Any, context: grpc.ServicerContext, send: Callable[[Any], None]) -> None:
        """Non-blocking (grpc passes ``send``; ``send(None)`` ends the stream). A stream stays open until
        its client ends it or the server stops: a drain's stop cancels what is left."""
        if request.service not in _HEALTH_SERVICES:  # never known here: nothing kept by its name
            send(health_pb2.HealthCheckResponse(status=_SERVICE_UNKNOWN))
            return

        def closed() -> None:
            with self._lock:
                self._streams.discard(send)

        with self._serving_lock:
            # As a publication holds it: the stream is sent the status and registered with no
            # publication between. Never ``_lock`` across a send: grpc's one event thread, which
            # completes every send, also runs an ended stream's ``closed``, which takes ``_lock`` (a
            # Watch answered while another stream ended had held all of grpc).
            send(health_pb2.HealthCheckResponse(status=self._status))
            with self._lock:
                self._streams.add(send)
        if not context.add_callback(closed):  # the stream ended already: its callback never runs
            closed()

    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]


class Sidecar:
    """Serves ``handle`` over gRPC; see the module docstring. ``run`` is the actor's one entry point."""

    def __init__(
        self, handle: RouterHandle, config: KvrouteConfig, *, reuse_port: bool = False, keep_call_timings: bool = False
    ) -> None:
        """``reuse_port``: bind the gRPC port with SO_REUSEPORT, sharing it with the other router processes
        of ``kvroute serve --processes N`` (the kernel spreads new connections over them). Off, a port
        another process holds is an error instead of a silent share. ``keep_call_timings``: keep each
        answered call's :class:`CallTiming` for :meth:`take_call_timings` (what the bench measures;
        ``kvroute serve`` keeps none)."""
        self._handle = handle
        self._reuse_port = reuse_port
        self._router = handle.router_actor()
        self._serve = config.serve
        # A configuration built in code was never validated: mTLS asked without a certificate served
        # plaintext, to any client.
        refuse("grpc_tls", section_problems("grpc_tls", config.grpc_tls))
        self._tls = config.grpc_tls
        self._listen = parse_listen(config.serve.grpc_listen)  # a bad address fails here, naming it
        self._cap_ms = config.router.budget_cap_ms
        self._reply_margin_ms = config.router.reply_margin_ms
        self._limits = config.limits
        self._block_size = config.deployment.block_size
        # The ids a call may carry and be shed: those the router takes (a message's are 64-bit integers
        # already, so only a narrower range, sglang's when a source hashes them, is checked).
        self._shed_ids = self._router.accepted_token_ids()
        self._large_requests = threading.Semaphore(1)
        self._path_cost_s = 0.0  # running estimate of the sidecar's own path per call
        # A request carrying more than a hash slice's worth of ids (8 bytes each at most) is large.
        self._large_request_bytes = 8 * config.limits.hash_slice_tokens
        self._gate = HandOffGate(
            InFlightLimit(
                initial=min(INITIAL_IN_FLIGHT_LIMIT, config.router.max_in_flight),
                ceiling=config.router.max_in_flight,
                floor=config.router.admission_duty_floor,
            ),
            # Waiting calls hold handler threads: leave at least one for the others.
            waiters=min(config.serve.slot_waiters, config.serve.grpc_max_workers - 1),
        )
        self._counters = _Counters(self._gate)
        # Appended by handler threads, taken by whoever measures; a deque's append and popleft are atomic.
        self._timings: deque[_TimingRow] | None = deque(maxlen=CALL_TIMING_SAMPLES) if keep_call_timings else None
        # Each reply's way back (the decision settled on the trio thread to its bytes on the handler
        # thread): appended by handler threads, handed to the metrics sink by the trio thread.
        self._reply_times: deque[float] = deque(maxlen=REPLY_SAMPLES)
        # The router's readiness, published by the trio thread (run(), drain(), _publish_readiness) and
        # read by health Checks on handler threads, which never wait for that thread: a stalled loop
        # must not pin a handler thread per probe.
        # The readiness last published and when (time.monotonic()), one value: read on other threads,
        # two fields could be seen torn (an old value with a fresh time).
        self._published: tuple[bool, float] = (False, -math.inf)
        self._health = _RouterHealth(self._published_ready)
        self._health_publisher: concurrent.futures.ThreadPoolExecutor | None = None  # while run() serves
        self._thread_wait = _ThreadWait()  # per handler thread: its call's wait for the thread
        self._pool: _TimedPool | None = None  # set in run(); read by handler threads
        self._shed_rng = random.Random()  # handler threads draw from it (each draw is atomic under the GIL)
        # Sheds waiting to be recorded on the trio thread: added by handler threads, recorded there.
        self._sheds: ShedRecords[router_v1_pb2.RouteRequest] = ShedRecords(converted, _request_id)
        # On /metrics too, not only in the summary at the stop: the calls refused before the router
        # (INVALID_ARGUMENT on the message alone), timed out or cut never reach its decision counts.
        metrics = handle.metrics
        for outcome, count in _SCRAPED_OUTCOMES.items():
            metrics.register_gauge_source("kvroute_sidecar_calls", partial(self._count, count), outcome=outcome)
        metrics.register_gauge_source("kvroute_sidecar_calls_in_flight", lambda: self.stats().in_flight)
        # The published answers last shed from and their shed_reply_body()s (replaced as a whole).
        self._shed_replies: tuple[tuple[RouteDecision, ...], tuple[bytes, ...]] = ((), ())
        # Set once in run() before serving; read by handler threads.
        self._token: trio.lowlevel.TrioToken | None = None
        # Owned by the trio thread (run() and the callbacks it runs).
        self._calls: trio.Nursery | None = None
        self._draining = False
        self._ready_told: bool | None = None  # the readiness last logged (trio thread)
        self._drain_requested = trio.Event()
        self.bound: HostPort | None = None

    def stats(self) -> SidecarStats:
        return self._counters.snapshot()

    def _count(self, count: Callable[[SidecarStats], int]) -> int:
        return count(self.stats())

    def wait_idle(self, timeout_s: float) -> bool:
        """Block (any thread but the trio one) until no Route call's RPC is open, at most ``timeout_s``;
        whether none is. A measurement's calls that its clients gave up on may still be queued for a
        handler thread when the clients return."""
        return self._counters.idle.wait(timeout_s)

    def take_call_timings(self) -> list[CallTiming]:
        """The timings of the calls a reply was made for since the last take (answered, or their client
        gone by then: ``client_gone``), and of those handed to the router that got none
        (``CallTiming.answered`` false); at most CALL_TIMING_SAMPLES, the latest; none unless the
        sidecar was made with ``keep_call_timings``."""
        taken: list[CallTiming] = []
        timings = self._timings
        if timings is None:
            return taken
        while True:
            try:
                taken.append(_call_timing(timings.popleft()))
            except IndexError:
                return taken

    def path_cost_ms(self) -> float:
        """The running estimate of this sidecar's own path per call (taken off each client deadline)."""
        return self._path_cost_s * 1000.0

    def drain(self) -> None:
        """Stop accepting calls and finish those in flight (within --drain-timeout-s); run() then returns.

        Call from the trio thread.
        """
        self._draining = True
        self._published = (False, self._published[1])
        # /readyz too: a load balancer probing over HTTP stops sending as one probing gRPC health does.
        self._handle.mark_draining("draining: new calls are refused")
        self._drain_requested.set()

    async def run(self, *, task_status: trio.TaskStatus[HostPort] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        credentials = None
        if self._tls.cert:  # reading the PEM files is I/O: off the trio thread
            credentials = await trio.to_thread.run_sync(server_credentials, self._tls)
        workers = self._serve.grpc_max_workers
        executor = self._pool = _TimedPool(self._thread_wait, max_workers=workers, thread_name_prefix="kvroute-sidecar")
        server = grpc.server(
            executor,
            handlers=[method_handlers({ROUTER_ROUTE: self._route_rpc})],
            # Calls beyond the threads wait for one: a shed answer costs a thread a fraction of a
            # millisecond, so a queue of them drains well within a client's deadline, where a refusal
            # beyond the threads would leave the caller with no answer at all.
            maximum_concurrent_rpcs=self._serve.grpc_max_concurrent_rpcs,
            options=[
                ("grpc.so_reuseport", int(self._reuse_port)),
                ("grpc.max_receive_message_length", max_request_bytes(self._limits)),
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            address = format_target(self._listen.host, self._listen.port)
            # Off the trio thread, where the router's actors already run: grpc resolves a host name
            # to bind with a blocking lookup.
            if credentials is None:
                port = await trio.to_thread.run_sync(server.add_insecure_port, address)
            else:
                port = await trio.to_thread.run_sync(server.add_secure_port, address, credentials)
        except RuntimeError as exc:
            executor.shutdown(wait=False)
            # grpc says the same for an address it cannot bind and for credentials it cannot load.
            tls = "" if credentials is None else " (or grpc could not use --grpc-tls-cert / --grpc-tls-key)"
            raise OSError(f"--grpc-listen: cannot bind {self._serve.grpc_listen}{tls}: {exc}") from exc
        # grpc's health set sends to every Watch stream in turn and waits for each send: tens of
        # streams hold a caller for milliseconds, which the routing thread must not pay. One thread
        # keeps the publications in order.
        self._health_publisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvroute-health")
        stop_watching = threading.Event()
        watchdog = threading.Thread(
            target=self._watch_publications, args=(stop_watching,), name="kvroute-health-watchdog", daemon=True
        )
        watchdog.start()
        try:
            async with trio.open_nursery() as calls:
                self._calls = calls
                self._sheds.open(self._router, calls)
                self._publish(self._ready_now())
                publishing = trio.CancelScope()
                calls.start_soon(self._publish_readiness, publishing)
                server.start()
                self.bound = HostPort(self._listen.host, port)
                log.info(
                    "Route gRPC service listening on %s (%s)",
                    self.bound,
                    "plaintext" if credentials is None else "mTLS" if self._tls.client_ca else "TLS",
                    extra=ctx(target=str(self.bound)),
                )
                task_status.started(self.bound)
                await self._drain_requested.wait()
                publishing.cancel()  # drain() published not ready, for good
                await self._drain_server(server)
                # The grace is over and grpc has ended every call still open: routing work left (a call
                # cut at the drain deadline, or one whose caller gave up) has nobody to answer, and
                # waiting for its own deadline would hold the stop past the grace.
                calls.cancel_scope.cancel()
        finally:
            self._calls = None
            self._sheds.close()
            self._published = (False, self._published[1])
            server.stop(grace=None)  # after a drain: nothing left; when cancelled: ends every call now
            executor.shutdown(wait=False)
            self._health_publisher.shutdown(wait=False, cancel_futures=True)
            stop_watching.set()
            watchdog.join(READY_PUBLISH_S)  # it wakes at once; at most one publication in progress

    def _watch_publications(self, stop: threading.Event) -> None:
        """A thread of its own: a stuck routing thread publishes nothing, so Watch streams (a load
        balancer's health checking uses them, not Check) kept its last SERVING for the whole stall; a
        publication gone stale tells them NOT_SERVING, and the next one restores it."""
        while not stop.wait(READY_PUBLISH_S):
            self._health.refresh()

    async def _drain_server(self, server: grpc.Server) -> None:
        # On the publisher's thread, after what it has queued: it sends to every Watch stream, and a
        # send waits for grpc (Checks meanwhile read the not-ready drain() published).
        publisher = self._health_publisher
        if publisher is None:
            self._health.enter_graceful_shutdown()
        else:
            publisher.submit(self._health.enter_graceful_shutdown)
        grace = self._serve.drain_timeout_s
        lame_duck = min(self._serve.drain_lame_duck_s, grace)
        before = self.stats()
        log.info(
            "draining: %d Route call(s) in flight; refusing new calls for %g s, then stopping within %g s",
            before.in_flight,
            lame_duck,
            grace,
            extra=ctx(reason="drain"),
        )
        # Lame duck: the server still matches every call that reached it and handlers refuse new ones
        # (UNAVAILABLE, not routed). Stopping grpc at once would cancel calls it had accepted but not yet
        # handed to a handler thread: those clients would not know whether they were routed.
        await trio.sleep(lame_duck)
        stopped = server.stop(grace=grace - lame_duck)  # cancels what is left after the grace
        # Once no Route call is left the rest is cancelled at once: a health Watch stream never ends
        # by itself, and would hold every drain to its whole grace.
        idle = self._counters.idle
        # A thread of its own: trio's default ones may all be held (hung name lookups share them), and
        # a drain must end within its grace.
        waits = trio.CapacityLimiter(1)
        await trio.to_thread.run_sync(partial(idle.wait, grace - lame_duck), abandon_on_cancel=True, limiter=waits)
        if idle.is_set() and not stopped.is_set():
            await trio.to_thread.run_sync(partial(server.stop, None), abandon_on_cancel=True, limiter=waits)
        # grpc sets the event when the last call has ended or the grace has passed.
        await trio.to_thread.run_sync(stopped.wait, abandon_on_cancel=True, limiter=waits)
        cut = self._counters.drain_deadline_passed()
        after = self.stats()
        log.info(
            "drained: %d answered and %d refused while draining, %d still in flight at the drain deadline",
            after.answered - before.answered,
            after.unavailable - before.unavailable,
            cut,
            extra=ctx(reason="drain"),
        )

    # --- grpc handler threads ------------------------------------------------------------------------

    def _route_rpc(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        received = time.monotonic()
        remaining = client_time_left(context)
        self._counters.enter()
        if not context.add_callback(self._counters.ended):  # the RPC has ended already
            self._counters.ended()
        if remaining is not None and remaining <= 0.0:
            # It waited out its client's deadline in gRPC's queues: the client has given up and gRPC
            # ends the call whatever the handler returns. Reading, shedding and recording it would
            # spend the CPU the calls queued behind it need to be answered in time.
            self._counters.leave("expired_at_receipt")
            raise PeerAbort(
                RpcStatus.DEADLINE_EXCEEDED, "the client's deadline passed before a handler thread took the call"
            )
        outcome = "answered"
        try:
            reply, allowed_s, stage_ms, hops, source = self._route_call(data, context, received, remaining)
            # A client that cancelled, or whose deadline passed, receives no reply: not "answered" (its
            # timing is kept, though: a reply made too late is what the timings are to show).
            if not context.is_active():
                outcome = "client_gone"
            timings = self._timings
            if timings is None:
                return reply
            allowed_s = allowed_at_receipt(allowed_s, remaining)
            query_ms = stage_ms.get(Stage.CACHE_QUERY)
            scoring_ms = [stage_ms[stage] for stage in _SCORING_STAGES if stage in stage_ms]
            done = time.monotonic()
            timings.append(
                _timing_row(
                    CallTiming(
                        elapsed_s=done - received,
                        allowed_s=allowed_s,
                        router_s=stage_ms.get(Stage.TOTAL, 0.0) / 1000.0,
                        query_s=None if query_ms is None else query_ms / 1000.0,
                        handed_s=None if hops is None or hops.arrived_at is None else hops.arrived_at - received,
                        way_back_s=None if hops is None or hops.settled_at is None else done - hops.settled_at,
                        scoring_s=sum(scoring_ms) / 1000.0 if scoring_ms else None,
                        client_left_s=remaining,
                        route_source=source,
                    )
                )
            )
            return reply
        except PeerAbort as abort:
            outcome = _OUTCOME_BY_STATUS.get(abort.status, "failed")
            raise
        finally:
            self._counters.leave(outcome)

    def _route_call(
        self, data: bytes, context: grpc.ServicerContext, received: float, left_at_receipt: float | None
    ) -> tuple[bytes, float, Mapping[Stage, float], _CallHops | None, RouteSource | None]:
        """The serialised decision, the time it had left at receipt in seconds (its routing deadline,
        min(budget, cap), less its wait for the handler thread, at least 0), the decision's stage times
        and, for a call handed to the router, its hops and its answer's source."""
        if self._draining:  # written by the trio thread; a call racing the flip is routed normally
            raise PeerAbort(RpcStatus.UNAVAILABLE, "kvroute is draining: request not routed")
        message = router_v1_pb2.RouteRequest()
        try:
            with self._reading_turn(len(data), context):
                message.ParseFromString(data)
                tokens = check_proto_bounds(message, self._limits, self._block_size)
                # A request naming roles always goes to the router: converted now, a bad role is
                # refused before the call counts as handed over. Others are converted once admitted.
                named_roles = converted(message) if message.roles else None
        except DecodeError as exc:
            # protobuf's error names no field for a string that is not UTF-8: the walk finds which.
            bad = first_bad_utf8(data, _STRING_FIELDS, max_fields=UTF8_WALK_MAX_FIELDS)
            if bad is not None:
                raise PeerAbort(RpcStatus.INVALID_ARGUMENT, str(BadRequest(bad.field, str(bad)))) from None
            raise PeerAbort(RpcStatus.INVALID_ARGUMENT, f"request: not a kvroute.v1.RouteRequest ({exc})") from None
        except BadRequest as exc:
            raise PeerAbort(RpcStatus.INVALID_ARGUMENT, str(exc)) from None
        remaining = client_time_left(context)
        sent_at = time.monotonic()
        # What this sidecar's own path (hand-off to the trio thread, the answer's way back, serialising
        # and sending it) has been costing: decided that much earlier, the answer leaves in time.
        path_cost_s = self._path_cost_s
        # The client's deadline less that path. The router keeps --reply-margin-ms on top.
        client_s = None if remaining is None else max(0.0, remaining - path_cost_s)
        # The call's routing time (min(budget, cap)), counted from receipt as the router counts it,
        # less the call's wait for this handler thread: queued in this process, it was the sidecar's
        # time (a call behind a held thread had its whole budget again once it got one).
        routing_s = max(0.0, budget_deadline(budget_ms(message), 0.0, self._cap_ms) - self._thread_wait.waited_s)
        # The router's deadline from receipt: the routing time less the sidecar's own path, so that
        # the reply, not only the decision, is made within it.
        decide_s = max(0.0, routing_s - path_cost_s)
        # What the router will have, from now: its deadline less what reading the call took (a large
        # request's wait for its reading turn is spent), or the client's less the reply margin.
        routing_left_s = max(0.0, decide_s - (sent_at - received))
        left_s = (
            routing_left_s if client_s is None else min(routing_left_s, client_s - self._reply_margin_ms / 1000.0)
        )
        if named_roles is not None:
            request = named_roles
            self._gate.hand_off_anyway()
        else:
            shed = self._shed_at_receipt(message, left_s, received, context, tokens)
            if shed is not None:
                reply, elapsed_ms = shed
                return reply, routing_s, {Stage.TOTAL: elapsed_ms}, None, None
            request = converted(message)  # no roles: nothing left to refuse
        # A call may have waited for its place: the client's deadline above counts that wait (from
        # sent_at); the in-flight limit and the own-path estimate count from the hand-off.
        handed_at = time.monotonic()
        # The routing deadline and a slack from now: a stalled trio thread's late answer still reaches a
        # client that waits. Never past the client's deadline, though, the time the call already spent
        # (a wait for its place) off it: nobody waits for the answer then.
        wait_s = routing_s + ANSWER_SLACK_S
        if remaining is not None:
            wait_s = min(wait_s, max(0.0, remaining - (handed_at - sent_at)))
        answer: concurrent.futures.Future[RouteDecision] = concurrent.futures.Future()
        had_s = left_s - (handed_at - sent_at)  # none to spare: the gate learns nothing from the call
        if had_s > 0.0:
            # The gate times the call to its release, the sidecar's own way back included: the router's
            # time and that path's allowance.
            had_s += path_cost_s
        release = partial(
            self._gate.answered,
            handed_at=handed_at,
            had_s=had_s,
            crowded=crowded(self._thread_wait.waited_s, remaining, self._serve.crowded_wait_share),
        )
        hops = _CallHops(release)  # settled by the trio thread
        token = self._token
        decided = gave_up = False
        try:
            if token is None:
                raise _Stopped
            token.run_sync_soon(self._spawn, request, client_s, (received, decide_s), sent_at, answer, hops)
            decision = answer_within(answer, wait_s)
            decided = True
        except (trio.RunFinishedError, _Stopped, RouterClosed):
            raise PeerAbort(RpcStatus.UNAVAILABLE, "kvroute is shutting down: request not routed") from None
        except concurrent.futures.TimeoutError:
            gave_up = True
            hops.give_up()
            raise PeerAbort(RpcStatus.DEADLINE_EXCEEDED, f"no decision within {wait_s * 1000:.1f} ms") from None
        except Exception as exc:
            raise PeerAbort(RpcStatus.INTERNAL, f"router error: {exc!r}") from exc
        finally:
            if not gave_up:
                release(answered=decided)
            if not decided:
                self._keep_unanswered(received, routing_s, left_at_receipt, hops)
        reply = self._reply(decision, context)
        done = time.monotonic()
        if hops.settled_at is not None:  # the future's settling orders the trio thread's write before this read
            self._reply_times.append(done - hops.settled_at)
        self._observe_path_cost(done - handed_at - decision.elapsed_ms / 1000.0, routing_s)
        return reply, routing_s, decision.stage_ms, hops, decision.route_source

    def _keep_unanswered(self, received: float, routing_s: float, remaining: float | None, hops: _CallHops) -> None:
        """A handed call that got no decision: its timing, if timings are kept (``CallTiming.answered``).
        ``remaining``: the client's time left at receipt."""
        timings = self._timings
        if timings is None:
            return
        timings.append(
            _timing_row(
                CallTiming(
                    elapsed_s=time.monotonic() - received,
                    allowed_s=allowed_at_receipt(routing_s, remaining),
                    handed_s=None if hops.arrived_at is None else hops.arrived_at - received,
                    client_left_s=remaining,
                    answered=False,
                )
            )
        )

    def _reply(self, decision: RouteDecision, context: grpc.ServicerContext) -> bytes:
        if decision.reason is Reason.BAD_REQUEST:
            raise PeerAbort(RpcStatus.INVALID_ARGUMENT, decision.error or "bad request")
        _carry_error(decision, context)
        return decision_to_proto(decision).SerializeToString()

    def _shed_at_receipt(
        self,
        message: router_v1_pb2.RouteRequest,
        left_s: float,
        received: float,
        context: grpc.ServicerContext,
        tokens: int,
    ) -> tuple[bytes, float] | None:
        """The reply (and its elapsed ms) of the router's ``overloaded`` answer when this call (naming
        no roles) cannot be served in time, decided here on the handler thread from what the router
        published; None: the call was counted as handed to the router (the caller must hand it off
        and report its answer)."""
        published = self._router.overload_answers()
        if published is None or not published.answers:
            self._gate.hand_off_anyway()
            return None
        estimate = published.estimate
        # While as many calls wait for a handler thread as there are threads, none is handed to the
        # router: a routed call holds its thread for its whole routing time and costs the CPU of many
        # sheds, and the calls waiting behind it are nearer their deadlines with every one. A call with
        # no time left is answered here whatever the estimate: an idle loop's lag can be 0, which
        # no time left would cover.
        if (
            left_s > 0.0
            and self._pool_backlog() < self._serve.grpc_max_workers
            and admits(estimate, left_s, in_flight=self._gate.in_router())
            and self._gate.hand_off(slot_wait_s(estimate, left_s))
        ):
            return None
        if self._shed_ids is not INT64 and not self._shed_ids.holds_all(message.token_ids):
            # An id the family does not hash (sglang: past a uint32) is the router's to refuse: under
            # overload it got a worker where at normal load it is refused.
            self._gate.hand_off_anyway()
            return None
        return self._shed(message, published, left_s, received, context, tokens)

    def _shed(
        self,
        message: router_v1_pb2.RouteRequest,
        published: OverloadAnswers,
        left_s: float,
        received: float,
        context: grpc.ServicerContext,
        tokens: int,
    ) -> tuple[bytes, float]:
        # A shed is the cheapest answer only if it stays cheap: the reply is the drawn answer's
        # bytes serialised once per draw, and the decision to record is built on the trio thread.
        answers, bodies = self._shed_replies
        if answers is not published.answers:  # a new draw: the first thread to see it serialises it
            answers = published.answers
            bodies = tuple(shed_reply_body(a) for a in answers)
            self._shed_replies = (answers, bodies)
        drawn_at = self._shed_rng.randrange(len(answers))
        drawn = answers[drawn_at]
        _carry_error(drawn, context)
        elapsed_ms = (time.monotonic() - received) * 1000.0
        reply = shed_reply(bodies[drawn_at], message.request_id, elapsed_ms)
        # Beyond SHED_RECORDS_MAX waiting the shed is answered and counted, not recorded.
        self._counters.shed(recorded=self._sheds.add(message, drawn, elapsed_ms, left_s, tokens))
        return reply, elapsed_ms

    @contextlib.contextmanager
    def _reading_turn(self, size: int, context: grpc.ServicerContext) -> Iterator[None]:
        """Parsing and converting a large request holds the GIL for milliseconds: one handler thread
        at a time does it, so the routing thread keeps its share of the GIL however many large
        requests arrive. The others wait (without the GIL) within their deadline. A small request
        reads at once."""
        if size <= self._large_request_bytes:
            yield
            return
        # At most the client's deadline, and never longer than any call's routing deadline can be (the
        # cap): a client without a deadline has about 9e18 s left, which the wait cannot take.
        remaining = client_time_left(context)
        wait_s = self._cap_ms / 1000.0 + ANSWER_SLACK_S
        if remaining is not None:
            wait_s = min(wait_s, remaining)
        if not self._large_requests.acquire(timeout=max(0.0, wait_s)):
            raise PeerAbort(RpcStatus.DEADLINE_EXCEEDED, "a large request waited its whole deadline to be read")
        try:
            yield
        finally:
            self._large_requests.release()

    def _observe_path_cost(self, seconds: float, routing_s: float) -> None:
        """Fold one call's own-path cost into the running estimate (handler threads write it; a float
        assignment is atomic, and a lost update only delays the estimate by a call)."""
        self._path_cost_s = next_path_cost(self._path_cost_s, seconds, routing_s)

    def _pool_backlog(self) -> int:
        pool = self._pool
        return 0 if pool is None else pool.waiting

    # --- the trio thread -------------------------------------------------------------------------------

    def _ready_now(self) -> bool:
        if self._draining:  # the drain says so itself
            return False
        ready, why = self._handle.ready()
        if ready is not self._ready_told:
            # Said as it changes (and first): a whole outage showed only as requests answered from the
            # domain, and readiness on the endpoints no one was reading.
            self._ready_told = ready
            if ready:
                log.info("ready: %s", redact_userinfo(why))
            else:
                log.warning("not ready: %s", redact_userinfo(why))
        return ready

    async def _publish_readiness(self, scope: trio.CancelScope) -> None:
        # Readiness follows several actors' state and the clock (a worker's ejection ends), with no
        # one event to wait for: republished at a fixed cadence, until the drain publishes it for good.
        with scope:
            while True:
                await trio.sleep(READY_PUBLISH_S)
                self._publish(self._ready_now())

    def _publish(self, ready: bool) -> None:
        self._published = (ready, time.monotonic())
        # Watch streams (clients' health checking) learn it now, not at the next Check. A stuck
        # routing thread publishes nothing: a Check on a handler thread finds the publication stale.
        publisher = self._health_publisher
        if publisher is not None:
            publisher.submit(self._health.set_serving, ready)

    def _published_ready(self) -> bool:
        """On handler threads: the readiness last published, if the trio thread published it recently.
        A routing thread that has stopped publishing (stuck, or stalled for seconds) is not serving."""
        ready, at = self._published
        return ready and time.monotonic() - at < READY_STALE_S

    def _spawn(
        self,
        request: RouteRequest,
        client_s: float | None,
        routing: tuple[float, float],
        sent_at: float,
        answer: concurrent.futures.Future[RouteDecision],
        hops: _CallHops,
    ) -> None:
        """Runs in the trio thread (run_sync_soon). ``routing``: when the handler thread received the call
        (``time.monotonic()``) and its routing deadline (min(budget, cap)) in seconds from then."""
        calls = self._calls
        if calls is None:
            hops.settle(answer, Error(_Stopped()))
            return
        arrived = hops.arrived_at = time.monotonic()
        deadline = None if client_s is None else caller_deadline(trio.current_time(), client_s, sent_at, arrived)
        self._hand_over_reply_times()
        try:
            calls.start_soon(self._call, request, deadline, routing, answer, hops)
        except RuntimeError:  # the calls' nursery closed as the sidecar stopped at once (run() clears it next)
            hops.settle(answer, Error(_Stopped()))

    def _hand_over_reply_times(self) -> None:
        """Send the replies' way-back times the handler threads measured since the last call to the
        metrics sink (the deadline split's tail), one message for all of them."""
        times = self._reply_times
        if not times:
            return
        taken = []
        while True:
            try:
                taken.append(times.popleft())
            except IndexError:
                break
        self._handle.metrics.emit(RepliesSent(tuple(taken)))

    async def _call(
        self,
        request: RouteRequest,
        deadline: float | None,
        routing: tuple[float, float],
        answer: concurrent.futures.Future[RouteDecision],
        hops: _CallHops,
    ) -> None:
        """``deadline``: the client's, on the trio clock (None: it set none)."""
        # The budget counts from the call's receipt: its time in this sidecar (reading it, the hop to
        # this thread, the wait for this task to start behind the loop's other work) is already spent,
        # so the router gets what is left of it. One copy of the request for both fields.
        received, routing_s = routing
        budget = budget_left_ms(routing_s, received, time.monotonic())
        request = replace(request, budget_ms=budget) if deadline is None else replace(
            request, budget_ms=budget, deadline=deadline
        )
        # Cancelled (the sidecar stopped at once): _Stopped, and the handler answers UNAVAILABLE.
        deliver = partial(hops.settle, answer)
        await deliver_outcome(partial(self._handle.route, request), deliver, _Stopped())


def _carry_error(decision: RouteDecision, context: grpc.ServicerContext) -> None:
    """A decision routing nowhere (``route_source=none``) carries its error in the trailing metadata."""
    if decision.route_source is RouteSource.NONE and decision.error:
        context.set_trailing_metadata(((ERROR_METADATA_KEY, metadata_text(decision.error)),))


def _request_id(message: router_v1_pb2.RouteRequest) -> str:
    return message.request_id


def metadata_text(text: str) -> str:
    """``text`` as a metadata value gRPC accepts: printable ASCII (anything else escaped, as a peer's
    error text may hold newlines or any character) and at most ERROR_METADATA_CHARS characters."""
    escaped = text.encode("unicode_escape").decode("ascii")
    if len(escaped) > ERROR_METADATA_CHARS:
        escaped = escaped[: ERROR_METADATA_CHARS - 1] + "~"
    return escaped


