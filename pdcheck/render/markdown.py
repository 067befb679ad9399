"""A page as GitHub-flavoured Markdown, compact: the summary, the run's facts and the top-level tables open; the
nested tables, the versions and environment and the --json document in <details> blocks (GitHub renders them
collapsed); the whole page under PAGE_MAX characters, so it pastes into an issue (docs/json.md, "Formats").

Every string on the page is one line of printable text (pdcheck.render.text: control characters visible, CR and
LF included), then escaped here for Markdown, so no value, key, title, command line or summary can end a cell, a
line or a block, or open one."""

from __future__ import annotations

import dataclasses
import re
from html import escape as html_escape

from pdcheck.render.page import Budget, Notes, Page, Table, folded
from pdcheck.render.text import clean, cut

# A GitHub issue body holds 65,536 characters: the page leaves a third of it for the reporter's own words.
PAGE_MAX = 40_000
LEFT_OUT_MAX = 500  # characters of the line naming the tables left out
FOLDED_MAX = 300  # characters of the <summary> line naming the folded tables

# What Markdown or a pipe table reads as syntax inside a line (# also a heading's closing sequence; on GitHub @ a
# mention and $ math); a backslash before ASCII punctuation is always a literal in CommonMark, so escaping these
# keeps a cell's text as written. An underscore between two letters or digits never starts emphasis, so
# UCX_NET_DEVICES stays readable in the raw text.
_SPECIAL = re.compile(r"[\\`*\[\]<>|~&!@$#]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_LEADING = re.compile(r"^([+\-=]|\d+[.)])")  # what would start a heading or a list at the start of a line


def escape(text: str) -> str:
    """One line of Markdown text that reads as `text`: unprintable characters visible (no CR or LF is left to end
    the line), then the syntax characters escaped."""
    return _SPECIAL.sub(lambda m: "\\" + m.group(0), clean(text))


def escape_line(text: str) -> str:
    """escape(), and what would open a heading or a list where the text starts a block (a list item's text)."""
    return _LEADING.sub(lambda m: m.group(0)[:-1] + "\\" + m.group(0)[-1], escape(text.strip(" ")))


@dataclasses.dataclass
class Layout:
    """What a page shows, as a reader (or a Markdown parser) should find it: the headings, every table's rows
    (header first) and every list item as text, the fenced blocks' contents, in reading order.
    tests/test_hostile_render.py parses the page and compares."""

    headings: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    tables: list[list[list[str]]] = dataclasses.field(default_factory=list)
    items: list[str] = dataclasses.field(default_factory=list)
    fences: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Layout) -> None:
        self.headings += other.headings
        self.tables += other.tables
        self.items += other.items
        self.fences += other.fences


@dataclasses.dataclass
class Section:
    lines: list[str]
    shows: Layout


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(escape(c) for c in cells) + " |"


def _cut_cells(t: Table, n: int) -> list[str]:
    return [f"… {n} more rows: this page is kept under {PAGE_MAX} characters; the --json document has them",
            *[""] * (len(t.columns) - 1)]


def _table(t: Table, budget: Budget, heading: bool = True) -> Section | None:
    head = ([f"### {escape(t.title)}", ""] if heading else []) + [_row(t.columns), "|" + "---|" * len(t.columns)]
    lines, kept = budget.rows(head, [_row(r) for r in t.rows], lambda n: _row(_cut_cells(t, n)), t.title)
    if not lines:
        return None
    rows = t.rows[:kept] + ([_cut_cells(t, len(t.rows) - kept)] if kept < len(t.rows) else [])
    budget.take([""])
    return Section([*lines, ""], Layout(headings=[(3, t.title)] if heading else [], tables=[[t.columns, *rows]]))


def _notes(n: Notes, budget: Budget) -> Section | None:
    def cut_item(k: int) -> str:
        return f"… {k} more: this page is kept under {PAGE_MAX} characters"

    lines, kept = budget.rows([f"### {escape(n.title)}", ""], [f"- {escape_line(i)}" for i in n.items],
                              lambda k: f"- {escape_line(cut_item(k))}", n.title)
    if not lines:
        return None
    budget.take([""])
    items = n.items[:kept] + ([cut_item(len(n.items) - kept)] if kept < len(n.items) else [])
    return Section([*lines, ""], Layout(headings=[(3, n.title)], items=[i.strip(" ") for i in items]))


def _fence(text: str, lang: str = "") -> list[str]:
    """A fenced block that no backtick run inside the text can close early."""
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return [f"{ticks}{lang}", text, ticks, ""]


def render(page: Page) -> str:
    return layout(page)[0]


def layout(page: Page) -> tuple[str, Layout]:
    """The page's text and what it shows. Sections are added in order of importance while the page stays under
    PAGE_MAX characters (the head and Reproduce always; then the facts, the top-level tables, the notes, the
    versions and environment, the nested tables, the --json document), and written in reading order."""
    budget = Budget(PAGE_MAX - LEFT_OUT_MAX - FOLDED_MAX - 200)
    head = Section([f"## {escape(page.title)}", "", f"**{page.state}** — {escape(page.summary)}", ""],
                   Layout(headings=[(2, page.title)]))
    repro_text = "\n".join(clean(x) for x in page.reproduce)
    repro = Section(["### Reproduce", "", escape(page.reproduce_note) + ":", "", *_fence(repro_text, "sh")],
                    Layout(headings=[(3, "Reproduce")], fences=[repro_text]))
    budget.take(head.lines + repro.lines)
    facts = _table(page.facts, budget, heading=False) if page.facts.rows else None
    main = [_table(t, budget) for t in page.tables if t.main]
    notes = [_notes(n, budget) for n in page.notes]
    env = [_table(t, budget) for t in page.environment]
    more_tables = [t for t in page.tables if not t.main]
    more = [_table(t, budget) for t in more_tables]
    doc_lines: list[str] = []
    if page.document is not None:
        doc_lines = ["<details>", "<summary>The --json document</summary>", "", *_fence(page.document, "json"),
                     "</details>", ""]
        if not budget.take(doc_lines):
            doc_lines = []
    out = Section([], Layout())

    def put(*sections: Section | None) -> None:
        for s in sections:
            if s is not None:
                out.lines.extend(s.lines)
                out.shows.add(s.shows)

    put(head, facts, *main, *notes)
    if any(more):
        names = folded([t.title for t, s in zip(more_tables, more, strict=True) if s is not None], FOLDED_MAX)
        out.lines += ["<details>", f"<summary>{html_escape(clean(names))}</summary>", ""]
        put(*more)
        out.lines += ["</details>", ""]
    if budget.left_out:
        names = cut(", ".join(budget.left_out), LEFT_OUT_MAX - 150)
        out.lines += [escape(f"Left out to keep this page under {PAGE_MAX} characters (the --json document has "
                             f"them): {names}"), ""]
    put(repro)
    out.lines += ["<details>", "<summary>Versions and environment</summary>", ""]
    put(*env)
    out.lines += ["</details>", ""]
    if doc_lines:
        out.lines += doc_lines
        out.shows.fences.append(page.document or "")
    else:
        out.lines += [escape("The --json document is not on this page (it would not fit): --json writes it."), ""]
    return "\n".join(out.lines), out.shows
