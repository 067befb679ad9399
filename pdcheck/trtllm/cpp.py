"""The C++ transceiver's conversation as far as its NIXL notification protocol and its checks go
(docs/trtllm-protocol.md §5): the gen runs inquireSupport on the ctx's CacheState (T61), sends its
RequestAndBufferInfo as a NIXL notification with its metadata (T59), spins for the ready signal and then for the
NotificationSyncInfo, with no bound (T61); the ctx takes the first request from getNotifs, loads the gen's agent,
runs inquireSupport (a refusal ends its response thread, T62), signals ready, WRITEs, and notifies the sync.

pdcheck's stand-ins, each because the real piece was not read or cannot run on a CPU: the gen learns its ctx's
agent and metadata from the parent (the request's opaque_state CommState, and NIXL's listener fetch, which pdcheck's
agents do not run); RequestInfo's BlockKey and DataTransceiverState are a placeholder carrying the gen's CacheState
(pdcheck/trtllm/cppwire.py); the receive buffer is the gen's KV blocks themselves (the staging buffer's split and
concat kernels were not read, T55), so equal TP and PP only; the tag is the request id's low 12 bits (the tag
derivation was not read; trtllm#17665 says it keeps 12 request-ID bits)."""

from __future__ import annotations

import struct
from typing import Any

from pdcheck import messages as m
from pdcheck.errors import NixlCallError
from pdcheck.trtllm import checks, cppwire, eras
from pdcheck.trtllm.eras.base import CTX_REFUSES, CTX_THREAD_ENDS, GEN_REFUSES, TrtLine
from pdcheck.trtllm.maps import WireError
from pdcheck.trtllm.messages import GenResult, TrtArmed, TrtCtxDone, TrtCtxUp, TrtEndLine, TrtGenGo
from pdcheck.trtllm.rankbase import GIVEN_UP, NOTIF, POLL_MS, Stopped, judge

# The roles (pdcheck/trtllm/ctx.py CtxRole, gen.py GenRole) call in here; typed as Any so that this module imports
# neither (tests/test_imports.py: no cycle).
CtxRole = GenRole = Any


def tag_of(request_id: int) -> int:
    return request_id & 0xFFF


# ---- the agent descriptor of the Python path (T41) -----------------------------------------------------------
def agent_blob(role: Any, form: str) -> bytes:
    """transfer_engine_info: the raw NIXL blob (the pure-Python agent) or AgentDesc.serialize() (the C++ binding
    agent): the blob as a serialize_utils string, no regions, an empty bounce endpoint."""
    blob = role.agent.metadata()
    if form != "cpp":
        return blob
    return struct.pack("<Q", len(blob)) + blob + struct.pack("<QQ", 0, 0)


def unwrap_agent_desc(data: bytes) -> bytes:
    """AgentDesc.deserialize: the NIXL blob inside, or ValueError (a raw blob from a pure-Python agent)."""
    if len(data) < 8:
        raise ValueError("AgentDesc.deserialize: the descriptor is shorter than its length field")
    n = struct.unpack_from("<Q", data)[0]
    if n > len(data) - 24:
        # no sizes in the text: a NIXL blob's length depends on the host's UCX transports
        raise ValueError("AgentDesc.deserialize: its blob length field runs past the descriptor (not an AgentDesc: a "
                         "pure-Python agent's raw NIXL metadata?)")
    return data[8:8 + n]


# ---- ctx -------------------------------------------------------------------------------------------------------
def ctx_line(role: CtxRole) -> None:
    spec, line = role.spec, eras.line(role.line_.line)
    m.send(role.conn, TrtCtxUp(spec.tp_rank, "", "", ""))
    # TrtPeers (nothing for the C++ path), read without Role.receive: its NIXL progress would consume (and drop)
    # a gen's RequestAndBufferInfo that arrives meanwhile
    if isinstance(m.recv(role.conn), m.Stop):
        raise Stopped
    pp, _tp = spec.side.coords(spec.tp_rank)
    own = checks.cache_state(spec.side, pp)
    me = NOTIF + role.agent.name
    state: dict[str, Any] = {"dead": False, "frozen": False}
    role.report("ctx")
    while True:
        for notes in role.agent.notifs().values():
            for note in notes:
                if state["dead"] or state["frozen"]:
                    continue  # nothing reads them any more: the response thread ended (or the rank is dying)
                role.count_received(me)
                _ctx_note(role, line, own, note, state)
                if state["dead"]:
                    role.sinks.append(me)
        if role.conn.poll(POLL_MS / 1000):
            msg = m.recv(role.conn)
            if isinstance(msg, m.Stop):
                raise Stopped
            if isinstance(msg, TrtEndLine):
                m.send(role.conn, TrtCtxDone(spec.tp_rank, role.result))
                return
        role.report("ctx")


