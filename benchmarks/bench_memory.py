"""transfer-bench's memory, computed before anything is allocated (pdcheck.bench.plan.memory_need) next to what
the run really takes: the peak of the summed RSS of pdcheck and every process of its session (the forkserver
and the ranks), sampled every 20 ms from /proc. The computed figure must stay above the measured one: it is
what `transfer-bench` checks against the machine before allocating (docs/reliability.md, "Input bounds").

    python benchmarks/bench_memory.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pdcheck.bench.command import parse_list
from pdcheck.bench.models import resolve_shape
from pdcheck.bench.plan import BenchConfig, memory_need, row_sizes
from pdcheck.bench.transport import preset

# The smallest blocks (128 B), so that block tables and descriptors weigh as much as the KV pools.
SHAPE = ["--model", "custom", "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--dtype", "fp8"]
CASES = [
    ["--tokens", "16384", "--requests", "64", "--block-size", "16"],
    ["--tokens", "65536", "--requests", "256", "--block-size", "16"],
    ["--tokens", "16384", "--requests", "1024", "--block-size", "16,32"],
    ["--tokens", "262144", "--requests", "32", "--block-size", "16"],
]


def computed(args: list[str]) -> int:
    o = dict(zip(args[::2], args[1::2], strict=True))
    cfg = BenchConfig(shape=resolve_shape(None, layers=1, kv_heads=1, head_dim=8, dtype="fp8"),
                      block_sizes=parse_list("--block-size", o["--block-size"]),
                      tokens=parse_list("--tokens", o["--tokens"]), transport=preset("default"),
                      requests=int(o["--requests"]))
    pools, meta = memory_need(cfg, *row_sizes(cfg))
    return pools + meta


def session_rss(sid: int) -> int:
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:
                continue
            with open(f"/proc/{d}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def measured(args: list[str]) -> int:
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "transfer-bench", *SHAPE, *args, "--iters", "20",
                             "--warmup", "1", "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, session_rss(proc.pid))
        time.sleep(0.02)
    return peak


def main() -> None:
    print(f"{'flags':<60} {'computed':>10} {'measured':>10}")
    for args in CASES:
        c, m = computed(args), measured(args)
        print(f"{' '.join(args):<60} {c / 2**20:>8.0f} MB {m / 2**20:>8.0f} MB {'ok' if c >= m else 'UNDER'}")


if __name__ == "__main__":
    main()
