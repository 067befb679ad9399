"""An exception the request path did not expect is a harness failure (exit 3, one line naming the rank and the
request), never a verdict: one injected in each role (P, D, the router) on real ranks; and the TP 2 -> TP 2
engine restart that used to crash the router (`list.remove(x): x not in list`) gives its verdict with any number
of requests (issue #37)."""

from __future__ import annotations

import functools

import pytest
from loadkit import scaled

from pdcheck import cli
from pdcheck.errors import HarnessError
from pdcheck.vllm.requests import plan as rplan
from pdcheck.vllm.requests.faults import parse_all
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.run import Options, run
from pdcheck.vllm.requests.shapes import Shape


@pytest.mark.parametrize(("role", "named"), [("P", "P rank 1 failed during vLLM 0.34.0's requests: P1 at request 1"),
                                             ("D", "D rank 0 failed during vLLM 0.34.0's requests: D0 at request 1"),
                                             ("router", "vLLM 0.34.0: the router (pdcheck's parent process), at "
                                                        "request 1")])
def test_an_unexpected_exception_names_the_rank_and_the_request(role: str, named: str) -> None:
    opts = Options(requests=3, rate=20.0, lease_s=5.0, shape=Shape(2, 1, 2, 1), crash=(role, 1))
    with pytest.raises(HarnessError) as got:
        run([("0.34.0", line_of("0.34.0"))], scaled(opts))
    text = str(got.value)
    assert "\n" not in text and "RuntimeError: an exception injected by the test hook" in text, text
    if role == "P":  # both P workers take request 1: whichever reports first is named
        assert text.replace("P rank 0", "P rank 1").replace("P0 at", "P1 at").startswith(named), text
    else:
        assert text.startswith(named), text


def test_the_cli_exits_3_with_one_line_when_a_rank_crashes(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(rplan, "Options", functools.partial(Options, crash=("D", 0)))
    code = cli.run(["requests", "--vllm", "0.34.0", "--requests", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 3
    assert err.count("\n") == 0 and err.startswith("pdcheck: error: D rank 0 failed during vLLM 0.34.0's requests: "
                                                   "D0 at request 0: RuntimeError"), err


def test_an_exception_outside_the_ranks_is_exit_3_never_a_verdict(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise ValueError("list.remove(x): x not in list")

    monkeypatch.setattr(rplan, "build", boom)
    code = cli.run(["requests", "--vllm", "0.34.0"])
    err = capsys.readouterr().err.strip()
    assert code == 3 and err.count("\n") == 0, err
    assert err.startswith("pdcheck: error: internal error, a bug in pdcheck: ValueError: list.remove(x)"), err


@pytest.mark.parametrize("n", [4, 7])
def test_tp2_engine_restart_gives_its_verdict_with_any_number_of_requests(n: int) -> None:
    # The whole engine (both P TP workers) is replaced after request 1's params: the scheduler starts over with
    # every block free, as the new processes do; the router used to keep the old free list and crash at the
    # first block the dead engine had held (request 3 with 4 requests).
    opts = Options(requests=n, rate=20.0, lease_s=5.0, shape=Shape(2, 1, 2, 1), faults=parse_all(["restart-p:1"], n))
    by = {r.release: r for r in run([("0.34.0", line_of("0.34.0"))], scaled(opts))}
    for r in by.values():
        assert [(o.request, o.rank, o.verdict) for o in r.outcomes] == \
            [(o.request, o.rank, o.verdict) for o in r.expected], r.outcomes
        assert r.accounting.restarts == 1
    real = by["0.34.0"].outcomes
    assert {o.verdict for o in real if o.request < 1} == {"delivered"}
    # the dead agent (kv_load_failure_policy fail); the new engine's 8 blocks hold requests 2-5, and request 6 waits
    # for the failed ones' lease
    assert {o.verdict for o in real if 1 <= o.request < 6} == {"error"}
    assert {o.verdict for o in real if o.request >= 6} <= {"hang"}
    assert {o.verdict for o in by["corrected"].outcomes if o.request != 1} == {"delivered"}
