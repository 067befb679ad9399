"""Deployment shapes beyond one TP group (issue #17): data parallel, pipeline parallel, block size P != D, fp8.

Pure-model tests over the release grid (ports, plan, per-release rules, hazard lines), bad input (exit 2, one
line), and one real-process run: 2 DP x 2 TP per side, real side channels and NIXL agents.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pdcheck.errors import BadInput
from pdcheck.vllm import ports
from pdcheck.vllm.hazards import evaluate
from pdcheck.vllm.plan import RunOptions, build, dp_scenario
from pdcheck.vllm.releases import (
    CORRECTED,
    MODELLED,
    compat_hash_for,
    multinode,
    resolve,
    resolve_many,
    rules,
    shapes,
)
from pdcheck.vllm.scenario import load

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"
SIDE = {"tp_size": 2, "num_blocks": 256, "kv_heads": 4, "head_dim": 64}


def _sc(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, **top: Any):
    doc: dict[str, Any] = {"prefill": {"engine_id": "P", **SIDE, **(prefill or {})},
                           "decode": {"engine_id": "D", **SIDE, **(decode or {})}, **top}
    doc.setdefault("vllm", ["0.14.0"])
    return load(None, doc)


def _dp2(**top: Any):
    return _sc({"dp_size": 2}, {"dp_size": 2}, **top)


# ---- data parallel: ports, routes, plan -------------------------------------------------------------------
def test_dp_engine_id_suffix_only_with_dp() -> None:
    assert ports.dp_engine_id("prefill", 1, 2) == "prefill_dp1"
    assert ports.dp_engine_id("prefill", 0, 1) == "prefill"


def test_dp_engine_ids_follow_each_release() -> None:
    """0.9.0's engine core keeps the configured id on every DP rank; from 0.9.1 each gets `_dp<N>`: a plan of one
    release names the sub-pairs' engines so, a matrix keeps the suffix."""
    assert ports.dp_engine_id("P", 1, 2, resolve("0.9.0")) == "P"
    assert ports.dp_engine_id("P", 1, 2, resolve("0.9.1")) == "P_dp1"
    plan = build(_dp2(vllm=["0.9.0"]), None, RunOptions())
    assert [(g.plan.scenario.prefill.engine_id, g.plan.scenario.decode.engine_id, g.plan.kv_owner)
            for g in plan.dp] == [("P", "D", "P"), ("P", "D", "P")]
    plan = build(_dp2(vllm=["0.9.0", "0.9.1"]), None, RunOptions())
    assert [g.plan.scenario.prefill.engine_id for g in plan.dp] == ["P_dp0", "P_dp1"]


def test_dp_configured_id_undoes_each_release_suffix() -> None:
    r90, r91 = resolve("0.9.0"), resolve("0.9.1")
    assert ports.dp_configured_id("P_dp1", r91) == "P" and ports.dp_configured_id("P_dp1", r90) == "P_dp1"
    assert ports.dp_configured_id("P_dpx", r91) == "P_dpx" and ports.dp_configured_id("P", r91) == "P"
    rt = ports.DpRoute(1, 1, 0, "prefill")
    assert ports.dp_route_ids(_dp2(), rt, r90, r90) == ("P", "P")
    assert ports.dp_route_ids(_dp2(), rt, r91, r91) == ("P_dp1", "P_dp0")


def _dp_probe(ids: list[str]) -> list[Any]:
    from pdcheck.vllm.probe import ProbeReport
    from pdcheck.vllm.results import ProbeRank

    return [ProbeReport(endpoint="h:1", release="x", release_source="--vllm", wire="A", dp_rank=k, ports=[k],
                        prefill_ranks=[ProbeRank(tp_rank=0, port=k, status="ok", engine_id=e)], num_blocks_spread=None,
                        decode=None, hazards=[], notes=[], verdict="ok", exit_code=0) for k, e in enumerate(ids)]


def test_dp_notes_read_the_release_engine_ids() -> None:
    """0.9.0's DP ranks all answer for the configured id: nothing to note; from 0.9.1 the same id on two DP
    ranks, or a rank without its suffix, means the ports reach the wrong DP rank."""
    from pdcheck.vllm.probe import dp_notes

    assert dp_notes(_dp_probe(["P", "P"]), 2, resolve("0.9.0")) == []
    assert dp_notes(_dp_probe(["P_dp0", "P_dp1"]), 2, resolve("0.9.1")) == []
    notes = dp_notes(_dp_probe(["P", "P"]), 2, resolve("0.9.1"))
    assert "answers for 'P', not 'P_dp0'" in notes[0] and "same engine 'P'" in notes[-1]
    assert "not 'P_dp1'" in dp_notes(_dp_probe(["P_dp0", "P_dp0"]), 2, resolve("0.14.0"))[0]


def test_h20_on_0_9_0_the_wrong_dp_rank_answers_for_the_same_engine() -> None:
    hz = _hz(_dp2(kv_transfer_params={"dp_port": "dp0"}), "0.9.0")["H20"]
    assert hz.applies and "expects 'P', reaches 'P' (prefill DP rank 0)" in hz.detail
    assert "wrong KV, no error" in hz.effects["0.9.0"] and "KeyError" not in hz.effects["0.9.0"]
    assert "expected 'P_dp1'" in hz.effects[CORRECTED.name]
    hz = _hz(_sc({"dp_size": 2, "side_channel_host_set": False}, {"dp_size": 2}), "0.9.0")["H20"]
    assert hz.effects["0.9.0"].endswith("its own id 'D': AssertionError: Conflict engine id found!")
    assert not _hz(_dp2(), "0.9.0")["H20"].applies


