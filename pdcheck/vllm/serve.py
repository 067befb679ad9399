"""`pdcheck serve`: the fake prefill ranks of a scenario as a long-running instance a real decode can use.

The same rank bodies as `pdcheck handshake` (handshake_ranks.prefill_main, via the forkserver launcher): real NIXL
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
from typing import Any

import msgspec

from pdcheck import lifecycle
from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.envelope import write
from pdcheck.errors import HarnessError
from pdcheck.geometry import Geometry
from pdcheck.launcher import launcher
from pdcheck.progress import log_line
from pdcheck.vllm import drive
from pdcheck.vllm import messages as vm
from pdcheck.vllm.plan import ServePlan
from pdcheck.vllm.ranks import prefill_main
from pdcheck.vllm.releases import shapes
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.releases.params import block_ids_value, num_tokens, pull_keys
from pdcheck.vllm.scenario import Scenario


class Endpoint(msgspec.Struct):
    host: str
    port: int
    ranks: list[int]  # the P TP ranks this listener answers for
    stages: list[int] = msgspec.field(default_factory=lambda: [0])  # the P pipeline stages a request reaches here (releases.shapes: by era)


class ServedStage(msgspec.Struct):
    """One P pipeline stage as served: its layers and whether a request can reach its metadata (era H keys
    every stage by (pp_rank, tp_rank); before it a TP rank's port answers with one stage, shapes.served_stage)."""

    pp_rank: int
    layers: list[int]  # [first, end) model layers this stage holds (vLLM's get_pp_indices)
    regions: int  # the registered regions its metadata carries
    served: bool


class ServedRank(msgspec.Struct):
    tp_rank: int
    num_blocks: int
    device_id: int
    agent_name: str
    block_len: int
    regions: int
    tagged_blocks: int  # blocks [0, tagged_blocks) of every region hold coordinate tags


class Ready(msgspec.Struct):
    """The body of serve's ready document (--json, docs/json.md): written while serving, so the envelope's
    exit_code is null."""

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
    engine_tag: int  # the engine part of every coordinate tag (pdcheck.pattern.engine_tag)
    version_url: str | None = None  # --api-port: GET answers {"version": release} as vLLM's /version does
    dp_ranks: list[Ready] = []  # prefill.dp_size > 1: each DP rank's document (this one is DP rank 0's)
    pp_size: int = 1  # P's pipeline stages; each serves its own layers' metadata (stages)
    stages: list[ServedStage] = []  # pp_size > 1: every stage, in pp_rank order


def transfer_params(sc: Scenario, release: ReleaseModel, host: str, port: int, tag_blocks: int) -> dict[str, Any]:
    """kv_transfer_params as P's request_finished returns them in `release`, key for key (releases.params),
    with remote_block_ids naming tagged blocks. From 0.18 the block ids are one list per KV cache group (a
    single group here)."""
    p = sc.prefill
    n = min(4, tag_blocks, min(p.blocks()))
    v = release.number
    ids: list[int] = list(range(n))
    every: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": block_ids_value(v, [ids]), "remote_engine_id": p.engine_id,
        "remote_request_id": "pdcheck-serve-0", "remote_host": host, "remote_port": port, "tp_size": p.tp_size,
        "dcp_size": 1, "pp_size": p.pp_size,
        "remote_num_tokens": num_tokens(n, p.block_size),
        "remote_blocks_expiry_time": None,  # what a P node sends (only a D node exports an expiry)
        "remote_registration_generation": 0, "transfer_mode": "pull",
    }
    return {k: every[k] for k in pull_keys(v)}


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
                reserved.update(drive.reserve_layout(held, host, g.ports, contacted=False))
            ranks = {
                k * tp + r: lau.start("P", k * tp + r, prefill_main, msgspec.msgpack.encode(vm.PrefillSpec(
                    engine_id=g.scenario.prefill.engine_id, tp_rank=r, tp_size=tp, num_blocks=p.blocks()[r],
                    device_id=p.device_id(r), device=opts.device, host=host,
                    geometry=pg, kv_cache_layout=p.kv_cache_layout,
                    inject=vm.Inject(), log_requests=True, tag_blocks=opts.tag_blocks,
                    memory_layout=p.backend_layout, pp_size=p.pp_size)))
                for k, g in enumerate(groups) for r in range(tp)
            }
            ready = orc.await_ready(lau, list(ranks.values()), opts.start_timeout_s)
            for sock in reserved.values():
                sock.close()
            listeners = {k * tp + r: g.ports.listeners[r] for k, g in enumerate(groups) for r in range(tp)}
            for k in range(len(groups)):
                values = {r: ready[orc.RankId("P", k * tp + r)][1] for r in range(tp)}
                for r in range(tp):
                    ranks[k * tp + r].send(vm.Serve(listeners[k * tp + r], values))
            drive.await_serving(lau, ranks, listeners, opts.start_timeout_s)
            from pdcheck.pattern import engine_tag

            stages, reached = served_stages(release.wire, pg, p.pp_size)
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
                    event="ready", pid=os.getpid(), scenario=sc.name,
                    release=release.name, wire=release.wire, engine_id=gp.engine_id, host=host, base_port=base,
                    remote_port=rport, tp_size=tp, dp_rank=gp.dp_rank, compat_hash=chash,
                    endpoints=[Endpoint(host, ls.port, ls.ranks, reached) for r in range(tp)
                               for ls in listeners[k * tp + r]],
                    prefill_ranks=served,
                    kv_transfer_params=transfer_params(g.scenario, release, host, rport, opts.tag_blocks),
                    engine_tag=engine_tag(gp.engine_id),
                    version_url=None if api is None else f"http://{_bracket(host)}:{api.server_port}/version",
                    pp_size=p.pp_size, stages=stages))
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
                    if isinstance(msg, vm.PrefillFinal):
                        rank.done = True
                        dead = f"; listener died: {msg.listener_dead}" if msg.listener_dead else ""
                        notifs = f"; notifications: {', '.join(msg.notifs[:8])}" if msg.notifs else ""
                        log(f"{rank.label}: {msg.served} request(s) answered{_answered_by(rank, ranks, listeners)}"
                            f"{notifs}{dead}")
        # Leaving the launcher reaped every rank whatever happened above. A signal's exit (130, 143, 129) is
        # lifecycle.exit_code's, as for every command.
        return code
    finally:
        if api is not None:
            api.shutdown()
            api.server_close()


