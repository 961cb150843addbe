"""P7: the gRPC sidecar under closed-loop load — is every caller answered by its deadline?

The sidecar (``router.sidecar.Sidecar`` over a router, as ``kvroute serve`` runs it, on this
process's one core) against the simulators in the separate process. Each level is a closed
loop of N grpcio asyncio callers (one channel, a client deadline on every call, each
request with ``budget_ms`` = BUDGET_MS), a bounded number of calls and a wall-clock bound. The
callers run in a child process of their own, on the simulators' CPUs, so this process's CPU
(reported per call) is the sidecar's and its GIL is not shared with the clients.

Lateness is the sidecar's own: from its handler's receipt of a call to its serialised reply,
less the call's deadline at receipt (min(budget, the client's remaining time)); gRPC's queueing
before the handler is in the client's latency, reported beside it. A call with no answer is
one the client saw end in an error (refused, timed out, failed). Each level is repeated at once
against a grpcio echo server with the sidecar's thread pool in this process (the echo floor):
the calls it leaves unanswered are gRPC's own limit on this core, not kvroute's.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace

import grpc
import trio

from kvroute_sim.bench import thread_cpu
from kvroute_sim.bench.callers import CallerResults, Level, caller_process
from kvroute_sim.bench.harness import ClusterView, prime, router_config
from kvroute_sim.bench.harness import Requests as RouterRequests
from kvroute_sim.bench.relay import BRIDGED_THREAD_PREFIX as BRIDGED_RELAY_THREADS
from kvroute_sim.bench.relay import THREAD_PREFIX as RELAY_THREADS
from kvroute_sim.bench.results import BenchReport, Figure, Verdict
from kvroute_sim.stats import Summary, percentile, shown_against
from router.api import open_router
from router.config import KvrouteConfig
from router.serve_cli import freeze_start_up
from router.sidecar import CallTiming, Sidecar
from router.targets import HostPort
from router.transport.grpc_server import method_handlers
from router.wire import router_v1_pb2
from router.wire.paths import ROUTER_ROUTE

LEVELS = (1, 8, 64, 256)  # concurrent callers
BUDGET_MS = 30
CLIENT_DEADLINE_S = 0.1  # a frontend gives its router call a few times the routing budget
# At most this long after a level's clients returned, for the calls they gave up on to leave the sidecar.
SETTLE_S = 5.0
LATE_SLACK_S = 0.005  # "on time": answered within the call's deadline plus this
WITHIN_TARGET = 0.99
FIGURE_TIMEOUT_S = 300.0
# This process's threads by role (thread_cpu.split): the handler threads of the sidecar, of the echo
# server and of P8's relays, the trio loop (the bench's main thread: the router's and the
# sidecar's trio side), grpcio's own threads (its server polling threads and client spin threads are
# unnamed Python threads; the event engine's are C threads), the rest (the bench's own waits on the
# callers' process, trio's worker threads).
THREAD_ROLES = (
    ("handlers", "kvroute-sidecar"),
    ("handlers", "p7-echo"),
    ("handlers", RELAY_THREADS),
    ("handlers", BRIDGED_RELAY_THREADS),
    ("trio loop", "MainThread"),
    ("grpcio", "Thread-"),
    ("grpcio", "event_engine"),
    ("grpcio", "grpc_"),
)


@dataclass(frozen=True, slots=True)
class LoadSizes:
    calls_per_level: tuple[int, ...]  # one per LEVELS entry
    max_level_s: float  # a level stops starting calls after this long, whatever is left
    warm_up: int  # routes before the sidecar starts (in process), then as many single-caller calls


@dataclass(frozen=True, slots=True)
class EchoFloor:
    """A grpcio server with the sidecar's thread pool and limits, answering every call with fixed
    bytes, under the same closed loop: what gRPC alone leaves unanswered on this process's core."""

    calls: int
    seconds: float
    no_answer: int
    client_p99_ms: float
    thread_cpu_s: Mapping[str, float] = field(default_factory=dict)  # by THREAD_ROLES role (empty off Linux)

    def to_json(self) -> dict[str, object]:
        return {
            "calls": self.calls,
            "calls_per_s": self.calls / self.seconds if self.seconds else 0.0,
            "no_answer": self.no_answer,
            "client_p99_ms": self.client_p99_ms,
            "thread_cpu_us_per_call": per_call_us(self.thread_cpu_s, self.calls),
        }


