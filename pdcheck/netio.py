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
# A server's last reply before it closes (doctor's listener: the Evidence, a Refused) must still reach the peer
# that waits for it: the closing socket lingers this long at most (a gone peer costs no more than this).
FLUSH_LINGER_MS = 2000
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


def request_reply(ctx: zmq.Context, endpoint: str, host: str, request: bytes | list[bytes], timeout_s: float,
                  while_waiting: Callable[[], object] | None = None, kind: int = zmq.REQ) -> list[bytes]:
    """Send `request` (one frame, or a multipart message) on a fresh socket of `kind` and return the reply frames,
    all within timeout_s. kind: REQ (vLLM's and doctor's side channels), or DEALER for a ROUTER that answers
    without REQ's empty delimiter frame (TensorRT-LLM's RankInfoServer). while_waiting: called every few
    milliseconds until the reply comes (what the caller's process must keep doing meanwhile).

    ReplyTimeout when no reply came in time (nothing listening, a mute peer, or a peer that sent an oversized
    frame: libzmq drops that connection silently, so the message says both). PeerError for a reply of too
    many frames or bytes."""
    deadline = deadline_in(timeout_s)
    sock = bounded_socket(ctx, kind, host)
    try:
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        sock.connect(endpoint)
        try:
            sock.send_multipart(request if isinstance(request, list) else [request])
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
                raise PeerError(f"the reply has more than {MAX_FRAMES} frames (at most {MAX_FRAMES} are read)")
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
    """getaddrinfo's first answer, within the deadline (lookup_all)."""
    return lookup_all(host, port, deadline, timeout_s)[0]


def lookup_all(host: str, port: int, deadline: float, timeout_s: float) -> list[tuple]:
    """getaddrinfo's answers (TCP), within the deadline: the resolver has no timeout of its own, so a name is
    looked up on a daemon thread that is abandoned if it does not answer in time. ReplyTimeout when it does not,
    Unreachable when the name does not resolve."""
    import threading

    out: list = []

    def look() -> None:
        try:
            out.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as exc:
            out.append(exc)

    t = threading.Thread(target=look, name="pdcheck-resolve", daemon=True)
    t.start()
    t.join(max(0.0, _left(deadline)))
    if not out:
        raise ReplyTimeout(f"{host}: no address within {timeout_s:g} s")
    if isinstance(out[0], BaseException) or not out[0]:
        why = getattr(out[0], "strerror", None) or out[0] or "no address"
        raise Unreachable(f"{host}: cannot resolve: {why}")
    return out[0]


def lookup(host: str, timeout_s: float) -> list[str]:
    """Every address `host` names (its A and AAAA records; an IP literal: itself), in the resolver's order, once
    each, within timeout_s (lookup_all's errors)."""
    found = lookup_all(host, 0, deadline_in(timeout_s), timeout_s)
    return list(dict.fromkeys(str(info[4][0]) for info in found))


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


# ------------------------------------------------------------------------------------------------ gRPC
# One unary gRPC call over HTTP/2 (RFC 9113) on a plain socket, within one deadline: enough to ask a peer
# whether it is the server it should be (a Ray GCS) before a client library that retries for minutes is let at
# it. Request headers go as HPACK literals (RFC 7541 6.2.2, no Huffman, no table); the answer's headers are
# not decoded: a DATA frame carrying a gRPC message on stream 1 is the answer, a HEADERS frame ending stream 1
# without one is a trailers-only answer (an error status).
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_DATA, _H2_HEADERS, _H2_SETTINGS, _H2_PING, _H2_GOAWAY = 0x0, 0x1, 0x4, 0x6, 0x7
_H2_END_STREAM, _H2_ACK = 0x1, 0x1
MAX_H2_FRAME = 1 << 14  # the frame size a peer may send without asking (SETTINGS_MAX_FRAME_SIZE's default)
MAX_GRPC_REPLY = 64 << 10  # bytes of an answer read in all (a Ray GetClusterId reply is ~40)


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_literal(name_index: int, value: str) -> bytes:
    """A header field, literal value without indexing, its name from the static table (index < 15)."""
    v = value.encode("ascii")
    if len(v) >= 127:
        raise ValueError("header value too long")
    return bytes([name_index, len(v)]) + v


