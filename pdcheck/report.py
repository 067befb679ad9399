"""The handshake report: one msgspec document (--json) and a rich rendering of the same data."""

from __future__ import annotations

import msgspec
from rich.console import Console
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
          timings: Timings, transfer: bool) -> Report:
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
    return Report(
        tool="pdcheck", version=__version__, scenario=sc.name, source=sc.source, releases=names, device=device,
        decode_ranks=decode, prefill_ranks=prefill,
        num_blocks_spread={"prefill": spread(sc.prefill.blocks()), "decode": spread(sc.decode.blocks())},
        hazards=evaluate(sc, releases), requests=requests, harness_errors=harness, survives=survives,
        exit_code=code, timings=timings,
    )


def to_json(rep: Report) -> bytes:
    return msgspec.json.encode(rep)


# ------------------------------------------------------------------------------------------------ rich
_STYLE = {"ok": "green", "assert": "bold red", "silent": "bold magenta", "error": "red", "hang": "yellow"}


def _cell(v: m.Verdict | None) -> Text:
    if v is None:
        return Text("-")
    t = Text(v.status.upper(), style=_STYLE.get(v.status, ""))
    if v.status == "assert":
        where = f" (handshake {v.handshake}, P rank {v.remote_rank})" if v.handshake else ""
        t.append(f"{where}\nassert {v.assert_expr}")
        if v.message:
            t.append(f', "{v.message}"')
    elif v.status != "ok" and v.message:
        exc = f"{v.exception}: " if v.exception else ""
        t.append(f"\n{exc}{v.message}")
    return t


def _transfer_cell(t: m.TransferResult | None) -> Text:
    if t is None:
        return Text("-")
    if t.status == "skipped":
        return Text("skipped", style="dim")
    if t.status == "error":
        return Text(f"ERROR {t.message}", style="red")
    txt = Text(f"{t.wrong}/{t.blocks} wrong", style="bold magenta" if t.wrong else "green")
    if t.first_mismatch:
        fm = t.first_mismatch
        txt.append(f"\nfirst: expected {fm.expected}\n       found {fm.found}")
    return txt


def render(rep: Report, console: Console) -> None:
    console.print(f"[bold]pdcheck handshake[/] {rep.scenario} [dim]({rep.source})[/]  device={rep.device}")
    for side, sp in rep.num_blocks_spread.items():
        diff = f", ranks {', '.join(map(str, sp.differing_ranks))} differ from {sp.mode}" if sp.differing_ranks else ""
        console.print(f"  {side} num_blocks: min {sp.min}, max {sp.max}{diff}")
    shown = [n for n in rep.releases] + [CORRECTED.name]
    table = Table(show_lines=True, title="Decode ranks")
    table.add_column("D rank", justify="right")
    table.add_column("num_blocks", justify="right")
    for n in shown:
        table.add_column(f"vLLM {n}" if n != CORRECTED.name else "corrected")
        table.add_column("contacted / recorded", justify="right")
    has_transfer = any(d.transfer for d in rep.decode_ranks)
    if has_transfer:
        for n in shown:
            table.add_column(f"transfer {n}")
    for d in rep.decode_ranks:
        row: list[Text | str] = [str(d.tp_rank), str(d.num_blocks)]
        for n in shown:
            v = d.verdicts.get(n)
            row.append(_cell(v))
            if v is None:
                row.append("-")
            else:
                rec = v.rank_num_blocks or ({} if v.recorded_num_blocks is None else {"": v.recorded_num_blocks})
                recs = ", ".join(f"P{k}:{x}" if k != "" else str(x) for k, x in rec.items()) or "none"
                row.append(f"P {','.join(map(str, v.contacted)) or '-'}\n{recs}")
        if has_transfer:
            for n in shown:
                row.append(_transfer_cell((d.transfer or {}).get(n)))
        table.add_row(*row)
    console.print(table)
    applied = [h for h in rep.hazards if h.applies]
    if applied:
        ht = Table(title="Hazards that apply", show_lines=True)
        ht.add_column("id")
        ht.add_column("hazard")
        ht.add_column("detail")
        for h in applied:
            eff = "\n".join(f"{k}: {v}" for k, v in h.effects.items())
            ht.add_row(h.id, h.name, h.detail + (f"\n{eff}" if eff else ""))
        console.print(ht)
    for e in rep.harness_errors:
        console.print(f"[red]harness:[/] {e}")
    for n, ok in rep.survives.items():
        console.print(f"vLLM {n}: " + ("[green]survives[/]" if ok else "[bold red]fails on this scenario[/]"))
    t = rep.timings
    console.print(f"[dim]{t.total_s:.2f} s (ranks up {t.start_s:.2f} s, handshake+transfer {t.run_s:.2f} s); "
                  f"exit {rep.exit_code}[/]")
