"""Replay: re-run recorded decisions through the real router chain and the real policy on MockClock.

Each recorded decision runs alone in its own ``trio.run`` on a fresh :class:`trio.testing.MockClock`
jumped to the request's recorded receipt time, so every relative time lands exactly where it was.
The real :class:`~actors.router_actor.RouterActor` walks the chain (admission, windows, fall-through,
the reason carried to the domain answer, role addresses); each source is a replay source that lets
its recorded answer arrive at its recorded time inside the window the configuration gives it now:

- master and KVCM: the recorded answer at its recorded time, or nothing if the window ends first
  (then the source's own window reason: ``master_unavailable``, ``deadline``);
- shadow: the recorded index match (the index's state is not replayed, its answer is);
- scoring: a fresh instance of the configured policy (``scorer.policy``) plans from the
  recorded cache answer and fleet, the recorded probe results arrive at their times until
  ``decide_at``, and it decides with the ledger view and tie draws the recorded decision read;
- domain: the worker the recorded decision drew (its RNG is shared by all requests, so the draw
  is an input, not something to recompute).

The ledger is reproduced per decision from its recorded view, not by replaying the ledger's history:
a decision's view depends on the order the Scorer's inbox served concurrent requests and on the
statuses each was made with, which the log records as the view itself. So each decision replays
exactly on its own, even from a log whose older files rotation deleted. A what-if run
(``overrides``) therefore changes each decision in isolation; a changed pick does not feed back into
the next decision's ledger.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trio
import trio.testing

from actors.metrics_sink import MetricsSink
from actors.router_actor import RouterActor, WalkProgress
from actors.sources.base import (
    Answered,
    Ended,
    FellThrough,
    RequestContext,
    Skipped,
    Source,
    SourceResult,
)
from actors.sources.companions import CompanionPicker
from actors.sources.domain import DomainSource
from actors.sources.master import kept_after_master, routed_pick
from actors.sources.scoring import selection_result
from actors.sources.shadow import scores_unmatched
from router.config import KvrouteConfig, LimitsConfig, MasterProtocol, RouterConfig
from router.decision_record import (
    KIND_DECISION,
    KIND_FLEET,
    KIND_HEADER,
    MAGIC,
    READABLE_VERSIONS,
    Frame,
    LogFormatError,
    TornTail,
    decision_fields,
    decode_addrs,
    decode_fleet,
    decode_hosts,
    read_frames,
)
from router.logs import AggregatingLogger
from router.master_config import master_hosts
from router.policy.cache_affinity import ObservedStatus
from router.policy.choice import make_policy, status_horizon_s
from router.policy.deadline_split import COLD, SplitEstimates
from router.policy.ledger import NEVER, SelectionLedger
from router.policy.plan import CandidateSource, Fleet
from router.problems import declared_range
from router.request import CheckedRequest, PreparedRequest, is_sliced
from router.settings import ROUTER_SETTING_OPTION, LoadedConfig, resolve_config
from router.settings.redact import config_digest
from router.settings.table import BY_NAME
from router.settings.validate import SettingProblem
from router.types import (
    BadRequest,
    DropReason,
    HostMatch,
    KvCacheGroupMode,
    Reason,
    Role,
    RoleAddr,
    RouteDecision,
    RouteRequest,
    RouteSource,
    SourceOutcome,
    Stage,
    TaskInfo,
    WorkerAddr,
    WorkerStatus,
)

log = logging.getLogger(__name__)

_IMMEDIATE_MASTER = frozenset({Reason.NO_MASTER, Reason.MASTER_BREAKER_OPEN, Reason.MASTER_QUEUE_FULL})


# --- the recorded cases --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordedProbe:
    arrived: float | None
    status: WorkerStatus | None
    taken: float | None
    missing: DropReason | None


@dataclass(frozen=True, slots=True)
class RecordedScoring:
    source: CandidateSource
    fleet: Fleet
    ejected: tuple[str, ...]
    probes: Mapping[str, RecordedProbe]
    ledger: Mapping[str, tuple[int, float]]  # target → (pending charge, last selected)
    ties: tuple[float, ...]
    decided: float | None = None  # when it scored, relative to receipt (None: not recorded)
    other_roles: frozenset[str] = frozenset()  # the workers its plan passed over as unfit (role, not alive)


@dataclass(frozen=True, slots=True)
class RecordedAnswer:
    started: float
    arrived: float
    result: SourceResult


@dataclass(frozen=True, slots=True)
class RecordedKvcm:
    arrived: float
    hosts: tuple[HostMatch, ...] | None
    reason: Reason | None


@dataclass(frozen=True, slots=True)
class Case:
    """One recorded decision, decoded: its inputs and what it decided (``expected``)."""

    path: str
    offset: int
    request_id: str
    received_at: float
    request: RouteRequest
    overloaded: bool
    master: RecordedAnswer | None
    kvcm: RecordedKvcm | None
    shadow_hosts: tuple[HostMatch, ...] | None
    scorings: tuple[RecordedScoring, ...]
    fleet: Fleet | None  # the last fleet the log described before this decision
    expected: Mapping[str, Any]
    split: SplitEstimates = COLD  # the deadline split's estimates the recorded request used
    # A version 2 record: its learned split left reserve_min + lag + score after the probes, not a tail.
    split_without_tail: bool = False
    # The token count of a prompt the recorded deadline cut while it was hashed (None: not cut). Its
    # request is built with a stand-in prompt of that length at replay (``replayed_request``), not held.
    hashing_cut: int | None = None
    # The count of keys recorded as a digest (None: none, or recorded as given in ``request``): stand-in
    # keys of that count are built at replay, not held, since a loaded case would hold 8 bytes a key.
    digested_keys: int | None = None

    def replayed_request(self) -> RouteRequest:
        """The request to route: the recorded one, with stand-in keys (zeros, the recorded count) for keys
        recorded as a digest, where only their count matters; and a stand-in prompt (zeros, the recorded
        length) for one whose hashing was cut: its keys were never made, and only its length and slicing
        decide."""
        request = self.request
        if self.digested_keys is not None:
            request = replace(request, block_cache_keys=(0,) * self.digested_keys)
        if self.hashing_cut is not None:
            request = replace(request, token_ids=(0,) * self.hashing_cut)
        return request

    def split_estimates(self, router: RouterConfig) -> SplitEstimates:
        """The estimates the recorded request's windows came from, under ``router``'s split rule."""
        e = self.split
        if self.split_without_tail and e.score is not None:
            return replace(e, tail=router.reserve_min_ms / 1000.0 + e.lag + e.score)
        return e

    def kept_by(self, stage: Stage) -> float | None:
        """When the recorded run took a wait's answer although its task resumed after the wait's window
        (the reply was in before the cut reached the task: a stalled loop keeps it), the window's end,
        relative to receipt: the answer was in by then. None when the recorded wait was cut."""
        for recorded_stage, end_ms, cut in self.expected.get("sw", ()):
            if recorded_stage == stage.value and not cut:
                return float(end_ms) / 1000.0
        return None

    def scored_past_its_window(self, decided: float) -> bool:
        """Whether a recorded scoring at ``decided`` (relative to receipt) came after the recorded probe
        window's end: its task resumed late (a stalled loop). True when the record holds no probe window
        (a version 1 log, or no wait): its scoring moment stands as recorded."""
        for stage, end_ms, _ in self.expected.get("sw", ()):
            if stage == Stage.PROBE.value:
                return decided * 1000.0 > float(end_ms) + 0.001  # past the end's rounding to the µs
        return True

    def ran_out_unseen(self) -> bool:
        """The recorded request ran out of time inside a source, with no wait cut: its task did not run
        again before the deadline (a stalled loop) somewhere the log does not time. Its last step is
        that source's, ended by the deadline (logs written before such steps were kept have none)."""
        steps: Sequence[Any] = self.expected.get("ch") or ()
        # The last source's own waits only: a query the split cut in KVCM's source, before the shadow
        # source took the rest, says nothing of where the shadow source's time went.
        own = (Stage.PROBE.value,) if steps and steps[-1][0] == RouteSource.SHADOW.value else None
        cut = any(bool(c) for stage, _, c in self.expected.get("sw", ()) if own is None or stage in own)
        ended_inside = not steps or _ended_by_the_deadline(steps[-1])
        return self.expected.get("r") == Reason.DEADLINE.value and ended_inside and not cut

    def ended_unscored_in(self, source: RouteSource) -> bool:
        """Whether the recorded request's deadline ended it in ``source``'s step (its last): with no
        scoring recorded for that source, it ran out before it scored."""
        steps: Sequence[Any] = self.expected.get("ch") or ()
        return (
            self.expected.get("r") == Reason.DEADLINE.value
            and bool(steps)
            and steps[-1][0] == source.value
            and _ended_by_the_deadline(steps[-1])
        )

    def queried(self) -> bool:
        """Whether the recorded request sent its KVCM query: every query sent runs the query's wait."""
        return any(stage == Stage.CACHE_QUERY.value for stage, _, _ in self.expected.get("sw", ()))

    def waited_for_leader(self) -> tuple[bool, bool] | None:
        """Whether the recorded request waited for a leader lookup, and whether the split cut that wait
        (None: it did not wait). Replay does not re-run lookups: it puts the recorded wait back."""
        for stage, _, cut in self.expected.get("sw", ()):
            if stage == Stage.LEADER.value:
                return True, bool(cut)
        return None


