"""Model presets and the KV shape a rank holds.

Shapes follow the models' HF configs. GQA models keep K and V per layer (two vLLM regions per layer);
MLA models (DeepSeek-V2/V3/R1) keep one latent region per layer of kv_lora_rank + qk_rope_head_dim
values per token, and that latent KV is replicated on every TP rank, not split.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdcheck.errors import BadInput
from pdcheck.geometry import DTYPE_BYTES, Geometry

# The names transfer-bench accepts -> pdcheck.geometry's (one table of element sizes for both commands).
DTYPES: dict[str, str] = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int  # total KV heads (GQA); 1 for MLA (the latent vector is one "head")
    head_dim: int  # per head; for MLA the latent width kv_lora_rank + qk_rope_head_dim
    dtype: str = "bf16"
    mla: bool = False

    def geometry(self, tp: int, block_tokens: int) -> Geometry:
        """What one of `tp` ranks holds, in vLLM's split K/V FlashAttention layout (one K and one V region per
        layer; MLA: one latent region per layer) with heads-first blocks, as `pdcheck handshake` registers it."""
        return Geometry(tp_size=tp, block_size=block_tokens, layers=self.layers, total_kv_heads=self.kv_heads,
                        head_dim=self.head_dim, dtype=DTYPES[self.dtype], attn_backend="FLASH_ATTN",
                        use_mla=self.mla)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[DTYPES[self.dtype]]

    @property
    def regions(self) -> int:
        return self.geometry(1, 1).num_regions


PRESETS: dict[str, ModelShape] = {
    m.name.lower(): m
    for m in (
        ModelShape("Llama-3.1-8B", layers=32, kv_heads=8, head_dim=128),
        ModelShape("Llama-3.1-70B", layers=80, kv_heads=8, head_dim=128),
        ModelShape("Llama-3.1-405B", layers=126, kv_heads=8, head_dim=128),
        ModelShape("Qwen3-8B", layers=36, kv_heads=8, head_dim=128),
        ModelShape("Qwen3-32B", layers=64, kv_heads=8, head_dim=128),
        ModelShape("Qwen3-235B-A22B", layers=94, kv_heads=4, head_dim=128),
        # kv_lora_rank 512 + qk_rope_head_dim 64 = 576 latent values per token per layer.
        ModelShape("DeepSeek-V3", layers=61, kv_heads=1, head_dim=576, mla=True),
        ModelShape("DeepSeek-R1", layers=61, kv_heads=1, head_dim=576, mla=True),
    )
}


def preset_names() -> list[str]:
    return [m.name for m in PRESETS.values()]


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise BadInput(f"{flag} must be a positive integer, got {value}")


def resolve_shape(
    model: str | None,
    *,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str | None = None,
    mla: bool | None = None,
) -> ModelShape:
    """A preset with explicit flags layered on top, or a fully explicit shape when no preset is named."""
    for flag, val in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim)):
        _positive(flag, val)
    if dtype is not None and dtype.lower() not in DTYPES:
        raise BadInput(f"--dtype {dtype!r} is not one of: bf16, fp16, fp32, fp8")
    if model:
        base = PRESETS.get(model.lower())
        if base is None:
            raise BadInput(f"--model {model!r} is not a known preset; known: {', '.join(preset_names())}")
    else:
        missing = [f for f, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim))
                   if v is None and not (f == "--kv-heads" and mla)]
        if missing:
            raise BadInput(f"without --model, give an explicit shape: missing {', '.join(missing)}")
        base = ModelShape("custom", layers=layers or 1, kv_heads=kv_heads or 1, head_dim=head_dim or 1)
    shape = replace(
        base,
        layers=layers or base.layers,
        kv_heads=kv_heads or base.kv_heads,
        head_dim=head_dim or base.head_dim,
        dtype=(dtype or base.dtype).lower(),
        mla=base.mla if mla is None else mla,
    )
    if shape.mla:
        shape = replace(shape, kv_heads=1)
    if shape != base and model:
        shape = replace(shape, name=f"{base.name} (modified)")
    return shape
