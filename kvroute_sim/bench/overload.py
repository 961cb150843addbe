"""P7: the gRPC sidecar under closed-loop load — is every caller answered by its deadline?

The sidecar (``router.sidecar.Sidecar`` over a router, as ``kvroute serve`` runs it, on this
process's one core) against the simulators in the separate process. Each level is a closed
loop of N plain grpcio client threads (one channel, a client deadline on every call, each
request with ``budget_ms`` = BUDGET_MS), a bounded number of calls and a wall-clock bound.

Lateness is the sidecar's own: from its handler's receipt of a call to its serialised reply,
less the call's deadline at receipt (min(budget, the client's remaining time)); gRPC's queueing
before the handler is in the client's latency, reported beside it. A call with no answer is
one the client saw end in an error (refused, timed out, failed).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc
import trio

from kvroute_sim.bench.harness import ClusterView, prime, router_config
from kvroute_sim.bench.harness import Requests as RouterRequests
from kvroute_sim.bench.results import BenchReport, Figure, Verdict
from kvroute_sim.stats import Summary, percentile
from router.api import open_router
from router.sidecar import CallTiming, Sidecar
from router.wire import router_v1_pb2
from router.wire.paths import ROUTER_ROUTE

LEVELS = (1, 8, 64, 256)  # concurrent callers
BUDGET_MS = 30
CLIENT_DEADLINE_S = 0.1  # a frontend gives its router call a few times the routing budget
LATE_SLACK_S = 0.005  # "on time": answered within the call's deadline plus this
WITHIN_TARGET = 0.99
FIGURE_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class LoadSizes:
    calls_per_level: tuple[int, ...]  # one per LEVELS entry
    max_level_s: float  # a level stops starting calls after this long, whatever is left
    warm_up: int  # routes before the sidecar starts (in process), then as many single-caller calls


@dataclass(slots=True)
class _CallerResults:
    """What one client thread saw; merged after the level (no shared state while it runs)."""

    replies: list[bytes] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # grpc status names


@dataclass(frozen=True, slots=True)
class LevelResult:
    callers: int
    calls: int
    seconds: float
    client_ms: tuple[float, ...]  # answered calls, as the client saw them
    errors: Counter[str]
    outcomes: Counter[str]  # "route_source/reason" of the answered calls
    timings: tuple[CallTiming, ...]  # the sidecar's own, answered calls

    @property
    def no_answer(self) -> int:
        return sum(self.errors.values())

    @property
    def within_share(self) -> float:
        if not self.timings:
            return 0.0
        return sum(t.lateness_s <= LATE_SLACK_S for t in self.timings) / len(self.timings)

    def share(self, *, source: str | None = None, reason: str | None = None) -> float:
        total = sum(self.outcomes.values())
        matching = sum(
            n
            for key, n in self.outcomes.items()
            if (source is None or key.split("/", 1)[0] == source) and (reason is None or key.split("/", 1)[1] == reason)
        )
        return matching / total if total else 0.0

    @property
    def p99_lateness_ms(self) -> float:
        return percentile([t.lateness_s * 1e3 for t in self.timings], 99)

    @property
    def met(self) -> bool:
        return self.no_answer == 0 and bool(self.timings) and self.within_share >= WITHIN_TARGET

    def to_json(self) -> dict[str, object]:
        sidecar_ms = [t.elapsed_s * 1e3 for t in self.timings]
        return {
            "callers": self.callers,
            "calls": self.calls,
            "seconds": self.seconds,
            "calls_per_s": self.calls / self.seconds if self.seconds else 0.0,
            "answered_by_sidecar": len(self.timings),
            "within_deadline_plus_5ms": self.within_share,
            "no_answer": self.no_answer,
            "errors": dict(self.errors.most_common()),
            "kvcm_share": self.share(source="kvcm"),
            "overloaded_share": self.share(reason="overloaded"),
            "p99_lateness_ms": self.p99_lateness_ms,
            "sidecar_ms": Summary.of(sidecar_ms).to_json() if sidecar_ms else None,
            "client_ms": Summary.of(self.client_ms).to_json() if self.client_ms else None,
            "outcomes": dict(self.outcomes.most_common()),
            "met": self.met,
        }


def route_requests(view: ClusterView, label: str, count: int, budget_ms: int = BUDGET_MS) -> list[bytes]:
    """``count`` serialised Route requests over the seeded prompts in turn (built before the clock runs)."""
    return [
        router_v1_pb2.RouteRequest(
            request_id=f"{label}-{i}",
            block_cache_keys=view.prompts[i % len(view.prompts)],
            block_size=view.block_size,
            budget_ms=budget_ms,
        ).SerializeToString()
        for i in range(count)
    ]


def _drive_level(
    channel: grpc.Channel, requests: Sequence[bytes], callers: int, max_s: float
) -> tuple[float, list[_CallerResults]]:
    """``callers`` threads, each calling again as soon as it is answered, until the requests are used
    up or ``max_s`` has passed; the elapsed seconds and each thread's results."""
    call = channel.unary_unary(ROUTER_ROUTE, None, None)
    serial = itertools.count()  # next() on it is atomic under the GIL
    results = [_CallerResults() for _ in range(callers)]
    stop_at = time.monotonic() + max_s

    def caller(into: _CallerResults) -> None:
        while time.monotonic() < stop_at:
            i = next(serial)
            if i >= len(requests):
                return
            start = time.perf_counter()
            try:
                reply: bytes = call(requests[i], timeout=CLIENT_DEADLINE_S)
            except grpc.RpcError as exc:
                into.errors.append(exc.code().name)
            else:
                into.client_ms.append((time.perf_counter() - start) * 1e3)
                into.replies.append(reply)

    threads = [threading.Thread(target=caller, args=(r,), name=f"p7-caller-{n}") for n, r in enumerate(results)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, results


def _level_result(
    callers: int, seconds: float, results: list[_CallerResults], timings: list[CallTiming]
) -> LevelResult:
    outcomes: Counter[str] = Counter()
    for r in results:
        for raw in r.replies:
            decision = router_v1_pb2.RouteDecision.FromString(raw)
            outcomes[f"{decision.route_source}/{decision.reason}"] += 1
    return LevelResult(
        callers=callers,
        calls=sum(len(r.replies) + len(r.errors) for r in results),
        seconds=seconds,
        client_ms=tuple(ms for r in results for ms in r.client_ms),
        errors=Counter(code for r in results for code in r.errors),
        outcomes=outcomes,
        timings=tuple(timings),
    )


async def _run(view: ClusterView, sizes: LoadSizes) -> list[LevelResult]:
    config = router_config(view, status_ttl_s=None)
    config = replace(config, serve=replace(config.serve, grpc_listen="127.0.0.1:0"))
    levels: list[LevelResult] = []
    with trio.fail_after(FIGURE_TIMEOUT_S):
        async with open_router(config) as router, trio.open_nursery() as nursery:
            await prime(router, RouterRequests(view, "p7-prime"), sizes.warm_up)
            sidecar = Sidecar(router, config)
            bound = await nursery.start(sidecar.run)
            channel = grpc.insecure_channel(str(bound), options=[("grpc.enable_retries", 0)])
            try:
                warm = route_requests(view, "p7-warm", sizes.warm_up)
                await trio.to_thread.run_sync(_drive_level, channel, warm, 1, sizes.max_level_s)
                sidecar.take_call_timings()  # the warm-up's, dropped
                for callers, calls in zip(LEVELS, sizes.calls_per_level, strict=True):
                    requests = route_requests(view, f"p7-{callers}", calls)
                    seconds, results = await trio.to_thread.run_sync(
                        _drive_level, channel, requests, callers, sizes.max_level_s
                    )
                    levels.append(_level_result(callers, seconds, results, sidecar.take_call_timings()))
            finally:
                channel.close()
                nursery.cancel_scope.cancel()
    return levels


def _curve(levels: Sequence[LevelResult]) -> str:
    header = (
        "callers | calls | calls/s | within dl+5ms | no answer | kvcm | overloaded | p99 late ms | client p99 ms"
        " | unanswered by status"
    )
    lines = [header]
    for lv in levels:
        client_p99 = percentile(lv.client_ms, 99)
        lines.append(
            f"{lv.callers:>7} | {lv.calls:>5} | {lv.calls / lv.seconds:>7,.0f} | {lv.within_share:>13.1%} | "
            f"{lv.no_answer:>9} | {lv.share(source='kvcm'):>4.0%} | {lv.share(reason='overloaded'):>10.1%} | "
            f"{lv.p99_lateness_ms:>11.1f} | {client_p99:>13.1f} | "
            + (", ".join(f"{code} {n}" for code, n in lv.errors.most_common()) or "-")
        )
    return "\n".join(lines)


def measure(report: BenchReport, view: ClusterView, sizes: LoadSizes) -> None:
    levels = trio.run(_run, view, sizes)
    met = all(lv.met for lv in levels)
    result = "; ".join(
        f"{lv.callers}: {lv.within_share:.1%} on time, {lv.no_answer} unanswered, "
        f"{lv.share(reason='overloaded'):.0%} overloaded"
        for lv in levels
    )
    report.figures.append(
        Figure(
            "P7",
            f"sidecar over loopback gRPC (sims in a separate process), closed loops of {', '.join(map(str, LEVELS))} "
            f"callers, budget {BUDGET_MS} ms, client deadline {CLIENT_DEADLINE_S * 1e3:.0f} ms; share answered "
            "within deadline + 5 ms, receipt to reply in the sidecar",
            result,
            f"≥ {WITHIN_TARGET:.0%} on time and none unanswered at every level",
            Verdict.MET if met else Verdict.MISSED,
            {
                "budget_ms": BUDGET_MS,
                "client_deadline_ms": CLIENT_DEADLINE_S * 1e3,
                "late_slack_ms": LATE_SLACK_S * 1e3,
                "levels": [lv.to_json() for lv in levels],
            },
        )
    )
    report.tables["P7 load curve (closed loop; lateness from the sidecar's receipt to its reply)"] = _curve(levels)