@dataclass(frozen=True, slots=True)
class RecordedLog:
    settings: Mapping[str, str]
    digest: str
    seed: int
    cases: tuple[Case, ...]
    # Files that end inside a frame (their writer stopped mid-write): read up to it, each said here.
    torn: tuple[TornTail, ...] = ()


@dataclass(frozen=True, slots=True)
class _Header:
    settings: Mapping[str, str]
    digest: str
    seed: int


class LogReader:
    """The decisions of log files, read as they are taken from :meth:`cases`, a frame at a time: a log
    set is never held whole (a replay needs one decision at a time).

    Made, it reads every file's header and no further: the first one's settings configure a replay
    (``settings``, ``digest``, ``seed``), and a file that cannot be opened, has no header, or has one
    of a version this kvroute does not read or of another configuration is refused then, before any
    decision. Raises LogFormatError naming the file and byte offset, when made or when :meth:`cases`
    reaches it; a file that ends inside a frame is read up to it, and the tear given to ``on_torn``
    and kept in ``torn``."""

    def __init__(self, paths: Sequence[str], on_torn: Callable[[TornTail], None] | None = None) -> None:
        self.torn: list[TornTail] = []
        self._on_torn = on_torn
        paths = tuple(paths)
        first = _check_headers(paths) or _Header({}, "", 0)  # no paths: no header, no decision
        self.settings, self.digest, self.seed = first.settings, first.digest, first.seed
        self._items = self._read(paths)

    def cases(self) -> Iterator[Case]:
        """Every decision of the files, in order, each read when it is taken (once: the files are read
        once)."""
        for item in self._items:
            if isinstance(item, Case):
                yield item

    def _read(self, paths: tuple[str, ...]) -> Iterator[_Header | Case]:
        digest: str | None = None
        for path in paths:
            fleets: dict[int, Fleet] = {}
            last_fleet: Fleet | None = None
            seen_header = False
            frames = read_frames(path)
            while True:
                try:
                    frame = next(frames)
                except StopIteration:
                    break
                except TornTail as tail:
                    if not seen_header:
                        raise
                    self.torn.append(tail)
                    if self._on_torn is not None:
                        self._on_torn(tail)
                    break
                try:
                    if frame.kind == KIND_HEADER:
                        header = _checked_header(path, frame, digest)
                        digest = header.digest
                        seen_header = True
                        item: _Header | Case = header
                    elif not seen_header:
                        raise LogFormatError(path, frame.offset, _BEFORE_THE_HEADER)
                    elif frame.kind == KIND_FLEET:
                        last_fleet = fleets[int(frame.payload["f"])] = decode_fleet(frame.payload)
                        continue
                    elif frame.kind == KIND_DECISION:
                        item = _case(path, frame.offset, frame.payload, fleets, last_fleet)
                    else:  # pragma: no cover  (read_frames yields no other kind)
                        continue
                except LogFormatError:
                    raise
                except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:  # (a huge number)
                    why = f"malformed frame payload ({type(exc).__name__}: {exc})"
                    raise LogFormatError(path, frame.offset, why) from None
                yield item
            if not seen_header:
                raise LogFormatError(path, len(MAGIC), _NO_HEADER)


