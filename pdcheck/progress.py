"""Progress of a long run on stderr (rich), silent under --json or when stderr is not a terminal: the one
progress bar of every command.

The run calls `tick(stage, done, total)` (optionally with a note: what it is on now); each stage gets one
bar. handshake's stages in order: "ranks up", "side channels", "handshakes + transfer proof";
transfer-bench's: "transfer-bench rows"; requests': "release lines"; smoke's: "smoke cases".
`tick.line(text)` prints a line that stays above the bars (smoke: a failure as it happens). Until the first
tick a "starting" line with the elapsed time shows that the run is under way.
"""

from __future__ import annotations

import contextlib
import sys
import threading
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


_active: list[_Bars] = []


@contextlib.contextmanager
def stderr_progress(enabled: bool = True, *, refresh_thread: bool = True) -> Iterator[Tick]:
    """A tick callback drawing bars on stderr; a no-op unless `enabled` and stderr is a terminal.
    refresh_thread=False: redraw on ticks only (transfer-bench: no thread beside the measured ranks).
    Inside another stderr_progress (a command that opened it before planning), the same bars."""
    if _active:  # a command that showed progress from its start: the run below draws into the same bars
        yield _active[-1]
        return
    if not enabled or not on_terminal():
        yield _Noop()
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
    """Progress is drawn only on a terminal: nothing on a pipe or a file (CI logs, `2> log`)."""
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
