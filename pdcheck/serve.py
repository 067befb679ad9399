"""`pdcheck serve`: the fake prefill ranks of a scenario as a long-running instance a real decode can use.

The same rank bodies as `pdcheck handshake` (ranks.prefill_main, via the forkserver launcher): real NIXL
agents, uneven num_blocks, the release's listener profile (wire era, port layout, compatibility hash). Blocks
are coordinate-tagged up front, since a real decode reads without asking; every request answered is logged
on stderr. The first stdout line (with --json) is the ready document: endpoints and kv_transfer_params.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from pdcheck import __version__, lifecycle
from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.bounds import MIN_BASE_PORT, SERVE_DURATION_S, check_seconds
from pdcheck.errors import BadInput, HarnessError
from pdcheck.launcher import launcher
from pdcheck.plan import TAG_BLOCKS, ServeOptions, ServePlan, build_serve
from pdcheck.progress import log_line
from pdcheck.ranks import prefill_main
from pdcheck.releases import resolve
from pdcheck.releases.base import ReleaseModel
from pdcheck.scenario import Scenario

Opt = typer.Option
SERVE = "Serve"
EPILOG = """[bold]Examples[/]
  pdcheck serve seed-19338-tp8 --vllm 0.11.1 --port 5600
  [dim]# first stdout line: the ready document (endpoints, kv_transfer_params)[/]
  pdcheck serve --prefill-tp 2 --prefill-blocks 3008,2992 --vllm 0.26.0 --json
  [dim]# pdcheck's own decode ranks against it[/]
  pdcheck handshake --vllm 0.26.0 --decode-blocks 3000 \\
      --prefill-endpoint 127.0.0.1:PORT

