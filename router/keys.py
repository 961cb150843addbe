"""Block cache keys for a prompt (pure): the three block-key families.

A prompt of N tokens and block size ``bs`` has floor(N / bs) keys (for ``sglang``
with lookahead 1, floor((N - 1) / bs): its logical length is N - 1). An incomplete
tail block has no key. Keys are signed 64-bit integers. Each family hashes the token ids of its
``token_id_range``: ``rtp`` and ``vllm`` any signed 64-bit integer, ``sglang`` a uint32.

- ``rtp``: the engine's rolling hash, carried across blocks.
- ``vllm``: sha256 over canonical CBOR ``[parent digest, [tokens], null]``, chained.
- ``sglang``: sha256 over ``parent digest ‖ tokens as uint32 little-endian``, chained.

Every function converts its tokens to a list at most once (hashing is the per-request hot path).
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import assert_never

from router.problems import Problem
from router.types import KeyFamily

_MASK64 = (1 << 64) - 1
_SIGN64 = 1 << 63
_GOLDEN = 0x9E3779B97F4A7C15
_RTP_OFFSET = (_GOLDEN - (1 << 31)) & _MASK64
_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1

# CBOR (RFC 8949) major types, pre-shifted into the initial byte.
_CBOR_UINT = 0x00
_CBOR_NEGINT = 0x20
_CBOR_BYTES = 0x40
_CBOR_TEXT = 0x60
_CBOR_ARRAY = 0x80
_CBOR_NULL = b"\xf6"

_PACK_U8 = struct.Struct(">BB").pack
_PACK_U16 = struct.Struct(">BH").pack
_PACK_U32 = struct.Struct(">BI").pack
_PACK_U64 = struct.Struct(">BQ").pack
_UNPACK_I64 = struct.Struct(">q").unpack_from


@dataclass(frozen=True, slots=True)
class IntRange:
    """The integers ``low``..``high``, called ``name``; ``struct_code`` packs exactly those."""

    name: str
    low: int
    high: int
    struct_code: str

    def holds_all(self, values: Sequence[int]) -> bool:
        """Whether every value is an integer in the range: packing checks each one's type and range in
        one pass in C (min and max took two)."""
        try:
            struct.pack(f"<{len(values)}{self.struct_code}", *values)
        except (struct.error, TypeError):
            return False
        return True

    def problem(self, family: KeyFamily, value: int) -> str:
        """Why ``family`` cannot hash the token id ``value`` (outside the range)."""
        return f"tokens: token id {value} is not {self.name}, as the {family.value} family hashes them"

    def check_span(self, family: KeyFamily, low: int, high: int) -> None:
        """Raise ValueError naming the first bound outside the range of ids spanning ``low``..``high``."""
        if low < self.low or high > self.high:
            raise ValueError(self.problem(family, low if low < self.low else high))


INT64 = IntRange("a 64-bit integer", -(1 << 63), (1 << 63) - 1, "q")
"""A request's token ids and block cache keys."""
UINT32 = IntRange("a uint32 (0..4294967295)", 0, (1 << 32) - 1, "I")


def token_id_range(family: KeyFamily) -> IntRange:
    """The token ids ``family`` hashes; one beyond is refused (``rtp`` truncates ids to 32 bits, but
    an id is a 64-bit integer; ``vllm``'s CBOR could carry more, but no request may)."""
    match family:
        case KeyFamily.RTP | KeyFamily.VLLM:
            return INT64
        case KeyFamily.SGLANG:
            return UINT32
        case _:
            assert_never(family)


_RTP_IDS = token_id_range(KeyFamily.RTP)
_VLLM_IDS = token_id_range(KeyFamily.VLLM)
_SGLANG_IDS = token_id_range(KeyFamily.SGLANG)


def _cbor_head(major: int, value: int) -> bytes:
    """The initial byte(s) of a CBOR item: major type plus its argument in minimal width."""
    if value < 24:
        return bytes((major | value,))
    if value < 0x100:
        return _PACK_U8(major | 24, value)
    if value < 0x10000:
        return _PACK_U16(major | 25, value)
    if value < 0x100000000:
        return _PACK_U32(major | 26, value)
    return _PACK_U64(major | 27, value)


