"""The request path's handshake count on TP and DP shapes is every D rank's, not D rank 0's: each D rank
handshakes with each P engine it meets (real P and D rank processes)."""

from __future__ import annotations

from loadkit import scaled

from pdcheck.vllm.requests.faults import parse_all
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.run import Options, run
from pdcheck.vllm.requests.shapes import Shape


def _run(shape: Shape, n: int) -> dict:
    # A lease no loaded machine's first handshakes outlast (0.5 s expired requests at load 20): these tests count
    # handshakes, and every request must be delivered for the count to be the whole one.
    opts = Options(requests=n, rate=20.0, lease_s=10.0, faults=parse_all([], n), shape=shape)
    return {r.release: r for r in run([("0.34.0", line_of("0.34.0"))], scaled(opts))}


def test_tp2_to_tp4_counts_every_d_rank_handshake():
    r = _run(Shape(2, 1, 4, 1), n=2)["0.34.0"]
    assert {o.verdict for o in r.outcomes} == {"delivered"}, r.outcomes
    # four D ranks, one engine: one handshake each (D rank 0 alone made one)
    assert r.handshake is not None and r.handshake.handshakes == 4 and not r.handshake.failed
    assert "," not in r.handshake.endpoint


def test_dp2_counts_each_d_dp_rank_and_names_both_engines_endpoints():
    r = _run(Shape(1, 2, 1, 2), n=4)["0.34.0"]
    assert {o.verdict for o in r.outcomes} == {"delivered"}, r.outcomes
    # D DP rank k meets P DP rank k's engine only: two handshakes on two side channels (D rank 0: one, on one)
    assert r.handshake is not None and r.handshake.handshakes == 2
    assert len(r.handshake.endpoint.split(", ")) == 2
