"""kvroute demo: workload shape and reproducibility, baseline policies, figures, a tiny end-to-end run.

The end-to-end tests use real loopback gRPC (SimCluster.serve_grpc + the real router) with the
real clock, each bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import trio

from kvroute_sim.demo import cli as demo_cli
from kvroute_sim.demo.baselines import (
    BASELINE_NAMES,
    LeastLoadedBaseline,
    MaxHitBaseline,
    MaxLocalAffinityBaseline,
    RandomBaseline,
    RoundRobinBaseline,
)
from kvroute_sim.demo.lineup import LINEUP as POLICY_NAMES
from kvroute_sim.demo.report import (
    CHART_FILE,
    RESULTS_FILE,
    PolicySummary,
    check_targets,
    format_table,
    spread,
    summarize,
)
from kvroute_sim.demo.runner import ClusterSpec, PolicyRun, RequestRecord, run_baseline
from kvroute_sim.demo.workload import (
    GROUP_STRIDE,
    DemoRequest,
    WorkloadSpec,
    build_workload,
    system_prompt,
    zipf_weights,
)
from kvroute_sim.stats import percentile
from router.keys import block_keys
from router.types import HostMatch

SMALL = WorkloadSpec(
    groups=8,
    prompts_per_group=50,
    system_prompt_tokens=256,
    question_tokens=32,
    output_tokens=64,
    multi_turn_fraction=0.5,
    turns=3,
    rate_per_s=100.0,
    seed=7,
)


# ---- workload -----------------------------------------------------------------------------------------


def test_workload_is_reproducible_for_a_seed() -> None:
    first, again = build_workload(SMALL), build_workload(SMALL)
    assert first == again
    other = build_workload(replace(SMALL, seed=8))
    assert [r.arrival_s for r in other.requests] != [r.arrival_s for r in first.requests]
    assert [r.group for r in other.requests] != [r.group for r in first.requests]


def test_workload_shape_prompts_and_keys() -> None:
    workload = build_workload(SMALL)
    requests = workload.requests
    first_turns = [r for r in requests if r.turn == 0]
    assert len(first_turns) == SMALL.conversations
    assert len({r.request_id for r in requests}) == len(requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    for r in first_turns:
        assert r.tokens[: SMALL.system_prompt_tokens] == tuple(system_prompt(r.group, SMALL.system_prompt_tokens))
        assert r.input_tokens == SMALL.system_prompt_tokens + SMALL.question_tokens
    for r in requests:
        assert r.keys == block_keys(r.tokens, SMALL.block_size, SMALL.key_family)
        assert max(r.tokens) < 2**31
    # Questions and answers are fresh: nothing but system prompts is shared between sessions.
    by_session: dict[int, list[int]] = {}
    for r in requests:
        by_session.setdefault(r.session, []).extend(r.tokens[SMALL.system_prompt_tokens :])
    fresh = Counter(t for tokens in by_session.values() for t in set(tokens))
    assert all(t >= SMALL.groups * GROUP_STRIDE for t in fresh)
    assert max(fresh.values()) == 1


def test_multi_turn_sessions_extend_earlier_prompts() -> None:
    sessions: dict[int, list[DemoRequest]] = {}
    for r in build_workload(SMALL).requests:
        sessions.setdefault(r.session, []).append(r)
    multi = [turns for turns in sessions.values() if len(turns) > 1]
    assert {len(turns) for turns in sessions.values()} == {1, SMALL.turns}
    # About multi_turn_fraction of the conversations (400 of them): both bounds.
    assert 0.4 * len(sessions) <= len(multi) <= 0.6 * len(sessions)
    for turns in multi:
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(SMALL.turns))
        for earlier, later in itertools.pairwise(turns):
            assert later.arrival_s > earlier.arrival_s
            assert later.tokens[: earlier.input_tokens] == earlier.tokens
            assert later.input_tokens == earlier.input_tokens + SMALL.output_tokens + SMALL.question_tokens
            assert later.keys[: len(earlier.keys)] == earlier.keys
            assert later.group == earlier.group


def test_group_popularity_follows_zipf() -> None:
    spec = replace(SMALL, prompts_per_group=500, multi_turn_fraction=0.0)  # 4,000 conversations
    weights = zipf_weights(spec.groups, spec.zipf_s)
    counts = Counter(r.group for r in build_workload(spec).requests)
    total = sum(counts.values())
    for group, weight in enumerate(weights):
        assert abs(counts[group] / total - weight) < 0.03, (group, counts[group] / total, weight)
    assert counts[0] > 5 * counts[spec.groups - 1]  # skewed: 1/1 vs 1/8
    assert zipf_weights(4, 0.0) == (0.25, 0.25, 0.25, 0.25)
    assert math.isclose(sum(weights), 1.0)


def test_arrivals_run_at_the_configured_rate() -> None:
    spec = replace(SMALL, prompts_per_group=250, multi_turn_fraction=0.0, rate_per_s=40.0)
    workload = build_workload(spec)
    rate = len(workload.requests) / workload.duration_s
    assert 36.0 <= rate <= 44.0
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(workload.requests)]
    mean = sum(gaps) / len(gaps)
    # Exponential gaps: the standard deviation is about the mean (a fixed-rate clock would give 0).
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert 0.85 * mean <= sd <= 1.15 * mean


def test_full_size_is_the_benchmark_shape() -> None:
    full = WorkloadSpec.full_size()
    assert (full.groups, full.prompts_per_group, full.system_prompt_tokens) == (64, 16, 2048)
    assert (full.question_tokens, full.output_tokens) == (128, 256)


@pytest.mark.parametrize(
    ("field", "value"),
    [("groups", 0), ("turns", 0), ("rate_per_s", 0.0), ("multi_turn_fraction", 1.5), ("zipf_s", -1.0)],
)
def test_bad_workload_parameters_name_the_field(field: str, value: float) -> None:
    changes: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=field):
        replace(SMALL, **changes)


# ---- baseline policies (pure) --------------------------------------------------------------------------


@dataclass
class StaticView:
    """A cluster view with fixed answers: the baselines see nothing else."""

    hosts: Sequence[str]
    loads: Sequence[int]
    cached: Sequence[int]  # each worker's cached prefix of any request, in blocks

    def outstanding_tokens(self, worker: int) -> int:
        return self.loads[worker]

    def cached_blocks(self, worker: int, keys: Sequence[int]) -> int:
        return self.cached[worker]

    def kvcm_matches(self, keys: Sequence[int]) -> Sequence[HostMatch]:
        return [HostMatch(h, c) for h, c in zip(self.hosts, self.cached, strict=True) if c > 0]


HOSTS = ("10.0.0.3:8000", "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.4:8000")
KEYS = (1, 2, 3)


def test_random_and_round_robin() -> None:
    view = StaticView(HOSTS, [0, 0, 0, 0], [0, 0, 0, 0])
    picks = [RandomBaseline(1).choose(KEYS, view) for _ in range(3)]
    assert picks == [RandomBaseline(1).choose(KEYS, view) for _ in range(3)]  # seeded
    policy = RandomBaseline(2)
    assert set(Counter(policy.choose(KEYS, view) for _ in range(400))) == {0, 1, 2, 3}
    rr = RoundRobinBaseline()
    assert [rr.choose(KEYS, view) for _ in range(6)] == [0, 1, 2, 3, 0, 1]


def test_least_loaded_takes_the_least_work_and_spreads_exact_ties() -> None:
    policy = LeastLoadedBaseline(0)
    assert policy.choose(KEYS, StaticView(HOSTS, [500, 20, 300, 21], [9, 0, 0, 0])) == 1
    tied = StaticView(HOSTS, [10, 5, 7, 5], [0, 0, 0, 0])
    assert set(Counter(policy.choose(KEYS, tied) for _ in range(200))) == {1, 3}


def test_max_local_affinity_breaks_ties_by_address_and_falls_back_to_random() -> None:
    policy = MaxLocalAffinityBaseline(0)
    # Workers 0 (10.0.0.3) and 2 (10.0.0.2) tie on 5 blocks: the lower address wins, load is ignored.
    view = StaticView(HOSTS, [0, 0, 900, 0], [5, 1, 5, 0])
    assert {policy.choose(KEYS, view) for _ in range(50)} == {2}
    assert policy.choose(KEYS, StaticView(HOSTS, [0] * 4, [0, 0, 0, 7])) == 3
    no_match = StaticView(HOSTS, [0] * 4, [0] * 4)
    assert set(Counter(policy.choose(KEYS, no_match) for _ in range(400))) == {0, 1, 2, 3}

    class Stranger(StaticView):
        def kvcm_matches(self, keys: Sequence[int]) -> Sequence[HostMatch]:
            return [HostMatch("10.9.9.9:8000", 50), HostMatch(HOSTS[1], 2)]

    assert policy.choose(KEYS, Stranger(HOSTS, [0] * 4, [0] * 4)) == 1  # a host outside the fleet is ignored


def test_max_hit_takes_the_longest_cache_then_the_least_work() -> None:
    policy = MaxHitBaseline(0)
    assert policy.choose(KEYS, StaticView(HOSTS, [100, 0, 50, 0], [6, 2, 6, 0])) == 2
    assert policy.choose(KEYS, StaticView(HOSTS, [100, 0, 50, 7], [0, 0, 0, 0])) == 1
    tied = StaticView(HOSTS, [3, 3, 9, 3], [4, 4, 4, 1])
    assert set(Counter(policy.choose(KEYS, tied) for _ in range(200))) == {0, 1}


def test_baselines_replay_identically_on_fresh_clusters() -> None:
    workload = build_workload(replace(SMALL, prompts_per_group=10))
    cluster = ClusterSpec(workers=4, kv_capacity_blocks=64)
    first = run_baseline(MaxHitBaseline(3), workload, cluster)
    again = run_baseline(MaxHitBaseline(3), workload, cluster)
    strip = [(r.worker, r.cached_tokens, r.ttft_s) for r in first.records]
    assert strip == [(r.worker, r.cached_tokens, r.ttft_s) for r in again.records]
    assert first.worker_prefill_tokens == again.worker_prefill_tokens
    assert sum(first.worker_prefill_tokens) == sum(max(1, r.input_tokens - r.cached_tokens) for r in first.records)
    # The oracle sees what a random policy cannot: a higher hit rate on the same arrivals.
    rand = run_baseline(RandomBaseline(3), workload, cluster)
    assert summarize(first).hit_rate > summarize(rand).hit_rate


# ---- figures --------------------------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def _record(
    worker: int, input_tokens: int, cached: int, ttft_ms: float, source: str = "-", predicted: int | None = None
) -> RequestRecord:
    return RequestRecord("r", worker, input_tokens, cached, ttft_ms / 1000.0, 0.001, source, source, predicted)


def test_summarize_hit_rate_imbalance_and_unrouted() -> None:
    run = PolicyRun(
        "kvroute",
        (
            _record(0, 100, 50, 10.0, "kvcm"),
            _record(1, 100, 0, 30.0, "domain"),
            _record(-1, 100, 0, math.nan, "none"),
        ),
        (150, 50),
    )
    s = summarize(run)
    assert (s.requests, s.unrouted) == (3, 1)
    assert s.hit_rate == 0.25  # 50 of the 200 routed tokens
    assert s.ttft_mean_ms == 20.0
    assert s.load_imbalance == 1.5  # 150 / mean 100
    assert s.route_sources == {"kvcm": 1, "domain": 1, "none": 1}
    assert s.predicted == 0 and math.isnan(s.actual_over_predicted)  # nothing predicted: no figure


def test_summarize_prediction_accuracy_over_the_predicted_requests() -> None:
    run = PolicyRun(
        "kvroute",
        (
            _record(0, 100, 50, 10.0, "kvcm", predicted=64),  # found 50 of 64
            _record(1, 100, 0, 30.0, "shadow", predicted=64),  # found nothing: a silent zero
            _record(2, 100, 10, 30.0, "domain", predicted=0),  # no prediction: not counted
        ),
        (100, 100, 90),
    )
    s = summarize(run)
    assert s.predicted == 2
    assert s.actual_over_predicted == 50 / 128
    assert s.silent_zero_share == 0.5
    assert "silent 0" in format_table([s]) and "50.0%" in format_table([s])


def test_spread_counts_workers_per_group_and_misses_of_a_prefix_cached_elsewhere() -> None:
    def rec(worker: int, group: int, cached: int, best: int) -> RequestRecord:
        return RequestRecord("r", worker, 100, cached, 0.01, 0.001, "-", "-", group=group, best_cached_tokens=best)

    records = (
        rec(0, 1, 0, 0),  # group 1's first request: nothing cached anywhere
        rec(0, 1, 64, 64),  # its holder: no miss
        rec(1, 1, 0, 64),  # a copy on worker 1: missed worker 0's prefix
        rec(2, 2, 0, 0),
        rec(-1, 2, 0, 64),  # unrouted: counts nowhere
    )
    found = spread(records)
    assert found.workers_per_group == 1.5  # group 1 on workers {0, 1}, group 2 on {2}
    assert found.missed_elsewhere == 0.25  # 1 of the 4 routed requests
    assert math.isnan(spread(()).workers_per_group)


def test_spread_on_a_tiny_workload_separates_affinity_from_random() -> None:
    workload = build_workload(replace(SMALL, prompts_per_group=6))
    cluster = ClusterSpec(workers=4, kv_capacity_blocks=64)
    by_hit = summarize(run_baseline(MaxHitBaseline(3), workload, cluster))
    by_random = summarize(run_baseline(RandomBaseline(3), workload, cluster))
    # max-hit goes to the longest cached prefix, so it never misses one held elsewhere.
    assert by_hit.missed_elsewhere == 0.0
    assert by_random.missed_elsewhere > 0.0
    assert 1.0 <= by_hit.workers_per_group < by_random.workers_per_group <= 4.0
    # Every routed request's best prefix is at least what its own worker held.
    run = run_baseline(RandomBaseline(3), workload, cluster)
    assert all(r.best_cached_tokens >= r.cached_tokens for r in run.records)
    assert {r.group for r in run.records} == {r.group for r in workload.requests}


def _summary(policy: str, hit: float, mean: float, p99: float, unrouted: int = 0) -> PolicySummary:
    return PolicySummary(policy, 10, unrouted, hit, mean, mean, p99, 1.0, 1.0, 1.0, {}, {}, (1,))


def test_targets_met_and_missed() -> None:
    baselines = [
        _summary("random", 0.5, 90.0, 400.0),
        _summary("least-loaded", 0.5, 40.0, 100.0),
        _summary("max-hit", 0.8, 30.0, 300.0),
        _summary("oracle", 0.78, 20.0, 100.0),
    ]
    good = check_targets([_summary("kvroute", 0.77, 18.0, 109.0), *baselines])
    assert [c.met for c in good] == [True, True, True, True, True, True]
    bad = check_targets([_summary("kvroute", 0.75, 41.0, 131.0, unrouted=4), *baselines])
    assert [c.met for c in bad] == [False, False, False, False, False, False]
    # Hit rate and TTFT are over the routed requests only: unrouted ones miss on their own check.
    (unrouted,) = [c for c in check_targets([_summary("kvroute", 0.77, 18.0, 109.0, 4), *baselines]) if not c.met]
    assert unrouted.target == "every request routed to a worker" and unrouted.detail.startswith("4 of 10")
    assert check_targets(baselines) == ()  # no kvroute run: nothing to judge


# ---- the tiny end-to-end run ----------------------------------------------------------------------------


def _demo_command(argv: list[str]) -> int:
    """``kvroute demo ARGV`` (its own parser: the other subcommands are not this test's business)."""
    parser = argparse.ArgumentParser(prog="kvroute demo")
    demo_cli.configure(parser)
    return demo_cli.run(parser.parse_args(argv))


async def test_tiny_demo_run_prints_the_table_and_writes_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--out",
        str(tmp_path),
        "--groups",
        "4",
        "--prompts-per-group",
        "6",
        "--system-prompt-tokens",
        "256",
        "--sim-workers",
        "3",
        "--kv-capacity-blocks",
        "32",
        "--rate",
        "100",
        # Decisions run on the real clock over loopback gRPC: a budget near the cap keeps a starved
        # machine from shedding them (answered ``domain``/``overloaded``) instead of asking KVCM.
        "--router-setting",
        "budget_cap_ms=2000",
    ]
    with trio.fail_after(60):
        # The command runs its own trio loop (trio.run): give it a thread of its own.
        code = await trio.to_thread.run_sync(_demo_command, argv, abandon_on_cancel=True)
    out = capsys.readouterr().out
    assert code == 0
    assert "debug endpoint: http://127.0.0.1:" in out
    assert "[kvroute]" in out and "hit rate so far" in out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    for column in (
        "hit rate",
        "TTFT mean",
        "p99 ms",
        "imbalance",
        "workers/group",
        "missed elsewhere",
        "decide p50",
        "actual/pred",
        "silent 0",
        "route_source",
    ):
        assert column in header
    table_rows = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in POLICY_NAMES]
    assert table_rows[-len(POLICY_NAMES) :] == list(POLICY_NAMES)
    results = json.loads((tmp_path / RESULTS_FILE).read_text())
    assert [p["policy"] for p in results["policies"]] == list(POLICY_NAMES)
    requests = results["workload"]["requests"]
    for policy in results["policies"]:
        assert policy["requests"] == requests
        assert policy["unrouted"] == 0
        # Defined (an undefined figure is written as null), and every policy reused some group's
        # system prompt (for kvroute this follows from a found prediction, asserted below).
        for figure in ("hit_rate", "workers_per_group", "missed_elsewhere"):
            assert isinstance(policy[figure], float), (policy["policy"], figure, policy[figure])
        assert policy["hit_rate"] > 0.0, policy
        assert len(policy["worker_prefill_tokens"]) == 3
    for kvroute in results["policies"][:2]:  # kvroute, then kvroute with the cost-aware policy
        assert kvroute["predicted"] > 0 and 0.0 < kvroute["actual_over_predicted"] <= 1.5
        assert 0.0 <= kvroute["silent_zero_share"] <= 1.0
        assert sum(kvroute["route_sources"].values()) == requests
        assert set(kvroute["route_sources"]) <= {"kvcm", "shadow", "domain"}
        # Real-clock decisions: how many KVCM answered is load-dependent; at least one did (a shed
        # call would show as domain, with reason overloaded).
        assert kvroute["route_sources"].get("kvcm", 0) >= 1, (kvroute["route_sources"], kvroute["reasons"])
    assert all(p["predicted"] == 0 and p["actual_over_predicted"] is None for p in results["policies"][2:])
    assert all(not p["route_sources"] for p in results["policies"][2:])
    # The baselines replay on the simulated clock alone (seeded, deterministic): the spread figures
    # tell a policy chasing cached prefixes from one ignoring them.
    by_name = {p["policy"]: p for p in results["policies"]}
    max_hit, spread_out = by_name[MaxHitBaseline.name], by_name[RandomBaseline.name]
    assert max_hit["missed_elsewhere"] == 0.0  # it picks the longest cached prefix by definition
    assert spread_out["workers_per_group"] > max_hit["workers_per_group"], (spread_out, max_hit)
    assert {t["target"].split()[0] for t in results["targets"]} >= {"hit", "mean", "p99"}
    assert (tmp_path / CHART_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(BASELINE_NAMES) < set(POLICY_NAMES)


@pytest.mark.parametrize("out", ["a-file/out", "a-file"])
def test_an_unusable_out_is_refused_before_the_run(
    out: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was found only when the results were written, after the whole run, as a traceback."""
    (tmp_path / "a-file").write_text("")
    argv = ["--out", str(tmp_path / out), "--groups", "2", "--prompts-per-group", "2", "--policies", "random"]
    assert _demo_command([*argv, "--no-master"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    assert captured.err == f"kvroute demo: --out {tmp_path / out}: Not a directory\n"


def test_flags_apply_over_the_presets() -> None:
    parser = argparse.ArgumentParser()
    demo_cli.configure(parser)
    workload, cluster = demo_cli.specs_from_args(parser.parse_args(["--rate", "12.5", "--sim-workers", "3"]))
    assert (workload.rate_per_s, cluster.workers) == (12.5, 3)
    assert workload.groups == WorkloadSpec().groups and cluster.kv_capacity_blocks == ClusterSpec().kv_capacity_blocks
    workload, cluster = demo_cli.specs_from_args(parser.parse_args(["--full-size", "--key-family", "vllm"]))
    assert replace(workload, key_family=WorkloadSpec().key_family) == WorkloadSpec.full_size()
    assert workload.key_family.value == "vllm"
    assert cluster == ClusterSpec.full_size()
    with pytest.raises(SystemExit):
        parser.parse_args(["--rate", "0"])
