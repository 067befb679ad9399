"""Every bundled scenario, run for real (ranks, side channel, NIXL, transfer), matches its [expect] table."""

from __future__ import annotations

import pytest
from conftest import SCENARIOS

from pdcheck.scenario import load

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
