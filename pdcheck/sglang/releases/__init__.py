"""SGLang release models, one small file per wire era. resolve("0.5.8") maps a release to its model."""

from __future__ import annotations

from msgspec.structs import replace

from pdcheck.errors import BadInput
from pdcheck.releaseline import CORRECTED, ReleaseTable, is_corrected, split_many, unique
from pdcheck.sglang.releases import r0_4_6, r0_4_7, r0_4_9, r0_5_3, r0_5_8, r0_5_9, r0_5_13, r0_5_23
from pdcheck.sglang.releases.base import SglangRelease

__all__ = ["CORRECTED", "MODELLED", "TABLE", "resolve", "resolve_many"]

# (first, last) inclusive (major, minor, patch) ranges -> model. Releases between the read wheels take the
# earlier era (read: 0.4.6.post1, 0.4.7, 0.4.9.post2, 0.5.3, 0.5.8 - 0.5.13, 0.5.23).
TABLE: ReleaseTable[SglangRelease] = ReleaseTable((
    ((0, 4, 5), (0, 4, 6), r0_4_6.MODEL),
    ((0, 4, 7), (0, 4, 8), r0_4_7.MODEL),
    ((0, 4, 9), (0, 5, 2), r0_4_9.MODEL),
    ((0, 5, 3), (0, 5, 7), r0_5_3.MODEL),
    ((0, 5, 8), (0, 5, 8), r0_5_8.MODEL),
    ((0, 5, 9), (0, 5, 9), r0_5_9.MODEL),
    ((0, 5, 10), (0, 5, 10), r0_5_9.MODEL_0_5_10),
    ((0, 5, 11), (0, 5, 11), r0_5_9.MODEL_0_5_11),
    ((0, 5, 12), (0, 5, 12), r0_5_9.MODEL_0_5_12),
    ((0, 5, 13), (0, 5, 22), r0_5_13.MODEL),
    ((0, 5, 23), (0, 5, 23), r0_5_23.MODEL),  # the newest read: a later 0.5 runs as it, with a warning
), first_name="0.4.5.post3", noun="an SGLang release number", example="0.5.8", label="SGLang ")
MODELLED: list[SglangRelease] = TABLE.values()


# 0.5.12's aux-only-with-state bug is gone from 0.5.12.post1 (its nixl/conn.py: `if kv_chunk.is_last:`), the only
# difference between the two that the model reads
_POST_FIXED = {"0.5.12": {"aux_needs_state": False}}


def _stamp(model: SglangRelease, name: str) -> SglangRelease:
    if name == model.name:
        return model
    fixed = _POST_FIXED.get(model.name, {}) if name.startswith(f"{model.name}.post") else {}
    return replace(model, name=name, **fixed)


def resolve(text: str, where: str = "--sglang") -> SglangRelease:
    """The model of one SGLang release, named as typed ('0.5.8', '0.4.6.post1')."""
    t = text.strip()
    if is_corrected(t):
        raise BadInput(f"{where}: 'corrected' runs beside every release; name a release (modelled: "
                       f"{TABLE.modelled})")
    return TABLE.resolve(t, where, _stamp, also="all", name=t)


def resolve_many(text: str, where: str = "--sglang") -> list[SglangRelease]:
    if text.strip() == "all":
        return list(MODELLED)
    return unique([resolve(part, where) for part in split_many(text, where)], where, "SGLang release")
