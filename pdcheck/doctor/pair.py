"""Two nodes: `doctor --listen` serves a prefill rank's KV, `doctor --peer` READs it with a decode rank, both
real transfer-bench ranks (pdcheck.bench.rank) started by pdcheck's launcher, every block checked by
coordinate, and each end's transport as UCX's protocol tables in its own rank log name it.

The side channel is ZMQ REQ/REP in the protocol of pdcheck.doctor.wire (msgspec msgpack only, never pickle):
Hello at the address the peer dialled -> Offer (the listener's agent metadata and the address it advertises,
as vLLM's prefill advertises VLLM_NIXL_SIDE_CHANNEL_HOST); Fill and Result at the advertised address. Every
exchange has one deadline (pdcheck.netio); anything a peer does wrong is a PeerError: exit 3, one line.

A listener started with --keep-listening serves one session after another: a --peer's pair, or a matrix
coordinator's requests (pdcheck.doctor.matrix): be the prefill end of a pair (Serve), or its decode end
(Dial: run the --peer side against another listener and report the Leg).

Over the ~500 lines a module keeps to: the listener's and the peer's halves of one protocol, each step beside
the step it answers; the wire is doctor/wire.py, the matrix doctor/matrix.py.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pdcheck import bounds
from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.bench import messages as bm
from pdcheck.bench.plan import make_plan
from pdcheck.bench.transport import diagnose, parse_proto_info
from pdcheck.doctor import addr, loopback
from pdcheck.doctor.addr import Endpoint, hostport
from pdcheck.doctor.model import check
from pdcheck.doctor.wire import (
    PROTOCOL,
    Aborted,
    Dial,
    End,
    Evidence,
    Fill,
    Filled,
    Hello,
    Here,
    Leg,
    Offer,
    Refused,
    Result,
    Serve,
    Serving,
    Who,
    decode,
    encode,
    judge_transfer,
)
from pdcheck.errors import BadInput, HarnessError, RankFailed
from pdcheck.netio import FLUSH_LINGER_MS, MAX_FRAME_BYTES, PeerError, bounded_socket, request_reply


class PairResult(msgspec.Struct):
    role: str  # "listen" or "peer"
    side_channel: str  # "TCP node-a:7777 (10.0.0.5)": where the peer dialled, and what that resolved to
    advertised: str
    proof: str  # "256 blocks checked, 0 wrong"
    checked: int
    wrong: int
    gbps: float
    p50_us: float
    local: End
    remote: End
    expect: list[str] = []  # what both ends judged the payload against: both ends' --expect

    def lines(self) -> list[str]:
        return [f"side channel over {self.side_channel} (advertised {self.advertised}); {self.proof}, "
                f"{self.gbps:.2f} GB/s",
                *(f"{who} ({e.role or '?'}, {e.host}): {_lanes(e)}"
                  for who, e in (("this end", self.local), ("other end", self.remote)))]


def _lanes(e: End) -> str:
    """One end's transports as its UCX tables name them: the payload on the decode end (the end that READ); the
    lanes on the prefill end, whose tables carry no READ."""
    lanes = f"UCX lanes {', '.join(e.transports) or 'none seen'} (UCX {e.ucx or 'unknown'})"
    if e.role == "prefill":
        return lanes
    return (f"payload over {', '.join(e.data) or 'nothing UCX named'}; notifications over "
            f"{', '.join(e.notifications) or 'nothing UCX named'}; {lanes}")


def _expect(frames: list[bytes], kind: type, what: str) -> Any:
    if len(frames) != 1:
        raise PeerError(f"{what}: {len(frames)} frames, expected 1")
    msg = decode(frames[0], what)
    if isinstance(msg, Refused):
        raise PeerError(f"{what}: the other end refused: {msg.reason}")
    if not isinstance(msg, kind):
        raise PeerError(f"{what}: got {type(msg).__name__}, expected {kind.__name__}")
    return msg


def _shape() -> list[int]:
    s = loopback.SHAPE
    return [s.layers, s.kv_heads, s.head_dim, loopback.BLOCK_TOKENS, loopback.TOKENS, loopback.REQUESTS]


def blocks_sent(plan: Any) -> int:
    """Blocks the decode end checks in one transfer: every block of every request, in each of the layers' K and
    V regions (what bench.measure.verify_requests counts); a peer reporting more is not measuring."""
    row = plan.rows[0]
    return row.requests * row.blocks * 2 * loopback.SHAPE.layers


def _union(mine: list[str], theirs: list[str], what: str) -> list[str]:
    """Both ends' --expect: each end judges against both (a transport one end asks for, the other must miss too)."""
    try:
        theirs = parse_expect(",".join(theirs)) if theirs else []
    except BadInput:
        raise PeerError(f"{what}: the other end's --expect {theirs[:4]} is not a list of transports") from None
    return list(dict.fromkeys([*mine, *theirs]))


