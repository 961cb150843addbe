"""MetricsSink actor: telemetry events in, a Prometheus registry and a ring of recent decisions out.

Producers call :meth:`MetricsSink.emit` — synchronous, never waits: ``send_nowait`` on a bounded
inbox; when it is full the event is dropped and counted (``kvroute_metrics_events_dropped_total``).
:meth:`MetricsSink.run` is the only task that applies events to the counters, histograms and the
decision ring, so that state has one owner.

Gauges that mirror another actor's state (probes in flight, ejected workers, pool size, breaker
state, inbox depths) are not pushed: the owner registers a snapshot callable with
:meth:`MetricsSink.register_gauge_source` and it is read at scrape time.

The registry is the sink's own ``CollectorRegistry``, never prometheus_client's global one, so two
routers in one process (tests, the demo) do not share counters.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import assert_never

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors.metric_families import OwnedCounter, OwnedFamilies, OwnedHistogram
from router.config import MetricsConfig, RouterConfig
from router.decision_pack import pack_decision, unpack_decision
from router.policy.deadline_split import SplitEstimates, SplitEstimator
from router.problems import Problem, range_problems, refuse
from router.slot_init import slot_init
from router.types import RouteDecision, RouteSource, Stage, cut_text

logger = logging.getLogger(__name__)

# Sub-millisecond stages to the default 50 ms cap, and on to the largest cap a setting allows (600 s):
# beyond the top bucket every quantile reads as that bucket.
DURATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 600.0
)

# Gauges read at scrape time from registered sources: name → (help, label names).
SOURCE_GAUGES: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "kvroute_kvcm_breaker_state": ("KVCM circuit breaker state: 0 closed, 1 half-open, 2 open", ()),
    "kvroute_master_breaker_state": ("Master circuit breaker state: 0 closed, 1 half-open, 2 open", ()),
    "kvroute_master_queue_length": ("The master's last reported queue length (-1: unknown)", ()),
    "kvroute_probe_inflight": ("Worker-status probes in flight", ()),
    "kvroute_workers_ejected": ("Workers currently ejected by outlier detection", ()),
    "kvroute_channel_pool_channels": ("gRPC channels held by the channel pool", ()),
    "kvroute_inbox_depth": ("Messages waiting in an actor's inbox", ("actor",)),
    "kvroute_sidecar_calls_in_flight": ("Route calls the gRPC sidecar is handling", ()),
    "kvroute_ready": ("1 while the router can route (its /readyz and gRPC health), else 0", ()),
    "kvroute_shadow_agreement_ratio": (
        "Mean agreement of the shadow index with KVCM over the last comparisons",
        (),
    ),
}
# Counters kept by a way in on its own threads, read at scrape time (their names without _total).
SOURCE_COUNTERS: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "kvroute_sidecar_calls": (
        "Route calls the gRPC sidecar ended, by how (answered and client_gone include shed_at_receipt)",
        ("outcome",),
    ),
}
REPLY_STAGE_LABEL = "reply"  # the duration histogram's stage label for a transport's way back (RepliesSent)
DRAIN_BATCH = 32  # events applied per scheduling round at most (about 1 ms of work)
BREAKER_STATE_VALUES: Mapping[str, float] = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


# --- events (small frozen values; producers build them, only run() reads them) -------------------


@slot_init
@dataclass(frozen=True, slots=True)
class DecisionMade:
    """A routing decision: counted by route_source/reason, its stage_ms and elapsed_ms observed, and
    the decision kept in the ring (cut to bounded size: see :func:`retained_decision`). Its
    candidates' ``dropped`` reasons are not counted here: the sources count their drops with
    :class:`CandidatesDropped` events (a decision's candidates are only those it explains).
    ``events``: what the request's sources observed on its way (KVCM outcome, status cache hits,
    dropped candidates, ...), applied with it: one inbox message per decision instead of one per
    observation."""

    decision: RouteDecision
    events: tuple[MetricEvent, ...] = ()


@slot_init
@dataclass(frozen=True, slots=True)
class KvcmRequest:
    method: str  # "GetClusterInfo" | "GetHostCacheState"
    outcome: str  # "ok", "not_leader", "unavailable", "deadline", "garbled", "remote_error", "no_leader", ...


@dataclass(frozen=True, slots=True)
class CandidatesDropped:
    """Candidates dropped before they could be planned (they never appear in a decision's candidates):
    ``n`` of them, for ``reason`` (a DropReason value)."""

    reason: str
    n: int


@dataclass(frozen=True, slots=True)
class ProbeSkipped:
    reason: str  # e.g. "deadline", "ejected", "budget"
    n: int = 1


@slot_init
@dataclass(frozen=True, slots=True)
class StatusLookups:
    """One request's candidate statuses: answered fresh from the cache (``from_background`` of
    them kept fresh by background polls), and ``probed``: those without a fresh status, which the
    request asked the prober to probe."""

    cache_hits: int = 1
    from_background: int = 0
    probed: int = 0


@dataclass(frozen=True, slots=True)
class BackgroundProbes:
    """Probes the prober started on its own: ``kind`` "refresh" (hot workers) or "health"."""

    kind: str
    n: int = 1


@dataclass(frozen=True, slots=True)
class ShadowRecordDropped:
    """A decision's record did not fit in the shadow index's inbox (the index misses it)."""


@dataclass(frozen=True, slots=True)
class MasterRequest:
    """One step of the master source: routed, fallback, business_error, queue_timeout, no_master,
    breaker_open, no_time, queue_full, or a transport error kind (unavailable, deadline, garbled,
    remote_error)."""

    outcome: str


@dataclass(frozen=True, slots=True)
class HitObserved:
    """A decision's predicted hit (tokens) against the prefix its worker reported for the request."""

    route_source: str
    predicted: int
    actual: int


