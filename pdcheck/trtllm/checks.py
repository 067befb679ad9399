"""The compatibility checks each line runs, where it runs them, and their exact texts (docs/trtllm-protocol.md §7):
pure functions over the two sides' advertised views. The fake ranks call them on what really arrived over the
wire; the pure engine and `probe` call them on a scenario's sides.

Python, ctx side at REGISTER_RANK_INFO: PeerRegistrar (T67) or AttentionPolicy (T68); a failure is only logged and
the gen is never told (T69). The C++ path: CacheFormatter::inquireSupport on the gen before its request and on the
ctx on it (T61, T62, T64). Nothing on the Python path compares the dtype, only element_bytes (T73). The corrected
gate runs on the gen before it registers and compares every field, the dtype included."""

from __future__ import annotations

import msgspec

from pdcheck.trtllm.cppwire import CacheState
from pdcheck.trtllm.eras.base import (
    INQUIRE,
    INQUIRE_TEXTS,
    LAYERS_DIFFER,
    REGISTER_RAISES,
    REGISTRAR,
    TrtLine,
    attention_text,
)
from pdcheck.trtllm.layout import Side, View


class Verdict(msgspec.Struct, frozen=True):
    """A check's outcome: refused (the first failing check's field and the texts logged), or what was logged
    while accepting (a layer-count warning)."""

    refused: bool
    field: str = ""
    logs: tuple[str, ...] = ()


def _fields(a: View, b: View) -> list[tuple[str, object, object]]:
    """(field, local, peer) in the order both registrars compare them (T67, T68); cp is always 1 here."""
    return [("is_mla", a.is_mla, b.is_mla), ("element_bytes", a.element_bytes, b.element_bytes),
            ("tokens_per_block", a.tokens_per_block, b.tokens_per_block),
            ("dims_per_head", a.dims_per_head, b.dims_per_head)]


def on_register(line: TrtLine, ctx: View, gen: View, gen_name: str, gen_rank: int) -> Verdict:
    """The ctx's check of a registering gen (self = ctx, peer = gen)."""
    if line.checks not in ("registrar", "attention"):
        return Verdict(False)
    raises = REGISTER_RAISES.format(name=gen_name, rank=gen_rank)
    layers = (sum(ctx.layer_num_per_pp), sum(gen.layer_num_per_pp))
    for field, a, b in _fields(ctx, gen):
        if a != b:
            text = REGISTRAR[field].format(a=a, b=b) if line.checks == "registrar" else attention_text(field, a, b)
            return Verdict(True, field, (text, raises))
    if line.checks == "registrar" and layers[0] != layers[1]:
        return Verdict(True, "layers", (REGISTRAR["layers"].format(a=layers[0], b=layers[1]), raises))
    if ctx.is_mla and (gen.kv_heads_per_rank != 1 or ctx.kv_heads_per_rank != 1):
        pair = (ctx.kv_heads_per_rank, gen.kv_heads_per_rank)
        text = REGISTRAR["mla_heads"].format(a=pair[0], b=pair[1]) if line.checks == "registrar" else \
            attention_text("mla_heads", *pair)
        return Verdict(True, "mla_heads", (text, raises))
    if layers[0] != layers[1]:
        return Verdict(False, "layers", (LAYERS_DIFFER.format(a=layers[0], b=layers[1]),))
    return Verdict(False)


def corrected_gate(ctx: View, gen: View, ctx_dtype: str, gen_dtype: str) -> str | None:
    """pdcheck's corrected gate on the gen (self = gen, peer = ctx): the first field that differs, as one
    reason, or None. A ctx that advertises no dtype speaks another wire era than the corrected one: refused, not
    guessed. TP sizes and head counts may differ (the mappers split and replicate heads, T50-T53)."""
    if not ctx_dtype:
        return "the ctx advertises no KV dtype (another wire era than the gen's): refused rather than guessed"
    pairs = [("is_mla", ctx.is_mla, gen.is_mla), ("kv dtype", ctx_dtype, gen_dtype),
             ("element_bytes", ctx.element_bytes, gen.element_bytes),
             ("tokens_per_block", ctx.tokens_per_block, gen.tokens_per_block),
             ("dims_per_head", ctx.dims_per_head, gen.dims_per_head),
             ("total layers", sum(ctx.layer_num_per_pp), sum(gen.layer_num_per_pp))]
    for field, c, g in pairs:
        if c != g:
            return f"{field} differs (ctx {c}, gen {g})"
    return None


def cache_state(side: Side, pp_rank: int = 0) -> CacheState:
    """A C++ rank's CacheState (T14: total_num_kv_heads_per_layer, head_dim, tokens_per_block, pp layer counts)."""
    per = side.pp_layers()
    return CacheState(heads_per_layer=[side.heads_per_rank] * per[pp_rank], size_per_head=side.head_dim,
                      tokens_per_block=side.tokens_per_block, tp=side.tp_size, pp=side.pp_size,
                      layers_per_pp=list(per), dtype=side.dtype, attention_type="MLA" if side.mla else "DEFAULT",
                      kv_factor=side.kv_factor)


def inquire(self_: CacheState, dest: CacheState) -> str | None:
    """CacheFormatter::inquireSupport (T64): the first failing check's warning, or None."""
    t = INQUIRE_TEXTS
    if self_.dtype != dest.dtype:
        return INQUIRE + t["dtype"]
    if len(set(self_.heads_per_layer)) > 1:
        return INQUIRE + t["self_heads"]
    if self_.attention_type != dest.attention_type:
        return INQUIRE + t["attention_type"]
    if self_.kv_factor != dest.kv_factor:
        return INQUIRE + t["kv_factor"]
    if self_.attention_type == "MLA":
        return INQUIRE + t["mla"]
    if len(set(dest.heads_per_layer)) > 1:
        return INQUIRE + t["dest_heads"]
    if self_.tokens_per_block != dest.tokens_per_block or self_.size_per_head != dest.size_per_head:
        return INQUIRE + t["tokens_per_block"]
    total_self, total_dest = sum(self_.layers_per_pp), sum(dest.layers_per_pp)
    if total_self != total_dest:
        return INQUIRE + t["layers"].format(a=total_self, b=total_dest)
    if total_self % self_.pp or total_dest % dest.pp:
        return INQUIRE + t["pp_divisible"]
    return None
