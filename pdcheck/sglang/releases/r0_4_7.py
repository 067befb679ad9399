"""SGLang 0.4.7 (R2): the common bootstrap server (B2: tp/dp sizes, -1/-1 parallel info, KeyError -> HTTP 500),
guard frame and one 11-field message per request with agent_name and required_dst_info_num (E2, int64 indices;
R2 nixl/conn.py:438-452, parsed :59-72). P TP != D TP asserts MLA-only (R2 common/conn.py:153-166)."""

from pdcheck.sglang.releases.base import SglangRelease

PUT_B2 = ("role", "tp_size", "dp_size", "rank_ip", "rank_port", "engine_rank")
INFO_B2 = ("prefill_tp_size", "prefill_dp_size")

MODEL = SglangRelease(
    name="0.4.7", tag="R2", versions=("0.4.7", "0.4.8"),
    bootstrap="B2", put_keys=PUT_B2, info_keys=INFO_B2, rank_query=("engine_rank", "target_dp_group"),
    not_ready_status=500,
    wire="E2", guard=True, split_registration=False, index_dtype="int64",
    completion="notif",
    hetero_tp="assert_mla",
    room_reuse="kept", page_count_assert=True,
    receiver_exception="Exception: Fake KVReceiver Exception",
    summary="guard frame, 11-field request, hetero TP asserts MLA-only, no timeouts",
)
