"""The ZMQ frames of TensorRT-LLM's Python transceiver per wire era (docs/trtllm-protocol.md §3): message types,
the REQUEST_INSTANCE_INFO reply, REGISTER_RANK_INFO, REQUEST_DATA and the result frames, encoded byte for byte
and decoded as each era's decoder does (strictly: a frame of another era is the exception that era raises, T13).
`corrected` is W3 plus the KV dtype in the attention map (pdcheck's proposal, T73)."""

from __future__ import annotations

import struct
from typing import Any, Literal

import msgspec

from pdcheck import bounds as b
from pdcheck.trtllm import maps
from pdcheck.trtllm.layout import View
from pdcheck.trtllm.maps import WireError

INFO = b"REQUEST_INSTANCE_INFO"
REQUEST_DATA = b"REQUEST_DATA"
TERMINATION = b"TERMINATION"
W1A_VARIANT_REGISTER = b"REQUEST_RANK_INFO"  # REGISTER_RANK_INFO's value in nine W1a versions (T10)
STATUS = {0: "SUCCESS", 1: "FAILED", 2: "IN_DOUBT"}
KV_RESULT = struct.Struct("<qqq?Bq")  # W3: instance_rank, unique_rid, receiver_slice_id, is_last, status, size


class Era(msgspec.Struct, frozen=True):
    name: str
    register: bytes  # REGISTER_RANK_INFO's bytes
    result: bytes  # the KV result message type
    sender_types: frozenset[bytes]  # what the ctx's Sender listener knows
    info: Literal["instance", "rank"]  # the REQUEST_INSTANCE_INFO reply: W1's InstanceInfo or a RankInfo
    rank_info: Literal["w1a", "w1", "w3"]


_W1 = frozenset({TERMINATION, b"PEER_INFO", REQUEST_DATA, INFO, b"REGISTER_RANK_INFO"})
_W2 = frozenset({TERMINATION, REQUEST_DATA, INFO, b"REGISTER_RANK_INFO"})
ERAS = {
    "W1a": Era("W1a", b"REGISTER_RANK_INFO", b"TASK_STATE", _W1 | {b"TASK_STATE", b"AUX_SEND_STATE"}, "instance",
               "w1a"),
    "W1b": Era("W1b", b"REGISTER_RANK_INFO", b"TASK_STATUS", _W1 | {b"TASK_STATUS", b"AUX_SEND_STATUS"}, "instance",
               "w1"),
    "W2a": Era("W2a", b"REGISTER_RANK_INFO", b"KV_AGENT_RESULT", _W2, "rank", "w3"),
    "W2b": Era("W2b", b"REGISTER_RANK_INFO", b"KV_AGENT_RESULT", _W2 | {b"CANCEL_SESSION"}, "rank", "w3"),
    "W3": Era("W3", b"REGISTER_RANK_INFO", b"KV_AGENT_RESULT", _W2 | {b"CANCEL_SESSION"}, "rank", "w3"),
    "corrected": Era("corrected", b"REGISTER_RANK_INFO", b"KV_AGENT_RESULT", _W2 | {b"CANCEL_SESSION"}, "rank",
                     "w3"),
}
REFUSED = b"REGISTER_REFUSED"  # corrected: the ctx answers a registration it refuses (pdcheck's frame)


class Facts(msgspec.Struct, frozen=True, kw_only=True):
    """What one fake rank advertises about itself (its RankInfo's values)."""

    instance_name: str
    rank: int
    view: View  # its layout and pool
    pp_size: int
    sender_endpoints: list[str]
    self_endpoint: str
    blob: bytes  # transfer_engine_info
    dtype: str = ""  # corrected only: the KV dtype itself


class Peer(msgspec.Struct, frozen=True, kw_only=True):
    """A peer's RankInfo (or a W1 InstanceInfo) as the other side uses it."""

    instance_name: str
    rank: int
    view: View
    pp_size: int
    sender_endpoints: list[str]
    self_endpoint: str
    blob: bytes
    dtype: str = ""


def _attention(v: View, dtype: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"kv_heads_per_rank": v.kv_heads_per_rank, "tokens_per_block": v.tokens_per_block,
                           "dims_per_head": v.dims_per_head, "element_bytes": v.element_bytes,
                           "enable_attention_dp": False, "is_mla": v.is_mla}
    if dtype:
        doc["dtype"] = dtype
    return doc


