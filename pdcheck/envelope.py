"""The one envelope every `--json` document carries (docs/json.md): which tool, version and schema wrote it,
for which command and framework, and the exit code the run ends with. Commands write their document only
through write (write_json, or the --format page of the same document), so no command's JSON can lack or
disagree on these fields."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import msgspec

from pdcheck.verdict import RankVerdict

SCHEMA = "pdcheck/1"
ENVELOPE_KEYS = ("tool", "version", "schema", "command", "framework", "exit_code")


class Envelope(msgspec.Struct, kw_only=True):
    """The envelope's fields as a type: decoding a document with it checks them (the body's fields are
    decoded with the command's own Struct)."""

    tool: str
    version: str
    schema: str
    command: str  # "handshake", "scenario from-logs", "transfer-bench", ...
    framework: str | None  # "vllm" | "sglang"; None where no framework applies (smoke, transfer-bench)
    exit_code: int | None  # the process's exit code; None only in serve's ready document (written while serving)


def document(command: str, framework: str | None, exit_code: int | None, body: Any) -> dict[str, Any]:
    """The envelope's fields first, then the body's (a msgspec Struct or a dict); a body field that repeats
    an envelope key must agree with it."""
    from pdcheck import __version__

    head: dict[str, Any] = {"tool": "pdcheck", "version": __version__, "schema": SCHEMA, "command": command,
                            "framework": framework, "exit_code": exit_code}
    rest = msgspec.to_builtins(body)
    if not isinstance(rest, dict):
        raise TypeError(f"{command}: a --json body is an object, got {type(rest).__name__}")
    for key in ENVELOPE_KEYS:
        if key in rest and rest[key] != head[key]:
            raise ValueError(f"{command}: body field {key!r}={rest[key]!r} disagrees with the envelope")
    return {**head, **{k: v for k, v in rest.items() if k not in head}}


def write_json(command: str, framework: str | None, exit_code: int | None, body: Any) -> None:
    """One JSON document on stdout, one line."""
    sys.stdout.buffer.write(msgspec.json.encode(document(command, framework, exit_code, body)) + b"\n")
    sys.stdout.buffer.flush()


def write(command: str, framework: str | None, exit_code: int | None, body: Any) -> None:
    """Every command's document goes out here: one JSON line, or the page the run asked for with --format
    markdown|html (pdcheck.render), rendered from the same document."""
    from pdcheck import render

    out = render.current()
    if out is None or out.format == "json":
        write_json(command, framework, exit_code, body)
    else:
        render.write(document(command, framework, exit_code, body), out, argv=render.ARGV.get())


class _Span(msgspec.Struct):
    fails: list[str]
    fixed_in: str | None = None


class _Floors(msgspec.Struct):
    failures: list[str] = []


class Rendered(Envelope, kw_only=True):
    """The keys a page reads for its summary line (pdcheck.render.page.summary), as every command writes them;
    decoding a saved document with it refuses one where they have another type (a `fails: 5`, `failures: true`,
    a null verdict). The rest of the body is rendered by its shape, whatever it is."""

    summary: str | None = None
    fail_spans: list[_Span] | None = None
    verdicts: list[RankVerdict] | None = None
    harness_errors: list[str] | None = None
    passed: int | None = None
    failed: int | None = None
    floors: _Floors | None = None
    rows: list[dict[str, Any]] | None = None


def load(data: bytes, where: str) -> dict[str, Any]:
    """A saved --json document, validated by decoding it: one JSON object within the document bounds
    (pdcheck.bounds.check_json_doc: depth and values, measured before decoding), whose envelope and summary keys
    decode as Rendered, written by pdcheck under this SCHEMA. Anything else is BadInput naming `where` and what
    is wrong."""
    from pdcheck import bounds
    from pdcheck.errors import BadInput

    if _two_object_lines(data):
        raise BadInput(f"{where}: JSON lines (transfer-bench --jsonl?); give one --json document")
    bounds.check_json_doc(data, where)
    try:
        doc = msgspec.json.decode(data, type=dict[str, Any])
        head = msgspec.convert(doc, Rendered)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadInput(f"{where}: not a pdcheck --json document: {exc}") from None
    except RecursionError:  # within MAX_DOC_DEPTH this does not happen; kept as the decoder's own limit
        raise BadInput(f"{where}: nested too deep for a pdcheck --json document") from None
    if head.tool != "pdcheck":
        raise BadInput(f"{where}: not a pdcheck --json document: tool is {head.tool!r}")
    if head.schema != SCHEMA:
        raise BadInput(f"{where}: schema {head.schema!r}; this pdcheck reads {SCHEMA!r}")
    return doc


def _two_object_lines(data: bytes) -> bool:
    """Whether the first two non-blank lines each start an object (JSON lines), looked at without splitting the
    whole document."""
    starts: list[bytes] = []
    pos = 0
    while len(starts) < 2 and pos < len(data):
        end = data.find(b"\n", pos)
        end = len(data) if end < 0 else end
        head = data[pos:min(end, pos + 64)].strip()
        if head:
            starts.append(head)
        pos = end + 1
    return len(starts) == 2 and all(x.startswith(b"{") for x in starts)


def write_jsonl(command: str, framework: str | None, exit_code: int, bodies: Iterable[Any]) -> None:
    """JSON lines (transfer-bench --jsonl): every line carries the whole envelope, so any one line read alone
    says which tool, schema and run wrote it; the lines are written when the run's exit code is known."""
    out = b"".join(msgspec.json.encode(document(command, framework, exit_code, b)) + b"\n" for b in bodies)
    sys.stdout.buffer.write(out)
    sys.stdout.buffer.flush()