_BEFORE_THE_HEADER = "a frame before the header"
_NO_HEADER = "no header frame"


def _check_headers(paths: tuple[str, ...]) -> _Header | None:
    """The first file's header, each file's read (its magic and first frame, no further) and checked as
    :meth:`LogReader._read` checks it when it gets there: what one read finds is refused before any
    decision replays, not after every earlier file's. None with no paths."""
    first: _Header | None = None
    for path in paths:
        frames = read_frames(path)
        try:
            frame = next(frames, None)
        finally:
            frames.close()
        if frame is None:
            raise LogFormatError(path, len(MAGIC), _NO_HEADER)
        if frame.kind != KIND_HEADER:
            raise LogFormatError(path, frame.offset, _BEFORE_THE_HEADER)
        header = _checked_header(path, frame, None if first is None else first.digest)
        first = first or header
    return first


def _checked_header(path: str, frame: Frame, digest: str | None) -> _Header:
    """A header frame's settings, refused when its version is not one this kvroute reads or its digest is
    not ``digest`` (the files before's; None: the first file)."""
    try:
        header = _header(frame.payload)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:  # (a huge number)
        why = f"malformed frame payload ({type(exc).__name__}: {exc})"
        raise LogFormatError(path, frame.offset, why) from None
    if header is None:
        raise LogFormatError(path, frame.offset, f"header format version {frame.payload.get('v')!r}")
    if digest is not None and header.digest != digest:
        raise LogFormatError(path, frame.offset, "recorded with another configuration than the files before")
    return header


def _header(payload: Mapping[str, Any]) -> _Header | None:
    """A header frame's settings (None: a format version this kvroute does not read)."""
    if payload.get("v") not in READABLE_VERSIONS:
        return None
    settings = {str(k): str(v) for k, v in dict(payload["settings"]).items()}
    return _Header(settings, str(payload["digest"]), int(payload["seed"]))


def load_log(paths: Sequence[str]) -> RecordedLog:
    """Every decision of the log files, in order, held (:class:`LogReader` reads them one at a time).
    Raises LogFormatError naming the file and byte offset; a file that ends inside a frame is read up
    to it (``RecordedLog.torn``)."""
    reader = LogReader(paths)
    cases = tuple(reader.cases())
    return RecordedLog(reader.settings, reader.digest, reader.seed, cases, tuple(reader.torn))


def _status(raw: Sequence[Any]) -> WorkerStatus:
    """A status with exactly the fields scoring reads (role, alive, queue, outstanding work, geometry,
    KV cache group mode: a row from before version 5 has none, read as unspecified, which every query
    type accepts)."""
    role = Role(raw[0])
    outstanding = int(raw[3])
    running = (TaskInfo("recorded", outstanding, 0, False),) if outstanding else ()
    return WorkerStatus(
        role=role,
        role_reported=role.value,
        alive=bool(raw[1]),
        status_version=1,
        latest_finished_version=0,
        running=running,
        waiting_query_len=int(raw[2]),
        block_size=None if raw[4] is None else int(raw[4]),
        lookahead_tokens=None if raw[5] is None else int(raw[5]),
        kv_cache_group_mode=KvCacheGroupMode(raw[6]) if len(raw) > 6 else KvCacheGroupMode.UNSPECIFIED,
    )


def _answer(raw: Sequence[Any]) -> RecordedAnswer:
    started, arrived, kind, reason = float(raw[0]), float(raw[1]), str(raw[2]), Reason(raw[3])
    result: SourceResult
    if kind == "answered":
        addrs = decode_addrs(raw[7])
        first = addrs[0]
        worker = WorkerAddr(first.ip, first.http_port, first.grpc_port, first.grpc_port)
        result = Answered(worker=worker, role=first.role, reason=reason, role_addrs=addrs)
    elif kind == "fell_through":
        result = FellThrough(reason, to_last=bool(raw[4]))
    elif kind == "ended":
        result = Ended(reason, str(raw[5]), int(raw[6]))
    else:
        result = Skipped()
    return RecordedAnswer(started, arrived, result)


# The most keys a request can have (the upper bound of limits.max_block_keys): a recorded count
# beyond it is a garbled log, not a request to rebuild.
_MAX_RECORDED_KEYS = int(declared_range(LimitsConfig, "max_block_keys").high)
_MAX_RECORDED_TOKENS = int(declared_range(LimitsConfig, "max_prompt_tokens").high)  # likewise for a prompt
# What a decision's "d" must hold for replay to compare it (decision_fields; "sm"/"sw" are optional).
_DECISION_FIELDS = frozenset({"w", "r", "rs", "ra", "ch", "c", "hit", "ec"})


