"""The msgpack maps of TensorRT-LLM's Python transceiver, per wire era: RankInfo (flat W1, nested W2/W3), the
W1 InstanceInfo reply, RecvReqInfo (GenReqInfo in W1a), as bytes on the wire and back (docs/trtllm-protocol.md
§3.4, §3.5, §3.7).

Encoding follows `msgpack.packb(dict)`: str as str, bytes as bin, None as nil, keys in the dataclass's order.
Decoding is TensorRT-LLM's `cls(**msgpack.unpackb(data))`: the key set must be exact (an unknown key or a missing
one is the TypeError it raises, T13), then every value is bounded before anything sizes a loop by it
(pdcheck.bounds.peer_doc): a peer's map is untrusted input (docs/reliability-untrusted.md)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from pdcheck import bounds as b
from pdcheck.netio import PeerError

I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec bounds stop at int64; an address fits uint64
Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
Count = Annotated[int, msgspec.Meta(ge=1, le=b.HARD_MAX_TP)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=b.HARD_MAX_TP * b.MAX_PP_SIZE)]
Str = Annotated[str, msgspec.Meta(max_length=b.MAX_PEER_STR)]
Endpoint = Annotated[str, msgspec.Meta(max_length=b.MAX_PEER_STR)]
Layers = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=b.MAX_LAYERS)]], msgspec.Meta(max_length=b.MAX_PP_SIZE)]
Endpoints = Annotated[list[Endpoint], msgspec.Meta(max_length=b.HARD_MAX_TP * b.MAX_PP_SIZE)]
Blob = Annotated[bytes, msgspec.Meta(max_length=1 << 20)]
MAX_IDS = 1 << 16  # block ids in one request: a prompt of 4096 tokens at 1 token per block, and some


class WireError(Exception):
    """What TensorRT-LLM's decoder raises on these bytes ("TypeError: ...", "ValueError: ..."), one line."""


class Attention(msgspec.Struct, frozen=True, kw_only=True):
    kv_heads_per_rank: Annotated[int, msgspec.Meta(ge=0, le=b.MAX_KV_HEADS)]
    tokens_per_block: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_BLOCK_SIZE)]
    dims_per_head: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_HEAD_DIM)]
    element_bytes: Annotated[int, msgspec.Meta(ge=1, le=8)] | Annotated[float, msgspec.Meta(gt=0, le=8)]
    enable_attention_dp: bool
    is_mla: bool


ATTENTION_KEYS = ("kv_heads_per_rank", "tokens_per_block", "dims_per_head", "element_bytes",
                  "enable_attention_dp", "is_mla")


class Pool(msgspec.Struct, frozen=True):
    base_address: U64
    slot_bytes: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_PEER_BLOCK_LEN)]
    num_slots: Annotated[int, msgspec.Meta(ge=0, le=b.MAX_NUM_BLOCKS)]


class PoolGroup(msgspec.Struct, frozen=True):
    pools: Annotated[list[Pool], msgspec.Meta(max_length=16)]


class LayerRef(msgspec.Struct, frozen=True):
    local_layer_id: Small
    global_layer_id: Small


class PoolView(msgspec.Struct, frozen=True):
    pool_idx: Small
    buffer_entries: Annotated[list[Annotated[list[U64], msgspec.Meta(max_length=3)]],
                              msgspec.Meta(max_length=4 * b.MAX_LAYERS)]
    pool_role: Annotated[list[Str], msgspec.Meta(max_length=4)]
    mapper_kind: Small


class LayerGroup(msgspec.Struct, frozen=True):
    pool_group_idx: Small
    kv_head_num_per_rank: Annotated[int, msgspec.Meta(ge=0, le=b.MAX_KV_HEADS)]
    sliding_window_size: Small | None
    local_layers: Annotated[list[LayerRef], msgspec.Meta(max_length=b.MAX_LAYERS)]
    pool_views: Annotated[list[PoolView], msgspec.Meta(max_length=16)]


class PageTable(msgspec.Struct, frozen=True):
    tokens_per_block: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_BLOCK_SIZE)]
    layer_groups: Annotated[list[LayerGroup], msgspec.Meta(max_length=16)]
    pool_groups: Annotated[list[PoolGroup], msgspec.Meta(max_length=16)]


