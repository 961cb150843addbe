"""The settings table: one definition per setting, generated from the dataclasses in ``router/config.py``.

Every field of every section of :class:`~router.config.KvrouteConfig` is one :class:`Setting`: its
default is read from the dataclass (never restated here), its type from the annotation; this module
adds only what the dataclass cannot say — the help text, the validation, whether the setting belongs
to the KVCM fallback, and whether it is required when that feature is on. The command-line flags
(``--block-size``), environment variables (``KVROUTE_BLOCK_SIZE``), TOML keys (``[deployment]
block_size``), ``--help`` and the check-config report are all generated from the table.

Sources, lowest to highest: dataclass defaults < TOML file (``--config F``) < environment < command
line. The origin of every effective value is kept. Validation reports every problem at once, each
naming its flag and environment variable. Fail-soft: problems confined to the KVCM fallback part turn
the fallback off in :attr:`LoadedConfig.effective` (domain routing) instead of stopping the process.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import ipaddress
import logging
import math
import os
import tomllib
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from router.config import KvrouteConfig
from router.targets import HostPort, TargetError, parse_target, parse_target_list
from router.types import KeyFamily, QueryType, Role

ENV_PREFIX = "KVROUTE_"
CONFIG_ENV = "KVROUTE_CONFIG"  # the TOML file, when --config is not given

_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})
_SECRET_WORDS = frozenset({"secret", "token", "password", "passwd", "credential", "apikey"})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")

# Sections whose settings carry no section prefix (their field names are already the operator's words).
_UNPREFIXED_SECTIONS = frozenset({"deployment", "serve"})
# Sections used only by the KVCM fallback; the rest are the main path unless a field says otherwise.
_FALLBACK_SECTIONS = frozenset({"leader", "breaker", "prober", "scorer", "shadow", "channel_pool"})


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
        return f"flag {self.where}"


DEFAULT_ORIGIN = Origin(SourceKind.DEFAULT)

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
    checks: tuple[Check, ...]
    choices: Mapping[str, enum.Enum] | None  # word → member, for ENUM and ENUM_TUPLE
    required_when: str | None  # name of the bool setting that makes this one required
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
                raise SettingValueError(f"expected an integer, got {text!r}") from None
        if self.kind is Kind.FLOAT:
            try:
                return float(raw)
            except ValueError:
                raise SettingValueError(f"expected a number, got {text!r}") from None
        if self.kind is Kind.BOOL:
            word = raw.lower()
            if word in _TRUE_WORDS:
                return True
            if word in _FALSE_WORDS:
                return False
            raise SettingValueError(f"expected true/false/1/0/yes/no/on/off, got {text!r}")
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
            return float(value)
        if self.kind is Kind.ENUM:
            return self._known(value)
        if self.kind is Kind.ENUM_TUPLE and isinstance(value, list | tuple):
            members: dict[object, None] = {}
            for item in value:
                members.setdefault(self._member(item.strip()) if isinstance(item, str) else self._known(item))
            return tuple(members)
        raise SettingValueError(f"expected {self._expected()}, got {value!r}")

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

    def validate(self, value: object) -> list[str]:
        """Pure: the problems with ``value`` (empty when valid)."""
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
        if self.required_when is not None:
            parts.append(f"[required when --{self.required_when.replace('_', '-')} is on]")
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
        raise SettingValueError(f"expected {self._expected()}, got {word!r}")

    def _known(self, value: object) -> enum.Enum:
        for member in (self.choices or {}).values():
            if member is value:
                return member
        raise SettingValueError(f"expected {self._expected()}, got {value!r}")

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


def _finite(value: float) -> str | None:
    return None if math.isfinite(value) else f"must be a finite number, got {value}"


def _positive(value: float) -> str | None:
    return None if value > 0 else f"must be > 0, got {value}"


def _non_negative(value: float) -> str | None:
    return None if value >= 0 else f"must be >= 0, got {value}"


def _at_least(low: int) -> Check:
    def check(value: int) -> str | None:
        return None if value >= low else f"must be >= {low}, got {value}"

    return check


def _within(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Check:
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")

    def check(value: float) -> str | None:
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return None if above and below else f"must be in {lo}{low}, {high}{hi}, got {value}"

    return check


def _port(allow_zero: bool) -> Check:
    return _within(0 if allow_zero else 1, 65535)


def _one_of(words: tuple[str, ...], *, ignore_case: bool = False) -> Check:
    def check(value: str) -> str | None:
        ok = value.upper() in words if ignore_case else value in words
        return None if ok else f"must be one of {'|'.join(words)}, got {value!r}"

    return check


def _non_empty(value: tuple[object, ...] | str) -> str | None:
    return None if value else "must not be empty"


def parse_listen(text: str) -> HostPort:
    """``HOST:PORT`` to listen on; port 0 asks the OS for a free port. Raises TargetError naming the input."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise TargetError(f"listen address {text!r} must be HOST:PORT (port 0 = any free port)")
    if port == "0":
        return HostPort(parse_target(f"{host}:1").host, 0)
    return parse_target(text)


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
    checks: tuple[Check, ...] | None = None  # None: the kind's default (ints/floats >= 0)
    short: bool = False  # the setting's name is the field's name, without the section prefix
    fallback: bool | None = None  # None: decided by the section
    required_when: str | None = None
    choices: Mapping[str, enum.Enum] | None = None
    metavar: str | None = None


