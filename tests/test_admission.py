"""Admission by expected cost: a request the router could only answer late is answered at once."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing

from actors import router_actor
from actors.scorer import Decided, DecideRequest, Scorer, ScorerHealth
from kvroute_sim.sim.cluster import SimCluster
from router.admission import AdmissionEstimate, AdmissionView, admits, slot_wait_s
from router.api import RouterHandle, open_router
from router.config import DeploymentConfig, DiscoveryConfig, KvrouteConfig, RouterConfig
from router.keys import block_keys
from router.request import key_slices
from router.transport.memory_adapter import MemoryNetwork
from router.types import KeyFamily, Reason, Role, RouteRequest, RouteSource, Stage

BLOCK = 16
PROMPT = tuple(range(4 * BLOCK))


def test_the_estimate_follows_a_sustained_lag_and_shrugs_off_one_stall() -> None:
    estimate = AdmissionEstimate(RouterConfig())
    assert estimate.admits(0.0)  # nothing known yet: nothing shed
    estimate.observe_lag(0.040)  # one 40 ms stall
    assert estimate.expected_s() < 0.005
    for _ in range(30):  # a saturated loop: every timer 20 ms late
        estimate.observe_lag(0.020)
    assert 0.018 < estimate.expected_s() < 0.020
    assert not estimate.admits(0.010) and estimate.admits(0.030)
    for _ in range(60):
        estimate.observe_lag(0.0)
        estimate.observe_own(0.0002)
    assert estimate.admits(0.001)
    view = estimate.view()
    assert view.expected_s == view.own_s + view.lag_s


def _memory_cluster(
    workers: int, router: RouterConfig | None = None, *, cluster: SimCluster | None = None
) -> tuple[MemoryNetwork, KvrouteConfig]:
    """A simulated cluster (``cluster``, or a new one of ``workers``) served on an in-memory network,
    and a router configuration for it."""
    cluster = cluster or SimCluster(workers=workers, kvcm_replicas=1, block_size=BLOCK)
    network = MemoryNetwork()
    addrs = cluster.serve_memory(network)
    config = KvrouteConfig(
        deployment=DeploymentConfig(block_size=BLOCK),
        router=router or RouterConfig(),
        discovery=DiscoveryConfig(kvcm_bootstrap=addrs.kvcm_bootstrap, workers=addrs.workers_arg),
    )
    return network, config


async def test_a_saturated_loop_sheds_at_admission_and_recovers(autojump_clock: trio.testing.MockClock) -> None:
    # Idle probing off: the stall below is modelled without requests, which an idle router's probe
    # would sample only every lag_probe_idle_ms.
    network, config = _memory_cluster(2, replace(RouterConfig(), lag_probe_interval_ms=5.0, lag_probe_idle_ms=0.0))
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)
        for _ in range(40):  # the loop runs 30 ms late at every turn: a stall with no checkpoint
            autojump_clock.jump(0.030)
            await trio.sleep(0.005)
        assert handle.router_actor().health().admission.lag_s > 0.010
        start = trio.current_time()
        shed = await handle.route(RouteRequest("late", token_ids=PROMPT, budget_ms=8))
        assert (shed.reason, shed.route_source) == (Reason.OVERLOADED, RouteSource.DOMAIN)
        assert trio.current_time() == start  # answered at admission: no hashing, query or probe
        roomy = await handle.route(RouteRequest("roomy", token_ids=PROMPT, budget_ms=50))
        assert roomy.reason is not Reason.OVERLOADED  # a budget that covers the lag is still routed
        await trio.sleep(1.0)  # the loop is on time again: the estimate decays
        again = await handle.route(RouteRequest("again", token_ids=PROMPT, budget_ms=8))
        assert again.reason is not Reason.OVERLOADED
        assert handle.router_actor().health().admission.lag_s < 0.001


async def test_a_request_naming_roles_not_routed_here_is_refused_not_shed_under_lag(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The roles were checked only once a request was admitted: under overload a role this deployment
    does not route was dropped from the shed's roles, and the request got a worker (domain/overloaded,
    charged) where at normal load it is refused, naming the field."""
    # Idle probing off: the stall below is modelled without requests, which an idle router's probe
    # would sample only every lag_probe_idle_ms.
    network, config = _memory_cluster(2, replace(RouterConfig(), lag_probe_interval_ms=5.0, lag_probe_idle_ms=0.0))
    assert config.deployment.roles == (Role.PREFILL,)
    foreign = [(Role.DECODE,), (Role.VIT,), (Role.PREFILL, Role.VIT)]
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)
        for _ in range(40):  # the loop runs 30 ms late at every turn: a stall with no checkpoint
            autojump_clock.jump(0.030)
            await trio.sleep(0.005)
        router = handle.router_actor()
        assert router.health().admission.lag_s > 0.010
        shed = await handle.route(RouteRequest("shed", token_ids=PROMPT, budget_ms=8, roles=(Role.PREFILL,)))
        assert shed.reason is Reason.OVERLOADED  # a budget the lag does not cover is shed
        overloaded = router.health().overloaded
        for roles in foreign:
            request = RouteRequest(f"foreign-{roles[-1].value}", token_ids=PROMPT, budget_ms=8, roles=roles)
            decision = await handle.route(request)
            assert decision.reason is Reason.BAD_REQUEST, (roles, decision.reason)
            assert decision.error is not None and decision.error.startswith("roles:"), decision.error
            assert roles[-1].value in decision.error
        assert router.health().overloaded == overloaded