# ------------------------------------------------------------------------------------------------ addresses
def _route_to(host: str) -> str:
    """This node's address on the route to `host` (a UDP connect sends nothing)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1" if fam == socket.AF_INET else "::1"


def advertised_host(bind: str) -> str:
    """What a listener bound to `bind` tells its peer: the address itself, or for a bind-all address this node's
    address on its default route (advertising 0.0.0.0 makes the other end dial itself)."""
    if ipaddress.ip_address(bind).is_unspecified:
        return _route_to("8.8.8.8" if ":" not in bind else "2001:4860:4860::8888")
    return bind


def _endpoint(ip: str, port: int) -> str:
    return f"tcp://{hostport(ip, port)}"


# ------------------------------------------------------------------------------------------------ ranks
def _spec(role: str, host: str, arena: int, ucx: dict[str, str]) -> bm.BenchSpec:
    cfg = loopback.config("cpu", 30.0)
    return bm.BenchSpec(
        role=role, tp_rank=0, agent_name=f"pdcheck-doctor-{'listen' if role == 'P' else 'peer'}-{os.getpid()}",
        arena_bytes=arena, device="cpu", gpu=0, cores=[], error_mode=None, progress_thread=False,
        target_busy=cfg.target_busy, ucx_env=ucx, shape=cfg.shape, ptp=1, dtp=1, iters=0, warmup=cfg.warmup,
        min_time=cfg.min_time, notif=True, host=host)


def _row_msg(plan: Any) -> bm.Row:
    from pdcheck.bench import tables

    row = plan.rows[0]
    return bm.Row(row.index, row.block_tokens, row.tokens, row.blocks, row.requests, row.run_length, row.num_blocks,
                 tables.table_bytes(row.tables_p), tables.table_bytes(row.tables_d), -1)


def _ucx_env() -> dict[str, str]:
    return {} if "UCX_PROTO_INFO" in os.environ else {"UCX_PROTO_INFO": "y"}


def _evidence(log: Path, host: str, ucx: str, role: str = "") -> End:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    tables = parse_proto_info(text)
    d = diagnose(tables)
    lanes = sorted({tl for t in tables if t.scope != "self" for tl in t.transports()})
    return End(host, d.data, d.notif, lanes, ucx, role)


RANK_SETUP_S = 60.0


class _Pair:
    """One bench rank on pdcheck's launcher, with transfer-bench's fault words (pdcheck.bench.runner). Its rank
    log lives in a scratch directory of the run (pdcheck.lifecycle): removed by close(), or at exit whatever
    interrupted the run; a start-up that fails or is interrupted closes what it started before it raises."""

    def __init__(self, role: str, host: str, timeout: float, bind: str | None = None) -> None:
        from pdcheck import lifecycle
        from pdcheck.bench.runner import Ranks
        from pdcheck.launcher import Launcher

        self.plan = make_plan(loopback.config("cpu", timeout))
        self.row = _row_msg(self.plan)
        self.timeout = timeout
        self.host = host  # how this end names itself in its evidence
        self.role = "prefill" if role == "P" else "decode"
        self.dir = lifecycle.scratch_dir("pdcheck-doctor-")
        self.lau = Launcher()
        try:
            self.ranks = Ranks(self.lau, self.dir)
            self.rid = orc.ids(role, 1)[0]
            arena = (self.plan.pool_p if role == "P" else self.plan.pool_d)[0]
            self.ranks.start(self.rid, _spec(role, bind or host, arena, _ucx_env()))
            # --timeout bounds what the other end does; this rank's own start-up (an agent, a registration, on a
            # busy machine seconds) gets at least RANK_SETUP_S, so a short --timeout never fails a healthy start.
            self.ready: bm.BenchReady = self.ranks.gather([self.rid], bm.BenchReady, max(timeout, RANK_SETUP_S),
                                                         "creating the agent and registering memory")[self.rid]
        except BaseException:
            self.close()
            raise

    def ask(self, msg: m.Msg, kind: type, what: str) -> Any:
        self.ranks.send([self.rid], msg)
        return self.ranks.gather([self.rid], kind, self.timeout, what)[self.rid]

    def stop(self) -> End:
        """Stop the rank (its log is complete once it exits) and read its evidence."""
        self.ask(m.Stop(), bm.Bye, "stopping")
        return self.evidence_after_failure()

    def evidence_after_failure(self) -> End:
        """The rank failed (and ends), or has stopped: close it and read what its log says."""
        self.lau.close()
        return _evidence(self.dir / f"{self.rid.short}.log", self.host, self.ready.ucx_version, self.role)

    def close(self) -> None:
        from pdcheck import lifecycle

        self.lau.close()
        lifecycle.remove_scratch(self.dir)


# ------------------------------------------------------------------------------------------------ listener
class Served(msgspec.Struct):
    """One pair a listener served, or a peer ran: what both ends need to judge it."""

    role: str  # "listen" or "peer"
    dialled: str  # the side channel's address as the peer named it: "node-a:7777 (10.0.0.5)"
    advertised: str
    checked: int
    wrong: int
    first_wrong: str | None
    gbps: float
    p50_us: float
    local: End
    remote: End
    expect: list[str]
    error: str | None = None  # the decode rank could not READ: NIXL's error (a finding: FAIL)


ONE_SHOT = ("this listener serves one --peer and exits; a --matrix needs listeners started with "
            "`pdcheck doctor --listen ADDR --keep-listening`")


class Listener:
    """The listener's REP socket: bound at --listen, it answers every message it receives once (a REP socket
    must), a Refused at the least, so a peer that is turned away hears why at once."""

    def __init__(self, where: Endpoint, timeout: float, advertise: str | None, expect: list[str]) -> None:
        self.where, self.timeout, self.expect = where, timeout, expect
        self.advertise_flag = advertise
        # Its own context, so that close() can wait (ctx.term) for the last reply to leave: closed with linger 0
        # in a process about to exit, an Evidence of a few hundred kB was dropped under load and the peer waited
        # out its --timeout for it.
        self.ctx = zmq.Context()
        self.sock = bounded_socket(self.ctx, zmq.REP, where.ip)
        self.owes_reply = False
        self.port = where.port
        self.adv = self.adv_label = ""
        self.here = ""  # the address this end gives in its evidence

    def bind(self) -> None:
        ip, port = self.where.ip, self.where.port
        try:
            if port:
                self.sock.bind(_endpoint(ip, port))
            else:
                port = self.sock.bind_to_random_port(f"tcp://{'[' + ip + ']' if ':' in ip else ip}")
        except zmq.ZMQError as exc:
            raise HarnessError(f"--listen {self.where.label}: cannot bind: {exc}") from None
        self.port = port
        self.adv = self.advertise_flag or hostport(advertised_host(ip), port)
        self.here = addr.split(self.adv)[0]
        # --advertise was resolved when it was parsed (addr.parse_advertise); shown as the peer will see it
        self.adv_label = addr.advertised(self.adv, "--advertise", self.timeout).label
        label = Endpoint(self.where.host, ip, port).label
        sys.stderr.write(f"pdcheck doctor: listening on {label} (advertising {self.adv})\n")
        sys.stderr.flush()

    @property
    def label(self) -> str:
        return Endpoint(self.where.host, self.where.ip, self.port).label

    def recv(self, deadline: float | None, what: str) -> tuple[Any, str]:
        """The next message (made safe) and the address it came from; waits until `deadline` (None: for ever,
        until a signal). PeerError when nothing arrives in time or it is not the protocol (answered Refused)."""
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise PeerError(f"--listen: nothing arrived within {self.timeout:g} s while {what}")
            if self.sock.poll(1000 if left is None else max(1, min(1000, int(left * 1000))), zmq.POLLIN):
                break
        frame = self.sock.recv(copy=False)
        self.owes_reply = True
        seen = _peer_address(frame)
        parts = 1
        # Drain the message (ZMQ delivered it whole, so this only frees it) before the one reply a REP socket gives.
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv(copy=False)
            parts += 1
        if parts > 1:
            raise PeerError(f"--listen: a {parts}-part message while {what} (a {PROTOCOL} peer sends one frame)")
        return decode(frame.bytes, f"--listen: from {seen} while {what}"), seen

    def reply(self, msg: Any) -> None:
        self.sock.send(encode(msg))
        self.owes_reply = False

    def refuse(self, why: str) -> None:
        """Answer a message this listener will not act on (REP owes every message one answer)."""
        if self.owes_reply:
            try:
                self.reply(Refused(why))
            except zmq.ZMQError:
                self.owes_reply = False

    def close(self) -> None:
        """Close, delivering the last reply first (at most FLUSH_LINGER_MS when the peer is gone)."""
        if not self.ctx.closed:
            self.sock.close(linger=FLUSH_LINGER_MS)
            self.ctx.term()

    def serve_pair(self, pair: _Pair, hello: Hello, seen: str, expect: list[str]) -> Served:
        """One pair on this end (the prefill end): Offer, Fill, the peer's Result; its evidence both ways."""
        from pdcheck import __version__

        who = f"--listen {self.label}: the peer at {seen}"
        if hello.protocol != PROTOCOL or hello.shape != _shape():
            self.reply(Refused(f"this listener speaks {PROTOCOL} with shape {_shape()} (pdcheck {__version__})"))
            raise PeerError(f"{who} speaks {hello.protocol[:40]!r} with shape {hello.shape[:8]} (pdcheck "
                            f"{hello.pdcheck[:40]}); this end {PROTOCOL} {_shape()}")
        both = _union(expect, hello.expect, who)
        r = pair.ready
        self.reply(Offer(r.agent_name, r.metadata, r.addr, r.dev, self.adv, r.ucx_version, expect))
        fill = self._next((Fill, Aborted), "waiting for the peer's Fill (at the advertised address)")
        if isinstance(fill, Aborted):  # the peer could not use the advertised address (and said so here)
            self.reply(Evidence(pair.stop()))
            raise PeerError(f"--listen: the peer says this listener {fill.error}; advertise an address of this node "
                            "that this listener listens on (--advertise)")
        filled = pair.ask(pair.row, bm.Filled, "filling the KV blocks")
        self.reply(Filled(filled.fill_ms))
        res = self._next((Result, Aborted), "waiting for the peer's transfer result")
        mine = pair.stop()
        self.reply(Evidence(mine))
        theirs = msgspec.structs.replace(res.end, role="decode")
        if isinstance(res, Aborted):
            if res.stage == "metadata":
                raise PeerError(f"{who}: its NIXL cannot read this listener's agent metadata ({res.error}): both "
                                "ends must run one NIXL release")
            return Served("listen", self.label, self.adv_label, 0, 0, None, 0.0, 0.0, mine, theirs, both,
                          f"the peer's READ failed: {res.error}")
        judge_transfer(who, res.checked, res.wrong, res.gbps, res.p50_us, blocks_sent(pair.plan))
        return Served("listen", self.label, self.adv_label, res.checked, res.wrong, res.first_wrong, res.gbps,
                      res.p50_us, mine, theirs, both)

    def _next(self, kinds: tuple[type, ...], what: str) -> Any:
        msg, _seen = self.recv(time.monotonic() + self.timeout, what)
        if not isinstance(msg, kinds):
            name = " or ".join(k.__name__ for k in kinds)
            self.refuse(f"expected {name}")
            raise PeerError(f"--listen: got {type(msg).__name__} while {what}")
        return msg


