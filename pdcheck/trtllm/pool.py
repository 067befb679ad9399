"""A fake rank's KV pool laid out as TensorRT-LLM lays it out ([blocks, layers, kv_factor, heads/rank,
tokens_per_block, head_dim], T39, T49) in host memory (pdcheck.kvcache.host_memory, registered as DRAM: VRAM labels
on host pointers fail, reference §10), tagged with pdcheck's one coordinate pattern (pdcheck.pattern.pattern), and
the transfer proof: every (token, head, layer, K/V) row a gen rank holds, checked by coordinate against what a
correct transfer puts there, naming the ctx coordinate that arrived instead.

The pattern's coordinate word carries (tag, P rank, region, block); here the rank is the ctx's global rank, the
region 2 x global layer + K/V, and the tag names the ctx's KV dtype, so a row that arrived right but in another
dtype (fp16 against bf16: equal element sizes, T73) shows as "encoded as bfloat16" rather than as right. The cell's
offset word is the byte offset in the (heads, tokens, head_dim) slab: it names the head and the token."""

from __future__ import annotations

import msgspec
import numpy as np

from pdcheck.kvcache import host_memory
from pdcheck.pattern import decode_cell, engine_tag, pattern
from pdcheck.trtllm.layout import DTYPE_BYTES, Side

DTYPE_TAG = {d: engine_tag(f"trtllm-kv-{d}") for d in DTYPE_BYTES}
TAG_DTYPE = {t: d for d, t in DTYPE_TAG.items()}
assert len(TAG_DTYPE) == len(DTYPE_TAG), "two dtypes share a pattern tag"


class Pool:
    """One rank's KV pool: num_blocks slots of slot_bytes, one registered region."""

    def __init__(self, side: Side, rank: int) -> None:
        self.side, self.rank = side, rank
        self.pp, self.tp = side.coords(rank)
        self.slot = side.slot_bytes(self.pp)
        self.layers = side.global_layers(self.pp)
        self._map, self.arr = host_memory(self.slot * side.num_blocks)
        self.addr = int(self.arr.ctypes.data)
        self.blocks = self.arr.reshape(side.num_blocks, self.slot)

    def region(self) -> list[tuple[int, int, int]]:
        return [(self.addr, self.arr.nbytes, 0)]

    def slab_at(self, local_layer: int, kv: int) -> int:
        return (local_layer * self.side.kv_factor + kv) * self.side.slab_bytes

    def tag(self, blocks: list[int]) -> None:
        """Every layer and K/V of these blocks holds its coordinate, tagged with this side's dtype."""
        ids = np.asarray(blocks, dtype=np.int64)
        s = self.side
        for i, g in enumerate(self.layers):
            for kv in range(s.kv_factor):
                at = self.slab_at(i, kv)
                self.blocks[ids, at:at + s.slab_bytes] = pattern(DTYPE_TAG[s.dtype], self.rank, 2 * g + kv, ids, 0,
                                                                 s.slab_bytes)

    def clear(self) -> None:
        self.arr[:] = 0


class RowProof(msgspec.Struct):
    """What the gen's rows hold. status: ok (every row right), dtype (every row holds the right coordinate,
    written in another dtype: silent wrong values), wrong (rows hold other coordinates), partial (some rows never
    written), empty (nothing arrived)."""

    status: str
    rows: int = 0
    wrong: int = 0
    arrived: int = 0  # rows holding a ctx coordinate (right or not)
    first: str | None = None  # the first wrong row: where, what it should hold, what it holds
    found_dtype: str | None = None  # the dtype the ctx wrote, when it is not the gen's


