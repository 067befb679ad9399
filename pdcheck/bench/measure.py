"""Ceilings and checks on the decode (initiator) rank, and the statistics the parent derives from them.

The timed loop is the agent wrapper's (nixlagent.Agent.timed): it re-posts prepped handles and busy-polls,
since a sleep would dominate transfers of a few µs and a progress thread would steal the core it measures
on. Blocks are checked by kvcache.check_blocks, the transfer proof's check.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcheck.bench.messages import Ceiling
from pdcheck.geometry import Geometry
from pdcheck.kvcache import Arena, BlockCheck, KVCache, check_blocks
from pdcheck.nixlagent import LOCAL, Agent


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
    agent: Agent,
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
    lh = agent.prep(LOCAL, ld, mem_type, "wire ceiling local dlist")
    rh = agent.prep(remote, rd, mem_type, "wire ceiling remote dlist")
    handles: list[Any] = []
    try:
        for s in range(slots):
            idx = np.array([s], dtype=np.int32)
            handles.append(agent.make_read(lh, idx, rh, idx, notif, "wire ceiling"))
        t0 = time.perf_counter()
        for h in handles:  # first touch + connection warm-up, then the estimate
            agent.complete(h, "wire ceiling")
        per = (time.perf_counter() - t0) / slots
        iters = auto_iters(per, budget_s, floor=max(5, min(slots, 50)), cap=20_000)
        lat, wall = agent.timed(handles, iters, "wire ceiling")
        last = (iters - 1) % slots
        wrong = verify(last * nbytes, nbytes)
    finally:
        agent.release(*handles)
        agent.release_dlist(lh, rh)
    arr = np.array(lat, dtype=np.int64)
    return Ceiling(gbps=nbytes * iters / wall, p50_us=float(np.median(arr)) / 1e3, nbytes=nbytes, iters=iters,
                   working_set=slots * nbytes, wrong=wrong)


@dataclass
class Check:
    checked: int = 0  # blocks compared
    wrong: int = 0  # blocks with at least one wrong byte
    first: str | None = None  # the first wrong block: where, and what arrived instead


def verify_requests(kv: KVCache, gp: Geometry, tag: int, src: int, offset: int, tables_p: np.ndarray,
                    tables_d: np.ndarray) -> Check:
    """Every request's decode blocks against the prefill blocks they were read from (D holds bytes
    [offset, offset + block_len) of P rank src's block), by kvcache.check_blocks, the transfer proof's check."""
    chk = BlockCheck()
    for q in range(tables_p.shape[0]):
        check_blocks(kv, tables_d[q], tables_p[q], tag, src, read_len=kv.block_len, remote_offset=offset, out=chk)
    w = chk.first
    first = None if w is None else (f"{gp.region_name(w.region)}, prefill block {w.remote_block} -> decode block "
                                    f"{w.local_block}, byte offset {w.byte}; found {w.found.describe(gp)}")
    return Check(chk.checked, chk.wrong, first)


def summarize(lat_ns: np.ndarray) -> dict[str, float]:
    """Per-transfer latency statistics in µs, keyed by schema.Row's field names (time_us is the mean)."""
    us = lat_ns.astype(np.float64) / 1e3
    keys = ("time_us", "p50_us", "p90_us", "p99_us", "p999_us", "max_us", "min_us", "cv_pct")
    if us.size == 0:
        return dict.fromkeys(keys, float("nan"))
    mean = float(us.mean())
    vals = [mean, *(float(x) for x in np.percentile(us, [50, 90, 99, 99.9])), float(us.max()), float(us.min()),
            float(us.std() / mean * 100) if mean > 0 else 0.0]
    return dict(zip(keys, vals, strict=True))
