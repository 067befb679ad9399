"""One wording of release ranges (releaseline.span, used by `pdcheck list releases`, the error texts and the docs),
a release newer than the newest modelled one run as that line with a warning that names it, and "did you mean"
for a mistyped release (suggest.py, as for names)."""

from __future__ import annotations

import re

import pytest

from pdcheck import catalog
from pdcheck.errors import BadInput
from pdcheck.releaseline import span
from pdcheck.sglang.releases import TABLE as SGLANG
from pdcheck.sglang.releases import resolve as sglang_resolve
from pdcheck.vllm.releases import TABLE as VLLM
from pdcheck.vllm.releases import resolve

RANGE = re.compile(r"^[0-9]+\.[0-9]+\.[0-9]+(\.post[0-9]+)?( to [0-9]+\.([0-9]+\.)?([0-9]+|x))?$")


def test_every_range_list_prints_is_one_form() -> None:
    entries = catalog.releases()
    assert entries and all(RANGE.match(e.releases) for e in entries), [e.releases for e in entries]
    assert VLLM.modelled == "0.9.0 to 0.34.x" and SGLANG.modelled == "0.4.5.post3 to 0.5.23"
    assert span((0, 9, 2), (0, 9, 10**9)) == "0.9.2 to 0.9.x"  # no '0.9.99' stand-in for "every patch"
    assert [e.releases for e in entries if e.framework == "sglang"][-1] == "0.5.23"  # ends at the newest read


@pytest.mark.parametrize("resolve_, newer, line", [(sglang_resolve, "0.5.99", "0.5.23"), (resolve, "0.35.0", "0.34.0")])
def test_a_newer_release_runs_as_the_newest_line_with_a_warning(resolve_, newer: str, line: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = resolve_(newer)
    err = capsys.readouterr().err
    assert re.fullmatch(rf"pdcheck: warning: --\w+: (SGLang )?release '{re.escape(newer)}' is newer than the newest "
                        rf"modelled one \([0-9. tox]+\): it runs as the {re.escape(line)} line\n", err), err
    newest = resolve_(line)
    assert type(model) is type(newest) and model.name == newer


@pytest.mark.parametrize("typed, meant", [("9.1", "0.9.1"), ("O.9.1", "0.9.1"), ("0.14.l", "0.14.0")])
def test_a_mistyped_release_gets_did_you_mean(typed: str, meant: str) -> None:
    with pytest.raises(BadInput, match=rf"; did you mean '{re.escape(meant)}'"):
        resolve(typed)


def test_another_major_is_not_modelled_however_new() -> None:
    with pytest.raises(BadInput, match=r"^--sglang: SGLang release '1\.0\.0' is not modelled \(modelled: "
                                       r"0\.4\.5\.post3 to 0\.5\.23, all\)"):
        sglang_resolve("1.0.0")


def test_the_cli_names_the_newer_release_and_runs_it(pdcheck) -> None:
    r = pdcheck("handshake", "hetero-p4-d2", "--vllm", "0.35.0", "--no-transfer", "--json")
    assert r.code in (0, 1) and r.json()["exit_code"] == r.code, r.said
    assert r.err.splitlines() == ["pdcheck: warning: --vllm: release '0.35.0' is newer than the newest modelled "
                                  "one (0.34.0 to 0.34.x): it runs as the 0.34.0 line"], r.err
    bad = pdcheck("handshake", "hetero-p4-d2", "--vllm", "9.1")
    assert bad.code == 2 and bad.err.count("\n") == 1 and "did you mean '0.9.1'?" in bad.err, bad.err
