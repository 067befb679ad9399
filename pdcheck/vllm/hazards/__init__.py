"""The hazard catalogue (docs/vllm-protocol.md §11) and a pure evaluation of a scenario against it: one module per
family of hazards (blocks, layout, tp, identity, wire, shapes), what they share in base.

`evaluate` looks only at the scenario's facts (both instances' per-rank counts, TP sizes, geometry, layout,
backend, engine ids, kv_transfer_params, device ids) and at what each release model *is* (its flow, wire era
and which checks it has). It starts no process and runs no handshake, so it is an independent cross-check of
what the engine reports: each Hazard says whether the condition holds, names the ranks and numbers, and
gives one line per release of what that release does about it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdcheck.releaseline import CORRECTED
from pdcheck.vllm.hazards.base import (
    CATALOGUE,
    SHAPE_CATALOGUE,
    Facts,
    Hazard,
    NumBlocksSpread,
    Rels,
    block_path,
    ranks_text,
    spread,
)
from pdcheck.vllm.hazards.blocks import _h01, _h02, _h03, _h04
from pdcheck.vllm.hazards.identity import _h18, _h19, _h21, _h23, _h25
from pdcheck.vllm.hazards.layout import _h07, _h08, _h09, _h10
from pdcheck.vllm.hazards.shapes import _h28, _x01, _x02, _x10
from pdcheck.vllm.hazards.tp import _h11, _h12, _h13
from pdcheck.vllm.hazards.wire import _h14, _h15, _h17, _h20
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.scenario import Scenario

EVALUATORS: dict[str, Callable[[Facts, Rels], Hazard]] = {
    "H01": _h01, "H02": _h02, "H03": _h03, "H04": _h04, "H07": _h07, "H08": _h08, "H09": _h09, "H10": _h10,
    "H11": _h11, "H12": _h12, "H13": _h13, "H14": _h14, "H15": _h15, "H17": _h17, "H18": _h18, "H19": _h19,
    "H20": _h20, "H21": _h21, "H23": _h23, "H25": _h25, "H28": _h28,
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


__all__ = ["CATALOGUE", "EVALUATORS", "SHAPE_CATALOGUE", "Facts", "Hazard", "NumBlocksSpread", "block_path",
           "evaluate", "ranks_text", "spread"]
