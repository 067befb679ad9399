"""What an SGLang release model is: data (bootstrap era, frame era, completion, timeouts) plus the ordered
checks D runs on P's advertised facts, with the exact texts the release raises. docs/sglang-protocol.md §8 lists the eras."""

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
# A second live request with the same bootstrap room, after the first one's last chunk (#40125): P's
# transfer_infos[room][agent] held only the later TransferInfo; then the room's entry is kept (<= 0.4.7), deleted
# so add_transfer_request raises KeyError in P's scheduler (0.4.9 - 0.5.8), popped so the transfer worker's
# `assert room in self.transfer_infos` fails the room on P (0.5.13), or popped and add_transfer_request returns
# None: nothing sent (0.5.23).
RoomReuse = Literal["kept", "keyerror", "assert", "cleared"]
# Which aux (metadata) buffers P's send_aux WRITEs (docs/sglang-protocol.md §6.2): buffer 0 only (<= 0.5.3); one per D buffer,
# with P's item lengths by index (0.5.8, 0.5.13: IndexError when D has more); the shorter list (0.5.23).
AuxPairing = Literal["first", "decode_count", "shorter"]


class PeerCheck(msgspec.Struct, frozen=True):
    """One check D makes on what P advertised, before any frame is sent. text: str.format with p= and d=."""

    id: str  # "page_size" | "kv_dtype" | "pp_size"
    exc: str
    text: str


