"""Rendering: an nccl-tests-style rich table, JSON / JSONL / CSV documents, and the optional plot."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pdcheck import figure
from pdcheck.bench import schema


def human(n: float) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{int(n // div)}{unit}"
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def _f(x: float | None, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}"


def _us(x: float) -> str:
    return _f(x, 1 if x < 1000 else 0)


COLUMNS = ("bs", "block", "tokens", "size", "descs", "merged", "time(us)", "GB/s", "%memcpy", "%wire",
           "p50(us)", "p90", "p99", "p999", "max", "#wrong")
# The columns a narrow terminal loses first (the rest say what a row measured and whether it was right).
OPTIONAL = ("p999", "p90", "merged", "block", "%wire", "max", "tokens", "%memcpy")


def _table(report: schema.Report, cols: list[str]) -> Table:
    tab = Table(box=None, header_style="bold", pad_edge=False, show_edge=False)
    for col in cols:
        tab.add_column(col, justify="right", no_wrap=True)

    def row(cells: dict[str, str], **kw: object) -> None:
        tab.add_row(*(cells.get(c, "") for c in cols), **kw)  # type: ignore[arg-type]

    for r in report.rows:
        row({"bs": str(r.block_tokens), "block": human(r.block_bytes), "tokens": str(r.tokens),
             "size": human(r.bytes), "descs": str(r.desc_count),
             "merged": "-" if r.desc_count_merged is None else str(r.desc_count_merged), "time(us)": _us(r.time_us),
             "GB/s": _f(r.gbps, 2) + ("*" if r.cache_hot else ""), "%memcpy": _f(r.pct_memcpy, 0),
             "%wire": _f(r.pct_wire, 0), "p50(us)": _us(r.p50_us), "p90": _us(r.p90_us), "p99": _us(r.p99_us),
             "p999": _us(r.p999_us), "max": _us(r.max_us), "#wrong": str(r.wrong)},
            style="red" if r.wrong else None, end_section=r is report.rows[-1])
    cl = report.ceilings
    p50 = sorted(r.wire_p50_us for r in report.rows)[len(report.rows) // 2] if report.rows else float("nan")
    row({"bs": "memcpy", "GB/s": _f(cl.memcpy_gbps, 2), "%memcpy": "100"}, style="dim")
    row({"bs": "wire", "block": "1 desc", "descs": "1", "merged": "1", "GB/s": _f(cl.wire_gbps, 2),
         "%memcpy": _f(100 * cl.wire_gbps / cl.memcpy_gbps, 0) if cl.memcpy_gbps else "-", "%wire": "100",
         "p50(us)": _us(p50)}, style="dim")
    return tab


def _fitted(report: schema.Report, console: Console) -> tuple[Table, list[str]]:
    """The table at the console's width: optional columns dropped, least needed first, until it fits (a
    wrapped row or a broken header word reads worse than a column fewer); the dropped ones named."""
    from rich.measure import Measurement

    cols, left_out = list(COLUMNS), []
    tab = _table(report, cols)
    for name in OPTIONAL:
        if Measurement.get(console, console.options.update_width(10**4), tab).maximum <= console.width:
            break
        cols.remove(name)
        left_out.append(name)
        tab = _table(report, cols)
    return tab, left_out


def render(report: schema.Report, console: Console) -> None:
    c, t, e = report.config, report.transport, report.env
    shape = (f"{c.layers} layers, MLA latent {c.head_dim}" if c.mla
             else f"{c.layers} layers, {c.kv_heads} KV heads x {c.head_dim}")
    mem = "GPU memory (VRAM)" if c.device == "cuda" else "host memory (DRAM)"
    pins = ", ".join(f"{k} -> core {','.join(map(str, v))}" if v else f"{k} unpinned" for k, v in e.pinning.items())
    head = [
        f"# pdcheck transfer-bench: {c.model} ({shape}, {c.dtype}), prefill TP{c.prefill_tp} -> decode "
        f"TP{c.decode_tp}, {c.operation}, {mem}",
        f"# transport: {', '.join(t.data) or 'unknown'} for data; {', '.join(t.notifications) or 'unknown'} for "
        f"notifications{'' if c.notif else ' (none sent)'}; error mode {t.error_mode}",
        f"# NIXL progress thread {'ON' if t.progress_thread else 'off (the bench polls; no thread spins)'}; "
        f"target {t.target_progress}; {t.summary}",
        f"# pinning: {pins}; LLC {human(int(e.host.get('llc_bytes') or 0))}; run length {c.run_length} "
        f"(1 = fully scattered); seed {c.seed}",
        f"# NIXL {e.nixl}, UCX {e.ucx}, host {e.host.get('hostname')} ({e.host.get('cpu')}, "
        f"{e.host.get('usable_cpus')} cores)",
    ]
    for line in head:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for cost in t.costs:
        console.print(f"# cost of this transport: {cost}", style="yellow", highlight=False, markup=False,
                      soft_wrap=True)

    tab, left_out = _fitted(report, console)
    console.print(tab)
    if left_out:
        console.print(f"# left out to fit {console.width} columns: {', '.join(left_out)} (--json, --csv have them)",
                      highlight=False, markup=False, soft_wrap=True)

    cl = report.ceilings
    wrong = sum(r.wrong for r in report.rows)
    checked = sum(r.checked for r in report.rows)
    console.print(f"# #wrong blocks : {wrong} of {checked} checked  {'FAILED' if wrong else 'OK'}",
                  style="red" if wrong else None, highlight=False, markup=False)
    for r in report.rows:
        if r.first_wrong:
            console.print(f"#   first wrong in {r.label}: {r.first_wrong}", style="red", highlight=False, markup=False)
    console.print(f"# ceilings (median over rows): memcpy {_f(cl.memcpy_gbps, 2)} GB/s ({cl.memcpy_method}); "
                  f"wire {_f(cl.wire_gbps, 2)} GB/s ({cl.wire_method})", highlight=False, markup=False,
                  soft_wrap=True)
    console.print("# GB/s is decimal (1e9 B/s), one direction; size = bytes per transfer; * = cache-hot row",
                  highlight=False, markup=False)
    fl = report.floors
    if fl.min_bw_gbps is not None or fl.max_p99_us is not None:
        verdict = "FAILED: " + "; ".join(fl.failures) if fl.failures else "OK"
        console.print(f"# floors (--min-bw {fl.min_bw_gbps} GB/s, --max-p99 {fl.max_p99_us} us): {verdict}",
                      style="red" if fl.failures else None, highlight=False, markup=False, soft_wrap=True)
    for w in report.warnings:
        console.print(f"! {w}", style="yellow", highlight=False, markup=False, soft_wrap=True)


def jsonl_lines(report: schema.Report) -> list[schema.Header | schema.RowLine | schema.SummaryLine]:
    """--jsonl's bodies: a header, one line per row, then the summary (each written under the envelope)."""
    lines: list[schema.Header | schema.RowLine | schema.SummaryLine] = [
        schema.Header(config=report.config, env=report.env, transport=report.transport)]
    lines += [schema.RowLine(row=r) for r in report.rows]
    lines.append(schema.SummaryLine(ok=report.ok, ceilings=report.ceilings, floors=report.floors,
                                    warnings=report.warnings))
    return lines