def _page_table(v: View) -> dict[str, Any]:
    """KVCachePageTable.to_dict() of a plain attention model with one window size (T38, T39)."""
    layers = list(v.layers)
    stride = v.layer_kv_bytes * v.kv_factor
    entries = [[i, i * stride + k * v.layer_kv_bytes, v.layer_kv_bytes] for i in range(len(layers))
               for k in range(v.kv_factor)]
    return {"tokens_per_block": v.tokens_per_block, "layer_groups": [{
        "pool_group_idx": 0, "kv_head_num_per_rank": v.kv_heads_per_rank, "sliding_window_size": None,
        "local_layers": [{"local_layer_id": i, "global_layer_id": g} for i, g in enumerate(layers)],
        "pool_views": [{"pool_idx": 0, "buffer_entries": entries,
                        "pool_role": ["key"] if v.is_mla else ["key", "value"], "mapper_kind": 0}]}],
        "pool_groups": [{"pools": [{"base_address": v.base_address, "slot_bytes": v.slot_bytes,
                                    "num_slots": v.num_slots}]}]}


def rank_info(era: str, f: Facts) -> bytes:
    """RankInfo.to_bytes() of era `era` (T31, T33)."""
    v = f.view
    if ERAS[era].rank_info == "w3":
        doc = {"instance_name": f.instance_name, "instance_rank": f.rank, "tp_size": v.tp_size,
               "tp_rank": v.tp_rank, "pp_size": f.pp_size, "pp_rank": v.pp_rank,
               "layer_num_per_pp": list(v.layer_num_per_pp), "sender_endpoints": f.sender_endpoints,
               "server_endpoint": "", "self_endpoint": f.self_endpoint, "transfer_engine_info": f.blob,
               "dp_size": 1, "dp_rank": 0, "cp_size": 1, "cp_rank": 0, "device_id": 0,
               "attention": _attention(v, f.dtype if era == "corrected" else ""), "aux_meta": None,
               "page_table": _page_table(v)}
        return msgspec.msgpack.encode(doc)
    doc = {"instance_name": f.instance_name, "instance_rank": f.rank, "tp_size": v.tp_size, "tp_rank": v.tp_rank,
           "pp_size": f.pp_size, "pp_rank": v.pp_rank, "dp_size": 1, "dp_rank": 0, "cp_size": 1, "cp_rank": 0,
           "device_id": 0, **_attention(v, ""), "layer_num_per_pp": list(v.layer_num_per_pp),
           "kv_ptrs": [v.base_address], "aux_ptrs": [], "server_endpoint": ""}
    doc["recv_endpoint" if era == "W1a" else "self_endpoint"] = f.self_endpoint
    doc.update(transfer_engine_info=f.blob, aux_meta=None)
    return msgspec.msgpack.encode(doc)


def instance_info(era: str, f: Facts) -> bytes:
    """W1's InstanceInfo (T32): the instance as rank 0 sees it."""
    v = f.view
    doc = {"instance_name": f.instance_name, "tp_size": v.tp_size, "pp_size": f.pp_size, "dp_size": 1,
           "cp_size": 1, **{k: x for k, x in _attention(v, "").items()},
           "layer_num_per_pp": list(v.layer_num_per_pp),
           ("ctx_endpoints" if era == "W1a" else "sender_endpoints"): f.sender_endpoints}
    return msgspec.msgpack.encode(doc)


def info_reply(era: str, f: Facts) -> bytes:
    return instance_info(era, f) if ERAS[era].info == "instance" else rank_info(era, f)


def _view(tp: int, tp_rank: int, pp_rank: int, lnpp: list[int], att: Any, base: int, slot: int, slots: int) -> View:
    return View(tp_size=tp, tp_rank=tp_rank, pp_rank=min(pp_rank, max(0, len(lnpp) - 1)),
                layer_num_per_pp=tuple(lnpp) or (0,), kv_heads_per_rank=att.kv_heads_per_rank,
                tokens_per_block=att.tokens_per_block, dims_per_head=att.dims_per_head,
                element_bytes=int(att.element_bytes), is_mla=att.is_mla, base_address=base, slot_bytes=slot,
                num_slots=slots)


