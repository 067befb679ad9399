"""Shapes beyond one TP group, and semantics: stale KV (H28), pipeline stages (X01), hybrid KV-cache groups
(X10), a backend that ignores the connector's layout (X02)."""

from __future__ import annotations

from pdcheck.releaseline import CORRECTED
from pdcheck.vllm.hazards.base import Facts, Hazard, Rels, _no, _yes
from pdcheck.vllm.releases import CORRECTED as CORRECTED_MODEL
from pdcheck.vllm.releases import hybrid, shapes


def _h28(f: Facts, rels: Rels) -> Hazard:
    """fp8 KV caches with dynamic (per-request) scales: the scales are not part of the transfer (vLLM #42179)."""
    dyn = [side for side, i in (("prefill", f.p), ("decode", f.d))
           if i.fp8_dynamic_scales and i.cache_dtype.startswith("fp8")]
    if not dyn:
        return _no("H28", "no fp8 KV cache with dynamic scales")
    effects = {rel.name: shapes.fp8_effects(rel, f.p.cache_dtype, f.p.cache_dtype, dynamic=True)[0] for rel in rels}
    effects[CORRECTED] = "warned: transfer the per-request scales with the blocks, or use static (calibrated) scales"
    return _yes("H28", f"fp8 KV cache with dynamic scales on {' and '.join(dyn)}", effects)


def _x01(f: Facts, rels: Rels) -> Hazard:
    p, d = f.p.pp_size, f.d.pp_size
    effects = {rel.name: shapes.pp_effect(rel, p, d) for rel in rels}
    effects[CORRECTED] = ("each D rank reads the layers of every P stage ((pp_rank, tp_rank) metadata, as 0.26+ "
                          "serve it); a D stage reads the layers it holds; against a P before 0.26, which serves one "
                          "stage per port, refused")  # shapes.stages_unreachable
    return _yes("X01", f"pipeline parallel: prefill pp_size {p}, decode pp_size {d}", effects)


def _x10(f: Facts, rels: Rels) -> Hazard:
    """Hybrid models: which releases refuse them at start-up, hash is_hma_enabled apart, or read which blocks of
    each group (releases.hybrid, the one home of these facts)."""
    g = f.dg.groups
    kinds = ", ".join(f"{gr.kind}{f' {gr.window}' if gr.window else ''} x{gr.layers}" for gr in g) or "full attention"
    hma = {side: i.hma for side, i in (("prefill", f.p), ("decode", f.d)) if i.hma is not None}
    detail = f"KV-cache groups: {kinds}" + "".join(f"; {side} hma = {str(v).lower()}" for side, v in hma.items())
    effects = {rel.name: "; ".join(hybrid.effects(rel, f.pg, f.dg)) or "no hybrid effect" for rel in rels}
    effects[CORRECTED] = "; ".join(hybrid.effects(CORRECTED_MODEL, f.pg, f.dg)) or "no hybrid effect"
    return _yes("X10", detail, effects)


def _x02(f: Facts, rels: Rels) -> Hazard:
    """A backend that writes another layout than the one vLLM resolved and the metadata advertises (#46204)."""
    sides = [f"{side}'s backend writes {i.backend_layout}, its metadata says {i.kv_cache_layout}"
             for side, i in (("prefill", f.p), ("decode", f.d))
             if i.backend_layout is not None and i.backend_layout != i.kv_cache_layout]
    split = f.dg.total_kv_heads // f.d_tp != f.pg.total_kv_heads // f.p_tp
    effects = {rel.name: shapes.backend_layout_effect(rel, f.p.memory_layout(), f.d.memory_layout(), split,
                                                      f.dg.use_mla) for rel in rels}
    effects[CORRECTED] = ("refused where heads split: D checks its own backend's layout (a head slice needs heads-first "
                          "blocks)" if split and not f.dg.use_mla else "whole blocks: accepted")
    return _yes("X02", "; ".join(sides), effects)
