"""``kvroute demo --scenario wrong-key-family``: the predicted-vs-reported hit signal on a key-family mismatch.

The simulated engines register their blocks with KVCM under their own key family
(``ENGINE_FAMILY``) and, when a request is dispatched, match the block keys the request carries
(the router's, as a frontend forwards them) against the blocks they hold. Requests share a few
system prompts and each has its own question. Two runs on fresh clusters and routers:

- right family: the router hashes as the engines do; KVCM names the holders, the engines find
  what was predicted;
- wrong family: the router hashes with ``WRONG_FAMILY``. KVCM never matches, so the shadow index
  (fed with the router's own keys) stands in and predicts hits at the workers it routed the same
  system prompt to; the engines match the router's keys against blocks registered under their own
  family and find nothing. That is the silent zero overlap:
  ``kvroute_hit_silent_zero_total`` counts it and ``/readyz`` warns once it dominates.

After each dispatch the worker is probed at once, so the status listing the request reaches the
router (as the prober's next status would).

``--scenario-scale`` scales the requests of each run (``requests_at``, at least ``MIN_REQUESTS``).
``--router-setting`` overrides go over both runs' settings; the key family is the scenario's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TextIO

import trio

from actors.hit_accuracy import WARNING_MIN_COMPARISONS
from kvroute_sim.demo.runner import check_router_settings, open_kvroute, refuse_fixed_settings
from kvroute_sim.demo.workload import WorkloadSpec, system_prompt
from kvroute_sim.sim.cluster import SimCluster
from kvroute_sim.sim.worker import WorkerSpec
from router.keys import block_keys
from router.transport.memory_adapter import MemoryNetwork
from router.types import KeyFamily, RouteRequest, RouteSource

NAME = "wrong-key-family"
SUMMARY = "the router hashes with another key family than the engines: predicted hits find nothing"
ENGINE_FAMILY = KeyFamily.RTP
WRONG_FAMILY = KeyFamily.VLLM
REQUESTS = 60
# The readiness warning needs WARNING_MIN_COMPARISONS (20) compared predictions and the first request of
# each of the GROUPS prompts predicts none: 24 on the simulated clock, and a few more for the real one.
MIN_REQUESTS = 30
GROUPS = 4
SYSTEM_TOKENS = 256
QUESTION_TOKENS = 64
WORKERS = 4
BUDGET_MS = 50.0
STATUS_WAIT_S = 0.1  # past the status cache's freshness, so the probe after a dispatch is a real one
_SPEC = WorkloadSpec()
_SETTINGS: Mapping[str, object] = {"budget_cap_ms": BUDGET_MS}
FIXED_SETTINGS: Mapping[str, str] = {"key_family": "it runs the router with the engines' key family, then a wrong one"}


@dataclass(frozen=True, slots=True)
class FamilyFigures:
    router_family: KeyFamily
    requests: int
    predicted: int  # routed requests with a predicted hit
    predicted_tokens: int
    actual_tokens: int  # what the engines found for those
    silent_zero: int  # predicted a hit, the engine found nothing (as the router counted it)
    compared: int  # predictions the router compared with a reported prefix
    silent_zero_metric: float  # kvroute_hit_silent_zero_total, all route sources
    warning: str | None  # the readiness warning at the end

    @property
    def actual_over_predicted(self) -> float:
        return self.actual_tokens / self.predicted_tokens if self.predicted_tokens else 0.0

    @property
    def silent_zero_share(self) -> float:
        return self.silent_zero / self.compared if self.compared else 0.0


_QUESTIONS_FROM = 500_000  # token ids of the questions: between group 0's system prompt and group 1's


def _prompt(i: int) -> tuple[int, ...]:
    start = _QUESTIONS_FROM + i * QUESTION_TOKENS
    question = tuple(range(start, start + QUESTION_TOKENS))
    return tuple(system_prompt(i % GROUPS, SYSTEM_TOKENS)) + question


async def measure_family(
    router_family: KeyFamily,
    *,
    network: MemoryNetwork | None = None,
    requests: int = REQUESTS,
    overrides: Mapping[str, object] | None = None,
) -> FamilyFigures:
    """Route and dispatch ``requests`` requests with the router hashing in ``router_family``
    (``overrides`` over the router's settings)."""
    block = _SPEC.block_size
    cluster = SimCluster([WorkerSpec(block_size=block)] * WORKERS, block_size=block)
    spec = WorkloadSpec(key_family=router_family)
    predicted = predicted_tokens = actual_tokens = 0
    settings = dict(_SETTINGS) | dict(overrides or {})
    async with open_kvroute(cluster, spec, extra_settings=settings, network=network) as setup:
        handle = setup.handle
        resolver = handle.leader_resolver()
        if resolver is not None:
            with trio.move_on_after(1.0):
                await resolver.leader()
        for i in range(requests):
            tokens = _prompt(i)
            decision = await handle.route(RouteRequest(f"family-{i}", token_ids=tokens, budget_ms=BUDGET_MS))
            if decision.worker is None:
                continue
            host = decision.worker.http_target
            forwarded = block_keys(tokens, block, router_family)  # the keys the frontend sends along
            cached = min(cluster.kvcm.local_prefix(host, forwarded) * block, len(tokens))
            worker = cluster.worker_index(host)
            cluster.workers[worker].submit(decision.request_id, len(tokens), cached, trio.current_time(), 16)
            cluster.kvcm.record_prefill(host, block_keys(tokens, block, ENGINE_FAMILY))  # the engine registers
            if decision.hit_tokens > 0:
                predicted += 1
                predicted_tokens += decision.hit_tokens
                actual_tokens += cached
            await trio.sleep(STATUS_WAIT_S)
            handle.prober().probe([decision.worker], trio.current_time() + 0.05)
            await trio.sleep(STATUS_WAIT_S)
        accuracy = handle.hit_accuracy()
        assert accuracy is not None, "open_router always starts the accuracy actor"
        health = accuracy.health()
        registry = handle.metrics.registry
        metric = sum(
            registry.get_sample_value("kvroute_hit_silent_zero_total", {"route_source": source.value}) or 0.0
            for source in RouteSource
        )
    return FamilyFigures(
        router_family,
        requests,
        predicted,
        predicted_tokens,
        actual_tokens,
        health.silent_zero,
        health.matched,
        metric,
        health.warning,
    )


def render(figures: list[FamilyFigures]) -> str:
    lines = [
        f"{'router family':<14} {'predicted':>9} {'actual/predicted':>17} {'silent zero':>12} "
        f"{'kvroute_hit_silent_zero_total':>30}  readiness warning"
    ]
    for f in figures:
        silent = f"{f.silent_zero}/{f.compared}"
        lines.append(
            f"{f.router_family.value:<14} {f.predicted:>9} {f.actual_over_predicted:>17.2f} {silent:>12} "
            f"{f.silent_zero_metric:>30g}  " + ("yes" if f.warning else "no")
        )
    return "\n".join(lines)


def passes(right: FamilyFigures, wrong: FamilyFigures) -> bool:
    """The scenario's verdict: the wrong family's predictions found nothing and the readiness warning
    fired, while the right family's, compared as often as the warning needs, never missed (no silent
    zero among no comparisons proves nothing: a router that predicted nothing once passed)."""
    return (
        wrong.silent_zero > 0
        and wrong.warning is not None
        and right.compared >= WARNING_MIN_COMPARISONS
        and right.silent_zero == 0
        and right.warning is None
    )


def requests_at(scale: float) -> int:
    """Each run's requests at ``--scenario-scale`` ``scale``."""
    return max(MIN_REQUESTS, round(REQUESTS * scale))


def check_overrides(overrides: Mapping[str, object]) -> None:
    """Raise ``DemoConfigError`` when ``overrides`` set the key family (or the cluster's settings), or a
    value the settings table refuses."""
    refuse_fixed_settings(NAME, overrides, FIXED_SETTINGS)
    check_router_settings(_SPEC, dict(_SETTINGS) | dict(overrides))


def run(
    out: TextIO,
    *,
    clock: trio.abc.Clock | None = None,
    in_memory: bool = False,
    requests: int = REQUESTS,
    overrides: Mapping[str, object] | None = None,
) -> int:
    """Both runs, side by side; 0 when the signal fired with the wrong family only, else 1.
    ``overrides``: checked by ``check_overrides``."""
    settings = dict(_SETTINGS) | dict(overrides or {})
    print(
        f"{NAME}: {SUMMARY}; engines and KVCM in {ENGINE_FAMILY.value}, {requests} requests over {GROUPS} "
        "system prompts; router settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
        file=out,
    )
    figures = []
    for family in (ENGINE_FAMILY, WRONG_FAMILY):
        network = MemoryNetwork() if in_memory else None
        figures.append(
            trio.run(
                partial(measure_family, family, network=network, requests=requests, overrides=overrides), clock=clock
            )
        )
    print(render(figures), file=out)
    right, wrong = figures
    if wrong.warning:
        print(f"readiness warning (wrong family): {wrong.warning}", file=out)
    fired = passes(right, wrong)
    print(f"{'PASS' if fired else 'FAIL'} {NAME}", file=out, flush=True)
    return 0 if fired else 1
