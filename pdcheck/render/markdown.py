"""A page as GitHub-flavoured Markdown: pipe tables, and <details> blocks (GitHub renders them collapsed) for the
versions and environment and for the --json document, so the whole diagnosis pastes into an issue."""

from __future__ import annotations

import re

from pdcheck.render.page import Page, Table

# What Markdown or a pipe table reads as syntax inside a line; a backslash before ASCII punctuation is always a
# literal in CommonMark, so escaping these keeps a cell's text as written. An underscore between two letters or
# digits never starts emphasis, so UCX_NET_DEVICES stays readable in the raw text.
_SPECIAL = re.compile(r"[\\`*\[\]<>|~&]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_LEADING = re.compile(r"^([#+\-=]|\d+[.)])")  # what would start a heading or a list at the start of a line


def escape(text: str) -> str:
    return _SPECIAL.sub(lambda m: "\\" + m.group(0), text)


def escape_line(text: str) -> str:
    """escape(), and what would open a heading or a list where the text starts a block (a list item's text)."""
    return _LEADING.sub(lambda m: m.group(0)[:-1] + "\\" + m.group(0)[-1], escape(text))


def _table(t: Table, heading: bool = True) -> list[str]:
    out = [f"### {escape(t.title)}", ""] if heading else []
    out.append("| " + " | ".join(escape(c) for c in t.columns) + " |")
    out.append("|" + "---|" * len(t.columns))
    for row in t.rows:
        out.append("| " + " | ".join(escape(c) for c in row) + " |")
    out.append("")
    return out


def _fence(text: str, lang: str = "") -> list[str]:
    """A fenced block that no backtick run inside the text can close early."""
    ticks = "`" * max(3, max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    return [f"{ticks}{lang}", text, ticks, ""]


def render(page: Page) -> str:
    out = [f"## {escape(page.title)}", "", f"**{page.state}** — {escape(page.summary)}", ""]
    if page.facts.rows:
        out += _table(page.facts, heading=False)
    for t in page.tables:
        out += _table(t)
    for n in page.notes:
        out += [f"### {escape(n.title)}", ""] + [f"- {escape_line(i)}" for i in n.items] + [""]
    out += ["### Reproduce", "", escape(page.reproduce_note) + ":", ""] + _fence("\n".join(page.reproduce), "sh")
    out += ["<details>", "<summary>Versions and environment</summary>", ""]
    for t in page.environment:
        out += _table(t)
    out += ["</details>", ""]
    if page.document is not None:
        out += ["<details>", "<summary>The --json document</summary>", ""] + _fence(page.document, "json")
        out += ["</details>", ""]
    return "\n".join(out)
