"""`pdcheck smoke` for SGLang scenarios (framework = "sglang"): the plan of a file's [expect] releases, and the
cases its run yields, in smoke's own Case shape."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from pdcheck.errors import BadInput
from pdcheck.seam import SmokeCost
from pdcheck.sglang import plan as sp
from pdcheck.sglang import report as sr
from pdcheck.sglang import runner
from pdcheck.sglang.releases import resolve
from pdcheck.sglang.scenario import load


def plan_of(path: Path, hang_timeout_ms: int) -> sp.SgPlan:
    sc = load(path)
    if not sc.expect:
        raise BadInput(f"{sc.source}: expect: no expected outcomes (add an [expect] table)")
    return sp.build(sc, ",".join(sc.expect), sp.SgOptions(hang_timeout_s=hang_timeout_ms / 1000))


def split(plan: sp.SgPlan) -> list[sp.SgPlan]:
    """One plan per release pair: each pair runs on its own ranks and bootstrap server (runner.run_pair), so
    smoke may run them side by side."""
    return [msgspec.structs.replace(plan, pairs=[pair]) for pair in plan.pairs] if plan.live is None else [plan]


def cost(plan: sp.SgPlan) -> SmokeCost:
    """Ranks alive at once (every P rank and D rank of a pair) and seconds: start-up plus, per pair expected to
    hang, the hang window it waits out."""
    sc = plan.scenario
    p, d = sc.prefill.side(), sc.decode.side()
    names = {pair.name for pair in plan.pairs}
    hangs = sum(1 for rel, exp in sc.expect.items() if resolve(rel).name in names
                and "hang" in (exp if isinstance(exp, list) else [exp]))
    return SmokeCost(ranks=p.tp_size * p.pp_size * p.dp_size + d.tp_size,
                     seconds=1.0 * len(plan.pairs) + hangs * plan.options.hang_timeout_s)


def run_one(plan: sp.SgPlan, case: Any) -> list[Any]:
    """case: smoke.Case (passed in: smoke imports this module, never the other way round). The cases of the
    [expect] releases the plan's pairs cover (all of them, unless split() cut the plan)."""
    sc = plan.scenario
    t0 = time.perf_counter()
    rep = sr.build(runner.run(plan))
    secs = time.perf_counter() - t0
    out = []
    names = set(plan.names)
    for release, exp in sc.expect.items():
        if resolve(release).name not in names:
            continue
        want = list(exp) if isinstance(exp, list) else [exp] * sc.decode.tp_size
        got = rep.matrix.get(resolve(release).name, [])
        msg = "; ".join(rep.harness_errors)
        if got != want and not msg:
            msg = ", ".join(f"D{i}: {g} (expected {w})" for i, (g, w) in enumerate(zip(got, want, strict=False))
                            if g != w) or f"{len(got)} decode ranks reported, {len(want)} expected"
        out.append(case(sc.name, sc.source, release, got == want and not rep.harness_errors, want, got, secs, msg,
                        framework="sglang", document=rep))
    return out
