"""The request path's side-channel handshake, as a vLLM D does it before it reads: P serves its NIXL agent
metadata, KV base addresses, block count and block lens on a ZMQ ROUTER listener (pdcheck.sidechannel.Listener,
loopback, port 0), in the wire format of the release line under test; D fetches it (sidechannel.fetch), decodes
it with that release's strict decoder (wire.strict_decode: decoding is validation) and loads the agent. A
replaced P binds the port of the one it replaces, as a restarted vLLM P keeps its configured port. A handshake
that fails (no answer within the release's recv timeout, a reply the release cannot decode) is D's verdict for
the line's requests, never a hang of the run.

In push mode (NixlPushConnector, 0.24+) P also handshakes with D before its first WRITE: D serves its own metadata
on the same kind of listener (PSide, D's values), its PUSH_REG names that side channel, and P fetches it with the
same fetch and decoder (DSide(peer="D")), in the background (Background), as vLLM's P does off its engine loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from pdcheck.errors import FetchRefused, FetchTimeout
from pdcheck.geometry import Geometry
from pdcheck.sidechannel import Listener, fetch
from pdcheck.vllm.releases import CORRECTED, MODELLED, compat_hash_for, resolve
from pdcheck.vllm.requests import messages as rm
from pdcheck.vllm.requests.lines import Lifecycle
from pdcheck.vllm.requests.model import decide, on_failure
from pdcheck.vllm.wire import FORMATS, AnyMeta, WireError, encode_reply, strict_decode

HANG_WAIT_MS = 3000  # a release whose recv() has no timeout: how long pdcheck waits before calling it a hang
POLL_EVERY_S = 0.005  # P answers its side channel this often at most (its hot loop stays a loop of requests)
MAX_PER_POLL = 16  # requests answered per look (D sends one per handshake)


class SideLog(msgspec.Struct):
    """A line's handshakes: where D found P's side channel, the wire it spoke, how many D made (every D rank's
    together: on a TP or DP shape each D rank handshakes with each engine it meets)."""

    endpoint: str  # every endpoint reached, comma-separated (a P DP rank each), in the order first reached
    wire: str
    handshakes: int
    failed: str = ""  # the first failed handshake's reason ("" when none failed)


def side_for(release: str, host: str, port: int, geometry: Geometry) -> rm.ReqSide:
    """Where P listens and how `release` speaks on it: the release model's wire era and compatibility hash (the
    one release -> wire mapping, pdcheck.vllm.releases; the corrected path speaks the newest modelled release's) and
    its recv timeout."""
    model = MODELLED[-1] if release == CORRECTED.name else resolve(release)
    timeout = (CORRECTED if release == CORRECTED.name else model).recv_timeout_ms
    return rm.ReqSide(host, port, model.wire, compat_hash_for(model, geometry), timeout)


def endpoint(side: rm.ReqSide) -> str:
    return f"tcp://{side.host}:{side.port}"


class PSide:
    """P's side-channel listener. It answers only once a line has begun (the era is the line's) and only from
    poll(), which P's loop calls every turn: a request waits in the socket until then."""

    def __init__(self, host: str, port: int, values: AnyMeta, mute: bool = False) -> None:
        self.ctx = zmq.Context()
        self.values, self.mute = values, mute
        newest = FORMATS[MODELLED[-1].wire]
        self.listener = Listener(self.ctx, host, port, newest, lambda _rank: [])
        self.host, self.port = host, self.listener.port
        self.live = False
        self.next = 0.0

    def begin(self, side: rm.ReqSide) -> None:
        """Serve this P's metadata in the line's wire format from now on."""
        from pdcheck.vllm.ranks import replier  # the rank side only (the parent imports this module too)

        fmt = FORMATS[side.wire]
        own = encode_reply(fmt, self.values, side.compat_hash)
        self.listener.fmt, self.listener.reply_for = fmt, replier(fmt, {0: own}, own)
        self.live = True

    def poll(self, now: float) -> None:
        if not self.live or now < self.next:
            return
        self.next = now + POLL_EVERY_S
        for _ in range(MAX_PER_POLL):
            if not self.listener.handle(mute=self.mute):
                return

    def close(self) -> None:
        self.listener.close()
        self.ctx.destroy(0)


