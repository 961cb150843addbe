"""Validation: every problem with a whole configuration at once, each naming its flag and env var.

Pure. The rules are not written here: each section is checked by its component's own
``*_problems`` function (the one its constructor refuses with), sections without a component by
their declared ranges, then the few rules that join sections. This module only renders them in the
operator's words (flag, environment variable, where the value came from) and says which problems
are confined to the KVCM fallback (fail-soft) and which stop kvroute.
"""

from __future__ import annotations

import ipaddress
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from actors.breaker import breaker_problems
from actors.channel_pool import channel_pool_problems
from actors.discovery import discovery_problems
from actors.leader_resolver import leader_problems
from actors.metrics_sink import metrics_problems
from actors.probe_budget import prober_problems
from actors.shadow_index import shadow_problems
from router.config import DeploymentConfig, KvrouteConfig, MasterProtocol
from router.keys import geometry_problems
from router.master_config import master_problems, names_a_host
from router.policy.cache_affinity import scorer_problems
from router.problems import Problem, range_problems
from router.settings.table import (
    BOOTSTRAP_SETTINGS,
    BY_NAME,
    BY_TOML_KEY,
    DEFAULT_ORIGIN,
    SETTINGS,
    Origin,
    SourceKind,
    parse_listen,
    value_of,
)
from router.targets import TargetError, redact_userinfo
from router.transport.tls import Unusable, UnusablePair, grpc_tls_problems, upstream_tls_problems
from router.types import PREFILL_CAPABLE_ROLES


@dataclass(frozen=True, slots=True)
class SettingProblem:
    """One configuration problem, naming every setting involved by flag and env var."""

    settings: tuple[str, ...]  # setting names; empty for file-level problems
    message: str
    fallback: bool  # confined to the KVCM fallback part

    def __str__(self) -> str:
        # A message may quote the value it refuses: an address's credentials never reach the reader.
        where = " / ".join(BY_NAME[name].where for name in self.settings)
        return redact_userinfo(f"{where}: {self.message}" if where else self.message)

    def listed(self) -> str:
        """The problem as a line of the CLIs' error lists."""
        return f"  x {self}{'  [KVCM fallback]' if self.fallback else ''}"


def _deployment_problems(config: DeploymentConfig) -> list[Problem]:
    ranged = range_problems(config)
    problems = list(ranged)
    # The geometry's rules read the ranged values: only once they are in range. Only a range problem
    # holds them back: a problem with another setting (--roles) must not hide the geometry's.
    if not ranged:
        problems += geometry_problems(config.block_size, config.key_family, config.lookahead_tokens)
    if config.roles and not any(r in PREFILL_CAPABLE_ROLES for r in config.roles):
        problems.append(Problem(("roles",), "name a prefill-capable role (PREFILL or PDFUSION) beside DECODE/VIT"))
    if not _utf8(config.kvcm_instance_id):
        # A flag or environment value may carry bytes that are not UTF-8 (as surrogate escapes): KVCM is
        # sent the id as a protobuf string, and encoding it failed in every query, crashing the resolver.
        problems.append(Problem(("kvcm_instance_id",), "must be UTF-8 text (KVCM is sent it as a string)"))
    return problems


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Each section's rules: its component's own check, or its declared ranges when no component of this
# layer has one (the router actor's and the process's settings).
SECTION_PROBLEMS: Mapping[str, Callable[[Any], list[Problem]]] = {
    "deployment": _deployment_problems,
    "router": range_problems,
    "limits": range_problems,
    "discovery": discovery_problems,
    "leader": leader_problems,
    "breaker": breaker_problems,
    "prober": prober_problems,
    "scorer": scorer_problems,
    "shadow": shadow_problems,
    "channel_pool": channel_pool_problems,
    "metrics": metrics_problems,
    "serve": range_problems,
    "master": master_problems,
    "master_breaker": breaker_problems,
    "grpc_tls": grpc_tls_problems,
    "upstream_tls": upstream_tls_problems,
}


# Each section's dataclass, as KvrouteConfig declares it.
_SECTION_TYPES: Mapping[str, type] = typing.get_type_hints(KvrouteConfig)


def section_type_problems(section: str, value: Any) -> list[Problem]:
    """Pure: whether one section of a configuration built in code is its dataclass, and each of its
    settings of its declared type. The forms, the rules and the actors' own checks compare and read
    values of those types: a str where a number goes raised a bare TypeError, a float where an int
    goes failed requests later."""
    expected = _SECTION_TYPES[section]
    if not isinstance(value, expected):
        return [Problem((), f"must be a {expected.__name__}, got a {type(value).__name__}")]
    return [
        Problem((s.field,), message)
        for s in SETTINGS
        if s.section == section and (message := s.type_problem(getattr(value, s.field))) is not None
    ]


def section_problems(section: str, value: Any) -> list[Problem]:
    """Pure: the problems of one section of a configuration built in code, which no loader validated:
    each setting's form (a debug token's characters, an enum's type) and the section's rules. Its files
    are not looked at: they are read, naming the setting, when they are used."""
    mistyped = section_type_problems(section, value)
    if mistyped:
        return mistyped
    problems = [
        Problem((s.field,), message)
        for s in SETTINGS
        if s.section == section
        for message in s.validate(getattr(value, s.field))
    ]
    return problems + SECTION_PROBLEMS[section](value)


