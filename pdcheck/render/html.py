"""A page as one self-contained HTML file: inline CSS, no script, no link, no image, nothing fetched; the
versions and environment and the --json document in <details> blocks, collapsed until clicked."""

from __future__ import annotations

from html import escape

from pdcheck.render.page import Page, Table

CSS = """body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;
color:#1f2328}h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}table{border-collapse:collapse;margin:.5em 0}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f6f8fa}
pre{background:#f6f8fa;padding:.8em;overflow-x:auto;white-space:pre-wrap;word-break:break-all}
.state{font-weight:bold;padding:1px 6px;border-radius:4px}.PASS{background:#dafbe1}.FAIL{background:#ffebe9}
.HARNESS{background:#fff8c5}.READY{background:#ddf4ff}details{margin:1em 0}summary{cursor:pointer;font-weight:bold}"""


def _table(t: Table, heading: bool = True) -> list[str]:
    out = [f"<h2>{escape(t.title)}</h2>"] if heading else []
    out.append("<table>")
    out.append("<tr>" + "".join(f"<th>{escape(c)}</th>" for c in t.columns) + "</tr>")
    for row in t.rows:
        out.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return out


def render(page: Page) -> str:
    state = page.state.split()[0]
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           f"<title>{escape(page.title)}: {escape(page.state)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
           f"<h1>{escape(page.title)}</h1>",
           f'<p class="summary"><span class="state {state}">{escape(page.state)}</span> {escape(page.summary)}</p>']
    if page.facts.rows:
        out += _table(page.facts, heading=False)
    for t in page.tables:
        out += _table(t)
    for n in page.notes:
        out += [f"<h2>{escape(n.title)}</h2>", "<ul>"] + [f"<li>{escape(i)}</li>" for i in n.items] + ["</ul>"]
    out += ["<h2>Reproduce</h2>", f"<p>{escape(page.reproduce_note)}:</p>",
            f"<pre><code>{escape(chr(10).join(page.reproduce))}</code></pre>"]
    out += ["<details>", "<summary>Versions and environment</summary>"]
    for t in page.environment:
        out += _table(t)
    out.append("</details>")
    if page.document is not None:
        out += ["<details>", "<summary>The --json document</summary>",
                f"<pre><code>{escape(page.document)}</code></pre>", "</details>"]
    out += ["</body>", "</html>", ""]
    return "\n".join(out)
