"""``kvroute bench``: P1–P9 and the soak, printed as one table and written as JSON.

Every ratio is measured side by side in the same run. Targets are reported (met /
MISSED), never asserted; where a CPU-bound one (P1, P2, P3, P6) is missed, a cProfile
window of the same work lists the top costs under the table.

Where things run: the simulators for P2/P3/P7/P8 in a child process (``kvroute sim-cluster
--print-json``, always stopped at the end); P4 in this process over loopback gRPC, so its
fault knobs can be switched directly; P7's sidecar in this process, its callers in a second child
on the simulators' CPUs; P8's sidecar and the plain client of its floor column in this process, its
caller in such a second child; P3 (memory), P5's baselines and the soak in memory; P9's ``kvroute
serve`` process trees on every CPU the run was allowed, its client threads in this process.
This process is pinned to one CPU for the run (the child gets the others), so "one core"
holds for the router and for the raw client it is compared with.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvroute_sim.bench import decision_cpu, latency, outage, overload, processes, quality, rate, soak, throughput
from kvroute_sim.bench.chart import chart_path, draw
from kvroute_sim.bench.cpus import KeepAwakeError, Placement, cpus_kept_awake, pinned_bench_process
from kvroute_sim.bench.harness import ClusterShape, ClusterView, router_config
from kvroute_sim.bench.latency import LatencySizes
from kvroute_sim.bench.outage import OutageSizes
from kvroute_sim.bench.overload import LoadSizes
from kvroute_sim.bench.processes import ProcessSizes
from kvroute_sim.bench.rate import RateSizes
from kvroute_sim.bench.raw_grpc import RawClient
from kvroute_sim.bench.results import BenchReport
from kvroute_sim.bench.simproc import sim_process
from kvroute_sim.bench.throughput import ThroughputSizes
from router.settings import BY_NAME, ROUTER_SETTING_OPTION, Origin, SettingValueError, SourceKind, validate
from router.wire.decode import COMPILED_KEYS_ENCODER

FIGURES = ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P9", "soak")
DEFAULT_OUT = "bench-results.json"
FULL_SOAK = 1_000_000  # ``--soak`` without N


@dataclass(frozen=True, slots=True)
class Sizes:
    decision_repeats: int  # P1/P6: recorded decisions per case
    latency: LatencySizes
    throughput_memory: ThroughputSizes
    throughput_grpc: ThroughputSizes
    outage: OutageSizes
    load: LoadSizes  # P7
    rate: RateSizes  # P8
    processes: ProcessSizes  # P9
    soak_requests: int  # the default run's soak (``--soak N`` overrides)
    child_duration_s: float  # the simulator child exits by itself after this long


FULL = Sizes(
    decision_repeats=20_000,
    latency=LatencySizes(rounds=3, routes_per_round=600, warm_up=200),
    throughput_memory=ThroughputSizes(rounds=3, decisions_per_round=10_000, concurrency=8, warm_up=500),
    throughput_grpc=ThroughputSizes(rounds=3, decisions_per_round=3_000, concurrency=8, warm_up=500),
    outage=OutageSizes(healthy=1_000, outage=2_000, detect_max=100, warm_up=100),
    load=LoadSizes(calls_per_level=(500, 2_000, 3_000, 3_000), max_level_s=12.0, warm_up=200),
    rate=RateSizes(seconds_per_rate=5.0, warm_up=200, floor_calls=500),
    processes=ProcessSizes(calls=6_000, max_level_s=20.0),
    soak_requests=50_000,
    child_duration_s=900.0,
)
QUICK = Sizes(
    decision_repeats=1_000,
    latency=LatencySizes(rounds=1, routes_per_round=100, warm_up=20),
    throughput_memory=ThroughputSizes(rounds=1, decisions_per_round=1_000, concurrency=8, warm_up=50),
    throughput_grpc=ThroughputSizes(rounds=1, decisions_per_round=300, concurrency=8, warm_up=50),
    outage=OutageSizes(healthy=100, outage=200, detect_max=100, warm_up=20),
    load=LoadSizes(calls_per_level=(50, 200, 320, 512), max_level_s=3.0, warm_up=20),
    rate=RateSizes(seconds_per_rate=0.4, warm_up=20, floor_calls=20),
    processes=ProcessSizes(calls=300, max_level_s=5.0),
    soak_requests=2_000,
    child_duration_s=300.0,
)


def _figure_list(text: str) -> frozenset[str]:
    by_lower = {f.lower(): f for f in FIGURES}
    chosen = set()
    for entry in (e.strip() for e in text.split(",")):
        if entry.lower() not in by_lower:
            raise argparse.ArgumentTypeError(f"unknown figure {entry!r} (choose from {','.join(FIGURES)})")
        chosen.add(by_lower[entry.lower()])
    return frozenset(chosen)


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="CI-sized run (seconds); the figures are noisier")
    parser.add_argument(
        "--only", type=_figure_list, default=None, metavar="P1,P3,...", help=f"run only these ({','.join(FIGURES)})"
    )
    parser.add_argument(
        "--soak",
        type=_positive_int,
        nargs="?",
        const=FULL_SOAK,
        default=None,
        metavar="N",
        help=f"soak with N requests (default {FULL_SOAK:,}; in-memory transports); without --only, runs only "
        f"the soak; with it, beside the figures it names (the default run soaks {FULL.soak_requests:,})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        help=f"JSON results (default {DEFAULT_OUT}); the chart of P7 and P8 goes beside it, as .png",
    )
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG of P7's load curve and P8's latency")
    parser.add_argument("--seed", type=int, default=0, help="seed for the decision-CPU cases")
    parser.add_argument(
        "--keep-cpus-awake",
        action="store_true",
        help="run a spinner at SCHED_IDLE on each allowed CPU (Linux): it takes no CPU time anything else "
        "wants, but no CPU halts while idle; compare a run with it and one without for what the halt between "
        "calls costs the figures",
    )
    parser.add_argument(
        ROUTER_SETTING_OPTION,
        type=_router_setting,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set one router setting (repeatable; the names of kvroute check-config) for every figure that opens "
        "a router, e.g. slot_waiters=0: compare two settings in the same build, with no other change",
    )


def settings_problems(router_settings: tuple[tuple[str, object], ...]) -> list[str]:
    """What the settings validation finds in the bench's router configuration with ``router_settings``
    and not without them (every value's range and form, each section's rules, the joint rules; the
    cluster's addresses are placeholders here)."""

    def problems(chosen: tuple[tuple[str, object], ...]) -> list[str]:
        view = ClusterView("127.0.0.1:1", "127.0.0.1:2", ClusterShape().block_size, (), chosen)
        origins = {name: Origin(SourceKind.FLAG, ROUTER_SETTING_OPTION) for name, _ in chosen}
        return [str(p) for p in validate(router_config(view, status_ttl_s=None), origins)]

    baseline = set(problems(()))
    return [p for p in problems(router_settings) if p not in baseline]


def _router_setting(text: str) -> tuple[str, object]:
    """NAME=VALUE parsed by the settings table (its ranges and joint rules: ``settings_problems``)."""
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_").removeprefix("__")
    setting = BY_NAME.get(name)
    if not sep or setting is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=VALUE with a router setting name (see kvroute check-config --help)"
        )
    try:
        value = setting.parse_text(raw)
    except SettingValueError as exc:
        raise argparse.ArgumentTypeError(f"{name}: {exc}") from None
    return name, value