_POS = (_positive,)
_NONNEG = (_non_negative,)
_TARGETS = "HOST:PORT[,...]"

_SPECS: dict[str, _Spec] = {
    # deployment
    "deployment.roles": _Spec(
        "Worker roles this deployment routes to; a worker reporting another role is dropped",
        (_non_empty,),
        choices={"PREFILL": Role.PREFILL, "PDFUSION": Role.PDFUSION},
        fallback=False,
        metavar="PREFILL[,PDFUSION]",
    ),
    "deployment.block_size": _Spec(
        "Tokens per KV block (keys are computed with it; workers reporting another are excluded)", _POS
    ),
    "deployment.lookahead_tokens": _Spec("Lookahead tokens of the engine's block keys", _NONNEG),
    "deployment.key_family": _Spec(
        "Block-key family used to hash token ids (caller-supplied keys are used as given)"
    ),
    "deployment.query_type": _Spec(
        "KVCM GetHostCacheState query type",
        choices={"prefix": QueryType.PREFIX_MATCH, "prefix-with-mamba": QueryType.PREFIX_MATCH_WITH_MAMBA},
    ),
    "deployment.kvcm_instance_id": _Spec(
        "KVCM instance id (the namespace, conventionally <deployment>_<block_size>)",
        (),
        required_when="kvcm_fallback",
        metavar="ID",
    ),
    "deployment.p2p_host_count": _Spec(
        "KVCM p2p_host_count asked per query (0 = local matches only)", _NONNEG
    ),
    # router
    "router.kvcm_fallback": _Spec(
        "Route by KVCM cache affinity (off: plain domain routing)", short=True, fallback=False
    ),
    "router.inbox_size": _Spec(
        "Router inbox; when full, route() answers at once with domain fallback (overloaded)", _POS
    ),
    "router.budget_cap_ms": _Spec(
        "Cap on one request's routing deadline: deadline = now + min(budget, cap)",
        _POS,
        short=True,
        metavar="MS",
    ),
    "router.reserve_fraction": _Spec(
        "Share of the deadline kept to decide with what is in hand",
        (_within(0, 1, high_open=True),),
        fallback=True,
    ),
    "router.reserve_min_ms": _Spec("Least time kept to decide, in ms", _NONNEG, fallback=True, metavar="MS"),
    "router.kvcm_query_timeout_ms": _Spec(
        "Cap on one GetHostCacheState call, in ms", _POS, fallback=True, metavar="MS"
    ),
    # discovery
    "discovery.kvcm_bootstrap": _Spec(
        "KVCM bootstrap targets, a bare host takes --kvcm-port; one bootstrap source is needed",
        (),
        short=True,
        fallback=True,
        required_when="kvcm_fallback",
        metavar=_TARGETS,
    ),
    "discovery.kvcm_bootstrap_file": _Spec(
        "File of KVCM bootstrap targets (one per line or comma-separated), re-read when it changes",
        (),
        short=True,
        fallback=True,
        required_when="kvcm_fallback",
        metavar="FILE",
    ),
    "discovery.kvcm_bootstrap_dns": _Spec(
        "DNS name (HOST[:PORT]) whose A/AAAA records are the KVCM bootstrap targets",
        (),
        short=True,
        fallback=True,
        required_when="kvcm_fallback",
        metavar="HOST[:PORT]",
    ),
    "discovery.kvcm_port": _Spec(
        "Port for bootstrap entries given without one",
        (_port(False),),
        short=True,
        fallback=True,
        metavar="PORT",
    ),
    "discovery.workers": _Spec(
        "Static worker list, ip:http_port entries", (), short=True, metavar="IP:HTTP_PORT[,...]"
    ),
    "discovery.workers_file": _Spec(
        "File of worker entries (ip:http_port), re-read when it changes", (), short=True, metavar="FILE"
    ),
    "discovery.workers_dns": _Spec(
        "DNS name (HOST[:PORT]) whose A/AAAA records are the workers", (), short=True, metavar="HOST[:PORT]"
    ),
    "discovery.worker_http_port": _Spec(
        "HTTP port for worker entries and DNS answers without one (0 = entries must give a port)",
        (_port(True),),
        short=True,
        metavar="PORT",
    ),
    "discovery.worker_grpc_port_offset": _Spec(
        "A worker's gRPC port = its HTTP port + this", (_within(-65535, 65535),), short=True, metavar="N"
    ),
    "discovery.worker_status_port": _Spec(
        "Port of GetWorkerStatus (0 = the worker's gRPC port)",
        (_port(True),),
        short=True,
        fallback=True,
        metavar="PORT",
    ),
    "discovery.refresh_interval_s": _Spec(
        "Each discovery source (file, DNS) is re-read this often", _POS, metavar="SECONDS"
    ),
    "discovery.stale_after_s": _Spec(
        "A failed or empty source keeps its last good entries this long", _POS, metavar="SECONDS"
    ),
    "discovery.refresh_timeout_s": _Spec(
        "Bound on one source refresh (a DNS lookup, a file read)", _POS, metavar="SECONDS"
    ),
    "discovery.max_entries": _Spec(
        "Most entries one source may list (a longer answer is a failed refresh)", _POS
    ),
    # leader
    "leader.refresh_interval_s": _Spec(
        "The KVCM leader is re-resolved in the background this often", _POS, metavar="SECONDS"
    ),
    "leader.max_staleness_s": _Spec(
        "A known leader is kept this long after refreshes start failing", _POS, metavar="SECONDS"
    ),
    "leader.lookup_timeout_s": _Spec(
        "Bound on one round of concurrent GetClusterInfo calls", _POS, metavar="SECONDS"
    ),
    "leader.backoff_initial_s": _Spec(
        "First wait after a failed leader lookup (doubles per failure)", _POS, metavar="SECONDS"
    ),
    "leader.backoff_max_s": _Spec("Longest wait between failed leader lookups", _POS, metavar="SECONDS"),
    "leader.backoff_jitter_s": _Spec("Random extra wait added to each backoff", _NONNEG, metavar="SECONDS"),
    "leader.no_leader_retry_s": _Spec(
        "Retry delay when KVCM says no leader is elected yet", _POS, metavar="SECONDS"
    ),
    # breaker
    "breaker.failure_threshold": _Spec("Consecutive KVCM failures that open the breaker", _POS),
    "breaker.window_s": _Spec("Sliding window for the failure-rate trigger", _POS, metavar="SECONDS"),
    "breaker.window_min_calls": _Spec("Calls needed in the window before the failure rate counts", _POS),
    "breaker.failure_rate": _Spec(
        "Failure rate over the window that opens the breaker", (_within(0, 1, low_open=True),)
    ),
    "breaker.window_buckets": _Spec("Buckets the window is counted in", _POS),
    "breaker.cooldown_s": _Spec("First OPEN period (doubles per re-open)", _POS, metavar="SECONDS"),
    "breaker.cooldown_max_s": _Spec("Longest OPEN period", _POS, metavar="SECONDS"),
    "breaker.trial_timeout_s": _Spec(
        "A half-open trial not reported back by then counts as failed", _POS, metavar="SECONDS"
    ),
    "breaker.slow_query_ms": _Spec(
        "A query cut off by its request's deadline counts as a KVCM failure only if it had this long",
        _NONNEG,
        metavar="MS",
    ),
    # prober
    "prober.inflight_cap": _Spec("Most worker-status probes in flight in the process", _POS),
    "prober.rate_per_s": _Spec("Probe rate budget (token bucket refill per second)", _POS),
    "prober.rate_burst": _Spec("Probe token bucket size", _POS),
    "prober.fresh_ttl_s": _Spec(
        "A worker status younger than this is used without a probe", _NONNEG, metavar="SECONDS"
    ),
    "prober.max_status_age_s": _Spec(
        "A worker whose last good status is older is treated as unknown", _POS, metavar="SECONDS"
    ),
    "prober.probe_timeout_s": _Spec("Cap on one GetWorkerStatus call", _POS, metavar="SECONDS"),
    "prober.eject_after_failures": _Spec("Consecutive probe failures that eject a worker", _POS),
    "prober.eject_base_s": _Spec("Ejection time per ejection count (base x n)", _POS, metavar="SECONDS"),
    "prober.eject_max_s": _Spec("Longest ejection", _POS, metavar="SECONDS"),
    "prober.max_ejected_fraction": _Spec("Most of the known workers ejected at once", (_within(0, 1),)),
    "prober.max_tracked_workers": _Spec("Bound on per-worker prober state", _POS),
    "prober.inbox_size": _Spec("WorkerProber inbox", _POS),
    "prober.engine_generation": _Spec("Worker-status decoder generation (engine version family)"),
    # scorer
    "scorer.prefill_queue_size_threshold": _Spec(
        "Workers with this many waiting tasks or more are dropped", _POS
    ),
    "scorer.p2p_hit_discount": _Spec("Weight of p2p-only blocks in the effective hit", (_within(0, 1),)),
    "scorer.max_extra_work_tokens": _Spec(
        "Extra work (tokens) the cache leader may have over the shortest", _NONNEG
    ),
    "scorer.min_hit_rate": _Spec(
        "Leader hit below this percent of the prompt turns affinity off (0 = no gate)", (_within(0, 100),)
    ),
    "scorer.outstanding_uncached_tokens_threshold": _Spec(
        "Outstanding-work guard in tokens (0 = off)", _NONNEG
    ),
    "scorer.hot_set_size": _Spec("Candidates taken from KVCM's answer (top by effective blocks)", _POS),
    "scorer.cold_set_size": _Spec("Extra candidates taken from discovery per request", _NONNEG),
    "scorer.seed": _Spec("Seed of the RNG that breaks exact ties", _NONNEG),
    "scorer.max_tracked_workers": _Spec("Bound on the selection ledger (last-selected, pre-charge)", _POS),
    "scorer.max_pending_charges": _Spec(
        "Pre-charges kept per worker (older ones are merged)", (_at_least(2),)
    ),
    # shadow
    "shadow.ttl_s": _Spec("Shadow index entries live this long", _POS, metavar="SECONDS"),
    "shadow.capacity_blocks": _Spec("Shadow index capacity in blocks (LRU)", _POS),
    "shadow.inbox_size": _Spec("ShadowIndex inbox; records beyond it are dropped and counted", _POS),
    # channel pool
    "channel_pool.max_channels": _Spec("Most gRPC channels kept open (LRU)", _POS),
    "channel_pool.idle_expiry_s": _Spec("An idle gRPC channel is closed after this", _POS, metavar="SECONDS"),
    "channel_pool.keepalive_time_ms": _Spec("gRPC keepalive ping interval", _POS, metavar="MS"),
    "channel_pool.keepalive_timeout_ms": _Spec("gRPC keepalive ping timeout", _POS, metavar="MS"),
    "channel_pool.max_message_bytes": _Spec("gRPC max message size", _POS),
    # metrics
    "metrics.inbox_size": _Spec("MetricsSink inbox; events beyond it are dropped and counted", _POS),
    "metrics.decision_ring_size": _Spec("Decisions kept for /debug/decisions", _POS),
    "metrics.shadow_agreement_window": _Spec(
        "Shadow-vs-KVCM comparisons averaged into the agreement ratio", _POS
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
    "serve.log_format": _Spec("Log line format", (_one_of(LOG_FORMATS),), metavar="|".join(LOG_FORMATS)),
    "serve.log_aggregate_interval_s": _Spec(
        "Hot-path warnings are aggregated and logged at most once per this", _POS, metavar="SECONDS"
    ),
    "serve.log_max_keys": _Spec(
        "Bound on distinct keys the aggregating and once-per-key loggers remember", _POS
    ),
    "serve.drain_timeout_s": _Spec(
        "On SIGTERM/SIGINT, in-flight requests get this long to finish", _NONNEG, metavar="SECONDS"
    ),
    "serve.drain_lame_duck_s": _Spec(
        "First part of the drain: health says NOT_SERVING and new Route calls are refused (UNAVAILABLE, "
        "not routed) while the server still runs, so no call is cut off when it stops (capped by "
        "--drain-timeout-s)",
        _NONNEG,
        metavar="SECONDS",
    ),
    "serve.grpc_max_workers": _Spec(
        "kvroute serve: Route handler threads, and the most Route calls in flight "
        "(beyond it a call is refused at once with RESOURCE_EXHAUSTED)",
        _POS,
    ),
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


def _default_checks(kind: Kind) -> tuple[Check, ...]:
    if kind in (Kind.INT, Kind.FLOAT):
        return (_non_negative,)
    return ()


def _build_table() -> tuple[Setting, ...]:
    settings: list[Setting] = []
    top_hints = typing.get_type_hints(KvrouteConfig)
    for section_field in dataclasses.fields(KvrouteConfig):
        section = section_field.name
        section_cls = top_hints[section]
        hints = typing.get_type_hints(section_cls)
        defaults = section_cls()
        for f in dataclasses.fields(section_cls):
            key = f"{section}.{f.name}"
            spec = _SPECS.get(key, _Spec(""))
            kind, enum_cls = _kind_of(hints[f.name], key)
            choices = spec.choices
            if choices is None and enum_cls is not None:
                choices = {str(m.value): m for m in enum_cls}
            checks = spec.checks if spec.checks is not None else _default_checks(kind)
            if kind is Kind.FLOAT:
                checks = (_finite, *checks)
            unprefixed = spec.short or section in _UNPREFIXED_SECTIONS
            fallback = spec.fallback
            if fallback is None:
                fallback = section in _FALLBACK_SECTIONS or section == "deployment"
            settings.append(
                Setting(
                    name=f.name if unprefixed else f"{section}_{f.name}",
                    section=section,
                    field=f.name,
                    kind=kind,
                    default=getattr(defaults, f.name),
                    help=spec.help,
                    checks=checks,
                    choices=choices,
                    required_when=spec.required_when,
                    fallback_part=fallback,
                    secret=is_secret_field(f.name),
                    metavar=spec.metavar or _default_metavar(kind, choices),
                )
            )
    _check_unique(settings)
    return tuple(settings)


def is_secret_field(name: str) -> bool:
    """A field is secret when a word of its name says so (``auth_token`` is; ``lookahead_tokens`` is not)."""
    return bool(_SECRET_WORDS & set(name.lower().split("_")))


def _default_metavar(kind: Kind, choices: Mapping[str, enum.Enum] | None) -> str:
    if choices is not None:
        words = "|".join(choices)
        return f"{words}[,...]" if kind is Kind.ENUM_TUPLE else words
    return {Kind.INT: "N", Kind.FLOAT: "X", Kind.BOOL: "BOOL", Kind.STR: "TEXT"}[kind]


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


# ---------------------------------------------------------------------------------------------
# Problems and the loaded result.


@dataclass(frozen=True, slots=True)
class Problem:
    """One configuration problem, naming every setting involved by flag and env var."""

    settings: tuple[str, ...]  # setting names ("" entries never; empty for file-level problems)
    message: str
    fallback: bool  # confined to the KVCM fallback part

    def __str__(self) -> str:
        where = " / ".join(BY_NAME[name].where for name in self.settings)
        return f"{where}: {self.message}" if where else self.message

    def listed(self) -> str:
        """The problem as a line of the CLIs' error lists."""
        return f"  x {self}{'  [KVCM fallback]' if self.fallback else ''}"


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    config: KvrouteConfig  # as given (may hold invalid values when there are errors)
    effective: KvrouteConfig  # fail-soft: invalid fallback settings → defaults and kvcm_fallback off
    sources: Mapping[str, Origin]  # setting name → where its value came from
    errors: tuple[Problem, ...]
    warnings: tuple[str, ...]
    config_path: str | None

    @property
    def fallback_errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.errors if p.fallback)

    @property
    def fatal_errors(self) -> tuple[Problem, ...]:
        """Problems outside the KVCM fallback: kvroute cannot start with them."""
        return tuple(p for p in self.errors if not p.fallback)

    @property
    def fallback_disabled_by_errors(self) -> bool:
        return self.config.router.kvcm_fallback and bool(self.fallback_errors)

    def value(self, name: str) -> object:
        """The effective value of a setting by name."""
        s = BY_NAME[name]
        return getattr(getattr(self.effective, s.section), s.field)


def _get(config: KvrouteConfig, name: str) -> Any:
    s = BY_NAME[name]
    return getattr(getattr(config, s.section), s.field)


# ---------------------------------------------------------------------------------------------
# Cross-field checks: pure functions of the whole config.

_CrossProblem = tuple[tuple[str, ...], str, bool]
_BOOTSTRAP = ("kvcm_bootstrap", "kvcm_bootstrap_file", "kvcm_bootstrap_dns")
_WORKER_SOURCES = ("workers", "workers_file", "workers_dns")


def _cross_checks(c: KvrouteConfig) -> Iterator[_CrossProblem]:
    d = c.discovery
    if c.router.kvcm_fallback:
        if not (d.kvcm_bootstrap or d.kvcm_bootstrap_file or d.kvcm_bootstrap_dns):
            yield (
                _BOOTSTRAP,
                "a KVCM bootstrap source is required when --kvcm-fallback is on (set one of them)",
                True,
            )
        if not c.deployment.kvcm_instance_id:
            yield ("kvcm_instance_id",), "required when --kvcm-fallback is on", True
    if d.kvcm_bootstrap:
        try:
            entries = parse_target_list(d.kvcm_bootstrap, default_port=d.kvcm_port)
        except TargetError as exc:
            yield ("kvcm_bootstrap",), str(exc), True
        else:
            if len(entries) > d.max_entries:
                yield (
                    ("kvcm_bootstrap", "discovery_max_entries"),
                    f"{len(entries)} entries, above the maximum",
                    True,
                )
    if d.kvcm_bootstrap_dns:
        try:
            parse_target(d.kvcm_bootstrap_dns, default_port=d.kvcm_port)
        except TargetError as exc:
            yield ("kvcm_bootstrap_dns",), str(exc), True
    worker_port = d.worker_http_port or None
    hint = "" if worker_port else " (or set --worker-http-port for entries without a port)"
    if d.workers:
        try:
            workers = parse_target_list(d.workers, default_port=worker_port)
        except TargetError as exc:
            yield ("workers",), f"{exc}{hint}", False
        else:
            if len(workers) > d.max_entries:
                yield (
                    ("workers", "discovery_max_entries"),
                    f"{len(workers)} entries, above the maximum",
                    False,
                )
    if d.workers_dns:
        try:
            parse_target(d.workers_dns, default_port=worker_port)
        except TargetError as exc:
            yield ("workers_dns",), f"{exc}{hint}", False
    if d.stale_after_s < d.refresh_interval_s:
        yield (
            ("discovery_stale_after_s", "discovery_refresh_interval_s"),
            f"the stale timeout ({d.stale_after_s} s) is shorter than the refresh interval "
            f"({d.refresh_interval_s} s)",
            False,
        )
    for low, high, fallback in (
        ("leader_backoff_initial_s", "leader_backoff_max_s", True),
        ("breaker_cooldown_s", "breaker_cooldown_max_s", True),
        ("prober_eject_base_s", "prober_eject_max_s", True),
    ):
        if _get(c, low) > _get(c, high):
            yield (low, high), f"{_get(c, low)} is above the maximum {_get(c, high)}", fallback
    if c.prober.fresh_ttl_s >= c.prober.max_status_age_s:
        yield (
            ("prober_fresh_ttl_s", "prober_max_status_age_s"),
            "the freshness TTL must be shorter than the max status age",
            True,
        )
    if c.router.reserve_min_ms >= c.router.budget_cap_ms:
        yield (
            ("router_reserve_min_ms", "budget_cap_ms"),
            (
                f"the decision reserve ({c.router.reserve_min_ms} ms) leaves nothing of the budget cap "
                f"({c.router.budget_cap_ms} ms)"
            ),
            True,
        )
    if c.deployment.key_family is KeyFamily.SGLANG and c.deployment.lookahead_tokens > 1:
        yield ("key_family", "lookahead_tokens"), "the sglang key family supports lookahead 0 or 1 only", True
    yield from _listen_clash(c)


def _listen_clash(c: KvrouteConfig) -> Iterator[_CrossProblem]:
    try:
        grpc, debug = parse_listen(c.serve.grpc_listen), parse_listen(c.serve.debug_listen)
    except TargetError:
        return  # reported by the per-setting check
    if grpc.port != 0 and grpc == debug:
        yield ("grpc_listen", "debug_listen"), f"both listen on {grpc}", False


def _from(origin: Origin) -> str:
    return "the default" if origin.kind is SourceKind.DEFAULT else f"from {origin}"


def validate(config: KvrouteConfig, sources: Mapping[str, Origin] | None = None) -> list[Problem]:
    """Pure: every problem with ``config`` at once (per-setting checks, then cross-field checks)."""
    problems: list[Problem] = []
    for s in SETTINGS:
        value = _get(config, s.name)
        origin = (sources or {}).get(s.name, DEFAULT_ORIGIN)
        for message in s.validate(value):
            problems.append(Problem((s.name,), f"{message} ({_from(origin)})", s.fallback_part))
    for names, message, fallback in _cross_checks(config):
        problems.append(Problem(names, message, fallback))
    return problems


# ---------------------------------------------------------------------------------------------
# Loading.


def _read_toml(path: str) -> tuple[dict[str, object], list[Problem]]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file), []
    except OSError as exc:
        return {}, [Problem((), f"--config {path}: cannot read the file: {exc.strerror or exc}", False)]
    except tomllib.TOMLDecodeError as exc:
        return {}, [Problem((), f"--config {path}: not valid TOML: {exc}", False)]


