"""CacheAffinityFirst: the reference scheduler's selection over one candidate plan.

Pure: values in, values out; time is passed in. The steps, each its own function:

- filters (:func:`filter_candidate`): alive, a routed role, queue below the threshold, the key
  geometry (block size, lookahead) the request's keys were made with;
- hit and work: the cached prefix a worker would reuse (:func:`hit_tokens`), and the uncached
  tokens it would have to prefill before this request's first token: its outstanding uncached
  tokens + the ledger's pre-charge since its status was taken + (seq_len − hit);
- orders: shortest-TTFT order (:func:`ttft_order`: work, last selected, tie draw) and leader order
  (most hit first, then the same): its first row (:func:`cache_leader`) decides, the whole order
  (:func:`leader_order`) is built only for a claim order;
- guard, gate and bound (:func:`choose`): the outstanding-tokens guard, the minimum-hit gate,
  and the extra-work bound the cache leader may cost over the shortest;
- choose: the preferred worker and the reason, then the ledger records it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from router.config import DeploymentConfig, ScorerConfig
from router.policy.base import PolicyHealth
from router.policy.ledger import SelectionLedger
from router.policy.plan import Candidate, CandidatePlan, CandidateSource, Fleet, effective_blocks, plan_candidates
from router.problems import Problem, range_problems, refuse
from router.slot_init import slot_init
from router.types import (
    PREFILL_CAPABLE_ROLES,
    CandidateExplain,
    DropReason,
    HostMatch,
    KvCacheGroupMode,
    QueryType,
    Reason,
    Role,
    WorkerAddr,
    WorkerStatus,
)


def round_half_up(x: float) -> int:
    """Java's ``Math.round`` on a double: floor(x + 1/2), computed exactly.

    With ``x = num / den`` exactly (every finite double is a ratio of integers),
    floor(x + 1/2) = floor((2·num + den) / (2·den)) in integer arithmetic — so
    0.49999999999999994 rounds to 0, where ``math.floor(x + 0.5)`` would give 1.
    """
    num, den = x.as_integer_ratio()
    return (2 * num + den) // (2 * den)


def hit_tokens(match: HostMatch | None, block_size: int, seq_len: int, p2p_hit_discount: float) -> int:
    """``round_half_up(effective blocks × block_size)`` capped at ``seq_len``; 0 without a match."""
    if match is None or block_size <= 0:
        return 0
    effective = effective_blocks(match, p2p_hit_discount)
    if effective <= 0:
        return 0
    if isinstance(effective, int):  # no P2P extension: the product is an exact integer
        return min(seq_len, effective * block_size)
    return min(seq_len, round_half_up(effective * block_size))


@slot_init
@dataclass(frozen=True, slots=True)
class ObservedStatus:
    """A worker status and the (trio) time it was taken: its call's send time (the prober's
    ``sent_at``), a time the status cannot be older than.

    A status clears the pre-charges made before ``taken_at``: a dispatch decided while its call was
    in flight may not be in it, so it stays charged (a reply's arrival would clear it).

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


class StatusViews:
    """The scoring view of each worker's status in hand, reused while the same status is passed
    again: a cached status is scored by many decisions, and summing its tasks once per status (not
    once per decision) saves most of a decision's cost. Bounded: the least recently new view goes
    first.

    The views are kept per worker; each is also indexed by its status object's id, so reusing one
    (every candidate of every decision) hashes an int rather than the worker's address.
    """

    __slots__ = ("_bound", "_by_status", "_views")

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._views: OrderedDict[WorkerAddr, ObservedStatus] = OrderedDict()
        # id(view.status) -> (worker, taken_at, view), only for views still in _views: the held view
        # keeps its status alive, so while an entry exists its id names that very status object.
        self._by_status: dict[int, tuple[WorkerAddr, float, ObservedStatus]] = {}

    def observe(self, worker: WorkerAddr, status: WorkerStatus, taken_at: float) -> ObservedStatus:
        known = self._by_status.get(id(status))
        if known is not None and known[0] is worker and known[1] == taken_at:
            return known[2]
        return self._observe_by_worker(worker, status, taken_at)

    def _observe_by_worker(self, worker: WorkerAddr, status: WorkerStatus, taken_at: float) -> ObservedStatus:
        views = self._views
        cached = views.get(worker)
        if cached is not None and cached.status is status and cached.taken_at == taken_at:
            self._by_status[id(status)] = (worker, taken_at, cached)
            return cached
        fresh = ObservedStatus(status, taken_at)
        if cached is not None:
            del views[worker]
            self._unindex(cached)
        views[worker] = fresh
        self._by_status[id(status)] = (worker, taken_at, fresh)
        if len(views) > self._bound:
            _, evicted = views.popitem(last=False)
            self._unindex(evicted)
        return fresh

    def retain(self, workers: Collection[WorkerAddr]) -> None:
        """Forget the views of every worker not in ``workers`` (each holds its last status whole)."""
        for worker in [w for w in self._views if w not in workers]:
            self._unindex(self._views.pop(worker))

    def _unindex(self, view: ObservedStatus) -> None:
        key = id(view.status)
        known = self._by_status.get(key)
        if known is not None and known[2] is view:
            del self._by_status[key]

    def __getitem__(self, worker: WorkerAddr) -> ObservedStatus:
        return self._views[worker]

    def __contains__(self, worker: object) -> bool:
        return worker in self._views

    def __len__(self) -> int:
        return len(self._views)


class ScoreSheet:
    """What one decision saw, kept so the explanation and the claim order can be built on
    demand: building them for every decision would cost more than the decision itself."""

    __slots__ = ("_chosen", "_claim", "_drops", "_hits", "_observed", "_plan", "_seq_len", "_ttft", "_works")

    def __init__(
        self,
        plan: CandidatePlan,
        hits: list[int],
        works: list[int | None],
        drops: list[DropReason | None],
        observed: list[ObservedStatus | None],
        chosen: int | None,
        claim: Callable[[], tuple[tuple[WorkerAddr, Reason], ...]],
        ttft: Sequence[TtftRow] = (),
        seq_len: int = 0,
    ) -> None:
        self._plan = plan
        self._ttft = ttft
        self._seq_len = seq_len
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
        """The claim order after the chosen worker, each with the reason it would carry."""
        return self._claim()

    def ledger_view(self) -> tuple[tuple[str, int, float, float], ...]:
        """The ledger as this decision read it, per candidate that passed the filters, in tie-draw
        order (by target): (target, pending charge, last-selected time, tie draw). Work is
        outstanding + pending + uncached, so the pending charge is recovered from it."""
        rows = []
        for _, last_selected, tie, index in sorted(self._ttft, key=lambda row: self._plan.candidates[row[3]].target):
            observed, work = self._observed[index], self._works[index]
            assert observed is not None and work is not None
            pending = work - observed.outstanding_uncached_tokens - (self._seq_len - self._hits[index])
            rows.append((self._plan.candidates[index].target, pending, last_selected, tie))
        return tuple(rows)

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


@slot_init
@dataclass(frozen=True, slots=True)
class Selection:
    """The policy's decision for one request.

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


# --- filters ---------------------------------------------------------------------------------


def filter_candidate(
    observed: ObservedStatus,
    roles: Collection[Role],
    queue_threshold: int,
    block_size: int,
    lookahead_tokens: int | None,
    group_mode: KvCacheGroupMode | None = None,
) -> DropReason | None:
    """Why a candidate with a status in hand cannot take the request, or None if it can.

    A worker that does not report its block size, lookahead or KV cache group mode is accepted;
    ``group_mode`` None (the query type implies none) checks no mode.
    """
    status = observed.status
    if not status.alive:
        return DropReason.NOT_ALIVE
    if status.role not in roles:
        return DropReason.ROLE_NOT_ROUTED
    if observed.waiting_count >= queue_threshold:
        return DropReason.QUEUE_FULL
    if status.block_size is not None and status.block_size != block_size:
        return DropReason.BLOCK_SIZE_MISMATCH
    if (
        lookahead_tokens is not None
        and status.lookahead_tokens is not None
        and status.lookahead_tokens != lookahead_tokens
    ):
        return DropReason.LOOKAHEAD_MISMATCH
    if (
        group_mode is not None
        and status.kv_cache_group_mode is not KvCacheGroupMode.UNSPECIFIED
        and status.kv_cache_group_mode is not group_mode
    ):
        return DropReason.QUERY_TYPE_MISMATCH
    return None


def expected_group_mode(query_type: QueryType) -> KvCacheGroupMode | None:
    """The KV cache group mode a worker must report for KVCM's answers to the deployment's query type
    to describe its cache (None: the query type implies none, nothing is checked)."""
    if query_type is QueryType.PREFIX_MATCH:
        return KvCacheGroupMode.FULL_ATTENTION_ONLY
    if query_type is QueryType.PREFIX_MATCH_WITH_MAMBA:
        return KvCacheGroupMode.WITH_MAMBA
    return None


# --- orders ----------------------------------------------------------------------------------


PassedRow = tuple[str, int, int, float, int]  # a candidate that passed: (target, plan index, work, last selected, hit)
TtftRow = tuple[int, float, float, int]  # (work, last selected, tie draw, index)


def ttft_order(passed: list[PassedRow], tie_rng: random.Random) -> list[TtftRow]:
    """Shortest-TTFT order over the passed candidates: (work, last selected, tie draw).

    Exact ties on (work, last selected) are broken by draws from ``tie_rng`` handed out in
    target order (targets are unique), so the result does not depend on the order the
    candidates came in. ``passed`` is left in its order (a filtered plan's stays in plan order).
    """
    draw = tie_rng.random
    order = [(work, last_selected, draw(), index) for _, index, work, last_selected, _ in sorted(passed)]
    order.sort()
    return order


def cache_leader(ttft: list[TtftRow], hits: Sequence[int], best_hit: int) -> TtftRow:
    """The first row of the cache-leader order (most hit first, then TTFT order): the first row in
    TTFT order holding ``best_hit``, the most any of them holds."""
    for row in ttft:
        if hits[row[3]] == best_hit:
            return row
    raise ValueError(f"best_hit: no row holds {best_hit}")


def leader_order(ttft: list[TtftRow], hits: Sequence[int]) -> list[TtftRow]:
    """Cache-leader order: most hit first, then TTFT order (the sort is stable)."""
    return sorted(ttft, key=lambda row: -hits[row[3]])


# --- guard, gate, bound: choose ----------------------------------------------------------------


def choose(
    ttft: list[TtftRow],
    leader: TtftRow,
    hits: list[int],
    *,
    seq_len: int,
    config: ScorerConfig,
) -> tuple[int, Reason, list[TtftRow]]:
    """(preferred plan index, reason, the guard-eligible rows) from the TTFT order and the cache
    leader.

    Guard: candidates whose work exceeds the outstanding-tokens threshold are not eligible for
    the shortest pick (if none is eligible, the shortest overall with a *_FALLBACK reason).
    Gate: a leader whose hit is below ``min_hit_rate`` % of the prompt does not lead.
    Bound: the leader wins when it costs at most ``max_extra_work_tokens`` more than the shortest.
    """
    threshold = config.outstanding_uncached_tokens_threshold
    eligible = ttft if threshold <= 0 else [row for row in ttft if row[0] <= threshold]
    shortest = eligible[0] if eligible else None
    leader_work, leader_index = leader[0], leader[3]
    if shortest is None:
        return ttft[0][3], Reason.SHORTEST_TTFT_OUTSTANDING_GUARD_FALLBACK, eligible
    if config.min_hit_rate > 0 and (seq_len <= 0 or hits[leader_index] * 100 / seq_len < config.min_hit_rate):
        return shortest[3], Reason.SHORTEST_TTFT_LOW_CACHE_HIT, eligible
    if threshold > 0 and leader_work > threshold:
        return shortest[3], Reason.SHORTEST_TTFT_OUTSTANDING_GUARD, eligible
    if leader_work - shortest[0] <= max(0, config.max_extra_work_tokens):
        return leader_index, Reason.CACHE_LEADER, eligible
    return shortest[3], Reason.SHORTEST_TTFT, eligible


def claim_order(
    candidates: tuple[Candidate, ...],
    preferred: int,
    eligible: list[TtftRow],
    hits: list[int],
    ttft: list[TtftRow],
    max_extra: int,
) -> tuple[tuple[WorkerAddr, Reason], ...]:
    """The order to try after the preferred worker, for a caller that cannot use it:
    affinity-tolerant eligible workers (hit above the shortest's, extra work within the bound)
    in leader order, then the shortest, then the rest in TTFT order."""
    order: list[tuple[WorkerAddr, Reason]] = []
    seen = {preferred}
    shortest = eligible[0] if eligible else None
    if shortest is not None:
        eligible_indices = frozenset(row[3] for row in eligible)
        shortest_work, shortest_index = shortest[0], shortest[3]
        shortest_hit = hits[shortest_index]
        for work, _, _, index in leader_order(ttft, hits):
            if (
                index not in seen
                and index in eligible_indices
                and hits[index] > shortest_hit
                and work - shortest_work <= max_extra
            ):
                seen.add(index)
                order.append((candidates[index].worker, Reason.CACHE_AFFINITY_FALLBACK))
        if shortest_index not in seen:
            seen.add(shortest_index)
            order.append((candidates[shortest_index].worker, Reason.SHORTEST_TTFT_FALLBACK))
    for _, _, _, index in ttft:
        if index not in seen:
            seen.add(index)
            order.append((candidates[index].worker, Reason.SHORTEST_TTFT_FALLBACK))
    return tuple(order)


# --- one decision ------------------------------------------------------------------------------


class FilteredPlan(NamedTuple):
    """The first steps of a decision over one plan (:func:`score`), what a policy prices: per plan candidate its
    hit, its work (None unless it passed), why it was dropped and the status it was scored on."""

    hits: list[int]
    works: list[int | None]
    drops: list[DropReason | None]
    observed: list[ObservedStatus | None]
    drop_counts: tuple[tuple[DropReason, int], ...]
    passed: list[PassedRow]  # in plan order
    best_hit: int  # the most any passed candidate holds (−1 when none passed)


# A policy's own cost: the passed rows (of the filtered plan, for the config and seq_len) with its
# cost in the work's place.
Ranker = Callable[[FilteredPlan, ScorerConfig, int], list[PassedRow]]
# (preferred plan index, reason, guard-eligible rows, the filtered plan, config) -> the index to take
Respread = Callable[[int, Reason, list[TtftRow], FilteredPlan, ScorerConfig], int]


def select(
    plan: CandidatePlan,
    filtered: FilteredPlan,
    ranked: list[PassedRow],
    tie_rng: random.Random,
    *,
    config: ScorerConfig,
    seq_len: int,
    respread: Respread | None = None,
) -> Selection:
    """The last steps: the TTFT order and the cache leader, guard, gate and bound (:func:`choose`) over
    ``ranked`` (the passed rows with the policy's cost in the work's place), then ``respread`` may move
    the choice; the selection reports the work (no prices). NO_CANDIDATES when nothing passed."""
    candidates = plan.candidates
    hits, works, observed_by_index = filtered.hits, filtered.works, filtered.observed
    if not ranked:
        return Selection(
            worker=None,
            role=None,
            reason=Reason.NO_CANDIDATES,
            hit_tokens=0,
            local_blocks=0,
            work_tokens=0,
            uncached_tokens=0,
            status_taken_at=None,
            drop_counts=filtered.drop_counts,
            sheet=ScoreSheet(plan, hits, works, filtered.drops, observed_by_index, None, tuple),
        )
    ttft = ttft_order(ranked, tie_rng)
    leader = cache_leader(ttft, hits, filtered.best_hit)
    preferred, reason, eligible = choose(ttft, leader, hits, seq_len=seq_len, config=config)
    if respread is not None:
        preferred = respread(preferred, reason, eligible, filtered, config)
    max_extra = max(0, config.max_extra_work_tokens)

    def claim() -> tuple[tuple[WorkerAddr, Reason], ...]:
        return claim_order(candidates, preferred, eligible, hits, ttft, max_extra)

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
        drop_counts=filtered.drop_counts,
        sheet=ScoreSheet(plan, hits, works, filtered.drops, observed_by_index, preferred, claim, ttft, seq_len),
    )


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
    rank: Ranker | None = None,
    respread: Respread | None = None,
    group_mode: KvCacheGroupMode | None = None,
) -> Selection:
    """CacheAffinityFirst over one plan. Reads the ledger; changes nothing but ``tie_rng``'s state.

    ``statuses`` holds the routable statuses the caller has (dead and ejected workers should
    be absent); a candidate without one is dropped with ``missing[worker]`` (default
    NO_STATUS). ``block_size``/``lookahead_tokens`` are those the request's keys were made
    with (``lookahead_tokens`` None: unknown, not checked); ``group_mode`` is the KV cache group mode
    the deployment's query type needs (:func:`expected_group_mode`; None: not checked). ``work`` includes the ledger's
    pre-charge, in the orders and in the outstanding guard alike.

    Another policy passes its own cost (``rank``, in the work's place in the orders, the guard and
    the bound) and may move the choice after (``respread``); the selection reports the work.
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
    status_of = statuses.get
    passed: list[PassedRow] = []
    best_hit = -1
    # The loop runs once per candidate per decision: the common cases of hit_tokens (no P2P extension)
    # and work_tokens are inlined; the functions above state the rules.
    for index, (worker, target, match, _) in enumerate(candidates):
        if match is None or block_size <= 0:
            hit = 0
        elif match.p2p_total <= match.local:
            hit = match.local * block_size  # ≤ 0 exactly when local is
            if hit > seq_len:
                hit = seq_len
            elif hit < 0:
                hit = 0
        else:
            hit = hit_tokens(match, block_size, seq_len, discount)
        hits[index] = hit
        observed = status_of(worker)
        drop: DropReason | None
        if observed is None:
            drop = DropReason.NO_STATUS if missing is None else missing.get(worker, DropReason.NO_STATUS)
        else:
            observed_by_index[index] = observed
            drop = filter_candidate(observed, roles, queue_threshold, block_size, lookahead_tokens, group_mode)
            if drop is None:
                pending, last_selected = view(target, observed.taken_at)
                work = works[index] = observed.outstanding_uncached_tokens + pending + (seq_len - hit)
                passed.append((target, index, work, last_selected, hit))
                if hit > best_hit:
                    best_hit = hit
                continue
        drops[index] = drop
        drop_totals[drop] = drop_totals.get(drop, 0) + 1
    drop_counts = tuple(sorted(drop_totals.items(), key=lambda item: item[0].value)) if drop_totals else ()
    filtered = FilteredPlan(hits, works, drops, observed_by_index, drop_counts, passed, best_hit)
    ranked = passed if rank is None else rank(filtered, config, seq_len)
    return select(plan, filtered, ranked, tie_rng, config=config, seq_len=seq_len, respread=respread)


def scorer_problems(config: ScorerConfig) -> list[Problem]:
    """Every problem with the policy's settings, naming the fields (empty when valid)."""
    found = range_problems(config)
    if config.hot_set_size + config.cold_set_size < 1:
        found.append(Problem(("hot_set_size", "cold_set_size"), "at least one candidate must be planned"))
    return found


CONTRACT_DROPS = frozenset(
    {DropReason.BLOCK_SIZE_MISMATCH, DropReason.LOOKAHEAD_MISMATCH, DropReason.QUERY_TYPE_MISMATCH}
)


class LedgerPolicy:
    """What a selection policy holds: its selection ledger, tie-break RNG and per-status scoring
    views, and the steps around one decision (plan, observe, decide, record). A policy gives its
    own cost and spreading (:func:`score`'s ``rank`` and ``respread``; none: CacheAffinityFirst's),
    the scorer settings its plan uses, and the fixed cost its pre-charge adds to a dispatch's
    uncached tokens.

    It holds state but does no I/O and reads no clock; the Scorer actor owns the one instance
    and is the only caller, so a selection is recorded before any other decision is scored.
    """

    name: str

    def __init__(
        self,
        config: ScorerConfig,
        deployment: DeploymentConfig,
        *,
        status_horizon_s: float,
        tie_rng: random.Random | None = None,
        ledger: SelectionLedger | None = None,
        plan_config: ScorerConfig | None = None,
        charge_tokens: int = 0,
        rank: Ranker | None = None,
        respread: Respread | None = None,
    ) -> None:
        refuse("scorer", scorer_problems(config))
        if not deployment.roles:
            refuse("deployment", [Problem(("roles",), "the deployment routes to no role")])
        self.config = config
        self.deployment = deployment
        self._plan_config = config if plan_config is None else plan_config
        self._charge_tokens = charge_tokens
        self._rank = rank
        self._respread = respread
        # A replay hands in the recorded ledger view and tie draws instead of fresh ones.
        self.ledger = (
            SelectionLedger(config.max_tracked_workers, config.max_pending_charges, status_horizon_s=status_horizon_s)
            if ledger is None
            else ledger
        )
        self._prefill_roles = tuple(r for r in deployment.roles if r in PREFILL_CAPABLE_ROLES)
        self._group_mode = expected_group_mode(deployment.query_type)
        self._tie_rng = random.Random(config.seed) if tie_rng is None else tie_rng
        self._observed = StatusViews(config.max_tracked_workers)
        # The scoring view of a status in hand (:class:`StatusViews`): bound once, since the
        # Scorer calls it for every candidate of every decision.
        self.observe: Callable[[WorkerAddr, WorkerStatus, float], ObservedStatus] = self._observed.observe

    def plan(
        self,
        hosts: Sequence[HostMatch],
        fleet: Fleet,
        *,
        request_id: str,
        source: CandidateSource,
        ejected: Collection[WorkerAddr],
        unfit: Callable[[WorkerAddr], bool] | None = None,
    ) -> CandidatePlan:
        return plan_candidates(
            hosts,
            fleet,
            request_id=request_id,
            namespace=self.deployment.kvcm_instance_id,
            config=self._plan_config,
            hot_source=source,
            ejected=ejected,
            unfit=unfit,
        )

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
        """Score ``plan`` and record the selection (its uncached tokens and the fixed cost) at ``now``.

        ``block_size`` is the one the request's keys were made with; the deployment's
        lookahead is the keys' lookahead. ``roles`` defaults to the deployment's.
        """
        selection = score(
            plan,
            statuses,
            self.ledger,
            config=self.config,
            roles=self._prefill_roles if roles is None else roles,
            seq_len=seq_len,
            block_size=block_size,
            lookahead_tokens=self.deployment.lookahead_tokens,
            tie_rng=self._tie_rng,
            missing=missing,
            rank=self._rank,
            respread=self._respread,
            group_mode=self._group_mode,
        )
        if selection.worker is not None:
            self.ledger.record(
                plan.candidates[selection.sheet.chosen_index].target,
                selection.uncached_tokens + self._charge_tokens,
                now,
                status_taken_at=selection.status_taken_at,
            )
        return selection

    def record(
        self,
        worker: WorkerAddr,
        uncached_tokens: int,
        now: float,
        status_taken_at: float | None = None,
        *,
        requests: int = 1,
    ) -> None:
        """Charge dispatches the policy did not decide (shadow or domain fallback, sheds in sums) to the
        ledger: their tokens and each one's fixed cost."""
        charge = uncached_tokens + requests * self._charge_tokens
        self.ledger.record(worker.http_target, charge, now, status_taken_at)

    def retain(self, workers: Collection[WorkerAddr]) -> None:
        """Forget what the ledger and the scoring views hold of every worker not in ``workers``."""
        self.ledger.retain({worker.http_target for worker in workers})
        self._observed.retain(workers)

    def health(self) -> PolicyHealth:
        return PolicyHealth(
            policy=self.name,
            tracked_workers=len(self.ledger),
            pending_charges=self.ledger.pending_charges(),
            observed_statuses=len(self._observed),
        )


class CacheAffinityFirst(LedgerPolicy):
    """The production policy: the reference scheduler's selection (:func:`score`), exactly."""

    name = "cache_affinity_first"
