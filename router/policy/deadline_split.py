"""The deadline split: how much of a request's time each waiting stage of a cache source may use.

The fixed split gives every wait the same end, ``decide_at = deadline − reserve`` with
``reserve = max(reserve_min, reserve_fraction × budget, min(2 × lag, budget / 2))`` (a task woken
at the end of a wait runs ``lag`` later; a lag above half the budget is shed at admission, not
waited out here): a slow KVCM query may then use the time its probes needed, and the decision falls
back although a hit was in reach.

The learned split keeps a running estimate of a high quantile of each stage's latency and ends
each wait early enough to leave the stages after it their expected time, giving the waits the part
of the fixed reserve the later stages do not need::

    probe_end  = max(decide_at, deadline − max(reserve_min, tail))   probes and plan
    query_end  = max(decide_at, probe_end − probe)                   GetHostCacheState
    leader_end = max(decide_at, query_end − query)                   a leader lookup

``probe`` (plan + probes) and ``query`` are the estimates of those stages; ``tail`` is the time from
the end of the last wait (the probes') to the reply leaving kvroute: the late wake-up of the
request's task (one woken after its deadline too, up to its deadline answer), the Scorer round
trip, building and emitting the decision and, where a transport reports it, the reply's way back
to the caller. Measured whole, it covers what no stage estimate
does (a first version left ``reserve_min + lag + score`` there, and its replies reached callers
late). No end is before the fixed split's: the learned split only lends the waits the part of the
fixed reserve that the measured tail does not need (when the tail needs all of it, the split is
the fixed one), and a KVCM answer that leaves the probes no time is still scored with the statuses
the prober has cached, so cutting the query to make room for probes loses more answers than it
saves. Every end is at most the request's deadline, so a window only ever shortens it. Until each
estimate has ``min_samples`` observations (cold start) the fixed split applies.

The estimate of the query and the probes is the mean plus ``deviations`` mean absolute deviations,
both exponentially weighted with ``weight`` per sample, so a sudden change moves it within a few
requests. A sample is at most what the stage's window left it (past that the task was running
late, the tail's part). A stage the split cut short was observed for less than it would have taken:
such a sample counts as it is when it is at least the current estimate (then the stage is at least
that slow); below it, it says nothing of the mean, which it never lowers, but lets the deviation
fade. A later stage no request reached for a while is forgotten (:class:`SplitEstimator`), so a
bad estimate cannot lock the split into cutting every query.

The tail is heavy-tailed (a scheduling stall of the routing thread, the GIL held by another thread
for its switch interval): most replies leave within a millisecond, a few take several. A mean plus
deviations jumps after each stall and sits below the stalls in between, so the tail's estimate is
a quantile of the recent samples (:class:`RecentQuantile`: ``TAIL_QUANTILE`` of the tails among the
last ``TAIL_WINDOW`` decisions that ran the query or brought a tail, a shadow-scored one's too): two
long tails among the recent ones raise it at once, and it comes down once they have left the window.

Pure: values in, values out; time is passed in.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from router.config import DeadlineSplit, RouterConfig
from router.slot_init import slot_init
from router.types import SplitMode, Stage, StageWindow

# The stages whose latency the split estimates, in the order a cache source runs them.
SPLIT_STAGES = (Stage.CACHE_QUERY, Stage.PROBE, Stage.SCORE)  # each a mean plus deviations; the tail apart


@dataclass(frozen=True, slots=True)
class SplitEstimates:
    """The published estimates, in seconds (None: fewer samples than the split needs)."""

    query: float | None = None
    probe: float | None = None  # plan + probes
    score: float | None = None  # the Scorer round trip (part of the tail; kept for the records)
    lag: float = 0.0  # the routing loop's lag: how late the request's task runs once a wait ends
    tail: float | None = None  # from the end of the last wait to the reply leaving kvroute

    @property
    def warm(self) -> bool:
        return self.query is not None and self.probe is not None and self.tail is not None


COLD = SplitEstimates()


class WithLag:
    """``replace(estimates, lag=lag)`` for each request, rebuilt only when the published estimates
    (a new object) or the lag changed since the last call: both change far less often than requests
    arrive, and ``dataclasses.replace`` costs microseconds."""

    __slots__ = ("_lag", "_published", "_result")

    def __init__(self) -> None:
        self._published: SplitEstimates | None = None
        self._lag = 0.0
        self._result = COLD

    def __call__(self, published: SplitEstimates, lag: float) -> SplitEstimates:
        if published is not self._published or lag != self._lag:
            self._published, self._lag = published, lag
            self._result = replace(published, lag=lag)
        return self._result


@slot_init
@dataclass(frozen=True, slots=True)
class SplitWindows:
    """One request's wait ends (trio time). The fixed split: all three are ``decide_at``."""

    leader_end: float
    query_end: float
    probe_end: float
    mode: SplitMode

    def end(self, stage: Stage) -> float:
        if stage is Stage.LEADER:
            return self.leader_end
        if stage is Stage.CACHE_QUERY:
            return self.query_end
        return self.probe_end


