"""The request-path roles of pdcheck's rank skeleton (pdcheck.ranks.run_rank): a P that allocates KV blocks per
request from a free list, tags them with the coordinate pattern and each block's generation, and frees them on
D's done notification (real NIXL notifications) or when the abort timeout / lease passes; a D that takes the
params the router forwards, decides as the release does (pdcheck.requests.model.decide), READs the blocks (the
one Agent, real NIXL), checks every block by coordinate and generation (kvcache.check_blocks) and notifies P in
the release's format.
"""

from __future__ import annotations

import math
import select
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from pdcheck import messages as m
from pdcheck.errors import NixlCallError
from pdcheck.kvcache import BlockCheck, KVCache, block_descs, check_blocks, desc_ids, engine_tag, pattern
from pdcheck.nixlagent import LOCAL, int32_ids, no_memory_hooks
from pdcheck.ranks import Role, run_rank, served_metadata
from pdcheck.releases.rules import msg_engine_id
from pdcheck.requests import push
from pdcheck.requests.handshake import Background, DSide, HandshakeFailed, PSide, endpoint
from pdcheck.requests.lines import CORRECTED, Lifecycle, abort_waits_read, line_of, with_policy
from pdcheck.requests.model import GEN_WRAP, abort_detail, decide, on_failure, params_for
from pdcheck.wire import AnyMeta

POLL_S = 0.002
HELD_POLL_S = 0.00005  # P holding blocks drives its UCX worker this often: D's READs progress only then
MAX_FLIGHT = 32  # D's READs in flight at once (vLLM's D posts every scheduled request's READ before it polls)
READ_POLL_S = 0.00005  # D with READs in flight looks at them again this often (when no message comes first)
READ_TIMEOUT_S = 30.0  # a READ not done by then is answered as failed (TIMEOUT), never a hang
FLUSH_S = 0.002  # D sends its answers at least this often while it works through a batch


def requests_main(conn: Connection, spec_bytes: bytes) -> None:
    run_rank(RequestsRole, conn, spec_bytes)


class RequestsRole(Role):
    spec_type = m.ReqSpec

    @classmethod
    def for_spec(cls, spec: m.ReqSpec) -> type[Role]:
        return RequestsP if spec.role == "P" else RequestsD

    @property
    def name(self) -> str:
        return f"{self.spec.role}{self.spec.tp_rank}:req"

    @property
    def agent_name(self) -> str:
        # A replaced P is a new agent under the same engine id (vLLM names each worker's agent by a uuid).
        inc = f".r{self.spec.incarnation}" if self.spec.incarnation else ""
        return f"{self.spec.engine_id}-{self.spec.role.lower()}{self.spec.tp_rank}{inc}"

    def environment(self) -> None:
        no_memory_hooks("cpu")
        _precise_sleeps()

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        self.kv = KVCache(self.spec.geometry, self.spec.num_blocks)
        return self.kv.regions(0), self.kv.mem_type

    def ready(self) -> m.Msg:
        return m.ReqReady(self.spec.tp_rank, self.spec.engine_id, self.agent.name, self.agent.metadata(), self.kv.base_addrs,
                          self.spec.num_blocks, self.setup_ms(), self.spec.incarnation)

    def wait(self, timeout_s: float) -> m.Msg | None:
        return m.recv(self.conn) if self.queued(timeout_s) else None

    def queued(self, timeout_s: float = 0.0) -> bool:
        """A message from the parent is waiting (within timeout_s): one poll(2) on the pipe, registered once
        (Connection.poll builds a selector per call, a cost in P's spin)."""
        poller = getattr(self, "_poller", None)
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self.conn.fileno(), select.POLLIN)
        if 0 < timeout_s < 0.001:
            return bool(select.select([self.conn.fileno()], [], [], timeout_s)[0])
        return bool(poller.poll(math.ceil(timeout_s * 1e3)))


def _precise_sleeps() -> None:
    """The ranks' short sleeps (HELD_POLL_S, READ_POLL_S: tens of microseconds) end when asked: Linux lets a
    sleep run late by the thread's timer slack, 50 us by default, which would double them. PR_SET_TIMERSLACK."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 us
    except (OSError, AttributeError):
        pass  # not Linux: the default slack only makes the polls slower


class Outgoing:
    """A rank's request-path answers to the parent, gathered over a loop turn and sent as one ReqBatch (the parent
    only needs them for verdicts: one pipe write and one wake-up per turn, not per request)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.msgs: list[Any] = []
        self.since = 0.0

    def add(self, msg: Any) -> None:
        if not self.msgs:
            self.since = time.monotonic()
        self.msgs.append(msg)

    def due(self) -> bool:
        return bool(self.msgs) and time.monotonic() - self.since >= FLUSH_S

    def flush(self) -> None:
        if self.msgs:
            m.send(self.conn, m.batched(self.msgs))
            self.msgs = []

    def send(self, msg: m.Msg) -> None:
        """A message outside the batch (Ack, ReqAccount), after everything gathered before it."""
        self.flush()
        m.send(self.conn, msg)


class _Held:
    __slots__ = ("blocks", "deadline", "gens")

    def __init__(self, blocks: list[int], gens: list[int], deadline: float) -> None:
        self.blocks, self.gens, self.deadline = blocks, gens, deadline