@dataclass(frozen=True, slots=True)
class LeaderChanged:
    """The leader resolver found a leader other than the last one it found (the first one counts)."""

    target: str


@dataclass(frozen=True, slots=True)
class ChannelEvicted:
    reason: str  # "lru" | "idle" | "invalidated" | "shutdown"
    n: int = 1


@slot_init
@dataclass(frozen=True, slots=True)
class ShadowAgreement:
    """One shadow-vs-KVCM comparison: top-holder agreement (1.0 full, 0.0 none), and the shadow's
    predicted hit against KVCM's reported one, in tokens."""

    ratio: float
    hit_error_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RepliesSent:
    """Replies a transport took from the router and handed on: each one's way back in seconds, from the
    decision leaving the router to the serialised reply (the gRPC sidecar's handler threads) or to the
    caller's asyncio loop resuming (the asyncio host). Part of the deadline split's tail; observed
    into the ``reply`` stage's duration too."""

    seconds: tuple[float, ...]


MetricEvent = (
    DecisionMade
    | RepliesSent
    | KvcmRequest
    | MasterRequest
    | HitObserved
    | ProbeSkipped
    | CandidatesDropped
    | StatusLookups
    | BackgroundProbes
    | LeaderChanged
    | ChannelEvicted
    | ShadowAgreement
    | ShadowRecordDropped
)


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    decision: RouteDecision
    at: float  # trio time the sink recorded it

    @classmethod
    def unpacked(cls, packed: bytes) -> DecisionRecord:
        """A decision as the ring keeps it (``pack_decision``), made whole again."""
        decision, at = unpack_decision(packed)
        return cls(decision, at)


def retained_decision(d: RouteDecision, text_chars: int, max_candidates: int) -> RouteDecision:
    """What the ring keeps of a decision: its request_id and error cut to ``text_chars`` characters
    (marked), at most ``max_candidates`` candidates (the chosen one among them whenever one is kept:
    0 keeps none). Pure; the
    decision itself when nothing is over a bound."""
    over_id = len(d.request_id) > text_chars
    over_error = d.error is not None and len(d.error) > text_chars
    over_candidates = len(d.candidates) > max_candidates
    if not (over_id or over_error or over_candidates):
        return d
    candidates = d.candidates
    if over_candidates:
        kept = list(candidates[:max_candidates])
        chosen = next((c for c in candidates[max_candidates:] if c.chosen), None)
        if chosen is not None and kept:
            kept[-1] = chosen
        candidates = tuple(kept)
    return replace(
        d,
        request_id=cut_text(d.request_id, text_chars),
        error=None if d.error is None else cut_text(d.error, text_chars),
        candidates=candidates,
    )


@dataclass(frozen=True, slots=True)
class MetricsSinkSnapshot:
    inbox_depth: int
    inbox_capacity: int
    inbox_peak: int
    processed: int
    dropped: int
    decisions_kept: int
    gauge_sources: int
    last_leader: str | None


