"""The ZMQ side channel: P's ROUTER listener and D's REQ fetch, framed by a Codec (a framework's wire era:
pdcheck.vllm.wire.WireFormat for vLLM, docs/vllm-protocol.md §3.2). No framework here.

Binds to the scenario's host (loopback by default). Replies are prebuilt msgpack frames; nothing received
is ever unpickled: requests are parsed with msgspec exactly as the modelled listener parses them.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import zmq

from pdcheck.errors import FetchRefused, FetchTimeout, HarnessError
from pdcheck.netio import PeerError, ReplyTimeout, request_reply

MAX_REQUEST_BYTES = 64 << 10  # a request is at most a few dozen bytes in every era

# (peer identity, request bytes, tp_rank asked for or None, reply bytes): `pdcheck serve` logs each answer.
RequestLog = Callable[[bytes, bytes, int | None, int], None]

IN_USE = "in use by another process: free it or choose another base port"


class Codec(Protocol):
    """How one wire era frames a handshake request."""

    @property
    def listener_dies_on_bad_request(self) -> bool:
        """The real listener parses outside any try: a bad request ends its thread."""
        ...

    def encode_request(self, tp_rank: int, pp_rank: int = 0) -> bytes: ...

    def parse_request(self, msg: bytes) -> int | None:
        """The tp_rank asked for (None: the era implies it); raises what the real listener raises."""
        ...

    def parse_stage(self, msg: bytes) -> int:
        """The pipeline stage asked for (0 where the era's request names none)."""
        ...


class Listener:
    """One handshake listener. `reply_for(tp_rank)` returns the frames for that rank; `stage_reply(pp_rank,
    tp_rank)` those of a later pipeline stage (vLLM's era H keys its metadata by both; None: P has one stage, and
    a request for another is the KeyError that ends the real listener thread)."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, fmt: Codec,
                 reply_for: Callable[[int | None], list[bytes]], log: RequestLog | None = None,
                 stage_reply: Callable[[int, int | None], list[bytes]] | None = None) -> None:
        self.fmt, self.reply_for, self.log, self.stage_reply = fmt, reply_for, log, stage_reply
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IPV6, ":" in host)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # libzmq drops a peer sending a bigger frame
        try:
            # port 0: the OS picks a free port, so parallel runs never collide; the launcher tells D.
            self.sock.bind(f"tcp://{_bracket(host)}:{port or '*'}")
        except zmq.ZMQError as exc:
            self.sock.close(0)
            why = IN_USE if exc.errno == errno.EADDRINUSE else exc.strerror  # str(exc) repeats the address
            raise HarnessError(f"side channel: cannot listen on {host}:{port}: {why}") from None
        endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.served = 0
        self.dead: str | None = None  # why the listener thread would have died (F-H, H15)

    def handle(self, mute: bool = False) -> bool:
        """Answer one pending request. Returns False when nothing was pending."""
        try:
            parts = self._recv_request()
        except zmq.Again:
            return False
        if parts is None or len(parts) != 3:
            return True  # a malformed envelope: vLLM's unpack would fail the same way; drop it
        identity, _empty, msg = parts
        if self.dead is not None or mute:
            return True
        try:
            rank = self.fmt.parse_request(msg)
            stage = self.fmt.parse_stage(msg)
            if stage == 0:
                frames = self.reply_for(rank)
            elif self.stage_reply is None:
                raise KeyError((stage, rank))  # encoded_data[(target_pp_rank, target_tp_rank)]
            else:
                frames = self.stage_reply(stage, rank)
        except Exception as exc:  # F-H decode and look up outside any try: the listener thread ends here
            if self.fmt.listener_dies_on_bad_request:
                self.dead = f"{type(exc).__name__}: {exc}"
                return True
            frames = self.reply_for(None)
        self.sock.send_multipart([identity, b"", *frames])
        self.served += 1
        if self.log is not None:
            self.log(identity, msg, rank, sum(len(f) for f in frames))
        return True

    def _recv_request(self) -> list[bytes] | None:
        """One whole message from a peer, frame by frame: None (dropped) past 3 frames, so a peer sending
        thousands of frames costs no list of them here."""
        parts = [self.sock.recv(zmq.NOBLOCK)]
        while self.sock.getsockopt(zmq.RCVMORE):
            frame = self.sock.recv(zmq.NOBLOCK)
            if len(parts) <= 3:
                parts.append(frame)
        return parts if len(parts) <= 3 else None

    def close(self) -> None:
        self.sock.close(0)


def fetch(ctx: zmq.Context, host: str, port: int, fmt: Codec, tp_rank: int, timeout_ms: int,
          pp_rank: int = 0, while_waiting: Callable[[], object] | None = None) -> list[bytes]:
    """One handshake request on a fresh REQ socket (a REQ that timed out cannot be reused, docs/vllm-protocol.md §9), the
    whole exchange within timeout_ms and the reply bounded (netio.request_reply). FetchTimeout when nothing
    came in time; FetchRefused for a reply pdcheck refuses to read (too many frames or bytes)."""
    try:
        return request_reply(ctx, f"tcp://{_bracket(host)}:{port}", host, fmt.encode_request(tp_rank, pp_rank),
                             timeout_ms / 1000, while_waiting)
    except ReplyTimeout:
        raise FetchTimeout(f"{host}:{port}") from None
    except PeerError as exc:
        raise FetchRefused(str(exc)) from None


@contextmanager
def hold_silent(host: str, port: int) -> Iterator[socket.socket]:
    """A TCP port pdcheck holds for the run and never answers on: connections queue in the backlog, so a
    ZMQ REQ sent there waits exactly as one sent to a dead or absent vLLM listener, and no other process
    can take the port. port 0: one the OS picks."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds: TIME_WAIT is not "in use"
        sock.bind((host, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        why = IN_USE if exc.errno == errno.EADDRINUSE else exc.strerror
        raise HarnessError(f"side channel: cannot hold {host}:{port} (a port the modelled release contacts): "
                           f"{why}") from None
    try:
        yield sock
    finally:
        sock.close()


def rebindable_port(host: str, tries: int = 64) -> int:
    """A free port for a listener that a replaced process must bind again (a restarted P's side channel): one below
    the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), which no connect() or bind to port 0 of
    any process is ever given. A port the OS picked would be free for the taking between the old process's death and
    the new one's bind (seen: a parallel run's outgoing connection took it, the restart failed with exit 3)."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    lo, hi = max(1024, low // 2), low - 1
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(tries):
        port = random.randint(lo, hi)
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise HarnessError(f"side channel: no free port on {host} from {lo} to {hi} after {tries} tries")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
