"""The settings table: generated from the config dataclasses; all sources; all problems at once; fail-soft."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
import typing
from pathlib import Path

import pytest
import trio
from hypothesis import example, given
from hypothesis import settings as settings_profile
from hypothesis import strategies as st

from router import request, settings
from router.cli import WholeNamesHelpFormatter
from router.config import KvrouteConfig
from router.problems import bounded
from router.settings import (
    BY_NAME,
    SETTINGS,
    Kind,
    Setting,
    SourceKind,
    add_arguments,
    assess,
    load_config,
    load_from_args,
    redacted,
)
from router.settings.load import MAX_TOKEN_FILE_BYTES
from router.types import KeyFamily, QueryType, Role

# A configuration on which everything validates, as flags.
GOOD = {
    "kvcm_bootstrap": "10.0.0.1:6381,10.0.0.2",
    "kvcm_instance_id": "llama_64",
    "workers": "10.1.0.1:8000,10.1.0.2:8000",
}


class _Closable:
    """A channel for a pool that opens none here."""

    def close(self) -> None:
        pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute-test", formatter_class=WholeNamesHelpFormatter)  # as kvroute's
    add_arguments(parser)
    return parser


def _names(problems: typing.Iterable[settings.SettingProblem]) -> set[tuple[str, ...]]:
    return {p.settings for p in problems}


# --- the definition walk ----------------------------------------------------------------------


def test_every_setting_has_flag_env_help_and_a_valid_or_required_default() -> None:
    for s in SETTINGS:
        assert s.flag == "--" + s.name.replace("_", "-")
        assert s.env == "KVROUTE_" + s.name.upper()
        assert s.help.strip(), f"{s.toml_key}: add its help text to router/settings/table.py _SPECS"
        assert s.env in s.help_text() and s.toml_key in s.help_text()
        if s.required_when is None:
            assert s.validate(s.default) == [], s.toml_key
        else:
            assert BY_NAME[s.required_when].kind is Kind.BOOL
            assert f"required when --{s.required_when.replace('_', '-')} is on" in s.help_text()
        # The default survives its own text form (what --help shows is what would be parsed).
        assert s.parse_text(s.format(s.default)) == s.default, s.toml_key


def test_every_config_field_is_exactly_one_setting_with_the_dataclass_default() -> None:
    hints = typing.get_type_hints(KvrouteConfig)
    whole = KvrouteConfig()  # a section's defaults as the whole config's factory makes them
    fields = [
        (section.name, f.name, getattr(getattr(whole, section.name), f.name))
        for section in dataclasses.fields(KvrouteConfig)
        for f in dataclasses.fields(hints[section.name])
    ]
    assert len(SETTINGS) == len(fields)
    for section, field, default in fields:
        matching = [s for s in SETTINGS if (s.section, s.field) == (section, field)]
        assert len(matching) == 1, f"{section}.{field}"
        assert matching[0].default == default
    assert load_config({}, {}).config == KvrouteConfig()


def test_names_flags_and_env_vars_never_collide() -> None:
    for attribute in ("name", "flag", "env", "toml_key"):
        values = [getattr(s, attribute) for s in SETTINGS]
        assert len(values) == len(set(values)), attribute
    assert "--config" not in {s.flag for s in SETTINGS}


def test_pinned_operator_names() -> None:
    pinned = {
        "--kvcm-bootstrap": "discovery.kvcm_bootstrap",
        "--kvcm-instance-id": "deployment.kvcm_instance_id",
        "--workers": "discovery.workers",
        "--block-size": "deployment.block_size",
        "--key-family": "deployment.key_family",
        "--query-type": "deployment.query_type",
        "--roles": "deployment.roles",
        "--budget-cap-ms": "router.budget_cap_ms",
        "--grpc-listen": "serve.grpc_listen",
        "--kvcm-fallback": "router.kvcm_fallback",
        "--debug-listen": "serve.debug_listen",
        "--log-level": "serve.log_level",
        "--log-format": "serve.log_format",
        "--prober-inflight-cap": "prober.inflight_cap",
    }
    by_flag = {s.flag: s.toml_key for s in SETTINGS}
    for flag, key in pinned.items():
        assert by_flag[flag] == key
    assert BY_NAME["kvcm_bootstrap"].env == "KVROUTE_KVCM_BOOTSTRAP"
    assert BY_NAME["debug_listen"].default == "127.0.0.1:0"
    # One KVCM instance id setting, not two.
    assert [s.toml_key for s in SETTINGS if "instance_id" in s.field] == ["deployment.kvcm_instance_id"]


_README = Path(__file__).resolve().parents[1] / "README.md"
# README's sections about settings: every flag they name is a setting's (the others name commands' own).
_SETTINGS_SECTIONS = (
    "### `kvroute serve`",
    "### Request bounds and the reply margin",
    "## Debug endpoints",
    "## Security",
    "## Readiness and dead workers",
)
_BACKTICKED_FLAG = re.compile(r"`(--[a-z0-9][a-z0-9-]*)(\*?)[^`]*`")


def _readme_sections(headings: typing.Iterable[str]) -> str:
    wanted = set(headings)
    kept: list[str] = []
    keep = False
    for line in _README.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            keep = line in wanted
            wanted.discard(line)
        elif keep:
            kept.append(line)
    assert not wanted, f"README.md has no section {sorted(wanted)}"
    return "\n".join(kept)


def test_the_flags_readme_and_refused_requests_name_are_settings() -> None:
    """An operator types the flag README or a refused request names: --max-prompt-tokens (not
    --limits-max-prompt-tokens), --reply-margin-ms (not --router-reply-margin-ms)."""
    flags = {s.flag for s in SETTINGS}
    in_readme = {m[1] + m[2] for m in _BACKTICKED_FLAG.finditer(_readme_sections(_SETTINGS_SECTIONS))}
    assert {"--max-prompt-tokens", "--reply-margin-ms", "--grpc-tls-cert"} <= in_readme  # the parse found them
    for named in sorted(in_readme - {"--config"}):
        if named.endswith("*"):  # a family: --master-breaker-*
            assert any(flag.startswith(named[:-1]) for flag in flags), named
        else:
            assert named in flags, f"README.md names {named}, which is no setting's flag"
    in_request = set(re.findall(r"\((--[a-z0-9-]+)\)", Path(request.__file__).read_text(encoding="utf-8")))
    assert "--max-prompt-tokens" in in_request
    assert in_request <= flags, in_request - flags


# "`--flag` (default 2,048", "`--flag N` (4 MiB)": a default README states, in its unit.
_STATED_DEFAULT = re.compile(r"`(--[a-z0-9-]+)(?: [A-Z]+)?` \((?:default )?([0-9][0-9,]*)( MiB| %| ms| s)?[),;: ]")
_UNIT = {"": 1.0, " ms": 1.0, " s": 1.0, " MiB": 1024.0 * 1024.0, " %": 0.01}


def test_the_defaults_readme_states_are_the_settings_defaults() -> None:
    by_flag = {s.flag: s for s in SETTINGS}
    stated: list[tuple[str, float]] = []
    for m in _STATED_DEFAULT.finditer(_README.read_text(encoding="utf-8")):
        if m[1] in by_flag:  # a command's own flag (--warmup-ms) is no setting
            stated.append((m[1], float(m[2].replace(",", "")) * _UNIT[m[3] or ""]))
    # The request bounds table: "| `token_ids` | 262,144 token ids | `--max-prompt-tokens` |".
    for row in _readme_sections(["### Request bounds and the reply margin"]).splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        bound = re.match(r"[0-9][0-9,]*", cells[1]) if len(cells) == 3 else None
        if bound is not None and cells[2].startswith("`--"):
            stated.append((cells[2].strip("`"), float(bound[0].replace(",", ""))))
    assert len({flag for flag, _ in stated}) >= 10, stated  # the parse found them
    for flag, value in stated:
        default = by_flag[flag].default
        assert isinstance(default, int | float)
        assert math.isclose(value, default), f"README.md says {flag} defaults to {value}, the table {default}"


# --- sources and parsing ----------------------------------------------------------------------


def test_precedence_defaults_file_env_flags_and_the_source_of_each(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text(
        '[deployment]\nblock_size = 32\nkvcm_instance_id = "from_file"\n'
        '[prober]\ninflight_cap = 16\n[discovery]\nworkers = "10.0.0.9:80"\n'
    )
    env = {"KVROUTE_BLOCK_SIZE": "48", "KVROUTE_PROBER_INFLIGHT_CAP": "8"}
    loaded = load_config({"block_size": "128"}, env, str(toml))
    c = loaded.config
    assert c.deployment.block_size == 128  # flag beats env beats file
    assert c.prober.inflight_cap == 8  # env beats file
    assert c.deployment.kvcm_instance_id == "from_file"
    assert c.discovery.workers == "10.0.0.9:80"
    assert c.scorer.hot_set_size == KvrouteConfig().scorer.hot_set_size
    assert loaded.sources["block_size"] == settings.Origin(SourceKind.FLAG, "--block-size")
    assert loaded.sources["prober_inflight_cap"] == settings.Origin(
        SourceKind.ENV, "KVROUTE_PROBER_INFLIGHT_CAP"
    )
    assert loaded.sources["kvcm_instance_id"].kind is SourceKind.FILE
    assert str(toml) in str(loaded.sources["kvcm_instance_id"])
    assert loaded.sources["scorer_hot_set_size"] is settings.DEFAULT_ORIGIN
    assert loaded.config_path == str(toml)


def test_config_path_from_env_when_no_flag(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text("[deployment]\nblock_size = 16\n")
    loaded = load_config({}, {"KVROUTE_CONFIG": str(toml)})
    assert loaded.config.deployment.block_size == 16
    assert loaded.warnings == ()  # KVROUTE_CONFIG is kvroute's own variable, though no setting
    # --config= given empty reads no file, whatever the environment names.
    none = load_config({"config": ""}, {"KVROUTE_CONFIG": str(toml)})
    assert none.config_path is None and none.config.deployment.block_size != 16


def test_an_enum_word_in_any_case_is_accepted_for_the_log_settings() -> None:
    loaded = load_config({**GOOD, "log_format": "JSON", "log_level": "debug"}, {})
    assert loaded.errors == ()


@pytest.mark.parametrize(
    ("word", "value"),
    [
        ("true", True),
        ("1", True),
        ("YES", True),
        ("on", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("Off", False),
    ],
)
def test_boolean_words(word: str, value: bool) -> None:
    assert load_config({"kvcm_fallback": word}, {}).config.router.kvcm_fallback is value
    assert load_config({}, {"KVROUTE_KVCM_FALLBACK": word}).config.router.kvcm_fallback is value


def test_boolean_garbage_is_rejected_naming_flag_and_env() -> None:
    loaded = load_config({}, {"KVROUTE_KVCM_FALLBACK": "maybe"})
    assert [str(p) for p in loaded.errors if p.settings == ("kvcm_fallback",)] == [
        "--kvcm-fallback (KVROUTE_KVCM_FALLBACK): expected true/false/1/0/yes/no/on/off, got 'maybe' "
        "(from env KVROUTE_KVCM_FALLBACK)"
    ]


def test_bare_boolean_flag_means_true_and_argparse_keeps_text_for_load_config() -> None:
    args = _parser().parse_args(["--kvcm-fallback", "--block-size", "x"])
    assert args.kvcm_fallback == "true"
    loaded = load_from_args(args, env={})
    assert loaded.config.router.kvcm_fallback is True
    assert ("block_size",) in _names(loaded.errors)  # argparse did not stop at the bad value


def test_an_empty_boolean_is_refused_not_taken_for_a_word() -> None:
    loaded = load_config(GOOD, {"KVROUTE_KVCM_FALLBACK": ""})
    [problem] = [str(p) for p in loaded.errors]
    assert problem.startswith("--kvcm-fallback (KVROUTE_KVCM_FALLBACK): expected true/false"), problem


def test_text_is_stripped_and_an_integer_is_decimal() -> None:
    assert load_config({**GOOD, "kvcm_instance_id": " ns "}, {}).config.deployment.kvcm_instance_id == "ns"
    assert load_config({**GOOD, "block_size": "010"}, {}).config.deployment.block_size == 10  # not octal
    hexadecimal = load_config({**GOOD, "block_size": "0x40"}, {})
    [problem] = [str(p) for p in hexadecimal.errors]
    assert problem.startswith("--block-size (KVROUTE_BLOCK_SIZE): expected an integer, got '0x40'"), problem


def test_a_toml_boolean_is_no_number(tmp_path: Path) -> None:
    """``budget_cap_ms = true`` is a mistake, not a budget cap of 1 ms."""
    toml = tmp_path / "kv.toml"
    toml.write_text("[router]\nbudget_cap_ms = true\n")
    loaded = load_config(GOOD, {}, str(toml))
    [problem] = [str(p) for p in loaded.errors]
    assert problem.startswith("--budget-cap-ms (KVROUTE_BUDGET_CAP_MS): expected a number"), problem
    assert loaded.config.router.budget_cap_ms == KvrouteConfig().router.budget_cap_ms


def test_enums_and_tuples() -> None:
    loaded = load_config(
        {"query_type": "prefix-with-mamba", "key_family": "VLLM", "roles": "pdfusion, PREFILL,PDFUSION"}, {}
    )
    d = loaded.config.deployment
    assert d.query_type is QueryType.PREFIX_MATCH_WITH_MAMBA
    assert d.key_family is KeyFamily.VLLM
    assert d.roles == (Role.PDFUSION, Role.PREFILL)
    assert load_config({"query_type": "prefix"}, {}).config.deployment.query_type is QueryType.PREFIX_MATCH
    assert load_config({"roles": "PREFILL,DECODE"}, {}).config.deployment.roles == (Role.PREFILL, Role.DECODE)
    bad = load_config({"query_type": "batch", "roles": "PREFILL,GPU", "key_family": "md5"}, {})
    messages = {p.settings: p.message for p in bad.errors}
    assert messages[("query_type",)].startswith("expected prefix|prefix-with-mamba, got 'batch'")
    assert messages[("roles",)].startswith("expected PREFILL|PDFUSION|DECODE|VIT (comma list), got 'GPU'")
    decode_only = {p.settings: p.message for p in load_config({"roles": "DECODE"}, {}).errors}
    assert "prefill-capable" in decode_only[("roles",)]
    assert messages[("key_family",)].startswith("expected rtp|vllm|sglang, got 'md5'")
    assert ("roles",) in _names(load_config({"roles": ""}, {}).errors)  # empty list: must not be empty


def test_toml_natives_lists_and_type_errors(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text(
        '[deployment]\nroles = ["PREFILL", "PDFUSION"]\nblock_size = "64"\n'
        "[router]\nkvcm_fallback = false\nbudget_cap_ms = 20\n"
        '[prober]\ninflight_cap = true\nrate_per_s = "fast"\n'
        "[nosuch]\nx = 1\n[scorer]\nhot_set = 3\n"
    )
    loaded = load_config({}, {}, str(toml))
    c = loaded.config
    assert c.deployment.roles == (Role.PREFILL, Role.PDFUSION)
    assert c.deployment.block_size == 64
    assert c.router.kvcm_fallback is False
    assert c.router.budget_cap_ms == 20.0
    assert isinstance(c.router.budget_cap_ms, float)
    errors = [str(p) for p in loaded.errors]
    assert any(
        e.startswith("--prober-inflight-cap (KVROUTE_PROBER_INFLIGHT_CAP): expected an integer")
        for e in errors
    )
    assert any(
        e.startswith("--prober-rate-per-s (KVROUTE_PROBER_RATE_PER_S): expected a number") for e in errors
    )
    assert any("unknown setting" in e and "[nosuch] x" in e for e in errors)
    assert any("unknown setting" in e and "[scorer] hot_set" in e for e in errors)
    assert len(errors) == 4


def test_a_misspelt_toml_key_stops_kvroute_and_leaves_the_fallback_on(tmp_path: Path) -> None:
    """A misspelt key is no fallback problem: as one it would switch the KVCM fallback off for a typo
    while the setting meant kept its default, and kvroute would start."""
    toml = tmp_path / "kv.toml"
    toml.write_text("[scorer]\nhot_set = 3\n")
    loaded = load_config(GOOD, {}, str(toml))
    assert [str(p) for p in loaded.fatal_errors] == [f"unknown setting {toml} [scorer] hot_set"]
    assert loaded.fallback_errors == ()
    assert loaded.effective.router.kvcm_fallback is True


def test_an_empty_environment_variable_is_a_value_above_the_file(tmp_path: Path) -> None:
    """An environment variable set to "" gives the setting "": it is not taken as unset."""
    toml = tmp_path / "kv.toml"
    toml.write_text('[deployment]\nkvcm_instance_id = "x"\n')
    flags = {name: value for name, value in GOOD.items() if name != "kvcm_instance_id"}
    loaded = load_config(flags, {"KVROUTE_KVCM_INSTANCE_ID": ""}, str(toml))
    assert loaded.config.deployment.kvcm_instance_id == ""
    assert loaded.sources["kvcm_instance_id"] == settings.Origin(SourceKind.ENV, "KVROUTE_KVCM_INSTANCE_ID")
    assert ("kvcm_instance_id",) in _names(loaded.fallback_errors)  # "" is what validation judges


def test_unreadable_and_malformed_files_are_problems_not_crashes(tmp_path: Path) -> None:
    missing = load_config({}, {}, str(tmp_path / "absent.toml"))
    assert any("cannot read the file" in str(p) for p in missing.fatal_errors)
    broken = tmp_path / "broken.toml"
    broken.write_text("[deployment\nblock_size = ")
    assert any("not valid TOML" in str(p) for p in load_config({}, {}, str(broken)).fatal_errors)
    nested = tmp_path / "nested.toml"  # tomllib recurses, and raised RecursionError out of loading
    nested.write_text("a = " + "[" * 5000 + "]" * 5000)
    assert any("nested too deeply" in str(p) for p in load_config({}, {}, str(nested)).fatal_errors)
    digits = tmp_path / "digits.toml"  # past int()'s digit limit tomllib raises a plain ValueError
    digits.write_text("[router]\nmax_in_flight = " + "9" * 5000 + "\n")
    assert any("digits" in str(p) for p in load_config({}, {}, str(digits)).fatal_errors)


def test_numbers_beyond_any_float_or_too_long_to_print_are_named_by_their_size(tmp_path: Path) -> None:
    """An integer too large for a float setting, or too long for a message, is a problem naming the
    setting and the integer's size, not an OverflowError or a digit-limit ValueError out of loading."""
    huge = tmp_path / "huge.toml"
    huge.write_text("[router]\nbudget_cap_ms = 1" + "0" * 400 + "\n")
    problems = [str(p) for p in load_config({}, {}, str(huge)).errors if "budget" in str(p)]
    assert problems and "an integer of 1329 bits, beyond any float" in problems[0]
    too_long = [str(p) for p in load_config({"block_size": 10**5000}, {}).errors if "block-size" in str(p)]
    assert too_long and "must be <= 65536, got an integer of 16610 bits" in too_long[0]


