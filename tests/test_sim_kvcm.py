"""SimKvcmIndex and SimKvcmCluster cores: prefix matching, LRU, P2P fields, leader/follower, faults.

Replies are checked through the real client decoders (router.wire.decode), so what the
core serves is what a client sees.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_sim.sim.faults import Garble, MethodStats
from kvroute_sim.sim.index import SimKvcmIndex
from kvroute_sim.sim.kvcm import KEPT_ANSWERS, KvcmFaults, SimKvcmCluster
from kvroute_sim.sim.memory_server import memory_handler
from router.transport.clients import KvcmClient
from router.transport.errors import GarbledReply, NotLeader, RemoteError, RpcStatus
from router.transport.memory_adapter import MemoryNetwork
from router.types import CacheQuery, HostMatch, QueryType
from router.wire import decode, paths
from router.wire import kvcm_meta_pb2 as kvcm_pb

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
KEYS = tuple(range(100, 110))


def _index(*hosts: str, capacity: int = 1000) -> SimKvcmIndex:
    index = SimKvcmIndex()
    for host in hosts:
        index.add_worker(host, capacity)
    return index


# ---- index: local prefix ----


def test_local_is_the_contiguous_stored_prefix() -> None:
    index = _index(A)
    index.record_prefill(A, [KEYS[0], KEYS[1], KEYS[3]])
    assert index.local_prefix(A, KEYS) == 2
    assert index.match(KEYS) == (HostMatch(A, 2, 0, 2),)


def test_only_hosts_with_local_above_zero_are_returned_in_local_then_host_order() -> None:
    index = _index(A, B, C)
    index.record_prefill(C, KEYS[:3])
    index.record_prefill(B, KEYS[1:])  # no block 0: local 0
    index.record_prefill(A, KEYS[:3])
    assert index.match(KEYS) == (HostMatch(A, 3, 0, 3), HostMatch(C, 3, 0, 3))
    assert index.match(()) == ()
    assert index.match((999,)) == ()


def test_full_match_and_duplicate_keys() -> None:
    index = _index(A)
    index.record_prefill(A, KEYS)
    assert index.match(KEYS) == (HostMatch(A, len(KEYS), 0, len(KEYS)),)
    assert index.local_prefix(A, (7, 7)) == 0
    index.record_prefill(A, (7, 7))
    assert index.local_prefix(A, (7, 7, 7)) == 3  # one stored key serves every position holding it


def test_large_fleet_and_long_prompt_match_is_exact() -> None:
    keys = tuple(range(10_000))
    index = SimKvcmIndex()
    hosts = [f"10.1.{i // 250}.{i % 250}:8000" for i in range(1000)]
    for i, host in enumerate(hosts):
        index.add_worker(host, 20_000)
        index.record_prefill(host, keys[: (i % 100) * 3])  # 0 .. 297 blocks
    index.record_prefill(hosts[7], keys)
    result = {h.host_ip_port: h.local for h in index.match(keys)}
    expected = {host: (i % 100) * 3 for i, host in enumerate(hosts) if i % 100}
    expected[hosts[7]] = len(keys)
    assert result == expected


# ---- index: LRU ----


def test_lru_evicts_least_recent_and_a_prompt_tail_before_its_prefix() -> None:
    index = _index(A, capacity=4)
    assert index.record_prefill(A, [1, 2, 3]) == 0
    assert index.record_prefill(A, [4, 5]) == 1  # 5 blocks > 4: the oldest block goes
    # [1,2,3] was stored tail first, so its tail (3) was the least recent.
    assert [index.holds(A, k) for k in (1, 2, 3, 4, 5)] == [True, True, False, True, True]
    assert index.stored_blocks(A) == 4
    assert index.match([1, 2, 3]) == (HostMatch(A, 2, 0, 2),)


def test_lru_touch_refreshes_a_prefix() -> None:
    index = _index(A, capacity=3)
    index.record_prefill(A, [1])
    index.record_prefill(A, [2, 3])
    index.record_prefill(A, [1])  # touched: now most recent
    index.record_prefill(A, [4])  # evicts the least recent: 3 (tail of [2, 3])
    assert [index.holds(A, k) for k in (1, 2, 3, 4)] == [True, True, False, True]
    index.record_prefill(A, [5])  # next least recent: 2
    assert [index.holds(A, k) for k in (1, 2, 4, 5)] == [True, False, True, True]


def test_prompt_longer_than_capacity_keeps_its_prefix() -> None:
    index = _index(A, capacity=3)
    assert index.record_prefill(A, KEYS) == len(KEYS) - 3
    assert index.local_prefix(A, KEYS) == 3


def test_eviction_removes_the_worker_from_matches() -> None:
    index = _index(A, B, capacity=2)
    index.record_prefill(A, [1, 2])
    index.record_prefill(B, [1, 2])
    index.record_prefill(A, [8, 9])
    assert index.match([1, 2]) == (HostMatch(B, 2, 0, 2),)


def test_shrinking_capacity_evicts_and_clear_and_remove() -> None:
    index = _index(A, B)
    index.record_prefill(A, KEYS)
    index.add_worker(A, 4)
    assert index.stored_blocks(A) == 4
    index.record_prefill(B, KEYS)
    index.clear_worker(B)
    assert index.stored_blocks(B) == 0
    assert index.match(KEYS) == (HostMatch(A, 4, 0, 4),)
    index.remove_worker(A)
    assert index.workers == (B,)
    assert index.match(KEYS) == ()


def test_bad_input_names_the_field() -> None:
    index = SimKvcmIndex()
    with pytest.raises(ValueError, match="capacity_blocks"):
        index.add_worker(A, 0)
    with pytest.raises(ValueError, match="host"):
        index.add_worker("  ", 10)
    with pytest.raises(ValueError, match="unknown worker"):
        index.record_prefill(A, [1])


# ---- index: P2P ----


def test_p2p_fields_for_evaluated_hosts_only() -> None:
    index = _index(A, B, C)
    index.record_prefill(A, KEYS[:3])
    index.record_prefill(B, KEYS[:6])
    index.record_prefill(C, KEYS[:8])
    # p2p_host_count 2: C (8) and B (6) are evaluated; A is not.
    assert index.match(KEYS, 2) == (
        HostMatch(C, 8, 0, 8),  # nobody holds block 8
        HostMatch(B, 6, 2, 8),  # blocks 6, 7 from C
        HostMatch(A, 3, 0, 3),
    )
    assert index.match(KEYS, 3)[2] == HostMatch(A, 3, 5, 8)
    assert index.match(KEYS, 0)[1] == HostMatch(B, 6, 0, 6)


def test_p2p_fetches_from_one_peer_not_a_union() -> None:
    index = _index(A, B, C)
    index.record_prefill(A, [KEYS[0], KEYS[2]])
    index.record_prefill(B, [KEYS[1]])
    index.record_prefill(C, [KEYS[3]])
    # A misses 1 (B has it), holds 2, misses 3 (only C has it): one peer reaches 3 blocks.
    assert index.match(KEYS[:4], 1) == (HostMatch(A, 1, 1, 3),)


def test_p2p_ties_by_host_string() -> None:
    index = _index(B, A, C)
    for host in (A, B, C):
        index.record_prefill(host, KEYS[:2])
    index.record_prefill(C, KEYS[2:5])  # C holds blocks 0..4: local 5
    index.record_prefill(B, [KEYS[2]])
    result = index.match(KEYS, 2)
    # Evaluated: C (local 5), then B (local 3) — never A (local 2).
    assert result == (HostMatch(C, 5, 0, 5), HostMatch(B, 3, 2, 5), HostMatch(A, 2, 0, 2))
    index2 = _index(B, A)
    index2.record_prefill(A, KEYS[:2])
    index2.record_prefill(B, KEYS[:2])
    assert index2.match(KEYS, 1) == (HostMatch(A, 2, 0, 2), HostMatch(B, 2, 0, 2))  # A wins the tie


def _brute_force(stores: dict[str, set[int]], keys: list[int], p2p: int) -> tuple[HostMatch, ...]:
    local = {}
    for host, stored in stores.items():
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        if n:
            local[host] = n
    ranked = sorted(local.items(), key=lambda item: (-item[1], item[0]))
    out = []
    for rank, (host, n) in enumerate(ranked):
        total = n
        if rank < p2p:
            for peer, theirs in stores.items():
                if peer == host:
                    continue
                j = n
                while j < len(keys) and (keys[j] in stores[host] or keys[j] in theirs):
                    j += 1
                total = max(total, j)
        fetch = sum(1 for k in keys[n:total] if k not in stores[host])
        out.append(HostMatch(host, n, fetch, total))
    return tuple(out)


@settings(max_examples=300, deadline=None)
@given(
    stores=st.dictionaries(
        st.sampled_from([A, B, C, "10.0.0.4:8000"]), st.sets(st.integers(0, 7), max_size=8), max_size=4
    ),
    keys=st.lists(st.integers(0, 7), max_size=10),
    p2p=st.integers(0, 5),
)
def test_match_equals_brute_force(stores: dict[str, set[int]], keys: list[int], p2p: int) -> None:
    index = _index(*stores)
    for host, stored in stores.items():
        index.record_prefill(host, sorted(stored))
    assert index.match(keys, p2p) == _brute_force(stores, keys, p2p)


_HOSTS = [A, B, C, "10.0.0.4:8000"]
_CHANGES: st.SearchStrategy[tuple[str, str, list[int]]] = st.one_of(
    st.tuples(st.just("prefill"), st.sampled_from(_HOSTS), st.lists(st.integers(0, 7), max_size=6)),
    st.tuples(st.just("clear"), st.sampled_from(_HOSTS), st.just([])),
    st.tuples(st.just("capacity"), st.sampled_from(_HOSTS), st.lists(st.integers(1, 6), min_size=1, max_size=1)),
)
_PROMPTS = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=8), min_size=1, max_size=3)  # asked repeatedly


def _apply(stores: SimKvcmIndex | SimKvcmCluster, change: tuple[str, str, list[int]]) -> None:
    """One drawn change: a prefill's keys stored, a worker cleared, or its capacity set (evicting)."""
    action, host, values = change
    if action == "prefill":
        stores.record_prefill(host, values)
    elif action == "clear":
        stores.clear_worker(host)
    else:
        stores.add_worker(host, values[0])


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(_CHANGES, max_size=12),
    prompts=_PROMPTS,
    p2p=st.integers(0, 3),
)
def test_every_answer_is_the_stores_of_the_moment(
    steps: list[tuple[str, str, list[int]]], prompts: list[list[int]], p2p: int
) -> None:
    """The same few prompts asked after every change (eviction included), twice: each answer is what
    the stores hold at that moment, and the index's version moves whenever a store changes."""
    index = _index(*_HOSTS, capacity=6)
    before = {h: set[int]() for h in _HOSTS}
    for change in steps:
        version = index.version
        _apply(index, change)
        stores = {h: {k for k in range(8) if index.holds(h, k)} for h in _HOSTS}
        assert index.version != version or stores == before  # a kept answer may not outlive a change
        before = stores
        for keys in prompts + prompts:
            assert index.match(keys, p2p) == _brute_force(stores, keys, p2p)



