"""The vectorised coordinate pattern and KV-cache operations agree with the region-by-region ones."""

from __future__ import annotations

import numpy as np

from pdcheck.geometry import Geometry
from pdcheck.kvcache import KVCache, decode_cell, pattern


def _kv() -> KVCache:
    g = Geometry(tp_size=2, block_size=4, layers=3, total_kv_heads=4, head_dim=8, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False)
    return KVCache(g, 10, layout="NHD")


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
