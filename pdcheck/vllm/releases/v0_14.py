"""vLLM 0.14 - 0.19 (era G; G18 from 0.18): P TP > D TP (#27274). 0.20 - 0.25: v0_20.

TpKVTopology.tp_ratio is negative when P TP > D TP and must divide either way; it runs before any request
(pre_flow). A D rank then handshakes every P rank it reads (`all_targets`, one REQ socket), so the
`dst_num_blocks` equality assert, kept from 0.11.1, fires whenever those P ranks advertise different
num_blocks (H03). "nP > nD" is gone: a larger P block now fails block_size_ratio. Replicated KV with P TP > D
TP is a bare assert, also for MLA (KVTopology.is_kv_replicated: `remote_tp_size // total_num_kv_heads >= 1`).
Hash factors grow: cross_layers_blocks (0.16), is_hma_enabled (0.18); the connector version is 2.
Checked against the wheels of 0.14.0, 0.14.1, 0.15.0, 0.15.1, 0.16.0, 0.17.0, 0.17.1, 0.18.0, 0.18.1, 0.19.0, 0.19.1.
"""

from dataclasses import replace

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import ReleaseModel, Step
from pdcheck.vllm.releases.v0_13 import HASH_0_13

HASH_0_16 = (*HASH_0_13, "cross_layers_blocks")
HASH_0_18 = (*HASH_0_16, "is_hma_enabled")
HASH_0_20 = HASH_0_18  # kept for importers

PRE_FLOW_14: tuple[Step, ...] = (rules.TP_RATIO_DIVISIBLE_LOCAL, rules.TP_RATIO_DIVISIBLE_REMOTE)

ADD_REMOTE_14: tuple[Step, ...] = (
    # add_remote_agent
    rules.RECORD_TP_SIZE,
    rules.NIXL_ADD,
    rules.BLOCK_SIZE_RATIO,
    rules.RECORD_DST_NUM_BLOCKS,
    # _validate_remote_agent_handshake
    rules.TP_SIZE_ASSERT,
    rules.P_GT_D_REPLICATED_14,
    rules.layout_check(enum_names=False),
    rules.BLOCK_LENS_EQUAL_REPLICATED,
    rules.REMOTE_LAYERS_SAME_BLOCK_LEN,
    rules.BLOCK_LEN_TP_RATIO_14_PAGE,
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

MODEL_0_16 = replace(MODEL, name="0.16.0", versions=("0.16.0", "0.17.0"), version="0.16.0",
                     hash_factors=HASH_0_16)

# 0.18: ssm_sizes in the metadata (wire G18, no version bump), is_hma_enabled hashed: False by default, since 0.18 -
# 0.21 disable the hybrid KV cache manager whenever --kv-transfer-config is set; NixlConnector is SupportsHMA from
# 0.18 (read in 0.18.0, not 0.17.0), so an explicit --no-disable-hybrid-kv-cache-manager turns it on (releases.hybrid).
MODEL_0_18 = replace(MODEL_0_16, name="0.18.0", versions=("0.18.0", "0.19.0"), wire="G18", version="0.18.0",
                     hash_factors=HASH_0_18)
