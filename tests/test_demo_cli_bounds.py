"""``kvroute demo`` and ``kvroute sim-cluster`` refuse bad input in one line naming the flag (or the trace
file and line), exit 2, before anything runs: ranges, far arrivals, unreadable traces, flags that
need another one or that the chosen mode would ignore. Hermetic: nothing here serves or replays."""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvroute_sim.demo import cli as demo_cli
from kvroute_sim.demo import evidence_cli
from kvroute_sim.demo.ladder import DEFAULT_LOADS
from kvroute_sim.demo.lineup import LINEUP as POLICY_NAMES
from kvroute_sim.demo.trace import (
    SPEEDUP_RANGE,
    TraceFormatError,
    TraceGenSpec,
    TraceRecord,
    generate_trace,
    read_trace,
    trace_workload,
)
from kvroute_sim.demo.workload import (
    GROUP_STRIDE,
    MAX_ARRIVAL_S,
    MAX_THINK_TIME_S,
    RATE_PER_S_RANGE,
    WorkloadSpec,
    build_workload,
    zipf_weights,
)
from kvroute_sim.sim import cluster_cli
from kvroute_sim.sim.traffic import MAX_SYSTEM_PROMPT_TOKENS, TrafficSpec

GOOD_LINE = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [7]}'


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute demo")
    demo_cli.configure(parser)
    return parser


def _demo(argv: list[str]) -> int:
    return demo_cli.run(_parser().parse_args(argv))


