"""Push mode (NixlPushConnector, vLLM 0.24+) of the request path, pure: its params, D's PUSH_REG registration,
P's completion notification, the request-id matching, and a simulator of P's and D's blocks that gives each
request's expected verdict (simulate), as pdcheck.vllm.requests.model does for pull.

Facts from the 0.24.0, 0.25.0, 0.26.0 and 0.34.0 wheels (nixl/push_scheduler.py, push_worker.py, metadata.py,
utils.py; kv_connector/factory.py registers NixlPushConnector from 0.24.0, 0.23.0 has none):
* D's scheduler (update_state_after_alloc) allocates its blocks and stages a registration; D's writer thread
  handshakes with P and sends `b"PUSH_REG:" + msgpack(reg)` to every P agent (PP prefill, PR #45880: one per
  pipeline stage), reg = {request_id (D's), decode_engine_id, decode_host, decode_port, decode_tp_size,
  local_block_ids (D's, per group), remote_engine_id, remote_host, remote_port, remote_tp_size, and from 0.26
  remote_pp_size}. D ignores `remote_block_ids` (it seeds them to ()) and never reads P's memory.
* P handshakes with D before its first WRITE to it: the PUSH_REG's decode_host / decode_port name D's own side
  channel, and P's _ensure_handshake (0.28+: on the background executor, the WRITE deferred until it is done, a
  failure logged as push_handshake_failed; 0.24-0.26: _ensure_d_handshake, blocking on the writer, "Failed handshake to
  D ... for push ...") fetches D's metadata there, cached by D's engine id. A failed handshake skips the WRITE:
  P's blocks wait for the lease and D waits (nothing tells it).
* P's writer matches a registration with a finished request by id: exact, then with the `-<8 hex>` suffix
  stripped from both (get_base_request_id). It WRITEs its blocks into D's with notif_msg
  `"{D request id}:{P world_size}"` and frees its blocks when its own WRITE handles are done (no notification
  from D). Unmatched finished blocks are freed at the lease (kv_lease_duration, renewed by D's `HB:` heartbeats);
  a registration that arrives after that is kept unmatched and never answered.
* D counts `pp_size * max(1, P_tp // D_world)` completion notifications (0.26+; 0.24 and 0.25: done at the
  first one), then the request is done. D's only
  deadline is the registration watchdog (`push_registration_timeout`, default `decoder_kv_blocks_ttl` = 480 s):
  it drops the registration and logs a warning, and the request keeps waiting (the lost-notification class of
  vLLM PR #50754).
* params: pdcheck.vllm.releases.params (PUSH), transfer_mode "push"; no remote_blocks_expiry_time. A missing remote_request_id only stops D's heartbeats (base_scheduler
  on_new_request); the push scheduler never reads it.
* On a TP shape (push_worker.py, 0.24.0-0.34.0): each D rank's PUSH_REG goes to every P agent of the engine it
  handshook with (its sources); P's _xfer_blocks_for_req WRITEs every D rank of plan.all_source_ranks, with P
  TP < D TP each its chunk of P's block (src_xfer_handles_by_tp_ratio), and the D ranks' other PUSH_REGs for
  the request stay pending, never matched. 0.24/0.25's D is done at the first completion: with P TP > D TP a race
  (the plan refuses that pair).
* Before 0.24 there is no push connector; 0.34 also selects it with kv_connector_extra_config transfer_mode.
  0.24/0.25 otherwise differ from 0.26 only in PP and MLA (0.26 WRITEs MLA to every D rank): not modelled here.

The faults, from the same code:
* A failed WRITE (read-fail in push mode): _xfer_blocks catches the error of make_prepped_xfer / transfer and logs
  `NIXL transfer failure: transfer_setup_failed. Push WRITE submission failed; releasing handle`; no handle is
  kept, so P's request is never done sending and its blocks wait for the lease. The completion notification rides
  on the WRITE, so D is never told: it waits (the watchdog only drops the registration).
* hold / heartbeat-loss: base_scheduler.on_new_request tracks the request's heartbeats from the moment D's
  scheduler has it; the PUSH_REG is staged only at update_state_after_alloc (D's blocks). P's writer forwards
  `HB:` to _handle_heartbeat, which renews the lease as in pull. Lost heartbeats: P frees at the lease, and the
  later PUSH_REG stays unmatched (a hang).
* restart-p (P replaced after handing out params): D's _ensure_handshake returns at once for an engine id in
  _remote_agents, so every later PUSH_REG (and heartbeat) goes to the dead agent; _do_send_reg_notif logs
  push_reg_notif_failed and keeps the receive pending (the request waits). The new P never sees a
  registration: its blocks wait for the lease.
* abort-d (the client aborts after PUSH_REG): push request_finished on D returns (False, None) for a request
  that is not P-side, so D's scheduler frees its blocks at once; P is never told and WRITEs into them when the
  registration reaches it, then frees its own blocks on its WRITE as usual.

Over the ~500 lines a module keeps to, on purpose: push mode's codec and its simulator read the same
release facts (above), and the simulator's expected verdicts must move with the codec's fields in one review.
"""