def per_call_us(seconds: Mapping[str, float], calls: int) -> dict[str, float]:
    return {role: s * 1e6 / calls for role, s in seconds.items()} if calls else {}


def _p50_max(values: Sequence[float]) -> tuple[float, float]:
    return (percentile(values, 50), max(values)) if values else (0.0, 0.0)


@dataclass(frozen=True, slots=True)
class LateSplit:
    """Where the calls answered after their deadline + LATE_SLACK_S, or handed to the router and never
    answered, spent their time (ms, p50 and max over them): receipt to the trio thread taking the call,
    the router's own decision, the decision settled to the serialised reply (the last two: answered
    calls). A call answered overloaded at receipt has none of the three."""

    late: int
    shed_at_receipt: int
    late_by_ms: tuple[float, float]
    to_trio_ms: tuple[float, float]
    router_ms: tuple[float, float]
    way_back_ms: tuple[float, float]

    @classmethod
    def of(cls, timings: Iterable[CallTiming]) -> LateSplit:
        late = [t for t in timings if not t.answered or t.lateness_s > LATE_SLACK_S]
        shed = [t for t in late if t.answered and t.handed_s is None]
        decided = [t for t in late if t.answered and t.handed_s is not None]
        return cls(
            late=len(late),
            shed_at_receipt=len(shed),
            late_by_ms=_p50_max([t.lateness_s * 1e3 for t in late]),
            to_trio_ms=_p50_max([t.handed_s * 1e3 for t in late if t.handed_s is not None]),
            router_ms=_p50_max([t.router_s * 1e3 for t in decided]),
            way_back_ms=_p50_max([(t.way_back_s or 0.0) * 1e3 for t in decided]),
        )

    def to_json(self) -> dict[str, object]:
        return {
            "late": self.late,
            "shed_at_receipt": self.shed_at_receipt,
            "late_by_ms_p50_max": self.late_by_ms,
            "to_trio_ms_p50_max": self.to_trio_ms,
            "router_ms_p50_max": self.router_ms,
            "way_back_ms_p50_max": self.way_back_ms,
        }


class CollectionPauses:
    """The wall time (s) of each of this process's collections while a block runs, by generation: a
    collection holds the GIL, so every thread of the sidecar waits it out."""

    __slots__ = ("_by_generation",)

    def __init__(self) -> None:
        self._by_generation: dict[int, list[float]] = {}

    def of(self, generation: int) -> tuple[float, ...]:
        return tuple(self._by_generation.get(generation, ()))

    @property
    def full(self) -> tuple[float, ...]:
        return self.of(FULL_GENERATION)

    def add(self, generation: int, seconds: float) -> None:
        self._by_generation.setdefault(generation, []).append(seconds)


FULL_GENERATION = 2  # CPython's oldest generation: a collection of it walks every tracked object


def pauses_cell(pauses: Sequence[float]) -> str:
    """A table cell for a run's collections of one generation: how many, and the longest in ms."""
    return f"{len(pauses)} ({max(pauses, default=0.0) * 1e3:.1f})"


@contextmanager
def collections_timed() -> Iterator[CollectionPauses]:
    """This process's collections of every generation while the block runs (``CollectionPauses``)."""
    pauses = CollectionPauses()
    started: list[float] = []

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.add(info["generation"], time.perf_counter() - started.pop())

    gc.callbacks.append(timed)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timed)


