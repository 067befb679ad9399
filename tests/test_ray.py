"""`--ray`: the seed scenario on a real two-node Ray cluster, P ranks on one node and D ranks on the other;
and the same across a real network: the two nodes in two network namespaces joined by a veth pair.

Nodes are started with `ray start --block` (Ray's own launcher); terminating that process stops every Ray
process it started (its SIGTERM handler), so nothing is left running. Verdicts and the transfer proof must equal
the local (loopback, forked) run's.
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIOS, Run
from netkit import _dev, _env, _ray_node, _ray_tmpdir, _two_nodes, _veth_pair, actor_tmp  # noqa: F401
from portkit import free_run

# The local-run test runs without Ray too; CI installs [test], which has ray, so the rest run there for real.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="--ray needs the ray extra (pip install 'pdcheck[ray]')")
SEED = str(SCENARIOS / "seed-19338-tp8.toml")


def _cli(args: list[str], netns: str | None = None, timeout: float = 180) -> Run:
    cmd = [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, "-m", "pdcheck", *args]
    return Run(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_env()))


def _proof(doc: dict) -> tuple:
    """What must not depend on placement: every verdict, every transfer result, what P ranks saw."""
    decode = [(d["tp_rank"], d["num_blocks"], d["verdicts"], d["bypassed"],
               {k: {f: t[f] for f in ("status", "blocks", "wrong", "wrong_regions", "first_mismatch", "stride")}
                for k, t in (d["transfer"] or {}).items()}) for d in doc["decode_ranks"]]
    prefill = [(p["tp_rank"], p["requests_served"], sorted(p["notifications"] or [])) for p in doc["prefill_ranks"]]
    return doc["matrix"], doc["survives"], doc["exit_code"], doc["harness_errors"], decode, prefill


def _check(local: Run, placed: Run) -> dict:
    assert local.code == 1, local.err
    assert placed.code == 1, placed.err
    doc = placed.json()
    assert _proof(doc) == _proof(local.json())
    # The seed's verdicts: 0.9.1 asserts on D ranks 1-7, the others survive, corrected delivers every block.
    assert doc["matrix"]["0.9.1"] == ["ok", *["assert"] * 7]
    assert all(d["transfer"]["corrected"]["wrong"] == 0 and d["transfer"]["corrected"]["blocks"] > 0
               for d in doc["decode_ranks"])
    p_nodes = {p["node"] for p in doc["prefill_ranks"]}
    d_nodes = {d["node"] for d in doc["decode_ranks"]}
    assert len(p_nodes) == 1 and len(d_nodes) == 1 and p_nodes != d_nodes, (p_nodes, d_nodes)
    assert "(ray node " in next(iter(p_nodes))
    return doc


def _placement_line(doc: dict) -> str:
    import msgspec

    from pdcheck.vllm import report

    return report.placement(msgspec.json.decode(json.dumps(doc).encode(), type=report.Report)) or ""


def test_local_run_names_this_host_as_node(pdcheck):
    run = pdcheck("handshake", SEED, "--vllm", "0.9.1", "--no-transfer", "--json")
    assert run.code == 1, run.err
    doc = run.json()
    assert {r["node"] for r in [*doc["prefill_ranks"], *doc["decode_ranks"]]} == {socket.gethostname()}


@pytest.mark.ray
@needs_ray
@pytest.mark.parametrize("address", ["127.0.0.1:1", "nonsense:xx", ""])
def test_ray_address_nobody_answers_is_one_line_exit_2(pdcheck, address):
    run = pdcheck("handshake", SEED, "--vllm", "0.9.1", "--json", "--ray", address, timeout=60)
    assert run.code == 2, run.err
    lines = [x for x in run.err.splitlines() if x.startswith("pdcheck: error:")]
    assert len(lines) == 1 and "--ray" in lines[0] and "Traceback" not in run.err
    assert run.out == ""


@pytest.mark.ray
@needs_ray
def test_ray_cluster_without_the_decode_resource_is_bad_input():
    port = free_run()
    with _ray_node(["--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                    '--resources={"pdcheck_prefill": 8}']):
        run = _cli(["handshake", SEED, "--vllm", "0.9.1", "--no-transfer", "--json", "--ray", f"127.0.0.1:{port}"],
                   timeout=120)
    assert run.code == 2, run.err
    assert "pdcheck_decode" in run.err and "Traceback" not in run.err
    assert run.out == ""


@pytest.mark.ray
@needs_ray
@pytest.mark.slow
def test_seed_on_two_ray_nodes_equals_the_local_run(pdcheck):
    """P ranks on the pdcheck_prefill node, D ranks on the pdcheck_decode node, one host."""
    local = pdcheck("handshake", SEED, "--json")
    t0 = time.monotonic()
    # D's node logs NIXL at INFO: its ranks' C-level lines must come back to the CLI's stderr, not stdout.
    with _two_nodes("127.0.0.1", "127.0.0.1", envs=(_env(), _env(NIXL_LOG_LEVEL="INFO"))) as addr:
        placed = _cli(["handshake", SEED, "--json", "--ray", addr])
    doc = _check(local, placed)
    left = set(Path(actor_tmp()).glob("pdcheck-[PD]rank*.log"))  # the nodes' TMPDIR, this module's own
    assert not left, f"rank actors left their log files behind: {sorted(map(str, left))[:3]}"
    for r in range(8):
        # The header names the node as Ray knows it (its NodeManagerAddress may be this host's routable
        # address even for a node started on 127.0.0.1): only the form is fixed.
        _, _, rest = placed.err.partition(f"--- D rank {r} log (")
        assert rest, placed.err[-2000:]
        assert "(ray node " in rest.split("\n", 1)[0]
        block = rest.split("\n--- ", 1)[0]
        assert "nixl_plugin_manager.cpp" in block
    assert time.monotonic() - t0 < 150
    line = _placement_line(doc)
    m = re.fullmatch(r"P ranks 0-7 on (\S+) \(ray node (\w+)\); D ranks 0-7 on (\S+) \(ray node (\w+)\)", line)
    assert m is not None and m[2] != m[4], line  # one host, two Ray nodes


# ---------------------------------------------------------------------------------- a real network link
@pytest.mark.ray
@needs_ray
@pytest.mark.slow
def test_seed_across_a_veth_link_equals_the_loopback_run(pdcheck):
    """The Ray head (P ranks) in namespace A, the worker (D ranks) in namespace B: the side channel binds A's
    veth address, D ranks reach it over the link, and UCX is given the veth device, never `lo`."""
    local = pdcheck("handshake", SEED, "--json")
    with _veth_pair() as (ns_a, ns_b, a_ip, b_ip):
        dev_a = _dev(ns_a)
        dev_b = _dev(ns_b)
        envs = (_env(UCX_NET_DEVICES=dev_a), _env(UCX_NET_DEVICES=dev_b))
        with _two_nodes(a_ip, b_ip, (ns_a, ns_b), envs) as addr:
            placed = _cli(["handshake", SEED, "--json", "--ray", addr], netns=ns_a)
    doc = _check(local, placed)
    assert {p["node"].split()[0] for p in doc["prefill_ranks"]} == {a_ip}
    assert {d["node"].split()[0] for d in doc["decode_ranks"]} == {b_ip}


# ------------------------------------------------------------------------------------------- transfer-bench
# 2 layers x K/V, 2 KV heads x 64 x bf16: 4 KiB blocks at 16 tokens; two prefill and two decode ranks.
BENCH = ["transfer-bench", "--model", "custom", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--tokens", "256",
         "--requests", "4", "--iters", "40", "--min-time", "0.05", "--block-size", "16,32", "--prefill-tp", "2",
         "--decode-tp", "2", "--json"]
# What must not depend on placement: the rows swept, their descriptors and bytes, and the block check.
ROW_SHAPE = ("label", "block_tokens", "tokens", "blocks", "regions", "requests", "run_length", "block_bytes", "bytes",
             "desc_count", "desc_runs", "checked", "wrong", "first_wrong")


@pytest.mark.ray
@needs_ray
@pytest.mark.slow
def test_transfer_bench_on_two_ray_nodes_equals_the_local_run(tmp_path):
    """P ranks as actors on the pdcheck_prefill node, D ranks on the pdcheck_decode node: real NIXL READs
    between them, every block checked by coordinate, the ranks' logs back in --log-dir."""
    local = _cli(BENCH)
    assert local.code == 0, local.err
    with _two_nodes("127.0.0.1", "127.0.0.1") as addr:
        placed = _cli([*BENCH, "--ray", addr, "--log-dir", str(tmp_path)])
    assert placed.code == 0, placed.err
    doc, ref = placed.json(), local.json()
    assert [{k: r[k] for k in ROW_SHAPE} for r in doc["rows"]] == [{k: r[k] for k in ROW_SHAPE} for r in ref["rows"]]
    assert len(doc["rows"]) == 2
    assert all(r["wrong"] == 0 and r["checked"] > 0 and r["iters"] > 0 and r["gbps"] > 0 for r in doc["rows"])
    assert doc["ok"] is True
    # No core of this host was given to a rank on a Ray node.
    assert "--ray" in doc["env"]["pin_note"] and set(doc["env"]["pinning"]) == {"P0", "P1", "D0", "D1"}
    # Each rank's log came back whole from its actor: UCX's protocol tables for the transport diagnosis.
    assert "cfg#" in (tmp_path / "D0.log").read_text(errors="replace")
    assert (tmp_path / "P1.log").exists()
    assert doc["transport"]["data"], doc["transport"]


@pytest.mark.ray
@needs_ray
def test_transfer_bench_ray_address_nobody_answers_is_one_line_exit_2():
    run = _cli([*BENCH, "--ray", "127.0.0.1:1"], timeout=60)
    assert run.code == 2, run.err
    lines = [x for x in run.err.splitlines() if "error" in x]
    assert len(lines) == 1 and "--ray" in lines[0] and "Traceback" not in run.err
    assert run.out == ""
