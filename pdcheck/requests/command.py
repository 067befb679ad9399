"""`pdcheck requests`: the command layer (thin typer): flags and file -> plan (pdcheck.requests.plan) -> real run
(pdcheck.requests.run) -> report (pdcheck.requests.report)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pdcheck.requests.faults import NAMES

Opt = typer.Option
RUN = "Run"
LOAD = "Requests"
OUTPUT = "Output"

EPILOG = """[bold]Examples[/]
  [dim]# blocks freed before a slow decode reads them, per release, with the corrected path beside[/]
  pdcheck requests scenarios/requests/requests-freed-early.toml --vllm 0.9.1,0.11.1,0.34.0
  [dim]# no file: flags only[/]
  pdcheck requests --vllm 0.34.0 --requests 20 --rate 20 --lease 0.5 --fault slow-decode:1 --fault drop-notif:3
  [dim]# push mode (0.24+): D registers (PUSH_REG), P WRITEs; P's completion notification lost for request 2[/]
  pdcheck requests --vllm 0.24.0,0.34.0 --mode push --lease 0.5 --fault drop-notif:2
  [dim]# P replaced after handing out request 2's params; the timeline as a picture[/]
  pdcheck requests --vllm 0.11.1,0.34.0 --requests 5 --fault restart-p:2 --plot restart.png

Faults (--fault NAME[:ARGS][:REQ|:p=SHARE], repeatable; REQ: one request, p=SHARE: that fraction of them picked
by --seed, default every one): slow-decode:SECONDS, drop-notif, delay-notif:SECONDS,
bad-params:out-of-range|reused-ids|wrong-engine|missing-request-id|wrong-tp, drop-params, restart-p:REQ[:rank=R],
read-fail, hold:SECONDS, heartbeat-loss:SECONDS, abort-d. In push mode drop-notif and delay-notif hit P's
completion notification to D.

Exit codes: 0 every request of every release delivered or recomputed and no block leaked, 1 otherwise,
2 bad input, 3 harness failure."""


def register(app: Any) -> None:
    from pdcheck.cliopts import Command

    @app.command(cls=Command, epilog=EPILOG)
    def requests(
        scenario: Annotated[Path | None, typer.Argument(help="A requests-*.toml scenario (flags override it).",
                                                        metavar="[SCENARIO.toml]", show_default=False)] = None,
        *,
        vllm: Annotated[str | None, Opt(metavar="RELEASES", rich_help_panel=RUN, show_default=False,
                                        help="Release(s): 0.9.1, '0.9.1,0.34.0' or 'all' (default: the "
                                             "scenario's \\[expect] releases).")] = None,
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
                                               help=f"A fault ({', '.join(NAMES)}); repeatable.")] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout instead of tables.")] = False,
        plot: Annotated[Path | None, Opt(metavar="FILE", rich_help_panel=OUTPUT, show_default=False,
                                         help="Also draw P's blocks held over time and each request's latency "
                                              "per release (.png/.svg/.pdf; needs matplotlib: "
                                              "pdcheck\\[plot]).")] = None,
    ) -> None:
        """The request lifecycle after the handshake: real P and D ranks, real NIXL READs and notifications; a
        verdict per request per release, the corrected path beside it, P's block accounting."""
        plan = build_plan(scenario, vllm, {"requests": n_requests, "rate": rate, "lease": lease,
                                           "blocks_per_request": blocks_per_request, "pool": pool, "seed": seed,
                                           "failure_policy": failure_policy, "mode": mode}, fault or [])
        if plot is not None:
            from pdcheck import figure
            from pdcheck.requests import plot as plotting

            figure.check(plot)  # before anything runs
        rep = execute(plan)
        if plot is not None:
            plotting.write(rep, plot)
        if json_out:
            from pdcheck.envelope import write_json

            write_json("requests", "vllm", rep.exit_code, rep)
        else:
            from pdcheck.console import console
            from pdcheck.requests.report import render

            render(rep, console())
        raise typer.Exit(rep.exit_code)


def build_plan(scenario: Path | None, vllm: str | None, flags: dict[str, Any], faults: list[str]) -> Any:
    from pdcheck.requests.plan import build
    from pdcheck.scenario import read_toml

    doc = read_toml(scenario) if scenario is not None else {}
    return build(scenario, doc, vllm, flags, faults)


def execute(plan: Any) -> Any:
    from pdcheck.requests import report
    from pdcheck.requests.run import run

    return report.build(plan, run(plan.releases, plan.options))
