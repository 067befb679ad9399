"""The vectorised coordinate pattern and KV-cache operations agree with the region-by-region ones."""

from __future__ import annotations

import numpy as np

from pdcheck.geometry import Geometry
from pdcheck.kvcache import KVCache, check_blocks, check_range, desc_ids, unique
from pdcheck.pattern import BlockView, coord_word, decode_cell, offset_word, pattern


def _kv(layout: str = "NHD") -> KVCache:
    g = Geometry(tp_size=2, block_size=4, layers=3, total_kv_heads=4, head_dim=8, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False)
    return KVCache(g, 10, layout=layout)


def test_pattern_with_one_region_per_block_equals_region_by_region() -> None:
    kv = _kv()
    blocks = np.array([3, 1, 7])
    regions = np.array([0, 4, 5])
    whole = pattern(9, 1, regions, blocks, 0, kv.block_len, kv.view)
    for i, (r, b) in enumerate(zip(regions, blocks, strict=True)):
        assert (whole[i] == pattern(9, 1, int(r), np.array([b]), 0, kv.block_len, kv.view)[0]).all()


def test_tag_many_clear_all_read_all() -> None:
    kv = _kv()
    kv.tag_many(9, 1, {0: [2, 5], 3: [5], 99: [1]})  # region 99 is not in this cache: skipped
    got = kv.read_all(np.array([2, 5]), 0, kv.block_len)
    assert got.shape == (kv.geometry.num_regions, 2, kv.block_len)
    assert (got[0] == pattern(9, 1, 0, np.array([2, 5]), 0, kv.block_len, kv.view)).all()
    assert (got[3, 1] == pattern(9, 1, 3, np.array([5]), 0, kv.block_len, kv.view)[0]).all()
    assert not got[3, 0].any() and not got[1].any()
    found = decode_cell(kv.views[3][5 * kv.block_len:5 * kv.block_len + 16])
    assert found.valid and (found.region, found.block, found.p_rank) == (3, 5, 1)
    kv.clear_all(np.array([5]))
    assert not kv.read_all(np.array([5]), 0, kv.block_len).any()
    assert kv.read_all(np.array([2]), 0, kv.block_len)[0].any()


def test_tag_many_again_restores_what_was_overwritten_and_keeps_the_rest() -> None:
    """tag_many skips blocks still holding its pattern; every write through the cache re-arms them."""
    kv = _kv()
    want = {r: pattern(9, 1, r, np.array([2, 5]), 0, kv.block_len, kv.view) for r in (0, 3)}
    kv.tag_many(9, 1, {0: [2, 5], 3: [2, 5]})
    kv.write_blocks(0, np.array([5]), np.full((1, kv.block_len), 0x5A, np.uint8))  # corrupt:P1:0:5
    kv.clear_all(np.array([2]))
    kv.tag_many(9, 1, {0: [2, 5], 3: [2, 5]})
    for r in (0, 3):
        assert (kv.read_all(np.array([2, 5]), 0, kv.block_len, r, r + 1)[0] == want[r]).all()
    kv.tag_many(7, 1, {0: [2]})  # another tag: written, whatever the first one marked
    assert (kv.read_all(np.array([2]), 0, kv.block_len, 0, 1)[0, 0] == pattern(7, 1, 0, np.array([2]), 0,
                                                                              kv.block_len, kv.view)[0]).all()


def test_read_all_region_range_is_a_slice_of_every_region() -> None:
    kv = _kv()
    kv.tag_many(9, 1, {r: [1, 4] for r in range(kv.geometry.num_regions)})
    every = kv.read_all(np.array([4, 1]), 8, 32)
    assert (kv.read_all(np.array([4, 1]), 8, 32, 2, 5) == every[2:5]).all()


