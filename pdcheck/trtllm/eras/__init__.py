"""TensorRT-LLM line models, one small file per era. `--trtllm` takes an era name (E1 ... E5, W1a ... W3), a
release number (resolved to its release era by the table below, attributed from dates: pull-request merge dates
and the versioned docs, never a wheel, docs/trtllm-protocol.md T3-T8), a comma list, or `all`."""

from __future__ import annotations

import msgspec
from msgspec.structs import replace

from pdcheck.errors import BadInput
from pdcheck.releaseline import ANY, CORRECTED, ReleaseTable, is_corrected, split_many, unique
from pdcheck.trtllm.eras import corrected, e1, e2, e3, e4, w1a, w1b, w2a, w2b, w3
from pdcheck.trtllm.eras.base import TrtLine

__all__ = ["ALL", "CORRECTED", "LINES", "TABLE", "Resolved", "resolve", "resolve_many"]

# Release eras (reference §1.2): which release runs which line. The Python wire eras W1a ... W3 lived on main in
# the 1.3.0rc series; which one shipped in which rc is not established (T8), so a release number never resolves to
# one of them: name it (--trtllm W1b). 1.4.0rc (E5) runs the Python transceiver by default, as W3.
TABLE: ReleaseTable[TrtLine] = ReleaseTable((
    ((0, 20, 0), (0, 21, ANY), e1.MODEL),
    ((1, 0, 0), (1, 1, ANY), e2.MODEL),
    ((1, 2, 0), (1, 2, ANY), e3.MODEL),
    ((1, 3, 0), (1, 3, ANY), e4.MODEL),
    ((1, 4, 0), (1, 4, ANY), w3.E5),
), noun="a TensorRT-LLM release number or era", example="1.2.1", label="TensorRT-LLM ")
# What else --trtllm takes beside a release, named where a typed value is refused (the table's range comes first)
ERA_NAMES = "eras E1-E5, a wire era W1a, W1b, W2a, W2b, W3, or all"

LINES: dict[str, TrtLine] = {x.name: x for x in (e1.MODEL, e2.MODEL, e3.MODEL, e4.MODEL, w3.E5, w1a.MODEL,
                                                  w1b.MODEL, w2a.MODEL, w2b.MODEL, w3.MODEL)}
# `all`: every release era and every wire era; E5 runs as W3, so it stands for W3 there
ALL = ("E1", "E2", "E3", "E4", "W1a", "W1b", "W2a", "W2b", "E5")
CORRECTED_LINE = corrected.MODEL


class Resolved(msgspec.Struct, frozen=True):
    """One typed item of --trtllm: the line it runs and how it was reached (a release: dated, not a wheel)."""

    typed: str
    line: TrtLine
    attribution: str = ""  # "1.2.1 -> E3, attributed from dates (...), not from a wheel"; "" for an era name


def resolve(text: str, where: str = "--trtllm") -> Resolved:
    t = text.strip()
    if is_corrected(t):
        raise BadInput(f"{where}: '{CORRECTED}' runs beside every era; name an era or a release (modelled: "
                       f"{TABLE.modelled}, {ERA_NAMES})")
    by_name = {k.lower(): v for k, v in LINES.items()}
    if t.lower() in by_name:
        return Resolved(t, by_name[t.lower()])
    line = TABLE.resolve(t, where, lambda x, _n: x, also=ERA_NAMES)
    return Resolved(t, line, f"{t} -> {line.name}: attributed from dates ({line.dated}), not from a wheel")


def resolve_many(text: str, where: str = "--trtllm") -> list[Resolved]:
    if text.strip() == "all":
        return [Resolved(n, LINES[n]) for n in ALL]
    got = [resolve(part, where) for part in split_many(text, where)]
    seen: dict[str, Resolved] = {}
    for r in got:
        seen.setdefault(r.line.name, r)
    return unique(list(seen.values()), where, "TensorRT-LLM era or release")


def line(name: str) -> TrtLine:
    """A line by its name (a rank's spec carries names), the corrected one included."""
    if is_corrected(name):
        return CORRECTED_LINE
    return LINES[name]


def stamped(line_: TrtLine, name: str) -> TrtLine:
    return line_ if line_.name == name else replace(line_, name=name)
