"""Settings: one definition per setting, loaded from defaults < TOML file < environment < flags.

The package, by what each part does:

- ``table``: the settings table, generated from the dataclasses in ``router/config.py`` (flag, env
  var, TOML key, default, range, help); pure.
- ``validate``: every problem with a configuration at once, collected from each component's own
  ``*_problems`` check and rendered with flags and env vars; pure.
- ``load``: :func:`resolve_config` (pure) and the file-reading wrappers :func:`load_config` /
  :func:`load_from_args`, with fail-soft for the KVCM fallback.
- ``cli_args``: argparse options generated from the table, and :func:`load_or_report` for commands.
- ``redact``: what ``/debug/config`` shows; ``assess``: what will and will not work, and the
  startup log report.
"""

from __future__ import annotations

from router.logs import LOG_FORMATS, LOG_LEVELS
from router.settings.assess import Assessment, assess, log_startup_report
from router.settings.cli_args import add_arguments, load_or_report
from router.settings.load import (
    FILE_CHECKS,
    MAX_CONFIG_FILE_BYTES,
    ConfigFile,
    LoadedConfig,
    SupervisedProcess,
    TokenFileError,
    config_path,
    given_in_code,
    load_config,
    load_from_args,
    read_config_file,
    read_token_file,
    resolve_config,
)
from router.settings.redact import debug_config_view, redacted
from router.settings.table import (
    BY_NAME,
    BY_TOML_KEY,
    CONFIG_ENV,
    DEFAULT_ORIGIN,
    ENV_PREFIX,
    ROUTER_SETTING_OPTION,
    SECTIONS,
    SETTINGS,
    Check,
    Kind,
    Origin,
    Setting,
    SettingValueError,
    SourceKind,
    is_secret_field,
    parse_listen,
    value_of,
    with_value,
)
from router.settings.validate import (
    SECTION_PROBLEMS,
    FileChecks,
    SettingProblem,
    section_problems,
    section_type_problems,
    validate,
)

__all__ = [
    "BY_NAME",
    "BY_TOML_KEY",
    "CONFIG_ENV",
    "DEFAULT_ORIGIN",
    "ENV_PREFIX",
    "FILE_CHECKS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_CONFIG_FILE_BYTES",
    "ROUTER_SETTING_OPTION",
    "SECTIONS",
    "SECTION_PROBLEMS",
    "SETTINGS",
    "Assessment",
    "Check",
    "ConfigFile",
    "FileChecks",
    "Kind",
    "LoadedConfig",
    "Origin",
    "Setting",
    "SettingProblem",
    "SettingValueError",
    "SourceKind",
    "SupervisedProcess",
    "TokenFileError",
    "add_arguments",
    "assess",
    "config_path",
    "debug_config_view",
    "given_in_code",
    "is_secret_field",
    "load_config",
    "load_from_args",
    "load_or_report",
    "log_startup_report",
    "parse_listen",
    "read_config_file",
    "read_token_file",
    "redacted",
    "resolve_config",
    "section_problems",
    "section_type_problems",
    "validate",
    "value_of",
    "with_value",
]
