"""The rich Console every command prints through: one home for how output is laid out.

On a terminal, rich's own width (the terminal's). Anywhere else (a pipe, a file, a CI log) nothing is wrapped:
rich would otherwise cut every line at 80 columns, splitting a sentence or a command in two and shortening
table headers, and a reader of a log has no window width to fit. COLUMNS, when set to a number, still wins
(at least MIN_WIDTH: rich prints nothing at 0 and one letter per line at 1); any other value is ignored.

Every string it renders passes through pdcheck.render.text first: a control character (ESC, BEL, CR, ...) in a
peer's value, a file or a flag shows as its escape and never reaches the terminal raw (docs/reliability.md,
"Pages, terminals and error lines"). And it prints under any stdout encoding (fit_streams).
"""

from __future__ import annotations

import codecs
import functools
import os
import sys
from typing import Any

UNWRAPPED = 100_000  # columns for output that is not a terminal: wide enough that nothing wraps
MIN_WIDTH = 40  # columns: a narrower COLUMNS is raised to this
ERRORS = "pdcheck-fallback"  # the codec error handler fit_streams sets on a stream that is not UTF-8

# What pdcheck's own text uses beyond ASCII, spelled in ASCII where the stream's encoding lacks it.
_ASCII = {"…": "...", "—": "-", "–": "-", "·": "-", "×": "x", "→": "->", "←": "<-", "≥": ">=", "≤": "<=",
          "≠": "!=", "µ": "u", "✓": "ok", "✗": "x", "•": "*", "─": "-", "│": "|", "‘": "'", "’": "'", "“": '"',
          "”": '"', "²": "^2", "³": "^3", "±": "+/-", "°": " deg"}


def _fallback(exc: UnicodeError) -> tuple[str, int]:
    """A character the stream cannot encode: its ASCII spelling when pdcheck's text uses it, else its escape."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = []
    for c in exc.object[exc.start:exc.end]:
        alt = _ASCII.get(c)
        out.append(alt if alt is not None else c.encode("ascii", "backslashreplace").decode("ascii"))
    return "".join(out), exc.end


codecs.register_error(ERRORS, _fallback)


def fit_streams() -> None:
    """stdout and stderr print whatever pdcheck writes, under any encoding (LC_ALL=C, PYTHONIOENCODING=latin-1 or
    ascii:strict): a stream that is not UTF-8 writes a character it lacks in ASCII or as its escape instead of
    raising UnicodeEncodeError. UTF-8 streams are left as they are."""
    for stream in (sys.stdout, sys.stderr):
        enc = getattr(stream, "encoding", None)
        try:
            utf8 = enc is not None and codecs.lookup(enc).name == "utf-8"
        except LookupError:
            utf8 = False
        if not utf8 and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors=ERRORS)
            except (ValueError, OSError):  # a closed or detached stream: nothing will be written to it
                pass


def columns() -> int | None:
    """COLUMNS as a width when it is a number (at least MIN_WIDTH); None when unset or not a number."""
    text = os.environ.get("COLUMNS", "").strip()
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        return None
    return max(MIN_WIDTH, int(text))


@functools.cache
def _console_class() -> Any:
    from rich.console import Console
    from rich.segment import Segment

    from pdcheck.render.text import visible

    class SafeConsole(Console):
        def render_str(self, text: str, **opts: Any) -> Any:
            # Every str rich renders (a print, a table cell, a title) comes here, before it is measured: what
            # pdcheck did not write cannot reach the terminal as a control sequence, and columns still line up.
            # pdcheck's own line breaks and tabs are kept.
            return super().render_str(visible(text, keep="\n\t"), **opts)

        def _render_buffer(self, buffer: Any) -> str:
            # The net under it: a Text built directly (not through render_str) is made visible here, segment by
            # segment; rich's own control segments (cursor moves of a live display) and the styles' colour
            # codes are rich's, added after this.
            return super()._render_buffer(
                seg if seg.control else Segment(visible(seg.text, keep="\n"), seg.style, seg.control)
                for seg in buffer)

    return SafeConsole


def console(stderr: bool = False, **kw: Any) -> Any:
    """A rich Console on stdout (or stderr). Imported here, lazily: a --json run never imports rich."""
    fit_streams()
    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced stream
        tty = False
    width = columns()
    if "width" not in kw:
        if width is not None:
            kw["width"] = width
        elif not tty:
            kw["width"] = UNWRAPPED
            kw.setdefault("soft_wrap", True)
        elif os.environ.get("COLUMNS") is not None:  # set, but not a width: the terminal's own
            try:
                kw["width"] = max(MIN_WIDTH, os.get_terminal_size(stream.fileno()).columns)
            except (OSError, ValueError):
                kw["width"] = 80
    # No highlighter: it colours digits inside names ("seed-19338-tp8") and splits "0.9.1" into two colours;
    # what is coloured, the markup says.
    kw.setdefault("highlight", False)
    return _console_class()(stderr=stderr, **kw)