def test_help_says_one_bootstrap_source_is_enough_and_the_instance_id_is_required() -> None:
    """All three bootstrap settings said "[required when --kvcm-fallback is on]", as if each one were
    required; validation asks for one of them."""
    either = (
        "[one of --kvcm-bootstrap, --kvcm-bootstrap-file, --kvcm-bootstrap-dns required when --kvcm-fallback is on]"
    )
    for name in ("kvcm_bootstrap", "kvcm_bootstrap_file", "kvcm_bootstrap_dns"):
        assert either in settings.BY_NAME[name].help_text()
    alone = settings.BY_NAME["kvcm_instance_id"].help_text()
    assert "[required when --kvcm-fallback is on]" in alone and "one of" not in alone


def test_a_section_that_is_not_a_table_is_named_as_such(tmp_path: Path) -> None:
    """``[[router]]`` or ``router = 5`` was an "unknown setting" whose message listed router among the
    valid sections; a top-level key that is no section stays unknown."""
    toml = tmp_path / "kv.toml"
    toml.write_text("[[router]]\nkvcm_fallback = false\n[[router]]\nbudget_cap_ms = 20\n")
    (problem,) = [p for p in load_config({}, {}, str(toml)).errors if not p.settings]  # the file's own
    assert str(problem).endswith("[router] must be a table of settings ([router], then key = value lines), "
                                 "not an array of tables ([[router]])")
    toml.write_text("master = 5\nstray = 1\n")
    errors = sorted(str(p) for p in load_config({}, {}, str(toml)).errors if not p.settings)
    assert len(errors) == 2
    assert errors[0].endswith("[master] must be a table of settings ([master], then key = value lines), not a value")
    assert errors[1].startswith("unknown setting") and "top-level key 'stray'" in errors[1]


