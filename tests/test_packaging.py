"""Packaging: the installed distribution is complete, importable, and inert on import; the product
(``router``, ``actors``) needs neither the simulator package (``kvroute_sim``) nor the ``demo`` extra.

Works for a regular install (CI: ``pip install '.[test]'`` from a clean clone — the
distribution's file list is the truth) and for an editable install (developers — the
installed package directories are walked). Imports run in a fresh interpreter whose
working directory is empty, so only the installed packages can be found.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import Distribution, distributions
from pathlib import Path, PurePosixPath

import pytest

from router import api
from router.cli import COMMANDS

DIST_NAME = "kvroute"
PACKAGES = ("router", "actors", "kvroute_sim")
PRODUCT = ("router", "actors")
SIMULATOR = "kvroute_sim"
# Top-level modules of the demo extra's distributions (matplotlib, psutil, trio-asyncio).
DEMO_EXTRA_MODULES = ("matplotlib", "psutil", "trio_asyncio")
FORBIDDEN_FOR_PRODUCT = (SIMULATOR, *DEMO_EXTRA_MODULES)
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def is_editable(dist: Distribution) -> bool:
    direct_url = dist.read_text("direct_url.json")
    return bool(direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"))


def installed_python_files(dist: Distribution) -> dict[PurePosixPath, Path]:
    """Installed .py files of PACKAGES: package-relative path → file on disk."""
    listed = {
        PurePosixPath(str(f)): Path(str(dist.locate_file(f)))
        for f in dist.files or ()
        if f.parts[0] in PACKAGES and f.suffix == ".py"
    }
    if listed:
        return listed
    assert is_editable(dist), f"{DIST_NAME} lists no {PACKAGES} files and is not an editable install"
    found: dict[PurePosixPath, Path] = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not an installed package"
        for location in spec.submodule_search_locations:
            base = Path(location)
            for path in base.rglob("*.py"):
                found[PurePosixPath(package, *path.relative_to(base).parts)] = path
    return found


def source_python_files() -> set[PurePosixPath]:
    return {
        PurePosixPath(p.relative_to(SOURCE_ROOT).as_posix())
        for package in PACKAGES
        for p in (SOURCE_ROOT / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def module_name(relative: PurePosixPath) -> str:
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.fixture(scope="module")
def dist() -> Distribution:
    """The installed distribution: ``python -m pytest`` puts the checkout on the path first, where an
    editable build leaves its ``kvroute.egg-info`` (metadata of no install)."""
    installs = [d for d in distributions(name=DIST_NAME) if Path(str(d.locate_file(""))).resolve() != SOURCE_ROOT]
    assert installs, f"{DIST_NAME} is not installed"
    return installs[0]


@pytest.fixture(scope="module")
def installed(dist: Distribution) -> dict[PurePosixPath, Path]:
    return installed_python_files(dist)


def test_distribution_metadata(dist: Distribution) -> None:
    assert dist.metadata["Name"] == DIST_NAME
    assert set(dist.metadata["Requires-Python"].split(",")) == {">=3.11", "<3.14"}
    assert [ep.value for ep in dist.entry_points if ep.name == "kvroute"] == ["router.cli:main"]


def requirement_names(dist: Distribution, extra: str | None) -> set[str]:
    """Distribution names required without a marker (extra=None) or by ``extra``."""
    names: set[str] = set()
    for line in dist.requires or ():
        requirement, _, marker = line.partition(";")
        wanted = not marker.strip() if extra is None else f'extra == "{extra}"' in marker
        if wanted:
            names.add(re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-"))
    return names


def test_a_plain_install_pulls_no_simulator_dependencies(dist: Distribution) -> None:
    """``pip install kvroute`` (no extras) installs the router's runtime dependencies only."""
    runtime = requirement_names(dist, None)
    assert {"grpcio", "trio", "hypercorn", "prometheus-client"} <= runtime
    assert runtime.isdisjoint({"matplotlib", "psutil", "trio-asyncio"}), runtime
    assert {"matplotlib", "psutil", "trio-asyncio"} <= requirement_names(dist, "demo")
    # The test extra runs the simulator tests, so it installs the demo extra too.
    assert DIST_NAME in requirement_names(dist, "test")


def test_every_source_module_is_in_the_installed_distribution(installed: dict[PurePosixPath, Path]) -> None:
    """A sub-package left out of the build's file list is missing here (with a wheel install)."""
    missing = sorted(str(p) for p in source_python_files() - set(installed))
    assert not missing, f"in the source tree but not installed: {missing}"


def test_every_source_package_directory_is_a_regular_package() -> None:
    """packages.find only ships directories with __init__.py; an editable install would hide the hole."""
    holes = sorted(
        str(d.relative_to(SOURCE_ROOT))
        for package in PACKAGES
        for d in [SOURCE_ROOT / package, *(SOURCE_ROOT / package).rglob("*")]
        if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py")) and not (d / "__init__.py").is_file()
    )
    assert not holes, f"directories with modules but no __init__.py: {holes}"


