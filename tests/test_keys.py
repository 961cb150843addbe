"""Block keys (router/keys.py): every golden vector of selection.md §1, plus properties."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from typing import overload

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.keys import NONE_HASH, block_keys, geometry_problems, rtp_keys, sglang_keys, vllm_block_cbor, vllm_keys
from router.types import KeyFamily

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

# --- golden vectors (selection.md §1) ----------------------------------------------------------

RTP_GOLDEN = [
    ([1, 2, 3, 4], 4, [455111481605203084]),
    (list(range(8)), 4, [455111276453135508, 6713779586671547074]),
    (list(range(10)), 4, [455111276453135508, 6713779586671547074]),
    (list(range(128)), 64, [2681637840371060507, -6990124544746687103]),
    ([-1, 7], 2, [-8366447769517733439]),
    ([0], 1, [-7046029254386353131]),
]

VLLM_GOLDEN = [
    ([1, 2, 3, 4], 4, 0, [2164874634404590027]),
    (list(range(128)), 64, 0, [-7527834946346035334, -7860823284622341314]),
    (list(range(130)), 64, 0, [-7527834946346035334, -7860823284622341314]),
    (list(range(1, 10)), 4, 1, [2771287707320467766, -4525836348354197114]),
    ([0, 23, 24, 255, 256, 65535, 65536, 2147483647], 8, 0, [2377946987338068860]),
    ([1, 2], 4, 0, []),
]

SGLANG_GOLDEN = [
    ([1, 2, 3, 4, 5], 4, 0, [-3488128144981237669]),
    ([1, 2, 3, 4, 5, 6, 7, 8], 4, 0, [-3488128144981237669, 5674439469042975057]),
    ([10, 20, 30, 40, 50], 2, 1, [-8847804484166691499, 4989791362144317498]),
    ([10, 20, 30, 40, 99], 4, 1, [8258502975543156532]),
]


@pytest.mark.parametrize(("tokens", "bs", "expected"), RTP_GOLDEN)
def test_rtp_golden(tokens: list[int], bs: int, expected: list[int]) -> None:
    assert rtp_keys(tokens, bs) == tuple(expected)
    assert block_keys(tokens, bs, KeyFamily.RTP) == tuple(expected)


def test_rtp_golden_from_range() -> None:
    assert rtp_keys(range(8), 4) == (455111276453135508, 6713779586671547074)


@pytest.mark.parametrize(("tokens", "bs", "lookahead", "expected"), VLLM_GOLDEN)
def test_vllm_golden(tokens: list[int], bs: int, lookahead: int, expected: list[int]) -> None:
    assert vllm_keys(tokens, bs, lookahead) == tuple(expected)
    assert block_keys(tokens, bs, KeyFamily.VLLM, lookahead) == tuple(expected)


@pytest.mark.parametrize(("tokens", "bs", "lookahead", "expected"), SGLANG_GOLDEN)
def test_sglang_golden(tokens: list[int], bs: int, lookahead: int, expected: list[int]) -> None:
    assert sglang_keys(tokens, bs, lookahead) == tuple(expected)
    assert block_keys(tokens, bs, KeyFamily.SGLANG, lookahead) == tuple(expected)


def test_none_hash_is_sha256_of_cbor_text_zero() -> None:
    assert hashlib.sha256(b"\x61\x30").digest() == NONE_HASH
    assert NONE_HASH.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"


def test_vllm_first_block_digest_golden() -> None:
    digest = hashlib.sha256(vllm_block_cbor(NONE_HASH, [1, 2, 3, 4])).digest()
    assert digest.hex() == "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb"
    # The key is the digest's last 8 bytes, big-endian, signed.
    assert int.from_bytes(digest[24:], "big", signed=True) == 2164874634404590027


def test_vllm_cbor_bytes_golden() -> None:
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2147483647]
    expected = (
        "8358204e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
        "880017181818ff19010019ffff1a000100001a7ffffffff6"
    )
    payload = vllm_block_cbor(NONE_HASH, tokens)
    assert payload.hex() == expected
    assert vllm_keys(tokens, 8) == (
        int.from_bytes(hashlib.sha256(payload).digest()[24:], "big", signed=True),
    )


@pytest.mark.parametrize(
    ("token", "encoding"),
    [
        (-1, "20"),
        (-24, "37"),
        (-25, "3818"),
        (-256, "38ff"),
        (-257, "390100"),
        (-65536, "39ffff"),
        (-65537, "3a00010000"),
        (-(1 << 32), "3affffffff"),
        (-(1 << 32) - 1, "3b0000000100000000"),
        ((1 << 32) - 1, "1affffffff"),
        (1 << 32, "1b0000000100000000"),
        ((1 << 63) - 1, "1b7fffffffffffffff"),
        (-(1 << 63), "3b7fffffffffffffff"),
    ],
)
def test_vllm_cbor_integer_widths(token: int, encoding: str) -> None:
    """Negative ids use major type 1; every width is minimal (RFC 8949 canonical)."""
    payload = vllm_block_cbor(NONE_HASH, [token])
    assert payload.hex() == "835820" + NONE_HASH.hex() + "81" + encoding + "f6"


def test_vllm_cbor_array_header_widths() -> None:
    assert vllm_block_cbor(NONE_HASH, [0] * 23)[35:36].hex() == "97"
    assert vllm_block_cbor(NONE_HASH, [0] * 24)[35:37].hex() == "9818"
    assert vllm_block_cbor(NONE_HASH, [0] * 256)[35:38].hex() == "990100"
    assert vllm_block_cbor(NONE_HASH, [0] * 65535)[35:38].hex() == "99ffff"
    assert vllm_block_cbor(NONE_HASH, [0] * 65536)[35:40].hex() == "9a00010000"
    assert len(vllm_keys([0] * 65536, 65536)) == 1  # a block of 65,536 tokens: a 4-byte array header


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(KeyFamily))
@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_must_be_positive(family: KeyFamily, block_size: int) -> None:
    with pytest.raises(ValueError, match=r"^block_size:"):
        block_keys([1, 2, 3], block_size, family)


@pytest.mark.parametrize("family", list(KeyFamily))
def test_negative_lookahead_rejected(family: KeyFamily) -> None:
    with pytest.raises(ValueError, match=r"^lookahead:"):
        block_keys([1, 2, 3], 1, family, -1)


def test_sglang_lookahead_above_one_rejected() -> None:
    with pytest.raises(ValueError, match=r"^lookahead: .*0 or 1"):
        block_keys([1, 2, 3], 1, KeyFamily.SGLANG, 2)


def test_rtp_has_no_lookahead() -> None:
    with pytest.raises(ValueError, match=r"^lookahead: the rtp family"):
        block_keys([1, 2, 3], 1, KeyFamily.RTP, 1)


@pytest.mark.parametrize("token", [-1, 1 << 32])
def test_sglang_rejects_ids_outside_uint32(token: int) -> None:
    with pytest.raises(ValueError, match=r"^tokens:"):
        sglang_keys([1, token], 2)


def test_sglang_hashes_every_uint32_id() -> None:
    assert sglang_keys([0xFFFFFFFF] * 4, 4) == (6541097565471264777,)
    assert sglang_keys([0] * 4, 4) == sglang_keys([0, 0, 0, 0, 0xFFFFFFFF], 4)


@pytest.mark.parametrize("token", [1 << 63, -(1 << 63) - 1, 1 << 64, -(1 << 64) - 1])
def test_vllm_rejects_ids_beyond_64_bits(token: int) -> None:
    """A token id is a signed 64-bit integer; CBOR could carry up to 2**64 - 1 and down to -2**64, and
    the vllm family hashed those, where every other check refuses them."""
    with pytest.raises(ValueError, match=rf"^tokens: token id {token} is not a 64-bit integer"):
        vllm_keys([1, token], 2)
    with pytest.raises(ValueError, match=r"^tokens:"):
        vllm_block_cbor(NONE_HASH, [token])


def test_vllm_parent_digest_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match=r"^parent_digest:"):
        vllm_block_cbor(b"\x00" * 31, [1])


# --- independent references, written straight from the spec text ------------------------------


def reference_rtp(tokens: Sequence[int], bs: int) -> list[int]:
    mask = (1 << 64) - 1

    def signed(x: int) -> int:
        x &= mask
        return x - (1 << 64) if x >= 1 << 63 else x

    h = 0
    keys = []
    for i, t in enumerate(tokens):
        v = signed(t & 0xFFFFFFFF if t & 0x80000000 == 0 else (t & 0xFFFFFFFF) - (1 << 32))
        h = signed(h ^ ((v + 0x9E3779B97F4A7C15 + (h << 12) + (h >> 32)) & mask))
        if (i + 1) % bs == 0:
            keys.append(h)
    return keys


def reference_vllm(tokens: Sequence[int], bs: int, lookahead: int) -> list[int]:
    n = len(tokens)
    digest = NONE_HASH
    keys = []
    for i in range(n // bs):
        window = tokens[i * bs : i * bs + bs + min(lookahead, n - i * bs - bs)]
        digest = hashlib.sha256(vllm_block_cbor(digest, window)).digest()
        keys.append(int.from_bytes(digest[-8:], "big", signed=True))
    return keys


def reference_sglang(tokens: Sequence[int], bs: int, lookahead: int) -> list[int]:
    if lookahead:
        logical: list[tuple[int, ...]] = list(itertools.pairwise(tokens))
    else:
        logical = [(t,) for t in tokens]
    parent = b""
    keys = []
    for p in range(len(logical) // bs):
        hasher = hashlib.sha256(parent)
        for ids in logical[p * bs : (p + 1) * bs]:
            for t in ids:
                hasher.update(t.to_bytes(4, "little", signed=False))
        parent = hasher.digest()
        keys.append(int.from_bytes(parent[:8], "big", signed=True))
    return keys


vocab_ids = st.integers(min_value=0, max_value=152_063)
any_ids = st.one_of(vocab_ids, st.integers(min_value=-(1 << 40), max_value=1 << 40))
block_sizes = st.integers(min_value=1, max_value=9)
lookaheads = st.integers(min_value=0, max_value=5)


@given(st.lists(any_ids, max_size=80), block_sizes)
def test_rtp_matches_spec_reference(tokens: list[int], bs: int) -> None:
    """Includes ids outside int32, which the engine truncates to 32 bits and sign-extends."""
    assert list(rtp_keys(tokens, bs)) == reference_rtp(tokens, bs)


@given(
    st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), max_size=60), block_sizes, lookaheads
)
def test_vllm_matches_spec_reference(tokens: list[int], bs: int, lookahead: int) -> None:
    assert list(vllm_keys(tokens, bs, lookahead)) == reference_vllm(tokens, bs, lookahead)


@given(st.lists(st.integers(min_value=0, max_value=0xFFFFFFFF), max_size=60), block_sizes, st.integers(0, 1))
def test_sglang_matches_spec_reference(tokens: list[int], bs: int, lookahead: int) -> None:
    assert list(sglang_keys(tokens, bs, lookahead)) == reference_sglang(tokens, bs, lookahead)


# --- properties ----------------------------------------------------------------------------------

FAMILY_LOOKAHEAD = st.sampled_from(
    [(KeyFamily.RTP, 0), (KeyFamily.VLLM, 0), (KeyFamily.VLLM, 1), (KeyFamily.VLLM, 3), (KeyFamily.SGLANG, 0),
     (KeyFamily.SGLANG, 1)]
)  # fmt: skip


def expected_key_count(n_tokens: int, bs: int, family: KeyFamily, lookahead: int) -> int:
    """floor(N / bs); sglang's logical length is N - lookahead (its bigrams need a next token)."""
    if family is KeyFamily.SGLANG:
        return max(0, n_tokens - lookahead) // bs
    return n_tokens // bs


