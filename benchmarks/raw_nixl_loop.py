#!/usr/bin/env python3
"""A hand-tuned raw NIXL READ loop: the yardstick `pdcheck transfer-bench` is held to (>= 0.95x).

No harness: two processes, host memory, one NIXL agent each (UCX, no progress thread), prepped
dlists from numpy Nx3 arrays, one prepped handle per request re-posted through NIXL's bindings
directly, busy polling, target busy-progressing its worker, target pinned to core 0 and initiator
to core 1. The blocks come from an .npz (bench_vs_raw.py writes it from transfer-bench's own plan),
so both measure exactly the same descriptors.

    python benchmarks/raw_nixl_loop.py BLOCKS.npz [--iters 60] [--notif] [--error-mode none]

Prints one JSON line: {"gbps": ..., "iters": ..., "bytes_per_transfer": ..., "descs_per_transfer": ...}.
Transport selection is by environment (UCX_TLS), as for the bench.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np
import zmq
from nixl_cu13._api import nixl_agent, nixl_agent_config

LOCAL = "NIXL_INIT_AGENT"


def agent(name: str, error_mode: str | None) -> nixl_agent:
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    a.create_backend("UCX", {"ucx_error_handling_mode": error_mode} if error_mode else {})
    return a


def pool(nbytes: int) -> np.ndarray:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: THP-eligible
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[:] = 1  # touch every page: an untouched source reads the shared zero page, cache-hot
    return arr


def register(a: nixl_agent, arr: np.ndarray) -> None:
    a.register_memory(a.get_reg_descs([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM"))


def target(args: argparse.Namespace, spec: dict[str, np.ndarray]) -> int:
    os.sched_setaffinity(0, {0})
    a = agent("raw-P", args.error_mode)
    src = pool(int(spec["p_pool"]))
    register(a, src)
    sock = zmq.Context().socket(zmq.REQ)
    sock.connect(args.connect)
    sock.send_multipart([bytes(a.get_agent_metadata()), str(src.ctypes.data).encode()])
    get, spins = a.get_new_notifs, 0
    while True:  # progress the worker; look at the socket every 64 spins
        get()
        spins += 1
        if not spins & 63 and sock.poll(0):
            sock.recv()
            return 0


def initiator(args: argparse.Namespace, spec: dict[str, np.ndarray]) -> int:
    os.sched_setaffinity(0, {1})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    child = subprocess.Popen([sys.executable, __file__, args.npz, "--role", "target", "--connect",
                              f"tcp://127.0.0.1:{port}"] + (["--error-mode", args.error_mode] if args.error_mode
                                                           else []))
    try:
        a = agent("raw-D", args.error_mode)
        dst = pool(int(spec["d_pool"]))
        register(a, dst)
        md, addr = sock.recv_multipart()
        remote = a.add_remote_agent(md)
        regions, nb = int(spec["regions"]), int(spec["num_blocks"])
        bd, bp, off = int(spec["d_block"]), int(spec["p_block"]), int(spec["offset"])
        n = regions * nb
        ld = np.empty((n, 3), np.uint64)
        ld[:, 0] = np.uint64(dst.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(bd)
        ld[:, 1], ld[:, 2] = bd, 0
        rd = np.empty((n, 3), np.uint64)
        rd[:, 0] = np.uint64(int(addr) + off) + np.arange(n, dtype=np.uint64) * np.uint64(bp)
        rd[:, 1], rd[:, 2] = bd, 0
        lh = a.prep_xfer_dlist(LOCAL, ld, "DRAM")
        rh = a.prep_xfer_dlist(remote, rd, "DRAM")
        notif = b"raw" if args.notif else b""
        handles = [a.make_prepped_xfer("READ", lh, li, rh, ri, notif)
                   for li, ri in zip(spec["lids"], spec["rids"], strict=True)]
        raw = [h._handle for h in handles]
        bind = sys.modules[type(a).__module__].nixlBind
        post, status, busy, ok = a.agent.postXferReq, a.agent.getXferStatus, bind.NIXL_IN_PROG, bind.NIXL_SUCCESS
        for h in raw:  # warm-up: every request once
            st = post(h, b"")
            while st == busy:
                st = status(h)
        k, iters = len(raw), args.iters
        t0 = time.perf_counter_ns()
        for i in range(iters):
            h = raw[i % k]
            st = post(h, b"")
            while st == busy:
                st = status(h)
            if st != ok:
                raise SystemExit(f"transfer failed: {st}")
        wall = time.perf_counter_ns() - t0
        nbytes = spec["lids"].shape[1] * bd
        print(json.dumps({"gbps": nbytes * iters / wall, "iters": iters, "bytes_per_transfer": int(nbytes),
                          "descs_per_transfer": int(spec["lids"].shape[1]), "requests": k}), flush=True)
        for h in handles:
            a.release_xfer_handle(h)
        a.release_dlist_handle(lh)
        a.release_dlist_handle(rh)
        sock.send(b"stop")
        child.wait(10)
        return 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        sock.close(0)
        ctx.term()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("npz")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--notif", action="store_true", help="attach a notification to every READ (as vLLM does)")
    ap.add_argument("--error-mode", choices=["peer", "none"])
    ap.add_argument("--role", choices=["initiator", "target"], default="initiator")
    ap.add_argument("--connect")
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    spec = dict(np.load(args.npz))
    return target(args, spec) if args.role == "target" else initiator(args, spec)


if __name__ == "__main__":
    sys.exit(main())
