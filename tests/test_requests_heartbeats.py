"""Heartbeats and handshakes as vLLM counts them (issue #37, pdcheck.vllm.requests.heartbeat): every D rank heartbeats a
request until every D rank of it is done, on the scheduler's one cadence; a heartbeat to an engine D does not know
starts a handshake and sends nothing; 0.33+ handshakes again at the READ after a handshake a heartbeat started; a
request that names no request id gets no handshake; push mode heartbeats until P's WRITE completes. The counts per
request and D rank are in --json (RequestRow.heartbeats / handshakes)."""

from __future__ import annotations

import pytest
from loadkit import scaled

from pdcheck.vllm.requests.faults import parse_all
from pdcheck.vllm.requests.heartbeat import Beats, Tracked, tracks
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.model import heartbeat_window
from pdcheck.vllm.requests.run import Options, run
from pdcheck.vllm.requests.shapes import Shape

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_request_id": "r", "remote_host": "h",
          "remote_port": 1, "tp_size": 1}


# -- pure ---------------------------------------------------------------------------------------------------


def test_what_the_scheduler_tracks() -> None:
    assert tracks(line_of("0.22.0"), PARAMS) and not tracks(line_of("0.21.0"), PARAMS)
    for key in ("remote_request_id", "tp_size", "remote_port"):  # on_new_request: every one required
        assert not tracks(line_of("0.34.0"), {k: v for k, v in PARAMS.items() if k != key})
    assert not tracks(line_of("0.34.0"), {**PARAMS, "do_remote_prefill": False}) and not tracks(line_of("0.34.0"),
                                                                                                 None)


def test_one_cadence_for_every_tracked_request_and_lost_ones_never_named() -> None:
    b = Beats()
    b.track(Tracked(0, "a", "P", 1, False))
    b.track(Tracked(1, "b", "P", 1, True))
    b.track(Tracked(2, "c", "Q", 2, False))
    got = b.due(10.0, 1.0)  # the first at once (the scheduler's last heartbeat time starts at 0)
    assert {e: [t.request for t in ts] for e, ts in got.items()} == {"P": [0, 1], "Q": [2]}
    assert Beats.message(got["P"]) == b"HB:a" and Beats.message([got["P"][1]]) is None
    assert b.due(10.5, 1.0) == {} and b.due(11.0, 1.0) != {}  # then every interval, for all of them together
    b.count_sent(got["P"], 2)
    assert b.named == {0: 1} and b.sent == 2
    b.stop(0), b.stop(1), b.stop(2)
    assert b.due(20.0, 1.0) == {}


def test_the_models_heartbeat_window_follows_the_last_d_rank() -> None:
    f = parse_all(["hold:1:0:rank=D1", "heartbeat-loss:1:1:rank=D1"], 2)
    # TP 2 -> TP 2: P rank 1 has D rank 1 alone: its lost heartbeats leave P rank 1 unrenewed
    assert heartbeat_window(f, 0, Shape(2, 1, 2, 1)) == (1.0, False)
    assert heartbeat_window(f, 1, Shape(2, 1, 2, 1)) == (1.0, True)
    # P TP 1 -> D TP 2: D rank 0 keeps heartbeating P's one rank until D rank 1 read
    assert heartbeat_window(f, 1, Shape(1, 1, 2, 1)) == (1.0, False)


# -- real ranks ---------------------------------------------------------------------------------------------


def _rows(r):
    return {(o.request, o.rank): (o.heartbeats, o.handshakes) for o in r.outcomes}


@pytest.mark.parametrize(("shape", "shakes_026", "shakes_034"), [
    (Shape(1, 1, 1, 1), 1, 2), (Shape(2, 1, 2, 1), 2, 4), (Shape(1, 1, 2, 1), 2, 4)])
