"""TensorRT-LLM's pure models: era resolution and dating, the layout arithmetic against docs/trtllm-protocol.md's
worked example (T53), the checks' exact texts (T64, T67, T68), the pure engine over every era and fault, the
transfer proof on in-process pools (a correct transfer, a wrong one, one in another dtype), and doctor's rules."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pdcheck.errors import BadInput
from pdcheck.trtllm import checks, engine, eras
from pdcheck.trtllm.doctor import checks as doctor_checks
from pdcheck.trtllm.layout import Side, View, fragments, mapper, merge, peer_ranks, should_write, view_of
from pdcheck.trtllm.pool import Pool, prove, reads_as
from pdcheck.trtllm.scenario import load


# ------------------------------------------------------------------------------------------------- eras
@pytest.mark.parametrize(("typed", "line"), [("0.20.0", "E1"), ("0.21", "E1"), ("1.0.0rc4", "E2"), ("1.1.0", "E2"),
                                            ("1.2.1", "E3"), ("1.3.0rc27", "E4"), ("1.4.0rc4", "E5"), ("w1b", "W1b"),
                                            ("E5", "E5"), ("W3", "W3")])
def test_a_release_resolves_to_its_era_and_says_it_is_dated(typed, line):
    r = eras.resolve(typed)
    assert r.line.name == line
    if typed[0].isdigit():
        assert r.attribution.startswith(f"{typed} -> {line}: attributed from dates") and "not from a wheel" in \
            r.attribution
    else:
        assert r.attribution == ""


@pytest.mark.parametrize("typed", ["0.19.0", "2.0.0", "E9", "W4", "", "corrected"])
def test_what_is_not_modelled_is_bad_input(typed):
    with pytest.raises(BadInput, match="--trtllm"):
        eras.resolve(typed)


def test_all_names_every_era_once_and_e5_runs_as_w3():
    names = [r.line.name for r in eras.resolve_many("all")]
    assert names == ["E1", "E2", "E3", "E4", "W1a", "W1b", "W2a", "W2b", "E5"]
    assert eras.line("E5").wire == "W3" and eras.line("E5").gate
    assert [r.line.name for r in eras.resolve_many("1.2.1,E3,1.2.0")] == ["E3"]  # one era, once


def test_timeouts_per_era_come_from_trtllm_12249():
    assert [eras.line(n).transfer_timeout_ms for n in ("E1", "E2", "E3")] == [None, None, None]
    assert eras.line("E4").transfer_timeout_ms == 60000 and eras.line("W3").transfer_timeout_ms == 60000
    assert "2026-03-18" in eras.line("E4").timeout_source


# ----------------------------------------------------------------------------------------------- layout
def _views(ctx: Side, gen: Side, c_rank: int, g_rank: int, bc: int = 0, bg: int = 0) -> tuple[View, View]:
    return view_of(ctx, c_rank, bc), view_of(gen, g_rank, bg)


def test_t53_head_mismatch_descriptor_addresses():
    """8 KV heads, head_dim 64, fp16, 16 tokens per block, 4 layers; ctx TP2, gen TP4: gen rank 3 reads ctx rank
    1; ctx block 5 -> gen block 9, layer 2, V: source Bc + 0x5b000, destination Bg + 0x4d000, 4096 bytes."""
    ctx, gen = Side(tp_size=2), Side(tp_size=4)
    assert peer_ranks(view_of(gen, 3, 0), ctx.pp_layers(), ctx.tp_size) == [1]
    c, g = _views(ctx, gen, 1, 3, bc=1 << 40, bg=1 << 41)
    assert mapper(c, g) == "head_mismatch"
    frags = fragments(c, g, [5], [9])
    assert len(frags) == 4 * 2  # one descriptor per (layer, K/V)
    assert (frags[2 * 2 + 1][0] - (1 << 40), frags[2 * 2 + 1][1] - (1 << 41), frags[5][2]) == (0x5b000, 0x4d000, 4096)


def test_t53_pp_variant_and_duplicate_heads():
    ctx, gen = Side(pp_size=2), Side()
    assert peer_ranks(view_of(gen, 0, 0), ctx.pp_layers(), ctx.tp_size) == [0, 1]
    c, g = _views(ctx, gen, 1, 0)
    assert mapper(c, g) == "head_match"
    assert fragments(c, g, [0], [0]) == [(0, 65536, 65536)]  # ctx pp1's layers 2-3 at offset 65536 of 131072
    dctx, dgen = Side(tp_size=4, kv_heads=2), Side(tp_size=2, kv_heads=2)
    assert peer_ranks(view_of(dgen, 1, 0), dctx.pp_layers(), 4) == [2, 3]
    writers = [r for r in range(4) if should_write(view_of(dctx, r, 0), view_of(dgen, r // 2, 0))]
    assert writers == [0, 2]


@pytest.mark.parametrize(("ct", "gt"), [(1, 1), (2, 4), (4, 2), (1, 8), (8, 1), (2, 2)])
def test_every_head_is_read_from_exactly_one_ctx_rank(ct, gt):
    """The peer set and the mappers together cover each gen rank's heads exactly once (8 heads)."""
    ctx, gen = Side(tp_size=ct), Side(tp_size=gt)
    for g in range(gt):
        covered: list[int] = []
        for c in peer_ranks(view_of(gen, g, 0), ctx.pp_layers(), ct):
            cv, gv = _views(ctx, gen, c, g)
            if should_write(cv, gv):
                per_head = gen.tokens_per_block * gen.row_bytes
                for _s, d, n in fragments(cv, gv, [0], [0]):  # the bytes of layer 0's K in gen block 0
                    lo, hi = d, min(d + n, gen.slab_bytes)
                    covered += [gen.heads_of(g)[h] for h in range(lo // per_head, -(-hi // per_head))
                                if lo < hi]
        assert sorted(covered) == gen.heads_of(g), (ct, gt, g, covered)


def test_merge_joins_only_adjacent_fragments():
    assert merge([(0, 100, 10), (10, 110, 5), (20, 115, 5)]) == [(0, 100, 15), (20, 115, 5)]


# ----------------------------------------------------------------------------------------------- checks
def test_registrar_and_attention_texts():
    ctx, gen = view_of(Side(), 0, 0), view_of(Side(tokens_per_block=32), 0, 0)
    w1 = checks.on_register(eras.line("W1b"), ctx, gen, "gen-x", 3)
    assert w1.refused and w1.logs == ("PeerRegistrar: tokens_per_block mismatch (local=16, peer=32).",
                                      "PeerRegistrar.register: peer gen-x (rank=3) is incompatible with local rank.")
    w3 = checks.on_register(eras.line("W3"), ctx, gen, "gen-x", 3)
    assert w3.logs[0] == ("AttentionPolicy: incompatible: tokens_per_block mismatch; field='tokens_per_block', "
                          "local=16, peer=32")
    layers = view_of(Side(layers=6), 0, 0)
    assert checks.on_register(eras.line("W1b"), ctx, layers, "g", 0).field == "layers"
    newest = checks.on_register(eras.line("W3"), ctx, layers, "g", 0)  # only warns, partial transfer (T68)
    assert not newest.refused and "allowing partial layer transfer" in newest.logs[0]


def test_dtype_is_compared_by_inquire_and_corrected_only():
    bf16, fp16 = Side(dtype="bfloat16"), Side(dtype="float16")
    for name in ("W1a", "W1b", "W2a", "W2b", "W3"):
        assert not checks.on_register(eras.line(name), view_of(bf16, 0, 0), view_of(fp16, 0, 0), "g", 0).refused
    assert checks.inquire(checks.cache_state(fp16), checks.cache_state(bf16)) == (
        "CacheFormatter::inquireSupport: selfConfig.getDataType() != destConfig.getDataType()")
    assert checks.corrected_gate(view_of(bf16, 0, 0), view_of(fp16, 0, 0), "bfloat16", "float16") == \
        "kv dtype differs (ctx bfloat16, gen float16)"


# ----------------------------------------------------------------------------------------------- engine
CASES = {  # (scenario tables, fault) -> era -> predicted status, corrected last
    "tpb": ({"gen": {"tokens_per_block": 32}}, "none",
            {"W1a": "hang", "W1b": "hang", "W2b": "hang", "W3": "hang", "E3": "error", "corrected": "error"}),
    "dtype": ({"ctx": {"dtype": "bfloat16"}}, "none",
              {"W1b": "silent", "W3": "silent", "E3": "error", "corrected": "error"}),
    "info": ({}, "info_silent", {"W1a": "hang", "W3": "hang", "corrected": "error"}),
    "dies": ({}, "ctx_dies", {"W1b": "hang", "W3": "hang", "E3": "hang", "corrected": "error"}),
    "lost": ({}, "completion_lost", {"W2b": "hang", "W3": "hang", "E4": "hang", "corrected": "ok"}),
    "unknown": ({}, "unknown_type", {"W1a": "hang", "W1b": "hang", "W2b": "ok", "W3": "ok", "corrected": "ok"}),
    "oob": ({}, "block_id_oob", {"W3": "error", "corrected": "error"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_predicts_each_failure_class(case):
    tables, fault, want = CASES[case]
    sc = load(None, {})
    sc = msgspec.structs.replace(sc, ctx=msgspec.convert({**tables.get("ctx", {})}, type(sc.ctx)),
                                 gen=msgspec.convert({**tables.get("gen", {})}, type(sc.gen)),
                                 request=msgspec.structs.replace(sc.request, fault=fault))
    got = {name: engine.predict(eras.line(name), eras.line(name), sc)[0].status for name in want}
    assert got == want


def test_engine_cross_era_pairs():
    sc = load(None, {})
    assert engine.predict(eras.line("W2b"), eras.line("W3"), sc)[0].status == "hang"  # RecvReqInfo keys
    assert engine.predict(eras.line("W2b"), eras.line("W1b"), sc)[0].status == "error"  # InstanceInfo vs RankInfo
    assert engine.predict(eras.line("W2a"), eras.line("W2b"), sc)[0].status == "hang"
    assert engine.predict(eras.line("E3"), eras.line("W3"), sc)[0] == engine.Predicted(
        "error", "info", "a C++ ctx publishes no info endpoint (T15)")


# ------------------------------------------------------------------------------------------------ proof
def _transfer(ctx: Side, gen: Side, ctx_blocks: list[int], gen_blocks: list[int], swap: bool = False
              ) -> tuple[list[Pool], list[Pool]]:
    """What the ctx ranks' WRITEs do, as memcpy within one process: the mappers' fragments between real pools."""
    cps = [Pool(ctx, r) for r in range(ctx.world)]
    gps = [Pool(gen, r) for r in range(gen.world)]
    for p in cps:
        p.tag(ctx_blocks)
    for g, gp in enumerate(gps):
        for c in peer_ranks(view_of(gen, g, gp.addr), ctx.pp_layers(), ctx.tp_size):
            cv, gv = view_of(ctx, c, cps[c].addr), view_of(gen, g, gp.addr)
            if not should_write(cv, gv):
                continue
            for s, d, n in fragments(cv, gv, ctx_blocks, gen_blocks):
                src = np.frombuffer((np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(s))),
                                    dtype=np.uint8).copy()
                if swap:
                    src = np.roll(src, 128)
                np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(d))[:] = src
    return cps, gps


@pytest.mark.parametrize(("ct", "gt", "heads", "cpp"), [(1, 1, 8, 1), (2, 4, 8, 1), (4, 2, 8, 1), (4, 2, 2, 1),
                                                         (1, 1, 8, 2)])
def test_the_proof_passes_a_correct_transfer(ct, gt, heads, cpp):
    ctx, gen = Side(tp_size=ct, kv_heads=heads, pp_size=cpp), Side(tp_size=gt, kv_heads=heads)
    _c, gps = _transfer(ctx, gen, [3, 7, 1], [9, 2, 5])
    for g, gp in enumerate(gps):
        p = prove(gen, g, gp, ctx, [9, 2, 5], [3, 7, 1])
        assert (p.status, p.wrong, p.arrived) == ("ok", 0, p.rows) and p.rows == 3 * 4 * 2 * gen.heads_per_rank * 16


def test_the_proof_names_the_ctx_coordinate_that_arrived_instead():
    ctx, gen = Side(tp_size=2), Side(tp_size=4)
    _c, gps = _transfer(ctx, gen, [3, 7, 1], [9, 2, 5], swap=True)  # every fragment shifted by one row
    p = prove(gen, 1, gps[1], ctx, [9, 2, 5], [3, 7, 1])
    assert p.status == "wrong" and p.wrong > 0
    assert p.first.startswith("gen block 9 (request block 0) layer 0 K head 2 token 0: should hold ctx rank 0 block 3, "
                              "holds ctx rank 0 layer 0 K block 3 head 3 token 15, encoded as float16"), p.first


def test_the_proof_shows_a_dtype_skew_as_right_rows_in_another_dtype():
    ctx, gen = Side(dtype="bfloat16"), Side(dtype="float16")
    _c, gps = _transfer(ctx, gen, [0, 1, 2], [3, 4, 5])
    p = prove(gen, 0, gps[0], ctx, [3, 4, 5], [0, 1, 2])
    assert (p.status, p.found_dtype, p.wrong, p.arrived) == ("dtype", "bfloat16", p.rows, p.rows)
    assert reads_as(1.0, "bfloat16", "float16") == 1.875 and reads_as(1.0, "float16", "bfloat16") == pytest.approx(
        0.0078125)


def test_the_proof_of_nothing_arrived():
    gen = Side()
    p = prove(gen, 0, Pool(gen, 0), Side(), [1, 2, 3], [4, 5, 6])
    assert p.status == "empty" and p.arrived == 0 and "untagged bytes (never written)" in p.first


# ----------------------------------------------------------------------------------------------- doctor
def _status(env: dict[str, str], name: str) -> tuple[str, str]:
    c = next(c for c in doctor_checks(env) if c.name == name)
    return c.status, c.detail


def test_doctor_rules():
    assert _status({}, "env TRTLLM_USE_PY_NIXL_KVCACHE")[0] == "PASS"
    assert _status({"TRTLLM_USE_PY_NIXL_KVCACHE": "yes"}, "env TRTLLM_USE_PY_NIXL_KVCACHE") == (
        "WARN", "'yes': Invalid value for TRTLLM_USE_PY_NIXL_KVCACHE: yes. Expected '0' or '1'. Defaulting to '0'.")
    assert _status({"TRTLLM_USE_PY_NIXL_KVCACHE": "1"}, "env TRTLLM_USE_PY_NIXL_KVCACHE")[0] == "WARN"
    both = {"TRTLLM_NIXL_KVCACHE_BACKEND": "LIBFABRIC", "NIXL_BACKEND": "LIBFABRIC"}
    status, detail = _status(both, "env TRTLLM_NIXL_KVCACHE_BACKEND")
    assert status == "FAIL" and "trtllm#10024" in detail
    assert _status({"TRTLLM_NIXL_KVCACHE_BACKEND": "GDS"}, "env TRTLLM_NIXL_KVCACHE_BACKEND") == (
        "WARN", "'GDS': Unsupported NIXL backend: GDS, fallback to UCX (T57)")
    assert _status({"TRTLLM_UCX_INTERFACE": "eth0"}, "env TRTLLM_NIXL_INTERFACE")[0] == "WARN"
    assert _status({"TRTLLM_USE_NIXL_KVCACHE": "1"}, "env TRTLLM_USE_*_KVCACHE")[0] == "WARN"
    assert _status({"TRTLLM_DISAGG_ENABLE_INFLIGHT_CANCEL": "1", "TRTLLM_DISAGG_LAYERWISE": "1"},
                   "env TRTLLM_DISAGG_ENABLE_INFLIGHT_CANCEL")[0] == "FAIL"
    assert _status({"UCX_RNDV_SCHEME": "get_zcopy"}, "env UCX_CUDA_IPC_ENABLE_MNNVL, UCX_RNDV_SCHEME")[0] == "WARN"


def test_doctor_interface_against_the_node():
    from pdcheck.doctor.netdevs import Devices, Nic

    devs = Devices([], [Nic("eth0", "up", "aa", 0, False, 1000, ["10.0.0.5"]),
                        Nic("ib0", "down", "bb", 0, False, None, ["10.1.0.5"]),
                        Nic("v6", "up", "cc", 0, False, None, ["fe80::1"])], [])
    got = {n: next(c for c in doctor_checks({"TRTLLM_NIXL_INTERFACE": n}, devs)
                   if c.name == "env TRTLLM_NIXL_INTERFACE").status for n in ("eth0", "ib0", "v6", "nope")}
    assert got == {"eth0": "PASS", "ib0": "FAIL", "v6": "FAIL", "nope": "FAIL"}


def test_framework_declares_its_flags_and_no_from_logs():
    from pdcheck import frameworks

    fw = frameworks.get("trtllm")
    assert set(fw.commands) == {"handshake", "smoke", "probe", "serve"}
    assert not fw.commands["handshake"].takes("device") and fw.commands["handshake"].takes("prefill_tp")
    assert len(fw.doctor_checks({}, None)) == 6
