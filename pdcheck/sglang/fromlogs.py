"""SGLang start-up logs -> an SGLang scenario: the `server_args=ServerArgs(...)` line every SGLang server logs at
start (entrypoints/engine.py: `logger.info(f"{server_args=}")`) carries tp/dp/pp, page size, KV dtype, the
disaggregation mode, transfer backend and bootstrap port. The release is not in it: name it with --sglang."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import msgspec

from pdcheck.errors import BadInput
from pdcheck.vllm.fromlogs import read_log

_LINE = re.compile(r"server_args=ServerArgs\((?P<body>.*)\)\s*$")
_FIELD = re.compile(r"(?:^|,\s)(?P<key>[a-z_][a-z0-9_]*)=")
# ServerArgs field -> (scenario key, type)
KEYS = {"tp_size": "tp_size", "pp_size": "pp_size", "page_size": "page_size", "kv_cache_dtype": "kv_cache_dtype"}
FACTS = ("dp_size", "enable_dp_attention", "disaggregation_mode", "disaggregation_transfer_backend",
         "disaggregation_bootstrap_port", "model_path")


class SgLogFacts(msgspec.Struct):
    path: str
    side: dict[str, Any]  # scenario [prefill]/[decode] keys found
    facts: dict[str, Any]  # the other server args pdcheck reports (mode, backend, bootstrap port, ...)
    notes: list[str] = []


def server_args(line: str) -> dict[str, Any] | None:
    """The key=value pairs of a ServerArgs repr; values that are not Python literals are kept as text."""
    m = _LINE.search(line)
    if not m:
        return None
    body = m.group("body")
    starts = [(f.start("key"), f.group("key")) for f in _FIELD.finditer(body)]
    out: dict[str, Any] = {}
    for i, (pos, key) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(body)
        text = body[pos + len(key) + 1:end].rstrip().rstrip(",")
        try:
            out[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            out[key] = text
    return out


def parse(path: Path, want_mode: str) -> SgLogFacts:
    args = None
    for line in read_log(path):
        found = server_args(line)
        if found is not None:
            args = found  # the last start-up wins
    if args is None:
        raise BadInput(f"{path}: no 'server_args=ServerArgs(...)' line (is this an SGLang server's log?)")
    side = {k: args[f] for f, k in KEYS.items() if isinstance(args.get(f), int | str) and not isinstance(
        args.get(f), bool)}
    if side.get("page_size") is None:
        side.pop("page_size", None)
    if str(side.get("kv_cache_dtype", "")).startswith("fp8"):
        side["dtype"] = "fp8"  # the KV pool's element type: one byte (kv_item_len halves)
    notes = []
    mode = args.get("disaggregation_mode")
    if mode != want_mode:
        notes.append(f"{path}: disaggregation_mode={mode!r}, expected {want_mode!r}")
    if args.get("disaggregation_transfer_backend") not in (None, "nixl"):
        notes.append(f"{path}: transfer backend {args.get('disaggregation_transfer_backend')!r}, not nixl: pdcheck "
                     "models SGLang's NIXL backend")
    return SgLogFacts(str(path), side, {k: args.get(k) for k in FACTS if k in args}, notes)


def to_toml(p: SgLogFacts, d: SgLogFacts, releases: list[str]) -> str:
    from pdcheck.render.text import toml_string, visible

    def val(v: Any) -> str:  # a log's text: quoted and its control characters escaped (never raw in the file)
        return toml_string(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)

    lines = ['framework = "sglang"', 'name = "from-logs"', f"# prefill log: {visible(p.path)}",
             f"# decode log: {visible(d.path)}",
             f"sglang = [{', '.join(val(r) for r in releases)}]", ""]
    for name, f in (("prefill", p), ("decode", d)):
        lines.append(f"[{name}]")
        lines += [f"{k} = {val(v)}" for k, v in f.side.items()]
        lines += [f"# {k} = {visible(repr(v))}" for k, v in f.facts.items()]
        lines.append("")
    return "\n".join(lines)