def test_generated_protobuf_modules_are_installed(installed: dict[PurePosixPath, Path]) -> None:
    protos = sorted((SOURCE_ROOT / "proto").glob("*.proto"))
    assert protos, "no .proto sources"
    for proto in protos:
        assert PurePosixPath("router", "wire", f"{proto.stem}_pb2.py") in installed, proto.name
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.origin is not None
        assert (Path(spec.origin).parent / "py.typed").is_file(), f"{package}/py.typed not installed"


def test_modules_are_imported_from_the_installed_distribution(
    dist: Distribution, installed: dict[PurePosixPath, Path]
) -> None:
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.origin is not None
        assert Path(spec.origin).resolve() == installed[PurePosixPath(package, "__init__.py")].resolve()
        if not is_editable(dist):
            # A regular install must not be shadowed by the source tree (the venv itself may live
            # inside the checkout, as CI's .venv does, so compare with the source package folder).
            assert not Path(spec.origin).resolve().is_relative_to(SOURCE_ROOT / package), spec.origin


IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, sys, threading, traceback

    errors = {}
    def import_all(names):
        for name in names:
            try:
                importlib.import_module(name)
            except BaseException:
                errors[name] = traceback.format_exc()

    names = sys.argv[1:]
    import_all([n for n in names if n.split(".")[0] in PRODUCT])
    loaded_by_product = sorted({n.split(".")[0] for n in sys.modules} & set(FORBIDDEN_FOR_PRODUCT))
    import_all([n for n in names if n.split(".")[0] not in PRODUCT])
    import psutil

    process = psutil.Process()
    print(json.dumps({
        "errors": errors,
        "loaded_by_product": loaded_by_product,
        "files": {name: sys.modules[name].__file__ for name in sys.argv[1:] if name in sys.modules},
        "threads": [t.name for t in threading.enumerate()],
        "children": len(process.children(recursive=True)),
        "connections": len(process.net_connections(kind="all")),
    }))
    """
)


def test_every_installed_module_imports_and_starts_nothing(
    installed: dict[PurePosixPath, Path], tmp_path: Path
) -> None:
    names = sorted({module_name(p) for p in installed})
    assert {"router.cli", "kvroute_sim.demo.cli"} <= set(names)
    script = f"PRODUCT = {PRODUCT!r}\nFORBIDDEN_FOR_PRODUCT = {FORBIDDEN_FOR_PRODUCT!r}\n{IMPORT_ALL}"
    result = subprocess.run(
        [sys.executable, "-c", script, *names],
        cwd=tmp_path,  # nothing importable here: the installed package is the only `router`
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["errors"] == {}, "\n".join(report["errors"].values())
    assert report["loaded_by_product"] == [], "the product imports simulator code or the demo extra"
    assert {Path(f).resolve() for f in report["files"].values()} == {p.resolve() for p in installed.values()}
    assert report["threads"] == ["MainThread"]
    assert report["children"] == 0
    assert report["connections"] == 0


def test_cli_subcommands_are_installed(tmp_path: Path) -> None:
    """Every subcommand's module is installed and ``kvroute <command> --help`` exits at once."""
    exe = shutil.which("kvroute", path=str(Path(sys.executable).parent))
    assert exe is not None, "console script 'kvroute' not installed beside this interpreter"
    result = subprocess.run([exe, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: kvroute")
    for name, command in COMMANDS.items():
        assert importlib.util.find_spec(command.module) is not None, command.module
        result = subprocess.run(
            [exe, name, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f"usage: kvroute {name}")


HELP_THEN_MODULES = textwrap.dedent(
    """
    import json, sys
    from router.cli import main
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
    print(json.dumps(sorted({n.split(".")[0] for n in sys.modules})))
    """
)


@pytest.mark.parametrize("argv", [["--help"], ["route", "--help"], ["serve", "--help"]])
def test_the_product_cli_imports_no_simulator_code(argv: list[str], tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-P", "-c", HELP_THEN_MODULES, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert "router" in loaded
    assert loaded.isdisjoint(FORBIDDEN_FOR_PRODUCT), sorted(loaded & set(FORBIDDEN_FOR_PRODUCT))


def test_generated_code_is_not_tracked_by_git() -> None:
    if not (SOURCE_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    tracked = subprocess.run(
        [git, "ls-files", "-z"], cwd=SOURCE_ROOT, capture_output=True, check=True, timeout=30
    ).stdout.decode()
    generated = [f for f in tracked.split("\0") if "_pb2" in PurePosixPath(f).name]
    assert generated == [], f"generated protobuf code is committed: {generated}"



def test_the_public_api_exports_what_the_docs_name_and_each_name_resolves() -> None:
    assert [name for name in api.__all__ if not hasattr(api, name)] == []
    docs = (SOURCE_ROOT / "README.md").read_text() + (SOURCE_ROOT / "docs" / "design.md").read_text()
    imports = re.findall(r"from router\.api import ([\w, ]+)", docs)
    imported = {name.strip() for line in imports for name in line.split(",")}
    assert {"KvrouteConfig", "RouteRequest", "open_router"} <= imported  # the docs' example still imports them
    # And what a caller catches or holds: route() on a closed router raises RouterClosed; open_router
    # yields a RouterHandle, route() returns a RouteDecision.
    named = imported | {"RouterClosed", "RouterHandle", "RouteDecision"}
    assert named <= set(api.__all__), named - set(api.__all__)
