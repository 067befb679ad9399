"""The transfer-bench output document (msgspec Structs): the body under pdcheck.envelope's envelope, whose
`schema` (envelope.SCHEMA) is bumped on any incompatible change (docs/json.md).

Units: bytes are bytes, GB/s is decimal (1e9 bytes/s), times are microseconds unless named *_ms.
With several decode ranks, bytes, descriptors and GB/s are sums over decode ranks (they pull at once)
and latencies pool every rank's transfers.
"""

from __future__ import annotations

import msgspec


class Row(msgspec.Struct, kw_only=True):
    index: int
    label: str
    block_tokens: int
    tokens: int  # per request
    blocks: int  # blocks per request per region
    regions: int  # per-layer K and V regions (MLA: one per layer)
    requests: int  # distinct block tables cycled through
    run_length: int
    block_bytes: int  # bytes per descriptor (one block of one region on a decode rank)
    bytes: int  # bytes per transfer
    desc_count: int  # descriptors per transfer as posted
    desc_count_merged: int | None  # after NIXL's merging (telemetry descCount); None when unavailable
    desc_runs: int  # address-contiguous runs: what full merging would leave
    iters: int
    time_us: float  # mean per transfer
    gbps: float
    p50_us: float
    p90_us: float
    p99_us: float
    p999_us: float
    max_us: float
    min_us: float
    cv_pct: float
    wrong: int  # blocks whose bytes differ from the logical-coordinate pattern
    checked: int
    first_wrong: str | None
    memcpy_gbps: float  # same bytes, 1-thread copy, measured right before and after this row
    wire_gbps: float  # same bytes as ONE descriptor over the same transport
    wire_p50_us: float
    wire_wrong: int  # wrong 8-byte words in the last wire-ceiling transfer
    pct_memcpy: float
    pct_wire: float
    working_set_bytes: int  # per side, cycled through
    cache_hot: bool  # working set under 2x the LLC: bandwidth is partly cache bandwidth
    prep_ms: float  # both prep_xfer_dlist calls
    make_us: float  # make_prepped_xfer per request
    verify_ms: float
    cpu_initiator: float  # decode rank CPU-s per s during the timed loop
    cpu_target: float | None  # prefill ranks CPU-s per s during the timed loop
    fill_ms: float
    foreign_cpu: float  # CPU-s/s used by other processes (and steal) while the row ran: noise indicator


class Ceilings(msgspec.Struct, kw_only=True):
    memcpy_gbps: float  # median over rows
    wire_gbps: float  # median over rows
    memcpy_method: str
    wire_method: str
    bytes: list[int]  # transfer sizes they were measured at (one per row)


class Transport(msgspec.Struct, kw_only=True):
    preset: str
    summary: str
    data: list[str]
    notifications: list[str]
    error_mode: str
    progress_thread: bool
    target_progress: str
    costs: list[str]


class Floors(msgspec.Struct, kw_only=True):
    min_bw_gbps: float | None
    max_p99_us: float | None
    failures: list[str]


class Config(msgspec.Struct, kw_only=True):
    model: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    mla: bool
    prefill_tp: int
    decode_tp: int
    block_sizes: list[int]
    tokens: list[int]
    run_length: int
    requests: int  # 0 = auto
    seed: int
    iters: int  # 0 = auto
    warmup: int
    min_time_s: float
    device: str
    notif: bool
    operation: str = "READ (decode pulls from prefill)"


class Env(msgspec.Struct, kw_only=True):
    pdcheck: str
    nixl: str
    ucx: str
    numpy: str
    ucx_env: dict[str, str]
    transports: list[str]
    pinning: dict[str, list[int]]
    pin_note: str
    host: dict[str, str | int | None]


class Report(msgspec.Struct, kw_only=True):
    ok: bool
    config: Config
    env: Env
    transport: Transport
    rows: list[Row]
    ceilings: Ceilings
    floors: Floors
    warnings: list[str]


# --jsonl: a header, one line per row, then the summary; each line under the whole envelope.
class Header(msgspec.Struct, kw_only=True, tag="header"):
    config: Config
    env: Env
    transport: Transport


class RowLine(msgspec.Struct, kw_only=True, tag="row"):
    row: Row


class SummaryLine(msgspec.Struct, kw_only=True, tag="summary"):
    ok: bool
    ceilings: Ceilings
    floors: Floors
    warnings: list[str]
