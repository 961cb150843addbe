"""Scorer: the actor that owns the selection policy and serialises every decision through one task.

The policy (CacheAffinityFirst) keeps a ledger of recent selections and their pre-charges; a
decision reads it and records into it. Running every decision in the Scorer's own task makes
that read-modify-write atomic by ownership, not by the absence of awaits in callers: a request
sends a :class:`DecideRequest` through the bounded inbox and waits for the reply under its own
deadline; fallback dispatches (shadow or domain) arrive as fire-and-forget records. The reply
carries the policy's own time in the Scorer's task apart from the wait for it: a caller's wall
time across the hop also holds the inbox and every task the loop ran first.

Readers that must not wait use :meth:`Scorer.health`, an immutable snapshot the task publishes
once per batch of messages it drained.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import trio

from actors.inbox import take_queued
from router.logs import AggregatingLogger
from router.policy.base import Policy, PolicyHealth
from router.policy.cache_affinity import CONTRACT_DROPS, ObservedStatus, ScoreSheet, Selection
from router.policy.plan import CandidatePlan, CandidateSource, Fleet
from router.slot_init import slot_init
from router.types import DropReason, HostMatch, Role, WorkerAddr, WorkerStatus

log = logging.getLogger(__name__)


@slot_init
@dataclass(frozen=True, slots=True)
class DecideRequest:
    """One decision's inputs: the plan, the statuses in hand (status, trio time taken), and why
    the other candidates have none."""

    plan: CandidatePlan
    statuses: Mapping[WorkerAddr, tuple[WorkerStatus, float]]
    missing: Mapping[WorkerAddr, DropReason]
    seq_len: int
    block_size: int
    roles: Collection[Role]
    now: float  # the request's trio time; the charge is made at the later of it and the Scorer's decision


class Decided(NamedTuple):
    """The Scorer's reply to one :class:`DecideRequest`."""

    selection: Selection
    work_s: float  # the policy's time on this decision in the Scorer's task (trio time), without the wait


class ScorerUnavailable(Exception):
    """The Scorer could not decide (its policy raised); the message says why."""


@dataclass(eq=False, slots=True)
class _Decision:
    request: DecideRequest
    caller: trio.lowlevel.Task  # woken by the Scorer's task once decided
    selection: Selection | None = None
    work_s: float = 0.0
    error: str | None = None
    done: bool = False  # decided (or failed): the reply fields are set
    waiting: bool = False  # the caller is parked for the reply
    abandoned: bool = False  # the caller left (its deadline passed): do not decide or record


def _fail(message: _Decision) -> None:
    """A decision the Scorer stopped before making (unless made already): its caller falls back at once."""
    if message.done:
        return
    message.error = "the Scorer stopped before deciding"
    message.done = True
    if message.waiting:
        message.waiting = False
        trio.lowlevel.reschedule(message.caller)


@dataclass(frozen=True, slots=True)
class _Record:
    worker: WorkerAddr
    uncached_tokens: int
    now: float
    requests: int = 1  # the dispatches it charges (sheds come in sums)


@dataclass(frozen=True, slots=True)
class ScorerHealth:
    policy: PolicyHealth
    decisions: int
    no_candidates: int
    abandoned: int  # decisions whose caller had left before the Scorer reached them
    records: int  # fallback dispatches charged to the ledger
    records_dropped: int  # fallback dispatches not charged: the inbox (for sheds' charges, its room) was full
    errors: int
    last_error: str | None
    inbox_depth: int
    inbox_capacity: int


# Room the inbox keeps beyond its requests' own for charging sheds (``charge_nowait``): a request in
# flight sends a decision and a fallback record at most, and sheds are not bounded by the requests in
# flight.
SHED_CHARGE_ROOM = 256