def test_an_own_time_above_every_budget_ages_while_everything_is_shed() -> None:
    estimate = AdmissionEstimate(RouterConfig())
    for _ in range(60):  # a slow spell: every admitted request took 80 ms of the router's own time
        estimate.observe_own(0.080)
        estimate.observe_lag(0.0)
    assert not estimate.admits(0.050)  # a 50 ms budget is shed now, so no request refreshes the average
    for _ in range(10):
        estimate.observe_lag(0.0)  # the loop is on time: each tick without a request ages the average
    assert estimate.admits(0.050)
    fed = AdmissionEstimate(RouterConfig())
    for _ in range(60):  # requests still admitted keep the average where they put it
        fed.observe_own(0.080)
        fed.observe_lag(0.0)
    assert fed.view().own_s > 0.075


def test_a_request_alone_is_judged_by_the_lag_only_so_a_stale_own_estimate_recovers() -> None:
    estimate = AdmissionEstimate(RouterConfig())
    estimate.observe_own(1.0)  # one stalled request: 100 ms expected from now on
    assert not estimate.admits(0.050, in_flight=1)
    assert estimate.admits(0.050, in_flight=0)  # admitted to take a fresh sample
    estimate.observe_lag(1.0)
    assert not estimate.admits(0.050, in_flight=0)  # a late loop still sheds it
    assert admits(AdmissionView(own_s=1.0, lag_s=0.001, expected_s=1.001), 0.002, in_flight=0)


def test_a_lag_sample_after_a_long_wait_moves_the_averages_as_the_skipped_probes_would() -> None:
    probed = AdmissionEstimate(RouterConfig())
    idle = AdmissionEstimate(RouterConfig())
    for estimate in (probed, idle):
        estimate.observe_own(0.040)
        estimate.observe_lag(0.020)
    for _ in range(24):  # an idle loop probed every interval: nothing due, so no lateness, and no request
        probed.observe_lag(0.0)
    probed.observe_lag(0.003)
    idle.observe_lag(0.003, intervals=25.0)  # one wait of 25 intervals, 3 ms late
    assert idle.view().lag_s == pytest.approx(probed.view().lag_s)
    assert idle.view().own_s == pytest.approx(probed.view().own_s)
    # A wait a request cut short ages them by the part of an interval it lasted, and samples nothing.
    cut = AdmissionEstimate(RouterConfig())
    cut.observe_lag(0.010)
    cut.observe_lag(0.0, intervals=0.5)
    assert cut.view().lag_s == pytest.approx(0.010 * (1 - 0.9) * 0.9**0.5)