class RequestsP(RequestsRole):
    """P's scheduler and worker in one: request_finished (allocate, tag, hand out params), _get_new_notifs (free on
    the done notification, renew on a heartbeat) and the expiry sweep; and its side channel (handshake.PSide)."""

    def ready(self) -> m.Msg:
        # Bound before P reports ready: a replaced P takes its port back before the router sends it anything.
        values = served_metadata(self.spec.engine_id, self.agent, self.kv, tp_size=1, kv_cache_layout="HND",
                                 device_id=0)
        self.side = PSide(self.host, self.spec.side_port, values, self.spec.mute_side)
        return msgspec.structs.replace(super().ready(), side_host=self.side.host, side_port=self.side.port)

    def run(self) -> None:
        kv, tag = self.kv, engine_tag(self.spec.engine_id)
        n = self.spec.num_blocks
        line: Lifecycle = CORRECTED
        expiry: float | None = None
        per_req = 1
        free: deque[int] = deque()
        gen = np.zeros(n, dtype=np.int64)
        held: dict[int, _Held] = {}
        waiting: deque[int] = deque()
        late = beats = 0
        errors: list[str] = []
        by_id: dict[str, int] = {}
        epoch = 0  # which line of the run: request ids differ between lines
        mode = "pull"
        d_side: _PushTarget | None = None  # push mode: P's handshake with D (on D's first PUSH_REG) and its WRITEs
        notif_faults: dict[int, tuple[bool, float, bool]] = {}  # push: drop-notif / delay-notif / a failed WRITE
        pending: list[tuple[float, str, bytes]] = []  # push mode: delayed completion notifications
        out = Outgoing(self.conn)
        idle = HELD_POLL_S
        side = self.side
        next_expiry = float("inf")  # no held request expires before this (heartbeats only push deadlines out)

        def admit() -> None:
            nonlocal next_expiry
            take = min(len(waiting), len(free) // per_req)
            if not take:
                return
            # Every request that fits now takes its blocks in arrival order, tagged in one pass.
            admitted = [waiting.popleft() for _ in range(take)]
            taken = [free.popleft() for _ in range(take * per_req)]
            gen[taken] = gen[taken] % GEN_WRAP + 1
            all_gens = [int(g) for g in gen[taken]]
            regions = kv.geometry.num_regions
            reg = np.repeat(np.arange(regions), len(taken))
            blk = np.tile(np.asarray(taken), regions)
            assert kv.blocks3 is not None
            kv.blocks3[reg, blk] = pattern(tag, 0, reg, blk, 0, kv.block_len, kv.view, np.tile(all_gens, regions))
            now = time.time()
            for k, i in enumerate(admitted):
                blocks = taken[k * per_req:(k + 1) * per_req]
                gens = all_gens[k * per_req:(k + 1) * per_req]
                deadline = now + expiry if expiry is not None else float("inf")
                held[i] = _Held(blocks, gens, deadline)
                next_expiry = min(next_expiry, deadline)
                inc = self.spec.incarnation
                rid = f"req-r{inc}.{epoch}.{i}" if inc else f"req-{epoch}.{i}"
                by_id[rid] = i
                if mode == "push":
                    params = push.params(line, i, blocks, self.spec.engine_id, 5600, 1,
                                         deadline if expiry is not None else None, gens, rid, inc + 1)
                else:
                    # vLLM's registration generation is 1 in every P process (one registration at start-up), so
                    # a replaced P hands out the same one; the corrected path counts incarnations.
                    params = params_for(line, i, blocks, self.spec.engine_id, 5600, 1,
                                        deadline if expiry is not None else None, gens, rid,
                                        inc + 1 if line is CORRECTED else 1)
                out.add(m.ReqPrefilled(i, rid, blocks, gens, params, now))

        def release(i: int, how: str, log: str = "") -> None:
            h = held.pop(i)
            free.extend(h.blocks)
            out.add(m.ReqFreed(i, how, time.time(), log))

        def handle(msg: m.Msg | None) -> None:
            nonlocal line, expiry, per_req, free, late, beats, errors, epoch, mode, d_side
            if isinstance(msg, m.ReqBegin):
                mode = msg.mode
                if mode == "push":
                    d_side = d_side or _PushTarget(self)
                    d_side.begin(line_of(msg.line), msg.side)
                if msg.side is not None:
                    side.begin(msg.side)  # this line's era from now on; D handshakes once the parent hears so
                    out.send(m.Serving(self.spec.tp_rank, [side.port]))
                notif_faults.clear()
                pending.clear()
                line = line_of(msg.line)
                expiry = None if line.expiry == "none" else (msg.lease_s if msg.lease_s is not None
                                                             else line.expiry_s)
                per_req = msg.blocks_per_request
                epoch += 1
                free = deque(range(n))
                gen[:] = 0
                held.clear()
                waiting.clear()
                by_id.clear()
                late = beats = 0
                errors = []
                kv.clear_all(np.arange(n))
            elif isinstance(msg, m.ReqPrefill):
                notif_faults[msg.request] = (msg.drop_notif, msg.notif_delay_s, msg.write_fail)
                waiting.append(msg.request)
                admit()
            elif isinstance(msg, m.ReqEnd):
                if d_side is not None:  # a handshake with D still running ends first (within its timeout)
                    for i in d_side.finish(held, notif_faults, pending, errors):
                        release(i, "written")
                out.send(m.ReqAccount(sorted(held), list(waiting), late, beats, errors,
                                      *(d_side.take() if d_side is not None else ())))
                held.clear()  # the line is over: nothing more expires or is admitted until the next ReqBegin
                waiting.clear()

        while True:
            # D's READs complete only as this loop drives P's UCX worker (agent.notifs(); no progress thread, which
            # would spin a core): while blocks are held a READ may be under way, so look often. P never spins: D
            # keeps many READs in flight and one turn here serves them all, and a spinning P would take D's core.
            # A turn that found nothing doubles the next look's delay (a slow decode, a hold), up to POLL_S.
            first = self.wait(idle if held else POLL_S)
            msgs = m.unbatch(first)
            while first is not None and self.queued():  # every queued message before the next sweep
                msgs += m.unbatch(first := m.recv(self.conn))
            for msg in msgs:
                if isinstance(msg, m.Stop):
                    out.flush()
                    side.close()
                    if d_side is not None:
                        d_side.hs.close()
                    return
                handle(msg)
            notifs = self.agent.notifs()
            idle = HELD_POLL_S if msgs or notifs else min(POLL_S, 2 * idle)
            for _peer, got in notifs.items():
                for raw in got:
                    if raw.startswith(push.PUSH_REG_PREFIX):  # push mode: D registered its blocks
                        if d_side is None:
                            errors.append("PUSH_REG outside push mode; dropping")
                            continue
                        done = d_side.register(raw, held, by_id, notif_faults, pending, errors)
                        if done is None:
                            late += 1  # no held request matches it: the lease freed the blocks first
                        elif done >= 0:
                            release(done, "written")
                        continue
                    if raw.startswith(b"HB:"):  # 0.24+: D's heartbeat renews the lease of each id it names
                        beats += 1
                        for rid in raw[3:].decode(errors="replace").split(","):
                            i = by_id.get(rid, -1)
                            if i in held and expiry is not None:
                                held[i].deadline = max(held[i].deadline, time.time() + line.lease_extension(expiry))
                        continue
                    try:
                        rid, _consumers = line.parse_notification(raw)
                    except ValueError as exc:
                        errors.append(f"{raw!r}: ValueError: {exc}")
                        continue
                    i = by_id.get(rid, -1)
                    if i in held:
                        release(i, "notif")
                    else:
                        late += 1
            if d_side is not None and d_side.hs.busy:  # push: the WRITEs that waited for P's handshake with D
                for i in d_side.poll(held, notif_faults, pending, errors):
                    release(i, "written")
            now = time.time()
            side.poll(now)
            for when, agent, note in [x for x in pending if x[0] <= now]:
                pending.remove((when, agent, note))
                self.agent.send_notif(agent, note)
            if now >= next_expiry:
                for i in [i for i, h in held.items() if now >= h.deadline]:
                    rid = next((k for k, v in by_id.items() if v == i), str(i))
                    release(i, "expired", line.expiry_log.format(req=rid, n=0, s=expiry or 0))
                next_expiry = min((h.deadline for h in held.values()), default=float("inf"))
            if waiting and free:
                admit()
            out.flush()


class RequestsD(RequestsRole):
    """D's scheduler and worker: decide on the forwarded params, heartbeat, READ, check, notify; in push mode D
    also serves its own side channel (handshake.PSide with D's metadata), where P handshakes with D."""

    def ready(self) -> m.Msg:
        values = served_metadata(self.spec.engine_id, self.agent, self.kv, tp_size=1, kv_cache_layout="HND",
                                 device_id=0)
        self.own = PSide(self.host, 0, values, self.spec.mute_side)
        return msgspec.structs.replace(super().ready(), side_host=self.own.host, side_port=self.own.port)

    def run(self) -> None:
        self.line: Lifecycle = CORRECTED
        self.peer: m.ReqReady | None = None  # the P whose agent D loaded (its handshake)
        self.side: m.ReqSide | None = None  # P's side channel and the line's wire
        self.hs = DSide()
        self.unreached: HandshakeFailed | None = None  # the last handshake failed: no P to read from
        self.registrations = 0  # P's registrations D has loaded (a replaced P's agent: the next generation)
        self.remote: Any = None
        self.local: Any = None
        self.expiry_s: float | None = None
        self.pending: list[tuple[float, bytes]] = []  # (when, notification) for delay-notif
        self.held: list[_Hold] = []  # hold / heartbeat-loss: requests D's scheduler has, read later
        self.flight: deque[_Flight] = deque()  # READs posted and not reaped, oldest first
        self.next_block = 0  # D's blocks are a ring: the next READ lands here (room() says where it fits)
        self._local_ids: dict[tuple[int, int], np.ndarray] = {}
        self._remote_ids: dict[tuple[int, ...], np.ndarray] = {}
        self.beats: list[str] = []  # this turn's requests whose leases the heartbeat renews
        self.todo: list[tuple[m.ReqDecode, str]] = []  # this turn's requests to READ, after the heartbeat
        waiter = _PushWaiter(self)
        self.out = out = Outgoing(self.conn)
        while True:
            # READs in flight: a short look at the pipe, then at the READs again. D never spins on one READ: P
            # serves every READ in flight in one turn of its loop, and a spinning D would take P's core.
            first = self.wait(READ_POLL_S if self.flight else POLL_S if self.pending or self.held or waiter.busy
                              else 0.05)
            msgs = m.unbatch(first)
            while first is not None and self.queued():  # everything queued: its READs go out together
                msgs += m.unbatch(first := m.recv(self.conn))
            for msg in msgs or [None]:
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
            self.start_reads()
            self.reap()
            out.flush()

    def turn(self, msg: m.Msg | None, waiter: _PushWaiter) -> None:
        """One message from the parent (None: none came), after the timers: push completions, delayed
        notifications, held requests."""
        out = self.out
        for final in waiter.poll(self.line):
            out.add(final)
        if self.pending:
            now = time.time()
            for when, note in [p for p in self.pending if p[0] <= now]:
                self.pending.remove((when, note))
                self.notify(note)
        if self.held:
            self.tick(time.time())
        if isinstance(msg, m.ReqBegin):
            self.start_reads()  # the last line's requests, before this line begins
            self.settle()
            self.line = with_policy(line_of(msg.line), msg.failure_policy)
            self.pending.clear()  # a delayed notification of the last line is never sent into this one
            self.held.clear()
            self.expiry_s = msg.lease_s if msg.lease_s is not None else self.line.expiry_s
            waiter.reset(msg.mode, self.expiry_s, msg.side)
            if msg.side is not None:
                self.side = msg.side
                self.handshake()  # a new line is a fresh deployment: D handshakes with the P running now
            out.send(m.Ack())  # D is ready for the line (restart-p waits for this handshake)
        elif isinstance(msg, m.ReqDecode) and self.unreached is not None:  # no P loaded: the handshake failed
            out.add(m.ReqDecoded(msg.request, "refused", *self.unreached.verdict(self.line, msg.request, msg.params)))
        elif isinstance(msg, m.ReqDecode) and waiter.mode == "push":
            assert self.peer is not None
            got = waiter.take(msg, self.line, self.peer)
            if got is not None:
                out.add(got)
        elif isinstance(msg, m.ReqDecode):
            got = self.decode(msg)
            if got is not None:
                out.add(got)

    def handshake(self) -> bool:
        """Fetch P's metadata over its side channel (decoded as the release decodes it) and load it when P's
        registration changed. False when the handshake failed (self.unreached says why) or P did not change."""
        side = self.side
        assert side is not None
        try:
            meta = self.hs.fetch(side)
        except HandshakeFailed as exc:
            self.unreached = exc
            self.out.add(m.ReqHandshook(endpoint(side), side.wire, str(exc)))
            return False
        self.unreached = None
        self.out.add(m.ReqHandshook(endpoint(side), side.wire))
        if self.peer is not None and meta.agent_metadata == self.peer.metadata:
            return False
        self.registrations += 1
        self.load(meta)
        return True

    def load(self, meta: AnyMeta) -> None:
        """The handshake's end: load P's agent and prep its blocks (dropping a replaced agent first)."""
        agent, kv = self.agent, self.kv
        if self.peer is not None:
            _forget(agent, self.remote, self.peer.agent)
        if self.local is None:
            self.local = agent.prep(LOCAL, kv.descs(kv.block_len, 0), kv.mem_type, "local")
        name, self.remote = _load_remote(agent, kv, meta, "P's blocks")
        self.peer = m.ReqReady(0, meta.engine_id, name, meta.agent_metadata, meta.kv_caches_base_addr,
                               meta.num_blocks, 0.0, self.registrations - 1)

    def notify(self, note: bytes) -> bool:
        """A notification to P; a dead P's agent answers NIXL_ERR_REMOTE_DISCONNECT (vLLM logs it and goes on)."""
        assert self.peer is not None
        try:
            self.agent.send_notif(self.peer.agent, note)
            return True
        except NixlCallError:
            return False

    def tick(self, now: float) -> None:
        """Held requests: heartbeats every lease/6 (unless lost), and the READ once the hold is over."""
        interval = (self.expiry_s or 0.0) / 6
        for h in list(self.held):
            if now >= h.read_at:
                self.held.remove(h)
                got = self.read(h.msg, h.rid)
                if got is not None:
                    self.out.add(got)
            elif self.line.heartbeat and interval > 0 and not h.msg.heartbeats_lost and now >= h.next_hb:
                self.notify(f"HB:{h.rid}".encode())
                h.next_hb = now + interval

    def decode(self, msg: m.ReqDecode) -> m.ReqDecoded | None:
        """The scheduler takes the request: decide, start its heartbeats, READ now or after its hold."""
        line, peer = self.line, self.peer
        assert peer is not None
        refused = decide(line, msg.request, msg.params, peer.engine_id, peer.num_blocks, time.time())
        if refused is not None:
            return m.ReqDecoded(msg.request, "refused", *refused)
        assert msg.params is not None
        rid = str(msg.params.get("remote_request_id", msg.request_id))
        if line.heartbeat and self.expiry_s is not None and not msg.heartbeats_lost:
            self.beats.append(rid)  # the scheduler now tracks it: start_reads() renews its lease
        if msg.hold_s > 0:
            now = time.time()
            self.held.append(_Hold(msg, rid, now + msg.hold_s, now + (self.expiry_s or 0.0) / 6))
            return None
        self.todo.append((msg, rid))
        return None

    def start_reads(self) -> None:
        """The turn's heartbeat, one notification naming every request the scheduler took ("HB:id1,id2", as
        vLLM's worker sends it), then their READs, in order."""
        if self.beats:
            self.notify(("HB:" + ",".join(self.beats)).encode())
            self.beats = []
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

    def read(self, msg: m.ReqDecode, rid: str) -> m.ReqDecoded | None:
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

    def post(self, msg: m.ReqDecode, rid: str) -> m.ReqDecoded | None:
        kv, agent, i, line = self.kv, self.agent, msg.request, self.line
        peer = self.peer
        assert peer is not None and msg.params is not None
        if line is CORRECTED:
            gen = int(msg.params.get("remote_registration_generation", 1))
            if gen > peer.incarnation + 1:
                self.rehandshake()  # P was replaced since D's handshake: load the new one before reading
                peer = self.peer
                assert peer is not None
            elif gen < peer.incarnation + 1:
                return m.ReqDecoded(i, "refused", "recomputed", f"P restarted after handing out these params "
                                    f"(registration generation {gen} < {peer.incarnation + 1}): its blocks died "
                                    "with it; recomputed")
            expiry = msg.params.get("remote_blocks_expiry_time")
            if msg.heartbeats_lost and expiry is not None and time.time() >= expiry:
                return m.ReqDecoded(i, "refused", "recomputed", "lease passed while D held the request (no renewal "
                                    "acknowledged: its heartbeats were lost): blocks not read, recomputed")
        ids = [int(b) for b in msg.params["remote_block_ids"]]
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
            h = agent.make_read(self.local, self.local_ids(mine), self.remote, self.remote_ids(ids, peer.num_blocks, ctx),
                                self.note(msg, rid), ctx)
            try:
                agent.start(h, ctx)  # its state is read by reap()
            except NixlCallError:
                agent.release(h)
                raise
        except NixlCallError as exc:
            return self.failed(i, exc, t_read)
        except (OverflowError, ValueError) as exc:  # ids NIXL cannot even take (int32)
            verdict, detail = on_failure(line, i, "transfer_setup_failed", f"{type(exc).__name__}: {exc}")
            return m.ReqDecoded(i, "failed", verdict, detail, t_read)
        self.flight.append(_Flight(h, msg, rid, mine, lo, t_read, peer))
        self.next_block = lo + len(ids)
        return None

    def note(self, msg: m.ReqDecode, rid: str) -> bytes:
        """The done notification that rides on the READ, as vLLM's _read_blocks sends it (NIXL delivers it to P
        once the READ is done); none when the router's faults drop or delay it."""
        return b"" if msg.drop_notif or msg.notif_delay_s > 0 else self.line.notification(rid, 1)

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
            ctx = f"request {f.msg.request}"
            try:
                done = self.agent.done(f.h, ctx)
                if not done and (landed or not block):
                    break
                if not done:
                    self.wait_read(f, ctx)
                landed.append(f)
            except NixlCallError as exc:
                self.out.add(self.failed(f.msg.request, exc, f.t_read))
            self.flight.popleft()
            self.agent.release(f.h)
        self.answer(landed)

    def wait_read(self, f: _Flight, ctx: str) -> None:
        """The oldest READ, to its end: D needs its blocks (or must answer in order)."""
        deadline = time.monotonic() + READ_TIMEOUT_S
        while not self.agent.done(f.h, ctx):
            if time.monotonic() > deadline:
                raise NixlCallError("check_xfer_state", "TIMEOUT", f"READ not done after {READ_TIMEOUT_S:g} s", ctx)
            time.sleep(READ_POLL_S)  # not a spin: P, which must drive the READ, may need this core

    def answer(self, landed: list[_Flight]) -> None:
        """Check the blocks these READs brought, by coordinate and generation, and answer for each request. One
        check per run of D's blocks covers every READ that landed there; only a run with a wrong block is
        checked request by request."""
        runs: list[list[_Flight]] = []
        for f in landed:
            if runs and runs[-1][-1].lo + len(runs[-1][-1].mine) == f.lo:
                runs[-1].append(f)
            else:
                runs.append([f])
        regions = self.kv.geometry.num_regions
        for run in runs:
            clean = self.check(run).wrong == 0
            for f in run:
                if clean:
                    out = m.ReqDecoded(f.msg.request, "read", t_read=f.t_read, checked=regions * len(f.mine))
                else:
                    chk = self.check([f])
                    out = m.ReqDecoded(f.msg.request, "read", t_read=f.t_read, checked=chk.checked,
                                       wrong=chk.wrong)
                    if chk.first is not None:
                        w = chk.first.found
                        out.found_block, out.found_gen, out.found_valid = w.block, w.gen, w.valid
                self.done(f.msg, f.rid)
                self.out.add(out)
                if self.out.due():  # the parent times each answer: no answer waits long for the rest
                    self.out.flush()

    def failed(self, i: int, exc: NixlCallError, t_read: float) -> m.ReqDecoded:
        line = self.line
        if line is CORRECTED and exc.status == "NIXL_ERR_REMOTE_DISCONNECT":
            return m.ReqDecoded(i, "failed", "recomputed", f"{exc}: P restarted; {self.rehandshake()}, "
                                "recomputed", t_read)
        verdict, detail = on_failure(line, i, "transfer_setup_failed", str(exc))
        return m.ReqDecoded(i, "failed", verdict, detail, t_read)

    def check(self, flights: list[_Flight]) -> BlockCheck:
        """Every block these READs brought, by coordinate and generation."""
        kv = self.kv
        one = len(flights) == 1
        mine = flights[0].mine if one else np.concatenate([f.mine for f in flights])
        blocks = flights[0].msg.expect_blocks if one else [b for f in flights for b in f.msg.expect_blocks]
        gens = flights[0].msg.expect_gens if one else [g for f in flights for g in f.msg.expect_gens]
        return check_blocks(kv, mine, blocks, engine_tag(flights[0].peer.engine_id), 0, read_len=kv.block_len,
                            view=kv.view, gens=gens)

    def done(self, msg: m.ReqDecode, rid: str) -> None:
        """delay-notif: the done notification goes notif_delay_s after the READ instead of riding on it."""
        if not msg.drop_notif and msg.notif_delay_s > 0:
            self.pending.append((time.time() + msg.notif_delay_s, self.line.notification(rid, 1)))

    def aborted(self, msg: m.ReqDecode, rid: str, mine: np.ndarray, ids: list[int], t_read: float) -> m.ReqDecoded:
        """abort-d: the READ is posted, then the client aborts. Before the 0.24 line D's scheduler frees the
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
        return m.ReqDecoded(msg.request, "aborted", "aborted", detail, t_read, d_freed_in_flight=freed_under)


def _load_remote(agent: Any, kv: KVCache, meta: AnyMeta, what: str) -> tuple[str, Any]:
    """The end of a handshake: load the peer's agent and prep its blocks as it served them (its block length; era
    A serves none: the same as ours)."""
    name = agent.add_remote(meta.agent_metadata)
    bl = meta.block_lens[0] if meta.block_lens else meta.block_len or kv.block_len
    return name, agent.prep(name, block_descs(meta.kv_caches_base_addr, meta.num_blocks, bl, bl, 0), kv.mem_type,
                            what)


def _forget(agent: Any, dlist: Any, name: str) -> None:
    agent.release_dlist(dlist)
    try:
        agent.remove_remote(name)
    except NixlCallError:
        pass  # its process is gone; forgetting it is all that is left to do


class _Flight:
    """A READ D posted and has not finished."""

    __slots__ = ("h", "lo", "mine", "msg", "peer", "rid", "t_read")

    def __init__(self, h: Any, msg: m.ReqDecode, rid: str, mine: np.ndarray, lo: int, t_read: float,
                 peer: m.ReqReady) -> None:
        self.h, self.msg, self.rid, self.mine, self.lo, self.t_read, self.peer = h, msg, rid, mine, lo, t_read, peer


class _Hold:
    __slots__ = ("msg", "next_hb", "read_at", "rid")

    def __init__(self, msg: m.ReqDecode, rid: str, read_at: float, next_hb: float) -> None:
        self.msg, self.rid, self.read_at, self.next_hb = msg, rid, read_at, next_hb


class _PushTarget:
    """P's side of push mode (push_worker.py): match D's PUSH_REG with a held request, handshake with D over D's
    side channel (the PUSH_REG's decode_host / decode_port) before the first WRITE to it, in the background, the
    WRITEs waiting for it; then WRITE the coordinate/generation-tagged blocks with the completion notification
    attached. Once per line (a line is a fresh deployment; vLLM caches the handshake by D's engine id)."""

    def __init__(self, role: RequestsP) -> None:
        self.role, self.agent = role, role.agent
        self.hs = Background("D")
        self.line: Lifecycle = CORRECTED
        self.side: m.ReqSide | None = None  # the line's wire: P speaks it on D's side channel
        self.d_agent, self.d_meta, self.d_blocks = "", b"", 0
        self.remote: Any = None
        self.local = self.agent.prep(LOCAL, role.kv.descs(role.kv.block_len, 0), role.kv.mem_type, "local")
        self.ready = False  # this line's handshake with D is done
        self.deferred: list[tuple[int, push.Registration]] = []  # matched, waiting for the handshake
        self.failed: list[int] = []  # WRITE failed
        self.hs_failed: list[int] = []  # P's handshake with D failed: no WRITE
        self.shakes: list[m.ReqHandshook] = []

    def begin(self, line: Lifecycle, side: m.ReqSide | None) -> None:
        self.line, self.side, self.ready = line, side, False
        self.deferred, self.failed, self.hs_failed, self.shakes = [], [], [], []

    def register(self, raw: bytes, held: dict[int, _Held], by_id: dict[str, int],
                 faults: dict[int, tuple[bool, float, bool]], pending: list[tuple[float, str, bytes]],
                 errors: list[str]) -> int | None:
        """A PUSH_REG: the request written (its blocks can be freed), None (no held request matches), -1 (dropped,
        failed, or waiting for the handshake with D)."""
        got = push.parse_registration(raw)
        if isinstance(got, str):
            errors.append(got)
            return -1
        # _pop_matching_finished_blocks: the exact id, then the id without vLLM's random suffix
        i = by_id.get(got.request_id, by_id.get(push.base_id(got.request_id), -1))
        if i not in held:
            return None
        if self.ready:
            return self.write(i, got, held, faults, pending, errors)
        self.deferred.append((i, got))
        if not self.hs.busy:
            self._start(got)
        return -1

    def _start(self, reg: push.Registration) -> None:
        assert self.side is not None
        self.hs.start(msgspec.structs.replace(self.side, host=reg.host, port=reg.port))

    def poll(self, held: dict[int, _Held], faults: dict[int, tuple[bool, float, bool]],
             pending: list[tuple[float, str, bytes]], errors: list[str]) -> list[int]:
        """The handshake, if it ended: the requests written now."""
        got = self.hs.result()
        return [] if got is None else self._settle(got, held, faults, pending, errors)

    def finish(self, held: dict[int, _Held], faults: dict[int, tuple[bool, float, bool]],
               pending: list[tuple[float, str, bytes]], errors: list[str]) -> list[int]:
        """The line's end: every handshake still running, to its end (each within the release's timeout)."""
        out: list[int] = []
        while self.hs.busy:
            got = self.hs.result(wait_s=None)
            if got is not None:
                out += self._settle(got, held, faults, pending, errors)
        return out

    def _settle(self, got: AnyMeta | HandshakeFailed, held: dict[int, _Held],
                faults: dict[int, tuple[bool, float, bool]], pending: list[tuple[float, str, bytes]],
                errors: list[str]) -> list[int]:
        side = self.hs.side
        assert side is not None and self.deferred
        expected = self.deferred[0][1].engine_id
        if not isinstance(got, HandshakeFailed) and got.engine_id != expected:
            got = HandshakeFailed(f"RuntimeError: {msg_engine_id(expected, got.engine_id)}")
        self.shakes.append(m.ReqHandshook(endpoint(side), side.wire, str(got) if isinstance(got, HandshakeFailed)
                                          else ""))
        if isinstance(got, HandshakeFailed):
            # 0.28+: every request waiting on the handshake's future fails with it; 0.26: one request per attempt.
            # The WRITE is skipped: P's blocks wait for the lease, D is never told.
            n = len(self.deferred) if push.handshake_joins(self.line) else 1
            for i, reg in self.deferred[:n]:
                errors.append(push.handshake_failure_log(self.line, reg.engine_id, reg.request_id, str(got)))
                self.hs_failed.append(i)
            del self.deferred[:n]
            if self.deferred:
                self._start(self.deferred[0][1])
            return []
        if got.agent_metadata != self.d_meta:  # D never changes in a run: loaded once, kept across lines
            if self.d_agent:
                _forget(self.agent, self.remote, self.d_agent)
            self.d_agent, self.remote = _load_remote(self.agent, self.role.kv, got, "D's blocks")
            self.d_meta, self.d_blocks = got.agent_metadata, got.num_blocks
        self.ready = True
        # A request whose lease ended while the handshake ran is no longer P's to WRITE (a loopback handshake
        # takes milliseconds; vLLM would WRITE from the freed blocks).
        done = [self.write(i, reg, held, faults, pending, errors) for i, reg in self.deferred if i in held]
        self.deferred = []
        return [i for i in done if i >= 0]

    def write(self, i: int, reg: push.Registration, held: dict[int, _Held],
              faults: dict[int, tuple[bool, float, bool]], pending: list[tuple[float, str, bytes]],
              errors: list[str]) -> int:
        """P's WRITE into D's registered blocks: the request (its blocks can be freed), or -1 (it failed)."""
        h = held[i]
        d_rid, d_blocks = reg.request_id, reg.blocks
        drop, delay, fail = faults.get(i, (False, 0.0, False))
        note = push.completion(d_rid)
        kv, n = self.role.kv, min(len(h.blocks), len(d_blocks))  # push aligns the per-group block counts
        regions = kv.geometry.num_regions
        try:
            if fail:
                # read-fail in push mode: the WRITE names memory D never registered; NIXL itself refuses it.
                bad = self.agent.prep(self.d_agent, np.array([(4096, kv.block_len, 0)], dtype=np.uint64),
                                      kv.mem_type, f"push {d_rid}: D's memory (read-fail)")
                self.agent.release_dlist(bad)
            self.agent.read(self.local, desc_ids(regions, kv.num_blocks, np.asarray(h.blocks[:n])), self.remote,
                            desc_ids(regions, self.d_blocks, np.asarray(d_blocks[:n])),
                            b"" if drop or delay > 0 else note, op="WRITE", context=f"push {d_rid}")
        except (NixlCallError, OverflowError, ValueError) as exc:
            # _xfer_blocks: logged, no handle kept: P's request is never done sending (its blocks wait for the
            # lease) and D is not told (the completion rides on the WRITE)
            errors.append(f"{push.WRITE_FAIL_LOG} | push WRITE for {d_rid}: {exc}")
            self.failed.append(i)
            return -1
        if delay > 0 and not drop:
            pending.append((time.time() + delay, self.d_agent, note))
        return i

    def take(self) -> tuple[list[int], list[m.ReqHandshook], list[int]]:
        """This line's failed WRITEs, P's handshakes with D, and the requests that handshake failed for."""
        out = (self.failed, self.shakes, self.hs_failed)
        self.failed, self.shakes, self.hs_failed = [], [], []
        return out


class _PushWaiter:
    """D's side of push mode (push_scheduler.py / push_worker.py): decide, heartbeat from the moment the scheduler
    has the request, take D's own blocks and send PUSH_REG to P (at once, or after a hold); on P's completion
    notification check every block by coordinate and generation. A release's D waits without a deadline; the
    corrected D gives up at the lease and recomputes. An abort after PUSH_REG frees D's blocks at once (the
    corrected D keeps them until the completion or the lease)."""

    def __init__(self, role: RequestsD) -> None:
        self.role = role
        self.mode = "pull"
        self.expiry_s: float | None = None
        self.free: deque[int] = deque()
        self.waiting: dict[str, tuple[m.ReqDecode, list[int], float]] = {}  # D's id -> (request, blocks, deadline)
        self.kept: set[str] = set()  # corrected: aborted requests whose blocks wait for P's WRITE to end
        self.held: list[_Hold] = []  # hold / heartbeat-loss: the scheduler has them, no blocks yet
        self.counts: dict[str, int] = {}
        self.p_engine = ""

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.held)

    def reset(self, mode: str, expiry_s: float | None, side: m.ReqSide | None) -> None:
        self.mode, self.expiry_s = mode, expiry_s
        if mode == "push" and side is not None:
            self.role.own.begin(side)  # D's side channel serves this line's wire: P handshakes there
        self.free = deque(range(self.role.kv.num_blocks))
        self.waiting.clear()  # requests of the last line that never completed stay hung there
        self.kept.clear()
        self.held.clear()
        self.counts.clear()
        self.role.kv.clear_all(np.arange(self.role.kv.num_blocks))

    def take(self, msg: m.ReqDecode, line: Lifecycle, peer: m.ReqReady) -> m.ReqDecoded | None:
        """The scheduler has the request (on_new_request): decide, heartbeat, register now or after the hold."""
        i = msg.request
        refused = push.decide(line, msg.params, peer.engine_id, time.time())
        if refused is not None:
            return m.ReqDecoded(i, "refused", *refused)
        assert msg.params is not None
        if line is CORRECTED:  # the registration generation counts P processes: D handshakes with the one running
            gen = int(msg.params.get("remote_registration_generation", 1))
            if gen > peer.incarnation + 1:
                self.role.rehandshake()
                assert self.role.peer is not None
                peer = self.role.peer
            elif gen < peer.incarnation + 1:
                return m.ReqDecoded(i, "refused", *push.stale_generation(gen - 1, peer.incarnation))
        self.p_engine = peer.engine_id
        rid = msg.params.get("remote_request_id")
        beats = line.heartbeat and self.expiry_s is not None and rid is not None and not msg.heartbeats_lost
        if beats:
            self.role.notify(f"HB:{rid}".encode())  # the lease is renewed
        if msg.hold_s > 0:
            now = time.time()
            interval = (self.expiry_s or 0.0) / 6
            self.held.append(_Hold(msg, str(rid) if beats else "", now + msg.hold_s, now + interval))
            return None
        return self.register(msg, line, peer)

    def register(self, msg: m.ReqDecode, line: Lifecycle, peer: m.ReqReady) -> m.ReqDecoded:
        """update_state_after_alloc and the writer's send: D's blocks, then PUSH_REG to P (a release keeps a
        request whose PUSH_REG failed waiting, with its blocks)."""
        i = msg.request
        assert msg.params is not None
        late = push.held_lost(line, msg.params, msg.heartbeats_lost, time.time())
        if late is not None:
            return m.ReqDecoded(i, "refused", *late)
        k = len(msg.expect_blocks)
        if len(self.free) < k:
            return m.ReqDecoded(i, "refused", "hang", push.d_pool_hang(self.role.kv.num_blocks))
        blocks = [self.free.popleft() for _ in range(k)]
        d_rid = push.d_request_id(msg.request_id)
        deadline = time.time() + self.expiry_s if line is CORRECTED and self.expiry_s is not None else float("inf")
        self.waiting[d_rid] = (msg, blocks, deadline)
        try:
            own = self.role.own  # decode_host / decode_port: D's side channel, where P handshakes with D
            self.role.agent.send_notif(peer.agent, push.registration(d_rid, self.role.spec.engine_id, own.host,
                                                                     own.port, blocks, msg.params))
        except NixlCallError as exc:  # _do_send_reg_notif: the agent D cached for P's engine id is gone
            if line is CORRECTED and exc.status == "NIXL_ERR_REMOTE_DISCONNECT":
                self._drop(d_rid)
                self.role.rehandshake()
            return m.ReqDecoded(i, "failed", *push.reg_failed(line, str(exc)), time.time())
        if msg.abort:
            return self.abort(d_rid, line)
        return m.ReqDecoded(i, "registered", t_read=time.time())

    def abort(self, d_rid: str, line: Lifecycle) -> m.ReqDecoded:
        """The client aborts right after PUSH_REG, before P can have WRITTEN (P has not seen the registration yet).
        A release frees D's blocks now, under the WRITE to come (P still WRITEs into them: nothing tells it); the
        corrected D keeps them until P's completion or its watchdog."""
        msg, blocks, _ = self.waiting[d_rid]
        if line is CORRECTED:
            self.kept.add(d_rid)
        else:
            del self.waiting[d_rid]  # P's completion, when it comes: "Unrecognized request ... notif"
            self.free.extend(blocks)
        return m.ReqDecoded(msg.request, "aborted", "aborted", push.abort_detail(line), time.time(),
                            d_freed_in_flight=line is not CORRECTED)

    def poll(self, line: Lifecycle) -> list[m.ReqDecoded]:
        if self.mode != "push":
            return []
        self.role.own.poll(time.time())  # P's handshake with D
        out: list[m.ReqDecoded] = []
        for _peer, got in self.role.agent.notifs().items():
            for raw in got:
                d_rid, _, _world = raw.decode(errors="replace").rpartition(":")
                if d_rid not in self.waiting:
                    continue  # "Unrecognized request %s notif (may have expired)."
                self.counts[d_rid] = self.counts.get(d_rid, 0) + 1
                if self.counts[d_rid] < push.expected_notifs():
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
                out.append(m.ReqDecoded(msg.request, "refused", "recomputed", push.watchdog_detail(self.expiry_s)))
        if self.held:
            out += self.tick(line, now)
        return out

    def tick(self, line: Lifecycle, now: float) -> list[m.ReqDecoded]:
        """Held requests: heartbeats every lease/6 (none when lost), the PUSH_REG once the hold is over."""
        out: list[m.ReqDecoded] = []
        interval = (self.expiry_s or 0.0) / 6
        peer = self.role.peer
        assert peer is not None
        for h in list(self.held):
            if now >= h.read_at:
                self.held.remove(h)
                out.append(self.register(h.msg, line, peer))
            elif h.rid and interval > 0 and now >= h.next_hb:
                self.role.notify(f"HB:{h.rid}".encode())
                h.next_hb = now + interval
        return out

    def _drop(self, d_rid: str) -> None:
        _msg, blocks, _ = self.waiting.pop(d_rid)
        self.kept.discard(d_rid)
        self.counts.pop(d_rid, None)
        self.free.extend(blocks)

    def _check(self, d_rid: str) -> m.ReqDecoded:
        msg, blocks, _ = self.waiting.pop(d_rid)
        self.counts.pop(d_rid, None)
        kv = self.role.kv
        chk = check_blocks(kv, np.asarray(blocks), msg.expect_blocks, engine_tag(self.p_engine), 0,
                           read_len=kv.block_len, view=kv.view, gens=msg.expect_gens)
        self.free.extend(blocks)
        out = m.ReqDecoded(msg.request, "read", t_read=time.time(), checked=chk.checked, wrong=chk.wrong)
        if chk.first is not None:
            f = chk.first.found
            out.found_block, out.found_gen, out.found_valid = f.block, f.gen, f.valid
        return out
