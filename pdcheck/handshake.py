"""`pdcheck handshake`: plan the ranks of a scenario, run them, and collect a Report."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import numpy as np

from pdcheck import messages as m
from pdcheck import report as rp
from pdcheck.errors import HarnessError
from pdcheck.kvcache import engine_tag
from pdcheck.launcher import Launcher, Rank, launcher
from pdcheck.ranks import decode_main, prefill_main
from pdcheck.releases import CORRECTED
from pdcheck.releases.base import ReleaseModel
from pdcheck.scenario import Scenario
from pdcheck.wire import FORMATS

ERA_PORT_SPAN = 100  # several eras in one run: era k listens at base_port + 100*k


@dataclasses.dataclass(frozen=True)
class Options:
    device: str = "cpu"
    transfer: bool = True
    hang_timeout_ms: int = 3000
    start_timeout_s: float = 60.0
    run_timeout_s: float = 120.0
    inject: m.Inject = m.Inject()


def make_requests(sc: Scenario) -> list[m.Req]:
    """Seeded block tables. P's scheduler hands out ids below the smallest count of its ranks (vLLM uses
    min(num_blocks) logically), D's likewise; both sides of a request have the same number of blocks."""
    rng = np.random.default_rng(sc.transfer.seed)
    p_max, d_max = min(sc.prefill.blocks()), min(sc.decode.blocks())
    k = min(sc.transfer.blocks_per_request, p_max, d_max)
    return [
        m.Req(f"req-{i}", sorted(rng.choice(p_max, k, replace=False).tolist()),
              sorted(rng.choice(d_max, k, replace=False).tolist()))
        for i in range(sc.transfer.requests)
    ]


def _wires(releases: list[ReleaseModel]) -> list[str]:
    out: list[str] = []
    for r in releases:
        if r.wire not in out:
            out.append(r.wire)
    return out


def _prefill_port(sc: Scenario, wire_index: int, tp_rank: int, per_rank: bool) -> int:
    p = sc.prefill
    base = p.base_port + wire_index * ERA_PORT_SPAN + (p.dp_rank * p.tp_size if per_rank else p.dp_rank)
    return base + (tp_rank if per_rank else 0)


def run(sc: Scenario, releases: list[ReleaseModel], opts: Options) -> rp.Report:
    t0 = time.perf_counter()
    wires = _wires(releases)
    requests = make_requests(sc)
    p, d = sc.prefill, sc.decode
    harness: list[str] = []
    with launcher() as lau:
        p_ranks = {
            r: lau.start("P", r, prefill_main, msgspec.msgpack.encode(m.PrefillSpec(
                engine_id=p.engine_id, tp_rank=r, tp_size=p.tp_size, num_blocks=p.blocks()[r],
                device_id=p.device_id(r), device=opts.device, host=p.host,
                ports=[_prefill_port(sc, i, r, FORMATS[w].port_scheme == "per_rank") for i, w in enumerate(wires)],
                wires=wires,
                geometry=dataclasses.asdict(p.geometry()), kv_cache_layout=p.kv_cache_layout,
                compat_hash=None, inject=opts.inject)))
            for r in range(p.tp_size)
        }
        d_ranks = {
            r: lau.start("D", r, decode_main, msgspec.msgpack.encode(m.DecodeSpec(
                engine_id=d.engine_id, tp_rank=r, tp_size=d.tp_size, num_blocks=d.blocks()[r],
                device_id=d.device_id(r), device=opts.device, geometry=dataclasses.asdict(d.geometry()),
                kv_cache_layout=d.kv_cache_layout, releases=[x.name for x in releases] + [CORRECTED.name],
                p_host=p.host, p_base_ports={w: _prefill_port(sc, i, 0, FORMATS[w].port_scheme == "per_rank") for i, w in enumerate(wires)},
                p_wire=wires[-1],  # corrected reads the newest era modelled (the most fields)
                p_engine_tag=engine_tag(p.engine_id), remote_engine_id=sc.remote_engine_id(),
                params_tp_size=sc.params_tp_size(), hang_timeout_ms=opts.hang_timeout_ms,
                transfer=opts.transfer, requests=requests)))
            for r in range(d.tp_size)
        }
        ready = _await_ready(lau, [*p_ranks.values(), *d_ranks.values()], opts.start_timeout_s)
        t_ready = time.perf_counter()
        for rank in d_ranks.values():
            rank.send(m.Go())
        results, p_final = _collect(lau, p_ranks, d_ranks, opts, harness)
    t_end = time.perf_counter()
    timings = rp.Timings(start_s=t_ready - t0, run_s=t_end - t_ready, total_s=t_end - t0,
                         setup_ms={lbl: ms for lbl, ms in ready.items()})
    return rp.build(sc, releases, opts.device, requests, results, p_final, harness, timings, opts.transfer)


def _await_ready(lau: Launcher, ranks: list[Rank], timeout_s: float) -> dict[str, float]:
    pending = {r.label: r for r in ranks}
    setup: dict[str, float] = {}
    for rank, msg in lau.events(ranks, time.monotonic() + timeout_s):
        if isinstance(msg, m.Ready):
            setup[rank.label] = msg.setup_ms
            pending.pop(rank.label, None)
            if not pending:
                return setup
        elif isinstance(msg, m.Failed):
            raise HarnessError(f"{rank.label} failed to start: {msg.error}")
        elif msg is None:
            raise HarnessError(f"{rank.label} died during start-up (exit code {rank.proc.exitcode})")
    raise HarnessError(f"{', '.join(sorted(pending))} not ready after {timeout_s:g} s")


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
    for rank, msg in lau.events(everyone, deadline):
        if msg is None:
            if rank.role == "D" and rank.tp_rank not in results:
                harness.append(f"{rank.label} died before reporting (exit code {rank.proc.exitcode})")
            elif rank.role == "P" and rank.tp_rank not in finals:
                harness.append(f"{rank.label} died (exit code {rank.proc.exitcode})")
            # A D rank waiting for tags from a dead P gets an answer so it can report the failed READ.
            for gid, (p_rank, d_rank, ticket) in list(owner.items()):
                if rank.role == "P" and p_rank == rank.tp_rank:
                    d_rank.send(m.Tagged(ticket))
                    owner.pop(gid)
        elif isinstance(msg, m.TagReq):
            target = p_ranks.get(msg.p_rank)
            if target is None or target.done:
                rank.send(m.Tagged(msg.ticket))
            else:
                next_ticket += 1
                owner[next_ticket] = (msg.p_rank, rank, msg.ticket)
                target.send(m.TagReq(next_ticket, msg.p_rank, msg.blocks))
        elif isinstance(msg, m.Tagged):
            entry = owner.pop(msg.ticket, None)
            if entry is not None:
                entry[1].send(m.Tagged(entry[2]))
        elif isinstance(msg, m.DecodeResult):
            results[rank.tp_rank] = msg
            rank.done = True
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