@given(st.lists(vocab_ids, max_size=120), block_sizes, FAMILY_LOOKAHEAD)
def test_key_count_and_signed_64_bit(
    tokens: list[int], bs: int, family_lookahead: tuple[KeyFamily, int]
) -> None:
    family, lookahead = family_lookahead
    keys = block_keys(tokens, bs, family, lookahead)
    assert len(keys) == expected_key_count(len(tokens), bs, family, lookahead)
    assert all(type(k) is int and INT64_MIN <= k <= INT64_MAX for k in keys)


@given(st.lists(vocab_ids, min_size=1, max_size=120), block_sizes, st.data())
def test_prefix_stability_rtp_sglang_and_vllm_without_lookahead(
    tokens: list[int], bs: int, data: st.DataObject
) -> None:
    """rtp, vllm with lookahead 0, sglang with lookahead 0 or 1: a prefix's keys are a prefix of the keys.

    sglang with lookahead 1 stays fully stable because it gives no key to a page whose last
    bigram would need a token past the prefix (its logical length is N - 1).
    """
    cut = data.draw(st.integers(min_value=0, max_value=len(tokens)), label="prefix length")
    for family, lookahead in [
        (KeyFamily.RTP, 0),
        (KeyFamily.VLLM, 0),
        (KeyFamily.SGLANG, 0),
        (KeyFamily.SGLANG, 1),
    ]:
        full = block_keys(tokens, bs, family, lookahead)
        prefix = block_keys(tokens[:cut], bs, family, lookahead)
        assert full[: len(prefix)] == prefix, (family, lookahead)


