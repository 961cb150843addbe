"""``kvroute demo --scenario kvcm-slow-budget``: the fixed deadline split against the learned one.

KVCM answers quickly for ``WARM_REQUESTS`` requests, then gets slow: GetHostCacheState answers close
to the request's budget (a delay drawn per request between ``QUERY_DELAY_S``, less what a query
cost beyond KVCM's own delay in the warm-up: loopback gRPC on a busy machine adds several ms). Worker status probes
take ``PROBE_DELAY_S``, and every request's prefix is stored at one worker (KVCM knows it, the shadow
index does not: a fall-through cannot find the hit elsewhere). One router per split runs on the same
cluster, and each request is routed by both, one after the other (the order alternates), with the
same KVCM delay: both splits see the same machine at the same moment, which on a busy machine
differs more from one run to the next than the splits do. The figures count the slow phase:

- fixed: every wait ends at ``deadline − max(1 ms, 10 % of the budget)``; a query answering
  after that, or probes arriving after it, lose the KVCM pick;
- learned: each wait leaves the later stages their measured time (the last one the measured tail,
  up to the reply leaving the router), so the query may run while the probes, the scoring and the
  reply still fit.

Printed side by side: the share routed from KVCM, the share routed to a holder of the prefix (hit
rate), and the share answered within the request's budget (deadline adherence).

``--scenario-scale`` scales the slow phase's requests (``requests_at``); the warm-up keeps its length,
since the learned split learns from it. ``--router-setting`` overrides go over both routers' settings,
except the ones the comparison sets itself (``FIXED_SETTINGS``).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import TextIO

import trio
import trio.testing

from kvroute_sim.demo.runner import (
    check_router_settings,
    load_router_config,
    open_kvroute,
    refuse_fixed_settings,
    router_settings,
)
from kvroute_sim.demo.workload import WorkloadSpec
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.kvcm import KvcmFaults
from kvroute_sim.sim.worker import WorkerFaults, WorkerSpec
from router.api import RouterHandle, open_router
from router.keys import block_keys
from router.transport.memory_adapter import MemoryNetwork
from router.types import RouteRequest, RouteSource, Stage
from router.wire import paths

NAME = "kvcm-slow-budget"
SUMMARY = "KVCM answers close to the budget: the fixed split against the learned one"
BUDGET_MS = 50.0
WARM_REQUESTS = 20
WARM_QUERY_DELAY_S = 0.005
QUERY_DELAY_S = (0.042, 0.048)  # uniform per request: around the fixed split's 45 ms wait end
PROBE_DELAY_S = 0.002
REQUESTS = 60  # in the slow phase
GAP_S = 0.02  # between one answer and the next request
WORKERS = 4
PROMPT_BLOCKS = 8
_SPEC = WorkloadSpec()
SPLITS = ("fixed", "learned")


@dataclass(frozen=True, slots=True)
class SplitFigures:
    split: str
    requests: int
    kvcm: int  # routed from KVCM
    hits: int  # routed to the worker holding the prefix
    within_budget: int  # answered within the request's budget (at the caller)
    query_overhead_s: float = 0.0  # a query's cost beyond KVCM's delay, measured in the warm-up

    def share(self, n: int) -> float:
        return n / self.requests if self.requests else 0.0


@dataclass(slots=True)
class _Tally:
    kvcm: int = 0
    hits: int = 0
    within: int = 0


async def measure_splits(
    splits: tuple[str, ...] = SPLITS,
    *,
    network: MemoryNetwork | None = None,
    requests: int = REQUESTS,
    overrides: Mapping[str, object] | None = None,
) -> list[SplitFigures]:
    """Route the warm-up, then ``requests`` seeded requests against a slow KVCM, each by one router per
    split (fresh routers on one fresh cluster: loopback gRPC, or ``network`` under a MockClock); count
    the slow ones per split. ``overrides`` go over every router's settings."""
    cluster = SimCluster([WorkerSpec(block_size=_SPEC.block_size)] * WORKERS, block_size=_SPEC.block_size)
    rng = random.Random(0)
    tallies = {split: _Tally() for split in splits}
    extra = dict(overrides or {})
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(
            open_kvroute(cluster, _SPEC, extra_settings=_settings(splits[0]) | extra, network=network)
        )
        handles: dict[str, RouterHandle] = {splits[0]: first.handle}
        for split in splits[1:]:
            settings = router_settings(first.addresses.kvcm_bootstrap, first.addresses.workers_arg, _SPEC)
            loaded = load_router_config(settings | _settings(split) | extra)
            handles[split] = await stack.enter_async_context(open_router(loaded.effective, rpc=network, loaded=loaded))
        for handle in handles.values():
            resolver = handle.leader_resolver()
            if resolver is not None:
                with trio.move_on_after(1.0):
                    await resolver.leader()  # the lookup itself is not what this scenario slows down
        for worker in cluster.workers:
            worker.set_faults(WorkerFaults(delay_s=PROBE_DELAY_S))
        leader = cluster.kvcm.leader
        assert leader is not None, "the simulated KVCM has a leader from the start"
        query_only = frozenset({paths.KVCM_GET_HOST_CACHE_STATE})
        warm_queries: list[float] = []
        overhead_s = 0.0
        for i in range(WARM_REQUESTS + requests):
            slow = i >= WARM_REQUESTS
            if i == WARM_REQUESTS and warm_queries:
                # What a query costs beyond KVCM's own delay here (loopback gRPC, a busy machine; none
                # under a MockClock): taken off the slow delays, so the answers land around the budget.
                overhead_s = max(0.0, statistics.median(warm_queries) - WARM_QUERY_DELAY_S)
            tokens = tuple(range(100_000 * (i + 1), 100_000 * (i + 1) + PROMPT_BLOCKS * _SPEC.block_size))
            holder = cluster.worker_addr(i % WORKERS).http_target
            cluster.kvcm.record_prefill(holder, block_keys(tokens, _SPEC.block_size, _SPEC.key_family))
            delay = max(0.0, rng.uniform(*QUERY_DELAY_S) - overhead_s) if slow else WARM_QUERY_DELAY_S
            cluster.kvcm.set_faults(leader, KvcmFaults(delay_s=delay, methods=query_only))
            order = splits if i % 2 == 0 else tuple(reversed(splits))  # neither split always goes first
            for split in order:
                started = trio.current_time()
                decision = await handles[split].route(
                    RouteRequest(f"{split}-{i}", token_ids=tokens, budget_ms=BUDGET_MS)
                )
                took = trio.current_time() - started
                await trio.sleep(GAP_S)
                if not slow:
                    if Stage.CACHE_QUERY in decision.stage_ms:
                        warm_queries.append(decision.stage_ms[Stage.CACHE_QUERY] / 1000.0)
                    continue
                tally = tallies[split]
                tally.kvcm += decision.route_source is RouteSource.KVCM
                tally.hits += decision.worker is not None and decision.worker.http_target == holder
                tally.within += took * 1000.0 <= BUDGET_MS
    return [SplitFigures(split, requests, t.kvcm, t.hits, t.within, overhead_s) for split, t in tallies.items()]


