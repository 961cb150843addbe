"""The decision record: what one routing decision was made from, and the framed log it is written to.

A :class:`DecisionRecord` rides along one request (``RequestContext.record``) when the decision log
is on. The sources fill it with what they were answered and when; the router adds the decision and
hands it to the log actor after the reply. Encoding happens in the log actor's writer thread, so
the request pays for a few attribute writes only.

The log (format version 5; versions 1 to 4 are still read) is a file that starts with :data:`MAGIC`
and continues with frames::

    u32 payload length | u8 kind | u32 crc32(payload) | payload (UTF-8 JSON object)

Kinds: ``H`` header (format version, configuration digest and its non-default settings, seed),
``F`` fleet (the discovered workers, written before the first decision that planned on them), ``D``
decision. Times in a decision are seconds relative to the request's receipt (``t``, the one
absolute trio time), so the log is compact and a replay can put each answer back where it arrived.
Pure apart from :func:`read_frames`, which reads a file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import struct
import zlib
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

from router.files import kind_of, open_regular_file
from router.policy.deadline_split import SplitEstimates
from router.policy.plan import CandidateSource, Fleet
from router.request import PreparedRequest
from router.types import (
    DropReason,
    HostMatch,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouteRequest,
    Stage,
    WorkerAddr,
    WorkerStatus,
)

FORMAT_VERSION = 5
# 2 added the deadline split: its estimates (``se``) and windows (``sm``, ``sw``); 3 the tail: its estimate
# (the fifth ``se`` value) and the request's own (``tl``); 4 a prompt the deadline cut while it was hashed
# (``hc``: its token count), which has no keys to record; 5 a status's KV cache group mode (the seventh
# value of a probe's status row), which the filter checks against the query type.
READABLE_VERSIONS = (1, 2, 3, 4, 5)
MAGIC = b"KVRDLOG" + bytes([FORMAT_VERSION])
FRAME_HEAD = struct.Struct(">IBI")  # payload length, kind, crc32 of the payload
MAX_FRAME_BYTES = 16 * 1024 * 1024
KIND_HEADER = ord("H")
KIND_FLEET = ord("F")
KIND_DECISION = ord("D")
KEYS_INLINE_MAX = 16  # longer key lists are recorded as a digest plus their length


# --- what the sources fill in ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SourceAnswer:
    """An opaque source's answer (the master's): when it was asked, when it answered, what it said.

    ``kind`` is ``answered`` | ``fell_through`` | ``ended``; the other fields as the result carried them."""

    started: float
    arrived: float
    kind: str
    reason: Reason
    to_last: bool = False
    error: str | None = None
    code: int = 0
    role_addrs: tuple[RoleAddr, ...] = ()


@dataclass(frozen=True, slots=True)
class KvcmAnswer:
    """KVCM's part: ``hosts`` are the positive hosts (None: KVCM gave none, ``reason`` says why)."""

    started: float
    arrived: float
    hosts: tuple[HostMatch, ...] | None
    reason: Reason | None


@dataclass(frozen=True, slots=True)
class ProbeRecord:
    """One planned candidate's status as the decision got it.

    ``arrived``: when its probe result came (None: not before waiting stopped). ``status`` and
    ``taken`` (when the status's call was sent, trio time, relative): the status scored with, possibly an older cached
    one; ``missing``: why it had none (None with no status: the policy's default)."""

    target: str
    arrived: float | None
    status: WorkerStatus | None
    taken: float | None
    missing: DropReason | None


@dataclass(slots=True)
class ScoringRecord:
    source: CandidateSource
    hosts: tuple[HostMatch, ...]
    fleet: Fleet
    ejected: tuple[str, ...]
    probes: tuple[ProbeRecord, ...] = ()
    # The workers the plan passed over as unfit, in the hot set or the cold walk (serving another role,
    # or saying they are not alive; why is not recorded).
    other_roles: tuple[str, ...] = ()
    decided: float = 0.0
    # Per candidate that passed the filters, in tie-draw order: (target, pending charge, last-selected trio
    # time or None (never), tie draw). The last-selected time stays absolute: only its order among the
    # candidates matters, and an absolute time keeps that order exactly.
    ledger: tuple[tuple[str, int, float | None, float], ...] = ()


