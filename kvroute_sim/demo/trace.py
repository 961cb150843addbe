"""Request traces in the Mooncake JSONL format: read, generate, replay as a ``Workload`` (pure but for file I/O).

One JSON object per line: ``timestamp`` (ms from the start), ``input_length``, ``output_length``,
``hash_ids`` (one id per ``TRACE_BLOCK_TOKENS``-token block of the prompt; equal ids at equal
positions are a shared prefix; ``len(hash_ids) == ceil(input_length / TRACE_BLOCK_TOKENS)``).
The ids are replayed as the caller's block keys with that block size.

The load a trace puts on a cluster is defined in ``load`` (as for any workload).

The generator makes traces of that format with the shapes real ones have: shared system prompts
(groups), multi-turn sessions whose later turns extend earlier prompts (prompt + answer + new
question), and long-tailed (log-normal) question and answer lengths, prompts capped at
``max_input_tokens``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute_sim.demo.workload import MAX_ARRIVAL_S, DemoRequest, Workload, WorkloadSpec

TRACE_BLOCK_TOKENS = 512
SPEEDUP_RANGE = (0.001, 1_000_000.0)  # ``trace_workload``'s speedup (``kvroute demo --trace-speedup``)
DEFAULT_SPEEDUP = 1.0  # a trace replayed in its own time
_MAX_KEY = 2**63 - 1


class TraceFormatError(ValueError):
    """A trace line that is not a valid record; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> dict[str, object]:
        ts = int(self.timestamp_ms) if float(self.timestamp_ms).is_integer() else self.timestamp_ms
        return {
            "timestamp": ts,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }


def _field_int(obj: dict[str, object], name: str, low: int, where: str) -> int:
    value = obj.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: {name!r} must be an integer, got {value!r}")
    if value < low:
        raise TraceFormatError(f"{where}: {name!r} must be >= {low}, got {value}")
    if value > _MAX_KEY:
        raise TraceFormatError(f"{where}: {name!r} must be <= 2^63-1, got {value}")
    return value


