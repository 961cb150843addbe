"""The central scheduler ("master"): request and reply values, and their codecs (pure, no I/O).

``schedule()`` on any ``MasterTransport`` returns a ``MasterReply`` for every answer the
scheduler gave in its own protocol — routed, an explicit fallback (8600) or a business
error code — and raises a ``TransportError`` for every attempt that got no usable reply
(refused, reset, timeout, a 200 whose body is not JSON, a non-JSON 5xx, a broken field).
What to do with each is the caller's policy; the decoders only state facts.

Both directions are here (client encode/decode, server decode/encode) so the simulated
scheduler speaks exactly what the adapters read.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from router.targets import TargetError, format_target, is_host, parse_target
from router.transport.errors import GarbledReply, RemoteError
from router.types import Role, RoleAddr, cut_text
from router.wire import master_flexlb_pb2 as flexlb_pb
from router.wire.decode import MAX_HOST_PORT_CHARS

CODE_OK = 200
CODE_NO_AVAILABLE_WORKER = 8400  # also the code of a per-role failure that names no error code
CODE_INVALID_REQUEST = 8406
CODE_QUEUE_TIMEOUT = 8503  # a queueing scheduler's answer once the call's generate_timeout has passed
CODE_FALLBACK = 8600  # "route by yourself"
DEFAULT_GENERATE_TIMEOUT_MS = 3_600_000
# Roles a scheduler may name in an answer.
MASTER_ROLES = (Role.PDFUSION, Role.DECODE, Role.PREFILL, Role.VIT)
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class MasterScheduleRequest:
    """One schedule call. ``block_size`` is required when ``block_cache_keys`` is non-empty."""

    request_id: str
    block_cache_keys: tuple[int, ...] = ()
    block_size: int | None = None
    seq_len: int = 0
    input_ids: tuple[int, ...] | None = None  # only when there are no keys; HTTP only
    generate_timeout_ms: int = DEFAULT_GENERATE_TIMEOUT_MS
    request_time_ms: int = 0  # epoch ms when the frontend received the request


@dataclass(frozen=True, slots=True)
class MasterRouted:
    """The scheduler named a worker per role, in its order (roles it did not name are absent)."""

    role_addrs: tuple[RoleAddr, ...]
    real_master_host: str | None
    queue_length: int | None


@dataclass(frozen=True, slots=True)
class MasterFallback:
    """Code 8600: the scheduler asks the frontend to route by itself."""

    message: str
    http_status: int | None  # None over gRPC
    code: int = CODE_FALLBACK


@dataclass(frozen=True, slots=True)
class MasterBusinessError:
    """Any other error code (8400, 8402-8406, 8502-8504, unknown codes): the request fails with it."""

    code: int
    message: str
    http_status: int | None  # None over gRPC


MasterReply = MasterRouted | MasterFallback | MasterBusinessError


@dataclass(frozen=True, slots=True)
class MasterInfo:
    """A ``/rtp_llm/master/info`` answer: which replica the scheduler replicas elected."""

    real_master_host: str | None
    queue_length: int | None
    pod_ip: str | None = None
    instance_ip: str | None = None


# --- roles and ids ------------------------------------------------------------------------


def parse_master_role(reported: str, field: str, target: str) -> Role:
    """ "PREFILL", "RoleType.PREFILL", "ROLE_TYPE_PREFILL"; empty means PDFUSION."""
    text = reported.strip()
    if not text:
        return Role.PDFUSION
    # ASCII alone: str.upper() maps a dotless "ı" to "I", and "prefıll" read as PREFILL. A text that
    # reduces to no name ("RoleType.", "ROLE_TYPE_") is no role; only an empty one means PDFUSION.
    name = text.rpartition(".")[2].upper().removeprefix("ROLE_TYPE_") if text.isascii() else ""
    if not name:
        raise GarbledReply(target, f"{field}: unknown role {reported!r}")
    try:
        role = Role(name)
    except ValueError:
        role = Role.UNKNOWN
    if role not in MASTER_ROLES:
        raise GarbledReply(target, f"{field}: unknown role {reported!r}")
    return role


def grpc_request_id(request_id: str) -> int:
    """The gRPC API's int64 request id: the id itself if it is a non-negative int64, else a stable hash."""
    text = request_id.strip()
    if text.isascii() and text.isdigit() and int(text) <= _INT64_MAX:
        return int(text)
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & _INT64_MAX