class RankInfo3(msgspec.Struct, frozen=True, kw_only=True):
    """W2/W3 RankInfo (T33), values bounded."""

    instance_name: Str
    instance_rank: Rank
    tp_size: Count
    tp_rank: Rank
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_PP_SIZE)]
    pp_rank: Rank
    layer_num_per_pp: Layers
    sender_endpoints: Endpoints
    server_endpoint: Endpoint
    self_endpoint: Endpoint
    transfer_engine_info: Blob
    dp_size: Count
    dp_rank: Rank
    cp_size: Count
    cp_rank: Rank
    device_id: Small
    attention: Attention | None
    aux_meta: Any
    page_table: PageTable | None


RANK_INFO3 = ("instance_name", "instance_rank", "tp_size", "tp_rank", "pp_size", "pp_rank", "layer_num_per_pp",
              "sender_endpoints", "server_endpoint", "self_endpoint", "transfer_engine_info", "dp_size", "dp_rank",
              "cp_size", "cp_rank", "device_id", "attention", "aux_meta", "page_table")


class RankInfo1(msgspec.Struct, frozen=True, kw_only=True):
    """W1 flat RankInfo (T31); W1a names the receiver endpoint `recv_endpoint`."""

    instance_name: Str
    instance_rank: Rank
    tp_size: Count
    tp_rank: Rank
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_PP_SIZE)]
    pp_rank: Rank
    dp_size: Count
    dp_rank: Rank
    cp_size: Count
    cp_rank: Rank
    device_id: Small
    kv_heads_per_rank: Annotated[int, msgspec.Meta(ge=0, le=b.MAX_KV_HEADS)]
    tokens_per_block: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_BLOCK_SIZE)]
    dims_per_head: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_HEAD_DIM)]
    element_bytes: Annotated[int, msgspec.Meta(ge=1, le=8)]
    enable_attention_dp: bool
    is_mla: bool
    layer_num_per_pp: Layers
    kv_ptrs: Annotated[list[U64], msgspec.Meta(max_length=64)]
    aux_ptrs: Annotated[list[U64], msgspec.Meta(max_length=64)]
    server_endpoint: Endpoint
    self_endpoint: Endpoint = ""
    recv_endpoint: Endpoint = ""
    transfer_engine_info: Blob
    aux_meta: Any


_FLAT = ("instance_name", "instance_rank", "tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "dp_rank",
         "cp_size", "cp_rank", "device_id", "kv_heads_per_rank", "tokens_per_block", "dims_per_head",
         "element_bytes", "enable_attention_dp", "is_mla", "layer_num_per_pp", "kv_ptrs", "aux_ptrs",
         "server_endpoint")
RANK_INFO1 = (*_FLAT, "self_endpoint", "transfer_engine_info", "aux_meta")
RANK_INFO1A = (*_FLAT, "recv_endpoint", "transfer_engine_info", "aux_meta")


class InstanceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """W1's REQUEST_INSTANCE_INFO reply (T32); W1a names the sender endpoints `ctx_endpoints`."""

    instance_name: Str
    tp_size: Count
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_PP_SIZE)]
    dp_size: Count
    cp_size: Count
    kv_heads_per_rank: Annotated[int, msgspec.Meta(ge=0, le=b.MAX_KV_HEADS)]
    tokens_per_block: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_BLOCK_SIZE)]
    dims_per_head: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_HEAD_DIM)]
    element_bytes: Annotated[int, msgspec.Meta(ge=1, le=8)]
    enable_attention_dp: bool
    is_mla: bool
    layer_num_per_pp: Layers
    sender_endpoints: Endpoints = []
    ctx_endpoints: Endpoints = []


_INSTANCE = ("instance_name", "tp_size", "pp_size", "dp_size", "cp_size", "kv_heads_per_rank", "tokens_per_block",
             "dims_per_head", "element_bytes", "enable_attention_dp", "is_mla", "layer_num_per_pp")
INSTANCE1 = (*_INSTANCE, "sender_endpoints")
INSTANCE1A = (*_INSTANCE, "ctx_endpoints")


