"""Across releases and ports: schema skew (H14), a listener a cross-era request kills (H15), the compat hash
(H17), side-channel host and port (H20)."""

from __future__ import annotations

from pdcheck.releaseline import CORRECTED
from pdcheck.vllm import ports
from pdcheck.vllm.hazards.base import Facts, Hazard, Rels, _has, _no, _yes
from pdcheck.vllm.releases import shapes
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.releases.rules import msg_engine_id


def _port_scheme(rel: ReleaseModel) -> str:
    from pdcheck.vllm.wire import FORMATS

    return FORMATS[rel.wire].port_scheme


def _p_release(f: Facts) -> ReleaseModel | None:
    """The prefill's own release in a cross-release pair (prefill.vllm), else None."""
    from pdcheck.vllm.releases import resolve

    return resolve(f.p.vllm) if f.p.vllm else None


def _h14(f: Facts, rels: Rels) -> Hazard:
    p_rel = _p_release(f)
    if p_rel is None:
        return _no("H14", "P and D model the same release (no prefill.vllm)")
    from pdcheck.vllm.wire import FORMATS, WireError, encode_reply, strict_decode

    probe = {"engine_id": "", "agent_metadata": b"", "kv_caches_base_addr": [], "num_blocks": 1, "tp_size": 1,
             "block_len": 1, "block_lens": [1], "block_strides": [1], "attn_backend_name": "", "kv_cache_layout": "",
             "device_id": 0, "block_size": 1, "ssm_sizes": (0, 0), "physical_blocks_per_logical_kv_block": 1}
    frames = encode_reply(FORMATS[p_rel.wire], probe, "")
    effects: dict[str, str] = {}
    for rel in rels:
        try:
            strict_decode(FORMATS[rel.wire], frames, None)
        except WireError as exc:
            effects[rel.name] = f"{exc.exc_type}: {exc.message or exc.expr} (P era {p_rel.wire}, D era {rel.wire})"
    if not effects:
        return _no("H14", f"P {p_rel.name}'s metadata decodes under every modelled D release")
    effects[CORRECTED] = "reads any era (optional fields), detects the era and refuses with a clear message"
    return _yes("H14", f"P runs {p_rel.name} (era {p_rel.wire}); D releases read another schema", effects)


def _h15(f: Facts, rels: Rels) -> Hazard:
    p_rel = _p_release(f)
    from pdcheck.vllm.wire import FORMATS, encode_request, parse_request

    p_fmt = FORMATS[p_rel.wire] if p_rel else None
    if p_fmt is None or not p_fmt.listener_dies_on_bad_request:
        return _no("H15", "no P listener of eras F-H receives requests of another era")
    effects: dict[str, str] = {}
    for rel in rels:
        try:
            parse_request(p_fmt, encode_request(FORMATS[rel.wire], 0))
        except Exception as exc:  # what the real listener thread would die of
            effects[rel.name] = (f"its request kills P's listener ({type(exc).__name__}); every later handshake "
                                 "to that P times out")
    if not effects:
        return _no("H15", f"every modelled D release frames requests as P {p_rel.name} expects")
    effects[CORRECTED] = "never probes a live P with a request of another era; P should catch per request"
    return _yes("H15", f"P {p_rel.name}'s listener decodes requests outside any try (era {p_rel.wire})", effects)


def _h17(f: Facts, rels: Rels) -> Hazard:
    """Only the cache_dtype factor: the other factors show up as H08/H10/H14 lines."""
    pc, dc = f.p.cache_dtype, f.d.cache_dtype
    if pc == dc:
        return _no("H17", f"both sides hash cache_dtype {pc!r}")
    effects = {rel.name: "; ".join(shapes.fp8_effects(rel, pc, dc, dynamic=False)) for rel in rels}
    effects[CORRECTED] = f"refused: cache_dtype {pc!r} on P, {dc!r} on D (the KV bytes are not comparable)"
    return _yes("H17", f"cache_dtype: P {pc!r}, D {dc!r}", effects)


def _h20(f: Facts, rels: Rels) -> Hazard:
    """Data parallel: the port a decode DP rank contacts belongs to another engine (the wrong DP port, or its
    own node's listener when VLLM_NIXL_SIDE_CHANNEL_HOST is left unset on P, vLLM #27083). Engine ids per
    release (ports.dp_route_ids): where every DP rank keeps the configured id, the wrong DP rank answers for
    the expected engine."""
    p, d = f.p, f.d
    if p.dp_size == 1 and d.dp_size == 1:
        return _no("H20", "one DP rank per side")
    routes = ports.dp_routes(f.sc)
    misrouted = [rt for rt in routes if rt.reached_side != "prefill" or rt.reached != rt.routed]
    one = rels[0] if len(rels) == 1 else None  # the ids the detail names: the one release's, else the suffix
    p_own = _p_release(f)
    wrong = [(rt, e, g) for rt in routes for e, g in [ports.dp_route_ids(f.sc, rt, p_own or one, one)]
             if g != e or rt in misrouted]
    if not wrong:
        return _no("H20", f"each decode DP rank reaches the prefill DP rank its router picked "
                          f"(prefill dp_size {p.dp_size}, decode dp_size {d.dp_size})")
    why = ("VLLM_NIXL_SIDE_CHANNEL_HOST is unset on P ('localhost' is advertised): D reaches its own node's "
           "listener" if not p.side_channel_host_set else "the proxy hands out DP rank 0's side-channel port")
    detail = why + "; " + ", ".join(f"decode DP rank {rt.d_dp} expects {e!r}, reaches {g!r}"
                                    + (f" (prefill DP rank {rt.reached})" if e == g else "") for rt, e, g in wrong)
    rt = wrong[0][0]
    effects: dict[str, str] = {}
    for rel in rels:
        exp, got = ports.dp_route_ids(f.sc, rt, p_own or rel, rel)
        own = ports.dp_engine_id(d.engine_id, rt.d_dp, d.dp_size, rel)
        if got == exp:
            effects[rel.name] = (f"decode DP rank {rt.d_dp}: every DP rank answers for {got!r} (the configured "
                                 f"engine id): the handshake passes with prefill DP rank {rt.reached}'s agent and the "
                                 f"reads take its blocks for requests DP rank {rt.routed} prefilled (wrong KV, no error)")
        elif _has(rel, "engine_id_matches"):
            effects[rel.name] = f"decode DP rank {rt.d_dp}: RuntimeError: {msg_engine_id(exp, got)}"
        elif got == own and _has(rel, "engine_id_conflict"):
            effects[rel.name] = (f"decode DP rank {rt.d_dp}: its own node's listener answers for its own id "
                                 f"{got!r}: AssertionError: Conflict engine id found!")
        else:
            effects[rel.name] = (f"decode DP rank {rt.d_dp}: no engine-id check: {got!r}'s agent is registered as "
                                 f"{exp!r}; the first read raises KeyError")
    exp, got = ports.dp_route_ids(f.sc, rt)
    effects[CORRECTED] = f"refused: answered for {got!r}, expected {exp!r} (set VLLM_NIXL_SIDE_CHANNEL_HOST; one port per DP rank)"
    return _yes("H20", detail, effects)
