"""`pdcheck doctor --ray ADDRESS`: the pair check between nodes of a real two-node Ray cluster (netkit's nodes,
the ones test_ray.py starts), and the pure rules that choose and order the pairs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT, Run
from netkit import _env, _ray_tmpdir, _two_nodes  # noqa: F401 - _ray_tmpdir: the module's Ray directory

from pdcheck.doctor.cluster import Node, PairRow, order, pairs_of

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="--ray needs the ray extra (pip install 'pdcheck[ray]')")


def _cli(*args: str, timeout: float = 240) -> Run:
    return Run(subprocess.run([sys.executable, "-m", "pdcheck", "doctor", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=_env(COLUMNS="400")))


def test_pairs_prefill_by_decode_and_every_pair() -> None:
    ps = [Node(f"p{i}", f"10.0.0.{i}", ["prefill"]) for i in range(3)]
    ds = [Node(f"d{i}", f"10.0.1.{i}", ["decode"]) for i in range(2)]
    both = Node("b", "10.0.2.1", ["prefill", "decode"])
    how, todo = pairs_of([*ps, *ds, both])
    assert how == "prefill x decode"
    assert len(todo) == 4 * 3 - 1  # every prefill node x every decode node, never a node with itself
    assert all(p.node_id != d.node_id and "prefill" in p.roles and "decode" in d.roles for p, d in todo)
    plain = [Node(f"n{i}", f"10.0.3.{i}", []) for i in range(4)]
    how, todo = pairs_of(plain)
    assert how == "every pair" and len(todo) == 6
    assert pairs_of(plain[:1])[1] == []


def test_slow_and_broken_pairs_first() -> None:
    def row(name: str, status: str, gbps: float) -> PairRow:
        return PairRow(name, "d", status, gbps, 10, 0, [], [], "ok", 0.1)  # type: ignore[arg-type]

    rows = [row("fast", "PASS", 10.0), row("ok", "PASS", 9.0), row("slow", "PASS", 2.0), row("dead", "FAIL", 0.0),
            row("median", "PASS", 8.0)]
    med = order(rows)
    assert med == 8.5  # of the four pairs that moved KV
    assert [r.prefill for r in rows] == ["dead", "slow", "median", "ok", "fast"]
    assert rows[1].status == "WARN" and "slow: under half the median pair's 8.50 GB/s" in rows[1].detail


def test_bad_ray_address_and_flags_are_one_line_exit_2() -> None:
    for args in (("--ray", "127.0.0.1:1"), ("--ray", "x:1", "--peer", "1.2.3.4:5"), ("--ray", "x:1", "--pairs", "0"),
                 ("--expect", "tcp")):
        r = _cli(*args, timeout=60)
        assert r.code == 2, (args, r.err)
        lines = r.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pdcheck: error:") and "Traceback" not in r.err, r.err
        assert r.out == ""


@pytest.mark.ray
@needs_ray
@pytest.mark.slow
def test_pair_matrix_on_two_ray_nodes() -> None:
    """The prefill-labelled node x the decode-labelled node: a real READ between two Ray nodes, every block
    checked, the payload's transport from the decode rank's UCX tables; --expect judged per pair."""
    with _two_nodes("127.0.0.1", "127.0.0.1") as addr:
        run = _cli("--ray", addr, "--pairs", "2", "--json", "--timeout", "60")
        table = _cli("--ray", addr, "--expect", "rc", "--timeout", "60")
    assert run.code == 0, run.err
    doc = run.json()
    cl = doc["cluster"]
    assert doc["mode"] == "ray" and cl["selection"] == "prefill x decode" and cl["concurrency"] == 1
    assert len(cl["nodes"]) == 2 and {tuple(n["roles"]) for n in cl["nodes"]} == {("prefill",), ("decode",)}
    (p,) = cl["pairs"]
    assert p["checked"] > 0 and p["wrong"] == 0 and p["gbps"] > 0, p
    assert p["prefill"] != p["decode"] and p["data"], p  # two Ray nodes; UCX named the payload's transport
    names = [c["name"] for c in doc["checks"]]
    assert names == ["ray cluster", f"pair {p['prefill']} -> {p['decode']}"]
    assert f"payload over {p['data'][0]}" in doc["checks"][1]["detail"]
    # both Ray nodes run on this one host: the payload went by shared memory, and the pair says no link was tested
    assert p["status"] == "WARN" and "no link exercised" in p["detail"], p
    # the same pair with --expect rc (no RDMA here): FAIL, exit 1, the matrix names what carried it
    assert table.code == 1, table.err
    out = table.out
    assert f"the payload went over {p['data'][0]} while --expect asks for rc" in out, out
    assert "pairs (prefill x decode, 1 at a time" in out, out
    matrix = out.split("pairs (prefill x decode")[1]
    assert "FAIL" in matrix and p["data"][0] in matrix, out
    assert out.strip().splitlines()[-1].startswith("2 checks: 1 FAIL, 1 PASS (failed: pair "), out
