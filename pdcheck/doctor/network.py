"""Checks over the devices sysfs shows: RDMA ports, plain NICs, and which NIC is closest to which GPU."""

from __future__ import annotations

from pdcheck.doctor.model import Check, check
from pdcheck.doctor.netdevs import Devices, suggest


def rdma(devs: Devices) -> Check:
    name = "RDMA ports"
    if not devs.rdma:
        return check(name, "SKIP", "no RDMA device (/sys/class/infiniband is empty or absent): between nodes UCX "
                     "moves KV over TCP")
    desc = "; ".join(f"{p.ucx_name} {p.state} {p.link_layer} {p.rate}" + (f" ({p.netdev})" if p.netdev else "")
                     for p in devs.rdma)
    down = [p.ucx_name for p in devs.rdma if not p.active]
    if not any(p.active for p in devs.rdma):
        return check(name, "FAIL", f"no port is ACTIVE: {desc}",
                     "bring a port up (ibstat; cable, subnet manager for InfiniBand, link for RoCE)")
    if down:
        return check(name, "WARN", f"{', '.join(down)} not ACTIVE: {desc}",
                     "leave them out of UCX_NET_DEVICES (see the suggested value)")
    roce_no_gid = [p.ucx_name for p in devs.rdma if p.link_layer == "Ethernet" and not p.gid0.strip("0:")]
    if roce_no_gid:
        return check(name, "WARN", f"RoCE port(s) without a GID: {', '.join(roce_no_gid)}; {desc}",
                     "give the port's netdev an address (RoCE GIDs come from it)")
    return check(name, "PASS", desc)


def nics(devs: Devices) -> Check:
    name = "network interfaces"
    up = [n for n in devs.nics if n.operstate in ("up", "unknown") and n.name != "lo"]
    desc = "; ".join(f"{n.name} {n.operstate}" + (f" {','.join(n.addresses)}" if n.addresses else "") +
                     (f" {n.speed_mbps} Mb/s" if n.speed_mbps else "") + (" virtual" if n.virtual else "")
                     for n in devs.nics)
    if not up:
        return check(name, "WARN", f"only loopback is up: {desc or 'no interfaces'}",
                     "a peer node cannot reach this one: bring an interface up")
    return check(name, "PASS", desc)


def affinity(devs: Devices) -> Check:
    name = "GPU-NIC affinity"
    if not devs.gpus:
        return check(name, "SKIP", "no NVIDIA GPU on the PCI bus")
    if not devs.rdma:
        return check(name, "SKIP", f"{len(devs.gpus)} GPU(s), no RDMA port to pair them with")
    sug = suggest(devs)
    lines = [f"GPU {g} (NUMA {numa}): {', '.join(sug.per_gpu.get(g, [])) or 'no active RDMA port on its node'}"
             for g, numa in ((x.pci, x.numa_node) for x in devs.gpus)]
    lonely = [g for g, v in sug.per_gpu.items() if not v]
    if lonely:
        return check(name, "WARN", "; ".join(lines),
                     "a GPU without a NIC on its NUMA node crosses the socket interconnect: place its rank's "
                     "traffic on the nearest port or accept the cost")
    return check(name, "PASS", "; ".join(lines))


def all_checks(devs: Devices) -> list[Check]:
    return [rdma(devs), nics(devs), affinity(devs)]
