"""`pdcheck doctor` across hosts without Ray: three `--listen --keep-listening` listeners, each in a network
namespace of its own on one bridge (netkit._bridged: every pair a real link, as the veth test's), and one
`--matrix` from a fourth namespace over a name that resolves to all three (as a headless Service's does); and a
`--peer` that dials its listener by host name."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import ROOT
from netkit import _bridged

pytestmark = pytest.mark.slow
PORT = 7777  # every listener in its own namespace: one port for all, as a DaemonSet's pods have


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    return dict(env, PYTHONPATH=str(ROOT), COLUMNS="400", **(extra or {}))


def _in(ns: str, *args: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-m", "pdcheck", "doctor", *args]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[list[tuple[str, str, str]], list[subprocess.Popen[str]]]]:
    """Three listeners (UCX_TLS=tcp: the payload crosses the links, not the host's shared memory), and a client
    namespace that resolves `listeners` to all three and `node-0` to the first."""
    with _bridged(4, names={"listeners": [0, 1, 2], "node-0": [0]}) as spokes:
        procs = [subprocess.Popen(_in(ns, "--listen", f"{ip}:{PORT}", "--keep-listening", "--json", "--timeout",
                                      "60"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env=_env({"UCX_TLS": "tcp"}))
                 for ns, ip, _dev in spokes[:3]]
        try:
            for p, (_ns, ip, _dev) in zip(procs, spokes, strict=False):
                assert p.stderr is not None
                line = p.stderr.readline()  # the announcement: the listener's rank is up
                assert f"listening on {ip}:{PORT}" in line, line + p.stderr.read()
            yield spokes, procs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()


def _matrix(spokes: list[tuple[str, str, str]], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_in(spokes[3][0], "--matrix", f"listeners:{PORT}", "--timeout", "60", *args),
                          capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=600)


def test_matrix_over_three_listeners_prints_every_pair(cluster) -> None:
    spokes, procs = cluster
    r = _matrix(spokes, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    cl = doc["cluster"]
    assert doc["mode"] == "matrix" and cl["selection"] == "every pair of listeners" and cl["concurrency"] == 1
    # the name resolved to every listener, each named with its address
    assert [n["address"] for n in cl["nodes"]] == [f"listeners:{PORT} ({ip})" for _ns, ip, _dev in spokes[:3]]
    pairs = {(p["prefill"], p["decode"]): p for p in cl["pairs"]}
    assert len(pairs) == 3, cl["pairs"]
    seen = {tuple(sorted(re.findall(r"10\.232\.0\.\d", f"{a} {b}"))) for a, b in pairs}
    assert seen == {("10.232.0.1", "10.232.0.2"), ("10.232.0.1", "10.232.0.3"), ("10.232.0.2", "10.232.0.3")}
    for p in cl["pairs"]:
        # each pair a real transfer between two namespaces over the link: TCP on the decode end's own device
        assert p["status"] == "PASS" and p["checked"] > 0 and p["wrong"] == 0 and p["gbps"] > 0, p
        dev = next(d for _ns, ip, d in spokes if ip in p["decode"])
        assert p["data"] and all(x.startswith(f"tcp/{dev}") for x in p["data"]), p
    checks = [c["name"] for c in doc["checks"]]
    assert checks[0] == "listeners" and len(checks) == 4
    # the same matrix as a table, as --ray prints its matrix, and --expect judged on every pair
    t = _matrix(spokes, "--expect", "rc")
    assert t.returncode == 1, t.stderr
    assert "pairs (every pair of listeners, 1 at a time" in t.stdout, t.stdout
    rows = [ln for ln in t.stdout.split("pairs (every pair of listeners")[1].splitlines() if ln.startswith("│")]
    assert len(rows) == 3 and all("FAIL" in ln and "tcp/" in ln for ln in rows), t.stdout
    assert "while --expect asks for rc" in t.stdout
    # each listener reported the pairs it took part in (a JSON line each) and is still serving
    assert all(p.poll() is None for p in procs)


def test_peer_dials_its_listener_by_host_name(cluster) -> None:
    """`--peer node-0:PORT` from the client namespace: the name resolved once, named with its address on both
    ends' side channel line."""
    spokes, _procs = cluster
    client = spokes[3][0]
    r = subprocess.run(_in(client, "--peer", f"node-0:{PORT}", "--json", "--timeout", "60", "--no-transfer"),
                       capture_output=True, text=True, cwd=ROOT, env=_env({"UCX_TLS": "tcp"}), timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    pr = doc["pair"]
    assert pr["side_channel"] == f"TCP node-0:{PORT} (10.232.0.1)", pr
    assert pr["advertised"] == f"10.232.0.1:{PORT}" and pr["remote"]["host"] == "10.232.0.1", pr
    assert pr["local"]["host"] == spokes[3][1] and pr["local"]["role"] == "decode", pr
    c = next(c for c in doc["checks"] if c["name"] == "pair transfer")
    assert c["status"] == "PASS" and "payload over tcp/" in c["detail"], c
    # a name this namespace cannot resolve: one line, exit 2, before anything starts
    bad = subprocess.run(_in(client, "--peer", f"node-9:{PORT}"), capture_output=True, text=True, cwd=ROOT,
                         env=_env(), timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("pdcheck: error: --peer: node-9 does not resolve here"), \
        bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
