"""Process lifecycle of the pdcheck parent: signals, exit codes, and stopping the forkserver.

SIGINT, SIGTERM and SIGHUP all take the Ctrl-C path: the first one raises KeyboardInterrupt in the main
thread, so every `finally` runs (ranks terminated and reaped, sockets closed), multiprocessing's atexit
hooks remove their pymp-* directories, and the process exits 128 + the signal (130, 143, 129).
A signal that arrives while that cleanup runs is only recorded, so it cannot cut the cleanup short.
A signal the parent inherited as ignored (nohup, a background job without job control) stays ignored,
as POSIX tools do.

Ctrl-C in a terminal sends SIGINT to the whole process group, and `timeout`, `kill -TERM -PGID` and a systemd
unit send SIGTERM to it: the forkserver, the resource tracker and every rank get it too. They are started with
SIGINT, SIGTERM and SIGHUP ignored (spawn_quietly), so only the parent acts on it and stops them (the launcher
stops a rank with SIGKILL); otherwise each prints a traceback of its own, or dies before the parent has
stopped, and the parent reports a dead rank or forkserver (exit 3) instead of the signal.

A command that stops on its own terms (serve: it tells its ranks to stop and reports what they did) runs
its loop inside signals_recorded(): there a signal is recorded, not raised, and the exit is still 128 + it.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from pdcheck.errors import EXIT_HARNESS, EXIT_INTERRUPTED

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []


def _handler(signum: int, frame: FrameType | None) -> None:
    first = not _received
    _received.append(signum)
    if first:
        raise KeyboardInterrupt(signal.Signals(signum).name)


def install_signal_handlers(before: list[int] | None = None) -> None:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt once (see above). before: the signals the entry point's
    own first handler recorded before this module could be imported (pdcheck.__main__), kept as received."""
    for signum in before or ():
        if signum not in _received:
            _received.append(signum)
    for sig in HANDLED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _handler)


T = TypeVar("T")


def spawn_quietly(start: Callable[[], T]) -> T:
    """Run `start`, which spawns helper processes (multiprocessing's forkserver and resource tracker), with
    SIGINT, SIGTERM and SIGHUP ignored, so that they inherit them ignored, and so do the ranks the forkserver
    forks (it hands its children the dispositions it inherited). The signals are blocked meanwhile: one that
    arrives in the window is delivered to this process's own handler afterwards, not lost."""
    if threading.current_thread() is not threading.main_thread():
        return start()  # signal dispositions can only be changed from the main thread
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(HANDLED))
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in HANDLED}
    try:
        return start()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _record(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)


@contextmanager
def signals_recorded() -> Iterator[Callable[[], int | None]]:
    """Within the block SIGINT, SIGTERM and SIGHUP are recorded, not raised: the loop inside polls the yielded
    received() and stops on its own terms. The exit is 128 + the first signal all the same (exit_code), and one
    that arrives after the block only adds to the record. Ignored signals stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    old = {sig: signal.signal(sig, _record) for sig in HANDLED if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield received
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends (then they are delivered as usual): for a step that
    must not be cut in half, such as forking a rank and recording it for cleanup."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(HANDLED))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def guard_stdout() -> None:
    """Make stdout a stream that a reader going away cannot fail (`pdcheck ... --json | head -c1`): once the
    pipe is closed, what is written is dropped, so the run ends with its own exit code, without a
    BrokenPipeError traceback or interpreter's "Exception ignored" line at exit. A closed fd 1 (`>&-`) reads as
    /dev/null."""
    out = sys.stdout
    if out is None:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the process's stdout, for its lifetime
        return
    try:
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture): nothing to guard
        return
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_PipeOut(fd)), encoding=out.encoding, errors=out.errors,
                                  line_buffering=out.line_buffering)


class _PipeOut(io.RawIOBase):
    """fd 1, written until its reader goes away; after that what is written is dropped."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd, self.gone = fd, False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, b: Any) -> int:
        if not self.gone:
            try:
                return os.write(self.fd, b)
            except BrokenPipeError:
                self.gone = True
        return len(memoryview(b))


def received() -> int | None:
    """The first signal that interrupted this run, if any."""
    return _received[0] if _received else None


def exit_code(code: int) -> int:
    """An interrupted run exits 128 + the signal that stopped it; anything else keeps its code."""
    sig = received()
    if sig is not None and code in (EXIT_INTERRUPTED, 0, 1):
        return 128 + sig
    return code


def shutdown(code: int = 0) -> str | None:
    """The last step of every exit path, bounded in time: stop and reap every rank a launcher still holds (a
    command interrupted between starting a rank and the `try` that closes it leaves one, which would hold the
    resource tracker's pipe open and outlive this process), then the forkserver and its resource tracker now
    instead of when they notice we are gone (up to tens of seconds later under SIGTERM); remove the run's
    scratch directories. All idempotent, nothing is started here. Then the rank logs: returns a temporary log
    directory kept because the run failed as a harness (exit `code` 3)."""
    if "pdcheck.launcher" in sys.modules:
        launcher = sys.modules["pdcheck.launcher"]
        launcher.close_all()
        launcher.stop_forkserver()
    remove_scratch()
    kept = finish_rank_logs(code)
    return kept if kept is not None and _logs["temp"] else None


