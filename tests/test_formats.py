"""--format markdown|html and `pdcheck report` (docs/json.md, "Formats"): every command's real --json document,
written by the real CLI, rendered by `pdcheck report` and checked with a Markdown parser (markdown-it-py: the
tables and the <details> block) and the stdlib's HTML parser (balanced tags, the summary and the table rows,
nothing fetched); --format directly on a few commands, the same tables as the saved document's page."""

from __future__ import annotations

import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt
from test_json_schema import BENCH, SEED_LOG, TINY, cli, serving

from pdcheck.render import render

VOID = {"meta", "br", "hr", "wbr"}  # HTML elements without an end tag


# ------------------------------------------------------------------------------------------------- the checks
def md_tables(text: str) -> list[list[list[str]]]:
    """Every table the Markdown parser finds: its rows (header first) of cell texts."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    tables: list[list[list[str]]] = []
    for t in tokens:
        if t.type == "table_open":
            tables.append([])
        elif t.type == "tr_open":
            tables[-1].append([])
        elif t.type == "inline" and tables and tables[-1] and t.level >= 4:  # inside th/td
            tables[-1][-1].append("".join(c.content for c in t.children or [] if c.type in ("text", "code_inline")))
    return tables


def check_markdown(text: str, doc: dict[str, Any]) -> list[list[list[str]]]:
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    blocks = "".join(t.content for t in tokens if t.type == "html_block")
    assert "<details>" in blocks and "<summary>Versions and environment</summary>" in blocks, text
    assert blocks.count("<details>") == blocks.count("</details>")
    tables = md_tables(text)
    assert tables and all(len({len(r) for r in tab}) == 1 for tab in tables), "a row with a stray | splits its cells"
    heading = next(t.content for t in tokens if t.type == "inline")
    assert heading.startswith(f"pdcheck {doc['command']}")
    assert _exit_words(doc) in text
    fences = [t for t in tokens if t.type == "fence" and t.info == "sh"]
    assert fences and all(line.startswith("pdcheck ") for line in fences[0].content.splitlines())
    _rows_shown(doc, [" | ".join(r) for tab in tables for r in tab])
    return tables


class Tags(HTMLParser):
    """Balanced tags, the text, every attribute."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.seen: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.text: list[str] = []
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen.append(tag)
        self.attrs += attrs
        if tag == "tr":
            self.rows.append([])
        if tag in ("td", "th"):
            self._cell = []
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def check_html(text: str, doc: dict[str, Any]) -> Tags:
    p = Tags()
    p.feed(text)
    p.close()
    assert p.stack == [], f"unclosed: {p.stack}"
    assert text.startswith("<!DOCTYPE html>") and {"html", "head", "body", "style", "table", "details"} <= set(p.seen)
    assert not {"script", "link", "img", "iframe", "object", "embed", "base"} & set(p.seen)
    assert not [a for a in p.attrs if a[0] in ("src", "href", "action", "srcset")], p.attrs
    assert "url(" not in text and "@import" not in text  # nothing fetched by the CSS either
    body = "".join(p.text)
    assert f"pdcheck {doc['command']}" in body and _exit_words(doc) in body
    _rows_shown(doc, [" | ".join(r) for r in p.rows])
    return p


def _exit_words(doc: dict[str, Any]) -> str:
    return "no exit code yet" if doc["exit_code"] is None else f"exit {doc['exit_code']}"


def _rows_shown(doc: dict[str, Any], rows: list[str]) -> None:
    """The document's main list shows up row for row: each verdict's release, rank and status (each check's
    name and status, each case's scenario, each bench row's label) in one table row."""
    for key, fields in (("verdicts", ("release", "rank", "status")), ("checks", ("name", "status")),
                        ("cases", ("scenario", "release")), ("rows", ("label", "bytes"))):
        for item in doc.get(key) or []:
            want = [str(item[f]) for f in fields]
            assert any(all(w in r for w in want) for r in rows), (key, want)


def report(path: Path, fmt: str) -> str:
    p = cli("report", str(path), "--format", fmt)
    assert p.returncode == 0 and p.stderr == b"", p.stderr.decode()
    return p.stdout.decode()


def rendered(tmp_path: Path, name: str, line: bytes) -> dict[str, Any]:
    """A --json line saved, then `pdcheck report` of it in both formats, each checked."""
    doc = json.loads(line)
    f = tmp_path / f"{name}.json"
    f.write_bytes(line)
    check_markdown(report(f, "markdown"), doc)
    check_html(report(f, "html"), doc)
    return doc


