"""A route request validated and keyed, and its deadline: pure functions of values (time passed in).

Validation and hashing are separate steps so that a long prompt can be hashed in slices:

    checked = check_request(request, deployment, limits)      # every bound and rule; no hashing
    keys = join_slices(key_slices(checked, limits.hash_slice_tokens))  # the caller may pause between slices
    prepared = checked.with_keys(keys)

:func:`prepare_request` does the three at once.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice

from router.config import DeploymentConfig, LimitsConfig
from router.keys import INT64, IntRange, block_key_slices, join_slices, token_id_range
from router.problems import declared_range
from router.slot_init import slot_init
from router.types import (
    COMPANION_ROLES,
    PREFILL_CAPABLE_ROLES,
    BadRequest,
    KeyFamily,
    Role,
    RouteRequest,
    WireRouteRequest,
)
from router.wire.decode import encode_block_keys

_QUOTED_CHARS = 40  # of a client's text quoted back in an error


@slot_init
@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request: the block keys to query, their block size, seq_len and roles."""

    keys: tuple[int, ...]
    block_size: int
    seq_len: int
    roles: tuple[Role, ...]  # the prefill-capable roles the pick may take
    companions: tuple[Role, ...] = ()  # roles that get one more address each (decode, vit)
    # ``keys`` as the KVCM query sends them, when the checks encoded them (derived: not shown, not compared).
    encoded_keys: bytes | None = field(default=None, repr=False, compare=False)