def _peer_address(frame: Any) -> str:
    """Where a message came from, as ZMQ saw the connection (not what the sender says of itself)."""
    try:
        return bounds.peer_text(frame.get("Peer-Address") or "an unknown address", 80)
    except (zmq.ZMQError, AttributeError, KeyError, UnicodeDecodeError):
        return "an unknown address"


def listen(report: Any, where: Endpoint, timeout: float, advertise: str | None = None,
           expect: list[str] | None = None) -> None:
    """Serve one peer: bind, print where, wait (at most `timeout`) for its Hello, then Fill and Result."""
    lis = Listener(where, timeout, advertise, expect or [])
    pair: _Pair | None = None
    try:
        # The rank (its agent, registered memory) starts before the announcement: "listening on" means a peer's
        # Hello is answered at once, within the peer's own --timeout however long this machine took to start it.
        pair = _Pair("P", "", timeout, bind=where.ip)
        lis.bind()
        pair.host = lis.here
        deadline = time.monotonic() + timeout
        while True:
            msg, seen = lis.recv(deadline, "waiting for a peer's Hello")
            if isinstance(msg, Hello):
                break
            lis.refuse(ONE_SHOT if isinstance(msg, Who | Serve | Dial) else "expected Hello")
            if not isinstance(msg, Who | Serve | Dial):
                raise PeerError(f"--listen: got {type(msg).__name__} from {seen} while waiting for a peer's Hello")
        record(report, lis.serve_pair(pair, msg, seen, lis.expect))
    except BaseException as exc:
        lis.refuse(str(exc) if isinstance(exc, HarnessError) else "the listener stopped")
        raise
    finally:
        lis.close()
        if pair is not None:
            pair.close()