# --- HTTP JSON: client side ---------------------------------------------------------------


def encode_schedule_json(request: MasterScheduleRequest) -> bytes:
    """The schedule call's JSON body, at once (see :func:`schedule_json_parts` for a long prompt)."""
    return b"".join(schedule_json_parts(request, schedule_json_items(request)))


def schedule_json_items(request: MasterScheduleRequest) -> int:
    """How many array items (keys and token ids) the schedule body holds: what its encoding costs."""
    return len(request.block_cache_keys) + len(request.input_ids or ())


def schedule_json_parts(request: MasterScheduleRequest, slice_items: int) -> Iterator[bytes]:
    """The schedule call's JSON body in parts to join, each array in slices of at most ``slice_items``
    items: a caller may pause between two parts, since the ids of a prompt of the longest allowed
    length take tens of milliseconds to encode in one go. Integers of other types (numpy's) are
    written as the Python ints they stand for."""
    head: dict[str, object] = {
        "request_id": request.request_id,
        "seq_len": request.seq_len,
        "generate_timeout": request.generate_timeout_ms,
        "request_time_ms": request.request_time_ms,
    }
    if request.block_size is not None:
        head["block_size"] = request.block_size
    yield json.dumps(head, separators=(",", ":"))[:-1].encode()  # the object stays open for the arrays
    step = max(1, slice_items)
    for name, values in (("block_cache_keys", request.block_cache_keys), ("input_ids", request.input_ids)):
        if values is None:
            continue
        yield f',"{name}":['.encode()
        for start in range(0, len(values), step):
            # json writes a tuple's slice as an array; the brackets are the whole array's, written once.
            text = json.dumps(values[start : start + step], separators=(",", ":"), default=operator.index)
            yield (text[1:-1] if start == 0 else "," + text[1:-1]).encode()
        yield b"]"
    yield b"}"


class _NotJson:
    """What a body that does not parse as JSON reads as (``null`` is JSON)."""


_NOT_JSON = _NotJson()


def _json_value(body: bytes) -> object:
    """The body's JSON value, or _NOT_JSON. Nesting deeper than the parser's recursion limit is no
    JSON either: it raises RecursionError, which is no ValueError (3 KB of ``[`` fit the size cap)."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return _NOT_JSON


def _json_object(status: int, body: bytes, target: str, what: str) -> dict[str, object] | None:
    """The body as a JSON object; None when it is not JSON at all."""
    value = _json_value(body)
    if value is _NOT_JSON:
        return None
    if not isinstance(value, dict):
        raise GarbledReply(target, f"{what}: HTTP {status} body is JSON but not an object")
    return value


def _not_json(status: int, body: bytes, target: str, what: str) -> Exception:
    snippet = body[:120].decode("utf-8", "replace")
    if status == 200:
        return GarbledReply(target, f"{what}: HTTP 200 body is not JSON: {snippet!r}")
    return RemoteError(target, f"{what}: body is not JSON: {snippet!r}", status, f"http:{status}")


_SERVER_EXCEPTION_STATUS = 500  # how the scheduler answers its own exceptions (plain text)
_CODE_MAX = 2**31 - 1  # the gRPC API's int32; our reply's error_code is uint32
# A routed reply names one worker per role the cluster has (four roles exist); more is garbage, and
# decoding it would hold the routing thread.
MAX_ROLE_ADDRS = 16
# A schedule or master/info reply is a few hundred bytes (one entry per role): a longer one, over either
# protocol, is refused unread, since it would be decoded on the routing thread.
MAX_REPLY_BYTES = 65_536
# The scheduler's error message is carried to the caller and into every record of the decision: kept
# to this many characters (a gRPC reply may be megabytes long).
MAX_MESSAGE_CHARS = 1024


def _error_code(code: int, field: str, target: str) -> int:
    """A scheduler's error code: positive and an int32 (as both APIs define it), else the reply is garbled."""
    if not 0 < code <= _CODE_MAX:
        raise GarbledReply(target, f"{field}: error code out of range 1..{_CODE_MAX}, got {code}")
    return code


