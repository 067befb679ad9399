"""`pdcheck requests` on TP and DP shapes: real P and D rank processes per shape (real NIXL READs of each D rank's
head slice, kvsplit's rule), consumer counting per P rank, the scheduler freeing once every TP worker is done,
DP routing by engine id; and the pure rules (pdcheck.vllm.requests.shapes, the model per shape, the plan's keys)."""

from __future__ import annotations

from pathlib import Path

import pytest
from loadkit import scaled

from pdcheck.errors import BadInput
from pdcheck.vllm.requests import shapes
from pdcheck.vllm.requests.faults import parse_all
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.model import simulate, simulate_shape
from pdcheck.vllm.requests.plan import build
from pdcheck.vllm.requests.run import Options, run
from pdcheck.vllm.requests.shapes import Shape

SCENARIOS = Path(__file__).resolve().parent.parent / "pdcheck" / "scenarios" / "requests"


# A line's first request waits for every D rank's first handshake, which on a loaded machine outlasted a 0.5 s
# lease (request 0 freed-early on D rank 1 at load 20): a test that does not test the expiry has a lease no
# handshake outlasts, and one that does has 1 s, its faults' delays twice that.
NO_EXPIRY_S = 5.0


def _run(shape: Shape, faults: list[str] = (), releases: tuple[str, ...] = ("0.34.0",), n: int = 3,
         lease: float | None = NO_EXPIRY_S, **more: float):
    opts = Options(requests=n, rate=20.0, lease_s=lease, faults=parse_all(list(faults), n), shape=shape, **more)
    return {r.release: r for r in run([(v, line_of(v)) for v in releases], scaled(opts))}


def _agrees(r) -> None:
    assert [(o.request, o.rank, o.verdict) for o in r.outcomes] == \
        [(o.request, o.rank, o.verdict) for o in r.expected], r.outcomes


# -- real ranks ---------------------------------------------------------------------------------------------


def test_tp2_to_tp2_each_d_rank_reads_its_p_rank_and_p_frees_on_both_workers():
    by = _run(Shape(2, 1, 2, 1))
    for r in by.values():
        _agrees(r)
        assert [o.rank for o in r.outcomes] == ["D0", "D1"] * 3
        assert r.accounting.freed == 3 and r.accounting.expired == 0
        assert [p.rank for p in r.p_ranks] == ["P0", "P1"]
    assert {o.verdict for o in by["0.34.0"].outcomes} == {"delivered"}


def test_p_tp1_to_d_tp2_two_consumers_of_one_p_rank():
    # 0.34: each D rank reads its head slice of the one P rank and sends "{id}:2"; P frees after the second.
    by = _run(Shape(1, 1, 2, 1), releases=("0.14.0", "0.34.0"))
    for r in by.values():
        _agrees(r)
        assert {o.verdict for o in r.outcomes} == {"delivered"}
        assert r.accounting.freed == 3


def test_p_tp2_to_d_tp1_one_d_rank_reads_both_p_ranks():
    by = _run(Shape(2, 1, 1, 1), releases=("0.14.0",))
    for r in by.values():
        _agrees(r)
        assert {o.verdict for o in r.outcomes} == {"delivered"} and r.accounting.freed == 3


def test_dp2_routes_by_engine_id_and_names_dp_ranks():
    by = _run(Shape(1, 2, 1, 2), n=4)
    r = by["0.34.0"]
    _agrees(r)
    assert [o.rank for o in r.outcomes] == ["DP0/D0", "DP1/D0", "DP0/D0", "DP1/D0"]
    assert [p.rank for p in r.p_ranks] == ["P0", "DP1/P0"] and r.accounting.freed == 4


