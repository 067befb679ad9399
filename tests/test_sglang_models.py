"""The SGLang release models, frames, bootstrap table and verdict engine (pure logic), one test per failure
class of the reference's §11, per release, with the exact texts the releases raise."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from pdcheck.errors import BadInput
from pdcheck.sglang import bootstrap as bs
from pdcheck.sglang import wire
from pdcheck.sglang.engine import Side, corrected, decide, decide_all
from pdcheck.sglang.releases import MODELLED, resolve, resolve_many

R = {m.tag: m for m in MODELLED}
D0 = wire.DFacts("127.0.0.1", 5555, "agent-d0", b"META", [0x1000, 0x2000], [0x3000], 0, 1, 0, 4096)
REQ = wire.Request(7, [1, 2, 3], 0)


def test_resolve_names_and_ranges() -> None:
    assert [m.tag for m in resolve_many("all")] == ["R1", "R2", "R3", "R4", "R5", "R5a", "R5b", "R5c", "R5d", "R6",
                                                    "R7"]
    assert resolve("0.5.8").tag == "R5" and resolve("0.5.10").tag == "R5b" and resolve("0.5.10").name == "0.5.10"
    assert resolve("0.5.12.post1").tag == "R5d" and resolve("0.5.13").tag == "R6"
    assert resolve("0.4.6.post1").tag == "R1" and resolve("0.4.9").tag == "R3"
    for bad in ("0.3.0", "1.0.0", "latest", "0.5"):
        with pytest.raises(BadInput):
            resolve(bad)


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_each_era_parses_its_own_frames(rel) -> None:
    parsed = [wire.decode(rel, f) for f in wire.encode(rel, D0, REQ)]
    assert isinstance(parsed[-1], wire.Transfer) and parsed[-1].pages == [1, 2, 3] and parsed[-1].room == 7
    reg = parsed[0] if rel.split_registration else parsed[0].inline
    assert reg.kv_ptrs == D0.kv_ptrs and reg.agent_metadata == b"META"
    if rel.wire in ("E4", "E5", "E5r", "E5s", "E6"):
        assert (reg.decode_tp_size, reg.decode_tp_rank, reg.item_len) == (1, 0, 4096)


def test_frame_counts_per_era() -> None:
    n = {m.wire: [len(f) - (1 if m.guard else 0) for f in wire.encode(m, D0, REQ)] for m in MODELLED}
    assert n == {"E1": [9], "E2": [11], "E3": [8, 7], "E4": [11, 7], "E5r": [12, 8], "E5s": [14, 9],
                 "E5": [17, 9], "E6": [24, 10]}


# (D era, P era) -> the exception P's bootstrap thread dies on (reference §5.2; 0.5.8 -> 0.5.13 read from the
# 0.5.13 wheel: the state list at #7 is unpacked before the IndexError at #11 could happen)
SKEW = [("R3", "R4", "IndexError: list index out of range"),
        ("R5", "R6", "struct.error: unpack requires a buffer of 4 bytes"),
        ("R5", "R7", "IndexError: list index out of range"),  # 0.5.23 reads msg[11] before the state list
        ("R6", "R5", "ValueError: invalid literal for int() with base 10: ''"),
        ("R1", "R2", "AssertionError: First message should be b'NixlMsgGuard'. Foreign traffic?"),
        ("R2", "R1", "ValueError: invalid literal for int() with base 10: 'NixlMsgGuard'")]


@pytest.mark.parametrize(("d", "p", "text"), SKEW)
def test_frame_skew_kills_p_listener(d, p, text) -> None:
    with pytest.raises(Exception) as ei:
        for frames in wire.encode(R[d], D0, REQ):
            wire.decode(R[p], frames)
    assert wire.death(ei.value) == text
    # Across bootstrap eras D already stops at GET /route (another query, another answer), before any frame.
    if R[d].bootstrap != R[p].bootstrap:
        assert decide(R[p], R[d], Side(), Side(), 0).stage == "bootstrap"


@pytest.mark.parametrize(("d", "p"), [("R2", "R3"), ("R3", "R2")])
def test_frame_skew_within_one_bootstrap_era(d, p) -> None:
    """0.4.7 and 0.4.9 share the bootstrap (B2) but not the frames: P's listener dies, D waits forever."""
    v = decide(R[p], R[d], Side(), Side(), 0)
    assert v.status == "hang" and v.stage == "register" and v.listener_dead and v.timeout_s is None