def one_line(p: subprocess.CompletedProcess[bytes]) -> bytes:
    lines = p.stdout.splitlines()
    assert len(lines) == 1, p.stdout.decode() + p.stderr.decode()
    return lines[0]


# ------------------------------------------------------------------------------- every command, through report
RUNS = {
    "handshake-vllm": ("handshake", *TINY, "--vllm", "0.9.1,0.9.2", "--json"),
    "handshake-sglang": ("handshake", "sglang-kv-dtype-mismatch", "--sglang", "0.5.8,0.5.13", "--json"),
    "requests": ("requests", "requests-read-failure", "--vllm", "0.13.0", "--json"),
    "from-logs": ("scenario", "from-logs", str(SEED_LOG), str(SEED_LOG), "--json"),
    "transfer-bench": (*BENCH, "--json"),
    "doctor": ("doctor", "--no-transfer", "--json"),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_command_renders(tmp_path: Path, name: str) -> None:
    p = cli(*RUNS[name])
    doc = rendered(tmp_path, name, one_line(p))
    assert doc["exit_code"] == p.returncode


def test_smoke_renders(tmp_path: Path) -> None:
    (tmp_path / "sc").mkdir()
    (tmp_path / "sc" / "tiny.toml").write_text(
        'name = "tiny"\nvllm = ["0.9.1"]\n[prefill]\ntp_size = 1\nnum_blocks = 64\n'
        '[decode]\ntp_size = 1\nnum_blocks = 64\n[expect]\n"0.9.1" = "ok"\n"corrected" = "assert"\n')
    p = cli("smoke", str(tmp_path / "sc"), "--no-transfer", "--json")
    doc = rendered(tmp_path, "smoke", one_line(p))
    assert (doc["exit_code"], doc["failed"]) == (1, 1) == (p.returncode, 1)


def test_serve_and_probe_render(tmp_path: Path) -> None:
    with serving(*TINY, "--vllm", "0.11.1") as (_proc, line):
        ready = rendered(tmp_path, "serve-vllm", line)
        p = cli("probe", f"{ready['host']}:{ready['base_port']}", "--vllm", "0.11.1", *TINY, "--json")
    rendered(tmp_path, "probe-vllm", one_line(p))
    with serving("--sglang", "0.5.8") as (_proc, line):
        ready = rendered(tmp_path, "serve-sglang", line)
        p = cli("probe", ready["bootstrap_url"], "--sglang", "0.5.8", "--json")
    rendered(tmp_path, "probe-sglang", one_line(p))


def test_list_renders(tmp_path: Path) -> None:
    from pdcheck.cli import LAZY

    if "list" not in LAZY:
        pytest.skip("no `pdcheck list` in this tree")
    p = cli("list", "--json")
    rendered(tmp_path, "list", one_line(p))


# ----------------------------------------------------------------------------------------- --format directly
def _before_reproduce(text: str) -> str:
    return text.split("### Reproduce")[0]


def test_format_markdown_is_the_json_documents_page(tmp_path: Path) -> None:
    """from-logs is deterministic: its --format page and the page of its saved --json document agree up to the
    Reproduce section (which differs by design: the command line vs how to render the file again)."""
    args = ("scenario", "from-logs", str(SEED_LOG), str(SEED_LOG))
    direct = cli(*args, "--format", "markdown")
    assert direct.returncode == 0, direct.stderr.decode()
    f = tmp_path / "fl.json"
    f.write_bytes(one_line(cli(*args, "--json")))
    text = direct.stdout.decode()
    check_markdown(text, json.loads(f.read_bytes()))
    assert _before_reproduce(text) == _before_reproduce(report(f, "markdown"))
    # the exact command line, shell-quoted, then the same run as --json
    assert f"pdcheck scenario from-logs {SEED_LOG} {SEED_LOG} --format markdown\n" in text
    assert f"pdcheck scenario from-logs {SEED_LOG} {SEED_LOG} --json\n" in text


def test_format_html_to_a_file(tmp_path: Path) -> None:
    out = tmp_path / "hs.html"
    p = cli("handshake", *TINY, "--vllm", "0.9.1", "--format", "html", "--output", str(out))
    assert p.returncode == 0 and p.stdout == b"" and str(out).encode() in p.stderr, p.stderr.decode()
    text = out.read_text()
    tags = check_html(text, {"command": "handshake", "exit_code": 0,
                             "verdicts": [{"release": "0.9.1", "rank": "D0", "status": "ok"}]})
    assert ["release", "rank", "status", "contacted", "proof"] in tags.rows
    assert "this host when the page was written" in text and "--output" in text


def test_format_markdown_doctor_and_requests(tmp_path: Path) -> None:
    p = cli("doctor", "--no-transfer", "--format", "markdown")
    tables = check_markdown(p.stdout.decode(), {"command": "doctor", "exit_code": p.returncode})
    checks = next(t for t in tables if t[0][:2] == ["name", "status"])
    assert len(checks) > 10 and {r[1] for r in checks[1:]} <= {"PASS", "WARN", "FAIL", "SKIP"}
    p = cli("requests", "requests-read-failure", "--vllm", "0.13.0", "--format", "json")  # --format json = --json
    doc = json.loads(one_line(p))
    assert doc["command"] == "requests" and doc["exit_code"] == p.returncode


# --------------------------------------------------------------------------------------------------- bad input
def _bad(p: subprocess.CompletedProcess[bytes], *words: str) -> None:
    err = p.stderr.decode()
    assert p.returncode == 2 and p.stdout == b"" and len(err.splitlines()) == 1, err
    assert err.startswith("pdcheck: error:") and all(w in err for w in words), err


def test_report_refuses_what_is_not_a_pdcheck_document(tmp_path: Path) -> None:
    cases = {"garbage.json": b"not json at all", "other.json": b'{"tool": "other", "version": "1"}',
             "list.json": b"[1, 2]", "envelope-less.json": b'{"tool": "pdcheck", "command": "handshake"}',
             "future.json": json.dumps({"tool": "pdcheck", "version": "9", "schema": "pdcheck/9", "command": "x",
                                        "framework": None, "exit_code": 0}).encode()}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        _bad(cli("report", str(tmp_path / name)), name)
    env = {"tool": "pdcheck", "version": "0.1.0", "schema": "pdcheck/1", "command": "transfer-bench",
           "framework": None, "exit_code": 0}
    (tmp_path / "b.jsonl").write_text(json.dumps({**env, "type": "header"}) + "\n" + json.dumps(env) + "\n")
    _bad(cli("report", str(tmp_path / "b.jsonl")), "--jsonl")
    _bad(cli("report", str(tmp_path / "missing.json")), "missing.json")
    _bad(cli("report", str(tmp_path)), "directory")
    (tmp_path / "ok.json").write_text(json.dumps(env))
    _bad(cli("report", str(tmp_path / "ok.json"), "--format", "pdf"), "--format")


def test_format_flags_refused_before_anything_runs(tmp_path: Path) -> None:
    _bad(cli("doctor", "--format", "xml"), "--format", "xml")
    _bad(cli("doctor", "--json", "--format", "html"), "--json", "--format")
    _bad(cli("doctor", "--output", str(tmp_path / "x.html")), "--output")
    _bad(cli("doctor", "--format", "json", "--output", str(tmp_path / "x.html")), "--output")
    _bad(cli("doctor", "--format", "html", "--output", str(tmp_path / "no" / "x.html")), "--output")


# ------------------------------------------------------------------------------ hostile text stays text (unit)
def test_hostile_cells_stay_text() -> None:
    """A peer's strings reach a page (a detail, an engine id): pipes, tags, backticks and newlines stay one
    cell's text in both formats."""
    nasty = "a|b <script>alert(1)</script> `x` *y* _z_ [l](http://e.x) &amp;\nline2"
    doc = {"tool": "pdcheck", "version": "0", "schema": "pdcheck/1", "command": "probe", "framework": "toy",
           "exit_code": 1, "endpoint": nasty,
           "verdicts": [{"release": "1.0", "rank": "D0", "status": "error", "detail": nasty}],
           "notes": ["# not a heading", "1. not a list"]}
    md = render(doc, "markdown", host=False)
    tables = md_tables(md)
    verdicts = next(t for t in tables if t[0][:3] == ["release", "rank", "status"])
    assert verdicts[1][3] == nasty.replace("\n", " ")
    tokens = MarkdownIt("commonmark").enable("table").parse(md)
    assert not [t for t in tokens if t.type in ("html_inline", "link_open", "em_open", "strong_open")]
    assert not [t for t in tokens if t.type == "heading_open" and t.tag == "h1"]
    assert not [t for t in tokens if t.type == "ordered_list_open"]
    page = render(doc, "html", host=False)
    tags = check_html(page, doc)
    assert "script" not in tags.seen and nasty.replace("\n", " ") in [c for r in tags.rows for c in r]
    assert re.search(r"<td>a\|b &lt;script&gt;", page)
