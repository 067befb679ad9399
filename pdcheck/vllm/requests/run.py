"""`pdcheck requests`' runtime: one real P rank and one real D rank (pdcheck.vllm.requests.rank, on the one launcher
and rank skeleton), driven by the parent, which is the router: it sends P each request at its arrival time, takes
the kv_transfer_params P hands out, applies the router's faults and forwards them to D (late under slow-decode),
and collects what each side reports. Each release line runs in turn on the same two ranks (P empties its blocks
between lines), the corrected request path last. The parent names each request's verdict from real outcomes:
D's check of every block by coordinate and generation, P's frees, the order of the two.

Over the ~500 lines a module keeps to: the router is one loop (arrivals, faults, forwarding, outcomes) and the
void-and-rerun of a line under load; the rules it applies live in model.py, the ranks in prefill.py/decode.py.
"""

from __future__ import annotations

import functools
import heapq
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.errors import HarnessError, PdcheckError
from pdcheck.geometry import Geometry
from pdcheck.launcher import launcher, warm_up
from pdcheck.sidechannel import rebindable_port
from pdcheck.vllm import messages as vm
from pdcheck.vllm.requests import messages as rm
from pdcheck.vllm.requests.faults import Fault, pick
from pdcheck.vllm.requests.handshake import SideLog, endpoint, side_for
from pdcheck.vllm.requests.lines import CORRECTED, Lifecycle
from pdcheck.vllm.requests.model import (
    Accounting,
    Outcome,
    PRankAccount,
    apply_bad,
    hang_detail,
    held_for,
    line_settle,
    run_end,
    simulate,
    simulate_shape,
)
from pdcheck.vllm.requests.push import HANG_NOTIF, HANG_UNMATCHED, HANG_WRITE_FAILED, d_pool, hang_handshake
from pdcheck.vllm.requests.push import simulate as push_simulate
from pdcheck.vllm.requests.push import simulate_shape as push_simulate_shape
from pdcheck.vllm.requests.shapes import Shape, d_group, d_label, engine, geometry, p_group
from pdcheck.vllm.requests.stall import AGAIN, StallClock, Voided, shortest, voids
from pdcheck.vllm.requests.texts import engine_deaths

P_ENGINE = "pdcheck-req-P"
D_ENGINE = "pdcheck-req-D"
GEOMETRY = Geometry(tp_size=1, block_size=16, layers=2, total_kv_heads=2, head_dim=64, dtype="bfloat16",
                    attn_backend="FLASH_ATTN", use_mla=False)


class Options(msgspec.Struct, frozen=True):
    requests: int = 8
    rate: float = 10.0
    lease_s: float | None = None
    blocks_per_request: int = 2
    pool: int = 8
    faults: tuple[Fault, ...] = ()
    failure_policy: str | None = None  # kv_load_failure_policy (0.13+); None: each release's default
    settle_s: float = 0.5
    start_timeout_s: float = 60.0
    mode: str = "pull"  # "push": NixlPushConnector (0.26+), pdcheck.vllm.requests.push
    mute_side: bool = False  # test hook: P's side channel never answers (D's handshake times out)
    mute_d_side: bool = False  # test hook, push mode: D's side channel never answers (P's handshake times out)
    stall_p: tuple[tuple[int, float], ...] = ()  # test hook: (request, seconds) P's loop stops before taking it
    # test hook: (role, request): "P" or "D" raises an exception it does not expect as it takes the request, "router"
    # (the parent) as it routes it to D
    crash: tuple[str, int] | None = None
    shape: Shape = Shape()  # TP and DP per side (pdcheck.vllm.requests.shapes)
    time_scale: float = 1.0  # the run in slow motion: every scenario length below is already multiplied by it

    @property
    def lease_scale(self) -> float:
        """The slow motion of the lease (lines.Lifecycle.lease_extension): a release's default lease is never
        stretched."""
        return self.time_scale if self.lease_s is not None else 1.0

    def scaled(self, k: float) -> Options:
        """Every length of the scenario k times longer (arrival gaps, lease, fault delays, settle): the verdicts
        are the same, as the model runs on the same lengths; only handshake and start-up costs, which do not
        stretch, shrink beside them (docs/requests.md, "Slow motion")."""
        if k == 1.0:
            return self
        faults = tuple(msgspec.structs.replace(f, seconds=f.seconds * k) for f in self.faults)
        return msgspec.structs.replace(self, rate=self.rate / k, lease_s=None if self.lease_s is None else
                                       self.lease_s * k, faults=faults, settle_s=self.settle_s * k,
                                       time_scale=self.time_scale * k)


class LineRun(msgspec.Struct):
    """One release line's run: real outcomes, the model's expectation, P's accounting."""

    release: str
    line: str
    outcomes: list[Outcome]
    expected: list[Outcome]
    accounting: Accounting
    expected_accounting: Accounting
    expiry_s: float | None
    expiry_log: list[str]
    notif_errors: list[str]
    seconds: float
    router_lag_s: float  # the most any request reached P or D after its time (the rate not kept)
    timeline: list[tuple[float, int]] = []  # (seconds into the line, P's blocks held from then on)
    latency_s: list[float | None] = []  # per request: arrival to D's answer (None: never answered)
    mode: str = "pull"
    handshake: SideLog | None = None  # D's side-channel handshakes with P in this line
    p_handshake: SideLog | None = None  # push mode: P's handshakes with D over D's side channel in this line
    params: list[dict[str, Any] | None] = []  # per request: the kv_transfer_params P produced (None: never prefilled)
    p_ranks: list[PRankAccount] = []  # on a TP/DP shape: each P rank's own count
    time_scale: float = 1.0  # the slow motion this line ran at (above the run's: the machine voided a run)
    stall_s: float = 0.0  # the worst the machine stalled the parent during this line (pdcheck.vllm.requests.stall)
    voided: list[Voided] = []  # earlier runs of this line whose timing a stall voided


def _stage(what: str, timeout_s: float) -> orc.Stage:
    return orc.Stage(f"{{rank}} failed during {what}: {{error}}", f"{{rank}} died during {what}: it {{ended}}",
                     f"{{ranks}} silent after {{timeout:g}} s during {what}", timeout_s)