from __future__ import annotations

import heapq
import math
import re
import zlib
from typing import Any

import msgspec

from pdcheck.vllm.releases.params import push_keys
from pdcheck.vllm.releases.rules import msg_engine_id
from pdcheck.vllm.requests.faults import P_RANKS, Fault, pick
from pdcheck.vllm.requests.lines import CORRECTED, Lifecycle
from pdcheck.vllm.requests.model import (
    DISCONNECT,
    GEN_WRAP,
    SETTLE_S,
    Accounting,
    Outcome,
    apply_bad,
    count_still_held,
    hang_detail,
    held_for,
    lose_held,
    on_failure,
    params_for,
    per_rank,
    renew,
    run_end,
    tp_refusal,
)

MODES = ("pull", "push")
PUSH_SINCE = (0, 24, 0)
PP_SINCE = (0, 26, 0)  # pp_size in the params, remote_pp_size in PUSH_REG, D counting P's notifications
PUSH_REG_PREFIX = b"PUSH_REG:"
D_POOL_MAX = 4096  # D's blocks in push mode: one request's blocks stay held while it waits for P's WRITE

_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
WATCHDOG = "push_registration_timeout (default decoder_kv_blocks_ttl, 480 s)"
HANG_NOTIF = ("P's WRITE completed and P freed its blocks, but its completion notification never reached D: D "
              f"waits ({WATCHDOG} only drops the registration; vLLM PR #50754)")
HANG_UNMATCHED = ("P freed the blocks at the lease before D's PUSH_REG arrived: the registration stays unmatched, "
                  f"P never WRITEs and D waits ({WATCHDOG} only drops the registration)")


def available(version: tuple[int, ...]) -> bool:
    return version >= PUSH_SINCE


def has_pp(line: Lifecycle | None) -> bool:
    """0.26+ (and the corrected path): the push code knows P's pipeline stages. None: the newest behaviour."""
    return line is None or line is CORRECTED or line.first >= PP_SINCE


def d_pool(requests: int, blocks_per_request: int, pool: int) -> int:
    """D's KV blocks in push mode: enough for every request to hold its own (a hung one never gives them back)."""
    return max(pool, min(requests * blocks_per_request, D_POOL_MAX))


def keys(line: Lifecycle) -> tuple[str, ...]:
    """The params P's push scheduler returns (releases.params); the corrected path's are the 0.28 push keys plus
    the expiry time, the block generations and the registration generation."""
    if line is not CORRECTED:
        return push_keys(line.first)
    return (*push_keys((0, 28, 0)), "remote_blocks_expiry_time", "block_generations",
            "remote_registration_generation")


def params(line: Lifecycle, req: int, blocks: list[int], engine_id: str, port: int, tp_size: int,
           expiry_at: float | None, gens: list[int], request_id: str = "", generation: int = 1, *,
           block_size: int = 16) -> dict[str, Any]:
    """generation: the corrected path's registration generation (P's incarnation + 1; releases send none)."""
    out = params_for(msgspec.structs.replace(line, keys=keys(line)), req, blocks, engine_id, port, tp_size,
                     expiry_at, gens, request_id, generation, block_size=block_size)
    if "transfer_mode" in out:
        out["transfer_mode"] = "push"
    return out


def d_request_id(base: str) -> str:
    """D's own id for the request: the proxy's id plus vLLM's random `-<8 hex>` suffix (deterministic here)."""
    return f"{base}-{zlib.crc32(base.encode()):08x}"


def base_id(request_id: str) -> str:
    """get_base_request_id: the id without its `-<8 hex>` suffix."""
    return _SUFFIX.sub("", request_id)


