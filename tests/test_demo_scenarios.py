"""kvroute demo --scenario: the fault scenarios and their invariant checks.

The invariants themselves (no request lost, none past its deadline, which sources answer before,
during and after the fault, recovery within the stated limit) are asserted under a MockClock with
the simulators and the router on an in-memory network: there they hold to the millisecond whatever
the machine is doing. Over real loopback gRPC (real clock) the test only checks liveness — every
request gets a worker — because shares and milliseconds there depend on how busy the machine is.
The command (``kvroute demo --scenario all``) keeps its strict checks on the real clock.
"""

from __future__ import annotations

import gc
import io
from collections.abc import Iterator

import pytest
import trio
import trio.testing

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
from router.transport.memory_adapter import MemoryNetwork

# Over real gRPC: phases at 40 % (warm-up 0.4 s, fault 0.6 s), and a few scenarios that cover the
# peers gRPC must survive: a dead leader, a hanging KVCM, slow worker probes; and a scheduler that
# hangs over real HTTP.
REAL_CLOCK_SCALE = 0.4
REAL_CLOCK_SCENARIOS = ("leader-killed", "kvcm-blackhole", "workers-slow", "master-hang")


_MASTER_EXTRA_CHECKS = {
    "master-hang": {"hang cost"},
    "master-fallback": {"kvcm not asked"},
    "master-business-error": {"error code", "kvcm not asked"},
}


def _expected_checks(scenario: Scenario) -> set[str]:
    names = {"answered", "deadline"} | _MASTER_EXTRA_CHECKS.get(scenario.name, set())
    if scenario.kvcm_routed:
        names |= {"switch" if scenario.switches else "during", "recovery"}
        if not scenario.at_start:
            names.add("before")
        if scenario.heal_s is not None:
            names.add("heal")
    return names


@pytest.mark.parametrize("scenario", SCENARIOS, ids=SCENARIO_NAMES)
async def test_scenario_invariants_hold_under_the_mock_clock(
    scenario: Scenario, autojump_clock: trio.testing.MockClock
) -> None:
    """Full-length phases, no deadline slack: every answer within its deadline, exact shares."""
    with trio.fail_after(120):
        result = await run_scenario(scenario, scale=1.0, deadline_slack_ms=0.0, network=MemoryNetwork())
    report = "\n".join(check.line() for check in result.checks)
    assert result.passed, f"{result.name}:\n{report}"
    assert _expected_checks(scenario) <= {check.name for check in result.checks}, report
    assert result.requests > 0


@pytest.fixture
def quiet_heap() -> Iterator[None]:
    """Collect and freeze what earlier tests left on the heap, so a full GC pass over the whole
    suite's garbage does not stall a real-clock scenario for a whole phase."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("name", REAL_CLOCK_SCENARIOS)
@pytest.mark.usefixtures("quiet_heap")
async def test_scenario_over_real_grpc_answers_every_request(name: str) -> None:
    """Liveness only: no request lost (each answered with a worker, at most 1 s past its deadline)."""
    scenario = next(s for s in SCENARIOS if s.name == name)
    with trio.fail_after(30):
        result = await run_scenario(scenario, scale=REAL_CLOCK_SCALE)
    checks = {check.name: check for check in result.checks}
    assert result.requests > 0
    assert checks["answered"].ok, checks["answered"].line()


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
        "master-down",
        "master-hang",
        "master-fallback",
        "master-business-error",
        "master-flapping",
        "master-and-kvcm-down",
    )
    assert all(s.master and s.healthy_source == "master" for s in SCENARIOS if s.name.startswith("master-"))


def test_scenario_command_prints_each_result_and_exits_zero_when_all_pass() -> None:
    """The command's path (run_scenarios: one trio.run per scenario, printing), on the mock clock."""
    out = io.StringIO()
    names = ["config-invalid", "kvcm-garbled"]
    code = run_scenarios(
        names, scale=REAL_CLOCK_SCALE, out=out, clock=trio.testing.MockClock(autojump_threshold=0), in_memory=True
    )
    text = out.getvalue()
    assert code == 0, text
    assert "PASS config-invalid" in text
    assert "PASS kvcm-garbled" in text
    assert "2 of 2 scenarios passed" in text


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


def _master_run(name: str, outcomes: list[Outcome], kvcm_queries: tuple[int, int] = (0, 0)) -> dict[str, bool]:
    scenario = next(s for s in SCENARIOS if s.name == name)
    ctx = ScenarioContext(SimCluster(2))
    ctx.counts["kvcm_queries_at_injection"], ctx.counts["kvcm_queries_at_clear"] = kvcm_queries
    checks = evaluate(scenario, ctx, outcomes, Timeline(0.0, 1.0, 2.0, 2.02))
    return {c.name: c.ok for c in checks}


def _master_pattern(during: str, code: int = 0) -> list[Outcome]:
    before = [_outcome(i, i * 0.02, "master") for i in range(50)]
    fault = [_outcome(50 + i, 1.0 + 0.02 * (i + 1), during) for i in range(45)]
    for o in fault:
        o.error_code = code
        if code:
            o.worker = None
    after = [_outcome(100 + i, 2.0 + 0.02 * (i + 1), "master") for i in range(20)]
    return before + fault + after


def test_master_checks_read_master_as_healthy_and_the_named_sources_as_expected() -> None:
    assert all(_master_run("master-down", _master_pattern("kvcm")).values())
    assert _master_run("master-down", _master_pattern("domain"))["switch"] is False  # not the KVCM path
    kvcm_pattern = [_outcome(o.index, o.started, "kvcm") for o in _master_pattern("kvcm")]
    checks = _master_run("master-down", kvcm_pattern)
    assert checks["before"] is False  # KVCM before the fault: the master was not asked first


def test_master_fallback_and_business_error_fail_when_kvcm_was_asked() -> None:
    assert all(_master_run("master-fallback", _master_pattern("domain")).values())
    assert _master_run("master-fallback", _master_pattern("domain"), (3, 4))["kvcm not asked"] is False
    checks = _master_run("master-business-error", _master_pattern("none", code=8400))
    assert all(checks.values()), checks
    assert _master_run("master-business-error", _master_pattern("none", code=8503))["error code"] is False
    # Without the scheduler's code, an answer without a worker is a lost request.
    unexplained = _master_pattern("none", code=8400)
    unexplained[60].error_code = 0
    unexplained[60].lost = "answered without a worker: none"
    assert _master_run("master-business-error", unexplained)["answered"] is False