def _refused_by_parser(parser: argparse.ArgumentParser, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


# ---- 1: arrival times: the flags' ranges, and a workload or trace arriving too late ------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "5e-324"], "argument --rate: must be in 0.001..1e+06, got 5e-324"),
        (["--rate", "1e-300"], "argument --rate: must be in 0.001..1e+06, got 1e-300"),
        (["--rate", "2e6"], "argument --rate: must be in 0.001..1e+06, got 2e6"),
        (["--think-time-s", "1e308"], "argument --think-time-s: must be > 0 and <= 3600, got 1e308"),
        (["--think-time-s", "0"], "argument --think-time-s: must be > 0 and <= 3600, got 0"),
        (["--trace-speedup", "1e-300"], "argument --trace-speedup: must be in 0.001..1e+06, got 1e-300"),
        (["--trace-speedup", "nan"], "argument --trace-speedup: must be in 0.001..1e+06, got nan"),
        (["--groups", "1" + "0" * 400], "argument --groups: too large, got 1" + "0" * 400),
    ],
)
def test_arrival_flags_have_ranges(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--rate 5e-324 crashed a worker (IndexError), 1e-300 printed server tracebacks, --think-time-s
    1e308 overflowed; an integer beyond float's range was an OverflowError traceback."""
    assert _refused_by_parser(_parser(), argv, capsys) == f"kvroute demo: error: {message}"


def test_the_ranges_are_the_specs_own() -> None:
    parser = _parser()
    low, high = RATE_PER_S_RANGE
    for rate in (low, high):
        assert demo_cli.specs_from_args(parser.parse_args(["--rate", str(rate)]))[0].rate_per_s == rate
    assert parser.parse_args(["--think-time-s", str(MAX_THINK_TIME_S)]).think_time_s == MAX_THINK_TIME_S
    with pytest.raises(ValueError, match="rate_per_s"):
        replace(WorkloadSpec(), rate_per_s=high * 2)
    with pytest.raises(ValueError, match="think_time_s"):
        replace(WorkloadSpec(), think_time_s=MAX_THINK_TIME_S * 2)
    assert parser.parse_args(["--trace-speedup", str(SPEEDUP_RANGE[1])]).trace_speedup == SPEEDUP_RANGE[1]


def test_a_workload_arriving_after_a_week_is_refused_naming_the_flag() -> None:
    tiny = WorkloadSpec(groups=1, system_prompt_tokens=1, question_tokens=1, output_tokens=0, block_size=1)
    slow = replace(tiny, prompts_per_group=1000, multi_turn_fraction=0.0, rate_per_s=RATE_PER_S_RANGE[0])
    with pytest.raises(ValueError, match=r"^--rate 0\.001: conversation \d+ of 1000 would start at .* a week"):
        build_workload(slow)
    thinking = replace(tiny, prompts_per_group=1, multi_turn_fraction=1.0, turns=1000, think_time_s=MAX_THINK_TIME_S)
    with pytest.raises(ValueError, match=r"^--think-time-s 3600: turn \d+ of conversation 1 would arrive"):
        build_workload(thinking)
    assert build_workload(replace(thinking, turns=100)).duration_s <= MAX_ARRIVAL_S


def test_the_demo_refuses_a_late_workload_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--groups", "1", "--prompts-per-group", "1000", "--system-prompt-tokens", "1", "--question-tokens", "1"]
    argv += ["--multi-turn-fraction", "0", "--rate", "0.001", "--no-master"]
    assert _demo([*argv, "--out", str(tmp_path), "--policies", "random"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvroute demo: error: --rate 0.001: conversation ")
    assert len(captured.err.splitlines()) == 1
    assert _demo([*argv, "--out", str(tmp_path), "--routers", "1"]) == 2  # the herding run too
    assert capsys.readouterr().err.startswith("kvroute demo: error: --rate 0.001: conversation ")


def test_a_trace_arriving_after_a_week_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    far = TraceRecord(1e300, 5, 1, (7,))
    with pytest.raises(ValueError, match=r"^t\.jsonl: the record at timestamp 1e\+300 ms .*--trace-speedup 1,"):
        trace_workload([far], source="t.jsonl")
    with pytest.raises(ValueError, match="--trace-speedup: must be in"):
        trace_workload([far], speedup=1e-300)
    path = tmp_path / "far.jsonl"
    path.write_text(json.dumps(far.to_json()) + "\n")
    assert _demo(["--trace", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute demo: error: {path}: the record at timestamp 1e+300 ms")
    assert "--trace-speedup" in err
    last = replace(far, timestamp_ms=MAX_ARRIVAL_S * 1000.0)
    assert trace_workload([last]).duration_s == MAX_ARRIVAL_S


def test_zipf_weights_of_a_steep_exponent_do_not_overflow() -> None:
    """--zipf-s 2000 raised OverflowError from 2 ** 2000."""
    assert zipf_weights(3, 2000.0) == (1.0, 0.0, 0.0)
    assert zipf_weights(3, 1.0) == tuple(w / (1 + 1 / 2 + 1 / 3) for w in (1.0, 1 / 2, 1 / 3))


# ---- 2: trace lines Python cannot read -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[" * 100_000, "JSON nested too deeply to read"),
        ('{"timestamp": ' + "1" * 5000 + "}", r"unreadable JSON \(Exceeds the limit \(4300 digits\)"),
        (GOOD_LINE.replace('"timestamp": 0', '"timestamp": ' + "1" * 400), "'timestamp' must be a number"),
        (GOOD_LINE.replace('"output_length": 1', '"output_length": ' + "1" * 400), "'output_length' must be <="),
    ],
)
def test_an_unreadable_trace_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    """A RecursionError traceback; a ValueError without the file and line; an OverflowError."""
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD_LINE + "\n\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=f"^bad.jsonl line 3: {message}"):
        read_trace(path)


def test_a_trace_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError, match=r"^bin\.jsonl line 2: not UTF-8 text$"):
        read_trace(path)
    assert len(read_trace(path, limit=1)) == 1


# ---- 3: a trace file that cannot be read names --trace and the file --------------------------------------


def test_a_trace_file_that_cannot_be_read_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path / "out")]
    missing = tmp_path / "missing.jsonl"
    assert _demo(["--trace", str(missing), *out]) == 2
    assert capsys.readouterr().err == f"kvroute demo: --trace {missing}: No such file or directory\n"
    assert _demo(["--trace", str(tmp_path), *out]) == 2
    assert capsys.readouterr().err == f"kvroute demo: --trace {tmp_path}: Is a directory\n"
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\n")
    assert _demo(["--trace", str(binary), *out]) == 2
    assert capsys.readouterr().err == f"kvroute demo: --trace {binary}: bin.jsonl line 1: not UTF-8 text\n"


