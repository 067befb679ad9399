"""`pdcheck smoke`: run every scenario of a directory and check each one's [expect] table, for CI. The file's
`framework` key picks the framework (pdcheck.frameworks) that plans and runs it and yields its cases.

Scenarios run side by side (`-j`): most of a scenario's time is waiting (hang timeouts, leases, restarts) while
the cores idle. Each part (a scenario, or the independent parts its framework splits it into) runs in a thread of
this process, its ranks forked from the one forkserver; a part is admitted while the rank processes alive stay
within a budget from the cores (docs/performance.md, "smoke"). Every part has its own launcher, ports from the OS,
rank-log directory and orchestration, so parts never see each other. The cases come out in file order, as
one at a time."""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdcheck import frameworks, verdict
from pdcheck.errors import EXIT_BAD_INPUT, BadInput
from pdcheck.scenariofile import read_toml
from pdcheck.seam import PHASES, Framework, SmokeCost, SmokeOptions


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
MAX_JOBS = 64


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


@dataclasses.dataclass(frozen=True)
class Select:
    """Which scenarios run (`--framework`, `--phase`, `-k`): every filter given must match."""

    frameworks: tuple[str, ...] = ()
    phases: tuple[str, ...] = ()
    names: tuple[str, ...] = ()  # substrings of the scenario's file name (without .toml)
    flags: tuple[tuple[str, str], ...] = ()  # (parameter, flag) given: every selected framework must take them

    def check(self) -> None:
        for name in self.frameworks:
            frameworks.get(name)  # BadInput naming the known ones
        for ph in self.phases:
            if ph not in PHASES:
                raise BadInput(f"--phase: expected one of {', '.join(PHASES)}, got {ph!r}")


def discover(directory: Path, opts: SmokeOptions, select: Select = Select()) -> list[tuple[Framework, Any, Path]]:
    """(framework, plan, file) of every scenario file the filters keep, each validated by its framework (the file's
    `framework` key picks it) exactly as its commands validate a file, before anything runs."""
    select.check()
    plans = []
    for f in scenario_files(directory):
        if select.names and not any(k in f.stem for k in select.names):
            continue
        doc = read_toml(f)
        if select.frameworks and (frameworks.declared(doc) or frameworks.DEFAULT) not in select.frameworks:
            continue
        fw, _ = frameworks.pick(doc, {}, str(f), command="smoke")
        frameworks.check_flags(fw, "smoke", select.flags)
        plan = fw.smoke_plan(f, opts)
        if select.phases and fw.smoke_phase(plan) not in select.phases:
            continue
        plans.append((fw, plan, f))
    if not plans:
        raise BadInput(f"{directory}: no scenario matches the filters (--framework, --phase, -k)")
    return plans


def default_jobs() -> int:
    """Parts at once: a scenario mostly waits, so several per core (docs/performance.md, "smoke")."""
    return max(2, 5 * _cores())


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def rank_budget(load: float | None = None) -> int:
    """Rank processes alive at once that the scheduler admits parts up to: starting a rank (its NIXL agent,
    its KV registration) is the CPU-bound part of a run; a part larger than the budget runs when it is alone.
    On a machine other work already loads (the 1-minute load average, `load`, above LOADED_PER_CORE per core
    when a part is admitted, as `make -l` looks), half of it: a request-path scenario's leases are absolute
    lengths (docs/scenarios-and-flags.md, `pdcheck smoke`), and every rank more stretches its ranks' waits."""
    budget = 10 * _cores()
    if load is not None and load > LOADED_PER_CORE * _cores():
        return budget // 2
    return budget