def test_routes_round_robin_explicit_dp0_and_host_unset() -> None:
    sc = _sc({"dp_size": 2}, {"dp_size": 4})
    assert [(r.routed, r.reached, r.reached_side) for r in ports.dp_routes(sc)] == [
        (0, 0, "prefill"), (1, 1, "prefill"), (0, 0, "prefill"), (1, 1, "prefill")]
    sc = _dp2(kv_transfer_params={"dp_route": [1, 1]})
    assert [(r.routed, r.reached) for r in ports.dp_routes(sc)] == [(1, 1), (1, 1)]
    sc = _dp2(kv_transfer_params={"dp_port": "dp0"})
    assert [(r.routed, r.reached) for r in ports.dp_routes(sc)] == [(0, 0), (1, 0)]
    sc = _sc({"dp_size": 2, "side_channel_host_set": False}, {"dp_size": 2})
    assert {r.reached_side for r in ports.dp_routes(sc)} == {"decode"}


@pytest.mark.parametrize("release", ["0.9.2", "0.11.0", "0.11.1", "0.14.0", "0.26.0", "0.34.0"])
def test_plan_one_group_per_decode_dp_rank_at_its_layout_port(release: str) -> None:
    sc = _dp2(vllm=[release])
    plan = build(sc, None, RunOptions())
    assert len(plan.dp) == 2
    rel = resolve(release)
    bases = [next(d.p_base_port for d in g.plan.d_releases if d.name == rel.name) for g in plan.dp]
    # A-E: one port per TP rank, DP rank k's from base + k * tp_size; F-H: one per DP rank, base + k
    assert bases[1] - bases[0] == (2 if ports.per_rank(rel.wire) else 1)
    for k, g in enumerate(plan.dp):
        sub = g.plan.scenario
        assert sub.prefill.engine_id == f"P_dp{k}" and sub.decode.engine_id == f"D_dp{k}"
        assert sub.remote_engine_id() == f"P_dp{k}" and g.plan.kv_owner == f"P_dp{k}"
        assert sub.prefill.dp_size == sub.decode.dp_size == 1


def test_dp_scenario_wrong_port_and_host_unset() -> None:
    sc = _dp2(kv_transfer_params={"dp_port": "dp0"})
    sub = dp_scenario(sc, ports.dp_routes(sc)[1])
    assert (sub.prefill.engine_id, sub.remote_engine_id()) == ("P_dp0", "P_dp1")
    sc = _sc({"dp_size": 2, "side_channel_host_set": False, "base_port": 30000}, {"dp_size": 2, "tp_size": 1})
    sub = dp_scenario(sc, ports.dp_routes(sc)[1])
    # D's own node's DP rank 1 answers: D's geometry and id, at P's port layout
    assert (sub.prefill.engine_id, sub.prefill.tp_size, sub.prefill.base_port) == ("D_dp1", 1, 30000)
    assert sub.remote_engine_id() == "P_dp1"


def test_unreached_prefill_dp_ranks_are_planned_to_start() -> None:
    plan = build(_dp2(kv_transfer_params={"dp_port": "dp0"}), None, RunOptions())
    assert [g.route.reached for g in plan.dp] == [0, 0]
    assert [(g.route.reached, g.plan.scenario.prefill.engine_id) for g in plan.dp_idle] == [(1, "P_dp1")]
    assert build(_dp2(), None, RunOptions()).dp_idle == []


def test_dp1_plan_unchanged() -> None:
    plan = build(_sc(), None, RunOptions())
    assert plan.dp == [] and plan.kv_owner is None


# ---- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("prefill", "decode", "top", "needle"), [
    ({"dp_size": 99}, {}, {}, "prefill.dp_size"),
    ({"pp_size": 0}, {}, {}, "prefill.pp_size"),
    ({"dp_size": 2, "dp_rank": 1}, {}, {}, "prefill.dp_rank: 1 with dp_size 2"),
    ({"dp_size": 2}, {"dp_size": 2}, {"kv_transfer_params": {"dp_route": [0]}}, "expected 2 entries"),
    ({"dp_size": 2}, {}, {"kv_transfer_params": {"dp_route": [2]}}, "prefill DP rank 2 does not exist"),
    ({"dp_size": 2, "side_channel_host_set": False}, {}, {}, "same dp_size"),
    ({"cache_dtype": "int4"}, {}, {}, "prefill.cache_dtype"),
    ({"dp_size": 8, "tp_size": 16, "num_blocks": 16}, {}, {}, "dp_size 8 x tp_size 16 = 128 ranks"),
    ({"dp_size": 2}, {"dp_size": 2}, {"expect": {"0.14.0": ["ok", "ok"]}}, "expected 4 entries"),
])
def test_bad_shapes_one_line(prefill: dict[str, Any], decode: dict[str, Any], top: dict[str, Any],
                             needle: str) -> None:
    with pytest.raises(BadInput) as exc:
        _sc(prefill, decode, **top)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_bad_dp_size_exit_2_from_the_cli(pdcheck, tmp_path: Path) -> None:
    f = tmp_path / "dp.toml"
    f.write_text('[prefill]\nnum_blocks = 64\ndp_size = 100\n[decode]\nnum_blocks = 64\n')
    run = pdcheck("handshake", str(f))
    assert run.code == 2 and run.out == ""
    assert len(run.err.strip().splitlines()) == 1 and "prefill.dp_size" in run.err


