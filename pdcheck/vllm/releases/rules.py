"""Shared steps that release files assemble: each is one line of a release's add_remote_agent.

Longer than the ~500 lines a module keeps to, on purpose: this is the one catalogue of every check and action any
vLLM line runs on P's metadata, in the order the releases introduced them (0.9 - 0.10.0, then eras D-E, F-H,
0.14+), each beside the source line it models. The release files (v0_9_1.py, ...) compose them; split by era, a
check later releases reuse would live far from the ones it replaced, and docs/release-models.md cites this file
for all of them."""

from __future__ import annotations

from collections.abc import Callable

from pdcheck import kvsplit
from pdcheck.vllm.releases.base import Action, Check, Ctx, Prepared, ReleaseModel, Step
from pdcheck.vllm.wire.formats import KV_LAYOUT_NAMES

MSG_SHAPE = (
    "Remote P worker KV layer cache must be of shape [2, N, local_kv_heads*tp_ratio, block_size, "
    "head_dim] and same dtype."
)


def _known_engine(ctx: Ctx) -> bool:
    return ctx.engine_id in ctx.state.tp_size


def _unknown_engine(ctx: Ctx) -> bool:
    return not _known_engine(ctx)


def _record_tp_size(ctx: Ctx) -> None:
    if _unknown_engine(ctx):
        ctx.state.tp_size[ctx.engine_id] = ctx.remote_tp_size


# `if engine_id in self._tp_size: assert ... else: self._tp_size[engine_id] = ...`
def tp_size_consistent(expr: str) -> tuple[Check, Action]:
    return (
        Check("tp_size_consistent", expr, lambda c: c.state.tp_size[c.engine_id] == c.remote_tp_size,
              when=_known_engine, hazard="H12"),
        Action("record_tp_size", _record_tp_size),
    )


ATTN_BACKEND = Check(
    "attn_backend", "nixl_agent_meta.attn_backend_name == self.backend_name",
    lambda c: c.meta.attn_backend_name == c.local.backend_name, hazard="H10",
)


def _nixl_add(ctx: Ctx) -> None:
    name = ctx.io.add_remote_agent(ctx.meta.agent_metadata)
    ctx.state.remote_agents.setdefault(ctx.engine_id, {})[ctx.remote_tp_rank] = name


NIXL_ADD = Action("nixl_add_remote_agent", _nixl_add)

TP_DIVISIBLE_091 = Check(
    "tp_divisible", "self._tp_size[self.engine_id] % self._tp_size[engine_id] == 0",
    lambda c: c.state.tp_size[c.local.engine_id] % c.state.tp_size[c.engine_id] == 0,
    message="Local TP size must be divisible by remote TP size.", hazard="H11",
)

# vllm.distributed.utils.divide -> ensure_divisibility(numerator, denominator)
TP_DIVIDE = Check(
    "tp_divisible", "numerator % denominator == 0",
    lambda c: c.state.tp_size[c.local.engine_id] % c.state.tp_size[c.engine_id] == 0,
    message=lambda c: f"{c.state.tp_size[c.local.engine_id]} is not divisible by {c.state.tp_size[c.engine_id]}",
    hazard="H11",
)

TP_RATIO_POSITIVE = Check(
    "tp_ratio_positive", "tp_ratio > 0", lambda c: c.tp_ratio > 0,
    message="Decode TP cannot be smaller than prefill TP", hazard="H11",
)


def _replicated(ctx: Ctx, with_replication: bool) -> bool:
    return ctx.local.use_mla or (with_replication and ctx.is_kv_replicated)


def remote_block_size(ctx: Ctx, with_replication: bool) -> int:
    slot = ctx.local.geometry.slot_size
    if _replicated(ctx, with_replication):
        return ctx.remote_block_len() // slot
    size = ctx.remote_block_len() // (slot * ctx.tp_ratio)
    if ctx.local.geometry.joint_kv:
        size //= 2  # K and V share one region (FlashInfer; FlashAttention 0.23+)
    return size


def block_len_checks(with_replication: bool) -> tuple[Check, Check]:
    """MLA (or replicated KV from 0.9.2): equal block_len; otherwise block_len scaled by tp_ratio."""
    same = Check(
        "block_len_equal", "self.block_len == nixl_agent_meta.block_len",
        lambda c: c.local.block_len == c.remote_block_len(),
        when=lambda c: _replicated(c, with_replication), hazard="H08",
        replication="loose" if with_replication else "mla",
    )
    scaled = Check(
        "block_len_tp_ratio", "nixl_agent_meta.block_len == self.block_len * tp_ratio",
        lambda c: c.remote_block_len() == c.local.block_len * c.tp_ratio,
        message=MSG_SHAPE, when=lambda c: not _replicated(c, with_replication), hazard="H08",
    )
    return same, scaled


