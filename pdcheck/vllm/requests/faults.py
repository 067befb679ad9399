"""Request-path faults as data: `--fault NAME[:ARGS]` (repeatable) and a scenario's [faults] list, parsed and
checked here before anything runs (one line naming what and where, exit 2)."""

from __future__ import annotations

import math
import zlib

import msgspec

from pdcheck.bounds import ascii_int, ascii_number, peer_text
from pdcheck.errors import BadInput
from pdcheck.suggest import did_you_mean

BAD_KINDS = ("out-of-range", "reused-ids", "wrong-engine", "missing-request-id", "wrong-tp")
MAX_SECONDS = 600.0
MAX_FAULTS = 64  # per run, the file's and the flags' together

# name -> (takes seconds, takes a kind, usage)
_SPECS: dict[str, tuple[bool, bool, str]] = {
    "slow-decode": (True, False, "slow-decode:SECONDS[:REQ|:p=SHARE][:rank=DK] (D gets the params SECONDS late; "
                                "rank=DK: only D TP rank K)"),
    "drop-notif": (False, False, "drop-notif[:REQ|:p=SHARE][:rank=DK] (D's done notification never reaches P; "
                                 "rank=DK: only D TP rank K's, one consumer of several)"),
    "delay-notif": (True, False, "delay-notif:SECONDS[:REQ|:p=SHARE][:rank=DK]"),
    "bad-params": (False, True, f"bad-params:{'|'.join(BAD_KINDS)}[:REQ|:p=SHARE]"),
    "drop-params": (False, False, "drop-params[:REQ|:p=SHARE] (the router forwards without kv_transfer_params)"),
    "restart-p": (False, False, "restart-p:REQ[:rank=R] (P's process is replaced after it hands out REQ's params: "
                                "same engine id, new agent)"),
    "read-fail": (False, False, "read-fail[:REQ|:p=SHARE][:rank=DK] (D's READ fails: a real NIXL error)"),
    "hold": (True, False, "hold:SECONDS[:REQ|:p=SHARE][:rank=DK] (D's scheduler has the request, reads SECONDS "
                          "later; heartbeats renew the lease)"),
    "heartbeat-loss": (True, False, "heartbeat-loss:SECONDS[:REQ|:p=SHARE][:rank=DK] (as hold, but D's heartbeats "
                                    "never reach P)"),
    "abort-d": (False, False, "abort-d[:REQ|:p=SHARE][:rank=DK] (D's client aborts the request while its READ is "
                              "in flight)"),
}
# The faults one D TP rank can have alone (rank=DK): the others of the shape read and notify as usual.
D_RANK_FAULTS = ("slow-decode", "drop-notif", "delay-notif", "read-fail", "hold", "heartbeat-loss", "abort-d")
P_RANKS = 1  # P's TP size where no shape says otherwise (restart-p's rank= is bounded by the plan's P TP)
NAMES = tuple(_SPECS)
# Every fault applies in push mode too (NixlPushConnector, 0.24+; read in the 0.24.0-0.26.0 and 0.34.0 push code,
# see pdcheck.vllm.requests.push): read-fail is P's WRITE failing, hold / heartbeat-loss a request D's scheduler holds
# before its PUSH_REG, abort-d the client aborting after it, restart-p a PUSH_REG sent to the replaced P's dead
# agent. So no fault is refused by mode.


class Fault(msgspec.Struct, frozen=True):
    name: str
    seconds: float = 0.0
    kind: str = ""
    request: int | None = None  # None: every request (or the `share` of them)
    share: float = 1.0  # p=SHARE: this fraction of the requests, picked by a hash of (seed, fault, request)
    seed: int = 0
    rank: int | None = None  # restart-p: only this P TP worker's process (None: every TP worker of the engine)
    d_rank: int | None = None  # D_RANK_FAULTS: only this D TP rank (None: every one)

    def on(self, d_rank: int) -> bool:
        """Whether the fault touches D TP rank d_rank's part of a request it hits."""
        return self.d_rank is None or self.d_rank == d_rank

    def hits(self, req: int) -> bool:
        if self.request is not None:
            return self.request == req
        if self.share >= 1.0:
            return True
        # Deterministic and seeded: the same requests every run, independent of timing and of other faults.
        return zlib.crc32(f"{self.seed}:{self.name}:{req}".encode()) / 2**32 < self.share

    def text(self) -> str:
        parts = [self.name]
        if self.seconds:
            parts.append(f"{self.seconds:g}")
        if self.kind:
            parts.append(self.kind)
        if self.request is not None:
            parts.append(str(self.request))
        elif self.share < 1.0:
            parts.append(f"p={self.share:g}")
        if self.rank is not None:
            parts.append(f"rank={self.rank}")
        if self.d_rank is not None:
            parts.append(f"rank=D{self.d_rank}")
        return ":".join(parts)


