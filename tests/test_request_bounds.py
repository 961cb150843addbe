"""Hostile-but-legal requests: the bounds on every variable field, seq_len against the prompt, the reply
margin, and long prompts hashed in slices that neither hold up other requests nor outlive their own.

The pure rules are tested as functions; the slicing through the real router under MockClock with an
in-memory cluster. A long prompt's progress is observed through the token tuple itself: hashing reads
it one slice at a time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, SupportsIndex, overload

import numpy
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.kvcm import KvcmFaults
from router.api import open_router
from router.config import (
    DeploymentConfig,
    DiscoveryConfig,
    KvrouteConfig,
    LimitsConfig,
    ProberConfig,
    RouterConfig,
    ScorerConfig,
    ServeConfig,
    UpstreamTlsConfig,
)
from router.keys import block_key_slices, block_keys, join_slices
from router.problems import ConfigError
from router.request import (
    check_admissible,
    check_request,
    check_roles,
    is_sliced,
    key_slices,
    prepare_request,
    request_deadline,
    sheddable,
)
from router.sidecar import check_proto_bounds
from router.supervisor import RouterHandle
from router.transport.memory_adapter import MemoryNetwork
from router.types import BadRequest, KeyFamily, Reason, Role, RouteRequest
from router.wire import router_v1_pb2
from router.wire.decode import encode_block_keys

BLOCK = 16
DEPLOYMENT = DeploymentConfig(block_size=BLOCK)
LIMITS = LimitsConfig()
MAX_PROMPT = tuple(range(LIMITS.max_prompt_tokens))
SLICES_OF_MAX_PROMPT = LIMITS.max_prompt_tokens // LIMITS.hash_slice_tokens


def refused(request: RouteRequest, limits: LimitsConfig = LIMITS) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        prepare_request(request, DEPLOYMENT, limits)
    return info.value


# --- bounds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (KvrouteConfig(router=RouterConfig(budget_cap_ms=float("nan"))), r"router\.budget_cap_ms: must be a finite"),
        (KvrouteConfig(router=RouterConfig(max_in_flight=0)), r"router\.max_in_flight: must be > 0"),
        (KvrouteConfig(limits=LimitsConfig(max_prompt_tokens=0)), r"limits\.max_prompt_tokens: must be > 0"),
        (KvrouteConfig(deployment=DeploymentConfig(block_size=0)), r"deployment\.block_size: must be > 0"),
        # The close waited on a NaN drain bound (ValueError from trio after serving), and the warnings'
        # logger refused its interval naming no field.
        (KvrouteConfig(serve=ServeConfig(drain_timeout_s=float("nan"))), r"serve\.drain_timeout_s: must be a finite"),
        (KvrouteConfig(serve=ServeConfig(log_aggregate_interval_s=0)), r"serve\.log_aggregate_interval_s: must be > 0"),
        # A setting's form, which only the loaders checked: a bare UnicodeEncodeError at the first request.
        (KvrouteConfig(serve=ServeConfig(debug_token="tøken")), r"serve\.debug_token: must be printable ASCII"),
        # grpc's core aborted the whole process at the first channel (no exception to catch).
        (
            KvrouteConfig(upstream_tls=UpstreamTlsConfig(ca="/etc/ca.pem", cert="/etc/client.pem")),
            r"upstream_tls\.cert, upstream_tls\.key: a certificate without its private key",
        ),
        # A value of another type: a str or None raised a bare TypeError from the range check; a float
        # where an int goes opened, then refused well-formed long prompts as the caller's bad token_ids.
        (
            KvrouteConfig(limits=LimitsConfig(hash_slice_tokens="2048")),  # type: ignore[arg-type]
            r"limits\.hash_slice_tokens: expected an integer, got '2048'",
        ),
        (
            KvrouteConfig(limits=LimitsConfig(hash_slice_tokens=2048.0)),  # type: ignore[arg-type]
            r"limits\.hash_slice_tokens: expected an integer, got 2048\.0",
        ),
        (KvrouteConfig(router=RouterConfig(budget_cap_ms=True)), r"router\.budget_cap_ms: expected a number, got True"),
        (KvrouteConfig(router=None), r"invalid router configuration: must be a RouterConfig, got a NoneType"),  # type: ignore[arg-type]
        # The actors' own sections too: their checks compared a str (TypeError) or took a float.
        (KvrouteConfig(prober=ProberConfig(fresh_ttl_s="1")), r"prober\.fresh_ttl_s: expected a number, got '1'"),  # type: ignore[arg-type]
        (KvrouteConfig(scorer=ScorerConfig(near_tie_tokens=1.5)), r"scorer\.near_tie_tokens: expected an integer"),  # type: ignore[arg-type]
        (KvrouteConfig(prober=None), r"invalid prober configuration: must be a ProberConfig"),  # type: ignore[arg-type]
    ],
    ids=[
        "nan-budget-cap", "no-request-in-flight", "no-prompt-token", "no-block-size", "nan-drain", "no-log-interval",
        "debug-token-not-ascii", "client-cert-without-key", "str-for-int", "float-for-int", "bool-for-float",
        "no-section", "actor-str-for-float", "actor-float-for-int", "no-actor-section",
    ],
)
async def test_a_configuration_built_in_code_is_refused_naming_the_field(config: KvrouteConfig, named: str) -> None:
    """An embedder's KvrouteConfig reaches open_router without the settings' validation, and the
    router and limits sections were refused by nobody: a NaN budget cap answered every request
    internal_error, no request in flight answered every one overloaded."""
    with pytest.raises(ConfigError, match=named):
        async with open_router(config, rpc=MemoryNetwork()):
            raise AssertionError("the router started")



async def test_a_configuration_built_in_code_may_use_numpy_numbers_and_a_list_of_roles() -> None:
    """What worked before the types were checked still opens: a number of another library's type, a
    list where a tuple of members goes."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=numpy.int64(BLOCK), roles=[Role.PREFILL]),  # type: ignore[arg-type]
        router=RouterConfig(budget_cap_ms=numpy.float64(50.0)),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    async with open_router(config, rpc=network) as handle:
        assert (await handle.route(RouteRequest("r", token_ids=tuple(range(4 * BLOCK))))).worker is not None


