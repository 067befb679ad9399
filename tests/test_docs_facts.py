"""Every count and release range the docs state comes from the code: checked here against `pdcheck list`'s
catalogue (pdcheck.catalog) and the release tables (releaseline.span), so a new scenario or release line that
the docs do not follow fails the suite."""

from __future__ import annotations

import re
import tomllib

import pytest
from conftest import ROOT

from pdcheck import catalog
from pdcheck.scenariofile import BUNDLED
from pdcheck.sglang.releases import TABLE as SGLANG
from pdcheck.vllm.releases import TABLE as VLLM

SCENARIOS = catalog.scenarios()


def _text(name: str) -> str:
    return " ".join((ROOT / name).read_text().split())  # one line: a phrase may wrap anywhere


def _names(framework: str, phase: str) -> set[str]:
    return {s.name for s in SCENARIOS if s.framework == framework and s.phase == phase}


def _push() -> set[str]:
    out = set()
    for path in (BUNDLED / "requests").glob("*.toml"):
        doc = tomllib.loads(path.read_text())
        if doc.get("requests", {}).get("mode") == "push":
            out.add(path.stem)
    return out


CLAIMS = [  # (doc, the phrase with the number as (\d+), what the code has)
    ("README.md", r"(\d+) scenarios ship with it", len(SCENARIOS)),
    ("README.md", r"SGLang's (\d+) are listed", len(_names("sglang", "handshake"))),
    ("README.md", r"the (\d+) request-path ones", len(_names("vllm", "requests"))),
    ("README.md", r"(\d+) of them in push mode", len(_push())),
    ("docs/scenarios-and-flags.md", r"There are (\d+) for vLLM's handshake", len(_names("vllm", "handshake"))),
    ("docs/scenarios-and-flags.md", r"SGLang's (\d+), in `scenarios/sglang/`", len(_names("sglang", "handshake"))),
    ("docs/scenarios-and-flags.md", r"the (\d+) of `pdcheck requests`", len(_names("vllm", "requests"))),
]


@pytest.mark.parametrize("doc, phrase, count", CLAIMS, ids=[f"{d}:{p[:30]}" for d, p, _c in CLAIMS])
def test_a_count_the_docs_state_is_the_codes(doc: str, phrase: str, count: int) -> None:
    found = re.findall(phrase, _text(doc))
    assert found, f"{doc}: no '{phrase}'"
    assert all(int(n) == count for n in found), f"{doc}: '{phrase}' says {found}, the catalogue has {count}"


def test_the_readme_names_every_bundled_vllm_handshake_scenario() -> None:
    para = _text("README.md").split("The bundled ones (vLLM):", 1)[1].split("; SGLang's", 1)[0]
    assert set(re.findall(r"`([a-z0-9-]+)`", para)) == _names("vllm", "handshake")


def test_the_scenario_tables_name_every_bundled_scenario() -> None:
    table = _text("docs/scenarios-and-flags.md").split("| name | what it reproduces |", 1)[1].split("## ", 1)[0]
    named = {n for cell in re.findall(r"\| ((?:`[a-z0-9-]+`(?:, )?)+) \|", table) for n in re.findall(r"`([^`]+)`", cell)}
    assert named == _names("vllm", "handshake")
    sglang = _text("docs/sglang.md")
    assert all(re.search(rf"\| `?{n}`? \|", sglang) for n in _names("sglang", "handshake"))


def test_the_modelled_ranges_are_the_tables() -> None:
    readme = _text("README.md")
    assert f"every vLLM release {VLLM.modelled}" in readme and f"disaggregation {SGLANG.modelled}" in readme


def test_every_range_of_release_lines_the_docs_write_is_a_tables() -> None:
    """A range in the one wording ('0.9.2 to 0.9.x', releaseline.span) names a line or a modelled range as the
    code has it: a table that grows or shifts a line fails here until the docs follow."""
    from pdcheck import frameworks

    tables = [t for fw in frameworks.all_frameworks() if (t := fw.release_table()) is not None]  # every framework's
    known = {t.modelled for t in tables} | {r for t in tables for r, _x in t.ranges()}
    wording = re.compile(r"\b\d+\.\d+\.\d+(?:\.post\d+)? to \d+(?:\.\d+)*\.x\b")
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in wording.finditer(" ".join(path.read_text().split())):
            if m.group(0) not in known:
                bad.append(f"{path.name}: {m.group(0)}")
    assert not bad, bad


def test_the_docs_use_no_hidden_old_flag_spelling() -> None:
    """A hidden flag (an old spelling kept working, as probe's --tp-size for --prefill-tp) is not what the docs
    teach: every flag the docs show after `pdcheck COMMAND` is one that COMMAND's --help lists."""
    import typer

    from pdcheck.cli import app

    root = typer.main.get_command(app)
    hidden = {}
    for name in root.list_commands(None):  # type: ignore[arg-type]  # the CLI loads its commands lazily
        cmd = root.get_command(None, name)  # type: ignore[arg-type]
        for param in getattr(cmd, "params", []):
            if getattr(param, "hidden", False):
                for opt in param.opts:
                    hidden.setdefault(opt, set()).add(name)
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"pdcheck ([a-z-]+)\b([^`\n]*)", path.read_text()):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", m.group(2)):
                if m.group(1) in hidden.get(flag, ()):
                    bad.append(f"{path.name}: pdcheck {m.group(1)} ... {flag}")
    assert not bad, bad