def test_ties_by_plain_host_string() -> None:
    hosts = ["10.0.0.2:8000", "10.0.0.1:8001", "10.0.0.10:8000", "10.0.0.9:8000"]
    index = _index(*hosts)
    for host in hosts:
        index.record_prefill(host, KEYS[:1])
    # Text order, not by address nor by the string read backwards.
    assert [m.host_ip_port for m in index.match(KEYS)] == sorted(hosts)


def test_p2p_one_peer_among_several_holders_of_the_first_miss() -> None:
    index = _index(A, B, C)
    index.record_prefill(A, [KEYS[0]])
    index.record_prefill(B, [KEYS[1], KEYS[2]])
    index.record_prefill(C, [KEYS[1], KEYS[3]])
    # B and C both hold A's first miss; B alone reaches block 2, and no one peer reaches block 3.
    assert index.match(KEYS[:4], 1)[0] == HostMatch(A, 1, 2, 3)


# ---- cluster: leader, followers, faults ----


def _cluster(**kwargs: object) -> SimKvcmCluster:
    cluster = SimKvcmCluster(["n0", "n1", "n2"], **kwargs)  # type: ignore[arg-type]
    for i, node in enumerate(cluster.node_ids):
        cluster.set_endpoint(node, f"127.0.1.{i + 1}", 6381)
    cluster.add_worker(A, 100)
    cluster.record_prefill(A, KEYS[:4])
    return cluster