Serves until Ctrl-C (exit 130), SIGTERM (exit 143) or --duration (exit 0); every rank is reaped."""


class Endpoint(msgspec.Struct):
    host: str
    port: int
    ranks: list[int]  # the P TP ranks this listener answers for


class ServedRank(msgspec.Struct):
    tp_rank: int
    num_blocks: int
    device_id: int
    agent_name: str
    block_len: int
    regions: int
    tagged_blocks: int  # blocks [0, tagged_blocks) of every region hold coordinate tags


class Ready(msgspec.Struct):
    tool: str
    version: str
    event: str  # "ready"
    pid: int
    scenario: str
    release: str
    wire: str
    engine_id: str
    host: str
    base_port: int  # VLLM_NIXL_SIDE_CHANNEL_PORT as P would have it
    remote_port: int  # what kv_transfer_params carry: DP-offset base (A-E) or the scheduler port (F-H)
    tp_size: int
    dp_rank: int
    compat_hash: str | None
    endpoints: list[Endpoint]
    prefill_ranks: list[ServedRank]
    kv_transfer_params: dict[str, Any]
    engine_tag: int  # the engine part of every coordinate tag (pdcheck.kvcache.engine_tag)
    version_url: str | None = None  # --api-port: GET answers {"version": release} as vLLM's /version does
    dp_ranks: list[Ready] = []  # prefill.dp_size > 1: each DP rank's document (this one is DP rank 0's)


def _v(release: ReleaseModel) -> tuple[int, ...]:
    return tuple(int(x) for x in (release.version or release.versions[0]).split(".")[:3])


def transfer_params(sc: Scenario, release: ReleaseModel, host: str, port: int, tag_blocks: int) -> dict[str, Any]:
    """kv_transfer_params as P's request_finished returns them in `release`, key for key (read from the 0.13-0.34
    wheels; before 0.13 reference §2), with remote_block_ids naming tagged blocks. From 0.18 the block ids are
    one list per KV cache group (a single group here)."""
    p = sc.prefill
    n = min(4, tag_blocks, min(p.blocks()))
    v = _v(release)
    ids: list[int] = list(range(n))
    out: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": [ids] if v >= (0, 18, 0) else ids, "remote_engine_id": p.engine_id,
    }
    if v >= (0, 13, 0):
        out["remote_request_id"] = "pdcheck-serve-0"
    out.update(remote_host=host, remote_port=port)
    if v >= (0, 9, 2):
        out["tp_size"] = p.tp_size
    if v >= (0, 29, 0):
        out.update(dcp_size=1, pp_size=1)
    if v >= (0, 21, 0):
        out["remote_num_tokens"] = n * p.block_size  # P's num_computed_tokens: the tokens those blocks hold
    if v >= (0, 26, 0):
        out["remote_blocks_expiry_time"] = None  # what a P node sends (only a D node exports an expiry)
    if v >= (0, 33, 0):
        out["remote_registration_generation"] = 0
    if v >= (0, 28, 0):
        out["transfer_mode"] = "pull"
    return out


def run(sp: ServePlan, on_ready: Callable[[Ready], None], log: Callable[[str], None]) -> int:
    """Start P's ranks, call on_ready, serve until SIGTERM/SIGINT or duration. Returns the exit code."""
    sc, release, opts = sp.scenario, sp.release, sp.options
    p = sc.prefill
    host, base = p.host, sp.base_port  # the scenario's host, or --host (loopback by default)
    chash = sp.compat_hash
    pg = sp.p_geometry
    # sp.ports (each DP rank's, with dp_size > 1): base_port is set, so vLLM's layout ports are bound as they are
    stop: dict[str, str | None] = {"why": None}
    api = None
    try:
        if opts.api_port is not None:
            api = version_server(host, opts.api_port, release.name)
        with launcher() as lau, ExitStack() as held:
            # The layout ports are held from before any rank starts until just before the ranks bind them, so
            # no rank's UCX listener or connection takes one from the ephemeral range (orchestrate.reserve_layout).
            groups = sp.dp or [sp]  # DP rank k's TP rank r runs as P rank k * tp_size + r
            tp = p.tp_size
            reserved: dict[int, Any] = {}
            for g in groups:
                reserved.update(orc.reserve_layout(held, host, g.ports, contacted=False))
            ranks = {
                k * tp + r: lau.start("P", k * tp + r, prefill_main, msgspec.msgpack.encode(m.PrefillSpec(
                    engine_id=g.scenario.prefill.engine_id, tp_rank=r, tp_size=tp, num_blocks=p.blocks()[r],
                    device_id=p.device_id(r), device=opts.device, host=host,
                    geometry=pg, kv_cache_layout=p.kv_cache_layout,
                    inject=m.Inject(), log_requests=True, tag_blocks=opts.tag_blocks,
                    memory_layout=p.backend_layout)))
                for k, g in enumerate(groups) for r in range(tp)
            }
            ready = orc.await_ready(lau, list(ranks.values()), opts.start_timeout_s)
            for sock in reserved.values():
                sock.close()
            listeners = {k * tp + r: g.ports.listeners[r] for k, g in enumerate(groups) for r in range(tp)}
            for k in range(len(groups)):
                values = {r: ready[orc.RankId("P", k * tp + r)][1] for r in range(tp)}
                for r in range(tp):
                    ranks[k * tp + r].send(m.Serve(listeners[k * tp + r], values))
            orc.await_serving(lau, ranks, listeners, opts.start_timeout_s)
            from pdcheck.kvcache import engine_tag

            docs = []
            for k, g in enumerate(groups):
                gp = g.scenario.prefill
                served = [
                    ServedRank(tp_rank=r, num_blocks=p.blocks()[r], device_id=p.device_id(r),
                               agent_name=f"{gp.engine_id}-p{r}", block_len=pg.block_len, regions=pg.num_regions,
                               tagged_blocks=min(opts.tag_blocks, p.blocks()[r]))
                    for r in range(tp)
                ]
                rport = g.remote_port
                docs.append(Ready(
                    tool="pdcheck", version=__version__, event="ready", pid=os.getpid(), scenario=sc.name,
                    release=release.name, wire=release.wire, engine_id=gp.engine_id, host=host, base_port=base,
                    remote_port=rport, tp_size=tp, dp_rank=gp.dp_rank, compat_hash=chash,
                    endpoints=[Endpoint(host, ls.port, ls.ranks) for r in range(tp) for ls in listeners[k * tp + r]],
                    prefill_ranks=served,
                    kv_transfer_params=transfer_params(g.scenario, release, host, rport, opts.tag_blocks),
                    engine_tag=engine_tag(gp.engine_id),
                    version_url=None if api is None else f"http://{_bracket(host)}:{api.server_port}/version"))
            on_ready(msgspec.structs.replace(docs[0], dp_ranks=docs) if sp.dp else docs[0])
            # From here a signal stops the serving loop, which stops the ranks and says what they served.
            with lifecycle.signals_recorded() as signalled:
                deadline = None if opts.duration_s is None else time.monotonic() + opts.duration_s
                code = 0
                while stop["why"] is None and (deadline is None or time.monotonic() < deadline):
                    # Wake at least every 0.2 s to see a signal; a rank that ends on its own is a harness failure.
                    for rank, msg in lau.events(list(ranks.values()), time.monotonic() + 0.2):
                        if signalled() is not None:
                            break
                        if msg is None:
                            log(f"{rank.label} died (exit code {rank.proc.exitcode})")
                            stop["why"], code = "rank died", 3
                            break
                    if signalled() is not None and stop["why"] is None:
                        stop["why"] = signal.Signals(signalled()).name
                log(f"stopping ({stop['why'] or 'duration reached'})")
                live = [r for r in ranks.values() if not r.done]
                for rank in live:
                    rank.send(m.Stop())
                for rank, msg in lau.events(live, time.monotonic() + 5.0):
                    if isinstance(msg, m.PrefillFinal):
                        rank.done = True
                        dead = f"; listener died: {msg.listener_dead}" if msg.listener_dead else ""
                        notifs = f"; notifications: {', '.join(msg.notifs[:8])}" if msg.notifs else ""
                        log(f"{rank.label}: {msg.served} request(s) answered{notifs}{dead}")
        # Leaving the launcher reaped every rank whatever happened above. A signal's exit (130, 143, 129) is
        # lifecycle.exit_code's, as for every command.
        return code
    finally:
        if api is not None:
            api.shutdown()
            api.server_close()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def version_server(host: str, port: int, version: str) -> Any:
    """A thread answering GET /version with {"version": ...}, as vLLM's API server does; nothing else."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    body = msgspec.json.encode({"version": version})

    class Handler(BaseHTTPRequestHandler):
        timeout = 10  # seconds per read: a client that connects and sends nothing does not hold a thread forever

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") != "/version":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log_line(f"api {self.client_address[0]} {fmt % args}")

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    try:
        srv = Server((host, port), Handler)
    except OSError as exc:
        raise HarnessError(f"serve: --api-port: cannot bind {host}:{port}: {exc.strerror}") from None
    threading.Thread(target=srv.serve_forever, name="pdcheck-serve-api", daemon=True).start()
    return srv


# --------------------------------------------------------------------------------------------------- CLI
def _print_ready(doc: Ready, json_out: bool) -> None:
    if json_out:
        sys.stdout.buffer.write(msgspec.json.encode(doc) + b"\n")
        sys.stdout.flush()
        return
    from pdcheck.console import console

    c = console()
    c.print(f"[bold]pdcheck serve[/] {doc.scenario}: vLLM {doc.release} prefill (era {doc.wire}), engine "
            f"{doc.engine_id}, TP {doc.tp_size}, pid {doc.pid}")
    for d in doc.dp_ranks or [doc]:
        dp = f"DP rank {d.dp_rank} ({d.engine_id}): " if doc.dp_ranks else ""
        for e in d.endpoints:
            c.print(f"  {dp}side channel {e.host}:{e.port} answers for TP rank(s) {','.join(map(str, e.ranks))}")
    for r in doc.prefill_ranks:
        c.print(f"  P rank {r.tp_rank}: num_blocks {r.num_blocks}, device {r.device_id}, agent {r.agent_name}, "
                f"blocks 0..{r.tagged_blocks - 1} tagged")
    if doc.compat_hash:
        c.print(f"  compatibility hash {doc.compat_hash}")
    if doc.version_url:
        c.print(f"  {doc.version_url} answers {{\"version\": \"{doc.release}\"}}", highlight=False)
    c.print("  kv_transfer_params for a decode request:")
    c.print("  " + msgspec.json.encode(doc.kv_transfer_params).decode(), highlight=False, soft_wrap=True)
    c.print("[dim]serving; Ctrl-C or SIGTERM stops every rank[/]")
    sys.stdout.flush()


def register(app: Any) -> None:
    from pdcheck.cliopts import Command, scenario_flags

    @app.command(cls=Command, epilog=EPILOG)
    @scenario_flags
    def serve(
        scenario: Annotated[Path | None, typer.Argument(metavar="SCENARIO", help="Scenario TOML file; its \\[prefill] table is served.")
                            ] = None,
        *,
        overrides: dict[str, Any],
        vllm: Annotated[str | None, Opt(metavar="RELEASE", rich_help_panel=SERVE, show_default=False,
                                        help="The release P speaks (default: the scenario's prefill.vllm, else its "
                                             "first release).")] = None,
        port: Annotated[int | None, Opt(metavar="PORT", rich_help_panel=SERVE, show_default=False,
                                        help="Base side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT): rank r on "
                                             "PORT + r in per-worker eras (A-E), one scheduler port in F-H; "
                                             "default: OS-chosen.")] = None,
        tag_blocks: Annotated[int, Opt(metavar="N", rich_help_panel=SERVE,
                                       help="Coordinate-tag blocks [0, N) of every region.")] = TAG_BLOCKS,
        duration: Annotated[float | None, Opt(metavar="SECONDS", rich_help_panel=SERVE, show_default=False,
                                              help="Stop after this many seconds (default: run until a signal).")
                            ] = None,
        api_port: Annotated[int | None, Opt(metavar="PORT", rich_help_panel=SERVE, show_default=False,
                                            help="Also answer GET /version on this port (0: OS-chosen), as vLLM's "
                                                 "API server does (for probe --vllm auto).")] = None,
        json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel="Output",
                                      help="The ready document as one JSON line on stdout.")] = False,
        sglang: Annotated[str | None, Opt(metavar="RELEASE", rich_help_panel=SERVE, show_default=False,
                                          help="Serve fake SGLang P ranks of this release and their bootstrap "
                                               "server (--port: its port) instead of vLLM's.")] = None,
    ) -> None:
        """Serve a scenario's fake prefill ranks to real decode instances until Ctrl-C/SIGTERM."""
        from pdcheck.scenario import load, read_toml

        if sglang is not None:
            if vllm is not None:
                raise BadInput("--vllm and --sglang: serve one framework's prefill, not both")
            from pdcheck.sglang.serve import command

            raise typer.Exit(command(scenario, sglang, port, duration, json_out))

        sc = load_prefill(scenario, overrides, read_toml, load)
        name = vllm if vllm is not None else sc.prefill.vllm or sc.vllm[0]
        if "," in name or name.strip() in ("all", "corrected"):
            raise BadInput(f"--vllm: serve speaks one release, got {name!r}")
        release = resolve(name)
        if port is not None and not MIN_BASE_PORT <= port <= 65535:
            raise BadInput(f"--port: {port} is outside {MIN_BASE_PORT}-65535")
        if tag_blocks < 0:
            raise BadInput("--tag-blocks must be >= 0")
        if duration is not None:
            check_seconds("--duration", duration, SERVE_DURATION_S)  # nan would end the run at once
        if api_port is not None and not 0 <= api_port <= 65535:
            raise BadInput(f"--api-port: {api_port} is not a port")
        plan = build_serve(sc, release, ServeOptions(port=port, tag_blocks=tag_blocks, duration_s=duration,
                                                     api_port=api_port))
        code = run(plan, lambda doc: _print_ready(doc, json_out), log_line)
        raise typer.Exit(code)


def load_prefill(path: Path | None, overrides: dict[str, Any], read_toml: Any, load: Any) -> Scenario:
    """load() wants both sides; serve starts no decode, so a missing decode.num_blocks is filled in."""
    doc = read_toml(path) if path is not None else {}
    extra: dict[str, Any] = {}
    if "num_blocks" not in doc.get("decode", {}):
        extra["decode"] = {"num_blocks": 1}
    if "num_blocks" not in doc.get("prefill", {}) and "num_blocks" not in overrides.get("prefill", {}):
        raise BadInput(f"{path or 'command line'}: prefill.num_blocks: required (scenario key or --prefill-blocks)")
    return load(path, {**overrides, **{k: {**overrides.get(k, {}), **v} for k, v in extra.items()}})