@dataclass(frozen=True, slots=True)
class LevelResult:
    callers: int
    calls: int
    seconds: float
    client_ms: tuple[float, ...]  # answered calls, as the client saw them
    errors: Counter[str]
    outcomes: Counter[str]  # "route_source/reason" of the answered calls
    # The sidecar's own, of every call it made a reply for (its client may have gone by then: client_gone)
    # and of every call it handed to the router and got no reply for (CallTiming.answered false).
    timings: tuple[CallTiming, ...]
    sidecar_cpu_s: float  # this process's CPU over the level: the sidecar, the router, grpc's threads
    caller_cpu_s: float  # the caller process's CPU over the level
    echo: EchoFloor  # the same level against a grpcio echo server with the sidecar's thread pool
    full_collection_s: tuple[float, ...] = ()  # this process's gen-2 collections during the level
    waited: int = 0  # calls that found the in-flight limit reached and waited for a place
    client_gone: int = 0  # of the timed calls, those whose client had gone when the reply was made
    shed_after_wait: int = 0  # of those, answered overloaded when no place came in time
    thread_cpu_s: Mapping[str, float] = field(default_factory=dict)  # by THREAD_ROLES role (empty off Linux)
    not_started: int = 0  # calls the level planned and never started: it ran past max_level_s
    # Calls that reached the sidecar's handler with none of the client's deadline left: they waited it
    # out in gRPC's queues (the client's, the transport, the server's thread pool), the client had
    # counted them unanswered, and the sidecar ended them unread (SidecarStats.expired_at_receipt).
    expired_at_receipt: int = 0

    @property
    def late_split(self) -> LateSplit:
        return LateSplit.of(self.timings)

    @property
    def no_answer(self) -> int:
        return sum(self.errors.values())

    @property
    def budget_gone(self) -> int:
        """Calls that reached the sidecar's handler with none of their budget left while their client
        still waited: they waited it out for a handler thread (gRPC's queueing, which P7's on-time
        share, judged from the receipt, leaves out: such a call is on time if answered at once). The
        calls whose client had already gone are ``expired_at_receipt``, not timed."""
        return sum(t.allowed_s <= 0.0 for t in self.timings)

    @property
    def within_share(self) -> float:
        if not self.timings:
            return 0.0
        return sum(t.answered and t.lateness_s <= LATE_SLACK_S for t in self.timings) / len(self.timings)

    def share(self, *, source: str | None = None, reason: str | None = None) -> float:
        total = sum(self.outcomes.values())
        matching = sum(
            n
            for key, n in self.outcomes.items()
            if (source is None or key.split("/", 1)[0] == source) and (reason is None or key.split("/", 1)[1] == reason)
        )
        return matching / total if total else 0.0

    @property
    def sidecar_cpu_ms_per_call(self) -> float:
        return self.sidecar_cpu_s * 1e3 / self.calls if self.calls else 0.0

    @property
    def p99_lateness_ms(self) -> float:
        return percentile([t.lateness_s * 1e3 for t in self.timings], 99)

    @property
    def met(self) -> bool:
        # A level cut short at max_level_s had a sidecar too slow to take its calls: never met.
        return (
            self.no_answer == 0
            and self.not_started == 0
            and bool(self.timings)
            and self.within_share >= WITHIN_TARGET
        )

    def to_json(self) -> dict[str, object]:
        sidecar_ms = [t.elapsed_s * 1e3 for t in self.timings]
        return {
            "callers": self.callers,
            "calls": self.calls,
            "seconds": self.seconds,
            "calls_per_s": self.calls / self.seconds if self.seconds else 0.0,
            "answered_by_sidecar": sum(t.answered for t in self.timings),  # a reply made (client_gone ones included)
            "unanswered_by_sidecar": sum(not t.answered for t in self.timings),  # handed, no reply: timed out
            "client_gone": self.client_gone,
            "reached_sidecar_past_deadline": self.expired_at_receipt,
            "reached_sidecar_with_budget_gone": self.budget_gone,
            "within_deadline_plus_5ms": self.within_share,
            "no_answer": self.no_answer,
            "errors": dict(self.errors.most_common()),
            "kvcm_share": self.share(source="kvcm"),
            "overloaded_share": self.share(reason="overloaded"),
            "p99_lateness_ms": self.p99_lateness_ms,
            "sidecar_cpu_ms_per_call": self.sidecar_cpu_ms_per_call,
            "caller_cpu_ms_per_call": self.caller_cpu_s * 1e3 / self.calls if self.calls else 0.0,
            "sidecar_ms": Summary.of(sidecar_ms).to_json() if sidecar_ms else None,
            "client_ms": Summary.of(self.client_ms).to_json() if self.client_ms else None,
            "outcomes": dict(self.outcomes.most_common()),
            "echo_floor": self.echo.to_json(),
            "late_split": self.late_split.to_json(),
            "full_collections_ms": [round(p * 1e3, 1) for p in self.full_collection_s],
            "waited_for_place": self.waited,
            "shed_after_wait": self.shed_after_wait,
            "not_started": self.not_started,
            "thread_cpu_us_per_call": per_call_us(self.thread_cpu_s, self.calls),
            "met": self.met,
        }