class Scorer:
    """Owns one :class:`Policy`; ``run`` is the only task that touches it."""

    def __init__(
        self,
        policy: Policy,
        *,
        inbox_size: int,
        max_warned_workers: int,
        error_log_interval_s: float,
        retain_settle_s: float,
    ) -> None:
        """``error_log_interval_s``: a failing policy's traceback is logged at most once per interval,
        and the count of the others when the interval ends (a bug would otherwise log one per request).
        ``retain_settle_s``: how long a request planned on the fleet before a ``retain`` may still send
        its decision or charge (the longest routing time): the retain is applied again after it."""
        if inbox_size < 1:
            raise ValueError(f"inbox_size: must be >= 1, got {inbox_size}")
        self._policy = policy
        self._send, self._receive = trio.open_memory_channel[_Decision | _Record](inbox_size)
        self._inbox_size = inbox_size
        self._max_warned = max_warned_workers
        self._warned: OrderedDict[str, None] = OrderedDict()  # contract mismatches, logged once per worker
        self._decisions = 0
        self._no_candidates = 0
        self._abandoned = 0
        self._records = 0
        self._records_dropped = 0
        self._errors = 0
        self._last_error: str | None = None
        self._error_log = AggregatingLogger(log, interval_s=error_log_interval_s, max_keys=1, level=logging.ERROR)
        # Set from a run's end to the next run's start: a decision asked for between a crash and the
        # restart fails at once, as the prober's and the resolver's do, instead of waiting out the
        # request's whole budget in an inbox nobody reads. (Before the first run a decision waits.)
        self._stopped = False
        # The workers discovery lists, when that changed since the task last looked (latest wins): the
        # policy forgets the others before its next message.
        self._retain_next: frozenset[WorkerAddr] | None = None
        # The last retain and when to apply it again: a request planned before it may name a departed
        # worker until then, and its decision or charge would track that worker again.
        self._retain_again: tuple[frozenset[WorkerAddr], float] | None = None
        self._retain_settle_s = retain_settle_s
        self._health = self._snapshot()

    def retain(self, workers: Collection[WorkerAddr]) -> None:
        """Keep only ``workers``' ledger entries and scoring views from the next message on (any task on
        the trio thread; a departed worker's last status is otherwise held until as many newer workers
        push it out)."""
        self._retain_next = frozenset(workers)

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
        """The policy's candidate plan. Planning reads only the policy's configuration, never its
        ledger, so it runs in the caller's task; deciding goes through the inbox."""
        return self._policy.plan(
            hosts, fleet, request_id=request_id, source=source, ejected=ejected, unfit=unfit
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the inbox until cancelled: drain what is queued without yielding between messages (each
        is short and bounded, and nothing can add to the inbox meanwhile), publish the health snapshot
        once per batch, then wait for the next message."""
        receive = self._receive
        deciding: _Decision | None = None  # the decision in hand: a bug while making it fails it too
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._error_log.run)  # logs the failures' totals when their interval ends
                self._stopped = False
                task_status.started()
                while True:
                    try:
                        message = receive.receive_nowait()
                    except trio.WouldBlock:
                        self._health = self._snapshot()
                        message = await receive.receive()
                    now = message.now if isinstance(message, _Record) else message.request.now
                    if self._retain_next is not None:
                        self._policy.retain(self._retain_next)
                        self._retain_again = (self._retain_next, now + self._retain_settle_s)
                        self._retain_next = None
                    elif self._retain_again is not None and now >= self._retain_again[1]:
                        self._policy.retain(self._retain_again[0])
                        self._retain_again = None
                    if isinstance(message, _Record):
                        self._policy.record(
                            message.worker, message.uncached_tokens, message.now, requests=message.requests
                        )
                        self._records += message.requests
                    elif message.abandoned:
                        self._abandoned += 1
                    else:
                        deciding = message
                        self._decide(message)
                        deciding = None
        finally:
            self._stopped = True
            if deciding is not None:
                _fail(deciding)
            self._fail_queued()

    def _fail_queued(self) -> None:
        """At the task's end: the decisions still queued fail now (their callers fall back at once);
        the dispatch records are queued again for the next run, which applies them."""
        for message in take_queued(self._receive):
            if isinstance(message, _Record):
                self._send.send_nowait(message)
            else:
                _fail(message)

    async def decide(self, request: DecideRequest) -> Decided:
        """The policy's selection for ``request``, recorded in its ledger, and the policy's time on it.

        Waits for the inbox and the reply under the caller's own deadline; a caller cancelled
        while waiting leaves nothing recorded unless the Scorer had already decided.
        Raises :class:`ScorerUnavailable` when the policy failed on this request.
        """
        if self._stopped:
            raise ScorerUnavailable("the Scorer is not running (it is restarting)")
        message = _Decision(request, trio.lowlevel.current_task())

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            # Marked at the moment the cancellation is delivered, not when this task next runs: the
            # Scorer's task may run first in the same batch, and must not charge a selection to a
            # caller that has already left.
            message.waiting = False
            message.abandoned = True
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            try:
                self._send.send_nowait(message)  # the common case: room in the inbox, no extra schedule point
            except trio.WouldBlock:
                await self._send.send(message)
            if not message.done:
                message.waiting = True
                await trio.lowlevel.wait_task_rescheduled(abort)
        except BaseException:
            message.abandoned = True
            raise
        if message.selection is None:
            raise ScorerUnavailable(message.error or "no selection")
        return Decided(message.selection, message.work_s)

    def record_nowait(self, worker: WorkerAddr, uncached_tokens: int, now: float, *, requests: int = 1) -> bool:
        """Charge ``requests`` dispatches the policy did not decide, ``uncached_tokens`` in all; never
        blocks. False (and the requests counted dropped) when full."""
        try:
            self._send.send_nowait(_Record(worker, uncached_tokens, now, requests))
        except trio.WouldBlock:
            self._records_dropped += requests
            return False
        return True

    def charge_nowait(self, worker: WorkerAddr, uncached_tokens: int, now: float, *, requests: int = 1) -> bool:
        """Charge ``requests`` dispatches of requests that never were in flight (answered
        ``overloaded``), ``uncached_tokens`` in all: as :meth:`record_nowait`, but only while fewer than
        ``SHED_CHARGE_ROOM`` messages wait, so however many sheds come, the requests in flight keep the
        inbox's room for their own (False, and the requests counted dropped)."""
        if self._receive.statistics().current_buffer_used >= SHED_CHARGE_ROOM:
            self._records_dropped += requests
            return False
        return self.record_nowait(worker, uncached_tokens, now, requests=requests)

    def health(self) -> ScorerHealth:
        """The snapshot the Scorer's task last published, with the counters callers keep themselves."""
        return replace(
            self._health,
            records_dropped=self._records_dropped,
            inbox_depth=self._receive.statistics().current_buffer_used,
        )

    def _decide(self, message: _Decision) -> None:
        request = message.request
        started = trio.current_time()
        try:
            observe = self._policy.observe
            statuses: dict[WorkerAddr, ObservedStatus] = {
                worker: observe(worker, status, taken_at) for worker, (status, taken_at) in request.statuses.items()
            }
            selection = self._policy.decide(
                request.plan,
                statuses,
                seq_len=request.seq_len,
                block_size=request.block_size,
                # Charged as decided now, not when asked: a status sent while the request waited in
                # this inbox cannot hold its dispatch, and clears the charges made before it.
                now=max(request.now, started),
                roles=request.roles,
                missing=request.missing,
            )
        except Exception as exc:  # one request's bad input must not stop the Scorer: that request falls back
            self._errors += 1
            self._last_error = repr(exc)
            message.error = repr(exc)
            self._error_log.note(
                "scorer_failed",
                started,
                f"the policy failed on a decision, which falls back: {exc!r}",
                exc_info=exc,
            )
        else:
            self._decisions += 1
            if selection.worker is None:
                self._no_candidates += 1
            if any(reason in CONTRACT_DROPS for reason, _ in selection.drop_counts):
                self._warn_mismatches(request, selection.sheet)
            message.selection = selection
        message.work_s = trio.current_time() - started
        message.done = True
        if message.waiting:
            message.waiting = False
            trio.lowlevel.reschedule(message.caller)

    def _snapshot(self) -> ScorerHealth:
        return ScorerHealth(
            policy=self._policy.health(),
            decisions=self._decisions,
            no_candidates=self._no_candidates,
            abandoned=self._abandoned,
            records=self._records,
            records_dropped=self._records_dropped,
            errors=self._errors,
            last_error=self._last_error,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._inbox_size,
        )

    def _warn_mismatches(self, request: DecideRequest, sheet: ScoreSheet) -> None:
        for candidate, drop in zip(request.plan.candidates, sheet.drops, strict=True):
            if drop not in CONTRACT_DROPS or candidate.target in self._warned:
                continue
            self._warned[candidate.target] = None
            if len(self._warned) > self._max_warned:
                self._warned.popitem(last=False)
            status = request.statuses[candidate.worker][0]
            log.warning(
                "worker contract mismatch target=%s reason=%s worker_block_size=%s worker_lookahead=%s "
                "worker_kv_cache_group_mode=%s keys_block_size=%s (logged once per worker)",
                candidate.target,
                drop.value,
                status.block_size,
                status.lookahead_tokens,
                status.kv_cache_group_mode.name,
                request.block_size,
            )
