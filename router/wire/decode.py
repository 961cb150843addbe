"""Encode requests and decode replies of the upstream services (pure).

Every decoder turns bytes into our typed values or raises ``GarbledReply`` naming
the field that broke the wire contract, or ``RemoteError``/``NotLeader`` for an
application error code. Both transport adapters use these functions, so the
in-memory and gRPC paths decode identically.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import assert_never, cast

from google.protobuf.message import DecodeError

from router.targets import TargetError, format_target, parse_target
from router.transport.errors import GarbledReply, NotLeader, RemoteError
from router.types import (
    CacheQuery,
    CacheState,
    ClusterInfo,
    EngineGeneration,
    HostMatch,
    KvCacheGroupMode,
    LeaderEndpoint,
    Role,
    TaskInfo,
    WorkerStatus,
)
from router.wire import engine_status_pb2 as engine_pb
from router.wire import kvcm_meta_pb2 as kvcm_pb

_packed_int64: Callable[[int, Sequence[int]], bytes | None] | None
try:
    from router.wire._packed import packed_int64 as _packed_int64
except ImportError:  # built without a C compiler: protobuf encodes the keys (see setup.py)
    _packed_int64 = None

# Whether block keys are encoded by the compiled encoder (``encode_block_keys``); reported by the bench.
COMPILED_KEYS_ENCODER = _packed_int64 is not None
_BLOCK_KEYS_FIELD = kvcm_pb.GetHostCacheStateRequest.DESCRIPTOR.fields_by_name["block_cache_keys"].number

_OK = kvcm_pb.OK
# The hosts one cache answer may name: every worker of a very large fleet holding the prompt's prefix.
# More is garbage, and decoding it would hold the routing thread.
MAX_CACHE_HOSTS = 65_536
# The longest host:port a host entry can be (a 253-character DNS name, ':' and a 5-digit port); a
# longer one is kept cut, which no parse accepts: it is dropped as malformed, and no decision, record or
# log carries a peer's arbitrarily long string.
MAX_HOST_PORT_CHARS = 259
# The tasks one worker status may list: many times any engine's running batch and waiting queue (a
# worker queued that deep is dropped as queue-full long before). More is garbage: every task is an
# object to build, and each new status is summed over its tasks on the routing thread.
MAX_WORKER_TASKS = 16_384
_NOT_LEADER = kvcm_pb.SERVER_NOT_LEADER


def _parse(message_type: type, data: bytes, target: str, what: str) -> object:
    msg = message_type()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise GarbledReply(target, f"{what}: undecodable reply ({exc})") from exc
    return msg


def _check_header(header_holder: object, target: str, what: str) -> None:
    """Raise unless ``header.status.code`` is OK."""
    if not header_holder.HasField("header"):  # type: ignore[attr-defined]
        raise GarbledReply(target, f"{what}.header: missing")
    status = header_holder.header.status  # type: ignore[attr-defined]
    code = int(status.code)
    if code == _OK:
        return
    name = kvcm_pb.ErrorCode.Name(code) if code in kvcm_pb.ErrorCode.values() else f"CODE_{code}"
    if code == _NOT_LEADER:
        raise NotLeader(target, status.message, code, name)
    raise RemoteError(target, status.message, code, name)


# --- KVCM: GetClusterInfo --------------------------------------------------------------


def encode_cluster_info_request(instance_id: str, trace_id: str = "") -> bytes:
    return kvcm_pb.GetClusterInfoRequest(trace_id=trace_id, instance_id=instance_id).SerializeToString()


def decode_cluster_info(data: bytes, target: str) -> ClusterInfo:
    """Accept a leader only when status is OK, the endpoint is present, the host non-blank and the port valid.

    OK with no leader endpoint and an empty leader id is "no leader elected yet".
    """
    msg = _parse(kvcm_pb.GetClusterInfoResponse, data, target, "GetClusterInfoResponse")
    assert isinstance(msg, kvcm_pb.GetClusterInfoResponse)
    _check_header(msg, target, "GetClusterInfoResponse")
    if not msg.HasField("leader_endpoint"):
        if msg.leader_node_id:
            raise GarbledReply(target, "GetClusterInfoResponse.leader_endpoint: missing for a named leader")
        return ClusterInfo(self_node_id=msg.self_node_id, leader=None)
    ep = msg.leader_endpoint
    host = ep.host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise GarbledReply(target, "GetClusterInfoResponse.leader_endpoint.host: blank")
    if not 1 <= ep.meta_rpc_port <= 65535:
        raise GarbledReply(
            target,
            f"GetClusterInfoResponse.leader_endpoint.meta_rpc_port: {ep.meta_rpc_port} not in 1..65535",
        )
    # A malformed host is the reply's fault: fail here, not later as a TargetError in the channel pool.
    try:
        leader = parse_target(format_target(host, ep.meta_rpc_port))
    except TargetError as exc:
        raise GarbledReply(target, f"GetClusterInfoResponse.leader_endpoint.host: {exc}") from exc
    node_id = ep.node_id or msg.leader_node_id
    return ClusterInfo(
        self_node_id=msg.self_node_id, leader=LeaderEndpoint(node_id, leader.host, leader.port)
    )


# --- KVCM: GetHostCacheState -----------------------------------------------------------


def encode_block_keys(keys: Sequence[int]) -> bytes:
    """``keys`` as ``GetHostCacheStateRequest.block_cache_keys`` on the wire: that field alone, encoded.
    Raises ValueError when a key is not a signed 64-bit integer (checking the keys and encoding them is
    one pass). The error does not quote the key: protobuf would write out a caller's integer of any size.

    A tuple or list of ints goes through the compiled encoder when it was built (the same bytes, a
    fraction of the CPU); anything it does not take, and every call without it, through protobuf."""
    if _packed_int64 is not None:
        encoded = _packed_int64(_BLOCK_KEYS_FIELD, keys)
        if encoded is not None:
            return encoded
    return encode_block_keys_with_protobuf(keys)


def encode_block_keys_with_protobuf(keys: Sequence[int]) -> bytes:
    """``encode_block_keys`` by protobuf alone: it checks each key as it converts it, and refuses a
    bool; an object with ``__index__`` (a numpy integer) is taken as its integer."""
    try:
        return kvcm_pb.GetHostCacheStateRequest(block_cache_keys=keys).SerializeToString()
    except (TypeError, ValueError):
        raise ValueError("a key is not a signed 64-bit integer") from None


def encode_cache_query(query: CacheQuery) -> bytes:
    """The request, its fields in field-number order. The keys' field comes from ``query.encoded_keys``
    when the request's checks already encoded them: encoded messages concatenate into their merge, so
    the parts are written on their own and joined, byte for byte what one message would write."""
    keys = query.encoded_keys if query.encoded_keys is not None else encode_block_keys(query.block_keys)
    head = kvcm_pb.GetHostCacheStateRequest(
        trace_id=query.trace_id,
        instance_id=query.instance_id,
        query_type=cast(kvcm_pb.QueryType, query.query_type.value),
    ).SerializeToString()
    tail = kvcm_pb.GetHostCacheStateRequest(p2p_host_count=query.p2p_host_count).SerializeToString()
    return head + keys + tail


def decode_cache_state(data: bytes, target: str, blocks_asked: int) -> CacheState:
    """Blank hosts are skipped (and counted); a duplicate host keeps its last entry; a count below zero
    or above ``blocks_asked`` (the query's keys: a match is a prefix of them) is garbled."""
    msg = _parse(kvcm_pb.GetHostCacheStateResponse, data, target, "GetHostCacheStateResponse")
    assert isinstance(msg, kvcm_pb.GetHostCacheStateResponse)
    _check_header(msg, target, "GetHostCacheStateResponse")
    if len(msg.hosts) > MAX_CACHE_HOSTS:
        raise GarbledReply(
            target, f"GetHostCacheStateResponse.hosts: {len(msg.hosts)} entries, more than {MAX_CACHE_HOSTS}"
        )
    hosts: dict[str, HostMatch] = {}
    blank = 0
    for i, h in enumerate(msg.hosts):
        name = h.host_ip_port.strip()
        if not name:
            blank += 1
            continue
        if len(name) > MAX_HOST_PORT_CHARS:
            name = name[:MAX_HOST_PORT_CHARS] + "…"
        counts = (("local", h.local), ("p2p_1_fetch", h.p2p_1_fetch), ("p2p_1_total_match", h.p2p_1_total_match))
        for field, count in counts:
            if not 0 <= count <= blocks_asked:
                raise GarbledReply(
                    target,
                    f"GetHostCacheStateResponse.hosts[{i}].{field}: {count} blocks, not in 0..{blocks_asked}"
                    " (the keys asked)",
                )
        hosts.pop(name, None)
        hosts[name] = HostMatch(name, h.local, h.p2p_1_fetch, max(h.p2p_1_total_match, h.local))
    return CacheState(hosts=tuple(hosts.values()), blank_hosts=blank)


# --- Engine: GetWorkerStatus -----------------------------------------------------------


def encode_status_version(latest_finished_version: int) -> bytes:
    return engine_pb.StatusVersionPB(
        latest_cache_version=-1, latest_finished_version=latest_finished_version
    ).SerializeToString()


def _task_k(t: engine_pb.TaskInfoPB) -> TaskInfo:
    return TaskInfo(
        request_id=t.request_id,
        input_length=t.input_length,
        prefix_length=t.prefix_length,
        is_waiting=t.is_waiting,
        prefix_length_valid=t.prefix_length_valid,
        remaining_prefill_tokens=(
            t.remaining_prefill_tokens if t.HasField("remaining_prefill_tokens") else None
        ),
        completed_prefill_tokens=(
            t.completed_prefill_tokens if t.HasField("completed_prefill_tokens") else None
        ),
    )


def _decode_generation_k(data: bytes, target: str) -> WorkerStatus:
    msg = _parse(engine_pb.WorkerStatusPB, data, target, "WorkerStatusPB")
    assert isinstance(msg, engine_pb.WorkerStatusPB)
    if len(msg.running_task_info) > MAX_WORKER_TASKS:
        raise GarbledReply(
            target,
            f"WorkerStatusPB.running_task_info: {len(msg.running_task_info)} entries, more than {MAX_WORKER_TASKS}",
        )
    if len(msg.finished_task_list) > MAX_WORKER_TASKS:
        raise GarbledReply(
            target,
            f"WorkerStatusPB.finished_task_list: {len(msg.finished_task_list)} entries, more than {MAX_WORKER_TASKS}",
        )
    tasks = [_task_k(t) for t in msg.running_task_info]
    finished = tuple(_task_k(t) for t in msg.finished_task_list)
    for field_name, listed in (("running_task_info", tasks), ("finished_task_list", finished)):
        for i, t in enumerate(listed):
            if t.input_length < 0 or t.prefix_length < 0:
                raise GarbledReply(target, f"WorkerStatusPB.{field_name}[{i}]: negative length")
    try:
        mode = KvCacheGroupMode(msg.kv_cache_group_mode)
    except ValueError:
        mode = KvCacheGroupMode.UNSPECIFIED
    for name, value in (
        ("block_size", msg.block_size),
        ("block_hash_lookahead_tokens", msg.block_hash_lookahead_tokens),
    ):
        if value < 0:
            raise GarbledReply(target, f"WorkerStatusPB.{name}: negative ({value})")
    reported_block = msg.block_size if msg.block_size > 0 else None
    return WorkerStatus(
        role=Role.parse(msg.role),
        role_reported=msg.role,
        alive=msg.alive,
        status_version=msg.status_version,
        latest_finished_version=msg.latest_finished_version,
        waiting=tuple(t for t in tasks if t.is_waiting),
        running=tuple(t for t in tasks if not t.is_waiting),
        waiting_query_len=msg.waiting_query_len,
        running_query_len=msg.running_query_len,
        available_concurrency=msg.available_concurrency,
        step_latency_ms=msg.step_latency_ms,
        block_size=reported_block,
        # Lookahead is meaningful only from an engine that reports its block geometry at all.
        lookahead_tokens=msg.block_hash_lookahead_tokens if reported_block is not None else None,
        kv_cache_group_mode=mode,
        available_kv_cache=msg.available_kv_cache if msg.total_kv_cache > 0 else None,
        total_kv_cache=msg.total_kv_cache if msg.total_kv_cache > 0 else None,
        finished=finished,
    )


def decode_worker_status(
    data: bytes, target: str, generation: EngineGeneration = EngineGeneration.K
) -> WorkerStatus:
    """Decode a WorkerStatusPB with the deployment's decoder (generation K today)."""
    match generation:
        case EngineGeneration.K:
            return _decode_generation_k(data, target)
        case _:
            assert_never(generation)
