"""HitAccuracy: the router's predicted cache hit against the one the engine reports.

Every decision with a worker predicts a hit (``hit_tokens``). The worker's status, when it next
arrives, lists its tasks with their ``request_id`` and ``prefix_length`` (the prefix it found
cached). This actor keeps the recent predictions (bounded, with a TTL), and when a status lists a
predicted request on the predicted worker it emits the comparison to the MetricsSink:
actual/predicted, the error in tokens, and "silent zero overlap" (nothing found where a hit was
predicted: a key family, block size or KVCM namespace that does not match the engine's).

Messages arrive through one bounded inbox (``send_nowait``; dropped and counted when full): the
router's predictions and the prober's statuses. The state is owned by ``run``; ``health`` reads an
immutable snapshot it publishes. A prediction expires ``accuracy_ttl_s`` after it was made, woken by an
alarm of ``run``'s own (a child task posting into the inbox): a status arriving later is not compared
with it, and with no traffic at all the snapshot still shows it expired.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

import trio

from actors.inbox import Alarm
from actors.metrics_sink import HitObserved, MetricsSink
from router.config import MetricsConfig
from router.slot_init import slot_init
from router.types import RouteSource, WorkerStatus

_RECENT_PER_WORKER = 32  # comparisons kept per worker for its recent accuracy
_WINDOW = 200  # recent comparisons the silent-zero share is taken over
WARNING_MIN_COMPARISONS = 20  # comparisons needed before the share can raise a warning
_WORKERS_SHOWN = 64  # workers in the health snapshot (the most recently compared)


@slot_init
@dataclass(frozen=True, slots=True)
class _Predicted:
    request_id: str
    worker: str  # http target
    tokens: int
    source: RouteSource
    at: float


# A prediction waiting for a status that lists its request: (worker, tokens, route source label, at).
# A plain tuple of strings and numbers, which the collector stops tracking at its first collection:
# where no engine lists request ids, every decision's waits out the TTL (tens of thousands at a few
# hundred decisions a second), and each kept as an object would be walked by every full collection.
_Pending = tuple[str, int, str, float]


@dataclass(frozen=True, slots=True)
class _StatusSeen:
    worker: str
    status: WorkerStatus


@dataclass(frozen=True, slots=True)
class _Expire:
    """The expiry alarm's wake-up: the oldest prediction's TTL has passed."""


_EXPIRE = _Expire()


@dataclass(frozen=True, slots=True)
class AccuracyHealth:
    pending: int  # predictions waiting for a status that lists their request
    matched: int
    silent_zero: int
    expired: int  # predictions no status listed within the TTL
    evicted: int  # predictions pushed out by the pending bound (--metrics-accuracy-pending-max) first
    dropped: int  # messages the full inbox refused
    inbox_depth: int
    inbox_capacity: int
    recent_by_worker: dict[str, float] = field(default_factory=dict)  # mean actual/predicted, recent
    silent_zero_share: float = 0.0  # over the last comparisons (at most 200)
    warning: str | None = None  # set while the share is above --metrics-accuracy-warn-silent-share


class HitAccuracy:
    def __init__(self, config: MetricsConfig, metrics: MetricsSink) -> None:
        self._max_pending = config.accuracy_pending_max
        self._warn_share = config.accuracy_warn_silent_share
        self._window: deque[bool] = deque(maxlen=_WINDOW)  # recent comparisons: silent zero or not
        self._ttl_s = config.accuracy_ttl_s
        self._metrics = metrics
        self._inbox_size = config.accuracy_inbox_size
        self._send, self._receive = trio.open_memory_channel[_Predicted | _StatusSeen | _Expire](self._inbox_size)
        self._pending: OrderedDict[str, _Pending] = OrderedDict()  # by request id, oldest first
        self._recent: OrderedDict[str, deque[float]] = OrderedDict()  # by worker, least recently compared first
        self._matched = 0
        self._silent_zero = 0
        self._expired = 0
        self._evicted = 0
        self._dropped = 0
        # Predictions sent and not yet applied: a send to a waiting owner hands the message over
        # without buffering it, so the inbox's buffer alone does not show them.
        self._predictions_sent = 0
        self._predictions_applied = 0
        self._health = self._snapshot()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply predictions and statuses as they arrive, and drop each prediction as its TTL passes,
        until cancelled. The expiry is an alarm that posts into the inbox, not a cancel scope around
        each receive: an exited scope's entry stays in trio's deadline heap, holding the scope, until
        its deadline (the TTL away) comes to the top or the heap is pruned, and with a batch for every
        decision that was one scope kept for each."""
        async with trio.open_nursery() as nursery:
            alarm = Alarm(self._send, _EXPIRE)
            await nursery.start(alarm.run)
            if self._pending:  # a restart's: set below only on a change, none might come
                alarm.set(self._next_expiry())
            task_status.started()
            async for message in self._receive:
                was_empty = not self._pending
                rung = False
                self._expire(trio.current_time())  # first: a status arriving after the TTL is not compared
                while True:  # what else is queued, then one snapshot for the batch (it walks the window)
                    if isinstance(message, _Expire):
                        rung = True
                    else:
                        self._apply(message)
                    try:
                        message = self._receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                # The oldest prediction's expiry gets earlier only from none to one; a later one (its
                # prediction matched, evicted or made again) rings early, finds nothing due, and is set
                # again here.
                if rung or (was_empty and self._pending):
                    alarm.set(self._next_expiry())
                self._health = self._snapshot()
            nursery.cancel_scope.cancel()

    def _next_expiry(self) -> float:
        """When the oldest pending prediction expires (never, with none pending)."""
        for *_, made_at in self._pending.values():
            return made_at + self._ttl_s
        return math.inf

    def _expire(self, now: float) -> None:
        """Forget the predictions made the TTL or more before ``now`` (the oldest are first): the same
        instant as ``_next_expiry``, or the timer would fire again at once."""
        while self._pending:
            *_, made_at = next(iter(self._pending.values()))
            if made_at + self._ttl_s > now:
                break
            self._pending.popitem(last=False)
            self._expired += 1

    def _apply(self, message: _Predicted | _StatusSeen) -> None:
        if isinstance(message, _Predicted):
            self._predictions_applied += 1
            self._predicted(message)
        else:
            self._status_seen(message.worker, message.status)

    def predict(self, request_id: str, worker: str, tokens: int, source: RouteSource, now: float) -> None:
        """A decision predicted ``tokens`` cached tokens on ``worker``; never blocks."""
        if self._offer(_Predicted(request_id, worker, tokens, source, now)):
            self._predictions_sent += 1

    def status_seen(self, worker: str, status: WorkerStatus) -> None:
        """A worker's new status (the prober's listener); never blocks."""
        # Read from the published snapshot (this runs in the prober's task), and sent too while a
        # prediction is on its way to the owner: a status may be what it waits for.
        if self._health.pending or self._predictions_sent != self._predictions_applied:
            self._offer(_StatusSeen(worker, status))

    def health(self) -> AccuracyHealth:
        """The snapshot the task last published, with what the senders count and the inbox as it is now."""
        return replace(self._health, dropped=self._dropped, inbox_depth=self._receive.statistics().current_buffer_used)

    def _offer(self, message: _Predicted | _StatusSeen) -> bool:
        try:
            self._send.send_nowait(message)
        except trio.WouldBlock:
            self._dropped += 1
            return False
        return True

    def _predicted(self, message: _Predicted) -> None:
        self._pending.pop(message.request_id, None)
        self._pending[message.request_id] = (message.worker, message.tokens, message.source.value, message.at)
        while len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)
            self._evicted += 1

    def _status_seen(self, worker: str, status: WorkerStatus) -> None:
        # The finished tasks too: a prefill that began and ended between two polls is only there.
        for task in (*status.waiting, *status.running, *status.finished):
            predicted = self._pending.get(task.request_id)
            if predicted is None:
                continue
            predicted_worker, tokens, source, _ = predicted
            if predicted_worker != worker:
                continue
            if task.is_waiting and not task.prefix_length_valid:
                continue  # queued, its prefix not matched yet: a later status reports it
            del self._pending[task.request_id]
            actual = min(task.prefix_length, task.input_length)
            self._matched += 1
            silent = actual == 0
            self._silent_zero += silent
            self._window.append(silent)
            self._metrics.emit(HitObserved(source, tokens, actual))
            recent = self._recent.pop(worker, None) or deque(maxlen=_RECENT_PER_WORKER)
            recent.append(actual / tokens)
            self._recent[worker] = recent
            while len(self._recent) > _WORKERS_SHOWN:
                self._recent.popitem(last=False)

    def _snapshot(self) -> AccuracyHealth:
        share = sum(self._window) / len(self._window) if self._window else 0.0
        warning = None
        if self._warn_share > 0 and len(self._window) >= WARNING_MIN_COMPARISONS and share > self._warn_share:
            warning = (
                f"{share:.0%} of the last {len(self._window)} routed requests found no cached prefix where one was "
                "predicted: check the key family, block size and KVCM namespace against the engines'"
            )
        return AccuracyHealth(
            pending=len(self._pending),
            matched=self._matched,
            silent_zero=self._silent_zero,
            expired=self._expired,
            evicted=self._evicted,
            dropped=self._dropped,
            inbox_depth=self._receive.statistics().current_buffer_used,
            inbox_capacity=self._inbox_size,
            recent_by_worker={w: round(sum(r) / len(r), 3) for w, r in self._recent.items() if r},
            silent_zero_share=share,
            warning=warning,
        )