def test_the_largest_legal_request_is_accepted_and_one_more_is_refused_naming_the_bound() -> None:
    assert len(prepare_request(RouteRequest("r", token_ids=MAX_PROMPT), DEPLOYMENT).keys) == len(MAX_PROMPT) // BLOCK
    over = refused(RouteRequest("r", token_ids=(*MAX_PROMPT, 1)))
    assert over.field_name == "token_ids"
    assert "262144" in str(over) and "--max-prompt-tokens" in str(over)

    keys = tuple(range(LIMITS.max_block_keys))
    assert prepare_request(RouteRequest("r", block_cache_keys=keys), DEPLOYMENT).keys == keys
    assert refused(RouteRequest("r", block_cache_keys=(*keys, 1))).field_name == "block_cache_keys"

    roles = (Role.PREFILL,) * LIMITS.max_roles
    # Accepted, each role once (a repeated companion role used to give repeated addresses).
    assert prepare_request(RouteRequest("r", token_ids=(1,), roles=roles), DEPLOYMENT).roles == (Role.PREFILL,)
    assert refused(RouteRequest("r", token_ids=(1,), roles=(*roles, Role.PREFILL))).field_name == "roles"

    rid = "x" * LIMITS.max_request_id_bytes
    assert prepare_request(RouteRequest(rid, token_ids=(1,)), DEPLOYMENT).seq_len == 1
    long_id = refused(RouteRequest(rid + "x", token_ids=(1,)))
    assert long_id.field_name == "request_id" and "256 UTF-8 bytes" in str(long_id)
    assert rid not in str(long_id)  # the id is not echoed back


def test_a_blank_request_id_is_refused_naming_it() -> None:
    for blank in (" ", "\t\n", "\u3000"):
        err = refused(RouteRequest(blank, token_ids=(1,)))
        assert err.field_name == "request_id" and "blank" in str(err), err
    assert prepare_request(RouteRequest(" r ", token_ids=(1,)), DEPLOYMENT).seq_len == 1


def test_request_id_is_measured_in_utf8_bytes() -> None:
    limits = LimitsConfig(max_request_id_bytes=4)
    assert prepare_request(RouteRequest("éé", token_ids=(1,)), DEPLOYMENT, limits).seq_len == 1
    assert refused(RouteRequest("éée", token_ids=(1,)), limits).field_name == "request_id"
    lone = refused(RouteRequest("\ud800\ud800", token_ids=(1,)), limits)
    assert lone.field_name == "request_id" and "unpaired surrogate '\\ud800' at index 0" in str(lone), lone
    # Within the length limit too: the id goes out as UTF-8 (KVCM's trace_id, the master's request).
    assert refused(RouteRequest("a\udc80", token_ids=(1,)), limits).field_name == "request_id"


def test_keys_may_not_cover_more_than_the_longest_prompt() -> None:
    limits = LimitsConfig(max_prompt_tokens=64)
    assert prepare_request(RouteRequest("r", block_cache_keys=(1, 2), block_size=32), DEPLOYMENT, limits).seq_len == 64
    assert refused(RouteRequest("r", block_cache_keys=(1, 2, 3), block_size=32), limits).field_name == (
        "block_cache_keys"
    )
    assert refused(RouteRequest("r", block_cache_keys=(1,), block_size=65), limits).field_name == "block_size"


