"""vLLM 0.13 (era G): the metadata travels inside NixlHandshakePayload{compatibility_hash, ...}.

The attention backend moves from a bare assert into the compatibility hash (#29503), which is compared
before the inner metadata is decoded (strict_decode does this with Params.local_hash). Otherwise 0.11.1's
checks: P TP > D TP still fails TpKVTopology.tp_ratio, "nP > nD" is still refused in the handshake.
"""

from pdcheck.vllm.releases import rules, v0_11_1
from pdcheck.vllm.releases.base import ReleaseModel

# docs/vllm-protocol.md §3.5 factor keys, 0.13 - 0.14
HASH_0_13 = ("vllm_version", "nixl_connector_version", "model", "dtype", "num_kv_heads", "head_size",
             "num_hidden_layers", "attn_backend_name", "cache_dtype")

MODEL = ReleaseModel(
    name="0.13.0",
    versions=("0.13.0",),
    wire="G",
    flow="target_only",
    tp_size_from="params",
    recv_timeout_ms=5000,
    pre_flow=(rules.TP_RATIO_DIVISIBLE_111,),
    pre_add=(rules.engine_id_matches(), rules.NP_GT_ND),
    add_remote=(
        *v0_11_1.ADD_HEAD_111,
        *(s for s in v0_11_1.VALIDATE_111 if s is not rules.ATTN_BACKEND),
        rules.prep_targets(signed=False),
    ),
    notif="{req}:{tp_ratio}",  # f"{remote_request_id}:{tp_ratio}"
    version="0.13.0",
    connector_version=2,
    hash_factors=HASH_0_13,
    summary="compatibility hash (attn backend in it); otherwise as 0.11.1",
)
