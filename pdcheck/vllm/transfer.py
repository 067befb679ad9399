"""The transfer proof on a D rank: real NIXL READs with the descriptor math a model chose, verified by coordinate.

Local descriptor ids are region * local_num_blocks + block; remote ids are region * stride + block, where the
stride is what the release recorded for the engine (dst_num_blocks) or, corrected, the remote rank's own count.
Where a release reads K and V as two halves of each block (Prepared.halves), each region counts as two virtual
regions (K half, V half), as vLLM 0.23 - 0.25 order their descriptors. The ids are kvcache.desc_ids, the
READs nixlagent.Agent.read and the check kvcache.check_blocks: the same three transfer-bench uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np

from pdcheck.errors import NixlCallError
from pdcheck.kvcache import KVCache, check_blocks, desc_ids
from pdcheck.messages import Mismatch, TransferResult
from pdcheck.nixlagent import LOCAL, Agent
from pdcheck.pattern import CELL, BlockView, SliceView, decode_cell, head_token
from pdcheck.vllm.engine import Outcome
from pdcheck.vllm.messages import Req
from pdcheck.vllm.releases import hybrid
from pdcheck.vllm.releases.base import Local, Prepared, ReleaseModel

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


def prove(agent: Agent, kv: KVCache, local: Local, outcome: Outcome, *, corrected: bool, remote_handles: dict[int, Any],
          lists: LocalLists, requests: list[Req], p_tag: int, notif: str, tp_ratio: int, tag: TagFn,
          live: bool = False, release: ReleaseModel | None = None) -> TransferResult:
    """READ every request's blocks and verify them by coordinate. live: P is an instance pdcheck does not
    drive (--prefill-endpoint); its blocks are verified only where they carry pdcheck's tags (pdcheck serve),
    otherwise the result says that the bytes arrived and that their content cannot be checked. release: a
    hybrid model's groups are read as that release reads them (releases.hybrid.group_reads: a sliding-window
    group its window's blocks, a Mamba group its one state page); None: every block of every region."""
    if not outcome.prepared:
        return TransferResult("skipped", message="no remote descriptor list was prepared")
    res = TransferResult("ok", stride=None if corrected else outcome.stride)
    wrong_regions: set[int] = set()
    unchecked = 0
    reads = (hybrid.group_reads(release, kv.geometry) if release is not None
             else [hybrid.GroupRead(0, 0, kv.geometry.num_regions, None)])
    for req in requests:
        for prep in _sub_blocks(outcome.prepared, kv.block_len):
            prep, req = prep[0], _mapped(req, prep[1], prep[0])
            stride = prep.dlist_blocks if corrected else (outcome.stride or prep.dlist_blocks)
            # One READ per request over every group's descriptors (as vLLM's one transfer per request): each
            # group its own run of (virtual: K and V halves when split) regions and its own blocks.
            parts = [(g, _clip(req, g.count)) for g in reads]
            lids = np.concatenate([desc_ids((g.last - g.first) * prep.halves, kv.num_blocks, r.local_block_ids,
                                            g.first * prep.halves) for g, r in parts])
            rids = np.concatenate([desc_ids((g.last - g.first) * prep.halves, stride, r.remote_block_ids,
                                            g.first * prep.halves) for g, r in parts])
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
            for g, r in parts:
                _verify(kv, prep, r, p_tag, res, wrong_regions, (g.first, g.last))
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


def _clip(req: Req, count: int | None) -> Req:
    """The last `count` blocks of a request (a sliding-window group's window, a Mamba group's state page)."""
    if count is None or count >= len(req.local_block_ids):
        return req
    return Req(req.req_id, req.remote_block_ids[-count:], req.local_block_ids[-count:])


