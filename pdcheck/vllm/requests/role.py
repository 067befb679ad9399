"""What the request path's P and D ranks share on pdcheck's rank skeleton (pdcheck.ranks): the role's names,
KV cache and ready message, the parent's pipe polled in microseconds, answers batched per loop turn (Outgoing),
and loading a peer's agent at the end of a handshake."""

from __future__ import annotations

import math
import select
import time
from multiprocessing.connection import Connection
from typing import Any

from pdcheck import messages as m
from pdcheck.errors import HarnessError, NixlCallError, PdcheckError
from pdcheck.kvcache import KVCache, block_descs
from pdcheck.nixlagent import no_memory_hooks
from pdcheck.ranks import Role
from pdcheck.vllm.requests import messages as rm
from pdcheck.vllm.wire import AnyMeta

POLL_S = 0.002
FLUSH_S = 0.002  # D sends its answers at least this often while it works through a batch


class RequestsRole(Role):
    spec_type = rm.ReqSpec
    at: int | None = None  # the request this rank was handling last: its failure line names it

    def run(self) -> None:
        """The role's loop (loop()); an exception it did not expect becomes one harness error that names this rank
        and the request in hand (the skeleton writes the traceback to the rank's log, the parent exits 3)."""
        try:
            self.loop()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise  # the parent is gone: nothing to report to
        except Exception as exc:
            text = " ".join(str(exc).split()) or type(exc).__name__
            what = text if isinstance(exc, PdcheckError) else f"{type(exc).__name__}: {text}"
            where = f" at request {self.at}" if self.at is not None else ""
            dp = f"DP{self.spec.dp_rank}/" if self.spec.dp_rank else ""
            raise HarnessError(f"{dp}{self.spec.role}{self.spec.tp_rank}{where}: {what}") from exc

    def loop(self) -> None:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return f"{self.spec.role}{self.spec.tp_rank}:req"

    @property
    def agent_name(self) -> str:
        # A replaced P is a new agent under the same engine id (vLLM names each worker's agent by a uuid).
        inc = f".r{self.spec.incarnation}" if self.spec.incarnation else ""
        return f"{self.spec.engine_id}-{self.spec.role.lower()}{self.spec.tp_rank}{inc}"

    def environment(self) -> None:
        no_memory_hooks("cpu")
        _precise_sleeps()

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        self.kv = KVCache(self.spec.geometry, self.spec.num_blocks)
        return self.kv.regions(0), self.kv.mem_type

    def ready(self) -> m.Msg:
        return rm.ReqReady(self.spec.tp_rank, self.spec.engine_id, self.agent.name, self.agent.metadata(), self.kv.base_addrs,
                          self.spec.num_blocks, self.setup_ms(), self.spec.incarnation)

    def wait(self, timeout_s: float) -> m.Msg | None:
        return m.recv(self.conn) if self.queued(timeout_s) else None

    def queued(self, timeout_s: float = 0.0) -> bool:
        """A message from the parent is waiting (within timeout_s): one poll(2) on the pipe, registered once
        (Connection.poll builds a selector per call, a cost in P's spin)."""
        poller = getattr(self, "_poller", None)
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self.conn.fileno(), select.POLLIN)
        if 0 < timeout_s < 0.001:
            return bool(select.select([self.conn.fileno()], [], [], timeout_s)[0])
        return bool(poller.poll(math.ceil(timeout_s * 1e3)))


def _precise_sleeps() -> None:
    """The ranks' short sleeps (HELD_POLL_S, READ_POLL_S: tens of microseconds) end when asked: Linux lets a
    sleep run late by the thread's timer slack, 50 us by default, which would double them. PR_SET_TIMERSLACK."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 us
    except (OSError, AttributeError):
        pass  # not Linux: the default slack only makes the polls slower


class Outgoing:
    """A rank's request-path answers to the parent, gathered over a loop turn and sent as one ReqBatch (the parent
    only needs them for verdicts: one pipe write and one wake-up per turn, not per request)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.msgs: list[Any] = []
        self.since = 0.0

    def add(self, msg: Any) -> None:
        if not self.msgs:
            self.since = time.monotonic()
        self.msgs.append(msg)

    def due(self) -> bool:
        return bool(self.msgs) and time.monotonic() - self.since >= FLUSH_S

    def flush(self) -> None:
        if self.msgs:
            m.send(self.conn, rm.batched(self.msgs))
            self.msgs = []

    def send(self, msg: m.Msg) -> None:
        """A message outside the batch (Ack, ReqAccount), after everything gathered before it."""
        self.flush()
        m.send(self.conn, msg)


def load_remote(agent: Any, kv: KVCache, meta: AnyMeta, what: str) -> tuple[str, Any]:
    """The end of a handshake: load the peer's agent and prep its blocks as it served them (its block length; era
    A serves none: the same as ours)."""
    name = agent.add_remote(meta.agent_metadata)
    bl = meta.block_lens[0] if meta.block_lens else meta.block_len or kv.block_len
    return name, agent.prep(name, block_descs(meta.kv_caches_base_addr, meta.num_blocks, bl, bl, 0), kv.mem_type,
                            what)


def forget_remote(agent: Any, dlist: Any, name: str) -> None:
    agent.release_dlist(dlist)
    try:
        agent.remove_remote(name)
    except NixlCallError:
        pass  # its process is gone; forgetting it is all that is left to do


class Hold:
    """A request D's scheduler has but reads (pull) or registers (push) later: `hold` / `heartbeat-loss`."""

    __slots__ = ("msg", "next_hb", "read_at", "rid")

    def __init__(self, msg: rm.ReqDecode, rid: str, read_at: float, next_hb: float) -> None:
        self.msg, self.rid, self.read_at, self.next_hb = msg, rid, read_at, next_hb
