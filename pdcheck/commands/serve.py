"""`pdcheck serve`: a scenario's fake prefill ranks for real decode instances, until a signal."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pdcheck.cliopts import Command, complete_scenario, release_flags, scenario_flags
from pdcheck.commands import OUTPUT, SIGNALS, Opt, output_flags

SERVE = "Serve"
EPILOG = f"""[bold]Examples[/]
  pdcheck serve seed-19338-tp8 --vllm 0.11.1 --port 5600
  [dim]# first stdout line: the ready document (endpoints, kv_transfer_params)[/]
  pdcheck serve --prefill-tp 2 --prefill-blocks 3008,2992 \\
      --vllm 0.26.0 --json
  [dim]# pdcheck's own decode ranks against it[/]
  pdcheck handshake --vllm 0.26.0 --decode-blocks 3000 \\
      --prefill-endpoint 127.0.0.1:PORT
  [dim]# SGLang: fake P ranks and their bootstrap server[/]
  pdcheck serve sglang-hetero-tp --sglang 0.5.8 --port 8998

Serves until a signal or --duration; every rank is reaped.
Exit codes: 0 --duration ended, 2 bad input, 3 harness failure,
{SIGNALS}"""


def register(app: typer.Typer) -> None:

    @app.command(cls=Command, epilog=EPILOG)
    @output_flags
    @scenario_flags
    @release_flags("serve", metavar="RELEASE", panel=SERVE)
    def serve(
        ctx: typer.Context,
        scenario: Annotated[Path | None, typer.Argument(
            metavar="SCENARIO", show_default=False, autocompletion=complete_scenario,
            help="A bundled scenario's name or a scenario TOML file; its \\[prefill] table is served.")] = None,
        *,
        overrides: dict[str, Any],
        releases: dict[str, str | None],
        port: Annotated[int | None, Opt(metavar="PORT", rich_help_panel=SERVE, show_default=False,
                                        help="Base side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT): rank r on "
                                             "PORT + r in per-worker eras (A-E), one scheduler port in F-H; "
                                             "default: OS-chosen.")] = None,
        tag_blocks: Annotated[int | None, Opt(metavar="N", rich_help_panel=SERVE, show_default=False,
                                              help="Coordinate-tag blocks [0, N) of every region (default: "
                                                   "4096).")] = None,
        duration: Annotated[float | None, Opt(metavar="SECONDS", rich_help_panel=SERVE, show_default=False,
                                              help="Stop after this many seconds (default: run until a signal).")
                            ] = None,
        api_port: Annotated[int | None, Opt(metavar="PORT", rich_help_panel=SERVE, show_default=False,
                                            help="Also answer GET /version on this port (0: OS-chosen), as vLLM's "
                                                 "API server does (for probe --vllm auto).")] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="The ready document as one JSON line on stdout.")] = False,
    ) -> None:
        """Serve a scenario's fake prefill ranks to real decode instances until Ctrl-C/SIGTERM."""
        from pdcheck import frameworks, seam
        from pdcheck.commands import framework_flags
        from pdcheck.scenariofile import read_toml

        scenario = frameworks.locate(scenario) if scenario is not None else None
        doc = read_toml(scenario) if scenario is not None else None
        fw, rels = frameworks.pick(doc, releases, str(scenario or "command line"), command="serve",
                                   one="serve one framework's prefill")
        frameworks.check_flags(fw, "serve", framework_flags(ctx, ("json_out", "duration")))
        raise typer.Exit(fw.serve(seam.ServeArgs(
            scenario=scenario, releases=rels, overrides=overrides, json_out=json_out, port=port,
            tag_blocks=tag_blocks, duration=duration, api_port=api_port)))
