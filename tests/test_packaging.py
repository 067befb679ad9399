"""A fresh `pip install -e '.[test]'` must be enough: pdcheck imports only the standard library, its declared
dependencies, and (lazily, behind a clear error) its declared extras."""

from __future__ import annotations

import ast
import sys
import tomllib

from conftest import ROOT

# import name -> distribution name as pyproject.toml declares it
IMPORT_TO_DIST = {"typer": "typer", "rich": "rich", "torch": "torch", "nixl": "nixl", "zmq": "pyzmq",
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
    assert {"pytest", "ruff", "matplotlib", "ray"} <= test
