"""`pdcheck requests`' report: a verdict per request per release with the corrected path's beside it, P's block
accounting, the model's expectation where the real run disagrees with it. One msgspec struct: --json encodes
it, the tables render it, so the two never disagree. Exit codes follow pdcheck.verdict's rule."""

from __future__ import annotations

from typing import Any

import msgspec

from pdcheck.requests.handshake import SideLog
from pdcheck.requests.model import VERDICTS, Accounting
from pdcheck.requests.plan import RequestsPlan
from pdcheck.requests.run import LineRun
from pdcheck.verdict import RankVerdict, exit_code, rank_label, survives

LAG_NOTE_S = 0.05  # a router this late changes which blocks a timing-bound fault meets
OK = ("delivered", "recomputed")  # the answer is right (recomputed: slower)


class RequestRow(msgspec.Struct):
    request: int
    verdict: str
    detail: str
    corrected: str
    corrected_detail: str
    found_request: int | None = None
    model: str = ""  # the model's verdict where it differs from the real run's ("" when they agree)
    params: dict[str, Any] | None = None  # the kv_transfer_params P produced for it, as P's release shapes them


class ReleaseReport(msgspec.Struct):
    release: str
    line: str
    survived: bool
    counts: dict[str, int]
    served_from_freed: float  # fraction of requests that read blocks P had freed (wrong + freed-early)
    expiry: str
    expiry_s: float | None
    expiry_knob: str
    notification: str
    rows: list[RequestRow]
    accounting: Accounting
    expiry_log: list[str]
    notif_errors: list[str]
    model_agrees: bool
    seconds: float
    router_lag_s: float  # how late the parent (the router) got a request to P or D at worst
    timeline: list[tuple[float, int]] = []  # (seconds into the run, P's blocks held): what --plot draws
    latency_s: list[float | None] = []  # per request: P's allocation to D's answer (None: never answered)
    handshake: SideLog | None = None  # D's side-channel handshakes with P (endpoint, wire era, count)
    p_handshake: SideLog | None = None  # push mode: P's handshakes with D over D's side channel


class Expectation(msgspec.Struct):
    release: str
    passed: bool
    expected: list[str]
    got: list[str]


class RequestsReport(msgspec.Struct):
    """The body of `requests`' --json; the envelope (pdcheck.envelope) adds tool, version, schema, command and
    framework."""

    scenario: str
    issue: str
    requests: int
    rate: float
    lease_s: float | None
    blocks_per_request: int
    pool: int
    faults: list[str]
    releases: list[ReleaseReport]
    corrected: ReleaseReport
    expectations: list[Expectation]
    exit_code: int
    # One per modelled release and request (D rank D0: the request path runs one TP rank per side), the shape
    # every command shares; releases[].rows carry the same verdicts with the corrected path's beside them.
    verdicts: list[RankVerdict] = []
    mode: str = "pull"  # "push": NixlPushConnector (pdcheck.requests.push)
    harness_errors: list[str] = []  # each request where the real ranks and the model disagree (exit 3)


def _release(run: LineRun, corrected: LineRun) -> ReleaseReport:
    n = len(run.outcomes)
    produced = run.params or [None] * n
    rows = [RequestRow(o.request, o.verdict, o.detail, c.verdict, c.detail, o.found_request,
                       "" if e.verdict == o.verdict else e.verdict, produced[k] if k < len(produced) else None)
            for k, (o, c, e) in enumerate(zip(run.outcomes, corrected.outcomes, run.expected, strict=True))]
    counts = {v: sum(o.verdict == v for o in run.outcomes) for v in VERDICTS}
    # An aborted request has no answer to judge: it fails the release only where D freed blocks under its READ.
    statuses = ["ok" if o.verdict in OK or o.verdict == "aborted" else o.verdict for o in run.outcomes]
    from pdcheck.requests.lines import line_of

    line = line_of(run.line)
    return ReleaseReport(
        run.release, run.line,
        survives(statuses, n) and run.accounting.leaked == 0 and run.accounting.d_freed_in_flight == 0,
        {k: v for k, v in counts.items() if v}, (counts["wrong"] + counts["freed-early"]) / max(1, n),
        line.expiry, run.expiry_s, line.expiry_knob, _notification(line, run.mode), rows, run.accounting,
        run.expiry_log[:3], run.notif_errors[:3], all(not r.model for r in rows), run.seconds, run.router_lag_s,
        run.timeline, run.latency_s, run.handshake, run.p_handshake)


def disagreements(r: ReleaseReport) -> list[str]:
    """One line per request where the real run and the model disagree: a harness error."""
    lag = (f"; the router was up to {r.router_lag_s:.2f} s late (this machine did not keep the rate the model "
           "assumes)" if r.router_lag_s > LAG_NOTE_S else "")
    return [f"vLLM {r.release} request {x.request}: the real ranks gave {x.verdict}, the model {x.model}{lag}"
            for x in r.rows if x.model]


def _notification(line: Any, mode: str) -> str:
    if mode == "push":
        return "D: PUSH_REG:<msgpack registration>; P's WRITE: <D request id>:<P world size>"
    return str(line.notif).replace("{req}", "<request id>").replace("{n}", "<consumers>")


