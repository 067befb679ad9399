"""KV layout hazards: block_size (H07), block length / heads / head_dim / dtype (H08), kv_cache_layout (H09),
attention backend (H10)."""

from __future__ import annotations

from pdcheck.releaseline import CORRECTED
from pdcheck.vllm.hazards.base import (
    _PRE_DEVICE_WIRES,
    _PRE_LAYOUT_WIRES,
    Facts,
    Hazard,
    Rels,
    _expected,
    _has,
    _no,
    _yes,
    corrected_block_len,
)
from pdcheck.vllm.hazards.wire import _p_release
from pdcheck.vllm.releases import hybrid, rules, shapes
from pdcheck.vllm.releases.rules import MSG_SHAPE, MSG_SHAPE_P_GT_D


def _geometry_diff(f: Facts) -> str:
    pairs = [("block_size", f.p.block_size, f.d.block_size), ("kv_heads", f.p.kv_heads, f.d.kv_heads),
             ("head_dim", f.p.head_dim, f.d.head_dim), ("dtype", f.p.dtype, f.d.dtype),
             ("use_mla", f.p.use_mla, f.d.use_mla), ("attn_backend", f.p.attn_backend, f.d.attn_backend)]
    diffs = [f"{k} {a} vs {b}" for k, a, b in pairs if a != b]
    return ", ".join(diffs) if diffs else "same model geometry"


def _h07(f: Facts, rels: Rels) -> Hazard:
    if f.p.block_size == f.d.block_size:
        return _no("H07", f"both use {f.d.block_size}-token blocks")
    pl, dl = f.pg.block_len, f.dg.block_len
    detail = f"P block_size {f.p.block_size} vs D {f.d.block_size} (P block_len {pl} B, D {dl} B)"
    effects: dict[str, str] = {}
    for rel in rels:
        got = _expected(rel, f)
        exp = got[0] if got else None
        on_wire = shapes.block_size_effect(rel, f.p.block_size, f.d.block_size)  # era F+: block_size advertised
        if on_wire is not None and on_wire.startswith("supported") and (
                hma := hybrid.handshake_refusal(rel, f.dg, f.p.block_size)):
            on_wire = shapes.PER_REQUEST.format(what=f"asserts '{hma}' (a hybrid model with HMA on)")
        if on_wire is not None:
            effects[rel.name] = on_wire
        elif rel.flow == "same_rank":
            effects[rel.name] = (f"no check: remote descriptors step by D's block_len {dl} B through P's "
                                 f"{pl} B blocks: wrong bytes, no error")
        elif exp is None:
            effects[rel.name] = "not reached: a TP check fails first (H11, H13)"
        elif exp != pl:
            effects[rel.name] = (f"block_size is not on the wire and the block_len check fires first: '{MSG_SHAPE}' "
                                 f"({pl} B vs {exp} B); the block-size assert behind it cannot fire")
        else:
            effects[rel.name] = (f"block_len matches ({pl} B), so the derived remote block size equals D's: "
                                 "undetected, tokens land in the wrong slots")
    effects[CORRECTED] = _h07_corrected(f, rels)
    return _yes("H07", detail, effects)


def _corrected_bsr(f: Facts, rels: Rels) -> int | None:
    """D's block in P blocks as the corrected model reads it: None where P (era A-E) advertises no block_size (the
    block length decides), 0 where P's does not divide D's (refused)."""
    p_rel = _p_release(f) or (rels[-1] if rels else None)  # the P the corrected D meets (handshake's profiles)
    if p_rel is not None and p_rel.wire in _PRE_DEVICE_WIRES:
        return None
    p_bs, d_bs = f.p.block_size, f.d.block_size
    return d_bs // p_bs if d_bs % p_bs == 0 else 0


def _h07_corrected(f: Facts, rels: Rels) -> str:
    """The corrected model checks an advertised block size first (P's must divide D's: its blocks are read into
    D's sub-blocks), then the block length (releases.corrected)."""
    bsr = _corrected_bsr(f, rels)
    pl = f.pg.block_len
    if bsr == 0:
        return (f"refused: P block_size {f.p.block_size}, D block_size {f.d.block_size}: D's block must be a whole "
                "number of P's")
    exp = corrected_block_len(f, f.params_tp) // (bsr or 1)
    if exp != pl:
        first = " first" if bsr is None else ""  # with no block_size advertised, the length decides
        return f"refused by the block length check{first} (H08): P block is {pl} B, D expects {exp} B"
    if bsr is None:
        return ("undetected: P (era A-E) does not advertise block_size and the block length matches: tokens land "
                "in the wrong slots")
    return (f"accepted: D's {f.d.block_size}-token block is {bsr} of P's; each is read into one of its sub-blocks "
            "(get_mapped_blocks) and rearranged on receive")


