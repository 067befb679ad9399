"""The README's two commands are CI: .ci/run runs them as the README's first code block writes them
(.ci/readme_commands.py reads the block), and every test module imports as that plain `pytest -q` runs it (the
console script: the clone is not on sys.path, tests/ is, through the rootdir conftest)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from conftest import ROOT

TESTS = ROOT / "tests"


def _readme_commands() -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / ".ci" / "readme_commands.py")], capture_output=True, text=True,
                         check=True)
    return out.stdout.splitlines()


def test_the_readme_block_is_the_two_commands_ci_runs() -> None:
    install, suite = _readme_commands()
    assert re.fullmatch(r"pip install -e \. && pdcheck handshake seed-19338-tp8", install), install
    assert suite == "pip install -e '.[test]' && pytest -q", suite
    readme = (ROOT / "README.md").read_text()
    assert "(exit 1)" in readme.split("## ")[0]  # .ci/run expects the seed's exit 1, as the README says


def test_ci_runs_the_readme_commands_and_no_other_pytest() -> None:
    script = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    code = [ln for ln in script if ln and not ln.startswith("#")]
    assert any('readme_commands.py 1)"' in ln for ln in code) and any('readme_commands.py 2)"' in ln for ln in code)
    assert not [ln for ln in code if re.search(r"\bpytest\b", ln)], "CI runs pytest only as the README writes it"


def _local_imports(path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_every_test_module_imports_as_plain_pytest_runs_it() -> None:
    """`from tests.x import y` needs the clone on sys.path (python -m pytest puts it there, pytest does not); a
    module of tests/ is imported by its own name, as conftest and the *kit modules are."""
    local = {p.stem for p in TESTS.glob("*.py")}
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        for line, module in _local_imports(path):
            top = module.split(".")[0]
            if top == "tests" or (top in local and "." in module):
                bad.append(f"{path.name}:{line}: {module}")
    assert not bad, bad
