"""`pdcheck probe`: read the side channel of a live prefill instance, read-only, in exactly one release's era.

Never registers memory, never adds a remote agent, never reads a block: it sends the era's metadata request
to each P TP rank on a fresh REQ socket with a receive timeout (closed with linger 0 on every path), decodes
the reply with that release's strict decoder. Against a decode configuration it then runs each D rank's
handshake flow in the same pure engine as `pdcheck handshake` (pdcheck.vllm.engine), on the replies already read,
and decides the verdict with handshake's own rule (pdcheck.verdict); the hazard catalogue (pdcheck.vllm.hazards)
explains it.

Only requests of the given release's era are sent: a 0.11.1+ listener thread dies on a request it cannot
unpack (docs/vllm-protocol.md §3.2, §9, H15), so a wrong guess would take a production P down.
"""

from __future__ import annotations

import time

import msgspec
import zmq

from pdcheck import bounds as b
from pdcheck import verdict as verdict_rule
from pdcheck.errors import BadInput, FetchRefused, FetchTimeout, HarnessError
from pdcheck.geometry import Geometry
from pdcheck.netio import MAX_FRAME_BYTES
from pdcheck.sidechannel import fetch
from pdcheck.verdict import RankVerdict
from pdcheck.vllm import releases
from pdcheck.vllm.engine import Outcome, Params
from pdcheck.vllm.engine import run as engine_run
from pdcheck.vllm.hazards import Hazard, NumBlocksSpread, evaluate, spread
from pdcheck.vllm.ports import dp_configured_id, dp_engine_id, rank_port
from pdcheck.vllm.releases import shapes
from pdcheck.vllm.releases.base import Local, Prepared, ReleaseModel
from pdcheck.vllm.report import verdict_detail
from pdcheck.vllm.results import ProbeRank
from pdcheck.vllm.scenario import LAYOUTS, Instance, Scenario
from pdcheck.vllm.wire import FORMATS, AnyMeta, WireError, WireFormat, strict_decode, tolerant_decode


class ProbeReport(msgspec.Struct, kw_only=True):
    """The body of `probe`'s --json (vLLM, one DP rank); the envelope (pdcheck.envelope) adds tool, version,
    schema, command and framework."""

    endpoint: str
    release: str
    release_source: str  # "--vllm", or the /version URL it was read from (--vllm auto)
    wire: str
    dp_rank: int
    ports: list[int]
    prefill_ranks: list[ProbeRank]
    num_blocks_spread: NumBlocksSpread | None
    decode: str | None  # where the decode configuration came from; None: no hazards evaluated
    hazards: list[Hazard]
    notes: list[str]
    verdict: str  # "ok" | "hazard" | "unreadable"
    exit_code: int
    # Each decode rank's handshake outcome under the release (the engine, against P's replies), by D rank;
    # None without a decode configuration. The verdict comes from these (pdcheck.verdict), as in `handshake`.
    decode_status: list[str] | None = None
    verdicts: list[RankVerdict] = []  # decode_status in the shape every command shares (empty: no decode)
    pp_size: int = 1  # P's pipeline stages as given (--prefill-pp or the scenario's prefill.pp_size)
    stages: list[ProbeRank] = []  # era H with pp_size > 1: the later stages' (pp_rank, tp_rank) replies


def parse_endpoint(text: str, what: str = "HOST:PORT") -> tuple[str, int]:
    """HOST:PORT, or [IPV6]:PORT. A bare IPv6 address (`::1`) is refused, not read as host ':' port 1."""
    t = text.strip()
    if t.startswith("["):
        host, sep, port = t[1:].partition("]:")
        if not sep or "]" in host or ":" not in host:
            raise BadInput(f"{what}: {text!r} is not [IPV6]:PORT (e.g. [::1]:5600)")
    else:
        host, sep, port = t.rpartition(":")
        if ":" in host:
            raise BadInput(f"{what}: {text!r}: an IPv6 address takes the form [ADDR]:PORT (e.g. [::1]:5600)")
    if not sep or not host or not (port.isascii() and port.isdigit()) or len(port) > 5 \
            or not 1 <= int(port) <= 65535:
        raise BadInput(f"{what}: {text!r} is not HOST:PORT (e.g. 127.0.0.1:5600 or [::1]:5600)")
    return host, int(port)