def without_prompt(request: RouteRequest, max_id_chars: int) -> RouteRequest:
    """``request`` as a record keeps it: without its token ids and keys, which the log never writes
    (the keys go as the prepared ones' digest), while a record may wait in the log's inbox: holding a
    262,144-token prompt, each held 10 MiB. An id longer than ``max_id_chars`` (the id limit) is cut
    to one character past it: still refused as too long when replayed, where the whole of a 17 MiB id
    made a frame no reader takes, and every decision of its file unreadable."""
    request_id = request.request_id
    long_id = isinstance(request_id, str) and len(request_id) > max_id_chars + 1
    if request.token_ids is None and request.block_cache_keys is None and not long_id:
        return request
    kept_id = request_id[: max_id_chars + 1] if long_id else request_id
    return replace(request, token_ids=None, block_cache_keys=None, request_id=kept_id)


@dataclass(slots=True)
class DecisionRecord:
    request: RouteRequest  # without its prompt (``without_prompt``)
    received_at: float
    deadline: float = 0.0
    prepared: PreparedRequest | None = None
    overloaded: bool = False
    master: SourceAnswer | None = None
    kvcm: KvcmAnswer | None = None
    shadow_hosts: tuple[HostMatch, ...] | None = None
    scorings: list[ScoringRecord] = field(default_factory=list)
    split: SplitEstimates | None = None  # the deadline split's estimates the request's windows came from
    # The token count of a checked prompt whose hashing the request's deadline cut (None: not cut): it
    # has no keys, so without it the record would read as a request refused before its checks.
    hashing_cut: int | None = None
    decision: RouteDecision | None = None


# --- encoding (the log actor's thread) -----------------------------------------------------------


def frame(kind: int, payload: Mapping[str, Any]) -> bytes:
    body = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
    return FRAME_HEAD.pack(len(body), kind, zlib.crc32(body)) + body


def _hosts(hosts: Sequence[HostMatch]) -> list[list[Any]]:
    return [[h.host_ip_port, h.local, h.p2p_fetch, h.p2p_total] for h in hosts]


def _status(s: WorkerStatus) -> list[Any]:
    """Every field of a status the filters and scoring read (``filter_candidate``, the policies' work)."""
    return [
        s.role.value,
        int(s.alive),
        s.waiting_count,
        s.outstanding_uncached_tokens,
        s.block_size,
        s.lookahead_tokens,
        s.kv_cache_group_mode.value,
    ]


def _addrs(addrs: Sequence[RoleAddr]) -> list[list[Any]]:
    return [[a.role.value, a.ip, a.http_port, a.grpc_port] for a in addrs]


def keys_field(keys: Sequence[int]) -> list[int] | str:
    """The keys as given when short, else ``sha256-prefix:length``."""
    if len(keys) <= KEYS_INLINE_MAX:
        return list(keys)
    digest = hashlib.sha256(b"".join(k.to_bytes(8, "big", signed=True) for k in keys)).hexdigest()[:16]
    return f"{digest}:{len(keys)}"


def _rel(value: float | None, base: float) -> float | None:
    return None if value is None else value - base


def encode_decision(record: DecisionRecord, fleet_id: int | None) -> dict[str, Any]:
    """A decision frame's payload (short keys: the log holds one of these per request)."""
    r = record.received_at
    req = record.request
    out: dict[str, Any] = {"id": req.request_id, "t": r}
    if req.budget_ms is not None:
        out["b"] = req.budget_ms
    if req.deadline is not None:
        out["dl"] = req.deadline - r
    if req.roles is not None:
        out["ro"] = [role.value for role in req.roles]
    prepared = record.prepared
    if prepared is not None:
        out["k"] = keys_field(prepared.keys)
        out["sl"] = prepared.seq_len
        out["bs"] = prepared.block_size
    if record.hashing_cut is not None:
        out["hc"] = record.hashing_cut
    if record.overloaded:
        out["ov"] = 1
    if record.master is not None:
        m = record.master
        out["m"] = [m.started, m.arrived, m.kind, m.reason.value, int(m.to_last), m.error, m.code, _addrs(m.role_addrs)]
    if record.kvcm is not None:
        k = record.kvcm
        out["kv"] = [k.started, k.arrived, None if k.hosts is None else _hosts(k.hosts), k.reason and k.reason.value]
    if record.shadow_hosts is not None:
        out["sh"] = _hosts(record.shadow_hosts)
    if record.split is not None:
        e = record.split
        out["se"] = [e.query, e.probe, e.score, e.lag, e.tail]
    if record.scorings:
        out["f"] = fleet_id
        out["sc"] = [
            {
                "s": sc.source.value,
                "h": _hosts(sc.hosts),
                "ej": list(sc.ejected),
                "or": list(sc.other_roles),
                "p": [
                    [p.target, p.arrived, None if p.status is None else _status(p.status), p.taken,
                     p.missing and p.missing.value]
                    for p in sc.probes
                ],
                "at": sc.decided,
                "lv": [list(row) for row in sc.ledger],
            }
            for sc in record.scorings
        ]
    d = record.decision
    if d is not None:
        tail_ms = d.stage_ms.get(Stage.TAIL)
        if tail_ms is not None:
            out["tl"] = round(tail_ms, 3)
        out["d"] = decision_fields(d)
    return out


