"""`pdcheck handshake`: plan the ranks of a scenario, run them, and collect a Report."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack

import msgspec
import numpy as np

from pdcheck import messages as m
from pdcheck import releases
from pdcheck import report as rp
from pdcheck.errors import BadInput, HarnessError
from pdcheck.geometry import Geometry
from pdcheck.kvcache import engine_tag
from pdcheck.launcher import Launcher, Rank, launcher
from pdcheck.ranks import decode_main, prefill_main
from pdcheck.releases import CORRECTED, resolve
from pdcheck.releases.base import ReleaseModel
from pdcheck.scenario import Instance, Scenario
from pdcheck.sidechannel import hold_silent
from pdcheck.wire import FORMATS

ERA_PORT_SPAN = 100  # several listener profiles in one run: profile k listens from base_port + 100*k
LAYOUT_BASE = 5557  # vLLM's default side-channel port: the layout D ranks address when no base_port is set


def kv_geometry(inst: Instance, run_releases: list[ReleaseModel]) -> Geometry:
    """The geometry a fake rank registers: FlashAttention's KV layout of the instance's own release (`vllm` in
    its table), else of the one release run. A matrix of several releases shares one KV cache per process, so it
    keeps one layout on both sides (the split K/V regions), which leaves the checks' ratios unchanged."""
    return releases.registered_geometry(inst.vllm, inst.geometry(), run_releases)


@dataclasses.dataclass(frozen=True)
class Options:
    device: str = "cpu"
    transfer: bool = True
    hang_timeout_ms: int = 3000
    start_timeout_s: float = 60.0
    run_timeout_s: float = 120.0
    inject: m.Inject = m.Inject()
    progress: Callable[[str, int, int], None] | None = None  # (stage, done, total), e.g. pdcheck.progress
    prefill_endpoint: tuple[str, int] | None = None  # a live P (pdcheck.live): no fake P is started
    prefill_tp_given: bool = True  # live P: prefill.tp_size was named (else probed where that is safe)
    ray: str | None = None  # a Ray cluster address ('auto': this node's): ranks become Ray actors (raylaunch)


def make_requests(sc: Scenario, p_limit: int | None = None) -> list[m.Req]:
    """Seeded block tables. P's scheduler hands out ids below the smallest count of its ranks (vLLM uses
    min(num_blocks) logically), D's likewise; both sides of a request have the same number of blocks.
    p_limit: remote ids stay below it (a live `pdcheck serve` P tags only its first blocks)."""
    rng = np.random.default_rng(sc.transfer.seed)
    p_max, d_max = min(sc.prefill.blocks()), min(sc.decode.blocks())
    if p_limit is not None:
        p_max = min(p_max, p_limit)
    k = min(sc.transfer.blocks_per_request, p_max, d_max)
    return [
        m.Req(f"req-{i}", sorted(rng.choice(p_max, k, replace=False).tolist()),
              sorted(rng.choice(d_max, k, replace=False).tolist()))
        for i in range(sc.transfer.requests)
    ]


def compat_hash_for(release: ReleaseModel, inst: Instance) -> str | None:
    """What an instance of `release` puts on the wire (G/H) or checks against; None before 0.13."""
    return releases.compat_hash_for(release, inst.geometry(), inst.model)


@dataclasses.dataclass(frozen=True)
class Profile:
    """What P serves for one modelled release: its wire era and hash, on its own base port."""

    wire: str
    compat_hash: str | None
    base_port: int  # A-E: rank r listens on base + dp*tp + r; F-H: P rank 0 listens on base + dp


@dataclasses.dataclass(frozen=True)
class PortPlan:
    """Side-channel ports in vLLM's layout (what a modelled release computes and contacts), and how this run
    binds them. Default: every listener on a port the OS picks, so parallel runs never collide, and D ranks
    are told the real port for each layout port. With an explicit prefill base_port the layout ports are
    bound as they are. Either way every layout port a release may contact is held by pdcheck: the ones the
    fake P does not serve are held silent (accepting, never answering), so the release's hang shows and no
    other process on the machine can answer a D rank."""

    listeners: dict[int, list[m.ListenerSpec]]  # P rank -> its listeners (layout port, bind port)
    contacted: list[int]  # layout ports some release of this run may contact
    fixed: bool  # explicit base_port: bind the layout ports themselves


def layout_base(wire: str, base: int, dp_rank: int, tp_size: int) -> int:
    """Where a P of DP rank `dp_rank` listens in vLLM's layout: per-worker eras (A-E) put its TP rank r at the
    result + r, the scheduler eras (F-H) one port per DP rank."""
    return base + (dp_rank * tp_size if FORMATS[wire].port_scheme == "per_rank" else dp_rank)


def _d_base(sc: Scenario, r: ReleaseModel, prof: Profile) -> int:
    wire = r.wire if r is not CORRECTED else prof.wire
    return layout_base(wire, prof.base_port, sc.prefill.dp_rank, sc.prefill.tp_size)


