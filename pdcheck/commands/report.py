"""`pdcheck report RUN.json`: a saved --json document rendered as Markdown or one HTML file (pdcheck.render)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdcheck.cliopts import Command
from pdcheck.commands import OUTPUT, SIGNALS, Opt

EPILOG = f"""[bold]Examples[/]
  [dim]# a run kept as JSON, then pasted into an issue[/]
  pdcheck doctor --json > doctor.json
  pdcheck report doctor.json --format markdown
  [dim]# one self-contained HTML file (no scripts, nothing fetched)[/]
  pdcheck report run.json --format html --output run.html

Exit codes: 0 rendered, 2 bad input (not a pdcheck --json document),
{SIGNALS}"""


def register(app: typer.Typer) -> None:

    @app.command(cls=Command, epilog=EPILOG)
    def report(
        document: Annotated[Path, typer.Argument(metavar="RUN.json", show_default=False,
                                                 help="A document written by any pdcheck command's --json.")],
        format_: Annotated[str, Opt("--format", metavar="markdown|html", rich_help_panel=OUTPUT,
                                    help="markdown: a summary line, the tables, versions and environment in a "
                                         "collapsed block, how to reproduce; html: the same as one "
                                         "self-contained file.")] = "markdown",
        output: Annotated[Path | None, Opt("--output", metavar="FILE", rich_help_panel=OUTPUT, show_default=False,
                                           help="Write the page here instead of stdout.")] = None,
        force: Annotated[bool, Opt("--force", metavar="", rich_help_panel=OUTPUT,
                                   help="Let --output be a symbolic link, written through.")] = False,
    ) -> None:
        """Render a saved --json document (any command's) as Markdown to paste into an issue, or as one HTML
        file. The document is validated first: its envelope must be pdcheck's, of this schema."""
        from pdcheck import bounds, envelope, render
        from pdcheck.errors import BadInput

        if format_ not in render.PAGES:
            raise BadInput(f"--format: {format_!r} is not one of {', '.join(render.PAGES)}")
        with bounds.forced_output(force):
            bounds.check_out_file("--output", output)
            data = bounds.read_file_bytes(document, "--json document", "give the file a --json run wrote",
                                          bounds.MAX_DOC_BYTES)
            doc = envelope.load(data, str(document))  # its depth and size bounded before it is decoded
            # The document's host, not this one: a saved run's environment is what the document says.
            render.write(doc, render.Output(format_, output), argv=None, source=str(document), host=False)
        raise typer.Exit(0)
