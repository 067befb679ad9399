"""vLLM's handshake and serve ranks' messages (pdcheck/vllm/ranks.py) and per-rank results, on the runtime's
codec (pdcheck.messages)."""

from __future__ import annotations

import msgspec

from pdcheck.geometry import Geometry
from pdcheck.messages import Msg, TransferResult, protocol
from pdcheck.verdict import Status


class Inject(msgspec.Struct, frozen=True):
    """Test hooks: make a P rank die or go mute on its first request, or corrupt one tagged block."""

    die_p: list[int] = []
    mute_p: list[int] = []
    corrupt: list[tuple[int, int, int]] = []  # (p_rank, region, block)

class Req(msgspec.Struct, frozen=True):
    req_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]

class RankSpec(msgspec.Struct, frozen=True):
    """What every handshake/serve rank is told: its engine, place in TP, and the KV cache it registers."""

    engine_id: str
    tp_rank: int
    tp_size: int
    num_blocks: int
    device_id: int
    device: str
    geometry: Geometry
    kv_cache_layout: str

class PrefillSpec(RankSpec, frozen=True):
    host: str
    inject: Inject
    log_requests: bool = False  # `pdcheck serve`: one stderr line per request answered
    tag_blocks: int = 0  # `pdcheck serve`: coordinate-tag blocks [0, tag_blocks) of every region up front
    memory_layout: str | None = None  # the layout the bytes really have (backend_layout); None: kv_cache_layout
    pp_size: int = 1  # P's pipeline stages: the rank holds every stage's layers and serves each stage's metadata

class ListenerSpec(msgspec.Struct, frozen=True):
    """One side-channel listener a P rank opens: A-E one per rank, F-H one per DP rank (on P rank 0)."""

    wire: str
    port: int  # where the modelled release puts it (vLLM's layout); D ranks address it by this number
    compat_hash: str | None
    ranks: list[int]  # whose metadata it serves
    bind_port: int = 0  # what the P rank binds: 0 = a port the OS picks (default), else `port` (explicit base_port)

class DRelease(msgspec.Struct, frozen=True):
    """One release a D rank models, and where the P side of it listens."""

    name: str
    p_base_port: int
    p_wire: str
    local_hash: str | None
    # P's TP group spans nodes and this release dials kv_transfer_params' remote_host (the head node) for every
    # P rank (releases.multinode); False: each rank where it listens
    head_host: bool = False

class DecodeSpec(RankSpec, frozen=True):
    releases: list[DRelease]  # "corrected" included
    p_host: str
    p_engine_tag: int
    remote_engine_id: str
    params_tp_size: int
    hang_timeout_ms: int
    transfer: bool
    requests: list[Req]
    live: bool = False  # P is a live instance (--prefill-endpoint): nobody tags on request; check tags if found
    pp_size: int = 1  # the D engine's pipeline parallel stages
    p_pp_size: int = 1  # P's pipeline stages (what its side channel serves, releases.shapes)
    memory_layout: str | None = None  # the layout the bytes really have (backend_layout); None: kv_cache_layout
    permute_local_kv: bool = False  # kv_transfer_config enable_permute_local_kv

class Serve(Msg):
    listeners: list[ListenerSpec]
    values: dict[int, bytes]  # P rank -> its metadata values (Ready.values, passed on as they came)

class Serving(Msg):
    tp_rank: int
    ports: list[int] = []  # the port each listener really bound, in Serve.listeners order

class PrefillFinal(Msg):
    tp_rank: int
    served: int
    notifs: list[str]
    listener_dead: str | None

class Verdict(msgspec.Struct):
    """One release's handshake on one D rank, as the engine finds it (engine.Outcome is this plus in-process
    state) and as the report's JSON shows it."""

    status: Status = "ok"
    assert_expr: str | None = None
    message: str | None = None
    recorded_num_blocks: int | None = None
    contacted: list[int] = []
    contacted_stages: list[int] = []  # P has pipeline stages: the stage asked of each contacted rank, in order
    exception: str | None = None
    check: str | None = None
    hazard: str | None = None
    handshake: int | None = None  # 1-based index of the handshake where it stopped
    remote_rank: int | None = None
    stride: int | None = None  # remote descriptor-id stride the release will use
    rank_num_blocks: dict[int, int] = {}  # what each contacted rank advertised

class DecodeResult(Msg):
    tp_rank: int
    num_blocks: int
    verdicts: dict[str, Verdict]
    transfer: dict[str, TransferResult] | None
    bypassed: dict[str, Verdict] = {}  # the release re-run with asserts stripped, when they differ
    elapsed_ms: float = 0.0


protocol(Serve, Serving, PrefillFinal, DecodeResult)
