"""The scheduler's codecs (pure) and MasterConfig's validator."""

from __future__ import annotations

import json

import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.config import MasterConfig, MasterProtocol
from router.master_config import master_hosts, master_problems
from router.transport.errors import GarbledReply, RemoteError
from router.types import Role, RoleAddr
from router.wire import master_flexlb_pb2 as flexlb_pb
from router.wire.master import (
    CODE_NO_AVAILABLE_WORKER,
    MAX_MESSAGE_CHARS,
    MAX_REPLY_BYTES,
    MAX_ROLE_ADDRS,
    BadScheduleRequest,
    MasterBusinessError,
    MasterFallback,
    MasterInfo,
    MasterRouted,
    MasterScheduleRequest,
    decode_info_json,
    decode_schedule_json,
    decode_schedule_pb,
    encode_cancel_pb,
    encode_schedule_json,
    encode_schedule_pb,
    grpc_request_id,
    parse_cancel_pb,
    parse_schedule_json,
    parse_schedule_pb,
    schedule_json_parts,
)

HOST = "10.1.0.1:7001"


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def status(
    role: object = "PREFILL", ip: object = "10.0.0.1", http: object = 8000, **extra: object
) -> dict[str, object]:
    return {"role": role, "server_ip": ip, "http_port": http, **extra}


# ---- routed ----


@pytest.mark.parametrize(
    ("reported", "role"),
    [
        ("PREFILL", Role.PREFILL),
        ("RoleType.PREFILL", Role.PREFILL),
        ("ROLE_TYPE_PREFILL", Role.PREFILL),
        ("decode", Role.DECODE),
        ("ROLE_TYPE_VIT", Role.VIT),
        ("", Role.PDFUSION),
        (None, Role.PDFUSION),
    ],
)
def test_role_spellings(reported: str | None, role: Role) -> None:
    reply = decode_schedule_json(200, body(success=True, code=200, server_status=[status(reported)]), HOST)
    assert isinstance(reply, MasterRouted) and reply.role_addrs[0].role is role


def test_grpc_port_is_http_plus_one_when_absent_or_zero() -> None:
    entries = [status(http=8000), status(http=8100, grpc_port=None), status(http=8200, grpc_port=0),
               status(http=8300, grpc_port=9999)]
    reply = decode_schedule_json(200, body(success=True, code=200, server_status=entries), HOST)
    assert isinstance(reply, MasterRouted)
    assert [a.grpc_port for a in reply.role_addrs] == [8001, 8101, 8201, 9999]


def test_no_grpc_port_beside_http_port_65535_is_garbled_both_protocols() -> None:
    """http + 1 was taken as is: a worker at port 65536 went into the decision (and the sidecar's
    reply), where discovery refuses the same worker for its port."""
    entries = [status(http=65535, grpc_port=None)]
    with pytest.raises(GarbledReply, match=r"server_status\[0\]\.grpc_port: missing, and http_port \+ 1 = 65536"):
        decode_schedule_json(200, body(success=True, code=200, server_status=entries), HOST)
    entry = flexlb_pb.FlexlbServerStatusPB(role="PREFILL", server_ip="10.0.0.5", http_port=65535)
    pb = flexlb_pb.FlexlbScheduleResponsePB(code=200, server_status=[entry])
    with pytest.raises(GarbledReply, match=r"server_status\[0\]\.grpc_port: missing"):
        decode_schedule_pb(pb.SerializeToString(), HOST)
    entries = [status(http=65535, grpc_port=65534)]  # named: kept
    reply = decode_schedule_json(200, body(success=True, code=200, server_status=entries), HOST)
    assert isinstance(reply, MasterRouted) and reply.role_addrs[0].grpc_port == 65534