def test_unknown_kvroute_env_vars_are_warned_about() -> None:
    loaded = load_config(
        {}, {"KVROUTE_BLOK_SIZE": "64", "HOME": "/root", **{"KVROUTE_WORKERS": "1.1.1.1:80"}}
    )
    assert loaded.warnings == ("environment variable KVROUTE_BLOK_SIZE is not a kvroute setting (ignored)",)


# --- validation -------------------------------------------------------------------------------


def test_a_good_config_has_no_problems() -> None:
    loaded = load_config(GOOD, {})
    assert loaded.errors == ()
    assert loaded.effective == loaded.config
    assert loaded.effective.router.kvcm_fallback is True


def test_every_problem_is_reported_at_once_naming_flag_and_env() -> None:
    flags = {
        **GOOD,
        "block_size": "0",
        "budget_cap_ms": "-5",
        "kvcm_bootstrap": "10.0.0.1:99999,bad host",
        "debug_listen": "127.0.0.1",
        "log_format": "xml",
    }
    env = {"KVROUTE_PROBER_INFLIGHT_CAP": "0", "KVROUTE_BREAKER_FAILURE_RATE": "1.5"}
    loaded = load_config(flags, env)
    assert _names(loaded.errors) == {
        ("block_size",),
        ("budget_cap_ms",),
        ("kvcm_bootstrap",),
        ("debug_listen",),
        ("log_format",),
        ("prober_inflight_cap",),
        ("breaker_failure_rate",),
        ("router_reserve_min_ms", "budget_cap_ms"),
    }
    for problem in loaded.errors:
        for name in problem.settings:
            assert BY_NAME[name].flag in str(problem) and BY_NAME[name].env in str(problem)
    text = {p.settings: str(p) for p in loaded.errors}
    assert (
        text[("block_size",)]
        == "--block-size (KVROUTE_BLOCK_SIZE): must be > 0, got 0 (from flag --block-size)"
    )
    assert "out of range" in text[("kvcm_bootstrap",)] and "bad host" in text[("kvcm_bootstrap",)]
    assert "(from env KVROUTE_BREAKER_FAILURE_RATE)" in text[("breaker_failure_rate",)]


