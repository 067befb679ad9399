"""Every check of `pdcheck doctor` on this node, each against its own deadline, into one Report."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import msgspec

from pdcheck.doctor import envcheck, loopback, netdevs, network, plugins, versions
from pdcheck.doctor.model import Check, check, exit_code, summary, within
from pdcheck.errors import BadInput, HarnessError
from pdcheck.seam import DoctorContext, Framework

DEADLINE_S = {"versions": 5.0, "network": 5.0, "environment": 5.0, "plugins": 20.0, "transfer": 30.0}

Tick = Callable[[str, int, int, str], None]


class Report(msgspec.Struct):
    """The whole diagnosis: what --json prints and the table shows."""

    mode: str  # "node", "listen", "peer", "ray" or "matrix"
    summary: str
    checks: list[Check]
    versions: versions.Versions
    plugins: list[plugins.Plugin]
    devices: netdevs.Devices
    suggested_ucx_net_devices: str | None
    exports: list[str]  # what to export for the framework installed here, from the checks' fixes
    transfers: list[loopback.Transfer]
    pair: object | None = None  # pdcheck.doctor.pair.PairResult in --listen/--peer mode
    cluster: object | None = None  # pdcheck.doctor.cluster.ClusterResult in --ray and --matrix mode
    seconds: float = 0.0


def _noop(stage: str, done: int, total: int, note: str = "") -> None:
    pass


def node_checks(frameworks: Sequence[Framework], *, multi_node: bool, tick: Tick = _noop,
                transfer: bool = True) -> Report:
    """This node's checks; `frameworks`: the registered ones (the command layer's registry), whose releases and
    environment rules are checked too."""
    t0 = time.monotonic()
    out: list[Check] = []
    steps = 5
    tick("doctor", 0, steps, "versions")

    def timed(name: str, fn: Callable[[], object]) -> object:
        s = time.monotonic()
        val, failed = within(name, DEADLINE_S[name], fn)
        if failed is not None:
            out.append(failed)
        took = time.monotonic() - s
        if isinstance(val, list):
            for c in val:
                if isinstance(c, Check):
                    c.seconds = round(took / len(val), 4)
        return val

    vers = timed("versions", lambda: versions.collect(frameworks)) or versions.collect_fallback()
    out += timed("versions", lambda: versions.checks(vers, frameworks)) or []  # type: ignore[arg-type]
    tick("doctor", 1, steps, "NIXL plugins")
    s = time.monotonic()
    try:
        probe = plugins.probe(DEADLINE_S["plugins"])
        vers.ucx = probe.ucx  # type: ignore[union-attr]
        got = plugins.checks(probe)
        plist = probe.plugins
    except HarnessError as exc:
        got = [check("NIXL plugins", "FAIL", str(exc), "import nixl_cu13 in a Python shell to see NIXL's error")]
        plist = []
    for c in got:
        c.seconds = round(time.monotonic() - s, 4)
    out += got
    tick("doctor", 2, steps, "network devices")
    devs = timed("network", netdevs.scan) or netdevs.Devices([], [], [])
    out += timed("network", lambda: network.all_checks(devs)) or []  # type: ignore[arg-type]
    tick("doctor", 3, steps, "environment")
    env = dict(os.environ)
    own = [c for fw in frameworks for c in fw.doctor_checks(env, DoctorContext(
        devices=devs, multi_node=multi_node, installed=vers.frameworks.get(fw.name)))]  # type: ignore[union-attr]
    out += timed("environment", lambda: envcheck.all_checks(env, devs, own)) or []  # type: ignore[arg-type]
    tick("doctor", 4, steps, "loopback transfer")
    transfers: list[loopback.Transfer] = []
    if transfer:
        t, c = loopback.run("cpu", DEADLINE_S["transfer"])
        out.append(c)
        if t is not None:
            transfers.append(t)
        gpu = gpu_transfer(devs)
        if isinstance(gpu, Check):
            out.append(gpu)
        else:
            t, c = loopback.run("cuda", DEADLINE_S["transfer"])
            out.append(c)
            if t is not None:
                transfers.append(t)
    tick("doctor", steps, steps, "done")
    sug = netdevs.suggest(devs)
    return Report(mode="node", summary=summary(out), checks=out, versions=vers, plugins=plist,  # type: ignore[arg-type]
                  devices=devs, suggested_ucx_net_devices=sug.value, exports=exports(out), transfers=transfers,
                  seconds=round(time.monotonic() - t0, 3))


def cluster_checks(frameworks: Sequence[Framework], address: str, pairs: int, timeout: float,
                   expect: list[str]) -> Report:
    """--ray: the pair matrix only (each node's own checks are `pdcheck doctor` on that node)."""
    from pdcheck.doctor import cluster

    t0 = time.monotonic()
    vers = within("versions", DEADLINE_S["versions"], lambda: versions.collect(frameworks))[0] or versions.collect_fallback()
    res, out = cluster.run(address, pairs, timeout, expect)
    out.insert(0, check("ray cluster", "PASS", f"{address}: {len(res.nodes)} live node(s); {len(res.pairs)} pair(s) "
                        f"({res.selection}), {res.concurrency} at a time"))
    return Report(mode="ray", summary=summary(out), checks=out, versions=vers, plugins=[],
                  devices=netdevs.Devices([], [], []), suggested_ucx_net_devices=None, exports=[], transfers=[],
                  cluster=res, seconds=round(time.monotonic() - t0, 3))


def matrix_checks(frameworks: Sequence[Framework], listeners: list, spec: str, pairs: int, timeout: float,
                  expect: list[str]) -> Report:
    """--matrix: every pair of the listeners (pdcheck.doctor.matrix), as --ray's matrix."""
    from pdcheck.doctor import matrix

    t0 = time.monotonic()
    vers = within("versions", DEADLINE_S["versions"], lambda: versions.collect(frameworks))[0] or versions.collect_fallback()
    res, out = matrix.run(listeners, spec, pairs, timeout, expect)
    names = ", ".join(n.address if n.node_id == "?" else f"{n.node_id} {n.address}" for n in res.nodes)
    out.insert(0, check("listeners", "PASS", f"{len(res.nodes)} listener(s): {names}; {len(res.pairs)} pair(s) "
                        f"({res.selection}), {res.concurrency} at a time"))
    return Report(mode="matrix", summary=summary(out), checks=out, versions=vers, plugins=[],
                  devices=netdevs.Devices([], [], []), suggested_ucx_net_devices=None, exports=[], transfers=[],
                  cluster=res, seconds=round(time.monotonic() - t0, 3))


def gpu_transfer(devs: netdevs.Devices) -> Check | None:
    """None when a GPU transfer can run here; else its SKIP with the reason (no torch import to find out)."""
    from pdcheck.bounds import check_device

    name = "loopback transfer (gpu memory)"
    try:
        check_device("cuda")
    except BadInput as exc:
        return check(name, "SKIP", str(exc).split(": ", 1)[-1].split("; use")[0])
    if len(devs.gpus) < 2:
        return check(name, "SKIP", f"{len(devs.gpus)} GPU(s): the GPU transfer puts prefill and decode on two GPUs")
    return None


def exports(checks: list[Check]) -> list[str]:
    """The `export ...` lines among the fixes of the environment checks, in order, once each."""
    seen: dict[str, None] = {}
    for c in checks:
        if c.status in ("WARN", "FAIL") and c.fix and c.fix.startswith("export ") and "<" not in c.fix:
            seen[c.fix] = None
    return list(seen)


def finish(report: Report) -> int:
    report.summary = summary(report.checks)
    return exit_code(report.checks)
