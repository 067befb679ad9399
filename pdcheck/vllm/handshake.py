"""`pdcheck handshake`: run a plan's fake P and D ranks and collect what they report (a RunResult)."""

from __future__ import annotations

import time
from contextlib import ExitStack

import msgspec

from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.launcher import launcher
from pdcheck.pattern import engine_tag
from pdcheck.vllm import drive
from pdcheck.vllm import messages as vm
from pdcheck.vllm import ports as portlayout
from pdcheck.vllm.plan import Plan
from pdcheck.vllm.ranks import decode_main, prefill_main
from pdcheck.vllm.releases import multinode
from pdcheck.vllm.results import RunResult, Timings


def run(plan: Plan) -> RunResult:
    """Start the plan's fake P and D ranks (a fake P only: a live one runs through pdcheck.vllm.live)."""
    assert plan.ports is not None and plan.live is None, "a live P's plan runs through pdcheck.vllm.live"
    if plan.dp:
        return _run_dp(plan)
    t0 = time.perf_counter()
    ports, requests, opts = plan.ports, plan.requests, plan.options
    sc = plan.scenario
    p, d = sc.prefill, sc.decode
    harness: list[str] = []
    d_rels = plan.d_releases
    with launcher(plan.ray, opts.start_timeout_s) as lau, ExitStack() as held:
        reserved = drive.reserve_layout(held, p.host, ports) if ports.fixed and plan.ray is None else {}
        where = lau.place([*(("P", r) for r in range(p.tp_size)), *(("D", r) for r in range(d.tp_size))],
                          gpu=opts.device == "cuda")
        # Each P rank listens on its own node's address (the scenario's host when all run here; a P spanning
        # `nodes` nodes here: node k's loopback address, ports.node_host).
        p_host = {r: where["P", r].host or portlayout.node_host(p.host, multinode.rank_node(r, p.tp_size, p.nodes))
                  for r in range(p.tp_size)}
        p_ranks = {
            r: lau.start("P", r, prefill_main, msgspec.msgpack.encode(vm.PrefillSpec(
                engine_id=p.engine_id, tp_rank=r, tp_size=p.tp_size, num_blocks=p.blocks()[r],
                device_id=p.device_id(r), device=opts.device, host=p_host[r],
                geometry=plan.p_geometry, kv_cache_layout=p.kv_cache_layout,
                inject=opts.inject, memory_layout=p.backend_layout, pp_size=p.pp_size)))
            for r in range(p.tp_size)
        }
        d_ranks = {
            r: lau.start("D", r, decode_main, msgspec.msgpack.encode(vm.DecodeSpec(
                engine_id=d.engine_id, tp_rank=r, tp_size=d.tp_size, num_blocks=d.blocks()[r],
                device_id=d.device_id(r), device=opts.device, geometry=plan.d_geometry,
                kv_cache_layout=d.kv_cache_layout, releases=d_rels,
                p_host=p_host[0], p_engine_tag=engine_tag(plan.kv_owner or p.engine_id), remote_engine_id=sc.remote_engine_id(),
                params_tp_size=sc.params_tp_size(), hang_timeout_ms=opts.hang_timeout_ms,
                transfer=opts.transfer, requests=requests, pp_size=d.pp_size, p_pp_size=p.pp_size,
                memory_layout=d.backend_layout,
                permute_local_kv=d.enable_permute_local_kv)))
            for r in range(d.tp_size)
        }
        ready = orc.await_ready(lau, [*p_ranks.values(), *d_ranks.values()], opts.start_timeout_s, opts.progress)
        values = {r: ready[orc.RankId("P", r)][1] for r in p_ranks}
        drive.release_served(reserved, ports)
        # (a Ray run's nodes are other machines: nothing of theirs is held here)
        listeners = drive.reserve_head_node(held, p_host, ports.listeners) if p.nodes > 1 else ports.listeners
        for r, rank in p_ranks.items():
            rank.send(vm.Serve(listeners[r], values))
        bound = drive.await_serving(lau, p_ranks, listeners, opts.start_timeout_s, opts.progress)
        hold = lau.hold_host or p.host
        go = drive.hold_the_rest(held, hold, ports.contacted, ports.fixed, bound, reserved)
        go = msgspec.structs.replace(go, host=hold, hosts={
            ls.port: p_host[r] for r, specs in ports.listeners.items() for ls in specs})
        t_ready = time.perf_counter()
        orc.send_all(d_ranks.values(), go)
        results, p_final = drive.route_tags(lau, p_ranks, d_ranks, opts.run_timeout_s, harness,
                                          expected_dead=opts.inject.die_p, tick=opts.progress)
    t_end = time.perf_counter()
    timings = Timings(start_s=t_ready - t0, run_s=t_end - t_ready, total_s=t_end - t0,
                      setup_ms={str(rid): ms for rid, (ms, _v) in ready.items()})
    nodes = {f"{role} rank {r}": pl.node for (role, r), pl in where.items()}
    if p.nodes > 1:  # a P spanning nodes here: name each P rank's node and the address it listened on
        nodes.update({f"P rank {r}": f"{nodes[f'P rank {r}']} node {multinode.rank_node(r, p.tp_size, p.nodes)} "
                                     f"({p_host[r]})" for r in range(p.tp_size)})
    return RunResult(sc, plan.releases, opts.device, requests, results, p_final, harness, timings, nodes)



