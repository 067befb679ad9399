"""FlashAttention's KV layout per release (geometry.kv_regions), the region names/layers on the wire, and the
checks 0.30 - 0.34 make on them. Pure tests, plus live runs of fake ranks and `pdcheck serve` per layout."""

from __future__ import annotations

import json

import pytest
from releasekit import assert_msg, assert_raise, mem_io, run_rank, side
from test_live import pdcheck, serve

from pdcheck.geometry import Geometry
from pdcheck.vllm.releases import for_release, resolve
from pdcheck.vllm.releases.v0_29 import MSG_REGION_NAMES
from pdcheck.vllm.wire import FORMATS
from pdcheck.vllm.wire.formats import build_metadata

G = Geometry(tp_size=2, block_size=16, layers=2, total_kv_heads=8, head_dim=128, dtype="bfloat16",
             attn_backend="FLASH_ATTN", use_mla=False)
PER = 16 * 4 * 128 * 2  # block_size x heads per rank x head_dim x bf16
L0, L1 = Geometry.layer_name(0), Geometry.layer_name(1)


@pytest.mark.parametrize(("release", "kv", "regions", "block_len", "halves"), [
    ("0.20.0", "split", 4, PER, 1),  # cache [2, num_blocks, ...]: K and V regions per layer
    ("0.22.1", "split", 4, PER, 1),
    ("0.23.0", "blocks_first", 2, 2 * PER, 2),  # [num_blocks, 2, ...]: one region, K and V halves
    ("0.25.1", "blocks_first", 2, 2 * PER, 2),
    ("0.26.0", "packed", 2, 2 * PER, 1),  # [num_blocks, heads, block_size, 2 * head_dim]
    ("0.34.0", "packed", 2, 2 * PER, 1),
])
def test_flash_attention_layout_per_release(release: str, kv: str, regions: int, block_len: int, halves: int) -> None:
    g = for_release(resolve(release), G)
    assert (g.kv_regions, g.num_regions, g.block_len, g.kv_halves) == (kv, regions, block_len, halves)
    assert g.num_regions * g.block_len == 4 * PER  # the same bytes per block and rank, cut differently
    assert g.region_layers() == ([L0, L0, L1, L1] if kv == "split" else [L0, L1])
    assert g.head_cell_bytes == 128 * 2 * (2 if kv == "packed" else 1)


def test_mla_and_flashinfer_keep_their_layout() -> None:
    mla = Geometry(tp_size=2, block_size=16, layers=2, total_kv_heads=1, head_dim=576, dtype="bfloat16",
                   attn_backend="FLASHMLA", use_mla=True)
    fi = Geometry(tp_size=2, block_size=16, layers=2, total_kv_heads=8, head_dim=128, dtype="bfloat16",
                  attn_backend="FLASHINFER", use_mla=False)
    for rel in ("0.20.0", "0.23.0", "0.34.0"):
        m, f = for_release(resolve(rel), mla), for_release(resolve(rel), fi)
        assert (m.num_regions, m.block_len, m.kv_halves) == (2, 16 * 576 * 2, 1)
        assert (f.num_regions, f.block_len, f.kv_halves) == (2, 2 * PER, 1)


def test_wire_carries_kv_cache_layout_names_from_029() -> None:
    values = {"engine_id": "P", "agent_metadata": b"", "kv_caches_base_addr": [1], "num_blocks": 4, "device_id": 0,
              "block_lens": [PER], "block_strides": [PER], "kv_cache_layout": "HND", "block_size": 16,
              "ssm_sizes": (0, 0), "attn_backend_name": "FLASH_ATTN", "physical_blocks_per_logical_kv_block": 1,
              "region_names": [L0], "region_members": [[L0]]}
    assert build_metadata(FORMATS["H"], values).kv_cache_layout == "HND"  # 0.26 - 0.28: get_kv_cache_layout()
    h34 = build_metadata(FORMATS["H34"], {**values, "kv_cache_layout": "NHD"})
    assert (h34.kv_cache_layout, h34.region_names, h34.region_members) == ("LBNHC", [L0], [[L0]])


# ---- 0.30 - 0.33: `assert nixl_agent_meta.region_names == <the local names>` when P sends names

