"""vLLM 0.10.1 - 0.10.2 (era D): 0.10.0 plus kv_cache_layout on the wire, compared only for heterogeneous TP.

`if tp_ratio > 1: assert nixl_agent_meta.kv_cache_layout == self.kv_cache_layout` (bare) sits in the
non-replicated branch, so homogeneous TP with different layouts passes (H09). The TPU pallas assert is
irrelevant on CUDA. Registration uses tp_rank as the device id and remote descriptors use remote_tp_rank.
"""

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import Ctx, ReleaseModel


def _block_size_msg(c: Ctx) -> str:
    # f"{self.block_size=} {remote_block_size=}", as in 0.9.2 - 0.10.0
    return ("Remote P worker with different block size is not supported "
            f"self.block_size={c.local.block_size} remote_block_size={rules.remote_block_size(c, True)}")


MODEL = ReleaseModel(
    name="0.10.1",
    versions=("0.10.1", "0.10.1.1", "0.10.2"),
    wire="D",
    flow="target_only",
    tp_size_from="params",
    recv_timeout_ms=None,
    pre_add=(rules.engine_id_matches(),),
    add_remote=(
        *rules.tp_size_consistent("self._tp_size[engine_id] == remote_tp_size"),
        rules.ATTN_BACKEND,
        rules.NIXL_ADD,
        rules.TP_DIVIDE,
        rules.TP_RATIO_POSITIVE,
        rules.LAYOUT_HETERO_TP_BARE,
        *rules.block_len_checks(with_replication=True),
        rules.block_size_check(_block_size_msg, with_replication=True),
        *rules.DST_NUM_BLOCKS_EQUAL,
        rules.prep_if_target(with_replication=True),
    ),
    version="0.10.1",
    summary="as 0.10.0, plus a bare kv_cache_layout assert when tp_ratio > 1; blocking recv",
)
