"""Bounded network reads from peers pdcheck does not control (docs/reliability-untrusted.md).

Two exchanges, each with one deadline for the whole exchange (not per read) and a cap on what is kept:

* `request_reply`: one ZMQ REQ/REP round trip (the vLLM side channel). Frames above MAX_FRAME_BYTES make
  libzmq drop the connection before the frame is buffered (ZMQ_MAXMSGSIZE); more than MAX_FRAMES frames, or
  more than MAX_REPLY_BYTES in all, are refused.
* `http_exchange`: one HTTP/1.0 request (the `--version-url` of `probe --vllm auto`, SGLang's bootstrap server)
  over a plain socket: lookup, connect, TLS, headers and body all within one deadline, headers at most
  MAX_HTTP_HEADER bytes, the body at most a given cap. No redirects are followed, nothing is cached, no proxy
  is used. `http_get` is its GET that wants a 200.

Both raise PeerError (exit 3, one line) for anything the peer does; the caller adds where it was reading.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import zmq

from pdcheck.errors import HarnessError

MAX_FRAME_BYTES = 16 << 20  # one side-channel frame; vLLM's largest metadata (1024 regions) is well below 1 MiB
MAX_FRAMES = 4  # frames in one reply: eras send 1 (A-G) or 2 (H)
MAX_REPLY_BYTES = 32 << 20  # all frames of one reply together
MAX_HTTP_HEADER = 64 << 10  # status line and headers of one HTTP response
MAX_HTTP_BODY = 64 << 10  # default body cap; GET /version answers ~20 bytes
WAITING_SLICE_MS = 5  # request_reply's while_waiting: how often it runs while the reply is awaited


class PeerError(HarnessError):
    """A peer sent something pdcheck refuses to read further (too big, too many, too slow, not the protocol)."""


class ReplyTimeout(PeerError):
    """No complete reply before the deadline."""


class Unreachable(PeerError):
    """No connection: nothing listens, the host is unreachable or its name does not resolve (a peer not up yet,
    not a peer that misbehaves)."""


def deadline_in(seconds: float) -> float:
    return time.monotonic() + seconds


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


# ------------------------------------------------------------------------------------------------- ZMQ
def bounded_socket(ctx: zmq.Context, kind: int, host: str) -> zmq.Socket:
    """A socket that never lingers and drops a peer sending a frame above MAX_FRAME_BYTES."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.IPV6, ":" in host)
    return sock


def request_reply(ctx: zmq.Context, endpoint: str, host: str, request: bytes, timeout_s: float,
                  while_waiting: Callable[[], object] | None = None) -> list[bytes]:
    """Send `request` on a fresh REQ socket and return the reply frames, all within timeout_s. while_waiting:
    called every few milliseconds until the reply comes (what the caller's process must keep doing meanwhile).

    ReplyTimeout when no reply came in time (nothing listening, a mute peer, or a peer that sent an oversized
    frame: libzmq drops that connection silently, so the message says both). PeerError for a reply of too
    many frames or bytes."""
    deadline = deadline_in(timeout_s)
    sock = bounded_socket(ctx, zmq.REQ, host)
    try:
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        sock.connect(endpoint)
        try:
            sock.send(request)
        except zmq.Again:
            raise ReplyTimeout(f"{endpoint}: the request could not be sent within {timeout_s:g} s") from None
        while True:
            ms = int(_left(deadline) * 1000)
            if ms <= 0:
                raise ReplyTimeout(f"no reply within {timeout_s * 1000:.0f} ms")
            if sock.poll(ms if while_waiting is None else min(ms, WAITING_SLICE_MS), zmq.POLLIN):
                break
            if while_waiting is not None:
                while_waiting()
        # A multipart message arrives whole, so once its first frame is readable every frame is; read them one
        # at a time to stop at the caps instead of building an unbounded list.
        frames: list[bytes] = []
        total = 0
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                raise PeerError("the reply ended before its last frame") from None
            total += len(frame)
            frames.append(frame)
            if len(frames) > MAX_FRAMES:
                raise PeerError(f"the reply has more than {MAX_FRAMES} frames (vLLM sends 1 or 2)")
            if total > MAX_REPLY_BYTES:
                raise PeerError(f"the reply is over {MAX_REPLY_BYTES >> 20} MiB")
            if not sock.getsockopt(zmq.RCVMORE):
                return frames
    finally:
        sock.close(0)


# ------------------------------------------------------------------------------------------------ HTTP
def http_get(url: str, timeout_s: float, max_body: int = MAX_HTTP_BODY) -> bytes:
    """The body of a 200 answer to GET url, read within timeout_s in all; PeerError otherwise."""
    status, body = http_exchange(url, timeout_s, max_body)
    if status != 200:
        raise PeerError(f"HTTP status {status} (expected 200)")
    return body