def _describe_found(cell: np.ndarray, ctx: Side) -> tuple[str, str | None]:
    f = decode_cell(cell)
    if not f.valid:
        return "untagged bytes (never written)", None
    dtype = TAG_DTYPE.get(f.tag)
    per_head = ctx.tokens_per_block * ctx.row_bytes
    _pp, tp = ctx.coords(f.p_rank) if f.p_rank < ctx.world else (0, 0)
    heads = ctx.heads_of(tp)
    local = f.offset // per_head
    head = heads[local] if local < len(heads) else local
    token = (f.offset // ctx.row_bytes) % ctx.tokens_per_block
    kv = "V" if f.region % 2 else ("K" if not ctx.mla else "latent")
    what = (f"ctx rank {f.p_rank} layer {f.region // 2} {kv} block {f.block} head {head} token {token}"
            + (f", encoded as {dtype}" if dtype else f", tag {f.tag:#x}"))
    return what, dtype


def prove(gen: Side, gen_rank: int, pool: Pool, ctx: Side, gen_blocks: list[int], ctx_blocks: list[int]) -> RowProof:
    """Every row of the request's gen blocks against the ctx row a correct transfer puts there: the ctx rank that
    holds that layer and head (any replica of a replicated head), its block at the same position, the same token."""
    if (ctx.tokens_per_block, ctx.head_dim, ctx.element_bytes, ctx.mla) != (
            gen.tokens_per_block, gen.head_dim, gen.element_bytes, gen.mla):
        arrived = int(np.count_nonzero(pool.blocks[np.asarray(gen_blocks, dtype=np.int64)]))
        return RowProof("skipped" if not arrived else "wrong", arrived=arrived,
                        first=None if not arrived else "bytes arrived in a geometry the gen does not share")
    want_tag = DTYPE_TAG[gen.dtype]
    _pp, tp = gen.coords(gen_rank)
    row, tpb = gen.row_bytes, gen.tokens_per_block
    per_head = tpb * row
    out = RowProof("ok")
    found_dtypes: set[str] = set()
    for pos, (gb, cb) in enumerate(zip(gen_blocks, ctx_blocks, strict=False)):
        for i, g in enumerate(pool.layers):
            c_pp = next((p for p in range(ctx.pp_size) if g in ctx.global_layers(p)), None)
            for kv in range(gen.kv_factor):
                at = pool.slab_at(i, kv)
                for h, head in enumerate(gen.heads_of(tp)):
                    got = pool.blocks[gb, at + h * per_head:at + (h + 1) * per_head].reshape(tpb, row)
                    out.rows += tpb
                    holders = [] if c_pp is None else [
                        (ctx.rank_of(c_pp, t), ctx.heads_of(t).index(head)) for t in range(ctx.tp_size)
                        if head in ctx.heads_of(t)]
                    bad = np.ones(tpb, dtype=bool)
                    for c_rank, c_head in holders:
                        exp = pattern(want_tag, c_rank, 2 * g + kv, np.asarray([cb]), c_head * per_head,
                                      per_head).reshape(tpb, row)
                        bad &= (got != exp).any(axis=1)
                    written = got.view(np.uint64).reshape(tpb, -1).any(axis=1)
                    out.arrived += int(written.sum())
                    if not bad.any():
                        continue
                    out.wrong += int(bad.sum())
                    t = int(np.flatnonzero(bad)[0])
                    what, dtype = _describe_found(got[t, :16], ctx)
                    if dtype is not None and dtype != gen.dtype:
                        found_dtypes.add(dtype)
                    if out.first is None:
                        should = (f"ctx rank {holders[0][0]} block {cb}" if holders else "no ctx rank holds it")
                        out.first = (f"gen block {gb} (request block {pos}) layer {g} {'KV'[kv]} head {head} "
                                     f"token {t}: should hold {should}, holds {what}")
    if not out.wrong:
        return out
    out.status = "empty" if not out.arrived else "partial" if out.arrived < out.rows else "wrong"
    if found_dtypes and out.arrived == out.rows and _right_but_dtype(gen, gen_rank, pool, ctx, gen_blocks,
                                                                       ctx_blocks, found_dtypes):
        out.status, out.found_dtype = "dtype", sorted(found_dtypes)[0]
    return out


def _right_but_dtype(gen: Side, gen_rank: int, pool: Pool, ctx: Side, gen_blocks: list[int], ctx_blocks: list[int],
                     dtypes: set[str]) -> bool:
    """Every row holds its right coordinate under the ctx's dtype tag: the bytes are the right ones, read by the
    gen in another dtype (silent wrong values)."""
    other = msgspec.structs.replace(gen, dtype=sorted(dtypes)[0])
    return prove(other, gen_rank, pool, ctx, gen_blocks, ctx_blocks).status == "ok"


def reads_as(value: float, written: str, read: str) -> float | None:
    """What `value`, written in dtype `written`, reads as in dtype `read` (same element size): the silent
    wrong value of T73, e.g. 1.0 in bfloat16 reads 1.875 in float16. None where pdcheck has no codec for it."""
    f32 = np.asarray([value], dtype=np.float32)
    bits: np.ndarray
    if written == "bfloat16":
        bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    elif written == "float16":
        bits = f32.astype(np.float16).view(np.uint16)
    else:
        return None
    if read == "float16":
        return float(bits.view(np.float16)[0])
    if read == "bfloat16":
        return float((bits.astype(np.uint32) << 16).view(np.float32)[0])
    return None
