"""SGLang 0.4.6.post1 (R1; 0.4.5.post3's nixl/conn.py is byte-identical): NIXL's own bootstrap server (B1), one
9-frame message per request with no guard and int64 page indices (E1), no peer checks, is_last parsed with
bool("0") (D completes after chunk 0), no timeouts. docs/sglang-protocol.md §3.2, §5.2 E1, §6.3, §7."""

from pdcheck.sglang.releases.base import SglangRelease

MODEL = SglangRelease(
    name="0.4.6.post1", tag="R1", versions=("0.4.5.post3", "0.4.6", "0.4.6.post1"),
    bootstrap="B1",
    put_keys=("role", "rank_ip", "rank_port", "engine_rank", "agent_name"),
    info_keys=(),  # no parallel-info query: D asks for its own engine rank
    rank_query=("engine_rank",),
    not_ready_status=404,
    wire="E1", guard=False, split_registration=False, index_dtype="int64",
    completion="notif",
    hetero_tp="lookup",
    last_chunk_bug=True,
    room_reuse="kept", p_blocks_on_info=True, page_count_assert=True,
    receiver_exception="Exception: Fake KVReceiver Exception",
    summary="NIXL's own bootstrap, 9 frames without guard, no checks, no timeouts, is_last bug",
)
