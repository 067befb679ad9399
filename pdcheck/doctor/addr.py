"""Addresses doctor takes (`--listen`, `--peer`, `--advertise`, `--matrix`) and the ones a listener advertises:
HOST:PORT where HOST is an IP address or a host name (a Kubernetes Service's included), resolved once, within a
deadline, and shown as both (`node-a:7777 (10.0.0.5)`). A name that does not resolve is bad input (exit 2) when
the user typed it, a peer's fault (exit 3) when a listener advertised it."""

from __future__ import annotations

import ipaddress

import msgspec

from pdcheck import bounds
from pdcheck.errors import BadInput
from pdcheck.netio import PeerError, lookup

RESOLVE_S = 10.0  # a name's lookup at most (the resolver has no deadline of its own: pdcheck.netio.lookup_all)


class Endpoint(msgspec.Struct, frozen=True):
    """HOST:PORT as given and the address HOST resolved to."""

    host: str  # as given: an IP address or a name
    ip: str  # what it resolved to (the address itself for an IP)
    port: int

    @property
    def hostport(self) -> str:
        """The resolved address, `10.0.0.5:7777` or `[::1]:7777`, for sockets and comparisons."""
        return hostport(self.ip, self.port)

    @property
    def label(self) -> str:
        """As the user and the output name it: `node-a:7777 (10.0.0.5)`, or `10.0.0.5:7777` for an IP."""
        given = hostport(self.host, self.port)
        return given if self.host == self.ip else f"{given} ({self.ip})"


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def split(text: str) -> tuple[str, str | None]:
    """'host:port', '[v6]:port', 'host' or '[v6]' -> (host, port text or None). A bare IPv6 address has no port
    (its colons are the address's)."""
    t = text.strip()
    if t.startswith("["):
        host, sep, rest = t[1:].partition("]")
        if not sep:
            return t, None
        return host, rest.removeprefix(":") if rest.startswith(":") else (None if not rest else rest)
    if t.count(":") == 1:
        host, _, port = t.partition(":")
        return host, port
    return t, None


def name_problem(host: str) -> str | None:
    """Why `host` is neither an IP address nor a host name (None when it is one): letters, digits, '-', '_' and
    dots in labels of at most 63 characters, 253 in all, ASCII only."""
    if is_ip(host):
        return None
    if not host:
        return "an empty host"
    if len(host) > bounds.MAX_HOST_NAME:
        return f"a host name of {len(host)} characters (at most {bounds.MAX_HOST_NAME})"
    labels = host.removesuffix(".").split(".")
    ok = host.isascii() and all(0 < len(lb) <= 63 and all(c.isalnum() or c in "-_" for c in lb) for lb in labels)
    return None if ok else "not an IP address or a host name"


def port_number(text: str | None, lo: int, hi: int) -> int | None:
    """An ASCII decimal port within lo..hi (None otherwise): '³' and '٣' are digits to str.isdigit, not here."""
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 5:
        return None
    n = int(text)
    return n if lo <= n <= hi else None


def resolve(host: str, timeout_s: float = RESOLVE_S) -> list[str]:
    """Every address `host` names (A and AAAA), within timeout_s; netio's Unreachable / ReplyTimeout otherwise."""
    if is_ip(host):
        return [str(ipaddress.ip_address(host))]
    return lookup(host, timeout_s)


def _flag_endpoint(flag: str, text: str, host: str, port: int) -> Endpoint:
    """Resolve a HOST the user typed: the first address it names; BadInput naming the flag when it names none."""
    problem = name_problem(host)
    if problem:
        raise BadInput(f"{flag}: {bounds.peer_text(text, 80)!s}: {problem}")
    try:
        ips = resolve(host)
    except PeerError as exc:
        raise BadInput(f"{flag}: {host} does not resolve here ({_why(exc, host)})") from None
    return Endpoint(host, ips[0], port)


def _why(exc: Exception, host: str) -> str:
    return str(exc).removeprefix(f"{host}: ")


def parse_listen(text: str) -> Endpoint:
    """--listen [HOST[:PORT]]: '' is 127.0.0.1 on a port the OS picks (0); HOST alone, too."""
    host, port_text = split(text)
    host = host or "127.0.0.1"
    port = 0 if port_text in (None, "") else port_number(port_text, 0, 65535)
    if port is None:
        raise BadInput(f"--listen: '{bounds.peer_text(port_text, 40)}' is not a port from 0 to 65535")
    return _flag_endpoint("--listen", text, host, port)


