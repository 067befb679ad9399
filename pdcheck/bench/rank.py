"""One rank process: `python -m pdcheck.bench.rank --control EP --role P|D --rank N --run-id ID`.

P (prefill) owns the source KV pool and only progresses its NIXL worker; D (decode) pulls the blocks
with READs, like vLLM's NixlConnector, times them and checks every block. Ctrl-C is the parent's to
handle (it reaps us); if the parent dies we die with it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
from typing import Any

import numpy as np
import zmq

from pdcheck.bench import layout, measure, pattern
from pdcheck.bench import protocol as pr
from pdcheck.bench.buffers import Pool, make_pool
from pdcheck.bench.models import ModelShape
from pdcheck.errors import NixlCallError
from pdcheck.nixlagent import LOCAL, Agent, quiet_nixl_env


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphan survives a killed parent
    except (OSError, AttributeError):
        pass


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


def _nixl(op: str, ctx: str, fn: Any, *args: Any) -> Any:
    """A raw NIXL call whose failure names the operation and NIXL's status word."""
    try:
        return fn(*args)
    except Exception as exc:  # the bindings raise their own nixl*Error classes
        words = [w for w in str(exc).replace(":", " ").split() if w.startswith("NIXL_")]
        raise NixlCallError(op, words[0] if words else type(exc).__name__, str(exc), ctx) from exc