class DpProbeReport(msgspec.Struct, kw_only=True):
    """`probe --dp-size N`: one report per DP rank's side channel, and what the engine ids say about the layout."""

    endpoint: str
    dp_size: int
    dp_ranks: list[ProbeReport]
    notes: list[str]
    exit_code: int
    verdicts: list[RankVerdict] = []  # every DP rank's, rank "DP<k>/D<i>"


def dp_notes(reports: list[ProbeReport], dp_size: int, release: ReleaseModel) -> list[str]:
    """Each DP rank's listener should answer for its own engine id (ports.dp_engine_id: `<engine>_dp<N>` where
    the release appends the suffix), a different engine per DP rank: another suffix, or one engine at two ports,
    means the port layout reaches the wrong DP rank (vLLM #27083). A release whose DP ranks all keep the
    configured id gives the ids nothing to tell apart: no note."""
    out: list[str] = []
    seen: dict[str, int] = {}
    for rep in reports:
        ids = sorted({r.engine_id for r in rep.prefill_ranks if r.status == "ok" and r.engine_id})
        for eid in ids:
            base = dp_configured_id(eid, release)
            want = dp_engine_id(base, rep.dp_rank, dp_size, release)
            if eid != want:
                out.append(f"DP rank {rep.dp_rank} (ports {','.join(map(str, rep.ports))}) answers for {eid!r}, "
                           f"not {want!r}: a D routed to this DP rank fails "
                           f"'Remote NIXL agent engine ID mismatch'")
            if eid in seen and seen[eid] != rep.dp_rank and dp_engine_id(base, 0, dp_size, release) != base:
                out.append(f"DP ranks {seen[eid]} and {rep.dp_rank} answer for the same engine {eid!r}")
            seen.setdefault(eid, rep.dp_rank)
    return out


def agent_name(blob: bytes) -> str | None:
    """The agent name inside a NIXL metadata blob ('nixlSerDes|Agent' + u64 length + name), read without
    loading the blob into an agent (loading it would open connections to a live instance)."""
    head = b"nixlSerDes|Agent"
    if not blob.startswith(head) or len(blob) < len(head) + 8:
        return None
    n = int.from_bytes(blob[len(head):len(head) + 8], "little")
    name = blob[len(head) + 8:len(head) + 8 + n]
    return name.decode(errors="replace") if len(name) == n else None


def _look(frames: list[bytes]) -> str | None:
    """The era a reply looks like, for a wrong-era verdict; None when it is not metadata of any era."""
    try:
        return tolerant_decode(frames).era
    except Exception:  # garbage: nothing to name
        return None


def _fill(pr: ProbeRank, meta: AnyMeta, remote_hash: str | None, expected: str | None) -> None:
    pr.engine_id, pr.num_blocks, pr.device_id = meta.engine_id, meta.num_blocks, meta.device_id
    pr.agent_name = agent_name(meta.agent_metadata)
    pr.block_len = meta.block_len if meta.block_len is not None else (meta.block_lens or [None])[0]
    pr.block_lens, pr.block_size, pr.layout = meta.block_lens, meta.block_size, meta.kv_cache_layout
    pr.tp_size, pr.attn_backend, pr.regions = meta.tp_size, meta.attn_backend_name, len(meta.kv_caches_base_addr)
    pr.compat_hash, pr.compat_hash_expected = remote_hash, expected
    pr.hash_match = None if remote_hash is None or expected is None else remote_hash == expected
    names = meta.region_names or [n for members in meta.region_members or [] for n in members]
    pr.layers = list(dict.fromkeys(names)) if names else None


