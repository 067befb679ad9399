"""Every bundled scenario, run for real (ranks, side channel, NIXL, transfer), matches its [expect] table."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, SCENARIOS

from pdcheck.vllm.scenario import load

FILES = sorted(SCENARIOS.glob("*.toml"))
KNOWN: dict[str, str] = {}  # scenario stem -> reason, for a defect that is known and open


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.xfail(reason=KNOWN[p.stem], strict=False)) if p.stem in KNOWN else p
    for p in FILES
], ids=[p.stem for p in FILES])
def test_scenario_meets_expectations(pdcheck, path):
    sc = load(path)
    assert sc.expect, f"{path.name} has no [expect] table"
    run = pdcheck("handshake", str(path), "--json", "--hang-timeout", "2")
    assert run.code in (0, 1), run.err
    doc = run.json()
    assert len(doc["decode_ranks"]) == sc.decode.tp_size * sc.decode.dp_size
    for release, exp in sc.expect.items():
        want = exp if isinstance(exp, list) else [exp] * (sc.decode.tp_size * sc.decode.dp_size)
        got = [d["verdicts"][release]["status"] for d in doc["decode_ranks"]]
        assert got == want, f"{path.name} {release}: {got} != {want}"
    for d in doc["decode_ranks"]:
        t = (d["transfer"] or {}).get("corrected")
        if d["verdicts"]["corrected"]["status"] == "silent":
            assert t is not None and t["wrong"] > 0  # silent is only ever claimed on evidence
        elif t is not None and t["status"] != "skipped":
            assert t["wrong"] == 0, f"{path.name} D rank {d['tp_rank']}: corrected delivered wrong blocks"
    modelled = [r for r in sc.vllm]
    assert run.code == (0 if all(doc["survives"][r] for r in modelled) else 1)


def _outside_the_clone(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI run from an empty directory, as a user of an installed pdcheck runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "pdcheck", *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=180)


@pytest.mark.parametrize("name", ["seed-19338-tp8", "seed-19338-tp8.toml"])
def test_a_bundled_scenario_is_found_by_name_from_anywhere(tmp_path, name):
    run = _outside_the_clone(tmp_path, "handshake", name, "--vllm", "0.9.1", "--no-transfer", "--json")
    assert run.returncode == 1, run.stderr
    import json

    doc = json.loads(run.stdout)
    assert doc["matrix"]["0.9.1"] == ["ok", *["assert"] * 7]


def test_a_path_wins_over_a_bundled_name_and_an_unknown_name_names_the_list_and_the_nearest(tmp_path):
    (tmp_path / "seed-19338-tp8.toml").write_text("this is not toml = = \n")
    run = _outside_the_clone(tmp_path, "handshake", "seed-19338-tp8.toml", "--no-transfer")
    assert run.returncode == 2 and "not valid TOML" in run.stderr  # the file here, not the bundled one
    run = _outside_the_clone(tmp_path, "handshake", "no-such-scenario", "--no-transfer")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "no bundled scenario of that name" in lines[0] and "pdcheck list scenarios" in lines[0]
    run = _outside_the_clone(tmp_path, "handshake", "seed-19338-tp9", "--no-transfer")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and "did you mean 'seed-19338-tp8'" in lines[0], run.stderr
    run = _outside_the_clone(tmp_path, "handshake", "sub/no-such.toml", "--no-transfer")
    assert run.returncode == 2 and "no such scenario file" in run.stderr  # a path is never looked up by name


def test_bundled_dir_is_the_clones_scenarios_dir():
    from pdcheck.frameworks import bundled_dirs
    from pdcheck.scenariofile import BUNDLED, bundled

    assert BUNDLED.resolve() == SCENARIOS.resolve()
    assert [p.name for p in bundled(bundled_dirs()[:1])] == [p.name for p in FILES]
