"""`pdcheck smoke` for TensorRT-LLM scenarios (framework = "trtllm"): the plan of a file's [expect] eras (the
corrected line always runs), and the cases its run yields, in smoke's own Case shape.

A scenario is one part: its ranks start once and run every line in turn, and a hang is decided when the ranks go
quiet, not by waiting (pdcheck/trtllm/runner.py), so a part costs its ranks' start-up and a few hundred
milliseconds per line whatever it expects."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pdcheck.errors import BadInput
from pdcheck.releaseline import CORRECTED
from pdcheck.seam import SmokeCost
from pdcheck.trtllm import plan as tp
from pdcheck.trtllm import report as tr
from pdcheck.trtllm import runner
from pdcheck.trtllm.eras import resolve
from pdcheck.trtllm.scenario import load


def plan_of(path: Path, hang_timeout_ms: int) -> tp.TrtPlan:
    sc = load(path)
    if not sc.expect:
        raise BadInput(f"{sc.source}: expect: no expected outcomes (add an [expect] table)")
    eras = [k for k in sc.expect if k != CORRECTED]
    if not eras:
        raise BadInput(f"{sc.source}: expect: name at least one era besides corrected")
    # the cap only guards a line whose ranks never go quiet; verdicts never wait for it
    return tp.build(sc, ",".join(eras), tp.TrtOptions(cap_s=max(10.0, 5 * hang_timeout_ms / 1000)))


def cost(plan: tp.TrtPlan) -> SmokeCost:
    sc = plan.scenario
    ranks = sc.ctx.side().world + sc.gen.side().world
    return SmokeCost(ranks=ranks, seconds=0.8 + 0.15 * len(plan.pairs) * ranks)


def run_one(plan: tp.TrtPlan, case: Any) -> list[Any]:
    """case: smoke.Case (passed in: smoke imports this module, never the other way round)."""
    sc = plan.scenario
    t0 = time.perf_counter()
    rep = tr.build(runner.run(plan))
    secs = time.perf_counter() - t0
    world = sc.gen.side().world
    out = []
    for key, exp in sc.expect.items():
        want = list(exp) if isinstance(exp, list) else [exp] * world
        got = rep.corrected if key == CORRECTED else rep.matrix.get(resolve(key).line.name, [])
        msg = "; ".join(rep.harness_errors)
        if got != want and not msg:
            msg = ", ".join(f"gen{i}: {g} (expected {w})" for i, (g, w) in enumerate(zip(got, want, strict=False))
                            if g != w) or f"{len(got)} gen ranks reported, {len(want)} expected"
        out.append(case(sc.name, sc.source, key, got == want and not rep.harness_errors, want, got, secs, msg,
                        framework="trtllm", document=rep))
    return out