def test_a_block_size_is_positive_and_at_most_the_longest_prompt() -> None:
    assert refused(RouteRequest("r", block_cache_keys=(1, 2), block_size=0)).field_name == "block_size"
    longest = LIMITS.max_prompt_tokens
    assert prepare_request(RouteRequest("r", block_cache_keys=(1,), block_size=longest), DEPLOYMENT).seq_len == longest
    over = refused(RouteRequest("r", block_cache_keys=(1,), block_size=longest + 1))
    assert over.field_name == "block_size" and "--max-prompt-tokens" in str(over)


def test_the_longest_prompt_may_say_its_seq_len_in_either_form() -> None:
    longest = LIMITS.max_prompt_tokens
    given = RouteRequest("r", token_ids=MAX_PROMPT, seq_len=longest)
    assert prepare_request(given, DEPLOYMENT, hash_tokens=False).seq_len == longest
    assert prepare_request(RouteRequest("r", block_cache_keys=(1,), seq_len=longest), DEPLOYMENT).seq_len == longest
    over = refused(RouteRequest("r", block_cache_keys=(1,), seq_len=longest + 1))
    assert over.field_name == "seq_len" and "--max-prompt-tokens" in str(over)


class CountedRoles(Sequence[Role]):
    """Roles that say there are very many, and count the items read."""

    def __init__(self) -> None:
        self.read = 0

    def __len__(self) -> int:
        return 10**9

    @overload
    def __getitem__(self, index: int) -> Role: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Role]: ...
    def __getitem__(self, index: int | slice) -> Role | Sequence[Role]:
        self.read += 1
        if isinstance(index, slice) or index >= 4:  # a walk ends soon, so a test of the walk ends too
            raise IndexError(index)
        return Role.PREFILL


def test_too_many_roles_are_refused_before_any_is_read() -> None:
    """A caller's sequence of roles is counted before its items are looked at one by one."""
    roles = CountedRoles()
    assert refused(RouteRequest("r", token_ids=(1,), roles=roles)).field_name == "roles"  # type: ignore[arg-type]
    assert roles.read == 0


def test_roles_given_as_a_string_are_refused_naming_them() -> None:
    """A str is a sequence, but of characters: an empty one named no role and took the deployment's."""
    for text in ("", "PREFILL"):
        assert refused(RouteRequest("r", token_ids=(1,), roles=text)).field_name == "roles"  # type: ignore[arg-type]


# --- seq_len -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_",
    [
        RouteRequest("r", token_ids=tuple(range(1024)), seq_len=5),
        RouteRequest("r", token_ids=tuple(range(1024)), seq_len=1025),
        RouteRequest("r", token_ids=tuple(range(1024)), seq_len=2**32 - 1),
        RouteRequest("r", block_cache_keys=tuple(range(64)), seq_len=5),  # 64 keys cover 1,024 tokens
        RouteRequest("r", block_cache_keys=tuple(range(64)), seq_len=2**32 - 1),
    ],
)
def test_a_seq_len_the_prompt_contradicts_is_refused(request_: RouteRequest) -> None:
    assert refused(request_).field_name == "seq_len"


@pytest.mark.parametrize("bad_key", [2**63, -(2**63) - 1, 1.5, "7", True, None, pytest.param(10**5000, id="huge")])
def test_a_key_that_is_not_a_signed_64_bit_integer_is_refused(bad_key: object) -> None:
    """A bool among them: an int to Python, but no key on the wire (the KVCM query's encoding refused it
    once the request was admitted, and the request was answered as an internal error)."""
    keys = (-(2**63), 2**63 - 1)  # the extremes are keys
    assert prepare_request(RouteRequest("r", block_cache_keys=keys), DEPLOYMENT).keys == keys
    bad = RouteRequest("r", block_cache_keys=(1, bad_key, 2))  # type: ignore[arg-type]
    error = refused(bad)
    assert error.field_name == "block_cache_keys"
    assert len(str(error)) < 200  # the key is not quoted back, however large
    assert sheddable(bad, DEPLOYMENT, LIMITS) is None  # refused under overload too, never shed


def test_the_caller_s_keys_reach_the_query_as_the_checks_encoded_them() -> None:
    keys = (5, -(2**63), 2**63 - 1)
    prepared = prepare_request(RouteRequest("r", block_cache_keys=keys), DEPLOYMENT)
    assert prepared.encoded_keys == encode_block_keys(keys)
    hashed = prepare_request(RouteRequest("r", token_ids=tuple(range(3 * BLOCK))), DEPLOYMENT)
    assert hashed.keys and hashed.encoded_keys is None  # the router's own keys: the query encodes them


