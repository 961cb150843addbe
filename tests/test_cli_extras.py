"""The simulator commands without the ``demo`` extra: one line naming the extra, exit 2, no traceback.

Nothing is uninstalled: the subprocess runs without the site module (``-S``) and gets a site directory
made of links to this interpreter's installed packages, minus the ones a test hides.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from router.cli import COMMANDS, DIST_NAME, missing_extra, missing_requirements

RUN_CLI = "import site, sys; site.addsitedir(sys.argv[1]); from router.cli import main; sys.exit(main(sys.argv[2:]))"

SIM_COMMANDS = sorted(name for name, command in COMMANDS.items() if command.extra == "demo")


def site_without(root: Path, hidden: tuple[str, ...]) -> Path:
    """A site directory linking every installed top-level entry except those starting with ``hidden``."""
    site = root / "site"
    site.mkdir()
    for directory in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in Path(directory).iterdir():
            if entry.name.lower().startswith(hidden) or (site / entry.name).exists():
                continue
            (site / entry.name).symlink_to(entry)
    return site


def run_cli(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-S", "-P", "-c", RUN_CLI, str(site), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_sim_commands_are_the_ones_that_need_the_demo_extra() -> None:
    assert SIM_COMMANDS == ["bench", "demo", "sim-cluster"]
    assert all(COMMANDS[name].module.startswith("kvroute_sim.") for name in SIM_COMMANDS)
    assert all(command.extra is None for command in COMMANDS.values() if command.module.startswith("router."))


def test_missing_requirements_reads_only_the_extras_lines() -> None:
    requirements = [
        "trio>=0.35",
        'matplotlib>=3.9; extra == "demo"',
        "psutil>=7.0 ; extra == 'demo'",
        'no-such-dist-xyz>=1; extra == "demo"',
        f'{DIST_NAME}[demo]; extra == "test"',
        'also-missing>=1; extra == "test"',
    ]
    installed = {"trio", "matplotlib"}
    assert missing_requirements("demo", requirements, installed.__contains__) == ["psutil", "no-such-dist-xyz"]
    assert missing_requirements("test", requirements, installed.__contains__) == ["also-missing"]
    assert missing_requirements("other", requirements, installed.__contains__) == []


def test_the_demo_extra_is_declared_and_installed_here() -> None:
    """The test extra pulls the demo extra: in this environment nothing of it is missing."""
    assert missing_extra("demo") == []
    assert missing_requirements("demo", ['matplotlib>=3.9; extra == "demo"']) == []


@pytest.mark.parametrize("command", SIM_COMMANDS)
def test_a_sim_command_without_the_extra_names_the_extra_in_one_line(command: str, tmp_path: Path) -> None:
    site = site_without(tmp_path, hidden=("matplotlib",))
    result = run_cli(site, tmp_path, command)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"kvroute {command} needs the 'demo' extra (missing: matplotlib): pip install 'kvroute[demo]'"
    ]


def test_the_controlled_environment_runs_a_sim_command_when_nothing_is_hidden(tmp_path: Path) -> None:
    site = site_without(tmp_path, hidden=())
    result = run_cli(site, tmp_path, "demo", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: kvroute demo")


def test_product_commands_run_without_the_extra(tmp_path: Path) -> None:
    site = site_without(tmp_path, hidden=("matplotlib", "psutil", "trio_asyncio"))
    result = run_cli(site, tmp_path, "check-config")
    # Without deployment settings the assessment reports problems (exit 1); what matters is that it ran.
    assert result.returncode == 1, result.stderr
    assert "\nresult: " in result.stdout
    assert result.stderr == ""

