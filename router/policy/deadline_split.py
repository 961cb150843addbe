"""The deadline split: how much of a request's time each waiting stage of a cache source may use.

The fixed split gives every wait the same end, ``decide_at = deadline − reserve`` with
``reserve = max(reserve_min, reserve_fraction × budget, min(2 × lag, budget / 2))`` (a task woken
at the end of a wait runs ``lag`` later; a lag above half the budget is shed at admission, not
waited out here): a slow KVCM query may then use the time its probes needed, and the decision falls
back although a hit was in reach.

The learned split keeps a running estimate of a high quantile of each stage's latency and ends
each wait early enough to leave the stages after it their expected time, giving the waits the part
of the fixed reserve the later stages do not need::

    probe_end  = max(decide_at, deadline − reserve_min − lag − score)   probes and plan
    query_end  = max(decide_at, probe_end − probe)                      GetHostCacheState
    leader_end = max(decide_at, query_end − query)                      a leader lookup

``score``, ``probe`` (plan + probes) and ``query`` are the estimates; ``lag`` is how late the
routing loop runs a due task (the admission estimate's), which the answer pays after the wait.
No end is before the fixed split's: a KVCM answer that leaves the probes no time is still scored
with the statuses the prober has cached, so cutting the query to make room for probes loses more
answers than it saves. Every end is at most the request's deadline, so a window only ever
shortens it. Until each estimate has
``min_samples`` observations (cold start) the fixed split applies.

The estimate per stage is the mean plus ``deviations`` mean absolute deviations, both
exponentially weighted with ``weight`` per sample, so a sudden change moves it within a few
requests. A stage the split cut short was observed for less than it would have taken: such a
sample is used only when it is at least the current estimate (then the stage is at least that
slow); below it, it says nothing. A later stage no request reached for a while is forgotten
(:class:`SplitEstimator`), so a bad estimate cannot lock the split into cutting every query.

Pure: values in, values out; time is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from router.config import DeadlineSplit, RouterConfig
from router.types import SplitMode, Stage, StageWindow

# The stages whose latency the split estimates, in the order a cache source runs them.
SPLIT_STAGES = (Stage.CACHE_QUERY, Stage.PROBE, Stage.SCORE)


@dataclass(frozen=True, slots=True)
class SplitEstimates:
    """The published estimates, in seconds (None: fewer samples than the split needs)."""

    query: float | None = None
    probe: float | None = None  # plan + probes
    score: float | None = None
    lag: float = 0.0  # the routing loop's lag: how late the request's task runs once the wait ends

    @property
    def warm(self) -> bool:
        return self.query is not None and self.probe is not None and self.score is not None


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
    assert estimates.query is not None and estimates.probe is not None and estimates.score is not None
    # Never before decide_at: a KVCM answer that leaves the probes no time is still scored with the
    # cached statuses, so ending the query earlier than the fixed split only loses answers.
    probe_end = max(decide_at, deadline - reserve_min - estimates.lag - estimates.score)
    query_end = max(decide_at, probe_end - estimates.probe)
    return SplitWindows(max(decide_at, query_end - estimates.query), query_end, probe_end, SplitMode.LEARNED)


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

        A censored sample below the estimate says nothing (the stage was given less than the estimate);
        one at or above it says the stage takes at least that long, and counts as it is."""
        if censored and self.samples and seconds < self.high:
            return
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


class SplitEstimator:
    """The estimates of the split's stages, fed with decisions; owned by one task (the metrics sink).

    A stage after the query (probes, score) not seen for ``STALE_AFTER × min_samples`` decisions that
    ran the query is forgotten: the split is cold again, so the fixed split lets the request reach it
    and it is measured afresh. Without that, an estimate that made the split cut every query would
    never be corrected, since no request would reach the stage again.
    """

    STALE_AFTER = 4

    __slots__ = ("_min_samples", "_since", "_stages")

    def __init__(self, router: RouterConfig) -> None:
        self._min_samples = router.split_min_samples
        self._stages = {
            stage: StageLatency(router.split_estimate_weight, router.split_deviations) for stage in SPLIT_STAGES
        }
        self._since = {Stage.PROBE: 0, Stage.SCORE: 0}  # decisions that ran the query but not this stage

    def observe(self, stage_ms: Mapping[Stage, float], windows: tuple[StageWindow, ...]) -> bool:
        """Feed one decision's stage times; True when an estimate changed."""
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
        query = stage_ms.get(Stage.CACHE_QUERY)
        if query is not None:
            self._stages[Stage.CACHE_QUERY].observe(query / 1000.0, censored=Stage.CACHE_QUERY in cut)
            changed = True
        probe = stage_ms.get(Stage.PROBE)
        if probe is not None:
            plan = stage_ms.get(Stage.PLAN, 0.0)
            self._stages[Stage.PROBE].observe((plan + probe) / 1000.0, censored=Stage.PROBE in cut)
            changed = True
        score = stage_ms.get(Stage.SCORE)
        if score is not None:
            self._stages[Stage.SCORE].observe(score / 1000.0)
            changed = True
        return changed

    def estimates(self) -> SplitEstimates:
        def high(stage: Stage) -> float | None:
            latency = self._stages[stage]
            return latency.high if latency.samples >= self._min_samples else None

        return SplitEstimates(high(Stage.CACHE_QUERY), high(Stage.PROBE), high(Stage.SCORE))
