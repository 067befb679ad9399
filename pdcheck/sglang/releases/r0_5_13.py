"""SGLang 0.5.13 (R6): PrefillServerInfo over the bootstrap (B5: new GET parameters, 503 until every P rank
registered, D parses the answer with PrefillServerInfo(**data), R6 common/conn.py:245), a state frame inserted
at #7 of the registration (E5, 17 fields; R6 nixl/conn.py:130-160), engine_rank in the kv notification (#22145:
hetero TP fixed), the kv-dtype check, bootstrap and waiting timeouts of 300 s, KVTransferError. D's scheduler
fetches P's parallel info 15 times a second apart, then aborts the request (decode.py _ensure_prefill_info, first
in the 0.5.10 wheel, which pdcheck still maps to the 0.5.8 model); P truncates its pages to the ones D offered
(first in 0.5.12) where older P's assert."""

from pdcheck.sglang.releases.base import KV_DTYPE, LOST_R6, PAGE_SIZE, SglangRelease

PUT_B5 = ("attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size", "attn_dp_rank",
          "pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_ip", "rank_port", "page_size",
          "kv_cache_dtype", "load_balance_method")
# PrefillServerInfo's fields in 0.5.13 (common/conn.py:70-85): the answer is dataclasses.asdict(info)
INFO_REQUIRED = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
                 "follow_bootstrap_room")
INFO_TARGETS = ("target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks", "required_dst_info_num",
                "required_prefill_response_num")

MODEL = SglangRelease(
    name="0.5.13", tag="R6", versions=("0.5.13",),
    bootstrap="B5", put_keys=PUT_B5, info_keys=(*INFO_REQUIRED, *INFO_TARGETS), info_required=INFO_REQUIRED,
    rank_query=("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"),
    not_ready_status=503,
    wire="E5", guard=True, split_registration=True, index_dtype="int32",
    completion="notif_engine",
    checks=(PAGE_SIZE, KV_DTYPE),
    hetero_tp="fixed",
    pp_assert=True,
    records_reason=True, sends_state=True, dp_conflict_check=True, room_reuse="assert", aux_pairing="decode_count",
    heartbeat_s=5.0, node_failure_log=LOST_R6,
    bootstrap_timeout_s=300.0, waiting_timeout_s=300.0,
    ensure_retries=15, ensure_retry_s=1.0,  # decode.py _max_ensure_retries, _ensure_retry_interval
    receiver_exception="KVTransferError(bootstrap_room={room}): NIXL KVReceiver Exception",
    summary="503 gate, strict PrefillServerInfo, state frame at #7, engine_rank notif, dtype check, 300 s timeouts",
)