def test_seq_len_agreeing_with_the_prompt_is_taken() -> None:
    tokens = tuple(range(1024))
    assert prepare_request(RouteRequest("r", token_ids=tokens, seq_len=1024), DEPLOYMENT).seq_len == 1024
    assert prepare_request(RouteRequest("r", token_ids=tokens), DEPLOYMENT).seq_len == 1024
    keys = tuple(range(64))
    # With keys, a tail shorter than a block (or blocks without keys) may follow.
    assert prepare_request(RouteRequest("r", block_cache_keys=keys, seq_len=1030), DEPLOYMENT).seq_len == 1030
    assert prepare_request(RouteRequest("r", block_cache_keys=keys), DEPLOYMENT).seq_len == 1024


def test_an_empty_prompt_is_refused_in_either_form() -> None:
    assert refused(RouteRequest("r", token_ids=())).field_name == "token_ids"
    for empty in (RouteRequest("r", block_cache_keys=()), RouteRequest("r", block_cache_keys=(), seq_len=0)):
        err = refused(empty)
        assert err.field_name == "block_cache_keys" and "must not be empty" in str(err), err
    # A prompt shorter than one block has no key: empty keys with its length (a decision log's record).
    assert prepare_request(RouteRequest("r", block_cache_keys=(), seq_len=5), DEPLOYMENT).seq_len == 5


# --- slices ------------------------------------------------------------------------------------------

FAMILIES = [(KeyFamily.RTP, 0), (KeyFamily.VLLM, 0), (KeyFamily.VLLM, 3), (KeyFamily.SGLANG, 0), (KeyFamily.SGLANG, 1)]


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=200),
    st.integers(1, 9),
    st.integers(1, 7),
    st.sampled_from(FAMILIES),
)
def test_slices_joined_are_the_keys(
    tokens: list[int], block_size: int, slice_blocks: int, family: tuple[KeyFamily, int]
) -> None:
    kind, lookahead = family
    slices = list(block_key_slices(tokens, block_size, kind, lookahead, slice_blocks))
    assert all(len(part) <= slice_blocks for part in slices)
    assert join_slices(iter(slices)) == block_keys(tokens, block_size, kind, lookahead)


def test_a_short_prompt_is_one_slice_and_a_long_one_many() -> None:
    short = check_request(RouteRequest("r", token_ids=tuple(range(LIMITS.hash_slice_tokens))), DEPLOYMENT, LIMITS)
    assert not is_sliced(short, LIMITS.hash_slice_tokens)
    assert len(list(key_slices(short, LIMITS.hash_slice_tokens))) == 1
    long = check_request(RouteRequest("r", token_ids=MAX_PROMPT), DEPLOYMENT, LIMITS)
    assert is_sliced(long, LIMITS.hash_slice_tokens)
    assert len(list(key_slices(long, LIMITS.hash_slice_tokens))) == SLICES_OF_MAX_PROMPT


def test_a_token_the_family_cannot_encode_is_refused_from_its_slice() -> None:
    deployment = DeploymentConfig(block_size=BLOCK, key_family=KeyFamily.SGLANG)
    tokens = (*range(4 * BLOCK), -1, *range(BLOCK))
    checked = check_request(RouteRequest("r", token_ids=tokens), deployment, LIMITS)
    slices = key_slices(checked, BLOCK)
    assert len(next(slices)) == 1  # the first slice is fine
    with pytest.raises(BadRequest) as info:
        list(slices)
    assert info.value.field_name == "token_ids"
    # The field is named once, not again by the hashing's own parameter name.
    assert str(info.value) == "token_ids: token id -1 is not a uint32 (0..4294967295), as the sglang family hashes them"


@pytest.mark.parametrize("family", list(KeyFamily))
@pytest.mark.parametrize("odd", ["7", 7.0, None, b"7"])
def test_a_token_id_that_is_no_integer_is_a_bad_request_not_a_router_bug(family: KeyFamily, odd: object) -> None:
    """A Python caller's list can hold anything: the hashing finds it, and the field is named."""
    deployment = DeploymentConfig(block_size=BLOCK, key_family=family)
    tokens: tuple[Any, ...] = (*range(2 * BLOCK), odd, *range(BLOCK))
    checked = check_request(RouteRequest("r", token_ids=tokens), deployment, LIMITS)
    with pytest.raises(BadRequest) as info:
        list(key_slices(checked, BLOCK))
    assert info.value.field_name == "token_ids"