def ask(ctx: zmq.Context, host: str, port: int, fmt: WireFormat, tp_rank: int, timeout_ms: int,
        expected_hash: str | None, max_tp: int = b.MAX_TP,
        pp_rank: int = 0) -> tuple[ProbeRank, AnyMeta | None, list[bytes] | None]:
    """One request of era `fmt` for `tp_rank` (and `pp_rank`, which only era H's request names), one strict
    decode; the reply's frames when it decoded. Never raises for what P sends."""
    pr = ProbeRank(tp_rank=tp_rank, port=port, status="ok")
    t0 = time.perf_counter()
    try:
        frames = fetch(ctx, host, port, fmt, tp_rank, timeout_ms, pp_rank)
    except FetchTimeout:
        pr.status = "no_reply"
        pr.message = (f"no reply from {_endpoint(host, port)} within {timeout_ms} ms (nothing listening, another "
                      f"host, a listener thread that already died (H15), or a frame over "
                      f"{MAX_FRAME_BYTES >> 20} MiB, which pdcheck drops)")
        return pr, None, None
    except FetchRefused as exc:
        pr.status, pr.out_of_bounds, pr.message = "garbled", "reply", f"refused: {exc}"
        return pr, None, None
    pr.reply_ms = (time.perf_counter() - t0) * 1e3
    pr.frames, pr.reply_bytes = len(frames), sum(len(f) for f in frames)
    try:
        # The hash is reported and compared below, not enforced: probing must show what P runs.
        meta, remote_hash = strict_decode(fmt, frames, expected_hash, enforce_hash=False)
    except WireError as exc:
        seen = _look(frames)
        pr.status = "wrong_era" if seen is not None else "garbled"
        pr.era_seen = seen
        what = exc.message or f"assert {exc.expr}"
        pr.message = (f"{exc.exc_type}: {what}" + (f" (the reply looks like era {seen}, expected era {fmt.name})"
                                                   if seen else " (not NIXL metadata of any era)"))
        return pr, None, None
    except Exception as exc:  # noqa: BLE001 - anything else a hostile peer can provoke is a verdict too
        pr.status = "garbled"
        pr.message = f"{type(exc).__name__}: {exc}"
        return pr, None, None
    bad = peer_bounds(meta, max_tp)
    if bad is not None:
        pr.status, pr.out_of_bounds = "garbled", bad[0]
        pr.message = f"{bad[0]}: {bad[1]} (pdcheck uses no value outside its bounds)"
        return pr, None, None
    _fill(pr, meta, remote_hash, expected_hash)
    return pr, meta, frames


def peer_bounds(meta: AnyMeta, max_tp: int) -> tuple[str, str] | None:
    """(field, why) for the first advertised value outside what pdcheck accepts from a scenario (bounds.py),
    or None. Checked before any value is used: an advertised tp_size is a loop count, num_blocks sizes block
    tables, regions size the geometry."""
    def out(field: str, v: object, lo: int, hi: int, extra: str = "") -> tuple[str, str]:
        return field, f"{v!r} is outside {lo}..{hi}{extra}"

    if meta.tp_size is not None and not 1 <= meta.tp_size <= max_tp:
        return out("tp_size", meta.tp_size, 1, max_tp, f" (--max-tp raises it up to {b.HARD_MAX_TP})"
                   if max_tp < b.HARD_MAX_TP else "")
    if not 1 <= meta.num_blocks <= b.MAX_NUM_BLOCKS:
        return out("num_blocks", meta.num_blocks, 1, b.MAX_NUM_BLOCKS)
    if not 1 <= len(meta.kv_caches_base_addr) <= b.MAX_PEER_REGIONS:
        return out("kv_caches_base_addr (regions)", len(meta.kv_caches_base_addr), 1, b.MAX_PEER_REGIONS)
    lens = meta.block_lens if meta.block_lens is not None else []
    if len(lens) > b.MAX_PEER_REGIONS:
        return out("block_lens (entries)", len(lens), 0, b.MAX_PEER_REGIONS)
    for name, v in [("block_len", meta.block_len), *(("block_lens", x) for x in lens)]:
        if v is not None and not 1 <= v <= b.MAX_PEER_BLOCK_LEN:
            return out(name, v, 1, b.MAX_PEER_BLOCK_LEN)
    if meta.block_size is not None and not 1 <= meta.block_size <= b.MAX_BLOCK_SIZE:
        return out("block_size", meta.block_size, 1, b.MAX_BLOCK_SIZE)
    if meta.device_id is not None and not 0 <= meta.device_id <= b.MAX_DEVICE_ID:
        return out("device_id", meta.device_id, 0, b.MAX_DEVICE_ID)
    for name, text in (("engine_id", meta.engine_id), ("attn_backend_name", meta.attn_backend_name),
                       ("kv_cache_layout", meta.kv_cache_layout)):
        if text is not None and len(text) > b.MAX_PEER_STR:
            return name, f"{len(text)} characters; at most {b.MAX_PEER_STR}"
    return None


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tp_bound(meta: AnyMeta, hint: Geometry) -> int | None:
    """P's TP size implied by rank 0's block length, given the model's heads, head_dim and dtype; None when it
    cannot be bounded (MLA, or one head per rank, which replicated KV also gives)."""
    blen = meta.block_len if meta.block_len is not None else (meta.block_lens or [None])[0]
    if hint.use_mla or not blen:
        return None
    per_head = (meta.block_size or hint.block_size) * hint.elem_size * hint.head_dim * (2 if hint.joint_kv else 1)
    if blen % per_head:
        return None
    local = blen // per_head
    if local <= 1 or hint.total_kv_heads % local:
        return None
    return hint.total_kv_heads // local