def _toml_values(path: str, data: Mapping[str, object]) -> Iterator[tuple[Setting | None, object, str]]:
    """(setting or None if unknown, value, "file [section] key") for every key of the file."""
    for section, table in data.items():
        if not isinstance(table, dict):
            yield (
                None,
                table,
                f"{path}: top-level key {section!r} (settings live in [section] tables: "
                f"{', '.join(SECTIONS)})",
            )
            continue
        for key, value in table.items():
            yield BY_TOML_KEY.get(f"{section}.{key}"), value, f"{path} [{section}] {key}"


def load_config(
    cli: argparse.Namespace | Mapping[str, object],
    env: Mapping[str, str],
    toml_path: str | None = None,
) -> LoadedConfig:
    """Build the configuration from defaults < TOML file < environment < command line.

    ``cli`` is an argparse namespace made by :func:`add_arguments`, or a mapping of setting name →
    value (text as on the command line, or a value of the setting's type); None means not given.
    ``toml_path`` None falls back to ``env["KVROUTE_CONFIG"]``. Never raises on bad input: every
    problem is in ``errors``.
    """
    given = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli)
    path = toml_path if toml_path is not None else env.get(CONFIG_ENV) or None
    values: dict[str, object] = {s.name: s.default for s in SETTINGS}
    sources: dict[str, Origin] = {s.name: DEFAULT_ORIGIN for s in SETTINGS}
    problems: list[Problem] = []
    warnings: list[str] = []

    def take(s: Setting, raw: object, origin: Origin) -> None:
        try:
            values[s.name] = s.parse_value(raw)
            sources[s.name] = origin
        except SettingValueError as exc:
            problems.append(Problem((s.name,), f"{exc} ({_from(origin)})", s.fallback_part))

    if path:
        data, file_problems = _read_toml(path)
        problems.extend(file_problems)
        for setting, value, where in _toml_values(path, data):
            if setting is None:
                problems.append(Problem((), f"unknown setting {where}", False))
            else:
                take(setting, value, Origin(SourceKind.FILE, where))
    for s in SETTINGS:
        if s.env in env:
            take(s, env[s.env], Origin(SourceKind.ENV, s.env))
    known_env = {s.env for s in SETTINGS} | {CONFIG_ENV}
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known_env:
            warnings.append(f"environment variable {name} is not a kvroute setting (ignored)")
    for s in SETTINGS:
        raw = given.get(s.name)
        if raw is not None:
            take(s, raw, Origin(SourceKind.FLAG, s.flag))

    config = _assemble(values)
    problems.extend(validate(config, sources))
    return LoadedConfig(
        config=config,
        effective=_fail_soft(config, problems),
        sources=sources,
        errors=tuple(problems),
        warnings=tuple(warnings),
        config_path=path,
    )