LOADED_PER_CORE = 3.0


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, SIGHUP) during smoke: the report of the scenarios that had finished."""

    def __init__(self, report: SmokeReport) -> None:
        super().__init__("interrupted")
        self.report = report


@dataclasses.dataclass
class _Part:
    scenario: int  # index into the plans, file order
    index: int  # its place among its scenario's parts
    fw: Framework
    plan: Any
    cost: SmokeCost
    document: Any = None  # the report body its run gave (a framework passes it as case(..., document=body))

    def case(self, *args: Any, document: Any = None, **kw: Any) -> Case:
        """The `case` a framework's smoke_run calls for each of its cases; `document` (its run's report, the
        body `pdcheck handshake|requests --json` would print) is kept for `smoke --documents`."""
        if document is not None:
            self.document = document
        return Case(*args, **kw)


class Document(msgspec.Struct, frozen=True):
    """One scenario part's report, as `smoke --documents DIR` writes it (docs/json.md)."""

    name: str  # the file's stem: the scenario's name, `.partK` after it when its framework split it
    command: str  # the phase: the command whose --json this is
    framework: str
    body: Any


def run(directory: Path, opts: SmokeOptions, jobs: int = 1, select: Select = Select(),
        on_case: Callable[[Case, int, int], None] | None = None,
        documents: list[Document] | None = None) -> SmokeReport:
    """Every selected scenario, `jobs` parts at once. on_case(case, done, total) as each case is known (from
    the main thread; total: the cases expected). `documents`, when given, gets each finished part's report
    (file order). Raises Interrupted with what finished on a signal."""
    plans = discover(directory, opts, select)
    parts = [_Part(i, k, fw, part, fw.smoke_cost(part)) for i, (fw, plan, _f) in enumerate(plans)
             for k, part in enumerate(fw.smoke_split(plan))]
    n_parts = {i: sum(1 for p in parts if p.scenario == i) for i in range(len(plans))}
    total = sum(fw.smoke_count(plan) for fw, plan, _f in plans)
    t0 = time.perf_counter()
    results: dict[int, dict[int, list[Case]]] = {}  # scenario -> part index -> its cases
    done = 0

    def report() -> SmokeReport:
        cases = [c for i in sorted(results) if len(results[i]) == n_parts[i] for c in _merged(results[i])]
        if documents is not None:
            documents[:] = [_document(p, *plans[p.scenario][1:], n_parts[p.scenario]) for p in parts
                            if p.document is not None and len(results.get(p.scenario, {})) == n_parts[p.scenario]]
        failed = sum(not c.passed for c in cases)
        return SmokeReport(str(directory), cases, len(cases) - failed, failed, time.perf_counter() - t0,
                           verdict.exit_code(c.passed for c in cases))

    def finished(part: _Part, cases: list[Case]) -> None:
        nonlocal done
        results.setdefault(part.scenario, {})[part.index] = cases
        for c in cases:
            done += 1
            if on_case is not None:
                on_case(c, done, total)

    if jobs <= 1:  # one at a time, in this thread
        try:
            for part in parts:
                finished(part, part.fw.smoke_run(part.plan, part.case))
        except KeyboardInterrupt:
            raise Interrupted(report()) from None
        return report()
    from pdcheck import launcher

    launcher.warm_up()  # the forkserver from this (the main) thread: it must ignore the signals (lifecycle)
    _run_parallel(parts, jobs, finished, report)
    return report()


