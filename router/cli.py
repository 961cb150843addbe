"""The ``kvroute`` command. Each subcommand lives in its own module, listed in COMMANDS.

A subcommand module defines ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name → (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim-cluster": ("kvroute_sim.sim.cluster_cli", "run simulated KVCM replicas and workers on loopback"),
    "check-config": ("router.check_config_cli", "show the effective configuration, its sources and problems"),
    "serve": ("router.serve_cli", "serve the router over gRPC (kvroute.v1 Router/Route + health) with debug HTTP"),
    "route": ("router.route_cli", "route one request in process and print the decision"),
    "explain": ("router.explain_cli", "route one request and explain every candidate: hit, work, why it won or lost"),
    "demo": ("kvroute_sim.demo.cli", "compare routing policies on an embedded cluster, or run fault scenarios"),
    "bench": ("kvroute_sim.bench.cli", "measure decision CPU, latency, throughput, outage cost, quality and a soak"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware request router for LLM serving")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=help_text, description=help_text)
        module.configure(sp)
        sp.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args._module.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
