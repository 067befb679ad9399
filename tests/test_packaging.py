"""A fresh `pip install -e '.[test]'` must be enough: pdcheck imports only the standard library, its declared
dependencies, and (lazily, behind a clear error) its declared extras."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from conftest import ROOT, SCENARIOS

# import name -> distribution name as pyproject.toml declares it
IMPORT_TO_DIST = {"typer": "typer", "rich": "rich", "torch": "torch", "nixl_cu13": "nixl-cu13", "zmq": "pyzmq",
                  "msgspec": "msgspec", "numpy": "numpy", "matplotlib": "matplotlib", "ray": "ray"}


def _declared() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(meta["dependencies"]) + [r for extra in meta["optional-dependencies"].values() for r in extra]
    return {r.split(">")[0].split("=")[0].split("[")[0].split("<")[0].strip().lower() for r in reqs}


def test_every_import_is_stdlib_or_declared() -> None:
    declared = _declared()
    bad = []
    for path in sorted((ROOT / "pdcheck").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for name in names:
                top = name.split(".")[0]
                if top == "pdcheck" or top in sys.stdlib_module_names:
                    continue
                if IMPORT_TO_DIST.get(top) not in declared:
                    bad.append(f"{path.relative_to(ROOT)}: import {name}")
    assert not bad, "undeclared imports (a fresh install lacks them):\n" + "\n".join(bad)


def test_test_extra_has_what_the_tests_need() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    test = {r.split(">")[0].strip().lower() for r in meta["optional-dependencies"]["test"]}
    assert {"pytest", "ruff", "matplotlib", "ray", "markdown-it-py"} <= test


def _setuptools_ok() -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    return int(setuptools.__version__.split(".")[0]) >= 68


@pytest.mark.skipif(not _setuptools_ok(), reason="building the wheel offline needs setuptools >= 68 installed")
def test_the_wheel_ships_every_bundled_scenario(tmp_path) -> None:
    """A non-editable install gets the scenarios as package data (pdcheck/scenarios), found by name from anywhere."""
    src = tmp_path / "src"  # a copy: the in-tree build leaves build/ and *.egg-info behind
    for part in ("pyproject.toml", "README.md", "pdcheck", "scenarios"):
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, src / part, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(ROOT / part, src / part)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = tmp_path.glob("pdcheck-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.removeprefix("pdcheck/scenarios/") for n in names if n.startswith("pdcheck/scenarios/"))
    assert shipped == sorted(str(p.relative_to(SCENARIOS)) for p in SCENARIOS.rglob("*.toml"))


def test_one_nixl_build_is_declared() -> None:
    """The `nixl` meta package pulls both nixl-cu12 and nixl-cu13; pdcheck depends on one build."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    nixl = [d for d in deps if d.lower().startswith("nixl")]
    assert len(nixl) == 1 and nixl[0].split(">")[0].split("=")[0].strip() in ("nixl-cu12", "nixl-cu13"), nixl


def test_xdist_groups_hold_with_the_installed_pytest(tmp_path) -> None:
    """The suite's `--dist loadgroup` keeps each xdist_group on one worker (one Ray cluster at a time, one smoke run
    for every snapshot): pytest 9.2 with pytest-xdist 3.8 silently spread them (pyproject.toml pins pytest)."""
    (tmp_path / "test_grouped.py").write_text(
        "import os\nimport pytest\n\npytestmark = pytest.mark.xdist_group('one')\n\n\n"
        "@pytest.mark.parametrize('i', range(8))\ndef test_x(i):\n"
        "    with open(f'worker-{i}', 'w') as f:\n        f.write(os.environ['PYTEST_XDIST_WORKER'])\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "4", "--dist", "loadgroup", "-p", "no:randomly",
                          "-p", "no:cacheprovider", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    workers = {(tmp_path / f"worker-{i}").read_text() for i in range(8)}
    assert len(workers) == 1, f"one group ran on {sorted(workers)}"
