"""`--ray ADDRESS`: every P and D rank a Ray actor on an existing Ray cluster (the optional `ray` extra).

P ranks go to nodes offering the `pdcheck_prefill` resource, D ranks to `pdcheck_decode` ones (one GPU each
with --device cuda). Each actor runs the same rank body as a local run (pdcheck.ranks) in a thread, over a
local pipe; the parent reaches it with Ray actor calls that carry msgspec-packed bytes only (messages.pack /
unpack, never a pickled object of ours). A P rank binds its node's own address and D ranks are told it, so
the side channel and NIXL cross the network between nodes. An actor's fd 1/2 (UCX's C-level lines too) go to
a per-rank log that comes back to the CLI's stderr when the run ends.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from pdcheck import messages as m
from pdcheck.errors import BadInput, HarnessError
from pdcheck.placement import Named, Place, RankId, RankLauncher, rounds

RESOURCE = {"P": "pdcheck_prefill", "D": "pdcheck_decode"}
_LOG_TAIL = 20_000  # bytes of a rank's log brought back to stderr
_FILE_LOG_MAX = 16 << 20  # bytes brought back to a rank's log file (transfer-bench parses UCX's tables there)
_JOIN_WAIT_S = 10.0  # how long placement waits for nodes with the wanted resources to join


@ray.remote(num_cpus=0, concurrency_groups={"recv": 1, "send": 1})
class RankActor:
    """One rank on its node. Its own calls run in order per group: `send` (parent -> rank) in submission
    order, `recv` (rank -> parent) one at a time; place/start/log in the default group."""

    def __init__(self, label: str) -> None:
        self.label = label
        fd, self.log_path = tempfile.mkstemp(prefix=f"pdcheck-{label.replace(' ', '')}-", suffix=".log")
        # The actor serves one rank: its stdout/stderr (Python and C-level) are that rank's log.
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives as long as the actor
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        self.parent, self.child = Pipe(duplex=True)

    def place(self) -> tuple[str, str, int, str]:
        """(this node's address, its Ray node id, this actor's pid, its host name). The address the node was
        started with (`ray start --node-ip-address`), which a worker's own route lookup
        (ray.util.get_node_ip_address) can miss."""
        node_id = ray.get_runtime_context().get_node_id()
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)
        return ip or ray.util.get_node_ip_address(), node_id, os.getpid(), socket.gethostname()

    def start(self, module: str, name: str, spec: bytes) -> None:
        target: Callable[[Connection, bytes], None] = getattr(importlib.import_module(module), name)
        threading.Thread(target=self._body, args=(target, spec), name=f"pdcheck-{self.label}", daemon=True).start()

    def _body(self, target: Callable[[Connection, bytes], None], spec: bytes) -> None:
        try:
            target(self.child, spec)
        except SystemExit:  # the rank skeleton's "failed" exit: it already logged why and told the parent
            pass
        except BaseException:  # the rank's traceback belongs in its log; the parent sees the pipe close
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            self.child.close()

    @ray.method(concurrency_group="recv")
    def recv(self) -> bytes | None:
        """The rank's next message (msgspec bytes); None once its body ended."""
        try:
            return self.parent.recv_bytes()
        except (EOFError, OSError):
            return None

    @ray.method(concurrency_group="send")
    def send(self, data: bytes) -> None:
        try:
            self.parent.send_bytes(data)
        except (BrokenPipeError, OSError):
            pass  # the rank ended; its recv reports that

    def log(self, tail: int = _LOG_TAIL) -> str:
        """The last `tail` bytes of the rank's log; the file is removed, since the run ends after this call
        (ray.kill runs no clean-up in the actor, and every Ray run would leave one file per rank in /tmp)."""
        sys.stdout.flush()
        sys.stderr.flush()
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - tail))
            text = f.read().decode(errors="replace")
        os.unlink(self.log_path)  # fd 1 and 2 stay open on the unlinked file until the actor is killed
        return text


@dataclass(eq=False)
class RayRank(Named):
    role: str
    tp_rank: int
    actor: Any
    node: str
    done: bool = False
    pending: Any = None  # the outstanding recv() call
    how: str = "is still running"
    pid: int | None = None  # its actor's process id when that runs on this host, else None
    stopped: str | None = None  # pdcheck stops Ray actors only at close(): never set while a run waits on them

    def reap(self, timeout_s: float) -> int | None:
        """An actor has no exit code the parent can see: None (ended() says how it ended)."""
        return None

    def send(self, msg: m.Msg) -> None:
        self.actor.send.remote(m.pack(msg))  # runs even if its ref is dropped; a dead rank shows in recv

    def ended(self) -> str:
        return self.how