def test_a_bad_listen_address_with_port_zero_is_quoted_as_given() -> None:
    loaded = load_config({**GOOD, "debug_listen": "999.1.1.1:0", "grpc_listen": "a b:0"}, {})
    text = {p.settings: str(p) for p in loaded.errors}
    assert "'999.1.1.1:0'" in text[("debug_listen",)] and ":1'" not in text[("debug_listen",)]
    assert "'a b:0'" in text[("grpc_listen",)]


def test_a_bad_value_a_higher_source_overrides_is_a_warning_not_a_problem() -> None:
    overridden = load_config({**GOOD, "block_size": "32"}, {"KVROUTE_BLOCK_SIZE": "abc"})
    assert overridden.errors == ()
    assert overridden.effective.deployment.block_size == 32 and overridden.effective.router.kvcm_fallback
    assert overridden.warnings == (
        "--block-size (KVROUTE_BLOCK_SIZE): expected an integer, got 'abc' (from env KVROUTE_BLOCK_SIZE): "
        "not used, flag --block-size wins",
    )
    # The winning source's own bad value is still a problem, whatever a lower source said.
    bad_flag = load_config({**GOOD, "block_size": "abc"}, {"KVROUTE_BLOCK_SIZE": "32"})
    assert _names(bad_flag.errors) == {("block_size",)}
    assert "(from flag --block-size)" in str(bad_flag.errors[0])
    # Two bad values: the one given above is the problem, the other is said not to be used.
    both = load_config({**GOOD, "block_size": "xyz"}, {"KVROUTE_BLOCK_SIZE": "abc"})
    assert _names(both.errors) == {("block_size",)} and "'xyz'" in str(both.errors[0])
    assert len(both.warnings) == 1 and "'abc'" in both.warnings[0] and "is given above it" in both.warnings[0]


def test_a_vanishingly_small_duration_is_refused_before_it_divides_a_clock_into_infinity() -> None:
    tiny = load_config({**GOOD, "breaker_window_s": "1e-306"}, {})
    (problem,) = tiny.errors
    assert problem.settings == ("breaker_window_s",) and "too small to use" in str(problem)
    assert load_config({**GOOD, "breaker_window_s": "1e-9"}, {}).errors == ()
    assert load_config({**GOOD, "prober_max_ejected_fraction": "0"}, {}).errors == ()  # zero is not small


@pytest.mark.parametrize(
    ("grpc_listen", "debug_listen", "clash"),
    [
        ("0.0.0.0:7000", "127.0.0.1:7000", True),  # a wildcard holds the port on every address
        ("127.0.0.1:7000", "[::]:7000", True),
        ("0.0.0.0:7000", "[::]:7000", True),  # dual-stack: [::] takes IPv4 too
        ("[::]:7000", "[::1]:7000", True),  # and every IPv6 address
        ("0.0.0.0:7000", "[::1]:7000", False),  # IPv4's wildcard leaves IPv6 addresses free
        ("[::1]:7000", "0.0.0.0:7000", False),
        ("0.0.0.0:7000", "[::ffff:127.0.0.1]:7000", True),  # an IPv4-mapped address is IPv4's
        ("localhost:7000", "0.0.0.0:7000", True),  # a name may resolve to IPv4
        ("127.0.0.1:7000", "127.0.0.2:7000", False),  # two addresses, one port each
        ("0.0.0.0:7000", "0.0.0.0:7001", False),
        ("0.0.0.0:0", "0.0.0.0:0", False),  # any free port, each its own
    ],
)
def test_grpc_and_debug_listeners_may_not_take_one_address(grpc_listen: str, debug_listen: str, clash: bool) -> None:
    """Only the same address and port was refused: a wildcard beside a host on the same port passed
    check-config, then serve failed to bind. 0.0.0.0 beside an IPv6 address was refused,
    although both bind."""
    loaded = load_config({**GOOD, "grpc_listen": grpc_listen, "debug_listen": debug_listen}, {})
    assert (("grpc_listen", "debug_listen") in _names(loaded.errors)) is clash


def test_cross_field_checks() -> None:
    loaded = load_config(
        {
            **GOOD,
            "workers": "10.1.0.1",
            "leader_backoff_initial_s": "9",
            "grpc_listen": "127.0.0.1:7000",
            "debug_listen": "127.0.0.1:7000",
            "key_family": "sglang",
            "lookahead_tokens": "2",
        },
        {},
    )
    text = {p.settings: str(p) for p in loaded.errors}
    assert set(text) == {
        ("workers",),
        ("leader_backoff_initial_s", "leader_backoff_max_s"),
        ("grpc_listen", "debug_listen"),
        ("key_family", "lookahead_tokens"),
    }
    assert "set --worker-http-port" in text[("workers",)]
    with_port = load_config({**GOOD, "workers": "10.1.0.1", "worker_http_port": "8000"}, {})
    assert with_port.errors == ()
    too_many = load_config({**GOOD, "discovery_max_entries": "1"}, {})
    assert _names(too_many.errors) == {
        ("kvcm_bootstrap", "discovery_max_entries"),
        ("workers", "discovery_max_entries"),
    }
    # Fail-soft resets the fallback setting only; the main-path limit keeps its given value.
    boot_only = load_config({**GOOD, "workers": "10.1.0.1:80", "discovery_max_entries": "1"}, {})
    assert _names(boot_only.errors) == {("kvcm_bootstrap", "discovery_max_entries")}
    assert boot_only.effective.discovery.max_entries == 1
    assert boot_only.effective.discovery.kvcm_bootstrap == ""
    # Port 0 on both listeners is fine: the OS picks two ports.
    assert load_config({**GOOD, "grpc_listen": "127.0.0.1:0"}, {}).errors == ()


def test_a_decision_reserve_the_budget_cap_leaves_nothing_of_is_refused_naming_both() -> None:
    """The least time kept to decide comes out of the budget: a reserve as large as the cap leaves the
    sources none at all."""
    equal = load_config({**GOOD, "router_reserve_min_ms": "50", "budget_cap_ms": "50"}, {})
    (problem,) = equal.errors
    assert problem.settings == ("router_reserve_min_ms", "budget_cap_ms")
    assert "--router-reserve-min-ms" in str(problem) and "--budget-cap-ms" in str(problem)
    assert load_config({**GOOD, "router_reserve_min_ms": "49", "budget_cap_ms": "50"}, {}).errors == ()


def test_a_scheduler_window_the_budget_cap_leaves_nothing_of_is_refused_naming_both() -> None:
    never = load_config({**GOOD, "master_hosts": "10.0.0.9", "master_later_sources_ms": "50"}, {})
    (problem,) = never.errors
    assert problem.settings == ("master_later_sources_ms", "budget_cap_ms")
    assert "--master-later-sources-ms" in str(problem) and "never be asked" in str(problem)
    assert load_config({**GOOD, "master_hosts": "10.0.0.9", "master_later_sources_ms": "49"}, {}).errors == ()
    # Without a source after the scheduler nothing is kept for one.
    alone = {"kvcm_fallback": "off", "workers": "10.1.0.1:80", "master_hosts": "10.0.0.9"}
    assert load_config({**alone, "master_later_sources_ms": "50"}, {}).errors == ()


