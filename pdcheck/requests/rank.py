"""The request-path roles of pdcheck's rank skeleton (pdcheck.ranks.run_rank): a P that allocates KV blocks per
request from a free list, tags them with the coordinate pattern and each block's generation, and frees them on
D's done notification (real NIXL notifications) or when the abort timeout / lease passes; a D that takes the
params the router forwards, decides as the release does (pdcheck.requests.model.decide), READs the blocks (the
one Agent, real NIXL), checks every block by coordinate and generation (kvcache.check_blocks) and notifies P in
the release's format.
"""

from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdcheck import messages as m
from pdcheck.errors import NixlCallError
from pdcheck.kvcache import KVCache, block_descs, check_blocks, desc_ids, engine_tag, pattern
from pdcheck.nixlagent import LOCAL, no_memory_hooks
from pdcheck.ranks import Role, run_rank
from pdcheck.requests.lines import CORRECTED, Lifecycle, line_of, with_policy
from pdcheck.requests.model import GEN_WRAP, decide, on_failure, params_for

POLL_S = 0.002
HELD_POLL_S = 0.0002


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
        return f"{self.spec.engine_id}-{self.spec.role.lower()}{self.spec.tp_rank}"

    def environment(self) -> None:
        no_memory_hooks("cpu")

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        self.kv = KVCache(self.spec.geometry, self.spec.num_blocks)
        return self.kv.regions(0), self.kv.mem_type

    def ready(self) -> m.Msg:
        return m.ReqReady(self.spec.tp_rank, self.spec.engine_id, self.agent.name, self.agent.metadata(), self.kv.base_addrs,
                          self.spec.num_blocks, self.setup_ms())

    def wait(self, timeout_s: float) -> m.Msg | None:
        return m.recv(self.conn) if self.conn.poll(timeout_s) else None


class _Held:
    __slots__ = ("blocks", "deadline", "gens")

    def __init__(self, blocks: list[int], gens: list[int], deadline: float) -> None:
        self.blocks, self.gens, self.deadline = blocks, gens, deadline


class RequestsP(RequestsRole):
    """P's scheduler and worker in one: request_finished (allocate, tag, hand out params), _get_new_notifs (free on
    the done notification, renew on a heartbeat) and the expiry sweep."""

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

        def admit() -> None:
            while waiting and len(free) >= per_req:
                i = waiting.popleft()
                blocks = [free.popleft() for _ in range(per_req)]
                gen[blocks] = gen[blocks] % GEN_WRAP + 1
                gens = [int(g) for g in gen[blocks]]
                regions = kv.geometry.num_regions
                reg = np.repeat(np.arange(regions), len(blocks))
                blk = np.tile(np.asarray(blocks), regions)
                assert kv.blocks3 is not None
                kv.blocks3[reg, blk] = pattern(tag, 0, reg, blk, 0, kv.block_len, kv.view, np.tile(gens, regions))
                now = time.time()
                deadline = now + expiry if expiry is not None else float("inf")
                held[i] = _Held(blocks, gens, deadline)
                rid = f"req-{epoch}.{i}"
                by_id[rid] = i
                params = params_for(line, i, blocks, self.spec.engine_id, 5600, 1,
                                    deadline if expiry is not None else None, gens, rid)
                m.send(self.conn, m.ReqPrefilled(i, rid, blocks, gens, params, now))

        def release(i: int, how: str, log: str = "") -> None:
            h = held.pop(i)
            free.extend(h.blocks)
            m.send(self.conn, m.ReqFreed(i, how, time.time(), log))

        def handle(msg: m.Msg | None) -> None:
            nonlocal line, expiry, per_req, free, late, beats, errors, epoch
            if isinstance(msg, m.ReqBegin):
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
                waiting.append(msg.request)
                admit()
            elif isinstance(msg, m.ReqEnd):
                m.send(self.conn, m.ReqAccount(sorted(held), list(waiting), late, beats, errors))
                held.clear()  # the line is over: nothing more expires or is admitted until the next ReqBegin
                waiting.clear()

        while True:
            # D's READs complete only as this loop drives P's UCX worker (agent.notifs(); no progress thread, which
            # would spin a core): while blocks are held a READ may be under way, so look often.
            msgs = [self.wait(HELD_POLL_S if held else POLL_S)]
            while msgs[-1] is not None and self.conn.poll(0):  # every queued message before the next sweep
                msgs.append(m.recv(self.conn))
            for msg in msgs:
                if isinstance(msg, m.Stop):
                    return
                handle(msg)
            for _peer, got in self.agent.notifs().items():
                for raw in got:
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
            now = time.time()
            for i in [i for i, h in held.items() if now >= h.deadline]:
                rid = next((k for k, v in by_id.items() if v == i), str(i))
                release(i, "expired", line.expiry_log.format(req=rid, n=0, s=expiry or 0))
            if waiting and free:
                admit()


