"""One typed plan per run, built once by the command layer from a scenario and flags before any process starts:
the releases resolved once, the KV geometry each side registers, the side-channel port plan, placement (local
or a Ray cluster), the prefill endpoint (fake P, or a live one), the requests and the run options. Runners
(handshake, live, serve) execute a plan; nothing below them resolves a release or lays out a port again.

ReleaseModel objects stay in-process: a plan is typed (msgspec) but only its data fields would encode.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np

from pdcheck.bounds import MAX_TP
from pdcheck.errors import BadInput
from pdcheck.geometry import Geometry
from pdcheck.vllm import messages as vm
from pdcheck.vllm import ports
from pdcheck.vllm.ports import DpRoute, PortPlan
from pdcheck.vllm.releases import (
    CORRECTED,
    compat_hash_for,
    for_release,
    mla_pages,
    multinode,
    registered_geometry,
    resolve,
    resolve_many,
)
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.scenario import Instance, Scenario

TAG_BLOCKS = 4096  # a served P coordinate-tags blocks [0, 4096) of every region (RAM stays bounded)


class RunOptions(msgspec.Struct, frozen=True):
    device: str = "cpu"
    transfer: bool = True
    hang_timeout_ms: int = 3000
    start_timeout_s: float = 60.0
    run_timeout_s: float = 120.0
    inject: vm.Inject = vm.Inject()
    max_tp: int = MAX_TP  # --max-tp: also the largest tp_size a live P may advertise
    # The command layer's tick (stage, done, total), e.g. pdcheck.progress; not data: never encoded.
    progress: Callable[[str, int, int], None] | None = None


class LiveP(msgspec.Struct, frozen=True):
    """--prefill-endpoint: a live P's side channel; no fake P is started."""

    host: str
    port: int
    tp_given: bool  # prefill.tp_size was named (else probed where that is safe)


class Plan(msgspec.Struct, frozen=True):
    """`pdcheck handshake`: everything a run needs, decided once."""

    scenario: Scenario
    releases: list[ReleaseModel]  # the modelled releases, in the order given ("corrected" runs besides them)
    p_release: ReleaseModel | None  # what P speaks when it is fixed: prefill.vllm, or the live P's release
    p_geometry: Geometry  # the KV geometry the fake P ranks register
    d_geometry: Geometry
    options: RunOptions
    ports: PortPlan | None = None  # None with a live P: its ports are its own
    d_releases: list[vm.DRelease] = []  # what each D rank models and where it finds P (fake P)
    requests: list[vm.Req] = []  # fake P; a live P's are drawn after its probe (its block counts)
    ray: str | None = None  # a Ray cluster address ('auto': this node's): ranks become Ray actors; None: local
    live: LiveP | None = None
    # Data parallel (dp_size > 1 on a side): one group per decode DP rank, each a full plan of its TP groups
    # (run one after the other); empty: one TP group per side, as always.
    dp: list[DpGroup] = []
    # Prefill DP ranks no decode DP rank reaches: each still a real TP group that starts and listens at its own
    # side channel (its plan's P side only), as every DP rank of an engine does
    dp_idle: list[DpGroup] = []
    kv_owner: str | None = None  # the engine whose blocks hold the requests' KV; None: the prefill engine

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.releases]

    def with_progress(self, tick: Callable[[str, int, int], None] | None) -> Plan:
        return msgspec.structs.replace(self, options=msgspec.structs.replace(self.options, progress=tick))


class DpGroup(msgspec.Struct, frozen=True):
    """One decode DP rank's run: where its route leads and the plan of that pair of TP groups."""

    route: DpRoute
    plan: Plan


