"""Who is who: engine id mismatch (H18) and collision (H19), a handshake with no timeout (H21), multi-node
instances (H23), device_id (H25)."""

from __future__ import annotations

from pdcheck.releaseline import CORRECTED
from pdcheck.vllm.hazards.base import (
    _EQ,
    _GE,
    _PRE_DEVICE_WIRES,
    Facts,
    Hazard,
    Rels,
    _has,
    _no,
    _paths,
    _plural,
    _remote_tp,
    _v,
    _yes,
    ranks_text,
    targets,
)
from pdcheck.vllm.hazards.wire import _p_release, _port_scheme
from pdcheck.vllm.releases import multinode
from pdcheck.vllm.releases.rules import msg_engine_id


def _h18(f: Facts, rels: Rels) -> Hazard:
    exp = f.sc.remote_engine_id()
    if exp == f.p.engine_id:
        return _no("H18", f"kv_transfer_params name the engine P answers for ({f.p.engine_id})")
    detail = f"kv_transfer_params name {exp!r}, the side channel answers for {f.p.engine_id!r}"
    effects: dict[str, str] = {}
    for rel in rels:
        if _has(rel, "engine_id_matches"):
            effects[rel.name] = f"RuntimeError: {msg_engine_id(exp, f.p.engine_id)}"
        else:
            # _remote_agents gets the expected id, but _tp_size/dst_num_blocks/handles the id P sent, so the
            # first _read_blocks looks up self._tp_size[<expected>] and fails (docs/vllm-protocol.md §3.8, H22).
            effects[rel.name] = ("no check: the other instance's agent is registered under the expected id, its "
                                 f"counts under {f.p.engine_id!r}; the first read then raises KeyError")
    effects[CORRECTED] = f"refused: answered for {f.p.engine_id!r}, expected {exp!r} (wrong host/port?)"
    return _yes("H18", detail, effects)


def _h19(f: Facts, rels: Rels) -> Hazard:
    if not f.collide:
        return _no("H19", f"remote {f.sc.remote_engine_id()!r} differs from local {f.d.engine_id!r}")
    detail = f"remote engine id equals D's own {f.d.engine_id!r}"
    effects: dict[str, str] = {}
    for rel in rels:
        if _has(rel, "engine_id_conflict"):
            effects[rel.name] = "`assert engine_id != self.engine_id, \"Conflict engine id found!\"`"
            continue
        rtp = _remote_tp(rel, f)
        if rtp != f.d_tp:
            effects[rel.name] = (f"no guard: `assert self._tp_size[engine_id] == ...` compares D's own TP "
                                 f"{f.d_tp} with {rtp} and fires (misleading)")
            continue
        paths = _paths(rel, f)
        eq = [r for r, bp in paths.items() if bp.stop == "dst_num_blocks_equal"]
        ge = [r for r, bp in paths.items() if bp.stop == "num_blocks_ge"]
        bits = []
        if eq:
            bits.append(f"{_EQ} compares D's own count and fires on D {_plural(eq)}")
        if ge:
            bits.append(f"{_GE} fires on D {_plural(ge)}")
        quiet = [r for r in paths if r not in eq and r not in ge]
        if quiet:
            bits.append(f"{_v(quiet, 'pass')} and overwrite{'s' if len(quiet) == 1 else ''} their own engine's entries "
                        "(kv_caches_base_addr) silently")
        effects[rel.name] = "no guard: " + "; ".join(bits)
    effects[CORRECTED] = "refused: the remote engine id equals the local one"
    return _yes("H19", detail, effects)


def _h21(f: Facts, rels: Rels) -> Hazard:
    effects: dict[str, str] = {}
    for rel in rels:
        if rel.recv_timeout_ms is not None:
            continue
        missing = [r for r in range(f.d_tp) if (tg := targets(rel, f, r)) is not None and any(p >= f.p_tp for p in tg)]
        p_rel = _p_release(f)
        if p_rel is not None and _port_scheme(p_rel) == "per_dp" and _port_scheme(rel) == "per_rank":
            # A per-rank D asks base + rank; a scheduler-style P listens on base + dp only.
            missing = sorted(set(missing) | {r for r in range(f.d_tp)
                                             if any(p > 0 for p in (targets(rel, f, r) or [r]))})
        if missing:
            effects[rel.name] = (f"{_v(missing, 'ask')} P ports nobody listens on; recv() has no timeout: "
                                 "the handshake blocks forever")
    if not effects:
        return _no("H21", "every modelled D rank asks a P rank that exists")
    effects[CORRECTED] = "asks only existing ranks; a 5 s receive timeout on a fresh socket per attempt"
    return _yes("H21", "a D rank asks a P rank that does not exist (P TP too small for the flow)", effects)


def _h23(f: Facts, rels: Rels) -> Hazard:
    """A P whose TP group spans nodes (vllm#25981, PR #26338): which D ranks ask a rank that is not served on the
    head node, whose address every release dials (releases.multinode, the one home of these facts)."""
    nodes = f.p.nodes
    if nodes <= 1:
        return _no("H23", "the prefill TP group runs on one node")
    per = f.p_tp // nodes
    p_rel = _p_release(f)
    effects: dict[str, str] = {}
    for rel in rels:
        wire = (p_rel or rel).wire
        lost = multinode.unreachable(rel, wire, f.p_tp, nodes)
        hit = [r for r in range(f.d_tp) if any(p in lost for p in (targets(rel, f, r) or []))]
        effects[rel.name] = multinode.effect(rel, wire, hit, lost, ranks_text(lost))
    effects[CORRECTED] = multinode.CORRECTED_EFFECT
    off = [r for r in range(f.p_tp) if multinode.rank_node(r, f.p_tp, nodes) > 0]
    return _yes("H23", f"prefill TP {f.p_tp} spans {nodes} nodes ({per} ranks each): P ranks {ranks_text(off)} "
                       f"are off the head node", effects)


def _h25(f: Facts, rels: Rels) -> Hazard:
    moved = [p for p in range(f.p_tp) if f.p.device_id(p) != p]
    if not moved:
        return _no("H25", "every P rank registered the device of its own rank number")
    regs = ", ".join(f"P rank {p} on device {f.p.device_id(p)}" for p in moved)
    effects: dict[str, str] = {}
    for rel in rels:
        if rel.wire in _PRE_DEVICE_WIRES:
            who = "D's own rank" if rel.flow == "same_rank" else "remote_tp_rank"
            effects[rel.name] = (f"remote descriptors name device = {who}, not the registered device: "
                                 "NIXL lookup failure (NOT_FOUND/BACKEND) or the wrong device")
    effects[CORRECTED] = ("uses the advertised device_id (era F, 0.11.1+); a pre-F P does not advertise it, "
                          "so the rank number is used and the same failure follows")
    return _yes("H25", f"{regs}; pre-F releases use the rank number as the device", effects)
