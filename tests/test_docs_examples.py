"""Docs are tests: every console example of README.md and docs/*.md runs and prints what the doc shows
(tests/docskit.py, on sybil), every block that shows a pdcheck command is such an example, and a block that is
not run says why."""

from __future__ import annotations

import re
from pathlib import Path

import docskit
import pytest

EXAMPLES = docskit.examples()


@pytest.mark.parametrize("example", EXAMPLES,
                         ids=[f"{Path(ex.path).relative_to(docskit.ROOT)}:{ex.line}" for ex in EXAMPLES])
def test_console_example(example) -> None:
    example.evaluate()


def _fenced(text: str) -> list[tuple[int, str, list[str]]]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^\s*```(\S*)", lines[i])
        if m:
            j = i + 1
            while not lines[j].strip().startswith("```"):
                j += 1
            out.append((i + 1, m.group(1), lines[i + 1:j]))
            i = j
        i += 1
    return out


def test_every_block_that_shows_a_pdcheck_command_is_a_console_example() -> None:
    """A command in a ```bash (or untyped) block would never run: it is a ```console transcript, or ```text (a
    diagram, a synopsis)."""
    bad = []
    for path in docskit.DOCS:
        for line, lang, body in _fenced(path.read_text()):
            if lang in ("console", "text", "json", "toml"):
                continue
            if any(docskit.COMMAND_LINE.match(ln) for ln in body):
                bad.append(f"{path.relative_to(docskit.ROOT)}:{line} ({lang or 'untyped'})")
    assert not bad, bad


def test_the_docs_have_console_examples_and_each_not_run_says_why() -> None:
    assert len(EXAMPLES) >= 20
    for ex in EXAMPLES:
        block = ex.parsed
        assert block.steps, f"{ex.path}:{ex.line}: a console block without a `$ ` command"
        if block.not_run is not None:
            assert len(block.not_run.split()) >= 3, f"{ex.path}:{ex.line}: `not run:` needs a reason"