def test_tp2_one_consumer_lost_notification_waits_for_the_lease():
    # D TP rank 1's notification never reaches P rank 1: every D rank still verifies its blocks, but P's scheduler
    # frees each request only at P rank 1's lease (P rank 0 counted its consumer at once).
    by = _run(Shape(2, 1, 2, 1), ["drop-notif:rank=D1"], releases=("0.34.0",), lease=1.0, settle_s=1.5)
    for r in by.values():
        _agrees(r)
        assert {o.verdict for o in r.outcomes} == {"delivered"}
        # None is freed by a notification; each is P rank 1's until its lease ends (the run may stop just before
        # the last lease does, on a loaded machine: then that one is still held, never freed)
        assert r.accounting.freed == 0 and r.accounting.expired + r.accounting.held == 3 and r.accounting.expired >= 1


def test_tp2_restart_p_replaces_every_worker_and_the_dead_agents_answer():
    by = _run(Shape(2, 1, 2, 1), ["restart-p:1"], releases=("0.34.0",))
    rel, cor = by["0.34.0"], by["corrected"]
    _agrees(rel)
    _agrees(cor)
    assert [o.verdict for o in rel.outcomes] == ["delivered"] * 2 + ["error"] * 4
    assert "NIXL_ERR_REMOTE_DISCONNECT" in rel.outcomes[2].detail or "transfer" in rel.outcomes[2].detail
    assert [o.verdict for o in cor.outcomes] == ["delivered"] * 2 + ["recomputed"] * 2 + ["delivered"] * 2
    assert rel.accounting.restarts == 1


def _by_rank(r) -> list[tuple[int, str, str]]:
    return [(o.request, o.rank, o.verdict) for o in r.outcomes]


def test_tp2_restart_one_p_worker_only_the_d_rank_reading_it_fails():
    # restart-p:1:rank=1: only P TP rank 1's process is replaced. D rank 0 reads the live worker 0 and delivers;
    # D rank 1 still reads worker 1's dead agent (no release re-handshakes with a known engine id); the corrected
    # D re-handshakes at the failed READ. The default lease outlasts the replacement's start.
    by = _run(Shape(2, 1, 2, 1), ["restart-p:1:rank=1"], releases=("0.34.0",), lease=None)
    rel, cor = by["0.34.0"], by["corrected"]
    _agrees(rel)
    _agrees(cor)
    assert _by_rank(rel) == [(0, "D0", "delivered"), (0, "D1", "delivered"), (1, "D0", "delivered"),
                             (1, "D1", "error"), (2, "D0", "delivered"), (2, "D1", "error")]
    assert "NIXL_ERR_REMOTE_DISCONNECT" in rel.outcomes[3].detail
    assert [o.verdict for o in cor.outcomes] == ["delivered"] * 3 + ["recomputed"] + ["delivered"] * 2
    # one worker replaced: P rank 0 freed request 1 on its consumer's notification (the dead worker's part
    # counts done); request 2's notification to the new worker never comes (held until its lease)
    assert rel.accounting.restarts == 1 and rel.accounting.freed == 2 and rel.accounting.held == 1
    assert cor.accounting.freed == 3


def test_tp2_one_d_rank_holds_and_fails_its_read_the_other_delivers():
    # 0.14.0 (no heartbeats, the abort timeout at 1 s): D rank 1 holds request 1 past it and reads freed blocks;
    # D rank 1's READ of request 2 fails. D rank 0 reads both at once and notifies P rank 0; P's scheduler frees
    # each only when P rank 1 expires (its consumer never notified in time).
    by = _run(Shape(2, 1, 2, 1), ["hold:2.0:1:rank=D1", "read-fail:2:rank=D1"], releases=("0.14.0",), lease=1.0)
    rel, cor = by["0.14.0"], by["corrected"]
    _agrees(rel)
    _agrees(cor)
    assert _by_rank(rel) == [(0, "D0", "delivered"), (0, "D1", "delivered"), (1, "D0", "delivered"),
                             (1, "D1", "freed-early"), (2, "D0", "delivered"), (2, "D1", "recomputed")]
    assert [o.verdict for o in cor.outcomes] == ["delivered"] * 5 + ["recomputed"]
    assert rel.accounting.freed == 1 and rel.accounting.expired + rel.accounting.held == 2
    assert rel.accounting.late_notifs >= 1  # D rank 1's notification of request 1 came after the expiry


