"""The operator's view of a configuration: what will and will not work, and the startup log report."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from actors.discovery import ListKind, list_file_problem
from actors.sources.master import DOMAIN_RESERVE_S
from router.config import KvrouteConfig
from router.decision_record import child_log_path, unusable_log_path
from router.master_config import master_hosts, master_problems
from router.settings.load import LoadedConfig
from router.settings.table import (
    BOOTSTRAP_SETTINGS,
    BY_NAME,
    WORKER_SOURCE_SETTINGS,
    SourceKind,
    parse_listen,
    value_of,
)
from router.targets import TargetError, redact_userinfo


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
    """Plain sentences on what will and will not work with the effective configuration."""
    c = loaded.effective
    src = loaded.sources
    works: list[str] = []
    broken: list[str] = []

    def said(name: str) -> str:
        s = BY_NAME[name]
        origin = src[name]
        where = "default" if origin.kind is SourceKind.DEFAULT else str(origin)
        return f"{s.flag}={s.shown_text(value_of(c, name))} ({where})"

    worker_sources = [n for n in WORKER_SOURCE_SETTINGS if value_of(c, n)]
    if loaded.fallback_disabled_by_errors:
        broken.append(
            f"KVCM fallback requested but DISABLED: {len(loaded.fallback_errors)} problem(s) in its settings "
            "(listed below); every request is routed by domain (discovery)"
        )
    if c.router.kvcm_fallback:
        boot = [said(n) for n in BOOTSTRAP_SETTINGS if value_of(c, n)]
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
    decision_log = c.router.decision_log
    if decision_log and not path_exists(os.path.dirname(os.path.abspath(decision_log))):
        broken.append(
            f"{BY_NAME['decision_log'].flag} {redact_userinfo(decision_log)}: its directory does not exist, so "
            "no decision is logged (each write fails; counted in /debug/actors)"
        )
    elif decision_log:
        # What each writer's rotation would touch: its file and the rotated names beside it.
        writers = (
            [child_log_path(decision_log, i) for i in range(c.serve.processes)]
            if c.serve.processes > 1
            else [decision_log]
        )
        paths = [f"{w}.{i}" if i else w for w in writers for i in range(c.router.decision_log_files)]
        for path in paths:
            unusable = unusable_log_path(path)
            if unusable is not None:
                broken.append(
                    f"{BY_NAME['decision_log'].flag}: {redact_userinfo(path)} {unusable}: it is left as it is, "
                    "and no decision is logged there (each write fails; counted in /debug/actors)"
                )
                break
    for name, kind in (("workers_file", ListKind.WORKERS), ("kvcm_bootstrap_file", ListKind.KVCM)):
        path = value_of(c, name)
        if path and not path_exists(path):
            broken.append(
                f"{BY_NAME[name].flag} {redact_userinfo(path)} does not exist: that source stays empty until it appears"
            )
        elif path and (why := list_file_problem(c.discovery, kind, path, f"{BY_NAME[name].flag} {path}")) is not None:
            broken.append(f"{redact_userinfo(why)}: that source stays empty until the file is fixed")
    roles = BY_NAME["roles"].format(c.deployment.roles)
    works.append(
        f"routes to roles {roles}; workers reporting another role are dropped (counted as role_not_routed)"
    )
    works.append(f"each request is decided within min(its budget, {said('budget_cap_ms')})")
    works += _master_lines(c, said)
    if c.router.kvcm_fallback and c.router.kvcm_query_timeout_ms >= c.router.budget_cap_ms:
        works.append(
            f"{said('router_kvcm_query_timeout_ms')} does not bound a query under the budget cap: "
            "the request's own deadline ends it first"
        )
    try:
        debug = parse_listen(c.serve.debug_listen)
    except TargetError:
        debug = None
    if debug is not None:
        port = "a free port chosen at start (logged)" if debug.port == 0 else f"port {debug.port}"
        works.append(f"debug HTTP (/healthz /readyz /metrics /debug/*) on {debug.host}, {port}")
        if not _is_loopback(debug.host):
            if c.serve.debug_token or c.serve.debug_token_file:
                works.append(
                    f"debug HTTP binds {debug.host}: every path but /healthz requires the bearer token, which "
                    "crosses the network in the clear (the debug endpoint has no TLS: keep it on a trusted "
                    "network or behind a TLS proxy)"
                )
            else:
                broken.append(
                    f"debug HTTP binds {debug.host}, not loopback, without --debug-token(-file): /metrics and "
                    "/debug/* are reachable from the network by anyone"
                )
    works += _tls_lines(c)
    try:
        grpc = parse_listen(c.serve.grpc_listen)
    except TargetError:
        grpc = None
    if grpc is not None and not _is_loopback(grpc.host) and not c.grpc_tls.cert:
        broken.append(
            f"kvroute serve's Route gRPC listens on {grpc.host}, not loopback, without TLS (--grpc-tls-cert, "
            "--grpc-tls-key): requests and answers cross the network in plaintext"
        )
    works.append(f"logs at {c.serve.log_level.upper()} as {c.serve.log_format}")
    prober = c.prober
    if prober.background_refresh and prober.refresh_interval_s >= prober.fresh_ttl_s:
        broken.append(
            f"{said('prober_background_refresh')} is on but inactive: {said('prober_refresh_interval_s')} is not "
            f"below {said('prober_fresh_ttl_s')}, so no polled status would still be fresh when read; requests "
            "probe their candidates on demand"
        )
    if loaded.fatal_errors:
        broken.append(
            f"kvroute will not start: {len(loaded.fatal_errors)} problem(s) outside the KVCM fallback "
            "(listed below)"
        )
    return Assessment(tuple(works), tuple(broken))


def _master_lines(c: KvrouteConfig, said: Callable[[str], str]) -> list[str]:
    refused = bool(master_problems(c.master))
    hosts = master_hosts(c.master) if not refused else ()
    if not hosts:
        why = "--master-hosts refused, see below" if refused else "--master-hosts empty"
        starts = "the chain starts at KVCM" if c.router.kvcm_fallback else "the chain is the domain source alone"
        return [f"no central scheduler ({why}): {starts}"]
    after = "KVCM, then the shadow index and domain" if c.router.kvcm_fallback else "domain routing"
    kept = (
        f"its budget less {said('master_later_sources_ms')} kept for KVCM"
        if c.router.kvcm_fallback
        else f"its deadline less {DOMAIN_RESERVE_S * 1000:g} ms"
    )
    lines = [
        f"the central scheduler is asked first: {len(hosts)} host(s) from {said('master_hosts')} over "
        f"{c.master.protocol.value}; when it cannot answer, {after}",
        f"a request's master attempt lasts at most min({said('master_transport_timeout_ms')}, {kept}); the "
        f"master's breaker opens after {said('master_breaker_failure_threshold')} failures",
    ]
    if c.master.transport_timeout_ms >= c.router.budget_cap_ms:
        lines.append(
            f"{said('master_transport_timeout_ms')} does not bound an attempt under the budget cap: "
            "the request's budget ends it first"
        )
    return lines


def _tls_lines(c: KvrouteConfig) -> list[str]:
    lines: list[str] = []
    if c.grpc_tls.cert:
        lines.append(
            "kvroute serve's Route gRPC uses TLS"
            + (" and requires client certificates (mTLS)" if c.grpc_tls.client_ca else "")
        )
    if c.upstream_tls.enabled:
        lines.append(
            "connections to KVCM, workers and the master use TLS (servers checked against "
            + ("--upstream-tls-ca" if c.upstream_tls.ca else "the system's CA bundle")
            + (", client certificate presented)" if c.upstream_tls.cert else ")")
        )
    else:
        lines.append("connections to KVCM, workers and the master are plaintext (no --upstream-tls-ca)")
    return lines


def log_startup_report(
    loaded: LoadedConfig, log: logging.Logger, path_exists: Callable[[str], bool] = os.path.exists
) -> None:
    """What a starting process logs about its configuration.

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
        log.warning("%s", redact_userinfo(warning))
    verdict = assess(loaded, path_exists)
    for line in verdict.will_not_work:
        log.warning("will not work: %s", redact_userinfo(line))
    for line in verdict.works:
        log.info("%s", redact_userinfo(line))