async def _publications(handle: RouterHandle, seconds: float, every_s: float = 0.001) -> int:
    """How many times the router published its overload answers over ``seconds`` (one per lag probe)."""
    router = handle.router_actor()
    seen = router.overload_answers()
    count = 0
    for _ in range(round(seconds / every_s)):
        await trio.sleep(every_s)
        if router.overload_answers() is not seen:
            seen = router.overload_answers()
            count += 1
    return count


async def _next_publication(handle: RouterHandle, within_s: float = 1.0) -> None:
    """Return just after the router's next lag probe published (within a millisecond)."""
    router = handle.router_actor()
    seen = router.overload_answers()
    for _ in range(round(within_s / 0.001)):
        await trio.sleep(0.001)
        if router.overload_answers() is not seen:
            return
    raise AssertionError(f"no lag probe published within {within_s} s")


@pytest.mark.parametrize(("idle_ms", "expected"), [(250.0, range(3, 6)), (0.0, range(95, 101)), (10.0, range(95, 101))])
async def test_an_idle_router_probes_its_lag_every_lag_probe_idle_ms(
    autojump_clock: trio.testing.MockClock, idle_ms: float, expected: range
) -> None:
    """Probing every 10 ms was most of an idle router's CPU. 0, or not above the interval: never slower."""
    network, config = _memory_cluster(2, replace(RouterConfig(), lag_probe_interval_ms=10.0, lag_probe_idle_ms=idle_ms))
    async with open_router(config, rpc=network) as handle:
        await handle.route(RouteRequest("warm", token_ids=PROMPT))
        await trio.sleep(0.5)  # quiet for longer than lag_probe_idle_ms
        assert await _publications(handle, 1.0) in expected
        published = handle.router_actor().overload_answers()
        assert published is not None and published.answers  # still drawn for threads that shed


async def test_a_request_brings_an_idle_router_back_to_its_lag_probe_interval_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network, config = _memory_cluster(2, replace(RouterConfig(), lag_probe_interval_ms=10.0, lag_probe_idle_ms=250.0))
    async with open_router(config, rpc=network) as handle:
        router = handle.router_actor()
        await trio.sleep(0.5)
        await _next_publication(handle)  # an idle probe: the next is 250 ms away
        published = router.overload_answers()
        await handle.route(RouteRequest("wakes", token_ids=PROMPT))
        await trio.sleep(0.011)
        assert router.overload_answers() is not published
        for i in range(20):  # requests keep coming: a probe every interval
            await handle.route(RouteRequest(f"r{i}", token_ids=PROMPT))
            await trio.sleep(0.005)
        assert await _publications(handle, 0.1) >= 9
        # A call another thread shed counts as one too: the process is busy.
        await trio.sleep(0.5)
        await _next_publication(handle)
        published = router.overload_answers()
        assert published is not None
        shed = RouteRequest("shed", token_ids=PROMPT)
        router.record_shed(lambda: shed, published.answers[0], trio.current_time())
        await trio.sleep(0.011)
        assert router.overload_answers() is not published


