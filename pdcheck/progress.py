"""Progress of a long run on stderr (rich), silent under --json or when stderr is not a terminal.

The run calls `tick(stage, done, total)`; each stage gets one bar. Stages in order: "ranks up", "side channels",
"handshakes + transfer proof".
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

Tick = Callable[[str, int, int], None]


def _noop(stage: str, done: int, total: int) -> None:
    pass


@contextlib.contextmanager
def stderr_progress(enabled: bool = True) -> Iterator[Tick]:
    """A tick callback drawing bars on stderr; a no-op unless `enabled` and stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield _noop
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars: dict[str, int] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as prog:

        def tick(stage: str, done: int, total: int) -> None:
            if stage not in bars:
                bars[stage] = prog.add_task(stage, total=total)
            prog.update(bars[stage], completed=done, total=total)

        yield tick
