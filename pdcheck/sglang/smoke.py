"""`pdcheck smoke` for SGLang scenarios (framework = "sglang"): the plan of a file's [expect] releases, and the
cases its run yields, in smoke's own Case shape."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pdcheck.errors import BadInput
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


def run_one(plan: sp.SgPlan, case: Any) -> list[Any]:
    """case: smoke.Case (passed in: smoke imports this module, never the other way round)."""
    sc = plan.scenario
    t0 = time.perf_counter()
    rep = sr.build(runner.run(plan))
    secs = time.perf_counter() - t0
    out = []
    for release, exp in sc.expect.items():
        want = list(exp) if isinstance(exp, list) else [exp] * sc.decode.tp_size
        got = rep.matrix.get(resolve(release).name, [])
        msg = "; ".join(rep.harness_errors)
        if got != want and not msg:
            msg = ", ".join(f"D{i}: {g} (expected {w})" for i, (g, w) in enumerate(zip(got, want, strict=False))
                            if g != w) or f"{len(got)} decode ranks reported, {len(want)} expected"
        out.append(case(sc.name, sc.source, release, got == want and not rep.harness_errors, want, got, secs, msg,
                        framework="sglang"))
    return out
