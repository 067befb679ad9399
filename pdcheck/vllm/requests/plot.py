"""`pdcheck requests --plot FILE`: P's blocks held over time and each request's latency, one line per release
and the corrected path, drawn from the report (the same struct --json encodes), with P's restarts, the faults
aimed at one request, and each line's expiry (abort timeout / lease) marked. matplotlib is optional
(pdcheck[plot]) and imported only here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdcheck import figure
from pdcheck.vllm.requests.report import OK, RequestsReport


def write(rep: RequestsReport, path: Path) -> None:
    plt = figure.pyplot()
    fig, (held, lat) = plt.subplots(2, 1, figsize=(10, 6.5))
    for r in [*rep.releases, rep.corrected]:
        if r.timeline:
            xs, ys = zip(*r.timeline, strict=True)
            (line,) = held.step(xs, ys, where="post", label=r.release if r.release == r.line else f"{r.release} ({r.line})")
        else:
            line = None
        color = line.get_color() if line is not None else None
        arrivals = [i / rep.rate for i in range(len(r.latency_s))]
        ok = [(x, y) for x, y, row in zip(arrivals, r.latency_s, r.rows, strict=True)
              if y is not None and row.verdict in (*OK, "aborted")]
        bad = [(x, y) for x, y, row in zip(arrivals, r.latency_s, r.rows, strict=True)
               if y is not None and row.verdict not in (*OK, "aborted")]
        if ok:
            lat.plot(*zip(*ok, strict=True), "o", ms=3, color=color, label=f"{r.release}")
        if bad:
            lat.plot(*zip(*bad, strict=True), "x", ms=6, color=color,
                     label=f"{r.release}: wrong / freed-early / error")
    _marks(rep, held, lat)
    held.axhline(rep.pool, ls="--", color="grey", lw=0.8, label=f"P's pool ({rep.pool})")
    held.set_xlabel("seconds into the release's run")
    held.set_ylabel("P's KV blocks held")
    held.set_ylim(bottom=0)
    lat.set_xlabel("request arrival (s)")
    lat.set_ylabel("P's prefill to D's answer (s)")
    for ax in (held, lat):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    faults = f"; faults {', '.join(rep.faults)}" if rep.faults else ""
    fig.suptitle(f"pdcheck requests {rep.scenario}: {rep.requests} requests at {rep.rate:g}/s, lease "
                 f"{rep.lease_s if rep.lease_s is not None else 'default'}{faults}", fontsize=9)
    figure.save(fig, path)


def _marks(rep: RequestsReport, held: Any, lat: Any) -> None:
    """Where a reader looks for the cause: a vertical line at the arrival of each request a fault names
    (restart-p: P replaced after its params), and each line's expiry as a horizontal line on the latency
    panel (a request above it was answered after P's timeout or lease had freed its blocks)."""
    from pdcheck.vllm.requests.faults import parse

    for f in rep.faults:
        req = parse(f, rep.requests).request
        if req is None:  # every request, or p=SHARE of them: the x markers show the ones that went wrong
            continue
        x = req / rep.rate
        restart = f.startswith("restart-p")
        for ax in (held, lat):
            ax.axvline(x, color="black" if restart else "purple", ls="-" if restart else ":", lw=1)
        held.annotate(f"P restarted after request {req}" if restart else f"{f} (request {req})", (x, 0),
                      xytext=(3, 3), textcoords="offset points", fontsize=7, rotation=90, va="bottom")
    expiries: dict[float, list[str]] = {}
    for r in [*rep.releases, rep.corrected]:
        if r.expiry_s is not None and any(y is not None and y >= r.expiry_s for y in r.latency_s):
            expiries.setdefault(r.expiry_s, []).append(r.release)
    for at, names in expiries.items():
        lat.axhline(at, ls="--", lw=0.8, color="red")
        lat.annotate(f"{', '.join(names)}: P frees unread blocks at {at:g} s (abort timeout / lease)", (0, at),
                     xytext=(3, 3), textcoords="offset points", fontsize=7, color="red")