def dp_scenario(sc: Scenario, rt: DpRoute, p_rel: ReleaseModel | None = None,
                d_rel: ReleaseModel | None = None) -> Scenario:
    """The pair one decode DP rank forms: its own TP group (engine id with its release's DP suffix) and the TP
    group that answers at the port it contacts, while kv_transfer_params still name the routed P DP rank's
    engine. p_rel, d_rel: each side's release (ports.dp_engine_id), None where a matrix runs several."""
    p, d = sc.prefill, sc.decode
    one = {"dp_size": 1, "dp_rank": 0}
    expected, answered = ports.dp_route_ids(sc, rt, p_rel, d_rel)
    if rt.reached_side == "prefill":
        answers = msgspec.structs.replace(p, **{**one, "dp_rank": rt.reached}, engine_id=answered) \
            if p.dp_size > 1 else p
    else:  # D's own node's engine of that DP rank listens at the port (VLLM_NIXL_SIDE_CHANNEL_HOST unset on P)
        answers = msgspec.structs.replace(d, **{**one, "dp_rank": rt.reached}, side_channel_host_set=True,
                                          engine_id=answered,
                                          base_port=p.base_port, host=p.host, vllm=p.vllm)
    dec = msgspec.structs.replace(d, **{**one, "dp_rank": rt.d_dp},
                                  engine_id=ports.dp_engine_id(d.engine_id, rt.d_dp, d.dp_size, d_rel))
    params = msgspec.structs.replace(sc.kv_transfer_params, remote_engine_id=expected, dp_route=None,
                                     dp_port="routed")
    return msgspec.structs.replace(sc, name=f"{sc.name} (decode DP rank {rt.d_dp})", prefill=answers, decode=dec,
                                   kv_transfer_params=params, expect={})


def releases_of(sc: Scenario, vllm: str | None) -> list[ReleaseModel]:
    """The releases a run models: --vllm, else the scenario's list."""
    return resolve_many(vllm) if vllm is not None else resolve_many(",".join(sc.vllm), f"{sc.source}: vllm")


def own_release(inst: Instance, where: str) -> ReleaseModel | None:
    """An instance's own release (its `vllm` key, for cross-release pairs)."""
    return resolve(inst.vllm, where) if inst.vllm else None


def kv_geometry(inst: Instance, own: ReleaseModel | None, run_releases: list[ReleaseModel]) -> Geometry:
    """The geometry a fake rank of `inst` registers (releases.registered_geometry, with its own release resolved)."""
    return registered_geometry(own, inst.geometry(), run_releases)


def make_requests(sc: Scenario, p_limit: int | None = None) -> list[vm.Req]:
    """Seeded block tables. P's scheduler hands out ids below the smallest count of its ranks (vLLM uses
    min(num_blocks) logically), D's likewise; both sides of a request have the same number of blocks.
    p_limit: remote ids stay below it (a live `pdcheck serve` P tags only its first blocks)."""
    rng = np.random.default_rng(sc.transfer.seed)
    p_max, d_max = min(sc.prefill.blocks()), min(sc.decode.blocks())
    if p_limit is not None:
        p_max = min(p_max, p_limit)
    k = min(sc.transfer.blocks_per_request, p_max, d_max)
    return [
        vm.Req(f"req-{i}", sorted(rng.choice(p_max, k, replace=False).tolist()),
              sorted(rng.choice(d_max, k, replace=False).tolist()))
        for i in range(sc.transfer.requests)
    ]


def d_release(release: ReleaseModel, p_base: int, p_wire: str, d: Instance, p_nodes: int = 1) -> vm.DRelease:
    """One release a D rank models: where P's side channel is (layout base), the hash D checks against, and
    whether it dials the head node for every P rank (a P spanning nodes, releases.multinode)."""
    return vm.DRelease(release.name, p_base, p_wire, compat_hash_for(release, d.geometry(), d.model,
                                                                   cache_dtype=d.cache_dtype),
                      head_host=p_nodes > 1 and multinode.dials_head_node(release))