class HandshakeFailed(Exception):
    """D's handshake did not load P's metadata. `blocking`: the release would wait in recv() for ever."""

    def __init__(self, text: str, blocking: bool = False) -> None:
        super().__init__(text)
        self.blocking = blocking

    def verdict(self, line: Lifecycle, req: int, params: dict[str, Any] | None,
                log: Callable[[str], str] | None = None) -> tuple[str, str]:
        """What the release makes of a request D has no P for (params dropped: D never needed one). log: the
        release's log line for a failed handshake of this request (D's handshake_failed, texts.failure_log)."""
        if params is None:
            got = decide(line, req, params, "", 0, 0.0)
            assert got is not None
            return got
        if self.blocking:
            return "hang", f"{self}; the request waits for the handshake"
        return on_failure(line, req, "handshake_failed", str(self), log(str(self)) if log else "")


class DSide:
    """The fetching side of the handshake: one ZMQ context, a fresh REQ per handshake (sidechannel.fetch). D's in
    pull mode; P's too in push mode (peer "D": whose side channel it asks)."""

    def __init__(self, peer: str = "P", while_waiting: Callable[[], object] | None = None) -> None:
        self.ctx = zmq.Context()
        self.peer = peer
        self.while_waiting = while_waiting  # what the fetching rank keeps doing while it waits for the reply

    def fetch(self, side: rm.ReqSide) -> AnyMeta:
        """P's metadata, decoded as the release decodes it; HandshakeFailed with the release's text."""
        fmt = FORMATS[side.wire]
        wait = side.timeout_ms if side.timeout_ms is not None else HANG_WAIT_MS
        try:
            frames = fetch(self.ctx, side.host, side.port, fmt, 0, wait, while_waiting=self.while_waiting)
        except FetchTimeout:
            if side.timeout_ms is None:
                raise HandshakeFailed(f"no reply from {self.peer}'s side channel {endpoint(side)}: this release blocks in "
                                      f"recv() with no timeout (reported after pdcheck's {wait} ms)",
                                      blocking=True) from None
            raise HandshakeFailed(f"zmq.error.Again: Resource temporarily unavailable (no reply from {self.peer}'s "
                                  f"side channel {endpoint(side)} within {wait} ms)") from None
        except FetchRefused as exc:
            raise HandshakeFailed(f"pdcheck refused the side channel's reply: {exc}") from None
        try:
            meta, _hash = strict_decode(fmt, frames, side.compat_hash)
        except WireError as exc:
            raise HandshakeFailed(f"{exc.exc_type}: {exc.message or exc.expr}") from None
        return meta

    def close(self) -> None:
        self.ctx.destroy(0)


class Background:
    """One handshake at a time off the caller's loop (vLLM's P handshakes with D on a background executor, 0.28+,
    or on its writer thread, 0.26: never on the engine loop). The fetch ends within the release's recv timeout
    (or pdcheck's HANG_WAIT_MS), so wait() is bounded."""

    def __init__(self, peer: str) -> None:
        self.fetcher = DSide(peer)
        self.future: Future[AnyMeta] | None = None
        self.side: rm.ReqSide | None = None

    def start(self, side: rm.ReqSide) -> None:
        fut: Future[AnyMeta] = Future()
        self.future, self.side = fut, side

        def work() -> None:
            try:
                fut.set_result(self.fetcher.fetch(side))
            except HandshakeFailed as exc:
                fut.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - reported as the handshake's failure, never lost in a thread
                fut.set_exception(HandshakeFailed(f"{type(exc).__name__}: {exc}"))

        threading.Thread(target=work, name="pdcheck-push-handshake", daemon=True).start()

    @property
    def busy(self) -> bool:
        return self.future is not None

    def result(self, wait_s: float | None = 0.0) -> AnyMeta | HandshakeFailed | None:
        """The finished handshake's metadata or failure (None: none, or still running after wait_s)."""
        fut = self.future
        if fut is None or (wait_s == 0.0 and not fut.done()):
            return None
        try:
            exc = fut.exception(timeout=wait_s)
        except TimeoutError:
            return None
        self.future = None
        if exc is not None:
            return exc if isinstance(exc, HandshakeFailed) else HandshakeFailed(str(exc))
        return fut.result()

    def close(self) -> None:
        if self.future is not None:
            self.result(wait_s=None)  # bounded by the fetch's own timeout: its socket goes before the context
        self.fetcher.close()