def listen_forever(where: Endpoint, timeout: float, advertise: str | None, expect: list[str],
                   on_session: Callable[[int, Served | None, str | None], None]) -> None:
    """--keep-listening: serve one session after another until a signal: a --peer's pair, or a matrix
    coordinator's Who, Serve (the prefill end of one pair) and Dial (its decode end, against another listener).
    on_session(n, what this end served or None, why the session failed or None) reports each pair."""
    lis = Listener(where, timeout, advertise, expect)
    warm: _Pair | None = None
    n = 0
    try:
        warm = _Pair("P", "", timeout, bind=where.ip)  # a prefill end ready before the first Hello, as listen()'s
        lis.bind()
        warm.host = lis.here
        while True:
            try:
                msg, seen = lis.recv(None, "waiting for a peer or a matrix coordinator")
            except PeerError as exc:  # garbage, a multi-part message: turned away, and the listener serves on
                lis.refuse(str(exc))
                n += 1
                on_session(n, None, str(exc))
                continue
            used = False
            try:
                if isinstance(msg, Who):
                    from pdcheck import __version__

                    lis.reply(Here(PROTOCOL, __version__, socket.gethostname(), lis.adv))
                    continue
                n += 1
                if isinstance(msg, Hello) and not msg.session:
                    used = True
                    on_session(n, lis.serve_pair(warm, msg, seen, lis.expect), None)
                elif isinstance(msg, Serve):
                    used = True
                    lis.reply(Serving(lis.adv))
                    hello, seen = _session_hello(lis, msg.session)
                    on_session(n, lis.serve_pair(warm, hello, seen, _union(lis.expect, msg.expect, seen)), None)
                elif isinstance(msg, Dial):
                    leg, served = _dial_leg(msg, timeout)
                    lis.reply(leg)
                    on_session(n, served, leg.harness)
                else:
                    lis.refuse(f"expected Hello, Who, Serve or Dial, not {type(msg).__name__}")
                    on_session(n, None, f"{seen} sent {type(msg).__name__}, which starts no session")
            except HarnessError as exc:
                lis.refuse(str(exc))
                on_session(n, None, str(exc))
            finally:
                if used:  # its rank has served (or failed): a fresh one for the next session
                    warm.close()
                    warm = None
                    warm = _Pair("P", lis.here, timeout, bind=where.ip)
    finally:
        lis.refuse("the listener stopped")
        lis.close()
        if warm is not None:
            warm.close()


