"""The transfer-bench roles of pdcheck's rank skeleton (pdcheck.ranks.run_rank), started by the same launcher as
a handshake rank (forked locally, or a Ray actor).

P (Target) lays each row's KV cache over its arena, tags every block with pdcheck's coordinate pattern and
progresses its NIXL worker; D (Initiator) pulls the blocks with READs, like vLLM's NixlConnector, times them and
checks every block by coordinate. The launcher's pipe carries msgspec messages (pdcheck.messages); the
rank's fd 1/2 go to its own log file, where UCX prints the protocol tables the parent diagnoses.
"""

from __future__ import annotations

import ctypes
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pdcheck import messages as m
from pdcheck.bench import measure, tables
from pdcheck.bench import messages as bm
from pdcheck.errors import NixlCallError
from pdcheck.geometry import Geometry, read_source
from pdcheck.kvcache import Arena, KVCache, block_descs, check_range, desc_ids, region_addrs
from pdcheck.nixlagent import LOCAL
from pdcheck.pattern import engine_tag
from pdcheck.ranks import Role, run_rank

BENCH_TAG = engine_tag("pdcheck-transfer-bench")  # the engine tag in every P block's coordinate cells


def ucx_version() -> str:
    """The UCX that NIXL loaded into this process (the wheel bundles its own libucp)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libucp" in line and "/" in line}
        for path in sorted(paths):
            lib = ctypes.CDLL(path)
            lib.ucp_get_version_string.restype = ctypes.c_char_p
            return lib.ucp_get_version_string().decode()
    except (OSError, AttributeError):
        pass
    return "unknown"


def _geometries(spec: bm.BenchSpec, block_tokens: int) -> tuple[Geometry, Geometry]:
    shape = spec.shape
    return shape.geometry(spec.ptp, block_tokens), shape.geometry(spec.dtp, block_tokens)


class BenchRole(Role):
    """A transfer-bench rank: one arena (sized for the largest row) registered with a NIXL agent configured as
    the transport preset says. The spec's role picks Target (P) or Initiator (D)."""

    spec_type = bm.BenchSpec

    @classmethod
    def for_spec(cls, spec: bm.BenchSpec) -> type[Role]:
        return Target if spec.role == "P" else Initiator

    @property
    def name(self) -> str:
        return f"{self.spec.role}{self.spec.tp_rank}"

    @property
    def host(self) -> str:
        return str(self.spec.host)

    def environment(self) -> None:
        spec = self.spec
        os.environ.update(spec.ucx_env)  # read when the agent creates its UCX context
        if spec.cores:
            os.sched_setaffinity(0, spec.cores)

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        s = self.spec
        self.arena = Arena(s.arena_bytes, s.device, s.gpu, hugepages=True, touch=True)
        return self.arena.registration(), self.arena.mem_type

    @property
    def agent_name(self) -> str:
        return str(self.spec.agent_name)

    def agent_options(self) -> dict[str, Any]:
        s = self.spec
        return {"progress_thread": s.progress_thread, "error_mode": s.error_mode, "telemetry": s.role == "D"}

    def ready(self) -> m.Msg:
        s, arena = self.spec, self.arena
        return bm.BenchReady(s.tp_rank, s.agent_name, self.agent.metadata(), arena.addr, arena.nbytes, arena.dev,
                            ucx_version(), sorted(os.sched_getaffinity(0)))


