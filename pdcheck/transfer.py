"""The transfer proof on a D rank: real NIXL READs with the descriptor math a model chose, verified by coordinate.

Local descriptor ids are region * local_num_blocks + block; remote ids are region * stride + block, where the
stride is what the release recorded for the engine (dst_num_blocks) or, corrected, the remote rank's own count.
Where a release reads K and V as two halves of each block (Prepared.halves), each region counts as two virtual
regions (K half, V half), as vLLM 0.23 - 0.25 order their descriptors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pdcheck.engine import Outcome
from pdcheck.errors import NixlCallError
from pdcheck.kvcache import CELL, CHUNK_BYTES, BlockView, KVCache, decode_cell, pattern
from pdcheck.messages import Mismatch, Req, TransferResult
from pdcheck.nixlagent import LOCAL, Agent
from pdcheck.releases.base import Local, Prepared

TagFn = Callable[[int, dict[int, list[int]]], None]


class LocalLists:
    """Local dlists over the whole cache, one per (read length, offset in block, halves): prepared once, like
    vLLM."""

    def __init__(self, agent: Agent, kv: KVCache, device_id: int) -> None:
        self.agent, self.kv, self.device_id = agent, kv, device_id
        self._h: dict[tuple[int, int], Any] = {}

    def get(self, read_len: int, offset: int, halves: int = 1) -> Any:
        key = (read_len, offset, halves)
        if key not in self._h:
            descs = self.kv.descs(read_len, self.device_id, offset=offset, halves=halves)
            self._h[key] = self.agent.prep(LOCAL, descs, self.kv.mem_type, "local")
        return self._h[key]


def _ids(regions: int, stride: int, blocks: list[int]) -> np.ndarray:
    b = np.asarray(blocks, dtype=np.int64)
    return (np.arange(regions, dtype=np.int64)[:, None] * stride + b[None, :]).reshape(-1)


def prove(agent: Agent, kv: KVCache, local: Local, outcome: Outcome, *, corrected: bool, remote_handles: dict[int, Any],
          lists: LocalLists, requests: list[Req], p_tag: int, notif: str, tp_ratio: int, tag: TagFn,
          live: bool = False) -> TransferResult:
    """READ every request's blocks and verify them by coordinate. live: P is an instance pdcheck does not
    drive (--prefill-endpoint); its blocks are verified only where they carry pdcheck's tags (pdcheck serve),
    otherwise the result says that the bytes arrived and that their content cannot be checked."""
    if not outcome.prepared:
        return TransferResult("skipped", message="no remote descriptor list was prepared")
    res = TransferResult("ok", stride=None if corrected else outcome.stride)
    wrong_regions: set[int] = set()
    unchecked = 0
    for req in requests:
        for prep in outcome.prepared:
            stride = prep.dlist_blocks if corrected else (outcome.stride or prep.dlist_blocks)
            regions = kv.geometry.num_regions * prep.halves  # virtual regions: K and V halves when split
            lids = _ids(regions, kv.num_blocks, req.local_block_ids)
            rids = _ids(regions, stride, req.remote_block_ids)
            limit = len(prep.base_addrs) * prep.halves * prep.dlist_blocks  # the remote list's real size
            phys: dict[int, list[int]] = {}
            for rid in rids[rids < limit]:
                phys.setdefault(int(rid // prep.dlist_blocks) // prep.halves, []).append(
                    int(rid % prep.dlist_blocks))
            if not live:
                tag(prep.p_rank, phys)
            kv.clear_all(np.asarray(req.local_block_ids))
            msg = notif.format(req=req.req_id, tp_ratio=tp_ratio, d_world_size=local.tp_size).encode()
            try:
                res.seconds += agent.read(lists.get(prep.block_len, prep.local_offset, prep.halves), lids,
                                          remote_handles[prep.p_rank], rids, msg,
                                          context=f"{req.req_id} from P rank {prep.p_rank}")
            except NixlCallError as exc:
                res.status, res.message = "error", f"{exc.detail} [{exc.status}] ({exc.context})"
                res.blocks += len(lids)
                return res
            if live and not _tagged(kv, prep, req, p_tag):
                unchecked += len(lids)
                res.blocks += len(lids)
                res.bytes += len(lids) * prep.block_len
                continue
            _verify(kv, prep, req, p_tag, res, wrong_regions)
    res.wrong_regions = sorted(wrong_regions)
    if unchecked and not res.wrong:
        res.status = "arrived"
        res.message = (f"READ DONE: {res.blocks} blocks ({res.bytes} bytes) arrived; content not checkable: the "
                       "live P's blocks carry no pdcheck coordinate tags (not pdcheck serve, or past --tag-blocks)")
        return res
    if res.wrong:
        res.status = "wrong"
        regs = ", ".join(str(r) for r in res.wrong_regions)
        res.message = f"READ DONE, {res.wrong} of {res.blocks} blocks wrong: region {regs} received other blocks"
    return res


def _tagged(kv: KVCache, prep: Prepared, req: Req, p_tag: int) -> bool:
    """Whether the first block read holds a pdcheck coordinate cell of the expected engine (pdcheck serve)."""
    if not req.local_block_ids:
        return False
    got = kv.read_blocks(0, np.asarray(req.local_block_ids[:1]))[0, prep.local_offset:prep.local_offset + CELL]
    found = decode_cell(got)
    return found.valid and found.tag == p_tag


def _join(parts: list[np.ndarray], axis: int) -> np.ndarray:
    """np.concatenate, without its copy when there is one part (one half per block)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)


