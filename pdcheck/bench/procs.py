"""Rank processes: spawn, pin, talk to, and always reap.

Each rank is a fresh interpreter (`python -m pdcheck.bench.rank`) so that its C-level stdout, where
UCX prints its protocol tables, lands in its own log file. Ranks run in their own session, so a
terminal Ctrl-C reaches only the parent, which then stops them; they also die with the parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec
import zmq

import pdcheck
from pdcheck.bench import protocol as pr
from pdcheck.errors import HarnessError, RankFailed, RankTimeout

M = TypeVar("M")


def assign_cores(ptp: int, dtp: int, pin: bool) -> tuple[dict[str, list[int]], str]:
    """Cores per rank label, and a note when the machine cannot give every rank its own core."""
    labels_p = [f"P{i}" for i in range(ptp)]
    labels_d = [f"D{i}" for i in range(dtp)]
    if not pin:
        return {lbl: [] for lbl in labels_p + labels_d}, "--no-pin"
    avail = sorted(os.sched_getaffinity(0))
    if len(avail) < 2:
        return {lbl: [] for lbl in labels_p + labels_d}, "only one usable core: prefill and decode share it"
    if len(avail) >= ptp + dtp:
        cores = {lbl: [avail[i]] for i, lbl in enumerate(labels_p + labels_d)}
        return cores, ""
    # Fewer cores than ranks: keep the two roles apart, share cores within a role.
    k = max(1, min(len(avail) - 1, round(len(avail) * ptp / (ptp + dtp))))
    cores = {lbl: [avail[i % k]] for i, lbl in enumerate(labels_p)}
    cores.update({lbl: [avail[k + i % (len(avail) - k)]] for i, lbl in enumerate(labels_d)})
    return cores, f"{ptp + dtp} ranks on {len(avail)} cores: ranks of one role share cores (oversubscribed)"


def rank_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env.setdefault("UCX_PROTO_INFO", "y")  # the protocol tables we parse for the transport diagnosis
    root = str(Path(pdcheck.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class Proc:
    label: str
    popen: subprocess.Popen[bytes]
    out: Path
    err: Path

    def last_error_line(self) -> str:
        try:
            lines = [ln.strip() for ln in self.err.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""


class Ranks:
    """Context manager over all rank processes and the parent's ROUTER socket (127.0.0.1 only)."""

    def __init__(self, labels: list[str], env: Mapping[str, str], log_dir: Path, run_id: str) -> None:
        self.labels = labels
        self.env = dict(env)
        self.log_dir = log_dir
        self.run_id = run_id
        self.procs: dict[str, Proc] = {}
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stopping = False

    def __enter__(self) -> Ranks:
        try:
            for label in self.labels:
                self._spawn(label)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, label: str) -> None:
        out, err = self.log_dir / f"{label}.out", self.log_dir / f"{label}.err"
        cmd = [sys.executable, "-m", "pdcheck.bench.rank", "--control", f"tcp://127.0.0.1:{self.port}",
               "--role", label[0], "--rank", label[1:], "--run-id", self.run_id]
        with open(out, "wb") as fo, open(err, "wb") as fe:
            popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe, env=self.env,
                                     start_new_session=True, close_fds=True)
        self.procs[label] = Proc(label, popen, out, err)

    def send(self, labels: Iterable[str], msg: pr.Msg) -> None:
        data = pr.pack(msg)
        for label in labels:
            self.sock.send_multipart([label.encode(), data])

    def gather(self, labels: Iterable[str], kind: type[M], timeout: float, what: str) -> dict[str, M]:
        pending = set(labels)
        got: dict[str, M] = {}
        deadline = time.monotonic() + timeout
        while pending:
            if self.sock.poll(100):
                ident, data = self.sock.recv_multipart()
                label = ident.decode(errors="replace")
                try:
                    msg = pr.unpack(data)
                except msgspec.DecodeError as exc:
                    raise HarnessError(f"{label} sent an undecodable control message: {exc}") from exc
                if isinstance(msg, pr.Failed):
                    raise RankFailed(f"rank {label} failed while {what}: {msg.message}")
                if not isinstance(msg, kind):
                    raise HarnessError(f"rank {label} sent {type(msg).__name__} while {what}")
                got[label] = msg
                pending.discard(label)
                continue
            if kind is not pr.Bye:
                self._check_alive(what)
            if time.monotonic() > deadline:
                raise RankTimeout(f"rank(s) {', '.join(sorted(pending))} did not answer within {timeout:g} s "
                                  f"while {what} (raise --timeout for very large rows)")
        return got

    def _check_alive(self, what: str) -> None:
        for p in self.procs.values():
            rc = p.popen.poll()
            if rc is not None:
                why = p.last_error_line()
                raise RankFailed(f"rank {p.label} exited with code {rc} while {what}" + (f": {why}" if why else ""))

    def wait_exit(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Idempotent: stop what still runs (TERM, then KILL), reap everything, free the port."""
        for p in self.procs.values():
            if p.popen.poll() is None:
                try:
                    os.kill(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3.0
        for p in self.procs.values():
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        if not self.sock.closed:
            self.sock.close(0)
            self.ctx.term()
