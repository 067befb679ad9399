"""The side-channel port layout: where vLLM's prefill listens and where its decode looks, per wire era, and how
a pdcheck run binds those ports. The one home of these rules: handshake, live, serve, probe and the D ranks
all ask here.

vLLM's layout (docs/vllm-protocol.md §3.1): VLLM_NIXL_SIDE_CHANNEL_PORT is a base; in the per-worker eras (A-E) TP rank r
of DP rank dp listens on base + dp * tp_size + r, in the scheduler eras (F-H) one listener per DP rank on
base + dp serves every TP rank.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING

import msgspec

from pdcheck.errors import BadInput, HarnessError
from pdcheck.vllm import messages as vm
from pdcheck.vllm.releases import CORRECTED, compat_hash_for
from pdcheck.vllm.wire import FORMATS

if TYPE_CHECKING:  # annotations only: the D ranks import this module for rank_offset
    from pdcheck.vllm.releases.base import ReleaseModel
    from pdcheck.vllm.scenario import Scenario

ERA_PORT_SPAN = 100  # several listener profiles in one run: profile k listens from its base + 100*k


def default_port(wire: str) -> int:
    """VLLM_NIXL_SIDE_CHANNEL_PORT's default in era `wire`: 5557 up to 0.11.0 (eras A-E), 5600 from 0.11.1
    (eras F-H; vllm#25059: 5557 collided with the kv-events port). docs/vllm-protocol.md §3.1."""
    if wire not in FORMATS:
        raise ValueError(f"unknown wire era {wire!r}")
    return 5557 if wire[0] < "F" else 5600


def node_host(host: str, node: int) -> str:
    """Node `node`'s address in a one-machine run: the instance's loopback address + node (127.0.0.1, .2, ...),
    so each node's listeners bind their own real address and a D that dials the head node's address for a rank on
    another node finds nobody of that rank there."""
    return str(ipaddress.IPv4Address(host) + node) if node else host


def per_rank(wire: str) -> bool:
    """Each TP rank has its own listener (A-E); else one scheduler listener per DP rank (F-H)."""
    return FORMATS[wire].port_scheme == "per_rank"


def layout_base(wire: str, base: int, dp_rank: int, tp_size: int) -> int:
    """Where a P of DP rank `dp_rank` listens in vLLM's layout: per-worker eras (A-E) put its TP rank r at the
    result + r, the scheduler eras (F-H) one port per DP rank."""
    return base + (dp_rank * tp_size if per_rank(wire) else dp_rank)


def rank_offset(wire: str, tp_rank: int) -> int:
    """A P TP rank's listener, from its DP rank's layout base: + tp_rank (A-E), the scheduler's own port (F-H)."""
    return tp_rank if per_rank(wire) else 0


def rank_port(wire: str, base: int, dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """Where P rank `tp_rank` answers: A-E each worker on base + dp*tp + rank, F-H the scheduler on base + dp."""
    return layout_base(wire, base, dp_rank, tp_size) + rank_offset(wire, tp_rank)


def ports_per_dp(wire: str, tp_size: int) -> int:
    """How many consecutive ports one DP rank's P occupies: one per TP rank (A-E), one (F-H)."""
    return tp_size if per_rank(wire) else 1


class Profile(msgspec.Struct, frozen=True):
    """What P serves for one modelled release: its wire era and hash, on its own base port."""

    wire: str
    compat_hash: str | None
    base_port: int  # A-E: rank r listens on base + dp*tp + r; F-H: P rank 0 listens on base + dp


class PortPlan(msgspec.Struct, frozen=True):
    """Side-channel ports in vLLM's layout (what a modelled release computes and contacts), and how this run
    binds them. Default: every listener on a port the OS picks, so parallel runs never collide, and D ranks
    are told the real port for each layout port. With an explicit prefill base_port the layout ports are
    bound as they are. Either way every layout port a release may contact is held by pdcheck: the ones the
    fake P does not serve are held silent (accepting, never answering), so the release's hang shows and no
    other process on the machine can answer a D rank."""

    profiles: dict[str, Profile]  # release name ("corrected" included) -> what P serves it
    listeners: dict[int, list[vm.ListenerSpec]]  # P rank -> its listeners (layout port, bind port)
    contacted: list[int]  # layout ports some release of this run may contact
    fixed: bool  # explicit base_port: bind the layout ports themselves

    def d_base(self, sc: Scenario, release: ReleaseModel) -> int:
        """The layout base a D rank of `release` addresses P at (corrected reads whatever P speaks)."""
        prof = self.profiles[release.name]
        wire = release.wire if release is not CORRECTED else prof.wire
        return layout_base(wire, prof.base_port, sc.prefill.dp_rank, sc.prefill.tp_size)


def plan_profiles(sc: Scenario, releases: list[ReleaseModel], p_own: ReleaseModel | None) -> dict[str, Profile]:
    """Release name -> P profile. P speaks the modelled release, or its own (p_own: prefill.vllm) in
    cross-release pairs. Distinct profiles get distinct ports: profile k listens from its era's base + 100*k,
    the base being prefill.base_port, else vLLM's default port of that era."""
    keys: list[tuple[str, str | None]] = []
    out: dict[str, Profile] = {}
    for r in [*releases, CORRECTED]:
        served = p_own or (releases[-1] if r is CORRECTED else r)
        key = (served.wire, compat_hash_for(served, sc.prefill.geometry(), sc.prefill.model,
                                          cache_dtype=sc.prefill.cache_dtype))
        if key not in keys:
            keys.append(key)
        base = sc.prefill.base_port if sc.prefill.base_port is not None else default_port(key[0])
        out[r.name] = Profile(key[0], key[1], base + ERA_PORT_SPAN * keys.index(key))
    return out


def plan_ports(sc: Scenario, releases: list[ReleaseModel], p_own: ReleaseModel | None, where: str = "") -> PortPlan:
    """Lay out every side-channel port of the run; BadInput if the layout leaves 1..65535 or overlaps.
    Runs before any process starts."""
    profiles = plan_profiles(sc, releases, p_own)
    fixed = sc.prefill.base_port is not None
    listeners = {r: _listeners(sc, profiles, r, fixed) for r in range(sc.prefill.tp_size)}
    served = [ls.port for specs in listeners.values() for ls in specs]
    where = where or sc.source or "command line"
    if len(set(served)) != len(served):
        raise BadInput(f"{where}: prefill.dp_rank {sc.prefill.dp_rank} x tp_size {sc.prefill.tp_size}: the side-channel "
                       f"listeners of different releases would share ports (keep dp_rank * tp_size below "
                       f"{ERA_PORT_SPAN - sc.prefill.tp_size})")
    n = max(sc.prefill.tp_size, sc.decode.tp_size, sc.params_tp_size())
    plan = PortPlan(profiles, listeners, [], fixed)
    contacted: set[int] = set()
    for r in [*releases, CORRECTED]:
        base = plan.d_base(sc, r)
        contacted.update(base + i for i in range(n))  # per-rank eras; base itself covers per-DP eras
    top = max([*served, *contacted])
    if top > 65535:
        key = "prefill.base_port" if fixed else "prefill.dp_rank"
        raise BadInput(f"{where}: {key}: the side-channel layout of {len(set(profiles.values()))} wire profile(s) "
                       f"x {n} ranks needs ports up to {top}, past 65535 (lower it)")
    return msgspec.structs.replace(plan, contacted=sorted(contacted))


def _listeners(sc: Scenario, profiles: dict[str, Profile], tp_rank: int, fixed: bool) -> list[vm.ListenerSpec]:
    p = sc.prefill
    seen: set[int] = set()
    out: list[vm.ListenerSpec] = []
    for prof in profiles.values():
        if prof.base_port in seen:
            continue
        seen.add(prof.base_port)
        base = layout_base(prof.wire, prof.base_port, p.dp_rank, p.tp_size)
        if per_rank(prof.wire):
            port = base + tp_rank
            out.append(vm.ListenerSpec(prof.wire, port, prof.compat_hash, [tp_rank], port if fixed else 0))
        elif tp_rank == 0:  # the scheduler's listener serves every TP rank of its DP rank
            out.append(vm.ListenerSpec(prof.wire, base, prof.compat_hash, list(range(p.tp_size)), base if fixed else 0))
    return out


def serve_base(wire: str, host: str, port: int | None, dp_rank: int, tp_size: int, where: str) -> int:
    """The base port a served P of era `wire` lays its listeners out from: `port` as given (BadInput when the
    layout runs past 65535), else one the OS picks with the ports above it free for every TP rank."""
    n = ports_per_dp(wire, tp_size)
    if port is not None:
        if layout_base(wire, port, dp_rank, tp_size) + n - 1 > 65535:
            raise BadInput(f"{where}: {port} + ranks runs past port 65535")
        return port
    base = free_base(host, n) - layout_base(wire, 0, dp_rank, tp_size)
    if base < 1:
        raise HarnessError(f"serve: the OS chose a port below DP rank {dp_rank}'s offset; pass --port")
    return base


def free_base(host: str, n: int, attempts: int = 50) -> int:
    """An OS-chosen port with the n-1 ports above it free too (per-worker eras lay ranks out contiguously)."""
    for _ in range(attempts):
        held: list[socket.socket] = []
        try:
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            s = socket.socket(fam, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
            base = s.getsockname()[1]
            if base + n - 1 > 65535:
                continue
            for k in range(1, n):
                t = socket.socket(fam, socket.SOCK_STREAM)
                held.append(t)
                t.bind((host, base + k))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise HarnessError(f"serve: no {n} consecutive free ports on {host}")


# ------------------------------------------------------------------------------------------------ data parallel
def dp_engine_id(engine_id: str, dp_rank: int, dp_size: int, release: ReleaseModel | None = None) -> str:
    """vLLM's engine id of one DP rank: `<engine_id>_dp<N>` whenever dp_size > 1 and the release's engine core
    appends it (ReleaseModel.dp_engine_suffix: 0.9.1+; 0.9.2 and 0.14.0 with the node-local DP rank, 0.26.0 and
    0.34.0 with the global one, which agree on one node), the id as configured otherwise. release None (a matrix
    of releases, or none named): the suffix, as every release but 0.9.0 has it."""
    suffixed = release is None or release.dp_engine_suffix
    return f"{engine_id}_dp{dp_rank}" if dp_size > 1 and suffixed else engine_id


def dp_configured_id(engine_id: str, release: ReleaseModel) -> str:
    """The configured engine id behind one DP rank's (dp_engine_id undone): the `_dp<N>` suffix stripped where
    the release appends it, the id itself where it does not."""
    head, sep, tail = engine_id.rpartition("_dp")
    return head if release.dp_engine_suffix and sep and tail.isdigit() else engine_id


def dp_route_ids(sc: Scenario, rt: DpRoute, p_rel: ReleaseModel | None = None,
                 d_rel: ReleaseModel | None = None) -> tuple[str, str]:
    """(expected, answered): the engine id kv_transfer_params name for the routed prefill DP rank, and the id of
    the engine whose listener answers at the port the decode DP rank contacts, each by its side's release
    (dp_engine_id)."""
    p, d = sc.prefill, sc.decode
    expected = sc.kv_transfer_params.remote_engine_id or dp_engine_id(p.engine_id, rt.routed, p.dp_size, p_rel)
    if rt.reached_side == "prefill":
        return expected, dp_engine_id(p.engine_id, rt.reached, p.dp_size, p_rel)
    return expected, dp_engine_id(d.engine_id, rt.reached, d.dp_size, d_rel)


class DpRoute(msgspec.Struct, frozen=True):
    """Which engine one decode DP rank reaches: the P DP rank the router picked, and the DP rank whose side
    channel really answers at the port D contacts (another one when the proxy hands out the wrong DP port, or
    D's own node's listener when VLLM_NIXL_SIDE_CHANNEL_HOST is left unset on P)."""

    d_dp: int
    routed: int  # the prefill DP rank the router picked (kv_transfer_params name its engine)
    reached: int  # the DP rank whose listener answers at the contacted port
    reached_side: str  # "prefill", or "decode": D's own node's listener (side-channel host unset, vLLM #27083)


def dp_routes(sc: Scenario) -> list[DpRoute]:
    """One route per decode DP rank: router choice (dp_route, else round robin), then the port D contacts:
    the routed rank's (layout_base with its DP rank), DP rank 0's ("dp0"), on P's host or, host unset, on its own."""
    p, d, params = sc.prefill, sc.decode, sc.kv_transfer_params
    out: list[DpRoute] = []
    for j in range(d.dp_size):
        routed = params.dp_route[j] if params.dp_route is not None else j % p.dp_size
        reached = 0 if params.dp_port == "dp0" else routed
        side = "prefill" if p.side_channel_host_set else "decode"
        out.append(DpRoute(j, routed, reached, side))
    return out
