"""Which string field of a serialised protobuf message holds bytes that are not UTF-8 (pure).

protobuf refuses such a message with one generic error ("String field had bad UTF-8") that names no
field. A walk over the message's top-level fields, in wire order, finds the first string field that
does not decode, so a refusal can name it. The walk stops at anything malformed (the parse's own
error is the one to give then) and after ``max_fields`` fields: it runs on a handler thread for a
message a client may have made as large as the receive limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_MAX_VARINT_BYTES = 10  # a 64-bit varint
_MAX_FIELD_NUMBER = 2**29 - 1


@dataclass(frozen=True, slots=True)
class BadUtf8:
    """A string field whose bytes are not UTF-8."""

    field: str  # the field's name
    item: int | None  # of a repeated field, which of its items (counting from 0); None: a singular field
    byte: int  # the first byte that is not UTF-8, counted within the item's bytes

    def __str__(self) -> str:
        where = "" if self.item is None else f" of {self.field}[{self.item}]"
        return f"not valid UTF-8 at byte {self.byte}{where}"


def _varint(data: bytes, at: int) -> tuple[int, int] | None:
    """The varint at ``at`` and the offset after it; None when it is cut short or longer than 10 bytes."""
    value = shift = 0
    for i in range(at, min(len(data), at + _MAX_VARINT_BYTES)):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return None


def first_bad_utf8(
    data: bytes, strings: Mapping[int, tuple[str, bool]], *, max_fields: int
) -> BadUtf8 | None:
    """The first top-level string field of the message ``data`` whose bytes are not UTF-8, walking at
    most ``max_fields`` fields in wire order; None when none is found before the walk ends, at the
    message's end, at the first malformed field (a key or a length cut short or out of range, a group
    or another unknown wire type) or at the bound. ``strings``: the string fields by number, each its
    name and whether it is repeated. O(``max_fields``) steps, each O(1) but a string's decoding."""
    at, items, view = 0, dict.fromkeys(strings, 0), memoryview(data)
    for _ in range(max_fields):
        if at >= len(data):
            return None
        key = _varint(data, at)
        if key is None:
            return None
        tag, at = key
        number, wire_type = tag >> 3, tag & 7
        if not 0 < number <= _MAX_FIELD_NUMBER:
            return None
        if wire_type == _VARINT:
            value = _varint(data, at)
            if value is None:
                return None
            at = value[1]
        elif wire_type in (_FIXED64, _FIXED32):
            at += 8 if wire_type == _FIXED64 else 4
            if at > len(data):
                return None
        elif wire_type == _LENGTH_DELIMITED:
            length = _varint(data, at)
            if length is None:
                return None
            size, start = length
            at = start + size
            if at > len(data):
                return None
            if number in strings:
                name, repeated = strings[number]
                try:
                    str(view[start:at], "utf-8")  # decoded in place: a string may be megabytes
                except UnicodeDecodeError as exc:
                    return BadUtf8(name, items[number] if repeated else None, exc.start)
                items[number] += 1
        else:  # a group (3, 4) or no wire type at all (6, 7): not walked
            return None
    return None
