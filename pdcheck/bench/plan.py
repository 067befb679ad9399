"""The run's configuration and its sweep plan: rows, requests per row, pool sizes, checked up front.

Everything that can be wrong with the flags is found here, before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pdcheck import bounds as b
from pdcheck.bench import tables
from pdcheck.bench.envinfo import host
from pdcheck.bench.transport import Preset
from pdcheck.errors import BadInput
from pdcheck.geometry import Geometry, ModelShape, read_source
from pdcheck.pattern import CELL


@dataclass
class BenchConfig:
    shape: ModelShape
    block_sizes: list[int]
    tokens: list[int]
    transport: Preset
    run_length: int = 1
    requests: int = 0  # 0: enough to cycle through 4x the LLC per side
    ptp: int = 1
    dtp: int = 1
    iters: int = 0  # 0: as many as fit in min_time
    warmup: int = 3
    min_time: float = 0.3
    seed: int = 0
    error_mode: str | None = None  # overrides the preset's
    progress_thread: bool = False
    target_poll: bool = False  # poll the prefill worker every 1 ms instead of busy-progressing it
    notif: bool = True
    pin: bool = True
    device: str = "cpu"
    timeout: float = 120.0
    corrupt: int | None = None  # self-test: the descriptor of request 0 to corrupt at the source
    log_dir: Path | None = None
    max_mem_fraction: float = 0.6
    ray: str | None = None  # a Ray cluster address: ranks become Ray actors on pdcheck_prefill/decode nodes

    @property
    def target_busy(self) -> bool:
        return self.transport.target_busy or not self.target_poll

    @property
    def effective_error_mode(self) -> str:
        return self.error_mode or self.transport.error_mode or "peer"


@dataclass
class Plan:
    rows: list[tables.RowPlan]
    pool_p: list[int]  # bytes per prefill rank
    pool_d: list[int]  # bytes per decode rank
    llc: int


def check_flags(cfg: BenchConfig) -> None:
    """Every flag against pdcheck.bounds, the rules every command shares."""
    for flag, vals in (("--block-size", cfg.block_sizes), ("--tokens", cfg.tokens)):
        if not vals:
            raise BadInput(f"{flag} needs at least one value")
        if len(vals) > b.MAX_SWEEP:
            raise BadInput(f"{flag}: {len(vals)} values; a sweep has at most {b.MAX_SWEEP}")
        for v in vals:
            b.check_int(flag, v, 1, b.MAX_BLOCK_SIZE if flag == "--block-size" else b.MAX_TOKENS)
    for flag, v, lo, hi in (
        ("--layers", cfg.shape.layers, 1, b.MAX_LAYERS), ("--kv-heads", cfg.shape.kv_heads, 1, b.MAX_KV_HEADS),
        ("--head-dim", cfg.shape.head_dim, 1, b.MAX_HEAD_DIM), ("--run-length", cfg.run_length, 1, b.MAX_RUN_LENGTH),
        ("--prefill-tp", cfg.ptp, 1, b.MAX_TP), ("--decode-tp", cfg.dtp, 1, b.MAX_TP),
        ("--requests", cfg.requests, 0, b.MAX_BENCH_REQUESTS), ("--iters", cfg.iters, 0, b.MAX_ITERS),
        ("--warmup", cfg.warmup, 0, b.MAX_WARMUP), ("--seed", cfg.seed, 0, b.MAX_SEED),
    ):
        b.check_int(flag, v, lo, hi)
    if cfg.corrupt is not None:
        b.check_int("--corrupt-block", cfg.corrupt, 0, b.MAX_CORRUPT_BLOCK)
    b.check_seconds("--min-time", cfg.min_time, b.MIN_TIME_S)
    b.check_seconds("--timeout", cfg.timeout, b.RUN_TIMEOUT_S)
    b.check_device(cfg.device)
    if cfg.log_dir is not None:
        b.check_out_dir("--log-dir", cfg.log_dir)
    if cfg.target_poll and cfg.transport.target_busy:
        raise BadInput(f"--target-poll: --transport {cfg.transport.name} only moves data while the target "
                       "busy-progresses")
    if cfg.error_mode not in (None, "peer", "none"):
        raise BadInput(f"--error-mode {cfg.error_mode!r} is not one of: peer, none")


def _check_tp(shape: ModelShape, tp: int) -> None:
    h = shape.kv_heads
    if shape.mla:
        return  # the latent is replicated on every rank
    if tp <= h and h % tp:
        raise BadInput(f"TP {tp} does not divide the {h} KV heads")
    if tp > h and tp % h:
        raise BadInput(f"TP {tp} is larger than the {h} KV heads and not a multiple of them")


def rank_geometries(cfg: BenchConfig, block_tokens: int) -> tuple[Geometry, Geometry]:
    """The P and D ranks' KV geometry for one block size (pdcheck.geometry, as `pdcheck handshake` uses);
    BadInput when a D rank's heads are not whole on one P rank."""
    _check_tp(cfg.shape, cfg.ptp)
    _check_tp(cfg.shape, cfg.dtp)
    gp, gd = cfg.shape.geometry(cfg.ptp, block_tokens), cfg.shape.geometry(cfg.dtp, block_tokens)
    if any(read_source(gp, gd, d) is None for d in range(cfg.dtp)):
        raise BadInput(f"decode TP {cfg.dtp} < prefill TP {cfg.ptp}: a decode rank would need heads from several "
                       "prefill ranks (not modelled; use --decode-tp >= --prefill-tp)")
    return gp, gd


