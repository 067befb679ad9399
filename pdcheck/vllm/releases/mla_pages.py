"""Compressed MLA caches (`--kv-cache-dtype fp8_ds_mla`) and NIXL's dense MLA virtual pages, per release.

Read from the release wheels (tests/test_shapes_wheels.py checks every fact below against each wheel's source):

* `fp8_ds_mla` is one of vLLM's `CacheDType` values from 0.11.1 (config/cache.py; 0.9.2's Literal has only
  auto/fp8/fp8_e4m3/fp8_e5m2; 0.10.x and 0.11.0 were not read). Its cache tensor is uint8
  (utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE) and one token's row is 656 bytes: 512 fp8 latent values, four
  float32 scales and 64 bf16 RoPE values (v1/attention/backends/mla/flashmla_sparse.py). An MLA cache is one
  latent "head" per token, replicated on every TP rank.
* `cache_dtype` is a compatibility-hash factor from 0.13: a P on fp8_ds_mla and a D on another cache dtype are
  refused at the handshake (hazard H17, releases.shapes.fp8_effects), on every release that has the hash.
* `block_strides` joins NixlAgentMetadata at connector version 9 (pdcheck's 0.29 model); version 10 ("Add dense
  virtual transfer pages for compressed MLA caches", the in-source history of nixl/metadata.py) lets a block's
  storage row be longer than its page: 0.34's register_kv_caches records `cache.stride(0) * element_size` as the
  block stride and the page size as block_len, and both descriptor builders (_build_fa_local, _build_fa_remote)
  read `block_len` bytes every `block_stride` bytes, each side with its own stride. pdcheck's 0.30 model is
  connector version 11, so version 10 first ships in 0.30. A release before it registers blocks that abut:
  there is no way to state a padded row to it (scenario validation, exit 2).
* 0.30+ check `stride >= block_len` for every remote region (rules.BLOCK_STRIDES_GE); a replicated (MLA) region
  must have P's block_len equal to D's ("KV cache sizes must match between P and D when replicated"): the pages
  must match, the rows need not.
"""

from __future__ import annotations

from pdcheck.errors import BadInput

CACHE_DTYPE = "fp8_ds_mla"
ROW_BYTES = 656  # one token: 512 x fp8 latent + 4 x float32 scale + 64 x bf16 RoPE
ELEMENT = "uint8"  # the cache tensor's dtype
FIRST_CACHE_DTYPE = (0, 11, 1)  # first release read whose CacheDType has fp8_ds_mla
FIRST_DENSE_PAGES = (0, 30, 0)  # NIXL_CONNECTOR_VERSION 10: dense virtual pages (block_strides > block_lens)
DENSE_PAGES_CONNECTOR_VERSION = 10


def _number(version: str) -> tuple[int, int, int]:
    a, b, c = ([int(x) for x in version.split(".")[:3]] + [0, 0, 0])[:3]
    return a, b, c


def has_cache_dtype(version: str) -> bool:
    return _number(version) >= FIRST_CACHE_DTYPE


def has_dense_pages(version: str) -> bool:
    return _number(version) >= FIRST_DENSE_PAGES


def validate(where: str, side: str, *, use_mla: bool, cache_dtype: str, dtype: str, head_dim: int,
             kv_heads: int, block_len: int, block_stride: int | None, releases: list[str]) -> None:
    """One line (BadInput, exit 2) for a compressed MLA cache or a padded row that cannot exist as stated."""
    if cache_dtype == CACHE_DTYPE and not (use_mla and dtype == ELEMENT and head_dim == ROW_BYTES and kv_heads == 1):
        raise BadInput(f"{where}: {side}.cache_dtype {CACHE_DTYPE!r} is an MLA cache of one latent head of "
                       f"{ROW_BYTES}-byte uint8 rows: set use_mla = true, kv_heads = 1, head_dim = {ROW_BYTES}, "
                       f"dtype = \"{ELEMENT}\"")
    if cache_dtype == CACHE_DTYPE:
        old = [r for r in releases if not has_cache_dtype(r)]
        if old:
            raise BadInput(f"{where}: {side}.cache_dtype {CACHE_DTYPE!r}: vLLM {old[0]} does not know it (its "
                           f"--kv-cache-dtype choices are auto, fp8, fp8_e4m3, fp8_e5m2; fp8_ds_mla from 0.11.1)")
    if block_stride is None:
        return
    if not use_mla:
        raise BadInput(f"{where}: {side}.block_stride: padded block rows (dense virtual pages) exist only for "
                       f"compressed MLA caches: set use_mla = true or leave block_stride out")
    if block_stride < block_len or block_stride % 16:
        raise BadInput(f"{where}: {side}.block_stride: {block_stride} B must be at least the block's "
                       f"{block_len} B (block_size x head_dim x dtype) and a multiple of 16 B")
    if block_stride > block_len:
        old = [r for r in releases if not has_dense_pages(r)]
        if old:
            raise BadInput(f"{where}: {side}.block_stride: vLLM {old[0]} predates dense MLA virtual pages (NIXL "
                           f"connector version {DENSE_PAGES_CONNECTOR_VERSION}, vLLM 0.30): its blocks abut, "
                           f"block_stride must equal the block's {block_len} B")

