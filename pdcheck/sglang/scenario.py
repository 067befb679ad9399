"""SGLang scenarios: a TOML file with `framework = "sglang"`, an SGLang server's layout per side, the releases
to run and the expected verdicts. Decoding is the validation (unknown keys and out-of-range values are bad
input, one line naming the key)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from pdcheck import bounds as b
from pdcheck.errors import BadInput
from pdcheck.geometry import DTYPE_BYTES
from pdcheck.scenariofile import decode_error, merge, read_toml
from pdcheck.sglang.engine import Side
from pdcheck.verdict import Status

Word = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.+-]+$")]
Small = Annotated[int, msgspec.Meta(ge=1, le=16)]  # fake ranks are processes on this host
# One failure injected into an otherwise healthy run (docs/sglang-protocol.md §11): two live requests share a bootstrap room
# (#40125); D discovers and registers but never sends its TransferInfo (#17845); every P rank is SIGKILLed
# mid-transfer, bootstrap server included (docs/sglang-protocol.md §3.3).
# dp_conflict: the router dispatches each request to another prefill DP rank than room % dp_size (P with
# follow_bootstrap_room, the default; docs/sglang-protocol.md §4).
Fault = Literal["none", "duplicate_room", "no_transfer_info", "kill_prefill", "dp_conflict"]


class SgInstance(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tp_size: Small = 1  # attention TP (per DP group)
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=4)] = 1  # prefill: attention DP groups (--enable-dp-attention)
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=8)] = 1
    page_size: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    kv_cache_dtype: Word = "auto"
    dtype: Word = "bfloat16"
    layers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    kv_heads: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_KV_HEADS)] = 8
    head_dim: Annotated[int, msgspec.Meta(ge=8, le=1024)] = 64
    mla: bool = False
    num_pages: Annotated[int, msgspec.Meta(ge=4, le=4096)] = 64
    # metadata (aux) buffers this server registers: an optional one (--disaggregation-enable-kv-checksum,
    # SGLANG_ENABLE_DISAGG_SAMPLING_MASK, the DSA top-k buffer) on one side only skews the count (docs/sglang-protocol.md §6.2)
    aux_buffers: Annotated[int, msgspec.Meta(ge=1, le=8)] = 1
    # a hybrid model (SWA / NSA / mamba): per-request state in its own pool, besides the paged KV (#18939)
    hybrid: bool = False
    sglang: Word | None = None  # this side's own release (a cross-release pair)
    registered: Annotated[int, msgspec.Meta(ge=0, le=16)] | None = None  # prefill: P ranks that PUT /route
    # decode: its bootstrap address names a port where no server listens (the server lives on P only:
    # ai-dynamo/dynamo#4855, a D given --disaggregation-bootstrap-port)
    no_bootstrap: bool = False

    def side(self) -> Side:
        return Side(tp_size=self.tp_size, dp_size=self.dp_size, pp_size=self.pp_size, page_size=self.page_size,
                    kv_cache_dtype=self.kv_cache_dtype, dtype=self.dtype, layers=self.layers, kv_heads=self.kv_heads,
                    head_dim=self.head_dim, mla=self.mla, num_pages=self.num_pages, aux_buffers=self.aux_buffers, hybrid=self.hybrid)


class SgTransfer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    requests: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2
    pages_per_request: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    seed: Annotated[int, msgspec.Meta(ge=0, le=b.MAX_SEED)] = 0
    fault: Fault = "none"
    # pdcheck's stand-in for SGLang's heartbeat interval (SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL, 5 s): D's
    # GET /health period; verdicts name the release's own value
    heartbeat_s: Annotated[float, msgspec.Meta(ge=0.05, le=10.0)] = 0.3


class SgScenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    framework: Literal["sglang"] = "sglang"
    name: Annotated[str, msgspec.Meta(max_length=256)] = "cli"
    description: Annotated[str, msgspec.Meta(max_length=16384)] = ""
    issue: Annotated[str, msgspec.Meta(max_length=256)] = ""  # the SGLang issue / PR this class comes from
    sglang: Annotated[list[Word], msgspec.Meta(max_length=b.MAX_RELEASES)] = msgspec.field(
        default_factory=lambda: ["0.5.23"])
    prefill: SgInstance = msgspec.field(default_factory=SgInstance)
    decode: SgInstance = msgspec.field(default_factory=SgInstance)
    transfer: SgTransfer = msgspec.field(default_factory=SgTransfer)
    expect: Annotated[dict[Word, Status | list[Status]], msgspec.Meta(max_length=b.MAX_RELEASES)] = msgspec.field(
        default_factory=dict)
    source: str = ""


def load(path: Path | None, overrides: dict[str, Any] | None = None) -> SgScenario:
    doc = read_toml(path) if path is not None else {"framework": "sglang"}
    where = str(path) if path is not None else "command line"
    if doc.get("framework") != "sglang":
        raise BadInput(f"{where}: not an SGLang scenario (it has no framework = \"sglang\")")
    if overrides:
        doc = merge(doc, {k: v for k, v in overrides.items() if k in ("prefill", "decode")})
    for side in ("prefill", "decode"):
        # the vLLM flags' keys an SGLang side does not have: a shared flag set names them
        if isinstance(doc.get(side), dict):
            doc[side] = {k: v for k, v in doc[side].items() if k not in ("engine_id",)}
    try:
        sc = msgspec.convert(doc, SgScenario)
    except msgspec.ValidationError as exc:
        raise BadInput(f"{where}: {decode_error(exc, doc, SgScenario)}") from None
    for side, inst in (("prefill", sc.prefill), ("decode", sc.decode)):
        if inst.dtype not in DTYPE_BYTES:
            raise BadInput(f"{where}: {side}.dtype: {inst.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if not inst.mla and inst.kv_heads % inst.tp_size and inst.tp_size % inst.kv_heads:
            raise BadInput(f"{where}: {side}: kv_heads {inst.kv_heads} and tp_size {inst.tp_size}: one must divide "
                           "the other")
    if sc.transfer.fault == "duplicate_room" and sc.transfer.requests < 2:
        raise BadInput(f"{where}: transfer.fault = 'duplicate_room' needs transfer.requests >= 2")
    if sc.transfer.fault == "duplicate_room" and sc.prefill.tp_size * sc.prefill.pp_size != sc.decode.tp_size:
        raise BadInput(f"{where}: transfer.fault = 'duplicate_room' is modelled for equal P and D ranks (one D per P)")
    if sc.transfer.fault == "dp_conflict" and sc.prefill.dp_size < 2:
        raise BadInput(f"{where}: transfer.fault = 'dp_conflict' needs prefill.dp_size >= 2")
    if sc.transfer.fault in ("kill_prefill", "dp_conflict") and sc.prefill.registered is not None:
        raise BadInput(f"{where}: transfer.fault = {sc.transfer.fault!r} runs with every prefill rank registered")
    if sc.transfer.fault == "kill_prefill" and sc.prefill.dp_size != 1:
        # the prefill is killed once every P rank wrote its first chunk: each must serve the request
        raise BadInput(f"{where}: transfer.fault = 'kill_prefill' is modelled for prefill.dp_size = 1")
    if sc.decode.dp_size != 1:
        raise BadInput(f"{where}: decode.dp_size: pdcheck models DP on the prefill only")
    if sc.prefill.registered is not None and sc.prefill.registered > (
            sc.prefill.tp_size * sc.prefill.pp_size * sc.prefill.dp_size):
        raise BadInput(f"{where}: prefill.registered: {sc.prefill.registered} > the prefill's ranks")
    return msgspec.structs.replace(sc, source=where)


