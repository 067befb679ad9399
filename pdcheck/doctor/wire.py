"""The doctor's side-channel protocol (`pdcheck-doctor/2`): msgspec msgpack over ZMQ REQ/REP, one frame per
message, never pickle.

A pair (`--listen` / `--peer`, docs/doctor.md "Two nodes"): three round trips like a P/D handshake.
    peer -> listener   Hello            (at the address dialled)       -> Offer (agent metadata, the address it
                                                                           advertises) or Refused
    peer -> listener   Fill | Aborted   (at the advertised address)    -> Filled | Evidence
    peer -> listener   Result | Aborted (at the advertised address)    -> Evidence
A matrix (`--matrix`): the coordinator asks each `--listen --keep-listening` listener, on the same socket,
    Who                                                                -> Here (its host name, advertised address)
    Serve (be the prefill end of a pair whose Hello carries `session`) -> Serving (its rank is ready)
    Dial  (be the decode end: dial `target` as a --peer would)         -> Leg (what that pair moved, both ends'
                                                                           evidence, or why it could not run)

Everything a peer sends is made safe where it enters (decode): every string through bounds.peer_text (no
control character reaches a terminal or a page; length-capped with a visible mark of what was cut), every list
capped (bounds.peer_list), and the numbers a peer reports of a transfer judged against their physical range
(judge_transfer: bounds.peer_number), a PeerError naming the peer, exit 3, never a PASS.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdcheck import bounds
from pdcheck.netio import PeerError

PROTOCOL = "pdcheck-doctor/2"

class End(msgspec.Struct):
    """One end's evidence from its own rank log."""

    host: str
    data: list[str]  # what carried the READ payload (the decode end; empty on the prefill end)
    notifications: list[str]
    transports: list[str]  # every transport/device in the rank's protocol tables
    ucx: str
    role: str = ""  # "prefill" (the end READ from) or "decode" (the end that READ)


class Hello(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    protocol: str
    pdcheck: str
    shape: list[int]  # layers, kv_heads, head_dim, block_tokens, tokens, requests: both ends build one plan
    expect: list[str] = []  # the peer's --expect: both ends judge the transfer against the union
    session: str = ""  # a matrix pair's token (Serve.session); "" for a --peer


class Offer(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    agent_name: str
    metadata: bytes
    addr: int
    dev: int
    advertise: str  # HOST:PORT where Fill and Result go
    ucx: str
    expect: list[str] = []  # the listener's --expect


class Fill(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


class Filled(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    ms: float


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
    """The peer could not go on: its decode rank could not READ (NIXL's own error, a finding for both ends), or
    (stage "metadata") its NIXL could not read the listener's agent metadata, or (stage "address") the address
    the listener advertises does not answer."""

    error: str
    end: End
    stage: str = "read"  # "read", "metadata" or "address"


class Who(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    protocol: str


class Here(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    protocol: str
    pdcheck: str
    host: str  # the listener's host name (a pod's name in Kubernetes)
    advertise: str  # HOST:PORT a peer is sent to


class Serve(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    session: str
    expect: list[str] = []


class Serving(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    advertise: str


class Dial(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    session: str
    target: str  # HOST:PORT: the other listener's advertised address
    expect: list[str] = []


class Leg(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """A matrix pair as its decode end saw it. error: NIXL refused the READ (a finding: FAIL); harness: the pair
    could not run (a dead or silent listener, a rank that died): that pair's FAIL, with the reason."""

    checked: int
    wrong: int
    first_wrong: str | None
    gbps: float
    p50_us: float
    local: End  # the decode end (the listener that dialled)
    remote: End  # the prefill end
    error: str | None = None
    harness: str | None = None


Wire = Hello | Offer | Fill | Filled | Result | Evidence | Refused | Aborted | Who | Here | Serve | Serving | Dial | Leg

# Fields whose text runs longer than a name: a peer's errors and reasons, the first wrong block's description.
_LONG = frozenset({"error", "reason", "first_wrong", "harness"})


def encode(msg: Any) -> bytes:
    return msgspec.msgpack.encode(msg)


def decode(data: bytes, what: str) -> Any:
    """One message, made safe (safe()); PeerError naming `what` for anything that is not the protocol."""
    try:
        msg = msgspec.msgpack.decode(data, type=Wire)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerError(f"{what}: not a {PROTOCOL} message ({bounds.peer_text(str(exc), 120)})") from None
    return safe(msg)


def safe(value: Any, field: str = "") -> Any:
    """`value` with every string a peer wrote made printable and capped (bounds.peer_text), every list capped
    (bounds.peer_list; a list of numbers loses its tail), recursively through Structs. Bytes (agent metadata,
    bounded by the frame cap) and numbers pass as they are: numbers are judged where they are used."""
    if isinstance(value, str):
        return bounds.peer_text(value, bounds.MAX_PEER_TEXT if field in _LONG else bounds.MAX_PEER_STR)
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return bounds.peer_list(value)
        return [safe(v) for v in value[:bounds.MAX_PEER_ITEMS]]
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.replace(value, **{f: safe(getattr(value, f), f) for f in value.__struct_fields__})
    return value


def judge_transfer(who: str, checked: Any, wrong: Any, gbps: Any, p50_us: Any, sent: int) -> None:
    """The numbers a peer reports of a transfer, each within its physical range: blocks checked 0..what was sent,
    wrong 0..checked, GB/s and the median latency finite and not negative. PeerError naming `who` otherwise."""
    n = bounds.peer_number(f"{who} reports blocks checked", checked, 0, sent)
    bounds.peer_number(f"{who} reports wrong blocks", wrong, 0, n)
    if not isinstance(checked, int) or not isinstance(wrong, int):
        raise PeerError(f"{who} reports a block count that is not a whole number")
    bounds.peer_number(f"{who} reports a bandwidth", gbps, 0, bounds.MAX_PEER_GBPS, " GB/s")
    bounds.peer_number(f"{who} reports a median latency", p50_us, 0, bounds.MAX_PEER_LATENCY_US, " µs")