class RayLauncher(RankLauncher[RayRank]):
    """The placement seam (pdcheck.placement.RankLauncher) over Ray actors."""

    def __init__(self, address: str, place_timeout_s: float = 120.0) -> None:
        self.address = address
        # Before ray.init, which retries an absent cluster for minutes; the local end of that connection is the
        # address the cluster reaches this process at, where D ranks find the parent's held ports.
        local = _reachable(address, place_timeout_s)
        try:
            # log_to_driver off: stdout is the report's (--json); rank logs come back by RankActor.log.
            ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=True)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise BadInput(f"--ray {address}: cannot connect to a Ray cluster there ({exc})") from None
        self.hold_host: str | None = local or ray.util.get_node_ip_address()
        self.actors: dict[tuple[str, int], Any] = {}
        self.places: dict[tuple[str, int], Place] = {}
        self.pids: dict[tuple[str, int], int | None] = {}
        self.logs: dict[tuple[str, int], str] = {}  # rank -> the local file its whole log comes back to
        self.ranks: list[RayRank] = []
        self.start_timeout_s = place_timeout_s

    def place(self, ranks: list[tuple[str, int]], gpu: bool = False,
              nodes: dict[tuple[str, int], str] | None = None) -> dict[tuple[str, int], Place]:
        """Place ranks by role resource; nodes: ranks pinned to a Ray node id instead (doctor's pair matrix),
        which need no pdcheck resource on that node."""
        nodes = nodes or {}
        pinned = {key: n for key, n in nodes.items() if key in ranks}
        ranks_all, ranks = ranks, [k for k in ranks if k not in pinned]
        want = {RESOURCE[role]: sum(1 for r, _ in ranks if r == role) for role in RESOURCE}
        have = ray.cluster_resources()
        t_end = time.monotonic() + _JOIN_WAIT_S
        while any(have.get(k, 0) < n for k, n in want.items()) and time.monotonic() < t_end:
            time.sleep(0.5)  # nodes started a moment ago may still be joining
            have = ray.cluster_resources()
        for role in ("P", "D"):
            want = sum(1 for r, _ in ranks if r == role)
            if want and have.get(RESOURCE[role], 0) < want:
                raise BadInput(f"--ray {self.address}: {want} {role} rank(s) need {want} x {RESOURCE[role]}; the "
                               f"cluster offers {have.get(RESOURCE[role], 0):g} (ray start --resources "
                               f"'{{\"{RESOURCE[role]}\": {want}}}' on the {role} nodes)")
            if want and gpu and have.get("GPU", 0) < len(ranks):
                raise BadInput(f"--ray {self.address}: --device cuda needs one GPU per rank ({len(ranks)}); the "
                               f"cluster offers {have.get('GPU', 0):g}")
        for key in ranks_all:
            role, r = key
            where: dict[str, Any] = {"resources": {RESOURCE[role]: 1}}
            if key in pinned:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(pinned[key], soft=False)}
            self.actors[key] = RankActor.options(  # type: ignore[attr-defined]
                num_gpus=1 if gpu else 0, name=None, **where,
            ).remote(str(RankId(role, r)))
        refs = {key: self.actors[key].place.remote() for key in ranks_all}
        try:
            got = ray.get(list(refs.values()), timeout=self.start_timeout_s)
        except GetTimeoutError:
            raise HarnessError(f"Ray did not place every rank within {self.start_timeout_s:g} s") from None
        except RayActorError as exc:
            raise HarnessError(f"a Ray rank actor died while starting: {_short(exc)}") from None
        here = socket.gethostname()
        for key, (ip, node_id, pid, host) in zip(refs, got, strict=True):
            self.places[key] = Place(ip, f"{ip} (ray node {node_id[:8]})")
            self.pids[key] = pid if host == here else None
        return {key: self.places[key] for key in ranks_all}

    def start(self, role: str, tp_rank: int, target: Callable[[Connection, bytes], None], spec: bytes,
              log: str | None = None) -> RayRank:
        """As Launcher.start. log: a local file that takes the rank's whole log when the run ends (else its
        tail goes to stderr)."""
        key = (role, tp_rank)
        if key not in self.actors:
            self.place([key])
        if log is not None:
            self.logs[key] = log
        actor = self.actors[key]
        actor.start.remote(target.__module__, target.__name__, spec)
        rank = RayRank(role, tp_rank, actor, self.places[key].node, pid=self.pids.get(key))
        self.ranks.append(rank)
        return rank

    def events(self, ranks: list[RayRank], deadline: float) -> Iterator[tuple[RayRank, m.Msg | None]]:
        """As Launcher.events: (rank, message) as they arrive, (rank, None) when a rank's body or actor ended."""
        for live, left in rounds(ranks, deadline):
            for r in live:
                if r.pending is None:
                    r.pending = r.actor.recv.remote()
            by_ref = {r.pending: r for r in live}
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=left)
            for ref in ready:
                r = by_ref[ref]
                r.pending = None
                try:
                    data = ray.get(ref)
                except RayActorError as exc:
                    r.how, r.done = f"lost its Ray actor ({_short(exc)})", True
                    yield r, None
                    continue
                if data is None:
                    r.how, r.done = "ended (its rank body returned; see its log)", True
                    yield r, None
                    continue
                yield r, m.unpack(data)

    def close(self) -> None:
        """Bring every rank's log back (to its file, else to stderr), then end every actor and leave the
        cluster."""
        if not ray.is_initialized():
            return
        self.release(list(self.actors))
        self.ranks.clear()
        ray.shutdown()

    def release(self, keys: list[tuple[str, int]]) -> None:
        """Bring these ranks' logs back (to their files, else to stderr) and end their actors; the others and
        the cluster connection stay (doctor's pair matrix ends each pair as it finishes)."""
        actors = {key: self.actors.pop(key) for key in keys if key in self.actors}
        refs = {key: a.log.remote(_FILE_LOG_MAX if key in self.logs else _LOG_TAIL)
                for key, a in actors.items()}
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=10)
        for (role, r), ref in refs.items():
            try:
                text = ray.get(ref, timeout=0)
            except (GetTimeoutError, RayActorError):
                continue  # its actor is gone (the rank died with it): its harness error says so
            if (role, r) in self.logs:
                with open(self.logs[role, r], "w") as f:
                    f.write(text)
            elif text.strip():
                node = self.places.get((role, r))
                head = f"--- {role} rank {r} log ({node.node if node else 'unplaced'}) ---"
                sys.stderr.write(f"{head}\n{text.rstrip()}\n")
        sys.stderr.flush()
        for a in actors.values():
            ray.kill(a)


