"""Starts rank processes from one forkserver that preloads NIXL, numpy, zmq and msgspec once.

A fresh interpreter per rank would pay the imports 16 times on 2 cores; a forked child pays nothing.
Every child is reaped on success, on error and on Ctrl-C (close() is idempotent and always runs).

Over the ~500 lines a module keeps to: the forkserver, the Launcher and its reaping, and the UCX shared-memory
segments a killed rank leaves are one concern (a rank's whole life on this host); Ray's placement is raylaunch.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import popen_forkserver, spawn
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from pdcheck import messages as m
from pdcheck.errors import BadInput, HarnessError
from pdcheck.placement import Named, Place, RankLauncher, rounds

# What the forkserver imports once for every rank; a framework's rank modules join when the registry loads it
# (pdcheck.frameworks.get -> preload), before the forkserver starts.
_PRELOAD = ["numpy", "zmq", "msgspec", "nixl_cu13._api", "pdcheck.bench.rank"]
_CTX: mp.context.BaseContext | None = None


def preload(modules: Iterable[str]) -> None:
    """Modules the forkserver imports before forking ranks (their bodies). Only a forkserver not yet started
    takes them; a rank whose module it lacks imports it itself."""
    _PRELOAD.extend(mod for mod in modules if mod not in _PRELOAD)
    if _CTX is not None:
        _CTX.set_forkserver_preload(list(_PRELOAD))


def _context() -> mp.context.BaseContext:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        _CTX = ctx
    return _CTX


_GET_PREP = spawn.get_preparation_data


def warm_up() -> None:
    """Start the forkserver now: it imports NIXL, numpy and zmq in its own process while the parent
    still imports the CLI, instead of after it. lifecycle.shutdown() stops it on every exit path."""
    _context()
    try:
        _ensure_forkserver()
    except HarnessError:
        pass  # only a head start: the first rank's start tries again and says why it cannot


_SHM_AT_START: list[set[str]] = []  # the UCX segments in /dev/shm before this process's forkserver started


def _ensure_forkserver() -> None:
    """Start the forkserver (and resource tracker) if none runs, immune to Ctrl-C (see lifecycle)."""
    from multiprocessing import forkserver

    from pdcheck.lifecycle import spawn_quietly

    if not _SHM_AT_START:
        _SHM_AT_START.append(ucx_segments())
    try:
        spawn_quietly(forkserver.ensure_running)
    except OSError as exc:  # e.g. its socket's path under $TMPDIR over the 107 bytes a Unix socket address holds
        raise HarnessError(f"the rank forkserver cannot start: {exc.strerror or exc} (its socket lives in "
                           f"$TMPDIR={os.environ.get('TMPDIR', '/tmp')})") from None


def _prep_without_main(name: str) -> dict[str, Any]:
    data = _GET_PREP(name)
    data.pop("init_main_from_path", None)
    data.pop("init_main_from_name", None)
    return data


_LAUNCH_LOCK = threading.Lock()  # smoke starts ranks from several threads; the swap below is process-wide


class _Popen(popen_forkserver.Popen):
    """multiprocessing re-runs `__main__` in every child: for the `pdcheck` console script that re-imports
    the whole CLI (typer, rich) in each rank, a third of a rank's start-up. Rank targets live in modules the
    forkserver preloads, so the children need no `__main__` at all."""

    def _launch(self, process_obj: Any) -> None:
        with _LAUNCH_LOCK:
            spawn.get_preparation_data = _prep_without_main  # type: ignore[assignment]
            try:
                super()._launch(process_obj)
            finally:
                spawn.get_preparation_data = _GET_PREP  # type: ignore[assignment]


class _RankProcess(mp.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:  # type: ignore[override]
        return _Popen(process_obj)


def _logged(target: Callable[[Connection, bytes], None], log: str, conn: Connection, spec: bytes) -> None:
    """In the forked rank: fd 1 and 2 to its own log file, then run the rank (pdcheck.lifecycle.rank_body)."""
    from pdcheck.lifecycle import rank_body

    rank_body(target, log, conn, spec)


def stop_forkserver() -> None:
    """Stop the forkserver and the resource tracker; a later run starts fresh ones. Idempotent: one already
    gone (and reaped) is forgotten.

    The forkserver is SIGKILLed, not asked to stop: by now every rank is reaped (Launcher.close, or it died
    and no rank could start), so it has nothing left to do, and its orderly exit finalizes numpy and NIXL
    (~0.08 s) while this process waits for it (either way, a child still running would outlive it). The
    resource tracker gets the stdlib's orderly stop: it unlinks what ranks may have leaked."""
    global _CTX
    if _CTX is None:
        return
    from multiprocessing import forkserver, resource_tracker, util

    fs = getattr(forkserver, "_forkserver", None)
    if fs is not None:
        with fs._lock:
            pid, fd, address = fs._forkserver_pid, fs._forkserver_alive_fd, fs._forkserver_address
            fs._forkserver_pid = fs._forkserver_alive_fd = fs._forkserver_address = None
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
            if pid is not None:
                _kill(pid, signal.SIGKILL)
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:  # already reaped (forkserver_alive() saw it die)
                    pass
            if address is not None and not util.is_abstract_socket_namespace(address):
                try:
                    os.unlink(address)
                except OSError:
                    pass
    _stop_tracker(getattr(resource_tracker, "_resource_tracker", None))
    if _SHM_AT_START:  # a forkserver killed in the middle of its work may leave a UCX segment (see below)
        remove_leaked_segments(_SHM_AT_START.pop())
    _CTX = None