class Registration(msgspec.Struct, frozen=True):
    """What P reads from a PUSH_REG: D's request id and blocks, and D's side channel (P's handshake with D)."""

    request_id: str
    blocks: list[int]
    engine_id: str = ""
    host: str = ""
    port: int = 0


def registration(d_rid: str, d_engine: str, d_host: str, d_port: int, d_blocks: list[int],
                 p_params: dict[str, Any], line: Lifecycle | None = None, d_tp: int = 1) -> bytes:
    """D's PUSH_REG notification, as its scheduler stages it and its writer sends it: decode_host / decode_port
    name D's own side channel (side_channel_host / side_channel_port), where P handshakes with D. remote_pp_size
    from 0.26 (line None: 0.26+)."""
    reg = {"request_id": d_rid, "decode_engine_id": d_engine, "decode_host": d_host, "decode_port": d_port,
           "decode_tp_size": d_tp, "local_block_ids": [list(d_blocks)],
           "remote_engine_id": p_params.get("remote_engine_id"), "remote_host": p_params.get("remote_host"),
           "remote_port": p_params.get("remote_port"), "remote_tp_size": p_params.get("tp_size", 1),
           "remote_pp_size": p_params.get("pp_size", 1)}
    if not has_pp(line):
        del reg["remote_pp_size"]
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(reg)


def parse_registration(raw: bytes) -> Registration | str:
    """P's side: the registration, or why P drops it (its log line). msgpack only, never pickle."""
    try:
        reg = msgspec.msgpack.decode(raw[len(PUSH_REG_PREFIX):])
    except msgspec.DecodeError:
        return "Failed to decode PUSH_REG notification payload"
    rid = reg.get("request_id") if isinstance(reg, dict) else None
    if not isinstance(rid, str):
        return "PUSH_REG notif missing request_id; dropping"
    groups = reg.get("local_block_ids")
    if groups and not isinstance(groups[0], list | tuple):  # _as_grouped_block_ids: a flat list is one group
        groups = [groups]
    blocks = groups[0] if groups else []
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        return f"PUSH_REG for {rid}: block ids are not integers; dropping"
    host, port, engine = reg.get("decode_host"), reg.get("decode_port"), reg.get("decode_engine_id")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        host, port = "", 0  # P's handshake with D then fails (vLLM's would raise on the KeyError / bad path)
    return Registration(rid, [int(b) for b in blocks], engine if isinstance(engine, str) else "", host, port)


def handshake_joins(line: Lifecycle) -> bool:
    """0.27+ (and the corrected path): P's handshake with D runs on the background executor and every PUSH_REG
    that comes while it runs waits on the same future (_ensure_handshake), so one failure fails them all. 0.24-0.26:
    the writer thread handshakes per request (_ensure_d_handshake, blocking), so each waiting request tries again.
    Read in nixl/push_worker.py's _do_start_push_kv: 0.26.0 the old way, 0.27.0 the new."""
    return line is CORRECTED or line.first >= (0, 27, 0)


def handshake_failure_log(line: Lifecycle, d_engine: str, d_rid: str, error: str) -> str:
    """What P logs for a request whose handshake with D failed (its WRITE is skipped)."""
    if handshake_joins(line):
        return f"NIXL transfer failure: push_handshake_failed | request {d_rid}: {error}"
    return f"Failed handshake to D {d_engine} for push {d_rid}: {error}"


def hang_handshake(log: str) -> str:
    return (f"P's handshake with D's side channel failed ({log}): P never WRITEs, its blocks wait for the lease, "
            f"and D waits ({WATCHDOG} only drops the registration)")


def completion(d_rid: str, p_world: int = 1) -> bytes:
    """The notif_msg P attaches to its WRITE."""
    return f"{d_rid}:{p_world}".encode()