# One process of the run before its KV cache and tables: Python, numpy, msgspec, NIXL and UCX (60-80 MB measured
# per process on 2 cores; benchmarks/bench_memory.py).
PROCESS_BYTES = 128 << 20


@dataclass(frozen=True)
class RowSize:
    """One sweep point's sizes, known from the flags before anything is allocated."""

    block_tokens: int
    tokens: int
    blocks: int  # per request per region
    requests: int
    num_blocks: int  # per region in each pool (tables.block_tables: every request's runs of blocks)
    regions_p: int
    regions_d: int


def memory_need(cfg: BenchConfig, sizes: list[RowSize], pool_p: list[int], pool_d: list[int]) -> tuple[int, int]:
    """(KV pools, everything else) in bytes of host memory, the whole run on this machine (parent and ranks):
    the pools (on the host with --device cpu); the block tables (int64 ids, requests x blocks per side and row:
    the parent holds every row's, builds one at about 6 tables' worth of temporaries and sends a copy to each
    rank); on each D rank the remote dlist (24 B per descriptor, kvcache.block_descs) and about as much again
    while NIXL converts each prepped dlist, and 8 B per descriptor of every READ handle (its int32 ids:
    requests x regions x blocks); and PROCESS_BYTES for each process (the parent, the forkserver, every rank).
    NIXL's own per-descriptor state was measured at under 8 B (nixl-cu13 1.x); benchmarks/bench_memory.py
    prints this figure next to the run's measured peak."""
    ranks = cfg.ptp + cfg.dtp
    table = [2 * r.requests * r.blocks * 8 for r in sizes]  # both sides' tables of one row
    parent = sum(table) + 3 * max(table, default=0)
    per_d = max((2 * 24 * r.regions_d * r.num_blocks + 8 * r.requests * r.regions_d * r.blocks for r in sizes),
                default=0)
    meta = (ranks + 2) * PROCESS_BYTES + parent + ranks * max(table, default=0) + cfg.dtp * per_d
    pools = sum(pool_p) + sum(pool_d) if cfg.device == "cpu" else 0
    return pools, meta


def row_sizes(cfg: BenchConfig) -> tuple[list[RowSize], list[int], list[int]]:
    """Every sweep point's sizes and the pools per P and D rank, from the flags alone (nothing allocated)."""
    shape = cfg.shape
    llc = tables.llc_bytes()
    sizes: list[RowSize] = []
    pool_p = [0] * cfg.ptp
    pool_d = [0] * cfg.dtp
    for tokens in cfg.tokens:
        for bt in cfg.block_sizes:
            head_bytes = bt * shape.head_dim * shape.dtype_bytes
            if head_bytes % CELL:
                raise BadInput(f"block of {bt} tokens x head dim {shape.head_dim} x {shape.dtype_bytes} B is "
                               f"{head_bytes} B per head: must be a multiple of {CELL} (the pattern's cell)")
            gp, gd = rank_geometries(cfg, bt)
            blocks = math.ceil(tokens / bt)
            req_bytes = gd.num_regions * blocks * gd.block_len
            requests = cfg.requests or tables.auto_requests(req_bytes, 4 * llc)
            run = max(1, min(cfg.run_length, blocks))
            num_blocks = requests * math.ceil(blocks / run) * run  # tables.block_tables' pool
            sizes.append(RowSize(bt, tokens, blocks, requests, num_blocks, gp.num_regions, gd.num_regions))
            pool_p = [max(n, tables.arena_bytes(gp, num_blocks)) for n in pool_p]
            pool_d = [max(n, tables.arena_bytes(gd, num_blocks)) for n in pool_d]
    return sizes, pool_p, pool_d


def make_plan(cfg: BenchConfig) -> Plan:
    """The sweep's rows with their block tables, after every size is checked: the memory the flags need
    (memory_need) against this machine's before any table is built."""
    check_flags(cfg)
    shape = cfg.shape
    llc = tables.llc_bytes()
    sizes, pool_p, pool_d = row_sizes(cfg)
    if cfg.corrupt is not None and cfg.corrupt >= shape.regions * min(r.blocks for r in sizes):
        raise BadInput(f"--corrupt-block {cfg.corrupt} is past the {shape.regions * min(r.blocks for r in sizes)} "
                       "descriptors of a request")
    pools, meta = memory_need(cfg, sizes, pool_p, pool_d)
    mem = int(host(llc)["mem_bytes"] or 0)
    if mem and pools + meta > cfg.max_mem_fraction * mem:
        flags = f"--tokens {','.join(map(str, cfg.tokens))} --requests {cfg.requests or 'auto'}"
        flags += f" --block-size {','.join(map(str, cfg.block_sizes))}"
        raise BadInput(f"{flags}: the run needs {_gib(pools + meta)} of host memory (KV pools {_gib(pools)}, block "
                       f"tables and descriptors {_gib(meta)}), more than {cfg.max_mem_fraction:.0%} of this "
                       f"machine's {_gib(mem)}; lower --tokens, --requests, --layers or the largest --block-size")
    for r in sizes:
        if r.regions_p * r.num_blocks >= 2**31:
            raise BadInput(f"row bs={r.block_tokens} tok={r.tokens}: {r.regions_p * r.num_blocks} descriptors exceed "
                           "int32 ids")
    rows = [tables.plan_row(i, r.block_tokens, r.tokens, r.requests, cfg.run_length, cfg.seed)
            for i, r in enumerate(sizes)]
    return Plan(rows, pool_p, pool_d, llc)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 1 << 40 else f"{n / 2**40:,.0f} TiB"
