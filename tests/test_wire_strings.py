"""The walk that names a RouteRequest's string field holding bytes that are not UTF-8."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from router.sidecar import _STRING_FIELDS, UTF8_WALK_MAX_FIELDS
from router.wire import router_v1_pb2
from router.wire.strings import BadUtf8, first_bad_utf8

ROLE_FIELD = b"\x3a"  # roles = 7, length-delimited


def walk(data: bytes) -> BadUtf8 | None:
    return first_bad_utf8(data, _STRING_FIELDS, max_fields=UTF8_WALK_MAX_FIELDS)


def parses(data: bytes) -> bool:
    try:
        router_v1_pb2.RouteRequest.FromString(data)
    except DecodeError:
        return False
    return True


def test_the_string_fields_are_the_request_id_and_the_roles() -> None:
    assert _STRING_FIELDS == {1: ("request_id", False), 7: ("roles", True)}


def test_a_request_id_that_is_not_utf8_is_named_with_its_first_bad_byte() -> None:
    rest = router_v1_pb2.RouteRequest(token_ids=[1, 2, 3], budget_ms=30).SerializeToString()
    data = b"\x0a\x03ab\xff" + rest
    assert not parses(data)
    found = walk(data)
    assert found == BadUtf8("request_id", None, 2)
    assert str(found) == "not valid UTF-8 at byte 2"


def test_a_role_that_is_not_utf8_is_named_after_packed_lists_and_scalars() -> None:
    # Both packed lists (large varints, negative keys), the scalars and a good role come first.
    good = router_v1_pb2.RouteRequest(
        request_id="r",
        token_ids=[2**63 - 1, 0, 300],
        block_cache_keys=[-1, -(2**63)],
        block_size=16,
        seq_len=48,
        budget_ms=30,
        roles=["PREFILL"],
    ).SerializeToString()
    data = good + ROLE_FIELD + b"\x04DE\xc3\x28"  # a lead byte followed by no continuation byte
    assert not parses(data)
    found = walk(data)
    assert found == BadUtf8("roles", 1, 2)
    assert str(found) == "not valid UTF-8 at byte 2 of roles[1]"


def test_unpacked_ints_and_fixed_width_fields_are_walked_over() -> None:
    unpacked = b"".join(b"\x10" + bytes([n]) for n in range(5))  # token_ids = 2 as single varints
    minus_one = b"\x10" + b"\xff" * 9 + b"\x01"  # a negative int64 is the longest varint: ten bytes
    fixed = b"\x41" + bytes(8) + b"\x4d" + bytes(4)  # unknown fields 8 (fixed64) and 9 (fixed32)
    data = unpacked + minus_one + fixed + ROLE_FIELD + b"\x02D\xff"
    assert not parses(data)
    assert walk(data) == BadUtf8("roles", 0, 1)


def test_a_well_formed_message_has_no_bad_string() -> None:
    data = router_v1_pb2.RouteRequest(request_id="é-r", token_ids=[1], roles=["prefill", "DECODE"]).SerializeToString()
    assert parses(data) and walk(data) is None


@pytest.mark.parametrize(
    ("raw", "bad_at"),
    [
        (b"\xed\xa0\x80", 0),  # a surrogate
        (b"a\xc0\x80", 1),  # an overlong NUL
        (b"\xf4\x90\x80\x80", 0),  # past U+10FFFF
        (b"\xef\xbf\xbf\x00", None),  # a noncharacter and NUL are UTF-8
    ],
)
def test_the_walk_judges_utf8_as_protobuf_does(raw: bytes, bad_at: int | None) -> None:
    data = b"\x0a" + bytes([len(raw)]) + raw
    assert parses(data) is (bad_at is None)
    assert walk(data) == (None if bad_at is None else BadUtf8("request_id", None, bad_at))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x0a\x7f",  # a length past the end
        b"\x0a\x05a\xff",  # the bad byte is there, but the field is cut short: malformed, not named
        b"\x0a",  # a key with no length
        b"\x10\xff\xff",  # a varint cut short
        b"\x10" + b"\xff" * 10 + b"\x01" + b"\x0a\x01\xff",  # a varint longer than 64 bits
        b"\x41\x00\x00" + b"\x0a\x01\xff",  # a fixed64 cut short
        b"\x00\x01" + b"\x0a\x01\xff",  # field number 0
        b"\x0b\x0c" + b"\x0a\x01\xff",  # a group (wire type 3): not walked
        b"\x0e" + b"\x0a\x01\xff",  # wire type 6: none
        b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # a key longer than a varint
    ],
)
def test_the_walk_stops_at_anything_malformed(data: bytes) -> None:
    assert walk(data) is None


def test_the_walk_stops_after_its_bound() -> None:
    filler = b"\x20\x01" * UTF8_WALK_MAX_FIELDS  # block_size, again and again
    assert walk(filler[2:] + b"\x0a\x01\xff") == BadUtf8("request_id", None, 0)
    assert walk(filler + b"\x0a\x01\xff") is None


@given(st.binary(max_size=64))
def test_garbage_never_raises_and_a_named_field_means_protobuf_refuses_the_message(data: bytes) -> None:
    found = walk(data)
    if found is not None:
        assert not parses(data)
        assert found.field in ("request_id", "roles")


@given(st.text(max_size=8), st.lists(st.text(max_size=8), max_size=3), st.binary(min_size=1, max_size=8))
def test_a_bad_string_appended_to_a_message_is_found_exactly_when_it_is_not_utf8(
    request_id: str, roles: list[str], raw: bytes
) -> None:
    good = router_v1_pb2.RouteRequest(request_id=request_id, token_ids=[1], roles=roles).SerializeToString()
    data = good + ROLE_FIELD + bytes([len(raw)]) + raw
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        assert walk(data) == BadUtf8("roles", len(roles), exc.start)
        assert not parses(data)
    else:
        assert walk(data) is None
