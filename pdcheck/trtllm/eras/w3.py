"""W3, the Python transceiver of disagg/native/transfer.py@006dd5ec (T12): KV_AGENT_RESULT as one 34-byte struct
(T35), RecvReqInfo with dst_start_token and bounce_dst_base (T30), the nested RankInfo and page table (T33, T38),
AttentionPolicy's checks on the ctx, only logged (T68, T69), and the gen-side gate that raises
PeerIncompatibleError (T70; its attention half is not established, so it fires on no attention field). The 1.4.0rc
default runtime (E5) as far as read: E5 resolves to this line."""

from msgspec.structs import replace

from pdcheck.trtllm.eras import w2b

MODEL = replace(
    w2b.MODEL, name="W3", wire="W3", gate=True, era="E4 (opt-in Python), E5 (default)",
    releases="1.3.0rc opt-in, 1.4.0rc default",
    timeout_source="kv_transfer_timeout_ms = 60000 (trtllm#12249, merged 2026-03-18)",
    dated="main at 006dd5ec; E5 by the 1.4.0rc1/rc4 docs (transceiver_runtime = 'PYTHON', T6)",
    summary="struct KV_AGENT_RESULT, page table, ctx-side checks only logged, gen-side gate (Mamba half)",
    facts=("T12", "T30", "T33", "T35", "T38", "T45", "T68", "T69", "T70"),
)
E5 = replace(MODEL, name="E5", era="E5", releases="1.4.0rc",
             summary="the Python transceiver by default, as W3")
