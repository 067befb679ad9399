"""Unit tests of the release models 0.10.1 - 0.34, driven through the pure engine with an in-memory HandshakeIO.

Per line, every check is made to fire and not to fire, with the expression and message reference §4 quotes;
plus the G/H compatibility hash, the 0.14+ multi-rank handshake that re-arms the dst_num_blocks equality
(H03), the era-H two-frame reply, hang vs receive timeout, and resolve() over many release numbers.
"""

from __future__ import annotations

from typing import Any

import pytest
from releasekit import (
    assert_bare,
    assert_msg,
    assert_raise,
    ctx_for,
    handshaker,
    ids,
    mem_io,
    run_all,
    run_rank,
    side,
    statuses,
    step,
)

from pdcheck.errors import BadInput
from pdcheck.vllm.releases import CORRECTED, MODELLED, compat_hash_for, resolve, resolve_many
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.releases.rules import (
    MSG_LAYOUT_111,
    MSG_REPLICATED,
    MSG_SHAPE,
    MSG_SHAPE_P_GT_D,
    MSG_SHAPE_PAGE,
)

V0101, V0102, V0110, V0111, V0120, V013 = (resolve(v) for v in ("0.10.1", "0.10.2", "0.11.0", "0.11.1", "0.12.0",
                                                                 "0.13.0"))
V014, V016, V020, V024 = (resolve(v) for v in ("0.14.0", "0.16.0", "0.20.0", "0.24.0"))
V026, V028, V031, V034 = (resolve(v) for v in ("0.26.0", "0.28.0", "0.31.0", "0.34.0"))
BEFORE_F = (V0101, V0110)
FROM_F = (V0111, V013, V014, V020, V024, V026, V031, V034)
G_H = (V013, V014, V016, V020, V024, V026, V028, V031, V034)
FROM_14 = (V014, V016, V020, V024, V026, V028, V031, V034)

EXPR_TP = "self._tp_size[engine_id] == remote_tp_size"
EXPR_TP_111 = "self._tp_size[remote_engine_id] == remote_tp_size"
EXPR_BACKEND = "nixl_agent_meta.attn_backend_name == self.backend_name"
EXPR_LAYOUT = "nixl_agent_meta.kv_cache_layout == self.kv_cache_layout"
EXPR_EQ = "self.dst_num_blocks[engine_id] == nixl_agent_meta.num_blocks"
EXPR_EQ_111 = "self.dst_num_blocks[remote_engine_id] == nixl_agent_meta.num_blocks"
EXPR_LEN = "len(nixl_agent_meta.kv_caches_base_addr) == len(self.block_len_per_layer)"
EXPR_REPL_111 = "self.block_len_per_layer[i] // block_size_ratio == nixl_agent_meta.block_lens[i]"
EXPR_SHAPE_111 = "remote_block_len == (self.block_len_per_layer[0] * tp_ratio) // block_size_ratio"
HASH_PREFIX = "NIXL compatibility hash mismatch. Local: "
MLA = {"mla": True, "kv_heads": 1, "head_dim": 576, "backend": "FLASHMLA"}


# ---- registry --------------------------------------------------------------------------------------------------
RESOLVE = [
    # typed, name, wire, flow, receive timeout, connector version
    ("0.9.0", "0.9.0", "A", "same_rank", None, None),
    ("0.9.1", "0.9.1", "B", "rank0_then_target", None, None),
    ("0.9.2", "0.9.2", "C", "target_only", None, None),
    ("0.10.0", "0.10.0", "C", "target_only", None, None),
    ("0.10.1", "0.10.1", "D", "target_only", None, None),
    ("0.10.1.1", "0.10.1.1", "D", "target_only", None, None),
    ("0.10.2", "0.10.2", "D", "target_only", None, None),
    ("0.11.0", "0.11.0", "E", "target_only", None, None),
    ("0.11.1", "0.11.1", "F", "target_only", 5000, None),
    ("0.11.2", "0.11.2", "F", "target_only", 5000, None),
    ("v0.12", "0.12.0", "F", "target_only", 5000, None),
    ("0.13.0", "0.13.0", "G", "target_only", 5000, 2),
    ("0.14.1", "0.14.1", "G", "all_targets", 5000, 2),
    ("0.15.0", "0.15.0", "G", "all_targets", 5000, 2),
    ("0.16.0", "0.16.0", "G", "all_targets", 5000, 2),
    ("0.17.1", "0.17.1", "G", "all_targets", 5000, 2),
    ("0.18.0", "0.18.0", "G18", "all_targets", 5000, 2),
    ("0.19.1", "0.19.1", "G18", "all_targets", 5000, 2),
    ("0.20.0", "0.20.0", "G20", "all_targets", 5000, 2),
    ("0.20.2", "0.20.2", "G20", "all_targets", 5000, 2),
    ("0.21.0", "0.21.0", "G24", "all_targets", 5000, 3),
    ("0.22.1", "0.22.1", "G24", "all_targets", 5000, 4),
    ("0.23.0", "0.23.0", "G24", "all_targets", 5000, 4),
    ("0.24.0", "0.24.0", "G24", "all_targets", 5000, 4),
    ("0.25.1", "0.25.1", "G24", "all_targets", 5000, 4),
    ("0.26.0", "0.26.0", "H", "all_targets", 5000, 5),
    ("0.27.1", "0.27.1", "H", "all_targets", 5000, 5),
    ("0.28.0", "0.28.0", "H", "all_targets", 5000, 7),
    ("0.29.0", "0.29.0", "H29", "all_targets", 5000, 9),
    ("0.30.0", "0.30.0", "H31", "all_targets", 5000, 11),
    ("0.31.0", "0.31.0", "H31", "all_targets", 5000, 13),
    ("0.32.0", "0.32.0", "H31", "all_targets", 5000, 14),
    ("0.33.2", "0.33.2", "H31", "all_targets", 5000, 15),
    ("0.34.0", "0.34.0", "H34", "all_targets", 5000, 16),
    ("0.34.1+cu129", "0.34.1", "H34", "all_targets", 5000, 16),
]


@pytest.mark.parametrize(("typed", "name", "wire", "flow", "timeout", "cv"), RESOLVE)
def test_resolve(typed: str, name: str, wire: str, flow: str, timeout: int | None, cv: int | None) -> None:
    m = resolve(typed)
    assert (m.name, m.version, m.wire, m.flow, m.recv_timeout_ms, m.connector_version) == (
        name, name, wire, flow, timeout, cv)
    assert m.tp_size_from == ("metadata" if name == "0.9.1" else "params")
    assert bool(m.hash_factors) == (cv is not None)
    assert resolve(typed) is m  # one object per release


