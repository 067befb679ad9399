"""`pdcheck doctor --matrix HOST:PORT[,...]`: every pair of `doctor --listen --keep-listening` listeners tests
each other, without Ray (a DaemonSet's pods: examples/kubernetes/doctor-matrix.yaml), printed as `--ray` prints
its matrix (pdcheck.doctor.cluster: one ClusterResult, one table, one --json shape).

The coordinator speaks the listeners' own protocol (pdcheck.doctor.wire): Who to each listener (its host name
and the address it advertises); then for each pair (A, B), A before B in the order given: Serve to A (its
prefill rank is ready, its Hello must carry the session's token), Dial to B (B runs the --peer side against A's
advertised address and answers with the Leg: what moved, both ends' evidence). Each request has a deadline;
a listener is in at most one pair at a time, --pairs pairs run at once. A pair that cannot move KV is that
pair's FAIL, never the whole run's; a listener that reports a transfer outside its physical range is a harness
error (exit 3) naming it.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

import msgspec
import zmq

from pdcheck.doctor import cluster
from pdcheck.doctor.addr import Endpoint
from pdcheck.doctor.cluster import ClusterResult, Node, PairRow
from pdcheck.doctor.model import Check
from pdcheck.doctor.pair import RANK_SETUP_S, _endpoint, _expect, blocks_sent, transfer_verdict
from pdcheck.doctor.wire import PROTOCOL, Dial, Here, Leg, Serve, Serving, Who, encode, judge_transfer
from pdcheck.netio import PeerError, request_reply

SELECTION = "every pair of listeners"


class _Listener(msgspec.Struct):
    at: Endpoint
    host: str = ""  # its host name (Here)
    advertise: str = ""
    down: str | None = None  # why it could not be asked (no Here)

    @property
    def label(self) -> str:
        return f"{self.host} {self.at.hostport}" if self.host else self.at.label


def _ask(at: Endpoint, msg: Any, kind: type, timeout: float, what: str) -> Any:
    where = f"the listener at {at.label} ({what})"
    try:
        frames = request_reply(zmq.Context.instance(), _endpoint(at.ip, at.port), at.ip, encode(msg), timeout)
    except PeerError as exc:
        raise type(exc)(f"{where}: {exc} (is `pdcheck doctor --listen ... --keep-listening` running there?)") \
            from None
    return _expect(frames, kind, where)


def run(listeners: list[Endpoint], spec: str, pairs_at_once: int, timeout: float,
        expect: list[str]) -> tuple[ClusterResult, list[Check]]:
    found = [_Listener(ep) for ep in listeners]
    threads = [threading.Thread(target=_who, args=(x, timeout), daemon=True) for x in found]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    todo = [(a, b) for i, a in enumerate(found) for b in found[i + 1:]]
    width = max(1, min(pairs_at_once, len(todo), len(found) // 2))  # disjoint pairs: at most half the listeners
    rows: list[PairRow] = []
    lies: list[str] = []
    sent = blocks_sent(_plan(timeout))
    _schedule(todo, width, lambda a, b: _one(a, b, timeout, expect, sent, rows, lies))
    if lies:
        raise PeerError(lies[0])
    med = cluster.order(rows)
    checks = [cluster.as_check(r, f"run plain `pdcheck doctor` on {r.prefill.split()[0]} and on "
                                  f"{r.decode.split()[0]} for their NICs and UCX environment") for r in rows]
    nodes = [Node(x.host or "?", x.at.label, []) for x in found]
    return ClusterResult(spec, SELECTION, nodes, width, round(med, 4), rows), checks


def _who(x: _Listener, timeout: float) -> None:
    try:
        here: Here = _ask(x.at, Who(PROTOCOL), Here, timeout, "Who")
    except PeerError as exc:
        x.down = str(exc)
        return
    x.host, x.advertise = here.host, here.advertise


def _schedule(todo: list[tuple[_Listener, _Listener]], width: int, one: Any) -> None:
    """Run one(a, b) for every pair, at most `width` at once and each listener in one pair at a time (its REP
    socket serves one session); a pair waits for its two listeners, not for the slowest pair of a round."""
    cond = threading.Condition()
    busy: set[int] = set()
    pending = list(todo)
    running = [0]

    def body(a: _Listener, b: _Listener) -> None:
        try:
            one(a, b)
        finally:
            with cond:
                busy.difference_update({id(a), id(b)})
                running[0] -= 1
                cond.notify_all()

    with cond:
        while pending or running[0]:
            pick = next((p for p in pending if id(p[0]) not in busy and id(p[1]) not in busy), None)
            if pick is None or running[0] >= width:
                cond.wait()
                continue
            pending.remove(pick)
            busy.update({id(pick[0]), id(pick[1])})
            running[0] += 1
            threading.Thread(target=body, args=pick, name="pdcheck-doctor-matrix", daemon=True).start()


def _one(a: _Listener, b: _Listener, timeout: float, expect: list[str], sent: int, rows: list[PairRow],
         lies: list[str]) -> None:
    """One pair, A the prefill end, B the decode end; its row (a FAIL with the reason when it cannot run)."""
    t0 = time.monotonic()

    def fail(why: str, data: list[str] | None = None, notif: list[str] | None = None) -> None:
        rows.append(PairRow(a.label, b.label, "FAIL", 0.0, 0, 0, data or [], notif or [], f"no KV moved: {why}",
                            round(time.monotonic() - t0, 3)))

    down = a.down or b.down
    if down:
        return fail(down)
    session = secrets.token_hex(8)
    try:
        # A's prefill rank is started between its sessions: RANK_SETUP_S covers one that is still starting.
        serving: Serving = _ask(a.at, Serve(session, expect), Serving, RANK_SETUP_S + timeout, "Serve")
        leg: Leg = _ask(b.at, Dial(session, serving.advertise, expect), Leg, RANK_SETUP_S + 5 * timeout, "Dial")
    except PeerError as exc:
        return fail(str(exc))
    if leg.harness:
        return fail(f"{b.label} could not run the pair: {leg.harness}", leg.local.data, leg.local.notifications)
    if leg.error:
        return fail(f"{b.label} could not READ from {a.label}: {leg.error}", leg.local.data, leg.local.notifications)
    try:
        judge_transfer(f"--matrix: the listener {b.label}", leg.checked, leg.wrong, leg.gbps, leg.p50_us, sent)
    except PeerError as exc:
        lies.append(str(exc))
        return fail(str(exc))
    gbps = round(leg.gbps, 4)
    status, detail, _ = transfer_verdict(leg.checked, leg.wrong, leg.first_wrong, gbps, leg.local.data, rdma=False,
                                         expect=expect, env={}, own_lanes=False, prefill_lanes=leg.remote.transports)
    if status == "PASS":
        detail = detail.replace(" (UCX protocol table of the decode end)", "") + \
            f"; notifications over {', '.join(leg.local.notifications) or '-'}"
    rows.append(PairRow(a.label, b.label, status, gbps, leg.checked, leg.wrong, leg.local.data,  # type: ignore[arg-type]
                        leg.local.notifications, detail, round(time.monotonic() - t0, 3)))


def _plan(timeout: float) -> Any:
    from pdcheck.bench.plan import make_plan
    from pdcheck.doctor import loopback

    return make_plan(loopback.config("cpu", timeout))
