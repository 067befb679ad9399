"""Release models, one small file per vLLM release line. resolve() maps a release number to its model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgspec

from pdcheck.geometry import Geometry
from pdcheck.releaseline import ANY, ReleaseTable, is_corrected, split_many, unique
from pdcheck.vllm.releases import (
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
from pdcheck.vllm.releases.base import ReleaseModel

CORRECTED = corrected.MODEL

# (first, last) inclusive release ranges -> model. Each range is one behaviour: wire era, checks, connector
# version and hash factors; resolve() stamps the exact release typed into name and version.
TABLE: ReleaseTable[ReleaseModel] = ReleaseTable((
    ((0, 9, 0), (0, 9, 0), v0_9_0.MODEL),
    ((0, 9, 1), (0, 9, 1), v0_9_1.MODEL),
    ((0, 9, 2), (0, 9, ANY), v0_9_2.MODEL),
    ((0, 10, 0), (0, 10, 0), v0_9_2.MODEL_0_10_0),
    ((0, 10, 1), (0, 10, ANY), v0_10_1.MODEL),  # era D: 0.10.1, 0.10.1.1, 0.10.2
    ((0, 11, 0), (0, 11, 0), v0_11_0.MODEL),  # era E
    ((0, 11, 1), (0, 12, ANY), v0_11_1.MODEL),  # era F
    ((0, 13, 0), (0, 13, ANY), v0_13.MODEL),  # era G, compatibility hash
    ((0, 14, 0), (0, 15, ANY), v0_14.MODEL),  # P TP > D TP, all target ranks
    ((0, 16, 0), (0, 17, ANY), v0_14.MODEL_0_16),  # + cross_layers_blocks in the hash
    ((0, 18, 0), (0, 19, ANY), v0_14.MODEL_0_18),  # G18 (ssm_sizes), + is_hma_enabled (False)
    ((0, 20, 0), (0, 20, ANY), v0_20.MODEL),  # G20, TransferTopology: strict replication, HND head split
    ((0, 21, 0), (0, 21, ANY), v0_20.MODEL_0_21),  # G24 fields, version 3, MLA skips the P > D assert
    ((0, 22, 0), (0, 22, ANY), v0_20.MODEL_0_22),  # version 4, is_hma_enabled True
    ((0, 23, 0), (0, 23, ANY), v0_20.MODEL_0_23),  # FlashAttention blocks-first: one region per layer
    ((0, 24, 0), (0, 25, ANY), v0_20.MODEL_0_24),  # per-region checks, per-rank head counts
    ((0, 26, 0), (0, 27, ANY), v0_26.MODEL),  # era H: two reply frames, version 5
    ((0, 28, 0), (0, 28, ANY), v0_26.MODEL_0_28),  # version 7, + speculative_config, transfer_mode
    ((0, 29, 0), (0, 29, ANY), v0_29.MODEL),  # version 9, block_strides, KVCacheLayout names
    ((0, 30, 0), (0, 30, ANY), v0_29.MODEL_0_30),  # version 11, region metadata asserts
    ((0, 31, 0), (0, 31, ANY), v0_29.MODEL_0_31),  # version 13
    ((0, 32, 0), (0, 32, ANY), v0_29.MODEL_0_32),  # version 14, layout message names both layouts
    ((0, 33, 0), (0, 33, ANY), v0_29.MODEL_0_33),  # version 15
    ((0, 34, 0), (0, 34, ANY), v0_29.MODEL_0_34),  # H34, version 16, regions paired before the NIXL add
), example="0.9.1", four_part=("0.10.1.1",))
# Releases with a fourth number that exist (release wheels); any other four-part number is a typo.
LISTED_FOUR_PART = TABLE.four_part


def _parse(text: str, where: str = "--vllm") -> tuple[tuple[int, int, int], str]:
    """(major, minor, patch) for the lookup and the normalised release (ReleaseTable.parse)."""
    return TABLE.parse(text, where)


def _stamp(model: ReleaseModel, name: str) -> ReleaseModel:
    return replace(model, name=name, version=name)


def resolve(text: str, where: str = "--vllm") -> ReleaseModel:
    """The model of one release. Its name and version are the normalised release typed, e.g. '0.14.1'."""
    if is_corrected(text):
        return CORRECTED
    return TABLE.resolve(text, where, _stamp)


# One representative per line of checks, for `--vllm all`. 0.23 is 0.22's checks with FlashAttention's blocks-first
# KV layout, which only a single-release run (or serve) registers: a matrix keeps one layout (plan.kv_geometry).
REPRESENTATIVES = ("0.9.0", "0.9.1", "0.9.2", "0.10.0", "0.10.1", "0.11.0", "0.11.1", "0.13.0", "0.14.0",
                   "0.16.0", "0.18.0", "0.20.0", "0.21.0", "0.22.0", "0.24.0", "0.26.0", "0.28.0", "0.29.0",
                   "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
MODELLED = [resolve(v) for v in REPRESENTATIVES]
SUITE_FROM = (0, 9, 1)  # the wheel suites read releases from here (0.9.0's connector is the first one, read apart)


def suite_releases() -> list[str]:
    """The releases whose wheels the opt-in fidelity suites read (CI picks from these): the first release of
    every line in TABLE from SUITE_FROM, and the x.y.0 of every minor the table models after it."""
    picks = {f for f in TABLE.firsts() if f >= SUITE_FROM}
    picks |= {(0, m, 0) for m in range(SUITE_FROM[1] + 1, TABLE.last[1] + 1) if TABLE.at((0, m, 0)) is not None}
    return [".".join(map(str, v)) for v in sorted(picks)]


def resolve_many(text: str, where: str = "--vllm") -> list[ReleaseModel]:
    if text.strip() == "all":
        return list(MODELLED)
    return unique([resolve(part, where) for part in split_many(text, where)], where)


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
    return for_release(rel, geometry) if rel is not None and not is_corrected(rel) else geometry


def compat_hash_for(release: ReleaseModel, geometry: Geometry, model: str = "pdcheck/fake-model", *,
                    cache_dtype: str = "auto", extra: dict[str, Any] | None = None) -> str | None:
    """The NIXL compatibility hash an instance of `release` computes (docs/vllm-protocol.md §3.5), or None before 0.13 (no hash).

    D uses its Local's geometry and model for Params.local_hash; a fake P uses its own for encode_reply."""
    from pdcheck.vllm.releases import hybrid
    from pdcheck.vllm.wire.compat import compat_hash, factors

    if not release.hash_factors or release.connector_version is None:
        return None
    f = factors(release.hash_factors, vllm_version=release.version or release.versions[0],
                connector_version=release.connector_version, model=model, dtype=geometry.dtype,
                num_kv_heads=geometry.total_kv_heads, head_size=geometry.head_dim,
                num_hidden_layers=geometry.layers, attn_backend_name=geometry.attn_backend,
                cache_dtype=cache_dtype, extra={"is_hma_enabled": hybrid.hma_enabled(release, geometry),
                                                   **(extra or {})})
    return compat_hash(f)
