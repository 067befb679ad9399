"""`probe` and `serve` for TensorRT-LLM against pdcheck's own fake ctx: `pdcheck serve --trtllm` starts real ctx
ranks and their info endpoint; `probe` reads it (REQUEST_INSTANCE_INFO only) and `handshake --prefill-endpoint`
runs real gen ranks against it, WRITEs and the row proof included; a hostile gen's frames leave it serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from test_hostile import contract, run
from test_live import Served, _alive, _descendants, serve

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tp2() -> Iterator[Served]:
    with serve("trt-tp2-to-tp1", "--trtllm", "W3", timeout=90) as s:
        yield s


def pdcheck(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdcheck", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_serve_ready_document(tp2):
    doc = tp2.doc
    assert (doc["command"], doc["framework"], doc["exit_code"], doc["era"]) == ("serve", "trtllm", None, "W3")
    assert doc["event"] == "ready" and doc["pid"] > 0  # the shape vLLM's and SGLang's ready documents share
    assert doc["info_endpoint"].startswith("tcp://127.0.0.1:") and (doc["tp_size"], doc["ctx_ranks"]) == (2, 2)


def test_probe_reads_the_ctx_read_only(tp2):
    r = pdcheck("probe", tp2.endpoint, "--trtllm", "auto", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["era"], rep["eras_alike"]) == ("W3", "W2a, W2b or W3")
    c = rep["ctx"]
    assert (c["tp_size"], c["pp_size"], c["layer_num_per_pp"], c["sender_endpoints"], c["kv_heads_per_rank"],
            c["tokens_per_block"], c["dims_per_head"], c["element_bytes"], c["dtypes"], c["num_slots"]) == (
        2, 1, [4], 2, 4, 16, 64, 2, ["bfloat16", "float16"], 16)
    assert rep["hazards"] == [] and any("the dtype is not on the wire" in n for n in rep["notes"])


def test_probe_hazards_against_a_gen_configuration(tp2):
    r = pdcheck("probe", tp2.endpoint, "--trtllm", "W3", "--scenario", "trt-tpb-mismatch", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1 == rep["exit_code"]
    assert rep["hazards"] == ["the ctx refuses a W3 gen at REGISTER_RANK_INFO and only logs it: AttentionPolicy: "
                              "incompatible: tokens_per_block mismatch; field='tokens_per_block', local=16, peer=32 "
                              "(T69)"]
    assert [v["status"] for v in rep["verdicts"]] == ["hang"]
    r = pdcheck("probe", tp2.endpoint, "--trtllm", "W1b", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and rep["hazards"][0].startswith("a W1b gen cannot decode this reply: TypeError: "
                                                               "InstanceInfo.__init__()")


def test_handshake_against_serve_writes_and_proves(tp2):
    r = pdcheck("handshake", "--trtllm", "W3", "--decode-tp", "4", "--prefill-endpoint", tp2.endpoint, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    assert doc["matrix"] == {"W3": ["ok"] * 4} and doc["corrected"] == []
    for v in doc["verdicts"]:
        assert v["proof"] == {"status": "ok", "blocks": 768, "wrong": 0, "asserts_stripped": None}


def test_a_hostile_gen_leaves_serve_serving(tp2):
    """Frames a real ctx would choke on: an identity alone, unknown types, foreign maps, garbage; then a valid
    handshake still works."""
    zctx = zmq.Context()
    try:
        info = zctx.socket(zmq.DEALER)
        info.connect(tp2.endpoint)
        info.send(b"REQUEST_INSTANCE_INFO")
        assert info.poll(30000)
        senders = msgspec.msgpack.decode(info.recv())["sender_endpoints"]
        for ep in senders:
            d = zctx.socket(zmq.DEALER)
            d.connect(ep)
            for frames in ([b"REGISTER_RANK_INFO", b"\xc1garbage"], [b"REQUEST_DATA", msgspec.msgpack.encode([1])],
                           [b"WHATEVER"], [b"REGISTER_RANK_INFO", msgspec.msgpack.encode({"tp_size": "2"})],
                           [b"REQUEST_DATA", msgspec.msgpack.encode({"sender_req_id": 1})], [b"x"] * 40):
                d.send_multipart(frames)
            d.close(linger=2000)
    finally:
        zctx.destroy(linger=2000)
    time.sleep(0.5)
    r = pdcheck("handshake", "--trtllm", "W3", "--decode-tp", "4", "--prefill-endpoint", tp2.endpoint, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["matrix"] == {"W3": ["ok"] * 4}, r.stderr


def test_a_w1b_gen_against_a_w3_ctx_fails_at_the_info_reply(tp2):
    r = pdcheck("handshake", "--trtllm", "W1b", "--decode-tp", "4", "--prefill-endpoint", tp2.endpoint, "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 1 and doc["matrix"] == {"W1b": ["error"] * 4} and doc["agree"]


def test_a_dtype_skew_against_serve_is_silent():
    with serve("trt-dtype-fp16-bf16", "--trtllm", "W3", timeout=90) as s:
        r = pdcheck("handshake", "trt-dtype-fp16-bf16", "--trtllm", "W3", "--prefill-endpoint", s.endpoint,
                    "--json")
    doc = json.loads(r.stdout)
    # the wire carries no dtype: pdcheck's gen takes the ctx for its own float16, and the proof finds bfloat16
    assert doc["matrix"] == {"W3": ["silent"]} and doc["verdicts"][0]["proof"]["status"] == "dtype"


def test_serve_stops_on_sigterm_and_reaps_every_rank():
    with serve("--trtllm", "W2b", "--prefill-tp", "4", timeout=90) as s:
        kids = _descendants(s.proc.pid)
        assert len(kids) >= 4
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 143
    assert not [k for k in kids if _alive(k)]
    assert b"ctx rank 3: 0 WRITE(s)" in s.err


@pytest.mark.parametrize(("args", "code", "says"), [
    (("probe", "127.0.0.1", "--trtllm", "W3"), 2, "is not HOST:PORT"),
    (("probe", "http://127.0.0.1:5", "--trtllm", "W3"), 2, "a TensorRT-LLM info endpoint is tcp://HOST:PORT"),
    (("probe", "127.0.0.1:5", "--trtllm", "E3"), 2, "runs the C++ transceiver"),
    (("serve", "--trtllm", "E4"), 2, "serve fakes the Python ctx"),
    (("serve", "--trtllm", "W1b,W3"), 2, "serve speaks one era"),
    (("probe", "127.0.0.1:9", "--trtllm", "W3", "--timeout", "1"), 3, "no reply within 1000 ms"),
])
def test_probe_and_serve_bad_input_and_nothing_listening(args, code, says):
    r = run(*args, limit_s=60)
    contract(r, code, within_s=60, says=says)


def test_ctrl_c_while_gens_wait_on_a_live_ctx_leaves_nothing_running(tp2):
    """The gens wait on a ctx that refused them (only logged): a live ctx cannot go quiet for pdcheck, so they wait
    their hang window; Ctrl-C to the process group ends the run with 130 and reaps every rank."""
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "handshake", "--trtllm", "W3", "--decode-block-size",
                             "32", "--prefill-endpoint", tp2.endpoint, "--hang-timeout", "60"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(_comm(k).startswith("pdcheck-gen")
                                                      for k in _descendants(proc.pid)):
            time.sleep(0.1)
        time.sleep(1.0)  # the gens have sent their requests and wait
        kids = _descendants(proc.pid)
        assert kids, "no rank started"
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err
    assert not [k for k in kids if _alive(k)]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""
