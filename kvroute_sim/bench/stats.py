"""Sample summaries shared by every figure: nearest-rank percentiles, one definition."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute_sim.demo.report import percentile  # the one nearest-rank definition (the demo's table uses it too)


@dataclass(frozen=True, slots=True)
class Summary:
    """A latency sample, in whatever unit it was recorded."""

    n: int
    p50: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        if not samples:
            raise ValueError("Summary.of: no samples")
        return cls(
            n=len(samples),
            p50=percentile(samples, 50),
            p99=percentile(samples, 99),
            mean=statistics.fmean(samples),
            max=max(samples),
        )

    def to_json(self) -> dict[str, float]:
        return {"n": self.n, "p50": self.p50, "p99": self.p99, "mean": self.mean, "max": self.max}