def _keys(raw: Any) -> tuple[int, ...] | int:
    """The recorded keys, or for long keys (recorded as a digest, where only their count matters to
    replay) their count."""
    if isinstance(raw, list):
        return tuple(int(k) for k in raw)
    _, _, length = str(raw).rpartition(":")
    count = int(length)
    if not 0 <= count <= _MAX_RECORDED_KEYS:
        raise ValueError(f"a recorded key count of {count}, beyond 0..{_MAX_RECORDED_KEYS}")
    return count


def _rows(fields: Mapping[str, Any], name: str, width: int) -> None:
    rows = fields[name]
    if not isinstance(rows, list) or not all(isinstance(row, list) and len(row) == width for row in rows):
        raise ValueError(f"the decision's {name!r} is not a list of {width}-field rows")


def _check_expected(fields: Mapping[str, Any]) -> None:
    """The recorded decision's fields that comparing and the what-if read, in their shapes: a record
    garbled inside frames whose checksums hold otherwise failed the what-if with a traceback."""
    missing = _DECISION_FIELDS - set(fields)
    if missing:
        raise KeyError(f"the decision lacks {', '.join(sorted(missing))}")
    for name, optional in (("hit", False), ("ec", True)):
        if not (optional and fields[name] is None) and type(fields[name]) is not int:
            raise ValueError(f"the decision's {name!r} is not an integer: {fields[name]!r:.40}")
    _rows(fields, "ch", 3)
    _rows(fields, "c", 8)
    _rows(fields, "ra", 4)
    decode_addrs(fields["ra"])  # the replayed domain and companions read them so: roles and ports
    if "sw" in fields:
        _rows(fields, "sw", 3)
    for row in fields["c"]:
        if row[4] is not None and type(row[4]) is not int:
            raise ValueError(f"a candidate's work in the decision is not an integer: {row[4]!r:.40}")


def _case(path: str, offset: int, p: Mapping[str, Any], fleets: Mapping[int, Fleet], fleet: Fleet | None) -> Case:
    _check_expected(dict(p["d"]))
    received = float(p["t"])
    roles = None if "ro" not in p else tuple(Role(r) for r in p["ro"])
    deadline = None if "dl" not in p else received + float(p["dl"])
    budget = None if "b" not in p else float(p["b"])
    digested_keys = None
    if "k" in p:
        recorded_keys = _keys(p["k"])
        keys = None
        if isinstance(recorded_keys, int):
            digested_keys = recorded_keys
        else:
            keys = recorded_keys
        request = RouteRequest(
            str(p["id"]),
            block_cache_keys=keys,
            block_size=int(p["bs"]),
            seq_len=int(p["sl"]),
            budget_ms=budget,
            deadline=deadline,
            roles=roles,
        )
    else:  # cut while hashing, refused before it had keys (bad request) or never admitted (overloaded)
        request = RouteRequest(str(p["id"]), budget_ms=budget, deadline=deadline, roles=roles)
    hashing_cut = None
    if "hc" in p:
        hashing_cut = int(p["hc"])
        if not 0 < hashing_cut <= _MAX_RECORDED_TOKENS:
            raise ValueError(f"a recorded prompt of {hashing_cut} tokens, beyond 1..{_MAX_RECORDED_TOKENS}")
    kvcm = None
    if "kv" in p:
        raw = p["kv"]
        kvcm = RecordedKvcm(
            float(raw[1]), None if raw[2] is None else decode_hosts(raw[2]), None if raw[3] is None else Reason(raw[3])
        )
    scorings = []
    for sc in p.get("sc", ()):
        scoring_fleet = fleets[int(p["f"])]
        probes = {
            str(row[0]): RecordedProbe(
                None if row[1] is None else float(row[1]),
                None if row[2] is None else _status(row[2]),
                None if row[3] is None else float(row[3]),
                None if row[4] is None else DropReason(row[4]),
            )
            for row in sc["p"]
        }
        ledger = {
            str(row[0]): (int(row[1]), NEVER if row[2] is None else float(row[2])) for row in sc["lv"]
        }
        scorings.append(
            RecordedScoring(
                CandidateSource(sc["s"]),
                scoring_fleet,
                tuple(str(t) for t in sc["ej"]),
                probes,
                ledger,
                tuple(float(row[3]) for row in sc["lv"]),
                decided=None if sc.get("at") is None else float(sc["at"]),
                other_roles=frozenset(str(t) for t in sc.get("or", ())),
            )
        )
        fleet = scoring_fleet
    expected = dict(p["d"])
    split = COLD
    split_without_tail = False
    if "se" in p:
        q, pr, sc, lag, *tail = (None if v is None else float(v) for v in p["se"])
        split = SplitEstimates(query=q, probe=pr, score=sc, lag=lag or 0.0, tail=tail[0] if tail else None)
        split_without_tail = not tail
    return Case(
        path=path,
        offset=offset,
        request_id=str(p["id"]),
        received_at=received,
        request=request,
        overloaded=bool(p.get("ov", 0)),
        master=None if "m" not in p else _answer(p["m"]),
        kvcm=kvcm,
        shadow_hosts=None if "sh" not in p else decode_hosts(p["sh"]),
        scorings=tuple(scorings),
        fleet=fleet,
        expected=expected,
        split=split,
        split_without_tail=split_without_tail,
        hashing_cut=hashing_cut,
        digested_keys=digested_keys,
    )


# --- the replay parts ------------------------------------------------------------------------------


