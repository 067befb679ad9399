"""What every hazard evaluator shares: the catalogue, the Hazard record, the scenario's facts (Facts) and what a
release model is, read off its data (which ranks it targets, the block length it expects)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from pdcheck import kvsplit
from pdcheck.geometry import Geometry
from pdcheck.releaseline import CORRECTED
from pdcheck.vllm.releases import registered_geometry, rules
from pdcheck.vllm.releases.base import ReleaseModel
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


Rels = Sequence[ReleaseModel]


def _name(hid: str) -> str:
    return CATALOGUE.get(hid) or SHAPE_CATALOGUE[hid]


def _yes(hid: str, detail: str, effects: dict[str, str]) -> Hazard:
    return Hazard(id=hid, name=_name(hid), applies=True, detail=detail, effects=effects)


def _no(hid: str, detail: str) -> Hazard:
    return Hazard(id=hid, name=_name(hid), applies=False, detail=detail)