def _selected(args: argparse.Namespace) -> frozenset[str]:
    """The figures to run: ``--only``'s, and the soak whenever ``--soak`` asks for one (it was once
    dropped without a word when ``--only`` did not name it too)."""
    soak = frozenset({"soak"}) if args.soak is not None else frozenset()
    if args.only is not None:
        return frozenset(args.only) | soak
    return soak or frozenset(FIGURES)


def run(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else FULL
    selected = _selected(args)
    problems = settings_problems(tuple(args.router_setting))
    if problems:
        print("kvroute bench: --router-setting:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 2
    try:
        BenchReport.ready(args.out)
    except OSError as exc:
        print(f"kvroute bench: --out {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    # The chart goes beside the results when they go to a file (not /dev/null, say): tried before the run too.
    chart = None if args.no_chart or not _regular_file_or_new(args.out) else chart_path(args.out)
    if chart is not None:
        try:
            BenchReport.ready(chart)
        except OSError as exc:
            print(f"kvroute bench: the chart beside --out, {chart}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    with contextlib.ExitStack() as stack:
        # Spinners first, one on each CPU this process may use, before it pins itself to one of them.
        try:
            awake = stack.enter_context(cpus_kept_awake()) if args.keep_cpus_awake else []
        except KeepAwakeError as exc:
            print(f"kvroute bench: --keep-cpus-awake: {exc}", file=sys.stderr)
            return 2
        placement = stack.enter_context(pinned_bench_process())
        kept_awake = f"CPUs {awake} kept awake by SCHED_IDLE spinners" if awake else "no CPU kept awake"
        keys_encoder = "compiled (router.wire._packed)" if COMPILED_KEYS_ENCODER else "protobuf (no compiled encoder)"
        report = BenchReport(
            meta={
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "python": platform.python_version(),
                "machine": platform.machine(),
                "quick": args.quick,
                "figures": sorted(selected),
                "cpu_placement": placement.describe(),
                "cpus_kept_awake": awake,
                "compiled_keys_encoder": COMPILED_KEYS_ENCODER,
                "sizes": asdict(sizes),
            },
            notes=[f"CPU placement: {placement.describe()}; {kept_awake}; block keys encoded by {keys_encoder}"],
        )
        _measure(report, selected, sizes, placement, args)
    print(report.render())
    report.write(args.out)
    print(f"\nresults written to {args.out}")
    if chart is not None:
        try:
            drawn = draw(report.saved(), chart)  # what was saved, nulls included
        except (OSError, ValueError) as exc:  # the results are written: say so, and why there is no chart
            print(f"kvroute bench: no chart ({chart}): {exc}", file=sys.stderr)
        else:
            if drawn is not None:
                print(f"chart of P7 and P8 written to {drawn}")
    return 0


def _regular_file_or_new(path: Path) -> bool:
    """Whether ``path`` is a regular file or does not exist yet (a device such as /dev/null is neither)."""
    return path.is_file() or not path.exists()


def _measure(
    report: BenchReport, selected: frozenset[str], sizes: Sizes, placement: Placement, args: argparse.Namespace
) -> None:
    """Each selected figure in turn (the raw floor before the router rows it is compared with)."""
    shape = ClusterShape(router_settings=tuple(args.router_setting))
    report.meta["router_settings"] = {name: str(value) for name, value in args.router_setting}
    seconds: dict[str, float] = {}
    report.meta["seconds"] = seconds

    def timed(name: str, step: Callable[[], None]) -> None:
        began = time.perf_counter()
        step()
        seconds[name] = round(time.perf_counter() - began, 1)
        print(f"kvroute bench: {name} done in {seconds[name]:.1f} s", file=sys.stderr, flush=True)

    if selected & {"P1", "P6"}:
        timed(
            "P1/P6",
            lambda: decision_cpu.measure(
                report, p1="P1" in selected, p6="P6" in selected, repeats=sizes.decision_repeats, seed=args.seed
            ),
        )
    if selected & {"P2", "P3", "P7", "P8", "P9"}:
        with sim_process(shape, sizes.child_duration_s, placement.child) as sim:
            if selected & {"P2", "P3"}:
                raw = RawClient(sim)
                try:
                    if "P2" in selected:
                        timed("P2", lambda: latency.measure(report, sim.view, raw, sizes.latency))
                    if "P3" in selected:
                        timed(
                            "P3 gRPC",
                            lambda: throughput.measure_grpc(
                                report, sim.view, raw, sizes.throughput_grpc, placement.child
                            ),
                        )
                finally:
                    raw.close()
            if "P7" in selected:
                timed("P7", lambda: overload.measure(report, sim.view, sizes.load, placement.child))
            if "P8" in selected:
                raw = RawClient(sim)
                try:
                    timed("P8", lambda: rate.measure(report, sim.view, raw, sizes.rate, placement.child))
                finally:
                    raw.close()
            if "P9" in selected:
                everywhere = placement.bench | placement.child if placement.bench and placement.child else None
                timed("P9", lambda: processes.measure(report, sim.view, sizes.processes, everywhere))
    if "P3" in selected:
        timed("P3 memory", lambda: throughput.measure_memory(report, shape, sizes.throughput_memory))
    if "P4" in selected:
        timed("P4", lambda: outage.measure(report, shape, sizes.outage))
    if "P5" in selected:
        timed("P5", lambda: quality.measure(report, quick=args.quick))
    if "soak" in selected:
        requests = sizes.soak_requests if args.soak is None else args.soak
        concurrency = sizes.throughput_memory.concurrency
        timed("soak", lambda: soak.measure(report, shape, requests, concurrency, default=args.soak is None))
    seconds["total"] = round(sum(seconds.values()), 1)
