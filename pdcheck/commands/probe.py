"""`pdcheck probe`: read a live prefill's side channel (or bootstrap server), read-only."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pdcheck import bounds as b
from pdcheck.cliopts import Command, release_flags, scenario_flags
from pdcheck.commands import OUTPUT, SCENARIO, Opt, emit, exit_codes, output_flags

PROBE = "Probe"
EPILOG = f"""[bold]Examples[/]
  pdcheck probe p-node:5600 --vllm 0.11.1 --prefill-tp 8
  [dim]# hazards against a decode configuration (scenario and/or flags)[/]
  pdcheck probe p-node:5600 --vllm 0.26.0 --prefill-tp 4 \\
      --scenario my.toml --json
  [dim]# release read from P's API server before any side-channel request[/]
  [dim]# a prefill with 2 pipeline stages: every (pp_rank, tp_rank) asked[/]
  pdcheck probe p-node:5600 --vllm 0.34.0 --prefill-tp 2 --pp-size 2 \\
      --scenario pp2-prefill-only
  pdcheck probe p-node:5600 --vllm auto \\
      --version-url http://p-node:8000/version
  [dim]# an SGLang prefill's bootstrap server, its release read from it[/]
  pdcheck probe http://p-node:8998 --sglang auto

{exit_codes("ok", "the release fails (handshake's rule) or a reply is refused")}
Read-only: no memory registered, no block read."""


def register(app: typer.Typer) -> None:

    @app.command(cls=Command, epilog=EPILOG)
    @output_flags
    @scenario_flags
    @release_flags("probe", metavar="RELEASE", panel=PROBE)
    def probe(
        ctx: typer.Context,
        endpoint: Annotated[str, typer.Argument(
            metavar="HOST:PORT", show_default=False,
            help="P's side channel (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT; the base port, before any DP offset), "
                 "or an SGLang bootstrap server's http://HOST:PORT.")],
        *,
        overrides: dict[str, Any],
        releases: dict[str, str | None],
        decode_releases: Annotated[str | None, Opt("--decode-releases", "--decode-sglang", metavar="RELEASES",
                                                   rich_help_panel=PROBE, show_default=False,
                                                   help="The decode release(s) to check against P (default: "
                                                        "P's).")] = None,
        dp_rank: Annotated[int, Opt(metavar="N", rich_help_panel=PROBE,
                                    help="Which DP rank of P to ask (port offset as that release lays it out).")] = 0,
        dp_size: Annotated[int, Opt(metavar="N", rich_help_panel=PROBE,
                                    help="Ask N DP ranks from --dp-rank on, each at its own side-channel port, and "
                                         "check their engine ids (_dp<N>).")] = 1,
        pp_size: Annotated[int | None, Opt(metavar="N", rich_help_panel=PROBE, show_default=False,
                                           help="P's pipeline stages: from 0.26 each stage's metadata is asked "
                                                "under (pp_rank, tp_rank) (default: the scenario's prefill.pp_size, "
                                                "else 1; a stage P lacks kills its listener).")] = None,
        tp_size: Annotated[int | None, Opt("--tp-size", hidden=True, show_default=False,
                                           help="The same as --prefill-tp (the older spelling).")] = None,
        timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=PROBE,
                                      help="Seconds for each side-channel exchange, and for the whole "
                                           "--version-url request.")] = 2.0,
        max_tp: Annotated[int, Opt(metavar="N", rich_help_panel=PROBE,
                                   help="Most P ranks asked, and the largest tp_size accepted from P; up to "
                                        f"{b.HARD_MAX_TP}.")] = b.MAX_TP,
        version_url: Annotated[str | None, Opt(metavar="URL", rich_help_panel=PROBE, show_default=False,
                                               help="With --vllm auto: P's API server /version URL (read before "
                                                    "any side-channel request).")] = None,
        scenario: Annotated[Path | None, Opt(metavar="SCENARIO", rich_help_panel=SCENARIO, show_default=False,
                                             help="Scenario (a bundled name or a TOML file) whose \\[decode] table "
                                                  "(and kv_transfer_params) the hazards are evaluated against.")
                            ] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout instead of tables.")] = False,
    ) -> None:
        """Read a live prefill instance's side channel (read-only) and report its ranks and the hazards."""
        from pdcheck import frameworks, seam
        from pdcheck.commands import framework_flags
        from pdcheck.scenariofile import read_toml

        scenario = frameworks.locate(scenario) if scenario is not None else None
        fw, rels = frameworks.pick(read_toml(scenario) if scenario is not None else None, releases, "probe",
                                   command="probe", one="probe one framework's prefill")
        frameworks.check_flags(fw, "probe", framework_flags(ctx, ("json_out", "timeout", "scenario")))
        p_tp = overrides.get("prefill", {}).get("tp_size")  # --prefill-tp: P's TP size (default: discovered)
        outcome = fw.probe(seam.ProbeArgs(
            endpoint=endpoint, releases=rels, overrides=overrides, scenario=scenario, timeout=timeout,
            max_tp=max_tp, decode_releases=decode_releases, dp_rank=dp_rank, dp_size=dp_size, pp_size=pp_size,
            tp_size=p_tp if p_tp is not None else tp_size, version_url=version_url))
        emit("probe", fw.name, outcome, json_out)