async def test_a_request_after_an_idle_probe_fell_due_takes_its_lateness(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The loop stalled past an idle probe's time and a request ran before the probe's task: the sample
    is the request's to take, late by the stall, once."""
    network, config = _memory_cluster(2, replace(RouterConfig(), lag_probe_interval_ms=10.0, lag_probe_idle_ms=250.0))
    async with open_router(config, rpc=network) as handle:
        router = handle.router_actor()
        await trio.sleep(1.0)
        await _next_publication(handle)  # an idle probe: the next is due in 249–250 ms
        autojump_clock.jump(0.300)  # a stall with no checkpoint, past that probe's time by 50–51 ms
        before = trio.current_time()
        await handle.route(RouteRequest("first", token_ids=PROMPT))
        probes_since = (trio.current_time() - before) / 0.010 + 1
        assert 0.050 * 0.1 * 0.9**probes_since <= router.health().admission.lag_s <= 0.051 * 0.1


async def test_the_next_request_finds_a_stale_own_estimate_aged_as_if_probed_every_interval(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float] = []
    admits = AdmissionEstimate.admits

    def judged(estimate: AdmissionEstimate, remaining_s: float, *, in_flight: int = 1) -> bool:
        seen.append(estimate.view().own_s)
        return admits(estimate, remaining_s, in_flight=in_flight)

    own: dict[float, float] = {}
    for idle_ms in (250.0, 0.0):
        network, config = _memory_cluster(2, replace(RouterConfig(), lag_probe_idle_ms=idle_ms))
        async with open_router(config, rpc=network) as handle:
            await handle.route(RouteRequest("warm", token_ids=PROMPT))
            router = handle.router_actor()
            router._estimate.observe_own(5.0)  # as if that request had stalled for seconds
            await trio.sleep(0.6)  # then nothing, into the middle of an idle probe's wait
            seen.clear()
            with monkeypatch.context() as patched:
                patched.setattr(AdmissionEstimate, "admits", judged)
                await handle.route(RouteRequest("next", token_ids=PROMPT))
            own[idle_ms] = seen[0]
    assert own[0.0] < 5.0 * 0.9**55  # about 60 probes of 10 ms aged it
    assert 0.9**2 < own[250.0] / own[0.0] < 0.9**-2  # the same within a probe or two either side


def test_a_request_waits_for_a_place_at_most_a_quarter_of_its_time_and_never_past_its_expected_cost() -> None:
    # The rest is for the remote calls once it is handed over.
    assert slot_wait_s(AdmissionView(own_s=0.0, lag_s=0.0, expected_s=0.0), 0.040) == pytest.approx(0.010)
    # 36 ms left, 30 expected: a wait of 9 ms would leave too little to be answered in time.
    assert slot_wait_s(AdmissionView(own_s=0.030, lag_s=0.0, expected_s=0.030), 0.036) == pytest.approx(0.006)
    assert slot_wait_s(AdmissionView(own_s=0.050, lag_s=0.0, expected_s=0.050), 0.040) == 0.0


async def test_a_stale_own_estimate_does_not_shed_forever(autojump_clock: trio.testing.MockClock) -> None:
    network, config = _memory_cluster(2)
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)
        handle.router_actor()._estimate.observe_own(5.0)  # as after one request stalled for seconds
        first = await handle.route(RouteRequest("first", token_ids=PROMPT, budget_ms=30))
        assert first.reason is not Reason.OVERLOADED
        for i in range(40):
            await handle.route(RouteRequest(f"r{i}", token_ids=PROMPT, budget_ms=30))
        assert handle.router_actor().health().admission.own_s < 0.030


async def test_the_router_publishes_overloaded_answers_and_counts_the_sheds_others_make(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network, config = _memory_cluster(3)
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)
        router = handle.router_actor()
        published = router.overload_answers()
        assert published is not None and published.answers
        workers = {w.http_target for w in handle.discovery().workers().workers}
        for answer in published.answers:
            assert (answer.route_source, answer.reason) == (RouteSource.DOMAIN, Reason.OVERLOADED)
            assert answer.worker is not None and answer.worker.http_target in workers
        before = router.health()
        charged = _scorer_records(handle)
        shed = RouteRequest("shed", token_ids=PROMPT)
        router.record_shed(lambda: shed, published.answers[0], trio.current_time())
        after = router.health()
        assert after.overloaded == before.overloaded + 1
        assert after.handled == before.handled  # never entered the pipeline
        worker = published.answers[0].worker
        assert worker is not None
        router.charge_sheds({worker: (3 * len(PROMPT), 3)})  # their worker gets them: charged, in a sum
        await trio.testing.wait_all_tasks_blocked()
        assert _scorer_records(handle) == charged + 3  # the dispatches charged, not the messages


def _scorer_records(handle: RouterHandle) -> int:
    scorer = handle.actors()["scorer"]["health"]
    assert isinstance(scorer, ScorerHealth)
    return scorer.records


class StallBeforeTheScorer(trio.abc.Instrument):
    """Other tasks ahead of the Scorer in the loop: every turn of the Scorer's task starts ``stall_s``
    later (the clock jumps before the task steps, so none of it is the Scorer's own work)."""

    def __init__(self, clock: trio.testing.MockClock, stall_s: float) -> None:
        self._clock = clock
        self._stall_s = stall_s
        self.stalls = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith("Scorer.run"):
            self._clock.jump(self._stall_s)
            self.stalls += 1


