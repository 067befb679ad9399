"""TP shape hazards: direction and divisibility (H11), kv_transfer_params' tp_size (H12), replicated KV with
P TP > D TP (H13)."""

from __future__ import annotations

from pdcheck import kvsplit
from pdcheck.releaseline import CORRECTED
from pdcheck.vllm.hazards.base import (
    Facts,
    Hazard,
    Rels,
    _expected,
    _no,
    _plural,
    _v,
    _yes,
    corrected_block_len,
    corrected_reading,
)
from pdcheck.vllm.releases import rules
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.releases.rules import MSG_SHAPE


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
