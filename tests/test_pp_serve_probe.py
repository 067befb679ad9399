"""serve and probe on a prefill with pipeline stages (P PP 2 x TP 2, D TP 2; scenario pp2-prefill-only): serve
serves each stage's metadata as the release does, probe asks each (pp_rank, tp_rank) the release keys and names
the stage in its verdicts, and pdcheck's D ranks (handshake --prefill-endpoint) that fetch stage (0, r) stop
where the release stops. Real processes and sockets on both ends."""

from __future__ import annotations

import json

import msgspec
import pytest
from test_live import pdcheck, serve

from pdcheck.vllm.probe import ProbeReport
from pdcheck.vllm.releases import shapes
from pdcheck.vllm.serve import Ready

SCENARIO = "pp2-prefill-only"
L0, L1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


def _probe(s, release: str, *extra: str) -> tuple[int, ProbeReport]:
    r = pdcheck("probe", s.endpoint, "--vllm", release, "--prefill-tp", "2", "--scenario", SCENARIO, "--json", *extra)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, msgspec.json.decode(r.stdout, type=ProbeReport)


def _live(s, release: str) -> dict:
    r = pdcheck("handshake", SCENARIO, "--vllm", release, "--prefill-endpoint", s.endpoint, "--json")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def test_serve_034_every_stage_probe_reads_each_and_d_stops_at_stage_0():
    with serve(SCENARIO, "--vllm", "0.34.0") as s:
        ready = msgspec.convert(s.doc, Ready)
        assert ready.pp_size == 2 and ready.kv_transfer_params["pp_size"] == 2
        assert [(st.pp_rank, st.layers, st.served) for st in ready.stages] == [(0, [0, 1], True), (1, [1, 2], True)]
        assert [e.stages for e in ready.endpoints] == [[0, 1]]  # one scheduler port keyed by (pp_rank, tp_rank)
        code, rep = _probe(s, "0.34.0")
        doc = _live(s, "0.34.0")
    asked = [x.split(" request ")[1] for x in s.err.decode().splitlines() if "-> reply" in x]
    # serve's request log names the stage that answered: probe asks (0, r) and (1, r), D ranks (0, r)
    assert {"['get_meta_msg', 1, 0] pp_rank 1 tp_rank 0 -> reply", "['get_meta_msg', 0, 1] pp_rank 0 tp_rank 1 -> reply"} \
        <= {x.rsplit(" ", 2)[0] for x in asked}
    assert code == 1 and rep.verdict == "hazard" and rep.pp_size == 2
    assert [(r.pp_rank, r.tp_rank, r.layers) for r in rep.prefill_ranks] == [(0, 0, [L0]), (0, 1, [L0])]
    assert [(r.pp_rank, r.tp_rank, r.status, r.layers) for r in rep.stages] == [(1, 0, "ok", [L1]), (1, 1, "ok", [L1])]
    for i, v in enumerate(rep.verdicts):
        assert (v.status, v.contacted, v.contacted_stages) == ("error", [i], [0])
        assert v.detail.startswith(f"RuntimeError: Engine prefill does not hold the KV layers ['{L1}']. "
                                   f"(at P stage 0, TP rank {i}) (per request: ")
    for v in doc["verdicts"]:  # the real D ranks fetched (0, r) over the socket and stop as 0.34.0 does
        assert (v["status"], v["contacted_stages"]) == ("error", [0]) and "does not hold the KV layers" in v["detail"]
    for d in doc["decode_ranks"]:
        corr = d["verdicts"]["corrected"]
        assert corr["status"] == "ok" and corr["contacted_stages"] == [0, 1] and d["transfer"]["corrected"]["wrong"] == 0


def test_serve_026_no_pp_size_in_params_d_asks_stage_0_and_asserts():
    with serve(SCENARIO, "--vllm", "0.26.0") as s:
        ready = msgspec.convert(s.doc, Ready)
        assert "pp_size" not in ready.kv_transfer_params and ready.pp_size == 2
        code, rep = _probe(s, "0.26.0")
        doc = _live(s, "0.26.0")
    assert code == 1 and [(r.pp_rank, r.regions, r.layers) for r in rep.stages] == [(1, 1, None), (1, 1, None)]
    for v in [*rep.verdicts, *(msgspec.convert(x, type(rep.verdicts[0])) for x in doc["verdicts"])]:
        assert v.status == "assert" and v.contacted_stages == [0] and shapes.MSG_PP_LAYERS in v.detail
        assert f"(at P stage 0, TP rank {v.contacted[0]}) (per request: " in v.detail


