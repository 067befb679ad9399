"""`pdcheck list [scenarios|releases]`: what is bundled (pdcheck.catalog), from any directory. (Not list.py: a
submodule named list would shadow the builtin inside the commands package.)"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from pdcheck.commands import OUTPUT, Opt, emit, output_flags

WHAT = ("scenarios", "releases")

EPILOG = """[bold]Examples[/]
  [dim]# every bundled scenario: name, framework, phase (the command that runs it), one line[/]
  pdcheck list scenarios
  [dim]# every modelled release range and the line it runs, per framework[/]
  pdcheck list releases --json

Exit codes: 0 listed, 2 bad input."""


def _complete_what(incomplete: str) -> list[str]:
    return [w for w in WHAT if w.startswith(incomplete)]


def register(app: typer.Typer) -> None:
    from pdcheck.cliopts import Command

    @app.command("list", cls=Command, epilog=EPILOG)
    @output_flags
    def list_(
        what: Annotated[str | None, typer.Argument(
            metavar="[scenarios|releases]", show_default=False, autocompletion=_complete_what,
            help="What to list (default: both).")] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout instead of tables.")] = False,
    ) -> None:
        """The bundled scenarios (name, framework, phase, one line; run one by name: pdcheck handshake NAME or
        pdcheck requests NAME) and the modelled releases per framework with the line each maps to."""
        from pdcheck import catalog
        from pdcheck.errors import BadInput
        from pdcheck.suggest import did_you_mean

        if what is not None and what not in WHAT:
            raise BadInput(f"list: {what!r}: name scenarios or releases{did_you_mean(what, WHAT)}")
        body = catalog.Catalog(catalog.scenarios() if what in (None, "scenarios") else [],
                               catalog.releases() if what in (None, "releases") else [])
        from pdcheck.seam import Outcome

        emit("list", None, Outcome(0, body, lambda con: render(body, con, what)), json_out)


def render(body: Any, con: Any, what: str | None = None) -> None:
    from rich import box
    from rich.table import Table

    if what in (None, "scenarios"):
        # One table per framework and phase, two columns: a third and fourth column beside a 42-character name
        # left the description a few characters on an 80-column terminal, cut mid-word.
        groups: dict[tuple[str, str], list[Any]] = {}
        for s in body.scenarios:
            groups.setdefault((s.framework, s.phase), []).append(s)
        for (framework, phase), rows in groups.items():
            t = Table(title=f"{framework} {phase} scenarios ({len(rows)}; run one: pdcheck {phase} NAME)",
                      title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, highlight=False)
            t.add_column("name", no_wrap=True)
            t.add_column("what it reproduces", overflow="fold", ratio=1)
            for s in rows:
                t.add_row(s.name, s.description)
            con.print(t)
    if what in (None, "releases"):
        t = Table(title="Modelled releases and the line each runs",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, highlight=False)
        for col in ("framework", "releases", "line it runs"):
            t.add_column(col, no_wrap=True)
        prev = ""
        for r in body.releases:
            t.add_row(r.framework if r.framework != prev else "", r.releases, r.line)
            prev = r.framework
        con.print(t)