def served_stages(wire: str, g: Geometry, pp_size: int) -> tuple[list[ServedStage], list[int]]:
    """Every P stage as a listener of era `wire` serves it (shapes.stage_metadata cuts the metadata per stage),
    and the stages a request can reach: every one under (pp_rank, tp_rank) from era H, before it the one stage
    a TP rank's port answers with (shapes.served_stage)."""
    if pp_size <= 1:
        return [], [0]
    total = sum(gr.layers for gr in g.groups) if g.groups else g.layers
    reached = list(range(pp_size)) if wire >= shapes.PP_STAGES_KEYED else [shapes.served_stage(wire, pp_size)]
    return [ServedStage(s, list(shapes.pp_layers(total, pp_size, s)), len(shapes.stage_regions(g, pp_size, s)),
                        s in reached) for s in range(pp_size)], reached


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
        write("serve", "vllm", None, doc)
        return
    from pdcheck.console import console

    c = console()
    pp = f" x PP {doc.pp_size}" if doc.pp_size > 1 else ""
    c.print(f"[bold]pdcheck serve[/] {doc.scenario}: vLLM {doc.release} prefill (era {doc.wire}), engine "
            f"{doc.engine_id}, TP {doc.tp_size}{pp}, pid {doc.pid}")
    for d in doc.dp_ranks or [doc]:
        dp = f"DP rank {d.dp_rank} ({d.engine_id}): " if doc.dp_ranks else ""
        for e in d.endpoints:
            c.print(f"  {dp}side channel {e.host}:{e.port} answers for TP rank(s) {','.join(map(str, e.ranks))}")
    for st in doc.stages:
        first, end = st.layers
        where = (f"served under ({st.pp_rank}, r) for each TP rank r" if len(doc.endpoints[0].stages) > 1 else
                 "what each TP rank's port answers with" if st.served else
                 "never served: a request names a TP rank only and its port answers with another stage")
        c.print(f"  PP stage {st.pp_rank}: layers {first}..{end - 1} ({st.regions} region(s)); {where}")
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


def load_prefill(path: Path | None, overrides: dict[str, Any], read_toml: Any, load: Any) -> Scenario:
    """load() wants both sides; serve starts no decode, so a missing decode.num_blocks is filled in."""
    doc = read_toml(path) if path is not None else {}
    extra: dict[str, Any] = {}
    if "num_blocks" not in doc.get("decode", {}):
        extra["decode"] = {"num_blocks": 1}
    if "num_blocks" not in doc.get("prefill", {}) and "num_blocks" not in overrides.get("prefill", {}):
        from pdcheck.vllm.scenario import missing_blocks

        raise missing_blocks(str(path or "command line"), "prefill", named=path is not None)
    return load(path, {**overrides, **{k: {**overrides.get(k, {}), **v} for k, v in extra.items()}})


def _answered_by(rank: Any, ranks: dict[int, Any], listeners: dict[int, list[vm.ListenerSpec]]) -> str:
    """For a rank with no listener of its own (F-H: one listener per DP rank, on its first TP rank): whose port
    answers for it, so '0 request(s) answered' does not read as a rank nobody reached."""
    idx = next((i for i, r in ranks.items() if r is rank), None)
    if idx is None or listeners.get(idx):
        return ""
    owner = next(((i, ls) for i, lss in listeners.items() for ls in lss if idx in ls.ranks), None)
    if owner is None:
        return ""
    return f" (its metadata is served by P rank {owner[0]}'s listener :{owner[1].port}, counted there)"
