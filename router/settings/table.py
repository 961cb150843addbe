"""The settings table: one definition per setting, generated from the dataclasses in ``router/config.py``.

Every field of every section of :class:`~router.config.KvrouteConfig` is one :class:`Setting`: its
default and numeric range are read from the dataclass (never restated here), its type from the
annotation; this module adds only what the dataclass cannot say — the help text, the checks on the
form of a text value, whether the setting belongs to the KVCM fallback, and whether it is required
when that feature is on. The command-line flags (``--block-size``), environment variables
(``KVROUTE_BLOCK_SIZE``), TOML keys (``[deployment] block_size``), ``--help`` and the check-config
report are all generated from the table. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import re
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from router.config import MASTER_GRPC_PORT_OFFSET, MASTER_HTTP_PORT, DeadlineSplit, KvrouteConfig
from router.logs import LOG_FORMATS, LOG_LEVELS
from router.problems import Range, range_of
from router.targets import REDACTED, HostPort, TargetError, parse_target, redact_userinfo
from router.types import QueryType, Role, ScorerPolicy, cut_text

ENV_PREFIX = "KVROUTE_"
CONFIG_ENV = "KVROUTE_CONFIG"  # the TOML file, when --config is not given

_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})
_SECRET_WORDS = frozenset({"secret", "token", "password", "passwd", "credential", "apikey"})

# Sections whose settings carry no section prefix (their field names are already the operator's words).
_UNPREFIXED_SECTIONS = frozenset({"deployment", "serve", "limits"})
# Sections used only by the KVCM fallback; the rest are the main path unless a field says otherwise.
# Not the prober's or the channel pool's: the prober runs with the fallback off too, its health probes
# (over the pool's channels) telling domain routing which workers are reachable.
_FALLBACK_SECTIONS = frozenset({"leader", "breaker", "scorer", "shadow"})


class Kind(enum.Enum):
    """How a setting's text is parsed (derived from the dataclass annotation)."""

    INT = "int"
    FLOAT = "float"
    BOOL = "bool"
    STR = "str"
    ENUM = "enum"
    ENUM_TUPLE = "enum_tuple"


