"""Drives one transfer-bench run: plan, start ranks, sweep the rows, stop, diagnose, summarise."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np

import pdcheck
from pdcheck import lifecycle
from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.bench import envinfo, measure, schema, tables
from pdcheck.bench import messages as bm
from pdcheck.bench.plan import BenchConfig, Plan, make_plan
from pdcheck.bench.rank import bench_main
from pdcheck.bench.transport import diagnose, parse_proto_info, warnings_for
from pdcheck.errors import HarnessError, RankFailed, RankTimeout
from pdcheck.launcher import Launcher, Rank, launcher
from pdcheck.placement import RankId

ProgressFn = Callable[[int, int, str], None]
M = TypeVar("M")
FOREIGN_LIMIT = 0.15  # CPU-s/s used by other processes during a row before it counts as disturbed

MEMCPY_METHOD = {
    "cpu": "numpy.copyto, 1 thread, same bytes as the row's transfer, rotating over the row's working set",
    "cuda": "torch copy_ inside the decode GPU (device to device), same bytes as the row's transfer",
}
WIRE_METHOD = "the same bytes as ONE descriptor per READ over the same transport, rotating over the pools"


@dataclass
class Outcome:
    config: schema.Config
    env: schema.Env
    transport: schema.Transport
    rows: list[schema.Row]
    ceilings: schema.Ceilings
    warnings: list[str]


def run(cfg: BenchConfig, progress: ProgressFn | None = None) -> Outcome:
    plan = make_plan(cfg)  # all bad input surfaces here, before any process exists
    everyone = [*orc.ids("P", cfg.ptp), *orc.ids("D", cfg.dtp)]
    if cfg.ray is None:
        cores, pin_note = assign_cores(cfg.ptp, cfg.dtp, cfg.pin)
    else:  # this host's cores say nothing about a Ray node's: leave placement within a node to Ray
        cores, pin_note = {rid: [] for rid in everyone}, "--ray (each rank's Ray node owns its cores)"
    warnings: list[str] = []
    for k, v in cfg.transport.env.items():
        if k in os.environ and os.environ[k] != v:
            warnings.append(f"{k}={os.environ[k]} from the environment replaced by --transport "
                            f"{cfg.transport.name} ({k}={v})")
    ucx = dict(cfg.transport.env)
    if "UCX_PROTO_INFO" not in os.environ:
        ucx["UCX_PROTO_INFO"] = "y"  # the protocol tables we parse for the transport diagnosis
    env = {**os.environ, **ucx}
    log_dir = cfg.log_dir or lifecycle.scratch_dir("pdcheck-bench-")
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with launcher(cfg.ray, cfg.timeout) as lau:
            rows, ready, target_cpu = _drive(cfg, plan, Ranks(lau, log_dir), cores, ucx, progress)
        # Each rank's fd 1/2 went to its log (a Ray rank's comes back when the launcher closes): UCX's tables
        # of every decode rank.
        proto = "\n".join(_read(_log(log_dir, rid)) for rid in everyone if rid.role == "D")
    finally:
        if cfg.log_dir is None:
            lifecycle.remove_scratch(log_dir)

    diag = diagnose(parse_proto_info(proto))
    pinning = {rid.short: ready[rid].cores for rid in everyone}
    pinned = cfg.pin and all(cores[rid] for rid in everyone)
    error_mode = cfg.effective_error_mode
    warnings += warnings_for(diag, preset_name=cfg.transport.name, error_mode=error_mode, device=cfg.device,
                             progress_thread=cfg.progress_thread, target_busy=cfg.target_busy, target_cpu=target_cpu, pinned=pinned,
                             pin_note=pin_note)
    warnings += _row_warnings(rows, plan.llc, cfg)
    costs = list(cfg.transport.costs)
    if error_mode == "none" and not any("peer-failure" in c for c in costs):
        costs.insert(0, "no peer-failure detection: error mode none means a dead peer hangs transfers")
    transport = schema.Transport(
        preset=cfg.transport.name, summary=cfg.transport.summary, data=diag.data, notifications=diag.notif,
        error_mode=error_mode, progress_thread=cfg.progress_thread,
        target_progress="busy-polled (get_new_notifs loop, like vLLM's progress thread)" if cfg.target_busy
        else "polled every 1 ms",
        costs=costs,
    )
    first = next(iter(ready.values()))
    envs = schema.Env(
        pdcheck=pdcheck.__version__, nixl=envinfo.version_of("nixl-cu13"), ucx=first.ucx_version,
        numpy=np.__version__, ucx_env=envinfo.ucx_env(env),
        transports=sorted(set(diag.data_transports) | set(diag.notif_transports)),
        pinning=pinning, pin_note=pin_note or ("pinned, one core per rank" if pinned else "not pinned"),
        host=envinfo.host(plan.llc),
    )
    ceilings = schema.Ceilings(
        memcpy_gbps=statistics.median(r.memcpy_gbps for r in rows),
        wire_gbps=statistics.median(r.wire_gbps for r in rows),
        memcpy_method=MEMCPY_METHOD[cfg.device], wire_method=WIRE_METHOD, bytes=[r.bytes for r in rows],
    )
    return Outcome(_config(cfg), envs, transport, rows, ceilings, warnings)


def _log(log_dir: Path, rid: RankId) -> Path:
    return log_dir / f"{rid.short}.log"


def assign_cores(ptp: int, dtp: int, pin: bool) -> tuple[dict[RankId, list[int]], str]:
    """Cores per rank, and a note when the machine cannot give every rank its own core."""
    labels_p = orc.ids("P", ptp)
    labels_d = orc.ids("D", dtp)
    if not pin:
        return {lbl: [] for lbl in labels_p + labels_d}, "--no-pin"
    avail = sorted(os.sched_getaffinity(0))
    if len(avail) < 2:
        return {lbl: [] for lbl in labels_p + labels_d}, "only one usable core: prefill and decode share it"
    if len(avail) >= ptp + dtp:
        cores = {lbl: [avail[i]] for i, lbl in enumerate(labels_p + labels_d)}
        return cores, ""
    # Fewer cores than ranks: keep the two roles apart, share cores within a role.
    k = max(1, min(len(avail) - 1, round(len(avail) * ptp / (ptp + dtp))))
    cores = {lbl: [avail[i % k]] for i, lbl in enumerate(labels_p)}
    cores.update({lbl: [avail[k + i % (len(avail) - k)]] for i, lbl in enumerate(labels_d)})
    return cores, f"{ptp + dtp} ranks on {len(avail)} cores: ranks of one role share cores (oversubscribed)"


class Ranks:
    """The bench's ranks on pdcheck's launcher (the one that starts handshake and serve ranks, locally or on Ray):
    start by rank id, send to a group, and gather one reply per rank (pdcheck.orchestrate) with the bench's
    fault texts."""

    def __init__(self, lau: Launcher, log_dir: Path) -> None:
        self.lau, self.log_dir = lau, log_dir
        self.by_id: dict[RankId, Rank] = {}

    def start(self, rid: RankId, spec: bm.BenchSpec) -> None:
        self.by_id[rid] = self.lau.start(rid.role, rid.index, bench_main, msgspec.msgpack.encode(spec),
                                         log=str(_log(self.log_dir, rid)))

    def pids(self) -> list[int]:
        """The ranks running on this host (a Ray rank on another node has none here)."""
        return [r.pid for r in self.by_id.values() if r.pid is not None]

    def send(self, ids: list[RankId], msg: m.Msg) -> None:
        orc.send_all((self.by_id[i] for i in ids), msg)

    def gather(self, ids: list[RankId], kind: type[M], timeout: float, what: str) -> dict[RankId, M]:
        # Every rank's pipe and sentinel, not only the awaited ones: a P rank that dies while D ranks measure
        # is reported now, not when the D ranks' READs time out.
        got = orc.gather(self.lau, [self.by_id[i] for i in ids], kind, timeout, _Faults(self, what, timeout),
                         watch=list(self.by_id.values()), ended_ok=kind is bm.Bye)
        return {rid: msg for rid, (_rank, msg) in got.items()}

    def died(self, rank: Rank, what: str) -> str:
        code = rank.reap(0.5)  # its exit status, for how it ended
        # An exit code: the rank's own last words say why. A signal: its log ends wherever UCX last printed.
        why = _last_line(_log(self.log_dir, rank.id)) if code is not None and code > 0 else ""
        return f"rank {rank.id.short} {rank.ended()} while {what}" + (f": {why}" if why else "")


@dataclass(frozen=True)
class _Faults:
    """transfer-bench's words for a rank that let a step down (orchestrate.Faults)."""

    ranks: Ranks
    what: str
    timeout: float

    def failed(self, rank: Rank, msg: m.Failed) -> Exception:
        # A READ from a rank that was killed fails on the reader first: name the cause, then the symptom.
        # The reader may hear of it before the killed rank's exit completes: give the others a moment.
        others = [r for r in self.ranks.by_id.values() if r is not rank and not r.done]
        dead = next((r for r, got in self.ranks.lau.events(others, time.monotonic() + 0.5) if got is None), None)
        failed = f"rank {rank.id.short} failed while {self.what}: {msg.error}"
        return RankFailed(f"{self.ranks.died(dead, self.what)} ({failed})" if dead else failed)

    def died(self, rank: Rank) -> Exception:
        return RankFailed(self.ranks.died(rank, self.what))

    def late(self, pending: list[RankId]) -> Exception:
        return RankTimeout(f"rank(s) {', '.join(sorted(r.short for r in pending))} did not answer within "
                           f"{self.timeout:g} s while {self.what} (raise --timeout for very large rows)")

    def stray(self, rank: Rank, msg: m.Msg) -> Exception | None:
        return HarnessError(f"rank {rank.id.short} sent {type(msg).__name__} while {self.what}")


