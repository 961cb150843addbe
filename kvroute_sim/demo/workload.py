"""The demo's workload: seeded, reproducible requests on a simulated timeline (pure: no I/O, no clock).

Shape (after the common generated-shared-prefix benchmark):

- ``groups`` shared system prompts of ``system_prompt_tokens`` tokens; ``groups ×
  prompts_per_group`` conversations, each opening with its group's system prompt and a
  fresh ``question_tokens``-token question. A conversation's group is drawn from a Zipf
  distribution (weight of the group of rank r ∝ 1 / r^zipf_s), so a few groups are hot.
- Multi-turn sessions: with probability ``multi_turn_fraction`` a conversation has
  ``turns`` turns; turn k+1's prompt is turn k's prompt + its answer (``output_tokens``
  fresh tokens) + a new question, so a later turn *extends* the earlier prompt.
- Arrivals: conversations start as a Poisson process at ``rate_per_s / mean turns``; a
  follow-up turn arrives an exponential think time (mean ``think_time_s``) after the
  previous turn. The overall request rate is therefore about ``rate_per_s``.

Token ids: group g's system prompt is ``g · 1,000,000 + i``; question and answer tokens
are fresh ids from ``groups · 1,000,000`` upward, unique across the workload (so only
system prompts and a session's own history are shared). All ids fit in 31 bits, so every
key family encodes them unchanged.

The same ``WorkloadSpec`` (seed included) always yields the same requests, so every
policy of the comparison sees identical arrivals.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from router.config import DeploymentConfig
from router.keys import block_keys
from router.types import KeyFamily

BULK_SHARE = 0.8  # of the requests: the bulk window, where the load is measured (``load``)
GROUP_STRIDE = 1_000_000  # token ids per group's system prompt range (and the longest system prompt)
# No request of a workload (or a replayed trace) arrives later than this on the simulated clock:
# a week. The simulators report times in int64 milliseconds and a later arrival is a mistake.
MAX_ARRIVAL_S = 7 * 24 * 3600.0
RATE_PER_S_RANGE = (0.001, 1_000_000.0)  # ``rate_per_s``: mean arrivals per simulated second
MAX_THINK_TIME_S = 3600.0  # ``think_time_s`` (> 0): an hour between a session's turns, on average
MULTI_TURN_FRACTION_RANGE = (0.0, 1.0)
_MAX_TOKEN_ID = 2**31 - 1
_DEPLOYMENT = DeploymentConfig()


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Parameters of one workload. The defaults are the scaled-down one-minute run (see ``full_size``)."""

    groups: int = 32
    prompts_per_group: int = 24
    system_prompt_tokens: int = 1024
    question_tokens: int = 128
    output_tokens: int = 256
    multi_turn_fraction: float = 0.3
    turns: int = 3
    think_time_s: float = 2.0
    rate_per_s: float = 300.0
    zipf_s: float = 1.0
    block_size: int = _DEPLOYMENT.block_size
    key_family: KeyFamily = _DEPLOYMENT.key_family
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low, value in (
            ("groups", 1, self.groups),
            ("prompts_per_group", 1, self.prompts_per_group),
            ("system_prompt_tokens", 1, self.system_prompt_tokens),
            ("question_tokens", 1, self.question_tokens),
            ("output_tokens", 0, self.output_tokens),
            ("turns", 1, self.turns),
            ("block_size", 1, self.block_size),
        ):
            if value < low:
                raise ValueError(f"{name}: must be >= {low}, got {value}")
        if self.system_prompt_tokens > GROUP_STRIDE:
            raise ValueError(f"system_prompt_tokens: must be <= {GROUP_STRIDE}, got {self.system_prompt_tokens}")
        least, most = MULTI_TURN_FRACTION_RANGE
        if not least <= self.multi_turn_fraction <= most:
            raise ValueError(f"multi_turn_fraction: must be in {least:g}..{most:g}, got {self.multi_turn_fraction}")
        if not 0 < self.think_time_s <= MAX_THINK_TIME_S:
            raise ValueError(f"think_time_s: must be > 0 and <= {MAX_THINK_TIME_S:g}, got {self.think_time_s}")
        least, most = RATE_PER_S_RANGE
        if not least <= self.rate_per_s <= most:
            raise ValueError(f"rate_per_s: must be in {least:g}..{most:g}, got {self.rate_per_s}")
        if not (math.isfinite(self.zipf_s) and self.zipf_s >= 0):
            raise ValueError(f"zipf_s: must be a finite number >= 0, got {self.zipf_s}")

    @classmethod
    def full_size(cls) -> WorkloadSpec:
        """The benchmark's own defaults: 64 groups × 16 prompts, 2,048-token system prompt, 128/256.

        Prompts are about twice as long as the scaled default's, so the arrival rate is halved to
        keep the prefill demand on the cluster comparable.
        """
        scaled = cls()
        return replace(
            scaled, groups=64, prompts_per_group=16, system_prompt_tokens=2048, rate_per_s=scaled.rate_per_s / 2
        )

    @property
    def conversations(self) -> int:
        return self.groups * self.prompts_per_group

    @property
    def mean_turns(self) -> float:
        return 1.0 + self.multi_turn_fraction * (self.turns - 1)

    def to_json(self) -> dict[str, object]:
        return {
            "groups": self.groups,
            "prompts_per_group": self.prompts_per_group,
            "system_prompt_tokens": self.system_prompt_tokens,
            "question_tokens": self.question_tokens,
            "output_tokens": self.output_tokens,
            "multi_turn_fraction": self.multi_turn_fraction,
            "turns": self.turns,
            "think_time_s": self.think_time_s,
            "rate_per_s": self.rate_per_s,
            "zipf_s": self.zipf_s,
            "block_size": self.block_size,
            "key_family": self.key_family.value,
            "seed": self.seed,
        }


