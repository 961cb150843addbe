"""The master source: ask the central scheduler first; when it cannot answer, fall through at once.

The master and slave come from :class:`MasterDiscovery`'s snapshot (never waited for). One window
bounds the attempt: ``min(transport timeout, time left − the time kept for the later sources)``,
so a master that accepts the connection and never answers still leaves KVCM its time. With no
cache source after it the window still ends just before the request's deadline: the master's own
window, not the request's scope, then ends a hung call, so the attempt is judged and the breaker
learns of it. Inside the window a transport failure of the master tries the slave once. The
scheduler is told the window's end (from the request's receipt, the time ``request_time_ms``
names) as the call's ``generate_timeout``. A scheduler counting it from its own receipt of the call
may queue the request a little longer (the time from our receipt to its, the network's); the call
ending at the window (a closed connection over HTTP, ``Cancel`` over gRPC) tells it to drop the
request. Outcomes:

- routed: the scheduler's role addresses, as given; the request's worker is the first of a
  prefill-capable role the request routes (a DECODE or VIT address rides along); KVCM is not asked;
- 8600 (not in a 200 reply): domain routing, the cache sources skipped;
- 8503 (QUEUE_TIMEOUT): the scheduler queued the request until the ``generate_timeout`` we sent,
  the window's end (a millisecond early by its rounding, more by its clock's skew): no answer within
  the window, as if the call had been cut there (the slave in its share, then the next source);
- any other code: the request ends with that code and message (the frontend fails it);
- no master known, the breaker open, no usable reply: fall through to the next source.

Consecutive transport failures open the master's breaker (the KVCM breaker's state machine), so
a hanging master costs at most the window for at most the breaker's threshold of requests.

The source is also the actor that owns the breaker, the last error and the outcome counters: only
its ``run`` task changes them. Requests read the :class:`BreakerView` it publishes (a CLOSED
breaker admits and an OPEN one rejects without a hop), ask it only for a trial (request/reply
under the request's deadline), and send one report per attempt (``send_nowait``; dropped and
counted when the inbox is full). ``health()`` is a copy of its state for /debug/actors.
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import trio

from actors.breaker import Admission, AnsweredWithin, BreakerSnapshot, BreakerState, BreakerView, KvcmBreaker
from actors.inbox import Ask, ask
from actors.master_discovery import MasterDiscovery, MasterDiscoverySnapshot
from actors.metrics_sink import MasterRequest, MetricsSink
from actors.sources.base import Answered, Ended, FellThrough, RequestContext, SourceResult, recorded_answer
from actors.sources.domain import DomainSource
from router.config import KvrouteConfig, MasterProtocol
from router.transport.errors import DeadlineExceeded, TransportError
from router.transport.ports import MasterTransport
from router.types import Reason, Role, RoleAddr, RouteDecision, RouteSource, WorkerAddr
from router.wire.master import (
    CODE_QUEUE_TIMEOUT,
    MasterBusinessError,
    MasterFallback,
    MasterReply,
    MasterRouted,
    MasterScheduleRequest,
)

_HTTP_OK = 200
_QUEUE_FULL_CODE = 429
# Kept after the master's window when only the domain source follows. It answers without waiting,
# so this is not its time: it makes the window end before the request's own deadline, whose scope
# (outer, and cancelled at the same instant) would otherwise take a hung call's cancellation and
# leave the attempt unjudged.
DOMAIN_RESERVE_S = 0.001


def kept_after_master(config: KvrouteConfig, *, later_sources: bool) -> float:
    """Seconds of the request's budget the master's window leaves for the sources after it: never
    less than the domain's reserve, so a window kept for KVCM too ends before the request's scope."""
    if not later_sources:
        return DOMAIN_RESERVE_S
    return max(config.master.later_sources_ms / 1000.0, DOMAIN_RESERVE_S)


def routed_pick(addrs: Sequence[RoleAddr], roles: Collection[Role]) -> RoleAddr | None:
    """The request's worker in a routed answer: the first address of a role it routes. A
    prefill/decode cluster answers [DECODE, PREFILL]; ``roles`` are the request's prefill-capable
    ones, so the companions' addresses ride along."""
    return next((a for a in addrs if a.role in roles), None)


