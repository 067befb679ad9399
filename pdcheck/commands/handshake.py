"""`pdcheck handshake`: fake (or live) P and D ranks run the modelled releases' handshake for real."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pdcheck.cliopts import Command, Device, complete_scenario, release_flags, scenario_flags
from pdcheck.commands import OUTPUT, RUN, SCENARIO, Opt, emit, exit_codes, output_flags

LIVE = "Live prefill"
HANG_TIMEOUT_S = 3.0  # handshake's and smoke's default
OWN = ("json_out", "hang_timeout", "timeout")  # flags every framework's handshake takes

EPILOG = f"""[bold]Examples[/]
  [dim]# have logs? start here, then run what it wrote[/]
  pdcheck scenario from-logs prefill.log decode.log -o mine.toml
  pdcheck handshake mine.toml --vllm all
  [dim]# a bundled scenario by name; one release: the per-rank report[/]
  pdcheck handshake seed-19338-tp8 --vllm 0.9.1
  [dim]# no scenario file: flags only[/]
  pdcheck handshake --prefill-tp 2 --decode-tp 2 \\
      --prefill-blocks 5808,5800 --decode-blocks 5800 --vllm 0.9.1
  [dim]# an SGLang scenario, every modelled SGLang release[/]
  pdcheck handshake sglang-hetero-tp --sglang all

{exit_codes("survives", "a hazard fires")}
Shell completion: pdcheck --install-completion (bash, zsh, fish, PowerShell)."""


def register(app: typer.Typer) -> None:

    @app.command(cls=Command, epilog=EPILOG)
    @output_flags
    @scenario_flags
    @release_flags("handshake")
    def handshake(
        ctx: typer.Context,
        scenario: Annotated[Path | None, typer.Argument(
            metavar="SCENARIO", show_default=False, autocompletion=complete_scenario,
            help="A bundled scenario's name or a scenario TOML file (flags override its keys).")] = None,
        *,
        overrides: dict[str, Any],
        from_logs: Annotated[tuple[Path, Path] | None, Opt(
            "--from-logs", metavar="P.log D.log", rich_help_panel=SCENARIO, show_default=False,
            help="Read the scenario from the two instances' vLLM start-up logs (as `pdcheck scenario from-logs`); "
                 "flags still override.")] = None,
        releases: dict[str, str | None],
        transfer: Annotated[bool, Opt("--transfer/--no-transfer", metavar="", rich_help_panel=RUN,
                                      help="Prove verdicts with real NIXL READs.")] = True,
        device: Device = "cpu",
        hang_timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                           help="Seconds before a reply-less handshake counts as a hang.")
                                ] = HANG_TIMEOUT_S,
        timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                      help="Seconds the whole run may take before ranks count as hung.")] = 120.0,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout instead of tables (no progress).")] = False,
        log_dir: Annotated[Path | None, Opt(metavar="DIR", rich_help_panel=OUTPUT, show_default=False,
                                            help="Keep each rank's log (its stdout and stderr, NIXL's and UCX's "
                                                 "own lines included) here as P0.log, D0.log, ... (default: a "
                                                 "temporary directory, removed unless the harness fails).")] = None,
        prefill_release: Annotated[str | None, Opt("--prefill-release", "--prefill-vllm", metavar="RELEASE",
                                                   rich_help_panel=LIVE, show_default=False,
                                                   help="The release the prefill runs (the scenario's prefill "
                                                        "release key): a cross-release pair, or the live P's "
                                                        "release with --prefill-endpoint.")] = None,
        prefill_endpoint: Annotated[str | None, Opt(metavar="HOST:PORT", rich_help_panel=LIVE, show_default=False,
                                                    help="A live P's side channel (e.g. pdcheck serve): no fake P; "
                                                         "its facts are probed, read-only.")] = None,
        inject: Annotated[list[str] | None, Opt(hidden=True,
                                                help="Test hooks: die:P1, mute:P1, corrupt:P0:1:17.")] = None,
        max_tp: Annotated[int, Opt(metavar="N", rich_help_panel=RUN,
                                   help="Most ranks per side (one process each); up to 256.")] = 64,
        ray: Annotated[str | None, Opt(metavar="ADDRESS", rich_help_panel=RUN, show_default=False,
                                       help="Run each rank as a Ray actor on this Ray cluster ('auto': the one "
                                            "this node belongs to): P on nodes with the pdcheck_prefill resource, "
                                            "D on pdcheck_decode ones (needs pdcheck\\[ray]).")] = None,
    ) -> None:
        """Start fake P and D ranks, run the modelled release's handshake for real, report per D rank."""
        from pdcheck import bounds, frameworks, progress, seam
        from pdcheck.commands import framework_flags
        from pdcheck.scenariofile import read_toml

        # Progress from the start: planning and the ranks' start-up come before the run's first stage.
        with progress.stderr_progress(enabled=not json_out):
            # Every check before any process starts: flags, file, releases, port layout, device.
            bounds.check_timeouts(hang_timeout, timeout)
            scenario = frameworks.locate(scenario) if scenario is not None else None
            doc = read_toml(scenario) if scenario is not None and from_logs is None else None
            fw, rels = frameworks.pick(doc, releases, str(scenario or "command line"))
            frameworks.check_flags(fw, "handshake", framework_flags(ctx, OWN))
            plan = fw.handshake_plan(seam.HandshakeArgs(
                scenario=scenario, releases=rels, overrides=overrides, hang_timeout=hang_timeout, timeout=timeout,
                json_out=json_out, transfer=transfer, device=device, max_tp=max_tp, from_logs=from_logs,
                prefill_release=prefill_release, prefill_endpoint=prefill_endpoint, inject=inject, ray=ray,
                log_dir=log_dir))
            outcome = fw.handshake_run(plan, show_progress=not json_out)
        emit("handshake", fw.name, outcome, json_out)