def _h08(f: Facts, rels: Rels) -> Hazard:
    pl, dl = f.pg.block_len, f.dg.block_len
    effects: dict[str, str] = {}
    for rel in rels:
        if rel.flow == "same_rank":
            if pl != dl:  # 0.9.0 steps through remote blocks with its own block_len, whatever P's is
                effects[rel.name] = f"no check: P blocks of {pl} B are read as {dl} B blocks (silent)"
            continue
        got = _expected(rel, f)
        if got is None or got[0] == pl:
            continue
        exp, kind = got
        on_wire = shapes.block_size_effect(rel, f.p.block_size, f.d.block_size)  # era F+: block_size advertised
        if on_wire is not None and not on_wire.startswith("supported"):
            effects[rel.name] = "not reached: the block-size check fires first (H07)"
            continue
        if on_wire is not None and pl == exp * f.p.block_size // f.d.block_size:
            continue  # P's smaller block, as block_size_ratio expects it
        effects[rel.name] = {
            "equal": f"bare `assert self.block_len == nixl_agent_meta.block_len` fails ({dl} vs {pl})",
            "scaled": (f"`assert nixl_agent_meta.block_len == self.block_len * tp_ratio` fails: '{MSG_SHAPE}' "
                       f"({pl} B vs {exp} B)"),
            "p_gt_d": (f"`assert remote_block_len == self.block_len_per_layer[0] // (-tp_ratio)` fails: "
                       f"'{MSG_SHAPE_P_GT_D}' ({pl} B vs {exp} B)"),
            "heads": (f"`remote_len == local_len * remote_heads // local_heads` fails (SPLIT region 0: {pl} B vs "
                      f"{exp} B)"),
        }[kind]
    bsr = _corrected_bsr(f, rels)
    exp = corrected_block_len(f, f.params_tp) // (bsr or 1)
    if bsr == 0:
        effects[CORRECTED] = "not reached: the block-size check refuses first (H07)"
    elif exp != pl:
        effects[CORRECTED] = f"refused: P block is {pl} B, D expects {exp} B"
    if not effects:
        return _no("H08", f"P block_len {pl} B matches what every release expects")
    effects.setdefault(CORRECTED, f"accepts: P's {pl} B matches the heads/head_dim/dtype it expects")
    why = _geometry_diff(f)
    if why == "same model geometry" and f.p_tp != f.d_tp:
        why += f" (only a release without heterogeneous TP expects D's own {dl} B)"
    detail = (f"P block_len {pl} B ({f.pg.block_size} tokens x {f.pg.local_kv_heads} heads x {f.pg.head_dim} x "
              f"{f.pg.elem_size} B{' x2 (K+V)' if f.pg.joint_kv else ''}), D block_len "
              f"{dl} B, tp_ratio {f.d_tp}//{f.p_tp}; {why}")
    return _yes("H08", detail, effects)


def _h09(f: Facts, rels: Rels) -> Hazard:
    if f.dg.use_mla:
        return _no("H09", "MLA: one latent per token, no head layout to disagree on")
    if rules.same_layout(f.p.kv_cache_layout, f.d.kv_cache_layout):  # LBHNC is HND's 0.29+ name
        same = {f.p.kv_cache_layout, f.d.kv_cache_layout}
        return _no("H09", f"both {' = '.join(sorted(same))}")
    ratio = f.ratio
    detail = f"P {f.p.kv_cache_layout} vs D {f.d.kv_cache_layout}, tp_ratio {ratio if ratio else 'n/a'}"
    if ratio > 1:
        what = (f"each D rank's head slice at (tp_rank % {ratio}) x {f.dg.block_len} B reads all heads of a "
                "fraction of the tokens instead: silent")
    else:
        what = "whole blocks are read and used in the other layout: silent"
    effects = {rel.name: (f"kv_cache_layout is not on the wire (era {rel.wire}) and not compared; {what}"
                          if rel.wire in _PRE_LAYOUT_WIRES else "compared (not modelled here)") for rel in rels}
    effects[CORRECTED] = ("refused when P advertises kv_cache_layout (era D, 0.10.1+); a P of eras A-C "
                          "does not, so it cannot be seen")
    return _yes("H09", detail, effects)


def _h10(f: Facts, rels: Rels) -> Hazard:
    if f.p.attn_backend == f.d.attn_backend:
        return _no("H10", f"both {f.d.attn_backend}")
    detail = f"P {f.p.attn_backend} vs D {f.d.attn_backend}"
    effects: dict[str, str] = {}
    for rel in rels:
        if _has(rel, "attn_backend"):
            effects[rel.name] = ("bare `assert nixl_agent_meta.attn_backend_name == self.backend_name` on every "
                                 "D rank, first handshake")
        else:
            effects[rel.name] = "not on the wire, not checked: blocks of the other backend's layout are read"
    effects[CORRECTED] = f"refused: attention backend P={f.p.attn_backend} D={f.d.attn_backend}"
    return _yes("H10", detail, effects)
