"""D's side of push mode (NixlPushConnector, vLLM 0.24+), on the request path's D rank (pdcheck.vllm.requests.decode):
decide, heartbeat from the moment the scheduler has a request, take D's own blocks, send PUSH_REG to every P rank of
the engine, and on P's completion notification check every block P WROTE by coordinate and generation. The pure
rules (params, registration, matching, the watchdog) are pdcheck.vllm.requests.push's."""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from pdcheck.errors import NixlCallError
from pdcheck.kvcache import BlockCheck, check_blocks
from pdcheck.pattern import engine_tag
from pdcheck.vllm.requests import messages as rm
from pdcheck.vllm.requests import push
from pdcheck.vllm.requests.lines import CORRECTED, Lifecycle
from pdcheck.vllm.requests.role import Hold


class DRank(Protocol):
    """What push mode uses of the D rank (pdcheck.vllm.requests.decode.RequestsD), named here so that this module
    does not import the one that imports it."""

    agent: Any  # its NIXL agent (pdcheck.nixlagent.Agent)
    kv: Any  # its KV cache (pdcheck.kvcache.KVCache)
    own: Any  # its own side channel, where P handshakes with D
    spec: Any  # its rank spec (engine_id, tp_size)
    p_geom: Any  # P's geometry
    plan: Any  # each P rank's part of D's blocks
    cur: Any  # the P ranks of the engine D handshook with
    peer: rm.ReqReady | None

    def rehandshake(self) -> None: ...


