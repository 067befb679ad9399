"""Hostile peers and files: the contract for untrusted input (docs/reliability-untrusted.md).

Every case runs real processes: a hostile peer (a ZMQ ROUTER, a raw TCP server or an HTTP server, each its own
Python process) and the real pdcheck CLI. Each asserts the contract: the exit code, at most one error line and
no traceback, the child's peak RSS (wait4's rusage, the child and every process it reaped), the wall time
within the documented timeout, and nothing left running in the child's session.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from portkit import is_free

from pdcheck import bounds
from pdcheck.netio import MAX_FRAME_BYTES

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
MiB = 1 << 20

# A peer process: `python -c PEER KIND ARG`; prints its port on the first stdout line, then serves forever.
PEER = r'''
import json, socket, sys, time
kind, arg = sys.argv[1], sys.argv[2]
if kind.startswith("zmq"):
    import msgspec, zmq
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    doc = {"engine_id": "evil", "agent_metadata": b"x", "kv_caches_base_addr": [1, 2], "num_blocks": 100,
           "tp_size": 1, "block_len": 4096, "attn_backend_name": "FLASH_ATTN_VLLM_V1"}
    if kind == "zmq-meta":
        doc.update(json.loads(arg))
    if kind == "zmq-regions":
        doc["kv_caches_base_addr"] = list(range(int(arg)))
    body = msgspec.msgpack.encode(doc)
    while True:
        ident, _e, _msg = s.recv_multipart()
        if kind == "zmq-mute":
            continue
        if kind == "zmq-big":
            s.send_multipart([ident, b"", b"\x00" * int(arg)])
        elif kind == "zmq-frames":
            s.send_multipart([ident, b"", *([b"f"] * int(arg))])
        elif kind == "zmq-garbage":
            s.send_multipart([ident, b"", bytes(range(256)) * 4])
        else:
            s.send_multipart([ident, b"", body])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(16)
print(srv.getsockname()[1], flush=True)
HEAD = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n"
if kind.startswith("sg"):  # an SGLang bootstrap server: arg {"info": {...}, "rank": {...}} over 0.5.23's answers
    sg = json.loads(arg)
    info = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16,
            "kv_cache_dtype": "auto", "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
            "dsv41_spec_layout": None, "kv_layout": None, "decode_allocation_policy": "early",
            "enable_kv_cache_sharding": False, "prefill_http_port": None, "target_tp_rank": None,
            "target_tp_ranks": None, "target_cp_ranks": None, "target_pp_ranks": None,
            "required_dst_info_num": None, "required_prefill_response_num": None}
    info = sg["info"] if sg.get("replace") else {**info, **sg.get("info", {})}
    info = {k: v for k, v in info.items() if v != "<drop>"}
    rank = {k: v for k, v in {"rank_ip": "127.0.0.1", "rank_port": 9, **sg.get("rank", {})}.items() if v != "<drop>"}
while True:
    c, _ = srv.accept()
    try:
        if kind not in ("tcp-garbage",) and not kind.startswith("sg"):
            c.recv(65536)
        if kind.startswith("sg"):
            line = c.recv(65536).split(b"\r\n", 1)[0].decode()
            whole = "=-1" in line and "=0" not in line and "=1" not in line
            if kind == "sg-slow" and not whole:
                time.sleep(3)  # every rank answers, slowly
            body = json.dumps(info if whole else rank).encode()
            c.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        elif kind == "tcp-garbage":  # not ZMTP, not HTTP
            c.sendall(bytes(range(256)) * 64)
        elif kind == "http-junk":
            c.sendall(b"\x00\x01 garbage, not HTTP\r\n\r\n")
        elif kind == "http-trickle-head":
            for b in HEAD * 100:
                c.send(bytes([b]))
                time.sleep(0.5)
        elif kind == "http-trickle-body":
            c.sendall(HEAD + b"Content-Length: 100\r\n\r\n")
            for b in b'{"version": "0.11.1"}' + b" " * 79:
                c.send(bytes([b]))
                time.sleep(0.5)
        elif kind == "http-huge-length":
            c.sendall(HEAD + b"Content-Length: 1000000000000\r\n\r\n" + b" " * 65536)
        elif kind == "http-endless":  # no Content-Length, a body that never ends
            c.sendall(HEAD + b"\r\n")
            while True:
                c.sendall(b" " * 65536)
        elif kind == "http-never":
            time.sleep(3600)
        elif kind == "http-ok":
            body = json.dumps({"version": arg}).encode()
            c.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass
    finally:
        c.close()
'''


@contextmanager
def peer(kind: str, arg: object = "") -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", PEER, kind, str(arg)], stdout=subprocess.PIPE, env=ENV)
    try:
        line = proc.stdout.readline()
        assert line, f"peer {kind} did not start"
        yield int(line)
    finally:
        proc.kill()
        proc.wait()


@dataclass
class Result:
    code: int
    out: str
    err: str
    wall_s: float
    peak_rss_mb: float
    left: list[str]  # processes of the child's session still alive after it exited


# Forks and execs the command, then reports the child's peak RSS from wait4. A process forked from pytest
# itself would inherit pytest's high-water mark (exec keeps the larger of the old and new image's), so the
# fork happens in this small interpreter. Exit code: the child's, or 128 + the signal that ended it.
WRAP = r"""
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""


