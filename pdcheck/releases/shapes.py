"""What each release does with deployment shapes beyond one TP group: pipeline parallel, a block size
that differs between P and D, fp8 KV caches. Read from the release wheels (0.9.2, 0.11.1, 0.14.0, 0.26.0,
0.34.0); the one home of these per-release facts: pdcheck.hazards phrases them, the tests check them.

Data parallel needs no rule here: the port of each DP rank is ports.layout_base, the engine id ports.dp_engine_id,
and what a D does when the wrong engine answers is the release's own engine-id check (rules.engine_id_matches).
"""

from __future__ import annotations

from pdcheck.releaseline import is_corrected
from pdcheck.releases.base import ReleaseModel

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


def pp_effect(rel: ReleaseModel, p_pp: int, d_pp: int, hybrid: bool = False) -> str:
    """What `rel` does with pipeline parallel stages on either side (full attention unless `hybrid`)."""
    if rel.wire < "H":
        # 0.14.0 engine core: `content.update(worker_dict)` over every worker's {tp_rank: metadata}
        return ("no pp_rank on the wire (requests name a TP rank only): the engine core merges its workers' "
                "{tp_rank: metadata} dicts, so one PP stage's metadata per TP rank is served and D registers that "
                "stage's layers only; pdcheck gives no rank verdict for it yet")
    if d_pp > 1:
        return f"decode refuses at start-up: {MSG_PP_DECODE}"
    if hybrid:
        return f"prefill refuses at start-up: {MSG_PP_HMA_0_34 if rel.number >= (0, 34) else MSG_PP_HMA_0_26}"
    return (f"requests carry (pp_rank, tp_rank) and NixlConnector serves every stage's metadata (it overrides "
            f"set_xfer_handshake_metadata_pp_aware), so its handshake passes; pull D reads kv_transfer_params "
            f"pp_size (default 1). The connector base class refuses with '{MSG_PP_VALUE_ERROR.format(cls='<X>')}' "
            f"only in connectors without that override (vLLM #52913)")


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
