#!/usr/bin/env python3
"""Record what a pdcheck command shows on a real terminal: run it in a detached tmux window and snapshot the
screen (tmux capture-pane) every INTERVAL seconds until it exits. Writes the distinct frames, each stamped with the
seconds since start, to OUT, and prints how many frames showed progress before the report.

    python3 benchmarks/record_tmux.py docs/recordings/smoke.txt -- pdcheck smoke
    python3 benchmarks/record_tmux.py docs/recordings/requests.txt --interval 1 -- pdcheck requests ...
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--width", type=int, default=100)
    ap.add_argument("--height", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("command", nargs="+")
    args = ap.parse_args()
    if shutil.which("tmux") is None:
        sys.exit("record_tmux: no tmux here")
    name = f"pdcheck-rec-{uuid.uuid4().hex[:8]}"
    done = f"/tmp/{name}.rc"
    line = " ".join(shlex.quote(c) for c in args.command)
    # The window stays after the command so the last screen can be captured; the exit code goes to a file.
    tmux("new-session", "-d", "-s", name, "-x", str(args.width), "-y", str(args.height),
         f"{line}; echo $? > {done}; sleep 3600")
    frames: list[tuple[float, str]] = []
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.timeout:
            screen = tmux("capture-pane", "-p", "-t", name).rstrip()
            if not frames or frames[-1][1] != screen:
                frames.append((time.monotonic() - t0, screen))
            if Path(done).exists():
                screen = tmux("capture-pane", "-p", "-t", name).rstrip()
                if frames[-1][1] != screen:
                    frames.append((time.monotonic() - t0, screen))
                break
            time.sleep(args.interval)
        rc = Path(done).read_text().strip() if Path(done).exists() else "timeout"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
        Path(done).unlink(missing_ok=True)
    with args.out.open("w") as f:
        f.write(f"$ {line}\n# recorded with benchmarks/record_tmux.py: tmux {args.width}x{args.height}, a snapshot "
                f"of the screen every {args.interval:g} s when it changed; exit {rc} after "
                f"{time.monotonic() - t0:.1f} s\n")
        for t, screen in frames:
            f.write(f"\n----- t = {t:5.1f} s " + "-" * 60 + "\n" + screen + "\n")
    print(f"{args.out}: {len(frames)} frames over {time.monotonic() - t0:.1f} s, exit {rc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