def live_release(sc: Scenario, p_own: ReleaseModel | None, releases: list[ReleaseModel]) -> ReleaseModel:
    """The release a live P runs: prefill.vllm, else the one release modelled."""
    if p_own is not None:
        return p_own
    if len(releases) == 1:
        return releases[0]
    raise BadInput("--prefill-endpoint: name the release the live P runs (--prefill-vllm, prefill.vllm in the scenario, or a "
                   "single --vllm): pdcheck only sends a live P requests of its own era")


def build(sc: Scenario, vllm: str | None, options: RunOptions, *, live: LiveP | None = None,
          ray: str | None = None, where: str = "") -> Plan:
    """The plan of one handshake run; BadInput for anything wrong with it. Releases are resolved here, once."""
    releases = releases_of(sc, vllm)
    p_own = own_release(sc.prefill, f"{sc.source}: prefill.vllm")
    d_own = own_release(sc.decode, f"{sc.source}: decode.vllm")
    for side, own in (("prefill", p_own), ("decode", d_own)):  # --vllm too: a release that predates the cache
        inst: Instance = getattr(sc, side)
        mla_pages.validate(sc.source, side, use_mla=inst.use_mla, cache_dtype=inst.cache_dtype, dtype=inst.dtype,
                           head_dim=inst.head_dim, kv_heads=inst.kv_heads, block_len=inst.geometry().block_len,
                           block_stride=inst.block_stride,
                           releases=[r.version or r.name for r in ([own] if own is not None else releases)])
    if sc.prefill.dp_size > 1 or sc.decode.dp_size > 1:
        if live is not None:
            raise BadInput("--prefill-endpoint with dp_size > 1: probe each DP rank's side channel "
                           "(pdcheck probe --dp-size) and run the handshake against one of them")
        groups = []
        # each side's engine ids follow its own release, or the run's one release (a matrix keeps the suffix)
        p_rel, d_rel = (own or (releases[0] if len(releases) == 1 else None) for own in (p_own, d_own))
        for rt in ports.dp_routes(sc):
            sub = build(dp_scenario(sc, rt, p_rel, d_rel), vllm, options, ray=ray, where=where)
            owner = ports.dp_engine_id(sc.prefill.engine_id, rt.routed, sc.prefill.dp_size, p_rel)
            groups.append(DpGroup(rt, msgspec.structs.replace(sub, kv_owner=owner)))
        reached = {g.route.reached for g in groups if g.route.reached_side == "prefill"}
        idle = [DpGroup(rt, build(dp_scenario(sc, rt, p_rel, d_rel), vllm, options, ray=ray, where=where))
                for k in range(sc.prefill.dp_size) if k not in reached
                for rt in [ports.DpRoute(0, k, k, "prefill")]]
        first = groups[0].plan
        return Plan(sc, releases, p_own, first.p_geometry, first.d_geometry, options, first.ports,
                    first.d_releases, first.requests, ray, dp=groups, dp_idle=idle)
    if live is not None:
        p_rel = live_release(sc, p_own, releases)
        # The live P's KV layout on the D side; P's own geometry is probed at run time.
        return Plan(sc, releases, p_rel, for_release(p_rel, sc.prefill.geometry()),
                    kv_geometry(sc.decode, d_own, [p_rel]), options, ray=ray, live=live)
    p_geometry = kv_geometry(sc.prefill, p_own, releases)
    _check_inject(options.inject, p_geometry, sc.prefill.blocks())
    plan = ports.plan_ports(sc, releases, p_own, where)
    # Once, not per rank: each release entry computes a compatibility hash.
    if sc.prefill.nodes > 1 and ray is not None:
        raise BadInput(f"{where or sc.source}: prefill.nodes: a P spanning nodes runs on this machine's loopback "
                       f"addresses (one per node); with --ray the cluster places the ranks (leave nodes out)")
    d_rels = [d_release(r, plan.d_base(sc, r), plan.profiles[r.name].wire, sc.decode, sc.prefill.nodes)
              for r in [*releases, CORRECTED]]
    return Plan(sc, releases, p_own, p_geometry, kv_geometry(sc.decode, d_own, releases),
                options, plan, d_rels, make_requests(sc), ray)



