"""Release models, one small file per vLLM release line. resolve() maps a release number to its model."""

from __future__ import annotations

import re

from pdcheck.errors import BadInput
from pdcheck.releases import corrected, v0_9_0, v0_9_1, v0_9_2
from pdcheck.releases.base import ReleaseModel

CORRECTED = corrected.MODEL

# (first, last) inclusive release ranges -> model. Order matters only for readability.
_LINES: list[tuple[tuple[int, int, int], tuple[int, int, int], ReleaseModel]] = [
    ((0, 9, 0), (0, 9, 0), v0_9_0.MODEL),
    ((0, 9, 1), (0, 9, 1), v0_9_1.MODEL),
    ((0, 9, 2), (0, 9, 99), v0_9_2.MODEL),
    ((0, 10, 0), (0, 10, 0), v0_9_2.MODEL_0_10_0),
]

MODELLED = [m for _, _, m in _LINES]


def _parse(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.\d+)*(?:[a-z+].*)?", text.strip())
    if not m:
        raise BadInput(f"--vllm: {text!r} is not a release number (expected e.g. 0.9.1)")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def resolve(text: str) -> ReleaseModel:
    if text.strip() == "corrected":
        return CORRECTED
    v = _parse(text)
    for first, last, model in _LINES:
        if first <= v <= last:
            return model
    known = ", ".join(m.name for m in MODELLED)
    raise BadInput(f"--vllm: release {text!r} is not modelled (modelled: {known}, corrected)")


def resolve_many(text: str) -> list[ReleaseModel]:
    if text.strip() == "all":
        return list(MODELLED)
    out: list[ReleaseModel] = []
    for part in text.split(","):
        m = resolve(part)
        if m is not CORRECTED and m not in out:
            out.append(m)
    if not out:
        raise BadInput("--vllm: name at least one release")
    return out
