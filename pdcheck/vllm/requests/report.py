"""`pdcheck requests`' report: a verdict per request per release with the corrected path's beside it, P's block
accounting, the model's expectation where the real run disagrees with it. One msgspec struct: --json encodes
it, the tables render it, so the two never disagree. Exit codes follow pdcheck.verdict's rule."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from pdcheck.releaseline import CORRECTED, is_corrected
from pdcheck.verdict import RankVerdict, exit_code, rank_label, survives
from pdcheck.vllm.requests.handshake import SideLog
from pdcheck.vllm.requests.model import VERDICTS, Accounting, PRankAccount
from pdcheck.vllm.requests.plan import RequestsPlan
from pdcheck.vllm.requests.run import LineRun
from pdcheck.vllm.requests.stall import Voided, void_note
from pdcheck.vllm.requests.texts import engine_deaths

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
    rank: str = ""  # on a TP/DP shape: the D rank ("D1", "DP1/D0"); a row per (request, D rank)
    heartbeats: int = 0  # heartbeats from this D rank that named the request (vLLM's scheduler: until every D rank is
    # done with it)
    handshakes: int = 0  # handshakes this D rank made for it: its READ's own, a heartbeat's, 0.33+'s second


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
    p_ranks: list[PRankAccount] = []  # on a TP/DP shape: each P rank's own count (accounting is the scheduler's)
    time_scale: float = 1.0  # the slow motion this line's verdicts ran at: the run's, or more where runs were voided
    stall_s: float = 0.0  # the worst the machine stalled the run during this line (pdcheck.vllm.requests.stall)
    voided: list[Voided] = []  # earlier runs of this line whose timing a stall voided (their verdicts unused)


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
    mode: str = "pull"  # "push": NixlPushConnector (pdcheck.vllm.requests.push)
    harness_errors: list[str] = []  # each request where the real ranks and the model disagree (exit 3)
    shape: str = ""  # TP and DP per side ("P TP 2 -> D TP 1"); "" for one P rank and one D rank
    # The run in slow motion (--time-scale): rate, lease_s and the faults' seconds above are as run, already
    # stretched by it; 1: as the scenario wrote them.
    time_scale: float = 1.0


def _release(run: LineRun, corrected: LineRun) -> ReleaseReport:
    n = len(run.outcomes)
    produced = run.params or [None] * n
    rows = [RequestRow(o.request, o.verdict, o.detail, c.verdict, c.detail, o.found_request,
                       "" if e.verdict == o.verdict else e.verdict,
                       produced[o.request] if o.request < len(produced) else None, o.rank, o.heartbeats,
                       o.handshakes)
            for o, c, e in zip(run.outcomes, corrected.outcomes, run.expected, strict=True)]
    counts = {v: sum(o.verdict == v for o in run.outcomes) for v in VERDICTS}
    # An aborted request has no answer to judge: it fails the release only where D freed blocks under its READ.
    statuses = ["ok" if o.verdict in OK or o.verdict == "aborted" else o.verdict for o in run.outcomes]
    from pdcheck.vllm.requests.lines import line_of

    line = line_of(run.line)
    return ReleaseReport(
        run.release, run.line,
        survives(statuses, n) and run.accounting.leaked == 0 and run.accounting.d_freed_in_flight == 0,
        {k: v for k, v in counts.items() if v}, (counts["wrong"] + counts["freed-early"]) / max(1, n),
        line.expiry, run.expiry_s, line.expiry_knob, _notification(line, run.mode), rows, run.accounting,
        run.expiry_log[:3], run.notif_errors[:3], all(not r.model for r in rows), run.seconds, run.router_lag_s,
        run.timeline, run.latency_s, run.handshake, run.p_handshake, run.p_ranks, run.time_scale, run.stall_s,
        run.voided)


def disagreements(r: ReleaseReport) -> list[str]:
    """One line per request where the real run and the model disagree: a harness error."""
    lag = (f"; the router was up to {r.router_lag_s:.2f} s late (this machine did not keep the rate the model "
           "assumes)" if r.router_lag_s > LAG_NOTE_S else "")
    if r.stall_s > LAG_NOTE_S:
        lag += f"; the machine stalled the run up to {r.stall_s:.2f} s at x{r.time_scale:g}"
    return [f"vLLM {r.release} request {x.request}{' on ' + x.rank if x.rank else ''}: the real ranks gave "
            f"{x.verdict}, the model {x.model}{lag}" for x in r.rows if x.model]


def _notification(line: Any, mode: str) -> str:
    if mode == "push":
        return "D: PUSH_REG:<msgpack registration>; P's WRITE: <D request id>:<P world size>"
    return str(line.notif).replace("{req}", "<request id>").replace("{n}", "<consumers>")


def build(plan: RequestsPlan, runs: list[LineRun]) -> RequestsReport:
    corrected = runs[-1]
    rels = [_release(r, corrected) for r in runs[:-1]]
    corr = _release(corrected, corrected)
    got = {r.release: [row.verdict for row in r.rows] for r in rels}
    got[CORRECTED] = [row.verdict for row in corr.rows]
    # Releases that did not run (--vllm named others) have nothing to compare.
    expectations = [Expectation(rel, got[_name(rel)] == want, want, got[_name(rel)])
                    for rel, want in plan.expect.items() if _name(rel) in got]
    # The model and the real ranks answer the same run: where they differ, one of them is wrong, and no verdict
    # of that run can be trusted (exit 3, naming each request).
    harness = [text for r in [*rels, corr] for text in disagreements(r)]
    code = exit_code([r.survived for r in rels], harness=bool(harness))
    o = plan.options
    verdicts = [RankVerdict(release=r.release, rank=row.rank or rank_label(0), status=row.verdict, detail=row.detail,
                            request=row.request) for r in rels for row in r.rows]
    return RequestsReport(plan.name, plan.issue, o.requests, o.rate, o.lease_s, o.blocks_per_request, o.pool,
                          [f.text() for f in o.faults], rels, corr, expectations, code, verdicts, mode=o.mode,
                          harness_errors=harness, shape="" if o.shape.single else o.shape.text(),
                          time_scale=o.time_scale)


def _name(release: str) -> str:
    from pdcheck.vllm.releases import resolve

    return release if is_corrected(release) else resolve(release).name


_STYLE = {"delivered": "green", "recomputed": "yellow", "aborted": "yellow", "wrong": "bold red", "freed-early": "red",
          "hang": "red", "error": "red"}
# The counts table's verdict columns, in the order a reader weighs them; a column no line has is left out.
_COLUMNS = ("delivered", "wrong", "freed-early", "hang", "error", "recomputed", "aborted")
# The long texts a failed READ repeats in every request's detail, shown once each as a numbered note: NIXL's
# exception ("NIXL transfer failed (request N): NIXL_ERR_X: nixlXError: NIXL_ERR_X") and the worker's context dict.
_NIXL_EXC = re.compile(r"NIXL transfer failed \(request \d+\): (NIXL_ERR_\w+)(?:: \w+: \1)?")
_CONTEXT = re.compile(r"Context: \{[^{}]*\}")


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


def _lost(r: ReleaseReport) -> str:
    """How a line loses requests: '3 error, 2 leaked' (counts of the verdicts that are not right)."""
    bad = [f"{n} {k}" for k, n in r.counts.items() if k not in OK]
    if r.accounting.leaked:
        bad.append(f"{r.accounting.leaked} leaked")
    if r.accounting.d_freed_in_flight:
        bad.append(f"{r.accounting.d_freed_in_flight} D blocks freed under a READ")
    return ", ".join(bad)


def verdict_line(rep: RequestsReport) -> str:
    """The answer first (rich markup): 'loses requests: 0.9.1 (3 error, 2 leaked) · survives: 0.11.1 (3
    recomputed) · corrected: 4 delivered, 1 recomputed · exit 1'."""
    from rich.markup import escape

    def counts(r: ReleaseReport) -> str:
        return ", ".join(f"{n} {k}" for k, n in r.counts.items())

    fail = [r for r in rep.releases if not r.survived]
    ok = [r for r in rep.releases if r.survived]
    parts = []
    if fail:
        parts.append("loses requests: [bold red]" + "; ".join(f"{escape(r.release)}[/] ({escape(_lost(r))})[bold red]"
                                                             for r in fail) + "[/]")
    if ok:
        parts.append("survives: [green]" + "; ".join(
            escape(r.release) + (f"[/] ({n} recomputed)[green]" if (n := r.counts.get("recomputed")) else "")
            for r in ok) + "[/]")
    c = rep.corrected
    parts.append(f"corrected: {'[green]' if c.survived else '[bold red]'}{escape(counts(c))}[/]")
    if rep.harness_errors:
        parts.insert(0, "[bold red]harness errors: verdicts not to be trusted[/]")
    code = f"[bold red]exit {rep.exit_code}[/]" if rep.exit_code else "[green]exit 0[/]"
    return " · ".join([*parts, code])


