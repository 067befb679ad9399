"""Runs a TensorRT-LLM plan on real processes: ctx and gen ranks from the one launcher (pdcheck.launcher), started
once per run and driven line by line (pdcheck/trtllm/messages.py says how), the pure engine's prediction next to
what the ranks did.

How a hang is decided without waiting for it: every rank reports what it sent and received (ZMQ messages per
endpoint, NIXL notifications per agent). When every message sent has been received, or went to a socket nothing
reads any more (a listener thread that died, a killed ctx), and every gen still waits, nothing more can ever
arrive: the gen's wait is the era's hang (forever, or until its kv_transfer_timeout_ms), and the corrected gen's
wait ends at its deadline. The parent then tells the gens (TrtGiveUp). No timing decides a verdict; a cap on each
line only guards against a rank that never goes quiet (docs/trtllm.md, "How a hang is decided")."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import Counter
from typing import Any

import msgspec

from pdcheck import messages as m
from pdcheck import orchestrate as orch
from pdcheck.errors import HarnessError
from pdcheck.launcher import launcher
from pdcheck.releaseline import CORRECTED
from pdcheck.trtllm import checks, engine, eras
from pdcheck.trtllm.ctx import ctx_main
from pdcheck.trtllm.gen import gen_main
from pdcheck.trtllm.messages import (
    CppPeer,
    CtxResult,
    GenResult,
    TrtArmed,
    TrtCtxDone,
    TrtCtxSpec,
    TrtCtxUp,
    TrtEndLine,
    TrtGenDone,
    TrtGenGo,
    TrtGenSpec,
    TrtGiveUp,
    TrtLine,
    TrtPeers,
    TrtReady,
    TrtState,
)
from pdcheck.trtllm.plan import Pair, TrtPlan
from pdcheck.trtllm.rankbase import NOTIF


class LineResult(msgspec.Struct):
    name: str  # the matrix row: the era as named
    ctx_line: str
    gen_line: str
    era: str
    releases: str
    runtime: str
    attribution: str  # a typed release's dating ("" for an era name)
    timeout: str  # the modelled kv_transfer_timeout_ms and where it comes from
    observed: list[GenResult]  # per gen rank, from the real processes
    model: list[engine.Predicted]  # per gen rank, the pure engine's prediction
    ctx: list[CtxResult]  # per ctx rank: what it logged
    killed: bool = False  # fault ctx_dies: the ctx instance was SIGKILLed
    harness: list[str] = []
    seconds: float = 0.0


class TrtRunResult(msgspec.Struct):
    scenario: str
    source: str
    issue: str
    lines: list[LineResult]
    skipped: list[str]
    seconds: float


def instance_name(scenario: str, role: str) -> str:
    """An instance's uuid (TensorRT-LLM's is uuid4, T19): derived from the scenario, so a report names the same
    instances run after run; a restarted ctx is another instance."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"pdcheck-trtllm/{scenario}/{role}"))


def _stage(what: str, timeout_s: float) -> orch.Stage:
    return orch.Stage(f"{{rank}} failed {what}: {{error}}", f"{{rank}} died {what}: it {{ended}}",
                      f"{{ranks}} did not answer {what} within {{timeout:g}} s", timeout_s)


def timeout_text(plan: TrtPlan, gen_line: str) -> tuple[int | None, str]:
    """The kv_transfer_timeout_ms the gen runs with: the scenario's [gen] value, else the era's default."""
    configured = plan.scenario.gen.kv_transfer_timeout_ms
    line = eras.line(gen_line)
    if configured is not None:
        return configured, f"kv_transfer_timeout_ms = {configured} (the scenario's [gen])"
    ms = line.transfer_timeout_ms
    return ms, ("no transfer timeout: " if ms is None else f"{ms} ms: ") + line.timeout_source