@dataclass(frozen=True, slots=True)
class MasterClientHealth:
    """What /debug/actors shows of the master client: discovery, breaker, last error."""

    discovery: MasterDiscoverySnapshot
    breaker: BreakerSnapshot
    last_error: str | None
    requests: int
    routed: int
    fell_through: int
    ended: int
    reports_dropped: int  # attempts whose report the full inbox refused (not counted above)
    inbox_depth: int
    inbox_capacity: int


class _Verdict(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"
    NOT_JUDGED = "not_judged"  # a trial slot released, nothing judged
    NOT_ASKED = "not_asked"  # the master was not called (no master, queue full, breaker open)


@dataclass(frozen=True, slots=True)
class _Attempted:
    """One request's attempt, reported when it ends: sent when it asked the master, kept aside
    when it was the breaker's trial, only counted when the master was not asked."""

    verdict: _Verdict
    trial: bool
    result: SourceResult | None  # None: the request was cancelled
    error: str | None  # the master's transport failure, for last_error
    called_at: float  # when the schedule call went out (-inf: it did not)
    # A trial granted to a caller already gone, given back: no request of its own (its caller reports).
    released: bool = False
    took_s: float | None = None  # answered: how long the master took
    cut_short: bool = False  # not judged: the request's budget cut the call short of an answer


class _AskTrial(Ask[Admission]):
    """May this request be the breaker's trial? (request/reply)"""


class _TrialEnded:
    """A wake-up: a trial's report waits in ``MasterSource._trial_reports`` (never dropped)."""


_TRIAL_ENDED = _TrialEnded()


class _Outcome:
    """What one attempt found out for the breaker, filled in as it goes (local to the request)."""

    __slots__ = ("called_at", "cut_short", "error", "took_s", "trial", "verdict")

    def __init__(self) -> None:
        self.verdict: _Verdict | None = None
        self.trial = False
        self.error: str | None = None
        self.called_at = -math.inf
        self.took_s: float | None = None  # answered: how long the master took
        self.cut_short = False  # not judged: the request's budget cut the call short of an answer


class MasterSource:
    kind = RouteSource.MASTER

    def __init__(
        self,
        config: KvrouteConfig,
        *,
        discovery: MasterDiscovery,
        transport: MasterTransport,
        domain: DomainSource,
        metrics: MetricsSink,
        later_sources: bool,
    ) -> None:
        # What the scheduler is sent does not depend on the KVCM switch: the caller's keys when it gave
        # keys; else over HTTP the token ids (the scheduler hashes them in its own family), and over
        # gRPC, which carries no token ids, the keys this router hashes.
        self.needs_keys = config.master.protocol is MasterProtocol.GRPC
        self._timeout_s = config.master.transport_timeout_ms / 1000.0
        self._slave_share = config.master.slave_window_share
        self._later_s = kept_after_master(config, later_sources=later_sources)
        self._slow_s = config.master_breaker.slow_query_ms / 1000.0
        self._queue_threshold = config.master.queue_length_reject_threshold
        self._discovery = discovery
        self._transport = transport
        self._domain = domain
        self._metrics = metrics
        # Owned by run():
        self._breaker = KvcmBreaker(config.master_breaker, section="master_breaker")
        # How long the master's answers took: written here, read by the requests judging a cut attempt.
        self._answered = AnsweredWithin()
        self._last_error: str | None = None
        self._requests = self._routed = self._fell_through = self._ended = 0
        self._view: BreakerView = self._breaker.view()
        self._view_changes = self._breaker.changes
        # An attempt report per request that asked the master, and a trial ask at most.
        self._inbox_size = 2 * config.router.max_in_flight
        self._send, self._receive = trio.open_memory_channel[_Attempted | _AskTrial | _TrialEnded](self._inbox_size)
        self._reports_dropped = 0  # kept by callers (a count only)
        self._view_rejections = 0  # admissions the published view refused, without a hop (callers' count)
        # A trial's report, kept out of the droppable inbox: lost, it would leave the breaker half-open
        # until the trial timed out, then reopen it though the master answered. One trial at a time.
        self._trial_reports: list[_Attempted] = []
        # Requests that never asked the master (its queue full, none known, the breaker refusing, no
        # time): counted by the callers, not sent (a burst of them filled the inbox). (Callers' counts.)
        self._unasked_fell_through = self._unasked_ended = 0

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline  # the attempt's own window is set inside, so a timeout is judged here

    def health(self) -> MasterClientHealth:
        """A copy of the task's state for /debug/actors (never the request path)."""
        return MasterClientHealth(
            discovery=self._discovery.snapshot(),
            breaker=self._breaker_snapshot(),
            last_error=self._last_error,
            requests=self._requests + self._unasked_fell_through + self._unasked_ended,
            routed=self._routed,
            fell_through=self._fell_through + self._unasked_fell_through,
            ended=self._ended + self._unasked_ended,
            reports_dropped=self._reports_dropped,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._inbox_size,
        )

    def _breaker_snapshot(self) -> BreakerSnapshot:
        breaker = self._breaker.snapshot(trio.current_time())
        return replace(breaker, rejected_total=breaker.rejected_total + self._view_rejections)

    def breaker_state(self) -> BreakerState:
        """The state the task last published."""
        return self._view.state

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the breaker, last error and counters: apply the inbox a batch at a time, then publish
        the breaker's view."""
        task_status.started()
        receive = self._receive
        try:
            while True:
                # Before each batch (the first too: a crashed task's, its wake-up taken by the batch that
                # crashed, waited for a message the half-open view kept from coming) and after it (its
                # wake-up may have found the inbox full, and then the batch that emptied it came first).
                while self._trial_reports:
                    self._apply_trial(self._trial_reports.pop())
                self._publish_view()
                message = await receive.receive()
                while True:
                    if isinstance(message, _AskTrial):
                        if not message.abandoned:
                            message.answer(self._breaker.admit(trio.current_time()))
                    elif isinstance(message, _Attempted):
                        self._apply(message)
                    try:
                        message = receive.receive_nowait()
                    except trio.WouldBlock:
                        break
        finally:
            self._publish_view()  # a crash in the middle of a batch: what it applied, published at once

    def _publish_view(self) -> None:
        if self._breaker.changes != self._view_changes:
            self._view_changes = self._breaker.changes
            self._view = self._breaker.view()

    def _apply_trial(self, attempted: _Attempted) -> None:
        try:
            self._apply(attempted)
        except BaseException:
            # Its verdict is lost with the crash (applied again, it would crash the restarted task too):
            # the slot is freed at least, not held half-open until the trial times out and then reopened.
            self._breaker.release_trial()
            raise

    def _apply(self, attempted: _Attempted) -> None:
        now = trio.current_time()
        verdict = attempted.verdict
        if verdict is _Verdict.SUCCESS:
            self._breaker.record_success(now, attempted.trial)
            if attempted.took_s is not None:
                self._answered.observe(attempted.took_s)
        elif verdict is _Verdict.FAILURE:
            self._breaker.record_failure(now, attempted.trial, started_at=attempted.called_at)
        elif verdict is _Verdict.NOT_JUDGED and attempted.trial:
            self._breaker.release_trial()
        if attempted.cut_short:
            self._answered.pass_over()
        if attempted.released:
            return
        if attempted.error is not None:
            self._last_error = attempted.error
        self._requests += 1
        result = attempted.result
        if isinstance(result, Answered):
            self._routed += 1
        elif isinstance(result, FellThrough):
            self._fell_through += 1
        elif isinstance(result, Ended):
            self._ended += 1

    def _report(self, attempted: _Attempted) -> None:
        if attempted.trial:
            self._trial_reports.append(attempted)
            with contextlib.suppress(trio.WouldBlock):  # a full inbox wakes the task anyway
                self._send.send_nowait(_TRIAL_ENDED)
            return
        if attempted.verdict is _Verdict.NOT_ASKED and attempted.error is None:
            if isinstance(attempted.result, Ended):
                self._unasked_ended += 1
                return
            if isinstance(attempted.result, FellThrough):
                self._unasked_fell_through += 1
                return
        try:
            self._send.send_nowait(attempted)
        except trio.WouldBlock:
            self._reports_dropped += 1

    async def _admit(self, until: float) -> Admission:
        """The breaker's admission: from the view, or (a trial may be due) from the task, waiting at
        most until ``until`` (then REJECT, so the later sources keep their time)."""
        admission = self._view.admits(trio.current_time())
        if admission is not None:
            if admission is Admission.REJECT:
                self._view_rejections += 1
            return admission
        with trio.move_on_at(until):
            return await ask(self._send, _AskTrial(), self._release_unclaimed)
        return Admission.REJECT

    def _release_unclaimed(self, admission: Admission) -> None:
        if admission is Admission.TRIAL:
            self._report(_Attempted(_Verdict.NOT_JUDGED, True, None, None, -math.inf, released=True))

    def queue_length(self) -> int:
        """The master's last reported queue length, -1 when unknown."""
        known = self._discovery.snapshot().queue_length
        return -1 if known is None else known

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        return None

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        started = trio.current_time()
        outcome = _Outcome()
        try:
            result = await self._attempt(ctx, outcome)
        except BaseException:  # cancelled: a trial that never got its verdict frees its slot
            verdict = outcome.verdict or _Verdict.NOT_JUDGED
            self._report(_Attempted(verdict, outcome.trial, None, outcome.error, outcome.called_at))
            raise
        self._report(
            _Attempted(
                outcome.verdict or _Verdict.NOT_ASKED,
                outcome.trial,
                result,
                outcome.error,
                outcome.called_at,
                took_s=outcome.took_s,
                cut_short=outcome.cut_short,
            )
        )
        if ctx.record is not None:
            ctx.record.master = recorded_answer(ctx.record, started, trio.current_time(), result)
        return result

    async def _attempt(self, ctx: RequestContext, outcome: _Outcome) -> SourceResult:
        known = self._discovery.snapshot()
        if self._queue_threshold > 0 and known.queue_length is not None and known.queue_length > self._queue_threshold:
            self._metrics.emit(MasterRequest("queue_full"))
            return Ended(
                Reason.MASTER_QUEUE_FULL,
                f"the master's queue ({known.queue_length}) is over {self._queue_threshold}",
                _QUEUE_FULL_CODE,
            )
        if known.master is None:
            self._metrics.emit(MasterRequest("no_master"))  # counted, not logged: discovery reports why
            return FellThrough(Reason.NO_MASTER)
        admission = await self._admit(ctx.deadline - self._later_s)
        if admission is Admission.REJECT:
            self._metrics.emit(MasterRequest("breaker_open"))
            return FellThrough(Reason.MASTER_BREAKER_OPEN)
        outcome.trial = admission is Admission.TRIAL
        now = trio.current_time()
        by_budget = ctx.deadline - self._later_s
        end = min(now + self._timeout_s, by_budget)
        if end <= now:
            # Not called: a trial's slot is released (judged nothing); another request is only counted.
            outcome.verdict = _Verdict.NOT_JUDGED if outcome.trial else _Verdict.NOT_ASKED
            self._metrics.emit(MasterRequest("no_time"))
            return FellThrough(Reason.DEADLINE)
        hosts = [known.master] + ([known.slave] if known.slave not in (None, known.master) else [])
        outcome.called_at = now
        # Once for both hosts: the receipt's wall clock is the request's, whenever each call starts.
        received_wall_s = time.time() - (now - ctx.received_at)
        # The master's call leaves the slave its share of the window, unless a part would be shorter
        # than a slow answer: a healthy pair answering in that time would both be cut and judged failed.
        slave_s = (end - now) * self._slave_share
        if min(slave_s, end - now - slave_s) < self._slow_s:
            slave_s = 0.0
        reply: MasterReply | None = None
        error: TransportError | None = None
        queue_timeout: TransportError | None = None
        calling = hosts[0]  # the host whose call the window's end cuts, if it does
        with trio.move_on_at(end):
            for i, host in enumerate(hosts):  # the slave once, inside the same window, after a transport failure
                calling = host
                host_end = end if i == len(hosts) - 1 else end - slave_s
                queue_timeout = None  # an 8503 stands for the window's end only as the last call's answer
                try:
                    with trio.move_on_at(host_end) as call:
                        request = self._request(ctx, received_wall_s, host_end)
                        reply = await self._transport.schedule(host, request)
                    if isinstance(reply, MasterBusinessError) and reply.code == CODE_QUEUE_TIMEOUT:
                        reply = None
                        error = queue_timeout = DeadlineExceeded(
                            host, f"QUEUE_TIMEOUT ({CODE_QUEUE_TIMEOUT}): queued until the window's end, not routed"
                        )
                        self._metrics.emit(MasterRequest("queue_timeout"))
                        continue
                    if not call.cancelled_caught:
                        break
                    error = DeadlineExceeded(host, "no schedule reply within its share of the window")
                except TransportError as exc:
                    error = exc
                self._metrics.emit(MasterRequest(error.kind))
        finished = trio.current_time()
        if reply is None:
            queued = error is not None and error is queue_timeout  # the window ended as the 8503 came
            if error is None or (finished >= end and not queued):
                error = DeadlineExceeded(calling, "no schedule reply within the master's window")
                self._metrics.emit(MasterRequest(error.kind))
            outcome.error = f"{error.target}: {error.kind}: {error.detail}"
            if (finished >= end or queued) and end == by_budget and self._answered.spares(end - now, self._slow_s):
                # The request's own budget cut the attempt short of what the master's answers take (or of
                # slow_query_ms): it says nothing of the master.
                outcome.verdict = _Verdict.NOT_JUDGED
                outcome.cut_short = True
            else:
                outcome.verdict = _Verdict.FAILURE
            return FellThrough(Reason.MASTER_UNAVAILABLE)
        outcome.verdict = _Verdict.SUCCESS
        outcome.took_s = finished - now
        return self._outcome(reply, ctx)

    def _outcome(self, reply: MasterReply, ctx: RequestContext) -> SourceResult:
        if isinstance(reply, MasterRouted):
            self._metrics.emit(MasterRequest("routed"))
            return self._routed_answer(reply, ctx)
        if isinstance(reply, MasterFallback) and reply.http_status != _HTTP_OK:
            self._metrics.emit(MasterRequest("fallback"))
            return FellThrough(Reason.MASTER_FALLBACK, to_last=True)
        # A business error (and 8600 inside a 200, which the reference frontend does not treat as a
        # fallback): the request fails with the scheduler's code, and no cache source is asked.
        code = reply.code
        message = reply.message if isinstance(reply, MasterBusinessError) else reply.message or "FALLBACK"
        self._metrics.emit(MasterRequest("business_error"))
        return Ended(Reason.MASTER_ERROR, f"the master answered code {code}: {message}", code)

    def _routed_answer(self, reply: MasterRouted, ctx: RequestContext) -> SourceResult:
        addrs = reply.role_addrs
        pick = routed_pick(addrs, ctx.prepared.roles)
        if pick is None:  # the master named no worker of a role this deployment routes: fill it as domain does
            filled = self._domain.pick(ctx.prepared, Reason.MASTER)
            if not isinstance(filled, Answered):
                return filled
            pick = RoleAddr(filled.role, filled.worker.ip, filled.worker.http_port, filled.worker.grpc_port)
            addrs = (*addrs, pick)
        worker = WorkerAddr(pick.ip, pick.http_port, pick.grpc_port, pick.grpc_port)
        return Answered(worker=worker, role=pick.role, reason=Reason.MASTER, role_addrs=addrs)

    def _request(self, ctx: RequestContext, received_wall_s: float, end: float) -> MasterScheduleRequest:
        """``received_wall_s``: the wall clock (epoch s) at the request's receipt, which the wire wants
        (an attempt takes it as its start's wall clock less the request's age on the trio clock)."""
        request, prepared = ctx.request, ctx.prepared
        # The caller's keys, as given (check_request keeps them); keys hashed from token ids if wanted.
        keys = prepared.keys if request.block_cache_keys is not None or self.needs_keys else ()
        return MasterScheduleRequest(
            request_id=request.request_id,
            block_cache_keys=keys,
            block_size=prepared.block_size if keys else None,
            seq_len=prepared.seq_len,
            input_ids=None if keys else request.token_ids,
            # Counted from the receipt, as request_time_ms is; a scheduler counting from its own receipt
            # of the call overshoots by the hop, and the window's end cancels the call. (Float noise
            # is not a ms.)
            generate_timeout_ms=max(1, math.ceil(round((end - ctx.received_at) * 1000.0, 6))),
            request_time_ms=int(received_wall_s * 1000),
        )
