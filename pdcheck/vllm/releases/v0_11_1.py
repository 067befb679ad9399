"""vLLM 0.11.1 - 0.12 (era F): scheduler-side listener, `[GET_META_MSG, tp_rank]`, 5 s receive timeout.

_nixl_handshake computes the target rank through TpKVTopology.tp_ratio before any request (pre_flow), checks
the engine id and `metadata.block_size <= self.block_size` ("nP > nD"), then add_remote_agent records
tp_size / block_size / dst_num_blocks for a new engine, adds the NIXL agent, derives block_size_ratio and
runs _validate_remote_agent_handshake. The layout difference is a RuntimeError even for homogeneous TP.
Remote descriptors use the device_id P advertises.
"""

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import ReleaseModel, Step

# _validate_remote_agent_handshake, in source order (0.13 drops the attention-backend assert: in the hash)
VALIDATE_111: tuple[Step, ...] = (
    rules.TP_SIZE_ASSERT,
    rules.ATTN_BACKEND,
    rules.TP_RATIO_POSITIVE,
    rules.layout_check(enum_names=False),
    rules.BLOCK_LENS_EQUAL_REPLICATED,
    rules.REMOTE_LAYERS_SAME_BLOCK_LEN,
    rules.BLOCK_LEN_TP_RATIO_111,
    rules.DST_NUM_BLOCKS_ASSERT,
    rules.BASE_ADDR_LEN,
)

# add_remote_agent before the validation
ADD_HEAD_111: tuple[Step, ...] = (
    rules.RECORD_TP_SIZE,
    rules.NIXL_ADD,
    rules.BLOCK_SIZE_RATIO,
    rules.RECORD_DST_NUM_BLOCKS,
)

MODEL = ReleaseModel(
    name="0.11.1",
    versions=("0.11.1", "0.11.2", "0.12.0"),
    wire="F",
    flow="target_only",
    tp_size_from="params",
    recv_timeout_ms=5000,
    pre_flow=(rules.TP_RATIO_DIVISIBLE_111,),
    pre_add=(rules.engine_id_matches(), rules.NP_GT_ND),
    add_remote=(*ADD_HEAD_111, *VALIDATE_111, rules.prep_targets(signed=False)),
    version="0.11.1",
    summary="scheduler listener, 5 s timeout; nP > nD and layout refused; validate_remote_agent_handshake",
)