LAG_RESERVE_FACTOR = 2.0  # the decision reserve is at least this many times the loop's average lag
TAIL_WINDOW = 40  # the recent decisions (that ran the query or brought a tail) whose tails make the estimate
TAIL_QUANTILE = 0.97  # ... and the share of those tails it covers (of 40: the second longest)


def split_windows(
    received_at: float, deadline: float, estimates: SplitEstimates, router: RouterConfig
) -> SplitWindows:
    """The wait ends of one request received at ``received_at`` with ``deadline`` (pure)."""
    budget = max(0.0, deadline - received_at)
    reserve_min = router.reserve_min_ms / 1000.0
    lag_reserve = min(LAG_RESERVE_FACTOR * estimates.lag, 0.5 * budget)
    decide_at = deadline - max(reserve_min, router.reserve_fraction * budget, lag_reserve)
    if router.deadline_split is DeadlineSplit.FIXED or not estimates.warm:
        mode = SplitMode.FIXED if router.deadline_split is DeadlineSplit.FIXED else SplitMode.COLD
        return SplitWindows(decide_at, decide_at, decide_at, mode)
    assert estimates.query is not None and estimates.probe is not None and estimates.tail is not None
    # Never before decide_at: the split lends the waits only what the tail leaves of the fixed reserve,
    # and a KVCM answer that leaves the probes no time is still scored with the cached statuses.
    probe_end = max(decide_at, deadline - max(reserve_min, estimates.tail))
    query_end = max(decide_at, probe_end - estimates.probe)
    leader_end = max(decide_at, query_end - estimates.query)
    return SplitWindows(leader_end, query_end, probe_end, SplitMode.LEARNED)


class StageLatency:
    """A running high-quantile estimate of one stage's latency (seconds)."""

    __slots__ = ("_deviation", "_deviations", "_mean", "_weight", "samples")

    def __init__(self, weight: float, deviations: float) -> None:
        self._weight = weight
        self._deviations = deviations
        self._mean = 0.0
        self._deviation = 0.0
        self.samples = 0

    @property
    def high(self) -> float:
        return self._mean + self._deviations * self._deviation

    def observe(self, seconds: float, *, censored: bool = False) -> None:
        """One sample; ``censored``: the stage was stopped after ``seconds`` (it would have taken longer).

        A censored sample at or above the estimate says the stage takes at least that long, and counts
        as it is. Below it, it says the stage takes at least that long, not how long: it counts as the
        mean when it is below the mean, so a cut never lowers the mean, but the deviation fades (a
        spread that only one outlier brought would otherwise be kept for as long as every sample is cut)."""
        if censored and self.samples and seconds < self.high:
            seconds = max(seconds, self._mean)
        if not self.samples:
            self._mean, self._deviation = seconds, seconds / 2.0
        else:
            w = self._weight
            self._deviation += w * (abs(seconds - self._mean) - self._deviation)
            self._mean += w * (seconds - self._mean)
        self.samples += 1

    def forget(self) -> None:
        self._mean = self._deviation = 0.0
        self.samples = 0


class RecentQuantile:
    """A quantile (nearest rank: ``quantile`` of them are at most it) of the samples among the last
    ``window`` entries. :meth:`pass_over` enters one without a sample, so old samples also leave when
    the requests that would have brought new ones stop reaching the stage (a stalled start would
    otherwise be kept for as long as the split cut every query).

    Read once per decision the metrics sink records: the window's samples are also kept in order, so
    a read is an index, not a sort of the window."""

    __slots__ = ("_ordered", "_quantile", "_recent")

    def __init__(self, window: int, quantile: float) -> None:
        self._recent: deque[float | None] = deque(maxlen=window)
        self._ordered: list[float] = []  # the samples in _recent, ascending
        self._quantile = quantile

    @property
    def samples(self) -> int:
        return len(self._ordered)

    @property
    def high(self) -> float:
        ordered = self._ordered
        return ordered[max(0, math.ceil(self._quantile * len(ordered)) - 1)] if ordered else 0.0

    def observe(self, seconds: float) -> None:
        self._enter(seconds)
        bisect.insort(self._ordered, seconds)

    def pass_over(self) -> None:
        self._enter(None)

    def _enter(self, entry: float | None) -> None:
        recent = self._recent
        if len(recent) == recent.maxlen:
            leaving = recent[0]
            if leaving is not None:
                ordered = self._ordered
                del ordered[bisect.bisect_left(ordered, leaving)]
        recent.append(entry)


def _within(sample_ms: float, end_ms: float | None, before_ms: float) -> float:
    """A stage's sample, at most what its window (ending ``end_ms`` after receipt; None: the stage had
    none) left it after the stages before it (``before_ms``)."""
    return sample_ms if end_ms is None else min(sample_ms, max(0.0, end_ms - before_ms))