class RequestsD(RequestsRole):
    """D's scheduler and worker: decide on the forwarded params, heartbeat, READ, check, notify."""

    def run(self) -> None:
        kv, agent = self.kv, self.agent
        line: Lifecycle = CORRECTED
        peer: m.ReqReady | None = None
        remote: Any = None
        local: Any = None
        expiry_s: float | None = None
        pending: list[tuple[float, bytes]] = []  # (when, notification) for delay-notif
        while True:
            msg = self.wait(POLL_S if pending else 0.05)
            now = time.time()
            for when, note in [p for p in pending if p[0] <= now]:
                pending.remove((when, note))
                assert peer is not None
                agent.send_notif(peer.agent, note)
            if isinstance(msg, m.Stop):
                return
            if isinstance(msg, m.ReqBegin):
                line = with_policy(line_of(msg.line), msg.failure_policy)
                pending.clear()  # a delayed notification of the last line is never sent into this one
                expiry_s = msg.lease_s if msg.lease_s is not None else line.expiry_s
                if msg.peer is not None and peer is None:
                    peer = msg.peer
                    agent.add_remote(peer.metadata)
                    bl = kv.block_len
                    remote = agent.prep(peer.agent, block_descs(peer.base_addrs, peer.num_blocks, bl, bl, 0),
                                        kv.mem_type, "P's blocks")
                    local = agent.prep(LOCAL, kv.descs(bl, 0), kv.mem_type, "local")
            elif isinstance(msg, m.ReqDecode):
                assert peer is not None
                m.send(self.conn, self.decode(msg, line, peer, remote, local, expiry_s, pending))

    def decode(self, msg: m.ReqDecode, line: Lifecycle, peer: m.ReqReady, remote: Any, local: Any,
               expiry_s: float | None, pending: list[tuple[float, bytes]]) -> m.ReqDecoded:
        kv, agent, i = self.kv, self.agent, msg.request
        refused = decide(line, i, msg.params, peer.engine_id, peer.num_blocks, time.time())
        if refused is not None:
            return m.ReqDecoded(i, "refused", *refused)
        assert msg.params is not None
        ids = [int(b) for b in msg.params["remote_block_ids"]]
        rid = str(msg.params.get("remote_request_id", msg.request_id))
        if line.heartbeat and expiry_s is not None:
            agent.send_notif(peer.agent, f"HB:{rid}".encode())  # the scheduler now tracks it: lease renewed
        regions = kv.geometry.num_regions
        mine = np.arange(len(ids))  # D's own blocks for this request: the first len(ids) of its cache
        t_read = time.time()
        try:
            agent.read(local, desc_ids(regions, kv.num_blocks, mine), remote,
                       desc_ids(regions, peer.num_blocks, np.asarray(ids)), context=f"request {i}", yield_cpu=True)
        except NixlCallError as exc:
            verdict, detail = on_failure(line, i, "transfer_setup_failed", str(exc))
            return m.ReqDecoded(i, "failed", verdict, detail, t_read)
        except (OverflowError, ValueError) as exc:  # ids NIXL cannot even take (int32)
            verdict, detail = on_failure(line, i, "transfer_setup_failed", f"{type(exc).__name__}: {exc}")
            return m.ReqDecoded(i, "failed", verdict, detail, t_read)
        chk = check_blocks(kv, mine, msg.expect_blocks, engine_tag(peer.engine_id), 0,
                           read_len=kv.block_len, view=kv.view, gens=msg.expect_gens)
        out = m.ReqDecoded(i, "read", t_read=t_read, checked=chk.checked, wrong=chk.wrong)
        if chk.first is not None:
            f = chk.first.found
            out.found_block, out.found_gen, out.found_valid = f.block, f.gen, f.valid
        if not msg.drop_notif:
            note = line.notification(rid, 1)
            if msg.notif_delay_s > 0:
                pending.append((time.time() + msg.notif_delay_s, note))
            else:
                agent.send_notif(peer.agent, note)
        return out

