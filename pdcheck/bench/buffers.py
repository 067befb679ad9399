"""KV pools in host memory (anonymous mmap + numpy) or GPU memory (torch, imported only for cuda).

Both expose the few operations the ranks need, so the measuring code never branches on the device.
"""

from __future__ import annotations

import mmap
from typing import Any, Protocol

import numpy as np

from pdcheck.bench import pattern
from pdcheck.kvcache import host_memory


class Pool(Protocol):
    addr: int
    nbytes: int
    mem_type: str  # NIXL memory type: DRAM or VRAM
    dev: int  # NIXL device id: 0 for DRAM, the GPU index for VRAM

    def fill(self, keys: np.ndarray, words_per_block: int, word_offset: int) -> None: ...
    def zero(self, nbytes: int) -> None: ...
    def gather(self, region: int, num_blocks: int, words_per_block: int, ids: np.ndarray) -> np.ndarray: ...
    def read_words(self, byte_start: int, nbytes: int) -> np.ndarray: ...
    def corrupt(self, byte_index: int) -> None: ...
    def copy(self, dst: int, src: int, nbytes: int) -> None: ...
    def sync(self) -> None: ...


class HostPool:
    """Page-aligned private anonymous memory with transparent huge pages asked for (madvise)."""

    mem_type = "DRAM"
    dev = 0

    def __init__(self, nbytes: int) -> None:
        self._map, self.arr = host_memory(max(nbytes, mmap.PAGESIZE), hugepages=True)
        # Write every page now: a first READ of untouched memory maps the shared zero page, and the
        # later copy-on-write faults (maybe onto 4 KiB pages) would land inside measured loops.
        self.arr[:] = 0
        self.nbytes = nbytes
        self.addr = self.arr.ctypes.data

    def _words(self, words_per_block: int, rows: int) -> np.ndarray:
        return self.arr[: rows * words_per_block * 8].view(np.uint64).reshape(rows, words_per_block)

    def fill(self, keys: np.ndarray, words_per_block: int, word_offset: int) -> None:
        regions, nb = keys.shape
        view = self._words(words_per_block, regions * nb).reshape(regions, nb, words_per_block)
        pattern.fill(view, keys, word_offset)

    def zero(self, nbytes: int) -> None:
        self.arr[:nbytes] = 0

    def gather(self, region: int, num_blocks: int, words_per_block: int, ids: np.ndarray) -> np.ndarray:
        start = region * num_blocks
        view = self._words(words_per_block, start + num_blocks)[start:]
        return view[ids]

    def read_words(self, byte_start: int, nbytes: int) -> np.ndarray:
        return self.arr[byte_start: byte_start + nbytes].view(np.uint64)

    def corrupt(self, byte_index: int) -> None:
        self.arr[byte_index] ^= 0xFF

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        np.copyto(self.arr[dst: dst + nbytes], self.arr[src: src + nbytes])  # one thread, like a memcpy

    def sync(self) -> None:
        return None


class CudaPool:
    """GPU memory for --device cuda. torch is imported here only: host runs never pay for it."""

    mem_type = "VRAM"

    def __init__(self, nbytes: int, gpu: int) -> None:
        import torch

        self._torch: Any = torch
        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        self.dev = gpu % count  # more ranks than GPUs: ranks share GPUs round-robin
        torch.cuda.set_device(self.dev)
        self.t = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.dev}")
        self.nbytes = nbytes
        self.addr = int(self.t.data_ptr())

    def _words(self, words_per_block: int, rows: int) -> Any:
        # int64 views: torch's uint64 support is partial; the bits are what matter.
        return self.t[: rows * words_per_block * 8].view(self._torch.int64).view(rows, words_per_block)

    def fill(self, keys: np.ndarray, words_per_block: int, word_offset: int) -> None:
        regions, nb = keys.shape
        vals = pattern.word_values(word_offset, words_per_block)
        view = self._words(words_per_block, regions * nb).view(regions, nb, words_per_block)
        for r in range(regions):  # one region at a time bounds the host staging buffer
            host = (keys[r][:, None] + vals[None, :]).view(np.int64)
            view[r].copy_(self._torch.from_numpy(host))
        self.sync()

    def zero(self, nbytes: int) -> None:
        self.t[:nbytes].zero_()
        self.sync()

    def gather(self, region: int, num_blocks: int, words_per_block: int, ids: np.ndarray) -> np.ndarray:
        start = region * num_blocks
        view = self._words(words_per_block, start + num_blocks)[start:]
        idx = self._torch.from_numpy(ids.astype(np.int64)).to(self.t.device)
        return view.index_select(0, idx).cpu().numpy().view(np.uint64)

    def read_words(self, byte_start: int, nbytes: int) -> np.ndarray:
        return self.t[byte_start: byte_start + nbytes].cpu().numpy().view(np.uint64)

    def corrupt(self, byte_index: int) -> None:
        self.t[byte_index: byte_index + 1].bitwise_xor_(0xFF)
        self.sync()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self.t[dst: dst + nbytes].copy_(self.t[src: src + nbytes])

    def sync(self) -> None:
        self._torch.cuda.synchronize(self.dev)


def make_pool(nbytes: int, device: str, gpu: int) -> Pool:
    if device == "cuda":
        return CudaPool(nbytes, gpu)
    return HostPool(nbytes)
