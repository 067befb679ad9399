"""SGLang release models, one small file per wire era. resolve("0.5.8") maps a release to its model."""

from __future__ import annotations

import re

from msgspec.structs import replace

from pdcheck.errors import BadInput
from pdcheck.sglang.releases import r0_4_6, r0_4_7, r0_4_9, r0_5_3, r0_5_8, r0_5_13, r0_5_23
from pdcheck.sglang.releases.base import SglangRelease

CORRECTED = "corrected"

# (first, last) inclusive (major, minor, patch) ranges -> model. Releases between the read wheels take the
# earlier era (the reference read 0.4.6.post1, 0.4.7, 0.4.9.post2, 0.5.3, 0.5.8, 0.5.13, 0.5.23).
_LINES: list[tuple[tuple[int, int, int], tuple[int, int, int], SglangRelease]] = [
    ((0, 4, 5), (0, 4, 6), r0_4_6.MODEL),
    ((0, 4, 7), (0, 4, 8), r0_4_7.MODEL),
    ((0, 4, 9), (0, 5, 2), r0_4_9.MODEL),
    ((0, 5, 3), (0, 5, 7), r0_5_3.MODEL),
    ((0, 5, 8), (0, 5, 12), r0_5_8.MODEL),
    ((0, 5, 13), (0, 5, 22), r0_5_13.MODEL),
    ((0, 5, 23), (0, 5, 99), r0_5_23.MODEL),
]
MODELLED: list[SglangRelease] = [m for _f, _l, m in _LINES]
_RANGE = "0.4.5.post3 to 0.5.x"
_NUMBER = re.compile(r"v?(0)\.([0-9]{1,3})\.([0-9]{1,3})((?:\.?post[0-9]{1,3})|rc[0-9]{1,3})?", re.ASCII)


def resolve(text: str, where: str = "--sglang") -> SglangRelease:
    """The model of one SGLang release, named as typed ('0.5.8', '0.4.6.post1')."""
    t = text.strip()
    if t == CORRECTED:
        raise BadInput(f"{where}: 'corrected' runs beside every release; name a release (modelled: {_RANGE})")
    mt = _NUMBER.fullmatch(t)
    if not mt:
        raise BadInput(f"{where}: {t!r} is not an SGLang release number (e.g. 0.5.8; modelled: {_RANGE}, all)")
    v = (int(mt.group(1)), int(mt.group(2)), int(mt.group(3)))
    for first, last, model in _LINES:
        if first <= v <= last:
            return model if t == model.name else replace(model, name=t)
    raise BadInput(f"{where}: SGLang {t!r} is not modelled (modelled: {_RANGE})")


def resolve_many(text: str, where: str = "--sglang") -> list[SglangRelease]:
    if text.strip() == "all":
        return list(MODELLED)
    parts = [p for p in text.split(",") if p.strip() != CORRECTED]
    if len(parts) > 64:
        raise BadInput(f"{where}: {len(parts)} releases named; at most 64 (or 'all')")
    out: list[SglangRelease] = []
    for part in parts:
        r = resolve(part, where)
        if r not in out:
            out.append(r)
    if not out:
        raise BadInput(f"{where}: name at least one SGLang release")
    return out
