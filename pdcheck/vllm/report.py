"""The handshake report: built from a run's results, one msgspec document (--json, docs/json.md) and a rich
rendering of the same data. Everything the rendering shows is decided in build: the verdicts, the hazards,
the exit code; render only draws the Report."""

from __future__ import annotations

import re
import socket
from typing import TYPE_CHECKING

import msgspec

from pdcheck import messages as m
from pdcheck import verdict
from pdcheck.vllm import messages as vm
from pdcheck.vllm.hazards import Hazard, NumBlocksSpread, evaluate, spread
from pdcheck.vllm.releases import CORRECTED, shapes
from pdcheck.vllm.results import Live, RunResult, Timings

if TYPE_CHECKING:  # rich is imported where a table is drawn: a --json run never imports it
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text


class DecodeRank(msgspec.Struct):
    tp_rank: int
    num_blocks: int
    device_id: int
    verdicts: dict[str, vm.Verdict]  # release name -> verdict; "corrected" included
    transfer: dict[str, m.TransferResult] | None = None
    bypassed: dict[str, vm.Verdict] = {}
    node: str = ""  # where the rank ran: this host's name, or its Ray node (--ray)
    dp_rank: int = 0  # its data-parallel rank (decode.dp_size > 1: one TP group per DP rank)
    when: dict[str, str] = {}  # release -> when its refusal reaches the user (releases.shapes.when_raised)


class PrefillRank(msgspec.Struct):
    tp_rank: int
    num_blocks: int
    device_id: int
    requests_served: int | None
    notifications: list[str] | None
    listener_died: str | None = None
    node: str = ""  # where the rank ran: this host's name, or its Ray node (--ray)
    dp_rank: int = 0


class FailSpan(msgspec.Struct):
    fails: list[str]  # consecutive modelled releases (by number) that fail
    fixed_in: str | None  # the next modelled release, which survives; None: none after them does


class Report(msgspec.Struct):
    """The body of handshake's --json (vLLM); the envelope (pdcheck.envelope) adds tool, version, schema,
    command and framework."""

    scenario: str
    source: str
    releases: list[str]
    device: str
    verdicts: list[verdict.RankVerdict]  # per modelled release and D rank, the shape every framework shares
    decode_ranks: list[DecodeRank]
    prefill_ranks: list[PrefillRank]
    num_blocks_spread: dict[str, NumBlocksSpread]
    hazards: list[Hazard]  # evaluated once, in build; the table and the JSON read this list
    requests: list[vm.Req]
    harness_errors: list[str]
    survives: dict[str, bool]  # release -> every decode rank ok
    matrix: dict[str, list[str]]  # release -> status per decode rank (corrected included)
    first_surviving: str | None  # the first modelled release (in the order given) that survives
    exit_code: int
    timings: Timings
    # By release number: every release that fails, and the first release after a failing one that survives
    # (null when nothing fails, or when the newest modelled release still fails). spans: each run of
    # consecutive failing releases with the release that fixes it.
    fails: list[str] = []
    fixed_in: str | None = None
    fail_spans: list[FailSpan] = []
    live: Live | None = None  # --prefill-endpoint


def _fold_transfer(v: vm.Verdict, t: m.TransferResult | None) -> vm.Verdict:
    """A handshake that passed but delivered wrong blocks is a silent failure."""
    if t is None or v.status != "ok" or t.status not in ("wrong", "error"):
        return v
    status = "silent" if t.status == "wrong" else "error"
    return msgspec.structs.replace(v, status=status, message=t.message)