def _cbor_int(value: int) -> bytes:
    """A token id's CBOR integer; only the vllm family's ids (CBOR itself could carry ±2**64)."""
    if not _VLLM_IDS.low <= value <= _VLLM_IDS.high:  # inline: once per token id
        raise ValueError(_VLLM_IDS.problem(KeyFamily.VLLM, value))
    if value >= 0:
        return _cbor_head(_CBOR_UINT, value)
    return _cbor_head(_CBOR_NEGINT, -1 - value)


def _as_list(tokens: Sequence[int]) -> Sequence[int]:
    """The tokens as an indexable sequence, copying only when they are neither a list nor a tuple."""
    return tokens if isinstance(tokens, list | tuple) else list(tokens)


def _check_geometry(block_size: int, lookahead: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    if lookahead < 0:
        raise ValueError(f"lookahead: must be >= 0, got {lookahead}")


# --- rtp -----------------------------------------------------------------------------


def rtp_keys(tokens: Sequence[int], block_size: int) -> tuple[int, ...]:
    """The engine's rolling hash: one state across all blocks; key_i is the state after block i."""
    return join_slices(rtp_key_slices(tokens, block_size, 0))


def rtp_key_slices(tokens: Sequence[int], block_size: int, slice_blocks: int) -> Iterator[tuple[int, ...]]:
    """:func:`rtp_keys` in slices of ``slice_blocks`` blocks (0: one slice), the state carried between them."""
    _check_geometry(block_size, 0)
    toks = _as_list(tokens)
    n_blocks = len(toks) // block_size
    # Hot loop, 7 integer ops per token. The state is kept offset as g = h + 2**63, which lies in
    # [0, 2**64): then h >> 32 == (g >> 32) - 2**31 and h << 12 == (g << 12) - 2**75 exactly, and
    # h ^ x == g ^ x ^ 2**63 (mod 2**64), so the engine's step
    #     h ^= v + GOLDEN + (h << 12) + (h >> 32)
    # becomes g = (g ^ (v + offset + (g << 12) + (g >> 32))) mod 2**64, with the constants folded
    # into offset = GOLDEN - 2**31 (mod 2**64). Bits above 64 never reach the low 64 bits of +, ^
    # and <<, so one mask per token suffices, and the key is h = g - 2**63.
    offset, mask, sign = _RTP_OFFSET, _MASK64, _SIGN64
    g = sign
    for first, stop in _slices(n_blocks, slice_blocks):
        part = toks[first * block_size : stop * block_size]
        low, high = min(part), max(part)
        if low < _INT32_MIN or high > _INT32_MAX:
            # The engine truncates to 32 bits, but only the family's ids are hashed (checked here, off
            # the common path, so a Python int of any size is not hashed as one).
            _RTP_IDS.check_span(KeyFamily.RTP, low, high)
            # Truncate to signed 32 bits once, up front, so the hot loop is the same for every input.
            part = [((t & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000 for t in part]
        keys: list[int] = []
        for start in range(0, len(part), block_size):
            for t in part[start : start + block_size]:
                g = (g ^ (t + offset + (g << 12) + (g >> 32))) & mask
            keys.append(g - sign)
        yield tuple(keys)


# --- vllm ----------------------------------------------------------------------------

NONE_HASH: bytes = hashlib.sha256(_cbor_head(_CBOR_TEXT, 1) + b"0").digest()
"""The seed digest: sha256 of the CBOR text string "0"."""

_CBOR_DIGEST_HEAD = _cbor_head(_CBOR_BYTES, 32)
_CBOR_TRIPLE_HEAD = _cbor_head(_CBOR_ARRAY, 3)


def vllm_block_cbor(parent_digest: bytes, block_tokens: Sequence[int]) -> bytes:
    """Canonical CBOR of ``[parent_digest, [block_tokens...], null]`` — the bytes a vLLM block hash covers."""
    if len(parent_digest) != 32:
        raise ValueError(f"parent_digest: must be 32 bytes, got {len(parent_digest)}")
    return b"".join(
        (
            _CBOR_TRIPLE_HEAD,
            _CBOR_DIGEST_HEAD,
            parent_digest,
            _cbor_head(_CBOR_ARRAY, len(block_tokens)),
            *_encode_tokens(block_tokens),
            _CBOR_NULL,
        )
    )


def _encode_tokens(toks: Sequence[int]) -> list[bytes]:
    """Each token's CBOR integer encoding, computed once (blocks overlap when there is lookahead)."""
    out: list[bytes] = []
    append = out.append
    # Largest widths first: ids of a >64K vocabulary mostly need 4 bytes, so most tokens take one test.
    for t in toks:
        if t >= 0x10000:
            append(_PACK_U32(0x1A, t) if t < 0x100000000 else _cbor_int(t))
        elif t >= 0x100:
            append(_PACK_U16(0x19, t))
        elif t >= 24:
            append(_PACK_U8(0x18, t))
        elif t >= 0:
            append(bytes((t,)))
        else:
            append(_cbor_int(t))
    return out


def vllm_keys(tokens: Sequence[int], block_size: int, lookahead: int = 0) -> tuple[int, ...]:
    """vLLM's chained sha256 over canonical CBOR; key_i = last 8 bytes of digest_i, big-endian, signed.

    With lookahead L, block i also covers up to L following tokens (those that exist);
    the stride stays ``block_size`` and the key count stays floor(N / block_size).
    """
    return join_slices(vllm_key_slices(tokens, block_size, lookahead, 0))


def vllm_key_slices(
    tokens: Sequence[int], block_size: int, lookahead: int, slice_blocks: int
) -> Iterator[tuple[int, ...]]:
    """:func:`vllm_keys` in slices of ``slice_blocks`` blocks (0: one slice), the digest carried between them."""
    _check_geometry(block_size, lookahead)
    toks = _as_list(tokens)
    n = len(toks)
    n_blocks = n // block_size
    sha256 = hashlib.sha256
    full = block_size + lookahead
    full_head = _cbor_head(_CBOR_ARRAY, full)
    digest = NONE_HASH
    for first, stop in _slices(n_blocks, slice_blocks):
        base = first * block_size
        # A slice's last block also covers up to ``lookahead`` tokens of the next one.
        encoded = _encode_tokens(toks[base : min(n, stop * block_size + lookahead)])
        keys: list[int] = []
        for start in range(base, stop * block_size, block_size):
            end = min(start + full, n)
            # Only the last blocks can be cut short by the end of the prompt.
            array_head = full_head if end - start == full else _cbor_head(_CBOR_ARRAY, end - start)
            digest = sha256(
                b"".join(
                    (
                        _CBOR_TRIPLE_HEAD,
                        _CBOR_DIGEST_HEAD,
                        digest,
                        array_head,
                        *encoded[start - base : end - base],
                        _CBOR_NULL,
                    )
                )
            ).digest()
            keys.append(_UNPACK_I64(digest, 24)[0])
        yield tuple(keys)


# --- sglang --------------------------------------------------------------------------


def sglang_keys(tokens: Sequence[int], block_size: int, lookahead: int = 0) -> tuple[int, ...]:
    """SGLang's page hash: sha256(parent ‖ uint32-LE tokens), chained; key = first 8 bytes, BE, signed.

    With lookahead 1 (EAGLE bigrams) logical token i is the pair (t_i, t_{i+1}), so the
    logical length is N - 1 and a page of ``block_size`` logical tokens hashes 2·block_size ids.
    """
    return join_slices(sglang_key_slices(tokens, block_size, lookahead, 0))


def sglang_key_slices(
    tokens: Sequence[int], block_size: int, lookahead: int, slice_blocks: int
) -> Iterator[tuple[int, ...]]:
    """:func:`sglang_keys` in slices of ``slice_blocks`` pages (0: one slice), the parent carried between them."""
    _check_geometry(block_size, lookahead)
    if lookahead > 1:
        raise ValueError(f"lookahead: the sglang family supports only 0 or 1, got {lookahead}")
    toks = _as_list(tokens)
    n_pages = max(0, len(toks) - lookahead) // block_size
    width = 4 * block_size * (1 + lookahead)
    sha256 = hashlib.sha256
    parent = b""
    for first, stop in _slices(n_pages, slice_blocks):
        begin, used = first * block_size, stop * block_size
        ids = toks[begin : used + lookahead]
        _SGLANG_IDS.check_span(KeyFamily.SGLANG, min(ids), max(ids))
        if lookahead:
            # Interleave (t_i, t_{i+1}) for each logical position i.
            flat = [0] * (2 * (used - begin))
            flat[0::2] = ids[: used - begin]
            flat[1::2] = ids[1:]
            ids = flat
        data = struct.pack(f"<{len(ids)}I", *ids)
        keys: list[int] = []
        for offset in range(0, len(data), width):
            parent = sha256(parent + data[offset : offset + width]).digest()
            keys.append(_UNPACK_I64(parent, 0)[0])
        yield tuple(keys)


# --- slicing ---------------------------------------------------------------------------


def _slices(n_blocks: int, slice_blocks: int) -> Iterator[tuple[int, int]]:
    """``[first, stop)`` block ranges of at most ``slice_blocks`` blocks (0: all in one) covering ``n_blocks``."""
    step = slice_blocks if slice_blocks > 0 else max(1, n_blocks)
    for first in range(0, n_blocks, step):
        yield first, min(n_blocks, first + step)


def join_slices(slices: Iterator[tuple[int, ...]]) -> tuple[int, ...]:
    """Consecutive slices of keys as one tuple (the one slice itself when there is only one)."""
    first = next(slices, ())
    rest = tuple(slices)
    return first if not rest else first + tuple(itertools.chain.from_iterable(rest))


# --- dispatch ------------------------------------------------------------------------


def geometry_problems(block_size: int, family: KeyFamily, lookahead: int) -> list[Problem]:
    """Why ``family`` cannot make keys for this block size and lookahead (empty when it can).

    Named by the deployment config's fields (``block_size``, ``key_family``, ``lookahead_tokens``).
    """
    problems: list[Problem] = []
    if block_size <= 0:
        problems.append(Problem(("block_size",), f"must be > 0, got {block_size}"))
    if lookahead < 0:
        problems.append(Problem(("lookahead_tokens",), f"must be >= 0, got {lookahead}"))
    elif family is KeyFamily.SGLANG and lookahead > 1:
        problems.append(
            Problem(("key_family", "lookahead_tokens"), "the sglang key family supports lookahead 0 or 1 only")
        )
    elif family is KeyFamily.RTP and lookahead != 0:
        problems.append(Problem(("key_family", "lookahead_tokens"), "the rtp key family has no lookahead (use 0)"))
    return problems



def block_keys(
    tokens: Sequence[int], block_size: int, family: KeyFamily, lookahead: int = 0
) -> tuple[int, ...]:
    """The block keys of ``tokens`` in the deployment's family.

    Raises ValueError naming the parameter: ``block_size`` ≤ 0, ``lookahead`` < 0,
    ``lookahead`` > 1 for sglang, ``lookahead`` ≠ 0 for rtp (it has none), or a token
    id the family cannot encode (``tokens``).
    """
    return join_slices(block_key_slices(tokens, block_size, family, lookahead, 0))


def block_key_slices(
    tokens: Sequence[int], block_size: int, family: KeyFamily, lookahead: int, slice_blocks: int
) -> Iterator[tuple[int, ...]]:
    """:func:`block_keys` as consecutive slices of at most ``slice_blocks`` keys each (0: one slice).

    The chained state is carried from one slice to the next, so the slices joined are exactly
    ``block_keys``; a caller can stop between two slices and lose nothing but the rest. The
    errors of :func:`block_keys` are raised by the first ``next()`` for geometry, and by the
    slice that holds a token the family cannot encode.
    """
    match family:
        case KeyFamily.RTP:
            if lookahead != 0:
                _check_geometry(block_size, lookahead)
                raise ValueError(f"lookahead: the rtp family has no lookahead, got {lookahead}")
            return rtp_key_slices(tokens, block_size, slice_blocks)
        case KeyFamily.VLLM:
            return vllm_key_slices(tokens, block_size, lookahead, slice_blocks)
        case KeyFamily.SGLANG:
            return sglang_key_slices(tokens, block_size, lookahead, slice_blocks)
        case _:
            assert_never(family)
