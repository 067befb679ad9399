"""Timed loops on the decode (initiator) rank, and the statistics the parent derives from them.

The hot loop re-posts prepped handles and busy-polls: a sleep would dominate transfers of a few µs,
and a progress thread would steal the core it measures on. It calls NIXL's bindings directly when
they are there (the Python wrapper adds ~0.3 µs per call) and the public API otherwise.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcheck.errors import NixlCallError
from pdcheck.geometry import Geometry
from pdcheck.kvcache import CELL, Arena, KVCache, decode_cell, pattern
from pdcheck.messages import Ceiling


class Poster:
    """Posts prepped handles and busy-polls them, through the bindings when the wheel exposes them."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        try:
            bind = importlib.import_module(type(raw).__module__).nixlBind
            self._fast: tuple[Any, Any, Any, Any] | None = (
                raw.agent.postXferReq, raw.agent.getXferStatus, bind.NIXL_IN_PROG, bind.NIXL_SUCCESS)
        except (ImportError, AttributeError):
            self._fast = None

    def one(self, h: Any) -> bool:
        """One transfer, to completion; False when NIXL reports an error."""
        if self._fast:
            post, status, busy, ok = self._fast
            hh = h._handle
            st = post(hh, b"")
            while st == busy:
                st = status(hh)
            return bool(st == ok)
        st = self.raw.transfer(h)
        while st == "PROC":
            st = self.raw.check_xfer_state(h)
        return bool(st == "DONE")

    def timed(self, handles: Sequence[Any], iters: int, context: str) -> tuple[list[int], int]:
        """`iters` transfers cycling over `handles`: per-transfer ns and the loop's wall ns.

        The fast path is the raw loop (benchmarks/raw_nixl_loop.py) plus two clock reads and an append.
        """
        now = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        n = len(handles)
        if self._fast:
            post, status, busy, ok = self._fast
            hs = [h._handle for h in handles]
            start = now()
            for i in range(iters):
                hh = hs[i % n]
                t0 = now()
                st = post(hh, b"")
                while st == busy:
                    st = status(hh)
                append(now() - t0)
                if st != ok:
                    raise NixlCallError("transfer", "NIXL_ERR_BACKEND", f"transfer state {st}", context)
            return lat, now() - start
        start = now()
        for i in range(iters):
            t0 = now()
            done = self.one(handles[i % n])
            append(now() - t0)
            if not done:
                raise NixlCallError("transfer", "NIXL_ERR_BACKEND", "transfer state ERR", context)
        return lat, now() - start


def auto_iters(per_op_s: float, min_time: float, floor: int = 20, cap: int = 200_000) -> int:
    if per_op_s <= 0:
        return cap
    return int(min(cap, max(floor, math.ceil(min_time / per_op_s))))


