"""``WorkerAddr`` keeps its hash from construction: equal addresses hash equal however they were
built (constructor, ``from_http``, ``replace``, copy, pickle, the decision log's decoder), and the
stored hash shows nowhere a user reads an address (``repr``, ``fields``/``asdict``, the /debug JSON,
``kvroute route --json``, the decision log and replay records), pinned here as they print. Also what
an address's status target and a reported task's uncached tokens are."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

from hypothesis import given
from hypothesis import strategies as st

from router.debug_http import to_jsonable
from router.decision_record import decision_fields, decode_fleet, encode_fleet
from router.policy.plan import Fleet
from router.route_cli import decision_json
from router.types import (
    CandidateExplain,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouteSource,
    SourceOutcome,
    SourceStep,
    SplitMode,
    Stage,
    StageWindow,
    TaskInfo,
    WorkerAddr,
)

ADDR = WorkerAddr.from_http("10.0.0.7", 8000)
DECISION = RouteDecision(
    request_id="r1",
    worker=ADDR,
    role=Role.PREFILL,
    route_source=RouteSource.KVCM,
    reason=Reason.CACHE_LEADER,
    hit_tokens=32,
    local_blocks=2,
    elapsed_ms=1.5,
    stage_ms={Stage.TOTAL: 1.5},
)


def copies(addr: WorkerAddr) -> list[WorkerAddr]:
    """``addr`` rebuilt every way the code or a user's tools may rebuild one."""
    return [
        WorkerAddr(addr.ip, addr.http_port, addr.grpc_port, addr.status_port),
        WorkerAddr(ip=addr.ip, http_port=addr.http_port, grpc_port=addr.grpc_port, status_port=addr.status_port),
        dataclasses.replace(addr),
        dataclasses.replace(addr, ip=addr.ip),
        copy.copy(addr),
        copy.deepcopy(addr),
        *(pickle.loads(pickle.dumps(addr, protocol)) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)),
    ]


def test_the_address_prints_its_four_fields_only() -> None:
    assert repr(ADDR) == "WorkerAddr(ip='10.0.0.7', http_port=8000, grpc_port=8001, status_port=8001)"
    assert [f.name for f in dataclasses.fields(ADDR)] == ["ip", "http_port", "grpc_port", "status_port"]
    assert dataclasses.asdict(ADDR) == {"ip": "10.0.0.7", "http_port": 8000, "grpc_port": 8001, "status_port": 8001}
    assert dataclasses.astuple(ADDR) == ("10.0.0.7", 8000, 8001, 8001)
    assert WorkerAddr.__match_args__ == ("ip", "http_port", "grpc_port", "status_port")
    assert not hasattr(ADDR, "__dict__")


def test_a_decision_holding_an_address_prints_as_before() -> None:
    assert repr(DECISION).startswith(
        "RouteDecision(request_id='r1', worker=WorkerAddr(ip='10.0.0.7', http_port=8000, grpc_port=8001, "
        "status_port=8001), role=<Role.PREFILL: 'PREFILL'>, "
    )
    # /debug/decisions and the actors' health snapshots
    assert json.dumps(to_jsonable(DECISION), sort_keys=True) == (
        '{"candidates": [], "elapsed_ms": 1.5, "error": null, "error_code": 0, "hit_tokens": 32, '
        '"local_blocks": 2, "reason": "CACHE_LEADER", "request_id": "r1", "role": "PREFILL", "role_addrs": [], '
        '"route_source": "kvcm", "sources": [], "split": null, "stage_ms": {"total": 1.5}, "windows": [], '
        '"worker": {"grpc_port": 8001, "http_port": 8000, "ip": "10.0.0.7", "status_port": 8001}}'
    )
    # kvroute route --json
    assert json.dumps(decision_json(DECISION), sort_keys=True) == (
        '{"candidates": [], "elapsed_ms": 1.5, "error": null, "error_code": 0, "error_message": "", '
        '"grpc_port": 8001, "hit_tokens": 32, "http_port": 8000, "ip": "10.0.0.7", "local_blocks": 2, '
        '"reason": "CACHE_LEADER", "request_id": "r1", "role": "PREFILL", "role_addrs": [], '
        '"route_source": "kvcm", "sources": [], "split": null, "stage_ms": {"total": 1.5}, "windows": []}'
    )
    # the decision log's and the replay's record of a decision
    assert json.dumps(decision_fields(DECISION)) == (
        '{"w": "10.0.0.7:8000", "r": "CACHE_LEADER", "rs": "kvcm", "ra": [], "ch": [], "c": [], "hit": 32, '
        '"ec": 0, "sm": null, "sw": []}'
    )


