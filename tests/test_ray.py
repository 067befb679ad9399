"""`--ray`: the seed scenario on a real two-node Ray cluster, P ranks on one node and D ranks on the other;
and the same across a real network: the two nodes in two network namespaces joined by a veth pair.

Nodes are started with `ray start --block` (Ray's own launcher); terminating that process stops every Ray
process it started (its SIGTERM handler), so nothing is left running. Verdicts and the transfer proof must equal
the local (loopback, forked) run's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIOS, Run

# The local-run test runs without Ray too; CI installs [test], which has ray, so the rest run there for real.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="--ray needs the ray extra (pip install 'pdcheck[ray]')")
SEED = str(SCENARIOS / "seed-19338-tp8.toml")
RAY = str(Path(sys.executable).parent / "ray")


_RAY_TMP: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _ray_tmpdir() -> Iterator[None]:
    """Ray keeps its sessions and the last cluster's address (ray_current_cluster) under RAY_TMPDIR/ray, by
    default /tmp/ray, where they outlive the test and a later `--ray auto` would find a cluster long gone.
    Every node and CLI run of this module uses one directory of its own, removed at the end (short: Ray's
    Unix sockets live under it)."""
    import tempfile

    _RAY_TMP["dir"] = tempfile.mkdtemp(prefix="pdck-ray-", dir="/tmp")
    try:
        yield
    finally:
        shutil.rmtree(_RAY_TMP.pop("dir"), ignore_errors=True)


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=_RAY_TMP["dir"], **extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _ray_node(args: list[str], netns: str | None = None, env: dict[str, str] | None = None,
              timeout: float = 90) -> Iterator[subprocess.Popen[str]]:
    """One Ray node (`ray start --block`), in a network namespace when given; stopped on exit."""
    cmd = [*(["ip", "netns", "exec", netns] if netns else []), RAY, "start", "--block", "--disable-usage-stats",
           "--num-cpus=1", *(["--include-dashboard=false"] if "--head" in args else []), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or _env(),
                            cwd=ROOT, start_new_session=True)
    seen: list[str] = []
    up = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "Ray runtime started" in line:
                up.set()
        up.set()  # it ended: say so at once

    threading.Thread(target=read, daemon=True).start()
    try:
        if not up.wait(timeout) or proc.poll() is not None:
            raise AssertionError(f"ray node did not start: {' '.join(cmd)}\n{''.join(seen)[-3000:]}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # ray start --block stops the processes it started
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


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

    from pdcheck import report

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
    port = _free_port()
    with _ray_node(["--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                    '--resources={"pdcheck_prefill": 8}']):
        run = _cli(["handshake", SEED, "--vllm", "0.9.1", "--no-transfer", "--json", "--ray", f"127.0.0.1:{port}"],
                   timeout=120)
    assert run.code == 2, run.err
    assert "pdcheck_decode" in run.err and "Traceback" not in run.err
    assert run.out == ""


@contextmanager
def _two_nodes(head_ip: str, worker_ip: str, ns: tuple[str, str] | None = None,
               envs: tuple[dict[str, str], dict[str, str]] | None = None) -> Iterator[str]:
    port = _free_port() if ns is None else 6379  # a namespace of our own has every port free
    addr = f"{head_ip}:{port}"
    e_head, e_worker = envs or (_env(), _env())
    with _ray_node(["--head", f"--port={port}", f"--node-ip-address={head_ip}",
                    '--resources={"pdcheck_prefill": 8}'], ns[0] if ns else None, e_head), \
         _ray_node([f"--address={addr}", f"--node-ip-address={worker_ip}",
                    '--resources={"pdcheck_decode": 8}'], ns[1] if ns else None, e_worker):
        yield addr


@pytest.mark.ray
@needs_ray
@pytest.mark.slow
def test_seed_on_two_ray_nodes_equals_the_local_run(pdcheck):
    """P ranks on the pdcheck_prefill node, D ranks on the pdcheck_decode node, one host."""
    local = pdcheck("handshake", SEED, "--json")
    actor_logs = set(Path(tempfile.gettempdir()).glob("pdcheck-[PD]rank*.log"))
    t0 = time.monotonic()
    # D's node logs NIXL at INFO: its ranks' C-level lines must come back to the CLI's stderr, not stdout.
    with _two_nodes("127.0.0.1", "127.0.0.1", envs=(_env(), _env(NIXL_LOG_LEVEL="INFO"))) as addr:
        placed = _cli(["handshake", SEED, "--json", "--ray", addr])
    doc = _check(local, placed)
    left = set(Path(tempfile.gettempdir()).glob("pdcheck-[PD]rank*.log")) - actor_logs
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
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@contextmanager
def _veth_pair() -> Iterator[tuple[str, str, str, str]]:
    """Two fresh network namespaces joined by a veth pair: (ns A, ns B, A's address, B's address)."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: no `ip` command here")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, dev_a, dev_b = f"pdck-a-{tag}", f"pdck-b-{tag}", f"pdva{tag}", f"pdvb{tag}"
    a_ip, b_ip = "10.231.0.1", "10.231.0.2"
    try:
        _ip("netns", "add", ns_a)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"network namespaces cannot be created here (needs root / CAP_SYS_ADMIN): {exc}")
    try:
        _ip("netns", "add", ns_b)
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for ns, dev, ip in ((ns_a, dev_a, a_ip), (ns_b, dev_b, b_ip)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, a_ip, b_ip
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)  # takes the veth with it


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


def _dev(ns: str) -> str:
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "type", "veth"], capture_output=True, text=True,
                         check=True, timeout=20).stdout
    return out.split(":")[1].strip().split("@")[0]


# ------------------------------------------------------------------------------------------- transfer-bench
# 2 layers x K/V, 2 KV heads x 64 x bf16: 4 KiB blocks at 16 tokens; two prefill and two decode ranks.
BENCH = ["transfer-bench", "--model=", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--tokens", "256",
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