def run(*args: str, limit_s: float = 60.0, env: dict[str, str] | None = None) -> Result:
    """The real CLI in its own session, with its peak RSS (the child and everything it reaped) and wall time;
    env: the environment instead of ENV."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as rss:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", WRAP, rss.name, sys.executable, "-m", "pdcheck", *args],
                                cwd=ROOT, env=ENV if env is None else env, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        left = _session(proc.pid)
        peak = int(rss.read() or 0) / 1024
        return Result(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                      wall, peak, left)


def _session(sid: int) -> list[str]:
    alive = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: session id
            alive.append(d)
    return alive


def contract(r: Result, code: int, *, within_s: float, rss_mb: float = 200, says: str | None = None) -> None:
    """Exit code, one line on stderr with no traceback, wall time, peak RSS, nothing left running."""
    detail = f"exit {r.code}, {r.wall_s:.2f} s, {r.peak_rss_mb:.0f} MB; stderr: {r.err[-2000:]}"
    assert r.code == code, detail
    assert "Traceback" not in r.err, detail
    if code in (2, 3):
        assert len(r.err.strip().splitlines()) == 1, detail
        assert r.err.startswith("pdcheck: error: "), detail
    if says is not None:
        assert says in r.err + r.out, detail
    assert r.wall_s < within_s, detail
    assert r.peak_rss_mb < rss_mb, detail
    assert not r.left, f"left running: {r.left}"


# ------------------------------------------------------------------------------------- probe vs hostile peers
@pytest.mark.parametrize(("kind", "arg", "field"), [
    ("zmq-meta", {"tp_size": 70000}, "tp_size"),
    ("zmq-meta", {"tp_size": 1000000}, "tp_size"),
    ("zmq-meta", {"tp_size": -1}, "tp_size"),
    ("zmq-meta", {"num_blocks": -1}, "num_blocks"),
    ("zmq-meta", {"num_blocks": 2**62}, "num_blocks"),
    ("zmq-meta", {"engine_id": "e" * 100000}, "engine_id"),
    ("zmq-meta", {"block_len": 0}, "block_len"),
    ("zmq-regions", 5000, "kv_caches_base_addr"),
])
def test_probe_out_of_bounds_value_is_a_garbled_verdict_naming_it(kind, arg, field):
    with peer(kind, json.dumps(arg) if isinstance(arg, dict) else arg) as port:
        # The timeout only bounds a peer that does not answer; under load a fresh peer may take a while to.
        r = run("probe", f"127.0.0.1:{port}", "--vllm", "0.9.1", "--timeout", "3", "--json")
    contract(r, 1, within_s=15)
    rep = json.loads(r.out)
    assert len(rep["prefill_ranks"]) == 1  # never a loop over the peer's count
    r0 = rep["prefill_ranks"][0]
    assert r0["status"] == "garbled" and r0["out_of_bounds"].startswith(field), r0
    assert rep["verdict"] == "unreadable"


@pytest.mark.parametrize(("kind", "arg", "code", "says"), [
    ("zmq-big", 100 * MiB, 3, f"a frame over {MAX_FRAME_BYTES >> 20} MiB"),  # libzmq drops the peer: no reply
    ("zmq-frames", 10000, 1, "more than 4 frames"),
    ("zmq-garbage", "", 1, "not NIXL metadata"),
    ("zmq-mute", "", 3, "no reply"),
    ("tcp-garbage", "", 3, "no reply"),
])
def test_probe_survives_hostile_side_channels(kind, arg, code, says):
    with peer(kind, arg) as port:
        r = run("probe", f"127.0.0.1:{port}", "--vllm", "0.9.1", "--tp-size", "1", "--timeout", "2", "--json")
    contract(r, code, within_s=15, says=says)


def test_probe_advertised_ranks_stop_at_the_first_silent_port():
    # Era B advertises tp_size 64 (within bounds) but only rank 0 answers: one timeout, not 63.
    with peer("zmq-meta", json.dumps({"tp_size": 64})) as port:
        r = run("probe", f"127.0.0.1:{port}", "--vllm", "0.9.1", "--timeout", "1.5", "--json")
    contract(r, 1, within_s=15)
    ranks = json.loads(r.out)["prefill_ranks"]
    assert [x["status"] for x in ranks] == ["ok", "no_reply"]


# ----------------------------------------------------------------------------------------- --version-url
@pytest.mark.parametrize(("kind", "says"), [
    ("http-trickle-head", "no complete answer within 1 s"),
    ("http-trickle-body", "no complete answer within 1 s"),
    ("http-never", "no complete answer within 1 s"),
    ("http-junk", "not an HTTP answer"),
    ("tcp-garbage", "cannot read the release from"),  # bytes, then a reset before the request is read
    ("http-huge-length", "at most 65536 are read"),
    ("http-endless", "a body over 65536 bytes"),
])
def test_version_url_is_bounded_in_time_and_size(kind, says):
    with peer(kind) as port:
        r = run("probe", "127.0.0.1:1", "--vllm", "auto", "--version-url", f"http://127.0.0.1:{port}/version",
                "--timeout", "1")
    contract(r, 3, within_s=10, says=says)


def test_version_url_answer_is_used():
    with peer("http-ok", "0.9.1") as http, peer("zmq-meta", json.dumps({"tp_size": 1})) as port:
        r = run("probe", f"127.0.0.1:{port}", "--vllm", "auto", "--version-url", f"http://127.0.0.1:{http}/version",
                "--json")
    contract(r, 0, within_s=15)
    assert json.loads(r.out)["release"] == "0.9.1"


# ---------------------------------------------------------------------------------- --prefill-endpoint
@pytest.mark.parametrize(("arg", "field"), [
    ({"tp_size": 10000}, "tp_size"),
    ({"num_blocks": -1}, "num_blocks"),
    ({"num_blocks": 2**40}, "num_blocks"),
])
def test_prefill_endpoint_out_of_bounds_exits_3_in_one_line(arg, field):
    with peer("zmq-meta", json.dumps(arg)) as port:
        r = run("handshake", "--prefill-endpoint", f"127.0.0.1:{port}", "--vllm", "0.9.1", "--decode-blocks", "100",
                "--hang-timeout", "2")
    contract(r, 3, within_s=20, rss_mb=600, says=f"P rank 0: {field}:")


@pytest.mark.parametrize(("kind", "arg", "code"), [("zmq-big", 100 * MiB, 3), ("zmq-frames", 10000, 3),
                                                   ("zmq-mute", "", 3)])
def test_prefill_endpoint_against_hostile_frames(kind, arg, code):
    with peer(kind, arg) as port:
        r = run("handshake", "--prefill-endpoint", f"127.0.0.1:{port}", "--vllm", "0.9.1", "--prefill-tp", "1",
                "--decode-blocks", "100", "--hang-timeout", "2")
    contract(r, code, within_s=20, rss_mb=600)


# ------------------------------------------------------------------------------------ CLI numbers and forms
@pytest.mark.parametrize("args", [
    ("probe", "127.0.0.1:5600", "--vllm", "0.11.1", "--timeout", "nan"),
    ("probe", "127.0.0.1:5600", "--vllm", "0.11.1", "--timeout", "inf"),
    ("probe", "127.0.0.1:5600", "--vllm", "0.11.1", "--timeout", "1e300"),
    ("probe", "::1", "--vllm", "0.11.1"),
    ("probe", "[::1]", "--vllm", "0.11.1"),
    ("probe", "127.0.0.1:5600", "--vllm", "0.11.1", "--max-tp", "1000"),
    ("serve", "--prefill-blocks", "64", "--vllm", "0.9.1", "--duration", "nan"),
    ("serve", "--prefill-blocks", "64", "--vllm", "0.9.1", "--duration", "inf"),
    ("handshake", "--prefill-blocks", "64", "--decode-blocks", "64", "--vllm", "0.9.1", "--no-transfer",
     "--inject", "corrupt:P0:99:999999999"),
    ("handshake", "--prefill-blocks", "64", "--decode-blocks", "64", "--vllm", "0.9.1", "--no-transfer",
     "--inject", "corrupt:P0:0:64"),
    ("requests", "--vllm", "0.9.2", "--rate", "1e-300"),
    ("requests", "--vllm", "0.9.2", "--rate", "nan"),
    # output paths, before anything starts: a missing directory, a directory, a directory not writable
    ("requests", "--vllm", "0.9.2", "--plot", "/nonexistent-dir/x.png"),
    ("transfer-bench", "--plot", "/nonexistent-dir/x.png"),
    ("transfer-bench", "--plot", "/proc/x.png"),
    ("smoke", "tests/data", "--junit", "/nonexistent-dir/x.xml"),
    ("smoke", "tests/data", "--junit", "/tmp"),
    ("smoke", "tests/data", "--junit", "/proc/x.xml"),
])
def test_bad_numbers_and_forms_exit_2(args):
    contract(run(*args), 2, within_s=15, rss_mb=300)


@pytest.mark.parametrize("stdout", ["closed-pipe", "closed"])
def test_a_closed_stdout_keeps_the_runs_exit_code(stdout):
    """`pdcheck ... --json | head -c1`, or stdout closed: the run's own code (0 here), no traceback, nothing
    on stderr."""
    args = [sys.executable, "-m", "pdcheck", "handshake", "--prefill-blocks", "64", "--decode-blocks", "64",
            "--vllm", "0.9.2", "--no-transfer", "--json"]
    if stdout == "closed":
        proc = subprocess.run(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=120, preexec_fn=lambda: os.close(1))
    else:
        proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.read(1) == b"{"
        proc.stdout.close()  # the reader goes away before the rest of the document
        proc.stderr = proc.stderr.read()  # type: ignore[assignment]
        proc.wait(120)
    assert proc.returncode == 0, proc.stderr
    assert not proc.stderr, proc.stderr


def test_ipv6_endpoint_in_brackets_is_read_as_host_and_port():
    r = run("probe", "[::1]:1", "--vllm", "0.11.1", "--timeout", "0.2")
    contract(r, 3, within_s=15, says="no reply from [::1]:1 ")


# ---------------------------------------------------------------------------------------------- serve
def test_serve_survives_hostile_clients_and_exits_143_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "serve", "--prefill-blocks", "64", "--vllm", "0.9.1",
                             "--json"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        doc = json.loads(proc.stdout.readline())
        port = doc["base_port"]
        with socket.create_connection(("127.0.0.1", port)) as s:  # raw garbage, not ZMTP
            s.sendall(bytes(range(256)) * 256)
        import zmq

        ctx = zmq.Context()
        try:
            for frames in ([b"x" * (100 * MiB)], [b"f"] * 10000):  # an oversized frame, then 10,000 frames
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.connect(f"tcp://127.0.0.1:{port}")
                d.send_multipart([b"", *frames])
                time.sleep(0.3)
                d.close(0)
        finally:
            ctx.destroy(0)
        # still serving: a real probe reads it
        r = run("probe", f"127.0.0.1:{port}", "--vllm", "0.9.1", "--json")
        contract(r, 0, within_s=15)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err
    assert b"Traceback" not in err
    assert not _session(proc.pid)
    with socket.socket() as s:  # nothing left bound
        s.bind(("127.0.0.1", port))


# ---------------------------------------------------------------------------------------------- from-logs
SEED_LOG = ROOT / "tests" / "data" / "seed-19338-workers.log"


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


def test_from_logs_fifo_is_refused_before_reading(tmp):
    fifo = tmp / "f.log"
    os.mkfifo(fifo)
    contract(run("scenario", "from-logs", str(fifo), str(SEED_LOG)), 2, within_s=10, says="not a regular file")
    contract(run("scenario", "from-logs", str(SEED_LOG), str(fifo)), 2, within_s=10, says="not a regular file")


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null", "/tmp"])
def test_from_logs_devices_and_directories_are_refused(path):
    contract(run("scenario", "from-logs", path, str(SEED_LOG)), 2, within_s=10)


def test_from_logs_gzip_bomb_stops_at_the_line_cap(tmp):
    bomb = tmp / "bomb.log.gz"
    member = gzip.compress(b"x\n" * (1 << 19), 9)  # 1 MiB of short lines in ~1 KiB
    with open(bomb, "wb") as f:
        for _ in range(1024):  # concatenated members: 1 GiB inflated, ~1 MiB on disk
            f.write(member)
    assert bomb.stat().st_size < 2 * MiB
    r = run("scenario", "from-logs", str(bomb), str(SEED_LOG))
    contract(r, 2, within_s=30, rss_mb=150, says=f"more than {bounds.MAX_LOG_LINES} lines after gzip inflation")
    print(f"gzip bomb: {r.wall_s:.2f} s, peak RSS {r.peak_rss_mb:.0f} MB")


def test_from_logs_one_huge_line_is_cut_not_held(tmp):
    log = tmp / "oneline.log"
    with open(log, "wb") as f:
        f.truncate(300 * MiB)  # sparse: 300 MiB of NUL bytes, no newline
    r = run("scenario", "from-logs", str(log), str(SEED_LOG))
    contract(r, 2, within_s=30, rss_mb=150, says="no num_blocks")  # read through, nothing found, bounded
    print(f"300 MiB single line: {r.wall_s:.2f} s, peak RSS {r.peak_rss_mb:.0f} MB")


def test_from_logs_over_the_byte_cap_is_refused(tmp):
    log = tmp / "big.log"
    with open(log, "wb") as f:
        f.truncate(bounds.MAX_LOG_BYTES + 1)  # sparse
    r = run("scenario", "from-logs", str(log), str(SEED_LOG))
    contract(r, 2, within_s=30, rss_mb=150, says=f"more than {bounds.MAX_LOG_BYTES >> 20} MiB")


def test_from_logs_200mb_log_is_streamed(tmp):
    """A 200 MB log (the seed log's start-up, then ~200 MB of request lines) reads with bounded memory."""
    log = tmp / "p.log"
    line = (b"INFO 01-02 03:04:05 [logger.py:43] Received request cmpl-0123456789abcdef: prompt: 'hello', "
            b"params: SamplingParams(n=1, temperature=0.0)\n")
    block = line * ((8 * MiB) // len(line))
    with open(log, "wb") as f:
        f.write(SEED_LOG.read_bytes())
        for _ in range(25):
            f.write(block)
    assert log.stat().st_size > 200 * 10**6
    r = run("scenario", "from-logs", str(log), str(SEED_LOG), "--json")
    contract(r, 0, within_s=60, rss_mb=150)
    assert json.loads(r.out)["scenario"]["prefill"]["num_blocks"]
    print(f"200 MB log: {r.wall_s:.2f} s, peak RSS {r.peak_rss_mb:.0f} MB")


def test_from_logs_corrupt_gzip_is_one_line(tmp):
    bad = tmp / "bad.log.gz"
    bad.write_bytes(gzip.compress(SEED_LOG.read_bytes())[:200])  # truncated
    contract(run("scenario", "from-logs", str(bad), str(SEED_LOG)), 2, within_s=10, says="not a readable gzip")


# ------------------------------------------------------------------------------------------- /dev/shm, ports
def test_leaked_ucx_segments_are_removed_and_nothing_else(tmp, monkeypatch):
    """remove_leaked_segments removes a new segment nobody holds, and keeps one that existed before the run and
    one a live process (another run's rank, here a sleeper) holds open, as UCX's creator does until it unlinks.
    In a directory of its own: in /dev/shm an unheld segment is garbage any run's cleanup rightly removes, and
    other runs (tests side by side) would take this test's stand-ins before it looks."""
    from pdcheck import launcher

    shm = tmp / "shm"
    shm.mkdir()
    monkeypatch.setattr(launcher, "SHM_DIR", str(shm))
    tag = f"{os.getpid():x}{time.monotonic_ns() & 0xffffff:x}"
    old, leaked, held = (Path(launcher.SHM_DIR) / f"{launcher.UCX_SHM_PREFIX}{k}{tag}" for k in ("o", "l", "h"))
    old.write_bytes(b"x")
    before = launcher.ucx_segments()
    leaked.write_bytes(b"x")
    held.write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print(1, flush=True); "
                               "time.sleep(60)", str(held)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline()
        removed = launcher.remove_leaked_segments(before)
        assert removed == [leaked.name]
        assert old.exists() and held.exists() and not leaked.exists()
    finally:
        holder.kill()
        holder.wait()
        for p in (old, leaked, held):
            p.unlink(missing_ok=True)


def test_layout_ports_are_held_before_any_rank_starts():
    """An explicit base port inside the ephemeral range: the parent binds every layout port before forking a rank,
    so no rank's UCX listener or connection can take one (the issue's 64 x 64 run collided 3 times in 4)."""
    from pdcheck.vllm import drive as orc
    from pdcheck.vllm.ports import plan_ports
    from pdcheck.vllm.releases import resolve
    from pdcheck.vllm.scenario import load

    lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())

    def layout(base: int):  # type: ignore[no-untyped-def]
        sc = load(None, {"prefill": {"tp_size": 4, "num_blocks": 64, "base_port": base},
                         "decode": {"tp_size": 8, "num_blocks": 64}})
        return plan_ports(sc, [resolve("0.9.1"), resolve("0.13.0")], None)

    # A base whose own layout ports are free now: with tests running side by side the ephemeral range is busy
    # (ranks' sockets, TIME_WAIT), so no fixed window of it is wholly free, but 16 given ports are.
    def free(plan) -> bool:  # type: ignore[no-untyped-def]
        return all(is_free(port) for port in set(plan.contacted) | {
            ls.port for specs in plan.listeners.values() for ls in specs})

    base, plan = next((b, pl) for b in range(lo + 1000, hi - 500, 37) if free(pl := layout(b)))
    from contextlib import ExitStack

    with ExitStack() as held:
        reserved = orc.reserve_layout(held, "127.0.0.1", plan)
        served = {ls.port for specs in plan.listeners.values() for ls in specs}
        assert set(reserved) == set(plan.contacted) | served
        for port in reserved:  # nobody, ephemeral or explicit, can bind them now
            with socket.socket() as s, pytest.raises(OSError):
                s.bind(("127.0.0.1", port))
        orc.release_served(reserved, plan)
        for port in served:  # released for the P ranks to bind
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        assert set(reserved) == set(plan.contacted) - served
    r = run("handshake", "--prefill-tp", "4", "--decode-tp", "8", "--prefill-blocks", "64", "--decode-blocks", "64",
            "--vllm", "0.9.1,0.13.0", "--no-transfer", "--prefill-base-port", str(base), "--json")
    contract(r, json.loads(r.out)["exit_code"] if r.out else -1, within_s=60, rss_mb=2000)


# ---------------------------------------------------------------------- SGLang's bootstrap server, hostile
# The same contract for SGLang's peer: an HTTP bootstrap server (GET /route) that is not HTTP, too slow, or
# advertises values of the wrong type or range. Every case is exit 2 (the flag or URL) or 3 (the peer).
B3 = {"replace": True, "info": {"prefill_attn_tp_size": 10**12, "prefill_dp_size": 1, "prefill_pp_size": 1}}
SG_VALUES = [  # (the peer's answers, the field the error names)
    ({"info": {"attn_tp_size": 2**70}}, "attn_tp_size = 1180591620717411303424"),
    ({"info": {"attn_tp_size": 0}}, "attn_tp_size = 0"),
    ({"info": {"attn_tp_size": "2"}}, "attn_tp_size = 2"),
    ({"info": {"attn_tp_size": 2.5}}, "attn_tp_size = 2.5"),
    ({"info": {"attn_tp_size": None}}, "attn_tp_size = None"),
    ({"info": {"attn_tp_size": [1]}}, "attn_tp_size = [1]"),
    ({"info": {"attn_tp_size": -4}}, "attn_tp_size = -4"),
    ({"info": {"attn_tp_size": True}}, "attn_tp_size = True"),
    ({"info": {"attn_tp_size": 10**9}}, "attn_tp_size = 1000000000"),
    ({"info": {"pp_size": 10**9}}, "pp_size = 1000000000"),
    ({"info": {"pp_size": "x"}}, "pp_size = x"),
    ({"info": {"pp_size": 0}}, "pp_size = 0"),
    ({"info": {"pp_size": -1}}, "pp_size = -1"),
    ({"info": {"dp_size": "x"}}, "dp_size = x"),
    ({"info": {"dp_size": 0}}, "dp_size = 0"),
    ({"info": {"dp_size": -3}}, "dp_size = -3"),
    ({"info": {"dp_size": 1.5}}, "dp_size = 1.5"),
    ({"info": {"dp_size": 10**30}}, "dp_size = 1000000000000000000000000000000"),
    ({"info": {"kv_cache_dtype": "k" * 60000}}, "kv_cache_dtype = kkkk"),
    ({"rank": {"rank_port": "abc"}}, "rank_port = abc"),
    ({"rank": {"rank_port": "<drop>"}}, "rank_port is missing"),
    ({"rank": {"rank_port": 10**30}}, "rank_port = 1000000000000000000000000000000"),
    ({"rank": {"rank_ip": "<drop>"}}, "rank_ip is missing"),
    (B3, "prefill_attn_tp_size = 1000000000000"),
]


@pytest.mark.parametrize(("answers", "says"), SG_VALUES, ids=[s.split(" ")[0] + f"-{i}" for i, (_a, s) in
                                                               enumerate(SG_VALUES)])
def test_sglang_probe_refuses_advertised_values_out_of_bounds(answers, says):
    with peer("sg", json.dumps(answers)) as port:
        r = run("probe", f"http://127.0.0.1:{port}", "--sglang", "auto", "--timeout", "5")
    contract(r, 3, within_s=20, says=says)
    assert not r.out  # the reason is on stderr, nothing on stdout


@pytest.mark.parametrize(("kind", "says"), [
    ("http-junk", "not an HTTP answer"),
    ("tcp-garbage", "bootstrap server"),
    ("http-trickle-head", "did not finish answering within 1 s"),
    ("http-trickle-body", "did not finish answering within 1 s"),
    ("http-never", "did not finish answering within 1 s"),
    ("http-endless", "a body over"),
])
def test_sglang_probe_is_bounded_against_a_peer_that_is_not_http_or_slow(kind, says):
    with peer(kind) as port:
        r = run("probe", f"http://127.0.0.1:{port}", "--sglang", "auto", "--timeout", "1")
    contract(r, 3, within_s=10, says=says)


def test_sglang_probe_timeout_bounds_the_whole_walk():
    # 64 ranks, each answering after 3 s: one walk, and --timeout 2 ends it (not 64 x 3 s, nor twice that).
    with peer("sg-slow", json.dumps({"info": {"attn_tp_size": 64}})) as port:
        r = run("probe", f"http://127.0.0.1:{port}", "--sglang", "auto", "--timeout", "2")
    contract(r, 3, within_s=12, says="did not finish answering within 2 s")


def test_sglang_probe_nothing_listening_says_why_on_stderr():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        r = run("probe", f"http://127.0.0.1:{port}", "--sglang", "auto", "--timeout", "1")
    contract(r, 3, within_s=10, says="no SGLang bootstrap answer")
    assert not r.out


@pytest.mark.parametrize("args", [
    ("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "1e300"), ("--timeout", "0"),
])
def test_sglang_probe_bad_timeout_exits_2(args):
    contract(run("probe", "http://127.0.0.1:8998", "--sglang", "auto", *args), 2, within_s=10, says="--timeout")


@pytest.mark.parametrize("url", ["http://[::1", "http://[::1]:99999", "ftp://127.0.0.1:1"])
def test_sglang_bad_urls_exit_2(url):
    contract(run("probe", url, "--sglang", "auto"), 2, within_s=10)
    contract(run("handshake", "--sglang", "0.5.23", "--prefill-endpoint", url), 2, within_s=15)


def test_sglang_probe_renders_a_long_peer_string_at_once():
    # A 60,000-character value the bounds allow to pass (an extra key of 0.4.6's rank answer) is printed cut,
    # without markup or rich's highlighter.
    answers = {"replace": True, "info": {}, "rank": {"agent_name": "[bold]" + "9." * 30000}}
    with peer("sg", json.dumps(answers)) as port:
        r = run("probe", f"http://127.0.0.1:{port}", "--sglang", "0.4.6.post1", "--timeout", "5")
    contract(r, 1 if r.code == 1 else 0, within_s=15)
    assert "(60006 characters)" in r.out and max(len(ln) for ln in r.out.splitlines()) < 2000


@pytest.mark.parametrize(("kind", "answers", "says"), [
    ("http-junk", None, "not an HTTP answer"),
    ("http-trickle-head", None, "no complete answer"),
    ("sg", {"info": {"attn_tp_size": 10**9}}, "attn_tp_size = 1000000000"),
    ("sg", {"rank": {"rank_port": "abc"}}, "rank_port = abc"),
    ("sg-slow", {"info": {"attn_tp_size": 64}}, "no complete answer within 2 s"),  # 64 ranks, 3 s each
])
def test_sglang_prefill_endpoint_against_a_hostile_bootstrap_server(kind, answers, says):
    with peer(kind, json.dumps(answers) if answers else "") as port:
        r = run("handshake", "--sglang", "0.5.23", "--prefill-endpoint", f"http://127.0.0.1:{port}",
                "--hang-timeout", "2")
    contract(r, 3, within_s=30, rss_mb=600, says=says)


@pytest.mark.parametrize("duration", ["nan", "inf", "1e300", "0"])
def test_sglang_serve_bad_duration_exits_2(duration):
    contract(run("serve", "--sglang", "0.5.23", "--duration", duration), 2, within_s=10, says="--duration")
