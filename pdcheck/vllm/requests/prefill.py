"""The request path's P rank: request_finished (allocate K blocks from a free list, tag them with the coordinate
pattern and each block's generation, hand out the release's kv_transfer_params), _get_new_notifs (free on D's done
notification, renew on a heartbeat), the expiry sweep, P's side channel; in push mode its WRITEs into D's blocks
(_PushTarget)."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import msgspec
import numpy as np

from pdcheck import messages as m
from pdcheck.errors import NixlCallError
from pdcheck.kvcache import block_descs, desc_ids
from pdcheck.nixlagent import LOCAL
from pdcheck.pattern import engine_tag, pattern
from pdcheck.vllm import messages as vm
from pdcheck.vllm.ranks import served_metadata
from pdcheck.vllm.releases.rules import msg_engine_id
from pdcheck.vllm.requests import messages as rm
from pdcheck.vllm.requests import push, shapes, texts
from pdcheck.vllm.requests.handshake import Background, HandshakeFailed, PSide, endpoint
from pdcheck.vllm.requests.lines import CORRECTED, Lifecycle, line_of
from pdcheck.vllm.requests.model import GEN_WRAP, params_for
from pdcheck.vllm.requests.role import POLL_S, Outgoing, RequestsRole, forget_remote, load_remote
from pdcheck.vllm.wire import AnyMeta

HELD_POLL_S = 0.00005  # P holding blocks drives its UCX worker this often: D's READs progress only then


class _Held:
    __slots__ = ("blocks", "deadline", "gens")

    def __init__(self, blocks: list[int], gens: list[int], deadline: float) -> None:
        self.blocks, self.gens, self.deadline = blocks, gens, deadline


class RequestsP(RequestsRole):
    """P's scheduler and worker in one: request_finished (allocate, tag, hand out params), _get_new_notifs (free on
    the done notification, renew on a heartbeat) and the expiry sweep; and its side channel (handshake.PSide)."""

    def ready(self) -> m.Msg:
        # Bound before P reports ready: a replaced P takes its port back before the router sends it anything.
        values = served_metadata(self.spec.engine_id, self.agent, self.kv, tp_size=self.spec.tp_size,
                                 kv_cache_layout="HND", device_id=self.spec.tp_rank)
        self.side = PSide(self.host, self.spec.side_port, values, self.spec.mute_side)
        return msgspec.structs.replace(super().ready(), side_host=self.side.host, side_port=self.side.port)

    def loop(self) -> None:
        kv, tag, me = self.kv, engine_tag(self.spec.engine_id), self.spec.tp_rank
        n = self.spec.num_blocks
        line: Lifecycle = CORRECTED
        expiry: float | None = None
        scale = 1.0  # the run's slow motion (ReqBegin.time_scale)
        per_req = 1
        free: deque[int] = deque()
        gen = np.zeros(n, dtype=np.int64)
        held: dict[int, _Held] = {}
        waiting: deque[int] = deque()
        late = beats = 0
        dead = False  # the engine core died (0.10.0's KeyError on a late notification): nothing more is done
        errors: list[str] = []
        by_id: dict[str, int] = {}
        epoch = 0  # which line of the run: request ids differ between lines
        release_name = CORRECTED.line  # the release under test: its log texts (pdcheck.vllm.requests.texts)
        mode = "pull"
        d_side: _PushTarget | None = None  # push mode: P's handshake with D (on D's first PUSH_REG) and its WRITEs
        notif_faults: dict[int, rm.ReqPrefill] = {}  # push: drop-notif / delay-notif / a failed WRITE
        pending: list[tuple[float, str, bytes]] = []  # push mode: delayed completion notifications
        out = Outgoing(self.conn)
        idle = HELD_POLL_S
        side = self.side
        next_expiry = float("inf")  # no held request expires before this (heartbeats only push deadlines out)
        tp = self.spec.tp_size
        # On a TP shape the scheduler frees a request's blocks once every TP worker reported it done (the parent,
        # rm.ReqRelease): this worker's done requests wait there, so every worker's free list stays the same.
        coordinated = tp > 1
        worker_done: dict[int, _Held] = {}
        counts: dict[str, int] = {}  # done notifications per request id, until its consumers all sent one

        def admit() -> None:
            nonlocal next_expiry
            take = 0 if dead else min(len(waiting), len(free) // per_req)
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
            kv.blocks3[reg, blk] = pattern(tag, me, reg, blk, 0, kv.block_len, kv.view, np.tile(all_gens, regions))
            now = time.time()
            for k, i in enumerate(admitted):
                blocks = taken[k * per_req:(k + 1) * per_req]
                gens = all_gens[k * per_req:(k + 1) * per_req]
                deadline = now + expiry if expiry is not None else float("inf")
                held[i] = _Held(blocks, gens, deadline)
                next_expiry = min(next_expiry, deadline)
                inc = self.spec.incarnation
                rid = f"req-r{rid_inc}.{epoch}.{i}" if rid_inc else f"req-{epoch}.{i}"
                by_id[rid] = i
                if mode == "push":
                    params = push.params(line, i, blocks, self.spec.engine_id, side.port, tp,
                                         deadline if expiry is not None else None, gens, rid, generation or inc + 1,
                                         block_size=kv.geometry.block_size)
                else:
                    # vLLM's registration generation counts the workers' metadata the scheduler took at start-up
                    # (set_xfer_handshake_metadata: +1 per (PP, TP) rank whose payload changed, all at once), so
                    # every P process of TP N hands out N and a replaced P the same; the corrected path counts
                    # incarnations.
                    params = params_for(line, i, blocks, self.spec.engine_id, side.port, tp,
                                        deadline if expiry is not None else None, gens, rid,
                                        (generation or inc + 1) if line is CORRECTED else tp,
                                        block_size=kv.geometry.block_size)
                out.add(rm.ReqPrefilled(i, rid, blocks, gens, params, now))

        def release(i: int, how: str, log: str = "") -> None:
            h = held.pop(i)
            if coordinated:
                worker_done[i] = h
            else:
                free.extend(h.blocks)
            out.add(rm.ReqFreed(i, how, time.time(), log))

        def expire_due(now: float) -> None:
            nonlocal next_expiry
            if now < next_expiry or dead:
                return
            for i in [i for i, h in held.items() if now >= h.deadline]:
                rid = next((k for k, v in by_id.items() if v == i), str(i))
                # the consumers' done notifications this worker got for it (consumer_notification_counts_by_req)
                release(i, "expired", line.expiry_log.format(req=rid, n=counts.pop(rid, 0), s=expiry or 0))
            next_expiry = min((h.deadline for h in held.values()), default=float("inf"))

        rid_inc = self.spec.incarnation  # a replaced TP worker names requests as the scheduler does (rm.ReqAdopt)
        generation = 0  # the corrected path after one TP worker's restart: the engine's generation (rm.ReqReplaced)

        def handle(msg: m.Msg | None) -> None:
            nonlocal line, expiry, per_req, free, late, beats, errors, epoch, mode, d_side, release_name, dead
            nonlocal rid_inc, generation, scale
            if isinstance(msg, rm.ReqBegin):
                mode = msg.mode
                if mode == "push":
                    d_side = d_side or _PushTarget(self)
                    d_side.begin(line_of(msg.line), msg.side, msg.peers)
                if msg.side is not None:
                    side.begin(msg.side)  # this line's era from now on; D handshakes once the parent hears so
                    out.send(vm.Serving(self.spec.tp_rank, [side.port]))
                notif_faults.clear()
                pending.clear()
                line = line_of(msg.line)
                release_name = msg.release or msg.line
                scale = msg.time_scale
                expiry = line.lease(msg.lease_s)
                per_req = msg.blocks_per_request
                epoch += 1
                free = deque(range(n))
                gen[:] = 0
                held.clear()
                worker_done.clear()
                counts.clear()
                waiting.clear()
                by_id.clear()
                late = beats = 0
                dead = False
                errors = []
                kv.clear_all(np.arange(n))
            elif isinstance(msg, rm.ReqAdopt):
                # This worker replaces one that died mid-line: the scheduler's free list and generations; what the
                # dead one held is done here (its blocks died with it) until the scheduler frees it.
                free = deque(msg.free)
                gen[:] = msg.gens
                worker_done.update({i: _Held(b, [], float("inf")) for i, b in msg.held.items()})
                epoch, rid_inc = msg.epoch, msg.rid_inc
            elif isinstance(msg, rm.ReqReplaced):
                generation = msg.generation
            elif isinstance(msg, rm.ReqRelease):
                got = worker_done.pop(msg.request, None)
                if got is not None:
                    free.extend(got.blocks)
                    admit()
            elif isinstance(msg, rm.ReqPrefill):
                self.at = msg.request
                if msg.crash:
                    raise RuntimeError("an exception injected by the test hook Options.crash")
                if msg.stall_s > 0:
                    time.sleep(msg.stall_s)  # the test hook: this process given no core for a while
                notif_faults[msg.request] = msg
                waiting.append(msg.request)
                admit()
            elif isinstance(msg, rm.ReqSync):
                out.send(msg)  # after every ReqPrefilled gathered before it
            elif isinstance(msg, rm.ReqEnd):
                if d_side is not None:  # a handshake with D still running ends first (within its timeout)
                    for i in d_side.finish(held, notif_faults, pending, errors):
                        release(i, "written")
                # Leases due by now expire before the count, not on the loop's next turn: the parent ends the line
                # after every due expiry (the model's horizon), and a count taken first would race it.
                expire_due(time.time())
                out.send(rm.ReqAccount(sorted(held), list(waiting), late, beats, errors,
                                      *(d_side.take() if d_side is not None else ())))
                held.clear()  # the line is over: nothing more expires or is admitted until the next ReqBegin
                waiting.clear()

        while True:
            # D's READs complete only as this loop drives P's UCX worker (agent.notifs(); no progress thread, which
            # would spin a core): while blocks are held a READ may be under way, so look often. P never spins: D
            # keeps many READs in flight and one turn here serves them all, and a spinning P would take D's core.
            # A turn that found nothing doubles the next look's delay (a slow decode, a hold), up to POLL_S.
            first = self.wait(idle if held else POLL_S)
            msgs = rm.unbatch(first)
            while first is not None and self.queued():  # every queued message before the next sweep
                msgs += rm.unbatch(first := m.recv(self.conn))
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
                    if dead:  # nothing reads notifications any more
                        break
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
                    if raw.startswith(b"HB:"):  # 0.22+: D's heartbeat renews the lease of each id it names
                        beats += 1
                        for rid in raw[3:].decode(errors="replace").split(","):
                            i = by_id.get(rid, -1)
                            if i in held and expiry is not None:
                                held[i].deadline = max(held[i].deadline, time.time() + line.lease_extension(expiry, scale))
                        continue
                    try:
                        rid, said_n = line.parse_notification(raw)
                    except ValueError as exc:
                        errors.append(f"{raw!r}: ValueError: {exc}")
                        continue
                    i = by_id.get(rid, -1)
                    self.at = i if i >= 0 else self.at
                    if i in held:
                        # every consumer (D rank reading this P rank) notifies once; free after the last
                        counts[rid] = counts.get(rid, 0) + 1
                        if counts[rid] >= shapes.expected(line, said_n, tp):
                            del counts[rid]
                            release(i, "notif")
                    else:
                        late += 1
                        if line.late_notif == "raises":  # 0.10.0: KeyError, the engine core dies
                            errors.append(texts.engine_died(rid))
                            dead = True
                            continue
                        said = texts.unrecognized(release_name, rid)  # the release's logger.error for it
                        if said is not None:
                            errors.append(said)
            if d_side is not None and d_side.hs.busy:  # push: the WRITEs that waited for P's handshake with D
                for i in d_side.poll(held, notif_faults, pending, errors):
                    release(i, "written")
            now = time.time()
            side.poll(now)
            for when, agent, note in [x for x in pending if x[0] <= now]:
                pending.remove((when, agent, note))
                self.agent.send_notif(agent, note)
            expire_due(now)
            if waiting and free:
                admit()
            out.flush()


class _DRank:
    """A D rank this P rank WRITEs, loaded at P's handshake with its engine: its agent, its blocks' dlist (the part
    of each block this P rank fills), P's matching dlist."""

    __slots__ = ("agent", "local", "meta", "num_blocks", "remote")

    def __init__(self, agent: str, remote: Any, local: Any, num_blocks: int, meta: bytes) -> None:
        self.agent, self.remote, self.local, self.num_blocks, self.meta = agent, remote, local, num_blocks, meta


