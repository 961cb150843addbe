"""SimKvcmCluster: KVCM meta-service replicas sharing one prefix index (core: no I/O, time passed in).

Semantics (as the real KVCM behaves): any replica answers GetClusterInfo (OK + the leader's
endpoint, or OK with no leader when none is elected); GetHostCacheState is answered by
the leader, while followers answer SERVER_NOT_LEADER (or answer the query too, when
``followers_answer_queries`` is set — both behaviours exist upstream). With no leader
elected every replica answers queries SERVER_NOT_LEADER unless followers answer.

Thread safety: gRPC server threads and the trio thread use one cluster at once, so
every public method takes the cluster's ``threading.Lock`` (held only for the short,
non-blocking work of one method). Knob changes wake calls hung on a fault.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute_sim.sim.codec import parse_request
from kvroute_sim.sim.faults import (
    ANSWER_NOW,
    UNDECODABLE_REPLY,
    CallPlan,
    CallStats,
    ChangeNotifier,
    Garble,
    SimEndpoint,
    check_garble,
)
from kvroute_sim.sim.index import SimKvcmIndex
from router.transport.errors import PeerAbort, RpcStatus
from router.types import HostMatch, LeaderEndpoint
from router.wire import kvcm_meta_pb2 as kvcm_pb
from router.wire import paths

KVCM_METHODS = frozenset({paths.KVCM_GET_CLUSTER_INFO, paths.KVCM_GET_HOST_CACHE_STATE})
_UNSUPPORTED_QUERY_TYPES = frozenset({kvcm_pb.QT_BATCH_GET, kvcm_pb.QT_REVERSE_ROLL_SW_MATCH})


# Serialised query answers kept while the index's stores do not change: a few prompts' worth (each
# key holds its query, a few KiB).
KEPT_ANSWERS = 64


@dataclass(frozen=True, slots=True)
class KvcmFaults:
    """Fault knobs of one replica; replace the whole value with ``SimKvcmCluster.set_faults``.

    ``dead``: the call ends UNAVAILABLE (a refused or unreachable peer). ``hang``: the call
    is accepted and never answered until the fault clears (then it is answered normally)
    or the caller goes away. ``delay_s``: answered after this long. ``error_code``: a KVCM
    ``ErrorCode`` number (e.g. ``kvcm_meta_pb2.INTERNAL_ERROR``) in the reply header.
    ``garbled``: an undecodable reply, or one that decodes but breaks the contract (a
    leader port of 0; a negative block count). ``no_leader_elected``: this replica's
    GetClusterInfo says OK with no leader. ``methods``: the method paths the faults above
    (except ``no_leader_elected``) apply to; None means every method.
    """

    dead: bool = False
    hang: bool = False
    delay_s: float = 0.0
    error_code: int | None = None
    garbled: Garble | None = None
    no_leader_elected: bool = False
    methods: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"delay_s: must be finite and >= 0, got {self.delay_s}")
        check_garble(self.garbled)
        if self.error_code is not None and (
            self.error_code == kvcm_pb.OK or self.error_code not in kvcm_pb.ErrorCode.values()
        ):
            raise ValueError(f"error_code: {self.error_code} is not a KVCM error code other than OK")
        if self.methods is not None and not self.methods <= KVCM_METHODS:
            raise ValueError(f"methods: {sorted(self.methods - KVCM_METHODS)} are not KVCM method paths")

    def applies_to(self, method_path: str) -> bool:
        return self.methods is None or method_path in self.methods


NO_FAULTS = KvcmFaults()


class _Replica:
    __slots__ = ("faults", "host", "node_id", "port", "stats")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.host: str | None = None
        self.port: int | None = None
        self.faults = NO_FAULTS
        self.stats = CallStats(KVCM_METHODS)


class SimKvcmCluster:
    """N replicas, one shared index, one (movable) leader."""

    def __init__(
        self,
        node_ids: Sequence[str],
        *,
        leader: str | None = None,
        followers_answer_queries: bool = False,
        instance_id: str = "",
        index: SimKvcmIndex | None = None,
    ) -> None:
        """``leader`` defaults to the first node; ``instance_id`` "" accepts any instance id."""
        if not node_ids:
            raise ValueError("node_ids: at least one replica is required")
        if len(set(node_ids)) != len(node_ids) or not all(n.strip() for n in node_ids):
            raise ValueError(f"node_ids: must be distinct and non-blank, got {list(node_ids)}")
        self._lock = threading.Lock()
        self._changes = ChangeNotifier()
        self._replicas = {node_id: _Replica(node_id) for node_id in node_ids}
        self._leader: str | None = node_ids[0] if leader is None else self._check_node(leader)
        self._followers_answer_queries = followers_answer_queries
        self._instance_id = instance_id
        self._index = SimKvcmIndex() if index is None else index
        self._answers: dict[bytes, bytes] = {}  # serialised query (no trace id) → serialised hosts
        self._answers_version = self._index.version

    @property
    def kept_answers(self) -> int:
        """Serialised query answers kept for the index's current stores (at most ``KEPT_ANSWERS``)."""
        with self._lock:
            return len(self._answers)

    # ---- topology and knobs (any thread) ----

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(self._replicas)

    def set_endpoint(self, node_id: str, host: str, port: int) -> None:
        """The address ``node_id`` serves on, advertised as ``leader_endpoint`` when it leads."""
        if not 1 <= port <= 65535:
            raise ValueError(f"port: {port} not in 1..65535 for replica {node_id!r}")
        with self._lock:
            replica = self._replicas[self._check_node(node_id)]
            replica.host, replica.port = host, port

    def endpoint(self, node_id: str) -> LeaderEndpoint | None:
        with self._lock:
            return self._endpoint_locked(self._check_node(node_id))

    @property
    def leader(self) -> str | None:
        with self._lock:
            return self._leader

    def set_leader(self, node_id: str | None) -> None:
        """Move leadership to ``node_id``; None means no leader is elected."""
        with self._lock:
            self._leader = None if node_id is None else self._check_node(node_id)
        self._changes.notify()

    def set_followers_answer_queries(self, answer: bool) -> None:
        with self._lock:
            self._followers_answer_queries = answer
        self._changes.notify()

    def faults(self, node_id: str) -> KvcmFaults:
        with self._lock:
            return self._replicas[self._check_node(node_id)].faults

    def set_faults(self, node_id: str, faults: KvcmFaults) -> None:
        """Switch ``node_id``'s fault knobs; calls hung on the old faults re-plan at once."""
        with self._lock:
            self._replicas[self._check_node(node_id)].faults = faults
        self._changes.notify()

    def clear_faults(self) -> None:
        with self._lock:
            for replica in self._replicas.values():
                replica.faults = NO_FAULTS
        self._changes.notify()

    def stats(self, node_id: str) -> CallStats:
        return self._replicas[self._check_node(node_id)].stats

    def replica(self, node_id: str) -> SimEndpoint:
        """The server-side view of one replica (what a memory or gRPC server serves)."""
        return KvcmReplica(self, self._check_node(node_id))

    # ---- the shared index (locked delegates; any thread) ----

    def add_worker(self, host: str, capacity_blocks: int) -> None:
        with self._lock:
            self._index.add_worker(host, capacity_blocks)

    def clear_worker(self, host: str) -> None:
        """Drop every block ``host`` stores (a restarted engine has a cold cache)."""
        with self._lock:
            self._index.clear_worker(host)

    def record_prefill(self, host: str, keys: Sequence[int]) -> int:
        """Store a prompt's keys at ``host`` (a prefill ran there); returns blocks evicted."""
        with self._lock:
            return self._index.record_prefill(host, keys)

    def local_prefix(self, host: str, keys: Sequence[int]) -> int:
        with self._lock:
            return self._index.local_prefix(host, keys)

    def match(self, keys: Sequence[int], p2p_host_count: int = 0) -> tuple[HostMatch, ...]:
        with self._lock:
            return self._index.match(keys, p2p_host_count)

    # ---- serving (called by the servers through KvcmReplica) ----

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        return self._changes.subscribe(wake)

    def plan(self, node_id: str, method_path: str) -> CallPlan:
        with self._lock:
            faults = self._replicas[node_id].faults
        if not faults.applies_to(method_path):
            return ANSWER_NOW
        if faults.dead:
            return CallPlan.dead(f"replica {node_id} is down")
        if faults.hang:
            return CallPlan(hang=True)
        return CallPlan(delay_s=faults.delay_s) if faults.delay_s > 0 else ANSWER_NOW

    def answer(self, node_id: str, method_path: str, request: bytes) -> bytes:
        if method_path == paths.KVCM_GET_CLUSTER_INFO:
            return self._answer_cluster_info(node_id, parse_request(kvcm_pb.GetClusterInfoRequest, request))
        if method_path == paths.KVCM_GET_HOST_CACHE_STATE:
            return self._answer_cache_state(node_id, parse_request(kvcm_pb.GetHostCacheStateRequest, request))
        raise PeerAbort(RpcStatus.UNIMPLEMENTED, f"unknown method {method_path}")

    def _answer_cluster_info(self, node_id: str, request: kvcm_pb.GetClusterInfoRequest) -> bytes:
        reply = kvcm_pb.GetClusterInfoResponse(self_node_id=node_id)
        reply.header.request_id = request.trace_id
        with self._lock:
            faults = self._replicas[node_id].faults
            applies = faults.applies_to(paths.KVCM_GET_CLUSTER_INFO)
            leader = None if faults.no_leader_elected or self._leader is None else self._leader
            endpoint = None if leader is None else self._endpoint_locked(leader)
        if applies and faults.garbled is Garble.UNDECODABLE:
            return UNDECODABLE_REPLY
        if applies and faults.error_code is not None:
            _set_status(reply.header, faults.error_code, f"replica {node_id}: injected error")
            return reply.SerializeToString()
        _set_status(reply.header, kvcm_pb.OK, "")
        if applies and faults.garbled is Garble.CONTRACT:
            # A named leader whose endpoint has port 0: decodes, but breaks the contract.
            reply.leader_node_id = leader or node_id
            reply.leader_endpoint.node_id = reply.leader_node_id
            reply.leader_endpoint.host = endpoint.host if endpoint else "127.0.0.1"
            reply.leader_endpoint.meta_rpc_port = 0
        elif endpoint is not None:
            reply.leader_node_id = endpoint.node_id
            reply.leader_endpoint.node_id = endpoint.node_id
            reply.leader_endpoint.host = endpoint.host
            reply.leader_endpoint.meta_rpc_port = endpoint.port
        return reply.SerializeToString()

    def _answer_cache_state(self, node_id: str, request: kvcm_pb.GetHostCacheStateRequest) -> bytes:
        reply = kvcm_pb.GetHostCacheStateResponse()
        reply.header.request_id = request.trace_id
        with self._lock:
            faults = self._replicas[node_id].faults
            applies = faults.applies_to(paths.KVCM_GET_HOST_CACHE_STATE)
            injected = applies and (faults.garbled is not None or faults.error_code is not None)
            leader = self._leader
            serves = node_id == leader or self._followers_answer_queries
            refusal = self._refusal(request)
            if serves and not injected and refusal is None:
                _set_status(reply.header, kvcm_pb.OK, "")
                return reply.SerializeToString() + self._encoded_hosts_locked(request)
        if applies and faults.garbled is Garble.UNDECODABLE:
            return UNDECODABLE_REPLY
        if applies and faults.error_code is not None:
            _set_status(reply.header, faults.error_code, f"replica {node_id}: injected error")
        elif applies and faults.garbled is Garble.CONTRACT:
            _set_status(reply.header, kvcm_pb.OK, "")
            reply.hosts.add(host_ip_port="127.0.0.1:1", local=-1, p2p_1_fetch=0, p2p_1_total_match=-1)
        elif not serves:
            where = f"leader is {leader}" if leader is not None else "no leader elected"
            _set_status(reply.header, kvcm_pb.SERVER_NOT_LEADER, f"{node_id} is not the leader; {where}")
        else:
            assert refusal is not None  # the one case left: an answer returned above
            _set_status(reply.header, *refusal)
        return reply.SerializeToString()

    def _encoded_hosts_locked(self, request: kvcm_pb.GetHostCacheStateRequest) -> bytes:
        """The reply's ``hosts`` entries, serialised, for ``request`` against the index as it is now.

        Kept per query (its fields but the trace id, serialised) while the index's stores do not
        change (its ``version``): the bench's in-process figures share the router's CPU with this
        answer. Serialised messages concatenate as a merge, so the caller appends
        these bytes to the header's."""
        index = self._index
        if self._answers_version != index.version:
            self._answers.clear()
            self._answers_version = index.version
        request.ClearField("trace_id")  # the caller has copied it into the reply
        asked = request.SerializeToString()
        encoded = self._answers.get(asked)
        if encoded is None:
            hosts = kvcm_pb.GetHostCacheStateResponse()
            for h in index.match(request.block_cache_keys, request.p2p_host_count):
                hosts.hosts.add(
                    host_ip_port=h.host_ip_port,
                    local=h.local,
                    p2p_1_fetch=h.p2p_fetch,
                    p2p_1_total_match=h.p2p_total,
                )
            encoded = hosts.SerializeToString()
            if len(self._answers) >= KEPT_ANSWERS:
                del self._answers[next(iter(self._answers))]  # the oldest kept answer
            self._answers[asked] = encoded
        return encoded

    def _refusal(self, request: kvcm_pb.GetHostCacheStateRequest) -> tuple[int, str] | None:
        """The error code and message for a query this KVCM does not serve, or None."""
        if request.query_type in _UNSUPPORTED_QUERY_TYPES:
            return (
                kvcm_pb.UNSUPPORTED,
                f"query_type {kvcm_pb.QueryType.Name(request.query_type)} is not supported",
            )
        if self._instance_id and request.instance_id != self._instance_id:
            return kvcm_pb.INSTANCE_NOT_EXIST, f"instance_id {request.instance_id!r} does not exist"
        return None

    # ---- internals ----

    def _check_node(self, node_id: str) -> str:
        if node_id not in self._replicas:
            raise ValueError(f"node_id: unknown replica {node_id!r} (replicas: {list(self._replicas)})")
        return node_id

    def _endpoint_locked(self, node_id: str) -> LeaderEndpoint | None:
        replica = self._replicas[node_id]
        if replica.host is None or replica.port is None:
            return None
        return LeaderEndpoint(node_id, replica.host, replica.port)


def _set_status(header: kvcm_pb.CommonResponseHeader, code: int, message: str) -> None:
    header.status.code = code  # type: ignore[assignment]
    header.status.message = message


class KvcmReplica:
    """One replica of a ``SimKvcmCluster`` as a ``SimEndpoint`` (KVCM replies need no clock)."""

    def __init__(self, cluster: SimKvcmCluster, node_id: str) -> None:
        self._cluster = cluster
        self.node_id = node_id

    @property
    def methods(self) -> frozenset[str]:
        return KVCM_METHODS

    @property
    def stats(self) -> CallStats:
        return self._cluster.stats(self.node_id)

    def plan(self, method_path: str, now: float) -> CallPlan:
        return self._cluster.plan(self.node_id, method_path)

    def answer(self, method_path: str, request: bytes, now: float) -> bytes:
        return self._cluster.answer(self.node_id, method_path, request)

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        return self._cluster.subscribe(wake)