@given(st.lists(vocab_ids, min_size=1, max_size=120), block_sizes, st.integers(1, 6), st.data())
def test_prefix_stability_vllm_with_lookahead(
    tokens: list[int], bs: int, lookahead: int, data: st.DataObject
) -> None:
    """vllm with lookahead L: of a p-token prefix's floor(p/bs) keys, exactly the first floor((p - L)/bs)
    are the full prompt's keys. A later prefix key hashed a window cut short by the prefix's end, so when
    the prompt goes on inside that window the key differs — and, chained, so does every key after it.
    """
    cut = data.draw(st.integers(min_value=0, max_value=len(tokens)), label="prefix length")
    full = vllm_keys(tokens, bs, lookahead)
    prefix = vllm_keys(tokens[:cut], bs, lookahead)
    stable = max(0, cut - lookahead) // bs
    assert len(prefix) == cut // bs
    assert prefix[:stable] == full[:stable]
    if cut < len(tokens):
        # Lower bound of the property: the unstable tail really differs (sha256 collisions aside).
        assert all(p != f for p, f in zip(prefix[stable:], full[stable:], strict=False))
    else:
        assert prefix == full


class CountingSequence(Sequence[int]):
    """A Sequence that counts how often it is walked and indexed."""

    def __init__(self, items: list[int]) -> None:
        self._items = items
        self.iterations = 0
        self.index_calls = 0

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        self.index_calls += 1
        return self._items[index]

    def __iter__(self) -> Iterator[int]:
        self.iterations += 1
        return iter(self._items)


