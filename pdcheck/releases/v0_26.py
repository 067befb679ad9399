"""vLLM 0.26 - 0.34 (era H; H31 from 0.31, H34 from 0.34): two reply frames `[payload, perf_counter]`.

D reads with recv_multipart() and `assert len(reply_parts) == 2` (strict_decode), and asks with
`[GET_META_MSG, pp_rank, tp_rank]`. The checks are 0.14's until 0.34. Connector versions: 5 (0.26 - 0.27),
7 (0.28 - 0.30), 13 (0.31 - 0.33), 16 (0.34). Hash: 0.28 adds speculative_config and transfer_mode, 0.31 drops
cross_layers_blocks. From 0.31 kv_cache_layout carries KVCacheLayout names (LBHNC = HND, LBNHC = NHD).

0.34 rewrites the validation: the replicated test is strict (remote_tp_size > total_num_kv_heads), block
lengths are checked per region with per-rank physical head counts (GQA replication), the layout message names
both layouts, head splitting needs a block-contiguous P layout, and P ranks of one engine must lay out their
regions alike. The dst_num_blocks equality assert is still there (H03).
"""

from collections.abc import Callable
from dataclasses import replace

from pdcheck.releases import rules
from pdcheck.releases.base import Check, Ctx, Prepared, ReleaseModel, Step
from pdcheck.releases.v0_14 import ADD_REMOTE_14, HASH_0_20, PRE_FLOW_14

HASH_0_28 = (*HASH_0_20, "speculative_config", "transfer_mode")
HASH_0_31 = tuple(k for k in HASH_0_28 if k != "cross_layers_blocks")


def _with_layout(steps: tuple[Step, ...], layout: Check) -> tuple[Step, ...]:
    return tuple(layout if s.id == "kv_cache_layout" else s for s in steps)


MODEL = ReleaseModel(
    name="0.26.0",
    versions=("0.26.0", "0.27.0"),
    wire="H",
    flow="all_targets",
    tp_size_from="params",
    recv_timeout_ms=5000,
    pre_flow=PRE_FLOW_14,
    pre_add=(rules.engine_id_matches(),),
    add_remote=ADD_REMOTE_14,
    notif="{req}:{tp_ratio}",  # 0.26 sends f"{remote_request_id}:{D_world_size}" (see v0_14)
    version="0.26.0",
    connector_version=5,
    hash_factors=HASH_0_20,
    summary="two reply frames (clock sync); 0.14's checks",
)

MODEL_0_28 = replace(MODEL, name="0.28.0", versions=("0.28.0", "0.29.0", "0.30.0"), version="0.28.0",
                     connector_version=7, hash_factors=HASH_0_28)

MODEL_0_31 = replace(MODEL_0_28, name="0.31.0", versions=("0.31.0", "0.32.0", "0.33.0"), wire="H31",
                     version="0.31.0", connector_version=13, hash_factors=HASH_0_31,
                     add_remote=_with_layout(ADD_REMOTE_14, rules.layout_check(enum_names=True)),
                     summary="per-region metadata; KVCacheLayout names; 0.14's checks")


# ---- 0.34 -----------------------------------------------------------------------------------------------------

def _earlier_ranks(c: Ctx) -> list[Prepared]:
    return [p for r, p in c.state.prepared.items() if r != c.remote_tp_rank]


def _same_regions(c: Ctx) -> bool:
    return all(len(p.base_addrs) == len(c.meta.kv_caches_base_addr) and p.remote_block_len == c.remote_block_len()
               for p in _earlier_ranks(c))


REGIONS_ALIKE = Check(
    "regions_alike", "every TP rank of the engine advertises the same KV regions", _same_regions,
    message=lambda c: f"The TP ranks of engine {c.engine_id} lay out their KV regions differently.",
    exc="RuntimeError", when=lambda c: bool(_earlier_ranks(c)), hazard="H08",
)


def _layout_msg(c: Ctx) -> str:
    return (f"Heterogeneous TP expects same kv_cache_layout (local {rules.layout_enum(c.local.kv_cache_layout)}, "
            f"remote {rules.layout_enum(c.meta.kv_cache_layout)}). Or enable experimental feature to use LBHNC to "
            "LBNHC support by setting 'enable_permute_local_kv'=True in --kv-transfer-config.")


LAYOUT_34 = rules.layout_check(enum_names=True, message=_layout_msg)


