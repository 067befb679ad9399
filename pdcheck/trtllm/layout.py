"""TensorRT-LLM's KV layout and the arithmetic of which ctx ranks a gen rank reads and where each byte goes: pure
functions, shared by the fake ranks (their WRITE descriptors), the transfer proof's oracle and the pure engine.

Pool: [blocks, local layers, kv_factor, heads/rank, tokens_per_block, head_dim] (T39, T49); a block (slot) is
`slot_bytes` long and starts at `base + slot_bytes * block_id`. The mappers (T50-T52) are computed on the ctx from
the gen's advertised RankInfo; the peer set (T46) and the duplicate-head writers (T47) from both RankInfos.
"""

from __future__ import annotations

from typing import Literal

import msgspec

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1, "int8": 1}
Dtype = Literal["float16", "bfloat16", "float32", "fp8", "int8"]


class Side(msgspec.Struct, frozen=True, kw_only=True):
    """One instance's model and parallel layout (a scenario's [ctx] or [gen] table, resolved)."""

    tp_size: int = 1
    pp_size: int = 1
    layers: int = 4
    layer_num_per_pp: tuple[int, ...] = ()  # per PP rank; () = the even split (the remainder on the last)
    kv_heads: int = 8  # the model's KV heads (all TP ranks together)
    head_dim: int = 64
    dtype: Dtype = "float16"
    tokens_per_block: int = 16
    num_blocks: int = 16
    mla: bool = False

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_factor(self) -> int:
        return 1 if self.mla else 2  # AttentionInfo.kv_factor (T34)

    @property
    def heads_per_rank(self) -> int:
        return 1 if self.mla else max(1, self.kv_heads // self.tp_size)

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    def pp_layers(self) -> tuple[int, ...]:
        if self.layer_num_per_pp:
            return self.layer_num_per_pp
        base = self.layers // self.pp_size
        return tuple([base] * (self.pp_size - 1) + [self.layers - base * (self.pp_size - 1)])

    def global_layers(self, pp_rank: int) -> range:
        """The global layer ids PP rank pp_rank holds (T46: Σ layer_num_per_pp[:p] onward)."""
        per = self.pp_layers()
        first = sum(per[:pp_rank])
        return range(first, first + per[pp_rank])

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank  # T46: pp * tp_size * cp_size + cp * tp_size + tp, cp = 1

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, tp_rank) of a global rank."""
        return divmod(rank, self.tp_size)

    @property
    def slab_bytes(self) -> int:
        """One (layer, K or V) of one block: heads/rank x tokens_per_block x head_dim x element bytes."""
        return self.heads_per_rank * self.tokens_per_block * self.head_dim * self.element_bytes

    @property
    def row_bytes(self) -> int:
        """One (token, head) row of one layer's K or V: what the transfer proof checks by coordinate."""
        return self.head_dim * self.element_bytes

    def slot_bytes(self, pp_rank: int) -> int:
        return self.pp_layers()[pp_rank] * self.kv_factor * self.slab_bytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_block)

    def heads_of(self, tp_rank: int) -> list[int]:
        """The model's KV heads a TP rank holds, in its local order (replicated when TP > heads)."""
        if self.mla:
            return [0]
        if self.tp_size <= self.kv_heads:
            h = self.heads_per_rank
            return list(range(tp_rank * h, (tp_rank + 1) * h))
        return [tp_rank * self.kv_heads // self.tp_size]


class View(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank advertises that the mappers use (its RankInfo: attention fields, layer ids, its pool)."""

    tp_size: int
    tp_rank: int
    pp_rank: int
    layer_num_per_pp: tuple[int, ...]
    kv_heads_per_rank: int
    tokens_per_block: int
    dims_per_head: int
    element_bytes: int
    is_mla: bool
    base_address: int
    slot_bytes: int
    num_slots: int

    @property
    def kv_factor(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def layers(self) -> range:
        first = sum(self.layer_num_per_pp[:self.pp_rank])
        return range(first, first + self.layer_num_per_pp[self.pp_rank])

    @property
    def layer_kv_bytes(self) -> int:
        return self.kv_heads_per_rank * self.tokens_per_block * self.dims_per_head * self.element_bytes


def view_of(side: Side, rank: int, base: int) -> View:
    pp, tp = side.coords(rank)
    return View(tp_size=side.tp_size, tp_rank=tp, pp_rank=pp, layer_num_per_pp=side.pp_layers(),
                kv_heads_per_rank=side.heads_per_rank, tokens_per_block=side.tokens_per_block,
                dims_per_head=side.head_dim, element_bytes=side.element_bytes, is_mla=side.mla,
                base_address=base, slot_bytes=side.slot_bytes(pp), num_slots=side.num_blocks)


# ---------------------------------------------------------------------------------------------- peer set
def find_overlap(self_tp: int, peer_tp: int, self_rank: int) -> tuple[int, int]:
    """_find_overlap without attention-DP (peer_dp_rank 0): (first peer TP rank, how many) (T46)."""
    if self_tp <= peer_tp:
        n = peer_tp // self_tp
        return self_rank * n, n
    return self_rank // (self_tp // peer_tp), 1


def peer_ranks(gen: View, ctx_pp_layers: tuple[int, ...], ctx_tp: int) -> list[int]:
    """The ctx ranks gen rank `gen` reads (get_peer_overlap with self = gen): every ctx PP rank whose layer range
    meets the gen's, times the TP overlap; rank id pp * tp + tp (T46). expected_transfers = len() (T22)."""
    mine = set(gen.layers)
    first, n = find_overlap(gen.tp_size, ctx_tp, gen.tp_rank)
    out = []
    start = 0
    for pp, count in enumerate(ctx_pp_layers):
        if mine & set(range(start, start + count)):
            out += [pp * ctx_tp + t for t in range(first, first + n)]
        start += count
    return out


def dup_factor(self_: View, peer: View) -> int:
    """duplicate_head_factor with self = the side asking (T46, T47)."""
    return max(1, (self_.kv_heads_per_rank * self_.tp_size) // max(1, peer.kv_heads_per_rank * peer.tp_size))


def should_write(ctx: View, gen: View) -> bool:
    """A ctx rank whose duplicate-head factor is d > 1 writes only if peer dp_rank % d == its TP rank % d (the
    peer's dp_rank is 0 without attention-DP); the others send SUCCESS with no bytes (T47)."""
    d = dup_factor(ctx, gen)
    return d <= 1 or 0 % d == ctx.tp_rank % d


# ------------------------------------------------------------------------------------------------ mappers
Mapper = Literal["identity", "head_match", "head_mismatch"]


def mapper(ctx: View, gen: View) -> Mapper:
    """AttentionPolicy.build_kv_mapper on the ctx (self = ctx, T50)."""
    is_dup = ctx.kv_heads_per_rank * ctx.tp_size != gen.kv_heads_per_rank * gen.tp_size
    if is_dup or ctx.is_mla or ctx.tp_size == gen.tp_size:
        common = set(ctx.layers) & set(gen.layers)
        if len(common) == len(ctx.layers) == len(gen.layers):
            return "identity"
        return "head_match"
    return "head_mismatch"


def fragments(ctx: View, gen: View, ctx_blocks: list[int], gen_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of every descriptor ctx rank `ctx` WRITEs into gen rank `gen`
    for the paired blocks, as the mappers compute them (T50-T52). Addresses use each side's advertised base and
    slot size with no bound check on the ids (T74)."""
    common = sorted(set(ctx.layers) & set(gen.layers))
    if not common:
        return []
    kind = mapper(ctx, gen)
    src_off, dst_off = common[0] - ctx.layers.start, common[0] - gen.layers.start
    out: list[tuple[int, int, int]] = []
    pairs = list(zip(ctx_blocks, gen_blocks, strict=False))
    if kind == "identity":
        for cb, gb in pairs:
            out.append((ctx.base_address + ctx.slot_bytes * cb, gen.base_address + gen.slot_bytes * gb,
                        ctx.slot_bytes))
        return out
    if kind == "head_match":
        per_c = ctx.slot_bytes // len(ctx.layers)
        per_g = gen.slot_bytes // len(gen.layers)
        if per_c != per_g:  # HeadMatchMapper asserts equal per-layer slot bytes on both sides
            raise ValueError(f"HeadMatchMapper: slot size per layer differs ({per_c} vs {per_g})")
        for cb, gb in pairs:
            out.append((ctx.base_address + ctx.slot_bytes * cb + src_off * per_c,
                        gen.base_address + gen.slot_bytes * gb + dst_off * per_g, len(common) * per_c))
        return out
    per_head = ctx.tokens_per_block * ctx.dims_per_head * ctx.element_bytes
    cont = min(ctx.kv_heads_per_rank, gen.kv_heads_per_rank) * per_head
    ratio = max(ctx.tp_size, gen.tp_size) // min(ctx.tp_size, gen.tp_size)
    src_head = (gen.tp_rank % ratio) * cont if ctx.tp_size < gen.tp_size else 0
    dst_head = (ctx.tp_rank % ratio) * cont if ctx.tp_size > gen.tp_size else 0
    for cb, gb in pairs:
        for j in range(len(common)):
            for k in range(ctx.kv_factor):
                src = ctx.base_address + ctx.slot_bytes * cb + ctx.layer_kv_bytes * (
                    ctx.kv_factor * (src_off + j) + k) + src_head
                dst = gen.base_address + gen.slot_bytes * gb + gen.layer_kv_bytes * (
                    gen.kv_factor * (dst_off + j) + k) + dst_head
                out.append((src, dst, cont))
    return out


def merge(frags: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent fragments (both sides contiguous) as one descriptor; NIXL moves the same bytes either way."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in frags:
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out
