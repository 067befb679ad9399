"""The pure SGLang verdict engine: given P's and D's geometry and releases, what each D rank's request does
(OK, ASSERT, ERROR, HANG with the timeout the release would wait, SILENT corruption), next to the corrected
behaviour. The same pieces the real ranks run: the bootstrap table and discovery (bootstrap), the frames and
P's parse (wire), the completion tracker; only the network and NIXL are replaced by calls in memory.
"""

from __future__ import annotations

import msgspec

from pdcheck.geometry import DTYPE_BYTES, Geometry
from pdcheck.sglang import bootstrap as bs
from pdcheck.sglang import wire
from pdcheck.sglang.releases.base import (
    ABORTED,
    DECODE_FAILED,
    DP_CONFLICT,
    ENSURE_FAILED,
    PAGE_COUNT_ASSERT,
    PAGE_COUNT_WARNING,
    PREFILL_DOWN,
    RID,
    SglangRelease,
)
from pdcheck.verdict import Status

ROOM = 7  # the room of the engine's one request
P_PAGES = 4  # P's pages for the engine's one request: its tokens are P_PAGES * P's page size


class Side(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One SGLang server's KV cache and parallel layout (server args)."""

    tp_size: int = 1  # attention TP (per DP group)
    dp_size: int = 1  # attention DP groups (prefill)
    pp_size: int = 1
    page_size: int = 16
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    dtype: str = "bfloat16"  # element type of the KV pool
    layers: int = 2
    kv_heads: int = 8  # total KV heads of the model
    head_dim: int = 64
    mla: bool = False
    num_pages: int = 64
    aux_buffers: int = 1  # metadata buffers registered (docs/sglang-protocol.md §6.2)
    hybrid: bool = False  # per-request state (SWA window KV / mamba) in its own pool (#18939)

    def geometry(self) -> Geometry:
        """The pdcheck KV geometry of one rank: a region per layer for K and for V, a block per page, so
        block_len is SGLang's kv_item_len (page_size * local heads * head_dim * dtype size)."""
        return Geometry(tp_size=self.tp_size, block_size=self.page_size, layers=self.layers,
                        total_kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                        attn_backend="SGLANG", use_mla=self.mla)

    @property
    def item_len(self) -> int:
        return self.geometry().block_len

    @property
    def num_ptrs(self) -> int:
        return self.geometry().num_regions


class SgVerdict(msgspec.Struct, kw_only=True):
    """One D rank's request under one release pair."""

    status: Status = "ok"
    stage: str = "done"  # bootstrap | register | transfer | completion | done
    exception: str | None = None
    message: str | None = None
    timeout_s: float | None = None  # HANG: what the release waits (None: forever)
    p_ranks: list[int] = []  # the P ranks this D rank talks to
    listener_dead: str | None = None  # P's bootstrap thread died on D's frames
    warning: str | None = None


def wait_text(rel: SglangRelease, where: str = "KVPoll.WaitingForInput") -> tuple[float | None, str]:
    t = rel.waiting_timeout_s if where == "KVPoll.WaitingForInput" else rel.bootstrap_timeout_s
    if t is None:
        return None, f"D waits in {where} forever (SGLang {rel.name} has no timeout there)"
    return t, f"D fails after {t:g} s: Request R timed out after {t:g}s in {where}"


def hang(rel: SglangRelease, stage: str, why: str, **kw: object) -> SgVerdict:
    t, text = wait_text(rel)
    return SgVerdict(status="hang", stage=stage, timeout_s=t, message=f"{why}; {text}", **kw)  # type: ignore[arg-type]


def d_pages_for(p: Side, d: Side, p_pages: int) -> int:
    """The pages D allocates for a request that fills p_pages of P's: D's scheduler allocates the request's
    tokens by its own page size (a 64-token request is 4 pages of 16 on P, 2 pages of 32 on D)."""
    return -(-p_pages * p.page_size // d.page_size)


def page_count(p_rel: SglangRelease, d_rel: SglangRelease, p_pages: int, d_pages: int,
               **kw: object) -> SgVerdict | None:
    """D offered fewer pages than P's request has: P's add_transfer_request asserts (0.4.5-0.5.11) and writes
    nothing. None: P goes on (equal counts, D offering more, or 0.5.12+ P, which sends only as many pages)."""
    if not p_rel.page_count_assert or d_pages >= p_pages:
        return None
    return hang(d_rel, "transfer", f"D allocated {d_pages} pages by its own page size for P's {p_pages}: "
                f"AssertionError: {PAGE_COUNT_ASSERT} in P's add_transfer_request (P's scheduler); nothing is "
                "written and D is not told", **kw)  # type: ignore[arg-type]


def ensure_failed(rel: SglangRelease, addr: str, room: int | str, why: str, rank: int = 0,
                  **kw: object) -> SgVerdict:
    """0.5.10+: D's scheduler could not fetch P's parallel info ensure_retries times ensure_retry_s apart; it
    aborts the receiver and the request fails (decode.py _ensure_prefill_info, then the bootstrap queue's
    "Decode handshake failed" line, which is also the request's abort message)."""
    n = rel.ensure_retries
    assert n is not None
    secs = (n - 1) * rel.ensure_retry_s  # the first attempt at once, the last (n-1) intervals later
    exc = receiver_error(rel, room, ABORTED)  # 0.5.10 - 0.5.12: the receiver's RuntimeError, without the reason
    return SgVerdict(status="error", stage="bootstrap", exception=exc.split("(")[0].split(":")[0], timeout_s=secs,
                     message=(
        f"{why}; after {secs:g} s: {ENSURE_FAILED.format(addr=addr, n=n)}; D aborts the receiver: "
        f"{decode_failed('handshake', rank, room, exc)}"), **kw)  # type: ignore[arg-type]


def decode_failed(what: str, rank: int, room: int | str, exc: str) -> str:
    """D's `Decode {handshake|transfer} failed for request ...` line, exactly (releases.base.DECODE_FAILED): the
    exception as str() gives it (a KVTransferError names its room; a RuntimeError only its message)."""
    said = exc if exc.startswith("KVTransferError(") else exc.split(": ", 1)[-1]
    return DECODE_FAILED.format(what=what, rank=rank, rid=RID, room=room, exc=said)


def receiver_error(rel: SglangRelease, room: int | str, reason: str) -> str:
    """What D's scheduler logs after `Decode transfer failed for request …` when the room failed for `reason`."""
    if rel.records_reason:
        return f"KVTransferError(bootstrap_room={room}): {reason}"
    return rel.receiver_exception.format(room=room, reason=reason)


def no_info(p_rel: SglangRelease, rooms: list[int], **kw: object) -> SgVerdict:
    """#17845: D discovered (and registered) but never sent a TransferInfo: P's request for the room waits in
    KVPoll.Bootstrapping, forever or until the release's bootstrap timeout."""
    r = ", ".join(map(str, rooms))
    t = p_rel.bootstrap_timeout_s
    stall = (" (add_transfer_request waits on a condition variable: P's scheduler blocks, every later request "
             "stalls)" if p_rel.p_blocks_on_info else "")
    end = (f"P fails it after {t:g} s: Request {rooms[0]} timed out after {t:g}s in KVPoll.Bootstrapping"
           if t is not None else f"forever: SGLang {p_rel.name} has no bootstrap timeout on P")
    return SgVerdict(status="hang", stage="bootstrap", timeout_s=t, message=(
        f"D sent no TransferInfo for room {r}: P's request stays in KVPoll.Bootstrapping{stall}; {end}"),
        **kw)  # type: ignore[arg-type]


def node_failure(rel: SglangRelease, addr: str, room: int, n: int = 1, **kw: object) -> SgVerdict:
    """P (ranks and bootstrap server) died mid-transfer: what D of `rel` does (docs/sglang-protocol.md §3.3, §7.1)."""
    if rel.heartbeat_s is None:
        t, text = wait_text(rel)
        return SgVerdict(status="hang", stage="transfer", timeout_s=t, message=(
            f"P died after a partial WRITE; SGLang {rel.name} has no heartbeat: {text}"), **kw)  # type: ignore[arg-type]
    assert rel.node_failure_log is not None
    lost = rel.node_failure_log.format(addr=addr, n=n)
    secs = rel.heartbeat_s * rel.heartbeat_failures
    if rel.records_reason:
        exc = receiver_error(rel, room, f"Lost connection with prefill instance (bootstrap_addr: {addr})")
        later = f"; a later request to it: {PREFILL_DOWN.format(addr=addr, room='R')}"
    else:
        exc = receiver_error(rel, room, "")
        later = ""
    node = "" if rel.records_reason else f"; Transfer for room {room} failed due to node failure"
    return SgVerdict(status="error", stage="transfer", exception=exc.split("(")[0].split(":")[0],
                     timeout_s=secs, message=(
                         f"after {secs:g} s (GET /health every {rel.heartbeat_s:g} s fails {rel.heartbeat_failures} "
                         f"times): {lost}{node}; {decode_failed('transfer', 0, room, exc)}{later}"),
                     **kw)  # type: ignore[arg-type]


def duplicate_room(p_rel: SglangRelease, room: int, **kw: object) -> SgVerdict:
    """#40125: two live requests A, B share `room`; both TransferInfos reach P before A's forward finishes.
    transfer_infos[room][agent] keeps only B's: A's KV lands in B's pages, A's pages are never written."""
    then = {
        "kept": "then P writes B's KV into B's pages again (the entry is kept)",
        "keyerror": f"then B's add_transfer_request raises KeyError: {room} in P's scheduler (the entry was deleted "
                    "after A's last chunk)",
        "assert": f"then B's chunk fails `assert room in self.transfer_infos` in P's transfer worker: room {room} "
                  "Failed on P, D not told",
        "cleared": "then B's add_transfer_request returns None (transfer_infos popped after A): nothing is sent for B",
    }[p_rel.room_reuse]
    return SgVerdict(status="silent", stage="completion", message=(
        f"two requests share bootstrap_room {room}: P keeps one TransferInfo per (room, D agent), the later one; "
        f"A's KV is written into B's pages, A's pages are never written; {then}; D's one status for the room "
        "completes both requests"), **kw)  # type: ignore[arg-type]


def aux_skew(p_rel: SglangRelease, d_rel: SglangRelease, p: Side, d: Side, **kw: object) -> SgVerdict | None:
    """Metadata buffer counts differ (or, <= 0.5.3, D has more than one): what P's send_aux does (docs/sglang-protocol.md §6.2).
    None: every D buffer gets its data."""
    np_, nd = p.aux_buffers, d.aux_buffers
    warn = p_rel.aux_skew_log.format(peer="<D agent>", d=nd, p=np_, n=min(np_, nd)) if (
        p_rel.aux_skew_log and np_ != nd) else None
    if p_rel.aux_pairing == "first":
        if nd == 1:
            return None
        return SgVerdict(status="silent", stage="transfer", warning=warn, message=(
            f"P's send_aux WRITEs buffer 0 only (aux_item_lens[0]); D's {nd - 1} other metadata buffer(s) are never "
            "written: D reads stale metadata"), **kw)  # type: ignore[arg-type]
    if p_rel.aux_pairing == "decode_count":
        if nd <= np_:
            return None
        where = "its transfer worker (room Failed on P)" if p_rel.records_reason else \
            "add_transfer_request, P's scheduler thread"
        return hang(d_rel, "transfer", f"P's send_aux loops over D's {nd} aux pointers with its own {np_} item "
                    f"lengths: IndexError: list index out of range in {where}; D is not told",
                    **kw)  # type: ignore[arg-type]
    if nd <= np_:
        return SgVerdict(status="ok", warning=warn, **kw) if warn else None  # type: ignore[arg-type]
    return SgVerdict(status="silent", stage="transfer", warning=warn, message=(
        f"P WRITEs the first {np_} of D's {nd} metadata buffers and logs the skew; D's other buffer(s) are never "
        "written"), **kw)  # type: ignore[arg-type]


def hybrid_state(p_rel: SglangRelease, d_rel: SglangRelease, p: Side, d: Side, **kw: object) -> SgVerdict | None:
    """#18939: D's model keeps per-request state besides the paged KV. None: the state arrives."""
    if not d.hybrid:
        return None
    if not d_rel.sends_state:
        return SgVerdict(status="silent", stage="transfer", message=(
            f"SGLang {d_rel.name} moves KV + aux only (the state indices are dropped): D completes and decodes "
            "with a stale state pool (SWA window / mamba state never written)"), **kw)  # type: ignore[arg-type]
    if not (p.hybrid and p_rel.sends_state):
        return hang(d_rel, "completion", "D sent state indices and waits for the state (expects_state); P sends "
                    "none", **kw)  # type: ignore[arg-type]
    return None


def table_for(p_rel: SglangRelease, p: Side, registered: int | None = None) -> bs.Table:
    """P's bootstrap table with `registered` of its ranks registered (default: all)."""
    t = bs.Table(p_rel, p.tp_size * p.pp_size * p.dp_size)
    for n in range(p.tp_size * p.pp_size * p.dp_size):
        if registered is not None and n >= registered:
            return t
        pp, dp, r = p_rank_of(p, n)
        t.put(bs.put_body(p_rel, rank=r, tp=p.tp_size, pp_rank=pp, pp=p.pp_size, ip="127.0.0.1",
                          port=40000 + n, page_size=p.page_size, kv_cache_dtype=p.kv_cache_dtype,
                          agent_name=f"p{r}", dp_rank=dp, dp=p.dp_size))
    return t


def p_rank_of(p: Side, n: int) -> tuple[int, int, int]:
    """P's n-th rank (launch order) as (pp rank, DP group, attention TP rank)."""
    return n // (p.tp_size * p.dp_size), (n // p.tp_size) % p.dp_size, n % p.tp_size


def dispatched_dp(p: Side, room: int, fault: str) -> int:
    """The prefill DP rank the router sends a room to: room % dp_size (follow_bootstrap_room), or the next
    one under the dp_conflict fault."""
    implied = room % p.dp_size
    return (implied + 1) % p.dp_size if fault == "dp_conflict" else implied


def dp_conflict(p_rel: SglangRelease, d_rel: SglangRelease, p: Side, room: int, **kw: object) -> SgVerdict:
    """docs/sglang-protocol.md §4: the router sent the room to DP rank X, D (follow_bootstrap_room) sends its TransferInfo to
    DP rank Y = room % dp_size, which never prefilled it."""
    x, y = dispatched_dp(p, room, "dp_conflict"), room % p.dp_size
    t, text = wait_text(d_rel)
    if p_rel.dp_conflict_check:
        reason = DP_CONFLICT.format(x=x, room=room, y=y)
        # 0.5.11 - 0.5.12 record the reason, but their sender raises RuntimeError("NIXL KVSender Exception")
        exc = (f"KVTransferError(bootstrap_room={room}): {reason}" if p_rel.records_reason
               else f"RuntimeError: NIXL KVSender Exception (recorded: {reason})")
        return SgVerdict(status="error", stage="bootstrap", exception=exc.split("(")[0].split(":")[0], message=(
            f"P DP rank {x}: Prefill bootstrap failed with exception {exc}; D's TransferInfo went to DP rank {y}, "
            f"which has no such request: {text}"), **kw)  # type: ignore[arg-type]
    where = f" (and P DP rank {y} keeps the stray TransferInfo)"
    return SgVerdict(status="hang", stage="bootstrap", timeout_s=t, message=(
        f"the router sent room {room} to P DP rank {x}; D sends its TransferInfo to DP rank {y} "
        f"(room % {p.dp_size}){where}: P's request waits in KVPoll.Bootstrapping "
        f"{'forever' if p_rel.bootstrap_timeout_s is None else f'{p_rel.bootstrap_timeout_s:g} s'}; {text}"),
        **kw)  # type: ignore[arg-type]


def refused(_q: dict[str, int]) -> tuple[int, str]:
    """GET /route where nothing listens."""
    return 0, "ConnectionRefusedError: [Errno 111] Connection refused"


def decide(p_rel: SglangRelease, d_rel: SglangRelease, p: Side, d: Side, d_rank: int, *, chunks: int = 1,
           registered: int | None = None, no_bootstrap: bool = False, fault: str = "none",
           p_pages: int = P_PAGES) -> SgVerdict:
    """What D rank `d_rank` of release d_rel sees for one request served by P of p_rel (no_bootstrap: D's
    bootstrap address has no server; fault: scenario.Fault; p_pages: the request's pages on P, the scenario's
    transfer.pages_per_request as the plan sized them). A P that wrote the KV (ok, silent) but sends no metadata
    without a request's state (0.5.12: releases.base.aux_needs_state) leaves D waiting."""
    v = _decide(p_rel, d_rel, p, d, d_rank, chunks=chunks, registered=registered, no_bootstrap=no_bootstrap,
                fault=fault, p_pages=p_pages)
    if v.status in ("ok", "silent") and p_rel.aux_needs_state and not (p.hybrid and p_rel.sends_state):
        return hang(d_rel, "completion", f"P {p_rel.name} WRITEs the KV but sends the metadata (aux) WRITE and its "
                    "`{room}_aux` notification only with a request's state (nixl/conn.py: `if kv_chunk.is_last and "
                    "kv_chunk.state_indices:`); this model has none, and D's is_done waits for received_aux",
                    p_ranks=v.p_ranks)
    return v


def _decide(p_rel: SglangRelease, d_rel: SglangRelease, p: Side, d: Side, d_rank: int, *, chunks: int,
            registered: int | None, no_bootstrap: bool, fault: str, p_pages: int) -> SgVerdict:
    table = table_for(p_rel, p, registered)
    try:
        found = bs.discover(d_rel, refused if no_bootstrap else table.get, tp_rank=d_rank, tp_size=d.tp_size, pp_size=d.pp_size,
                            page_size=d.page_size, kv_cache_dtype=d.kv_cache_dtype, mla=d.mla, room=ROOM)
    except bs.DiscoveryError as e:
        if e.info and d_rel.ensure_retries is not None:
            return ensure_failed(d_rel, "127.0.0.1:8998", ROOM, e.message, d_rank)
        if e.retry:  # 0.5.13+: D retries the bootstrap; the request never leaves Bootstrapping on D
            t = d_rel.bootstrap_timeout_s
            return SgVerdict(status="hang", stage="bootstrap", exception=None if e.exc == "retry" else e.exc,
                             timeout_s=t, message=f"{e.message}; D retries and the request stays in "
                             f"KVPoll.Bootstrapping" + (f" until {t:g} s" if t else ""))
        status: Status = "assert" if e.exc == "AssertionError" else "error"
        return SgVerdict(status=status, stage="bootstrap", exception=e.exc, message=e.message)
    targets = [t[0] for t in found.targets]
    dfacts = wire.DFacts("127.0.0.1", 50000, f"d{d_rank}", b"meta", list(range(d.num_ptrs)), [0], d_rank,
                         d.tp_size, d_rank, d.item_len)
    d_pages = d_pages_for(p, d, p_pages)
    req = wire.Request(7, list(range(d_pages)), 0, found.required if p.tp_size < d.tp_size else 1)
    try:
        for frames in wire.encode(d_rel, dfacts, req):
            wire.decode(p_rel, frames)
    except Exception as exc:  # P's bootstrap thread dies on it
        dead = wire.death(exc)
        return hang(d_rel, "register", f"P rank {targets[0]}'s bootstrap thread died: {dead}", p_ranks=targets,
                    exception=dead.split(":")[0], listener_dead=dead)
    if p_rel.fewer_regions_raise and d.num_ptrs < p.num_ptrs:  # checked as P adds D's agent
        dead = p_rel.fewer_regions_raise.format(d=d.num_ptrs, p=p.num_ptrs)
        return hang(d_rel, "register", f"P rank {targets[0]}'s bootstrap thread died: {dead}", p_ranks=targets,
                    exception="ValueError", listener_dead=dead)
    if fault == "no_transfer_info":
        return no_info(p_rel, [ROOM], p_ranks=targets)
    if fault == "dp_conflict":
        return dp_conflict(p_rel, d_rel, p, ROOM, p_ranks=targets)
    if fault == "kill_prefill":
        return node_failure(d_rel, "127.0.0.1:8998", ROOM, p_ranks=targets)
    if fault == "duplicate_room":
        return duplicate_room(p_rel, ROOM, p_ranks=targets)
    few = page_count(p_rel, d_rel, p_pages, d_pages, p_ranks=targets)
    if few is not None:
        return few
    fewer = PAGE_COUNT_WARNING.format(d=d_pages, p=p_pages) if d_pages < p_pages else None  # 0.5.12+ P
    # 0.4.6 has no TP mapping: P pairs pages as for equal TP, with its own (other TP's) item length
    hetero = p.tp_size != d.tp_size and not p.mla and p_rel.hetero_tp != "lookup"
    # P's release writes. Equal TP (or MLA): P's own item_len on both sides, paired by pointer index.
    if not hetero:
        if p.num_ptrs > d.num_ptrs:
            why = (f"P's send_kvcache pairs its {p.num_ptrs} layer pointers with D's {d.num_ptrs}: IndexError: "
                   "list index out of range in P's transfer")
            if p_rel.completion == "kv_status":
                return SgVerdict(status="error", stage="transfer", exception="KVTransferError", p_ranks=targets,
                                 message=f"KVTransferError(bootstrap_room=7): {why}")
            return hang(d_rel, "transfer", f"{why}; D is not told", p_ranks=targets)
        if p.item_len * p.num_pages > d.item_len * d.num_pages:
            return hang(d_rel, "transfer", f"P writes {p.item_len}-byte pages into D's {d.item_len}-byte pages: "
                        "outside D's registration, NIXL refuses the descriptors in P's transfer; D is not told",
                        p_ranks=targets)
        if p.item_len != d.item_len or p.num_ptrs != d.num_ptrs:
            what = []
            if p.page_size != d.page_size:
                what.append(f"page_size {p.page_size} vs {d.page_size}")
            if p.kv_cache_dtype != d.kv_cache_dtype or p.dtype != d.dtype:
                what.append(f"KV dtype {p.dtype} vs {d.dtype}")
            if p.kv_heads != d.kv_heads or p.head_dim != d.head_dim:
                what.append(f"heads x head_dim {p.kv_heads}x{p.head_dim} vs {d.kv_heads}x{d.head_dim}")
            if p.tp_size != d.tp_size:
                what.append(f"TP {p.tp_size} vs {d.tp_size}: no TP mapping in {p_rel.name}")
            if p.layers != d.layers:
                what.append(f"layers {p.layers} vs {d.layers}")
            return SgVerdict(status="silent", stage="transfer", p_ranks=targets, warning=fewer, message=(
                f"P writes D's page ids with its own kv_item_len {p.item_len} (send_kvcache: dst_ptr + page * "
                f"item_len, both the offset and the length P's; D's is {d.item_len}; {', '.join(what)}); no "
                "release compares them: wrong bytes, NIXL reports DONE"))
    else:
        slicing = p_rel.hetero_tp in ("slice", "slice_pp_hang")
        if slicing and min(p.tp_size, d.tp_size) and p.kv_heads < max(p.tp_size, d.tp_size):
            return SgVerdict(status="silent", stage="transfer", p_ranks=targets, warning=found.warning, message=(
                f"head slicing with {p.kv_heads} KV heads < TP {max(p.tp_size, d.tp_size)}: wrong GQA head "
                "offsets (fixed by #22145 in 0.5.13)"))
    skew = aux_skew(p_rel, d_rel, p, d, p_ranks=targets)
    if skew is not None and skew.status != "ok":
        return skew
    state = hybrid_state(p_rel, d_rel, p, d, p_ranks=targets)
    if state is not None and p_rel.completion == d_rel.completion:
        return state
    # completion, P's way against D's way
    if (p_rel.completion == "kv_status") != (d_rel.completion == "kv_status"):
        how = "a ZMQ KV_STATUS message D never reads" if p_rel.completion == "kv_status" else \
            "NIXL notifications; D waits for KV_STATUS"
        return hang(d_rel, "completion", f"P {p_rel.name} signals completion with {how}", p_ranks=targets)
    tracker = wire.Tracker(d_rel, found.required)
    for pr in targets:
        if p_rel.completion == "kv_status":
            tracker.status(wire.kv_status(7, "Success", pr))
            continue
        key = 0 if p_rel.completion == "notif_pp" else pr  # 0.5.8 sends pp_rank: 0 for every TP rank
        for c in range(chunks):
            tracker.notif(wire.kv_notif(p_rel, 7, c, c == chunks - 1, key))
            if d_rel.last_chunk_bug and c == 0 and chunks > 1:
                tracker.notif(wire.aux_notif(7))  # aux rides with the last chunk; D's is_last bug fires early
                if tracker.done():
                    return SgVerdict(status="silent", stage="completion", p_ranks=targets, message=(
                        f"D declares the room done after chunk 0 of {chunks} (is_last = bool('0') is True): "
                        "later chunks land after D decodes: torn KV"))
        tracker.notif(wire.aux_notif(7))
    if not tracker.done():
        return hang(d_rel, "completion", f"{len(targets)} P ranks notify with pp_rank 0: expected_kvs_per_pp has 1 "
                    f"entry, {found.required} required (#19043)", p_ranks=targets, warning=found.warning)
    if p.pp_size > 1 and d_rel.tag in ("R1", "R2", "R3", "R4"):
        return SgVerdict(status="silent", stage="completion", p_ranks=targets, message=(
            "D completes on the first PP rank's notifications: premature completion (#15027)"))
    return SgVerdict(status="ok", p_ranks=targets, warning=found.warning or (skew.warning if skew else None))


# fault -> (stage, exception, message): how a fixed SGLang fails each fault at once, never silently or by a hang
_CORRECTED_FAULTS: dict[str, tuple[str, str, str]] = {
    "duplicate_room": ("bootstrap", "ValueError",
                       "bootstrap_room already in use by a live request: the second one is refused"),
    "no_transfer_info": ("bootstrap", "KVTransferError", "P fails the room after its bootstrap timeout and frees it"),
    "kill_prefill": ("transfer", "KVTransferError", "D's heartbeat fails the room: Lost connection with prefill instance"),
    "dp_conflict": ("bootstrap", "KVTransferError",
                    "P fails the misrouted room at once and tells D (or D asks P which DP rank)"),
}


def corrected(p: Side, d: Side, fault: str = "none") -> SgVerdict:
    """What a fixed SGLang does: compare every fact the write depends on before the first frame; refuse a room
    already in use; bound every wait (a P timeout for a missing TransferInfo, D's heartbeat for a dead P)."""
    if fault in _CORRECTED_FAULTS:
        stage, exception, message = _CORRECTED_FAULTS[fault]
        return SgVerdict(status="error", stage=stage, exception=exception, message=message)
    for what, a, b in (("aux buffers", p.aux_buffers, d.aux_buffers), ("hybrid state", p.hybrid, d.hybrid),
                       ("page_size", p.page_size, d.page_size), ("kv dtype", p.dtype, d.dtype),
                       ("kv_cache_dtype", p.kv_cache_dtype, d.kv_cache_dtype), ("layers", p.layers, d.layers),
                       ("kv heads", p.kv_heads, d.kv_heads), ("head_dim", p.head_dim, d.head_dim),
                       ("MLA", p.mla, d.mla)):
        if a != b:
            return SgVerdict(status="error", stage="bootstrap", exception="ValueError",
                             message=f"{what} differs: prefill {a}, decode {b}; refused before any write")
    if d.pp_size not in (1, p.pp_size):
        return SgVerdict(status="error", stage="bootstrap", exception="ValueError",
                         message=f"decode pp size {d.pp_size} must be 1 or the prefill's {p.pp_size}")
    return SgVerdict(status="ok")


def decide_all(p_rel: SglangRelease, d_rel: SglangRelease, p: Side, d: Side, **kw: object) -> list[SgVerdict]:
    return [decide(p_rel, d_rel, p, d, r, **kw) for r in range(d.tp_size)]  # type: ignore[arg-type]


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]