def grpc_unary(host: str, port: int, path: str, message: bytes, timeout_s: float) -> bytes | None:
    """The reply message of one unary gRPC call (None: the server answered with trailers only, an error status),
    all within timeout_s. PeerError for anything that is not an HTTP/2 gRPC answer: silence, a connection
    closed, bytes that are not HTTP/2 frames, a frame above MAX_H2_FRAME, more than MAX_GRPC_REPLY bytes."""
    deadline = deadline_in(timeout_s)
    try:
        sock = socket.create_connection((host, port), timeout=max(0.001, _left(deadline)))
    except TimeoutError:
        raise ReplyTimeout(f"cannot connect to {host}:{port} within {timeout_s:g} s") from None
    except OSError as exc:
        raise Unreachable(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    headers = (bytes([0x83, 0x86])  # :method POST, :scheme http (static table 3 and 6, indexed)
               + _hpack_literal(4, path) + _hpack_literal(1, authority)
               + bytes([0x0f, 0x10]) + b"\x10application/grpc"  # content-type (static 31: 4-bit prefix 15 + 16)
               + b"\x00\x02te\x08trailers")
    body = b"\x00" + len(message).to_bytes(4, "big") + message  # gRPC framing: not compressed, length, message
    try:
        _send_all(sock, _H2_PREFACE + _h2_frame(_H2_SETTINGS, 0, 0, b"")
                  + _h2_frame(_H2_HEADERS, 0x4, 1, headers)  # END_HEADERS
                  + _h2_frame(_H2_DATA, _H2_END_STREAM, 1, body), deadline, timeout_s)
        buf = b""
        got = 0
        reply = bytearray()
        while True:
            while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
                if len(buf) >= 9 and int.from_bytes(buf[:3], "big") > MAX_H2_FRAME:
                    raise PeerError(f"an HTTP/2 frame of {int.from_bytes(buf[:3], 'big')} bytes (not a gRPC server)")
                chunk = _recv(sock, deadline, timeout_s)
                if not chunk:
                    raise PeerError("the connection closed before a gRPC answer")
                got += len(chunk)
                if got > MAX_GRPC_REPLY:
                    raise PeerError(f"over {MAX_GRPC_REPLY >> 10} KiB without a gRPC answer")
                buf += chunk
            n = int.from_bytes(buf[:3], "big")
            kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            payload, buf = buf[9:9 + n], buf[9 + n:]
            if kind == _H2_SETTINGS and not flags & _H2_ACK:
                _send_all(sock, _h2_frame(_H2_SETTINGS, _H2_ACK, 0, b""), deadline, timeout_s)
            elif kind == _H2_PING and not flags & _H2_ACK:
                _send_all(sock, _h2_frame(_H2_PING, _H2_ACK, 0, payload), deadline, timeout_s)
            elif kind == _H2_GOAWAY:
                raise PeerError("the server sent GOAWAY before answering")
            elif kind > 0x9:
                raise PeerError(f"HTTP/2 frame type {kind} (not an HTTP/2 server)")
            elif stream == 1 and kind == _H2_DATA:
                if flags & 0x8:  # PADDED
                    pad = payload[0] if payload else 0
                    payload = payload[1:len(payload) - pad]
                reply += payload
                if len(reply) >= 5 and len(reply) >= 5 + int.from_bytes(reply[1:5], "big"):
                    return bytes(reply[5:5 + int.from_bytes(reply[1:5], "big")])
            elif stream == 1 and kind == _H2_HEADERS and flags & _H2_END_STREAM:
                return None if not reply else bytes(reply[5:])
    except OSError as exc:
        if isinstance(exc, TimeoutError):
            raise ReplyTimeout(f"no gRPC answer within {timeout_s:g} s") from None
        raise PeerError(f"{type(exc).__name__}: {exc}") from None
    finally:
        sock.close()