@dataclass(frozen=True, slots=True)
class FileChecks:
    """How validation asks whether a named file can be used (I/O, passed in by the loaders)."""

    pem: Unusable  # a TLS certificate, key or CA bundle
    token: Unusable  # the debug token file
    cert_key: UnusablePair  # a certificate and its private key, together
    ca_bundle: Unusable  # a bundle of CA certificates


def _section_rules(
    files: FileChecks | None, malformed: frozenset[str]
) -> Mapping[str, Callable[[Any], list[Problem]]]:
    """The sections' rules; ``files`` reads the TLS files of a section none of whose settings is
    ``malformed`` (a value already refused by its own check, such as a path holding a NUL character,
    which open() would raise ValueError on)."""
    if files is None:
        return SECTION_PROBLEMS
    rules = dict(SECTION_PROBLEMS)
    for section, problems in (("grpc_tls", grpc_tls_problems), ("upstream_tls", upstream_tls_problems)):
        if not any(s.section == section and s.name in malformed for s in SETTINGS):
            rules[section] = partial(problems, unusable=files.pem, pair=files.cert_key, bundle=files.ca_bundle)
    return rules


MAX_PORT = 65_535
_ANY_IPV4 = "0.0.0.0"  # a listener there holds the port on every IPv4 address
_ANY_ADDRESS = "::"  # dual-stack: a listener there holds the port on every address, IPv4 too


