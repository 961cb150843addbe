"""What is shown of a configuration: redacted values, their sources, and the problems.

Two rules, for every view (``/debug/config``, check-config, the log): a secret setting (the TLS
private keys, the debug token; any setting named like a secret) shows as ``<redacted>`` when set, and
the userinfo of an address (``user:password@host``) shows as ``<redacted>@host`` in every value and
message.
"""

from __future__ import annotations

import hashlib
import json

from router.config import KvrouteConfig
from router.settings.load import LoadedConfig
from router.settings.table import SECTIONS, SETTINGS, value_of
from router.targets import redact_userinfo


def redacted(config: KvrouteConfig) -> dict[str, dict[str, object]]:
    """The config as JSON-ready ``{section: {field: value}}``, every value as ``Setting.shown`` gives it."""
    out: dict[str, dict[str, object]] = {section: {} for section in SECTIONS}
    for s in SETTINGS:
        out[s.section][s.field] = s.shown(value_of(config, s.name))
    return out


def debug_config_view(loaded: LoadedConfig) -> dict[str, object]:
    """What /debug/config shows: the effective config (redacted), each value's source, and the problems."""
    return {
        "process": None if loaded.supervised is None else str(loaded.supervised),
        "config_file": loaded.config_path,
        "effective": redacted(loaded.effective),
        "sources": {s.toml_key: str(loaded.sources[s.name]) for s in SETTINGS},
        "kvcm_fallback_disabled_by_errors": loaded.fallback_disabled_by_errors,
        "errors": [str(p) for p in loaded.errors],
        "warnings": [redact_userinfo(w) for w in loaded.warnings],
    }


def non_default_settings(config: KvrouteConfig) -> dict[str, str]:
    """Setting name → text (as on the command line) for every setting not at its default; secrets masked."""
    out: dict[str, str] = {}
    for s in SETTINGS:
        value = value_of(config, s.name)
        if value != s.default:
            out[s.name] = "<redacted>" if s.secret else s.format(value)
    return out


# Settings no decision depends on: where the process listens and with what credentials, how it logs,
# what its debug endpoint keeps, its transport's channels, and where its decision log goes; and the
# seed, whose draws a log records and a replay takes from it. The children of ``--processes N``
# differ in some (each its own debug port, log file and seed), and so may two runs whose logs are
# replayed together.
_OPERATIONAL_SECTIONS = frozenset({"serve", "metrics", "grpc_tls", "upstream_tls", "channel_pool"})
_OPERATIONAL_SETTINGS = frozenset(
    {"decision_log", "decision_log_max_bytes", "decision_log_files", "decision_log_inbox_size", "scorer_seed"}
)


def config_digest(config: KvrouteConfig) -> str:
    """A short digest of the value of every setting decisions depend on: two configurations that
    decide alike share it, wherever they listen, log or write their decision log."""
    decisive = {
        s.name: s.format(value_of(config, s.name))
        for s in SETTINGS
        if s.section not in _OPERATIONAL_SECTIONS and s.name not in _OPERATIONAL_SETTINGS
    }
    text = json.dumps(decisive, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