def _finite(number: float) -> bool:
    """Finite as a float: an integer beyond float's range is not."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def parse_line(text: str, where: str) -> TraceRecord:
    """One trace line; ``where`` (e.g. ``trace.jsonl line 7``) starts every error message."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise TraceFormatError(f"{where}: JSON nested too deeply to read") from None
    except ValueError as exc:  # an integer of more digits than int() converts: the advice after ';' is Python's
        raise TraceFormatError(f"{where}: unreadable JSON ({str(exc).partition(';')[0]})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not _finite(ts) or ts < 0:
        raise TraceFormatError(f"{where}: 'timestamp' must be a number of ms >= 0, got {ts!r}")
    input_length = _field_int(obj, "input_length", 1, where)
    output_length = _field_int(obj, "output_length", 0, where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _MAX_KEY for i in ids
    ):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of integers in 0..2^63-1")
    expected = -(-input_length // TRACE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise TraceFormatError(
            f"{where}: 'hash_ids' has {len(ids)} ids; input_length {input_length} needs "
            f"ceil({input_length}/{TRACE_BLOCK_TOKENS}) = {expected}"
        )
    return TraceRecord(float(ts), input_length, output_length, tuple(ids))


def read_trace(path: Path, *, limit: int | None = None) -> tuple[TraceRecord, ...]:
    """The first ``limit`` records of ``path`` (blank lines skipped), sorted by timestamp (stable).

    TraceFormatError names the line that is not UTF-8 text or not a record; OSError, the file's."""
    records: list[TraceRecord] = []
    # Undecodable bytes become lone surrogates, which no UTF-8 text decodes to: found per line.
    with path.open(encoding="utf-8", errors="surrogateescape") as lines:
        for number, line in enumerate(lines, start=1):
            if limit is not None and len(records) >= limit:
                break
            where = f"{path.name} line {number}"
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:
                raise TraceFormatError(f"{where}: not UTF-8 text") from None
            if line.strip():
                records.append(parse_line(line, where))
    if not records:
        raise TraceFormatError(f"{path.name}: no records")
    records.sort(key=lambda r: r.timestamp_ms)
    return tuple(records)


def write_trace(path: Path, records: Iterable[TraceRecord]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")
    return path


@dataclass(frozen=True, slots=True)
class TraceWorkload(Workload):
    """A replayed trace: requests with block keys but no token ids."""

    source: str = ""
    speedup: float = DEFAULT_SPEEDUP

    def to_json(self) -> dict[str, object]:
        n = len(self.requests)
        return {
            "trace": self.source,
            "speedup": self.speedup,
            "block_size": self.spec.block_size,
            "requests": n,
            "mean_input_tokens": round(sum(r.input_tokens for r in self.requests) / n, 1) if n else 0.0,
            "max_input_tokens": max((r.input_tokens for r in self.requests), default=0),
            "mean_output_tokens": round(sum(r.output_tokens for r in self.requests) / n, 1) if n else 0.0,
            "simulated_duration_s": round(self.duration_s, 3),
        }


def trace_workload(
    records: Sequence[TraceRecord], *, speedup: float = DEFAULT_SPEEDUP, source: str = "", seed: int = 0
) -> TraceWorkload:
    """The records as a workload: arrival = timestamp / speedup, keys = hash_ids, block size 512.

    ValueError, naming ``kvroute demo``'s flag, for a speedup outside ``SPEEDUP_RANGE`` or a record
    arriving after ``MAX_ARRIVAL_S``."""
    low, high = SPEEDUP_RANGE
    if not low <= speedup <= high:
        raise ValueError(f"--trace-speedup: must be in {low:g}..{high:g}, got {speedup}")
    for r in records:
        arrival_s = r.timestamp_ms / 1000.0 / speedup
        if not arrival_s <= MAX_ARRIVAL_S:
            raise ValueError(
                f"{source or 'trace'}: the record at timestamp {r.timestamp_ms:g} ms would arrive at "
                f"{arrival_s:.6g} simulated s with --trace-speedup {speedup:g}, after the last arrival allowed "
                f"({MAX_ARRIVAL_S:g} s, a week); raise --trace-speedup or replay fewer records (--trace-limit)"
            )
    spec = WorkloadSpec(block_size=TRACE_BLOCK_TOKENS, seed=seed)
    requests = tuple(
        DemoRequest(
            request_id=f"t{i:06d}",
            arrival_s=r.timestamp_ms / 1000.0 / speedup,
            group=-1,
            session=i,
            turn=0,
            tokens=(),
            keys=r.hash_ids,
            input_tokens=r.input_length,
            output_tokens=r.output_length,
        )
        for i, r in enumerate(records)
    )
    return TraceWorkload(spec, requests, source=source, speedup=speedup)


# ---- generator ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceGenSpec:
    """A synthetic trace's shape (defaults: a few hundred requests, prompts up to 100 K tokens)."""

    sessions: int = 200
    groups: int = 12
    system_prompt_tokens: tuple[int, int] = (1024, 8192)  # uniform range per group
    question_median_tokens: float = 600.0
    question_sigma: float = 1.7  # log-normal: a long tail of pasted documents
    answer_median_tokens: float = 250.0
    answer_sigma: float = 0.8
    max_input_tokens: int = 100_000
    max_output_tokens: int = 4096
    multi_turn_fraction: float = 0.5
    max_turns: int = 5
    think_time_s: float = 5.0
    sessions_per_s: float = 20.0
    zipf_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value in (
            ("sessions", self.sessions),
            ("groups", self.groups),
            ("max_turns", self.max_turns),
            ("max_input_tokens", self.max_input_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        low, high = self.system_prompt_tokens
        if not 1 <= low <= high < self.max_input_tokens:
            raise ValueError(f"system_prompt_tokens: need 1 <= low <= high < max_input_tokens, got {low}, {high}")
        for name, number in (
            ("think_time_s", self.think_time_s),
            ("sessions_per_s", self.sessions_per_s),
            ("question_median_tokens", self.question_median_tokens),
            ("answer_median_tokens", self.answer_median_tokens),
        ):
            if not (math.isfinite(number) and number > 0):
                raise ValueError(f"{name}: must be > 0, got {number}")
        if not 0.0 <= self.multi_turn_fraction <= 1.0:
            raise ValueError(f"multi_turn_fraction: must be in 0..1, got {self.multi_turn_fraction}")


def generate_trace(spec: TraceGenSpec) -> tuple[TraceRecord, ...]:
    """A seeded synthetic trace (deterministic for a spec), sorted by timestamp.

    Block ids: a full block of a group's system prompt has the same id in every session of the
    group; a session's later turn keeps the ids of the earlier turn's full blocks (its prompt is
    the earlier prompt + answer + question); every other block gets a fresh id.
    """
    rng = random.Random(spec.seed)
    fresh = itertools.count()
    low, high = spec.system_prompt_tokens
    systems = []
    for _ in range(spec.groups):
        length = rng.randint(low, high)
        systems.append((length, tuple(next(fresh) for _ in range(length // TRACE_BLOCK_TOKENS))))
    weights = [1.0 / (rank**spec.zipf_s) for rank in range(1, spec.groups + 1)]

    def lognormal(median: float, sigma: float, cap: int) -> int:
        return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))

    records: list[TraceRecord] = []
    start = 0.0
    for _ in range(spec.sessions):
        start += rng.expovariate(spec.sessions_per_s)
        system_length, system_ids = systems[rng.choices(range(spec.groups), weights)[0]]
        turns = rng.randint(2, spec.max_turns) if spec.max_turns > 1 and rng.random() < spec.multi_turn_fraction else 1
        # Each prompt is the previous one (the system prompt, at first) + its answer + a question;
        # only the previous prompt's whole blocks keep their ids.
        prev_length, ids, answer, at = system_length, list(system_ids), 0, start
        for turn in range(turns):
            if turn > 0:
                at += rng.expovariate(1.0 / spec.think_time_s)
            question = lognormal(spec.question_median_tokens, spec.question_sigma, spec.max_input_tokens)
            length = min(spec.max_input_tokens, prev_length + answer + question)
            if length <= prev_length:
                break  # the conversation outgrew the context
            kept = prev_length // TRACE_BLOCK_TOKENS
            ids = ids[:kept] + [next(fresh) for _ in range(-(-length // TRACE_BLOCK_TOKENS) - kept)]
            answer = lognormal(spec.answer_median_tokens, spec.answer_sigma, spec.max_output_tokens)
            records.append(TraceRecord(round(at * 1000.0, 3), length, answer, tuple(ids)))
            prev_length = length
    records.sort(key=lambda r: r.timestamp_ms)
    return tuple(records)
