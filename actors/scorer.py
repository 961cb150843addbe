"""CacheAffinityFirst (selection.md §2) and the candidate plan (§3): a pure core and its owner.

The pure part takes values and returns values, with time passed in; nothing here does I/O
or reads a clock:

- :func:`plan_candidates` turns a cache answer (KVCM's, or the shadow index's) and an
  indexed discovery snapshot (:class:`Fleet`) into the candidates to probe and score.
- :func:`score` applies the filters, hit, work, orders, guard, gate and bound of §2 and
  returns a :class:`Selection` (chosen worker, reason, hit, drop counts by reason; the
  per-candidate explanation and the §2.7 claim order are built on demand).
- :class:`SelectionLedger` holds the only state the policy needs between decisions: each
  worker's last-selected time and its local pre-charge, bounded (LRU over workers).

:class:`Scorer` owns the ledger. Its ``decide`` is synchronous — no ``await`` inside —
so on trio's single thread two decisions can never interleave: scoring a request and
recording its selection happen atomically, and the next decision sees the pre-charge.
That is how the reference scheduler's claim by compare-and-set (§2.7) is adapted here:
the claim cannot fail, because nobody else can take the worker between scoring and
recording. The §2.7 spread order is still available (:meth:`Selection.alternates`) for a
caller that cannot use the chosen worker.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import logging
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from router.config import DeploymentConfig, ScorerConfig
from router.targets import TargetError, format_target, parse_target
from router.types import (
    CandidateExplain,
    DropReason,
    HostMatch,
    Reason,
    Role,
    WorkerAddr,
    WorkerStatus,
)

log = logging.getLogger(__name__)

_NEVER = -math.inf  # last-selected time of a worker never selected: sorts first (preferred)


def round_half_up(x: float) -> int:
    """Java's ``Math.round`` on a double: floor(x + 1/2), computed exactly.

    With ``x = num / den`` exactly (every finite double is a ratio of integers),
    floor(x + 1/2) = floor((2·num + den) / (2·den)) in integer arithmetic — so
    0.49999999999999994 rounds to 0, where ``math.floor(x + 0.5)`` would give 1.
    """
    num, den = x.as_integer_ratio()
    return (2 * num + den) // (2 * den)


def hit_tokens(match: HostMatch | None, block_size: int, seq_len: int, p2p_hit_discount: float) -> int:
    """§2.2: ``round_half_up(effective_blocks × block_size)`` capped at ``seq_len``; 0 without a match.

    ``effective_blocks`` and its product are computed in doubles in the reference's order,
    then rounded exactly; with no P2P extension the product is an exact integer.
    """
    if match is None or block_size <= 0:
        return 0
    local = match.local
    if match.p2p_total <= local or p2p_hit_discount <= 0:
        return 0 if local <= 0 else min(seq_len, local * block_size)
    effective = local + (match.p2p_total - local) * p2p_hit_discount
    return 0 if effective <= 0 else min(seq_len, round_half_up(effective * block_size))


# ---------------------------------------------------------------------------------------------
# Candidate plan (§3)
# ---------------------------------------------------------------------------------------------


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
    fleet: Fleet, seed: bytes, count: int, taken: set[int], ejected: Collection[WorkerAddr]
) -> list[tuple[WorkerAddr, int]]:
    """Up to ``count`` fleet workers (with their indices) not taken (by id) nor ejected, in
    per-request order.

    The seed PR ranked every worker by sha256(request id, namespace, target), which costs
    O(fleet) per request. Here the request seed picks a start index and a stride coprime
    with the fleet size; stepping visits distinct workers, so the walk examines ``count`` +
    (hot or ejected workers met on the way) entries, whatever the fleet size. Every worker
    is equally likely to come first, and the order is reproducible per request (a function
    of request id, namespace and the fleet's targets).
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
        if id(worker) not in taken and not (ejected and worker in ejected):
            picked.append((worker, index))
            taken.add(id(worker))
            if len(picked) == count:
                break
        index = (index + stride) % n
    return picked


def plan_candidates(
    hosts: Sequence[HostMatch],
    fleet: Fleet,
    *,
    request_id: str,
    namespace: str,
    config: ScorerConfig,
    hot_source: CandidateSource = CandidateSource.HOT,
    ejected: Collection[WorkerAddr] = frozenset(),
) -> CandidatePlan:
    """The candidate plan of selection.md §3.

    Hot set: hosts with ``local ≥ 1`` or ``p2p_total ≥ 1``, by (−effective blocks, −local),
    mapped to discovered workers, one per gRPC target, the first ``config.hot_set_size``.
    Where hosts tie exactly at that cut, the per-request rank sha256(seed ‖ target) decides
    who is in (never the address, never the answer's order). Unknown, malformed and ejected
    hosts are dropped and reported; they take no hot slot.

    Cold set: ``config.cold_set_size`` discovered workers not in the hot set and not ejected,
    in a reproducible per-request order (:func:`_cold_walk`). A cold worker that the answer
    also lists keeps its match.

    Cost: O(m log m) for an answer of m hosts, plus O(cold + skipped) fleet entries.
    """
    seed = request_seed(request_id, namespace)
    discount = max(0.0, config.p2p_hit_discount)
    ranked = [
        (-(h.local + (h.p2p_total - h.local) * discount if h.p2p_total > h.local else h.local), -h.local, i)
        for i, h in enumerate(hosts)
        if h.local >= 1 or h.p2p_total >= 1
    ]
    ranked.sort()  # the answer index breaks no tie that matters: exact ties at the cut are re-ranked

    slots = max(0, config.hot_set_size)
    hot: list[Candidate] = []
    hot_keys: list[tuple[float, int]] = []
    taken: set[int] = set()  # ids of fleet workers already planned (fleet objects are unique)
    dropped: list[CandidateExplain] = []

    by_target = fleet.by_http_target

    def admit(match: HostMatch) -> Candidate | None:
        target = match.host_ip_port
        worker = by_target.get(target)
        if worker is None:  # not the canonical spelling, or not a discovered worker
            resolved = _resolve_host(target, fleet)
            if isinstance(resolved, DropReason):
                dropped.append(_drop_explain(match, hot_source, resolved))
                return None
            worker, target = resolved
        if ejected and worker in ejected:
            dropped.append(_drop_explain(match, hot_source, DropReason.EJECTED))
            return None
        if id(worker) in taken:
            return None  # a second entry for a worker already planned (by gRPC target)
        taken.add(id(worker))
        return Candidate(worker, target, match, hot_source)

    position = 0
    while position < len(ranked) and len(hot) < slots:
        neg_eff, neg_local, i = ranked[position]
        position += 1
        candidate = admit(hosts[i])
        if candidate is not None:
            hot.append(candidate)
            hot_keys.append((neg_eff, neg_local))
    if hot and position < len(ranked) and ranked[position][:2] == hot_keys[-1]:
        # Exact tie across the cut: rank the whole tied group per request.
        cut_key = hot_keys[-1]
        tied = [c for c, key in zip(hot, hot_keys, strict=True) if key == cut_key]
        del hot[len(hot) - len(tied) :]
        while position < len(ranked) and ranked[position][:2] == cut_key:
            candidate = admit(hosts[ranked[position][2]])
            position += 1
            if candidate is not None:
                tied.append(candidate)
        tied.sort(key=lambda c: _target_rank(seed, c.target))
        keep = slots - len(hot)
        hot.extend(tied[:keep])
        taken.difference_update(id(c.worker) for c in tied[keep:])

    cold_picks = _cold_walk(fleet, seed, config.cold_set_size, taken, ejected)
    cold: list[Candidate] = []
    if cold_picks:
        by_host = {h.host_ip_port: h for h in reversed(hosts)}  # the first entry per host wins
        targets = fleet.targets
        cold = [
            Candidate(worker, targets[i], by_host.get(targets[i]), CandidateSource.COLD)
            for worker, i in cold_picks
        ]
    return CandidatePlan(tuple(hot) + tuple(cold), tuple(dropped))


# ---------------------------------------------------------------------------------------------
# Selection ledger: last-selected times and local pre-charge
# ---------------------------------------------------------------------------------------------


class _LedgerEntry:
    """One worker's last-selected time and charges.

    Charges are kept as parallel lists of times and running totals, live from ``head``:
    ``cums[i]`` is every token charged up to and including charge ``i``, ``base`` the total
    of the charges a status has cleared, ``total`` of all. So the pending tokens since ``t``
    are ``total`` minus the running total just before the first charge made at or after
    ``t`` — one bisection, however many charges a stale status has let pile up.
    """

    __slots__ = ("base", "cums", "head", "last_selected", "times", "total")

    def __init__(self) -> None:
        self.last_selected = _NEVER
        self.times: list[float] = []
        self.cums: list[int] = []
        self.head = 0
        self.base = 0
        self.total = 0

    def pending(self, since: float) -> int:
        k = bisect.bisect_left(self.times, since, self.head)
        return self.total - (self.base if k == self.head else self.cums[k - 1])

    def clear_before(self, since: float) -> None:
        k = bisect.bisect_left(self.times, since, self.head)
        if k > self.head:
            self.base = self.cums[k - 1]
            self.head = k

    def charge(self, now: float, tokens: int, max_charges: int) -> None:
        if self.times and now < self.times[-1]:
            now = self.times[-1]  # keep times sorted if a caller's clock steps back
        self.total += tokens
        self.times.append(now)
        self.cums.append(self.total)
        if len(self.times) - self.head > max_charges:
            # Forget the oldest charge's time but not its tokens (base is unchanged): they
            # now clear only with the next charge, so they stay counted a little longer —
            # over-estimating load spreads more; it never piles on.
            self.head += 1
        if self.head > max_charges:
            del self.times[: self.head]
            del self.cums[: self.head]
            self.head = 0


class SelectionLedger:
    """Per-worker last-selected time and local pre-charge, bounded (LRU over workers).

    Pre-charge rule: a charge carries the time it was made; a status taken at ``t`` already
    reflects the dispatches made before ``t``, so it clears the charges made before ``t``
    and only charges made at or after ``t`` are added to that status's work. Statuses of a
    worker only get newer (the prober's cache moves forward); a status older than one already
    recorded with is charged only what remains (charges made before the newest are gone).

    A worker evicted from the ledger is treated as never selected and uncharged.
    """

    def __init__(self, max_tracked_workers: int, max_pending_charges: int) -> None:
        if max_tracked_workers < 1:
            raise ValueError(f"max_tracked_workers: must be >= 1, got {max_tracked_workers}")
        if max_pending_charges < 1:
            raise ValueError(f"max_pending_charges: must be >= 1, got {max_pending_charges}")
        self._max_workers = max_tracked_workers
        self._max_charges = max_pending_charges
        self._entries: OrderedDict[str, _LedgerEntry] = OrderedDict()  # by worker http target

    def __len__(self) -> int:
        return len(self._entries)

    def view(self, worker: str, status_taken_at: float) -> tuple[int, float]:
        """(pending tokens since ``status_taken_at``, last-selected time) in one lookup."""
        entry = self._entries.get(worker)
        if entry is None:
            return 0, _NEVER
        return entry.pending(status_taken_at), entry.last_selected

    def record(
        self, worker: str, uncached_tokens: int, now: float, status_taken_at: float | None = None
    ) -> None:
        """§2.8: charge ``uncached_tokens`` to ``worker`` (its http target) at ``now``; mark it
        selected at ``now``.

        ``status_taken_at`` (the status the selection was made with, if any) clears the
        charges made before it.
        """
        entry = self._entries.get(worker)
        if entry is None:
            entry = self._entries[worker] = _LedgerEntry()
            if len(self._entries) > self._max_workers:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(worker)
        if status_taken_at is not None:
            entry.clear_before(status_taken_at)
        entry.charge(now, max(0, uncached_tokens), self._max_charges)
        entry.last_selected = max(entry.last_selected, now)


# ---------------------------------------------------------------------------------------------
# CacheAffinityFirst (§2)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObservedStatus:
    """A worker status and the (trio) time it was taken (the prober's ``observed_at``).

    A status clears the pre-charges made before ``taken_at``; the probe's send time would be
    the exact cut, its receive time also clears a dispatch made while the probe was in flight.

    Build one per status received and reuse it for every decision while it is fresh: the
    outstanding uncached tokens (a sum over the worker's tasks) are computed once, here.
    """

    status: WorkerStatus
    taken_at: float
    outstanding_uncached_tokens: int = field(init=False)
    waiting_count: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outstanding_uncached_tokens", self.status.outstanding_uncached_tokens)
        object.__setattr__(self, "waiting_count", self.status.waiting_count)


class ScoreSheet:
    """What one decision saw, kept so the explanation and the §2.7 order can be built on
    demand: building them for every decision would cost more than the decision itself."""

    __slots__ = ("_chosen", "_claim", "_drops", "_hits", "_observed", "_plan", "_works")

    def __init__(
        self,
        plan: CandidatePlan,
        hits: list[int],
        works: list[int | None],
        drops: list[DropReason | None],
        observed: list[ObservedStatus | None],
        chosen: int | None,
        claim: Callable[[], tuple[tuple[WorkerAddr, Reason], ...]],
    ) -> None:
        self._plan = plan
        self._hits = hits
        self._works = works
        self._drops = drops
        self._observed = observed
        self._chosen = chosen
        self._claim = claim

    def explain(self) -> tuple[CandidateExplain, ...]:
        """Every candidate (plan drops first): hit, work, role, drop reason, which was chosen."""
        rows = list(self._plan.dropped)
        for index, candidate in enumerate(self._plan.candidates):
            observed = self._observed[index]
            drop = self._drops[index]
            rows.append(
                CandidateExplain(
                    target=candidate.target,
                    source=candidate.source.value,
                    local_blocks=0 if candidate.match is None else candidate.match.local,
                    hit_tokens=self._hits[index],
                    work_tokens=self._works[index],
                    role=None if observed is None else observed.status.role.value,
                    dropped=None if drop is None else drop.value,
                    chosen=index == self._chosen,
                )
            )
        return tuple(rows)

    def alternates(self) -> tuple[tuple[WorkerAddr, Reason], ...]:
        """§2.7's claim order after the chosen worker, each with the reason it would carry."""
        return self._claim()

    @property
    def chosen_index(self) -> int:
        """Index in the plan's candidates of the chosen worker (only when one was chosen)."""
        if self._chosen is None:
            raise LookupError("no candidate was chosen")
        return self._chosen

    @property
    def drops(self) -> Sequence[DropReason | None]:
        """Per plan candidate: why it was dropped, or None if it was scored."""
        return self._drops


@dataclass(frozen=True, slots=True)
class Selection:
    """The Scorer's decision for one request.

    ``worker`` is None (reason NO_CANDIDATES) when no candidate passed the filters.
    ``drop_counts`` counts dropped candidates by reason, plan drops included.
    """

    worker: WorkerAddr | None
    role: Role | None
    reason: Reason
    hit_tokens: int
    local_blocks: int
    work_tokens: int
    uncached_tokens: int  # seq_len − hit of the chosen worker: its pre-charge
    status_taken_at: float | None
    drop_counts: tuple[tuple[DropReason, int], ...]
    sheet: ScoreSheet = field(repr=False, compare=False)

    def explain(self) -> tuple[CandidateExplain, ...]:
        return self.sheet.explain()

    def alternates(self) -> tuple[tuple[WorkerAddr, Reason], ...]:
        return self.sheet.alternates()


def _claim_order(
    candidates: tuple[Candidate, ...],
    preferred: int,
    shortest: tuple[int, float, float, int] | None,
    hits: list[int],
    leader_order: list[tuple[int, int, float, float, int]],
    ttft_order: list[tuple[int, float, float, int]],
    eligible: frozenset[int],
    max_extra: int,
) -> tuple[tuple[WorkerAddr, Reason], ...]:
    """§2.7 after the preferred worker: affinity-tolerant eligible workers (hit above the
    shortest's, extra work within the bound) in leader order, then the shortest, then the
    rest in TTFT order."""
    order: list[tuple[WorkerAddr, Reason]] = []
    seen = {preferred}
    if shortest is not None:
        shortest_work, shortest_index = shortest[0], shortest[3]
        shortest_hit = hits[shortest_index]
        for neg_hit, work, _, _, index in leader_order:
            if (
                index not in seen
                and index in eligible
                and -neg_hit > shortest_hit
                and work - shortest_work <= max_extra
            ):
                seen.add(index)
                order.append((candidates[index].worker, Reason.CACHE_AFFINITY_FALLBACK))
        if shortest_index not in seen:
            seen.add(shortest_index)
            order.append((candidates[shortest_index].worker, Reason.SHORTEST_TTFT_FALLBACK))
    for _, _, _, index in ttft_order:
        if index not in seen:
            seen.add(index)
            order.append((candidates[index].worker, Reason.SHORTEST_TTFT_FALLBACK))
    return tuple(order)


def score(
    plan: CandidatePlan,
    statuses: Mapping[WorkerAddr, ObservedStatus],
    ledger: SelectionLedger,
    *,
    config: ScorerConfig,
    roles: Collection[Role],
    seq_len: int,
    block_size: int,
    lookahead_tokens: int | None,
    tie_rng: random.Random,
    missing: Mapping[WorkerAddr, DropReason] | None = None,
) -> Selection:
    """CacheAffinityFirst, selection.md §2, over one plan. Reads the ledger; changes nothing
    but ``tie_rng``'s state.

    ``statuses`` holds the routable statuses the caller has (dead and ejected workers should
    be absent); a candidate without one is dropped with ``missing[worker]`` (default
    NO_STATUS). ``block_size``/``lookahead_tokens`` are those the request's keys were made
    with (``lookahead_tokens`` None: unknown, not checked); a worker that does not report
    its own (None) is accepted. ``work`` includes the ledger's pre-charge, in the orders and
    in the outstanding guard alike.

    Exact ties on (work, last-selected) are broken by draws from ``tie_rng`` handed out in
    target order, so the result is the same whatever order the candidates come in.
    """
    if seq_len < 0:
        raise ValueError(f"seq_len: must be >= 0, got {seq_len}")
    discount = config.p2p_hit_discount
    queue_threshold = config.prefill_queue_size_threshold
    candidates = plan.candidates
    n = len(candidates)
    hits = [0] * n
    works: list[int | None] = [None] * n
    drops: list[DropReason | None] = [None] * n
    observed_by_index: list[ObservedStatus | None] = [None] * n
    drop_totals: dict[DropReason, int] = {}
    for explained in plan.dropped:
        if explained.dropped is not None:
            plan_drop = DropReason(explained.dropped)
            drop_totals[plan_drop] = drop_totals.get(plan_drop, 0) + 1

    view = ledger.view
    # (target, index, work, last-selected, hit) of each candidate that passes the filters (§2.1).
    passed: list[tuple[str, int, int, float, int]] = []
    for index, (worker, target, match, _) in enumerate(candidates):
        if match is not None and match.p2p_total <= match.local and block_size > 0:
            hit = hits[index] = min(seq_len, match.local * block_size) if match.local > 0 else 0
        else:
            hit = hits[index] = hit_tokens(match, block_size, seq_len, discount)
        observed = observed_by_index[index] = statuses.get(worker)
        drop: DropReason | None = None
        if observed is None:
            drop = DropReason.NO_STATUS if missing is None else missing.get(worker, DropReason.NO_STATUS)
        else:
            status = observed.status
            if not status.alive:
                drop = DropReason.NOT_ALIVE
            elif status.role not in roles:
                drop = DropReason.ROLE_NOT_ROUTED
            elif observed.waiting_count >= queue_threshold:
                drop = DropReason.QUEUE_FULL
            elif status.block_size is not None and status.block_size != block_size:
                drop = DropReason.BLOCK_SIZE_MISMATCH
            elif (
                lookahead_tokens is not None
                and status.lookahead_tokens is not None
                and status.lookahead_tokens != lookahead_tokens
            ):
                drop = DropReason.LOOKAHEAD_MISMATCH
        if drop is None:
            assert observed is not None
            pending, last_selected = view(target, observed.taken_at)
            work = works[index] = observed.outstanding_uncached_tokens + pending + (seq_len - hit)
            passed.append((target, index, work, last_selected, hit))
        else:
            drops[index] = drop
            drop_totals[drop] = drop_totals.get(drop, 0) + 1
    drop_counts = tuple(sorted(drop_totals.items(), key=lambda item: item[0].value))

    if not passed:
        return Selection(
            worker=None,
            role=None,
            reason=Reason.NO_CANDIDATES,
            hit_tokens=0,
            local_blocks=0,
            work_tokens=0,
            uncached_tokens=0,
            status_taken_at=None,
            drop_counts=drop_counts,
            sheet=ScoreSheet(plan, hits, works, drops, observed_by_index, None, tuple),
        )

    # §2.4 orders. The tie draw goes to candidates in target order (targets are unique), so
    # it does not depend on the order they came in.
    passed.sort()
    ttft_order: list[tuple[int, float, float, int]] = []
    leader_order: list[tuple[int, int, float, float, int]] = []
    for _, index, work, last_selected, hit in passed:
        tie = tie_rng.random()
        ttft_order.append((work, last_selected, tie, index))
        leader_order.append((-hit, work, last_selected, tie, index))
    ttft_order.sort()
    leader_order.sort()

    # §2.5-2.6.
    max_extra = max(0, config.max_extra_work_tokens)
    threshold = config.outstanding_uncached_tokens_threshold
    eligible = ttft_order if threshold <= 0 else [row for row in ttft_order if row[0] <= threshold]
    shortest = eligible[0] if eligible else None
    leader_index = leader_order[0][4]
    if shortest is None:
        preferred, reason = ttft_order[0][3], Reason.SHORTEST_TTFT_OUTSTANDING_GUARD_FALLBACK
    elif config.min_hit_rate > 0 and (
        seq_len <= 0 or hits[leader_index] * 100 / seq_len < config.min_hit_rate
    ):
        preferred, reason = shortest[3], Reason.SHORTEST_TTFT_LOW_CACHE_HIT
    elif threshold > 0 and leader_order[0][1] > threshold:
        preferred, reason = shortest[3], Reason.SHORTEST_TTFT_OUTSTANDING_GUARD
    elif leader_order[0][1] - shortest[0] <= max_extra:
        preferred, reason = leader_index, Reason.CACHE_LEADER
    else:
        preferred, reason = shortest[3], Reason.SHORTEST_TTFT

    def claim() -> tuple[tuple[WorkerAddr, Reason], ...]:
        eligible_indices = frozenset(row[3] for row in eligible)
        return _claim_order(
            candidates, preferred, shortest, hits, leader_order, ttft_order, eligible_indices, max_extra
        )

    chosen = candidates[preferred]
    chosen_observed = observed_by_index[preferred]
    chosen_work = works[preferred]
    assert chosen_observed is not None and chosen_work is not None
    return Selection(
        worker=chosen.worker,
        role=chosen_observed.status.role,
        reason=reason,
        hit_tokens=hits[preferred],
        local_blocks=0 if chosen.match is None else chosen.match.local,
        work_tokens=chosen_work,
        uncached_tokens=seq_len - hits[preferred],
        status_taken_at=chosen_observed.taken_at,
        drop_counts=drop_counts,
        sheet=ScoreSheet(plan, hits, works, drops, observed_by_index, preferred, claim),
    )


def check_scorer_config(config: ScorerConfig) -> list[str]:
    """Every problem with ``config``, each naming its field (empty when valid)."""
    problems: list[str] = []
    if config.prefill_queue_size_threshold < 1:
        threshold = config.prefill_queue_size_threshold
        problems.append(f"prefill_queue_size_threshold: must be >= 1, got {threshold}")
    for name, value in (("p2p_hit_discount", config.p2p_hit_discount), ("min_hit_rate", config.min_hit_rate)):
        if not math.isfinite(value):
            problems.append(f"{name}: must be a finite number, got {value}")
    if config.hot_set_size < 0:
        problems.append(f"hot_set_size: must be >= 0, got {config.hot_set_size}")
    if config.cold_set_size < 0:
        problems.append(f"cold_set_size: must be >= 0, got {config.cold_set_size}")
    if config.hot_set_size + config.cold_set_size < 1:
        problems.append("hot_set_size, cold_set_size: at least one candidate must be planned")
    if config.max_tracked_workers < 1:
        problems.append(f"max_tracked_workers: must be >= 1, got {config.max_tracked_workers}")
    if config.max_pending_charges < 1:
        problems.append(f"max_pending_charges: must be >= 1, got {config.max_pending_charges}")
    return problems


class Scorer:
    """Owns the selection ledger and the tie-break RNG; decides one request at a time.

    ``decide`` and ``record`` are synchronous and never await, so on trio's single thread
    they are atomic: a selection is recorded before any other decision is scored (§2.7's
    claim, serialized). Call them only from trio tasks of one run (the state is not
    thread-safe, and need not be).
    """

    def __init__(self, config: ScorerConfig, deployment: DeploymentConfig) -> None:
        problems = check_scorer_config(config)
        if not deployment.roles:
            problems.append("roles: the deployment routes to no role")
        if problems:
            raise ValueError("invalid scorer configuration: " + "; ".join(problems))
        self.config = config
        self.deployment = deployment
        self.ledger = SelectionLedger(config.max_tracked_workers, config.max_pending_charges)
        self._tie_rng = random.Random(config.seed)
        # Contract mismatches are logged once per worker (bounded like the ledger).
        self._warned: OrderedDict[str, None] = OrderedDict()
        self._observed: OrderedDict[WorkerAddr, ObservedStatus] = OrderedDict()  # least recently new first

    def observe(self, worker: WorkerAddr, status: WorkerStatus, taken_at: float) -> ObservedStatus:
        """The scoring view of a status in hand, reused while the same status is passed again.

        A cached status is scored by many decisions; summing its tasks once per status (not
        once per decision) is most of a decision's cost saved. Bounded by max_tracked_workers.
        """
        cached = self._observed.get(worker)
        if cached is not None and cached.status is status and cached.taken_at == taken_at:
            return cached
        fresh = ObservedStatus(status, taken_at)
        self._observed.pop(worker, None)
        self._observed[worker] = fresh
        if len(self._observed) > self.config.max_tracked_workers:
            self._observed.popitem(last=False)
        return fresh

    def decide(
        self,
        plan: CandidatePlan,
        statuses: Mapping[WorkerAddr, ObservedStatus],
        *,
        seq_len: int,
        block_size: int,
        now: float,
        roles: Collection[Role] | None = None,
        missing: Mapping[WorkerAddr, DropReason] | None = None,
    ) -> Selection:
        """Score ``plan`` and record the selection at ``now`` (trio time), atomically.

        ``block_size`` is the one the request's keys were made with; the deployment's
        lookahead is the keys' lookahead. ``roles`` defaults to the deployment's.
        """
        selection = score(
            plan,
            statuses,
            self.ledger,
            config=self.config,
            roles=self.deployment.roles if roles is None else roles,
            seq_len=seq_len,
            block_size=block_size,
            lookahead_tokens=self.deployment.lookahead_tokens,
            tie_rng=self._tie_rng,
            missing=missing,
        )
        if selection.worker is not None:
            self.ledger.record(
                plan.candidates[selection.sheet.chosen_index].target,
                selection.uncached_tokens,
                now,
                status_taken_at=selection.status_taken_at,
            )
        if any(reason in _CONTRACT_DROPS for reason, _ in selection.drop_counts):
            self._warn_mismatches(plan, statuses, selection.sheet, block_size)
        return selection

    def record(
        self, worker: WorkerAddr, uncached_tokens: int, now: float, status_taken_at: float | None = None
    ) -> None:
        """Charge a dispatch the Scorer did not decide (shadow or domain fallback) to the ledger."""
        self.ledger.record(worker.http_target, uncached_tokens, now, status_taken_at)

    def _warn_mismatches(
        self,
        plan: CandidatePlan,
        statuses: Mapping[WorkerAddr, ObservedStatus],
        sheet: ScoreSheet,
        block_size: int,
    ) -> None:
        for candidate, drop in zip(plan.candidates, sheet.drops, strict=True):
            if drop not in _CONTRACT_DROPS or candidate.target in self._warned:
                continue
            self._warned[candidate.target] = None
            if len(self._warned) > self.config.max_tracked_workers:
                self._warned.popitem(last=False)
            status = statuses[candidate.worker].status
            log.warning(
                "worker contract mismatch target=%s reason=%s worker_block_size=%s worker_lookahead=%s "
                "keys_block_size=%s keys_lookahead=%s (logged once per worker)",
                candidate.target,
                drop.value,
                status.block_size,
                status.lookahead_tokens,
                block_size,
                self.deployment.lookahead_tokens,
            )


_CONTRACT_DROPS = frozenset({DropReason.BLOCK_SIZE_MISMATCH, DropReason.LOOKAHEAD_MISMATCH})
