"""Progress of a long run on stderr (rich bars on a terminal, a plain line every PIPED_EVERY_S elsewhere),
silent under --json: the one progress of every command.

The run calls `tick(stage, done, total)` (optionally with a note: what it is on now); each stage gets one
bar. handshake's stages in order: "ranks up", "side channels", "handshakes + transfer proof";
transfer-bench's: "transfer-bench rows"; requests': "release lines"; smoke's: "smoke cases".
`tick.line(text)` prints a line that stays above the bars (smoke: a failure as it happens). Until the first
tick a "starting" line with the elapsed time shows that the run is under way.

On a pipe or a file (a CI log) there are no bars: one plain line at least every PIPED_EVERY_S seconds of a run
that lasts that long, `pdcheck: 20 s: smoke cases 14/79 (note)`, so a log shows the run is alive; a shorter run
prints none.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol


class Tick(Protocol):
    def __call__(self, stage: str, done: int, total: int, note: str = "") -> None: ...

    def line(self, text: str) -> None: ...


class _Noop:
    def __call__(self, stage: str, done: int, total: int, note: str = "") -> None:
        pass

    def line(self, text: str) -> None:
        pass


class _Bars:
    """The bars of one run: one per stage, added at its first tick."""

    def __init__(self, prog: Any, redraw: bool) -> None:
        self.prog, self.redraw = prog, redraw
        self.bars: dict[str, Any] = {}
        # Shown at once, before the first stage reports (forkserver, imports, rank start-up)
        self.starting: Any = prog.add_task("starting", total=None, note="")
        self.lock = threading.Lock()  # smoke ticks from its worker threads' results, serve from several

    def __call__(self, stage: str, done: int, total: int, note: str = "") -> None:
        with self.lock:
            if self.starting is not None:
                self.prog.remove_task(self.starting)
                self.starting = None
            if stage not in self.bars:
                self.bars[stage] = self.prog.add_task(stage, total=total, note=note)
            self.prog.update(self.bars[stage], completed=done, total=total, note=note)
            if self.redraw:
                self.prog.refresh()

    def line(self, text: str) -> None:
        with self.lock:
            self.prog.console.print(text, highlight=False, markup=False)


PIPED_EVERY_S = 10.0  # a line at least this often on a pipe (the bound: CI logs silent for a minute)


class _Lines:
    """Progress on a pipe: the latest stage as one line every PIPED_EVERY_S seconds, from a thread (or, without
    one, at the first tick after the interval)."""

    def __init__(self, thread: bool) -> None:
        self.start = time.monotonic()
        self.state = "starting"
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.due = self.start + PIPED_EVERY_S
        self.thread = threading.Thread(target=self._loop, name="pdcheck-progress", daemon=True) if thread else None
        if self.thread is not None:
            self.thread.start()

    def _write(self, text: str) -> None:
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stderr: progress is not worth an error
            pass

    def _emit(self) -> None:
        with self.lock:
            now = time.monotonic()
            self.due = now + PIPED_EVERY_S
            self._write(f"pdcheck: {now - self.start:.0f} s: {self.state}")

    def _loop(self) -> None:
        while not self.done.wait(max(0.0, self.due - time.monotonic())):
            if time.monotonic() >= self.due:
                self._emit()

    def __call__(self, stage: str, done: int, total: int, note: str = "") -> None:
        with self.lock:
            self.state = f"{stage} {done}/{total}" + (f" ({note})" if note else "")
        if self.thread is None and time.monotonic() >= self.due:
            self._emit()

    def line(self, text: str) -> None:
        with self.lock:
            self._write(text)

    def close(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()


_active: list[Any] = []


@contextlib.contextmanager
def stderr_progress(enabled: bool = True, *, refresh_thread: bool = True) -> Iterator[Tick]:
    """A tick callback drawing bars on stderr; a no-op unless `enabled` and stderr is a terminal.
    refresh_thread=False: redraw on ticks only (transfer-bench: no thread beside the measured ranks).
    Inside another stderr_progress (a command that opened it before planning), the same bars."""
    if _active:  # a command that showed progress from its start: the run below draws into the same bars
        yield _active[-1]
        return
    if not enabled:
        yield _Noop()
        return
    if not on_terminal():
        lines = _Lines(refresh_thread)
        _active.append(lines)
        try:
            yield lines
        finally:
            _active.remove(lines)
            lines.close()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pdcheck.console import console

    # The one console: a case's note or line (a scenario's name, a failure's message) is shown, never acted on.
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=console(stderr=True), transient=True,
                  auto_refresh=refresh_thread) as prog:
        bars = _Bars(prog, not refresh_thread)
        prog.refresh()
        _active.append(bars)
        try:
            yield bars
        finally:
            _active.remove(bars)


def on_terminal() -> bool:
    """Bars are drawn only on a terminal; a pipe or a file (CI logs, `2> log`) gets _Lines."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def log_line(text: str, command: str = "serve") -> None:
    """One timestamped line on stderr, `HH:MM:SS pdcheck <command>: text`: the one writer of the log lines a
    long-running command prints as it goes (serve's per-request lines, from the parent and its ranks)."""
    import time

    from pdcheck.lifecycle import user_stderr

    out = user_stderr()  # in a rank: the terminal, not the rank's log file (serve's request log is for the user)
    out.write(f"{time.strftime('%H:%M:%S')} pdcheck {command}: {text}\n")
    out.flush()