class SglangRelease(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # what the user types and reports show, e.g. "0.5.8"
    tag: str  # the reference's tag, R1 ... R7
    versions: tuple[str, ...]  # releases of this line (checked against the wheels of the first)
    bootstrap: str  # B1 ... B6 (docs/sglang-protocol.md §3.2)
    put_keys: tuple[str, ...]  # PUT /route JSON keys a P rank sends; the server requires them (KeyError -> 500)
    info_keys: tuple[str, ...]  # the GET /route "parallel info" (-1) answer's keys
    info_required: tuple[str, ...] = ()  # R7: PrefillServerInfo(**data): missing or unknown keys raise TypeError
    rank_query: tuple[str, ...]  # per-rank GET /route query parameters
    not_ready_status: int  # per-rank GET while P ranks still register: 404 (B1), 500 (KeyError), 503 (B5+)
    wire: str  # E1 ... E6 (docs/sglang-protocol.md §5.2)
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
    records_reason: bool = False  # 0.5.13+: KVTransferError carries the recorded failure reason
    room_reuse: RoomReuse = "keyerror"
    aux_pairing: AuxPairing = "first"
    aux_skew_log: str | None = None  # 0.5.23 logs a registration whose aux buffer count differs
    # 0.5.23: P's bootstrap thread compares D's KV region count with its own when D registers
    # (_add_remote_peer -> _prepare_payload_xfer) and raises on fewer: the thread dies, D's room hangs.
    fewer_regions_raise: str | None = None
    # D's heartbeat (0.5.3+): GET /health every heartbeat_s; after heartbeat_failures failures every pending room
    # of that prefill is failed with node_failure_log. None: no heartbeat (D waits for a dead P).
    heartbeat_s: float | None = None
    heartbeat_failures: int = 2
    node_failure_log: str | None = None
    # P's scheduler when a room's TransferInfo never comes (#17845): 0.4.6's add_transfer_request blocks on a
    # condition variable (the whole scheduler stalls); later releases leave the request in Bootstrapping.
    p_blocks_on_info: bool = False
    # A hybrid model's state (SWA window KV, mamba state) in its own pool: up to 0.5.8 P sends KV + aux only
    # (0.5.8's receiver takes state_indices and drops them); from 0.5.13 D sends its state pointers and indices,
    # P WRITEs the state and D waits for it (#18939).
    sends_state: bool = False
    # 0.5.12: P's transfer worker sends the metadata (aux) WRITE and its `{room}_aux` notification only inside `if
    # kv_chunk.is_last and kv_chunk.state_indices:` (nixl/conn.py); a model with no per-request state (state_types
    # empty: state_indices == []) never sends it, and D's TransferStatus.is_done waits for received_aux
    aux_needs_state: bool = False
    # P with DP > 1 and follow_bootstrap_room, a request the router dispatched to another DP rank than
    # room % dp_size: from 0.5.13 the P sender fails the room at once (DP_CONFLICT; R6 common/conn.py:733-751,
    # R7 :2160-2181); before, P's request waits in Bootstrapping for a TransferInfo D sent to the other DP rank.
    dp_conflict_check: bool = False
    thread_death_log: str | None = None  # R7 logs the P bootstrap thread's death
    # P's add_transfer_request when D offers fewer pages than P's chunk has (D allocates the request's tokens by
    # its own page size): `assert len(chunked_dst_kv_indice) == len(kv_indices)` in P's scheduler, nothing is
    # written and D is not told (nixl/conn.py 0.4.5.post3-0.5.11); from 0.5.12 P's transfer worker logs the two
    # lengths and sends only as many of its pages as D offered.
    page_count_assert: bool = False
    # D's scheduler fetches P's parallel info (GET /route with -1s) before it makes the receiver; from 0.5.10
    # (decode.py _ensure_prefill_info) it tries ensure_retries times ensure_retry_s apart, then logs
    # ENSURE_FAILED and aborts the receiver: the request fails with "Aborted by AbortReq.". None: D retries
    # inside the receiver and the request stays in KVPoll.Bootstrapping.
    ensure_retries: int | None = None
    ensure_retry_s: float = 1.0
    summary: str = ""


# Exact texts (docs/sglang-protocol.md §7.1); {p} and {d} are P's and D's values.
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

AUX_SKEW_LOG = ("Decode {peer} registered {d} metadata buffers but this prefill has {p}; only the first {n} are "
                "transferred, and misaligned if the extra buffer is not the last. An optional metadata buffer is "
                "enabled on one engine only: --disaggregation-enable-kv-checksum, SGLANG_ENABLE_DISAGG_SAMPLING_MASK, "
                "or the DSA top-k buffer.")
FEWER_REGIONS = ("ValueError: NIXL PD transfer: decode registered fewer KV regions ({d}) than prefill ({p}); "
                 "unexpected geometry")
LOST_R4 = "Lost connection with prefill instance (bootstrap_addr: {addr}), {n} transfers affected"
LOST_R6 = "Lost connection with prefill instance (bootstrap_addr: {addr}), {n} requests affected"
PREFILL_DOWN = ("Prefill server with bootstrap_addr: {addr} is healthy before, but now it is down. Request "
                "(bootstrap_room: {room}) has been marked as failed.")
PAGE_COUNT_ASSERT = "assert len(chunked_dst_kv_indice) == len(kv_indices)"
PAGE_COUNT_WARNING = "len(chunked_dst_kv_indice) = {d}, len(kv_chunk.prefill_kv_indices) = {p}"
ENSURE_FAILED = "Could not fetch prefill parallel info from {addr} after {n} attempts"
ABORTED = "Aborted by AbortReq."
# D's scheduler when a request's receiver failed (decode.py, 0.5.8-0.5.23: the bootstrap queue's "handshake", the
# transfer queue's "transfer"), then " with exception {e}" (str of what failure_exception raised); the same text is
# the request's abort message (prepare_abort). rid: SGLang's request id (a uuid hex); pdcheck's requests have none.
DECODE_FAILED = ("Decode {what} failed for request rank={rank} decode_req.req.rid={rid!r} "
                 "decode_req.req.bootstrap_room={room} with exception {exc}")
RID = "<rid>"
DP_CONFLICT = ("follow_bootstrap_room conflict: dispatched to dp_rank {x} but bootstrap_room {room} implies dp_rank "
               "{y}. Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.")