def test_a_breaker_trial_given_up_on_within_the_budget_cap_is_refused_naming_both() -> None:
    """A breaker's trial report names no trial: one given up on while its request still runs would
    report into the next trial. No request outlasts the budget cap, so the trial timeout must."""
    kvcm = load_config({**GOOD, "breaker_trial_timeout_s": "0.05", "budget_cap_ms": "50"}, {})
    (problem,) = kvcm.errors
    assert problem.settings == ("breaker_trial_timeout_s", "budget_cap_ms")
    assert "--breaker-trial-timeout-s" in str(problem) and "--budget-cap-ms" in str(problem)
    assert "KVCM breaker" in str(problem)
    assert load_config({**GOOD, "breaker_trial_timeout_s": "0.051", "budget_cap_ms": "50"}, {}).errors == ()
    master = load_config({**GOOD, "master_hosts": "10.0.0.9", "master_breaker_trial_timeout_s": "0.05"}, {})
    (problem,) = master.errors
    assert problem.settings == ("master_breaker_trial_timeout_s", "budget_cap_ms")
    assert "master breaker" in str(problem)
    # A breaker nothing uses is not judged: no master hosts, or the KVCM fallback off.
    assert load_config({**GOOD, "master_breaker_trial_timeout_s": "0.05"}, {}).errors == ()
    alone = {"kvcm_fallback": "off", "workers": "10.1.0.1:80"}
    assert load_config({**alone, "breaker_trial_timeout_s": "0.05"}, {}).errors == ()


def test_a_leader_stale_before_its_next_refresh_is_refused_naming_both() -> None:
    stale = load_config({**GOOD, "leader_max_staleness_s": "5", "leader_refresh_interval_s": "10"}, {})
    assert _names(stale.errors) == {("leader_max_staleness_s", "leader_refresh_interval_s")}
    assert load_config({**GOOD, "leader_max_staleness_s": "10", "leader_refresh_interval_s": "10"}, {}).errors == ()


def test_required_when_on_is_checked_only_then() -> None:
    off = load_config({"kvcm_fallback": "off", "workers": "10.1.0.1:80"}, {})
    assert off.errors == ()
    on = load_config({"workers": "10.1.0.1:80"}, {})
    assert _names(on.errors) == {
        ("kvcm_bootstrap", "kvcm_bootstrap_file", "kvcm_bootstrap_dns"),
        ("kvcm_instance_id",),
    }
    assert all(p.fallback for p in on.errors)
    assert (
        load_config(
            {"workers": "10.1.0.1:80", "kvcm_bootstrap_dns": "kvcm.svc", "kvcm_instance_id": "x"}, {}
        ).errors
        == ()
    )


def test_a_huge_or_long_refused_number_is_named_by_its_size_not_repeated() -> None:
    """Beyond the interpreter's 4,300-digit limit an integer was "expected an integer" and the whole
    value came back in the message; any refused value is quoted cut (a line of 4,413
    characters)."""
    huge = load_config({**GOOD, "scorer_seed": "1" * 4301}, {})
    (problem,) = [p for p in huge.errors if p.settings == ("scorer_seed",)]
    assert "4301 digits" in str(problem) and len(str(problem)) < 200
    long_text = load_config({**GOOD, "scorer_seed": "x" + "1" * 400}, {})
    (problem,) = [p for p in long_text.errors if p.settings == ("scorer_seed",)]
    assert "expected an integer" in str(problem) and "cut: 401 chars" in str(problem) and len(str(problem)) < 250
    assert "got 'abc'" in str(load_config({**GOOD, "prober_inflight_cap": "abc"}, {}).errors[0])
    # Not an integer however it looks: signs twice, a digit int() does not take.
    for odd in ("+-5", "--5", "²"):
        (problem,) = load_config({**GOOD, "scorer_seed": odd}, {}).errors
        assert "expected an integer" in str(problem), odd
    assert "4301 digits" in str(load_config({**GOOD, "scorer_seed": "-" + "5" * 4301}, {}).errors[0])


@pytest.mark.parametrize(
    "name",
    ["roles", "key_family", "query_type", "log_level", "debug_listen", "workers", "kvcm_bootstrap", "master_hosts"],
)
def test_a_long_refused_word_or_target_is_quoted_cut(name: str) -> None:
    """Enums, one-of checks, listen addresses and targets repeated a refused value whole (messages
    of 5,000-10,000 characters for a value of 5,000)."""
    errors = load_config({**GOOD, name: "q" * 5000}, {}).errors
    assert errors and all(len(str(p)) < 400 for p in errors), [len(str(p)) for p in errors]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("workers", "admin:{secret}@10.0.0.1:80"),
        ("kvcm_bootstrap", "http://admin:{secret}@10.0.0.1:6381"),
        ("master_hosts", "admin:{secret}@[::1]:7001"),
        ("debug_listen", "admin:{secret}@0.0.0.0"),
    ],
)
def test_a_long_password_in_a_refused_address_is_redacted_before_the_quote_is_cut(name: str, value: str) -> None:
    """Cutting the quoted value dropped the '@', and the message's redaction, which looks for it,
    then let the password's start through (a review of 2221f71)."""
    secret = "S3CRETtoken" + "x" * 80
    errors = load_config({**GOOD, name: value.format(secret=secret)}, {}).errors
    assert errors and not [str(p) for p in errors if "S3CRET" in str(p)]


def test_a_long_password_in_a_toml_value_of_the_wrong_type_is_redacted(tmp_path: Path) -> None:
    toml = tmp_path / "kv.toml"
    toml.write_text('[discovery]\nworkers = ["admin:S3CRETtoken' + "x" * 80 + '@10.0.0.1:80"]\n')
    errors = load_config({}, {}, str(toml)).errors
    assert any(p.settings == ("workers",) for p in errors)
    assert not [str(p) for p in errors if "S3CRET" in str(p)]


def test_an_instance_id_that_is_not_utf8_is_refused_and_turns_the_fallback_off() -> None:
    """A flag or environment value may hold bytes that are not UTF-8 (surrogate escapes): it passed,
    then every KVCM query failed to encode it and the leader resolver crashed again and again."""
    loaded = load_config({**GOOD, "kvcm_instance_id": "d\udcff", "workers": "10.1.0.1:80"}, {})
    assert _names(loaded.fallback_errors) == {("kvcm_instance_id",)}
    assert "UTF-8" in str(loaded.fallback_errors[0]) and "--kvcm-instance-id" in str(loaded.fallback_errors[0])
    assert loaded.effective.router.kvcm_fallback is False
    assert load_config({**GOOD, "kvcm_instance_id": "dépl_64", "workers": "10.1.0.1:80"}, {}).errors == ()
    # Beside a geometry problem, both are reported (the id's once hid the geometry's).
    both = load_config({**GOOD, "kvcm_instance_id": "d\udcff", "lookahead_tokens": "3", "workers": "10.1.0.1:80"}, {})
    assert _names(both.fallback_errors) == {("kvcm_instance_id",), ("key_family", "lookahead_tokens")}