def _ipv6_address(host: str) -> bool:
    """Whether ``host`` is an IPv6 address that is not an IPv4-mapped one (a name may resolve to
    IPv4: it is not)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is None


def _hosts_overlap(a: str, b: str) -> bool:
    """Whether listeners on hosts ``a`` and ``b`` at one port would take the same address (the second
    bind would then fail at start-up instead of here): the same host, either one ``::``, or either one
    0.0.0.0 and the other not an IPv6 address (which binds beside it)."""
    if a == b or _ANY_ADDRESS in (a, b):
        return True
    if a == _ANY_IPV4:
        return not _ipv6_address(b)
    if b == _ANY_IPV4:
        return not _ipv6_address(a)
    return False


def _from(origin: Origin) -> str:
    return "the default" if origin.kind is SourceKind.DEFAULT else f"from {origin}"


def _joint_problems(c: KvrouteConfig) -> Iterator[tuple[tuple[str, ...], str]]:
    """Rules that join sections (or the process's own settings): (setting names, message)."""
    d = c.discovery
    if c.router.kvcm_fallback:
        if not (d.kvcm_bootstrap or d.kvcm_bootstrap_file or d.kvcm_bootstrap_dns):
            yield BOOTSTRAP_SETTINGS, "a KVCM bootstrap source is required when --kvcm-fallback is on (set one of them)"
        if not c.deployment.kvcm_instance_id:
            yield ("kvcm_instance_id",), "required when --kvcm-fallback is on"
    if c.router.reserve_min_ms >= c.router.budget_cap_ms:
        yield (
            ("router_reserve_min_ms", "budget_cap_ms"),
            f"the decision reserve ({c.router.reserve_min_ms} ms) leaves nothing of the budget cap "
            f"({c.router.budget_cap_ms} ms)",
        )
    if c.master.hosts and c.router.kvcm_fallback and c.master.later_sources_ms >= c.router.budget_cap_ms:
        yield (
            ("master_later_sources_ms", "budget_cap_ms"),
            f"the time kept for the sources after the scheduler ({c.master.later_sources_ms} ms) leaves it "
            f"nothing of the budget cap ({c.router.budget_cap_ms} ms): it would never be asked",
        )
    # A breaker takes the next trial's verdict from the first trial report it gets, so a trial must not
    # be given up on while its request may still report: no request lasts past the budget cap.
    breakers = (
        (c.router.kvcm_fallback, c.breaker.trial_timeout_s, "breaker_trial_timeout_s", "KVCM"),
        (bool(c.master.hosts), c.master_breaker.trial_timeout_s, "master_breaker_trial_timeout_s", "master"),
    )
    for used, trial_timeout_s, name, which in breakers:
        if used and trial_timeout_s * 1000.0 <= c.router.budget_cap_ms:
            yield (
                (name, "budget_cap_ms"),
                f"the {which} breaker would give up on a half-open trial ({trial_timeout_s} s) while its request "
                f"may still run (up to the budget cap, {c.router.budget_cap_ms} ms), and take that trial's late "
                "report for the next one's verdict (keep it longer than the cap)",
            )
    if c.serve.grpc_max_concurrent_rpcs < c.serve.grpc_max_workers:
        yield (
            ("grpc_max_concurrent_rpcs", "grpc_max_workers"),
            f"gRPC would hold at most {c.serve.grpc_max_concurrent_rpcs} calls at once, fewer than the "
            f"{c.serve.grpc_max_workers} handler threads (keep it at least grpc_max_workers)",
        )
    if c.serve.slot_waiters >= c.serve.grpc_max_workers:
        yield (
            ("slot_waiters", "grpc_max_workers"),
            f"{c.serve.slot_waiters} calls waiting for the router could hold every one of the "
            f"{c.serve.grpc_max_workers} handler threads (keep it below)",
        )
    try:
        grpc, debug = parse_listen(c.serve.grpc_listen), parse_listen(c.serve.debug_listen)
    except TargetError:
        return  # reported by the per-setting check
    if grpc.port != 0 and grpc.port == debug.port and _hosts_overlap(grpc.host, debug.host):
        yield ("grpc_listen", "debug_listen"), (
            f"both listen on {grpc}" if grpc == debug else f"{grpc} and {debug} share port {grpc.port}"
        )
    processes = c.serve.processes
    if processes > 1 and debug.port != 0:
        last = debug.port + processes - 1
        if last > MAX_PORT:
            yield ("processes", "debug_listen"), f"{processes} processes need debug ports {debug.port}..{last}"
        elif _hosts_overlap(grpc.host, debug.host) and debug.port < grpc.port <= last:
            yield (
                ("processes", "grpc_listen", "debug_listen"),
                f"the debug ports of {processes} processes ({debug.port}..{last}) include the gRPC port {grpc.port}",
            )


# The deployment's settings a scheduler over gRPC is sent block keys made with.
_KEY_GEOMETRY = frozenset({"block_size", "lookahead_tokens", "key_family"})


def _keyed_master_problems(c: KvrouteConfig) -> list[SettingProblem]:
    """The key geometry's problems again, on the main path, when a scheduler over gRPC is sent keys made
    with it: fail-soft would reset the geometry to its defaults and send the scheduler wrong keys."""
    if not names_a_host(c.master) or c.master.protocol is not MasterProtocol.GRPC:
        return []
    found = []
    for problem in _deployment_problems(c.deployment):
        if set(problem.fields) <= _KEY_GEOMETRY:
            names = tuple(BY_TOML_KEY[f"deployment.{name}"].name for name in problem.fields)
            message = f"{_in_flags('deployment', problem.message)} (the scheduler is sent block keys made with it)"
            found.append(SettingProblem(names, message, fallback=False))
    return found


def _token_problems(
    c: KvrouteConfig, files: FileChecks | None, malformed: frozenset[str]
) -> Iterator[tuple[tuple[str, ...], str]]:
    if c.serve.debug_token and c.serve.debug_token_file:
        yield ("debug_token", "debug_token_file"), "give the debug token one way, not both"
    if files is not None and c.serve.debug_token_file and "debug_token_file" not in malformed:
        why = files.token(c.serve.debug_token_file)
        if why is not None:
            yield ("debug_token_file",), why


def _in_flags(section: str, message: str) -> str:
    """``message`` with the section's field names (those with an underscore: no plain words) as flags."""
    return _FIELD_WORD.sub(
        lambda m: BY_TOML_KEY[f"{section}.{m[0]}"].flag if f"{section}.{m[0]}" in BY_TOML_KEY else m[0], message
    )


_FIELD_WORD = re.compile(r"\b[a-z0-9]+(?:_[a-z0-9]+)+\b")


def _problem(names: tuple[str, ...], message: str) -> SettingProblem:
    # Confined to the fallback when any setting involved is a fallback part: switching the fallback
    # off (and its settings back to their defaults) removes the problem.
    return SettingProblem(names, message, any(BY_NAME[name].fallback_part for name in names))


def validate(
    config: KvrouteConfig, sources: Mapping[str, Origin] | None = None, files: FileChecks | None = None
) -> list[SettingProblem]:
    """Pure: every problem with ``config`` at once (each value's form, each section's rules, joint rules).

    ``files`` answers whether the named files (TLS, the debug token) can be used; without it only
    the settings' shape is checked. This is the whole of what ``serve`` checks before it starts:
    check-config runs exactly this, with the same ``files``.
    """
    origins = sources or {}
    problems: list[SettingProblem] = []
    for s in SETTINGS:
        for message in s.validate(value_of(config, s.name)):
            problems.append(_problem((s.name,), f"{message} ({_from(origins.get(s.name, DEFAULT_ORIGIN))})"))
    malformed = frozenset(p.settings[0] for p in problems)
    for section, rules in _section_rules(files, malformed).items():
        for found in rules(getattr(config, section)):
            names = tuple(BY_TOML_KEY[f"{section}.{name}"].name for name in found.fields)
            message = _in_flags(section, found.message)
            if len(names) == 1:
                message += f" ({_from(origins.get(names[0], DEFAULT_ORIGIN))})"
            problems.append(_problem(names, message))
    for names, message in (*_joint_problems(config), *_token_problems(config, files, malformed)):
        problems.append(_problem(names, message))
    problems += _keyed_master_problems(config)
    # One setting's problems first, in table order; then those joining settings, as found.
    order = {s.name: i for i, s in enumerate(SETTINGS)}
    return sorted(problems, key=lambda p: order[p.settings[0]] if len(p.settings) == 1 else len(order))
