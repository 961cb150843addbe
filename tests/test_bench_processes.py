"""``kvroute bench --quick --only P9`` runs end to end: both process counts measured against the same
simulator child, every process tree stopped, the CPU pinning undone. Shapes only, never speed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from router.cli import main


def test_quick_p9_measures_one_and_two_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    affinity = os.sched_getaffinity(0)

    assert main(["bench", "--quick", "--only", "P9", "--out", str(out)]) == 0

    assert psutil.Process().children(recursive=True) == []  # serve trees and the simulator child are gone
    assert os.sched_getaffinity(0) == affinity
    (figure,) = json.loads(out.read_text(encoding="utf-8"))["figures"]
    assert figure["key"] == "P9" and figure["verdict"] == "-"
    data = figure["data"]
    assert data["cpus"] and data["ratio"] > 0
    levels = data["levels"]
    assert [lv["processes"] for lv in levels] == [1, 2]
    for level in levels:
        assert level["answered"] > 0 and level["decisions_per_s"] > 0
        assert sum(level["outcomes"].values()) == level["answered"]
        # Each router process printed its drain summary; each answered some (warm-up included).
        assert len(level["answered_by_process"]) == level["processes"]
        assert all(n > 0 for n in level["answered_by_process"]), level
    printed = capsys.readouterr().out
    assert "| P9 " in printed and "with 2" in printed