def test_fail_soft_invalid_fallback_part_turns_the_fallback_off_and_keeps_defaults() -> None:
    loaded = load_config(
        {**GOOD, "block_size": "0", "shadow_ttl_s": "-3", "workers": "10.1.0.1:80"}, {}
    )
    assert loaded.fatal_errors == ()
    assert _names(loaded.fallback_errors) == {("block_size",), ("shadow_ttl_s",)}
    assert loaded.fallback_disabled_by_errors
    assert loaded.config.deployment.block_size == 0  # as given
    eff = loaded.effective
    assert eff.router.kvcm_fallback is False
    assert eff.deployment.block_size == KvrouteConfig().deployment.block_size
    assert eff.shadow.ttl_s == KvrouteConfig().shadow.ttl_s
    assert eff.discovery.workers == "10.1.0.1:80"  # the main path is untouched
    assert settings.validate(eff) == []  # nothing invalid reaches an actor


def test_main_path_problems_are_fatal_not_fail_soft() -> None:
    loaded = load_config({**GOOD, "workers": "nonsense:port", "metrics_inbox_size": "0"}, {})
    assert _names(loaded.fatal_errors) == {("workers",), ("metrics_inbox_size",)}
    assert loaded.fallback_errors == ()
    assert loaded.effective.router.kvcm_fallback is True


@pytest.mark.parametrize(
    ("name", "bad", "fallback"),
    [
        ("shadow_ttl_s", "0", True),
        ("channel_pool_max_channels", "0", False),  # the health probes' channels, the fallback off too
        ("router_reserve_fraction", "1", True),
        ("router_reserve_min_ms", "-1", True),
        ("split_min_samples", "0", True),
        ("roles", "DECODE", False),  # every answer needs its roles, the domain fallback's too
        ("prober_health_interval_s", "-1", False),  # the domain fallback knows dead workers from them too
    ],
)
def test_a_bad_value_turns_the_fallback_off_or_stops_kvroute_by_whether_it_is_a_fallback_setting(
    name: str, bad: str, fallback: bool
) -> None:
    """A fallback setting's bad value goes back to its default with the KVCM fallback off, and kvroute
    starts; any other stops it."""
    loaded = load_config({**GOOD, name: bad}, {})
    assert _names(loaded.fallback_errors if fallback else loaded.fatal_errors) == {(name,)}
    assert (loaded.fatal_errors if fallback else loaded.fallback_errors) == ()
    assert loaded.effective.router.kvcm_fallback is not fallback


def test_the_settings_the_health_probes_use_are_the_main_path() -> None:
    """The prober runs with the KVCM fallback off too: its health probes, to --worker-status-port over
    the channel pool, tell domain routing which workers are reachable. Such a setting given out of
    range was reset to its default as a fallback setting, and kvroute started probing the gRPC port
    with a 0.2 s timeout where the operator had said otherwise."""
    loaded = load_config(
        {**GOOD, "worker_status_port": "70000", "prober_probe_timeout_s": "0", "channel_pool_max_channels": "0"}, {}
    )
    assert loaded.fallback_errors == ()
    assert _names(loaded.fatal_errors) == {
        ("worker_status_port",),
        ("prober_probe_timeout_s",),
        ("channel_pool_max_channels",),
    }


def test_a_bad_key_geometry_is_fatal_when_a_scheduler_over_grpc_is_sent_keys_made_with_it() -> None:
    """Fail-soft reset a bad --block-size to its default: the KVCM fallback went off, but the gRPC
    scheduler went on being sent keys, made with the default block size."""
    bad = {**GOOD, "block_size": "70000", "master_hosts": "10.0.0.9:7001"}
    over_http = load_config(bad, {})
    assert over_http.fatal_errors == () and _names(over_http.fallback_errors) == {("block_size",)}
    over_grpc = load_config({**bad, "master_protocol": "grpc"}, {})
    [fatal] = over_grpc.fatal_errors
    assert fatal.settings == ("block_size",) and "the scheduler is sent block keys made with it" in str(fatal)


# --- views ------------------------------------------------------------------------------------


def test_redacted_view_is_json_and_masks_secret_named_fields() -> None:
    view = redacted(load_config(GOOD, {}).effective)
    assert json.loads(json.dumps(view)) == view
    assert view["deployment"]["roles"] == ["PREFILL"]
    assert view["deployment"]["query_type"] == "prefix"
    assert view["deployment"]["lookahead_tokens"] == 0  # "tokens" is not "token"
    assert view["discovery"]["kvcm_bootstrap"] == GOOD["kvcm_bootstrap"]
    assert settings.is_secret_field("auth_token") and settings.is_secret_field("kvcm_password")
    assert not settings.is_secret_field("max_extra_work_tokens")


def test_debug_config_view_lists_problems_and_sources() -> None:
    loaded = load_config({**GOOD, "block_size": "0"}, {"KVROUTE_BUDGET_CAP_MS": "40"})
    view = settings.debug_config_view(loaded)
    assert view["kvcm_fallback_disabled_by_errors"] is True
    assert view["errors"] == [
        "--block-size (KVROUTE_BLOCK_SIZE): must be > 0, got 0 (from flag --block-size)"
    ]
    sources = view["sources"]
    assert isinstance(sources, dict)
    assert sources["router.budget_cap_ms"] == "env KVROUTE_BUDGET_CAP_MS"
    assert sources["scorer.seed"] == "default"
    json.dumps(view)


def test_help_is_generated_from_the_table() -> None:
    text = " ".join(_parser().format_help().split())
    for s in SETTINGS:
        assert s.flag in text
    assert "[required when --kvcm-fallback is on]" in text
    assert "KVROUTE_PROBER_INFLIGHT_CAP" in text


def test_assessment_says_what_will_and_will_not_work() -> None:
    loaded = load_config({"kvcm_bootstrap": "10.0.0.1", "kvcm_instance_id": "ns", "block_size": "64"}, {})
    verdict = assess(loaded, path_exists=lambda _: True)
    assert (
        "KVCM fallback on, but no worker discovery source (--workers, --workers-file, --workers-dns): "
        "cold candidates and domain fallback unavailable"
    ) in verdict.will_not_work
    assert (
        "block size from --block-size=64 (flag --block-size): "
        "workers that report another block size will be excluded"
    ) in verdict.works

    broken = load_config(
        {**GOOD, "kvcm_instance_id": "", "workers_file": "/nope", "debug_listen": "0.0.0.0:9"}, {}
    )
    verdict = assess(broken, path_exists=lambda _: False)
    assert verdict.will_not_work[0].startswith("KVCM fallback requested but DISABLED: 1 problem(s)")
    assert any(line.startswith("--workers-file /nope does not exist") for line in verdict.will_not_work)
    assert any("binds 0.0.0.0, not loopback" in line for line in verdict.will_not_work)
    assert not any(line.startswith("KVCM fallback on") for line in verdict.works)

    off = assess(load_config({**GOOD, "kvcm_fallback": "no"}, {}), path_exists=lambda _: True)
    assert off.works[0] == (
        "KVCM fallback off (--kvcm-fallback=false (flag --kvcm-fallback)): "
        "every request is routed by domain (discovery)"
    )
    assert off.will_not_work == ()


def test_startup_report_logs_one_error_for_the_fallback_problems(caplog: pytest.LogCaptureFixture) -> None:
    loaded = load_config({**GOOD, "block_size": "0", "kvcm_instance_id": ""}, {"KVROUTE_NOPE": "1"})
    log = logging.getLogger("kvroute.test.settings")
    with caplog.at_level(logging.INFO, logger=log.name):
        settings.log_startup_report(loaded, log, path_exists=lambda _: True)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "KVCM fallback disabled, routing by domain: 2 configuration problem(s): "
        "--block-size (KVROUTE_BLOCK_SIZE): must be > 0, got 0 (from flag --block-size); "
        "--kvcm-instance-id (KVROUTE_KVCM_INSTANCE_ID): required when --kvcm-fallback is on"
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == "environment variable KVROUTE_NOPE is not a kvroute setting (ignored)"
    assert warnings[1].startswith("will not work: KVCM fallback requested but DISABLED")
    assert any(
        r.getMessage().startswith("workers from --workers=")
        for r in caplog.records
        if r.levelno == logging.INFO
    )


