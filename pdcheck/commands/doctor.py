"""`pdcheck doctor`: the typer command (thin): flags -> run (pdcheck.doctor.run / pair) -> table or --json."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from pdcheck.commands import OUTPUT, RUN, Opt, emit, exit_codes, output_flags

PAIR = "Two nodes"

EPILOG = f"""[bold]Examples[/]
  [dim]# this node: versions, NIXL plugins, NICs, environment, a loopback transfer[/]
  pdcheck doctor
  [dim]# two nodes: a real transfer, the transport as UCX reports it on both ends[/]
  pdcheck doctor --listen 10.0.0.5:7777          [dim]# on node A[/]
  pdcheck doctor --peer 10.0.0.5:7777            [dim]# on node B[/]
  [dim]# a Ray cluster: every prefill x decode node pair, 4 at a time[/]
  pdcheck doctor --ray 10.0.0.1:6379 --pairs 4

{exit_codes("every check PASS, WARN or SKIP", "a check FAILs")}
Exit 3 also names a peer that is dead, silent, lies about its address or breaks
the protocol."""


def register(app: Any) -> None:
    from pdcheck.cliopts import Command

    @app.command(cls=Command, epilog=EPILOG)
    @output_flags
    def doctor(
        listen: Annotated[str | None, Opt(metavar="[HOST:PORT]", rich_help_panel=PAIR, show_default=False,
                                          help="Wait for one `doctor --peer` and serve it a real transfer "
                                               "(HOST:PORT, HOST, or '' for 127.0.0.1 on a port the OS picks, "
                                               "printed on stderr).")] = None,
        peer: Annotated[str | None, Opt(metavar="HOST:PORT", rich_help_panel=PAIR, show_default=False,
                                        help="Run a real transfer with the `doctor --listen` at HOST:PORT.")] = None,
        advertise: Annotated[str | None, Opt(metavar="HOST:PORT", rich_help_panel=PAIR, show_default=False,
                                             help="With --listen: the address the peer is told to use after its "
                                                  "first exchange (behind NAT; default: the --listen address, or "
                                                  "this node's address for a bind-all one).")] = None,
        ray: Annotated[str | None, Opt(metavar="ADDRESS", rich_help_panel=PAIR, show_default=False,
                                       help="The two-node check between nodes of this Ray cluster (HOST:PORT or "
                                            "auto): every pdcheck_prefill node x every pdcheck_decode node, or "
                                            "every pair of nodes without those resources; a matrix, slow and "
                                            "broken pairs first.")] = None,
        pairs: Annotated[int, Opt(metavar="N", rich_help_panel=PAIR,
                                  help="With --ray: how many pairs run at a time.")] = 4,
        expect: Annotated[str | None, Opt(metavar="TRANSPORT[,...]", rich_help_panel=PAIR, show_default=False,
                                          help="Two nodes: the transport or device the payload must use (rc, "
                                               "rc_mlx5, tcp, cma, cuda_ipc, sm, mlx5_2:1, eth0); FAIL when "
                                               "UCX carried it over anything else.")] = None,
        timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=PAIR,
                                      help="Two nodes: how long --listen waits for its peer, and each "
                                           "exchange's deadline.")] = 60.0,
        no_transfer: Annotated[bool, Opt("--no-transfer", rich_help_panel=RUN,
                                         help="Skip the loopback transfer (static checks only).")] = False,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                      help="One JSON document on stdout instead of the table.")] = False,
    ) -> None:
        """Can this node (or this pair of nodes) move KV with NIXL, and over which transport? Versions, NIXL
        plugins, RDMA ports, NICs and GPUs, the environment that breaks P/D, and a real transfer with the
        transfer proof, each check PASS, WARN, FAIL or SKIP with the fix in one line."""
        # Ctrl-C and SIGTERM are cli.main's (pdcheck.lifecycle): every launcher here closes in a finally.
        raise typer.Exit(_run(listen, peer, advertise, timeout, no_transfer, json_out, expect, ray, pairs))


def _run(listen: str | None, peer: str | None, advertise: str | None, timeout: float, no_transfer: bool,
         json_out: bool, expect: str | None = None, ray: str | None = None, pairs: int = 4) -> int:
    from pdcheck import bounds, progress
    from pdcheck.doctor import pair, run
    from pdcheck.errors import BadInput

    if listen is not None and peer is not None:
        raise BadInput("--listen and --peer are exclusive: one node listens, the other dials it")
    if ray is not None and (listen is not None or peer is not None):
        raise BadInput("--ray runs every pair itself: not with --listen or --peer")
    if not 1 <= pairs <= 64:
        raise BadInput(f"--pairs: {pairs} is not from 1 to 64")
    if advertise is not None and listen is None:
        raise BadInput("--advertise: only with --listen")
    bounds.check_seconds("--timeout", timeout, bounds.PROBE_TIMEOUT_S)
    where = pair.parse_listen(listen) if listen is not None else None
    target = pair.parse_peer(peer) if peer is not None else None
    wanted = pair.parse_expect(expect)
    if wanted and where is None and target is None and ray is None:
        raise BadInput("--expect: only with --listen, --peer or --ray (it judges a transfer between nodes)")
    if ray is not None:
        from pdcheck.launcher import check_ray

        check_ray(ray)
        report = run.cluster_checks(ray, pairs, timeout, wanted)
        return _emit(report, run.finish(report), json_out)
    with progress.stderr_progress(enabled=not json_out, refresh_thread=False) as tick:
        report = run.node_checks(multi_node=where is not None or target is not None, tick=tick,
                                 transfer=not no_transfer and where is None and target is None)
        t0, before = time.monotonic(), len(report.checks)
        if where is not None:
            report.mode = "listen"
            pair.listen(report, where, timeout, advertise, wanted)
        elif target is not None:
            report.mode = "peer"
            pair.dial(report, target, timeout, wanted)
        took = time.monotonic() - t0
        for c in report.checks[before:]:
            c.seconds = round(took, 3)
        report.seconds = round(report.seconds + took, 3)
    return _emit(report, run.finish(report), json_out)


def _emit(report: Any, code: int, json_out: bool) -> int:
    from pdcheck.doctor.render import render
    from pdcheck.seam import Outcome

    emit("doctor", None, Outcome(code, report, lambda con: render(report, con)), json_out)
    return code