def block_size_check(message: object, with_replication: bool) -> Check:
    return Check(
        "block_size_equal", "self.block_size == remote_block_size",
        lambda c: c.local.block_size == remote_block_size(c, with_replication),
        message=message, hazard="H07",  # type: ignore[arg-type]
    )


NUM_BLOCKS_GE = Check(
    "num_blocks_ge", "self.num_blocks >= nixl_agent_meta.num_blocks",
    lambda c: c.local.num_blocks >= c.meta.num_blocks, hazard="H02",
)


def _known_blocks(ctx: Ctx) -> bool:
    return ctx.engine_id in ctx.state.dst_num_blocks


def _record_blocks(ctx: Ctx) -> None:
    if not _known_blocks(ctx):
        ctx.state.dst_num_blocks[ctx.engine_id] = ctx.meta.num_blocks


# `if engine_id in self.dst_num_blocks: assert ... == ... else: self.dst_num_blocks[engine_id] = ...`
# Under python -O the assert vanishes and the first recorded count stays: the silent stride of H01/H03.
DST_NUM_BLOCKS_EQUAL = (
    Check("dst_num_blocks_equal", "self.dst_num_blocks[engine_id] == nixl_agent_meta.num_blocks",
          lambda c: c.state.dst_num_blocks[c.engine_id] == c.meta.num_blocks, when=_known_blocks, hazard="H03"),
    Action("record_dst_num_blocks", _record_blocks),
)


def remote_stride(ctx: Ctx) -> int:
    """Bytes between the starts of two of P's blocks as D's descriptors walk them: block_strides[0] where the wire
    carries it (0.29+; a padded compressed-MLA row from connector version 10, 0.30+), else 0 (blocks abut)."""
    strides = ctx.meta.block_strides
    return int(strides[0]) if strides else 0


def prep_if_target(with_replication: bool, device: str = "remote_tp_rank") -> Action:
    """Register the remote rank's blocks, but only if this D rank pulls from it (p_remote_rank)."""

    def run(ctx: Ctx) -> None:
        ratio = ctx.tp_ratio
        if ctx.local.tp_rank // ratio != ctx.remote_tp_rank:
            return
        rank_offset = 0 if _replicated(ctx, with_replication) else (ctx.local.tp_rank % ratio) * ctx.local.block_len
        dev = {"remote_tp_rank": ctx.remote_tp_rank, "local_rank": ctx.local.tp_rank}.get(device)
        if dev is None:
            dev = ctx.meta.device_id if ctx.meta.device_id is not None else ctx.remote_tp_rank
        prepared = Prepared(
            p_rank=ctx.remote_tp_rank, agent=ctx.state.remote_agents[ctx.engine_id][ctx.remote_tp_rank],
            dlist_blocks=ctx.meta.num_blocks, block_len=ctx.local.block_len,
            remote_block_len=ctx.remote_block_len(), rank_offset=rank_offset, device_id=dev,
            base_addrs=list(ctx.meta.kv_caches_base_addr), remote_stride=remote_stride(ctx),
        )
        ctx.io.prep_remote(prepared, "DRAM")
        ctx.state.prepared[ctx.remote_tp_rank] = prepared

    return Action("prep_remote_descs", run)


def already_added(ctx: Ctx) -> bool:
    return ctx.remote_tp_rank in ctx.state.remote_agents.get(ctx.engine_id, {})


def msg_engine_id(expected: str, received: str) -> str:
    """The RuntimeError text of vLLM's engine-id check (0.10+), as the release writes it (no space after ',')."""
    return f"Remote NIXL agent engine ID mismatch. Expected {expected},received {received}."


def engine_id_matches(exc_message: str = "0.10") -> Check:
    return Check(
        "engine_id_matches", "metadata.engine_id == expected_engine_id",
        lambda c: c.meta.engine_id == c.expected_engine_id,
        message=lambda c: msg_engine_id(c.expected_engine_id, c.meta.engine_id),
        exc="RuntimeError", hazard="H18",
    )


# ---- 0.10.1 - 0.34 (eras D - H) ------------------------------------------------------------------------------
# Shared steps of the later release files. Only additions: the steps above keep their behaviour.

RECORD_TP_SIZE = Action("record_tp_size", _record_tp_size)  # `if engine_id not in self._tp_size: ... = remote`
RECORD_DST_NUM_BLOCKS = Action("record_dst_num_blocks", _record_blocks)  # `if engine_id not in dst_num_blocks`


def is_replicated(ctx: Ctx) -> bool:
    """MLA, or TpKVTopology.is_kv_replicated up to 0.31: `remote_tp_size // total_num_kv_heads >= 1`."""
    return ctx.local.use_mla or ctx.is_kv_replicated


def is_replicated_strict(ctx: Ctx) -> bool:
    """0.34: `remote_tp_size > total_num_kv_heads` (at P TP == heads every P rank still holds its own head)."""
    return ctx.local.use_mla or is_kv_replicated_strict(ctx)


