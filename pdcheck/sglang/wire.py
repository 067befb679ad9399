"""SGLang's D -> P ZMQ frames per era (docs/sglang-protocol.md §5.2), P's strict parse, and completion messages (docs/sglang-protocol.md §6.3).

Frames are positional ASCII ints with no version field. decode() parses exactly as the release's bootstrap
thread does, in its order, so a frame that release cannot parse raises what it raises (IndexError,
AssertionError, ValueError, struct.error, UnicodeDecodeError): P's listener thread dies on it.
"""

from __future__ import annotations

import struct
from typing import Literal

import msgspec
import numpy as np

from pdcheck.sglang.releases.base import GUARD, GUARD_TEXT, SglangRelease

KVPOLL = {"Failed": 0, "Bootstrapping": 1, "WaitingForInput": 2, "Transferring": 3, "Success": 4}


class DFacts(msgspec.Struct, frozen=True):
    """What one D rank tells P about itself (KVArgs and its agent)."""

    ip: str
    port: int  # D's own PULL socket (0.5.23: where KV_STATUS comes back)
    agent_name: str
    agent_metadata: bytes
    kv_ptrs: list[int]  # SGLang's order: K of every layer, then V of every layer
    aux_ptrs: list[int]
    gpu_id: int
    tp_size: int
    tp_rank: int
    item_len: int  # bytes of one page of one layer's K (or V)
    state_ptrs: list[int] = []  # a hybrid model's state pool (SWA window KV / mamba), 0.5.13+ frame #7
    state_item_len: int = 0


class Request(msgspec.Struct, frozen=True):
    room: int
    pages: list[int]  # D's page indices
    aux_index: int | None
    required_dst_info_num: int = 1
    is_dummy: bool = False
    state_indices: list[int] = []  # the request's state slots (hybrid models; sent from 0.5.13)


class Registration(msgspec.Struct, frozen=True):
    """P's view of a D registration (KVArgsRegisterInfo)."""

    agent_name: str
    agent_metadata: bytes
    kv_ptrs: list[int]
    aux_ptrs: list[int]
    gpu_id: int
    decode_tp_size: int | None = None
    decode_tp_rank: int | None = None
    item_len: int | None = None
    endpoint: str = ""
    port: int = 0
    state_ptrs: list[int] = []


class Transfer(msgspec.Struct, frozen=True):
    """P's view of a TransferInfo (E1/E2 carry the registration facts inline)."""

    room: int
    agent_name: str
    pages: list[int]
    aux_index: int
    required_dst_info_num: int
    endpoint: str = ""
    port: int = 0
    inline: Registration | None = None
    state_indices: list[int] = []


Parsed = Registration | Transfer | None  # None: a message the release ignores


# Eras whose state frames are raw arrays, before common/utils.unpack_int_lists (0.5.12): E5r 0.5.9 - 0.5.10, E5s
# 0.5.11 (+ state item lengths and dims in the registration, decode_prefix_len in the request)
RAW_STATE = ("E5r", "E5s")


def _a(x: int | str | None) -> bytes:
    return str(x).encode("ascii")


def _q(ptrs: list[int]) -> bytes:
    return b"".join(struct.pack("Q", p) for p in ptrs)


def _unq(frame: bytes) -> list[int]:
    return list(struct.unpack(f"{len(frame) // 8}Q", frame))


def _pack_int_lists(lists: list[list[int]], fmt: str) -> bytes:
    """common/utils.pack_int_lists (R6): a count, the byte lengths, then the buffers, little-endian."""
    bufs = [struct.pack(f"<{len(a)}{fmt}", *a) for a in lists]
    return struct.pack(f"<{len(bufs) + 1}I", len(bufs), *(len(b) for b in bufs)) + b"".join(bufs) if bufs else b""


