#!/usr/bin/env python3
"""`pdcheck requests` against a raw NIXL loop doing the same READs and notifications, in one run.

pdcheck: the runner API of `pdcheck requests` (pdcheck.vllm.requests.run.run), one release line, pull mode, no
faults, every request due at once (the rate is not the limit): real P and D ranks, the parent as router. Each
request: P allocates and tags 2 blocks, hands out params; D decides, READs the blocks (2 layers, K and V: 8
descriptors of 4 KiB), checks them, sends the done notification; P frees on it. The corrected path runs after the
line (run() always adds it) and is timed too.

raw: two processes with one NIXL agent each (UCX, host memory, same KV cache geometry and descriptors from
pdcheck.kvcache), no harness: D posts each request's READ of the same 8 descriptors from prepped dlists with
"{id}:1" riding on it (the done notification, as vLLM sends it), busy-polls it, releases the handle; P busy-polls its notifications until it has all of them. The
clock stops when P has the last notification.

Runs alternate (pdcheck, raw, pdcheck, ...; this host drifts; raw sends as many heartbeats as pdcheck did just before) and the script prints requests/s of each, the medians and
the ratio of time per request, pdcheck / raw (goal <= 1.3).

    python benchmarks/requests_vs_raw.py [--requests 2000] [--reps 3] [--line 0.34.0] [--pool 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdcheck.kvcache import KVCache, block_descs, desc_ids  # noqa: E402
from pdcheck.nixlagent import confine_ucx, no_memory_hooks  # noqa: E402
from pdcheck.vllm.requests.lines import line_of  # noqa: E402
from pdcheck.vllm.requests.run import GEOMETRY  # noqa: E402

PER_REQUEST = 2  # blocks per request, as Options' default


def _agent(name: str) -> object:
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    a.create_backend("UCX", {})
    return a


def _setup(name: str, pool: int) -> tuple[object, KVCache]:
    confine_ucx("127.0.0.1")  # as pdcheck's ranks: UCX on lo, no memory hooks
    no_memory_hooks("cpu")
    a = _agent(name)
    kv = KVCache(GEOMETRY, pool)
    a.register_memory(a.get_reg_descs([(x, n, d, "") for x, n, d in kv.regions(0)], kv.mem_type))
    return a, kv


def raw_p(connect: str, pool: int) -> int:
    a, kv = _setup("raw-req-P", pool)
    sock = zmq.Context().socket(zmq.REQ)
    sock.connect(connect)
    sock.send_multipart([bytes(a.get_agent_metadata()), json.dumps(kv.base_addrs).encode()])
    want = int(sock.recv())  # D starts; P counts notifications as vLLM's _get_new_notifs does (rsplit, int)
    got, counts = 0, {}
    c0 = time.process_time()
    while got < want:
        os.sched_yield()  # spin, but let a loaded host's other processes run (D among them)
        for notifs in a.get_new_notifs().values():
            for raw in notifs:
                if raw.startswith(b"HB:"):  # a heartbeat: P renews a lease (a dict write)
                    continue
                rid, n = raw.decode().rsplit(":", 1)
                counts[rid] = counts.get(rid, 0) + 1
                if counts[rid] == int(n):
                    del counts[rid]
                    got += 1
    sock.send(json.dumps([time.perf_counter(), time.process_time() - c0]).encode())
    sock.recv()
    return 0


def raw_d(requests: int, pool: int, heartbeats: int) -> dict[str, float]:
    """heartbeats: how many HB notifications to send, as many as pdcheck's D sent in the same rep (one per loop
    turn, naming that turn's requests): evenly spread, each naming the requests up to the next."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    child = subprocess.Popen([sys.executable, __file__, "--role", "P", "--connect", f"tcp://127.0.0.1:{port}",
                              "--pool", str(pool)])
    try:
        a, kv = _setup("raw-req-D", pool)
        if not sock.poll(60_000):
            raise SystemExit("raw P did not start within 60 s")
        md, addrs = sock.recv_multipart()
        peer = a.add_remote_agent(md)
        bl = kv.block_len
        remote = a.prep_xfer_dlist(peer, block_descs(json.loads(addrs), pool, bl, bl, 0), kv.mem_type)
        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", kv.descs(bl, 0), kv.mem_type)
        regions = kv.geometry.num_regions
        mine = desc_ids(regions, pool, np.arange(PER_REQUEST))
        theirs = [desc_ids(regions, pool, (np.arange(PER_REQUEST) + PER_REQUEST * i) % pool)
                  for i in range(requests)]
        every = -(-requests // heartbeats) if heartbeats else 0
        beats = [("HB:" + ",".join(f"req-{j}" for j in range(i, min(requests, i + every)))).encode()
                 for i in range(0, requests, every)] if every else []
        sock.send(str(requests).encode())
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(requests):
            if every and not i % every:  # 0.24+: the heartbeat before the READs of the requests it names
                a.send_notif(peer, beats[i // every])
            # the done notification rides on the READ, as vLLM's _read_blocks sends it (and pdcheck's D)
            h = a.make_prepped_xfer("READ", local, mine, remote, theirs[i], f"req-{i}:1".encode())
            st = a.transfer(h)
            while st not in ("DONE", "ERR"):
                os.sched_yield()
                st = a.check_xfer_state(h)
            if st == "ERR":
                raise SystemExit(f"raw READ {i} failed")
            a.release_xfer_handle(h)
        cpu_d = time.process_time() - c0
        if not sock.poll(60_000):  # never a hang: a lost notification ends the run here
            raise SystemExit(f"raw P did not report all {requests} notifications within 60 s")
        t_p, cpu_p = json.loads(sock.recv())  # P has every notification (one host, one perf_counter clock)
        sock.send(b"stop")
        child.wait(10)
        return {"seconds": t_p - t0, "requests_per_s": requests / (t_p - t0),
                "cpu_ms": {"P": 1e3 * cpu_p / requests, "D": 1e3 * cpu_d / requests}}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        sock.close(0)
        ctx.term()


def pdcheck_run(requests: int, pool: int, line: str) -> dict[str, float]:
    from pdcheck.vllm.requests.run import Options, run

    settle = Options().settle_s  # the run stops when no answer came for `settle` s: shorter cuts P's first answers
    opts = Options(requests=requests, rate=1e9, pool=pool, settle_s=settle, start_timeout_s=120.0)
    cpu = _RankCpu()
    c0 = time.process_time()
    try:
        out = run([(line, line_of(line))], opts)
    finally:
        cpu.stop()
    parent = time.process_time() - c0
    rel, cor = out
    for lr in out:
        bad = [o for o in lr.outcomes if o.verdict != "delivered"]
        if bad:
            raise SystemExit(f"pdcheck {lr.release}: {len(bad)} requests not delivered, first {bad[0]}")
    # a line's seconds end `settle` after the last answer (its notification must reach P): not request work
    both = 2 * requests  # the line and the corrected path: CPU is counted over both
    ranks = cpu.by_role()
    return {"seconds": rel.seconds - settle, "requests_per_s": requests / (rel.seconds - settle),
            "heartbeats": rel.accounting.heartbeats,
            "corrected_requests_per_s": requests / (cor.seconds - settle), "router_lag_s": rel.router_lag_s,
            "cpu_ms": {"parent": 1e3 * parent / both, **{k: 1e3 * v / both for k, v in ranks.items()}}}


class _RankCpu:
    """CPU seconds of pdcheck's rank processes (children of the launcher's forkserver), sampled from /proc while
    they live: the largest utime + stime seen per process, named P or D by the order they started."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.2):
            stats = {}
            for d in Path("/proc").iterdir():
                if d.name.isdigit():
                    try:
                        f = (d / "stat").read_text().rsplit(")", 1)[1].split()
                    except OSError:
                        continue
                    stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)
            servers = {pid for pid, (ppid, _c) in stats.items() if ppid == me}
            for pid, (ppid, c) in stats.items():
                if ppid in servers:
                    self.seen[pid] = max(self.seen.get(pid, 0.0), c)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def by_role(self) -> dict[str, float]:
        pids = sorted(self.seen)
        return {"P" if k == 0 else "D" if k == 1 else f"rank{k}": self.seen[p] for k, p in enumerate(pids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--line", default="0.34.0")
    ap.add_argument("--pool", type=int, default=256, help="P's and D's KV blocks (freed blocks are reused)")
    ap.add_argument("--role", choices=["main", "P"], default="main")
    ap.add_argument("--connect")
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    if args.role == "P":
        return raw_p(args.connect, args.pool)
    raws, mine = [], []
    for rep in range(args.reps):
        p = pdcheck_run(args.requests, args.pool, args.line)
        r = raw_d(args.requests, args.pool, p["heartbeats"])  # the same READs and notifications
        raws.append(r["requests_per_s"])
        mine.append(p["requests_per_s"])
        print(f"rep {rep}: raw {r['requests_per_s']:6.0f} req/s  pdcheck {args.line} {p['requests_per_s']:6.0f} "
              f"req/s (corrected path {p['corrected_requests_per_s']:.0f});  CPU ms/request: raw "
              + " ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms"].items()) + ", pdcheck "
              + " ".join(f"{k} {v:.2f}" for k, v in p["cpu_ms"].items())
              + f"; heartbeats {p['heartbeats']}  (load {os.getloadavg()[0]:.1f})", flush=True)
    raw_m, mine_m = statistics.median(raws), statistics.median(mine)
    ratio = raw_m / mine_m
    print(json.dumps({"requests": args.requests, "line": args.line, "raw_requests_per_s": round(raw_m),
                      "pdcheck_requests_per_s": round(mine_m), "ratio": round(ratio, 2), "goal": 1.3}))
    print(f"pdcheck requests: {mine_m:.0f} req/s, raw NIXL loop: {raw_m:.0f} req/s, time per request "
          f"{ratio:.2f}x raw (goal <= 1.3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
