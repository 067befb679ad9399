"""Untrusted text on every output (docs/reliability.md, "Pages, terminals and error lines"): one renderer
(pdcheck.render.text) under the Markdown and HTML pages, the console and the error line.

Property-based (hypothesis) over arbitrary strings and documents: a page parses (markdown-it-py, html.parser) to
exactly the structure the renderer meant (pdcheck.render.markdown.Layout: its headings, tables, list items and
fenced blocks) and holds no byte below 0x20 but its own newlines; the console lets no control character through;
json_shape measures what a decoder would build. Then live: an SGLang bootstrap server of this file's own (a real
http.server process) whose kv_cache_dtype carries CR, LF, |, ESC and BEL, read by `probe --format markdown`, the
rich table and `pdcheck report`; a side channel whose engine id is rich markup."""

from __future__ import annotations

import atexit
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from markdown_it import MarkdownIt
from test_hostile import ENV, contract, peer, run

from pdcheck.bounds import json_shape
from pdcheck.render import html as html_writer
from pdcheck.render import markdown as md_writer
from pdcheck.render import page as page_model
from pdcheck.render.text import clean, cut, shell_word, toml_string, visible, words_cut

# Nothing left on disk: hypothesis keeps a cache of the code's constants in .hypothesis/ of the working directory
# otherwise (and, with database=None below, no example database).
_HOME = tempfile.mkdtemp(prefix="pdcheck-hypothesis-")
set_hypothesis_home_dir(_HOME)
atexit.register(shutil.rmtree, _HOME, True)

# Characters that end or open something somewhere: line ends of every kind, terminal controls, Markdown and HTML
# syntax, bidi overrides, a lone surrogate (an undecodable byte under surrogateescape).
NASTY = list("\r\n\t\x00\x07\x08\x0b\x0c\x1b\x7f\x85\x9b\u2028\u2029\u202e\u200b\ufeff\udcff"
             "|`*_[]<>#-=+!&\\~$@:;'\"/ ()0123456789")
TEXT = st.text(st.one_of(st.sampled_from(NASTY), st.characters()), max_size=40)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True), TEXT)
JSON = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=4)), max_leaves=25)
ROW = st.dictionaries(TEXT, JSON, max_size=5)
BODY = st.dictionaries(TEXT, st.one_of(JSON, st.lists(ROW, min_size=1, max_size=5),
                                       st.lists(TEXT.map(lambda s: s + " x"), min_size=1, max_size=4),
                                       st.dictionaries(TEXT, ROW, min_size=1, max_size=3)), max_size=6)


@st.composite
def documents(draw: Any) -> dict[str, Any]:
    doc = {"tool": "pdcheck", "version": "0.1.0", "schema": "pdcheck/1", "command": draw(TEXT),
           "framework": draw(st.one_of(st.none(), TEXT)), "exit_code": draw(st.sampled_from([0, 1, 3, None]))}
    body = draw(BODY)
    for k in ("summary", "verdicts", "fail_spans", "floors", "rows"):  # the keys the summary line reads
        if draw(st.booleans()):
            body[k] = draw(st.one_of(TEXT, st.lists(ROW, max_size=3), ROW))
    return {**doc, **{k: v for k, v in body.items() if k not in doc}}


# database=None: nothing left on disk (hypothesis keeps its examples in .hypothesis/ otherwise)
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def raw_controls(text: str, keep: str = "\n") -> list[str]:
    """Characters a terminal acts on: C0 (but `keep`), DEL and C1."""
    return [c for c in text if (ord(c) < 0x20 and c not in keep) or 0x7f <= ord(c) < 0xa0]


# ---------------------------------------------------------------------------------------- the page, as parsed
def _inline(tok: Any, odd: list[str], allowed: tuple[str, ...] = ()) -> str:
    out = []
    for c in tok.children or []:
        if c.type == "text":
            out.append(c.content)
        elif c.type not in allowed:
            odd.append(c.type)
    return "".join(out)