def _ctx_note(role: CtxRole, line: TrtLine, own: cppwire.CacheState, note: bytes, state: dict[str, Any]) -> None:
    try:
        index, got = cppwire.decode(note)
    except WireError as exc:
        role.log(f"{CTX_THREAD_ENDS.format(error=exc)} (T62)")
        state["dead"] = True
        return
    if index != cppwire.REQUEST:
        return
    req: cppwire.RequestAndBuffer = got  # type: ignore[assignment]
    try:
        if req.metadata is None:
            raise ValueError("should get metadata for sender loadRemtoeAgent")  # T62's text, as spelled
        name = role.load(req.metadata)
        if name != req.agent:
            raise ValueError(f"loadRemoteAgent gets error agent name: {name} != {req.agent}")
    except (ValueError, NixlCallError) as exc:
        role.log(CTX_THREAD_ENDS.format(error=exc))
        state["dead"] = True
        return
    if role.line_.fault == "ctx_dies":
        state["frozen"] = True
        m.send(role.conn, TrtArmed(role.spec.tp_rank))
        return
    refused = checks.inquire(own, req.cache_state)
    if refused is not None:
        role.log(refused)
        role.log(CTX_THREAD_ENDS.format(error=CTX_REFUSES) + " (the CacheSender thread ends: this rank answers "
                 "no later request, T62)")
        state["dead"] = True
        return
    tag = tag_of(req.request_id)
    role.agent.send_notif(name, cppwire.ready(req.agent, tag, True))
    role.count_sent(NOTIF + name)
    slot = role.pool.slot
    segs = [(role.pool.addr + slot * cb, d.addr, slot) for cb, d in zip(role.spec.ctx_blocks, req.descs,
                                                                         strict=False)]
    try:
        role.write(name, segs, b"", f"request {req.request_id}")
        role.result.writes += 1
    except NixlCallError as exc:
        if line.transfer_timeout_ms is None:  # 1.2.0rc2: while (!isCompleted()); never sees the error (T62)
            role.log(f"NixlTransferStatus::wait spins on {exc.status}: isCompleted() is never true (T62)")
            state["dead"] = True
        else:
            role.log(f"AgentConnection::send failed: {exc.status} (NixlTransferStatus::wait returned kFAILURE, "
                     "T63); the gen is not notified")
        return
    if role.line_.fault == "completion_lost":
        role.log("pdcheck: the NotificationSyncInfo to the gen was lost after the WRITE (fault completion_lost, "
                 "trtllm#17665)")
        return
    role.agent.send_notif(name, cppwire.sync(req.agent, tag))
    role.count_sent(NOTIF + name)


# ---- gen -------------------------------------------------------------------------------------------------------
def gen_line(role: GenRole, go: TrtGenGo, line: TrtLine) -> GenResult:
    spec = role.spec
    role.rid = go.unique_rid
    targets = [p.rank for p in go.cpp_peers]
    if not go.cpp_peers:
        return GenResult("error", "inquire", "a C++ gen and a Python ctx: the ctx's ContextPhaseParams carry no "
                         "opaque_state (what the C++ gen does with it is not established, T15)")
    pp, _tp = spec.side.coords(spec.tp_rank)
    own = checks.cache_state(spec.side, pp)
    for peer in go.cpp_peers:
        refused = checks.inquire(own, peer.cache_state)
        if refused is not None:
            role.logs.append(refused)
            return GenResult("error", "inquire", f"{GEN_REFUSES} ({refused}; the gen's inquireSupport, before any "
                             "request, T61)", exception="RuntimeError", contacted=targets)
    slot = role.pool.slot
    descs = [cppwire.MemoryDesc(role.pool.addr + slot * gb, slot, 0) for gb in spec.gen_blocks]
    for i, peer in enumerate(go.cpp_peers):
        name = role.load(peer.metadata)  # the stand-in for fetchRemoteMD + checkRemoteMD (T61)
        req = cppwire.RequestAndBuffer(agent=role.agent.name, address=f"{spec.host}:0", request_id=go.ctx_req_id,
                                       cache_state=own, descs=descs, metadata=role.agent.metadata(), valid_idx=i)
        role.agent.send_notif(name, cppwire.request(req))
        role.count_sent(NOTIF + name)
    tag = tag_of(go.ctx_req_id)
    ready: list[bool] = []
    synced: list[int] = []

    def on_notif(note: bytes) -> Any:
        try:
            index, got = cppwire.decode(note)
        except WireError:
            return None
        if index == cppwire.READY and got[0] == role.agent.name and got[1] == tag:  # type: ignore[index]
            ready.append(bool(got[2]))  # type: ignore[index]
        elif index == cppwire.SYNC and got[0] == role.agent.name and got[1] == tag:  # type: ignore[index]
            synced.append(1)
        if ready and not all(ready):
            return False
        return True if len(ready) >= len(targets) and len(synced) >= len(targets) else None

    got = role.wait("ready", {}, lambda _s, _f: None, on_notif)
    if got is False:
        return GenResult("error", "ready", "the ready signal says not ready: DISAGG_TRANS_ERROR (T61)",
                         contacted=targets)
    proof = prove_of(role)
    if got is GIVEN_UP:
        stage = "ready" if len(ready) < len(targets) else "completion"
        if stage == "ready":
            what = "recvReadySignal: waitForNotification<ReadySignalInfo> spins over getNotifs with no bound (T61)"
        else:
            what = ("waitForSyncInfo spins over getNotifs for the NotificationSyncInfo with no bound (T61; "
                    "trtllm#17665, open)")
            if proof.status == "ok":
                what += f"; yet all {proof.rows} rows arrived right: only the notification is missing"
        res = GenResult("hang", stage, f"waits forever: {what}", contacted=targets, proof=proof)
        if line.transfer_timeout_ms is not None:
            res.message += (f"; kv_transfer_timeout_ms = {line.transfer_timeout_ms} flags the request, the wait "
                            "itself has no bound (trtllm#17665 reports the hang on 1.3.0rc0-rc24)")
        return res
    return judge(spec.side.dtype, spec.ctx_side.dtype, proof, targets)


def prove_of(role: GenRole) -> Any:
    from pdcheck.trtllm.pool import prove

    s = role.spec
    return prove(s.side, s.tp_rank, role.pool, s.ctx_side, s.gen_blocks, s.ctx_blocks)