# ---- per-release rules over the grid ---------------------------------------------------------------------
@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_block_size_effect_grid(rel) -> None:
    bigger_p = shapes.block_size_effect(rel, 32, 16)
    smaller_p = shapes.block_size_effect(rel, 16, 32)
    if rel.wire < "F":
        assert bigger_p is None and smaller_p is None  # no block_size on the wire: the block-length reading
        return
    assert bigger_p is not None and smaller_p is not None
    assert bigger_p.startswith("passes start-up") and "every later request" in bigger_p
    if any(s.id == "block_size_le" for s in rel.pre_add):  # 0.11.1-0.13: checked before add_remote_agent
        assert "nP > nD is not supported yet." in bigger_p
    else:
        assert "Local block size 16 is not divisible by remote block size 32 or vice versa." in bigger_p
    assert smaller_p.startswith("supported")


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_pp_effect_grid(rel) -> None:
    text = shapes.pp_effect(rel, 2, 1)
    if rel.wire < "H":
        assert "no rank verdict for D stages" in shapes.pp_effect(rel, 1, 2)
    else:
        assert "(pp_rank, tp_rank)" in text
        assert shapes.MSG_PP_DECODE in shapes.pp_effect(rel, 1, 2)
        assert any(s.id == "pp_decode" for s in rel.pre_flow)
    assert (rel.wire >= "H") == any(s is rules.PP_DECODE_REFUSED for s in rel.pre_flow)


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_cache_dtype_feeds_the_hash_from_0_13(rel) -> None:
    g = _sc().prefill.geometry()
    auto, fp8 = (compat_hash_for(rel, g, cache_dtype=c) for c in ("auto", "fp8"))
    if "cache_dtype" in rel.hash_factors:
        assert auto != fp8
    else:
        assert auto == fp8
    assert ("cache_dtype" in rel.hash_factors) == (tuple(map(int, rel.version.split(".")[:2])) >= (0, 13))


def test_cache_dtype_reaches_d_and_p_hashes() -> None:
    plan = build(_sc({"cache_dtype": "fp8"}), None, RunOptions())
    d_hash = next(d.local_hash for d in plan.d_releases if d.name == "0.14.0")
    assert plan.ports is not None and plan.ports.profiles["0.14.0"].compat_hash != d_hash


def test_when_raised() -> None:
    r14, r9 = resolve("0.14.0"), resolve("0.9.1")
    assert shapes.when_raised(r14, "assert", "block_size_ratio").startswith("per request")
    assert shapes.when_raised(r14, "error", "pp_decode").startswith("at start-up")
    assert shapes.when_raised(r14, "ok", None) is None and shapes.when_raised(r9, "assert", "x") is None
    assert shapes.when_raised(r14, "silent", None) is None  # nothing reaches the user: no "raises" line


# ---- hazard lines ----------------------------------------------------------------------------------------
def _hz(sc, names: str) -> dict[str, Any]:
    return {h.id: h for h in evaluate(sc, resolve_many(names))}


def test_h20_wrong_dp_rank_per_release() -> None:
    hz = _hz(_dp2(kv_transfer_params={"dp_port": "dp0"}), "0.9.2,0.10.0,0.34.0")["H20"]
    assert hz.applies
    assert hz.effects["0.34.0"].endswith("Remote NIXL agent engine ID mismatch. Expected P_dp1,received P_dp0.")
    assert "KeyError" in hz.effects["0.9.2"] and "engine ID mismatch" in hz.effects["0.10.0"]
    hz = _hz(_sc({"dp_size": 2, "side_channel_host_set": False}, {"dp_size": 2}), "0.14.0")["H20"]
    assert hz.applies and "Expected P_dp0,received D_dp0." in hz.effects["0.14.0"]
    assert not _hz(_dp2(), "0.14.0")["H20"].applies


def test_h07_per_request_from_era_f() -> None:
    hz = _hz(_sc({"block_size": 32}, {"block_size": 16}), "0.9.2,0.11.1,0.14.0")["H07"]
    assert "block_len check fires first" in hz.effects["0.9.2"]
    assert "nP > nD is not supported yet." in hz.effects["0.11.1"]
    assert hz.effects["0.14.0"].startswith("passes start-up") and "#42895" in hz.effects["0.14.0"]


def test_h17_h28_and_x01() -> None:
    hz = _hz(_sc({"cache_dtype": "fp8"}), "0.11.1,0.14.0")
    assert hz["H17"].applies and "hash mismatch" in hz["H17"].effects["0.14.0"]
    assert "no hash" in hz["H17"].effects["0.11.1"]
    both = {"cache_dtype": "fp8", "fp8_dynamic_scales": True}
    hz = _hz(_sc(both, both), "0.34.0")
    assert not hz["H17"].applies and hz["H28"].applies and "#42179" in hz["H28"].effects["0.34.0"]
    assert "X01" not in hz
    hz = _hz(_sc({"pp_size": 2}, {"pp_size": 2}), "0.14.0,0.26.0")
    assert hz["X01"].applies and shapes.MSG_PP_DECODE in hz["X01"].effects["0.26.0"]


def test_bundled_shape_scenarios_exist_with_expectations() -> None:
    for stem, issue in [("dp2-host-unset-27083", "#27083"), ("dp2-wrong-port-27083", "#27083"),
                        ("pp2-pull-52913", "#52913"), ("pp2-prefill-only", "#52913"), ("block-size-per-request-42895", "#42895"),
                        ("fp8-dynamic-scales-42179", "#42179"), ("nhd-native-46204", "#46204"),
                        ("multinode-tp-26338", "#26338")]:
        sc = load(SCENARIOS / f"{stem}.toml")
        assert issue in sc.description and sc.expect


# ---- real processes: 2 DP x 2 TP per side ----------------------------------------------------------------
def test_dp2_tp2_real_ranks_per_dp_rank_verdicts(pdcheck) -> None:
    run = pdcheck("handshake", str(SCENARIOS / "dp2-wrong-port-27083.toml"), "--vllm", "0.9.2,0.14.0", "--json",
                  "--hang-timeout", "2", timeout=120)
    assert run.code == 1, run.err
    doc = run.json()
    ranks = [(d["dp_rank"], d["tp_rank"]) for d in doc["decode_ranks"]]
    assert ranks == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for d in doc["decode_ranks"]:
        v14, v92 = d["verdicts"]["0.14.0"], d["verdicts"]["0.9.2"]
        if d["dp_rank"] == 0:  # the routed DP rank answers: the tagged blocks of prefill_dp0 arrive intact
            assert v14["status"] == v92["status"] == "ok"
            assert d["transfer"]["0.14.0"]["status"] == "ok" and d["transfer"]["0.14.0"]["wrong"] == 0
        else:
            assert v14["status"] == "error" and v14["exception"] == "RuntimeError"
            assert v14["message"] == "Remote NIXL agent engine ID mismatch. Expected prefill_dp1,received prefill_dp0."
            assert "per request" in d["when"]["0.14.0"]
            assert v92["status"] == "error" and v92["exception"] == "KeyError"
    # every P DP rank that answered ran as its own TP group
    assert {(p["dp_rank"], p["tp_rank"]) for p in doc["prefill_ranks"] if p["requests_served"]} == {(0, 0), (0, 1)}
    # prefill DP rank 1, which no decode DP rank reaches (the proxy hands out DP rank 0's port), started too
    assert {(p["dp_rank"], p["tp_rank"]) for p in doc["prefill_ranks"] if p["requests_served"] == 0} == {(1, 0), (1, 1)}
    assert [h["id"] for h in doc["hazards"] if h["applies"]] == ["H20"]