def md_structure(text: str) -> dict[str, Any]:
    """What markdown-it finds: headings, tables (rows of cell texts), list items, fences, HTML blocks, the
    summary paragraph, and every inline or block token the renderer never writes."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    got: dict[str, Any] = {"headings": [], "tables": [], "items": [], "fences": [], "html": [], "odd": [],
                           "paragraphs": []}
    odd = got["odd"]
    known = {"heading_open", "heading_close", "inline", "paragraph_open", "paragraph_close", "table_open",
             "table_close", "thead_open", "thead_close", "tbody_open", "tbody_close", "tr_open", "tr_close",
             "th_open", "th_close", "td_open", "td_close", "bullet_list_open", "bullet_list_close",
             "list_item_open", "list_item_close", "fence", "html_block"}
    for i, t in enumerate(tokens):
        if t.type not in known:
            odd.append(t.type)
        if t.type == "heading_open":
            got["headings"].append((int(t.tag[1]), _inline(tokens[i + 1], odd)))
        elif t.type == "table_open":
            got["tables"].append([])
        elif t.type == "tr_open":
            got["tables"][-1].append([])
        elif t.type in ("th_open", "td_open"):
            nxt = tokens[i + 1]
            got["tables"][-1][-1].append(_inline(nxt, odd) if nxt.type == "inline" else "")
        elif t.type == "list_item_open":
            got["items"].append(_inline(tokens[i + 2], odd))
        elif t.type == "fence":
            got["fences"].append(t.content)
        elif t.type == "html_block":
            got["html"].append(t.content)
        elif t.type == "paragraph_open" and tokens[i - 1].type != "list_item_open":
            got["paragraphs"].append(_inline(tokens[i + 1], odd, ("strong_open", "strong_close")))
    return got


def check_markdown_page(text: str, shows: md_writer.Layout, pg: page_model.Page) -> None:
    got = md_structure(text)
    assert got["odd"] == [], got["odd"]
    assert got["headings"] == [(lvl, h.strip(" ")) for lvl, h in shows.headings]
    assert got["tables"] == [[[c.strip(" ") for c in row] for row in tab] for tab in shows.tables]
    assert got["items"] == shows.items
    assert got["fences"] == [f + "\n" for f in shows.fences]
    assert got["paragraphs"][0] == f"{pg.state} — {pg.summary}".strip(" ")
    assert all(re.fullmatch(r"<details>\n(<summary>[^\n<]*</summary>\n)?|</details>\n", h) for h in got["html"]), \
        got["html"]
    assert raw_controls(text) == []
    assert len(text) <= md_writer.PAGE_MAX


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.seen: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.tables: list[list[list[str]]] = []
        self.h2: list[str] = []
        self._cell: list[str] | None = None
        self._h2: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen.append(tag)
        self.attrs += attrs
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "h2":
            self._h2 = []
        if tag != "meta":
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None
        if tag == "h2" and self._h2 is not None:
            self.h2.append("".join(self._h2))
            self._h2 = None

    def handle_data(self, data: str) -> None:
        for part in (self._cell, self._h2):
            if part is not None:
                part.append(data)


def check_html_page(text: str, pg: page_model.Page) -> None:
    p = Tags()
    p.feed(text)
    p.close()
    assert p.stack == []
    assert set(p.seen) <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "span", "table", "tr",
                           "th", "td", "ul", "li", "pre", "code", "details", "summary"}, set(p.seen)
    assert {a for a, _ in p.attrs} <= {"lang", "charset", "class"}
    tables = ([pg.facts] if pg.facts.rows else []) + [t for t in pg.tables if t.main] + \
        [t for t in pg.tables if not t.main] + pg.environment
    assert p.tables == [[t.columns, *t.rows] for t in tables]
    assert raw_controls(text) == []


@PROPS
@given(documents(), st.one_of(st.none(), st.lists(TEXT, max_size=4)))
def test_any_document_renders_as_the_renderer_means(doc: dict[str, Any], argv: list[str] | None) -> None:
    ctx = page_model.Context(argv=None if argv is None else tuple(argv), source="RUN\n# x.json", host=None)
    pg = page_model.build(doc, ctx)
    text, shows = md_writer.layout(pg)
    check_markdown_page(text, shows, pg)
    check_html_page(html_writer.render(pg), pg)


@PROPS
@given(st.lists(TEXT, min_size=1, max_size=3), TEXT, TEXT)
def test_cells_keys_and_summaries_stay_in_their_place(values: list[str], key: str, summary: str) -> None:
    """The issue's shapes: a lone CR in a value, LF in a key, the command or the summary."""
    doc = {"tool": "pdcheck", "version": "0", "schema": "pdcheck/1", "command": f"c\r\n## {key}",
           "framework": None, "exit_code": 1, "summary": f"s\r{summary}\n# pwned",
           "verdicts": [{"release": v, "rank": "D0", "status": f"\r{v}", key + "\n| a |": v} for v in values],
           key or "k": {f"{key}\n### pwned": v for v in values}}
    pg = page_model.build(doc, page_model.Context(argv=("handshake", f"\r{key}"), host=None))
    text, shows = md_writer.layout(pg)
    check_markdown_page(text, shows, pg)
    assert "pwned" not in "".join(h for _, h in md_structure(text)["headings"] if h == "pwned")
    check_html_page(html_writer.render(pg), pg)


