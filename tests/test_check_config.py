"""``kvroute check-config``: every problem at once, with sources and a plain verdict; exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.cli import main
from router.settings import SETTINGS, load_config
from router.settings.assess import assess

BROKEN_TOML = """
[deployment]
block_size = 0
query_type = "prefix-with-mamba"
[discovery]
kvcm_bootstrap = "10.0.0.1:6381,[::1"
workers = "10.1.0.1:8000"
[prober]
inflight_cap = -1
[serve]
log_format = "yaml"
"""


@pytest.fixture(autouse=True)
def _no_kvroute_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process runs read os.environ: start each from no KVROUTE_* variable."""
    for name in list(os.environ):
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)


def test_broken_config_lists_every_problem_and_exits_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "broken.toml"
    config.write_text(BROKEN_TOML)
    code = main(["check-config", "--config", str(config), "--budget-cap-ms", "abc"])
    out = capsys.readouterr().out
    assert code == 1
    errors = [line.strip() for line in out.splitlines() if line.startswith("  x ")]
    assert len(errors) == 6
    expected_starts = [
        "x --budget-cap-ms (KVROUTE_BUDGET_CAP_MS): expected a number, got 'abc' (from flag --budget-cap-ms)",
        "x --block-size (KVROUTE_BLOCK_SIZE): must be > 0, got 0 (from config file",
        "x --prober-inflight-cap (KVROUTE_PROBER_INFLIGHT_CAP): must be > 0, got -1",
        "x --log-format (KVROUTE_LOG_FORMAT): must be one of text|json, got 'yaml'",
        "x --kvcm-instance-id (KVROUTE_KVCM_INSTANCE_ID): required when --kvcm-fallback is on",
        "x --kvcm-bootstrap (KVROUTE_KVCM_BOOTSTRAP): unclosed '[' in target '[::1'",
    ]
    for start in expected_starts:
        assert sum(line.startswith(start) for line in errors) == 1, start
    assert "errors (6):" in out
    assert "result: 6 error(s); 3 outside the KVCM fallback: kvroute will not start" in out
    assert "KVCM fallback requested but DISABLED: 3 problem(s) in its settings" in out
    # Sources: a value from the file names the file and key.
    assert "--query-type" in out and f"config file {config} [deployment] query_type" in out


def test_good_config_prints_sources_and_verdict_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "check-config",
        "--kvcm-bootstrap=10.0.0.1,10.0.0.2:7000",
        "--kvcm-instance-id=llama_64",
        "--workers=10.1.0.1:8000",
        "--block-size=64",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "result: OK" in out
    assert (
        "  + block size from --block-size=64 (flag --block-size): workers that report another block size"
        in out
    )
    assert (
        "  + KVCM fallback on: leader from --kvcm-bootstrap=10.0.0.1,10.0.0.2:7000 (flag --kvcm-bootstrap)"
        in out
    )
    block_line = next(line for line in out.splitlines() if line.strip().startswith("--block-size "))
    assert block_line.split()[1:] == ["64", "flag", "--block-size"]
    assert "errors" not in out


