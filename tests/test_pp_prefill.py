"""Pipeline parallel on the prefill side only: which stage's metadata P serves and D asks, per release line, and
the release's own layer check on it (releases.shapes); one real-process run of the bundled scenario."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from conftest import ROOT

from pdcheck.geometry import Geometry
from pdcheck.vllm.engine import Params, run
from pdcheck.vllm.hazards import evaluate
from pdcheck.vllm.releases import CORRECTED, MODELLED, compat_hash_for, resolve, resolve_many, shapes
from pdcheck.vllm.releases.base import Local, Prepared, ReleaseModel
from pdcheck.vllm.scenario import load
from pdcheck.vllm.wire import FORMATS, AnyMeta, WireFormat, encode_reply

SCENARIO = ROOT / "scenarios" / "pp2-prefill-only.toml"
G = Geometry(tp_size=2, block_size=16, layers=2, total_kv_heads=4, head_dim=64, dtype="bfloat16",
             attn_backend="FLASH_ATTN", use_mla=False)


def _meta(rank: int) -> AnyMeta:
    n = G.num_regions
    return AnyMeta(engine_id="prefill", agent_metadata=f"prefill/{rank}".encode(),
                   kv_caches_base_addr=[(rank + 1) << 32 | r << 24 for r in range(n)], num_blocks=64, tp_size=2,
                   block_len=G.block_len, block_lens=[G.block_len] * n, block_strides=[G.block_len] * n,
                   attn_backend_name="FLASH_ATTN", kv_cache_layout="HND", device_id=rank, block_size=16,
                   ssm_sizes=(0, 0), physical_blocks_per_logical_kv_block=1, region_names=G.region_layers(),
                   region_members=[[x] for x in G.region_layers()])


@dataclass
class StageIO:
    """P with 2 stages as the release's listener serves them (shapes.served_stage / keyed by stage in H)."""

    p_wire: str
    compat: str | None
    asked: list[tuple[int, int]]

    def fetch(self, fmt: WireFormat, p_rank: int, timeout_ms: int | None, pp_rank: int = 0) -> list[bytes]:
        stage = shapes.answered_stage(self.p_wire, pp_rank, 2)
        self.asked.append((stage, p_rank))
        return encode_reply(FORMATS[self.p_wire], shapes.stage_metadata(_meta(p_rank), G, 2, stage), self.compat)

    def add_remote_agent(self, blob: bytes) -> str:
        return blob.decode()

    def prep_remote(self, prepared: Prepared, mem_type: str) -> None:
        pass


def _run(rel: ReleaseModel, r: int = 1, p_wire: str | None = None) -> tuple[Any, list[tuple[int, int]]]:
    wire = p_wire or ("H34" if rel is CORRECTED else rel.wire)
    h = compat_hash_for(rel if rel is not CORRECTED else resolve("0.34.0"), G, "pdcheck/fake-model")
    io = StageIO(wire, h, [])
    local = Local("decode", r, 2, 64, G, "HND", r, model="pdcheck/fake-model")
    out = run(rel, local, Params("prefill", 2, wire, local_hash=h, pp_size=2), io)
    return out, io.asked


