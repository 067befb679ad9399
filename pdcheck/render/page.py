"""One page model for every command, built from its --json document alone (docs/json.md): a summary line, the
run's facts, the tables, the notes, the versions and environment, the commands that reproduce it. Nothing here
knows a command or a framework: a section comes from the shape of the document's keys (a list of objects is a
table, a list of sentences is a note list, an environment-like object goes in the collapsible block), so a new
command or framework renders without a line here."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

from pdcheck.render.text import clean, cut, json_visible, shell_word

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
# Every cap says what it cut (docs/json.md, "Formats"): a row "… N more rows", a cell "… (N characters)".
MAX_ROWS = 100  # rows of one table (key/value tables included), items of one list, tables nested under one key
MAX_COLUMNS = 30  # columns of one table
MAX_TABLES = 200  # tables on one page
MAX_DEPTH = 6  # levels of a nested value written out inside one cell
CELL_MAX = 300  # characters of one table cell; the full value is in the --json document
KEY_MAX = 100  # characters of a key, a column name, a command's or framework's name
TITLE_MAX = 200  # characters of a table's title
SUMMARY_MAX = 1000  # characters of the summary line
ARG_MAX = 1024  # characters of one argument of the command line that is shown
JSON_MAX = 48 << 10  # the whole document goes in its own collapsible block up to this size (an issue holds 64 KB)
ENV_PREFIXES = ("UCX_", "NIXL_")  # + each framework's (render.Output.env_prefixes, from the registry)
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")


@dataclasses.dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    main: bool = True  # a top-level table (shown first); False: nested in a row, or an object's key/value table


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
    """One value as one line of printable text (pdcheck.render.text): lists joined, objects as key=value, floats
    to 4 digits, line breaks as spaces, other control characters visible, cut at limit (saying so)."""
    if isinstance(value, str):
        text = cut(value, limit)
    else:
        text = _text(value, limit + 1)
        if len(text) > limit:
            text = text[:limit] + "… (the rest is in the --json document)"
    return clean(text.replace("\r\n", " ").replace("\n", " "))


def key(name: Any, limit: int = KEY_MAX) -> str:
    """A key, column name or title part from a document: one line of printable text, cut at limit."""
    return clean(name if isinstance(name, str) else _text(name, limit + 1), limit)


def _text(value: Any, limit: int) -> str:
    """The text of a value, built no further than `limit` characters (a cell of a million-entry list costs what
    the cell shows) and no deeper than MAX_DEPTH levels."""
    out: list[str] = []
    n = 0
    for part in _parts(value, 0):
        out.append(part)
        n += len(part)
        if n > limit:
            break
    return "".join(out)


def _scalar(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    try:
        return str(value)
    except ValueError:  # an int past Python's str() digit limit (only a document built in-process has one)
        return f"<an integer of {value.bit_length()} bits>"


def _parts(value: Any, depth: int) -> Iterator[str]:
    if isinstance(value, (list, tuple)):
        if depth >= MAX_DEPTH:
            yield "…"
            return
        for i, v in enumerate(value):
            if i:
                yield ", "
            if isinstance(v, (list, dict)):
                yield "["
                yield from _parts(v, depth + 1)
                yield "]"
            else:
                yield _scalar(v)
    elif isinstance(value, dict):  # unset fields left out: the --json document has them all
        if depth >= MAX_DEPTH:
            yield "…"
            return
        first = True
        for k, v in value.items():
            if v is None or v == "" or v == [] or v == {}:
                continue
            if not first:
                yield ", "
            first = False
            yield f"{_scalar(k)}="
            if isinstance(v, (list, dict)):
                yield "["
                yield from _parts(v, depth + 1)
                yield "]"
            else:
                yield _scalar(v)
    else:
        yield _scalar(value)


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


def _keyed(value: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """The first MAX_ROWS entries as rows (the key first), and how many there are."""
    return [{"key": k, **v} for k, v in itertools.islice(value.items(), MAX_ROWS)], len(value)


def _label(row: dict[str, Any], index: int) -> str:
    """How a nested table names the row it came from: its first short scalar (a release, a rank), else its index."""
    for k, v in row.items():
        if isinstance(v, (str, int)) and not isinstance(v, bool) and len(_scalar(v)) <= 40:
            return f"{key(k, 40)}={key(v, 40)}"
    return str(index)


def table(title: str, items: list[dict[str, Any] | None], main: bool = True, total: int | None = None
          ) -> tuple[Table, list[tuple[str, list[Any], int]]]:
    """A list of objects as a table: a column per key (in first-seen order, all-empty columns left out, at most
    MAX_COLUMNS); a value that is itself a list of objects becomes its own table (returned as (title, rows)), not
    a cell. At most MAX_ROWS rows, and only those are read; a last row says how many more (of `total`, default
    all of items) the --json document holds."""
    total = len(items) if total is None else total
    rows = [r if r is not None else {} for r in items[:MAX_ROWS]]
    columns: list[str] = []
    nested: list[tuple[str, list[Any], int]] = []
    # A key that holds objects in any row is a nested table in every row, never a column.
    tabular = {k for r in rows for k, v in r.items() if _is_rows(v) or _is_keyed_rows(v)}
    seen: set[str] = set()
    for i, r in enumerate(rows):
        for k, v in r.items():
            if k in tabular:
                if (_is_rows(v) or _is_keyed_rows(v)) and len(nested) < MAX_ROWS:
                    sub, n = (v, len(v)) if _is_rows(v) else _keyed(v)
                    nested.append((cut(f"{title} {_label(r, i)}: {key(k)}", TITLE_MAX), sub, n))
            elif k not in seen:
                seen.add(k)
                columns.append(k)
    columns = [c for c in columns if any(r.get(c) not in (None, "", [], {}) for r in rows)]
    more = len(columns) - MAX_COLUMNS
    columns = columns[:MAX_COLUMNS]
    out = [[cell(r.get(c)) for c in columns] for r in rows]
    names = [key(c) for c in columns]
    if more > 0:
        names.append(f"… {more} more columns in the --json document")
        out = [[*r, ""] for r in out]
    if total > len(rows) and names:
        out.append([f"… {total - len(rows)} more rows in the --json document"] + [""] * (len(names) - 1))
    return Table(cut(title, TITLE_MAX), names, out, main), nested


def _leaves(prefix: str, value: Any, depth: int = 0) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value and depth < 2:
        for k, v in value.items():
            if v is not None and v != [] and v != {}:
                yield from _leaves(f"{prefix}.{key(k)}" if prefix else key(k), v, depth + 1)
    else:
        yield prefix, value


def flatten(prefix: str, value: Any, out: list[list[str]], depth: int = 0) -> None:
    """An object as key/value rows, nested keys dotted (two levels; deeper ones as one cell); at most MAX_ROWS
    rows, then one saying how many more keys the --json document holds."""
    more = 0
    for k, v in _leaves(prefix, value, depth):
        if len(out) < MAX_ROWS:
            out.append([cut(k, TITLE_MAX), cell(v)])
        else:
            more += 1
    if more:
        out.append([f"… {more} more keys in the --json document", ""])


def summary(doc: dict[str, Any]) -> tuple[str, str]:
    """(state, the one line): the exit code's meaning, then what the run found, from whichever of the common
    keys the document has (a summary sentence, failing-release spans, verdicts, pass/fail counts, ok). A key of
    another type than pdcheck writes adds nothing (pdcheck report refuses such a document before this)."""
    code = doc.get("exit_code")
    if code is None:
        state, meaning = "READY", "no exit code yet (written while the command runs: serve's ready document)"
    else:
        state, meaning = EXIT.get(code, ("FAIL", f"exit {key(code)}")) if isinstance(code, int) else (
            "FAIL", f"exit {key(code)}")
    found: list[str] = []
    if isinstance(doc.get("summary"), str):
        found.append(cut(doc["summary"], SUMMARY_MAX))
    spans = doc.get("fail_spans")
    if isinstance(spans, list) and spans:
        for sp in spans[:MAX_ROWS]:
            if isinstance(sp, dict):
                fails = _text(sp.get("fails"), SUMMARY_MAX)
                fixed = (f"fixed in {_text(sp['fixed_in'], KEY_MAX)}" if sp.get("fixed_in")
                         else "no later modelled release survives")
                found.append(f"fails: {fails} · {fixed}")
    elif isinstance(spans, list) and doc.get("harness_errors") == []:
        found.append("every modelled release survives")
    verdicts = doc.get("verdicts")
    if _is_rows(verdicts):
        per: dict[str, dict[str, int]] = {}
        for v in verdicts:
            if v is None:
                continue
            counts = per.setdefault(key(v.get("release"), 40), {})
            status = key(v.get("status"), 40)
            counts[status] = counts.get(status, 0) + 1
        found.append("; ".join(f"{rel}: " + ", ".join(s if n == 1 else f"{s} ×{n}" for s, n in c.items())
                               for rel, c in list(per.items())[:MAX_ROWS]))
    if _is_int(doc.get("passed")) and _is_int(doc.get("failed")):
        found.append(f"{doc['passed']} passed, {doc['failed']} failed")
    floors = doc.get("floors")
    if isinstance(floors, dict) and isinstance(floors.get("failures"), list) and floors["failures"]:
        found.append("floors failed: " + "; ".join(_text(f, SUMMARY_MAX) for f in floors["failures"][:MAX_ROWS]))
    if isinstance(doc.get("rows"), list) and "ok" in doc:
        wrong = sum(r["wrong"] for r in doc["rows"] if isinstance(r, dict) and _is_int(r.get("wrong")))
        found.append(f"{len(doc['rows'])} rows, {wrong} blocks wrong")
    return state, clean(" · ".join([meaning, *found]), SUMMARY_MAX)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
    """The command line that made this output, shell-quoted (an argument with control characters in bash's
    $'...' form: visible, and still the same argument), and the same run as --json; for a saved document the
    line that renders it again (the document does not record its command line)."""
    if ctx.argv is None:
        src = shell_word(ctx.source or "RUN.json", ARG_MAX)
        return [f"pdcheck report {src} --format markdown", f"pdcheck report {src} --format html"], (
            f"rendered from a saved --json document of `pdcheck {key(doc.get('command'))}`; a --json document does "
            "not record its command line")
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
    lines = ["pdcheck " + " ".join(shell_word(a, ARG_MAX) for a in argv)]
    if "--json" not in as_json:
        as_json.append("--json")
    lines.append("pdcheck " + " ".join(shell_word(a, ARG_MAX) for a in as_json))
    return lines, "the command line that wrote this, then the same run as one JSON document"


def build(doc: dict[str, Any], ctx: Context) -> Page:
    command = key(doc.get("command") or "?")
    fw = doc.get("framework")
    title = f"pdcheck {command}" + (f" ({key(fw)})" if fw else "")
    state, line = summary(doc)
    facts: list[list[str]] = []
    tables: list[Table] = []
    dict_tables: list[Table] = []
    notes: list[Notes] = []
    env: list[Table] = [Table("pdcheck", ["key", "value"], [[k, cell(doc.get(k))] for k in ENVELOPE], False)]
    body = {k: v for k, v in doc.items() if k not in ENVELOPE}
    order = [k for k in FIRST if k in body] + [k for k in body if k not in FIRST]
    dropped = 0

    def add_rows(title: str, rows: list[Any], main: bool, total: int | None = None) -> None:
        nonlocal dropped
        if len(tables) + len(dict_tables) >= MAX_TABLES:
            dropped += 1
            return
        t, nested = table(title, rows, main, total)
        if t.columns:
            tables.append(t)
        for sub_title, sub, n in nested:
            add_rows(sub_title, sub, False, n)

    for name in order:
        value = body[name]
        k = key(name)
        if name in ENVIRONMENT and isinstance(value, dict):
            rows: list[list[str]] = []
            flatten("", value, rows)
            env.append(Table(k, ["key", "value"], rows, False))
        elif _is_rows(value):
            add_rows(k, value, True)
        elif _is_sentences(value):
            items = [cell(v, 4 * CELL_MAX) for v in value[:MAX_ROWS]]
            if len(value) > MAX_ROWS:
                items.append(f"… {len(value) - MAX_ROWS} more in the --json document")
            notes.append(Notes(k, items))
        elif isinstance(value, dict) and value:
            plain = {kk: v for kk, v in value.items() if not _is_rows(v)}
            rows = []
            flatten("", plain, rows)
            if rows and len(tables) + len(dict_tables) < MAX_TABLES:
                dict_tables.append(Table(k, ["key", "value"], rows, False))
            for kk, v in value.items():
                if _is_rows(v):
                    add_rows(cut(f"{k}: {key(kk)}", TITLE_MAX), v, False)
        elif value is None or (isinstance(value, (dict, list)) and not value):
            continue
        elif len(facts) < MAX_ROWS:
            facts.append([k, cell(value)])
        else:
            dropped += 1
    if dropped:
        notes.append(Notes("left out", [f"{dropped} more tables or fields are in the --json document"]))
    if ctx.host is not None:
        host: list[list[str]] = []
        flatten("", ctx.host, host)
        env.append(Table("this host when the page was written", ["key", "value"], host, False))
    lines, note = reproduce(doc, ctx)
    return Page(title=title, state=state, summary=line, facts=Table("run", ["key", "value"], facts),
                tables=tables + dict_tables, notes=notes, environment=env, reproduce=lines, reproduce_note=note,
                document=_document(doc))


def _document(doc: dict[str, Any]) -> str | None:
    """The document as one line of JSON when it is at most JSON_MAX characters, its strings' unprintable
    characters as JSON escapes (it reads back the same)."""
    import json

    import msgspec

    try:
        size = len(msgspec.json.encode(doc))  # C speed; no str of a large document is built
    except (TypeError, ValueError, OverflowError, RecursionError):
        return None
    if size > JSON_MAX:
        return None
    return json_visible(json.dumps(doc, ensure_ascii=False))


def folded(titles: list[str], limit: int) -> str:
    """The line of a folded block of tables: how many, and the keys they come from ("27 more tables:
    decode_ranks (24), num_blocks_spread, ...")."""
    groups: dict[str, int] = {}
    for t in titles:
        g = t.split(" ")[0].split(":")[0]
        groups[g] = groups.get(g, 0) + 1
    names = ", ".join(g if n == 1 else f"{g} ({n})" for g, n in groups.items())
    return cut(f"{len(titles)} more tables: {names}", limit)


@dataclasses.dataclass
class Budget:
    """Characters a page may still take (a GitHub issue body holds 65,536): sections are added in order of
    importance while they fit; a table that fits only in part is cut at a row that says how many are left
    out, one that does not fit at all is named in `left_out`."""

    left: int
    left_out: list[str] = dataclasses.field(default_factory=list)

    def take(self, lines: list[str]) -> bool:
        size = sum(len(x) + 1 for x in lines)
        if size > self.left:
            return False
        self.left -= size
        return True

    def rows(self, head: list[str], rows: list[str], cut_row: Any, title: str) -> tuple[list[str], int]:
        """A table's lines and how many of its rows they hold: its head, then rows while they fit (room kept for
        the cut row, `cut_row(n)`: the line saying n rows are left out, added when any is); ([], 0) and the title
        in left_out when not even the head and that line fit."""
        reserve = len(cut_row(len(rows))) + 1 if rows else 0
        size = sum(len(x) + 1 for x in head)
        if size + reserve > self.left:
            self.left_out.append(title)
            return [], 0
        self.left -= size
        out = list(head)
        for i, r in enumerate(rows):
            if len(r) + 1 + (0 if i == len(rows) - 1 else reserve) > self.left:
                line = cut_row(len(rows) - i)
                self.left -= len(line) + 1
                return [*out, line], i
            self.left -= len(r) + 1
            out.append(r)
        return out, len(rows)
