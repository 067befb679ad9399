"""`pdcheck requests`: the request lifecycle after the handshake, on real ranks (pdcheck.vllm.requests)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdcheck.cliopts import Command, complete_scenario, release_flags, shape_flags
from pdcheck.commands import OUTPUT, Opt, emit, exit_codes, output_flags

LOAD = "Requests"

EXAMPLES = """[bold]Examples[/]
  [dim]# blocks freed before a slow decode reads them, per release[/]
  pdcheck requests requests-freed-early --vllm 0.9.1,0.11.1,0.34.0
  [dim]# no file: flags only[/]
  pdcheck requests --vllm 0.34.0 --requests 20 --rate 20 --lease 0.5 \\
      --fault slow-decode:1 --fault drop-notif:3
  [dim]# on a shape: P TP 2 -> D TP 2, one P worker restarted[/]
  pdcheck requests --vllm 0.34.0 --prefill-tp 2 --decode-tp 2 \\
      --fault restart-p:2:rank=1
  [dim]# push mode (0.24+): D registers, P WRITEs; request 2's completion lost[/]
  pdcheck requests --vllm 0.24.0,0.34.0 --mode push --lease 0.5 \\
      --fault drop-notif:2
  [dim]# P replaced after handing out request 2's params; the timeline drawn[/]
  pdcheck requests --vllm 0.11.1,0.34.0 --requests 5 --fault restart-p:2 \\
      --plot restart.png"""
EXIT = exit_codes("every request delivered or recomputed, no block leaked", "otherwise")
FAULT_HELP = ""  # --fault's help: each framework's fault names (Support.help), set when the command is built


def register(app: typer.Typer) -> None:
    from pdcheck import frameworks

    global FAULT_HELP
    supports = [fw.commands["requests"] for fw in frameworks.supporting("requests")]
    FAULT_HELP = "A fault (" + "; ".join(s.help["fault"] for s in supports if "fault" in s.help) + "); repeatable."
    epilog = "\n\n".join([EXAMPLES, *(s.epilog for s in supports if s.epilog), EXIT])

    @app.command(cls=Command, epilog=epilog)
    @output_flags
    @release_flags("requests")
    @shape_flags
    def requests(
        ctx: typer.Context,
        scenario: Annotated[Path | None, typer.Argument(
            metavar="SCENARIO", show_default=False, autocompletion=complete_scenario,
            help="A bundled requests scenario's name or a requests TOML file (flags override it).")] = None,
        *,
        overrides: dict[str, dict[str, int]],
        releases: dict[str, str | None],
        n_requests: Annotated[int | None, Opt("--requests", metavar="N", rich_help_panel=LOAD, show_default=False,
                                              help="Requests per release (default 8).")] = None,
        rate: Annotated[float | None, Opt(metavar="QPS", rich_help_panel=LOAD, show_default=False,
                                          help="Arrivals per second (default 10).")] = None,
        lease: Annotated[float | None, Opt(metavar="SECONDS", rich_help_panel=LOAD, show_default=False,
                                           help="Abort timeout / lease for every release that has one (default: "
                                                "each release's own, 120-480 s).")] = None,
        blocks_per_request: Annotated[int | None, Opt(metavar="K", rich_help_panel=LOAD, show_default=False,
                                                      help="KV blocks per request (default 2).")] = None,
        pool: Annotated[int | None, Opt(metavar="B", rich_help_panel=LOAD, show_default=False,
                                        help="P's KV blocks (default 8).")] = None,
        failure_policy: Annotated[str | None, Opt(metavar="fail|recompute", rich_help_panel=LOAD, show_default=False,
                                                  help="kv_load_failure_policy of 0.13+ releases (default: each "
                                                       "release's own: recompute, fail from 0.17).")] = None,
        mode: Annotated[str | None, Opt(metavar="pull|push", rich_help_panel=LOAD, show_default=False,
                                        help="pull (default): D READs; push: D registers and P WRITEs "
                                             "(NixlPushConnector, 0.24+ only).")] = None,
        seed: Annotated[int | None, Opt(metavar="N", rich_help_panel=LOAD, show_default=False,
                                        help="Which requests a fault's p=SHARE picks (default 0).")] = None,
        fault: Annotated[list[str] | None, Opt(metavar="NAME[:ARGS]", rich_help_panel=LOAD, show_default=False,
                                               help=FAULT_HELP)] = None,
        time_scale: Annotated[float | None, Opt(metavar="K", rich_help_panel=LOAD, show_default=False,
                                                help="Run every length (arrival gaps, lease, fault seconds) K times "
                                                     "slower, 1-20, for a loaded machine; the verdicts stay the "
                                                     "same (default $PDCHECK_TIME_SCALE, else 1).")] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout instead of tables.")] = False,
        every: Annotated[bool, Opt("--all", metavar="", rich_help_panel=OUTPUT,
                                   help="List every request, not only the ones not delivered.")] = False,
        plot: Annotated[Path | None, Opt(metavar="FILE", rich_help_panel=OUTPUT, show_default=False,
                                         help="Also draw P's blocks held over time and each request's latency "
                                              "per release (.png/.svg/.pdf; needs matplotlib: "
                                              "pdcheck\\[plot]).")] = None,
    ) -> None:
        """The request lifecycle after the handshake: real P and D ranks, real NIXL READs and notifications; a
        verdict per request per release, the corrected path beside it, P's block accounting."""
        from pdcheck import frameworks, seam
        from pdcheck.commands import framework_flags
        from pdcheck.scenariofile import read_toml

        scenario = frameworks.locate(scenario) if scenario is not None else None
        fw, rels = frameworks.pick(read_toml(scenario) if scenario is not None else None, releases,
                                   str(scenario or "command line"), command="requests")
        frameworks.check_flags(fw, "requests", framework_flags(ctx, ("json_out",)))
        outcome = fw.requests(seam.RequestsArgs(
            scenario=scenario, releases=rels, overrides=overrides, faults=fault or [], json_out=json_out, plot=plot,
            every=every,
            flags={"requests": n_requests, "rate": rate, "lease": lease, "blocks_per_request": blocks_per_request,
                   "pool": pool, "seed": seed, "failure_policy": failure_policy, "mode": mode,
                   "time_scale": time_scale}))
        emit("requests", fw.name, outcome, json_out)
