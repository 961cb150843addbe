"""Sample statistics for the demo, ``kvroute bench`` and the ``bench/`` scripts: one definition.

Percentiles are nearest-rank: the printed p99 is a value that was measured, never an interpolation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; NaN when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


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