def encode(rel: SglangRelease, d: DFacts, req: Request, *, register: bool = True) -> list[list[bytes]]:
    """The messages a D rank of `rel` pushes to one P rank for one request: the registration (once per
    connection, 0.4.9+) and the TransferInfo, each a list of frames."""
    idx = np.asarray([] if req.is_dummy else req.pages, dtype=rel.index_dtype).tobytes()
    room, ip, port, aux = _a(req.room), _a(d.ip), _a(d.port), _a(req.aux_index)
    name, meta = d.agent_name.encode("ascii"), d.agent_metadata
    if rel.wire == "E1":
        return [[room, ip, port, meta, _q(d.kv_ptrs), idx, _q(d.aux_ptrs), aux, _a(d.gpu_id)]]
    if rel.wire == "E2":
        return [[GUARD, room, ip, port, meta, name, _q(d.kv_ptrs), idx, _q(d.aux_ptrs), aux, _a(d.gpu_id),
                 _a(req.required_dst_info_num)]]
    reg = [GUARD, b"None", ip, port, name, meta, _q(d.kv_ptrs), _q(d.aux_ptrs)]
    if rel.wire == "E3":
        reg += [_a(d.gpu_id)]
    elif rel.wire == "E4":
        reg += [_a(d.gpu_id), _a(d.tp_size), _a(d.tp_rank), _a(d.item_len)]
    elif rel.wire in RAW_STATE:  # 0.5.9 - 0.5.11: the state frame at #7 as raw uint64s (nixl/conn.py)
        reg += [_q(d.state_ptrs) if d.state_ptrs else b"", _a(d.gpu_id), _a(d.tp_size), _a(d.tp_rank), _a(d.item_len)]
        if rel.wire == "E5s":  # 0.5.11: the state item lengths and dims per tensor, raw uint32s
            reg += [struct.pack(f"{1}I", d.state_item_len) if d.state_ptrs else b"", b""]
    else:  # E5 / E6: the state frame at #7 (empty: no hybrid state), staging and slots empty
        st = bool(d.state_ptrs)
        reg += [_pack_int_lists([d.state_ptrs], "Q") if st else b"", _a(d.gpu_id), _a(d.tp_size), _a(d.tp_rank),
                _a(d.item_len), _pack_int_lists([[d.state_item_len]], "I") if st else b"", b"", b"", b"", b""]
        if rel.wire == "E6":
            per_entry = _q([d.item_len] * len(d.kv_ptrs))
            reg += [",".join(["DRAM"] * len(d.kv_ptrs)).encode("ascii"), per_entry, b"", b"", _a(1), _a(0),
                    _pack_int_lists([[d.state_item_len * 16]], "Q") if st else b""]
    request = [GUARD, room, ip, port, name, idx, aux, _a(req.required_dst_info_num)]
    if rel.wire in RAW_STATE:  # state indices as raw int32s; 0.5.11 adds str(decode_prefix_len or 0)
        request += [np.asarray(req.state_indices, dtype=np.int32).tobytes()
                    if req.state_indices and not req.is_dummy else b""]
        if rel.wire == "E5s":
            request += [_a(0)]
    if rel.wire in ("E5", "E6"):
        # state indices (one list per state pool), decode_prefix_len
        request += [_pack_int_lists([req.state_indices], "i") if req.state_indices and not req.is_dummy else b"",
                    b""]
        if rel.wire == "E6":
            request += [_a(int(req.is_dummy))]
    return [reg, request] if register else [request]


def decode(rel: SglangRelease, frames: list[bytes]) -> Parsed:
    """Parse one message as P of `rel`'s bootstrap thread does (same order, same Python operations)."""
    if rel.wire == "E1":
        if frames[0] == b"None":
            return None
        return _transfer_inline(frames, with_name=False)
    assert frames[0] == GUARD, GUARD_TEXT
    msg = frames[1:]
    if rel.wire == "E2":
        room = msg[0].decode("ascii")
        int(msg[10].decode("ascii"))  # required_dst_info_num first (R2 nixl/conn.py:332)
        int(room)
        msg[4].decode("ascii")
        return _transfer_inline(msg, with_name=True)
    room = msg[0].decode("ascii")
    msg[3].decode("ascii")  # agent_name, before the room test
    if room == "None":
        return _registration(rel, msg)
    int(room)
    return _transfer(rel, msg)


