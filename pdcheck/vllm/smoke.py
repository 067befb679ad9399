"""`pdcheck smoke` for vLLM's scenarios: a handshake scenario (its [expect] per release and D rank) or a
request-path one (per release and request), planned, costed and run into smoke's cases."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcheck.errors import BadInput, HarnessError
from pdcheck.seam import (
    SmokeCost,
    SmokeOptions,
)

NAME = "vllm"  # the framework's name (pdcheck/vllm/framework.py): smoke's cases carry it
REQUESTS_PREFIX = "requests-"  # scenarios of `pdcheck requests` (pdcheck.vllm.requests.plan's format)
REQUESTS_DIR = "requests"  # ... and every scenario of this subdirectory (the bundled ones live in scenarios/requests)


def is_requests_file(path: Path) -> bool:
    """A `pdcheck requests` scenario: requests-*.toml, or any file of a requests/ directory."""
    return path.name.startswith(REQUESTS_PREFIX) or path.parent.name == REQUESTS_DIR

def requests_files(directory: Path) -> list[Path]:
    """`pdcheck requests` scenarios: requests-*.toml here, and every *.toml of ./requests (or of this directory
    when it is a requests/ directory)."""
    try:
        if directory.name == REQUESTS_DIR:
            return sorted(directory.glob("*.toml"))
        sub = directory / REQUESTS_DIR
        return sorted({*directory.glob(f"{REQUESTS_PREFIX}*.toml"), *(sub.glob("*.toml") if sub.is_dir() else [])})
    except OSError:
        return []


def plan(path: Path, options: SmokeOptions) -> Any:
    from pdcheck.vllm.commands import load, requests_plan

    if is_requests_file(path):
        plan = requests_plan(path, None, {}, [])
        if not plan.expect:
            raise BadInput(f"{path}: expect: no expected outcomes (add an [expect] table)")
        return plan
    from pdcheck.vllm.plan import RunOptions, build
    from pdcheck.vllm.releases import CORRECTED

    sc = load(path, {})
    if not sc.expect:
        raise BadInput(f"{sc.source}: expect: no expected outcomes (add an [expect] table)")
    opts = RunOptions(transfer=options.transfer, hang_timeout_ms=options.hang_timeout_ms)
    return build(sc, ",".join(r for r in sc.expect if r != CORRECTED.name), opts, where=sc.source)


def run(plan: Any, case: Callable[..., Any]) -> list[Any]:
    from pdcheck.vllm.plan import Plan

    return _smoke_handshake(plan, case) if isinstance(plan, Plan) else _smoke_requests(plan, case)


def count(plan: Any) -> int:
    from pdcheck.vllm.plan import Plan

    return len(plan.scenario.expect if isinstance(plan, Plan) else plan.expect)


def phase(plan: Any) -> str:
    from pdcheck.vllm.plan import Plan

    return "handshake" if isinstance(plan, Plan) else "requests"


def cost(part: Any) -> SmokeCost:
    from pdcheck.vllm.plan import Plan

    if not isinstance(part, Plan):  # one P and one D rank; each release line (and corrected) in turn
        from pdcheck.vllm.requests.model import run_end

        o = part.options
        per_line = run_end(o.requests, o.rate, o.faults, o.settle_s) + (o.lease_s or 0.5)
        return SmokeCost(ranks=2, seconds=(len(part.releases) + 1) * per_line)
    sc = part.scenario
    # Each D rank runs the releases one after another: a hanging one waits out the whole hang timeout.
    hangs = sum(1 for exp in sc.expect.values() if "hang" in (exp if isinstance(exp, list) else [exp]))
    groups = max(1, len(part.dp) + len(part.dp_idle))
    return SmokeCost(ranks=sc.prefill.tp_size + sc.decode.tp_size,
                     seconds=groups * (0.5 + 0.1 * (sc.prefill.tp_size + sc.decode.tp_size))
                     + hangs * part.options.hang_timeout_ms / 1000)


def _smoke_requests(plan: Any, case: Callable[..., Any]) -> list[Any]:
    """One request-path scenario: a case per [expect] release (verdict per request)."""
    from pdcheck.vllm.commands import requests_execute

    t0 = time.perf_counter()
    try:
        rep = requests_execute(plan)
    except HarnessError as exc:  # this scenario could not run: its cases fail with the reason, the job goes on
        secs = time.perf_counter() - t0
        return [case(plan.name, plan.source, release, False, want, [], secs, f"harness error: {exc}",
                     framework=NAME) for release, want in plan.expect.items()]
    secs = time.perf_counter() - t0
    return [case(rep.scenario, plan.source, e.release, e.passed, e.expected, e.got, secs,
                 "" if e.passed else ", ".join(f"request {i}: {g} (expected {w})" for i, (g, w) in
                                               enumerate(zip(e.got, e.expected, strict=False)) if g != w)
                 or f"{len(e.got)} requests reported, {len(e.expected)} expected", framework=NAME,
                 document=rep)
            for e in rep.expectations]


def _smoke_handshake(plan: Any, case: Callable[..., Any]) -> list[Any]:
    from pdcheck.vllm import handshake as hs
    from pdcheck.vllm import report
    from pdcheck.vllm.releases import CORRECTED, resolve

    sc = plan.scenario
    t0 = time.perf_counter()
    try:
        rep = report.build(hs.run(plan))
    except HarnessError as exc:  # this scenario could not run (a port taken, a rank that never started): its
        # cases fail with the reason, and the job goes on to the other scenarios
        secs = time.perf_counter() - t0
        return [case(sc.name, sc.source, release, False, _want(sc, exp), [], secs, f"harness error: {exc}",
                     framework=NAME) for release, exp in sc.expect.items()]
    secs = time.perf_counter() - t0
    cases = []
    for release, exp in sc.expect.items():
        want = _want(sc, exp)
        got = rep.matrix.get(resolve(release).name if release != CORRECTED.name else release, [])
        msg = "; ".join(rep.harness_errors)
        if got != want and not msg:
            diff = [f"D{i}: {g} (expected {w})" for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
            msg = ", ".join(diff) or f"{len(got)} decode ranks reported, {len(want)} expected"
        cases.append(case(sc.name, sc.source, release, got == want and not rep.harness_errors, want, got, secs, msg,
                          framework=NAME, document=rep))
    return cases


def _want(sc: Any, exp: str | list[str]) -> list[str]:
    """A release's expected verdict per decode rank (one verdict: the same for every rank)."""
    return list(exp) if isinstance(exp, list) else [exp] * (sc.decode.tp_size * sc.decode.dp_size)
