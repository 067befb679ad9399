"""vLLM's rules for `pdcheck doctor` (pdcheck.seam.Framework.doctor_checks): the side channel a prefill on this
node advertises (VLLM_NIXL_SIDE_CHANNEL_HOST) and the ports it will bind (VLLM_NIXL_SIDE_CHANNEL_PORT)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping

from pdcheck.doctor.model import Check, check
from pdcheck.doctor.netdevs import Devices
from pdcheck.seam import DoctorContext
from pdcheck.vllm.ports import default_port

SIDE_CHANNEL_PORT = default_port("F")  # VLLM_NIXL_SIDE_CHANNEL_PORT's default from 0.11.1 (era F; 5557 before)


def checks(env: Mapping[str, str], ctx: DoctorContext) -> list[Check]:
    return [side_channel_host(env, ctx.devices, vllm=ctx.installed is not None, multi_node=ctx.multi_node),
            side_channel_ports(env, ctx.devices)]


def _local_addresses(devs: Devices) -> set[str]:
    return {a for n in devs.nics for a in n.addresses}


def side_channel_host(env: Mapping[str, str], devs: Devices, *, vllm: bool, multi_node: bool) -> Check:
    name = "env VLLM_NIXL_SIDE_CHANNEL_HOST"
    value = env.get(name[4:])
    ours = sorted(a for a in _local_addresses(devs) if not ipaddress.ip_address(a).is_loopback)
    fix = f"export VLLM_NIXL_SIDE_CHANNEL_HOST={ours[0]}" if ours else \
        "export VLLM_NIXL_SIDE_CHANNEL_HOST=<this node's address that decode nodes reach>"
    if value is None:
        if not vllm:
            return check(name, "SKIP", "unset, and vLLM is not installed here")
        status = "FAIL" if multi_node else "WARN"
        return check(name, status, "unset: vLLM's default is localhost, so a decode on another node dials its "
                     "own node's side channel", fix)
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return check(name, "PASS", f"{value}: a name, resolved by each decode (make sure it resolves there)")
    if ip.is_unspecified:
        return check(name, "FAIL", f"{value} is a bind-all address: prefill advertises it to decode, which then "
                     "dials itself", fix)
    if ip.is_loopback:
        status = "FAIL" if multi_node else "WARN"
        return check(name, status, f"{value} is loopback: fine on one node, a decode on another node dials "
                     "itself", fix)
    if devs.nics and value not in _local_addresses(devs):
        return check(name, "FAIL", f"{value} is not an address of this node (its addresses: "
                     f"{', '.join(ours) or 'none'}): decode dials another machine", fix)
    return check(name, "PASS", f"{value}: an address of this node")


def side_channel_ports(env: Mapping[str, str], devs: Devices,
                       is_free: Callable[[str, int], bool] | None = None) -> Check:
    """The listener ports vLLM's prefill will bind: the base and one per GPU above it (the per-worker eras use
    base + tp_rank; the later ones one per DP rank)."""
    name = "side-channel ports"
    raw = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    base = SIDE_CHANNEL_PORT
    if raw is not None:
        if not raw.isdigit() or not 1 <= int(raw) <= 65535:
            return check(name, "FAIL", f"VLLM_NIXL_SIDE_CHANNEL_PORT={raw!r} is not a port number",
                         "export VLLM_NIXL_SIDE_CHANNEL_PORT=5600")
        base = int(raw)
    n = max(1, len(devs.gpus))
    ports = [p for p in range(base, base + n) if p <= 65535]
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "0.0.0.0")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        host = "0.0.0.0"
    free = is_free or port_free
    taken = [p for p in ports if not free(host, p)]
    span = f"{ports[0]}" if len(ports) == 1 else f"{ports[0]}-{ports[-1]}"
    if taken:
        return check(name, "WARN", f"{', '.join(map(str, taken))} of {span} already taken on {host} (a running "
                     "prefill holds them; a new one on this node cannot bind them)",
                     "export VLLM_NIXL_SIDE_CHANNEL_PORT=<a free base> on the new instance, or stop the old one")
    return check(name, "PASS", f"{span} free on {host}")


def port_free(host: str, port: int) -> bool:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


