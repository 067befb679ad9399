"""Shared steps that release files assemble: each is one line of a release's add_remote_agent."""

from __future__ import annotations

from pdcheck.releases.base import Action, Check, Ctx, Prepared

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
    if ctx.local.geometry.flashinfer:
        size //= 2  # K and V share one FlashInfer region
    return size


def block_len_checks(with_replication: bool) -> tuple[Check, Check]:
    """MLA (or replicated KV from 0.9.2): equal block_len; otherwise block_len scaled by tp_ratio."""
    same = Check(
        "block_len_equal", "self.block_len == nixl_agent_meta.block_len",
        lambda c: c.local.block_len == c.remote_block_len(),
        when=lambda c: _replicated(c, with_replication), hazard="H08",
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
            base_addrs=list(ctx.meta.kv_caches_base_addr),
        )
        ctx.io.prep_remote(prepared, "DRAM")
        ctx.state.prepared[ctx.remote_tp_rank] = prepared

    return Action("prep_remote_descs", run)


def already_added(ctx: Ctx) -> bool:
    return ctx.remote_tp_rank in ctx.state.remote_agents.get(ctx.engine_id, {})


def engine_id_matches(exc_message: str = "0.10") -> Check:
    return Check(
        "engine_id_matches", "metadata.engine_id == expected_engine_id",
        lambda c: c.meta.engine_id == c.expected_engine_id,
        message=lambda c: (
            f"Remote NIXL agent engine ID mismatch. Expected {c.expected_engine_id},received {c.meta.engine_id}."
        ),
        exc="RuntimeError", hazard="H18",
    )


def remote_block_size_corrected(ctx: Ctx) -> int:
    """Token block size implied by the P block when the era does not advertise block_size."""
    g = ctx.local.geometry
    elem_heads = g.elem_size * g.head_dim * (1 if g.use_mla else max(1, g.total_kv_heads // ctx.remote_tp_size))
    size = ctx.remote_block_len() // elem_heads
    return size // 2 if (g.flashinfer and not g.use_mla) else size
