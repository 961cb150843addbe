"""``kvroute demo`` flags for trace replay (``--trace``), trace generation and the load ladder (``--ladder``).

Kept apart from ``cli`` so the comparison's own flags stay where they are; ``cli.run`` hands over to
``run_evidence`` when one of these flags is given.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import trio

from kvroute_sim.demo.flag_values import number
from kvroute_sim.demo.ladder import (
    DEFAULT_LOADS,
    default_slo_ms,
    format_ladder,
    ladder_targets,
    run_ladder,
    write_ladder_chart,
)
from kvroute_sim.demo.load import offered_load, workers_for_load
from kvroute_sim.demo.report import check_targets, format_table, results_json, summarize, write_chart, write_results
from kvroute_sim.demo.runner import COMPARISON_SETTINGS, DemoConfigError, check_router_settings
from kvroute_sim.demo.trace import (
    DEFAULT_SPEEDUP,
    SPEEDUP_RANGE,
    TraceFormatError,
    TraceGenSpec,
    generate_trace,
    read_trace,
    trace_workload,
    write_trace,
)
from kvroute_sim.demo.workload import BULK_SHARE, MAX_ARRIVAL_S, Workload, build_workload, bulk_span

# A trace's prompts are tens of thousands of tokens: per worker, 2 M tokens of prefix cache and
# 512 K of running KV (blocks of 512 tokens), unless the cluster flags say otherwise.
TRACE_KV_CAPACITY_BLOCKS = 4096
TRACE_RUNNING_KV_BLOCKS = 1024


def _positive(kind: type[int] | type[float]) -> argparse._ActionType:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(x) / 100.0 for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected percentages like 30,50,70") from None
    if not loads or any(not 0 < load <= 10 for load in loads):
        raise argparse.ArgumentTypeError(f"{text!r}: loads must be in (0, 1000] percent")
    return loads


def configure_evidence(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trace replay and load ladder")
    g.add_argument("--trace", type=Path, metavar="FILE", help="replay a Mooncake-format JSONL trace (512-token blocks)")
    g.add_argument(
        "--trace-speedup",
        type=number(float, *SPEEDUP_RANGE),
        metavar="X",
        help="compress time X-fold, X in {:g}..{:g} (default {:g}); every request must arrive within {:g} simulated s "
        "(a week)".format(*SPEEDUP_RANGE, DEFAULT_SPEEDUP, MAX_ARRIVAL_S),
    )
    g.add_argument("--trace-limit", type=_positive(int), metavar="N", help="the first N requests of the trace")
    g.add_argument(
        "--target-load",
        type=_positive(float),
        metavar="F",
        help="size the cluster (--sim-workers): the fewest workers keeping the workload's load (best-reuse prefill "
        "work in its bulk, over prefill capacity) at or below F",
    )
    g.add_argument(
        "--trace-generate", type=Path, metavar="FILE", help="write a synthetic trace (seeded by --seed) and exit"
    )
    g.add_argument(
        "--trace-generate-sessions",
        type=_positive(int),
        metavar="N",
        help=f"sessions in the generated trace (default {TraceGenSpec().sessions})",
    )
    g.add_argument("--ladder", action="store_true", help="also run every policy at each load of --ladder-loads")
    g.add_argument(
        "--ladder-loads",
        type=_loads,
        metavar="PCTS",
        help="loads in percent of prefill capacity (default " + ",".join(f"{100 * x:.0f}" for x in DEFAULT_LOADS) + ")",
    )
    g.add_argument(
        "--slo-ms",
        type=_positive(float),
        metavar="MS",
        help="TTFT SLO of the goodput column (default: 5x the median idle prefill)",
    )


def _rung_started(rungs: int, started: float, index: int, load: float) -> None:
    elapsed = time.monotonic() - started  # display only
    print(f"rung {index + 1}/{rungs}: load {load:.0%} ({elapsed:.0f} s so far)", flush=True)


def evidence_requested(args: argparse.Namespace) -> bool:
    return bool(args.trace or args.trace_generate or args.ladder or args.target_load)


def run_evidence(args: argparse.Namespace) -> int:
    from kvroute_sim.demo import cli  # the comparison itself; imported here, cli imports this module

    if args.trace_generate is not None:
        sessions = TraceGenSpec().sessions if args.trace_generate_sessions is None else args.trace_generate_sessions
        spec = TraceGenSpec(sessions=sessions, seed=args.seed or 0)
        try:
            path = write_trace(args.trace_generate, generate_trace(spec))
        except OSError as exc:
            print(f"kvroute demo: --trace-generate {args.trace_generate}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
        return 0
    workload: Workload
    if args.trace is not None:  # read first: its errors name the flag and the file
        try:
            records = read_trace(args.trace, limit=args.trace_limit)
        except (OSError, TraceFormatError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            print(f"kvroute demo: --trace {args.trace}: {reason}", file=sys.stderr)
            return 2
    try:
        workload_spec, cluster_spec = cli.specs_from_args(args)
        if args.trace is not None:
            speedup = DEFAULT_SPEEDUP if args.trace_speedup is None else args.trace_speedup
            workload = trace_workload(records, speedup=speedup, source=str(args.trace), seed=workload_spec.seed)
            if args.cluster_kv_capacity_blocks is None:
                cluster_spec = replace(cluster_spec, kv_capacity_blocks=TRACE_KV_CAPACITY_BLOCKS)
            if args.cluster_running_kv_blocks is None:
                cluster_spec = replace(cluster_spec, running_kv_blocks=TRACE_RUNNING_KV_BLOCKS)
        else:
            workload = build_workload(workload_spec)
        if args.target_load is not None:
            workers = workers_for_load(workload, cluster_spec, args.target_load)
            cluster_spec = replace(cluster_spec, workers=workers)
    except ValueError as exc:
        print(f"kvroute demo: error: {exc}", file=sys.stderr)
        return 2
    policies = cli.selected_policies(args)
    overrides: dict[str, object] = dict(args.router_setting)
    settings = dict(COMPARISON_SETTINGS) | overrides
    try:
        check_router_settings(workload.spec, settings)
    except DemoConfigError as exc:
        print(f"kvroute demo: error: {exc}", file=sys.stderr)
        return 2
    load = offered_load(workload, cluster_spec)
    start, end = bulk_span(workload)
    print(
        f"{'trace ' + str(args.trace) if args.trace else 'synthetic workload'}: {len(workload.requests)} requests over "
        f"{workload.duration_s:.1f} simulated s; load {load:.0%} of {cluster_spec.workers} workers' prefill capacity "
        f"(best-reuse prefill work over the {BULK_SHARE:.0%} of requests arriving in {start:.1f}..{end:.1f} s)",
        flush=True,
    )
    runs = trio.run(partial(cli.compare, workload, cluster_spec, policies, router_overrides=overrides, out=sys.stdout))
    summaries = [summarize(r) for r in runs]
    checks = check_targets(summaries)
    print()
    print(format_table(summaries))
    for check in checks:
        print(check.line())
    payload = results_json(workload, cluster_spec, summaries, checks, {k: str(v) for k, v in settings.items()})
    out_dir = Path(args.out)
    if args.ladder:
        slo_ms = args.slo_ms or default_slo_ms(workload, cluster_spec)
        loads = DEFAULT_LOADS if args.ladder_loads is None else args.ladder_loads
        print(f"\nload ladder: {', '.join(f'{x:.0%}' for x in loads)}; TTFT SLO {slo_ms:.0f} ms", flush=True)
        rungs = run_ladder(
            workload,
            cluster_spec,
            policies,
            loads=loads,
            slo_ms=slo_ms,
            router_settings=settings,
            progress=cli.ProgressLine(sys.stdout),
            rung_started=partial(_rung_started, len(loads), time.monotonic()),
        )
        print()
        print(format_ladder(rungs, slo_ms))
        for line in ladder_targets(rungs):
            print(line)
        payload["slo_ms"] = round(slo_ms, 3)
        payload["ladder"] = [r.to_json() for r in rungs]
        if not args.no_chart:
            title = f"TTFT vs load ({args.trace or 'synthetic workload'}, {cluster_spec.workers} workers)"
            print(f"wrote {write_ladder_chart(out_dir, rungs, slo_ms, title)}")
    print(f"wrote {write_results(out_dir, payload)}")
    if not args.no_chart:
        print(f"wrote {write_chart(out_dir, summaries)}")
    return 0
