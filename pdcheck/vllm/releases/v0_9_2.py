"""vLLM 0.9.2 - 0.10.0: target rank only, tp_size from kv_transfer_params (#19413); `>=` dropped (#19532).

0.10.0 adds the engine-id RuntimeError before add_remote_agent.
"""

from dataclasses import replace

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import Ctx, ReleaseModel


def _block_size_msg(c: Ctx) -> str:
    # 0.9.2 formats the values with f"{self.block_size=} {remote_block_size=}".
    return ("Remote P worker with different block size is not supported "
            f"self.block_size={c.local.block_size} remote_block_size={rules.remote_block_size(c, True)}")

MODEL = ReleaseModel(
    name="0.9.2",
    versions=("0.9.2",),
    wire="C",
    flow="target_only",
    tp_size_from="params",
    recv_timeout_ms=None,
    pre_add=(),
    add_remote=(
        *rules.tp_size_consistent("self._tp_size[engine_id] == remote_tp_size"),
        rules.ATTN_BACKEND,
        rules.NIXL_ADD,
        rules.TP_DIVIDE,
        rules.TP_RATIO_POSITIVE,
        *rules.block_len_checks(with_replication=True),
        rules.block_size_check(_block_size_msg, with_replication=True),
        *rules.DST_NUM_BLOCKS_EQUAL,
        rules.prep_if_target(with_replication=True),
    ),
    summary="target rank only (tp_size from kv_transfer_params); blocking recv in a 1-thread executor",
)

MODEL_0_10_0 = replace(MODEL, name="0.10.0", versions=("0.10.0",), pre_add=(rules.engine_id_matches(),))
