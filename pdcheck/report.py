"""The handshake report: one msgspec document (--json) and a rich rendering of the same data."""

from __future__ import annotations

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from pdcheck import __version__
from pdcheck import messages as m
from pdcheck.errors import EXIT_HARNESS, EXIT_HAZARD, EXIT_OK
from pdcheck.hazards import Hazard, NumBlocksSpread, evaluate, spread
from pdcheck.releases import CORRECTED
from pdcheck.releases.base import ReleaseModel
from pdcheck.scenario import Scenario


class Timings(msgspec.Struct):
    start_s: float  # launching every rank until all are registered and listening
    run_s: float  # handshakes and transfers
    total_s: float
    setup_ms: dict[str, float] = {}


class DecodeRank(msgspec.Struct):
    tp_rank: int
    num_blocks: int
    device_id: int
    verdicts: dict[str, m.Verdict]  # release name -> verdict; "corrected" included
    transfer: dict[str, m.TransferResult] | None = None
    bypassed: dict[str, m.Verdict] = {}


class PrefillRank(msgspec.Struct):
    tp_rank: int
    num_blocks: int
    device_id: int
    requests_served: int | None
    notifications: list[str] | None
    listener_died: str | None = None


class Report(msgspec.Struct):
    tool: str
    version: str
    scenario: str
    source: str
    releases: list[str]
    device: str
    decode_ranks: list[DecodeRank]
    prefill_ranks: list[PrefillRank]
    num_blocks_spread: dict[str, NumBlocksSpread]
    hazards: list[Hazard]
    requests: list[m.Req]
    harness_errors: list[str]
    survives: dict[str, bool]  # release -> every decode rank ok
    matrix: dict[str, list[str]]  # release -> status per decode rank (corrected included)
    first_surviving: str | None  # the first modelled release (in the order given) that survives
    exit_code: int
    timings: Timings


def _fold_transfer(v: m.Verdict, t: m.TransferResult | None) -> m.Verdict:
    """A handshake that passed but delivered wrong blocks is a silent failure."""
    if t is None or v.status != "ok" or t.status not in ("wrong", "error"):
        return v
    status = "silent" if t.status == "wrong" else "error"
    return msgspec.structs.replace(v, status=status, message=t.message)


def build(sc: Scenario, releases: list[ReleaseModel], device: str, requests: list[m.Req],
          results: dict[int, m.DecodeResult], finals: dict[int, m.PrefillFinal], harness: list[str],
          timings: Timings) -> Report:
    names = [r.name for r in releases]
    decode: list[DecodeRank] = []
    for r in range(sc.decode.tp_size):
        res = results.get(r)
        if res is None:
            continue
        verdicts = {k: _fold_transfer(v, (res.transfer or {}).get(k)) for k, v in res.verdicts.items()}
        decode.append(DecodeRank(r, res.num_blocks, sc.decode.device_id(r), verdicts, res.transfer, res.bypassed))
    prefill = [
        PrefillRank(r, sc.prefill.blocks()[r], sc.prefill.device_id(r),
                    finals[r].served if r in finals else None, finals[r].notifs if r in finals else None,
                    finals[r].listener_dead if r in finals else None)
        for r in range(sc.prefill.tp_size)
    ]
    survives = {
        n: len(decode) == sc.decode.tp_size and all(d.verdicts[n].status == "ok" for d in decode) for n in names
    }
    code = EXIT_HARNESS if harness else (EXIT_OK if all(survives.values()) else EXIT_HAZARD)
    matrix = {n: [d.verdicts[n].status for d in decode] for n in [*names, CORRECTED.name]}
    return Report(
        tool="pdcheck", version=__version__, scenario=sc.name, source=sc.source, releases=names, device=device,
        decode_ranks=decode, prefill_ranks=prefill,
        num_blocks_spread={"prefill": spread(sc.prefill.blocks()), "decode": spread(sc.decode.blocks())},
        hazards=evaluate(sc, releases), requests=requests, harness_errors=harness, survives=survives,
        matrix=matrix, first_surviving=next((n for n in names if survives[n]), None), exit_code=code, timings=timings,
    )


def to_json(rep: Report) -> bytes:
    return msgspec.json.encode(rep)


# ------------------------------------------------------------------------------------------------ rich
_STYLE = {"ok": "green", "assert": "bold red", "silent": "bold magenta", "error": "red", "hang": "yellow"}


def _detail(v: m.Verdict) -> str:
    if v.status == "assert":
        msg = f', "{v.message}"' if v.message else ""
        return f"assert {v.assert_expr}{msg}"
    exc = f"{v.exception}: " if v.exception else ""
    return f"{exc}{v.message or ''}"