def test_resolve_lines_share_steps() -> None:
    a, b = resolve("0.14.0"), resolve("0.14.1")
    assert (a.add_remote, a.pre_flow, a.hash_factors) == (b.add_remote, b.pre_flow, b.hash_factors)
    assert (a.name, b.name, a.version, b.version) == ("0.14.0", "0.14.1", "0.14.0", "0.14.1") and a != b
    assert resolve("0.12.0").add_remote == resolve("0.11.1").add_remote


@pytest.mark.parametrize("bad", ["0.8.5", "1.0.0", "0.0.1"])
def test_resolve_out_of_range(bad: str) -> None:
    with pytest.raises(BadInput, match=r"^--vllm: release '.*' is not modelled \(modelled: 0\.9\.0 to 0\.34\.x, "
                                       r"corrected\)(; did you mean '[0-9.]+'( or '[0-9.]+')*\?)?$"):
        resolve(bad)


def test_resolve_not_a_number() -> None:
    with pytest.raises(BadInput, match="is not a release number"):
        resolve("latest")


def test_modelled_and_resolve_many() -> None:
    assert [m.name for m in MODELLED] == ["0.9.0", "0.9.1", "0.9.2", "0.10.0", "0.10.1", "0.11.0", "0.11.1",
                                          "0.13.0", "0.14.0", "0.16.0", "0.18.0", "0.20.0", "0.21.0", "0.22.0",
                                          "0.24.0", "0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
                                          "0.33.0", "0.34.0"]
    assert resolve_many("all") == MODELLED
    got = resolve_many("0.14.1, 0.14.1,0.28,corrected,v0.34.0")
    assert [m.name for m in got] == ["0.14.1", "0.28.0", "0.34.0"]
    assert resolve("corrected") is CORRECTED


def test_hash_factors_per_line() -> None:
    base = {"vllm_version", "nixl_connector_version", "model", "dtype", "num_kv_heads", "head_size",
            "num_hidden_layers", "attn_backend_name", "cache_dtype"}
    assert set(V013.hash_factors) == set(V014.hash_factors) == base
    assert set(V016.hash_factors) == base | {"cross_layers_blocks"}
    assert set(resolve("0.17.1").hash_factors) == base | {"cross_layers_blocks"}
    assert set(resolve("0.18.0").hash_factors) == set(V020.hash_factors) == set(V024.hash_factors) == set(
        V026.hash_factors) == (base | {"cross_layers_blocks", "is_hma_enabled"})
    assert set(V028.hash_factors) == base | {"cross_layers_blocks", "is_hma_enabled", "speculative_config",
                                             "transfer_mode"}
    assert set(resolve("0.29.0").hash_factors) == set(V031.hash_factors) == set(V034.hash_factors) == (
        base | {"is_hma_enabled", "speculative_config", "transfer_mode"})
    g = side("D", 1, 100).geometry
    assert all(compat_hash_for(m, g) is None for m in (V0101, V0110, V0111, V0120))
    hashes = {compat_hash_for(m, g) for m in G_H}
    assert len(hashes) == len(G_H) and all(len(h or "") == 64 for h in hashes)


def test_notifications() -> None:
    assert resolve("0.9.0").notif == "{req}"
    assert {m.notif for m in (V0101, V0110, V0111, V013, *FROM_14)} == {"{req}:{tp_ratio}"}


# ---- hang vs receive timeout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", BEFORE_F, ids=lambda m: m.name)
def test_hang_without_receive_timeout(rel: ReleaseModel) -> None:
    p = side("P", 2, 2048)
    o = run_rank(rel, p, side("D", 2, 2048), 1, io=mem_io(rel, p, mute={1}))
    assert (o.status, o.exception, o.contacted, o.handshake) == ("hang", None, [1], 1)
    assert o.message is not None and o.message.startswith("no reply from P rank 1: this release blocks in recv()")


@pytest.mark.parametrize("rel", FROM_F, ids=lambda m: m.name)
def test_receive_timeout_from_0111(rel: ReleaseModel) -> None:
    p = side("P", 2, 2048)
    o = run_rank(rel, p, side("D", 2, 2048), 1, io=mem_io(rel, p, mute={1}))
    assert (o.status, o.exception, o.message, o.contacted) == (
        "error", "zmq.error.Again", "Resource temporarily unavailable", [1])