def memcpy_ceiling(pool: Arena, used: int, nbytes: int, budget_s: float) -> Ceiling:
    """One-thread copy of `nbytes` between slots of the pool, rotating over `used` bytes (beyond the LLC)."""
    pairs = max(1, used // nbytes // 2)
    lat: list[int] = []
    now = time.perf_counter_ns
    deadline = time.perf_counter() + budget_s
    i = 0
    while i < 3 or (time.perf_counter() < deadline and i < 10_000):
        p = i % pairs
        t0 = now()
        pool.copy((2 * p + 1) * nbytes, 2 * p * nbytes, nbytes)
        pool.sync()
        lat.append(now() - t0)
        i += 1
    arr = np.array(lat[1:] if len(lat) > 3 else lat, dtype=np.int64)  # the first copy may fault pages in
    med = float(np.median(arr))
    return Ceiling(gbps=nbytes / med, p50_us=med / 1e3, nbytes=nbytes, iters=len(arr),
                   working_set=min(used, 2 * pairs * nbytes))


@dataclass
class WireSide:
    addr: int
    used: int  # bytes of the pool that hold this row's blocks
    dev: int


def wire_ceiling(
    agent: Any,
    poster: Poster,
    remote: str,
    mem_type: str,
    local: WireSide,
    far: WireSide,
    nbytes: int,
    budget_s: float,
    notif: bytes,
    verify: Callable[[int, int], int],
) -> Ceiling:
    """The same bytes as ONE descriptor, rotating over slots of both pools: what the wire gives for free."""
    slots = max(1, min(local.used // nbytes, far.used // nbytes))
    offs = np.arange(slots, dtype=np.uint64) * np.uint64(nbytes)
    ld = np.stack([np.uint64(local.addr) + offs, np.full(slots, nbytes, np.uint64),
                   np.full(slots, local.dev, np.uint64)], axis=1)
    rd = np.stack([np.uint64(far.addr) + offs, np.full(slots, nbytes, np.uint64),
                   np.full(slots, far.dev, np.uint64)], axis=1)
    lh = agent.prep("NIXL_INIT_AGENT", ld, mem_type, "wire ceiling local dlist")
    rh = agent.prep(remote, rd, mem_type, "wire ceiling remote dlist")
    raw = agent.raw
    handles = []
    try:
        for s in range(slots):
            idx = np.array([s], dtype=np.int32)
            handles.append(raw.make_prepped_xfer("READ", lh, idx, rh, idx, notif))
        t0 = time.perf_counter()
        for h in handles:  # first touch + connection warm-up, then the estimate
            if not poster.one(h):
                raise NixlCallError("transfer", "NIXL_ERR_BACKEND", "transfer state ERR", "wire ceiling")
        per = (time.perf_counter() - t0) / slots
        iters = auto_iters(per, budget_s, floor=max(5, min(slots, 50)), cap=20_000)
        lat, wall = poster.timed(handles, iters, "wire ceiling")
        last = (iters - 1) % slots
        wrong = verify(last * nbytes, nbytes)
    finally:
        for h in handles:
            raw.release_xfer_handle(h)
        raw.release_dlist_handle(lh)
        raw.release_dlist_handle(rh)
    arr = np.array(lat, dtype=np.int64)
    return Ceiling(gbps=nbytes * iters / wall, p50_us=float(np.median(arr)) / 1e3, nbytes=nbytes, iters=iters,
                   working_set=slots * nbytes, wrong=wrong)


@dataclass
class Check:
    checked: int = 0  # blocks compared
    wrong: int = 0  # blocks with at least one wrong byte
    first: str | None = None  # the first wrong block: where, and what arrived instead


def verify_requests(kv: KVCache, gp: Geometry, tag: int, src: int, offset: int, tables_p: np.ndarray,
                    tables_d: np.ndarray, chunk_bytes: int = 64 << 20) -> Check:
    """Compare every transferred decode block with the coordinate pattern of the prefill block it was read from
    (D holds bytes [offset, offset + block_len) of P rank src's block), a bounded number of regions at a time."""
    out = Check()
    g, bd = kv.geometry, kv.block_len
    for q in range(tables_p.shape[0]):
        p_ids, d_ids = tables_p[q], tables_d[q]
        step = max(1, chunk_bytes // max(1, len(d_ids) * bd))
        for lo in range(0, g.num_regions, step):
            regs = np.arange(lo, min(lo + step, g.num_regions))
            got = kv.read_all(d_ids, 0, bd, lo, lo + len(regs))
            exp = pattern(tag, src, np.repeat(regs, len(p_ids)), np.tile(p_ids, len(regs)), offset, bd).reshape(
                got.shape)
            bad = (got != exp).any(axis=2)
            out.checked += bad.size
            out.wrong += int(bad.sum())
            if out.first is None and bad.any():
                r, i = (int(x) for x in np.argwhere(bad)[0])
                byte = int(np.flatnonzero(got[r, i] != exp[r, i])[0])
                cell = byte // CELL * CELL
                found = decode_cell(got[r, i, cell:cell + CELL]).describe(gp)
                out.first = (f"{g.region_name(int(regs[r]))}, prefill block {int(p_ids[i])} -> decode block "
                             f"{int(d_ids[i])}, byte offset {byte}; found {found}")
    return out


def wrong_words(got: np.ndarray, tag: int, src: int, gp: Geometry, num_blocks: int, start: int,
                chunk_bytes: int = 8 << 20) -> int:
    """Wrong 8-byte words in bytes [start, start + len(got)) of P rank src's tagged KV cache (its regions back
    to back from the arena's start): the wire ceiling's one-descriptor READ. Chunked: a 128 MiB transfer must
    not allocate gigabytes of temporaries."""
    bp = gp.block_len
    wrong = 0
    step = max(1, chunk_bytes // bp)
    first, last = start // bp, -(-(start + got.size) // bp)
    for lo in range(first, last, step):
        rows = np.arange(lo, min(lo + step, last))
        exp = pattern(tag, src, rows // num_blocks, rows % num_blocks, 0, bp).reshape(-1)
        a, b = max(start, lo * bp), min(start + got.size, (lo + len(rows)) * bp)
        part = got[a - start:b - start].view(np.uint64)
        wrong += int((part != exp[a - lo * bp:b - lo * bp].view(np.uint64)).sum())
    return wrong


@dataclass
class Summary:
    samples: int
    time_us: float  # mean per transfer
    p50_us: float
    p90_us: float
    p99_us: float
    p999_us: float
    max_us: float
    min_us: float
    cv_pct: float


def summarize(lat_ns: np.ndarray) -> Summary:
    us = lat_ns.astype(np.float64) / 1e3
    if us.size == 0:
        return Summary(0, *(float("nan"),) * 8)
    p50, p90, p99, p999 = (float(x) for x in np.percentile(us, [50, 90, 99, 99.9]))
    mean = float(us.mean())
    return Summary(int(us.size), mean, p50, p90, p99, p999, float(us.max()), float(us.min()),
                   float(us.std() / mean * 100) if mean > 0 else 0.0)
