"""`pdcheck requests` in push mode (NixlPushConnector) on TP and DP shapes: real P and D rank processes, every D rank
registering with the P ranks that feed it (real PUSH_REG notifications), each P rank handshaking with its D ranks
over their own side channels and WRITing each its part of the blocks (real NIXL WRITEs on host memory, kvsplit's
rule the other way), every D rank checking its blocks by coordinate and generation; the verdicts per (request, D
rank) against the model, --json against the table; and the pure rules (the plan, the model per D rank)."""

from __future__ import annotations

import re

import pytest
from conftest import SCENARIOS
from loadkit import scaled

from pdcheck.errors import BadInput
from pdcheck.vllm.requests import push
from pdcheck.vllm.requests.faults import parse_all
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.model import VERDICTS
from pdcheck.vllm.requests.plan import build
from pdcheck.vllm.requests.run import Options, run
from pdcheck.vllm.requests.shapes import Shape

LOST = ["delivered", "delivered", "hang", "delivered", "delivered", "hang", "delivered", "delivered"]


def _run(shape: Shape, faults: list[str] = (), releases: tuple[str, ...] = ("0.34.0",), n: int = 3):
    # A lease the first line's handshakes (D with P, then P with each D rank) fit in on a loaded machine
    opts = Options(requests=n, rate=20.0, lease_s=1.0, faults=parse_all(list(faults), n), mode="push", shape=shape)
    return {r.release: r for r in run([(v, line_of(v)) for v in releases], scaled(opts))}


def _agrees(r) -> None:
    assert [(o.request, o.rank, o.verdict) for o in r.outcomes] == \
        [(o.request, o.rank, o.verdict) for o in r.expected], r.outcomes


def _line_counts(table: str) -> dict[str, list[int]]:
    """The table's per-line row: the numbers after the line's name (verdict counts, then P's blocks)."""
    out = {}
    for ln in table.splitlines():
        cells = ln.split()
        if len(cells) > 3 and re.fullmatch(r"\d+\.\d+\.\d+|corrected", cells[0]) and all(c.isdigit()
                                                                                        for c in cells[1:]):
            out[cells[0]] = [int(c) for c in cells[1:]]
    return out


# -- real ranks ---------------------------------------------------------------------------------------------


def test_push_tp2_scenario_each_d_rank_written_by_its_p_rank_and_table_agrees_with_json(pdcheck):
    path = str(SCENARIOS / "requests" / "requests-push-tp2-lost-completion.toml")
    # 0.24 (its D done at the first completion: one per D rank here) and the corrected path; smoke runs the rest
    run_ = pdcheck("requests", path, "--vllm", "0.24.0", "--json", timeout=120)
    assert run_.code == 1, run_.err  # both D ranks wait on requests 2 and 5
    doc = run_.json()
    assert doc["mode"] == "push" and doc["shape"] == "P TP 2 -> D TP 2"
    assert [(e["release"], e["passed"]) for e in doc["expectations"]] == [("0.24.0", True), ("corrected", True)]
    for rel in [*doc["releases"], doc["corrected"]]:
        assert rel["model_agrees"], rel["rows"]
        assert [r["rank"] for r in rel["rows"]] == ["D0", "D1"] * 8
        want = LOST if rel["release"] != "corrected" else [v.replace("hang", "recomputed") for v in LOST]
        assert [r["verdict"] for r in rel["rows"]] == [v for v in want for _ in range(2)]
        # each P rank frees on its own WRITE done; the scheduler once both workers are: never at the lease
        acc = rel["accounting"]
        assert (acc["freed"], acc["expired"], acc["held"], acc["leaked"]) == (8, 0, 0, 0)
        assert [(p["rank"], p["holding"]) for p in rel["p_ranks"]] == [("P0", 0), ("P1", 0)]
        # each P rank handshook with the one D rank it feeds, over that D rank's own side channel
        assert rel["p_handshake"]["handshakes"] == 2 and not rel["p_handshake"]["failed"]
    assert "PR #50754" in doc["releases"][0]["rows"][4]["detail"]
    table = pdcheck("requests", path, "--vllm", "0.24.0", timeout=120)
    assert table.code == 1 and "push mode" in table.out
    counts = _line_counts(table.out)
    assert set(counts) == {"0.24.0", "corrected"}, table.out
    lines = [*doc["releases"], doc["corrected"]]
    cols = [v for v in VERDICTS if any(rel["counts"].get(v) for rel in lines)]  # the table's verdict columns
    for rel in lines:
        acc = rel["accounting"]
        assert counts[rel["release"]] == [*(rel["counts"].get(v, 0) for v in cols), acc["freed"], acc["expired"],
                                          acc["held"], acc["leaked"], acc["late_notifs"]], (rel["release"], table.out)


