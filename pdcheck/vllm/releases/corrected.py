"""The corrected behaviour: what a connector that handles uneven ranks does.

num_blocks is kept per (remote engine, remote rank) and remote descriptor ids use that rank's own count;
no global num_blocks relation is asserted; only the target rank(s) are contacted; P TP > D TP is
supported where divisible; real incompatibilities (shape, block size, layout, backend) are refused with
a clear message instead of a bare assert. Reads any era's reply (tolerant decode).
"""

from __future__ import annotations

from pdcheck import kvsplit
from pdcheck.releaseline import CORRECTED
from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import Action, Check, Ctx, Prepared, ReleaseModel


def _p_tp(c: Ctx) -> int:
    return c.remote_tp_size


def _split(c: Ctx) -> tuple[int, int, int, int, bool]:
    """(d_rank, d_tp, p_tp, heads, mla): the arguments of every kvsplit rule, as this D rank sees them."""
    g = c.local.geometry
    return c.local.tp_rank, c.local.tp_size, _p_tp(c), g.total_kv_heads, g.use_mla


def block_size_ratio(c: Ctx) -> int:
    """D's block in P blocks (P's block_size divides D's; 1 when P advertises none or it does not divide)."""
    p_bs = c.meta.block_size
    return c.local.block_size // p_bs if p_bs and c.local.block_size % p_bs == 0 else 1


def expected_remote_block_len(c: Ctx) -> int:
    _rank, d_tp, p_tp, heads, mla = _split(c)
    return kvsplit.corrected_remote_block_len(c.local.block_len, d_tp, p_tp, heads, mla) // block_size_ratio(c)


def _block_size_ok(c: Ctx) -> bool:
    # D's block a whole number of P's: P's blocks are read into sub-blocks of D's and rearranged on receive, as
    # 0.11.1+ do (block_size_ratio, get_mapped_blocks); a larger P block would have to be split across D blocks.
    p_bs = c.meta.block_size
    return p_bs is None or (p_bs <= c.local.block_size and c.local.block_size % p_bs == 0)


def _record_rank(c: Ctx) -> None:
    c.state.tp_size.setdefault(c.engine_id, c.remote_tp_size)


def _prep(c: Ctx) -> None:
    d_rank, d_tp, p_tp, heads, mla = _split(c)
    rlen = c.remote_block_len()
    halves = c.local.geometry.kv_halves
    bsr = block_size_ratio(c)
    unit = c.local.block_len // halves // bsr  # K and V read as two halves of a blocks-first block; one sub-block
    if d_tp >= p_tp:
        # The D rank's heads sit inside its P rank's block, at its first head's place (HND slices). With D TP
        # > heads several D ranks share a head, so this is not simply (tp_rank % ratio).
        head_len = unit // c.local.geometry.local_kv_heads  # one head's slice of a block (HND)
        read_len, local_offset = unit, 0
        rank_offset = kvsplit.head_offset(d_rank, d_tp, p_tp, heads, mla) * head_len
    else:
        # One chunk of the local block per P rank read (a whole block for MLA, which reads one rank).
        reads = kvsplit.corrected_reads(d_rank, d_tp, p_tp, heads, mla)
        read_len = unit // len(reads)
        local_offset, rank_offset = reads.index(c.remote_tp_rank) * read_len, 0
    dev = c.meta.device_id if c.meta.device_id is not None else c.remote_tp_rank
    prepared = Prepared(
        p_rank=c.remote_tp_rank, agent=c.state.remote_agents[c.engine_id][c.remote_tp_rank],
        dlist_blocks=c.meta.num_blocks, block_len=read_len, remote_block_len=rlen, rank_offset=rank_offset,
        local_offset=local_offset, device_id=dev, base_addrs=list(c.meta.kv_caches_base_addr), halves=halves,
        sub_blocks=bsr, permuted=rules.permute_active(c), remote_stride=rules.remote_stride(c),
    )
    c.io.prep_remote(prepared, "DRAM")
    c.state.prepared[c.remote_tp_rank] = prepared


def _layout_known(c: Ctx) -> bool:
    return not c.local.use_mla and c.meta.kv_cache_layout is not None


def heads_first(layout: str) -> bool:
    """Whether a layout puts a block's heads before its tokens (HND, LBHNC, ...): a head's run is contiguous."""
    return layout.index("H") < layout.index("N") if "H" in layout and "N" in layout else True