def not_replicated(ctx: Ctx) -> bool:
    return not is_replicated(ctx)


def signed_tp_ratio(ctx: Ctx) -> int:
    """0.14+ TpKVTopology.tp_ratio: D // P when D >= P, else -(P // D) (#27274). ≤0.13 is `ctx.tp_ratio`."""
    d, p = ctx.state.tp_size[ctx.local.engine_id], ctx.state.tp_size[ctx.engine_id]
    return d // p if d >= p else -p // d


def block_size_ratio(ctx: Ctx) -> int:
    """TpKVTopology.block_size_ratio: local kernel block size // the remote's advertised block_size (F+)."""
    return ctx.local.block_size // (ctx.meta.block_size or 0)


def block_len_per_layer(ctx: Ctx) -> list[int]:
    """The D worker's block_len_per_layer (0.11.0+): one entry per registered region."""
    return [ctx.local.block_len] * ctx.local.geometry.num_regions


def remote_block_lens(ctx: Ctx) -> list[int]:
    return list(ctx.meta.block_lens or [])


class _ListIndexError(IndexError, KeyError):
    """`list[i]` past the end, as vLLM's per-layer loops raise it (IndexError). It also derives from KeyError only
    so that the engine, which catches KeyError among the exceptions a release's own Python raises, reports it."""

    def __str__(self) -> str:
        return "list index out of range"


_ListIndexError.__name__ = _ListIndexError.__qualname__ = "IndexError"


def remote_block_len_at(ctx: Ctx, i: int) -> int:
    """`nixl_agent_meta.block_lens[i]`, IndexError past the end as in vLLM's per-layer loops."""
    lens = remote_block_lens(ctx)
    if i >= len(lens):
        raise _ListIndexError("list index out of range")
    return lens[i]


# ---- checks made by 0.10.1 - 0.11.0 (eras D and E)

def _tp_ratio_above_one(ctx: Ctx) -> bool:
    return not is_replicated(ctx) and ctx.tp_ratio > 1


# 0.10.1-0.11.0: `if tp_ratio > 1: assert nixl_agent_meta.kv_cache_layout == self.kv_cache_layout` (non-replicated
# branch only): homogeneous TP with different layouts passes (H09).
LAYOUT_HETERO_TP_BARE = Check(
    "kv_cache_layout", "nixl_agent_meta.kv_cache_layout == self.kv_cache_layout",
    lambda c: c.meta.kv_cache_layout == c.local.kv_cache_layout, when=_tp_ratio_above_one, hazard="H09",
)

MSG_REPLICATED = "KV cache sizes must match between P and D when replicated"

# 0.11.0
BLOCK_LENS_EQUAL_REPLICATED_110 = Check(
    "block_lens_equal_replicated", "self.block_len_per_layer == nixl_agent_meta.block_lens",
    lambda c: block_len_per_layer(c) == remote_block_lens(c), message=MSG_REPLICATED, when=is_replicated,
    hazard="H08", replication="loose",
)

REMOTE_LAYERS_SAME_BLOCK_LEN = Check(
    "remote_layers_same_block_len", "block_len == remote_block_len",
    lambda c: all(x == c.remote_block_len() for x in remote_block_lens(c)),
    message="All remote layers must have the same block size", when=not_replicated, hazard="H08",
)

BLOCK_LEN_TP_RATIO_110 = Check(
    "block_len_tp_ratio", "remote_block_len == self.block_len_per_layer[0] * tp_ratio",
    lambda c: c.remote_block_len() == c.local.block_len * c.tp_ratio, message=MSG_SHAPE, when=not_replicated,
    hazard="H08",
)

BASE_ADDR_LEN = Check(
    "kv_caches_base_addr_len", "len(nixl_agent_meta.kv_caches_base_addr) == len(self.block_len_per_layer)",
    lambda c: len(c.meta.kv_caches_base_addr) == len(block_len_per_layer(c)), hazard="H08",
)


# ---- checks made by 0.11.1 - 0.34 (eras F - H)

def _tp_divisible_msg(c: Ctx) -> str:
    return (f"Local tensor parallel size {c.local.tp_size} is not divisible by remote tensor parallel size "
            f"{c.remote_tp_size}.")


# TpKVTopology.tp_ratio, called by _nixl_handshake (get_target_remote_rank) before any request is sent: pre_flow.
# ≤0.13 knows only D >= P, so P TP > D TP fails here too (2 % 4 != 0).
TP_RATIO_DIVISIBLE_111 = Check(
    "tp_ratio_divisible", "self.tp_size % remote_tp_size == 0",
    lambda c: c.local.tp_size % c.remote_tp_size == 0, message=_tp_divisible_msg, hazard="H11",
)

