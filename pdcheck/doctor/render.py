"""The doctor's table: the same facts as its --json document (one row per check, then the transfers, the
suggested exports and, in pair mode, both ends' evidence)."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from pdcheck.doctor.run import Report

STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


def render(report: Report, con: Any) -> None:
    t = Table(title=f"pdcheck doctor ({report.mode})", title_justify="left", show_lines=False)
    for col in ("check", "status", "detail", "fix", "s"):
        t.add_column(col, overflow="fold", justify="right" if col == "s" else "left")
    for c in report.checks:
        st = STYLE[c.status]
        t.add_row(escape(c.name), f"[{st}]{c.status}[/]", escape(c.detail), escape(c.fix or ""), f"{c.seconds:.2f}")
    con.print(t)
    cluster = report.cluster
    if cluster is not None:
        _matrix(cluster, con)
    for tr in report.transfers:
        con.print(f"transfer ({tr.memory} memory): {tr.blocks_checked} blocks checked, {tr.blocks_wrong} wrong, "
                  f"{tr.gbps:.2f} GB/s; payload: {escape(', '.join(tr.data) or 'unknown')}; notifications: "
                  f"{escape(', '.join(tr.notifications) or 'unknown')} (UCX {tr.ucx})")
    pair = report.pair
    if pair is not None:
        for line in getattr(pair, "lines", lambda: [])():
            con.print(escape(line))
    if report.suggested_ucx_net_devices:
        con.print(f"suggested: export UCX_NET_DEVICES={report.suggested_ucx_net_devices}")
    for e in report.exports:
        if "UCX_NET_DEVICES" not in e or not report.suggested_ucx_net_devices:
            con.print(f"to export: {escape(e)}")
    con.print(f"{escape(report.summary)} in {report.seconds:.1f} s")


def _matrix(cluster: Any, con: Any) -> None:
    """One row per pair, broken and slow first: bandwidth and what carried the payload."""
    t = Table(title=f"pairs ({cluster.selection}, {cluster.concurrency} at a time; median {cluster.median_gbps:.2f} "
                    "GB/s)", title_justify="left")
    for col in ("prefill node", "decode node", "status", "GB/s", "payload", "notifications"):
        t.add_column(col, overflow="fold", justify="right" if col == "GB/s" else "left")
    for r in cluster.pairs:
        st = STYLE[r.status]
        t.add_row(escape(r.prefill), escape(r.decode), f"[{st}]{r.status}[/]", f"{r.gbps:.2f}",
                  escape(", ".join(r.data) or "-"), escape(", ".join(r.notifications) or "-"))
    con.print(t)
