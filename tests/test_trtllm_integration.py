"""TensorRT-LLM on real ranks, one test per failure class: the real CLI starts fake ctx and gen processes (real ZMQ
sockets, real NIXL agents, real WRITEs), and each test asserts the evidence its class leaves: the exact wait that
hangs, the text a ctx logged, the rows the proof found, the ranks contacted. The bundled scenarios' whole
documents are held by tests/test_snapshots.py; these assert what each class is about."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_hostile import contract, run

ROOT = Path(__file__).resolve().parent.parent


def handshake(*args: str, timeout: float = 180) -> dict:
    r = subprocess.run([sys.executable, "-m", "pdcheck", "handshake", *args, "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    assert r.returncode == doc["exit_code"], r.stderr
    assert doc["harness_errors"] == [], doc["harness_errors"]
    assert doc["agree"], "the pure engine disagrees with the ranks"
    return doc


def line(doc: dict, name: str) -> dict:
    return next(x for x in doc["lines"] if x["name"] == name)


def test_compatibility_checks_per_era_and_where_they_run():
    doc = handshake("trt-tpb-mismatch", "--trtllm", "all")
    assert list(doc["matrix"]) == ["E1", "E2", "E3", "E4", "W1a", "W1b", "W2a", "W2b", "E5"]
    for cpp in ("E1", "E2", "E3", "E4"):  # the C++ gen refuses before any request (T61)
        v = line(doc, cpp)["observed"][0]
        assert (v["status"], v["stage"]) == ("error", "inquire")
        assert v["message"].startswith("Disagg server does not currently support these cacheState.")
    w1a = line(doc, "W1a")
    assert w1a["observed"][0]["status"] == "hang" and w1a["observed"][0]["timeout_ms"] is None
    assert w1a["ctx"][0]["listener_dead"].startswith("ValueError: PeerRegistrar.register: peer ")
    assert w1a["ctx"][0]["logs"][0] == "PeerRegistrar: tokens_per_block mismatch (local=16, peer=32)."
    for name in ("W2a", "W2b", "E5"):  # only logged on the ctx; the gen waits its 60 s (trtllm#12249)
        x = line(doc, name)
        assert x["observed"][0]["status"] == "hang" and x["observed"][0]["timeout_ms"] == 60000
        assert any(log.startswith("Sender: error handling REGISTER_RANK_INFO: PeerRegistrar.register")
                   for log in x["ctx"][0]["logs"]), x["ctx"]
    assert "AttentionPolicy: incompatible: tokens_per_block mismatch; field='tokens_per_block', local=16, peer=32" in \
        line(doc, "E5")["ctx"][0]["logs"]
    fixed = line(doc, "corrected")["observed"][0]
    assert fixed["status"] == "error" and fixed["exception"] == "PeerIncompatibleError"
    assert "is incompatible: tokens_per_block differs (ctx 16, gen 32)" in fixed["message"]
    assert doc["exit_code"] == 1 and doc["summary"].startswith("error: E1, E2, E3, E4 · hang: W1a, W1b, W2a, W2b, E5")


def test_a_same_size_dtype_passes_every_python_check_and_the_proof_shows_it():
    doc = handshake("trt-dtype-fp16-bf16")
    for name in ("W1b", "W3"):
        v = line(doc, name)["observed"][0]
        assert v["status"] == "silent" and v["proof"]["status"] == "dtype" and v["proof"]["found_dtype"] == "bfloat16"
        assert v["proof"]["wrong"] == v["proof"]["rows"] == 3 * 4 * 2 * 8 * 16
        assert "1.0 written as bfloat16 reads 1.875 as float16" in v["message"]
        assert line(doc, name)["ctx"][0]["writes"] == 1
    assert line(doc, "E3")["observed"][0]["message"].startswith("Disagg server does not currently support")
    assert "kv dtype differs (ctx bfloat16, gen float16)" in line(doc, "corrected")["observed"][0]["message"]


@pytest.mark.parametrize(("scenario", "contacted"), [
    ("trt-tp1-to-tp2", [[0], [0]]),
    ("trt-tp2-to-tp1", [[0, 1]]),
    ("trt-dup-heads", [[0, 1]]),
    ("trt-pp2-to-pp1", [[0, 1]]),
])
def test_heterogeneous_layouts_are_read_right_row_by_row(scenario, contacted):
    doc = handshake(scenario)
    for x in doc["lines"]:
        assert [v["contacted"] for v in x["observed"]] == contacted, x["name"]
        for v in x["observed"]:
            assert v["status"] == "ok" and v["proof"]["status"] == "ok" and v["proof"]["wrong"] == 0
            assert v["proof"]["rows"] == v["proof"]["arrived"] > 0
    if scenario == "trt-dup-heads":  # ctx ranks 1 and 3 answer SUCCESS without writing (T47)
        assert [c["writes"] for c in line(doc, "W3")["ctx"]] == [1, 0]


def test_an_unanswered_info_endpoint_blocks_the_gen_with_no_timeout():
    # a cap of an hour: the verdict is decided when the ranks go quiet, never by waiting for the cap
    doc = handshake("trt-info-silent", "--hang-timeout", "3600")
    for name in ("W1a", "W1b", "W3"):
        v = line(doc, name)["observed"][0]
        assert (v["status"], v["stage"], v["timeout_ms"]) == ("hang", "info", None)
        assert "Receiver._get_sender_info blocks in recv_multipart() on tcp://127.0.0.1:" in v["message"]
    assert line(doc, "corrected")["observed"][0]["status"] == "error"
    assert doc["seconds"] < 600


def test_a_ctx_that_dies_after_registering_leaves_the_gen_waiting_and_nothing_running():
    r = run("handshake", "trt-ctx-dies", "--json", limit_s=120)
    contract(r, 1, within_s=120, rss_mb=600)
    doc = json.loads(r.out)
    for name, stage in (("W1b", "transfer"), ("W3", "transfer"), ("E3", "ready")):
        x = line(doc, name)
        assert x["killed"] and (x["observed"][0]["status"], x["observed"][0]["stage"]) == ("hang", stage)
    assert line(doc, "W1b")["observed"][0]["timeout_ms"] is None
    assert line(doc, "W3")["observed"][0]["timeout_ms"] == 60000
    assert "Terminating generation request" in line(doc, "W3")["observed"][0]["message"]
    assert line(doc, "corrected")["observed"][0]["status"] == "error"


def test_a_lost_completion_after_the_write_hangs_with_the_bytes_already_there():
    doc = handshake("trt-completion-lost")
    for name in ("W2b", "W3", "E3", "E4"):
        v = line(doc, name)["observed"][0]
        assert v["status"] == "hang" and v["proof"]["status"] == "ok" and v["proof"]["wrong"] == 0
        assert "arrived right: only the" in v["message"]
    assert line(doc, "E4")["observed"][0]["stage"] == "completion"
    assert "trtllm#17665" in line(doc, "E4")["observed"][0]["message"]
    assert line(doc, "corrected")["observed"][0]["status"] == "ok"  # the completion travels with the WRITE


def test_an_unknown_message_type_ends_a_w1_listener():
    doc = handshake("trt-unknown-type")
    assert line(doc, "W1a")["ctx"][0]["listener_dead"] == (
        "ValueError: transceiver sender loop received unknown message type: REQUEST_RANK_INFO")
    assert line(doc, "W1b")["ctx"][0]["listener_dead"] == (
        "ValueError: Sender received unknown message type: b'REQUEST_RANK_INFO'")
    assert line(doc, "W3")["ctx"][0]["logs"] == ["Sender received unknown message type: b'REQUEST_RANK_INFO'"]
    assert doc["matrix"] == {"W1a": ["hang"], "W1b": ["hang"], "W3": ["ok"]}


def test_wire_and_agent_skew():
    doc = handshake("trt-wire-skew")
    assert line(doc, "W3")["ctx_line"] == "W2b" and line(doc, "W3")["ctx"][0]["logs"] == [
        "Sender: error handling REQUEST_DATA: RecvReqInfo.__init__() got an unexpected keyword argument "
        "'dst_start_token'"]
    assert line(doc, "W1b")["observed"][0]["message"].startswith(
        "TypeError: InstanceInfo.__init__() got an unexpected keyword argument 'instance_rank'")
    doc = handshake("trt-agent-skew")
    assert line(doc, "W3")["ctx"][0]["logs"][0].startswith("Sender: error handling REGISTER_RANK_INFO: "
                                                           "AgentDesc.deserialize")


def _scenario(tmp_path: Path, body: str) -> str:
    path = tmp_path / "s.toml"
    path.write_text('framework = "trtllm"\nname = "t"\n' + body)
    return str(path)


def test_a_block_id_past_the_pool_fails_the_write_on_the_ctx(tmp_path):
    doc = handshake(_scenario(tmp_path, 'trtllm = ["W3"]\n[request]\nfault = "block_id_oob"\n'))
    v = line(doc, "W3")["observed"][0]
    assert v["status"] == "error" and v["message"].startswith("KV transfer failed for request 1000 slice=0")
    assert "nixl_status=NIXL_ERR_NOT_FOUND" in line(doc, "W3")["ctx"][0]["logs"][0]
    assert "outside its 16 slots: refused" in line(doc, "corrected")["ctx"][0]["logs"][0]


def test_a_configured_transfer_timeout_is_modelled_not_waited(tmp_path):
    doc = handshake(_scenario(tmp_path, 'trtllm = ["W1b", "W3"]\n[gen]\ntokens_per_block = 32\n'
                                        'kv_transfer_timeout_ms = 600000\n'))
    assert [line(doc, n)["observed"][0]["timeout_ms"] for n in ("W1b", "W3")] == [600000, 600000]
    assert line(doc, "W3")["timeout"] == "kv_transfer_timeout_ms = 600000 (the scenario's [gen])"


def test_markdown_page_and_flags(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pdcheck", "handshake", "--trtllm", "E3,W3", "--prefill-tp", "1",
                        "--dtype", "bfloat16", "--format", "markdown"], cwd=ROOT, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    assert "every era survives" in r.stdout and "| W3 |" in r.stdout.replace("`", "")


@pytest.mark.parametrize(("args", "says"), [
    (("trt-tp1-to-tp2", "--trtllm", "E3"), "--trtllm: E3: the C++ path with different TP or PP"),
    (("trt-tpb-mismatch", "--trtllm", "2.0.0"), "--trtllm: TensorRT-LLM release '2.0.0' is not modelled"),
    (("trt-tpb-mismatch", "--device", "cuda"), "--device: not available for TensorRT-LLM"),
    (("trt-tpb-mismatch", "--vllm", "0.9.1"), "trt-tpb-mismatch.toml is a TensorRT-LLM scenario; use --trtllm"),
])
def test_bad_input_is_one_line(args, says):
    r = run("handshake", *args, limit_s=60)
    contract(r, 2, within_s=60, says=says)


def test_a_bad_scenario_key_is_one_line(tmp_path):
    r = run("handshake", _scenario(tmp_path, "[gen]\ntokens_per_blok = 3\n"), limit_s=60)
    contract(r, 2, within_s=60, says="gen.tokens_per_blok: unknown key; did you mean 'tokens_per_block'?")
