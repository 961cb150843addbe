"""The bench's PNG: P7's load curve and P8's latency against offered rate, drawn from the report.

Drawn from the figures' JSON data (what ``--out`` holds), so a chart can be redrawn from any saved
results and always shows what the table printed. One panel per figure the run measured; none of the
two measured: no chart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvroute_sim.demo.figures import png

CHART_SUFFIX = ".png"


def chart_path(results: Path) -> Path:
    """Where the chart of the results written to ``results`` goes: beside them, ``.png`` for ``.json``,
    else ``.png`` added (``results.v1`` and ``results.v2`` do not share one, nor ``bench.png`` become
    its own results' chart)."""
    if results.suffix == ".json":
        return results.with_suffix(CHART_SUFFIX)
    return results.with_name(results.name + CHART_SUFFIX)


def _number(value: object) -> float:
    """A figure's number, NaN for one the JSON holds as null (no sample)."""
    return float(value) if isinstance(value, int | float) else math.nan


def draw(report: Mapping[str, Any], path: Path) -> Path | None:
    """Draw P7 and P8 from ``report`` (``BenchReport.to_json()``) into ``path``; None when the run
    measured neither."""
    by_key = {figure["key"]: figure for figure in report["figures"]}
    panels = [(key, by_key[key]["data"]) for key in ("P7", "P8") if key in by_key]
    if not panels:
        return None
    title = "kvroute bench: the sidecar under load (sims in a separate process)"
    with png(path, title, 1, len(panels), figsize=(7 * len(panels), 5), squeeze=False) as (_, axes):
        for ax, (key, data) in zip(axes[0], panels, strict=True):
            if key == "P7":
                _p7(ax, data)
            else:
                _p8(ax, data)
    return path


def _p7(ax: Any, data: Mapping[str, Any]) -> None:
    """Closed loops: callers → on-time, KVCM and overloaded shares, and the p99 lateness."""
    levels: Sequence[Mapping[str, Any]] = data["levels"]
    callers = [level["callers"] for level in levels]
    for label, field, style in (
        # Each over its own calls: the on-time share over the decisions the sidecar made (the calls with
        # no answer are in the title), the two sources over the answers the callers received.
        ("the sidecar's decisions within deadline + 5 ms", "within_deadline_plus_5ms", "o-"),
        ("answers from KVCM", "kvcm_share", "s-"),
        ("answers overloaded", "overloaded_share", "^-"),
    ):
        ax.plot(callers, [100 * _number(level[field]) for level in levels], style, label=label)
    ax.axhline(99, color="tab:green", linewidth=0.8, linestyle=":", label="target: 99 % on time")
    ax.set_xscale("log", base=2)
    ax.set_xticks(callers)
    ax.set_xticklabels([str(c) for c in callers])
    ax.minorticks_off()
    ax.set_xlabel("callers (closed loop)")
    ax.set_ylabel("share (%)")
    ax.set_ylim(-5, 105)
    late = ax.twinx()
    late.plot(callers, [_number(level["p99_lateness_ms"]) for level in levels], "d--", color="tab:red")
    late.axhline(data["late_slack_ms"], color="tab:red", linewidth=0.8, linestyle=":")
    late.set_ylabel("p99 lateness from the sidecar's receipt (ms, dashed)")
    unanswered = sum(int(level["no_answer"]) for level in levels)
    ax.set_title(f"P7: budget {data['budget_ms']:g} ms; calls without an answer: {unanswered}")
    ax.legend(loc="center left", fontsize="small")


def _p8(ax: Any, data: Mapping[str, Any]) -> None:
    """Open loop: offered rate → the sidecar's p50 and p99, the plain client's query, the relays' p99s,
    fallbacks."""
    rates: Sequence[Mapping[str, Any]] = data["rates"]
    offered = [r["rate"] for r in rates]
    ax.plot(offered, [_number(r["sidecar_p50_ms"]) for r in rates], "o-", label="sidecar p50")
    ax.plot(offered, [_number(r["sidecar_p99_ms"]) for r in rates], "s-", label="sidecar p99")
    ax.plot(offered, [_number(r["floor_query_p50_ms"]) for r in rates], "x:", label="plain client's KVCM query p50")
    for key, marker, color, label in (
        ("relay", "^:", "tab:purple", "a plain grpcio relay's p99 (no router)"),
        ("bridged", "v:", "tab:brown", "the relay through the trio hand-off, p99 (no router)"),
    ):
        relayed = [r for r in rates if r.get(key)]
        if relayed:
            ax.plot(
                [r["rate"] for r in relayed],
                [_number(r[key]["p99_ms"]) for r in relayed],
                marker,
                color=color,
                label=label,
            )
    ax.axhline(2.0, color="tab:blue", linewidth=0.8, linestyle=":", label="targets at 100/s: p50 2 ms, p99 5 ms")
    ax.axhline(5.0, color="tab:orange", linewidth=0.8, linestyle=":")
    ax.axvline(500, color="gray", linewidth=0.8, linestyle="--", label="the knee must lie beyond 500/s")
    knee = data.get("knee")
    if knee is not None:
        ax.axvline(knee, color="tab:red", linewidth=1.0, label=f"knee at {knee}/s")
    ax.set_xscale("log")
    ax.set_xticks(offered)
    ax.set_xticklabels([str(r) for r in offered])
    ax.minorticks_off()  # the rates are the ticks; a log axis' minor labels crowd them
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (calls/s, open loop)")
    ax.set_ylabel("receipt to reply (ms)")
    fallbacks = ax.twinx()
    fallbacks.plot(offered, [100 * _number(r["fallback_share"]) for r in rates], "d--", color="tab:red")
    fallbacks.set_ylabel("answers not from KVCM (%, dashed)")
    fallbacks.set_ylim(-2, 102)
    ax.set_title(f"P8: budget {data['budget_ms']:g} ms")
    ax.legend(loc="upper left", fontsize="small")
