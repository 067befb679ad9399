"""The SGLang run's report: one typed document (--json, docs/json.md) and the rich table rendered from it,
never apart. Its verdicts and exit code come from pdcheck.verdict, as vLLM's do."""

from __future__ import annotations

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdcheck import verdict
from pdcheck.sglang.runner import SgPairResult, SgRunResult

COLOR = {"ok": "green", "silent": "bold red", "assert": "red", "error": "red", "hang": "yellow"}


class SgReport(msgspec.Struct):
    """The body of `handshake --sglang`'s --json; the envelope (pdcheck.envelope) adds tool, version, schema,
    command and framework."""

    scenario: str
    source: str
    issue: str
    matrix: dict[str, list[str]]  # release -> observed status per D rank
    agree: bool  # the pure engine predicted every observed status
    verdicts: list[verdict.RankVerdict]  # per release and D rank, the shape every framework shares
    pairs: list[SgPairResult]  # SGLang's own section: observed, model and corrected per pair
    harness_errors: list[str]
    seconds: float
    exit_code: int


def build(res: SgRunResult) -> SgReport:
    harness = [h for p in res.pairs for h in p.harness]
    matrix = {p.release: [v.status for v in p.observed] for p in res.pairs}
    agree = all([v.status for v in p.observed] == [v.status for v in p.model] for p in res.pairs)
    verdicts = [verdict.RankVerdict(
        release=p.release, rank=verdict.rank_label(r), status=v.status, detail=v.message or v.warning or "",
        stage=v.stage, contacted=list(v.p_ranks),
        proof=None if t is None else verdict.Proof(status=t.status, blocks=t.blocks, wrong=t.wrong))
        for p in res.pairs for r, v in enumerate(p.observed)
        for t in [p.transfers[r] if r < len(p.transfers) else None]]
    code = verdict.exit_code(
        [verdict.survives([v.status for v in p.observed], len(p.observed)) for p in res.pairs], harness=bool(harness))
    return SgReport(res.scenario, res.source, res.issue, matrix, agree, verdicts, res.pairs, harness, res.seconds,
                    code)


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