def test_a_worker_address_is_kept_in_discoverys_one_spelling_both_protocols() -> None:
    """Taken as written, an IPv6 address written out in full (as a Java scheduler writes it) or a host
    name in capitals named a worker discovery never lists: the shadow index recorded the master's
    answers under it, and never matched them."""
    entries = [status("PREFILL", "2001:DB8:0:0:0:0:0:5", 8000), status("DECODE", "Worker-1.Example.", 9000)]
    reply = decode_schedule_json(200, body(success=True, code=200, server_status=entries), HOST)
    assert isinstance(reply, MasterRouted)
    assert [a.ip for a in reply.role_addrs] == ["2001:db8::5", "worker-1.example"]
    entry = flexlb_pb.FlexlbServerStatusPB(role="PREFILL", server_ip="[2001:db8:0::5]", http_port=8000)
    pb = flexlb_pb.FlexlbScheduleResponsePB(code=200, server_status=[entry])
    grpc_reply = decode_schedule_pb(pb.SerializeToString(), HOST)
    assert isinstance(grpc_reply, MasterRouted) and grpc_reply.role_addrs[0].ip == "2001:db8::5"


def test_routed_keeps_order_master_and_queue_length() -> None:
    entries = [status("DECODE", "10.0.0.2", 9000), status("PREFILL", "10.0.0.1", 8000)]
    reply = decode_schedule_json(
        200, body(success=True, code=200, server_status=entries, real_master_host="1.2.3.4:7001", queue_length=3), HOST
    )
    assert reply == MasterRouted(
        (RoleAddr(Role.DECODE, "10.0.0.2", 9000, 9001), RoleAddr(Role.PREFILL, "10.0.0.1", 8000, 8001)),
        "1.2.3.4:7001",
        3,
    )


def test_a_worker_address_is_kept_without_spaces_or_url_brackets_both_protocols() -> None:
    """Taken as written, " 10.0.0.5 " would become the target " 10.0.0.5 :8000", and "[fd00::5]" a
    worker whose ip keeps its brackets."""
    entries = [status("PREFILL", " 10.0.0.5 ", 8000), status("DECODE", "[fd00::5]", 9000)]
    reply = decode_schedule_json(200, body(success=True, code=200, server_status=entries), HOST)
    assert isinstance(reply, MasterRouted)
    assert [a.ip for a in reply.role_addrs] == ["10.0.0.5", "fd00::5"]
    entry = flexlb_pb.FlexlbServerStatusPB(role="PREFILL", server_ip=" [fd00::6] ", http_port=8000)
    pb = flexlb_pb.FlexlbScheduleResponsePB(code=200, server_status=[entry])
    grpc_reply = decode_schedule_pb(pb.SerializeToString(), HOST)
    assert isinstance(grpc_reply, MasterRouted) and grpc_reply.role_addrs[0].ip == "fd00::6"


@pytest.mark.parametrize(
    ("reported", "kept"),
    [
        ("10.0.0.9:7001", "10.0.0.9:7001"),
        (" sched-a.example:7001 ", "sched-a.example:7001"),
        ("fd00::2:7001", "fd00::2:7001"),  # the scheduler joins an IPv6 address and its port unbracketed
        ("[fd00::2]:7001", "[fd00::2]:7001"),
        ("10.0.0.9", None),  # no port
        ("10.0.0.9:0", None),
        ("10.0.0.9:70000", None),
        ("10.0.0.9:" + "0" * 300 + "7001", None),  # a port, but longer than any host:port
        ("10.77.0.3:" + "9" * 5000, None),
        ("10.0.0.9; rm -rf /:7001", None),
        ("admin:secret@10.0.0.9:7001", None),
        ("x" * 65_000, None),
    ],
)
def test_a_master_address_that_is_no_host_and_port_is_absent_both_protocols_and_master_info(
    reported: str, kept: str | None
) -> None:
    """Its replica names no master (the reply is still an answer): a peer's text of up to a whole reply
    would otherwise be carried into the discovery snapshot and /debug/actors."""
    routed = decode_schedule_json(200, body(success=True, code=200, server_status=[], real_master_host=reported), HOST)
    assert routed == MasterRouted((), kept, None)
    pb = flexlb_pb.FlexlbScheduleResponsePB(success=True, code=200, real_master_host=reported)
    assert decode_schedule_pb(pb.SerializeToString(), HOST) == MasterRouted((), kept, 0)
    info = decode_info_json(200, body(success=True, code=200, real_master_host=reported), HOST)
    assert info == MasterInfo(kept, None)