def decision_fields(d: RouteDecision) -> dict[str, Any]:
    """What "identical" compares: worker, role addresses, reason, source chain, candidate scores
    (plus the hit the decision predicts, which the what-if reports)."""
    return {
        "w": None if d.worker is None else d.worker.http_target,
        "r": d.reason.value,
        "rs": d.route_source.value,
        "ra": _addrs(d.role_addrs),
        "ch": [[s.source.value, s.outcome.value, None if s.reason is None else s.reason.value] for s in d.sources],
        "c": [
            [c.target, c.source, c.local_blocks, c.hit_tokens, c.work_tokens, c.role, c.dropped, int(c.chosen)]
            for c in d.candidates
        ],
        "hit": d.hit_tokens,
        "ec": d.error_code,
        "sm": None if d.split is None else d.split.value,
        # Windows to the microsecond: what the split set, not the last bits of the float arithmetic.
        "sw": [[w.stage.value, round(w.end_ms, 3), int(w.cut)] for w in d.windows],
    }


def encode_fleet(fleet_id: int, fleet: Fleet) -> dict[str, Any]:
    return {"f": fleet_id, "w": [[w.ip, w.http_port, w.grpc_port, w.status_port] for w in fleet.workers]}


# --- decoding ------------------------------------------------------------------------------------


class LogFormatError(ValueError):
    """The log cannot be read from ``offset`` on; the message says what was found there."""

    def __init__(self, path: str, offset: int, message: str) -> None:
        super().__init__(f"{path}: byte offset {offset}: {message}")
        self.path = path
        self.offset = offset


class TornTail(LogFormatError):
    """The file ends inside a frame: its writer stopped mid-write (a crash, a full disk). What came
    before is whole and can be read."""


@dataclass(frozen=True, slots=True)
class Frame:
    offset: int
    kind: int
    payload: dict[str, Any]


def child_log_path(path: str, index: int) -> str:
    """Child ``index``'s decision log under ``kvroute serve --processes N``: its own file beside the
    configured path (``PATH.p<index>``), since a log file has one writer (each would truncate and rotate
    its siblings'); empty stays off."""
    return f"{path}.p{index}" if path else ""


def unusable_log_path(path: str) -> str | None:
    """Why ``path`` cannot be this router's decision log, or None: a log rotates what it finds at its
    path away, so whatever is there must be a decision log already (or nothing, or an empty file). A
    directory, anything else but a regular file, or another file is left as it is, and no decision is
    logged."""
    try:
        mode_and_size = os.stat(path)
    except (FileNotFoundError, ValueError):  # ValueError: a NUL in it, refused by the setting's own check
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISDIR(mode_and_size.st_mode):
        return "is a directory"
    if not stat.S_ISREG(mode_and_size.st_mode):  # a FIFO would hold the reader (and writer) for good
        return f"is not a regular file ({kind_of(mode_and_size.st_mode)})"
    if mode_and_size.st_size == 0:
        return None
    try:
        with open_regular_file(path) as file:
            head = file.read(len(MAGIC) - 1)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if head != MAGIC[: len(head)]:  # a header cut short by a crash is still a log's
        return "holds something that is not a kvroute decision log (no KVRDLOG header)"
    return None


def read_frames(path: str) -> Generator[Frame, None, None]:
    """Every frame of one log file, in order, read a frame at a time (a file is never held whole).
    Raises :class:`LogFormatError` naming the byte offset of the first thing that is not a whole,
    intact frame (truncation, a bad checksum, non-JSON); :class:`TornTail` when that is the file's end."""
    try:
        file = open_regular_file(path)
    except OSError as exc:
        raise LogFormatError(path, 0, f"cannot read the file: {exc.strerror or exc}") from None
    with file:
        yield from _frames(path, file)


def parse_frames(path: str, data: bytes) -> Iterator[Frame]:
    """Every frame of a log file's contents ``data``, as :func:`read_frames` reads them."""
    yield from _frames(path, io.BytesIO(data))


_KINDS = frozenset({KIND_HEADER, KIND_FLEET, KIND_DECISION})
_PAYLOAD_BYTES = bytes(range(0x20, 0x7F))  # what a payload is written in (``json.dumps``, ASCII escapes)
ZERO_TAIL_CHUNK = 1024 * 1024  # how much of a zero tail is read at a time


