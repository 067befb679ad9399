"""Scenarios: TOML files decoded into msgspec Structs, with command-line overrides.

Decoding is the validation: an unknown key or a wrong type is reported with the file and the key path.
Flags are merged into the raw document *before* decoding, so they get exactly the same checks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomllib

from pdcheck.errors import BadInput
from pdcheck.geometry import DTYPE_BYTES, Geometry

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Status = Literal["ok", "assert", "silent", "error", "hang"]

LAYOUTS = ("NHD", "HND", "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


class Instance(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    engine_id: str
    tp_size: Pos = 1
    num_blocks: Pos | list[Pos]
    block_size: Pos = 16
    layers: Pos = 1
    kv_heads: Pos = 8
    head_dim: Pos = 128
    dtype: str = "bfloat16"
    kv_cache_layout: str = "HND"
    attn_backend: str = "FLASH_ATTN_VLLM_V1"
    use_mla: bool = False
    host: str = "127.0.0.1"
    base_port: Port | None = None  # None: ports the OS picks; set: vLLM's layout from here (prefill side)
    dp_rank: NonNeg = 0
    device_ids: list[NonNeg] | None = None  # GPU index per TP rank; default: the TP rank (one GPU per rank)
    model: str = "pdcheck/fake-model"
    vllm: str | None = None  # this instance's own release, for cross-release pairs

    def blocks(self) -> list[int]:
        nb = self.num_blocks
        return list(nb) if isinstance(nb, list) else [nb] * self.tp_size

    def device_id(self, tp_rank: int) -> int:
        return self.device_ids[tp_rank] if self.device_ids is not None else tp_rank

    def geometry(self) -> Geometry:
        return Geometry(
            tp_size=self.tp_size, block_size=self.block_size, layers=self.layers,
            total_kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype,
            attn_backend=self.attn_backend, use_mla=self.use_mla,
        )


class TransferParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What the proxy hands D in kv_transfer_params (reference §2)."""

    remote_engine_id: str | None = None  # default: the prefill engine id
    tp_size: Pos | None = None  # default: the prefill TP size, as 0.9.2+ P sends it
    omit_tp_size: bool = False  # a proxy that drops the key: D then reads tp_size=1


class TransferSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    requests: Pos = 2
    blocks_per_request: Pos = 32
    seed: int = 0


class Scenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "cli"
    description: str = ""
    vllm: list[str] = msgspec.field(default_factory=lambda: ["0.9.1"])
    prefill: Instance
    decode: Instance
    kv_transfer_params: TransferParams = msgspec.field(default_factory=TransferParams)
    transfer: TransferSpec = msgspec.field(default_factory=TransferSpec)
    # Expected outcome per release: one status for every decode rank, or a list per rank.
    expect: dict[str, Status | list[Status]] = msgspec.field(default_factory=dict)
    source: str = ""  # the file it came from (filled in by load)

    def remote_engine_id(self) -> str:
        return self.kv_transfer_params.remote_engine_id or self.prefill.engine_id

    def params_tp_size(self) -> int:
        """tp_size as D reads it: kv_transfer_params.get("tp_size", 1)."""
        if self.kv_transfer_params.omit_tp_size:
            return 1
        return self.kv_transfer_params.tp_size or self.prefill.tp_size


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _friendly(exc: msgspec.ValidationError) -> tuple[str, str]:
    m = _AT.match(str(exc))
    assert m is not None
    path = (m.group("path") or "").lstrip(".")
    path = re.sub(r"\[(\d+)\]", r"[\1]", path)
    msg = m.group("msg").replace("`", "")
    msg = msg[0].lower() + msg[1:] if msg else msg
    return path, msg


def _validate(sc: Scenario, where: str) -> None:
    for side in ("prefill", "decode"):
        inst: Instance = getattr(sc, side)
        nb = inst.num_blocks
        if isinstance(nb, list) and len(nb) != inst.tp_size:
            raise BadInput(
                f"{where}: {side}.num_blocks: expected {inst.tp_size} entries (one per TP rank, "
                f"tp_size = {inst.tp_size}), got {len(nb)}"
            )
        if inst.device_ids is not None and len(inst.device_ids) != inst.tp_size:
            raise BadInput(f"{where}: {side}.device_ids: expected {inst.tp_size} entries, got {len(inst.device_ids)}")
        if inst.dtype not in DTYPE_BYTES:
            raise BadInput(f"{where}: {side}.dtype: expected one of {', '.join(DTYPE_BYTES)}, got {inst.dtype!r}")
        if inst.kv_cache_layout not in LAYOUTS:
            raise BadInput(
                f"{where}: {side}.kv_cache_layout: expected one of {', '.join(LAYOUTS)}, got {inst.kv_cache_layout!r}"
            )
        if not inst.engine_id:
            raise BadInput(f"{where}: {side}.engine_id: must not be empty")
    for release, exp in sc.expect.items():
        if isinstance(exp, list) and len(exp) != sc.decode.tp_size:
            raise BadInput(
                f"{where}: expect.{release}: expected {sc.decode.tp_size} entries (one per decode rank), got {len(exp)}"
            )


def decode_scenario(doc: dict[str, Any], where: str) -> Scenario:
    try:
        sc = msgspec.convert(doc, Scenario, strict=True)
    except msgspec.ValidationError as exc:
        path, msg = _friendly(exc)
        raise BadInput(f"{where}: {path or '(top level)'}: {msg}") from None
    _validate(sc, where)
    return msgspec.structs.replace(sc, source=where)


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such scenario file") from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{path}: not valid TOML: {exc}") from None


def merge(doc: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge flag overrides into the raw document; the flags win."""
    out = dict(doc)
    for key, val in overrides.items():
        if isinstance(val, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], val)
        else:
            out[key] = val
    return out


def load(path: Path | None, overrides: dict[str, Any] | None = None) -> Scenario:
    doc = read_toml(path) if path is not None else {}
    where = str(path) if path is not None else "command line"
    if overrides:
        doc = merge(doc, overrides)
        if path is not None:
            where = f"{path} (with flags)"
    for side in ("prefill", "decode"):
        doc.setdefault(side, {})
        if isinstance(doc[side], dict):
            doc[side].setdefault("engine_id", f"{side}-engine")
            if "num_blocks" not in doc[side]:
                raise BadInput(f"{where}: {side}.num_blocks: required (scenario key or --{side}-blocks)")
    return decode_scenario(doc, where)


def parse_counts(flag: str, text: str) -> int | list[int]:
    """'5808,5800' -> [5808, 5800]; '5800' -> 5800 (every rank)."""
    parts = [p.strip() for p in text.split(",")]
    vals: list[int] = []
    for p in parts:
        if not re.fullmatch(r"-?\d+", p):
            raise BadInput(f"{flag}: {p!r} is not an integer (expected a number or a comma-separated list)")
        vals.append(int(p))
    for v in vals:
        if v < 1:
            raise BadInput(f"{flag}: {v} must be at least 1")
    return vals[0] if len(vals) == 1 else vals
