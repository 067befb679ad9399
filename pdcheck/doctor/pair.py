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
from pdcheck.bench import messages as bm
from pdcheck.bench.plan import make_plan
from pdcheck.bench.transport import diagnose, parse_proto_info
from pdcheck.doctor import loopback
from pdcheck.doctor.model import check
from pdcheck.errors import BadInput, HarnessError, RankFailed
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


class Aborted(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """The peer's decode rank could not READ (NIXL's own error): a finding for both ends, not a harness fault."""

    error: str
    end: End


Wire = Hello | Offer | Fill | Filled | Result | Evidence | Refused | Aborted


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


def _evidence(log: Path, host: str, ucx: str) -> End:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    tables = parse_proto_info(text)
    d = diagnose(tables)
    lanes = sorted({tl for t in tables if t.scope != "self" for tl in t.transports()})
    return End(host, d.data, d.notif, lanes, ucx)


RANK_SETUP_S = 60.0


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
        # --timeout bounds what the other end does; this rank's own start-up (an agent, a registration, on a
        # busy machine seconds) gets at least RANK_SETUP_S, so a short --timeout never fails a healthy start.
        self.ready: bm.BenchReady = self.ranks.gather([self.rid], bm.BenchReady, max(timeout, RANK_SETUP_S),
                                                     "creating the agent and registering memory")[self.rid]

    def ask(self, msg: m.Msg, kind: type, what: str) -> Any:
        self.ranks.send([self.rid], msg)
        return self.ranks.gather([self.rid], kind, self.timeout, what)[self.rid]

    def stop(self) -> End:
        """Stop the rank (its log is complete once it exits) and read its evidence."""
        self.ask(m.Stop(), bm.Bye, "stopping")
        self.lau.close()
        return _evidence(self.dir / f"{self.rid.short}.log", self.host, self.ready.ucx_version)

    def evidence_after_failure(self) -> End:
        """The rank failed (and ends): close it and read what its log says."""
        self.lau.close()
        return _evidence(self.dir / f"{self.rid.short}.log", self.host, self.ready.ucx_version)

    def close(self) -> None:
        self.lau.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ listener
def listen(report: Any, where: tuple[str, int], timeout: float, advertise: str | None = None,
           expect: list[str] | None = None) -> None:
    """Serve one peer: bind, print where, wait (at most `timeout`) for its Hello, then Fill and Result."""
    from pdcheck import __version__

    host, port = where
    ctx = zmq.Context.instance()
    sock = bounded_socket(ctx, zmq.REP, host)
    pair: _Pair | None = None
    try:
        # The rank (its agent, registered memory) starts before the announcement: "listening on" means a peer's
        # Hello is answered at once, within the peer's own --timeout however long this machine took to start it.
        pair = _Pair("P", host, timeout)
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
        deadline = time.monotonic() + timeout
        hello = _serve(sock, deadline, timeout, Hello, "waiting for a peer's Hello")
        if hello.protocol != PROTOCOL or hello.shape != _shape():
            _reply(sock, Refused(f"this listener speaks {PROTOCOL} with shape {_shape()} (pdcheck {__version__})"))
            raise PeerError(f"the peer speaks {hello.protocol[:40]!r} with shape {hello.shape[:8]} (pdcheck "
                            f"{hello.pdcheck[:40]}); this end {PROTOCOL} {_shape()}")
        r = pair.ready
        _reply(sock, Offer(r.agent_name, r.metadata, r.addr, r.dev, adv, r.ucx_version))
        deadline = time.monotonic() + timeout
        fill = _serve(sock, deadline, timeout, (Fill, Aborted), "waiting for the peer's Fill (at the advertised "
                      "address)")
        if isinstance(fill, Aborted):  # the peer could not use the advertised address (and said so here)
            _reply(sock, Evidence(pair.stop()))
            raise PeerError(f"--listen: the peer says this listener {fill.error[:bounds.MAX_PEER_STR]}; advertise "
                            "an address of this node that this listener listens on (--advertise)")
        filled = pair.ask(pair.row, bm.Filled, "filling the KV blocks")
        _reply(sock, Filled(filled.fill_ms))
        deadline = time.monotonic() + timeout
        res = _serve(sock, deadline, timeout, (Result, Aborted), "waiting for the peer's transfer result")
        mine = pair.stop()
        _reply(sock, Evidence(mine))
        dialled = _hostport(host, port)
        if isinstance(res, Aborted):
            _record_aborted(report, "listen", dialled, adv, f"the peer's READ failed: {res.error}", mine,
                            _clean(res.end))
            return
        _record(report, "listen", dialled, adv, res.checked, res.wrong, res.first_wrong, res.gbps, res.p50_us,
                mine, _clean(res.end), expect)
    finally:
        sock.close(0)
        if pair is not None:
            pair.close()


def _serve(sock: zmq.Socket, deadline: float, timeout: float, kind: type | tuple[type, ...], what: str) -> Any:
    left = deadline - time.monotonic()
    if left <= 0 or not sock.poll(int(left * 1000), zmq.POLLIN):
        raise PeerError(f"--listen: nothing arrived within {timeout:g} s while {what}")
    frame = sock.recv()
    if sock.getsockopt(zmq.RCVMORE):
        raise PeerError(f"--listen: a multi-part message while {what} (a {PROTOCOL} peer sends one frame)")
    msg = _decode(frame, f"--listen: while {what}")
    if not isinstance(msg, kind):
        name = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        _reply(sock, Refused(f"expected {name}"))
        raise PeerError(f"--listen: got {type(msg).__name__} while {what}")
    return msg


def _reply(sock: zmq.Socket, msg: Any) -> None:
    sock.send(msgspec.msgpack.encode(msg))


# ------------------------------------------------------------------------------------------------ peer
def dial(report: Any, target: tuple[str, int], timeout: float, expect: list[str] | None = None) -> None:
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
        # What is wrong with the advertised address, the listener hears over the address that did answer (an
        # Aborted in place of the Fill) instead of waiting out its deadline. ZMQ would retry a refused connection
        # silently until the deadline: a plain connect says so at once.
        try:
            ahost, aport = check_advertised(offer.advertise, where)
        except PeerError as exc:
            _tell_listener(ctx, host, port, str(exc).removeprefix(f"{where}: "), pair, timeout)
            raise
        adv = _hostport(ahost, aport)
        lie = "; a listener must advertise the address it listens on (VLLM_NIXL_SIDE_CHANNEL_HOST)"
        refused = _unreachable(ahost, aport, timeout)
        if refused:
            _tell_listener(ctx, host, port, f"advertises {adv}, where nothing answered ({refused})", pair, timeout)
            raise PeerError(f"{where}: the listener advertises {adv}, where nothing answered ({refused}){lie}")
        try:
            frames = request_reply(ctx, _endpoint(ahost, aport), ahost, msgspec.msgpack.encode(Fill()), timeout)
        except PeerError as exc:
            raise PeerError(f"{where}: the listener advertises {adv}, where nothing answered ({exc}){lie}") from None
        _expect(frames, Filled, f"{where} (advertised {adv})")
        try:
            pair.ask(bm.Peers([bm.PeerInfo(0, offer.agent_name, offer.metadata, offer.addr, offer.dev)]), m.Ack,
                     "loading the listener's agent metadata")
            pair.ranks.send([pair.rid], pair.row)
            pair.ranks.gather([pair.rid], m.Armed, timeout, "READing the listener's blocks (warm-up)")
            row: bm.RankRow = pair.ask(bm.Measure(), bm.RankRow, "READing the listener's blocks")
        except RankFailed as exc:
            # NIXL refused or failed the READ (an unreachable agent, a wrong device): the finding of this check.
            mine = pair.evidence_after_failure()
            try:
                frames = request_reply(ctx, _endpoint(ahost, aport), ahost,
                                       msgspec.msgpack.encode(Aborted(str(exc)[:1000], mine)), timeout)
            except PeerError as exc2:
                raise type(exc2)(f"{where} (advertised {adv}): no evidence back: {exc2}") from None
            theirs = _expect(frames, Evidence, f"{where} (advertised {adv})").end
            _record_aborted(report, "peer", dialled, adv, str(exc), mine, _clean(theirs))
            return
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
                _clean(theirs), expect)
    finally:
        pair.close()


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