def load_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> LoadedConfig:
    """load_config for a namespace made by add_arguments (``--config`` included); env: os.environ."""
    config_path = vars(args).get("config")
    return load_config(
        args, os.environ if env is None else env, config_path if isinstance(config_path, str) else None
    )


def _assemble(values: Mapping[str, object]) -> KvrouteConfig:
    hints = typing.get_type_hints(KvrouteConfig)
    sections: dict[str, Any] = {}
    for section in SECTIONS:
        fields = {s.field: values[s.name] for s in SETTINGS if s.section == section}
        sections[section] = hints[section](**fields)
    return KvrouteConfig(**sections)


def _fail_soft(config: KvrouteConfig, problems: Iterable[Problem]) -> KvrouteConfig:
    """Invalid fallback settings go back to their (valid) defaults and the fallback is switched off.

    Only settings of the fallback part are reset: a main-path setting named in the same problem
    (e.g. --discovery-max-entries beside --kvcm-bootstrap) keeps its value.
    """
    if not any(p.fallback for p in problems):
        return config
    values = {s.name: _get(config, s.name) for s in SETTINGS}
    values["kvcm_fallback"] = False
    reset: set[str] = set()
    # A reset can expose a new conflict (fresh TTL back to its default, above a small given max age):
    # repeat until no fallback setting is left in a problem. Each round resets at least one more.
    while True:
        bad = {name for p in problems if p.fallback for name in p.settings if BY_NAME[name].fallback_part}
        if bad <= reset:
            return _assemble(values)
        reset |= bad
        for name in bad:
            values[name] = BY_NAME[name].default
        problems = validate(_assemble(values))


