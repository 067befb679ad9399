"""A live TensorRT-LLM ctx's info endpoint: its address as a user types it, and the bounded DEALER exchange with it
(docs/reliability-untrusted.md). TensorRT-LLM's RankInfoServer is a ROUTER that answers a DEALER (T17, T18), so the
exchange is pdcheck.netio's request_reply on a DEALER: netio's socket, caps and one deadline, its errors (exit 3)."""

from __future__ import annotations

import zmq

from pdcheck.errors import BadInput
from pdcheck.netio import request_reply


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
    """Send `frames` to the info endpoint and return the reply's frames, all within timeout_s (netio's caps)."""
    return request_reply(zctx, endpoint, host, frames, timeout_s, kind=zmq.DEALER)
