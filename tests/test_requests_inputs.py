"""`pdcheck requests`' inputs (issues #35 and #36): the shape flags (cliopts.SHAPE_FLAGS, the mechanism that gives
`handshake` its scenario flags), a file of [prefill]/[decode] alone as a request-path scenario of that shape, and bad
input refused up front in one line naming the flag or the file: a fault blamed where it was given, a lease under
the floor (bounds.LEASE_S), an unknown table, a rank or a number that is not ASCII digits or is too long."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcheck import bounds, cli


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.run(list(argv))
    got = capsys.readouterr()
    return code, got.out, got.err


def _toml(tmp_path: Path, text: str, name: str = "mine.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("argv", "said"), [
    (["--lease", "1e-300"], f"pdcheck: error: --lease: lease = 1e-300 is out of range (>= {bounds.LEASE_S[0]:g}"),
    (["--lease", "0.05"], "pdcheck: error: --lease: lease = 0.05 is out of range"),
    (["--decode-tp", "2", "--fault", "hold:1:rank=D²"], "pdcheck: error: --fault: 'hold:1:rank=D²': rank= takes a D TP "
                                                         "rank"),
    (["--decode-tp", "2", "--fault", "hold:1:rank=D" + "1" * 5000], "pdcheck: error: --fault: 'hold:1:rank=D111"),
    (["--fault", "slow-decode:١"], "pdcheck: error: --fault: 'slow-decode:١': seconds must be a number"),
    (["--fault", "drop-notif:٣"], "pdcheck: error: --fault: 'drop-notif:٣': the request must be an integer"),
    (["--prefill-tp", "2", "--fault", "restart-p:1:rank=²"], "pdcheck: error: --fault: 'restart-p:1:rank=²': rank= "
                                                               "takes a P TP rank"),
    (["--fault", "drop-notiff"], "pdcheck: error: --fault: unknown fault 'drop-notiff'"),
    (["--prefill-tp", "9"], "pdcheck: error: --prefill-tp: tp_size = 9 is out of range"),
    (["--prefill-tp", "2", "--decode-tp", "3"], "pdcheck: error: the shape flags: P TP 2 -> D TP 3: one TP size must "
                                                "divide the other"),
    (["--prefill-dp", "4", "--decode-dp", "4", "--decode-tp", "2"], "pdcheck: error: the shape flags: P TP 1 x DP 4 "
                                                                    "-> D TP 2 x DP 4 is 12 ranks"),
])
def test_bad_flags_are_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                said: str) -> None:
    code, _out, err = _run(capsys, "requests", "--vllm", "0.34.0", *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith(said), err
    assert len(err) < 400, err  # a 5,000-digit rank is not echoed whole


def test_a_fault_is_blamed_where_it_was_given(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _toml(tmp_path, '[requests]\n[faults]\nhold = "1"\n')
    code, _out, err = _run(capsys, "requests", path, "--vllm", "0.34.0", "--fault", "drop-notiff")
    assert code == 2 and err.startswith("pdcheck: error: --fault: unknown fault 'drop-notiff'"), err
    assert "did you mean 'drop-notif'" in err
    path = _toml(tmp_path, '[requests]\n[faults]\nhold = "1:rank=D²"\n', "bad.toml")
    code, _out, err = _run(capsys, "requests", path, "--vllm", "0.34.0", "--fault", "drop-notif:1")
    assert code == 2 and err.startswith(f"pdcheck: error: {path}: faults: 'hold:1:rank=D²'"), err
    code, _out, err = _run(capsys, "requests", "--vllm", "0.34.0", "--decode-tp", "2", "--fault", "hold:1:rank=D2")
    assert code == 2 and err.startswith("pdcheck: error: --fault hold:1:rank=D2: D TP rank 2 does not exist"), err


@pytest.mark.parametrize(("text", "said"), [
    ('[requests]\nrequests = 2\n[bogus]\nx = 1\n', "unknown table(s) bogus (known: requests, prefill, decode, faults, "
                                                   "expect)"),
    ('[requests]\n[faults]\ndrop-notif = []\n', "[faults] drop-notif = []: give true, an argument string or a "
                                                "non-empty list"),
    ('[requests]\nlease = 1e-300\n', "[requests]: lease = 1e-300 is out of range"),
    ('[prefill]\ntp_size = 2\nnum_blocks = 100\n[decode]\ntp_size = 2\n', "a handshake scenario (it has [prefill]/"
                                                                          "[decode] with handshake keys, no "
                                                                          "[requests]); run it with: pdcheck "
                                                                          "handshake mine"),
])
def test_bad_files_are_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                                said: str) -> None:
    path = _toml(tmp_path, text)
    code, _out, err = _run(capsys, "requests", path, "--vllm", "0.34.0")
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"pdcheck: error: {path}"), err
    assert said in err, err


def test_shape_flags_and_a_shape_only_file_run_on_that_shape(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = _toml(tmp_path, "[prefill]\ntp_size = 2\n[decode]\ntp_size = 1\n")
    # the file's P TP 2 -> D TP 1, the flag's D TP 2: TP 2 -> TP 2, with the defaults for the rest
    code, out, err = _run(capsys, "requests", path, "--vllm", "0.34.0", "--requests", "2", "--decode-tp", "2",
                          "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["shape"] == "P TP 2 -> D TP 2"
    line = doc["releases"][0]
    assert [r["rank"] for r in line["rows"]] == ["D0", "D1", "D0", "D1"]
    assert [p["rank"] for p in line["p_ranks"]] == ["P0", "P1"]
    code, out, err = _run(capsys, "requests", "--vllm", "0.34.0", "--requests", "2", "--prefill-dp", "2",
                          "--decode-dp", "2", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["shape"] == "P TP 1 x DP 2 -> D TP 1 x DP 2"
    assert [r["rank"] for r in doc["releases"][0]["rows"]] == ["DP0/D0", "DP1/D0"]
