"""A fill pattern keyed by logical coordinate, and the per-block check that counts #wrong.

Every 8-byte word holds key(seed, region, prefill block id) + global_word * C, where global_word counts
words inside the logical block across all heads. A swapped, shifted, truncated, stale or duplicated
block therefore never matches; a constant fill (nixlbench, kvbench) would miss all of those.
Filling is one broadcast add over the pool, at memory speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_C = np.uint64(0x9E3779B97F4A7C15)  # odd, so word index -> value is a bijection mod 2**64


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (numpy wraps uint64 arithmetic silently on arrays)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def block_keys(seed: int, regions: int, num_blocks: int) -> np.ndarray:
    """(regions, num_blocks) uint64 keys, one per logical (layer, K/V, prefill block id)."""
    r = np.arange(regions, dtype=np.uint64)[:, None]
    b = np.arange(num_blocks, dtype=np.uint64)[None, :]
    s = np.uint64((seed * int(_C)) & (2**64 - 1))  # in Python ints: numpy warns on scalar overflow
    z = s + r * np.uint64(0xD1B54A32D192ED03) + b * np.uint64(0x8CB92BA72F3D8DD7)
    return _mix(z)


def word_values(word_offset: int, words: int) -> np.ndarray:
    return (np.arange(words, dtype=np.uint64) + np.uint64(word_offset)) * _C


def fill(pool_words: np.ndarray, keys: np.ndarray, word_offset: int) -> None:
    """pool_words: (regions, num_blocks, words_per_block) uint64 view of the prefill pool."""
    np.add(keys[:, :, None], word_values(word_offset, pool_words.shape[2])[None, None, :], out=pool_words)


@dataclass
class Check:
    checked: int = 0  # blocks compared
    wrong: int = 0  # blocks with at least one wrong byte
    first: str | None = None  # coordinates of the first wrong block

    def add(self, other: Check) -> None:
        self.checked += other.checked
        self.wrong += other.wrong
        self.first = self.first or other.first


def region_name(region: int, mla: bool) -> str:
    return f"layer {region} latent" if mla else f"layer {region // 2} {'KV'[region % 2]}"


def check_region(
    got: np.ndarray,
    keys_row: np.ndarray,
    p_ids: np.ndarray,
    d_ids: np.ndarray,
    word_offset: int,
    region: int,
    mla: bool,
) -> Check:
    """got: (n, words) uint64 decode blocks d_ids of one region, read from prefill blocks p_ids."""
    expected = keys_row[p_ids][:, None] + word_values(word_offset, got.shape[1])[None, :]
    bad = got != expected
    per_block = bad.any(axis=1)
    out = Check(checked=len(p_ids), wrong=int(per_block.sum()))
    if out.wrong:
        i = int(np.argmax(per_block))
        w = int(np.argmax(bad[i]))
        out.first = (f"{region_name(region, mla)}, prefill block {int(p_ids[i])} -> decode block {int(d_ids[i])}, "
                     f"byte offset {w * 8}")
    return out


def check_range(got: np.ndarray, keys: np.ndarray, start_word: int, words_per_block: int, word_offset: int,
                chunk: int = 1 << 20) -> int:
    """Wrong words in a contiguous run of prefill-pool words [start_word, start_word + len(got)).

    Chunked: a 128 MiB wire-ceiling transfer must not allocate gigabytes of index temporaries.
    """
    wrong = 0
    for lo in range(0, got.size, chunk):
        part = got[lo: lo + chunk]
        g = np.arange(start_word + lo, start_word + lo + part.size, dtype=np.int64)
        blk = g // words_per_block
        region, block = np.divmod(blk, keys.shape[1])
        within = (g % words_per_block).astype(np.uint64) + np.uint64(word_offset)
        wrong += int((part != keys[region, block] + within * _C).sum())
    return wrong
