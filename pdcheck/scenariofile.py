"""Scenario files, whatever the framework: a TOML file read under pdcheck's input bounds, flags merged into it, a
bundled scenario found by name, and msgspec's decode errors said as one line naming the key path (with "did you
mean"). A framework's own scenario type (pdcheck/vllm/scenario.py, pdcheck/sglang/scenario.py) decodes the
document; the bundled directories come from the registry (pdcheck.frameworks.bundled_dirs), which callers pass."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from pdcheck import bounds as b
from pdcheck.errors import BadInput
from pdcheck.verdict import STATUSES

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def field_names(struct: Any, seen: set[Any] | None = None) -> list[str]:
    """Every key a scenario may hold, at any depth: what a misspelt key is compared with."""
    import msgspec.inspect as mi

    seen = set() if seen is None else seen
    out: list[str] = []

    def walk(t: Any) -> None:
        if isinstance(t, mi.StructType) and t.cls not in seen:
            seen.add(t.cls)
            for f in t.fields:
                out.append(f.encode_name)
                walk(f.type)
        for attr in ("types", "item_type", "value_type"):
            inner = getattr(t, attr, None)
            for x in (inner if isinstance(inner, tuple) else (inner,) if inner is not None else ()):
                walk(x)

    walk(mi.type_info(struct))
    return list(dict.fromkeys(out))


def friendly(exc: msgspec.ValidationError) -> tuple[str, str]:
    m = _AT.match(str(exc))
    assert m is not None
    path = (m.group("path") or "").lstrip(".")
    path = re.sub(r"\[(\d+)\]", r"[\1]", path)
    msg = m.group("msg").replace("`", "")
    msg = msg[0].lower() + msg[1:] if msg else msg
    return path, msg


def unknown_keys(table: dict[str, Any], struct: Any, where: str) -> None:
    """A key the struct does not have, named with the close ones ('prefill.num_blcks: unknown key; did you
    mean 'num_blocks'?'), before a required key it may be a typo of is reported missing."""
    from pdcheck.suggest import did_you_mean

    fields = [f.encode_name for f in msgspec.structs.fields(struct)]
    for key in table:
        if key not in fields:
            raise BadInput(f"{where}.{key}: unknown key{did_you_mean(key, fields)}")


def literal_at(struct: Any, path: str) -> tuple[str, ...]:
    """The values of the Literal field at a dotted path ('prefill.ssm_conv_layout'), () when there is none."""
    import msgspec.inspect as mi

    t: Any = mi.type_info(struct)
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        while isinstance(t, mi.UnionType | mi.ListType):
            t = next((x for x in t.types if not isinstance(x, mi.NoneType)), None) if isinstance(t, mi.UnionType) \
                else t.item_type
        if not isinstance(t, mi.StructType):
            return ()
        t = next((f.type for f in t.fields if f.encode_name == part), None)
    while isinstance(t, mi.UnionType):
        t = next((x for x in t.types if isinstance(x, mi.LiteralType)), None)
    return tuple(map(str, t.values)) if isinstance(t, mi.LiteralType) else ()


# The scenarios shipped with pdcheck (package data; the clone's top-level scenarios/ is the same directory).
def decode_error(exc: msgspec.ValidationError, doc: dict[str, Any], struct: Any) -> str:
    """msgspec's error decoding `doc` as `struct`, as one line: the key path, the close key or value offered."""
    from pdcheck.suggest import did_you_mean

    path, msg = friendly(exc)
    if msg.startswith("object contains unknown field"):
        key = msg.rsplit(" ", 1)[-1]
        return f"{path + '.' if path else ''}{key}: unknown key{did_you_mean(key, field_names(struct))}"
    return enum_hint(msg, doc, path or "(top level)", struct)


def enum_hint(msg: str, doc: Any, path: str, struct: Any) -> str:
    """msgspec's 'invalid enum value 'asert'' with the valid values named and the close one offered; the dict
    key msgspec shows as '[...]' put back ('expect[...]' -> 'expect.0.9.1')."""
    from pdcheck.suggest import did_you_mean

    m = re.match(r"invalid enum value '(?P<v>[^']*)'", msg)
    if m is None:
        return f"{path}: {msg}"
    value = m.group("v")
    head = path.split("[...]")[0].split(".")[-1] if "[...]" in path else ""
    if head == "expect" and isinstance(doc.get("expect"), dict):
        key = next((k for k, v in doc["expect"].items() if v == value or (isinstance(v, list) and value in v)), None)
        if key is not None:
            path = path.replace("[...]", f".{key}", 1)
    choices = STATUSES if head == "expect" else literal_at(struct, path)
    if not choices:
        return f"{path}: {msg}"
    return f"{path}: {value!r} is not one of {', '.join(choices)}{did_you_mean(value, choices)}"




BUNDLED = Path(__file__).parent / "scenarios"


def bundled(dirs: Sequence[Path]) -> list[Path]:
    """The bundled scenario files of these directories (pdcheck.frameworks.bundled_dirs), directory order, then
    by name."""
    return [f for d in dirs for f in sorted(d.glob("*.toml"))]


def locate(path: Path, dirs: Sequence[Path]) -> Path:
    """A scenario argument as a file: an existing path as given; else a bare name, with or without .toml,
    names a bundled scenario of these directories (`pdcheck handshake seed-19338-tp8` works from any
    directory)."""
    try:
        if path.exists() or len(path.parts) != 1:
            return path
    except (OSError, ValueError):  # a name too long, a NUL byte: read_scenario_text says what is wrong
        return path
    name = path.name if path.suffix == ".toml" else f"{path.name}.toml"
    for d in dirs:
        if (d / name).is_file():
            return d / name
    from pdcheck.suggest import did_you_mean

    names = [p.stem for p in bundled(dirs)]
    hint = did_you_mean(Path(name).stem, names) or f" ({len(names)} bundled: pdcheck list scenarios)"
    raise BadInput(f"{path}: no such scenario file, and no bundled scenario of that name{hint}")


def read_toml(path: Path) -> dict[str, Any]:
    """A scenario file (a path: the command layer has located a bundled name, pdcheck.cliopts) as a TOML
    document."""
    text = b.read_scenario_text(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise BadInput(f"{path}: not valid TOML: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise BadInput(f"{path}: not valid TOML: {exc}") from None


def merge(doc: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge flag overrides into the raw document; the flags win."""
    out = dict(doc)
    for key, val in overrides.items():
        if isinstance(val, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], val)
        else:
            out[key] = val
    return out


def parse_counts(flag: str, text: str) -> int | list[int]:
    """'5808,5800' -> [5808, 5800]; '5800' -> 5800 (every rank)."""
    parts = [p.strip() for p in text.split(",")]
    vals: list[int] = []
    if len(parts) > b.HARD_MAX_TP:
        raise BadInput(f"{flag}: {len(parts)} values; at most one per rank ({b.HARD_MAX_TP})")
    for p in parts:
        if not re.fullmatch(r"-?[0-9]{1,20}", p, re.ASCII):
            raise BadInput(f"{flag}: {p!r} is not an integer (expected a number or a comma-separated list)")
        vals.append(int(p))
    for v in vals:
        if not 1 <= v <= b.MAX_NUM_BLOCKS:
            raise BadInput(f"{flag}: {v} is out of range (1 to {b.MAX_NUM_BLOCKS})")
    return vals[0] if len(vals) == 1 else vals
