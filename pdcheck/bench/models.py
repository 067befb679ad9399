"""Model presets (pdcheck.geometry.ModelShape) and --model/--layers/... resolved into one.

Shapes follow the models' HF configs. GQA models keep K and V per layer (two vLLM regions per layer);
MLA models (DeepSeek-V2/V3/R1) keep one latent region per layer of kv_lora_rank + qk_rope_head_dim
values per token, and that latent KV is replicated on every TP rank, not split.
"""

from __future__ import annotations

from msgspec.structs import replace

from pdcheck.bounds import MAX_HEAD_DIM, MAX_KV_HEADS, MAX_LAYERS, check_int
from pdcheck.errors import BadInput
from pdcheck.geometry import DTYPE_NAMES, ModelShape

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


CUSTOM = "custom"  # --model custom: no preset, the shape from --layers/--kv-heads/--head-dim


def preset_names() -> list[str]:
    return [m.name for m in PRESETS.values()]


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
    for flag, val, hi in (("--layers", layers, MAX_LAYERS), ("--kv-heads", kv_heads, MAX_KV_HEADS),
                          ("--head-dim", head_dim, MAX_HEAD_DIM)):
        if val is not None:
            check_int(flag, val, 1, hi)  # here, not only in the plan: 0 would read as "not given" below
    if dtype is not None and dtype.lower() not in DTYPE_NAMES:
        raise BadInput(f"--dtype {dtype!r} is not one of: bf16, fp16, fp32, fp8")
    if model is not None and model.strip().lower() == CUSTOM:
        model = None
    if model:
        base = PRESETS.get(model.lower())
        if base is None:
            raise BadInput(f"--model {model!r} is not a known preset; known: {', '.join(preset_names())}, or "
                           f"{CUSTOM} with --layers, --kv-heads and --head-dim")
    else:
        missing = [f for f, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-dim", head_dim))
                   if v is None and not (f == "--kv-heads" and mla)]
        if missing:
            raise BadInput(f"--model {CUSTOM} needs an explicit shape: missing {', '.join(missing)}")
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
