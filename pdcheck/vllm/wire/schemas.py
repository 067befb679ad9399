"""vLLM's NixlAgentMetadata per wire schema, field for field and in encode order (docs/vllm-protocol.md §3.4/§3.6).

Eras A-E are msgspec Structs (map-encoded; subclass fields follow parent fields, which reproduces
vLLM's key order). From F on vLLM uses plain dataclasses, which msgspec encodes with every field,
defaults included. Decoding with these types is exactly the strict decode each release performs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

import msgspec

_AE = {"omit_defaults": True, "dict": True}


class MetaA(msgspec.Struct, **_AE):  # 0.9.0
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    num_blocks: int


class MetaB(MetaA, **_AE):  # 0.9.1
    tp_size: int
    block_len: int
    attn_backend_name: str


class MetaC(MetaA, **_AE):  # 0.9.2 - 0.10.0
    block_len: int
    attn_backend_name: str


class MetaD(MetaC, **_AE):  # 0.10.1 - 0.10.2
    kv_cache_layout: str


class MetaE(MetaA, **_AE):  # 0.11.0
    block_lens: list[int]
    attn_backend_name: str
    kv_cache_layout: str


@dataclasses.dataclass
class MetaF:  # 0.11.1 - 0.12
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    attn_backend_name: str
    kv_cache_layout: str
    block_size: int


@dataclasses.dataclass
class MetaG:  # 0.13 - 0.16 (attn backend moved into the compatibility hash)
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    kv_cache_layout: str
    block_size: int


@dataclasses.dataclass
class MetaG18(MetaG):  # 0.18 - 0.19
    ssm_sizes: tuple[int, int]


@dataclasses.dataclass
class MetaG20(MetaG):  # 0.20
    ssm_sizes: tuple[int, int]
    attn_backend_name: str


@dataclasses.dataclass
class MetaG24(MetaG20):  # 0.21 - 0.28
    physical_blocks_per_logical_kv_block: int


@dataclasses.dataclass
class MetaH29:  # 0.29: block_strides and dcp/pcp sizes, no per-region fields yet (read in the 0.29.0 wheel)
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    dcp_size: int = 1
    pcp_size: int = 1


@dataclasses.dataclass
class MetaH31:  # 0.30 - 0.33
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    region_members: list[list[str]] = field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclasses.dataclass
class MetaH34:  # 0.34
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = field(default_factory=list)
    layer_group_ids: dict[str, int] = field(default_factory=dict)
    packed_member_layouts: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclasses.dataclass
class HandshakePayload:  # G/H outer frame (NixlHandshakePayload)
    compatibility_hash: str
    agent_metadata_bytes: bytes


class AnyMeta(msgspec.Struct):
    """Tolerant view of any era's metadata: required core, everything else optional (docs/vllm-protocol.md §3.6)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    num_blocks: int
    device_id: int | None = None
    tp_size: int | None = None
    block_len: int | None = None
    block_lens: list[int] | None = None
    block_strides: list[int] | None = None
    attn_backend_name: str | None = None
    kv_cache_layout: str | None = None
    block_size: int | None = None
    ssm_sizes: tuple[int, int] | None = None
    physical_blocks_per_logical_kv_block: int | None = None
    region_names: list[str] | None = None  # 0.30+
    region_members: list[list[str]] | None = None  # 0.31+ (0.34 requires one entry per region)
    region_group_ids: list[int] | None = None  # 0.31+: the KV-cache group of each region (hybrid models)


class AnyPayload(msgspec.Struct):
    compatibility_hash: str
    agent_metadata_bytes: bytes


SCHEMAS: dict[str, type] = {
    "A": MetaA, "B": MetaB, "C": MetaC, "D": MetaD, "E": MetaE, "F": MetaF,
    "G": MetaG, "G18": MetaG18, "G20": MetaG20, "G24": MetaG24, "H": MetaG24, "H29": MetaH29, "H31": MetaH31, "H34": MetaH34,
}


def field_names(schema: type) -> list[str]:
    if dataclasses.is_dataclass(schema):
        return [f.name for f in dataclasses.fields(schema)]
    return list(schema.__struct_fields__)  # type: ignore[attr-defined]
