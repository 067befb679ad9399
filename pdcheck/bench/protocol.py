"""Control messages between the parent and the rank processes: msgspec msgpack over ZMQ, never pickle.

The parent binds a ROUTER on 127.0.0.1 (ephemeral port); each rank connects a DEALER whose identity is
its label ("P0", "D1"). Arrays travel as raw little-endian bytes.
"""

from __future__ import annotations

import msgspec
import numpy as np


class ShapeMsg(msgspec.Struct, frozen=True):
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    mla: bool


class Hello(msgspec.Struct, tag=True):
    role: str
    rank: int
    pid: int


class Setup(msgspec.Struct, tag=True):
    agent_name: str
    pool_bytes: int
    device: str
    gpu: int
    cores: list[int]
    error_mode: str | None
    progress_thread: bool
    target_busy: bool
    shape: ShapeMsg
    ptp: int
    dtp: int
    seed: int
    iters: int  # 0 = auto from min_time
    warmup: int
    min_time: float
    notif: bool
    llc: int


class Ready(msgspec.Struct, tag=True):
    agent_name: str
    metadata: bytes
    addr: int
    nbytes: int
    dev: int
    ucx_version: str
    cores: list[int]


class PeerInfo(msgspec.Struct):
    rank: int
    name: str
    metadata: bytes
    addr: int
    dev: int


class Peers(msgspec.Struct, tag=True):
    peers: list[PeerInfo]


class RowMsg(msgspec.Struct, tag=True):
    index: int
    block_tokens: int
    tokens: int
    blocks: int
    requests: int
    run_length: int
    num_blocks: int
    tables_p: bytes  # int64 (requests, blocks)
    tables_d: bytes
    corrupt: int  # -1, or the descriptor index (request 0 of decode rank 0) to corrupt at the source


class Filled(msgspec.Struct, tag=True):
    fill_ms: float


class Armed(msgspec.Struct, tag=True):
    pass


class Ack(msgspec.Struct, tag=True):
    pass


class Go(msgspec.Struct, tag=True):
    pass


class Poll(msgspec.Struct, tag=True):
    pass


class Stats(msgspec.Struct, tag=True):
    cpu_s: float  # process CPU time so far (all threads, progress thread included)
    wall_s: float
    notifs: int  # notifications received so far


class Ceiling(msgspec.Struct):
    gbps: float
    p50_us: float
    nbytes: int
    iters: int
    working_set: int
    wrong: int = 0


class RankRow(msgspec.Struct, tag=True):
    """One decode rank's measurements for one sweep point."""

    rank: int
    nbytes: int  # per transfer
    block_bytes: int
    desc_count: int
    desc_merged: list[int]  # NIXL telemetry descCount per request handle (empty when unavailable)
    desc_runs: float  # mean contiguous runs per request: the count if NIXL merged every run
    iters: int
    wall_ns: int
    lat_ns: bytes  # int64 per transfer
    checked: int
    wrong: int
    first_wrong: str | None
    memcpy: list[Ceiling]  # before and after the row, to catch drift
    wire: Ceiling
    prep_ms: float
    make_us: float
    verify_ms: float
    cpu_s: float
    working_set: int
    telemetry_error: str | None = None


class Stop(msgspec.Struct, tag=True):
    pass


class Bye(msgspec.Struct, tag=True):
    notifs: int


class Failed(msgspec.Struct, tag=True):
    message: str


Msg = (Hello | Setup | Ready | Peers | RowMsg | Filled | Armed | Ack | Go | Poll | Stats | RankRow | Stop | Bye
       | Failed)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Msg)


def pack(msg: Msg) -> bytes:
    return _enc.encode(msg)


def unpack(data: bytes) -> Msg:
    return _dec.decode(data)


def arr_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def bytes_arr(b: bytes, rows: int) -> np.ndarray:
    return np.frombuffer(b, dtype="<i8").reshape(rows, -1)