# ---------------------------------------------------------------------------------------------
# argparse, redaction, and the operator's view.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one option per setting (grouped by section); --help is generated from the table.

    Options default to None (= not given) and are parsed by load_config, so every bad value is
    reported at once instead of argparse stopping at the first.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"TOML file with [section] tables of settings (env {CONFIG_ENV}); precedence: "
        "defaults < file < environment < flags",
    )
    for section in SECTIONS:
        group = parser.add_argument_group(f"{section} settings")
        for s in SETTINGS:
            if s.section != section:
                continue
            help_text = s.help_text().replace("%", "%%")
            if s.kind is Kind.BOOL:
                group.add_argument(
                    s.flag,
                    dest=s.name,
                    default=None,
                    nargs="?",
                    const="true",
                    metavar=s.metavar,
                    help=help_text,
                )
            else:
                group.add_argument(s.flag, dest=s.name, default=None, metavar=s.metavar, help=help_text)


def redacted(config: KvrouteConfig) -> dict[str, dict[str, object]]:
    """The config as JSON-ready ``{section: {field: value}}``; fields named like secrets are masked."""
    out: dict[str, dict[str, object]] = {section: {} for section in SECTIONS}
    for s in SETTINGS:
        value = _get(config, s.name)
        out[s.section][s.field] = "<redacted>" if s.secret and value else s.jsonable(value)
    return out