def test_later_era_extra_frames_are_ignored() -> None:
    for frames in wire.encode(R["R4"], D0, REQ):  # R4 D -> R3 P: the trailing frames are ignored
        assert wire.decode(R["R3"], frames) is not None
    for frames in wire.encode(R["R7"], D0, REQ):  # R7 D -> R6 P: 24 registration frames, E5 reads 17
        assert wire.decode(R["R6"], frames) is not None


def test_foreign_traffic_and_none_aux_index() -> None:
    with pytest.raises(AssertionError, match="Foreign traffic"):
        wire.decode(R["R4"], [b"GET / HTTP/1.1"])
    frames = wire.encode(R["R4"], D0, wire.Request(7, [1], None))[1]
    with pytest.raises(ValueError, match="'None'"):
        wire.decode(R["R4"], frames)
    e6 = wire.encode(R["R7"], D0, REQ)[0]
    e6[19] = struct.pack("Q", 1)  # one per-entry item length for two pointers
    with pytest.raises(ValueError, match="dst_kv_item_lens length mismatch: got 1, expected 2"):
        wire.decode(R["R7"], e6)


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_page_size_mismatch(rel) -> None:
    v = decide(rel, rel, Side(page_size=16), Side(page_size=32), 0)
    if rel.tag >= "R5":  # 0.5.8+ (R5, R5a - R5d, R6, R7)
        assert (v.status, v.exception) == ("error", "RuntimeError")
        assert v.message == ("Page size mismatch: prefill server has page_size=16, but decode server has "
                             "page_size=32. Both servers must use the same --page-size value.")
    else:  # D allocates 2 pages of 32 for P's 4 of 16: P's add_transfer_request asserts, writes nothing
        assert (v.status, v.stage, v.timeout_s) == ("hang", "transfer", None)
        assert "AssertionError: assert len(chunked_dst_kv_indice) == len(kv_indices)" in v.message
    assert corrected(Side(page_size=16), Side(page_size=32)).status == "error"
    # D's page smaller: D offers 8 pages for P's 4; no assert (P pairs its 4 with D's first 4), P's own item length
    v = decide(rel, rel, Side(page_size=32), Side(page_size=16, num_pages=128), 0)
    if rel.tag >= "R5":
        assert (v.status, v.exception) == ("error", "RuntimeError")
    else:
        assert v.status == "silent" and "kv_item_len" in v.message


def test_d_allocates_by_its_own_page_size_and_p_asserts_until_0_5_12() -> None:
    from pdcheck.sglang.engine import d_pages_for

    assert d_pages_for(Side(page_size=16), Side(page_size=32), 4) == 2
    assert d_pages_for(Side(page_size=16), Side(page_size=8), 4) == 8
    assert d_pages_for(Side(page_size=16), Side(page_size=48), 4) == 2  # 64 tokens: a partly filled last page
    assert [r.page_count_assert for r in MODELLED] == [True] * 8 + [False] * 3  # to 0.5.11
    # a 0.5.13 P (its transfer worker truncates to D's pages) under a 0.5.3 D that checks nothing: it writes
    from msgspec.structs import replace

    v = decide(R["R6"], replace(R["R6"], checks=()), Side(page_size=16), Side(page_size=32), 0)
    assert v.status == "silent" and v.warning == "len(chunked_dst_kv_indice) = 2, len(kv_chunk.prefill_kv_indices) = 4"


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_kv_dtype_mismatch(rel) -> None:
    v = decide(rel, rel, Side(kv_cache_dtype="fp8_e4m3", dtype="fp8"), Side(), 0)
    if rel.tag >= "R5b":  # 0.5.10+
        assert v.status == "error" and v.message == (
            "KV cache dtype mismatch: prefill server has kv_cache_dtype=fp8_e4m3, but decode server has "
            "kv_cache_dtype=auto. Both servers must use the same --kv-cache-dtype value.")
    else:
        assert v.status == "silent"


def _post_fixed(rel):  # type: ignore[no-untyped-def]
    """The release with its post-release fixes where a later rule would drown in its bug (0.5.12 -> 0.5.12.post1)."""
    return resolve(f"{rel.name}.post1") if rel.aux_needs_state else rel


