"""The Scorer actor: it owns the policy, decides through its inbox, charges fallbacks, publishes health."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing

from actors.scorer import Decided, DecideRequest, Scorer, ScorerUnavailable
from router.config import DeploymentConfig, KvrouteConfig, ScorerConfig
from router.policy.cache_affinity import CacheAffinityFirst, Selection
from router.policy.choice import make_policy, status_horizon_s
from router.policy.plan import Candidate, CandidatePlan, CandidateSource
from router.types import DropReason, HostMatch, Reason, Role, TaskInfo, WorkerAddr, WorkerStatus
from tests.test_supervision import run_until_it_crashes

BS = 16
SEQ = 1600
ERROR_LOG_INTERVAL_S = 60.0
RETAIN_SETTLE_S = 0.05


def addr(i: int) -> WorkerAddr:
    return WorkerAddr.from_http(f"10.0.0.{i}", 8000)


def status(queued: int = 0, *, block_size: int | None = None) -> WorkerStatus:
    tasks = (TaskInfo("q", input_length=queued, prefix_length=0, is_waiting=True),) if queued else ()
    return WorkerStatus(
        role=Role.PREFILL,
        role_reported="RoleType.PREFILL",
        alive=True,
        status_version=1,
        latest_finished_version=0,
        waiting=tasks,
        block_size=block_size,
    )


def plan_of(*rows: tuple[WorkerAddr, int | None]) -> CandidatePlan:
    return CandidatePlan(
        tuple(
            Candidate(
                w,
                w.http_target,
                None if local is None else HostMatch(w.http_target, local),
                CandidateSource.COLD if local is None else CandidateSource.HOT,
            )
            for w, local in rows
        )
    )


def request(
    plan: CandidatePlan, statuses: Mapping[WorkerAddr, WorkerStatus], now: float, *, seq_len: int = SEQ
) -> DecideRequest:
    return DecideRequest(
        plan=plan,
        statuses={w: (s, 0.0) for w, s in statuses.items()},
        missing={},
        seq_len=seq_len,
        block_size=BS,
        roles=(Role.PREFILL,),
        now=now,
    )


def make_scorer(inbox: int = 8, **scorer_fields: object) -> Scorer:
    config = replace(ScorerConfig(), **scorer_fields)  # type: ignore[arg-type]
    return Scorer(
        CacheAffinityFirst(config, DeploymentConfig(block_size=BS), status_horizon_s=0.0),
        inbox_size=inbox,
        max_warned_workers=64,
        error_log_interval_s=ERROR_LOG_INTERVAL_S,
        retain_settle_s=RETAIN_SETTLE_S,
    )


async def test_decisions_are_recorded_so_the_next_one_sees_the_precharge(nursery: trio.Nursery) -> None:
    scorer = make_scorer(max_extra_work_tokens=0)
    await nursery.start(scorer.run)
    a, b = addr(1), addr(2)
    plan = plan_of((a, 10), (b, 10))  # equal hits: the shortest work wins each time
    first, _ = await scorer.decide(request(plan, {a: status(), b: status()}, now=1.0))
    second, _ = await scorer.decide(request(plan, {a: status(), b: status()}, now=1.1))
    assert {first.worker, second.worker} == {a, b}  # the first pick's pre-charge sent the second elsewhere
    health = scorer.health()
    assert (health.decisions, health.policy.tracked_workers, health.policy.pending_charges) == (2, 2, 2)
    assert health.policy.policy == "cache_affinity_first"


async def test_a_worker_discovery_no_longer_lists_is_forgotten_by_the_ledger_and_the_views(
    nursery: trio.Nursery,
) -> None:
    """A departed worker's ledger entry and scoring view (its last status, whole) stayed until as many
    newer workers pushed them out: with the default bound, thousands of dead workers' statuses."""
    scorer = make_scorer(max_extra_work_tokens=0)
    await nursery.start(scorer.run)
    a, b = addr(1), addr(2)
    plan = plan_of((a, 10), (b, 10))
    for now in (1.0, 1.1):
        await scorer.decide(request(plan, {a: status(), b: status()}, now=now))
    policy = scorer.health().policy
    assert (policy.tracked_workers, policy.observed_statuses, policy.pending_charges) == (2, 2, 2)
    scorer.retain([b])  # a left discovery
    selection, _ = await scorer.decide(request(plan_of((b, 10)), {b: status()}, now=1.2))
    assert selection.worker == b
    policy = scorer.health().policy
    assert (policy.tracked_workers, policy.observed_statuses, policy.pending_charges) == (1, 1, 2)
    # A request planned before the change still names a; once such requests are over, a is dropped again.
    await scorer.decide(request(plan_of((a, 10)), {a: status()}, now=1.2))
    assert scorer.health().policy.observed_statuses == 2
    await scorer.decide(request(plan_of((b, 10)), {b: status()}, now=1.2 + RETAIN_SETTLE_S))
    policy = scorer.health().policy
    assert (policy.tracked_workers, policy.observed_statuses) == (1, 1)