def _settings(split: str) -> dict[str, object]:
    # KVCM is slow here by design, not failing: a query the split's window cut must not count against
    # it, or after a few cuts in a row the breaker, not the split, decides which requests ask KVCM.
    return {"deadline_split": split, "budget_cap_ms": BUDGET_MS, "breaker_slow_query_ms": BUDGET_MS + 1.0}


# The settings of ``_settings``: the verdict compares the splits under them.
FIXED_SETTINGS: Mapping[str, str] = {
    "deadline_split": "it runs one router per split, fixed and learned",
    "budget_cap_ms": f"KVCM's delays are set against its {BUDGET_MS:g} ms budget",
    "breaker_slow_query_ms": "KVCM is slow there by design: its breaker must not count the slow queries",
}


def requests_at(scale: float) -> int:
    """The slow phase's requests at ``--scenario-scale`` ``scale``."""
    return max(1, round(REQUESTS * scale))


def check_overrides(overrides: Mapping[str, object]) -> None:
    """Raise ``DemoConfigError`` when ``overrides`` set one of ``FIXED_SETTINGS`` (or the cluster's), or
    a value the settings table refuses for either router."""
    refuse_fixed_settings(NAME, overrides, FIXED_SETTINGS)
    for split in SPLITS:
        check_router_settings(_SPEC, _settings(split) | dict(overrides))


