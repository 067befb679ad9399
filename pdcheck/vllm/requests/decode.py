"""The request path's D rank: take the params the router forwards, decide as the release does
(pdcheck.vllm.requests.model.decide), handshake with P over its side channel, heartbeat, READ the blocks with the done
notification riding on each READ (the one Agent, real NIXL; many in flight on a ring of D's blocks), check every
block by coordinate and generation (kvcache.check_blocks) and answer; in push mode register with P and wait for
its WRITEs (pdcheck.vllm.requests.push_decode).

Over the ~500 lines a module keeps to: D's pull path is one state machine (params, handshake, heartbeats,
READs in flight, checks, answers) over one event loop; the push side is push_decode.py."""

from __future__ import annotations

import functools
import time
from collections import deque
from typing import Any

import msgspec
import numpy as np

from pdcheck import messages as m
from pdcheck.errors import NixlCallError
from pdcheck.kvcache import BlockCheck, block_descs, check_blocks, desc_ids
from pdcheck.nixlagent import LOCAL, int32_ids
from pdcheck.pattern import engine_tag
from pdcheck.vllm.ranks import served_metadata
from pdcheck.vllm.releases.params import block_id_groups
from pdcheck.vllm.releases.rules import msg_engine_id
from pdcheck.vllm.requests import messages as rm
from pdcheck.vllm.requests import push, shapes, texts
from pdcheck.vllm.requests.handshake import DSide, HandshakeFailed, PSide, endpoint
from pdcheck.vllm.requests.heartbeat import Beats, Tracked, tracks
from pdcheck.vllm.requests.lines import CORRECTED, Lifecycle, abort_waits_read, line_of, with_policy
from pdcheck.vllm.requests.model import abort_detail, decide, on_failure, read_ids
from pdcheck.vllm.requests.push_decode import PushWaiter
from pdcheck.vllm.requests.role import POLL_S, Hold, Outgoing, RequestsRole, forget_remote, load_remote
from pdcheck.vllm.wire import AnyMeta

MAX_FLIGHT = 32  # D's READs in flight at once (vLLM's D posts every scheduled request's READ before it polls)
READ_POLL_S = 0.00005  # D with READs in flight looks at them again this often (when no message comes first)
READ_TIMEOUT_S = 30.0  # a READ not done by then is answered as failed (TIMEOUT), never a hang