def _read(path: str, file: BinaryIO, size: int, offset: int) -> bytes:
    try:
        return file.read(size)
    except OSError as exc:
        raise LogFormatError(path, offset, f"cannot read the file: {exc.strerror or exc}") from None


def _zeros_to_the_end(path: str, file: BinaryIO, offset: int) -> int | None:
    """How many bytes are left in ``file``, if every one is zero (None when one is not). Read in
    bounded pieces: a zero tail can be as long as the file system extended the file."""
    left = 0
    while chunk := _read(path, file, ZERO_TAIL_CHUNK, offset):
        if chunk.count(0) != len(chunk):
            return None
        left += len(chunk)
    return left


def _frames(path: str, file: BinaryIO) -> Iterator[Frame]:
    head = _read(path, file, len(MAGIC), 0)
    # The magic first: a file that is no log (a device, a stray file) is refused before it is read on.
    if len(head) < len(MAGIC) or head[: len(MAGIC) - 1] != MAGIC[:-1]:
        raise LogFormatError(path, 0, "not a kvroute decision log (no KVRDLOG header)")
    if head[-1] not in READABLE_VERSIONS:
        readable = " and ".join(str(v) for v in READABLE_VERSIONS)
        raise LogFormatError(path, len(MAGIC) - 1, f"format version {head[-1]}, this kvroute reads {readable}")
    offset = len(MAGIC)
    while frame_head := _read(path, file, FRAME_HEAD.size, offset):
        if len(frame_head) < FRAME_HEAD.size:
            have = len(frame_head)
            raise TornTail(path, offset, f"truncated frame header ({have} of {FRAME_HEAD.size} bytes)")
        length, kind, crc = FRAME_HEAD.unpack(frame_head)
        if kind not in _KINDS or length > MAX_FRAME_BYTES:
            # A file system that extends the file before its data lands leaves zeros where a crash cut
            # the last write: zeros from the kind byte to the end of the file are a torn tail.
            zeros = _zeros_to_the_end(path, file, offset) if frame_head.count(0, 4) == len(frame_head) - 4 else None
            if zeros is not None:
                raise TornTail(path, offset, _zero_tail(FRAME_HEAD.size + zeros))
            if kind not in _KINDS:
                raise LogFormatError(path, offset, f"unknown frame kind {kind}")
            raise LogFormatError(path, offset, f"frame length {length} is over {MAX_FRAME_BYTES}")
        body = _read(path, file, length, offset)
        if len(body) < length:
            # A write cut short leaves the start of one payload (JSON in printable ASCII), zeros after it at
            # most; anything else, frame heads among it, is a length garbled to run over the frames after
            # it, whose decisions a torn tail would drop with a warning.
            if body.rstrip(b"\0").translate(None, _PAYLOAD_BYTES):
                raise LogFormatError(path, offset, f"frame length {length} runs over the frames after it (corrupted)")
            raise TornTail(path, offset, f"truncated frame ({len(body)} of {length} payload bytes)")
        if zlib.crc32(body) != crc:
            # A payload (JSON) holds no zero byte: one that ends in zeros running to the end of the file
            # is a write cut by a crash, as above.
            zeros = _zeros_to_the_end(path, file, offset) if body.endswith(b"\0") else None
            if zeros is not None:
                raise TornTail(path, offset, _zero_tail(FRAME_HEAD.size + length + zeros))
            raise LogFormatError(path, offset, "frame checksum mismatch (corrupted)")
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise LogFormatError(path, offset, f"frame payload is not JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise LogFormatError(path, offset, "frame payload is not a JSON object")
        yield Frame(offset, kind, payload)
        offset += FRAME_HEAD.size + length


def _zero_tail(left: int) -> str:
    why = "its data never reached the disk"
    return f"zero bytes from inside this frame to the end of the file ({left} bytes from here): {why}"


def decode_hosts(raw: Sequence[Sequence[Any]]) -> tuple[HostMatch, ...]:
    return tuple(HostMatch(str(h[0]), int(h[1]), int(h[2]), int(h[3])) for h in raw)


def decode_addrs(raw: Sequence[Sequence[Any]]) -> tuple[RoleAddr, ...]:
    return tuple(RoleAddr(Role(a[0]), str(a[1]), int(a[2]), int(a[3])) for a in raw)


def decode_fleet(payload: Mapping[str, Any]) -> Fleet:
    return Fleet.of(WorkerAddr(str(w[0]), int(w[1]), int(w[2]), int(w[3])) for w in payload["w"])
