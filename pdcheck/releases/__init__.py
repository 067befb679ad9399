"""Release models, one small file per vLLM release line. resolve() maps a release number to its model."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec

from pdcheck.errors import BadInput
from pdcheck.geometry import Geometry
from pdcheck.releases import (
    corrected,
    v0_9_0,
    v0_9_1,
    v0_9_2,
    v0_10_1,
    v0_11_0,
    v0_11_1,
    v0_13,
    v0_14,
    v0_20,
    v0_26,
    v0_29,
)
from pdcheck.releases.base import ReleaseModel

CORRECTED = corrected.MODEL

_ANY = 10**9  # every patch release of a minor line

# (first, last) inclusive release ranges -> model. Each range is one behaviour: wire era, checks, connector
# version and hash factors; resolve() stamps the exact release typed into name and version.
_LINES: list[tuple[tuple[int, int, int], tuple[int, int, int], ReleaseModel]] = [
    ((0, 9, 0), (0, 9, 0), v0_9_0.MODEL),
    ((0, 9, 1), (0, 9, 1), v0_9_1.MODEL),
    ((0, 9, 2), (0, 9, 99), v0_9_2.MODEL),
    ((0, 10, 0), (0, 10, 0), v0_9_2.MODEL_0_10_0),
    ((0, 10, 1), (0, 10, _ANY), v0_10_1.MODEL),  # era D: 0.10.1, 0.10.1.1, 0.10.2
    ((0, 11, 0), (0, 11, 0), v0_11_0.MODEL),  # era E
    ((0, 11, 1), (0, 12, _ANY), v0_11_1.MODEL),  # era F
    ((0, 13, 0), (0, 13, _ANY), v0_13.MODEL),  # era G, compatibility hash
    ((0, 14, 0), (0, 15, _ANY), v0_14.MODEL),  # P TP > D TP, all target ranks
    ((0, 16, 0), (0, 17, _ANY), v0_14.MODEL_0_16),  # + cross_layers_blocks in the hash
    ((0, 18, 0), (0, 19, _ANY), v0_14.MODEL_0_18),  # G18 (ssm_sizes), + is_hma_enabled (False)
    ((0, 20, 0), (0, 20, _ANY), v0_20.MODEL),  # G20, TransferTopology: strict replication, HND head split
    ((0, 21, 0), (0, 21, _ANY), v0_20.MODEL_0_21),  # G24 fields, version 3, MLA skips the P > D assert
    ((0, 22, 0), (0, 22, _ANY), v0_20.MODEL_0_22),  # version 4, is_hma_enabled True
    ((0, 23, 0), (0, 23, _ANY), v0_20.MODEL_0_23),  # FlashAttention blocks-first: one region per layer
    ((0, 24, 0), (0, 25, _ANY), v0_20.MODEL_0_24),  # per-region checks, per-rank head counts
    ((0, 26, 0), (0, 27, _ANY), v0_26.MODEL),  # era H: two reply frames, version 5
    ((0, 28, 0), (0, 28, _ANY), v0_26.MODEL_0_28),  # version 7, + speculative_config, transfer_mode
    ((0, 29, 0), (0, 29, _ANY), v0_29.MODEL),  # version 9, block_strides, KVCacheLayout names
    ((0, 30, 0), (0, 30, _ANY), v0_29.MODEL_0_30),  # version 11, region metadata asserts
    ((0, 31, 0), (0, 31, _ANY), v0_29.MODEL_0_31),  # version 13
    ((0, 32, 0), (0, 32, _ANY), v0_29.MODEL_0_32),  # version 14, layout message names both layouts
    ((0, 33, 0), (0, 33, _ANY), v0_29.MODEL_0_33),  # version 15
    ((0, 34, 0), (0, 34, _ANY), v0_29.MODEL_0_34),  # H34, version 16, regions paired before the NIXL add
]

_RANGE = "0.9.0 to 0.34.x"

_cache: dict[str, ReleaseModel] = {}


# Releases with a fourth number that exist (reference: release wheels); any other four-part number is a typo.
LISTED_FOUR_PART = ("0.10.1.1",)
_NUMBER = re.compile(r"v?([0-9]{1,4})\.([0-9]{1,4})(?:\.([0-9]{1,4}))?(?:\.([0-9]{1,4}))?"
                     r"(rc[0-9]{1,4}|\.?post[0-9]{1,4}|\.?dev[0-9]{1,6}|\+[A-Za-z0-9.]{1,32})?", re.ASCII)


def _lines_of_minor(major: int, minor: int) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    return [(f, lt) for f, lt, _m in _LINES if f <= (major, minor, _ANY) and lt >= (major, minor, 0)]


def _span(first: tuple[int, int, int], last: tuple[int, int, int]) -> str:
    a = ".".join(map(str, first))
    if first == last:
        return a
    b = f"{last[0]}.{last[1]}.x" if last[2] == _ANY else ".".join(map(str, last))
    return f"{a}-{b}"


def _parse(text: str, where: str = "--vllm") -> tuple[tuple[int, int, int], str]:
    """(major, minor, patch) for the lookup, and the normalised release: 'v0.14' -> '0.14.0' (a minor that is
    one modelled line), '0.10.1.1' kept (a listed release), local/pre-release suffixes ('+cu128', 'rc1')
    dropped. ASCII digits only; an ambiguous minor ('0.9') or an unlisted fourth number is bad input."""
    t = text.strip()
    m = _NUMBER.fullmatch(t)
    if not m:
        raise BadInput(f"{where}: {t!r} is not a release number (ASCII digits, e.g. 0.9.1; modelled: {_RANGE}, "
                       f"corrected)")
    major, minor = int(m.group(1)), int(m.group(2))
    if m.group(3) is None:
        lines = _lines_of_minor(major, minor)
        if len(lines) > 1:
            cands = ", ".join(_span(f, lt) for f, lt in lines)
            raise BadInput(f"{where}: {t!r} is ambiguous: {major}.{minor} spans release lines {cands} "
                           f"(name one, e.g. {'.'.join(map(str, lines[0][0]))})")
    v = major, minor, int(m.group(3) or 0)
    norm = ".".join(map(str, v))
    if m.group(4) is not None:
        four = f"{norm}.{int(m.group(4))}"
        if four not in LISTED_FOUR_PART:
            raise BadInput(f"{where}: release {t!r} does not exist (four-part releases: "
                           f"{', '.join(LISTED_FOUR_PART)}; or name {norm})")
        norm = four
    return v, norm


def resolve(text: str, where: str = "--vllm") -> ReleaseModel:
    """The model of one release. Its name and version are the normalised release typed, e.g. '0.14.1'."""
    if text.strip() == "corrected":
        return CORRECTED
    v, norm = _parse(text, where)
    if norm in _cache:
        return _cache[norm]
    for first, last, model in _LINES:
        if first <= v <= last:
            _cache[norm] = replace(model, name=norm, version=norm)
            return _cache[norm]
    raise BadInput(f"{where}: release {text.strip()!r} is not modelled (modelled: {_RANGE}, corrected)")


# One representative per line of checks, for `--vllm all`. 0.23 is 0.22's checks with FlashAttention's blocks-first
# KV layout, which only a single-release run (or serve) registers: a matrix keeps one layout (plan.kv_geometry).
REPRESENTATIVES = ("0.9.0", "0.9.1", "0.9.2", "0.10.0", "0.10.1", "0.11.0", "0.11.1", "0.13.0", "0.14.0",
                   "0.16.0", "0.18.0", "0.20.0", "0.21.0", "0.22.0", "0.24.0", "0.26.0", "0.28.0", "0.29.0",
                   "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
MODELLED = [resolve(v) for v in REPRESENTATIVES]


def resolve_many(text: str, where: str = "--vllm") -> list[ReleaseModel]:
    if text.strip() == "all":
        return list(MODELLED)
    parts = text.split(",")
    if len(parts) > 64:
        raise BadInput(f"{where}: {len(parts)} releases named; at most 64 (or 'all')")
    out: list[ReleaseModel] = []
    for part in parts:
        m = resolve(part, where)
        if m is not CORRECTED and m not in out:
            out.append(m)
    if not out:
        raise BadInput(f"{where}: name at least one release")
    return out


def for_release(release: ReleaseModel, geometry: Geometry) -> Geometry:
    """The geometry an instance of `release` registers: FlashAttention's KV layout of that release."""
    kv = release.fa_kv_regions
    return geometry if geometry.kv_regions == kv else msgspec.structs.replace(geometry, kv_regions=kv)