# ---------------------------------------------------------------------------------------------- scratch
# Temporary directories a command makes for its own use (a doctor pair's rank logs, the plugin probe's): the
# command removes each when done, and shutdown() removes whatever a signal kept it from removing.
_scratch: list[str] = []


def scratch_dir(prefix: str) -> Path:
    """A fresh temporary directory of this run, removed by remove_scratch(path) or at shutdown at the latest
    (created and recorded with signals held, so no interrupt falls between the two)."""
    import tempfile

    with signals_deferred(), _logs_lock:
        path = tempfile.mkdtemp(prefix=prefix)
        _scratch.append(path)
    return Path(path)


def remove_scratch(path: Path | str | None = None) -> None:
    """Remove one scratch directory (None: every one this run still has)."""
    import shutil

    with _logs_lock:
        paths = list(_scratch) if path is None else [str(path)]
        for p in paths:
            if p in _scratch:
                _scratch.remove(p)
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- rank logs
# Every local rank writes its fd 1 and 2 (NIXL's and UCX's native lines included) to its own file, so that an
# expected failure's C++ error lines do not reach the terminal. The files live in one directory per pdcheck
# run: the user's --log-dir (kept), or a temporary one removed at exit unless the run failed as a harness.
_logs: dict[str, Any] = {"root": None, "temp": False, "runs": []}
_logs_lock = threading.Lock()  # smoke's threads each start launchers


def keep_rank_logs(directory: Path) -> None:
    """Write this run's rank logs under `directory` and keep them (--log-dir)."""
    from pdcheck.errors import BadInput

    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"--log-dir: cannot create {directory}: {exc.strerror}") from None
    _logs.update(root=str(directory), temp=False)


def rank_log_dir() -> str:
    """A fresh directory for one launcher's rank logs (P0.log, D3.log, ...): the run's log directory for the
    first launcher of this process, run-2, run-3, ... beneath it for later ones (smoke runs many)."""
    import os
    import tempfile

    with _logs_lock:
        if _logs["root"] is None:
            _logs.update(root=tempfile.mkdtemp(prefix="pdcheck-logs-"), temp=True)
        runs: list[str] = _logs["runs"]
        path = _logs["root"] if not runs else os.path.join(_logs["root"], f"run-{len(runs) + 1}")
        os.makedirs(path, exist_ok=True)
        runs.append(path)
        return path


def rank_log_dirs() -> list[str]:
    """The directories rank_log_dir() handed out, oldest first."""
    return list(_logs["runs"])


def finish_rank_logs(code: int) -> str | None:
    """At exit: remove a temporary log directory, unless the run failed as a harness (exit 3) and a rank
    wrote something, the evidence. Returns the directory kept, if any (the user's --log-dir included)."""
    import shutil

    root = _logs["root"]
    if root is None:
        return None
    if _logs["temp"] and (code != EXIT_HARNESS or not _any_written()):
        shutil.rmtree(root, ignore_errors=True)
        _logs.update(root=None, temp=False, runs=[])
        return None
    return root


def _any_written() -> bool:
    import os

    for d in _logs["runs"]:
        try:
            if any(e.name.endswith(".log") and e.stat().st_size for e in os.scandir(d)):
                return True
        except OSError:
            continue
    return False


def native_errors(dirs: list[str]) -> dict[str, list[str]]:
    """NIXL's own (glog) error lines in these rank logs: message -> the ranks that logged it ('D0', 'P3').
    Timestamps, thread ids, per-call values (' at index ...') and agent names are dropped so repeats group."""
    import os
    import re

    line = re.compile(r"^[EF]\d{4} [\d:.]+\s+\d+ (\S+:\d+)\] (.*?)(?: at index .*)?$")
    found: dict[str, list[str]] = {}
    for d in dirs:
        try:
            names = sorted(n for n in os.listdir(d) if n.endswith(".log"))
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(d, name), errors="replace") as f:
                    for text in f:
                        hit = line.match(text)
                        if hit:
                            msg = re.sub(r" for agent '[^']*'", "", hit.group(2))
                            ranks = found.setdefault(f"{msg} ({hit.group(1)})", [])
                            if name[:-4] not in ranks:
                                ranks.append(name[:-4])
            except OSError:
                continue
    return found


# ---------------------------------------------------------------------------------------------- in a rank
_user_stderr: list[Any] = []  # in a rank: a stream on the stderr it was started with, before fd 2 went to its log


def rank_body(target: Callable[[Any, bytes], None], log: str, conn: Any, spec: bytes) -> None:
    """The body of every forked rank: point fd 1 and 2 at its own log file, then run target(conn, spec). A
    parent that went away (its end of the pipe closed: Ctrl-C, killed) ends the rank quietly; the log says so."""
    import os

    user = os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _user_stderr[:] = [open(user, "w", buffering=1)]  # noqa: SIM115 - lives as long as the rank
    try:
        target(conn, spec)
    except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
        os.write(2, f"pdcheck: the parent closed this rank's pipe ({type(exc).__name__}); exiting\n".encode())
        raise SystemExit(1) from None


def user_stderr() -> Any:
    """Where a line meant for the user goes (serve's request log): in a rank, the stderr it was started with
    (the terminal), not its log file; sys.stderr anywhere else."""
    return _user_stderr[0] if _user_stderr else sys.stderr