def http_exchange(url: str, timeout_s: float, max_body: int = MAX_HTTP_BODY, *, method: str = "GET",
                  body: bytes | None = None, deadline: float | None = None) -> tuple[int, bytes]:
    """(status, body) of one request to url, all within timeout_s (and before `deadline`, a time.monotonic()
    of a longer exchange this one is part of). Unreachable when no connection is made, ReplyTimeout when the
    answer is not complete in time, PeerError for anything else the peer does."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PeerError(f"{url!r} is not an http(s) URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise PeerError(f"{url!r}: the port is not a number from 0 to 65535") from None
    host = parts.hostname
    own = deadline_in(timeout_s)
    deadline = own if deadline is None else min(own, deadline)
    try:
        addr = _resolve(host, port, deadline, timeout_s)
        sock = socket.socket(addr[0], socket.SOCK_STREAM)
        sock.settimeout(max(0.001, _left(deadline)))
        try:
            sock.connect(addr[4])
        except BaseException:
            sock.close()
            raise
    except TimeoutError:
        raise ReplyTimeout(f"cannot connect to {host}:{port} within {timeout_s:g} s") from None
    except OSError as exc:
        raise Unreachable(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    try:
        if parts.scheme == "https":
            import ssl

            sock.settimeout(max(0.001, _left(deadline)))
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        hostport = f"[{host}]" if ":" in host else host
        if parts.port:
            hostport += f":{parts.port}"
        extra = "" if body is None else f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        req = (f"{method} {path} HTTP/1.0\r\nHost: {hostport}\r\nAccept: application/json\r\n{extra}"
               "User-Agent: pdcheck\r\nConnection: close\r\n\r\n")
        _send_all(sock, req.encode("ascii", "replace") + (body or b""), deadline, timeout_s)
        head, rest = _read_head(sock, deadline, timeout_s)
        status, headers = _parse_head(head)
        length = headers.get("content-length")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise PeerError("a chunked body answering an HTTP/1.0 request")
        want: int | None = None
        if length is not None:
            if not length.isdigit():
                raise PeerError(f"Content-Length {length[:40]!r} is not a number")
            want = int(length)
            if want > max_body:
                raise PeerError(f"a body of {want} bytes; at most {max_body} are read")
        return status, _read_body(sock, rest, want, max_body, deadline, timeout_s)
    except OSError as exc:  # reset, TLS failure, ...
        if isinstance(exc, TimeoutError):
            raise ReplyTimeout(f"no complete answer within {timeout_s:g} s") from None
        raise PeerError(f"{type(exc).__name__}: {exc}") from None
    finally:
        sock.close()


def _resolve(host: str, port: int, deadline: float, timeout_s: float) -> tuple:
    """getaddrinfo's first answer, within the deadline: the resolver has no timeout of its own, so a name is
    looked up on a daemon thread that is abandoned if it does not answer in time."""
    import threading

    out: list = []

    def look() -> None:
        try:
            out.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0])
        except (OSError, IndexError) as exc:
            out.append(exc)

    t = threading.Thread(target=look, name="pdcheck-resolve", daemon=True)
    t.start()
    t.join(max(0.0, _left(deadline)))
    if not out:
        raise ReplyTimeout(f"{host}: no address within {timeout_s:g} s")
    if isinstance(out[0], BaseException):
        raise Unreachable(f"{host}: cannot resolve: {getattr(out[0], 'strerror', None) or out[0]}")
    return out[0]


def _send_all(sock: socket.socket, data: bytes, deadline: float, timeout_s: float) -> None:
    view = memoryview(data)
    while view:
        left = _left(deadline)
        if left <= 0:
            raise ReplyTimeout(f"no complete answer within {timeout_s:g} s")
        sock.settimeout(left)
        sent = sock.send(view)
        view = view[sent:]


def _recv(sock: socket.socket, deadline: float, timeout_s: float) -> bytes:
    left = _left(deadline)
    if left <= 0:
        raise ReplyTimeout(f"no complete answer within {timeout_s:g} s")
    sock.settimeout(left)  # each read gets only what is left of the one deadline
    return sock.recv(65536)


def _read_head(sock: socket.socket, deadline: float, timeout_s: float) -> tuple[bytes, bytes]:
    buf = b""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            return buf[:end], buf[end + 4:]
        if len(buf) > MAX_HTTP_HEADER:
            raise PeerError(f"HTTP headers over {MAX_HTTP_HEADER >> 10} KiB")
        chunk = _recv(sock, deadline, timeout_s)
        if not chunk:
            raise PeerError("the connection closed before the end of the HTTP headers" if buf else
                            "the connection closed without an answer")
        buf += chunk


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (parts[1].isdigit() and len(parts[1]) == 3):
        raise PeerError(f"not an HTTP answer (status line {lines[0][:60]!r})")
    headers: dict[str, str] = {}
    for ln in lines[1:]:
        key, sep, value = ln.partition(":")
        if sep:
            headers[key.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _read_body(sock: socket.socket, got: bytes, want: int | None, max_body: int, deadline: float,
               timeout_s: float) -> bytes:
    buf = bytearray(got)
    while want is None or len(buf) < want:
        if len(buf) > max_body:
            raise PeerError(f"a body over {max_body} bytes")
        chunk = _recv(sock, deadline, timeout_s)
        if not chunk:
            if want is not None:
                raise PeerError(f"the connection closed after {len(buf)} of {want} body bytes")
            break
        buf += chunk
    if len(buf) > max_body:
        raise PeerError(f"a body over {max_body} bytes")
    return bytes(buf if want is None else buf[:want])
