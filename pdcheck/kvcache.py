"""KV-cache memory and layout for every rank, handshake and transfer-bench alike, and the check by coordinate.

An Arena is the memory a rank registers: on the host one private anonymous NORESERVE mapping (nothing is
faulted in until a block is tagged or written, so the seed's ~0.9 GB per rank costs only the pages touched),
on --device cuda one torch tensor (torch is imported only on that path: ~2.7 s and 650 MB per process).
A KVCache lays vLLM's regions over an arena back to back; block_descs turns any cache into NIXL dlists.

The coordinate pattern blocks are tagged with and checked against is pdcheck/pattern.py; check_blocks here
reads a cache's blocks back against it.
"""

from __future__ import annotations

import functools
import mmap
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdcheck.geometry import Geometry
from pdcheck.pattern import (
    CELL,
    PLAIN,
    BlockView,
    Found,
    _cells,
    _check_keys,
    coord_word,
    decode_cell,
    pattern,
    write_pattern,
)

CHUNK_BYTES = 1 << 20  # pattern work in pieces this big: a proof's whole pattern (tens of MB) would leave the cache


_MMAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value




def host_memory(nbytes: int, *, hugepages: bool = False) -> tuple[mmap.mmap, np.ndarray]:
    """Private anonymous host memory, the one allocation behind every KV cache.

    Private, not mmap's default shared mapping: shared anonymous memory is shmem, which gets no THP.
    NORESERVE: only touched pages cost. hugepages: ask for transparent huge pages (transfer-bench's arenas)."""
    mm = mmap.mmap(-1, max(1, nbytes), flags=_MMAP_FLAGS)
    if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled: plain pages, the same for every measured row
    return mm, np.frombuffer(mm, dtype=np.uint8)


