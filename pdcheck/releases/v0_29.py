"""vLLM 0.29 - 0.34 (era H, per-region metadata: block_strides from 0.29, region_* from 0.30, region_members
from 0.31, ple_block_len from 0.32, layer_group_ids from 0.34; pdcheck reads them with the H31/H34 schemas).

0.29 names layouts with KVCacheLayout (LBHNC = HND, LBNHC = NHD) and splits heads only into a block-contiguous
LOCAL layout; cross_layers_blocks leaves the hash. 0.30 asserts the region metadata at the end of the
validation (block_strides length, stride >= block_len). 0.32's layout message names both layouts. 0.34 pairs
the remote regions with its own before anything else in add_remote_agent: P ranks of one engine whose regions
pair differently raise "lay out their KV regions differently" before the NIXL add and the validation.
Connector versions: 9 (0.29), 11 (0.30), 13 (0.31), 14 (0.32), 15 (0.33), 16 (0.34).
Checked against the wheels of 0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0, 0.34.0.
"""

from dataclasses import replace

from pdcheck.releases import rules
from pdcheck.releases.base import Check, Ctx, Prepared, Step
from pdcheck.releases.v0_20 import HEAD_20, PREP_24
from pdcheck.releases.v0_26 import HASH_0_28, MODEL_0_28

HASH_0_29 = tuple(k for k in HASH_0_28 if k != "cross_layers_blocks")
HASH_0_31 = HASH_0_29  # kept for importers


def _validate(layout: Check, *, strides: bool, regions_31: bool) -> tuple[Step, ...]:
    return (
        rules.TP_SIZE_ASSERT_20,
        rules.P_GT_D_REPLICATED_21,
        layout,
        rules.HEAD_SPLIT_ENUM,
        rules.NUM_LAYERS_31 if regions_31 else rules.NUM_LAYERS_24,
        rules.REPLICATED_REGIONS,
        rules.SPLIT_REGIONS,
        rules.P_GT_D_SAME_BLOCK_SIZE_20,
        rules.SPLIT_REGIONS_P_GT_D,
        rules.DST_NUM_BLOCKS_ASSERT,
        rules.BASE_ADDR_LEN_31 if regions_31 else rules.BASE_ADDR_LEN,
        *((rules.BLOCK_STRIDES_LEN, rules.BLOCK_STRIDES_GE) if strides else ()),
    )


MODEL = replace(
    MODEL_0_28, name="0.29.0", versions=("0.29.0",), wire="H31", version="0.29.0", connector_version=9,
    hash_factors=HASH_0_29,
    add_remote=(*HEAD_20, *_validate(rules.LAYOUT_29, strides=False, regions_31=False), PREP_24),
    summary="KVCacheLayout names; block-contiguous local layout to split heads",
)
MODEL_0_30 = replace(MODEL, name="0.30.0", versions=("0.30.0",), version="0.30.0", connector_version=11,
                     add_remote=(*HEAD_20, *_validate(rules.LAYOUT_29, strides=True, regions_31=False), PREP_24),
                     summary="region metadata asserted after the validation")
MODEL_0_31 = replace(MODEL_0_30, name="0.31.0", versions=("0.31.0",), version="0.31.0", connector_version=13,
                     add_remote=(*HEAD_20, *_validate(rules.LAYOUT_29, strides=True, regions_31=True), PREP_24),
                     summary="per-region metadata; KVCacheLayout names")
MODEL_0_32 = replace(MODEL_0_31, name="0.32.0", versions=("0.32.0",), version="0.32.0", connector_version=14,
                     add_remote=(*HEAD_20, *_validate(rules.LAYOUT_32, strides=True, regions_31=True), PREP_24),
                     summary="layout message names both layouts")
MODEL_0_33 = replace(MODEL_0_32, name="0.33.0", versions=("0.33.0",), version="0.33.0", connector_version=15)


# ---- 0.34: _pair_regions before anything else in add_remote_agent ---------------------------------------------

def _lengths_ok(c: Ctx) -> bool:
    n = len(c.meta.kv_caches_base_addr)
    return all(v is None or len(v) == n for v in (c.meta.block_lens, c.meta.block_strides))


REGION_METADATA_LENGTHS = Check(
    "region_metadata_lengths", "every per-region metadata list has len(kv_caches_base_addr) entries", _lengths_ok,
    message=lambda c: f"Engine {c.engine_id} advertised KV region metadata of different lengths.",
    exc="RuntimeError", hazard="H08",
)


def _earlier_ranks(c: Ctx) -> list[Prepared]:
    return [p for r, p in c.state.prepared.items() if r != c.remote_tp_rank]


def _same_regions(c: Ctx) -> bool:
    # `self._dst_pairs.setdefault(engine_id, pairs) != pairs`: the pairing of remote regions with local ones,
    # which for one model differs only when the number of regions does.
    return all(len(p.base_addrs) == len(c.meta.kv_caches_base_addr) for p in _earlier_ranks(c))


REGIONS_ALIKE = Check(
    "regions_alike", "self._dst_pairs.setdefault(engine_id, pairs) == pairs", _same_regions,
    message=lambda c: f"The TP ranks of engine {c.engine_id} lay out their KV regions differently.",
    exc="RuntimeError", when=lambda c: bool(_earlier_ranks(c)), hazard="H08",
)

MODEL_0_34 = replace(
    MODEL_0_33, name="0.34.0", versions=("0.34.0",), wire="H34", version="0.34.0", connector_version=16,
    add_remote=(REGION_METADATA_LENGTHS, REGIONS_ALIKE, *HEAD_20,
                *_validate(rules.LAYOUT_32, strides=True, regions_31=True), PREP_24),
    summary="regions paired before the NIXL add; per-region checks with per-rank head counts",
)