def test_success_without_code_and_null_optionals() -> None:
    reply = decode_schedule_json(200, body(success=True, server_status=[], real_master_host=None), HOST)
    assert reply == MasterRouted((), None, None)


def test_a_failed_role_entry_fails_the_answer_with_its_code() -> None:
    entries = [status("DECODE"), {"role": "PREFILL", "success": False, "code": 8402, "message": "no prefill"}]
    reply = decode_schedule_json(200, body(success=True, code=200, server_status=entries), HOST)
    assert reply == MasterBusinessError(8402, "no prefill", 200)


@pytest.mark.parametrize("extra", [{}, {"code": None}, {"code": 0}, {"code": 200}])
def test_a_failed_role_entry_without_an_error_code_is_8400(extra: dict[str, object]) -> None:
    """A role the scheduler could not route fails the answer as an error of unknown code (no slave, no
    KVCM asked), not as an entry garbled for lack of a server_ip, nor as an error of code 200."""
    entries = [status("DECODE"), {"role": "PREFILL", "success": False, "message": "no prefill", **extra}]
    reply = decode_schedule_json(200, body(success=True, code=200, server_status=entries), HOST)
    assert reply == MasterBusinessError(CODE_NO_AVAILABLE_WORKER, "no prefill", 200)


# ---- fallback and business errors ----


def test_8600_is_a_fallback_whatever_the_http_status() -> None:
    for http_status in (500, 200):
        reply = decode_schedule_json(http_status, body(success=False, code=8600, error_message="FALLBACK"), HOST)
        assert reply == MasterFallback("FALLBACK", http_status)


@pytest.mark.parametrize("message", [{"detail": "why"}, 42, ["why"]], ids=["object", "number", "list"])
def test_an_error_whose_message_is_no_string_is_still_the_schedulers_error(message: object) -> None:
    """The code is the answer; the message only describes it. Garbled for its message, the scheduler's
    own error became a connection failure: the slave and KVCM asked, the breaker charged."""
    reply = decode_schedule_json(500, body(success=False, code=8400, error_message=message), HOST)
    assert reply == MasterBusinessError(8400, json.dumps(message), 500)
    long_message = {"detail": "x" * 5000}  # cut as a string is, its length told as it was
    reply = decode_schedule_json(500, body(success=False, code=8400, error_message=long_message), HOST)
    assert isinstance(reply, MasterBusinessError) and reply.message.endswith(f"{len(json.dumps(long_message))} chars]")
    entries = [{"role": "PREFILL", "success": False, "code": 8402, "message": message}]
    reply = decode_schedule_json(200, body(success=True, code=200, server_status=entries), HOST)
    assert reply == MasterBusinessError(8402, json.dumps(message), 200)


@pytest.mark.parametrize(("http_status", "code"), [(500, 8400), (400, 8406), (503, 8502), (500, 8503), (500, 7777)])
def test_business_errors(http_status: int, code: int) -> None:
    reply = decode_schedule_json(http_status, body(success=False, code=code, error_message="why"), HOST)
    assert reply == MasterBusinessError(code, "why", http_status)


@pytest.mark.parametrize("code", [8400, 8600])
def test_a_long_error_message_is_cut(code: int) -> None:
    """The message goes into every record of the decision: kept to MAX_MESSAGE_CHARS, as over gRPC."""
    reply = decode_schedule_json(500, body(success=False, code=code, error_message="x" * 1_000_000), HOST)
    assert isinstance(reply, MasterBusinessError | MasterFallback)
    assert len(reply.message) == MAX_MESSAGE_CHARS and reply.message.endswith("…[cut: 1000000 chars]")
    entry = {"role": "PREFILL", "success": False, "code": code, "message": "y" * 100_000}
    failed = decode_schedule_json(200, body(success=True, code=200, server_status=[entry]), HOST)
    assert isinstance(failed, MasterBusinessError) and len(failed.message) == MAX_MESSAGE_CHARS


# ---- no usable reply ----


@pytest.mark.parametrize("code", [-1, 2**31, 10**12])
def test_an_error_code_out_of_int32_range_is_garbled(code: int) -> None:
    with pytest.raises(GarbledReply, match="error code out of range"):
        decode_schedule_json(500, body(success=False, code=code, error_message="x"), HOST)
    with pytest.raises(GarbledReply, match="error code out of range"):
        decode_schedule_json(200, body(success=True, code=200, server_status=[status(success=False, code=code)]), HOST)