def _cell(v: m.Verdict | None, t: m.TransferResult | None, notes: dict[str, str]) -> Text:
    """Three short lines: status and note key, P ranks contacted and num_blocks recorded, transfer."""
    if v is None:
        return Text("-")
    text = Text(v.status.upper(), style=_STYLE.get(v.status, ""))
    if v.status != "ok":
        key = notes.setdefault(_detail(v), chr(ord("a") + len(notes)))
        where = f" @hs{v.handshake}" if v.handshake else ""
        text.append(f" [{key}]{where}")
    rec = v.rank_num_blocks or ({} if v.recorded_num_blocks is None else {-1: v.recorded_num_blocks})
    recs = ",".join(str(x) if k == -1 else f"{x}" for k, x in rec.items()) or "-"
    text.append(f"\nP{','.join(map(str, v.contacted)) or '-'} n={recs}", style="dim")
    if t is not None and t.status != "skipped":
        if t.status == "error":
            text.append("\nxfer ERROR", style="red")
        else:
            text.append(f"\nxfer {t.wrong}/{t.blocks} wrong", style="bold magenta" if t.wrong else "green")
    return text


def render_matrix(rep: Report, console: Console) -> None:
    """Rows are releases, columns decode ranks (a count summary when there are more than 8)."""
    wide = len(rep.decode_ranks) <= 8
    table = Table(title=f"Version matrix: {escape(rep.scenario)}")
    table.add_column("release", no_wrap=True)
    if wide:
        for d in rep.decode_ranks:
            table.add_column(f"D{d.tp_rank}", justify="center")
    else:
        table.add_column("decode ranks")
    for n, row in rep.matrix.items():
        label = n if n == CORRECTED.name else f"vLLM {n}"
        if wide:
            table.add_row(label, *(Text(x, style=_STYLE.get(x, "")) for x in row))
        else:
            counts = {x: row.count(x) for x in dict.fromkeys(row)}
            table.add_row(label, ", ".join(f"{k} {v}" for k, v in counts.items()))
    console.print(table)
    first = rep.first_surviving
    console.print(f"first release that survives: [bold]{first}[/]" if first else "[bold red]no modelled release survives[/]")


def render(rep: Report, console: Console) -> None:
    console.print(f"[bold]pdcheck handshake[/] {escape(rep.scenario)} [dim]({escape(rep.source)}, device {rep.device})[/]")
    for side, sp in rep.num_blocks_spread.items():
        diff = f"; ranks {','.join(map(str, sp.differing))} differ from {sp.mode}" if sp.differing else ""
        console.print(f"  {side} num_blocks: min {sp.min}, max {sp.max}{diff}")
    shown = [*rep.releases, CORRECTED.name]
    table = Table(title="Decode ranks (status, P ranks contacted / num_blocks recorded, transfer proof)")
    table.add_column("D", justify="right")
    table.add_column("blocks", justify="right")
    for n in shown:
        table.add_column(n if n == CORRECTED.name else f"vLLM {n}")
    notes: dict[str, str] = {}
    for d in rep.decode_ranks:
        table.add_row(str(d.tp_rank), str(d.num_blocks),
                      *(_cell(d.verdicts.get(n), (d.transfer or {}).get(n), notes) for n in shown))
    console.print(table)
    for text, key in notes.items():
        console.print(Text(f"  [{key}] {text}"))  # Text: "[a]" must not be read as markup
    for n in shown:
        firsts = [(d.tp_rank, t) for d in rep.decode_ranks
                  if (t := (d.transfer or {}).get(n)) and t.message and t.status != "skipped"]
        if firsts:
            r, t = firsts[0]
            line = f"  transfer {n}, D rank {r}: {t.message}"
            if t.first_mismatch:
                fm = t.first_mismatch
                line += f"; first mismatch: expected {fm.expected}, found {fm.found}"
            console.print(line, highlight=False)
    applied = [h for h in rep.hazards if h.applies]
    if applied:
        ht = Table(title="Hazards that apply (reference §11)", show_lines=True)
        ht.add_column("id")
        ht.add_column("hazard / detail")
        for h in applied:
            eff = "".join(f"\n  {k}: {v}" for k, v in h.effects.items())
            ht.add_row(h.id, Text(h.name, style="bold") + Text(f"\n{h.detail}{eff}"))
        console.print(ht)
    for e in rep.harness_errors:
        console.print(f"[red]harness:[/] {escape(e)}")
    for n, ok in rep.survives.items():
        console.print(f"vLLM {n}: " + ("[green]survives[/]" if ok else "[bold red]fails on this scenario[/]"))
    t = rep.timings
    console.print(f"[dim]{t.total_s:.2f} s (ranks up {t.start_s:.2f} s, handshake+transfer {t.run_s:.2f} s); "
                  f"exit {rep.exit_code}[/]")