def probe_ranks(host: str, base: int, release: ReleaseModel, *, dp_rank: int = 0, tp_size: int | None = None,
                timeout_ms: int = 2000, expected_hash: str | None = None, hint: Geometry | None = None,
                max_tp: int = b.MAX_TP) -> tuple[list[ProbeRank], list[list[bytes] | None], list[str]]:
    """Ask every P TP rank once. The number of ranks: tp_size if given; else era B's advertised tp_size (at most
    max_tp: a larger one makes rank 0 `garbled`; asking stops at the first rank that does not answer); else in
    the per-worker eras (A-E) the next port that does not answer, up to max_tp ports; else (F-H) rank 0 only,
    since asking a rank the scheduler does not serve raises KeyError in its listener thread and kills it.
    Returns the ranks, each rank's reply frames (None where it did not decode) and notes."""
    fmt = FORMATS[release.wire]
    notes: list[str] = []
    ranks: list[ProbeRank] = []
    replies: list[list[bytes] | None] = []
    ctx = zmq.Context()
    try:
        n = tp_size
        advertised = False  # n came from the peer: never more than max_tp asks, stop at the first silence
        r = 0
        while (n is None and r < max_tp) or (n is not None and r < n):
            port = rank_port(fmt.name, base, dp_rank, n or 1, r)
            pr, meta, frames = ask(ctx, host, port, fmt, r, timeout_ms, expected_hash, max_tp)
            if r == 0 and pr.status == "no_reply":
                raise HarnessError(f"probe: {pr.message}")
            if advertised and pr.status == "no_reply":
                notes.append(f"{r} of the {n} advertised P rank(s) asked: port {port} did not answer")
                ranks.append(pr)
                replies.append(frames)
                break
            if n is None and r > 0 and pr.status == "no_reply":
                notes.append(f"{r} P rank(s) found: port {port} did not answer (pass --tp-size to name the size)")
                break
            if n is None and r > 0 and pr.engine_id is not None and pr.engine_id != ranks[0].engine_id:
                # The next port belongs to someone else (another instance's listener on this host).
                notes.append(f"{r} P rank(s) found: port {port} answers for engine {pr.engine_id!r}, not "
                             f"{ranks[0].engine_id!r} (pass --tp-size to name the size)")
                break
            ranks.append(pr)
            replies.append(frames)
            if r == 0 and n is not None and n > 1 and fmt.port_scheme == "per_dp" and meta and hint is not None:
                bound = tp_bound(meta, hint)
                if bound is not None and n > bound:
                    # Asking a rank the scheduler does not serve raises KeyError in its listener thread.
                    notes.append(f"asked {bound} rank(s), not {n}: P rank 0's block length means TP {bound} for "
                                 f"{hint.total_kv_heads} KV heads, and a request for a rank an era-{fmt.name} "
                                 "scheduler does not serve kills its listener (KeyError, H15)")
                    n = bound
            if n is None and r == 0:
                if meta is not None and meta.tp_size is not None:
                    n, advertised = meta.tp_size, True  # era B advertises it (bounded by ask: 1..max_tp)
                elif pr.out_of_bounds is not None:
                    n = 1  # a peer advertising out-of-bounds values gives no rank count to trust
                    notes.append(f"only TP rank 0 asked: it advertises {pr.out_of_bounds} out of bounds")
                elif fmt.port_scheme == "per_dp":
                    n = 1
                    notes.append("only TP rank 0 asked: in eras F-H a request for a rank the scheduler does not "
                                 "serve kills its listener (KeyError), so pass --tp-size to ask the others")
            r += 1
        if n is None and r >= max_tp:
            notes.append(f"stopped after {max_tp} P ranks (--max-tp); pass --tp-size to name the size")
    finally:
        ctx.destroy(0)
    return ranks, replies, notes