# 0.14+: both directions (#27274)
TP_RATIO_DIVISIBLE_LOCAL = Check(
    "tp_ratio_divisible", "self.tp_size % remote_tp_size == 0",
    lambda c: c.local.tp_size % c.remote_tp_size == 0, message=_tp_divisible_msg,
    when=lambda c: c.local.tp_size >= c.remote_tp_size, hazard="H11",
)
TP_RATIO_DIVISIBLE_REMOTE = Check(
    "tp_ratio_divisible", "remote_tp_size % self.tp_size == 0",
    lambda c: c.remote_tp_size % c.local.tp_size == 0,
    message=lambda c: (f"Remote tensor parallel size {c.remote_tp_size} is not divisible by local tensor parallel "
                       f"size {c.local.tp_size}."),
    when=lambda c: c.local.tp_size < c.remote_tp_size, hazard="H11",
)

# 0.11.1-0.13 _nixl_handshake, right before add_remote_agent
NP_GT_ND = Check(
    "block_size_le", "metadata.block_size <= self.block_size",
    lambda c: (c.meta.block_size or 0) <= c.local.block_size, message="nP > nD is not supported yet.", hazard="H07",
)

BLOCK_SIZE_RATIO = Check(
    "block_size_ratio", "self.block_size % remote_block_size == 0",
    lambda c: c.local.block_size % (c.meta.block_size or 0) == 0,
    message=lambda c: (f"Local block size {c.local.block_size} is not divisible by remote block size "
                       f"{c.meta.block_size} or vice versa."),
    hazard="H07",
)

# _validate_remote_agent_handshake: the tp_size was recorded at the top of add_remote_agent if the engine was new
TP_SIZE_ASSERT = Check(
    "tp_size_consistent", "self._tp_size[remote_engine_id] == remote_tp_size",
    lambda c: c.state.tp_size[c.engine_id] == c.remote_tp_size, hazard="H12",
)

MSG_LAYOUT_111 = (
    "Heterogeneous TP expects same kv_cache_layout. Or enable experimental feature to use HND to NHD support by "
    "setting 'enable_permute_local_kv'=True in --kv-transfer-config."
)

# Enum names of KVCacheLayout (0.31+) and the older strings they replace.
LAYOUT_ENUM = KV_LAYOUT_NAMES


def layout_enum(value: str | None) -> str | None:
    """How a 0.31+ release names a layout: old strings map to their KVCacheLayout names, enum names stay."""
    return LAYOUT_ENUM.get(value, value) if value is not None else None


def same_layout(remote: str | None, local: str | None) -> bool:
    """The one layout comparison (0.29+ and the corrected D): 0.29+ metadata carries KVCacheLayout names and D
    resolves its own layout to one (vLLM reads HND/NHD as LBHNC/LBNHC), so an old-style name and its enum
    name are the same layout; before 0.29 both sides carry the old strings, which this leaves as they are."""
    return layout_enum(remote) == layout_enum(local)


def permute_active(c: Ctx) -> bool:
    """enable_permute_local_kv took effect: the layouts differ and the release accepted it (its layout check
    passed), so it reads P's heads-first slices and permutes every received block into its own layout."""
    return (c.local.permute_local_kv and not c.local.use_mla
            and not same_layout(c.meta.kv_cache_layout, c.local.kv_cache_layout))


def layout_check(*, enum_names: bool, message: object = MSG_LAYOUT_111,
                 permute: tuple[str, str | None] | None = ("HND", None)) -> Check:
    """0.11.1+: RuntimeError on any layout difference (homogeneous TP too), non-MLA only, unless the D sets
    enable_permute_local_kv and P's layout is `permute` = (remote, local or None for any): 0.11.1 - 0.28
    `nixl_agent_meta.kv_cache_layout == "HND"`; 0.29 - 0.31 `== "LBHNC"`; 0.32+ LBHNC into a local LBNHC only.
    permute None: the flag is not modelled for that release line: a difference raises.

    enum_names (0.29+): the release compares KVCacheLayout names (what its metadata carries: pdcheck's fake P and
    serve advertise them on wires H31/H34); the D's own layout, which a scenario may name the pre-0.29 way, and an
    old-style name from P are read as the enum name of the same layout."""

    def ok(c: Ctx) -> bool:
        if enum_names:
            same = same_layout(c.meta.kv_cache_layout, c.local.kv_cache_layout)
        else:
            same = c.meta.kv_cache_layout == c.local.kv_cache_layout
        if same or permute is None or not c.local.permute_local_kv:
            return same
        remote, local = permute
        return c.meta.kv_cache_layout == remote and (local is None or layout_enum(c.local.kv_cache_layout) == local)

    return Check(
        "kv_cache_layout", "nixl_agent_meta.kv_cache_layout == kv_cache_layout", ok, message=message,  # type: ignore[arg-type]
        exc="RuntimeError", when=lambda c: not c.local.use_mla, hazard="H09",
    )