def render(figures: list[SplitFigures]) -> str:
    """The splits side by side."""
    lines = [
        f"{'split':<9} {'requests':>8} {'kvcm share':>11} {'hit rate':>9} {'within budget':>14} "
        f"{'query overhead':>15}"
    ]
    for f in figures:
        lines.append(
            f"{f.split:<9} {f.requests:>8} {f.share(f.kvcm):>10.1%} {f.share(f.hits):>9.1%} "
            f"{f.share(f.within_budget):>14.1%} {f.query_overhead_s * 1000:>12.1f} ms"
        )
    return "\n".join(lines)


def run_both(out: TextIO, *, requests: int = REQUESTS, overrides: Mapping[str, object] | None = None) -> int:
    """The scenario twice: on a simulated clock with the in-memory transports, where only the split's
    rule differs (each stage takes exactly its simulated time) and the learned split must do better,
    then on the real clock over loopback gRPC, where this machine's stalls add to every stage and it
    must do at least as well. 1 when either run FAILs (a simulated FAIL once left the exit 0)."""
    print("simulated clock, in-memory transports:", file=out)
    simulated = run(
        out,
        clock=trio.testing.MockClock(autojump_threshold=0),
        in_memory=True,
        requests=requests,
        overrides=overrides,
        better=True,
    )
    print("real clock, loopback gRPC:", file=out)
    return max(simulated, run(out, requests=requests, overrides=overrides))


def run(
    out: TextIO,
    *,
    clock: trio.abc.Clock | None = None,
    in_memory: bool = False,
    requests: int = REQUESTS,
    overrides: Mapping[str, object] | None = None,
    better: bool = False,
) -> int:
    """Run both splits, print them side by side; 0 when the learned split kept at least the fixed one's
    KVCM share and hit rate at the same deadline adherence (``better``: and a larger KVCM share, as
    on the simulated clock, where a tie means the learned split did nothing), else 1.
    ``overrides``: checked by ``check_overrides``."""
    low, high = (d * 1000.0 for d in QUERY_DELAY_S)
    common = {k: v for k, v in _settings(SPLITS[0]).items() if k != "deadline_split"} | dict(overrides or {})
    print(
        f"{NAME}: {SUMMARY}; budget {BUDGET_MS:g} ms, GetHostCacheState {low:g}-{high:g} ms, "
        f"after {WARM_REQUESTS} requests at {WARM_QUERY_DELAY_S * 1000:g} ms; status probes "
        f"{PROBE_DELAY_S * 1000:g} ms; {requests} slow requests, each routed by both splits; router settings: "
        + ", ".join(f"{k}={v}" for k, v in common.items()),
        file=out,
    )
    network = MemoryNetwork() if in_memory else None
    figures = trio.run(
        partial(measure_splits, SPLITS, network=network, requests=requests, overrides=overrides), clock=clock
    )
    print(render(figures), file=out, flush=True)
    fixed, learned = figures
    kept = learned.kvcm >= fixed.kvcm and learned.hits >= fixed.hits and learned.within_budget >= fixed.within_budget
    if better:
        kept = kept and learned.kvcm > fixed.kvcm
    print(f"{'PASS' if kept else 'FAIL'} {NAME}", file=out)
    return 0 if kept else 1