def expected_notifs(p_tp: int = 1, d_world: int = 1, pp_size: int = 1, line: Lifecycle | None = None) -> int:
    """How many completion notifications D waits for: one per producer rank writing into it (0.26+); 0.24 and
    0.25 call the request done at the first one."""
    return pp_size * max(1, p_tp // d_world) if has_pp(line) else 1


def decide(line: Lifecycle, params: dict[str, Any] | None, p_engine: str, now: float,
           p_tp: int = P_RANKS) -> tuple[str, str] | None:
    """What D does with the params before it registers: None (register), or (verdict, detail). The block ids do not
    matter (D never reads P's memory); a missing remote_request_id only stops the heartbeats, except on the
    corrected path, which checks every key. A wrong tp_size goes into PUSH_REG's remote_tp_size, which only feeds
    D's _ensure_handshake (a no-op for a known engine); P WRITEs by decode_tp_size (0.24.0-0.34.0 push code)."""
    if params is None:
        return "recomputed", "no kv_transfer_params: D prefills the prompt itself (no PUSH_REG)"
    if line is CORRECTED:
        if "remote_request_id" not in params:
            return "recomputed", "kv_transfer_params lack remote_request_id: refused, recomputed"
        expiry = params.get("remote_blocks_expiry_time")
        if expiry is not None and now >= expiry:
            return "recomputed", "lease passed before D got the params: no PUSH_REG, prefill recomputed"
        wrong_tp = tp_refusal(params, p_tp)
        if wrong_tp is not None:
            return "recomputed", wrong_tp
    if params.get("remote_engine_id") != p_engine:
        return on_failure(line, 0, "push_reg_handshake_failed", "RuntimeError: "
                          + msg_engine_id(str(params.get("remote_engine_id")), p_engine))
    return None


HANG_WRITE_FAILED = ("P's WRITE failed (NIXL transfer failure: transfer_setup_failed. Push WRITE submission failed; "
                     "releasing handle): D is never told and waits, and P's blocks wait for the lease "
                     f"({WATCHDOG} only drops the registration)")
WRITE_FAIL_LOG = "NIXL transfer failure: transfer_setup_failed. Push WRITE submission failed; releasing handle"
HELD_LOST = ("lease passed while D held the request (no renewal acknowledged: its heartbeats were lost): no "
             "PUSH_REG, prefill recomputed")


def abort_detail(line: Lifecycle) -> str:
    """abort-d after D's PUSH_REG: what D's scheduler does with its blocks."""
    if line is CORRECTED:
        return ("client aborted after PUSH_REG: D keeps its blocks until P's completion notification (or the "
                "lease), so P's WRITE lands in blocks no other request has")
    return ("client aborted after PUSH_REG: D freed its blocks at once (push request_finished: not a P-side "
            "request, no delay_free_blocks) while P's WRITE into them was still to come; P is never told")


def held_lost(line: Lifecycle, params: dict[str, Any], lost: bool, now: float) -> tuple[str, str] | None:
    """At the end of a hold, before the PUSH_REG: the corrected D, whose heartbeats were not acknowledged, checks
    the lease the params carry. A release registers whatever happened to its heartbeats."""
    expiry = params.get("remote_blocks_expiry_time")
    if line is CORRECTED and lost and expiry is not None and now >= expiry:
        return "recomputed", HELD_LOST
    return None


def reg_failed(line: Lifecycle, error: str) -> tuple[str, str]:
    """D's PUSH_REG send failed (the agent D cached for P's engine id is gone)."""
    if line is CORRECTED:
        return "recomputed", f"{error}: P restarted; D re-handshakes and recomputes (the blocks died with P)"
    return "hang", (f"NIXL transfer failure: push_reg_notif_failed | {error}: the PUSH_REG went to the agent D "
                    "cached for P's engine id (a replaced P is never re-handshaken); D keeps the receive pending "
                    f"and waits ({WATCHDOG} only drops the registration)")


def stale_generation(own: int, now: int) -> tuple[str, str]:
    """The corrected D: params of a P that was replaced since (registration generation own + 1 < now + 1)."""
    return "recomputed", (f"P restarted after handing out these params (registration generation {own + 1} < "
                          f"{now + 1}): its blocks died with it; no PUSH_REG, recomputed")


def watchdog_detail(expiry_s: float) -> str:
    return f"no completion notification {expiry_s:g} s (the lease) after PUSH_REG: D gives up and recomputes"


def d_blocks(request: int, k: int, pool: int) -> list[int]:
    """D's blocks for a request in push mode: D's scheduler allocates them once for every D worker (the PUSH_REG of
    each D rank names the same ids, and P WRITEs every D rank it feeds at the first one), so a D rank that takes the
    request late (rank=DK) still has the ids the others registered. Request i takes the i-th run of k blocks (D has
    one run per request up to D_POOL_MAX blocks: d_pool), wrapping past that."""
    return [(request * k + j) % pool for j in range(k)]


def d_pool_hang(pool: int) -> str:
    return f"D's {pool} KV blocks stayed held by requests waiting for P's WRITE: no blocks to register"


class _Req:
    __slots__ = ("beating", "blocks", "d_blocks", "deadline", "failed", "gens", "holding", "inc", "params", "written")

    def __init__(self, blocks: list[int], gens: list[int], deadline: float, inc: int) -> None:
        self.blocks, self.gens, self.deadline, self.inc = blocks, gens, deadline, inc
        self.holding, self.written, self.failed = True, False, False
        self.beating = False  # D's scheduler heartbeats it, to P's agent of its incarnation
        self.d_blocks: list[int] = []
        self.params: dict[str, Any] = {}


def simulate(line: Lifecycle, requests: int, rate: float, blocks_per_request: int, pool: int,
             lease: float | None, faults: tuple[Fault, ...], engine_id: str = "P",
             settle: float = SETTLE_S, group: tuple[int, int] = (0, 1),
             p_tp: int = 1, time_scale: float = 1.0) -> tuple[list[Outcome], Accounting]:
    """Each request's expected verdict and P's accounting in push mode. group (g, dp_size): only the requests the
    router sends to P DP rank g, as model.simulate; p_tp: P's TP (the params' tp_size). P allocates as in pull (model.simulate);
    D's scheduler takes the request when the router hands it the params (late under slow-decode), heartbeats
    (unless lost) and registers at once or after its hold; P WRITEs if it still holds the blocks and frees them
    when the WRITE is done (a failed WRITE: at the lease); the completion notification (dropped or delayed by
    drop-notif / delay-notif) tells D. An abort after the PUSH_REG frees D's blocks at once (kept on the corrected
    path). The corrected path's D gives up at the lease after its registration and recomputes."""
    expiry = line.lease(lease)
    free, d_size = list(range(pool)), d_pool(requests, blocks_per_request, pool)
    d_used: set[int] = set()  # D's blocks held by requests waiting for P's WRITE
    gen = [0] * pool
    reqs: dict[int, _Req] = {}
    out: dict[int, Outcome] = {}
    acc = Accounting()
    heap: list[tuple[float, int, str, int]] = []
    waiting: list[int] = []
    seq = 0
    inc = d_inc = 0  # restart-p: P's incarnation, and the one whose agent D loaded

    def push(t: float, kind: str, i: int) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, i))
        seq += 1

    def release(i: int, t: float) -> None:
        reqs[i].holding = False
        free.extend(reqs[i].blocks)
        admit(t)

    def admit(t: float) -> None:
        while waiting and len(free) >= blocks_per_request and t <= horizon:
            i = waiting.pop(0)
            blocks = [free.pop(0) for _ in range(blocks_per_request)]
            for b in blocks:
                acc.reused += gen[b] > 0
                gen[b] = gen[b] % GEN_WRAP + 1
            acc.allocated += len(blocks)
            deadline = t + expiry if expiry is not None else math.inf
            reqs[i] = _Req(blocks, [gen[b] for b in blocks], deadline, inc)
            if deadline < math.inf:
                push(deadline, "expire", i)
            slow = pick(faults, "slow-decode", i)
            push(t + (slow.seconds if slow else 0.0), "recv", i)
            if pick(faults, "restart-p", i):
                restart()

    def restart() -> None:
        """P's process is replaced after handing out these params: what it held dies with it; the new P starts
        with every block free."""
        nonlocal inc
        inc += 1
        acc.restarts += 1
        lose_held(reqs.values(), acc)
        free[:] = range(pool)
        gen[:] = [0] * pool

    def register(i: int, t: float) -> None:
        """D's PUSH_REG (after any hold): P WRITEs if it still holds the blocks, else the registration waits."""
        nonlocal d_inc
        r = reqs[i]
        late = held_lost(line, r.params, held_for(faults, i)[1], t)
        if late is not None:
            out[i] = Outcome(i, *late)
            return
        mine = d_blocks(i, blocks_per_request, d_size)
        if d_used.intersection(mine):
            out[i] = Outcome(i, "hang", d_pool_hang(d_size))
            return
        r.d_blocks = mine
        d_used.update(mine)
        if d_inc < inc:  # D's cached agent is the dead P's: the PUSH_REG cannot be sent
            out[i] = Outcome(i, *reg_failed(line, DISCONNECT))
            if line is CORRECTED:  # re-handshake; the blocks go back (a release keeps them: the receive waits)
                d_inc = inc
                d_used.difference_update(r.d_blocks)
                r.d_blocks = []
            return
        if line is CORRECTED and expiry is not None:
            push(t + expiry, "watchdog", i)
        if pick(faults, "abort-d", i):
            out[i] = Outcome(i, "aborted", abort_detail(line))
            if line is not CORRECTED:  # freed at once, under the WRITE to come
                acc.d_freed_in_flight += 1
                d_used.difference_update(r.d_blocks)
                r.d_blocks = []
        if not r.holding:  # the registration reaches P after the lease freed the blocks
            acc.late_notifs += 1
            return
        if pick(faults, "read-fail", i):  # P's WRITE fails: no notification, its blocks wait for the lease
            r.failed = True
            if r.beating and expiry is not None and line.lease_extension(expiry, time_scale) > 0:
                # ... which D's heartbeats keep renewing while D waits for the WRITE (pdcheck.vllm.requests.heartbeat):
                # a release's D waits past the run; the corrected D gives up a lease after its PUSH_REG (a whole-
                # second lease under 1.5 s is never extended: lines.Lifecycle.lease_extension)
                gone = t + expiry if line is CORRECTED else horizon + expiry
                r.deadline = max(r.deadline, gone + line.lease_extension(expiry, time_scale))
                push(r.deadline, "expire", i)
            return
        r.written = True
        release(i, t)
        acc.freed += 1
        if not pick(faults, "drop-notif", i):
            delay = pick(faults, "delay-notif", i)
            push(t + (delay.seconds if delay else 0.0), "notif", i)

    for i in range(group[0], requests, group[1]):
        push(i / rate, "arrive", i)
    horizon = run_end(requests, rate, faults, settle) + (expiry or 0.0)
    while heap:
        t, _s, kind, i = heapq.heappop(heap)
        r = reqs.get(i)
        if kind == "arrive":
            waiting.append(i)
            admit(t)
        elif kind == "recv":
            assert r is not None
            prm: dict[str, Any] | None = params(line, i, r.blocks, engine_id, 5600, p_tp,
                                                r.deadline if r.deadline < math.inf else None, r.gens)
            bad = pick(faults, "bad-params", i)
            if bad is not None:
                earlier = reqs[i - group[1]].blocks if i - group[1] in reqs else None  # this P DP rank's previous
                prm = apply_bad(prm, bad.kind, pool, earlier)
            if pick(faults, "drop-params", i):
                prm = None
            refused = decide(line, prm, engine_id, t, p_tp)
            if refused is not None:
                out[i] = Outcome(i, *refused)
                continue
            assert prm is not None
            r.params = prm
            if line is CORRECTED and r.inc > d_inc:
                d_inc = inc  # newer params than D's handshake: load the P running now first
            elif line is CORRECTED and r.inc < d_inc:
                out[i] = Outcome(i, *stale_generation(r.inc, d_inc))
                continue
            hold_s, lost = held_for(faults, i)
            if line.heartbeat and expiry is not None and "remote_request_id" in prm and not lost and d_inc == inc:
                # D's scheduler tracks it from here (on_new_request): heartbeats every lease/6 until P's WRITE
                # completes (P frees on its WRITE: only the ones before the PUSH_REG count here; a failed WRITE,
                # register())
                r.beating = True
                renew(line, expiry, t, hold_s, r, acc, lambda when, i=i: push(when, "expire", i), time_scale)
            if hold_s > 0:
                push(t + hold_s, "register", i)
            else:
                register(i, t)
        elif kind == "register":
            register(i, t)
        elif kind == "notif":
            assert r is not None
            if t <= horizon and (i not in out or r.d_blocks):  # an aborted request's kept blocks come back too
                out.setdefault(i, Outcome(i, "delivered"))
                d_used.difference_update(r.d_blocks)
                r.d_blocks = []
        elif kind == "watchdog":
            assert r is not None
            if (i not in out or r.d_blocks) and expiry is not None:
                out.setdefault(i, Outcome(i, "recomputed", watchdog_detail(expiry)))
                d_used.difference_update(r.d_blocks)
                r.d_blocks = []
        elif kind == "expire":
            assert r is not None
            if t <= horizon and r.holding and t >= r.deadline:
                release(i, t)
                acc.expired += 1
    for i in waiting:
        out[i] = Outcome(i, "hang", hang_detail(line, pool))
    for i, r in reqs.items():
        if i not in out:
            out[i] = Outcome(i, "hang", HANG_WRITE_FAILED if r.failed else HANG_NOTIF if r.written else HANG_UNMATCHED)
    count_still_held(reqs.values(), acc)
    return [out[i] for i in range(group[0], requests, group[1])], acc


