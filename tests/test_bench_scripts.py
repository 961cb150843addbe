"""The profiling helpers in bench/: the P3 load runs and reports, the py-spy summary reads raw output.

Run as the README shows them (subprocesses from the checkout); sizes are tiny, and nothing
here measures speed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_pipeline_load_routes_in_memory_and_reports_a_rate() -> None:
    result = _run("pipeline_load.py", "--decisions", "200", "--concurrency", "4")
    assert result.returncode == 0, result.stderr
    assert "decisions/s (200 in" in result.stdout
    assert "'kvcm/CACHE_LEADER'" in result.stdout  # the seeded prompts are answered by KVCM


def test_pipeline_load_names_a_bad_flag() -> None:
    result = _run("pipeline_load.py", "--decisions", "0")
    assert result.returncode == 2
    assert "--decisions must be >= 1" in result.stderr


def test_spy_summary_shares_and_callees(tmp_path: Path) -> None:
    raw = tmp_path / "p.raw"
    raw.write_text(
        "main (a.py:1);route (r.py:5);encode (d.py:9) 30\n"
        "main (a.py:1);route (r.py:5);score (s.py:2) 10\n"
        "main (a.py:1);idle (t.py:3) 50\n"
        " 10\n"  # a thread sampled outside any Python frame
    )
    result = _run("spy_summary.py", str(raw), "--under", "route")
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert "100 samples" in lines[0]
    assert "40.0 %  route" in lines  # inclusive
    assert "50.0 %  idle" in lines  # own
    assert "10.0 %  (no Python frame)" in lines
    under = lines[lines.index("under route:") + 1 :]
    assert under[:2] == ["30.0 %  encode", "10.0 %  score"]


def test_spy_summary_rejects_a_file_that_is_not_raw_output(tmp_path: Path) -> None:
    raw = tmp_path / "p.svg"
    raw.write_text("<svg>\n")
    result = _run("spy_summary.py", str(raw))
    assert result.returncode != 0
    assert "p.svg:1: not a py-spy raw line" in result.stderr