def test_0_5_12_sends_no_aux_without_a_state() -> None:
    # read in the 0.5.12 wheel's nixl/conn.py transfer worker: the aux WRITE and `{room}_aux` sit inside `if
    # kv_chunk.is_last and kv_chunk.state_indices:`; 0.5.12.post1 has `if kv_chunk.is_last:`. D's is_done needs aux.
    v = decide(resolve("0.5.12"), resolve("0.5.12"), Side(), Side(), 0)
    assert (v.status, v.stage) == ("hang", "completion") and "received_aux" in v.message, v
    assert decide(resolve("0.5.12"), resolve("0.5.12"), Side(hybrid=True), Side(hybrid=True), 0).status == "ok"
    assert decide(resolve("0.5.12.post1"), resolve("0.5.12.post1"), Side(), Side(), 0).status == "ok"
    assert [r.name for r in MODELLED if r.aux_needs_state] == ["0.5.12"]


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_head_dim_and_layers_never_checked(rel) -> None:
    rel = _post_fixed(rel)  # 0.5.12's aux bug hangs every case: these rules run on 0.5.12.post1
    assert decide(rel, rel, Side(head_dim=128), Side(head_dim=64, num_pages=128), 0).status == "silent"
    v = decide(rel, rel, Side(layers=3), Side(layers=2), 0)
    assert v.status == "hang"  # P fails in its transfer and D is not told; 0.5.23: P's bootstrap thread dies
    assert (v.listener_dead == "ValueError: NIXL PD transfer: decode registered fewer KV regions (4) than prefill "
            "(6); unexpected geometry") == (rel.tag == "R7"), v
    assert decide(rel, rel, Side(layers=2), Side(layers=3), 0).status == "silent"


EXPECT_P_GT_D = {"R1": "silent", "R2": "assert", "R3": "assert", "R4": "ok", "R5": "hang", "R6": "ok", "R7": "ok",
                 # 0.5.9 - 0.5.12 still key the kv notification by pp_rank (#19043, fixed in 0.5.13)
                 "R5a": "hang", "R5b": "hang", "R5c": "hang", "R5d": "hang"}


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_hetero_tp_p_gt_d(rel) -> None:
    rel = _post_fixed(rel)  # 0.5.12's aux bug hangs every case: these rules run on 0.5.12.post1
    v = decide(rel, rel, Side(tp_size=2), Side(tp_size=1), 0)
    assert v.status == EXPECT_P_GT_D[rel.tag]
    if v.status == "assert":
        assert v.message == "PD with different TP sizes per DP rank is not yet supported for non-MLA models"
    if v.status == "hang":
        assert v.timeout_s == 300.0 and "#19043" in v.message
    if rel.tag in ("R4", "R5"):
        assert v.warning == "Performance is NOT guaranteed when using different TP sizes for non-MLA models. "


def test_hetero_tp_gqa_offsets_and_mla() -> None:
    assert decide(R["R4"], R["R4"], Side(tp_size=4, kv_heads=2), Side(tp_size=2, kv_heads=2), 0).status == "silent"
    assert decide(R["R6"], R["R6"], Side(tp_size=4, kv_heads=2), Side(tp_size=2, kv_heads=2), 0).status == "ok"
    assert decide(R["R2"], R["R2"], Side(tp_size=2, mla=True), Side(tp_size=1, mla=True), 0).status == "ok"
    # 0.4.6: D rank 1 finds no P rank 1 (404 -> assert); P writes its 2x pages past D rank 0's registration
    assert [v.status for v in decide_all(R["R1"], R["R1"], Side(tp_size=1), Side(tp_size=2))] == ["hang", "assert"]


def test_pp_mismatch() -> None:
    v = decide(R["R5"], R["R5"], Side(pp_size=2), Side(pp_size=3), 0)
    assert v.status == "assert" and v.message == ("('Decode pp size (3) should be equal to prefill pp size (2) "
                                                  "or 1',)")
    assert decide(R["R4"], R["R4"], Side(pp_size=2), Side(pp_size=1), 0).status == "silent"  # #15027


def test_r1_last_chunk_bug() -> None:
    assert decide(R["R1"], R["R1"], Side(), Side(), 0, chunks=2).status == "silent"
    assert decide(R["R2"], R["R2"], Side(), Side(), 0, chunks=2).status == "ok"


def test_completion_skew_hangs() -> None:
    v = decide(R["R6"], R["R7"], Side(), Side(), 0)
    assert v.status == "hang" and v.stage == "completion" and v.timeout_s == 300.0


