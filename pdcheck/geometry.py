"""KV-cache geometry of one rank as vLLM lays it out: regions, bytes per block, head slices.

FlashAttention (non-MLA): one K and one V region per layer, block = [block_size, local_heads, head_dim].
FlashInfer: K and V share one region per layer, block = [2, block_size, local_heads, head_dim].
MLA: one region per layer, block = [block_size, latent_dim] (head_dim is the latent dim), replicated per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "uint8": 1,
}


@dataclass(frozen=True)
class Geometry:
    tp_size: int
    block_size: int  # tokens per block
    layers: int
    total_kv_heads: int
    head_dim: int
    dtype: str
    attn_backend: str
    use_mla: bool

    @property
    def elem_size(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def flashinfer(self) -> bool:
        return "FLASHINFER" in self.attn_backend.upper()

    @property
    def kv_replicated(self) -> bool:
        # tp == heads still gives every rank its own head; only tp > heads repeats heads across ranks.
        return self.use_mla or self.tp_size > self.total_kv_heads

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
    def block_len(self) -> int:
        """Bytes of one block in one region (vLLM's block_len)."""
        per = self.block_size * self.slot_size
        return 2 * per if (self.flashinfer and not self.use_mla) else per

    @property
    def num_regions(self) -> int:
        return self.layers if (self.use_mla or self.flashinfer) else 2 * self.layers

    def region_name(self, region: int) -> str:
        if self.use_mla:
            return f"layer {region} (MLA)"
        if self.flashinfer:
            return f"layer {region} (K+V)"
        return f"layer {region // 2} {'KV'[region % 2]}"
