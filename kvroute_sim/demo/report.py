"""The comparison's figures (pure), its table, the targets check, ``demo-results.json`` and the PNG chart.

Definitions (per policy, over the routed requests):

- prefix hit rate: cached prompt tokens / prompt tokens (token-weighted);
- simulated TTFT: mean, p50 and p99 (nearest-rank percentiles) in ms;
- load imbalance: max / mean of the workers' prefill (uncached) tokens;
- decision latency p50 / p99 in µs, real time: the whole ``route()`` call for kvroute
  (loopback gRPC to KVCM and workers included), the baseline's own ``choose()`` otherwise;
- route_source mix: kvroute's decisions by ``route_source`` (baselines have none);
- prediction accuracy (policies that predict a hit: kvroute): over the routed requests with a
  predicted hit, the cached tokens the simulated engine found / the tokens predicted, and the
  silent-zero share (the engine found nothing where a hit was predicted).
- spread: workers per prefix group (the distinct workers a group's requests were routed to, averaged
  over the groups that had a request) and the share of requests that missed a prefix cached on
  another worker (some worker held a longer prefix of the prompt than the chosen one did).
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute_sim.demo.baselines import KVROUTE, LEAST_LOADED
from kvroute_sim.demo.figures import png
from kvroute_sim.demo.lineup import MAX_HIT, ORACLE, PRACTICAL_BASELINES
from kvroute_sim.demo.runner import NO_SOURCE, ClusterSpec, PolicyRun, RequestRecord
from kvroute_sim.demo.workload import Workload
from kvroute_sim.stats import percentile, shown_against

RESULTS_FILE = "demo-results.json"
CHART_FILE = "demo-chart.png"

# The demo's targets (P5): kvroute vs the baselines on the same arrivals.
HIT_RATE_OF_MAX_HIT_MIN = 0.95
P99_OF_LEAST_LOADED_MAX = 1.1
MEAN_OF_ORACLE_MAX = 1.15  # kvroute's mean TTFT / the TTFT oracle's
P99_OF_ORACLE_MAX = 1.3


@dataclass(frozen=True, slots=True)
class PolicySummary:
    policy: str
    requests: int
    unrouted: int  # kvroute answers without a worker (route_source=none)
    hit_rate: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    load_imbalance: float
    decision_p50_us: float
    decision_p99_us: float
    route_sources: Mapping[str, int]  # empty for baselines
    reasons: Mapping[str, int]  # empty for baselines
    worker_prefill_tokens: tuple[int, ...]
    predicted: int = 0  # routed requests with a predicted hit (none for a policy that does not predict)
    actual_over_predicted: float = math.nan  # cached tokens found / predicted, over those
    silent_zero_share: float = math.nan  # of those, the share where the engine found nothing
    workers_per_group: float = math.nan
    missed_elsewhere: float = math.nan  # share of routed requests

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "unrouted": self.unrouted,
            "hit_rate": _finite(self.hit_rate),
            "ttft_mean_ms": _finite(self.ttft_mean_ms),
            "ttft_p50_ms": _finite(self.ttft_p50_ms),
            "ttft_p99_ms": _finite(self.ttft_p99_ms),
            "load_imbalance": _finite(self.load_imbalance),
            "decision_p50_us": _finite(self.decision_p50_us),
            "decision_p99_us": _finite(self.decision_p99_us),
            "route_sources": dict(self.route_sources),
            "reasons": dict(self.reasons),
            "worker_prefill_tokens": list(self.worker_prefill_tokens),
            "predicted": self.predicted,
            "actual_over_predicted": _finite(self.actual_over_predicted),
            "silent_zero_share": _finite(self.silent_zero_share),
            "workers_per_group": _finite(self.workers_per_group),
            "missed_elsewhere": _finite(self.missed_elsewhere),
        }


def _finite(value: float) -> float | None:
    """JSON has no NaN: an undefined figure is null."""
    return round(value, 6) if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class Spread:
    workers_per_group: float  # mean over groups of the distinct workers their requests went to
    missed_elsewhere: float  # share of routed requests whose worker held less of the prompt than another did


def spread(records: Sequence[RequestRecord]) -> Spread:
    """How far each prefix group was spread, and how often a cached prefix elsewhere was missed
    (routed requests only; requests of no known group count toward the second figure alone)."""
    routed = [r for r in records if r.worker >= 0]
    workers: dict[int, set[int]] = {}
    for r in routed:
        if r.group >= 0:
            workers.setdefault(r.group, set()).add(r.worker)
    per_group = sum(len(w) for w in workers.values()) / len(workers) if workers else math.nan
    missed = sum(1 for r in routed if r.best_cached_tokens > r.cached_tokens)
    return Spread(per_group, missed / len(routed) if routed else math.nan)


def summarize(run: PolicyRun) -> PolicySummary:
    routed = [r for r in run.records if r.worker >= 0]
    input_tokens = sum(r.input_tokens for r in routed)
    ttfts_ms = [r.ttft_s * 1000.0 for r in routed]
    decisions_us = [r.decision_s * 1e6 for r in run.records]
    loads = run.worker_prefill_tokens
    mean_load = sum(loads) / len(loads) if loads else 0.0
    sourced = [r for r in run.records if r.route_source != NO_SOURCE]
    predicted = [r for r in routed if r.predicted_tokens]
    predicted_tokens = sum(r.predicted_tokens or 0 for r in predicted)
    spread_of = spread(run.records)
    return PolicySummary(
        policy=run.policy,
        requests=len(run.records),
        unrouted=len(run.records) - len(routed),
        hit_rate=sum(r.cached_tokens for r in routed) / input_tokens if input_tokens else math.nan,
        ttft_mean_ms=sum(ttfts_ms) / len(ttfts_ms) if ttfts_ms else math.nan,
        ttft_p50_ms=percentile(ttfts_ms, 50),
        ttft_p99_ms=percentile(ttfts_ms, 99),
        load_imbalance=max(loads) / mean_load if mean_load > 0 else math.nan,
        decision_p50_us=percentile(decisions_us, 50),
        decision_p99_us=percentile(decisions_us, 99),
        route_sources=dict(Counter(r.route_source for r in sourced).most_common()),
        reasons=dict(Counter(r.reason for r in sourced).most_common()),
        worker_prefill_tokens=tuple(loads),
        predicted=len(predicted),
        actual_over_predicted=(
            sum(r.cached_tokens for r in predicted) / predicted_tokens if predicted_tokens else math.nan
        ),
        silent_zero_share=(
            sum(1 for r in predicted if r.cached_tokens == 0) / len(predicted) if predicted else math.nan
        ),
        workers_per_group=spread_of.workers_per_group,
        missed_elsewhere=spread_of.missed_elsewhere,
    )


def source_mix(summary: PolicySummary) -> str:
    """``kvcm 96% domain 4%`` (largest first), or ``-`` for a baseline."""
    total = sum(summary.route_sources.values())
    if not total:
        return NO_SOURCE
    return " ".join(f"{source} {_percent(n / total)}" for source, n in summary.route_sources.items())


def _percent(share: float) -> str:
    return "<1%" if 0 < share < 0.005 else f"{100 * share:.0f}%"


_COLUMNS = (
    ("policy", "<"),
    ("hit rate", ">"),
    ("TTFT mean", ">"),
    ("p50", ">"),
    ("p99 ms", ">"),
    ("imbalance", ">"),
    ("workers/group", ">"),
    ("missed elsewhere", ">"),
    ("decide p50", ">"),
    ("p99 µs", ">"),
    ("actual/pred", ">"),
    ("silent 0", ">"),
    ("route_source", "<"),
)


def _fmt(value: float, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else "n/a"


def format_table(summaries: Sequence[PolicySummary]) -> str:
    rows = [
        (
            s.policy,
            _fmt(100 * s.hit_rate, ".1f") + "%",
            _fmt(s.ttft_mean_ms, ".1f"),
            _fmt(s.ttft_p50_ms, ".1f"),
            _fmt(s.ttft_p99_ms, ".1f"),
            _fmt(s.load_imbalance, ".2f"),
            _fmt(s.workers_per_group, ".2f"),
            _fmt(100 * s.missed_elsewhere, ".1f") + "%",
            _fmt(s.decision_p50_us, ".0f"),
            _fmt(s.decision_p99_us, ".0f"),
            _fmt(s.actual_over_predicted, ".2f") if s.predicted else NO_SOURCE,
            _fmt(100 * s.silent_zero_share, ".1f") + "%" if s.predicted else NO_SOURCE,
            source_mix(s),
        )
        for s in summaries
    ]
    widths = [max(len(title), *(len(row[i]) for row in rows)) for i, (title, _) in enumerate(_COLUMNS)]
    lines = [
        "  ".join(f"{title:{align}{w}}" for (title, align), w in zip(_COLUMNS, widths, strict=True)).rstrip(),
    ]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        cells = (f"{cell:{align}{w}}" for cell, (_, align), w in zip(row, _COLUMNS, widths, strict=True))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class TargetCheck:
    target: str
    met: bool
    detail: str

    def line(self) -> str:
        return f"{'MET ' if self.met else 'MISS'}  {self.target}: {self.detail}"

    def to_json(self) -> dict[str, object]:
        return {"target": self.target, "met": self.met, "detail": self.detail}


def check_targets(summaries: Sequence[PolicySummary]) -> tuple[TargetCheck, ...]:
    """The quality targets (those whose policies were run): kvroute vs oracle, baselines, least-loaded."""
    by_name = {s.policy: s for s in summaries}
    kv = by_name.get(KVROUTE)
    if kv is None:
        return ()
    # Hit rate and TTFT are taken over the routed requests: a request kvroute left without a worker
    # is in neither, so every request must have been routed for them to say anything.
    checks = [
        TargetCheck(
            "every request routed to a worker",
            kv.unrouted == 0,
            f"{kv.unrouted} of {kv.requests} answered without a worker",
        )
    ]
    max_hit = by_name.get(MAX_HIT)
    if max_hit is not None:
        ratio = kv.hit_rate / max_hit.hit_rate if max_hit.hit_rate > 0 else math.nan
        checks.append(
            TargetCheck(
                f"hit rate >= {HIT_RATE_OF_MAX_HIT_MIN:.0%} of max-hit's",
                math.isfinite(ratio) and ratio >= HIT_RATE_OF_MAX_HIT_MIN,
                f"{100 * kv.hit_rate:.1f}% vs {100 * max_hit.hit_rate:.1f}% = "
                f"{shown_against(100 * ratio, 1, at_least=True):.1f}% of max-hit",
            )
        )
    others = [by_name[name] for name in PRACTICAL_BASELINES if name in by_name]
    if others:
        best = min(others, key=lambda s: s.ttft_mean_ms)
        checks.append(
            TargetCheck(
                "mean TTFT below every baseline (" + ", ".join(s.policy for s in others) + ")",
                all(kv.ttft_mean_ms < s.ttft_mean_ms for s in others),
                f"{kv.ttft_mean_ms:.1f} ms vs the best baseline {best.policy} {best.ttft_mean_ms:.1f} ms",
            )
        )
    oracle = by_name.get(ORACLE)
    if oracle is not None:
        for what, limit, mine, theirs in (
            ("mean", MEAN_OF_ORACLE_MAX, kv.ttft_mean_ms, oracle.ttft_mean_ms),
            ("p99", P99_OF_ORACLE_MAX, kv.ttft_p99_ms, oracle.ttft_p99_ms),
        ):
            checks.append(
                TargetCheck(
                    f"{what} TTFT <= {limit}x the TTFT oracle's",
                    mine <= limit * theirs,
                    f"{mine:.1f} ms vs {theirs:.1f} ms ({shown_against(mine / theirs, 2, at_least=False):.2f}x)",
                )
            )
    least = by_name.get(LEAST_LOADED)
    if least is not None:
        limit = P99_OF_LEAST_LOADED_MAX * least.ttft_p99_ms
        checks.append(
            TargetCheck(
                f"p99 TTFT <= {P99_OF_LEAST_LOADED_MAX}x least-loaded's",
                kv.ttft_p99_ms <= limit,
                f"{kv.ttft_p99_ms:.1f} ms vs {least.ttft_p99_ms:.1f} ms "
                f"({shown_against(kv.ttft_p99_ms / least.ttft_p99_ms, 2, at_least=False):.2f}x)",
            )
        )
    return tuple(checks)


def results_json(
    workload: Workload,
    cluster: ClusterSpec,
    summaries: Sequence[PolicySummary],
    checks: Sequence[TargetCheck],
    router_settings: Mapping[str, object],
) -> dict[str, object]:
    return {
        "workload": workload.to_json(),
        "cluster": cluster.to_json(),
        "router_settings": dict(router_settings),
        "policies": [s.to_json() for s in summaries],
        "targets": [c.to_json() for c in checks],
    }


def ready_out_dir(out_dir: Path) -> None:
    """Create ``out_dir`` and try a file in it: OSError (its ``strerror`` the reason) when the run's
    results could not be written there, found before the run instead of after it."""
    if out_dir.exists() and not out_dir.is_dir():  # mkdir would call it "File exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out_dir):
        pass


def write_results(out_dir: Path, payload: Mapping[str, object]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def write_chart(out_dir: Path, summaries: Sequence[PolicySummary]) -> Path:
    """A 2×2 PNG: hit rate, simulated TTFT (mean/p50/p99), load imbalance, decision latency (log)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CHART_FILE
    names = [s.policy for s in summaries]
    colors = ["tab:green" if n == KVROUTE else "tab:gray" if n == ORACLE else "tab:blue" for n in names]
    x = list(range(len(names)))
    with png(path, "kvroute demo: policies on identical arrivals", 2, 2, figsize=(12, 8)) as (_, axes):
        ax = axes[0][0]
        ax.bar(x, [100 * s.hit_rate for s in summaries], color=colors)
        ax.set_title("prefix hit rate (%)")
        ax = axes[0][1]
        width = 0.27
        for offset, label, values in (
            (-width, "mean", [s.ttft_mean_ms for s in summaries]),
            (0.0, "p50", [s.ttft_p50_ms for s in summaries]),
            (width, "p99", [s.ttft_p99_ms for s in summaries]),
        ):
            ax.bar([i + offset for i in x], values, width, label=label)
        ax.set_title("simulated TTFT (ms)")
        ax.legend()
        ax = axes[1][0]
        ax.bar(x, [s.load_imbalance for s in summaries], color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title("load imbalance (max / mean prefill tokens)")
        ax = axes[1][1]
        ax.bar([i - 0.2 for i in x], [s.decision_p50_us for s in summaries], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [s.decision_p99_us for s in summaries], 0.4, label="p99")
        ax.set_yscale("log")
        ax.set_title("decision latency (µs, real)")
        ax.legend()
        for row in axes:
            for ax in row:
                ax.set_xticks(x)
                ax.set_xticklabels(names, rotation=20, ha="right")
    return path
