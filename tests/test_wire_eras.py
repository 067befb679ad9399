"""Wire eras over real ZMQ sockets, the cross-era decode matrix (reference §3.6), and a real cross-release pair."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from portkit import free_run

from pdcheck.sidechannel import Listener, fetch
from pdcheck.vllm.wire import FORMATS, WireError, encode_reply, encode_request, strict_decode

VALUES = dict(engine_id="eng-P", agent_metadata=b"\x00AGENT", kv_caches_base_addr=[1, 2], num_blocks=111680,
              tp_size=8, block_len=4096, block_lens=[4096, 4096], block_strides=[4096, 4096],
              attn_backend_name="FLASH_ATTN", kv_cache_layout="HND", device_id=3, block_size=16, ssm_sizes=(0, 0),
              physical_blocks_per_logical_kv_block=1)
REQUEST_HEX = {"raw": "6765745f6d6574615f6d7367", "tp": "92c40c6765745f6d6574615f6d736703",
               "pp_tp": "93c40c6765745f6d6574615f6d73670003"}


@pytest.mark.parametrize("era", list(FORMATS))
def test_fake_p_answers_same_era_d_over_a_real_socket(era):
    fmt = FORMATS[era]
    assert encode_request(fmt, 3).hex() == REQUEST_HEX[fmt.request]  # reference §3.2
    ctx = zmq.Context()
    try:
        lst = Listener(ctx, "127.0.0.1", free_run(), fmt,
                       lambda rank: encode_reply(fmt, {**VALUES, "num_blocks": 1000 + (rank or 0)}, "h" * 64))
        import threading

        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                if not lst.handle():
                    stop.wait(0.001)

        t = threading.Thread(target=serve)
        t.start()
        frames = fetch(ctx, "127.0.0.1", lst.port, fmt, 3, 3000)
        stop.set()
        t.join()
        lst.close()
        assert len(frames) == fmt.reply_frames
        if fmt.reply_frames == 2:
            assert isinstance(msgspec.msgpack.decode(frames[1]), float)
        meta, h = strict_decode(fmt, frames, "h" * 64 if fmt.wrapped else None)
        assert meta.num_blocks == (1000 if fmt.request == "raw" else 1003)  # F-H look the rank up
        assert (h == "h" * 64) == fmt.wrapped
    finally:
        ctx.destroy(0)


# Reference §3.6: row = P era, column = D's strict decoder; None = OK, else the missing field.
MATRIX = {
    "A": {"A": None, "B": "tp_size", "C": "block_len", "D": "block_len", "E": "block_lens", "F": "device_id"},
    "B": {"A": None, "B": None, "C": None, "D": "kv_cache_layout", "E": "block_lens", "F": "device_id"},
    "C": {"A": None, "B": "tp_size", "C": None, "D": "kv_cache_layout", "E": "block_lens", "F": "device_id"},
    "D": {"A": None, "B": "tp_size", "C": None, "D": None, "E": "block_lens", "F": "device_id"},
    "E": {"A": None, "B": "tp_size", "C": "block_len", "D": "block_len", "E": None, "F": "device_id"},
    "F": {"A": None, "B": "tp_size", "C": "block_len", "D": "block_len", "E": None, "F": None},
}


@pytest.mark.parametrize("p_era", list(MATRIX))
def test_cross_era_decode_matrix_matches_reference(p_era):
    frames = encode_reply(FORMATS[p_era], VALUES)
    for d_era, missing in MATRIX[p_era].items():
        if missing is None:
            assert strict_decode(FORMATS[d_era], frames)[0].num_blocks == 111680
        else:
            with pytest.raises(WireError) as exc:
                strict_decode(FORMATS[d_era], frames)
            assert exc.value.exc_type == "msgspec.ValidationError" and f"`{missing}`" in exc.value.message
    with pytest.raises(WireError) as exc:  # every pre-G payload read by a 0.13+ D
        strict_decode(FORMATS["G"], frames)
    assert "Failed to decode NixlHandshakePayload" in exc.value.message and "compatibility_hash" in exc.value.message


def test_g_payload_read_by_pre_g_d_misses_engine_id():
    frames = encode_reply(FORMATS["G"], VALUES, "h" * 64)
    for d_era in "ABCDEF":
        with pytest.raises(WireError) as exc:
            strict_decode(FORMATS[d_era], frames)
        assert "`engine_id`" in exc.value.message


def test_real_cross_release_pair_kills_the_listener(pdcheck, tmp_path):
    # A 0.11.1 P (scheduler listener, msgpack requests) and a 0.11.0 D (raw b"get_meta_msg" to base + rank).
    sc = tmp_path / "x.toml"
    p_base, d_base = free_run(2), free_run(2)
    sc.write_text(f'vllm = ["0.11.0"]\n[prefill]\nengine_id = "P"\ntp_size = 2\nnum_blocks = 64\nbase_port = {p_base}\n'
                  f'vllm = "0.11.1"\n[decode]\nengine_id = "D"\ntp_size = 2\nnum_blocks = 64\nbase_port = {d_base}\n')
    run = pdcheck("handshake", str(sc), "--json", "--hang-timeout", "1", "--no-transfer")
    assert run.code == 1, run.err
    doc = run.json()
    v = [d["verdicts"]["0.11.0"]["status"] for d in doc["decode_ranks"]]
    assert v == ["hang", "hang"]  # D0's raw request killed P's listener; D1's port has no listener at all
    assert "DecodeError" in (doc["prefill_ranks"][0]["listener_died"] or "")