class RecordedLedger(SelectionLedger):
    """The ledger as the recorded decision read it; recording into it changes nothing."""

    def __init__(self, view: Mapping[str, tuple[int, float]]) -> None:
        super().__init__(1, 2, status_horizon_s=0.0)  # records nothing: no charge to keep
        self._view = view

    def view(self, worker: str, status_taken_at: float) -> tuple[int, float]:
        return self._view.get(worker, (0, NEVER))

    def record(self, worker: str, uncached_tokens: int, now: float, status_taken_at: float | None = None) -> None:
        return None


class RecordedTies(random.Random):
    """The recorded tie draws in order; beyond them (a what-if scoring more candidates), seeded draws."""

    def __init__(self, ties: Sequence[float], seed: int) -> None:
        super().__init__(seed)
        self._ties = list(ties)
        self._next = 0

    def random(self) -> float:
        if self._next < len(self._ties):
            self._next += 1
            return self._ties[self._next - 1]
        return super().random()


@dataclass(slots=True)
class _Current:
    case: Case | None = None

    def get(self) -> Case:
        assert self.case is not None
        return self.case


# The source whose scoring a plan's hot candidates come from.
_SOURCE_OF: Mapping[CandidateSource, RouteSource] = {
    CandidateSource.HOT: RouteSource.KVCM,
    CandidateSource.SHADOW: RouteSource.SHADOW,
    CandidateSource.COLD: RouteSource.KVCM,
}


class _ReplayScoring:
    def __init__(self, config: KvrouteConfig, current: _Current) -> None:
        self._config = config
        self._current = current

    async def choose(self, ctx: RequestContext, hosts: Sequence[HostMatch], source: CandidateSource) -> SourceResult:
        case = self._current.get()
        if case.ran_out_unseen():  # the recorded stall, before any probe wait: the deadline ends it here too
            await trio.sleep_forever()
        recorded = next((s for s in case.scorings if s.source is source), None)
        fleet = recorded.fleet if recorded is not None else case.fleet or Fleet.of(())
        policy = make_policy(
            self._config.scorer,
            self._config.deployment,
            status_horizon_s=status_horizon_s(self._config),
            tie_rng=RecordedTies(() if recorded is None else recorded.ties, self._config.scorer.seed),
            ledger=RecordedLedger({} if recorded is None else recorded.ledger),
        )
        known = fleet.by_http_target
        ejected = [] if recorded is None else [known[t] for t in recorded.ejected if t in known]
        other_roles = frozenset[str]() if recorded is None else recorded.other_roles
        plan = policy.plan(
            hosts,
            fleet,
            request_id=ctx.request.request_id,
            source=source,
            ejected=ejected,
            unfit=lambda worker: worker.http_target in other_roles,
        )
        probes: Mapping[str, RecordedProbe] = {} if recorded is None else recorded.probes
        r = case.received_at
        in_time = [
            r + p.arrived
            for c in plan.candidates
            if (p := probes.get(c.target)) is not None and p.arrived is not None and r + p.arrived <= ctx.decide_at
        ]
        if in_time:  # the recorded results arrive at their times; waiting ends at decide_at at the latest
            with trio.move_on_at(ctx.decide_at):
                await trio.sleep_until(max(in_time))
        # The live wait was cut when some result had not come by decide_at.
        late = any(
            (p := probes.get(c.target)) is None or p.arrived is None or r + p.arrived > ctx.decide_at
            for c in plan.candidates
        )
        ctx.split.waited(Stage.PROBE, late)
        if recorded is None and case.ended_unscored_in(_SOURCE_OF[source]):
            # The recorded deadline ended it after its probe wait, before it scored: here too, not by
            # scoring nothing (no statuses, so no candidates) where the recording had no time to.
            await trio.sleep_forever()
        # A recorded run whose task resumed after decide_at (a stalled loop) scored with the results in
        # hand when it did: those are the ones that had arrived by its recorded scoring moment. One that
        # scored by its decide_at had in hand what had come by then; a what-if's decide_at says that alone.
        in_hand_by = ctx.decide_at
        if recorded is not None and recorded.decided is not None and case.scored_past_its_window(recorded.decided):
            in_hand_by = max(in_hand_by, r + recorded.decided)
        statuses: dict[WorkerAddr, ObservedStatus] = {}
        missing: dict[WorkerAddr, DropReason] = {}
        for c in plan.candidates:
            p = probes.get(c.target)
            if p is None or (p.arrived is not None and r + p.arrived > in_hand_by):
                missing[c.worker] = DropReason.PROBE_SKIPPED  # not in hand by decide_at (what-if)
            elif p.status is not None and p.taken is not None:
                statuses[c.worker] = policy.observe(c.worker, p.status, r + p.taken)
            elif p.missing is not None:
                missing[c.worker] = p.missing
        prepared = ctx.prepared
        selection = policy.decide(
            plan,
            statuses,
            seq_len=prepared.seq_len,
            block_size=prepared.block_size,
            now=trio.current_time(),
            roles=prepared.roles,
            missing=missing,
        )
        return selection_result(selection)


class _ReplayMaster:
    kind = RouteSource.MASTER

    def __init__(self, config: KvrouteConfig, current: _Current, *, later_sources: bool) -> None:
        self.needs_keys = config.master.protocol is MasterProtocol.GRPC  # as the master source hashes
        self._timeout_s = config.master.transport_timeout_ms / 1000.0
        self._later_s = kept_after_master(config, later_sources=later_sources)
        self._current = current

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        return None

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        case = self._current.get()
        recorded = case.master
        if recorded is None:  # the request's deadline ended it before the master answered
            await trio.sleep_forever()
            raise AssertionError("unreachable")  # pragma: no cover
        result = recorded.result
        if isinstance(result, Answered):  # the worker as the master source picks it
            pick = routed_pick(result.role_addrs, ctx.prepared.roles) or result.role_addrs[0]
            worker = WorkerAddr(pick.ip, pick.http_port, pick.grpc_port, pick.grpc_port)
            result = Answered(worker=worker, role=pick.role, reason=result.reason, role_addrs=result.role_addrs)
        if isinstance(result, FellThrough | Ended) and result.reason in _IMMEDIATE_MASTER:
            return result
        now = trio.current_time()
        end = min(now + self._timeout_s, ctx.deadline - self._later_s)
        if end <= now:
            return FellThrough(Reason.DEADLINE)
        with trio.move_on_at(end):
            await trio.sleep_until(case.received_at + recorded.arrived)
            return result
        return FellThrough(Reason.MASTER_UNAVAILABLE)


