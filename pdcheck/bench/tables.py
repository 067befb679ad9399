"""The sweep's seeded block tables (all TP ranks of one engine share one block table).

The KV geometry itself (regions, block bytes, which P rank's head slice a D rank reads) is pdcheck.geometry's,
and descriptor ids over the tables are kvcache.desc_ids, the same as `pdcheck handshake` uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdcheck.bounds import MAX_BENCH_REQUESTS
from pdcheck.geometry import Geometry

PAGE = 4096


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


def table_bytes(table: np.ndarray) -> bytes:
    """A (requests, blocks) block table as it travels in bm.Row: raw little-endian int64."""
    return np.ascontiguousarray(table, dtype="<i8").tobytes()


def table_of(data: bytes, requests: int) -> np.ndarray:
    """The (requests, blocks) block table back from table_bytes."""
    return np.frombuffer(data, dtype="<i8").reshape(requests, -1)


def contiguous_runs(local_ids: np.ndarray, l_bytes: int, remote_ids: np.ndarray, r_bytes: int, length: int) -> int:
    """Descriptors left if every address-contiguous run (on both sides at once) were merged into one."""
    if local_ids.size == 0:
        return 0
    la = local_ids.astype(np.int64) * l_bytes
    ra = remote_ids.astype(np.int64) * r_bytes
    breaks = (la[1:] != la[:-1] + length) | (ra[1:] != ra[:-1] + length)
    return int(breaks.sum()) + 1


def arena_bytes(geometry: Geometry, num_blocks: int) -> int:
    """A rank's KV cache for one row, in whole pages."""
    n = geometry.num_regions * num_blocks * geometry.block_len
    return -(-n // PAGE) * PAGE


def auto_requests(request_bytes: int, target_ws: int) -> int:
    """Enough requests that cycling through them touches `target_ws` bytes per side (>= 2 requests)."""
    return int(min(MAX_BENCH_REQUESTS, max(2, math.ceil(target_ws / max(1, request_bytes)))))


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
