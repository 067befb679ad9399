"""Scenarios: TOML files decoded into msgspec Structs, with command-line overrides.

Decoding is the validation: an unknown key or a wrong type is reported with the file and the key path.
Flags are merged into the raw document *before* decoding, so they get exactly the same checks.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from pdcheck import bounds as b
from pdcheck.errors import BadInput
from pdcheck.geometry import DTYPE_BYTES, Geometry, KVGroup
from pdcheck.scenariofile import decode_error, merge, read_toml, unknown_keys
from pdcheck.verdict import Status

Port = Annotated[int, msgspec.Meta(ge=b.MIN_BASE_PORT, le=65535)]
# Bounds (pdcheck/bounds.py, README "Input bounds"): checked while decoding, so a flag gets the same check.
Tp = Annotated[int, msgspec.Meta(ge=1, le=b.HARD_MAX_TP)]
Blocks = Annotated[int, msgspec.Meta(ge=1, le=b.MAX_NUM_BLOCKS)]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=b.MAX_BLOCK_SIZE)]
Layers = Annotated[int, msgspec.Meta(ge=1, le=b.MAX_LAYERS)]
Heads = Annotated[int, msgspec.Meta(ge=1, le=b.MAX_KV_HEADS)]
HeadDim = Annotated[int, msgspec.Meta(ge=1, le=b.MAX_HEAD_DIM)]
DpRank = Annotated[int, msgspec.Meta(ge=0, le=b.MAX_DP_RANK)]
DpSize = Annotated[int, msgspec.Meta(ge=1, le=b.MAX_DP_SIZE)]
PpSize = Annotated[int, msgspec.Meta(ge=1, le=b.MAX_PP_SIZE)]
Nodes = Annotated[int, msgspec.Meta(ge=1, le=b.MAX_NODES)]
CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "fp8_ds_mla")
DeviceId = Annotated[int, msgspec.Meta(ge=0, le=b.MAX_DEVICE_ID)]
# Names travel into NIXL agent names, the wire and reports: printable ASCII, bounded.
Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]
Text = Annotated[str, msgspec.Meta(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")]
Word = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.+-]+$")]

LAYOUTS = ("NHD", "HND", "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


class Instance(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    engine_id: Ident
    tp_size: Tp = 1
    num_blocks: Blocks | Annotated[list[Blocks], msgspec.Meta(max_length=b.HARD_MAX_TP)]
    block_size: BlockSize = 16
    layers: Layers = 1
    kv_heads: Heads = 8
    head_dim: HeadDim = 128
    dtype: Word = "bfloat16"
    kv_cache_layout: Word = "HND"
    # The layout the attention backend really writes, when it ignores the connector's required layout (an
    # NHD-native backend under NixlConnector's HND, vLLM #46204); None: kv_cache_layout. The metadata still
    # advertises kv_cache_layout.
    backend_layout: Word | None = None
    # kv_transfer_config's enable_permute_local_kv (decode side, 0.11.1+): accept P's HND (0.32+: LBHNC) into this
    # side's other layout and permute each received block
    enable_permute_local_kv: bool = False
    attn_backend: Word = "FLASH_ATTN_VLLM_V1"
    use_mla: bool = False
    host: Annotated[str, msgspec.Meta(max_length=64)] = "127.0.0.1"
    base_port: Port | None = None  # None: ports the OS picks; set: vLLM's layout from here (prefill side)
    dp_rank: DpRank = 0
    dp_size: DpSize = 1  # data parallel: that many engines (each a TP group with its own side channel)
    pp_size: PpSize = 1  # pipeline parallel stages (modelled by pdcheck.shapes; one stage runs)
    # Nodes the TP group spans (PR #26338): ranks split evenly, node k's ranks on their own address (ports.node_host)
    nodes: Nodes = 1
    cache_dtype: Word = "auto"  # --kv-cache-dtype: a compat-hash factor from 0.13 (fp8: vLLM #42179)
    fp8_dynamic_scales: bool = False  # fp8 KV with per-request (dynamic) scales: vLLM #42179
    # VLLM_NIXL_SIDE_CHANNEL_HOST set to a routable address (prefill); False: it is left unset ("localhost"), so
    # a D on another node reaches its own node's listener of that port (vLLM #27083)
    side_channel_host_set: bool = True
    # GPU index per TP rank; default: the TP rank (one GPU per rank)
    device_ids: Annotated[list[DeviceId], msgspec.Meta(max_length=b.HARD_MAX_TP)] | None = None
    model: Text = "pdcheck/fake-model"
    vllm: Word | None = None  # this instance's own release, for cross-release pairs
    # Hybrid models (docs/deployment-shapes.md): KV-cache groups in layer order, their layers adding up to `layers`
    kv_groups: Annotated[list[KVGroup], msgspec.Meta(max_length=b.MAX_LAYERS)] | None = None
    hma: bool | None = None  # --[no-]disable-hybrid-kv-cache-manager; None: the release decides
    max_model_len: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] | None = None  # default: one rank's whole cache
    ssm_conv_layout: Literal["SD", "DS"] | None = None  # VLLM_SSM_CONV_STATE_LAYOUT; None: unset (SD)
    # Bytes from one block's start to the next, where a compressed MLA cache (fp8_ds_mla) pads its storage rows
    # past the page (dense virtual pages, NIXL connector version 10, vLLM 0.30+); None: blocks abut
    block_stride: Annotated[int, msgspec.Meta(ge=16, le=b.MAX_RANK_BYTES)] | None = None

    def blocks(self) -> list[int]:
        nb = self.num_blocks
        return list(nb) if isinstance(nb, list) else [nb] * self.tp_size

    def memory_layout(self) -> str:
        """How the KV cache's bytes are really ordered (the backend's layout, else the advertised one)."""
        return self.backend_layout or self.kv_cache_layout

    def device_id(self, tp_rank: int) -> int:
        return self.device_ids[tp_rank] if self.device_ids is not None else tp_rank

    def geometry(self) -> Geometry:
        return Geometry(
            tp_size=self.tp_size, block_size=self.block_size, layers=self.layers,
            total_kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype,
            attn_backend=self.attn_backend, use_mla=self.use_mla,
            groups=tuple(self.kv_groups or ()), hma=self.hma, ssm_conv_layout=self.ssm_conv_layout or "SD",
            block_stride=self.block_stride or 0,
        )


class TransferParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What the proxy hands D in kv_transfer_params (docs/vllm-protocol.md §2)."""

    remote_engine_id: Ident | None = None  # default: the prefill engine id
    tp_size: Tp | None = None  # default: the prefill TP size, as 0.9.2+ P sends it
    omit_tp_size: bool = False  # a proxy that drops the key: D then reads tp_size=1
    # DP: the prefill DP rank the router picks for each decode DP rank (default: round robin, j % prefill.dp_size)
    dp_route: Annotated[list[DpRank], msgspec.Meta(max_length=b.MAX_DP_SIZE)] | None = None
    # "routed": remote_port is the routed P DP rank's port; "dp0": a proxy that hands out DP rank 0's port for
    # every request (a wrong DP port)
    dp_port: Literal["routed", "dp0"] = "routed"


class TransferSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    requests: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_REQUESTS)] = 2
    blocks_per_request: Annotated[int, msgspec.Meta(ge=1, le=b.MAX_BLOCKS_PER_REQUEST)] = 32
    seed: Annotated[int, msgspec.Meta(ge=0, le=b.MAX_SEED)] = 0


class Scenario(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: Text = "cli"
    description: Annotated[str, msgspec.Meta(max_length=16384)] = ""
    vllm: Annotated[list[Word], msgspec.Meta(max_length=b.MAX_RELEASES)] = msgspec.field(
        default_factory=lambda: ["0.9.1"])
    prefill: Instance
    decode: Instance
    kv_transfer_params: TransferParams = msgspec.field(default_factory=TransferParams)
    transfer: TransferSpec = msgspec.field(default_factory=TransferSpec)
    # Expected outcome per release: one status for every decode rank, or a list per rank.
    expect: Annotated[dict[Word, Status | list[Status]], msgspec.Meta(max_length=b.MAX_RELEASES)] = msgspec.field(
        default_factory=dict)
    source: str = ""  # the file it came from (filled in by load)

    def remote_engine_id(self) -> str:
        return self.kv_transfer_params.remote_engine_id or self.prefill.engine_id

    def params_tp_size(self) -> int:
        """tp_size as D reads it: kv_transfer_params.get("tp_size", 1)."""
        if self.kv_transfer_params.omit_tp_size:
            return 1
        return self.kv_transfer_params.tp_size or self.prefill.tp_size


def _validate_groups(sc: Scenario, where: str) -> None:
    """KV-cache groups: they add up to the model's layers, windows fit the context, both sides run one model."""
    for side in ("prefill", "decode"):
        inst: Instance = getattr(sc, side)
        groups = inst.kv_groups or []
        context = inst.max_model_len or min(inst.blocks(), default=0) * inst.block_size
        for i, gr in enumerate(groups):
            at = f"{where}: {side}.kv_groups[{i}]"
            if gr.layers < 1:
                raise BadInput(f"{at}.layers: {gr.layers}; a group holds at least one layer")
            if gr.kind == "sliding_window" and gr.window < 1:
                raise BadInput(f"{at}.window: a sliding_window group needs its window in tokens (>= 1)")
            if gr.kind != "sliding_window" and gr.window:
                raise BadInput(f"{at}.window: only a sliding_window group has a window ({gr.kind} group)")
            if gr.window > context:
                raise BadInput(f"{at}.window: {gr.window} tokens is larger than the context of {context} tokens "
                               f"({'max_model_len' if inst.max_model_len else 'num_blocks x block_size'})")
            if gr.kind == "mamba" and inst.use_mla:
                raise BadInput(f"{at}: Mamba groups beside MLA are not modelled (use_mla = true)")
        if groups and sum(gr.layers for gr in groups) != inst.layers:
            raise BadInput(f"{where}: {side}.kv_groups: the groups hold {sum(gr.layers for gr in groups)} layers, "
                           f"the model has layers = {inst.layers}: they must add up")
    p, d = sc.prefill, sc.decode
    if (p.kv_groups or []) != (d.kv_groups or []):
        raise BadInput(f"{where}: prefill.kv_groups and decode.kv_groups differ: both sides serve one model")
    if any(gr.kind == "mamba" for gr in p.kv_groups or []) and p.tp_size != d.tp_size:
        raise BadInput(f"{where}: kv_groups with a mamba group need equal tp_size on both sides (pdcheck moves SSM "
                       f"state whole per rank; prefill {p.tp_size}, decode {d.tp_size})")


def _validate(sc: Scenario, where: str, max_tp: int = b.MAX_TP) -> None:
    from pdcheck.vllm.releases import CORRECTED, mla_pages, resolve

    for side in ("prefill", "decode"):
        inst: Instance = getattr(sc, side)
        if inst.tp_size > max_tp:
            raise BadInput(f"{where}: {side}.tp_size: {inst.tp_size} ranks; at most {max_tp} per side "
                           f"(one process each; --max-tp raises it up to {b.HARD_MAX_TP})")
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
        if inst.backend_layout is not None and inst.backend_layout not in LAYOUTS:
            raise BadInput(
                f"{where}: {side}.backend_layout: expected one of {', '.join(LAYOUTS)}, got {inst.backend_layout!r}"
            )
        b.check_host(where, f"{side}.host", inst.host)
        g = inst.geometry()
        if g.block_len % 16:
            raise BadInput(f"{where}: {side}: a block of {g.block_len} B (block_size x heads per rank x head_dim x "
                           f"dtype) is not a multiple of 16 B, the cell pdcheck tags blocks with")
        mla_pages.validate(where, side, use_mla=inst.use_mla, cache_dtype=inst.cache_dtype, dtype=inst.dtype,
                           head_dim=inst.head_dim, kv_heads=inst.kv_heads, block_len=g.block_len,
                           block_stride=inst.block_stride,
                           releases=[resolve(v, f"{where}: vllm").version for v in [*sc.vllm, *([inst.vllm] if inst.vllm
                                                                                               else [])]])
        rank_bytes = max(inst.blocks()) * g.row_len * g.num_regions
        if rank_bytes > b.MAX_RANK_BYTES:
            raise BadInput(f"{where}: {side}: {rank_bytes / 2**30:.4g} GiB of KV cache per rank (num_blocks x "
                           f"{g.row_len} B x {g.num_regions} regions); at most {b.MAX_RANK_BYTES >> 30} GiB")
        work = sc.transfer.requests * min(sc.transfer.blocks_per_request, min(inst.blocks())) \
            * g.row_len * g.num_regions  # P tags whole rows, padding included
        if work > b.MAX_PROOF_BYTES:
            raise BadInput(f"{where}: transfer: requests x blocks_per_request make the transfer proof tag and check "
                           f"{work / 2**30:.4g} GiB per {side} rank; at most {b.MAX_PROOF_BYTES >> 20} MiB "
                           f"(fewer requests or blocks per request)")
        if inst.vllm is not None:
            resolve(inst.vllm, f"{where}: {side}.vllm")
        if inst.cache_dtype not in CACHE_DTYPES:
            raise BadInput(f"{where}: {side}.cache_dtype: expected one of {', '.join(CACHE_DTYPES)}, "
                           f"got {inst.cache_dtype!r}")
        if inst.dp_size > 1 and inst.dp_rank != 0:
            raise BadInput(f"{where}: {side}.dp_rank: {inst.dp_rank} with dp_size {inst.dp_size}; with dp_size > 1 "
                           f"every DP rank 0..{inst.dp_size - 1} runs (leave dp_rank out)")
        if inst.tp_size % inst.nodes:
            raise BadInput(f"{where}: {side}.nodes: {inst.nodes} nodes must divide tp_size {inst.tp_size} "
                           f"(each node holds the same number of TP ranks)")
        if inst.nodes > 1 and inst.dp_size > 1:
            raise BadInput(f"{where}: {side}.nodes: a TP group spanning {inst.nodes} nodes with dp_size "
                           f"{inst.dp_size} is not modelled (give one of them as 1)")
        if inst.nodes > 1 and not _loopback_v4(inst.host):
            raise BadInput(f"{where}: {side}.nodes: node k runs on loopback address 127.0.0.(k+1); "
                           f"{side}.host {inst.host!r} must be an IPv4 loopback address")
        if inst.dp_size * inst.tp_size > max_tp:
            raise BadInput(f"{where}: {side}: dp_size {inst.dp_size} x tp_size {inst.tp_size} = "
                           f"{inst.dp_size * inst.tp_size} ranks; at most {max_tp} per side (--max-tp)")
    route = sc.kv_transfer_params.dp_route
    if route is not None:
        if len(route) != sc.decode.dp_size:
            raise BadInput(f"{where}: kv_transfer_params.dp_route: expected {sc.decode.dp_size} entries (one per "
                           f"decode DP rank), got {len(route)}")
        bad = [i for i in route if i >= sc.prefill.dp_size]
        if bad:
            raise BadInput(f"{where}: kv_transfer_params.dp_route: prefill DP rank {bad[0]} does not exist "
                           f"(prefill.dp_size = {sc.prefill.dp_size})")
    if not sc.prefill.side_channel_host_set and sc.prefill.dp_size != sc.decode.dp_size:
        raise BadInput(f"{where}: prefill.side_channel_host_set = false models D reaching its own node's DP "
                       f"listeners: give both sides the same dp_size")
    for v in sc.vllm:
        resolve(v, f"{where}: vllm")
    for release in sc.expect:
        if release != CORRECTED.name:
            resolve(release, f"{where}: expect")
    for release, exp in sc.expect.items():
        n = sc.decode.tp_size * sc.decode.dp_size  # DP-major: DP rank 0's TP ranks first
        if isinstance(exp, list) and len(exp) != n:
            raise BadInput(
                f"{where}: expect.{release}: expected {n} entries (one per decode rank), got {len(exp)}"
            )
    _validate_groups(sc, where)  # last: it reads num_blocks, checked above


def other_phase(doc: dict[str, Any], where: str, path: Path | None) -> None:
    """A request-path scenario (it has [requests] / [faults], which no handshake scenario has; [prefill] and
    [decode] give its TP/DP shape) given to a handshake command: name the command that runs it."""
    if "requests" in doc or "faults" in doc:
        name = path.stem if path is not None else "SCENARIO"
        raise BadInput(f"{where}: a request-path scenario (it has a [requests] or [faults] table); run it with: "
                       f"pdcheck requests {name}")


def decode_scenario(doc: dict[str, Any], where: str, max_tp: int = b.MAX_TP) -> Scenario:
    try:
        sc = msgspec.convert(doc, Scenario, strict=True)
    except msgspec.ValidationError as exc:
        raise BadInput(f"{where}: {decode_error(exc, doc, Scenario)}") from None
    except RecursionError:
        raise BadInput(f"{where}: nested too deeply to be a scenario") from None
    _validate(sc, where, max_tp)
    return msgspec.structs.replace(sc, source=where)


def load(path: Path | None, overrides: dict[str, Any] | None = None, max_tp: int = b.MAX_TP) -> Scenario:
    doc = read_toml(path) if path is not None else {}
    where = str(path) if path is not None else "command line"
    if overrides:
        doc = merge(doc, overrides)
        if path is not None:
            where = f"{path} (with flags)"
    other_phase(doc, where, path)
    for side in ("prefill", "decode"):
        doc.setdefault(side, {})
        if isinstance(doc[side], dict):
            unknown_keys(doc[side], Instance, f"{where}: {side}")
            doc[side] = dict(doc[side])  # merge() copies one level: never fill defaults into the caller's dict
            doc[side].setdefault("engine_id", f"{side}-engine")
            if "num_blocks" not in doc[side]:
                raise missing_blocks(where, side, named=path is not None)
    return decode_scenario(doc, where, max_tp)


def missing_blocks(where: str, side: str, *, named: bool) -> BadInput:
    """A side without num_blocks. Without a scenario named (bare `pdcheck handshake`), the line points at the
    bundled ones, since naming one is what a first run most likely meant."""
    hint = "" if named else "; or name a scenario: `pdcheck list scenarios` lists the bundled ones"
    return BadInput(f"{where}: {side}.num_blocks: required (scenario key or --{side}-blocks){hint}")


def _loopback_v4(host: str) -> bool:
    """An IPv4 loopback address: node k of a multi-node instance binds the address k above it (127/8 is all `lo`)."""
    try:
        return ipaddress.IPv4Address(host).is_loopback
    except ValueError:
        return False
