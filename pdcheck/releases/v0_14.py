"""vLLM 0.14 - 0.25 (era G; G20 from 0.20, G24 from 0.24): P TP > D TP (#27274).

TpKVTopology.tp_ratio is negative when P TP > D TP and must divide either way; it runs before any request
(pre_flow). A D rank then handshakes every P rank it reads (`all_targets`, one REQ socket), so the
`dst_num_blocks` equality assert, kept from 0.11.1, fires whenever those P ranks advertise different
num_blocks (H03). "nP > nD" is gone: a larger P block now fails block_size_ratio. Replicated KV with P TP > D
TP is a bare assert. Hash factors grow: cross_layers_blocks (0.16), is_hma_enabled (0.20); the connector
version is 2 until 0.20 and 4 in 0.24 - 0.25.
"""

from dataclasses import replace

from pdcheck.releases import rules
from pdcheck.releases.base import ReleaseModel, Step
from pdcheck.releases.v0_13 import HASH_0_13

HASH_0_16 = (*HASH_0_13, "cross_layers_blocks")
HASH_0_20 = (*HASH_0_16, "is_hma_enabled")

PRE_FLOW_14: tuple[Step, ...] = (rules.TP_RATIO_DIVISIBLE_LOCAL, rules.TP_RATIO_DIVISIBLE_REMOTE)

ADD_REMOTE_14: tuple[Step, ...] = (
    # add_remote_agent
    rules.RECORD_TP_SIZE,
    rules.NIXL_ADD,
    rules.BLOCK_SIZE_RATIO,
    rules.RECORD_DST_NUM_BLOCKS,
    # _validate_remote_agent_handshake
    rules.TP_SIZE_ASSERT,
    rules.NOT_P_GT_D_REPLICATED,
    rules.layout_check(enum_names=False),
    rules.BLOCK_LENS_EQUAL_REPLICATED,
    rules.REMOTE_LAYERS_SAME_BLOCK_LEN,
    rules.BLOCK_LEN_TP_RATIO_14,
    rules.P_GT_D_SAME_BLOCK_SIZE,
    rules.BLOCK_LEN_P_GT_D,
    rules.DST_NUM_BLOCKS_ASSERT,
    rules.BASE_ADDR_LEN,
    # back in add_remote_agent: this rank's descriptors
    rules.prep_targets(signed=True),
)

MODEL = ReleaseModel(
    name="0.14.0",
    versions=("0.14.0", "0.14.1", "0.15.0"),
    wire="G",
    flow="all_targets",
    tp_size_from="params",
    recv_timeout_ms=5000,
    pre_flow=PRE_FLOW_14,
    pre_add=(rules.engine_id_matches(),),
    add_remote=ADD_REMOTE_14,
    # 0.14 sends f"{remote_request_id}:{D_world_size}"; pdcheck's transfer fills only {req} and {tp_ratio}.
    notif="{req}:{tp_ratio}",
    version="0.14.0",
    connector_version=2,
    hash_factors=HASH_0_13,
    summary="P TP > D TP supported; every target P rank handshaken; dst_num_blocks equality re-armed (H03)",
)

MODEL_0_16 = replace(MODEL, name="0.16.0", versions=("0.16.0", "0.17.0", "0.18.0", "0.19.0"), version="0.16.0",
                     hash_factors=HASH_0_16)

# 0.20: ssm_sizes and attn_backend_name back in the metadata (no version bump), is_hma_enabled hashed
MODEL_0_20 = replace(MODEL_0_16, name="0.20.0", versions=("0.20.0", "0.21.0", "0.22.0", "0.23.0"), wire="G20",
                     version="0.20.0", hash_factors=HASH_0_20)

# 0.24: physical_blocks_per_logical_kv_block (3) and lease heartbeats (4)
MODEL_0_24 = replace(MODEL_0_20, name="0.24.0", versions=("0.24.0", "0.25.0"), wire="G24", version="0.24.0",
                     connector_version=4)