# --- the settings are at least as strict as the actors ---------------------------------------


def _edge_values(s: settings.Setting) -> list[object]:
    if s.kind is Kind.INT:
        assert isinstance(s.default, int)
        return [-1, 0, 1, 2, s.default, s.default * 2 + 1]
    assert isinstance(s.default, float)
    return [-1.0, 0.0, 0.001, 0.5, 1.0, s.default, s.default * 3]


_CHECKED_SECTIONS = ("leader", "breaker", "prober", "scorer", "discovery")


_OPERATOR_VALUES = st.fixed_dictionaries(
    {},
    optional={
        s.name: st.sampled_from(_edge_values(s))
        for s in SETTINGS
        if s.section in _CHECKED_SECTIONS and s.kind in (Kind.INT, Kind.FLOAT)
    },
)


@settings_profile(max_examples=300, deadline=None)
@given(_OPERATOR_VALUES)
@example({"prober_fresh_ttl_s": -1.0, "prober_max_status_age_s": 0.001})  # a reset exposes a conflict
def test_an_effective_config_never_makes_an_actor_reject_it(values: dict[str, object]) -> None:
    """Whatever the operator gives, the fail-soft effective config passes every actor's own check."""
    from actors.breaker import KvcmBreaker
    from actors.channel_pool import ChannelPool
    from actors.discovery import Discovery
    from actors.leader_resolver import leader_problems
    from actors.probe_budget import prober_problems
    from actors.shadow_index import ShadowIndexActor
    from router.policy.cache_affinity import CacheAffinityFirst

    loaded = load_config({**GOOD, **values}, {})
    if loaded.fatal_errors:
        return  # kvroute refuses to start; nothing reaches an actor
    eff = loaded.effective
    # The constructors refuse through the same checks the settings layer collected.
    KvcmBreaker(eff.breaker)
    ShadowIndexActor(eff.shadow)
    ChannelPool(eff.channel_pool, lambda target: _Closable())
    CacheAffinityFirst(eff.scorer, eff.deployment, status_horizon_s=0.0)
    assert leader_problems(eff.leader) == []
    assert prober_problems(eff.prober) == []

    async def start_discovery() -> None:
        Discovery(eff.discovery)  # raises DiscoveryConfigError on what it cannot use

    trio.run(start_discovery)


# --- one validation, bounded values, files that cannot crash -------------------------------------


def test_non_utf8_oversized_and_directory_files_are_problems_naming_the_file(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes("[deployment]\nkvcm_instance_id = 'café'\n".encode("latin-1"))
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (settings.MAX_CONFIG_FILE_BYTES + 1))
    for path, why in ((latin1, "not UTF-8 text"), (big, "larger than"), (tmp_path, "cannot read the file")):
        loaded = load_config({}, {}, str(path))  # never raises
        file_problems = [str(p) for p in loaded.fatal_errors if p.settings == ()]
        assert len(file_problems) == 1, file_problems
        assert file_problems[0].startswith(f"--config {path}: {why}"), file_problems[0]


def test_a_token_file_past_its_size_limit_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """A bearer token is a line of text: a larger file is no token file, and a token cut from its
    first bytes would not be the one the operator meant."""
    token = tmp_path / "token"
    token.write_text("x" * MAX_TOKEN_FILE_BYTES)  # the largest a token file may be
    assert load_config({**GOOD, "debug_token_file": str(token)}, {}).errors == ()
    large = tmp_path / "large"
    large.write_text("x" * 5000)
    loaded = load_config({**GOOD, "debug_token_file": str(large)}, {})
    [problem] = [str(p) for p in loaded.errors]
    assert problem.startswith(
        f"--debug-token-file (KVROUTE_DEBUG_TOKEN_FILE): larger than {MAX_TOKEN_FILE_BYTES} bytes"
    ), problem


def test_a_blank_token_file_is_refused_not_read_as_no_token(tmp_path: Path) -> None:
    """The debug endpoint takes an empty token as none asked for: a token file holding only whitespace
    would open /metrics and /debug to anyone."""
    blank = tmp_path / "token"
    blank.write_text("\n  \n")
    [problem] = [str(p) for p in load_config({**GOOD, "debug_token_file": str(blank)}, {}).errors]
    assert problem.startswith("--debug-token-file (KVROUTE_DEBUG_TOKEN_FILE): "), problem
    with pytest.raises(settings.TokenFileError):
        settings.read_token_file(str(blank))


def test_resolve_config_is_pure_and_load_config_is_it_over_the_file_read(tmp_path: Path) -> None:
    # No file is opened: the path is only a name for the sources.
    given = settings.ConfigFile("/nonexistent/kv.toml", {"deployment": {"block_size": 32}})
    loaded = settings.resolve_config(given, {"KVROUTE_LOOKAHEAD_TOKENS": "0"}, {"budget_cap_ms": "20"})
    assert loaded.config.deployment.block_size == 32
    assert str(loaded.sources["block_size"]) == "config file /nonexistent/kv.toml [deployment] block_size"
    assert loaded.config_path == "/nonexistent/kv.toml"
    toml = tmp_path / "kv.toml"
    toml.write_text("[deployment]\nblock_size = 32\n")
    read = settings.read_config_file(str(toml))
    assert load_config({}, {}, str(toml)) == settings.resolve_config(read, {}, {})
    assert load_config({}, {"KVROUTE_CONFIG": str(toml)}).config.deployment.block_size == 32


_NUMERIC = [s for s in SETTINGS if s.kind in (Kind.INT, Kind.FLOAT)]


@pytest.mark.parametrize("setting", _NUMERIC, ids=[s.name for s in _NUMERIC])
def test_every_numeric_setting_is_bounded_above_and_refused_beyond_naming_its_flag(setting: Setting) -> None:
    assert setting.range is not None and math.isfinite(setting.range.high)
    assert f"Range: {setting.range}." in setting.help_text()
    beyond = setting.range.high + 1
    loaded = load_config({**GOOD, setting.name: str(int(beyond) if setting.kind is Kind.INT else beyond)}, {})
    [problem] = [p for p in loaded.errors if p.settings == (setting.name,)]
    assert str(problem).startswith(f"{setting.flag} ({setting.env}): must be <")


@pytest.mark.parametrize(
    ("name", "refused", "accepted"),
    [
        pytest.param("router_reserve_fraction", "1", "0.99", id="a reserve of the whole deadline leaves no wait"),
        pytest.param("router_admission_decay", "1", "0.99", id="an estimate keeping all its weight never learns"),
        pytest.param("master_slave_window_share", "1", "0.99", id="the master's call is left some of its window"),
        pytest.param("decision_log_max_bytes", "4095", "4096", id="a decision log file holds at least 4 KiB"),
        pytest.param("decision_log_files", "0", "1", id="the current decision log file is one of those kept"),
        pytest.param("processes", "0", "1", id="at least one process serves"),
        pytest.param("metrics_decision_text_chars", "31", "32", id="room for a cut text's start and its marker"),
        pytest.param("kvcm_port", "0", "1", id="a KVCM entry's port is one to connect to"),
        pytest.param("worker_status_port", "65536", "65535", id="a port is at most 65535"),
        pytest.param("scorer_max_pending_charges", "1", "2", id="a forgotten charge clears with the next's time"),
        pytest.param("breaker_failure_rate", "0", "1", id="a failure rate of 0 would open on no failure"),
    ],
)
def test_the_ends_of_a_range_mean_what_the_setting_needs(name: str, refused: str, accepted: str) -> None:
    flag = BY_NAME[name].flag
    problems = [str(p) for p in load_config({**GOOD, name: refused}, {}).errors]
    assert len(problems) == 1 and problems[0].startswith(f"{flag} ("), problems
    assert load_config({**GOOD, name: accepted}, {}).errors == ()


