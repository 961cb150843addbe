"""The ``kvroute`` command. Each subcommand lives in its own module, listed in COMMANDS.

A subcommand module defines ``configure(parser)`` and ``run(args) -> int``. Only the module of the
subcommand being run is imported: ``kvroute --help`` and the product's own subcommands never import
the simulator package (``kvroute_sim``), whose commands need the ``demo`` extra's libraries.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata

DIST_NAME = "kvroute"


@dataclass(frozen=True)
class Command:
    module: str
    help: str
    extra: str | None = None  # the optional dependency group the module needs, if any


COMMANDS: dict[str, Command] = {
    "sim-cluster": Command(
        "kvroute_sim.sim.cluster_cli", "run simulated KVCM replicas and workers on loopback", extra="demo"
    ),
    "check-config": Command("router.check_config_cli", "show the effective configuration, its sources and problems"),
    "serve": Command(
        "router.serve_cli", "serve the router over gRPC (kvroute.v1 Router/Route + health) with debug HTTP"
    ),
    "route": Command("router.route_cli", "route one request in process and print the decision"),
    "explain": Command(
        "router.explain_cli", "route one request and explain every candidate: hit, work, why it won or lost"
    ),
    "replay": Command(
        "router.replay_cli", "re-run a decision log's decisions (or what-if other settings) and compare them"
    ),
    "demo": Command(
        "kvroute_sim.demo.cli", "compare routing policies on an embedded cluster, or run fault scenarios", extra="demo"
    ),
    "bench": Command(
        "kvroute_sim.bench.cli",
        "measure decision CPU, latency, throughput, outage cost, quality and a soak",
        extra="demo",
    ),
}

_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _is_installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def missing_requirements(
    extra: str, requirements: Iterable[str], is_installed: Callable[[str], bool] = _is_installed
) -> list[str]:
    """Names of the distributions that ``extra`` requires and that are not installed.

    ``requirements`` are Requires-Dist lines (``name>=1.0; extra == "demo"``); a line naming
    this distribution itself (``kvroute[demo]``) is not a separate install and is skipped.
    """
    marker = re.compile(rf"""\bextra\s*==\s*["']{re.escape(extra)}["']""")
    missing: list[str] = []
    for line in requirements:
        requirement, _, markers = line.partition(";")
        match = _REQUIREMENT_NAME.match(requirement)
        if match is None or not marker.search(markers):
            continue
        name = match.group(1)
        if name != DIST_NAME and not is_installed(name):
            missing.append(name)
    return missing


def missing_extra(extra: str) -> list[str]:
    """What the installed distribution's ``extra`` requires and is not installed (nothing when unknown)."""
    try:
        requirements = metadata.requires(DIST_NAME) or []
    except metadata.PackageNotFoundError:  # run from a source tree without an install: nothing to check
        return []
    return missing_requirements(extra, requirements)


def extra_hint(command: str, extra: str, missing: Sequence[str]) -> str:
    return (
        f"kvroute {command} needs the '{extra}' extra (missing: {', '.join(missing)}): "
        f"pip install '{DIST_NAME}[{extra}]'"
    )


class WholeNamesHelpFormatter(argparse.HelpFormatter):
    """argparse's help with words never broken across lines: a long environment variable, TOML key or
    flag name (``KVROUTE_MASTER_BREAKER_OVERLAPPING_FAILURES_COUNT_ONCE``) stays whole, so it can be
    found and copied from a narrow terminal's help."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the ``selected`` subcommand's module is imported to add its flags."""
    # No abbreviated flags: "--budget-cap 7" must not quietly mean --budget-cap-ms, nor stop working
    # (or change meaning) the day another flag starts with the same words.
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="KV-cache-aware request router for LLM serving",
        allow_abbrev=False,
        formatter_class=WholeNamesHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sp = sub.add_parser(
            name,
            help=command.help,
            description=command.help,
            allow_abbrev=False,
            formatter_class=WholeNamesHelpFormatter,
        )
        if name == selected:
            module = importlib.import_module(command.module)
            module.configure(sp)
            sp.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    selected = args_in[0] if args_in and args_in[0] in COMMANDS else None
    if selected is not None and (extra := COMMANDS[selected].extra) is not None:
        missing = missing_extra(extra)
        if missing:
            print(extra_hint(selected, extra, missing), file=sys.stderr)
            return 2
    args = build_parser(selected).parse_args(args_in)
    code: int = args._module.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
