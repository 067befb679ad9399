"""The SGLang run's report: one typed document (--json) and the rich table rendered from it, never apart."""

from __future__ import annotations

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdcheck.errors import EXIT_HARNESS, EXIT_HAZARD, EXIT_OK
from pdcheck.sglang.runner import SgPairResult, SgRunResult

COLOR = {"ok": "green", "silent": "bold red", "assert": "red", "error": "red", "hang": "yellow"}


class SgReport(msgspec.Struct):
    framework: str
    scenario: str
    source: str
    issue: str
    matrix: dict[str, list[str]]  # release -> observed status per D rank
    agree: bool  # the pure engine predicted every observed status
    pairs: list[SgPairResult]
    harness_errors: list[str]
    seconds: float
    exit_code: int


def build(res: SgRunResult) -> SgReport:
    harness = [h for p in res.pairs for h in p.harness]
    matrix = {p.release: [v.status for v in p.observed] for p in res.pairs}
    agree = all([v.status for v in p.observed] == [v.status for v in p.model] for p in res.pairs)
    hazard = any(s != "ok" for row in matrix.values() for s in row)
    code = EXIT_HARNESS if harness else EXIT_HAZARD if hazard else EXIT_OK
    return SgReport("sglang", res.scenario, res.source, res.issue, matrix, agree, res.pairs, harness, res.seconds,
                    code)


def to_json(rep: SgReport) -> bytes:
    return msgspec.json.encode(rep)


def _cell(status: str) -> str:
    return f"[{COLOR.get(status, 'white')}]{status}[/]"


def render(rep: SgReport, console: Console) -> None:
    title = f"pdcheck handshake (SGLang NIXL): {escape(rep.scenario)}"
    if rep.issue:
        title += f" [dim]({escape(rep.issue)})[/]"
    table = Table(title=title)
    for col in ("release", "D", "verdict", "stage", "model", "fixed"):
        table.add_column(col, no_wrap=True)
    table.add_column("what happens", min_width=36, ratio=1)
    for p in rep.pairs:
        rel = p.release if p.p_release == p.d_release else f"{p.p_release} -> {p.d_release}"
        for r, v in enumerate(p.observed):
            detail = v.message or (v.warning or "")
            if v.status == "hang":
                detail = f"[yellow]waits {'forever' if v.timeout_s is None else f'{v.timeout_s:g} s'}[/]: " + \
                    escape(detail)
            else:
                detail = escape(detail)
            if v.status == "ok" and p.transfers[r] is not None:
                detail = f"{p.transfers[r].blocks} pages WRITten and checked by coordinate" + (
                    f"; {escape(v.warning)}" if v.warning else "")
            table.add_row(escape(rel) if r == 0 else "", str(r), _cell(v.status), v.stage,
                          _cell(p.model[r].status), _cell(p.corrected.status), detail)
    console.print(table)
    for h in rep.harness_errors:
        console.print(f"[red]harness:[/] {escape(h)}")
    if not rep.agree:
        console.print("[bold red]the pure engine's prediction differs from what the ranks did (column model)[/]")
    console.print(f"[dim]{rep.seconds:.2f} s; exit {rep.exit_code}[/]")