def test_tp2_one_d_rank_slow_and_aborted_on_0_34():
    # slow-decode on D rank 1 only: its params arrive after the lease, with no heartbeat (its scheduler did not
    # have the request); D rank 0 read at once. abort-d on D rank 0 only: D rank 1 delivers request 2.
    by = _run(Shape(2, 1, 2, 1), ["slow-decode:2.0:1:rank=D1", "abort-d:2:rank=D0"], releases=("0.34.0",),
              lease=1.0)
    rel, cor = by["0.34.0"], by["corrected"]
    _agrees(rel)
    _agrees(cor)
    assert _by_rank(rel) == [(0, "D0", "delivered"), (0, "D1", "delivered"), (1, "D0", "delivered"),
                             (1, "D1", "freed-early"), (2, "D0", "aborted"), (2, "D1", "delivered")]
    assert [o.verdict for o in cor.outcomes] == ["delivered"] * 3 + ["recomputed", "aborted", "delivered"]


def test_per_rank_faults_are_bounded_by_the_plans_shape():
    doc = {"requests": {"requests": 3}, "prefill": {"tp_size": 2}, "decode": {"tp_size": 2}}
    with pytest.raises(BadInput, match=r"restart-p:1:rank=2: P TP rank 2 does not exist \(prefill tp_size 2\)"):
        build(None, {**doc, "faults": {"restart-p": "1:rank=2"}}, "0.34.0", {}, [])
    with pytest.raises(BadInput, match=r"hold:1:rank=D2: D TP rank 2 does not exist"):
        build(None, {**doc, "faults": {"hold": "1:rank=D2"}}, "0.34.0", {}, [])
    plan = build(None, {**doc, "faults": {"restart-p": "1:rank=1", "read-fail": ["rank=D0"]}}, "0.34.0", {}, [])
    assert [(f.name, f.rank, f.d_rank) for f in plan.options.faults] == [("restart-p", 1, None),
                                                                         ("read-fail", None, 0)]


def test_model_per_rank_faults_and_one_worker_restart():
    line = line_of("0.34.0")
    sh = Shape(2, 1, 2, 1)
    out, acc = simulate_shape(line, 3, 20.0, 2, 8, 0.5, parse_all(["hold:0.8:1:rank=D1"], 3), sh)
    assert [o.verdict for o in out] == ["delivered"] * 6 and acc.freed == 3  # D rank 1's heartbeats renew
    out, _ = simulate_shape(line, 3, 20.0, 2, 8, 0.5, parse_all(["heartbeat-loss:0.8:1:rank=D1"], 3), sh)
    assert [(o.rank, o.verdict) for o in out if o.request == 1] == [("D0", "delivered"), ("D1", "freed-early")]
    # P TP 2 -> D TP 1: the one D rank reads the replaced worker too
    out, _ = simulate_shape(line, 3, 20.0, 2, 8, None, parse_all(["restart-p:1:rank=0"], 3), Shape(2, 1, 1, 1))
    assert [o.verdict for o in out] == ["delivered", "error", "error"]


# -- pure rules ---------------------------------------------------------------------------------------------


def test_reads_follow_kvsplit():
    sh = Shape(1, 1, 2, 1)
    p, d = shapes.geometry(sh, 1), shapes.geometry(sh, 2)
    assert [(x.p_rank, x.remote_offset) for r in range(2) for x in shapes.reads(p, d, r)] == \
        [(0, 0), (0, d.head_slice_bytes)]
    sh = Shape(2, 1, 1, 1)
    p, d = shapes.geometry(sh, 2), shapes.geometry(sh, 1)
    assert [(x.p_rank, x.local_offset, x.read_len) for x in shapes.reads(p, d, 0)] == \
        [(0, 0, p.block_len), (1, p.block_len, p.block_len)]
    assert shapes.consumers(Shape(1, 1, 4, 1), 0) == 4 and shapes.consumers(Shape(4, 1, 2, 1), 3) == 1