def test_a_heartbeats_handshake_and_034s_second_one(shape: Shape, shakes_026: int, shakes_034: int) -> None:
    # Request 0 is held 1.5 s before its READ, on every D rank: the scheduler heartbeats it from the start, so the
    # first heartbeat finds no engine and starts D's handshake; 0.33+ records no registration generation there,
    # so the next READ (request 1's, 0.1 s later) drops the engine and handshakes again. A 2 s lease: heartbeats
    # extend it by 1 s (kv_lease_duration * 2 // 3).
    opts = Options(requests=2, rate=10.0, lease_s=2.0, faults=parse_all(["hold:1.5:0"], 2), shape=shape)
    by = {r.release: r for r in run([(v, line_of(v)) for v in ("0.26.0", "0.34.0")], scaled(opts))}
    for r in by.values():
        assert [o.verdict for o in r.outcomes] == [o.verdict for o in r.expected] == ["delivered"] * len(r.outcomes)
    assert by["0.26.0"].handshake.handshakes == shakes_026
    assert by["0.34.0"].handshake.handshakes == shakes_034
    for rel in ("0.26.0", "0.34.0"):
        rows = _rows(by[rel])
        for (req, _rank), (beats, _shakes) in rows.items():
            if req == 0:  # held 1.5 s at lease/6: every D rank heartbeats it all along
                assert beats >= 4, (rel, rows)
        assert sum(s for _b, s in rows.values()) == by[rel].handshake.handshakes, (rel, rows)


def test_every_d_rank_heartbeats_until_the_last_is_done() -> None:
    # Only D rank 1 holds request 0; D rank 0 reads at once, but the scheduler's heartbeats go on from every
    # worker until every one finished it. P TP 1 -> D TP 2 on 0.34: D rank 0 handshakes at its READ, D rank 1 at a
    # heartbeat and again at its READ (3 in all).
    opts = Options(requests=2, rate=10.0, lease_s=2.0, faults=parse_all(["hold:1.5:0:rank=D1"], 2),
                   shape=Shape(1, 1, 2, 1))
    r = run([("0.34.0", line_of("0.34.0"))], scaled(opts))[0]
    assert [o.verdict for o in r.outcomes] == [o.verdict for o in r.expected]
    rows = _rows(r)
    assert rows[(0, "D0")][0] >= 4 and rows[(0, "D1")][0] >= 4, rows
    assert r.handshake.handshakes == 3 and rows[(0, "D0")][1] == 1 and rows[(0, "D1")][1] == 1, rows


def test_a_request_without_request_id_gets_no_handshake() -> None:
    # update_state_after_alloc refuses it before any receive is scheduled, and on_new_request never tracked it
    opts = Options(requests=1, rate=10.0, lease_s=2.0, faults=parse_all(["bad-params:missing-request-id:0"], 1))
    by = {r.release: r for r in run([(v, line_of(v)) for v in ("0.14.0", "0.34.0")], scaled(opts))}
    for rel in ("0.14.0", "0.34.0"):
        assert [o.verdict for o in by[rel].outcomes] == ["hang"]
        assert by[rel].handshake.handshakes == 0 and _rows(by[rel])[(0, "")] == (0, 0)


def test_push_heartbeats_go_on_while_d_waits_for_ps_write() -> None:
    # P's WRITE for request 1 fails: D waits for ever and its scheduler heartbeats it all that time (a 2 s lease:
    # extended by 1 s at each), so P still holds its blocks at the end instead of freeing them at the lease
    opts = Options(requests=3, rate=10.0, lease_s=2.0, faults=parse_all(["read-fail:1"], 3), mode="push")
    r = run([("0.34.0", line_of("0.34.0"))], scaled(opts))[0]
    assert [o.verdict for o in r.outcomes] == [o.verdict for o in r.expected] == ["delivered", "hang", "delivered"]
    assert (r.accounting.expired, r.accounting.held) == (0, 1) and r.expected_accounting.held == 1
    assert _rows(r)[(1, "")][0] >= 4
