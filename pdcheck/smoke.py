"""`pdcheck smoke`: run every scenario of a directory and check each one's [expect] table, for CI."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdcheck import handshake as hs
from pdcheck import report, verdict
from pdcheck.errors import EXIT_BAD_INPUT, BadInput, HarnessError
from pdcheck.plan import Plan, RunOptions, build
from pdcheck.releases import CORRECTED, resolve
from pdcheck.scenario import load, read_toml


class Case(msgspec.Struct):
    """One [expect] entry of one scenario: a release's expected verdicts against the ones the run gave
    (docs/json.md)."""

    scenario: str  # the scenario's name
    file: str  # the scenario file it came from
    release: str  # the [expect] key as written ("0.9.1", "corrected")
    passed: bool  # got == expected, and the harness did not fail
    expected: list[str]  # per D rank (`requests` scenarios: per request), the verdict the file expects
    got: list[str]  # ... and the one the run gave ([] when the scenario could not run)
    seconds: float  # the whole scenario's run, shared by its cases
    message: str = ""  # why it failed: the ranks that differ, or the harness error
    framework: str = "vllm"  # "vllm" | "sglang"


class SmokeReport(msgspec.Struct):
    """The body of smoke's --json; the envelope (pdcheck.envelope) adds tool, version, schema, command and
    framework (null: a directory may mix frameworks; each case names its own)."""

    directory: str
    cases: list[Case]
    passed: int
    failed: int
    seconds: float
    exit_code: int  # pdcheck.verdict's rule over the cases: 0 every case passed, else 1


MAX_SCENARIOS = 1000
REQUESTS_PREFIX = "requests-"  # scenarios of `pdcheck requests` (pdcheck.requests.plan's format)
REQUESTS_DIR = "requests"  # ... and every scenario of this subdirectory (the bundled ones live in scenarios/requests)


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


def requests_plans(directory: Path) -> list[object]:
    """Every requests-*.toml's plan, checked before anything runs; each must have an [expect] table."""
    from pdcheck.requests.command import build_plan

    plans = []
    for f in requests_files(directory)[:MAX_SCENARIOS]:
        plan = build_plan(f, None, {}, [])
        if not plan.expect:
            raise BadInput(f"{f}: expect: no expected outcomes (add an [expect] table)")
        plans.append(plan)
    return plans


def run_requests(plan: object) -> list[Case]:
    """One request-path scenario: a case per [expect] release (verdict per request)."""
    from pdcheck.requests.command import execute

    t0 = time.perf_counter()
    rep = execute(plan)
    secs = time.perf_counter() - t0
    return [Case(rep.scenario, plan.source, e.release, e.passed, e.expected, e.got, secs,  # type: ignore[attr-defined]
                 "" if e.passed else ", ".join(f"request {i}: {g} (expected {w})" for i, (g, w) in
                                               enumerate(zip(e.got, e.expected, strict=False)) if g != w)
                 or f"{len(e.got)} requests reported, {len(e.expected)} expected")
            for e in rep.expectations]


def discover(directory: Path, opts: RunOptions) -> list[Any]:
    """The plan of every *.toml of the directory (its [expect] releases), validated exactly as `handshake`
    validates a file, before anything runs."""
    try:
        if not directory.is_dir():
            raise BadInput(f"{directory}: not a directory of scenarios")
        # SGLang's scenarios (framework = "sglang") live in a sglang/ folder beside vLLM's
        files = sorted(directory.glob("*.toml")) + sorted(directory.glob("sglang/*.toml"))
    except OSError as exc:
        raise BadInput(f"{directory}: cannot list: {exc.strerror}") from None
    req = set(requests_files(directory))
    files = [f for f in files if f not in req]  # `pdcheck requests` scenarios: run_requests
    if not files and not requests_files(directory):
        raise BadInput(f"{directory}: no *.toml scenarios")
    if len(files) > MAX_SCENARIOS:
        raise BadInput(f"{directory}: {len(files)} scenarios; at most {MAX_SCENARIOS}")
    plans: list[Any] = []
    scenarios = []
    for f in files:
        if read_toml(f).get("framework") == "sglang":  # SGLang's plan (pdcheck.sglang.smoke)
            from pdcheck.sglang import smoke as sg

            plans.append(sg.plan_of(f, opts.hang_timeout_ms))
        else:
            scenarios.append(load(f))
    for sc in scenarios:
        if not sc.expect:
            raise BadInput(f"{sc.source}: expect: no expected outcomes (add an [expect] table)")
        plans.append(build(sc, ",".join(r for r in sc.expect if r != CORRECTED.name), opts, where=sc.source))
    return plans


