"""Two nodes: `doctor --listen` serves a prefill rank's KV, `doctor --peer` READs it with a decode rank, both
real transfer-bench ranks (pdcheck.bench.rank) started by pdcheck's launcher, every block checked by
coordinate, and each end's transport as UCX's protocol tables in its own rank log name it.

The side channel is ZMQ REQ/REP, msgspec msgpack only (never pickle), three exchanges like a P/D handshake:
Hello at the address the peer dialled -> Offer (the listener's agent metadata and the address it advertises,
as vLLM's prefill advertises VLLM_NIXL_SIDE_CHANNEL_HOST); Fill and Result at the advertised address. Every
exchange has one deadline (pdcheck.netio); anything a peer does wrong is a PeerError: exit 3, one line.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pdcheck import bounds
from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.bench.plan import make_plan
from pdcheck.bench.transport import diagnose, parse_proto_info
from pdcheck.doctor import loopback
from pdcheck.doctor.model import check
from pdcheck.errors import BadInput, HarnessError
from pdcheck.netio import MAX_FRAME_BYTES, PeerError, bounded_socket, request_reply

PROTOCOL = "pdcheck-doctor/1"


# ------------------------------------------------------------------------------------------------ the wire
class Hello(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    protocol: str
    pdcheck: str
    shape: list[int]  # layers, kv_heads, head_dim, block_tokens, tokens, requests: both ends build one plan


class Offer(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    agent_name: str
    metadata: bytes
    addr: int
    dev: int
    advertise: str  # HOST:PORT where Fill and Result go
    ucx: str


class Fill(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


class Filled(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    ms: float


class End(msgspec.Struct):
    """One end's evidence from its own rank log."""

    host: str
    data: list[str]  # what carried the READ payload (decode end)
    notifications: list[str]
    transports: list[str]  # every transport/device in the rank's protocol tables
    ucx: str


