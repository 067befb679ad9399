"""What an SGLang release model is: data (bootstrap era, frame era, completion, timeouts) plus the ordered
checks D runs on P's advertised facts, with the exact texts the release raises. Reference §8 lists the eras."""

from __future__ import annotations

from typing import Literal

import msgspec

# How D learns a request is complete: NIXL notifications "{room}_kv_{chunk}_{last}" (+ "_{pp_rank}" from 0.5.8,
# "_{engine_rank}" from 0.5.13) and "{room}_aux"; or P's ZMQ KV_STATUS message (0.5.23).
Completion = Literal["notif", "notif_pp", "notif_engine", "kv_status"]
# P TP != D TP, non-MLA: R1 looks up D's own engine rank on P (404 -> assert); R2/R3 assert MLA-only; R4 head
# slicing (GQA offsets wrong when kv heads < TP); R5 slicing, P > D never completes (pp-keyed notifications);
# R6+ fixed (#22145).
HeteroTP = Literal["lookup", "assert_mla", "slice", "slice_pp_hang", "fixed"]


class PeerCheck(msgspec.Struct, frozen=True):
    """One check D makes on what P advertised, before any frame is sent. text: str.format with p= and d=."""

    id: str  # "page_size" | "kv_dtype" | "pp_size"
    exc: str
    text: str


class SglangRelease(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # what the user types and reports show, e.g. "0.5.8"
    tag: str  # the reference's tag, R1 ... R7
    versions: tuple[str, ...]  # releases of this line (checked against the wheels of the first)
    bootstrap: str  # B1 ... B6 (reference §3.2)
    put_keys: tuple[str, ...]  # PUT /route JSON keys a P rank sends; the server requires them (KeyError -> 500)
    info_keys: tuple[str, ...]  # the GET /route "parallel info" (-1) answer's keys
    info_required: tuple[str, ...] = ()  # R7: PrefillServerInfo(**data): missing or unknown keys raise TypeError
    rank_query: tuple[str, ...]  # per-rank GET /route query parameters
    not_ready_status: int  # per-rank GET while P ranks still register: 404 (B1), 500 (KeyError), 503 (B5+)
    wire: str  # E1 ... E6 (reference §5.2)
    guard: bool  # frames start with b"NixlMsgGuard" (0.4.7+)
    split_registration: bool  # registration ("None" room) separate from TransferInfo (0.4.9+)
    index_dtype: str  # numpy dtype of the page-index frame: "int64" (<= 0.4.7) or "int32"
    completion: Completion
    checks: tuple[PeerCheck, ...] = ()  # in source order
    hetero_tp: HeteroTP
    pp_assert: bool = False  # "Decode pp size (X) should be equal to prefill pp size (Y) or 1" (0.5.8+)
    last_chunk_bug: bool = False  # R1: is_last = bool("0") is True: D completes after chunk 0 (torn KV)
    bootstrap_timeout_s: float | None = None  # P waits this long in KVPoll.Bootstrapping; None: forever
    waiting_timeout_s: float | None = None  # D waits this long in KVPoll.WaitingForInput; None: forever
    receiver_exception: str  # what receiver.failure_exception() raises when no reason is recorded
    thread_death_log: str | None = None  # R7 logs the P bootstrap thread's death
    summary: str = ""


# Exact texts (reference §7.1); {p} and {d} are P's and D's values.
PAGE_SIZE = PeerCheck(
    "page_size", "RuntimeError",
    "Page size mismatch: prefill server has page_size={p}, but decode server has page_size={d}. Both servers must "
    "use the same --page-size value.")
KV_DTYPE = PeerCheck(
    "kv_dtype", "RuntimeError",
    "KV cache dtype mismatch: prefill server has kv_cache_dtype={p}, but decode server has kv_cache_dtype={d}. Both "
    "servers must use the same --kv-cache-dtype value.")
# A 1-tuple message (trailing comma in the source), so it prints as a tuple (R5 common/conn.py:378-383).
PP_SIZE = PeerCheck("pp_size", "AssertionError",
                    "('Decode pp size ({d}) should be equal to prefill pp size ({p}) or 1',)")

HETERO_TP_ASSERT = "PD with different TP sizes per DP rank is not yet supported for non-MLA models"
HETERO_TP_WARNING = "Performance is NOT guaranteed when using different TP sizes for non-MLA models. "
GUARD = b"NixlMsgGuard"
GUARD_TEXT = f"First message should be {GUARD!r}. Foreign traffic?"
NOT_REGISTERED_503 = "Prefill server not fully registered yet ({n} workers registered)."
