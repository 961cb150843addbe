"""``kvroute check-config``: the effective configuration, where each value came from, and what will work.

Exits 0 when the configuration has no problem, 1 otherwise (every problem listed with its flag and
environment variable). Problems confined to the KVCM fallback would start kvroute with the fallback
off; any other problem stops ``kvroute serve``.
"""

from __future__ import annotations

import argparse

from router.settings import (
    SECTIONS,
    SETTINGS,
    Assessment,
    LoadedConfig,
    add_arguments,
    assess,
    load_from_args,
)
from router.targets import redact_userinfo
from router.text import one_line


def configure(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)


def render(loaded: LoadedConfig, verdict: Assessment) -> str:
    """The report as text (pure)."""
    lines = [
        f"configuration file: {loaded.config_path or '(none)'}",
        "",
        "effective configuration (value  source):",
    ]
    rows: list[tuple[str, str, str, str]] = []
    for s in SETTINGS:
        given = getattr(getattr(loaded.config, s.section), s.field)
        value = getattr(getattr(loaded.effective, s.section), s.field)
        text = s.shown_text(value)
        source = str(loaded.sources[s.name])
        if s.shown_text(given) != text:  # compared as shown: NaN is not equal to itself
            shown = repr(s.shown_text(given))
            source += f"; {shown} not used: the KVCM fallback settings have problems"
        rows.append((s.section, s.flag, text or "(empty)", source))
    flag_width = max(len(row[1]) for row in rows)
    value_width = min(40, max(len(row[2]) for row in rows))
    for section in SECTIONS:
        lines.append(f"  [{section}]")
        lines += [
            f"    {f:<{flag_width}}  {v:<{value_width}}  {src}" for sec, f, v, src in rows if sec == section
        ]
    lines += ["", "will work:"]
    lines += [f"  + {line}" for line in verdict.works] or ["  (nothing)"]
    lines += ["", "will not work:"]
    lines += [f"  - {line}" for line in verdict.will_not_work] or ["  (nothing found)"]
    if loaded.warnings:
        lines += ["", "warnings:"] + [f"  ! {w}" for w in loaded.warnings]
    if loaded.errors:
        lines += ["", f"errors ({len(loaded.errors)}):"]
        lines += [p.listed() for p in loaded.errors]
        fatal = len(loaded.fatal_errors)
        lines += [
            "",
            f"result: {len(loaded.errors)} error(s); "
            + (
                f"{fatal} outside the KVCM fallback: kvroute will not start"
                if fatal
                else "kvroute would start"
            )
            + (" with the KVCM fallback off" if loaded.fallback_disabled_by_errors and not fatal else ""),
        ]
    else:
        lines += ["", "result: OK"]
    # Every value above is redacted; the free text (the assessment, warnings) may quote an address too.
    # Each line kept to one printable line: a value can hold a newline, or a file name's undecodable
    # byte, which a strict UTF-8 stdout refused with a traceback in place of the report.
    return redact_userinfo("\n".join(one_line(line) for line in lines)) + "\n"


def run(args: argparse.Namespace) -> int:
    loaded = load_from_args(args)
    print(render(loaded, assess(loaded)), end="")
    return 1 if loaded.errors else 0