def _session_hello(lis: Listener, session: str) -> tuple[Hello, str]:
    """After Serve: the Hello of that session's decode end, within the timeout; anything else meanwhile (a second
    coordinator, a stray peer) is turned away as busy."""
    deadline = time.monotonic() + lis.timeout
    while True:
        msg, seen = lis.recv(deadline, "waiting for the matrix pair's Hello")
        if isinstance(msg, Hello) and msg.session == session:
            return msg, seen
        lis.refuse("busy: this listener is the prefill end of a matrix pair now")


def _dial_leg(msg: Dial, timeout: float) -> tuple[Leg, Served | None]:
    """A coordinator's Dial: the --peer side against the other listener, as the Leg the coordinator judges and the
    session this end reports; whatever goes wrong is the Leg's `harness` text (that pair's FAIL)."""
    try:
        target = addr.advertised(msg.target, "--matrix target", timeout)
        got = decode_leg(target, timeout, parse_expect(",".join(msg.expect)) if msg.expect else [], msg.session)
    except (HarnessError, BadInput) as exc:
        empty = End("", [], [], [], "", "decode")
        return Leg(0, 0, None, 0.0, 0.0, empty, msgspec.structs.replace(empty, role="prefill"), None, str(exc)), None
    return Leg(got.checked, got.wrong, got.first_wrong, got.gbps, got.p50_us, got.local, got.remote, got.error), got


# ------------------------------------------------------------------------------------------------ peer
def dial(report: Any, target: Endpoint, timeout: float, expect: list[str] | None = None) -> None:
    """--peer: one pair with the listener at `target`, recorded in the report."""
    record(report, decode_leg(target, timeout, expect or []))


