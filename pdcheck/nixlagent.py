"""A thin wrapper over one NIXL agent: registration, remote agents, prepped READs, notifications.

Every NIXL failure becomes a NixlCallError that names the operation and the NIXL status, so reports
can show NIXL's own words (for example ``NIXL_ERR_INVALID_PARAM``) instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdcheck.errors import NixlCallError

# The agent logs one INFO line per backend; ranks run many agents, keep the terminal quiet.
logging.getLogger("NIXL").setLevel(logging.WARNING)

LOCAL = "NIXL_INIT_AGENT"  # NIXL's name for the local side of a prepped dlist


def _status(exc: BaseException) -> str:
    text = str(exc).strip()
    for word in text.replace(":", " ").split():
        if word.startswith("NIXL_"):
            return word
    return type(exc).__name__


def nixl_call(op: str, context: str, fn: Any, *args: Any, **kw: Any) -> Any:
    """Call into NIXL's bindings; a failure becomes a NixlCallError naming the operation and NIXL's status."""
    try:
        return fn(*args, **kw)
    except NixlCallError:
        raise
    except Exception as exc:  # NIXL raises its own nixl*Error classes from the bindings
        raise NixlCallError(op, _status(exc), f"{type(exc).__name__}: {exc}".strip(), context) from exc


class Agent:
    """One NIXL agent with the UCX backend.

    No progress thread by default: on small hosts it spins a core and distorts everything (see
    transfer-bench-anchors §2.4); pdcheck polls from its own loop instead.
    """

    def __init__(
        self,
        name: str,
        *,
        progress_thread: bool = False,
        error_mode: str | None = None,
        telemetry: bool = False,
        engine_config: str | None = None,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        params: dict[str, str] = {}
        if error_mode:
            params["ucx_error_handling_mode"] = error_mode
        if engine_config:
            params["engine_config"] = engine_config
        # No listen thread: metadata travels over pdcheck's own side channel, never NIXL's TCP listener.
        cfg = nixl_agent_config(
            enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[],
            capture_telemetry=telemetry,
        )
        self._a = nixl_call("create agent", name, nixl_agent, name, cfg)
        nixl_call("create backend UCX", name, self._a.create_backend, "UCX", params)
        self._registered: list[Any] = []

    @property
    def raw(self) -> Any:
        return self._a

    def register(self, regions: Sequence[tuple[int, int, int]], mem_type: str) -> None:
        descs = nixl_call(
            "get_reg_descs", self.name, self._a.get_reg_descs,
            [(a, n, d, "") for a, n, d in regions], mem_type,
        )
        nixl_call("register_memory", self.name, self._a.register_memory, descs)
        self._registered.append(descs)

    def metadata(self) -> bytes:
        return bytes(self._a.get_agent_metadata())

    def add_remote(self, blob: bytes) -> str:
        name = nixl_call("add_remote_agent", self.name, self._a.add_remote_agent, blob)
        return name.decode() if isinstance(name, bytes) else str(name)

    def prep(self, agent: str, descs: np.ndarray, mem_type: str, context: str = "") -> Any:
        xd = nixl_call("get_xfer_descs", context or self.name, self._a.get_xfer_descs, descs, mem_type)
        return nixl_call("prep_xfer_dlist", context or agent, self._a.prep_xfer_dlist, agent, xd)

    def read(
        self,
        local: Any,
        local_ids: np.ndarray,
        remote: Any,
        remote_ids: np.ndarray,
        notif: bytes = b"",
        *,
        timeout_s: float = 30.0,
        context: str = "",
        op: str = "READ",
    ) -> float:
        """Post a prepped READ (op="WRITE": a WRITE, as SGLang's P pushes into D), busy-poll to completion,
        return seconds. Raises NixlCallError."""
        lid = np.ascontiguousarray(local_ids, dtype=np.int32)
        rid = np.ascontiguousarray(remote_ids, dtype=np.int32)
        t0 = time.perf_counter()
        h = nixl_call("make_prepped_xfer", context, self._a.make_prepped_xfer, op, local, lid, remote, rid, notif)
        try:
            state = nixl_call("transfer", context, self._a.transfer, h)
            deadline = t0 + timeout_s
            while state not in ("DONE", "ERR"):
                if time.perf_counter() > deadline:
                    raise NixlCallError("check_xfer_state", "TIMEOUT", f"{op} not done after {timeout_s:g} s", context)
                state = nixl_call("check_xfer_state", context, self._a.check_xfer_state, h)
            if state == "ERR":
                raise NixlCallError("transfer", "NIXL_ERR_BACKEND", "transfer state ERR", context)
            return time.perf_counter() - t0
        finally:
            self._a.release_xfer_handle(h)

    def make_read(self, local: Any, local_ids: Any, remote: Any, remote_ids: Any, notif: bytes = b"",
                  context: str = "") -> Any:
        """A prepped READ handle, posted many times (transfer-bench); give it back with release()."""
        return nixl_call("make_prepped_xfer", context, self._a.make_prepped_xfer, "READ", local, local_ids, remote,
                         remote_ids, notif)

    def release(self, xfers: Sequence[Any] = (), dlists: Sequence[Any] = ()) -> None:
        """Give back transfer handles, then the prepped dlists they were made from."""
        for h in xfers:
            self._a.release_xfer_handle(h)
        for h in dlists:
            self._a.release_dlist_handle(h)

    def desc_count(self, xfer: Any, context: str = "") -> int:
        """NIXL telemetry (agent made with telemetry=True): descriptors the backend posted for a handle, after
        merging contiguous ones."""
        return int(nixl_call("get_xfer_telemetry", context, self._a.get_xfer_telemetry, xfer).descCount)

    def notif_count(self) -> int:
        """Progress the worker once; how many notifications arrived (their texts are dropped)."""
        got = self._a.get_new_notifs()  # a busy target calls this in a tight loop: nothing more when empty
        return sum(map(len, got.values())) if got else 0

    def send_notif(self, agent: str, msg: bytes) -> None:
        nixl_call("send_notif", agent, self._a.send_notif, agent, msg)

    def notifs(self) -> dict[str, list[bytes]]:
        got = self._a.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in got.items()}


def confine_ucx(host: str) -> None:
    """UCX's TCP transport listens on every network device (seen on eth0): with a loopback side channel,
    keep it on `lo` too. Read when the agent creates its UCX context, so this runs before Agent().
    A non-loopback --host leaves UCX its own device choice (the user asked for the network)."""
    if is_loopback(host):
        os.environ["UCX_NET_DEVICES"] = "lo"


def no_memory_hooks(device: str) -> None:
    """Host-memory handshake ranks run UCX without its memory hooks (UCX_MEM_EVENTS=no) unless the user set
    the variable. UCX patches mmap/munmap/brk so that its registration cache learns of unmapped memory: on
    this 2-vCPU VM that took 0.4 s of CPU per agent, ~90 % of a rank's start-up. pdcheck's KV caches are
    registered with NIXL explicitly and stay mapped for the whole run, and host transports (CMA, shared
    memory, TCP) keep no registration cache. GPU ranks keep UCX's default (its CUDA hooks feed memory-type
    detection), and so does transfer-bench, which measures a deployment's configuration."""
    if device == "cpu":
        os.environ.setdefault("UCX_MEM_EVENTS", "no")


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def quiet_nixl_env(host: str = "127.0.0.1") -> None:
    """Called first in rank processes: stdout belongs to the launcher's report (--json), so rank output
    goes to stderr, and NIXL's per-agent INFO lines are dropped. A terminal Ctrl-C reaches the whole
    process group: ranks ignore it and let the parent stop them in order."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():  # a Ray actor runs its rank in a thread
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    confine_ucx(host)
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    os.dup2(2, 1)
    for name in list(logging.root.manager.loggerDict):
        if name.lower().startswith("nixl"):
            logging.getLogger(name).setLevel(logging.WARNING)
