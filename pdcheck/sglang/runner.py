"""Runs an SGLang plan on real processes: per release pair, P's real HTTP bootstrap server in this process,
fake P and D ranks from the one launcher (pdcheck.launcher), waits through pdcheck.orchestrate; then the pure
engine's prediction and the corrected behaviour beside what the ranks observed."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import msgspec

from pdcheck import messages as m
from pdcheck import orchestrate as orch
from pdcheck.errors import HarnessError
from pdcheck.launcher import launcher
from pdcheck.pattern import engine_tag
from pdcheck.sglang import bootstrap as bs
from pdcheck.sglang import engine
from pdcheck.sglang.plan import Pair, SgPlan
from pdcheck.sglang.ranks import (
    SERVE_TAG,
    DFinal,
    PFinal,
    SgDecodeSpec,
    SgPrefillSpec,
    sglang_decode_main,
    sglang_prefill_main,
)


class SgPairResult(msgspec.Struct):
    release: str
    p_release: str
    d_release: str
    observed: list[engine.SgVerdict]  # per D rank, from the real processes
    model: list[engine.SgVerdict]  # per D rank, the pure engine's prediction
    corrected: engine.SgVerdict
    transfers: list[m.TransferResult | None]
    prefill: list[PFinal]
    harness: list[str] = []
    seconds: float = 0.0


class SgRunResult(msgspec.Struct):
    scenario: str
    source: str
    issue: str
    pairs: list[SgPairResult]
    seconds: float


def _faults(what: str, timeout_s: float) -> orch.Stage:
    return orch.Stage(f"{{rank}} failed {what}: {{error}}", f"{{rank}} died {what}: it {{ended}}",
                      f"{{ranks}} did not finish {what} within {{timeout:g}} s", timeout_s)


def run_pair(plan: SgPlan, pair: Pair) -> SgPairResult:
    sc, opt = plan.scenario, plan.options
    p, d = sc.prefill.side(), sc.decode.side()
    tag = engine_tag(f"sglang-{pair.name}")
    p_world = p.tp_size * p.pp_size * p.dp_size  # every PP stage is a P rank (each fake stage holds every layer)
    registered = sc.prefill.registered if sc.prefill.registered is not None else p_world
    fault = sc.transfer.fault
    model = engine.decide_all(pair.p, pair.d, p, d, registered=registered if registered < p_world else None,
                              no_bootstrap=sc.decode.no_bootstrap, fault=fault, p_pages=len(plan.requests[0].p_pages))
    t0 = time.perf_counter()
    server = bs.Server(bs.Table(pair.p, p_world))
    harness: list[str] = []
    observed: list[engine.SgVerdict] = []
    transfers: list[m.TransferResult | None] = []
    d_final: dict[int, DFinal] = {}
    p_final: dict[int, PFinal] = {}
    try:
        with launcher(None) as lau, contextlib.ExitStack() as held:
            p_ranks = []
            for r in range(p_world):
                pp, dp, tp = engine.p_rank_of(p, r)
                mine = [q for q in plan.requests if engine.dispatched_dp(p, q.room, fault) == dp]  # the router's
                p_ranks.append(lau.start("P", r, sglang_prefill_main, msgspec.msgpack.encode(SgPrefillSpec(
                    tp, pair.p.name, p, server.port, mine, tag, register=r < registered, pp_rank=pp, fault=fault,
                    dp_rank=dp))))
            d_port = server.port
            if sc.decode.no_bootstrap:
                # A port bound for the whole run and never listened on: every connection is refused, as where
                # nothing listens, and no other part of a parallel smoke can take it meanwhile (one freed at once
                # was taken by another part's bootstrap server, and D got that server's answer).
                import socket

                s = held.enter_context(socket.socket())
                s.bind(("127.0.0.1", 0))
                d_port = s.getsockname()[1]
            # D ranks start beside P's: their set-up (agent, registration) needs nothing of P; they contact
            # the bootstrap server only after Go, once every rank is ready
            d_ranks = [lau.start("D", r, sglang_decode_main, msgspec.msgpack.encode(SgDecodeSpec(
                r, pair.d.name, d, p, d_port, plan.requests, tag, opt.hang_timeout_s, fault=fault,
                heartbeat_s=sc.transfer.heartbeat_s))) for r in range(d.tp_size)]
            orch.await_ready(lau, [*p_ranks, *d_ranks], opt.start_timeout_s)
            orch.send_all(d_ranks, m.Go())
            if fault == "kill_prefill":
                # every P rank wrote chunk 0 of its first request; the whole prefill dies: ranks and bootstrap
                orch.gather(lau, p_ranks, m.Armed, opt.run_timeout_s, _faults("its first chunk", opt.run_timeout_s),
                            watch=d_ranks)
                for pr in p_ranks:
                    os.kill(pr.pid, signal.SIGKILL)
                server.close()
            got = orch.gather(lau, d_ranks, m.FrameworkFinal, opt.run_timeout_s, _faults("its request", opt.run_timeout_s),
                              watch=p_ranks if fault != "kill_prefill" else ())
            d_final = {rid.index: msgspec.msgpack.decode(msg.body, type=DFinal) for rid, (_r, msg) in got.items()}
            if fault == "kill_prefill":
                p_ranks = []
            # P ranks stop first, D ranks once every P rank has: a P rank still WRITing or notifying (hetero TP:
            # D may complete on another P rank's pages first) never meets a D that is already gone
            orch.send_all(p_ranks, m.Stop())
            got_p = {} if not p_ranks else orch.gather(lau, p_ranks, m.FrameworkFinal, opt.start_timeout_s, _faults("to stop", 30.0),
                                ended_ok=True)  # a P rank ends right after its final message
            orch.send_all(d_ranks, m.Stop())
            p_final = {rid.index: msgspec.msgpack.decode(msg.body, type=PFinal) for rid, (_r, msg) in got_p.items()}
    except HarnessError as exc:  # what the ranks delivered before it stays in the report
        harness.append(str(exc))
    finally:
        server.close()
    finals = [p_final[r] for r in sorted(p_final)]
    for r in range(d.tp_size):
        f = d_final.get(r)
        if f is None:
            observed.append(engine.SgVerdict(status="hang", stage="harness", message="no result"))
            transfers.append(None)
            continue
        v = f.verdict
        if fault == "dp_conflict" and v.status == "hang":  # D waited for a room its P DP rank never prefilled
            conflicts = [e for pf in p_final.values() for e in pf.errors if e.startswith("follow_bootstrap_room")]
            stuck = [room for pf in p_final.values() for room in pf.bootstrapping]
            if conflicts or stuck:
                v = engine.dp_conflict(pair.p, pair.d, p, plan.requests[0].room, p_ranks=v.p_ranks)
                if stuck and not conflicts and v.message:
                    v.message += f" (P: rooms {stuck} still in KVPoll.Bootstrapping)"
        if fault == "no_transfer_info":  # D's row tells P's side: its rooms stuck in Bootstrapping
            rooms = sorted({room for pr in v.p_ranks if pr in p_final for room in p_final[pr].bootstrapping})
            if rooms:
                v = engine.no_info(pair.p, rooms, p_ranks=v.p_ranks)
        # What only P saw: its bootstrap thread died on D's frames, or its WRITE failed and D was not told.
        for pr in v.p_ranks:
            pf = p_final.get(pr)
            if pf is None:
                continue
            if pf.listener_dead and v.status == "hang":
                v.listener_dead = pf.listener_dead
                v.stage = "register"
                v.exception = pf.listener_dead.split(":")[0]
                v.message = f"P rank {pr}'s bootstrap thread died: {pf.listener_dead}; {v.message}"
            elif pf.errors and v.status == "hang":
                v.stage = "transfer"
                v.message = f"P rank {pr}'s transfer failed: {pf.errors[0]}; D is not told; {v.message}"
            elif (pf.errors or pf.logs) and v.status == "silent":
                v.message = f"{v.message}; P rank {pr}: {'; '.join([*pf.errors, *pf.logs][:2])}"
            if pf.logs and v.warning is None and fault != "duplicate_room":
                v.warning = pf.logs[0]
        observed.append(v)
        transfers.append(f.transfer)
    return SgPairResult(pair.name, pair.p.name, pair.d.name, observed, model, engine.corrected(p, d, fault), transfers,
                        finals, harness, time.perf_counter() - t0)


def run_live_pair(plan: SgPlan, pair: Pair) -> SgPairResult:
    """Fake D ranks against a live SGLang prefill's bootstrap server (--prefill-endpoint)."""
    sc, opt, live = plan.scenario, plan.options, plan.live
    assert live is not None
    p, d = sc.prefill.side(), sc.decode.side()
    t0 = time.perf_counter()
    harness: list[str] = []
    d_final: dict[int, DFinal] = {}
    try:
        with launcher(None) as lau:
            d_ranks = [lau.start("D", r, sglang_decode_main, msgspec.msgpack.encode(SgDecodeSpec(
                r, pair.d.name, d, p, live.port, plan.requests, SERVE_TAG, opt.hang_timeout_s,
                bootstrap_host=live.host))) for r in range(d.tp_size)]
            orch.await_ready(lau, d_ranks, opt.start_timeout_s)
            orch.send_all(d_ranks, m.Go())
            got = orch.gather(lau, d_ranks, m.FrameworkFinal, opt.run_timeout_s,
                              _faults("its request", opt.run_timeout_s))
            d_final = {rid.index: msgspec.msgpack.decode(msg.body, type=DFinal) for rid, (_r, msg) in got.items()}
            orch.send_all(d_ranks, m.Stop())
    except HarnessError as exc:
        harness.append(str(exc))
    observed = [d_final[r].verdict if r in d_final else engine.SgVerdict(status="hang", stage="harness",
                                                                          message="no result")
                for r in range(d.tp_size)]
    transfers = [d_final[r].transfer if r in d_final else None for r in range(d.tp_size)]
    return SgPairResult(pair.name, pair.p.name, pair.d.name, observed,
                        engine.decide_all(pair.p, pair.d, p, d, p_pages=len(plan.requests[0].p_pages)),
                        engine.corrected(p, d), transfers, [], harness, time.perf_counter() - t0)


def run(plan: SgPlan) -> SgRunResult:
    t0 = time.perf_counter()
    sc = plan.scenario
    one = run_pair if plan.live is None else run_live_pair
    return SgRunResult(sc.name, sc.source, sc.issue, [one(plan, pair) for pair in plan.pairs],
                       time.perf_counter() - t0)