def decode_leg(target: Endpoint, timeout: float, expect: list[str], session: str = "") -> Served:
    """The decode end of one pair: Hello to the listener at `target`, Fill at the address it advertises, the READ
    with every block checked, Result; both ends' evidence."""
    from pdcheck import __version__

    ctx = zmq.Context.instance()
    where = f"--peer {target.label}"
    pair = _Pair("D", _route_to(target.ip), timeout)
    try:
        try:
            frames = request_reply(ctx, _endpoint(target.ip, target.port), target.ip,
                                   encode(Hello(PROTOCOL, __version__, _shape(), expect, session)), timeout)
        except PeerError as exc:
            raise type(exc)(f"{where}: {exc} (is `pdcheck doctor --listen` running there?)") from None
        offer = _expect(frames, Offer, where)
        if not (0 <= offer.addr < 2**64 and 0 <= offer.dev <= bounds.MAX_DEVICE_ID):
            raise PeerError(f"{where}: memory address {offer.addr} or device {offer.dev} out of range")
        if len(offer.metadata) > MAX_FRAME_BYTES:
            raise PeerError(f"{where}: agent metadata over {MAX_FRAME_BYTES >> 20} MiB")
        both = _union(expect, offer.expect, where)
        # What is wrong with the advertised address, the listener hears over the address that did answer (an
        # Aborted in place of the Fill) instead of waiting out its deadline. ZMQ would retry a refused connection
        # silently until the deadline: a plain connect says so at once.
        try:
            adv = addr.advertised(offer.advertise, where, timeout)
        except PeerError as exc:
            _tell_listener(ctx, target, str(exc).removeprefix(f"{where}: "), pair, timeout)
            raise
        same = adv.hostport == target.hostport
        refused = _unreachable(adv.ip, adv.port, timeout)
        if refused:
            gone = _unreachable(target.ip, target.port, timeout) if not same else refused
            if gone:  # nothing answers where the listener did a moment ago either: it went away
                raise PeerError(f"{where}: the listener answered, then went away: {adv.label} now gives {refused}"
                                + ("" if same else f", and {target.label} {gone}") + " (stopped, or died)")
            _tell_listener(ctx, target, f"advertises {adv.label}, where nothing answered ({refused})", pair,
                           timeout)
            raise PeerError(f"{where}: the listener advertises {adv.label}, where nothing answered ({refused}); a "
                            "listener must advertise the address it listens on (VLLM_NIXL_SIDE_CHANNEL_HOST)")
        try:
            frames = request_reply(ctx, _endpoint(adv.ip, adv.port), adv.ip, encode(Fill()), timeout)
        except PeerError as exc:
            if same:  # where it answered a moment ago: gone (nothing listens), or there but silent
                now = _unreachable(adv.ip, adv.port, timeout)
                raise PeerError(f"{where}: the listener answered, then " + (
                    f"went away: {adv.label} now gives {now} (stopped, or died)" if now else
                    f"stopped answering ({exc})")) from None
            raise PeerError(f"{where}: the listener advertises {adv.label}, where nothing answered its protocol "
                            f"({exc}); a listener must advertise the address it listens on") from None
        filled = _expect(frames, Filled, f"{where} (advertised {adv.label})")
        bounds.peer_number(f"{where}: the listener reports its fill time", filled.ms, 0, 3600e3, " ms")
        back = _Back(ctx, adv, where, timeout)
        try:
            pair.ask(bm.Peers([bm.PeerInfo(0, offer.agent_name, offer.metadata, offer.addr, offer.dev)]), m.Ack,
                     "loading the listener's agent metadata")
        except RankFailed as exc:
            if "NIXL_ERR_MISMATCH" not in str(exc):
                return back.aborted(pair, both, str(exc), "read", target)
            # NIXL could not even deserialize it: not a network problem, the other end's words are not metadata
            back.aborted(pair, both, str(exc), "metadata", target)
            raise PeerError(f"{where}: the listener's agent metadata is not NIXL metadata this end's NIXL can read "
                            f"({_nixl_status(str(exc))}): a peer speaking garbage, or a NIXL release of another "
                            "format (both ends must run one NIXL release)") from None
        try:
            pair.ranks.send([pair.rid], pair.row)
            pair.ranks.gather([pair.rid], m.Armed, timeout, "READing the listener's blocks (warm-up)")
            row: bm.RankRow = pair.ask(bm.Measure(), bm.RankRow, "READing the listener's blocks")
        except RankFailed as exc:
            # NIXL refused or failed the READ (an unreachable agent, a wrong device): the finding of this check.
            return back.aborted(pair, both, str(exc), "read", target)
        mine = pair.stop()
        gbps = row.nbytes * row.iters / row.wall_ns if row.wall_ns else 0.0
        import numpy as np

        lat = np.frombuffer(row.lat_ns, dtype="<i8")
        p50 = float(np.median(lat)) / 1e3 if lat.size else 0.0
        theirs = back.evidence(Result(row.checked, row.wrong, row.first_wrong, gbps, p50, mine))
        return Served("peer", target.label, adv.label, row.checked, row.wrong, row.first_wrong, gbps, p50, mine,
                      theirs, both)
    finally:
        pair.close()


def _nixl_status(text: str) -> str:
    return next((w.rstrip(":,") for w in text.split() if w.startswith("NIXL_ERR")), "a NIXL error")


class _Back:
    """The last exchange with the listener, at its advertised address: this end's outcome for its evidence."""

    def __init__(self, ctx: zmq.Context, adv: Endpoint, where: str, timeout: float) -> None:
        self.ctx, self.adv, self.where, self.timeout = ctx, adv, where, timeout

    def evidence(self, msg: Any) -> End:
        try:
            frames = request_reply(self.ctx, _endpoint(self.adv.ip, self.adv.port), self.adv.ip, encode(msg),
                                   self.timeout)
        except PeerError as exc:
            raise type(exc)(f"{self.where} (advertised {self.adv.label}): no evidence back: {exc}") from None
        end = _expect(frames, Evidence, f"{self.where} (advertised {self.adv.label})").end
        return msgspec.structs.replace(end, role="prefill")

    def aborted(self, pair: _Pair, both: list[str], error: str, stage: str, target: Endpoint) -> Served:
        mine = pair.evidence_after_failure()
        theirs = self.evidence(Aborted(error[:bounds.MAX_PEER_TEXT], mine, stage))
        return Served("peer", target.label, self.adv.label, 0, 0, None, 0.0, 0.0, mine, theirs, both, error)


