"""`pdcheck smoke`: every scenario of a directory against its [expect] table, for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pdcheck.cliopts import Command
from pdcheck.commands import OUTPUT, RUN, Opt, emit, exit_codes, output_flags
from pdcheck.commands.handshake import HANG_TIMEOUT_S

SELECT = "Select"

EPILOG = f"""[bold]Examples[/]
  [dim]# CI: every bundled scenario against its expected outcome[/]
  pdcheck smoke --junit smoke.xml
  [dim]# your own scenarios (each with an \\[expect] table), as JSON[/]
  pdcheck smoke my-scenarios/ --json
  [dim]# quicker: no transfer proof[/]
  pdcheck smoke my-scenarios/ --no-transfer
  [dim]# only the SGLang scenarios; only the request-path ones[/]
  pdcheck smoke --framework sglang
  pdcheck smoke --phase requests
  [dim]# names containing "hetero", one scenario at a time[/]
  pdcheck smoke -k hetero -j 1

{exit_codes("every expectation holds", "one does not")}"""


# smoke's own flags; any other (--no-transfer) must be one every selected scenario's framework takes
OWN = ("junit", "json_out", "documents", "hang_timeout", "jobs", "framework", "phase", "name")


FRAMEWORK_HELP = ""  # --framework's help, naming the registered frameworks: set when the command is built


def register(app: typer.Typer) -> None:
    from pdcheck import frameworks

    global FRAMEWORK_HELP
    FRAMEWORK_HELP = f"Only this framework's scenarios ({', '.join(frameworks.names())}; repeatable)."

    @app.command(cls=Command, epilog=EPILOG)
    @output_flags
    def smoke(
        ctx: typer.Context,
        directory: Annotated[Path | None, typer.Argument(
            metavar="DIRECTORY", show_default=False,
            help="Directory of scenario TOML files with expect tables (default: the bundled scenarios).")] = None,
        junit: Annotated[Path | None, Opt(metavar="FILE.xml", rich_help_panel=OUTPUT, show_default=False,
                                          help="Write JUnit XML here (GitHub/GitLab test reports).")] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout instead of the table.")] = False,
        documents: Annotated[Path | None, Opt(metavar="DIR", rich_help_panel=OUTPUT, show_default=False,
                                              help="Also write each scenario's report there as NAME.json: the "
                                                   "document `pdcheck handshake|requests NAME --json` prints "
                                                   "(CI artifacts).")] = None,
        transfer: Annotated[bool, Opt("--transfer/--no-transfer", metavar="", rich_help_panel=RUN,
                                      help="Prove verdicts with real NIXL READs.")] = True,
        hang_timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                           help="Seconds before a reply-less handshake counts as a hang.")
                                ] = HANG_TIMEOUT_S,
        jobs: Annotated[int | None, Opt("--jobs", "-j", metavar="N", rich_help_panel=RUN, show_default=False,
                                        help="Scenarios (or their independent parts) run at once, their rank "
                                             "processes bounded by the cores (default: 5 per core; 1: one after "
                                             "another).")] = None,
        framework: Annotated[list[str] | None, Opt(metavar="NAME", rich_help_panel=SELECT, show_default=False,
                                                   help=FRAMEWORK_HELP)] = None,
        phase: Annotated[list[str] | None, Opt(metavar="PHASE", rich_help_panel=SELECT, show_default=False,
                                               help="Only scenarios of this phase: handshake or requests "
                                                    "(repeatable).")] = None,
        name: Annotated[list[str] | None, Opt("-k", metavar="TEXT", rich_help_panel=SELECT, show_default=False,
                                              help="Only scenarios whose name contains TEXT (repeatable: any "
                                                   "of them).")] = None,
    ) -> None:
        """Run every scenario in DIRECTORY and check its expected outcome per release. Exit 0 only if all hold."""
        from pdcheck import bounds, progress
        from pdcheck import smoke as sm
        from pdcheck.commands import framework_flags
        from pdcheck.scenariofile import BUNDLED
        from pdcheck.seam import SmokeOptions

        bounds.check_timeouts(hang_timeout)
        bounds.check_out_file("--junit", junit)  # before anything runs
        if documents is not None:
            bounds.check_out_dir("--documents", documents)
        n = sm.default_jobs() if jobs is None else jobs
        if not 1 <= n <= sm.MAX_JOBS:
            from pdcheck.errors import BadInput

            raise BadInput(f"--jobs: expected 1 to {sm.MAX_JOBS}, got {n}")
        select = sm.Select(tuple(framework or ()), tuple(phase or ()), tuple(name or ()),
                           tuple(framework_flags(ctx, OWN)))
        with progress.stderr_progress(enabled=not json_out) as tick:
            def on_case(case: sm.Case, done: int, total: int) -> None:
                tick("smoke cases", done, total, f"{case.scenario}")
                if not case.passed:
                    tick.line(f"FAIL {case.scenario} {case.release}: {case.message}")

            interrupted = False
            docs: list[sm.Document] = []
            try:
                rep = sm.run(directory if directory is not None else BUNDLED,
                             SmokeOptions(transfer=transfer, hang_timeout_ms=int(hang_timeout * 1000)), n, select,
                             on_case, docs if documents is not None else None)
            except sm.Interrupted as stop:
                rep, interrupted = stop.report, True
        if documents is not None:
            documents.mkdir(parents=True, exist_ok=True)
            sm.write_documents(documents, docs)
        _write(rep, junit, json_out, interrupted)


def _write(rep: Any, junit: Path | None, json_out: bool, interrupted: bool) -> None:
    """JUnit, then the table or --json (pdcheck.commands.emit), and exit: of every case, or (interrupted) of the
    scenarios that finished, with the signal's exit code."""
    from pdcheck import smoke as sm
    from pdcheck.seam import Outcome

    assert isinstance(rep, sm.SmokeReport)
    if interrupted:  # the run's exit code is the signal's (pdcheck.lifecycle), the document's too
        import msgspec

        from pdcheck import lifecycle
        from pdcheck.errors import EXIT_INTERRUPTED

        rep = msgspec.structs.replace(rep, exit_code=lifecycle.exit_code(EXIT_INTERRUPTED))
    if junit is not None:
        from pdcheck.bounds import write_out

        write_out("--junit", junit, sm.junit(rep))
    emit("smoke", None, Outcome(rep.exit_code, rep, lambda con: sm.render(rep, con, interrupted=interrupted)),
         json_out)
