"""The environment variables that commonly break P/D, each a pure rule over the environment and this node's
devices (docs/doctor.md says how to act on each verdict)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pdcheck.doctor.model import Check, check
from pdcheck.doctor.netdevs import Devices, suggest

RDMA_TLS = ("rc", "rc_v", "rc_x", "rc_mlx5", "ud", "ud_v", "ud_x", "ud_mlx5", "dc", "dc_x", "dc_mlx5", "ib")
CUDA_TLS = ("cuda", "cuda_ipc", "cuda_copy", "gdr_copy")
TELEMETRY_EXPORTERS = ("prometheus", "prometheus_mp", "doca", "NOP")


def ucx_net_devices(env: Mapping[str, str], devs: Devices) -> Check:
    name = "env UCX_NET_DEVICES"
    sug = suggest(devs)
    value = env.get("UCX_NET_DEVICES")
    export = f"export UCX_NET_DEVICES={sug.value}" if sug.value else None
    if value is None or value.strip().lower() == "all":
        said = "unset (UCX's default: all)" if value is None else "all"
        if sug.value:
            return check(name, "WARN", f"{said}: UCX may bind every device, management NICs included, and a "
                         "device another node cannot reach fails as a bare NIXL_ERR_BACKEND", export)
        return check(name, "PASS", f"{said}; no active RDMA port, so nothing to narrow")
    rdma = {p.ucx_name: p for p in devs.rdma}
    nics = {n.name: n for n in devs.nics}
    bad: list[str] = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        if item in rdma:
            if not rdma[item].active:
                bad.append(f"{item} is {rdma[item].state} ({rdma[item].phys_state})")
        elif item in nics:
            if nics[item].operstate == "down":
                bad.append(f"{item} is down")
        elif ":" in item and item.split(":", 1)[0] in {p.device for p in devs.rdma}:
            bad.append(f"{item}: the device has no such port")
        else:
            bad.append(f"{item} does not exist on this node")
    if bad:
        return check(name, "FAIL", f"{value}: {'; '.join(bad)}", export or
                     "name only devices this node has and that are up: ls /sys/class/infiniband /sys/class/net")
    return check(name, "PASS", f"{value}: every device exists and is up")


def _tls(value: str) -> tuple[bool, set[str]]:
    """(negated, names) of a UCX_TLS value ('^tcp,cuda_ipc' excludes)."""
    neg = value.startswith("^")
    return neg, {v.strip() for v in value.lstrip("^").split(",") if v.strip()}


def ucx_tls(env: Mapping[str, str], devs: Devices) -> Check:
    name = "env UCX_TLS"
    value = env.get("UCX_TLS")
    if value is None:
        return check(name, "PASS", "unset: UCX picks its transports")
    neg, names = _tls(value)
    problems: list[str] = []
    rdma = any(p.active for p in devs.rdma)

    def allows(group: tuple[str, ...]) -> bool:
        if "all" in names:
            return not neg
        hit = bool(names & set(group))
        return not hit if neg else hit

    if rdma and not allows(RDMA_TLS):
        problems.append("no RDMA transport (rc/ud/dc/ib) although this node has active RDMA ports: the payload "
                        "goes over TCP")
    if devs.gpus and not allows(CUDA_TLS):
        problems.append("no CUDA transport (cuda_copy/cuda_ipc): GPU memory cannot be moved")
    if not neg and "all" not in names and not names & {"tcp", *RDMA_TLS}:
        problems.append("no network transport at all (tcp, rc, ud, dc): a peer on another node is unreachable")
    if problems:
        return check(name, "WARN", f"{value}: {'; '.join(problems)}",
                     "unset UCX_TLS, or add the missing transports (e.g. UCX_TLS=rc,cuda_copy,cuda_ipc,tcp)")
    return check(name, "PASS", f"{value}")


def alloc_conf(env: Mapping[str, str]) -> Check:
    name = "env PYTORCH_CUDA_ALLOC_CONF"
    value = env.get("PYTORCH_CUDA_ALLOC_CONF")
    if not value:
        return check(name, "PASS", "unset")
    opts = {k.strip(): v.strip() for k, _, v in (o.partition(":") for o in value.split(","))}
    if opts.get("expandable_segments", "").lower() == "true":
        return check(name, "WARN", f"{value}: expandable segments allocate with CUDA virtual memory; KV caches "
                     "there need a NIXL/UCX that registers and exports such memory (cuda_ipc, GPUDirect RDMA)",
                     "drop expandable_segments:True for the serving process, or prove the GPU path with "
                     "pdcheck transfer-bench --device cuda")
    return check(name, "PASS", value)


def telemetry(env: Mapping[str, str]) -> Check:
    name = "env NIXL_TELEMETRY_*"
    got = {k: v for k, v in sorted(env.items()) if k.startswith("NIXL_TELEMETRY_")}
    if not got:
        return check(name, "PASS", "unset (telemetry as each agent asks)")
    enable = got.get("NIXL_TELEMETRY_ENABLE", "").lower()
    if enable in ("n", "no", "0", "off", "false"):
        return check(name, "WARN", f"NIXL_TELEMETRY_ENABLE={got['NIXL_TELEMETRY_ENABLE']} overrides an agent's "
                     "capture_telemetry: get_xfer_telemetry raises nixlNoTelemetryError",
                     "unset NIXL_TELEMETRY_ENABLE to let the framework decide")
    exp = got.get("NIXL_TELEMETRY_EXPORTER")
    if exp is not None and exp not in TELEMETRY_EXPORTERS:
        return check(name, "WARN", f"NIXL_TELEMETRY_EXPORTER={exp} is not one of {', '.join(TELEMETRY_EXPORTERS)}",
                     "export NIXL_TELEMETRY_EXPORTER=prometheus (or unset it)")
    tdir = got.get("NIXL_TELEMETRY_DIR")
    if tdir is not None and not (os.path.isdir(tdir) and os.access(tdir, os.W_OK)):
        return check(name, "FAIL", f"NIXL_TELEMETRY_DIR={tdir} is not a writable directory",
                     f"mkdir -p {tdir} (or unset NIXL_TELEMETRY_DIR)")
    return check(name, "PASS", ", ".join(f"{k}={v}" for k, v in got.items()))


def all_checks(env: Mapping[str, str], devs: Devices, frameworks: list[Check]) -> list[Check]:
    """UCX's and NIXL's variables, and each framework's own rules (pdcheck.seam.Framework.doctor_checks: vLLM's
    side channel, ...) after UCX's."""
    return [ucx_net_devices(env, devs), ucx_tls(env, devs), *frameworks, alloc_conf(env), telemetry(env)]