class _Run:
    """One part's ranks and lines."""

    def __init__(self, lau: Any, plan: TrtPlan) -> None:
        self.lau, self.plan = lau, plan
        sc = plan.scenario
        self.ctx_side, self.gen_side = sc.ctx.side(), sc.gen.side()
        self.ctx: list[Any] = []
        self.ctx_ready: dict[int, TrtReady] = {}
        self.starts = 0
        gen_name = instance_name(sc.name, "gen")
        self.gen = [lau.start("gen", r, gen_main, msgspec.msgpack.encode(TrtGenSpec(
            r, self.gen_side, self.ctx_side, gen_name, plan.gen_blocks, plan.ctx_blocks, agent=sc.gen.agent,
            cap_s=plan.options.cap_s))) for r in range(self.gen_side.world)]
        self.start_ctx()
        got = orch.gather(lau, [*self.ctx, *self.gen], TrtReady, plan.options.start_timeout_s, _stage(
            "to start", plan.options.start_timeout_s))
        self.ctx_ready = {rid.index: msg for rid, (_r, msg) in got.items() if rid.role == "ctx"}

    def start_ctx(self) -> None:
        """The ctx instance (again after a fault killed it: a restarted ctx is a new instance)."""
        sc = self.plan.scenario
        name = instance_name(sc.name, f"ctx{self.starts or ''}")
        self.starts += 1
        self.ctx = [self.lau.start("ctx", r, ctx_main, msgspec.msgpack.encode(TrtCtxSpec(
            r, self.ctx_side, name, self.plan.ctx_blocks, self.gen_side, agent=sc.ctx.agent)))
            for r in range(self.ctx_side.world)]

    def restart_ctx(self) -> None:
        self.start_ctx()
        got = orch.gather(self.lau, self.ctx, TrtReady, self.plan.options.start_timeout_s,
                          _stage("to start again", self.plan.options.start_timeout_s))
        self.ctx_ready = {rid.index: msg for rid, (_r, msg) in got.items()}

    def line(self, index: int, pair: Pair) -> LineResult:
        t0 = time.monotonic()
        plan, sc = self.plan, self.plan.scenario
        opt, fault = plan.options, sc.request.fault
        ctx_l, gen_l = eras.line(pair.ctx), eras.line(pair.gen)
        rid, ctx_req = 1000 + index, 7000 + index
        if not self.ctx:
            self.restart_ctx()
        orch.send_all(self.ctx, TrtLine(index, pair.ctx, fault, rid, ctx_req))
        ups = {r.index: msg for r, (_x, msg) in orch.gather(self.lau, self.ctx, TrtCtxUp, opt.start_timeout_s,
                                                              _stage("to open a line", opt.start_timeout_s),
                                                              watch=self.gen).items()}
        senders = [ups[r].sender for r in range(self.ctx_side.world)]
        orch.send_all(self.ctx, TrtPeers(senders, ups[0].info))
        timeout_ms, _text = timeout_text(plan, pair.gen)
        for g in self.gen:
            peers = []
            if gen_l.runtime == "cpp" and ctx_l.runtime == "cpp":  # the counterpart: equal TP and PP (plan)
                ready = self.ctx_ready[g.id.index]
                pp, _tp = self.ctx_side.coords(g.id.index)
                peers = [CppPeer(g.id.index, ready.agent, ready.metadata, checks.cache_state(self.ctx_side, pp))]
            g.send(TrtGenGo(index, pair.gen, fault, rid, ctx_req, ups[0].info if ctx_l.runtime == "python" else "",
                            timeout_ms, peers))
        done, killed = self.watch(pair, ups)
        ctx_results: list[CtxResult] = []
        if killed:
            ctx_results = [CtxResult(logs=["pdcheck: SIGKILLed once it had registered the gen and stored its "
                                           "REQUEST_DATA (fault ctx_dies)"]) for _ in self.ctx]
            self.ctx = []
        else:
            orch.send_all(self.ctx, TrtEndLine())
            got = orch.gather(self.lau, self.ctx, TrtCtxDone, opt.start_timeout_s,
                              _stage("to close a line", opt.start_timeout_s))
            by = {rid.index: msg.result for rid, (_r, msg) in got.items()}
            ctx_results = [by[r] for r in range(len(self.ctx))]
        return LineResult(pair.name, pair.ctx, pair.gen, gen_l.era, gen_l.releases, gen_l.runtime, pair.attribution,
                          _text, [done[g] for g in range(len(self.gen))],
                          engine.predict(ctx_l, gen_l, sc, timeout_ms), ctx_results, killed,
                          seconds=time.monotonic() - t0)

    def watch(self, pair: Pair, ups: dict[int, TrtCtxUp]) -> tuple[dict[int, GenResult], bool]:
        """Every gen's TrtGenDone; the give-up when the ranks are quiet; the kill of fault ctx_dies."""
        opt = self.plan.options
        states: dict[tuple[str, int], TrtState] = {}
        done: dict[int, GenResult] = {}
        killed, given_up = False, False
        dead_sinks: set[str] = set()
        start = time.monotonic()
        deadline = start + opt.run_timeout_s
        while len(done) < len(self.gen):
            now = time.monotonic()
            if now > deadline:
                raise HarnessError(f"line {pair.name}: gen rank(s) "
                                   f"{', '.join(str(g.id.index) for g in self.gen if g.id.index not in done)} did not "
                                   f"finish within {opt.run_timeout_s:g} s")
            live = [r for r in self.ctx if not r.done] + [g for g in self.gen if g.id.index not in done]
            for rank, msg in self.lau.events(live, min(deadline, now + 0.05)):
                if msg is None:
                    if rank.id.role == "ctx" and killed:
                        continue
                    raise HarnessError(f"{rank.id} died in line {pair.name}: it {rank.ended()}")
                if isinstance(msg, m.Failed):
                    raise HarnessError(f"{rank.id} failed in line {pair.name}: {msg.error}")
                if isinstance(msg, TrtState):
                    states[(msg.role, msg.tp_rank)] = msg
                elif isinstance(msg, TrtGenDone):
                    done[msg.tp_rank] = msg.result
                elif isinstance(msg, TrtArmed) and not killed:
                    killed = True
                    for r in self.ctx:  # the whole ctx instance dies (SIGKILL: no goodbye, no frame)
                        if r.pid is not None:
                            os.kill(r.pid, signal.SIGKILL)
                    dead_sinks |= {e for u in ups.values() for e in (u.sender, u.receiver, u.info) if e}
                    dead_sinks |= {NOTIF + x.agent for x in self.ctx_ready.values()}
            waiting = [g for g in self.gen if g.id.index not in done]
            if not given_up and waiting and (self.quiet(states, dead_sinks, killed, waiting)
                                             or time.monotonic() - start > opt.cap_s):
                given_up = True
                orch.send_all(waiting, TrtGiveUp())
        return done, killed

    def quiet(self, states: dict[tuple[str, int], TrtState], dead_sinks: set[str], killed: bool,
              waiting: list[Any]) -> bool:
        if any(states.get(("gen", g.id.index)) is None or states[("gen", g.id.index)].waiting is None
               for g in waiting):
            return False
        if not killed and any(("ctx", r) not in states for r in range(len(self.ctx))):
            return False
        sent: Counter[str] = Counter()
        received: Counter[str] = Counter()
        sinks = set(dead_sinks)
        for st in states.values():
            sent.update(st.sent)
            received.update(st.received)
            sinks.update(st.sinks)
        return all(key in sinks or received[key] >= n for key, n in sent.items())

    def stop(self) -> None:
        orch.send_all([r for r in [*self.ctx, *self.gen] if not r.done], m.Stop())


