"""The version-matrix summary: which releases fail and which release fixes them (pure)."""

from __future__ import annotations

from pdcheck.vllm.report import FailSpan, fail_spans


def test_one_failing_release_and_its_fix() -> None:
    got = fail_spans({"0.9.0": True, "0.9.1": False, "0.9.2": True, "0.10.0": True})
    assert got == [FailSpan(["0.9.1"], "0.9.2")]


def test_release_order_not_input_order() -> None:
    got = fail_spans({"0.11.0": True, "0.10.1.1": False, "0.10.0": True, "0.9.2": False, "0.9.1": False})
    assert got == [FailSpan(["0.9.1", "0.9.2"], "0.10.0"), FailSpan(["0.10.1.1"], "0.11.0")]


def test_two_runs_and_no_fix_for_the_last() -> None:
    got = fail_spans({"0.9.1": False, "0.9.2": True, "0.14.0": False, "0.34.0": False})
    assert got == [FailSpan(["0.9.1"], "0.9.2"), FailSpan(["0.14.0", "0.34.0"], None)]


def test_nothing_fails() -> None:
    assert fail_spans({"0.9.0": True, "0.9.2": True}) == []