def test_strict_prefill_server_info() -> None:
    v = decide(R["R7"], R["R6"], Side(), Side(), 0)  # R7 P answers keys R6 D does not know
    # TypeError, logged; D's scheduler retries the fetch 15 times, then aborts the request
    assert (v.status, v.exception, v.timeout_s) == ("error", "KVTransferError", 14.0)
    assert "unexpected keyword argument 'enable_dsa_cache_layer_split'" in v.message
    v = decide(R["R5"], R["R6"], Side(), Side(), 0)  # an R5 server does not know R6's query parameters
    assert v.status == "error" and v.stage == "bootstrap" and "Missing inputs for bootstrap server." in v.message
    table = bs.Table(R["R6"], 1)
    with pytest.raises(bs.DiscoveryError, match=r"missing 1 required positional argument: 'follow_bootstrap_room'"):
        bs.discover(R["R6"], lambda q: (200, '{"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, '
                                        '"page_size": 16, "kv_cache_dtype": "auto"}'),
                    tp_rank=0, tp_size=1, pp_size=1, page_size=16, kv_cache_dtype="auto", mla=False)
    assert table.count == 0


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_query_before_all_p_ranks_registered(rel) -> None:
    table = bs.Table(rel, 2)
    q = {k: (1 if k in ("engine_rank", "target_tp_rank") else 0) for k in rel.rank_query}
    status, text = table.get(q)
    assert status == rel.not_ready_status
    if status == 503:
        assert text == "Prefill server not fully registered yet (0 workers registered)."
    v = decide(rel, rel, Side(tp_size=2), Side(tp_size=2), 1, registered=1)
    # 0.5.13+: the parallel-info fetch gets 503 until every P rank registered; D gives up after 15 attempts
    assert v.status == {"R1": "assert", "R2": "assert", "R3": "assert", "R4": "assert", "R5": "assert",
                        "R5a": "assert", "R6": "error", "R7": "error"}.get(rel.tag, "error")  # 0.5.10+: error


def test_bootstrap_missing() -> None:
    def nothing(_q: dict[str, int]) -> tuple[int, str]:
        return 0, "ConnectionRefusedError: [Errno 111] Connection refused"

    kw = dict(tp_rank=0, tp_size=1, pp_size=1, page_size=16, kv_cache_dtype="auto", mla=False)
    errs = {}
    for rel in MODELLED:
        with pytest.raises(bs.DiscoveryError) as ei:
            bs.discover(rel, nothing, **kw)
        errs[rel.tag] = ei.value.exc
    assert errs == {"R1": "AssertionError", "R2": "TypeError", "R3": "TypeError", "R4": "AttributeError",
                    "R5": "Failed", "R5a": "Failed", "R5b": "retry", "R5c": "retry", "R5d": "retry", "R6": "retry",
                    "R7": "retry"}
    # 0.5.13+: the decode scheduler's fetch of P's parallel info, 15 attempts 1 s apart, then the abort
    for tag in ("R6", "R7"):
        v = decide(R[tag], R[tag], Side(), Side(), 0, no_bootstrap=True)
        assert (v.status, v.stage, v.exception, v.timeout_s) == ("error", "bootstrap", "KVTransferError", 14.0)
        assert "Could not fetch prefill parallel info from 127.0.0.1:8998 after 15 attempts" in v.message
        assert v.message.endswith("with exception KVTransferError(bootstrap_room=7): Aborted by AbortReq.")


def test_put_missing_key_is_500() -> None:
    t = bs.Table(R["R4"], 1)
    assert t.put({"role": "Prefill"})[0] == 500
    body = bs.put_body(R["R4"], rank=0, tp=1, pp_rank=0, pp=1, ip="127.0.0.1", port=1, page_size=16,
                       kv_cache_dtype="auto", agent_name="a")
    assert t.put(body) == (200, "OK") and sorted(body) == sorted(R["R4"].put_keys)


def test_tracker_pp_and_engine_keys() -> None:
    t5 = wire.Tracker(R["R5"], required=2)
    for _ in range(2):
        t5.notif(wire.kv_notif(R["R5"], 7, 0, True, 0))
    t5.notif("7_aux")
    assert not t5.done()
    t6 = wire.Tracker(R["R6"], required=2)
    for rank in (0, 1):
        t6.notif(wire.kv_notif(R["R6"], 7, 0, True, rank))
    t6.notif("7_aux")
    assert t6.done()
    t7 = wire.Tracker(R["R7"])
    t7.status(wire.kv_status(7, "Failed", 0, "NIXL transfer encountered ERR room=7"))
    assert not t7.done() and t7.failed == "NIXL transfer encountered ERR room=7"


