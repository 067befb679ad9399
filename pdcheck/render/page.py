"""One page model for every command, built from its --json document alone (docs/json.md): a summary line, the
run's facts, the tables, the notes, the versions and environment, the commands that reproduce it. Nothing here
knows a command or a framework: a section comes from the shape of the document's keys (a list of objects is a
table, a list of sentences is a note list, an environment-like object goes in the collapsible block), so a new
command or framework renders without a line here."""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

# The envelope's keys (pdcheck.envelope.ENVELOPE_KEYS; not imported: the renderer sits below the envelope).
ENVELOPE = ("tool", "version", "schema", "command", "framework", "exit_code")
# Top-level objects that describe where the run ran rather than what it found: the collapsible block.
ENVIRONMENT = ("versions", "env", "environment", "host", "config", "transport", "timings", "info")
# Tables first, in this order when present; the rest in the document's order.
FIRST = ("verdicts", "checks", "cases", "rows")
# What each exit code means for every command (README, "Exit codes"); 2 and the signals write no document.
EXIT = {0: ("PASS", "exit 0 (everything checked survives)"),
        1: ("FAIL", "exit 1 (a release fails, a check fails or an expectation does not hold)"),
        3: ("HARNESS ERROR", "exit 3 (the harness failed: the verdicts are incomplete)")}
MAX_ROWS = 100  # rows of one table, and tables nested under one key; the rest are in the --json document
CELL_MAX = 300  # characters of one table cell; the full value is in the --json document
JSON_MAX = 48 << 10  # the whole document goes in its own collapsible block up to this size (an issue holds 64 KB)
ENV_PREFIXES = ("UCX_", "NIXL_")  # + each framework's (render.Output.env_prefixes, from the registry)
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")


@dataclasses.dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]


@dataclasses.dataclass
class Notes:
    title: str
    items: list[str]


@dataclasses.dataclass
class Page:
    title: str
    state: str  # PASS, FAIL, HARNESS ERROR, READY
    summary: str  # the one line: the exit code's meaning and what the run found
    facts: Table  # the run's scalar fields
    tables: list[Table]
    notes: list[Notes]
    environment: list[Table]  # versions and environment, for the collapsible block
    reproduce: list[str]  # shell lines
    reproduce_note: str
    document: str | None  # the --json document itself when small enough to paste


@dataclasses.dataclass(frozen=True)
class Context:
    """What the document does not carry: the command line that ran (None when rendering a saved document) and
    this host's facts at that moment."""

    argv: tuple[str, ...] | None = None
    source: str | None = None  # `pdcheck report FILE`: the file
    host: dict[str, Any] | None = None


def cell(value: Any, limit: int = CELL_MAX) -> str:
    """One value as one line of text: lists joined, objects as key=value, floats to 4 digits, cut at limit."""
    text = _text(value)
    text = " ".join(text.split("\n"))
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v) if not isinstance(v, (list, dict)) else f"[{_text(v)}]" for v in value)
    if isinstance(value, dict):  # unset fields left out: the --json document has them all
        return ", ".join(f"{k}={_text(v)}" if not isinstance(v, (list, dict)) else f"{k}=[{_text(v)}]"
                         for k, v in value.items() if v is not None and v != "" and v != [] and v != {})
    return str(value)


def _is_rows(value: Any) -> bool:
    """A list of objects (a null entry is an empty row: a D rank without a transfer)."""
    return (isinstance(value, list) and any(isinstance(v, dict) for v in value)
            and all(isinstance(v, dict) or v is None for v in value))


def _is_sentences(value: Any) -> bool:
    return (isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
            and any(" " in v for v in value))


def _is_keyed_rows(value: Any) -> bool:
    """An object of objects (per release, per rank): a table with the key as its first column."""
    return isinstance(value, dict) and bool(value) and all(isinstance(v, dict) and v for v in value.values())


def _keyed(value: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, **v} for k, v in value.items()]


def _label(row: dict[str, Any], index: int) -> str:
    """How a nested table names the row it came from: its first short scalar (a release, a rank), else its index."""
    for k, v in row.items():
        if isinstance(v, (str, int)) and not isinstance(v, bool) and len(str(v)) <= 40:
            return f"{k}={v}"
    return str(index)


