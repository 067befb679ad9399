"""The rank skeleton every rank process runs; each framework's roles plug into it (docs/architecture.md).

The skeleton (run_rank) does what every rank does: decode its spec, name the process, quiet NIXL's output, let
the role set its environment and allocate its memory, create the NIXL agent and register that memory, send the
role's Ready message, run the role, and turn any failure into one Failed line to the parent. It knows no
framework: vLLM's handshake roles are in pdcheck.vllm.ranks, the request path's in pdcheck.vllm.requests, SGLang's
in pdcheck.sglang.ranks, transfer-bench's in pdcheck.bench.rank.
"""

from __future__ import annotations

import select
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import msgspec

from pdcheck import messages as m
from pdcheck.errors import PdcheckError
from pdcheck.launcher import name_this_process
from pdcheck.nixlagent import Agent, quiet_nixl_env

PROGRESS_SLICE_MS = 5  # how often a waiting rank drives its NIXL worker (Role.receive)


# ---------------------------------------------------------------------------------------------- skeleton
class Role:
    """One kind of rank. The skeleton calls environment(), memory(), creates `agent` (agent_name, agent_options())
    and registers that memory, sends ready(), then calls run() (the role's conversation with the parent, to its
    Stop)."""

    spec_type: ClassVar[type[Any]]
    letter: ClassVar[str] = ""  # "P" or "D": the process name pdcheck-P3 (a role may take it from its spec)
    agent: Agent

    def __init__(self, conn: Connection, spec: Any) -> None:
        self.conn, self.spec = conn, spec
        self.t0 = time.perf_counter()

    @classmethod
    def for_spec(cls, spec: Any) -> type[Role]:
        """The role class that runs this spec (a family of roles sharing one spec type picks here)."""
        return cls

    @property
    def name(self) -> str:
        return f"{self.letter}{self.spec.tp_rank}"

    @property
    def host(self) -> str:
        """The address this rank's NIXL traffic uses: UCX stays on `lo` for a loopback one."""
        return "127.0.0.1"

    def environment(self) -> None:
        """Process-wide settings read when the agent is created (UCX variables, pinning)."""

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        """Allocate this rank's memory (before the agent: for VRAM the CUDA context must exist before UCX
        creates its worker); the regions to register (addr, bytes, device id) and their NIXL memory type."""
        raise NotImplementedError

    @property
    def agent_name(self) -> str:
        raise NotImplementedError

    def agent_options(self) -> dict[str, Any]:
        return {}

    def ready(self) -> m.Msg:
        """The message that tells the parent this rank is up (agent created, memory registered)."""
        raise NotImplementedError

    def run(self) -> None:
        """The role's conversation with the parent. Default: serve peers (their READs of this rank's memory,
        their notifications) until the parent's Stop."""
        while not isinstance(self.receive(), m.Stop):
            pass

    def receive(self, timeout_s: float | None = None) -> m.Msg | None:
        """The parent's next message, driving this rank's NIXL worker while it waits: no agent runs a progress
        thread (pdcheck.nixlagent), so a peer's READ of this rank's memory, or a notification to it, completes
        only as this rank progresses its worker (docs/architecture.md, "The rank skeleton"). None when timeout_s
        passes first."""
        if not hasattr(self, "_pipe"):
            self._pipe = select.poll()
            self._pipe.register(self.conn.fileno(), select.POLLIN)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pipe.poll(PROGRESS_SLICE_MS):
            if hasattr(self, "agent"):
                self.agent.progress()
            if deadline is not None and time.monotonic() >= deadline:
                return None
        return m.recv(self.conn)

    def setup_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3


def run_rank(role_type: type[Role], conn: Connection, spec_bytes: bytes) -> None:
    """The body of every rank process (a launcher target calls this with its role)."""
    spec = msgspec.msgpack.decode(spec_bytes, type=role_type.spec_type)
    role = role_type.for_spec(spec)(conn, spec)
    name_this_process(f"pdcheck-{role.name}")
    quiet_nixl_env(role.host)
    try:
        role.environment()
        role.t0 = time.perf_counter()
        regions, mem_type = role.memory()
        role.agent = Agent(role.agent_name, **role.agent_options())
        role.agent.register(regions, mem_type)
        ready = role.ready()
    except Exception as exc:  # reported to the launcher, which turns it into a harness error
        fail(role, exc)
        return
    try:
        m.send(conn, ready)
        role.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone or stopped the run: nothing to report to
    except Exception as exc:  # the traceback to the rank's log, one line to the parent; exit status 1
        traceback.print_exc()
        print(f"{role.name}: {_one_line(exc)}", file=sys.stderr, flush=True)
        fail(role, exc)
        raise SystemExit(1) from None


def _one_line(exc: BaseException) -> str:
    # pdcheck's own errors are already a sentence for the user; anything else is named by its type.
    text = " ".join(str(exc).split())
    return text if isinstance(exc, PdcheckError) and text else f"{type(exc).__name__}: {text or type(exc).__name__}"


def fail(role: Role, exc: BaseException) -> None:
    try:
        m.send(role.conn, m.Failed(role.spec.tp_rank, _one_line(exc)))
    except OSError:
        pass