def test_the_decision_logs_fleet_frame_round_trips() -> None:
    other = WorkerAddr("10.0.0.8", 8000, 9001, 9100)
    payload = encode_fleet(3, Fleet.of([ADDR, other]))
    assert json.dumps(payload) == '{"f": 3, "w": [["10.0.0.7", 8000, 8001, 8001], ["10.0.0.8", 8000, 9001, 9100]]}'
    decoded = decode_fleet(json.loads(json.dumps(payload)))
    assert decoded.workers == (ADDR, other)
    assert {ADDR: "a", other: "b"}[decoded.workers[1]] == "b"


@given(
    ip=st.text(min_size=1, max_size=20),
    http_port=st.integers(1, 65535),
    offset=st.integers(-100, 100),
    status_port=st.none() | st.integers(1, 65535),
)
def test_equal_addresses_hash_equal_however_built(
    ip: str, http_port: int, offset: int, status_port: int | None
) -> None:
    addr = WorkerAddr.from_http(ip, http_port, grpc_port_offset=offset, status_port=status_port)
    # The value the generated hash gave, so sets and dicts of addresses behave as they did.
    assert hash(addr) == hash((addr.ip, addr.http_port, addr.grpc_port, addr.status_port))
    cache = {addr: "status"}
    for rebuilt in copies(addr):
        assert rebuilt == addr
        assert hash(rebuilt) == hash(addr)
        assert cache[rebuilt] == "status"
        assert repr(rebuilt) == repr(addr)


def test_a_changed_copy_hashes_as_its_own_fields() -> None:
    moved = dataclasses.replace(ADDR, status_port=9100)
    assert moved != ADDR
    assert hash(moved) == hash(WorkerAddr("10.0.0.7", 8000, 8001, 9100))
    assert hash(moved) == hash(("10.0.0.7", 8000, 8001, 9100))
    assert {ADDR, moved, WorkerAddr.from_http("10.0.0.7", 8000, status_port=9100)} == {ADDR, moved}


def test_a_copied_or_pickled_decision_keeps_a_hashable_worker() -> None:
    for rebuilt in (copy.deepcopy(DECISION), pickle.loads(pickle.dumps(DECISION))):
        assert rebuilt == DECISION
        assert rebuilt.worker is not None
        assert hash(rebuilt.worker) == hash(ADDR)
        assert rebuilt.worker == ADDR


def test_a_drawn_answer_given_to_a_request_keeps_every_other_field() -> None:
    drawn = RouteDecision(
        request_id="drawn",
        worker=ADDR,
        role=Role.PREFILL,
        route_source=RouteSource.DOMAIN,
        reason=Reason.OVERLOADED,
        hit_tokens=16,
        local_blocks=1,
        elapsed_ms=0.5,
        stage_ms={Stage.CACHE_QUERY: 0.25},
        candidates=(CandidateExplain(ADDR.http_target, "hot", 1, 16, 10, "PREFILL", None, chosen=True),),
        error="why",
        sources=(SourceStep(RouteSource.DOMAIN, SourceOutcome.ANSWERED, Reason.OVERLOADED, 0.1),),
        role_addrs=(RoleAddr(Role.PREFILL, "10.0.0.7", 8000, 8001),),
        error_code=7,
        split=SplitMode.FIXED,
        windows=(StageWindow(Stage.CACHE_QUERY, 1.0, cut=False),),
    )
    # The fixture sets every field away from its default, so a field added later and not passed on
    # by answering() fails here.
    for f in dataclasses.fields(RouteDecision):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert getattr(drawn, f.name) != default, f.name
    given = drawn.answering("r9", 2.5)
    assert given == dataclasses.replace(drawn, request_id="r9", elapsed_ms=2.5, stage_ms={Stage.TOTAL: 2.5})


def test_the_status_target_is_on_the_status_port() -> None:
    addr = WorkerAddr.from_http("10.0.0.1", 8000, 1, 9999)
    assert (addr.grpc_target, addr.status_target) == ("10.0.0.1:8001", "10.0.0.1:9999")
    assert WorkerAddr.from_http("10.0.0.1", 8000).status_target == "10.0.0.1:8001"  # none given: the gRPC port


def test_a_waiting_task_costs_its_uncached_input_whatever_it_reports_remaining() -> None:
    waiting = TaskInfo("t1", input_length=100, prefix_length=30, is_waiting=True, remaining_prefill_tokens=5)
    assert waiting.uncached_tokens == 70


def test_a_running_task_costs_what_remains_of_its_prefill_never_below_zero() -> None:
    running = TaskInfo("t2", input_length=100, prefix_length=30, is_waiting=False, remaining_prefill_tokens=5)
    assert running.uncached_tokens == 5
    overrun = TaskInfo("t3", input_length=100, prefix_length=30, is_waiting=False, remaining_prefill_tokens=-7)
    assert overrun.uncached_tokens == 0