def test_subprocess_with_env_and_flags(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env.update(
        {"KVROUTE_KVCM_FALLBACK": "perhaps", "KVROUTE_WORKERS": "10.1.0.1", "KVROUTE_SCORER_SEED": "-1"}
    )
    result = subprocess.run(
        [sys.executable, "-P", "-m", "router.cli", "check-config", "--debug-listen", "localhost"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    errors = [line.strip() for line in result.stdout.splitlines() if line.startswith("  x ")]
    assert [e.split(":")[0] for e in errors] == [
        # a value that does not parse, then one setting's problems in table order, then joint ones
        "x --kvcm-fallback (KVROUTE_KVCM_FALLBACK)",
        "x --kvcm-instance-id (KVROUTE_KVCM_INSTANCE_ID)",
        "x --workers (KVROUTE_WORKERS)",
        "x --scorer-seed (KVROUTE_SCORER_SEED)",
        "x --debug-listen (KVROUTE_DEBUG_LISTEN)",
        "x --kvcm-bootstrap (KVROUTE_KVCM_BOOTSTRAP) / --kvcm-bootstrap-file (KVROUTE_KVCM_BOOTSTRAP_FILE) / "
        "--kvcm-bootstrap-dns (KVROUTE_KVCM_BOOTSTRAP_DNS)",
    ]
    assert "(from env KVROUTE_KVCM_FALLBACK)" in errors[0]


def test_non_utf8_config_file_is_a_listed_problem_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "latin1.toml"
    config.write_bytes("[deployment]\nkvcm_instance_id = 'café'\n".encode("latin-1"))
    assert main(["check-config", "--config", str(config)]) == 1  # not a UnicodeDecodeError traceback
    out = capsys.readouterr().out
    assert f"  x --config {config}: not UTF-8 text" in out
    assert "kvroute will not start" in out


def test_check_config_refuses_what_serve_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    # The worker's gRPC port would be 65536: discovery refuses it when serve starts, so check-config must.
    code = main(["check-config", "--kvcm-fallback", "off", "--workers", "10.1.0.1:65535"])
    out = capsys.readouterr().out
    assert code == 1
    assert "x --workers (KVROUTE_WORKERS): 10.1.0.1:65535: grpc port 65536" in out
    assert "(http + --worker-grpc-port-offset)" in out
    assert "result: OK" not in out


def test_the_report_says_what_the_master_does_and_which_timeouts_the_cap_makes_moot() -> None:
    base = {"workers": "10.0.0.5:8000", "kvcm_bootstrap": "10.0.0.9:6381", "kvcm_instance_id": "x"}
    none = assess(load_config(base, {}))
    assert "no central scheduler (--master-hosts empty): the chain starts at KVCM" in none.works
    alone = assess(load_config(base | {"kvcm_fallback": "false"}, {}))
    assert "no central scheduler (--master-hosts empty): the chain is the domain source alone" in alone.works
    bad = assess(load_config(base | {"master_hosts": "10.0.0.1:99999"}, {}))
    assert any(line.startswith("no central scheduler (--master-hosts refused") for line in bad.works)
    on = assess(load_config(base | {"master_hosts": "10.0.0.1,10.0.0.2:7001"}, {}))
    asked = next(line for line in on.works if "central scheduler is asked first" in line)
    assert "2 host(s)" in asked and "KVCM, then the shadow index and domain" in asked
    assert any("--master-transport-timeout-ms=200.0" in line and "budget cap" in line for line in on.works)
    assert any("--router-kvcm-query-timeout-ms=500.0" in line and "budget cap" in line for line in on.works)
    off = assess(load_config(base | {"master_hosts": "10.0.0.1", "kvcm_fallback": "false", "budget_cap_ms": "500"}, {}))
    asked = next(line for line in off.works if "central scheduler is asked first" in line)
    assert asked.endswith("when it cannot answer, domain routing")
    assert not any("does not bound" in line for line in off.works)  # the timeouts apply under a 500 ms cap


def test_a_decision_log_in_a_directory_that_does_not_exist_is_reported(tmp_path: Path) -> None:
    base = {"workers": "10.0.0.5:8000", "kvcm_fallback": "false"}
    missing = assess(load_config(base | {"decision_log": str(tmp_path / "nope" / "d.log")}, {}))
    assert any("--decision-log" in line and "directory does not exist" in line for line in missing.will_not_work)
    present = assess(load_config(base | {"decision_log": str(tmp_path / "d.log")}, {}))
    assert not any("--decision-log" in line for line in present.will_not_work)


def test_a_list_file_that_cannot_be_used_is_reported_as_a_refresh_would_read_it(tmp_path: Path) -> None:
    base = {"kvcm_fallback": "false"}
    (tmp_path / "wdir").mkdir()
    (tmp_path / "bad.txt").write_text("127.0.0.1:8000\nbad entry\n")
    (tmp_path / "good.txt").write_text("127.0.0.1:8000\n# a comment\n127.0.0.2:8000\n")
    os.mkfifo(tmp_path / "fifo")  # no writer: opening it would wait for one forever
    cases = (("wdir", "not a regular file"), ("fifo", "not a regular file"), ("bad.txt", "bad host 'bad entry'"))
    for name, why in cases:
        path = str(tmp_path / name)
        verdict = assess(load_config(base | {"workers_file": path}, {}))
        assert any(line.startswith(f"--workers-file {path}: ") and why in line for line in verdict.will_not_work)
    good = assess(load_config(base | {"workers_file": str(tmp_path / "good.txt")}, {}))
    assert not any("--workers-file" in line for line in good.will_not_work)
    boot = assess(load_config({"kvcm_bootstrap_file": str(tmp_path / "wdir"), "kvcm_instance_id": "i"}, {}))
    assert any(line.startswith("--kvcm-bootstrap-file") and "not a regular file" in line for line in boot.will_not_work)


def test_a_path_holding_a_nul_character_is_refused_naming_its_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TOML strings can hold U+0000, and open() raises ValueError on it, not OSError: check-config and
    serve ended in a traceback for the TLS and token files, and passed it for the others."""
    paths = [s for s in SETTINGS if s.metavar in ("FILE", "PATH")]
    assert {s.name for s in paths} >= {"workers_file", "decision_log", "grpc_tls_cert", "debug_token_file"}
    for setting in paths:
        toml = tmp_path / f"{setting.name}.toml"
        section, key = setting.toml_key.split(".")
        toml.write_text(f'[{section}]\n{key} = "a\\u0000b"\n')
        code = main(["check-config", "--config", str(toml), "--workers", "127.0.0.1:1", "--kvcm-fallback", "off"])
        out = capsys.readouterr().out
        assert code == 1, (setting.name, out)
        assert f"x {setting.flag} ({setting.env}): a path cannot hold a NUL character" in out, (setting.name, out)


def test_background_refresh_on_but_inactive_is_reported() -> None:
    base = {"workers": "10.0.0.5:8000", "kvcm_fallback": "false"}
    inactive = assess(load_config(base | {"prober_refresh_interval_s": "0.1"}, {}))
    assert any(
        "--prober-background-refresh=true" in line and "inactive" in line and "--prober-fresh-ttl-s=0.05" in line
        for line in inactive.will_not_work
    )
    for quiet in ({}, {"prober_refresh_interval_s": "0.1", "prober_background_refresh": "false"}):
        verdict = assess(load_config(base | quiet, {}))
        assert not any("inactive" in line for line in verdict.will_not_work)


def test_a_decision_log_path_holding_a_directory_or_another_file_is_reported(tmp_path: Path) -> None:
    base = {"workers": "10.0.0.5:8000", "kvcm_fallback": "false"}
    (tmp_path / "adir").mkdir()
    (tmp_path / "notes.txt").write_text("important notes")
    (tmp_path / "old.log").write_bytes(b"KVRDL")  # a log whose header a crash cut short is still a log
    for name, why in (("adir", "is a directory"), ("notes.txt", "not a kvroute decision log")):
        verdict = assess(load_config(base | {"decision_log": str(tmp_path / name)}, {}))
        assert any("--decision-log" in line and why in line for line in verdict.will_not_work), name
    ours = assess(load_config(base | {"decision_log": str(tmp_path / "old.log")}, {}))
    assert not any("--decision-log" in line for line in ours.will_not_work)
    # What the writers would rotate is looked at too: a rotated name, and each child's own file.
    (tmp_path / "old.log.2").mkdir()
    rotated = assess(load_config(base | {"decision_log": str(tmp_path / "old.log")}, {}))
    assert any("old.log.2 is a directory" in line for line in rotated.will_not_work)
    (tmp_path / "c.log.p1").mkdir()
    children = assess(load_config(base | {"decision_log": str(tmp_path / "c.log"), "processes": "2"}, {}))
    assert any("c.log.p1 is a directory" in line for line in children.will_not_work)


def test_a_settings_file_that_cannot_be_read_is_blamed_on_what_named_it(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    by_env = load_config({"workers": "10.0.0.5:8000"}, {"KVROUTE_CONFIG": missing})
    env_errors = [str(p) for p in by_env.errors]
    assert any(e.startswith(f"KVROUTE_CONFIG {missing}: cannot read the file") for e in env_errors), env_errors
    by_flag = load_config({"workers": "10.0.0.5:8000", "config": missing}, {})
    assert any(str(p).startswith(f"--config {missing}: cannot read the file") for p in by_flag.errors), by_flag.errors


def test_a_nan_value_is_not_reported_as_set_aside_by_the_fallback(capsys: pytest.CaptureFixture[str]) -> None:
    """NaN is not equal to itself: the report compares what it shows, not the values."""
    assert main(["check-config", "--workers", "10.0.0.1:80", "--budget-cap-ms", "nan"]) != 0  # refused
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("--budget-cap-ms"))
    assert "not used" not in row


def test_an_abbreviated_flag_is_refused_not_taken_for_the_flag_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["check-config", "--budget-cap", "7"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --budget-cap 7" in capsys.readouterr().err


@pytest.mark.parametrize("columns", [60, 80])
def test_help_keeps_every_flag_env_var_and_toml_key_whole_on_a_narrow_terminal(
    columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse broke long words at the line's end: at 80 columns
    KVROUTE_MASTER_BREAKER_OVERLAPPING_FAILURES_COUNT_ONCE was split in two, and at 60 dozens of names,
    which then could not be found or copied from the help."""
    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit):
        main(["check-config", "--help"])
    text = capsys.readouterr().out
    assert [s.flag for s in SETTINGS if s.flag not in text] == []
    assert [s.env for s in SETTINGS if s.env not in text] == []
    assert [s.toml_key for s in SETTINGS if s.toml_key not in text] == []


@pytest.mark.parametrize("command", ["route", "explain"])
def test_route_and_explain_help_say_they_log_warnings_unless_a_level_is_given(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Their help gave serve's default (INFO) while they log WARNING unless --log-level is given;
    check-config's help keeps the setting's own default alone."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "WARNING unless given" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["check-config", "--help"])
    assert "WARNING unless given" not in " ".join(capsys.readouterr().out.split())


# A configuration on which everything validates, as flags.
GOOD = {"kvcm_bootstrap": "10.0.0.1:6381", "kvcm_instance_id": "x", "workers": "10.1.0.1:80"}


def test_problems_confined_to_the_fallback_turn_it_off_and_do_not_stop_kvroute(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in GOOD.items()]
    assert main(["check-config", *flags, "--block-size=0"]) == 1
    out = capsys.readouterr().out
    assert "  - KVCM fallback requested but DISABLED: 1 problem(s) in its settings" in out
    assert "kvroute will not start" not in out
    assert out.endswith("result: 1 error(s); kvroute would start with the KVCM fallback off\n")
    # The DISABLED line says the fallback is off; a "fallback off" line would blame the default.
    assert not any(line.startswith("  + KVCM fallback off") for line in out.splitlines())
    # Each row shows the value in effect, and the one given that the fallback's problems set aside.
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("    --")}
    assert rows["--block-size"].split()[1] == "64"
    assert rows["--block-size"].endswith("flag --block-size; '0' not used: the KVCM fallback settings have problems")
    assert rows["--kvcm-fallback"].split()[1] == "false"
    assert rows["--kvcm-fallback"].endswith("default; 'true' not used: the KVCM fallback settings have problems")


def test_fallback_problems_with_the_fallback_off_do_not_say_it_was_disabled() -> None:
    verdict = assess(load_config(GOOD | {"kvcm_fallback": "off", "block_size": "0"}, {}))
    assert not any("DISABLED" in line for line in verdict.will_not_work)
    assert any(
        line.startswith("KVCM fallback off (--kvcm-fallback=false (flag --kvcm-fallback))") for line in verdict.works
    )


@pytest.mark.parametrize("name", ["localhost", "LocalHost", "localhost."])
def test_localhost_is_loopback_for_both_listeners(name: str) -> None:
    # A name is read case-insensitively and without its trailing dot: each spelling is localhost.
    verdict = assess(load_config(GOOD | {"debug_listen": f"{name}:0", "grpc_listen": f"{name}:50051"}, {}))
    assert "debug HTTP (/healthz /readyz /metrics /debug/*) on localhost, a free port chosen at start (logged)" in (
        verdict.works
    )
    assert not any("not loopback" in line for line in verdict.will_not_work)


def test_a_name_that_only_begins_like_localhost_is_not_loopback() -> None:
    verdict = assess(load_config(GOOD | {"debug_listen": "localhost.example:9"}, {}))
    assert any(line.startswith("debug HTTP binds localhost.example, not loopback") for line in verdict.will_not_work)


def test_a_debug_listener_off_loopback_is_reported_unless_a_token_guards_it(tmp_path: Path) -> None:
    off_loopback = GOOD | {"debug_listen": "0.0.0.0:9"}
    open_to_all = assess(load_config(off_loopback, {}))
    assert any(
        line.startswith("debug HTTP binds 0.0.0.0, not loopback") and "by anyone" in line
        for line in open_to_all.will_not_work
    )
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    for guard in ({"debug_token": "s3cret"}, {"debug_token_file": str(token)}):
        loaded = load_config(off_loopback | guard, {})
        assert loaded.errors == (), guard
        verdict = assess(loaded)
        assert not any("debug HTTP binds" in line for line in verdict.will_not_work), guard
        said = [w for w in verdict.works if w.startswith("debug HTTP binds 0.0.0.0: every path but /healthz")]
        # The endpoint has no TLS: said, so a token sent in the clear is not taken for a safe one.
        assert len(said) == 1 and "requires the bearer token" in said[0] and "in the clear" in said[0], guard


def test_a_relative_decision_log_is_checked_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare file name's directory is the working directory, which exists; os.path.dirname alone gives ''."""
    monkeypatch.chdir(tmp_path)
    here = assess(load_config(GOOD | {"decision_log": "d.log"}, {}))
    assert not any("--decision-log" in line for line in here.will_not_work)
    missing = assess(load_config(GOOD | {"decision_log": "nope/d.log"}, {}))
    assert any(
        line.startswith("--decision-log nope/d.log: its directory does not exist") for line in missing.will_not_work
    )


def test_a_timeout_equal_to_the_budget_cap_is_reported_as_not_bounding() -> None:
    """A request's deadline is at most the cap, so a timeout equal to it never ends a query or attempt first."""
    kvcm = "--router-kvcm-query-timeout-ms=500.0 (default) does not bound a query"
    at_cap = assess(load_config(GOOD | {"budget_cap_ms": "500"}, {}))
    assert any(line.startswith(kvcm) for line in at_cap.works)
    above = assess(load_config(GOOD | {"budget_cap_ms": "500.5"}, {}))
    assert not any(line.startswith(kvcm) for line in above.works)
    master = "--master-transport-timeout-ms=200.0 (default) does not bound an attempt"
    with_master = GOOD | {"master_hosts": "10.0.0.3"}
    at_cap = assess(load_config(with_master | {"budget_cap_ms": "200"}, {}))
    assert any(line.startswith(master) for line in at_cap.works)
    above = assess(load_config(with_master | {"budget_cap_ms": "200.5"}, {}))
    assert not any(line.startswith(master) for line in above.works)


def test_background_refresh_at_its_fresh_ttl_is_inactive() -> None:
    """The prober refreshes in the background only while the interval is below the fresh ttl."""
    at_ttl = assess(load_config(GOOD | {"prober_refresh_interval_s": "0.05"}, {}))
    assert any(
        "is on but inactive: --prober-refresh-interval-s=0.05" in line and "--prober-fresh-ttl-s=0.05 (default)" in line
        for line in at_ttl.will_not_work
    )


def test_a_value_with_an_undecodable_byte_or_a_newline_is_reported_on_its_line(tmp_path: Path) -> None:
    """A file name's byte that is not UTF-8 reaches Python as an unpaired surrogate: a strict UTF-8
    stdout (the usual locales') refused the report with a traceback, exit 1 on a config that was
    fine. A newline in a value broke the table's line in two."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONIOENCODING"] = "utf-8:strict"
    env["KVROUTE_KVCM_INSTANCE_ID"] = "inst\nance"  # not used with the fallback off, but shown
    log_flag = os.fsencode(tmp_path) + b"/\xff.log"
    result = subprocess.run(
        [sys.executable, "-P", "-m", "router.cli", "check-config", "--kvcm-fallback", "false",
         "--workers", "10.1.0.1:8000", "--decision-log", log_flag],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    out = result.stdout.decode()
    assert "result: OK" in out
    assert "\\udcff.log" in out  # the flag's value, the undecodable byte escaped
    assert any(line.split()[:2] == ["--kvcm-instance-id", "inst\\u000aance"] for line in out.splitlines()), out
