"""hazards.evaluate on the bundled scenarios and on synthetic ones, plus spread() and the catalogue."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pdcheck.vllm.engine import Params, run
from pdcheck.vllm.hazards import (
    CATALOGUE,
    SHAPE_CATALOGUE,
    Facts,
    Hazard,
    block_path,
    evaluate,
    ranks_text,
    spread,
)
from pdcheck.vllm.releases import CORRECTED, resolve
from pdcheck.vllm.releases.base import Local
from pdcheck.vllm.scenario import Scenario, load
from pdcheck.vllm.wire import encode_reply

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"
REFERENCE = Path("/work/shared/reference/vllm-nixl-protocol.md")
SEED = [111680, 111488, 111488, 111488, 111488, 111488, 112448, 111488]
REQUIRED = {"H01", "H02", "H03", "H07", "H08", "H09", "H10", "H11", "H12", "H18", "H19", "H25"}
EQ = "`assert self.dst_num_blocks[engine_id] == nixl_agent_meta.num_blocks`"
GE = "`assert self.num_blocks >= nixl_agent_meta.num_blocks`"


def bundled(name: str) -> Scenario:
    return load(SCENARIOS / f"{name}.toml")


def models(sc: Scenario) -> list[Any]:
    return [resolve(v) for v in sc.vllm] + [CORRECTED]


def by_id(sc: Scenario) -> dict[str, Hazard]:
    return {h.id: h for h in evaluate(sc, models(sc))}


def synth(prefill: dict[str, Any], decode: dict[str, Any], **top: Any) -> Scenario:
    doc: dict[str, Any] = {"prefill": {"engine_id": "P", **prefill}, "decode": {"engine_id": "D", **decode}, **top}
    doc.setdefault("vllm", ["0.9.0", "0.9.1", "0.9.2", "0.10.0"])
    return load(None, doc)


# ---- catalogue and spread ------------------------------------------------------------------------------
def test_catalogue_ids_are_h01_to_h28() -> None:
    assert list(CATALOGUE) == [f"H{i:02d}" for i in range(1, 29)]


@pytest.mark.skipif(not REFERENCE.exists(), reason="reference not present")
def test_catalogue_names_match_reference_table() -> None:
    text = REFERENCE.read_text()
    section = text[text.index("## 11."):text.index("## Appendix A")]
    ref = {m.group(1): m.group(2).strip().replace("\u2011", "-")
           for m in re.finditer(r"^\| (H\d\d) \| ([^|]+) \|", section, re.M)}
    assert ref == CATALOGUE


def test_spread_seed() -> None:
    s = spread(SEED)
    assert (s.min, s.max, s.mode, s.differing) == (111488, 112448, 111488, [0, 6])


def test_spread_even_and_tie() -> None:
    assert spread([5808]).differing == []
    assert spread([3000, 3000, 3000]).differing == []
    tie = spread([3008, 2992])  # a tie: rank 0's count is the mode, so rank 1 is the odd one out
    assert (tie.mode, tie.differing, tie.min, tie.max) == (3008, [1], 2992, 3008)
    with pytest.raises(ValueError):
        spread([])


def test_ranks_text() -> None:
    assert ranks_text([1, 2, 3, 4, 5, 7]) == "1-5,7"
    assert ranks_text([2, 3]) == "2,3"
    assert ranks_text([6]) == "6"
    assert ranks_text([0, 2, 4, 5, 6]) == "0,2,4-6"


# ---- bundled scenarios ---------------------------------------------------------------------------------
APPLIES = {
    "seed-19338-tp8": {"H01", "H02", "H03", "H04"},
    "decode-fewer-blocks": {"H02"},
    "hetero-d4-p2": {"H01", "H03", "H04", "H08", "H21"},
    "hetero-p4-d2": {"H02", "H03", "H11"},
    "block-size-mismatch": {"H07", "H08"},
    "kv-heads-mismatch": {"H08"},
    "layout-mismatch": {"H09"},
    "cross-release-listener-death": {"H15", "H21"},
    "attn-backend-mismatch": {"H08", "H10"},
    "mla": {"H01", "H02", "H03", "H04", "H21"},
    "dp2-host-unset-27083": {"H20"},
    "dp2-wrong-port-27083": {"H20"},
    "pp2-pull-52913": {"X01"},
    "pp2-prefill-only": {"X01"},
    "block-size-per-request-42895": {"H07", "H08"},
    "fp8-dynamic-scales-42179": {"H28"},
    "hybrid-mamba-10741": {"X10"},
    "hybrid-sliding-window": {"X10"},
    "nhd-native-46204": {"X02"},
    "mla-virtual-pages": set(),  # both sides on fp8_ds_mla, pages equal: the padded rows are read right
    "mla-fp8-ds-vs-auto": {"H08", "H17"},
    "multinode-tp-26338": {"H23"},
}


def test_every_bundled_scenario_has_an_applies_row() -> None:
    assert sorted(p.stem for p in SCENARIOS.glob("*.toml")) == sorted(APPLIES)


@pytest.mark.parametrize("name", sorted(APPLIES))
def test_bundled_applies(name: str) -> None:
    sc = bundled(name)
    hz = evaluate(sc, models(sc))
    ids = [h.id for h in hz]
    assert ids == sorted(ids) and REQUIRED <= set(ids)
    assert {h.id for h in hz if h.applies} == APPLIES[name]
    for h in hz:
        assert h.name == {**CATALOGUE, **SHAPE_CATALOGUE}[h.id] and h.detail
        if h.applies:
            assert "corrected" in h.effects and set(sc.vllm) >= set(h.effects) - {"corrected"}
        else:
            assert h.effects == {}


def test_seed_details() -> None:
    hz = by_id(bundled("seed-19338-tp8"))
    assert hz["H03"].detail.startswith("P ranks 0,6 differ: 111680/112448 vs 111488 on ranks 1-5,7; D ranks 1-7 ")
    assert hz["H01"].detail == ("P rank 0 advertises 111680; D ranks 1-7 read P ranks 1-7 (111488 on P ranks "
                                "1-5,7; 112448 on P rank 6)")
    e091 = hz["H01"].effects["0.9.1"]
    assert f"{EQ} fires on D rank 6 (111680 vs 112448 on P rank 6)" in e091
    assert f"D ranks 1-5,7 stop earlier at {GE}" in e091
    assert "D ranks 1-7 read with stride 111680" in e091
    assert hz["H01"].effects["corrected"].endswith("111488 on P ranks 1-5,7; 112448 on P rank 6")
    assert hz["H02"].detail == "D ranks 1-5,7 (111488) < P rank 0 (111680)"
    assert hz["H02"].effects["0.9.1"] == f"{GE} fires on D ranks 1-5,7"
    assert "dropped by #19532" in hz["H02"].effects["0.9.2"]
    assert "cannot fire" in hz["H03"].effects["0.10.0"]
    assert hz["H04"].effects["0.9.1"].startswith("with asserts stripped (python -O): D ranks 1-7 use stride 111680")
    assert "0.9.2" not in hz["H04"].effects


def test_decode_fewer_blocks() -> None:
    hz = by_id(bundled("decode-fewer-blocks"))
    assert hz["H02"].detail == "D rank 0 (5800) < P rank 0 (5808)"
    assert hz["H02"].effects["0.9.1"] == f"{GE} fires on D rank 0"
    assert hz["H01"].detail == "P TP 1: there is only rank 0"


def test_hetero_p4_d2() -> None:
    hz = by_id(bundled("hetero-p4-d2"))
    assert hz["H11"].detail == "P TP 4 > D TP 2"
    assert "'Local TP size must be divisible by remote TP size.'" in hz["H11"].effects["0.9.1"]
    assert "ZeroDivisionError" in hz["H11"].effects["0.9.2"] and "ZeroDivisionError" in hz["H11"].effects["0.10.0"]
    assert hz["H11"].effects["corrected"] == ("supported: each D rank reads 2 P ranks, a head slice from each; "
                                              "D rank 0 reads P ranks 0,1")
    assert hz["H03"].detail.endswith("D rank 0 reads P ranks 0,1")  # D rank 1 reads 2,3: equal counts
    assert hz["H02"].effects["0.9.1"].endswith("is not reached on the ranks concerned")


def test_block_size_mismatch_surfaces_as_shape() -> None:
    hz = by_id(bundled("block-size-mismatch"))
    assert hz["H07"].detail == "P block_size 32 vs D 16 (P block_len 8192 B, D 4096 B)"
    assert "the block-size assert behind it cannot fire" in hz["H07"].effects["0.9.1"]
    assert "(8192 B vs 4096 B)" in hz["H07"].effects["0.10.0"]
    assert hz["H07"].effects["0.9.0"].startswith("no check")
    # the corrected model's length check comes first and names the same bytes as H08's line
    assert hz["H07"].effects["corrected"] == ("refused by the block length check first (H08): P block is 8192 B, "
                                              "D expects 4096 B")
    assert hz["H08"].effects["corrected"] == "refused: P block is 8192 B, D expects 4096 B"


def test_kv_heads_mismatch() -> None:
    h = by_id(bundled("kv-heads-mismatch"))["H08"]
    assert h.detail.endswith("kv_heads 8 vs 4")
    assert h.effects["0.9.2"].startswith("`assert nixl_agent_meta.block_len == self.block_len * tp_ratio` fails")
    assert h.effects["corrected"] == "refused: P block is 8192 B, D expects 4096 B"


def test_layout_mismatch() -> None:
    h = by_id(bundled("layout-mismatch"))["H09"]
    assert h.detail == "P NHD vs D HND, tp_ratio 2"
    assert "not on the wire (era B)" in h.effects["0.9.1"] and "silent" in h.effects["0.9.1"]
    assert "not on the wire (era C)" in h.effects["0.10.0"]


@pytest.mark.parametrize(("p_layout", "d_layout", "applies"), [
    ("LBHNC", "HND", False), ("LBNHC", "NHD", False), ("LBHNC", "NHD", True), ("HND", "LBNHC", True)])
def test_layout_names_compare_as_the_release_resolves_them(p_layout: str, d_layout: str, applies: bool) -> None:
    """0.29+ metadata carries KVCacheLayout names (LBHNC is HND's): the same layout by either name is no H09."""
    geo = {"tp_size": 1, "num_blocks": 512, "kv_heads": 4, "head_dim": 64}
    sc = synth({**geo, "kv_cache_layout": p_layout}, {**geo, "kv_cache_layout": d_layout}, vllm=["0.34.0"])
    assert by_id(sc)["H09"].applies is applies


def test_mla_has_no_layout_hazard_and_hangs_090() -> None:
    hz = by_id(bundled("mla"))
    assert not hz["H09"].applies and not hz["H08"].applies
    assert hz["H21"].effects["0.9.0"].startswith("D ranks 2,3 ask P ports nobody listens on")
    assert hz["H02"].detail == "D rank 1 (2992) < P rank 0 (3008)"


# ---- synthetic scenarios -------------------------------------------------------------------------------
def test_h12_missing_tp_size() -> None:
    sc = synth({"tp_size": 2, "num_blocks": 2048}, {"tp_size": 2, "num_blocks": 2048},
               kv_transfer_params={"omit_tp_size": True})
    h = by_id(sc)["H12"]
    assert h.applies and h.detail == "kv_transfer_params lack tp_size: D reads 1 while P runs TP 2"
    assert h.effects["0.9.1"].endswith("unaffected")
    assert h.effects["0.9.2"].startswith("tp_ratio 2: D ranks ask P rank 0 and fail")
    assert not by_id(synth({"tp_size": 2, "num_blocks": 8}, {"tp_size": 2, "num_blocks": 8}))["H12"].applies


def test_h18_engine_id_mismatch() -> None:
    sc = synth({"num_blocks": 64}, {"num_blocks": 64}, kv_transfer_params={"remote_engine_id": "Q"})
    h = by_id(sc)["H18"]
    assert h.applies
    assert h.effects["0.10.0"] == "RuntimeError: Remote NIXL agent engine ID mismatch. Expected Q,received P."
    assert h.effects["0.9.2"].startswith("no check") and "KeyError" in h.effects["0.9.2"]


def test_h19_engine_id_collision() -> None:
    sc = load(None, {"vllm": ["0.9.0", "0.9.1", "0.9.2", "0.10.0"],
                     "prefill": {"engine_id": "X", "num_blocks": 5800},
                     "decode": {"engine_id": "X", "num_blocks": 5808}})
    h = by_id(sc)["H19"]
    assert h.applies and h.detail == "remote engine id equals D's own 'X'"
    assert "Conflict engine id found!" in h.effects["0.9.0"]
    assert h.effects["0.9.1"] == f"no guard: {EQ} compares D's own count and fires on D rank 0"
    assert h.effects["corrected"] == "refused: the remote engine id equals the local one"
    tp = load(None, {"vllm": ["0.9.1"], "prefill": {"engine_id": "X", "tp_size": 2, "num_blocks": 64},
                     "decode": {"engine_id": "X", "tp_size": 4, "num_blocks": 64}})
    assert "compares D's own TP 4 with 2" in by_id(tp)["H19"].effects["0.9.1"]


def test_h25_device_ids() -> None:
    sc = synth({"tp_size": 2, "num_blocks": 64, "device_ids": [4, 5]}, {"tp_size": 2, "num_blocks": 64})
    h = by_id(sc)["H25"]
    assert h.applies
    assert h.detail.startswith("P rank 0 on device 4, P rank 1 on device 5")
    assert "remote_tp_rank" in h.effects["0.9.1"] and "D's own rank" in h.effects["0.9.0"]
    same = synth({"tp_size": 2, "num_blocks": 64, "device_ids": [0, 1]}, {"tp_size": 2, "num_blocks": 64})
    assert not by_id(same)["H25"].applies


def test_h11_not_divisible_hangs_the_rank_without_a_p() -> None:
    sc = synth({"tp_size": 3, "kv_heads": 12, "num_blocks": 64}, {"tp_size": 4, "kv_heads": 12, "num_blocks": 64})
    hz = by_id(sc)
    assert hz["H11"].detail == "D TP 4 is not a multiple of P TP 3"
    assert hz["H11"].effects["0.9.2"] == ("`divide(4, 3)`: '4 is not divisible by 3' on D ranks 0-2; D rank 3 asks "
                                          "P ranks that do not exist and blocks in recv() (H21)")
    assert hz["H11"].effects["corrected"] == "refused: TP sizes D=4 and P=3 do not divide"
    assert "0.9.2" in hz["H21"].effects


def test_h13_replicated_p_bigger() -> None:
    sc = synth({"tp_size": 4, "kv_heads": 2, "num_blocks": 64}, {"tp_size": 2, "kv_heads": 2, "num_blocks": 64})
    assert by_id(sc)["H13"].applies
    assert by_id(sc)["H13"].effects["corrected"] == ("replicated KV: each D rank reads one P rank of its group "
                                                     "(D rank 0 reads P rank 0)")


def test_h13_per_release_rule() -> None:
    """P TP == heads: 0.14 - 0.19 (`//` >= 1) assert, 0.20+ (`>`) split; MLA: 0.20 asserts, 0.21+ do not."""
    rels = {"vllm": ["0.19.0", "0.20.0", "0.34.0"]}
    sc = synth({"tp_size": 2, "kv_heads": 2, "num_blocks": 64}, {"tp_size": 1, "kv_heads": 2, "num_blocks": 64},
               **rels)
    eff = by_id(sc)["H13"].effects
    assert eff["0.19.0"].startswith("asserts") and eff["0.20.0"].startswith("not replicated")
    assert eff["0.34.0"].startswith("not replicated")
    mla = {"use_mla": True, "kv_heads": 1, "head_dim": 576, "attn_backend": "FLASHMLA", "num_blocks": 64}
    sc = synth({"tp_size": 4, **mla}, {"tp_size": 2, **mla}, vllm=["0.20.0", "0.21.0"])
    hz = by_id(sc)["H13"]
    assert hz.applies and hz.effects["0.20.0"].startswith("asserts") and hz.effects["0.21.0"].startswith("not")


def test_h08_replicated_091_bug() -> None:
    """vllm#19691: P TP >= heads, non-MLA: 0.9.1 expects a scaled block, 0.9.2 knows replication."""
    sc = synth({"tp_size": 2, "kv_heads": 2, "num_blocks": 64}, {"tp_size": 4, "kv_heads": 2, "num_blocks": 64})
    h = by_id(sc)["H08"]
    assert h.applies and set(h.effects) == {"0.9.1", "corrected"}
    assert h.effects["corrected"].startswith("accepts")


def test_nothing_applies_to_a_clean_pair() -> None:
    sc = synth({"tp_size": 2, "num_blocks": 4096}, {"tp_size": 2, "num_blocks": 4096})
    assert [h.id for h in evaluate(sc, models(sc)) if h.applies] == []


def test_corrected_in_releases_is_not_doubled() -> None:
    sc = bundled("seed-19338-tp8")
    with_c = evaluate(sc, [resolve("0.9.1"), CORRECTED])
    without = evaluate(sc, [resolve("0.9.1")])
    assert with_c == without
    assert set(next(h for h in with_c if h.id == "H01").effects) == {"0.9.1", "corrected"}


# ---- the facts-based num_blocks path agrees with the engine ---------------------------------------------
class _IO:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc

    def fetch(self, fmt: Any, p_rank: int, timeout_ms: int | None) -> list[bytes]:
        p, g = self.sc.prefill, self.sc.prefill.geometry()
        return encode_reply(fmt, dict(engine_id=p.engine_id, agent_metadata=b"a", kv_caches_base_addr=[0] * g.num_regions,
                                      num_blocks=p.blocks()[p_rank], tp_size=p.tp_size, block_len=g.block_len,
                                      attn_backend_name=g.attn_backend))

    def add_remote_agent(self, blob: bytes) -> str:
        return "agent"

    def prep_remote(self, prepared: Any, mem_type: str) -> None:
        return None


@pytest.mark.parametrize("name", ["seed-19338-tp8", "hetero-d4-p2", "mla", "decode-fewer-blocks"])
@pytest.mark.parametrize("release", ["0.9.1", "0.9.2"])
def test_block_path_matches_engine(name: str, release: str) -> None:
    sc, rel = bundled(name), resolve(release)
    f = Facts.of(sc)
    d = sc.decode
    for r in range(d.tp_size):
        loc = Local(d.engine_id, r, d.tp_size, d.blocks()[r], d.geometry(), d.kv_cache_layout, r)
        out = run(rel, loc, Params(sc.prefill.engine_id, sc.params_tp_size(), rel.wire), _IO(sc))
        stripped = run(rel, loc, Params(sc.prefill.engine_id, sc.params_tp_size(), rel.wire), _IO(sc),
                       bypass_asserts=True)
        bp = block_path(rel, f, r)
        assert bp is not None
        assert (out.check, out.remote_rank if out.check else None) == (bp.stop, bp.stop_p)
        assert (stripped.status == "silent") == bp.stripped_silent
        assert stripped.stride == bp.recorded
