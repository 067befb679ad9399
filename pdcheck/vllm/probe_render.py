"""`pdcheck probe`'s output: the report of a live prefill's side channel as a table (per P rank, the hazards, what
each D rank of the release would do), from the same ProbeReport its --json prints."""

from __future__ import annotations

from typing import Any

from pdcheck.vllm.probe import ProbeReport
from pdcheck.vllm.report import contacted_text
from pdcheck.vllm.results import ProbeRank


def render(rep: ProbeReport, console: Any) -> None:
    """The report as tables. A peer's strings (engine ids, agent names, layouts, backends, hashes) are its own
    text: printed cut to bounds.MAX_PEER_STR and never read as markup; control characters are made visible by
    the console (pdcheck.console)."""
    from rich.table import Table
    from rich.text import Text

    from pdcheck.bounds import peer_text
    from pdcheck.vllm.report import hazard_table, spread_line

    src = "" if rep.release_source == "--vllm" else f", read from {rep.release_source}"
    console.print(f"[bold]pdcheck probe[/] {rep.endpoint} as vLLM {rep.release}{src} (era {rep.wire}, "
                  f"DP rank {rep.dp_rank}, ports {','.join(map(str, rep.ports))}); read-only")
    staged = rep.pp_size > 1
    t = Table(title="Prefill ranks (as the side channel advertises them" +
              (f"; P has {rep.pp_size} pipeline stages: (pp_rank, tp_rank))" if staged else ")"))
    cols = ("P", "status", "num_blocks", "block_len(s)", "block_size", "layout", "device", "backend", "ms")
    for col in (*cols, *(("regions", "layers") if staged else ())):
        t.add_column(col, overflow="fold")  # a narrow terminal folds a header onto two lines, never cuts it
    for r in [*rep.prefill_ranks, *rep.stages]:
        style = "green" if r.status == "ok" else "bold red"
        lens = ",".join(map(str, sorted(set(r.block_lens)))) if r.block_lens else (str(r.block_len or "-"))
        t.add_row(rank_text(r), Text(r.status, style=style), str(r.num_blocks or "-"), lens,
                  str(r.block_size or "-"), Text(peer_text(r.layout or "-")),
                  "-" if r.device_id is None else str(r.device_id), Text(peer_text(r.attn_backend or "-")),
                  "-" if r.reply_ms is None else f"{r.reply_ms:.1f}",
                  *((str(r.regions or "-"), ", ".join(r.layers or []) or "-") if staged else ()))
    console.print(t)
    ok = [r for r in rep.prefill_ranks if r.status == "ok"]
    if ok:
        console.print(f"  engine id(s): {', '.join(sorted({peer_text(r.engine_id or '-') for r in ok}))}; agents: "
                      f"{', '.join(peer_text(r.agent_name or '?') for r in ok)}", highlight=False, markup=False)
        tps = sorted({r.tp_size for r in ok if r.tp_size is not None})
        if tps:
            console.print(f"  advertised tp_size: {', '.join(map(str, tps))}")
        for h in sorted({r.compat_hash for r in ok if r.compat_hash}):
            same = {r.hash_match for r in ok if r.compat_hash == h}
            tail = " (differs from the decode's)" if False in same else " (equals the decode's)" if True in same else ""
            console.print(f"  compatibility hash: {peer_text(h)}{tail}", highlight=False, markup=False)
    for r in [*rep.prefill_ranks, *rep.stages]:
        if r.message:
            console.print(Text(f"  P rank {rank_text(r)}: {r.message}", style="red"))
    if rep.num_blocks_spread is not None:
        console.print(spread_line("num_blocks", rep.num_blocks_spread))
    ht = hazard_table(rep.hazards, f"Hazards against the decode configuration ({rep.decode})")
    if ht is not None:
        console.print(ht)
    elif rep.decode is not None:
        console.print(f"  no catalogue hazard applies against the decode configuration ({rep.decode})")
    for n in rep.notes:
        console.print(Text(f"  note: {n}", style="dim"))
    if rep.decode_status is not None:
        per = ", ".join(f"{v.rank} {v.status}" + (f" (asked {contacted_text(v)})" if v.contacted_stages else "")
                        for v in rep.verdicts)
        console.print(f"  decode handshakes as vLLM {rep.release}: {per}", highlight=False)
        for v in rep.verdicts:
            if v.detail:
                console.print(Text(f"  {v.rank}: {v.detail}", style="red"))
    console.print(f"verdict: {rep.verdict}; exit {rep.exit_code}")


def rank_text(r: ProbeRank) -> str:
    """A probed rank as the side channel keys it: "1", or "(0,1)" (pp_rank, tp_rank) with pipeline stages."""
    return str(r.tp_rank) if r.pp_rank is None else f"({r.pp_rank},{r.tp_rank})"