# ---- 4: range errors name the flag, with the bound the spec declares -------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--multi-turn-fraction", "2"], "argument --multi-turn-fraction: must be in 0..1, got 2"),
        (["--multi-turn-fraction", "-0.5"], "argument --multi-turn-fraction: must be in 0..1, got -0.5"),
        (
            ["--system-prompt-tokens", "2000000"],
            f"argument --system-prompt-tokens: must be in 1..{GROUP_STRIDE}, got 2000000",
        ),
    ],
)
def test_demo_range_errors_name_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """They named the spec's field (multi_turn_fraction: must be in 0..1) after parsing."""
    assert _refused_by_parser(_parser(), argv, capsys) == f"kvroute demo: error: {message}"


def test_demo_accepts_the_bounds_the_spec_does() -> None:
    args = _parser().parse_args(["--system-prompt-tokens", str(GROUP_STRIDE), "--multi-turn-fraction", "1"])
    workload, _ = demo_cli.specs_from_args(args)
    assert (workload.system_prompt_tokens, workload.multi_turn_fraction) == (GROUP_STRIDE, 1.0)


def test_sim_cluster_prompt_tokens_range_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """It said ``system_prompt_tokens: must be <= 900000``."""
    parser = argparse.ArgumentParser(prog="kvroute sim-cluster")
    cluster_cli.configure(parser)
    message = _refused_by_parser(parser, ["--prompt-tokens", "2000000"], capsys)
    expected = f"argument --prompt-tokens: must be <= {MAX_SYSTEM_PROMPT_TOKENS}, got 2000000"
    assert message == f"kvroute sim-cluster: error: {expected}"
    args = parser.parse_args(["--prompt-tokens", str(MAX_SYSTEM_PROMPT_TOKENS)])
    assert cluster_cli.build_cluster(args)[1].system_prompt_tokens == MAX_SYSTEM_PROMPT_TOKENS
    with pytest.raises(ValueError, match="system_prompt_tokens"):
        TrafficSpec(system_prompt_tokens=MAX_SYSTEM_PROMPT_TOKENS + 1)


