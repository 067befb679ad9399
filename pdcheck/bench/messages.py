"""transfer-bench's (and doctor's transfer) ranks' messages (pdcheck/bench/rank.py), on the runtime's codec
(pdcheck.messages)."""

from __future__ import annotations

import msgspec

from pdcheck.geometry import ModelShape
from pdcheck.messages import Msg, protocol


class BenchSpec(msgspec.Struct, frozen=True):
    """What a transfer-bench rank is started with (launcher.start's spec)."""

    role: str  # "P" or "D"
    tp_rank: int
    agent_name: str
    arena_bytes: int  # sized for the largest row
    device: str
    gpu: int
    cores: list[int]  # [] = not pinned
    error_mode: str | None
    progress_thread: bool
    target_busy: bool
    ucx_env: dict[str, str]  # the transport preset's UCX variables, set before the agent exists
    shape: ModelShape
    ptp: int
    dtp: int
    iters: int  # 0 = auto from min_time
    warmup: int
    min_time: float
    notif: bool
    host: str = "127.0.0.1"  # the rank's node address (Ray); loopback keeps UCX on `lo`

class BenchReady(Msg):
    tp_rank: int
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

class Peers(Msg):
    peers: list[PeerInfo]

class Row(Msg):
    """One sweep point. Block tables travel as raw little-endian int64 (requests x blocks)."""

    index: int
    block_tokens: int
    tokens: int
    blocks: int
    requests: int
    run_length: int
    num_blocks: int
    tables_p: bytes
    tables_d: bytes
    corrupt: int  # -1, or the descriptor index (request 0 of decode rank 0) to corrupt at the source

class Filled(Msg):
    fill_ms: float

class Measure(Msg):
    """Start the timed loop (every D rank at once)."""

class Poll(Msg):
    pass

class Stats(Msg):
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

class RankRow(Msg):
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

class Bye(Msg):
    notifs: int


protocol(BenchReady, Peers, Row, Filled, Measure, Poll, Stats, RankRow, Bye)
