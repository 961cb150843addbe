"""``kvroute bench`` smoke test: a tiny configuration runs end to end and reports every figure.

It checks the shape of the table and of the JSON (rows, keys, verdict words, numbers
present), that the simulator child process is gone afterwards and that the CPU affinity
is given back — never the speed: targets are the benchmark's business, not CI's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import selectors
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import psutil
import pytest
import trio

from kvroute_sim.bench import callers, chart, cpus, decision_cpu, latency, overload, thread_cpu, throughput
from kvroute_sim.bench import cli as bench_cli
from kvroute_sim.bench import rate as p8_rate
from kvroute_sim.bench.cli import _router_setting, _selected, settings_problems
from kvroute_sim.bench.harness import ClusterShape, ClusterView, Outcomes, router_config
from kvroute_sim.bench.outage import NOT_DETECTED, P4_TARGET_ADDED_P99_MS, until_written_off
from kvroute_sim.bench.overload import EchoFloor, LateSplit, LevelResult
from kvroute_sim.bench.processes import _serve_command
from kvroute_sim.bench.rate import PathSegments, RateResult, breakdown, knee, knee_free_through, targets_met
from kvroute_sim.bench.raw_grpc import FloorSamples, RawClient, paced, slot_wait
from kvroute_sim.bench.results import BenchReport, Verdict
from kvroute_sim.bench.throughput import rounds_rate
from kvroute_sim.stats import shown_against
from router.cli import build_parser, main
from router.config import KvrouteConfig
from router.sidecar import CallTiming, SidecarStats
from router.types import RouteSource
from router.wire import kvcm_meta_pb2 as kvcm_pb
from router.wire.decode import COMPILED_KEYS_ENCODER

QUICK_FIGURES = "P1,P2,P3,P4,P5,P6,P7,P8,soak"
EXPECTED_ROWS = [
    "P1",
    "P6",
    "P2 warm",
    "P2 cold",
    "P3 gRPC",
    "P7",
    "P8",
    "P3 memory",
    "P4 query blackholed",
    "P4 KVCM blackholed",
    "P4 KVCM dead",
    "P5",
    "soak",
]
VERDICTS = {"met", "MISSED", "-"}


def _table_rows(stdout: str) -> list[list[str]]:
    """The cells of the main table's body rows (after the header and its rule)."""
    lines = stdout.split("\n\n", 1)[0].splitlines()
    assert lines[0].startswith("| figure") and set(lines[1]) <= {"|", "-"}
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_quick_bench_prints_one_row_per_figure_and_writes_them_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nested" / "bench.json"
    affinity = os.sched_getaffinity(0)

    assert main(["bench", "--quick", "--only", QUICK_FIGURES, "--out", str(out)]) == 0

    assert psutil.Process().children(recursive=True) == []  # the simulator child was stopped
    assert os.sched_getaffinity(0) == affinity  # the CPU pinning was undone
    # P7's load curve and P8's latency against rate, drawn beside the results.
    assert (tmp_path / "nested" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    document = json.loads(out.read_text(encoding="utf-8"))
    figures = document["figures"]
    assert [f["key"] for f in figures] == EXPECTED_ROWS
    for figure in figures:
        assert figure["verdict"] in VERDICTS, figure
        assert figure["measured"] and figure["result"] and figure["data"], figure
    by_key = {f["key"]: f for f in figures}
    # Numbers the table is built from are in the JSON, in range.
    assert 0 < by_key["P1"]["data"]["p50"] <= by_key["P1"]["data"]["p99"]
    assert by_key["P2 warm"]["data"]["ratio_p50"] > 0
    assert by_key["P2 warm"]["data"]["floor"]["pair_ms"]["n"] == by_key["P2 warm"]["data"]["route"]["n"]
    fanout = by_key["P2 cold"]["data"]["raw_fanout"]  # the raw client doing a cold route's RPCs
    assert fanout["probes"] >= 1 and fanout["ms"]["n"] == by_key["P2 cold"]["data"]["route"]["n"]
    assert by_key["P3 gRPC"]["data"]["raw_calls_per_s"] and by_key["P3 gRPC"]["data"]["decisions_per_s"] > 0
    # The same decisions through the sidecar kvroute serve runs: its process's CPU per decision.
    through_sidecar = by_key["P3 gRPC"]["data"]["sidecar"]
    assert 0 < through_sidecar["answered"] <= through_sidecar["calls"]
    assert through_sidecar["decisions_per_s"] > 0 and through_sidecar["process_cpu_ms_per_decision"] > 0
    assert "through the sidecar" in by_key["P3 gRPC"]["result"]
    # Whether the breaker opens within the quick run's few routes depends on the machine's load (a
    # query cut short by a busy loop is not judged); the MockClock tests pin that it opens. Here: the
    # row is honest about it.
    blackholed = by_key["P4 query blackholed"]
    if blackholed["data"]["detected_by"] != "breaker open":
        assert blackholed["verdict"] == "MISSED", blackholed
    else:  # judged on the added p99 alone
        met = blackholed["data"]["added_p99_ms"] <= P4_TARGET_ADDED_P99_MS
        assert blackholed["verdict"] == ("met" if met else "MISSED"), blackholed
    assert by_key["P5"]["data"]["hit_rate_of_max_hit"] > 0
    assert {p["policy"] for p in by_key["P5"]["data"]["policies"]} >= {"kvroute", "oracle", "least-loaded"}
    levels = by_key["P7"]["data"]["levels"]
    assert [lv["callers"] for lv in levels] == [1, 8, 64, 256]
    for level in levels:  # every call is either answered or counted unanswered, by status
        assert level["calls"] > 0 and level["answered_by_sidecar"] + level["no_answer"] >= level["calls"]
        assert level["no_answer"] == sum(level["errors"].values())
        # Ended unread: gRPC's deadline on the server side is never before the client's own.
        assert 0 <= level["reached_sidecar_past_deadline"] <= level["no_answer"]
        assert 0 <= level["client_gone"] <= level["answered_by_sidecar"]
        assert 0 <= level["within_deadline_plus_5ms"] <= 1 and 0 <= level["overloaded_share"] <= 1
        assert 0 <= level["kvcm_share"] <= 1
        if os.path.isdir("/proc/self/task"):  # where this process's CPU went, by thread role
            assert set(level["thread_cpu_us_per_call"]) == {"handlers", "trio loop", "grpcio", "other", "ended"}
    rates = by_key["P8"]["data"]["rates"]
    assert [r["rate"] for r in rates] == [50, 100, 200, 400, 500, 800]
    for r in rates:  # every call sent is answered by the sidecar or seen failing by the client
        assert r["sent"] > 0 and r["answered_by_sidecar"] + sum(r["errors"].values()) >= r["sent"]
        assert 0 <= r["fallback_share"] <= 1 and sum(r["outcomes"].values()) <= r["sent"]
        if r["answered_by_sidecar"]:  # where the time went: the router's share, the sidecar's own path
            assert r["router_p50_ms"] >= 0 and 0 <= r["own_path_p50_ms"] <= r["sidecar_p99_ms"]
        assert r["cpu_ms_per_call"] > 0
        # the plain client's floor beside it: one query per call sent, up to the quick cap
        assert r["floor_queries"] == min(r["sent"], 20)
        assert 0 < r["floor_query_p50_ms"] <= r["floor_query_p99_ms"]
        # and the relays: the rate's first calls, each answered by the relay or failed at the client
        for relay in (r["relay"], r["bridged"]):
            assert relay["sent"] == min(r["sent"], 20) and 0 <= relay["fallback_share"] <= 1
            assert relay["answered"] <= relay["sent"] and relay["cpu_ms_per_call"] > 0
            if relay["answered"]:
                assert 0 < relay["p50_ms"] <= relay["p99_ms"]
        if os.path.isdir("/proc/self/task"):  # where this process's CPU went, by thread role
            for run in (r, r["relay"], r["bridged"]):
                assert set(run["thread_cpu_us_per_call"]) == {"handlers", "trio loop", "grpcio", "other", "ended"}
    assert "plain client's KVCM query at this rate" in by_key["P8"]["result"]
    assert "a plain grpcio relay on this core" in by_key["P8"]["result"]
    assert "the same relay through the sidecar's hand-off to its trio thread" in by_key["P8"]["result"]
    for found in ("knee", "relay_knee", "bridged_knee"):
        assert by_key["P8"]["data"][found] in {None, 50, 100, 200, 400, 500, 800}
    soak = by_key["soak"]["data"]
    assert soak["requests"] == 2_000 and soak["warm_up"] == 1_000
    assert sum(soak["outcomes"].values()) == soak["requests"] - soak["warm_up"]
    assert soak["end"]["live_tasks"] > 0 and soak["end"]["open_fds"] > 0
    assert set(document["meta"]["seconds"]) >= {
        "P1/P6",
        "P2",
        "P3 gRPC",
        "P3 memory",
        "P4",
        "P5",
        "P7",
        "P8",
        "soak",
        "total",
    }

    printed = capsys.readouterr().out
    assert "chart of P7 and P8 written to" in printed
    rows = _table_rows(printed)
    assert [row[0] for row in rows] == EXPECTED_ROWS
    assert [row[4] for row in rows] == [f["verdict"] for f in figures]
    assert "P5 policy table (the demo's):" in printed
    assert "P7 load curve" in printed
    assert "P8 latency against offered rate" in printed
    assert "plain query p50/p99 ms" in printed


def test_a_soak_asked_for_beside_only_runs_with_its_figures() -> None:
    parser = argparse.ArgumentParser()
    bench_cli.configure(parser)
    assert _selected(parser.parse_args(["--only", "P1", "--soak", "5000"])) == {"P1", "soak"}
    assert _selected(parser.parse_args(["--only", "P1"])) == {"P1"}
    assert _selected(parser.parse_args(["--soak", "5000"])) == {"soak"}
    assert _selected(parser.parse_args([])) == set(bench_cli.FIGURES)


def test_soak_alone_runs_only_the_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    assert main(["bench", "--soak", "300", "--out", str(out)]) == 0
    document = json.loads(out.read_text(encoding="utf-8"))
    assert [f["key"] for f in document["figures"]] == ["soak"]
    data = document["figures"][0]["data"]
    assert (data["requests"], data["warm_up"]) == (300, 150)  # at most half of N warms up


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--only", "P1,P99"], "unknown figure 'P99'"),
        (["--soak", "0"], "must be >= 1, got 0"),
        (["--soak", "lots"], "'lots' is not an integer"),
    ],
)
def test_bad_flags_are_named(argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.parametrize(("out", "reason"), [("a-file/bench.json", "Not a directory"), (".", "Is a directory")])
def test_an_unusable_out_is_refused_before_measuring(
    out: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was found only when the results were written, after every figure, as a traceback."""
    (tmp_path / "a-file").write_text("")
    path = tmp_path / out
    assert main(["bench", "--soak", "50", "--out", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing measured, no table
    assert captured.err == f"kvroute bench: --out {path}: {reason}\n"


def test_the_out_check_leaves_no_file_behind_and_an_earlier_one_as_it_was(tmp_path: Path) -> None:
    fresh, earlier = tmp_path / "new" / "bench.json", tmp_path / "earlier.json"
    earlier.write_text("{}\n")
    BenchReport.ready(fresh)
    BenchReport.ready(earlier)
    assert fresh.parent.is_dir() and not fresh.exists()
    assert earlier.read_text() == "{}\n"


def test_p8_knee_is_where_p99_doubles_or_fallbacks_pass_two_percent() -> None:
    def at(rate: int, p99_ms: float, fallbacks: int = 0) -> RateResult:
        outcomes = Counter({"kvcm/CACHE_LEADER": 100 - fallbacks, "domain/deadline": fallbacks})
        return RateResult(rate, 100, 1.0, (1.0,) * 98 + (p99_ms,) * 2, (), Counter(), outcomes)

    assert knee([at(50, 3.0), at(100, 4.0), at(200, 5.9)]) is None
    assert knee([at(50, 3.0), at(100, 4.0), at(200, 6.0)]) == 200
    assert knee([at(50, 3.0), at(100, 3.0, fallbacks=3), at(200, 6.0)]) == 100
    assert knee([at(50, 3.0, fallbacks=2)]) is None


def test_p8_knee_target_is_met_only_where_its_own_rate_was_measured_knee_free() -> None:
    """A knee found at 800/s after 400/s lies anywhere in (400, 800]: "beyond 500/s" is not shown
    (such a run was counted met)."""

    def at(rate: int, p99_ms: float) -> RateResult:
        calls = 5 * rate
        tail = calls // 50  # the slowest 2 %: the p99
        outcomes = Counter({"kvcm/CACHE_LEADER": calls})
        return RateResult(rate, calls, 5.0, (1.5,) * (calls - tail) + (p99_ms,) * tail, (), Counter(), outcomes)

    skipped_500 = [at(50, 3.0), at(100, 3.0), at(200, 3.0), at(400, 5.9), at(800, 12.0)]
    assert knee(skipped_500) == 800 and knee_free_through(skipped_500) == 400
    assert not targets_met(skipped_500)
    measured_500 = [at(50, 3.0), at(100, 3.0), at(200, 3.0), at(400, 5.0), at(500, 5.9), at(800, 12.0)]
    assert knee_free_through(measured_500) == 500 and targets_met(measured_500)
    knee_at_500 = [at(50, 3.0), at(100, 3.0), at(200, 3.0), at(400, 5.0), at(500, 6.0), at(800, 12.0)]
    assert knee_free_through(knee_at_500) == 400 and not targets_met(knee_at_500)
    assert targets_met([at(r, 3.0) for r in (50, 100, 200, 400, 500, 800)])  # no knee at all


def test_p8_is_missed_when_a_call_at_the_target_rate_got_no_answer() -> None:
    """A call with no answer is in no latency sample: 9 of 500 failing at 100/s (under the knee's 2 %)
    would otherwise leave p50 and p99 taken over the answered calls alone, and the figure met."""

    def at(rate: int, failed: int = 0) -> RateResult:
        answered = 5 * rate - failed
        errors = Counter({"DEADLINE_EXCEEDED": failed}) if failed else Counter()
        outcomes = Counter({"kvcm/CACHE_LEADER": answered})
        return RateResult(rate, 5 * rate, 5.0, (1.5,) * answered, (2.0,) * answered, errors, outcomes)

    rates = (50, 100, 200, 400, 500, 800)
    assert targets_met([at(r) for r in rates])
    assert not targets_met([at(r, failed=9 if r == 100 else 0) for r in rates])


def test_an_open_loop_stalled_past_its_time_stops_and_counts_what_it_never_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stall guard compared the schedule, which never passes max_s, so a stalled client sent its
    backlog at once; stopping, the calls it never sent were neither answered nor errors, and P8's
    'every call answered' could not see them."""

    class Channel:
        def unary_unary(self, *args: object) -> Callable[..., Awaitable[bytes]]:
            async def call(request: bytes, timeout: float) -> bytes:  # noqa: ASYNC109 - grpc's own signature
                return b""

            return call

    # The client's clock, its sleeps and one stall of its process, on a clock of the test's own.
    now = [0.0]
    stalls = iter([0.05])  # the first sleep comes back 50 ms late: past the level's 30 ms
    pause = asyncio.sleep

    async def sleep_through_a_stall(seconds: float) -> None:
        now[0] += max(0.0, seconds) + next(stalls, 0.0)
        await pause(0)

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(asyncio, "sleep", sleep_through_a_stall)
    requests = tuple(b"r%d" % i for i in range(20))  # 20 ms of schedule at 1,000/s
    level = callers.Level("x", requests, 1, max_s=0.03, client_deadline_s=0.1, rate_per_s=1000)
    _, (seen,) = asyncio.run(callers._drive_open_loop(cast(Any, Channel()), level))
    # Call 0 at once, call 1 after the stalled sleep; then 51 ms have passed: the other 18 are not sent.
    assert len(seen.replies) == 2
    assert seen.errors == [callers.NOT_SENT] * 18


def test_a_closed_loop_past_its_time_says_how_many_calls_it_never_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A P7 level stops starting calls once max_level_s has passed; the calls it dropped were in neither
    the answered nor the unanswered, so a level cut short read as a whole one."""

    # Each call takes 0.3 s of a clock of the test's own: calls start at 0, 0.3, 0.6 and 0.9 s of a 1 s level.
    now = [0.0]

    class Channel:
        def unary_unary(self, *args: object) -> Callable[..., Awaitable[bytes]]:
            async def call(request: bytes, timeout: float) -> bytes:  # noqa: ASYNC109 - grpc's own signature
                now[0] += 0.3
                return b""

            return call

    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    requests = tuple(b"r%d" % i for i in range(10))
    level = callers.Level("x", requests, 2, max_s=1.0, client_deadline_s=0.1)
    _, seen, not_started = asyncio.run(callers.drive_level(cast(Any, Channel()), level))
    assert sum(len(r.replies) for r in seen) == 4 and not_started == 6
    _, _, none_left = asyncio.run(callers.drive_level(cast(Any, Channel()), replace(level, max_s=100.0)))
    assert none_left == 0

    echo = EchoFloor(calls=1, seconds=1.0, no_answer=0, client_p99_ms=1.0)
    cut_short = overload._level_result(2, 1.2, seen, [], 0.0, 0.0, echo, [], not_started=not_started)
    assert cut_short.to_json()["not_started"] == 6
    assert overload._curve([cut_short]).splitlines()[1].endswith("| cut short: 6")
    # Every call it made answered on time: whole, the level is met; cut short, it is not.
    on_time = [CallTiming(elapsed_s=0.001, allowed_s=0.030) for _ in range(4)]
    whole = overload._level_result(2, 1.2, seen, on_time, 0.0, 0.0, echo, [])
    assert whole.met
    assert not replace(whole, not_started=not_started).met


def test_p8_floor_calls_keep_the_open_loop_schedule_and_start_at_once_after_an_overrun() -> None:
    now = [100.0]
    started: list[float] = []
    slept: list[float] = []
    durations = [0.005, 0.025, 0.002, 0.002, 0.002]  # call 1 overruns its 10 ms slot by 20 ms

    def call(i: int) -> None:
        started.append(now[0] - 100.0)
        now[0] += durations[i]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    samples = paced(len(durations), 100.0, call, clock=lambda: now[0], sleep=sleep)

    # slots at 0, 10, 20, 30, 40 ms: calls 2 and 3 are late and start at once, call 4 waits for its slot
    assert started == pytest.approx([0.0, 0.010, 0.035, 0.037, 0.040])
    assert slept == pytest.approx([0.005, 0.001])  # only ahead of a slot, never a negative sleep
    assert samples == pytest.approx([5.0, 25.0, 2.0, 2.0, 2.0])  # each call's own time, not its lateness
    assert slot_wait(0.0, 3, 100.0, now=0.05) == 0.0
    assert slot_wait(0.0, 3, 100.0, now=0.01) == pytest.approx(0.02)


class _JumpingSelector(selectors.SelectSelector):
    """Never blocks: a wait for the loop's next timer moves the loop's clock on to it at once."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # nothing scheduled: every task waits on something that will never come
            raise RuntimeError("every task waits on something other than the clock")
        self._clock[0] += timeout
        return super().select(0)


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose time passes only while every task waits for it, and then at once (as trio's
    MockClock with autojump_threshold=0): what runs in it keeps its schedule however busy the machine."""

    def __init__(self) -> None:
        self._clock = [0.0]
        super().__init__(_JumpingSelector(self._clock))

    def time(self) -> float:
        return self._clock[0]


def test_an_open_loop_sends_each_call_on_its_schedule_while_the_earlier_ones_wait_for_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P8 offers a fixed rate: call i goes at start + i / rate whether or not earlier calls were answered.
    A loop that waited for each answer before the next send would offer a slow router less load."""
    sent: list[float] = []

    class Channel:
        def unary_unary(self, *args: object) -> Callable[..., Awaitable[bytes]]:
            async def call(request: bytes, timeout: float) -> bytes:  # noqa: ASYNC109 - grpc's own signature
                sent.append(time.perf_counter())
                await asyncio.sleep(0.05)  # each call is answered 50 ms after it was sent
                return b""

            return call

    loop = _VirtualTimeLoop()
    monkeypatch.setattr(time, "perf_counter", loop.time)  # the client's clock is the loop's
    requests = tuple(b"r%d" % i for i in range(10))
    level = callers.Level("x", requests, 1, max_s=1.0, client_deadline_s=0.1, rate_per_s=100)
    try:
        seconds, (seen,) = loop.run_until_complete(callers._drive_open_loop(cast(Any, Channel()), level))
    finally:
        loop.close()
    # 10 ms apart: calls 1 to 4 went while call 0 still waited for its answer at 50 ms.
    assert sent == pytest.approx([i / 100 for i in range(10)])
    assert seen.client_ms == pytest.approx([50.0] * 10) and seen.errors == []
    assert seconds == pytest.approx(0.14)  # the last sent at 90 ms, answered 50 ms later


class _TimingSidecar:
    """A sidecar as P7 and P8 use it: it times each call a fake client sends it (``_SendingClient``)."""

    def __init__(self) -> None:
        self.timings: list[CallTiming] = []

    def take_call_timings(self) -> list[CallTiming]:
        taken, self.timings = self.timings, []
        return taken

    def wait_idle(self, timeout_s: float) -> bool:
        return True

    def stats(self) -> SidecarStats:
        return SidecarStats(0, 0, 0, 0, 0, 0, 0)


class _SendingClient:
    """The callers' process: each call to the sidecar timed there (a warm-up call 1 s, any other 2 ms)
    at 1 ms of this process's CPU (``cpu``); a call to the echo server or the relay at 1 s of it,
    outside the sidecar's."""

    def __init__(self, sidecar: _TimingSidecar, cpu: list[float]) -> None:
        self._sidecar = sidecar
        self._cpu = cpu

    def run(self, level: callers.Level) -> callers.LevelRun:
        seen = callers.CallerResults()
        for request in level.requests:
            if level.target in {"echo", "relay", "bridged"}:
                self._cpu[0] += 1.0
            else:
                warm_up = b"warm" in request
                self._sidecar.timings.append(CallTiming(elapsed_s=1.0 if warm_up else 0.002, allowed_s=0.03))
                self._cpu[0] += 0.001
            seen.replies.append(b"")
            seen.client_ms.append(2.0)
        return callers.LevelRun(0.1, (seen,), 0.0)


def _fake_sidecar_run(monkeypatch: pytest.MonkeyPatch, module: object) -> tuple[_TimingSidecar, list[float]]:
    """``module``'s (P7's or P8's) sidecar, callers' process and requests replaced by fakes, this process's
    CPU by a counter of the test's own; the sidecar and the counter."""
    sidecar = _TimingSidecar()
    cpu = [0.0]

    @asynccontextmanager
    async def serving(view: object, label: str, warm_up: int) -> AsyncIterator[tuple[Any, str, KvrouteConfig]]:
        yield sidecar, "sidecar", KvrouteConfig()

    def requests(view: object, label: str, count: int, budget_ms: int = 30) -> tuple[bytes, ...]:
        return tuple(f"{label}-{i}".encode() for i in range(count))

    monkeypatch.setattr(module, "serving_sidecar", serving)
    monkeypatch.setattr(module, "caller_process", lambda cpus: nullcontext(_SendingClient(sidecar, cpu)))
    monkeypatch.setattr(module, "route_requests", requests)
    monkeypatch.setattr(time, "process_time", lambda: cpu[0])
    return sidecar, cpu


def test_p8_times_each_rate_by_its_own_calls_and_their_cpu_with_the_warm_up_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each rate's latencies are its own calls' (the warm-up's, slow as a cold router's, dropped before
    the first rate) and its CPU per call is this process's over its client's run (not over the floor's
    plain client run after it, nor over the relay floor's); the relay's calls are the rate's first
    ``floor_calls``, on its schedule, timed and charged by themselves, and it is stopped at the end;
    the bridged relay's likewise, after it."""
    _, cpu = _fake_sidecar_run(monkeypatch, p8_rate)

    class FloorClient:
        kvcm_target = "kvcm-leader"

        def warm_up(self, calls: int) -> None:
            cpu[0] += 1.0

        def paced_cache_queries(self, calls: int, rate_per_s: float) -> list[float]:
            cpu[0] += 1.0
            return [1.0] * calls

    class Relay:
        def __init__(self, target: str) -> None:
            self.target = target
            self.stopped = False

        def take_ms(self) -> list[float]:
            return [0.5] * 2  # the fake client's calls to the relay are not timed here: two per take

        def stop(self) -> None:
            self.stopped = True

    made: list[tuple[str, KvrouteConfig]] = []
    relays: list[Relay] = []

    def relay_floor(kvcm_target: str, config: KvrouteConfig) -> Relay:
        made.append((kvcm_target, config))
        relays.append(Relay("relay"))
        return relays[-1]

    def bridged_relay_floor(kvcm_target: str, config: KvrouteConfig, nursery: trio.Nursery) -> Relay:
        made.append((kvcm_target, config))
        relays.append(Relay("bridged"))
        return relays[-1]

    monkeypatch.setattr(p8_rate, "relay_floor", relay_floor)
    monkeypatch.setattr(p8_rate, "bridged_relay_floor", bridged_relay_floor)
    sizes = p8_rate.RateSizes(seconds_per_rate=0.02, warm_up=3, floor_calls=2)
    results = trio.run(p8_rate._run, cast(Any, None), cast(Any, FloorClient()), sizes, None)
    assert made == [("kvcm-leader", KvrouteConfig())] * 2  # the sidecar's configuration, for both relays
    assert [(relay.target, relay.stopped) for relay in relays] == [("relay", True), ("bridged", True)]
    assert [r.sent for r in results] == [1, 2, 4, 8, 10, 16]
    for result in results:
        assert result.sidecar_ms == pytest.approx((2.0,) * result.sent), result.rate
        assert result.cpu_ms_per_call == pytest.approx(1.0), result.rate
        assert result.relay is not None
        assert result.relay.sent == min(result.sent, 2), result.rate
        assert result.relay.cpu_ms_per_call == pytest.approx(1e3), result.rate  # 1 s per relayed call
        assert result.relay.fallback_share == 1.0  # the fake's empty replies are no KVCM answers
        assert result.bridged is not None and result.bridged.sent == result.relay.sent, result.rate
        assert result.bridged.cpu_ms_per_call == pytest.approx(1e3), result.rate


def test_p7_times_each_level_by_its_own_calls_and_their_cpu_with_the_warm_up_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As P8's: a level's timings are its own calls' (the warm-up's dropped before the first level) and
    its sidecar CPU is this process's over its callers' run, not over the echo server's after it."""
    _fake_sidecar_run(monkeypatch, overload)

    class EchoServer:
        def stop(self, grace: float | None) -> None:
            pass

    monkeypatch.setattr(overload, "_echo_server", lambda workers, limit: (EchoServer(), "echo"))
    monkeypatch.setattr(thread_cpu, "snapshot", dict)
    sizes = overload.LoadSizes(calls_per_level=(1, 2, 3, 4), max_level_s=1.0, warm_up=3)
    levels = trio.run(overload._run, cast(Any, None), sizes, None)
    assert [lv.calls for lv in levels] == [1, 2, 3, 4]
    for level in levels:
        assert [t.elapsed_s for t in level.timings] == [0.002] * level.calls, level.callers
        assert level.sidecar_cpu_ms_per_call == pytest.approx(1.0), level.callers


def test_p7_counts_a_call_on_time_within_its_deadline_plus_5_ms() -> None:
    late_by_4_ms = CallTiming(elapsed_s=0.034, allowed_s=0.030)
    late_by_6_ms = CallTiming(elapsed_s=0.036, allowed_s=0.030)
    level = LevelResult(
        callers=1,
        calls=2,
        seconds=1.0,
        client_ms=(35.0, 37.0),
        errors=Counter(),
        outcomes=Counter({"kvcm/CACHE_LEADER": 2}),
        timings=(late_by_4_ms, late_by_6_ms),
        sidecar_cpu_s=0.001,
        caller_cpu_s=0.001,
        echo=EchoFloor(calls=2, seconds=1.0, no_answer=0, client_p99_ms=1.0),
    )
    assert level.within_share == 0.5
    assert level.late_split.late == 1


def test_p3_gives_the_raw_clients_cpu_per_call_over_its_own_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw client's CPU per call beside the router's: its rounds' CPU over all their calls, not the
    router's windows between them nor its warm-up."""
    cpu = [0.0]
    monkeypatch.setattr(time, "process_time", lambda: cpu[0])

    class Raw:
        def warm_up(self, calls: int) -> None:
            cpu[0] += 1.0

        def concurrent_rate(self, calls: int, concurrency: int) -> float:
            cpu[0] += 0.0005 * calls
            return 1000.0

    async def router_rounds(
        view: object, rpc: object, sizes: throughput.ThroughputSizes, between_rounds: Callable[[], None], missed: object
    ) -> tuple[throughput._Run, None]:
        for _ in range(sizes.rounds):
            between_rounds()
            cpu[0] += 1.0  # the router's own window
        return throughput._Run(decisions=sizes.rounds * sizes.decisions_per_round, seconds=1.0), None

    async def sidecar_run(view: object, sizes: throughput.ThroughputSizes, cpus: object) -> throughput.SidecarRun:
        cpu[0] += 5.0  # the sidecar's pass, after the raw rounds
        return throughput.SidecarRun(calls=12, answered=10, seconds=0.5, cpu_s=0.03, kvcm_share=0.9)

    monkeypatch.setattr(throughput, "_router_run", router_rounds)
    monkeypatch.setattr(throughput, "_sidecar_run", sidecar_run)
    report = BenchReport(meta={})
    sizes = throughput.ThroughputSizes(rounds=3, decisions_per_round=4, concurrency=2, warm_up=5)
    throughput.measure_grpc(report, cast(Any, None), cast(Any, Raw()), sizes, None)
    (figure,) = report.figures
    assert figure.data["raw_process_cpu_ms_per_call"] == pytest.approx(0.5)
    # The sidecar's CPU per decision is over the calls it answered.
    assert figure.data["sidecar"] == {
        "calls": 12,
        "answered": 10,
        "decisions_per_s": pytest.approx(20.0),
        "process_cpu_ms_per_decision": pytest.approx(3.0),
        "kvcm_share": 0.9,
    }
    assert "through the sidecar 20 decisions/s, sidecar process CPU 3.000 ms/decision" in figure.result


def test_p8_floor_queries_go_through_the_seeded_prompts_in_turn() -> None:
    """The floor at each rate is the query a steady-state decision makes, over the same prompts in turn
    as the router's requests, not the first prompt's every time."""
    prompts = ((1, 2), (3, 4), (5, 6))
    sim = SimpleNamespace(view=SimpleNamespace(prompts=prompts), leader_target="127.0.0.1:1", workers=())
    raw = RawClient(cast(Any, sim))
    sent: list[bytes] = []
    try:
        raw._kvcm = cast(Any, lambda request, timeout: sent.append(request))
        raw.paced_cache_queries(5, 1e9)
    finally:
        raw.close()
    queried = [tuple(kvcm_pb.GetHostCacheStateRequest.FromString(request).block_cache_keys) for request in sent]
    assert queried == [prompts[0], prompts[1], prompts[2], prompts[0], prompts[1]]


def test_p8_breakdown_splits_each_call_into_the_routers_time_its_query_and_the_sidecars_own_path() -> None:
    routed = CallTiming(elapsed_s=0.010, allowed_s=0.03, router_s=0.007, query_s=0.004)
    shed = CallTiming(elapsed_s=0.001, allowed_s=0.03, router_s=0.0005)  # answered overloaded on the handler thread
    router_ms, query_ms, own_ms = breakdown([routed, shed])
    assert router_ms == pytest.approx((7.0, 0.5))
    assert query_ms == pytest.approx((4.0,))  # only the call that queried KVCM
    assert own_ms == pytest.approx((3.0, 0.5))
    result = RateResult(
        rate=100,
        sent=2,
        seconds=0.02,
        sidecar_ms=(10.0, 1.0),
        client_ms=(11.0, 2.0),
        errors=Counter(),
        outcomes=Counter({"kvcm/CACHE_LEADER": 1, "domain/overloaded": 1}),
        router_ms=router_ms,
        query_ms=query_ms,
        own_path_ms=own_ms,
        cpu_ms_per_call=5.0,
        floor_query_ms=(2.0, 3.0),
    ).to_json()
    assert result["kvcm_query_p50_ms"] == 4.0 and result["cpu_ms_per_call"] == 5.0
    assert result["floor_queries"] == 2 and result["floor_query_p50_ms"] == 2.0
    empty = RateResult(100, 1, 1.0, (), (), Counter(), Counter()).to_json()
    assert empty["router_p50_ms"] is None and empty["floor_query_p99_ms"] is None


def test_p8_path_segments_split_a_kvcm_call_along_its_path_and_leave_out_the_others() -> None:
    kvcm = CallTiming(
        elapsed_s=0.0020,
        allowed_s=0.03,
        router_s=0.0012,
        query_s=0.0008,
        handed_s=0.0002,
        way_back_s=0.0003,
        scoring_s=0.0001,
        route_source=RouteSource.KVCM,
    )
    shadow = CallTiming(
        elapsed_s=0.0010,
        allowed_s=0.03,
        router_s=0.0005,
        handed_s=0.0002,
        way_back_s=0.0002,
        route_source=RouteSource.SHADOW,
    )
    # A KVCM query cut short (it has a query stage), then the shadow's answer: not a KVCM call either.
    after_a_cut_query = replace(shadow, elapsed_s=0.050, router_s=0.048, query_s=0.045, scoring_s=0.001)
    shed = CallTiming(elapsed_s=0.0001, allowed_s=0.03, router_s=0.0001)  # answered overloaded at receipt
    segments = PathSegments.of([kvcm, shadow, after_a_cut_query, shed])
    assert segments.elapsed == pytest.approx((2.0,))  # only the call KVCM's source answered
    assert segments.to_trio == pytest.approx((0.2,))
    assert segments.task_start == pytest.approx((0.3,))  # 2.0 - 0.2 - 1.2 - 0.3
    assert segments.router_work == pytest.approx((0.4,))
    assert segments.scoring == pytest.approx((0.1,))
    assert segments.query == pytest.approx((0.8,))
    assert segments.way_back == pytest.approx((0.3,))
    parts = segments.to_trio[0] + segments.task_start[0] + segments.router_work[0] + segments.query[0]
    assert parts + segments.way_back[0] == pytest.approx(segments.elapsed[0])
    assert segments.p50s()["query"] == pytest.approx(0.8)
    assert PathSegments.of([shed]).p50s()["elapsed"] is None
    rate = RateResult(
        100,
        1,
        1.0,
        (2.0,),
        (),
        Counter(),
        Counter(),
        segments=segments,
        full_collection_s=(0.0123,),
        young_collection_s=((0.0004, 0.0011), (0.0042,)),
    )
    result = rate.to_json()
    segments_json = result["segments_p50_ms"]
    assert isinstance(segments_json, dict)
    assert segments_json["calls"] == 1
    assert result["full_collections_ms"] == [12.3]
    assert result["gen0_collections"] == {"count": 2, "total_ms": 1.5, "max_ms": 1.1}
    assert result["gen1_collections"] == {"count": 1, "total_ms": 4.2, "max_ms": 4.2}
    row = p8_rate._segments([rate]).splitlines()[1]
    assert row.endswith(" | 2 (1.1) / 1 (4.2) / 1 (12.3)")


def test_collections_are_timed_by_generation_while_the_block_runs() -> None:
    """The collector's own callbacks name the generation: each forced collection lands in its own."""
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection among the forced ones
    try:
        with overload.collections_timed() as pauses:
            gc.collect(0)
            gc.collect(1)
            gc.collect(1)
            gc.collect(2)
    finally:
        if was_enabled:
            gc.enable()
    assert (len(pauses.of(0)), len(pauses.of(1)), len(pauses.full)) == (1, 2, 1)
    assert all(seconds >= 0.0 for seconds in (*pauses.of(0), *pauses.of(1), *pauses.full))
    gc.collect(1)  # after the block: not counted
    assert len(pauses.of(1)) == 2


def test_p7_late_split_says_where_the_late_calls_spent_their_time() -> None:
    on_time = CallTiming(elapsed_s=0.020, allowed_s=0.030, router_s=0.015, handed_s=0.001, way_back_s=0.001)
    late_routed = CallTiming(elapsed_s=0.050, allowed_s=0.030, router_s=0.035, handed_s=0.010, way_back_s=0.004)
    late_shed = CallTiming(elapsed_s=0.040, allowed_s=0.030, router_s=0.040)  # answered overloaded at receipt
    split = LateSplit.of([on_time, late_routed, late_shed])
    assert (split.late, split.shed_at_receipt) == (2, 1)
    assert split.late_by_ms[1] == pytest.approx(20.0)
    assert split.to_trio_ms == pytest.approx((10.0, 10.0))  # only the call handed to the router
    assert split.router_ms == pytest.approx((35.0, 35.0))
    assert split.way_back_ms == pytest.approx((4.0, 4.0))
    assert LateSplit.of([on_time]).late == 0


def test_p7_counts_a_handed_call_with_no_reply_as_late_whatever_its_timing() -> None:
    """The sidecar gives up on a handed call at its client's deadline: its lateness from the routing
    deadline can be under the slack, yet it was never answered."""
    answered = CallTiming(elapsed_s=0.020, allowed_s=0.030, router_s=0.015, handed_s=0.001, way_back_s=0.001)
    given_up = CallTiming(elapsed_s=0.0300, allowed_s=0.0299, handed_s=0.002, answered=False)
    never_taken = CallTiming(elapsed_s=0.0300, allowed_s=0.0299, answered=False)  # the trio thread never took it
    split = LateSplit.of([answered, given_up, never_taken])
    assert (split.late, split.shed_at_receipt) == (2, 0)
    assert split.to_trio_ms == pytest.approx((2.0, 2.0))
    assert split.router_ms == (0.0, 0.0)  # no decision: nothing of the router's to show
    level = LevelResult(
        callers=8,
        calls=3,
        seconds=1.0,
        client_ms=(20.0,),
        errors=Counter({"DEADLINE_EXCEEDED": 2}),
        outcomes=Counter({"kvcm/CACHE_LEADER": 1}),
        timings=(answered, given_up, never_taken),
        sidecar_cpu_s=0.001,
        caller_cpu_s=0.001,
        echo=EchoFloor(calls=3, seconds=1.0, no_answer=0, client_p99_ms=1.0),
    )
    assert level.within_share == pytest.approx(1 / 3)
    assert (level.to_json()["answered_by_sidecar"], level.to_json()["unanswered_by_sidecar"]) == (1, 2)


def test_p8_breaks_down_only_the_answered_calls_but_times_every_call_the_sidecar_handed() -> None:
    answered = CallTiming(elapsed_s=0.002, allowed_s=0.030, router_s=0.0015, query_s=0.001)
    given_up = CallTiming(elapsed_s=0.080, allowed_s=0.030, answered=False)
    router_ms, query_ms, own_ms = breakdown([answered, given_up])
    assert router_ms == pytest.approx((1.5,)) and query_ms == pytest.approx((1.0,))
    assert own_ms == pytest.approx((0.5,))
    failed = Counter({"DEADLINE_EXCEEDED": 1})
    result = RateResult(100, 2, 1.0, (2.0, 80.0), (2.0,), failed, Counter(), unanswered_by_sidecar=1)
    assert result.p(99) == 80.0
    assert (result.to_json()["answered_by_sidecar"], result.to_json()["unanswered_by_sidecar"]) == (1, 1)


def test_p7_counts_the_calls_that_reached_the_sidecar_with_no_deadline_left() -> None:
    on_time = CallTiming(elapsed_s=0.001, allowed_s=0.030, client_left_s=0.1)
    # Its budget spent waiting for a handler thread, with the client still waiting: answered in time
    # for it, not a call that reached the sidecar too late (counted as one once the wait was taken off).
    budget_spent = CallTiming(elapsed_s=0.0001, allowed_s=0.0, client_left_s=0.05)
    level = LevelResult(
        callers=256,
        calls=4,
        seconds=1.0,
        client_ms=(5.0,),
        errors=Counter({"DEADLINE_EXCEEDED": 2}),
        outcomes=Counter({"domain/overloaded": 1}),
        timings=(on_time, budget_spent),
        sidecar_cpu_s=0.001,
        caller_cpu_s=0.001,
        echo=EchoFloor(calls=4, seconds=1.0, no_answer=0, client_p99_ms=1.0),
        expired_at_receipt=1,  # the client had given up: ended unread, not timed
    )
    assert level.to_json()["reached_sidecar_past_deadline"] == 1
    # The queueing P7's on-time share leaves out, counted beside it: the call whose client still waited.
    assert level.budget_gone == 1 and level.to_json()["reached_sidecar_with_budget_gone"] == 1
    assert level.within_share == 1.0  # each timed call answered at once from its receipt


def test_p9_passes_the_router_settings_to_kvroute_serve_and_keeps_its_own_flags() -> None:
    """P9 runs ``kvroute serve`` itself: a --router-setting the other figures' routers took was once not
    passed to it, so a comparison of two settings compared two identical P9 runs."""
    settings = tuple(_router_setting(t) for t in ("budget_cap_ms=7", "kvcm_fallback=false", "grpc_max_workers=8"))
    view = ClusterView("127.0.0.1:1", "127.0.0.1:2", 16, (), settings)
    command = _serve_command(view, 2)
    assert command[4] == "serve"
    parsed = vars(build_parser("serve").parse_args(command[4:]))
    assert (parsed["budget_cap_ms"], parsed["kvcm_fallback"]) == ("7.0", "false")
    # The figure's own flags come last and win: the processes compared, the threads it sizes.
    assert (parsed["processes"], parsed["grpc_max_workers"]) == ("2", "64")


def test_a_router_setting_reaches_every_view_the_bench_builds_and_their_routers_configs() -> None:
    setting = _router_setting("slot-waiters=16")
    assert setting == ("slot_waiters", 16)
    _cluster, _network, view = ClusterShape(router_settings=(setting,)).in_memory()
    assert view.router_settings == (setting,)
    config = router_config(view, status_ttl_s=None)
    assert config.serve.slot_waiters == 16
    assert config.discovery.kvcm_bootstrap == view.kvcm_bootstrap  # the rest as before
    plain = router_config(ClusterShape().in_memory()[2], status_ttl_s=None)
    assert plain.serve.slot_waiters == 0


def test_a_bad_router_setting_is_refused_naming_it() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="nosuch=1"):
        _router_setting("nosuch=1")
    with pytest.raises(argparse.ArgumentTypeError, match="slot_waiters: expected an integer"):
        _router_setting("slot_waiters=many")
    assert settings_problems(()) == []
    problems = settings_problems((("slot_waiters", 64),))
    assert len(problems) == 1 and "--slot-waiters" in problems[0] and "handler threads" in problems[0]
    assert main(["bench", "--only", "P7", "--router-setting", "grpc_max_workers=0"]) == 2


def test_thread_cpu_splits_each_threads_time_by_the_first_role_its_name_starts_with() -> None:
    T = thread_cpu.ThreadTime
    before = {1: T("kvroute-sidecar_0", 1.0, 10), 2: T("MainThread", 5.0, 1), 3: T("Thread-7 (_serve)", 0.5, 20)}
    after = {
        1: T("kvroute-sidecar_0", 1.25, 10),
        2: T("MainThread", 5.5, 1),
        3: T("Thread-7 (_serve)", 0.75, 20),
        4: T("event_engine", 0.125, 30),  # started meanwhile: counted from zero
        5: T("Trio thread 3", 0.0625, 40),
    }
    roles = (("handlers", "kvroute-sidecar"), ("trio loop", "MainThread"), ("grpcio", "Thread-"), ("grpcio", "event_"))
    # The process used 1.5 s: what the threads seen at the end account for is 1.1875 s, and the rest
    # was used by threads that ended in between (grpcio's client spin threads).
    assert thread_cpu.split(before, after, roles, process_s=1.5) == {
        "handlers": 0.25,
        "trio loop": 0.5,
        "grpcio": 0.375,
        "other": 0.0625,
        thread_cpu.ENDED: 0.3125,
    }
    # Per-thread ticks rounding above the process's time: nothing ended, never negative.
    assert thread_cpu.split(before, after, roles, process_s=1.0)[thread_cpu.ENDED] == 0.0
    # A thread id reused by a new thread (started later) counts from zero, never negative.
    reused = thread_cpu.split({1: T("old", 9.0, 5)}, {1: T("kvroute-sidecar_1", 0.5, 50)}, roles, process_s=0.5)
    assert reused["handlers"] == 0.5
    # A thread renamed meanwhile (trio's worker threads take each job's name) is the same thread: only
    # what it used in between counts, under the name it has now.
    renamed = thread_cpu.split(
        {6: T("Trio thread 0", 3.0, 7)}, {6: T("kvroute-sidecar_2", 3.5, 7)}, roles, process_s=0.5
    )
    assert renamed["handlers"] == 0.5 and renamed["other"] == 0.0
    # Off Linux no thread is seen: no split at all, not the process's time as "ended".
    assert thread_cpu.split({}, {}, roles, process_s=2.0) == {}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread CPU is read from Linux's /proc")
def test_thread_cpu_snapshot_names_this_processs_threads_as_python_knows_them() -> None:
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: stop.wait(10.0), name="test-thread-cpu")
    spinner.start()
    try:
        names = {t.name for t in thread_cpu.snapshot().values()}
    finally:
        stop.set()
        spinner.join()
    assert {"MainThread", "test-thread-cpu"} <= names
    assert all(t.cpu_s >= 0.0 for t in thread_cpu.snapshot().values())
    # The main thread's own time: some (it imported and collected), and within the process's.
    (main_thread,) = [t for t in thread_cpu.snapshot().values() if t.name == "MainThread"]
    assert 0.0 < main_thread.cpu_s <= time.process_time() + 0.02  # a tick's rounding


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread CPU is read from Linux's /proc")
def test_thread_cpu_knows_a_renamed_thread_by_its_start_time() -> None:
    """A thread that takes another name between two snapshots (as trio's worker threads do per job) keeps
    its id and its start time, which is no earlier than the main thread's."""
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: stop.wait(10.0), name="test-before-job")
    spinner.start()
    try:
        before = thread_cpu.snapshot()
        spinner.name = "test-in-a-job"
        after = thread_cpu.snapshot()
    finally:
        stop.set()
        spinner.join()
    assert spinner.native_id is not None
    then, now = before[spinner.native_id], after[spinner.native_id]
    assert (then.name, now.name) == ("test-before-job", "test-in-a-job")
    assert then.started == now.started > 0
    main_id = threading.main_thread().native_id
    assert main_id is not None and 0 < after[main_id].started <= now.started


