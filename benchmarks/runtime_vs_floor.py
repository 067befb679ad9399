#!/usr/bin/env python3
"""`pdcheck handshake` vs a raw NIXL floor doing the same NIXL work, over a grid, in one run.

The floor is one fresh interpreter that imports NIXL and numpy once and forks T P and T D processes
(the cheapest way to get 2T agents). Each rank: one agent, num_regions anonymous mmaps registered, P sends
its metadata; each D rank, per modelled release (the scenario's one release plus `corrected`), calls
add_remote_agent for its P rank and prepares a remote dlist of num_blocks x regions descriptors, and with
the transfer a local dlist of the same size once; then P writes a pattern into the requested blocks of
every region, D READs them per request and compares. pdcheck runs the same scenario (`--json`), timed
end to end as a subprocess like the floor. Each figure is the median of --repeat runs.

Two floors: one with NIXL's and UCX's defaults (the floor the speed goal was set against), and one with the UCX
settings pdcheck's host-memory ranks run with (UCX_NET_DEVICES=lo, and UCX_MEM_EVENTS=no: UCX's memory hooks are
~90 % of an agent's start-up here and pdcheck does not need them), whose ratio counts pdcheck's own work only.

    python benchmarks/runtime_vs_floor.py [--repeat 1] [--tp 2 8] [--layers 1 32 80] [--large-layers 32]

Run it in a network namespace of your own when other pdcheck runs share the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL_BLOCKS, LARGE_BLOCKS = 1000, 111680
REQUESTS, BLOCKS_PER_REQUEST = 2, 32  # the scenario defaults pdcheck's transfer proof uses
RELEASES = 2  # "0.10.0" + corrected: one handshake each per D rank

SIDE = """[{side}]
engine_id = "floor-{e}"
tp_size = {{t}}
num_blocks = {{blocks}}
block_size = 16
layers = {{layers}}
kv_heads = {{t}}
head_dim = 128
dtype = "bfloat16"
"""
SCENARIO = ('name = "floor-t{t}-l{layers}-b{blocks}"\nvllm = ["0.10.0"]\n'
            + SIDE.format(side="prefill", e="p") + SIDE.format(side="decode", e="d"))
# What the `pdcheck` console script runs (pdcheck.__main__:main); an installed script may predate this tree.
PDCHECK = [sys.executable, "-m", "pdcheck"]
BLOCK_LEN = 16 * 1 * 128 * 2  # block_size x one local head x head_dim x bf16


# ------------------------------------------------------------------------------------------------ floor
def floor_main(t: int, layers: int, blocks: int, transfer: bool) -> None:
    import mmap
    import multiprocessing as mp

    import numpy as np
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value; pdcheck maps the same way
    regions = 2 * layers
    region_bytes = blocks * BLOCK_LEN
    req_blocks = [np.arange(q * BLOCKS_PER_REQUEST, (q + 1) * BLOCKS_PER_REQUEST) % blocks for q in range(REQUESTS)]

    def setup(name: str) -> tuple[object, list[np.ndarray], list[int]]:
        a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[]))
        a.create_backend("UCX", {})
        maps = [mmap.mmap(-1, region_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | NORESERVE)
                for _ in range(regions)]
        views = [np.frombuffer(mm, dtype=np.uint8) for mm in maps]
        addrs = [v.ctypes.data for v in views]
        a.register_memory(a.get_reg_descs([(x, region_bytes, 0, "") for x in addrs], "DRAM"))
        return a, views, addrs

    def dlist(addrs: list[int]) -> np.ndarray:
        offs = np.arange(blocks, dtype=np.uint64) * np.uint64(BLOCK_LEN)
        out = np.empty((regions * blocks, 3), dtype=np.uint64)
        out[:, 0] = np.concatenate([np.uint64(x) + offs for x in addrs])
        out[:, 1] = BLOCK_LEN
        out[:, 2] = 0
        return out

    def expected(rank: int, region: int, ids: np.ndarray) -> np.ndarray:
        words = BLOCK_LEN // 8
        base = (np.uint64(rank) << np.uint64(56)) | (np.uint64(region) << np.uint64(40))
        return (base | ids.astype(np.uint64)[:, None] << np.uint64(16) | np.arange(words, dtype=np.uint64)[None, :])

    def prefill(rank: int, conn: object) -> None:
        a, views, addrs = setup(f"fp{rank}")
        conn.send((a.get_agent_metadata(), addrs))
        if transfer:
            for ids in req_blocks:
                for r in range(regions):
                    views[r].view(np.uint64).reshape(blocks, -1)[ids] = expected(rank, r, ids)
            conn.send("tagged")
        while not conn.poll(0.001):  # progress the worker (UCX over TCP needs the target's) until stop
            a.get_new_notifs()

    def decode(rank: int, conn: object) -> None:
        a, views, addrs = setup(f"fd{rank}")
        local = a.prep_xfer_dlist("NIXL_INIT_AGENT", dlist(addrs), "DRAM") if transfer else None
        meta, p_addrs = conn.recv()
        ok = True
        for _ in range(RELEASES):
            name = a.add_remote_agent(meta)
            remote = a.prep_xfer_dlist(name, dlist(p_addrs), "DRAM")
            if not transfer:
                continue
            for ids in req_blocks:
                didx = (np.arange(regions)[:, None] * blocks + ids[None, :]).reshape(-1)
                h = a.make_prepped_xfer("READ", local, didx, remote, didx, b"floor")
                a.transfer(h)
                while a.check_xfer_state(h) == "PROC":
                    pass
                a.release_xfer_handle(h)
                for r in range(regions):
                    got = views[r].view(np.uint64).reshape(blocks, -1)[ids]
                    ok &= bool((got == expected(rank, r, ids)).all())
        conn.send(ok)

    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for role, fn in (("P", prefill), ("D", decode)):
        for r in range(t):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=fn, args=(r, child))
            p.start()
            pipes.append((role, r, parent))
            procs.append(p)
    metas = [conn.recv() for role, _r, conn in pipes if role == "P"]
    if transfer:
        for role, _r, conn in pipes:
            if role == "P":
                conn.recv()
    for role, r, conn in pipes:
        if role == "D":
            conn.send(metas[r])
    oks = [conn.recv() for role, _r, conn in pipes if role == "D"]
    for role, _r, conn in pipes:
        if role == "P":
            conn.send("stop")
    for p in procs:
        p.join()
    if not all(oks) or any(p.exitcode for p in procs):
        sys.exit("floor: a rank failed or read wrong bytes")


# ------------------------------------------------------------------------------------------------ driver
# What pdcheck's host-memory handshake ranks run with (nixlagent.confine_ucx, no_memory_hooks; __main__):
# the second floor gets the same, so that its ratio counts only pdcheck's own work.
SAME_UCX = {"UCX_NET_DEVICES": "lo", "UCX_MEM_EVENTS": "no", "OPENBLAS_NUM_THREADS": "1"}


def timed(cmd: list[str], ok: tuple[int, ...] = (0,), extra: dict[str, str] | None = None) -> float:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **(extra or {}))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, cwd=ROOT, env=env)
    dt = time.perf_counter() - t0
    if proc.returncode not in ok:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 32, 80])
    ap.add_argument("--large-layers", type=int, nargs="*", default=[32],
                    help="layers of the 111680-block points (80 needs ~20 GB of dlists at T=8)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--floor", nargs=4, type=int, metavar=("T", "LAYERS", "BLOCKS", "TRANSFER"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.floor:
        floor_main(*a.floor[:3], bool(a.floor[3]))
        return
    grid = [(t, n, SMALL_BLOCKS, x) for x in (False, True) for t in a.tp for n in a.layers]
    grid += [(t, n, LARGE_BLOCKS, x) for x in (False, True) for t in a.tp for n in a.large_layers]
    # As installed: pip compiles the bytecode; PYTHONDONTWRITEBYTECODE would otherwise make every pdcheck
    # run recompile its modules, which the floor's few lines never pay.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "pdcheck")], check=True,
                   stdout=subprocess.DEVNULL)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdcheck-floor-") as tmp:
        print(f"{'T':>2} {'layers':>6} {'blocks':>7} {'transfer':>8} {'floor s':>8} {'same-UCX floor s':>16} "
              f"{'pdcheck s':>9} {'ratio':>6} {'same-UCX ratio':>14}")
        for t, n, b, x in grid:
            sc = Path(tmp) / f"t{t}-l{n}-b{b}.toml"
            sc.write_text(SCENARIO.format(t=t, layers=n, blocks=b))
            fl, fs, pd = [], [], []
            floor = [sys.executable, __file__, "--floor", str(t), str(n), str(b), str(int(x))]
            for _ in range(a.repeat):
                fl.append(timed(floor))
                fs.append(timed(floor, extra=SAME_UCX))
                pd.append(timed([*PDCHECK, "handshake", str(sc), "--json",
                                 "--transfer" if x else "--no-transfer"], ok=(0, 1)))
            f, f2, p = statistics.median(fl), statistics.median(fs), statistics.median(pd)
            rows.append({"tp": t, "layers": n, "blocks": b, "transfer": x, "floor_s": f, "same_ucx_floor_s": f2,
                         "pdcheck_s": p, "ratio": p / f, "same_ucx_ratio": p / f2})
            print(f"{t:>2} {n:>6} {b:>7} {'yes' if x else 'no':>8} {f:>8.2f} {f2:>16.2f} {p:>9.2f} {p / f:>5.2f}x "
                  f"{p / f2:>13.2f}x", flush=True)
    worst = max(r["ratio"] for r in rows)
    worst2 = max(r["same_ucx_ratio"] for r in rows)
    print(f"worst ratio {worst:.2f}x against NIXL's defaults (goal <= 1.3x); {worst2:.2f}x against a floor with "
          f"pdcheck's UCX settings ({', '.join(f'{k}={v}' for k, v in SAME_UCX.items())})")
    if a.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