@pytest.mark.parametrize(("release", "stage"), [("0.14.0", 1), ("0.9.2", 0)])
def test_before_era_h_one_stage_answers_each_port(release: str, stage: int):
    with serve(SCENARIO, "--vllm", release) as s:
        ready = msgspec.convert(s.doc, Ready)
        assert {tuple(e.stages) for e in ready.endpoints} == {(stage,)}
        assert [st.served for st in ready.stages] == [st.pp_rank == stage for st in ready.stages]
        _code, rep = _probe(s, release)
    logged = [x for x in s.err.decode().splitlines() if "-> reply" in x]
    assert logged and all(f" pp_rank {stage} tp_rank " in x for x in logged)  # the stage the port answers with
    assert [r.pp_rank for r in rep.prefill_ranks] == [stage, stage] and rep.stages == []
    assert any(f"answers with stage {stage}'s metadata" in n for n in rep.notes)
    assert all(v.contacted_stages == [stage] for v in rep.verdicts) and rep.verdicts


@pytest.mark.parametrize(("args", "text"), [
    (("--vllm", "0.34.0", "--pp-size", "0"), "--pp-size: 0 is out of range (1 to 16)"),
    (("--sglang", "0.5.8", "--pp-size", "2"), "--pp-size: not available for SGLang"),
])
def test_pp_size_bad_input_is_one_line(args: tuple[str, ...], text: str):
    r = pdcheck("probe", "127.0.0.1:5600", *args)
    assert r.returncode == 2 and r.stderr.startswith(f"pdcheck: error: {text}") and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("release", ["0.29.0", "0.34.0"])
def test_enum_layout_names_are_no_h09_a_real_mismatch_is(release: str):
    """A 0.29+ P advertises LBHNC, HND's KVCacheLayout name: against an HND decode no H09; against NHD the
    release refuses and H09 says why."""
    geo = ("--kv-heads", "4", "--head-dim", "64", "--decode-blocks", "512")
    with serve("--vllm", release, "--prefill-tp", "1", "--prefill-blocks", "512", *geo) as s:
        same = pdcheck("probe", s.endpoint, "--vllm", release, "--prefill-tp", "1", *geo, "--json")
        other = pdcheck("probe", s.endpoint, "--vllm", release, "--prefill-tp", "1", *geo,
                        "--decode-kv-cache-layout", "NHD", "--json")
    reps = [msgspec.json.decode(r.stdout, type=ProbeReport) for r in (same, other)]
    logged = [x for x in s.err.decode().splitlines() if "-> reply" in x]
    assert len(logged) == 2 and all("pp_rank" not in x for x in logged)  # one stage: the TP rank only
    assert [r.prefill_ranks[0].layout for r in reps] == ["LBHNC", "LBHNC"]
    assert same.returncode == 0 and reps[0].verdict == "ok" and not [h for h in reps[0].hazards if h.applies]
    assert other.returncode == 1 and [h.id for h in reps[1].hazards if h.applies] == ["H09"]
    assert reps[1].verdicts[0].detail.startswith("RuntimeError: Heterogeneous TP expects same kv_cache_layout")


@pytest.mark.parametrize("release", ["0.11.1", "0.25.0"])
def test_corrected_d_refuses_a_live_p_serving_one_stage_per_port(release: str):
    """0.11.1 - 0.25 serve the last stage for every request (it names a TP rank only): asking again returns the
    same stage, so the corrected D refuses instead of reading stage 1's layers as all of them."""
    with serve(SCENARIO, "--vllm", release) as s:
        doc = _live(s, release)
    for d in doc["decode_ranks"]:
        corr = d["verdicts"]["corrected"]
        assert (corr["status"], corr["exception"], corr["check"]) == ("error", "RuntimeError", "pp_stages_served")
        assert "serves one stage per port" in corr["message"] and "cannot read every stage's layers" in corr["message"]
        assert corr["contacted"] == [] and d["transfer"]["corrected"]["message"] == "handshake ended in error"