def test_pattern_words_are_coord_word_and_offset_word() -> None:
    """pattern() computes the offset word in one XOR: it must equal offset_word's formula cell by cell."""
    view = BlockView.of("NHD", 8, 16, 256)  # tokens-first: logical offsets differ from byte offsets
    blocks, regions = np.array([0, 7, 99_999, 123_456]), np.array([4095, 0, 17, 3])
    start, length = 4096, 65536
    got = pattern(0xABC, 255, regions, blocks, start, length, view).view(np.uint64).reshape(len(blocks), -1, 2)
    cells = view.logical(np.arange(start // 16, (start + length) // 16, dtype=np.uint64) * np.uint64(16))
    coord = coord_word(0xABC, 255, regions, blocks)[:, None]
    assert (got[:, :, 0] == coord).all()
    assert (got[:, :, 1] == offset_word(coord, cells[None, :])).all()


def test_unique_is_np_unique_of_block_ids() -> None:
    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 7, 300):
        ids = rng.integers(0, 40, n)
        assert unique(ids).tolist() == np.unique(ids).tolist()
        assert unique(ids.tolist()).dtype == np.int64


def test_desc_ids_index_block_descs_rows() -> None:
    kv = _kv()
    descs = kv.descs(kv.block_len, 0)
    ids = desc_ids(kv.geometry.num_regions, kv.num_blocks, [7, 2])
    assert ids.tolist() == [r * 10 + b for r in range(kv.geometry.num_regions) for b in (7, 2)]
    assert (descs[ids, 0] == [kv.base_addrs[r] + b * kv.block_len for r in range(kv.geometry.num_regions)
                              for b in (7, 2)]).all()


def test_check_blocks_counts_wrong_blocks_and_names_what_arrived() -> None:
    # D holds P blocks 4 and 6 in its blocks 1 and 3; in region 5 (layer 2 V) P block 6 arrived in both.
    p, d = _kv(), _kv()
    p.fill(9, 1)
    d.blocks3[:, [1, 3]] = p.blocks3[:, [4, 6]]
    chk = check_blocks(d, [1, 3], [4, 6], 9, 1, read_len=d.block_len, view=d.view)
    assert (chk.checked, chk.wrong, chk.first) == (12, 0, None)
    d.blocks3[5, 1] = p.blocks3[5, 6]
    chk = check_blocks(d, [1, 3], [4, 6], 9, 1, read_len=d.block_len, view=d.view)
    assert (chk.wrong, chk.wrong_regions) == (1, {5})
    w = chk.first
    assert w is not None and (w.region, w.local_block, w.remote_block, w.byte, w.at) == (5, 1, 4, 0, 0)
    assert w.found.describe(d.geometry) == "P rank 1 layer 2 V (region 5) block 6 +0"
    # K and V halves read separately (blocks-first releases): the second half of each local block is checked
    # against the second half of the P block; a slice of each half (offset, length) works the same way.
    half = d.block_len // 2
    d.blocks3[5, 1] = p.blocks3[5, 4]
    chk = check_blocks(d, [1, 3], [4, 6], 9, 1, read_len=half - 16, local_offset=16, remote_offset=16, halves=2,
                       remote_half=half, view=d.view)
    assert (chk.checked, chk.wrong) == (12, 0)


def test_check_range_counts_wrong_words_of_a_contiguous_read() -> None:
    p = _kv("HND")  # transfer-bench's caches: heads first, where byte offset = logical offset
    p.fill(9, 1)
    start = 3 * p.block_len + 64  # mid-block, across block and region boundaries
    got = p.arena.arr[start:start + 25 * p.block_len].copy()
    assert check_range(got, 9, 1, p.geometry, p.num_blocks, start) == 0
    got[8 * p.block_len + 3] ^= 1
    assert check_range(got, 9, 1, p.geometry, p.num_blocks, start) == 1



def _fast_and_general(d: KVCache, remote: np.ndarray, gens: list[int], span: tuple[int, int] | None = None
                      ) -> tuple[tuple, tuple]:
    """check_blocks of D's blocks 3..6 as a run (the in-place fast path) and listed out of order (the general
    path, expected bytes built and compared)."""
    order = [2, 0, 3, 1]
    fast = check_blocks(d, np.arange(3, 7), remote, 9, 1, read_len=d.block_len, view=d.view, gens=gens,
                        region_span=span)
    slow = check_blocks(d, np.arange(3, 7)[order], remote[order], 9, 1, read_len=d.block_len, view=d.view,
                        gens=[gens[i] for i in order], region_span=span)
    return ((fast.checked, fast.wrong, fast.bytes, fast.wrong_regions),
            (slow.checked, slow.wrong, slow.bytes, slow.wrong_regions))


def test_check_blocks_on_a_run_of_blocks_agrees_with_the_general_check() -> None:
    # Both paths must say the same, with generations, in both layouts, for clean blocks and for damage.
    rng = np.random.default_rng(7)
    for layout in ("NHD", "HND"):
        p, d = _kv(layout), _kv(layout)
        remote, gens = np.array([6, 2, 9, 4]), [3, 1, 2, 255]
        regions = p.geometry.num_regions
        reg, blk = np.repeat(np.arange(regions), 4), np.tile(remote, regions)
        p.blocks3[reg, blk] = pattern(9, 1, reg, blk, 0, p.block_len, p.view, np.tile(gens, regions))
        d.blocks3[:, 3:7] = p.blocks3[:, remote]
        fast, slow = _fast_and_general(d, remote, gens)
        assert fast == slow == (regions * 4, 0, regions * 4 * d.block_len, set())
        fast, slow = _fast_and_general(d, remote, [3, 1, 7, 255])  # one block of another generation
        assert fast == slow and fast[1] == regions
        assert _fast_and_general(d, remote, gens, (1, 3))[0] == (8, 0, 8 * d.block_len, set())
        for _ in range(5):
            r, b, byte = int(rng.integers(regions)), int(rng.integers(3, 7)), int(rng.integers(d.block_len))
            d.blocks3[r, b, byte] ^= 0x10
            fast, slow = _fast_and_general(d, remote, gens)
            assert fast == slow and fast[1] == 1 and fast[3] == {r}
            d.blocks3[r, b, byte] ^= 0x10
        assert _fast_and_general(d, remote, gens)[0][1] == 0
