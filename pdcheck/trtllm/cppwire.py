"""The C++ transceiver's NIXL notifications (docs/trtllm-protocol.md §5.2): serialize_utils encodings (T58) of the
NotificationInfo variant (T59): 0 RequestAndBufferInfo, 1 NotificationSyncInfo, 2 ReadySignalInfo.

Indexes 1 and 2 are byte-exact (T60 is a worked example). Index 0 embeds RequestInfo, whose BlockKey and
DataTransceiverState encodings were not read (T59): between pdcheck's own fakes its outer layout is kept (agent
name, address, RequestInfo, MemoryDescs, optional metadata, valid connection index, buffer kinds, as at
connection.h@0649223e) and the RequestInfo is `u64 request id, i32 index from end` followed by a pdcheck
placeholder: the gen's CacheState as msgpack in a serialize_utils string. A real C++ peer would not parse it."""

from __future__ import annotations

import struct

import msgspec

from pdcheck import bounds as b
from pdcheck.trtllm.maps import WireError

REQUEST, SYNC, READY = 0, 1, 2
MAX_STRING = 1 << 20  # bytes of one string field (the NIXL metadata blob is the largest, a few KB)
MAX_DESCS = 1 << 16


class CacheState(msgspec.Struct, frozen=True, kw_only=True):
    """What inquireSupport compares (T64): CacheState's model, parallel and data-type parts."""

    heads_per_layer: list[int]  # nbKvHeadsPerLayer of this rank
    size_per_head: int
    tokens_per_block: int
    tp: int
    pp: int
    layers_per_pp: list[int]
    dtype: str
    attention_type: str = "DEFAULT"  # DEFAULT | MLA
    kv_factor: int = 2


class MemoryDesc(msgspec.Struct, frozen=True):
    addr: int
    length: int
    device: int = 0


class RequestAndBuffer(msgspec.Struct, frozen=True, kw_only=True):
    agent: str
    address: str
    request_id: int
    cache_state: CacheState
    descs: list[MemoryDesc]
    metadata: bytes | None
    valid_idx: int


def _str(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def sync(agent: str, tag: int) -> bytes:
    """NotificationSyncInfo{receiver's agent name, tag} (T59, T60)."""
    return struct.pack("<Q", SYNC) + _str(agent.encode()) + struct.pack("<i", tag)


def ready(agent: str, tag: int, is_ready: bool) -> bytes:
    return struct.pack("<Q", READY) + _str(agent.encode()) + struct.pack("<i?", tag, is_ready)


def request(r: RequestAndBuffer) -> bytes:
    state = msgspec.msgpack.encode(r.cache_state)
    out = [struct.pack("<Q", REQUEST), _str(r.agent.encode()), _str(r.address.encode()),
           struct.pack("<Qi", r.request_id, -1), _str(b"pdcheck-placeholder:" + state),
           struct.pack("<Q", len(r.descs))]
    out += [struct.pack("<QQI", d.addr, d.length, d.device) for d in r.descs]
    out.append(b"\x00" if r.metadata is None else b"\x01" + _str(r.metadata))
    out.append(struct.pack("<iQ", r.valid_idx, 0))  # no buffer kinds
    return b"".join(out)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise WireError("std::runtime_error: deserialize: read past the end of the notification")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def u(self, fmt: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        n = self.u("<Q")
        if n > MAX_STRING:
            raise WireError(f"a string of {n} bytes; at most {MAX_STRING} are read")
        return self.take(n)


def decode(data: bytes) -> tuple[int, object]:
    """(variant index, its fields): (1, (name, tag)), (2, (name, tag, ready)), (0, RequestAndBuffer)."""
    r = _Reader(data)
    index = r.u("<Q")
    if index == SYNC:
        return SYNC, (r.string().decode(errors="replace"), r.u("<i"))
    if index == READY:
        return READY, (r.string().decode(errors="replace"), r.u("<i"), bool(r.u("<?")))
    if index != REQUEST:
        raise WireError("std::runtime_error: Unknown variant type")
    agent, address = r.string().decode(errors="replace"), r.string().decode(errors="replace")
    request_id, _index_from_end = r.u("<Q"), r.u("<i")
    placeholder = r.string()
    if not placeholder.startswith(b"pdcheck-placeholder:"):
        raise WireError("RequestInfo: not pdcheck's placeholder (a real C++ peer's BlockKey and "
                        "DataTransceiverState encodings were not read, docs/trtllm-protocol.md T59)")
    try:
        state = msgspec.msgpack.decode(placeholder[20:], type=CacheState)
    except msgspec.DecodeError as exc:
        raise WireError(f"RequestInfo placeholder: {b.peer_text(str(exc), 120)}") from None
    n = r.u("<Q")
    if n > MAX_DESCS:
        raise WireError(f"{n} memory descriptors; at most {MAX_DESCS} are read")
    descs = [MemoryDesc(r.u("<Q"), r.u("<Q"), r.u("<I")) for _ in range(n)]
    metadata = r.string() if r.u("<?") else None
    valid = r.u("<i")
    return REQUEST, RequestAndBuffer(agent=agent, address=address, request_id=request_id, cache_state=state,
                                     descs=descs, metadata=metadata, valid_idx=valid)