@pytest.mark.parametrize(
    ("family", "lookahead"), [(KeyFamily.RTP, 0), (KeyFamily.VLLM, 2), (KeyFamily.SGLANG, 1)]
)
def test_tokens_are_converted_once(family: KeyFamily, lookahead: int) -> None:
    """review-lessons §20: a non-list input is walked exactly once, never indexed token by token."""
    items = list(range(1000, 1100))
    seq = CountingSequence(items)
    assert block_keys(seq, 16, family, lookahead) == block_keys(items, 16, family, lookahead)
    assert seq.iterations == 1
    assert seq.index_calls == 0


def test_rtp_refuses_a_token_id_beyond_64_bits_it_would_truncate() -> None:
    """The engine truncates ids to 32 bits, but an id is a 64-bit integer: one beyond is no id (a
    request of them routed as a well-formed prompt, while with nothing hashing them it was refused)."""
    assert block_keys([2**40] * 4, 4, KeyFamily.RTP) == block_keys([2**40 & 0xFFFFFFFF] * 4, 4, KeyFamily.RTP)
    # The extremes are ids, truncated as any other: 2**63 - 1 to -1, -2**63 to 0.
    assert rtp_keys([2**63 - 1, 0, 0, 0], 4) == rtp_keys([-1, 0, 0, 0], 4)
    assert rtp_keys([-(2**63), 0, 0, 0], 4) == rtp_keys([0, 0, 0, 0], 4)
    for beyond in (2**63, -(2**63) - 1, 2**70):
        with pytest.raises(ValueError, match=f"token id {beyond} is not a 64-bit integer"):
            block_keys([1, 2, beyond, 4], 4, KeyFamily.RTP)


def test_geometry_problems_name_each_field_of_a_geometry_no_family_can_hash() -> None:
    """A total check of its own: the settings reach it only with ranged values, an embedder with any."""
    assert geometry_problems(64, KeyFamily.SGLANG, 1) == []
    assert [p.fields for p in geometry_problems(0, KeyFamily.VLLM, 0)] == [("block_size",)]
    assert [p.fields for p in geometry_problems(-1, KeyFamily.RTP, -1)] == [("block_size",), ("lookahead_tokens",)]
    assert [p.fields for p in geometry_problems(64, KeyFamily.SGLANG, 2)] == [("key_family", "lookahead_tokens")]
    assert [p.fields for p in geometry_problems(64, KeyFamily.RTP, 1)] == [("key_family", "lookahead_tokens")]
