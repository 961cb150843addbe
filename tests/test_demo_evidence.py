"""Trace format and generator, the decode/KV worker model, the TTFT oracle, the SGLang baseline, the ladder."""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import pytest
import trio
import trio.testing

from kvroute_sim.demo import cli as demo_cli
from kvroute_sim.demo.ladder import goodput, run_kvroute_in_memory, run_ladder
from kvroute_sim.demo.lineup import KVROUTE, LINEUP, LINEUP_BASELINES, ORACLE, lineup_baselines, run_lineup_baseline
from kvroute_sim.demo.load import offered_load, scale_arrivals, scale_to_load, workers_for_load
from kvroute_sim.demo.oracle import FAMILY, TtftOracleBaseline, run_oracle
from kvroute_sim.demo.report import summarize
from kvroute_sim.demo.request_view import RequestView
from kvroute_sim.demo.runner import (
    COMPARISON_SETTINGS,
    ClusterSpec,
    PolicyRun,
    RequestRecord,
    route_request,
    run_baseline,
)
from kvroute_sim.demo.sglang_baseline import ApproxRadixTree, SglangCacheAwareBaseline
from kvroute_sim.demo.trace import (
    TRACE_BLOCK_TOKENS,
    TraceFormatError,
    TraceGenSpec,
    generate_trace,
    read_trace,
    trace_workload,
    write_trace,
)
from kvroute_sim.demo.workload import DemoRequest, Workload, WorkloadSpec, build_workload, bulk_window
from kvroute_sim.sim.worker import SimWorker, WorkerSpec

SMALL_TRACE = TraceGenSpec(sessions=40, groups=4, seed=3)


def test_generated_trace_has_the_format_and_the_shapes(tmp_path: Path) -> None:
    records = generate_trace(SMALL_TRACE)
    assert records == generate_trace(SMALL_TRACE)  # seeded
    path = write_trace(tmp_path / "t.jsonl", records)
    assert read_trace(path) == records
    for r in records:
        assert len(r.hash_ids) == -(-r.input_length // TRACE_BLOCK_TOKENS)
        assert r.input_length <= SMALL_TRACE.max_input_tokens
    assert [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)
    # Shared system prompts: some first block is used by requests of different sessions.
    firsts = [r.hash_ids[0] for r in records]
    assert len(set(firsts)) < len(firsts)
    # Multi-turn: some prompt extends an earlier one by more than its first block.
    extends = any(
        later.hash_ids[: len(earlier.hash_ids) - 1] == earlier.hash_ids[:-1] and len(earlier.hash_ids) > 2
        for earlier, later in itertools.combinations(records, 2)
        if len(later.hash_ids) > len(earlier.hash_ids)
    )
    assert extends
    long_tail = generate_trace(replace(SMALL_TRACE, sessions=400))
    assert max(r.input_length for r in long_tail) > 30_000


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("not json", "not JSON"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": "x", "hash_ids": [1]}', "output_length"),
    ],
)
def test_bad_trace_lines_name_the_line_and_field(tmp_path: Path, line: str, field: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [7]}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=f"bad.jsonl line 3: .*{field}"):
        read_trace(path)


