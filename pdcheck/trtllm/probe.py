"""`pdcheck probe --trtllm`: ask a live ctx's info endpoint REQUEST_INSTANCE_INFO, read-only (never
REGISTER_RANK_INFO: a registration would load pdcheck's agent into the ctx and, in W1a, an unexpected frame ends
its listener thread, T43), and report its ranks, layout, tokens per block and element size, and the hazards
against a gen configuration. Also `handshake --trtllm ERA --prefill-endpoint`: pdcheck's gen ranks against a live
ctx (`pdcheck serve --trtllm`, or a real one), its facts probed the same way first.

The reply is untrusted: bounded by pdcheck/trtllm/peerio.py (frames, bytes, one deadline) and decoded into bounded
Structs (pdcheck/trtllm/maps.py). A reply pdcheck refuses to read is exit 3 in one line; a reply of another known
wire era is a finding (the named gen era cannot decode it)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import zmq
from rich.console import Console
from rich.markup import escape

from pdcheck import bounds as b
from pdcheck import messages as m
from pdcheck import verdict
from pdcheck.errors import BadInput
from pdcheck.netio import PeerError
from pdcheck.trtllm import checks, engine, eras, peerio, wire
from pdcheck.trtllm.eras.base import TrtLine
from pdcheck.trtllm.layout import DTYPE_BYTES, Side
from pdcheck.trtllm.maps import WireError
from pdcheck.trtllm.plan import LiveCtx, Pair, TrtOptions, TrtPlan, blocks
from pdcheck.trtllm.scenario import TrtInstance, TrtScenario, load

# The reply shapes, newest first: one RankInfo shape serves W2a, W2b and W3 (the reply cannot tell them apart).
SHAPES = (("W3", "W2a, W2b or W3"), ("W1b", "W1b"), ("W1a", "W1a"))


class CtxLayout(msgspec.Struct):
    instance_name: str
    tp_size: int
    pp_size: int
    layer_num_per_pp: list[int]
    sender_endpoints: int  # how many it lists
    kv_heads_per_rank: int
    tokens_per_block: int
    dims_per_head: int
    element_bytes: int
    dtypes: list[str]  # the KV dtypes of that element size: the dtype itself is not on the wire (T73)
    is_mla: bool
    num_slots: int | None = None  # W2/W3: its page table's blocks


class TrtProbeReport(msgspec.Struct):
    framework: str
    endpoint: str
    era: str  # the wire era the reply's shape belongs to
    eras_alike: str  # every era answering with that shape
    ctx: CtxLayout
    gen_era: str | None  # the gen era judged against it (--trtllm, else the reply's)
    hazards: list[str]
    notes: list[str]
    exit_code: int
    verdicts: list[verdict.RankVerdict] = []  # a gen configuration's predicted outcome per gen rank


def exchange(endpoint: str, timeout_s: float) -> tuple[str, bytes]:
    """(tcp endpoint, the one reply frame) of REQUEST_INSTANCE_INFO; PeerError (exit 3) for anything refused."""
    b.check_seconds("--timeout", timeout_s, b.PROBE_TIMEOUT_S)
    ep, host = peerio.endpoint_of(endpoint)
    zctx = zmq.Context()
    try:
        frames = peerio.request(zctx, ep, host, [wire.INFO], timeout_s)
    except PeerError as exc:
        raise PeerError(f"{ep}: {exc}") from None
    finally:
        zctx.destroy(0)
    return ep, frames[0]


def recognise(reply: bytes, where: str) -> tuple[str, str, wire.Peer]:
    """(era, eras alike, the ctx as that era decodes it): the first shape whose decoder takes the reply."""
    errors = []
    for era, alike in SHAPES:
        try:
            return era, alike, wire.decode_info_reply(era, reply, "RankInfo" if era == "W3" else "InstanceInfo")
        except WireError as exc:
            errors.append(str(exc))
    raise PeerError(f"{where}: not a TensorRT-LLM RankInfo or InstanceInfo ({b.peer_text(errors[0], 160)})")


def layout_of(peer: wire.Peer) -> CtxLayout:
    v = peer.view
    return CtxLayout(peer.instance_name, v.tp_size, peer.pp_size, list(v.layer_num_per_pp), len(peer.sender_endpoints),
                     v.kv_heads_per_rank, v.tokens_per_block, v.dims_per_head, v.element_bytes,
                     sorted(d for d, n in DTYPE_BYTES.items() if n == v.element_bytes), v.is_mla,
                     v.num_slots or None)


def side_of(c: CtxLayout, dtype_hint: str) -> Side:
    """The ctx as a Side: its dtype is the gen's when their element sizes match (the wire cannot tell), else the
    first dtype of its size."""
    dtype = dtype_hint if dtype_hint in c.dtypes else (c.dtypes[0] if c.dtypes else "float16")
    heads = 1 if c.is_mla else c.kv_heads_per_rank * c.tp_size
    return Side(tp_size=c.tp_size, pp_size=c.pp_size, layers=sum(c.layer_num_per_pp),
                layer_num_per_pp=tuple(c.layer_num_per_pp), kv_heads=max(1, heads), head_dim=c.dims_per_head,
                dtype=dtype, tokens_per_block=c.tokens_per_block, num_blocks=max(4, c.num_slots or 16),  # type: ignore[arg-type]
                mla=c.is_mla)


def gen_line(releases: str | None, era: str) -> TrtLine:
    if releases is None or releases.strip() == "auto":
        return eras.line(era)
    if "," in releases or releases.strip() == "all":
        raise BadInput(f"--trtllm: probe judges one gen era, got {releases!r}")
    line = eras.resolve(releases).line
    if line.runtime == "cpp":
        raise BadInput(f"--trtllm: {line.name} runs the C++ transceiver, which has no info endpoint to probe "
                       "(NIXL notifications only, docs/trtllm-protocol.md §5)")
    return line


def probe_report(endpoint: str, releases: str | None, scenario: Path | None, overrides: dict[str, Any],
                 timeout_s: float) -> TrtProbeReport:
    named = None if releases is None or releases.strip() == "auto" else gen_line(releases, "W3")
    gen_sc = load(scenario, overrides) if scenario is not None or overrides else None
    ep, reply = exchange(endpoint, timeout_s)
    era, alike, peer = recognise(reply, f"{ep} (REQUEST_INSTANCE_INFO reply)")
    c = layout_of(peer)
    line = named or eras.line(era)
    hazards, notes = [], [f"the reply's shape is {alike}'s"]
    if len(c.dtypes) > 1:
        notes.append(f"element size {c.element_bytes} bytes: {' or '.join(c.dtypes)}; the dtype is not on the wire "
                     "(T73), so a gen of the other one passes every check and reads wrong values")
    if wire.ERAS[line.wire].info != wire.ERAS[era].info or wire.ERAS[line.wire].rank_info != wire.ERAS[era].rank_info:
        try:
            wire.decode_info_reply(line.wire, reply)
        except WireError as exc:
            hazards.append(f"a {line.name} gen cannot decode this reply: {exc} (T13): its request fails at once")
    verdicts: list[verdict.RankVerdict] = []
    if gen_sc is not None:
        g = gen_sc.gen.side()
        ctx_side = side_of(c, g.dtype)
        ctx_line = eras.line(era)
        got = checks.on_register(ctx_line, _view(ctx_side), _view(g), "gen", 0)
        if got.refused:
            hazards.append(f"the ctx refuses a {line.name} gen at REGISTER_RANK_INFO and only logs it: "
                           f"{got.logs[0]} (T69)")
        elif got.logs:
            notes.append(got.logs[0])
        if g.element_bytes == c.element_bytes and len(c.dtypes) > 1:
            notes.append(f"the gen's {g.dtype} cannot be checked against the ctx's dtype: make sure the ctx runs "
                         f"{g.dtype} too")
        for r in range(g.world):
            p = engine.one(ctx_line, line, ctx_side, g, "none")
            verdicts.append(verdict.RankVerdict(release=line.name, rank=f"gen{r}", status=p.status,
                                                detail=p.why or "every check passes", stage=p.stage or None))
    failing = bool(hazards) or any(v.status != "ok" for v in verdicts)
    return TrtProbeReport("trtllm", ep, era, alike, c, line.name, hazards, notes,
                          verdict.exit_code([not failing]), verdicts)


def _view(side: Side) -> Any:
    from pdcheck.trtllm.layout import view_of

    return view_of(side, 0, 0)


def render(rep: TrtProbeReport, console: Console) -> None:
    c = rep.ctx
    console.print(f"TensorRT-LLM ctx at {escape(rep.endpoint)}: wire era {rep.era} ({escape(rep.eras_alike)}), "
                  f"instance {escape(c.instance_name)}")
    console.print(f"  TP {c.tp_size}, PP {c.pp_size}, layers per PP rank {c.layer_num_per_pp}, "
                  f"{c.sender_endpoints} sender endpoint(s)")
    console.print(f"  {c.kv_heads_per_rank} KV head(s) per rank, {c.tokens_per_block} tokens per block, head dim "
                  f"{c.dims_per_head}, {c.element_bytes}-byte elements ({' or '.join(c.dtypes)})"
                  + (", MLA" if c.is_mla else "") + (f", {c.num_slots} blocks" if c.num_slots else ""))
    for n in rep.notes:
        console.print(f"[dim]note: {escape(n)}[/]")
    for h in rep.hazards:
        console.print(f"[red]hazard:[/] {escape(h)}")
    for v in rep.verdicts:
        console.print(f"{escape(v.release)} {v.rank}: {v.status} {escape(v.detail)}")
    console.print(f"[dim]exit {rep.exit_code}[/]")


# ---- handshake --prefill-endpoint ----------------------------------------------------------------------------
def live_plan(sc: TrtScenario, releases: str | None, endpoint: str, hang_s: float, options: TrtOptions) -> TrtPlan:
    """pdcheck's gens against a live ctx: its facts read first (bounded, read-only); the proof's oracle is the
    ctx it advertised, its blocks 0 .. n-1 (what `pdcheck serve --trtllm` WRITEs from)."""
    text = releases if releases is not None else ",".join(sc.trtllm)
    lines = eras.resolve_many(text, "--trtllm")
    for r in lines:
        if r.line.runtime == "cpp":
            raise BadInput(f"--trtllm: {r.typed}: --prefill-endpoint is a Python ctx's info endpoint; {r.line.name} "
                           "runs the C++ transceiver")
    ep, reply = exchange(endpoint, hang_s)
    era, _alike, peer = recognise(reply, f"{ep} (REQUEST_INSTANCE_INFO reply)")
    c = layout_of(peer)
    side = side_of(c, sc.gen.dtype)
    ctx = TrtInstance(tp_size=side.tp_size, pp_size=side.pp_size, layers=side.layers,
                      layer_num_per_pp=list(side.layer_num_per_pp), kv_heads=side.kv_heads, head_dim=side.head_dim,
                      dtype=side.dtype, tokens_per_block=side.tokens_per_block, num_blocks=side.num_blocks,
                      mla=side.mla)
    sc = msgspec.structs.replace(sc, ctx=ctx)
    _ctx_blocks, gen_blocks = blocks(sc)
    n = sc.ctx.side().blocks_for(sc.request.prompt_tokens)
    pairs = [Pair(r.line.name, r.line.name, r.line.name, r.attribution) for r in lines]
    return TrtPlan(sc, pairs, list(range(n)), gen_blocks, msgspec.structs.replace(options, cap_s=hang_s), [],
                   LiveCtx(ep, era))


def run_live(plan: TrtPlan) -> Any:
    """Each line's gen ranks against the live ctx: no ctx of pdcheck's to go quiet, so a wait ends at the hang
    window (--hang-timeout), as SGLang's and vLLM's live runs do."""
    from pdcheck import orchestrate as orch
    from pdcheck.errors import HarnessError
    from pdcheck.launcher import launcher
    from pdcheck.trtllm.gen import gen_main
    from pdcheck.trtllm.messages import TrtGenDone, TrtGenGo, TrtGenSpec, TrtReady
    from pdcheck.trtllm.runner import LineResult, TrtRunResult, _not_run, _stage, timeout_text

    t0 = time.monotonic()
    sc, live = plan.scenario, plan.live
    assert live is not None
    g, c = sc.gen.side(), sc.ctx.side()
    lines: list[LineResult] = []
    opt = plan.options
    try:
        with launcher(None) as lau:
            gens = [lau.start("gen", r, gen_main, msgspec.msgpack.encode(TrtGenSpec(
                r, g, c, str(uuid.uuid4()), plan.gen_blocks, plan.ctx_blocks, agent=sc.gen.agent,
                cap_s=opt.cap_s))) for r in range(g.world)]
            orch.gather(lau, gens, TrtReady, opt.start_timeout_s, _stage("to start", opt.start_timeout_s))
            for i, pair in enumerate(plan.pairs):
                t1 = time.monotonic()
                timeout_ms, text = timeout_text(plan, pair.gen)
                orch.send_all(gens, TrtGenGo(i, pair.gen, "none", 1000 + i, 7000 + i, live.endpoint, timeout_ms))
                got = orch.gather(lau, gens, TrtGenDone, opt.cap_s + opt.start_timeout_s,
                                  _stage("its request", opt.cap_s + opt.start_timeout_s))
                done = {rid.index: msg.result for rid, (_r, msg) in got.items()}
                line = eras.line(pair.gen)
                lines.append(LineResult(pair.name, "live", pair.gen, line.era, line.releases, line.runtime,
                                        pair.attribution, text, [done[r] for r in range(g.world)],
                                        engine.predict(eras.line(live.era), line, sc, timeout_ms), [],
                                        seconds=time.monotonic() - t1))
            orch.send_all(gens, m.Stop())
    except HarnessError as exc:
        lines += [_not_run(plan, p, str(exc)) for p in plan.pairs[len(lines):]]
    return TrtRunResult(sc.name, sc.source, sc.issue, lines, [], time.monotonic() - t0)