def decode_rank_info(era: str, data: bytes, where: str = "RankInfo") -> Peer:
    """RankInfo.from_bytes of era `era`: its key check, then bounds; WireError otherwise."""
    kind = ERAS[era].rank_info
    if kind == "w3":
        doc = maps.unpack(data, "RankInfo", maps.RANK_INFO3)
        dtype = ""
        att = doc.get("attention")
        if era == "corrected" and isinstance(att, dict):
            att = dict(att)
            dtype = b.peer_text(att.pop("dtype", ""), 32)
            doc = {**doc, "attention": att}
        if isinstance(att, dict):
            maps.unpack(msgspec.msgpack.encode(att), "AttentionInfo", maps.ATTENTION_KEYS)
        ri = maps.bounded(doc, maps.RankInfo3, where)
        if ri.attention is None or ri.page_table is None or not ri.page_table.pool_groups or \
                not ri.page_table.pool_groups[0].pools:
            raise WireError(f"{where}: no attention info or page table (a RankInfo without KV)")
        pool = ri.page_table.pool_groups[0].pools[0]
        view = _view(ri.tp_size, ri.tp_rank, ri.pp_rank, ri.layer_num_per_pp, ri.attention, pool.base_address,
                     pool.slot_bytes, pool.num_slots)
        return Peer(instance_name=ri.instance_name, rank=ri.instance_rank, view=view, pp_size=ri.pp_size,
                    sender_endpoints=ri.sender_endpoints, self_endpoint=ri.self_endpoint,
                    blob=ri.transfer_engine_info, dtype=dtype)
    doc = maps.unpack(data, "RankInfo", maps.RANK_INFO1A if kind == "w1a" else maps.RANK_INFO1)
    ri1 = maps.bounded(doc, maps.RankInfo1, where)
    lnpp = ri1.layer_num_per_pp
    if not ri1.kv_ptrs or not 0 <= ri1.pp_rank < len(lnpp):
        raise WireError(f"{where}: kv_ptrs empty or pp_rank {ri1.pp_rank} outside layer_num_per_pp")
    kvf = 1 if ri1.is_mla else 2
    # the peer's block stride: _block_size = layers x kv_factor x kv_heads_per_rank x tpb x head_dim x bytes
    slot = lnpp[ri1.pp_rank] * kvf * ri1.kv_heads_per_rank * ri1.tokens_per_block * ri1.dims_per_head * \
        ri1.element_bytes
    view = _view(ri1.tp_size, ri1.tp_rank, ri1.pp_rank, lnpp, ri1, ri1.kv_ptrs[0], max(1, slot), 0)
    return Peer(instance_name=ri1.instance_name, rank=ri1.instance_rank, view=view, pp_size=ri1.pp_size,
                sender_endpoints=[], self_endpoint=ri1.recv_endpoint if kind == "w1a" else ri1.self_endpoint,
                blob=ri1.transfer_engine_info)


def decode_info_reply(era: str, data: bytes, where: str = "REQUEST_INSTANCE_INFO reply") -> Peer:
    """The ctx as the gen learns it from the info endpoint: W1's InstanceInfo or rank 0's RankInfo."""
    if ERAS[era].info == "rank":
        return decode_rank_info(era, data, where)
    keys = maps.INSTANCE1A if era == "W1a" else maps.INSTANCE1
    ii = maps.bounded(maps.unpack(data, "InstanceInfo", keys), maps.InstanceInfo, where)
    view = _view(ii.tp_size, 0, 0, ii.layer_num_per_pp, ii, 0, 1, 0)
    return Peer(instance_name=ii.instance_name, rank=0, view=view, pp_size=ii.pp_size,
                sender_endpoints=ii.ctx_endpoints if era == "W1a" else ii.sender_endpoints, self_endpoint="",
                blob=b"")


# ------------------------------------------------------------------------------------------------ requests
def recv_req(era: str, r: maps.Req) -> bytes:
    """RecvReqInfo.to_bytes (GenReqInfo in W1a) of era `era` (T27-T30)."""
    ids: Any
    if era in ("W2b", "W3", "corrected"):
        ids = [maps.id_bytes(r.block_ids)]
    elif era == "W2a":
        ids = [list(r.block_ids)]
    else:
        ids = list(r.block_ids)
    keys = maps.REQ["W3" if era == "corrected" else era]
    values = {"ctx_req_id": r.sender_req_id, "sender_req_id": r.sender_req_id, "instance_name": r.instance_name,
              "instance_rank": r.instance_rank, "blocks": ids, "block_ids": ids, "block_ids_per_layer_groups": ids,
              "unique_rid": str(r.unique_rid) if era == "W1a" else r.unique_rid, "slice_id": r.slice_id}
    return msgspec.msgpack.encode({k: values.get(k) for k in keys})