QUERY = CacheQuery("inst", QueryType.PREFIX_MATCH, KEYS, trace_id="req-1")


def _info(cluster: SimKvcmCluster, node: str) -> bytes:
    return cluster.answer(node, paths.KVCM_GET_CLUSTER_INFO, decode.encode_cluster_info_request("inst", "t"))


def _state(cluster: SimKvcmCluster, node: str, query: CacheQuery = QUERY) -> bytes:
    return cluster.answer(node, paths.KVCM_GET_HOST_CACHE_STATE, decode.encode_cache_query(query))


def test_any_replica_answers_cluster_info_with_the_leader() -> None:
    cluster = _cluster()
    for node in cluster.node_ids:
        info = decode.decode_cluster_info(_info(cluster, node), node)
        assert info.self_node_id == node
        assert info.leader is not None
        assert (info.leader.node_id, info.leader.target) == ("n0", "127.0.1.1:6381")


def test_a_followers_cluster_info_names_the_leader_and_echoes_the_trace_id() -> None:
    cluster = _cluster()
    request = decode.encode_cluster_info_request("inst", "trace-1")
    info = kvcm_pb.GetClusterInfoResponse.FromString(cluster.answer("n1", paths.KVCM_GET_CLUSTER_INFO, request))
    assert (info.header.status.code, info.header.request_id) == (kvcm_pb.OK, "trace-1")
    assert (info.self_node_id, info.leader_node_id, info.leader_endpoint.node_id) == ("n1", "n0", "n0")
    assert (info.leader_endpoint.host, info.leader_endpoint.meta_rpc_port) == ("127.0.1.1", 6381)
    cluster.set_leader(None)
    request = decode.encode_cluster_info_request("inst", "trace-2")
    info = kvcm_pb.GetClusterInfoResponse.FromString(cluster.answer("n1", paths.KVCM_GET_CLUSTER_INFO, request))
    assert (info.header.status.code, info.header.request_id) == (kvcm_pb.OK, "trace-2")
    assert info.leader_node_id == "" and not info.HasField("leader_endpoint")


