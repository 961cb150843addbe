"""What is shown of a configuration: redacted values, their sources, and the problems."""

from __future__ import annotations

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