class _SourceGauges(Collector):
    """Reads the registered snapshot callables at scrape time (gauges, and counters kept elsewhere)."""

    def __init__(self) -> None:
        self.sources: dict[tuple[str, tuple[str, ...]], Callable[[], float]] = {}
        self.failed: set[tuple[str, tuple[str, ...]]] = set()  # bounded by sources: logged once each

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            name: GaugeMetricFamily(name, help_text, labels=labels)
            for name, (help_text, labels) in SOURCE_GAUGES.items()
        }
        for name, (help_text, labels) in SOURCE_COUNTERS.items():
            families[name] = CounterMetricFamily(name, help_text, labels=labels)
        return families

    def describe(self) -> Iterator[Metric]:
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        for key, read in self.sources.items():
            name, label_values = key
            try:
                value = float(read())
            except Exception:  # a broken snapshot must not break the scrape; say so once
                if key not in self.failed:
                    self.failed.add(key)
                    logger.exception("gauge source %s%s failed; its sample is left out", name, list(label_values))
                continue
            families[name].add_metric(list(label_values), value)
        yield from families.values()


def metrics_problems(config: MetricsConfig) -> list[Problem]:
    """Every reason the sink cannot work with ``config`` (empty when it can)."""
    return range_problems(config)


class MetricsSink:
    """``split``: the router settings the deadline split's estimates follow (None: the defaults)."""

    def __init__(self, config: MetricsConfig, *, split: RouterConfig | None = None) -> None:
        refuse("metrics", metrics_problems(config))
        self._config = config
        self._send, self._receive = trio.open_memory_channel[MetricEvent](config.inbox_size)
        self.registry = CollectorRegistry(auto_describe=True)
        f = OwnedFamilies()
        self._dropped = OwnedCounter(
            "kvroute_metrics_events_dropped", "Telemetry events dropped: inbox full", families=f
        )
        self._decisions = OwnedCounter(
            "kvroute_route_decisions", "Routing decisions", ("route_source", "reason"), families=f
        )
        self._duration = OwnedHistogram(
            "kvroute_route_duration_seconds",
            "Time spent per routing stage (total = the whole decision)",
            ("stage",),
            buckets=DURATION_BUCKETS,
            families=f,
        )
        self._source_outcomes = OwnedCounter(
            "kvroute_source_outcomes",
            "What each source of the chain did with a request (reason: why it fell through or ended)",
            ("source", "outcome", "reason"),
            families=f,
        )
        self._hit_ratio = OwnedHistogram(
            "kvroute_hit_actual_over_predicted",
            "The prefix a worker reported for a routed request / the hit the router predicted",
            ("route_source",),
            buckets=(0.0, 0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.5, 2.0),
            families=f,
        )
        self._hit_error = OwnedHistogram(
            "kvroute_hit_error_tokens",
            "|reported prefix − predicted hit| in tokens",
            ("route_source",),
            buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536),
            families=f,
        )
        self._silent_zero = OwnedCounter(
            "kvroute_hit_silent_zero",
            "Routed requests whose worker found no cached prefix where the router predicted one",
            ("route_source",),
            families=f,
        )
        self._shadow_hit_error = OwnedHistogram(
            "kvroute_shadow_hit_error_tokens",
            "|the shadow index's predicted hit − KVCM's reported hit| at KVCM's best holder, in tokens",
            buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536),
            families=f,
        )
        self._master_requests = OwnedCounter(
            "kvroute_master_requests", "Master source outcomes and transport errors", ("outcome",), families=f
        )
        self._kvcm_requests = OwnedCounter(
            "kvroute_kvcm_requests", "KVCM RPCs by outcome", ("method", "outcome"), families=f
        )
        self._leader_changes = OwnedCounter(
            "kvroute_kvcm_leader_changes",
            "KVCM leaders the leader resolver found that differ from the last it found (the first counts)",
            families=f,
        )
        self._probe_skipped = OwnedCounter("kvroute_probe_skipped", "Worker probes skipped", ("reason",), families=f)
        self._cache_hits = OwnedCounter(
            "kvroute_worker_status_cache_hits", "Worker statuses served from the status cache", families=f
        )
        self._fresh_from_background = OwnedCounter(
            "kvroute_worker_status_fresh_from_background",
            "Worker statuses served fresh from the cache that a background poll had fetched",
            families=f,
        )
        self._probed_per_request = OwnedHistogram(
            "kvroute_probes_per_request",
            "Candidates per scored request without a fresh status (each asked for a probe)",
            buckets=(0, 1, 2, 4, 8, 16, 32),
            families=f,
        )
        self._background_probes = OwnedCounter(
            "kvroute_probe_background", "Worker probes the prober started on its own", ("kind",), families=f
        )
        self._shadow_dropped = OwnedCounter(
            "kvroute_shadow_records_dropped", "Decisions the shadow index missed (its inbox was full)", families=f
        )
        self._evictions = OwnedCounter(
            "kvroute_channel_pool_evictions", "gRPC channels evicted from the pool", ("reason",), families=f
        )
        self._candidates_dropped = OwnedCounter(
            "kvroute_candidates_dropped", "Candidates dropped before scoring", ("reason",), families=f
        )
        self._split_cuts = OwnedCounter(
            "kvroute_deadline_split_cuts",
            "Waits of a request the deadline split's window ended (the stage had not finished)",
            ("stage",),
            families=f,
        )
        self._shadow_comparisons = OwnedCounter(
            "kvroute_shadow_comparisons", "Shadow-index predictions compared with KVCM answers", families=f
        )
        # The stages' children looked up once: the sink's hot loop observes each stage per decision.
        self._stage_durations = {stage: self._duration.labels(stage.value) for stage in Stage}
        self._stage_cuts = {stage: self._split_cuts.labels(stage.value) for stage in Stage}
        self._reply_duration = self._duration.labels(REPLY_STAGE_LABEL)
        r = self.registry
        r.register(f)
        self._gauges = _SourceGauges()
        r.register(self._gauges)
        self.register_gauge_source("kvroute_inbox_depth", self.inbox_depth, actor="metrics_sink")
        # Read at scrape time: the window's mean is needed only then, not at every comparison.
        self.register_gauge_source("kvroute_shadow_agreement_ratio", self._agreement_ratio)
        # Owned by run() (mutated only there, or in synchronous non-awaiting methods).
        # Packed (router/decision_pack.py): one bytes object a decision, which the collector does not
        # walk, where the decision itself is some fifteen objects it would walk at every collection of
        # the generation the ring's newer ones are in.
        self._ring: deque[bytes] = deque(maxlen=config.decision_ring_size)
        self._agreements: deque[float] = deque(maxlen=config.shadow_agreement_window)
        self._agreement_sum = 0.0
        self._processed = 0
        self._dropped_count = 0
        self._peak = 0
        self._last_leader: str | None = None
        self._split_estimator = SplitEstimator(RouterConfig() if split is None else split)
        # Published for the routing path, which reads it without waiting; replaced, never changed.
        self._split_estimates = self._split_estimator.estimates()
        # An estimate changed since the last publication: published once per drained batch (no
        # reader runs within one, it has no await), not once per event that changed it.
        self._estimates_changed = False

    @property
    def config(self) -> MetricsConfig:
        return self._config

    # --- producers (any task; synchronous, never waits) ---

    def emit(self, event: MetricEvent) -> None:
        """Queue ``event`` without waiting; when the inbox is full (or closed) drop and count it."""
        try:
            self._send.send_nowait(event)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._dropped_count += 1
            self._dropped.inc()

    def register_gauge_source(self, name: str, read: Callable[[], float], **labels: str) -> None:
        """Read ``read()`` at every scrape as gauge ``name`` (one of SOURCE_GAUGES) with ``labels``, or
        as counter ``name`` (one of SOURCE_COUNTERS: ``read`` must never go down).

        Registering the same name and labels again replaces the source (an actor restarted by the
        supervisor re-registers). ``read`` runs in the scraping task: it must be cheap and not await.
        """
        known = {**SOURCE_GAUGES, **SOURCE_COUNTERS}
        if name not in known:
            raise ValueError(f"unknown source gauge {name!r}; known: {', '.join(known)}")
        label_names = known[name][1]
        if set(labels) != set(label_names):
            raise ValueError(f"gauge {name} takes labels {list(label_names)}, got {sorted(labels)}")
        key = (name, tuple(labels[n] for n in label_names))
        self._gauges.sources[key] = read
        self._gauges.failed.discard(key)

    # --- readers (debug endpoint) ---

    def recent_decisions(self, limit: int) -> list[bytes]:
        """The last ``limit`` decisions, newest first, packed (``DecisionRecord.unpacked`` reads one): a
        snapshot of references, so a reader unpacks them at its own pace."""
        if limit < 1:
            return []
        # Not by index: a deque's item is found by walking from its nearer end, and ``ring[-i]`` for
        # every i walked the ring quadratically (seconds on the trio thread for a ring of a million).
        return list(itertools.islice(reversed(self._ring), limit))

    def split_estimates(self) -> SplitEstimates:
        """The deadline split's latest estimates (an immutable snapshot)."""
        return self._split_estimates

    def inbox_depth(self) -> int:
        return self._send.statistics().current_buffer_used

    def snapshot(self) -> MetricsSinkSnapshot:
        return MetricsSinkSnapshot(
            inbox_depth=self.inbox_depth(),
            inbox_capacity=self._config.inbox_size,
            inbox_peak=self._peak,
            processed=self._processed,
            dropped=self._dropped_count,
            decisions_kept=len(self._ring),
            gauge_sources=len(self._gauges.sources),
            last_leader=self._last_leader,
        )

    # --- the owner task ---

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply events until cancelled. May be started again after a crash: the inbox and state persist."""
        task_status.started()
        while True:
            event = await self._receive.receive()
            # Single consumer: between two receives the buffer only grows, so its largest size is
            # seen here (this event plus what is still queued) — producers pay nothing for the peak.
            self._peak = max(self._peak, self._receive.statistics().current_buffer_used + 1)
            self._apply(event)
            self._processed += 1
            # Drain a bounded batch per scheduling round: one event per round cannot keep up with
            # routers emitting several per decision, and an unbounded batch would hold the loop.
            for _ in range(DRAIN_BATCH - 1):
                try:
                    event = self._receive.receive_nowait()
                except trio.WouldBlock:
                    break
                self._apply(event)
                self._processed += 1
            if self._estimates_changed:
                self._estimates_changed = False
                self._split_estimates = self._split_estimator.estimates()

    def _apply(self, event: MetricEvent) -> None:
        match event:
            case DecisionMade(decision, events):
                self._record_decision(decision)
                for carried in events:
                    self._apply(carried)
            case KvcmRequest(method, outcome):
                self._kvcm_requests.labels(method, outcome).inc()
            case HitObserved(route_source, predicted, actual):
                self._hit_ratio.labels(route_source).observe(actual / predicted if predicted else 0.0)
                self._hit_error.labels(route_source).observe(abs(actual - predicted))
                if actual == 0 and predicted > 0:
                    self._silent_zero.labels(route_source).inc()
            case MasterRequest(outcome):
                self._master_requests.labels(outcome).inc()
            case ProbeSkipped(reason, n):
                self._probe_skipped.labels(reason).inc(n)
            case CandidatesDropped(reason, n):
                self._candidates_dropped.labels(reason).inc(n)
            case StatusLookups(cache_hits, from_background, probed):
                if cache_hits:
                    self._cache_hits.inc(cache_hits)
                if from_background:
                    self._fresh_from_background.inc(from_background)
                self._probed_per_request.observe(probed)
            case BackgroundProbes(kind, n):
                self._background_probes.labels(kind).inc(n)
            case LeaderChanged(target):
                self._last_leader = target
                self._leader_changes.inc()
            case ChannelEvicted(reason, n):
                self._evictions.labels(reason).inc(n)
            case ShadowAgreement(ratio, hit_error_tokens):
                self._record_agreement(ratio)
                self._shadow_hit_error.observe(hit_error_tokens)
            case RepliesSent(seconds):
                reply = self._reply_duration
                for sample in seconds:
                    reply.observe(sample)
                if self._split_estimator.observe_replies(seconds):
                    self._estimates_changed = True
            case ShadowRecordDropped():
                self._shadow_dropped.inc()
            case _:
                assert_never(event)

    def _record_decision(self, d: RouteDecision) -> None:
        self._decisions.labels(d.route_source.value, d.reason.value).inc()
        durations = self._stage_durations
        for stage, ms in d.stage_ms.items():
            durations[stage].observe(ms / 1000.0)
        if Stage.TOTAL not in d.stage_ms:
            durations[Stage.TOTAL].observe(d.elapsed_ms / 1000.0)
        for window in d.windows:
            if window.cut:
                self._stage_cuts[window.stage].inc()
        # The master's attempt came before the cache source's windows: time they no longer had.
        ahead_ms = sum(step.elapsed_ms for step in d.sources if step.source is RouteSource.MASTER)
        if self._split_estimator.observe(d.stage_ms, d.windows, ahead_ms=ahead_ms):
            self._estimates_changed = True
        for step in d.sources:
            reason = "" if step.reason is None else step.reason.value
            self._source_outcomes.labels(step.source.value, step.outcome.value, reason).inc()
        kept = retained_decision(d, self._config.decision_text_chars, self._config.decision_max_candidates)
        self._ring.append(pack_decision(kept, trio.current_time()))

    def _record_agreement(self, ratio: float) -> None:
        ratio = min(1.0, max(0.0, ratio))
        if len(self._agreements) == self._agreements.maxlen:
            self._agreement_sum -= self._agreements[0]
        self._agreements.append(ratio)
        self._agreement_sum += ratio
        self._shadow_comparisons.inc()

    def _agreement_ratio(self) -> float:
        """The mean of the agreement window (0.0 before the first comparison)."""
        if not self._agreements:
            return 0.0
        return min(1.0, max(0.0, self._agreement_sum / len(self._agreements)))