def run(plan: TrtPlan) -> TrtRunResult:
    t0 = time.monotonic()
    sc = plan.scenario
    lines: list[LineResult] = []
    try:
        with launcher(None) as lau:
            runner = _Run(lau, plan)
            for i, pair in enumerate(plan.pairs):
                lines.append(runner.line(i, pair))
            runner.stop()
    except HarnessError as exc:  # what ran before stays in the report; the rest is the harness's failure
        for pair in plan.pairs[len(lines):]:
            lines.append(_not_run(plan, pair, str(exc)))
    return TrtRunResult(sc.name, sc.source, sc.issue, lines, plan.skipped, time.monotonic() - t0)


def _not_run(plan: TrtPlan, pair: Pair, why: str) -> LineResult:
    gen_l = eras.line(pair.gen)
    world = plan.scenario.gen.side().world
    timeout_ms, text = timeout_text(plan, pair.gen)
    return LineResult(pair.name, pair.ctx, pair.gen, gen_l.era, gen_l.releases, gen_l.runtime, pair.attribution,
                      text, [GenResult("hang", "harness", "no result") for _ in range(world)],
                      engine.predict(eras.line(pair.ctx), gen_l, plan.scenario, timeout_ms), [], harness=[why])


def is_corrected(line: LineResult) -> bool:
    return line.name == CORRECTED
