"""kvroute demo --scenario: every fault scenario, shortened, passes over real loopback gRPC (real clock);
the invariant checks themselves catch a lost request, a late answer, a missing switch and no recovery."""

from __future__ import annotations

import argparse
import gc
import io
from collections.abc import Iterator

import pytest
import trio

from kvroute_sim.demo import cli as demo_cli
from kvroute_sim.demo.scenarios import (
    BUDGET_MS,
    SCENARIO_NAMES,
    SCENARIOS,
    Outcome,
    Scenario,
    ScenarioContext,
    Timeline,
    evaluate,
    run_scenario,
    run_scenarios,
)
from kvroute_sim.sim.cluster import SimCluster

CI_SCALE = 0.4  # phases at 40 %: warm-up 0.4 s, fault 0.6 s
# The simulators run in this process on gRPC threads and contend with the router for the GIL, so on a
# loaded 2-core CI machine an answer can land some ms past its deadline for reasons outside the router.
# Exact deadline adherence is asserted under MockClock (tests/test_router_pipeline.py); here the check
# still catches a router that waits out a fault (KVCM query timeout 500 ms; a hang never answers).
CI_DEADLINE_SLACK_MS = 100.0


@pytest.fixture
def quiet_heap() -> Iterator[None]:
    """Collect and freeze what earlier tests left on the heap, so a full GC pass over the whole
    suite's garbage does not land inside a scenario's deadline check (seen: +121 ms in CI)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=SCENARIO_NAMES)
@pytest.mark.usefixtures("quiet_heap")
async def test_scenario_passes_shortened(scenario: Scenario) -> None:
    with trio.fail_after(15):
        result = await run_scenario(scenario, scale=CI_SCALE, deadline_slack_ms=CI_DEADLINE_SLACK_MS)
    report = "\n".join(check.line() for check in result.checks)
    assert result.passed, f"{result.name}:\n{report}"
    assert {"answered", "deadline"} <= {check.name for check in result.checks}
    assert result.requests > 0


def test_every_issue_scenario_exists() -> None:
    assert SCENARIO_NAMES == (
        "leader-killed",
        "leader-moves",
        "kvcm-blackhole",
        "kvcm-slow",
        "kvcm-garbled",
        "workers-slow",
        "worker-flapping",
        "discovery-empty",
        "bootstrap-dead-at-start",
        "config-invalid",
    )


async def test_scenario_command_prints_pass_and_exits_zero() -> None:
    parser = argparse.ArgumentParser(prog="kvroute demo")
    demo_cli.configure(parser)
    args = parser.parse_args(["--scenario", "config-invalid", "--scenario-scale", str(CI_SCALE)])
    assert args.scenario == "config-invalid"
    out = io.StringIO()
    with trio.fail_after(15):
        code = await trio.to_thread.run_sync(
            lambda: run_scenarios([args.scenario], scale=args.scenario_scale, out=out), abandon_on_cancel=True
        )
    text = out.getvalue()
    assert code == 0, text
    assert "PASS config-invalid" in text
    assert "1 of 1 scenarios passed" in text


# ---- the checks on synthetic outcomes (pure) -------------------------------------------------------------


def _outcome(i: int, at: float, source: str, elapsed_ms: float = 5.0, lost: str | None = None) -> Outcome:
    return Outcome(
        i, started=at, ended=at + elapsed_ms / 1000.0, elapsed_ms=elapsed_ms, source=source, worker="w", lost=lost
    )


def _run(outcomes: list[Outcome], recovered_at: float | None) -> dict[str, bool]:
    scenario = next(s for s in SCENARIOS if s.name == "kvcm-garbled")  # must switch; breaker recovery limit
    ctx = ScenarioContext(SimCluster(2))
    checks = evaluate(scenario, ctx, outcomes, Timeline(0.0, 1.0, 2.0, recovered_at))
    return {c.name: c.ok for c in checks}


def _healthy() -> list[Outcome]:
    kvcm_before = [_outcome(i, i * 0.02, "kvcm") for i in range(50)]  # 0 .. 1 s
    fallback = [_outcome(50 + i, 1.0 + 0.02 * (i + 1), "shadow") for i in range(45)]  # during
    kvcm_after = [_outcome(100 + i, 2.0 + 0.02 * (i + 1), "kvcm") for i in range(20)]
    return kvcm_before + fallback + kvcm_after


def test_checks_pass_on_the_expected_pattern() -> None:
    assert _run(_healthy(), recovered_at=2.02) == {
        "answered": True,
        "deadline": True,
        "before": True,
        "switch": True,
        "recovery": True,
    }


def test_checks_fail_on_loss_lateness_no_switch_and_no_recovery() -> None:
    outcomes = _healthy()
    outcomes[3] = _outcome(3, 0.06, "", lost="no answer")
    assert _run(outcomes, 2.02)["answered"] is False
    outcomes = _healthy()
    outcomes[60] = _outcome(60, 1.2, "shadow", elapsed_ms=BUDGET_MS + 5.5)
    assert _run(outcomes, 2.02)["deadline"] is False
    outcomes = _healthy()
    outcomes[60] = _outcome(60, 1.2, "shadow", elapsed_ms=BUDGET_MS + 4.5)
    assert _run(outcomes, 2.02)["deadline"] is True
    no_switch = [_outcome(o.index, o.started, "kvcm") for o in _healthy()]
    assert _run(no_switch, 2.02)["switch"] is False
    unexpected = _healthy()
    unexpected[60] = _outcome(60, 1.2, "none")
    assert _run(unexpected, 2.02)["switch"] is False
    assert _run(_healthy(), recovered_at=None)["recovery"] is False
    assert _run(_healthy(), recovered_at=2.0 + 2.5)["recovery"] is False  # over the 2 s limit
    late_before = _healthy()
    for i in range(30, 50):
        late_before[i] = _outcome(i, i * 0.02, "domain")
    assert _run(late_before, 2.02)["before"] is False
