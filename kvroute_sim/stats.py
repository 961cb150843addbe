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


def shown_against(value: float, places: int, *, at_least: bool) -> float:
    """``value`` rounded to ``places`` decimals toward the side of its target it could miss on (down
    for an at-least target, up for an at-most one), so a printed figure equal to its target has met it:
    98.97 % shown as 99.0 % beside MISSED read as a contradiction."""
    scale = 10.0**places
    if not math.isfinite(value):
        return value
    return (math.floor if at_least else math.ceil)(round(value * scale, 9)) / scale


def json_safe(value: object) -> object:
    """``value`` with every non-finite float (an empty sample's NaN, a missing rate's inf) as None:
    JSON has neither."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value