# ---- shared: every later line passes a plain matching pair -------------------------------------------------------
@pytest.mark.parametrize("rel", (V0101, V0110, V0111, *G_H), ids=lambda m: m.name)
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 2), (2, 4), (1, 8)])
def test_matching_instances_pass(rel: ReleaseModel, p_tp: int, d_tp: int) -> None:
    p, d = side("P", p_tp, 3000), side("D", d_tp, 3000)
    outs = run_all(rel, p, d)
    assert statuses(outs) == ["ok"] * d_tp
    ratio = d_tp // p_tp
    assert [o.contacted for o in outs] == [[r // ratio] for r in range(d_tp)]
    assert [x.rank_offset for o in outs for x in o.prepared] == [
        (r % ratio) * d.geometry.block_len for r in range(d_tp)]
    assert all(o.stride == 3000 for o in outs)


@pytest.mark.parametrize("rel", (V0101, V0110, V0111, *G_H), ids=lambda m: m.name)
def test_engine_id_mismatch(rel: ReleaseModel) -> None:
    p, d = side("P-other", 2, 2048), side("D", 2, 2048)
    o = run_rank(rel, p, d, 0, expected="P-expected")
    assert_raise(o, "engine_id_matches",
                 "Remote NIXL agent engine ID mismatch. Expected P-expected,received P-other.")
    assert o.hazard == "H18"


# ---- 0.10.1 - 0.10.2 (era D) -------------------------------------------------------------------------------------
class TestV0101:
    def test_layout_assert_only_for_tp_ratio_above_one(self) -> None:
        for rel in (V0101, V0102):
            outs = run_all(rel, side("P", 2, 3000, layout="NHD"), side("D", 4, 3000))
            for o in outs:
                assert_bare(o, "kv_cache_layout", EXPR_LAYOUT, hazard="H09")
            # homogeneous TP: the layouts are never compared (H09: read with the wrong layout)
            assert statuses(run_all(rel, side("P", 2, 3000, layout="NHD"), side("D", 2, 3000))) == ["ok"] * 2

    def test_layout_not_compared_for_replicated_kv_or_mla(self) -> None:
        p, d = side("P", 2, 3000, kv_heads=2, layout="NHD"), side("D", 4, 3000, kv_heads=2)
        assert statuses(run_all(V0101, p, d)) == ["ok"] * 4
        p, d = side("P", 2, 3000, layout="NHD", **MLA), side("D", 4, 3000, **MLA)
        assert statuses(run_all(V0101, p, d)) == ["ok"] * 4

    def test_layout_equal_not_firing(self) -> None:
        assert statuses(run_all(V0101, side("P", 2, 3000, layout="NHD"), side("D", 4, 3000, layout="NHD"))) == [
            "ok"] * 4

    def test_steps_as_0100_plus_layout(self) -> None:
        assert ids(V0101) == ["engine_id_matches", "tp_size_consistent", "record_tp_size", "attn_backend",
                              "nixl_add_remote_agent", "tp_divisible", "tp_ratio_positive", "kv_cache_layout",
                              "block_len_equal", "block_len_tp_ratio", "block_size_equal", "dst_num_blocks_equal",
                              "record_dst_num_blocks", "prep_remote_descs"]

    def test_tp_size_consistency(self) -> None:
        p, d = side("P", 2, 3000), side("D", 4, 3000)
        h = handshaker(V0101, p, d, 0)
        h.state.tp_size["P"] = 4
        assert_bare(h.run(), "tp_size_consistent", EXPR_TP, hazard="H12")

    def test_attn_backend(self) -> None:
        o = run_rank(V0101, side("P", 2, 2048, backend="FLASHINFER"), side("D", 2, 2048), 1)
        assert_bare(o, "attn_backend", EXPR_BACKEND, hazard="H10")

    def test_tp_divide_and_zero_division(self) -> None:
        outs = run_all(V0101, side("P", 3, 3000, kv_heads=12), side("D", 4, 3000, kv_heads=12))
        for o in outs[:3]:
            assert_msg(o, "tp_divisible", "numerator % denominator == 0", "4 is not divisible by 3")
        p = side("P", 4, 3000)
        io = mem_io(V0101, p)
        o = run_rank(V0101, p, side("D", 2, 3000), 1, io=io)
        assert (o.status, o.exception, io.asked) == ("error", "ZeroDivisionError", [])

    def test_shape_and_replicated(self) -> None:
        for o in run_all(V0101, side("P", 2, 2048, kv_heads=8), side("D", 2, 2048, kv_heads=4)):
            assert_msg(o, "block_len_tp_ratio", "nixl_agent_meta.block_len == self.block_len * tp_ratio", MSG_SHAPE)
        o = run_rank(V0101, side("P", 2, 2048, kv_heads=2, head_dim=64), side("D", 4, 2048, kv_heads=2), 0)
        assert_bare(o, "block_len_equal", "self.block_len == nixl_agent_meta.block_len", hazard="H08")

    def test_block_size_message(self) -> None:
        check = step(V0101, "block_size_equal")
        ctx = ctx_for(side("D", 2, 2048), 0, side("P", 2, 2048, block_size=32), 0)
        assert check.ok(ctx) is False
        assert check.render(ctx) == ("Remote P worker with different block size is not supported "
                                     "self.block_size=16 remote_block_size=32")
        assert check.ok(ctx_for(side("D", 2, 2048), 0, side("P", 2, 2048), 0)) is True

    def test_dst_num_blocks_equality_needs_a_second_handshake(self) -> None:
        p, d = side("P", 2, [3008, 2992]), side("D", 2, 3000)
        assert statuses(run_all(V0101, p, d)) == ["ok", "ok"]
        h = handshaker(V0101, p, d, 1)
        h.state.dst_num_blocks["P"] = 3008
        assert_bare(h.run(), "dst_num_blocks_equal", EXPR_EQ, hazard="H03")

    def test_remote_device_is_remote_tp_rank(self) -> None:
        p = side("P", 2, 2048)
        o = run_rank(V0101, p, side("D", 2, 2048), 1, io=mem_io(V0101, p, override={1: {"device_id": 7}}))
        assert o.prepared[0].device_id == 1  # era D carries no device_id: remote_tp_rank


# ---- 0.11.0 (era E) ------------------------------------------------------------------------------------------------
class TestV0110:
    def test_replicated_list_equality(self) -> None:
        o = run_rank(V0110, side("P", 2, 3000, **{**MLA, "head_dim": 512}), side("D", 4, 3000, **MLA), 0)
        assert_msg(o, "block_lens_equal_replicated", "self.block_len_per_layer == nixl_agent_meta.block_lens",
                   MSG_REPLICATED, hazard="H08")
        # replicated KV (P TP >= heads) with another layer count: the list differs in length
        o = run_rank(V0110, side("P", 2, 3000, kv_heads=2, layers=2), side("D", 4, 3000, kv_heads=2), 0)
        assert_msg(o, "block_lens_equal_replicated", "self.block_len_per_layer == nixl_agent_meta.block_lens",
                   MSG_REPLICATED)
        assert statuses(run_all(V0110, side("P", 2, 3000, **MLA), side("D", 4, 3000, **MLA))) == ["ok"] * 4

    def test_all_remote_layers_same_block_size(self) -> None:
        p = side("P", 2, 3000, layers=2)
        bl = p.geometry.block_len
        io = mem_io(V0110, p, override={0: {"block_lens": [bl, bl, bl, 2 * bl]}})
        o = run_rank(V0110, p, side("D", 2, 3000, layers=2), 0, io=io)
        assert_msg(o, "remote_layers_same_block_len", "block_len == remote_block_len",
                   "All remote layers must have the same block size")

    def test_shape(self) -> None:
        for o in run_all(V0110, side("P", 2, 2048, kv_heads=8), side("D", 2, 2048, kv_heads=4)):
            assert_msg(o, "block_len_tp_ratio", "remote_block_len == self.block_len_per_layer[0] * tp_ratio",
                       MSG_SHAPE, hazard="H08")

    def test_block_size_message(self) -> None:
        check = step(V0110, "block_size_equal")
        ctx = ctx_for(side("D", 2, 2048), 0, side("P", 2, 2048, block_size=32), 0)
        assert check.ok(ctx) is False
        assert check.render(ctx) == ("Remote P worker with different page/block size is not supported "
                                     "self.block_size=16, remote_block_size=32")
        assert check.ok(ctx_for(side("D", 2, 2048), 0, side("P", 2, 2048), 0)) is True

    def test_number_of_regions(self) -> None:
        o = run_rank(V0110, side("P", 2, 3000, layers=2), side("D", 2, 3000, layers=1), 0)
        assert_bare(o, "kv_caches_base_addr_len", EXPR_LEN, hazard="H08")
        assert run_rank(V0110, side("P", 2, 3000, layers=2), side("D", 2, 3000, layers=2), 0).status == "ok"

    def test_layout_only_for_tp_ratio_above_one(self) -> None:
        for o in run_all(V0110, side("P", 2, 3000, layout="NHD"), side("D", 4, 3000)):
            assert_bare(o, "kv_cache_layout", EXPR_LAYOUT)
        assert statuses(run_all(V0110, side("P", 2, 3000, layout="NHD"), side("D", 2, 3000))) == ["ok"] * 2

    def test_attn_backend_and_tp_size(self) -> None:
        o = run_rank(V0110, side("P", 2, 2048, backend="FLASHINFER"), side("D", 2, 2048), 0)
        assert_bare(o, "attn_backend", EXPR_BACKEND)
        h = handshaker(V0110, side("P", 2, 3000), side("D", 2, 3000), 0)
        h.state.tp_size["P"] = 1
        assert_bare(h.run(), "tp_size_consistent", EXPR_TP)

    def test_dst_num_blocks_equality(self) -> None:
        p, d = side("P", 2, [3008, 2992]), side("D", 2, 3000)
        h = handshaker(V0110, p, d, 1)
        h.state.dst_num_blocks["P"] = 3008
        assert_bare(h.run(), "dst_num_blocks_equal", EXPR_EQ)
        assert run_rank(V0110, p, d, 1).status == "ok"


# ---- 0.11.1 - 0.12 (era F) and 0.13 (era G) ---------------------------------------------------------------------
F_G = (V0111, V0120, V013)


@pytest.mark.parametrize("rel", F_G, ids=lambda m: m.name)
class TestV0111:
    def test_p_tp_greater_than_d_tp_before_any_request(self, rel: ReleaseModel) -> None:
        p = side("P", 4, 3000)
        io = mem_io(rel, p)
        o = run_rank(rel, p, side("D", 2, 3000), 1, io=io)
        assert_msg(o, "tp_ratio_divisible", "self.tp_size % remote_tp_size == 0",
                   "Local tensor parallel size 2 is not divisible by remote tensor parallel size 4.", hazard="H11")
        assert (o.contacted, io.asked, o.handshake) == ([], [], 0)

    def test_tp_not_divisible(self, rel: ReleaseModel) -> None:
        for o in run_all(rel, side("P", 3, 3000, kv_heads=12), side("D", 4, 3000, kv_heads=12)):
            assert_msg(o, "tp_ratio_divisible", "self.tp_size % remote_tp_size == 0",
                       "Local tensor parallel size 4 is not divisible by remote tensor parallel size 3.")

    def test_np_greater_than_nd(self, rel: ReleaseModel) -> None:
        p = side("P", 2, 3000, block_size=32)
        io = mem_io(rel, p)
        o = run_rank(rel, p, side("D", 2, 3000), 0, io=io)
        assert_msg(o, "block_size_le", "metadata.block_size <= self.block_size", "nP > nD is not supported yet.",
                   hazard="H07")
        assert (o.contacted, io.added) == ([0], [])  # in _nixl_handshake: no NIXL agent added

    def test_smaller_p_block_is_supported(self, rel: ReleaseModel) -> None:
        """D block 32 = 2 x P block 16: block_size_ratio 2, D reads half-blocks."""
        d = side("D", 2, 3000, block_size=32)
        outs = run_all(rel, side("P", 2, 6000), d)
        assert statuses(outs) == ["ok", "ok"]
        assert [x.block_len for o in outs for x in o.prepared] == [d.geometry.block_len // 2] * 2

    def test_block_size_ratio(self, rel: ReleaseModel) -> None:
        o = run_rank(rel, side("P", 2, 3000, block_size=12), side("D", 2, 3000, block_size=32), 0)
        assert_msg(o, "block_size_ratio", "self.block_size % remote_block_size == 0",
                   "Local block size 32 is not divisible by remote block size 12 or vice versa.", hazard="H07")

    def test_tp_size_assert(self, rel: ReleaseModel) -> None:
        p, d = side("P", 2, 3000), side("D", 4, 3000)
        h = handshaker(rel, p, d, 0)
        h.state.tp_size["P"] = 4
        assert_bare(h.run(), "tp_size_consistent", EXPR_TP_111, hazard="H12")

    def test_tp_ratio_positive_unreachable(self, rel: ReleaseModel) -> None:
        check = step(rel, "tp_ratio_positive")
        assert (check.expr, check.message) == ("tp_ratio > 0", "Decode TP cannot be smaller than prefill TP")
        assert check.ok(ctx_for(side("D", 2, 3000), 0, side("P", 4, 3000), 0)) is False

    def test_layout_runtime_error_even_homogeneous(self, rel: ReleaseModel) -> None:
        for o in run_all(rel, side("P", 2, 3000, layout="NHD"), side("D", 2, 3000)):
            assert_raise(o, "kv_cache_layout", MSG_LAYOUT_111)
            assert o.hazard == "H09"
        # MLA: not compared
        assert statuses(run_all(rel, side("P", 2, 3000, layout="NHD", **MLA), side("D", 2, 3000, **MLA))) == [
            "ok"] * 2

    def test_replicated_block_lens(self, rel: ReleaseModel) -> None:
        o = run_rank(rel, side("P", 2, 2048, kv_heads=2, head_dim=64), side("D", 4, 2048, kv_heads=2), 0,
                     enforce=False)
        assert_msg(o, "block_lens_equal_replicated", EXPR_REPL_111, MSG_REPLICATED, hazard="H08")
        assert statuses(run_all(rel, side("P", 2, 2048, kv_heads=2), side("D", 4, 2048, kv_heads=2))) == ["ok"] * 4

    def test_replicated_fewer_remote_layers_is_index_error(self, rel: ReleaseModel) -> None:
        p, d = side("P", 2, 2048, **MLA), side("D", 2, 2048, **MLA, layers=2)
        o = run_rank(rel, p, d, 0, enforce=False)
        assert (o.status, o.exception, o.message) == ("error", "IndexError", "list index out of range")

    def test_all_remote_layers_same_block_size(self, rel: ReleaseModel) -> None:
        p = side("P", 2, 3000, layers=2)
        bl = p.geometry.block_len
        o = run_rank(rel, p, side("D", 2, 3000, layers=2), 0,
                     io=mem_io(rel, p, override={0: {"block_lens": [bl, bl, 2 * bl, bl]}}))
        assert_msg(o, "remote_layers_same_block_len", "block_len == remote_block_len",
                   "All remote layers must have the same block size")

    def test_shape(self, rel: ReleaseModel) -> None:
        p, d = side("P", 2, 2048, kv_heads=8), side("D", 2, 2048, kv_heads=4)
        for o in run_all(rel, p, d, enforce=False):
            assert_msg(o, "block_len_tp_ratio", EXPR_SHAPE_111, MSG_SHAPE, hazard="H08")

    def test_dst_num_blocks_equality(self, rel: ReleaseModel) -> None:
        p, d = side("P", 2, [3008, 2992]), side("D", 2, 3000)
        assert statuses(run_all(rel, p, d)) == ["ok", "ok"]
        h = handshaker(rel, p, d, 1)
        h.state.dst_num_blocks["P"] = 3008
        assert_bare(h.run(), "dst_num_blocks_equal", EXPR_EQ_111, hazard="H03")

    def test_number_of_regions(self, rel: ReleaseModel) -> None:
        o = run_rank(rel, side("P", 2, 3000, layers=2), side("D", 2, 3000), 0, enforce=False)
        assert_bare(o, "kv_caches_base_addr_len", EXPR_LEN)

    def test_device_id_from_metadata(self, rel: ReleaseModel) -> None:
        p = side("P", 2, 2048)
        o = run_rank(rel, p, side("D", 2, 2048), 1, io=mem_io(rel, p, override={1: {"device_id": 7}}))
        assert (o.status, o.prepared[0].device_id) == ("ok", 7)


class TestV0111Only:
    def test_attn_backend_bare(self) -> None:
        for rel in (V0111, V0120):
            o = run_rank(rel, side("P", 2, 2048, backend="FLASHINFER"), side("D", 2, 2048), 0)
            assert_bare(o, "attn_backend", EXPR_BACKEND, hazard="H10")

    def test_cross_era_e_and_f(self) -> None:
        """0.11.0 D against a 0.11.1 P: the metadata decodes (OK cell of §3.6); the framing differs (not modelled)."""
        p = side("P", 2, 2048)
        assert run_rank(V0110, p, side("D", 2, 2048), 0, io=mem_io(V0110, p, wire="F")).status == "ok"
        o = run_rank(V0111, p, side("D", 2, 2048), 0, io=mem_io(V0111, p, wire="E"))
        assert (o.status, o.exception, o.message) == (
            "error", "msgspec.ValidationError", "Object missing required field `device_id`")


class TestV013:
    def test_attn_backend_is_in_the_hash(self) -> None:
        assert "attn_backend" not in ids(V013)
        p, d = side("P", 2, 2048, backend="TRITON_ATTN"), side("D", 2, 2048)
        o = run_rank(V013, p, d, 0)
        assert (o.status, o.exception, o.check, o.assert_expr) == ("error", "RuntimeError", None, None)
        assert o.message is not None and o.message.startswith(HASH_PREFIX)
        assert run_rank(V013, p, d, 0, enforce=False).status == "ok"  # escape hatch: nothing else compares it

    @pytest.mark.parametrize("diff", [{"model": "other/model"}, {"dtype": "float16"}, {"kv_heads": 4},
                                      {"head_dim": 64}, {"layers": 2}, {"backend": "FLASHINFER"}])
    def test_hash_mismatch(self, diff: dict[str, Any]) -> None:
        p, d = side("P", 2, 2048, **diff), side("D", 2, 2048)
        local_hash, remote_hash = compat_hash_for(V013, d.geometry, d.model), compat_hash_for(V013, p.geometry, p.model)
        io = mem_io(V013, p)
        o = run_rank(V013, p, d, 0, io=io)
        assert (o.status, o.exception) == ("error", "RuntimeError")
        assert o.message is not None and o.message.startswith(
            f"{HASH_PREFIX}{local_hash}, Remote: {remote_hash}. Prefill and decode instances have incompatible "
            "configurations.")
        assert o.message.endswith('{"kv_connector_extra_config": {"enforce_handshake_compat": false}}\'')
        assert io.added == []  # compared before the metadata is decoded

    def test_hash_not_firing_for_block_size_or_layout_or_tp(self) -> None:
        """tp_size, block_size and kv_cache_layout are validated at run time, not hashed."""
        assert run_rank(V013, side("P", 2, 6000), side("D", 2, 3000, block_size=32), 0).status == "ok"
        assert run_rank(V013, side("P", 1, 3000), side("D", 2, 3000), 1).status == "ok"
        o = run_rank(V013, side("P", 2, 3000, layout="NHD"), side("D", 2, 3000), 0)
        assert_raise(o, "kv_cache_layout", MSG_LAYOUT_111)

    def test_hash_differs_across_releases_of_one_line(self) -> None:
        p, d = side("P", 2, 2048), side("D", 2, 2048)
        o = run_rank(V013, p, d, 0, io=mem_io(V013, p, p_rel=resolve("0.13.1")))
        assert o.message is not None and o.message.startswith(HASH_PREFIX)

    def test_decode_error_wrapped(self) -> None:
        p = side("P", 2, 2048)
        o = run_rank(V013, p, side("D", 2, 2048), 0, io=mem_io(V013, p, wire="F"))
        assert (o.status, o.exception) == ("error", "RuntimeError")
        assert o.message is not None and o.message.startswith(
            "Failed to decode NixlHandshakePayload. This likely indicates an incompatibility between connector "
            "version. Error: ")


# ---- 0.14 - 0.25 (era G, G20, G24) and 0.26 - 0.34 (era H) -------------------------------------------------------
SEED4 = [3008, 2992, 2992, 2992]


@pytest.mark.parametrize("rel", FROM_14, ids=lambda m: m.name)
class TestFrom014:
    def test_p_tp_greater_than_d_tp_reads_every_target(self, rel: ReleaseModel) -> None:
        p, d = side("P", 4, 3000), side("D", 2, 3000)
        outs = run_all(rel, p, d)
        assert statuses(outs) == ["ok", "ok"]
        assert [o.contacted for o in outs] == [[0, 1], [2, 3]]
        half = d.geometry.block_len // 2
        assert [(x.p_rank, x.block_len, x.local_offset, x.rank_offset) for o in outs for x in o.prepared] == [
            (0, half, 0, 0), (1, half, half, 0), (2, half, 0, 0), (3, half, half, 0)]

    def test_h03_uneven_p_counts_fire_on_the_second_handshake(self, rel: ReleaseModel) -> None:
        p, d = side("P", 4, SEED4), side("D", 2, 3000)
        outs = run_all(rel, p, d)
        assert_bare(outs[0], "dst_num_blocks_equal", EXPR_EQ_111, hazard="H03")
        assert (outs[0].handshake, outs[0].remote_rank, outs[0].contacted, outs[0].recorded_num_blocks) == (
            2, 1, [0, 1], 3008)
        assert outs[1].status == "ok"  # P ranks 2 and 3 agree
        # python -O: the first rank's count strides the second rank's list (H04)
        o = run_rank(rel, p, d, 0, bypass=True)
        assert (o.status, o.hazard, o.stride, [x.dlist_blocks for x in o.prepared]) == (
            "silent", "H04", 3008, [3008, 2992])

    def test_mla_p_greater_handshakes_all_reads_one(self, rel: ReleaseModel) -> None:
        # 0.14 - 0.20 assert `not (tp_ratio < 0 and is_kv_replicated)` for MLA too, with the model's KV head count
        # (a one-head MLA model trips it there: TestMlaPGreaterThanD); 128 heads, as DeepSeek's config has, pass.
        mla = {**MLA, "kv_heads": 128}
        p, d = side("P", 4, SEED4, **mla), side("D", 2, 3000, **mla)
        outs = run_all(rel, side("P", 4, 3000, **mla), d)
        assert statuses(outs) == ["ok", "ok"]
        # every target rank is handshaken (get_target_remote_ranks has no MLA case), the first one is read
        assert [o.contacted for o in outs] == [[0, 1], [2, 3]]
        assert [(x.p_rank, x.block_len) for o in outs for x in o.prepared] == [(0, d.geometry.block_len),
                                                                              (2, d.geometry.block_len)]
        # so P ranks advertising different num_blocks trip the dst_num_blocks equality for MLA too (H03)
        o = run_rank(rel, p, d, 0)
        assert (o.status, o.check, o.handshake, o.remote_rank) == ("assert", "dst_num_blocks_equal", 2, 1)

    def test_tp_divisibility_both_directions(self, rel: ReleaseModel) -> None:
        p = side("P", 6, 3000, kv_heads=12)
        io = mem_io(rel, p)
        o = run_rank(rel, p, side("D", 4, 3000, kv_heads=12), 0, io=io)
        assert_msg(o, "tp_ratio_divisible", "remote_tp_size % self.tp_size == 0",
                   "Remote tensor parallel size 6 is not divisible by local tensor parallel size 4.", hazard="H11")
        assert io.asked == []
        o = run_rank(rel, side("P", 3, 3000, kv_heads=12), side("D", 4, 3000, kv_heads=12), 0)
        assert_msg(o, "tp_ratio_divisible", "self.tp_size % remote_tp_size == 0",
                   "Local tensor parallel size 4 is not divisible by remote tensor parallel size 3.")

    def test_larger_p_block_fails_block_size_ratio(self, rel: ReleaseModel) -> None:
        assert "block_size_le" not in ids(rel)
        io = mem_io(rel, side("P", 2, 3000, block_size=32))
        o = run_rank(rel, io.p, side("D", 2, 3000), 0, io=io)
        assert_msg(o, "block_size_ratio", "self.block_size % remote_block_size == 0",
                   "Local block size 16 is not divisible by remote block size 32 or vice versa.", hazard="H07")
        assert len(io.added) == 1  # raised in add_remote_agent, after the NIXL agent was added

    def test_p_greater_block_size_ratio(self, rel: ReleaseModel) -> None:
        o = run_rank(rel, side("P", 4, 6000, block_size=8), side("D", 2, 3000), 0)
        assert_msg(o, "p_gt_d_block_size", "block_size_ratio == 1",
                   "Different local/remote block sizes are not supported when P TP > D TP.", hazard="H07")

    def test_tp_size_assert(self, rel: ReleaseModel) -> None:
        h = handshaker(rel, side("P", 2, 3000), side("D", 4, 3000), 0)
        h.state.tp_size["P"] = 4
        # 0.20+ keep the remote tp_size in TransferTopology's EngineTransferInfo
        expr = EXPR_TP_111 if rel in (V014, V016) else "remote_info.remote_tp_size == remote_tp_size"
        assert_bare(h.run(), "tp_size_consistent", expr, hazard="H12")

    def test_dst_num_blocks_not_firing_with_even_counts(self, rel: ReleaseModel) -> None:
        outs = run_all(rel, side("P", 4, 2992), side("D", 2, 3000))
        assert statuses(outs) == ["ok", "ok"] and [o.stride for o in outs] == [2992, 2992]

    def test_no_attn_backend_assert(self, rel: ReleaseModel) -> None:
        assert "attn_backend" not in ids(rel)
        p, d = side("P", 2, 2048, backend="TRITON_ATTN"), side("D", 2, 2048)
        o = run_rank(rel, p, d, 0)
        assert o.message is not None and o.message.startswith(HASH_PREFIX)
        assert run_rank(rel, p, d, 0, enforce=False).status == "ok"

    def test_hash_mismatch_heads(self, rel: ReleaseModel) -> None:
        o = run_rank(rel, side("P", 4, 3000, kv_heads=4), side("D", 2, 3000), 0)
        assert (o.status, o.exception, o.contacted) == ("error", "RuntimeError", [0])
        assert o.message is not None and o.message.startswith(HASH_PREFIX)

    def test_hash_across_versions(self, rel: ReleaseModel) -> None:
        p, d = side("P", 2, 3000), side("D", 2, 3000)
        o = run_rank(rel, p, d, 0, io=mem_io(rel, p, p_rel=V013))
        assert (o.status, o.exception) == ("error", "RuntimeError")


EXPR_P_GT_D_14 = "not (tp_ratio < 0 and self.kv_topo.is_kv_replicated(remote_engine_id))"
EXPR_P_GT_D_20 = "not (tp_ratio < 0 and self.transfer_topo.is_kv_replicated(remote_engine_id))"
BEFORE_20 = (V014, V016)
PER_REGION = (V024, V026, V028, V031, V034)  # 0.24+: per-region block lengths with per-rank head counts


def _p_gt_d_expr(rel: ReleaseModel) -> str:
    return EXPR_P_GT_D_14 if rel in BEFORE_20 else EXPR_P_GT_D_20


@pytest.mark.parametrize("rel", FROM_14, ids=lambda m: m.name)
class TestV014To034:
    def test_replicated_with_p_greater_is_a_bare_assert(self, rel: ReleaseModel) -> None:
        """H13: P TP 4 > 2 KV heads and P TP > D TP: every release from 0.14 to 0.34 asserts, statement as written."""
        o = run_rank(rel, side("P", 4, 3000, kv_heads=2), side("D", 2, 3000, kv_heads=2), 0)
        assert_bare(o, "p_gt_d_replicated", _p_gt_d_expr(rel), hazard="H13")

    def test_replication_boundary(self, rel: ReleaseModel) -> None:
        """P TP == heads: KVTopology (0.14 - 0.19, `//` >= 1) calls it replicated and asserts; TransferTopology
        (0.20+, `>`) splits one head per P rank."""
        p, d = side("P", 2, 3000, kv_heads=2), side("D", 1, 3000, kv_heads=2)
        o = run_rank(rel, p, d, 0)
        if rel in BEFORE_20:
            assert_bare(o, "p_gt_d_replicated", EXPR_P_GT_D_14)
            return
        assert (o.status, o.contacted) == ("ok", [0, 1])
        half = d.geometry.block_len // 2
        assert [(x.block_len, x.local_offset) for x in o.prepared] == [(half, 0), (half, half)]

    def test_p_greater_shape(self, rel: ReleaseModel) -> None:
        p, d = side("P", 4, 3000, head_dim=64), side("D", 2, 3000)
        o = run_rank(rel, p, d, 0, enforce=False)
        if rel in PER_REGION:
            pl, dl = p.geometry.block_len, d.geometry.block_len
            assert_msg(o, "block_len_p_gt_d", "remote_len == local_len * remote_heads // local_heads",
                       f"SPLIT region 0: remote P KV block_len {pl} must equal local {dl} * remote_heads 2 // "
                       "local_heads 4.", hazard="H08")
        else:
            assert_msg(o, "block_len_p_gt_d", "remote_block_len == self.block_len_per_layer[0] // (-tp_ratio)",
                       MSG_SHAPE_P_GT_D, hazard="H08")

    def test_d_greater_shape(self, rel: ReleaseModel) -> None:
        p, d = side("P", 2, 3000, head_dim=64), side("D", 4, 3000)
        o = run_rank(rel, p, d, 0, enforce=False)
        if rel in PER_REGION:
            assert_msg(o, "block_len_split", "remote_len == (local_len * remote_heads // local_heads) // "
                       "block_size_ratio",
                       f"SPLIT region 0: remote P KV block_len {p.geometry.block_len} must equal local "
                       f"{d.geometry.block_len} * remote_heads 4 // local_heads 2 // block_size_ratio 1.")
        else:
            # "page_size" from 0.14 on (0.11.1 - 0.13 say "block_size")
            assert_msg(o, "block_len_tp_ratio", EXPR_SHAPE_111, MSG_SHAPE_PAGE)

    def test_replicated_block_lens(self, rel: ReleaseModel) -> None:
        """P TP 4 > 2 heads (replicated everywhere), D TP 4, P's head_dim half D's."""
        p, d = side("P", 4, 3000, kv_heads=2, head_dim=64), side("D", 4, 3000, kv_heads=2)
        o = run_rank(rel, p, d, 0, enforce=False)
        if rel in PER_REGION:
            assert_msg(o, "block_lens_equal_replicated", "local_len // block_size_ratio == remote_len",
                       f"KV cache sizes must match between P and D when replicated (region 0: local="
                       f"{d.geometry.block_len}, remote={p.geometry.block_len}, bsr=1).", hazard="H08")
        else:
            assert_msg(o, "block_lens_equal_replicated", EXPR_REPL_111, MSG_REPLICATED)

    def test_layout_runtime_error(self, rel: ReleaseModel) -> None:
        o = run_rank(rel, side("P", 2, 3000, layout="NHD"), side("D", 2, 3000), 0)
        if rel is V034:
            assert (o.status, o.check) == ("error", "kv_cache_layout")  # its own message: TestV034
        else:
            assert_raise(o, "kv_cache_layout", MSG_LAYOUT_111)

    def test_equal_nhd_layouts(self, rel: ReleaseModel) -> None:
        """Equal NHD layouts with D TP > P TP: 0.14 - 0.19 pass the handshake (the head slice misreads, H09);
        0.20+ refuse to split heads out of a local layout that is not HND / block-contiguous."""
        outs = run_all(rel, side("P", 2, 3000, layout="NHD"), side("D", 4, 3000, layout="NHD"))
        if rel in BEFORE_20:
            assert statuses(outs) == ["ok"] * 4
            return
        msg = (HEAD_SPLIT_20 if rel in (V020, V024, V026, V028) else HEAD_SPLIT_29)
        for o in outs:
            assert_raise(o, "head_split_contiguous", msg)


HEAD_SPLIT_20 = ("Heterogeneous TP head-dimension splitting requires contiguous heads. Use HND layout on the "
                 "prefill side.")
HEAD_SPLIT_29 = ("Heterogeneous TP head-dimension splitting requires contiguous heads. Use a block-contiguous "
                 "layout (e.g. LBHNC) on the prefill side.")


# ---- era H framing and layout names ------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", (V026, V028, V031, V034), ids=lambda m: m.name)
def test_h_one_frame_reply_trips_the_assert(rel: ReleaseModel) -> None:
    p = side("P", 2, 2048)
    o = run_rank(rel, p, side("D", 2, 2048), 0, io=mem_io(rel, p, one_frame=True))
    assert_bare(o, None, "len(reply_parts) == 2")
    o = run_rank(rel, p, side("D", 2, 2048), 0, io=mem_io(rel, p, wire="G24"))  # a 0.24 P answers
    assert_bare(o, None, "len(reply_parts) == 2")
    assert run_rank(rel, p, side("D", 2, 2048), 0).status == "ok"


def test_g_d_reads_only_the_first_frame() -> None:
    """A 0.24 D reads one frame: an H reply still decodes (the REQ state problem is the socket's, not modelled)."""
    p = side("P", 2, 2048)
    o = run_rank(V024, p, side("D", 2, 2048), 0, io=mem_io(V024, p, wire="H"))
    assert o.status == "ok"


@pytest.mark.parametrize("rel", (V031, V034), ids=lambda m: m.name)
@pytest.mark.parametrize(("p_layout", "d_layout", "ok"), [
    ("HND", "HND", True), ("LBHNC", "HND", True), ("NHD", "NHD", True), ("LBNHC", "NHD", True),
    ("NHD", "HND", False), ("LBNHC", "HND", False), ("LHBNC", "HND", False), ("HND", "NHD", False),
])
def test_031_layout_names(rel: ReleaseModel, p_layout: str, d_layout: str, ok: bool) -> None:
    o = run_rank(rel, side("P", 2, 3000, layout=p_layout), side("D", 2, 3000, layout=d_layout), 0)
    assert (o.status == "ok") is ok
    if not ok:
        assert (o.status, o.exception, o.check) == ("error", "RuntimeError", "kv_cache_layout")


def test_028_compares_plain_strings() -> None:
    o = run_rank(V028, side("P", 2, 3000, layout="LBHNC"), side("D", 2, 3000), 0)
    assert_raise(o, "kv_cache_layout", MSG_LAYOUT_111)


# ---- 0.34 ------------------------------------------------------------------------------------------------------------
class TestV034:
    def test_layout_message_names_both(self) -> None:
        o = run_rank(V034, side("P", 2, 3000, layout="NHD"), side("D", 2, 3000), 0)
        assert_raise(o, "kv_cache_layout",
                     "Heterogeneous TP expects same kv_cache_layout (local LBHNC, remote LBNHC). Or enable "
                     "experimental feature to receive LBHNC into a local LBNHC cache by setting "
                     "'enable_permute_local_kv'=True in --kv-transfer-config.")

    def test_head_split_needs_contiguous_heads(self) -> None:
        outs = run_all(V034, side("P", 2, 3000, layout="NHD"), side("D", 4, 3000, layout="NHD"))
        for o in outs:
            assert_raise(o, "head_split_contiguous", HEAD_SPLIT_29)
        # homogeneous TP with NHD on both sides splits nothing
        assert statuses(run_all(V034, side("P", 2, 3000, layout="NHD"), side("D", 2, 3000, layout="NHD"))) == [
            "ok"] * 2

    def test_split_region_message(self) -> None:
        p, d = side("P", 2, 3000, kv_heads=4), side("D", 2, 3000)
        o = run_rank(V034, p, d, 1, enforce=False)
        assert_msg(o, "block_len_split", "remote_len == (local_len * remote_heads // local_heads) // block_size_ratio",
                   "SPLIT region 0: remote P KV block_len 8192 must equal local 16384 * remote_heads 4 // "
                   "local_heads 4 // block_size_ratio 1.", hazard="H08")

    def test_split_region_index(self) -> None:
        p, d = side("P", 2, 3000, layers=2), side("D", 4, 3000, layers=2)
        bl = p.geometry.block_len
        o = run_rank(V034, p, d, 0, io=mem_io(V034, p, override={0: {"block_lens": [bl, bl, bl // 2, bl]}}))
        assert o.message == (f"SPLIT region 2: remote P KV block_len {bl // 2} must equal local {bl // 2} * "
                             "remote_heads 4 // local_heads 2 // block_size_ratio 1.")

    def test_number_of_layers(self) -> None:
        # 0.34 pairs regions through the layer names first: a layer D lacks raises there (pp_size 1)
        o = run_rank(V034, side("P", 2, 3000, layers=2), side("D", 2, 3000), 0, enforce=False)
        assert_raise(o, "layer_known", "Engine P holds KV layer 'model.layers.1.self_attn.attn', which has no "
                     "counterpart here.")
        o = run_rank(V034, side("P", 2, 3000), side("D", 2, 3000, layers=3), 0, enforce=False)
        assert_raise(o, "layers_held", "Engine P does not hold the KV layers ['model.layers.1.self_attn.attn', "
                     "'model.layers.2.self_attn.attn'].")
        o = run_rank(V031, side("P", 2, 3000, layers=2), side("D", 2, 3000), 0, enforce=False)
        assert_msg(o, "num_kv_layers", "len(local_regions) == len(nixl_agent_meta.block_lens)",
                   "Number of KV layers must match between prefill and decode")
        o = run_rank(V024, side("P", 2, 3000, layers=2), side("D", 2, 3000), 0, enforce=False)
        assert_msg(o, "num_kv_layers", "len(self.block_len_per_layer) == len(nixl_agent_meta.block_lens)",
                   "Number of KV layers must match between prefill and decode")

    def test_ranks_lay_out_regions_alike(self) -> None:
        """P rank 1 lists its layers' regions in another order than rank 0: raised before rank 1's NIXL add."""
        p = side("P", 4, 3000, layers=2)
        names = p.geometry.region_layers()[::-1]
        swapped = {"region_names": names, "region_members": [[n] for n in names]}
        io = mem_io(V034, p, override={1: swapped})
        o = run_rank(V034, p, side("D", 2, 3000, layers=2), 0, io=io)
        assert_raise(o, "regions_alike", "The TP ranks of engine P lay out their KV regions differently.")
        assert (o.handshake, o.remote_rank, len(io.added)) == (2, 1, 1)
        # 0.31 adds rank 1's agent first and then fails the validation on the region names
        io = mem_io(V031, p, override={1: swapped})
        o = run_rank(V031, p, side("D", 2, 3000, layers=2), 0, io=io)
        assert (o.check, o.assert_expr, len(io.added)) == ("region_names", "nixl_agent_meta.region_names == "
                                                           "expected_names", 2)

    def test_region_metadata_lengths(self) -> None:
        p = side("P", 2, 3000)
        bl = p.geometry.block_len
        io = mem_io(V034, p, override={0: {"block_strides": [bl]}})
        o = run_rank(V034, p, side("D", 2, 3000), 0, io=io)
        assert_raise(o, "region_metadata_lengths", "Engine P advertised KV region metadata of different lengths.")
        assert io.added == []  # before the NIXL add
        # 0.30 - 0.33 assert it at the end of the validation
        o = run_rank(V031, p, side("D", 2, 3000), 0, io=mem_io(V031, p, override={0: {"block_strides": [bl]}}))
        assert_bare(o, "block_strides_len", "len(nixl_agent_meta.block_strides) == num_remote_regions")

    def test_block_strides(self) -> None:
        p = side("P", 2, 3000)
        bl = p.geometry.block_len
        o = run_rank(V034, p, side("D", 2, 3000), 0, io=mem_io(V034, p, override={0: {"block_strides": [bl, bl - 1]}}))
        assert_bare(o, "block_strides_ge", "all(stride >= block_len for stride, block_len in zip(nixl_agent_meta."
                    "block_strides, nixl_agent_meta.block_lens, strict=True))")
        io = mem_io(V034, p, override={0: {"block_strides": [2 * bl, 2 * bl]}})
        assert run_rank(V034, p, side("D", 2, 3000), 0, io=io).status == "ok"
        # 0.29 has block_strides on the wire but asserts nothing about them yet
        io = mem_io(resolve("0.29.0"), p, override={0: {"block_strides": [bl, bl - 1]}})
        assert run_rank(resolve("0.29.0"), p, side("D", 2, 3000), 0, io=io).status == "ok"

    def test_head_offsets_when_d_tp_exceeds_heads(self) -> None:
        """2 KV heads, P TP 1, D TP 4: D ranks 0,1 hold head 0 and 2,3 head 1 (per-rank head counts, 0.24+)."""
        p, d = side("P", 1, 3000, kv_heads=2), side("D", 4, 3000, kv_heads=2)
        for rel in PER_REGION:
            outs = run_all(rel, p, d)
            assert statuses(outs) == ["ok"] * 4
            bl = d.geometry.block_len
            assert [o.prepared[0].rank_offset for o in outs] == [0, 0, bl, bl]
        # 0.20 - 0.23 expect a tp_ratio-scaled block here and refuse P's 2-head block
        assert_msg(run_rank(V020, p, d, 0), "block_len_tp_ratio", EXPR_SHAPE_111, MSG_SHAPE_PAGE)