def test_a_printed_figure_equal_to_its_target_has_met_it() -> None:
    """Rounded to its target's precision a figure could print as the target beside MISSED (98.97 % as
    "99.0 % on time", a 2.004 ms p50 as "2.00 ms"): it is rounded toward the side it misses on."""
    assert shown_against(98.967, 1, at_least=True) == 98.9
    assert shown_against(99.0, 1, at_least=True) == 99.0
    assert shown_against(2.004, 2, at_least=False) == 2.01
    assert shown_against(2.0, 2, at_least=False) == 2.0
    assert shown_against(1.53, 2, at_least=False) == 1.53


def test_figures_round_their_result_toward_a_miss_and_need_the_kvcm_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """P1 printed 'p50 100.0 µs' beside MISSED for a 100.04 µs p50; and P2 and P3 judged every decision
    whatever its route, so with the KVCM fallback off (no remote call at all) P2 cold was met at 0.06×
    a floor made of the very calls it did not make."""

    def crafted(cases: Iterable[decision_cpu.Case], repeats: int) -> None:
        for case in cases:
            if not case.samples:
                case.samples[:] = [100.04] * 10

    monkeypatch.setattr(decision_cpu, "run_interleaved", crafted)
    report = BenchReport(meta={})
    decision_cpu.measure(report, p1=True, p6=False, repeats=1, seed=0)
    (p1,) = report.figures
    assert p1.verdict is Verdict.MISSED and p1.result.startswith("p50 100.1 µs")

    async def routes(*args: object) -> object:
        floor = FloorSamples([0.5] * 10, [0.5] * 10)
        via = {"warm": Counter({"kvcm/ok": 10}), "cold": Counter({"domain/feature_off": 10})}
        rows = {name: latency._Row([0.9] * 10, Outcomes(outcomes)) for name, outcomes in via.items()}
        return floor, latency._Fanout(4, [2.0] * 10), rows, {}

    monkeypatch.setattr(latency, "_measure", routes)
    report = BenchReport(meta={})
    latency.measure(report, cast(Any, None), cast(Any, None), cast(Any, None))
    verdicts = {figure.key: figure for figure in report.figures}
    assert verdicts["P2 warm"].verdict is Verdict.MET  # 0.90× its floor, every decision via kvcm
    assert verdicts["P2 cold"].verdict is Verdict.MISSED
    assert "not the route the target is about" in verdicts["P2 cold"].result


