#!/usr/bin/env python3
"""Seed scenario end to end vs starting 16 bare NIXL agents in parallel, measured in one run.

Prints both figures and the ratio (target: <= 1.5). Each figure is the median of --repeat runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BARE = (
    "import sys\nfrom nixl_cu13._api import nixl_agent, nixl_agent_config\n"
    "nixl_agent(sys.argv[1], nixl_agent_config(enable_prog_thread=False, backends=['UCX']))\n"
)


def bare_agents(n: int) -> float:
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", BARE, f"bare{i}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for i in range(n)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def seed(args: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pdcheck", "handshake", str(ROOT / "scenarios/seed-19338-tp8.toml"),
                           "--json", *args], capture_output=True, cwd=ROOT)
    if proc.returncode not in (0, 1):
        sys.exit(f"pdcheck failed: {proc.stderr.decode()}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    base, full, hs = [], [], []
    for _ in range(a.repeat):
        base.append(bare_agents(16))
        full.append(seed([]))
        hs.append(seed(["--no-transfer"]))
    b, f, h = statistics.median(base), statistics.median(full), statistics.median(hs)
    print(f"16 bare NIXL agents in parallel : {b:.2f} s")
    print(f"seed 8P+8D, handshake+transfer  : {f:.2f} s   ratio {f / b:.2f}x (target <= 1.5x)")
    print(f"seed 8P+8D, --no-transfer        : {h:.2f} s   ratio {h / b:.2f}x")


if __name__ == "__main__":
    main()