class Result(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    checked: int
    wrong: int
    first_wrong: str | None
    gbps: float
    p50_us: float
    end: End


class Evidence(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    end: End


class Refused(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    reason: str


Wire = Hello | Offer | Fill | Filled | Result | Evidence | Refused


class PairResult(msgspec.Struct):
    role: str  # "listen" or "peer"
    side_channel: str  # "TCP 10.0.0.5:7777"
    advertised: str
    proof: str  # "256 blocks checked, 0 wrong"
    checked: int
    wrong: int
    gbps: float
    p50_us: float
    local: End
    remote: End

    def lines(self) -> list[str]:
        return [f"side channel over {self.side_channel} (advertised {self.advertised}); {self.proof}, "
                f"{self.gbps:.2f} GB/s",
                *(f"{who} {e.host}: payload over {', '.join(e.data) or '-'}; notifications over "
                  f"{', '.join(e.notifications) or '-'}; UCX lanes {', '.join(e.transports) or 'none seen'} "
                  f"(UCX {e.ucx})" for who, e in (("this end", self.local), ("other end", self.remote)))]


def _decode(data: bytes, what: str) -> Any:
    try:
        return msgspec.msgpack.decode(data, type=Wire)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerError(f"{what}: not a {PROTOCOL} message ({str(exc)[:120]})") from None


def _expect(frames: list[bytes], kind: type, what: str) -> Any:
    if len(frames) != 1:
        raise PeerError(f"{what}: {len(frames)} frames, expected 1")
    msg = _decode(frames[0], what)
    if isinstance(msg, Refused):
        raise PeerError(f"{what}: the other end refused: {msg.reason[:bounds.MAX_PEER_STR]}")
    if not isinstance(msg, kind):
        raise PeerError(f"{what}: got {type(msg).__name__}, expected {kind.__name__}")
    return msg


def _shape() -> list[int]:
    s = loopback.SHAPE
    return [s.layers, s.kv_heads, s.head_dim, loopback.BLOCK_TOKENS, loopback.TOKENS, loopback.REQUESTS]


# ------------------------------------------------------------------------------------------------ addresses
def _split(text: str, flag: str) -> tuple[str, str]:
    if text.startswith("["):
        host, sep, port = text[1:].partition("]")
        return host, port.removeprefix(":") if sep else ""
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, port
    return text, ""


def parse_listen(text: str) -> tuple[str, int]:
    """--listen [HOST:PORT]: '' is 127.0.0.1 on a port the OS picks; HOST alone, too."""
    host, port = _split(text.strip(), "--listen")
    host = host or "127.0.0.1"
    bounds.check_host("--listen", "HOST", host)
    if port and not (port.isdigit() and 0 <= int(port) <= 65535):
        raise BadInput(f"--listen: {port!r} is not a port from 0 to 65535")
    return host, int(port or 0)


def parse_peer(text: str) -> tuple[str, int]:
    host, port = _split(text.strip(), "--peer")
    if not host or not port:
        raise BadInput(f"--peer: {text!r} is not HOST:PORT (e.g. 10.0.0.5:7777)")
    bounds.check_host("--peer", "HOST", host)
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise BadInput(f"--peer: {port!r} is not a port from 1 to 65535")
    return host, int(port)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _endpoint(host: str, port: int) -> str:
    return f"tcp://{_hostport(host, port)}"


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


def check_advertised(adv: str, what: str) -> tuple[str, int]:
    host, port = _split(adv, what)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise PeerError(f"{what}: advertises {adv[:80]!r}, not an IP address and port") from None
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise PeerError(f"{what}: advertises {adv[:80]!r}, not an IP address and port")
    if ip.is_unspecified:
        raise PeerError(f"{what}: advertises {adv}, a bind-all address: dialling it reaches this node itself "
                        "(the listener must advertise an address of its own node)")
    return host, int(port)


# ------------------------------------------------------------------------------------------------ ranks
def _spec(role: str, host: str, arena: int, ucx: dict[str, str]) -> m.BenchSpec:
    cfg = loopback.config("cpu", 30.0)
    return m.BenchSpec(
        role=role, tp_rank=0, agent_name=f"pdcheck-doctor-{'listen' if role == 'P' else 'peer'}-{os.getpid()}",
        arena_bytes=arena, device="cpu", gpu=0, cores=[], error_mode=None, progress_thread=False,
        target_busy=cfg.target_busy, ucx_env=ucx, shape=cfg.shape, ptp=1, dtp=1, iters=0, warmup=cfg.warmup,
        min_time=cfg.min_time, notif=True, host=host)


def _row_msg(plan: Any) -> m.Row:
    from pdcheck.bench import tables

    row = plan.rows[0]
    return m.Row(row.index, row.block_tokens, row.tokens, row.blocks, row.requests, row.run_length, row.num_blocks,
                 tables.table_bytes(row.tables_p), tables.table_bytes(row.tables_d), -1)


def _ucx_env() -> dict[str, str]:
    return {} if "UCX_PROTO_INFO" in os.environ else {"UCX_PROTO_INFO": "y"}


def _evidence(log: Path, host: str, ucx: str) -> End:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    tables = parse_proto_info(text)
    d = diagnose(tables)
    lanes = sorted({tl for t in tables if t.scope != "self" for tl in t.transports()})
    return End(host, d.data, d.notif, lanes, ucx)


class _Pair:
    """One bench rank on pdcheck's launcher, with transfer-bench's fault words (pdcheck.bench.runner)."""

    def __init__(self, role: str, host: str, timeout: float) -> None:
        from pdcheck.bench.runner import Ranks
        from pdcheck.launcher import Launcher

        self.plan = make_plan(loopback.config("cpu", timeout))
        self.row = _row_msg(self.plan)
        self.timeout = timeout
        self.dir = Path(tempfile.mkdtemp(prefix="pdcheck-doctor-"))
        self.lau = Launcher()
        self.ranks = Ranks(self.lau, self.dir)
        self.rid = orc.ids(role, 1)[0]
        self.host = host
        arena = (self.plan.pool_p if role == "P" else self.plan.pool_d)[0]
        self.ranks.start(self.rid, _spec(role, host, arena, _ucx_env()))
        self.ready: m.BenchReady = self.ranks.gather([self.rid], m.BenchReady, timeout,
                                                     "creating the agent and registering memory")[self.rid]

    def ask(self, msg: m.Msg, kind: type, what: str) -> Any:
        self.ranks.send([self.rid], msg)
        return self.ranks.gather([self.rid], kind, self.timeout, what)[self.rid]

    def stop(self) -> End:
        """Stop the rank (its log is complete once it exits) and read its evidence."""
        self.ask(m.Stop(), m.Bye, "stopping")
        self.lau.close()
        return _evidence(self.dir / f"{self.rid.short}.log", self.host, self.ready.ucx_version)

    def close(self) -> None:
        self.lau.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ listener
def listen(report: Any, where: tuple[str, int], timeout: float, advertise: str | None = None) -> None:
    """Serve one peer: bind, print where, wait (at most `timeout`) for its Hello, then Fill and Result."""
    from pdcheck import __version__

    host, port = where
    ctx = zmq.Context.instance()
    sock = bounded_socket(ctx, zmq.REP, host)
    pair: _Pair | None = None
    try:
        try:
            if port:
                sock.bind(_endpoint(host, port))
            else:
                port = sock.bind_to_random_port(f"tcp://{'[' + host + ']' if ':' in host else host}")
        except zmq.ZMQError as exc:
            raise HarnessError(f"--listen {_hostport(host, port)}: cannot bind: {exc}") from None
        adv = advertise or _hostport(advertised_host(host), port)
        sys.stderr.write(f"pdcheck doctor: listening on {_hostport(host, port)} (advertising {adv})\n")
        sys.stderr.flush()
        pair = _Pair("P", host, timeout)
        deadline = time.monotonic() + timeout
        hello = _serve(sock, deadline, timeout, Hello, "waiting for a peer's Hello")
        if hello.protocol != PROTOCOL or hello.shape != _shape():
            _reply(sock, Refused(f"this listener speaks {PROTOCOL} with shape {_shape()} (pdcheck {__version__})"))
            raise PeerError(f"the peer speaks {hello.protocol[:40]!r} with shape {hello.shape[:8]} (pdcheck "
                            f"{hello.pdcheck[:40]}); this end {PROTOCOL} {_shape()}")
        r = pair.ready
        _reply(sock, Offer(r.agent_name, r.metadata, r.addr, r.dev, adv, r.ucx_version))
        deadline = time.monotonic() + timeout
        _serve(sock, deadline, timeout, Fill, "waiting for the peer's Fill (at the advertised address)")
        filled = pair.ask(pair.row, m.Filled, "filling the KV blocks")
        _reply(sock, Filled(filled.fill_ms))
        deadline = time.monotonic() + timeout
        res = _serve(sock, deadline, timeout, Result, "waiting for the peer's transfer result")
        mine = pair.stop()
        _reply(sock, Evidence(mine))
        dialled = _hostport(host, port)
        _record(report, "listen", dialled, adv, res.checked, res.wrong, res.first_wrong, res.gbps, res.p50_us,
                mine, res.end)
    finally:
        sock.close(0)
        if pair is not None:
            pair.close()


def _serve(sock: zmq.Socket, deadline: float, timeout: float, kind: type, what: str) -> Any:
    left = deadline - time.monotonic()
    if left <= 0 or not sock.poll(int(left * 1000), zmq.POLLIN):
        raise PeerError(f"--listen: nothing arrived within {timeout:g} s while {what}")
    frame = sock.recv()
    if sock.getsockopt(zmq.RCVMORE):
        raise PeerError(f"--listen: a multi-part message while {what} (a {PROTOCOL} peer sends one frame)")
    msg = _decode(frame, f"--listen: while {what}")
    if not isinstance(msg, kind):
        _reply(sock, Refused(f"expected {kind.__name__}"))
        raise PeerError(f"--listen: got {type(msg).__name__} while {what}")
    return msg


def _reply(sock: zmq.Socket, msg: Any) -> None:
    sock.send(msgspec.msgpack.encode(msg))


# ------------------------------------------------------------------------------------------------ peer
def dial(report: Any, target: tuple[str, int], timeout: float) -> None:
    from pdcheck import __version__

    host, port = target
    ctx = zmq.Context.instance()
    dialled = _hostport(host, port)
    where = f"--peer {dialled}"
    local = _route_to(host)
    pair = _Pair("D", local, timeout)
    try:
        try:
            frames = request_reply(ctx, _endpoint(host, port), host,
                                   msgspec.msgpack.encode(Hello(PROTOCOL, __version__, _shape())), timeout)
        except PeerError as exc:
            raise type(exc)(f"{where}: {exc} (is `pdcheck doctor --listen` running there?)") from None
        offer = _expect(frames, Offer, where)
        if len(offer.agent_name) > bounds.MAX_PEER_STR or len(offer.ucx) > bounds.MAX_PEER_STR:
            raise PeerError(f"{where}: an agent name or UCX version over {bounds.MAX_PEER_STR} characters")
        if not (0 <= offer.addr < 2**64 and 0 <= offer.dev <= bounds.MAX_DEVICE_ID):
            raise PeerError(f"{where}: memory address {offer.addr} or device {offer.dev} out of range")
        if len(offer.metadata) > MAX_FRAME_BYTES:
            raise PeerError(f"{where}: agent metadata over {MAX_FRAME_BYTES >> 20} MiB")
        ahost, aport = check_advertised(offer.advertise, where)
        adv = _hostport(ahost, aport)
        try:
            frames = request_reply(ctx, _endpoint(ahost, aport), ahost, msgspec.msgpack.encode(Fill()), timeout)
        except PeerError as exc:
            raise PeerError(f"{where}: the listener advertises {adv}, where nothing answered ({exc}); a listener "
                            "must advertise the address it listens on (VLLM_NIXL_SIDE_CHANNEL_HOST)") from None
        _expect(frames, Filled, f"{where} (advertised {adv})")
        pair.ask(m.Peers([m.PeerInfo(0, offer.agent_name, offer.metadata, offer.addr, offer.dev)]), m.Ack,
                 "loading the listener's agent metadata")
        pair.ranks.send([pair.rid], pair.row)
        pair.ranks.gather([pair.rid], m.Armed, timeout, "READing the listener's blocks (warm-up)")
        row: m.RankRow = pair.ask(m.Measure(), m.RankRow, "READing the listener's blocks")
        mine = pair.stop()
        gbps = row.nbytes * row.iters / row.wall_ns if row.wall_ns else 0.0
        import numpy as np

        lat = np.frombuffer(row.lat_ns, dtype="<i8")
        p50 = float(np.median(lat)) / 1e3 if lat.size else 0.0
        try:
            frames = request_reply(ctx, _endpoint(ahost, aport), ahost, msgspec.msgpack.encode(
                Result(row.checked, row.wrong, row.first_wrong, gbps, p50, mine)), timeout)
        except PeerError as exc:
            raise type(exc)(f"{where} (advertised {adv}): no evidence back: {exc}") from None
        theirs = _expect(frames, Evidence, f"{where} (advertised {adv})").end
        _record(report, "peer", dialled, adv, row.checked, row.wrong, row.first_wrong, gbps, p50, mine,
                _clean(theirs))
    finally:
        pair.close()


def _clean(e: End) -> End:
    """The other end's evidence, cut to printable bounds (it is the peer's word)."""
    cap = bounds.MAX_PEER_STR

    def few(xs: list[str]) -> list[str]:
        return [x[:cap] for x in xs[:32]]

    return End(e.host[:cap], few(e.data), few(e.notifications), few(e.transports), e.ucx[:cap])


def _record(report: Any, role: str, dialled: str, adv: str, checked: int, wrong: int, first: str | None,
            gbps: float, p50: float, mine: End, theirs: End) -> None:
    decode_end = mine if role == "peer" else theirs
    res = PairResult(role, f"TCP {dialled}", adv, f"{checked} blocks checked, {wrong} wrong", checked, wrong, gbps,
                     p50, mine, theirs)
    report.pair = res
    data = ", ".join(decode_end.data) or "unknown"
    report.checks.append(check("pair side channel", "PASS", f"TCP {dialled}, advertised {adv}"))
    if wrong or not checked:
        report.checks.append(check("pair transfer", "FAIL", f"{wrong} of {checked} blocks arrived wrong "
                                   f"({(first or '')[:200]})", "the transport corrupts or misroutes data: pin "
                                   "UCX_TLS and UCX_NET_DEVICES to known devices and rerun"))
    elif not decode_end.data:
        report.checks.append(check("pair transfer", "WARN", f"{checked} blocks checked, {gbps:.2f} GB/s; UCX "
                                   "printed no protocol table for the READ", "unset UCX_PROTO_INFO"))
    else:
        rdma = any(p.active for p in report.devices.rdma)
        tcp = all(d.startswith("tcp/") for d in decode_end.data)
        status = "WARN" if tcp and rdma else "PASS"
        report.checks.append(check(
            "pair transfer", status, f"{checked} blocks checked, 0 wrong, {gbps:.2f} GB/s; payload over {data} "
            f"(UCX protocol table of the decode end)" + ("; payload fell back to tcp although RDMA ports are "
                                                          "active" if status == "WARN" else ""),
            "check UCX_TLS and UCX_NET_DEVICES on both nodes (see the suggested value)" if status == "WARN"
            else None))