def _transfer_inline(msg: list[bytes], *, with_name: bool) -> Transfer:
    """E1 (R1 nixl/conn.py:49-60) and E2 (R2 nixl/conn.py:59-72): everything in one message."""
    o = 1 if with_name else 0
    room = int(msg[0].decode("ascii"))
    endpoint = msg[1].decode("ascii")
    port = int(msg[2].decode("ascii"))
    meta = msg[3]
    name = msg[4].decode("ascii") if with_name else ""
    kv_ptrs = _unq(msg[4 + o])
    pages = np.frombuffer(msg[5 + o], dtype=np.int64).tolist()
    aux_ptrs = _unq(msg[6 + o])
    aux_index = int(msg[7 + o].decode("ascii"))
    gpu = int(msg[8 + o].decode("ascii"))
    required = int(msg[10].decode("ascii")) if with_name else 1
    return Transfer(room, name, pages, aux_index, required, endpoint, port,
                    Registration(name, meta, kv_ptrs, aux_ptrs, gpu, endpoint=endpoint, port=port))


def _unpack_int_lists(buf: bytes, fmt: str) -> list[list[int]]:
    """common/utils.unpack_int_lists (R6): a count, the lengths, then the buffers, little-endian."""
    if buf == b"":
        return []
    (n,) = struct.unpack("<I", buf[:4])
    lens = struct.unpack(f"<{n}I", buf[4:4 + 4 * n])
    out, off, width = [], 4 + 4 * n, struct.calcsize(fmt)
    for ln in lens:
        b = buf[off:off + ln]
        out.append(list(struct.unpack(f"<{len(b) // width}{fmt}", b)))
        off += ln
    return out


def _registration_e6(msg: list[bytes]) -> Registration:
    """0.5.23's KVArgsRegisterInfo.from_zmq (nixl/conn.py:376-456), in its order: the pointer frame, the memory
    kinds, the item length(s) and their count check, then the optional lists, then the constructor's fields."""
    kv_ptrs = _unq(msg[5])
    if len(msg) > 17 and msg[17]:
        kinds = msg[17].decode("ascii").split(",")
        if len(kinds) != len(kv_ptrs):
            raise ValueError(f"kv_data_mem_kinds length mismatch: got {len(kinds)}, expected {len(kv_ptrs)}")
        invalid = sorted(set(kinds) - {"VRAM", "DRAM"})
        if invalid:
            raise ValueError(f"Unsupported NIXL KV memory kind(s): {invalid}")
    item = int(msg[11].decode("ascii"))
    lens = _unq(msg[18]) if len(msg) > 18 and msg[18] != b"" else [item] * len(kv_ptrs)
    if len(lens) != len(kv_ptrs):
        raise ValueError(f"dst_kv_item_lens length mismatch: got {len(lens)}, expected {len(kv_ptrs)}")
    state = _unpack_int_lists(msg[7], "Q") if len(msg) > 7 and msg[7] != b"" else []
    for i in (12, 13):
        if len(msg) > i and len(msg[i]) > 0:
            _unpack_int_lists(msg[i], "I")
    if len(msg) > 16 and msg[16] != b"":
        int(msg[16].decode("ascii"))
    if len(msg) > 19 and len(msg[19]) > 0:
        _unpack_int_lists(msg[19], "I")
    if len(msg) > 20 and msg[20] != b"":
        struct.unpack(f"{len(msg[20]) // 4}I", msg[20])
    msg[0].decode("ascii")
    endpoint = msg[1].decode("ascii")
    port = int(msg[2].decode("ascii"))
    name = msg[3].decode("ascii")
    aux_ptrs = _unq(msg[6])
    gpu, tp, rank = (int(msg[i].decode("ascii")) for i in (8, 9, 10))
    for i in (21, 22):
        if len(msg) > i and msg[i] != b"":
            int(msg[i].decode("ascii"))
    if len(msg) > 14 and len(msg[14]) == 8:
        struct.unpack("Q", msg[14])
    if len(msg) > 15 and msg[15] != b"":
        int(msg[15].decode("ascii"))
    if len(msg) > 23 and len(msg[23]) > 0:
        _unpack_int_lists(msg[23], "Q")
    return Registration(name, msg[4], kv_ptrs, aux_ptrs, gpu, tp, rank, item, endpoint, port,
                        state[0] if state else [])