def _replicated_lens_ok(c: Ctx) -> bool:
    bsr = block_size_ratio(c)
    return all(x // bsr == remote_block_len_at(c, i) for i, x in enumerate(block_len_per_layer(c)))


BLOCK_LENS_EQUAL_REPLICATED = Check(
    "block_lens_equal_replicated", "self.block_len_per_layer[i] // block_size_ratio == nixl_agent_meta.block_lens[i]",
    _replicated_lens_ok, message=MSG_REPLICATED, when=is_replicated, hazard="H08", replication="loose",
)

BLOCK_LEN_TP_RATIO_111 = Check(
    "block_len_tp_ratio", "remote_block_len == (self.block_len_per_layer[0] * tp_ratio) // block_size_ratio",
    lambda c: c.remote_block_len() == (c.local.block_len * c.tp_ratio) // block_size_ratio(c), message=MSG_SHAPE,
    when=not_replicated, hazard="H08",
)

DST_NUM_BLOCKS_ASSERT = Check(
    "dst_num_blocks_equal", "self.dst_num_blocks[remote_engine_id] == nixl_agent_meta.num_blocks",
    lambda c: c.state.dst_num_blocks[c.engine_id] == c.meta.num_blocks, hazard="H03",
)


# ---- 0.14+ (P TP > D TP, #27274)

def _split_pos(c: Ctx) -> bool:
    return not_replicated(c) and signed_tp_ratio(c) > 0


def _split_neg(c: Ctx) -> bool:
    return not_replicated(c) and signed_tp_ratio(c) < 0


BLOCK_LEN_TP_RATIO_14 = Check(
    "block_len_tp_ratio", "remote_block_len == (self.block_len_per_layer[0] * tp_ratio) // block_size_ratio",
    lambda c: c.remote_block_len() == (c.local.block_len * signed_tp_ratio(c)) // block_size_ratio(c),
    message=MSG_SHAPE, when=_split_pos, hazard="H08",
)

P_GT_D_SAME_BLOCK_SIZE = Check(
    "p_gt_d_block_size", "block_size_ratio == 1", lambda c: block_size_ratio(c) == 1,
    message="Different local/remote block sizes are not supported when P TP > D TP.", when=_split_neg, hazard="H07",
)

MSG_SHAPE_P_GT_D = (
    "Remote P worker KV layer cache must be of shape [2, N, local_kv_heads/tp_ratio, page_size, head_dim] and "
    "same dtype."
)

BLOCK_LEN_P_GT_D = Check(
    "block_len_p_gt_d", "remote_block_len == self.block_len_per_layer[0] // (-tp_ratio)",
    lambda c: c.remote_block_len() == c.local.block_len // (-signed_tp_ratio(c)), message=MSG_SHAPE_P_GT_D,
    when=_split_neg, hazard="H08",
)


def prep_targets(*, signed: bool, replicated: object = is_replicated, head_offsets: bool = False) -> Action:
    """F+ remote descriptors of one handshaken (target) rank: the device id P advertised, the head slice when D TP
    > P TP, the remote sub-block when D's block is a multiple of P's (block_size_ratio), and, 0.14+, a local chunk
    per P rank when P TP > D TP (non-MLA).

    head_offsets (0.34, per-rank physical head counts): the slice starts at the D rank's first head inside its P
    rank, which differs from `tp_rank % tp_ratio` once D TP exceeds the KV heads."""

    def run(ctx: Ctx) -> None:
        ratio = signed_tp_ratio(ctx) if signed else ctx.tp_ratio
        bsr = block_size_ratio(ctx)
        rep = replicated(ctx)  # type: ignore[operator]
        halves = ctx.local.geometry.kv_halves
        read_len = ctx.local.block_len // halves  # get_backend_aware_kv_block_len: the K half when split
        remote_kv_block_len = read_len // bsr
        if bsr > 1:
            read_len = remote_kv_block_len  # using the remote kv_block_len as the transfer unit
        local_offset = 0
        if ratio < 0 and not ctx.local.use_mla:
            read_len //= -ratio  # P TP > D TP: read a chunk of the local block from each P rank
            local_offset = (ctx.remote_tp_rank % -ratio) * read_len
        rank_offset = (ctx.local.tp_rank % ratio) * remote_kv_block_len if (ratio > 0 and not rep) else 0
        if head_offsets and ratio > 0 and not rep:
            g = ctx.local.geometry
            first_head = ctx.local.tp_rank * g.total_kv_heads // ctx.local.tp_size
            p_heads = max(1, g.total_kv_heads // ctx.state.tp_size[ctx.engine_id])
            rank_offset = (first_head % p_heads) * (remote_kv_block_len // g.local_kv_heads)
        dev = ctx.meta.device_id if ctx.meta.device_id is not None else ctx.remote_tp_rank
        prepared = Prepared(
            p_rank=ctx.remote_tp_rank, agent=ctx.state.remote_agents[ctx.engine_id][ctx.remote_tp_rank],
            dlist_blocks=ctx.meta.num_blocks, block_len=read_len, remote_block_len=ctx.remote_block_len(),
            rank_offset=rank_offset, local_offset=local_offset, device_id=dev,
            base_addrs=list(ctx.meta.kv_caches_base_addr), halves=halves, sub_blocks=max(1, bsr),
            permuted=permute_active(ctx), remote_stride=remote_stride(ctx),
        )
        ctx.io.prep_remote(prepared, "DRAM")
        if ratio < 0 and ctx.remote_tp_rank not in kvsplit.release_reads(
                "all_targets", ctx.local.tp_rank, ctx.local.tp_size, ctx.state.tp_size[ctx.engine_id], ctx.local.use_mla):
            # MLA with P TP > D TP: the descriptors are registered, but only the first target rank is read (the
            # latent is replicated); the others only get a notification.
            return
        ctx.state.prepared[ctx.remote_tp_rank] = prepared

    return Action("prep_remote_descs", run)


# ---- 0.14 - 0.34, re-read against each release's source -------------------------------------------------------
# The statement texts below are the releases' own, whitespace collapsed.

MSG_SHAPE_PAGE = (
    "Remote P worker KV layer cache must be of shape [2, N, local_kv_heads*tp_ratio, page_size, head_dim] and "
    "same dtype."
)


def is_kv_replicated_strict(ctx: Ctx) -> bool:
    """0.20+ TransferTopology.is_kv_replicated: `remote_tp_size > self.total_num_kv_heads` (MLA not special-cased;
    0.20 - 0.28 pass the model's total KV heads for MLA too, 0.29+ pass 1)."""
    return kvsplit.topology_replicated(ctx.state.tp_size[ctx.engine_id], ctx.local.geometry.total_kv_heads,
                                       strict=True)


def not_replicated_strict(ctx: Ctx) -> bool:
    return not is_replicated_strict(ctx)


def p_gt_d_replicated(expr: str, *, strict: bool, skip_mla: bool) -> Check:
    """`assert not (tp_ratio < 0 and <topology>.is_kv_replicated(remote_engine_id))`, bare in every release.

    0.14 - 0.19 (KVTopology): `remote_tp_size // total_num_kv_heads >= 1`; 0.20+ (TransferTopology): strict `>`.
    0.14 - 0.20 assert it for MLA as well (with the model's KV head count); 0.21+ skip MLA."""
    repl = is_kv_replicated_strict if strict else (lambda c: c.is_kv_replicated)

    def skip(c: Ctx) -> bool:
        return skip_mla and c.local.use_mla

    return Check("p_gt_d_replicated", expr, lambda c: not (signed_tp_ratio(c) < 0 and repl(c)),
                 when=lambda c: not skip(c), hazard="H13", replication="strict" if strict else "loose",
                 skips_mla=skip_mla)


P_GT_D_REPLICATED_14 = p_gt_d_replicated(
    "not (tp_ratio < 0 and self.kv_topo.is_kv_replicated(remote_engine_id))", strict=False, skip_mla=False)
EXPR_P_GT_D_20 = "not (tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id))"
P_GT_D_REPLICATED_20 = p_gt_d_replicated(EXPR_P_GT_D_20, strict=True, skip_mla=False)
P_GT_D_REPLICATED_21 = p_gt_d_replicated(EXPR_P_GT_D_20, strict=True, skip_mla=True)

TP_SIZE_ASSERT_20 = Check(
    "tp_size_consistent", "remote_info.remote_tp_size == remote_tp_size",
    lambda c: c.state.tp_size[c.engine_id] == c.remote_tp_size, hazard="H12",
)

# KVCacheLayout (0.29+): is_block_contiguous is true when [H, N, C] closes the stride order.
BLOCK_CONTIGUOUS = {"LBHNC": True, "LBNHC": False, "LHBNC": False, "BLHNC": True, "BLNHC": False, "BHLNC": False}

MSG_HEAD_SPLIT_20 = ("Heterogeneous TP head-dimension splitting requires contiguous heads. Use HND layout on the "
                     "prefill side.")
MSG_HEAD_SPLIT_29 = ("Heterogeneous TP head-dimension splitting requires contiguous heads. Use a block-contiguous "
                     "layout (e.g. LBHNC) on the prefill side.")


def _head_split_applies(c: Ctx) -> bool:
    # `abs(tp_ratio) != 1 and not self.use_mla and not ...is_kv_replicated(remote_engine_id)`; pdcheck models the
    # default enable_permute_local_kv=False.
    return (abs(signed_tp_ratio(c)) != 1 and not c.local.use_mla and not is_kv_replicated_strict(c)
            and not permute_active(c))  # `and not self.enable_permute_local_kv` (0.26, 0.34)


def _local_block_contiguous(c: Ctx) -> bool:
    # KVCacheLayout[kv_cache_layout]: an unknown name is the KeyError the release raises.
    name = layout_enum(c.local.kv_cache_layout) or ""
    if name not in BLOCK_CONTIGUOUS:
        raise KeyError(name)
    return BLOCK_CONTIGUOUS[name]


# 0.20 - 0.28: the LOCAL layout (equal to the remote one by then: a difference raised just before) must be HND.
HEAD_SPLIT_HND = Check(
    "head_split_contiguous", 'kv_cache_layout == "HND"', lambda c: c.local.kv_cache_layout == "HND",
    message=MSG_HEAD_SPLIT_20, exc="RuntimeError", when=_head_split_applies, hazard="H09",
)
# 0.29+: `KVCacheLayout[kv_cache_layout].is_block_contiguous` of the local layout
HEAD_SPLIT_ENUM = Check(
    "head_split_contiguous", "KVCacheLayout[kv_cache_layout].is_block_contiguous", _local_block_contiguous,
    message=MSG_HEAD_SPLIT_29, exc="RuntimeError", when=_head_split_applies, hazard="H09",
)


def replace_check(check: Check, **kw: object) -> Check:
    from dataclasses import replace

    return replace(check, **kw)  # type: ignore[arg-type]


def _layout_msg_32(c: Ctx) -> str:
    return (f"Heterogeneous TP expects same kv_cache_layout (local {layout_enum(c.local.kv_cache_layout)}, remote "
            f"{layout_enum(c.meta.kv_cache_layout)}). Or enable experimental feature to receive LBHNC into a local "
            "LBNHC cache by setting 'enable_permute_local_kv'=True in --kv-transfer-config.")


# KVCacheLayout names on the wire, 0.11.1's message; the flag accepts a remote LBHNC whatever the local layout
# (read in the 0.29.0 - 0.31.0 wheels: `nixl_agent_meta.kv_cache_layout == "LBHNC"` alone)
LAYOUT_29 = layout_check(enum_names=True, permute=("LBHNC", None))
LAYOUT_32 = layout_check(enum_names=True, message=_layout_msg_32, permute=("LBHNC", "LBNHC"))


# 0.20 - 0.23: the 0.14 block-length checks, with TransferTopology's strict replication and page_size messages
BLOCK_LENS_EQUAL_REPLICATED_20 = replace_check(BLOCK_LENS_EQUAL_REPLICATED, when=is_replicated_strict,
                                               replication="strict")
REMOTE_LAYERS_SAME_BLOCK_LEN_20 = replace_check(REMOTE_LAYERS_SAME_BLOCK_LEN, when=not_replicated_strict)


def _split_pos_strict(c: Ctx) -> bool:
    return not_replicated_strict(c) and signed_tp_ratio(c) > 0


def _split_neg_strict(c: Ctx) -> bool:
    return not_replicated_strict(c) and signed_tp_ratio(c) < 0


BLOCK_LEN_TP_RATIO_14_PAGE = replace_check(BLOCK_LEN_TP_RATIO_14, message=MSG_SHAPE_PAGE)
BLOCK_LEN_TP_RATIO_20 = replace_check(BLOCK_LEN_TP_RATIO_14_PAGE, when=_split_pos_strict)
P_GT_D_SAME_BLOCK_SIZE_20 = replace_check(P_GT_D_SAME_BLOCK_SIZE, when=_split_neg_strict)
BLOCK_LEN_P_GT_D_20 = replace_check(BLOCK_LEN_P_GT_D, when=_split_neg_strict)


# 0.24+: per-region checks with per-rank physical head counts (#45330)

def remote_heads(c: Ctx) -> int:
    """`max(1, total_kv_heads // remote_tp_size)`: physical KV heads per P rank."""
    return kvsplit.rank_heads(c.state.tp_size[c.engine_id], c.local.geometry.total_kv_heads, False)


def local_heads(c: Ctx) -> int:
    """TransferTopology.local_physical_heads: `max(1, total_num_kv_heads // tp_size)`."""
    return kvsplit.rank_heads(c.local.tp_size, c.local.geometry.total_kv_heads, False)


def num_layers_check(expr: str) -> Check:
    return Check(
        "num_kv_layers", expr, lambda c: len(remote_block_lens(c)) == len(block_len_per_layer(c)),
        message="Number of KV layers must match between prefill and decode", hazard="H08",
    )


NUM_LAYERS_24 = num_layers_check("len(self.block_len_per_layer) == len(nixl_agent_meta.block_lens)")
NUM_LAYERS_31 = num_layers_check("len(local_regions) == len(nixl_agent_meta.block_lens)")


def _first_bad(c: Ctx, want: Callable[[int], int]) -> int | None:
    for i, local_len in enumerate(block_len_per_layer(c)):
        if remote_block_len_at(c, i) != want(local_len):
            return i
    return None


def _repl_want(c: Ctx) -> Callable[[int], int]:
    bsr = block_size_ratio(c)
    return lambda local_len: local_len // bsr


def _split_want(c: Ctx) -> Callable[[int], int]:
    rh, lh, bsr = remote_heads(c), local_heads(c), block_size_ratio(c)
    return lambda local_len: (local_len * rh // lh) // bsr


def _split_neg_want(c: Ctx) -> Callable[[int], int]:
    rh, lh = remote_heads(c), local_heads(c)
    return lambda local_len: local_len * rh // lh


def _region(c: Ctx, want: Callable[[Ctx], Callable[[int], int]]) -> tuple[int, int, int]:
    i = _first_bad(c, want(c)) or 0
    return i, block_len_per_layer(c)[i], remote_block_lens(c)[i]


def _repl_region_msg(c: Ctx) -> str:
    i, local_len, remote_len = _region(c, _repl_want)
    return (f"KV cache sizes must match between P and D when replicated (region {i}: local={local_len}, "
            f"remote={remote_len}, bsr={block_size_ratio(c)}).")


def _split_region_msg(c: Ctx) -> str:
    i, local_len, remote_len = _region(c, _split_want)
    return (f"SPLIT region {i}: remote P KV block_len {remote_len} must equal local {local_len} * remote_heads "
            f"{remote_heads(c)} // local_heads {local_heads(c)} // block_size_ratio {block_size_ratio(c)}.")


def _split_neg_region_msg(c: Ctx) -> str:
    i, local_len, remote_len = _region(c, _split_neg_want)
    return (f"SPLIT region {i}: remote P KV block_len {remote_len} must equal local {local_len} * remote_heads "
            f"{remote_heads(c)} // local_heads {local_heads(c)}.")


REPLICATED_REGIONS = Check(
    "block_lens_equal_replicated", "local_len // block_size_ratio == remote_len",
    lambda c: _first_bad(c, _repl_want(c)) is None, message=_repl_region_msg, when=is_replicated_strict,
    hazard="H08", replication="strict",
)
SPLIT_REGIONS = Check(
    "block_len_split", "remote_len == (local_len * remote_heads // local_heads) // block_size_ratio",
    lambda c: _first_bad(c, _split_want(c)) is None, message=_split_region_msg, when=_split_pos_strict,
    hazard="H08",
)
SPLIT_REGIONS_P_GT_D = Check(
    "block_len_p_gt_d", "remote_len == local_len * remote_heads // local_heads",
    lambda c: _first_bad(c, _split_neg_want(c)) is None, message=_split_neg_region_msg, when=_split_neg_strict,
    hazard="H08",
)

BASE_ADDR_LEN_31 = replace_check(BASE_ADDR_LEN, expr="len(nixl_agent_meta.kv_caches_base_addr) == len(local_regions)")

# 0.30+: the region metadata asserts at the end of the validation (block_strides is a required field from 0.29)
BLOCK_STRIDES_LEN = Check(
    "block_strides_len", "len(nixl_agent_meta.block_strides) == num_remote_regions",
    lambda c: len(c.meta.block_strides or []) == len(c.meta.kv_caches_base_addr), hazard="H08",
)


def _strides_ge(c: Ctx) -> bool:
    strides, lens = list(c.meta.block_strides or []), remote_block_lens(c)
    if len(strides) != len(lens):
        raise ValueError("zip() argument 2 is shorter than argument 1" if len(lens) < len(strides)
                         else "zip() argument 2 is longer than argument 1")
    return all(s >= n for s, n in zip(strides, lens, strict=True))


BLOCK_STRIDES_GE = Check(
    "block_strides_ge",
    "all(stride >= block_len for stride, block_len in zip(nixl_agent_meta.block_strides, nixl_agent_meta.block_lens, "
    "strict=True))",
    _strides_ge, hazard="H08",
)


# 0.26+ base_worker.__init__ (pull and push workers): `if kv_role == "kv_consumer" and self.pp_size > 1: raise`, at
# the D worker's start-up, before any request (pdcheck runs it as the first pre_flow step).
PP_DECODE_REFUSED = Check(
    "pp_decode", 'not (kv_transfer_config.kv_role == "kv_consumer" and self.pp_size > 1)',
    lambda c: c.local.pp_size == 1,
    message="NixlPushConnector consumer (decode) does not support pipeline_parallel_size > 1.",
    exc="NotImplementedError", hazard="X01",
)


def _steps(rel: ReleaseModel) -> tuple[Step, ...]:
    return (*rel.pre_flow, *rel.pre_add, *rel.add_remote)


def replication(rel: ReleaseModel) -> str | None:
    """What `rel`'s block-length checks count as replicated KV ("mla", "loose", "strict"; Check.replication);
    None where it makes none (0.9.0, the corrected model)."""
    return next((s.replication for s in _steps(rel) if isinstance(s, Check) and s.replication), None)


def p_gt_d_skips_mla(rel: ReleaseModel) -> bool:
    """`rel` does not assert the P TP > D TP replication for MLA (0.21+)."""
    return any(isinstance(s, Check) and s.id == "p_gt_d_replicated" and s.skips_mla for s in _steps(rel))
