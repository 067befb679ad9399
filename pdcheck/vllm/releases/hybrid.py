"""What each release does with a hybrid model's KV-cache groups: sliding-window and Mamba/SSM groups
beside full attention. Read from the release wheels (0.9.2, 0.11.1, 0.14.0 - 0.26.0 each minor, 0.34.0); the one
home of these per-release facts: the engine asks it for start-up and handshake refusals, the transfer proof for
the blocks of each group a D rank reads, hazards and the compatibility hash for is_hma_enabled.

The hybrid KV cache manager (HMA) with NixlConnector, per release (vllm/config):
- up to 0.13: any --kv-transfer-config turns it off, whatever the flag says;
- 0.14 - 0.17: off by default with a connector; --no-disable-hybrid-kv-cache-manager is refused at start-up by the
  connector factory (NixlConnector is not SupportsHMA);
- 0.18 - 0.21: NixlConnector is SupportsHMA, but any connector still turns the manager off by default; an explicit
  --no-disable-hybrid-kv-cache-manager turns it on (the factory accepts it);
- 0.22+: config asks the connector (supports_hma), so it stays on unless --disable-hybrid-kv-cache-manager.
With it off, unify_hybrid_kv_cache_specs turns sliding-window layers into full attention (every block of every
layer is kept and transferred: correct, no memory saved); Mamba/SSM layers cannot be converted: 0.9.1 - 0.26
raise "Hybrid KV cache manager is disabled but failed to convert ..." at start-up (dynamo #10741), 0.27+ no longer
raise there and the NIXL worker's `assert self._is_hma_required` stops it instead; 0.9.0's V1 has no Mamba at all.
With it on (0.18+): P clips each sliding-window group's blocks to its window (get_sw_clipped_blocks:
cdiv(window, block_size) + 1 blocks), a Mamba group is one whole state page per request, full-attention groups
send every block.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcheck.geometry import Geometry
from pdcheck.releaseline import is_corrected
from pdcheck.vllm.releases.base import ReleaseModel

# v1/core/kv_cache_utils.py unify_hybrid_kv_cache_specs, 0.9.1 - 0.26.0 (dynamo #10741)
MSG_UNIFY = ("ValueError: Hybrid KV cache manager is disabled but failed to convert the KV cache specs to one "
             "unified type.")
# 0.9.0's V1 engine has no Mamba KV cache (no MambaSpec, no unify refusal): engine/arg_utils.py turns a model that
# is not is_v1_compatible away under VLLM_USE_V1=1 (without it, the V0 fallback has no NixlConnector)
MSG_NO_V1_MAMBA = "NotImplementedError: VLLM_USE_V1=1 is not supported with the model's architectures (no V1 Mamba)."
# kv_connector/factory.py, 0.14.0 (0.11.1 has the check too, but its config forces HMA off before it runs)
MSG_NOT_HMA = ("ValueError: Connector NixlConnector does not support HMA but HMA is enabled. Please set "
               "`--disable-hybrid-kv-cache-manager`.")
# the worker's __init__, a bare assert present from 0.18.0; 0.27+ reach it (0.9.1 - 0.26 raise MSG_UNIFY first: the
# unify refusal is gone from v1/core in the 0.27.0 - 0.34.0 wheels)
MSG_HMA_REQUIRED = "AssertionError: assert self._is_hma_required (Mamba layers with the hybrid manager off)"
# the worker's __init__ with Mamba layers: read in 0.20.0 - 0.26.0 and 0.34.0, absent from 0.18.0 and 0.19.0
MSG_DS_LAYOUT = ("AssertionError: 3-read Mamba conv transfer requires DS conv state layout. Set "
                 "VLLM_SSM_CONV_STATE_LAYOUT=DS")
# the worker's _validate_remote_agent_handshake, `if self._is_hma_required: assert block_size_ratio == 1`: read in
# 0.18.0 and 0.19.0 (nixl_connector.py), 0.20.0 - 0.23.0 (nixl/worker.py), 0.24.0 - 0.26.0 (nixl/base_worker.py);
# absent from 0.17.0 (no HMA path) and from 0.27.0 on (read in 0.27.0 - 0.34.0: transfers at remote-block
# granularity instead)
MSG_HMA_BLOCK_SIZE = "HMA does not support different remote block size yet"
# the engine's warning when it converts sliding-window layers (every release that unifies)
MSG_UNIFIED = ("Hybrid KV cache manager is disabled for this hybrid model, This means we do not enable any "
               "optimizations for saving KV cache memory (e.g., dropping the KV cache outside the sliding window).")

START_UP = "hybrid_startup"  # the check id of a start-up refusal (shapes.when_raised reports it at start-up)


def supports_hma(rel: ReleaseModel) -> bool:
    """NixlConnector is SupportsHMA: 0.18+ (read: `class NixlConnector(KVConnectorBase_V1, SupportsHMA)` in 0.18.0,
    not in 0.17.0)."""
    return is_corrected(rel) or rel.number >= (0, 18)


def hma_enabled(rel: ReleaseModel, g: Geometry) -> bool:
    """The deployment's `not disable_hybrid_kv_cache_manager` with NixlConnector (is_hma_enabled in the hash)."""
    if not supports_hma(rel):
        return False  # forced off (up to 0.13), or off with an explicit enable refused at start-up (0.14 - 0.17)
    if g.hma is None:  # no flag: the release's default with a connector (off 0.18 - 0.21, on 0.22+)
        return is_corrected(rel) or rel.is_hma_enabled
    return g.hma


