"""A thin wrapper over one NIXL agent: registration, remote agents, prepped READs, notifications.

Every NIXL failure becomes a NixlCallError that names the operation and the NIXL status, so reports
can show NIXL's own words (for example ``NIXL_ERR_INVALID_PARAM``) instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
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


def int32_ids(ids: np.ndarray, context: str) -> np.ndarray:
    """Descriptor ids as NIXL takes them (int32); ids beyond int32 are refused, never wrapped. An int32 array
    is taken as it is (a caller keeps converted ids to post them again)."""
    a = np.asarray(ids)
    if a.dtype == np.int32 and a.flags.c_contiguous:
        return a
    if a.size and (int(a.max()) >= 2**31 or int(a.min()) < 0):
        bad = int(a.max()) if int(a.max()) >= 2**31 else int(a.min())
        raise NixlCallError("make_prepped_xfer", "NIXL_ERR_INVALID_PARAM", f"descriptor id {bad} is not an int32",
                            context)
    return np.ascontiguousarray(a, dtype=np.int32)


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
    docs/transfer-bench.md, "NIXL cost model"); pdcheck polls from its own loop instead.
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
        # nixl_cu13: the one NIXL build pdcheck depends on (pyproject.toml says why)
        from nixl_cu13._api import nixl_agent, nixl_agent_config

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
        # Posting goes straight to NIXL's bindings (the module nixl_agent comes from always has them).
        bind = sys.modules[type(self._a).__module__].nixlBind
        self._fast: tuple[Any, Any, Any, Any] = (self._a.agent.postXferReq, self._a.agent.getXferStatus,
                                                 bind.NIXL_IN_PROG, bind.NIXL_SUCCESS)
        self._names = {getattr(bind, k): k for k in dir(bind) if k.startswith("NIXL_ERR_")}

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

    def remove_remote(self, agent: str) -> None:
        """Forget a peer's metadata (a re-handshake: its process was replaced)."""
        nixl_call("remove_remote_agent", self.name, self._a.remove_remote_agent, agent)

    def post(self, h: Any) -> str:
        """Post handle h without waiting: its state right after ("PROC", "DONE" or "ERR")."""
        return str(nixl_call("transfer", self.name, self._a.transfer, h))

    def state(self, h: Any) -> str:
        return str(nixl_call("check_xfer_state", self.name, self._a.check_xfer_state, h))

    def prep(self, agent: str, descs: np.ndarray, mem_type: str, context: str = "") -> Any:
        xd = nixl_call("get_xfer_descs", context or self.name, self._a.get_xfer_descs, descs, mem_type)
        return nixl_call("prep_xfer_dlist", context or agent, self._a.prep_xfer_dlist, agent, xd)

    def release_dlist(self, *dlists: Any) -> None:
        for d in dlists:
            nixl_call("release_dlist_handle", self.name, self._a.release_dlist_handle, d)

    def make_read(self, local: Any, local_ids: np.ndarray, remote: Any, remote_ids: np.ndarray,
                  notif: bytes = b"", context: str = "", op: str = "READ") -> Any:
        """One prepped READ handle over descriptor ids of two prepped dlists (kvcache.desc_ids); post it with
        complete() or timed(), as often as needed, and give it back with release(). op="WRITE": a WRITE (SGLang's
        P pushes into D)."""
        lid, rid = int32_ids(local_ids, context), int32_ids(remote_ids, context)
        return nixl_call("make_prepped_xfer", context, self._a.make_prepped_xfer, op, local, lid, remote, rid,
                         notif)

    def release(self, *handles: Any) -> None:
        for h in handles:
            nixl_call("release_xfer_handle", self.name, self._a.release_xfer_handle, h)

    def complete(self, h: Any, context: str = "", timeout_s: float | None = None, yield_cpu: bool = False) -> None:
        """Post handle h and busy-poll it to completion. Raises NixlCallError (a NIXL error, or TIMEOUT).
        yield_cpu: give up the core between polls, for a READ that needs the target's loop to progress."""
        self.wait(h, context, timeout_s, yield_cpu)

    def start(self, h: Any, context: str = "") -> Any:
        """Post handle h without waiting: the raw state to finish it with wait(started=...), other transfers
        posted meanwhile. Raises NixlCallError."""
        try:
            return self._fast[0](h._handle, b"")
        except Exception as exc:  # the bindings raise nixl*Error classes
            raise NixlCallError("transfer", _status(exc), f"{type(exc).__name__}: {exc}".strip(), context) from exc

    def wait(self, h: Any, context: str = "", timeout_s: float | None = None, yield_cpu: bool = False,
             started: Any = None) -> None:
        """complete(), or for a handle start() posted (started: its raw state) the busy-poll alone."""
        post, status, busy, ok = self._fast
        try:
            hh = h._handle
            st = post(hh, b"") if started is None else started
            if timeout_s is None:
                while st == busy:
                    st = status(hh)
            else:
                deadline, spins = time.perf_counter() + timeout_s, 0
                while st == busy:
                    if yield_cpu:
                        os.sched_yield()
                    st = status(hh)
                    spins += 1
                    if not spins & 1023 and time.perf_counter() > deadline:  # a clock read costs a poll
                        raise NixlCallError("check_xfer_state", "TIMEOUT", f"READ not done after {timeout_s:g} s",
                                            context)
        except NixlCallError:
            raise
        except Exception as exc:  # the bindings raise nixl*Error classes
            raise NixlCallError("transfer", _status(exc), f"{type(exc).__name__}: {exc}".strip(), context) from exc
        if st != ok:
            raise NixlCallError("transfer", self._names.get(st, str(st)), "transfer state ERR", context)

    def done(self, h: Any, context: str = "") -> bool:
        """One look at a handle start() posted: True once its transfer is done, False while under way. Raises
        NixlCallError on a NIXL error."""
        _post, status, busy, ok = self._fast
        try:
            st = status(h._handle)
        except Exception as exc:  # the bindings raise nixl*Error classes
            raise NixlCallError("check_xfer_state", _status(exc), f"{type(exc).__name__}: {exc}".strip(),
                                context) from exc
        if st == busy:
            return False
        if st != ok:
            raise NixlCallError("transfer", self._names.get(st, str(st)), "transfer state ERR", context)
        return True

    def timed(self, handles: Sequence[Any], iters: int, context: str = "") -> tuple[list[int], int]:
        """`iters` transfers cycling over `handles`, each posted and busy-polled to completion: per-transfer
        ns and the loop's wall ns (transfer-bench's measured loop).

        NIXL's bindings directly (the Python wrapper adds ~0.3 µs per call): the raw loop of
        benchmarks/raw_nixl_loop.py plus two clock reads and an append; the try costs nothing per pass."""
        post, status, busy, ok = self._fast
        now = time.perf_counter_ns
        lat: list[int] = []
        append = lat.append
        hs = [h._handle for h in handles]
        n = len(hs)
        st = ok
        try:
            start = now()
            for i in range(iters):
                hh = hs[i % n]
                t0 = now()
                st = post(hh, b"")
                while st == busy:
                    st = status(hh)
                append(now() - t0)
                if st != ok:
                    break
            wall = now() - start
        except Exception as exc:  # the bindings raise nixl*Error classes
            raise NixlCallError("transfer", _status(exc), f"{type(exc).__name__}: {exc}".strip(), context) from exc
        if st != ok:
            raise NixlCallError("transfer", self._names.get(st, str(st)), "transfer state ERR", context)
        return lat, wall

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
        yield_cpu: bool = False,
    ) -> float:
        """One prepped READ (op="WRITE": a WRITE), posted and busy-polled to completion: seconds. Raises
        NixlCallError."""
        t0 = time.perf_counter()
        h = self.make_read(local, local_ids, remote, remote_ids, notif, context, op)
        try:
            self.complete(h, context, timeout_s, yield_cpu)
            return time.perf_counter() - t0
        finally:
            self._a.release_xfer_handle(h)  # not release(): a failed release must not hide the READ's error

    def desc_count(self, h: Any) -> int:
        """Descriptors NIXL posted for handle h after merging (telemetry; an agent made with telemetry=True)."""
        return int(nixl_call("get_xfer_telemetry", self.name, self._a.get_xfer_telemetry, h).descCount)

    def progress(self) -> int:
        """Drive the UCX worker once (a target's only progress without a thread): notifications received."""
        got = self._a.get_new_notifs()
        return sum(len(v) for v in got.values()) if got else 0

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