def _int_field(obj: Mapping[str, object], key: str, field: str, target: str, *, optional: bool) -> int | None:
    value = obj.get(key)
    if value is None:
        if optional:
            return None
        raise GarbledReply(target, f"{field}: missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise GarbledReply(target, f"{field}: expected an integer, got {value!r}")
    return value


def _str_field(obj: Mapping[str, object], key: str, field: str, target: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise GarbledReply(target, f"{field}: expected a string, got {value!r}")
    return _sendable(value)


def _sendable(text: str) -> str:
    """``text`` as any UTF-8 wire takes it: JSON's \ud800 (and bytes decoded with surrogatepass) give a
    lone surrogate, and a scheduler's error message so made failed the sidecar's reply to its caller."""
    return text if text.isascii() else text.encode("utf-8", "replace").decode("utf-8")


def _message(obj: Mapping[str, object], key: str) -> str:
    """An error message, cut to ``MAX_MESSAGE_CHARS``; one that is not a string is shown as its JSON:
    it only describes the error its code names, and garbling the reply for it turned a scheduler's own
    answer into a connection failure (the slave and KVCM asked, its breaker charged)."""
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        value = json.dumps(value)  # as long as the reply, which is bounded
    return cut_text(_sendable(value), MAX_MESSAGE_CHARS)


def _port(value: int | None, field: str, target: str) -> int:
    if value is None or not 1 <= value <= 65535:
        raise GarbledReply(target, f"{field}: port out of range 1..65535, got {value!r}")
    return value


def _grpc_port(grpc_port: int | None, http_port: int, field: str, target: str) -> int:
    """The entry's gRPC port; without one, the scheduler's convention (http + 1), which must be a port
    too (http_port 65535 would give 65536, refused everywhere else)."""
    if grpc_port:
        return _port(grpc_port, f"{field}.grpc_port", target)
    if http_port == 65535:
        raise GarbledReply(target, f"{field}.grpc_port: missing, and http_port + 1 = 65536 is not a port")
    return http_port + 1


def _role_addr_json(entry: object, index: int, target: str) -> RoleAddr | MasterBusinessError:
    field = f"server_status[{index}]"
    if not isinstance(entry, dict):
        raise GarbledReply(target, f"{field}: expected an object, got {entry!r}")
    if entry.get("success") is False:
        # A role the scheduler could not route fails the whole answer with that role's code.
        code = _int_field(entry, "code", f"{field}.code", target, optional=True)
        message = _message(entry, "message")
        # The OK code on a failed role names no error either: its role was not routed all the same.
        code = CODE_NO_AVAILABLE_WORKER if code in (None, 0, CODE_OK) else _error_code(code, f"{field}.code", target)
        return MasterBusinessError(code, message, None)
    role = parse_master_role(_str_field(entry, "role", f"{field}.role", target) or "", f"{field}.role", target)
    ip = _str_field(entry, "server_ip", f"{field}.server_ip", target)
    if not ip:
        raise GarbledReply(target, f"{field}.server_ip: missing or empty")
    ip = _server_ip(ip, f"{field}.server_ip", target)
    raw_http = _int_field(entry, "http_port", f"{field}.http_port", target, optional=False)
    http_port = _port(raw_http, f"{field}.http_port", target)
    grpc = _int_field(entry, "grpc_port", f"{field}.grpc_port", target, optional=True)
    grpc_port = _grpc_port(grpc, http_port, field, target)
    return RoleAddr(role, ip, http_port, grpc_port)


def _server_ip(ip: str, field: str, target: str) -> str:
    """The worker's address, as the caller connects to it: an IP address or a host name, nothing else (a
    peer's arbitrary text would also be carried into every record of it), without the spaces or URL
    brackets the scheduler may write around it (they would become part of every target built from it)."""
    bare = ip.strip()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]  # an IPv6 address written as in a URL
    if not is_host(bare):
        raise GarbledReply(target, f"{field}: not an IP address or host name: {cut_text(ip, 64)!r}")
    # In the one spelling discovery's targets have (an IPv6 address shortened, a name in lower case):
    # the decision's worker is matched against them, and the shadow index records under it; a Java
    # scheduler writes "2001:db8:0:0:0:0:0:5", and that record was never matched.
    try:
        return parse_target(format_target(bare, 1)).host
    except TargetError as exc:
        raise GarbledReply(target, f"{field}: {exc}") from None


def _master_host(reported: str | None) -> str | None:
    """The replica a reply names as master: ``host:port`` as the scheduler joins them (an IPv6 address
    unbracketed, so read by its last colon). Anything else, or longer than any host:port, reads as absent:
    its replica names no master (it answered all the same), and a peer's text reaches no snapshot."""
    text = (reported or "").strip()
    host, sep, port = text.rpartition(":")
    if not sep or len(text) > MAX_HOST_PORT_CHARS:
        return None
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        parse_target(f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}")
    except TargetError:
        return None
    return text


def decode_schedule_json(status: int, body: bytes, target: str) -> MasterReply:
    """An HTTP reply of ``POST /rtp_llm/schedule`` → ``MasterReply``; raises for no usable reply."""
    what = "schedule"
    value = _json_value(body)
    # The scheduler's own exceptions answer a 500 whose body is an error it could not shape (plain
    # text, ``null``, a framework's error object without a code): a usable reply, not a connection
    # failure, which the reference frontend fails with NO_AVAILABLE_WORKER, and so do we. Any other
    # status with such a body (a proxy's 502, a 404 from a host that is no scheduler) is no reply
    # from the scheduler at all.
    if value is _NOT_JSON:
        if status != _SERVER_EXCEPTION_STATUS:
            raise _not_json(status, body, target, what)
        return _unshaped_error(status, body, "is not JSON")
    if not isinstance(value, dict):
        if status == _SERVER_EXCEPTION_STATUS:
            return _unshaped_error(status, body, "is JSON but not an object")
        raise GarbledReply(target, f"{what}: HTTP {status} body is JSON but not an object")
    obj: dict[str, object] = value
    code = _int_field(obj, "code", "code", target, optional=True)
    success = obj.get("success")
    # 0 is no code, as the gRPC reply's proto3 default and a server_status entry's read: a Java
    # scheduler's int code never set sends it. Garbled here, the scheduler's own failure opened its breaker.
    if code is None or code == 0:
        if success is not True:
            # The scheduler's own failure without its code (a 500 it could not shape, or its 200 saying
            # success false): an error of unknown code, which the reference frontend takes as 8400.
            if status == _SERVER_EXCEPTION_STATUS or (status == 200 and success is False):
                return _unshaped_error(status, body, "has no code")
            raise GarbledReply(target, f"code: missing in an HTTP {status} reply that is not a success")
        code = CODE_OK
    message = _message(obj, "error_message")
    if code == CODE_FALLBACK:
        return MasterFallback(message, status)
    if code != CODE_OK:
        return MasterBusinessError(_error_code(code, "code", target), message, status)
    if status != 200:
        raise RemoteError(target, f"{what}: code 200 in an HTTP {status} reply", status, f"http:{status}")
    entries = obj.get("server_status") or []
    if not isinstance(entries, list):
        raise GarbledReply(target, f"server_status: expected a list, got {entries!r}")
    if len(entries) > MAX_ROLE_ADDRS:
        raise GarbledReply(target, f"server_status: {len(entries)} entries, more than {MAX_ROLE_ADDRS}")
    addrs: list[RoleAddr] = []
    for i, entry in enumerate(entries):
        decoded = _role_addr_json(entry, i, target)
        if isinstance(decoded, MasterBusinessError):
            return MasterBusinessError(decoded.code, decoded.message, status)
        addrs.append(decoded)
    return MasterRouted(
        tuple(addrs),
        _master_host(_str_field(obj, "real_master_host", "real_master_host", target)),
        _int_field(obj, "queue_length", "queue_length", target, optional=True),
    )


def _unshaped_error(status: int, body: bytes, what: str) -> MasterBusinessError:
    snippet = body[:120].decode("utf-8", "replace")
    return MasterBusinessError(CODE_NO_AVAILABLE_WORKER, f"HTTP {status} body {what}: {snippet!r}", status)


def decode_info_json(status: int, body: bytes, target: str) -> MasterInfo:
    """An HTTP reply of ``POST /rtp_llm/master/info``; raises unless it is a 200 success."""
    what = "master/info"
    obj = _json_object(status, body, target, what)
    if obj is None:
        raise _not_json(status, body, target, what)
    code = _int_field(obj, "code", "code", target, optional=True)
    # An answer is a 200 that says neither success false nor an error code: a replica not ready to
    # answer would otherwise count as healthy, and its word on the master be taken.
    if status != 200 or obj.get("success") is False or code not in (None, CODE_OK):
        message = _message(obj, "error_message")
        # The scheduler's own code where it gave one other than success's, else the HTTP status.
        error_code = code if code not in (None, CODE_OK) else status
        raise RemoteError(target, f"{what}: {message}", error_code, f"http:{status}")
    return MasterInfo(
        _master_host(_str_field(obj, "real_master_host", "real_master_host", target)),
        _int_field(obj, "queue_length", "queue_length", target, optional=True),
        _str_field(obj, "pod_ip", "pod_ip", target),
        _str_field(obj, "instance_ip", "instance_ip", target),
    )


# --- HTTP JSON: server side (the simulated scheduler) --------------------------------------


class BadScheduleRequest(ValueError):
    """A schedule body the scheduler rejects with 8406; the message names the field."""


def parse_schedule_json(body: bytes) -> MasterScheduleRequest:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadScheduleRequest(f"body: not JSON ({exc!r})") from exc
    if not isinstance(obj, dict):
        raise BadScheduleRequest("body: not a JSON object")
    raw_id = obj.get("request_id")
    if isinstance(raw_id, float):
        # A JSON number is coerced to the id's text whatever its notation (12.0, 1e3); one that names
        # no whole id has no text to coerce to.
        if not raw_id.is_integer():  # nor is NaN or an infinity
            raise BadScheduleRequest(f"request_id: a number must be a whole one, got {raw_id!r}")
        raw_id = int(raw_id)
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or not str(raw_id).strip():
        raise BadScheduleRequest("request_id: required, non-blank")
    keys = _int_list(obj.get("block_cache_keys"), "block_cache_keys")
    block_size = obj.get("block_size")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)):
        raise BadScheduleRequest(f"block_size: expected an integer, got {block_size!r}")
    # Keys cost block_size tokens each: with keys, a size of no tokens is as unusable as none (the
    # gRPC side refuses cache_key_block_size <= 0 alike).
    if keys and (block_size is None or block_size <= 0):
        raise BadScheduleRequest(f"block_size: a positive one is required with block_cache_keys, got {block_size!r}")
    ids = obj.get("input_ids")
    return MasterScheduleRequest(
        request_id=str(raw_id),
        block_cache_keys=keys,
        block_size=block_size,
        seq_len=_int_or(obj.get("seq_len"), 0, "seq_len"),
        input_ids=None if ids is None else _int_list(ids, "input_ids"),
        generate_timeout_ms=_int_or(obj.get("generate_timeout"), DEFAULT_GENERATE_TIMEOUT_MS, "generate_timeout"),
        request_time_ms=_int_or(obj.get("request_time_ms"), 0, "request_time_ms"),
    )


