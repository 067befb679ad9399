"""What a TensorRT-LLM line model is: data (runtime, wire era, which checks run where, what a listener does with a
frame it cannot handle, the default transfer timeout, how the release is dated) and the exact texts TensorRT-LLM
logs or raises (docs/trtllm-protocol.md §7). One small file per era fills the struct (eras/e*.py, eras/w*.py);
pdcheck/trtllm/eras/__init__.py maps releases to them."""

from __future__ import annotations

from typing import Literal

import msgspec

Runtime = Literal["cpp", "python"]
# The ctx's Sender listener on an unknown message type or a handler exception (T43-T45): its thread ends (W1a),
# ZMQMessenger@65b31db1 stops the listener (W1b, see T44), or the handler logs and the loop goes on (W2b, W3).
Listener = Literal["dies", "stops", "logs"]
# Which compatibility checks the ctx runs on a registering gen: PeerRegistrar (T67), AttentionPolicy (T68), the
# C++ CacheFormatter::inquireSupport on both sides (T64), or pdcheck's corrected gate on the gen (every field).
Checks = Literal["registrar", "attention", "inquire", "corrected"]


class TrtLine(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # what the user types and reports show: "E3", "W1b", "corrected"
    era: str  # the release era it belongs to: "E3", "E4 (opt-in Python)", "E5"
    releases: str  # the releases of that era, as users read them
    runtime: Runtime
    wire: str  # "cpp" | "W1a" | "W1b" | "W2a" | "W2b" | "W3" | "corrected" (pdcheck/trtllm/wire.py)
    checks: Checks
    listener: Listener = "logs"
    # kv_transfer_timeout_ms's default: None, no deadline (the request waits forever); trtllm#12249 made it
    # 60000 (merged 2026-03-18, T5). The REQUEST_INSTANCE_INFO reply has no timeout in any era (T21, T65).
    transfer_timeout_ms: int | None = None
    timeout_source: str = ""
    # W3's gen-side gate (T70): MambaPolicy.validate_peer_compatible (recurrent state, T79; pdcheck's pools are
    # attention-only) and AttentionPolicy.validate_peer_compatible, found in no stored version: the attention
    # fields it compares are not established, so it fires on none of them here.
    gate: bool = False
    layer_count_rejects: bool = True  # T67 rejects a total layer count difference; T68's newest only warns
    dated: str = ""  # how its releases are attributed (dates, docs), never a wheel (T3, T8)
    summary: str = ""
    facts: tuple[str, ...] = ()


# ---- Python ctx side, at REGISTER_RANK_INFO (T67: W1 PeerRegistrar) --------------------------------------------
REGISTRAR = {
    "is_mla": "PeerRegistrar: compatibility check failed: 'is_mla' differs (local={a}, peer={b}).",
    "element_bytes": "PeerRegistrar: element size mismatch (local={a} bytes, peer={b} bytes).",
    "tokens_per_block": "PeerRegistrar: tokens_per_block mismatch (local={a}, peer={b}).",
    "dims_per_head": "PeerRegistrar: dims_per_head mismatch (local={a}, peer={b}).",
    "layers": "PeerRegistrar: total layer count mismatch (local={a}, peer={b}).",
    "mla_heads": "PeerRegistrar: MLA mode requires exactly 1 KV head per rank for both local and peer. "
                 "(local={a}, peer={b})",
}
REGISTER_RAISES = "PeerRegistrar.register: peer {name} (rank={rank}) is incompatible with local rank."

# ---- W2b/W3 AttentionPolicy.check_peer_compatible (T68), kv pairs formatted with repr ---------------------------
ATTENTION = {
    "is_mla": "is_mla mismatch",
    "element_bytes": "element_bytes mismatch",
    "tokens_per_block": "tokens_per_block mismatch",
    "dims_per_head": "dims_per_head mismatch",
    "mla_heads": "MLA requires kv_heads_per_rank == 1 for both ranks",
}
LAYERS_DIFFER = "PeerRegistrar: layer count differs (local={a}, peer={b}), allowing partial layer transfer."


def attention_text(field: str, a: object, b: object) -> str:
    reason = ATTENTION[field]
    pairs = (f"field={field!r}, " if reason.endswith("mismatch") else "") + f"local={a!r}, peer={b!r}"
    return f"AttentionPolicy: incompatible: {reason}; {pairs}"


# ---- what a listener logs (T43-T45, T23, T24) ------------------------------------------------------------------
SENDER_ERROR = "Sender: error handling {type}: {error}"
W1A_UNKNOWN = "transceiver sender loop received unknown message type: {type}"  # ValueError, the thread ends
UNKNOWN = "Sender received unknown message type: {type!r}"
MESSENGER_STOPS = "Error in listener: {error}"  # ZMQMessenger@65b31db1: logged, then the listener stops (T44)
RESULT_FAILED = ("KV transfer failed for request {rid} slice={slice} peer_rank={peer} is_last_slice={last} "
                 "(reported by remote agent; see sender-side log for nixl_status)")
AGENT_FAILED = "KV transfer agent failed: unique_rid={rid} slice={slice} peer_rank={peer} nixl_status={status}"

# ---- the W3 gen-side gate (T70) and the executor's deadline (T66) -------------------------------------------
PEER_INCOMPATIBLE = ("context peer at '{endpoint}' is incompatible: {error} (cached: all further requests to this "
                     "context peer fail fast; restart this generation worker to re-validate, e.g. after redeploying "
                     "a compatible server on the same endpoint)")
TIMEOUT_CANCEL = "Terminating generation request {rid} due to KV cache transfer timeout"

# ---- C++ CacheFormatter::inquireSupport (T64) and what each side does with a refusal (T61, T62) -------------
INQUIRE = "CacheFormatter::inquireSupport: "
INQUIRE_TEXTS = {
    "dtype": "selfConfig.getDataType() != destConfig.getDataType()",
    "self_heads": "only support equal number of heads per layer",
    "attention_type": "only support same attention type",
    "kv_factor": "only support same kv factor",
    "mla": "only support non-MLA",
    "dest_heads": "only support same number of heads per layer",
    "tokens_per_block": "only support same tokens per block and size per head",
    "layers": "incompatible total layer counts: self={a}, dest={b}",
    "pp_divisible": "layers must be divisible by pipeline parallelism",
}
GEN_REFUSES = "Disagg server does not currently support these cacheState."
CTX_REFUSES = ("Disagg server does not currently support these cacheState, please check the cacheState of the "
               "context and gen executors")
CTX_THREAD_ENDS = "Exception in CacheSender response: {error}"
