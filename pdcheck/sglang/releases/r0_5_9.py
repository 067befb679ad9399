"""SGLang 0.5.9 - 0.5.12: between R5 (0.5.8) and R6 (0.5.13), read in the 0.5.9, 0.5.10, 0.5.11 and 0.5.12 wheels.

0.5.9: a hybrid model's state in the messages (the state pointers at #7 of the registration, the state indices at
#7 of the request; P WRITEs the state, _send_mamba_state), as raw arrays (E5r). 0.5.10: PrefillServerInfo over
the bootstrap (B5, 503 until every P rank registered, the kv-dtype check), P's bootstrap timeout of 300 s
(common/conn.py), and D's scheduler fetches P's parallel info 15 times a second apart, then aborts the request
(decode.py _ensure_prefill_info). 0.5.11: the state item lengths in the registration and decode_prefix_len in the
request (E5s), the follow_bootstrap_room DP conflict check. 0.5.12: the state frames as common/utils
unpack_int_lists (E5), P truncates its pages to the ones D offered instead of asserting, a room reused after its
last chunk fails the transfer worker's `assert room in self.transfer_infos`, and P sends the metadata (aux) WRITE
and its notification only with a request's state (found by tests/test_sglang_fidelity.py: a model without one
never completes on D). Still as 0.5.8: the pp_rank in the
kv notification (P TP > D TP non-MLA never completes), `transfers affected` on a lost P, RuntimeError("NIXL
KVReceiver Exception") without the recorded reason."""

from msgspec.structs import replace

from pdcheck.sglang.releases import r0_5_8, r0_5_13
from pdcheck.sglang.releases.base import KV_DTYPE, PAGE_SIZE

MODEL = replace(
    r0_5_8.MODEL, name="0.5.9", tag="R5a", versions=("0.5.9",), wire="E5r", sends_state=True,
    summary="0.5.8 with a hybrid model's state frames (raw arrays)",
)
MODEL_0_5_10 = replace(
    MODEL, name="0.5.10", tag="R5b", versions=("0.5.10",),
    bootstrap="B5", put_keys=r0_5_13.PUT_B5, info_keys=(*r0_5_13.INFO_REQUIRED, *r0_5_13.INFO_TARGETS),
    info_required=r0_5_13.INFO_REQUIRED, rank_query=r0_5_13.MODEL.rank_query, not_ready_status=503,
    checks=(PAGE_SIZE, KV_DTYPE), bootstrap_timeout_s=300.0,
    ensure_retries=15, ensure_retry_s=1.0,  # decode.py _max_ensure_retries, _ensure_retry_interval
    summary="503 gate, strict PrefillServerInfo, dtype check, parallel-info retries; pp_rank notif (P TP > D TP hangs)",
)
MODEL_0_5_11 = replace(MODEL_0_5_10, name="0.5.11", tag="R5c", versions=("0.5.11",), wire="E5s", dp_conflict_check=True,
                       summary="0.5.10 + DP conflict check, state item lengths in the registration")
MODEL_0_5_12 = replace(MODEL_0_5_11, name="0.5.12", tag="R5d", versions=("0.5.12",), wire="E5", page_count_assert=False,
                       room_reuse="assert", aux_needs_state=True,
                       summary="0.5.11 + packed state frames, P truncates to D's pages, room reuse asserts on P, "
                               "aux sent only with a state (a model without one never completes)")