@pytest.mark.parametrize("family", list(KeyFamily))
def test_numpy_integer_token_ids_hash_as_the_same_python_ints(family: KeyFamily) -> None:
    """A Python caller's token ids as numpy int64, all of them or one in a later slice: numpy's fixed
    width overflows the rtp hash's arithmetic, yet the keys are those of the same Python ints."""
    deployment = DeploymentConfig(block_size=BLOCK, key_family=family)
    plain = tuple(range(1000, 1000 + 5 * BLOCK))
    expected = join_slices(key_slices(check_request(RouteRequest("r", token_ids=plain), deployment, LIMITS), BLOCK))
    assert expected
    all_numpy = tuple(numpy.array(plain, dtype=numpy.int64))
    for tokens in (all_numpy, (*plain[: 3 * BLOCK], *all_numpy[3 * BLOCK :])):
        checked = check_request(RouteRequest("r", token_ids=tokens), deployment, LIMITS)
        assert join_slices(key_slices(checked, BLOCK)) == expected


class _IndexOnly:
    """An integer only through ``__index__`` (as ``operator.index``, struct and json's default read it)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("family", list(KeyFamily))
def test_a_token_id_that_is_an_integer_through_index_hashes_as_that_int_and_may_be_shed(family: KeyFamily) -> None:
    """The shed check's packer took such an id and the hashing refused it: the request was refused
    ``bad_request`` at normal load and shed ``overloaded``, with a worker charged, under a full cap."""
    deployment = DeploymentConfig(block_size=BLOCK, key_family=family)
    plain = tuple(range(1000, 1000 + 5 * BLOCK))
    expected = join_slices(key_slices(check_request(RouteRequest("r", token_ids=plain), deployment, LIMITS), BLOCK))
    for at in (0, 4 * BLOCK + 1):  # the first slice, the last
        tokens: tuple[Any, ...] = (*plain[:at], _IndexOnly(plain[at]), *plain[at + 1 :])
        request = RouteRequest("r", token_ids=tokens)
        assert join_slices(key_slices(check_request(request, deployment, LIMITS), BLOCK)) == expected
        assert sheddable(request, deployment, LIMITS) == len(tokens)


# --- the reply margin ----------------------------------------------------------------------------------


def test_the_router_decides_the_reply_margin_before_an_absolute_deadline() -> None:
    request = RouteRequest("r", token_ids=(1,), deadline=10.020)
    assert request_deadline(request, 10.0, 50.0, reply_margin_ms=1.0) == pytest.approx(10.019)
    # A budget or the cap that ends earlier still wins; the margin is not taken from them.
    assert request_deadline(RouteRequest("r", budget_ms=5, deadline=10.020), 10.0, 50.0, 1.0) == pytest.approx(10.005)
    assert request_deadline(RouteRequest("r", budget_ms=5), 10.0, 50.0, 1.0) == pytest.approx(10.005)
    assert request_deadline(RouteRequest("r", deadline=11.0), 10.0, 50.0, 1.0) == pytest.approx(10.050)
    # A budget past the cap is capped.
    assert request_deadline(RouteRequest("r", token_ids=(1,), budget_ms=10_000), 100.0, 50.0) == pytest.approx(100.05)


async def test_a_caller_deadline_is_answered_a_margin_early(autojump_clock: trio.testing.MockClock) -> None:
    """KVCM hangs: the decision comes by deadline − margin, not by the deadline."""
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, reply_margin_ms=3.0) as handle:
        leader = cluster.kvcm.leader
        assert leader is not None
        cluster.kvcm.set_faults(leader, KvcmFaults(hang=True))
        start = trio.current_time()
        decision = await handle.route(RouteRequest("r", token_ids=tuple(range(64)), deadline=start + 0.020))
        assert decision.worker is not None
        # Decided by deadline − margin (17 ms; the decision's own reserve comes off that too), where
        # without the margin it would have been 18 ms: deadline − reserve.
        assert trio.current_time() - start <= 0.017 + 1e-9


# --- slicing in the router ------------------------------------------------------------------------------


class CountedTokens(tuple[int, ...]):
    """Token ids that count the slices read from them: hashing reads one slice of tokens per slice of keys."""

    slices_read: int
    _waiting: list[tuple[int, trio.Event]]

    def __new__(cls, tokens: tuple[int, ...]) -> CountedTokens:
        made = super().__new__(cls, tokens)
        made.slices_read = 0
        made._waiting = []
        return made

    async def read(self, slices: int) -> None:
        """Return once ``slices`` slices have been read (the hashing task reads them)."""
        if self.slices_read >= slices:
            return
        event = trio.Event()
        self._waiting.append((slices, event))
        with trio.fail_after(1):
            await event.wait()

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: SupportsIndex | slice) -> int | tuple[int, ...]:
        if isinstance(index, slice):
            self.slices_read += 1
            for slices, event in self._waiting:
                if self.slices_read >= slices:
                    event.set()
        return super().__getitem__(index)


@asynccontextmanager
async def routed(cluster: SimCluster, **router_kw: float) -> AsyncIterator[RouterHandle]:
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = KvrouteConfig(
        deployment=DEPLOYMENT,
        router=RouterConfig(**router_kw),  # type: ignore[arg-type]
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    async with open_router(config, rpc=network) as handle:
        resolver = handle.leader_resolver()  # None with the KVCM fallback off
        if resolver is not None:
            with trio.move_on_after(1):
                await resolver.leader()
        # One request first: leader, channels and statuses are warm.
        await handle.route(RouteRequest("warm", token_ids=tuple(range(64)), budget_ms=50))
        yield handle


async def test_a_maximal_request_does_not_hold_up_a_normal_one(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as handle, trio.open_nursery() as nursery:
        tokens = CountedTokens(MAX_PROMPT)
        nursery.start_soon(handle.route, RouteRequest("huge", token_ids=tokens, budget_ms=50))
        await tokens.read(1)  # the huge request is hashing
        start = trio.current_time()
        normal = await handle.route(RouteRequest("normal", token_ids=tuple(range(256)), budget_ms=20))
        # Answered while the huge request is still hashing, within its own deadline, not by the fallback.
        assert 0 < tokens.slices_read < SLICES_OF_MAX_PROMPT
        assert normal.worker is not None and normal.reason is not Reason.DEADLINE
        assert trio.current_time() - start <= 0.020


async def test_a_bool_among_the_keys_is_answered_bad_request_not_as_a_bug(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as handle:
        decision = await handle.route(RouteRequest("b", block_cache_keys=(1, True, 3), budget_ms=50))
        assert decision.reason is Reason.BAD_REQUEST, decision
        assert decision.error is not None and "block_cache_keys" in decision.error
        good = await handle.route(RouteRequest("g", block_cache_keys=(1, 2, 3), budget_ms=50))
        assert good.worker is not None and good.reason is not Reason.BAD_REQUEST


async def test_with_the_fallback_off_a_maximal_prompts_ids_are_checked_in_slices_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Nothing hashes the ids (KVCM fallback off), yet a scheduler may be sent them: they are checked
    in slices with rests between, as hashing would, and a bad id in the last slice is still named."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster, kvcm_fallback=False) as handle, trio.open_nursery() as nursery:
        tokens = CountedTokens(MAX_PROMPT)
        nursery.start_soon(handle.route, RouteRequest("huge", token_ids=tokens, budget_ms=50))
        await tokens.read(1)  # the huge request is being checked
        normal = await handle.route(RouteRequest("normal", token_ids=tuple(range(256)), budget_ms=20))
        assert 0 < tokens.slices_read < SLICES_OF_MAX_PROMPT  # answered between two of its slices
        assert normal.worker is not None and normal.reason is Reason.FEATURE_OFF
    bad = (*MAX_PROMPT[:-1], 2**63)
    async with routed(SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK), kvcm_fallback=False) as handle:
        refused = await handle.route(RouteRequest("bad", token_ids=bad, budget_ms=50))
        assert refused.reason is Reason.BAD_REQUEST and refused.error is not None and "token_ids" in refused.error


@pytest.mark.parametrize("kvcm_fallback", [True, False])
@pytest.mark.parametrize(("family", "token_id"), [(KeyFamily.SGLANG, 2**32), (KeyFamily.VLLM, 2**63)])
async def test_under_overload_a_token_id_is_shed_or_refused_as_the_hashing_would_take_it(
    autojump_clock: trio.testing.MockClock, kvcm_fallback: bool, family: KeyFamily, token_id: int
) -> None:
    """An id the deployment's family does not hash (sglang: a uint32) is refused while the family hashes
    the ids (the KVCM fallback on), and shed like any request while nothing does; one that is no 64-bit
    integer is refused either way. The shed pre-check knew only int64, so an sglang id of 2**32 got a
    worker under overload, and one it said the router refuses but the router took was routed with no
    admission place."""
    cluster = SimCluster(workers=4, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK, key_family=family),
        router=RouterConfig(max_in_flight=1, kvcm_fallback=kvcm_fallback),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    refused_at_normal_load = kvcm_fallback or family is KeyFamily.VLLM  # the KVCM source hashes the ids
    prompt = tuple(range(8 * BLOCK))
    odd = [
        RouteRequest("in-a-block", token_ids=(token_id, *prompt[1:]), budget_ms=50),
        RouteRequest("in-the-tail", token_ids=(*prompt, token_id), budget_ms=50),
    ]
    async with open_router(config, rpc=network) as handle:
        async with trio.open_nursery() as nursery:
            tokens = CountedTokens(MAX_PROMPT)
            nursery.start_soon(handle.route, RouteRequest("takes-the-place", token_ids=tokens, budget_ms=50))
            await tokens.read(1)  # hashed or checked in slices: it holds the one place
            answered = [(await handle.route(request)).reason for request in odd]
            assert tokens.slices_read < SLICES_OF_MAX_PROMPT  # answered while the place was taken
        assert answered == [Reason.BAD_REQUEST if refused_at_normal_load else Reason.OVERLOADED] * 2, answered
        for request in odd:  # at normal load
            decision = await handle.route(request)
            assert (decision.reason is Reason.BAD_REQUEST) == refused_at_normal_load, decision


async def test_a_cancelled_long_request_stops_hashing(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as handle:
        tokens = CountedTokens(MAX_PROMPT)
        async with trio.open_nursery() as nursery:
            caller = trio.CancelScope()

            async def abandoned() -> None:
                with caller:
                    await handle.route(RouteRequest("abandoned", token_ids=tokens, budget_ms=50))

            nursery.start_soon(abandoned)
            await tokens.read(3)
            caller.cancel()
        stopped_at = tokens.slices_read
        await trio.testing.wait_all_tasks_blocked()
        assert stopped_at < SLICES_OF_MAX_PROMPT
        assert tokens.slices_read == stopped_at


async def test_a_long_request_past_its_deadline_stops_hashing_and_is_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    async with routed(cluster) as handle, trio.open_nursery() as nursery:
        tokens = CountedTokens(MAX_PROMPT)
        decisions = []

        async def late() -> None:
            decisions.append(await handle.route(RouteRequest("late", token_ids=tokens, budget_ms=10)))

        nursery.start_soon(late)
        await tokens.read(3)
        autojump_clock.jump(0.011)  # the hashing took the whole budget
        await trio.testing.wait_all_tasks_blocked()
        assert tokens.slices_read < SLICES_OF_MAX_PROMPT
        [decision] = decisions
        assert decision.reason is Reason.DEADLINE and decision.worker is not None


@pytest.mark.parametrize(
    ("fields", "tokens"),
    [
        ({"token_ids": tuple(range(100))}, 100),
        ({"block_cache_keys": (1, 2, 3)}, 3 * BLOCK),  # the deployment's block size
        ({"block_cache_keys": (1, 2, 3), "block_size": 64}, 3 * 64),
        ({"block_cache_keys": (1, 2, 3), "seq_len": 60}, 60),
        ({}, None),  # neither list: refused
        ({"block_cache_keys": tuple(range(10)), "block_size": 10**9}, None),  # past the longest prompt
        ({"block_cache_keys": (1, 2, 3), "seq_len": 40}, None),  # shorter than the keys cover
    ],
)
def test_a_shed_request_is_charged_the_length_its_checks_gave_it_in_both_forms(
    fields: dict[str, Any], tokens: int | None
) -> None:
    """The prompt's length comes from the same checks that decide a request may be shed, read alike
    from the router's request and the sidecar's message without converting it; a request they refuse
    is not shed at all."""
    assert sheddable(RouteRequest("r", **fields), DEPLOYMENT, LIMITS) == tokens
    message = router_v1_pb2.RouteRequest(request_id="r", **{k: v for k, v in fields.items()})
    if tokens is None:
        with pytest.raises(BadRequest):
            check_proto_bounds(message, LIMITS, BLOCK)
    else:
        assert check_proto_bounds(message, LIMITS, BLOCK) == tokens


@pytest.mark.parametrize(
    "roles",
    [(Role.DECODE,), (Role.VIT,), (Role.PREFILL, Role.VIT), (Role.DECODE, Role.PDFUSION)],
)
def test_a_request_naming_a_role_not_routed_here_is_not_sheddable(roles: tuple[Role, ...]) -> None:
    """The roles are among the checks made before a shed, with the rule the router's own check applies:
    under overload a role the deployment does not route was dropped from the answer and the request
    given a worker, where at normal load it is refused."""
    request = RouteRequest("r", token_ids=tuple(range(40)), roles=roles)
    assert sheddable(request, DEPLOYMENT, LIMITS) is None
    with pytest.raises(BadRequest) as admissible:
        check_admissible(request, DEPLOYMENT, LIMITS)
    with pytest.raises(BadRequest) as checked:
        check_request(request, DEPLOYMENT, LIMITS)
    assert admissible.value.field_name == checked.value.field_name == "roles"
    assert str(admissible.value) == str(checked.value)


# Per family, an id just inside and just outside the ids it hashes; with nothing hashing them, the
# request's own contract (a 64-bit integer) decides.
INT64_EDGES = ((2**63 - 1, -(2**63)), (2**63, -(2**63) - 1))
UINT32_EDGES = ((2**32 - 1, 0), (2**32, -1))
ID_EDGES = {KeyFamily.RTP: INT64_EDGES, KeyFamily.VLLM: INT64_EDGES, KeyFamily.SGLANG: UINT32_EDGES}


@pytest.mark.parametrize("family", list(KeyFamily))
@pytest.mark.parametrize("hash_tokens", [True, False])
@pytest.mark.parametrize("at", [1, 5], ids=["in-a-whole-block", "in-the-tail"])
def test_a_token_id_is_refused_at_normal_load_exactly_when_it_may_not_be_shed(
    family: KeyFamily, hash_tokens: bool, at: int
) -> None:
    """One rule decides: the ids the family hashes when it hashes them, else any 64-bit integer. The
    shed pre-check checked int64 alone, the vllm family took any uint64 (down to -2**64) and sglang
    uint32, and the tail was checked as int64: an sglang id of 2**32 was shed under overload and
    refused at normal load, a vllm one of 2**63 accepted or refused by its position alone."""
    deployment = DeploymentConfig(block_size=4, key_family=family)
    inside = ID_EDGES[family][0] if hash_tokens else INT64_EDGES[0]
    for token_id in sorted({*inside, *UINT32_EDGES[1], *INT64_EDGES[1]}):
        tokens = [1, 2, 3, 4, 5, 6]  # one whole block, a tail of two
        tokens[at] = token_id
        request = RouteRequest("r", token_ids=tuple(tokens))
        try:
            prepare_request(request, deployment, LIMITS, hash_tokens=hash_tokens)
        except BadRequest as exc:
            assert exc.field_name == "token_ids"
            accepted = False
        else:
            accepted = True
        assert accepted == (min(inside) <= token_id <= max(inside)), (token_id, accepted)
        shed = sheddable(request, deployment, LIMITS, hash_tokens=hash_tokens)
        assert (shed is not None) == accepted, (token_id, shed)
        if accepted:
            assert shed == len(tokens)
        if hash_tokens:  # nothing may be shed that the router refuses: the default is the strict rule
            assert (sheddable(request, deployment, LIMITS) is not None) == accepted


def test_the_vllm_and_sglang_ids_the_shed_pre_check_disagreed_on() -> None:
    cases = [
        (KeyFamily.VLLM, (2**63, 2, 3, 4, 5)),  # was accepted, and not sheddable
        (KeyFamily.VLLM, (1, 2, 3, 4, 2**63)),  # refused, not sheddable
        (KeyFamily.SGLANG, (2**32, 2, 3, 4, 5)),  # refused, yet sheddable
        (KeyFamily.SGLANG, (1, 2, 3, 4, 2**32)),  # was accepted, and sheddable
    ]
    for family, tokens in cases:
        deployment = DeploymentConfig(block_size=4, key_family=family)
        request = RouteRequest("r", token_ids=tokens)
        with pytest.raises(BadRequest) as info:
            prepare_request(request, deployment, LIMITS)
        assert info.value.field_name == "token_ids"
        assert sheddable(request, deployment, LIMITS) is None


def test_the_roles_a_request_may_name() -> None:
    routed = (Role.PREFILL, Role.PDFUSION, Role.DECODE)
    assert check_roles(None, routed) == ((Role.PREFILL, Role.PDFUSION), (Role.DECODE,))
    assert check_roles((), routed) == ((Role.PREFILL, Role.PDFUSION), (Role.DECODE,))  # none named: the deployment's
    assert check_roles((Role.DECODE, Role.PDFUSION, Role.PDFUSION), routed) == ((Role.PDFUSION,), (Role.DECODE,))
    for roles in [(Role.DECODE,), (Role.VIT, Role.PREFILL)]:  # no prefill-capable one; one not routed
        with pytest.raises(BadRequest) as refused:
            check_roles(roles, routed)
        assert refused.value.field_name == "roles"
    with pytest.raises(BadRequest, match="name a prefill-capable role"):
        check_roles(None, (Role.DECODE,))
    deployment = DeploymentConfig(block_size=BLOCK, roles=routed)
    request = RouteRequest("r", token_ids=tuple(range(40)), roles=(Role.DECODE, Role.PREFILL))
    assert sheddable(request, deployment, LIMITS) == 40
