"""A real P/D transfer on this node: transfer-bench's runner (pdcheck.bench.runner) with one small KV-shaped
row, a prefill and a decode rank forked from pdcheck's launcher, every block checked by coordinate (the
transfer proof), and the transport as UCX's own protocol tables in the decode rank's log name it."""

from __future__ import annotations

import time

import msgspec

from pdcheck.bench.plan import BenchConfig
from pdcheck.bench.transport import preset
from pdcheck.doctor.model import Check, check
from pdcheck.errors import HarnessError
from pdcheck.geometry import ModelShape

# Two layers of an 8-KV-head, 128-dim bf16 model, 16-token blocks, 1024 tokens per request: 8 MiB per request,
# four distinct requests; small enough for well under a second on two cores, large enough that CMA and TCP
# differ by an order of magnitude.
SHAPE = ModelShape("doctor", layers=2, kv_heads=8, head_dim=128)
BLOCK_TOKENS = 16
TOKENS = 1024
REQUESTS = 4


class Transfer(msgspec.Struct):
    """What one loopback transfer proved."""

    memory: str  # "host" or "gpu"
    bytes_per_request: int
    blocks_checked: int
    blocks_wrong: int
    first_wrong: str | None
    gbps: float
    p50_us: float
    data: list[str]  # UCX's protocol for the READ payload, e.g. "cma/memory (zero-copy)"
    notifications: list[str]  # what carried NIXL's notifications, e.g. "tcp/lo"
    ucx: str
    warnings: list[str]


def config(device: str, deadline_s: float) -> BenchConfig:
    return BenchConfig(shape=SHAPE, block_sizes=[BLOCK_TOKENS], tokens=[TOKENS], transport=preset("default"),
                       requests=REQUESTS, warmup=2, min_time=0.1, device=device, timeout=deadline_s)


def run(device: str, deadline_s: float) -> tuple[Transfer | None, Check]:
    """One transfer; a FAIL check (with the error) instead of raising when the ranks cannot move KV."""
    from pdcheck.bench.runner import run as bench_run

    memory = "host" if device == "cpu" else "gpu"
    name = f"loopback transfer ({memory} memory)"
    t0 = time.monotonic()
    try:
        out = bench_run(config(device, deadline_s))
    except HarnessError as exc:
        c = check(name, "FAIL", f"no KV moved: {exc}",
                  "read the NIXL status above; rerun with UCX_LOG_LEVEL=info to see UCX's own reason")
        c.seconds = round(time.monotonic() - t0, 3)
        return None, c
    row = out.rows[0]
    t = Transfer(memory, row.bytes, row.checked, row.wrong, row.first_wrong, row.gbps, row.p50_us,
                 out.transport.data, out.transport.notifications, out.env.ucx,
                 [w for w in out.warnings if "cache-hot" not in w and "other processes" not in w])
    c = verdict(name, t)
    c.seconds = round(time.monotonic() - t0, 3)
    return t, c


def verdict(name: str, t: Transfer) -> Check:
    data = ", ".join(t.data) or "unknown"
    notif = ", ".join(t.notifications) or "unknown"
    moved = (f"{t.blocks_checked} blocks checked, {t.gbps:.2f} GB/s, p50 {t.p50_us:.0f} µs; payload over "
             f"{data}, notifications over {notif} (UCX {t.ucx} protocol tables)")
    if t.blocks_wrong:
        return check(name, "FAIL", f"{t.blocks_wrong} of {t.blocks_checked} blocks arrived wrong ({t.first_wrong})",
                     "the transport corrupts or misroutes data: pin UCX_TLS to a known transport and report it")
    if not t.blocks_checked:
        return check(name, "FAIL", "no block was checked", "rerun; report it if it persists")
    if not t.data:
        return check(name, "WARN", f"{moved}; UCX printed no protocol table for the READ",
                     "unset UCX_PROTO_INFO (pdcheck sets it to y) so the transport can be named")
    if t.memory == "host" and any(d.startswith("tcp/") for d in t.data):
        return check(name, "WARN", f"{moved}: host memory on one node fell back to TCP (CMA unreachable: other "
                     "PID namespaces, ptrace restrictions, or UCX_TLS)",
                     "run prefill and decode in one PID namespace (hostPID, or one container) or allow ptrace; "
                     "check UCX_TLS includes cma")
    return check(name, "PASS", moved)