def _notes(text: str, notes: dict[str, int], first: dict[int, str]) -> str:
    """`text` with NIXL's exception and the worker's context dict replaced by a numbered note, once per kind."""
    def note(key: str, full: str) -> int:
        n = notes.setdefault(key, len(notes) + 1)
        first.setdefault(n, full)
        return n

    text = _NIXL_EXC.sub(lambda m: f"{m.group(1)} [{note(m.group(1), m.group(0))}]", text)
    # one note per failure type: a handshake's context and a READ's differ in more than their numbers
    return _CONTEXT.sub(lambda m: f"Context [{note('context ' + _kind(m.group(0)), m.group(0))}]", text)


def _kind(context: str) -> str:
    got = re.search(r"'failure_type': '([a-z_]+)'", context)
    return got.group(1) if got else ""



def _span_text(ids: list[int], most: int = 5) -> str:
    """'2-4, 7, 9' (runs folded); past `most` pieces, the first ones and the count."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    pieces = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    return ", ".join(pieces) if len(pieces) <= most else ", ".join(pieces[:most]) + f", … ({len(ids)} in all)"


def _rows(r: ReleaseReport, every: bool, notes: dict[str, int],
          first: dict[int, str]) -> list[tuple[str, str, str, str]]:
    """(requests, D rank, verdict, what happened) for one line: every (request, D rank) with --all, else the ones
    not delivered, those of one D rank whose verdict and detail differ only in numbers folded into one row."""
    groups: dict[tuple[str, str, str, str], list[tuple[int, str]]] = {}
    for row in r.rows:
        if row.verdict == "delivered" and not row.model and not every:
            continue
        detail = _notes(row.detail, notes, first)
        key = (row.rank, row.verdict, row.model, str(row.request) if every else re.sub(r"\d+", "#", detail))
        groups.setdefault(key, []).append((row.request, detail))
    out = []
    for (rank, verdict, model, _k), members in groups.items():
        ids = [i for i, _d in members]
        detail = members[0][1]
        if len(ids) > 1:
            detail = f"request {ids[0]}: {detail}"
        shown = _v(verdict) + (f" [dim](model: {model})[/]" if model else "")
        out.append((_span_text(ids), rank, shown, detail))
    return out


def d_ranks(rep: RequestsReport) -> int:
    """How many D ranks the report's rows name (more than one: the table gains a D rank column)."""
    return len({row.rank for r in [*rep.releases, rep.corrected] for row in r.rows})