def _registration(rel: SglangRelease, msg: list[bytes]) -> Registration:
    if rel.wire == "E6":
        return _registration_e6(msg)
    state: list[list[int]] = []
    if rel.wire in RAW_STATE:
        # 0.5.9 - 0.5.11's from_zmq: the raw state pointers at #7 first, (0.5.11) the raw item lengths and dims
        if len(msg) > 7 and msg[7] != b"":
            state = [list(struct.unpack(f"{len(msg[7]) // 8}Q", msg[7]))]
        if rel.wire == "E5s":
            for i in (12, 13):
                if len(msg) > i and len(msg[i]) > 0:
                    struct.unpack(f"{len(msg[i]) // 4}I", msg[i])
    if rel.wire == "E5":
        # optional frames first (R6 nixl/conn.py:130-160): the state list at #7 is parsed before gpu_id
        if len(msg) > 7 and msg[7] != b"":
            state = _unpack_int_lists(msg[7], "Q")
        if len(msg) > 12 and len(msg[12]) > 0:
            _unpack_int_lists(msg[12], "I")
        if len(msg) > 13 and len(msg[13]) > 0:
            _unpack_int_lists(msg[13], "I")
        if len(msg) > 16 and msg[16] != b"":
            int(msg[16].decode("ascii"))
    endpoint = msg[1].decode("ascii")
    port = int(msg[2].decode("ascii"))
    name = msg[3].decode("ascii")
    meta = msg[4]
    kv_ptrs = _unq(msg[5])
    aux_ptrs = _unq(msg[6])
    if rel.wire == "E3":
        return Registration(name, meta, kv_ptrs, aux_ptrs, int(msg[7].decode("ascii")), endpoint=endpoint, port=port)
    s = 1 if rel.wire in ("E5", "E6", *RAW_STATE) else 0
    gpu = int(msg[7 + s].decode("ascii"))
    tp = int(msg[8 + s].decode("ascii"))
    rank = int(msg[9 + s].decode("ascii"))
    item = int(msg[10 + s].decode("ascii"))
    if rel.wire == "E5":
        _staging(msg, 14)
    return Registration(name, meta, kv_ptrs, aux_ptrs, gpu, tp, rank, item, endpoint, port, state[0] if state else [])


def _staging(msg: list[bytes], i: int) -> None:
    """StagingRegisterInfo.from_zmq_fields (R6 common/staging_handler.py:475-489)."""
    if len(msg) > i and len(msg[i]) == 8:
        struct.unpack("Q", msg[i])
    if len(msg) > i + 1 and len(msg[i + 1]) > 0:
        int(msg[i + 1].decode("ascii"))


def _transfer(rel: SglangRelease, msg: list[bytes]) -> Transfer:
    state: list[list[int]] = []
    if rel.wire in RAW_STATE and len(msg) > 7 and msg[7] != b"":
        state = [np.frombuffer(msg[7], dtype=np.int32).tolist()]
    if rel.wire in ("E5", "E6") and len(msg) > 7 and msg[7] != b"":
        state = _unpack_int_lists(msg[7], "i")
    t = Transfer(room=int(msg[0].decode("ascii")), endpoint=msg[1].decode("ascii"),
                 port=int(msg[2].decode("ascii")), agent_name=msg[3].decode("ascii"),
                 pages=np.frombuffer(msg[4], dtype=np.int32).tolist(), aux_index=int(msg[5].decode("ascii")),
                 required_dst_info_num=int(msg[6].decode("ascii")), state_indices=state[0] if state else [])
    if rel.wire in ("E5", "E5s", "E6") and len(msg) > 8 and msg[8] != b"":
        int(msg[8].decode("ascii"))
    return t