def _read(path: Path) -> str:
    """A rank's log; empty when it never came back (a Ray actor lost with its node)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in _read(path).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _drive(cfg: BenchConfig, plan: Plan, ranks: Ranks, cores: dict[RankId, list[int]], ucx: dict[str, str],
           progress: ProgressFn | None) -> tuple[list[schema.Row], dict[RankId, bm.BenchReady], float | None]:
    t = cfg.timeout
    ps, ds = orc.ids("P", cfg.ptp), orc.ids("D", cfg.dtp)
    everyone = [*ps, *ds]
    where = ranks.lau.place([(r.role, r.index) for r in everyone], gpu=cfg.device == "cuda")
    for rid in everyone:
        is_p = rid.role == "P"
        host = where[rid.role, rid.index].host
        ranks.start(rid, bm.BenchSpec(
            role=rid.role, tp_rank=rid.index, agent_name=f"pdcheck-{rid.short}",
            arena_bytes=(plan.pool_p if is_p else plan.pool_d)[rid.index], device=cfg.device,
            # A Ray actor sees only the one GPU Ray gave it.
            gpu=0 if host is not None else rid.index if is_p else cfg.ptp + rid.index, cores=cores[rid],
            error_mode=cfg.error_mode or cfg.transport.error_mode, progress_thread=cfg.progress_thread,
            target_busy=cfg.target_busy, ucx_env=ucx, shape=cfg.shape, ptp=cfg.ptp, dtp=cfg.dtp, iters=cfg.iters,
            warmup=cfg.warmup, min_time=cfg.min_time, notif=cfg.notif, host=host or "127.0.0.1",
        ))
    ready = ranks.gather(everyone, bm.BenchReady, t, "creating agents and registering memory")
    peers = [bm.PeerInfo(rid.index, r.agent_name, r.metadata, r.addr, r.dev) for rid, r in ready.items()
             if rid.role == "P"]
    ranks.send(ds, bm.Peers(peers))
    ranks.gather(ds, m.Ack, t, "loading prefill metadata")

    rows: list[schema.Row] = []
    target_cpu: list[float] = []
    meter = envinfo.ForeignCpu([os.getpid(), *ranks.pids()])
    for row in plan.rows:
        what = f"row {row.label()}"
        msg = bm.Row(row.index, row.block_tokens, row.tokens, row.blocks, row.requests, row.run_length,
                    row.num_blocks, tables.table_bytes(row.tables_p), tables.table_bytes(row.tables_d),
                    -1 if cfg.corrupt is None else cfg.corrupt)
        ranks.send(ps, msg)
        filled = ranks.gather(ps, bm.Filled, t, f"filling {what}")
        ranks.send(ds, msg)
        ranks.gather(ds, m.Armed, t, f"preparing {what}")
        ranks.send(ps, bm.Poll())
        before = ranks.gather(ps, bm.Stats, t, f"polling {what}")
        meter.restart()
        ranks.send(ds, bm.Measure())
        results = ranks.gather(ds, bm.RankRow, t, f"measuring {what}")
        foreign = meter.read()
        ranks.send(ps, bm.Poll())
        after = ranks.gather(ps, bm.Stats, t, f"polling {what}")
        cpu = sum((after[p].cpu_s - before[p].cpu_s) / max(1e-9, after[p].wall_s - before[p].wall_s) for p in ps)
        target_cpu.append(cpu)
        fill_ms = max(f.fill_ms for f in filled.values())
        rows.append(aggregate(cfg, row, [results[d] for d in ds], cpu, fill_ms, plan.llc, foreign))
        if progress:
            progress(len(rows), len(plan.rows), row.label())
    ranks.send(everyone, m.Stop())
    ranks.gather(everyone, bm.Bye, t, "stopping")
    return rows, ready, statistics.median(target_cpu) if target_cpu else None


def aggregate(cfg: BenchConfig, row: tables.RowPlan, rr: list[bm.RankRow], target_cpu: float | None,
              fill_ms: float, llc: int, foreign_cpu: float = 0.0) -> schema.Row:
    """Decode ranks pull at the same time: sum their bytes and GB/s, pool their latencies."""
    lat = np.concatenate([np.frombuffer(r.lat_ns, dtype="<i8") for r in rr])
    gbps = sum(r.nbytes * r.iters / r.wall_ns for r in rr)
    memcpy = sum(statistics.mean(c.gbps for c in r.memcpy) for r in rr)
    wire = sum(r.wire.gbps for r in rr)
    merged = None if any(not r.desc_merged for r in rr) else round(sum(statistics.mean(r.desc_merged) for r in rr))
    ws = min(r.working_set for r in rr)
    first = next((r.first_wrong for r in rr if r.first_wrong), None)
    return schema.Row(
        index=row.index, label=row.label(), block_tokens=row.block_tokens, tokens=row.tokens, blocks=row.blocks,
        regions=cfg.shape.regions, requests=row.requests, run_length=row.run_length,
        block_bytes=rr[0].block_bytes, bytes=sum(r.nbytes for r in rr), desc_count=sum(r.desc_count for r in rr),
        desc_count_merged=merged, desc_runs=round(sum(r.desc_runs for r in rr)), iters=min(r.iters for r in rr),
        gbps=gbps, **measure.summarize(lat),
        wrong=sum(r.wrong for r in rr), checked=sum(r.checked for r in rr),
        first_wrong=f"decode rank {next(r.rank for r in rr if r.first_wrong)}: {first}" if first else None,
        memcpy_gbps=memcpy, wire_gbps=wire, wire_p50_us=statistics.median(r.wire.p50_us for r in rr),
        wire_wrong=sum(r.wire.wrong for r in rr),
        pct_memcpy=100 * gbps / memcpy if memcpy else 0.0, pct_wire=100 * gbps / wire if wire else 0.0,
        working_set_bytes=ws, cache_hot=ws < 2 * llc, prep_ms=max(r.prep_ms for r in rr),
        make_us=max(r.make_us for r in rr), verify_ms=max(r.verify_ms for r in rr),
        cpu_initiator=statistics.mean(r.cpu_s / (r.wall_ns / 1e9) for r in rr), cpu_target=target_cpu,
        fill_ms=fill_ms, foreign_cpu=foreign_cpu,
    )


def _row_warnings(rows: list[schema.Row], llc: int, cfg: BenchConfig) -> list[str]:
    out = []
    hot = [r.label for r in rows if r.cache_hot]
    if hot:
        out.append(f"cache-hot rows ({', '.join(hot)}): working set under 2x the {llc >> 20} MiB LLC, bandwidth "
                   "partly measures cache; raise --requests or --tokens")
    if any(r.desc_count_merged is None for r in rows):
        out.append("NIXL telemetry gave no descCount: merged descriptor counts are unknown")
    busy = [f"{r.label} {r.foreign_cpu:.2f}" for r in rows if r.foreign_cpu > FOREIGN_LIMIT]
    if busy:
        out.append(f"other processes used CPU while rows were measured ({', '.join(busy)} CPU-s/s): those "
                   "figures are disturbed; rerun on a quiet host")
    bad_wire = [r.label for r in rows if r.wire_wrong]
    if bad_wire:
        out.append(f"the one-descriptor wire-ceiling READ delivered wrong bytes ({', '.join(bad_wire)})")
    if cfg.corrupt is not None:
        out.append(f"self-test: descriptor {cfg.corrupt} of request 0 was corrupted at the source on purpose")
    return out


def _config(cfg: BenchConfig) -> schema.Config:
    s = cfg.shape
    return schema.Config(
        model=s.name, layers=s.layers, kv_heads=s.kv_heads, head_dim=s.head_dim, dtype=s.dtype, mla=s.mla,
        prefill_tp=cfg.ptp, decode_tp=cfg.dtp, block_sizes=cfg.block_sizes, tokens=cfg.tokens,
        run_length=cfg.run_length, requests=cfg.requests, seed=cfg.seed, iters=cfg.iters, warmup=cfg.warmup,
        min_time_s=cfg.min_time, device=cfg.device, notif=cfg.notif,
    )
