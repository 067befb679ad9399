"""--format markdown|html: a command's --json document rendered as a page to paste into an issue or keep as one
HTML file (docs/json.md, "Formats"). One page model (page.py) built from the document alone, two writers
(markdown.py, html.py). Which format a run asked for is set once by the command layer (pdcheck.commands'
output_flags) and read where every document is written (pdcheck.envelope.write)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

FORMATS = ("json", "markdown", "html")
PAGES = ("markdown", "html")


@dataclasses.dataclass(frozen=True)
class Output:
    format: str  # one of FORMATS
    path: Path | None = None  # --output: the page goes to this file instead of stdout
    # The host facts a page adds, beyond pdcheck's own (page.host_facts): each framework's distribution and the
    # prefixes of its environment variables (the command layer fills them from the registry).
    distributions: tuple[str, ...] = ()
    env_prefixes: tuple[str, ...] = ()


# The command line of the running command (pdcheck.cli.run sets it), for the page's "Reproduce" section.
ARGV: ContextVar[tuple[str, ...] | None] = ContextVar("pdcheck_argv", default=None)
_OUTPUT: ContextVar[Output | None] = ContextVar("pdcheck_output", default=None)


@contextlib.contextmanager
def selected(out: Output) -> Iterator[None]:
    token = _OUTPUT.set(out)
    try:
        yield
    finally:
        _OUTPUT.reset(token)


def current() -> Output | None:
    """The format the running command was asked for; None: plain --json (or none was asked)."""
    return _OUTPUT.get()


def render(doc: dict[str, Any], fmt: str, argv: tuple[str, ...] | None = None, source: str | None = None,
           host: bool = True, out: Output | None = None) -> str:
    """The page of one --json document. argv: the command line that wrote it (None for a saved document, whose
    page then says how to render it again); host: add this host's versions and UCX/NIXL variables (a live run:
    the host is the one that ran it)."""
    from pdcheck.render import html, markdown, page

    extra = out or Output(fmt)
    ctx = page.Context(argv=argv, source=source, host=page.host_facts(dict(os.environ), extra.distributions,
                                                                      extra.env_prefixes) if host else None)
    built = page.build(doc, ctx)
    return markdown.render(built) if fmt == "markdown" else html.render(built)


def write(doc: dict[str, Any], out: Output, argv: tuple[str, ...] | None = None, source: str | None = None,
          host: bool = True) -> None:
    """The page on stdout, or in out.path (then one line on stderr names it)."""
    text = render(doc, out.format, argv=argv, source=source, host=host, out=out)
    if out.path is not None:
        from pdcheck.bounds import write_out

        write_out("--output", out.path, text.encode("utf-8"))  # checked before the run (bounds.check_out_file)
        print(f"pdcheck: wrote {out.path}", file=sys.stderr)
        return
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()
