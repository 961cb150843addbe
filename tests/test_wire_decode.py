"""router/wire/decode.py: replies built with our real generated messages, decoded into our typed values."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import cast

import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.targets import TargetError, parse_target
from router.transport.errors import (
    MAX_PEER_TEXT_CHARS,
    GarbledReply,
    NotLeader,
    RemoteError,
    RpcStatus,
    TransportError,
    status_to_error,
)
from router.types import CacheQuery, HostMatch, KvCacheGroupMode, LeaderEndpoint, QueryType, Role
from router.wire import engine_status_pb2 as engine_pb
from router.wire import kvcm_meta_pb2 as kvcm_pb
from router.wire.decode import (
    COMPILED_KEYS_ENCODER,
    MAX_CACHE_HOSTS,
    MAX_HOST_PORT_CHARS,
    MAX_WORKER_TASKS,
    decode_cache_state,
    decode_cluster_info,
    decode_worker_status,
    encode_block_keys,
    encode_block_keys_with_protobuf,
    encode_cache_query,
    encode_cluster_info_request,
    encode_status_version,
)
from router.wire.master import parse_master_role

try:
    from router.wire._packed import packed_int64
except ImportError:  # built without a C compiler: only protobuf's way is there to test
    packed_int64 = None  # type: ignore[assignment]

PEER = "10.9.9.9:6381"
ASKED = 16  # the keys a query asked about: no count in its answer may exceed them
GARBAGE = b"\xff\xfe garbage \x00\x01"


def cluster_reply(
    *,
    code: int = kvcm_pb.OK,
    message: str = "",
    leader_node_id: str = "n1",
    endpoint: kvcm_pb.MetaNodeEndpoint | None = None,
) -> bytes:
    reply = kvcm_pb.GetClusterInfoResponse(
        header=kvcm_pb.CommonResponseHeader(
            status=kvcm_pb.Status(code=cast(kvcm_pb.ErrorCode, code), message=message)
        ),
        self_node_id="self",
        leader_node_id=leader_node_id,
    )
    if endpoint is not None:
        reply.leader_endpoint.CopyFrom(endpoint)
    return reply.SerializeToString()


def endpoint(host: str = "10.0.0.5", port: int = 6381, node_id: str = "n1") -> kvcm_pb.MetaNodeEndpoint:
    return kvcm_pb.MetaNodeEndpoint(node_id=node_id, host=host, meta_rpc_port=port, meta_http_port=6382)


# --- GetClusterInfo ------------------------------------------------------------------------------


def test_cluster_info_request_round_trips() -> None:
    request = kvcm_pb.GetClusterInfoRequest.FromString(encode_cluster_info_request("ns_16", trace_id="t1"))
    assert (request.instance_id, request.trace_id) == ("ns_16", "t1")


def test_valid_leader() -> None:
    info = decode_cluster_info(cluster_reply(endpoint=endpoint()), PEER)
    assert info.self_node_id == "self"
    assert info.leader == LeaderEndpoint("n1", "10.0.0.5", 6381)
    assert info.leader.target == "10.0.0.5:6381"


def test_leader_node_id_falls_back_to_the_replys_leader_id() -> None:
    info = decode_cluster_info(cluster_reply(leader_node_id="n7", endpoint=endpoint(node_id="")), PEER)
    assert info.leader is not None and info.leader.node_id == "n7"


def test_no_leader_elected_is_a_valid_answer_not_an_error() -> None:
    info = decode_cluster_info(cluster_reply(leader_node_id=""), PEER)
    assert info.leader is None
    assert info.self_node_id == "self"


def test_named_leader_without_endpoint_is_garbled() -> None:
    with pytest.raises(GarbledReply, match="leader_endpoint: missing") as info:
        decode_cluster_info(cluster_reply(leader_node_id="n1"), PEER)
    assert info.value.target == PEER


@pytest.mark.parametrize("host", ["", "   ", "[]"])
def test_blank_leader_host_is_garbled(host: str) -> None:
    with pytest.raises(GarbledReply, match=r"leader_endpoint\.host: blank"):
        decode_cluster_info(cluster_reply(endpoint=endpoint(host=host)), PEER)


@pytest.mark.parametrize("host", ["bad host", "kvcm:6381", "1.2.3", "[::1"])
def test_malformed_leader_host_is_garbled(host: str) -> None:
    with pytest.raises(GarbledReply, match=r"leader_endpoint\.host: ") as info:
        decode_cluster_info(cluster_reply(endpoint=endpoint(host=host)), PEER)
    assert host in str(info.value)


@pytest.mark.parametrize(
    ("port", "valid"), [(0, False), (1, True), (65535, True), (65536, False), (-1, False)]
)
def test_leader_port_range_both_bounds(port: int, valid: bool) -> None:
    reply = cluster_reply(endpoint=endpoint(port=port))
    if valid:
        info = decode_cluster_info(reply, PEER)
        assert info.leader is not None and info.leader.port == port
    else:
        with pytest.raises(GarbledReply, match=f"meta_rpc_port: {port} not in 1..65535"):
            decode_cluster_info(reply, PEER)


@pytest.mark.parametrize(
    ("host", "bare", "target"),
    [
        ("::1", "::1", "[::1]:6381"),
        ("[2001:db8::1]", "2001:db8::1", "[2001:db8::1]:6381"),
        ("2001:DB8:0::1", "2001:db8::1", "[2001:db8::1]:6381"),
        (" Kvcm-0.Local ", "kvcm-0.local", "kvcm-0.local:6381"),
    ],
)
def test_leader_host_is_normalised_and_ipv6_bracketed_in_the_target(
    host: str, bare: str, target: str
) -> None:
    info = decode_cluster_info(cluster_reply(endpoint=endpoint(host=host)), PEER)
    assert info.leader is not None
    assert (info.leader.host, info.leader.target) == (bare, target)


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (kvcm_pb.SERVICE_NOT_READY, "SERVICE_NOT_READY"),
        (kvcm_pb.INTERNAL_ERROR, "INTERNAL_ERROR"),
        (kvcm_pb.UNSPECIFIED, "UNSPECIFIED"),
        (kvcm_pb.INSTANCE_NOT_EXIST, "INSTANCE_NOT_EXIST"),
        (4242, "CODE_4242"),
    ],
)
def test_non_ok_codes_are_remote_errors(code: int, name: str) -> None:
    with pytest.raises(RemoteError) as info:
        decode_cluster_info(cluster_reply(code=code, message="why", endpoint=endpoint()), PEER)
    assert not isinstance(info.value, NotLeader)
    assert (info.value.code, info.value.code_name, info.value.target) == (code, name, PEER)
    assert "why" in str(info.value)


def test_a_peers_text_in_an_error_is_kept_to_a_bound_whatever_its_length() -> None:
    """A peer's text reaches logs, decisions, /readyz and /debug/actors: a megabyte of it stays out,
    whichever field carried it."""
    errors: list[TransportError] = []
    for code in (kvcm_pb.SERVICE_NOT_READY, kvcm_pb.SERVER_NOT_LEADER):
        with pytest.raises(RemoteError) as remote:
            decode_cluster_info(cluster_reply(code=code, message="why" + "x" * 1_000_000, endpoint=endpoint()), PEER)
        errors.append(remote.value)
    with pytest.raises(GarbledReply) as garbled:  # a leader host no parse accepts, named twice in the error
        decode_cluster_info(cluster_reply(endpoint=endpoint(host="h" * 1_000_000)), PEER)
    errors.append(garbled.value)
    with pytest.raises(GarbledReply) as role:  # the master's reply naming a role nobody knows
        parse_master_role("R" * 1_000_000, "server_status[0].role", PEER)
    errors.append(role.value)
    errors.append(status_to_error(PEER, RpcStatus.INTERNAL, "y" * 100_000))
    for error in errors:
        # Kept to the bound, and saying it was cut and how long it was (a target's error cuts the host and
        # the target it names, the others the whole text).
        assert len(error.detail) <= MAX_PEER_TEXT_CHARS and re.search(r"…\[cut: \d+ chars\]", error.detail), error
        assert len(str(error)) <= len(PEER) + 2 + MAX_PEER_TEXT_CHARS


def test_server_not_leader_is_not_leader() -> None:
    with pytest.raises(NotLeader) as info:
        decode_cluster_info(cluster_reply(code=kvcm_pb.SERVER_NOT_LEADER, endpoint=endpoint()), PEER)
    assert (info.value.code, info.value.code_name) == (9, "SERVER_NOT_LEADER")
    assert info.value.kind == "not_leader"


def test_missing_header_is_garbled() -> None:
    reply = kvcm_pb.GetClusterInfoResponse(self_node_id="s", leader_endpoint=endpoint()).SerializeToString()
    with pytest.raises(GarbledReply, match=r"GetClusterInfoResponse\.header: missing"):
        decode_cluster_info(reply, PEER)


def test_cluster_info_garbage_is_garbled_naming_the_message() -> None:
    with pytest.raises(GarbledReply, match="GetClusterInfoResponse: undecodable") as info:
        decode_cluster_info(GARBAGE, PEER)
    assert info.value.target == PEER
    assert info.value.kind == "garbled"


# --- GetHostCacheState ---------------------------------------------------------------------------


def cache_reply(*hosts: tuple[str, int, int, int], code: int = kvcm_pb.OK) -> bytes:
    reply = kvcm_pb.GetHostCacheStateResponse(
        header=kvcm_pb.CommonResponseHeader(
            status=kvcm_pb.Status(code=cast(kvcm_pb.ErrorCode, code), message="m")
        )
    )
    for host, local, fetch, total in hosts:
        reply.hosts.add(host_ip_port=host, local=local, p2p_1_fetch=fetch, p2p_1_total_match=total)
    return reply.SerializeToString()


def test_cache_query_encodes_every_field() -> None:
    keys = (1, -2, 1 << 62, -(1 << 63))
    query = CacheQuery("deploy_16", QueryType.PREFIX_MATCH_WITH_MAMBA, keys, trace_id="r1", p2p_host_count=3)
    data = encode_cache_query(query)
    request = kvcm_pb.GetHostCacheStateRequest.FromString(data)
    assert request.instance_id == "deploy_16"
    assert request.trace_id == "r1"
    assert request.query_type == kvcm_pb.QT_PREFIX_MATCH_WITH_MAMBA
    assert tuple(request.block_cache_keys) == keys
    assert request.p2p_host_count == 3
    assert list(request.medium) == []  # empty = all media
    assert b"\x22" in data  # field 4, wire type 2: the keys are packed


@given(
    keys=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40).map(tuple),
    trace_id=st.text(max_size=12),
    p2p=st.integers(0, 2**31 - 1),
    query_type=st.sampled_from(QueryType),
)
def test_a_query_with_its_keys_encoded_by_the_checks_is_byte_for_byte_the_one_message(
    keys: tuple[int, ...], trace_id: str, p2p: int, query_type: QueryType
) -> None:
    """The keys' field written apart and joined: the same bytes as one message with every field, in
    field-number order, whether the checks encoded the keys or the query does."""
    one_message = kvcm_pb.GetHostCacheStateRequest(
        trace_id=trace_id,
        instance_id="deploy_16",
        query_type=cast(kvcm_pb.QueryType, query_type.value),
        block_cache_keys=keys,
        p2p_host_count=p2p,
    ).SerializeToString()
    query = CacheQuery("deploy_16", query_type, keys, trace_id=trace_id, p2p_host_count=p2p)
    assert encode_cache_query(query) == one_message
    with_encoded = CacheQuery(
        "deploy_16", query_type, keys, trace_id=trace_id, p2p_host_count=p2p, encoded_keys=encode_block_keys(keys)
    )
    assert encode_cache_query(with_encoded) == one_message


@pytest.mark.parametrize("bad", [True, 2**63, -(2**63) - 1, 1.0, "1"])
def test_encoding_a_key_that_is_not_a_signed_64_bit_integer_fails(bad: object) -> None:
    with pytest.raises(ValueError, match="a key is not a signed 64-bit integer"):
        encode_block_keys((1, bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a key is not a signed 64-bit integer"):
        encode_block_keys_with_protobuf((1, bad))  # type: ignore[arg-type]


BLOCK_KEYS_FIELD = kvcm_pb.GetHostCacheStateRequest.DESCRIPTOR.fields_by_name["block_cache_keys"].number
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# The ends of the range and the varints' length steps, besides any int64.
EDGES = st.sampled_from([0, 1, -1, 127, 128, 2**63 - 1, -(2**63), 2**35, -(2**35)])
needs_compiled = pytest.mark.skipif(packed_int64 is None, reason="router.wire._packed was not built (no C compiler)")


def test_the_compiled_keys_encoder_is_in_use_when_it_was_built() -> None:
    assert COMPILED_KEYS_ENCODER is (packed_int64 is not None)


@given(keys=st.lists(st.one_of(INT64, EDGES), max_size=600), as_list=st.booleans())
def test_block_keys_encode_to_protobufs_own_bytes_either_way(keys: list[int], as_list: bool) -> None:
    """The encoder in use (compiled when built) writes what protobuf writes, for a tuple or a list."""
    values = keys if as_list else tuple(keys)
    expected = kvcm_pb.GetHostCacheStateRequest(block_cache_keys=keys).SerializeToString()
    assert encode_block_keys(values) == expected
    assert encode_block_keys_with_protobuf(values) == expected
    if packed_int64 is not None:
        assert packed_int64(BLOCK_KEYS_FIELD, values) == expected


class _Index(enum.IntEnum):
    SEVEN = 7


@needs_compiled
@pytest.mark.parametrize(
    "keys",
    [
        (1, True),  # a bool is refused by protobuf
        (1, 2**63),  # out of range
        (-(2**63) - 1,),
        (1, 1.0),
        (1, "1"),
        (1, _Index.SEVEN),  # an int subclass: protobuf takes its value
        (1, numpy.int64(7)),  # __index__: protobuf takes it
        range(3),  # neither a tuple nor a list
    ],
    ids=["bool", "past-max", "past-min", "float", "str", "int-subclass", "numpy", "range"],
)
def test_the_compiled_encoder_leaves_to_protobuf_what_it_does_not_take(keys: Sequence[object]) -> None:
    assert packed_int64 is not None
    assert packed_int64(BLOCK_KEYS_FIELD, keys) is None  # type: ignore[arg-type]
    try:
        expected: bytes | str = encode_block_keys_with_protobuf(keys)  # type: ignore[arg-type]
    except ValueError as exc:
        expected = str(exc)
    try:
        got: bytes | str = encode_block_keys(keys)  # type: ignore[arg-type]
    except ValueError as exc:
        got = str(exc)
    assert got == expected


@needs_compiled
def test_the_compiled_encoder_refuses_a_field_number_protobuf_cannot_have() -> None:
    assert packed_int64 is not None
    for bad in (0, -1, 2**29):
        with pytest.raises(ValueError, match="field_number"):
            packed_int64(bad, (1,))
    assert packed_int64(2**29 - 1, ()) == b""


def test_cache_state_values() -> None:
    state = decode_cache_state(cache_reply(("10.0.0.1:8000", 3, 2, 5), ("[::1]:8000", 1, 0, 1)), PEER, ASKED)
    assert state.hosts == (HostMatch("10.0.0.1:8000", 3, 2, 5), HostMatch("[::1]:8000", 1, 0, 1))


def test_cache_state_blank_hosts_are_skipped() -> None:
    state = decode_cache_state(cache_reply(("", 9, 0, 9), ("  ", 9, 0, 9), ("a:1", 2, 0, 2)), PEER, ASKED)
    assert [h.host_ip_port for h in state.hosts] == ["a:1"]
    assert state.blank_hosts == 2  # counted by the KVCM source as malformed hosts


def test_cache_state_with_more_hosts_than_a_fleet_has_is_garbled_before_decoding_them() -> None:
    many = [(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000", 1, 0, 1) for i in range(MAX_CACHE_HOSTS + 1)]
    with pytest.raises(GarbledReply, match=f"hosts: {MAX_CACHE_HOSTS + 1} entries, more than {MAX_CACHE_HOSTS}"):
        decode_cache_state(cache_reply(*many), PEER, ASKED)


def test_cache_state_keeps_a_host_longer_than_any_host_port_cut_so_no_parse_accepts_it() -> None:
    state = decode_cache_state(cache_reply(("w" * 100_000, 4, 0, 4), ("a:1", 2, 0, 2)), PEER, ASKED)
    cut, kept = state.hosts
    assert len(cut.host_ip_port) == MAX_HOST_PORT_CHARS + 1 and cut.host_ip_port.endswith("…")
    assert cut.local == 4 and kept.host_ip_port == "a:1"
    with pytest.raises(TargetError):
        parse_target(cut.host_ip_port)


def test_cache_state_duplicate_host_keeps_the_last_entry() -> None:
    state = decode_cache_state(cache_reply(("a:1", 5, 0, 5), ("b:1", 1, 0, 1), ("a:1", 2, 1, 3)), PEER, ASKED)
    assert set(state.hosts) == {HostMatch("b:1", 1, 0, 1), HostMatch("a:1", 2, 1, 3)}
    assert len(state.hosts) == 2


def test_cache_state_total_below_local_means_not_evaluated() -> None:
    """An older server leaves p2p_1_total_match unset (0) for hosts it did not evaluate: total = local."""
    state = decode_cache_state(cache_reply(("a:1", 4, 0, 0)), PEER, ASKED)
    assert state.hosts == (HostMatch("a:1", 4, 0, 4),)


@pytest.mark.parametrize(
    ("counts", "field"),
    [
        ((-1, 0, 0), "local: -1"),
        ((1, -1, 1), "p2p_1_fetch: -1"),
        ((1, 0, -1), "p2p_1_total_match: -1"),
        ((ASKED + 1, 0, ASKED + 1), f"local: {ASKED + 1}"),
        ((2**33, 0, 2**33), f"local: {2**33}"),
        ((1, ASKED + 1, 1), f"p2p_1_fetch: {ASKED + 1}"),
        ((1, 3, ASKED + 1), f"p2p_1_total_match: {ASKED + 1}"),
    ],
)
def test_cache_state_counts_outside_the_keys_asked_are_garbled_naming_the_field(
    counts: tuple[int, int, int], field: str
) -> None:
    """A match is a prefix of the keys asked: a count below zero or above them is a broken answer."""
    with pytest.raises(GarbledReply, match=rf"hosts\[1\]\.{field} blocks, not in 0\.\.{ASKED}"):
        decode_cache_state(cache_reply(("ok:1", 1, 0, 1), ("bad:1", *counts)), PEER, ASKED)


def test_cache_state_counts_equal_to_the_keys_asked_are_whole_matches() -> None:
    state = decode_cache_state(cache_reply(("a:1", ASKED, 0, ASKED), ("b:1", 2, ASKED - 2, ASKED)), PEER, ASKED)
    assert state.hosts == (HostMatch("a:1", ASKED, 0, ASKED), HostMatch("b:1", 2, ASKED - 2, ASKED))


def test_cache_state_not_leader_and_other_codes() -> None:
    with pytest.raises(NotLeader):
        decode_cache_state(cache_reply(code=kvcm_pb.SERVER_NOT_LEADER), PEER, ASKED)
    with pytest.raises(RemoteError) as info:
        decode_cache_state(cache_reply(code=kvcm_pb.INSTANCE_NOT_EXIST), PEER, ASKED)
    assert not isinstance(info.value, NotLeader)
    assert info.value.code_name == "INSTANCE_NOT_EXIST"


def test_cache_state_garbage_is_garbled_naming_the_message() -> None:
    with pytest.raises(GarbledReply, match="GetHostCacheStateResponse: undecodable"):
        decode_cache_state(GARBAGE, PEER, ASKED)


def test_cache_state_missing_header_is_garbled() -> None:
    data = kvcm_pb.GetHostCacheStateResponse(hosts=[kvcm_pb.HostCacheMatch(host_ip_port="a:1", local=1)])
    with pytest.raises(GarbledReply, match=r"GetHostCacheStateResponse\.header: missing"):
        decode_cache_state(data.SerializeToString(), PEER, ASKED)


# --- GetWorkerStatus -----------------------------------------------------------------------------

WORKER = "10.0.0.1:8001"


def status_reply(**fields: object) -> engine_pb.WorkerStatusPB:
    base: dict[str, object] = {"role": "RoleType.PREFILL", "alive": True, "status_version": 3}
    base.update(fields)
    return engine_pb.WorkerStatusPB(**base)  # type: ignore[arg-type]


def test_status_version_request() -> None:
    request = engine_pb.StatusVersionPB.FromString(encode_status_version(17))
    assert (request.latest_cache_version, request.latest_finished_version) == (-1, 17)


def test_worker_status_scalars() -> None:
    reply = status_reply(
        latest_finished_version=12,
        waiting_query_len=4,
        running_query_len=2,
        available_concurrency=6,
        step_latency_ms=1.5,
        block_size=64,
        block_hash_lookahead_tokens=1,
        kv_cache_group_mode=engine_pb.KV_CACHE_GROUP_MODE_WITH_MAMBA,
        available_kv_cache=100,
        total_kv_cache=400,
    )
    status = decode_worker_status(reply.SerializeToString(), WORKER)
    assert (status.role, status.role_reported, status.alive) == (Role.PREFILL, "RoleType.PREFILL", True)
    assert (status.status_version, status.latest_finished_version) == (3, 12)
    assert (status.waiting_query_len, status.running_query_len, status.available_concurrency) == (4, 2, 6)
    assert status.step_latency_ms == 1.5
    assert (status.block_size, status.lookahead_tokens) == (64, 1)
    assert status.kv_cache_group_mode is KvCacheGroupMode.WITH_MAMBA
    assert (status.available_kv_cache, status.total_kv_cache) == (100, 400)


def test_block_size_zero_means_not_reported() -> None:
    """A stock generation-K engine leaves block_size unset: None, never 0 standing for a size."""
    status = decode_worker_status(status_reply(block_hash_lookahead_tokens=1).SerializeToString(), WORKER)
    assert status.block_size is None
    assert status.lookahead_tokens is None
    assert status.total_kv_cache is None and status.available_kv_cache is None


def test_reported_block_size_with_zero_lookahead_is_a_real_zero() -> None:
    status = decode_worker_status(status_reply(block_size=16).SerializeToString(), WORKER)
    assert (status.block_size, status.lookahead_tokens) == (16, 0)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"block_size": -16}, "block_size"),
        ({"block_size": 16, "block_hash_lookahead_tokens": -1}, "lookahead"),
    ],
)
def test_negative_geometry_is_garbled(fields: dict[str, int], name: str) -> None:
    with pytest.raises(GarbledReply, match=f"WorkerStatusPB.*{name}.*negative"):
        decode_worker_status(status_reply(**fields).SerializeToString(), WORKER)


def test_tasks_split_by_is_waiting_with_optional_presence_kept() -> None:
    reply = status_reply()
    reply.running_task_info.add(request_id="w1", input_length=100, prefix_length=20, is_waiting=True)
    running_zero = reply.running_task_info.add(request_id="r-zero", input_length=500, prefix_length=100)
    running_zero.remaining_prefill_tokens = 0
    running_zero.completed_prefill_tokens = 400
    reply.running_task_info.add(request_id="r-absent", input_length=500, prefix_length=100)
    reply.running_task_info.add(request_id="w2", input_length=50, prefix_length=80, is_waiting=True)
    reply.finished_task_list.add(request_id="done", input_length=999)

    status = decode_worker_status(reply.SerializeToString(), WORKER)

    assert [t.request_id for t in status.waiting] == ["w1", "w2"]
    assert [t.request_id for t in status.running] == ["r-zero", "r-absent"]
    assert all(t.is_waiting for t in status.waiting)
    assert not any(t.is_waiting for t in status.running)
    zero, absent = status.running
    assert (zero.remaining_prefill_tokens, zero.completed_prefill_tokens) == (0, 400)
    assert (absent.remaining_prefill_tokens, absent.completed_prefill_tokens) == (None, None)
    # Present 0 means nothing left; absent falls back to input - prefix (selection.md §2.3).
    assert [t.uncached_tokens for t in status.running] == [0, 400]
    assert [t.uncached_tokens for t in status.waiting] == [80, 0]
    assert status.outstanding_uncached_tokens == 480
    assert status.waiting_count == 2


@pytest.mark.parametrize(
    ("reported", "role"),
    [
        ("RoleType.PREFILL", Role.PREFILL),
        ("RoleType.PDFUSION", Role.PDFUSION),
        ("RoleType.DECODE", Role.DECODE),
        ("RoleType.VIT", Role.VIT),
        ("RoleType.FRONTEND", Role.FRONTEND),
        ("RoleType.UNKNOWN", Role.UNKNOWN),
        ("decode", Role.DECODE),
        ("RoleType.SOMETHING_NEW", Role.UNKNOWN),
        ("", Role.UNKNOWN),
        ("RoleType.PREFıLL", Role.UNKNOWN),  # a dotless ı upper-cases to I: it was read as PREFILL
        ("vıt", Role.UNKNOWN),
    ],
)
def test_roles(reported: str, role: Role) -> None:
    status = decode_worker_status(status_reply(role=reported).SerializeToString(), WORKER)
    assert status.role is role
    assert status.role_reported == reported


def test_unknown_group_mode_is_unspecified() -> None:
    reply = status_reply(kv_cache_group_mode=7)
    assert decode_worker_status(reply.SerializeToString(), WORKER).kv_cache_group_mode is (
        KvCacheGroupMode.UNSPECIFIED
    )


@pytest.mark.parametrize("listed", ["running_task_info", "finished_task_list"])
@pytest.mark.parametrize("lengths", [{"input_length": -1}, {"input_length": 100, "prefix_length": -50}])
def test_negative_task_length_is_garbled_naming_the_task(listed: str, lengths: dict[str, int]) -> None:
    """A negative prefix would count more uncached tokens than the task has."""
    reply = status_reply()
    tasks = getattr(reply, listed)
    tasks.add(request_id="ok", input_length=1)
    tasks.add(request_id="bad", **lengths)
    with pytest.raises(GarbledReply, match=rf"WorkerStatusPB.{listed}\[1\]: negative"):
        decode_worker_status(reply.SerializeToString(), WORKER)


@pytest.mark.parametrize(("listed", "kept"), [("running_task_info", "running"), ("finished_task_list", "finished")])
def test_a_status_listing_more_tasks_than_any_worker_runs_is_garbled_before_decoding_them(
    listed: str, kept: str
) -> None:
    reply = status_reply()
    tasks = getattr(reply, listed)
    for i in range(MAX_WORKER_TASKS):
        tasks.add(request_id=f"t{i}", input_length=1)
    assert len(getattr(decode_worker_status(reply.SerializeToString(), WORKER), kept)) == MAX_WORKER_TASKS
    tasks.add()
    with pytest.raises(
        GarbledReply, match=f"{listed}: {MAX_WORKER_TASKS + 1} entries, more than {MAX_WORKER_TASKS}"
    ):
        decode_worker_status(reply.SerializeToString(), WORKER)


def test_worker_status_garbage_is_garbled_naming_the_message() -> None:
    with pytest.raises(GarbledReply, match="WorkerStatusPB: undecodable") as info:
        decode_worker_status(GARBAGE, WORKER)
    assert info.value.target == WORKER


def test_status_version_zero_is_passed_through_for_the_prober_to_ignore() -> None:
    status = decode_worker_status(status_reply(status_version=0).SerializeToString(), WORKER)
    assert status.status_version == 0
