"""vLLM 0.26 - 0.28 (era H): two reply frames `[payload, perf_counter]`.

D reads with recv_multipart() and `assert len(reply_parts) == 2` (strict_decode), and asks with
`[GET_META_MSG, pp_rank, tp_rank]`. The checks are 0.24's. FlashAttention packs K and V into the content dim:
cache [num_blocks, heads, block_size, 2 * head_dim] (HND; NHD permutes heads and tokens), one region per layer. Connector versions: 5 (0.26 - 0.27), 7 (0.28);
0.28 hashes speculative_config and transfer_mode too. 0.29 - 0.34: v0_29.
Checked against the wheels of 0.26.0, 0.27.0, 0.27.1, 0.28.0.
"""

from dataclasses import replace

from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.v0_14 import HASH_0_18
from pdcheck.vllm.releases.v0_20 import MODEL_0_24

HASH_0_20 = HASH_0_18  # kept for importers
HASH_0_28 = (*HASH_0_18, "speculative_config", "transfer_mode")

MODEL = replace(MODEL_0_24, name="0.26.0", versions=("0.26.0", "0.27.0", "0.27.1"), wire="H", version="0.26.0",
                connector_version=5, fa_kv_regions="packed", notif="{req}:{tp_ratio}",  # 0.26 sends f"{req}:{D_world_size}" (see v0_14)
                summary="two reply frames (clock sync); 0.24's checks",
                pre_flow=(rules.PP_DECODE_REFUSED, *MODEL_0_24.pre_flow))  # decode-side PP refused (base_worker)

MODEL_0_28 = replace(MODEL, name="0.28.0", versions=("0.28.0",), version="0.28.0", connector_version=7,
                     hash_factors=HASH_0_28)
