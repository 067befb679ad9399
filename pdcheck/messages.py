"""Messages between the launcher and rank processes (handshake, serve and transfer-bench ranks alike), and the
per-rank results. msgspec msgpack over the launcher's pipes, never pickle."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any, Literal

import msgspec

from pdcheck.geometry import Geometry, ModelShape

Status = Literal["ok", "assert", "silent", "error", "hang"]  # a handshake's verdict


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


# ---- launcher <-> rank traffic ----------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    tp_rank: int
    agent: str
    setup_ms: float
    # P: this rank's metadata values as its framework encodes them (msgpack), opaque to the launcher: P rank 0
    # serves them on per-DP listeners
    values: bytes | None = None


class Serve(msgspec.Struct, tag=True):
    listeners: list[ListenerSpec]
    values: dict[int, bytes]  # P rank -> its metadata values (Ready.values, passed on as they came)


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


class DecodeResult(msgspec.Struct, tag=True):
    tp_rank: int
    num_blocks: int
    verdicts: dict[str, Verdict]
    transfer: dict[str, TransferResult] | None
    bypassed: dict[str, Verdict] = {}  # the release re-run with asserts stripped, when they differ
    elapsed_ms: float = 0.0


# ------------------------------------------------------------------ transfer-bench: the same pipe and codec
class BenchSpec(msgspec.Struct, frozen=True):
    """What a transfer-bench rank is started with (launcher.start's spec)."""

    role: str  # "P" or "D"
    tp_rank: int
    agent_name: str
    arena_bytes: int  # sized for the largest row
    device: str
    gpu: int
    cores: list[int]  # [] = not pinned
    error_mode: str | None
    progress_thread: bool
    target_busy: bool
    ucx_env: dict[str, str]  # the transport preset's UCX variables, set before the agent exists
    shape: ModelShape
    ptp: int
    dtp: int
    iters: int  # 0 = auto from min_time
    warmup: int
    min_time: float
    notif: bool
    host: str = "127.0.0.1"  # the rank's node address (Ray); loopback keeps UCX on `lo`


class BenchReady(msgspec.Struct, tag=True):
    tp_rank: int
    agent_name: str
    metadata: bytes
    addr: int
    nbytes: int
    dev: int
    ucx_version: str
    cores: list[int]


class PeerInfo(msgspec.Struct):
    rank: int
    name: str
    metadata: bytes
    addr: int
    dev: int


class Peers(msgspec.Struct, tag=True):
    peers: list[PeerInfo]


class Row(msgspec.Struct, tag=True):
    """One sweep point. Block tables travel as raw little-endian int64 (requests x blocks)."""

    index: int
    block_tokens: int
    tokens: int
    blocks: int
    requests: int
    run_length: int
    num_blocks: int
    tables_p: bytes
    tables_d: bytes
    corrupt: int  # -1, or the descriptor index (request 0 of decode rank 0) to corrupt at the source


class Filled(msgspec.Struct, tag=True):
    fill_ms: float


class Armed(msgspec.Struct, tag=True):
    pass


class Ack(msgspec.Struct, tag=True):
    pass


class Measure(msgspec.Struct, tag=True):
    """Start the timed loop (every D rank at once)."""


class Poll(msgspec.Struct, tag=True):
    pass


class Stats(msgspec.Struct, tag=True):
    cpu_s: float  # process CPU time so far (all threads, progress thread included)
    wall_s: float
    notifs: int  # notifications received so far


class Ceiling(msgspec.Struct):
    gbps: float
    p50_us: float
    nbytes: int
    iters: int
    working_set: int
    wrong: int = 0


class RankRow(msgspec.Struct, tag=True):
    """One decode rank's measurements for one sweep point."""

    rank: int
    nbytes: int  # per transfer
    block_bytes: int
    desc_count: int
    desc_merged: list[int]  # NIXL telemetry descCount per request handle (empty when unavailable)
    desc_runs: float  # mean contiguous runs per request: the count if NIXL merged every run
    iters: int
    wall_ns: int
    lat_ns: bytes  # int64 per transfer
    checked: int
    wrong: int
    first_wrong: str | None
    memcpy: list[Ceiling]  # before and after the row, to catch drift
    wire: Ceiling
    prep_ms: float
    make_us: float
    verify_ms: float
    cpu_s: float
    working_set: int
    telemetry_error: str | None = None


class Bye(msgspec.Struct, tag=True):
    notifs: int


class FrameworkFinal(msgspec.Struct, tag=True):
    """A rank of another serving framework (pdcheck.sglang) reports its end: `body` is msgpack of that
    framework's own result type, decoded by its runner (this codec stays framework-neutral)."""

    tp_rank: int
    body: bytes


# ------------------------------------------------------------------ `pdcheck requests` (pdcheck.requests.rank, prefill, decode)
class ReqSpec(msgspec.Struct, frozen=True):
    role: str  # "P" or "D"
    engine_id: str
    geometry: Geometry
    num_blocks: int
    tp_rank: int = 0
    incarnation: int = 0  # restart-p: how many times this P rank was replaced (a new process and agent)
    side_port: int = 0  # P's side-channel port (0: one the OS picks; a replaced P binds the port of the one it replaces)
    mute_side: bool = False  # test hook: P's side channel takes requests and never answers (a stuck listener)
    tp_size: int = 1  # the request path on a shape (pdcheck.requests.shapes): this side's TP
    dp_rank: int = 0
    peer_geometry: Geometry | None = None  # D: P's KV geometry (which P ranks it reads, at which offsets)


class ReqReady(msgspec.Struct, tag=True):
    tp_rank: int
    engine_id: str
    agent: str
    metadata: bytes
    base_addrs: list[int]
    num_blocks: int
    setup_ms: float
    incarnation: int = 0  # restart-p: which process of this P rank (its registration generation - 1)
    side_host: str = ""  # where its side-channel listener is bound (D's serves in push mode)
    side_port: int = 0


class ReqSide(msgspec.Struct, frozen=True):
    """Where P's side channel listens, and how the line's release speaks and waits on it."""

    host: str
    port: int
    wire: str  # key into pdcheck.wire.FORMATS
    compat_hash: str | None  # G/H eras: NixlHandshakePayload.compatibility_hash
    timeout_ms: int | None  # the release's recv timeout (None: a blocking recv())


class ReqHandshook(msgspec.Struct, tag=True):
    """One side-channel handshake (D with P; in push mode P with D too) (error: why it failed, "" when it loaded
    the peer's metadata)."""

    endpoint: str
    wire: str
    error: str = ""


class ReqBegin(msgspec.Struct, tag=True):
    """A release line's run starts: P empties its blocks and takes this lease; D handshakes with P over `side`."""

    line: str
    lease_s: float | None  # None: the line's default (or no expiry)
    blocks_per_request: int
    failure_policy: str | None = None  # kv_load_failure_policy as deployed (None: the release's default)
    mode: str = "pull"  # "push": D registers (PUSH_REG), P WRITEs into D's blocks and notifies D
    side: ReqSide | None = None  # P's side channel: P serves this line's wire on it, D handshakes over it
    release: str = ""  # the release itself (a line spans several): its log texts (pdcheck.requests.texts)
    peers: dict[str, list[ReqSide]] = {}  # D on a shape: each P engine id -> its side channel per P TP rank
    time_scale: float = 1.0  # the lease's slow motion (lease_s is already stretched): Options.lease_scale


class ReqPrefill(msgspec.Struct, tag=True):
    request: int
    drop_notif: bool = False  # push mode: P's WRITE goes without its completion notification
    notif_delay_s: float = 0.0  # push mode: ... which P sends this late
    write_fail: bool = False  # push mode: read-fail hits P's WRITE (a real NIXL error)
    drop_rank: int = -1  # push mode on a shape: only the notification to this D TP rank is dropped (-1: every one)
    delay_rank: int = -1  # ... only this D TP rank's is delayed
    stall_s: float = 0.0  # test hook: P's loop stops this long before it takes the request (a machine that gives
    # the process no core: pdcheck.requests.run's end waits for it)
    crash: bool = False  # test hook: P raises an exception it does not expect as it takes the request
    fail_rank: int = -1  # push mode on a shape: only the WRITE into this D TP rank fails (-1: every one)


class ReqPrefilled(msgspec.Struct, tag=True):
    request: int
    request_id: str  # P's id for it (unique across the lines a run plays: late notifications match nothing)
    blocks: list[int]
    gens: list[int]
    # kv_transfer_params as P encoded them: the router forwards them to D without decoding them (Raw), and decodes
    # only to corrupt them (bad-params); D decodes them into a dict (ReqDecode.params)
    params: msgspec.Raw
    t: float  # time.time() at allocation


class ReqDecode(msgspec.Struct, tag=True):
    """The router hands D a request: the params as forwarded (None: dropped) and the oracle's expectation."""

    request: int
    request_id: str  # the proxy's id (D notifies with it where the release has no remote_request_id)
    params: dict[str, Any] | None  # the router may set P's encoded params (msgspec.Raw): they encode as that dict
    expect_blocks: list[int]
    expect_gens: list[int]
    drop_notif: bool = False
    notif_delay_s: float = 0.0
    hold_s: float = 0.0  # hold / heartbeat-loss: D reads this long after its scheduler takes the request
    heartbeats_lost: bool = False
    read_fail: bool = False
    abort: bool = False  # abort-d: the client aborts while the READ is in flight
    alone: bool = False  # a fault touches it: D reads it alone, after every READ before it (none beside it)
    crash: bool = False  # test hook: D raises an exception it does not expect as it takes the request


class ReqDecoded(msgspec.Struct, tag=True):
    request: int
    status: str  # "refused" | "failed" | "read"; push mode: "registered" first (PUSH_REG sent), then the outcome
    verdict: str = ""  # refused/failed: the release's verdict
    detail: str = ""
    t_read: float = 0.0
    checked: int = 0
    wrong: int = 0
    found_block: int = -1  # the first wrong block's first cell, decoded
    found_gen: int = -1
    found_valid: bool = False
    d_freed_in_flight: bool = False  # abort-d: D freed its blocks while its READ was in flight


class ReqFreed(msgspec.Struct, tag=True):
    request: int
    how: str  # "notif" | "expired" | "written" (push: P's WRITE into D's blocks completed)
    t: float
    log: str = ""


class ReqEnd(msgspec.Struct, tag=True):
    pass


class ReqSync(msgspec.Struct, tag=True):
    """A round trip through P's pipe: P sends it back once it has taken every message sent before it (its prefills
    answered or queued for blocks), so a P the machine stalled is waited for, not judged."""


class ReqRelease(msgspec.Struct, tag=True):
    """P on a TP shape: every TP worker reported the request done; the scheduler frees its blocks now."""

    request: int


class ReqAdopt(msgspec.Struct, tag=True):
    """restart-p on one P TP worker: the scheduler's state its replacement takes (the other workers kept theirs),
    so every worker's free list and generations stay the same: the free list in order, each block's generation,
    the requests the dead worker held (their blocks died: done on this worker, freed when the scheduler says) and
    how the scheduler names requests (the line count and process count in its request ids)."""

    free: list[int]
    gens: list[int]
    held: dict[int, list[int]]
    epoch: int
    rid_inc: int


class ReqReplaced(msgspec.Struct, tag=True):
    """The corrected path, P TP rank 0 (the scheduler's params): a TP worker of its engine was replaced, so the
    registration generation it hands out counts that process too."""

    generation: int


class ReqDone(msgspec.Struct, tag=True):
    """To D's ranks: every D rank of the request's DP group answered it (vLLM's finished_recving, aggregated over
    the workers): its heartbeats stop (pdcheck.requests.heartbeat)."""

    request: int


class ReqTally(msgspec.Struct, tag=True):
    """A D rank at the line's end (after ReqEnd): per request, the heartbeats that named it and the handshakes made
    for it; the HB messages it sent."""

    heartbeats: dict[int, int]
    handshakes: dict[int, int]
    sent: int


class ReqBatch(msgspec.Struct, tag=True):
    """Request-path messages of one loop turn, in order, in one pipe write (a wake-up per turn, not per request)."""

    msgs: list[ReqPrefill | ReqPrefilled | ReqDecode | ReqDecoded | ReqFreed | ReqHandshook | ReqRelease | ReqDone]


class ReqAccount(msgspec.Struct, tag=True):
    holding: list[int]  # requests still holding blocks
    waiting: list[int]  # requests still waiting for blocks
    late_notifs: int
    heartbeats: int
    notif_errors: list[str]
    write_failed: list[int] = []  # push mode: requests whose WRITE failed on P (D is never told)
    handshakes: list[ReqHandshook] = []  # push mode: P's handshakes with D over D's side channel in this line
    handshake_failed: list[int] = []  # push mode: requests whose WRITE P skipped (its handshake with D failed)


Msg = (Ready | Serve | Serving | Failed | Go | TagReq | Tagged | Stop | PrefillFinal | DecodeResult | FrameworkFinal
       | BenchReady | Peers | Row | Filled | Armed | Ack | Measure | Poll | Stats | RankRow | Bye
       | ReqReady | ReqBegin | ReqPrefill | ReqPrefilled | ReqDecode | ReqDecoded | ReqFreed | ReqEnd | ReqSync | ReqAccount
       | ReqRelease | ReqAdopt | ReqReplaced | ReqDone | ReqTally
       | ReqBatch | ReqHandshook)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Msg)


def pack(msg: Msg) -> bytes:
    return _enc.encode(msg)


def unpack(data: bytes) -> Msg:
    return _dec.decode(data)


def send(conn: Connection, msg: Msg) -> None:
    """One message over a launcher pipe (either end)."""
    conn.send_bytes(pack(msg))


def recv(conn: Connection) -> Msg:
    return unpack(conn.recv_bytes())


def unbatch(msg: Msg | None) -> list[Any]:
    """The messages one pipe message carries, in order (a ReqBatch: its messages)."""
    if isinstance(msg, ReqBatch):
        return list(msg.msgs)
    return [] if msg is None else [msg]


def batched(msgs: list[Any]) -> Msg:
    """One pipe message for msgs: the message itself, or a ReqBatch of them."""
    return msgs[0] if len(msgs) == 1 else ReqBatch(msgs)