class Target(BenchRole):
    """P rank: tags each row's blocks and progresses the worker (busy for emulated transports)."""

    def run(self) -> None:
        self.notifs = 0
        self.t0 = time.perf_counter()
        get = self.agent.progress  # also drives the UCX worker: the only progress without a thread
        busy = self.spec.target_busy
        poll = self.conn.poll
        spins = 0
        while True:
            self.notifs += get()
            if busy:
                spins += 1
                if spins & 63 or not poll(0):  # a pipe poll costs µs; look every 64 spins
                    continue
            elif not poll(0.001):
                continue
            msg = m.recv(self.conn)
            if isinstance(msg, bm.Row):
                m.send(self.conn, self.fill(msg))
            elif isinstance(msg, bm.Poll):
                m.send(self.conn, bm.Stats(time.process_time(), time.perf_counter() - self.t0, self.notifs))
            elif isinstance(msg, m.Stop):
                m.send(self.conn, bm.Bye(self.notifs))
                return

    def fill(self, msg: bm.Row) -> bm.Filled:
        s = self.spec
        t0 = time.perf_counter()
        gp, gd = _geometries(s, msg.block_tokens)
        KVCache(gp, msg.num_blocks, arena=self.arena).fill(BENCH_TAG, s.tp_rank)
        if msg.corrupt >= 0:
            src, offset = read_source(gp, gd, 0) or (0, 0)
            if src == s.tp_rank:  # decode rank 0 reads from this rank: flip a byte in the middle of its slice
                region, i = divmod(msg.corrupt % (gp.num_regions * msg.blocks), msg.blocks)
                block = int(tables.table_of(msg.tables_p, msg.requests)[0, i])
                row = int(desc_ids(gp.num_regions, msg.num_blocks, [block])[region])  # the cache's row, in order
                self.arena.flip(row * gp.block_len + offset + gd.block_len // 2)
        self.arena.sync()
        return bm.Filled((time.perf_counter() - t0) * 1e3)


class Initiator(BenchRole):
    """D rank: pulls the row's requests with prepped READs and checks what landed."""

    def run(self) -> None:
        self.peers: dict[int, bm.PeerInfo] = {}
        self.names: dict[int, str] = {}
        while True:
            msg = m.recv(self.conn)
            if isinstance(msg, bm.Peers):
                for p in msg.peers:
                    self.peers[p.rank] = p
                    self.names[p.rank] = self.agent.add_remote(p.metadata)
                m.send(self.conn, m.Ack())
            elif isinstance(msg, bm.Row):
                m.send(self.conn, self.row(msg))
            elif isinstance(msg, m.Stop):
                m.send(self.conn, bm.Bye(0))
                return

    def row(self, msg: bm.Row) -> bm.RankRow:
        s, arena, agent = self.spec, self.arena, self.agent
        gp, gd = _geometries(s, msg.block_tokens)
        src, offset = read_source(gp, gd, s.tp_rank) or (0, 0)  # the plan refused geometries without a source
        nb, bd, bp = msg.num_blocks, gd.block_len, gp.block_len
        kv = KVCache(gd, nb, arena=arena)
        peer, remote = self.peers[src], self.names[src]
        tables_p = tables.table_of(msg.tables_p, msg.requests)
        tables_d = tables.table_of(msg.tables_d, msg.requests)
        notif = f"pdcheck:{msg.index}".encode() if s.notif else b""
        ctx = f"row {msg.index} ({msg.block_tokens}-token blocks)"

        # Prepped dlists over the whole caches, built once per row from numpy Nx3 arrays.
        t0 = time.perf_counter()
        lh = self.agent.prep(LOCAL, kv.descs(bd, arena.dev), arena.mem_type, f"{ctx}: local dlist")
        far = block_descs(region_addrs(peer.addr, gp, nb), nb, bp, bd, peer.dev, offset=offset)
        rh = self.agent.prep(remote, far, arena.mem_type, f"{ctx}: remote dlist")
        prep_ms = (time.perf_counter() - t0) * 1e3
        handles, runs = [], []
        t0 = time.perf_counter()
        try:
            for q in range(msg.requests):
                lids = desc_ids(gd.num_regions, nb, tables_d[q])
                rids = desc_ids(gd.num_regions, nb, tables_p[q])
                handles.append(agent.make_read(lh, lids, rh, rids, notif, ctx))
                runs.append(tables.contiguous_runs(lids, bd, rids, bp, bd))
            make_us = (time.perf_counter() - t0) * 1e6 / max(1, msg.requests)
            return self._measure(msg, kv, gp, src, offset, handles, runs, prep_ms, make_us, peer, remote, notif,
                                 tables_p, tables_d, ctx)
        finally:
            agent.release(*handles)
            agent.release_dlist(lh, rh)

    def _measure(self, msg: bm.Row, kv: KVCache, gp: Geometry, src: int, offset: int, handles: list[Any],
                 runs: list[int], prep_ms: float, make_us: float, peer: bm.PeerInfo, remote: str, notif: bytes,
                 tables_p: np.ndarray, tables_d: np.ndarray, ctx: str) -> bm.RankRow:
        s, arena, agent = self.spec, self.arena, self.agent
        gd = kv.geometry
        regions, nb, bd, bp = gd.num_regions, msg.num_blocks, gd.block_len, gp.block_len
        nbytes = regions * msg.blocks * bd
        used_d, used_p = regions * nb * bd, regions * nb * bp
        budget = max(0.05, s.min_time / 4)

        mem_a = measure.memcpy_ceiling(arena, used_d, nbytes, budget)

        def wire_check(off: int, n: int) -> int:
            return check_range(arena.host_bytes(off, n), BENCH_TAG, src, gp, nb, off)

        wire = measure.wire_ceiling(agent, remote, arena.mem_type,
                                    measure.WireSide(arena.addr, used_d, arena.dev),
                                    measure.WireSide(peer.addr, used_p, peer.dev), nbytes, budget, notif, wire_check)
        arena.zero(used_d)  # blocks that never arrive must not pass the check

        # Warm-up: every request once (connection, first touch, telemetry), then the estimate.
        t0 = time.perf_counter()
        for i in range(max(len(handles), s.warmup)):
            agent.complete(handles[i % len(handles)], ctx)
        per_op = (time.perf_counter() - t0) / max(len(handles), s.warmup)
        iters = s.iters or measure.auto_iters(per_op, s.min_time)
        merged, terr = [], None
        try:
            merged = [self.agent.desc_count(h) for h in handles]
        except NixlCallError as exc:  # telemetry is optional in NIXL builds; report why it is missing (NIXL's words)
            why = exc.__cause__ or exc
            terr = f"{type(why).__name__}: {why}"

        m.send(self.conn, m.Armed())
        go = m.recv(self.conn)
        if not isinstance(go, bm.Measure):
            raise RuntimeError(f"expected Measure, got {type(go).__name__}")
        cpu0 = time.process_time()
        lat, wall = agent.timed(handles, iters, ctx)
        cpu = time.process_time() - cpu0

        t0 = time.perf_counter()
        chk = measure.verify_requests(kv, gp, BENCH_TAG, src, offset, tables_p, tables_d)
        verify_ms = (time.perf_counter() - t0) * 1e3
        mem_b = measure.memcpy_ceiling(arena, used_d, nbytes, budget)
        return bm.RankRow(
            rank=s.tp_rank, nbytes=nbytes, block_bytes=bd, desc_count=regions * msg.blocks, desc_merged=merged,
            desc_runs=float(np.mean(runs)), iters=iters, wall_ns=wall,
            lat_ns=np.asarray(lat, dtype="<i8").tobytes(), checked=chk.checked, wrong=chk.wrong,
            first_wrong=chk.first, memcpy=[mem_a, mem_b], wire=wire, prep_ms=prep_ms, make_us=make_us,
            verify_ms=verify_ms, cpu_s=cpu, working_set=used_d, telemetry_error=terr,
        )


def bench_main(conn: Connection, spec_bytes: bytes) -> None:
    """A transfer-bench rank (launcher target)."""
    run_rank(BenchRole, conn, spec_bytes)
