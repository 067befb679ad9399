"""KV-cache allocation, registration and coordinate tagging for one fake rank.

Host memory is an anonymous mmap per region: nothing is faulted in until a block is tagged or written,
so the seed's ~0.9 GB per rank costs only the pages actually touched. GPU memory (--device cuda) uses
torch tensors; torch is imported only on that path (it costs ~2.7 s and 650 MB per process).

Pattern: every 16-byte cell of a P block holds (coordinate word, offset word). The coordinate word packs
engine tag, P rank, region and block id; the offset word packs the byte offset and a check value. A D
rank can therefore say not only that a block is wrong but which block it received instead.
"""

from __future__ import annotations

import mmap
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcheck.geometry import Geometry

CELL = 16
CHUNK_BYTES = 1 << 20  # pattern work in pieces this big: a proof's whole pattern (tens of MB) would leave the cache
_MMAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value
_MIX = np.uint64(0x9E3779B97F4A7C15)
_SALT = 0xA5C3_5A3C  # so that zeroed (stale, never-written) memory never passes the check


def host_memory(nbytes: int, *, hugepages: bool = False) -> tuple[mmap.mmap, np.ndarray]:
    """Private anonymous host memory, the one allocation both KV caches and transfer-bench pools use.

    Private, not mmap's default shared mapping: shared anonymous memory is shmem, which gets no THP.
    NORESERVE: only touched pages cost. hugepages: ask for transparent huge pages (the bench's pools)."""
    mm = mmap.mmap(-1, max(1, nbytes), flags=_MMAP_FLAGS)
    if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled: plain pages, the same for every measured row
    return mm, np.frombuffer(mm, dtype=np.uint8)


def unique(a: np.ndarray | list[int]) -> np.ndarray:
    """np.unique of block ids (sorted, int64) without its first-call cost: numpy 2.4's unique imports numpy.ma
    (~12 ms) in every rank that calls it."""
    out = np.sort(np.asarray(a, dtype=np.int64).reshape(-1))
    if len(out) < 2:
        return out
    keep = np.empty(len(out), dtype=bool)
    keep[0] = True
    np.not_equal(out[1:], out[:-1], out=keep[1:])
    return out[keep]


def engine_tag(engine_id: str) -> int:
    return zlib.crc32(engine_id.encode()) & 0xFFF


def coord_word(tag: int, p_rank: int, region: int | np.ndarray, block: np.ndarray) -> np.ndarray:
    """region: one region, or one per block (broadcast with block)."""
    reg = np.asarray(region).astype(np.uint64) & np.uint64(0xFFF)
    return (np.uint64(tag) << np.uint64(52)) | (np.uint64(p_rank & 0xFF) << np.uint64(44)) | (
        reg << np.uint64(32)) | np.asarray(block).astype(np.uint64)