def test_trace_workload_speedup_limit_and_load(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", generate_trace(SMALL_TRACE))
    records = read_trace(path, limit=10)
    assert len(records) == 10
    slow, fast = trace_workload(records), trace_workload(records, speedup=4.0)
    assert fast.requests[-1].arrival_s == pytest.approx(slow.requests[-1].arrival_s / 4)
    assert slow.requests[0].keys == records[0].hash_ids and slow.requests[0].tokens == ()
    cluster = ClusterSpec(workers=2, prefill_tokens_per_s=10_000.0)
    load = offered_load(slow, cluster)
    assert offered_load(scale_arrivals(slow, 3.0), cluster) == pytest.approx(3 * load)
    assert offered_load(scale_to_load(slow, cluster, 0.7), cluster) == pytest.approx(0.7)
    assert offered_load(slow, replace(cluster, workers=4)) < load
    workers = workers_for_load(slow, cluster, load / 3)
    assert offered_load(slow, replace(cluster, workers=workers)) <= load / 3
    assert offered_load(slow, replace(cluster, workers=workers - 1)) > load / 3


def test_decode_holds_running_kv_and_queues_the_next_prompt() -> None:
    worker = SimWorker(
        "w",
        WorkerSpec(prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0, running_kv_blocks=10, kv_block_tokens=100),
    )
    # 500 + 100 tokens = 6 blocks, held from 0 to 0.5 s prefill + 10 s decode.
    assert worker.submit("a", 500, 0, 0.0, output_tokens=100) == pytest.approx(0.5)
    assert worker.held_kv_blocks(1.0) == 6
    assert worker.in_flight(1.0) == 1 and worker.queue_length(1.0) == 0
    # 5 more blocks do not fit before "a" ends at 10.5 s: the prefill waits for it.
    assert worker.ttft_if_submitted(400, 0, 1.0, output_tokens=100) == pytest.approx(10.5 + 0.4 - 1.0)
    assert worker.submit("b", 400, 0, 1.0, output_tokens=100) == pytest.approx(9.9)
    assert worker.in_flight(10.6) == 1
    unbounded = SimWorker("u", WorkerSpec(prefill_tokens_per_s=1000.0))
    unbounded.submit("a", 500, 0, 0.0, output_tokens=100)
    assert unbounded.submit("b", 400, 0, 1.0, output_tokens=100) == pytest.approx(0.4)


def test_sglang_tree_matches_the_longest_routed_prefix() -> None:
    tree = ApproxRadixTree()
    tree.insert((1, 2, 3, 4), 0)
    tree.insert((1, 2, 9), 1)
    assert tree.match((1, 2, 3, 4, 5)) == (4, 0)
    assert tree.match((1, 2, 9, 9)) == (3, 1)
    assert tree.match((1, 2)) == (2, 1)  # both hold it: the most recently chosen
    assert tree.match((7,)) == (0, None)


def test_sglang_tree_counts_each_workers_units_through_splits() -> None:
    tree = ApproxRadixTree()
    tree.insert((1, 2, 3, 4), 0)
    tree.insert((1, 2, 9), 1)  # splits (1, 2, 3, 4): worker 0 keeps its 4 units
    tree.insert((1, 2, 3, 4), 0)  # nothing new for worker 0
    assert (tree.units(0), tree.units(1), tree.units(2)) == (4, 3, 0)
    assert tree.smallest(3) == 2  # never routed to: the most room
    assert tree.smallest(2) == 1
    tree.insert((5,), 2)
    tree.insert((6,), 3)
    assert tree.smallest(4) == 2  # a tie: the first registered


@dataclass
class _SglangView:
    """What the SGLang baseline reads of a cluster: the request and the requests in flight."""

    request: DemoRequest
    in_flight: list[int]

    @property
    def hosts(self) -> list[str]:
        return [f"w{i}" for i in range(len(self.in_flight))]

    def requests_in_flight(self, worker: int) -> int:
        return self.in_flight[worker]


def _prompt(tokens: tuple[int, ...], *, keys: tuple[int, ...] = (), input_tokens: int | None = None) -> DemoRequest:
    return DemoRequest("r", 0.0, 0, 0, 0, tokens, keys, len(tokens) if input_tokens is None else input_tokens)


def _sglang_choose(baseline: SglangCacheAwareBaseline, request: DemoRequest, in_flight: list[int]) -> int:
    return baseline.choose((), cast(RequestView, _SglangView(request, in_flight)))


def test_sglang_baseline_sends_a_cold_prompt_to_the_smallest_tree_not_the_least_loaded() -> None:
    baseline = SglangCacheAwareBaseline(16)
    assert _sglang_choose(baseline, _prompt(tuple(range(1000))), [0, 0, 0]) == 0
    assert _sglang_choose(baseline, _prompt(tuple(range(2000, 2010))), [0, 0, 0]) == 1
    # Worker 2 is the busiest but holds the least of the tree: a prompt the tree barely knows goes there.
    assert _sglang_choose(baseline, _prompt(tuple(range(3000, 3100))), [1, 1, 5]) == 2
    # Worker 1 holds 10 units, worker 2 100, worker 0 1,000: the next cold prompt goes to worker 1.
    assert _sglang_choose(baseline, _prompt(tuple(range(4000, 4050))), [0, 9, 0]) == 1


def test_sglang_baseline_follows_a_match_above_its_threshold_while_balanced() -> None:
    baseline = SglangCacheAwareBaseline(16)
    shared = tuple(range(100))
    assert _sglang_choose(baseline, _prompt(shared), [0, 0]) == 0
    assert _sglang_choose(baseline, _prompt(tuple(range(500, 510))), [0, 0]) == 1
    # 40 of 100 matched (above 0.3): worker 0, though worker 1 holds less of the tree.
    assert _sglang_choose(baseline, _prompt(shared[:40] + tuple(range(900, 960))), [0, 0]) == 0
    # 20 of 100 matched (not above 0.3): the smallest tree, worker 1.
    assert _sglang_choose(baseline, _prompt(shared[:20] + tuple(range(700, 780))), [0, 0]) == 1
    # Imbalanced only when both thresholds are passed: loads 70 and 10 differ by 60 (not above 64), so
    # the match still decides.
    assert _sglang_choose(baseline, _prompt(shared), [70, 10]) == 0
    # Both passed (difference 80 > 64, and 90 > 1.5 × 10): the least loaded, whatever the match.
    assert _sglang_choose(baseline, _prompt(shared), [90, 10]) == 1


def test_sglang_baseline_matches_a_trace_prompt_by_its_blocks() -> None:
    baseline = SglangCacheAwareBaseline(16)
    assert _sglang_choose(baseline, _prompt((), keys=(1, 2, 3, 4), input_tokens=64), [0, 0, 0]) == 0
    assert _sglang_choose(baseline, _prompt((), keys=(9,), input_tokens=16), [0, 0, 0]) == 1
    # 2 of 4 blocks matched: 32 of 64 tokens, above 0.3 (counted in units it would be 2 of 64).
    assert _sglang_choose(baseline, _prompt((), keys=(1, 2, 7, 8), input_tokens=64), [0, 0, 0]) == 0


def test_every_baseline_replays_and_the_oracle_is_deterministic() -> None:
    records = generate_trace(SMALL_TRACE)
    workload = scale_arrivals(trace_workload(records), 20.0)
    cluster = ClusterSpec(workers=3, kv_capacity_blocks=400, running_kv_blocks=400)
    runs = {p.name: run_lineup_baseline(p, workload, cluster) for p in lineup_baselines(1, TRACE_BLOCK_TOKENS)}
    assert set(runs) == set(LINEUP_BASELINES)
    for run in runs.values():
        assert summarize(run).requests == len(workload.requests)
    again = run_oracle(1, workload, cluster)
    assert [r.worker for r in again.records] == [r.worker for r in runs[ORACLE].records]


def test_goodput_counts_requests_within_the_slo() -> None:
    def rec(worker: int, ttft_s: float) -> RequestRecord:
        return RequestRecord("r", worker, 10, 0, ttft_s, 0.0, "-", "-")

    run = PolicyRun("x", (rec(0, 0.05), rec(1, 0.2), rec(-1, float("nan")), rec(0, 0.1)), (1, 1))
    assert goodput(run, 100.0) == 0.5


def test_ladder_runs_baselines_at_each_load() -> None:
    workload = trace_workload(generate_trace(replace(SMALL_TRACE, sessions=15)))
    rungs = run_ladder(
        workload, ClusterSpec(workers=2), ("least-loaded", ORACLE), loads=(0.3, 0.9), slo_ms=500.0, router_settings={}
    )
    assert [r.load for r in rungs] == [0.3, 0.9]
    for rung in rungs:
        assert [e.summary.policy for e in rung.entries] == ["least-loaded", ORACLE]
        assert json.loads(json.dumps(rung.to_json()))["policies"][0]["goodput"] is not None


def test_trace_flags_generate_and_reject_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    demo_cli.configure(parser)
    out = tmp_path / "g.jsonl"
    assert demo_cli.run(parser.parse_args(["--trace-generate", str(out), "--trace-generate-sessions", "5"])) == 0
    assert read_trace(out)
    assert demo_cli.run(parser.parse_args(["--trace-generate", str(tmp_path)])) == 2  # a directory: named, no traceback
    assert capsys.readouterr().err.startswith(f"kvroute demo: --trace-generate {tmp_path}: ")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert demo_cli.run(parser.parse_args(["--trace", str(bad)])) == 2
    assert "bad.jsonl line 1" in capsys.readouterr().err


def _request(name: str, at: float, keys: tuple[int, ...]) -> DemoRequest:
    return DemoRequest(name, at, -1, 0, 0, (), keys, input_tokens=100 * len(keys))


def test_the_greedy_ttft_choice_is_no_ceiling_and_the_oracle_family_beats_it() -> None:
    """Two workers, 100-token blocks, 1,000 tokens/s, 16 blocks of cache each. Y (prefix Q) and X (prefix
    P) keep the workers busy; A (P + 1 block) arrives when X's worker is busy until 2.1 s and Y's is idle:
    cold on Y's worker its TTFT is 1.1 s, behind X 1.2 s, so greedy sends it there, and its 11 blocks
    evict the back half of Q. B (Q + 1 block) then prefills 600 tokens behind A (TTFT 1.69 s) instead
    of 100 tokens on an idle worker (0.1 s)."""
    p, q = tuple(range(100, 110)), tuple(range(200, 210))
    workload = Workload(
        WorkloadSpec(block_size=100),
        (
            _request("Y", 0.0, q),
            _request("X", 0.5, p + tuple(range(300, 306))),
            _request("A", 1.0, (*p, 400)),
            _request("B", 1.01, (*q, 500)),
        ),
    )
    cluster = ClusterSpec(workers=2, prefill_tokens_per_s=1000.0, kv_capacity_blocks=16)
    greedy = run_baseline(TtftOracleBaseline(0), workload, cluster)
    ttft = {r.request_id: r.ttft_s for r in greedy.records}
    assert ttft["A"] == pytest.approx(1.1) and ttft["B"] == pytest.approx(1.69)
    oracle = {r.request_id: r.ttft_s for r in run_oracle(0, workload, cluster).records}
    assert oracle["A"] == pytest.approx(1.2) and oracle["B"] == pytest.approx(0.1)
    assert sum(oracle.values()) < sum(ttft.values()) - 1.0


def test_a_hot_prefix_group_wants_a_second_home_before_greedy_makes_one() -> None:
    """Two workers, 100-token blocks, 1,000 tokens/s. H0 stores prefix P (10 blocks) on a worker; then
    30 requests of P + 1 block arrive every 50 ms, each 100 ms of prefill where P is cached (1.1 s cold).
    Greedy queues them behind each other until the wait exceeds a cold prefill; the family's wait-weighted
    member copies P to the other worker sooner, every later request waits less, and the oracle takes it."""
    p = tuple(range(100, 110))
    burst = tuple(_request(f"H{k}", 1.2 + 0.05 * k, (*p, 1000 + k)) for k in range(1, 31))
    requests = (_request("H0", 0.0, (*p, 1000)), *burst)
    workload = Workload(WorkloadSpec(block_size=100), requests)
    cluster = ClusterSpec(workers=2, prefill_tokens_per_s=1000.0, kv_capacity_blocks=64)
    arrivals = tuple(r.arrival_s for r in requests)

    def mean_ttft(run: PolicyRun) -> float:
        return sum(r.ttft_s for r in run.records) / len(run.records)

    greedy = mean_ttft(run_baseline(TtftOracleBaseline(0), workload, cluster))
    delay_only = [
        mean_ttft(run_baseline(TtftOracleBaseline(0, weights=w, arrivals=arrivals), workload, cluster))
        for w in FAMILY
        if w.wait == 0
    ]
    oracle = run_oracle(0, workload, cluster)
    assert min(delay_only) == pytest.approx(greedy)  # pricing the delay or the copy does not find the second home
    assert mean_ttft(oracle) < greedy - 0.05
    assert {r.worker for r in oracle.records[1:]} == {0, 1}


def test_the_labelled_load_is_the_measured_busy_share_and_the_oracle_beats_every_policy() -> None:
    """A small fixed workload at several loads: the oracle's workers are busy about the labelled share of
    the bulk window (simulated clock), and no policy - kvroute through the real router included - has a
    lower mean TTFT than the oracle (beyond a 2 % tolerance)."""
    workload = build_workload(WorkloadSpec(groups=8, prompts_per_group=10, rate_per_s=100.0, seed=5))
    cluster = ClusterSpec(workers=4, kv_capacity_blocks=96)
    loads = (0.3, 0.6, 0.9)
    rungs = run_ladder(workload, cluster, LINEUP, loads=loads, slo_ms=500.0, router_settings=dict(COMPARISON_SETTINGS))
    first, end = bulk_window([r.arrival_s for r in workload.requests])
    assert end - first >= 0.8 * len(workload.requests)
    for rung in rungs:
        assert [e.summary.policy for e in rung.entries] == list(LINEUP)
        assert rung.measured_load == pytest.approx(rung.load, abs=0.1)
        means = {e.summary.policy: e.summary.ttft_mean_ms for e in rung.entries}
        for policy, mean in means.items():
            assert mean >= 0.98 * means[ORACLE], (rung.load, policy, mean, means[ORACLE])
        assert means[KVROUTE] > 0


def test_a_trace_reaches_the_router_as_full_block_keys() -> None:
    """A trace's hash_ids name the last, partial block too; the router takes the full blocks' keys
    (more would cover more tokens than the prompt and make a bad request for the domain fallback)."""
    workload = scale_arrivals(trace_workload(generate_trace(replace(SMALL_TRACE, sessions=8))), 5.0)
    request = next(r for r in workload.requests if r.input_tokens % TRACE_BLOCK_TOKENS)
    routed = route_request(request, TRACE_BLOCK_TOKENS)
    assert routed.block_cache_keys == request.keys[: request.input_tokens // TRACE_BLOCK_TOKENS]
    cluster = ClusterSpec(workers=2, kv_capacity_blocks=400, running_kv_blocks=400)
    run = trio.run(
        run_kvroute_in_memory,
        workload,
        cluster,
        dict(COMPARISON_SETTINGS),
        clock=trio.testing.MockClock(autojump_threshold=0),
    )
    reasons = Counter(r.reason for r in run.records)
    assert "bad_request" not in reasons
    assert Counter(r.route_source for r in run.records)["kvcm"] > 0
