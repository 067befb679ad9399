"""Regression tests for the release models re-read against the vLLM wheels 0.13 - 0.34 (issue 8, part 4).

Each test names the release behaviour it pins; the statement texts are the releases' own. The compatibility
hashes were computed by running each wheel's own compute_nixl_compatibility_hash and hash_factors (extracted
from the wheel, executed with a stand-in VllmConfig); the test also re-derives them from the factor lists.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from releasekit import assert_bare, assert_msg, assert_raise, run_all, run_rank, side, statuses

from pdcheck.geometry import Geometry
from pdcheck.vllm.releases import compat_hash_for, resolve

GEOMETRY = Geometry(tp_size=2, block_size=16, layers=2, total_kv_heads=8, head_dim=128, dtype="bfloat16",
                    attn_backend="FLASH_ATTN", use_mla=False)

# release -> sha256 hex computed by that wheel's own code for GEOMETRY, model "pdcheck/fake-model", cache "auto",
# FLASH_ATTN, no speculative config, pull mode, cross_layers_blocks False; disable_hybrid_kv_cache_manager as
# VllmConfig.__post_init__ leaves it on CUDA with NixlConnector (True up to 0.21, False from 0.22).
REAL_HASHES = {
    "0.13.0": "ca39b7e37d003685ced72ac8781e760c4d9ab814d33154ced9d3952af2e92616",
    "0.14.0": "f6e326659bdb3c34ed7ebd6283788c97280bf9d4c5f8cc40904a13c2371a48cc",
    "0.14.1": "44d21cdb1d980e21eb5fcb993f1c0da5990e6a74700fafe0688f427c1e029cfd",
    "0.15.1": "2456de1a8bca9c91d8978041d8d3acf21ce9d6c221089c1cdcbeb3e5d2369496",
    "0.16.0": "32eeb21a0662c2bd4a9069c77ac0419ceb181a804aec5a5374776995bf2d2629",
    "0.17.1": "7522eb606ea1a9e30ab8444f1ed6e41490e7da11eed342045d3453fca0184a89",
    "0.18.0": "07b50b561d877df8e31ed7984df5484708f3fc004cb78db0099d68c24c777479",
    "0.19.1": "8ee9141077eedf7a1cb53285ce39148d18652bafd2c35dfd4ae3f96b6fdb867f",
    "0.20.0": "f2a4334176957959c70c795575d0871ce44ff6b3f11f189b023abdec2cc56ad8",
    "0.20.2": "c98b9853d01a1f66d0b1ba9b32f2478b8de33b1f9cc3b279770bcf6384947a30",
    "0.21.0": "47a898a540163c569cb61a4db56c552b59f6b99b1dbc649949b214e72630654f",
    "0.22.0": "983886a8f84607812240fc91b01a7b88c29c97bab2f7335153435262f7fdb882",
    "0.23.0": "06c94900a91be28222e01de49c63550c2bd540ea78f2a1829e02f2c060e48aa8",
    "0.24.0": "8945e381e58f5ee120b9532074fbbcb0dfae04f50774a06d57fd1c763013d131",
    "0.25.1": "cd14cdd8f8421f9be2c3242f411c7a15975c79d222f8408e899076e4f6c4da35",
    "0.26.0": "6f2e8bbaa0a0b3327bda08adc84359d2cf3d8abf1182ebc0bc1f2ad92c89da38",
    "0.27.1": "569c1cb6b1b802729025307b1bec90b54e9efb2bd99fc28934346a698a765691",
    "0.28.0": "e6d72be2d3772e48e23e6bf1bc76d0e5adf49b1811f5655897ce31a3610a0b9a",
    "0.29.0": "fe9ad9a16ab64a6e04bd1d35f77e28cdeb16baadb1a78b22a2b574f1a37f6985",
    "0.30.0": "d26af076712ebf20b61f1fcfe7b380ce7ba7f10e497c10ca437a412cf30fde96",
    "0.31.0": "169e3ac1e6a2064b159f380a78195fe6b13b49b238eb7d88220a3b8eb22c3746",
    "0.32.0": "b2fe414f1d2df38694df971ef76217ab3f20ed634f0df25e7da43fdc9da5838d",
    "0.33.0": "f4b74c8abbbc1329ab004588ca7bb27f2f77eacc381ee48adbeac6d0a7b578d1",
    "0.34.0": "27948c22cff7115e71fb68e72e762c0f18e25a8500660e79bc67973e0704faaf",
}

# NIXL_CONNECTOR_VERSION per minor line, as the wheels define it
CONNECTOR_VERSION = {13: 2, 14: 2, 15: 2, 16: 2, 17: 2, 18: 2, 19: 2, 20: 2, 21: 3, 22: 4, 23: 4, 24: 4, 25: 4,
                     26: 5, 27: 5, 28: 7, 29: 9, 30: 11, 31: 13, 32: 14, 33: 15, 34: 16}


def _source_factors(release: str) -> dict[str, object]:
    """The factor dict the sources build, written out here independently of pdcheck.vllm.wire.compat."""
    minor = int(release.split(".")[1])
    f: dict[str, object] = {
        "vllm_version": release, "nixl_connector_version": CONNECTOR_VERSION[minor], "model": "pdcheck/fake-model",
        "dtype": "torch.bfloat16", "num_kv_heads": 8, "head_size": 128, "num_hidden_layers": 2,
        "attn_backend_name": "FLASH_ATTN", "cache_dtype": "auto",
    }
    if 16 <= minor <= 28:
        f["cross_layers_blocks"] = False
    if minor >= 18:
        f["is_hma_enabled"] = minor >= 22
    if minor >= 28:
        f["speculative_config"] = None
        f["transfer_mode"] = "pull"
    return f


@pytest.mark.parametrize("release", sorted(REAL_HASHES))
def test_compat_hash_is_what_the_wheel_computes(release: str) -> None:
    want = hashlib.sha256(json.dumps(_source_factors(release), sort_keys=True).encode()).hexdigest()
    assert want == REAL_HASHES[release]
    assert compat_hash_for(resolve(release), GEOMETRY) == REAL_HASHES[release]


@pytest.mark.parametrize(("release", "hma"), [
    ("0.18.0", False), ("0.19.1", False), ("0.20.0", False), ("0.21.0", False),  # any connector turns HMA off
    ("0.22.0", True), ("0.23.0", True), ("0.24.0", True), ("0.28.0", True), ("0.34.0", True),  # SupportsHMA
])
def test_is_hma_enabled_of_a_gpu_deployment(release: str, hma: bool) -> None:
    assert resolve(release).is_hma_enabled is hma
    assert "is_hma_enabled" in resolve(release).hash_factors


def test_connector_versions() -> None:
    for minor, cv in CONNECTOR_VERSION.items():
        assert resolve(f"0.{minor}.0").connector_version == cv, minor


@pytest.mark.parametrize(("release", "wire"), [
    ("0.17.1", "G"), ("0.18.0", "G18"), ("0.19.1", "G18"), ("0.20.2", "G20"), ("0.21.0", "G24"), ("0.23.0", "G24"),
    ("0.28.0", "H"), ("0.29.0", "H29"), ("0.30.0", "H31"), ("0.33.0", "H31"), ("0.34.0", "H34"),
])
def test_wire_schema_per_release(release: str, wire: str) -> None:
    """ssm_sizes from 0.18, physical_blocks_per_logical_kv_block from 0.21, block_strides from 0.29."""
    assert resolve(release).wire == wire


# ---- `assert not (tp_ratio < 0 and ...is_kv_replicated(remote_engine_id))` ---------------------------------------
EXPR_14 = "not (tp_ratio < 0 and self.kv_topo.is_kv_replicated(remote_engine_id))"
EXPR_20 = "not (tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id))"


@pytest.mark.parametrize(("release", "expr"), [
    ("0.14.0", EXPR_14), ("0.19.0", EXPR_14), ("0.20.0", EXPR_20), ("0.24.0", EXPR_20), ("0.26.0", EXPR_20),
    ("0.29.0", EXPR_20), ("0.31.0", EXPR_20), ("0.33.0", EXPR_20), ("0.34.0", EXPR_20),
])
def test_p_greater_with_replicated_kv_asserts(release: str, expr: str) -> None:
    """2 KV heads, P TP 4 -> D TP 2: every release asserts (0.34 included), with its own statement text."""
    rel = resolve(release)
    outs = run_all(rel, side("P", 4, 3000, kv_heads=2), side("D", 2, 3000, kv_heads=2))
    for o in outs:
        assert_bare(o, "p_gt_d_replicated", expr, hazard="H13")
        assert o.contacted == [o.remote_rank]  # the first P rank it handshakes


MLA1 = {"mla": True, "kv_heads": 1, "head_dim": 576, "backend": "FLASHMLA"}


@pytest.mark.parametrize(("release", "fires"), [
    ("0.14.0", True), ("0.19.0", True), ("0.20.0", True), ("0.21.0", False), ("0.29.0", False), ("0.34.0", False),
])
def test_mla_p_greater_than_d(release: str, fires: bool) -> None:
    """0.14 - 0.20 make the assert for MLA too (a one-KV-head MLA model is replicated at P TP 4); 0.21+ skip MLA."""
    rel = resolve(release)
    o = run_rank(rel, side("P", 4, 3000, **MLA1), side("D", 2, 3000, **MLA1), 0)
    if fires:
        assert_bare(o, "p_gt_d_replicated", EXPR_14 if rel.name < "0.20" else EXPR_20)
    else:
        assert (o.status, o.contacted, [x.p_rank for x in o.prepared]) == ("ok", [0, 1], [0])


# ---- head-split RuntimeError ------------------------------------------------------------------------------------
HND_MSG = ("Heterogeneous TP head-dimension splitting requires contiguous heads. Use HND layout on the prefill "
           "side.")
ENUM_MSG = ("Heterogeneous TP head-dimension splitting requires contiguous heads. Use a block-contiguous layout "
            "(e.g. LBHNC) on the prefill side.")


@pytest.mark.parametrize(("release", "msg"), [
    ("0.14.0", None), ("0.19.1", None), ("0.20.0", HND_MSG), ("0.24.0", HND_MSG), ("0.28.0", HND_MSG),
    ("0.29.0", ENUM_MSG), ("0.31.0", ENUM_MSG), ("0.34.0", ENUM_MSG),
])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 4), (4, 2)])
def test_head_split_needs_a_block_contiguous_local_layout(release: str, msg: str | None, p_tp: int,
                                                          d_tp: int) -> None:
    """|tp_ratio| != 1, not MLA, KV not replicated, NHD on both sides: raised from 0.20, both TP directions."""
    rel = resolve(release)
    outs = run_all(rel, side("P", p_tp, 3000, layout="NHD"), side("D", d_tp, 3000, layout="NHD"))
    if msg is None:
        assert statuses(outs) == ["ok"] * d_tp  # 0.14 - 0.19 have no such check
        return
    for o in outs:
        assert_raise(o, "head_split_contiguous", msg)


@pytest.mark.parametrize("release", ["0.20.0", "0.29.0", "0.34.0"])
def test_head_split_not_raised(release: str) -> None:
    rel = resolve(release)
    # homogeneous TP
    assert statuses(run_all(rel, side("P", 2, 3000, layout="NHD"), side("D", 2, 3000, layout="NHD"))) == ["ok"] * 2
    # replicated KV (P TP 4 > 2 heads, D TP 8): nothing is split on heads
    outs = run_all(rel, side("P", 4, 3000, kv_heads=2, layout="NHD"), side("D", 8, 3000, kv_heads=2, layout="NHD"))
    assert "head_split_contiguous" not in {o.check for o in outs}
    # MLA
    outs = run_all(rel, side("P", 2, 3000, **MLA1, layout="NHD"), side("D", 4, 3000, **MLA1, layout="NHD"))
    assert statuses(outs) == ["ok"] * 4


@pytest.mark.parametrize(("layout", "ok"), [("LBHNC", True), ("BLHNC", True), ("LBNHC", False), ("LHBNC", False),
                                            ("BLNHC", False), ("BHLNC", False)])
def test_head_split_enum_layouts_from_029(layout: str, ok: bool) -> None:
    """0.29+ ask KVCacheLayout[local].is_block_contiguous: [H, N, C] innermost."""
    for release in ("0.29.0", "0.34.0"):
        rel = resolve(release)
        outs = run_all(rel, side("P", 2, 3000, layout=layout), side("D", 4, 3000, layout=layout))
        if ok:
            assert statuses(outs) == ["ok"] * 4
        else:
            for o in outs:
                assert_raise(o, "head_split_contiguous", ENUM_MSG)


# ---- layout messages ----------------------------------------------------------------------------------------------
OLD_LAYOUT = ("Heterogeneous TP expects same kv_cache_layout. Or enable experimental feature to use HND to NHD "
              "support by setting 'enable_permute_local_kv'=True in --kv-transfer-config.")


@pytest.mark.parametrize(("release", "msg"), [
    ("0.29.0", OLD_LAYOUT), ("0.31.0", OLD_LAYOUT),
    ("0.32.0", "Heterogeneous TP expects same kv_cache_layout (local LBHNC, remote LBNHC). Or enable experimental "
               "feature to receive LBHNC into a local LBNHC cache by setting 'enable_permute_local_kv'=True in "
               "--kv-transfer-config."),
])
def test_layout_message(release: str, msg: str) -> None:
    o = run_rank(resolve(release), side("P", 2, 3000, layout="LBNHC"), side("D", 2, 3000, layout="LBHNC"), 0)
    assert_raise(o, "kv_cache_layout", msg)


# ---- per-region block lengths (0.24+) ---------------------------------------------------------------------------
def test_per_region_checks_start_in_024() -> None:
    """P TP 4, D TP 2, P's head_dim half D's: 0.20 - 0.23 check block_lens[0] // -tp_ratio, 0.24+ per region."""
    p, d = side("P", 4, 3000, head_dim=64), side("D", 2, 3000)
    o = run_rank(resolve("0.23.0"), p, d, 0, enforce=False)
    assert (o.check, o.assert_expr) == ("block_len_p_gt_d",
                                        "remote_block_len == self.block_len_per_layer[0] // (-tp_ratio)")
    o = run_rank(resolve("0.24.0"), p, d, 0, enforce=False)
    assert_msg(o, "block_len_p_gt_d", "remote_len == local_len * remote_heads // local_heads",
               f"SPLIT region 0: remote P KV block_len {p.geometry.block_len} must equal local {d.geometry.block_len} "
               "* remote_heads 2 // local_heads 4.")


def test_p_greater_block_size_before_block_len() -> None:
    """0.24+: in the P TP > D TP branch the block-size assert comes first, region by region."""
    o = run_rank(resolve("0.34.0"), side("P", 4, 6000, block_size=8, head_dim=64), side("D", 2, 3000), 0,
                 enforce=False)
    assert_msg(o, "p_gt_d_block_size", "block_size_ratio == 1",
               "Different local/remote block sizes are not supported when P TP > D TP.")