def offset_word(coord: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    check = ((coord * _MIX) ^ offsets.astype(np.uint64) ^ np.uint64(_SALT)) & np.uint64(0xFFFFFFFF)
    return (offsets.astype(np.uint64) << np.uint64(32)) | check


@dataclass(frozen=True)
class BlockView:
    """How bytes of a block map to (head, token): the logical offset a cell is tagged with.

    The logical offset is the byte offset the same element would have in a heads-first (HND) block. For an
    HND block it is the byte offset itself; for a tokens-first (NHD) block the two differ, so a reader that
    assumes the wrong layout finds other logical offsets than it expects (hazard H09).
    """

    heads_first: bool = True
    heads: int = 1
    block_size: int = 1
    head_bytes: int = CELL

    @classmethod
    def of(cls, layout: str, heads: int, block_size: int, head_bytes: int, *, plain: bool = False) -> BlockView:
        # MLA and FlashInfer blocks are not modelled per head: byte offset is the logical offset.
        if plain or head_bytes % CELL or heads <= 1:
            return cls()
        heads_first = layout.index("H") < layout.index("N") if "H" in layout and "N" in layout else True
        return cls(heads_first, heads, block_size, head_bytes)

    def logical(self, offsets: np.ndarray) -> np.ndarray:
        if self.heads_first:
            return offsets
        hb = np.uint64(self.head_bytes)
        token = offsets // (hb * np.uint64(self.heads))
        head = (offsets // hb) % np.uint64(self.heads)
        return (head * np.uint64(self.block_size) + token) * hb + offsets % hb


PLAIN = BlockView()


def pattern(tag: int, p_rank: int, region: int | np.ndarray, blocks: np.ndarray, start: int, length: int,
            view: BlockView = PLAIN) -> np.ndarray:
    """Expected bytes [start, start+length) of each given block: shape (len(blocks), length) uint8.
    region: one region for all blocks, or one per block (a whole proof in one vectorised pass).

    Written straight into the result, one pass per word: a proof's pattern is tens of MB. offset_word is
    (offset << 32) | ((coord * MIX ^ offset ^ SALT) & 0xFFFFFFFF); offsets fit in 32 bits, so that equals
    ((offset << 32) | offset) ^ ((coord * MIX ^ SALT) & 0xFFFFFFFF): one XOR of a per-offset and a per-block
    term."""
    cells = view.logical(np.arange(start // CELL, (start + length) // CELL, dtype=np.uint64) * np.uint64(CELL))
    coord = coord_word(tag, p_rank, region, np.asarray(blocks))
    out = np.empty((len(coord), len(cells), 2), dtype=np.uint64)
    out[:, :, 0] = coord[:, None]
    per_block = ((coord * _MIX) ^ np.uint64(_SALT)) & np.uint64(0xFFFFFFFF)
    np.bitwise_xor(per_block[:, None], ((cells << np.uint64(32)) | cells)[None, :], out=out[:, :, 1])
    return out.reshape(len(coord), -1).view(np.uint8)


@dataclass(frozen=True)
class Found:
    """What a cell actually held."""

    tag: int
    p_rank: int
    region: int
    block: int
    offset: int
    valid: bool

    def describe(self, geometry: Geometry | None = None) -> str:
        if not self.valid:
            return "untagged bytes (not a pattern cell: stale, zero or partial data)"
        reg = geometry.region_name(self.region) if geometry else f"region {self.region}"
        return f"P rank {self.p_rank} {reg} (region {self.region}) block {self.block} +{self.offset}"


def decode_cell(cell: np.ndarray) -> Found:
    w0, w1 = (int(x) for x in cell.view(np.uint64)[:2])
    offset = w1 >> 32
    valid = (w1 & 0xFFFFFFFF) == ((((w0 * int(_MIX)) & 0xFFFFFFFFFFFFFFFF) ^ offset ^ _SALT) & 0xFFFFFFFF)
    return Found(w0 >> 52, (w0 >> 44) & 0xFF, (w0 >> 32) & 0xFFF, w0 & 0xFFFFFFFF, offset, bool(valid))


class KVCache:
    """num_regions buffers of num_blocks * block_len bytes, registered with one NIXL agent."""

    def __init__(self, geometry: Geometry, num_blocks: int, device: str = "cpu", gpu_index: int = 0,
                 layout: str = "HND") -> None:
        self.geometry, self.num_blocks, self.device = geometry, num_blocks, device
        g = geometry
        self.view = BlockView.of(layout, g.local_kv_heads, g.block_size, g.head_cell_bytes, plain=not g.per_head_view)
        self.block_len = geometry.block_len
        self.region_bytes = num_blocks * self.block_len
        self._keep: list[Any] = []
        self.views: list[Any] = []
        self.base_addrs: list[int] = []
        self.blocks3: np.ndarray | None = None  # host: (regions, num_blocks, block_len) over every region
        # host: which (region, block) still hold tag_many's pattern for _tagged_by = (tag, P rank). Every D
        # release asks P to tag the same blocks again; those writes would change no byte.
        self._tagged: np.ndarray | None = None
        self._tagged_by: tuple[int, int] | None = None
        if device == "cpu":
            self.mem_type = "DRAM"
            # One mapping for all regions (each still registered as its own region, like vLLM's tensors):
            # tagging, clearing and checking every region is then one numpy operation, not a loop.
            mm, whole = host_memory(geometry.num_regions * self.region_bytes)
            self._keep.append(mm)
            self.blocks3 = whole[:geometry.num_regions * self.region_bytes].reshape(
                geometry.num_regions, num_blocks, self.block_len)
            for r in range(geometry.num_regions):
                arr = whole[r * self.region_bytes:(r + 1) * self.region_bytes]
                self.views.append(arr)
                self.base_addrs.append(arr.ctypes.data)
        else:
            import torch  # only here: the GPU path

            self.mem_type = "VRAM"
            dev = torch.device("cuda", gpu_index)
            for _ in range(geometry.num_regions):
                t = torch.empty(self.region_bytes, dtype=torch.uint8, device=dev)
                self.views.append(t)
                self.base_addrs.append(t.data_ptr())

    def regions(self, device_id: int) -> list[tuple[int, int, int]]:
        return [(a, self.region_bytes, device_id) for a in self.base_addrs]

    def _block_slice(self, region: int, block: int) -> slice:
        start = block * self.block_len
        return slice(start, start + self.block_len)

    def write_blocks(self, region: int, blocks: np.ndarray, data: np.ndarray) -> None:
        """data: (len(blocks), block_len) uint8."""
        view = self.views[region]
        if self.device == "cpu":
            view.reshape(self.num_blocks, self.block_len)[blocks] = data
            if self._tagged is not None:
                self._tagged[region, blocks] = False
            return
        import torch

        idx = torch.as_tensor(blocks, device=view.device, dtype=torch.long)
        view.view(self.num_blocks, self.block_len)[idx] = torch.from_numpy(np.ascontiguousarray(data)).to(view.device)

    def read_blocks(self, region: int, blocks: np.ndarray) -> np.ndarray:
        view = self.views[region]
        if self.device == "cpu":
            return view.reshape(self.num_blocks, self.block_len)[blocks]
        import torch

        idx = torch.as_tensor(blocks, device=view.device, dtype=torch.long)
        return view.view(self.num_blocks, self.block_len)[idx].cpu().numpy()

    def tag(self, tag: int, p_rank: int, region: int, blocks: np.ndarray) -> None:
        blocks = unique(blocks)
        if len(blocks):
            self.write_blocks(region, blocks, pattern(tag, p_rank, region, blocks, 0, self.block_len, self.view))

    def tag_many(self, tag: int, p_rank: int, blocks: dict[int, list[int]]) -> None:
        """Tag the given blocks of each region (regions outside this cache are skipped) in one pass."""
        pairs = [(r, unique(b)) for r, b in blocks.items()
                 if 0 <= r < self.geometry.num_regions and len(b)]
        if not pairs:
            return
        if self.blocks3 is None:  # GPU: one region at a time through torch
            for r, b in pairs:
                self.tag(tag, p_rank, r, b)
            return
        regs = np.concatenate([np.full(len(b), r, dtype=np.int64) for r, b in pairs])
        blks = np.concatenate([b for _r, b in pairs])
        if self._tagged is None or self._tagged_by != (tag, p_rank):
            self._tagged, self._tagged_by = np.zeros((self.geometry.num_regions, self.num_blocks), dtype=bool), (
                tag, p_rank)
        fresh = ~self._tagged[regs, blks]  # blocks already holding this pattern keep it
        regs, blks = regs[fresh], blks[fresh]
        step = max(1, CHUNK_BYTES // self.block_len)  # a pattern chunk at a time: it stays in cache
        for i in range(0, len(regs), step):
            r, b = regs[i:i + step], blks[i:i + step]
            self.blocks3[r, b] = pattern(tag, p_rank, r, b, 0, self.block_len, self.view)
        self._tagged[regs, blks] = True

    def clear_all(self, blocks: np.ndarray) -> None:
        """Zero the given blocks in every region."""
        blocks = unique(blocks)
        if self.blocks3 is not None:
            self.blocks3[:, blocks] = 0
            if self._tagged is not None:
                self._tagged[:, blocks] = False
            return
        for r in range(self.geometry.num_regions):
            self.clear(r, blocks)

    def read_all(self, blocks: np.ndarray, start: int, length: int, first: int = 0, last: int | None = None
                 ) -> np.ndarray:
        """Bytes [start, start+length) of the given blocks of every region (or of regions first..last-1):
        (regions, len(blocks), length)."""
        last = self.geometry.num_regions if last is None else last
        if self.blocks3 is not None:
            return self.blocks3[first:last, blocks, start:start + length]
        return np.stack([self.read_blocks(r, blocks)[:, start:start + length] for r in range(first, last)])

    def clear(self, region: int, blocks: np.ndarray) -> None:
        blocks = unique(blocks)
        if len(blocks):
            self.write_blocks(region, blocks, np.zeros((len(blocks), self.block_len), dtype=np.uint8))
