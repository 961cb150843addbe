"""``kvroute replay PATH...``: re-run recorded decisions and say which come out identical.

Exit status: 0 when every decision replays identically, 1 when some differ, 2 when the log cannot be
read or a ``--router-setting`` is not valid. With ``--router-setting NAME=VALUE`` (a what-if) it
reports how the decisions change under those settings and exits 0 once the report is printed.

Every file's header is read and checked first: a file that cannot be opened, has no header, or one
of another version or configuration is refused before any replay. The decisions are read as they
are replayed, one at a time (a log set held whole takes many times its size): a fault found partway
stops the replay there, after the decisions before it, whose summary (the what-if's too) is printed,
said to cover them; it exits 2.
"""

from __future__ import annotations

import argparse
import sys

from router.decision_record import LogFormatError, TornTail
from router.logs import shown
from router.replay import LogReader, ReplayEngine, WhatIf, difference, replay_config, taken_from_recording
from router.settings.table import BY_NAME, ROUTER_SETTING_OPTION


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="decision log files (oldest first: PATH.1 PATH)")
    parser.add_argument(
        ROUTER_SETTING_OPTION,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="what-if: replay with this setting changed (a setting name or flag, e.g. scorer-min-hit-rate=0); "
        "repeatable",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the differing decisions and the summary")


def _overrides(given: list[str]) -> dict[str, str] | str:
    out: dict[str, str] = {}
    for item in given:
        name, sep, value = item.partition("=")
        key = name.strip().lstrip("-").replace("-", "_")
        if not sep or key not in BY_NAME:
            return f"--router-setting {item!r}: expected NAME=VALUE with NAME a kvroute setting"
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    overrides = _overrides(args.router_setting)
    if isinstance(overrides, str):
        print(f"kvroute replay: {overrides}", file=sys.stderr)
        return 2
    try:
        log = LogReader(args.paths, on_torn=_warn_torn)
    except LogFormatError as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 2
    for name in overrides:
        if taken_from_recording(name):
            print(f"warning: --router-setting {name}: replay takes its effect from the recording (remote answers, "
                  "the fleet, sheds and draws as they were): this what-if changes no decision", file=sys.stderr)
    setup = replay_config(log, overrides)
    if setup.problems:
        print(f"kvroute replay: {len(setup.problems)} configuration problem(s):", file=sys.stderr)
        for problem in setup.problems:
            print(problem.listed(), file=sys.stderr)
        return 2
    if not setup.digest_matches:
        print("warning: the recorded configuration digest differs from this kvroute's reading of the same settings "
              "(defaults changed between versions?)", file=sys.stderr)
    engine = ReplayEngine(setup.config)
    what_if = WhatIf()
    identical = 0
    try:
        for case in log.cases():
            outcome = engine.replay(case)
            what_if.add(outcome)
            if outcome.identical:
                identical += 1
                if not args.quiet:
                    print(f"identical {shown(case.request_id)}")
            else:
                print(f"different {shown(case.request_id)} ({case.path} @{case.offset}): {difference(outcome)}")
    except LogFormatError as exc:
        if what_if.total:  # what the decisions before it came to is known: said, not lost with the fault
            _summary(overrides, what_if, identical, of=" (the decisions before the fault)")
        print(f"kvroute replay: {exc} (replay stopped there, after {what_if.total} decisions)", file=sys.stderr)
        return 2
    _summary(overrides, what_if, identical)
    if overrides:
        return 0
    return 0 if identical == what_if.total else 1


def _summary(overrides: dict[str, str], what_if: WhatIf, identical: int, of: str = "") -> None:
    """The what-if's report (with ``overrides``) and the count of identical decisions; ``of`` says which
    decisions they cover when not every one."""
    total = what_if.total
    if overrides:
        changes = ", ".join(f"{k}={v}" for k, v in overrides.items())
        print(f"what-if {changes}: {what_if.changed} of {total} decisions change{of}")
        for (before, after), n in sorted(what_if.transitions.items(), key=lambda item: -item[1]):
            print(f"  {n} x {before} -> {after}")
        print(f"  workers changed: {what_if.workers_changed}")
        print(f"  predicted hit tokens: {what_if.hit_delta:+d}; chosen worker's work tokens: {what_if.work_delta:+d}")
    print(f"{identical} of {total} decisions identical{of}")


def _warn_torn(tail: TornTail) -> None:
    print(f"warning: {tail}: the file ends inside a frame (its writer stopped mid-write); "
          "the decisions before it are replayed", file=sys.stderr)
