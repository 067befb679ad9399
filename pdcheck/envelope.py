"""The one envelope every `--json` document carries (docs/json.md): which tool, version and schema wrote it,
for which command and framework, and the exit code the run ends with. Commands write their document only
through write_json, so no command's JSON can lack or disagree on these fields."""

from __future__ import annotations

import sys
from typing import Any

import msgspec

SCHEMA = "pdcheck/1"
ENVELOPE_KEYS = ("tool", "version", "schema", "command", "framework", "exit_code")


def document(command: str, framework: str | None, exit_code: int, body: Any) -> dict[str, Any]:
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


def write_json(command: str, framework: str | None, exit_code: int, body: Any) -> None:
    """One JSON document on stdout, one line."""
    sys.stdout.buffer.write(msgspec.json.encode(document(command, framework, exit_code, body)) + b"\n")
    sys.stdout.buffer.flush()
