"""The request path's rules in one place, pure: what D does with the params a router hands it (decide), what a
failed READ becomes (on_failure), and a simulator of P's block accounting that gives each request's expected
verdict for a release line and a fault list (simulate). The real run (pdcheck.vllm.requests.run) uses decide and
on_failure in its D rank and compares its outcomes with simulate's.

Verdicts: delivered (every block verified), wrong (another request's KV arrived: named), freed-early (P freed the
blocks before D read them; the bytes were not yet overwritten), hang (named timeout), error (the release's
exception or failure log), recomputed (failure policy, refused or missing params), aborted (D's client went away
mid-transfer: no answer to judge; what matters is whether D freed its blocks under the READ).

Over the ~500 lines a module keeps to, on purpose: the one home of the request path's rules, which the real
run and the expected verdicts both call; split, a rule and the simulator step that applies it would drift.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from pdcheck.vllm.releases import params as kvparams
from pdcheck.vllm.releases.rules import msg_engine_id
from pdcheck.vllm.requests.faults import P_RANKS, Fault, pick
from pdcheck.vllm.requests.lines import CORRECTED, Lifecycle, abort_waits_read

VERDICTS = ("delivered", "wrong", "freed-early", "hang", "error", "recomputed", "aborted")
GEN_WRAP = 255  # generation word: 1..255 (0: never allocated, the handshake's pattern)


class Outcome(msgspec.Struct):
    request: int
    verdict: str
    detail: str = ""
    found_request: int | None = None  # wrong: whose KV arrived
    rank: str = ""  # on a TP/DP shape: the D rank this verdict is of ("D1", "DP1/D0"); "" with one D rank
    heartbeats: int = 0  # the real run: heartbeats from this D rank that named the request (0.22+)
    handshakes: int = 0  # ... handshakes this D rank made for it (its own READ's, or its heartbeats')


class Accounting(msgspec.Struct):
    """P's blocks at the end of a run."""

    allocated: int = 0  # block allocations
    freed: int = 0  # requests freed on D's notification
    expired: int = 0  # requests freed at the abort timeout / lease
    reused: int = 0  # allocations of a block an earlier request held
    leaked: int = 0  # requests still holding blocks that nothing will free (no expiry)
    held: int = 0  # requests still holding blocks with an expiry still to come
    late_notifs: int = 0  # notifications for requests P had already freed
    heartbeats: int = 0  # lease renewals P received (0.22+, corrected)
    restarts: int = 0  # restart-p: P processes replaced
    lost: int = 0  # requests whose blocks died with a replaced P (neither freed nor expired)
    d_freed_in_flight: int = 0  # abort-d: requests whose D blocks were freed under their in-flight READ
    engine_died: int = 0  # P's engine core died on a late notification (lines.Lifecycle.late_notif "raises")


class PRankAccount(msgspec.Struct):
    """One P rank's own count on a TP/DP shape (the scheduler's, request by request, is Accounting)."""

    rank: str  # "P1", "DP1/P0"
    holding: int  # requests this worker still had at the end (not yet done)
    late_notifs: int
    heartbeats: int


def params_for(line: Lifecycle, req: int, blocks: list[int], engine_id: str, port: int, tp_size: int,
               expiry_at: float | None, gens: list[int], request_id: str = "", generation: int = 1, *,
               block_size: int = 16) -> dict[str, Any]:
    """The kv_transfer_params P returns from request_finished, with the release's keys and value shapes
    (releases.params): port is P's side-channel port; remote_num_tokens the tokens its blocks hold."""
    every: dict[str, Any] = {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": kvparams.block_ids_value(line.first, [blocks]),
        "remote_engine_id": engine_id, "remote_host": "127.0.0.1", "remote_port": port, "tp_size": tp_size,
        "remote_request_id": request_id or f"req-{req}",
        "remote_num_tokens": kvparams.num_tokens(len(blocks), block_size),
        # vLLM's P returns None here (it stamps an expiry only on D's turn-2 blocks); the corrected path sends it
        "remote_blocks_expiry_time": expiry_at if line.line == CORRECTED.line else None, "transfer_mode": "pull",
        "dcp_size": 1, "pp_size": 1, "remote_registration_generation": generation,
        "block_generations": list(gens),
    }
    return {k: every[k] for k in line.keys}


