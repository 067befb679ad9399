"""The hazard catalogue (docs/vllm-protocol.md §11) and a pure evaluation of a scenario against it.

`evaluate` looks only at the scenario's facts (both instances' per-rank counts, TP sizes, geometry, layout,
backend, engine ids, kv_transfer_params, device ids) and at what each release model *is* (its flow, wire era
and which checks it has). It starts no process and runs no handshake, so it is an independent cross-check of
what the engine reports: each Hazard says whether the condition holds, names the ranks and numbers, and
gives one line per release of what that release does about it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from pdcheck import kvsplit
from pdcheck.geometry import Geometry
from pdcheck.releaseline import CORRECTED
from pdcheck.vllm import ports
from pdcheck.vllm.releases import CORRECTED as CORRECTED_MODEL
from pdcheck.vllm.releases import hybrid, multinode, registered_geometry, rules, shapes
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.releases.rules import MSG_SHAPE, MSG_SHAPE_P_GT_D, msg_engine_id
from pdcheck.vllm.scenario import Instance, Scenario

CATALOGUE: dict[str, str] = {
    "H01": "rank-0 num_blocks aliasing",
    "H02": "decode has fewer blocks than prefill",
    "H03": "uneven num_blocks across ranks of one engine (multi-rank handshake)",
    "H04": "wrong descriptor stride",
    "H05": "remote block id out of range",
    "H06": "local blocks > remote blocks per request",
    "H07": "block_size mismatch",
    "H08": "block_len / heads / head_dim / dtype mismatch",
    "H09": "kv_cache_layout mismatch",
    "H10": "attention backend mismatch",
    "H11": "TP direction or divisibility",
    "H12": "tp_size missing or inconsistent",
    "H13": "replicated KV plus P TP > D TP",
    "H14": "cross-version schema skew",
    "H15": "listener killed by a malformed/cross-era request",
    "H16": "reply framing skew",
    "H17": "compat hash mismatch",
    "H18": "engine id mismatch",
    "H19": "engine id collision",
    "H20": "side-channel host/port misconfiguration",
    "H21": "handshake hang / no timeout",
    "H22": "failed handshake not propagated",
    "H23": "multi-node instance",
    "H24": "stale or reloaded NIXL agent",
    "H25": "device_id mismatch",
    "H26": "notification format skew",
    "H27": "host-buffer specifics",
    "H28": "P/D both correct but KV semantically stale",
}

# Shapes beyond one TP group that docs/vllm-protocol.md §11 has no row for; listed only when they apply.
SHAPE_CATALOGUE: dict[str, str] = {
    "X01": "pipeline parallel stages",
    "X10": "hybrid KV-cache groups (sliding window, Mamba/SSM)",
    "X02": "attention backend ignores the connector's KV layout",
}

_EQ = "`assert self.dst_num_blocks[engine_id] == nixl_agent_meta.num_blocks`"
_GE = "`assert self.num_blocks >= nixl_agent_meta.num_blocks`"
_PRE_LAYOUT_WIRES = ("A", "B", "C")  # kv_cache_layout enters the metadata in era D (0.10.1)
_PRE_DEVICE_WIRES = ("A", "B", "C", "D", "E")  # device_id enters the metadata in era F (0.11.1)


class Hazard(msgspec.Struct, kw_only=True):
    id: str
    name: str
    applies: bool
    detail: str
    effects: dict[str, str] = msgspec.field(default_factory=dict)  # release name -> what it does about it


class NumBlocksSpread(msgspec.Struct, frozen=True, kw_only=True):
    min: int
    max: int
    mode: int
    differing: list[int]  # ranks whose count differs from the mode


def spread(blocks: Sequence[int]) -> NumBlocksSpread:
    """Summary of one instance's per-rank counts. On a tie the count seen first (lowest rank) is the mode,
    so with two ranks the rank that disagrees with rank 0 is the one reported (0.9.1 aliases to rank 0)."""
    if not blocks:
        raise ValueError("spread() needs at least one count")
    mode = Counter(blocks).most_common(1)[0][0]
    return NumBlocksSpread(min=min(blocks), max=max(blocks), mode=mode,
                           differing=[r for r, n in enumerate(blocks) if n != mode])


# ---- small formatting helpers -------------------------------------------------------------------------
def ranks_text(ranks: Sequence[int]) -> str:
    """[1, 2, 3, 4, 5, 7] -> "1-5,7": rank lists stay short even for TP 8."""
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if j == i else f"{rs[i]}-{rs[j]}" if j > i + 1 else f"{rs[i]},{rs[j]}")
        i = j + 1
    return ",".join(out)


def _plural(ranks: Sequence[int]) -> str:
    return f"rank {ranks_text(ranks)}" if len(set(ranks)) == 1 else f"ranks {ranks_text(ranks)}"


def _v(ranks: Sequence[int], verb: str) -> str:
    """'D rank 6 stops' / 'D ranks 1-5,7 stop': subject and verb agree."""
    if len(set(ranks)) > 1:
        return f"D {_plural(ranks)} {verb}"
    return f"D {_plural(ranks)} {verb}{'es' if verb.endswith(('sh', 'ss')) else 's'}"


def _by_count(counts: Sequence[int], ranks: Sequence[int]) -> str:
    """'111488 on P ranks 1-5,7; 112448 on P rank 6' for the given ranks."""
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(counts[r], []).append(r)
    return "; ".join(f"{n} on P {_plural(rs)}" for n, rs in groups.items())


# ---- scenario facts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Facts:
    """What both instances advertise, computed once (the same numbers vLLM would derive)."""

    sc: Scenario
    p: Instance
    d: Instance
    pb: list[int]
    db: list[int]
    pg: Geometry
    dg: Geometry
    params_tp: int  # tp_size as D reads it from kv_transfer_params (.get("tp_size", 1))

    @classmethod
    def of(cls, sc: Scenario, rels: Sequence[ReleaseModel] = ()) -> Facts:
        """rels: the releases run, which decide the KV layout the ranks register (and the engine measures)."""
        pg, dg = (registered_geometry(i.vllm, i.geometry(), rels) for i in (sc.prefill, sc.decode))
        return cls(sc, sc.prefill, sc.decode, sc.prefill.blocks(), sc.decode.blocks(), pg, dg, sc.params_tp_size())

    @property
    def p_tp(self) -> int:
        return self.p.tp_size

    @property
    def d_tp(self) -> int:
        return self.d.tp_size

    @property
    def tp_ok(self) -> bool:
        """D TP a multiple of P TP: the only direction 0.9.x/0.10.0 support (H11)."""
        return self.d_tp >= self.p_tp and self.d_tp % self.p_tp == 0

    @property
    def ratio(self) -> int:
        return self.d_tp // self.p_tp if self.tp_ok else 0

    @property
    def collide(self) -> bool:
        return self.sc.remote_engine_id() == self.d.engine_id or self.p.engine_id == self.d.engine_id


# ---- what a release model is, read off its data ------------------------------------------------------
def _ids(rel: ReleaseModel) -> set[str]:
    return {s.id for s in (*rel.pre_add, *rel.add_remote)}


def _has(rel: ReleaseModel, check_id: str) -> bool:
    return check_id in _ids(rel)


def _remote_tp(rel: ReleaseModel, f: Facts) -> int:
    """P's TP size as the release learns it: P rank 0's metadata (0.9.1) or kv_transfer_params (0.9.2+)."""
    return f.p_tp if rel.tp_size_from == "metadata" else f.params_tp


def corrected_reads(f: Facts, r: int) -> list[int]:
    """The P ranks D rank r reads under the corrected model (kvsplit, the engine's rule; P TP as
    kv_transfer_params give it)."""
    return kvsplit.corrected_reads(r, f.d_tp, f.params_tp, f.dg.total_kv_heads, f.dg.use_mla)


def corrected_block_len(f: Facts, rtp: int) -> int:
    """The P block length the corrected model accepts when P's TP is `rtp` (kvsplit, the engine's rule)."""
    return kvsplit.corrected_remote_block_len(f.dg.block_len, f.d_tp, rtp, f.dg.total_kv_heads, f.dg.use_mla)


def corrected_reading(f: Facts) -> str:
    """What the corrected model reads for this TP pair, in words: the text every hazard line uses."""
    d, p, heads, mla = f.d_tp, f.params_tp, f.dg.total_kv_heads, f.dg.use_mla
    if not kvsplit.divisible(d, p):
        return f"refused: TP sizes D={d} and P={p} do not divide"
    repl = "MLA" if mla else "replicated KV" if kvsplit.p_replicated(p, heads, mla) else None
    if d >= p:
        return "each D rank reads its heads from one P rank" + (f" ({repl})" if repl else "")
    first = corrected_reads(f, 0)  # with sizes that divide, every D rank reads as many P ranks
    n, eg = len(first), f"D rank 0 reads P {_plural(first)}"
    if n == 1:
        return f"{repl}: each D rank reads one P rank of its group ({eg})"
    what = (f"one P rank per KV head ({repl}: P TP {p} > {heads} heads)" if repl
            else "a head slice from each")
    return f"each D rank reads {n} P ranks, {what}; {eg}"


def targets(rel: ReleaseModel, f: Facts, r: int) -> list[int] | None:
    """P ranks D rank r handshakes, in order (kvsplit, the engine's rule); None when the flow dies before
    sending a request."""
    if rel.flow == CORRECTED:
        return corrected_reads(f, r)
    if rel.flow == "rank0_then_target" and not f.tp_ok:
        return [0]  # the rank-0 add_remote_agent stops at the divisibility assert
    # rank0_then_target learns P's TP from P rank 0's metadata; the later flows from kv_transfer_params
    try:
        return kvsplit.release_targets(rel.flow, r, f.d_tp, _remote_tp(rel, f))
    except ZeroDivisionError:
        return None  # tp_rank // 0 in _nixl_handshake (P TP > D TP before 0.14)


@dataclass(frozen=True)
class BlockPath:
    """One D rank's num_blocks bookkeeping under one release, the other checks assumed to pass."""

    stop: str | None  # "num_blocks_ge" / "dst_num_blocks_equal": the num_blocks assert that fires first
    stop_p: int | None  # the P rank whose handshake it fires in
    recorded: int  # dst_num_blocks[engine]: the stride remote ids use
    target: int  # the P rank whose descriptor list this D rank reads
    stripped_silent: bool  # with asserts stripped (python -O), stride != the target's own count


def block_path(rel: ReleaseModel, f: Facts, r: int) -> BlockPath | None:
    """None where the num_blocks checks are never reached (TP unsupported, or a P rank that does not exist)."""
    if rel.flow == CORRECTED:
        return None
    tg = targets(rel, f, r)
    if tg is None or any(p >= f.p_tp for p in tg) or (rel.flow == "rank0_then_target" and not f.tp_ok):
        return None
    has_ge, has_eq = _has(rel, "num_blocks_ge"), _has(rel, "dst_num_blocks_equal")
    # vLLM seeds dst_num_blocks with its own engine: a colliding engine id starts from D's own count (H19).
    recorded: int | None = f.db[r] if f.collide else None
    stop: tuple[str, int] | None = None
    for p in tg:
        n = f.pb[p]
        if stop is None and has_ge and f.db[r] < n:
            stop = ("num_blocks_ge", p)
        if recorded is None or not has_eq:
            recorded = n  # 0.9.0 overwrites; the if/else of 0.9.1+ keeps the first count
        elif n != recorded and stop is None:
            stop = ("dst_num_blocks_equal", p)
    assert recorded is not None
    # The lists read (kvsplit, the rule rules.prep_targets follows)
    read = kvsplit.release_reads(rel.flow, r, f.d_tp, _remote_tp(rel, f), f.dg.use_mla)
    return BlockPath(stop[0] if stop else None, stop[1] if stop else None, recorded, read[-1],
                     any(recorded != f.pb[p] for p in read))


def _paths(rel: ReleaseModel, f: Facts) -> dict[int, BlockPath]:
    out: dict[int, BlockPath] = {}
    for r in range(f.d_tp):
        bp = block_path(rel, f, r)
        if bp is not None:
            out[r] = bp
    return out


# How a release checks P's block_len (the rules.py checks, read off its version and steps):
# "plain" (0.9.1: MLA only is replicated), "replicated" (0.9.2 - 0.19: KVTopology `tp // heads >= 1`),
# "strict" (0.20 - 0.23: TransferTopology `tp > heads`), "heads" (0.24+: strict, per-rank physical head counts).
LenRule = str
# What the accepted length is: "equal" (replicated/MLA), "scaled" (D's block x tp_ratio), "p_gt_d" (0.14 - 0.23:
# D's block // |tp_ratio|), "heads" (0.24+: D's block x remote heads // local heads).
LenKind = str


def block_len_rule(rel: ReleaseModel) -> LenRule:
    # The release's own checks say it (rules.replication): #19691 (0.9.2) added the `tp_size // total_kv_heads
    # >= 1` replicated branch, 0.9.1 only knows MLA; TransferTopology (0.20+) is strict.
    repl = rules.replication(rel)
    if repl in (None, "mla"):
        return "plain"
    if repl == "loose":
        return "replicated"
    return "heads" if _has(rel, "block_len_split") else "strict"


def expected_remote_block_len(f: Facts, rel: ReleaseModel, rtp: int) -> tuple[int, LenKind] | None:
    """(the P block_len release `rel` accepts when P's TP is `rtp`, which branch accepts it); None where an
    earlier check stops first: the TP checks (H11, P TP > D TP before 0.14) or the replicated P TP > D TP assert
    (H13, 0.14+)."""
    dl, heads, mla = f.dg.block_len, f.dg.total_kv_heads, f.dg.use_mla
    rule = block_len_rule(rel)
    replicated = mla or (rule != "plain" and kvsplit.topology_replicated(rtp, heads, strict=rule in ("strict", "heads")))
    per_head = dl * kvsplit.rank_heads(rtp, heads, mla) // kvsplit.rank_heads(f.d_tp, heads, mla)
    if not kvsplit.divisible(f.d_tp, rtp):
        return None  # every release checks TP divisibility before the block length
    if f.d_tp < rtp:  # only 0.14+ (all_targets) read from a larger P
        if rel.flow != "all_targets" or (replicated and not (mla and rules.p_gt_d_skips_mla(rel))):
            return None
        if replicated:
            return dl, "equal"  # MLA from 0.21: the P TP > D TP assert skips MLA
        return (per_head, "heads") if rule == "heads" else (dl // (rtp // f.d_tp), "p_gt_d")
    if replicated:
        return dl, "equal"  # `assert self.block_len == nixl_agent_meta.block_len` (bare)
    if rule == "heads":
        return per_head, "heads"
    return dl * (f.d_tp // rtp), "scaled"  # `assert nixl_agent_meta.block_len == self.block_len * tp_ratio, MSG_SHAPE`


def _expected(rel: ReleaseModel, f: Facts) -> tuple[int, LenKind] | None:
    return expected_remote_block_len(f, rel, _remote_tp(rel, f))


# ---- one function per hazard -------------------------------------------------------------------------
Rels = Sequence[ReleaseModel]


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


def _geometry_diff(f: Facts) -> str:
    pairs = [("block_size", f.p.block_size, f.d.block_size), ("kv_heads", f.p.kv_heads, f.d.kv_heads),
             ("head_dim", f.p.head_dim, f.d.head_dim), ("dtype", f.p.dtype, f.d.dtype),
             ("use_mla", f.p.use_mla, f.d.use_mla), ("attn_backend", f.p.attn_backend, f.d.attn_backend)]
    diffs = [f"{k} {a} vs {b}" for k, a, b in pairs if a != b]
    return ", ".join(diffs) if diffs else "same model geometry"


def _h07(f: Facts, rels: Rels) -> Hazard:
    if f.p.block_size == f.d.block_size:
        return _no("H07", f"both use {f.d.block_size}-token blocks")
    pl, dl = f.pg.block_len, f.dg.block_len
    detail = f"P block_size {f.p.block_size} vs D {f.d.block_size} (P block_len {pl} B, D {dl} B)"
    effects: dict[str, str] = {}
    for rel in rels:
        got = _expected(rel, f)
        exp = got[0] if got else None
        on_wire = shapes.block_size_effect(rel, f.p.block_size, f.d.block_size)  # era F+: block_size advertised
        if on_wire is not None and on_wire.startswith("supported") and (
                hma := hybrid.handshake_refusal(rel, f.dg, f.p.block_size)):
            on_wire = shapes.PER_REQUEST.format(what=f"asserts '{hma}' (a hybrid model with HMA on)")
        if on_wire is not None:
            effects[rel.name] = on_wire
        elif rel.flow == "same_rank":
            effects[rel.name] = (f"no check: remote descriptors step by D's block_len {dl} B through P's "
                                 f"{pl} B blocks: wrong bytes, no error")
        elif exp is None:
            effects[rel.name] = "not reached: a TP check fails first (H11, H13)"
        elif exp != pl:
            effects[rel.name] = (f"block_size is not on the wire and the block_len check fires first: '{MSG_SHAPE}' "
                                 f"({pl} B vs {exp} B); the block-size assert behind it cannot fire")
        else:
            effects[rel.name] = (f"block_len matches ({pl} B), so the derived remote block size equals D's: "
                                 "undetected, tokens land in the wrong slots")
    effects[CORRECTED] = _h07_corrected(f, rels)
    return _yes("H07", detail, effects)


def _corrected_bsr(f: Facts, rels: Rels) -> int | None:
    """D's block in P blocks as the corrected model reads it: None where P (era A-E) advertises no block_size (the
    block length decides), 0 where P's does not divide D's (refused)."""
    p_rel = _p_release(f) or (rels[-1] if rels else None)  # the P the corrected D meets (handshake's profiles)
    if p_rel is not None and p_rel.wire in _PRE_DEVICE_WIRES:
        return None
    p_bs, d_bs = f.p.block_size, f.d.block_size
    return d_bs // p_bs if d_bs % p_bs == 0 else 0


def _h07_corrected(f: Facts, rels: Rels) -> str:
    """The corrected model checks an advertised block size first (P's must divide D's: its blocks are read into
    D's sub-blocks), then the block length (releases.corrected)."""
    bsr = _corrected_bsr(f, rels)
    pl = f.pg.block_len
    if bsr == 0:
        return (f"refused: P block_size {f.p.block_size}, D block_size {f.d.block_size}: D's block must be a whole "
                "number of P's")
    exp = corrected_block_len(f, f.params_tp) // (bsr or 1)
    if exp != pl:
        first = " first" if bsr is None else ""  # with no block_size advertised, the length decides
        return f"refused by the block length check{first} (H08): P block is {pl} B, D expects {exp} B"
    if bsr is None:
        return ("undetected: P (era A-E) does not advertise block_size and the block length matches: tokens land "
                "in the wrong slots")
    return (f"accepted: D's {f.d.block_size}-token block is {bsr} of P's; each is read into one of its sub-blocks "
            "(get_mapped_blocks) and rearranged on receive")


def _h08(f: Facts, rels: Rels) -> Hazard:
    pl, dl = f.pg.block_len, f.dg.block_len
    effects: dict[str, str] = {}
    for rel in rels:
        if rel.flow == "same_rank":
            if pl != dl:  # 0.9.0 steps through remote blocks with its own block_len, whatever P's is
                effects[rel.name] = f"no check: P blocks of {pl} B are read as {dl} B blocks (silent)"
            continue
        got = _expected(rel, f)
        if got is None or got[0] == pl:
            continue
        exp, kind = got
        on_wire = shapes.block_size_effect(rel, f.p.block_size, f.d.block_size)  # era F+: block_size advertised
        if on_wire is not None and not on_wire.startswith("supported"):
            effects[rel.name] = "not reached: the block-size check fires first (H07)"
            continue
        if on_wire is not None and pl == exp * f.p.block_size // f.d.block_size:
            continue  # P's smaller block, as block_size_ratio expects it
        effects[rel.name] = {
            "equal": f"bare `assert self.block_len == nixl_agent_meta.block_len` fails ({dl} vs {pl})",
            "scaled": (f"`assert nixl_agent_meta.block_len == self.block_len * tp_ratio` fails: '{MSG_SHAPE}' "
                       f"({pl} B vs {exp} B)"),
            "p_gt_d": (f"`assert remote_block_len == self.block_len_per_layer[0] // (-tp_ratio)` fails: "
                       f"'{MSG_SHAPE_P_GT_D}' ({pl} B vs {exp} B)"),
            "heads": (f"`remote_len == local_len * remote_heads // local_heads` fails (SPLIT region 0: {pl} B vs "
                      f"{exp} B)"),
        }[kind]
    bsr = _corrected_bsr(f, rels)
    exp = corrected_block_len(f, f.params_tp) // (bsr or 1)
    if bsr == 0:
        effects[CORRECTED] = "not reached: the block-size check refuses first (H07)"
    elif exp != pl:
        effects[CORRECTED] = f"refused: P block is {pl} B, D expects {exp} B"
    if not effects:
        return _no("H08", f"P block_len {pl} B matches what every release expects")
    effects.setdefault(CORRECTED, f"accepts: P's {pl} B matches the heads/head_dim/dtype it expects")
    why = _geometry_diff(f)
    if why == "same model geometry" and f.p_tp != f.d_tp:
        why += f" (only a release without heterogeneous TP expects D's own {dl} B)"
    detail = (f"P block_len {pl} B ({f.pg.block_size} tokens x {f.pg.local_kv_heads} heads x {f.pg.head_dim} x "
              f"{f.pg.elem_size} B{' x2 (K+V)' if f.pg.joint_kv else ''}), D block_len "
              f"{dl} B, tp_ratio {f.d_tp}//{f.p_tp}; {why}")
    return _yes("H08", detail, effects)


def _h09(f: Facts, rels: Rels) -> Hazard:
    if f.dg.use_mla:
        return _no("H09", "MLA: one latent per token, no head layout to disagree on")
    if rules.same_layout(f.p.kv_cache_layout, f.d.kv_cache_layout):  # LBHNC is HND's 0.29+ name
        same = {f.p.kv_cache_layout, f.d.kv_cache_layout}
        return _no("H09", f"both {' = '.join(sorted(same))}")
    ratio = f.ratio
    detail = f"P {f.p.kv_cache_layout} vs D {f.d.kv_cache_layout}, tp_ratio {ratio if ratio else 'n/a'}"
    if ratio > 1:
        what = (f"each D rank's head slice at (tp_rank % {ratio}) x {f.dg.block_len} B reads all heads of a "
                "fraction of the tokens instead: silent")
    else:
        what = "whole blocks are read and used in the other layout: silent"
    effects = {rel.name: (f"kv_cache_layout is not on the wire (era {rel.wire}) and not compared; {what}"
                          if rel.wire in _PRE_LAYOUT_WIRES else "compared (not modelled here)") for rel in rels}
    effects[CORRECTED] = ("refused when P advertises kv_cache_layout (era D, 0.10.1+); a P of eras A-C "
                          "does not, so it cannot be seen")
    return _yes("H09", detail, effects)


def _h10(f: Facts, rels: Rels) -> Hazard:
    if f.p.attn_backend == f.d.attn_backend:
        return _no("H10", f"both {f.d.attn_backend}")
    detail = f"P {f.p.attn_backend} vs D {f.d.attn_backend}"
    effects: dict[str, str] = {}
    for rel in rels:
        if _has(rel, "attn_backend"):
            effects[rel.name] = ("bare `assert nixl_agent_meta.attn_backend_name == self.backend_name` on every "
                                 "D rank, first handshake")
        else:
            effects[rel.name] = "not on the wire, not checked: blocks of the other backend's layout are read"
    effects[CORRECTED] = f"refused: attention backend P={f.p.attn_backend} D={f.d.attn_backend}"
    return _yes("H10", detail, effects)


def _h11(f: Facts, rels: Rels) -> Hazard:
    if f.tp_ok:
        return _no("H11", f"D TP {f.d_tp} is a multiple of P TP {f.p_tp}")
    d, p = f.d_tp, f.p_tp
    detail = (f"P TP {p} > D TP {d}" if p > d else f"D TP {d} is not a multiple of P TP {p}")
    effects: dict[str, str] = {}
    for rel in rels:
        if rel.flow == "rank0_then_target":
            effects[rel.name] = ("`assert self._tp_size[self.engine_id] % self._tp_size[engine_id] == 0` "
                                 "'Local TP size must be divisible by remote TP size.' on every D rank (rank-0 handshake)")
        elif rel.flow == "target_only":
            effects[rel.name] = _h11_target_only(f)
        elif rel.flow == "same_rank":
            missing = [r for r in range(d) if r >= p]
            effects[rel.name] = ("no heterogeneous TP: each D rank asks the P rank of its own number"
                                 + (f"; {_v(missing, 'ask')} ports nobody listens on and {'blocks' if len(missing) == 1 else 'block'} in recv()"
                                    if missing else ""))
    reading = corrected_reading(f)
    if reading.startswith("refused"):
        effects[CORRECTED] = reading
    elif f.params_tp != f.p_tp:  # it reads what kv_transfer_params describe; H12's line says how that ends
        effects[CORRECTED] = f"reads P as TP {f.params_tp} (kv_transfer_params, H12): {reading}"
    else:
        effects[CORRECTED] = f"supported: {reading}"
    return _yes("H11", detail, effects)


def _h11_target_only(f: Facts) -> str:
    ptp = f.params_tp
    if ptp > f.d_tp:
        return (f"`tp_ratio = {f.d_tp} // {ptp}` is 0 and `self.tp_rank // tp_ratio` raises ZeroDivisionError "
                "in _nixl_handshake before any request, on every D rank")
    if f.d_tp % ptp == 0:
        return f"tp_size {ptp} from kv_transfer_params divides D TP {f.d_tp}: passes (see H12)"
    ratio = f.d_tp // ptp
    asked = {r: r // ratio for r in range(f.d_tp)}
    dead = [r for r, t in asked.items() if t >= f.p_tp]
    live = [r for r, t in asked.items() if t < f.p_tp]
    line = f"`divide({f.d_tp}, {ptp})`: '{f.d_tp} is not divisible by {ptp}' on D {_plural(live)}"
    if dead:
        line += f"; {_v(dead, 'ask')} P ranks that do not exist and {'blocks' if len(dead) == 1 else 'block'} in recv() (H21)"
    return line


def _h12(f: Facts, rels: Rels) -> Hazard:
    kv = f.sc.kv_transfer_params
    if not kv.omit_tp_size and (kv.tp_size is None or kv.tp_size == f.p_tp):
        return _no("H12", f"kv_transfer_params carry tp_size {f.params_tp}, P runs TP {f.p_tp}")
    detail = (f"kv_transfer_params lack tp_size: D reads 1 while P runs TP {f.p_tp}" if kv.omit_tp_size
              else f"kv_transfer_params say tp_size {kv.tp_size} while P runs TP {f.p_tp}")
    effects: dict[str, str] = {}
    for rel in rels:
        if rel.tp_size_from == "metadata":
            effects[rel.name] = f"reads tp_size from P rank 0's metadata ({f.p_tp}): unaffected"
        elif rel.flow == "same_rank":
            effects[rel.name] = "no heterogeneous TP: tp_size is not used"
        else:
            effects[rel.name] = _h12_params(rel, f)
    exp = corrected_block_len(f, f.params_tp)
    effects[CORRECTED] = ("trusts kv_transfer_params too, but its block_len check refuses the wrong ratio "
                          f"({f.pg.block_len} B vs {exp} B)" if exp != f.pg.block_len
                          else "reads the rank tp_size points at; geometry happens to match")
    return _yes("H12", detail, effects)


def _h12_params(rel: ReleaseModel, f: Facts) -> str:
    ptp = f.params_tp
    if ptp > f.d_tp:
        return f"tp_ratio {f.d_tp} // {ptp} = 0: ZeroDivisionError before any request"
    got = _expected(rel, f)
    exp = got[0] if got else None
    tgt = sorted({r // (f.d_tp // ptp) for r in range(f.d_tp)})
    if exp is not None and exp != f.pg.block_len:
        return (f"tp_ratio {f.d_tp // ptp}: D ranks ask P {_plural(tgt)} and fail '{MSG_SHAPE}' "
                f"({f.pg.block_len} B vs {exp} B)")
    return f"tp_ratio {f.d_tp // ptp}: D ranks ask P {_plural(tgt)}; block_len happens to match"


def _h13_fires(rel: ReleaseModel, f: Facts) -> bool:
    """`assert not (tp_ratio < 0 and is_kv_replicated)`: KVTopology (0.14 - 0.19) counts P TP >= heads as
    replicated, TransferTopology (0.20+) P TP > heads; 0.14 - 0.20 make it for MLA too, 0.21+ skip MLA."""
    if f.p_tp <= f.d_tp or (f.dg.use_mla and rules.p_gt_d_skips_mla(rel)):
        return False
    return kvsplit.topology_replicated(f.p_tp, f.dg.total_kv_heads, strict=rules.replication(rel) == "strict")


def _h13(f: Facts, rels: Rels) -> Hazard:
    modern = [rel for rel in rels if rel.flow == "all_targets"]
    heads = f.dg.total_kv_heads
    # Replicated as the newest vLLM counts it (kvsplit.p_replicated: P TP > heads), MLA left to the releases.
    replicated = not f.dg.use_mla and kvsplit.p_replicated(f.p_tp, heads, False) and f.p_tp > f.d_tp
    if not any(_h13_fires(rel, f) for rel in modern) and not replicated:
        return _no("H13", f"P TP {f.p_tp}, D TP {f.d_tp}, {heads} KV heads"
                   + (", MLA" if f.dg.use_mla else ""))
    effects = {rel.name: "P TP > D TP is unsupported here (H11)" for rel in rels}
    for rel in modern:
        if _h13_fires(rel, f):
            effects[rel.name] = "asserts `not (tp_ratio < 0 and is_kv_replicated)`"
        elif f.dg.use_mla:
            effects[rel.name] = "not asserted for MLA: handshakes every target P rank, reads the first"
        else:
            effects[rel.name] = "not replicated by this release's rule: reads a head slice from each P rank"
    effects[CORRECTED] = corrected_reading(f)
    if f.dg.use_mla:
        detail = f"MLA with P TP {f.p_tp} > D TP {f.d_tp}"
    elif replicated:
        detail = f"P TP {f.p_tp} > {heads} KV heads (replicated) and > D TP {f.d_tp}"
    else:
        detail = (f"P TP {f.p_tp} = {heads} KV heads and > D TP {f.d_tp}: every P rank holds its own head, but "
                  "KVTopology (0.14 - 0.19) counts `remote_tp // heads >= 1` as replicated")
    return _yes("H13", detail, effects)


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


def _port_scheme(rel: ReleaseModel) -> str:
    from pdcheck.vllm.wire import FORMATS

    return FORMATS[rel.wire].port_scheme


def _p_release(f: Facts) -> ReleaseModel | None:
    """The prefill's own release in a cross-release pair (prefill.vllm), else None."""
    from pdcheck.vllm.releases import resolve

    return resolve(f.p.vllm) if f.p.vllm else None


def _h14(f: Facts, rels: Rels) -> Hazard:
    p_rel = _p_release(f)
    if p_rel is None:
        return _no("H14", "P and D model the same release (no prefill.vllm)")
    from pdcheck.vllm.wire import FORMATS, WireError, encode_reply, strict_decode

    probe = {"engine_id": "", "agent_metadata": b"", "kv_caches_base_addr": [], "num_blocks": 1, "tp_size": 1,
             "block_len": 1, "block_lens": [1], "block_strides": [1], "attn_backend_name": "", "kv_cache_layout": "",
             "device_id": 0, "block_size": 1, "ssm_sizes": (0, 0), "physical_blocks_per_logical_kv_block": 1}
    frames = encode_reply(FORMATS[p_rel.wire], probe, "")
    effects: dict[str, str] = {}
    for rel in rels:
        try:
            strict_decode(FORMATS[rel.wire], frames, None)
        except WireError as exc:
            effects[rel.name] = f"{exc.exc_type}: {exc.message or exc.expr} (P era {p_rel.wire}, D era {rel.wire})"
    if not effects:
        return _no("H14", f"P {p_rel.name}'s metadata decodes under every modelled D release")
    effects[CORRECTED] = "reads any era (optional fields), detects the era and refuses with a clear message"
    return _yes("H14", f"P runs {p_rel.name} (era {p_rel.wire}); D releases read another schema", effects)


def _h15(f: Facts, rels: Rels) -> Hazard:
    p_rel = _p_release(f)
    from pdcheck.vllm.wire import FORMATS, encode_request, parse_request

    p_fmt = FORMATS[p_rel.wire] if p_rel else None
    if p_fmt is None or not p_fmt.listener_dies_on_bad_request:
        return _no("H15", "no P listener of eras F-H receives requests of another era")
    effects: dict[str, str] = {}
    for rel in rels:
        try:
            parse_request(p_fmt, encode_request(FORMATS[rel.wire], 0))
        except Exception as exc:  # what the real listener thread would die of
            effects[rel.name] = (f"its request kills P's listener ({type(exc).__name__}); every later handshake "
                                 "to that P times out")
    if not effects:
        return _no("H15", f"every modelled D release frames requests as P {p_rel.name} expects")
    effects[CORRECTED] = "never probes a live P with a request of another era; P should catch per request"
    return _yes("H15", f"P {p_rel.name}'s listener decodes requests outside any try (era {p_rel.wire})", effects)


def _h17(f: Facts, rels: Rels) -> Hazard:
    """Only the cache_dtype factor: the other factors show up as H08/H10/H14 lines."""
    pc, dc = f.p.cache_dtype, f.d.cache_dtype
    if pc == dc:
        return _no("H17", f"both sides hash cache_dtype {pc!r}")
    effects = {rel.name: "; ".join(shapes.fp8_effects(rel, pc, dc, dynamic=False)) for rel in rels}
    effects[CORRECTED] = f"refused: cache_dtype {pc!r} on P, {dc!r} on D (the KV bytes are not comparable)"
    return _yes("H17", f"cache_dtype: P {pc!r}, D {dc!r}", effects)


def _h20(f: Facts, rels: Rels) -> Hazard:
    """Data parallel: the port a decode DP rank contacts belongs to another engine (the wrong DP port, or its
    own node's listener when VLLM_NIXL_SIDE_CHANNEL_HOST is left unset on P, vLLM #27083). Engine ids per
    release (ports.dp_route_ids): where every DP rank keeps the configured id, the wrong DP rank answers for
    the expected engine."""
    p, d = f.p, f.d
    if p.dp_size == 1 and d.dp_size == 1:
        return _no("H20", "one DP rank per side")
    routes = ports.dp_routes(f.sc)
    misrouted = [rt for rt in routes if rt.reached_side != "prefill" or rt.reached != rt.routed]
    one = rels[0] if len(rels) == 1 else None  # the ids the detail names: the one release's, else the suffix
    p_own = _p_release(f)
    wrong = [(rt, e, g) for rt in routes for e, g in [ports.dp_route_ids(f.sc, rt, p_own or one, one)]
             if g != e or rt in misrouted]
    if not wrong:
        return _no("H20", f"each decode DP rank reaches the prefill DP rank its router picked "
                          f"(prefill dp_size {p.dp_size}, decode dp_size {d.dp_size})")
    why = ("VLLM_NIXL_SIDE_CHANNEL_HOST is unset on P ('localhost' is advertised): D reaches its own node's "
           "listener" if not p.side_channel_host_set else "the proxy hands out DP rank 0's side-channel port")
    detail = why + "; " + ", ".join(f"decode DP rank {rt.d_dp} expects {e!r}, reaches {g!r}"
                                    + (f" (prefill DP rank {rt.reached})" if e == g else "") for rt, e, g in wrong)
    rt = wrong[0][0]
    effects: dict[str, str] = {}
    for rel in rels:
        exp, got = ports.dp_route_ids(f.sc, rt, p_own or rel, rel)
        own = ports.dp_engine_id(d.engine_id, rt.d_dp, d.dp_size, rel)
        if got == exp:
            effects[rel.name] = (f"decode DP rank {rt.d_dp}: every DP rank answers for {got!r} (the configured "
                                 f"engine id): the handshake passes with prefill DP rank {rt.reached}'s agent and the "
                                 f"reads take its blocks for requests DP rank {rt.routed} prefilled (wrong KV, no error)")
        elif _has(rel, "engine_id_matches"):
            effects[rel.name] = f"decode DP rank {rt.d_dp}: RuntimeError: {msg_engine_id(exp, got)}"
        elif got == own and _has(rel, "engine_id_conflict"):
            effects[rel.name] = (f"decode DP rank {rt.d_dp}: its own node's listener answers for its own id "
                                 f"{got!r}: AssertionError: Conflict engine id found!")
        else:
            effects[rel.name] = (f"decode DP rank {rt.d_dp}: no engine-id check: {got!r}'s agent is registered as "
                                 f"{exp!r}; the first read raises KeyError")
    exp, got = ports.dp_route_ids(f.sc, rt)
    effects[CORRECTED] = f"refused: answered for {got!r}, expected {exp!r} (set VLLM_NIXL_SIDE_CHANNEL_HOST; one port per DP rank)"
    return _yes("H20", detail, effects)


def _h28(f: Facts, rels: Rels) -> Hazard:
    """fp8 KV caches with dynamic (per-request) scales: the scales are not part of the transfer (vLLM #42179)."""
    dyn = [side for side, i in (("prefill", f.p), ("decode", f.d))
           if i.fp8_dynamic_scales and i.cache_dtype.startswith("fp8")]
    if not dyn:
        return _no("H28", "no fp8 KV cache with dynamic scales")
    effects = {rel.name: shapes.fp8_effects(rel, f.p.cache_dtype, f.p.cache_dtype, dynamic=True)[0] for rel in rels}
    effects[CORRECTED] = "warned: transfer the per-request scales with the blocks, or use static (calibrated) scales"
    return _yes("H28", f"fp8 KV cache with dynamic scales on {' and '.join(dyn)}", effects)


def _x01(f: Facts, rels: Rels) -> Hazard:
    p, d = f.p.pp_size, f.d.pp_size
    effects = {rel.name: shapes.pp_effect(rel, p, d) for rel in rels}
    effects[CORRECTED] = ("each D rank reads the layers of every P stage ((pp_rank, tp_rank) metadata, as 0.26+ "
                          "serve it); a D stage reads the layers it holds; against a P before 0.26, which serves one "
                          "stage per port, refused")  # shapes.stages_unreachable
    return _yes("X01", f"pipeline parallel: prefill pp_size {p}, decode pp_size {d}", effects)


def _x10(f: Facts, rels: Rels) -> Hazard:
    """Hybrid models: which releases refuse them at start-up, hash is_hma_enabled apart, or read which blocks of
    each group (releases.hybrid, the one home of these facts)."""
    g = f.dg.groups
    kinds = ", ".join(f"{gr.kind}{f' {gr.window}' if gr.window else ''} x{gr.layers}" for gr in g) or "full attention"
    hma = {side: i.hma for side, i in (("prefill", f.p), ("decode", f.d)) if i.hma is not None}
    detail = f"KV-cache groups: {kinds}" + "".join(f"; {side} hma = {str(v).lower()}" for side, v in hma.items())
    effects = {rel.name: "; ".join(hybrid.effects(rel, f.pg, f.dg)) or "no hybrid effect" for rel in rels}
    effects[CORRECTED] = "; ".join(hybrid.effects(CORRECTED_MODEL, f.pg, f.dg)) or "no hybrid effect"
    return _yes("X10", detail, effects)


def _x02(f: Facts, rels: Rels) -> Hazard:
    """A backend that writes another layout than the one vLLM resolved and the metadata advertises (#46204)."""
    sides = [f"{side}'s backend writes {i.backend_layout}, its metadata says {i.kv_cache_layout}"
             for side, i in (("prefill", f.p), ("decode", f.d))
             if i.backend_layout is not None and i.backend_layout != i.kv_cache_layout]
    split = f.dg.total_kv_heads // f.d_tp != f.pg.total_kv_heads // f.p_tp
    effects = {rel.name: shapes.backend_layout_effect(rel, f.p.memory_layout(), f.d.memory_layout(), split,
                                                      f.dg.use_mla) for rel in rels}
    effects[CORRECTED] = ("refused where heads split: D checks its own backend's layout (a head slice needs heads-first "
                          "blocks)" if split and not f.dg.use_mla else "whole blocks: accepted")
    return _yes("X02", "; ".join(sides), effects)


def _name(hid: str) -> str:
    return CATALOGUE.get(hid) or SHAPE_CATALOGUE[hid]


def _yes(hid: str, detail: str, effects: dict[str, str]) -> Hazard:
    return Hazard(id=hid, name=_name(hid), applies=True, detail=detail, effects=effects)


def _no(hid: str, detail: str) -> Hazard:
    return Hazard(id=hid, name=_name(hid), applies=False, detail=detail)


EVALUATORS: dict[str, Callable[[Facts, Rels], Hazard]] = {
    "H01": _h01, "H02": _h02, "H03": _h03, "H04": _h04, "H07": _h07, "H08": _h08, "H09": _h09, "H10": _h10,
    "H11": _h11, "H12": _h12, "H13": _h13, "H14": _h14, "H15": _h15, "H17": _h17, "H18": _h18, "H19": _h19, "H20": _h20, "H21": _h21,
    "H23": _h23, "H25": _h25, "H28": _h28,
}


def evaluate(sc: Scenario, releases: Sequence[ReleaseModel]) -> list[Hazard]:
    """Every evaluated hazard, applicable or not, in id order. Effects name each given release (the
    corrected model is skipped if passed: its line is always added under "corrected")."""
    rels = [r for r in releases if r.flow != CORRECTED]
    f = Facts.of(sc, rels)
    out = [EVALUATORS[hid](f, rels) for hid in sorted(EVALUATORS)]
    if sc.prefill.pp_size > 1 or sc.decode.pp_size > 1:
        out.append(_x01(f, rels))
    if any(i.kv_groups or i.hma is not None for i in (sc.prefill, sc.decode)):
        out.append(_x10(f, rels))
    if any(i.backend_layout not in (None, i.kv_cache_layout) for i in (sc.prefill, sc.decode)):
        out.append(_x02(f, rels))
    return out