@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One request of the workload: its arrival on the simulated timeline, its prompt and block keys.

    ``tokens`` is empty when only the block keys are known (a replayed trace); ``input_tokens``
    is the prompt's length either way, ``output_tokens`` the answer it decodes.
    """

    request_id: str
    arrival_s: float
    group: int
    session: int
    turn: int  # 0 for a conversation's first prompt
    tokens: tuple[int, ...]
    keys: tuple[int, ...]
    input_tokens: int
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec
    requests: tuple[DemoRequest, ...]  # in arrival order

    @property
    def duration_s(self) -> float:
        """Simulated time from 0 to the last arrival."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    def to_json(self) -> dict[str, object]:
        """The spec plus the realised shape (for demo-results.json)."""
        n = len(self.requests)
        return {
            "spec": self.spec.to_json(),
            "requests": n,
            "conversations": self.spec.conversations,
            "follow_up_turns": sum(1 for r in self.requests if r.turn > 0),
            "mean_input_tokens": round(sum(r.input_tokens for r in self.requests) / n, 1) if n else 0.0,
            "simulated_duration_s": round(self.duration_s, 3),
            "conversations_per_group": list(group_counts(self.requests, self.spec.groups)),
        }


def zipf_weights(n: int, s: float) -> tuple[float, ...]:
    """Normalised Zipf weights for ranks 1..n: w_r ∝ 1 / r^s (s = 0 is uniform)."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    raw = [_inverse_power(rank, s) for rank in range(1, n + 1)]
    total = sum(raw)
    return tuple(w / total for w in raw)


def _inverse_power(rank: int, s: float) -> float:
    """``1 / rank^s``; 0 where ``rank^s`` overflows a float (its inverse is below the smallest one)."""
    try:
        power: float = float(rank) ** s  # what int ** float computes
    except OverflowError:
        return 0.0
    return 1.0 / power


def system_prompt(group: int, tokens: int) -> range:
    """Group ``group``'s shared system prompt: token ids ``group · GROUP_STRIDE + 0..tokens-1``."""
    return range(group * GROUP_STRIDE, group * GROUP_STRIDE + tokens)