class _PushTarget:
    """P's side of push mode (push_worker.py): match D's PUSH_REG with a held request, handshake with D over D's
    side channel before the first WRITE to that D engine, in the background, the WRITEs waiting for it; then WRITE
    the coordinate/generation-tagged blocks with the completion notification attached. Once per line and D engine
    (a line is a fresh deployment; vLLM caches the handshake by D's engine id).

    On a TP shape each P rank handshakes with the D ranks it feeds (its consumers, kvsplit's rule read the other
    way: shapes.sources) and WRITEs each the part of its blocks that D rank holds; the first PUSH_REG of a request
    starts them all (vLLM's P WRITEs every rank of plan.all_source_ranks; the other consumers' PUSH_REGs for it
    stay pending, never answered)."""

    def __init__(self, role: RequestsP) -> None:
        self.role, self.agent = role, role.agent
        self.hs = Background("D")
        self.line: Lifecycle = CORRECTED
        self.side: rm.ReqSide | None = None  # the line's wire: P speaks it on D's side channel
        self.peers: dict[str, list[rm.ReqSide]] = {}  # on a shape: each D engine id -> its side channel per TP rank
        self.full = self.agent.prep(LOCAL, role.kv.descs(role.kv.block_len, 0), role.kv.mem_type, "local")
        self.engines: dict[str, list[_DRank]] = {}  # loaded once, kept across lines (D never changes in a run)
        self.ready: set[str] = set()  # D engines this line's handshake is done with
        self.fetch: tuple[str, list[tuple[int, rm.ReqSide]], list[tuple[int, AnyMeta]]] | None = None
        self.deferred: list[tuple[int, push.Registration]] = []  # matched, waiting for the handshake
        self.matched: set[int] = set()  # requests a registration matched in this line
        self.failed: list[int] = []  # WRITE failed
        self.hs_failed: list[int] = []  # P's handshake with D failed: no WRITE
        self.shakes: list[rm.ReqHandshook] = []
        spec = role.spec
        self.d_geom = spec.peer_geometry  # None: one P rank and one D rank, whole blocks
        self.shape = shapes.Shape(spec.tp_size, 1, self.d_geom.tp_size if self.d_geom else 1, 1)

    def begin(self, line: Lifecycle, side: rm.ReqSide | None, peers: dict[str, list[rm.ReqSide]]) -> None:
        self.line, self.side, self.peers, self.ready = line, side, peers, set()
        self.deferred, self.failed, self.hs_failed, self.shakes = [], [], [], []
        self.matched = set()

    def consumers(self) -> list[int]:
        """The D TP ranks (of one D engine) this P rank WRITEs."""
        me = self.role.spec.tp_rank
        return [d for d in range(self.shape.d_tp) if me in shapes.sources(self.shape, d)]

    def register(self, raw: bytes, held: dict[int, _Held], by_id: dict[str, int],
                 faults: dict[int, rm.ReqPrefill], pending: list[tuple[float, str, bytes]],
                 errors: list[str]) -> int | None:
        """A PUSH_REG: the request written (its blocks can be freed), None (no held request matches), -1 (dropped,
        failed, waiting for the handshake with D, or another consumer's registration of a request matched
        already)."""
        got = push.parse_registration(raw)
        if isinstance(got, str):
            errors.append(got)
            return -1
        # _pop_matching_finished_blocks: the exact id, then the id without vLLM's random suffix
        i = by_id.get(got.request_id, by_id.get(push.base_id(got.request_id), -1))
        if i in self.matched:
            return -1
        if i not in held:
            return None
        self.matched.add(i)
        if got.engine_id in self.ready:
            return self.write(i, got, held, faults, pending, errors)
        self.deferred.append((i, got))
        if not self.hs.busy:
            self._start(got)
        return -1

    def _start(self, reg: push.Registration) -> None:
        """P's handshake with D's engine: each D rank it WRITEs, one after the other (on a shape each on the side
        channel the run names for it; else where the PUSH_REG says)."""
        assert self.side is not None
        sides = self.peers.get(reg.engine_id) if self.d_geom is not None else None
        own = msgspec.structs.replace(self.side, host=reg.host, port=reg.port)
        todo = [(d, sides[d] if sides and d < len(sides) else own) for d in self.consumers()]
        self.fetch = (reg.engine_id, todo, [])  # todo[0]: the D rank being fetched
        self.hs.start(todo[0][1])

    def poll(self, held: dict[int, _Held], faults: dict[int, rm.ReqPrefill],
             pending: list[tuple[float, str, bytes]], errors: list[str]) -> list[int]:
        """The handshake, if it ended: the requests written now."""
        got = self.hs.result()
        return [] if got is None else self._settle(got, held, faults, pending, errors)

    def finish(self, held: dict[int, _Held], faults: dict[int, rm.ReqPrefill],
               pending: list[tuple[float, str, bytes]], errors: list[str]) -> list[int]:
        """The line's end: every handshake still running, to its end (each within the release's timeout)."""
        out: list[int] = []
        while self.hs.busy:
            got = self.hs.result(wait_s=None)
            if got is not None:
                out += self._settle(got, held, faults, pending, errors)
        return out

    def _settle(self, got: AnyMeta | HandshakeFailed, held: dict[int, _Held],
                faults: dict[int, rm.ReqPrefill], pending: list[tuple[float, str, bytes]],
                errors: list[str]) -> list[int]:
        side = self.hs.side
        assert side is not None and self.fetch is not None
        eng, (now, *todo), metas = self.fetch
        if not isinstance(got, HandshakeFailed) and got.engine_id != eng:
            got = HandshakeFailed(f"RuntimeError: {msg_engine_id(eng, got.engine_id)}")
        self.shakes.append(rm.ReqHandshook(endpoint(side), side.wire, str(got) if isinstance(got, HandshakeFailed)
                                          else ""))
        mine = [(i, reg) for i, reg in self.deferred if reg.engine_id == eng]
        if not isinstance(got, HandshakeFailed) and todo:  # the next D rank of the engine
            self.fetch = (eng, todo, [*metas, (now[0], got)])
            self.hs.start(todo[0][1])
            return []
        self.fetch = None
        if isinstance(got, HandshakeFailed):
            # 0.28+: every request waiting on the handshake's future fails with it; 0.26: one request per attempt.
            # The WRITE is skipped: P's blocks wait for the lease, D is never told.
            n = len(mine) if push.handshake_joins(self.line) else 1
            for i, reg in mine[:n]:
                errors.append(push.handshake_failure_log(self.line, reg.engine_id, reg.request_id, str(got)))
                self.hs_failed.append(i)
            self.deferred = [x for x in self.deferred if x not in mine[:n]]
            if self.deferred:
                self._start(self.deferred[0][1])
            return []
        self._load(eng, [*metas, (now[0], got)])
        self.ready.add(eng)
        self.deferred = [x for x in self.deferred if x not in mine]
        if self.deferred:
            self._start(self.deferred[0][1])
        # A request whose lease ended while the handshake ran is no longer P's to WRITE (a loopback handshake
        # takes milliseconds; vLLM would WRITE from the freed blocks).
        done = [self.write(i, reg, held, faults, pending, errors) for i, reg in mine if i in held]
        return [i for i in done if i >= 0]

    def _load(self, eng: str, metas: list[tuple[int, AnyMeta]]) -> None:
        """Load each D rank's agent and prep the part of its blocks this P rank WRITEs (again only where D's
        registration changed)."""
        old = self.engines.get(eng, [])
        if [t.meta for t in old] == [meta.agent_metadata for _d, meta in metas]:
            return
        for t in old:
            forget_remote(self.agent, t.remote, t.agent)
            if t.local is not self.full:
                self.agent.release_dlist(t.local)
        kv, me = self.role.kv, self.role.spec.tp_rank
        out: list[_DRank] = []
        for d, meta in metas:
            if self.d_geom is None:  # one P rank and one D rank: P WRITEs its whole block
                name, remote = load_remote(self.agent, kv, meta, "D's blocks")
                out.append(_DRank(name, remote, self.full, meta.num_blocks, meta.agent_metadata))
                continue
            rd = next(r for r in shapes.reads(kv.geometry, self.d_geom, d) if r.p_rank == me)
            name = self.agent.add_remote(meta.agent_metadata)
            bl = meta.block_lens[0] if meta.block_lens else meta.block_len or self.d_geom.block_len
            remote = self.agent.prep(name, block_descs(meta.kv_caches_base_addr, meta.num_blocks, bl, rd.read_len, 0,
                                                       offset=rd.local_offset), kv.mem_type, "D's blocks")
            local = self.agent.prep(LOCAL, kv.descs(rd.read_len, 0, offset=rd.remote_offset), kv.mem_type, "local")
            out.append(_DRank(name, remote, local, meta.num_blocks, meta.agent_metadata))
        self.engines[eng] = out

    def write(self, i: int, reg: push.Registration, held: dict[int, _Held],
              faults: dict[int, rm.ReqPrefill], pending: list[tuple[float, str, bytes]],
              errors: list[str]) -> int:
        """P's WRITEs into D's registered blocks, one per D rank it feeds: the request (its blocks can be freed),
        or -1 (one failed)."""
        h = held[i]
        d_rid, d_blocks = reg.request_id, reg.blocks
        f = faults.get(i, rm.ReqPrefill(i))
        note = push.completion(d_rid, self.shape.p_tp)  # "{D request id}:{P world size}"
        kv, n = self.role.kv, min(len(h.blocks), len(d_blocks))  # push aligns the per-group block counts
        regions = kv.geometry.num_regions
        targets = self.engines[reg.engine_id]
        failed = False
        for d, t in zip(self.consumers(), targets, strict=True):  # _xfer_blocks per D rank: one failing alone
            try:
                if f.write_fail and f.fail_rank in (-1, d):
                    # read-fail in push mode: the WRITE names memory D never registered; NIXL itself refuses it.
                    bad = self.agent.prep(t.agent, np.array([(4096, kv.block_len, 0)], dtype=np.uint64),
                                          kv.mem_type, f"push {d_rid}: D's memory (read-fail)")
                    self.agent.release_dlist(bad)
                quiet = (f.drop_notif and f.drop_rank in (-1, d)) or (f.notif_delay_s > 0 and f.delay_rank in (-1, d))
                self.agent.read(t.local, desc_ids(regions, kv.num_blocks, np.asarray(h.blocks[:n])), t.remote,
                                desc_ids(regions, t.num_blocks, np.asarray(d_blocks[:n])),
                                b"" if quiet else note, op="WRITE", context=f"push {d_rid}")
            except (NixlCallError, OverflowError, ValueError) as exc:
                # _xfer_blocks: logged, no handle kept: P's request is never done sending (its blocks wait for the
                # lease) and that D rank is not told (the completion rides on the WRITE); the others' WRITEs go on
                errors.append(f"{push.WRITE_FAIL_LOG} | push WRITE for {d_rid}: {exc}")
                failed = True
        if failed:
            self.failed.append(i)
            return -1
        for d, t in zip(self.consumers(), targets, strict=True):
            if f.notif_delay_s > 0 and f.delay_rank in (-1, d) and not (f.drop_notif and f.drop_rank in (-1, d)):
                pending.append((time.time() + f.notif_delay_s, t.agent, note))
        return i

    def take(self) -> tuple[list[int], list[rm.ReqHandshook], list[int]]:
        """This line's failed WRITEs, P's handshakes with D, and the requests that handshake failed for."""
        out = (self.failed, self.shakes, self.hs_failed)
        self.failed, self.shakes, self.hs_failed = [], [], []
        return out