def build(res: RunResult) -> Report:
    """The report of one run: verdicts folded with the transfer proof, the hazards, the exit code."""
    sc, releases, results, finals, harness = res.scenario, res.releases, res.decode, res.prefill, res.harness
    here = socket.gethostname()
    nodes = res.nodes
    names = [r.name for r in releases]
    decode: list[DecodeRank] = []
    d_tp, p_tp = sc.decode.tp_size, sc.prefill.tp_size
    n_decode = d_tp * sc.decode.dp_size  # DP rank j's TP rank r reports as D rank j * tp_size + r
    for i in range(n_decode):
        dr = results.get(i)
        if dr is None:
            continue
        r = i % d_tp
        verdicts = {k: _fold_transfer(v, (dr.transfer or {}).get(k)) for k, v in dr.verdicts.items()}
        when = {rel.name: w for rel in releases if (v := verdicts.get(rel.name)) is not None
                and (w := shapes.when_raised(rel, v.status, v.check)) is not None}
        decode.append(DecodeRank(r, dr.num_blocks, sc.decode.device_id(r), verdicts, dr.transfer, dr.bypassed,
                                 nodes.get(f"D rank {i}", here), i // d_tp, when))
    prefill = [
        PrefillRank(i % p_tp, sc.prefill.blocks()[i % p_tp], sc.prefill.device_id(i % p_tp),
                    finals[i].served if i in finals else None, finals[i].notifs if i in finals else None,
                    finals[i].listener_dead if i in finals else None, nodes.get(f"P rank {i}", here), i // p_tp)
        for i in range(p_tp * sc.prefill.dp_size)
    ]
    survives = {n: verdict.survives([d.verdicts[n].status for d in decode], n_decode) for n in names}
    code = verdict.exit_code(survives.values(), harness=bool(harness))
    matrix = {n: [d.verdicts[n].status for d in decode] for n in [*names, CORRECTED.name]}
    spans = fail_spans(survives) if not harness else []
    return Report(
        scenario=sc.name, source=sc.source, releases=names, device=res.device,
        verdicts=rank_verdicts(decode, names, sc.decode.dp_size > 1), decode_ranks=decode, prefill_ranks=prefill,
        num_blocks_spread={"prefill": spread(sc.prefill.blocks()), "decode": spread(sc.decode.blocks())},
        hazards=evaluate(sc, releases), requests=res.requests, harness_errors=harness, survives=survives,
        matrix=matrix, first_surviving=next((n for n in names if survives[n]), None), exit_code=code,
        timings=res.timings, fails=[n for sp in spans for n in sp.fails], fixed_in=spans[-1].fixed_in if spans else None,
        fail_spans=spans, live=res.live,
    )


def rank_verdicts(decode: list[DecodeRank], names: list[str], dp: bool) -> list[verdict.RankVerdict]:
    """The common per-rank list (pdcheck.verdict.RankVerdict): release by release, D rank by D rank."""
    out = []
    for n in names:
        for d in decode:
            v = d.verdicts[n]
            t = (d.transfer or {}).get(n)
            out.append(verdict.RankVerdict(
                release=n, rank=verdict.rank_label(d.tp_rank, d.dp_rank, dp), status=v.status,
                detail="" if v.status == "ok" else verdict_detail(v) + (f" ({d.when[n]})" if n in d.when else ""),
                stage=None if v.handshake is None else f"handshake {v.handshake}", contacted=list(v.contacted),
                contacted_stages=list(v.contacted_stages),
                proof=None if t is None else verdict.Proof(
                    status=t.status, blocks=t.blocks, wrong=t.wrong,
                    asserts_stripped=True if v.status == "assert" else None)))
    return out


def _release_key(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name))


def fail_spans(survives: dict[str, bool]) -> list[FailSpan]:
    """Runs of failing releases, in release order, each with the first later release that survives."""
    spans: list[FailSpan] = []
    run: list[str] = []
    for name in sorted(survives, key=_release_key):
        if not survives[name]:
            run.append(name)
        elif run:
            spans.append(FailSpan(run, name))
            run = []
    if run:
        spans.append(FailSpan(run, None))
    return spans


# ------------------------------------------------------------------------------------------------ rich
_STYLE = {"ok": "green", "assert": "bold red", "silent": "bold magenta", "error": "red", "hang": "yellow"}


def _detail(v: vm.Verdict) -> str:
    if v.status == "assert":
        msg = f', "{v.message}"' if v.message else ""
        return f"assert {v.assert_expr}{msg}"
    exc = f"{v.exception}: " if v.exception else ""
    return f"{exc}{v.message or ''}"


def contacted_text(v: vm.Verdict) -> str:
    """The P ranks a D rank contacted: "P0,1", or with pipeline stages on P each as (pp_rank, tp_rank), the key
    vLLM's side channel serves them under: "P(0,0),(1,0)"."""
    if v.contacted_stages:
        return "P" + ",".join(f"({s},{r})" for s, r in zip(v.contacted_stages, v.contacted, strict=False))
    return f"P{','.join(map(str, v.contacted)) or '-'}"


def verdict_detail(v: vm.Verdict) -> str:
    """A failed verdict's one line: the exception or assert, and with pipeline stages on P where it stopped."""
    return _detail(v) + _where(v)


def _where(v: vm.Verdict) -> str:
    """Where a D rank stopped when P has pipeline stages: the stage and TP rank of the last reply."""
    if not v.contacted_stages or not v.contacted:
        return ""
    return f" (at P stage {v.contacted_stages[-1]}, TP rank {v.contacted[-1]})"


def _cell(v: vm.Verdict | None, t: m.TransferResult | None, notes: dict[str, str], when: str | None = None) -> Text:
    """Three short lines: status and note key, P ranks contacted and num_blocks recorded, transfer."""
    from rich.text import Text

    if v is None:
        return Text("-")
    text = Text(v.status.upper(), style=_STYLE.get(v.status, ""))
    if v.status != "ok":
        key = notes.setdefault(_detail(v) + (f" ({when})" if when else ""), chr(ord("a") + len(notes)))
        where = f" @hs{v.handshake}" if v.handshake else ""
        text.append(f" [{key}]{where}")
    rec = v.rank_num_blocks or ({} if v.recorded_num_blocks is None else {-1: v.recorded_num_blocks})
    recs = ",".join(str(x) if k == -1 else f"{x}" for k, x in rec.items()) or "-"
    text.append(f"\n{contacted_text(v)} n={recs}", style="dim")
    if t is not None and t.status != "skipped":
        if t.status == "error":
            text.append("\nxfer ERROR", style="red")
        elif t.status == "arrived":
            text.append(f"\nxfer {t.blocks} arrived, unchecked", style="yellow")
        elif v.status == "assert":  # the release asserted: this transfer is what runs with the asserts stripped
            text.append(f"\nasserts stripped (python -O): {t.wrong}/{t.blocks} wrong",
                        style="bold magenta" if t.wrong else "green")
        else:
            text.append(f"\nxfer {t.wrong}/{t.blocks} wrong", style="bold magenta" if t.wrong else "green")
    return text


_SHORT = {"ok": "ok", "assert": "A", "silent": "S", "error": "E", "hang": "H"}
_LEGEND = {"A": "assert", "S": "silent wrong blocks", "E": "error", "H": "hang"}


def summary(rep: Report) -> str:
    """'fails: 0.9.1 · fixed in 0.9.2' (rich markup), one clause per run of failing releases."""
    if rep.harness_errors:
        return "[bold red]harness errors: verdicts incomplete[/]"
    if not rep.fail_spans:
        return "[green]every release run survives[/]"
    parts = []
    newest = newest_modelled()
    for sp in rep.fail_spans:
        if sp.fixed_in:
            fixed = f"fixed in [bold green]{sp.fixed_in}[/]"
        elif _release_key(sp.fails[-1]) >= newest:
            fixed = "[bold red]no later modelled release survives[/]"
        else:  # the run stopped short of the newest modelled line: say what was not run, not that it fails
            fixed = f"[yellow]no release run after {sp.fails[-1]} survives; later ones not run (--vllm all)[/]"
        parts.append(f"fails: [bold red]{', '.join(sp.fails)}[/] · {fixed}")
    return "; ".join(parts)


def newest_modelled() -> tuple[int, ...]:
    """The first release of the newest modelled line ((0, 34, 0)): a failing run that ends before it has not
    shown that nothing later survives."""
    from pdcheck.vllm.releases import TABLE

    return tuple(TABLE.lines[-1][0])


def reasons(rep: Report) -> list[tuple[list[str], str]]:
    """Why each failing release fails, in the matrix view: the first failing D rank's detail, releases with the
    same detail folded into one line (0.13.0 ... 0.24.0: the older P cannot satisfy the newer D)."""
    by: dict[str, list[str]] = {}
    for v in rep.verdicts:
        if v.status != "ok" and v.release in rep.survives and not rep.survives[v.release]:
            names = by.setdefault(v.detail or v.status, [])
            if v.release not in names and not any(v.release in x for x in by.values() if x is not names):
                names.append(v.release)
    return [(names, text) for text, names in by.items() if names]


def _matrix_table(rep: Report, labels: dict[str, str], short: bool) -> tuple[Table, set[str]]:
    from rich import box
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    per_rank = len(rep.decode_ranks) <= 16
    table = Table(title=f"Version matrix: {escape(rep.scenario)}", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False)
    table.add_column("release", no_wrap=True)
    if per_rank:
        for d in rep.decode_ranks:
            label = f"D{d.dp_rank}.{d.tp_rank}" if rep.prefill_ranks and any(x.dp_rank for x in rep.decode_ranks) \
                else f"D{d.tp_rank}"
            table.add_column(label, justify="center", no_wrap=True)
    else:
        table.add_column("decode ranks")
    used: set[str] = set()
    for n, row in rep.matrix.items():
        if per_rank:
            cells = [_SHORT.get(x, x) if short else x for x in row]
            used.update(c for c in cells if c in _LEGEND)
            table.add_row(labels[n], *(Text(c, style=_STYLE.get(x, "")) for c, x in zip(cells, row, strict=True)))
        else:
            counts = {x: row.count(x) for x in dict.fromkeys(row)}
            table.add_row(labels[n], ", ".join(f"{k} {v}" for k, v in counts.items()))
    return table, used


def render_live(rep: Report, console: Console) -> None:
    """--prefill-endpoint: the live P, what could be checked, and the releases not run against it."""
    from rich.text import Text

    if rep.live is None:
        return
    lv = rep.live
    console.print(f"  live prefill {lv.endpoint}: vLLM {lv.prefill_release} (era {lv.prefill_wire}), "
                  f"{len(lv.probe)} rank(s) probed; no fake P started", highlight=False)
    console.print(Text(f"  KV content: {lv.content}"))
    for name, why in lv.skipped.items():
        console.print(Text(f"  vLLM {name}: {why}", style="yellow"))
    for n in lv.notes:
        console.print(Text(f"  note: {n}", style="dim"))


def placement(rep: Report) -> str | None:
    """'P ranks 0-7 on A; D ranks 0-7 on B' when ranks ran anywhere but this one host (--ray), else None."""
    where: dict[str, dict[str, list[int]]] = {}
    for side, ranks in (("P", rep.prefill_ranks), ("D", rep.decode_ranks)):
        for r in ranks:
            where.setdefault(r.node, {}).setdefault(side, []).append(r.tp_rank)
    if set(where) <= {socket.gethostname(), ""}:
        return None
    return "; ".join(f"{side} ranks {_span(ids)}" + f" on {node}"
                     for node, sides in where.items() for side, ids in sides.items())


def _span(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) \
        else ",".join(map(str, ids))


def render_matrix(rep: Report, console: Console) -> None:
    """Rows are releases, columns decode ranks. Whole status words when the table fits the terminal, else
    one-letter codes with a legend (never a truncated word); a count per status past 16 ranks."""
    from rich.measure import Measurement
    from rich.text import Text

    labels = {n: n if n == CORRECTED.name else f"vLLM {n}" for n in rep.matrix}
    table, used = _matrix_table(rep, labels, short=False)
    natural = Measurement.get(console, console.options.update_width(10**4), table).maximum
    if natural > console.width:
        table, used = _matrix_table(rep, labels, short=True)
    console.print(table)
    if (at := placement(rep)) is not None:
        console.print(Text(f"placement: {at}", style="dim"))
    if used:
        console.print("[dim]" + " · ".join(f"{k} = {_LEGEND[k]}" for k in _LEGEND if k in used) + "[/]")
    for names, text in reasons(rep):
        console.print(Text(f"  {_names(names)}: {text}"))
    for h in rep.hazards:
        if h.applies and any(n in h.effects and not rep.survives.get(n, True) for n in rep.survives):
            console.print(Text(f"  {h.id} {h.name}", style="dim"))
    console.print(summary(rep))


def _names(names: list[str]) -> str:
    """'0.13.0-0.24.0 (9 releases)' for a long run of releases, else the names."""
    return f"{names[0]}-{names[-1]} ({len(names)} releases)" if len(names) > 3 else ", ".join(names)


def spread_line(what: str, sp: NumBlocksSpread) -> str:
    """'  prefill num_blocks: min 111488, max 112448; ranks 0,6 differ from 111488'."""
    diff = f"; ranks {','.join(map(str, sp.differing))} differ from {sp.mode}" if sp.differing else ""
    return f"  {what}: min {sp.min}, max {sp.max}{diff}"


def hazard_table(hazards: list[Hazard], title: str) -> Table | None:
    """The catalogue hazards that apply, one row each with their effects; None when none applies."""
    from rich.table import Table
    from rich.text import Text

    applied = [h for h in hazards if h.applies]
    if not applied:
        return None
    ht = Table(title=title, show_lines=True)
    ht.add_column("id")
    ht.add_column("hazard / detail")
    for h in applied:
        eff = "".join(f"\n  {k}: {v}" for k, v in h.effects.items())
        ht.add_row(h.id, Text(h.name, style="bold") + Text(f"\n{h.detail}{eff}"))
    return ht


def render(rep: Report, console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    console.print(f"[bold]pdcheck handshake[/] {escape(rep.scenario)} [dim]({escape(rep.source)}, device {rep.device})[/]")
    render_live(rep, console)
    for side, sp in rep.num_blocks_spread.items():
        console.print(spread_line(f"{side} num_blocks", sp))
    if (at := placement(rep)) is not None:
        console.print(Text(f"  placement: {at}"))
    shown = [*rep.releases, CORRECTED.name]
    table = Table(title="Decode ranks (status, P ranks contacted / num_blocks recorded, transfer proof)")
    dp = any(d.dp_rank for d in rep.decode_ranks)
    if dp:
        table.add_column("DP", justify="right")
    table.add_column("D", justify="right")
    table.add_column("blocks", justify="right")
    for n in shown:
        table.add_column(n if n == CORRECTED.name else f"vLLM {n}")
    notes: dict[str, str] = {}
    for d in rep.decode_ranks:
        table.add_row(*([str(d.dp_rank)] if dp else []), str(d.tp_rank), str(d.num_blocks),
                      *(_cell(d.verdicts.get(n), (d.transfer or {}).get(n), notes, d.when.get(n)) for n in shown))
    console.print(table)
    for text, key in notes.items():
        console.print(Text(f"  [{key}] {text}"))  # Text: "[a]" must not be read as markup
    for n in shown:
        firsts = [(d, t) for d in rep.decode_ranks
                  if (t := (d.transfer or {}).get(n)) and t.message and t.status != "skipped"]
        if firsts:
            d, t = firsts[0]
            line = f"  transfer {n}, {'DP rank ' + str(d.dp_rank) + ' ' if dp else ''}D rank {d.tp_rank}: {t.message}"
            if t.first_mismatch:
                fm = t.first_mismatch
                line += f"; first mismatch: expected {fm.expected}, found {fm.found}"
            console.print(line, highlight=False)
    ht = hazard_table(rep.hazards, "Hazards that apply")
    if ht is not None:
        console.print(ht)
    for e in rep.harness_errors:
        console.print(f"[red]harness:[/] {escape(e)}")
    for n, ok in rep.survives.items():
        console.print(f"vLLM {n}: " + ("[green]survives[/]" if ok else "[bold red]fails on this scenario[/]"))
    t = rep.timings
    console.print(f"[dim]{t.total_s:.2f} s (ranks up {t.start_s:.2f} s, handshake+transfer {t.run_s:.2f} s); "
                  f"exit {rep.exit_code}[/]")
