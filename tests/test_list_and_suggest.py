"""`pdcheck list`, shell completion of scenario names and releases, and "did you mean" for names, keys and
enum values; a scenario of the other phase names the command that runs it. The CLI runs in-process (cli.run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdcheck import cli
from pdcheck.scenariofile import BUNDLED


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.run(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_json_names_every_bundled_scenario_and_release_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "list", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["command"] == "list" and doc["exit_code"] == 0
    by_name = {s["name"]: s for s in doc["scenarios"]}
    assert len(by_name) == len(list(BUNDLED.rglob("*.toml")))
    assert by_name["hetero-p4-d2"]["phase"] == "handshake" and by_name["hetero-p4-d2"]["framework"] == "vllm"
    assert by_name["requests-freed-early"]["phase"] == "requests"
    assert by_name["sglang-aux-skew"]["framework"] == "sglang"
    assert all(s["description"] and "\n" not in s["description"] for s in doc["scenarios"])
    lines = {(r["framework"], r["releases"]): r["line"] for r in doc["releases"]}
    assert lines[("vllm", "0.11.1 to 0.12.x")] == "0.11.1" and lines[("sglang", "0.5.8")] == "0.5.8"
    assert lines[("sglang", "0.5.13 to 0.5.22")] == "0.5.13"


def test_list_table_and_a_misspelt_what(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "list", "scenarios")
    assert rc == 0 and "requests-prefill-restart" in out and "Modelled releases" not in out
    rc, _out, err = _run(capsys, "list", "scenaros")
    assert rc == 2 and "did you mean 'scenarios'?" in err


def test_completion_offers_bundled_names_and_releases() -> None:
    import click

    cmd = cli._lazy_command("handshake")
    ctx = click.Context(cmd)
    scenario = next(p for p in cmd.params if p.name == "scenario")
    names = [c.value for c in scenario.shell_complete(ctx, "hetero-p")]
    assert "hetero-p4-d2" in names and "seed-19338-tp8" not in names
    vllm = next(p for p in cmd.params if "--vllm" in p.opts)
    assert [c.value for c in vllm.shell_complete(ctx, "0.9.1,0.1")][:3] == ["0.9.1,0.10.0", "0.9.1,0.10.1",
                                                                             "0.9.1,0.11.0"]
    sglang = next(p for p in cmd.params if "--sglang" in p.opts)
    assert "0.5.23" in [c.value for c in sglang.shell_complete(ctx, "0.5")]
    req = cli._lazy_command("requests")
    assert "requests-freed-early" in [c.value for c in next(p for p in req.params if p.name == "scenario")
                                      .shell_complete(click.Context(req), "requests-fr")]


def test_a_misspelt_name_key_or_value_gets_did_you_mean(capsys: pytest.CaptureFixture[str],
                                                        tmp_path: Path) -> None:
    rc, _out, err = _run(capsys, "handshake", "hetro-p4-d2", "--vllm", "0.9.1")
    assert rc == 2 and "did you mean 'hetero-p4-d2'" in err and len(err) < 200
    text = (BUNDLED / "hetero-p4-d2.toml").read_text()
    typo = tmp_path / "typo.toml"
    typo.write_text(text.replace("num_blocks = [3008", "num_blcks = [3008"))
    rc, _out, err = _run(capsys, "handshake", str(typo), "--vllm", "0.9.1")
    assert rc == 2 and "prefill.num_blcks: unknown key; did you mean 'num_blocks'?" in err
    enum = tmp_path / "enum.toml"
    enum.write_text(text.replace('"0.9.1" = "assert"', '"0.9.1" = "asert"'))
    rc, _out, err = _run(capsys, "handshake", str(enum), "--vllm", "0.9.1")
    assert rc == 2 and "expect.0.9.1: 'asert' is not one of ok, assert, silent, error, hang; did you mean " \
        "'assert'?" in err
    sg = tmp_path / "sg.toml"
    sg.write_text((BUNDLED / "sglang" / "sglang-aux-skew.toml").read_text().replace("[prefill]\n",
                                                                                     "[prefill]\nkv_heds = 8\n"))
    rc, _out, err = _run(capsys, "handshake", str(sg), "--sglang", "0.5.8")
    assert rc == 2 and "prefill.kv_heds: unknown key; did you mean 'kv_heads'?" in err


def test_a_scenario_of_the_other_phase_names_its_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = _run(capsys, "handshake", "requests-freed-early", "--vllm", "0.9.1")
    assert rc == 2 and "run it with: pdcheck requests requests-freed-early" in err
    rc, _out, err = _run(capsys, "requests", "hetero-p4-d2", "--vllm", "0.9.1")
    assert rc == 2 and "run it with: pdcheck handshake hetero-p4-d2" in err
    # a request-path scenario with a TP shape has [prefill]/[decode] too: its [requests] table names it
    rc, _out, err = _run(capsys, "handshake", "requests-tp2-freed-early", "--vllm", "0.9.1")
    assert rc == 2 and "run it with: pdcheck requests requests-tp2-freed-early" in err


def test_an_sglang_enum_value_names_the_valid_ones(tmp_path: Path) -> None:
    from pdcheck.errors import BadInput
    from pdcheck.sglang.scenario import load

    path = tmp_path / "s.toml"
    path.write_text('framework = "sglang"\n[transfer]\nfault = "kill_prefil"\n')
    with pytest.raises(BadInput, match=r"transfer.fault: 'kill_prefil' is not one of .*kill_prefill.*; did you "
                                       r"mean 'kill_prefill'\?"):
        load(path)