def probe_stages(host: str, base: int, release: ReleaseModel, ranks: list[ProbeRank], pp_size: int, *,
                 dp_rank: int = 0, timeout_ms: int = 2000, expected_hash: str | None = None,
                 max_tp: int = b.MAX_TP) -> tuple[list[ProbeRank], dict[tuple[int, int], list[bytes] | None],
                                                   list[str]]:
    """P's pipeline stages past the first: from era H each TP rank's metadata is served per stage under
    (pp_rank, tp_rank) on the same port, so every stage of every rank that answered is asked; a stage P lacks
    raises KeyError in its listener thread (H15), which is why only the stages given are asked. Before era H a
    request names a TP rank only and its port answers with one stage (shapes.served_stage): nothing more to ask.
    Sets each stage-0 rank's pp_rank; returns the later stages' ranks, their replies by (pp_rank, tp_rank), notes."""
    fmt = FORMATS[release.wire]
    if pp_size <= 1:
        return [], {}, []
    for pr in ranks:
        pr.pp_rank = shapes.answered_stage(fmt.name, 0, pp_size)
    if fmt.name < shapes.PP_STAGES_KEYED:
        stage = shapes.served_stage(fmt.name, pp_size)
        return [], {}, [f"P has {pp_size} pipeline stages: an era-{fmt.name} request names a TP rank only, and its "
                        f"port answers with stage {stage}'s metadata; the other stages' layers are never served"]
    out: list[ProbeRank] = []
    replies: dict[tuple[int, int], list[bytes] | None] = {}
    ctx = zmq.Context()
    try:
        for s in range(1, pp_size):
            for pr0 in ranks:
                if pr0.status != "ok":
                    continue
                pr, _meta, frames = ask(ctx, host, pr0.port, fmt, pr0.tp_rank, timeout_ms, expected_hash, max_tp,
                                        pp_rank=s)
                pr.pp_rank = s
                out.append(pr)
                replies[(s, pr0.tp_rank)] = frames
    finally:
        ctx.destroy(0)
    return out, replies, []


