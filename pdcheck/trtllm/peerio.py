"""A bounded DEALER exchange with a live TensorRT-LLM ctx's info endpoint (docs/reliability-untrusted.md).

TensorRT-LLM's RankInfoServer is a ROUTER that answers a DEALER (T17, T18); pdcheck.netio's request_reply speaks
REQ, whose empty delimiter frame the ROUTER would read as the message type. This is netio's exchange for a DEALER,
on netio's socket (no linger, frames above netio.MAX_FRAME_BYTES dropped by libzmq) with netio's caps on frames
and bytes and one deadline for the whole exchange; it raises netio's errors (exit 3, one line). The lead may move
it into pdcheck.netio beside request_reply."""

from __future__ import annotations

import zmq

from pdcheck.errors import BadInput
from pdcheck.netio import MAX_FRAMES, MAX_REPLY_BYTES, PeerError, ReplyTimeout, bounded_socket, deadline_in


def endpoint_of(text: str, flag: str = "probe") -> tuple[str, str]:
    """(tcp://HOST:PORT, HOST) of HOST:PORT or tcp://HOST:PORT, as the ctx advertises its disagg_info_endpoint."""
    t = text.strip()
    body = t[len("tcp://"):] if t.startswith("tcp://") else t
    if "://" in body:
        raise BadInput(f"{flag}: {text!r}: a TensorRT-LLM info endpoint is tcp://HOST:PORT")
    host, sep, port = body.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise BadInput(f"{flag}: {text!r} is not HOST:PORT (the ctx's disagg_info_endpoint, e.g. "
                       "tcp://10.0.0.5:40123)")
    shown = f"[{host}]" if ":" in host else host
    return f"tcp://{shown}:{int(port)}", host


def request(zctx: zmq.Context, endpoint: str, host: str, frames: list[bytes], timeout_s: float) -> list[bytes]:
    """Send `frames` on a fresh DEALER and return the reply's frames, all within timeout_s. ReplyTimeout when
    none came (nothing listening, a mute peer, or a peer whose oversized frame libzmq dropped); PeerError for a
    reply of too many frames or bytes."""
    deadline = deadline_in(timeout_s)
    sock = bounded_socket(zctx, zmq.DEALER, host)
    try:
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        sock.connect(endpoint)
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            raise ReplyTimeout(f"{endpoint}: the request could not be sent within {timeout_s:g} s") from None
        ms = int((deadline - deadline_in(0)) * 1000)
        if ms <= 0 or not sock.poll(ms, zmq.POLLIN):
            raise ReplyTimeout(f"no reply within {timeout_s * 1000:.0f} ms (nothing listens, the ctx does not "
                               "answer, or it sent a frame over the size cap)")
        out: list[bytes] = []
        total = 0
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                raise PeerError("the reply ended before its last frame") from None
            total += len(frame)
            out.append(frame)
            if len(out) > MAX_FRAMES:
                raise PeerError(f"the reply has more than {MAX_FRAMES} frames (TensorRT-LLM's RankInfoServer "
                                "sends 1)")
            if total > MAX_REPLY_BYTES:
                raise PeerError(f"the reply is over {MAX_REPLY_BYTES >> 20} MiB")
            if not sock.getsockopt(zmq.RCVMORE):
                return out
    finally:
        sock.close(0)
