"""A decision packed into bytes the garbage collector never walks, for keeping many of them.

The metrics sink keeps the last ``decision_ring_size`` decisions for ``/debug/decisions``. As objects,
each is about fifteen the collector tracks (the decision, its stage times, candidates, sources, role
addresses and windows, and the tuples holding them), and a ring of them outlives the young
generations: every collection of generation 1 walks the recent ones again, with the GIL held, while
the router waits. Packed, a kept decision is one ``bytes`` object, which the collector does not
track; it is unpacked only when it is read.

``marshal`` carries the fields as tuples of numbers, strings, booleans and None (enum members by
value, addresses by their parts). The bytes never leave the process that packed them, so marshal's
format, which may change between Python versions, is never read by another. Pure: values in, values
out.
"""

from __future__ import annotations

import marshal
from typing import Any

from router.types import (
    CandidateExplain,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouteSource,
    SourceOutcome,
    SourceStep,
    SplitMode,
    Stage,
    StageWindow,
    WorkerAddr,
)


def pack_decision(d: RouteDecision, at: float) -> bytes:
    """``d`` and ``at`` (when it was kept), as bytes :func:`unpack_decision` reads back."""
    # Enum members by ``_value_``, their own attribute: ``value`` is a descriptor around it, and this
    # runs for every decision the sink records.
    worker = d.worker
    return marshal.dumps(
        (
            at,
            d.request_id,
            None if worker is None else (worker.ip, worker.http_port, worker.grpc_port, worker.status_port),
            None if d.role is None else d.role._value_,
            d.route_source._value_,
            d.reason._value_,
            d.hit_tokens,
            d.local_blocks,
            d.elapsed_ms,
            tuple((stage._value_, ms) for stage, ms in d.stage_ms.items()),
            tuple(
                (c.target, c.source, c.local_blocks, c.hit_tokens, c.work_tokens, c.role, c.dropped, c.chosen)
                for c in d.candidates
            ),
            d.error,
            tuple(
                (s.source._value_, s.outcome._value_, None if s.reason is None else s.reason._value_, s.elapsed_ms)
                for s in d.sources
            ),
            tuple((a.role._value_, a.ip, a.http_port, a.grpc_port) for a in d.role_addrs),
            d.error_code,
            None if d.split is None else d.split._value_,
            tuple((w.stage._value_, w.end_ms, w.cut) for w in d.windows),
        )
    )


def unpack_decision(packed: bytes) -> tuple[RouteDecision, float]:
    """The decision :func:`pack_decision` packed, equal to the one given it, and its ``at``."""
    fields: tuple[Any, ...] = marshal.loads(packed)
    (
        at,
        request_id,
        worker,
        role,
        route_source,
        reason,
        hit_tokens,
        local_blocks,
        elapsed_ms,
        stage_ms,
        candidates,
        error,
        sources,
        role_addrs,
        error_code,
        split,
        windows,
    ) = fields
    decision = RouteDecision(
        request_id=request_id,
        worker=None if worker is None else WorkerAddr(*worker),
        role=None if role is None else Role(role),
        route_source=RouteSource(route_source),
        reason=Reason(reason),
        hit_tokens=hit_tokens,
        local_blocks=local_blocks,
        elapsed_ms=elapsed_ms,
        stage_ms={Stage(stage): ms for stage, ms in stage_ms},
        candidates=tuple(CandidateExplain(*c) for c in candidates),
        error=error,
        sources=tuple(
            SourceStep(RouteSource(source), SourceOutcome(outcome), None if why is None else Reason(why), ms)
            for source, outcome, why, ms in sources
        ),
        role_addrs=tuple(RoleAddr(Role(r), ip, http_port, grpc_port) for r, ip, http_port, grpc_port in role_addrs),
        error_code=error_code,
        split=None if split is None else SplitMode(split),
        windows=tuple(StageWindow(Stage(stage), end_ms, cut) for stage, end_ms, cut in windows),
    )
    return decision, at
