"""A page as one self-contained HTML file: inline CSS, no script, no link, no image, nothing fetched; the nested
tables, the versions and environment and the --json document in <details> blocks, collapsed until clicked; the
whole file under PAGE_MAX characters. Every string is printable text first (pdcheck.render.text), then escaped."""

from __future__ import annotations

from html import escape as _escape

from pdcheck.render.page import Budget, Page, Table, folded
from pdcheck.render.text import clean, cut

PAGE_MAX = 8 << 20  # characters of one file; pdcheck's documents stay far below it (a table shows 100 rows)
FOLDED_MAX = 300

CSS = """body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;
color:#1f2328}h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f6f8fa}
pre{background:#f6f8fa;padding:.8em;overflow-x:auto;white-space:pre-wrap;word-break:break-all}
.state{font-weight:bold;padding:1px 6px;border-radius:4px}.PASS{background:#dafbe1}.FAIL{background:#ffebe9}
.HARNESS{background:#fff8c5}.READY{background:#ddf4ff}details{margin:1em 0}summary{cursor:pointer;font-weight:bold}"""


def escape(text: str) -> str:
    """Text that reads as `text` in HTML: unprintable characters visible, then &, <, >, quotes escaped."""
    return _escape(clean(text))


def _cut_cells(t: Table, n: int) -> list[str]:
    return [f"… {n} more rows: this file is kept under {PAGE_MAX} characters; the --json document has them",
            *[""] * (len(t.columns) - 1)]


def _row(cells: list[str], tag: str = "td") -> str:
    return "<tr>" + "".join(f"<{tag}>{escape(c)}</{tag}>" for c in cells) + "</tr>"


def _table(t: Table, budget: Budget, heading: bool = True) -> list[str]:
    head = ([f"<h2>{escape(t.title)}</h2>"] if heading else []) + ["<table>", _row(t.columns, "th")]
    lines, _kept = budget.rows(head, [_row(r) for r in t.rows], lambda n: _row(_cut_cells(t, n)), t.title)
    if not lines:
        return []
    budget.take(["</table>"])
    return [*lines, "</table>"]


def render(page: Page) -> str:
    state = page.state.split()[0]
    budget = Budget(PAGE_MAX - 2 * FOLDED_MAX - len(CSS) - 1000)
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f"<title>{escape(page.title)}: {escape(page.state)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
           f"<h1>{escape(page.title)}</h1>",
           f'<p class="summary"><span class="state {state}">{escape(page.state)}</span> {escape(page.summary)}</p>']
    repro = ["<h2>Reproduce</h2>", f"<p>{escape(page.reproduce_note)}:</p>",
             f"<pre><code>{_lines(page.reproduce)}</code></pre>"]
    budget.take(out + repro)
    facts = _table(page.facts, budget, heading=False) if page.facts.rows else []
    main = [x for t in page.tables if t.main for x in _table(t, budget)]
    notes: list[str] = []
    for n in page.notes:
        lines, _kept = budget.rows([f"<h2>{escape(n.title)}</h2>", "<ul>"], [f"<li>{escape(i)}</li>" for i in n.items],
                                   lambda k: f"<li>… {k} more: this file is kept under {PAGE_MAX} characters</li>",
                                   n.title)
        if lines:
            budget.take(["</ul>"])
            notes += [*lines, "</ul>"]
    env = [x for t in page.environment for x in _table(t, budget)]
    more_tables = [t for t in page.tables if not t.main]
    more = [(t.title, _table(t, budget)) for t in more_tables]
    doc = ["<details>", "<summary>The --json document</summary>", f"<pre><code>{escape(page.document)}</code></pre>",
           "</details>"] if page.document is not None else []
    if doc and not budget.take(doc):
        doc = []
    out += facts + main + notes
    shown = [(title, lines) for title, lines in more if lines]
    if shown:
        out += ["<details>", f"<summary>{escape(folded([title for title, _ in shown], FOLDED_MAX))}</summary>"]
        out += [x for _, lines in shown for x in lines]
        out.append("</details>")
    if budget.left_out:
        names = cut(", ".join(budget.left_out), 350)
        note = f"Left out to keep this file under {PAGE_MAX} characters (the --json document has them): {names}"
        out.append(f"<p>{escape(note)}</p>")
    out += repro
    out += ["<details>", "<summary>Versions and environment</summary>", *env, "</details>"]
    out += doc
    out += ["</body>", "</html>", ""]
    return "\n".join(out)


def _lines(lines: list[str]) -> str:
    return "\n".join(escape(x) for x in lines)
