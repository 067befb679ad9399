"""`pdcheck handshake`: run a plan's fake P and D ranks and collect what they report (a RunResult)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

import msgspec

from pdcheck import messages as m
from pdcheck.errors import HarnessError
from pdcheck.kvcache import engine_tag
from pdcheck.launcher import Launcher, Rank, launcher
from pdcheck.plan import Plan
from pdcheck.ports import PortPlan
from pdcheck.ranks import decode_main, prefill_main
from pdcheck.results import RunResult, Timings
from pdcheck.sidechannel import hold_silent

if TYPE_CHECKING:
    from pdcheck.plan import RunOptions as Options  # the name the orchestration helpers below annotate with


def run(plan: Plan) -> RunResult:
    """Start the plan's fake P and D ranks (a fake P only: a live one runs through pdcheck.live)."""
    assert plan.ports is not None and plan.live is None, "a live P's plan runs through pdcheck.live"
    t0 = time.perf_counter()
    ports, requests, opts = plan.ports, plan.requests, plan.options
    sc = plan.scenario
    p, d = sc.prefill, sc.decode
    harness: list[str] = []
    d_rels = plan.d_releases
    with launcher(plan.ray, opts.start_timeout_s) as lau, ExitStack() as held:
        where = lau.place([*(("P", r) for r in range(p.tp_size)), *(("D", r) for r in range(d.tp_size))],
                          gpu=opts.device == "cuda")
        # Each P rank listens on its own node's address (the scenario's host when all run here).
        p_host = {r: where["P", r].host or p.host for r in range(p.tp_size)}
        p_ranks = {
            r: lau.start("P", r, prefill_main, msgspec.msgpack.encode(m.PrefillSpec(
                engine_id=p.engine_id, tp_rank=r, tp_size=p.tp_size, num_blocks=p.blocks()[r],
                device_id=p.device_id(r), device=opts.device, host=p_host[r],
                geometry=plan.p_geometry, kv_cache_layout=p.kv_cache_layout,
                inject=opts.inject)))
            for r in range(p.tp_size)
        }
        d_ranks = {
            r: lau.start("D", r, decode_main, msgspec.msgpack.encode(m.DecodeSpec(
                engine_id=d.engine_id, tp_rank=r, tp_size=d.tp_size, num_blocks=d.blocks()[r],
                device_id=d.device_id(r), device=opts.device, geometry=plan.d_geometry,
                kv_cache_layout=d.kv_cache_layout, releases=d_rels,
                p_host=p_host[0], p_engine_tag=engine_tag(p.engine_id), remote_engine_id=sc.remote_engine_id(),
                params_tp_size=sc.params_tp_size(), hang_timeout_ms=opts.hang_timeout_ms,
                transfer=opts.transfer, requests=requests)))
            for r in range(d.tp_size)
        }
        ready = _await_ready(lau, [*p_ranks.values(), *d_ranks.values()], opts.start_timeout_s, opts.progress)
        values = {r: ready[f"P rank {r}"][1] for r in p_ranks}
        for r, rank in p_ranks.items():
            rank.send(m.Serve(ports.listeners[r], values))
        bound = _await_serving(lau, p_ranks, ports, opts.start_timeout_s, opts.progress)
        hold = lau.hold_host or p.host
        go = _hold_the_rest(held, hold, ports, bound)
        go = msgspec.structs.replace(go, host=hold, hosts={
            ls.port: p_host[r] for r, specs in ports.listeners.items() for ls in specs})
        t_ready = time.perf_counter()
        for rank in d_ranks.values():
            rank.send(go)
        results, p_final = _collect(lau, p_ranks, d_ranks, opts, harness)
    t_end = time.perf_counter()
    timings = Timings(start_s=t_ready - t0, run_s=t_end - t_ready, total_s=t_end - t0,
                      setup_ms={lbl: ms for lbl, (ms, _v) in ready.items()})
    return RunResult(sc, plan.releases, opts.device, requests, results, p_final, harness, timings,
                     {f"{role} rank {r}": pl.node for (role, r), pl in where.items()})


def _await_ready(lau: Launcher, ranks: list[Rank], timeout_s: float,
                 tick: Callable[[str, int, int], None] | None = None) -> dict[str, tuple[float, bytes]]:
    pending = {r.label: r for r in ranks}
    setup: dict[str, tuple[float, bytes]] = {}
    for rank, msg in lau.events(ranks, time.monotonic() + timeout_s):
        if isinstance(msg, m.Ready):
            setup[rank.label] = (msg.setup_ms, msg.values)
            pending.pop(rank.label, None)
            if tick:
                tick("ranks up", len(setup), len(ranks))
            if not pending:
                return setup
        elif isinstance(msg, m.Failed):
            raise HarnessError(f"{rank.label} failed to start: {msg.error}")
        elif msg is None:
            raise HarnessError(f"{rank.label} died during start-up: it {rank.ended()}")
    raise HarnessError(f"{', '.join(sorted(pending))} not ready after {timeout_s:g} s (start-up follows --timeout)")


