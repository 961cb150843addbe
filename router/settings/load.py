"""Loading: defaults < TOML file < environment < command line, with the origin of every value.

:func:`resolve_config` is pure (the file's parsed contents, the environment and the flags in, a
:class:`LoadedConfig` out); :func:`read_config_file` is the one piece of I/O, and :func:`load_config`
/ :func:`load_from_args` read the file and resolve. Nothing here raises on bad input: an unreadable
file, a bad value or a broken rule is a problem in ``errors``. Fail-soft: problems confined to the
KVCM fallback part turn the fallback off in :attr:`LoadedConfig.effective` (domain routing) instead
of stopping the process.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from router.config import KvrouteConfig
from router.files import open_regular_file
from router.settings.table import (
    BY_NAME,
    BY_TOML_KEY,
    CONFIG_ENV,
    DEFAULT_ORIGIN,
    ENV_PREFIX,
    SECTIONS,
    SETTINGS,
    Origin,
    Setting,
    SettingValueError,
    SourceKind,
    value_of,
)
from router.settings.validate import FileChecks, SettingProblem, validate
from router.transport.tls import ca_bundle_problem, cert_key_problem, pem_file_problem

# A settings file is a few kilobytes; anything far larger is not one (and is not read into memory).
MAX_CONFIG_FILE_BYTES = 1 << 20


# A bearer token is a line of text; a larger file is not a token file (and is not read into memory).
MAX_TOKEN_FILE_BYTES = 4096


class TokenFileError(ValueError):
    """The debug token file cannot be used; the message says why (never the token)."""


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped). Reads the file; raises TokenFileError."""
    try:
        with open_regular_file(path) as file:
            raw = file.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise TokenFileError(f"cannot read the file: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise TokenFileError(f"larger than {MAX_TOKEN_FILE_BYTES} bytes: not a token file")
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise TokenFileError("the token must be printable ASCII") from None
    if not token or not all("!" <= c <= "~" for c in token):
        raise TokenFileError("must hold one token: printable ASCII without spaces")
    return token


def token_file_problem(path: str) -> str | None:
    """Why ``path`` is not a usable token file (None when it is). Reads the file."""
    try:
        read_token_file(path)
    except TokenFileError as exc:
        return str(exc)
    return None


# What a configuration loaded to run with is checked against: the files it names exist and fit.
FILE_CHECKS = FileChecks(
    pem=pem_file_problem, token=token_file_problem, cert_key=cert_key_problem, ca_bundle=ca_bundle_problem
)


@dataclass(frozen=True, slots=True)
class SupervisedProcess:
    """This process is one of the children a ``serve --processes N`` parent runs: it serves as one
    process (its own ``processes`` is 1), and the debug views say which of the N it is."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"process {self.index} of {self.count} (serve --processes {self.count})"


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    config: KvrouteConfig  # as given (may hold invalid values when there are errors)
    effective: KvrouteConfig  # fail-soft: invalid fallback settings → defaults and kvcm_fallback off
    sources: Mapping[str, Origin]  # setting name → where its value came from
    errors: tuple[SettingProblem, ...]
    warnings: tuple[str, ...]
    config_path: str | None
    supervised: SupervisedProcess | None = None  # set by serve in a supervising parent's child

    @property
    def fallback_errors(self) -> tuple[SettingProblem, ...]:
        return tuple(p for p in self.errors if p.fallback)

    @property
    def fatal_errors(self) -> tuple[SettingProblem, ...]:
        """Problems outside the KVCM fallback: kvroute cannot start with them."""
        return tuple(p for p in self.errors if not p.fallback)

    @property
    def fallback_disabled_by_errors(self) -> bool:
        return self.config.router.kvcm_fallback and bool(self.fallback_errors)

    def value(self, name: str) -> object:
        """The effective value of a setting by name."""
        return value_of(self.effective, name)


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """A TOML settings file as read: its tables, or why it could not be used (then ``tables`` is empty)."""

    path: str
    tables: Mapping[str, object]
    problems: tuple[SettingProblem, ...] = ()


def read_config_file(path: str, named_by: str = "--config") -> ConfigFile:
    """Read and parse ``path`` (I/O). Never raises: whatever makes it unusable is a problem naming it
    and what named it (``named_by``: the flag, or the environment variable)."""

    def unusable(why: str) -> ConfigFile:
        return ConfigFile(path, {}, (SettingProblem((), f"{named_by} {path}: {why}", False),))

    try:
        with open_regular_file(path) as file:
            raw = file.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as exc:
        return unusable(f"cannot read the file: {exc.strerror or exc}")
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        return unusable(f"larger than {MAX_CONFIG_FILE_BYTES} bytes: not a settings file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return unusable(f"not UTF-8 text (byte {exc.start}: {raw[exc.start : exc.start + 1]!r}); TOML files are UTF-8")
    try:
        return ConfigFile(path, tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        return unusable(f"not valid TOML: {exc}")
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        return unusable("not a settings file: arrays or tables nested too deeply for the TOML parser")
    except ValueError as exc:  # tomllib lets int()'s digit limit through as a plain ValueError
        return unusable(f"not a settings file: {exc}")


def config_path(flags: Mapping[str, object], env: Mapping[str, str]) -> str | None:
    """The settings file to read: ``--config``, else ``KVROUTE_CONFIG``, else none. ``--config=`` (given,
    empty) reads none, whatever the environment names."""
    given = flags.get("config")
    if isinstance(given, str):
        return given or None
    return env.get(CONFIG_ENV) or None


def _toml_values(path: str, data: Mapping[str, object]) -> Iterator[tuple[Setting | None, object, str]]:
    """(setting or None if unknown, value, "file [section] key") for every key of the file."""
    for section, table in data.items():
        if not isinstance(table, dict):
            continue  # not a table of settings: _misplaced says what it is
        for key, value in table.items():
            yield BY_TOML_KEY.get(f"{section}.{key}"), value, f"{path} [{section}] {key}"


def _misplaced(path: str, data: Mapping[str, object]) -> Iterator[str]:
    """A problem for each top-level key of the file that is not a table of settings. A section's name
    written as an array of tables (``[[router]]``) or given a value was once an "unknown setting" whose
    message listed that very section among the valid ones."""
    for section, table in data.items():
        if isinstance(table, dict):
            continue
        if section in SECTIONS:
            form = f"an array of tables ([[{section}]])" if isinstance(table, list) else "a value"
            yield f"{path}: [{section}] must be a table of settings ([{section}], then key = value lines), not {form}"
        else:
            yield (
                f"unknown setting {path}: top-level key {section!r} (settings live in [section] tables: "
                f"{', '.join(SECTIONS)})"
            )


def _from(origin: Origin) -> str:
    return "the default" if origin.kind is SourceKind.DEFAULT else f"from {origin}"


def resolve_config(
    file: ConfigFile | None,
    env: Mapping[str, str],
    flags: Mapping[str, object],
    files: FileChecks | None = None,
    *,
    flags_given_as: Mapping[str, str] | None = None,
) -> LoadedConfig:
    """Pure: the configuration from defaults < ``file`` < ``env`` < ``flags``, validated.

    ``flags`` maps setting name → value (text as on the command line, or a value of the setting's
    type); None or absent means not given. ``files`` checks the files the settings name (see
    :func:`~router.settings.validate.validate`). ``flags_given_as``: per setting name, the option its
    value was given with where that is not the setting's own flag (``--router-setting``), so a problem
    names what the operator typed. Every problem is in ``errors``.
    """
    values: dict[str, object] = {s.name: s.default for s in SETTINGS}
    sources: dict[str, Origin] = {s.name: DEFAULT_ORIGIN for s in SETTINGS}
    problems: list[SettingProblem] = []
    warnings: list[str] = []

    # A value that does not parse is a problem unless a source of higher precedence gives the setting
    # a value of its own: then the bad one is not used, and only a warning says so.
    unparsed: dict[str, list[SettingProblem]] = {}

    def take(s: Setting, raw: object, origin: Origin) -> None:
        try:
            parsed = s.parse_value(raw)
        except SettingValueError as exc:
            problem = SettingProblem((s.name,), f"{exc} ({_from(origin)})", s.fallback_part)
            earlier = unparsed.setdefault(s.name, [])
            # A bad value above another bad one: that one is not used either.
            warnings.extend(f"{e}: not used, {origin} is given above it" for e in earlier)
            unparsed[s.name] = [problem]
            return
        values[s.name] = parsed
        sources[s.name] = origin
        warnings.extend(f"{e}: not used, {origin} wins" for e in unparsed.pop(s.name, []))

    if file is not None:
        problems.extend(file.problems)
        problems.extend(SettingProblem((), message, False) for message in _misplaced(file.path, file.tables))
        for setting, value, where in _toml_values(file.path, file.tables):
            if setting is None:
                problems.append(SettingProblem((), f"unknown setting {where}", False))
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
        raw = flags.get(s.name)
        if raw is not None:
            given_as = flags_given_as.get(s.name) if flags_given_as is not None else None
            take(s, raw, Origin(SourceKind.FLAG, given_as or s.flag))

    problems.extend(p for listed in unparsed.values() for p in listed)
    config = _assemble(values)
    problems.extend(validate(config, sources, files))
    effective = _fail_soft(config, problems)
    if effective is not config:
        # Resetting the fallback part can expose a problem the given values hid (a list parsed only
        # once its port is valid): what would stop kvroute must be listed too.
        listed = {p.settings for p in problems}
        problems.extend(
            p for p in validate(effective, sources, files) if not p.fallback and p.settings not in listed
        )
    return LoadedConfig(
        config=config,
        effective=effective,
        sources=sources,
        errors=tuple(problems),
        warnings=tuple(warnings),
        config_path=None if file is None else file.path,
    )


def load_config(
    cli: argparse.Namespace | Mapping[str, object],
    env: Mapping[str, str],
    toml_path: str | None = None,
    *,
    flags_given_as: Mapping[str, str] | None = None,
) -> LoadedConfig:
    """Read the settings file (I/O) and :func:`resolve_config` it with ``env`` and ``cli``.

    ``cli`` is an argparse namespace made by :func:`~router.settings.add_arguments`, or a mapping of
    setting name → value. ``toml_path`` None falls back to ``--config`` in ``cli``, then
    ``env["KVROUTE_CONFIG"]``. The files the settings name (TLS, the debug token) are checked too.
    Never raises on bad input: every problem is in ``errors``.
    """
    flags = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli)
    path = toml_path if toml_path is not None else config_path(flags, env)
    named_by = CONFIG_ENV if toml_path is None and path and not flags.get("config") else "--config"
    file = read_config_file(path, named_by) if path else None
    loaded = resolve_config(file, env, flags, FILE_CHECKS, flags_given_as=flags_given_as)
    if isinstance(cli, argparse.Namespace):
        return loaded  # a namespace also carries the command's own arguments
    # A mapping names settings only: a misspelt name must not be ignored silently.
    unknown = tuple(
        SettingProblem((), f"unknown setting {name!r}", False)
        for name in flags
        if name not in BY_NAME and name != "config"
    )
    return replace(loaded, errors=unknown + loaded.errors) if unknown else loaded


def given_in_code(config: KvrouteConfig) -> LoadedConfig:
    """The loaded form of a configuration an embedder built in code: the values as given (those not at
    their default attributed to the code), with no file behind them and no problems found in loading."""
    sources = {
        s.name: DEFAULT_ORIGIN if value_of(config, s.name) == s.default else Origin(SourceKind.CODE)
        for s in SETTINGS
    }
    return LoadedConfig(config, config, sources, (), (), None)


def load_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> LoadedConfig:
    """load_config for a namespace made by add_arguments (``--config`` included); env: os.environ."""
    return load_config(args, os.environ if env is None else env)


def _assemble(values: Mapping[str, object]) -> KvrouteConfig:
    hints = typing.get_type_hints(KvrouteConfig)
    sections: dict[str, Any] = {}
    for section in SECTIONS:
        fields = {s.field: values[s.name] for s in SETTINGS if s.section == section}
        sections[section] = hints[section](**fields)
    return KvrouteConfig(**sections)


def _fail_soft(config: KvrouteConfig, problems: Iterable[SettingProblem]) -> KvrouteConfig:
    """Invalid fallback settings go back to their (valid) defaults and the fallback is switched off.

    Only settings of the fallback part are reset: a main-path setting named in the same problem
    (e.g. --discovery-max-entries beside --kvcm-bootstrap) keeps its value.
    """
    if not any(p.fallback for p in problems):
        return config
    values = {s.name: value_of(config, s.name) for s in SETTINGS}
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
