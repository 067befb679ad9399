"""Progress of a long run on stderr (rich), silent under --json or when stderr is not a terminal: the one
progress bar of every command.

The run calls `tick(stage, done, total)` (optionally with a note: what it is on now); each stage gets one
bar. handshake's stages in order: "ranks up", "side channels", "handshakes + transfer proof";
transfer-bench's: "transfer-bench rows".
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Protocol


class Tick(Protocol):
    def __call__(self, stage: str, done: int, total: int, note: str = "") -> None: ...


def _noop(stage: str, done: int, total: int, note: str = "") -> None:
    pass


@contextlib.contextmanager
def stderr_progress(enabled: bool = True, *, refresh_thread: bool = True) -> Iterator[Tick]:
    """A tick callback drawing bars on stderr; a no-op unless `enabled` and stderr is a terminal.
    refresh_thread=False: redraw on ticks only (transfer-bench: no thread beside the measured ranks)."""
    if not enabled or not sys.stderr.isatty():
        yield _noop
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars: dict[str, int] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                  auto_refresh=refresh_thread) as prog:

        def tick(stage: str, done: int, total: int, note: str = "") -> None:
            if stage not in bars:
                bars[stage] = prog.add_task(stage, total=total, note=note)
            prog.update(bars[stage], completed=done, total=total, note=note)
            if not refresh_thread:
                prog.refresh()

        yield tick


def log_line(text: str, command: str = "serve") -> None:
    """One timestamped line on stderr, `HH:MM:SS pdcheck <command>: text`: the one writer of the log lines a
    long-running command prints as it goes (serve's per-request lines, from the parent and its ranks)."""
    import time

    from pdcheck.lifecycle import user_stderr

    out = user_stderr()  # in a rank: the terminal, not the rank's log file (serve's request log is for the user)
    out.write(f"{time.strftime('%H:%M:%S')} pdcheck {command}: {text}\n")
    out.flush()
