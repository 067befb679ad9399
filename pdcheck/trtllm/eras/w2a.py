"""W2a (Shixiaowei02:disagg/native/transfer.py@1867cbb1, T12): KV_AGENT_RESULT as 6 ASCII frames (T36),
RecvReqInfo as W1b per layer group (T28), the nested RankInfo served by RankInfoServer (not read at a W2 commit:
pdcheck's is W3's, T33). Handlers are wrapped: an unknown type is logged (T45). The registrar at W2 was not read:
PeerRegistrar's checks (T67) assumed. kv_transfer_timeout_ms 60000 assumed (after trtllm#12249)."""

from msgspec.structs import replace

from pdcheck.trtllm.eras import w1a

MODEL = replace(
    w1a.MODEL, name="W2a", wire="W2a", listener="logs", transfer_timeout_ms=60000,
    timeout_source="kv_transfer_timeout_ms = 60000 (trtllm#12249; assumed for W2)",
    summary="6-frame ASCII KV_AGENT_RESULT, nested RankInfo; handler errors logged",
    facts=("T12", "T28", "T33", "T36", "T45"),
)