class _ReplayKvcm:
    kind = RouteSource.KVCM
    needs_keys = True

    def __init__(self, config: KvrouteConfig, current: _Current, scoring: _ReplayScoring) -> None:
        self._query_timeout_s = config.router.kvcm_query_timeout_ms / 1000.0
        self._current = current
        self._scoring = scoring

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        return None

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        case = self._current.get()
        recorded = case.kvcm
        if not ctx.prepared.keys:  # as the KVCM source: known without asking, the load decides
            # A log written before 2026-12-06 recorded no answer (None) and sent such a prompt to the
            # domain's draw: replayed as it was.
            if recorded is None or recorded.hosts is not None:
                ctx.cache_hosts = ()
            return FellThrough(Reason.NO_POSITIVE_MATCH)
        if recorded is None:
            await trio.sleep_forever()
            raise AssertionError("unreachable")  # pragma: no cover
        if recorded.reason is Reason.BREAKER_OPEN:  # refused before any lookup or query: nothing waited
            return FellThrough(Reason.BREAKER_OPEN)
        leader = case.waited_for_leader()
        if leader is not None:
            ctx.split.waited(Stage.LEADER, leader[1])
            if leader[1]:  # the lookup outlasted its window: no query was sent
                return FellThrough(Reason.DEADLINE)
            if not case.queried():  # the lookup failed inside its window: no query was sent either
                return FellThrough(recorded.reason or Reason.NO_LEADER)
        query_end = ctx.split.windows.query_end
        end = min(query_end, trio.current_time() + self._query_timeout_s)
        if end <= trio.current_time():
            # The window over before the query: the transport refuses it unsent (``NotSent``), with no
            # checkpoint, and the chain goes on; a wait here would meet the request's own expired scope.
            ctx.split.waited(Stage.CACHE_QUERY, query_end <= end)
            return FellThrough(Reason.DEADLINE)
        lands = recorded.arrived
        kept_by = case.kept_by(Stage.CACHE_QUERY)
        if recorded.hosts is not None and kept_by is not None and lands > kept_by:
            # Windows are recorded to the µs: land just inside the recorded one.
            lands = kept_by - 1e-6
        arrived = False
        with trio.move_on_at(end):
            await trio.sleep_until(case.received_at + lands)
            arrived = True
        ctx.split.waited(Stage.CACHE_QUERY, not arrived and query_end <= end)
        if not arrived:
            return FellThrough(Reason.DEADLINE)
        if recorded.hosts is None or not recorded.hosts:
            ctx.cache_hosts = recorded.hosts
            return FellThrough(recorded.reason or Reason.NO_POSITIVE_MATCH)
        ctx.cache_hosts = recorded.hosts
        return await self._scoring.choose(ctx, recorded.hosts, CandidateSource.HOT)


class _ReplayShadow:
    kind = RouteSource.SHADOW
    needs_keys = True

    def __init__(self, current: _Current, scoring: _ReplayScoring, *, score_unmatched: bool) -> None:
        self._current = current
        self._scoring = scoring
        self._score_unmatched = score_unmatched

    def window(self, ctx: RequestContext) -> float:
        return ctx.deadline

    def after_reply(self, ctx: RequestContext, decision: RouteDecision) -> None:
        return None

    async def attempt(self, ctx: RequestContext) -> SourceResult:
        if ctx.cache_hosts:
            return Skipped()
        hosts = self._current.get().shadow_hosts or ()
        if not hosts:
            if scores_unmatched(ctx, self._score_unmatched):
                return await self._scoring.choose(ctx, (), CandidateSource.SHADOW)
            return FellThrough(ctx.fallthrough or Reason.NO_POSITIVE_MATCH)
        return await self._scoring.choose(ctx, hosts, CandidateSource.SHADOW)


_DOMAIN_ENDINGS = frozenset(r.value for r in (Reason.NO_WORKERS, Reason.NO_CANDIDATES, Reason.BAD_REQUEST))


class _ReplayDomain(DomainSource):
    """The recorded draw: the worker the recorded decision's domain answer named."""

    def __init__(self, config: KvrouteConfig, current: _Current) -> None:  # no super(): no fleet, prober, RNG
        self._roles = config.deployment.roles
        self._current = current

    def charge(self, worker: WorkerAddr, tokens: int, requests: int = 1) -> None:
        """Nothing: replay reads each decision's ledger from the recording, and has no Scorer."""

    def pick(
        self,
        prepared: PreparedRequest | None,
        reason: Reason,
        error: str | None = None,
        *,
        rng: random.Random | None = None,  # replay draws nothing: the recording names the worker
        roles: tuple[Role, ...] | None = None,
    ) -> Answered | Ended:
        case = self._current.get()
        expected = case.expected
        if expected["rs"] == RouteSource.NONE.value and expected["r"] in _DOMAIN_ENDINGS:
            # The domain named no worker (none known, none routable, or a bad request with neither):
            # as recorded. The error text is not compared.
            return Ended(Reason(expected["r"]), error or f"as recorded: {expected['r']}")
        if prepared is not None:
            roles = prepared.roles
        elif roles is None:
            roles = self._roles
        addrs = decode_addrs(expected["ra"])
        if expected["rs"] == RouteSource.DOMAIN.value and addrs:
            first = addrs[0]
            fleet_worker = None if case.fleet is None else case.fleet.by_http_target.get(first.http_target)
            worker = fleet_worker or WorkerAddr(first.ip, first.http_port, first.grpc_port, first.grpc_port)
            return Answered(worker=worker, role=first.role, reason=reason, error=error)
        if case.fleet is not None and case.fleet.workers:  # what-if only: the recording drew no domain worker
            return Answered(worker=case.fleet.workers[0], role=roles[0], reason=reason, error=error)
        return Ended(Reason.NO_WORKERS, "the recording names no worker to stand in for a domain draw")


