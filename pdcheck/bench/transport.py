"""Transport presets, the UCX_PROTO_INFO tables the ranks print, and what they mean for the numbers.

UCX 1.23 (bundled in the NIXL wheel) prints one table per endpoint and operation when a protocol is
first selected, e.g.

    [1796235679.86] [vm:5070 :0]   | D intra-node cfg#1                                              |
    [1796235679.86] [vm:5070 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
    ...                            | 0..inf | zero-copy | cma/memory |

The READ tables say which transport moved the KV; the plain active-message table says which one
carries NIXL notifications.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdcheck.errors import BadInput


@dataclass(frozen=True)
class Preset:
    name: str
    env: dict[str, str]
    error_mode: str | None  # None: NIXL's default, "peer"
    target_busy: bool  # the prefill rank busy-progresses its worker
    summary: str
    costs: tuple[str, ...] = ()


PRESETS: dict[str, Preset] = {
    "default": Preset(
        "default", {}, None, False,
        "UCX's own choice (host memory on one host: CMA zero-copy for data), error mode peer",
    ),
    # Measured on a 2-vCPU VM with THP-backed pools: CMA reaches ~0.85-0.9x of a one-thread memcpy for
    # blocks >= 1 MiB and is steady; the shared-memory emulation below swings between 0.3x and 1.0x.
    # UCX_CMA_SEG_SIZE=64m (default 512k) lets one process_vm_readv carry up to 16 whole blocks.
    "best": Preset(
        "best", {"UCX_CMA_SEG_SIZE": "64m"}, "none", False,
        "CMA zero-copy for data (UCX_CMA_SEG_SIZE=64m), ucx_error_handling_mode=none so notifications use "
        "shared memory, not tcp/lo",
        ("no peer-failure detection: error mode none means a dead peer hangs transfers instead of failing them",),
    ),
    "shm": Preset(
        # A deeper FIFO (2048 x 8 KiB segments in flight, default 256) absorbs the moments one side is
        # descheduled: on a 2-vCPU VM it lifted the median from ~0.45x to ~0.65x of memcpy.
        "shm", {"UCX_TLS": "posix,sysv,self", "UCX_SYSV_FIFO_SIZE": "2048", "UCX_POSIX_FIFO_SIZE": "2048"},
        "none", True,
        "shared-memory RMA emulation (UCX_TLS=posix,sysv,self, FIFO 2048, ucx_error_handling_mode=none), "
        "busy target",
        (
            "no peer-failure detection: error mode none means a dead peer hangs transfers instead of failing them",
            "one busy core on the prefill side: emulated RMA only moves while the target progresses its worker",
        ),
    ),
    "tcp": Preset(
        "tcp", {"UCX_TLS": "tcp,self"}, None, True,
        "TCP loopback (UCX_TLS=tcp,self): what host memory gets when CMA is unreachable (other PID namespace)",
        ("one busy core on the prefill side: RMA over TCP is emulated and needs the target to progress",),
    ),
}


def preset(name: str) -> Preset:
    p = PRESETS.get(name.lower())
    if p is None:
        raise BadInput(f"--transport {name!r} is not one of: {', '.join(PRESETS)}")
    return p


_PREFIX = re.compile(r"^\[[^\]]*\]\s+\[[^\]]*\]\s+")
_ENDPOINT = re.compile(r"^(?P<name>.+?)\s+(?P<scope>self|intra-node|inter-node)\s+cfg#(?P<cfg>\d+)$")
_TL = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\-]+)")


@dataclass
class ProtoTable:
    endpoint: str
    scope: str
    operation: str
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (range, protocol, config)

    def transports(self) -> list[str]:
        return sorted({f"{a}/{b}" for _, _, cfg in self.rows for a, b in _TL.findall(cfg)})


def parse_proto_info(text: str) -> list[ProtoTable]:
    """Tables from UCX_PROTO_INFO=y output (other lines, and malformed tables, are skipped)."""
    groups: list[list[str]] = []
    current: list[str] | None = None
    for raw in text.splitlines():
        m = _PREFIX.match(raw)
        if not m:
            current = None
            continue
        line = raw[m.end():].strip()
        if line.startswith("+"):
            current = []
            groups.append(current)
        elif line.startswith("|") and current is not None:
            current.append(line)
    tables: list[ProtoTable] = []
    i = 0
    while i + 2 < len(groups):
        head, cols, body = groups[i], groups[i + 1], groups[i + 2]
        ep = _ENDPOINT.match(_cells(head[0])[0]) if len(head) == 2 else None
        if ep and cols and _cells(cols[0])[0] == "Range":
            t = ProtoTable(ep["name"], ep["scope"], _cells(head[1])[0])
            for row in body:
                c = _cells(row)
                if len(c) >= 3:
                    t.rows.append((c[0], c[1], " ".join(c[2:])))
            tables.append(t)
            i += 3
        else:
            i += 1
    return tables


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@dataclass
class Diagnosis:
    data: list[str]  # e.g. "cma/memory (zero-copy)"
    notif: list[str]  # e.g. "tcp/lo"
    data_transports: list[str]
    notif_transports: list[str]


def diagnose(tables: list[ProtoTable]) -> Diagnosis:
    """Which transports carried READ data and notifications between ranks (loopback endpoints ignored)."""
    data: dict[str, None] = {}
    notif: dict[str, None] = {}
    data_tl: dict[str, None] = {}
    notif_tl: dict[str, None] = {}
    for t in tables:
        if t.scope == "self":
            continue
        if t.operation.startswith("remote memory read"):
            for _, proto, cfg in t.rows:
                data[f"{cfg} ({proto})"] = None
            data_tl.update(dict.fromkeys(t.transports()))
        elif re.match(r"active message by ucp_am_send\* from ", t.operation):
            for _, _, cfg in t.rows:
                notif[cfg] = None
            notif_tl.update(dict.fromkeys(t.transports()))
    return Diagnosis(list(data), list(notif), list(data_tl), list(notif_tl))


def warnings_for(diag: Diagnosis, *, preset_name: str, error_mode: str, device: str, progress_thread: bool,
                 target_busy: bool, target_cpu: float | None, pinned: bool, pin_note: str) -> list[str]:
    out: list[str] = []
    if not diag.data_transports:
        out.append("transport unknown: no UCX_PROTO_INFO table for READ was found in the decode rank's output")
    tcp_data = any(t.startswith("tcp/") for t in diag.data_transports)
    if tcp_data and device == "cpu":
        if preset_name == "tcp":
            out.append("data over TCP as asked (--transport tcp): expect 5-25x less than CMA or shared memory")
        else:
            out.append("host-to-host data fell back to TCP: CMA is unreachable (different PID namespaces, e.g. "
                       "separate containers, or ptrace restrictions); expect 5-25x less bandwidth")
    if tcp_data and device == "cuda":
        out.append("GPU data went over TCP: no CUDA-capable transport (cuda_ipc, cuda_copy, rc/ib) was usable; "
                   "check UCX_TLS includes cuda and UCX_NET_DEVICES")
    if any(t.startswith("tcp/") for t in diag.notif_transports) and error_mode == "peer" and not tcp_data:
        out.append("notifications go over tcp/lo: error mode peer excludes posix/sysv shared memory (no "
                   "peer-failure support), ~27 µs instead of ~5 µs per small READ with a notification")
    if any("software emulation" in d for d in diag.data):
        out.append("RMA is software-emulated (two copies through a FIFO): the target must progress; numbers are noisy")
    if progress_thread:
        spin = f" (prefill rank measured {target_cpu:.2f} CPU-s/s)" if target_cpu is not None else ""
        out.append(f"NIXL progress thread enabled: it busy-spins a core per agent{spin}; on small hosts it costs "
                   "25-60 % of the bandwidth and adds ms-scale p99 spikes")
    elif target_cpu is not None and target_cpu > 0.5 and not target_busy:
        out.append(f"the prefill rank spun {target_cpu:.2f} CPU-s/s although it should only poll every 1 ms")
    if not pinned:
        out.append(f"ranks not pinned: {pin_note}")
    elif pin_note:
        out.append(pin_note)
    return out