def _unreachable(host: str, port: int, timeout: float) -> str:
    """Why a TCP connection to host:port fails within timeout ("" when one opens; it closes at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ""
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no connection within {timeout:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def _tell_listener(ctx: zmq.Context, target: Endpoint, why: str, pair: _Pair, timeout: float) -> None:
    """The listener, over the address it was dialled at, learns what is wrong with the one it advertises (why:
    "advertises ..."); a listener that does not answer is left to its own deadline."""
    try:
        request_reply(ctx, _endpoint(target.ip, target.port), target.ip,
                      encode(Aborted(why, pair.evidence_after_failure(), "address")), timeout)
    except PeerError:
        pass


# ------------------------------------------------------------------------------------------------ the verdict
def record(report: Any, s: Served) -> None:
    """Both pair checks of one end into its report: the side channel, and the transfer judged from the decode
    end's lanes against both ends' --expect (both ends reach one verdict on it) and this node's environment."""
    res = PairResult(s.role, f"TCP {s.dialled}", s.advertised,
                     "no KV moved" if s.error else f"{s.checked} blocks checked, {s.wrong} wrong", s.checked, s.wrong,
                     s.gbps, s.p50_us, s.local, s.remote, s.expect)
    report.pair = res
    report.checks.append(check("pair side channel", "PASS", f"TCP {s.dialled}, advertised {s.advertised}"))
    if s.error is not None:
        report.checks.append(check("pair transfer", "FAIL", f"no KV moved: {bounds.peer_text(s.error, 400)}",
                                   unreachable_fix(os.environ)))
        return
    decode_end, prefill_end = (s.local, s.remote) if s.role == "peer" else (s.remote, s.local)
    rdma = any(p.active for p in report.devices.rdma)
    status, detail, fix = transfer_verdict(s.checked, s.wrong, s.first_wrong, s.gbps, decode_end.data, rdma=rdma,
                                           expect=s.expect, env=dict(os.environ), own_lanes=s.role == "peer",
                                           prefill_lanes=prefill_end.transports)
    report.checks.append(check("pair transfer", status, detail, fix))


def unreachable_fix(env: Any) -> str:
    """What to do when the decode rank cannot reach the other node's agent (a bare NIXL_ERR_BACKEND)."""
    net = env.get("UCX_NET_DEVICES", "")
    named = [d for d in net.split(",") if d and d != "all"]
    if named and all(d.split(":")[0] == "lo" for d in named):
        return (f"UCX_NET_DEVICES={net} names only loopback, which never reaches another node: name a device "
                "on the route between the nodes (see network interfaces and RDMA ports), or unset it")
    return ("the agents cannot reach each other: UCX_NET_DEVICES and UCX_TLS on both nodes must name a device and "
            f"transport on the route between them (here: UCX_NET_DEVICES={net or 'unset'}, "
            f"UCX_TLS={env.get('UCX_TLS') or 'unset'})")


# UCX's shared-memory transports (reachable only between processes of one host) and UCX_TLS's aliases
# (docs/transfer-bench.md names the lanes as UCX's protocol tables print them).
SHARED_MEMORY = ("cma", "knem", "xpmem", "posix", "sysv")
ONE_HOST = (*SHARED_MEMORY, "cuda_ipc")  # lanes that never leave a host (cuda_ipc: GPU to GPU within one)
TLS_ALIAS = {"sm": SHARED_MEMORY, "shm": SHARED_MEMORY, "mm": ("posix", "sysv", "xpmem"), "ib": ("rc", "ud", "dc"),
             "cuda": ("cuda_copy", "cuda_ipc")}


def parse_expect(text: str | None) -> list[str]:
    """--expect TRANSPORT[,...]: UCX transports (tcp, rc, rc_mlx5, cma, cuda_ipc, sm) or devices (mlx5_2:1, eth0)."""
    if text is None:
        return []
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or len(items) > 16 or any(
            not (x.isascii() and all(ch.isalnum() or ch in "_:.-" for ch in x)) or len(x) > 64 for x in items):
        raise BadInput(f"--expect: '{bounds.peer_text(text, 80)}' is not a comma list of UCX transports or devices "
                       "(e.g. rc, tcp, cma, cuda_ipc, mlx5_2:1)")
    return items


def _lane(lane: str) -> tuple[str, str]:
    """'tcp/eth0 (software emulation)' -> ('tcp', 'eth0')."""
    tl, _, rest = lane.partition("/")
    return tl, rest.split(" ", 1)[0]


def _allows(name: str, tl: str, dev: str) -> bool:
    """Does an asked-for name (a UCX_TLS entry, an --expect item) cover the lane tl/dev?"""
    return (name in ("all", tl, dev) or tl.startswith(name + "_") or tl in TLS_ALIAS.get(name, ())
            or any(tl.startswith(a + "_") for a in TLS_ALIAS.get(name, ())))