@pytest.mark.parametrize(("release", "shape", "sent", "counted"), [
    ("0.9.1", Shape(1, 1, 2, 1), 2, 2),   # tp_ratio
    ("0.13.0", Shape(2, 1, 4, 1), 2, 2),
    ("0.14.0", Shape(1, 1, 2, 1), 2, 2),  # D's world size; P derives D TP // P TP
    ("0.14.0", Shape(2, 1, 4, 1), 4, 2),
    ("0.26.0", Shape(2, 1, 1, 1), 1, 1),
    ("0.34.0", Shape(2, 1, 4, 1), 2, 2),  # expected_consumers
    ("0.34.0", Shape(4, 1, 2, 1), 1, 1),
])
def test_notification_count_per_release(release, shape, sent, counted):
    line = line_of(release)
    assert shapes.notif_count(line, shape) == sent
    assert shapes.expected(line, sent, shape.p_tp) == counted == shapes.consumers(shape, 0)


def test_model_per_shape_is_tp1_per_d_rank_and_dp_splits_the_pool():
    line = line_of("0.9.1")
    faults = parse_all(["drop-notif"], 8)
    one, _ = simulate(line, 8, 10.0, 2, 8, 0.5, faults)
    assert [o.verdict for o in one] == ["delivered"] * 4 + ["hang"] * 4
    tp2, _ = simulate_shape(line, 8, 10.0, 2, 8, 0.5, faults, Shape(2, 1, 2, 1))
    assert [(o.request, o.rank, o.verdict) for o in tp2] == \
        [(o.request, r, o.verdict) for o in one for r in ("D0", "D1")]
    dp2, acc = simulate_shape(line, 8, 10.0, 2, 8, 0.5, faults, Shape(1, 2, 1, 2))
    assert {o.verdict for o in dp2} == {"delivered"} and acc.leaked == 8  # each engine has its own 8 blocks
    assert [o.rank for o in dp2[:2]] == ["DP0/D0", "DP1/D0"]


def test_plan_reads_the_shape_keys_and_refuses_what_does_not_run():
    doc = {"requests": {"requests": 2}, "prefill": {"tp_size": 2}, "decode": {"tp_size": 2},
           "expect": {"0.34.0": "delivered"}}
    plan = build(None, doc, None, {}, [])
    assert plan.options.shape == Shape(2, 1, 2, 1) and plan.expect["0.34.0"] == ["delivered"] * 4
    cases = [
        ({"prefill": {"tp_size": 3}, "decode": {"tp_size": 2}}, "0.34.0", "one TP size must divide the other"),
        ({"prefill": {"tp_size": 2}}, "0.11.1", "reads no P TP > D TP"),
        ({"prefill": {"tp_size": 8}, "decode": {"tp_size": 8}}, "0.34.0", "at most 8"),
        ({"prefill": {"pp_size": 2}}, "0.34.0", "unknown key(s) pp_size"),
        ({"prefill": {"tp_size": 2}, "requests": {"mode": "push"}}, "0.25.0", "races the other WRITEs"),
        ({"decode": {"tp_size": 2}, "faults": {"drop-notif": "rank=D2"}}, "0.34.0", "D TP rank 2 does not exist"),
    ]
    for extra, rel, said in cases:
        with pytest.raises(BadInput, match=said.replace("(", r"\(").replace(")", r"\)")):
            build(None, {"requests": {"requests": 2}, **extra}, rel, {}, [])


def test_bundled_shape_scenarios_cover_every_pull_class():
    classes = {p.stem.removeprefix("requests-") for p in SCENARIOS.glob("requests-*.toml")
               if not p.stem.startswith(("requests-push-", "requests-tp2-", "requests-hetero-", "requests-dp2-"))}
    for kind in ("tp2", "hetero"):
        assert {c for c in classes if (SCENARIOS / f"requests-{kind}-{c}.toml").exists()} == classes, kind