def test_a_negative_grpc_error_code_is_garbled() -> None:
    reply = flexlb_pb.FlexlbScheduleResponsePB(success=False, code=-8400, error_message="x")
    with pytest.raises(GarbledReply, match="error code out of range"):
        decode_schedule_pb(reply.SerializeToString(), HOST)


def test_more_role_entries_than_roles_exist_is_garbled() -> None:
    many = [status(ip=f"10.0.0.{i}") for i in range(MAX_ROLE_ADDRS + 1)]
    with pytest.raises(GarbledReply, match="server_status: 17 entries"):
        decode_schedule_json(200, body(success=True, code=200, server_status=many), HOST)
    reply = flexlb_pb.FlexlbScheduleResponsePB(
        success=True,
        code=200,
        server_status=[
            flexlb_pb.FlexlbServerStatusPB(role="PREFILL", server_ip=f"10.0.0.{i}", http_port=8000)
            for i in range(MAX_ROLE_ADDRS + 1)
        ],
    )
    with pytest.raises(GarbledReply, match="server_status: 17 entries"):
        decode_schedule_pb(reply.SerializeToString(), HOST)


def test_the_reply_bound_is_the_64_kib_the_design_states() -> None:
    assert MAX_REPLY_BYTES == 64 * 1024


def test_200_not_json_is_garbled() -> None:
    with pytest.raises(GarbledReply, match="not JSON"):
        decode_schedule_json(200, b"<html>", HOST)


def test_a_plain_text_500_is_no_available_worker() -> None:
    """The scheduler's exceptions answer plain text: a reply (not a connection failure) that fails the
    request with 8400, as the reference frontend does with an unparsable error body."""
    reply = decode_schedule_json(500, b"java.lang.NullPointerException", HOST)
    assert isinstance(reply, MasterBusinessError)
    assert (reply.code, reply.http_status) == (CODE_NO_AVAILABLE_WORKER, 500)
    assert "java.lang.NullPointerException" in reply.message


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        (b"null", "is JSON but not an object"),  # what an exception's null message prints as
        (b'{"status":500,"error":"Internal Server Error","path":"/rtp_llm/schedule"}', "has no code"),
        (b"[" * 3000, "is not JSON"),  # nested past the parser's recursion limit, within the size cap
    ],
)
def test_a_500_whose_error_body_the_scheduler_did_not_shape_is_no_available_worker(payload: bytes, said: str) -> None:
    """An unparsable error body is 8400 (the request fails; no slave, no KVCM), not a connection failure."""
    reply = decode_schedule_json(500, payload, HOST)
    assert isinstance(reply, MasterBusinessError)
    assert (reply.code, reply.http_status) == (CODE_NO_AVAILABLE_WORKER, 500)
    assert said in reply.message


def test_json_nested_past_the_parsers_recursion_limit_is_garbled_not_a_crash() -> None:
    nested = b"[" * 3000
    with pytest.raises(GarbledReply, match="not JSON"):
        decode_schedule_json(200, nested, HOST)
    with pytest.raises(GarbledReply, match="not JSON"):
        decode_info_json(200, nested, HOST)
    with pytest.raises(GarbledReply, match="not an object"):
        decode_schedule_json(502, b"null", HOST)  # not the scheduler's 500: no reply from it
    with pytest.raises(BadScheduleRequest, match="body: not JSON"):
        parse_schedule_json(nested)


@pytest.mark.parametrize("http_status", [404, 502, 503, 504])
def test_another_status_whose_body_is_not_json_is_no_reply_from_the_scheduler(http_status: int) -> None:
    """A proxy's error page, or a host that is no scheduler: the slave and then KVCM are tried."""
    with pytest.raises(RemoteError) as caught:
        decode_schedule_json(http_status, b"<html>Bad Gateway</html>", HOST)
    assert caught.value.code_name == f"http:{http_status}"


