"""Network devices and GPUs as sysfs describes them: RDMA ports (state, link layer, GID 0, rate), plain NICs
(state, address, speed), the NUMA node of every NIC and GPU, and a UCX_NET_DEVICES value built from them.

Everything reads under a root directory (default "/"), so the parsing is tested on a fake tree.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

NVIDIA = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers (class code without the programming interface)


class RdmaPort(msgspec.Struct):
    device: str  # mlx5_0
    port: int
    state: str  # ACTIVE, DOWN, INIT, ...
    phys_state: str  # LinkUp, Disabled, Polling, ...
    link_layer: str  # InfiniBand or Ethernet (RoCE)
    rate: str  # "200 Gb/sec (4X HDR)"
    gid0: str
    numa_node: int  # -1: unknown
    netdev: str | None  # the Ethernet interface of a RoCE port

    @property
    def ucx_name(self) -> str:
        return f"{self.device}:{self.port}"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


class Nic(msgspec.Struct):
    name: str
    operstate: str  # up, down, unknown (lo and some virtual links say unknown while they work)
    mac: str
    numa_node: int
    virtual: bool  # no PCI device behind it (lo, veth, bridges)
    speed_mbps: int | None
    addresses: list[str]


class Gpu(msgspec.Struct):
    pci: str  # 0000:17:00.0
    numa_node: int


class Devices(msgspec.Struct):
    rdma: list[RdmaPort]
    nics: list[Nic]
    gpus: list[Gpu]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:  # absent, or a counter the driver refuses to read (speed of a down link: EINVAL)
        return None


def _int(text: str | None, default: int = -1) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _after_colon(text: str | None) -> str:
    """'4: ACTIVE' -> 'ACTIVE' (sysfs prints the number and the name)."""
    if not text:
        return "unknown"
    return text.split(":", 1)[-1].strip()


def _ls(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def rdma_ports(root: Path) -> list[RdmaPort]:
    base = root / "sys/class/infiniband"
    out: list[RdmaPort] = []
    for dev in _ls(base):
        numa = _int(_read(base / dev / "device/numa_node"))
        nets = _ls(base / dev / "device/net")
        for port in _ls(base / dev / "ports"):
            p = base / dev / "ports" / port
            if not port.isdigit():
                continue
            out.append(RdmaPort(
                device=dev, port=int(port), state=_after_colon(_read(p / "state")),
                phys_state=_after_colon(_read(p / "phys_state")), link_layer=_read(p / "link_layer") or "unknown",
                rate=_read(p / "rate") or "unknown", gid0=_read(p / "gids/0") or "", numa_node=numa,
                netdev=nets[0] if nets else None,
            ))
    return out


def nics(root: Path, addresses: dict[str, list[str]] | None = None) -> list[Nic]:
    base = root / "sys/class/net"
    out: list[Nic] = []
    for name in _ls(base):
        d = base / name
        speed = _int(_read(d / "speed"))
        out.append(Nic(
            name=name, operstate=_read(d / "operstate") or "unknown", mac=_read(d / "address") or "",
            numa_node=_int(_read(d / "device/numa_node")), virtual=not (d / "device").exists(),
            speed_mbps=speed if speed > 0 else None, addresses=(addresses or {}).get(name, []),
        ))
    return out


def gpus(root: Path) -> list[Gpu]:
    base = root / "sys/bus/pci/devices"
    out: list[Gpu] = []
    for pci in _ls(base):
        d = base / pci
        cls = _read(d / "class") or ""
        if _read(d / "vendor") == NVIDIA and cls[:6] in GPU_CLASSES:
            out.append(Gpu(pci, _int(_read(d / "numa_node"))))
    return out


def ipv4_addresses() -> dict[str, list[str]]:
    """Interface -> its IPv4 address (SIOCGIFADDR: the primary one), on this host."""
    import fcntl
    import socket
    import struct

    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _idx, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            out[name] = [socket.inet_ntoa(raw[20:24])]
    return out


def scan(root: Path = Path("/")) -> Devices:
    addrs = ipv4_addresses() if root == Path("/") else None
    return Devices(rdma_ports(root), nics(root, addrs), gpus(root))


class Suggestion(msgspec.Struct):
    value: str | None  # what to export as UCX_NET_DEVICES; None: nothing better than UCX's own choice
    per_gpu: dict[str, list[str]]  # GPU PCI address -> the active RDMA ports on its NUMA node
    reason: str


def suggest(devs: Devices) -> Suggestion:
    """UCX_NET_DEVICES for this node: the active RDMA ports closest (same NUMA node) to each GPU; every active
    port when no GPU or no NUMA information; nothing when there is no active RDMA port (TCP only)."""
    active = [p for p in devs.rdma if p.active]
    if not active:
        return Suggestion(None, {}, "no active RDMA port: UCX can only use TCP (and shared memory/CMA on one node)")
    per_gpu: dict[str, list[str]] = {}
    for g in devs.gpus:
        near = [p.ucx_name for p in active if g.numa_node >= 0 and p.numa_node == g.numa_node]
        per_gpu[g.pci] = near
    chosen = sorted({n for v in per_gpu.values() for n in v})
    if chosen:
        return Suggestion(",".join(chosen), per_gpu,
                          "active RDMA ports on the GPUs' NUMA nodes (a rank can narrow it to its own GPU's)")
    return Suggestion(",".join(p.ucx_name for p in active), per_gpu,
                      "every active RDMA port (no GPU, or no NUMA information ties one to a GPU)")