class PushWaiter:
    """D's side of push mode (push_scheduler.py / push_worker.py): decide, heartbeat from the moment the scheduler
    has the request, take D's own blocks and send PUSH_REG to P (at once, or after a hold); on P's completion
    notification check every block by coordinate and generation. A release's D waits without a deadline; the
    corrected D gives up at the lease and recomputes. An abort after PUSH_REG frees D's blocks at once (the
    corrected D keeps them until the completion or the lease)."""

    def __init__(self, role: DRank) -> None:
        self.role = role
        self.mode = "pull"
        self.expiry_s: float | None = None
        self.used: set[int] = set()  # D's blocks held by requests waiting for P's WRITE (push.d_blocks)
        self.waiting: dict[str, tuple[rm.ReqDecode, list[int], float]] = {}  # D's id -> (request, blocks, deadline)
        self.kept: set[str] = set()  # corrected: aborted requests whose blocks wait for P's WRITE to end
        self.held: list[Hold] = []  # hold / heartbeat-loss: the scheduler has them, no blocks yet
        # Completion notifications per D request id, and how many it takes (from the P world size each carries).
        # On a shape one D rank's PUSH_REG can make P WRITE every D rank it feeds: D's scheduler allocated the same
        # blocks on all its ranks at once, but here each D rank is a process of its own and may take the request
        # a moment after the WRITE landed, so the notification counts until this rank registers.
        self.counts: dict[str, int] = {}
        self.need: dict[str, int] = {}
        self.gone: set[str] = set()  # done or dropped in this line: a later notification is "Unrecognized"
        self.due: list[str] = []  # registered with every completion already counted
        self.tags: dict[str, str] = {}  # D's request id -> the P engine it names (its blocks' tag)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.held)

    def reset(self, mode: str, expiry_s: float | None, side: rm.ReqSide | None) -> None:
        self.mode, self.expiry_s = mode, expiry_s
        if mode == "push" and side is not None:
            self.role.own.begin(side)  # D's side channel serves this line's wire: P handshakes there
        self.used = set()
        self.waiting.clear()  # requests of the last line that never completed stay hung there
        self.kept.clear()
        self.held.clear()
        self.counts.clear()
        self.need.clear()
        self.gone.clear()
        self.due.clear()
        self.tags.clear()
        self.role.kv.clear_all(np.arange(self.role.kv.num_blocks))

    def take(self, msg: rm.ReqDecode, line: Lifecycle, peer: rm.ReqReady) -> rm.ReqDecoded | None:
        """The scheduler has the request (on_new_request): decide, heartbeat, register now or after the hold."""
        i = msg.request
        refused = push.decide(line, msg.params, peer.engine_id, time.time(), self.role.p_geom.tp_size)
        if refused is not None:
            return rm.ReqDecoded(i, "refused", *refused)
        assert msg.params is not None
        if line is CORRECTED:  # the registration generation counts P processes: D handshakes with the one running
            gen = int(msg.params.get("remote_registration_generation", 1))
            if gen > peer.incarnation + 1:
                self.role.rehandshake()
                assert self.role.peer is not None
                peer = self.role.peer
            elif gen < peer.incarnation + 1:
                return rm.ReqDecoded(i, "refused", *push.stale_generation(gen - 1, peer.incarnation))
        if msg.hold_s > 0:  # its heartbeats are the scheduler's (RequestsD.heartbeat), until P's WRITE completes
            now = time.time()
            self.held.append(Hold(msg, "", now + msg.hold_s, now))
            return None
        return self.register(msg, line, peer)

    def register(self, msg: rm.ReqDecode, line: Lifecycle, peer: rm.ReqReady) -> rm.ReqDecoded:
        """update_state_after_alloc and the writer's send: D's blocks, then PUSH_REG to P (a release keeps a
        request whose PUSH_REG failed waiting, with its blocks)."""
        i = msg.request
        assert msg.params is not None
        late = push.held_lost(line, msg.params, msg.heartbeats_lost, time.time())
        if late is not None:
            return rm.ReqDecoded(i, "refused", *late)
        n = self.role.kv.num_blocks
        blocks = push.d_blocks(i, len(msg.expect_blocks), n)  # the scheduler's: the same on every D rank
        if self.used.intersection(blocks):
            return rm.ReqDecoded(i, "refused", "hang", push.d_pool_hang(n))
        self.used.update(blocks)
        d_rid = push.d_request_id(msg.request_id)
        deadline = time.time() + self.expiry_s if line is CORRECTED and self.expiry_s is not None else float("inf")
        self.waiting[d_rid] = (msg, blocks, deadline)
        self.tags[d_rid] = peer.engine_id
        if self.counts.get(d_rid, 0) >= self.need.get(d_rid, 1 << 30):
            self.due.append(d_rid)
        own = self.role.own  # decode_host / decode_port: D's side channel, where P handshakes with D
        reg = push.registration(d_rid, self.role.spec.engine_id, own.host, own.port, blocks, msg.params, line,
                                self.role.spec.tp_size)
        failed: NixlCallError | None = None
        for src in self.role.cur or []:  # _do_send_reg_notif: every P rank of the engine D handshook with, each
            try:  # on its own: one agent gone (a replaced P worker) fails its send alone
                self.role.agent.send_notif(src.peer.agent, reg)
            except NixlCallError as exc:
                failed = failed or exc
        if failed is not None:  # push_reg_notif_failed: the receive stays pending (a release: the request waits)
            if line is CORRECTED and failed.status == "NIXL_ERR_REMOTE_DISCONNECT":
                self._drop(d_rid)
                self.role.rehandshake()
            return rm.ReqDecoded(i, "failed", *push.reg_failed(line, str(failed)), time.time())
        if msg.abort:
            return self.abort(d_rid, line)
        return rm.ReqDecoded(i, "registered", t_read=time.time())

    def abort(self, d_rid: str, line: Lifecycle) -> rm.ReqDecoded:
        """The client aborts right after PUSH_REG, before P can have WRITTEN (P has not seen the registration yet).
        A release frees D's blocks now, under the WRITE to come (P still WRITEs into them: nothing tells it); the
        corrected D keeps them until P's completion or its watchdog."""
        msg, blocks, _ = self.waiting[d_rid]
        if line is CORRECTED:
            self.kept.add(d_rid)
        else:
            del self.waiting[d_rid]  # P's completion, when it comes: "Unrecognized request ... notif"
            self.gone.add(d_rid)
            self.used.difference_update(blocks)
        return rm.ReqDecoded(msg.request, "aborted", "aborted", push.abort_detail(line), time.time(),
                            d_freed_in_flight=line is not CORRECTED)

    def poll(self, line: Lifecycle) -> list[rm.ReqDecoded]:
        if self.mode != "push":
            return []
        self.role.own.poll(time.time())  # P's handshake with D
        out: list[rm.ReqDecoded] = []
        ready, self.due = self.due, []
        for _peer, got in self.role.agent.notifs().items():
            for raw in got:
                d_rid, _, world = raw.decode(errors="replace").rpartition(":")
                if d_rid in self.gone or (d_rid not in self.waiting and len(self.counts) >= push.D_POOL_MAX):
                    continue  # "Unrecognized request %s notif (may have expired)."
                self.counts[d_rid] = self.counts.get(d_rid, 0) + 1
                p_world = int(world) if world.isdigit() else 1
                self.need[d_rid] = push.expected_notifs(p_world, self.role.spec.tp_size, line=line)
                if d_rid in self.waiting and self.counts[d_rid] >= self.need[d_rid]:
                    ready.append(d_rid)
        for d_rid in ready:
            if d_rid not in self.waiting:
                continue
            if d_rid in self.kept:  # an aborted request's WRITE is done: its blocks go back, no answer
                self._drop(d_rid)
                continue
            out.append(self._check(d_rid))
        now = time.time()
        for d_rid in [r for r, w in self.waiting.items() if now >= w[2]]:
            msg = self.waiting[d_rid][0]
            aborted = d_rid in self.kept
            self._drop(d_rid)
            assert self.expiry_s is not None
            if not aborted:
                out.append(rm.ReqDecoded(msg.request, "refused", "recomputed", push.watchdog_detail(self.expiry_s)))
        if self.held:
            out += self.tick(line, now)
        return out

    def tick(self, line: Lifecycle, now: float) -> list[rm.ReqDecoded]:
        """Held requests: the PUSH_REG once the hold is over."""
        out: list[rm.ReqDecoded] = []
        peer = self.role.peer
        assert peer is not None
        for h in list(self.held):
            if now >= h.read_at:
                self.held.remove(h)
                out.append(self.register(h.msg, line, peer))
        return out

    def _drop(self, d_rid: str) -> None:
        _msg, blocks, _ = self.waiting.pop(d_rid)
        self.kept.discard(d_rid)
        self.forget(d_rid)
        self.used.difference_update(blocks)

    def forget(self, d_rid: str) -> None:
        self.counts.pop(d_rid, None)
        self.need.pop(d_rid, None)
        self.tags.pop(d_rid, None)
        self.gone.add(d_rid)

    def _check(self, d_rid: str) -> rm.ReqDecoded:
        msg, blocks, _ = self.waiting.pop(d_rid)
        tag = engine_tag(self.tags.get(d_rid, ""))
        self.forget(d_rid)
        kv = self.role.kv
        chk: BlockCheck | None = None
        for rd in self.role.plan:  # each P rank's part of D's blocks (on one P and one D rank: the whole block)
            chk = check_blocks(kv, np.asarray(blocks), msg.expect_blocks, tag, rd.p_rank, read_len=rd.read_len,
                               local_offset=rd.local_offset, remote_offset=rd.remote_offset, view=kv.view,
                               gens=msg.expect_gens, out=chk)
        assert chk is not None
        self.used.difference_update(blocks)
        out = rm.ReqDecoded(msg.request, "read", t_read=time.time(), checked=chk.checked, wrong=chk.wrong)
        if chk.first is not None:
            f = chk.first.found
            out.found_block, out.found_gen, out.found_valid = f.block, f.gen, f.valid
        return out
