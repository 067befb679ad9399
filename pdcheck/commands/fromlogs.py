"""`pdcheck scenario from-logs`: a commented scenario out of two start-up logs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pdcheck.cliopts import Command, release_flags, scenario_flags
from pdcheck.commands import OUTPUT, RUN, SIGNALS, Opt, emit, output_flags

EPILOG = f"""[bold]Examples[/]
  [dim]# vLLM logs: write the scenario, then run it[/]
  pdcheck scenario from-logs prefill.log decode.log -o mine.toml
  pdcheck handshake mine.toml --vllm all
  [dim]# a field the logs lack, given as a flag; the DP rank 1 lines[/]
  pdcheck scenario from-logs p.log.gz d.log.gz --kv-heads 8 --dp-rank 1
  [dim]# SGLang servers' logs, for two SGLang releases[/]
  pdcheck scenario from-logs p.log d.log --sglang 0.5.8,0.5.23 -o sg.toml

Exit codes: 0 written, 2 bad input,
{SIGNALS}"""


def register(app: typer.Typer) -> None:

    @app.command("from-logs", cls=Command, epilog=EPILOG)
    @output_flags
    @scenario_flags
    @release_flags("from-logs")
    def scenario_from_logs(
        ctx: typer.Context,
        prefill_log: Annotated[Path, typer.Argument(metavar="PREFILL.log", show_default=False,
                                                    help="The prefill instance's start-up log (plain or .gz).")],
        decode_log: Annotated[Path, typer.Argument(metavar="DECODE.log", show_default=False,
                                                   help="The decode instance's start-up log (plain or .gz).")],
        *,
        overrides: dict[str, Any],
        output: Annotated[Path | None, Opt("--output", "-o", metavar="SCENARIO.toml", rich_help_panel=OUTPUT,
                                           show_default=False,
                                           help="Write the scenario here (default: stdout); an existing file "
                                                "only with --force.")] = None,
        force: Annotated[bool, Opt("--force", metavar="", rich_help_panel=OUTPUT,
                                   help="Let --output replace an existing file.")] = False,
        dp_rank: Annotated[int | None, Opt(metavar="N", rich_help_panel=RUN, show_default=False,
                                           help="Data-parallel rank to read when a log has several (default: "
                                                "the lowest).")] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout: the scenario, where each value came "
                                           "from, and what is missing.")] = False,
        releases: dict[str, str | None],
    ) -> None:
        """Read P/D geometry and per-rank num_blocks out of start-up logs and write a commented scenario.

        Flags fill in or override what the logs lack; the scenario runs with `pdcheck handshake SCENARIO`."""
        from pdcheck import bounds, frameworks, seam
        from pdcheck.errors import BadInput

        if output is not None and not force and (output.exists() or output.is_symlink()):
            raise BadInput(f"--output: {output} exists; pass --force to replace it")
        bounds.check_out_file("--output", output, force)
        from pdcheck.commands import framework_flags

        fw, rels = frameworks.pick(None, releases, "logs", command="from-logs")
        frameworks.check_flags(fw, "from-logs", framework_flags(ctx, ("json_out", "output", "force")))
        outcome = fw.from_logs(seam.FromLogsArgs(prefill_log=prefill_log, decode_log=decode_log,
                                                       releases=rels, overrides=overrides, output=output,
                                                       dp_rank=dp_rank))
        if output is not None and outcome.text is not None:
            bounds.write_out("--output", output, outcome.text.encode("utf-8"), force)
        emit("scenario from-logs", fw.name, outcome, json_out)
