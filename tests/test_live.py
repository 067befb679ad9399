"""probe, serve and handshake --prefill-endpoint: real processes on both ends (pdcheck serve as the live P)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from portkit import free_run, refusing

from pdcheck.vllm.live import kills_listener
from pdcheck.vllm.probe import agent_name, parse_endpoint
from pdcheck.vllm.wire import FORMATS

ROOT = Path(__file__).resolve().parent.parent
SCEN = ROOT / "scenarios"
ENV = dict(os.environ, PYTHONPATH=str(ROOT))

# One release per wire era A-H.
ERAS = {"A": "0.9.0", "B": "0.9.1", "C": "0.9.2", "D": "0.10.1", "E": "0.11.0", "F": "0.11.1", "G": "0.13.0",
        "H": "0.26.0"}


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], doc: dict) -> None:
        self.proc, self.doc = proc, doc
        self.err = b""

    @property
    def endpoint(self) -> str:
        """Where a client reaches it: TensorRT-LLM's info endpoint, else vLLM's side channel."""
        return self.doc.get("info_endpoint") or f"{self.doc['host']}:{self.doc['base_port']}"


@contextmanager
def serve(*args: str, timeout: float = 60) -> Iterator[Served]:
    """`pdcheck serve ... --json`; the first stdout line is the ready document. Stopped with SIGTERM."""
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "serve", *args, "--json"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    served: Served | None = None
    try:
        line = _readline(proc, timeout)
        assert line, f"serve printed no ready line: {proc.stderr.read().decode() if proc.poll() is not None else ''}"
        served = Served(proc, json.loads(line))
        assert served.doc["event"] == "ready"
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            _out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _out, err = proc.communicate()
        if served is not None:
            served.err = err


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return got[0] if got else b""


def pdcheck(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdcheck", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def probe_json(endpoint: str, *args: str) -> tuple[int, dict]:
    r = pdcheck("probe", endpoint, "--json", *args)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, json.loads(r.stdout)


# ---------------------------------------------------------------------------------------------- every era
@pytest.mark.parametrize("era", list(ERAS))
def test_probe_reads_serve_in_every_era(era):
    release = ERAS[era]
    with serve("--prefill-tp", "2", "--prefill-blocks", "3008,2992", "--decode-blocks", "3000", "--kv-heads", "4",
               "--head-dim", "64", "--vllm", release) as s:
        assert s.doc["wire"] == era
        listeners = [e["port"] for e in s.doc["endpoints"]]
        base = s.doc["base_port"]
        # per-worker eras: rank r on base + r; F-H: one scheduler port answering both ranks
        assert listeners == ([base, base + 1] if era <= "E" else [base])
        for _attempt in range(2):  # an F-H listener must survive the probe: ask it twice
            code, rep = probe_json(s.endpoint, "--vllm", release, "--tp-size", "2")
            assert code == 0, rep
            assert rep["verdict"] == "ok" and rep["wire"] == era
            ranks = rep["prefill_ranks"]
            assert [r["tp_rank"] for r in ranks] == [0, 1]
            assert [r["num_blocks"] for r in ranks] == [3008, 2992]
            assert all(r["status"] == "ok" and r["engine_id"] == "prefill-engine" for r in ranks)
            assert [r["agent_name"] for r in ranks] == ["prefill-engine-p0", "prefill-engine-p1"]
            assert all(r["reply_ms"] > 0 for r in ranks)
            assert rep["num_blocks_spread"] == {"min": 2992, "max": 3008, "mode": 3008, "differing": [1]}
            if era >= "F":
                assert [r["device_id"] for r in ranks] == [0, 1] and all(r["block_size"] == 16 for r in ranks)
            if era in ("G", "H"):
                assert all(r["compat_hash"] == s.doc["compat_hash"] for r in ranks)
            if era == "B":
                assert all(r["tp_size"] == 2 for r in ranks)
    assert s.proc.returncode == 143  # SIGTERM, as every command (README exit codes)
    log = s.err.decode()
    assert "died" not in log
    assert log.count("-> reply") == 4, log  # every request answered is logged, one line each


# ------------------------------------------------------------------------- handshake against a live P
@pytest.fixture(scope="module")
def hetero_serve() -> Iterator[Served]:
    with serve(str(SCEN / "hetero-d4-p2.toml"), "--vllm", "0.9.1") as s:
        yield s


def test_handshake_prefill_endpoint_against_serve(hetero_serve):
    r = pdcheck("handshake", str(SCEN / "hetero-d4-p2.toml"), "--vllm", "0.9.1", "--prefill-endpoint",
                hetero_serve.endpoint, "--json")
    assert "Traceback" not in r.stderr, r.stderr
    rep = json.loads(r.stdout)
    # the same verdicts as against pdcheck's own fake P (the scenario's [expect])
    assert rep["matrix"] == {"0.9.1": ["ok", "ok", "assert", "assert"], "corrected": ["ok"] * 4}
    assert r.returncode == 1
    live = rep["live"]
    assert live["endpoint"] == hetero_serve.endpoint and live["prefill_wire"] == "B"
    assert [p["num_blocks"] for p in live["probe"]] == [3008, 2992]
    assert live["content"].startswith("verified")
    for d in rep["decode_ranks"]:
        t = d["transfer"]["corrected"]
        assert t["status"] == "ok" and t["blocks"] > 0 and t["wrong"] == 0
    # 0.9.1 with asserts stripped reads P rank 1 with P rank 0's stride: serve's tags show the wrong blocks
    assert rep["decode_ranks"][2]["transfer"]["0.9.1"]["wrong"] > 0


def test_probe_hazards_equal_handshake_hazards(hetero_serve):
    sc = str(SCEN / "hetero-d4-p2.toml")
    hs = pdcheck("handshake", sc, "--vllm", "0.9.1", "--no-transfer", "--json")
    code, rep = probe_json(hetero_serve.endpoint, "--vllm", "0.9.1", "--tp-size", "2", "--scenario", sc)
    assert code == 1 and rep["verdict"] == "hazard"
    expected = json.loads(hs.stdout)["hazards"]
    assert rep["hazards"] == expected
    assert {h["id"] for h in expected if h["applies"]} >= {"H01", "H03"}


def test_serve_logs_requests_and_notifications(hetero_serve):  # last user of the module's serve: stops it
    pdcheck("handshake", str(SCEN / "hetero-d4-p2.toml"), "--vllm", "0.9.1", "--prefill-endpoint",
            hetero_serve.endpoint, "--json")
    hetero_serve.proc.send_signal(signal.SIGTERM)
    _out, err = hetero_serve.proc.communicate(timeout=30)
    log = err.decode()
    assert "NIXL notification from decode-tp4-d0: 'req-0:2'" in log  # 0.9.1's "{req}:{tp_ratio}" notification
    line = next(x for x in log.splitlines() if "-> reply" in x)
    assert "era B" in line and "peer " in line and "request 'get_meta_msg'" in line
    assert "tp_rank 0" in log and "tp_rank 1" in log and "bytes" in line


@pytest.mark.parametrize("release", ["0.26.0"])
def test_probe_hazards_equal_handshake_hazards_later_eras(release):
    sc = str(SCEN / "seed-19338-tp8.toml")
    hs = pdcheck("handshake", sc, "--vllm", release, "--no-transfer", "--json")
    with serve(sc, "--vllm", release, "--tag-blocks", "16") as s:
        code, rep = probe_json(s.endpoint, "--vllm", release, "--tp-size", "8", "--scenario", sc)
    # uneven counts, but one handshake per D rank: the hazards apply, the release survives (as in handshake)
    assert code == hs.returncode == 0 and rep["decode_status"] == ["ok"] * 8
    assert [r["num_blocks"] for r in rep["prefill_ranks"]] == [111680, *[111488] * 5, 112448, 111488]
    assert rep["hazards"] == json.loads(hs.stdout)["hazards"]


def test_handshake_live_content_not_checkable_without_tags():
    with serve(str(SCEN / "decode-fewer-blocks.toml"), "--vllm", "0.10.0", "--tag-blocks", "0") as s:
        r = pdcheck("handshake", str(SCEN / "decode-fewer-blocks.toml"), "--vllm", "0.10.0", "--prefill-endpoint",
                    s.endpoint, "--json")
    rep = json.loads(r.stdout)
    assert "not checkable" in rep["live"]["content"]
    statuses = {t["status"] for d in rep["decode_ranks"] for t in d["transfer"].values()}
    assert statuses == {"arrived"}
    assert all(t["bytes"] > 0 for d in rep["decode_ranks"] for t in d["transfer"].values())


# ------------------------------------------------------------------------------ wrong era, garbage, dead
def test_wrong_era_reply_is_a_verdict_and_the_listener_lives_on():
    with serve("--prefill-blocks", "64", "--decode-blocks", "64", "--vllm", "0.11.1") as s:
        # a 0.13 probe sends the same (msg, rank) tuple as 0.11.1, so the F listener survives it
        code, rep = probe_json(s.endpoint, "--vllm", "0.13.0", "--tp-size", "1")
        assert code == 1 and rep["verdict"] == "unreadable"
        r0 = rep["prefill_ranks"][0]
        assert r0["status"] == "wrong_era" and r0["era_seen"] == "F"
        assert "NixlHandshakePayload" in r0["message"]
        code, rep = probe_json(s.endpoint, "--vllm", "0.11.1", "--tp-size", "1")
        assert code == 0 and rep["prefill_ranks"][0]["num_blocks"] == 64


def test_two_frame_era_against_one_frame_p():
    with serve("--prefill-blocks", "64", "--decode-blocks", "64", "--vllm", "0.10.1") as s:
        code, rep = probe_json(s.endpoint, "--vllm", "0.26.0", "--tp-size", "1")
    r0 = rep["prefill_ranks"][0]
    assert code == 1 and r0["status"] == "wrong_era" and r0["era_seen"] == "D"
    assert "len(reply_parts) == 2" in r0["message"]


def test_garbled_reply_is_a_verdict():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def answer() -> None:  # a peer that answers every request with bytes that are not msgpack metadata
        while not stop.is_set():
            if sock.poll(50):
                ident, _e, _msg = sock.recv_multipart()
                sock.send_multipart([ident, b"", b"\xc1\x00garbage"])

    t = threading.Thread(target=answer)
    t.start()
    try:
        code, rep = probe_json(f"127.0.0.1:{port}", "--vllm", "0.9.2", "--tp-size", "1")
    finally:
        stop.set()
        t.join()
        ctx.destroy(0)
    r0 = rep["prefill_ranks"][0]
    assert code == 1 and r0["status"] == "garbled" and r0["era_seen"] is None
    assert "not NIXL metadata" in r0["message"]


def test_dead_endpoint_is_a_clear_error_within_the_timeout():
    with refusing() as port:  # for the probe's whole run
        t0 = time.monotonic()
        r = pdcheck("probe", f"127.0.0.1:{port}", "--vllm", "0.26.0", "--timeout", "0.5")
    assert r.returncode == 3
    assert "no reply from 127.0.0.1" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 15  # interpreter start-up plus the 0.5 s timeout


def test_probe_bad_input_exits_2():
    r = pdcheck("probe", "localhost", "--vllm", "0.9.2")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr and "Traceback" not in r.stderr
    r = pdcheck("probe", "127.0.0.1:5600", "--vllm", "auto")
    assert r.returncode == 2 and "needs --version-url" in r.stderr and "no order of trial requests" in r.stderr


# -------------------------------------------------------------------------------------------- serve life
def test_serve_exits_cleanly_on_sigterm_and_reaps_every_rank():
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "serve", "--prefill-tp", "2", "--prefill-blocks",
                             "128", "--vllm", "0.26.0", "--json"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        doc = json.loads(_readline(proc, 60))
        kids = _descendants(proc.pid)
        assert len(kids) >= 2  # the forkserver and the rank processes
        assert doc["kv_transfer_params"]["remote_port"] == doc["base_port"]
        assert doc["kv_transfer_params"]["tp_size"] == 2
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert b"stopping (SIGTERM)" in err and b"Traceback" not in err
    deadline = time.monotonic() + 5
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in kids if _alive(k)]
    with socket.socket() as s:  # the scheduler port is free again
        s.bind(("127.0.0.1", doc["base_port"]))


def test_serve_fixed_port_layout_per_worker_era():
    base = free_run(3)
    with serve("--prefill-tp", "3", "--prefill-blocks", "64", "--vllm", "0.9.2", "--port", str(base)) as s:
        assert [e["port"] for e in s.doc["endpoints"]] == [base, base + 1, base + 2]
        assert s.doc["kv_transfer_params"]["remote_port"] == base
        assert s.doc["kv_transfer_params"]["remote_engine_id"] == "prefill-engine"


# ------------------------------------------------------------------------------------------- pure logic
def test_kills_listener_matches_reference():
    f = FORMATS
    assert kills_listener(f["C"], f["H"]) is None  # A-E reply to anything
    assert kills_listener(f["F"], f["G"]) is None  # same (msg, rank) tuple
    assert "DecodeError" in kills_listener(f["H"], f["C"])  # raw bytes: msgpack trailing characters
    assert "ValueError" in kills_listener(f["H"], f["G"])  # 2-tuple into a 3-way unpack
    assert "ValueError" in kills_listener(f["G"], f["H"])


def test_agent_name_and_endpoint_parsing():
    blob = b"nixlSerDes|Agent" + (5).to_bytes(8, "little") + b"abc-1|Conns..."
    assert agent_name(blob) == "abc-1"
    assert agent_name(b"garbage") is None
    assert parse_endpoint("[::1]:5600") == ("::1", 5600)
    assert parse_endpoint("10.0.0.2:5557") == ("10.0.0.2", 5557)


# ------------------------------------------------------------------------------------- --vllm auto, TP guard
def test_probe_auto_reads_the_release_out_of_band():
    with serve("--prefill-tp", "2", "--prefill-blocks", "96", "--vllm", "0.26.0", "--api-port", "0") as s:
        url = s.doc["version_url"]
        assert url.endswith("/version")
        code, rep = probe_json(s.endpoint, "--vllm", "auto", "--version-url", url, "--tp-size", "2")
        assert code == 0 and rep["release"] == "0.26.0" and rep["wire"] == "H" and rep["release_source"] == url
        assert [r["num_blocks"] for r in rep["prefill_ranks"]] == [96, 96]
    log = s.err.decode()
    assert "GET /version" in log and "died" not in log
    assert log.count("-> reply") == 2  # nothing but the two era-H requests reached the side channel


def test_probe_never_asks_a_rank_the_scheduler_lacks():
    # TP 2 with 8 KV heads: rank 0's block holds 4 heads, so TP is 2; --tp-size 4 would ask rank 2 and kill
    # the 0.13 listener (KeyError). The probe asks 2 ranks, and the listener still answers afterwards.
    with serve("--prefill-tp", "2", "--prefill-blocks", "64", "--kv-heads", "8", "--vllm", "0.13.0") as s:
        code, rep = probe_json(s.endpoint, "--vllm", "0.13.0", "--tp-size", "4", "--decode-blocks", "64",
                               "--kv-heads", "8")
        assert [r["tp_rank"] for r in rep["prefill_ranks"]] == [0, 1]
        assert any("kills its listener" in n for n in rep["notes"])
        code, rep = probe_json(s.endpoint, "--vllm", "0.13.0", "--tp-size", "2")
        assert code == 0 and rep["verdict"] == "ok"
    assert "died" not in s.err.decode()


def test_live_p_is_never_sent_a_request_that_kills_its_listener():
    sc = str(SCEN / "cross-release-listener-death.toml")  # prefill.vllm = 0.11.1
    with serve(sc) as s:
        assert s.doc["release"] == "0.11.1"
        r = pdcheck("handshake", sc, "--vllm", "0.11.0,0.11.1", "--prefill-endpoint", s.endpoint, "--json")
        rep = json.loads(r.stdout)
        assert "0.11.0" in rep["live"]["skipped"] and "DecodeError" in rep["live"]["skipped"]["0.11.0"]
        assert rep["matrix"] == {"0.11.1": ["ok", "ok"], "corrected": ["ok", "ok"]}
        assert r.returncode == 0
        code, _rep = probe_json(s.endpoint, "--vllm", "0.11.1", "--tp-size", "2")  # still alive
        assert code == 0
    assert "died" not in s.err.decode()


def test_kv_transfer_params_keys_per_release():
    from pdcheck.vllm.releases import resolve
    from pdcheck.vllm.scenario import load
    from pdcheck.vllm.serve import transfer_params

    sc = load(None, {"prefill": {"num_blocks": 64, "tp_size": 2}, "decode": {"num_blocks": 64}})
    p34 = transfer_params(sc, resolve("0.34.0"), "10.0.0.5", 5600, 4096)
    # key for key as 0.34's pull scheduler returns them
    assert list(p34) == ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                         "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                         "remote_num_tokens", "remote_blocks_expiry_time", "remote_registration_generation",
                         "transfer_mode"]
    assert p34["remote_block_ids"] == [[0, 1, 2, 3]] and p34["remote_num_tokens"] == 64 and p34["tp_size"] == 2
    p091 = transfer_params(sc, resolve("0.9.1"), "h", 1, 2)
    assert "tp_size" not in p091 and p091["remote_block_ids"] == [0, 1]
    assert "remote_num_tokens" not in transfer_params(sc, resolve("0.20.0"), "h", 1, 4096)


def test_handshake_live_flags_only_discovers_per_worker_ranks():
    with serve("--prefill-tp", "2", "--prefill-blocks", "80,72", "--vllm", "0.10.1") as s:
        r = pdcheck("handshake", "--decode-tp", "2", "--decode-blocks", "72", "--vllm", "0.10.1",
                    "--prefill-endpoint", s.endpoint, "--hang-timeout", "1", "--json")
    rep = json.loads(r.stdout)
    assert [p["num_blocks"] for p in rep["live"]["probe"]] == [80, 72]  # ranks found without --prefill-tp
    assert any("2 P rank(s) found" in n for n in rep["live"]["notes"])
    assert rep["matrix"] == {"0.10.1": ["ok", "ok"], "corrected": ["ok", "ok"]}
    assert all(d["transfer"]["0.10.1"]["status"] == "ok" for d in rep["decode_ranks"])


def test_serve_takes_prefill_base_port_and_its_vllm_wins_over_the_scenarios():
    """--prefill-base-port lays out the ports as --port does, and --vllm replaces the scenario's prefill.vllm
    (here 0.11.1, one scheduler port of era F) for the listeners too, not only for the ready document."""
    sc = SCEN / "cross-release-listener-death.toml"
    base = free_run(2)
    with serve(str(sc), "--prefill-tp", "2", "--prefill-blocks", "64", "--vllm", "0.9.2",
               "--prefill-base-port", str(base)) as s:
        assert s.doc["release"] == "0.9.2" and s.doc["wire"] == "C"
        assert [e["port"] for e in s.doc["endpoints"]] == [base, base + 1]  # per-worker era: one port per rank
        r = pdcheck("probe", f"127.0.0.1:{base}", "--vllm", "0.9.2", "--tp-size", "2", "--json")
        assert r.returncode == 0, r.stderr
        assert [p["num_blocks"] for p in json.loads(r.stdout)["prefill_ranks"]] == [64, 64]