def _layers(regions: int, geometry_flat: bool) -> int:
    return regions if geometry_flat else max(1, regions // 2)


def probed_instance(base: Instance, ranks: list[ProbeRank], host: str, port: int, dp_rank: int,
                    notes: list[str], release: ReleaseModel | None = None) -> Instance:
    """The prefill instance as the wire shows it. Facts the metadata does not carry (heads, head_dim, dtype,
    model) come from `base` (the scenario's [prefill] table, else the decode instance); heads are solved
    from the advertised block length when it disagrees."""
    ok = [r for r in ranks if r.status == "ok"]
    if not ok:
        return base
    first = ok[0]
    counts = [r.num_blocks if r.status == "ok" and r.num_blocks else base.blocks()[0] for r in ranks]
    backend = first.attn_backend or base.attn_backend
    use_mla = base.use_mla or "MLA" in backend.upper()
    layout = first.layout if first.layout in LAYOUTS else base.kv_cache_layout
    if first.layout is not None and first.layout not in LAYOUTS:
        notes.append(f"P advertises kv_cache_layout {first.layout!r}, which pdcheck does not model; "
                     f"hazards assume {layout}")
    inst = msgspec.structs.replace(
        base, engine_id=first.engine_id or base.engine_id, tp_size=len(ranks), num_blocks=counts,
        block_size=first.block_size or base.block_size, kv_cache_layout=layout, attn_backend=backend,
        use_mla=use_mla, host=host, base_port=port, dp_rank=dp_rank, device_ids=None)
    devs = [r.device_id for r in ok if r.device_id is not None]
    if len(devs) == len(ranks) and devs != list(range(len(ranks))):
        inst = msgspec.structs.replace(inst, device_ids=devs)
    # the block lengths and regions P's release registers (FlashAttention's layout differs per release)
    g = releases.for_release(release, inst.geometry()) if release is not None else inst.geometry()
    if first.regions:
        inst = msgspec.structs.replace(inst, layers=_layers(first.regions, use_mla or g.joint_kv))
        g = releases.for_release(release, inst.geometry()) if release is not None else inst.geometry()
    if first.block_len and first.block_len != g.block_len:
        per_head = g.block_size * g.elem_size * g.head_dim * (2 if g.joint_kv else 1)
        if not use_mla and first.block_len % per_head == 0:
            heads = first.block_len // per_head * inst.tp_size
            notes.append(f"P's block_len {first.block_len} means {heads} KV heads with head_dim {g.head_dim} and "
                         f"{g.dtype} (assumed from the decode configuration)")
            inst = msgspec.structs.replace(inst, kv_heads=heads)
        else:
            notes.append(f"P's block_len {first.block_len} does not fit head_dim {g.head_dim} x {g.dtype}: "
                         "hazards use the decode configuration's heads")
    return inst


def run(host: str, port: int, release: ReleaseModel, *, dp_rank: int = 0, tp_size: int | None = None,
        timeout_ms: int = 2000, decode_sc: Scenario | None = None, decode_from: str | None = None,
        release_source: str = "--vllm", max_tp: int = b.MAX_TP, pp_size: int | None = None) -> ProbeReport:
    """Probe, then evaluate the hazards against `decode_sc` (its [prefill] table supplies what the wire lacks).
    pp_size: P's pipeline stages (default: the scenario's prefill.pp_size, else 1)."""
    expected = None
    if decode_sc is not None:
        expected = releases.compat_hash_for(release, decode_sc.decode.geometry(), decode_sc.decode.model,
                                            cache_dtype=decode_sc.decode.cache_dtype)
    ranks, replies, notes = probe_ranks(host, port, release, dp_rank=dp_rank, tp_size=tp_size,
                                       timeout_ms=timeout_ms, expected_hash=expected, max_tp=max_tp,
                                       hint=releases.for_release(release, decode_sc.prefill.geometry())
                                       if decode_sc is not None else None)
    if pp_size is None:
        pp_size = decode_sc.prefill.pp_size if decode_sc is not None else 1
    stages, stage_replies, stage_notes = probe_stages(host, port, release, ranks, pp_size, dp_rank=dp_rank,
                                                      timeout_ms=timeout_ms, expected_hash=expected, max_tp=max_tp)
    notes += stage_notes
    fmt = FORMATS[release.wire]
    ok = [r for r in ranks if r.status == "ok"]
    hazards: list[Hazard] = []
    statuses: list[str] | None = None  # each D rank's handshake outcome; None: no decode configuration
    outcomes: list[Outcome] = []
    if decode_sc is not None and ok:
        p_inst = probed_instance(decode_sc.prefill, ranks, host, port, dp_rank, notes, release)
        sc = msgspec.structs.replace(decode_sc, prefill=msgspec.structs.replace(p_inst, pp_size=pp_size))
        hazards = evaluate(sc, [release])
        outcomes = decode_outcomes(sc, release, {**{(0, r): f for r, f in enumerate(replies)}, **stage_replies},
                                   expected)
        statuses = [o.status for o in outcomes]
    elif decode_sc is None:
        notes.append("no decode configuration (a scenario or --decode-* flags): hazards not evaluated")
    engines = sorted({r.engine_id for r in ok if r.engine_id})
    if len(engines) > 1:
        notes.append(f"P ranks answer for different engine ids: {', '.join(engines)}")
    for r in ok:
        if r.hash_match is False:
            notes.append(f"P rank {r.tp_rank}: compatibility hash {r.compat_hash} differs from the {release.name} "
                         f"decode's {r.compat_hash_expected}: a real {release.name} decode refuses it "
                         "(RuntimeError: NIXL compatibility hash mismatch, H17)")
    unreadable = len(ok) < len(ranks) or any(r.status != "ok" for r in stages)
    # With a decode configuration, the handshake's own rule on the engine's outcomes (pdcheck.verdict): the
    # hazards explain, they do not decide. Without one, only what the replies themselves show.
    d_tp = decode_sc.decode.tp_size if decode_sc is not None else 0
    fires = not verdict_rule.survives(statuses, d_tp) if statuses is not None else len(engines) > 1
    verdict = "unreadable" if unreadable else "hazard" if fires else "ok"
    return ProbeReport(
        endpoint=f"{host}:{port}", release=release.name,
        release_source=release_source,
        wire=fmt.name, dp_rank=dp_rank, ports=sorted({r.port for r in ranks}), prefill_ranks=ranks,
        num_blocks_spread=spread([r.num_blocks for r in ok if r.num_blocks is not None]) if ok else None,
        decode=decode_from if decode_sc is not None else None, hazards=hazards, notes=notes, verdict=verdict,
        exit_code=verdict_rule.exit_code([verdict == "ok"]), decode_status=statuses,
        verdicts=[RankVerdict(release=release.name, rank=verdict_rule.rank_label(i), status=o.status,
                              detail="" if o.status == "ok" else verdict_detail(o) + _when(release, o),
                              stage=None if o.handshake is None else f"handshake {o.handshake}",
                              contacted=list(o.contacted), contacted_stages=list(o.contacted_stages))
                  for i, o in enumerate(outcomes)],
        pp_size=pp_size, stages=stages,
    )


class _Replay:
    """HandshakeIO over the replies the probe already read, by (pp_rank, tp_rank): a D rank's handshake flow runs
    in-process without sending anything again, loading an agent or registering memory (probe stays read-only).
    A rank or stage that was not asked answers nothing, as one P lacks would."""

    def __init__(self, replies: dict[tuple[int, int], list[bytes] | None]) -> None:
        self.replies = replies

    def fetch(self, fmt: WireFormat, p_rank: int, timeout_ms: int | None, pp_rank: int = 0) -> list[bytes]:
        frames = self.replies.get((pp_rank, p_rank))
        if frames is None:
            raise FetchTimeout
        return frames

    def add_remote_agent(self, blob: bytes) -> str:
        return agent_name(blob) or "remote"

    def prep_remote(self, prepared: Prepared, mem_type: str) -> None:
        pass  # nothing is registered: the descriptor ids are all the verdict needs


def decode_outcomes(sc: Scenario, release: ReleaseModel, replies: dict[tuple[int, int], list[bytes] | None],
                    local_hash: str | None) -> list[Outcome]:
    """Each D rank's outcome under `release` against the replies P gave, by (pp_rank, tp_rank): the pure engine,
    with the Local and Params a `pdcheck handshake` D rank builds (handshake_ranks.decode_main), P's pipeline
    stages included (the stages the release asks, shapes.asked_stages)."""
    d = sc.decode
    g = releases.registered_geometry(d.vllm, d.geometry(), [release])
    params = Params(sc.remote_engine_id(), sc.params_tp_size(), release.wire, local_hash,
                    pp_size=sc.prefill.pp_size)
    out = []
    for r in range(d.tp_size):
        local = Local(d.engine_id, r, d.tp_size, d.blocks()[r], g, d.kv_cache_layout, d.device_id(r))
        out.append(engine_run(release, local, params, _Replay(replies)))
    return out


def _when(release: ReleaseModel, o: Outcome) -> str:
    """When the refusal reaches the user, as handshake's report says it (shapes.when_raised)."""
    w = shapes.when_raised(release, o.status, o.check)
    return "" if w is None else f" ({w})"