def remote_heads(c: Ctx) -> int:
    """Physical KV heads per P rank (GQA replication when P TP > heads)."""
    return max(1, c.local.geometry.total_kv_heads // c.state.tp_size[c.engine_id])


def local_heads(c: Ctx) -> int:
    return c.local.geometry.local_kv_heads


def _head_split(c: Ctx) -> bool:
    return not rules.is_replicated_strict(c) and remote_heads(c) > local_heads(c)


CONTIGUOUS_HEADS = ("LBHNC", "BLHNC")  # heads right after the block index: one D rank's heads are one slice

HEAD_SPLIT_CONTIGUOUS = Check(
    "head_split_contiguous", "remote kv_cache_layout keeps each block's heads contiguous",
    lambda c: rules.layout_enum(c.meta.kv_cache_layout) in CONTIGUOUS_HEADS,
    message=("Heterogeneous TP head-dimension splitting requires contiguous heads. Use a block-contiguous layout "
             "(e.g. LBHNC) on the prefill side."),
    exc="RuntimeError", when=lambda c: not c.local.use_mla and _head_split(c), hazard="H09",
)

NUM_LAYERS = Check(
    "num_kv_layers", "len(nixl_agent_meta.block_lens) == len(self.block_len_per_layer)",
    lambda c: len(rules.remote_block_lens(c)) == len(rules.block_len_per_layer(c)),
    message="Number of KV layers must match between prefill and decode", hazard="H08",
)


def _first_bad(c: Ctx, want: Callable[[int], int]) -> int | None:
    for i, local_len in enumerate(rules.block_len_per_layer(c)):
        if rules.remote_block_len_at(c, i) != want(local_len):
            return i
    return None


def _replicated_want(c: Ctx) -> Callable[[int], int]:
    bsr = rules.block_size_ratio(c)
    return lambda local_len: local_len // bsr


def _replicated_msg(c: Ctx) -> str:
    i = _first_bad(c, _replicated_want(c)) or 0
    return (f"KV cache sizes must match between P and D when replicated (region {i}: "
            f"local={rules.block_len_per_layer(c)[i]}, remote={rules.remote_block_lens(c)[i]}, "
            f"bsr={rules.block_size_ratio(c)}).")


REPLICATED_REGIONS = Check(
    "block_lens_equal_replicated", "self.block_len_per_layer[i] // block_size_ratio == nixl_agent_meta.block_lens[i]",
    lambda c: _first_bad(c, _replicated_want(c)) is None, message=_replicated_msg, when=rules.is_replicated_strict,
    hazard="H08",
)


def _split_want(c: Ctx) -> Callable[[int], int]:
    rh, lh, bsr = remote_heads(c), local_heads(c), rules.block_size_ratio(c)
    return lambda local_len: local_len * rh // lh // bsr


def _split_msg(c: Ctx) -> str:
    i = _first_bad(c, _split_want(c)) or 0
    return (f"SPLIT region {i}: remote P KV block_len {rules.remote_block_lens(c)[i]} must equal local "
            f"{rules.block_len_per_layer(c)[i]} * remote_heads {remote_heads(c)} // local_heads {local_heads(c)} "
            f"// block_size_ratio {rules.block_size_ratio(c)}.")


def _not_replicated_strict(c: Ctx) -> bool:
    return not rules.is_replicated_strict(c)


SPLIT_REGIONS = Check(
    "block_len_split",
    "nixl_agent_meta.block_lens[i] == self.block_len_per_layer[i] * remote_heads // local_heads // block_size_ratio",
    lambda c: _first_bad(c, _split_want(c)) is None, message=_split_msg, when=_not_replicated_strict, hazard="H08",
)

P_GT_D_SAME_BLOCK_SIZE_34 = replace(
    rules.P_GT_D_SAME_BLOCK_SIZE, when=lambda c: _not_replicated_strict(c) and rules.signed_tp_ratio(c) < 0)

BLOCK_STRIDES_LEN = Check(
    "block_strides_len", "len(nixl_agent_meta.block_strides) == len(nixl_agent_meta.block_lens)",
    lambda c: len(c.meta.block_strides or []) == len(rules.remote_block_lens(c)),
    when=lambda c: c.meta.block_strides is not None, hazard="H08",
)

BLOCK_STRIDES_GE = Check(
    "block_strides_ge", "stride >= block_len",
    lambda c: all(s >= n for s, n in zip(c.meta.block_strides or [], rules.remote_block_lens(c), strict=False)),
    when=lambda c: c.meta.block_strides is not None, hazard="H08",
)

ADD_REMOTE_34: tuple[Step, ...] = (
    # add_remote_agent
    rules.RECORD_TP_SIZE,
    rules.NIXL_ADD,
    rules.BLOCK_SIZE_RATIO,
    rules.RECORD_DST_NUM_BLOCKS,
    # base_worker._validate_remote_agent_handshake
    rules.TP_SIZE_ASSERT,
    REGIONS_ALIKE,
    LAYOUT_34,
    HEAD_SPLIT_CONTIGUOUS,
    NUM_LAYERS,
    REPLICATED_REGIONS,
    P_GT_D_SAME_BLOCK_SIZE_34,
    SPLIT_REGIONS,
    rules.DST_NUM_BLOCKS_ASSERT,
    rules.BASE_ADDR_LEN,
    BLOCK_STRIDES_LEN,
    BLOCK_STRIDES_GE,
    rules.prep_targets(signed=True, replicated=rules.is_replicated_strict, head_offsets=True),
)

MODEL_0_34 = replace(MODEL_0_31, name="0.34.0", versions=("0.34.0",), wire="H34", version="0.34.0",
                     connector_version=16, add_remote=ADD_REMOTE_34,
                     summary="per-region checks with per-rank head counts; strict replication; layout names")