def hma_required(rel: ReleaseModel, g: Geometry) -> bool:
    """NIXL's _is_hma_required: the manager is on and some group is not full attention."""
    return hma_enabled(rel, g) and g.hybrid


def startup_refusal(rel: ReleaseModel, g: Geometry) -> str | None:
    """What the release raises while an instance of geometry `g` starts (before it serves), or None."""
    if g.hma is True and not supports_hma(rel) and rel.number >= (0, 14):
        return MSG_NOT_HMA
    if not g.has_mamba:
        return None
    if not hma_enabled(rel, g):
        # corrected too: Mamba state cannot live in a unified full-attention pool, so it refuses as 0.26 does
        if rel.number < (0, 9, 1):
            return MSG_NO_V1_MAMBA
        return MSG_HMA_REQUIRED if (0, 27) <= rel.number < (99,) else MSG_UNIFY
    if (0, 20) <= rel.number < (99,) and g.ssm_conv_layout != "DS":  # 0.18 - 0.19 have no 3-read conv transfer
        return MSG_DS_LAYOUT
    return None


def handshake_refusal(rel: ReleaseModel, local: Geometry, remote_block_size: int | None) -> str | None:
    """A refusal at the handshake (so on the first request): 0.18 - 0.26 assert equal block sizes with HMA."""
    if remote_block_size is None or remote_block_size == local.block_size or is_corrected(rel):
        return None
    if hma_required(rel, local) and (0, 18) <= rel.number < (0, 27) and local.block_size % remote_block_size == 0:
        return MSG_HMA_BLOCK_SIZE
    return None


@dataclass(frozen=True)
class GroupRead:
    """The blocks of one group a D rank reads for one request: regions [first, last), and the positions in the
    request's block list (the last `count` blocks, or all of them when count is None)."""

    group: int
    first: int
    last: int
    count: int | None


def sw_blocks(window: int, block_size: int) -> int:
    """get_sw_clipped_blocks' blocks of a sliding-window group: cdiv(window, block_size) + 1."""
    return -(-window // block_size) + 1


def group_reads(rel: ReleaseModel, g: Geometry) -> list[GroupRead]:
    """Which regions and which of a request's blocks a D rank of `rel` reads, group by group. Without groups, or
    with the hybrid manager off (sliding window unified to full attention), every block of every region."""
    spans = g.group_regions()
    if not g.groups or not hma_required(rel, g):
        return [GroupRead(0, 0, g.num_regions, None)]
    out = []
    for i, (gr, (a, z)) in enumerate(zip(g.groups, spans, strict=True)):
        count = {"full": None, "sliding_window": sw_blocks(gr.window, g.block_size), "mamba": 1}[gr.kind]
        out.append(GroupRead(i, a, z, count))
    return out


def effects(rel: ReleaseModel, p: Geometry, d: Geometry) -> list[str]:
    """What `rel` does with these groups, one line each (hazard H30's text)."""
    if not (p.groups or d.groups or p.hma is not None or d.hma is not None):
        return []
    out: list[str] = []
    why = {side: w for side, g in (("prefill", p), ("decode", d)) if (w := startup_refusal(rel, g))}
    if why:
        if len(set(why.values())) == 1:
            return [f"{' and '.join(why)} refuse{'s' if len(why) == 1 else ''} at start-up: "
                    f"{next(iter(why.values()))}"]
        return [f"{side} refuses at start-up: {w}" for side, w in why.items()]
    if "is_hma_enabled" in rel.hash_factors and hma_enabled(rel, p) != hma_enabled(rel, d):
        out.append(f"is_hma_enabled {hma_enabled(rel, p)} (prefill) vs {hma_enabled(rel, d)} (decode) is a hash "
                   "factor: 'RuntimeError: NIXL compatibility hash mismatch' at the handshake (first request)")
    if d.groups and d.hybrid:
        if not hma_enabled(rel, d):
            out.append("hybrid KV cache manager off: sliding-window layers are unified to full attention (every "
                       "block of every layer is kept and read: correct, no KV memory saved)")
        else:
            parts = []
            for r in group_reads(rel, d):
                gr = d.groups[r.group]
                what = ("every block" if r.count is None else
                        "its whole state page" if gr.kind == "mamba" else f"its last {r.count} blocks")
                parts.append(f"group {r.group} ({gr.kind}, regions {r.first}-{r.last - 1}) {what}")
            out.append("hybrid KV cache manager on: D reads " + "; ".join(parts))
    bs = handshake_refusal(rel, d, p.block_size)
    if bs:
        out.append(f"block size {p.block_size} (prefill) vs {d.block_size} (decode) with HMA: the first request "
                   f"asserts '{bs}'")
    return out