class _ReplayCompanions(CompanionPicker):
    def __init__(self, current: _Current) -> None:  # no super(): companions come from the recording
        self._current = current

    def fill(
        self, given: tuple[RoleAddr, ...], companions: Sequence[Role], *, rng: random.Random | None = None
    ) -> tuple[RoleAddr, ...]:
        missing = [role for role in companions if all(a.role is not role for a in given)]
        recorded = decode_addrs(self._current.get().expected["ra"])
        return given + tuple(a for a in recorded if a.role in missing and a not in given)


class _ReplayRouter(RouterActor):
    # Set for the case it replays (a router is made per case): the recorded deadline cut its hashing.
    hashing_was_cut = False

    async def _keys(self, checked: CheckedRequest, progress: WalkProgress) -> tuple[int, ...]:
        """A prompt whose recorded hashing the deadline cut is hashed until the deadline cuts it again:
        the log holds neither its keys nor how long the rest would have taken (a what-if giving it more
        time cannot know), as a source that had not answered by then never answers."""
        if self.hashing_was_cut and is_sliced(checked, self._limits.hash_slice_tokens):
            await trio.sleep_forever()
        return await super()._keys(checked, progress)

    # Set per case: the recorded answer outside the chain was the checks' refusal.
    refused: BadRequest | None = None

    def shed_check(self, request: RouteRequest) -> int | BadRequest:
        """A recorded shed (or answer with no time left) passed the checks when it was made, and a
        recorded refusal did not; the record keeps no prompt to check again (nor is anything charged:
        replay has no Scorer)."""
        return 0 if self.refused is None else self.refused

    async def route_overloaded(self, request: RouteRequest) -> RouteDecision:
        """Route with every admission token held, as when the recorded request found none."""
        holders = [object() for _ in range(int(self._limiter.total_tokens))]
        for holder in holders:
            self._limiter.acquire_on_behalf_of_nowait(holder)
        try:
            return await self.route(request)
        finally:
            for holder in holders:
                self._limiter.release_on_behalf_of(holder)


# --- the engine ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    case: Case
    replayed: Mapping[str, Any]

    @property
    def compared(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The recorded and the replayed decision's fields as they compare (what ``identical`` and
        :func:`difference` both read)."""
        # A version 1 log recorded no split: its decisions compare without it.
        replayed = {k: v for k, v in self.replayed.items() if k in self.case.expected}
        expected = dict(self.case.expected)
        chain = replayed.get("ch")
        # Written before a source the deadline ended kept its step: the step replay adds for it is not
        # in the record.
        if expected.get("ch") == [] and chain and self.case.ran_out_unseen() and _ended_by_the_deadline(chain[-1]):
            replayed = {**replayed, "ch": chain[:-1]}
        return expected, replayed

    @property
    def identical(self) -> bool:
        expected, replayed = self.compared
        return expected == replayed


def _ended_by_the_deadline(step: Sequence[Any]) -> bool:
    """Whether a logged chain step (source, outcome, reason) is a source the request's deadline ended."""
    return list(step[1:]) == [SourceOutcome.FELL_THROUGH.value, Reason.DEADLINE.value]


def normalized(decision: RouteDecision) -> dict[str, Any]:
    """The decision's compared fields as the log stores them (JSON types)."""
    loaded: dict[str, Any] = json.loads(json.dumps(decision_fields(decision)))
    return loaded


class ReplayEngine:
    def __init__(self, config: KvrouteConfig) -> None:
        self.config = config
        self._metrics = MetricsSink(config.metrics)  # the router emits into it; nothing reads it here

    def replay(self, case: Case) -> Outcome:
        clock = trio.testing.MockClock(autojump_threshold=0)
        decision = trio.run(self._one, case, clock, clock=clock)
        return Outcome(case, normalized(decision))

    def replay_all(self, cases: Iterable[Case]) -> list[Outcome]:
        return [self.replay(case) for case in cases]

    async def _one(self, case: Case, clock: trio.testing.MockClock) -> RouteDecision:
        config = self.config
        clock.jump(max(0.0, case.received_at - trio.current_time()))
        current = _Current(case)
        scoring = _ReplayScoring(config, current)
        domain = _ReplayDomain(config, current)
        chain: list[Source] = []
        if master_hosts(config.master):
            chain.append(_ReplayMaster(config, current, later_sources=config.router.kvcm_fallback))
        if config.router.kvcm_fallback:
            chain.append(_ReplayKvcm(config, current, scoring))
            chain.append(_ReplayShadow(current, scoring, score_unmatched=config.router.score_unmatched))
        chain.append(domain)
        warn = AggregatingLogger(log, interval_s=math.inf, max_keys=16)
        split = case.split_estimates(config.router)
        router = _ReplayRouter(
            config,
            chain=chain,
            domain=domain,
            companions=_ReplayCompanions(current),
            metrics=self._metrics,
            warn=warn,
            split_estimates=lambda: split,
        )
        router.hashing_was_cut = case.hashing_cut is not None
        if case.expected.get("r") == Reason.BAD_REQUEST.value:
            router.refused = BadRequest("request", "refused by its checks when it was recorded")
        request = case.replayed_request()
        if case.overloaded:
            return await router.route_overloaded(request)
        return await router.route(request)