class Req(msgspec.Struct, frozen=True, kw_only=True):
    """A gen's request, whatever its era calls the fields (T27-T30)."""

    sender_req_id: I64
    instance_name: Str
    instance_rank: Rank
    block_ids: Annotated[list[I64], msgspec.Meta(max_length=MAX_IDS)]
    unique_rid: I64
    slice_id: I64 = 0


REQ = {  # the exact key set of each era's request map, in order
    "W1a": ("ctx_req_id", "instance_name", "instance_rank", "blocks", "unique_rid", "start_token_idx", "aux_slot"),
    "W1b": ("sender_req_id", "instance_name", "instance_rank", "block_ids", "unique_rid", "start_token_idx",
            "aux_slot"),
    "W2a": ("sender_req_id", "instance_name", "instance_rank", "block_ids_per_layer_groups", "unique_rid",
            "start_token_idx", "aux_slot"),
    "W2b": ("sender_req_id", "instance_name", "instance_rank", "block_ids_per_layer_groups", "unique_rid",
            "start_token_idx", "aux_slot", "mamba_state_index", "slice_id"),
    "W3": ("sender_req_id", "instance_name", "instance_rank", "block_ids_per_layer_groups", "unique_rid",
           "dst_start_token", "aux_slot", "slice_id", "bounce_dst_base"),
}
REQ_CLASS = {"W1a": "GenReqInfo"}


# ------------------------------------------------------------------------------------------------ decoding
def unpack(data: bytes, cls: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """msgpack.unpackb then `cls(**map)`'s key check: the map, or the WireError TensorRT-LLM raises."""
    try:
        doc = msgspec.msgpack.decode(data)
    except msgspec.DecodeError as exc:
        raise WireError(f"ExtraData/UnpackValueError: {exc}") from None
    if not isinstance(doc, dict):
        raise WireError(f"TypeError: {cls}() argument after ** must be a mapping, not {type(doc).__name__}")
    extra = [k for k in doc if k not in keys]
    if extra:
        raise WireError(f"TypeError: {cls}.__init__() got an unexpected keyword argument {b.peer_text(extra[0], 64)!r}")
    missing = [k for k in keys if k not in doc]
    if missing:
        raise WireError(f"TypeError: {cls}.__init__() missing {len(missing)} required positional argument"
                        f"{'s' if len(missing) > 1 else ''}: {', '.join(repr(k) for k in missing[:3])}")
    return doc


def bounded(doc: Any, typ: type[Any], where: str) -> Any:
    """`doc` as the bounded Struct `typ`; a value out of bounds or of the wrong type is WireError (a fake rank
    logs it) and, read from a live peer, PeerError (pdcheck.bounds.peer_doc)."""
    try:
        return b.peer_doc(doc, typ, where)
    except PeerError as exc:
        raise WireError(str(exc)) from None


def ids_of(items: Any, wire: str) -> list[int]:
    """Block ids of the first layer group: msgpack ints (W1, W2a) or int64 bytes (W2b, W3: np.frombuffer, T30)."""
    if wire in ("W2b", "W3", "corrected"):
        if not isinstance(items, list) or not items:
            raise WireError("IndexError: list index out of range (block_ids_per_layer_groups)")
        raw = items[0]
        if not isinstance(raw, bytes):
            raise WireError(f"TypeError: a bytes-like object is required, not '{type(raw).__name__}'")
        if len(raw) % 8:
            raise WireError("ValueError: buffer size must be a multiple of element size")
        if len(raw) // 8 > MAX_IDS:
            raise WireError(f"{len(raw) // 8} block ids; at most {MAX_IDS} are read")
        return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, len(raw), 8)]
    if wire == "W2a":
        items = items[0] if isinstance(items, list) and items else items
    if not isinstance(items, list) or len(items) > MAX_IDS or not all(
            isinstance(x, int) and not isinstance(x, bool) and -(1 << 63) <= x < (1 << 63) for x in items):
        raise WireError("TypeError: block ids are not a list of integers")
    return list(items)


def id_bytes(ids: list[int]) -> bytes:
    """np.asarray(ids, np.int64).tobytes(): little-endian int64 on the hosts TensorRT-LLM targets (T30)."""
    return b"".join(int(i).to_bytes(8, "little", signed=True) for i in ids)