class SplitEstimator:
    """The estimates of the split's stages, fed with decisions; owned by one task (the metrics sink).

    A stage after the query (probes, score) not seen for ``STALE_AFTER × min_samples`` decisions
    that ran the query is forgotten: the split is cold again, so the fixed split lets the request reach
    it and it is measured afresh. Without that, an estimate that made the split cut every query would
    never be corrected, since no request would reach the stage again. The tail's window counts the
    decisions that ran the query or brought a tail (a shadow-scored one's too), so it empties (cold)
    after ``TAIL_WINDOW`` queries without a tail.

    The tail is the router's part (``stage_ms[Stage.TAIL]``, from the end of the probe wait to the
    decision leaving the router) plus, once a transport reports them (:meth:`observe_replies`), the
    replies' way back from the router to the transport (the gRPC sidecar's handler thread taking the
    decision and serialising it): each has its own estimate and the published tail is their sum.
    """

    STALE_AFTER = 4

    __slots__ = ("_min_samples", "_replies", "_since", "_stages", "_tail")

    def __init__(self, router: RouterConfig) -> None:
        self._min_samples = router.split_min_samples
        self._stages = {
            stage: StageLatency(router.split_estimate_weight, router.split_deviations) for stage in SPLIT_STAGES
        }
        self._tail = RecentQuantile(TAIL_WINDOW, TAIL_QUANTILE)
        self._replies = RecentQuantile(TAIL_WINDOW, TAIL_QUANTILE)
        # Decisions that ran the query but not this stage.
        self._since = {Stage.PROBE: 0, Stage.SCORE: 0}

    def observe(
        self, stage_ms: Mapping[Stage, float], windows: tuple[StageWindow, ...], *, ahead_ms: float = 0.0
    ) -> bool:
        """Feed one decision's stage times; True when an estimate changed. ``ahead_ms``: what the chain
        spent before the cache source, which is no stage (the master's attempt)."""
        cut = {w.stage for w in windows if w.cut}
        changed = False
        if Stage.CACHE_QUERY in stage_ms:
            for stage in self._since:
                if stage in stage_ms:
                    self._since[stage] = 0
                    continue
                self._since[stage] += 1
                if self._since[stage] > self.STALE_AFTER * self._min_samples and self._stages[stage].samples:
                    self._stages[stage].forget()
                    changed = True
        # A waiting stage takes at most the time its window left it: the window's end after receipt less
        # the stages before it. Past that the request's task was running late (a stalled loop), which the
        # tail measures; counted here, one stall would hold the estimate up for as long as the stage is cut.
        ends = {w.stage: w.end_ms for w in windows}
        before = stage_ms.get(Stage.KEYS, 0.0) + ahead_ms + stage_ms.get(Stage.LEADER, 0.0)
        query = stage_ms.get(Stage.CACHE_QUERY)
        if query is not None:
            sample = _within(query, ends.get(Stage.CACHE_QUERY), before)
            self._stages[Stage.CACHE_QUERY].observe(sample / 1000.0, censored=Stage.CACHE_QUERY in cut)
            before += query
            changed = True
        probe = stage_ms.get(Stage.PROBE)
        if probe is not None:
            sample = _within(stage_ms.get(Stage.PLAN, 0.0) + probe, ends.get(Stage.PROBE), before)
            self._stages[Stage.PROBE].observe(sample / 1000.0, censored=Stage.PROBE in cut)
            changed = True
        score = stage_ms.get(Stage.SCORE)
        if score is not None:
            self._stages[Stage.SCORE].observe(score / 1000.0)
            changed = True
        tail = stage_ms.get(Stage.TAIL)
        if tail is not None:  # never cut: every sample counts as it is
            self._tail.observe(tail / 1000.0)
            changed = True
        elif query is not None:
            had = self._tail.samples
            self._tail.pass_over()
            changed = changed or self._tail.samples != had
        return changed

    def observe_replies(self, seconds: Sequence[float]) -> bool:
        """Feed replies' way back from the router to the transport (seconds each); True when any."""
        for sample in seconds:
            self._replies.observe(max(0.0, sample))
        return bool(seconds)

    def estimates(self) -> SplitEstimates:
        # The tail's windows hold TAIL_WINDOW entries, and a decision whose query was cut brings none:
        # asked for more than half of them, a cut query now and then (what the learned split itself
        # makes) held the split cold, and for more than all of them, for good.
        windowed = min(self._min_samples, TAIL_WINDOW // 2)

        def high(latency: StageLatency | RecentQuantile) -> float | None:
            needed = windowed if isinstance(latency, RecentQuantile) else self._min_samples
            return latency.high if latency.samples >= needed else None

        stages = self._stages
        tail = high(self._tail)
        if tail is not None and self._replies.samples:  # a transport reports its part: cold until it is known
            replies = high(self._replies)
            tail = None if replies is None else tail + replies
        return SplitEstimates(
            query=high(stages[Stage.CACHE_QUERY]), probe=high(stages[Stage.PROBE]), score=high(stages[Stage.SCORE]),
            tail=tail,
        )
