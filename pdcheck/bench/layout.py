"""vLLM-shaped KV geometry: per-rank block sizes, seeded block tables, descriptor arrays.

vLLM registers one region per layer and K/V (MLA: per layer), each `num_blocks` blocks long, and
addresses a block as descriptor id `region * num_blocks + block_id`. Blocks are HND (heads outermost
within a block), so a decode rank with fewer heads than its prefill peer reads a contiguous slice of
each prefill block. All TP ranks of one engine share one block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdcheck.bench.models import ModelShape
from pdcheck.errors import BadInput

PAGE = 4096
MAX_REQUESTS = 4096


@dataclass(frozen=True)
class RankGeom:
    """What one TP rank holds per block: a slice of heads (or the whole replicated MLA latent)."""

    tp: int
    rank: int
    head_start: int
    heads: int
    head_bytes: int  # one head of one block (block_tokens * head_dim * dtype)

    @property
    def block_bytes(self) -> int:
        return self.heads * self.head_bytes

    @property
    def word_offset(self) -> int:
        """Offset of this rank's slice inside the logical (all-heads) block, in 8-byte words."""
        return self.head_start * self.head_bytes // 8


def rank_geom(shape: ModelShape, tp: int, rank: int, block_tokens: int) -> RankGeom:
    head_bytes = block_tokens * shape.head_dim * shape.dtype_bytes
    if shape.mla:
        return RankGeom(tp, rank, 0, 1, head_bytes)  # latent KV is replicated on every rank
    h = shape.kv_heads
    if tp <= h:
        if h % tp:
            raise BadInput(f"TP {tp} does not divide the {h} KV heads")
        n = h // tp
        return RankGeom(tp, rank, rank * n, n, head_bytes)
    if tp % h:
        raise BadInput(f"TP {tp} is larger than the {h} KV heads and not a multiple of them")
    return RankGeom(tp, rank, rank // (tp // h), 1, head_bytes)  # vLLM replicates heads when TP > heads


@dataclass(frozen=True)
class ReadPlan:
    """Where decode rank `d` reads from: prefill rank `src`, at `offset` bytes into each prefill block."""

    d: RankGeom
    p: RankGeom
    offset: int


def read_plan(shape: ModelShape, ptp: int, dtp: int, d_rank: int, block_tokens: int) -> ReadPlan:
    d = rank_geom(shape, dtp, d_rank, block_tokens)
    candidates = []
    for p_rank in range(ptp):
        p = rank_geom(shape, ptp, p_rank, block_tokens)
        if p.head_start <= d.head_start and d.head_start + d.heads <= p.head_start + p.heads:
            candidates.append(p)
    if not candidates:
        raise BadInput(
            f"decode TP {dtp} < prefill TP {ptp}: a decode rank would need heads from several prefill ranks "
            "(not modelled; use --decode-tp >= --prefill-tp)"
        )
    p = candidates[d_rank % len(candidates)]  # spread replicated sources over the prefill ranks
    return ReadPlan(d, p, (d.head_start - p.head_start) * d.head_bytes)


@dataclass
class RowPlan:
    """One sweep point: shape knobs plus the seeded block tables both sides use."""

    index: int
    block_tokens: int
    tokens: int
    blocks: int  # blocks per request per region (last one partial when tokens % block_tokens)
    requests: int
    run_length: int  # effective contiguous run length (capped at `blocks`)
    num_blocks: int  # blocks per region in each pool
    tables_p: np.ndarray  # (requests, blocks) prefill block ids
    tables_d: np.ndarray  # (requests, blocks) decode block ids

    def label(self) -> str:
        return f"bs={self.block_tokens} tok={self.tokens}"


def block_tables(requests: int, blocks: int, run: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Per-request block ids built from shuffled runs of `run` contiguous blocks (run 1 = fully scattered).

    The pool is cut into slots of `run` blocks; each request takes ceil(blocks/run) random slots, so a
    request's blocks are contiguous in runs of `run` and the runs land anywhere, like a busy allocator.
    """
    run = max(1, min(run, blocks))
    runs_per_req = math.ceil(blocks / run)
    slots = requests * runs_per_req
    perm = rng.permutation(slots).reshape(requests, runs_per_req).astype(np.int64)
    ids = (perm[:, :, None] * run + np.arange(run, dtype=np.int64)[None, None, :]).reshape(requests, -1)
    return np.ascontiguousarray(ids[:, :blocks]), slots * run


def plan_row(index: int, block_tokens: int, tokens: int, requests: int, run_length: int, seed: int) -> RowPlan:
    blocks = math.ceil(tokens / block_tokens)
    run = max(1, min(run_length, blocks))
    # Independent streams per side: prefill and decode allocators never agree on block ids.
    tp_, nb = block_tables(requests, blocks, run, np.random.default_rng([seed, index, 0]))
    td, nb_d = block_tables(requests, blocks, run, np.random.default_rng([seed, index, 1]))
    assert nb == nb_d
    return RowPlan(index, block_tokens, tokens, blocks, requests, run, nb, tp_, td)


def desc_ids(regions: int, num_blocks: int, table: np.ndarray) -> np.ndarray:
    """vLLM descriptor ids for one request, region-major: region * num_blocks + block_id (int32 for NIXL)."""
    ids = np.arange(regions, dtype=np.int64)[:, None] * num_blocks + table[None, :]
    out = ids.ravel()
    if out.size and int(out.max()) >= 2**31:
        raise BadInput("pool too large: descriptor ids exceed int32; lower --requests or --tokens")
    return out.astype(np.int32)


def pool_descs(base: int, regions: int, num_blocks: int, block_bytes: int, length: int, dev: int,
               offset: int = 0) -> np.ndarray:
    """Nx3 (addr, len, devId) for every block of every region, in descriptor-id order."""
    n = regions * num_blocks
    out = np.empty((n, 3), dtype=np.uint64)
    out[:, 0] = np.uint64(base + offset) + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
    out[:, 1] = length
    out[:, 2] = dev
    return out


def contiguous_runs(local_ids: np.ndarray, l_bytes: int, remote_ids: np.ndarray, r_bytes: int, length: int) -> int:
    """Descriptors left if every address-contiguous run (on both sides at once) were merged into one."""
    if local_ids.size == 0:
        return 0
    la = local_ids.astype(np.int64) * l_bytes
    ra = remote_ids.astype(np.int64) * r_bytes
    breaks = (la[1:] != la[:-1] + length) | (ra[1:] != ra[:-1] + length)
    return int(breaks.sum()) + 1


def pool_bytes(shape: ModelShape, geom: RankGeom, num_blocks: int) -> int:
    n = shape.regions * num_blocks * geom.block_bytes
    return -(-n // PAGE) * PAGE


def auto_requests(request_bytes: int, target_ws: int) -> int:
    """Enough requests that cycling through them touches `target_ws` bytes per side (>= 2 requests)."""
    return int(min(MAX_REQUESTS, max(2, math.ceil(target_ws / max(1, request_bytes)))))


def llc_bytes() -> int:
    """Largest CPU cache (the LLC) from sysfs; 32 MiB when unknown."""
    import glob

    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 32 << 20