def _tell_listener(ctx: zmq.Context, host: str, port: int, why: str, pair: _Pair, timeout: float) -> None:
    """The listener, over the address it was dialled at, learns what is wrong with the one it advertises (why:
    "advertises ..."); a listener that does not answer is left to its own deadline."""
    try:
        request_reply(ctx, _endpoint(host, port), host,
                      msgspec.msgpack.encode(Aborted(why, pair.evidence_after_failure())), timeout)
    except PeerError:
        pass


def _clean(e: End) -> End:
    """The other end's evidence, cut to printable bounds (it is the peer's word)."""
    cap = bounds.MAX_PEER_STR

    def few(xs: list[str]) -> list[str]:
        return [x[:cap] for x in xs[:32]]

    return End(e.host[:cap], few(e.data), few(e.notifications), few(e.transports), e.ucx[:cap])


def _record(report: Any, role: str, dialled: str, adv: str, checked: int, wrong: int, first: str | None,
            gbps: float, p50: float, mine: End, theirs: End, expect: list[str] | None = None) -> None:
    decode_end = mine if role == "peer" else theirs
    res = PairResult(role, f"TCP {dialled}", adv, f"{checked} blocks checked, {wrong} wrong", checked, wrong, gbps,
                     p50, mine, theirs)
    report.pair = res
    report.checks.append(check("pair side channel", "PASS", f"TCP {dialled}, advertised {adv}"))
    rdma = any(p.active for p in report.devices.rdma)
    status, detail, fix = transfer_verdict(checked, wrong, first, gbps, decode_end.data, rdma=rdma,
                                           expect=expect or [], env=dict(os.environ), own_lanes=role == "peer")
    report.checks.append(check("pair transfer", status, detail, fix))