def test_no_leader_elected_cluster_wide_and_per_replica() -> None:
    cluster = _cluster()
    cluster.set_faults("n1", KvcmFaults(no_leader_elected=True))
    assert decode.decode_cluster_info(_info(cluster, "n1"), "n1").leader is None
    assert decode.decode_cluster_info(_info(cluster, "n2"), "n2").leader is not None
    cluster.set_leader(None)
    assert decode.decode_cluster_info(_info(cluster, "n0"), "n0").leader is None
    with pytest.raises(NotLeader, match="no leader elected"):
        decode.decode_cache_state(_state(cluster, "n0"), "n0", len(KEYS))


def test_leader_answers_queries_followers_say_not_leader() -> None:
    cluster = _cluster()
    state = decode.decode_cache_state(_state(cluster, "n0"), "n0", len(KEYS))
    assert state.hosts == (HostMatch(A, 4, 0, 4),)
    with pytest.raises(NotLeader) as caught:
        decode.decode_cache_state(_state(cluster, "n1"), "n1", len(KEYS))
    assert caught.value.code == kvcm_pb.SERVER_NOT_LEADER
    assert "leader is n0" in str(caught.value)


def test_leader_moves() -> None:
    cluster = _cluster()
    cluster.set_leader("n2")
    with pytest.raises(NotLeader):
        decode.decode_cache_state(_state(cluster, "n0"), "n0", len(KEYS))
    assert decode.decode_cache_state(_state(cluster, "n2"), "n2", len(KEYS)).hosts == (HostMatch(A, 4, 0, 4),)
    info = decode.decode_cluster_info(_info(cluster, "n0"), "n0")
    assert info.leader is not None and info.leader.target == "127.0.1.3:6381"


def test_followers_may_answer_queries() -> None:
    cluster = _cluster(followers_answer_queries=True)
    assert decode.decode_cache_state(_state(cluster, "n1"), "n1", len(KEYS)).hosts == (HostMatch(A, 4, 0, 4),)
    cluster.set_followers_answer_queries(False)
    with pytest.raises(NotLeader):
        decode.decode_cache_state(_state(cluster, "n1"), "n1", len(KEYS))