async def test_a_decision_is_charged_when_it_is_made_not_when_it_was_asked_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """R1 asks at t=0 and waits in the Scorer's inbox (a busy loop) until t=0.010. A status of A sent at
    t=0.005 cannot hold R1's dispatch, decided after it; but R1's charge was stamped with the time it
    asked, before the status, so the status cleared it and R2 piled onto A with R1."""
    scorer = make_scorer(max_extra_work_tokens=0)
    a, b = addr(1), addr(2)
    plan = plan_of((a, 10), (b, None))  # A holds 10 blocks (160 tokens of 1600); B is idle with none
    picks: list[WorkerAddr | None] = []
    async with trio.open_nursery() as nursery:

        async def asks_first() -> None:
            selection, _ = await scorer.decide(request(plan, {a: status(), b: status()}, now=trio.current_time()))
            picks.append(selection.worker)

        nursery.start_soon(asks_first)
        await trio.sleep(0.010)
        await nursery.start(scorer.run)  # the Scorer's task runs only now
        await trio.testing.wait_all_tasks_blocked()
        assert picks == [a]
        r2 = replace(
            request(plan, {a: status(), b: status()}, now=trio.current_time()),
            statuses={a: (status(), 0.005), b: (status(), 0.0)},  # A's status sent while R1 waited
        )
        selection, _ = await scorer.decide(r2)
        assert selection.worker == b  # R1's uncached 1,440 tokens on A, in no status of A
        nursery.cancel_scope.cancel()


