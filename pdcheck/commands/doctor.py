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
  [dim]# without Ray: a listener on every node, then every pair of them[/]
  pdcheck doctor --listen 0.0.0.0:7777 --keep-listening   [dim]# on each node[/]
  pdcheck doctor --matrix pdcheck-doctor.default.svc:7777   [dim]# anywhere[/]

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
                                               "printed on stderr; HOST an address or a name).")] = None,
        keep_listening: Annotated[bool, Opt("--keep-listening", rich_help_panel=PAIR,
                                            help="With --listen: serve one peer or --matrix pair after another "
                                                 "until stopped (a DaemonSet's pod), one report per pair.")] = False,
        peer: Annotated[str | None, Opt(metavar="HOST:PORT", rich_help_panel=PAIR, show_default=False,
                                        help="Run a real transfer with the `doctor --listen` at HOST:PORT (HOST "
                                             "an address, a host name or a Service's name).")] = None,
        advertise: Annotated[str | None, Opt(metavar="HOST:PORT", rich_help_panel=PAIR, show_default=False,
                                             help="With --listen: the address the peer is told to use after its "
                                                  "first exchange (behind NAT; default: the --listen address, or "
                                                  "this node's address for a bind-all one).")] = None,
        matrix: Annotated[str | None, Opt(metavar="HOST:PORT[,...]", rich_help_panel=PAIR, show_default=False,
                                          help="Every pair of these `--listen --keep-listening` listeners tests "
                                               "each other (every address of each HOST: a headless Service's "
                                               "name gives every pod); a matrix, broken pairs first.")] = None,
        ray: Annotated[str | None, Opt(metavar="ADDRESS", rich_help_panel=PAIR, show_default=False,
                                       help="The two-node check between nodes of this Ray cluster (HOST:PORT or "
                                            "auto): every pdcheck_prefill node x every pdcheck_decode node, or "
                                            "every pair of nodes without those resources; a matrix, slow and "
                                            "broken pairs first.")] = None,
        pairs: Annotated[int, Opt(metavar="N", rich_help_panel=PAIR,
                                  help="With --ray or --matrix: how many pairs run at a time.")] = 4,
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
        raise typer.Exit(_run(listen, peer, advertise, timeout, no_transfer, json_out, expect, ray, pairs, matrix,
                              keep_listening))


def _run(listen: str | None, peer: str | None, advertise: str | None, timeout: float, no_transfer: bool,
         json_out: bool, expect: str | None = None, ray: str | None = None, pairs: int = 4,
         matrix: str | None = None, keep_listening: bool = False) -> int:
    from pdcheck import bounds, frameworks, progress
    from pdcheck.doctor import addr, pair, run
    from pdcheck.errors import BadInput

    fws = frameworks.all_frameworks()  # their releases and environment rules are checked on this node
    if listen is not None and peer is not None:
        raise BadInput("--listen and --peer are exclusive: one node listens, the other dials it")
    modes = [f for f, v in (("--listen", listen), ("--peer", peer), ("--ray", ray), ("--matrix", matrix))
             if v is not None]
    if len(modes) > 1:
        raise BadInput(f"{modes[-1]}: not with {modes[0]} ({modes[-1]} runs every pair itself)" if modes[-1] in
                       ("--ray", "--matrix") else f"{modes[0]} and {modes[1]} are exclusive")
    if not 1 <= pairs <= 64:
        raise BadInput(f"--pairs: {pairs} is not from 1 to 64")
    if advertise is not None and listen is None:
        raise BadInput("--advertise: only with --listen")
    if keep_listening and listen is None:
        raise BadInput("--keep-listening: only with --listen")
    bounds.check_seconds("--timeout", timeout, bounds.PROBE_TIMEOUT_S)
    wanted = pair.parse_expect(expect)
    where = addr.parse_listen(listen) if listen is not None else None
    adv = addr.parse_advertise(advertise) if advertise is not None else None
    target = addr.parse_peer(peer) if peer is not None else None
    if wanted and where is None and target is None and ray is None and matrix is None:
        raise BadInput("--expect: only with --listen, --peer, --matrix or --ray (it judges a transfer between "
                       "nodes)")
    if ray is not None:
        from pdcheck.launcher import check_ray

        check_ray(ray)
        report = run.cluster_checks(fws, ray, pairs, timeout, wanted)
        return _emit(report, run.finish(report), json_out)
    if matrix is not None:
        listeners = addr.parse_matrix(matrix)
        report = run.matrix_checks(fws, listeners, matrix, pairs, timeout, wanted)
        return _emit(report, run.finish(report), json_out)
    if where is not None and keep_listening:
        return _keep_listening(where, adv, timeout, wanted, json_out)
    with progress.stderr_progress(enabled=not json_out, refresh_thread=False) as tick:
        report = run.node_checks(fws, multi_node=where is not None or target is not None, tick=tick,
                                 transfer=not no_transfer and where is None and target is None)
        t0, before = time.monotonic(), len(report.checks)
        if where is not None:
            report.mode = "listen"
            pair.listen(report, where, timeout, adv, wanted)
        elif target is not None:
            report.mode = "peer"
            pair.dial(report, target, timeout, wanted)
        took = time.monotonic() - t0
        for c in report.checks[before:]:
            c.seconds = round(took, 3)
        report.seconds = round(report.seconds + took, 3)
    return _emit(report, run.finish(report), json_out)


def _keep_listening(where: Any, adv: str | None, timeout: float, wanted: list[str], json_out: bool) -> int:
    """--listen --keep-listening: this node's checks once, then one report per pair served (a JSON line each with
    --json) until a signal ends the run (128 + the signal); a session that fails is one line on stderr."""
    import sys

    import msgspec

    from pdcheck import frameworks
    from pdcheck.doctor import pair, run
    from pdcheck.errors import one_line

    base = run.node_checks(frameworks.all_frameworks(), multi_node=True, transfer=False)
    base.mode = "listen"

    def on_session(n: int, served: Any, error: str | None) -> None:
        if served is None:
            sys.stderr.write(f"pdcheck doctor: session {n}: {one_line(error or 'no pair')}\n")
            sys.stderr.flush()
            return
        report = msgspec.structs.replace(base, checks=list(base.checks))
        pair.record(report, served)
        try:
            _emit(report, run.finish(report), json_out)
        except typer.Exit:
            pass

    pair.listen_forever(where, timeout, adv, wanted, on_session)
    return 0  # not reached: it serves until a signal


def _emit(report: Any, code: int, json_out: bool) -> int:
    from pdcheck.doctor.render import render
    from pdcheck.seam import Outcome

    emit("doctor", None, Outcome(code, report, lambda con: render(report, con)), json_out)
    return code