# ---- 5: flags that need another, and flags the chosen mode would ignore ----------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--trace T --groups 4", "argument --groups: not allowed with argument --trace"),
        ("--trace T --rate 50", "argument --rate: not allowed with argument --trace"),
        ("--trace T --block-size 16", "argument --block-size: not allowed with argument --trace"),
        ("--trace T --key-family vllm", "argument --key-family: not allowed with argument --trace"),
        ("--trace T --routers 1,2", "argument --trace: not allowed with argument --routers"),
        ("--ladder --routers 1,2", "argument --ladder: not allowed with argument --routers"),
        ("--routers 1,2 --policies random", "argument --policies: not allowed with argument --routers"),
        ("--target-load 0.5 --sim-workers 3", "argument --sim-workers: not allowed with argument --target-load"),
        ("--trace-speedup 2", "argument --trace-speedup: only applies with argument --trace"),
        ("--trace-speedup 1", "argument --trace-speedup: only applies with argument --trace"),
        ("--trace-limit 5", "argument --trace-limit: only applies with argument --trace"),
        ("--ladder-loads 30,50", "argument --ladder-loads: only applies with argument --ladder"),
        ("--trace T --slo-ms 100", "argument --slo-ms: only applies with argument --ladder"),
        ("--scenario-scale 0.4", "argument --scenario-scale: only applies with argument --scenario"),
        (
            "--trace-generate-sessions 5",
            "argument --trace-generate-sessions: only applies with argument --trace-generate",
        ),
        ("--scenario all --trace T", "argument --trace: not allowed with argument --scenario"),
        ("--scenario all --seed 3", "argument --seed: not allowed with argument --scenario"),
        ("--trace-generate G --ladder", "argument --ladder: not allowed with argument --trace-generate"),
        ("--trace-generate G --groups 4", "argument --groups: not allowed with argument --trace-generate"),
    ],
)
def test_conflicting_flags_are_refused_naming_both(
    argv: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were silently ignored: a --trace run with --groups replayed the trace all the same."""
    out = tmp_path / "out"
    args = shlex.split(argv.replace(" T", f" {tmp_path / 't.jsonl'}").replace(" G", f" {tmp_path / 'g.jsonl'}"))
    assert _demo([*args, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvroute demo: error: {message}\n"
    assert captured.out == "" and not out.exists() and not (tmp_path / "g.jsonl").exists()


@pytest.mark.parametrize(
    "argv",
    [
        # README.md and docs/design.md
        "",
        "--scenario kvcm-slow",
        "--scenario all --scenario-scale 0.4",
        "--scenario kvcm-slow-budget --router-setting budget_cap_ms=50",
        "--trace-generate trace0.jsonl --trace-generate-sessions 50 --seed 3",
        "--trace trace0.jsonl --ladder --no-chart",
        "--trace trace0.jsonl --ladder --policies sglang-cache-aware,oracle",
        "--ladder --no-master --policies sglang-cache-aware,oracle",
        "--ladder --ladder-loads 30,50,70,90,110 --slo-ms 200",
        "--routers 1,2,4",
        "--policies kvroute-cost-aware --no-master",
        "--router-setting score_unmatched=true",
        "--full-size",
        # what a trace or the load sizing does take
        "--trace t.jsonl --trace-speedup 4 --trace-limit 100 --seed 2 --sim-workers 3 --full-size",
        "--trace t.jsonl --target-load 0.7 --kv-capacity-blocks 100",
        "--routers 1,2 --groups 4 --sim-workers 2 --no-master --no-chart",
    ],
)
def test_documented_and_meaningful_combinations_are_not_refused(argv: str) -> None:
    assert demo_cli.flag_conflict(_parser().parse_args(shlex.split(argv))) is None


class _Stop(Exception):
    pass


def test_unset_flags_keep_their_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flags whose presence is checked default to None; where they are read, None is the old default."""
    assert demo_cli.selected_policies(_parser().parse_args([])) == POLICY_NAMES
    scales: list[float] = []

    def scenario(name: str, scale: float, overrides: object) -> int:
        scales.append(scale)
        return 0

    monkeypatch.setattr(demo_cli, "_scenario", scenario)
    assert _demo(["--scenario", "all"]) == 0 and scales == [1.0]
    generated = tmp_path / "g.jsonl"
    assert _demo(["--trace-generate", str(generated)]) == 0
    assert read_trace(generated) == generate_trace(TraceGenSpec())
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINE + "\n" + GOOD_LINE.replace('"timestamp": 0', '"timestamp": 500') + "\n")
    speedups: list[float] = []

    def workload(records: object, *, speedup: float, source: str, seed: int) -> object:
        speedups.append(speedup)
        raise ValueError("stop here")

    monkeypatch.setattr(evidence_cli, "trace_workload", workload)
    assert _demo(["--trace", str(trace), "--out", str(tmp_path / "out")]) == 2 and speedups == [1.0]
    monkeypatch.undo()
    ladders: list[tuple[object, object]] = []

    def ladder(workload: object, cluster: object, policies: object, *, loads: object, **_: object) -> object:
        ladders.append((policies, loads))
        raise _Stop  # before anything is written

    compared: list[object] = []

    def comparison(call: partial[object]) -> tuple[()]:
        compared.append(call.args[2])  # the policies
        return ()

    monkeypatch.setattr(evidence_cli, "trio", SimpleNamespace(run=comparison))  # no comparison
    monkeypatch.setattr(evidence_cli, "format_table", lambda summaries: "")
    monkeypatch.setattr(evidence_cli, "run_ladder", ladder)
    with pytest.raises(_Stop):
        _demo(["--trace", str(trace), "--ladder", "--out", str(tmp_path / "out")])
    assert compared == [POLICY_NAMES] and ladders == [(POLICY_NAMES, DEFAULT_LOADS)]
    capsys.readouterr()
