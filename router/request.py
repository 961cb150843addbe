"""A route request validated and keyed, and its deadline: pure functions of values (time passed in)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from router.config import DeploymentConfig
from router.keys import block_keys
from router.types import COMPANION_ROLES, PREFILL_CAPABLE_ROLES, BadRequest, Role, RouteRequest

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request: the block keys to query, their block size, seq_len and roles."""

    keys: tuple[int, ...]
    block_size: int
    seq_len: int
    roles: tuple[Role, ...]  # the prefill-capable roles the pick may take
    companions: tuple[Role, ...] = ()  # roles that get one more address each (decode, vit)


def prepare_request(
    request: RouteRequest, deployment: DeploymentConfig, *, hash_tokens: bool = True
) -> PreparedRequest:
    """Validate ``request`` and compute its block keys (pure). Raise BadRequest naming the field.

    Caller keys are used exactly as given (no re-hashing); tokens are hashed with the deployment's
    family, block size and lookahead — the one source of the key geometry. ``hash_tokens=False``
    (KVCM fallback off: nothing uses keys) skips hashing, a few ms of CPU for a long prompt, and
    gives no keys.
    """
    if not request.request_id:
        raise BadRequest("request_id", "must not be empty")
    has_tokens = request.token_ids is not None
    has_keys = request.block_cache_keys is not None
    if has_tokens == has_keys:
        raise BadRequest("token_ids", "give exactly one of token_ids or block_cache_keys")
    if request.block_size is not None and request.block_size <= 0:
        raise BadRequest("block_size", f"must be positive, got {request.block_size}")
    if request.seq_len is not None and request.seq_len < 0:
        raise BadRequest("seq_len", f"must not be negative, got {request.seq_len}")
    if request.budget_ms is not None and not math.isfinite(request.budget_ms):
        raise BadRequest("budget_ms", f"must be finite, got {request.budget_ms}")
    roles = deployment.roles if not request.roles else request.roles
    foreign = [r.value for r in roles if r not in deployment.roles]
    if foreign:
        raise BadRequest("roles", f"{','.join(foreign)} not routed by this deployment ({_names(deployment.roles)})")
    prefill_roles = tuple(r for r in roles if r in PREFILL_CAPABLE_ROLES)
    if not prefill_roles:
        raise BadRequest("roles", "name a prefill-capable role (PREFILL or PDFUSION) beside any companion role")
    if request.block_cache_keys is not None:
        keys = tuple(request.block_cache_keys)
        block_size = request.block_size if request.block_size is not None else deployment.block_size
        if keys and (min(keys) < _INT64_MIN or max(keys) > _INT64_MAX):
            raise BadRequest("block_cache_keys", "every key must be a signed 64-bit integer")
        seq_len = request.seq_len if request.seq_len is not None else len(keys) * block_size
    else:
        assert request.token_ids is not None
        tokens = request.token_ids
        if not tokens:
            raise BadRequest("token_ids", "must not be empty")
        if request.block_size is not None and request.block_size != deployment.block_size:
            raise BadRequest(
                "block_size",
                f"{request.block_size} differs from the deployment's {deployment.block_size}, "
                "which token ids are hashed with; send block_cache_keys to use another",
            )
        block_size = deployment.block_size
        try:
            keys = (
                block_keys(tokens, block_size, deployment.key_family, deployment.lookahead_tokens)
                if hash_tokens
                else ()
            )
        except ValueError as exc:
            raise BadRequest("token_ids", str(exc)) from exc
        seq_len = request.seq_len if request.seq_len is not None else len(tokens)
    companions = tuple(r for r in roles if r in COMPANION_ROLES)
    return PreparedRequest(
        keys=keys, block_size=block_size, seq_len=seq_len, roles=prefill_roles, companions=companions
    )


def _names(roles: Sequence[Role]) -> str:
    return ",".join(r.value for r in roles)


def request_deadline(request: RouteRequest, now: float, cap_ms: float) -> float:
    """``now + min(budget, cap)``; an absolute deadline counts as a budget. Never later than the cap."""
    cap = now + cap_ms / 1000.0
    if request.deadline is not None:
        return min(request.deadline, cap)
    if request.budget_ms is not None and math.isfinite(request.budget_ms):
        return min(now + max(0.0, request.budget_ms) / 1000.0, cap)
    return cap
