"""The messages between the parent and TensorRT-LLM's fake ranks (pdcheck.messages' codec: msgspec, never pickle).

A run starts its ctx and gen ranks once and runs its lines (eras) one after the other on them: for each line the
parent opens the line on the ctx ranks (TrtLine), hands them their peers' endpoints (TrtPeers, the allgather of
T19), starts the gen ranks (TrtGenGo), and watches every rank's counters (TrtState). When every frame and
notification sent has been received and the gens still wait, nothing more can come: the wait is the era's hang,
and the parent tells the gens so (TrtGiveUp) instead of waiting out a timeout (docs/trtllm.md, "How a hang is
decided"). Then the gens report (TrtGenDone) and the ctx ranks close the line (TrtEndLine, TrtCtxDone)."""

from __future__ import annotations

import msgspec

from pdcheck.messages import Msg, protocol
from pdcheck.trtllm.cppwire import CacheState
from pdcheck.trtllm.layout import Side
from pdcheck.trtllm.pool import RowProof


class TrtCtxSpec(msgspec.Struct, frozen=True):
    tp_rank: int  # the global rank (the skeleton's name for it)
    side: Side
    instance_name: str
    ctx_blocks: list[int]  # the request's blocks: tagged once, WRITten from
    gen_side: Side  # for the C++ ranks' CacheState of their counterpart (the real one reads it from RequestInfo)
    host: str = "127.0.0.1"
    agent: str = "py"  # transfer_engine_info form it expects (T41)
    serve: bool = False  # `pdcheck serve`: one line, every request served, until Stop
    info_port: int = 0  # serve --port: the RankInfoServer's port (0: the OS picks)


class TrtGenSpec(msgspec.Struct, frozen=True):
    tp_rank: int
    side: Side
    ctx_side: Side  # the proof's oracle: which ctx rank holds which head and layer
    instance_name: str
    gen_blocks: list[int]
    ctx_blocks: list[int]
    host: str = "127.0.0.1"
    agent: str = "py"
    cap_s: float = 30.0  # pdcheck's cap on one line's waits (a live ctx: the hang window)


class TrtReady(Msg):
    tp_rank: int
    agent: str
    metadata: bytes
    base: int
    setup_ms: float


class TrtLine(Msg):
    """Open a line: the ctx rank's era, the fault, the request's ids."""

    index: int
    line: str
    fault: str
    unique_rid: int
    ctx_req_id: int


class TrtCtxUp(Msg):
    tp_rank: int
    sender: str  # its Sender ROUTER's endpoint ("" on the C++ path)
    receiver: str
    info: str  # rank 0's RankInfoServer endpoint


class TrtPeers(Msg):
    sender_endpoints: list[str]  # by global rank
    info_endpoint: str


class CppPeer(msgspec.Struct, frozen=True):
    """What a C++ gen learns of its counterpart from the request's opaque_state (CommState, CacheState): the
    agent and its metadata stand in for NIXL's listener fetch (fetchRemoteMD, T61), which pdcheck's agents
    do not run (pdcheck.nixlagent)."""

    rank: int
    agent: str
    metadata: bytes
    cache_state: CacheState


class TrtGenGo(Msg):
    index: int
    line: str
    fault: str
    unique_rid: int
    ctx_req_id: int
    info_endpoint: str
    timeout_ms: int | None  # the modelled kv_transfer_timeout_ms (None: forever)
    cpp_peers: list[CppPeer] = []


class TrtState(Msg):
    """A rank's counters, sent whenever they change and it is about to wait. Keys are endpoints (a ZMQ endpoint,
    or "notif:<agent>" for NIXL notifications to that agent)."""

    role: str  # "ctx" | "gen"
    tp_rank: int
    sent: dict[str, int]
    received: dict[str, int]
    sinks: list[str] = []  # its endpoints that read nothing more (a muted info server, a dead listener)
    waiting: str | None = None  # gen: the wait it is in (stage)


class TrtArmed(Msg):
    """ctx_dies: this ctx rank registered the gen and stored its REQUEST_DATA; kill it now."""

    tp_rank: int


class TrtGiveUp(Msg):
    """Nothing more can arrive: the gen's wait is a hang (the era's) or a deadline (corrected)."""


class GenResult(msgspec.Struct):
    status: str  # ok | silent | error | hang
    stage: str
    message: str = ""
    exception: str | None = None
    contacted: list[int] = []
    proof: RowProof | None = None
    logs: list[str] = []
    timeout_ms: int | None = None  # hang: the timeout that ends the wait (None: forever)


class TrtGenDone(Msg):
    tp_rank: int
    result: GenResult


class TrtEndLine(Msg):
    pass


class CtxResult(msgspec.Struct):
    logs: list[str] = []  # what the ctx logged (TensorRT-LLM's texts)
    writes: int = 0
    registered: list[str] = []
    listener_dead: str | None = None


class TrtCtxDone(Msg):
    tp_rank: int
    result: CtxResult


protocol(TrtReady, TrtLine, TrtCtxUp, TrtPeers, TrtGenGo, TrtState, TrtArmed, TrtGiveUp, TrtGenDone, TrtEndLine,
         TrtCtxDone)
