"""`pdcheck smoke`: every scenario of a directory against its [expect] table, for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdcheck.cliopts import Command
from pdcheck.commands import OUTPUT, RUN, Opt, emit, exit_codes, output_flags
from pdcheck.commands.handshake import HANG_TIMEOUT_S

EPILOG = f"""[bold]Examples[/]
  [dim]# CI: every bundled scenario against its expected outcome[/]
  pdcheck smoke --junit smoke.xml
  [dim]# your own scenarios (each with an \\[expect] table), as JSON[/]
  pdcheck smoke my-scenarios/ --json
  [dim]# quicker: no transfer proof[/]
  pdcheck smoke my-scenarios/ --no-transfer

{exit_codes("every expectation holds", "one does not")}"""


def register(app: typer.Typer) -> None:

    @app.command(cls=Command, epilog=EPILOG)
    @output_flags
    def smoke(
        directory: Annotated[Path | None, typer.Argument(
            metavar="DIRECTORY", show_default=False,
            help="Directory of scenario TOML files with expect tables (default: the bundled scenarios).")] = None,
        junit: Annotated[Path | None, Opt(metavar="FILE.xml", rich_help_panel=OUTPUT, show_default=False,
                                          help="Write JUnit XML here (GitHub/GitLab test reports).")] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout instead of the table.")] = False,
        transfer: Annotated[bool, Opt("--transfer/--no-transfer", metavar="", rich_help_panel=RUN,
                                      help="Prove verdicts with real NIXL READs.")] = True,
        hang_timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                           help="Seconds before a reply-less handshake counts as a hang.")
                                ] = HANG_TIMEOUT_S,
    ) -> None:
        """Run every scenario in DIRECTORY and check its expected outcome per release. Exit 0 only if all hold."""
        from pdcheck import bounds
        from pdcheck import smoke as sm
        from pdcheck.errors import BadInput
        from pdcheck.frameworks import Outcome, SmokeOptions
        from pdcheck.scenario import BUNDLED

        bounds.check_timeouts(hang_timeout)
        bounds.check_out_file("--junit", junit)  # before anything runs
        rep = sm.run(directory if directory is not None else BUNDLED,
                     SmokeOptions(transfer=transfer, hang_timeout_ms=int(hang_timeout * 1000)))
        if junit is not None:
            try:
                junit.write_bytes(sm.junit(rep))
            except OSError as exc:
                raise BadInput(f"--junit: cannot write {junit}: {exc.strerror}") from None
        emit("smoke", None, Outcome(rep.exit_code, rep, lambda con: sm.render(rep, con)), json_out)