def table(title: str, items: list[dict[str, Any] | None]) -> tuple[Table, list[tuple[str, list[Any]]]]:
    """A list of objects as a table: a column per key (in first-seen order, all-empty columns left out); a value
    that is itself a list of objects becomes its own table (returned as (title, rows)), not a cell."""
    rows = [r if r is not None else {} for r in items]
    columns: list[str] = []
    nested: list[tuple[str, list[Any]]] = []
    # A key that holds objects in any row is a nested table in every row, never a column.
    tabular = {k for r in rows for k, v in r.items() if _is_rows(v) or _is_keyed_rows(v)}
    for i, r in enumerate(rows):
        for k, v in r.items():
            if k in tabular:
                if _is_rows(v) or _is_keyed_rows(v):
                    nested.append((f"{title} {_label(r, i)}: {k}", v if _is_rows(v) else _keyed(v)))
            elif k not in columns:
                columns.append(k)
    nested = nested[:MAX_ROWS]
    columns = [c for c in columns if any(r.get(c) not in (None, "", [], {}) for r in rows)]
    out = [[cell(r.get(c)) for c in columns] for r in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS and columns:
        out.append([f"… {len(rows) - MAX_ROWS} more rows in the --json document"] + [""] * (len(columns) - 1))
    return Table(title, columns, out), nested


def flatten(prefix: str, value: Any, out: list[list[str]], depth: int = 0) -> None:
    """An object as key/value rows, nested keys dotted (two levels; deeper ones as one cell)."""
    if isinstance(value, dict) and value and depth < 2:
        for k, v in value.items():
            if v is not None and v != [] and v != {}:
                flatten(f"{prefix}.{k}" if prefix else str(k), v, out, depth + 1)
    else:
        out.append([prefix, cell(value)])


def summary(doc: dict[str, Any]) -> tuple[str, str]:
    """(state, the one line): the exit code's meaning, then what the run found, from whichever of the common
    keys the document has (a summary sentence, failing-release spans, verdicts, pass/fail counts, ok)."""
    code = doc.get("exit_code")
    if code is None:
        state, meaning = "READY", "no exit code yet (written while the command runs: serve's ready document)"
    else:
        state, meaning = EXIT.get(code, ("FAIL", f"exit {code}"))
    found: list[str] = []
    if isinstance(doc.get("summary"), str):
        found.append(doc["summary"])
    spans = doc.get("fail_spans")
    if isinstance(spans, list) and spans:
        for sp in spans:
            if isinstance(sp, dict):
                fails = ", ".join(map(str, sp.get("fails") or []))
                fixed = f"fixed in {sp['fixed_in']}" if sp.get("fixed_in") else "no later modelled release survives"
                found.append(f"fails: {fails} · {fixed}")
    elif isinstance(spans, list) and doc.get("harness_errors") == []:
        found.append("every modelled release survives")
    verdicts = doc.get("verdicts")
    if _is_rows(verdicts):
        per: dict[str, dict[str, int]] = {}
        for v in verdicts:
            counts = per.setdefault(str(v.get("release")), {})
            counts[str(v.get("status"))] = counts.get(str(v.get("status")), 0) + 1
        found.append("; ".join(f"{rel}: " + ", ".join(s if n == 1 else f"{s} ×{n}" for s, n in c.items())
                               for rel, c in per.items()))
    if isinstance(doc.get("passed"), int) and isinstance(doc.get("failed"), int):
        found.append(f"{doc['passed']} passed, {doc['failed']} failed")
    floors = doc.get("floors")
    if isinstance(floors, dict) and floors.get("failures"):
        found.append("floors failed: " + "; ".join(map(str, floors["failures"])))
    if isinstance(doc.get("rows"), list) and "ok" in doc:
        wrong = sum(r.get("wrong", 0) for r in doc["rows"] if isinstance(r, dict) and isinstance(r.get("wrong"), int))
        found.append(f"{len(doc['rows'])} rows, {wrong} blocks wrong")
    return state, " · ".join([meaning, *found])


def host_facts(env: dict[str, str], distributions: tuple[str, ...] = (),
               env_prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """This host at render time: Python, the platform, the installed distributions pdcheck works with (and the
    frameworks' own, `distributions`), and the environment variables that steer UCX, NIXL and the frameworks'
    side channels (`env_prefixes`; only those: nothing else of the environment goes into a page meant to be
    pasted)."""
    import importlib.metadata as md
    import platform

    dists: dict[str, str] = {}
    for name in ("pdcheck", "nixl", "nixl-cu12", "nixl-cu13", "torch", *distributions, "msgspec", "pyzmq"):
        try:
            dists[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "installed": dists,
            "variables": {k: v for k, v in sorted(env.items())
                          if k.startswith((*ENV_PREFIXES, *env_prefixes)) or k in ENV_NAMES}}


def reproduce(doc: dict[str, Any], ctx: Context) -> tuple[list[str], str]:
    """The command line that made this output, shell-quoted, and the same run as --json; for a saved document
    the line that renders it again (the document does not record its command line)."""
    if ctx.argv is None:
        src = shlex.quote(ctx.source or "RUN.json")
        return [f"pdcheck report {src} --format markdown", f"pdcheck report {src} --format html"], (
            f"rendered from a saved --json document of `pdcheck {doc.get('command')}`; a --json document does not "
            "record its command line")
    argv = list(ctx.argv)
    as_json: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--format", "--output"):
            skip = True
            continue
        if a.startswith(("--format=", "--output=")):
            continue
        as_json.append(a)
    lines = ["pdcheck " + shlex.join(argv)]
    if "--json" not in as_json:
        as_json.append("--json")
    lines.append("pdcheck " + shlex.join(as_json))
    return lines, "the command line that wrote this, then the same run as one JSON document"


def build(doc: dict[str, Any], ctx: Context) -> Page:
    import json

    command = str(doc.get("command") or "?")
    fw = doc.get("framework")
    title = f"pdcheck {command}" + (f" ({fw})" if fw else "")
    state, line = summary(doc)
    facts: list[list[str]] = []
    tables: list[Table] = []
    dict_tables: list[Table] = []
    notes: list[Notes] = []
    env: list[Table] = [Table("pdcheck", ["key", "value"], [[k, cell(doc.get(k))] for k in ENVELOPE])]
    body = {k: v for k, v in doc.items() if k not in ENVELOPE}
    order = [k for k in FIRST if k in body] + [k for k in body if k not in FIRST]

    def add_rows(title: str, rows: list[Any]) -> None:
        t, nested = table(title, rows)
        if t.columns:
            tables.append(t)
        for sub_title, sub in nested:
            add_rows(sub_title, sub)

    for key in order:
        value = body[key]
        if key in ENVIRONMENT and isinstance(value, dict):
            rows: list[list[str]] = []
            flatten("", value, rows)
            env.append(Table(key, ["key", "value"], rows))
        elif _is_rows(value):
            add_rows(key, value)
        elif _is_sentences(value):
            notes.append(Notes(key, [cell(v, 4 * CELL_MAX) for v in value]))
        elif isinstance(value, dict) and value:
            plain = {k: v for k, v in value.items() if not _is_rows(v)}
            rows = []
            flatten("", plain, rows)
            if rows:
                dict_tables.append(Table(key, ["key", "value"], rows))
            for k, v in value.items():
                if _is_rows(v):
                    add_rows(f"{key}: {k}", v)
        elif value is None or (isinstance(value, (dict, list)) and not value):
            continue
        else:
            facts.append([key, cell(value)])
    if ctx.host is not None:
        host: list[list[str]] = []
        flatten("", ctx.host, host)
        env.append(Table("this host when the page was written", ["key", "value"], host))
    lines, note = reproduce(doc, ctx)
    text = json.dumps(doc, ensure_ascii=False)
    return Page(title=title, state=state, summary=line, facts=Table("run", ["key", "value"], facts),
                tables=tables + dict_tables, notes=notes, environment=env, reproduce=lines, reproduce_note=note,
                document=text if len(text) <= JSON_MAX else None)
