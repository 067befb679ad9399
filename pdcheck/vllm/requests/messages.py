"""`pdcheck requests`' messages between the parent (run.py) and its P and D ranks (prefill.py, decode.py), on the
runtime's codec (pdcheck.messages)."""

from __future__ import annotations

from typing import Any

import msgspec

from pdcheck.geometry import Geometry
from pdcheck.messages import Msg, protocol


class ReqSpec(msgspec.Struct, frozen=True):
    role: str  # "P" or "D"
    engine_id: str
    geometry: Geometry
    num_blocks: int
    tp_rank: int = 0
    incarnation: int = 0  # restart-p: how many times this P rank was replaced (a new process and agent)
    side_port: int = 0  # P's side-channel port (0: one the OS picks; a replaced P binds the port of the one it replaces)
    mute_side: bool = False  # test hook: P's side channel takes requests and never answers (a stuck listener)
    tp_size: int = 1  # the request path on a shape (pdcheck.vllm.requests.shapes): this side's TP
    dp_rank: int = 0
    peer_geometry: Geometry | None = None  # D: P's KV geometry (which P ranks it reads, at which offsets)

class ReqReady(Msg):
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
    wire: str  # key into pdcheck.vllm.wire.FORMATS
    compat_hash: str | None  # G/H eras: NixlHandshakePayload.compatibility_hash
    timeout_ms: int | None  # the release's recv timeout (None: a blocking recv())

class ReqHandshook(Msg):
    """One side-channel handshake (D with P; in push mode P with D too) (error: why it failed, "" when it loaded
    the peer's metadata)."""

    endpoint: str
    wire: str
    error: str = ""

class ReqBegin(Msg):
    """A release line's run starts: P empties its blocks and takes this lease; D handshakes with P over `side`."""

    line: str
    lease_s: float | None  # None: the line's default (or no expiry)
    blocks_per_request: int
    failure_policy: str | None = None  # kv_load_failure_policy as deployed (None: the release's default)
    mode: str = "pull"  # "push": D registers (PUSH_REG), P WRITEs into D's blocks and notifies D
    side: ReqSide | None = None  # P's side channel: P serves this line's wire on it, D handshakes over it
    release: str = ""  # the release itself (a line spans several): its log texts (pdcheck.vllm.requests.texts)
    peers: dict[str, list[ReqSide]] = {}  # D on a shape: each P engine id -> its side channel per P TP rank
    time_scale: float = 1.0  # the lease's slow motion (lease_s is already stretched): Options.lease_scale

class ReqPrefill(Msg):
    request: int
    drop_notif: bool = False  # push mode: P's WRITE goes without its completion notification
    notif_delay_s: float = 0.0  # push mode: ... which P sends this late
    write_fail: bool = False  # push mode: read-fail hits P's WRITE (a real NIXL error)
    drop_rank: int = -1  # push mode on a shape: only the notification to this D TP rank is dropped (-1: every one)
    delay_rank: int = -1  # ... only this D TP rank's is delayed
    stall_s: float = 0.0  # test hook: P's loop stops this long before it takes the request (a machine that gives
    # the process no core: pdcheck.vllm.requests.run's end waits for it)
    crash: bool = False  # test hook: P raises an exception it does not expect as it takes the request
    fail_rank: int = -1  # push mode on a shape: only the WRITE into this D TP rank fails (-1: every one)


class ReqPrefilled(Msg):
    request: int
    request_id: str  # P's id for it (unique across the lines a run plays: late notifications match nothing)
    blocks: list[int]
    gens: list[int]
    # kv_transfer_params as P encoded them: the router forwards them to D without decoding them (Raw), and decodes
    # only to corrupt them (bad-params); D decodes them into a dict (ReqDecode.params)
    params: msgspec.Raw
    t: float  # time.time() at allocation

class ReqDecode(Msg):
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
    crash: bool = False  # test hook: D (TP rank 0) raises an exception it does not expect as it takes the request

class ReqDecoded(Msg):
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

class ReqFreed(Msg):
    request: int
    how: str  # "notif" | "expired" | "written" (push: P's WRITE into D's blocks completed)
    t: float
    log: str = ""

class ReqEnd(Msg):
    pass

class ReqSync(Msg):
    """A round trip through P's pipe: P sends it back once it has taken every message sent before it (its prefills
    answered or queued for blocks), so a P the machine stalled is waited for, not judged."""

class ReqRelease(Msg):
    """P on a TP shape: every TP worker reported the request done; the scheduler frees its blocks now."""

    request: int

class ReqAdopt(Msg):
    """restart-p on one P TP worker: the scheduler's state its replacement takes (the other workers kept theirs),
    so every worker's free list and generations stay the same: the free list in order, each block's generation,
    the requests the dead worker held (their blocks died: done on this worker, freed when the scheduler says) and
    how the scheduler names requests (the line count and process count in its request ids)."""

    free: list[int]
    gens: list[int]
    held: dict[int, list[int]]
    epoch: int
    rid_inc: int

class ReqReplaced(Msg):
    """The corrected path, P TP rank 0 (the scheduler's params): a TP worker of its engine was replaced, so the
    registration generation it hands out counts that process too."""

    generation: int

class ReqDone(Msg):
    """To D's ranks: every D rank of the request's DP group answered it (vLLM's finished_recving, aggregated over
    the workers): its heartbeats stop (pdcheck.vllm.requests.heartbeat)."""

    request: int


class ReqTally(Msg):
    """A D rank at the line's end (after ReqEnd): per request, the heartbeats that named it and the handshakes made
    for it; the HB messages it sent."""

    heartbeats: dict[int, int]
    handshakes: dict[int, int]
    sent: int


class ReqBatch(Msg):
    """Request-path messages of one loop turn, in order, in one pipe write (a wake-up per turn, not per request)."""

    msgs: list[ReqPrefill | ReqPrefilled | ReqDecode | ReqDecoded | ReqFreed | ReqHandshook | ReqRelease | ReqDone]

class ReqAccount(Msg):
    holding: list[int]  # requests still holding blocks
    waiting: list[int]  # requests still waiting for blocks
    late_notifs: int
    heartbeats: int
    notif_errors: list[str]
    write_failed: list[int] = []  # push mode: requests whose WRITE failed on P (D is never told)
    handshakes: list[ReqHandshook] = []  # push mode: P's handshakes with D over D's side channel in this line
    handshake_failed: list[int] = []  # push mode: requests whose WRITE P skipped (its handshake with D failed)


def unbatch(msg: Msg | None) -> list[Any]:
    """The messages one pipe message carries, in order (a ReqBatch: its messages)."""
    if isinstance(msg, ReqBatch):
        return list(msg.msgs)
    return [] if msg is None else [msg]


def batched(msgs: list[Any]) -> Msg:
    """One pipe message for msgs: the message itself, or a ReqBatch of them."""
    return msgs[0] if len(msgs) == 1 else ReqBatch(msgs)


protocol(ReqReady, ReqHandshook, ReqBegin, ReqPrefill, ReqPrefilled, ReqDecode, ReqDecoded, ReqFreed, ReqEnd, ReqSync, ReqRelease, ReqAdopt, ReqReplaced, ReqDone, ReqTally, ReqBatch,
         ReqAccount)