GCS_ANSWER_S = 10.0  # a Ray GCS answers GetClusterId in milliseconds; more than this is no GCS to run on
CLUSTER_ID_BYTES = 28  # Ray's ClusterID (a UniqueID)


def _reachable(address: str, timeout_s: float = GCS_ANSWER_S) -> str | None:
    """BadInput unless a Ray cluster's GCS answers at `address` ('auto': the one this node's `ray start`
    recorded, or RAY_ADDRESS) within min(timeout_s, GCS_ANSWER_S); returns this end's address of that connection.
    Asked before ray.init, which retries an address that accepts TCP but is no GCS (a silent port, one that sends
    junk) for minutes, printing its warnings. Ray Client addresses (ray://) are left to ray.init (None)."""
    if address.startswith("ray://"):
        return None
    from ray._private.services import canonicalize_bootstrap_address

    try:
        addr = canonicalize_bootstrap_address(address)
    except (ValueError, ConnectionError) as exc:
        raise BadInput(f"--ray {address}: {exc}".rstrip(".")) from None
    if addr is None:
        raise BadInput(f"--ray {address}: expected the address of a running Ray cluster (HOST:PORT or auto)")
    host, _, port = addr.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):
        raise BadInput(f"--ray {address}: expected HOST:PORT of a Ray cluster's head (or auto)")
    wait = min(timeout_s, GCS_ANSWER_S)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=min(wait, 3)) as conn:
            local = str(conn.getsockname()[0])
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise BadInput(f"--ray {address}: no Ray cluster answers at {addr} ({why}; start one with `ray start "
                       f"--head`)") from None
    from pdcheck.bounds import peer_text
    from pdcheck.netio import PeerError, grpc_unary

    try:
        reply = grpc_unary(host.strip("[]"), int(port), "/ray.rpc.NodeInfoGcsService/GetClusterId", b"", wait)
    except PeerError as exc:
        raise BadInput(f"--ray {address}: {addr} accepts connections but is not a Ray cluster's GCS "
                       f"({peer_text(str(exc), 120)})") from None
    if reply is not None and _proto_bytes(reply, 2) is None:
        raise BadInput(f"--ray {address}: {addr} answers gRPC but not as a Ray GCS (no cluster id)")
    return local


def _proto_bytes(msg: bytes, field: int) -> bytes | None:
    """A length-delimited field of a protobuf message (the GCS's GetClusterIdReply.cluster_id), None if absent
    or not CLUSTER_ID_BYTES long, or if the message does not parse."""
    i = 0

    def varint() -> int:
        nonlocal i
        out = shift = 0
        while i < len(msg) and shift < 64:
            b = msg[i]
            i += 1
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7
        raise ValueError("truncated varint")

    try:
        while i < len(msg):
            key = varint()
            num, kind = key >> 3, key & 7
            if kind == 0:
                varint()
            elif kind == 2:
                n = varint()
                value, i = msg[i:i + n], i + n
                if num == field:
                    return value if len(value) == CLUSTER_ID_BYTES else None
            elif kind in (1, 5):
                i += 8 if kind == 1 else 4
            else:
                return None
    except ValueError:
        return None
    return None


def _short(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