# Faults that make one D rank register late (its own PUSH_REG): with D TP > P TP another D rank's PUSH_REG to the same
# P rank starts every WRITE of that P rank (_xfer_blocks_for_req: plan.all_source_ranks), the late one's included.
LATE_REG = ("slow-decode", "hold", "heartbeat-loss")


def rank_faults(faults: tuple[Fault, ...], shape: Any, k: int, line: Lifecycle | None = None) -> tuple[Fault, ...]:
    """The faults D TP rank k meets, as a TP 1 run of its own (simulate_shape): every fault of every rank, a rank=DJ
    fault only on rank J, a late registration only where no other D rank feeds the same P rank in time, and one P TP
    worker's restart (restart-p:REQ:rank=R) only where rank k reads worker R (its PUSH_REGs go to the dead agent;
    push_reg_notif_failed), as a restart of the P it reads."""
    from pdcheck.vllm.requests.shapes import sources

    mine = set(sources(shape, k))
    sharers = [j for j in range(shape.d_tp) if j != k and mine & set(sources(shape, j))]
    out = []
    for f in faults:
        if f.name == "restart-p" and f.rank is not None and shape.p_tp > 1:
            if f.rank in mine:
                out.append(msgspec.structs.replace(f, rank=None))
            continue
        if not f.on(k):
            continue
        if f.d_rank is not None and f.name in LATE_REG and sharers and line is not CORRECTED:
            continue  # a sharer's PUSH_REG (on time) makes P WRITE this rank too (the corrected D refuses late params)
        out.append(f)
    return tuple(out)


