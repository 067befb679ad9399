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
GroupKind = Literal["full", "sliding_window", "mamba"]


class KVGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One KV-cache group of a hybrid model (vLLM's KVCacheGroupSpec): its kind, how many layers it holds and,
    for sliding-window attention, its window in tokens. A group's layers follow the previous group's, so its
    regions are one contiguous run of the cache (Geometry.group_regions). A Mamba/SSM layer is one region of
    whole-state pages: the hybrid manager pads every group's page to one size, so its state (conv | ssm) is one
    block of block_len bytes, read whole."""

    kind: GroupKind
    layers: int
    window: int = 0  # tokens; sliding_window only

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
    groups: tuple[KVGroup, ...] = ()  # hybrid models: KV-cache groups in layer order; () is one full group
    # --[no-]disable-hybrid-kv-cache-manager as deployed: None leaves it to vLLM (releases.hybrid.hma_enabled)
    hma: bool | None = None
    ssm_conv_layout: str = "SD"  # VLLM_SSM_CONV_STATE_LAYOUT (unset: SD); 0.20+ NIXL needs DS for Mamba (releases.hybrid)
    # Bytes from one block's start to the next (block_strides on the 0.29+ wire); 0: blocks abut (block_len). A
    # compressed MLA cache (fp8_ds_mla) pads each storage row past its page: NIXL connector version 10 (0.30+)
    # reads only the block_len-byte page of every block_stride-byte row, a "dense virtual page".
    block_stride: int = 0

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
    def row_len(self) -> int:
        """Bytes between the starts of two blocks of one region: block_stride, or block_len when blocks abut."""
        return self.block_stride or self.block_len

    @property
    def attn_regions_per_layer(self) -> int:
        return 1 if (self.use_mla or self.joint_kv) else 2

    def _regions_of(self, group: KVGroup) -> int:
        return group.layers if group.kind == "mamba" else group.layers * self.attn_regions_per_layer

    @property
    def num_regions(self) -> int:
        if self.groups:
            return sum(self._regions_of(gr) for gr in self.groups)
        return self.layers * self.attn_regions_per_layer

    @property
    def hybrid(self) -> bool:
        """More than one kind of KV-cache group, or any group that is not full attention."""
        return any(gr.kind != "full" for gr in self.groups)

    @property
    def has_mamba(self) -> bool:
        return any(gr.kind == "mamba" for gr in self.groups)

    def group_regions(self) -> list[tuple[int, int]]:
        """[first, last) region of each group (one group of every region when there are no groups)."""
        if not self.groups:
            return [(0, self.num_regions)]
        out, first = [], 0
        for gr in self.groups:
            out.append((first, first + self._regions_of(gr)))
            first = out[-1][1]
        return out

    def region_group_ids(self) -> list[int]:
        """The group each region belongs to, in registration order (region_group_ids on the 0.31+ wire)."""
        return [i for i, (a, z) in enumerate(self.group_regions()) for _ in range(a, z)]

    def region_layer(self, region: int) -> int:
        """The model layer a registered region belongs to (layers count across groups)."""
        return self._region_layer(region)[1]

    def _region_layer(self, region: int) -> tuple[int, int, int]:
        """(group, layer, region index inside the layer) of a region; layers count across groups."""
        if not self.groups:
            per = self.attn_regions_per_layer
            return 0, region // per, region % per
        layer0 = 0
        for i, ((a, z), gr) in enumerate(zip(self.group_regions(), self.groups, strict=True)):
            if a <= region < z:
                per = 1 if gr.kind == "mamba" else self.attn_regions_per_layer
                return i, layer0 + (region - a) // per, (region - a) % per
            layer0 += gr.layers
        raise IndexError(region)

    @property
    def ssm_sizes(self) -> tuple[int, int]:
        """(conv, ssm) state bytes of one Mamba page, as the 0.18+ wire carries them; (0, 0) without Mamba. One
        page of block_len bytes holds both: pdcheck gives the conv state the first quarter (16-byte cells)."""
        if not self.has_mamba:
            return (0, 0)
        conv = max(16, self.block_len // 4 // 16 * 16)
        return (conv, self.block_len - conv)

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
        out = []
        for r in range(self.num_regions):
            gi, layer, _part = self._region_layer(r)
            mamba = bool(self.groups) and self.groups[gi].kind == "mamba"
            out.append(f"model.layers.{layer}.mixer" if mamba else self.layer_name(layer))  # a Mamba block's mixer
        return out

    def region_name(self, region: int) -> str:
        if self.groups:
            gi, layer, part = self._region_layer(region)
            gr = self.groups[gi]
            what = {"full": "full attention", "sliding_window": f"sliding window {gr.window}",
                    "mamba": "Mamba/SSM state"}[gr.kind]
            if gr.kind == "mamba":
                return f"group {gi} ({what}) layer {layer} (conv|ssm state)"
            inner = Geometry(tp_size=self.tp_size, block_size=self.block_size, layers=1,
                             total_kv_heads=self.total_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                             attn_backend=self.attn_backend, use_mla=self.use_mla, kv_regions=self.kv_regions)
            return f"group {gi} ({what}) {inner.region_name(part).replace('layer 0', f'layer {layer}')}"
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