def _run_parallel(parts: list[_Part], jobs: int, finished: Callable[[_Part, list[Case]], None],
                  report: Callable[[], SmokeReport]) -> None:
    """Parts in worker threads, the largest and then the longest first, while at most `jobs` run and their ranks
    fit rank_budget()
    (a part alone always runs). Results are handed to `finished` in this thread. A signal stops every rank
    of every part (launcher.abort_all), waits for the workers to clean up, and raises Interrupted."""
    from pdcheck import launcher

    # The parts that need most of the rank budget first (left to the end, each would run alone there), then
    # longest first.
    pending = sorted(parts, key=lambda p: (2 * p.cost.ranks <= rank_budget(), -p.cost.seconds))
    running: dict[int, _Part] = {}
    done_q: queue.Queue[tuple[int, list[Case] | None, BaseException | None]] = queue.Queue()
    threads: list[threading.Thread] = []

    def work(key: int, part: _Part) -> None:
        try:
            done_q.put((key, part.fw.smoke_run(part.plan, part.case), None))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it there
            done_q.put((key, None, exc))

    try:
        key = 0
        while pending or running:
            used = sum(p.cost.ranks for p in running.values())
            budget = rank_budget(_load())
            while pending and len(running) < jobs:
                fit = next((p for p in pending if used + p.cost.ranks <= budget), None)
                if fit is None:
                    if running:
                        break
                    fit = pending[0]
                pending.remove(fit)
                key += 1
                running[key] = fit
                used += fit.cost.ranks
                t = threading.Thread(target=work, args=(key, fit), name=f"pdcheck-smoke-{key}", daemon=True)
                threads.append(t)
                t.start()
            try:
                got, cases, exc = done_q.get(timeout=0.5)
            except queue.Empty:
                continue
            part = running.pop(got)
            if exc is not None:
                raise exc
            assert cases is not None
            finished(part, cases)
    except KeyboardInterrupt:
        launcher.abort_all()
        _join(threads, 10.0)
        raise Interrupted(report()) from None
    except BaseException:
        launcher.abort_all("stopped")
        _join(threads, 10.0)
        raise




def _join(threads: list[threading.Thread], timeout_s: float) -> None:
    """Wait for the workers to close their launchers (every rank reaped); a second signal meanwhile is only
    recorded (lifecycle), so this wait is not cut short."""
    from pdcheck import launcher

    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if not any(t.is_alive() for t in threads):  # nothing left that could start a rank: an in-process caller
        launcher.reset_abort()                 # (the tests' CLI runner) may run again


def _document(part: _Part, plan: Any, file: Path, n_parts: int) -> Document:
    name = file.stem
    return Document(name if n_parts == 1 else f"{name}.part{part.index}", part.fw.smoke_phase(plan), part.fw.name,
                    part.document)


def write_documents(directory: Path, documents: list[Document]) -> None:
    """Each part's report as DIR/NAME.json: the document `pdcheck <phase> NAME --json` prints (the envelope's
    exit code is the report's own)."""
    from pdcheck.bounds import write_out
    from pdcheck.envelope import document

    for d in documents:
        body = document(d.command, d.framework, getattr(d.body, "exit_code", None), d.body)
        write_out("--documents", directory / f"{d.name}.json", msgspec.json.encode(body) + b"\n")


def _merged(parts: dict[int, list[Case]]) -> list[Case]:
    """A scenario's cases from its parts, in part order; `seconds` is the scenario's: its parts' sum."""
    if len(parts) == 1:
        return parts[0]
    secs = sum(cases[0].seconds for cases in parts.values() if cases)
    return [msgspec.structs.replace(c, seconds=secs) for k in sorted(parts) for c in parts[k]]


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


def render(rep: SmokeReport, console: Console, interrupted: bool = False) -> None:
    """The table of cases; interrupted: of the scenarios that finished before the signal."""
    table = Table(title=f"pdcheck smoke: {escape(rep.directory)}" + (" (interrupted)" if interrupted else ""))
    for col in ("scenario", "release", "result", "decode ranks", "detail"):
        table.add_column(col, no_wrap=col in ("scenario", "release", "result"))
    for c in rep.cases:
        summary = ", ".join(f"{k} {c.got.count(k)}" for k in dict.fromkeys(c.got)) or "-"
        table.add_row(escape(c.scenario), c.release, "[green]pass[/]" if c.passed else "[bold red]FAIL[/]", summary,
                      escape(c.message))
    console.print(table)
    console.print(f"{rep.passed} passed, {rep.failed} failed in {rep.seconds:.1f} s"
                  + ("; interrupted: only the scenarios that finished are listed" if interrupted else ""))


__all__ = ["EXIT_BAD_INPUT", "SmokeReport", "junit", "render", "run"]
