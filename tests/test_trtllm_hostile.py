"""Hostile TensorRT-LLM ctx peers: a ROUTER of the test's own (its own Python process) answers
REQUEST_INSTANCE_INFO with an oversized frame, too many frames, garbage, a map of the wrong shape, wrong-typed or
out-of-bounds values, or never answers. `probe --trtllm` and `handshake --trtllm --prefill-endpoint` each end with
exit 3 and one line naming what was refused, within their timeout, bounded in memory, nothing left running
(tests/test_hostile.py's contract)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_hostile import contract, run

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

PEER = r'''
import json, sys
import msgspec, zmq
from pdcheck.trtllm import wire
from pdcheck.trtllm.layout import Side, view_of
kind, arg = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
facts = wire.Facts(instance_name="evil", rank=0, view=view_of(Side(), 0, 1 << 40), pp_size=1,
                   sender_endpoints=["tcp://127.0.0.1:9"], self_endpoint="tcp://127.0.0.1:9", blob=b"x")
doc = msgspec.msgpack.decode(wire.rank_info("W3", facts))
if kind == "doc":
    doc.update(json.loads(arg))
if kind == "endpoints":
    doc["sender_endpoints"] = ["tcp://127.0.0.1:9"] * int(arg)
while True:
    ident, *_rest = s.recv_multipart()
    if kind == "mute":
        continue
    if kind == "big":
        s.send_multipart([ident, b"\x00" * int(arg)])
    elif kind == "frames":
        s.send_multipart([ident, *([b"f"] * int(arg))])
    elif kind == "garbage":
        s.send_multipart([ident, bytes(range(256)) * 4])
    elif kind == "list":
        s.send_multipart([ident, msgspec.msgpack.encode([1, 2, 3])])
    else:
        s.send_multipart([ident, msgspec.msgpack.encode(doc)])
'''


@contextmanager
def peer(kind: str, arg: object = "") -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", PEER, kind, str(arg)], stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        line = proc.stdout.readline()
        assert line, f"peer {kind} did not start"
        yield int(line)
    finally:
        proc.kill()
        proc.wait()


CASES = [
    ("mute", "", "no reply within 3000 ms"),
    ("big", 17 * MiB, "no reply within 3000 ms"),  # over netio's frame cap: libzmq drops the peer
    ("frames", 10000, "the reply has more than 4 frames"),
    ("garbage", "", "not a TensorRT-LLM RankInfo or InstanceInfo"),
    ("list", "", "argument after ** must be a mapping, not list"),
    ("doc", {"tp_size": "2"}, "(RankInfo: tp_size = 2: expected `int`, got `str`)"),
    ("doc", {"tp_size": 10**6}, "tp_size = 1000000: expected `int` <= 256"),
    ("doc", {"instance_name": "e" * 100000}, "instance_name = eeee"),
    ("doc", {"attention": {"kv_heads_per_rank": 8}}, "AttentionInfo.__init__() missing 5 required positional"),
    ("doc", {"page_table": None}, "no attention info or page table"),
    ("doc", {"extra": 1}, "RankInfo.__init__() got an unexpected keyword argument 'extra'"),
    ("endpoints", 100000, "sender_endpoints"),
]


@pytest.mark.parametrize(("kind", "arg", "says"), CASES, ids=[f"{k}-{i}" for i, (k, _a, _s) in enumerate(CASES)])
def test_probe_refuses_a_hostile_ctx_in_one_line(kind, arg, says):
    with peer(kind, json.dumps(arg) if isinstance(arg, dict) else arg) as port:
        r = run("probe", f"127.0.0.1:{port}", "--trtllm", "auto", "--timeout", "3", limit_s=60)
    contract(r, 3, within_s=30, rss_mb=250, says=says)


@pytest.mark.parametrize(("kind", "arg", "says"), [CASES[0], CASES[2], CASES[5], CASES[11]],
                         ids=["mute", "frames", "wrong-type", "endpoints"])
def test_handshake_refuses_a_hostile_live_ctx_before_any_rank_starts(kind, arg, says):
    with peer(kind, json.dumps(arg) if isinstance(arg, dict) else arg) as port:
        r = run("handshake", "--trtllm", "W3", "--prefill-endpoint", f"tcp://127.0.0.1:{port}", "--hang-timeout", "3",
                limit_s=90)
    contract(r, 3, within_s=60, rss_mb=800, says=says)
