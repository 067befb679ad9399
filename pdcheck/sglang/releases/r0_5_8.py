"""SGLang 0.5.8 (R5): page_size in the bootstrap (B4) and D's first check (PR #14474, R5 common/conn.py:276-284),
the PP assert, pp_rank in the kv notification (#15027), SGLANG_DISAGGREGATION_WAITING_TIMEOUT = 300 s on D.
P TP > D TP non-MLA never completes: every P rank notifies pp_rank 0 (#19043, fixed by #22145 in 0.5.13)."""

from msgspec.structs import replace

from pdcheck.sglang.releases import r0_5_3
from pdcheck.sglang.releases.base import PAGE_SIZE

MODEL = replace(
    r0_5_3.MODEL, name="0.5.8", tag="R5", versions=("0.5.8",),
    bootstrap="B4", put_keys=(*r0_5_3.PUT_B3, "page_size"), info_keys=(*r0_5_3.INFO_B3, "prefill_page_size"),
    completion="notif_pp",
    checks=(PAGE_SIZE,),
    hetero_tp="slice_pp_hang",
    pp_assert=True,
    aux_pairing="decode_count",
    waiting_timeout_s=300.0,
    receiver_exception="RuntimeError: NIXL KVReceiver Exception",
    summary="page-size check, pp_rank in notifications (P TP > D TP hangs 300 s), waiting timeout",
)