def _check_inject(inject: vm.Inject, g: Geometry, blocks: list[int]) -> None:
    """--inject corrupt names a block the P rank registers: one past its cache would index outside it."""
    for p_rank, region, block in inject.corrupt:
        if region >= g.num_regions or block >= blocks[p_rank]:
            raise BadInput(f"--inject: corrupt:P{p_rank}:{region}:{block}: P rank {p_rank} has {g.num_regions} "
                           f"regions and {blocks[p_rank]} blocks")


# ------------------------------------------------------------------------------------------------ serve
class ServeOptions(msgspec.Struct, frozen=True):
    port: int | None = None  # base port; None: OS-chosen
    tag_blocks: int = TAG_BLOCKS
    duration_s: float | None = None  # serve this long, then stop (tests, scripts); None: until a signal
    api_port: int | None = None  # serve vLLM's GET /version here (0: OS-chosen), for `probe --vllm auto`
    start_timeout_s: float = 60.0
    device: str = "cpu"


class ServePlan(msgspec.Struct, frozen=True):
    """`pdcheck serve`: P's ranks as one release lays them out."""

    scenario: Scenario  # prefill.host, base_port and vllm as served
    release: ReleaseModel
    p_geometry: Geometry  # the regions and block lengths a real P of `release` registers
    base_port: int  # VLLM_NIXL_SIDE_CHANNEL_PORT as P would have it
    compat_hash: str | None
    ports: PortPlan  # fixed: vLLM's layout ports bound as they are, as a real P of `release` would
    remote_port: int  # what kv_transfer_params carry: DP-offset base (A-E) or the scheduler port (F-H)
    options: ServeOptions
    dp: list[ServePlan] = []  # prefill.dp_size > 1: every DP rank's plan (engine <id>_dp<N>) on one base port


def build_serve(sc: Scenario, release: ReleaseModel, options: ServeOptions) -> ServePlan:
    """--port, else the scenario's prefill.base_port (or --prefill-base-port), else ports the OS picks.
    P speaks `release` (--vllm wins over the scenario's prefill.vllm): listeners, hash and KV layout agree."""
    p = sc.prefill
    where = "--port" if options.port is not None else "prefill.base_port"
    if p.nodes > 1:
        raise BadInput(f"{sc.source or 'scenario'}: prefill.nodes: serve runs a P on one node; a P spanning "
                       f"{p.nodes} nodes is modelled by `pdcheck handshake` only (leave nodes out)")
    if p.dp_size > 1:  # every DP rank, each laid out from one base as vLLM does
        port = options.port if options.port is not None else p.base_port
        if port is None:
            port = ports.free_base(p.host, ports.ports_per_dp(release.wire, p.tp_size) * p.dp_size)
        dp = [build_serve(msgspec.structs.replace(sc, prefill=msgspec.structs.replace(
                  p, dp_size=1, dp_rank=k, engine_id=ports.dp_engine_id(p.engine_id, k, p.dp_size, release))),
                  release, msgspec.structs.replace(options, port=port)) for k in range(p.dp_size)]
        return msgspec.structs.replace(dp[0], dp=dp)
    base = ports.serve_base(release.wire, p.host, options.port if options.port is not None else p.base_port,
                            p.dp_rank, p.tp_size, where)
    p = msgspec.structs.replace(p, base_port=base, vllm=release.name)
    sc = msgspec.structs.replace(sc, prefill=p)
    return ServePlan(sc, release, for_release(release, p.geometry()), base,
                     compat_hash_for(release, p.geometry(), p.model, cache_dtype=p.cache_dtype),
                     ports.plan_ports(sc, [release], release, "serve"),
                     ports.layout_base(release.wire, base, p.dp_rank, p.tp_size), options)