def build_workload(spec: WorkloadSpec) -> Workload:
    """Every request of ``spec``, sorted by arrival (ties by request id). Deterministic for a spec.

    ValueError, naming the demo's flag, when a request would arrive after ``MAX_ARRIVAL_S``."""
    rng = random.Random(spec.seed)
    cumulative = list(itertools.accumulate(zipf_weights(spec.groups, spec.zipf_s)))
    groups = range(spec.groups)
    start_rate = spec.rate_per_s / spec.mean_turns
    fresh = itertools.count(spec.groups * GROUP_STRIDE)
    requests: list[DemoRequest] = []
    started_at = 0.0
    for session in range(spec.conversations):
        started_at += rng.expovariate(start_rate)
        if not started_at <= MAX_ARRIVAL_S:
            raise ValueError(
                f"--rate {spec.rate_per_s:g}: conversation {session + 1} of {spec.conversations} would start "
                f"at {started_at:.6g} simulated s, after the last arrival allowed ({MAX_ARRIVAL_S:g} s, a week); "
                "raise --rate or start fewer conversations (--groups, --prompts-per-group)"
            )
        group = rng.choices(groups, cum_weights=cumulative)[0]
        turns = spec.turns if rng.random() < spec.multi_turn_fraction else 1
        prompt = list(system_prompt(group, spec.system_prompt_tokens))
        arrival = started_at
        for turn in range(turns):
            if turn > 0:
                prompt.extend(itertools.islice(fresh, spec.output_tokens))  # the previous turn's answer
                arrival += rng.expovariate(1.0 / spec.think_time_s)
                if not arrival <= MAX_ARRIVAL_S:
                    raise ValueError(
                        f"--think-time-s {spec.think_time_s:g}: turn {turn + 1} of conversation {session + 1} "
                        f"would arrive at {arrival:.6g} simulated s, after the last arrival allowed "
                        f"({MAX_ARRIVAL_S:g} s, a week); lower --think-time-s, --turns or --rate"
                    )
            prompt.extend(itertools.islice(fresh, spec.question_tokens))
            tokens = tuple(prompt)
            requests.append(
                DemoRequest(
                    request_id=f"s{session:05d}-t{turn}",
                    arrival_s=arrival,
                    group=group,
                    session=session,
                    turn=turn,
                    tokens=tokens,
                    keys=block_keys(tokens, spec.block_size, spec.key_family),
                    input_tokens=len(tokens),
                    output_tokens=spec.output_tokens,
                )
            )
    if next(fresh) > _MAX_TOKEN_ID:
        raise ValueError("workload: more fresh tokens than 31-bit token ids allow; use fewer or shorter prompts")
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    return Workload(spec, tuple(requests))


def group_counts(requests: Sequence[DemoRequest], groups: int) -> tuple[int, ...]:
    """Conversations per group (first turns only): the realised popularity."""
    counts = [0] * groups
    for request in requests:
        if request.turn == 0:
            counts[request.group] += 1
    return tuple(counts)


def bulk_window(arrivals: Sequence[float]) -> tuple[int, int]:
    """``(first, end)``: the requests ``arrivals[first:end]`` (sorted times) of the shortest span
    holding ``BULK_SHARE`` of them; a workload's sessions start for a while and then trail off with
    their last turns, and the load is what the bulk of the requests meets."""
    n = len(arrivals)
    if n < 2:
        return (0, n)
    size = max(2, math.ceil(BULK_SHARE * n))
    first = min(range(n - size + 1), key=lambda i: (arrivals[i + size - 1] - arrivals[i], i))
    return (first, first + size)


def bulk_span(workload: Workload) -> tuple[float, float]:
    """The bulk window's first and last arrival (simulated s; ``(0, 0)`` without requests)."""
    arrivals = [r.arrival_s for r in workload.requests]
    first, end = bulk_window(arrivals)
    if end <= first:
        return (0.0, 0.0)
    return (arrivals[first], arrivals[end - 1])