def _hold_the_rest(held: ExitStack, host: str, plan: PortPlan, bound: dict[int, int]) -> m.Go:
    """Hold every contacted layout port no P listener serves (silent), plus one silent catch-all port."""
    ports = dict(bound)
    catch_all = held.enter_context(hold_silent(host, 0))
    for layout in plan.contacted:
        if layout not in ports:
            ports[layout] = held.enter_context(hold_silent(host, layout)).getsockname()[1] if plan.fixed \
                else catch_all.getsockname()[1]
    return m.Go(ports, catch_all.getsockname()[1])


def _await_serving(lau: Launcher, p_ranks: dict[int, Rank], plan: PortPlan, timeout_s: float,
                   tick: Callable[[str, int, int], None] | None = None) -> dict[int, int]:
    """Wait until every P rank listens; layout port -> the port really bound."""
    ranks = list(p_ranks.values())
    pending = {r.label for r in ranks}
    bound: dict[int, int] = {}
    for rank, msg in lau.events(ranks, time.monotonic() + timeout_s):
        if isinstance(msg, m.Serving):
            pending.discard(rank.label)
            if tick:
                tick("side channels", len(ranks) - len(pending), len(ranks))
            bound.update(zip([ls.port for ls in plan.listeners[rank.tp_rank]], msg.ports, strict=True))
            if not pending:
                return bound
        elif isinstance(msg, m.Failed):
            raise HarnessError(f"{rank.label} could not open its side channel: {msg.error}")
        elif msg is None:
            raise HarnessError(f"{rank.label} died during start-up (opening its side channel): it "
                               f"{rank.ended()}")
    raise HarnessError(f"{', '.join(sorted(pending))} not serving after {timeout_s:g} s")


def _collect(lau: Launcher, p_ranks: dict[int, Rank], d_ranks: dict[int, Rank], opts: Options,
             harness: list[str]) -> tuple[dict[int, m.DecodeResult], dict[int, m.PrefillFinal]]:
    results: dict[int, m.DecodeResult] = {}
    finals: dict[int, m.PrefillFinal] = {}
    # The launcher issues its own ticket ids: each D rank numbers its requests from 1, so two D ranks
    # reading one P rank would otherwise collide and one would wait forever.
    owner: dict[int, tuple[int, Rank, int]] = {}  # global ticket -> (P rank, D rank, the D rank's ticket)
    next_ticket = 0
    deadline = time.monotonic() + opts.run_timeout_s
    everyone = [*p_ranks.values(), *d_ranks.values()]
    phase = {r.label: "handshake" for r in everyone}  # -> "transfer" at the rank's first block-tag request
    for rank, msg in lau.events(everyone, deadline):
        if msg is None:
            finished = rank.tp_rank in (results if rank.role == "D" else finals)
            if finished:
                continue
            how = f"{rank.label} died during {phase[rank.label]}: it {rank.ended()}"
            expected = rank.role == "P" and rank.tp_rank in opts.inject.die_p
            if not expected:
                # A rank nobody meant to kill: its sentinel fired now, so say so now, stop everything and
                # report what the other ranks delivered (exit 3) instead of waiting for --timeout.
                harness.append(how)
                print(f"pdcheck: {how}; stopping the run", file=sys.stderr, flush=True)
                break
            harness.append(how)
            # A D rank waiting for tags from a dead P gets an answer so it can report the failed READ.
            for gid, (p_rank, d_rank, ticket) in list(owner.items()):
                if rank.role == "P" and p_rank == rank.tp_rank:
                    d_rank.send(m.Tagged(ticket))
                    owner.pop(gid)
        elif isinstance(msg, m.TagReq):
            phase[rank.label] = "transfer"
            target = p_ranks.get(msg.p_rank)
            if target is None or target.done:
                rank.send(m.Tagged(msg.ticket))
            else:
                next_ticket += 1
                phase[target.label] = "transfer"
                owner[next_ticket] = (msg.p_rank, rank, msg.ticket)
                target.send(m.TagReq(next_ticket, msg.p_rank, msg.blocks))
        elif isinstance(msg, m.Tagged):
            entry = owner.pop(msg.ticket, None)
            if entry is not None:
                entry[1].send(m.Tagged(entry[2]))
        elif isinstance(msg, m.DecodeResult):
            results[rank.tp_rank] = msg
            rank.done = True
            if opts.progress:
                opts.progress("handshakes + transfer proof", len(results), len(d_ranks))
            if len(results) == len(d_ranks):
                for pr in p_ranks.values():
                    pr.send(m.Stop())
        elif isinstance(msg, m.PrefillFinal):
            finals[rank.tp_rank] = msg
            rank.done = True
    for r in d_ranks.values():
        if r.tp_rank not in results and not any(r.label in h for h in harness):
            harness.append(f"{r.label} did not report within {opts.run_timeout_s:g} s")
    return results, finals