def test_the_results_file_is_strict_json_with_undefined_figures_as_null(tmp_path: Path) -> None:
    """A rate or level with no answered call has no percentile (NaN, or inf for a missing rate):
    written as such, the file was not JSON a strict parser reads."""
    report = BenchReport(meta={"empty": float("nan")})
    report.notes.append("n")
    report.tables["t"] = "x"
    report.meta["levels"] = [{"p99_lateness_ms": float("nan"), "sidecar_p50_ms": float("inf"), "n": 3}]
    path = tmp_path / "results.json"
    report.write(path)

    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    written = json.loads(path.read_text(), parse_constant=refuse)
    assert written["meta"] == {"empty": None, "levels": [{"p99_lateness_ms": None, "sidecar_p50_ms": None, "n": 3}]}


def test_the_raw_clients_rate_over_rounds_is_taken_as_the_routers_is() -> None:
    """Rounds of 3,000 calls each at 4,000, 2,000 and 3,000 calls/s took 0.75 + 1.5 + 1.0 s: 9,000 calls
    in 3.25 s. The plain mean (3,000/s) beat a router with the very same rounds, timed whole, by 8 %."""
    assert rounds_rate([4000.0, 2000.0, 3000.0]) == pytest.approx(9000 / 3.25)
    assert rounds_rate([2500.0, 2500.0]) == pytest.approx(2500.0)


