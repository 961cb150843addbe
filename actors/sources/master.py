"""The master source: ask the central scheduler first; when it cannot answer, fall through at once.

The master and slave come from :class:`MasterDiscovery`'s snapshot (never waited for). One window
bounds the attempt: ``min(transport timeout, time left − the time kept for the later sources)``,
so a master that accepts the connection and never answers still leaves KVCM its time. Inside the
window a transport failure of the master tries the slave once. Outcomes:

- routed: the scheduler's role addresses, as given; KVCM is not asked;
- 8600 (not in a 200 reply): domain routing, the cache sources skipped;
- any other code: the request ends with that code and message (the frontend fails it);
- no master known, the breaker open, no usable reply: fall through to the next source.

Consecutive transport failures open the master's breaker (the KVCM breaker's state machine), so
a hanging master costs at most the window for at most the breaker's threshold of requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import trio

from actors.breaker import Admission, BreakerSnapshot, BreakerState, KvcmBreaker
from actors.master_discovery import MasterDiscovery, MasterDiscoverySnapshot
from actors.metrics_sink import MasterRequest, MetricsSink
from actors.sources.base import Answered, Ended, FellThrough, RequestContext, SourceResult, recorded_answer
from actors.sources.domain import DomainSource
from router.config import KvrouteConfig
from router.transport.errors import DeadlineExceeded, TransportError
from router.transport.ports import MasterTransport
from router.types import Reason, RoleAddr, RouteDecision, RouteSource, WorkerAddr
from router.wire.master import MasterBusinessError, MasterFallback, MasterReply, MasterRouted, MasterScheduleRequest

_HTTP_OK = 200
_QUEUE_FULL_CODE = 429


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


class MasterSource:
    kind = RouteSource.MASTER
    needs_keys = False

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
        self._roles = config.deployment.roles
        self._timeout_s = config.master.transport_timeout_ms / 1000.0
        self._later_s = config.master.later_sources_ms / 1000.0 if later_sources else 0.0
        self._slow_s = config.master_breaker.slow_query_ms / 1000.0
        self._queue_threshold = config.master.queue_length_reject_threshold
        self._discovery = discovery
        self._transport = transport
        self._domain = domain
        self._metrics = metrics
        self.breaker = KvcmBreaker(config.master_breaker)
        self._last_error: str | None = None
        self._requests = self._routed = self._fell_through = self._ended = 0

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline  # the attempt's own window is set inside, so a timeout is judged here

    def health(self) -> MasterClientHealth:
        return MasterClientHealth(
            discovery=self._discovery.snapshot(),
            breaker=self.breaker.snapshot(trio.current_time()),
            last_error=self._last_error,
            requests=self._requests,
            routed=self._routed,
            fell_through=self._fell_through,
            ended=self._ended,
        )

    def breaker_state(self) -> BreakerState:
        return self.breaker.state

    def queue_length(self) -> int:
        """The master's last reported queue length, -1 when unknown."""
        known = self._discovery.snapshot().queue_length
        return -1 if known is None else known

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        return None

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        self._requests += 1
        started = trio.current_time()
        result = await self._attempt(ctx)
        if ctx.record is not None:
            ctx.record.master = recorded_answer(ctx.record, started, trio.current_time(), result)
        if isinstance(result, Answered):
            self._routed += 1
        elif isinstance(result, FellThrough):
            self._fell_through += 1
        else:
            self._ended += 1
        return result

    async def _attempt(self, ctx: RequestContext) -> SourceResult:
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
        now = trio.current_time()
        admission = self.breaker.admit(now)
        if admission is Admission.REJECT:
            self._metrics.emit(MasterRequest("breaker_open"))
            return FellThrough(Reason.MASTER_BREAKER_OPEN)
        trial = admission is Admission.TRIAL
        by_budget = ctx.deadline - self._later_s
        end = min(now + self._timeout_s, by_budget)
        if end <= now:
            if trial:
                self.breaker.release_trial()
            self._metrics.emit(MasterRequest("no_time"))
            return FellThrough(Reason.DEADLINE)
        hosts = [known.master] + ([known.slave] if known.slave not in (None, known.master) else [])
        request = self._request(ctx)
        reply: MasterReply | None = None
        error: TransportError | None = None
        with trio.move_on_at(end):
            for host in hosts:  # the slave once, inside the same window, after a transport failure
                try:
                    reply = await self._transport.schedule(host, request)
                    break
                except TransportError as exc:
                    error = exc
                    self._metrics.emit(MasterRequest(exc.kind))
        finished = trio.current_time()
        if reply is None:
            if error is None or finished >= end:
                error = DeadlineExceeded(hosts[-1], "no schedule reply within the master's window")
                self._metrics.emit(MasterRequest(error.kind))
            self._last_error = f"{error.target}: {error}"
            if finished >= end and end == by_budget and end - now < self._slow_s:
                if trial:  # the request's own budget cut the attempt short: it says nothing of the master
                    self.breaker.release_trial()
            else:
                self.breaker.record_failure(finished, trial)
            return FellThrough(Reason.MASTER_UNAVAILABLE)
        self.breaker.record_success(finished, trial)
        return self._outcome(reply)

    def _outcome(self, reply: MasterReply) -> SourceResult:
        if isinstance(reply, MasterRouted):
            self._metrics.emit(MasterRequest("routed"))
            return self._routed_answer(reply)
        if isinstance(reply, MasterFallback) and reply.http_status != _HTTP_OK:
            self._metrics.emit(MasterRequest("fallback"))
            return FellThrough(Reason.MASTER_FALLBACK, to_last=True)
        # A business error (and 8600 inside a 200, which the reference frontend does not treat as a
        # fallback): the request fails with the scheduler's code, and no cache source is asked.
        code = reply.code
        message = reply.message if isinstance(reply, MasterBusinessError) else reply.message or "FALLBACK"
        self._metrics.emit(MasterRequest("business_error"))
        return Ended(Reason.MASTER_ERROR, f"the master answered code {code}: {message}", code)

    def _routed_answer(self, reply: MasterRouted) -> SourceResult:
        addrs = reply.role_addrs
        pick = next((a for a in addrs if a.role in self._roles), None)
        if pick is None:  # the master named no worker of a role this deployment routes: fill it as domain does
            filled = self._domain.pick(None, Reason.MASTER)
            if not isinstance(filled, Answered):
                return filled
            pick = RoleAddr(filled.role, filled.worker.ip, filled.worker.http_port, filled.worker.grpc_port)
            addrs = (*addrs, pick)
        worker = WorkerAddr(pick.ip, pick.http_port, pick.grpc_port, pick.grpc_port)
        return Answered(worker=worker, role=pick.role, reason=Reason.MASTER, role_addrs=addrs)

    @staticmethod
    def _request(ctx: RequestContext) -> MasterScheduleRequest:
        request, prepared = ctx.request, ctx.prepared
        keys = prepared.keys or tuple(request.block_cache_keys or ())
        return MasterScheduleRequest(
            request_id=request.request_id,
            block_cache_keys=keys,
            block_size=prepared.block_size if keys else None,
            seq_len=prepared.seq_len,
            input_ids=None if keys else request.token_ids,
            request_time_ms=int(time.time() * 1000),  # the wire wants wall-clock epoch ms
        )
