"""TensorRT-LLM's wire codecs: each era's maps and frames round-trip, decode as strictly as TensorRT-LLM's
`cls(**map)` (docs/trtllm-protocol.md T13), fail across eras with the exception each era raises, and, on any bytes
at all, raise only WireError (a fake rank logs it; a live peer's is exit 3), never anything else (hypothesis)."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcheck.netio import PeerError
from pdcheck.trtllm import cppwire, wire
from pdcheck.trtllm.layout import Side, view_of
from pdcheck.trtllm.maps import Req as TReq
from pdcheck.trtllm.maps import WireError, id_bytes, ids_of

PY = ("W1a", "W1b", "W2a", "W2b", "W3", "corrected")
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


TP2 = Side(tp_size=2)


def facts(side: Side = TP2, rank: int = 1) -> wire.Facts:
    return wire.Facts(instance_name="inst", rank=rank, view=view_of(side, rank, 0x7F0000000000), pp_size=side.pp_size,
                      sender_endpoints=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], self_endpoint="tcp://127.0.0.1:3",
                      blob=b"nixl-blob", dtype=side.dtype)


@pytest.mark.parametrize("era", PY)
def test_rank_info_round_trips_every_field_the_ctx_uses(era):
    f = facts()
    peer = wire.decode_rank_info(era, wire.rank_info(era, f))
    assert (peer.instance_name, peer.rank, peer.blob, peer.self_endpoint) == ("inst", 1, b"nixl-blob",
                                                                             "tcp://127.0.0.1:3")
    v, want = peer.view, f.view
    assert (v.tp_size, v.tp_rank, v.kv_heads_per_rank, v.tokens_per_block, v.dims_per_head, v.element_bytes,
            v.base_address, v.slot_bytes) == (2, 1, want.kv_heads_per_rank, 16, 64, 2, want.base_address,
                                              want.slot_bytes)


@pytest.mark.parametrize("era", PY)
def test_the_info_reply_per_era(era):
    peer = wire.decode_info_reply(era, wire.info_reply(era, facts()))
    assert peer.sender_endpoints == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"] and peer.view.tp_size == 2
    first = msgspec.msgpack.decode(wire.info_reply(era, facts()))
    assert list(first)[:2] == (["instance_name", "tp_size"] if era in ("W1a", "W1b") else
                               ["instance_name", "instance_rank"])  # InstanceInfo (T32) or RankInfo (T33)


def test_w3_rank_info_bytes_are_trtllms_map():
    doc = msgspec.msgpack.decode(wire.rank_info("W3", facts()))
    assert list(doc) == ["instance_name", "instance_rank", "tp_size", "tp_rank", "pp_size", "pp_rank",
                         "layer_num_per_pp", "sender_endpoints", "server_endpoint", "self_endpoint",
                         "transfer_engine_info", "dp_size", "dp_rank", "cp_size", "cp_rank", "device_id", "attention",
                         "aux_meta", "page_table"]
    assert doc["attention"] == {"kv_heads_per_rank": 4, "tokens_per_block": 16, "dims_per_head": 64,
                                "element_bytes": 2, "enable_attention_dp": False, "is_mla": False}
    pool = doc["page_table"]["pool_groups"][0]["pools"][0]
    assert pool == {"base_address": 0x7F0000000000, "slot_bytes": 4 * 2 * 4 * 16 * 64 * 2, "num_slots": 16}
    assert doc["page_table"]["layer_groups"][0]["pool_views"][0]["buffer_entries"][:2] == [[0, 0, 8192],
                                                                                           [0, 8192, 8192]]


@pytest.mark.parametrize("era", PY)
@given(ids=st.lists(st.integers(min_value=0, max_value=(1 << 40)), max_size=64), rid=st.integers(0, 1 << 40))
@FAST
def test_recv_req_round_trips(era, ids, rid):
    req = TReq(sender_req_id=7, instance_name="g", instance_rank=3, block_ids=ids, unique_rid=rid)
    back = wire.decode_recv_req(era, wire.recv_req(era, req))
    assert (back.block_ids, back.unique_rid, back.sender_req_id, back.instance_rank) == (ids, rid, 7, 3)


def test_recv_req_keys_and_block_id_bytes_per_era():
    req = TReq(sender_req_id=1, instance_name="g", instance_rank=0, block_ids=[9, 2], unique_rid=5)
    w3 = msgspec.msgpack.decode(wire.recv_req("W3", req))
    assert list(w3) == ["sender_req_id", "instance_name", "instance_rank", "block_ids_per_layer_groups", "unique_rid",
                        "dst_start_token", "aux_slot", "slice_id", "bounce_dst_base"]
    assert w3["block_ids_per_layer_groups"] == [struct.pack("<qq", 9, 2)]
    assert msgspec.msgpack.decode(wire.recv_req("W1a", req))["unique_rid"] == "5"  # GenReqInfo's str id (T27)
    assert msgspec.msgpack.decode(wire.recv_req("W1b", req))["block_ids"] == [9, 2]


@pytest.mark.parametrize(("ctx", "gen", "raised"), [
    ("W2b", "W3", "TypeError: RecvReqInfo.__init__() got an unexpected keyword argument 'dst_start_token'"),
    ("W3", "W2b", "TypeError: RecvReqInfo.__init__() got an unexpected keyword argument 'start_token_idx'"),
    ("W1b", "W1a", "TypeError: RecvReqInfo.__init__() got an unexpected keyword argument 'ctx_req_id'"),
    ("W3", "W2a", "TypeError: RecvReqInfo.__init__() got an unexpected keyword argument 'start_token_idx'"),
])
def test_a_request_of_another_era_is_the_typeerror_that_era_raises(ctx, gen, raised):
    req = TReq(sender_req_id=1, instance_name="g", instance_rank=0, block_ids=[1], unique_rid=5)
    with pytest.raises(WireError) as exc:
        wire.decode_recv_req(ctx, wire.recv_req(gen, req))
    assert str(exc.value) == raised


def test_w3_decodes_int_lists_as_np_frombuffer_would_fail():
    with pytest.raises(WireError, match="a bytes-like object is required, not 'list'"):
        ids_of([[1, 2]], "W3")
    with pytest.raises(WireError, match="multiple of element size"):
        ids_of([b"\x01\x02\x03"], "W3")
    assert ids_of([id_bytes([-1, 5])], "W3") == [-1, 5]


@pytest.mark.parametrize("era", PY)
@pytest.mark.parametrize("status", ["SUCCESS", "FAILED"])
def test_result_frames_round_trip(era, status):
    r = wire.Result(2, 1001, True, status, 4096 if status == "SUCCESS" else 0)
    frames = wire.result_frames(era, r)
    want = {"W1a": 5, "W1b": 6, "W2a": 6, "W2b": 7 if status == "SUCCESS" else 6, "W3": 2, "corrected": 2}[era]
    assert len(frames) == want
    back = wire.decode_result(era, frames)
    assert (back.rid, back.last, back.status) == (1001, True, status)
    assert back.rank == (-1 if era == "W1a" else 2)


def test_w3_result_is_34_bytes_and_cross_era_results_fail():
    frames = wire.result_frames("W3", wire.Result(1, 2, True, "SUCCESS", 3))
    assert frames == [b"KV_AGENT_RESULT", struct.pack("<qqq?Bq", 1, 2, 0, True, 0, 3)] and len(frames[1]) == 34
    with pytest.raises(WireError, match="unpack requires a buffer of 34 bytes"):
        wire.decode_result("W3", wire.result_frames("W2b", wire.Result(1, 2, True, "SUCCESS", 3)))
    with pytest.raises(WireError, match="UnicodeDecodeError|not enough values"):
        wire.decode_result("W2b", frames)
    with pytest.raises(WireError, match="unknown message type"):
        wire.decode_result("W1b", frames)


@pytest.mark.parametrize("era", PY)
@given(data=st.binary(max_size=4096))
@FAST
def test_any_bytes_decode_or_raise_wireerror_only(era, data):
    for decode in (wire.decode_rank_info, wire.decode_info_reply, wire.decode_recv_req):
        try:
            decode(era, data)
        except WireError:
            pass


MSGPACK = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=20) |
                       st.binary(max_size=20),
                       lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                                   max_size=6), max_leaves=30)


@pytest.mark.parametrize("era", ("W1b", "W3"))
@given(tweak=st.dictionaries(st.sampled_from(["tp_size", "tp_rank", "pp_rank", "layer_num_per_pp",
                                              "sender_endpoints", "attention", "page_table", "kv_ptrs",
                                              "transfer_engine_info", "instance_name"]), MSGPACK, min_size=1,
                             max_size=3))
@FAST
def test_wrong_typed_or_out_of_bounds_values_are_wireerror(era, tweak):
    doc = msgspec.msgpack.decode(wire.rank_info(era, facts()))
    doc.update({k: v for k, v in tweak.items() if k in doc})
    try:
        wire.decode_rank_info(era, msgspec.msgpack.encode(doc))
    except WireError:
        pass


def test_bounds_are_named_for_a_live_peer():
    doc = msgspec.msgpack.decode(wire.rank_info("W3", facts()))
    doc["tp_size"] = 100000
    with pytest.raises(WireError, match="tp_size = 100000"):
        wire.decode_rank_info("W3", msgspec.msgpack.encode(doc), "ctx's reply")
    doc["tp_size"], doc["sender_endpoints"] = 2, ["x"] * 100000
    with pytest.raises(WireError, match="sender_endpoints"):
        wire.decode_rank_info("W3", msgspec.msgpack.encode(doc))
    assert issubclass(PeerError, Exception)


# ------------------------------------------------------------------------------------------------- C++
def test_t60_sync_notification_bytes():
    raw = cppwire.sync("gen_1_0", 7)
    assert raw == bytes.fromhex("0100000000000000" "0700000000000000") + b"gen_1_0" + bytes.fromhex("07000000")
    assert len(raw) == 27 and cppwire.decode(raw) == (1, ("gen_1_0", 7))
    assert cppwire.decode(cppwire.ready("a", 3, False)) == (2, ("a", 3, False))


def test_request_and_buffer_round_trip():
    from pdcheck.trtllm.checks import cache_state

    r = cppwire.RequestAndBuffer(agent="gen0", address="127.0.0.1:0", request_id=7001, cache_state=cache_state(Side()),
                                 descs=[cppwire.MemoryDesc(1 << 40, 131072, 0)], metadata=b"md", valid_idx=0)
    assert cppwire.decode(cppwire.request(r)) == (0, r)


@given(data=st.binary(max_size=512))
@FAST
def test_any_notification_bytes_decode_or_raise_wireerror_only(data):
    try:
        cppwire.decode(data)
    except WireError:
        pass
    huge = struct.pack("<QQ", 1, 1 << 40)  # a sync whose name claims a terabyte
    with pytest.raises(WireError, match="at most"):
        cppwire.decode(huge)