def test_caps_say_what_they_cut() -> None:
    """1 MB keys and summaries, 100,000-row key/value tables and lists, 100,000 columns: bounded pages that say
    what the --json document holds beyond them."""
    big = "k" * (1 << 20)
    doc = {"tool": "pdcheck", "version": "0", "schema": "pdcheck/1", "command": big, "framework": None,
           "exit_code": 0, "summary": big, big: "v", "kv": {f"k{i}": i for i in range(100_000)},
           "notes": [f"note {i}" for i in range(100_000)], "wide": [{f"c{i}": i for i in range(100_000)}],
           "rows": [{"a": i} for i in range(100_000)]}
    pg = page_model.build(doc, page_model.Context(host=None))
    text, shows = md_writer.layout(pg)
    check_markdown_page(text, shows, pg)
    assert f"({1 << 20} characters)" in text
    assert "99900 more rows in the --json document" in text and "99900 more keys in the --json document" in text
    assert "99900 more in the --json document" in text and "99970 more columns in the --json document" in text
    h = html_writer.render(pg)
    check_html_page(h, pg)
    assert len(h) < 1 << 20


# --------------------------------------------------------------------------------------- one text mechanism
@PROPS
@given(TEXT, st.integers(0, 50))
def test_clean_is_printable_bounded_and_idempotent(s: str, limit: int) -> None:
    out = clean(s, limit)
    assert out.isprintable() and clean(out) == out
    assert len(cut(s, limit)) <= limit + len(f"… ({len(s)} characters)")
    assert visible(s, keep="\n").replace("\n", "").isprintable()
    assert visible(out) == out


@settings(max_examples=40, deadline=None, database=None)
@given(st.text(st.one_of(st.sampled_from(NASTY), st.characters(blacklist_categories=("Cs",))), min_size=1,
               max_size=30).filter(lambda s: "\x00" not in s))
def test_shell_words_are_visible_and_reproduce_the_argument(arg: str) -> None:
    word = shell_word(arg)
    assert word.isprintable()
    out = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, check=True).stdout
    assert out.decode("utf-8", "surrogateescape") == arg


@PROPS
@given(TEXT)
def test_toml_strings_read_back_and_show_nothing_raw(s: str) -> None:
    """from-logs writes a log's text into a scenario file (and on stdout) through toml_string."""
    import tomllib

    t = toml_string(s)
    assert t.isprintable()
    assert tomllib.loads(f"k = {t}")["k"] == re.sub(r"[\ud800-\udfff]", "\ufffd", s)


def test_error_words_are_cut_and_the_line_kept() -> None:
    line = words_cut("list: " + "w" * 100_000 + " is not one of scenarios, releases", 200, 2000)
    assert line.startswith("list: www") and line.endswith("(100000 characters) is not one of scenarios, releases")


@PROPS
@given(JSON)
def test_json_shape_is_what_a_decoder_builds(value: Any) -> None:
    def shape(v: Any) -> tuple[int, int]:
        if isinstance(v, (list, dict)):
            kids = [shape(x) for x in (v.values() if isinstance(v, dict) else v)]
            return 1 + max((d for d, _ in kids), default=0), 1 + max(0, len(kids) - 1) + sum(n for _, n in kids)
        return 0, 0

    text = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    assert json_shape(text) == shape(value)


# ------------------------------------------------------------------------------------------------- terminal
@PROPS
@given(TEXT)
def test_the_console_lets_no_control_character_through(s: str) -> None:
    from rich.table import Table
    from rich.text import Text

    from pdcheck.console import console

    for color in (False, True):
        buf = io.StringIO()
        con = console(file=buf, width=100, force_terminal=color, color_system="standard" if color else None)
        t = Table(title=s)
        t.add_column(s)
        t.add_column("text")
        t.add_row(s, Text(s, style="red"))
        con.print(t)
        con.print(s, markup=False)
        con.print(Text(s))
        out = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())  # the console's own colours
        assert raw_controls(out) == [], out


# ---------------------------------------------------------------------------------------------- live peers
HOSTILE = "auto\r\n## pwned\n| x | y |\x1b[31mRED\x07`code`<b>bold</b>\r"

# An SGLang 0.5.23 bootstrap server on http.server (a real HTTP server, its own process): GET /route answers the
# parallel info (every query value -1) or one rank; kv_cache_dtype is argv[1].
BOOTSTRAP = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

