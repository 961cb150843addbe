"""The profiling helpers in bench/: the P3 load runs and reports, the py-spy summary reads raw output.

Run as the README shows them (subprocesses from the checkout); sizes are tiny, and nothing
here measures speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    for rate in ("0", "-5", "nan"):
        result = _run("pipeline_load.py", "--rate", rate)
        assert result.returncode == 2
        assert f"--rate must be > 0, got {float(rate)}" in result.stderr


def test_pipeline_load_runs_an_open_loop_and_splits_the_loops_cpu_by_task() -> None:
    result = _run("pipeline_load.py", "--decisions", "40", "--rate", "400", "--steps")
    assert result.returncode == 0, result.stderr
    assert "(40 in" in result.stdout and "open loop at 400/s)" in result.stdout
    assert "'kvcm/CACHE_LEADER'" in result.stdout
    lines = result.stdout.splitlines()
    assert any(line.startswith("trio loop CPU per decision:") for line in lines)
    # Each route is a task of the open loop's own, stepped at least once; the Scorer's hop shows beside it.
    route_rows = [line for line in lines if line.endswith("open_loop.<locals>.one")]
    assert len(route_rows) == 1
    assert float(route_rows[0].split("|")[1]) >= 1.0
    assert any(line.endswith("actors.scorer.Scorer.run") for line in lines)


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


def test_spy_summary_charges_samples_to_the_innermost_package_outside_the_standard_library(tmp_path: Path) -> None:
    raw = tmp_path / "p.raw"
    raw.write_text(
        # grpcio starting a thread: threading.py is the standard library, so it is grpcio's
        "main (pipeline_load.py:1);route (router/supervisor.py:5);future (grpc/_channel.py:9);"
        "start (threading.py:9) 30\n"
        "main (pipeline_load.py:1);route (router/supervisor.py:5);check (router/request.py:2) 20\n"
        "main (pipeline_load.py:1);run (trio/_core/_run.py:3);fly (actors/worker_prober.py:4) 10\n"
        "main (pipeline_load.py:1);prime (kvroute_sim/bench/harness.py:7) 25\n"
        "_bootstrap (threading.py:1);run (threading.py:2) 5\n"
        " 10\n"
    )
    result = _run("spy_summary.py", str(raw), "--by-package", "--exclude", "prime", "--top", "1")
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert "75 samples (100 recorded)" in lines[0]
    packages = lines[lines.index("by package (innermost frame outside the standard library):") + 1 :][:4]
    assert packages == [
        "40.0 %  grpcio",
        "40.0 %  kvroute",
        "13.3 %  (no Python frame)",
        "6.7 %  CPython (standard library only)",
    ]
    within = _run("spy_summary.py", str(raw), "--by-package", "--exclude", "prime", "--within", "route")
    lines = [line.strip() for line in within.stdout.splitlines()]
    packages = lines[lines.index("by package (innermost frame outside the standard library):") + 1 :][:2]
    assert packages == ["40.0 %  grpcio", "26.7 %  kvroute"]  # shares still of the 75 samples kept


def _spinners_left() -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # a process that ended meanwhile
            continue
        if "SCHED_IDLE" in text and "while True: pass" in text:
            found.append(text)
    return found


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_idle_wake_keeps_each_cpu_awake_while_it_measures_and_stops_its_spinners() -> None:
    result = _run("bench_idle_wake.py", "--samples", "10", "--keep-awake")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"CPUs {sorted(os.sched_getaffinity(0))} kept awake by SCHED_IDLE spinners"
    rows = [line.split("|")[0].strip() for line in lines[2:]]
    assert rows == ["python work"] * 3 + ["trio hop"] * 3 + ["thread wake"] * 3
    assert _spinners_left() == []