def test_push_p_tp1_to_d_tp2_one_p_rank_writes_each_d_rank_its_heads():
    # D0's and D1's PUSH_REGs both reach P0; the first starts P0's WRITEs into both (the second matches nothing
    # and is no late registration). rank=D1: only P0's completion to D1 is lost; D0 still gets its own.
    by = _run(Shape(1, 1, 2, 1), ["drop-notif:1:rank=D1"], releases=("0.24.0", "0.34.0"))
    for name, r in by.items():
        _agrees(r)
        lost = "recomputed" if name == "corrected" else "hang"
        assert [(o.rank, o.verdict) for o in r.outcomes] == [("D0", "delivered"), ("D1", "delivered"),
                                                             ("D0", "delivered"), ("D1", lost),
                                                             ("D0", "delivered"), ("D1", "delivered")]
        assert r.accounting.freed == 3 and r.accounting.late_notifs == 0
        assert r.p_handshake is not None and r.p_handshake.handshakes == 2 and not r.p_handshake.failed


def test_push_p_tp2_to_d_tp1_d_counts_both_p_ranks_and_a_failed_write_hangs(pdcheck):
    run_ = pdcheck("requests", str(SCENARIOS / "requests" / "requests-push-hetero-write-failure.toml"), "--json",
                   timeout=120)
    assert run_.code == 1, run_.said
    doc = run_.json()
    assert [e["passed"] for e in doc["expectations"]] == [True] * 3, doc["expectations"]
    for rel in doc["releases"]:
        assert rel["model_agrees"] and {r["rank"] for r in rel["rows"]} == {"D0"}
        assert "Push WRITE submission failed" in rel["rows"][2]["detail"]
        acc = rel["accounting"]
        assert (acc["freed"], acc["expired"]) == (6, 2)  # each failed WRITE's blocks wait for the lease
        assert [p["rank"] for p in rel["p_ranks"]] == ["P0", "P1"] and rel["p_handshake"]["handshakes"] == 2


def test_push_dp2_routes_each_registration_to_its_engine():
    by = _run(Shape(1, 2, 1, 2), ["drop-notif:2"], n=4)
    r = by["0.34.0"]
    _agrees(r)
    assert [(o.rank, o.verdict) for o in r.outcomes] == [("DP0/D0", "delivered"), ("DP1/D0", "delivered"),
                                                         ("DP0/D0", "hang"), ("DP1/D0", "delivered")]
    assert [p.rank for p in r.p_ranks] == ["P0", "DP1/P0"] and r.accounting.freed == 4
    assert r.p_handshake is not None and r.p_handshake.handshakes == 2  # each P engine with its D engine


def test_push_tp2_restart_p_registrations_hit_the_dead_workers():
    by = _run(Shape(2, 1, 2, 1), ["restart-p:1"], n=3)
    rel, cor = by["0.34.0"], by["corrected"]
    _agrees(rel)
    _agrees(cor)
    assert [o.verdict for o in rel.outcomes] == ["delivered"] * 2 + ["hang"] * 4
    assert "push_reg_notif_failed" in rel.outcomes[2].detail
    assert [o.verdict for o in cor.outcomes] == ["delivered"] * 2 + ["recomputed"] * 2 + ["delivered"] * 2
    assert rel.accounting.restarts == 1


# -- pure rules ---------------------------------------------------------------------------------------------


def test_plan_runs_push_on_shapes_and_refuses_p_tp_over_d_tp_before_0_26():
    plan = build(None, {"requests": {"requests": 2, "mode": "push"}, "prefill": {"tp_size": 2},
                        "decode": {"tp_size": 2}, "expect": {"0.24.0": "delivered"}}, None, {}, [])
    assert plan.options.mode == "push" and plan.options.shape == Shape(2, 1, 2, 1)
    assert plan.expect["0.24.0"] == ["delivered"] * 4
    doc = {"requests": {"requests": 2, "mode": "push"}, "prefill": {"tp_size": 2}}
    with pytest.raises(BadInput, match=r"vLLM 0\.24\.0's D takes a request as done at the first P rank's"):
        build(None, doc, "0.24.0,0.34.0", {}, [])
    assert [r for r, _ in build(None, doc, "0.26.0", {}, []).releases] == ["0.26.0"]
    names = [r for r, _ in build(None, doc, "all", {}, []).releases]
    assert names and all(tuple(map(int, r.split("."))) >= push.PP_SINCE for r in names)


def test_push_model_on_a_shape_is_tp1_per_d_rank_and_a_rank_fault_hits_that_rank_only():
    line = line_of("0.34.0")
    one, _ = push.simulate(line, 8, 10.0, 2, 8, 0.5, parse_all(["drop-notif:2"], 8))
    tp2, _ = push.simulate_shape(line, 8, 10.0, 2, 8, 0.5, parse_all(["drop-notif:2"], 8), Shape(2, 1, 2, 1))
    assert [(o.request, o.rank, o.verdict) for o in tp2] == \
        [(o.request, r, o.verdict) for o in one for r in ("D0", "D1")]
    ranked, _ = push.simulate_shape(line, 4, 10.0, 2, 8, 0.5, parse_all(["drop-notif:2:rank=D1"], 4),
                                    Shape(1, 1, 2, 1))
    assert [o.verdict for o in ranked] == ["delivered"] * 5 + ["hang"] + ["delivered"] * 2
    dp2, _ = push.simulate_shape(line, 4, 10.0, 2, 8, 0.5, (), Shape(1, 2, 1, 2))
    assert [o.rank for o in dp2] == ["DP0/D0", "DP1/D0"] * 2