def test_p2p_host_count_reaches_the_index_and_trace_id_is_echoed() -> None:
    cluster = _cluster()
    cluster.add_worker(B, 100)
    cluster.record_prefill(B, KEYS[:6])
    query = CacheQuery("inst", QueryType.PREFIX_MATCH, KEYS, trace_id="req-9", p2p_host_count=2)
    raw = _state(cluster, "n0", query)
    state = decode.decode_cache_state(raw, "n0", len(query.block_keys))
    assert state.hosts == (HostMatch(B, 6, 0, 6), HostMatch(A, 4, 2, 6))
    reply = kvcm_pb.GetHostCacheStateResponse.FromString(raw)
    assert reply.header.request_id == "req-9"


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(_CHANGES, max_size=10),
    prompts=_PROMPTS,
    p2p=st.integers(0, 3),
)
def test_a_served_answer_is_the_stores_of_the_moment_and_echoes_its_trace_id(
    steps: list[tuple[str, str, list[int]]], prompts: list[list[int]], p2p: int
) -> None:
    """Through the wire: the same queries after every change and again right after, each with its
    own trace id (the serialised answers the cluster keeps must not carry one request's id to the next)."""
    cluster = SimKvcmCluster(["n0"])
    for host in _HOSTS:
        cluster.add_worker(host, 6)
    serial = 0
    for change in [*steps, ("clear", A, [])]:
        _apply(cluster, change)
        stores = {h: {k for k in range(8) if cluster.local_prefix(h, [k])} for h in _HOSTS}
        for keys in prompts + prompts:
            serial += 1
            query = CacheQuery(
                "inst", QueryType.PREFIX_MATCH, tuple(keys), trace_id=f"req-{serial}", p2p_host_count=p2p
            )
            raw = _state(cluster, "n0", query)
            assert decode.decode_cache_state(raw, "n0", len(keys)).hosts == _brute_force(stores, keys, p2p)
            assert kvcm_pb.GetHostCacheStateResponse.FromString(raw).header.request_id == f"req-{serial}"


def test_kept_answers_are_bounded() -> None:
    cluster = _cluster()
    for n in range(KEPT_ANSWERS * 3):
        query = CacheQuery("inst", QueryType.PREFIX_MATCH, (*KEYS[:4], 1000 + n), trace_id=f"req-{n}")
        state = decode.decode_cache_state(_state(cluster, "n0", query), "n0", len(query.block_keys))
        assert state.hosts == (HostMatch(A, 4, 0, 4),)
    assert cluster.kept_answers == KEPT_ANSWERS


def test_unsupported_query_type_and_unknown_instance() -> None:
    cluster = _cluster(instance_id="inst")
    batch = CacheQuery("inst", QueryType.BATCH_GET, KEYS)
    with pytest.raises(RemoteError, match="UNSUPPORTED"):
        decode.decode_cache_state(_state(cluster, "n0", batch), "n0", len(batch.block_keys))
    other = CacheQuery("other", QueryType.PREFIX_MATCH, KEYS)
    with pytest.raises(RemoteError, match="INSTANCE_NOT_EXIST"):
        decode.decode_cache_state(_state(cluster, "n0", other), "n0", len(other.block_keys))
    mamba = CacheQuery("inst", QueryType.PREFIX_MATCH_WITH_MAMBA, KEYS)
    state = decode.decode_cache_state(_state(cluster, "n0", mamba), "n0", len(mamba.block_keys))
    assert state.hosts == (HostMatch(A, 4, 0, 4),)


def test_error_code_fault_and_method_filter() -> None:
    cluster = _cluster()
    cluster.set_faults(
        "n0",
        KvcmFaults(error_code=kvcm_pb.INTERNAL_ERROR, methods=frozenset({paths.KVCM_GET_HOST_CACHE_STATE})),
    )
    with pytest.raises(RemoteError) as caught:
        decode.decode_cache_state(_state(cluster, "n0"), "n0", len(KEYS))
    assert (caught.value.code, caught.value.code_name) == (kvcm_pb.INTERNAL_ERROR, "INTERNAL_ERROR")
    assert not isinstance(caught.value, NotLeader)
    assert decode.decode_cluster_info(_info(cluster, "n0"), "n0").leader is not None  # not filtered in
    cluster.set_faults("n0", KvcmFaults(error_code=kvcm_pb.SERVICE_NOT_READY))
    with pytest.raises(RemoteError, match="SERVICE_NOT_READY"):
        decode.decode_cluster_info(_info(cluster, "n0"), "n0")


@pytest.mark.parametrize("garble", list(Garble))
def test_garbled_replies_fail_decoding(garble: Garble) -> None:
    cluster = _cluster()
    cluster.set_faults("n0", KvcmFaults(garbled=garble))
    with pytest.raises(GarbledReply):
        decode.decode_cluster_info(_info(cluster, "n0"), "n0")
    with pytest.raises(GarbledReply):
        decode.decode_cache_state(_state(cluster, "n0"), "n0", len(KEYS))
    if garble is Garble.CONTRACT:  # it does decode as protobuf: only the contract is broken
        kvcm_pb.GetClusterInfoResponse.FromString(_info(cluster, "n0"))
    cluster.clear_faults()
    assert decode.decode_cache_state(_state(cluster, "n0"), "n0", len(KEYS)).hosts == (HostMatch(A, 4, 0, 4),)