def apply_bad(params: dict[str, Any], kind: str, p_blocks: int, earlier: list[int] | None) -> dict[str, Any]:
    """A router (or a hand-made request) that corrupts one field (bad-params:KIND)."""
    out = dict(params)
    ids = params["remote_block_ids"]
    n = sum(len(g) for g in kvparams.block_id_groups(ids))
    if kind == "out-of-range":
        out["remote_block_ids"] = kvparams.reshaped(ids, [p_blocks + 7 + i for i in range(n)])
    elif kind == "reused-ids" and earlier:
        out["remote_block_ids"] = kvparams.reshaped(ids, list(earlier))
    elif kind == "wrong-engine":
        out["remote_engine_id"] = f"{params['remote_engine_id']}-other"
    elif kind == "missing-request-id":
        out.pop("remote_request_id", None)
    elif kind == "wrong-tp":
        # P runs TP P_RANKS; a router (or a hand-made request) says twice that. Lines before 0.9.2 hand out no
        # tp_size, but a router can still add one (they never read it from the params).
        out["tp_size"] = 2 * max(P_RANKS, int(params.get("tp_size") or 1))
    return out


def read_ids(params: dict[str, Any], block_size: int = 16) -> list[int]:
    """The P block ids D reads for a request: remote_block_ids in either shape (one KV-cache group here), the
    last ones that hold the tokens it loads where P sends remote_num_tokens (vLLM reads the remote blocks
    that match its local ones, counted from the end)."""
    groups = kvparams.block_id_groups(params["remote_block_ids"])
    if len(groups) != 1:
        raise ValueError(f"remote_block_ids holds {len(groups)} KV-cache groups; this model has one")
    ids = groups[0]
    if "remote_num_tokens" in params:
        want = -(-kvparams.tokens_to_load(params, len(ids) * block_size) // block_size)
        ids = ids[len(ids) - want:] if want else []
    return ids


def tp_refusal(params: dict[str, Any], p_tp: int) -> str | None:
    """The corrected path's tp_size check (H12's fix: require tp_size and cross-check it against the TP D recorded
    at its handshake with that engine). vLLM, with the engine already known, never looks: see lines.py."""
    tp = params.get("tp_size")
    if tp == p_tp:
        return None
    said = "lack tp_size" if tp is None else f"say tp_size {tp!r}"
    return f"kv_transfer_params {said}, but engine {params.get('remote_engine_id')}'s handshake recorded TP " \
           f"{p_tp}: refused, recomputed"


def on_failure(line: Lifecycle, req: int, failure_type: str, error: str, log: str = "") -> tuple[str, str]:
    """A failed handshake or READ under the release's policy: (verdict, detail). log: what the release logs
    for it (pdcheck.vllm.requests.texts), shown in place of the bare failure type."""
    said = log or f"{failure_type}: {error}"
    if line.on_failure == "recompute":
        return "recomputed", f"{said} -> kv_load_failure_policy recompute"
    if line.on_failure == "fail":
        said = log or f"NIXL transfer failure: {failure_type} | {error}"
        return "error", f"{said} (kv_load_failure_policy fail: request aborted)"
    return "error", f"{error} (engine crash: {line.failure_log})"


def decide(line: Lifecycle, req: int, params: dict[str, Any] | None, p_engine: str, p_blocks: int,
           now: float, p_tp: int = P_RANKS, log: Callable[[str], str] | None = None) -> tuple[str, str] | None:
    """What D does with the params before any READ: None (read), or (verdict, detail). p_tp: P's TP as D's
    handshake with the engine recorded it (the request path's P runs P_RANKS ranks); log: the release's log line
    for a failed handshake (the real D's; the model needs only the verdict)."""
    if params is None:
        return "recomputed", "no kv_transfer_params: D prefills the prompt itself"
    if "remote_request_id" in line.keys and "remote_request_id" not in params:
        if line.missing_request_id == "hang":
            return "hang", ("Got invalid KVTransferParams: ... This request will not utilize KVTransfer (no "
                            "remote_request_id): no receive scheduled after the async load was asked for; the "
                            "request waits in WAITING_FOR_REMOTE_KVS")
        return "recomputed", "kv_transfer_params lack remote_request_id: refused, prefill recomputed"
    if params.get("remote_engine_id") != p_engine and line.engine_id_checked:
        error = "RuntimeError: " + msg_engine_id(str(params.get("remote_engine_id")), p_engine)
        return on_failure(line, req, "handshake_failed", error, log(error) if log else "")
    if line is CORRECTED:
        expiry = params.get("remote_blocks_expiry_time")
        if expiry is not None and now >= expiry:
            return "recomputed", "lease passed before D got the params: blocks not read, prefill recomputed"
        bad = [b for b in read_ids(params) if not 0 <= b < p_blocks]
        if bad:
            return "recomputed", f"remote block id {bad[0]} out of range (P has {p_blocks} blocks): refused, " \
                                 "recomputed"
        wrong_tp = tp_refusal(params, p_tp)
        if wrong_tp is not None:
            return "recomputed", wrong_tp
    return None


SETTLE_S = 0.5

# What NIXL answers, measured on real agents: a READ to an agent whose process is gone, and a READ over memory
# the peer never registered (read-fail).
DISCONNECT = "postXferReq: remote agent was disconnected -> NIXL_ERR_REMOTE_DISCONNECT"
NOT_REGISTERED = "prepXferDlist: remote memory not registered -> NIXL_ERR_NOT_FOUND"


def restart_detail(line: Lifecycle, own: int, now: int) -> tuple[str, str] | None:
    """D reads after P was replaced (own: the incarnation that handed out the params, now: the one running; D's
    loaded agent is the dead one). None: read (the corrected path re-handshook first and the params are
    current)."""
    if line is CORRECTED:
        if own < now:
            return "recomputed", f"P restarted after handing out these params (registration generation {own + 1} < " \
                                 f"{now + 1}): its blocks died with it; D re-handshook and recomputes"
        return None
    return on_failure(line, 0, "transfer_setup_failed", f"{DISCONNECT} (D still reads from the dead agent: "
                                                        "the same engine id never re-handshakes)")


def abort_detail(line: Lifecycle) -> str:
    if abort_waits_read(line):
        return "client aborted mid-transfer: D kept its blocks until the READ finished (delay_free_blocks)"
    return "client aborted mid-transfer: D freed its blocks under the in-flight READ (finish_requests frees at " \
           "once); its bytes may land in the next request's blocks"


def held_for(faults: tuple[Fault, ...], req: int, d_rank: int | None = None) -> tuple[float, bool]:
    """hold / heartbeat-loss: (seconds D holds the request before its READ, whether its heartbeats are lost); with
    d_rank, that D TP rank's own (pick)."""
    lost, hold = pick(faults, "heartbeat-loss", req, d_rank), pick(faults, "hold", req, d_rank)
    if lost is not None:
        return lost.seconds, True
    return (hold.seconds if hold else 0.0), False


def heartbeat_window(faults: tuple[Fault, ...], req: int, shape: Any = None) -> tuple[float, bool]:
    """How long D's scheduler heartbeats request req after taking it, and whether P misses them (pdcheck.vllm.requests.
    heartbeat): every D rank sends them until the last one read it (the longest hold), and a P rank misses them only
    when every D rank that reads it lost its heartbeats (heartbeat-loss on all of them; with D TP > P TP another D
    rank's still reach it)."""
    if shape is None or shape.d_tp == 1:
        return held_for(faults, req)
    from pdcheck.vllm.requests.shapes import sources

    per = [held_for(faults, req, k) for k in range(shape.d_tp)]
    lost = any(all(per[k][1] for k in range(shape.d_tp) if p in sources(shape, k)) for p in range(shape.p_tp))
    return max(h for h, _ in per), lost


def hang_detail(line: Lifecycle, pool: int, engine_died: bool = False) -> str:
    """Why a request never got blocks, and until when it would wait."""
    if engine_died:
        return ("P's engine core died on a late done notification (KeyError, P's log below): nothing admits the "
                "request")
    until = ("forever: nothing frees unread blocks before 0.10 (no VLLM_NIXL_ABORT_REQUEST_TIMEOUT)"
             if line.expiry == "none" else f"until {line.expiry_knob} frees them")
    return f"P's {pool} KV blocks stayed held by earlier requests: the request waits for free blocks {until}"


def line_settle(line: Lifecycle, settle: float, expiry: float | None, time_scale: float = 1.0) -> float:
    """How long a line runs past D's last answer: `settle`; but where D's heartbeats renew a lease by about that
    long (within one heartbeat interval), one interval past the renewal D sends with its last READ (a heartbeat
    goes after the step's READs, before the scheduler hears the request finished): that lease then expires inside
    the run, never on its last instant, where P's count would race the end (docs/requests.md, "Heartbeats and
    handshakes"). A renewal far longer than settle stays held, far shorter expires, either way by a margin."""
    if not line.heartbeat or expiry is None:
        return settle
    ext, interval = line.lease_extension(expiry, time_scale), expiry / 6
    return ext + interval if abs(ext - settle) < interval else settle


def run_end(requests: int, rate: float, faults: tuple[Fault, ...], settle: float = SETTLE_S) -> float:
    """When a run stops: the last request's params reach D and its notification reaches P, plus settle."""
    last = 0.0
    for i in range(requests):
        slow, delay = pick(faults, "slow-decode", i), pick(faults, "delay-notif", i)
        last = max(last, i / rate + (slow.seconds if slow else 0.0) + (delay.seconds if delay else 0.0)
                   + held_for(faults, i)[0])
    return last + settle


class _Req:
    __slots__ = ("blocks", "deadline", "gens", "holding", "inc", "params", "winc")

    def __init__(self, blocks: list[int], gens: list[int], deadline: float, inc: int = 0, winc: int = 0) -> None:
        self.blocks, self.gens, self.deadline, self.inc, self.winc = blocks, gens, deadline, inc, winc
        self.holding = True
        self.params: dict[str, Any] = {}


def simulate(line: Lifecycle, requests: int, rate: float, blocks_per_request: int, pool: int,
             lease: float | None, faults: tuple[Fault, ...], engine_id: str = "P",
             settle: float = SETTLE_S, group: tuple[int, int] = (0, 1), shape: Any = None,
             ranks: dict[tuple[int, int], Outcome] | None = None,
             time_scale: float = 1.0) -> tuple[list[Outcome], Accounting]:
    """Each request's expected verdict and P's accounting. group (g, dp_size): only the requests the router
    sends to P DP rank g (i % dp_size == g: each DP rank an engine with its own pool), at their own times.
    shape (pdcheck.vllm.requests.shapes.Shape) with `ranks`: where a fault touches one D TP rank (rank=DK) or one P TP
    worker restarts (restart-p:REQ:rank=R), each D TP rank's own verdict goes into ranks[(request, D TP rank)]
    (its own faults, at its own times; it reads worker R or not), while P's blocks follow the request: freed once
    every consumer notified (the slowest or failing one decides) or at the expiry.
    P frees on notification or at the expiry (lease
    overrides the release's default; a release without one never frees unread blocks); freed blocks go to the
    tail of P's free list and later requests take them from its head (vLLM's free block queue). The run ends
    `settle` seconds after the last request's notification: expiries still to come count as held. time_scale: the
    run's slow motion (Options.scaled: the lengths given are already stretched; only the lease extension's whole
    seconds need it)."""
    expiry = line.lease(lease)
    free = list(range(pool))
    owner: dict[int, int] = {}
    gen = [0] * pool
    last_gen_owner: dict[tuple[int, int], int] = {}
    acc = Accounting()
    reqs: dict[int, _Req] = {}
    out: dict[int, Outcome] = {}
    heap: list[tuple[float, int, str, int]] = []
    waiting: list[int] = []
    seq = 0
    inc = 0  # restart-p: P's incarnation
    d_inc: dict[int, int] = {}  # view (-1: the request; k: D TP rank k) -> the incarnation whose agent D loaded
    last_answer = 0.0
    ever: set[int] = set()
    from pdcheck.vllm.requests.shapes import sources

    p_tp = shape.p_tp if shape is not None else 1
    d_tp = shape.d_tp if shape is not None else 1
    # restart-p:REQ:rank=R on P TP > 1: one worker's process (w_inc times, R = w_rank, last at w_t)
    w_inc, w_rank, w_t = 0, -1, math.inf
    w_seen: set[int] = set()  # corrected: the D TP ranks that re-handshook after it
    apart = ranks is not None and shape is not None and (
        any(f.d_rank is not None for f in faults)
        or (p_tp > 1 and any(f.name == "restart-p" and f.rank is not None for f in faults)))

    def push(t: float, kind: str, i: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, i))
        seq += 1

    def release(i: int, t: float) -> None:
        r = reqs[i]
        r.holding = False
        for b in r.blocks:
            owner.pop(b, None)
            free.append(b)
        admit(t)

    def admit(t: float) -> None:
        """Waiting requests take free blocks in arrival order (vLLM's scheduler waits for free blocks); a dead
        P's scheduler takes none (they hang)."""
        while waiting and len(free) >= blocks_per_request and running(t) and not acc.engine_died:
            i = waiting.pop(0)
            blocks = [free.pop(0) for _ in range(blocks_per_request)]
            for b in blocks:
                if b in ever:
                    acc.reused += 1
                ever.add(b)
                gen[b] = gen[b] % GEN_WRAP + 1
                owner[b] = i
                last_gen_owner[(b, gen[b])] = i
            acc.allocated += len(blocks)
            deadline = t + expiry if expiry is not None else math.inf
            reqs[i] = _Req(blocks, [gen[b] for b in blocks], deadline, inc, w_inc)
            if deadline < math.inf:
                push(deadline, "expire", i)
            slow = pick(faults, "slow-decode", i)
            push(t + (slow.seconds if slow else 0.0), "recv", i)
            if apart:  # each D TP rank gets the params when its own slow-decode says
                for k in range(d_tp):
                    mine = pick(faults, "slow-decode", i, k)
                    push(t + (mine.seconds if mine else 0.0), f"recv@{k}", i)
            hit = pick(faults, "restart-p", i)
            if hit is not None and hit.rank is not None and p_tp > 1:
                restart_worker(hit.rank, t)
            elif hit is not None:
                restart()

    def restart() -> None:
        """P's process is replaced: its blocks (and every request holding them) die with it; the new P starts
        with every block free and every generation 0."""
        nonlocal inc
        inc += 1
        acc.restarts += 1
        lose_held(reqs.values(), acc)
        free[:] = range(pool)
        owner.clear()
        gen[:] = [0] * pool

    def restart_worker(rank: int, t: float) -> None:
        """One P TP worker's process is replaced: the scheduler and the other workers keep every block; what
        the dead worker held is done on it. The D ranks that read it READ its dead agent from now on (a release
        never re-handshakes with a known engine; the corrected D does at the first failed READ)."""
        nonlocal w_inc, w_rank, w_t
        w_inc, w_rank, w_t = w_inc + 1, rank, t
        acc.restarts += 1

    def read(i: int, t: float, view: int = -1) -> None:
        """D's READ of request i at t, and what it finds. view -1: the request (P's accounting: its notification;
        its verdict where the D ranks do not differ); k: D TP rank k's own verdict (ranks[(i, k)]) only."""
        nonlocal last_answer
        last_answer = t  # every READ ends in an outcome D answers with
        r, params = reqs[i], reqs[i].params
        rank = None if view < 0 else view

        def answer(o: Outcome) -> None:
            if view < 0:
                out[i] = o
            elif ranks is not None:
                ranks[(i, view)] = o

        if inc > d_inc.get(view, 0) or r.inc < inc:
            refused = restart_detail(line, r.inc, inc)
            if line is CORRECTED:
                d_inc[view] = inc
            if refused is not None:
                answer(Outcome(i, *refused))
                return
        if view >= 0 and w_inc and t >= w_t and w_rank in sources(shape, view) and \
                (line is not CORRECTED or view not in w_seen):
            # this D rank reads the replaced worker's dead agent (the corrected D once, then re-handshakes)
            w_seen.add(view)
            answer(Outcome(i, *on_failure(line, i, "transfer_setup_failed", DISCONNECT)) if line is not CORRECTED
                   else Outcome(i, "recomputed", f"{DISCONNECT}: P TP worker {w_rank} restarted; D re-handshook "
                                                 "and recomputes"))
            return
        hold_s, lost = held_for(faults, i, rank)
        if line is CORRECTED and lost:
            exp = params.get("remote_blocks_expiry_time")
            if exp is not None and t >= exp:
                answer(Outcome(i, "recomputed", "lease passed while D held the request (its heartbeats never "
                                                "renewed it): blocks not read, recomputed"))
                return
        if pick(faults, "read-fail", i, rank):
            answer(Outcome(i, *on_failure(line, i, "transfer_setup_failed", NOT_REGISTERED)))
            return
        ids = read_ids(params)
        if any(not 0 <= b < pool for b in ids):
            answer(Outcome(i, *on_failure(line, i, "transfer_setup_failed", "makeXferReq: remote index out "
                                          "of range -> NIXL_ERR_INVALID_PARAM")))
            return
        if view >= 0:
            answer(found(i, t, r, ids) if not pick(faults, "abort-d", i, rank) else
                   Outcome(i, "aborted", abort_detail(line)))
            return
        if w_inc and line is not CORRECTED and r.winc == w_inc:
            # admitted after one worker's restart: the D ranks that read it fail, and its replacement never hears
            # of the request, so P's scheduler frees it only at that worker's expiry
            out[i] = found(i, t, r, ids)
            return
        if pick(faults, "abort-d", i):
            out[i] = Outcome(i, "aborted", abort_detail(line))
            acc.d_freed_in_flight += not abort_waits_read(line)
        else:
            out[i] = found(i, t, r, ids)
        if not pick(faults, "drop-notif", i):
            delay = pick(faults, "delay-notif", i)
            push(t + (delay.seconds if delay else 0.0), "notif", i)

    def found(i: int, t: float, r: _Req, ids: list[int]) -> Outcome:
        """What a READ of request i's blocks at t finds."""
        # Whose KV each block read holds: the request that wrote the block's current generation.
        bad = [(b, gen[b], last_gen_owner.get((b, gen[b])))
               for b, mine in zip(ids, r.blocks, strict=True) if b != mine or owner.get(b) not in (i, None)
               or last_gen_owner.get((b, gen[b])) != i]
        if bad:
            b, g, j = bad[0]
            whose = f"request {j}'s KV (generation {g})" if j is not None else "untagged bytes"
            if line is CORRECTED:
                return Outcome(i, "recomputed", f"generation check: block {b} holds {whose}: refused, recomputed")
            return Outcome(i, "wrong", f"block {b} holds {whose}", j)
        if not r.holding:
            return Outcome(i, "freed-early", f"P freed the blocks at {r.deadline:.2f} s ({line.expiry}), D read at "
                                             f"{t:.2f} s")
        return Outcome(i, "delivered")

    def recv_rank(i: int, t: float, k: int) -> None:
        """D TP rank k gets request i's params at t: decides, then READs now or after its own hold."""
        nonlocal last_answer
        params = recv_params(i, t)
        refused = decide(line, i, params, engine_id, pool, t)
        if refused is not None:
            if ranks is not None:
                ranks[(i, k)] = Outcome(i, *refused)
            last_answer = t
            return
        assert params is not None
        reqs[i].params = params  # the same params every D rank gets (the request's recv may come later)
        hold_s, _lost = held_for(faults, i, k)
        if hold_s > 0:
            push(t + hold_s, f"read@{k}", i)
        else:
            read(i, t, k)

    def recv_params(i: int, t: float) -> dict[str, Any] | None:
        r = reqs[i]
        params: dict[str, Any] | None = params_for(line, i, r.blocks, engine_id, 5600, 1,
                                                    r.deadline if r.deadline < math.inf else None, r.gens)
        bad = pick(faults, "bad-params", i)
        if bad is not None and params is not None:
            # the previous request of this P DP rank (reqs holds this group's only)
            earlier = reqs[i - group[1]].blocks if i - group[1] in reqs else None
            params = apply_bad(params, bad.kind, pool, earlier)
        if pick(faults, "drop-params", i):
            params = None
        return params

    for i in range(group[0], requests, group[1]):
        push(i / rate, "arrive", i)
    horizon = run_end(requests, rate, faults, settle)

    def running(t: float) -> bool:
        """The real router runs until its schedule's end and `settle` past D's last answer, and never stops
        while a request P handed out is still unanswered (a hold or a queue can push answers past the end)."""
        return t <= max(horizon, last_answer + settle) or len(out) < len(reqs)  # out: answered requests of reqs

    while heap:
        t, _s, kind, i = heapq.heappop(heap)
        if kind == "arrive":
            waiting.append(i)
            admit(t)
        elif kind.startswith("recv@"):
            recv_rank(i, t, int(kind[5:]))
        elif kind.startswith("read@"):
            read(i, t, int(kind[5:]))
        elif kind == "recv":
            r = reqs[i]
            params = recv_params(i, t)
            refused = decide(line, i, params, engine_id, pool, t)
            if refused is not None:
                out[i] = Outcome(i, *refused)
                last_answer = t
                continue
            assert params is not None
            r.params = params
            hold_s, _lost = held_for(faults, i)
            beat_s, lost = heartbeat_window(faults, i, shape)
            if line.heartbeat and expiry is not None and not lost:
                # D's scheduler tracks it from here: heartbeats until every D rank read it
                renew(line, expiry, t, beat_s, r, acc, lambda when, i=i: push(when, "expire", i), time_scale)
            if hold_s > 0:
                push(t + hold_s, "read", i)
            else:
                read(i, t)
        elif kind == "read":
            read(i, t)
        elif kind == "notif":
            if acc.engine_died:
                continue  # nothing reads notifications any more
            if reqs[i].holding:
                release(i, t)
                acc.freed += 1
            else:
                acc.late_notifs += 1
                # 0.10.0: _get_new_notifs raises KeyError: P's engine core dies, holding what it held
                acc.engine_died = int(line.late_notif == "raises")
        elif kind == "expire":
            r = reqs[i]
            if not running(t) or acc.engine_died:
                continue  # the run ended first: P still holds them
            if r.holding and t >= r.deadline:
                release(i, t)
                acc.expired += 1
    for i in waiting:
        out[i] = Outcome(i, "hang", hang_detail(line, pool, bool(acc.engine_died)))
    count_still_held(reqs.values(), acc)
    return [out[i] for i in range(group[0], requests, group[1])], acc


