"""SGLang 0.5.3 (R4): attention TP/DP and PP in the bootstrap (B3, /health), registration + decode_tp_size,
decode_tp_rank, dst_kv_item_len (E4, 11 fields; R4 nixl/conn.py:79-92). P TP != D TP non-MLA: head slicing with
only a warning, GQA offsets wrong when kv heads < TP (fixed by #22145 in 0.5.13). No page-size check, no
timeouts (heartbeat only). docs/sglang-protocol.md §4, §6.2, §7."""

from pdcheck.sglang.releases.base import LOST_R4, SglangRelease

PUT_B3 = ("role", "attn_tp_size", "attn_tp_rank", "attn_dp_size", "attn_dp_rank", "pp_size", "pp_rank",
          "system_dp_size", "system_dp_rank", "rank_ip", "rank_port")
INFO_B3 = ("prefill_attn_tp_size", "prefill_dp_size", "prefill_pp_size")

MODEL = SglangRelease(
    name="0.5.3", tag="R4", versions=("0.5.3",),
    bootstrap="B3", put_keys=PUT_B3, info_keys=INFO_B3,
    rank_query=("engine_rank", "target_dp_group", "target_pp_rank"),
    not_ready_status=500,
    wire="E4", guard=True, split_registration=True, index_dtype="int32",
    completion="notif",
    hetero_tp="slice",
    heartbeat_s=5.0, node_failure_log=LOST_R4, page_count_assert=True,
    receiver_exception="Exception: Fake KVReceiver Exception",
    summary="head slicing for hetero TP (GQA offsets wrong), no page-size check, no timeouts",
)