TRACKER_STOP_S = 2.0  # the tracker's own clean-up (unlinking what ranks leaked) takes milliseconds


def _stop_tracker(rt: Any) -> None:
    """multiprocessing's resource tracker, stopped as ResourceTracker._stop does (close our end of its pipe: it
    unlinks what ranks registered and leaked, then exits), but waited for TRACKER_STOP_S at most, then
    SIGKILLed. The stdlib waits for ever, and the tracker exits only once every process holding that pipe has:
    each rank the forkserver forked holds it, so a rank nobody stopped used to hang this process's exit."""
    if rt is None or getattr(rt, "_fd", None) is None:
        return
    with rt._lock:
        fd, pid = rt._fd, rt._pid
        rt._fd = rt._pid = None
        try:
            os.close(fd)
        except OSError:
            pass
        if pid is None:
            return
        t_end = time.monotonic() + TRACKER_STOP_S
        while True:
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # already reaped
                return
            if done:
                return
            if time.monotonic() >= t_end:
                _kill(pid, signal.SIGKILL)
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
                return
            time.sleep(0.01)


@dataclass
class Rank(Named):
    role: str  # "P" or "D"
    tp_rank: int
    proc: BaseProcess
    conn: Connection
    done: bool = False  # sent its final message
    stopped: str | None = None  # why pdcheck itself stopped it (abort_all): its end is no death to report

    @property
    def pid(self) -> int | None:
        """Its process id on this host (None: it runs elsewhere)."""
        return self.proc.pid

    def reap(self, timeout_s: float) -> int | None:
        """Wait up to timeout_s for it to end: its exit code (negative: the signal), None if still running."""
        self.proc.join(timeout_s)
        return self.proc.exitcode

    def send(self, msg: m.Msg) -> None:
        try:
            m.send(self.conn, msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the rank is gone; its sentinel reports that

    def running(self) -> bool:
        """Still running, by pid, and still this rank (its /proc name), never a process that reused the pid."""
        if not running(self.proc.pid):
            return False
        try:
            with open(f"/proc/{self.proc.pid}/comm", "rb") as f:
                comm = f.read().strip()
        except OSError:
            return False
        return self.proc.exitcode is None or comm.split(b":")[0] == f"pdcheck-{self.id.short}".encode()

    def ended(self) -> str:
        """How the rank ended, for 'P rank 1 died: it ...' (every placement backend's ranks answer this)."""
        if self.stopped is not None:
            return f"was stopped by pdcheck ({self.stopped})"
        return how_it_ended(self.proc.exitcode)


def how_it_ended(code: int | None) -> str:
    """'killed by SIGKILL' / 'exited with code 17' for a process exit code."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def name_this_process(name: str) -> None:
    """Set the kernel's name of this process (/proc/PID/comm, what ps and top show): 'pdcheck-D3'. Lets a
    user (and the fault tests) tell the forked ranks apart; they all share the forkserver's command line."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def running(pid: int | None) -> bool:
    """The process exists and is not a zombie (/proc: ranks and their forkserver run on Linux only)."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def forkserver_alive() -> bool:
    """The forkserver parents every rank; when it dies, the ranks' sentinels close although they may run on."""
    pid = _forkserver_pid()
    if pid is None:
        return True
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


# Every local launcher with ranks, so that an interrupt can stop the runs of other threads (smoke runs scenarios
# side by side in threads; only the main thread sees the signal): abort_all().
_LIVE: set[Launcher] = set()
_LIVE_LOCK = threading.Lock()
_aborted: list[str] = []


def abort_all(why: str = "interrupted") -> None:
    """Stop every rank of every launcher of this process now (SIGKILL) and refuse new ones: the runs waiting
    on them see their ranks die and end; each launcher's close() still reaps its own. Idempotent."""
    with _LIVE_LOCK:
        if not _aborted:
            _aborted.append(why)
        for lau in list(_LIVE):
            for r in lau.ranks:
                if r.running():
                    r.stopped = why  # before the kill: the thread that waits on it must not call it a death
                    _kill(r.proc.pid, signal.SIGKILL)


def close_all() -> None:
    """Stop and reap the ranks of every local launcher not closed yet (lifecycle.shutdown, on every exit path):
    a command interrupted after a rank was forked and recorded, but before the `try` whose `finally` closes its
    launcher, would otherwise leave that rank running. Idempotent."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for lau in live:
        lau.close()


def aborted() -> str | None:
    """Why abort_all() stopped this process's runs, if it did."""
    return _aborted[0] if _aborted else None


def reset_abort() -> None:
    """Let ranks start again after abort_all() (a test, or an in-process caller that handled the interrupt)."""
    with _LIVE_LOCK:
        _aborted.clear()


class Launcher(RankLauncher[Rank]):
    """Local placement: every rank a forked child on this host. The placement seam: place(), start() (with an
    optional log file), events(), close() and hold_host, and ranks that answer id, label, send(), ended(), pid,
    reap() and done; pdcheck.raylaunch.RayLauncher answers the same calls with Ray actors on other nodes.
    pdcheck.orchestrate drives the ranks over either."""

    hold_host: str | None = None  # where the parent holds silent side-channel ports; None: the scenario's P host

    def __init__(self) -> None:
        self.ranks: list[Rank] = []
        self.shm_before = ucx_segments()  # see remove_leaked_segments
        self.log_dir: str | None = None  # where ranks started without a log= write theirs (lifecycle's)

    def place(self, ranks: list[tuple[str, int]], gpu: bool = False) -> dict[tuple[str, int], Place]:
        """(role, tp_rank) -> where it will run. Locally: this host, at the scenario's addresses."""
        node = socket.gethostname()
        return {key: Place(None, node) for key in ranks}

    def start(self, role: str, tp_rank: int, target: Callable[[Connection, bytes], None], spec: bytes,
              log: str | None = None) -> Rank:
        """Fork a rank from the forkserver; it runs target(pipe, spec). log: a file that takes the rank's fd 1
        and 2, C-level output included (UCX prints its protocol tables there); None: <role><tp_rank>.log in
        this run's rank-log directory (pdcheck.lifecycle)."""
        from pdcheck import lifecycle

        ctx = _context()
        if not forkserver_alive():
            # warm_up() started it early; multiprocessing would quietly start another, but a killed
            # forkserver is a harness failure whenever it happens.
            stop_forkserver()
            raise HarnessError(f"the rank forkserver died before {role} rank {tp_rank} started; nothing was left "
                               "running")
        if log is None:
            if self.log_dir is None:
                self.log_dir = lifecycle.rank_log_dir()
            log = os.path.join(self.log_dir, f"{role}{tp_rank}.log")
        parent, child = ctx.Pipe(duplex=True)
        proc = _RankProcess(target=_logged, args=(target, log, child, spec), name=f"pdcheck-{role}{tp_rank}",
                            daemon=True)
        try:
            _ensure_forkserver()  # proc.start() would start one too, but one that Ctrl-C interrupts
        except HarnessError:
            parent.close()
            child.close()
            raise
        try:
            # Signals wait until the rank is in self.ranks: one forked but not recorded would outlive close().
            # (Not around the forkserver's start: a process spawned meanwhile would inherit the blocked signals.)
            with lifecycle.signals_deferred():
                proc.start()
                child.close()
                rank = Rank(role, tp_rank, proc, parent)
                with _LIVE_LOCK:  # recorded before abort_all() can look, or stopped here if it already did
                    self.ranks.append(rank)
                    _LIVE.add(self)
                    if _aborted:
                        _kill(proc.pid, signal.SIGKILL)
            if _aborted:
                raise KeyboardInterrupt(_aborted[0])
        except (EOFError, OSError) as exc:  # the forkserver died (or could not start): no rank can start
            parent.close()
            child.close()
            stop_forkserver()
            raise HarnessError(f"the rank forkserver died while starting {role} rank {tp_rank} "
                               f"({type(exc).__name__}: {exc or 'connection closed'}); nothing was left running") \
                from None
        return rank

    def events(self, ranks: list[Rank], deadline: float) -> Iterator[tuple[Rank, m.Msg | None]]:
        """Yield (rank, message) as they arrive; (rank, None) when a rank's process ends. Stops at deadline."""
        for live, left in rounds(ranks, deadline):
            by_obj: dict[object, Rank] = {}
            for r in live:
                by_obj[r.conn] = r
                by_obj[r.proc.sentinel] = r
            for obj in wait(list(by_obj), timeout=left):
                r = by_obj[obj]
                if r.done:
                    continue
                if obj is r.conn:
                    try:
                        data = r.conn.recv_bytes()
                    except (EOFError, OSError):  # the pipe closed: the process is ending, learn how
                        r.proc.join(1.0)
                        r.done = True
                        yield r, None
                        continue
                    yield r, m.unpack(data)
                elif not r.conn.poll():  # process ended and nothing left to read
                    # The forkserver reaps a rank before it writes the status and closes the sentinel, so a
                    # closed sentinel with the rank still running means the forkserver itself is gone.
                    if not forkserver_alive() or running(r.proc.pid):
                        raise HarnessError("the rank forkserver died (killed?); every rank was stopped")
                    r.proc.join(0.5)
                    r.done = True
                    yield r, None

    def close(self) -> None:
        """Stop and reap every rank: SIGKILL (a rank ignores SIGTERM, so that a signal to the process group
        reaches only the parent: lifecycle.spawn_quietly), then up to 2 s for it to end. Signals go by pid
        whenever the rank still runs, even when multiprocessing thinks it ended (its forkserver died and can no
        longer report it)."""
        for r in self.ranks:
            if r.running():
                _kill(r.proc.pid, signal.SIGKILL)
        t_end = time.monotonic() + 2.0
        for r in self.ranks:
            while r.running() and time.monotonic() < t_end:
                r.proc.join(0.05)
            r.proc.join(0.5)
            r.conn.close()
        with _LIVE_LOCK:
            self.ranks.clear()
            _LIVE.discard(self)
        remove_leaked_segments(self.shm_before)


SHM_DIR = "/dev/shm"
UCX_SHM_PREFIX = "ucx_shm_posix_"


def ucx_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(UCX_SHM_PREFIX)}
    except OSError:
        return set()