def route_requests(view: ClusterView, label: str, count: int, budget_ms: int = BUDGET_MS) -> tuple[bytes, ...]:
    """``count`` serialised Route requests over the seeded prompts in turn (built before the clock runs)."""
    return tuple(
        router_v1_pb2.RouteRequest(
            request_id=f"{label}-{i}",
            block_cache_keys=view.prompts[i % len(view.prompts)],
            block_size=view.block_size,
            budget_ms=budget_ms,
        ).SerializeToString()
        for i in range(count)
    )


def reply_outcomes(replies: Iterable[bytes]) -> Counter[str]:
    """``route_source/reason`` counts of serialised Route replies."""
    outcomes: Counter[str] = Counter()
    for raw in replies:
        decision = router_v1_pb2.RouteDecision.FromString(raw)
        outcomes[f"{decision.route_source}/{decision.reason}"] += 1
    return outcomes


@asynccontextmanager
async def serving_sidecar(
    view: ClusterView, label: str, warm_up: int
) -> AsyncIterator[tuple[Sidecar, HostPort, KvrouteConfig]]:
    """A router over ``view`` primed with ``warm_up`` decisions, behind a sidecar on a loopback port (the
    sidecar, its address and the router's configuration); both stop when the block ends, under the
    figure's time limit."""
    config = router_config(view, status_ttl_s=None)
    config = replace(config, serve=replace(config.serve, grpc_listen="127.0.0.1:0"))
    with trio.fail_after(FIGURE_TIMEOUT_S):
        async with open_router(config) as router, trio.open_nursery() as nursery:
            await prime(router, RouterRequests(view, f"{label}-prime"), warm_up)
            sidecar = Sidecar(router, config, keep_call_timings=True)
            bound = await nursery.start(sidecar.run)
            # As `kvroute serve` once started: the bench's heap (earlier figures, the priming) leaves the
            # collector's view for the figure, and full collections are as rare.
            thresholds = gc.get_threshold()
            freeze_start_up()
            try:
                yield sidecar, bound, config
            finally:
                gc.unfreeze()
                gc.set_threshold(*thresholds)
                nursery.cancel_scope.cancel()


def _level_result(
    callers: int,
    seconds: float,
    results: Sequence[CallerResults],
    timings: list[CallTiming],
    sidecar_cpu_s: float,
    caller_cpu_s: float,
    echo: EchoFloor,
    full_collection_s: Sequence[float],
    waits: tuple[int, int] = (0, 0),
    thread_cpu_s: Mapping[str, float] | None = None,
    client_gone: int = 0,
    not_started: int = 0,
    expired_at_receipt: int = 0,
) -> LevelResult:
    outcomes = reply_outcomes(raw for r in results for raw in r.replies)
    return LevelResult(
        callers=callers,
        calls=sum(len(r.replies) + len(r.errors) for r in results),
        seconds=seconds,
        client_ms=tuple(ms for r in results for ms in r.client_ms),
        errors=Counter(code for r in results for code in r.errors),
        outcomes=outcomes,
        timings=tuple(timings),
        sidecar_cpu_s=sidecar_cpu_s,
        caller_cpu_s=caller_cpu_s,
        echo=echo,
        full_collection_s=tuple(full_collection_s),
        waited=waits[0],
        shed_after_wait=waits[1],
        thread_cpu_s=dict(thread_cpu_s or {}),
        client_gone=client_gone,
        not_started=not_started,
        expired_at_receipt=expired_at_receipt,
    )