def parse(text: str, requests: int, where: str = "--fault", seed: int = 0) -> Fault:
    name, _, rest = text.strip().partition(":")
    said = peer_text(text, 60)  # what the error lines echo: printable, at most 60 characters
    if name not in _SPECS:
        raise BadInput(f"{where}: unknown fault {peer_text(name, 40)!r} (known: {', '.join(NAMES)})"
                       f"{did_you_mean(name, NAMES) if len(name) <= 40 else ''}")
    takes_s, takes_kind, usage = _SPECS[name]
    args = rest.split(":") if rest else []
    seconds, kind, req, share = 0.0, "", None, 1.0
    if takes_s:
        if not args:
            raise BadInput(f"{where}: {said!r}: give the seconds: {usage}")
        got = ascii_number(args.pop(0))
        if got is None:
            raise BadInput(f"{where}: {said!r}: seconds must be a number: {usage}")
        seconds = got
        if not math.isfinite(seconds) or not 0 < seconds <= MAX_SECONDS:
            raise BadInput(f"{where}: {said!r}: seconds must be in (0, {MAX_SECONDS:g}]")
    if takes_kind:
        if not args or args[0] not in BAD_KINDS:
            raise BadInput(f"{where}: {said!r}: name the kind: {usage}")
        kind = args.pop(0)
    if name == "restart-p":
        return _restart(said, args, requests, where, usage, seed)
    if args and args[0].startswith("p="):
        got = ascii_number(args.pop(0)[2:])
        share = got if got is not None else -1.0
        if not 0 < share <= 1:
            raise BadInput(f"{where}: {said!r}: p= takes a fraction in (0, 1]")
    elif args and not args[0].startswith("rank="):
        req = _request(args.pop(0), said, requests, where, usage)
        if name == "bad-params" and kind == "reused-ids" and req == 0:
            raise BadInput(f"{where}: {said!r}: request 0 has no earlier request whose block ids it could reuse")
    d_rank = None
    if args and args[0].startswith("rank=") and name in D_RANK_FAULTS:
        raw = args.pop(0)[5:]
        d_rank = ascii_int(raw[1:]) if raw.startswith("D") else None
        if d_rank is None:
            raise BadInput(f"{where}: {said!r}: rank= takes a D TP rank, e.g. rank=D1: {usage}")
    if args:
        raise BadInput(f"{where}: {said!r}: too many arguments: {usage}")
    return Fault(name, seconds, kind, req, share, seed, d_rank=d_rank)


def _request(arg: str, said: str, requests: int, where: str, usage: str) -> int:
    req = ascii_int(arg)
    if req is None:
        raise BadInput(f"{where}: {said!r}: the request must be an integer: {usage}")
    if not 0 <= req < requests:
        raise BadInput(f"{where}: {said!r}: request {req} does not exist (requests 0..{requests - 1})")
    return req


def _restart(said: str, args: list[str], requests: int, where: str, usage: str, seed: int) -> Fault:
    """restart-p:REQ[:rank=R]: one request (a restart is a real new process, never a share of them)."""
    if not args or args[0].startswith(("p=", "rank=")):
        raise BadInput(f"{where}: {said!r}: name the request after whose params P restarts: {usage}")
    req = _request(args.pop(0), said, requests, where, usage)
    rank = None
    if args and args[0].startswith("rank="):
        rank = ascii_int(args.pop(0)[5:])  # the upper bound is the plan's P TP size (plan.py)
        if rank is None:
            raise BadInput(f"{where}: {said!r}: rank= takes a P TP rank, e.g. rank=1: {usage}")
    if args:
        raise BadInput(f"{where}: {said!r}: too many arguments: {usage}")
    return Fault("restart-p", 0.0, "", req, 1.0, seed, rank)


def parse_all(items: list[str], requests: int, where: str = "--fault", seed: int = 0) -> tuple[Fault, ...]:
    if len(items) > MAX_FAULTS:
        raise BadInput(f"{where}: {len(items)} faults; at most {MAX_FAULTS}")
    return tuple(parse(t, requests, where, seed) for t in items)


def pick(faults: tuple[Fault, ...], name: str, req: int, d_rank: int | None = None) -> Fault | None:
    """The last fault of that name that hits request req (a later --fault overrides an earlier one); with d_rank,
    only one that touches that D TP rank (without: one on any rank, the request's slowest consumer)."""
    found = None
    for f in faults:
        if f.name == name and f.hits(req) and (d_rank is None or f.on(d_rank)):
            found = f
    return found