def test_pp_layers_as_get_pp_indices() -> None:
    assert [shapes.pp_layers(2, 2, s) for s in range(2)] == [(0, 1), (1, 2)]
    assert [shapes.pp_layers(5, 3, s) for s in range(3)] == [(0, 2), (2, 4), (4, 5)]  # remainder before the last
    assert [shapes.pp_layers(8, 4, s) for s in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_stage_metadata_cuts_each_stage_to_its_layers() -> None:
    s0, s1 = (shapes.stage_metadata(_meta(0), G, 2, s) for s in range(2))
    assert s0.region_names == ["model.layers.0.self_attn.attn"] * 2
    assert s1.region_members == [["model.layers.1.self_attn.attn"]] * 2
    assert s0.kv_caches_base_addr + s1.kv_caches_base_addr == _meta(0).kv_caches_base_addr
    assert shapes.merge_stages([s0, s1]) == _meta(0)
    assert shapes.stage_metadata(_meta(0), G, 1, 0) == _meta(0)


@pytest.mark.parametrize(("release", "stages", "pp"), [
    ("0.9.1", [0], None), ("0.14.0", [0], None), ("0.25.0", [0], None), ("0.26.0", [0], None),
    ("0.28.0", [0], None), ("0.29.0", [0, 1], 2), ("0.34.0", [0, 1], 2)])
def test_asked_stages_and_params_per_line(release: str, stages: list[int], pp: int | None) -> None:
    rel = resolve(release)
    assert shapes.asked_stages(rel, 2) == stages
    assert shapes.params_pp_size(rel, 2) == pp
    assert shapes.asked_stages(CORRECTED, 2) == [0, 1]


def test_served_stage_per_era() -> None:
    assert shapes.served_stage("B", 2) == 0 and shapes.served_stage("E", 2) == 0  # per-worker listeners
    assert shapes.served_stage("F", 2) == 1 and shapes.served_stage("G24", 2) == 1  # content.update: last wins


@pytest.mark.parametrize(("release", "status", "check", "answered", "message"), [
    ("0.9.1", "ok", None, [(0, 0), (0, 1)], None),  # no layer check: the READ fails in NIXL (real run below)
    ("0.11.1", "assert", "kv_caches_base_addr_len", [(1, 1)], None),
    ("0.14.0", "assert", "kv_caches_base_addr_len", [(1, 1)], None),
    ("0.24.0", "assert", "num_kv_layers", [(1, 1)], shapes.MSG_PP_LAYERS),
    ("0.26.0", "assert", "num_kv_layers", [(0, 1)], shapes.MSG_PP_LAYERS),
    ("0.29.0", "assert", "num_kv_layers", [(0, 1)], shapes.MSG_PP_LAYERS),
    ("0.33.0", "assert", "num_kv_layers", [(0, 1)], shapes.MSG_PP_LAYERS),
    ("0.34.0", "error", "layers_held", [(0, 1)],
     "Engine prefill does not hold the KV layers ['model.layers.1.self_attn.attn']."),
])
def test_one_stage_trips_the_release_layer_check(release: str, status: str, check: str | None,
                                                   answered: list[tuple[int, int]], message: str | None) -> None:
    out, asked = _run(resolve(release))
    assert (out.status, out.check, out.message) == (status, check, message)
    assert asked == answered
    assert out.contacted_stages == [s for s, _ in answered] and out.contacted == [r for _, r in answered]


def test_corrected_reads_every_stage() -> None:
    out, asked = _run(CORRECTED)
    assert out.status == "ok" and asked == [(0, 1), (1, 1)]
    assert out.contacted_stages == [0, 1]


@pytest.mark.parametrize(("p_wire", "stage"), [("B", 0), ("G", 1), ("G24", 1)])
def test_corrected_refuses_a_p_serving_one_stage_per_port(p_wire: str, stage: int) -> None:
    """Before era H a request names a TP rank only: asking again returns the same stage, never the others."""
    out, asked = _run(CORRECTED, p_wire=p_wire)
    assert (out.status, out.exception, out.check) == ("error", "RuntimeError", shapes.PP_STAGES_CHECK)
    assert out.message == shapes.stages_unreachable(p_wire, 2) and asked == []
    assert f"(era {p_wire}) serves one stage per port" in out.message and f"stage {stage} answers" in out.message


@pytest.mark.parametrize("rel", [r for r in MODELLED if r.number >= (0, 9, 1)], ids=lambda r: r.name)
def test_x01_line_names_the_check_the_run_stops_at(rel: ReleaseModel) -> None:
    out, _ = _run(rel)
    effect = shapes.pp_effect(rel, 2, 1)
    assert "ok" not in effect.split(";")[-1]
    if out.check == "layers_held":
        assert "does not hold the KV layers" in effect
    elif out.check == "num_kv_layers":
        assert shapes.MSG_PP_LAYERS in effect
    elif out.check == "kv_caches_base_addr_len":
        assert "len(nixl_agent_meta.kv_caches_base_addr) == len(self.block_len_per_layer)" in effect
    else:
        assert out.status == "ok" and "no layer-count check" in effect
    hz = {h.id: h for h in evaluate(load(SCENARIO), resolve_many(rel.name))}["X01"]
    assert hz.effects[rel.name] == effect and "serves every stage's metadata … so its handshake passes" not in effect


def test_real_ranks_per_release(pdcheck) -> None:
    run = pdcheck("handshake", str(SCENARIO), "--vllm", "0.9.1,0.26.0,0.34.0", "--json", timeout=180)
    assert run.code == 1, run.err
    doc = run.json()
    by = {(v["release"], v["rank"]): v for v in doc["verdicts"]}
    v34 = by["0.34.0", "D1"]
    assert v34["status"] == "error" and v34["contacted"] == [1] and v34["contacted_stages"] == [0]
    assert v34["detail"].startswith("RuntimeError: Engine prefill does not hold the KV layers "
                                    "['model.layers.1.self_attn.attn']. (at P stage 0, TP rank 1)")
    v26 = by["0.26.0", "D0"]
    assert v26["status"] == "assert" and shapes.MSG_PP_LAYERS in v26["detail"] and v26["contacted_stages"] == [0]
    assert by["0.9.1", "D0"]["status"] == "error" and "NIXL_ERR_INVALID_PARAM" in by["0.9.1", "D0"]["detail"]
    for d in doc["decode_ranks"]:
        corr = d["corrected"] if "corrected" in d else d["verdicts"].get("corrected")
        if corr is not None:
            assert corr["status"] == "ok" and corr["contacted_stages"] == [0, 1]
            assert d["transfer"]["corrected"]["wrong"] == 0
