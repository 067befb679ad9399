"""vLLM 0.11.0 (era E): block_len becomes the per-layer list block_lens.

Replicated KV / MLA compares the whole list; otherwise every remote layer must have one block length, scaled
by tp_ratio. The block-size message says "page/block" and formats both values; a final bare assert compares
the number of regions. Still no receive timeout.
"""

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import Ctx, ReleaseModel


def _block_size_msg(c: Ctx) -> str:
    # "... not supported " f"{self.block_size=}, {remote_block_size=}"
    return ("Remote P worker with different page/block size is not supported "
            f"self.block_size={c.local.block_size!r}, remote_block_size={rules.remote_block_size(c, True)!r}")


MODEL = ReleaseModel(
    name="0.11.0",
    versions=("0.11.0",),
    wire="E",
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
        rules.BLOCK_LENS_EQUAL_REPLICATED_110,
        rules.REMOTE_LAYERS_SAME_BLOCK_LEN,
        rules.LAYOUT_HETERO_TP_BARE,
        rules.BLOCK_LEN_TP_RATIO_110,
        rules.block_size_check(_block_size_msg, with_replication=True),
        *rules.DST_NUM_BLOCKS_EQUAL,
        rules.BASE_ADDR_LEN,
        rules.prep_if_target(with_replication=True),
    ),
    version="0.11.0",
    summary="block_lens per layer; layout assert only for tp_ratio > 1; blocking recv",
)