@pytest.mark.parametrize(
    ("written_off_after", "routes", "detected"),
    [(5, 5, "breaker open"), (2, 2, "breaker open"), (None, 5, NOT_DETECTED)],
)
def test_p4_counts_kvcm_written_off_by_the_last_route_it_allows(
    written_off_after: int | None, routes: int, detected: str
) -> None:
    """With as many detection routes allowed as the breaker needs failures, the last one opens it: that
    was recorded as never detected, which misses the judged figure."""
    routed: list[float] = []

    async def route_once() -> float:
        routed.append(float(len(routed) + 1))
        return routed[-1]

    def written_off() -> str | None:
        return "breaker open" if written_off_after is not None and len(routed) >= written_off_after else None

    result = trio.run(until_written_off, route_once, written_off, 5)
    assert result == ([float(n) for n in range(1, routes + 1)], detected)


def test_the_chart_draws_what_the_saved_results_hold_and_nothing_without_p7_or_p8(tmp_path: Path) -> None:
    """Drawn from the JSON the bench wrote (a figure without a sample is null there), one panel each."""
    level = {"callers": 8, "within_deadline_plus_5ms": 1.0, "kvcm_share": 1.0, "overloaded_share": 0.0}
    levels = [
        {**level, "p99_lateness_ms": None, "no_answer": 0},
        {**level, "callers": 64, "p99_lateness_ms": 3.0, "no_answer": 2},
    ]
    rate = {"rate": 50, "sidecar_p50_ms": 2.0, "sidecar_p99_ms": 4.0, "floor_query_p50_ms": 1.0, "fallback_share": 0.0}
    rates = [rate, {**rate, "rate": 800, "sidecar_p99_ms": None}]
    report = {
        "figures": [
            {"key": "P7", "data": {"budget_ms": 30, "late_slack_ms": 5, "levels": levels}},
            {"key": "P8", "data": {"budget_ms": 30, "knee": 800, "rates": rates}},
        ]
    }
    results = tmp_path / "bench.json"
    path = chart.draw(report, chart.chart_path(results))
    assert path == tmp_path / "bench.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert chart.draw({"figures": [{"key": "P1", "data": {}}]}, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_the_chart_goes_beside_the_results_never_over_them() -> None:
    """A review: ``--out bench.png`` had its results replaced by the chart, and ``results.v1`` and
    ``results.v2`` shared one."""
    assert chart.chart_path(Path("out/bench-results.json")) == Path("out/bench-results.png")
    assert chart.chart_path(Path("bench.png")) == Path("bench.png.png")
    assert chart.chart_path(Path("results.v1")) != chart.chart_path(Path("results.v2"))
    assert chart.chart_path(Path("results")) == Path("results.png")