def build(plan: RequestsPlan, runs: list[LineRun]) -> RequestsReport:
    corrected = runs[-1]
    rels = [_release(r, corrected) for r in runs[:-1]]
    corr = _release(corrected, corrected)
    got = {r.release: [row.verdict for row in r.rows] for r in rels}
    got["corrected"] = [row.verdict for row in corr.rows]
    # Releases that did not run (--vllm named others) have nothing to compare.
    expectations = [Expectation(rel, got[_name(rel)] == want, want, got[_name(rel)])
                    for rel, want in plan.expect.items() if _name(rel) in got]
    # The model and the real ranks answer the same run: where they differ, one of them is wrong, and no verdict
    # of that run can be trusted (exit 3, naming each request).
    harness = [text for r in [*rels, corr] for text in disagreements(r)]
    code = exit_code([r.survived for r in rels], harness=bool(harness))
    o = plan.options
    verdicts = [RankVerdict(release=r.release, rank=rank_label(0), status=row.verdict, detail=row.detail,
                            request=row.request) for r in rels for row in r.rows]
    return RequestsReport(plan.name, plan.issue, o.requests, o.rate, o.lease_s, o.blocks_per_request, o.pool,
                          [f.text() for f in o.faults], rels, corr, expectations, code, verdicts, mode=o.mode,
                          harness_errors=harness)


def _name(release: str) -> str:
    from pdcheck.releases import resolve

    return release if release == "corrected" else resolve(release).name


_STYLE = {"delivered": "green", "recomputed": "yellow", "aborted": "yellow", "wrong": "bold red", "freed-early": "red", "hang": "red",
          "error": "red"}


def _handshakes(console: Any, title: str, logs: list[tuple[str, SideLog | None]]) -> None:
    """One line per direction: where, and each line's handshake count and wire era; then each failure."""
    from rich.markup import escape

    shakes = [(rel, s) for rel, s in logs if s is not None]
    if not shakes:
        return
    where = ", ".join(dict.fromkeys(s.endpoint for _rel, s in shakes if s.endpoint)) or "(none reached)"
    console.print(f"[dim]{title} {escape(where)}:[/] " + ", ".join(
        f"{escape(rel)} {s.handshakes} (era {s.wire})" for rel, s in shakes))
    for rel, s in shakes:
        if s.failed:
            console.print(f"[dim]{escape(rel)}:[/] [red]handshake failed[/]: {escape(s.failed)}")


def _v(verdict: str) -> str:
    return f"[{_STYLE.get(verdict, 'white')}]{verdict}[/]"


def render(rep: RequestsReport, console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    head = f"pdcheck requests: {escape(rep.scenario)}"
    if rep.issue:
        head += f" ({escape(rep.issue)})"
    console.print(f"[bold]{head}[/]: {rep.mode} mode, {rep.requests} requests at {rep.rate:g}/s, {rep.blocks_per_request} blocks "
                  f"each from P's {rep.pool}; lease {rep.lease_s if rep.lease_s is not None else 'default'}"
                  f"{'; faults ' + escape(', '.join(rep.faults)) if rep.faults else ''}")
    for r in rep.releases:
        t = Table(title=f"vLLM {r.release} (line {r.line}): {r.expiry}"
                        f"{f' {r.expiry_s:g} s' if r.expiry_s is not None else ''}; notification "
                        f"{escape(r.notification)}")
        for col in ("req", "verdict", "what happened", "corrected", "corrected: what happens"):
            t.add_column(col, overflow="fold")
        for row in r.rows:
            model = f" [dim](model: {row.model})[/]" if row.model else ""
            t.add_row(str(row.request), _v(row.verdict) + model, escape(row.detail), _v(row.corrected),
                      escape(row.corrected_detail))
        console.print(t)
    on = "P's WRITE done" if rep.mode == "push" else "notification"
    a = Table(title=f"P's blocks: requests freed on {on} / expired / still held / leaked; blocks reused")
    for col in ("release", "verdicts", "from freed", "freed", "expired", "held", "leaked", "reused", "late"):
        a.add_column(col, overflow="fold")
    for r in [*rep.releases, rep.corrected]:
        acc = r.accounting
        counts = ", ".join(f"{k} {v}" for k, v in r.counts.items())
        a.add_row(r.release, counts, f"{r.served_from_freed:.0%}", str(acc.freed), str(acc.expired), str(acc.held),
                  ("[red]" if acc.leaked else "") + str(acc.leaked) + ("[/]" if acc.leaked else ""), str(acc.reused),
                  str(acc.late_notifs))
    console.print(a)
    for r in [*rep.releases, rep.corrected]:
        for line in r.expiry_log[:1] + r.notif_errors[:1]:
            console.print(f"[dim]{escape(r.release)} P:[/] {escape(line)}")
    lines = [*rep.releases, rep.corrected]
    _handshakes(console, "D's handshakes over P's side channel", [(r.release, r.handshake) for r in lines])
    _handshakes(console, "P's handshakes over D's side channel", [(r.release, r.p_handshake) for r in lines])
    for r in [*rep.releases, rep.corrected]:
        acc = r.accounting
        if acc.restarts:
            console.print(f"[dim]{escape(r.release)}:[/] P replaced {acc.restarts} time(s) (new process, new agent, "
                          f"same engine id); {acc.lost} request(s)' blocks died with it")
        if acc.d_freed_in_flight:
            console.print(f"[dim]{escape(r.release)}:[/] [red]D freed its blocks under an in-flight READ[/] for "
                          f"{acc.d_freed_in_flight} aborted request(s)")
    for e in rep.expectations:
        mark = "[green]pass[/]" if e.passed else "[bold red]FAIL[/]"
        console.print(f"expect {escape(e.release)}: {mark}" + ("" if e.passed else f" (expected {e.expected}, got "
                                                                                      f"{e.got})"))
    for r in [*rep.releases, rep.corrected]:
        if r.router_lag_s > LAG_NOTE_S:
            console.print(f"[yellow]note:[/] vLLM {escape(r.release)}: this machine did not keep {rep.rate:g} "
                          f"requests/s: the router handed a request on up to {r.router_lag_s:.2f} s late")
    for text in rep.harness_errors:
        console.print(f"[bold red]harness error:[/] {escape(text)}")
    console.print(f"[dim]exit {rep.exit_code}[/]")