def plan_ports(sc: Scenario, releases: list[ReleaseModel], where: str = "") -> PortPlan:
    """Lay out every side-channel port of the run; BadInput if the layout leaves 1..65535 or overlaps.
    Runs before any process starts."""
    profiles = plan_profiles(sc, releases)
    fixed = sc.prefill.base_port is not None
    listeners = {r: _listeners(sc, profiles, r, fixed) for r in range(sc.prefill.tp_size)}
    served = [ls.port for specs in listeners.values() for ls in specs]
    where = where or sc.source or "command line"
    if len(set(served)) != len(served):
        raise BadInput(f"{where}: prefill.dp_rank {sc.prefill.dp_rank} x tp_size {sc.prefill.tp_size}: the side-channel "
                       f"listeners of different releases would share ports (keep dp_rank * tp_size below "
                       f"{ERA_PORT_SPAN - sc.prefill.tp_size})")
    n = max(sc.prefill.tp_size, sc.decode.tp_size, sc.params_tp_size())
    contacted: set[int] = set()
    for r in [*releases, CORRECTED]:
        base = _d_base(sc, r, profiles[r.name])
        contacted.update(base + i for i in range(n))  # per-rank eras; base itself covers per-DP eras
    top = max([*served, *contacted])
    if top > 65535:
        key = "prefill.base_port" if fixed else "prefill.dp_rank"
        raise BadInput(f"{where}: {key}: the side-channel layout of {len(set(profiles.values()))} wire profile(s) "
                       f"x {n} ranks needs ports up to {top}, past 65535 (lower it)")
    return PortPlan(listeners, sorted(contacted), fixed)


def plan_profiles(sc: Scenario, releases: list[ReleaseModel]) -> dict[str, Profile]:
    """Release name -> P profile. P speaks the modelled release, or its own (prefill.vllm) in cross-release pairs.
    Distinct profiles get distinct ports: profile k listens from base_port + 100*k."""
    p_own = resolve(sc.prefill.vllm) if sc.prefill.vllm else None
    p_base = sc.prefill.base_port if sc.prefill.base_port is not None else LAYOUT_BASE
    keys: list[tuple[str, str | None]] = []
    out: dict[str, Profile] = {}
    for r in [*releases, CORRECTED]:
        served = p_own or (releases[-1] if r is CORRECTED else r)
        key = (served.wire, compat_hash_for(served, sc.prefill))
        if key not in keys:
            keys.append(key)
        out[r.name] = Profile(key[0], key[1], p_base + ERA_PORT_SPAN * keys.index(key))
    return out


def _listeners(sc: Scenario, profiles: dict[str, Profile], tp_rank: int, fixed: bool) -> list[m.ListenerSpec]:
    p = sc.prefill
    seen: set[int] = set()
    out: list[m.ListenerSpec] = []
    for prof in profiles.values():
        if prof.base_port in seen:
            continue
        seen.add(prof.base_port)
        if FORMATS[prof.wire].port_scheme == "per_rank":
            port = prof.base_port + p.dp_rank * p.tp_size + tp_rank
            out.append(m.ListenerSpec(prof.wire, port, prof.compat_hash, [tp_rank], port if fixed else 0))
        elif tp_rank == 0:  # the scheduler's listener serves every TP rank of its DP rank
            port = prof.base_port + p.dp_rank
            out.append(m.ListenerSpec(prof.wire, port, prof.compat_hash, list(range(p.tp_size)), port if fixed else 0))
    return out


def run(sc: Scenario, releases: list[ReleaseModel], opts: Options) -> rp.Report:
    if opts.prefill_endpoint is not None:
        from pdcheck import live

        return live.run(sc, releases, opts, *opts.prefill_endpoint)
    t0 = time.perf_counter()
    profiles = plan_profiles(sc, releases)
    ports = plan_ports(sc, releases)
    requests = make_requests(sc)
    p, d = sc.prefill, sc.decode
    harness: list[str] = []

    def d_release(r: ReleaseModel) -> m.DRelease:
        prof = profiles[r.name]
        return m.DRelease(r.name, _d_base(sc, r, prof), prof.wire, compat_hash_for(r, d))

    # Once, not per rank: each release entry computes a compatibility hash.
    d_rels = [d_release(x) for x in [*releases, CORRECTED]]
    p_geom, d_geom = (dataclasses.asdict(kv_geometry(inst, releases)) for inst in (p, d))
    with launcher(opts.ray, opts.start_timeout_s) as lau, ExitStack() as held:
        where = lau.place([*(("P", r) for r in range(p.tp_size)), *(("D", r) for r in range(d.tp_size))],
                          gpu=opts.device == "cuda")
        # Each P rank listens on its own node's address (the scenario's host when all run here).
        p_host = {r: where["P", r].host or p.host for r in range(p.tp_size)}
        p_ranks = {
            r: lau.start("P", r, prefill_main, msgspec.msgpack.encode(m.PrefillSpec(
                engine_id=p.engine_id, tp_rank=r, tp_size=p.tp_size, num_blocks=p.blocks()[r],
                device_id=p.device_id(r), device=opts.device, host=p_host[r],
                geometry=p_geom, kv_cache_layout=p.kv_cache_layout,
                inject=opts.inject)))
            for r in range(p.tp_size)
        }
        d_ranks = {
            r: lau.start("D", r, decode_main, msgspec.msgpack.encode(m.DecodeSpec(
                engine_id=d.engine_id, tp_rank=r, tp_size=d.tp_size, num_blocks=d.blocks()[r],
                device_id=d.device_id(r), device=opts.device, geometry=d_geom,
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
    timings = rp.Timings(start_s=t_ready - t0, run_s=t_end - t_ready, total_s=t_end - t0,
                         setup_ms={lbl: ms for lbl, (ms, _v) in ready.items()})
    return rp.build(sc, releases, opts.device, requests, results, p_final, harness, timings,
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
