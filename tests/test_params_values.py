"""kv_transfer_params values as P's request_finished produces them (releases.params: remote_block_ids one list per
KV-cache group from 0.18, remote_num_tokens a token count, remote_port P's side-channel port), D's reading of
either shape, and `pdcheck requests --json` carrying the params P produced; the opt-in part reads the wheels."""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec
import pytest

from pdcheck.vllm.releases import params as kvparams
from pdcheck.vllm.requests.lines import CORRECTED, line_of
from pdcheck.vllm.requests.model import apply_bad, params_for, read_ids

SRC = Path(os.environ.get("PDCHECK_VLLM_SRC", "/nonexistent"))


def test_block_ids_one_list_per_group_from_0_18() -> None:
    assert params_for(line_of("0.17.0"), 0, [3, 7], "P", 41000, 1, None, [1, 1])["remote_block_ids"] == [3, 7]
    for release in ("0.18.0", "0.26.0", "0.34.0"):
        p = params_for(line_of(release), 0, [3, 7], "P", 41000, 1, None, [1, 1])
        assert p["remote_block_ids"] == [[3, 7]]  # `(block_ids,)` as msgpack carries the tuple
    assert params_for(CORRECTED, 0, [3, 7], "P", 41000, 1, None, [1, 1])["remote_block_ids"] == [[3, 7]]
    with pytest.raises(ValueError):
        kvparams.block_ids_value("0.17.0", [[1], [2]])


def test_remote_num_tokens_is_a_token_count_and_port_is_p_s() -> None:
    p = params_for(line_of("0.34.0"), 0, [3, 7], "P", 41000, 1, None, [1, 1])
    assert p["remote_num_tokens"] == 32 and p["remote_port"] == 41000
    assert params_for(line_of("0.34.0"), 0, [3, 7], "P", 41000, 1, None, [1, 1], block_size=64)[
        "remote_num_tokens"] == 128
    assert "remote_num_tokens" not in params_for(line_of("0.20.0"), 0, [3, 7], "P", 1, 1, None, [1, 1])


def test_d_reads_either_shape_and_loads_the_tokens_p_names() -> None:
    assert kvparams.block_id_groups([3, 7]) == [[3, 7]]
    assert kvparams.block_id_groups([[3, 7]]) == [[3, 7]] and kvparams.block_id_groups(([3, 7],)) == [[3, 7]]
    for bad in (7, [[3], 7], "3,7"):
        with pytest.raises(ValueError):
            kvparams.block_id_groups(bad)
    p = params_for(line_of("0.34.0"), 0, [3, 7], "P", 41000, 1, None, [1, 1])
    assert read_ids(p) == [3, 7]
    # D loads min(remote_num_tokens, prompt) - computed tokens: a block count in that field (2) reads one block
    assert kvparams.tokens_to_load({"remote_num_tokens": 2}, 32) == 2
    assert read_ids({**p, "remote_num_tokens": 2}) == [7]
    assert read_ids({**p, "remote_num_tokens": 0}) == []
    assert read_ids({"remote_block_ids": [3, 7]}) == [3, 7]  # before 0.21: the whole list


def test_router_faults_keep_the_release_shape() -> None:
    p = params_for(line_of("0.34.0"), 0, [3, 7], "P", 41000, 1, None, [1, 1])
    assert apply_bad(p, "out-of-range", 8, None)["remote_block_ids"] == [[15, 16]]
    assert apply_bad(p, "reused-ids", 8, [1, 2])["remote_block_ids"] == [[1, 2]]
    flat = params_for(line_of("0.14.0"), 0, [3, 7], "P", 41000, 1, None, [1, 1])
    assert apply_bad(flat, "out-of-range", 8, None)["remote_block_ids"] == [15, 16]


def test_real_ranks_params_in_json(pdcheck) -> None:
    run = pdcheck("requests", "--vllm", "0.34.0,0.17.0", "--requests", "2", "--json", timeout=180)
    assert run.code == 0, run.err
    doc = run.json()
    by = {r["release"]: r for r in doc["releases"]}
    port = int(by["0.34.0"]["handshake"]["endpoint"].rsplit(":", 1)[1])
    for row in by["0.34.0"]["rows"]:
        p = row["params"]
        assert row["verdict"] == "delivered"
        assert len(p["remote_block_ids"]) == 1 and len(p["remote_block_ids"][0]) == doc["blocks_per_request"]
        assert p["remote_num_tokens"] == 16 * doc["blocks_per_request"] and p["remote_port"] == port
    for row in by["0.17.0"]["rows"]:
        assert row["verdict"] == "delivered"
        assert all(isinstance(b, int) for b in row["params"]["remote_block_ids"])


# ---- opt-in: the wheels' own request_finished (PDCHECK_VLLM_SRC, as tests/test_requests_against_wheels.py) ------
RELEASES = sorted((p.name for p in SRC.glob("0.*") if (p / "vllm/distributed/kv_transfer").is_dir()),
                  key=lambda v: tuple(int(x) for x in v.split(".")[:3]))


@pytest.mark.skipif(not RELEASES, reason="set PDCHECK_VLLM_SRC to a directory of unpacked vLLM wheels")
@pytest.mark.parametrize("release", RELEASES)
def test_value_shapes_against_the_wheel(release: str) -> None:
    from reqkit import Wheel, grouped, request

    v = tuple(int(x) for x in release.split(".")[:3])
    root = SRC / release / "vllm/distributed/kv_transfer/kv_connector/v1"
    conn = "\n".join(p.read_text() for p in [root / "nixl_connector.py", *sorted(root.glob("nixl/connector.py"))]
                     if p.exists())
    wraps = re.search(r"request_finished\(request, \(block_ids,\)\)", conn) is not None
    assert wraps == (v >= kvparams.BLOCK_IDS_PER_GROUP), release
    if v < (0, 9, 1):
        return
    w = Wheel(SRC, release)
    line = line_of(release)
    _delay, theirs = w.scheduler().request_finished(request("req-7", {"do_remote_decode": True}, tokens=32),
                                                     ([3, 4],) if grouped(w) else [3, 4])
    theirs = msgspec.msgpack.decode(msgspec.msgpack.encode(theirs))  # as the params travel
    if not wraps and isinstance(theirs["remote_block_ids"][0], list):
        theirs["remote_block_ids"] = theirs["remote_block_ids"][0]  # the scheduler alone, before the wrap
    mine = params_for(line, 7, [3, 4], "P", 5600, 1, None, [1, 1], request_id="req-7")
    assert mine["remote_block_ids"] == theirs["remote_block_ids"]
    if "remote_num_tokens" in theirs:
        assert mine["remote_num_tokens"] == theirs["remote_num_tokens"] == 32