def run(releases: list[tuple[str, Lifecycle]], opts: Options,
        tick: Callable[[str, int, int, str], None] | None = None) -> list[LineRun]:
    """Every (release name, lifecycle line) in turn, then the corrected path, on one real P and one real D.
    tick(stage, done, total, note): progress per release line (pdcheck.progress)."""
    warm_up()
    out: list[LineRun] = []
    sh = opts.shape
    # A P that restart-p replaces binds its side channel's port again: one no other process is handed meanwhile
    restarted = any(f.name == "restart-p" for f in opts.faults)
    with launcher() as lau:
        ps = [lau.start("P", g * sh.p_tp + r, _target(), msgspec.msgpack.encode(_p_spec(
                  opts, g, r, side_port=rebindable_port("127.0.0.1") if restarted else 0)))
              for g in range(sh.p_dp) for r in range(sh.p_tp)]
        d_blocks = opts.pool if opts.mode == "pull" else d_pool(opts.requests, opts.blocks_per_request, opts.pool)
        ds = [lau.start("D", g * sh.d_tp + r, _target(), msgspec.msgpack.encode(
            rm.ReqSpec("D", engine(D_ENGINE, g, sh.d_dp), geometry(sh, sh.d_tp) if not sh.single else GEOMETRY,
                      d_blocks, tp_rank=r, mute_side=opts.mute_d_side, tp_size=sh.d_tp, dp_rank=g,
                      peer_geometry=None if sh.single else geometry(sh, sh.p_tp))))
              for g in range(sh.d_dp) for r in range(sh.d_tp)]
        got = orc.gather(lau, [*ps, *ds], rm.ReqReady, opts.start_timeout_s, _stage("start-up", opts.start_timeout_s))
        d_ready = [got[d.id][1] for d in ds]  # push mode: each D rank's own side channel, where P handshakes
        slots = [_PSlot(p, _Outbox(p), got[p.id][1], k // sh.p_tp, k % sh.p_tp) for k, p in enumerate(ps)]
        dboxes = [_Outbox(d) for d in ds]
        try:
            lines = [*releases, (CORRECTED.line, CORRECTED)]
            for k, (name, line) in enumerate(lines):
                if tick is not None:
                    tick("release lines", k, len(lines), name)
                # Every line begins with D's handshake with the P that runs now (after a restart-p: the replacement).
                out.append(_steady(functools.partial(_one_line, lau, slots, ds, dboxes, name, line, d_ready=d_ready),
                                   opts, None if tick is None else functools.partial(tick, "release lines", k,
                                                                                     len(lines))))
            if tick is not None:
                tick("release lines", len(lines), len(lines), "")
        finally:
            for box in [*(s.box for s in slots), *dboxes]:
                box.send(m.Stop())
                box.close()
    return out


def _steady(one_line: Callable[..., LineRun], opts: Options, tick: Callable[[str], None] | None) -> LineRun:
    """A line, run again in slower motion while the machine stalls it past a share of its shortest length
    (pdcheck.vllm.requests.stall): its verdicts are those of the last run, the voided ones listed beside them."""
    voided: list[Voided] = []
    while True:
        with StallClock() as clock:
            got = one_line(opts=opts)
        length = shortest(opts.lease_s, [f.seconds for f in opts.faults])
        if not voids(clock.worst, length, opts.time_scale, len(voided)):
            got.time_scale, got.stall_s, got.voided = opts.time_scale, clock.worst, voided
            return got
        assert length is not None
        voided.append(Voided(opts.time_scale, clock.worst, length))
        opts = opts.scaled(AGAIN)
        if tick is not None:
            tick(f"{got.release} again at x{opts.time_scale:g} (the machine stalled {clock.worst:.2f} s)")


def _p_spec(opts: Options, group: int, rank: int, incarnation: int = 0, side_port: int = 0) -> rm.ReqSpec:
    sh = opts.shape
    return rm.ReqSpec("P", engine(P_ENGINE, group, sh.p_dp), GEOMETRY if sh.single else geometry(sh, sh.p_tp),
                     opts.pool, tp_rank=rank, incarnation=incarnation, side_port=side_port, mute_side=opts.mute_side,
                     tp_size=sh.p_tp, dp_rank=group,
                     peer_geometry=None if sh.single else geometry(sh, sh.d_tp))  # push: which part P WRITEs where


class _PSlot:
    """The P rank now serving (restart-p replaces it: a new process, a new agent, the same engine id)."""

    def __init__(self, rank: Any, box: _Outbox, ready: rm.ReqReady, group: int = 0, tp_rank: int = 0) -> None:
        self.rank, self.box, self.ready = rank, box, ready
        self.group, self.tp_rank = group, tp_rank  # its P DP rank (engine) and TP rank
        self.incarnation = 0
        self.begin: rm.ReqBegin | None = None  # the line this P rank runs (its own side channel)
        self.lines = 0  # lines this process began (its request ids' epoch)
        self.rid_inc = 0  # the process count its request ids carry (a replaced TP worker takes the others')


def _restart_p(lau: Any, slot: _PSlot, begin: rm.ReqBegin, opts: Options, adopt: rm.ReqAdopt | None = None) -> float:
    """Kill P's process and start its replacement on the one launcher: the same engine id, blocks and side-channel
    port, a new agent. The new P takes the line (begin) and serves its metadata on that port; D reads it there
    only where the release re-handshakes. Returns the seconds it took (the router holds requests meanwhile)."""
    import os
    import signal

    t0 = time.time()
    old = slot.rank
    slot.box.close()
    if old.pid is not None:
        os.kill(old.pid, signal.SIGKILL)
    old.reap(5.0)
    old.done = True
    slot.incarnation += 1
    slot.lines, slot.rid_inc = 0, slot.incarnation
    log = getattr(lau, "log_dir", None)
    spec = _p_spec(opts, slot.group, slot.tp_rank, slot.incarnation, slot.ready.side_port)
    k = slot.group * opts.shape.p_tp + slot.tp_rank
    p = lau.start("P", k, _target(), msgspec.msgpack.encode(spec),
                  **({"log": f"{log}/P{k}.r{slot.incarnation}.log"} if log else {}))
    ready = orc.gather(lau, [p], rm.ReqReady, opts.start_timeout_s, _stage("P's restart", opts.start_timeout_s))
    slot.rank, slot.box, slot.ready = p, _Outbox(p), ready[p.id][1]
    _begin_p(lau, slot, begin, opts)
    if adopt is not None:  # one TP worker replaced: it takes the scheduler's state (the others kept theirs)
        slot.box.send(adopt)
        slot.lines, slot.rid_inc = adopt.epoch, adopt.rid_inc
    return time.time() - t0


def _begin_p(lau: Any, slot: _PSlot, begin: rm.ReqBegin, opts: Options) -> None:
    """P takes the line, and its side channel serves the line's wire once P says so (vm.Serving): only then may D
    handshake, or it could read the last line's era."""
    slot.box.send(begin)
    slot.lines += 1
    orc.gather(lau, [slot.rank], vm.Serving, opts.start_timeout_s, _stage("the side channel's start",
                                                                         opts.start_timeout_s))


def _settle_before_restart(lau: Any, ranks: list[Any], req: int, st: _LineState, opts: Options,
                           timeout_s: float = 10.0) -> None:
    """Before P is killed: D finished its handshake with it (answered the line's ReqBegin), and the requests
    before `req` finish as the model has them: D answered each, and P freed each one D read and notified at once
    (a restart is deterministic: it never races the handshake or an earlier READ)."""
    def settled() -> bool:
        if not st.d_began[0]:
            return False
        for j in st.prefilled:
            if j >= req:
                continue
            dec = st.decoded.get(j)
            if dec is None:
                return False
            notified = not (pick(opts.faults, "drop-notif", j) or pick(opts.faults, "delay-notif", j))
            if dec.status == "read" and notified and j not in st.freed:
                return False
            if dec.status == "registered" and j not in st.freed:  # push: P's WRITE into D's blocks still to come
                return False
        return True

    deadline = time.monotonic() + timeout_s
    while not settled() and time.monotonic() < deadline:
        for rank, got in lau.events(ranks, min(deadline, time.monotonic() + 0.05)):
            if got is None or isinstance(got, m.Failed):
                return  # the main loop reports it
            for msg in rm.unbatch(got):
                st.take_other(rank, msg)
            break


class _LineState:
    """What the ranks of one line reported: P's prefills (its scheduler's: TP rank 0 of each P DP rank), D's
    answers per (request, D TP rank), P's frees (on a TP shape: once every TP worker of the engine reported the
    request done, when the parent, as P's scheduler, tells them to free: rm.ReqRelease)."""

    def __init__(self, opts: Options, slots: list[_PSlot], d_ids: dict[Any, tuple[int, int]],
                 to_ds: list[_Outbox] | None = None) -> None:
        self.opts, self.slots, self.d_ids = opts, slots, d_ids
        self.to_ds = to_ds or []  # D's ranks, by DP rank then TP rank: ReqDone when a request is done on all
        self.prefilled: dict[int, rm.ReqPrefilled] = {}
        self.decoded: dict[int, rm.ReqDecoded] = {}  # every D rank of its D DP rank answered (TP rank 0's answer)
        self.by_rank: dict[tuple[int, int], rm.ReqDecoded] = {}  # (request, D TP rank) -> its answer
        self.freed: dict[int, rm.ReqFreed] = {}
        self.done: dict[int, dict[int, rm.ReqFreed]] = {}  # TP shapes: request -> P TP rank -> its worker's done
        self.shadow: dict[tuple[int, int], list[int]] = {}  # (request, P TP rank > 0) -> the blocks it took
        self.first: dict[int, rm.ReqPrefilled] = {}  # TP rank 0's prefills waiting for the other workers'
        self.reports: dict[int, int] = {}
        self.logs: list[str] = []
        self.shakes: list[rm.ReqHandshook] = []
        self.acks = 0
        self.d_began = [False]
        self.synced: set[int] = set()  # the P slots (indices) that sent the line's ReqSync back
        self.sched_free: dict[int, list[int]] = {}  # P DP rank -> the scheduler's free list (TP shapes)
        self.at: int | None = None  # the request the router handled last (named if it fails)

    def prefill_ready(self, slot: _PSlot | None, msg: rm.ReqPrefilled) -> rm.ReqPrefilled | None:
        """TP rank 0's prefill of a request once every P TP worker of its engine has it (its blocks tagged)."""
        if self.opts.shape.p_tp == 1 or slot is None:
            return msg
        if slot.tp_rank == 0:
            self.first[msg.request] = msg
        else:
            self.shadow[(msg.request, slot.tp_rank)] = msg.blocks  # the scheduler's blocks: checked at the end
        seen = self.reports[msg.request] = self.reports.get(msg.request, 0) + 1
        return self.first.pop(msg.request, None) if seen == self.opts.shape.p_tp else None

    def slot_of(self, rank: Any) -> _PSlot | None:
        return next((s for s in self.slots if s.rank.id == rank.id), None)

    def take_other(self, rank: Any, msg: m.Msg) -> None:
        """Everything but P's prefills: D's answers, D's handshakes and the line's begun, P's frees."""
        sh = self.opts.shape
        slot = self.slot_of(rank)
        if isinstance(msg, rm.ReqDecoded):
            _g, r = self.d_ids.get(rank.id, (0, 0))
            self.by_rank[(msg.request, r)] = msg
            if all((msg.request, k) in self.by_rank for k in range(sh.d_tp)):
                self.decoded[msg.request] = self.by_rank[(msg.request, 0)]
                g = d_group(sh, msg.request)  # finished on every D worker: the scheduler stops its heartbeats
                for box in self.to_ds[g * sh.d_tp:(g + 1) * sh.d_tp]:
                    box.send(rm.ReqDone(msg.request))
        elif isinstance(msg, rm.ReqSync) and slot is not None:
            self.synced.add(self.slots.index(slot))
        elif isinstance(msg, m.Ack):
            self.acks += 1
            self.d_began[0] = self.acks >= len(self.d_ids)
        elif isinstance(msg, rm.ReqHandshook):  # every D rank's: each handshakes with each engine it meets
            self.shakes.append(msg)
        elif isinstance(msg, rm.ReqFreed) and sh.p_tp > 1 and slot is not None:
            self.worker_done(slot, msg)
        else:
            _record_free(msg, self.freed, self.logs)

    def worker_done(self, slot: _PSlot, msg: rm.ReqFreed) -> None:
        got = self.done.setdefault(msg.request, {})
        got[slot.tp_rank] = msg
        if msg.log:  # every P worker logs its own expiry (vLLM's _reap_expired_send_leases runs in each)
            self.logs.append(f"(P TP{slot.tp_rank}) {msg.log}")
        if len(got) == self.opts.shape.p_tp and msg.request not in self.freed:
            # the scheduler frees once every worker is done: at the last one, expired if any worker expired (a
            # replaced worker's "lost" counts as done, never as how)
            hows = [f.how for f in got.values() if f.how != "lost"] or ["notif"]
            how = "expired" if "expired" in hows else hows[-1]
            self.freed[msg.request] = rm.ReqFreed(msg.request, how, max(f.t for f in got.values()))
            pf = self.prefilled.get(msg.request)
            if pf is not None:
                self.sched_free.setdefault(slot.group, self._fresh()).extend(pf.blocks)
            for s in self.slots:
                if s.group == slot.group:
                    s.box.send(rm.ReqRelease(msg.request))

    def _fresh(self) -> list[int]:
        return list(range(self.opts.pool))

    def engine_replaced(self, group: int) -> None:
        """restart-p of a whole engine (every TP worker of P DP rank `group`): the new processes start with every
        block free, so the scheduler's free list does too; what the old ones held died with them."""
        self.sched_free[group] = self._fresh()

    def allocated(self, slot: _PSlot | None, pf: rm.ReqPrefilled) -> None:
        """The scheduler's free list of the P DP rank (what a replaced TP worker takes: replaced())."""
        if self.opts.shape.p_tp > 1 and slot is not None:
            free = self.sched_free.setdefault(slot.group, self._fresh())
            for b in pf.blocks:
                free.remove(b)

    def replaced(self, slot: _PSlot) -> rm.ReqAdopt:
        """TP worker `slot` dies (after the params of the request restart-p names): what it held is done on it (its
        blocks died; the scheduler frees each once the other workers are done); its replacement takes the
        scheduler's state."""
        now = time.time()
        held = {i: pf.blocks for i, pf in self.prefilled.items() if p_group(self.opts.shape, i) == slot.group
                and i not in self.freed and slot.tp_rank not in self.done.get(i, {})}
        gens = [0] * self.opts.pool
        for pf in self.prefilled.values():  # in the order P handed them out: each block's latest generation
            if p_group(self.opts.shape, pf.request) == slot.group:
                for b, g in zip(pf.blocks, pf.gens, strict=True):
                    gens[b] = g
        free = list(self.sched_free.setdefault(slot.group, self._fresh()))
        kept = next(s for s in self.slots if s.group == slot.group and s is not slot)
        adopt = rm.ReqAdopt(free, gens, held, kept.lines, kept.rid_inc)
        for i in held:
            self.worker_done(slot, rm.ReqFreed(i, "lost", now))
        return adopt


def _record_free(msg: m.Msg, freed: dict[int, rm.ReqFreed], logs: list[str]) -> None:
    if isinstance(msg, rm.ReqFreed):
        freed.setdefault(msg.request, msg)
        if msg.log:
            logs.append(msg.log)


class _Outbox:
    """Sends to one rank from a thread of its own, in order. The parent's loop then never blocks on a full pipe
    while that rank blocks sending its answers to the parent (at a few hundred requests a second both pipes
    fill: a deadlock)."""

    def __init__(self, rank: Any) -> None:
        self.rank, self.id = rank, rank.id
        self._q: queue.Queue[m.Msg | None] = queue.Queue()
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._drain, name=f"pdcheck-send-{rank.id}", daemon=True)
        self._t.start()

    def _drain(self) -> None:
        while (msg := self._q.get()) is not None:
            try:
                self.rank.send(msg)
            except (OSError, EOFError, ValueError) as exc:  # the rank is gone: the event loop reports how
                self.error = exc
                return

    def send(self, msg: m.Msg) -> None:
        self._q.put(msg)

    def send_all(self, msgs: list[Any]) -> None:
        """A loop turn's messages, in one pipe write."""
        if msgs:
            self._q.put(rm.batched(msgs))

    def close(self, timeout_s: float = 10.0) -> None:
        self._q.put(None)
        self._t.join(timeout_s)


def _target() -> Any:
    from pdcheck.vllm.requests.rank import requests_main

    return requests_main


def _one_line(lau: Any, slots: list[_PSlot], ds: list[Any], to_ds: list[_Outbox], name: str, line: Lifecycle,
              opts: Options, d_ready: list[rm.ReqReady] | None = None) -> LineRun:
    """One release line's run (_line). An exception the router did not expect is one harness error naming the
    line and the request it was handling (exit 3: a crash never reads as a verdict); its traceback stays chained."""
    held: list[_LineState] = []
    try:
        return _line(lau, slots, ds, to_ds, name, line, opts, d_ready, held)
    except PdcheckError:
        raise
    except Exception as exc:
        at = held[0].at if held else None
        where = f", at request {at}" if at is not None else ""
        text = " ".join(str(exc).split()) or type(exc).__name__
        raise HarnessError(f"vLLM {name}: the router (pdcheck's parent process){where}: {type(exc).__name__}: "
                           f"{text}") from exc


def _line(lau: Any, slots: list[_PSlot], ds: list[Any], to_ds: list[_Outbox], name: str, line: Lifecycle,
          opts: Options, d_ready: list[rm.ReqReady] | None, held: list[_LineState]) -> LineRun:
    push = opts.mode == "push"
    sh = opts.shape
    # The replacement after a restart-p binds the same port: one side channel per P rank for the whole run.
    sides = [side_for(name, sl.ready.side_host, sl.ready.side_port, GEOMETRY) for sl in slots]
    side = sides[0]
    peers = {engine(P_ENGINE, g, sh.p_dp): [sides[k] for k, sl in enumerate(slots) if sl.group == g]
             for g in range(sh.p_dp)}
    begin = rm.ReqBegin(line.line, opts.lease_s, opts.blocks_per_request, failure_policy=opts.failure_policy,
                       mode=opts.mode, side=side, release=name, peers={} if sh.single else peers,
                       time_scale=opts.lease_scale)
    # push on a shape: P handshakes with the D ranks it WRITEs, each on its own side channel (vLLM's P: D's port
    # plus the rank), per D engine id; on one P and one D rank P goes where the PUSH_REG says.
    d_peers = {} if sh.single or not push or d_ready is None else {
        engine(D_ENGINE, g, sh.d_dp): [side_for(name, dr.side_host, dr.side_port, GEOMETRY)
                                       for dr in d_ready[g * sh.d_tp:(g + 1) * sh.d_tp]] for g in range(sh.d_dp)}
    for sl, sd in zip(slots, sides, strict=True):
        sl.begin = msgspec.structs.replace(begin, side=sd, peers=d_peers)
        _begin_p(lau, sl, sl.begin, opts)  # push: P learns D's side channel from D's PUSH_REG, as vLLM's P does
    for box in to_ds:
        box.send(begin)  # D handshakes over P's side channel at its first request, and answers now (m.Ack)
    d_ids = {d.id: (k // sh.d_tp, k % sh.d_tp) for k, d in enumerate(ds)}
    st = _LineState(opts, slots, d_ids, to_ds)
    held.append(st)
    prefilled, decoded, freed, logs, shakes = st.prefilled, st.decoded, st.freed, st.logs, st.shakes
    ranks_now = [*(sl.rank for sl in slots), *ds]
    got = orc.gather(lau, ds, m.Ack, opts.start_timeout_s,
                     _Recording(_stage(f"vLLM {name}'s handshake", opts.start_timeout_s), lambda msg: None))
    del got
    st.d_began[0] = True
    t0 = time.time()  # the line's requests arrive from now on, as the raw loop's clock starts after its set-up
    restarts = 0
    lost = 0
    gone: set[int] = set()  # requests a replaced P held or had freed: no longer P's to free
    lost_at: dict[int, float] = {}  # request -> when its blocks died with a replaced P
    restarts_due = sorted(f.request for f in opts.faults if f.name == "restart-p" and f.request is not None)
    parked: list[tuple[float, int]] = []  # prefills held back until P's restart
    answered: dict[int, float] = {}
    n = opts.requests
    # (when, seq, action, request): "prefill" to P, "decode" to D
    due: list[tuple[float, int, str, int]] = [(t0 + i / opts.rate, i, "prefill", i) for i in range(n)]
    heapq.heapify(due)
    seq = n
    restarting = any(f.name == "restart-p" for f in opts.faults)
    expiry = line.lease(opts.lease_s)
    # push: the corrected D gives up a lease after its PUSH_REG; the run waits for that
    settle = line_settle(line, opts.settle_s, expiry, opts.lease_scale)
    end = t0 + run_end(n, opts.rate, opts.faults, settle) + ((expiry or 0.0) if push else 0.0)
    registered: set[int] = set()  # push: D sent PUSH_REG (its outcome comes later, or never: a hang)
    sync_sent = False  # the ReqSync round trip with every P rank, sent once the schedule's end is reached
    last_answer = t0
    lag = 0.0
    hard = end + 30.0  # a rank that stops answering ends the run as a harness error, never a hang
    faults = _stage(f"vLLM {name}'s requests", hard - time.time())
    while True:
        now = time.time()
        to_p: dict[int, list[rm.ReqPrefill]] = {}
        to_dd: dict[int, list[rm.ReqDecode]] = {}
        while due and due[0][0] <= now:
            when, _s, action, i = heapq.heappop(due)
            lag = max(lag, now - when)
            if action == "prefill" and restarts_due and restarts_due[0] < i:
                parked.append((when, i))  # P restarts after an earlier request: this one goes to the new P
            elif action == "prefill":
                to_p.setdefault(p_group(sh, i), []).append(_prefill(i, opts))
            else:
                st.at = i
                for r in _d_ranks(action, sh.d_tp):  # each D TP rank of the request's D DP rank, its own faults
                    to_dd.setdefault(d_group(sh, i) * sh.d_tp + r, []).append(_route(prefilled, i, opts, r))
        for sl in slots:  # every request due this turn, in one message per rank
            sl.box.send_all(to_p.get(sl.group, []))
        for k, box in enumerate(to_ds):
            box.send_all(to_dd.get(k, []))
        # Settle after the last answer too: its notification (sent just before) must reach P before P counts.
        if now >= max(end, last_answer + settle) and len(decoded.keys() | registered) >= len(prefilled) \
                and not due:
            # ... and every prefill sent to P was taken: a P the machine stalled past the end has not answered one
            # yet, and the run would call it a hang (P answers a ReqSync after everything before it)
            if len(st.synced) == len(slots):
                break
            if not sync_sent:  # once: no prefill is sent after it (nothing is due)
                sync_sent = True
                for sl in slots:
                    sl.box.send(rm.ReqSync())
        if now > hard:
            raise HarnessError(f"vLLM {name}: requests still open {hard - t0:.0f} s after the run began")
        stop = max(end, last_answer + settle)
        wake = min(due[0][0] if due else stop, stop if now < stop else now + 0.05)
        ranks_now = [*(sl.rank for sl in slots), *ds]
        for rank, got_msg in lau.events(ranks_now, time.monotonic() + max(0.001, wake - time.time())):
            if got_msg is None:
                raise faults.died(rank)
            if isinstance(got_msg, m.Failed):
                raise faults.failed(rank, got_msg)
            # A rank's loop turn, in order; a prefill after which P restarts goes last (what P sent after it, e.g.
            # a free, counts before the restart, as _settle_before_restart would have read it from the pipe).
            msgs = rm.unbatch(got_msg)
            if restarting:
                msgs.sort(key=lambda x: isinstance(x, rm.ReqPrefilled) and pick(opts.faults, "restart-p", x.request)
                          is not None)
            slot = st.slot_of(rank)
            for msg in msgs:
                st.at = getattr(msg, "request", st.at)
                if isinstance(msg, rm.ReqPrefilled) and (msg := st.prefill_ready(slot, msg)) is None:
                    continue  # P's scheduler hands the params out once every TP worker has the request
                if isinstance(msg, rm.ReqPrefilled):
                    prefilled[msg.request] = msg
                    st.allocated(slot, msg)
                    # slow-decode: the params reach each D TP rank when its own fault says (rank=DK: one late)
                    late = [(s_.seconds if (s_ := pick(opts.faults, "slow-decode", msg.request, r)) else 0.0)
                            for r in range(sh.d_tp)]
                    t_decode = msg.t + late[0]
                    if pick(opts.faults, "restart-p", msg.request):
                        # Between handshake and transfer: P is replaced after handing out these params. Whatever it
                        # still held dies with it; the schedule pauses while the new P starts.
                        # The params D was due to get before this moment go to D now, before P dies, as the model
                        # orders them (on a loaded machine their turn of the loop may not have come yet: D then
                        # read an earlier request from the dead P); every D rank of the shape gets its own.
                        early = sorted(e for e in due if e[2].startswith("decode") and e[0] <= msg.t)
                        if early:
                            due[:] = [e for e in due if not (e[2].startswith("decode") and e[0] <= msg.t)]
                            heapq.heapify(due)
                            for e in early:
                                for r in _d_ranks(e[2], sh.d_tp):
                                    to_ds[d_group(sh, e[3]) * sh.d_tp + r].send(_route(prefilled, e[3], opts, r))
                        _settle_before_restart(lau, ranks_now, msg.request, st, opts)
                        dying = [j for j in prefilled if j not in freed and j not in gone]
                        lost += len(dying)
                        lost_at.update(dict.fromkeys(dying, time.time()))
                        gone.update(prefilled)
                        restarts += 1
                        # push: the new P handshakes with D on D's first PUSH_REG to it. On a TP shape the whole
                        # engine (every TP worker of its DP rank) is replaced.
                        down = 0.0
                        # restart-p:REQ:rank=R on a P TP > 1: only worker R's process; the others keep serving
                        hit = pick(opts.faults, "restart-p", msg.request)
                        one = hit.rank if hit is not None and sh.p_tp > 1 else None
                        for sl in slots:
                            if slot is not None and sl.group == slot.group and one in (None, sl.tp_rank):
                                down += _restart_p(lau, sl, sl.begin, opts,
                                                   None if one is None else st.replaced(sl))
                        if one is None and slot is not None:  # a new engine: every block free (model.restart)
                            st.engine_replaced(slot.group)
                        if one is not None and slot is not None:  # the engine's generation counts the new process
                            group = [sl for sl in slots if sl.group == slot.group]
                            group[0].box.send(rm.ReqReplaced(1 + sum(sl.incarnation for sl in group)))
                        if msg.request in restarts_due:
                            restarts_due.remove(msg.request)
                        due = [(w + down, s_, a, j) for w, s_, a, j in due]
                        due += [(w + down, j, "prefill", j) for w, j in parked]
                        parked.clear()
                        heapq.heapify(due)
                        end, hard, t_decode = end + down, hard + down, t_decode + down
                    for k, when in enumerate(late if len(set(late)) > 1 else late[:1]):
                        heapq.heappush(due, (t_decode - late[0] + when, seq, "decode" if len(set(late)) == 1
                                             else f"decode@{k}", msg.request))
                        seq += 1
                elif isinstance(msg, rm.ReqDecoded) and msg.status == "registered":
                    registered.add(msg.request)
                    last_answer = time.time()
                    if expiry is not None:
                        # the corrected D gives up a lease after this PUSH_REG: a late one (D's first handshake
                        # on a loaded machine) moves that past the schedule's end, which then waits for it
                        end = max(end, last_answer + expiry + settle)
                        hard = max(hard, end + 30.0)
                else:
                    st.take_other(rank, msg)
                    if isinstance(msg, rm.ReqDecoded) and msg.request in decoded:
                        last_answer = answered[msg.request] = time.time()
            break  # back to the schedule after every pipe message
    tallies: list[rm.ReqTally] = []  # each D rank's heartbeats and handshakes, per request
    for d, box in zip(ds, to_ds, strict=True):
        box.send(rm.ReqEnd())
        tallies.append(orc.gather(lau, [d], rm.ReqTally, 30.0,
                                  _Recording(_stage(f"vLLM {name}'s heartbeat count", 30.0),
                                             functools.partial(st.take_other, d)))[d.id][1])
    accts = []
    for sl in slots:
        sl.box.send(rm.ReqEnd())
        accts.append(orc.gather(lau, [sl.rank], rm.ReqAccount, 30.0,
                                _Recording(_stage(f"vLLM {name}'s accounting", 30.0),
                                           functools.partial(st.take_other, sl.rank)))[sl.rank.id][1])
    acct = accts[0] if len(accts) == 1 else _merged(accts)
    seconds = time.time() - t0  # the line's real run, not the verdicts and the model after it
    for (i, r), blocks in st.shadow.items():
        if i in prefilled and blocks != prefilled[i].blocks:
            raise HarnessError(f"vLLM {name}: request {i}: P TP rank {r} took blocks {blocks}, rank 0 "
                               f"{prefilled[i].blocks}: the scheduler's workers disagree")
    owner: dict[tuple[int, int], int] = {}  # (block, generation) -> the request P last allocated it to
    for pf in prefilled.values():  # in the order P handed them out
        for b, g in zip(pf.blocks, pf.gens, strict=True):
            owner[(b, g)] = pf.request
    hs_error = next((s.error for s in acct.handshakes if s.error), "")
    judge = functools.partial(_push_verdict, write_failed=set(acct.write_failed),
                              hs_failed=set(acct.handshake_failed), hs_error=hs_error) if push else _verdict
    if sh.single:
        outcomes = [judge(i, line, opts.pool, prefilled, decoded, freed, owner) for i in range(n)]
        if engine_deaths(acct.notif_errors):  # P admitted nothing after its engine core died
            outcomes = [msgspec.structs.replace(o, detail=hang_detail(line, opts.pool, True))
                        if i not in prefilled else o for i, o in enumerate(outcomes)]
    else:  # a verdict per (request, D rank): each D TP rank's own answer
        outcomes = []
        for i in range(n):
            for r in range(sh.d_tp):
                mine = {i: st.by_rank[(i, r)]} if (i, r) in st.by_rank else {}
                got_o = judge(i, line, opts.pool, prefilled, mine, freed, owner)
                got_o.rank = d_label(sh, d_group(sh, i), r)
                outcomes.append(got_o)
    for o in outcomes:  # what each D rank's scheduler and worker did for it: heartbeats that named it, handshakes
        tally = tallies[d_group(sh, o.request) * sh.d_tp + (int(o.rank.rsplit("D", 1)[1]) if o.rank else 0)]
        o.heartbeats, o.handshakes = tally.heartbeats.get(o.request, 0), tally.handshakes.get(o.request, 0)
    acc = _accounting(prefilled, freed, acct, line, opts)
    acc.restarts, acc.lost = restarts, lost
    acc.d_freed_in_flight = sum(dec.d_freed_in_flight for dec in decoded.values())
    exp, exp_acc = expected(line, opts)
    # The schedule pauses while P restarts: arrivals are measured from when the router handed the request on.
    arrived = {i: pf.t for i, pf in prefilled.items()}
    latency = [answered[i] - arrived[i] if i in answered and i in arrived else None for i in range(n)]
    failed = next((s.error for s in shakes if s.error), "")
    p_side = None
    if push:  # D's side channel, as P's handshakes found it (none: no PUSH_REG reached P)
        p_side = SideLog(acct.handshakes[0].endpoint if acct.handshakes else "", side.wire, len(acct.handshakes),
                         hs_error)
    produced = [msgspec.msgpack.decode(prefilled[i].params) if i in prefilled else None for i in range(n)]
    return LineRun(name, line.line, outcomes, exp, acc, exp_acc, expiry, logs, acct.notif_errors, seconds,
                   lag, _timeline(t0, prefilled, freed, lost_at), latency, opts.mode,
                   SideLog(", ".join(dict.fromkeys(s.endpoint for s in shakes)) or endpoint(side), side.wire,
                           len(shakes), failed), p_side, produced,
                   p_ranks=[_rank_account(sl, a) for sl, a in zip(slots, accts, strict=True)] if not sh.single
                   else [])


def expected(line: Lifecycle, opts: Options) -> tuple[list[Outcome], Accounting]:
    """The model's verdict per request (per D TP rank on a shape) and P's accounting for one release line: what
    the real ranks' outcomes are compared with."""
    sh, push = opts.shape, opts.mode == "push"
    expiry = line.lease(opts.lease_s)
    settle = line_settle(line, opts.settle_s, expiry, opts.lease_scale)
    if sh.single:
        return (push_simulate if push else simulate)(
            line, opts.requests, opts.rate, opts.blocks_per_request, opts.pool, opts.lease_s, opts.faults, P_ENGINE,
            settle, time_scale=opts.lease_scale)
    return (push_simulate_shape if push else simulate_shape)(
        line, opts.requests, opts.rate, opts.blocks_per_request, opts.pool, opts.lease_s, opts.faults, sh, P_ENGINE,
        settle, opts.lease_scale)


def _merged(accts: list[rm.ReqAccount]) -> rm.ReqAccount:
    """Every P rank's accounting as the scheduler's: a request held while any worker holds it; late
    notifications, heartbeats and errors summed over the workers."""
    return rm.ReqAccount(sorted({i for a in accts for i in a.holding}), sorted({i for a in accts for i in a.waiting}),
                        sum(a.late_notifs for a in accts), sum(a.heartbeats for a in accts),
                        [e for a in accts for e in a.notif_errors], sorted({i for a in accts for i in a.write_failed}),
                        [h for a in accts for h in a.handshakes],
                        sorted({i for a in accts for i in a.handshake_failed}))


def _rank_account(slot: _PSlot, a: rm.ReqAccount) -> PRankAccount:
    sh_dp = f"DP{slot.group}/" if slot.group else ""
    return PRankAccount(f"{sh_dp}P{slot.tp_rank}", len(a.holding), a.late_notifs, a.heartbeats)


def _timeline(t0: float, prefilled: dict[int, rm.ReqPrefilled], freed: dict[int, rm.ReqFreed],
              lost_at: dict[int, float]) -> list[tuple[float, int]]:
    """P's blocks held over the line, from its real allocations, frees and restarts."""
    steps: list[tuple[float, int]] = []
    for i, pf in prefilled.items():
        k = len(pf.blocks)
        steps.append((pf.t, k))
        end = freed[i].t if i in freed else lost_at.get(i)
        if end is not None:
            steps.append((end, -k))
    steps.sort()
    out: list[tuple[float, int]] = [(0.0, 0)]
    held = 0
    for t, dk in steps:
        held += dk
        out.append((round(t - t0, 4), held))
    return out


class _Recording(orc.Stage):
    """A wait for one message during which what the ranks report besides it still counts (record), e.g. a block
    P freed after the parent's last look, before P's accounting."""

    def __init__(self, base: orc.Stage, record: Callable[[m.Msg], None]) -> None:
        super().__init__(base.failed_text, base.died_text, base.late_text, base.timeout_s)
        object.__setattr__(self, "_record", record)

    def stray(self, rank: Any, got: m.Msg) -> Exception | None:
        for msg in rm.unbatch(got):
            self._record(msg)  # type: ignore[attr-defined]
        return None


def _route(prefilled: dict[int, rm.ReqPrefilled], i: int, opts: Options, d_rank: int = 0) -> rm.ReqDecode:
    """The router: forward P's params to D (TP rank d_rank of the request's D DP rank), as the faults say."""
    pf = prefilled[i]
    if opts.crash == ("router", i):
        raise RuntimeError("an exception injected by the test hook Options.crash")
    crash = opts.crash == ("D", i) and d_rank == 0  # one D worker raises, so the error line names one rank
    params: dict[str, Any] | msgspec.Raw | None = pf.params  # forwarded as P encoded them
    bad = pick(opts.faults, "bad-params", i)
    if bad is not None:
        j = i - opts.shape.p_dp  # reused-ids: the previous request the router sent the same P DP rank (engine)
        earlier = prefilled[j].blocks if j in prefilled else None
        params = apply_bad(msgspec.msgpack.decode(pf.params), bad.kind, opts.pool, earlier)
    if pick(opts.faults, "drop-params", i):
        params = None
    hold_s, lost = held_for(opts.faults, i, d_rank)
    if opts.mode == "push":  # the notification faults and read-fail hit P's WRITE instead (_prefill)
        return rm.ReqDecode(i, pf.request_id, params, pf.blocks, pf.gens, hold_s=hold_s, heartbeats_lost=lost,
                           abort=pick(opts.faults, "abort-d", i, d_rank) is not None, crash=crash)
    delay = pick(opts.faults, "delay-notif", i)
    delay = delay if delay is not None and delay.on(d_rank) else None
    drop = pick(opts.faults, "drop-notif", i)
    return rm.ReqDecode(i, pf.request_id, params, pf.blocks, pf.gens, drop is not None and drop.on(d_rank),
                       delay.seconds if delay else 0.0, hold_s, lost,
                       pick(opts.faults, "read-fail", i, d_rank) is not None,
                       pick(opts.faults, "abort-d", i, d_rank) is not None, any(f.hits(i) for f in opts.faults),
                       crash=crash)


def _d_ranks(action: str, d_tp: int) -> range:
    """The D TP ranks a "decode" entry of the router's schedule goes to: every one, or "decode@K" only rank K."""
    if action.startswith("decode@"):
        k = int(action[7:])
        return range(k, k + 1)
    return range(d_tp)


def _prefill(i: int, opts: Options) -> rm.ReqPrefill:
    """A request to P; in push mode with the faults on P's WRITE: its completion notification, its failure."""
    stall = dict(opts.stall_p).get(i, 0.0)
    crash = opts.crash == ("P", i)
    if opts.mode != "push":
        return rm.ReqPrefill(i, stall_s=stall, crash=crash)
    delay, drop, fail = (pick(opts.faults, "delay-notif", i), pick(opts.faults, "drop-notif", i),
                         pick(opts.faults, "read-fail", i))
    return rm.ReqPrefill(i, drop is not None, delay.seconds if delay else 0.0, fail is not None,
                        drop.d_rank if drop is not None and drop.d_rank is not None else -1,
                        delay.d_rank if delay is not None and delay.d_rank is not None else -1, stall, crash,
                        fail.d_rank if fail is not None and fail.d_rank is not None else -1)


def _verdict(i: int, line: Lifecycle, pool: int, prefilled: dict[int, rm.ReqPrefilled], decoded: dict[int, rm.ReqDecoded],
             freed: dict[int, rm.ReqFreed], owner: dict[tuple[int, int], int]) -> Outcome:
    if i not in prefilled:
        return Outcome(i, "hang", hang_detail(line, pool))
    dec = decoded.get(i)
    if dec is None:
        return Outcome(i, "hang", "D never answered for this request")
    if dec.status in ("refused", "failed", "aborted"):
        return Outcome(i, dec.verdict, dec.detail)
    if dec.wrong:
        return _wrong(i, dec, line, owner)
    f = freed.get(i)
    if f is not None and f.t <= dec.t_read:
        return Outcome(i, "freed-early", f"P freed the blocks ({f.how}) {dec.t_read - f.t:.2f} s before D read "
                                         "them")
    return Outcome(i, "delivered")


def _wrong(i: int, dec: rm.ReqDecoded, line: Lifecycle, owner: dict[tuple[int, int], int]) -> Outcome:
    """D's check found another generation's bytes: whose KV it read (P's allocation log names the owner)."""
    j = owner.get((dec.found_block, dec.found_gen)) if dec.found_valid else None
    whose = f"request {j}'s KV (generation {dec.found_gen})" if j is not None else "untagged bytes"
    if line is CORRECTED:
        return Outcome(i, "recomputed", f"generation check: block {dec.found_block} holds {whose}: refused, "
                                        "recomputed")
    return Outcome(i, "wrong", f"block {dec.found_block} holds {whose}", j)


def _accounting(prefilled: dict[int, rm.ReqPrefilled], freed: dict[int, rm.ReqFreed], acct: rm.ReqAccount,
                line: Lifecycle, opts: Options) -> Accounting:
    seen: set[int] = set()
    reused = 0
    for i in sorted(prefilled, key=lambda k: prefilled[k].t):
        for b in prefilled[i].blocks:
            reused += b in seen
            seen.add(b)
    expires = line.expiry != "none"
    return Accounting(
        allocated=sum(len(pf.blocks) for pf in prefilled.values()),
        freed=sum(f.how in ("notif", "written") for f in freed.values()),
        expired=sum(f.how == "expired" for f in freed.values()),
        reused=reused,
        leaked=0 if expires else len(acct.holding),
        held=len(acct.holding) if expires else 0,
        late_notifs=acct.late_notifs,
        heartbeats=acct.heartbeats,
        engine_died=min(1, engine_deaths(acct.notif_errors)))


def _push_verdict(i: int, line: Lifecycle, pool: int, prefilled: dict[int, rm.ReqPrefilled],
                  decoded: dict[int, rm.ReqDecoded], freed: dict[int, rm.ReqFreed],
                  owner: dict[tuple[int, int], int], write_failed: frozenset[int] | set[int] = frozenset(),
                  hs_failed: frozenset[int] | set[int] = frozenset(), hs_error: str = "") -> Outcome:
    """Push mode: P frees its blocks once its WRITE is done, before D hears of it, so freed-early does not apply;
    a request D registered that never completed waits for P's notification (hang), named by what P did (WRITE
    done, WRITE failed, no WRITE: P's handshake with D failed, or the registration came after the lease)."""
    if i not in prefilled:
        return Outcome(i, "hang", hang_detail(line, pool))
    dec = decoded.get(i)
    if dec is not None and dec.status == "registered":  # PUSH_REG sent (read before a restart): no outcome yet
        dec = None
    if dec is None:
        f = freed.get(i)
        if i in write_failed:
            return Outcome(i, "hang", HANG_WRITE_FAILED)
        if i in hs_failed:
            return Outcome(i, "hang", hang_handshake(hs_error))
        return Outcome(i, "hang", HANG_NOTIF if f is not None and f.how == "written" else HANG_UNMATCHED)
    if dec.status in ("refused", "failed", "aborted"):
        return Outcome(i, dec.verdict, dec.detail)
    if dec.wrong:
        return _wrong(i, dec, line, owner)
    return Outcome(i, "delivered")
