"""Wire formats per vLLM era (docs/vllm-protocol.md §3.1-§3.3): port scheme, request framing, reply framing, schema.

Everything here is data plus encode/decode; nothing opens a socket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from pdcheck.vllm.wire.schemas import SCHEMAS, AnyMeta, AnyPayload, HandshakePayload, field_names

GET_META_MSG = b"get_meta_msg"


@dataclass(frozen=True)
class WireFormat:
    name: str
    schema: str  # key into SCHEMAS
    port_scheme: Literal["per_rank", "per_dp"]  # A-E: base + tp_rank; F-H: one scheduler port per DP rank
    request: Literal["raw", "tp", "pp_tp"]
    reply_frames: int  # H: payload + msgpack(perf_counter)
    wrapped: bool  # G/H: NixlHandshakePayload{compatibility_hash, agent_metadata_bytes}

    @property
    def schema_type(self) -> type:
        return SCHEMAS[self.schema]

    @property
    def listener_dies_on_bad_request(self) -> bool:
        # F-H decode the request outside any try/except (docs/vllm-protocol.md §3.2, H15).
        return self.request != "raw"

    # pdcheck.sidechannel.Codec: the side channel frames requests through these
    def encode_request(self, tp_rank: int, pp_rank: int = 0) -> bytes:
        return encode_request(self, tp_rank, pp_rank)

    def parse_request(self, msg: bytes) -> int | None:
        return parse_request(self, msg)

    def parse_stage(self, msg: bytes) -> int:
        return parse_stage(self, msg)


FORMATS: dict[str, WireFormat] = {
    f.name: f
    for f in (
        WireFormat("A", "A", "per_rank", "raw", 1, False),
        WireFormat("B", "B", "per_rank", "raw", 1, False),
        WireFormat("C", "C", "per_rank", "raw", 1, False),
        WireFormat("D", "D", "per_rank", "raw", 1, False),
        WireFormat("E", "E", "per_rank", "raw", 1, False),
        WireFormat("F", "F", "per_dp", "tp", 1, False),
        WireFormat("G", "G", "per_dp", "tp", 1, True),
        WireFormat("G18", "G18", "per_dp", "tp", 1, True),
        WireFormat("G20", "G20", "per_dp", "tp", 1, True),
        WireFormat("G24", "G24", "per_dp", "tp", 1, True),
        WireFormat("H", "H", "per_dp", "pp_tp", 2, True),
        WireFormat("H29", "H29", "per_dp", "pp_tp", 2, True),
        WireFormat("H31", "H31", "per_dp", "pp_tp", 2, True),
        WireFormat("H34", "H34", "per_dp", "pp_tp", 2, True),
    )
}


class WireError(Exception):
    """A reply the modelled release cannot read; the text is what that release would raise."""

    def __init__(self, exc_type: str, message: str, expr: str | None = None) -> None:
        self.exc_type = exc_type
        self.message = message
        self.expr = expr
        super().__init__(f"{exc_type}: {message}")


_enc = msgspec.msgpack.Encoder()


def encode_request(fmt: WireFormat, tp_rank: int, pp_rank: int = 0) -> bytes:
    if fmt.request == "raw":
        return GET_META_MSG  # the rank is implied by the port
    if fmt.request == "tp":
        return _enc.encode((GET_META_MSG, tp_rank))
    return _enc.encode((GET_META_MSG, pp_rank, tp_rank))


def parse_request(fmt: WireFormat, msg: bytes) -> int | None:
    """What the listener of `fmt` makes of a request: the tp_rank asked for, or None (raw eras).

    Raises the exception the real listener raises; in F-H that exception ends the listener thread.
    """
    if fmt.request == "raw":
        return None  # A-E only log an unexpected message, then reply anyway
    decoded = msgspec.msgpack.decode(msg)  # DecodeError on a legacy raw request
    if fmt.request == "tp":
        _msg, tp_rank = decoded  # ValueError on the wrong arity
    else:
        _msg, _pp, tp_rank = decoded
    return int(tp_rank)


def parse_stage(fmt: WireFormat, msg: bytes) -> int:
    """The pipeline stage a request asks for: its pp_rank where the era's request carries one (H), else 0."""
    if fmt.request in ("raw", "tp"):
        return 0
    _msg, pp_rank, _tp = msgspec.msgpack.decode(msg)
    return int(pp_rank)


# 0.29+ put KVCacheLayout names on the wire (`get_resolved_kv_cache_layout().name`) and compare them as strings:
# the pre-0.29 names of the same layouts.
KV_LAYOUT_NAMES = {"HND": "LBHNC", "NHD": "LBNHC"}
_ENUM_LAYOUT_WIRES = ("H29", "H31", "H34")