INFO = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16,
        "kv_cache_dtype": sys.argv[1], "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
        "dsv41_spec_layout": None, "kv_layout": None, "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False, "prefill_http_port": None, "target_tp_rank": None,
        "target_tp_ranks": None, "target_cp_ranks": None, "target_pp_ranks": None, "required_dst_info_num": None,
        "required_prefill_response_num": None}

class Route(BaseHTTPRequestHandler):
    def do_GET(self):
        q = parse_qs(urlparse(self.path).query)
        whole = all(v == ["-1"] for v in q.values())
        body = json.dumps(INFO if whole else {"rank_ip": "127.0.0.1", "rank_port": 9}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

srv = ThreadingHTTPServer(("127.0.0.1", 0), Route)
print(srv.server_address[1], flush=True)
srv.serve_forever()
'''


@contextmanager
def bootstrap(dtype: str) -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, dtype], stdout=subprocess.PIPE, env=ENV)
    try:
        line = proc.stdout.readline() if proc.stdout else b""
        assert line, "the bootstrap server did not start"
        yield int(line)
    finally:
        proc.kill()
        proc.wait()


def test_a_peers_kv_cache_dtype_stays_in_its_cell(tmp_path: Path) -> None:
    with bootstrap(HOSTILE) as port:
        url = f"http://127.0.0.1:{port}"
        page = run("probe", url, "--sglang", "auto", "--timeout", "10", "--format", "markdown")
        table = run("probe", url, "--sglang", "auto", "--timeout", "10")
        saved = run("probe", url, "--sglang", "auto", "--timeout", "10", "--json")
    for r in (page, table, saved):
        contract(r, r.code if r.code in (0, 1) else -1, within_s=30)
        assert raw_controls(r.out) == [] and raw_controls(r.err) == [], (r.out, r.err)
    shown = page_model.cell(HOSTILE)  # a cell is one line: line breaks as spaces, the rest visible
    # the page: the peer's value is one cell of the info table, escapes visible; no heading, row or HTML of its own
    got = md_structure(page.out)
    assert got["odd"] == [] and not [h for _, h in got["headings"] if "pwned" in h]
    rows = [row for tab in got["tables"] for row in tab if row[0] == "kv_cache_dtype"]
    assert rows == [["kv_cache_dtype", shown]], rows
    # the rich table: the same text, visible
    assert "\\x1b[31mRED\\x07" in table.out and "## pwned" in table.out
    # the saved document: `pdcheck report` renders it exactly as the renderer means
    f = tmp_path / "probe.json"
    f.write_text(saved.out)
    r = run("report", str(f))
    contract(r, 0, within_s=30)
    doc = json.loads(saved.out)
    pg = page_model.build(doc, page_model.Context(source=str(f)))
    text, shows = md_writer.layout(pg)
    assert r.out.rstrip("\n") == text.rstrip("\n")  # what the CLI printed is the page meant
    check_markdown_page(text, shows, pg)
    h = run("report", str(f), "--format", "html")
    contract(h, 0, within_s=30)
    check_html_page(h.out, pg)


def test_a_side_channels_engine_id_is_neither_markup_nor_escapes() -> None:
    evil = "[/bold][red]x\x1b]0;title\x07\x1b[2J"
    with peer("zmq-meta", json.dumps({"engine_id": evil, "attn_backend_name": "[/x]\r\nFAKE"})) as port:
        r = run("probe", f"127.0.0.1:{port}", "--vllm", "0.9.1", "--timeout", "5")
    contract(r, r.code if r.code in (0, 1) else -1, within_s=30)
    assert raw_controls(r.out) == [] and "[/bold][red]x\\x1b]0;title\\x07" in r.out


def test_a_page_of_the_seed_scenario_fits_an_issue_and_labels_the_stripped_rerun() -> None:
    r = run("handshake", "seed-19338-tp8", "--vllm", "0.9.1", "--format", "markdown", limit_s=120)
    contract(r, 1, within_s=120, rss_mb=1024)
    assert len(r.out) < 45_000, len(r.out)
    got = md_structure(r.out)
    verdicts = got["tables"][1]
    assert verdicts[0][:3] == ["release", "rank", "status"]
    proof = verdicts[0].index("proof")
    for row in verdicts[1:]:
        assert ("asserts_stripped=yes" in row[proof]) == (row[2] == "assert"), row
    assert any(h.startswith("<details>\n<summary>") and "more tables: decode_ranks" in h for h in got["html"])