async def _run(view: ClusterView, sizes: LoadSizes, caller_cpus: Set[int] | None) -> list[LevelResult]:
    levels: list[LevelResult] = []
    async with serving_sidecar(view, "p7", sizes.warm_up) as (sidecar, bound, config):
        echo_server, echo_target = _echo_server(
            config.serve.grpc_max_workers, config.serve.grpc_max_concurrent_rpcs
        )
        try:
            with caller_process(caller_cpus) as callers_child:
                warm = Level(
                    str(bound),
                    route_requests(view, "p7-warm", sizes.warm_up),
                    1,
                    sizes.max_level_s,
                    CLIENT_DEADLINE_S,
                )
                await trio.to_thread.run_sync(callers_child.run, warm)
                await trio.to_thread.run_sync(callers_child.run, replace(warm, target=echo_target))
                sidecar.take_call_timings()  # the warm-up's, dropped
                for callers, calls in zip(LEVELS, sizes.calls_per_level, strict=True):
                    level = Level(
                        str(bound),
                        route_requests(view, f"p7-{callers}", calls),
                        callers,
                        sizes.max_level_s,
                        CLIENT_DEADLINE_S,
                    )
                    threads_before = await trio.to_thread.run_sync(thread_cpu.snapshot)
                    cpu_before = time.process_time()
                    before = sidecar.stats()
                    with collections_timed() as pauses:
                        run = await trio.to_thread.run_sync(callers_child.run, level)
                        # Calls its clients gave up on may still wait for a handler: this level's, not the next's.
                        await trio.to_thread.run_sync(sidecar.wait_idle, SETTLE_S)
                    cpu_s = time.process_time() - cpu_before
                    threads_after = await trio.to_thread.run_sync(thread_cpu.snapshot)
                    after = sidecar.stats()
                    waits = (
                        after.waited_for_place - before.waited_for_place,
                        after.shed_after_wait - before.shed_after_wait,
                    )
                    client_gone = after.client_gone - before.client_gone
                    expired = after.expired_at_receipt - before.expired_at_receipt
                    timings = sidecar.take_call_timings()
                    echo_cpu_before = time.process_time()
                    echo = await trio.to_thread.run_sync(callers_child.run, replace(level, target=echo_target))
                    echo_cpu_s = time.process_time() - echo_cpu_before
                    echo_threads_after = await trio.to_thread.run_sync(thread_cpu.snapshot)
                    echo_floor = EchoFloor(
                        sum(len(r.replies) + len(r.errors) for r in echo.results),
                        echo.seconds,
                        sum(len(r.errors) for r in echo.results),
                        percentile([ms for r in echo.results for ms in r.client_ms], 99),
                        thread_cpu.split(threads_after, echo_threads_after, THREAD_ROLES, process_s=echo_cpu_s),
                    )
                    levels.append(
                        _level_result(
                            callers,
                            run.seconds,
                            run.results,
                            timings,
                            cpu_s,
                            run.cpu_s,
                            echo_floor,
                            pauses.full,
                            waits,
                            thread_cpu.split(threads_before, threads_after, THREAD_ROLES, process_s=cpu_s),
                            client_gone,
                            run.not_started,
                            expired,
                        )
                    )
        finally:
            echo_server.stop(grace=None)
    return levels


