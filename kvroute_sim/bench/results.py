"""The bench's output: one row per figure, its target verdict, the printed table and the JSON document."""

from __future__ import annotations

import enum
import errno
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvroute_sim.stats import json_safe, shown_against


class Verdict(enum.Enum):
    MET = "met"
    MISSED = "MISSED"
    NO_TARGET = "-"


# The share of its decisions a figure about the KVCM route must have made by that route for its verdict:
# below it the figure times fallbacks (the feature off, calls shed overloaded), which make no remote call,
# against a floor made of those calls.
KVCM_SHARE_MIN = 0.99


def via_kvcm(verdict: Verdict, kvcm_share: float) -> Verdict:
    """``verdict``, or MISSED when fewer than ``KVCM_SHARE_MIN`` of the decisions came via KVCM."""
    return verdict if kvcm_share >= KVCM_SHARE_MIN else Verdict.MISSED


def kvcm_share_text(kvcm_share: float) -> str:
    """'N% via kvcm', rounded down: 98.9 % printed as 99 % beside the 99 % rule read as met."""
    return f"{shown_against(100 * kvcm_share, 0, at_least=True):.0f}% via kvcm"


def kvcm_share_note(kvcm_share: float) -> str:
    """What the result says when ``via_kvcm`` refuses its verdict (else nothing)."""
    if kvcm_share >= KVCM_SHARE_MIN:
        return ""
    return f" (under {KVCM_SHARE_MIN:.0%} via kvcm: not the route the target is about)"


def at_most(value: float, limit: float) -> Verdict:
    return Verdict.MET if value <= limit else Verdict.MISSED


def at_least(value: float, limit: float) -> Verdict:
    return Verdict.MET if value >= limit else Verdict.MISSED


@dataclass(frozen=True, slots=True)
class Figure:
    """One row of the table: what was measured, the result, the target and whether it was met."""

    key: str  # "P1", "P2 warm", "soak", ...
    measured: str
    result: str
    target: str
    verdict: Verdict
    data: Mapping[str, object] = field(default_factory=dict)  # every number behind the row, for the JSON

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "measured": self.measured,
            "result": self.result,
            "target": self.target,
            "verdict": self.verdict.value,
            "data": dict(self.data),
        }


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One function's share of a profiled pass (cProfile)."""

    function: str
    calls: int
    own_s: float  # time in the function itself
    cumulative_s: float

    def to_json(self) -> dict[str, object]:
        return {"function": self.function, "calls": self.calls, "own_s": self.own_s, "cum_s": self.cumulative_s}


@dataclass(slots=True)
class BenchReport:
    meta: dict[str, object]
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # printed under the table
    profiles: dict[str, tuple[ProfileRow, ...]] = field(default_factory=dict)  # by figure key
    tables: dict[str, str] = field(default_factory=dict)  # further tables a figure comes with, by title

    def table(self) -> str:
        header = ("figure", "measured", "result", "target", "verdict")
        rows = [header] + [(f.key, f.measured, f.result, f.target or "-", f.verdict.value) for f in self.figures]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |" for row in rows]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        return "\n".join(lines)

    def render(self) -> str:
        parts = [self.table()]
        if self.notes:
            parts.append("\n".join(f"- {note}" for note in self.notes))
        parts += [f"{title}:\n{table}" for title, table in self.tables.items()]
        for key, rows in self.profiles.items():
            lines = [f"profile of {key} (cProfile, top own time):"]
            lines += [
                f"  {r.own_s * 1e3:9.1f} ms own {r.cumulative_s * 1e3:9.1f} ms cum {r.calls:>9} calls  {r.function}"
                for r in rows
            ]
            parts.append("\n".join(lines))
        return "\n\n".join(parts)

    def to_json(self) -> dict[str, object]:
        return {
            "meta": self.meta,
            "figures": [f.to_json() for f in self.figures],
            "notes": list(self.notes),
            "profiles": {key: [r.to_json() for r in rows] for key, rows in self.profiles.items()},
            "tables": dict(self.tables),
        }

    @staticmethod
    def ready(path: Path) -> None:
        """Create ``path``'s directory and open ``path`` for writing (a file made here is removed again):
        OSError (its ``strerror`` the reason) when ``write`` would fail, found before the run."""
        if path.parent.exists() and not path.parent.is_dir():  # mkdir would call it "File exists"
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent))
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with path.open("a", encoding="utf-8"):  # appends nothing: an earlier run's results stay until written
            pass
        if not existed:
            path.unlink()

    def saved(self) -> dict[str, Any]:
        """What ``write`` saves: the report with an undefined figure (no sample) as null, not NaN or
        Infinity (strict JSON)."""
        return cast(dict[str, Any], json_safe(self.to_json()))  # a dict stays a dict

    def write(self, path: Path) -> None:
        text = json.dumps(self.saved(), indent=2, sort_keys=False, allow_nan=False)
        path.write_text(text + "\n", encoding="utf-8")
