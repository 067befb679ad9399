#!/usr/bin/env python3
"""The test suite's wall time on this machine next to its one-at-a-time time, in one run.

Runs the README's `pytest -q` (its console script, as a user does: the clone is not on sys.path) with
`--durations=0` (the project's addopts: pytest-xdist workers) and prints the wall time, the sum of every test's
setup + call + teardown (what one worker, one test at a time, would take at least), their ratio, the slowest tests
and the load average around the run (a shared machine gives pessimistic figures). `--beside` runs a second copy
of the suite at the same time, as a CI runner shared with another job does, and prints both copies' wall times.
Target: within 8 minutes on 2 cores beside a second copy. Exit 1 when the suite fails.

    python3 benchmarks/suite_wall.py               # the whole suite, the project's workers, alone
    python3 benchmarks/suite_wall.py --beside      # the same beside a second copy of itself
    python3 benchmarks/suite_wall.py -- -n 2 -m 'not ray'
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# pytest's --durations lines: "12.34s call     tests/test_x.py::test_y[id]"
DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*)$")


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list")
    ap.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "pdcheck-suite-wall.log",
                    help="where pytest's whole output goes (its failures, when there are any)")
    ap.add_argument("--beside", action="store_true", help="run a second copy of the suite at the same time")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args()
    # The console script next to this interpreter: `python -m pytest` would put the clone on sys.path.
    script = Path(sys.executable).with_name("pytest")
    pytest_cmd = [str(script)] if script.exists() else [shutil.which("pytest") or "pytest"]
    cmd = [*pytest_cmd, "-q", "-p", "no:cacheprovider", "--durations=0", "--durations-min=0", *args.pytest_args]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    before = loadavg()
    t0 = time.perf_counter()
    other = None
    if args.beside:  # the second copy: the same command, its output discarded, its wall time printed
        other = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    after = loadavg()
    other_wall = other_rc = None
    if other is not None:
        other_rc = other.wait()
        other_wall = time.perf_counter() - t0
    args.log.write_text(proc.stdout + proc.stderr)
    per_test: dict[str, float] = defaultdict(float)
    for line in proc.stdout.splitlines():
        m = DURATION.match(line)
        if m:
            per_test[m.group(3).strip()] += float(m.group(1))
    summary = next((ln for ln in reversed(proc.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", ln)), "?")
    serial = sum(per_test.values())
    print(f"suite: {summary.strip('= ')}")
    print(f"wall {wall:.1f} s (target 480 s) · one at a time >= {serial:.1f} s (sum of {len(per_test)} tests' "
          f"setup+call+teardown) · {serial / wall:.2f}x")
    if other is not None:
        print(f"beside a second copy of the suite: this copy {wall:.1f} s, the other {other_wall:.1f} s "
              f"(exit {other_rc})")
    print(f"load average before {before}, after {after}; {os.cpu_count()} CPUs")
    print(f"slowest {args.top}:")
    for name, secs in sorted(per_test.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {secs:6.2f} s  {name}")
    print(f"pytest's output: {args.log}")
    if proc.returncode != 0:
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        print("\n".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
