"""``kvroute demo``: the policy comparison on an embedded cluster, or a fault scenario (``--scenario``).

Comparison: builds the workload, serves a fresh SimCluster (3 KVCM replicas, N workers) over
loopback gRPC, opens the real router on it with its debug endpoint (address printed), replays
the workload through kvroute, then replays the same arrivals with every baseline on fresh
in-memory clusters; prints live progress, the table and the targets; then the master-outage
comparison (``master_outage``: a SimMaster in front, down for the middle third of the requests;
``--no-master`` skips it); writes ``demo-results.json``, ``demo-chart.png`` and
``demo-master-outage.png`` to ``--out``. Exit 0; 2 on bad flags, in one line naming them: a value out
of its range, a flag that needs another (``--trace-speedup`` without ``--trace``, ``flag_conflict``)
or one the chosen run would ignore (``--groups`` with ``--trace``).

The demo's flags are its own (``--sim-workers``, not ``--workers``); router settings can be
overridden with ``--router-setting NAME=VALUE`` (the names of ``kvroute check-config``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import TextIO

import trio

from kvroute_sim.demo import key_family, scenarios, split_budget
from kvroute_sim.demo.evidence_cli import configure_evidence, evidence_requested, run_evidence
from kvroute_sim.demo.flag_values import number
from kvroute_sim.demo.herding import HERDING_FILE, default_variants, format_herding, run_herding, write_herding
from kvroute_sim.demo.lineup import (
    COST_AWARE_SETTINGS,
    KVROUTE,
    KVROUTE_COST_AWARE,
    lineup_baselines,
    run_lineup_baseline,
)
from kvroute_sim.demo.lineup import LINEUP as POLICY_NAMES
from kvroute_sim.demo.master_outage import (
    OutageResult,
    OutageWindow,
    format_outage_table,
    outage_json,
    run_master_outage,
    write_outage_chart,
)
from kvroute_sim.demo.report import (
    check_targets,
    format_table,
    ready_out_dir,
    results_json,
    summarize,
    write_chart,
    write_results,
)
from kvroute_sim.demo.runner import (
    COMPARISON_SETTINGS,
    ClusterSpec,
    DemoConfigError,
    PolicyRun,
    SimClock,
    build_cluster,
    check_router_settings,
    open_kvroute,
    run_kvroute,
)
from kvroute_sim.demo.workload import (
    GROUP_STRIDE,
    MAX_ARRIVAL_S,
    MAX_THINK_TIME_S,
    MULTI_TURN_FRACTION_RANGE,
    RATE_PER_S_RANGE,
    Workload,
    WorkloadSpec,
    build_workload,
)
from router.logs import setup_logging
from router.settings import BY_NAME, ROUTER_SETTING_OPTION
from router.types import KeyFamily

DEFAULT_OUT = "demo-out"
MAX_ROUTERS = 16


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    name = name.strip().replace("-", "_").removeprefix("__")
    if not sep or name not in BY_NAME:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=VALUE with a router setting name (see kvroute check-config --help)"
        )
    return name, value


def _router_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(dict.fromkeys(int(p) for p in text.split(",") if p.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected router counts such as 1,2,4") from None
    if not counts or any(not 1 <= n <= MAX_ROUTERS for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: each router count must be in 1..{MAX_ROUTERS}")
    return counts


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policies {unknown}; choose from {','.join(POLICY_NAMES)}")
    return names


# Workload and cluster flags: (flag, spec field, parser, metavar, help). Defaults come from the presets.
_WORKLOAD_FLAGS: tuple[tuple[str, str, Callable[[str], object], str, str], ...] = (
    ("--groups", "groups", number(int, 1), "N", "shared-system-prompt groups"),
    ("--prompts-per-group", "prompts_per_group", number(int, 1), "N", "conversations = groups x this"),
    (
        "--system-prompt-tokens",
        "system_prompt_tokens",
        number(int, 1, GROUP_STRIDE),
        "N",
        f"tokens per system prompt, at most {GROUP_STRIDE}",
    ),
    ("--question-tokens", "question_tokens", number(int, 1), "N", "tokens per question"),
    ("--output-tokens", "output_tokens", number(int, 0), "N", "tokens per answer (extends the next turn)"),
    (
        "--multi-turn-fraction",
        "multi_turn_fraction",
        number(float, *MULTI_TURN_FRACTION_RANGE),
        "F",
        "share of multi-turn conversations, in {:g}..{:g}".format(*MULTI_TURN_FRACTION_RANGE),
    ),
    ("--turns", "turns", number(int, 1), "N", "turns of a multi-turn conversation"),
    (
        "--think-time-s",
        "think_time_s",
        number(float, 0.0, MAX_THINK_TIME_S, above=True),
        "F",
        f"mean gap between turns (s), at most {MAX_THINK_TIME_S:g}",
    ),
    (
        "--rate",
        "rate_per_s",
        number(float, *RATE_PER_S_RANGE),
        "F",
        "mean arrivals per simulated second, in {:g}..{:g}; every request must arrive within {:g} simulated s "
        "(a week)".format(*RATE_PER_S_RANGE, MAX_ARRIVAL_S),
    ),
    ("--zipf-s", "zipf_s", number(float, 0.0), "F", "Zipf exponent of group popularity (0 = uniform)"),
    ("--seed", "seed", number(int, 0), "N", "workload and baseline seed"),
    ("--block-size", "block_size", number(int, 1), "N", "tokens per KV block"),
    ("--key-family", "key_family", KeyFamily, "FAMILY", "block key family: " + "|".join(f.value for f in KeyFamily)),
)
_CLUSTER_FLAGS: tuple[tuple[str, str, Callable[[str], object], str, str], ...] = (
    ("--sim-workers", "workers", number(int, 1), "N", "simulated workers"),
    ("--kvcm-replicas", "kvcm_replicas", number(int, 1), "N", "KVCM replicas (the first leads)"),
    ("--prefill-tokens-per-s", "prefill_tokens_per_s", number(float, 0.0, above=True), "F", "prefill per worker"),
    ("--kv-capacity-blocks", "kv_capacity_blocks", number(int, 1), "N", "KV capacity per worker (blocks, LRU)"),
    ("--decode-tokens-per-s", "decode_tokens_per_s", number(float, 0.0, above=True), "F", "decode speed per sequence"),
    ("--running-kv-blocks", "running_kv_blocks", number(int, 1), "N", "running requests' KV per worker (blocks)"),
)


# Flags that only mean something with another one, and flags a mode would ignore: given together,
# ``flag_conflict`` refuses them (exit 2) rather than run without what was asked. A flag is given
# when its value is not its default (None, False or []; flags whose default means something else
# take None and the default where they are read).
_NEEDS: tuple[tuple[str, str], ...] = (
    ("--scenario-scale", "--scenario"),
    ("--trace-speedup", "--trace"),
    ("--trace-limit", "--trace"),
    ("--trace-generate-sessions", "--trace-generate"),
    ("--ladder-loads", "--ladder"),
    ("--slo-ms", "--ladder"),
)
_EVIDENCE_MODES = ("--trace", "--ladder", "--target-load")
_SPEC_FLAGS = (*(flag for flag, *_ in _WORKLOAD_FLAGS), *(flag for flag, *_ in _CLUSTER_FLAGS), "--full-size")
_TRACE_IGNORES = tuple(flag for flag, name, *_ in _WORKLOAD_FLAGS if name != "seed")  # a trace is the workload
_GENERATE_IGNORES = tuple(flag for flag in _SPEC_FLAGS if flag != "--seed")  # --seed seeds the generated trace
_CONFLICTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("--scenario", ("--trace-generate", "--routers", *_EVIDENCE_MODES, "--policies", *_SPEC_FLAGS)),
    (
        "--trace-generate",  # writes the trace (--trace-generate-sessions, --seed) and exits
        ("--routers", *_EVIDENCE_MODES, "--policies", ROUTER_SETTING_OPTION, *_GENERATE_IGNORES),
    ),
    ("--routers", (*_EVIDENCE_MODES, "--policies")),  # its own comparison: fixed variants, one workload
    ("--trace", _TRACE_IGNORES),
    ("--target-load", ("--sim-workers",)),  # it sets the number of workers
)
_DESTS = {
    **{flag: name for flag, name, *_ in _WORKLOAD_FLAGS},
    **{flag: f"cluster_{name}" for flag, name, *_ in _CLUSTER_FLAGS},
}


def _given(args: argparse.Namespace, flag: str) -> bool:
    value = getattr(args, _DESTS.get(flag, flag.removeprefix("--").replace("-", "_")))
    return value is not None and value is not False and not (isinstance(value, list) and not value)


def flag_conflict(args: argparse.Namespace) -> str | None:
    """The first flag given without the one it needs, or with one its mode ignores (both named); None if none."""
    for flag, needed in _NEEDS:
        if _given(args, flag) and not _given(args, needed):
            return f"argument {flag}: only applies with argument {needed}"
    for mode, ignored in _CONFLICTS:
        if _given(args, mode):
            for flag in ignored:
                if _given(args, flag):
                    return f"argument {flag}: not allowed with argument {mode}"
    return None


def selected_policies(args: argparse.Namespace) -> tuple[str, ...]:
    """``--policies``, all of them when not given."""
    policies: tuple[str, ...] = POLICY_NAMES if args.policies is None else args.policies
    return policies


def _preset_help(text: str, scaled: object, full: object) -> str:
    def word(value: object) -> str:
        return value.value if isinstance(value, KeyFamily) else f"{value:g}" if isinstance(value, float) else str(value)

    defaults = word(scaled) if scaled == full else f"{word(scaled)}; --full-size {word(full)}"
    return f"{text} (default {defaults})"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario",
        choices=(*scenarios.SCENARIO_NAMES, split_budget.NAME, key_family.NAME, "all"),
        default=None,
        metavar="NAME",
        help="run a fault scenario instead of the policy comparison; exit 1 on any FAIL. NAME: all (the fault "
        "scenarios), " + ", ".join(scenarios.SCENARIO_NAMES) + f"; {split_budget.NAME} (the fixed deadline split "
        f"against the learned one, side by side); {key_family.NAME} (predicted vs reported hits with the right "
        "and a wrong key family)",
    )
    parser.add_argument(
        "--scenario-scale",
        type=number(float, 0.0, above=True),
        default=None,
        metavar="F",
        help=f"multiply every scenario phase by F (default {scenarios.DEFAULT_SCALE:g}; e.g. 0.4 for CI); "
        f"{split_budget.NAME} and {key_family.NAME}: their measured requests "
        f"(the latter at least {key_family.MIN_REQUESTS})",
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, metavar="DIR", help=f"where the JSON and PNG go (default {DEFAULT_OUT})"
    )
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    parser.add_argument(
        "--no-master",
        action="store_true",
        help="no central scheduler in the demo cluster: skip the master-outage comparison",
    )
    parser.add_argument(
        "--policies",
        type=_policies,
        default=None,
        metavar="LIST",
        help=f"policies to compare (default all: {','.join(POLICY_NAMES)})",
    )
    parser.add_argument(
        "--routers",
        type=_router_counts,
        default=None,
        metavar="LIST",
        help="instead of the comparison: the same workload through 1, 2, ... independent routers sharing only "
        "the simulated KVCM and workers (e.g. 1,2,4), for cache-affinity, cost-aware, and cost-aware with "
        f"near-tie spreading; prints the table and writes {HERDING_FILE}",
    )
    parser.add_argument(
        ROUTER_SETTING_OPTION,
        type=_setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override one router setting (repeatable), e.g. scorer_max_extra_work_tokens=512; with --scenario, "
        "over the scenario's settings (not the ones it sets itself: its cluster's addresses, block size and key "
        "family, and what it compares)",
    )
    parser.add_argument(
        "--log-level",
        default="ERROR",
        metavar="LEVEL",
        help="level of the router's logs on stderr (default ERROR; WARNING shows its aggregated fallback warnings)",
    )
    w = parser.add_argument_group("workload (defaults: the scaled one-minute run; --full-size for the benchmark's)")
    w.add_argument(
        "--full-size",
        action="store_true",
        help="64 groups x 16 prompts, 2,048-token system prompts (and a cluster sized for them)",
    )
    scaled_w, full_w = asdict(WorkloadSpec()), asdict(WorkloadSpec.full_size())
    for flag, name, parse, metavar, text in _WORKLOAD_FLAGS:
        help_text = _preset_help(text, scaled_w[name], full_w[name])
        w.add_argument(flag, dest=name, type=parse, metavar=metavar, help=help_text)
    c = parser.add_argument_group("simulated cluster")
    scaled_c, full_c = asdict(ClusterSpec()), asdict(ClusterSpec.full_size())
    for flag, name, parse, metavar, text in _CLUSTER_FLAGS:
        help_text = _preset_help(text, scaled_c[name], full_c[name])
        c.add_argument(flag, dest=f"cluster_{name}", type=parse, metavar=metavar, help=help_text)
    configure_evidence(parser)


def specs_from_args(args: argparse.Namespace) -> tuple[WorkloadSpec, ClusterSpec]:
    """The preset (scaled or ``--full-size``) with every given flag applied; ValueError names a bad one."""
    workload = WorkloadSpec.full_size() if args.full_size else WorkloadSpec()
    cluster = ClusterSpec.full_size() if args.full_size else ClusterSpec()
    given = vars(args)
    workload_flags = {name: given[name] for _, name, *_ in _WORKLOAD_FLAGS if given[name] is not None}
    cluster_flags = {
        name: given[f"cluster_{name}"] for _, name, *_ in _CLUSTER_FLAGS if given[f"cluster_{name}"] is not None
    }
    return replace(workload, **workload_flags), replace(cluster, **cluster_flags)


class ProgressLine:
    """Live progress: one updating line on a terminal; otherwise a line at most every
    ``PLAIN_INTERVAL_S`` of wall time per policy, plus its last one."""

    PLAIN_INTERVAL_S = 2.0

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._printed_at: dict[str, float] = {}

    def __call__(self, policy: str, done: int, total: int, hit_rate: float) -> None:
        text = f"[{policy}] {done}/{total} requests, hit rate so far {hit_rate:.1%}"
        if self._tty:
            self._stream.write("\r" + text.ljust(64) + ("\n" if done == total else ""))
        else:
            now = time.monotonic()  # display pacing only, not policy time
            if done < total and now - self._printed_at.get(policy, -math.inf) < self.PLAIN_INTERVAL_S:
                return
            self._printed_at[policy] = now
            self._stream.write(text + "\n")
        self._stream.flush()


async def compare(
    workload: Workload,
    cluster_spec: ClusterSpec,
    policies: Sequence[str],
    *,
    router_overrides: dict[str, object],
    out: TextIO,
) -> tuple[PolicyRun, ...]:
    """Every selected policy over ``workload``: kvroute through the real router first (its debug
    endpoint up and printed for the whole run), then the baselines, each in a worker thread."""
    progress = ProgressLine(out)
    runs: list[PolicyRun] = []
    clock = SimClock()
    settings = dict(COMPARISON_SETTINGS) | router_overrides
    async with open_kvroute(
        build_cluster(cluster_spec, workload),
        workload.spec,
        clock=clock.now,
        extra_settings=settings,
        debug_http=True,
    ) as setup:
        print(f"debug endpoint: http://{setup.handle.debug_address}/debug/actors (also /metrics)", file=out)
        print(f"kvcm bootstrap: {setup.addresses.kvcm_bootstrap}", file=out, flush=True)
        if KVROUTE in policies:
            runs.append(await run_kvroute(setup, clock, workload, progress))
        for policy in lineup_baselines(workload.spec.seed, workload.spec.block_size):
            if policy.name in policies:
                runs.append(
                    await trio.to_thread.run_sync(run_lineup_baseline, policy, workload, cluster_spec, progress)
                )
    if KVROUTE_COST_AWARE in policies:  # the same router with the cost-aware policy, on a fresh cluster
        cost_aware_clock = SimClock()
        async with open_kvroute(
            build_cluster(cluster_spec, workload),
            workload.spec,
            clock=cost_aware_clock.now,
            extra_settings=settings | dict(COST_AWARE_SETTINGS),
        ) as cost_aware:
            runs.append(await run_kvroute(cost_aware, cost_aware_clock, workload, progress, label=KVROUTE_COST_AWARE))
    order = {name: i for i, name in enumerate(POLICY_NAMES)}
    return tuple(sorted(runs, key=lambda r: order[r.policy]))


def run(args: argparse.Namespace) -> int:
    if (conflict := flag_conflict(args)) is not None:
        print(f"kvroute demo: error: {conflict}", file=sys.stderr)
        return 2
    try:
        setup_logging(args.log_level, "text")
    except ValueError as exc:
        print(f"kvroute demo: error: {exc}", file=sys.stderr)
        return 2
    if args.scenario is not None:
        scale = scenarios.DEFAULT_SCALE if args.scenario_scale is None else args.scenario_scale
        return _scenario(args.scenario, scale, dict(args.router_setting))
    if args.trace_generate is None:  # that run writes its FILE, every other one --out
        try:
            ready_out_dir(Path(args.out))
        except OSError as exc:
            print(f"kvroute demo: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if evidence_requested(args):
        return run_evidence(args)
    try:
        workload_spec, cluster_spec = specs_from_args(args)
    except ValueError as exc:
        print(f"kvroute demo: error: {exc}", file=sys.stderr)
        return 2
    overrides: dict[str, object] = dict(args.router_setting)
    if args.routers is not None:
        return _herding(workload_spec, cluster_spec, args.routers, overrides, Path(args.out))
    try:
        check_router_settings(workload_spec, dict(COMPARISON_SETTINGS) | overrides)
        workload = build_workload(workload_spec)
    except (DemoConfigError, ValueError) as exc:
        print(f"kvroute demo: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"workload: {workload_spec.conversations} conversations over {workload_spec.groups} groups, "
        f"~{workload_spec.rate_per_s:g} requests/s (simulated), seed {workload_spec.seed}; "
        f"cluster: {cluster_spec.workers} workers, {cluster_spec.kvcm_replicas} KVCM replicas",
        flush=True,
    )
    print(f"{len(workload.requests)} requests over {workload.duration_s:.1f} simulated seconds", flush=True)
    policies = selected_policies(args)
    runs = trio.run(partial(compare, workload, cluster_spec, policies, router_overrides=overrides, out=sys.stdout))
    summaries = [summarize(r) for r in runs]
    checks = check_targets(summaries)
    print()
    print(format_table(summaries))
    print(
        "(TTFT: simulated from each worker's queue and uncached tokens. Decision latency: real; for kvroute\n"
        " the whole route() over loopback gRPC - KVCM query and fresh status probes every decision - to\n"
        " simulators sharing this process; kvroute bench measures it against a separate simulator process.)"
    )
    if checks:
        print()
        for check in checks:
            print(check.line())
    out_dir = Path(args.out)
    settings = {k: str(v) for k, v in (dict(COMPARISON_SETTINGS) | overrides).items()}
    payload = results_json(workload, cluster_spec, summaries, checks, settings)
    outage = None if args.no_master else _master_outage(workload, cluster_spec, overrides)
    if outage is not None:
        payload["master_outage"] = outage_json(outage, OutageWindow.of(workload))
    path = write_results(out_dir, payload)
    print(f"\nwrote {path}")
    if not args.no_chart:
        print(f"wrote {write_chart(out_dir, summaries)}")
        if outage is not None:
            print(f"wrote {write_outage_chart(out_dir, outage)}")
    return 0


def _scenario(name: str, scale: float, overrides: dict[str, object]) -> int:
    """``--scenario NAME``: its runs with ``overrides`` (refused with exit 2 before any run when it
    cannot take them) at phase scale ``scale``."""
    names = scenarios.SCENARIO_NAMES if name == "all" else (name,)
    try:
        if name == split_budget.NAME:
            split_budget.check_overrides(overrides)
        elif name == key_family.NAME:
            key_family.check_overrides(overrides)
        else:
            scenarios.check_overrides(names, overrides, asked=name)
    except DemoConfigError as exc:
        print(f"kvroute demo: error: {exc}", file=sys.stderr)
        return 2
    if name == split_budget.NAME:
        return split_budget.run_both(sys.stdout, requests=split_budget.requests_at(scale), overrides=overrides)
    if name == key_family.NAME:
        return key_family.run(sys.stdout, requests=key_family.requests_at(scale), overrides=overrides)
    return scenarios.run_scenarios(names, scale=scale, out=sys.stdout, overrides=overrides)


def _herding(
    workload_spec: WorkloadSpec,
    cluster_spec: ClusterSpec,
    counts: Sequence[int],
    overrides: dict[str, object],
    out_dir: Path,
) -> int:
    """The 1/2/4-router comparison (``herding``): the table on stdout and ``HERDING_FILE``."""
    variants = default_variants(overrides)
    try:
        for variant in variants:
            check_router_settings(workload_spec, variant.settings)
        workload = build_workload(workload_spec)
    except (DemoConfigError, ValueError) as exc:
        print(f"kvroute demo: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{len(workload.requests)} requests over {workload.duration_s:.1f} simulated seconds through "
        f"{','.join(map(str, counts))} independent routers (in memory, simulated time; requests to the routers "
        "in turn)",
        flush=True,
    )
    rows = run_herding(workload, cluster_spec, variants, counts, ProgressLine(sys.stdout))
    print()
    print(format_herding(rows))
    print(
        "(Each router probes and caches worker statuses as configured and sees the others' dispatches only in\n"
        " the statuses it reads; imbalance: max / mean prefill tokens per worker.)"
    )
    path = write_herding(out_dir, workload, cluster_spec, rows)
    print(f"\nwrote {path}")
    return 0


def _master_outage(
    workload: Workload, cluster_spec: ClusterSpec, overrides: dict[str, object]
) -> tuple[OutageResult, ...]:
    """The master-outage comparison, printed: the scheduler healthy, down with the KVCM path, down without."""
    print("\nmaster-outage comparison (a SimMaster in front of the same cluster; in memory, simulated time):")
    results = run_master_outage(workload, cluster_spec, ProgressLine(sys.stdout), overrides)
    print()
    print(format_outage_table(results, OutageWindow.of(workload)))
    print(
        "(kvroute asks the scheduler first; while it is down the KVCM path keeps cache affinity. The pre-change\n"
        " frontend - KVCM fallback off - routes by domain meanwhile. The kvroute row of the table above is the\n"
        " KVCM path alone, compared with the baselines.)"
    )
    return results