def test_plan_dead_hang_delay_and_method_filter() -> None:
    cluster = _cluster()
    replica = cluster.replica("n1")
    assert replica.plan(paths.KVCM_GET_CLUSTER_INFO, 0.0).abort is None
    cluster.set_faults("n1", KvcmFaults(dead=True, hang=True))
    abort = replica.plan(paths.KVCM_GET_CLUSTER_INFO, 0.0).abort
    assert abort is not None and abort.status is RpcStatus.UNAVAILABLE
    cluster.set_faults("n1", KvcmFaults(hang=True, methods=frozenset({paths.KVCM_GET_HOST_CACHE_STATE})))
    assert replica.plan(paths.KVCM_GET_HOST_CACHE_STATE, 0.0).hang
    assert not replica.plan(paths.KVCM_GET_CLUSTER_INFO, 0.0).hang
    cluster.set_faults("n1", KvcmFaults(delay_s=0.25))
    assert replica.plan(paths.KVCM_GET_CLUSTER_INFO, 0.0).delay_s == 0.25


def test_knob_changes_notify_subscribers() -> None:
    cluster = _cluster()
    woken: list[int] = []
    unsubscribe = cluster.subscribe(lambda: woken.append(1))
    cluster.set_faults("n0", KvcmFaults(hang=True))
    cluster.set_leader("n1")
    cluster.clear_faults()
    unsubscribe()
    cluster.set_leader("n0")
    assert len(woken) == 3


def test_bad_knobs_and_topology_name_the_field() -> None:
    with pytest.raises(ValueError, match="delay_s"):
        KvcmFaults(delay_s=-1)
    with pytest.raises(ValueError, match="error_code"):
        KvcmFaults(error_code=kvcm_pb.OK)
    with pytest.raises(ValueError, match="error_code"):
        KvcmFaults(error_code=12345)
    with pytest.raises(ValueError, match="methods"):
        KvcmFaults(methods=frozenset({paths.WORKER_GET_STATUS}))
    with pytest.raises(ValueError, match="garbled: must be a Garble"):
        KvcmFaults(garbled=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="node_ids"):
        SimKvcmCluster(["a", "a"])
    with pytest.raises(ValueError, match="node_id"):
        SimKvcmCluster(["a"], leader="b")
    with pytest.raises(ValueError, match="port"):
        SimKvcmCluster(["a"]).set_endpoint("a", "127.0.0.1", 0)


def test_bad_request_is_invalid_argument() -> None:
    cluster = _cluster()
    with pytest.raises(Exception, match="INVALID_ARGUMENT") as caught:
        cluster.answer("n0", paths.KVCM_GET_HOST_CACHE_STATE, b"\x0a\x7f")
    assert caught.value.status is RpcStatus.INVALID_ARGUMENT  # type: ignore[attr-defined]


# ---- in-memory server: faults on trio time ----


async def test_memory_hang_released_when_the_fault_clears(autojump_clock: trio.testing.MockClock) -> None:
    cluster = _cluster()
    network = MemoryNetwork()
    network.serve("kvcm", memory_handler(cluster.replica("n0")))
    client = KvcmClient(network)
    cluster.set_faults("n0", KvcmFaults(hang=True))
    stats = cluster.stats("n0")
    answered_at: list[float] = []

    async def query() -> None:
        await client.get_host_cache_state("kvcm", QUERY)
        answered_at.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(query)
        await trio.sleep(30)
        assert stats.get(paths.KVCM_GET_HOST_CACHE_STATE).in_flight == 1
        assert answered_at == []
        cluster.set_faults("n0", KvcmFaults(delay_s=0.5))  # no longer hung; now slow
    assert answered_at == [start + 30.5]
    assert stats.get(paths.KVCM_GET_HOST_CACHE_STATE) == MethodStats(calls=1, in_flight=0, peak_in_flight=1)


async def test_memory_unknown_method_is_unimplemented(autojump_clock: trio.testing.MockClock) -> None:
    cluster = _cluster()
    network = MemoryNetwork()
    network.serve("kvcm", memory_handler(cluster.replica("n0")))
    with pytest.raises(RemoteError, match="UNIMPLEMENTED"):
        await network.call("kvcm", paths.WORKER_GET_STATUS, b"")


def test_cluster_clear_worker_empties_its_cache() -> None:
    cluster = _cluster()
    assert cluster.local_prefix(A, KEYS) == 4
    cluster.clear_worker(A)
    assert cluster.local_prefix(A, KEYS) == 0
    assert decode.decode_cache_state(_state(cluster, "n0"), "n0", len(KEYS)).hosts == ()