def _sub_blocks(prepared: list[Prepared], block_len: int) -> list[tuple[Prepared, int]]:
    """Each prepared list once per sub-block of the local block it fills (Prepared.sub_blocks), with the local
    offset of that sub-block."""
    out: list[tuple[Prepared, int]] = []
    for prep in prepared:
        sub_len = block_len // prep.halves // prep.sub_blocks
        out += [(replace(prep, local_offset=prep.local_offset + i * sub_len), i) if prep.sub_blocks > 1 else (prep, -1)
                for i in range(prep.sub_blocks)]
    return out


def _mapped(req: Req, sub: int, prep: Prepared) -> Req:
    """The request's P blocks for sub-block `sub` of each local block: P's block j * sub_blocks + sub of the
    request (get_mapped_blocks' order), drawn from its ids so they stay inside P's cache."""
    if sub < 0:
        return req
    n = prep.dlist_blocks
    remote = [(int(b) * prep.sub_blocks + sub) % n for b in req.remote_block_ids]
    return msgspec.structs.replace(req, remote_block_ids=remote)


def _tagged(kv: KVCache, prep: Prepared, req: Req, p_tag: int) -> bool:
    """Whether the first block read holds a pdcheck coordinate cell of the expected engine (pdcheck serve)."""
    if not req.local_block_ids:
        return False
    got = kv.read_blocks(0, np.asarray(req.local_block_ids[:1]))[0, prep.local_offset:prep.local_offset + CELL]
    found = decode_cell(got)
    return found.valid and found.tag == p_tag


def _verify(kv: KVCache, prep: Prepared, req: Req, p_tag: int, res: TransferResult, wrong_regions: set[int],
            span: tuple[int, int] | None = None) -> None:
    # D reads the P block as if it had D's own layout (vLLM assumes equal layouts): check it that way.
    g = kv.geometry
    p_heads = max(1, prep.remote_block_len // max(1, g.block_size * g.head_cell_bytes))
    view = BlockView.of("HND" if kv.view.heads_first else "NHD", p_heads, g.block_size, g.head_cell_bytes,
                        plain=not g.per_head_view)
    slice_heads = prep.block_len // max(1, g.head_slice_bytes)
    if prep.permuted:  # the release permutes each received block into D's layout: what it read must be HND
        view = BlockView.of("HND", p_heads, g.block_size, g.head_cell_bytes, plain=not g.per_head_view)
    elif (g.per_head_view and not kv.view.heads_first and prep.halves == 1 and prep.local_offset == 0
            and prep.rank_offset % g.head_slice_bytes == 0 and slice_heads > 1):
        # D's own blocks are token-major: what it read must be its heads in its order, wherever P put them
        view = SliceView(False, slice_heads, g.block_size, g.head_cell_bytes, first=prep.rank_offset // g.head_slice_bytes)
    chk = check_blocks(kv, req.local_block_ids, req.remote_block_ids, p_tag, prep.p_rank, read_len=prep.block_len,
                       local_offset=prep.local_offset, remote_offset=prep.rank_offset, halves=prep.halves,
                       remote_half=prep.remote_block_len // prep.halves, view=view, region_span=span)
    res.blocks += chk.checked
    res.bytes += chk.bytes
    res.wrong += chk.wrong
    wrong_regions.update(chk.wrong_regions)
    w = chk.first
    if w is not None and res.first_mismatch is None:
        exp_at, found = w.at, w.found.describe(g)
        if view.heads > 1 and g.per_head_view:  # name the (head, token) cells: a permuted head shows as such
            exp_at = int(view.logical(np.asarray([w.at], dtype=np.uint64))[0])
            if w.found.valid:
                found += " (head {}, token {})".format(*head_token(g, w.found.offset))
        cell = " (head {}, token {})".format(*head_token(g, exp_at)) if view.heads > 1 and g.per_head_view else ""
        res.first_mismatch = Mismatch(
            region=w.region, local_block=w.local_block, remote_block=w.remote_block, p_rank=prep.p_rank,
            expected=f"P rank {prep.p_rank} {g.region_name(w.region)} (region {w.region}) block {w.remote_block} "
            f"+{exp_at}{cell}",
            found=found,
        )