class SourceKind(enum.Enum):
    DEFAULT = "default"
    FILE = "config file"
    ENV = "environment"
    FLAG = "command line"
    CODE = "the embedding code"  # a KvrouteConfig built in code and handed to open_router
    PARENT = "the supervising parent"  # a value `serve --processes` resolved for its child (where: its own origin)


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an effective value came from."""

    kind: SourceKind
    where: str = ""  # the file and key, the env var, or the flag

    def __str__(self) -> str:
        if self.kind is SourceKind.DEFAULT:
            return "default"
        if self.kind is SourceKind.FILE:
            return f"config file {self.where}"
        if self.kind is SourceKind.ENV:
            return f"env {self.where}"
        if self.kind is SourceKind.CODE:
            return "given in code"
        if self.kind is SourceKind.PARENT:
            return f"{self.where}, as the supervising parent resolved it for this process"
        return f"flag {self.where}"


DEFAULT_ORIGIN = Origin(SourceKind.DEFAULT)
# The option the commands that open routers of their own (replay, demo, bench) take a setting with.
ROUTER_SETTING_OPTION = "--router-setting"

Check = Callable[[Any], str | None]


class SettingValueError(ValueError):
    """A value that cannot be parsed for a setting (the message says what was expected)."""


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting: everything the flag, env var, TOML key, help and validation are generated from."""

    name: str  # e.g. "prober_inflight_cap"
    section: str  # KvrouteConfig field, e.g. "prober"
    field: str  # field of the section's dataclass, e.g. "inflight_cap"
    kind: Kind
    default: object  # read from the dataclass
    help: str
    checks: tuple[Check, ...]  # the form of a text value; numeric ranges are ``range``
    range: Range | None  # every INT and FLOAT setting has one (declared with the default)
    choices: Mapping[str, enum.Enum] | None  # word → member, for ENUM and ENUM_TUPLE
    required_when: str | None  # name of the bool setting that makes this one required
    # With required_when: the settings (names, this one among them) of which any one is enough.
    required_one_of: tuple[str, ...]
    fallback_part: bool  # only the KVCM fallback uses it (invalid → fallback off, not a crash)
    secret: bool
    metavar: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def toml_key(self) -> str:
        return f"{self.section}.{self.field}"

    @property
    def where(self) -> str:
        """How an operator names this setting in a message."""
        return f"{self.flag} ({self.env})"

    def parse_text(self, text: str) -> object:
        """Parse a flag or environment value; raises SettingValueError saying what was expected."""
        raw = text.strip()
        if self.kind is Kind.INT:
            try:
                return int(raw, 10)
            except ValueError:
                digits = _INTEGER.fullmatch(raw)
                if digits is not None:  # an integer int() refused: beyond the interpreter's digit limit
                    raise SettingValueError(
                        f"got an integer of {len(digits[1])} digits, beyond any allowed value"
                    ) from None
                raise SettingValueError(f"expected an integer, got {_quoted(text)}") from None
        if self.kind is Kind.FLOAT:
            try:
                return float(raw)
            except ValueError:
                raise SettingValueError(f"expected a number, got {_quoted(text)}") from None
        if self.kind is Kind.BOOL:
            word = raw.lower()
            if word in _TRUE_WORDS:
                return True
            if word in _FALSE_WORDS:
                return False
            raise SettingValueError(f"expected true/false/1/0/yes/no/on/off, got {_quoted(text)}")
        if self.kind is Kind.STR:
            return raw
        if self.kind is Kind.ENUM:
            return self._member(raw)
        members: dict[enum.Enum, None] = {}
        for part in raw.split(","):
            if part.strip():
                members.setdefault(self._member(part.strip()))
        return tuple(members)

    def parse_value(self, value: object) -> object:
        """Parse a TOML (or programmatic) value: text goes through parse_text, natives are type-checked."""
        if isinstance(value, str):
            return self.parse_text(value)
        if self.kind is Kind.BOOL and isinstance(value, bool):
            return value
        if self.kind is Kind.INT and isinstance(value, int) and not isinstance(value, bool):
            return value
        if self.kind is Kind.FLOAT and isinstance(value, int | float) and not isinstance(value, bool):
            if isinstance(value, int) and abs(value) > sys.float_info.max:
                # Named by its size: float() would overflow, and its digits may be thousands.
                raise SettingValueError(
                    f"expected {self._expected()}, got an integer of {value.bit_length()} bits, beyond any float"
                )
            return float(value)
        if self.kind is Kind.ENUM:
            return self._known(value)
        if self.kind is Kind.ENUM_TUPLE and isinstance(value, list | tuple):
            members: dict[object, None] = {}
            for item in value:
                members.setdefault(self._member(item.strip()) if isinstance(item, str) else self._known(item))
            return tuple(members)
        raise SettingValueError(f"expected {self._expected()}, got {self._quoted(value)}")

    def format(self, value: object) -> str:
        """The text that parse_text turns back into ``value``."""
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, enum.Enum):
            return self._word(value)
        if isinstance(value, tuple):
            return ",".join(self.format(v) for v in value)
        return str(value)

    def jsonable(self, value: object) -> object:
        if isinstance(value, enum.Enum):
            return self._word(value)
        if isinstance(value, tuple):
            return [self.jsonable(v) for v in value]
        return value

    def shown(self, value: object) -> object:
        """``value`` as it may be shown (JSON-ready): a set secret masked, the userinfo of addresses removed."""
        if self.secret and value:
            return REDACTED
        plain = self.jsonable(value)
        return redact_userinfo(plain) if isinstance(plain, str) else plain

    def shown_text(self, value: object) -> str:
        """``value`` as text (what the flag would take), redacted like :meth:`shown`."""
        if self.secret and value:
            return REDACTED
        return redact_userinfo(self.format(value))

    def type_problem(self, value: object) -> str | None:
        """Pure: why ``value``, as a configuration built in code holds it, is not of this setting's type
        (None when it is). Nothing is parsed: text is no number, a bool is none either, a float no
        integer; a number type of another library (numpy's) is one, and a list of members is as good
        as a tuple."""
        members = (self.choices or {}).values()
        match self.kind:
            case Kind.STR:
                typed = isinstance(value, str)
            case Kind.BOOL:
                typed = isinstance(value, bool)
            case Kind.INT:
                typed = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            case Kind.FLOAT:
                typed = isinstance(value, numbers.Real) and not isinstance(value, bool)
            case Kind.ENUM:
                typed = any(value is m for m in members)
            case Kind.ENUM_TUPLE:
                typed = isinstance(value, tuple | list) and all(any(v is m for m in members) for v in value)
        return None if typed else f"expected {self._expected()}, got {self._quoted(value)}"

    def validate(self, value: object) -> list[str]:
        """Pure: the problems with the form of ``value`` (empty when valid); ranges are checked per section."""
        problems = []
        for check in self.checks:
            problem = check(value)
            if problem is not None:
                problems.append(problem)
        return problems

    def help_text(self) -> str:
        parts = [self.help.rstrip(".") + "."]
        if self.choices is not None:
            parts.append(
                f"One of: {' | '.join(self.choices)}"
                + (" (comma list)." if self.kind is Kind.ENUM_TUPLE else ".")
            )
        if self.range is not None:
            parts.append(f"Range: {self.range}.")
        if self.required_when is not None:
            when = f"required when --{self.required_when.replace('_', '-')} is on"
            if self.required_one_of:
                flags = ", ".join("--" + name.replace("_", "-") for name in self.required_one_of)
                parts.append(f"[one of {flags} {when}]")
            else:
                parts.append(f"[{when}]")
        if self.fallback_part:
            parts.append("[KVCM fallback]")
        default = self.format(self.default)
        parts.append(f"Default: {default if default else '(empty)'}; env {self.env}; TOML {self.toml_key}.")
        return " ".join(parts)

    def _word(self, member: enum.Enum) -> str:
        if self.choices is not None:
            for word, candidate in self.choices.items():
                if candidate is member:
                    return word
        return str(member.value)

    def _member(self, word: str) -> enum.Enum:
        if self.choices is not None:
            for choice, member in self.choices.items():
                if choice.lower() == word.lower():
                    return member
        raise SettingValueError(f"expected {self._expected()}, got {_quoted(word)}")

    def _known(self, value: object) -> enum.Enum:
        for member in (self.choices or {}).values():
            if member is value:
                return member
        raise SettingValueError(f"expected {self._expected()}, got {self._quoted(value)}")

    def _quoted(self, value: object) -> str:
        """A refused value as an error may repeat it: a secret's only by its type (a token given as a
        number is still the token)."""
        if self.secret:
            return f"a value of type {type(value).__name__}"
        return cut_text(redact_userinfo(repr(value)), _QUOTED_CHARS)  # redacted before a cut drops the '@'

    def _expected(self) -> str:
        if self.choices is not None:
            return "|".join(self.choices) + (" (comma list)" if self.kind is Kind.ENUM_TUPLE else "")
        return {
            Kind.INT: "an integer",
            Kind.FLOAT: "a number",
            Kind.BOOL: "true/false",
            Kind.STR: "a string",
        }[self.kind]




# ---------------------------------------------------------------------------------------------
# Checks: pure, value in, problem text (or None) out.


def _one_of(words: tuple[str, ...], *, ignore_case: bool = False) -> Check:
    def check(value: str) -> str | None:
        # lower() on both sides, as setup_logging normalises (casefold() would accept what it refuses).
        ok = value.lower() in {w.lower() for w in words} if ignore_case else value in words
        return None if ok else f"must be one of {'|'.join(words)}, got {_quoted(value)}"

    return check