class Arena:
    """The memory one rank registers with NIXL: host (anonymous mmap) or GPU (one torch tensor).

    A handshake rank sizes it to its KV cache; a transfer-bench rank sizes it to its largest row and lays
    each row's KV cache over it (KVCache(..., arena=)), so NIXL registration and page faults happen once.
    torch is imported only on the GPU path (it costs ~2 s and 650 MB per process)."""

    def __init__(self, nbytes: int, device: str = "cpu", gpu_index: int = 0, *, hugepages: bool = False,
                 touch: bool = False) -> None:
        self.nbytes, self.device = nbytes, device
        self.arr: np.ndarray | None = None  # host: uint8 over the whole arena
        self.tensor: Any = None  # GPU: uint8 tensor over the whole arena
        if device == "cpu":
            self.mem_type, self.dev = "DRAM", 0
            self._map, self.arr = host_memory(nbytes, hugepages=hugepages)
            if touch:
                # A first READ of untouched memory maps the shared zero page; the copy-on-write faults that
                # follow (maybe onto 4 KiB pages) would land inside measured loops.
                self.arr[:] = 0
            self.addr = self.arr.ctypes.data
        else:
            import torch  # only here: the GPU path

            count = torch.cuda.device_count()
            if count == 0:
                raise RuntimeError("--device cuda: torch sees no CUDA device")
            self.mem_type, self.dev = "VRAM", gpu_index % count  # more ranks than GPUs: round-robin
            torch.cuda.set_device(self.dev)
            self.tensor = torch.empty(max(1, nbytes), dtype=torch.uint8, device=f"cuda:{self.dev}")
            self.addr = int(self.tensor.data_ptr())

    def span(self, start: int, nbytes: int) -> Any:
        """Bytes [start, start + nbytes): a numpy view (host) or a tensor view (GPU)."""
        whole = self.arr if self.arr is not None else self.tensor
        return whole[start:start + nbytes]

    def host_bytes(self, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) as host numpy (a view on the host, a copy from the GPU)."""
        if self.arr is not None:
            return self.arr[start:start + nbytes]
        return self.tensor[start:start + nbytes].cpu().numpy()

    def zero(self, nbytes: int) -> None:
        if self.arr is not None:
            self.arr[:nbytes] = 0
        else:
            self.tensor[:nbytes].zero_()
            self.sync()

    def flip(self, byte_index: int) -> None:
        """Invert one byte (transfer-bench's self-test of the check)."""
        if self.arr is not None:
            self.arr[byte_index] ^= 0xFF
        else:
            self.tensor[byte_index:byte_index + 1].bitwise_xor_(0xFF)
            self.sync()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """One-thread copy inside the arena: transfer-bench's memcpy ceiling."""
        if self.arr is not None:
            np.copyto(self.arr[dst:dst + nbytes], self.arr[src:src + nbytes])
        else:
            self.tensor[dst:dst + nbytes].copy_(self.tensor[src:src + nbytes])

    def sync(self) -> None:
        if self.tensor is not None:
            import torch

            torch.cuda.synchronize(self.dev)

    def registration(self) -> list[tuple[int, int, int]]:
        """The whole arena as one NIXL region (addr, bytes, device id)."""
        return [(self.addr, self.nbytes, self.dev)]


def region_addrs(base: int, geometry: Geometry, num_blocks: int) -> list[int]:
    """Where each region of a KV cache laid over memory at `base` starts (KVCache's layout: regions back to
    back). A transfer-bench D rank computes its P peer's regions from the peer's arena address with it."""
    region_bytes = num_blocks * geometry.row_len
    return [base + r * region_bytes for r in range(geometry.num_regions)]


def block_descs(base_addrs: list[int], num_blocks: int, block_len: int, read_len: int, dev: int, *,
                offset: int = 0, halves: int = 1, stride: int = 0) -> np.ndarray:
    """Nx3 (addr, len, devId) for every block of every region in descriptor-id order (region-major, then K
    and V halves where a release reads a block as two, then block): what local and remote dlists are built
    from. offset: where in each block (or half) the read starts, e.g. a D rank's head slice of a P block.
    stride: bytes from one block's start to the next (0: block_len, blocks abut; larger: padded rows, of which
    only the page is read, as vLLM 0.30+ reads block_strides)."""
    blocks = np.arange(num_blocks, dtype=np.uint64) * np.uint64(stride or block_len)
    half = block_len // halves
    addrs = np.concatenate([np.uint64(a + offset + h * half) + blocks for a in base_addrs for h in range(halves)])
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = read_len
    out[:, 2] = dev
    return out


def desc_ids(regions: int, stride: int, blocks: np.ndarray | list[int], first: int = 0) -> np.ndarray:
    """vLLM's descriptor ids of the given blocks in every region, region-major: region * stride + block_id
    (int64). stride: the dlist's blocks per region, a release's recorded count or the cache's own. The ids
    index block_descs' rows (halves=2: each K or V half counts as a region). first: start at that region (one
    KV-cache group of a hybrid model: regions first .. first + regions - 1)."""
    b = np.asarray(blocks, dtype=np.int64).reshape(-1)
    return (np.arange(first, first + regions, dtype=np.int64)[:, None] * stride + b[None, :]).reshape(-1)


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


class KVCache:
    """num_regions regions of num_blocks * row_len bytes, contiguous in one Arena, each registered with NIXL
    as its own region (as vLLM registers one tensor per layer and K/V). A row is one block (block_len bytes)
    unless the geometry pads it (block_stride: a compressed MLA cache's storage row, vLLM's dense virtual
    pages); the padding is tagged like the page, so a reader that walks the rows at the wrong stride receives
    named, wrong bytes. Contiguous: tagging, clearing and
    checking every region is one numpy operation, not a loop. arena: lay the cache over memory that is
    already allocated and registered (transfer-bench, one cache per row); otherwise it gets its own."""

    def __init__(self, geometry: Geometry, num_blocks: int, device: str = "cpu", gpu_index: int = 0,
                 layout: str = "HND", arena: Arena | None = None) -> None:
        self.geometry, self.num_blocks = geometry, num_blocks
        g = geometry
        self.view = BlockView.of(layout, g.local_kv_heads, g.block_size, g.head_cell_bytes, plain=not g.per_head_view)
        self.block_len = geometry.block_len  # the page a transfer reads
        self.row_len = geometry.row_len  # the memory one block takes (block_len unless padded)
        self.region_bytes = num_blocks * self.row_len
        nbytes = geometry.num_regions * self.region_bytes
        if arena is None:
            arena = Arena(nbytes, device, gpu_index)
        elif arena.nbytes < nbytes:
            raise ValueError(f"KV cache of {nbytes} bytes does not fit its {arena.nbytes}-byte arena")
        self.arena = arena
        self.device, self.mem_type = arena.device, arena.mem_type
        self.views: list[Any] = [arena.span(r * self.region_bytes, self.region_bytes)
                                 for r in range(geometry.num_regions)]
        self.base_addrs = region_addrs(arena.addr, geometry, num_blocks)
        # host: (regions, num_blocks, row_len) over every region
        self.blocks3: np.ndarray | None = None if arena.arr is None else arena.arr[:nbytes].reshape(
            geometry.num_regions, num_blocks, self.row_len)
        # host: which (region, block) still hold tag_many's pattern for _tagged_by = (tag, P rank). Every D
        # release asks P to tag the same blocks again; those writes would change no byte.
        self._tagged: np.ndarray | None = None
        self._tagged_by: tuple[int, int] | None = None

    def regions(self, device_id: int) -> list[tuple[int, int, int]]:
        return [(a, self.region_bytes, device_id) for a in self.base_addrs]

    def descs(self, read_len: int, device_id: int, *, offset: int = 0, halves: int = 1) -> np.ndarray:
        """This cache's dlist: every block of every region (kvcache.block_descs)."""
        return block_descs(self.base_addrs, self.num_blocks, self.block_len, read_len, device_id, offset=offset,
                           halves=halves, stride=self.row_len)

    def fill(self, tag: int, p_rank: int, chunk_bytes: int = 1 << 20) -> None:
        """Tag every block of every region, at memory speed: in place, a cache-sized chunk at a time, so the
        coordinate store and the check XOR meet the same lines in cache."""
        g = self.geometry
        rows = max(1, chunk_bytes // self.row_len)
        for region in range(g.num_regions):
            for lo in range(0, self.num_blocks, rows):
                blocks = np.arange(lo, min(lo + rows, self.num_blocks))
                if self.blocks3 is not None:
                    write_pattern(self.blocks3[region, lo:lo + len(blocks)], tag, p_rank, region, blocks, 0, self.view)
                else:
                    self.write_blocks(region, blocks, pattern(tag, p_rank, region, blocks, 0, self.row_len,
                                                              self.view))
        self._tagged, self._tagged_by = None, None  # tag_many's marks know nothing of this fill

    def write_blocks(self, region: int, blocks: np.ndarray, data: np.ndarray) -> None:
        """data: (len(blocks), n) uint8, the first n bytes of each block's row (n: block_len or row_len)."""
        view = self.views[region]
        n = data.shape[1]
        if self.device == "cpu":
            view.reshape(self.num_blocks, self.row_len)[blocks, :n] = data
            if self._tagged is not None:
                self._tagged[region, blocks] = False
            return
        import torch

        idx = torch.as_tensor(blocks, device=view.device, dtype=torch.long)
        view.view(self.num_blocks, self.row_len)[idx, :n] = torch.from_numpy(np.ascontiguousarray(data)).to(view.device)

    def read_blocks(self, region: int, blocks: np.ndarray) -> np.ndarray:
        view = self.views[region]
        if self.device == "cpu":
            return view.reshape(self.num_blocks, self.row_len)[blocks]
        import torch

        idx = torch.as_tensor(blocks, device=view.device, dtype=torch.long)
        return view.view(self.num_blocks, self.row_len)[idx].cpu().numpy()

    def tag(self, tag: int, p_rank: int, region: int, blocks: np.ndarray) -> None:
        blocks = unique(blocks)
        if len(blocks):
            self.write_blocks(region, blocks, pattern(tag, p_rank, region, blocks, 0, self.row_len, self.view))

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
        step = max(1, CHUNK_BYTES // self.row_len)  # a pattern chunk at a time: it stays in cache
        for i in range(0, len(regs), step):
            r, b = regs[i:i + step], blks[i:i + step]
            self.blocks3[r, b] = pattern(tag, p_rank, r, b, 0, self.row_len, self.view)
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
            self.write_blocks(region, blocks, np.zeros((len(blocks), self.row_len), dtype=np.uint8))


@dataclass
class Wrong:
    """The first wrong block a check found: where, and what arrived instead."""

    region: int
    local_block: int
    remote_block: int
    byte: int  # first wrong byte in the bytes read into the local block
    at: int  # byte offset in the P block of that byte's cell
    found: Found


@dataclass
class BlockCheck:
    """What a check of transferred blocks found; one check may add up several calls (requests, P ranks)."""

    checked: int = 0  # blocks compared (regions x blocks)
    wrong: int = 0  # blocks with at least one wrong byte
    bytes: int = 0
    wrong_regions: set[int] = field(default_factory=set)
    first: Wrong | None = None


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


def _all_right(kv: KVCache, local: np.ndarray, remote: np.ndarray, tag: int, p_rank: int, n: int, view: BlockView,
               gens: np.ndarray | list[int] | None, r0: int, regions: int) -> bool:
    """check_blocks' fast path, for the common case (host memory, whole blocks read into a run of local blocks):
    True when every cell holds exactly what write_pattern writes there. It compares the cache in place, word by
    word, against the coordinate and check words, without building the expected bytes or copying the blocks
    read (two allocations the size of the read and their page faults, most of a small check's cost). False:
    not applicable, or something is wrong, and check_blocks' general path finds what and where."""
    k = len(local)
    if kv.blocks3 is None or not k or n % CELL or n > kv.row_len or local[-1] - local[0] != k - 1 \
            or not (np.diff(local) == 1).all():
        return False
    lo = int(local[0])
    got = kv.blocks3[r0:regions, lo:lo + k, :n].view(np.uint64).reshape(regions - r0, k, n // CELL, 2)
    reg = np.arange(r0, regions, dtype=np.int64)[:, None]
    gen = 0 if gens is None else np.asarray(gens, dtype=np.int64)[None, :]
    coord = coord_word(tag, p_rank, reg, remote[None, :], gen)
    if (got[..., 0] != coord[..., None]).any():
        return False
    checks = np.bitwise_xor(got[..., 1], _offset_words(view, n)[None, None, :])
    return not (checks != _check_keys(coord)[..., None]).any()


@functools.lru_cache(maxsize=16)
def _offset_words(view: BlockView, length: int) -> np.ndarray:
    """_cells(view, 0, length), kept: the same few (view, length) pairs serve every check of a run."""
    words = _cells(view, 0, length)
    words.flags.writeable = False  # shared by every caller
    return words


def check_blocks(kv: KVCache, local_ids: np.ndarray | list[int], remote_ids: np.ndarray | list[int], tag: int,
                 p_rank: int, *, read_len: int, local_offset: int = 0, remote_offset: int = 0, halves: int = 1,
                 remote_half: int = 0, view: BlockView = PLAIN, out: BlockCheck | None = None,
                 gens: np.ndarray | list[int] | None = None, region_span: tuple[int, int] | None = None
                 ) -> BlockCheck:
    """The one block check of the transfer proof and transfer-bench: local block local_ids[i] of every region
    must hold bytes [remote_offset, remote_offset + read_len) of P rank p_rank's block remote_ids[i] of the same
    region (coordinate pattern `tag`, laid out by `view`). halves=2: K and V halves are read separately, the
    local half `kv.block_len // 2` holding its slice of the P half at remote_half. gens: the generation each
    remote block must hold (the request path; None: 0, every other command). region_span: check regions
    [first, last) only (one KV-cache group of a hybrid model, read with its own blocks)."""
    out = out or BlockCheck()
    remote = np.asarray(remote_ids, dtype=np.int64)
    local = np.asarray(local_ids, dtype=np.int64)
    r0, regions = region_span or (0, kv.geometry.num_regions)
    k, n = len(local), read_len
    if halves == 1 and not local_offset and not remote_offset and _all_right(kv, local, remote, tag, p_rank, n,
                                                                            view, gens, r0, regions):
        out.checked += (regions - r0) * k
        out.bytes += (regions - r0) * k * n
        return out
    local_half = kv.block_len // halves

    def got_exp(first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """Read and expected bytes of regions first..last-1: (regions, blocks, bytes read per block). Each half
        (K, then V when split) of the local block holds its slice of the same half of the P block."""
        got = _join([kv.read_all(local, h * local_half + local_offset, n, first, last) for h in range(halves)], 2)
        reg = np.repeat(np.arange(first, last, dtype=np.int64), k)
        blk = np.tile(remote, last - first)
        gen = 0 if gens is None else np.tile(np.asarray(gens, dtype=np.int64), last - first)
        exp = _join([pattern(tag, p_rank, reg, blk, remote_offset + h * remote_half, n, view, gen)
                     for h in range(halves)], 1).reshape(got.shape)
        return got, exp

    # A few regions per pass (CHUNK_BYTES): the pattern and the bytes read stay in cache.
    step = max(1, CHUNK_BYTES // max(1, k * n * halves))
    bad = np.zeros((regions - r0, k), dtype=bool)
    for first in range(r0, regions, step):
        last = min(regions, first + step)
        bad[first - r0:last - r0] = _rows_differ(*got_exp(first, last))
    out.checked += (regions - r0) * k
    out.bytes += (regions - r0) * k * n * halves
    out.wrong += int(bad.sum())
    if not bad.any():
        return out
    out.wrong_regions.update(r0 + int(r) for r in np.flatnonzero(bad.any(axis=1)))
    if out.first is None:
        region, i = (int(x) for x in np.argwhere(bad)[0])  # region-major, like reading region by region
        region += r0
        got, exp = got_exp(region, region + 1)
        byte = int(np.flatnonzero(got[0, i] != exp[0, i])[0])
        cell = byte // CELL * CELL
        out.first = Wrong(region, int(local[i]), int(remote[i]), byte,
                          remote_offset + (cell // n) * remote_half + cell % n, decode_cell(got[0, i][cell:cell + CELL]))
    return out


def check_range(got: np.ndarray, tag: int, p_rank: int, geometry: Geometry, num_blocks: int, start: int,
                chunk_bytes: int = 8 << 20) -> int:
    """Wrong 8-byte words in `got`, which must hold bytes [start, start + len(got)) of P rank p_rank's whole
    KV cache of num_blocks blocks per region (regions back to back, as KVCache lays them; pattern `tag` with
    byte offset = logical offset, i.e. heads-first blocks, as transfer-bench lays them):
    transfer-bench's one-descriptor wire ceiling. Chunked: a 128 MiB READ must not allocate gigabytes."""
    bp = geometry.block_len
    wrong = 0
    step = max(1, chunk_bytes // bp)
    first, last = start // bp, -(-(start + got.size) // bp)
    for lo in range(first, last, step):
        rows = np.arange(lo, min(lo + step, last))  # rows of the cache: descriptor ids region * num_blocks + block
        exp = pattern(tag, p_rank, rows // num_blocks, rows % num_blocks, 0, bp).reshape(-1)
        a, b = max(start, lo * bp), min(start + got.size, (lo + len(rows)) * bp)
        part = got[a - start:b - start].view(np.uint64)
        wrong += int((part != exp[a - lo * bp:b - lo * bp].view(np.uint64)).sum())
    return wrong