def death(exc: BaseException) -> str:
    """How a listener death reads in a report: the exception as Python prints it."""
    name = "struct.error" if isinstance(exc, struct.error) else type(exc).__name__
    return f"{name}: {exc}"


# ---------------------------------------------------------------------------------------------- completion
def kv_notif(rel: SglangRelease, room: int, chunk: int, is_last: bool, rank: int) -> str:
    """The kv-chunk notification P attaches to its WRITE (rank: pp_rank for 0.5.8, engine_rank for 0.5.13)."""
    base = f"{room}_kv_{chunk}_{int(is_last)}"
    return f"{base}_{rank}" if rel.completion in ("notif_pp", "notif_engine") else base


def aux_notif(room: int) -> str:
    return f"{room}_aux"


def state_notif(room: int, rank: int) -> str:
    """0.5.13's state notification (R6 nixl/conn.py:819-826): `{room}_state_{engine_rank}`."""
    return f"{room}_state_{rank}"


def kv_status(room: int, status: str, p_rank: int, reason: str = "") -> list[bytes]:
    """0.5.23's P -> D completion message (nixl/conn.py:515)."""
    return [b"KV_STATUS", _a(room), _a(KVPOLL[status]), _a(p_rank), reason.encode()]


class Tracker:
    """D's completion bookkeeping for one room (TransferStatus, docs/sglang-protocol.md §6.3), fed with what arrived.

    required: prefill responses D waits for (required_prefill_response_num: P attn TP / D attn TP when P is
    larger, else 1)."""

    def __init__(self, rel: SglangRelease, required: int = 1, expects_state: bool = False) -> None:
        self.rel, self.required = rel, required
        # 0.5.13: D sent state indices, so it waits for a "{room}_state_{rank}" notification too (expects_state)
        self.expects_state = expects_state and rel.completion == "notif_engine"
        self.state = False
        self.received: dict[int, set[int]] = {}  # key (pp or engine rank; 0 before 0.5.8) -> chunks
        self.expected: dict[int, int] = {}
        self.aux = False
        self.ok_ranks: set[int] = set()
        self.failed: str | None = None

    def notif(self, text: str) -> None:
        parts = text.split("_")
        if len(parts) >= 2 and parts[1] == "aux":
            self.aux = True
            return
        if len(parts) >= 2 and parts[1] == "state":
            self.state = True
            return
        if len(parts) < 4 or parts[1] != "kv":
            return
        chunk = int(parts[2])
        # R1: bool(components[3]) is True for "0" (R1 nixl/conn.py:281); fixed in 0.4.7 with bool(int(...))
        last = bool(parts[3]) if self.rel.last_chunk_bug else bool(int(parts[3]))
        key = int(parts[4]) if self.rel.completion in ("notif_pp", "notif_engine") and len(parts) > 4 else 0
        self.received.setdefault(key, set()).add(chunk)
        if last:
            self.expected[key] = chunk + 1

    def status(self, frames: list[bytes]) -> None:
        if len(frames) < 4 or frames[0] != b"KV_STATUS":
            return
        state, rank = int(frames[2]), int(frames[3])
        if state == KVPOLL["Success"]:
            self.ok_ranks.add(rank)
        elif state == KVPOLL["Failed"]:
            self.failed = frames[4].decode(errors="replace") if len(frames) > 4 else ""

    def done(self) -> bool:
        if self.rel.completion == "kv_status":
            return len(self.ok_ranks) >= self.required
        if not self.aux or not self.expected or (self.expects_state and not self.state):
            return False
        if self.rel.completion == "notif":
            return all(len(self.received.get(k, ())) == n for k, n in self.expected.items())
        # 0.5.8+: one entry per pp (0.5.8) or engine (0.5.13) rank, each complete
        return len(self.expected) >= self.required and all(
            len(self.received.get(k, ())) >= n for k, n in self.expected.items())


Kind = Literal["registration", "transfer"]