def test_a_lone_surrogate_in_a_schedulers_text_is_replaced_not_carried() -> None:
    """JSON's \\ud800 decodes to a lone surrogate, which no UTF-8 wire takes: a scheduler's error message
    so made failed the sidecar's reply to its caller (an UNKNOWN status, counted answered)."""
    decoded = decode_schedule_json(500, b'{"success":false,"code":8400,"error_message":"a\\ud800b"}', HOST)
    assert isinstance(decoded, MasterBusinessError) and decoded.message == "a?b"
    decoded.message.encode("utf-8")


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"[1, 2]", "not an object"),
        (body(success=True, code=200, server_status="x"), "server_status"),
        (body(success=True, code=200, server_status=5), "server_status"),
        (body(success=True, code=200, server_status=True), "server_status"),
        (body(success=True, code=200, server_status=["x"]), "server_status[0]"),
        (body(success=True, code=200, server_status=[status(ip="")]), "server_status[0].server_ip"),
        (body(success=True, code=200, server_status=[status(ip="10.0.0.1; rm")]), "server_status[0].server_ip"),
        (body(success=True, code=200, server_status=[status(ip="h" * 300)]), "server_status[0].server_ip"),
        # An IPv6 zone id takes any text but "%" and "/": a peer's newlines and kilobytes came through it.
        (body(success=True, code=200, server_status=[status(ip="fe80::1%x\n<log line>" + "A" * 3000)]), "server_ip"),
        (body(success=True, code=200, server_status=[status(ip="fe80::1%\ud800")]), "server_status[0].server_ip"),
        (body(success=True, code=200, server_status=[status(http=0)]), "server_status[0].http_port"),
        (body(success=True, code=200, server_status=[status(http="80")]), "server_status[0].http_port"),
        (body(success=True, code=200, server_status=[status(http=None)]), "server_status[0].http_port"),
        # JSON true is no integer, though Python's bool is one: not port 1, nor error code 1.
        (body(success=True, code=200, server_status=[status(http=True)]), "server_status[0].http_port"),
        (body(success=True, code=200, server_status=[status(grpc_port=True)]), "server_status[0].grpc_port"),
        (body(success=False, code=True), "code"),
        (body(success=True, code=200, server_status=[status(grpc_port=70000)]), "server_status[0].grpc_port"),
        (body(success=True, code=200, server_status=[status("FRONTEND")]), "server_status[0].role"),
        # Only an empty role is PDFUSION; a text that reduces to no name was taken as it, and upper-casing
        # read a dotless "ı" as "I".
        (body(success=True, code=200, server_status=[status("RoleType.")]), "server_status[0].role"),
        (body(success=True, code=200, server_status=[status("prefıll")]), "server_status[0].role"),
        (body(success=True, code=200, server_status=[], queue_length="many"), "queue_length"),
        (body(success=True, code="200"), "code"),
    ],
)
def test_broken_fields_are_garbled_naming_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(GarbledReply, match=field.replace("[", r"\[").replace("]", r"\]")):
        decode_schedule_json(200, payload, HOST)


def test_the_schedulers_failure_without_a_code_is_8400_both_protocols() -> None:
    """The reference frontend takes an error of unknown code as 8400: the scheduler's own 200 saying
    success false, or its gRPC reply with success false and no code, ended as garbled (no reply), so
    the slave and then KVCM were asked and the breaker counted a failure."""
    reply = decode_schedule_json(200, body(success=False, error_message="no route"), HOST)
    assert isinstance(reply, MasterBusinessError) and reply.code == CODE_NO_AVAILABLE_WORKER
    pb = flexlb_pb.FlexlbScheduleResponsePB(success=False, error_message="no route")
    grpc_reply = decode_schedule_pb(pb.SerializeToString(), HOST)
    assert grpc_reply == MasterBusinessError(CODE_NO_AVAILABLE_WORKER, "no route", None)
    # Such a body under another status is a proxy's or another host's, not the scheduler's: no reply.
    with pytest.raises(GarbledReply, match="code"):
        decode_schedule_json(503, body(success=False, error_message="x"), HOST)