class RequestsD(RequestsRole):
    """D's scheduler and worker: decide on the forwarded params, heartbeat, READ, check, notify; in push mode D
    also serves its own side channel (handshake.PSide with D's metadata), where P handshakes with D."""

    def ready(self) -> m.Msg:
        values = served_metadata(self.spec.engine_id, self.agent, self.kv, tp_size=self.spec.tp_size,
                                 kv_cache_layout="HND", device_id=self.spec.tp_rank)
        self.own = PSide(self.host, 0, values, self.spec.mute_side)
        return msgspec.structs.replace(super().ready(), side_host=self.own.host, side_port=self.own.port)

    def loop(self) -> None:
        self.line: Lifecycle = CORRECTED
        self.release = CORRECTED.line  # the release under test: its log texts (pdcheck.vllm.requests.texts)
        self.peer: rm.ReqReady | None = None  # the P whose agent D loaded (its handshake)
        self.side: rm.ReqSide | None = None  # P's side channel and the line's wire
        # vLLM's D handshakes on a background thread while its engine keeps stepping (and driving its NIXL
        # worker): a P WRITing into D meanwhile (push mode) completes instead of waiting on a D that only waits
        # for P's reply, a wait only the handshake's timeout would end.
        self.hs = DSide(while_waiting=self.agent.progress)
        self.unreached: HandshakeFailed | None = None  # the last handshake failed: no P to read from
        self.pushing = False
        self.known: set[str] = set()  # engine ids D handshook with in this line (vLLM's _remote_agents)
        # A failed handshake's future: the requests that waited on it (queued meanwhile) fail with it.
        self.joined: tuple[str, HandshakeFailed] | None = None
        self.backlog: list[m.Msg] = []  # messages read from the pipe while a handshake ran
        self.registrations = 0  # P's registrations D has loaded (a replaced P's agent: the next generation)
        self.remote: Any = None
        self.local: Any = None
        # The request path on a shape: what this D rank reads of each P rank (shapes.reads, kvsplit's rule), the
        # P ranks' side channels per engine id (DP: an engine per P DP rank), and the sources loaded per engine.
        d_geom = self.spec.geometry
        self.p_geom = self.spec.peer_geometry or d_geom
        self.plan = shapes.reads(self.p_geom, d_geom, self.spec.tp_rank)
        self.notif_n = 1  # the number D's done notification carries (shapes.notif_count, per line)
        self.peer_sides: dict[str, list[rm.ReqSide]] = {}
        self.srcs: dict[str, list[_Src]] = {}
        self.cur: list[_Src] = []  # the sources of the engine the request in hand names
        self.regs: dict[str, int] = {}  # registrations loaded per engine id
        self.expiry_s: float | None = None
        self.pending: list[tuple[float, bytes, list[_Src]]] = []  # (when, notification, to) for delay-notif
        self.held: list[Hold] = []  # hold / heartbeat-loss: requests D's scheduler has, read later
        self.unshaken: list[Hold] = []  # ... whose engine D does not know yet (no handshake has loaded it)
        self.flight: deque[_Flight] = deque()  # READs posted and not reaped, oldest first
        self.next_block = 0  # D's blocks are a ring: the next READ lands here (room() says where it fits)
        self._local_ids: dict[tuple[int, int], np.ndarray] = {}
        self._remote_ids: dict[tuple[int, ...], np.ndarray] = {}
        self.todo: list[tuple[rm.ReqDecode, str]] = []  # this turn's requests to READ
        self.hb = Beats()  # the requests D's scheduler heartbeats (pdcheck.vllm.requests.heartbeat)
        self.fresh: set[str] = set()  # engines this turn started a handshake with: no heartbeat to them yet
        self.shake_for: list[int] = []  # the requests the next handshake is made for (counted per request)
        self.reg_gen: dict[str, int] = {}  # 0.33+: the registration generation D recorded per engine
        waiter = PushWaiter(self)
        self.out = out = Outgoing(self.conn)
        while True:
            # READs in flight: a short look at the pipe, then at the READs again. D never spins on one READ: P
            # serves every READ in flight in one turn of its loop, and a spinning D would take P's core.
            first = self.wait(READ_POLL_S if self.flight else POLL_S if self.pending or self.held or self.unshaken
                              or waiter.busy or self.hb.tracked else 0.05)
            msgs = rm.unbatch(first)
            while first is not None and self.queued():  # everything queued: its READs go out together
                msgs += rm.unbatch(first := m.recv(self.conn))
            for msg in self.drained(msgs or [None]):
                if isinstance(msg, m.Stop):
                    self.start_reads()
                    self.settle()
                    out.flush()
                    self.hs.close()
                    self.own.close()
                    return
                self.turn(msg, waiter)
                if out.due():
                    out.flush()
            self.joined = None  # later requests start a handshake of their own
            self.start_reads()
            self.reap()
            self.heartbeat(time.time())
            if waiter.mode != "push" and self.peer is not None:
                # vLLM's D runs get_finished every engine step, and its get_new_notifs drives the UCX worker:
                # without that, a heartbeat (or a delayed notification) sent while D only holds a request sits
                # in D's worker until the next READ, and P gets it after the lease. Push mode polls in waiter.
                self.agent.progress()
            out.flush()

    def turn(self, msg: m.Msg | None, waiter: PushWaiter) -> None:
        """One message from the parent (None: none came), after the timers: push completions, delayed
        notifications, held requests."""
        out = self.out
        for final in waiter.poll(self.line):
            out.add(final)
        if self.pending:
            now = time.time()
            for item in [p for p in self.pending if p[0] <= now]:
                self.pending.remove(item)
                self.notify(item[1], item[2])
        if self.unshaken:
            self.tick_unshaken(time.time())
        if self.held:
            self.tick(time.time())
        if isinstance(msg, rm.ReqDecode):
            self.at = msg.request
            if msg.crash:
                raise RuntimeError("an exception injected by the test hook Options.crash")
            params = msg.params if isinstance(msg.params, dict) else None
            if tracks(self.line, params) and self.expiry_s is not None:  # on_new_request
                assert params is not None
                port = params.get("remote_port")
                self.hb.track(Tracked(msg.request, str(params["remote_request_id"]),
                                      str(params["remote_engine_id"]), port if isinstance(port, int) else None,
                                      msg.heartbeats_lost))
        if isinstance(msg, rm.ReqDone):
            self.hb.stop(msg.request)  # every D rank of its DP group answered it: finished_recving
        elif isinstance(msg, rm.ReqEnd):  # the line's end: what this rank's heartbeats and handshakes came to
            out.send(rm.ReqTally(dict(self.hb.named), dict(self.hb.shakes), self.hb.sent))
            self.hb.tracked.clear()
        elif isinstance(msg, rm.ReqBegin):
            self.start_reads()  # the last line's requests, before this line begins
            self.settle()
            self.line = with_policy(line_of(msg.line), msg.failure_policy)
            self.release = msg.release or msg.line
            self.pending.clear()  # a delayed notification of the last line is never sent into this one
            self.held.clear()
            self.unshaken.clear()
            self.expiry_s = msg.lease_s if msg.lease_s is not None else self.line.expiry_s
            waiter.reset(msg.mode, self.expiry_s, msg.side)
            self.pushing = msg.mode == "push"
            self.peer_sides = dict(msg.peers)
            self.notif_n = shapes.notif_count(self.line, shapes.Shape(self.p_geom.tp_size, 1,
                                                                      self.spec.geometry.tp_size, 1))
            if msg.side is not None:
                self.side = msg.side
            # A new line is a fresh deployment: D knows no engine until a request names one (lazy handshake).
            self.known.clear()
            self.reg_gen.clear()
            self.hb.reset()
            self.unreached = None
            out.send(m.Ack())
        elif isinstance(msg, rm.ReqDecode) and not self.pushing and msg.hold_s > 0 and self.unknown(msg):
            self.hold_unknown(msg)
        elif isinstance(msg, rm.ReqDecode) and (refused := self.ensure(msg)) is not None:
            out.add(rm.ReqDecoded(msg.request, "refused", *refused))
        elif isinstance(msg, rm.ReqDecode) and waiter.mode == "push":
            assert self.peer is not None
            got = waiter.take(msg, self.line, self.peer)
            if got is not None:
                out.add(got)
        elif isinstance(msg, rm.ReqDecode):
            got = self.decode(msg)
            if got is not None:
                out.add(got)

    def drained(self, msgs: list[Any]) -> Any:
        """This turn's messages, then those read from the pipe while a handshake ran (they waited on it)."""
        yield from msgs
        while self.backlog:
            yield self.backlog.pop(0)

    def ensure(self, msg: rm.ReqDecode) -> tuple[str, str] | None:
        """vLLM's D handshakes lazily (_ensure_handshake / _background_nixl_handshake, every release): the first
        request whose params name an engine D does not know starts the handshake with the host and port they
        name; requests that arrive meanwhile wait on the same future and fail with it. None: go on (known now, or
        no params: nothing to handshake for); else the request's verdict."""
        params = msg.params if isinstance(msg.params, dict) else None
        if params is None:  # nothing names an engine: no handshake; the release decides without a P
            if self.peer is not None:
                return None
            return push.decide(self.line, None, "", 0.0) if self.pushing else \
                decide(self.line, msg.request, None, "", 0, 0.0)
        if self.side is None:
            return None
        if not self.pushing and self.line.missing_request_id == "hang" and "remote_request_id" not in params:
            # update_state_after_alloc refuses the params before any receive is scheduled: no handshake (and the
            # scheduler never tracked it for heartbeats)
            return decide(self.line, msg.request, params, "", 0, 0.0)
        engine = str(params.get("remote_engine_id"))
        if msg.hold_s == 0:
            self.generation(engine, params)
        if engine in self.known:
            self.use(self.srcs[engine] if engine in self.srcs else self.cur)
            return None
        if self.joined is not None and self.joined[0] == engine:
            return self.joined[1].verdict(self.line, msg.request, params, functools.partial(self.handshake_log, msg))
        port = params.get("remote_port")
        self.shake_for = [msg.request]
        ok = self.handshake(engine, port if isinstance(port, int) else None)
        if not ok and self.unreached is not None:
            self.joined = (engine, self.unreached)
            while self.queued():  # sent while the handshake ran: they joined its future
                self.backlog += rm.unbatch(m.recv(self.conn))
            return self.unreached.verdict(self.line, msg.request, params, functools.partial(self.handshake_log, msg))
        return None

    def generation(self, engine: str, params: dict[str, Any]) -> None:
        """0.33+ (_read_blocks_for_req): a registration generation newer than the one D recorded for the engine
        drops what D loaded (_cleanup_remote_engine) and handshakes again. D records none at a handshake a heartbeat
        started, so the request's own READ makes a second one after it."""
        if self.line is CORRECTED or self.pushing or "remote_registration_generation" not in self.line.keys:
            return
        gen = params.get("remote_registration_generation")
        gen = gen if isinstance(gen, int) and not isinstance(gen, bool) else 0
        if self.reg_gen.get(engine, 0) < gen:
            self.reg_gen[engine] = gen
            self.known.discard(engine)

    def heartbeat(self, now: float) -> None:
        """The scheduler's heartbeat, when due (every lease/6): `HB:<ids>` to each P agent of every engine D knows;
        one D does not know gets a handshake instead, and nothing this time (_send_heartbeats)."""
        groups = self.hb.due(now, (self.expiry_s or 0.0) / 6) if self.side is not None else {}
        for engine, reqs in groups.items():
            if engine in self.fresh:  # its handshake started this turn: still pending in vLLM
                continue
            if engine not in self.known:
                self.shake_for = [t.request for t in reqs]
                self.handshake(engine, reqs[0].port)  # a failure is only logged; the next heartbeat tries again
                continue
            note = Beats.message(reqs)
            srcs = self.srcs.get(engine) or []
            if note is not None and srcs:
                self.notify(note, srcs)
                self.hb.count_sent(reqs, len(srcs))
        self.fresh.clear()

    def unknown(self, msg: rm.ReqDecode) -> bool:
        """The request's params name an engine D has not handshaken with in this line."""
        params = msg.params if isinstance(msg.params, dict) else None
        return params is not None and self.side is not None and str(params.get("remote_engine_id")) not in self.known

    def hold_unknown(self, msg: rm.ReqDecode) -> None:
        """A request D's scheduler holds (hold / heartbeat-loss) whose engine D does not know. vLLM's D handshakes
        lazily, for the first request or heartbeat that names an engine: from 0.22 the scheduler heartbeats the
        request while it waits, and _send_heartbeats starts the handshake (_ensure_handshake) at the first one;
        a failed one is only logged, and the next heartbeat starts another. Before 0.22 nothing does until the
        request is scheduled for its READ (_background_nixl_handshake), after the hold; that handshake decides."""
        now = time.time()
        h = Hold(msg, "", now + msg.hold_s, now)
        self.unshaken.append(h)
        self.tick_unshaken(now)

    def tick_unshaken(self, now: float) -> None:
        """Held requests of an engine D does not know: read at the hold's end (the request's own handshake), or held
        as any once a handshake (a heartbeat's, heartbeat()) loaded the engine."""
        for h in list(self.unshaken):
            params = h.msg.params
            assert isinstance(params, dict)
            engine = str(params.get("remote_engine_id"))
            if now >= h.read_at:  # scheduled: the request's own handshake (ensure), then as any request
                self.unshaken.remove(h)
                self.take(msgspec.structs.replace(h.msg, hold_s=0.0))
                continue
            if engine in self.known:  # a handshake loaded it: the request waits out its hold as any held one
                self.unshaken.remove(h)
                self.take(msgspec.structs.replace(h.msg, hold_s=h.read_at - now))

    def take(self, msg: rm.ReqDecode) -> None:
        """The scheduler takes a request (pull mode): the lazy handshake, then decide/hold/READ."""
        refused = self.ensure(msg)
        if refused is not None:
            self.out.add(rm.ReqDecoded(msg.request, "refused", *refused))
            return
        got = self.decode(msg)
        if got is not None:
            self.out.add(got)

    def handshake(self, engine: str | None = None, port: int | None = None) -> bool:
        """Fetch P's metadata over its side channel (decoded as the release decodes it) and load it when P's
        registration changed. False when the handshake failed (self.unreached says why) or P did not change.
        engine: the engine id the request named (None: the one D loaded). A reply of another engine fails the
        handshake where the release checks it (handshake_setup_failed; the request's verdict is decide's)."""
        asked = engine if engine is not None else (self.peer.engine_id if self.peer else "")
        sides = self.sides_for(asked, port)
        self.hb.count_shake(self.shake_for or ([self.at] if self.at is not None else []))
        self.shake_for = []
        self.fresh.add(asked)
        metas: list[AnyMeta] = []
        for rd in self.plan:  # one handshake with the engine: every P rank this D rank reads, on its port
            side = sides[rd.p_rank] if rd.p_rank < len(sides) else sides[0]
            try:
                metas.append(self.hs.fetch(side))
            except HandshakeFailed as exc:
                self.unreached = exc
                self.out.add(rm.ReqHandshook(endpoint(side), side.wire, str(exc)))
                return False
        side = sides[0]
        self.unreached = None
        eid = metas[0].engine_id
        if engine is not None and eid != engine and self.line.engine_id_checked:
            # Nothing is recorded for the engine the request named: its next request handshakes again.
            error = "RuntimeError: " + msg_engine_id(engine, eid)
            # the handshake's own done_callback line (0.14+: _log_failure with no request, the engine it asked for)
            said = texts.failure_log(self.release, "handshake_setup_failed", {
                "request_id": None, "engine_id": self.spec.engine_id, "remote_engine_id": engine})
            self.out.add(rm.ReqHandshook(endpoint(side), side.wire, f"{said}; exc_info: {error}" if said
                                        else f"handshake_setup_failed: {error}"))
            if eid not in self.srcs:
                self.load(metas)  # decide() names the mismatch from the engine D reached
            self.use(self.srcs[eid])
            return True
        self.known.update({eid, engine} if engine is not None else {eid})
        self.out.add(rm.ReqHandshook(endpoint(side), side.wire))
        old = self.srcs.get(eid)
        if old is not None and [s.peer.metadata for s in old] == [mt.agent_metadata for mt in metas]:
            self.use(old)
            return False
        self.load(metas)
        return True

    def sides_for(self, engine: str, port: int | None = None) -> list[rm.ReqSide]:
        """P's side channels (one per P TP rank) of the engine a request names; an engine no P runs under goes to
        the port the params name (remote_port: P's side-channel port), else the line's first P."""
        assert self.side is not None
        by_port = next((sd for sd in self.peer_sides.values() if sd and sd[0].port == port), None)
        return self.peer_sides.get(engine) or by_port or next(iter(self.peer_sides.values()), None) or [self.side]

    def load(self, metas: list[AnyMeta]) -> None:
        """The handshake's end: load each P rank's agent and prep the part of its blocks this D rank reads
        (dropping a replaced engine's agents first)."""
        agent, kv = self.agent, self.kv
        eid = metas[0].engine_id
        for old in self.srcs.pop(eid, []):
            forget_remote(agent, old.remote, old.peer.agent)
            if old.local is not self.local:
                agent.release_dlist(old.local)
        if self.local is None:
            self.local = agent.prep(LOCAL, kv.descs(kv.block_len, 0), kv.mem_type, "local")
        self.regs[eid] = self.regs.get(eid, 0) + 1
        self.registrations = self.regs[eid]
        srcs = []
        for rd, meta in zip(self.plan, metas, strict=True):
            if self.spec.peer_geometry is None:  # one P rank and one D rank: D reads P's whole block
                name, remote = load_remote(agent, kv, meta, "P's blocks")
                local = self.local
            else:
                name = agent.add_remote(meta.agent_metadata)
                bl = meta.block_lens[0] if meta.block_lens else meta.block_len or self.p_geom.block_len
                remote = agent.prep(name, block_descs(meta.kv_caches_base_addr, meta.num_blocks, bl, rd.read_len, 0,
                                                      offset=rd.remote_offset), kv.mem_type, "P's blocks")
                local = agent.prep(LOCAL, kv.descs(rd.read_len, 0, offset=rd.local_offset), kv.mem_type, "local")
            peer = rm.ReqReady(rd.p_rank, eid, name, meta.agent_metadata, meta.kv_caches_base_addr, meta.num_blocks,
                              0.0, self.registrations - 1)
            srcs.append(_Src(rd, peer, remote, local))
        self.srcs[eid] = srcs
        self.use(srcs)

    def use(self, srcs: list[_Src]) -> None:
        """The engine the request in hand names: its sources (the first also as peer/remote/local)."""
        if srcs:
            self.cur = srcs
            self.peer, self.remote, self.local = srcs[0].peer, srcs[0].remote, srcs[0].local
            self.registrations = self.regs.get(srcs[0].peer.engine_id, self.registrations)

    def notify(self, note: bytes, srcs: list[_Src] | None = None) -> bool:
        """A notification to each P rank read (a heartbeat: each of the engine's); a dead P's agent answers
        NIXL_ERR_REMOTE_DISCONNECT (vLLM logs it and goes on)."""
        assert self.peer is not None
        ok = True
        for src in srcs or self.cur:
            try:
                self.agent.send_notif(src.peer.agent, note)
            except NixlCallError:
                ok = False
        return ok

    def tick(self, now: float) -> None:
        """Held requests: the READ once the hold is over (the scheduler schedules it: its handshake checks first);
        their heartbeats are the scheduler's (heartbeat())."""
        for h in list(self.held):
            if now >= h.read_at:
                self.held.remove(h)
                refused = self.ensure(msgspec.structs.replace(h.msg, hold_s=0.0))
                got = rm.ReqDecoded(h.msg.request, "refused", *refused) if refused is not None else \
                    self.read(h.msg, h.rid)
                if got is not None:
                    self.out.add(got)

    def decode(self, msg: rm.ReqDecode) -> rm.ReqDecoded | None:
        """The scheduler takes the request: decide, start its heartbeats, READ now or after its hold."""
        line, peer = self.line, self.peer
        assert peer is not None
        refused = decide(line, msg.request, msg.params, peer.engine_id, peer.num_blocks, time.time(),
                         self.p_geom.tp_size, functools.partial(self.handshake_log, msg))
        if refused is not None:
            return rm.ReqDecoded(msg.request, "refused", *refused)
        assert msg.params is not None
        rid = str(msg.params.get("remote_request_id", msg.request_id))
        if msg.hold_s > 0:
            now = time.time()
            self.held.append(Hold(msg, rid, now + msg.hold_s, now + (self.expiry_s or 0.0) / 6))
            return None
        self.todo.append((msg, rid))
        return None

    def start_reads(self) -> None:
        """The READs of the requests the scheduler took this turn, in order (the heartbeat follows them)."""
        todo, self.todo = self.todo, []
        for msg, rid in todo:
            got = self.read(msg, rid)
            if got is not None:
                self.out.add(got)

    def rehandshake(self) -> str:
        """The corrected path: handshake again over P's side channel; load what it serves now."""
        if self.handshake():
            return f"D re-handshook (registration generation {self.registrations})"
        if self.unreached is not None:
            return f"D's re-handshake failed: {self.unreached}"
        return "no newer P to re-handshake with"

    def read(self, msg: rm.ReqDecode, rid: str) -> rm.ReqDecoded | None:
        """Post request msg's READ into D's next free blocks: its answer now (refused, failed, aborted), or None
        (in flight: reap() checks it once it is done). A request a fault touches is read alone, in order."""
        if msg.alone:
            self.settle()
        out = self.post(msg, rid)
        if msg.alone:
            self.settle()
        elif len(self.flight) >= MAX_FLIGHT:
            self.reap(block=True)
        return out

    def room(self, k: int) -> int:
        """Where in D's ring of blocks a READ of k blocks lands: k free blocks in a row, after the READs in flight
        (waiting for the oldest of them while there is no such run)."""
        n = self.kv.num_blocks
        while self.flight:
            tail, head = self.flight[0].lo, self.next_block
            if head > tail:  # in use: [tail, head)
                if n - head >= k:
                    return head
                if tail >= k:
                    return 0
            elif head < tail and tail - head >= k:  # in use: [tail, n) and [0, head)
                return head
            self.reap(block=True)
        return 0

    def post(self, msg: rm.ReqDecode, rid: str) -> rm.ReqDecoded | None:
        kv, agent, i, line = self.kv, self.agent, msg.request, self.line
        if isinstance(msg.params, dict) and (eng := str(msg.params.get("remote_engine_id"))) in self.srcs:
            self.use(self.srcs[eng])  # DP: the engine this request's params name
        peer = self.peer
        assert peer is not None and msg.params is not None
        if line is CORRECTED:
            gen = int(msg.params.get("remote_registration_generation", 1))
            if gen > peer.incarnation + 1:
                self.rehandshake()  # P was replaced since D's handshake: load the new one before reading
                peer = self.peer
                assert peer is not None
                if gen > peer.incarnation + 1:  # another TP worker of the engine was replaced, not one D reads
                    self.regs[peer.engine_id] = self.registrations = gen
                    for src in self.cur:
                        src.peer.incarnation = gen - 1
            elif gen < peer.incarnation + 1:
                return rm.ReqDecoded(i, "refused", "recomputed", f"P restarted after handing out these params "
                                    f"(registration generation {gen} < {peer.incarnation + 1}): its blocks died "
                                    "with it; recomputed")
            expiry = msg.params.get("remote_blocks_expiry_time")
            if msg.heartbeats_lost and expiry is not None and time.time() >= expiry:
                return rm.ReqDecoded(i, "refused", "recomputed", "lease passed while D held the request (no renewal "
                                    "acknowledged: its heartbeats were lost): blocks not read, recomputed")
        ids = read_ids(msg.params, self.kv.geometry.block_size)
        lo = self.room(len(ids))
        mine = np.arange(lo, lo + len(ids))  # D's own blocks for this request
        t_read = time.time()
        try:
            if msg.read_fail:
                # A READ over memory P never registered: NIXL itself refuses it.
                bad = agent.prep(peer.agent, np.array([(4096, kv.block_len, 0)], dtype=np.uint64), kv.mem_type,
                                 f"request {i}: P's memory (read-fail)")
                agent.release_dlist(bad)
            if msg.abort:
                return self.aborted(msg, rid, mine, ids, t_read)
            ctx = f"request {i}"
            hs: list[Any] = []
            try:
                for src in self.cur:  # one READ per P rank this D rank reads, each notifying that rank
                    hs.append(agent.make_read(src.local, self.local_ids(mine), src.remote,
                                              self.remote_ids(ids, src.peer.num_blocks, ctx), self.note(msg, rid), ctx))
                    agent.start(hs[-1], ctx)  # its state is read by reap()
            except NixlCallError:
                for h in hs:
                    agent.release(h)
                raise
        except NixlCallError as exc:
            # preparing or posting the READ raised: _read_blocks' transfer_setup_failed, whatever NIXL's status (a
            # dead peer's NIXL_ERR_REMOTE_DISCONNECT at post time included)
            return self.failed(msg, rid, mine, exc, t_read, "transfer_setup_failed")
        except (OverflowError, ValueError) as exc:  # ids NIXL cannot even take (int32)
            error = f"{type(exc).__name__}: {exc}"
            verdict, detail = on_failure(line, i, "transfer_setup_failed", error,
                                         self.failure_log(msg, rid, mine, "transfer_setup_failed", error))
            return rm.ReqDecoded(i, "failed", verdict, detail, t_read)
        self.flight.append(_Flight(hs, msg, rid, mine, lo, t_read, peer, self.cur))
        self.next_block = lo + len(ids)
        return None

    def note(self, msg: rm.ReqDecode, rid: str) -> bytes:
        """The done notification that rides on the READ, as vLLM's _read_blocks sends it (NIXL delivers it to P
        once the READ is done); none when the router's faults drop or delay it."""
        return b"" if msg.drop_notif or msg.notif_delay_s > 0 else self.line.notification(rid, self.notif_n)

    def local_ids(self, mine: np.ndarray) -> np.ndarray:
        """D's descriptor ids of its blocks `mine` (a run of blocks), as NIXL takes them: the same few runs serve
        every READ."""
        key = (int(mine[0]), len(mine)) if len(mine) else (0, 0)
        got = self._local_ids.get(key)
        if got is None:
            got = self._local_ids[key] = int32_ids(desc_ids(self.kv.geometry.num_regions, self.kv.num_blocks, mine),
                                                   "D's blocks")
        return got

    def remote_ids(self, ids: list[int], stride: int, context: str) -> np.ndarray:
        """P's descriptor ids of the blocks a request names, as NIXL takes them. P hands out the same few runs of
        blocks again and again (its free list), so they are kept, a bounded number."""
        key = (stride, *ids)
        got = self._remote_ids.get(key)
        if got is None:
            got = int32_ids(desc_ids(self.kv.geometry.num_regions, stride, np.asarray(ids, dtype=np.int64)), context)
            if len(self._remote_ids) >= 4096:
                self._remote_ids.clear()
            self._remote_ids[key] = got
        return got

    def settle(self) -> None:
        """Every READ in flight to its end (a READ alone, a new line, the end): D's ring starts over empty."""
        while self.flight:
            self.reap(block=True)
        self.next_block = 0

    def reap(self, block: bool = False) -> None:
        """The READs in flight that are done, oldest first (block: waiting for the oldest): check each
        request's blocks and answer. A failed READ is answered as the release answers it."""
        landed: list[_Flight] = []
        while self.flight:
            f = self.flight[0]
            self.at = f.msg.request
            ctx = f"request {f.msg.request}"
            try:
                done = all([self.agent.done(h, ctx) for h in f.h])
                if not done and (landed or not block):
                    break
                if not done:
                    self.wait_read(f, ctx)
                landed.append(f)
            except NixlCallError as exc:
                self.out.add(self.failed(f.msg, f.rid, f.mine, exc, f.t_read))
            self.flight.popleft()
            for h in f.h:
                self.agent.release(h)
        self.answer(landed)

    def wait_read(self, f: _Flight, ctx: str) -> None:
        """The oldest READ, to its end: D needs its blocks (or must answer in order)."""
        deadline = time.monotonic() + READ_TIMEOUT_S
        while not all([self.agent.done(h, ctx) for h in f.h]):
            if time.monotonic() > deadline:
                raise NixlCallError("check_xfer_state", "TIMEOUT", f"READ not done after {READ_TIMEOUT_S:g} s", ctx)
            time.sleep(READ_POLL_S)  # not a spin: P, which must drive the READ, may need this core

    def answer(self, landed: list[_Flight]) -> None:
        """Check the blocks these READs brought, by coordinate and generation, and answer for each request. One
        check per run of D's blocks covers every READ that landed there; only a run with a wrong block is
        checked request by request."""
        runs: list[list[_Flight]] = []
        for f in landed:
            if runs and runs[-1][-1].lo + len(runs[-1][-1].mine) == f.lo and runs[-1][-1].srcs is f.srcs:
                runs[-1].append(f)
            else:
                runs.append([f])
        regions = self.kv.geometry.num_regions
        for run in runs:
            clean = self.check(run).wrong == 0
            for f in run:
                if clean:
                    out = rm.ReqDecoded(f.msg.request, "read", t_read=f.t_read, checked=regions * len(f.mine))
                else:
                    chk = self.check([f])
                    out = rm.ReqDecoded(f.msg.request, "read", t_read=f.t_read, checked=chk.checked,
                                       wrong=chk.wrong)
                    if chk.first is not None:
                        w = chk.first.found
                        out.found_block, out.found_gen, out.found_valid = w.block, w.gen, w.valid
                self.done(f.msg, f.rid)
                self.out.add(out)
                if self.out.due():  # the parent times each answer: no answer waits long for the rest
                    self.out.flush()

    def failed(self, msg: rm.ReqDecode, rid: str, mine: np.ndarray, exc: NixlCallError,
               t_read: float, kind: str = "") -> rm.ReqDecoded:
        line, i = self.line, msg.request
        if line is CORRECTED and exc.status == "NIXL_ERR_REMOTE_DISCONNECT":
            return rm.ReqDecoded(i, "failed", "recomputed", f"{exc}: P restarted; {self.rehandshake()}, "
                                "recomputed", t_read)
        # As vLLM names it (kind: the caller knows): preparing or posting the READ raised (_read_blocks'
        # transfer_setup_failed), its state came back failed (_pop_done_transfers' transfer_failed), or looking at
        # its state raised (transfer_exception).
        kind = kind or {"transfer": "transfer_failed", "check_xfer_state": "transfer_exception"}.get(
            exc.op, "transfer_setup_failed")
        extra = {"xfer_state": "ERR"} if kind == "transfer_failed" else {}
        verdict, detail = on_failure(line, i, kind, str(exc), self.failure_log(msg, rid, mine, kind, str(exc), extra))
        return rm.ReqDecoded(i, "failed", verdict, detail, t_read)

    def handshake_log(self, msg: rm.ReqDecode, error: str) -> str:
        """What the release logs for a request whose handshake failed (request_ready's _log_failure with the request's
        meta, then from 0.22 get_finished's 'Skipping KV post-processing' warning): the blocks in its context are the
        ones D would have read into."""
        p = msg.params if isinstance(msg.params, dict) else {}
        try:
            k = len(read_ids(p, self.kv.geometry.block_size))
        except (KeyError, TypeError, ValueError):
            k = 0
        mine = (self.next_block + np.arange(k)) % self.kv.num_blocks
        return self.failure_log(msg, str(p.get("remote_request_id", msg.request_id)), mine, "handshake_failed", error)

    def failure_log(self, msg: rm.ReqDecode, rid: str, mine: np.ndarray, kind: str, error: str,
                    extra: dict[str, Any] | None = None) -> str:
        """What the release logs for a failed READ: its _log_failure line with the context dict it builds (the
        exception's traceback shortened to its last line), then its 'Skipping KV post-processing' warning."""
        p = msg.params if isinstance(msg.params, dict) else {}
        context: dict[str, Any] = {"request_id": msg.request_id, "engine_id": self.spec.engine_id,
                                   "remote_engine_id": p.get("remote_engine_id"), "remote_request_id": rid,
                                   "remote_host": p.get("remote_host"), "remote_port": p.get("remote_port"),
                                   "num_local_blocks": len(mine),
                                   "num_remote_blocks": _num_blocks(p.get("remote_block_ids")),
                                   "local_block_ids_sample": [int(b) for b in mine[:10]]}
        if kind == "transfer_setup_failed":  # _read_blocks' own extra context
            context.update(dst_engine_id=p.get("remote_engine_id"), remote_rank=0)
        context.update(extra or {})
        head = texts.failure_log(self.release, kind, context)
        if head is None:
            return ""
        skip = texts.skipping(self.release, msg.request_id)
        return f"{head}; exc_info: {error}" + (f"; WARNING {skip}" if skip else "")

    def check(self, flights: list[_Flight]) -> BlockCheck:
        """Every block these READs brought, by coordinate and generation."""
        kv = self.kv
        one = len(flights) == 1
        mine = flights[0].mine if one else np.concatenate([f.mine for f in flights])
        blocks = flights[0].msg.expect_blocks if one else [b for f in flights for b in f.msg.expect_blocks]
        gens = flights[0].msg.expect_gens if one else [g for f in flights for g in f.msg.expect_gens]
        out: BlockCheck | None = None
        for src in flights[0].srcs:  # each P rank's part of D's blocks
            rd = src.read
            out = check_blocks(kv, mine, blocks, engine_tag(flights[0].peer.engine_id), rd.p_rank,
                               read_len=rd.read_len, local_offset=rd.local_offset, remote_offset=rd.remote_offset,
                               view=kv.view, gens=gens, out=out)
        assert out is not None
        return out

    def done(self, msg: rm.ReqDecode, rid: str) -> None:
        """delay-notif: the done notification goes notif_delay_s after the READ instead of riding on it."""
        if not msg.drop_notif and msg.notif_delay_s > 0:
            self.pending.append((time.time() + msg.notif_delay_s, self.line.notification(rid, self.notif_n),
                                 list(self.cur)))

    def aborted(self, msg: rm.ReqDecode, rid: str, mine: np.ndarray, ids: list[int], t_read: float) -> rm.ReqDecoded:
        """abort-d: the READ is posted, then the client aborts. Before 0.16 D's scheduler frees the
        request's blocks at once, under the READ; from it, only once the READ is done. The READ completes
        either way and P is notified (vLLM's notification rides on the READ)."""
        kv, agent, peer = self.kv, self.agent, self.peer
        assert peer is not None
        regions = kv.geometry.num_regions
        h = agent.make_read(self.local, desc_ids(regions, kv.num_blocks, mine), self.remote,
                            desc_ids(regions, peer.num_blocks, np.asarray(ids)), self.note(msg, rid),
                            f"request {msg.request}")
        try:
            state = at_abort = agent.post(h)
            freed_under = not abort_waits_read(self.line)  # the abort: freed now, whatever the READ's state
            deadline = time.time() + 30.0
            while state == "PROC" and time.time() < deadline:
                state = agent.state(h)
        finally:
            agent.release(h)
        self.done(msg, rid)
        detail = abort_detail(self.line) + f" (the READ's state at the abort: {at_abort}; then {state})"
        return rm.ReqDecoded(msg.request, "aborted", "aborted", detail, t_read, d_freed_in_flight=freed_under)


class _Flight:
    """A READ D posted and has not finished."""

    __slots__ = ("h", "lo", "mine", "msg", "peer", "rid", "srcs", "t_read")

    def __init__(self, h: list[Any], msg: rm.ReqDecode, rid: str, mine: np.ndarray, lo: int, t_read: float,
                 peer: rm.ReqReady, srcs: list[_Src]) -> None:
        self.h, self.msg, self.rid, self.mine, self.lo, self.t_read, self.peer = h, msg, rid, mine, lo, t_read, peer
        self.srcs = srcs


class _Src:
    """A P rank this D rank reads, loaded at a handshake: its agent, its blocks' dlist, D's part of its blocks."""

    __slots__ = ("local", "peer", "read", "remote")

    def __init__(self, read: shapes.Read, peer: rm.ReqReady, remote: Any, local: Any) -> None:
        self.read, self.peer, self.remote, self.local = read, peer, remote, local


def _num_blocks(value: object) -> int:
    """The release's context count: `sum(len(group) for group in remote_block_ids)` (a flat list: its length)."""
    try:
        return sum(len(g) for g in block_id_groups(value))
    except ValueError:
        return 0