def _record_aborted(report: Any, role: str, dialled: str, adv: str, error: str, mine: End, theirs: End) -> None:
    """The decode rank could not READ: NIXL's error is the finding (FAIL, exit 1), with both ends' lanes."""
    res = PairResult(role, f"TCP {dialled}", adv, "no KV moved", 0, 0, 0.0, 0.0, mine, theirs)
    report.pair = res
    report.checks.append(check("pair side channel", "PASS", f"TCP {dialled}, advertised {adv}"))
    report.checks.append(check("pair transfer", "FAIL", f"no KV moved: {error[:400]}", unreachable_fix(os.environ)))


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


# ------------------------------------------------------------------------------------------------ which transport
# UCX's shared-memory transports (reachable only between processes of one host) and UCX_TLS's aliases
# (docs/transfer-bench.md names the lanes as UCX's protocol tables print them).
SHARED_MEMORY = ("cma", "knem", "xpmem", "posix", "sysv")
TLS_ALIAS = {"sm": SHARED_MEMORY, "shm": SHARED_MEMORY, "mm": ("posix", "sysv", "xpmem"), "ib": ("rc", "ud", "dc"),
             "cuda": ("cuda_copy", "cuda_ipc")}


def parse_expect(text: str | None) -> list[str]:
    """--expect TRANSPORT[,...]: UCX transports (tcp, rc, rc_mlx5, cma, cuda_ipc, sm) or devices (mlx5_2:1, eth0)."""
    if text is None:
        return []
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or any(not all(ch.isalnum() or ch in "_:.-" for ch in x) or len(x) > 64 for x in items):
        raise BadInput(f"--expect: {text[:80]!r} is not a comma list of UCX transports or devices "
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
    shm = [d for d, (tl, _) in zip(data, lanes, strict=True) if tl in SHARED_MEMORY]
    if named and shm:
        env_missed.append(f"UCX_NET_DEVICES={net} asks for the network, but {', '.join(shm)} is shared memory: "
                          "both ends run on one host and the link between them was not tested")
    if named and own_lanes:
        off = [d for d, (tl, dev) in zip(data, lanes, strict=True)
               if tl not in SHARED_MEMORY and dev != "memory" and dev not in named]
        if off:
            env_missed.append(f"UCX_NET_DEVICES={net} asks for {', '.join(named)}")
    tls = env.get("UCX_TLS", "")
    if tls and not tls.startswith("^"):
        asked = [t.strip() for t in tls.split(",") if t.strip()]
        if not any(_allows(t, tl, dev) for t in asked for tl, dev in lanes):
            env_missed.append(f"UCX_TLS={tls} here asks for {', '.join(asked)} (the other node's UCX_TLS differs?)")
    return missed, env_missed


def transfer_verdict(checked: int, wrong: int, first: str | None, gbps: float, data: list[str], *, rdma: bool,
                     expect: list[str], env: Any, own_lanes: bool) -> tuple[str, str, str | None]:
    """(status, detail, fix) of a transfer between two nodes, from the decode end's proof and payload lanes."""
    if wrong or not checked:
        return ("FAIL", f"{wrong} of {checked} blocks arrived wrong ({(first or '')[:200]})",
                "the transport corrupts or misroutes data: pin UCX_TLS and UCX_NET_DEVICES to known devices and rerun")
    moved = f"{checked} blocks checked, 0 wrong, {gbps:.2f} GB/s"
    if not data:
        return "WARN", f"{moved}; UCX printed no protocol table for the READ", "unset UCX_PROTO_INFO"
    over = f"payload over {', '.join(data)} (UCX protocol table of the decode end)"
    missed, env_missed = asked_but_not_used(data, expect, env, own_lanes)
    if missed or env_missed:
        status = "FAIL" if missed else "WARN"
        return (status, f"{moved}; the payload went over {', '.join(data)} while " + "; ".join(missed + env_missed),
                "check UCX_TLS and UCX_NET_DEVICES on both nodes (now here: UCX_TLS="
                f"{env.get('UCX_TLS') or 'unset'}, UCX_NET_DEVICES={env.get('UCX_NET_DEVICES') or 'unset'}) and "
                "that the asked-for devices are up (RDMA ports, network interfaces above)")
    if rdma and all(d.startswith("tcp/") for d in data):
        return ("WARN", f"{moved}; {over}; payload fell back to tcp although RDMA ports are active",
                "check UCX_TLS and UCX_NET_DEVICES on both nodes (see the suggested value)")
    return "PASS", f"{moved}; {over}", None
