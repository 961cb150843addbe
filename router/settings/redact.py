"""What is shown of a configuration: redacted values, their sources, and the problems."""

from __future__ import annotations

import hashlib
import json

from router.config import KvrouteConfig
from router.settings.load import LoadedConfig
from router.settings.table import SECTIONS, SETTINGS, value_of


def redacted(config: KvrouteConfig) -> dict[str, dict[str, object]]:
    """The config as JSON-ready ``{section: {field: value}}``; fields named like secrets are masked."""
    out: dict[str, dict[str, object]] = {section: {} for section in SECTIONS}
    for s in SETTINGS:
        value = value_of(config, s.name)
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


def non_default_settings(config: KvrouteConfig) -> dict[str, str]:
    """Setting name → text (as on the command line) for every setting not at its default; secrets masked."""
    out: dict[str, str] = {}
    for s in SETTINGS:
        value = value_of(config, s.name)
        if value != s.default:
            out[s.name] = "<redacted>" if s.secret else s.format(value)
    return out


def config_digest(config: KvrouteConfig) -> str:
    """A short digest of every setting's value: two configurations that decide alike share it."""
    text = json.dumps({s.name: s.format(value_of(config, s.name)) for s in SETTINGS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