@pytest.mark.parametrize("http_status", [200, 500])
def test_code_0_is_no_code_over_http_as_over_grpc(http_status: int) -> None:
    """A Java scheduler's int code never set reads 0: over gRPC it is proto3's no code, and over HTTP
    it was garbled, so the same answer asked the slave and KVCM and counted a breaker failure."""
    failed = decode_schedule_json(http_status, body(success=False, code=0, error_message="no route"), HOST)
    pb = flexlb_pb.FlexlbScheduleResponsePB(success=False, code=0, error_message="no route")
    assert isinstance(failed, MasterBusinessError) and failed.code == CODE_NO_AVAILABLE_WORKER
    assert decode_schedule_pb(pb.SerializeToString(), HOST) == MasterBusinessError(
        CODE_NO_AVAILABLE_WORKER, "no route", None
    )
    if http_status == 200:
        routed = decode_schedule_json(200, body(success=True, code=0, server_status=[status()]), HOST)
        assert isinstance(routed, MasterRouted) and routed.role_addrs


def test_code_200_under_a_5xx_is_not_routed() -> None:
    with pytest.raises(RemoteError):
        decode_schedule_json(503, body(success=True, code=200, server_status=[]), HOST)


# ---- master/info ----


def test_info_decodes() -> None:
    reply = body(success=True, code=200, real_master_host="10.1.0.2:7001", pod_ip="10.1.0.1", queue_length=4)
    assert decode_info_json(200, reply, HOST) == MasterInfo("10.1.0.2:7001", 4, "10.1.0.1", None)


def test_info_failure_and_garbage() -> None:
    with pytest.raises(RemoteError):
        decode_info_json(500, body(success=False, code=8400, error_message="x"), HOST)
    with pytest.raises(RemoteError, match="not ready"):  # a 200 saying it failed is no answer
        decode_info_json(200, body(success=False, code=8400, error_message="not ready"), HOST)
    with pytest.raises(RemoteError, match="not ready") as caught:  # nor is one carrying an error code
        decode_info_json(200, body(code=8400, error_message="not ready"), HOST)
    assert caught.value.code == 8400
    with pytest.raises(RemoteError) as caught:  # a code that is not success's is carried as given
        decode_info_json(200, body(success=True, code=0, real_master_host="10.0.0.1:7001"), HOST)
    assert caught.value.code == 0
    with pytest.raises(GarbledReply):
        decode_info_json(200, b"nope", HOST)


# ---- request encoding, both protocols ----


def test_json_request_fields() -> None:
    request = MasterScheduleRequest("r-1", (1, -2), 64, 128, None, 5000, 1_700_000_000_000)
    assert json.loads(encode_schedule_json(request)) == {
        "request_id": "r-1",
        "block_cache_keys": [1, -2],
        "block_size": 64,
        "seq_len": 128,
        "generate_timeout": 5000,
        "request_time_ms": 1_700_000_000_000,
    }
    with_ids = MasterScheduleRequest("r-2", seq_len=3, input_ids=(5, 6, 7))
    sent = json.loads(encode_schedule_json(with_ids))
    assert sent["input_ids"] == [5, 6, 7] and "block_size" not in sent
    assert parse_schedule_json(encode_schedule_json(with_ids)) == with_ids


@given(
    keys=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40),
    ids=st.one_of(st.none(), st.lists(st.integers(0, 2**31 - 1), max_size=40)),
    slice_items=st.integers(1, 50),
)
def test_the_body_in_slices_is_the_body_at_once(keys: list[int], ids: list[int] | None, slice_items: int) -> None:
    request = MasterScheduleRequest(
        "r", tuple(keys), 64 if keys else None, 64 * len(keys) or 1, None if ids is None else tuple(ids), 5000, 1
    )
    joined = b"".join(schedule_json_parts(request, slice_items))
    assert json.loads(joined) == json.loads(encode_schedule_json(request))
    assert parse_schedule_json(joined) == request


def test_numpy_integer_ids_are_written_as_the_ints_they_stand_for() -> None:
    request = MasterScheduleRequest("r", seq_len=3, input_ids=tuple(numpy.array([5, 6, 7], dtype=numpy.int64)))
    assert json.loads(encode_schedule_json(request))["input_ids"] == [5, 6, 7]


