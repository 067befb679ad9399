"""Per-rank num_blocks hazards: rank-0 aliasing (H01), decode with fewer blocks (H02), uneven counts across a
multi-rank handshake (H03), the wrong descriptor stride (H04)."""

from __future__ import annotations

from pdcheck import kvsplit
from pdcheck.releaseline import CORRECTED
from pdcheck.vllm.hazards.base import (
    _EQ,
    _GE,
    Facts,
    Hazard,
    Rels,
    _by_count,
    _has,
    _no,
    _paths,
    _plural,
    _v,
    _yes,
    ranks_text,
    spread,
)
from pdcheck.vllm.hazards.tp import _h13_fires
from pdcheck.vllm.releases.base import ReleaseModel


def _h01(f: Facts, rels: Rels) -> Hazard:
    if f.p_tp <= 1 or not f.tp_ok:
        why = "P TP 1: there is only rank 0" if f.p_tp <= 1 else "TP sizes unsupported by 0.9.1 (H11)"
        return _no("H01", why)
    hit = [r for r in range(f.d_tp) if r // f.ratio != 0 and f.pb[r // f.ratio] != f.pb[0]]
    if not hit:
        return _no("H01", f"every P rank a D rank reads advertises P rank 0's {f.pb[0]}")
    read = sorted({r // f.ratio for r in hit})
    detail = (f"P rank 0 advertises {f.pb[0]}; {_v(hit, 'read')} P {_plural(read)} "
              f"({_by_count(f.pb, read)})")
    effects: dict[str, str] = {}
    for rel in rels:
        if rel.flow == "rank0_then_target":
            paths = _paths(rel, f)
            eq = [r for r in hit if paths[r].stop == "dst_num_blocks_equal"]
            ge = [r for r in hit if paths[r].stop == "num_blocks_ge"]
            silent = [r for r in hit if paths[r].stripped_silent]
            parts = [f"rank-0 pre-handshake records {f.pb[0]} for the engine"]
            if eq:
                parts.append(f"{_EQ} fires on D {_plural(eq)} ({f.pb[0]} vs {_by_count(f.pb, [r // f.ratio for r in eq])})")
            if ge:
                parts.append(f"{_v(ge, 'stop')} earlier at {_GE} (H02)")
            if silent:
                parts.append(f"with asserts stripped {_v(silent, 'read')} with stride {f.pb[0]}: "
                             "silent wrong blocks (H04)")
            effects[rel.name] = "; ".join(parts)
        elif rel.flow == "target_only":
            effects[rel.name] = ("handshakes only the target P rank (tp_size from kv_transfer_params): "
                                 "each D rank records that rank's own count, no aliasing")
        elif rel.flow == "same_rank":
            effects[rel.name] = "handshakes only the P rank of its own number: no rank-0 aliasing"
    effects[CORRECTED] = f"num_blocks kept per P rank; remote ids use {_by_count(f.pb, read)}"
    return _yes("H01", detail, effects)


def _h02_pairs(f: Facts) -> dict[int, list[int]]:
    """P rank -> D ranks with fewer blocks than it, over the pairs D reads (its target, and P rank 0,
    which 0.9.1 handshakes first on every D rank)."""
    pairs: dict[int, list[int]] = {}
    for r in range(f.d_tp):
        cand = {0}
        if f.tp_ok:
            cand.add(r // f.ratio)
        for p in sorted(cand):
            if f.db[r] < f.pb[p]:
                pairs.setdefault(p, []).append(r)
    return pairs


def _h02(f: Facts, rels: Rels) -> Hazard:
    pairs = _h02_pairs(f)
    if not pairs:
        return _no("H02", f"no D rank has fewer blocks than a P rank it handshakes (D min {min(f.db)}, "
                          f"P max {max(f.pb)})")
    bits = []
    for p, rs in pairs.items():
        dcounts = sorted({f.db[r] for r in rs})
        dtxt = str(dcounts[0]) if len(dcounts) == 1 else "/".join(map(str, dcounts))
        bits.append(f"D {_plural(rs)} ({dtxt}) < P rank {p} ({f.pb[p]})")
    effects: dict[str, str] = {}
    for rel in rels:
        if _has(rel, "num_blocks_ge"):
            fired = [r for r, bp in _paths(rel, f).items() if bp.stop == "num_blocks_ge"]
            effects[rel.name] = (f"{_GE} fires on D {_plural(fired)}" if fired
                                 else f"{_GE} is not reached on the ranks concerned")
        elif rel.flow in ("target_only", "rank0_then_target"):
            effects[rel.name] = "no `>=` check (dropped by #19532): D's count is never compared with P's"
        elif rel.flow == "same_rank":
            effects[rel.name] = "no num_blocks check at all"
    effects[CORRECTED] = "no global relation needed: ids are checked per request against each rank's count"
    return _yes("H02", "; ".join(bits), effects)


def _multi_rank_readers(f: Facts) -> dict[int, list[int]]:
    """D rank -> the P ranks it handshakes in one engine when that is more than one: 0.9.1's rank-0
    pre-handshake, or P TP > D TP, where 0.14+ handshake every P rank of the D rank's group (MLA and replicated
    KV included: they read one, but record and compare each one's num_blocks)."""
    out: dict[int, list[int]] = {}
    for r in range(f.d_tp):
        if f.tp_ok and f.p_tp > 1 and r // f.ratio != 0:
            out[r] = kvsplit.release_targets("rank0_then_target", r, f.d_tp, f.p_tp)
        elif f.p_tp > f.d_tp and f.p_tp % f.d_tp == 0:
            out[r] = kvsplit.release_targets("all_targets", r, f.d_tp, f.p_tp)
    return out


def _h03(f: Facts, rels: Rels) -> Hazard:
    sp = spread(f.pb)
    if not sp.differing:
        return _no("H03", f"all {f.p_tp} P ranks advertise {sp.mode}")
    same = [r for r in range(f.p_tp) if r not in sp.differing]
    diff_counts = "/".join(str(f.pb[r]) for r in sp.differing)
    verb = "differs" if len(sp.differing) == 1 else "differ"
    detail = f"P {_plural(sp.differing)} {verb}: {diff_counts} vs {sp.mode} on {_plural(same)}"
    uneven = {r: ps for r, ps in _multi_rank_readers(f).items() if len({f.pb[p] for p in ps}) > 1}
    if not uneven:
        return _no("H03", detail + "; no D rank handshakes two of them")
    if f.tp_ok:
        detail += f"; D {_plural(list(uneven))} handshake P rank 0 and then a P rank with another count"
    else:
        detail += "; " + "; ".join(f"D rank {r} reads P ranks {ranks_text(ps)}" for r, ps in uneven.items())
    effects: dict[str, str] = {}
    for rel in rels:
        if rel.flow == "rank0_then_target" and f.tp_ok:
            paths = _paths(rel, f)
            eq = [r for r, bp in paths.items() if bp.stop == "dst_num_blocks_equal"]
            ge = [r for r in uneven if paths[r].stop == "num_blocks_ge"]
            line = f"{_EQ} fires on D {_plural(eq)}" if eq else f"{_EQ} not reached"
            if ge:
                line += f" ({_v(ge, 'stop')} earlier at {_GE})"
            effects[rel.name] = line
        elif rel.flow in ("target_only", "all_targets") and f.tp_ok:
            effects[rel.name] = f"one handshake per D rank and engine: {_EQ} cannot fire"
        elif rel.flow == "all_targets":
            effects[rel.name] = _h03_all_targets(rel, f, uneven)
        elif rel.flow == "same_rank":
            effects[rel.name] = "one handshake per D rank: counts are never compared"
        else:
            effects[rel.name] = "P TP > D TP is unsupported here, it fails first (H11); from 0.14 the equality assert fires"
    effects[CORRECTED] = "each P rank's list and ids use that rank's own count: nothing to compare"
    return _yes("H03", detail, effects)


def _h03_all_targets(rel: ReleaseModel, f: Facts, uneven: dict[int, list[int]]) -> str:
    """0.14+ with P TP > D TP: every P rank of the group is handshaken, each one's count compared."""
    if _h13_fires(rel, f):
        return "`assert not (tp_ratio < 0 and is_kv_replicated)` fires first (H13)"
    eq = [r for r, bp in _paths(rel, f).items() if bp.stop == "dst_num_blocks_equal" and r in uneven]
    return (f"handshakes every P rank of its group: {_EQ} fires on D {_plural(eq)}" if eq
            else f"{_EQ} not reached")


def _h04(f: Facts, rels: Rels) -> Hazard:
    effects: dict[str, str] = {}
    for rel in rels:
        paths = _paths(rel, f)
        silent = [r for r, bp in paths.items() if bp.stripped_silent]
        if silent:
            strides = sorted({paths[r].recorded for r in silent})
            lists = _by_count(f.pb, sorted({paths[r].target for r in silent}))
            live = [r for r in silent if paths[r].stop is None]
            how = f"silent on D {_plural(live)} as shipped" if live else "with asserts stripped (python -O)"
            effects[rel.name] = (f"{how}: D {_plural(silent)} use stride {'/'.join(map(str, strides))} "
                                 f"for lists of {lists}: region >= 1 reads other blocks, NIXL reports DONE")
    if not effects:
        return _no("H04", "every modelled release uses the target rank's own count as the remote stride")
    effects[CORRECTED] = "remote ids use the read rank's own count"
    return _yes("H04", "remote descriptor ids would use a count recorded from another rank or engine", effects)
