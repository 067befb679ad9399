"""One worker's fault in push mode on TP and DP shapes (issue #37): a restart of one P TP worker, a late PUSH_REG on
one D rank, a failed WRITE into one D rank. Each bundled scenario runs on real ranks (every delivered block checked by
coordinate: the transfer proof) and meets its [expect]; the model agrees with every (request, D rank); and the pure
rule (push.rank_faults) says which D rank meets which fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdcheck.vllm.requests import push
from pdcheck.vllm.requests.faults import parse_all
from pdcheck.vllm.requests.lines import CORRECTED
from pdcheck.vllm.requests.plan import build
from pdcheck.vllm.requests.report import build as report
from pdcheck.vllm.requests.run import run
from pdcheck.vllm.requests.shapes import Shape
from pdcheck.vllm.scenario import read_toml

SCENARIOS = Path(__file__).resolve().parent.parent / "pdcheck" / "scenarios" / "requests"


def test_which_d_rank_meets_which_fault() -> None:
    late = parse_all(["slow-decode:2:1:rank=D1"], 3)
    # TP 2 -> TP 2: D rank 1 alone registers with P rank 1: late there, on time on D rank 0
    assert push.rank_faults(late, Shape(2, 1, 2, 1), 1) == late and push.rank_faults(late, Shape(2, 1, 2, 1), 0) == ()
    # P TP 1 -> D TP 2: D rank 0's PUSH_REG makes P's one rank WRITE both, so D rank 1 is not late (the corrected D
    # still refuses params whose lease passed)
    assert push.rank_faults(late, Shape(1, 1, 2, 1), 1) == ()
    assert push.rank_faults(late, Shape(1, 1, 2, 1), 1, CORRECTED) == late
    fail = parse_all(["read-fail:1:rank=D1"], 3)
    assert push.rank_faults(fail, Shape(1, 1, 2, 1), 1) == fail and push.rank_faults(fail, Shape(1, 1, 2, 1), 0) == ()
    restart = parse_all(["restart-p:1:rank=1"], 3)
    whole = push.rank_faults(restart, Shape(2, 1, 2, 1), 1)
    assert [(f.name, f.rank) for f in whole] == [("restart-p", None)]  # its PUSH_REGs go to the dead agent
    assert push.rank_faults(restart, Shape(2, 1, 2, 1), 0) == ()
    assert len(push.rank_faults(restart, Shape(2, 1, 1, 1), 0)) == 1  # P TP 2 -> D TP 1: D reads both workers


@pytest.mark.parametrize("name", ["requests-push-tp2-one-p-worker-restart", "requests-push-tp2-one-late-registration",
                                  "requests-push-hetero-one-late-registration",
                                  "requests-push-tp2-one-write-failure"])
def test_bundled_push_one_rank_scenario(name: str) -> None:
    path = SCENARIOS / f"{name}.toml"
    plan = build(path, read_toml(path), None, {}, [])
    rep = report(plan, run(plan.releases, plan.options))
    assert not rep.harness_errors, rep.harness_errors  # the model agrees with every (request, D rank)
    assert all(e.passed for e in rep.expectations), [(e.release, e.got) for e in rep.expectations if not e.passed]
    for rel in rep.releases:
        bad = {(row.request, row.rank): row.detail for row in rel.rows if row.verdict != "delivered"}
        if name == "requests-push-tp2-one-p-worker-restart":
            assert set(bad) == {(2, "D1"), (3, "D1"), (4, "D1")}, bad
            assert all("push_reg_notif_failed" in d and "NIXL_ERR_REMOTE_DISCONNECT" in d for d in bad.values())
        elif name == "requests-push-tp2-one-write-failure":
            assert set(bad) == {(2, "D1")}, bad
            # P logged the one failed WRITE; the other D rank's WRITE of the same request went through
            assert sum("Push WRITE submission failed" in e for e in rel.notif_errors) == 1, rel.notif_errors
        elif name == "requests-push-tp2-one-late-registration":
            assert set(bad) == {(2, "D1")} and rel.accounting.expired == 1, (bad, rel.accounting)
        else:  # P WRITEs both D ranks at D rank 0's PUSH_REG: the late rank is delivered
            assert not bad and rel.accounting.freed == 5, (bad, rel.accounting)
    assert {(r.request, r.rank) for r in rep.corrected.rows if r.verdict == "recomputed"} == {(2, "D1")}


def test_one_rank_push_faults_on_dp_shapes_agree_with_the_model() -> None:
    # P TP 2 x DP 2 -> D TP 2: worker 1 of P DP rank 0 (request 2's engine) is replaced; DP rank 1's requests go on
    path = SCENARIOS / "requests-push-tp2-one-p-worker-restart.toml"
    doc = {k: v for k, v in read_toml(path).items() if k != "expect"}
    plan = build(path, doc, "0.34.0", {}, [], {"prefill": {"dp_size": 2}})
    got = run(plan.releases, plan.options)
    for r in got:
        assert [(o.request, o.rank, o.verdict) for o in r.outcomes] == \
            [(o.request, o.rank, o.verdict) for o in r.expected], r.outcomes
    hung = {(o.request, o.rank) for o in got[0].outcomes if o.verdict == "hang"}
    assert hung == {(2, "D1"), (4, "D1")}, hung  # the even requests went to the engine whose worker 1 died