@slot_init
@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request that passed every check; its token ids, if they are to be hashed, are not yet."""

    tokens: Sequence[int]  # to hash; empty when keys were given or nothing uses keys
    keys: tuple[int, ...]  # the caller's keys (empty when tokens are to be hashed)
    block_size: int
    seq_len: int
    roles: tuple[Role, ...]  # the prefill-capable roles the pick may take
    companions: tuple[Role, ...]  # roles that get one more address each (decode, vit)
    family: KeyFamily
    lookahead: int
    # Token ids nothing hashes (KVCM fallback off) that a scheduler may be sent: checked in slices,
    # as hashing would check them, since one pass over the longest prompt holds the loop for ms.
    ids_to_check: Sequence[int] = ()
    # The caller's keys as the KVCM query sends them: how they were checked (``encode_block_keys``).
    encoded_keys: bytes | None = field(default=None, repr=False, compare=False)

    def with_keys(self, keys: tuple[int, ...]) -> PreparedRequest:
        return PreparedRequest(
            keys=keys,
            block_size=self.block_size,
            seq_len=self.seq_len,
            roles=self.roles,
            companions=self.companions,
            encoded_keys=self.encoded_keys if keys is self.keys and keys else None,
        )


def check_bounds(limits: LimitsConfig, *, request_id: str, n_tokens: int, n_keys: int, n_roles: int) -> None:
    """Raise BadRequest naming the field and its bound when a request is larger than ``limits`` allow.

    Takes sizes only (O(1) but for the request_id's UTF-8 length), so a transport can refuse an
    oversized request before converting it.
    """
    if n_tokens > limits.max_prompt_tokens:
        raise BadRequest(
            "token_ids",
            f"{n_tokens} token ids, more than the limit of {limits.max_prompt_tokens} (--max-prompt-tokens)",
        )
    if n_keys > limits.max_block_keys:
        raise BadRequest(
            "block_cache_keys", f"{n_keys} keys, more than the limit of {limits.max_block_keys} (--max-block-keys)"
        )
    if n_roles > limits.max_roles:
        raise BadRequest("roles", f"{n_roles} roles, more than the limit of {limits.max_roles} (--max-roles)")
    limit = limits.max_request_id_bytes
    # A character is at least one UTF-8 byte: a long id is refused without encoding it.
    if len(request_id) > limit:
        raise _id_too_long(limit)
    try:
        encoded = request_id.encode("utf-8")
    except UnicodeEncodeError as exc:  # the id goes out as UTF-8 (KVCM's trace_id, the master's request)
        raise BadRequest(
            "request_id", f"not Unicode text: an unpaired surrogate {request_id[exc.start]!a} at index {exc.start}"
        ) from None
    if len(encoded) > limit:
        raise _id_too_long(limit)


def _id_too_long(limit: int) -> BadRequest:
    # Built only when raised: every request, a shed one included, passes the check above.
    return BadRequest("request_id", f"longer than the limit of {limit} UTF-8 bytes (--max-request-id-bytes)")


def quoted(text: str) -> str:
    """A client's text for an error message: repr, cut to a few dozen characters."""
    return repr(text) if len(text) <= _QUOTED_CHARS else f"{text[:_QUOTED_CHARS]!r}… ({len(text)} chars)"


# The most roles any configuration allows (the upper bound of limits.max_roles): checked with the
# fields' types, before the configured limit, so that no more are looked at one by one.
_MAX_ROLES = int(declared_range(LimitsConfig, "max_roles").high)


def _type_name(value: object) -> str:
    return type(value).__name__


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _shown(value: int | float) -> str:
    if isinstance(value, int) and value.bit_length() > 64:  # repr of a huge int is slow, or refused
        return f"an integer of {value.bit_length()} bits"
    return repr(value)


def check_fields(request: RouteRequest) -> None:
    """The fields' types, and the timing fields' values, before anything reads them (pure): a caller
    of the Python API can pass anything, and the deadline is computed before the other checks. Raise
    BadRequest naming the field."""
    if not isinstance(request.request_id, str):
        raise BadRequest("request_id", f"must be a string, got {_type_name(request.request_id)}")
    budget = request.budget_ms
    if budget is not None:
        if not _is_number(budget):
            raise BadRequest("budget_ms", f"must be a number of milliseconds, got {_type_name(budget)}")
        if not _is_finite(budget) or budget < 0:
            raise BadRequest("budget_ms", f"must be finite and not negative, got {_shown(budget)}")
    deadline = request.deadline
    if deadline is not None and not (_is_number(deadline) and _is_finite(deadline)):
        shown = _shown(deadline) if _is_number(deadline) else _type_name(deadline)
        raise BadRequest("deadline", f"must be a finite time on the router's clock, got {shown}")
    for name, value in (("block_size", request.block_size), ("seq_len", request.seq_len)):
        if value is not None and not _is_int(value):
            raise BadRequest(name, f"must be an integer, got {_type_name(value)}")
        if value is not None and value.bit_length() > 63:
            raise BadRequest(name, f"must be a 64-bit integer, got {_shown(value)}")
    for name, items in (("token_ids", request.token_ids), ("block_cache_keys", request.block_cache_keys)):
        if items is not None and not isinstance(items, tuple | list):
            raise BadRequest(name, f"must be a tuple or list of integers, got {_type_name(items)}")
    roles = request.roles
    if roles is not None:
        if isinstance(roles, str) or not isinstance(roles, Sequence):
            raise BadRequest("roles", f"must be a sequence of Role values, got {_type_name(roles)}")
        if len(roles) > _MAX_ROLES:
            raise BadRequest("roles", f"{len(roles)} roles, more than {_MAX_ROLES}")
        if not all(isinstance(r, Role) for r in roles):
            raise BadRequest("roles", "must be a sequence of Role values")


def with_plain_id(request: RouteRequest) -> RouteRequest:
    """``request`` with an id of a ``str`` subclass (a ``StrEnum`` member, ``numpy.str_``) made a plain
    ``str`` of the same text, any other unchanged (pure). Such an id passes the checks, but the decisions
    the metrics sink keeps are packed with ``marshal``, which takes only the built-in types: the sink
    crashed on each one. Raise TypeError for what is no ``RouteRequest`` (a caller's bug, not a bad
    request: there is no field to name, and an ``AttributeError`` from deeper in said nothing)."""
    if not isinstance(request, RouteRequest):
        raise TypeError(f"route() takes a RouteRequest, got a {type(request).__name__}")
    request_id = request.request_id
    if type(request_id) is str or not isinstance(request_id, str):
        return request
    return replace(request, request_id=str.__str__(request_id))  # str() would call the subclass's __str__


def check_shape(request_id: str, *, has_tokens: bool, has_keys: bool) -> None:
    """The checks a request's shape alone decides (pure; the id already within ``check_bounds``' limit):
    an id, and exactly one prompt list. The sidecar runs them on a message before it may shed it, so a
    malformed call is refused, never answered ``overloaded`` with a worker. Raise BadRequest naming the
    field."""
    if not request_id:
        raise BadRequest("request_id", "must not be empty")
    if request_id.isspace():  # the scheduler refuses a blank id (8406): refused here, named, at once
        raise BadRequest("request_id", "must not be blank (whitespace only)")
    if has_tokens == has_keys:
        raise BadRequest("token_ids", "give exactly one of token_ids or block_cache_keys")


@slot_init
@dataclass(frozen=True, slots=True)
class Admissible:
    """What the checks made before a shed found: the block size, the prompt's length, and the roles."""

    block_size: int
    seq_len: int
    roles: tuple[Role, ...]  # the prefill-capable roles the pick may take
    companions: tuple[Role, ...]  # roles that get one more address each (decode, vit)


def check_admissible(request: RouteRequest, deployment: DeploymentConfig, limits: LimitsConfig) -> Admissible:
    """The checks made before a request may be answered ``overloaded`` (pure, O(1)): its fields' types,
    its sizes against ``limits``, its shape, its geometry (``check_geometry``) and its roles
    (``check_roles``). Raise BadRequest naming the field: a malformed request is told so, even under
    overload."""
    check_fields(request)
    n_tokens = None if request.token_ids is None else len(request.token_ids)
    n_keys = None if request.block_cache_keys is None else len(request.block_cache_keys)
    check_bounds(
        limits,
        request_id=request.request_id,
        n_tokens=n_tokens or 0,
        n_keys=n_keys or 0,
        n_roles=0 if request.roles is None else len(request.roles),
    )
    check_shape(request.request_id, has_tokens=n_tokens is not None, has_keys=n_keys is not None)
    block_size, seq_len = check_geometry(
        n_tokens=n_tokens,
        n_keys=n_keys,
        block_size=request.block_size,
        seq_len=request.seq_len,
        deployment_block_size=deployment.block_size,
        limits=limits,
    )
    roles, companions = check_roles(request.roles, deployment.roles)
    return Admissible(block_size=block_size, seq_len=seq_len, roles=roles, companions=companions)


def check_roles(roles: Sequence[Role] | None, routed: Sequence[Role]) -> tuple[tuple[Role, ...], tuple[Role, ...]]:
    """The prefill-capable and the companion roles a request names (the deployment's ``routed`` ones
    when it names none), each once and in order (pure, O(max_roles): ``roles``' type and count already
    checked). Every one must be routed here, and one prefill-capable. Raise BadRequest("roles")."""
    named = tuple(routed) if not roles else tuple(dict.fromkeys(roles))  # each role once
    foreign = [r.value for r in named if r not in routed]
    if foreign:
        raise BadRequest("roles", f"{','.join(foreign)} not routed by this deployment ({_names(routed)})")
    prefill, companions = _role_parts(named)
    if not prefill:
        raise BadRequest("roles", "name a prefill-capable role (PREFILL or PDFUSION) beside any companion role")
    return prefill, companions


def check_geometry(
    *,
    n_tokens: int | None,
    n_keys: int | None,
    block_size: int | None,
    seq_len: int | None,
    deployment_block_size: int,
    limits: LimitsConfig,
) -> tuple[int, int]:
    """The block size and the prompt's length a request's counts give (pure, O(1): from the counts
    alone, so a request may be checked before it is converted or shed). ``n_keys`` None: token ids
    were given (``n_tokens`` of them). seq_len, when given, must be the prompt's length: with token
    ids, their count; with keys, at least the tokens the keys' blocks cover; never more than
    ``max_prompt_tokens``. An empty prompt is refused in either form: no token ids, or no keys and
    no seq_len (empty keys with a seq_len are a prompt shorter than one block, as a decision log
    records one). Raise BadRequest naming the field."""
    if block_size is not None and block_size <= 0:
        raise BadRequest("block_size", f"must be positive, got {block_size}")
    if block_size is not None and block_size > limits.max_prompt_tokens:
        raise BadRequest(
            "block_size",
            f"{block_size} is more than the limit of {limits.max_prompt_tokens} tokens (--max-prompt-tokens)",
        )
    if seq_len is not None and seq_len < 0:
        raise BadRequest("seq_len", f"must not be negative, got {seq_len}")
    if seq_len is not None and seq_len > limits.max_prompt_tokens:
        raise BadRequest(
            "seq_len", f"{seq_len} is more than the limit of {limits.max_prompt_tokens} (--max-prompt-tokens)"
        )
    if n_keys is not None:
        if not n_keys and not seq_len:  # as empty token ids: no prompt to route (proto3: not given)
            raise BadRequest(
                "block_cache_keys",
                "must not be empty without a seq_len (give seq_len for a prompt shorter than a block)",
            )
        size = block_size if block_size is not None else deployment_block_size
        covered = n_keys * size
        if seq_len is None:
            if covered > limits.max_prompt_tokens:
                raise BadRequest(
                    "block_cache_keys",
                    f"{n_keys} keys of {size} tokens cover {covered} tokens, more than the limit of "
                    f"{limits.max_prompt_tokens} (--max-prompt-tokens)",
                )
            return size, covered
        if seq_len < covered:
            raise BadRequest(
                "seq_len", f"{seq_len} is shorter than the {covered} tokens the {n_keys} keys of {size} tokens cover"
            )
        return size, seq_len
    if not n_tokens:
        raise BadRequest("token_ids", "must not be empty")
    if block_size is not None and block_size != deployment_block_size:
        raise BadRequest(
            "block_size",
            f"{block_size} differs from the deployment's {deployment_block_size}, "
            "which token ids are hashed with; send block_cache_keys to use another",
        )
    if seq_len is not None and seq_len != n_tokens:
        raise BadRequest(
            "seq_len", f"{seq_len} differs from the {n_tokens} token ids given (leave it out to use their count)"
        )
    return deployment_block_size, n_tokens


def named_roles(
    request: RouteRequest, deployment: DeploymentConfig
) -> tuple[tuple[Role, ...], tuple[Role, ...]] | None:
    """The prefill-capable and the companion roles ``request`` names that ``deployment`` routes, for an
    answer made before its checks or without them (overloaded, deadline, a bug): None when it names
    none, names them in a form the checks refuse, or names no prefill-capable one routed here (the
    deployment's roles answer it then). Pure."""
    roles = request.roles
    # The type first: a value of another type may not even have a truth value (a numpy array).
    if not isinstance(roles, tuple | list) or not roles or not all(isinstance(r, Role) for r in roles):
        return None
    prefill, companions = _role_parts(tuple(r for r in dict.fromkeys(roles) if r in deployment.roles))
    if not prefill:
        return None
    return prefill, companions


def _role_parts(roles: tuple[Role, ...]) -> tuple[tuple[Role, ...], tuple[Role, ...]]:
    """``roles``' prefill-capable ones and its companion ones, each in order."""
    return tuple(r for r in roles if r in PREFILL_CAPABLE_ROLES), tuple(r for r in roles if r in COMPANION_ROLES)


def check_request(
    request: RouteRequest, deployment: DeploymentConfig, limits: LimitsConfig, *, hash_tokens: bool = True
) -> CheckedRequest:
    """Validate ``request`` against the deployment and ``limits`` (pure). Raise BadRequest naming the field.

    Caller keys are used exactly as given (no re-hashing); tokens are to be hashed with the
    deployment's family, block size and lookahead — the one source of the key geometry.
    ``hash_tokens=False`` (KVCM fallback off: nothing uses keys) leaves nothing to hash.
    seq_len, when given, must be the prompt's length: with token ids, their count; with keys, at
    least the tokens the keys' blocks cover; never more than ``max_prompt_tokens``.
    """
    admissible = check_admissible(request, deployment, limits)
    tokens: Sequence[int] = ()
    ids_to_check: Sequence[int] = ()
    keys: tuple[int, ...] = ()
    encoded_keys: bytes | None = None
    if request.block_cache_keys is not None:
        keys = tuple(request.block_cache_keys)
        if keys:
            encoded_keys = _encoded_on_the_wire(request)
            if encoded_keys is None:
                encoded_keys = _encoded_block_keys(keys)
    else:
        assert request.token_ids is not None
        if hash_tokens:
            tokens = request.token_ids  # the hashing checks each id, and key_slices the ids it leaves
        else:
            ids_to_check = request.token_ids  # nothing hashes them; a scheduler may be sent them
    return CheckedRequest(
        ids_to_check=ids_to_check,
        tokens=tokens,
        keys=keys,
        block_size=admissible.block_size,
        seq_len=admissible.seq_len,
        roles=admissible.roles,
        companions=admissible.companions,
        family=deployment.key_family,
        lookahead=deployment.lookahead_tokens,
        encoded_keys=encoded_keys,
    )


def _encoded_on_the_wire(request: RouteRequest) -> bytes | None:
    """The encoding of its keys a request read off the wire came with (``WireRouteRequest`` keeps one
    only while it is of the keys it holds): keys protobuf read are signed 64-bit integers, so they
    need no other check."""
    if isinstance(request, WireRouteRequest) and request.encoded_keys is not None:
        return request.encoded_keys[1]
    return None


def _encoded_block_keys(keys: Sequence[int]) -> bytes:
    """``keys`` encoded as the KVCM query sends them; raise BadRequest("block_cache_keys") for one that
    is not a signed 64-bit integer (a bool neither: the wire has no such key, and the query's encoding
    would refuse it later, as a bug)."""
    try:
        return encode_block_keys(keys)
    except ValueError:
        raise BadRequest("block_cache_keys", "every key must be a signed 64-bit integer (an int, not a bool)") from None


def sheddable(
    request: RouteRequest, deployment: DeploymentConfig, limits: LimitsConfig, *, hash_tokens: bool = True
) -> int | None:
    """The prompt's length (what a shed charges its worker) when ``request`` may be answered
    ``overloaded``; None when the router would refuse it from its fields alone (``shed_check``)."""
    checked = shed_check(request, deployment, limits, hash_tokens=hash_tokens)
    return None if isinstance(checked, BadRequest) else checked


def shed_check(
    request: RouteRequest, deployment: DeploymentConfig, limits: LimitsConfig, *, hash_tokens: bool = True
) -> int | BadRequest:
    """The prompt's length when ``request`` may be answered outside the chain (``overloaded``, or
    ``deadline`` with no time on arrival); else the refusal the router's checks would give it, so a
    malformed request is told so even under overload (pure). Its admissible fields (``check_admissible``,
    O(1), its roles among them), each key a 64-bit integer and each token id one the router takes
    (``accepted_token_ids``, ``hash_tokens`` as ``check_request`` is given it; left True, a request is
    never shed that the router would refuse) (O(n), in C: a prompt of 262,144 ids about 3 ms)."""
    try:
        seq_len = check_admissible(request, deployment, limits).seq_len
        if request.block_cache_keys is not None and _encoded_on_the_wire(request) is None:
            _encoded_block_keys(request.block_cache_keys)
        if request.token_ids is not None:
            check_token_ids(request.token_ids, accepted_token_ids(deployment.key_family, hash_tokens=hash_tokens))
    except BadRequest as exc:
        return exc
    return seq_len


def accepted_token_ids(family: KeyFamily, *, hash_tokens: bool) -> IntRange:
    """The token ids the router takes: those its deployment's ``family`` hashes when it hashes them
    (``hash_tokens``), else any 64-bit integer (a scheduler may be sent them: ``check_token_ids``)."""
    return token_id_range(family) if hash_tokens else INT64


def check_token_ids(token_ids: Sequence[int], ids: IntRange = INT64) -> None:
    """Raise BadRequest("token_ids") unless every id is in ``ids`` (pure): for token ids no key hashes,
    which its family's hashing would catch, or none does (every token id a 64-bit integer)."""
    if not ids.holds_all(token_ids):
        raise BadRequest("token_ids", f"every token id must be {ids.name}")


def key_slices(checked: CheckedRequest, slice_tokens: int) -> Iterator[tuple[int, ...]]:
    """The request's block keys in consecutive slices of about ``slice_tokens`` tokens (pure).

    The caller's keys, or no keys, are one slice; token ids are hashed lazily, one slice per
    ``next()``, so a caller may pause (or stop) between two. Raises BadRequest("token_ids") for a
    token id the key family cannot encode, or one that is no integer (a Python caller's list), from the
    slice that holds it: found by the hashing itself, at no cost to a well-formed prompt; the ids after
    the last whole block, which no key covers, are checked once the last slice is given.
    """
    if checked.ids_to_check:
        ids, step = checked.ids_to_check, max(1, slice_tokens)
        for start in range(0, len(ids), step):
            check_token_ids(ids[start : start + step])
            yield ()
        return
    if not checked.tokens:
        yield checked.keys
        return
    slice_blocks = max(1, slice_tokens // checked.block_size)
    slices = block_key_slices(checked.tokens, checked.block_size, checked.family, checked.lookahead, slice_blocks)
    given = 0
    as_python_ints = False
    while True:
        try:
            part = next(slices, None)
        except ValueError as exc:
            # The hashing names its own parameter (tokens): the field named here stands for it.
            raise BadRequest("token_ids", str(exc).removeprefix("tokens: ")) from exc
        except (TypeError, struct.error, OverflowError) as exc:
            # An integer the hashing does not take as it is: a fixed-width type (numpy's int64) overflows
            # its arithmetic, which Python's ints do not, and an object that is an integer only through
            # ``__index__`` (as the shed check's packer, and the scheduler's JSON, read it) supports
            # none of its operators. Hash the same values as Python ints, past the slices already given.
            if as_python_ints:
                if isinstance(exc, OverflowError):
                    raise BadRequest("token_ids", "every token id must be a 64-bit integer") from None
                raise BadRequest("token_ids", "every token id must be an integer") from None
            as_python_ints = True
            try:
                tokens = [operator.index(t) for t in checked.tokens]
            except TypeError:
                raise BadRequest("token_ids", "every token id must be an integer") from None
            slices = islice(
                block_key_slices(tokens, checked.block_size, checked.family, checked.lookahead, slice_blocks),
                given,
                None,
            )
            continue
        if part is None:
            # The ids after the last whole block the family hashed (a lookahead holds the last ones
            # back) are hashed by no key: checked here against the family's range, or an id there that
            # the family would refuse in a whole block passed as a well-formed prompt. Ids checked
            # twice are harmless.
            bs = checked.block_size
            tail = checked.tokens[max(0, len(checked.tokens) - checked.lookahead) // bs * bs :]
            check_token_ids(tail, token_id_range(checked.family))
            return
        given += 1
        yield part


def is_sliced(checked: CheckedRequest, slice_tokens: int) -> bool:
    """Whether hashing (or checking) ``checked`` takes more than one slice (a caller pauses between
    slices only then)."""
    return max(len(checked.tokens), len(checked.ids_to_check)) > slice_tokens


def prepare_request(
    request: RouteRequest,
    deployment: DeploymentConfig,
    limits: LimitsConfig | None = None,
    *,
    hash_tokens: bool = True,
) -> PreparedRequest:
    """Validate ``request`` and compute its block keys at once (pure). Raise BadRequest naming the field.

    ``limits`` None: the default bounds.
    """
    limits = LimitsConfig() if limits is None else limits
    checked = check_request(request, deployment, limits, hash_tokens=hash_tokens)
    at_once = max(1, len(checked.tokens), len(checked.ids_to_check))
    return checked.with_keys(join_slices(key_slices(checked, at_once)))


def _names(roles: Sequence[Role]) -> str:
    return ",".join(r.value for r in roles)


def caller_deadline(now: float, remaining_s: float, sent_at: float, arrived_at: float) -> float:
    """A caller's deadline on the trio clock (``now``), for a call that had ``remaining_s`` left when
    another thread sent it on at ``sent_at`` and reached the trio thread at ``arrived_at`` (both
    ``time.monotonic()``): the wait for the trio thread is already spent. The router keeps its reply
    margin before it.
    """
    return now + remaining_s - max(0.0, arrived_at - sent_at)


def budget_left_ms(routing_s: float, received_at: float, arrived_at: float) -> float:
    """What is left of a call's routing deadline (``routing_s``, min(budget, cap) in seconds from when
    another thread received it at ``received_at``) once it reached the routing thread at ``arrived_at``
    (both ``time.monotonic()``), in ms: the budget counts from the call's receipt, not from its hand-off.
    """
    return max(0.0, routing_s - max(0.0, arrived_at - received_at)) * 1000.0


def budget_deadline(budget_ms: float | None, now: float, cap_ms: float) -> float:
    """``now + min(budget, cap)``: a request's own deadline before any caller's (None: the cap)."""
    deadline = now + cap_ms / 1000.0
    if budget_ms is not None and math.isfinite(budget_ms):
        deadline = min(deadline, now + max(0.0, budget_ms) / 1000.0)
    return deadline


def request_deadline(request: RouteRequest, now: float, cap_ms: float, reply_margin_ms: float = 0.0) -> float:
    """When the router must have decided: ``now + min(budget, cap)``, and ``reply_margin_ms`` before the
    caller's absolute deadline when it gave one (that margin is the time the answer needs to reach it).
    """
    deadline = budget_deadline(request.budget_ms, now, cap_ms)
    if request.deadline is not None:
        deadline = min(deadline, request.deadline - reply_margin_ms / 1000.0)
    return deadline
