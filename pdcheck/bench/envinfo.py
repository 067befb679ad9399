"""The facts about this host and software that a bandwidth figure is meaningless without."""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Mapping
from importlib import metadata


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_model() -> str:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total() -> int:
    for line in (_read("/proc/meminfo") or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _thp() -> str | None:
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    if text and "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text


def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def host(llc: int) -> dict[str, str | int | None]:
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count() or 0,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "llc_bytes": llc,
        "mem_bytes": _mem_total(),
        "thp": _thp(),
        # CMA (process_vm_readv) needs one PID namespace and a permissive Yama policy.
        "pid_namespace": pidns,
        "yama_ptrace_scope": _read("/proc/sys/kernel/yama/ptrace_scope"),
        "python": platform.python_version(),
    }


def ucx_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(("UCX_", "NIXL_"))}


class ForeignCpu:
    """CPU time spent by processes other than ours over an interval, in CPU-s per s.

    On a shared or small host a neighbour's compile or test run halves a bandwidth figure; this is how
    a row says it was disturbed. Kernel and hypervisor steal time count as foreign too.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.hz = os.sysconf("SC_CLK_TCK")
        self._start = self._sample()

    @staticmethod
    def _busy() -> int:
        fields = (_read("/proc/stat") or "cpu 0").splitlines()[0].split()[1:]
        vals = [int(x) for x in fields[:8]] + [0] * 8
        user, nice, system, _idle, _iowait, irq, softirq, steal = vals[:8]
        return user + nice + system + irq + softirq + steal

    def _ours(self) -> int:
        total = 0
        for pid in self.pids:
            text = _read(f"/proc/{pid}/stat")
            if text:
                f = text.rsplit(")", 1)[1].split()
                total += int(f[11]) + int(f[12])  # utime, stime
        return total

    def _sample(self) -> tuple[float, int, int]:
        import time

        return time.monotonic(), self._busy(), self._ours()

    def restart(self) -> None:
        self._start = self._sample()

    def read(self) -> float:
        t0, b0, o0 = self._start
        t1, b1, o1 = self._sample()
        if t1 <= t0:
            return 0.0
        return max(0.0, ((b1 - b0) - (o1 - o0)) / self.hz / (t1 - t0))


def wait_quiet(limit: float = 0.15, max_wait: float = 300.0, window: float = 1.0) -> float:
    """Block until the whole host uses under `limit` CPU-s/s (benchmark scripts call this between runs).

    Returns the last reading; gives up after `max_wait` seconds (the caller reports the load it got).
    """
    import time

    deadline = time.monotonic() + max_wait
    while True:
        meter = ForeignCpu([])
        time.sleep(window)
        load = meter.read()
        if load < limit or time.monotonic() > deadline:
            return load