def test_server_side_rejects_keys_without_block_size() -> None:
    with pytest.raises(BadScheduleRequest, match="block_size"):
        parse_schedule_json(body(request_id="x", block_cache_keys=[1]))
    with pytest.raises(BadScheduleRequest, match="request_id"):
        parse_schedule_json(body(request_id=" "))
    assert parse_schedule_json(body(request_id=42)).request_id == "42"


@pytest.mark.parametrize(("raw", "request_id"), [(b"42", "42"), (b"12.0", "12"), (b"1e3", "1000"), (b"-0.0", "0")])
def test_server_side_coerces_a_json_number_request_id_to_the_integers_text(raw: bytes, request_id: str) -> None:
    assert parse_schedule_json(b'{"request_id": ' + raw + b"}").request_id == request_id


@pytest.mark.parametrize("raw", [b"12.5", b"NaN", b"Infinity", b"1e400"])
def test_server_side_refuses_a_request_id_number_that_is_no_whole_one(raw: bytes) -> None:
    with pytest.raises(BadScheduleRequest, match="request_id"):
        parse_schedule_json(b'{"request_id": ' + raw + b"}")


@given(st.text(min_size=1, max_size=40))
def test_grpc_request_id_is_a_stable_non_negative_int64(request_id: str) -> None:
    value = grpc_request_id(request_id)
    assert 0 <= value < 2**63 and value == grpc_request_id(request_id)


def test_grpc_request_id_keeps_numeric_ids() -> None:
    assert grpc_request_id("12345") == 12345
    assert grpc_request_id(str(2**63)) != 2**63


def test_grpc_request_fields() -> None:
    request = MasterScheduleRequest("77", (1, 2, 3), 16, 48, None, 9000, 123)
    sent = flexlb_pb.FlexlbScheduleRequestPB.FromString(encode_schedule_pb(request))
    assert (sent.request_id, list(sent.block_cache_keys), sent.cache_key_block_size) == (77, [1, 2, 3], 16)
    assert (sent.seq_len, sent.generate_timeout, sent.request_time_ms, sent.forward_hop) == (48, 9000, 123, 0)
    number, parsed = parse_schedule_pb(encode_schedule_pb(request))
    assert number == 77 and parsed == request


def test_grpc_reply_decoding() -> None:
    reply = flexlb_pb.FlexlbScheduleResponsePB(success=True, code=200, real_master_host="", queue_length=2)
    reply.server_status.add(role="RoleType.DECODE", server_ip="10.0.0.2", http_port=9000)
    reply.server_status.add(role="", server_ip="10.0.0.3", http_port=9100, grpc_port=9200)
    assert decode_schedule_pb(reply.SerializeToString(), HOST) == MasterRouted(
        (RoleAddr(Role.DECODE, "10.0.0.2", 9000, 9001), RoleAddr(Role.PDFUSION, "10.0.0.3", 9100, 9200)), None, 2
    )
    error = flexlb_pb.FlexlbScheduleResponsePB(success=False, code=8503, error_message="queue timeout")
    assert decode_schedule_pb(error.SerializeToString(), HOST) == MasterBusinessError(8503, "queue timeout", None)
    with pytest.raises(GarbledReply):
        decode_schedule_pb(b"\x0a\x7f", HOST)
    broken = flexlb_pb.FlexlbScheduleResponsePB(success=True, code=200)
    broken.server_status.add(role="PREFILL", server_ip="10.0.0.1", http_port=0)
    with pytest.raises(GarbledReply, match=r"server_status\[0\].http_port"):
        decode_schedule_pb(broken.SerializeToString(), HOST)
    chatty = flexlb_pb.FlexlbScheduleResponsePB(success=False, code=8503, error_message="e" * 1_000_000)
    decoded = decode_schedule_pb(chatty.SerializeToString(), HOST)
    assert isinstance(decoded, MasterBusinessError) and decoded.code == 8503
    assert len(decoded.message) == MAX_MESSAGE_CHARS and decoded.message.endswith("…[cut: 1000000 chars]")
    bracketed = flexlb_pb.FlexlbScheduleResponsePB(success=True, code=200)
    bracketed.server_status.add(role="PREFILL", server_ip=" [::1] ", http_port=8000)
    assert isinstance(decode_schedule_pb(bracketed.SerializeToString(), HOST), MasterRouted)
    long_ip = flexlb_pb.FlexlbScheduleResponsePB(success=True, code=200)
    long_ip.server_status.add(role="PREFILL", server_ip="x" * 100_000, http_port=8000)
    with pytest.raises(GarbledReply, match=r"server_status\[0\].server_ip: not an IP address or host name") as raised:
        decode_schedule_pb(long_ip.SerializeToString(), HOST)
    assert len(str(raised.value)) < 300  # the peer's text is shown cut, not whole


