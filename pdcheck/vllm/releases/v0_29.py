"""vLLM 0.29 - 0.34 (era H, per-region metadata: block_strides from 0.29, region_* from 0.30, region_members
from 0.31, ple_block_len from 0.32, layer_group_ids from 0.34; pdcheck reads them with the H29/H31/H34 schemas).

0.29 names layouts with KVCacheLayout (LBHNC = HND, LBNHC = NHD) and splits heads only into a block-contiguous
LOCAL layout; cross_layers_blocks leaves the hash. 0.30 asserts the region metadata at the end of the
validation (block_strides length, stride >= block_len). 0.32's layout message names both layouts. 0.34 pairs
the remote regions with its own before anything else in add_remote_agent: P ranks of one engine whose regions
pair differently raise "lay out their KV regions differently" before the NIXL add and the validation.
Connector versions: 9 (0.29), 11 (0.30), 13 (0.31), 14 (0.32), 15 (0.33), 16 (0.34).
Checked against the wheels of 0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0, 0.34.0.
"""

import re
from dataclasses import replace

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import Action, Check, Ctx, Step
from pdcheck.vllm.releases.v0_20 import HEAD_20, PREP_24
from pdcheck.vllm.releases.v0_26 import HASH_0_28, MODEL_0_28

HASH_0_29 = tuple(k for k in HASH_0_28 if k != "cross_layers_blocks")


MSG_REGION_NAMES = "NIXL transfer regions must name the same model caches in the same order"


def region_names_check(expr: str) -> Check:
    """0.30 - 0.33, end of the validation: `if nixl_agent_meta.region_names is not None: assert <expr>, MSG`.
    0.31+ compare with `_transfer_layer_names or self.region_names`: the region names for one PP stage."""
    return Check(
        "region_names", expr, lambda c: c.meta.region_names == c.local.geometry.region_layers(),
        message=MSG_REGION_NAMES, when=lambda c: c.meta.region_names is not None, hazard="H08",
    )


REGION_NAMES_30 = region_names_check("nixl_agent_meta.region_names == self.region_names")
REGION_NAMES_31 = region_names_check("nixl_agent_meta.region_names == expected_names")


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
        *((REGION_NAMES_31 if regions_31 else REGION_NAMES_30,) if strides else ()),
    )


MODEL = replace(
    MODEL_0_28, name="0.29.0", versions=("0.29.0",), wire="H29", version="0.29.0", connector_version=9,
    hash_factors=HASH_0_29,
    add_remote=(*HEAD_20, *_validate(rules.LAYOUT_29, strides=False, regions_31=False), PREP_24),
    summary="KVCacheLayout names; block-contiguous local layout to split heads",
)
MODEL_0_30 = replace(MODEL, name="0.30.0", versions=("0.30.0",), wire="H31", version="0.30.0", connector_version=11,
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
    return all(v is None or len(v) == n for v in (c.meta.block_lens, c.meta.block_strides, c.meta.region_names))


REGION_METADATA_LENGTHS = Check(
    "region_metadata_lengths", "every per-region metadata list has len(kv_caches_base_addr) entries", _lengths_ok,
    message=lambda c: f"Engine {c.engine_id} advertised KV region metadata of different lengths.",
    exc="RuntimeError", hazard="H08",
)


# _pair_regions pairs the peer's regions with the local ones through the layer names in region_members: the
# peer must name the layers of every region, hold only local layers (one PP stage) and every local layer.
LAYERS_ADVERTISED = Check(
    "region_members", "len(nixl_agent_meta.region_members) == num_regions",
    lambda c: len(c.meta.region_members or []) == len(c.meta.kv_caches_base_addr),
    message=lambda c: f"Engine {c.engine_id} did not advertise the layers of its KV regions.",
    exc="RuntimeError", hazard="H08",
)


def _remote_layers(c: Ctx) -> dict[str, int]:
    out: dict[str, int] = {}
    for names in c.meta.region_members or []:
        for name in names:
            out[name] = out.get(name, 0) + 1
    return out


def _local_layers(c: Ctx) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in c.local.geometry.region_layers():
        out[name] = out.get(name, 0) + 1
    return out


def _stranger(c: Ctx) -> str | None:
    local = _local_layers(c)
    return next((n for n in _remote_layers(c) if n not in local), None)


def _spans_differ(c: Ctx) -> str | None:
    local = _local_layers(c)
    return next((n for n, k in _remote_layers(c).items() if n in local and local[n] != k), None)


def _layer_key(name: str) -> tuple[tuple[int, int | str], ...]:
    # the release's _region_sort_key: model-layer order, then cache name
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name))


def _missing(c: Ctx) -> list[str]:
    return sorted(_local_layers(c).keys() - _remote_layers(c).keys(), key=_layer_key)


LAYER_KNOWN = Check(
    "layer_known", "layer_name in self._regions_by_layer", lambda c: _stranger(c) is None,
    message=lambda c: f"Engine {c.engine_id} holds KV layer {_stranger(c)!r}, which has no counterpart here.",
    exc="RuntimeError", hazard="H08",
)
LAYER_SPANS = Check(
    "layer_spans", "len(local_regions) == len(remote_regions)", lambda c: _spans_differ(c) is None,
    message=lambda c: (f"KV layer {_spans_differ(c)!r} spans {_remote_layers(c)[_spans_differ(c) or '']} NIXL "
                       f"regions on engine {c.engine_id} and {_local_layers(c)[_spans_differ(c) or '']} here."),
    exc="NotImplementedError", hazard="H08",
)
LAYERS_HELD = Check(
    "layers_held", "not missing", lambda c: not _missing(c),
    message=lambda c: f"Engine {c.engine_id} does not hold the KV layers {_missing(c)}.",
    exc="RuntimeError", hazard="H08",
)


def _pairs(c: Ctx) -> tuple[tuple[str, ...], ...]:
    # What _pair_regions derives from the peer's region_members for a fixed local side: which remote region
    # holds which layer, in the peer's order.
    return tuple(tuple(names) for names in c.meta.region_members or [])


def _record_pairs(c: Ctx) -> None:
    c.state.dst_pairs.setdefault(c.engine_id, _pairs(c))


# `if self._dst_pairs.setdefault(engine_id, pairs) != pairs: raise RuntimeError(...)`
REGIONS_ALIKE = Check(
    "regions_alike", "self._dst_pairs.setdefault(engine_id, pairs) == pairs",
    lambda c: c.state.dst_pairs[c.engine_id] == _pairs(c),
    message=lambda c: f"The TP ranks of engine {c.engine_id} lay out their KV regions differently.",
    exc="RuntimeError", when=lambda c: c.engine_id in c.state.dst_pairs, hazard="H08",
)
RECORD_PAIRS = Action("record_dst_pairs", _record_pairs)

MODEL_0_34 = replace(
    MODEL_0_33, name="0.34.0", versions=("0.34.0",), wire="H34", version="0.34.0", connector_version=16,
    add_remote=(REGION_METADATA_LENGTHS, LAYERS_ADVERTISED, LAYER_KNOWN, LAYER_SPANS, LAYERS_HELD, REGIONS_ALIKE,
                RECORD_PAIRS, *HEAD_20,
                *_validate(rules.LAYOUT_32, strides=True, regions_31=True), PREP_24),
    summary="regions paired before the NIXL add; per-region checks with per-rank head counts",
)