SG_SCENARIOS = sorted((Path(__file__).resolve().parent.parent / "scenarios" / "sglang").glob("*.toml"))


@pytest.mark.parametrize("path", SG_SCENARIOS, ids=lambda p: p.stem)
def test_bundled_sglang_scenario_matches_the_engine(path: Path) -> None:
    """Each bundled SGLang scenario names its issue, and the pure engine predicts its [expect] table (the
    real run in the smoke job must then agree with both)."""
    from pdcheck.sglang import plan as sp
    from pdcheck.sglang.scenario import load

    sc = load(path)
    assert sc.name == path.stem and sc.issue and sc.description and sc.expect
    plan = sp.build(sc, ",".join(sc.expect), sp.SgOptions())
    p, d = sc.prefill.side(), sc.decode.side()
    reg = sc.prefill.registered
    for pair in plan.pairs:
        want = sc.expect[pair.name]
        want = list(want) if isinstance(want, list) else [want] * d.tp_size
        got = [v.status for v in decide_all(pair.p, pair.d, p, d, registered=reg, no_bootstrap=sc.decode.no_bootstrap,
                                            fault=sc.transfer.fault, p_pages=len(plan.requests[0].p_pages))]
        assert got == want, f"{path.name} {pair.name}: {got} != {want}"


def test_scenario_bad_input() -> None:
    from pdcheck.sglang.scenario import load

    with pytest.raises(BadInput, match="not an SGLang scenario"):
        load(Path(__file__).resolve().parent.parent / "scenarios" / "mla.toml")
    with pytest.raises(BadInput, match="page_size"):
        load(None, {"prefill": {"page_size": 0}})
    with pytest.raises(BadInput, match="kv_heads 8 and tp_size 3"):
        load(None, {"prefill": {"tp_size": 3}})


LOG = ("[2026-01-23 10:00:00] INFO engine.py:154: server_args=ServerArgs(model_path='Qwen/Qwen3-8B', "
       "host='0.0.0.0', kv_cache_dtype='fp8_e4m3', page_size=32, tp_size=2, pp_size=1, dp_size=1, "
       "disaggregation_mode='prefill', disaggregation_transfer_backend='nixl', disaggregation_bootstrap_port=8998, "
       "json_model_override_args='{\"a\": 1}', lora_paths=None)")


def test_server_args_line(tmp_path: Path) -> None:
    from pdcheck.sglang import fromlogs

    args = fromlogs.server_args(LOG)
    assert args is not None and args["tp_size"] == 2 and args["json_model_override_args"] == '{"a": 1}'
    (tmp_path / "p.log").write_text("noise\n" + LOG + "\n")
    f = fromlogs.parse(tmp_path / "p.log", "prefill")
    assert f.side == {"tp_size": 2, "pp_size": 1, "page_size": 32, "kv_cache_dtype": "fp8_e4m3", "dtype": "fp8"}
    assert f.facts["disaggregation_bootstrap_port"] == 8998 and not f.notes
    assert fromlogs.parse(tmp_path / "p.log", "decode").notes  # the wrong mode is named
    (tmp_path / "x.log").write_text("vLLM log\n")
    with pytest.raises(BadInput, match="no 'server_args=ServerArgs"):
        fromlogs.parse(tmp_path / "x.log", "prefill")


