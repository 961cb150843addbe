"""The command line: one option per setting (generated from the table), and loading for a CLI command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from router.settings.load import LoadedConfig, load_from_args
from router.settings.table import CONFIG_ENV, SECTIONS, SETTINGS, Kind


def add_arguments(parser: argparse.ArgumentParser, notes: Mapping[str, str] | None = None) -> None:
    """Add ``--config`` and one option per setting (grouped by section); --help is generated from the table.
    ``notes``: text appended to a setting's help (by setting name) where a command uses it its own way.

    Options default to None (= not given) and are parsed by load_config, so every bad value is
    reported at once instead of argparse stopping at the first.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"TOML file with [section] tables of settings (env {CONFIG_ENV}); precedence: "
        "defaults < file < environment < flags",
    )
    for section in SECTIONS:
        group = parser.add_argument_group(f"{section} settings")
        for s in SETTINGS:
            if s.section != section:
                continue
            help_text = s.help_text()
            if notes and s.name in notes:
                help_text = f"{help_text} {notes[s.name]}"
            help_text = help_text.replace("%", "%%")
            if s.kind is Kind.BOOL:
                group.add_argument(
                    s.flag,
                    dest=s.name,
                    default=None,
                    nargs="?",
                    const="true",
                    metavar=s.metavar,
                    help=help_text,
                )
            else:
                group.add_argument(s.flag, dest=s.name, default=None, metavar=s.metavar, help=help_text)


def load_or_report(args: argparse.Namespace, command: str, env: Mapping[str, str] | None = None) -> LoadedConfig | None:
    """The configuration for ``kvroute <command>``, or None after listing on stderr every problem
    that stops it (problems confined to the KVCM fallback do not: it runs with the fallback off).

    The caller exits with its own "configuration" status when this returns None.
    """
    loaded = load_from_args(args, env)
    if not loaded.fatal_errors:
        return loaded
    print(f"kvroute {command}: {len(loaded.errors)} configuration problem(s), not starting:", file=sys.stderr)
    for problem in loaded.errors:
        print(problem.listed(), file=sys.stderr)
    return None