def _echo_server(workers: int, max_concurrent_rpcs: int) -> tuple[grpc.Server, str]:
    """A grpcio server like the sidecar's (thread pool, concurrency limit) answering every Route
    call with the same bytes; started, with its address."""
    reply = router_v1_pb2.RouteDecision(request_id="echo", route_source="domain", reason="overloaded")
    body = reply.SerializeToString()
    server = grpc.server(
        ThreadPoolExecutor(max_workers=workers, thread_name_prefix="p7-echo"),
        handlers=[method_handlers({ROUTER_ROUTE: lambda _data, _context: body})],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[("grpc.so_reuseport", 0)],
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _curve(levels: Sequence[LevelResult]) -> str:
    header = (
        "callers | calls | calls/s | within dl+5ms | no answer | reached past deadline | budget gone at receipt"
        " | kvcm | overloaded"
        " | p99 late ms | client p99 ms | sidecar CPU ms/call | waited (shed after) | echo unanswered"
        " | echo client p99 ms | unanswered by status | not started"
    )
    lines = [header]
    for lv in levels:
        client_p99 = percentile(lv.client_ms, 99)
        # Rounded as the row rounds it: a missed level's 98.97 % printed as 99.0% here.
        on_time = f"{shown_against(100 * lv.within_share, 1, at_least=True):.1f}%"
        lines.append(
            f"{lv.callers:>7} | {lv.calls:>5} | {lv.calls / lv.seconds:>7,.0f} | {on_time:>13} | "
            f"{lv.no_answer:>9} | {lv.expired_at_receipt:>21} | {lv.budget_gone:>22} | "
            f"{lv.share(source='kvcm'):>4.0%} | {lv.share(reason='overloaded'):>10.1%} | "
            f"{lv.p99_lateness_ms:>11.1f} | {client_p99:>13.1f} | {lv.sidecar_cpu_ms_per_call:>18.3f} | "
            f"{f'{lv.waited} ({lv.shed_after_wait})':>19} | {lv.echo.no_answer:>15} | {lv.echo.client_p99_ms:>18.1f} | "
            + (", ".join(f"{code} {n}" for code, n in lv.errors.most_common()) or "-")
            + f" | {f'cut short: {lv.not_started}' if lv.not_started else '-'}"
        )
    return "\n".join(lines)


def _thread_table(levels: Sequence[LevelResult]) -> str | None:
    """µs of CPU per call by thread role, the sidecar's level beside the echo server's (None off Linux)."""
    if not any(lv.thread_cpu_s for lv in levels):
        return None
    roles = [*dict.fromkeys(role for role, _ in THREAD_ROLES), "other", thread_cpu.ENDED]
    lines = [
        "callers | sidecar µs/call: " + " / ".join(roles) + " = total | echo µs/call: " + " / ".join(roles) + " = total"
    ]
    for lv in levels:
        cells = []
        for seconds, calls in ((lv.thread_cpu_s, lv.calls), (lv.echo.thread_cpu_s, lv.echo.calls)):
            us = per_call_us(seconds, calls)
            cells.append(" / ".join(f"{us.get(role, 0.0):.0f}" for role in roles) + f" = {sum(us.values()):.0f}")
        lines.append(f"{lv.callers:>7} | " + " | ".join(cells))
    return "\n".join(lines)


def _late_table(levels: Sequence[LevelResult]) -> str:
    lines = [
        "callers | late | of them shed at receipt | late by ms p50/max | receipt to trio ms p50/max"
        " | router ms p50/max | way back ms p50/max | full collections (max ms)"
    ]
    for lv in levels:
        split = lv.late_split
        pauses = lv.full_collection_s
        lines.append(
            f"{lv.callers:>7} | {split.late:>4} | {split.shed_at_receipt:>23} | "
            + " | ".join(
                f"{p50:.1f} / {top:.1f}"
                for p50, top in (split.late_by_ms, split.to_trio_ms, split.router_ms, split.way_back_ms)
            )
            + f" | {pauses_cell(pauses)}"
        )
    return "\n".join(lines)


def measure(report: BenchReport, view: ClusterView, sizes: LoadSizes, caller_cpus: Set[int] | None) -> None:
    """``caller_cpus``: where the caller process runs (the simulators' CPUs: not the sidecar's)."""
    levels = trio.run(_run, view, sizes, caller_cpus)
    met = all(lv.met for lv in levels)
    result = "; ".join(
        f"{lv.callers}: {shown_against(100 * lv.within_share, 1, at_least=True):.1f}% on time, "
        f"{lv.no_answer} unanswered, "
        f"{lv.share(reason='overloaded'):.0%} overloaded"
        + (f", cut short: {lv.not_started} not started" if lv.not_started else "")
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
    report.tables["P7 late calls: where their time went"] = _late_table(levels)
    threads = _thread_table(levels)
    if threads is not None:
        report.tables[
            "P7 CPU per call by thread (this process: the sidecar's level, then the echo server's; ended: threads"
            " that ended within the level, grpcio's client spin threads)"
        ] = threads
