"""pdcheck on a pseudo-terminal (python's pty): what a user at a terminal sees, progress bars included."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT


class Pty:
    """pdcheck on a pseudo-terminal (stdin, stdout and stderr), its own session: what a user at a terminal sees."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        master, slave = pty.openpty()
        os.set_blocking(master, False)
        import fcntl
        import struct
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path), TERM="xterm-256color", COLUMNS="160")
        env.pop("NO_COLOR", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "pdcheck", *args], stdin=slave, stdout=slave,
                                     stderr=slave, cwd=ROOT, env=env, start_new_session=True)
        os.close(slave)
        self.master, self.text = master, ""

    def read(self, timeout: float = 0.2) -> str:
        r, _, _ = select.select([self.master], [], [], timeout)
        if r:
            try:
                while True:
                    chunk = os.read(self.master, 65536)
                    if not chunk:
                        break
                    self.text += chunk.decode(errors="replace")
            except (BlockingIOError, OSError):
                pass
        return self.text

    def wait_for(self, needle: str, timeout: float) -> float:
        """Seconds until `needle` appeared on the terminal."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if needle in self.read():
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"{needle!r} never appeared (exit {self.proc.poll()}): {self.read()[-3000:]!r}")

    def finish(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read()
        if self.proc.poll() is None:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout} s: {self.read()[-3000:]!r}")
        for _ in range(5):
            self.read(0.05)
        os.close(self.master)
        return self.proc.returncode


