"""How KV heads split over TP ranks, and which P ranks a D rank handshakes and reads: the one home of these rules.

The engine (each release's flow and the corrected model), the hazard catalogue, the report built from both and
the transfer bench (geometry.read_source) all ask this module, so no two parts of one report can disagree on
which P ranks a D rank reads, whether KV is replicated, or what P block length the corrected model expects.

The corrected behaviour follows the newest vLLM (0.34, TransferTopology): P's KV is replicated when P TP exceeds
the model's KV heads (strict: at P TP == heads every P rank holds its own head) or for MLA. A D rank reads, for
each KV head it holds, one P rank that holds that head: with P TP <= D TP that is one P rank; with P TP > D TP it
is every P rank of its group when P is not replicated, one per head when P is replicated (heads spread over the
group), and the first of the group for MLA (every P rank holds the whole latent).
Pure integer arithmetic, no pdcheck imports: geometry, releases, engine and hazards all sit above it.
"""

from __future__ import annotations


def rank_heads(tp: int, heads: int, mla: bool) -> int:
    """Physical KV heads per rank (vLLM's `max(1, total_num_kv_heads // tp_size)`); MLA: one latent."""
    return 1 if mla else max(1, heads // tp)


def topology_replicated(p_tp: int, heads: int, *, strict: bool) -> bool:
    """vLLM's is_kv_replicated(remote): KVTopology (0.9.2 - 0.19) `remote_tp_size // total_num_kv_heads >= 1`,
    TransferTopology (0.20+) strict `remote_tp_size > total_num_kv_heads`. MLA is each caller's own business."""
    return p_tp > heads if strict else p_tp // heads >= 1


def p_replicated(p_tp: int, heads: int, mla: bool) -> bool:
    """Whether several P ranks hold the same KV (the corrected model's rule): MLA, or P TP > the model's KV heads
    (the newest vLLM's strict test: at P TP == heads each P rank holds its own head)."""
    return mla or topology_replicated(p_tp, heads, strict=True)


def divisible(d_tp: int, p_tp: int) -> bool:
    """The TP sizes the corrected model supports: one a multiple of the other."""
    return max(d_tp, p_tp) % min(d_tp, p_tp) == 0


def corrected_reads(d_rank: int, d_tp: int, p_tp: int, heads: int, mla: bool) -> list[int]:
    """The P ranks D rank `d_rank` handshakes and reads under the corrected model, in order."""
    if d_tp >= p_tp:
        return [d_rank // max(1, d_tp // p_tp)]
    ratio = p_tp // d_tp
    first = d_rank * ratio
    # One P rank per distinct head group inside this D rank's share: P ranks holding the same head repeat
    # every p_tp // heads ranks; MLA's latent is whole on every rank.
    step = ratio if mla else min(ratio, max(1, p_tp // heads))
    return list(range(first, first + ratio, step))


def corrected_remote_block_len(d_block_len: int, d_tp: int, p_tp: int, heads: int, mla: bool) -> int:
    """The P block length the corrected model accepts: D's block scaled by the heads per rank on each side
    (0.34's SPLIT rule `local_len * remote_heads // local_heads`, which also gives equality when replicated)."""
    if mla:
        return d_block_len
    return d_block_len * rank_heads(p_tp, heads, mla) // rank_heads(d_tp, heads, mla)


def head_offset(d_rank: int, d_tp: int, p_tp: int, heads: int, mla: bool) -> int:
    """With D TP >= P TP: how many heads into its P rank's block D rank `d_rank`'s first head sits."""
    if mla or d_tp < p_tp:
        return 0
    return (d_rank * heads // d_tp) % rank_heads(p_tp, heads, mla)


def release_targets(flow: str, d_rank: int, d_tp: int, p_tp: int) -> list[int]:
    """The P ranks a release's flow handshakes, in order (base.Flow). p_tp is P's TP as the release learns it.
    ZeroDivisionError where the release itself divides by a zero tp_ratio (0.9.1 - 0.13 with P TP > D TP).

    same_rank (0.9.0): the rank of its own number. rank0_then_target (0.9.1): P rank 0 first, then the target.
    target_only (0.9.2 - 0.13): the target `tp_rank // tp_ratio`. all_targets (0.14+): every P rank whose heads
    this D rank holds, MLA and replicated KV included (they read only the first, see rules.prep_targets)."""
    if flow == "same_rank":
        return [d_rank]
    if flow == "corrected":
        raise ValueError("the corrected model's reads depend on the heads: use corrected_reads")
    if d_tp >= p_tp or flow != "all_targets":
        target = d_rank // (d_tp // p_tp)
        return ([0] if target == 0 else [0, target]) if flow == "rank0_then_target" else [target]
    ratio = p_tp // d_tp
    return list(range(d_rank * ratio, (d_rank + 1) * ratio))


def release_reads(flow: str, d_rank: int, d_tp: int, p_tp: int, mla: bool) -> list[int]:
    """The P ranks whose blocks a release's D rank reads, of those it handshakes: the target (up to 0.13, the
    last rank handshaken); every P rank of the group (0.14+ with P TP > D TP), only the first for MLA, whose
    latent is whole on each (the others get a notification only)."""
    tg = release_targets(flow, d_rank, d_tp, p_tp)
    if flow != "all_targets":
        return tg[-1:]
    return tg[:1] if mla else tg