def remove_leaked_segments(before: set[str]) -> list[str]:
    """Remove the UCX shared-memory segments a killed rank left in /dev/shm; returns their names.

    UCX's posix transport creates a segment with shm_open and unlinks its name right after (it is reached
    through /proc/PID/fd), so a name still in /dev/shm after the ranks are reaped is one whose creator died in
    between (SIGKILL, or a signal during start-up). Removed only if all three hold: it appeared since this
    launcher started, it belongs to this user, and no live process holds it open or mapped. The creator holds
    it from shm_open on, so a segment another run is creating right now is never taken; one another run
    leaked is garbage nobody can reach, and its own parent would remove it the same way."""
    fresh = ucx_segments() - before
    if not fresh:
        return []
    uid = os.getuid()
    mine = set()
    for name in fresh:
        try:
            if os.lstat(f"{SHM_DIR}/{name}").st_uid == uid:
                mine.add(name)
        except OSError:
            pass
    held = _held_segments(mine) if mine else set()
    removed = []
    for name in sorted(mine - held):
        try:
            os.unlink(f"{SHM_DIR}/{name}")
            removed.append(name)
        except OSError:
            pass
    return removed


def _held_segments(names: set[str]) -> set[str]:
    """Which of `names` some live process this user can inspect has open or mapped."""
    paths = {f"{SHM_DIR}/{n}": n for n in names}
    held: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target in paths:
                    held.add(paths[target])
            with open(f"/proc/{pid}/maps", "rb") as f:
                maps = f.read()
        except OSError:
            # Ended meanwhile, or not ours to read (init, another user, a non-dumpable process): UCX ranks of
            # this user, ours or a parallel run's, are readable, and those are what creates these segments.
            continue
        for path, name in paths.items():
            if path.encode() in maps:
                held.add(name)
    return held


def _kill(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def check_ray(address: str) -> None:
    """BadInput before anything starts: --ray given empty, or Ray not installed."""
    import importlib.util

    if not address.strip():
        raise BadInput("--ray: expected a Ray cluster address (HOST:PORT, ray://HOST:PORT or auto)")
    if importlib.util.find_spec("ray") is None:
        raise BadInput("--ray: Ray is not installed here (pip install 'pdcheck[ray]')")


@contextmanager
def launcher(ray: str | None = None, place_timeout_s: float = 120.0) -> Iterator[RankLauncher[Any]]:
    """The rank launcher: local forked children, or (ray: a cluster address or 'auto') Ray actors."""
    lau: RankLauncher[Any]
    if ray is not None:
        from pdcheck.raylaunch import RayLauncher  # Ray is an optional extra: imported only when asked for

        lau = RayLauncher(ray, place_timeout_s)
    else:
        lau = Launcher()
    try:
        yield lau
    finally:
        lau.close()