def _int_list(value: object, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise BadScheduleRequest(f"{field}: expected a list of integers")
    return tuple(value)


def _int_or(value: object, default: int, field: str) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadScheduleRequest(f"{field}: expected an integer, got {value!r}")
    return value


def routed_json(
    role_addrs: Sequence[RoleAddr], real_master_host: str | None, queue_length: int | None, request_id: str
) -> bytes:
    statuses = [
        {
            "role": a.role.value,
            "server_ip": a.ip,
            "http_port": a.http_port,
            "grpc_port": a.grpc_port,
            "debug_info": None,
            "request_id": request_id,
            "success": True,
            "code": CODE_OK,
            "message": None,
        }
        for a in role_addrs
    ]
    reply = {
        "success": True,
        "code": CODE_OK,
        "server_status": statuses,
        "real_master_host": real_master_host,
        "queue_length": queue_length,
    }
    return json.dumps(reply).encode()


def error_json(code: int, message: str) -> bytes:
    return json.dumps({"success": False, "code": code, "error_message": message}).encode()


def info_json(real_master_host: str | None, queue_length: int, pod_ip: str) -> bytes:
    reply = {
        "success": True,
        "code": CODE_OK,
        "real_master_host": real_master_host,
        "pod_ip": pod_ip,
        "instance_ip": pod_ip,
        "queue_length": queue_length,
    }
    return json.dumps(reply).encode()


# --- gRPC ------------------------------------------------------------------------------------


def encode_schedule_pb(request: MasterScheduleRequest) -> bytes:
    message = flexlb_pb.FlexlbScheduleRequestPB(
        request_id=grpc_request_id(request.request_id),
        block_cache_keys=request.block_cache_keys,
        seq_len=request.seq_len,
        generate_timeout=request.generate_timeout_ms,
        request_time_ms=request.request_time_ms,
        cache_key_block_size=request.block_size or 0,
        forward_hop=0,
    )
    return message.SerializeToString()


def encode_cancel_pb(request_id: str, deadline_exceeded: bool) -> bytes:
    reason = flexlb_pb.DEADLINE_EXCEEDED if deadline_exceeded else flexlb_pb.CLIENT_CANCELLED
    return flexlb_pb.FlexlbCancelRequestPB(request_id=grpc_request_id(request_id), reason=reason).SerializeToString()


def decode_schedule_pb(data: bytes, target: str) -> MasterReply:
    reply = flexlb_pb.FlexlbScheduleResponsePB()
    try:
        reply.ParseFromString(data)
    except DecodeError as exc:
        raise GarbledReply(target, f"schedule: undecodable reply ({exc})") from exc
    # A reply of the scheduler's service saying success false without a code: an error of unknown code,
    # which the reference frontend takes as 8400 (not a garbled reply: the slave and KVCM are not asked).
    code = reply.code or (CODE_OK if reply.success else CODE_NO_AVAILABLE_WORKER)
    if code == CODE_FALLBACK:
        return MasterFallback(cut_text(reply.error_message, MAX_MESSAGE_CHARS), None)
    if code != CODE_OK:
        message = cut_text(reply.error_message, MAX_MESSAGE_CHARS)
        return MasterBusinessError(_error_code(code, "code", target), message, None)
    if len(reply.server_status) > MAX_ROLE_ADDRS:
        raise GarbledReply(target, f"server_status: {len(reply.server_status)} entries, more than {MAX_ROLE_ADDRS}")
    addrs: list[RoleAddr] = []
    for i, entry in enumerate(reply.server_status):
        field = f"server_status[{i}]"
        if not entry.server_ip:
            raise GarbledReply(target, f"{field}.server_ip: missing or empty")
        ip = _server_ip(entry.server_ip, f"{field}.server_ip", target)
        http_port = _port(entry.http_port, f"{field}.http_port", target)
        grpc_port = _grpc_port(entry.grpc_port, http_port, field, target)
        role = parse_master_role(entry.role, f"{field}.role", target)
        addrs.append(RoleAddr(role, ip, http_port, grpc_port))
    return MasterRouted(tuple(addrs), _master_host(reply.real_master_host), reply.queue_length)


def parse_schedule_pb(data: bytes) -> tuple[int, MasterScheduleRequest]:
    """Server side: (the int64 id, the request with that id as its string id)."""
    message = flexlb_pb.FlexlbScheduleRequestPB()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise BadScheduleRequest(f"body: undecodable ({exc})") from exc
    keys = tuple(message.block_cache_keys)
    if keys and message.cache_key_block_size <= 0:
        raise BadScheduleRequest("cache_key_block_size: required when block_cache_keys is non-empty")
    request = MasterScheduleRequest(
        request_id=str(message.request_id),
        block_cache_keys=keys,
        block_size=message.cache_key_block_size or None,
        seq_len=message.seq_len,
        generate_timeout_ms=message.generate_timeout or DEFAULT_GENERATE_TIMEOUT_MS,
        request_time_ms=message.request_time_ms,
    )
    return message.request_id, request


def parse_cancel_pb(data: bytes) -> tuple[int, bool]:
    """Server side: (the int64 id, whether the reason is a deadline)."""
    message = flexlb_pb.FlexlbCancelRequestPB()
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise BadScheduleRequest(f"body: undecodable ({exc})") from exc
    return message.request_id, message.reason == flexlb_pb.DEADLINE_EXCEEDED


def routed_pb(role_addrs: Sequence[RoleAddr], real_master_host: str | None, queue_length: int) -> bytes:
    reply = flexlb_pb.FlexlbScheduleResponsePB(
        success=True, code=CODE_OK, real_master_host=real_master_host or "", queue_length=queue_length
    )
    for a in role_addrs:
        reply.server_status.add(role=a.role.value, server_ip=a.ip, http_port=a.http_port, grpc_port=a.grpc_port)
    return reply.SerializeToString()


def error_pb(code: int, message: str) -> bytes:
    return flexlb_pb.FlexlbScheduleResponsePB(success=False, code=code, error_message=message).SerializeToString()