def _non_empty(value: tuple[object, ...] | str) -> str | None:
    return None if value else "must not be empty"


def _header_token(value: str) -> str | None:
    # The value itself is never repeated: it is a secret.
    if all("!" <= c <= "~" for c in value):
        return None
    return "must be printable ASCII without spaces (it is sent in an HTTP header)"


def parse_listen(text: str) -> HostPort:
    """``HOST:PORT`` to listen on; port 0 asks the OS for a free port. Raises TargetError naming the input."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise TargetError(f"listen address {_quoted(text)} must be HOST:PORT (port 0 = any free port)")
    if port == "0":
        stand_in = f"{host}:1"  # the host checked as a target's, with a port a target may have
        try:
            return HostPort(parse_target(stand_in).host, 0)
        except TargetError as exc:  # named as given, not as the stand-in
            raise TargetError(str(exc).replace(repr(stand_in), repr(text))) from None
    return parse_target(text)


# Settings naming a file: a NUL character (which TOML and env values can hold) is no path, and
# open() raises ValueError, not OSError, on it.
_PATH_METAVARS = frozenset({"FILE", "PATH"})


def _path(value: str) -> str | None:
    return "a path cannot hold a NUL character" if "\0" in value else None


def _listen(value: str) -> str | None:
    try:
        parse_listen(value)
    except TargetError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------------------------
# What the dataclasses cannot say, per field ("section.field"). Defaults are NOT here.


@dataclass(frozen=True, slots=True)
class _Spec:
    help: str
    checks: tuple[Check, ...] = ()  # the form of text values; numeric ranges live with the defaults
    short: bool = False  # the setting's name is the field's name, without the section prefix
    fallback: bool | None = None  # None: decided by the section
    required_when: str | None = None
    required_one_of: tuple[str, ...] = ()
    choices: Mapping[str, enum.Enum] | None = None
    metavar: str | None = None
    secret: bool = False  # shown as <redacted> (fields named like a secret are, whatever this says)


_TARGETS = "HOST:PORT[,...]"

# The KVCM bootstrap sources: with the fallback on, any one of them is enough.
_BOOTSTRAP = ("kvcm_bootstrap", "kvcm_bootstrap_file", "kvcm_bootstrap_dns")

_SPECS: dict[str, _Spec] = {
    # deployment
    "deployment.roles": _Spec(
        "Roles every answer needs: prefill-capable ones (PREFILL, PDFUSION) are alternatives for the "
        "cache-aware pick; DECODE and VIT each get one more address (prefill/decode separation: PREFILL,DECODE)",
        (_non_empty,),
        choices={"PREFILL": Role.PREFILL, "PDFUSION": Role.PDFUSION, "DECODE": Role.DECODE, "VIT": Role.VIT},
        fallback=False,
        metavar="PREFILL[,PDFUSION][,DECODE][,VIT]",
    ),
    "deployment.block_size": _Spec(
        "Tokens per KV block (keys are computed with it; workers reporting another are excluded)"
    ),
    "deployment.lookahead_tokens": _Spec("Lookahead tokens of the engine's block keys"),
    "deployment.key_family": _Spec(
        "Block-key family used to hash token ids (caller-supplied keys are used as given)"
    ),
    "deployment.query_type": _Spec(
        "KVCM GetHostCacheState query type",
        choices={"prefix": QueryType.PREFIX_MATCH, "prefix-with-mamba": QueryType.PREFIX_MATCH_WITH_MAMBA},
    ),
    "deployment.kvcm_instance_id": _Spec(
        "KVCM instance id (the namespace, conventionally <deployment>_<block_size>)",
        required_when="kvcm_fallback",
        metavar="ID",
    ),
    "deployment.p2p_host_count": _Spec(
        "KVCM p2p_host_count asked per query (0 = local matches only)"
    ),
    # router
    "router.kvcm_fallback": _Spec(
        "Route by KVCM cache affinity (off: plain domain routing)", short=True, fallback=False
    ),
    "router.max_in_flight": _Spec(
        "Requests routed at once; beyond it route() answers at once with domain fallback (overloaded)"
    ),
    "router.budget_cap_ms": _Spec(
        "Cap on one request's routing deadline: deadline = now + min(budget, cap)",
        short=True,
        metavar="MS",
    ),
    "router.reserve_fraction": _Spec(
        "Share of the deadline kept to decide with what is in hand",
        fallback=True,
    ),
    "router.reserve_min_ms": _Spec("Least time kept to decide, in ms", fallback=True, metavar="MS"),
    "router.admission_decay": _Spec(
        "Weight the admission estimate (own time and loop lag per request, averaged) keeps per sample; "
        "a request whose remaining budget is below the estimate is answered at once (overloaded)"
    ),
    "router.admission_duty_floor": _Spec(
        "kvroute serve: the least share of the time one call may spend in the router once late answers "
        "have shrunk admission below one call at a time (each on-time answer then regrows it by a tenth); "
        "lower sheds more of a storm it cannot serve in time and recovers more slowly",
        metavar="SHARE",
    ),
    "router.lag_probe_interval_ms": _Spec("How often the routing loop's lag is measured", metavar="MS"),
    "router.lag_probe_idle_ms": _Spec(
        "Once no request has come for this long (none in flight), the loop's lag is measured this often "
        "instead, until the next request; 0, or not above --router-lag-probe-interval-ms: never slower",
        metavar="MS",
    ),
    "router.kvcm_query_timeout_ms": _Spec(
        "Cap on one GetHostCacheState call, in ms", fallback=True, metavar="MS"
    ),
    "router.deadline_split": _Spec(
        "How a cache source's waits share the budget: fixed (all end at deadline − reserve) or learned "
        "(each leaves the later stages their estimated latency; fixed until estimates exist)",
        choices={"fixed": DeadlineSplit.FIXED, "learned": DeadlineSplit.LEARNED},
        short=True,
        fallback=True,
    ),
    "router.split_estimate_weight": _Spec(
        "Learned split: weight of each new latency sample in a stage's estimate", short=True, fallback=True
    ),
    "router.split_deviations": _Spec(
        "Learned split: a stage's estimate is its mean plus this many mean absolute deviations",
        short=True,
        fallback=True,
    ),
    "router.split_min_samples": _Spec(
        "Learned split: samples each stage needs before the split uses its estimate", short=True, fallback=True
    ),
    # request bounds, the reply margin, what a kept decision holds
    "limits.max_prompt_tokens": _Spec(
        "Most token ids one request may carry; seq_len may not exceed it either (beyond: INVALID_ARGUMENT)"
    ),
    "limits.max_block_keys": _Spec("Most block_cache_keys one request may carry (beyond: INVALID_ARGUMENT)"),
    "limits.max_roles": _Spec("Most roles one request may name (beyond: INVALID_ARGUMENT)"),
    "limits.max_request_id_bytes": _Spec(
        "Longest request_id in UTF-8 bytes (beyond: INVALID_ARGUMENT)", metavar="BYTES"
    ),
    "limits.hash_slice_tokens": _Spec(
        "A longer prompt is hashed in slices of this many tokens, other requests running in between and "
        "the request's deadline checked after each; a shorter one is hashed at once"
    ),
    "router.reply_margin_ms": _Spec(
        "Time kept before a caller's own deadline (gRPC deadline, absolute deadline) to send the answer: "
        "the router decides this much earlier",
        short=True,
        metavar="MS",
    ),
    "metrics.decision_text_chars": _Spec(
        "A kept decision's request_id and error are cut to this many characters (marked as cut)"
    ),
    "metrics.accuracy_pending_max": _Spec("Predicted hits kept until a worker's status reports the request"),
    "metrics.accuracy_ttl_s": _Spec(
        "A predicted hit no status reported within this long is forgotten", metavar="SECONDS"
    ),
    "metrics.accuracy_inbox_size": _Spec("Predictions and statuses waiting for the accuracy actor; beyond: dropped"),
    "metrics.accuracy_warn_silent_share": _Spec(
        "/readyz warns while more than this share of recent routed requests found no cached prefix where a "
        "hit was predicted (0 = off)"
    ),
    "metrics.decision_max_candidates": _Spec("Candidates kept per decision for /debug/decisions"),
    "metrics.decisions_body_max_bytes": _Spec(
        "/debug/decisions adds no more decisions beyond this many bytes of JSON (and says so)",
        metavar="BYTES",
    ),
    "router.decision_log": _Spec(
        "Append every decision's inputs to this file (framed, rotated; read by kvroute replay); empty = off",
        short=True,
        metavar="PATH",
    ),
    "router.decision_log_max_bytes": _Spec(
        "Size at which the decision log rotates (PATH -> PATH.1 -> ...)", short=True, metavar="BYTES"
    ),
    "router.decision_log_files": _Spec(
        "Decision log files kept, the current one included (disk use <= files x max bytes)", short=True
    ),
    "router.decision_log_inbox_size": _Spec(
        "Decisions waiting to be written; beyond it they are dropped and counted", short=True
    ),
    # discovery
    "discovery.kvcm_bootstrap": _Spec(
        "KVCM bootstrap targets, a bare host takes --kvcm-port; one bootstrap source is needed",
        short=True,
        fallback=True,
        required_when="kvcm_fallback",
        required_one_of=_BOOTSTRAP,
        metavar=_TARGETS,
    ),
    "discovery.kvcm_bootstrap_file": _Spec(
        "File of KVCM bootstrap targets (one per line or comma-separated), re-read when it changes; "
        "replace it atomically, as --workers-file",
        short=True,
        fallback=True,
        required_when="kvcm_fallback",
        required_one_of=_BOOTSTRAP,
        metavar="FILE",
    ),
    "discovery.kvcm_bootstrap_dns": _Spec(
        "DNS name (HOST[:PORT]) whose A/AAAA records are the KVCM bootstrap targets",
        short=True,
        fallback=True,
        required_when="kvcm_fallback",
        required_one_of=_BOOTSTRAP,
        metavar="HOST[:PORT]",
    ),
    "discovery.kvcm_port": _Spec(
        "Port for bootstrap entries given without one",
        short=True,
        fallback=True,
        metavar="PORT",
    ),
    "discovery.workers": _Spec(
        "Static worker list, ip:http_port entries", short=True, metavar="IP:HTTP_PORT[,...]"
    ),
    "discovery.workers_file": _Spec(
        "File of worker entries (ip:http_port), re-read when it changes; replace it atomically (write a "
        "temporary file, rename it over this one): one caught mid-write is applied as it is",
        short=True,
        metavar="FILE",
    ),
    "discovery.workers_dns": _Spec(
        "DNS name (HOST[:PORT]) whose A/AAAA records are the workers", short=True, metavar="HOST[:PORT]"
    ),
    "discovery.worker_http_port": _Spec(
        "HTTP port for worker entries and DNS answers without one (0 = entries must give a port)",
        short=True,
        metavar="PORT",
    ),
    "discovery.worker_grpc_port_offset": _Spec(
        "A worker's gRPC port = its HTTP port + this", short=True, metavar="N"
    ),
    "discovery.worker_status_port": _Spec(
        "Port of GetWorkerStatus (0 = the worker's gRPC port)",
        short=True,
        metavar="PORT",
    ),
    "discovery.refresh_interval_s": _Spec(
        "Each discovery source (file, DNS) is re-read this often", metavar="SECONDS"
    ),
    "discovery.stale_after_s": _Spec(
        "A failed or empty source keeps its last good entries this long", metavar="SECONDS"
    ),
    "discovery.refresh_timeout_s": _Spec(
        "Bound on one source refresh (a DNS lookup, a file read)", metavar="SECONDS"
    ),
    "discovery.max_entries": _Spec(
        "Most entries one source may list (a longer answer is a failed refresh)"
    ),
    # leader
    "leader.refresh_interval_s": _Spec(
        "The KVCM leader is re-resolved in the background this often", metavar="SECONDS"
    ),
    "leader.max_staleness_s": _Spec(
        "A known leader is kept this long after refreshes start failing", metavar="SECONDS"
    ),
    "leader.lookup_timeout_s": _Spec(
        "Bound on one round of concurrent GetClusterInfo calls", metavar="SECONDS"
    ),
    "leader.backoff_initial_s": _Spec(
        "First wait after a failed leader lookup (doubles per failure)", metavar="SECONDS"
    ),
    "leader.backoff_max_s": _Spec("Longest wait between failed leader lookups", metavar="SECONDS"),
    "leader.backoff_jitter_s": _Spec("Random extra wait added to each backoff", metavar="SECONDS"),
    "leader.no_leader_retry_s": _Spec(
        "Retry delay when KVCM says no leader is elected yet, or no KVCM target is known", metavar="SECONDS"
    ),
    "leader.invalidated_suspect_s": _Spec(
        "How long a leader a query found wrong stays suspect: a lookup takes it only when no other KVCM "
        "replica names another leader, or when it names itself",
        metavar="SECONDS",
    ),
    # breaker
    "breaker.failure_threshold": _Spec("Consecutive KVCM failures that open the breaker"),
    "breaker.window_s": _Spec("Sliding window for the failure-rate trigger", metavar="SECONDS"),
    "breaker.window_min_calls": _Spec("Calls needed in the window before the failure rate counts"),
    "breaker.failure_rate": _Spec(
        "Failure rate over the window that opens the breaker"
    ),
    "breaker.window_buckets": _Spec("Buckets the window is counted in"),
    "breaker.cooldown_s": _Spec("First OPEN period (doubles per re-open)", metavar="SECONDS"),
    "breaker.cooldown_max_s": _Spec("Longest OPEN period", metavar="SECONDS"),
    "breaker.trial_timeout_s": _Spec(
        "A half-open trial not reported back by then counts as failed", metavar="SECONDS"
    ),
    "breaker.overlapping_failures_count_once": _Spec(
        "Count failures of KVCM calls that were in flight together (one stall) as one towards the "
        "consecutive threshold; the window's failure rate still counts each"
    ),
    "breaker.slow_query_ms": _Spec(
        "A query cut off by its request's deadline counts as a KVCM failure only if it had this long",
        metavar="MS",
    ),
    # prober
    "prober.inflight_cap": _Spec("Most worker-status probes in flight in the process"),
    "prober.rate_per_s": _Spec("Probe rate budget (token bucket refill per second)"),
    "prober.rate_burst": _Spec("Probe token bucket size"),
    "prober.fresh_ttl_s": _Spec(
        "A worker status younger than this is used without a probe", metavar="SECONDS"
    ),
    "prober.max_status_age_s": _Spec(
        "A worker whose last good status is older is treated as unknown", metavar="SECONDS"
    ),
    "prober.probe_timeout_s": _Spec("Cap on one GetWorkerStatus call", metavar="SECONDS"),
    "prober.eject_after_failures": _Spec("Consecutive probe failures that eject a worker"),
    "prober.eject_base_s": _Spec("Ejection time per ejection count (base x n)", metavar="SECONDS"),
    "prober.eject_max_s": _Spec("Longest ejection", metavar="SECONDS"),
    "prober.max_tracked_workers": _Spec("Bound on per-worker prober state"),
    "prober.engine_generation": _Spec("Worker-status decoder generation (engine version family)"),
    # readiness and routability: what is known about workers, and what is done when none can be reached
    "prober.max_ejected_fraction": _Spec(
        "Most of the known workers ejected at once (at least one when two or more are known; 0 = never); "
        "more workers failing than that is a collective failure: nobody is ejected, and each is "
        "readmitted on its first good probe"
    ),
    "prober.health_interval_s": _Spec(
        "Background health probes of discovered workers run this often, so a dead worker is known "
        "without probing on the request path (0 = off)",
        metavar="SECONDS",
    ),
    "prober.health_max_probes": _Spec(
        "Most background health probes started at once; each interval's pass over the fleet goes on "
        "(round robin) as they land, until every worker not heard from for an interval is probed",
    ),
    "prober.background_refresh": _Spec(
        "Keep the statuses of recently wanted workers fresh by polling them in the background, so a "
        "request makes no probe of its own (only while refresh-interval is below fresh-ttl)",
    ),
    "prober.refresh_interval_s": _Spec(
        "Background refresh: how often each hot worker's status is polled", metavar="SECONDS"
    ),
    "prober.hot_window_s": _Spec(
        "Background refresh: a worker is hot (polled) while a request named it as a candidate this recently",
        metavar="SECONDS",
    ),
    "prober.refresh_budget_share": _Spec(
        "Background refresh: most of the probe rate budget it may use; it takes only tokens beyond the "
        "rest, which stays for requests' own probes",
    ),
    "prober.refresh_idle_gaps": _Spec(
        "Background refresh: a hot worker is polled only while a request read its status within this many "
        "of its usual gaps between reads (at least two refresh intervals, at most hot-window), so polls "
        "stop soon after a worker's reads stop",
    ),
    "prober.serial_refresh": _Spec(
        "Background refresh: make a round's polls one after another on one worker thread (blocking gRPC "
        "calls, each bounded by what is left of probe-timeout for the round) instead of a task and an "
        "asynchronous call each; on-demand probes are unchanged",
    ),
    "router.score_unmatched": _Spec(
        "A prompt nobody holds (KVCM answered no match, the shadow index has none) goes to the least "
        "loaded of the cold set, scored, instead of the domain's random draw",
        short=True,
        fallback=True,
    ),
    "router.route_blind": _Spec(
        "Route to workers known to be unreachable (ejected, or refusing probes) instead of answering "
        "no_candidates, and stay ready when none is reachable; a worker reporting another role than the "
        "request's is still taken only when none may serve it",
        short=True,
        fallback=False,
    ),
    # scorer
    "scorer.policy": _Spec(
        "Selection policy: cache-affinity (the reference scheduler's policy, exactly) or cost-aware (prices "
        "a prefix copy's eviction and a request's fixed cost, looks wider for idle workers; can spread "
        "near-ties)",
        choices={p.value: p for p in ScorerPolicy},
        metavar="cache-affinity|cost-aware",
    ),
    "scorer.prefill_queue_size_threshold": _Spec(
        "Workers with this many waiting tasks or more are dropped"
    ),
    "scorer.p2p_hit_discount": _Spec("Weight of p2p-only blocks in the effective hit"),
    "scorer.max_extra_work_tokens": _Spec(
        "Extra work (tokens) the cache leader may have over the shortest"
    ),
    "scorer.min_hit_rate": _Spec(
        "Leader hit below this percent of the prompt turns affinity off (0 = no gate)"
    ),
    "scorer.outstanding_uncached_tokens_threshold": _Spec(
        "Outstanding-work guard in tokens (0 = off)"
    ),
    "scorer.hot_set_size": _Spec("Candidates taken from KVCM's answer (top by effective blocks)"),
    "scorer.cold_set_size": _Spec("Extra candidates taken from discovery per request"),
    "scorer.seed": _Spec("Seed of the RNG that breaks exact ties"),
    "scorer.max_tracked_workers": _Spec("Bound on the selection ledger (last-selected, pre-charge)"),
    "scorer.max_pending_charges": _Spec(
        "Pre-charges kept per worker (older ones are merged)"
    ),
    "scorer.copy_cost_weight": _Spec(
        "cost-aware: price of each token of a prefix another candidate holds and this one would copy, in "
        "tokens of future prefill (the eviction the copy causes; 0 = the copy's prefill now only)"
    ),
    "scorer.request_cost_tokens": _Spec(
        "cost-aware: a request's fixed cost in tokens, counted for this request and each one queued ahead"
    ),
    "scorer.near_tie_tokens": _Spec(
        "cost-aware: candidates within this many tokens of the chosen one's cost, holding its hit, are "
        "near-ties; the power of two "
        "choices among them spreads independent routers (0 = off)"
    ),
    "scorer.cost_aware_cold_set_size": _Spec(
        "cost-aware: extra candidates taken from discovery per request, in place of --scorer-cold-set-size"
    ),
    # shadow
    "shadow.ttl_s": _Spec("Shadow index entries live this long", metavar="SECONDS"),
    "shadow.capacity_blocks": _Spec("Shadow index capacity in blocks (LRU)"),
    "shadow.inbox_size": _Spec("ShadowIndex inbox; records beyond it are dropped and counted"),
    # channel pool
    "channel_pool.max_channels": _Spec("Most gRPC channels kept open (LRU)"),
    "channel_pool.idle_expiry_s": _Spec("An idle gRPC channel is closed after this", metavar="SECONDS"),
    "channel_pool.keepalive_time_ms": _Spec("gRPC keepalive ping interval", metavar="MS"),
    "channel_pool.keepalive_timeout_ms": _Spec("gRPC keepalive ping timeout", metavar="MS"),
    "channel_pool.max_message_bytes": _Spec("gRPC max message size"),
    "channel_pool.inbox_size": _Spec(
        "ChannelPool inbox: lease reports and returns (two per lease in flight); beyond it leases wait and "
        "invalidations are dropped and counted"
    ),
    "channel_pool.start_off_loop": _Spec(
        "Start a gRPC call on an idle channel from a starter thread, not the event loop (grpcio starts a "
        "thread for it, which blocks the starter for up to milliseconds); off: the loop starts every call"
    ),
    # metrics
    "metrics.inbox_size": _Spec("MetricsSink inbox; events beyond it are dropped and counted"),
    "metrics.decision_ring_size": _Spec("Decisions kept for /debug/decisions"),
    "metrics.shadow_agreement_window": _Spec(
        "Shadow-vs-KVCM comparisons averaged into the agreement ratio"
    ),
    "metrics.shadow_compare_every": _Spec(
        "Compare one KVCM answer in N with the shadow index (the first one is; 1: every answer)", metavar="N"
    ),
    # serve
    "serve.grpc_listen": _Spec(
        "kvroute serve: HOST:PORT of the Route gRPC service (port 0 = any free port)",
        (_listen,),
        metavar="HOST:PORT",
    ),
    "serve.debug_listen": _Spec(
        "HOST:PORT of the debug HTTP endpoint (port 0 = any free port, logged)",
        (_listen,),
        metavar="HOST:PORT",
    ),
    "serve.log_level": _Spec(
        "Log level", (_one_of(LOG_LEVELS, ignore_case=True),), metavar="|".join(LOG_LEVELS)
    ),
    "serve.log_format": _Spec(
        "Log line format", (_one_of(LOG_FORMATS, ignore_case=True),), metavar="|".join(LOG_FORMATS)
    ),
    "serve.log_aggregate_interval_s": _Spec(
        "Hot-path warnings are aggregated and logged at most once per this", metavar="SECONDS"
    ),
    "serve.log_max_keys": _Spec(
        "Bound on distinct keys the aggregating and once-per-key loggers remember"
    ),
    "serve.drain_timeout_s": _Spec(
        "On SIGTERM/SIGINT, in-flight requests get this long to finish", metavar="SECONDS"
    ),
    "serve.drain_lame_duck_s": _Spec(
        "First part of the drain: health says NOT_SERVING and new Route calls are refused (UNAVAILABLE, "
        "not routed) while the server still runs, so no call is cut off when it stops (capped by "
        "--drain-timeout-s)",
        metavar="SECONDS",
    ),
    "serve.grpc_max_workers": _Spec(
        "kvroute serve: Route handler threads, the most Route calls handled at once (more wait for a "
        "thread, up to --grpc-max-concurrent-rpcs)",
    ),
    "serve.grpc_max_concurrent_rpcs": _Spec(
        "kvroute serve: the most Route calls gRPC holds at once, handled or waiting for a handler thread "
        "(beyond it a call is refused at once with RESOURCE_EXHAUSTED); at least --grpc-max-workers. A "
        "waiting call holds no thread, and when it reaches one with too little time left it is answered "
        "overloaded at once",
    ),
    "serve.slot_waiters": _Spec(
        "kvroute serve: Route calls that may wait on their handler threads for a place in the router when "
        "its learnt in-flight limit is reached, each at most a quarter of its time left and while the rest "
        "covers the admission estimate (then it is answered overloaded); 0 (the default) = answered overloaded "
        "at once",
    ),
    "serve.crowded_wait_share": _Spec(
        "kvroute serve: a Route call handed to the router after waiting for a handler thread more than "
        "this share of its client's deadline counts as answered late, shrinking the learnt in-flight "
        "limit: the process is short of CPU, and routed calls cost the most of it (higher: more calls "
        "routed under overload, with less margin for the calls queued behind them)",
        metavar="SHARE",
    ),
    "serve.processes": _Spec(
        "kvroute serve: independent router processes sharing the Route gRPC port (SO_REUSEPORT), "
        "supervised by the parent (restarted when one dies, drained together); process i serves debug "
        "HTTP on the debug port + i (each its own free port when the debug port is 0)",
    ),
    # master (the central scheduler, asked first when hosts are given)
    "master.hosts": _Spec(
        f"Central scheduler replicas' HTTP addresses (a bare host: port {MASTER_HTTP_PORT}); empty: no master, "
        "the chain starts at KVCM",
        metavar="HOST[:PORT][,...]",
    ),
    "master.protocol": _Spec(
        "The scheduler API: http (JSON, POST /rtp_llm/schedule) or grpc (HTTP port + "
        f"{MASTER_GRPC_PORT_OFFSET})"
    ),
    "master.transport_timeout_ms": _Spec(
        "Longest window of one request's master attempt (master, then the slave once, inside it)", metavar="MS"
    ),
    "master.later_sources_ms": _Spec(
        "Time of the request's budget kept for the sources after the master (KVCM, shadow)", metavar="MS"
    ),
    "master.slave_window_share": _Spec(
        "Share of the attempt window the master's call leaves for the slave (when one is known); 0 = none"
    ),
    "master.discovery_interval_s": _Spec("How often every scheduler host's master/info is polled", metavar="SECONDS"),
    "master.discovery_timeout_s": _Spec("Bound on one master/info poll of one host", metavar="SECONDS"),
    "master.discovery_failure_threshold": _Spec("Consecutive failed polls that mark a scheduler host unhealthy"),
    "master.discovery_drop_after_s": _Spec(
        "An unhealthy scheduler host is forgotten this long after its last success", metavar="SECONDS"
    ),
    "master.queue_length_reject_threshold": _Spec(
        "Reject requests up front (error 429) while the master's queue_length exceeds this; 0 = off"
    ),
    "master.http_max_connections": _Spec(
        "Connections the scheduler HTTP client keeps for reuse (all hosts together), at least "
        "--router-max-in-flight plus the hosts; calls at once are never made to wait for a connection"
    ),
    "master.http_keepalive_expiry_s": _Spec("Idle time after which a pooled scheduler connection is closed"),
    "master_breaker.failure_threshold": _Spec("Consecutive master transport failures that open its breaker"),
    "master_breaker.window_s": _Spec("Sliding window for the master breaker's failure rate", metavar="SECONDS"),
    "master_breaker.window_min_calls": _Spec("Calls needed in the window before the master failure rate counts"),
    "master_breaker.failure_rate": _Spec("Master transport failure rate in the window that opens its breaker"),
    "master_breaker.window_buckets": _Spec("Buckets the master breaker's window is counted in"),
    "master_breaker.cooldown_s": _Spec("First OPEN period of the master breaker (doubles per re-open)"),
    "master_breaker.cooldown_max_s": _Spec("Longest OPEN period of the master breaker"),
    "master_breaker.trial_timeout_s": _Spec("A master half-open trial never reported back counts as failed after this"),
    "master_breaker.overlapping_failures_count_once": _Spec(
        "Count failures of master calls that were in flight together as one towards the consecutive "
        "threshold (off: every failure counts, so a hung master is skipped sooner)"
    ),
    "master_breaker.slow_query_ms": _Spec(
        "A master attempt the request's own deadline cut off before it had this long is not judged", metavar="MS"
    ),
    # security: the debug endpoint's token, the sidecar's TLS, the clients' TLS
    "serve.debug_token": _Spec(
        "Bearer token every debug path except /healthz requires (Authorization: Bearer TOKEN; empty = none); "
        "prefer --debug-token-file or the environment: a flag is visible to other local users",
        (_header_token,),
        metavar="TOKEN",
        secret=True,
    ),
    "serve.debug_token_file": _Spec(
        "File holding the debug bearer token (surrounding whitespace ignored); instead of --debug-token",
        metavar="FILE",
        secret=True,
    ),
    "grpc_tls.cert": _Spec(
        "kvroute serve: PEM certificate chain of the Route gRPC server; set (with --grpc-tls-key) = TLS, "
        "empty = plaintext",
        metavar="FILE",
    ),
    "grpc_tls.key": _Spec("kvroute serve: PEM private key of --grpc-tls-cert", metavar="FILE", secret=True),
    "grpc_tls.client_ca": _Spec(
        "kvroute serve: PEM CA bundle; set = clients must present a certificate it signed (mTLS)",
        metavar="FILE",
    ),
    "upstream_tls.ca": _Spec(
        "PEM CA bundle that KVCM's, the workers' and the master's certificates are checked against; "
        "set (or --upstream-tls-cert set) = kvroute's own connections use TLS, empty = plaintext",
        metavar="FILE",
    ),
    "upstream_tls.cert": _Spec(
        "PEM client certificate chain kvroute presents to KVCM, workers and the master (mTLS); "
        "without --upstream-tls-ca the system's CA bundle (OpenSSL's default file, or $SSL_CERT_FILE) checks the "
        "servers, for gRPC and HTTPS alike ($SSL_CERT_DIR: HTTPS only)",
        metavar="FILE",
    ),
    "upstream_tls.key": _Spec("PEM private key of --upstream-tls-cert", metavar="FILE", secret=True),
}


def _kind_of(annotation: object, where: str) -> tuple[Kind, type[enum.Enum] | None]:
    if annotation is bool:
        return Kind.BOOL, None
    if annotation is int:
        return Kind.INT, None
    if annotation is float:
        return Kind.FLOAT, None
    if annotation is str:
        return Kind.STR, None
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return Kind.ENUM, annotation
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if (
            len(args) == 2
            and args[1] is Ellipsis
            and isinstance(args[0], type)
            and issubclass(args[0], enum.Enum)
        ):
            return Kind.ENUM_TUPLE, args[0]
    raise TypeError(
        f"{where}: settings support bool, int, float, str, enums and tuple[Enum, ...], not {annotation!r}"
    )


def _build_table() -> tuple[Setting, ...]:
    settings: list[Setting] = []
    top_hints = typing.get_type_hints(KvrouteConfig)
    default_config = KvrouteConfig()  # a section's defaults as the whole config sets them (its factory)
    for section_field in dataclasses.fields(KvrouteConfig):
        section = section_field.name
        section_cls = top_hints[section]
        hints = typing.get_type_hints(section_cls)
        defaults = getattr(default_config, section)
        for f in dataclasses.fields(section_cls):
            key = f"{section}.{f.name}"
            spec = _SPECS.get(key, _Spec(""))
            kind, enum_cls = _kind_of(hints[f.name], key)
            choices = spec.choices
            if choices is None and enum_cls is not None:
                choices = {str(m.value): m for m in enum_cls}
            declared = range_of(f)
            if kind in (Kind.INT, Kind.FLOAT) and declared is None:
                raise TypeError(f"{key}: a numeric setting needs a range (bounded() in router/config.py)")
            unprefixed = spec.short or section in _UNPREFIXED_SECTIONS
            fallback = spec.fallback
            if fallback is None:
                fallback = section in _FALLBACK_SECTIONS or section == "deployment"
            metavar = spec.metavar or _default_metavar(kind, choices)
            settings.append(
                Setting(
                    name=f.name if unprefixed else f"{section}_{f.name}",
                    section=section,
                    field=f.name,
                    kind=kind,
                    default=getattr(defaults, f.name),
                    help=spec.help,
                    checks=spec.checks + ((_path,) if metavar in _PATH_METAVARS else ()),
                    range=declared,
                    choices=choices,
                    required_when=spec.required_when,
                    required_one_of=spec.required_one_of,
                    fallback_part=fallback,
                    secret=spec.secret or is_secret_field(f.name),
                    metavar=metavar,
                )
            )
    _check_unique(settings)
    unknown = set(_SPECS) - {s.toml_key for s in settings}
    if unknown:
        raise RuntimeError(f"_SPECS describes no field of KvrouteConfig: {sorted(unknown)}")
    return tuple(settings)


def is_secret_field(name: str) -> bool:
    """A field is secret when a word of its name says so (``auth_token`` is; ``lookahead_tokens`` is not)."""
    return bool(_SECRET_WORDS & set(name.lower().split("_")))


def _default_metavar(kind: Kind, choices: Mapping[str, enum.Enum] | None) -> str:
    if choices is not None:
        words = "|".join(choices)
        return f"{words}[,...]" if kind is Kind.ENUM_TUPLE else words
    return {Kind.INT: "N", Kind.FLOAT: "X", Kind.BOOL: "BOOL", Kind.STR: "TEXT"}[kind]


_QUOTED_CHARS = 64  # a refused value quoted in a message: its start, and how long it was
# What int() refused only for its length: a run of ASCII digits (int() also takes other scripts' digits
# and underscores between digits, which a refusal for length never is about).
_INTEGER = re.compile(r"[+-]?([0-9]+)")


def _quoted(text: str) -> str:
    """A refused flag or environment value as a message quotes it: a value of thousands of characters
    made a message of thousands. Redacted first: a cut that drops the '@' would leave an address's
    userinfo before it for the message's own redaction to miss."""
    return repr(cut_text(redact_userinfo(text), _QUOTED_CHARS))


def _check_unique(settings: list[Setting]) -> None:
    seen: dict[str, str] = {}
    for s in settings:
        for ident in (s.name, s.flag, s.env):
            if ident in seen:
                raise RuntimeError(f"setting {s.toml_key} collides with {seen[ident]} on {ident!r}")
            seen[ident] = s.toml_key


SETTINGS: tuple[Setting, ...] = _build_table()
BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}
BY_TOML_KEY: Mapping[str, Setting] = {s.toml_key: s for s in SETTINGS}
SECTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KvrouteConfig))
BOOTSTRAP_SETTINGS = _BOOTSTRAP
WORKER_SOURCE_SETTINGS = ("workers", "workers_file", "workers_dns")


def value_of(config: KvrouteConfig, name: str) -> Any:
    """The value of the setting ``name`` in ``config``."""
    s = BY_NAME[name]
    return getattr(getattr(config, s.section), s.field)


def with_value(config: KvrouteConfig, name: str, value: object) -> KvrouteConfig:
    """``config`` with the setting ``name`` set to ``value`` (already parsed; not validated here)."""
    s = BY_NAME[name]
    section = dataclasses.replace(getattr(config, s.section), **{s.field: value})
    return dataclasses.replace(config, **{s.section: section})