async def test_the_own_time_excludes_the_wait_for_the_scorers_turn(autojump_clock: trio.testing.MockClock) -> None:
    cluster = SimCluster(workers=2, kvcm_replicas=1, block_size=BLOCK)
    network, config = _memory_cluster(2, replace(RouterConfig(), budget_cap_ms=2000.0), cluster=cluster)
    cluster.kvcm.record_prefill(cluster.worker_addr(1).http_target, block_keys(PROMPT, BLOCK, KeyFamily.RTP))
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)
        stall = StallBeforeTheScorer(autojump_clock, 0.020)
        trio.lowlevel.add_instrument(stall)
        try:
            decisions = [await handle.route(RouteRequest(f"r{i}", token_ids=PROMPT, budget_ms=1000)) for i in range(5)]
        finally:
            trio.lowlevel.remove_instrument(stall)
        assert stall.stalls >= 5
        for decision in decisions:
            assert decision.route_source is RouteSource.KVCM
            assert decision.stage_ms[Stage.SCORE] > 19.0  # the hop's wall time holds the 20 ms wait
        # Hashing, planning and the Scorer's work take no mock time: the waits are not the request's own.
        assert handle.router_actor().health().admission.own_s == 0.0


async def test_the_own_time_counts_a_long_prompts_hashing_not_its_rests_and_turn(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KEYS stage is wall time: a sliced prompt's rests after each slice and its wait for the turn
    to hash. Fed to the admission estimate as work, three long prompts at once counted two, four and
    six times their hashing, and a short request beside one was shed."""
    slice_s = 0.001  # what hashing one slice takes here: the mock clock moves that much per slice
    def timed(*args: Any) -> Iterator[tuple[int, ...]]:
        for part in key_slices(*args):
            autojump_clock.jump(slice_s)
            yield part

    monkeypatch.setattr(router_actor, "key_slices", timed)
    network, config = _memory_cluster(2, replace(RouterConfig(), budget_cap_ms=1000.0))
    long_prompt = tuple(range(8 * config.limits.hash_slice_tokens))  # eight slices: 8 ms of hashing
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)
        admission = handle.router_actor().health
        for burst in range(5):
            async with trio.open_nursery() as together:
                for i in range(3):
                    request = RouteRequest(f"L{burst}.{i}", token_ids=long_prompt, budget_ms=1000)
                    together.start_soon(handle.route, request)
        assert admission().admission.own_s < 8 * slice_s * 1.5  # about one prompt's hashing, not several


async def test_the_own_time_of_a_request_its_deadline_ended_is_its_work_too(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt's request that its deadline ends in the chain (here: the Scorer too slow) has no
    context when it is answered; the estimate then took the KEYS stage's wall time, its rests and its
    turn included, and three such requests counted several times their hashing."""
    slice_s = 0.001

    def timed(*args: Any) -> Iterator[tuple[int, ...]]:
        for part in key_slices(*args):
            autojump_clock.jump(slice_s)
            yield part

    decide = Scorer.decide

    async def stalled(self: Scorer, request: DecideRequest) -> Decided:
        await trio.sleep(1)
        return await decide(self, request)

    monkeypatch.setattr(router_actor, "key_slices", timed)
    monkeypatch.setattr(Scorer, "decide", stalled)
    network, config = _memory_cluster(2, replace(RouterConfig(), budget_cap_ms=1000.0))
    long_prompt = tuple(range(8 * config.limits.hash_slice_tokens))  # eight slices: 8 ms of hashing
    async with open_router(config, rpc=network) as handle:
        await trio.sleep(0.1)
        reasons = set()
        for burst in range(5):
            async with trio.open_nursery() as together:
                for i in range(3):

                    async def one(i: int = i, burst: int = burst) -> None:
                        request = RouteRequest(f"L{burst}.{i}", token_ids=long_prompt, budget_ms=100)
                        reasons.add((await handle.route(request)).reason)

                    together.start_soon(one)
        assert reasons == {Reason.DEADLINE}
        assert handle.router_actor().health().admission.own_s < 8 * slice_s * 1.5

