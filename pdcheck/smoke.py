"""`pdcheck smoke`: run every scenario of a directory and check each one's [expect] table, for CI. The file's
`framework` key picks the framework (pdcheck.frameworks) that plans and runs it and yields its cases."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdcheck import frameworks, verdict
from pdcheck.errors import EXIT_BAD_INPUT, BadInput
from pdcheck.frameworks import Framework, SmokeOptions
from pdcheck.scenario import read_toml


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


def scenario_files(directory: Path) -> list[Path]:
    """Every *.toml of the directory and of each registered framework's scenario subdirectories."""
    try:
        if not directory.is_dir():
            raise BadInput(f"{directory}: not a directory of scenarios")
        subs = dict.fromkeys(d for fw in frameworks.all_frameworks() for d in fw.scenario_dirs if d)
        files = sorted(directory.glob("*.toml"))
        for sub in subs:
            files += sorted(directory.glob(f"{sub}/*.toml"))
    except OSError as exc:
        raise BadInput(f"{directory}: cannot list: {exc.strerror}") from None
    if not files:
        raise BadInput(f"{directory}: no *.toml scenarios")
    if len(files) > MAX_SCENARIOS:
        raise BadInput(f"{directory}: {len(files)} scenarios; at most {MAX_SCENARIOS}")
    return files


def discover(directory: Path, opts: SmokeOptions) -> list[tuple[Framework, Any]]:
    """(framework, plan) of every scenario file, each validated by its framework (the file's `framework`
    key picks it) exactly as its commands validate a file, before anything runs."""
    plans = []
    for f in scenario_files(directory):
        fw, _ = frameworks.pick(read_toml(f).get("framework"), {}, str(f), command="smoke")
        plans.append((fw, fw.smoke_plan(f, opts)))
    return plans


def run(directory: Path, opts: SmokeOptions) -> SmokeReport:
    plans = discover(directory, opts)
    t0 = time.perf_counter()
    cases = [c for fw, plan in plans for c in fw.smoke_run(plan, Case)]
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
