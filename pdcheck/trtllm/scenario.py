"""TensorRT-LLM scenarios: a TOML file with `framework = "trtllm"`, each instance's layout ([ctx], [gen]), the one
request of a run and the failure injected into it ([request]), the eras to run and the expected verdicts
([expect]). Decoding is the validation: an unknown key or an out-of-range value is bad input, one line naming it.

The scenario flags every framework shares name the sides prefill and decode: --prefill-tp is ctx.tp_size,
--decode-tp gen.tp_size, --block-size tokens_per_block, --layers, --kv-heads, --head-dim, --dtype both sides."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from pdcheck import bounds as b
from pdcheck.errors import BadInput
from pdcheck.scenariofile import decode_error, merge, read_toml
from pdcheck.trtllm.layout import DTYPE_BYTES, Dtype, Side
from pdcheck.verdict import Status

Word = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.+-]+$")]
Tp = Annotated[int, msgspec.Meta(ge=1, le=8)]  # fake ranks are processes on this host
Pp = Annotated[int, msgspec.Meta(ge=1, le=4)]
# One failure injected into the request (docs/trtllm.md, "Failure classes"):
# info_silent: the ctx's RankInfoServer reads REQUEST_INSTANCE_INFO and never answers (T21);
# ctx_dies: every ctx rank is SIGKILLed once it registered the gen and stored its REQUEST_DATA (T65, T66);
# completion_lost: the ctx WRITEs, then its KV_AGENT_RESULT frame (C++: the NotificationSyncInfo) is lost
#   (trtllm#17665, T26, T61);
# unknown_type: another gen of the W1a variant registers first with b"REQUEST_RANK_INFO" (T10, T43-T45);
# block_id_oob: the gen's request names a block id past its pool (no bound check on the ctx, T74).
Fault = Literal["none", "info_silent", "ctx_dies", "completion_lost", "unknown_type", "block_id_oob"]
Agent = Literal["py", "cpp"]  # what transfer_engine_info carries: the raw NIXL blob or AgentDesc (T41)


class TrtInstance(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tp_size: Tp = 1
    pp_size: Pp = 1
    layers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    layer_num_per_pp: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=64)]], msgspec.Meta(max_length=4)] = []
    kv_heads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    head_dim: Annotated[int, msgspec.Meta(ge=8, le=512)] = 64
    dtype: Dtype = "float16"
    tokens_per_block: Annotated[int, msgspec.Meta(ge=1, le=128)] = 16
    num_blocks: Annotated[int, msgspec.Meta(ge=4, le=1024)] = 16
    mla: bool = False
    agent: Agent = "py"
    trtllm: Word | None = None  # this side's own era (a cross-era pair: a W2b ctx and a W3 gen)
    # gen: the configured cache_transceiver_config.kv_transfer_timeout_ms (default: the era's default)
    kv_transfer_timeout_ms: Annotated[int, msgspec.Meta(ge=1, le=3_600_000)] | None = None

    def side(self) -> Side:
        return Side(tp_size=self.tp_size, pp_size=self.pp_size, layers=self.layers,
                    layer_num_per_pp=tuple(self.layer_num_per_pp), kv_heads=self.kv_heads, head_dim=self.head_dim,
                    dtype=self.dtype, tokens_per_block=self.tokens_per_block, num_blocks=self.num_blocks,
                    mla=self.mla)


class TrtRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 40
    seed: Annotated[int, msgspec.Meta(ge=0, le=b.MAX_SEED)] = 0
    fault: Fault = "none"


class TrtScenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    framework: Literal["trtllm"] = "trtllm"
    name: Annotated[str, msgspec.Meta(max_length=256)] = "cli"
    description: Annotated[str, msgspec.Meta(max_length=16384)] = ""
    issue: Annotated[str, msgspec.Meta(max_length=256)] = ""
    trtllm: Annotated[list[Word], msgspec.Meta(max_length=b.MAX_RELEASES)] = msgspec.field(
        default_factory=lambda: ["W3"])
    ctx: TrtInstance = msgspec.field(default_factory=TrtInstance)
    gen: TrtInstance = msgspec.field(default_factory=TrtInstance)
    request: TrtRequest = msgspec.field(default_factory=TrtRequest)
    expect: Annotated[dict[Word, Status | list[Status]], msgspec.Meta(max_length=b.MAX_RELEASES)] = msgspec.field(
        default_factory=dict)
    source: str = ""


# The shared scenario flags' keys (pdcheck.cliopts) as this scenario names them.
_KEYS = {"tp_size": "tp_size", "block_size": "tokens_per_block", "layers": "layers", "kv_heads": "kv_heads",
         "head_dim": "head_dim", "dtype": "dtype", "num_blocks": "num_blocks"}
_SIDES = {"prefill": "ctx", "decode": "gen"}


def overrides_of(flags: dict[str, Any]) -> dict[str, Any]:
    """The command's overrides ({prefill: {...}, decode: {...}}, cliopts' keys) as [ctx] / [gen] keys."""
    out: dict[str, Any] = {}
    for side, keys in flags.items():
        if side in _SIDES and isinstance(keys, dict):
            out[_SIDES[side]] = {_KEYS.get(k, k): v for k, v in keys.items()}
    return out


def load(path: Path | None, overrides: dict[str, Any] | None = None) -> TrtScenario:
    doc = read_toml(path) if path is not None else {"framework": "trtllm"}
    where = str(path) if path is not None else "command line"
    if doc.get("framework") != "trtllm":
        raise BadInput(f"{where}: not a TensorRT-LLM scenario (it has no framework = \"trtllm\")")
    if overrides:
        doc = merge(doc, overrides_of(overrides))
    try:
        sc = msgspec.convert(doc, TrtScenario)
    except msgspec.ValidationError as exc:
        raise BadInput(f"{where}: {decode_error(exc, doc, TrtScenario)}") from None
    for name, inst in (("ctx", sc.ctx), ("gen", sc.gen)):
        _check_side(where, name, inst)
    return msgspec.structs.replace(sc, source=where)


def _check_side(where: str, name: str, inst: TrtInstance) -> None:
    if not inst.mla and inst.kv_heads % inst.tp_size and inst.tp_size % inst.kv_heads:
        raise BadInput(f"{where}: {name}: kv_heads {inst.kv_heads} and tp_size {inst.tp_size}: one must divide "
                       "the other")
    if inst.layer_num_per_pp and (len(inst.layer_num_per_pp) != inst.pp_size
                                  or sum(inst.layer_num_per_pp) != inst.layers):
        raise BadInput(f"{where}: {name}.layer_num_per_pp: {inst.layer_num_per_pp} is not one count per PP rank "
                       f"({inst.pp_size}) summing to layers ({inst.layers})")
    if inst.layers < inst.pp_size:
        raise BadInput(f"{where}: {name}: layers {inst.layers} < pp_size {inst.pp_size}")
    if inst.head_dim * DTYPE_BYTES[inst.dtype] % 16:
        # the coordinate pattern tags 16-byte cells; a (token, head) row must hold whole cells
        raise BadInput(f"{where}: {name}.head_dim: {inst.head_dim} x {DTYPE_BYTES[inst.dtype]} bytes is not a "
                       "multiple of 16 (pdcheck's coordinate cells)")
    if name == "ctx" and inst.kv_transfer_timeout_ms is not None:
        raise BadInput(f"{where}: ctx.kv_transfer_timeout_ms: the timeout is the gen's wait; set it in [gen]")
