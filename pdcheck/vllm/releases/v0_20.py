"""vLLM 0.20 - 0.25 (era G20; G24 wire from 0.21): TransferTopology replaces KVTopology.

Replication is strict from 0.20 (`remote_tp_size > total_num_kv_heads`), the validation asserts
`remote_info.remote_tp_size == remote_tp_size`, and heterogeneous TP (|tp_ratio| != 1, KV not replicated, not
MLA) raises unless the LOCAL layout is HND. 0.21 stops asserting the P TP > D TP replication for MLA; 0.24 checks
block lengths per region with per-rank physical head counts (#45330). Connector version: 2 (0.20), 3 (0.21, +
physical_blocks_per_logical_kv_block), 4 (0.22+). is_hma_enabled hashes True by default from 0.22 (config asks
the connector, and NixlConnector is SupportsHMA); 0.20 - 0.21 still turn the hybrid manager off for any connector
unless --no-disable-hybrid-kv-cache-manager (releases.hybrid).
Checked against the wheels of 0.20.0, 0.20.1, 0.20.2, 0.21.0, 0.22.0, 0.22.1, 0.23.0, 0.24.0, 0.25.0, 0.25.1.
"""

from dataclasses import replace

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import Step
from pdcheck.vllm.releases.v0_14 import HASH_0_18, MODEL_0_18

HEAD_20: tuple[Step, ...] = (
    # add_remote_agent: register_remote_engine (first tp_size wins), NIXL add, block_size_ratio, dst_num_blocks
    rules.RECORD_TP_SIZE,
    rules.NIXL_ADD,
    rules.BLOCK_SIZE_RATIO,
    rules.RECORD_DST_NUM_BLOCKS,
)


def _validate_20(p_gt_d: object) -> tuple[Step, ...]:
    return (
        rules.TP_SIZE_ASSERT_20,
        p_gt_d,  # type: ignore[misc]
        rules.layout_check(enum_names=False),
        rules.HEAD_SPLIT_HND,
        rules.BLOCK_LENS_EQUAL_REPLICATED_20,
        rules.REMOTE_LAYERS_SAME_BLOCK_LEN_20,
        rules.BLOCK_LEN_TP_RATIO_20,
        rules.P_GT_D_SAME_BLOCK_SIZE_20,
        rules.BLOCK_LEN_P_GT_D_20,
        rules.DST_NUM_BLOCKS_ASSERT,
        rules.BASE_ADDR_LEN,
    )


VALIDATE_24: tuple[Step, ...] = (
    rules.TP_SIZE_ASSERT_20,
    rules.P_GT_D_REPLICATED_21,
    rules.layout_check(enum_names=False),
    rules.HEAD_SPLIT_HND,
    rules.NUM_LAYERS_24,
    # one loop over the regions: replicated, D TP >= P TP (split), P TP > D TP (block size, then split)
    rules.REPLICATED_REGIONS,
    rules.SPLIT_REGIONS,
    rules.P_GT_D_SAME_BLOCK_SIZE_20,
    rules.SPLIT_REGIONS_P_GT_D,
    rules.DST_NUM_BLOCKS_ASSERT,
    rules.BASE_ADDR_LEN,
)

PREP_20 = rules.prep_targets(signed=True, replicated=rules.is_replicated_strict)
PREP_24 = rules.prep_targets(signed=True, replicated=rules.is_replicated_strict, head_offsets=True)

MODEL = replace(
    MODEL_0_18, name="0.20.0", versions=("0.20.0", "0.20.1", "0.20.2"), wire="G20", version="0.20.0",
    hash_factors=HASH_0_18, add_remote=(*HEAD_20, *_validate_20(rules.P_GT_D_REPLICATED_20), PREP_20),
    summary="TransferTopology: strict replication, HND needed to split heads",
)

MODEL_0_21 = replace(MODEL, name="0.21.0", versions=("0.21.0",), wire="G24", version="0.21.0", connector_version=3,
                     add_remote=(*HEAD_20, *_validate_20(rules.P_GT_D_REPLICATED_21), PREP_20))

MODEL_0_22 = replace(MODEL_0_21, name="0.22.0", versions=("0.22.0", "0.22.1"), version="0.22.0",
                     connector_version=4, is_hma_enabled=True)

# 0.23: FlashAttention's cache becomes blocks-first, [num_blocks, 2, block_size, heads, head_dim]: one region per
# layer with K then V inside each block (TransferTopology.split_k_and_v is False); same checks as 0.22.
MODEL_0_23 = replace(MODEL_0_22, name="0.23.0", versions=("0.23.0",), version="0.23.0", fa_kv_regions="blocks_first",
                     summary="FlashAttention blocks-first: one region per layer, K and V inside each block")

MODEL_0_24 = replace(MODEL_0_23, name="0.24.0", versions=("0.24.0", "0.25.0", "0.25.1"), version="0.24.0",
                     add_remote=(*HEAD_20, *VALIDATE_24, PREP_24),
                     summary="per-region block lengths with per-rank head counts")
