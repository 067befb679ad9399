"""vLLM 0.9.1 (#18833): handshake P rank 0 first to learn tp_size, then the target rank.

The rank-0 pre-handshake records rank 0's num_blocks for the whole engine: vLLM #19338.
"""

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import ReleaseModel

MODEL = ReleaseModel(
    name="0.9.1",
    versions=("0.9.1",),
    wire="B",
    flow="rank0_then_target",
    tp_size_from="metadata",
    recv_timeout_ms=None,
    pre_add=(),
    add_remote=(
        *rules.tp_size_consistent("self._tp_size[engine_id] == nixl_agent_meta.tp_size"),
        rules.ATTN_BACKEND,
        rules.NIXL_ADD,
        rules.TP_DIVISIBLE_091,
        rules.TP_RATIO_POSITIVE,
        *rules.block_len_checks(with_replication=False),
        rules.block_size_check("Remote P worker with different block size is not supported", with_replication=False),
        rules.NUM_BLOCKS_GE,
        *rules.DST_NUM_BLOCKS_EQUAL,
        rules.prep_if_target(with_replication=False),
    ),
    summary="rank-0 pre-handshake (tp_size from metadata), then the target rank; blocking recv",
)
