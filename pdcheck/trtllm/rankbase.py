"""What TensorRT-LLM's fake ctx and gen roles share on pdcheck's rank skeleton (pdcheck.ranks): the pool, the
NIXL memory type (DRAM: host memory), the counters every frame and notification moves (TrtState, for the
parent's quiescence rule), bounded ZMQ sockets bound as TensorRT-LLM binds them, and NIXL WRITE helpers."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import numpy as np
import zmq

from pdcheck import messages as m
from pdcheck.netio import MAX_FRAME_BYTES
from pdcheck.nixlagent import LOCAL, no_memory_hooks
from pdcheck.ranks import Role
from pdcheck.trtllm.messages import GenResult, TrtReady, TrtState
from pdcheck.trtllm.pool import Pool, reads_as

POLL_MS = 5  # how often a waiting fake rank drives its NIXL worker (a WRITE into it completes only then)
MAX_FRAMES = 16  # frames of one message a fake rank reads; the rest are dropped unread (the longest era sends 7)
NOTIF = "notif:"  # counter key of NIXL notifications to an agent
GIVEN_UP = object()  # a wait the parent ended: nothing more can arrive


class Stopped(Exception):
    """The parent's Stop arrived inside a line."""


def descs(segs: list[tuple[int, int]]) -> np.ndarray:
    out = np.zeros((len(segs), 3), dtype=np.uint64)
    if segs:
        out[:, :2] = np.asarray(segs, dtype=np.uint64)
    return out


class TrtRole(Role):
    """A fake TensorRT-LLM rank: its pool in host memory, its agent named instance_name + rank (T19)."""

    letter: ClassVar[str] = ""

    def environment(self) -> None:
        no_memory_hooks("cpu")

    @property
    def agent_name(self) -> str:
        return f"{self.spec.instance_name}{self.spec.tp_rank}"

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        self.pool = Pool(self.spec.side, self.spec.tp_rank)
        return self.pool.region(), "DRAM"  # TensorRT-LLM registers VRAM; host memory must be DRAM (reference §10)

    def ready(self) -> m.Msg:
        self.zctx = zmq.Context()
        self.loaded: dict[bytes, str] = {}  # NIXL metadata blob -> the agent name NIXL gave it
        self.reset_counters()
        return TrtReady(self.spec.tp_rank, self.agent.name, self.agent.metadata(), self.pool.addr, self.setup_ms())

    # ---- counters -------------------------------------------------------------------------------------
    def reset_counters(self) -> None:
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}
        self.sinks: list[str] = []
        self._reported: tuple[Any, ...] | None = None

    def count_sent(self, key: str) -> None:
        self.sent[key] = self.sent.get(key, 0) + 1

    def count_received(self, key: str) -> None:
        self.received[key] = self.received.get(key, 0) + 1

    def report(self, role: str, waiting: str | None = None) -> None:
        """TrtState to the parent when anything changed since the last one."""
        now = (dict(self.sent), dict(self.received), list(self.sinks), waiting)
        if now != self._reported:
            self._reported = now
            m.send(self.conn, TrtState(role, self.spec.tp_rank, now[0], now[1], now[2], waiting))

    # ---- sockets --------------------------------------------------------------------------------------
    def router(self, port: int = 0) -> tuple[zmq.Socket, str]:
        """A ROUTER bound on this rank's host, an ephemeral port unless given; its endpoint as LAST_ENDPOINT
        reads it (T17). MAXMSGSIZE drops a peer sending a frame above the netio cap."""
        s = self.zctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        s.bind(f"tcp://{self.spec.host}:{port or '*'}")
        return s, s.getsockopt(zmq.LAST_ENDPOINT).decode()

    def dealer(self, endpoint: str) -> zmq.Socket:
        s = self.zctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 500)  # what was sent still goes out when the line closes it
        s.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        s.connect(endpoint)
        return s

    @staticmethod
    def read(sock: zmq.Socket) -> list[bytes]:
        """One whole message, at most MAX_FRAMES frames kept (a peer's thousand frames cost no list of them)."""
        frames = [sock.recv(zmq.NOBLOCK)]
        while sock.getsockopt(zmq.RCVMORE):
            f = sock.recv(zmq.NOBLOCK)
            if len(frames) < MAX_FRAMES:
                frames.append(f)
        return frames

    # ---- NIXL -----------------------------------------------------------------------------------------
    def load(self, blob: bytes) -> str:
        """add_remote_agent once per blob (a peer registering again in the next line is already known)."""
        if blob not in self.loaded:
            self.loaded[blob] = self.agent.add_remote(blob)
        return self.loaded[blob]

    def write(self, peer: str, segs: list[tuple[int, int, int]], notif: bytes, context: str) -> None:
        """One NIXL WRITE of (source, destination, bytes) segments into `peer`, busy-polled to completion (the
        target drives its worker meanwhile). Raises NixlCallError."""
        if not segs:
            return
        lh = self.agent.prep(LOCAL, descs([(s, n) for s, _d, n in segs]), "DRAM", "ctx's source blocks")
        rh = self.agent.prep(peer, descs([(d, n) for _s, d, n in segs]), "DRAM", f"gen's blocks ({peer})")
        try:
            ids = np.arange(len(segs))
            self.agent.read(lh, ids, rh, ids, notif, op="WRITE", timeout_s=10.0, context=context, yield_cpu=True)
        finally:
            self.agent.release_dlist(lh, rh)

    def idle(self, poller: zmq.Poller, ms: int = POLL_MS) -> dict[Any, int]:
        events = dict(poller.poll(ms))
        return events

    def now(self) -> float:
        return time.monotonic()


def judge(gen_dtype: str, ctx_dtype: str, proof: Any, targets: list[int]) -> GenResult:
    """A completed transfer by its proof: ok, or silent (completed, the rows wrong)."""
    if proof.status == "ok":
        return GenResult("ok", "", f"{proof.rows} rows right by coordinate", contacted=targets, proof=proof)
    if proof.status == "dtype":
        demo = reads_as(1.0, proof.found_dtype or ctx_dtype, gen_dtype)
        value = f"; 1.0 written as {proof.found_dtype} reads {demo:g} as {gen_dtype}" if demo is not None else ""
        return GenResult("silent", "proof", f"completed, and every one of {proof.rows} rows holds its right "
                         f"coordinate, written as {proof.found_dtype} and read as {gen_dtype} (equal element "
                         f"sizes: nothing compares the dtype, T73){value}", contacted=targets, proof=proof)
    return GenResult("silent", "proof", f"completed, but {proof.wrong} of {proof.rows} rows are wrong: {proof.first}",
                     contacted=targets, proof=proof)
