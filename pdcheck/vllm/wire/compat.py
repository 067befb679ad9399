"""The G/H compatibility hash (docs/vllm-protocol.md §3.5): sha256 of json.dumps(factors, sort_keys=True)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

TORCH_DTYPE = {"bfloat16": "torch.bfloat16", "float16": "torch.float16", "float32": "torch.float32",
               "fp8": "torch.float8_e4m3fn", "fp8_e4m3": "torch.float8_e4m3fn", "fp8_e5m2": "torch.float8_e5m2",
               "uint8": "torch.uint8"}


def factors(keys: tuple[str, ...], *, vllm_version: str, connector_version: int, model: str, dtype: str,
            num_kv_heads: int, head_size: int, num_hidden_layers: int, attn_backend_name: str,
            cache_dtype: str = "auto", extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The factor dict of one release line: `keys` says which factors that line hashes."""
    every: dict[str, Any] = {
        "vllm_version": vllm_version, "nixl_connector_version": connector_version, "model": model,
        "dtype": TORCH_DTYPE.get(dtype, dtype), "num_kv_heads": num_kv_heads, "head_size": head_size,
        "num_hidden_layers": num_hidden_layers, "attn_backend_name": attn_backend_name, "cache_dtype": cache_dtype,
        "cross_layers_blocks": False, "is_hma_enabled": False, "speculative_config": None, "transfer_mode": "pull",
        **(extra or {}),
    }
    return {k: every[k] for k in keys}


def compat_hash(f: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest()