class Channel:
    def __init__(self, control: str, identity: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.connect(control)
        self.parent = os.getppid()

    def send(self, msg: pr.Msg) -> None:
        self.sock.send(pr.pack(msg))

    def ready(self) -> bool:
        return bool(self.sock.poll(0))

    def recv(self) -> pr.Msg:
        while not self.sock.poll(200):
            if os.getppid() != self.parent:
                raise SystemExit(1)
        return pr.unpack(self.sock.recv())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _shape(s: pr.ShapeMsg) -> ModelShape:
    return ModelShape(s.name, s.layers, s.kv_heads, s.head_dim, s.dtype, s.mla)


class Target:
    """P rank: fills its pool per row and progresses the worker (busy for emulated transports)."""

    def __init__(self, rank: int, setup: pr.Setup, agent: Agent, pool: Pool, chan: Channel) -> None:
        self.rank, self.setup, self.agent, self.pool, self.chan = rank, setup, agent, pool, chan
        self.notifs = 0
        self.t0 = time.perf_counter()

    def run(self) -> None:
        get = self.agent.raw.get_new_notifs
        busy = self.setup.target_busy
        spins = 0
        while True:
            got = get()  # also drives the UCX worker: the only progress this rank gets without a thread
            if got:
                self.notifs += sum(len(v) for v in got.values())
            if busy:
                spins += 1
                if spins & 63 or not self.chan.ready():  # zmq polls cost µs; look every 64 spins
                    continue
            elif not self.chan.sock.poll(1):
                continue
            msg = self.chan.recv()
            if isinstance(msg, pr.RowMsg):
                self.chan.send(self.fill(msg))
            elif isinstance(msg, pr.Poll):
                self.chan.send(pr.Stats(time.process_time(), time.perf_counter() - self.t0, self.notifs))
            elif isinstance(msg, pr.Stop):
                self.chan.send(pr.Bye(self.notifs))
                return

    def fill(self, msg: pr.RowMsg) -> pr.Filled:
        s, shape = self.setup, _shape(self.setup.shape)
        t0 = time.perf_counter()
        geom = layout.rank_geom(shape, s.ptp, self.rank, msg.block_tokens)
        keys = pattern.block_keys(s.seed, shape.regions, msg.num_blocks)
        self.pool.fill(keys, geom.block_bytes // 8, geom.word_offset)
        if msg.corrupt >= 0:
            plan = layout.read_plan(shape, s.ptp, s.dtp, 0, msg.block_tokens)
            if plan.p.rank == self.rank:
                n = msg.corrupt % (shape.regions * msg.blocks)
                region, i = divmod(n, msg.blocks)
                block = int(pr.bytes_arr(msg.tables_p, msg.requests)[0, i])
                at = (region * msg.num_blocks + block) * geom.block_bytes + plan.offset + plan.d.block_bytes // 2
                self.pool.corrupt(at)
        return pr.Filled((time.perf_counter() - t0) * 1e3)


class Initiator:
    """D rank: pulls the row's requests with prepped READs and checks what landed."""

    def __init__(self, rank: int, setup: pr.Setup, agent: Agent, pool: Pool, chan: Channel) -> None:
        self.rank, self.setup, self.agent, self.pool, self.chan = rank, setup, agent, pool, chan
        self.peers: dict[int, pr.PeerInfo] = {}
        self.names: dict[int, str] = {}
        self.poster = measure.Poster(agent.raw)

    def run(self) -> None:
        while True:
            msg = self.chan.recv()
            if isinstance(msg, pr.Peers):
                for p in msg.peers:
                    self.peers[p.rank] = p
                    self.names[p.rank] = self.agent.add_remote(p.metadata)
                self.chan.send(pr.Ack())
            elif isinstance(msg, pr.RowMsg):
                self.chan.send(self.row(msg))
            elif isinstance(msg, pr.Stop):
                self.chan.send(pr.Bye(0))
                return

    def row(self, msg: pr.RowMsg) -> pr.RankRow:
        s, shape, pool, raw = self.setup, _shape(self.setup.shape), self.pool, self.agent.raw
        plan = layout.read_plan(shape, s.ptp, s.dtp, self.rank, msg.block_tokens)
        regions, nb = shape.regions, msg.num_blocks
        bd, bp = plan.d.block_bytes, plan.p.block_bytes
        peer, remote = self.peers[plan.p.rank], self.names[plan.p.rank]
        tables_p = pr.bytes_arr(msg.tables_p, msg.requests)
        tables_d = pr.bytes_arr(msg.tables_d, msg.requests)
        notif = f"pdcheck:{msg.index}".encode() if s.notif else b""
        ctx = f"row {msg.index} ({msg.block_tokens}-token blocks)"

        # Prepped dlists over the whole pools, built once per row from numpy Nx3 arrays.
        t0 = time.perf_counter()
        lh = self.agent.prep(LOCAL, layout.pool_descs(pool.addr, regions, nb, bd, bd, pool.dev), pool.mem_type,
                             f"{ctx}: local dlist")
        rh = self.agent.prep(remote, layout.pool_descs(peer.addr, regions, nb, bp, bd, peer.dev, plan.offset),
                             pool.mem_type, f"{ctx}: remote dlist")
        prep_ms = (time.perf_counter() - t0) * 1e3
        handles, runs = [], []
        t0 = time.perf_counter()
        try:
            for q in range(msg.requests):
                lids = layout.desc_ids(regions, nb, tables_d[q])
                rids = layout.desc_ids(regions, nb, tables_p[q])
                handles.append(_nixl("make_prepped_xfer", ctx, raw.make_prepped_xfer, "READ", lh, lids, rh, rids, notif))
                runs.append(layout.contiguous_runs(lids, bd, rids, bp, bd))
            make_us = (time.perf_counter() - t0) * 1e6 / max(1, msg.requests)
            return self._measure(msg, plan, handles, runs, prep_ms, make_us, peer, remote, notif, ctx)
        finally:
            for h in handles:
                raw.release_xfer_handle(h)
            raw.release_dlist_handle(lh)
            raw.release_dlist_handle(rh)

    def _measure(self, msg: pr.RowMsg, plan: layout.ReadPlan, handles: list, runs: list[int], prep_ms: float,
                 make_us: float, peer: pr.PeerInfo, remote: str, notif: bytes, ctx: str) -> pr.RankRow:
        s, shape, pool, raw = self.setup, _shape(self.setup.shape), self.pool, self.agent.raw
        regions, nb = shape.regions, msg.num_blocks
        bd, bp = plan.d.block_bytes, plan.p.block_bytes
        nbytes = regions * msg.blocks * bd
        used_d, used_p = regions * nb * bd, regions * nb * bp
        budget = max(0.05, s.min_time / 4)
        keys = pattern.block_keys(s.seed, regions, nb)

        mem_a = measure.memcpy_ceiling(pool, used_d, nbytes, budget)

        def wire_check(off: int, n: int) -> int:
            return pattern.check_range(pool.read_words(off, n), keys, off // 8, bp // 8, plan.p.word_offset)

        wire = measure.wire_ceiling(self.agent, self.poster, remote, pool.mem_type,
                                    measure.WireSide(pool.addr, used_d, pool.dev),
                                    measure.WireSide(peer.addr, used_p, peer.dev), nbytes, budget, notif, wire_check)
        pool.zero(used_d)  # blocks that never arrive must not pass the check

        # Warm-up: every request once (connection, first touch, telemetry), then the estimate.
        t0 = time.perf_counter()
        for i in range(max(len(handles), s.warmup)):
            if not self.poster.one(handles[i % len(handles)]):
                raise NixlCallError("transfer", "NIXL_ERR_BACKEND", "transfer state ERR", ctx)
        per_op = (time.perf_counter() - t0) / max(len(handles), s.warmup)
        iters = s.iters or measure.auto_iters(per_op, s.min_time)
        merged, terr = [], None
        try:
            merged = [int(raw.get_xfer_telemetry(h).descCount) for h in handles]
        except Exception as exc:  # telemetry is optional in NIXL builds; report why it is missing
            terr = f"{type(exc).__name__}: {exc}"

        self.chan.send(pr.Armed())
        go = self.chan.recv()
        if not isinstance(go, pr.Go):
            raise RuntimeError(f"expected Go, got {type(go).__name__}")
        cpu0 = time.process_time()
        lat, wall = self.poster.timed(handles, iters, ctx)
        cpu = time.process_time() - cpu0

        t0 = time.perf_counter()
        tables_p = pr.bytes_arr(msg.tables_p, msg.requests)
        tables_d = pr.bytes_arr(msg.tables_d, msg.requests)
        chk = measure.verify_requests(pool, keys, tables_p, tables_d, nb, bd // 8, plan.d.word_offset, shape.mla)
        verify_ms = (time.perf_counter() - t0) * 1e3
        mem_b = measure.memcpy_ceiling(pool, used_d, nbytes, budget)
        return pr.RankRow(
            rank=self.rank, nbytes=nbytes, block_bytes=bd, desc_count=regions * msg.blocks, desc_merged=merged,
            desc_runs=float(np.mean(runs)), iters=iters, wall_ns=wall,
            lat_ns=np.asarray(lat, dtype="<i8").tobytes(), checked=chk.checked, wrong=chk.wrong,
            first_wrong=chk.first, memcpy=[mem_a, mem_b], wire=wire, prep_ms=prep_ms, make_us=make_us,
            verify_ms=verify_ms, cpu_s=cpu, working_set=used_d, telemetry_error=terr,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdcheck.bench.rank")
    ap.add_argument("--control", required=True)
    ap.add_argument("--role", choices=["P", "D"], required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--run-id", default="")  # lets tests find stray processes; otherwise unused
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    quiet_nixl_env()
    chan = Channel(args.control, f"{args.role}{args.rank}")
    try:
        chan.send(pr.Hello(args.role, args.rank, os.getpid()))
        setup = chan.recv()
        if not isinstance(setup, pr.Setup):
            raise RuntimeError(f"expected Setup, got {type(setup).__name__}")
        if setup.cores:
            os.sched_setaffinity(0, setup.cores)
        # The pool first: for VRAM the CUDA context must exist before UCX creates its worker.
        pool = make_pool(setup.pool_bytes, setup.device, setup.gpu)
        agent = Agent(setup.agent_name, progress_thread=setup.progress_thread, error_mode=setup.error_mode,
                      telemetry=args.role == "D")
        agent.register([(pool.addr, pool.nbytes, pool.dev)], pool.mem_type)
        chan.send(pr.Ready(setup.agent_name, agent.metadata(), pool.addr, pool.nbytes, pool.dev, ucx_version(),
                           sorted(os.sched_getaffinity(0))))
        role = Target if args.role == "P" else Initiator
        role(args.rank, setup, agent, pool, chan).run()
        return 0
    except SystemExit:
        raise
    except BaseException as exc:  # report, in one line, whatever stopped this rank
        text = " ".join(str(exc).split()) or type(exc).__name__
        try:
            chan.send(pr.Failed(f"{type(exc).__name__}: {text}"))
        except zmq.ZMQError:
            pass
        print(f"{args.role}{args.rank}: {type(exc).__name__}: {text}", file=sys.stderr, flush=True)
        return 1
    finally:
        chan.close()


if __name__ == "__main__":
    sys.exit(main())
