"""Hybrid models (issue #17): KV-cache groups (full attention, sliding window, Mamba/SSM state).

Pure-model tests of the geometry, the per-release facts (releases.hybrid), the compatibility hash and the wire;
the one block check over a group's regions, naming the group and layer of a wrong block; bad input (exit 2, one
line); and real-process runs (ranks, side channels, NIXL READs) whose transfer proof reads each group as the
release does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdcheck.errors import BadInput
from pdcheck.geometry import Geometry, KVGroup
from pdcheck.kvcache import KVCache, check_blocks, desc_ids
from pdcheck.vllm.hazards import evaluate
from pdcheck.vllm.releases import CORRECTED, MODELLED, compat_hash_for, resolve, shapes
from pdcheck.vllm.releases import hybrid as h
from pdcheck.vllm.scenario import load
from pdcheck.vllm.wire import FORMATS, AnyMeta
from pdcheck.vllm.wire.formats import build_metadata

SW = (KVGroup(kind="full", layers=2), KVGroup(kind="sliding_window", layers=4, window=64))
MAMBA = (KVGroup(kind="full", layers=1), KVGroup(kind="mamba", layers=3))
SIDE = {"tp_size": 2, "num_blocks": 256, "kv_heads": 4, "head_dim": 64}
SW_DOC = [{"kind": "full", "layers": 2}, {"kind": "sliding_window", "layers": 4, "window": 64}]
MAMBA_DOC = [{"kind": "full", "layers": 1}, {"kind": "mamba", "layers": 3}]


def _g(groups: tuple[KVGroup, ...] = SW, **kw: Any) -> Geometry:
    layers = sum(gr.layers for gr in groups) or 1
    base: dict[str, Any] = dict(tp_size=2, block_size=16, layers=layers, total_kv_heads=4, head_dim=64,
                                dtype="bfloat16", attn_backend="FLASH_ATTN", use_mla=False, groups=groups)
    return Geometry(**{**base, **kw})


def _sc(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, **top: Any):
    doc: dict[str, Any] = {"prefill": {"engine_id": "P", **SIDE, **(prefill or {})},
                           "decode": {"engine_id": "D", **SIDE, **(decode or {})}, **top}
    doc.setdefault("vllm", ["0.26.0"])
    return load(None, doc)


# ---- geometry: groups lay out contiguous runs of regions ---------------------------------------------------
def test_group_regions_ids_and_names() -> None:
    g = _g()
    assert g.num_regions == 12 and g.group_regions() == [(0, 4), (4, 12)]
    assert g.region_group_ids() == [0] * 4 + [1] * 8
    assert g.region_name(5) == "group 1 (sliding window 64) layer 2 V"
    assert g.region_layers()[5] == "model.layers.2.self_attn.attn"
    m = _g(MAMBA)
    assert m.num_regions == 5 and m.group_regions() == [(0, 2), (2, 5)]
    assert m.region_name(4) == "group 1 (Mamba/SSM state) layer 3 (conv|ssm state)"
    assert m.region_layers()[1:3] == ["model.layers.0.self_attn.attn", "model.layers.1.mixer"]
    conv, ssm = m.ssm_sizes
    assert conv + ssm == m.block_len and conv % 16 == 0 and conv > 0
    assert _g(SW).ssm_sizes == (0, 0)
    assert _g(()).group_regions() == [(0, 2)] and _g(()).region_group_ids() == [0, 0]


# ---- per-release facts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", [*MODELLED, CORRECTED], ids=lambda r: r.name)
def test_startup_refusal_grid(rel) -> None:
    v = tuple(int(x) for x in (rel.version or rel.versions[0]).split(".")[:3]) if rel is not CORRECTED else (99,)
    mamba, ds = _g(MAMBA), _g(MAMBA, ssm_conv_layout="DS")
    assert h.startup_refusal(rel, _g(SW)) is None  # sliding window: unified or clipped, never refused
    if v < (0, 9, 1):
        assert h.startup_refusal(rel, ds) == h.MSG_NO_V1_MAMBA  # 0.9.0's V1 has no Mamba KV cache at all
    elif v < (0, 22):
        assert h.startup_refusal(rel, ds) == h.MSG_UNIFY  # dynamo #10741: HMA off by default with any connector
        assert not h.hma_enabled(rel, ds)
    else:
        assert h.startup_refusal(rel, ds) is None and h.hma_enabled(rel, ds)
        off = _g(MAMBA, ssm_conv_layout="DS", hma=False)
        assert h.startup_refusal(rel, off) == (h.MSG_HMA_REQUIRED if (0, 27) <= v < (99,) else h.MSG_UNIFY)
        assert h.startup_refusal(rel, mamba) == (h.MSG_DS_LAYOUT if (0, 20) <= v < (99,) else None)
    # an explicit --no-disable-hybrid-kv-cache-manager: refused by 0.14 - 0.17's factory, ignored before 0.14,
    # honoured from 0.18 (NixlConnector is SupportsHMA), the conv layout asserted from 0.20
    on = h.startup_refusal(rel, _g(SW, hma=True))
    assert on == (h.MSG_NOT_HMA if (0, 14) <= v < (0, 18) else None)
    assert h.hma_enabled(rel, _g(SW, hma=True)) == (v >= (0, 18))
    if (0, 18) <= v < (0, 22):
        assert h.startup_refusal(rel, _g(MAMBA, hma=True, ssm_conv_layout="DS")) is None
        assert h.startup_refusal(rel, _g(MAMBA, hma=True)) == (h.MSG_DS_LAYOUT if v >= (0, 20) else None)


def test_group_reads_per_release() -> None:
    g = _g(SW)
    for name in ("0.9.2", "0.14.0"):  # HMA off: sliding window unified to full attention
        assert h.group_reads(resolve(name), g) == [h.GroupRead(0, 0, 12, None)]
    for rel in (resolve("0.26.0"), resolve("0.34.0"), CORRECTED):
        assert h.group_reads(rel, g) == [h.GroupRead(0, 0, 4, None), h.GroupRead(1, 4, 12, 5)]  # cdiv(64,16)+1
    assert h.group_reads(resolve("0.34.0"), _g(SW, hma=False)) == [h.GroupRead(0, 0, 12, None)]
    assert h.group_reads(resolve("0.34.0"), _g(MAMBA, ssm_conv_layout="DS"))[1] == h.GroupRead(1, 2, 5, 1)


def test_hma_block_size_assert_only_0_18_to_0_26() -> None:
    g = _g(SW, block_size=32)
    assert h.handshake_refusal(resolve("0.26.0"), g, 16) == h.MSG_HMA_BLOCK_SIZE
    assert h.handshake_refusal(resolve("0.27.0"), g, 16) is None  # the assert is gone from the 0.27.0 wheel on
    assert h.handshake_refusal(resolve("0.30.0"), g, 16) is None
    assert h.handshake_refusal(resolve("0.22.0"), g, 16) == h.MSG_HMA_BLOCK_SIZE
    assert h.handshake_refusal(resolve("0.34.0"), g, 16) is None  # remote-block granularity
    assert h.handshake_refusal(resolve("0.26.0"), _g((), block_size=32), 16) is None  # not hybrid: no HMA
    assert h.handshake_refusal(resolve("0.26.0"), _g(SW, block_size=32, hma=False), 16) is None
    assert h.handshake_refusal(resolve("0.14.0"), g, 16) is None
    # 0.18 - 0.21: only with the manager explicitly on (off by default with a connector)
    assert h.handshake_refusal(resolve("0.18.0"), g, 16) is None
    assert h.handshake_refusal(resolve("0.18.0"), _g(SW, block_size=32, hma=True), 16) == h.MSG_HMA_BLOCK_SIZE
    assert h.handshake_refusal(resolve("0.17.0"), _g(SW, block_size=32, hma=True), 16) is None


def test_is_hma_enabled_in_the_hash_per_deployment() -> None:
    for name, factor in (("0.14.0", False), ("0.18.0", True), ("0.26.0", True), ("0.34.0", True)):
        rel = resolve(name)
        assert ("is_hma_enabled" in rel.hash_factors) == factor
        on, off = compat_hash_for(rel, _g(SW, hma=True)), compat_hash_for(rel, _g(SW, hma=False))
        assert (on != off) == factor, name  # 0.14 has no factor (and refuses hma=True at start-up)
        # no flag: 0.18 - 0.21 turn the manager off for any connector, 0.22+ leave it on
        assert compat_hash_for(rel, _g(SW)) == (off if name in ("0.14.0", "0.18.0") else on), name
    line = h.effects(resolve("0.26.0"), _g(SW), _g(SW, hma=False))
    assert any("is_hma_enabled True (prefill) vs False (decode)" in x for x in line)


def test_wire_carries_ssm_sizes_and_region_group_ids() -> None:
    g = _g(MAMBA)
    n = g.num_regions
    values = AnyMeta(engine_id="P", agent_metadata=b"x", kv_caches_base_addr=[0] * n, num_blocks=8, device_id=0,
                     block_lens=[g.block_len] * n, block_strides=[g.block_len] * n, kv_cache_layout="HND",
                     block_size=16, attn_backend_name="FLASH_ATTN", physical_blocks_per_logical_kv_block=1,
                     ssm_sizes=g.ssm_sizes, region_group_ids=g.region_group_ids())
    meta = build_metadata(FORMATS["H34"], values)
    assert meta.ssm_sizes == g.ssm_sizes and meta.region_group_ids == [0, 0, 1, 1, 1]
    assert not hasattr(build_metadata(FORMATS["H"], values), "region_group_ids")  # 0.26: no region_group_ids


def test_startup_refusal_is_reported_at_start_up() -> None:
    assert shapes.when_raised(resolve("0.14.0"), "error", h.START_UP) == \
        "at start-up: the decode worker refuses before it serves"


def test_hazard_line_names_each_release() -> None:
    sc = _sc({"layers": 4, "kv_groups": MAMBA_DOC}, {"layers": 4, "kv_groups": MAMBA_DOC},
             vllm=["0.14.0", "0.26.0"])
    x10 = next(z for z in evaluate(sc, [resolve("0.14.0"), resolve("0.26.0")]) if z.id == "X10")
    assert h.MSG_UNIFY in x10.effects["0.14.0"]
    assert h.MSG_DS_LAYOUT in x10.effects["0.26.0"]
    assert "whole state page" in x10.effects["corrected"]


# ---- the one block check over one group's regions ----------------------------------------------------------
def test_check_blocks_over_a_group_names_group_layer_and_block() -> None:
    g = _g(SW)
    kv = KVCache(g, 32)
    blocks = np.arange(8, 16)
    for r in range(g.num_regions):
        kv.tag(7, 1, r, blocks)
    win = blocks[-5:]
    ok = check_blocks(kv, win, win, 7, 1, read_len=kv.block_len, region_span=(4, 12))
    assert (ok.checked, ok.wrong) == (8 * 5, 0)
    kv.arena.flip(kv.base_addrs[9] - kv.base_addrs[0] + 14 * kv.block_len + 40)  # region 9, block 14
    bad = check_blocks(kv, win, win, 7, 1, read_len=kv.block_len, region_span=(4, 12))
    assert bad.wrong == 1 and bad.wrong_regions == {9}
    assert (bad.first.region, bad.first.local_block) == (9, 14)
    assert g.region_name(9) == "group 1 (sliding window 64) layer 4 V"
    # the full-attention group's regions are not part of that check, and stay right
    assert check_blocks(kv, blocks, blocks, 7, 1, read_len=kv.block_len, region_span=(0, 4)).wrong == 0
    assert list(desc_ids(2, 32, [3], first=4)) == [4 * 32 + 3, 5 * 32 + 3]


# ---- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("prefill", "decode", "needle"), [
    ({"layers": 5, "kv_groups": SW_DOC}, {"layers": 6, "kv_groups": SW_DOC}, "must add up"),
    ({"layers": 6, "max_model_len": 32, "kv_groups": SW_DOC}, {"layers": 6, "kv_groups": SW_DOC},
     "larger than the context of 32 tokens"),
    ({"layers": 6, "num_blocks": 2, "kv_groups": SW_DOC}, {"layers": 6, "kv_groups": SW_DOC},
     "larger than the context of 32 tokens (num_blocks x block_size)"),
    ({"layers": 6, "kv_groups": [{"kind": "full", "layers": 2}, {"kind": "sliding_window", "layers": 4}]}, {},
     "needs its window"),
    ({"layers": 2, "kv_groups": [{"kind": "full", "layers": 2, "window": 8}]}, {}, "only a sliding_window"),
    ({"layers": 6, "kv_groups": SW_DOC}, {"layers": 6}, "differ: both sides serve one model"),
    ({"layers": 4, "kv_groups": MAMBA_DOC}, {"layers": 4, "tp_size": 4, "kv_groups": MAMBA_DOC}, "equal tp_size"),
    ({"layers": 4, "kv_groups": [{"kind": "ssm", "layers": 4}]}, {}, "prefill.kv_groups[0].kind"),
])
def test_bad_groups_one_line(prefill: dict[str, Any], decode: dict[str, Any], needle: str) -> None:
    with pytest.raises(BadInput) as exc:
        _sc(prefill, decode)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_bad_groups_exit_2_from_the_cli(pdcheck, tmp_path: Path) -> None:
    f = tmp_path / "g.toml"
    group = '[[{side}.kv_groups]]\nkind = "sliding_window"\nlayers = 2\nwindow = 9999\n'
    f.write_text("".join(f"[{s}]\nnum_blocks = 64\nlayers = 2\n{group.format(side=s)}" for s in ("prefill", "decode")))
    run = pdcheck("handshake", str(f))
    assert run.code == 2 and run.out == ""
    assert len(run.err.strip().splitlines()) == 1 and "larger than the context of 1024 tokens" in run.err


# ---- real ranks: the transfer proof reads each group as the release does -------------------------------------
@pytest.mark.parametrize(("release", "per_request", "corrected"), [
    # HMA off: 12 regions (split K, V) x 32 blocks; corrected (HMA on) the full group's 4 regions every block,
    # the sliding-window group's 8 its window's cdiv(64, 16) + 1 = 5 blocks
    ("0.14.0", 12 * 32, 4 * 32 + 8 * 5),
    # 0.26 packs K|V: one region per layer (corrected registers the release's layout in a one-release run)
    ("0.26.0", 2 * 32 + 4 * 5, 2 * 32 + 4 * 5),
])
def test_real_transfer_reads_each_group(pdcheck, release: str, per_request: int, corrected: int) -> None:
    run = pdcheck("handshake", "scenarios/hybrid-sliding-window.toml", "--vllm", release, "--json")
    assert run.code == 0, run.err
    doc = run.json()
    for d in doc["decode_ranks"]:
        for name in (release, "corrected"):
            t = d["transfer"][name]
            assert t["status"] == "ok" and t["wrong"] == 0
        assert d["transfer"][release]["blocks"] == 2 * per_request  # 2 requests
        assert d["transfer"]["corrected"]["blocks"] == 2 * corrected


def test_real_mamba_state_travels_whole_and_10741_refuses(pdcheck) -> None:
    run = pdcheck("handshake", "scenarios/hybrid-mamba-10741.toml", "--vllm", "0.14.0", "--json")
    assert run.code == 1, run.err
    for d in run.json()["decode_ranks"]:
        v = d["verdicts"]["0.14.0"]
        assert (v["status"], v["exception"]) == ("error", "ValueError") and "failed to convert" in v["message"]
        assert d["when"]["0.14.0"].startswith("at start-up")
        t = d["transfer"]["corrected"]
        # full group: 2 regions x 32 blocks; Mamba group: 3 regions x 1 whole state page; 2 requests
        assert t["status"] == "ok" and t["wrong"] == 0 and t["blocks"] == 2 * (2 * 32 + 3)


# ---- the pure engine: where each refusal stops a D rank ------------------------------------------------------
def test_engine_stops_where_the_release_does() -> None:
    from releasekit import run_all, side, statuses

    sw = {"layers": 6, "groups": SW, "kv_heads": 4, "head_dim": 64}
    p, d = side("P", 2, 64, block_size=16, **sw), side("D", 2, 64, block_size=32, **sw)
    outs = run_all(resolve("0.26.0"), p, d)
    assert statuses(outs) == ["assert", "assert"] and outs[0].message == h.MSG_HMA_BLOCK_SIZE
    assert outs[0].handshake == 1  # at the handshake (the first request), not at start-up
    mamba = {"layers": 4, "groups": MAMBA, "kv_heads": 4, "head_dim": 64}
    p, d = side("P", 2, 64, **mamba), side("D", 2, 64, **mamba)
    outs = run_all(resolve("0.14.0"), p, d)
    assert statuses(outs) == ["error", "error"] and outs[0].exception == "ValueError"
    assert outs[0].check == h.START_UP and outs[0].contacted == []  # nothing sent: the worker never started


def _request_blocks(release: str) -> list[int]:
    from pdcheck.vllm.plan import RunOptions, build

    sc = load(Path("scenarios/hybrid-sliding-window.toml"), {"vllm": [release]})
    return build(sc, None, RunOptions()).requests[0].remote_block_ids


@pytest.mark.parametrize(("release", "region", "position", "named"), [
    # 0.26 packs K|V: regions 2-5 are the sliding-window group's layers 2-5; its window is the last 5 blocks
    ("0.26.0", 3, -1, "group 1 (sliding window 64) layer 3 (K|V per head) (region 3)"),
    # 0.14 unifies the window group to full attention (split K, V: regions 4-11), so it reads the first block too
    ("0.14.0", 9, 0, "group 1 (sliding window 64) layer 4 V (region 9)"),
])
def test_real_wrong_block_is_named_by_group_layer_region_block(pdcheck, release: str, region: int, position: int,
                                                               named: str) -> None:
    block = _request_blocks(release)[position]
    run = pdcheck("handshake", "scenarios/hybrid-sliding-window.toml", "--vllm", release, "--json",
                  "--inject", f"corrupt:P0:{region}:{block}")
    assert run.code == 1, run.err
    d0 = run.json()["decode_ranks"][0]
    t = d0["transfer"][release]
    assert t["status"] == "wrong" and t["wrong"] == 1 and t["wrong_regions"] == [region]
    mm = t["first_mismatch"]
    assert (mm["region"], mm["remote_block"], mm["p_rank"]) == (region, block, 0)
    assert mm["expected"].startswith(f"P rank 0 {named} block {block}")
    assert d0["verdicts"][release]["status"] == "silent"


def test_real_block_outside_the_window_is_not_read(pdcheck) -> None:
    """0.26: the first block of a request is outside the 64-token window, so the window group never reads it."""
    block = _request_blocks("0.26.0")[0]
    run = pdcheck("handshake", "scenarios/hybrid-sliding-window.toml", "--vllm", "0.26.0", "--json",
                  "--inject", f"corrupt:P0:3:{block}", "--inject", f"corrupt:P0:1:{block}")
    assert run.code == 1, run.err
    t = run.json()["decode_ranks"][0]["transfer"]["0.26.0"]
    # region 1 (full attention, layer 1) reads it and finds the corruption; region 3 (the window group) does not
    assert t["wrong"] == 1 and t["wrong_regions"] == [1]
