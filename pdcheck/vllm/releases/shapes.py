"""What each release does with deployment shapes beyond one TP group: pipeline parallel, a block size
that differs between P and D, fp8 KV caches. Read from the release wheels (0.9.2, 0.11.1, 0.14.0, 0.26.0,
0.34.0); the one home of these per-release facts: pdcheck.vllm.hazards phrases them, the tests check them.

Data parallel needs no rule here: the port of each DP rank is ports.layout_base, the engine id ports.dp_engine_id,
and what a D does when the wrong engine answers is the release's own engine-id check (rules.engine_id_matches).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdcheck.geometry import Geometry
from pdcheck.releaseline import is_corrected
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.releases.params import pull_keys
from pdcheck.vllm.wire import AnyMeta

# The handshake runs on a request's first load (start_load_kv / the handshake executor), never at start-up: a
# refusal there leaves the server healthy and fails that request, then the next one the same way.
PER_REQUEST = ("passes start-up (the server reports healthy: the handshake runs on the first request); the first "
               "request {what}, and every later request to that P fails the same way")

# base.py of the KV connectors (0.26.0, 0.34.0): raised by set_xfer_handshake_metadata_pp_aware of a connector that
# does not override it; NixlConnector overrides it (serves every PP stage's metadata), so it is not raised there.
MSG_PP_VALUE_ERROR = ("ValueError: {cls} received pp_rank > 0 handshake metadata but does not support "
                      "PP-disaggregated KV transfer.")
# base_worker.py __init__, both 0.26.0 and 0.34.0 (pull and push workers share it)
MSG_PP_DECODE = ("NotImplementedError: NixlPushConnector consumer (decode) does not support "
                 "pipeline_parallel_size > 1.")
MSG_PP_HMA_0_26 = ("NotImplementedError: NixlPushConnector does not support pipeline_parallel_size > 1 with hybrid KV "
                   "cache layouts (HMA) yet.")
MSG_PP_HMA_0_34 = ("NotImplementedError: NixlConnector (pull) does not support pipeline_parallel_size > 1 with "
                   "hybrid KV cache layouts (HMA); use NixlPushConnector for PP + HMA.")


def _has(rel: ReleaseModel, check_id: str) -> bool:
    return any(s.id == check_id for s in (*rel.pre_flow, *rel.pre_add, *rel.add_remote))


# ---- pipeline parallel on the prefill side (docs/release-models.md, "Pipeline parallel") ---------------------
# Who serves which stage's metadata, per wire era (read in the wheels 0.9.1 - 0.34.0):
# * A - E (0.9.0 - 0.11.0): every worker runs its own listener on base_port + tp_rank; the workers of one TP rank
#   in several stages share that port on one node, so one stage answers (pdcheck serves stage 0).
# * F - G (0.11.1 - 0.25): the engine core merges the workers' {tp_rank: metadata} with `content.update(...)` in
#   worker order (pp_rank * tp_size + tp_rank): the last stage overwrites the others, D gets its layers.
# * H (0.26+): the scheduler keeps encoded_data[(pp_rank, tp_rank)] for every stage; D asks
#   (GET_META_MSG, pp_rank, tp_rank) for each pp_rank in range(remote_pp_size), stage-major, where
#   remote_pp_size = kv_transfer_params.get("pp_size", 1); pull P puts pp_size in its params from 0.29
#   (releases.params), so 0.26 - 0.28 ask stage 0 only.
PP_STAGES_KEYED = "H"  # the first era whose listener keys metadata by (pp_rank, tp_rank)
MSG_PP_LAYERS = "Number of KV layers must match between prefill and decode"  # 0.24 - 0.34 assert
LAYER_COUNT_CHECKS = ("layers_held", "num_kv_layers", "kv_caches_base_addr_len")  # what one stage's metadata trips


def pp_layers(layers: int, pp_size: int, stage: int) -> tuple[int, int]:
    """[first, end) layer of `stage` (vLLM's get_pp_indices without VLLM_PP_LAYER_PARTITION): an even split, the
    remainder spread over the stages before the last."""
    parts = [layers // pp_size] * pp_size
    for i in range(2, layers % pp_size + 2):
        parts[-i] += 1
    first = sum(parts[:stage])
    return first, first + parts[stage]


def stage_regions(g: Geometry, pp_size: int, stage: int) -> list[int]:
    """The registered regions a P worker of `stage` holds: those of its layers, in registration order."""
    total = sum(gr.layers for gr in g.groups) if g.groups else g.layers
    first, end = pp_layers(total, pp_size, stage)
    return [r for r in range(g.num_regions) if first <= g.region_layer(r) < end]


def stage_metadata(meta: AnyMeta, g: Geometry, pp_size: int, stage: int) -> AnyMeta:
    """What P's worker of `stage` advertises: `meta` (every layer) cut to that stage's regions."""
    if pp_size <= 1:
        return meta
    keep = stage_regions(g, pp_size, stage)

    def cut(values: Sequence | None) -> list | None:
        return None if values is None else [values[i] for i in keep]

    return msgspec.structs.replace(
        meta, kv_caches_base_addr=cut(meta.kv_caches_base_addr) or [], block_lens=cut(meta.block_lens),
        block_strides=cut(meta.block_strides), region_names=cut(meta.region_names),
        region_members=cut(meta.region_members), region_group_ids=cut(meta.region_group_ids))


def merge_stages(metas: Sequence[AnyMeta]) -> AnyMeta:
    """The corrected D's view of a P with several stages: every stage's regions, stage by stage."""
    if len(metas) == 1:
        return metas[0]

    def cat(name: str) -> list | None:
        parts = [getattr(x, name) for x in metas]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]

    return msgspec.structs.replace(
        metas[0], kv_caches_base_addr=cat("kv_caches_base_addr") or [], block_lens=cat("block_lens"),
        block_strides=cat("block_strides"), region_names=cat("region_names"),
        region_members=cat("region_members"), region_group_ids=cat("region_group_ids"))


def served_stage(wire: str, pp_size: int) -> int:
    """The stage whose metadata a listener of era `wire` serves for a TP rank where it serves one per rank
    (before era H); from era H every stage is served under its own key."""
    return pp_size - 1 if wire >= "F" else 0


PP_STAGES_CHECK = "pp_stages_served"  # the corrected D's check that P serves every stage it must read


def stages_unreachable(wire: str, p_pp: int) -> str | None:
    """The corrected D's refusal where P's side channel cannot give it every stage's metadata: before era H a
    request names a TP rank only and each port answers with one stage (served_stage), so asking again returns
    the same stage and the other stages' layers stay out of reach. None: one stage, or every stage is served."""
    if p_pp <= 1 or wire >= PP_STAGES_KEYED:
        return None
    return (f"refused: P has {p_pp} pipeline stages, but its side channel (era {wire}) serves one stage per port "
            f"(a request names a TP rank only; stage {served_stage(wire, p_pp)} answers every one): the corrected D "
            "cannot read every stage's layers")


def params_pp_size(rel: ReleaseModel, p_pp: int) -> int | None:
    """kv_transfer_params["pp_size"] as pull P sends it, or None where P's params carry no pp_size."""
    return p_pp if "pp_size" in pull_keys(rel.number) else None


def asked_stages(rel: ReleaseModel, p_pp: int) -> list[int]:
    """The P stages a pull D of `rel` asks, per TP rank it handshakes: every stage of remote_pp_size where P's
    params name it (0.29+), stage 0 from 0.26 (the request carries pp_rank 0), and none by number before 0.26
    (the request names a TP rank; P's listener picks the stage, served_stage). The corrected D asks every stage."""
    if is_corrected(rel):
        return list(range(p_pp))
    if rel.wire < PP_STAGES_KEYED:
        return [0]
    return list(range(params_pp_size(rel, p_pp) or 1))


def answered_stage(wire: str, asked: int, p_pp: int) -> int:
    """The P stage whose metadata answers a request of era `wire` that asked for stage `asked`."""
    return asked if wire >= PP_STAGES_KEYED else served_stage(wire, p_pp)


def layer_check(rel: ReleaseModel) -> str | None:
    """The first check of `rel` that one stage's metadata (part of D's layers) trips; None: the release has none."""
    return next((c for c in LAYER_COUNT_CHECKS if _has(rel, c)), None)


_LAYER_REFUSAL = {
    "layers_held": "'RuntimeError: Engine <P> does not hold the KV layers [...]' (the other stages' layers)",
    "num_kv_layers": f"'AssertionError: {MSG_PP_LAYERS}'",
    "kv_caches_base_addr_len": "'AssertionError' on len(nixl_agent_meta.kv_caches_base_addr) == "
                               "len(self.block_len_per_layer)",
}


def pp_effect(rel: ReleaseModel, p_pp: int, d_pp: int, hybrid: bool = False) -> str:
    """What `rel` does with pipeline parallel stages on either side (full attention unless `hybrid`). With
    stages on P only, the rank verdict comes from the release's own layer check on the stage D receives
    (layer_check), so this line and the run agree."""
    if rel.wire >= PP_STAGES_KEYED and d_pp > 1:
        return f"decode refuses at start-up: {MSG_PP_DECODE}"
    if rel.wire >= PP_STAGES_KEYED and hybrid:
        return f"prefill refuses at start-up: {MSG_PP_HMA_0_34 if rel.number >= (0, 34) else MSG_PP_HMA_0_26}"
    if d_pp > 1:
        return ("decode pipeline stages before 0.26: requests name a TP rank only; pdcheck gives no rank verdict "
                "for D stages yet")
    if p_pp <= 1:
        return "one stage on each side"
    if rel.wire < "F":
        got = ("every worker listens on base_port + tp_rank itself: the stages of one TP rank share that port and "
               "one answers (stage 0 here)")
    elif rel.wire < PP_STAGES_KEYED:
        got = ("the engine core merges its workers' {tp_rank: metadata} dicts in worker order: the last stage "
               f"(pp_rank {p_pp - 1}) is what every TP rank serves")
    else:
        pp = params_pp_size(rel, p_pp)
        sent = (f"kv_transfer_params carry pp_size {pp}: D asks (pp_rank, tp_rank) for every stage, stage 0 first"
                if pp else "kv_transfer_params carry no pp_size: D asks stage (0, tp_rank) only")
        got = (f"P serves every stage's metadata under (pp_rank, tp_rank) (NixlConnector overrides "
               f"set_xfer_handshake_metadata_pp_aware); {sent}")
    check = layer_check(rel)
    what = (_LAYER_REFUSAL[check] if check else "no layer-count check: D takes one stage's regions for all its "
            "layers and its first READ fails in NIXL (remote index out of range)")
    return f"{got}; one stage holds part of D's layers: {what} (vLLM #52913)"


def block_size_effect(rel: ReleaseModel, p_bs: int, d_bs: int) -> str | None:
    """A P block size != D block size in the releases that advertise block_size (era F, 0.11.1, on); None for
    the earlier ones (block_size is not on the wire: hazards' block-length reading applies)."""
    if rel.wire < "F":
        return None
    if _has(rel, "block_size_le") and p_bs > d_bs:  # 0.11.1-0.13: before add_remote_agent, so it fires first
        return PER_REQUEST.format(what="asserts 'AssertionError: nP > nD is not supported yet.'")
    if d_bs % p_bs == 0:
        return (f"supported: D's {d_bs}-token block is {d_bs // p_bs} of P's (P < D, block_size_ratio; "
                "not with a host buffer)")
    if _has(rel, "block_size_ratio"):
        what = (f"asserts 'AssertionError: Local block size {d_bs} is not divisible by remote block size {p_bs} "
                "or vice versa.' (vLLM #42895)")
        return PER_REQUEST.format(what=what)
    return None


def fp8_effects(rel: ReleaseModel, p_dtype: str, d_dtype: str, dynamic: bool) -> list[str]:
    """cache_dtype in the compatibility hash (0.13+), and dynamic fp8 scales that no release transfers."""
    out: list[str] = []
    if p_dtype != d_dtype:
        if "cache_dtype" in rel.hash_factors:
            out.append(f"cache_dtype {p_dtype!r} vs {d_dtype!r} is a hash factor: 'RuntimeError: NIXL compatibility "
                       "hash mismatch' at the handshake (first request)")
        else:
            out.append(f"no hash: cache_dtype {p_dtype!r} vs {d_dtype!r} shows only through the block length")
    if dynamic:
        out.append("dynamic fp8 KV scales stay on P: D reads the quantized blocks and decodes them with its own "
                   "scales: no error, quality loss (vLLM #42179)")
    return out


def backend_layout_effect(rel: ReleaseModel, p_mem: str, d_mem: str, split: bool, mla: bool) -> str:
    """An attention backend that ignores the connector's required layout (vLLM #46204): every release compares
    the advertised layouts only (0.20+'s head-split check too), so the real order of the bytes is never seen."""
    if mla:
        return "MLA: one latent per token, no head order to permute"
    if not split:
        same = "the same backend on both sides" if p_mem == d_mem else f"but P's bytes are {p_mem}, D's {d_mem}"
        return f"whole blocks are copied, {same}: " + ("fine" if p_mem == d_mem else "silent")
    return (f"each D rank reads its head slice as a byte range of P's {p_mem} block: tokens of every head, not its "
            "head; NIXL reports DONE, nothing raises: silent (permuted heads, vLLM #46204)")


START_UP_CHECKS = {"pp_decode", "hybrid_startup"}  # raised while the worker starts, before it serves anything


def when_raised(rel: ReleaseModel, status: str, check: str | None) -> str | None:
    """When a refusal reaches the user: at start-up, or per request after the server reported healthy (the
    handshake runs on a request's first KV load in every release; from era F, 0.11.1, a failed handshake fails
    that request and leaves the server up). None: ok, or an early release whose failure takes the engine down."""
    if status in ("ok", "silent") or is_corrected(rel):  # silent: nothing reaches the user
        return None
    if check in START_UP_CHECKS:
        return "at start-up: the decode worker refuses before it serves"
    if rel.wire >= "F":
        return "per request: passes start-up (healthy), the first request raises it, and every later one to that P"
    return None
