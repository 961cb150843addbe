"""The demo's master-outage comparison: each arm replayed under a MockClock on in-memory transports, and
the command printing it, writing it to the JSON and charting it (or skipping it with --no-master)."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest
import trio
import trio.testing

from kvroute_sim.demo import cli as demo_cli
from kvroute_sim.demo.master_outage import (
    ARMS,
    KVROUTE_KVCM_PATH,
    MASTER_HEALTHY,
    OUTAGE_CHART_FILE,
    PRE_CHANGE,
    OutageWindow,
    run_arm,
)
from kvroute_sim.demo.report import RESULTS_FILE, summarize
from kvroute_sim.demo.runner import ClusterSpec
from kvroute_sim.demo.workload import WorkloadSpec, build_workload

SMALL = WorkloadSpec(groups=6, prompts_per_group=30, system_prompt_tokens=256, question_tokens=32, rate_per_s=60.0)
CLUSTER = ClusterSpec(workers=4, kv_capacity_blocks=48)


def test_the_window_is_the_middle_third_of_the_requests() -> None:
    workload = build_workload(SMALL)
    window = OutageWindow.of(workload)
    inside = sum(window.holds(r.arrival_s) for r in workload.requests)
    assert 0 < window.start_s < window.end_s < workload.duration_s
    assert abs(inside - len(workload.requests) / 3) <= 2


@pytest.mark.parametrize("arm", ARMS)
async def test_each_arm_routes_the_window_from_its_source(arm: str, autojump_clock: trio.testing.MockClock) -> None:
    workload = build_workload(SMALL)
    with trio.fail_after(600):
        whole, during = await run_arm(arm, workload, CLUSTER)
    assert len(whole.records) == len(workload.requests) and all(r.worker >= 0 for r in whole.records)
    window = OutageWindow.of(workload)
    before = [r for r, q in zip(whole.records, workload.requests, strict=True) if q.arrival_s < window.start_s]
    assert {r.route_source for r in before} == {"master"}  # the scheduler routes while it is up
    sources = Counter(r.route_source for r in during.records)
    expected = {MASTER_HEALTHY: "master", KVROUTE_KVCM_PATH: "kvcm", PRE_CHANGE: "domain"}[arm]
    assert sources[expected] >= 0.9 * len(during.records), sources
    # The window's figures are its own: its load is its requests' uncached tokens (it was the whole
    # run's), and what any worker held for each request and its group are filled in (they were 0 and -1).
    uncached = [0] * CLUSTER.workers
    for record in during.records:
        uncached[record.worker] += record.input_tokens - record.cached_tokens
    assert during.worker_prefill_tokens == tuple(uncached) != whole.worker_prefill_tokens
    assert all(r.group >= 0 for r in during.records) and any(r.best_cached_tokens > 0 for r in during.records)


async def test_the_kvcm_path_keeps_the_hit_rate_the_domain_loses(autojump_clock: trio.testing.MockClock) -> None:
    workload = build_workload(SMALL)
    with trio.fail_after(600):
        summaries = {arm: summarize((await run_arm(arm, workload, CLUSTER))[1]) for arm in ARMS}
    kvcm, domain, healthy = summaries[KVROUTE_KVCM_PATH], summaries[PRE_CHANGE], summaries[MASTER_HEALTHY]
    assert kvcm.hit_rate > domain.hit_rate and kvcm.ttft_mean_ms < domain.ttft_mean_ms
    assert healthy.hit_rate > domain.hit_rate


def _demo_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvroute demo")
    demo_cli.configure(parser)
    return demo_cli.run(parser.parse_args(argv))


_TINY = [
    "--groups", "4", "--prompts-per-group", "6", "--system-prompt-tokens", "256", "--sim-workers", "3",
    "--kv-capacity-blocks", "32", "--rate", "100", "--policies", "random",
]  # fmt: skip


async def test_the_command_prints_writes_and_charts_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with trio.fail_after(120):
        code = await trio.to_thread.run_sync(_demo_command, ["--out", str(tmp_path), *_TINY], abandon_on_cancel=True)
    out = capsys.readouterr().out
    assert code == 0
    assert "master-outage comparison" in out
    rows = [line.split("  ")[0] for line in out.splitlines()]
    assert all(arm in rows for arm in ARMS)
    outage = json.loads((tmp_path / RESULTS_FILE).read_text())["master_outage"]
    assert [a["arm"] for a in outage["arms"]] == list(ARMS)
    assert all(0.0 <= a["during_outage"]["hit_rate"] <= 1.0 for a in outage["arms"])
    for arm in outage["arms"]:  # no decision time on this clock: null, never a made-up 0
        assert arm["during_outage"]["decision_p50_us"] is None
    assert (tmp_path / OUTAGE_CHART_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_no_master_skips_the_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--out", str(tmp_path), "--no-master", "--no-chart", *_TINY]
    with trio.fail_after(120):
        code = await trio.to_thread.run_sync(_demo_command, argv, abandon_on_cancel=True)
    assert code == 0
    assert "master-outage comparison" not in capsys.readouterr().out
    assert "master_outage" not in json.loads((tmp_path / RESULTS_FILE).read_text())
    assert not (tmp_path / OUTAGE_CHART_FILE).exists()