def decode_recv_req(era: str, data: bytes) -> maps.Req:
    keys = maps.REQ["W3" if era == "corrected" else era]
    doc = maps.unpack(data, maps.REQ_CLASS.get(era, "RecvReqInfo"), keys)
    ids = maps.ids_of(doc[keys[3]], era)
    rid = doc["unique_rid"]
    if era == "W1a" and isinstance(rid, str) and rid.lstrip("-").isdigit() and len(rid) < 20:
        rid = int(rid)
    out = {"sender_req_id": doc[keys[0]], "instance_name": doc["instance_name"],
           "instance_rank": doc["instance_rank"], "block_ids": ids, "unique_rid": rid,
           "slice_id": doc.get("slice_id") or 0}
    return maps.bounded(out, maps.Req, "RecvReqInfo")


# ------------------------------------------------------------------------------------------------ results
class Result(msgspec.Struct, frozen=True):
    rank: int  # the ctx rank (-1: W1a's frames carry none)
    rid: int
    last: bool
    status: str  # SUCCESS | FAILED | IN_DOUBT
    size: int = 0


def _a(x: object) -> bytes:
    return str(x).encode("ascii")


def result_frames(era: str, r: Result, slice_id: int = 0) -> list[bytes]:
    """One KV result as era `era` frames it (T35-T37); failures carry no transfer size (T35, T36)."""
    st = r.status.encode()
    if era == "W1a":
        return [b"TASK_STATE", _a(r.rid), _a(slice_id), _a(r.last), st]
    if era == "W1b":
        return [b"TASK_STATUS", _a(r.rank), _a(r.rid), _a(slice_id), _a(r.last), st]
    if era == "W2a":
        return [b"KV_AGENT_RESULT", _a(r.rank), _a(r.rid), _a(slice_id), _a(r.last), st]
    if era == "W2b":
        frames = [b"KV_AGENT_RESULT", _a(r.rank), _a(r.rid), _a(slice_id), _a(r.last), st]
        return frames + [_a(r.size)] if r.status == "SUCCESS" else frames
    code = {v: k for k, v in STATUS.items()}[r.status]
    return [b"KV_AGENT_RESULT", KV_RESULT.pack(r.rank, r.rid, slice_id, r.last, code, r.size)]


def decode_result(era: str, frames: list[bytes]) -> Result:
    """The gen's Receiver decoding a result message (frames after the identity); WireError as its era raises."""
    kind = ERAS[era].result
    if not frames or frames[0] != kind:
        raise WireError(f"ValueError: Receiver received unknown message type: "
                        f"{b.peer_text(frames[0] if frames else b'', 64)}")
    if era in ("W3", "corrected"):
        if len(frames) < 2 or len(frames[1]) != KV_RESULT.size:
            raise WireError(f"struct.error: unpack requires a buffer of {KV_RESULT.size} bytes")
        rank, rid, _slice, last, code, size = KV_RESULT.unpack(frames[1])
        if code not in STATUS:
            raise WireError(f"KeyError: {code}")
        return Result(rank, rid, bool(last), STATUS[code], size)
    try:
        fields = [f.decode("ascii") for f in frames[1:]]
    except UnicodeDecodeError as exc:
        raise WireError(f"UnicodeDecodeError: {exc.reason}") from None
    want = 4 if era == "W1a" else 5
    if len(fields) < want:
        raise WireError(f"ValueError: not enough values to unpack (expected {want}, got {len(fields)})")
    try:
        if era == "W1a":
            rid, _slice, last, status = fields[:4]
            return Result(-1, int(rid), last == "True", status)
        rank, rid, _slice, last, status = fields[:5]
        size = int(fields[5]) if era == "W2b" and len(fields) > 5 else 0
        return Result(int(rank), int(rid), last == "True", status, size)
    except ValueError as exc:
        raise WireError(f"ValueError: {exc}") from None