# ---- failure classes beyond the handshake (reference §11): duplicate room, missing TransferInfo, prefill killed,
# aux buffer skew; each per release next to the corrected behaviour


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_duplicate_room(rel) -> None:
    rel = _post_fixed(rel)  # 0.5.12's aux bug hangs every case: these rules run on 0.5.12.post1
    v = decide(rel, rel, Side(), Side(), 0, fault="duplicate_room")
    assert v.status == "silent" and "A's pages are never written" in v.message
    then = {"R1": "again", "R2": "again", "R3": "KeyError: 7", "R4": "KeyError: 7", "R5": "KeyError: 7",
            "R5a": "KeyError: 7", "R5b": "KeyError: 7", "R5c": "KeyError: 7", "R5d": "assert room in self.transfer_infos",
            "R6": "assert room in self.transfer_infos", "R7": "returns None"}[rel.tag]
    assert then in v.message
    assert corrected(Side(), Side(), "duplicate_room").status == "error"


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_no_transfer_info_leaves_p_bootstrapping(rel) -> None:
    v = decide(rel, rel, Side(), Side(), 0, fault="no_transfer_info")
    assert (v.status, v.stage) == ("hang", "bootstrap")
    if rel.tag >= "R5b":  # 0.5.10+: the bootstrap timeout in common/conn.py
        assert v.timeout_s == 300.0 and "Request 7 timed out after 300s in KVPoll.Bootstrapping" in v.message
    else:
        assert v.timeout_s is None and "forever" in v.message
    assert ("P's scheduler blocks" in v.message) == (rel.tag == "R1")


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_prefill_killed_mid_transfer(rel) -> None:
    v = decide(rel, rel, Side(), Side(), 0, fault="kill_prefill")
    if rel.tag in ("R1", "R2", "R3"):  # no heartbeat, no waiting timeout
        assert (v.status, v.timeout_s) == ("hang", None)
        return
    assert v.status == "error" and v.timeout_s == 10.0 and "GET /health every 5 s fails 2 times" in v.message
    # decode.py's line exactly (str() of the exception: a KVTransferError names its room, the others their message)
    failed = "Decode transfer failed for request rank=0 decode_req.req.rid='<rid>' decode_req.req.bootstrap_room=7 "
    text = {"R4": "1 transfers affected; Transfer for room 7 failed due to node failure; " + failed
                  + "with exception Fake KVReceiver Exception",
            "R5": "1 transfers affected; Transfer for room 7 failed due to node failure; " + failed
                  + "with exception NIXL KVReceiver Exception",
            "R6": "1 requests affected; " + failed + "with exception KVTransferError(bootstrap_room=7): "
                  "Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:8998)",
            }
    # 0.5.9 - 0.5.12 as 0.5.8: the receiver's RuntimeError, no recorded reason
    assert (text["R6"] if rel.records_reason else text.get(rel.tag, text["R5"])) in v.message
    assert ("is healthy before, but now it is down" in v.message) == (rel.tag in ("R6", "R7"))


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_aux_buffer_skew(rel) -> None:
    rel = _post_fixed(rel)  # 0.5.12's aux bug hangs every case: these rules run on 0.5.12.post1
    more_d = decide(rel, rel, Side(aux_buffers=1), Side(aux_buffers=2), 0)
    more_p = decide(rel, rel, Side(aux_buffers=2), Side(aux_buffers=1), 0)
    both = decide(rel, rel, Side(aux_buffers=2), Side(aux_buffers=2), 0)
    if rel.tag in ("R1", "R2", "R3", "R4"):  # buffer 0 only (aux_item_lens[0])
        assert (more_d.status, more_p.status, both.status) == ("silent", "ok", "silent")
        assert "buffer 0 only" in more_d.message
    elif rel.aux_pairing == "decode_count":  # one per D pointer with P's item lengths (0.5.8 - 0.5.13)
        assert (more_d.status, more_d.timeout_s, more_p.status, both.status) == ("hang", 300.0, "ok", "ok")
        assert "IndexError: list index out of range" in more_d.message
    else:  # the shorter list, and an error log
        assert (more_d.status, more_p.status, both.status) == ("silent", "ok", "ok")
        assert more_p.warning.startswith("Decode <D agent> registered 1 metadata buffers but this prefill has 2; "
                                         "only the first 1 are transferred")
    assert corrected(Side(aux_buffers=1), Side(aux_buffers=2)).status == "error"


@pytest.mark.parametrize("rel", MODELLED, ids=lambda r: r.name)
def test_hybrid_state(rel) -> None:
    both = decide(rel, rel, Side(hybrid=True), Side(hybrid=True), 0)
    only_d = decide(rel, rel, Side(), Side(hybrid=True), 0)
    if rel.sends_state:  # 0.5.9+
        assert both.status == "ok"
        # 0.5.13 waits for the state notification; 0.5.23 completes by KV_STATUS without it
        assert (only_d.status, only_d.timeout_s) == ("hang", 300.0)
    else:
        assert both.status == only_d.status == "silent" and "KV + aux only" in both.message
    assert corrected(Side(), Side(hybrid=True)).status == "error"