def _head_split(c: Ctx) -> bool:
    """D's heads per rank differ from P's: D reads part of each P block (D TP > P TP) or joins several P blocks
    into one of its own (P TP > D TP)."""
    _rank, d_tp, p_tp, heads, mla = _split(c)
    return not mla and max(1, heads // d_tp) != max(1, heads // p_tp)


def _layout_ok(c: Ctx) -> bool:
    """Equal layouts, or (enable_permute_local_kv) a heads-first P whose slices D permutes into its own layout."""
    if rules.same_layout(c.meta.kv_cache_layout, c.local.kv_cache_layout):
        return True
    return c.local.permute_local_kv and heads_first(c.meta.kv_cache_layout or "")


def _split_layout_ok(c: Ctx) -> bool:
    return heads_first(c.local.memory_layout or c.local.kv_cache_layout)


def _split_layout_msg(c: Ctx) -> str:
    mem, adv = c.local.memory_layout or c.local.kv_cache_layout, c.local.kv_cache_layout
    backend = f"the attention backend writes {mem} while the connector registered {adv}" if mem != adv \
        else f"the KV cache is {mem}"
    return (f"refused: {backend}; D TP {c.local.tp_size} and P TP {_p_tp(c)} split heads, which needs heads-first "
            "blocks (HND) on both sides: a token-major block's byte range holds tokens, not heads (vLLM #46204)")


MODEL = ReleaseModel(
    name=CORRECTED,
    versions=(),
    wire="any",
    flow="corrected",
    tp_size_from="params",
    recv_timeout_ms=5000,
    tolerant_decode=True,
    pre_add=(
        Check("engine_id_matches", "meta.engine_id == kv_transfer_params['remote_engine_id']",
              lambda c: c.meta.engine_id == c.expected_engine_id,
              message=lambda c: f"refused: the side channel answered for engine {c.meta.engine_id!r}, "
              f"kv_transfer_params name {c.expected_engine_id!r} (wrong host/port?)",
              exc="RuntimeError", hazard="H18"),
        Check("engine_id_distinct", "meta.engine_id != local.engine_id",
              lambda c: c.meta.engine_id != c.local.engine_id,
              message=lambda c: f"refused: remote engine id {c.meta.engine_id!r} equals the local one",
              exc="RuntimeError", hazard="H19"),
    ),
    # Before any request: with TP sizes that do not divide, some D rank's target would be a P rank that does
    # not exist (D TP 3, P TP 2: D rank 2 would ask P rank 2).
    pre_flow=(
        Check("tp_divisible", "max(tp) % min(tp) == 0",
              lambda c: kvsplit.divisible(c.local.tp_size, _p_tp(c)),
              message=lambda c: f"refused: TP sizes D={c.local.tp_size} and P={_p_tp(c)} do not divide",
              exc="RuntimeError", hazard="H11"),
    ),
    add_remote=(
        Check("attn_backend", "meta.attn_backend_name in (None, local.backend_name)",
              lambda c: c.meta.attn_backend_name in (None, c.local.backend_name),
              message=lambda c: f"refused: attention backend P={c.meta.attn_backend_name} D={c.local.backend_name}",
              exc="RuntimeError", hazard="H10"),
        Check("kv_cache_layout", "meta.kv_cache_layout == local.kv_cache_layout (or permuted on receive)",
              _layout_ok, when=_layout_known,
              message=lambda c: f"refused: kv_cache_layout P={c.meta.kv_cache_layout} D={c.local.kv_cache_layout}",
              exc="RuntimeError", hazard="H09"),
        # The one incompatibility the metadata cannot show: the bytes' real order. D knows its own backend's (P
        # serves the same model, so it has the same); a head split of token-major blocks permutes heads.
        Check("head_split_layout", "heads_first(local memory layout) where heads split",
              _split_layout_ok, when=lambda c: _head_split(c) and not rules.permute_active(c),
              message=_split_layout_msg, exc="RuntimeError", hazard="H09"),
        Check("block_size_divides", "meta.block_size divides local.block_size",
              _block_size_ok, when=lambda c: c.meta.block_size is not None,
              message=lambda c: f"refused: P block_size {c.meta.block_size}, D block_size {c.local.block_size}: D's "
              "block must be a whole number of P's (they are read into its sub-blocks)",
              exc="RuntimeError", hazard="H07"),
        Check("block_len", "meta.block_len == expected (heads, head_dim, dtype)",
              lambda c: c.remote_block_len() == expected_remote_block_len(c),
              message=lambda c: f"refused: P block is {c.remote_block_len()} B, D expects "
              f"{expected_remote_block_len(c)} B (block_size, heads, head_dim or dtype differ)",
              exc="RuntimeError", hazard="H08"),
        Action("record_tp_size", _record_rank),
        rules.NIXL_ADD,
        Action("prep_remote_descs", _prep),  # stride for this rank = its own num_blocks
    ),
    notif="{req}:{tp_ratio}",
    summary="target rank(s) only; num_blocks per remote rank; ids use that rank's count; P>D when divisible",
)
