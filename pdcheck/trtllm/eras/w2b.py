"""W2b (chuangz0:disagg/native/transfer.py@14b23e51, T12): CANCEL_SESSION added, block ids as raw int64 bytes per
layer group (T29), KV_AGENT_RESULT as 7 ASCII frames with the transfer size (T36); AttentionPolicy's checks (T68,
assumed at W2b) and the nested RankInfo (W3's, T33)."""

from msgspec.structs import replace

from pdcheck.trtllm.eras import w2a

MODEL = replace(
    w2a.MODEL, name="W2b", wire="W2b", checks="attention", layer_count_rejects=False,
    summary="7-frame ASCII KV_AGENT_RESULT, int64 block-id bytes, AttentionPolicy checks",
    facts=("T12", "T29", "T33", "T36", "T45", "T68"),
)