def render(rep: RequestsReport, console: Any, every: bool = False) -> None:
    """The verdict line first, then one table of counts per line (corrected its last row), then the requests
    that were not delivered (every request with `every`), NIXL's long texts once each as notes."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    head = f"pdcheck requests: {escape(rep.scenario)}"
    if rep.issue:
        head += f" ({escape(rep.issue)})"
    console.print(f"[bold]{head}[/]: {rep.mode} mode, {rep.requests} requests at {rep.rate:g}/s, {rep.blocks_per_request} blocks "
                  f"each from P's {rep.pool}; lease {rep.lease_s if rep.lease_s is not None else 'default'}"
                  f"{'; faults ' + escape(', '.join(rep.faults)) if rep.faults else ''}"
                  f"{f'; every length x{rep.time_scale:g} (--time-scale)' if rep.time_scale != 1 else ''}",
                  highlight=False)
    console.print(verdict_line(rep), highlight=False)
    lines = [*rep.releases, rep.corrected]
    cols = [k for k in _COLUMNS if k == "delivered" or any(r.counts.get(k) for r in lines)]
    on = "P's WRITE done" if rep.mode == "push" else "notification"
    a = Table(title=f"Requests per line; P's blocks: requests freed on {on} / expired / still held / leaked; "
                    "late notifications", title_justify="left", highlight=False, box=box.SIMPLE_HEAD, pad_edge=False)
    a.add_column("line", no_wrap=True)
    for k in [*cols, "freed", "expired", "held", "leaked", "late"]:
        a.add_column(k, justify="right", min_width=len(k))  # a header word is never cut
    for r in lines:
        acc = r.accounting
        name = r.release if r.release == r.line or is_corrected(r.release) else f"{r.release} ({r.line})"
        label = Text(name, style="bold" if r is rep.corrected else ("" if r.survived else "red"))
        a.add_row(label,
                  *(f"[{_STYLE[k]}]{n}[/]" if (n := r.counts.get(k, 0)) and k != "delivered" else str(n)
                    for k in cols),
                  str(acc.freed), str(acc.expired), str(acc.held),
                  f"[red]{acc.leaked}[/]" if acc.leaked else "0", str(acc.late_notifs),
                  end_section=bool(rep.releases) and r is rep.releases[-1])
    console.print(a)
    console.print(Text("P frees unread blocks: " + ", ".join(
        f"{r.release} " + (f"{r.expiry} {r.expiry_s:g} s" if r.expiry_s is not None else r.expiry) for r in lines),
        style="dim"))
    notes: dict[str, int] = {}
    first: dict[int, str] = {}
    t = Table(title="Every request" if every else "Requests not delivered (--all: every request)",
              title_justify="left", highlight=False, box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("line", no_wrap=True)
    t.add_column("requests", max_width=34)
    by_rank = d_ranks(rep) > 1  # a row names (request, D rank) on a shape with more than one D rank
    if by_rank:
        t.add_column("D rank", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    t.add_column("what happened", overflow="fold")
    shown = 0
    for r in lines:
        for i, (ids, rank, verdict, detail) in enumerate(_rows(r, every, notes, first)):
            t.add_row(r.release if i == 0 else "", ids, *([rank] if by_rank else []), verdict, escape(detail))
            shown += 1
    if shown:
        console.print(t)
        for n, full in first.items():
            console.print(Text(f"  [{n}] {full}", style="dim"))  # Text: "[1]" must not be read as markup
    for r in lines:
        for line in r.expiry_log[:1] + r.notif_errors[:1] + [e for e in r.notif_errors[1:] if engine_deaths([e])]:
            # P's engine core dying (0.10.0's KeyError on a late notification) is the run's verdict on P
            console.print(Text(f"{r.release} P: {_notes(line, notes, first)}",
                               style="bold red" if engine_deaths([line]) else "dim"))
    if rep.releases:
        kinds = dict.fromkeys(r.notification for r in rep.releases)
        console.print(Text("D's done notification: " + ("; ".join(
            f"{r.release} {r.notification}" for r in rep.releases) if len(kinds) > 1 else next(iter(kinds))),
            style="dim"))
    _handshakes(console, "D's handshakes over P's side channel", [(r.release, r.handshake) for r in lines])
    _handshakes(console, "P's handshakes over D's side channel", [(r.release, r.p_handshake) for r in lines])
    restarts: dict[str, list[str]] = {}
    for r in lines:
        if r.accounting.restarts:
            restarts.setdefault(f"P replaced {r.accounting.restarts} time(s) (new process, new agent, same engine id);"
                                f" {r.accounting.lost} request(s)' blocks died with it", []).append(r.release)
    for text, names in restarts.items():
        console.print(f"[dim]{escape(', '.join(names))}:[/] {escape(text)}", highlight=False)
    for r in lines:
        acc = r.accounting
        if acc.d_freed_in_flight:
            console.print(f"[dim]{escape(r.release)}:[/] [red]D freed its blocks under an in-flight READ[/] for "
                          f"{acc.d_freed_in_flight} aborted request(s)", highlight=False)
    failed = [e for e in rep.expectations if not e.passed]
    if rep.expectations:
        console.print("expect: " + ("[green]every line as expected[/] (" + ", ".join(
            escape(e.release) for e in rep.expectations) + ")" if not failed else "; ".join(
            f"[bold red]{escape(e.release)} FAIL[/] (expected {escape(str(e.expected))}, got {escape(str(e.got))})"
            for e in failed)), highlight=False)
    for r in lines:
        for v in r.voided:
            console.print(f"[yellow]note:[/] vLLM {escape(r.release)}: {escape(void_note(v))}", highlight=False)
        if r.router_lag_s > LAG_NOTE_S:
            console.print(f"[yellow]note:[/] vLLM {escape(r.release)}: this machine did not keep {rep.rate:g} "
                          f"requests/s: the router handed a request on up to {r.router_lag_s:.2f} s late",
                          highlight=False)
    for text in rep.harness_errors:
        console.print(f"[bold red]harness error:[/] {escape(text)}", highlight=False)