async def test_a_status_older_than_one_already_scored_with_is_charged_every_dispatch_since_it(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """R3 read A's status taken at t=0 while it was fresh and waited for its other probes; meanwhile R2
    was scored with a newer status of A (taken at t=0.050), which cleared the charges made before it.
    R3 then saw A without R1's and R2's dispatches and piled onto it: A holds 1,000 queued and is sent
    1,000 by each of R1 and R2, 3,000 in all against B's 2,500."""
    config = KvrouteConfig()
    policy = make_policy(config.scorer, DeploymentConfig(block_size=BS), status_horizon_s=status_horizon_s(config))
    scorer = Scorer(
        policy,
        inbox_size=8,
        max_warned_workers=64,
        error_log_interval_s=ERROR_LOG_INTERVAL_S,
        retain_settle_s=RETAIN_SETTLE_S,
    )
    await nursery.start(scorer.run)
    a, b = addr(1), addr(2)
    plan = plan_of((a, None), (b, None))  # neither holds any of the 1,000 tokens
    a_at_0, b_at_0 = (status(), 0.0), (status(1500), 0.0)

    async def decided_at(now: float, statuses: dict[WorkerAddr, tuple[WorkerStatus, float]]) -> WorkerAddr | None:
        await trio.sleep_until(now)
        selection, _ = await scorer.decide(replace(request(plan, {}, now, seq_len=1000), statuses=statuses))
        return selection.worker

    assert await decided_at(0.010, {a: a_at_0, b: b_at_0}) == a  # idle A: 1,000 against B's 2,500
    # A probe of A sent at t=0.050 shows R1's 1,000 tokens queued.
    assert await decided_at(0.060, {a: (status(1000), 0.050), b: b_at_0}) == a  # 2,000 against 2,500
    # A: its status's 0, R1's and R2's 2,000, and this request's 1,000.
    assert await decided_at(0.070, {a: a_at_0, b: b_at_0}) == b


async def test_record_nowait_charges_a_fallback_dispatch(nursery: trio.Nursery) -> None:
    scorer = make_scorer()
    await nursery.start(scorer.run)
    a, b = addr(1), addr(2)
    assert scorer.record_nowait(a, 5000, now=1.0)  # e.g. a domain-fallback dispatch
    selection, _ = await scorer.decide(request(plan_of((a, None), (b, None)), {a: status(), b: status()}, now=2.0))
    assert selection.worker == b
    assert scorer.health().records == 1


async def test_a_stopped_scorer_fails_decisions_at_once_and_its_next_run_applies_the_records(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Between a run's end (a crash) and the next run, a decision fails at once instead of waiting in
    an inbox nobody reads; dispatches recorded meanwhile, or queued when the run ended, are kept for
    the next run."""
    scorer = make_scorer()
    a, b = addr(1), addr(2)
    plan = plan_of((a, 10), (b, 10))
    async with trio.open_nursery() as first_run:
        await first_run.start(scorer.run)
        assert scorer.record_nowait(a, 100, now=0.0)  # queued, not yet applied, when the run ends
        first_run.cancel_scope.cancel()
    start = trio.current_time()
    with trio.fail_after(1), pytest.raises(ScorerUnavailable, match="not running"):
        await scorer.decide(request(plan, {a: status(), b: status()}, now=1.0))
    assert trio.current_time() == start
    assert scorer.record_nowait(b, 100, now=1.0)
    async with trio.open_nursery() as second_run:
        await second_run.start(scorer.run)
        await trio.testing.wait_all_tasks_blocked()
        assert scorer.health().records == 2
        selection, _ = await scorer.decide(request(plan, {a: status(), b: status()}, now=2.0))
        assert selection.worker is not None
        second_run.cancel_scope.cancel()


async def test_the_decision_in_hand_when_the_scorer_crashes_fails_at_once(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while making a decision (outside the policy, whose failure that request alone falls back
    on) ends the Scorer's run with the decision in hand: the queued ones failed at once, but its
    caller was never woken and waited out its whole window."""
    scorer = make_scorer()
    a, b = addr(1), addr(2)
    plan = plan_of((a, 10), (b, 10))

    def bug(message: object) -> None:
        raise RuntimeError("a bug while deciding")

    monkeypatch.setattr(scorer, "_decide", bug)
    crashed: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(run_until_it_crashes, scorer.run, crashed)
        start = trio.current_time()
        with trio.fail_after(1), pytest.raises(ScorerUnavailable, match="stopped before deciding"):
            await scorer.decide(request(plan, {a: status(), b: status()}, now=1.0))
        assert trio.current_time() == start
    assert [str(exc) for exc in crashed] == ["a bug while deciding"]


class _RecordFailsOnce(CacheAffinityFirst):
    """A policy whose first record() raises, as a bug would: the Scorer's run ends there."""

    def __init__(self) -> None:
        super().__init__(ScorerConfig(), DeploymentConfig(block_size=BS), status_horizon_s=0.0)
        self.failed = False

    def record(
        self,
        worker: WorkerAddr,
        uncached_tokens: int,
        now: float,
        status_taken_at: float | None = None,
        *,
        requests: int = 1,
    ) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug in record()")
        super().record(worker, uncached_tokens, now, status_taken_at, requests=requests)


async def test_records_still_queued_when_a_run_crashes_are_applied_by_the_next_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A run that ends with dispatch records in its inbox (a crash on the one before them) gives them
    to the next run: lost, the workers they charge would look idle and draw the next requests."""
    scorer = Scorer(
        _RecordFailsOnce(),
        inbox_size=8,
        max_warned_workers=64,
        error_log_interval_s=ERROR_LOG_INTERVAL_S,
        retain_settle_s=RETAIN_SETTLE_S,
    )
    a, b = addr(1), addr(2)
    assert [scorer.record_nowait(w, 100, now=0.0) for w in (a, a, b)] == [True, True, True]
    with pytest.raises(BaseExceptionGroup) as crashed:
        await scorer.run()  # the first record raises; the other two are still queued
    assert crashed.group_contains(RuntimeError, match="a bug in record")
    async with trio.open_nursery() as second_run:
        await second_run.start(scorer.run)
        await trio.testing.wait_all_tasks_blocked()
        assert scorer.health().records == 2
        second_run.cancel_scope.cancel()


async def test_a_full_inbox_drops_and_counts_records() -> None:
    scorer = make_scorer(inbox=2)  # not running: nothing drains the inbox
    assert [scorer.record_nowait(addr(1), 10, now=0.0) for _ in range(4)] == [True, True, False, False]
    assert scorer.health().records_dropped == 2


async def test_a_failing_decision_is_reported_to_its_caller_and_the_scorer_keeps_serving(
    nursery: trio.Nursery,
) -> None:
    scorer = make_scorer()
    await nursery.start(scorer.run)
    a = addr(1)
    plan = plan_of((a, 10))
    with pytest.raises(ScorerUnavailable, match="seq_len"):
        await scorer.decide(request(plan, {a: status()}, now=1.0, seq_len=-1))
    assert (await scorer.decide(request(plan, {a: status()}, now=1.0))).selection.worker == a
    health = scorer.health()
    assert (health.errors, health.decisions) == (1, 1)
    assert health.last_error is not None and "seq_len" in health.last_error


async def test_a_caller_that_left_before_its_turn_is_not_decided_or_recorded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scorer = make_scorer()
    a = addr(1)
    plan = plan_of((a, 10))
    async with trio.open_nursery() as nursery:
        with trio.move_on_after(0.01):  # the Scorer is not running yet: this caller gives up
            await scorer.decide(request(plan, {a: status()}, now=0.0))
        await nursery.start(scorer.run)
        selection, _ = await scorer.decide(request(plan, {a: status()}, now=1.0))
        nursery.cancel_scope.cancel()
    health = scorer.health()
    assert (health.abandoned, health.decisions, health.policy.pending_charges) == (1, 1, 1)
    assert selection.reason is Reason.CACHE_LEADER


async def test_a_caller_cancelled_in_the_batch_the_scorer_runs_in_is_not_charged() -> None:
    """The caller's cancellation is delivered while its message waits, and the Scorer's task is
    ready in the same batch: whichever runs first, nothing is decided or recorded for a caller that
    has left (trio runs a batch's tasks in no fixed order, so twenty rounds)."""
    a = addr(1)
    plan = plan_of((a, 10))
    for _ in range(20):
        scorer = make_scorer()
        async with trio.open_nursery() as nursery:
            caller = trio.CancelScope()

            async def ask(scorer: Scorer, caller: trio.CancelScope) -> None:
                with caller:
                    await scorer.decide(request(plan, {a: status()}, now=0.0))

            nursery.start_soon(ask, scorer, caller)
            await trio.testing.wait_all_tasks_blocked()  # its message is in the inbox; it is parked
            nursery.start_soon(scorer.run)  # ready in the same batch as the cancelled caller
            caller.cancel()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        health = scorer.health()
        assert (health.abandoned, health.decisions, health.policy.pending_charges) == (1, 0, 0)


async def test_a_contract_mismatch_is_logged_once_per_worker(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    scorer = make_scorer()
    await nursery.start(scorer.run)
    a, b = addr(1), addr(2)
    plan = plan_of((a, 20), (b, None))
    with caplog.at_level(logging.WARNING, logger="actors.scorer"):
        for t in range(5):
            selection, _ = await scorer.decide(request(plan, {a: status(block_size=64), b: status()}, now=float(t)))
            assert dict(selection.drop_counts) == {DropReason.BLOCK_SIZE_MISMATCH: 1}
    messages = [r.getMessage() for r in caplog.records if r.name == "actors.scorer"]
    assert len(messages) == 1 and a.http_target in messages[0] and "block_size_mismatch" in messages[0]


class SlowPolicy(CacheAffinityFirst):
    """Every decision takes ``work_s`` of the mock clock, as CPU work in the Scorer's task would."""

    def __init__(self, clock: trio.testing.MockClock, work_s: float) -> None:
        super().__init__(ScorerConfig(), DeploymentConfig(block_size=BS), status_horizon_s=0.0)
        self._clock = clock
        self._work_s = work_s

    def decide(self, *args: Any, **kwargs: Any) -> Selection:
        self._clock.jump(self._work_s)
        return super().decide(*args, **kwargs)


async def test_the_reply_carries_the_policys_work_and_not_the_wait_in_the_inbox(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scorer = Scorer(
        SlowPolicy(autojump_clock, 0.002),
        inbox_size=8,
        max_warned_workers=64,
        error_log_interval_s=ERROR_LOG_INTERVAL_S,
        retain_settle_s=RETAIN_SETTLE_S,
    )
    a, b = addr(1), addr(2)
    plan = plan_of((a, 10), (b, 10))
    replies: list[tuple[float, Decided]] = []

    async def caller(now: float) -> None:
        sent = trio.current_time()
        decided = await scorer.decide(request(plan, {a: status(), b: status()}, now=now))
        replies.append((trio.current_time() - sent, decided))

    async with trio.open_nursery() as service:
        async with trio.open_nursery() as callers:
            for i in range(3):
                callers.start_soon(caller, float(i))
            await trio.sleep(0.050)  # the Scorer's turn comes late: the three decisions wait in its inbox
            await service.start(scorer.run)
        service.cancel_scope.cancel()
    assert len(replies) == 3
    for waited, decided in replies:
        assert waited == pytest.approx(0.056)  # the inbox, then all three decisions of the batch
        assert decided.work_s == pytest.approx(0.002)  # its own decision only
        assert decided.selection.worker in (a, b)