def _rows_differ(got: np.ndarray, exp: np.ndarray) -> np.ndarray:
    """(got != exp).any(axis=-1), compared 8 bytes at a time where the rows allow it (8x fewer elements)."""
    if got.shape[-1] % 8 == 0:
        try:
            return (got.view(np.uint64) != exp.view(np.uint64)).any(axis=-1)
        except ValueError:  # a last axis that is not contiguous cannot be viewed as wider words
            pass
    return (got != exp).any(axis=-1)


def _verify(kv: KVCache, prep: Prepared, req: Req, p_tag: int, res: TransferResult, wrong_regions: set[int]) -> None:
    remote = np.asarray(req.remote_block_ids, dtype=np.int64)
    local_ids = np.asarray(req.local_block_ids, dtype=np.int64)
    lo, n = prep.local_offset, prep.block_len
    # D reads the P block as if it had D's own layout (vLLM assumes equal layouts): check it that way.
    g = kv.geometry
    head_bytes = g.head_cell_bytes
    p_heads = max(1, prep.remote_block_len // max(1, g.block_size * head_bytes))
    view = BlockView.of("HND" if kv.view.heads_first else "NHD", p_heads, g.block_size, head_bytes,
                        plain=not g.per_head_view)
    local_half, remote_half = kv.block_len // prep.halves, prep.remote_block_len // prep.halves
    regions, k = kv.geometry.num_regions, len(local_ids)

    def got_exp(first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """Read and expected bytes of regions first..last-1: (regions, blocks, bytes read per block). Each half
        (K, then V when split) of the local block holds its slice of the same half of the P block."""
        got = _join([kv.read_all(local_ids, h * local_half + lo, n, first, last) for h in range(prep.halves)], 2)
        reg = np.repeat(np.arange(first, last, dtype=np.int64), k)
        blk = np.tile(remote, last - first)
        exp = _join([pattern(p_tag, prep.p_rank, reg, blk, prep.rank_offset + h * remote_half, n, view)
                     for h in range(prep.halves)], 1).reshape(got.shape)
        return got, exp

    # A few regions per pass (CHUNK_BYTES): the pattern and the bytes read stay in cache.
    step = max(1, CHUNK_BYTES // max(1, k * n * prep.halves))
    bad_block = np.zeros((regions, k), dtype=bool)
    for first in range(0, regions, step):
        last = min(regions, first + step)
        bad_block[first:last] = _rows_differ(*got_exp(first, last))
    res.blocks += regions * k
    res.bytes += regions * k * n * prep.halves
    res.wrong += int(bad_block.sum())
    if not bad_block.any():
        return
    wrong_regions.update(int(r) for r in np.flatnonzero(bad_block.any(axis=1)))
    if res.first_mismatch is None:
        region, i = (int(x) for x in np.argwhere(bad_block)[0])  # region-major, like reading region by region
        got, exp = got_exp(region, region + 1)
        cell = int(np.flatnonzero(got[0, i] != exp[0, i])[0]) // CELL * CELL
        found = decode_cell(got[0, i][cell:cell + CELL])
        at = prep.rank_offset + (cell // n) * remote_half + cell % n  # byte offset in the P block
        res.first_mismatch = Mismatch(
            region=region, local_block=int(local_ids[i]), remote_block=int(remote[i]), p_rank=prep.p_rank,
            expected=f"P rank {prep.p_rank} {kv.geometry.region_name(region)} (region {region}) block "
            f"{int(remote[i])} +{at}",
            found=found.describe(kv.geometry),
        )