def _serve_idle(plan: Plan) -> tuple[dict[int, vm.PrefillFinal], dict[str, str], list[str]]:
    """A prefill DP rank no decode DP rank reaches: its TP group starts (KV cache, NIXL agent), opens its side
    channel at its own port and serves nobody until stopped. (finals, nodes, harness lines)."""
    assert plan.ports is not None
    opts, p = plan.options, plan.scenario.prefill
    harness: list[str] = []
    with launcher(plan.ray, opts.start_timeout_s) as lau, ExitStack() as held:
        reserved = drive.reserve_layout(held, p.host, plan.ports, contacted=False) \
            if plan.ports.fixed and plan.ray is None else {}
        where = lau.place([("P", r) for r in range(p.tp_size)], gpu=opts.device == "cuda")
        p_host = {r: where["P", r].host or p.host for r in range(p.tp_size)}
        p_ranks = {
            r: lau.start("P", r, prefill_main, msgspec.msgpack.encode(vm.PrefillSpec(
                engine_id=p.engine_id, tp_rank=r, tp_size=p.tp_size, num_blocks=p.blocks()[r],
                device_id=p.device_id(r), device=opts.device, host=p_host[r], geometry=plan.p_geometry,
                kv_cache_layout=p.kv_cache_layout, inject=vm.Inject(), memory_layout=p.backend_layout)))
            for r in range(p.tp_size)
        }
        ready = orc.await_ready(lau, list(p_ranks.values()), opts.start_timeout_s, opts.progress)
        values = {r: ready[orc.RankId("P", r)][1] for r in p_ranks}
        drive.release_served(reserved, plan.ports)
        for r, rank in p_ranks.items():
            rank.send(vm.Serve(plan.ports.listeners[r], values))
        drive.await_serving(lau, p_ranks, plan.ports.listeners, opts.start_timeout_s, opts.progress)
        orc.send_all(p_ranks.values(), m.Stop())
        finals: dict[int, vm.PrefillFinal] = {}
        for rank, msg in lau.events(list(p_ranks.values()), time.monotonic() + opts.run_timeout_s):
            if isinstance(msg, vm.PrefillFinal):
                finals[rank.tp_rank] = msg
                rank.done = True
            elif msg is None and rank.tp_rank not in finals:
                harness.append(f"{rank.id} died after start-up: it {rank.ended()}")
    return finals, {f"P rank {r}": pl.node for (_role, r), pl in where.items()}, harness


def _run_dp(plan: Plan) -> RunResult:
    """Data parallel: each decode DP rank's TP group with the TP group that answers at the port it contacts, one
    pair after the other (real ranks, side channels and NIXL agents each time), merged with flat rank indices:
    decode DP rank j's TP rank r is D rank j * tp_size + r, likewise for P."""
    sc = plan.scenario
    d_tp, p_tp = sc.decode.tp_size, sc.prefill.tp_size
    decode: dict[int, vm.DecodeResult] = {}
    prefill: dict[int, vm.PrefillFinal] = {}
    harness: list[str] = []
    nodes: dict[str, str] = {}
    requests: list[vm.Req] = []
    start = run_s = total = 0.0
    setup: dict[str, float] = {}
    for g in plan.dp:
        res = run(msgspec.structs.replace(g.plan, options=plan.options))
        rt = g.route
        requests = requests or res.requests
        decode.update({rt.d_dp * d_tp + r: v for r, v in res.decode.items()})
        if rt.reached_side == "prefill":
            prefill.update({rt.reached * p_tp + r: v for r, v in res.prefill.items()})
        harness += [f"decode DP rank {rt.d_dp}: {h}" for h in res.harness]
        for label, node in res.nodes.items():
            role, _, idx = label.rpartition(" ")
            off = rt.d_dp * d_tp if role == "D rank" else rt.reached * p_tp
            nodes[f"{role} {off + int(idx)}"] = node
        start, run_s, total = start + res.timings.start_s, run_s + res.timings.run_s, total + res.timings.total_s
        setup.update({f"DP{rt.d_dp} {k}": ms for k, ms in res.timings.setup_ms.items()})
    for g in plan.dp_idle:  # every prefill DP rank runs, reached or not
        k = g.route.reached
        finals, where, lines = _serve_idle(msgspec.structs.replace(g.plan, options=plan.options))
        prefill.update({k * p_tp + r: v for r, v in finals.items()})
        nodes.update({f"P rank {k * p_tp + int(label.rpartition(' ')[2])}": node for label, node in where.items()})
        harness += [f"prefill DP rank {k} (reached by no decode DP rank): {h}" for h in lines]
    return RunResult(sc, plan.releases, plan.options.device, requests, decode, prefill, harness,
                     Timings(start_s=start, run_s=run_s, total_s=total, setup_ms=setup), nodes)