# --- configuration and the what-if ---------------------------------------------------------------------


# What replay takes from the recording rather than from the configuration: the fleet (discovery),
# every remote answer with its time (leader lookups, breakers, probes, the shadow index's match),
# sheds (admission), tie draws (the seed); and what decides nothing (transport, serving, logging).
_RECORDED_SECTIONS = frozenset(
    {"discovery", "leader", "breaker", "master_breaker", "prober", "shadow", "channel_pool", "metrics", "serve"}
    | {"grpc_tls", "upstream_tls"}
)
_RECORDED_SETTINGS = frozenset(
    {"router_max_in_flight", "router_admission_decay", "router_admission_duty_floor", "router_lag_probe_interval_ms"}
    | {"router_lag_probe_idle_ms"}
    | {"decision_log", "decision_log_max_bytes", "decision_log_files", "decision_log_inbox_size", "scorer_seed"}
    | {"master_discovery_interval_s", "master_discovery_timeout_s", "master_discovery_failure_threshold"}
    | {"master_discovery_drop_after_s", "master_http_max_connections", "master_http_keepalive_expiry_s"}
    | {"block_size", "key_family"}  # the keys are replayed as recorded, not hashed again
)


def taken_from_recording(name: str) -> bool:
    """Whether replay takes setting ``name``'s effect from the recording: a what-if on it changes nothing."""
    return name in _RECORDED_SETTINGS or BY_NAME[name].section in _RECORDED_SECTIONS


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    config: KvrouteConfig
    problems: tuple[SettingProblem, ...]
    digest_matches: bool


def replay_config(recorded: RecordedLog | LogReader, overrides: Mapping[str, str]) -> ReplayConfig:
    """The recorded configuration (its non-default settings over this kvroute's defaults), then ``overrides``.

    A problem an override brings is fatal, the fallback's too: served, a bad fallback setting turns
    the fallback off (fail-soft), which in a what-if would report every decision changing to domain
    routing for a typo. A problem the recording itself had stays as it was served."""
    base = resolve_config(None, {}, dict(recorded.settings))
    # Only the overrides were given with --router-setting: a recorded setting's problem must read as
    # in ``base``, or it would count as one the overrides brought.
    given_as = dict.fromkeys(overrides, ROUTER_SETTING_OPTION)
    loaded = resolve_config(None, {}, {**recorded.settings, **overrides}, flags_given_as=given_as)
    brought = tuple(p for p in loaded.errors if p not in base.errors)
    problems = tuple(dict.fromkeys((*loaded.fatal_errors, *brought, *_unrecorded_sources(base, loaded))))
    return ReplayConfig(loaded.effective, problems, config_digest(base.config) == recorded.digest)


def _unrecorded_sources(recorded: LoadedConfig, what_if: LoadedConfig) -> list[SettingProblem]:
    """A what-if that turns on a source the recording never asked: it has no answers of it to replay,
    and a source that never answered in the recording never does in replay, so every request would
    wait it out (a master) or find nothing (KVCM without recorded keys): a made-up result."""
    problems: list[SettingProblem] = []
    if not recorded.effective.master.hosts and what_if.effective.master.hosts:
        problems.append(
            SettingProblem(("master_hosts",), "the log was recorded without a master: it has no master answers", False)
        )
    if not recorded.effective.router.kvcm_fallback and what_if.effective.router.kvcm_fallback:
        problems.append(
            SettingProblem(
                ("kvcm_fallback",), "the log was recorded with the KVCM fallback off: it has no KVCM answers", False
            )
        )
    return problems


@dataclass(slots=True)
class WhatIf:
    """How the decisions change under other settings."""

    total: int = 0
    changed: int = 0
    transitions: dict[tuple[str, str], int] = field(default_factory=dict)  # (route/reason before, after) → n
    workers_changed: int = 0
    hit_delta: int = 0  # predicted cache-hit tokens, after − before
    work_delta: int = 0  # the chosen worker's work tokens, after − before

    def add(self, outcome: Outcome) -> None:
        before, after = outcome.case.expected, outcome.replayed
        self.total += 1
        if outcome.identical:
            return
        self.changed += 1
        key = (f"{before['rs']}/{before['r']}", f"{after['rs']}/{after['r']}")
        self.transitions[key] = self.transitions.get(key, 0) + 1
        self.workers_changed += before["w"] != after["w"]
        self.hit_delta += int(after["hit"]) - int(before["hit"])
        self.work_delta += chosen_work(after) - chosen_work(before)


def chosen_work(fields: Mapping[str, Any]) -> int:
    """The chosen candidate's work tokens (0 when no candidate was scored and chosen)."""
    for row in fields["c"]:
        if row[7] and row[4] is not None:
            return int(row[4])
    return 0


def difference(outcome: Outcome) -> str:
    """What differs, in a few words: ``worker a -> b; reason x -> y``."""
    before, after = outcome.compared  # a field the record does not hold (a version 1 split) is not named
    names = {
        "w": "worker",
        "r": "reason",
        "rs": "source",
        "ra": "role addrs",
        "ch": "chain",
        "c": "candidates",
        "sm": "split",
        "sw": "stage windows",
    }
    parts = []
    for key, name in names.items():
        if before.get(key) != after.get(key):
            if key in ("w", "r", "rs"):
                parts.append(f"{name} {before.get(key)} -> {after.get(key)}")
            else:
                parts.append(f"{name} differ")
    return "; ".join(parts) or "other fields differ"
