#!/usr/bin/env python3
"""`pdcheck smoke` over every bundled scenario: wall time with -j N next to -j 1 (one at a time), in one run.

Prints both wall times (the whole command, start-up included), their ratio, the load average before and after
each run (the machine may be shared: a loaded machine gives pessimistic figures), and whether both runs gave the
same cases (scenario, release, expected, got, passed) in the same order and the same JUnit testcases. Target:
-j N within 60 s on 2 cores. Exit 1 when the two runs disagree.

    python3 benchmarks/smoke_wall.py              # -j default (5 per core) vs -j 1
    python3 benchmarks/smoke_wall.py -j 8 --skip-serial -- -k sglang
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.etree import ElementTree as ET

ROOT = Path(__file__).resolve().parent.parent
CPU: dict[int | None, float] = {}  # -j -> CPU seconds of the run (the command and its processes)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def smoke(jobs: int | None, extra: list[str], tmp: Path) -> tuple[float, dict, list[tuple[str, ...]], str, str]:
    """(wall seconds, --json document, JUnit testcases, load before, load after)."""
    junit = tmp / f"smoke-j{jobs or 'default'}.xml"
    cmd = [sys.executable, "-m", "pdcheck", "smoke", "--json", "--junit", str(junit), *extra]
    if jobs is not None:
        cmd += ["-j", str(jobs)]
    before = loadavg()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # pdcheck, its forkserver and every rank the forkserver reaped
    CPU[jobs] = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    if proc.returncode not in (0, 1):
        sys.exit(f"pdcheck smoke -j {jobs} exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    doc = json.loads(proc.stdout)
    (tmp / f"smoke-j{jobs or 'default'}.json").write_bytes(proc.stdout)
    tcs = [(tc.get("classname", ""), tc.get("name", ""), "fail" if tc.find("failure") is not None else "pass")
           for tc in ET.parse(junit).getroot().iter("testcase")]
    return wall, doc, tcs, before, loadavg()


def verdicts(doc: dict) -> list[tuple]:
    return [(c["framework"], c["scenario"], c["release"], tuple(c["expected"]), tuple(c["got"]), c["passed"])
            for c in doc["cases"]]


def failures(doc: dict) -> None:
    for c in doc["cases"]:
        if not c["passed"]:
            print(f"  FAIL {c['framework']} {c['scenario']} {c['release']}: {c['message']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=None, help="smoke's -j (default: its own)")
    ap.add_argument("--skip-serial", action="store_true", help="only the -j N run")
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's --json and JUnit in this directory")
    ap.add_argument("extra", nargs="*", help="more smoke arguments (after --)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="smoke-wall-") as tmp_dir:
        tmp = Path(tmp_dir) if a.keep is None else a.keep
        tmp.mkdir(parents=True, exist_ok=True)
        print(f"cores: {len(os.sched_getaffinity(0))}; load average (1, 5, 15 min) at start: {loadavg()}")
        par = smoke(a.jobs, a.extra, tmp)
        label = f"-j {a.jobs}" if a.jobs is not None else "-j default"
        print(f"smoke {label:<11}: {par[0]:6.1f} s wall, {len(par[1]['cases'])} cases, {par[1]['failed']} failed "
              f"{CPU[a.jobs]:.0f} CPU s (load {par[3]} -> {par[4]})")
        if a.skip_serial:
            return
        failures(par[1])
        ser = smoke(1, a.extra, tmp)
        print(f"smoke -j 1      : {ser[0]:6.1f} s wall, {len(ser[1]['cases'])} cases, {ser[1]['failed']} failed "
              f"{CPU[1]:.0f} CPU s (load {ser[3]} -> {ser[4]})")
        failures(ser[1])
        print(f"ratio           : {ser[0] / par[0]:.2f}x faster with {label}")
        same = verdicts(par[1]) == verdicts(ser[1]) and par[2] == ser[2]
        print(f"same cases and JUnit testcases: {'yes' if same else 'NO'}")
        if not same:
            for x, y in zip(verdicts(par[1]), verdicts(ser[1]), strict=False):
                if x != y:
                    print(f"  {label}: {x}\n  -j 1: {y}")
            sys.exit(1)


if __name__ == "__main__":
    main()