# ---- probe --dp-size against two live `pdcheck serve` DP ranks -------------------------------------------
def _serve_doc(tmp_path: Path, k: int, engine_id: str) -> Path:
    f = tmp_path / f"dp{k}.toml"
    f.write_text(f'[prefill]\nengine_id = "{engine_id}"\ndp_rank = {k}\ntp_size = 2\nnum_blocks = 64\nkv_heads = 4\n'
                 f'head_dim = 64\n[decode]\nnum_blocks = 64\n')
    return f


@pytest.mark.parametrize("ids", [("prefill_dp0", "prefill_dp1"), ("prefill_dp0", "prefill_dp0")])
def test_probe_dp_size_reads_every_dp_rank(tmp_path: Path, ids: tuple[str, str]) -> None:
    from contextlib import ExitStack

    from test_live import pdcheck as run_cli
    from test_live import serve

    from pdcheck.vllm.ports import free_base

    base = free_base("127.0.0.1", 2)
    with ExitStack() as stack:
        for k, eid in enumerate(ids):
            stack.enter_context(serve(str(_serve_doc(tmp_path, k, eid)), "--vllm", "0.14.0", "--port", str(base)))
        r = run_cli("probe", f"127.0.0.1:{base}", "--vllm", "0.14.0", "--dp-size", "2", "--tp-size", "2", "--json")
    assert "Traceback" not in r.stderr, r.stderr
    import json

    doc = json.loads(r.stdout)
    assert [d["ports"] for d in doc["dp_ranks"]] == [[base], [base + 1]]  # era G: one scheduler port per DP rank
    got = [sorted({p["engine_id"] for p in d["prefill_ranks"]}) for d in doc["dp_ranks"]]
    assert got == [[ids[0]], [ids[1]]]
    if ids[1] == "prefill_dp1":
        assert doc["notes"] == [] and r.returncode == 0
    else:  # DP rank 1's port answers for DP rank 0's engine: a D routed there fails the engine-id check
        assert r.returncode == 1 and any("answers for 'prefill_dp0', not 'prefill_dp1'" in n for n in doc["notes"])