def simulate_shape(line: Lifecycle, requests: int, rate: float, blocks_per_request: int, pool: int,
                   lease: float | None, faults: tuple[Fault, ...], shape: Any, engine_id: str = "P",
                   settle: float = SETTLE_S, time_scale: float = 1.0) -> tuple[list[Outcome], Accounting]:
    """simulate on a TP/DP shape, as model.simulate_shape does for pull: each P DP rank's requests on its own pool,
    then a verdict per (request, D TP rank). Every D TP rank of a request's D DP rank registers at once, each P TP
    worker WRITEs each of its consumers its part and P's scheduler frees once every worker's WRITEs are done, so
    each D rank meets what the one D rank meets on TP 1 (0.26+: D counts one completion per P rank writing it,
    push.expected_notifs). One rank's fault (rank=DK, restart-p:REQ:rank=R): each D rank meets its own
    (rank_faults), and P's accounting follows the request's slowest or failing part (every fault on the request)."""
    ranked = any(f.d_rank is not None or (f.name == "restart-p" and f.rank is not None and shape.p_tp > 1)
                 for f in faults)
    views = [rank_faults(faults, shape, r, line) for r in range(shape.d_tp)] if ranked else [faults]
    whole = tuple(msgspec.structs.replace(f, d_rank=None, rank=None) for f in faults)
    by_rank: list[list[Outcome]] = []
    acc = Accounting()
    for mine in views:
        outs: dict[int, Outcome] = {}
        for g in range(shape.p_dp):
            got, _a = simulate(line, requests, rate, blocks_per_request, pool, lease, mine, engine_id, settle,
                               (g, shape.p_dp), shape.p_tp, time_scale)
            outs.update({o.request: o for o in got})
        by_rank.append(per_rank([outs[i] for i in range(requests)], shape))
    for g in range(shape.p_dp):
        _got, a = simulate(line, requests, rate, blocks_per_request, pool, lease, whole if ranked else faults,
                           engine_id, settle, (g, shape.p_dp), shape.p_tp, time_scale)
        for f in msgspec.structs.fields(Accounting):
            setattr(acc, f.name, getattr(acc, f.name) + getattr(a, f.name))
    if not ranked:
        return by_rank[0], acc
    return [by_rank[k % shape.d_tp][k] for k in range(requests * shape.d_tp)], acc