@pytest.mark.parametrize(("release", "expr"), [
    ("0.30.0", "nixl_agent_meta.region_names == self.region_names"),
    ("0.31.0", "nixl_agent_meta.region_names == expected_names"),
    ("0.33.0", "nixl_agent_meta.region_names == expected_names"),
])
def test_region_names_must_match_030_to_033(release: str, expr: str) -> None:
    rel = resolve(release)
    p, d = side("P", 2, 3000, layers=2), side("D", 2, 3000, layers=2)
    other = ["model.layers.0.self_attn.k", "model.layers.0.self_attn.v", L1, L1]
    o = run_rank(rel, p, d, 0, io=mem_io(rel, p, override={0: {"region_names": other}}), enforce=False)
    assert_msg(o, "region_names", expr, MSG_REGION_NAMES, hazard="H08")
    # no names advertised (an older P): the release skips the check
    o = run_rank(rel, p, d, 0, io=mem_io(rel, p, override={0: {"region_names": None}}), enforce=False)
    assert o.status == "ok"
    # the 0.29 model has no such check
    o = run_rank(resolve("0.29.0"), p, d, 0, io=mem_io(resolve("0.29.0"), p, override={0: {"region_names": other}}),
                 enforce=False)
    assert o.status == "ok"


# ---- 0.34: _pair_regions through region_members, before the NIXL add

V034 = resolve("0.34.0")


def test_034_needs_the_layers_of_every_region() -> None:
    p, d = side("P", 2, 3000), side("D", 2, 3000)
    io = mem_io(V034, p, override={0: {"region_members": []}})
    o = run_rank(V034, p, d, 0, io=io, enforce=False)
    assert_raise(o, "region_members", "Engine P did not advertise the layers of its KV regions.")
    assert io.added == []  # raised before the NIXL add


def test_034_region_metadata_lengths_include_names() -> None:
    p, d = side("P", 2, 3000), side("D", 2, 3000)
    o = run_rank(V034, p, d, 0, io=mem_io(V034, p, override={0: {"region_names": [L0]}}), enforce=False)
    assert_raise(o, "region_metadata_lengths", "Engine P advertised KV region metadata of different lengths.")


def test_034_layer_spans_other_region_count() -> None:
    """P registers a layer as one region (0.26+ FlashAttention), D as K and V regions (a 0.22 layout)."""
    p, d = side("P", 2, 3000), side("D", 2, 3000)
    one = {"kv_caches_base_addr": [1 << 32], "block_lens": [2 * PER], "block_strides": [2 * PER],
           "region_names": [L0], "region_members": [[L0]]}
    o = run_rank(V034, p, d, 0, io=mem_io(V034, p, override={0: one}), enforce=False)
    assert_raise(o, "layer_spans", f"KV layer {L0!r} spans 1 NIXL regions on engine P and 2 here.",
                 exc="NotImplementedError")


# ---- live: fake ranks and serve register the release's layout and READ by it

@pytest.mark.parametrize("release", ["0.23.0", "0.34.0"])
def test_hetero_tp_transfer_follows_the_release_layout(release: str) -> None:
    """D TP 4 reads head slices from P TP 2: K and V halves (0.23) or one packed run per head slice (0.34)."""
    r = pdcheck("handshake", "scenarios/hetero-d4-p2.toml", "--vllm", release, "--transfer", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    for rank in doc["decode_ranks"]:
        for name, t in rank["transfer"].items():
            assert (name, t["status"], t["wrong"]) == (name, "ok", 0)
            assert t["blocks"] == 64  # 32 blocks x 2 requests x 1 region per layer (1 layer)


@pytest.mark.parametrize(("release", "regions", "block_len"), [("0.22.0", 2, PER), ("0.26.0", 1, 2 * PER)])
def test_serve_registers_the_release_layout(release: str, regions: int, block_len: int) -> None:
    with serve("--prefill-tp", "2", "--prefill-blocks", "64", "--kv-heads", "8", "--vllm", release) as s:
        r = pdcheck("probe", f"127.0.0.1:{s.doc['base_port']}", "--vllm", release, "--tp-size", "2", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [(x["regions"], x["block_len"]) for x in s.doc["prefill_ranks"]] == [(regions, block_len)] * 2
    assert [r["block_lens"] for r in rep["prefill_ranks"]] == [[block_len] * regions] * 2