def on_one_host(lane: str) -> bool:
    """A payload lane that only connects processes of one host: shared memory, CUDA IPC, or the loopback device."""
    tl, dev = _lane(lane)
    return tl in ONE_HOST or dev == "lo"


def asked_but_not_used(data: list[str], expect: list[str], env: Any, own_lanes: bool) -> tuple[list[str], list[str]]:
    """(what --expect asked for and the payload did not use, what this node's UCX environment asked for and the
    payload did not use). own_lanes: the payload lanes are this node's (the decode end), so their device names
    can be compared with this node's UCX_NET_DEVICES."""
    lanes = [_lane(d) for d in data]
    missed = [] if not expect or any(_allows(e, tl, dev) for e in expect for tl, dev in lanes) else [
        f"--expect asks for {','.join(expect)}"]
    env_missed: list[str] = []
    net = env.get("UCX_NET_DEVICES", "")
    named = [d for d in net.split(",") if d and d != "all"]
    if named and any(on_one_host(d) for d in data):
        env_missed.append(f"UCX_NET_DEVICES={net} asks for the network")
    if named and own_lanes:
        off = [d for d, (tl, dev) in zip(data, lanes, strict=True)
               if tl not in ONE_HOST and dev != "memory" and dev not in named]
        if off:
            env_missed.append(f"UCX_NET_DEVICES={net} asks for {', '.join(named)}")
    tls = env.get("UCX_TLS", "")
    if tls and not tls.startswith("^"):
        asked = [t.strip() for t in tls.split(",") if t.strip()]
        if not any(_allows(t, tl, dev) for t in asked for tl, dev in lanes):
            env_missed.append(f"UCX_TLS={tls} here asks for {', '.join(asked)} (the other node's UCX_TLS differs?)")
    return missed, env_missed


def transfer_verdict(checked: int, wrong: int, first: str | None, gbps: float, data: list[str], *, rdma: bool,
                     expect: list[str], env: Any, own_lanes: bool,
                     prefill_lanes: list[str] | None = None) -> tuple[str, str, str | None]:
    """(status, detail, fix) of a transfer between two nodes, from the decode end's proof and payload lanes:
    FAIL when blocks arrived wrong or --expect was missed; WARN when no link was exercised (the payload stayed
    within one host), when this node's UCX environment asked for something else, or when RDMA ports are active
    and the payload went over TCP; else PASS."""
    if wrong or not checked:
        return ("FAIL", f"{wrong} of {checked} blocks arrived wrong ({(first or '')[:200]})",
                "the transport corrupts or misroutes data: pin UCX_TLS and UCX_NET_DEVICES to known devices and rerun")
    moved = f"{checked} blocks checked, 0 wrong, {gbps:.2f} GB/s"
    if not data:
        return "WARN", f"{moved}; UCX printed no protocol table for the READ", "unset UCX_PROTO_INFO"
    over = f"payload over {', '.join(data)} (UCX protocol table of the decode end)"
    missed, env_missed = asked_but_not_used(data, expect, env, own_lanes)
    env_fix = ("check UCX_TLS and UCX_NET_DEVICES on both nodes (now here: UCX_TLS="
               f"{env.get('UCX_TLS') or 'unset'}, UCX_NET_DEVICES={env.get('UCX_NET_DEVICES') or 'unset'}) and "
               "that the asked-for devices are up (RDMA ports, network interfaces above)")
    if missed or env_missed:
        status = "FAIL" if missed else "WARN"
        return (status, f"{moved}; the payload went over {', '.join(data)} while " + "; ".join(missed + env_missed)
                + _one_host_note(data, prefill_lanes), env_fix)
    if all(on_one_host(d) for d in data):
        return ("WARN", f"{moved}; {over}" + _one_host_note(data, prefill_lanes),
                "run the two ends on two nodes (in Kubernetes: pod anti-affinity) to test the link between them")
    if rdma and all(d.startswith("tcp/") for d in data):
        return ("WARN", f"{moved}; {over}; payload fell back to tcp although RDMA ports are active",
                "check UCX_TLS and UCX_NET_DEVICES on both nodes (see the suggested value)")
    return "PASS", f"{moved}; {over}", None


def _one_host_note(data: list[str], prefill_lanes: list[str] | None) -> str:
    one = [d for d in data if on_one_host(d)]
    if not one or len(one) != len(data):
        return ""
    lanes = f"; the prefill end's UCX lanes: {', '.join(prefill_lanes)}" if prefill_lanes else ""
    return (f"; no link exercised: {', '.join(one)} only reaches processes of the same host, so both ends run on "
            f"one host (the decode end's payload lanes: {', '.join(data)}{lanes})")
