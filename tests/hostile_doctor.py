"""A hostile doctor end of pdcheck's own: the real `pdcheck doctor --listen` or `--peer` (its real rank, its real
sockets), except that what it sends is rewritten on the way out.

    python tests/hostile_doctor.py MUTATION -- doctor --peer 127.0.0.1:7777 --timeout 20

MUTATION is JSON, or @FILE holding it: {"<message type>": {"<field>": value, ...}, ...} sets fields of every message of that type this
end sends (msgpack encodes them as they are: NaN, a negative count, a string of control characters); End fields
({"End": {"host": ...}}) apply to the evidence inside Result, Evidence and Aborted. Special keys:
"__as__": "Refused" sends a Refused with the given fields in place of the message; "__bytes__": ["metadata"]
turns those string values into bytes; "__exit_before__": "Filled" ends the process (os._exit) where it would send
that message, as a listener that answered (its Offer) and then died. JSON reads NaN and Infinity.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import msgspec

from pdcheck.doctor import pair, wire

mutation: dict[str, Any] = json.loads(open(sys.argv[1][1:]).read() if sys.argv[1].startswith("@") else sys.argv[1])
if sys.argv[2] != "--":
    raise SystemExit("usage: hostile_doctor.py MUTATION -- doctor ARGS...")
_encode = wire.encode
_exit_before = mutation.pop("__exit_before__", None)


def _fields(name: str) -> dict[str, Any]:
    out = dict(mutation.get(name, {}))
    for key in out.pop("__bytes__", []):
        out[key] = out[key].encode("latin-1")
    return out


def _end(end: wire.End) -> wire.End:
    return msgspec.structs.replace(end, **_fields("End")) if "End" in mutation else end


def hostile(msg: Any) -> bytes:
    name = type(msg).__name__
    if name == _exit_before:
        os._exit(0)
    if hasattr(msg, "end"):
        msg = msgspec.structs.replace(msg, end=_end(msg.end))
    change = _fields(name)
    kind = change.pop("__as__", None)
    if kind is not None:
        if kind == "Aborted" and "end" not in change and hasattr(msg, "end"):
            change["end"] = msg.end
        data = _encode(getattr(wire, kind)(**change))
    else:
        data = _encode(msgspec.structs.replace(msg, **change) if change else msg)
    return data


pair.encode = hostile
sys.argv = ["pdcheck", *sys.argv[3:]]
from pdcheck.__main__ import main  # noqa: E402 - after the patch, as the console script would start

main()
