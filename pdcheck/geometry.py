"""KV-cache geometry of one rank as vLLM lays it out: regions, bytes per block, head slices.

FlashAttention (non-MLA) depends on the release (kv_regions, set from the release model by releases.for_release):
- "split" (up to 0.22, cache [2, num_blocks, ...]): one K and one V region per layer, block = [block_size,
  local_heads, head_dim] (or heads first, HND);
- "blocks_first" (0.23 - 0.25, cache [num_blocks, 2, ...]): one region per layer, block = [2, block_size,
  local_heads, head_dim]; vLLM indexes K and V as two virtual halves of each block;
- "packed" (0.26+, cache [num_blocks, heads, block_size, 2 * head_dim] permuted by the layout): one region per
  layer, K and V packed per (head, token) cell, so a head slice (HND) is one contiguous run of both.
FlashInfer: K and V share one region per layer, block = [2, block_size, local_heads, head_dim].
MLA: one region per layer, block = [block_size, latent_dim] (head_dim is the latent dim), replicated per rank.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pdcheck.kvsplit import corrected_reads

KVRegions = Literal["split", "blocks_first", "packed"]

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "uint8": 1,
}


class Geometry(msgspec.Struct, frozen=True):
    """One rank's KV geometry; it travels to the rank inside its spec message as it is (msgspec)."""

    tp_size: int
    block_size: int  # tokens per block
    layers: int
    total_kv_heads: int
    head_dim: int
    dtype: str
    attn_backend: str
    use_mla: bool
    kv_regions: KVRegions = "split"  # FlashAttention's per-release cache layout (module docstring)

    @property
    def elem_size(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def flashinfer(self) -> bool:
        return "FLASHINFER" in self.attn_backend.upper()

    @property
    def local_kv_heads(self) -> int:
        if self.use_mla:
            return 1
        return max(1, self.total_kv_heads // self.tp_size)

    @property
    def slot_size(self) -> int:
        """Bytes per token per region (vLLM's slot_size_bytes)."""
        return self.elem_size * self.local_kv_heads * self.head_dim

    @property
    def joint_kv(self) -> bool:
        """K and V in one region per layer (FlashInfer; FlashAttention from 0.23), not MLA."""
        return not self.use_mla and (self.flashinfer or self.kv_regions != "split")

    @property
    def packed(self) -> bool:
        """K and V packed per (head, token) cell (FlashAttention 0.26+)."""
        return not self.use_mla and not self.flashinfer and self.kv_regions == "packed"

    @property
    def block_len(self) -> int:
        """Bytes of one block in one region (vLLM's block_len, block_lens[i] on the wire)."""
        per = self.block_size * self.slot_size
        return 2 * per if self.joint_kv else per

    @property
    def num_regions(self) -> int:
        return self.layers if (self.use_mla or self.joint_kv) else 2 * self.layers

    @property
    def kv_halves(self) -> int:
        """2 where vLLM reads K and V as two virtual halves of each block (FlashAttention blocks-first, 0.23 -
        0.25: _build_fa_remote's second split, V at block_len // 2); 1 where a block is read as one run."""
        return 2 if (self.kv_regions == "blocks_first" and not self.use_mla and not self.flashinfer) else 1

    @property
    def head_cell_bytes(self) -> int:
        """Bytes of one (head, token) cell of a block: head_dim elements, K and V together when packed."""
        return self.elem_size * self.head_dim * (2 if self.packed else 1)

    @property
    def per_head_view(self) -> bool:
        """Whether a block is a grid of (head, token) cells that a layout orders (not MLA, not K|V halves)."""
        return not self.use_mla and not self.flashinfer and self.kv_regions != "blocks_first"

    @staticmethod
    def layer_name(layer: int) -> str:
        """The attention layer's name in vLLM's kv_caches dict (a Llama-style model)."""
        return f"model.layers.{layer}.self_attn.attn"

    def region_layers(self) -> list[str]:
        """The layer each registered region belongs to, in registration order (region_names on the wire)."""
        per = 1 if (self.use_mla or self.joint_kv) else 2
        return [self.layer_name(r // per) for r in range(self.num_regions)]

    def region_name(self, region: int) -> str:
        if self.use_mla:
            return f"layer {region} (MLA)"
        if self.packed:
            return f"layer {region} (K|V per head)"
        if self.joint_kv:
            return f"layer {region} (K+V)"
        return f"layer {region // 2} {'KV'[region % 2]}"

    def head_start(self, rank: int) -> int:
        """The first KV head TP rank `rank` holds: heads split in rank order; with more ranks than heads,
        consecutive ranks replicate one head; MLA's latent is held whole by every rank."""
        if self.use_mla:
            return 0
        if self.tp_size <= self.total_kv_heads:
            return rank * self.local_kv_heads
        return rank // max(1, self.tp_size // self.total_kv_heads)

    @property
    def head_slice_bytes(self) -> int:
        """Bytes of one head's run in a heads-first (HND) block: block_size tokens of head_dim elements."""
        return self.block_size * self.head_cell_bytes


def read_source(p: Geometry, d: Geometry, d_rank: int) -> tuple[int, int] | None:
    """Which P rank D rank `d_rank` reads its heads from (the corrected model's choice, kvsplit.corrected_reads),
    and at what byte offset of a heads-first P block its slice starts. None where the corrected model reads
    several P ranks for one D rank (its heads span several P ranks) or that rank does not hold them whole."""
    reads = corrected_reads(d_rank, d.tp_size, p.tp_size, d.total_kv_heads, d.use_mla)
    if len(reads) != 1:
        return None
    src, lo, n = reads[0], d.head_start(d_rank), d.local_kv_heads
    if not (p.head_start(src) <= lo and lo + n <= p.head_start(src) + p.local_kv_heads):
        return None  # TP sizes that do not divide: no P rank holds this D rank's heads whole
    return src, (lo - p.head_start(src)) * d.head_slice_bytes


# Dtype names a model shape may give -> Geometry's (one table of element sizes for every command).
DTYPE_NAMES: dict[str, str] = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
}


class ModelShape(msgspec.Struct, frozen=True):
    """A model's KV shape, before TP splits it (transfer-bench's --model presets; it crosses the rank pipe)."""

    name: str
    layers: int
    kv_heads: int  # total KV heads (GQA); 1 for MLA (the latent vector is one "head")
    head_dim: int  # per head; for MLA the latent width kv_lora_rank + qk_rope_head_dim
    dtype: str = "bf16"  # a DTYPE_NAMES key
    mla: bool = False

    def geometry(self, tp: int, block_tokens: int) -> Geometry:
        """What one of `tp` ranks holds, in vLLM's split K/V FlashAttention layout (one K and one V region per
        layer; MLA: one latent region per layer) with heads-first blocks, as `pdcheck handshake` registers it."""
        return Geometry(tp_size=tp, block_size=block_tokens, layers=self.layers, total_kv_heads=self.kv_heads,
                        head_dim=self.head_dim, dtype=DTYPE_NAMES[self.dtype], attn_backend="FLASH_ATTN",
                        use_mla=self.mla)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[DTYPE_NAMES[self.dtype]]

    @property
    def regions(self) -> int:
        return self.geometry(1, 1).num_regions