def run_one(plan: Plan) -> list[Case]:
    sc = plan.scenario
    t0 = time.perf_counter()
    try:
        rep = report.build(hs.run(plan))
    except HarnessError as exc:  # this scenario could not run (a port taken, a rank that never started): its
        # cases fail with the reason, and the job goes on to the other scenarios
        secs = time.perf_counter() - t0
        return [Case(sc.name, sc.source, release, False, _want(sc, exp), [], secs, f"harness error: {exc}")
                for release, exp in sc.expect.items()]
    secs = time.perf_counter() - t0
    cases = []
    for release, exp in sc.expect.items():
        want = _want(sc, exp)
        got = rep.matrix.get(resolve(release).name if release != CORRECTED.name else release, [])
        msg = "; ".join(rep.harness_errors)
        if got != want and not msg:
            diff = [f"D{i}: {g} (expected {w})" for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
            msg = ", ".join(diff) or f"{len(got)} decode ranks reported, {len(want)} expected"
        cases.append(Case(sc.name, sc.source, release, got == want and not rep.harness_errors, want, got, secs, msg))
    return cases


def _want(sc: Any, exp: str | list[str]) -> list[str]:
    """A release's expected verdict per decode rank (one verdict: the same for every rank)."""
    return list(exp) if isinstance(exp, list) else [exp] * (sc.decode.tp_size * sc.decode.dp_size)


def _run_sglang(plan: Any) -> list[Case]:
    from pdcheck.sglang import smoke as sg

    return sg.run_one(plan, Case)


def run(directory: Path, opts: RunOptions) -> SmokeReport:
    plans = discover(directory, opts)
    req_plans = requests_plans(directory)
    t0 = time.perf_counter()
    cases = [c for plan in plans for c in (run_one(plan) if isinstance(plan, Plan) else _run_sglang(plan))]
    cases += [c for plan in req_plans for c in run_requests(plan)]
    failed = sum(not c.passed for c in cases)
    return SmokeReport(str(directory), cases, len(cases) - failed, failed, time.perf_counter() - t0,
                       verdict.exit_code(c.passed for c in cases))


def junit(rep: SmokeReport) -> bytes:
    """JUnit XML: one testsuite per scenario, one testcase per release (GitHub and GitLab render it)."""
    root = ET.Element("testsuites", name="pdcheck smoke", tests=str(len(rep.cases)), failures=str(rep.failed),
                      time=f"{rep.seconds:.3f}")
    by_scenario: dict[str, list[Case]] = {}
    for c in rep.cases:
        by_scenario.setdefault(c.scenario, []).append(c)
    for name, cases in by_scenario.items():
        suite = ET.SubElement(root, "testsuite", name=name, tests=str(len(cases)),
                              failures=str(sum(not c.passed for c in cases)), errors="0",
                              time=f"{cases[0].seconds:.3f}")
        for c in cases:
            tc = ET.SubElement(suite, "testcase", classname=f"pdcheck.{name}", name=f"{c.framework} {c.release}",
                               file=c.file, time=f"{c.seconds / len(cases):.3f}")
            if not c.passed:
                fail = ET.SubElement(tc, "failure", message=c.message, type="ExpectationMismatch")
                fail.text = f"expected {c.expected}\ngot      {c.got}"
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def render(rep: SmokeReport, console: Console) -> None:
    table = Table(title=f"pdcheck smoke: {escape(rep.directory)}")
    for col in ("scenario", "release", "result", "decode ranks", "detail"):
        table.add_column(col, no_wrap=col in ("scenario", "release", "result"))
    for c in rep.cases:
        summary = ", ".join(f"{k} {c.got.count(k)}" for k in dict.fromkeys(c.got)) or "-"
        table.add_row(escape(c.scenario), c.release, "[green]pass[/]" if c.passed else "[bold red]FAIL[/]", summary,
                      escape(c.message))
    console.print(table)
    console.print(f"{rep.passed} passed, {rep.failed} failed in {rep.seconds:.1f} s")


__all__ = ["EXIT_BAD_INPUT", "SmokeReport", "junit", "render", "run"]
