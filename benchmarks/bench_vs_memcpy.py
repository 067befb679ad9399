#!/usr/bin/env python3
"""transfer-bench with the best host-memory transport against the memcpy row of the same run.

Runs `pdcheck transfer-bench --transport best` (CMA zero-copy, UCX_CMA_SEG_SIZE=64m, error mode
none; pools in THP-backed private memory) on KV blocks of 1 MiB and more (Llama-3.1-8B heads,
4 layers so a transfer is 64 MiB) several times and prints, per block size, the KV READ GB/s, the
memcpy ceiling measured in the same run (same bytes, 1 thread, beyond the LLC) and their ratio.
Target: >= 0.9. Reported: the median over runs of the per-run ratio (this host drifts by tens of
percent over seconds, so a ratio inside one run is the fair figure).

    python benchmarks/bench_vs_memcpy.py [--reps 7] [--min-time 1.0] [--transport best|shm|default]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdcheck.bench.envinfo import wait_quiet  # noqa: E402

BLOCKS = "512,1024,2048"  # tokens per block: 1, 2 and 4 MiB blocks for 8 KV heads x 128 x bf16
ARGS = ["--model", "Llama-3.1-8B", "--layers", "4", "--tokens", "4096", "--block-size", BLOCKS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=1.0)
    ap.add_argument("--transport", default="best")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pdcheck.bench", "transfer-bench", *ARGS, "--transport", args.transport,
           "--min-time", str(args.min_time), "--json"]
    per: dict[int, list[tuple[float, float]]] = {}
    data = None
    for rep in range(args.reps):
        wait_quiet()  # this VM is shared: start each run on a quiet host
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
        if out.returncode not in (0, 1):
            raise SystemExit(f"transfer-bench failed ({out.returncode}): {out.stderr.strip()[-500:]}")
        data = json.loads(out.stdout)
        cells = []
        for r in data["rows"]:
            per.setdefault(r["block_bytes"], []).append((r["gbps"], r["memcpy_gbps"]))
            cells.append(f"{r['block_bytes'] >> 20} MiB {r['gbps']:5.2f}/{r['memcpy_gbps']:5.2f}="
                         f"{r['gbps'] / r['memcpy_gbps']:.2f} (#wrong {r['wrong']}, other CPU {r['foreign_cpu']:.2f})")
        print(f"rep {rep + 1}: " + "   ".join(cells), flush=True)
    assert data is not None
    print(f"transport: {args.transport}: {', '.join(data['transport']['data'])}; costs: "
          f"{'; '.join(data['transport']['costs']) or 'none'}")
    worst = float("inf")
    for block, xs in sorted(per.items()):
        kv = statistics.median(g for g, _ in xs)
        mc = statistics.median(m for _, m in xs)
        ratio = statistics.median(g / m for g, m in xs)
        best = max(xs)
        worst = min(worst, ratio)
        print(f"block {block >> 20} MiB: KV READ median {kv:5.2f} GB/s (best {best[0]:5.2f}), memcpy median "
              f"{mc:5.2f} GB/s, median per-run ratio {ratio:.3f}, best run {best[0] / best[1]:.3f}")
    print(f"worst median ratio {worst:.3f}: {'meets' if worst >= 0.9 else 'MISSES'} the 0.9 target "
          "(on a shared or noisy host look at the best runs too)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
