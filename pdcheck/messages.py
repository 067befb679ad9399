"""Messages between the launcher and rank processes, and the per-rank results. msgspec, never pickle."""

from __future__ import annotations

import msgspec


class Inject(msgspec.Struct, frozen=True):
    """Test hooks: make a P rank die or go mute on its first request, or corrupt one tagged block."""

    die_p: list[int] = []
    mute_p: list[int] = []
    corrupt: list[tuple[int, int, int]] = []  # (p_rank, region, block)


class Req(msgspec.Struct, frozen=True):
    req_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]


class PrefillSpec(msgspec.Struct, frozen=True):
    engine_id: str
    tp_rank: int
    tp_size: int
    num_blocks: int
    device_id: int
    device: str
    host: str
    geometry: dict[str, object]
    kv_cache_layout: str
    inject: Inject
    log_requests: bool = False  # `pdcheck serve`: one stderr line per request answered
    tag_blocks: int = 0  # `pdcheck serve`: coordinate-tag blocks [0, tag_blocks) of every region up front


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


class DecodeSpec(msgspec.Struct, frozen=True):
    engine_id: str
    tp_rank: int
    tp_size: int
    num_blocks: int
    device_id: int
    device: str
    geometry: dict[str, object]
    kv_cache_layout: str
    releases: list[DRelease]  # "corrected" included
    p_host: str
    p_engine_tag: int
    remote_engine_id: str
    params_tp_size: int
    hang_timeout_ms: int
    transfer: bool
    requests: list[Req]
    live: bool = False  # P is a live instance (--prefill-endpoint): nobody tags on request; check tags if found


# ---- launcher <-> rank traffic ----------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    tp_rank: int
    agent: str
    setup_ms: float
    values: bytes = b""  # P: msgpack of this rank's metadata values, for per-DP listeners on P rank 0


class Serve(msgspec.Struct, tag=True):
    listeners: list[ListenerSpec]
    values: dict[int, bytes]  # P rank -> metadata values (msgpack)


class Serving(msgspec.Struct, tag=True):
    tp_rank: int
    ports: list[int] = []  # the port each listener really bound, in Serve.listeners order


class Failed(msgspec.Struct, tag=True):
    tp_rank: int
    error: str


class Go(msgspec.Struct, tag=True):
    """Start the handshakes. `ports` maps every layout port a release may contact to the port pdcheck really
    bound for it in this run; anything else goes to `silent`, a port pdcheck holds that never answers."""

    ports: dict[int, int] = {}
    silent: int = 0
    # Where each P-served layout port listens (its P rank's node address); every other port, `silent` included,
    # on `host` (where the parent holds them). Empty: the scenario's P host (one machine).
    hosts: dict[int, str] = {}
    host: str = ""


class TagReq(msgspec.Struct, tag=True):
    ticket: int
    p_rank: int
    blocks: dict[int, list[int]]  # region -> physical block ids to tag


class Tagged(msgspec.Struct, tag=True):
    ticket: int


class Stop(msgspec.Struct, tag=True):
    pass


class PrefillFinal(msgspec.Struct, tag=True):
    tp_rank: int
    served: int
    notifs: list[str]
    listener_dead: str | None


class Mismatch(msgspec.Struct):
    region: int
    local_block: int
    remote_block: int
    p_rank: int
    expected: str
    found: str


class TransferResult(msgspec.Struct):
    status: str  # "ok" | "wrong" | "error" | "skipped" | "arrived" (READ DONE, content not checkable)
    blocks: int = 0
    wrong: int = 0
    first_mismatch: Mismatch | None = None
    wrong_regions: list[int] = []
    message: str | None = None
    stride: int | None = None
    bytes: int = 0
    seconds: float = 0.0


class Verdict(msgspec.Struct):
    status: str
    assert_expr: str | None
    message: str | None
    recorded_num_blocks: int | None
    contacted: list[int]
    exception: str | None = None
    check: str | None = None
    hazard: str | None = None
    handshake: int | None = None
    remote_rank: int | None = None
    stride: int | None = None
    rank_num_blocks: dict[int, int] = {}


class DecodeResult(msgspec.Struct, tag=True):
    tp_rank: int
    num_blocks: int
    verdicts: dict[str, Verdict]
    transfer: dict[str, TransferResult] | None
    bypassed: dict[str, Verdict] = {}  # the release re-run with asserts stripped, when they differ
    elapsed_ms: float = 0.0


Msg = Ready | Serve | Serving | Failed | Go | TagReq | Tagged | Stop | PrefillFinal | DecodeResult

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Msg)


def pack(msg: Msg) -> bytes:
    return _enc.encode(msg)


def unpack(data: bytes) -> Msg:
    return _dec.decode(data)