@pytest.mark.parametrize("release", ["0.9.2", "0.14.0"])
def test_serve_every_dp_rank_and_probe_them(tmp_path: Path, release: str) -> None:
    import json

    from test_live import pdcheck as run_cli
    from test_live import serve

    f = tmp_path / "dp.toml"
    f.write_text('[prefill]\nengine_id = "prefill"\ndp_size = 2\ntp_size = 2\nnum_blocks = 64\nkv_heads = 4\n'
                 'head_dim = 64\n')
    with serve(str(f), "--vllm", release) as s:
        docs = s.doc["dp_ranks"]
        assert [(d["dp_rank"], d["engine_id"]) for d in docs] == [(0, "prefill_dp0"), (1, "prefill_dp1")]
        base = s.doc["base_port"]
        per_rank = release == "0.9.2"  # era C: base + dp * tp + rank; era G: one scheduler port per DP rank
        assert [d["kv_transfer_params"]["remote_port"] for d in docs] == [base, base + (2 if per_rank else 1)]
        assert [d["kv_transfer_params"]["remote_engine_id"] for d in docs] == ["prefill_dp0", "prefill_dp1"]
        r = run_cli("probe", f"127.0.0.1:{base}", "--vllm", release, "--dp-size", "2", "--tp-size", "2", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["notes"] == []
    assert [sorted({p["engine_id"] for p in d["prefill_ranks"]}) for d in doc["dp_ranks"]] == [
        ["prefill_dp0"], ["prefill_dp1"]]


def test_h08_defers_to_the_block_size_check_from_era_f() -> None:
    hz = _hz(_sc({"block_size": 32}, {"block_size": 16}), "0.9.2,0.14.0")["H08"]
    assert "Remote P worker KV layer cache" in hz.effects["0.9.2"]
    assert hz.effects["0.14.0"] == "not reached: the block-size check fires first (H07)"
    hz = _hz(_sc({"block_size": 16}, {"block_size": 32}), "0.14.0,0.34.0")["H08"]
    assert "0.14.0" not in hz.effects and "0.34.0" not in hz.effects  # P < D: block_size_ratio expects the half


def test_p_smaller_block_supported_from_era_f_real_ranks(pdcheck) -> None:
    run = pdcheck("handshake", "--prefill-tp", "2", "--decode-tp", "2", "--prefill-blocks", "256", "--decode-blocks",
                  "256", "--prefill-block-size", "16", "--decode-block-size", "32", "--kv-heads", "4", "--head-dim",
                  "64", "--vllm", "0.11.1,0.14.0,0.34.0", "--json", timeout=120)
    doc = run.json()
    assert doc["matrix"]["0.11.1"] == doc["matrix"]["0.14.0"] == doc["matrix"]["0.34.0"] == ["ok", "ok"]
    assert doc["matrix"]["corrected"] == ["ok", "ok"]  # corrected reads P's blocks into D's sub-blocks too
    for d in doc["decode_ranks"]:  # 2 requests x 32 D blocks x 2 regions, each D block read as 2 P blocks
        for rel in ("0.14.0", "0.34.0", "corrected"):
            assert d["transfer"][rel]["status"] == "ok" and d["transfer"][rel]["blocks"] == 2 * 32 * 2 * 2, rel


@pytest.mark.parametrize(("p_bs", "d_bs", "tp"), [(16, 48, ("2", "4")), (32, 16, ("2", "2")), (16, 40, ("2", "2"))])
def test_block_size_ratio_corrected_real_ranks(pdcheck, p_bs: int, d_bs: int, tp: tuple[str, str]) -> None:
    """D's block a whole number of P's (here with a head split too): the corrected model and 0.14+ read each D
    block as d_bs // p_bs P blocks and the proof passes; P > D or not a divisor: the release's per-request
    assert (#42895), the corrected refusal."""
    run = pdcheck("handshake", "--prefill-tp", tp[0], "--decode-tp", tp[1], "--prefill-blocks", "256",
                  "--decode-blocks", "256", "--prefill-block-size", str(p_bs), "--decode-block-size", str(d_bs),
                  "--kv-heads", "4", "--head-dim", "64", "--vllm", "0.14.0,0.34.0", "--json", timeout=120)
    doc = run.json()
    n = int(tp[1])
    if d_bs % p_bs == 0:
        assert run.code == 0, run.err
        assert doc["matrix"]["0.14.0"] == doc["matrix"]["0.34.0"] == doc["matrix"]["corrected"] == ["ok"] * n
        ratio = d_bs // p_bs
        for d in doc["decode_ranks"]:
            assert d["transfer"]["corrected"]["wrong"] == 0
            assert d["transfer"]["corrected"]["blocks"] == 2 * 32 * 2 * ratio
    else:
        assert doc["matrix"]["0.14.0"] == doc["matrix"]["0.34.0"] == ["assert"] * n
        assert doc["matrix"]["corrected"] == ["error"] * n
        d0 = doc["decode_ranks"][0]
        assert "#42895" not in d0["verdicts"]["0.14.0"]["message"]  # the release's own text
        assert d0["verdicts"]["0.14.0"]["message"].startswith(f"Local block size {d_bs} is not divisible")
        assert "whole number of P's" in d0["verdicts"]["corrected"]["message"]
        assert "per request" in d0["when"]["0.14.0"]


def test_h07_corrected_accepts_p_smaller_block() -> None:
    hz = _hz(_sc({"block_size": 16}, {"block_size": 32}), "0.14.0")
    assert hz["H07"].effects["corrected"].startswith("accepted: D's 32-token block is 2 of P's")
    hz = _hz(_sc({"block_size": 32}, {"block_size": 16}), "0.14.0")
    assert hz["H07"].effects["corrected"].startswith("refused: P block_size 32, D block_size 16")


# ---- KV layout: a backend that ignores the connector's layout (vLLM #46204) -------------------------------
def test_nhd_native_backend_validation_and_hazard() -> None:
    with pytest.raises(BadInput, match=r"prefill.backend_layout: expected one of NHD, HND"):
        _sc({"backend_layout": "XYZ"})
    nhd = {"backend_layout": "NHD"}
    sc = _sc(nhd, {**nhd, "tp_size": 4})  # P TP 2, D TP 4: heads split
    hz = _hz(sc, "0.9.2,0.14.0,0.26.0,0.34.0")
    assert hz["X02"].applies and "backend writes NHD, its metadata says HND" in hz["X02"].detail
    assert all("silent (permuted heads, vLLM #46204)" in hz["X02"].effects[r] for r in ("0.9.2", "0.34.0"))
    assert hz["X02"].effects["corrected"].startswith("refused where heads split")
    hz = _hz(_sc(nhd, nhd), "0.14.0")  # same TP: whole blocks, same backend both sides
    assert hz["X02"].effects["0.14.0"].endswith("fine") and hz["X02"].effects["corrected"].endswith("accepted")
    assert "X02" not in _hz(_sc(), "0.14.0")


def _layout_run(pdcheck, tmp_path: Path, prefill: str, decode: str, releases: str) -> dict[str, Any]:
    f = tmp_path / "s.toml"
    tp1 = "" if "tp_size" in prefill else "tp_size = 1\n"
    f.write_text(f'[prefill]\nengine_id = "P"\n{tp1}num_blocks = 32\nkv_heads = 8\nhead_dim = 64\n'
                 f'{prefill}\n[decode]\nengine_id = "D"\nnum_blocks = 32\nkv_heads = 8\nhead_dim = 64\n{decode}\n'
                 f'[transfer]\nrequests = 1\nblocks_per_request = 4\n')
    run = pdcheck("handshake", str(f), "--vllm", releases, "--json", timeout=120)
    assert run.code in (0, 1), run.err
    return run.json()


def test_nhd_native_head_split_is_silent_and_named_by_head(pdcheck, tmp_path: Path) -> None:
    """Real ranks: both sides advertise HND, write NHD; D TP 2 reads half of P's block as its 4 heads. Every
    release passes its checks and the proof finds other (head, token) cells; corrected refuses."""
    nhd = 'kv_cache_layout = "HND"\nbackend_layout = "NHD"'
    doc = _layout_run(pdcheck, tmp_path, nhd, f"tp_size = 2\n{nhd}", "0.9.2,0.14.0,0.26.0,0.34.0")
    for rel in ("0.9.2", "0.14.0", "0.26.0", "0.34.0"):
        assert doc["matrix"][rel] == ["silent", "silent"], rel
    assert doc["matrix"]["corrected"] == ["error", "error"]
    d1 = doc["decode_ranks"][1]
    fm = d1["transfer"]["0.14.0"]["first_mismatch"]
    # D rank 1 reads the second half of a 16-token block: its head 4, token 0 is token 8 of head 0 in NHD
    assert fm["expected"].endswith("(head 4, token 0)") and fm["found"].endswith("(head 0, token 8)"), fm
    assert "#46204" in d1["verdicts"]["corrected"]["message"]


def test_nhd_native_same_tp_is_fine_and_nhd_head_split_is_caught(pdcheck, tmp_path: Path) -> None:
    """Same TP: whole blocks, same backend: ok everywhere. Advertised NHD on both sides with D TP 2 (0.14.0 has
    no head-split layout check): the proof reads D's two-head NHD block as D's attention does and finds it
    wrong; 0.26.0 refuses (head split needs HND); corrected refuses."""
    nhd = 'kv_cache_layout = "HND"\nbackend_layout = "NHD"'
    doc = _layout_run(pdcheck, tmp_path, nhd, nhd, "0.14.0,0.34.0")
    assert doc["matrix"]["0.14.0"] == doc["matrix"]["0.34.0"] == doc["matrix"]["corrected"] == ["ok"]
    doc = _layout_run(pdcheck, tmp_path, 'kv_cache_layout = "NHD"', 'tp_size = 4\nkv_cache_layout = "NHD"',
                      "0.14.0,0.26.0")
    assert doc["matrix"]["0.14.0"] == ["silent"] * 4
    assert doc["matrix"]["0.26.0"] == ["error"] * 4 and doc["matrix"]["corrected"] == ["error"] * 4


def test_enable_permute_local_kv_per_release(pdcheck, tmp_path: Path) -> None:
    """D NHD with enable_permute_local_kv against an HND P, D TP 4 / P TP 2: 0.11.1+ accept and permute each block
    on receive (the proof checks the heads-first slices they read); 0.10.1 has no flag (bare layout assert);
    0.34 permutes LBHNC into LBNHC only (BLNHC raises); the other direction raises everywhere."""
    def run(p_layout: str, d_layout: str, releases: str) -> dict[str, Any]:
        return _layout_run(pdcheck, tmp_path, f'tp_size = 2\nkv_cache_layout = "{p_layout}"',
                           f'tp_size = 4\nkv_cache_layout = "{d_layout}"\nenable_permute_local_kv = true', releases)

    doc = run("HND", "NHD", "0.10.1,0.11.1,0.14.0,0.26.0,0.34.0")
    assert doc["matrix"]["0.10.1"] == ["assert"] * 4
    for rel in ("0.11.1", "0.14.0", "0.26.0", "0.34.0", "corrected"):
        assert doc["matrix"][rel] == ["ok"] * 4, rel
        assert all(d["transfer"][rel]["status"] == "ok" for d in doc["decode_ranks"]), rel
    doc = run("HND", "BLNHC", "0.34.0")
    assert doc["matrix"]["0.34.0"] == ["error"] * 4
    assert "receive LBHNC into a local LBNHC cache" in doc["decode_ranks"][0]["verdicts"]["0.34.0"]["message"]
    doc = run("NHD", "HND", "0.14.0")
    assert doc["matrix"]["0.14.0"] == doc["matrix"]["corrected"] == ["error"] * 4


# ---- compressed MLA caches (fp8_ds_mla) and dense MLA virtual pages (connector version 10) ------------------------
DS = {"tp_size": 1, "num_blocks": 16, "block_size": 64, "use_mla": True, "kv_heads": 1, "head_dim": 656,
      "dtype": "uint8", "cache_dtype": "fp8_ds_mla", "attn_backend": "FLASHMLA_SPARSE"}
PAGE = 64 * 656  # 41984 B: one 64-token block of 656-byte latent rows


@pytest.mark.parametrize(("prefill", "decode", "top", "needle"), [
    ({**DS, "use_mla": False}, DS, {"vllm": ["0.34.0"]}, "prefill.cache_dtype 'fp8_ds_mla' is an MLA cache"),
    ({**DS, "head_dim": 576}, DS, {"vllm": ["0.34.0"]}, "head_dim = 656"),
    (DS, DS, {"vllm": ["0.9.2"]}, "vLLM 0.9.2 does not know it"),
    ({**DS, "block_stride": PAGE - 16}, DS, {"vllm": ["0.34.0"]}, "must be at least the block's 41984 B"),
    ({**DS, "block_stride": PAGE + 8}, DS, {"vllm": ["0.34.0"]}, "multiple of 16 B"),
    ({"block_stride": 4096}, {}, {"vllm": ["0.34.0"]}, "only for compressed MLA caches"),
    (DS, {**DS, "block_stride": PAGE + 1024}, {"vllm": ["0.26.0", "0.34.0"]},
     "decode.block_stride: vLLM 0.26.0 predates dense MLA virtual pages (NIXL connector version 10"),
    (DS, {**DS, "block_stride": PAGE + 1024}, {"vllm": ["0.29.0"]}, "vLLM 0.29.0 predates"),
])
def test_bad_mla_pages_one_line(prefill: dict[str, Any], decode: dict[str, Any], top: dict[str, Any],
                                needle: str) -> None:
    with pytest.raises(BadInput) as exc:
        _sc(prefill, decode, **top)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_mla_pages_release_facts() -> None:
    from pdcheck.vllm.releases import mla_pages

    # version 10 lies between pdcheck's 0.29 model (9) and its 0.30 model (11)
    assert resolve("0.29.0").connector_version == 9 < mla_pages.DENSE_PAGES_CONNECTOR_VERSION
    assert resolve("0.30.0").connector_version == 11
    assert [r.name for r in MODELLED if mla_pages.has_dense_pages(r.name)] == [
        r.name for r in MODELLED if (r.connector_version or 0) >= mla_pages.DENSE_PAGES_CONNECTOR_VERSION]
    assert not mla_pages.has_cache_dtype("0.9.2") and mla_pages.has_cache_dtype("0.11.1")
    # a padded row is stated on the side; the page (block_len) stays what the cache dtype makes it
    sc = _sc(DS, {**DS, "block_stride": PAGE + 8448}, vllm=["0.34.0"])
    g = sc.decode.geometry()
    assert (g.block_len, g.row_len) == (PAGE, PAGE + 8448) and sc.prefill.geometry().row_len == PAGE


def _copy(src, dst, src_descs, dst_descs) -> None:  # a stand-in for a NIXL READ, pure numpy (unit test only)
    for (sa, n, _), (da, m, _) in zip(src_descs, dst_descs, strict=True):
        assert n == m
        so, do = int(sa) - src.arena.addr, int(da) - dst.arena.addr
        dst.arena.arr[do:do + int(n)] = src.arena.arr[so:so + int(n)]


def test_one_kv_cache_reads_virtual_pages_and_names_wrong_bytes() -> None:
    import numpy as np

    from pdcheck.geometry import Geometry
    from pdcheck.kvcache import KVCache, block_descs, check_blocks

    base = dict(tp_size=1, block_size=64, layers=2, total_kv_heads=1, head_dim=656, dtype="uint8",
                attn_backend="FLASHMLA_SPARSE", use_mla=True)
    p = KVCache(Geometry(**base, block_stride=PAGE + 8448), 8)  # padded rows
    d = KVCache(Geometry(**base), 8)  # dense rows
    assert p.region_bytes == 8 * (PAGE + 8448) and d.region_bytes == 8 * PAGE
    p.fill(7, 0)
    blocks = np.arange(8)
    local = d.descs(PAGE, 0)
    # as 0.30+ read: block_len bytes every block_strides[0] bytes
    _copy(p, d, block_descs(p.base_addrs, 8, PAGE, PAGE, 0, stride=p.row_len), local)
    ok = check_blocks(d, blocks, blocks, 7, 0, read_len=PAGE)
    assert ok.checked == 16 and ok.wrong == 0
    # a reader that walks P's rows at block_len lands inside the padding of earlier blocks: named wrong bytes
    d.clear_all(blocks)
    _copy(p, d, block_descs(p.base_addrs, 8, PAGE, PAGE, 0), local)
    bad = check_blocks(d, blocks, blocks, 7, 0, read_len=PAGE)
    assert bad.wrong == 14 and bad.first is not None  # block 0 of each region is the only one where they agree
    assert (bad.first.local_block, bad.first.remote_block) == (1, 1)
    assert bad.first.found.block == 0 and bad.first.found.offset == PAGE  # block 0's padding, +41984


def test_mla_virtual_pages_real_ranks(pdcheck) -> None:
    run = pdcheck("handshake", str(SCENARIOS / "mla-virtual-pages.toml"), "--json", "--hang-timeout", "2",
                  timeout=120)
    assert run.code == 0, run.err
    doc = run.json()
    assert doc["matrix"] == {"0.30.0": ["ok", "ok"], "0.34.0": ["ok", "ok"], "corrected": ["ok", "ok"]}
    for d in doc["decode_ranks"]:
        for rel in ("0.30.0", "0.34.0", "corrected"):
            t = d["transfer"][rel]
            # every page read whole from P's padded rows (64 blocks x 41984 B), none wrong
            assert t["status"] == "ok" and t["wrong"] == 0 and t["bytes"] == t["blocks"] * PAGE > 0


def test_vllm_flag_before_dense_pages_exit_2_one_line(pdcheck) -> None:
    run = pdcheck("handshake", "mla-virtual-pages", "--vllm", "0.26.0")
    assert run.code == 2 and run.out == ""
    err = run.err.strip().splitlines()
    assert len(err) == 1 and "prefill.block_stride: vLLM 0.26.0 predates dense MLA virtual pages" in err[0]


def test_fp8_ds_mla_logs_replay(pdcheck, tmp_path: Path) -> None:
    from test_fromlogs import _log_0_26

    (tmp_path / "p.log").write_text("\n".join(_log_0_26("prefill", dp=1, tp=1, cache="fp8_ds_mla", mla=True)))
    (tmp_path / "d.log").write_text("\n".join(_log_0_26("decode", dp=1, tp=2, cache="fp8_ds_mla", mla=True)))
    out = tmp_path / "x.toml"
    run = pdcheck("scenario", "from-logs", str(tmp_path / "p.log"), str(tmp_path / "d.log"), "-o", str(out))
    assert run.code == 0, run.err
    sc = load(out)
    assert (sc.decode.cache_dtype, sc.decode.dtype, sc.decode.head_dim, sc.decode.use_mla) == (
        "fp8_ds_mla", "uint8", 656, True)
    run = pdcheck("handshake", str(out), "--json", "--hang-timeout", "2", timeout=120)
    assert run.code == 0, run.err
    assert run.json()["matrix"]["0.26.0"] == ["ok", "ok"]
# ---- multi-node TP (PR #26338): a prefill TP group spanning nodes -----------------------------------------
def _nodes(p_tp: int, nodes: int, d_tp: int, vllm: list[str]):
    return _sc({"tp_size": p_tp, "nodes": nodes}, {"tp_size": d_tp}, vllm=vllm)


def test_node_addresses_and_rank_split() -> None:
    assert [multinode.rank_node(r, 8, 4) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [ports.node_host("127.0.0.1", k) for k in range(3)] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]


@pytest.mark.parametrize(("release", "lost"), [("0.9.2", [2, 3]), ("0.10.1", [2, 3]), ("0.11.0", [2, 3]),
                                               ("0.11.1", []), ("0.14.0", []), ("0.26.0", []), ("0.34.0", [])])
def test_unreachable_ranks_per_era(release: str, lost: list[int]) -> None:
    rel = resolve(release)
    assert multinode.unreachable(rel, rel.wire, 4, 2) == lost
    assert multinode.unreachable(rel, rel.wire, 4, 1) == []
    assert multinode.unreachable(CORRECTED, rel.wire, 4, 2) == []


def test_plan_marks_every_release_but_corrected_as_dialling_the_head_node() -> None:
    plan = build(_nodes(4, 2, 4, ["0.9.2", "0.34.0"]), None, RunOptions())
    assert {r.name: r.head_host for r in plan.d_releases} == {"0.9.2": True, "0.34.0": True, "corrected": False}
    plan = build(_nodes(4, 1, 4, ["0.9.2"]), None, RunOptions())
    assert not any(r.head_host for r in plan.d_releases)
    with pytest.raises(BadInput, match="--ray"):
        build(_nodes(4, 2, 4, ["0.9.2"]), None, RunOptions(), ray="auto")
    from pdcheck.vllm.plan import ServeOptions, build_serve

    with pytest.raises(BadInput, match="serve runs a P on one node"):
        build_serve(_nodes(4, 2, 4, ["0.14.0"]), resolve("0.14.0"), ServeOptions())


@pytest.mark.parametrize(("p_tp", "nodes", "d_tp", "vllm"), [
    (4, 2, 4, ["0.9.1", "0.9.2", "0.10.1", "0.11.0", "0.11.1", "0.14.0", "0.26.0", "0.34.0"]),
    (4, 4, 8, ["0.9.2", "0.11.0", "0.14.0", "0.34.0"]),
    (8, 2, 2, ["0.14.0", "0.34.0"]),  # P TP > D TP: 0.14+ read every P rank from the head node's listener
    (2, 2, 4, ["0.9.1", "0.9.2", "0.11.1"]),
])
def test_h23_names_exactly_the_d_ranks_the_engine_hangs(p_tp: int, nodes: int, d_tp: int, vllm: list[str]) -> None:
    """H23's line per release and the pure engine's verdicts (test_release_models.scenario_statuses, the P ranks
    off the head node mute for releases that dial the head node for them) agree rank for rank."""
    from test_release_models import scenario_statuses

    sc = _nodes(p_tp, nodes, d_tp, vllm)
    hz = _hz(sc, ",".join(vllm))["H23"]
    assert hz.applies and f"spans {nodes} nodes" in hz.detail
    for rel in vllm:
        hung = [r for r, s in enumerate(scenario_statuses(sc, rel)) if s == "hang"]
        named = re.search(r"D ranks? ([\d, ]+) get no reply", hz.effects[rel])
        assert (named is None and not hung) or [int(x) for x in named.group(1).split(", ")] == hung, rel
        if resolve(rel).wire >= "F":
            assert "PR #26338" in hz.effects[rel] and not hung
    assert scenario_statuses(sc, "corrected") == ["ok"] * d_tp
    assert not _hz(_nodes(p_tp, 1, d_tp, vllm), vllm[0])["H23"].applies


@pytest.mark.parametrize(("prefill", "needle"), [
    ({"tp_size": 4, "nodes": 3}, "prefill.nodes: 3 nodes must divide tp_size 4"),
    ({"tp_size": 4, "nodes": 9}, "prefill.nodes"),
    ({"tp_size": 4, "nodes": 2, "dp_size": 2}, "with dp_size 2 is not modelled"),
    ({"tp_size": 4, "nodes": 2, "host": "::1"}, "must be an IPv4 loopback address"),
])
def test_bad_nodes_one_line(prefill: dict[str, Any], needle: str) -> None:
    with pytest.raises(BadInput) as exc:
        _sc(prefill)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_bad_nodes_exit_2_from_the_cli(pdcheck, tmp_path: Path) -> None:
    f = tmp_path / "nodes.toml"
    f.write_text('[prefill]\nnum_blocks = 64\ntp_size = 4\nnodes = 3\n[decode]\nnum_blocks = 64\n')
    run = pdcheck("handshake", str(f))
    assert run.code == 2 and run.out == ""
    assert len(run.err.strip().splitlines()) == 1 and "prefill.nodes" in run.err


def test_multinode_real_ranks_on_their_node_addresses(pdcheck) -> None:
    """The bundled scenario, real processes: P ranks 2-3 listen on 127.0.0.2; 0.9.2's D ranks 2-3 dial the head
    node's address for them and hang; 0.11.1 reads all four through rank 0's listener; corrected, against 0.9.2's
    per-rank listeners, reads each where it listens; the transfer proof passes wherever the handshake did."""
    run = pdcheck("handshake", str(SCENARIOS / "multinode-tp-26338.toml"), "--vllm", "0.9.2,0.11.1", "--json",
                  "--hang-timeout", "1", timeout=120)
    assert run.code == 1, run.err
    doc = run.json()
    assert [p["node"].split(" ", 1)[1] for p in doc["prefill_ranks"]] == [
        "node 0 (127.0.0.1)", "node 0 (127.0.0.1)", "node 1 (127.0.0.2)", "node 1 (127.0.0.2)"]
    assert doc["matrix"] == {"0.9.2": ["ok", "ok", "hang", "hang"], "0.11.1": ["ok"] * 4, "corrected": ["ok"] * 4}
    for d in doc["decode_ranks"]:
        for rel in ("0.11.1", "corrected"):
            assert d["transfer"][rel]["status"] == "ok" and d["transfer"][rel]["wrong"] == 0, (d["tp_rank"], rel)
    assert "no reply from P rank 2" in doc["decode_ranks"][2]["verdicts"]["0.9.2"]["message"]
    h23 = next(h for h in doc["hazards"] if h["id"] == "H23")
    assert h23["applies"] and "D ranks 2, 3 get no reply" in h23["effects"]["0.9.2"]
    run = pdcheck("handshake", str(SCENARIOS / "multinode-tp-26338.toml"), "--vllm", "0.9.2", "--json",
                  "--hang-timeout", "1", timeout=120)
    doc = run.json()
    assert doc["matrix"]["corrected"] == ["ok"] * 4  # per-rank listeners: corrected dials each rank's own node
    assert all(d["transfer"]["corrected"]["status"] == "ok" for d in doc["decode_ranks"])