def to_csv(report: schema.Report) -> str:
    buf = io.StringIO()
    fields = [f for f in schema.Row.__struct_fields__]
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(fields)
    for r in report.rows:
        w.writerow(["" if getattr(r, f) is None else getattr(r, f) for f in fields])
    return buf.getvalue()


def plot(report: schema.Report, path: Path) -> None:
    plt = figure.pyplot()
    rows = report.rows
    by_block = len(set(report.config.block_sizes)) > 1
    xs = [r.block_bytes if by_block else r.bytes for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(xs, [r.gbps for r in rows], "o-", label="KV READ")
    ax1.axhline(report.ceilings.memcpy_gbps, ls="--", color="grey", label="memcpy (1 thread)")
    ax1.axhline(report.ceilings.wire_gbps, ls=":", color="black", label="wire (1 descriptor)")
    ax1.set_ylabel("GB/s (1e9)")
    ax1.set_ylim(bottom=0)
    ax2.plot(xs, [r.p99_us for r in rows], "o-", color="tab:red", label="p99")
    ax2.plot(xs, [r.p50_us for r in rows], "o--", color="tab:orange", label="p50")
    ax2.set_ylabel("latency per transfer (µs)")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block bytes" if by_block else "bytes per transfer")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    c = report.config
    fig.suptitle(f"{c.model} {c.dtype}, TP{c.prefill_tp}->TP{c.decode_tp}, transport {report.transport.preset} "
                 f"({', '.join(report.transport.data) or 'unknown'})", fontsize=10)
    figure.save(fig, path)
