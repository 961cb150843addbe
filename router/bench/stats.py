"""Sample summaries shared by every figure: nearest-rank percentiles, one definition."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in 0..1, of a non-empty sample."""
    if not samples:
        raise ValueError("percentile: no samples")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


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
        return cls(
            n=len(samples),
            p50=percentile(samples, 0.5),
            p99=percentile(samples, 0.99),
            mean=statistics.fmean(samples),
            max=max(samples),
        )

    def to_json(self) -> dict[str, float]:
        return {"n": self.n, "p50": self.p50, "p99": self.p99, "mean": self.mean, "max": self.max}