def test_a_range_refuses_its_own_default_outside_it() -> None:
    with pytest.raises(ValueError, match=re.escape("default 5 is outside its own range [0, 1]")):
        bounded(5, 0, 1)
    with pytest.raises(ValueError, match=re.escape("default 1 is outside its own range [0, 1)")):
        bounded(1, 0, 1, high_open=True)
    bounded(1, 0, 1)  # an end that belongs to the range is a default


def test_grpc_max_workers_beyond_its_bound_stops_serve() -> None:
    loaded = load_config({**GOOD, "grpc_max_workers": "99999999999"}, {})
    # every problem at once: the range, then the rule joining it to the gRPC call cap
    assert str(loaded.fatal_errors[0]) == (
        "--grpc-max-workers (KVROUTE_GRPC_MAX_WORKERS): must be <= 10000, got 99999999999 "
        "(from flag --grpc-max-workers)"
    )
    assert _names(loaded.fatal_errors) == {("grpc_max_workers",), ("grpc_max_concurrent_rpcs", "grpc_max_workers")}


def test_grpc_must_hold_at_least_as_many_calls_as_there_are_handler_threads() -> None:
    loaded = load_config({**GOOD, "grpc_max_workers": "64", "grpc_max_concurrent_rpcs": "63"}, {})
    assert _names(loaded.fatal_errors) == {("grpc_max_concurrent_rpcs", "grpc_max_workers")}
    assert "63 calls at once, fewer than the 64 handler threads" in str(loaded.fatal_errors[0])
    assert load_config({**GOOD, "grpc_max_workers": "64", "grpc_max_concurrent_rpcs": "64"}, {}).errors == ()
    assert load_config(GOOD, {}).effective.serve.grpc_max_concurrent_rpcs == 1024


def test_slot_waiters_must_leave_a_handler_thread_free() -> None:
    loaded = load_config({**GOOD, "grpc_max_workers": "8", "slot_waiters": "8"}, {})
    assert _names(loaded.fatal_errors) == {("slot_waiters", "grpc_max_workers")}
    assert "handler threads" in str(loaded.fatal_errors[0])
    assert load_config({**GOOD, "grpc_max_workers": "8", "slot_waiters": "7"}, {}).errors == ()
    assert load_config({**GOOD, "slot_waiters": "0"}, {}).effective.serve.slot_waiters == 0


def test_every_section_is_checked_by_its_own_rules() -> None:
    assert set(settings.SECTION_PROBLEMS) == set(settings.SECTIONS)


@pytest.mark.parametrize(
    ("workers", "refused"),
    [
        ("10.1.0.1:65535", True),  # its gRPC port (http + 1) does not exist
        ("10.1.0.1:80\n10.1.0.2:80  # two workers, one per line", False),  # as in a workers file
        ("10.1.0.1:80,not an address:80", True),
    ],
)
def test_settings_refuse_exactly_the_worker_lists_discovery_refuses(workers: str, refused: bool) -> None:
    from actors.discovery import Discovery, DiscoveryConfigError

    loaded = load_config({"kvcm_fallback": "off", "workers": workers}, {})

    async def construct() -> bool:
        try:
            Discovery(loaded.config.discovery)
        except DiscoveryConfigError:
            return True
        return False

    assert trio.run(construct) is refused
    assert bool(loaded.fatal_errors) is refused


def test_key_geometry_the_family_cannot_hash_is_refused_up_front() -> None:
    # rtp keys have no lookahead: before, this started and every request that sent token ids failed.
    loaded = load_config({**GOOD, "lookahead_tokens": "1"}, {})
    assert _names(loaded.errors) == {("key_family", "lookahead_tokens")}
    assert load_config({**GOOD, "lookahead_tokens": "1", "key_family": "vllm"}, {}).errors == ()


@pytest.mark.parametrize("roles", ["PREFILL,DECODE", "PDFUSION,VIT"])
def test_one_prefill_capable_role_is_enough_beside_decode_or_vit(roles: str) -> None:
    """DECODE and VIT each add an address beside the cache-aware pick, which needs one role that can
    prefill: PREFILL or PDFUSION, not every role."""
    assert load_config({**GOOD, "roles": roles}, {}).errors == ()


def test_a_roles_problem_and_a_geometry_problem_are_reported_together() -> None:
    """Every problem at once: a --roles without a prefill-capable role held the key-geometry rules
    back as a range problem does, so the rtp family's lookahead was reported only once --roles was
    fixed."""
    loaded = load_config({**GOOD, "roles": "DECODE", "lookahead_tokens": "1"}, {})
    assert _names(loaded.errors) == {("roles",), ("key_family", "lookahead_tokens")}


def test_prober_freshness_within_the_max_age_is_one_rule_for_settings_and_prober() -> None:
    from actors.probe_budget import prober_problems
    from actors.worker_prober import WorkerProber
    from router.config import ProberConfig

    # Equal is allowed by both (the settings layer used to refuse what the prober accepted).
    equal = {"prober_fresh_ttl_s": "3", "prober_max_status_age_s": "3"}
    assert load_config({**GOOD, **equal}, {}).errors == ()
    assert prober_problems(ProberConfig(fresh_ttl_s=3.0, max_status_age_s=3.0)) == []
    above = {"prober_fresh_ttl_s": "3.5", "prober_max_status_age_s": "3"}
    assert _names(load_config({**GOOD, **above}, {}).errors) == {("prober_fresh_ttl_s", "prober_max_status_age_s")}
    config = ProberConfig(fresh_ttl_s=3.5, max_status_age_s=3.0)
    assert [p.fields for p in prober_problems(config)] == [("fresh_ttl_s", "max_status_age_s")]
    with pytest.raises(ValueError, match=r"prober\.fresh_ttl_s, prober\.max_status_age_s"):
        WorkerProber(config, transport=None)  # type: ignore[arg-type]  # refused before the transport is used


def test_load_or_report_lists_what_stops_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["--metrics-inbox-size", "0", "--kvcm-fallback", "off"])
    assert settings.load_or_report(args, "route", env={}) is None
    err = capsys.readouterr().err
    assert err.startswith("kvroute route: 1 configuration problem(s), not starting:\n")
    assert "  x --metrics-inbox-size (KVROUTE_METRICS_INBOX_SIZE): must be > 0, got 0" in err
    ok = settings.load_or_report(_parser().parse_args(["--kvcm-fallback", "off"]), "route", env={})
    assert ok is not None and ok.errors == ()


def test_a_mapping_with_a_misspelt_setting_name_is_an_error_naming_it() -> None:
    from router.settings.load import load_config

    loaded = load_config({"budget_cap_msx": 5, "budget_cap_ms": 40}, {})
    assert any("unknown setting 'budget_cap_msx'" in str(p) for p in loaded.fatal_errors)
    assert loaded.config.router.budget_cap_ms == 40