def registered_geometry(own: ReleaseModel | str | None, geometry: Geometry,
                        run_releases: Sequence[ReleaseModel]) -> Geometry:
    """The geometry an instance's ranks register, which the engine's checks and the hazard lines both measure:
    FlashAttention's KV layout of the instance's own release (`vllm` in its table, by name or resolved), else
    of the one release run. A matrix of several releases shares one KV cache per process, so it keeps one
    layout on both sides (the split K/V regions), which leaves the checks' ratios unchanged."""
    rel = resolve(own) if isinstance(own, str) else own
    if rel is None and len(run_releases) == 1:
        rel = run_releases[0]
    return for_release(rel, geometry) if rel is not None and rel is not CORRECTED else geometry


def compat_hash_for(release: ReleaseModel, geometry: Geometry, model: str = "pdcheck/fake-model", *,
                    cache_dtype: str = "auto", extra: dict[str, Any] | None = None) -> str | None:
    """The NIXL compatibility hash an instance of `release` computes (§3.5), or None before 0.13 (no hash).

    D uses its Local's geometry and model for Params.local_hash; a fake P uses its own for encode_reply."""
    from pdcheck.releases import hybrid
    from pdcheck.wire.compat import compat_hash, factors

    if not release.hash_factors or release.connector_version is None:
        return None
    f = factors(release.hash_factors, vllm_version=release.version or release.versions[0],
                connector_version=release.connector_version, model=model, dtype=geometry.dtype,
                num_kv_heads=geometry.total_kv_heads, head_size=geometry.head_dim,
                num_hidden_layers=geometry.layers, attn_backend_name=geometry.attn_backend,
                cache_dtype=cache_dtype, extra={"is_hma_enabled": hybrid.hma_enabled(release, geometry),
                                                   **(extra or {})})
    return compat_hash(f)
