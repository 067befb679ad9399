"""Every bundled request-path scenario on every TP/DP shape it accepts (issue #37): no scenario, shape or fault
combination of `pdcheck list` crashes. A shape is refused in one line (the plan's bounds), or planned, modelled and
run to a verdict on which the real ranks and the model agree.

* The plan and the model (pure) run every scenario on all 71 shapes of at most 8 ranks, every release it names.
* Real ranks run every scenario on one shape of each kind the request path treats apart (TP equal, P TP < D TP,
  P TP > D TP, DP on both sides, DP on one side), the scenario's newest release and corrected. Which kind a scenario
  gets rotates with the commit (as the wheel suites pick their second release, .ci/run), so every pair is run over
  time; PDCHECK_ALL_SHAPES=1 runs every scenario on every kind (slow: the figure is in docs/requests.md).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pdcheck.errors import BadInput
from pdcheck.kvsplit import divisible
from pdcheck.vllm.requests.plan import build
from pdcheck.vllm.requests.run import expected, run
from pdcheck.vllm.requests.shapes import MAX_RANKS
from pdcheck.vllm.scenario import read_toml

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "pdcheck" / "scenarios" / "requests").glob("*.toml"))
SIZES = (1, 2, 4, 8)
# (P TP, P DP, D TP, D DP), every shape of at most MAX_RANKS ranks whose TP sizes divide
SHAPES = [(pt, pd, dt, dd) for pt in SIZES for dt in SIZES for pd in range(1, MAX_RANKS + 1)
          for dd in range(1, MAX_RANKS + 1) if pt * pd + dt * dd <= MAX_RANKS and divisible(dt, pt)]
# One shape of each kind the request path treats apart (shapes.py, run.py): equal TP, P TP < D TP, P TP > D TP, DP on
# both sides, DP on P's side only, and the widest TP.
KINDS = [(2, 1, 2, 1), (1, 1, 2, 1), (2, 1, 1, 1), (1, 2, 1, 2), (1, 2, 1, 1), (4, 1, 4, 1)]


def _flags(shape: tuple[int, int, int, int]) -> dict[str, dict[str, int]]:
    pt, pd, dt, dd = shape
    return {"prefill": {"tp_size": pt, "dp_size": pd}, "decode": {"tp_size": dt, "dp_size": dd}}


def _plan(path: Path, shape: tuple[int, int, int, int], releases: str | None = None) -> Any:
    """The scenario on that shape, without its [expect] (its verdicts are its own shape's): every release it names,
    or `releases`. None: the shape is refused (one line of bad input)."""
    doc = read_toml(path)
    named = [r for r in doc.get("expect", {}) if r != "corrected"]
    doc = {k: v for k, v in doc.items() if k != "expect"}
    try:
        return build(path, doc, releases or ",".join(named), {}, [], _flags(shape))
    except BadInput as exc:
        assert "\n" not in str(exc)
        return None


def test_the_shapes() -> None:
    assert len(SHAPES) == 71 and len(SCENARIOS) >= 40
    assert set(KINDS) <= set(SHAPES)


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_scenario_plans_and_models_on_every_shape(path: Path) -> None:
    accepted = 0
    for shape in SHAPES:
        plan = _plan(path, shape)
        if plan is None:
            continue
        accepted += 1
        for _name, line in plan.releases:
            outs, _acc = expected(line, plan.options)
            assert len(outs) == plan.options.requests * shape[2], (shape, line.line)
    assert accepted, path.stem


def _commit() -> int:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return int(out.stdout.strip()[:12] or "0", 16)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def _newest(path: Path) -> str:
    """The newest release a scenario names (its [expect]'s last one)."""
    return [r for r in read_toml(path).get("expect", {}) if r != "corrected"][-1]


def _real_cases() -> list[Any]:
    every = os.environ.get("PDCHECK_ALL_SHAPES") == "1"
    turn = _commit()
    cases = []
    for k, path in enumerate(SCENARIOS):
        kinds = [shape for shape in KINDS if _plan(path, shape, _newest(path)) is not None]
        picked = kinds if every else [kinds[(turn + k) % len(kinds)]]
        marks = [pytest.mark.slow] if every else []
        cases += [pytest.param(path, shape, id=f"{path.stem}-{'x'.join(map(str, shape))}", marks=marks)
                  for shape in picked]
    return cases


@pytest.mark.parametrize(("path", "shape"), _real_cases())
def test_every_scenario_runs_on_real_ranks_on_each_kind_of_shape(path: Path, shape: tuple[int, int, int, int]) -> None:
    plan = _plan(path, shape, _newest(path))
    lines = run(plan.releases, plan.options)
    for r in lines:  # a verdict for every (request, D rank), the model's (a disagreement is a harness error)
        assert [(o.request, o.rank, o.verdict) for o in r.outcomes] == \
            [(o.request, o.rank, o.verdict) for o in r.expected], (r.release, r.outcomes, r.expected)
