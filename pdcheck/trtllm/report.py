"""The TensorRT-LLM run's report: one typed document (--json, docs/json.md) and the rich table rendered from it,
never apart. Verdicts and the exit code come from pdcheck.verdict, as every framework's do; the corrected line
is reported beside the eras and never sets the exit code."""

from __future__ import annotations

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdcheck import verdict
from pdcheck.releaseline import CORRECTED
from pdcheck.trtllm.messages import GenResult
from pdcheck.trtllm.runner import LineResult, TrtRunResult

COLOR = {"ok": "green", "silent": "bold red", "assert": "red", "error": "red", "hang": "yellow"}


class TrtReport(msgspec.Struct):
    """The body of `handshake --trtllm`'s --json; the envelope (pdcheck.envelope) adds tool, version, schema,
    command and framework."""

    scenario: str
    source: str
    issue: str
    summary: str  # one line: which eras fail and how, next to corrected
    matrix: dict[str, list[str]]  # era -> observed status per gen rank
    corrected: list[str]  # the corrected line's status per gen rank
    agree: bool  # the pure engine predicted every observed status
    verdicts: list[verdict.RankVerdict]  # per era and gen rank, the shape every framework shares
    lines: list[LineResult]  # TensorRT-LLM's own section: observed, model and what each ctx rank logged
    attributions: list[str]  # releases named by number: attributed from dates, not from a wheel
    skipped: list[str]  # eras `all` left out for this scenario, and why
    harness_errors: list[str]
    seconds: float
    exit_code: int


def detail(line: LineResult, r: int) -> str:
    """One line per gen rank: what happened, and what the ctx it reads logged about it."""
    v = line.observed[r]
    text = v.message
    if v.status in ("hang", "error") and v.stage not in ("info", "inquire"):
        logged = [x for c in v.contacted if c < len(line.ctx) for x in line.ctx[c].logs]
        if logged:
            text += f"; ctx rank {v.contacted[0]} logged: {logged[0]}"
            if len(logged) > 1:
                text += f" | {logged[1]}"
    return text


def build(res: TrtRunResult) -> TrtReport:
    harness = list(dict.fromkeys(h for x in res.lines for h in x.harness))
    eras = [x for x in res.lines if x.name != CORRECTED]
    corrected = next((x for x in res.lines if x.name == CORRECTED), None)
    matrix = {x.name: [v.status for v in x.observed] for x in eras}
    agree = all([v.status for v in x.observed] == [p.status for p in x.model] for x in res.lines if not x.harness)
    verdicts = [verdict.RankVerdict(release=x.name, rank=f"gen{r}", status=v.status, detail=detail(x, r),
                                    stage=v.stage or None, contacted=list(v.contacted), proof=_proof(v))
                for x in eras for r, v in enumerate(x.observed)]
    survived = [verdict.survives(s, len(s)) for s in matrix.values()]
    code = verdict.exit_code(survived, harness=bool(harness))
    return TrtReport(res.scenario, res.source, res.issue, summary(matrix, corrected), matrix,
                     [v.status for v in corrected.observed] if corrected else [], agree, verdicts, res.lines,
                     [x.attribution for x in res.lines if x.attribution], res.skipped, harness, res.seconds, code)


def _proof(v: GenResult) -> verdict.Proof | None:
    if v.proof is None:
        return None
    return verdict.Proof(status=v.proof.status, blocks=v.proof.rows, wrong=v.proof.wrong)


def summary(matrix: dict[str, list[str]], corrected: LineResult | None) -> str:
    bad: dict[str, list[str]] = {}
    for name, statuses in matrix.items():
        worst = next((s for s in ("silent", "hang", "error", "assert") if s in statuses), None)
        if worst is not None:
            bad.setdefault(worst, []).append(name)
    parts = [f"{s}: {', '.join(names)}" for s, names in bad.items()] or ["every era survives"]
    if corrected is not None:
        parts.append(f"corrected: {', '.join(sorted(set(v.status for v in corrected.observed)))}")
    return " · ".join(parts)


def _cell(status: str) -> str:
    return f"[{COLOR.get(status, 'white')}]{status}[/]"


def _what(line: LineResult, r: int) -> str:
    text = escape(detail(line, r))
    return f"[yellow]{text}[/]" if line.observed[r].status == "hang" else text


def render(rep: TrtReport, console: Console) -> None:
    title = f"pdcheck handshake (TensorRT-LLM): {escape(rep.scenario)}"
    if rep.issue:
        title += f" [dim]({escape(rep.issue)})[/]"
    table = Table(title=title)
    for col in ("era", "gen", "verdict", "stage", "model", "fixed"):
        table.add_column(col, no_wrap=True)
    table.add_column("what happens", min_width=36, ratio=1)
    corrected = next((x for x in rep.lines if x.name == CORRECTED), None)
    for line in rep.lines:
        if line.name == CORRECTED:
            continue
        for r, v in enumerate(line.observed):
            fixed = corrected.observed[r].status if corrected and r < len(corrected.observed) else ""
            name = line.name if line.ctx_line == line.gen_line else f"{line.ctx_line} -> {line.gen_line}"
            table.add_row(escape(name) if r == 0 else "", str(r), _cell(v.status), v.stage,
                          _cell(line.model[r].status), _cell(fixed), _what(line, r))
    console.print(table)
    if corrected is not None:
        for r, v in enumerate(corrected.observed):
            console.print(f"corrected gen{r}: {_cell(v.status)} {escape(detail(corrected, r))}")
    for a in rep.attributions:
        console.print(f"[dim]{escape(a)}[/]")
    for s in rep.skipped:
        console.print(f"[dim]not run: {escape(s)}[/]")
    for h in rep.harness_errors:
        console.print(f"[red]harness:[/] {escape(h)}")
    if not rep.agree:
        console.print("[bold red]the pure engine's prediction differs from what the ranks did (column model)[/]")
    console.print(f"[dim]{escape(rep.summary)}; {rep.seconds:.2f} s; exit {rep.exit_code}[/]")
