"""The coordinate pattern every transfer proof checks by: each 16-byte cell of a P block names its logical
coordinate (engine tag, P rank, region, block id and generation, byte offset), so a cell that arrived in the wrong
place names the block it came from (Found). Block views map a cache's physical layout to those coordinates (a
heads-first slice of a P block under heterogeneous TP).

Pattern: every 16-byte cell of a P block holds (coordinate word, offset word). The coordinate word packs
engine tag, P rank, region, the block's generation and block id; the offset word packs the byte offset and a
check value. A D rank can therefore say not only that a block is wrong but which block it received instead, and
(`pdcheck requests`) which allocation of that block: generation 0 is every other command's pattern (byte for
byte the pattern before generations existed), 1..255 count a request path's allocations of the block.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from pdcheck.geometry import Geometry

CELL = 16
_M32 = np.uint64(0xFFFFFFFF)


_MIX = np.uint64(0x9E3779B97F4A7C15)


_SALT = 0xA5C3_5A3C  # so that zeroed (stale, never-written) memory never passes the check


def engine_tag(engine_id: str) -> int:
    return zlib.crc32(engine_id.encode()) & 0xFFF


GEN_SHIFT = np.uint64(24)  # block ids stay below bounds.MAX_NUM_BLOCKS = 2**24; bits 24..31 hold the generation


def coord_word(tag: int, p_rank: int, region: int | np.ndarray, block: np.ndarray,
               gen: int | np.ndarray = 0) -> np.ndarray:
    """region: one region, or one per block (broadcast with block); gen: one generation, or one per block."""
    reg = np.asarray(region).astype(np.uint64) & np.uint64(0xFFF)
    word = (np.uint64(tag) << np.uint64(52)) | (np.uint64(p_rank & 0xFF) << np.uint64(44)) | (
        reg << np.uint64(32)) | np.asarray(block).astype(np.uint64)
    if np.any(np.asarray(gen)):
        word = word | ((np.asarray(gen).astype(np.uint64) & np.uint64(0xFF)) << GEN_SHIFT)
    return word


def offset_word(coord: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The offset word of a cell, in its defining form: (offset << 32) | low32(coord * MIX ^ offset ^ SALT).
    write_pattern computes the same bits as one XOR of a per-block and a per-cell term; decode_cell checks
    a cell against this form."""
    off = np.asarray(offsets).astype(np.uint64)
    check = ((np.asarray(coord).astype(np.uint64) * _MIX) ^ off ^ np.uint64(_SALT)) & _M32
    return (off << np.uint64(32)) | check


def _check_keys(coord: np.ndarray) -> np.ndarray:
    """The per-block half of the offset word's check value (the per-cell half is the offset itself)."""
    return ((coord * _MIX) & _M32) ^ np.uint64(_SALT)


def _cell_words(logical: np.ndarray) -> np.ndarray:
    """Offset words before the per-block check key is XORed in: offset in the high half, offset in the low."""
    off = logical.astype(np.uint64)
    return (off << np.uint64(32)) | (off & _M32)


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


@dataclass(frozen=True)
class SliceView(BlockView):
    """What a D rank with token-major (NHD) blocks of `heads` heads must find in the bytes it read at P's head
    `first`: the logical offset of each of its (head, token) cells. Its attention reads byte x of its block as
    token x // (heads * head_bytes), head first + (x // head_bytes) % heads; a byte range of a P block that is a
    head slice only when heads come first holds other heads or tokens otherwise (vLLM #46204)."""

    first: int = 0

    def logical(self, offsets: np.ndarray) -> np.ndarray:
        hb, bs = np.uint64(self.head_bytes), np.uint64(self.block_size)
        x = offsets - np.uint64(self.first) * bs * hb  # offsets start at the slice (start = its byte offset)
        token = x // (hb * np.uint64(self.heads))
        head = (x // hb) % np.uint64(self.heads) + np.uint64(self.first)
        return (head * bs + token) * hb + x % hb


def head_token(geometry: Geometry, logical: int) -> tuple[int, int]:
    """(head within its P rank's block, token) of a logical (heads-first) byte offset."""
    hb = geometry.head_cell_bytes
    return logical // (geometry.block_size * hb), (logical // hb) % geometry.block_size


PLAIN = BlockView()


def _cells(view: BlockView, start: int, length: int) -> np.ndarray:
    return _cell_words(view.logical(np.arange(start // CELL, (start + length) // CELL, dtype=np.uint64)
                                    * np.uint64(CELL)))


def write_pattern(dst: np.ndarray, tag: int, p_rank: int, region: int | np.ndarray, blocks: np.ndarray,
                  start: int = 0, view: BlockView = PLAIN, gen: int | np.ndarray = 0) -> None:
    """Write the expected bytes [start, start + length) of each block into dst, (len(blocks), length) uint8
    with contiguous rows, in place: a broadcast store and a broadcast XOR, no temporaries the size of dst.
    Each 16-byte cell holds the coordinate word and the offset word, offset | check, where
    check = low32(coord * MIX) ^ offset ^ SALT splits into a per-block key and a per-cell term."""
    coord = coord_word(tag, p_rank, region, np.asarray(blocks), gen)
    cells = dst.view(np.uint64).reshape(len(coord), -1, 2)
    cells[:, :, 0] = coord[:, None]
    np.bitwise_xor(_cells(view, start, dst.shape[1])[None, :], _check_keys(coord)[:, None], out=cells[:, :, 1])


def pattern(tag: int, p_rank: int, region: int | np.ndarray, blocks: np.ndarray, start: int, length: int,
            view: BlockView = PLAIN, gen: int | np.ndarray = 0) -> np.ndarray:
    """Expected bytes [start, start+length) of each given block: shape (len(blocks), length) uint8.
    region: one region for all blocks, or one per block (a whole proof in one vectorised pass)."""
    out = np.empty((len(np.asarray(blocks)), length), dtype=np.uint8)
    write_pattern(out, tag, p_rank, region, blocks, start, view, gen)
    return out


@dataclass(frozen=True)
class Found:
    """What a cell actually held."""

    tag: int
    p_rank: int
    region: int
    block: int
    offset: int
    valid: bool
    gen: int = 0  # the block's allocation (request path); 0 elsewhere

    def describe(self, geometry: Geometry | None = None) -> str:
        if not self.valid:
            return "untagged bytes (not a pattern cell: stale, zero or partial data)"
        reg = geometry.region_name(self.region) if geometry else f"region {self.region}"
        gen = f" generation {self.gen}" if self.gen else ""
        return f"P rank {self.p_rank} {reg} (region {self.region}) block {self.block}{gen} +{self.offset}"


def decode_cell(cell: np.ndarray) -> Found:
    w0, w1 = (int(x) for x in cell.view(np.uint64)[:2])
    offset = w1 >> 32
    valid = w1 == int(offset_word(np.uint64(w0), np.uint64(offset)))
    return Found(w0 >> 52, (w0 >> 44) & 0xFF, (w0 >> 32) & 0xFFF, w0 & 0xFFFFFF, offset, bool(valid),
                 (w0 >> 24) & 0xFF)