def renew(line: Lifecycle, expiry: float, t: float, hold_s: float, r: Any, acc: Accounting,
          expire_at: Callable[[float], None], time_scale: float = 1.0) -> None:
    """D's scheduler heartbeats request r from when it takes it (t) every lease/6 until its READ (pull) or its
    PUSH_REG (push), hold_s later: P counts them and its lease runs to at least the last one's time + the
    release's extension (expire_at: the expiry event, moved there)."""
    beats = int(hold_s // (expiry / 6))
    acc.heartbeats += 1 + beats
    renewed = t + beats * (expiry / 6) + line.lease_extension(expiry, time_scale)
    if r.holding and renewed > r.deadline:
        r.deadline = renewed
        expire_at(renewed)


def lose_held(reqs: Iterable[Any], acc: Accounting) -> None:
    """restart-p: the blocks every request held die with P's old process (lost; nothing frees them now)."""
    for r in reqs:
        if r.holding:
            r.holding, r.deadline = False, math.inf
            acc.lost += 1


def count_still_held(reqs: Iterable[Any], acc: Accounting) -> None:
    """At the run's end: blocks P still holds wait for their expiry (held), or for ever (leaked)."""
    for r in reqs:
        if r.holding:
            if r.deadline < math.inf:
                acc.held += 1
            else:
                acc.leaked += 1


def simulate_shape(line: Lifecycle, requests: int, rate: float, blocks_per_request: int, pool: int,
                   lease: float | None, faults: tuple[Fault, ...], shape: Any, engine_id: str = "P",
                   settle: float = SETTLE_S, time_scale: float = 1.0) -> tuple[list[Outcome], Accounting]:
    """simulate on a TP/DP shape: each P DP rank's requests on its own pool, then a verdict per (request, D TP
    rank) (per_rank); P's accounting summed over the DP ranks."""
    outs: dict[int, Outcome] = {}
    ranks: dict[tuple[int, int], Outcome] = {}
    acc = Accounting()
    for g in range(shape.p_dp):
        got, a = simulate(line, requests, rate, blocks_per_request, pool, lease, faults, engine_id, settle,
                          (g, shape.p_dp), shape, ranks, time_scale)
        outs.update({o.request: o for o in got})
        for f in msgspec.structs.fields(Accounting):
            setattr(acc, f.name, getattr(acc, f.name) + getattr(a, f.name))
    return per_rank([outs[i] for i in range(requests)], shape, ranks), acc


def per_rank(outcomes: list[Outcome], shape: Any,
             ranks: dict[tuple[int, int], Outcome] | None = None) -> list[Outcome]:
    """The model on a TP/DP shape: every D TP rank of the D DP rank a request goes to reads its own P rank(s) at
    the same time and notifies each, and P's scheduler frees a request's blocks only once every worker counted
    every consumer (or its expiry), so each D rank meets what the one D rank meets on TP 1: the same verdict per
    (request, D rank). The counts per P rank differ (pdcheck.vllm.requests.shapes)."""
    from pdcheck.vllm.requests.shapes import d_group, d_label

    mine = ranks or {}
    return [msgspec.structs.replace(mine.get((o.request, r), o), rank=d_label(shape, d_group(shape, o.request), r))
            for o in outcomes for r in range(shape.d_tp)]
