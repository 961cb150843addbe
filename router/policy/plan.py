"""The candidate plan: a cache answer and a discovery snapshot in, the workers to probe and score out.

Pure: values in, values out; no I/O, no clock.

Hot set: the answer's hosts with ``local ≥ 1`` or ``p2p_total ≥ 1``, best effective blocks first,
mapped to discovered workers, one per gRPC target, at most ``hot_set_size``. Where hosts tie
exactly at that cut, a per-request rank decides who is in (never the address, never the answer's
order). Unknown, malformed and ejected hosts are dropped and reported; they take no hot slot. Nor
does a worker known unfit for the request (``unfit``: it reported another role, or lately that it is
not alive): dropped and reported (``unfit``), it leaves its slot to a holder that can serve the
request (a decode worker holding the prefix would otherwise be dropped after its probe).

Cold set: ``cold_set_size`` discovered workers not in the hot set, not ejected and not known unfit
(``unfit``), in a reproducible per-request order, so idle workers are found and load spreads.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from router.config import ScorerConfig
from router.slot_init import slot_init
from router.targets import TargetError, format_target, parse_target
from router.types import CandidateExplain, DropReason, HostMatch, WorkerAddr


def effective_blocks(match: HostMatch, p2p_hit_discount: float) -> float:
    """Local blocks plus the P2P-only blocks weighted by the discount: the one formula for a match's value.

    Computed in doubles in the reference scheduler's order; with no P2P extension (or no
    discount) it is exactly ``local``.
    """
    local = match.local
    if match.p2p_total <= local or p2p_hit_discount <= 0:
        return local
    return local + (match.p2p_total - local) * p2p_hit_discount


class CandidateSource(enum.Enum):
    """How a candidate entered the plan (the values are CandidateExplain.source)."""

    HOT = "hot"  # from KVCM's answer
    SHADOW = "shadow"  # from the router-local shadow index's answer
    COLD = "cold"  # from discovery, for spread and to find idle workers


@dataclass(frozen=True, slots=True)
class Fleet:
    """An indexed discovery snapshot: build it once per snapshot, read it per decision in O(1).

    ``workers`` is in canonical order (by HTTP target, one worker per gRPC target) with
    ``targets[i] == workers[i].http_target``, so the per-request cold order depends only on
    the request and the set of workers, never on the order discovery listed them in.
    """

    workers: Sequence[WorkerAddr]
    targets: Sequence[str]
    by_http_target: Mapping[str, WorkerAddr]

    @classmethod
    def of(cls, workers: Iterable[WorkerAddr]) -> Fleet:
        by_grpc: dict[str, WorkerAddr] = {}
        for worker in sorted(workers, key=lambda w: (w.http_target, w.grpc_target, w.status_target)):
            by_grpc.setdefault(worker.grpc_target, worker)
        ordered = tuple(by_grpc.values())
        targets = tuple(w.http_target for w in ordered)
        return cls(ordered, targets, dict(zip(targets, ordered, strict=True)))


class Candidate(NamedTuple):
    worker: WorkerAddr
    target: str  # worker.http_target (its KVCM identity), computed once
    match: HostMatch | None  # the cache answer's match for this worker, whichever set it came through
    source: CandidateSource


@slot_init
@dataclass(frozen=True, slots=True)
class CandidatePlan:
    """Candidates to probe and score, each worker once: the hot set (best first), then the
    cold set (in draw order)."""

    candidates: tuple[Candidate, ...]
    dropped: tuple[CandidateExplain, ...] = ()  # cache-answer hosts that could not become candidates


def request_seed(request_id: str, namespace: str) -> bytes:
    """sha256 over the request id and the KVCM namespace: the per-request source of cold order."""
    rid = request_id.encode()
    return hashlib.sha256(len(rid).to_bytes(4, "big") + rid + namespace.encode()).digest()


def _target_rank(seed: bytes, target: str) -> bytes:
    """A per-request pseudo-random rank of one target: sha256(request seed ‖ target)."""
    return hashlib.sha256(seed + target.encode()).digest()[:8]


def _resolve_host(host_ip_port: str, fleet: Fleet) -> tuple[WorkerAddr, str] | DropReason:
    """Map a cache answer's ``host_ip_port`` to a discovered worker and its canonical target.

    A host that discovery does not list is dropped (UNKNOWN_HOST) rather than synthesised
    from a port convention: discovery decides which workers belong to the deployment (and
    their roles); KVCM may still remember a worker that left, or list another deployment's.
    """
    worker = fleet.by_http_target.get(host_ip_port)
    if worker is not None:
        return worker, host_ip_port
    try:
        parsed = parse_target(host_ip_port)
    except TargetError:
        return DropReason.MALFORMED_HOST
    target = format_target(parsed.host, parsed.port)
    worker = fleet.by_http_target.get(target)
    return DropReason.UNKNOWN_HOST if worker is None else (worker, target)


def _drop_explain(match: HostMatch, source: CandidateSource, reason: DropReason) -> CandidateExplain:
    return CandidateExplain(
        target=match.host_ip_port,
        source=source.value,
        local_blocks=match.local,
        hit_tokens=0,
        work_tokens=None,
        role=None,
        dropped=reason.value,
    )


def _coprime_stride(draw: int, n: int) -> int:
    """A stride in [1, n) coprime with n (so stepping by it visits every index once); 1 when n ≤ 2."""
    if n <= 2:
        return 1
    stride = draw % (n - 1) + 1
    # Stops by itself: 1 is coprime with every n, and at most n - 1 strides are tried.
    for _ in range(n - 1):
        if math.gcd(stride, n) == 1:
            return stride
        stride = stride % (n - 1) + 1
    return 1


def _cold_walk(
    fleet: Fleet,
    seed: bytes,
    count: int,
    taken: set[int],
    ejected: Collection[WorkerAddr],
    skip: Callable[[WorkerAddr], bool] | None = None,
) -> list[tuple[WorkerAddr, int]]:
    """Up to ``count`` fleet workers (with their indices) not taken (by id), ejected nor skipped, in
    per-request order.

    Ranking every worker per request would cost O(fleet). Here the request seed picks a start
    index and a stride coprime with the fleet size; stepping visits distinct workers, so the
    walk examines ``count`` + (hot or ejected workers met on the way) entries, whatever the
    fleet size. Every worker is equally likely to come first, and the order is reproducible
    per request (a function of request id, namespace and the fleet's targets).
    """
    workers = fleet.workers
    n = len(workers)
    if count <= 0 or n == 0:
        return []
    index = int.from_bytes(seed[0:8], "big") % n
    stride = _coprime_stride(int.from_bytes(seed[8:16], "big"), n)
    picked: list[tuple[WorkerAddr, int]] = []
    for _ in range(n):
        worker = workers[index]
        if id(worker) not in taken and not (ejected and worker in ejected) and not (skip and skip(worker)):
            picked.append((worker, index))
            taken.add(id(worker))
            if len(picked) == count:
                break
        index = (index + stride) % n
    return picked


RankedHost = tuple[float, int, int]  # (−effective blocks, −local, answer index)


class _HotSetBuilder:
    """Maps ranked cache-answer hosts to planned candidates, each fleet worker at most once."""

    __slots__ = ("_ejected", "_fleet", "_source", "_unfit", "dropped", "taken")

    def __init__(
        self,
        fleet: Fleet,
        source: CandidateSource,
        ejected: Collection[WorkerAddr],
        unfit: Callable[[WorkerAddr], bool] | None = None,
    ) -> None:
        self._fleet = fleet
        self._source = source
        self._ejected = ejected
        self._unfit = unfit
        self.taken: set[int] = set()  # ids of fleet workers already planned (fleet objects are unique)
        self.dropped: list[CandidateExplain] = []

    def admit(
        self,
        hosts: Sequence[HostMatch],
        ranked: list[RankedHost],
        position: int,
        limit: int,
        admitted: list[Candidate],
        rows: list[RankedHost],
        same_rank: RankedHost | None = None,
    ) -> int:
        """Append to ``admitted`` (and each one's ranked row to ``rows``) the candidates for
        ``ranked[position:]`` in order, until it holds ``limit`` or (with ``same_rank``) a host ranks
        differently; return the position after the last host examined.

        A host is dropped and reported (unknown, malformed, ejected), or skipped when its worker is
        already planned (a second entry by gRPC target). One loop for every host a decision examines:
        a call per host would cost more than the mapping.
        """
        by_http_target = self._fleet.by_http_target
        ejected, taken, source, unfit = self._ejected, self.taken, self._source, self._unfit
        end = len(ranked)
        if len(admitted) >= limit:
            return position
        while position < end:
            row = ranked[position]
            if same_rank is not None and (row[0] != same_rank[0] or row[1] != same_rank[1]):
                break
            position += 1
            match = hosts[row[2]]
            target = match.host_ip_port
            worker = by_http_target.get(target)
            if worker is None or ejected:
                found = self._resolve(match, worker)
                if found is None:
                    continue
                worker, target = found
            key = id(worker)
            if key in taken:
                continue  # a second entry for a worker already planned (by gRPC target)
            if unfit is not None and unfit(worker):  # passed over, reported: it cannot serve the request
                self.dropped.append(_drop_explain(match, source, DropReason.UNFIT))
                continue
            taken.add(key)
            # tuple.__new__: a NamedTuple's own constructor is a Python-level call
            admitted.append(tuple.__new__(Candidate, (worker, target, match, source)))
            rows.append(row)
            if len(admitted) >= limit:
                break
        return position

    def _resolve(self, match: HostMatch, worker: WorkerAddr | None) -> tuple[WorkerAddr, str] | None:
        """The worker and canonical target of a host not listed under its own spelling, or of any host
        while some workers are ejected; None when the host is dropped (and reported)."""
        target = match.host_ip_port
        if worker is None:  # not the canonical spelling, or not a discovered worker
            resolved = _resolve_host(target, self._fleet)
            if isinstance(resolved, DropReason):
                self.dropped.append(_drop_explain(match, self._source, resolved))
                return None
            worker, target = resolved
        if self._ejected and worker in self._ejected:
            self.dropped.append(_drop_explain(match, self._source, DropReason.EJECTED))
            return None
        return worker, target

    def release(self, candidates: Iterable[Candidate]) -> None:
        self.taken.difference_update(id(c.worker) for c in candidates)


def _rank_hosts(hosts: Sequence[HostMatch], p2p_hit_discount: float) -> list[RankedHost]:
    """(−effective blocks, −local, answer index) of each positive host, best first."""
    ranked = [
        (-effective_blocks(h, p2p_hit_discount) if h.p2p_total > h.local else -h.local, -h.local, i)
        for i, h in enumerate(hosts)
        if h.local >= 1 or h.p2p_total >= 1
    ]
    ranked.sort()  # the answer index breaks no tie that matters: exact ties at the cut are re-ranked
    return ranked


def _hot_set(
    hosts: Sequence[HostMatch], ranked: list[RankedHost], slots: int, seed: bytes, builder: _HotSetBuilder
) -> list[Candidate]:
    hot: list[Candidate] = []
    rows: list[RankedHost] = []
    position = builder.admit(hosts, ranked, 0, slots, hot, rows)
    if not hot or position >= len(ranked) or ranked[position][:2] != rows[-1][:2]:
        return hot
    # Exact tie across the cut: rank the whole tied group per request.
    cut = rows[-1]
    first_tied = next(i for i, row in enumerate(rows) if row[:2] == cut[:2])  # rows are in rank order
    tied = hot[first_tied:]
    del hot[first_tied:]
    builder.admit(hosts, ranked, position, len(ranked), tied, [], same_rank=cut)
    tied.sort(key=lambda c: _target_rank(seed, c.target))
    keep = slots - len(hot)
    hot.extend(tied[:keep])
    builder.release(tied[keep:])
    return hot


# Hosts spelled otherwise than their worker's canonical target that one plan parses to find its cold
# picks' matches: the spelling is rare, and parsing costs microseconds a host.
_COLD_MATCH_PARSES = 256


def _matches_of(hosts: Sequence[HostMatch], fleet: Fleet, wanted: set[str]) -> dict[str, HostMatch]:
    """The answer's matches by canonical target, as the cold walk names workers, for the ``wanted``
    targets (the first entry for a worker wins). An answer may spell a worker otherwise (an IPv6
    address written out in full, a port with leading zeros): such hosts are parsed, at most
    ``_COLD_MATCH_PARSES``."""
    by_http_target = fleet.by_http_target
    found: dict[str, tuple[int, HostMatch]] = {}
    spelled_otherwise: list[tuple[int, HostMatch]] = []
    for i, match in enumerate(hosts):
        target = match.host_ip_port
        if target not in by_http_target:
            spelled_otherwise.append((i, match))
        elif target in wanted and target not in found:
            found[target] = (i, match)
    for i, match in spelled_otherwise[:_COLD_MATCH_PARSES]:
        resolved = _resolve_host(match.host_ip_port, fleet)
        if isinstance(resolved, DropReason) or resolved[1] not in wanted:
            continue
        earlier = found.get(resolved[1])
        if earlier is None or i < earlier[0]:
            found[resolved[1]] = (i, match)
    return {target: match for target, (_, match) in found.items()}


def plan_candidates(
    hosts: Sequence[HostMatch],
    fleet: Fleet,
    *,
    request_id: str,
    namespace: str,
    config: ScorerConfig,
    hot_source: CandidateSource = CandidateSource.HOT,
    ejected: Collection[WorkerAddr] = frozenset(),
    unfit: Callable[[WorkerAddr], bool] | None = None,
) -> CandidatePlan:
    """The hot set then the cold set (see the module docstring).

    A cold worker that the answer also lists keeps its match. Cost: O(m log m) for an answer
    of m hosts, plus O(cold + skipped) fleet entries.
    """
    seed = request_seed(request_id, namespace)
    builder = _HotSetBuilder(fleet, hot_source, ejected, unfit)
    ranked = _rank_hosts(hosts, max(0.0, config.p2p_hit_discount))
    hot = _hot_set(hosts, ranked, max(0, config.hot_set_size), seed, builder)
    cold_picks = _cold_walk(fleet, seed, config.cold_set_size, builder.taken, ejected, unfit)
    cold: list[Candidate] = []
    if cold_picks:
        by_host = _matches_of(hosts, fleet, {fleet.targets[i] for _, i in cold_picks})
        targets = fleet.targets
        cold = [
            Candidate(worker, targets[i], by_host.get(targets[i]), CandidateSource.COLD) for worker, i in cold_picks
        ]
    hot.extend(cold)
    return CandidatePlan(tuple(hot), tuple(builder.dropped))