def test_grpc_cancel_reason() -> None:
    assert parse_cancel_pb(encode_cancel_pb("9", deadline_exceeded=True)) == (9, True)
    assert parse_cancel_pb(encode_cancel_pb("9", deadline_exceeded=False)) == (9, False)


# ---- MasterConfig ----


def test_default_config_is_valid_and_off() -> None:
    config = MasterConfig()
    assert master_problems(config) == []
    assert (master_hosts(config), config.protocol, config.transport_timeout_ms) == ((), MasterProtocol.HTTP, 200.0)
    assert (config.discovery_interval_s, config.discovery_timeout_s) == (1.0, 0.5)
    assert (config.discovery_failure_threshold, config.discovery_drop_after_s) == (2, 30.0)
    # The reference frontend's default: a queue longer than 100,000 rejects up front.
    assert config.queue_length_reject_threshold == 100_000


def test_a_bare_host_takes_the_default_port_and_an_explicit_one_is_kept() -> None:
    config = MasterConfig(hosts="10.0.0.1, 10.0.0.2:7005, [::1], sched.example")
    assert master_problems(config) == []
    assert master_hosts(config) == ("10.0.0.1:7001", "10.0.0.2:7005", "[::1]:7001", "sched.example:7001")
    # The default port counts when duplicates are found.
    assert [p.message for p in master_problems(MasterConfig(hosts="10.0.0.1,10.0.0.1:7001"))] == [
        "'10.0.0.1:7001' is listed twice"
    ]


def test_a_host_list_of_separators_alone_is_refused() -> None:
    """Given, it counted as a scheduler configured: its breaker's rules were applied to a router
    whose assessment said there was no scheduler."""
    assert [(p.fields, p.message) for p in master_problems(MasterConfig(hosts=" , ,"))] == [
        (("hosts",), "names no entry, only separators (' , ,')")
    ]


def test_problems_name_every_bad_field() -> None:
    config = MasterConfig(
        hosts="10.0.0.1:7001, 10.0.0.1:7001,bad host,10.0.0.2:65534",
        protocol=MasterProtocol.GRPC,
        transport_timeout_ms=0,
        discovery_interval_s=-1,
        discovery_timeout_s=0,
        discovery_failure_threshold=0,
        discovery_drop_after_s=0,
        queue_length_reject_threshold=-5,
        http_max_connections=0,
    )
    found = master_problems(config)
    fields = [name for p in found for name in p.fields]
    assert fields.count("hosts") == 3
    assert set(fields) == {
        "hosts",
        "protocol",  # with the port + 2 beyond 65535
        "transport_timeout_ms",
        "discovery_interval_s",
        "discovery_timeout_s",
        "discovery_failure_threshold",
        "discovery_drop_after_s",
        "queue_length_reject_threshold",
        "http_max_connections",
    }
    messages = " | ".join(p.message for p in found)
    assert "listed twice" in messages and "'bad host'" in messages and "65534" in messages


def test_a_port_whose_grpc_port_does_not_exist_is_refused_only_for_the_grpc_protocol() -> None:
    """Over HTTP nothing is sent to port + 2: a scheduler on port 65534 was refused all the same."""
    assert master_problems(MasterConfig(hosts="10.0.0.2:65534,10.0.0.3:65535")) == []
    refused = master_problems(MasterConfig(hosts="10.0.0.2:65533,10.0.0.3:65534", protocol=MasterProtocol.GRPC))
    assert [(p.fields, "65534" in p.message) for p in refused] == [(("hosts", "protocol"), True)]
