"""Summaries that are true: the matrix's fail line when the run stopped short of the newest release, each
failing release's reason in the matrix view, no per-rank hint when nothing fails, the -O transfer named as such,
serve's request log and era F's ranks without a listener, no highlighter colour inside names and versions.
Handshakes run on real ranks in-process (cli.run); the cell and log helpers are pure."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from pdcheck import cli
from pdcheck import messages as m
from pdcheck.vllm import messages as vm


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = cli.run(list(argv))
    out, _err = capsys.readouterr()
    return rc, out


def test_a_run_that_stops_short_does_not_say_nothing_later_survives(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "handshake", "hetero-p4-d2", "--no-transfer")
    assert rc == 1
    assert "no later modelled release survives" not in out
    assert "fails: 0.9.1, 0.9.2, 0.10.0 · no release run after 0.10.0 survives; later ones not run (--vllm all)" in out
    # the reason of each failing release, in the matrix view, releases with one reason on one line
    assert "  0.9.2, 0.10.0: ZeroDivisionError" in out and "H11 TP direction or divisibility" in out
    assert "Per-rank asserts and transfer proof: --vllm 0.9.1" in out


def test_every_release_passing_offers_no_per_rank_rerun(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, "handshake", "mla", "--vllm", "0.14.0,0.20.0,0.34.0", "--no-transfer")
    assert rc == 0 and "every release run survives" in out and "Per-rank asserts" not in out


def test_an_asserting_release_transfer_reads_as_asserts_stripped() -> None:
    from pdcheck.vllm.report import _cell

    notes: dict[str, str] = {}
    cell = _cell(vm.Verdict(status="assert", assert_expr="x", handshake=1, contacted=[0]),
                 m.TransferResult(status="wrong", blocks=128, wrong=64), notes)
    assert "asserts stripped (python -O): 64/128 wrong" in cell.plain and "xfer 64/128" not in cell.plain
    ok = _cell(vm.Verdict(status="ok", contacted=[0]), m.TransferResult(status="ok", blocks=128), notes)
    assert "xfer 0/128 wrong" in ok.plain


def test_serve_logs_the_request_not_its_hex() -> None:
    import msgspec

    from pdcheck.vllm.ranks import readable

    assert readable(b"get_meta_msg") == "'get_meta_msg'"
    assert readable(msgspec.msgpack.encode([b"get_meta_msg", 3])) == "['get_meta_msg', 3]"
    assert readable(b"\xff\x00") == "ff00"


def test_a_rank_without_a_listener_says_whose_port_answers_for_it() -> None:
    from pdcheck.vllm.serve import _answered_by

    r0, r1 = object(), object()
    ranks = {0: r0, 1: r1}
    listeners = {0: [vm.ListenerSpec("F", 5600, None, [0, 1])], 1: []}
    assert _answered_by(r1, ranks, listeners) == (" (its metadata is served by P rank 0's listener :5600, "
                                                  "counted there)")
    assert _answered_by(r0, ranks, listeners) == ""


def test_names_and_versions_print_without_highlighter_colour() -> None:
    from pdcheck.console import console

    c = console(file=io.StringIO(), force_terminal=True, width=80)
    c.print("vLLM 0.9.1 seed-19338-tp8")
    assert c.file.getvalue().strip() == "vLLM 0.9.1 seed-19338-tp8"  # no escape codes inside
    plain = Console(file=io.StringIO(), force_terminal=True, width=80)
    plain.print("vLLM 0.9.1")
    assert "\x1b[" in plain.file.getvalue()  # what rich's default highlighter would have done
