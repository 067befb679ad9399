"""`pdcheck requests`' rendering: the verdict line first, one counts table, only the requests not delivered
(grouped), NIXL's long text once as a note. Pure rendering of a built report (rich Console, fixed width)."""

from __future__ import annotations

import io

import msgspec
from rich.console import Console

from pdcheck.vllm.requests import report
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.model import Accounting, Outcome
from pdcheck.vllm.requests.plan import RequestsPlan
from pdcheck.vllm.requests.run import LineRun, Options
from pdcheck.vllm.requests.stall import Voided

NIXL = ("NIXL transfer failed (request {i}): NIXL_ERR_REMOTE_DISCONNECT: nixlRemoteDisconnectError: "
        "NIXL_ERR_REMOTE_DISCONNECT (engine crash)")


def _rep(n: int = 40) -> report.RequestsReport:
    def run(release: str, verdicts: list[str], details: list[str], acc: Accounting) -> LineRun:
        outs = [Outcome(i, v, d) for i, (v, d) in enumerate(zip(verdicts, details, strict=True))]
        return LineRun(release, release, outs, outs, acc, acc, 2.0, [], [], 1.0, 0.0)

    bad = ["delivered"] * 2 + ["error"] * (n - 2)
    details = ["", ""] + [NIXL.format(i=i) for i in range(2, n)]
    plan = RequestsPlan("flags", "flags", "", [("0.9.1", line_of("0.9.1")), ("0.11.1", line_of("0.11.1"))],
                        Options(requests=n), {})
    return report.build(plan, [run("0.9.1", bad, details, Accounting(freed=2, leaked=n - 2)),
                               run("0.11.1", ["delivered"] * n, [""] * n, Accounting(freed=n)),
                               run("corrected", ["delivered"] * n, [""] * n, Accounting(freed=n))])


def _text(rep: report.RequestsReport, every: bool = False, width: int = 100) -> str:
    buf = io.StringIO()
    report.render(rep, Console(file=buf, width=width, color_system=None), every=every)
    return buf.getvalue()


def test_the_answer_comes_first_and_failed_requests_fold_into_one_row() -> None:
    rep = _rep()
    out = _text(rep)
    lines = out.splitlines()
    assert lines[1].startswith("loses requests: 0.9.1 (38 error, 38 leaked) · survives: 0.11.1 · corrected: "
                               "40 delivered · exit 1")
    assert len(lines) < 30
    # one row for the 38 failed requests of 0.9.1; none for 0.11.1's or corrected's delivered ones
    assert "2-39" in out and "request 2: NIXL_ERR_REMOTE_DISCONNECT [1] (engine crash)" in out
    # NIXL's text once, as a note, not in every row
    assert out.count("nixlRemoteDisconnectError") == 1
    assert "[1] NIXL transfer failed (request 2): NIXL_ERR_REMOTE_DISCONNECT" in out
    # the counts table: corrected is its last row, no per-release request tables
    assert "corrected" in out and out.count("what happened") == 1


def test_all_lists_every_request_and_the_header_words_fit() -> None:
    out = _text(_rep(), every=True)
    assert "Every request" in out
    for header in ("delivered", "error", "leaked"):
        assert header in out  # never cut to 'deliver…'
    assert all(len(line) <= 100 for line in out.splitlines())


def test_json_keeps_every_request() -> None:
    rep = _rep()
    doc = msgspec.json.decode(msgspec.json.encode(rep))
    assert len(doc["releases"][0]["rows"]) == 40 and doc["releases"][0]["rows"][5]["detail"] == NIXL.format(i=5)


def test_a_voided_run_is_a_note_and_its_line_keeps_its_scale_in_json() -> None:
    acc = Accounting(freed=2)
    outs = [Outcome(i, "delivered", "") for i in range(2)]
    steady = LineRun("0.34.0", "0.34.0", outs, outs, acc, acc, 1.0, [], [], 1.0, 0.0, time_scale=1.5, stall_s=0.03,
                     voided=[Voided(1.0, 0.41, 0.5)])
    corr = LineRun("corrected", "corrected", outs, outs, acc, acc, 1.0, [], [], 1.0, 0.0)
    plan = RequestsPlan("flags", "flags", "", [("0.34.0", line_of("0.34.0"))], Options(requests=2), {})
    rep = report.build(plan, [steady, corr])
    out = _text(rep, width=200)
    assert ("note: vLLM 0.34.0: the machine stalled the run 0.41 s at x1, over a third of its shortest length "
            "(0.5 s): that run's timing is void, the line ran again at x1.5") in out, out
    doc = msgspec.json.decode(msgspec.json.encode(rep))
    rel = doc["releases"][0]
    assert (rel["time_scale"], rel["stall_s"], rel["voided"]) == (1.5, 0.03, [
        {"time_scale": 1.0, "stall_s": 0.41, "length_s": 0.5}])
    assert doc["time_scale"] == 1.0 and doc["corrected"]["voided"] == [] and rep.exit_code == 0
