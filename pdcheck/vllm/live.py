"""`pdcheck handshake --prefill-endpoint HOST:PORT`: the fake D ranks meet a live prefill instance.

No fake P is started. P's facts come from a read-only probe in P's own era (pdcheck.vllm.probe); then every modelled
release's D ranks (and the corrected model) handshake with the live side channel exactly as in
`pdcheck handshake`, and with --transfer READ a few blocks. Blocks are verified only where they carry
pdcheck's coordinate tags (a `pdcheck serve` P); a real instance's KV content is not checkable.

A D release whose request P's listener cannot unpack is not run: on a 0.11.1+ P it would kill the listener
thread of a live instance (docs/vllm-protocol.md §3.2, H15). The report names the releases skipped and why.
"""

from __future__ import annotations

import time

import msgspec

from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.errors import HarnessError
from pdcheck.launcher import launcher
from pdcheck.pattern import engine_tag
from pdcheck.vllm import drive, probe
from pdcheck.vllm import messages as vm
from pdcheck.vllm.plan import TAG_BLOCKS, Plan, d_release, make_requests
from pdcheck.vllm.ports import layout_base
from pdcheck.vllm.ranks import decode_main
from pdcheck.vllm.releases import CORRECTED
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.results import Live, RunResult, Timings
from pdcheck.vllm.scenario import Scenario
from pdcheck.vllm.wire import FORMATS, WireFormat, encode_request, parse_request


def kills_listener(p_fmt: WireFormat, d_fmt: WireFormat) -> str | None:
    """Why a request of era d_fmt would end P's listener thread, or None when P survives it."""
    if not p_fmt.listener_dies_on_bad_request:
        return None
    try:
        parse_request(p_fmt, encode_request(d_fmt, 0))
    except Exception as exc:  # what the real listener thread would die of
        return f"{type(exc).__name__}: {exc}"
    return None


def run(plan: Plan) -> RunResult:
    assert plan.live is not None and plan.p_release is not None, "a fake P's plan runs through pdcheck.vllm.handshake"
    t0 = time.perf_counter()
    host, port, opts = plan.live.host, plan.live.port, plan.options
    sc, releases, p_rel = plan.scenario, plan.releases, plan.p_release
    p_fmt = FORMATS[p_rel.wire]
    d = sc.decode
    ranks, _replies, notes = probe.probe_ranks(host, port, p_rel, dp_rank=sc.prefill.dp_rank,
                                             tp_size=sc.prefill.tp_size if plan.live.tp_given else None,
                                             timeout_ms=opts.hang_timeout_ms, hint=plan.p_geometry,
                                             max_tp=opts.max_tp)
    for r in ranks:
        if r.out_of_bounds is not None:
            raise HarnessError(f"--prefill-endpoint {host}:{port}: P rank {r.tp_rank}: {r.message}")
    p = probe.probed_instance(sc.prefill, ranks, host, port, sc.prefill.dp_rank, notes, p_rel)
    sc = _checked(msgspec.structs.replace(sc, prefill=p), f"{host}:{port}", opts.max_tp)
    for r in ranks:
        if r.status != "ok":
            notes.append(f"probe of P rank {r.tp_rank} ({p_rel.name}, era {p_rel.wire}): {r.message}")
    skipped: dict[str, str] = {}
    run_rels: list[ReleaseModel] = []
    for rel in releases:
        why = kills_listener(p_fmt, FORMATS[rel.wire])
        if why is None:
            run_rels.append(rel)
        else:
            skipped[rel.name] = (f"not run: its era-{rel.wire} request would kill the live P's era-{p_rel.wire} "
                                 f"listener thread ({why}; H15)")
    requests = make_requests(sc, p_limit=TAG_BLOCKS)
    # The live P's layout from its probed TP size; corrected reads whatever P speaks. Once: each entry
    # computes a compatibility hash.
    d_rels = [d_release(r, layout_base(p_rel.wire if r is CORRECTED else r.wire, port, p.dp_rank, p.tp_size),
                        p_rel.wire, d) for r in [*run_rels, CORRECTED]]
    d_geom = plan.d_geometry  # the live P's KV layout
    harness: list[str] = []
    with launcher() as lau:
        d_ranks = {
            r: lau.start("D", r, decode_main, msgspec.msgpack.encode(vm.DecodeSpec(
                engine_id=d.engine_id, tp_rank=r, tp_size=d.tp_size, num_blocks=d.blocks()[r],
                device_id=d.device_id(r), device=opts.device,
                geometry=d_geom, kv_cache_layout=d.kv_cache_layout, releases=d_rels,
                p_host=host, p_engine_tag=engine_tag(p.engine_id), remote_engine_id=sc.remote_engine_id(),
                params_tp_size=sc.params_tp_size(), hang_timeout_ms=opts.hang_timeout_ms,
                transfer=opts.transfer, requests=requests, live=True, memory_layout=d.backend_layout,
                permute_local_kv=d.enable_permute_local_kv, p_pp_size=p.pp_size)))
            for r in range(d.tp_size)
        }
        ready = orc.await_ready(lau, list(d_ranks.values()), opts.start_timeout_s)
        t_ready = time.perf_counter()
        orc.send_all(d_ranks.values(), m.Go())
        results, _finals = drive.route_tags(lau, {}, d_ranks, opts.run_timeout_s, harness, tick=opts.progress)
    t_end = time.perf_counter()
    timings = Timings(start_s=t_ready - t0, run_s=t_end - t_ready, total_s=t_end - t0,
                      setup_ms={str(rid): ms for rid, (ms, _v) in ready.items()})
    # The live P's ranks run behind its endpoint, not here.
    live = Live(endpoint=f"{host}:{port}", prefill_release=p_rel.name, prefill_wire=p_rel.wire, probe=ranks,
                skipped=skipped, content=_content(results, opts.transfer), notes=notes)
    return RunResult(sc, run_rels, opts.device, requests, results, {}, harness, timings,
                     {f"P rank {r}": host for r in range(p.tp_size)}, live)


def _checked(sc: Scenario, endpoint: str, max_tp: int) -> Scenario:
    """The scenario with the live P's facts, through the same field bounds as a scenario file (scenario.py's
    types: num_blocks, layers, heads, block size, names): what a peer advertises never sizes a loop, a block
    table or a geometry unchecked. Not the per-rank memory bounds: no fake P allocates the live P's cache.
    Out of bounds: exit 3, one line."""
    try:
        checked = msgspec.convert(msgspec.to_builtins(sc), Scenario, strict=True)
    except msgspec.ValidationError as exc:
        raise HarnessError(f"--prefill-endpoint {endpoint}: the live P advertises {exc} (pdcheck uses no value "
                           "outside its bounds)") from None
    if checked.prefill.tp_size > max_tp:
        raise HarnessError(f"--prefill-endpoint {endpoint}: the live P has {checked.prefill.tp_size} ranks; "
                           f"at most --max-tp {max_tp}")
    return checked


def _content(results: dict[int, vm.DecodeResult], transfer: bool) -> str:
    if not transfer:
        return "not read (--no-transfer)"
    seen = {t.status for d in results.values() for t in (d.transfer or {}).values()}
    if "arrived" in seen:
        return ("bytes arrived (READ DONE), content not checkable: the live P's blocks carry no pdcheck "
                "coordinate tags; a real vLLM instance's KV cannot be verified from outside")
    if seen & {"ok", "wrong"}:
        return "verified block by block against pdcheck serve's coordinate tags"
    return "no block was read (every handshake stopped first)"
