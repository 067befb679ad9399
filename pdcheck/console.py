"""The rich Console every command prints through: one home for how output is laid out.

On a terminal, rich's own width (the terminal's). Anywhere else (a pipe, a file, a CI log) nothing is wrapped:
rich would otherwise cut every line at 80 columns, splitting a sentence or a command in two and shortening
table headers, and a reader of a log has no window width to fit. COLUMNS, when set, still wins.
"""

from __future__ import annotations

import os
import sys
from typing import Any

UNWRAPPED = 100_000  # columns for output that is not a terminal: wide enough that nothing wraps


def console(stderr: bool = False, **kw: Any) -> Any:
    """A rich Console on stdout (or stderr). Imported here, lazily: a --json run never imports rich."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced stream
        tty = False
    if not tty and "width" not in kw and not os.environ.get("COLUMNS"):
        kw["width"] = UNWRAPPED
        kw.setdefault("soft_wrap", True)
    # No highlighter: it colours digits inside names ("seed-19338-tp8") and splits "0.9.1" into two colours;
    # what is coloured, the markup says.
    kw.setdefault("highlight", False)
    return Console(stderr=stderr, **kw)
