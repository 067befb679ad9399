"""`pdcheck serve --trtllm ERA`: fake TensorRT-LLM ctx ranks of one Python wire era and their info endpoint, for a
real gen (its disagg params naming this ctx_info_endpoint) or for `pdcheck handshake --trtllm ERA
--prefill-endpoint tcp://HOST:PORT`, until a signal or --duration. Every block of every ctx rank is tagged with
the coordinate pattern; a REQUEST_DATA is served from the ctx's blocks 0 .. n-1 for the gen's n blocks, whatever
its request id (a real ctx serves the session its prefill made)."""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from pdcheck import bounds, lifecycle
from pdcheck import messages as m
from pdcheck import orchestrate as orch
from pdcheck.envelope import write
from pdcheck.errors import EXIT_OK, BadInput, HarnessError
from pdcheck.launcher import launcher
from pdcheck.trtllm import eras
from pdcheck.trtllm.ctx import ctx_main
from pdcheck.trtllm.messages import TrtCtxDone, TrtCtxSpec, TrtCtxUp, TrtLine, TrtPeers, TrtReady
from pdcheck.trtllm.runner import _stage
from pdcheck.trtllm.scenario import load


class Served(msgspec.Struct):
    framework: str
    era: str
    info_endpoint: str  # what a gen's disaggregated params carry as ctx_info_endpoint
    ctx_ranks: int
    tp_size: int
    pp_size: int
    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    event: str = "ready"  # as vLLM's ready document: a script waits for one shape, whatever the framework
    pid: int = 0  # the serving process (signal it to stop)


def _port_free(port: int) -> None:
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    except OSError as exc:
        raise BadInput(f"--port: cannot bind 127.0.0.1:{port}: {exc.strerror}") from None
    finally:
        s.close()


def command(scenario: Path | None, releases: str | None, overrides: dict[str, Any], port: int | None,
            duration_s: float | None, json_out: bool) -> int:
    sc = load(scenario, overrides)
    text = releases or sc.ctx.trtllm or sc.trtllm[0]
    if "," in text or text.strip() == "all":
        raise BadInput(f"--trtllm: serve speaks one era, got {text!r}")
    line = eras.resolve(text, "--trtllm").line
    if line.runtime == "cpp":
        raise BadInput(f"--trtllm: {line.name} runs the C++ transceiver: serve fakes the Python ctx (its info "
                       "endpoint); the C++ RequestInfo encoding was not read (docs/trtllm-protocol.md T59)")
    if port is not None:
        if not 1024 <= port <= 65535:
            raise BadInput(f"--port: {port} is outside 1024-65535")
        _port_free(port)
    if duration_s is not None:
        bounds.check_seconds("--duration", duration_s, bounds.SERVE_DURATION_S)
    side = sc.ctx.side()
    finals: dict[int, Any] = {}
    name = str(uuid.uuid4())  # an instance's name, as TensorRT-LLM's (T19): a gen may meet several serves
    with launcher(None) as lau:
        ranks = [lau.start("ctx", r, ctx_main, msgspec.msgpack.encode(TrtCtxSpec(
            r, side, name, list(range(side.num_blocks)), sc.gen.side(),
            agent=sc.ctx.agent, serve=True, info_port=port or 0))) for r in range(side.world)]
        orch.gather(lau, ranks, TrtReady, 60.0, _stage("to start", 60.0))
        orch.send_all(ranks, TrtLine(0, line.name, "none", 0, 0))
        ups = {rid.index: msg for rid, (_r, msg) in orch.gather(lau, ranks, TrtCtxUp, 60.0,
                                                                  _stage("to open", 60.0)).items()}
        orch.send_all(ranks, TrtPeers([ups[r].sender for r in range(side.world)], ups[0].info))
        doc = Served("trtllm", line.name, ups[0].info, side.world, side.tp_size, side.pp_size, side.layers,
                     side.kv_heads, side.head_dim, side.tokens_per_block, side.dtype, pid=os.getpid())
        if json_out:
            write("serve", "trtllm", None, doc)
        else:
            print(f"serving TensorRT-LLM {line.name} ctx: info endpoint {doc.info_endpoint}, {side.world} ctx "
                  f"rank(s), {side.tokens_per_block} tokens per block, {side.dtype}", flush=True)
        # A signal stops the loop (the exit is still 130, 143 or 129: lifecycle.exit_code), then the ranks.
        with lifecycle.signals_recorded() as signalled:
            end = time.monotonic() + duration_s if duration_s else None
            while signalled() is None and (end is None or time.monotonic() < end):
                for rank, msg in lau.events(ranks, time.monotonic() + 0.05):
                    if msg is None:
                        raise HarnessError(f"{rank.id} died while serving: it {rank.ended()}")
                    if isinstance(msg, m.Failed):
                        raise HarnessError(f"{rank.id} failed while serving: {msg.error}")
            orch.send_all(ranks, m.Stop())
            got = orch.gather(lau, ranks, TrtCtxDone, 30.0, _stage("to stop", 30.0), ended_ok=True)
        finals = {rid.index: msg.result for rid, (_r, msg) in got.items()}
    for r, f in sorted(finals.items()):
        print(f"ctx rank {r}: {f.writes} WRITE(s), registered {len(f.registered)} gen rank(s)"
              + (f", listener ended: {f.listener_dead}" if f.listener_dead else "")
              + (f", logged: {f.logs[0]}" if f.logs else ""), file=sys.stderr)
    return EXIT_OK