def debug_config_view(loaded: LoadedConfig) -> dict[str, object]:
    """What /debug/config shows: the effective config (redacted), each value's source, and the problems."""
    return {
        "config_file": loaded.config_path,
        "effective": redacted(loaded.effective),
        "sources": {s.toml_key: str(loaded.sources[s.name]) for s in SETTINGS},
        "kvcm_fallback_disabled_by_errors": loaded.fallback_disabled_by_errors,
        "errors": [str(p) for p in loaded.errors],
        "warnings": list(loaded.warnings),
    }


@dataclass(frozen=True, slots=True)
class Assessment:
    works: tuple[str, ...]
    will_not_work: tuple[str, ...]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def assess(loaded: LoadedConfig, path_exists: Callable[[str], bool] = os.path.exists) -> Assessment:
    """Plain sentences on what will and will not work with the effective configuration (lesson §16)."""
    c = loaded.effective
    src = loaded.sources
    works: list[str] = []
    broken: list[str] = []

    def said(name: str) -> str:
        s = BY_NAME[name]
        origin = src[name]
        where = "default" if origin.kind is SourceKind.DEFAULT else str(origin)
        return f"{s.flag}={s.format(_get(c, name))} ({where})"

    worker_sources = [n for n in _WORKER_SOURCES if _get(c, n)]
    if loaded.fallback_disabled_by_errors:
        broken.append(
            f"KVCM fallback requested but DISABLED: {len(loaded.fallback_errors)} problem(s) in its settings "
            "(listed below); every request is routed by domain (discovery)"
        )
    if c.router.kvcm_fallback:
        boot = [said(n) for n in _BOOTSTRAP if _get(c, n)]
        works.append(
            f"KVCM fallback on: leader from {', '.join(boot)}; namespace {c.deployment.kvcm_instance_id!r}; "
            f"query type {BY_NAME['query_type'].format(c.deployment.query_type)}"
        )
        works.append(
            f"block size from {said('block_size')}: workers that report another block size will be excluded"
        )
        if c.deployment.lookahead_tokens:
            works.append(
                f"lookahead from {said('lookahead_tokens')}: workers that report another will be excluded"
            )
        works.append(
            f"token ids are hashed with the {BY_NAME['key_family'].format(c.deployment.key_family)} "
            "key family; caller-supplied block keys are used as given"
        )
        works.append(
            f"shadow index keeps affinity through a KVCM outage (entries live {c.shadow.ttl_s:g} s, "
            f"up to {c.shadow.capacity_blocks} blocks)"
        )
        if not worker_sources:
            broken.append(
                "KVCM fallback on, but no worker discovery source (--workers, --workers-file, "
                "--workers-dns): cold candidates and domain fallback unavailable"
            )
    elif not loaded.fallback_disabled_by_errors:
        works.append(
            f"KVCM fallback off ({said('kvcm_fallback')}): every request is routed by domain (discovery)"
        )
    if worker_sources:
        works.append("workers from " + ", ".join(said(n) for n in worker_sources))
    else:
        broken.append(
            "no worker discovery source: no request can be routed (decisions have route_source=none), "
            "/readyz reports not ready"
        )
    for name in ("workers_file", "kvcm_bootstrap_file"):
        path = _get(c, name)
        if path and not path_exists(path):
            broken.append(
                f"{BY_NAME[name].flag} {path} does not exist: that source stays empty until it appears"
            )
    roles = BY_NAME["roles"].format(c.deployment.roles)
    works.append(
        f"routes to roles {roles}; workers reporting another role are dropped (counted as role_not_routed)"
    )
    works.append(f"each request is decided within min(its budget, {said('budget_cap_ms')})")
    try:
        debug = parse_listen(c.serve.debug_listen)
    except TargetError:
        debug = None
    if debug is not None:
        port = "a free port chosen at start (logged)" if debug.port == 0 else f"port {debug.port}"
        works.append(f"debug HTTP (/healthz /readyz /metrics /debug/*) on {debug.host}, {port}")
        if not _is_loopback(debug.host):
            broken.append(
                f"debug HTTP binds {debug.host}, not loopback: /metrics and /debug/* are reachable "
                "from the network"
            )
    works.append(f"logs at {c.serve.log_level.upper()} as {c.serve.log_format}")
    if loaded.fatal_errors:
        broken.append(
            f"kvroute will not start: {len(loaded.fatal_errors)} problem(s) outside the KVCM fallback "
            "(listed below)"
        )
    return Assessment(tuple(works), tuple(broken))


def log_startup_report(
    loaded: LoadedConfig, log: logging.Logger, path_exists: Callable[[str], bool] = os.path.exists
) -> None:
    """What a starting process logs about its configuration (lesson §16).

    One ERROR record listing every problem in the KVCM fallback settings when they turned the fallback
    off, one ERROR record listing the problems outside it (the caller should not start), a WARNING per
    ignored KVROUTE_* variable and per thing that will not work, and INFO for what will.
    """
    if loaded.fallback_errors:
        log.error(
            "KVCM fallback disabled, routing by domain: %d configuration problem(s): %s",
            len(loaded.fallback_errors),
            "; ".join(str(p) for p in loaded.fallback_errors),
        )
    if loaded.fatal_errors:
        log.error(
            "%d configuration problem(s): %s",
            len(loaded.fatal_errors),
            "; ".join(str(p) for p in loaded.fatal_errors),
        )
    for warning in loaded.warnings:
        log.warning("%s", warning)
    verdict = assess(loaded, path_exists)
    for line in verdict.will_not_work:
        log.warning("will not work: %s", line)
    for line in verdict.works:
        log.info("%s", line)