def test_state_frames_round_trip() -> None:
    d = wire.DFacts("127.0.0.1", 5555, "agent-d0", b"META", [0x1000, 0x2000], [0x3000], 0, 1, 0, 4096,
                    [0x9000], 256)
    req = wire.Request(7, [1, 2], 0, state_indices=[3])
    for rel in (R["R5a"], R["R5c"], R["R5d"], R["R6"], R["R7"]):
        reg, t = (wire.decode(rel, f) for f in wire.encode(rel, d, req))
        assert reg.state_ptrs == [0x9000] and t.state_indices == [3]
    assert wire.decode(R["R5"], wire.encode(R["R5"], d, req)[1]).state_indices == []  # 0.5.8 sends none
    t = wire.Tracker(R["R6"], 1, expects_state=True)
    for n in (wire.kv_notif(R["R6"], 7, 0, True, 0), wire.aux_notif(7)):
        t.notif(n)
    assert not t.done()
    t.notif(wire.state_notif(7, 0))
    assert t.done()


@pytest.mark.parametrize("rel", MODELLED[1:], ids=lambda r: r.name)
def test_dp_conflict(rel) -> None:
    rel = _post_fixed(rel)  # 0.5.12's aux bug hangs every case: these rules run on 0.5.12.post1
    p = Side(dp_size=2)
    assert decide(rel, rel, p, Side(), 0).status == "ok"  # routed by the room: DP rank 7 % 2
    v = decide(rel, rel, p, Side(), 0, fault="dp_conflict")
    if rel.dp_conflict_check:  # 0.5.11+; the exception carries the reason from 0.5.13
        assert (v.status, v.exception) == ("error", "KVTransferError" if rel.records_reason else "RuntimeError")
        assert ("follow_bootstrap_room conflict: dispatched to dp_rank 0 but bootstrap_room 7 implies dp_rank 1. "
                "Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing.") in v.message
    else:
        assert v.status == "hang" and v.timeout_s == (300.0 if rel.tag >= "R5" else None)
    assert corrected(p, Side(), "dp_conflict").status == "error"


def test_dp_table_keys_per_era() -> None:
    for rel in MODELLED[1:]:
        t = bs.Table(rel, 2)
        for dp in range(2):
            assert t.put(bs.put_body(rel, rank=0, tp=1, pp_rank=0, pp=1, ip="127.0.0.1", port=7000 + dp,
                                     page_size=16, kv_cache_dtype="auto", agent_name="a", dp_rank=dp, dp=2))[0] == 200
        for room, port in ((10, 7000), (11, 7001)):
            found = bs.discover(rel, t.get, tp_rank=0, tp_size=1, pp_size=1, page_size=16, kv_cache_dtype="auto",
                                mla=False, room=room)
            assert found.targets == [(0, "127.0.0.1", port)], rel.name


def test_fault_bad_input(tmp_path: Path) -> None:
    from pdcheck.sglang import plan as sp
    from pdcheck.sglang.scenario import load

    def toml(text: str) -> Path:
        p = tmp_path / "s.toml"
        p.write_text('framework = "sglang"\n' + text)
        return p

    with pytest.raises(BadInput, match="transfer.fault"):
        load(toml('[transfer]\nfault = "meteor"\n'))
    with pytest.raises(BadInput, match="needs transfer.requests >= 2"):
        load(toml('[transfer]\nrequests = 1\nfault = "duplicate_room"\n'))
    with pytest.raises(BadInput, match="needs prefill.dp_size >= 2"):
        load(toml('[transfer]\nfault = "dp_conflict"\n'))
    with pytest.raises(BadInput, match="decode.dp_size"):
        load(toml('[decode]\ndp_size = 2\n'))
    with pytest.raises(BadInput, match="0.4.6.post1 has no DP mapping"):
        sp.build(load(toml('[prefill]\ndp_size = 2\n')), "0.4.6.post1", sp.SgOptions())
    assert [r.room for r in sp.make_requests(load(toml('[transfer]\nrequests = 3\nfault = "duplicate_room"\n')))] == [
        1000, 1000, 1002]
    with pytest.raises(BadInput, match="kill_prefill' is modelled for prefill.dp_size = 1"):
        load(toml('[prefill]\ndp_size = 2\n[transfer]\nfault = "kill_prefill"\n'))