def test_a_chart_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "bench.png").mkdir()  # where the chart of bench.json would go
    assert main(["bench", "--quick", "--only", "P1", "--out", str(tmp_path / "bench.json")]) == 2
    assert not (tmp_path / "bench.json").exists()  # refused before measuring, nothing written
    # Results to a device (not a regular file) get no chart beside them, and no error.
    assert main(["bench", "--quick", "--only", "P1", "--out", os.devnull]) == 0


def test_the_results_say_which_encoder_encoded_the_block_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--only", "P1", "--no-chart", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["compiled_keys_encoder"] is COMPILED_KEYS_ENCODER
    said = "compiled (router.wire._packed)" if COMPILED_KEYS_ENCODER else "protobuf (no compiled encoder)"
    assert f"block keys encoded by {said}" in capsys.readouterr().out


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_keep_cpus_awake_runs_a_spinner_per_cpu_for_the_run_and_records_it(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    spinning: list[int] = []
    real_measure = bench_cli._measure

    def measure_and_count(*args: Any) -> None:
        spinning.append(len(_idle_spinners()))
        real_measure(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_cli, "_measure", measure_and_count)
        assert main(["bench", "--quick", "--only", "P1", "--no-chart", "--keep-cpus-awake", "--out", str(out)]) == 0
    allowed = sorted(os.sched_getaffinity(0))
    assert spinning == [len(allowed)]  # one a CPU while the figures ran
    meta = json.loads(out.read_text())["meta"]
    assert meta["cpus_kept_awake"] == allowed
    assert _idle_spinners() == []  # and none after
    assert main(["bench", "--quick", "--only", "P1", "--no-chart", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["cpus_kept_awake"] == []


def test_keep_cpus_awake_that_cannot_start_is_refused_naming_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    @contextlib.contextmanager
    def cannot() -> Iterator[list[int]]:
        raise cpus.KeepAwakeError("a spinner ended at once: no such CPU")
        yield []

    monkeypatch.setattr(bench_cli, "cpus_kept_awake", cannot)
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--only", "P1", "--keep-cpus-awake", "--out", str(out)]) == 2
    assert "kvroute bench: --keep-cpus-awake: a spinner ended at once: no such CPU" in capsys.readouterr().err
    assert not out.exists()


def _idle_spinners() -> list[int]:
    """The processes running at SCHED_IDLE that are this process's children."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if os.sched_getscheduler(child.pid) == os.SCHED_IDLE:
                found.append(child.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def test_no_chart_skips_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--only", "P1", "--no-chart", "--out", str(out)]) == 0
    assert out.exists() and not (tmp_path / "bench.png").exists()
    assert "chart of P7 and P8" not in capsys.readouterr().out