def parse_hostport(flag: str, text: str, example: str = "10.0.0.5:7777") -> tuple[str, int]:
    """HOST:PORT of a flag, checked in form only (ASCII port 1..65535, HOST an IP address or a name)."""
    host, port_text = split(text)
    if not host or port_text is None:
        raise BadInput(f"{flag}: '{bounds.peer_text(text, 80)}' is not HOST:PORT (e.g. {example})")
    port = port_number(port_text, 1, 65535)
    if port is None:
        raise BadInput(f"{flag}: '{bounds.peer_text(port_text, 40)}' is not a port from 1 to 65535")
    problem = name_problem(host)
    if problem:
        raise BadInput(f"{flag}: '{bounds.peer_text(text, 80)}': {problem}")
    return host, port


def parse_peer(text: str) -> Endpoint:
    """--peer HOST:PORT, the name resolved here."""
    host, port = parse_hostport("--peer", text)
    return _flag_endpoint("--peer", text, host, port)


def parse_advertise(text: str) -> str:
    """--advertise HOST:PORT: what the peer is told, as given (a name is resolved by the peer, in its own view of
    the names, as vLLM's decode resolves VLLM_NIXL_SIDE_CHANNEL_HOST); it must resolve here too, and must not be a
    bind-all address, which reaches whoever dials it."""
    host, port = parse_hostport("--advertise", text)
    ep = _flag_endpoint("--advertise", text, host, port)
    if ipaddress.ip_address(ep.ip).is_unspecified:
        raise BadInput(f"--advertise: {hostport(host, port)} is a bind-all address: a peer dialling it reaches "
                       "itself (advertise an address of this node)")
    return hostport(host, port)


def parse_matrix(text: str) -> list[Endpoint]:
    """--matrix HOST:PORT[,HOST:PORT...]: every address of every HOST (a headless Service's name gives all its
    pods), once each, in the order given."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise BadInput("--matrix: expected HOST:PORT[,HOST:PORT...] (listeners, or a headless Service's name)")
    if len(items) > bounds.MAX_MATRIX_LISTENERS:
        raise BadInput(f"--matrix: {len(items)} listeners; at most {bounds.MAX_MATRIX_LISTENERS}")
    out: dict[str, Endpoint] = {}
    for item in items:
        host, port = parse_hostport("--matrix", item, "node-a:7777,node-b:7777")
        first = _flag_endpoint("--matrix", item, host, port)
        ips = [first.ip] if host == first.ip else resolve(host)
        for ip in ips:
            ep = Endpoint(host, ip, port)
            out.setdefault(ep.hostport, ep)
    if len(out) > bounds.MAX_MATRIX_LISTENERS:
        raise BadInput(f"--matrix: {len(out)} listeners; at most {bounds.MAX_MATRIX_LISTENERS}")
    if len(out) < 2:
        raise BadInput(f"--matrix {bounds.peer_text(text, 80)}: {len(out)} listener; a pair needs two (a list, or "
                       "a headless Service whose name gives every pod's address)")
    return list(out.values())


def advertised(adv: str, what: str, timeout_s: float = RESOLVE_S) -> Endpoint:
    """The address a listener advertises (HOST:PORT, its word), resolved here: PeerError (exit 3) for one that is
    not an address, does not resolve or is a bind-all address."""
    shown = bounds.peer_text(adv, 80)
    host, port_text = split(adv)
    port = port_number(port_text, 1, 65535)
    if port is None or name_problem(host):
        raise PeerError(f"{what}: advertises '{shown}', not an IP address or host name and a port")
    try:
        ips = resolve(host, timeout_s)
    except PeerError as exc:
        raise PeerError(f"{what}: advertises {shown}, a name that does not resolve here ({_why(exc, host)})") \
            from None
    ep = Endpoint(host, ips[0], port)
    if ipaddress.ip_address(ep.ip).is_unspecified:
        raise PeerError(f"{what}: advertises {ep.label}, a bind-all address: dialling it reaches this node itself "
                        "(the listener must advertise an address of its own node)")
    return ep