def build_metadata(fmt: WireFormat, values: AnyMeta | dict[str, Any]) -> Any:
    """Instantiate the era's schema from a superset of field values (extra keys and unset fields ignored)."""
    if isinstance(values, AnyMeta):
        values = {k: v for k, v in msgspec.structs.asdict(values).items() if v is not None}
    schema = fmt.schema_type
    out = {k: values[k] for k in field_names(schema) if k in values}
    if fmt.name in _ENUM_LAYOUT_WIRES and out.get("kv_cache_layout") in KV_LAYOUT_NAMES:
        out["kv_cache_layout"] = KV_LAYOUT_NAMES[out["kv_cache_layout"]]
    return schema(**out)


def encode_reply(fmt: WireFormat, values: AnyMeta | dict[str, Any], compat_hash: str | None = None) -> list[bytes]:
    body = _enc.encode(build_metadata(fmt, values))
    if fmt.wrapped:
        body = _enc.encode(HandshakePayload(compat_hash or "", body))
    frames = [body]
    if fmt.reply_frames == 2:
        frames.append(_enc.encode(time.perf_counter()))
    return frames


def _validation(exc: Exception) -> WireError:
    return WireError(f"msgspec.{type(exc).__name__}", str(exc))


def strict_decode(fmt: WireFormat, frames: list[bytes], local_hash: str | None = None,
                  enforce_hash: bool = True) -> tuple[AnyMeta, str | None]:
    """Decode a reply the way a D of era `fmt` does. Returns (metadata, remote hash).

    Raises WireError carrying the exception that release raises.
    """
    if fmt.reply_frames == 2:
        if len(frames) != 2:
            raise WireError("AssertionError", "", "len(reply_parts) == 2")
    payload = frames[0]
    remote_hash: str | None = None
    if fmt.wrapped:
        try:
            outer = msgspec.msgpack.Decoder(HandshakePayload).decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(
                "RuntimeError",
                "Failed to decode NixlHandshakePayload. This likely indicates an incompatibility "
                f"between connector version. Error: {exc}",
            ) from exc
        remote_hash = outer.compatibility_hash
        if enforce_hash and local_hash is not None and remote_hash != local_hash:
            raise WireError(
                "RuntimeError",
                f"NIXL compatibility hash mismatch. Local: {local_hash}, Remote: {remote_hash}. "
                "Prefill and decode instances have incompatible configurations. This may be due to: "
                "different vLLM versions, models, dtypes, KV cache layouts, attention backends, etc. "
                "Both instances must use identical configurations.Disable this check using "
                '--kv-transfer-config \'{"kv_connector_extra_config": {"enforce_handshake_compat": false}}\'',
            )
        try:
            strict = msgspec.msgpack.Decoder(fmt.schema_type).decode(outer.agent_metadata_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("RuntimeError", f"Failed to decode NixlAgentMetadata. Error: {exc}") from exc
        payload = outer.agent_metadata_bytes
    else:
        try:
            strict = msgspec.msgpack.Decoder(fmt.schema_type).decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _validation(exc) from exc
    del strict  # validated; the uniform view below carries the same values
    return msgspec.msgpack.Decoder(AnyMeta).decode(payload), remote_hash


@dataclass
class Tolerant:
    meta: AnyMeta
    era: str
    compat_hash: str | None
    remote_perf_counter: float | None


def tolerant_decode(frames: list[bytes]) -> Tolerant:
    """Read any era's reply (docs/vllm-protocol.md §3.6 recipe) and say which era it came from."""
    ts = msgspec.msgpack.decode(frames[1], type=float) if len(frames) == 2 else None
    top = msgspec.msgpack.decode(frames[0])
    compat: str | None = None
    body = frames[0]
    if isinstance(top, dict) and "compatibility_hash" in top:
        outer = msgspec.msgpack.decode(frames[0], type=AnyPayload)
        compat, body = outer.compatibility_hash, outer.agent_metadata_bytes
    meta = msgspec.msgpack.decode(body, type=AnyMeta)
    return Tolerant(meta, detect_era(meta, wrapped=compat is not None, frames=len(frames)), compat, ts)


def detect_era(meta: AnyMeta, *, wrapped: bool, frames: int) -> str:
    if frames == 2:
        return "H"
    if wrapped:
        return "G"
    if meta.device_id is not None:
        return "F"
    if meta.block_lens is not None:
        return "E"
    if meta.kv_cache_layout is not None:
        return "D"
    if meta.tp_size is not None:
        return "B"
    if meta.block_len is not None:
        return "C"
    return "A"
