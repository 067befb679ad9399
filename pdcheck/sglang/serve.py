"""`pdcheck serve --sglang RELEASE`: fake SGLang P ranks and their bootstrap server, for a real SGLang decode (or
`pdcheck handshake --sglang R --prefill-endpoint URL`) to use until a signal or --duration. Pages are tagged
with SERVE_TAG when a room asks for them; P serves a room from the same page ids as the decode's, as many as its
own page size needs for the tokens of D's pages (D's page size: the scenario's [decode].page_size, else P's)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import msgspec

from pdcheck import bounds, lifecycle
from pdcheck import messages as m
from pdcheck import orchestrate as orch
from pdcheck.envelope import write
from pdcheck.errors import EXIT_OK, BadInput, HarnessError
from pdcheck.launcher import launcher
from pdcheck.scenariofile import read_toml
from pdcheck.sglang import bootstrap as bs
from pdcheck.sglang.ranks import SERVE_TAG, PFinal, SgPrefillSpec, sglang_prefill_main
from pdcheck.sglang.releases import resolve
from pdcheck.sglang.scenario import load


class Served(msgspec.Struct):
    framework: str
    release: str
    bootstrap_url: str
    p_ranks: int
    page_size: int
    kv_cache_dtype: str
    event: str = "ready"  # as vLLM's ready document: a script waits for one shape, whatever the framework
    pid: int = 0  # the serving process (signal it to stop)


def command(scenario: Any, release: str, port: int | None, duration_s: float | None, json_out: bool) -> int:
    if "," in release or release.strip() == "all":
        raise BadInput(f"--sglang: serve speaks one release, got {release!r}")
    rel = resolve(release)
    if port is not None and not 1024 <= port <= 65535:
        raise BadInput(f"--port: {port} is outside 1024-65535")
    if duration_s is not None:
        bounds.check_seconds("--duration", duration_s, bounds.SERVE_DURATION_S)  # nan, inf, 1e300 are bad input
    sc = load(scenario) if scenario is not None else load(None)
    p = sc.prefill.side()
    # the decode's page size only where the scenario names it: otherwise D pages as P does
    named = scenario is not None and "page_size" in (read_toml(scenario).get("decode") or {})
    d_page_size = sc.decode.page_size if named else 0
    try:
        server = bs.Server(bs.Table(rel, p.tp_size), port=port or 0)
    except OSError as exc:
        raise BadInput(f"--port: cannot bind 127.0.0.1:{port}: {exc.strerror}") from None
    finals: dict[int, PFinal] = {}
    try:
        with launcher(None) as lau:
            ranks = [lau.start("P", r, sglang_prefill_main, msgspec.msgpack.encode(SgPrefillSpec(
                r, rel.name, p, server.port, [], SERVE_TAG, serve=True, d_page_size=d_page_size))) for r in range(p.tp_size)]
            orch.await_ready(lau, ranks, 60.0)
            doc = Served("sglang", rel.name, f"http://127.0.0.1:{server.port}", p.tp_size, p.page_size,
                         p.kv_cache_dtype, pid=os.getpid())
            if json_out:
                write("serve", "sglang", None, doc)
            else:
                print(f"serving SGLang {rel.name} prefill: bootstrap {doc.bootstrap_url}, {p.tp_size} P rank(s), "
                      f"page_size {p.page_size}", flush=True)
            # A signal stops the loop (the exit is still 130, 143 or 129: lifecycle.exit_code), then the ranks.
            with lifecycle.signals_recorded() as signalled:
                end = time.monotonic() + duration_s if duration_s else None
                while signalled() is None and (end is None or time.monotonic() < end):
                    time.sleep(0.05)
                orch.send_all(ranks, m.Stop())
                got = orch.gather(lau, ranks, m.FrameworkFinal, 30.0, orch.Stage(
                    "{rank} failed: {error}", "{rank} died while serving: it {ended}", "{ranks} did not stop",
                    30.0), ended_ok=True)
            finals = {rid.index: msgspec.msgpack.decode(msg.body, type=PFinal) for rid, (_r, msg) in got.items()}
    except HarnessError:
        raise
    finally:
        server.close()
    for r, f in sorted(finals.items()):
        print(f"P rank {r}: {f.writes} WRITE requests, registered {len(f.registered)} decode agent(s)"
              + (f", listener died: {f.listener_dead}" if f.listener_dead else "")
              + (f", errors: {f.errors[0]}" if f.errors else ""), file=sys.stderr)
    return EXIT_OK
