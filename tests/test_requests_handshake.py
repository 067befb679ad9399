"""`pdcheck requests`' side-channel handshake: D fetches P's metadata over real ZMQ (P's Listener, D's fetch and
the release's strict decoder); a P whose listener never answers is each release's verdict within its timeout,
never a hang of the run; a reply in another era is the release's decode error. In push mode P handshakes with D
over D's side channel (named by D's PUSH_REG) before its first WRITE; a D that never answers is each release's
hang, never the run's."""

from __future__ import annotations

import re
import threading
import time

import pytest

from pdcheck.vllm.requests import messages as rm
from pdcheck.vllm.requests.handshake import HANG_WAIT_MS, DSide, HandshakeFailed, PSide, side_for
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.run import GEOMETRY, Options, run
from pdcheck.vllm.wire import AnyMeta


def test_unanswered_side_channel_is_each_releases_verdict_within_its_timeout():
    t0 = time.monotonic()
    out = run([("0.9.1", line_of("0.9.1")), ("0.34.0", line_of("0.34.0"))],
              Options(requests=3, rate=20.0, mute_side=True))
    took = time.monotonic() - t0
    by = {r.release: r for r in out}
    # 0.9.1's recv() has no timeout: its requests wait for the handshake for ever (pdcheck reports it)
    assert [o.verdict for o in by["0.9.1"].outcomes] == ["hang"] * 3
    assert "blocks in recv() with no timeout" in by["0.9.1"].outcomes[0].detail
    # 0.34.0 gives up after its 5 s recv timeout: handshake_failed under kv_load_failure_policy fail
    assert [o.verdict for o in by["0.34.0"].outcomes] == ["error"] * 3
    # as request_ready's _log_failure prints it (the request's meta in its context, the exception as exc_info), then
    # get_finished's warning (0.22+)
    said = by["0.34.0"].outcomes[0].detail
    assert said.startswith("NIXL transfer failure: handshake_failed | Context: {'failure_type': 'handshake_failed', "
                           "'request_id': "), said
    assert "exc_info: zmq.error.Again" in said and "; WARNING Skipping KV post-processing for failed request" in said
    assert [o.verdict for o in by["corrected"].outcomes] == ["recomputed"] * 3
    for r in out:
        assert r.handshake is not None and r.handshake.handshakes == 1 and r.handshake.failed
    assert by["0.34.0"].handshake.wire == "H34" and by["0.9.1"].handshake.wire == "B"
    # three lines, each one handshake that waits its release's timeout; nothing waits for the run's own limit
    assert took < 60, took


def _serve(p: PSide, stop: threading.Event) -> None:
    while not stop.is_set():
        p.poll(time.time())
        time.sleep(0.001)


@pytest.mark.parametrize(("served", "asked", "needle"), [
    ("0.9.1", "0.13.0", "RuntimeError: Failed to decode NixlHandshakePayload"),  # a bare era-B map, no wrapper
    ("0.9.1", "0.34.0", "AssertionError: len(reply_parts) == 2"),  # era H wants its timestamp frame
    ("0.26.0", "0.28.0", "RuntimeError: NIXL compatibility hash mismatch"),  # one era, another release
    # an era-H listener cannot unpack an era-G request: its thread ends (H15), D's recv times out
    ("0.34.0", "0.14.0", "zmq.error.Again: Resource temporarily unavailable"),
    ("0.11.1", "0.11.1", ""),  # the same era: decoded and validated
])
def test_reply_in_another_era_is_the_releases_decode_error(served, asked, needle):
    values = AnyMeta(engine_id="pdcheck-req-P", agent_metadata=b"agent", kv_caches_base_addr=[4096, 8192],
                     num_blocks=8, tp_size=1, block_len=GEOMETRY.block_len, block_lens=[GEOMETRY.block_len] * 2,
                     block_strides=[GEOMETRY.row_len] * 2, attn_backend_name="FLASH_ATTN", kv_cache_layout="HND",
                     device_id=0, block_size=16, ssm_sizes=(0, 0), physical_blocks_per_logical_kv_block=1)
    p = PSide("127.0.0.1", 0, values)
    p.begin(side_for(served, "127.0.0.1", p.port, GEOMETRY))
    stop = threading.Event()
    t = threading.Thread(target=_serve, args=(p, stop), daemon=True)
    t.start()
    d = DSide()
    try:
        side = side_for(asked, "127.0.0.1", p.port, GEOMETRY)
        if not needle:
            meta = d.fetch(side)
            assert (meta.agent_metadata, meta.kv_caches_base_addr, meta.num_blocks) == (b"agent", [4096, 8192], 8)
            assert meta.block_lens == [GEOMETRY.block_len] * 2
            return
        with pytest.raises(HandshakeFailed, match=re.escape(needle)) as got:
            d.fetch(side)
        line = line_of(asked)
        verdict, detail = got.value.verdict(line, 0, {"remote_block_ids": [0]})
        # handshake_failed under the release's policy: 0.13 recomputes, 0.34 fails the request
        assert verdict == ("recomputed" if line.on_failure == "recompute" else "error") and needle in detail
        assert "handshake_failed" in detail
    finally:
        stop.set()
        t.join(5)
        d.close()
        p.close()


def test_no_reply_on_a_release_without_a_recv_timeout_is_a_hang_after_pdchecks_wait():
    p = PSide("127.0.0.1", 0, AnyMeta(engine_id="e", agent_metadata=b"", kv_caches_base_addr=[], num_blocks=0))
    d = DSide()
    try:
        t0 = time.monotonic()
        with pytest.raises(HandshakeFailed) as got:  # nobody polls P's listener
            d.fetch(side_for("0.10.1", "127.0.0.1", p.port, GEOMETRY))
        # zmq's poll may wake a fraction of a millisecond before its timeout on its own clock
        assert HANG_WAIT_MS / 1e3 - 0.01 <= time.monotonic() - t0 < HANG_WAIT_MS / 1e3 + 2
        assert got.value.verdict(line_of("0.10.1"), 0, {})[0] == "hang"
        assert got.value.verdict(line_of("0.10.1"), 0, None)[0] == "recomputed"  # no params: D never needed P
    finally:
        d.close()
        p.close()


def test_side_for_maps_each_release_to_its_wire_era_and_corrected_to_the_newest():
    eras = {r: side_for(r, "h", 1, GEOMETRY) for r in ("0.9.0", "0.11.1", "0.15.1", "0.18.0", "0.26.0", "corrected")}
    assert {r: s.wire for r, s in eras.items()} == {"0.9.0": "A", "0.11.1": "F", "0.15.1": "G", "0.18.0": "G18",
                                                    "0.26.0": "H", "corrected": "H34"}
    assert eras["0.9.0"].timeout_ms is None and eras["0.11.1"].timeout_ms == 5000
    assert eras["0.9.0"].compat_hash is None and eras["corrected"].compat_hash
    assert isinstance(eras["corrected"], rm.ReqSide)


def test_push_p_handshakes_with_d_over_ds_side_channel_and_table_agrees_with_json(pdcheck):
    args = ("requests", "--vllm", "0.26.0,0.34.0", "--mode", "push", "--requests", "4", "--lease", "0.5")
    doc = pdcheck(*args, "--json", timeout=120).json()
    for rel in [*doc["releases"], doc["corrected"]]:
        assert [r["verdict"] for r in rel["rows"]] == ["delivered"] * 4, rel["rows"]
        p_hs, d_hs = rel["p_handshake"], rel["handshake"]
        # one handshake per line, at D's first PUSH_REG, to D's own listener (not P's), in the line's wire era
        assert (p_hs["handshakes"], p_hs["failed"], p_hs["wire"]) == (1, "", d_hs["wire"]), p_hs
        assert p_hs["endpoint"].startswith("tcp://127.0.0.1:") and p_hs["endpoint"] != d_hs["endpoint"]
        assert rel["accounting"]["freed"] == 4  # every WRITE went out once the handshake loaded D's agent
    table = pdcheck(*args, timeout=120)
    assert table.code == 0, table.err
    line = next(ln for ln in table.out.splitlines() if ln.startswith("P's handshakes over D's side channel"))
    assert "tcp://127.0.0.1:" in line
    assert "0.26.0 1 (era H), 0.34.0 1 (era H34), corrected 1 (era H34)" in line


def test_push_d_side_channel_that_never_answers_is_each_releases_hang_not_the_runs():
    t0 = time.monotonic()
    out = run([("0.26.0", line_of("0.26.0")), ("0.34.0", line_of("0.34.0"))],
              Options(requests=2, rate=20.0, lease_s=0.5, mode="push", mute_d_side=True))
    took = time.monotonic() - t0
    by = {r.release: r for r in out}
    for rel in ("0.26.0", "0.34.0"):
        r = by[rel]
        # P skips the WRITE: D is never told (a hang), P's blocks wait for the lease, which D's heartbeats renew
        # while D waits for the WRITE (held at the end, unless the machine stalled a renewal past the lease's
        # 2/3: tests/test_requests_heartbeats.py holds that claim in slow motion)
        assert [o.verdict for o in r.outcomes] == ["hang"] * 2, r.outcomes
        assert "P's handshake with D's side channel failed (zmq.error.Again" in r.outcomes[0].detail
        assert r.accounting.freed == 0 and r.accounting.expired + r.accounting.held == 2, r.accounting
        assert r.accounting.heartbeats > 2, r.accounting
        assert r.p_handshake is not None and "no reply from D's side channel" in r.p_handshake.failed
        assert r.handshake is not None and not r.handshake.failed  # D's handshake with P went through
    # 0.26 handshakes per request on its writer thread; 0.28+ requests wait on one handshake's future
    assert by["0.26.0"].p_handshake.handshakes == 2 and by["0.34.0"].p_handshake.handshakes == 1
    assert sum("Failed handshake to D pdcheck-req-D for push" in e for e in by["0.26.0"].notif_errors) == 2
    assert sum("NIXL transfer failure: push_handshake_failed" in e for e in by["0.34.0"].notif_errors) == 2
    # the corrected D gives up a lease after its PUSH_REG
    assert [o.verdict for o in by["corrected"].outcomes] == ["recomputed"] * 2
    # four 5 s handshakes, each the release's recv timeout; nothing waits for the run's own limit
    assert took < 60, took


def test_d_handshakes_lazily_at_the_first_request_naming_an_unknown_engine():
    """vLLM's D handshakes with P for the first request whose params name an engine it does not know
    (_ensure_handshake): no params, no handshake; a wrong remote_engine_id is a failed handshake of its own
    (handshake_setup_failed where the release checks the engine id), and the engine stays unknown."""
    from pdcheck.vllm.requests.faults import parse_all

    dropped = run([("0.34.0", line_of("0.34.0"))],
                  Options(requests=2, rate=20.0, faults=parse_all(["drop-params"], 2)))
    for r in dropped:
        assert [o.verdict for o in r.outcomes] == ["recomputed"] * 2
        assert r.handshake is not None and r.handshake.handshakes == 0, r.handshake
    wrong = run([("0.9.1", line_of("0.9.1")), ("0.34.0", line_of("0.34.0"))],
                Options(requests=3, rate=10.0, faults=parse_all(["bad-params:wrong-engine:0"], 3)))
    by = {r.release: r for r in wrong}
    # 0.9.1 checks no engine id: its one handshake serves every request
    assert by["0.9.1"].handshake is not None and by["0.9.1"].handshake.handshakes == 1
    # 0.34.0: request 0's handshake fails on the engine id, request 1 (the real engine) handshakes again
    hs = by["0.34.0"].handshake
    assert hs is not None and hs.handshakes == 2 and hs.failed.startswith(
        "NIXL transfer failure: handshake_setup_failed | Context: {'failure_type': 'handshake_setup_failed', "
        "'request_id': None, ") and hs.failed.endswith("exc_info: RuntimeError: Remote NIXL agent engine ID mismatch. "
                                                       "Expected pdcheck-req-P-other,received pdcheck-req-P."), hs
    assert [o.verdict for o in by["0.34.0"].outcomes] == ["error", "delivered", "delivered"]
    assert "handshake_failed" in by["0.34.0"].outcomes[0].detail


def test_a_heartbeat_starts_ds_lazy_handshake_from_0_22():
    """From 0.22 D's _send_heartbeats calls _ensure_handshake for the engine a held request names: the heartbeat,
    not the READ, starts the handshake, and a failed one is only logged, so each later heartbeat (every lease/6)
    starts another until the request's own, after the hold, decides. Before 0.22 nothing heartbeats: the one
    handshake is the request's, after its hold."""
    from pdcheck.vllm.requests.faults import parse_all

    faults = parse_all(["bad-params:wrong-engine:0", "hold:0.6:0"], 1)
    out = run([("0.14.0", line_of("0.14.0")), ("0.34.0", line_of("0.34.0"))],
              Options(requests=1, rate=20.0, lease_s=0.6, faults=faults))
    by = {r.release: r for r in out}
    for r in out:
        assert [o.verdict for o in r.outcomes] == [o.verdict for o in r.expected]
    assert by["0.14.0"].handshake is not None and by["0.14.0"].handshake.handshakes == 1
    hs = by["0.34.0"].handshake
    # the first heartbeat's at once, at least one more before the request's own at the hold's end
    assert hs is not None and hs.handshakes >= 3 and hs.failed.startswith(
        "NIXL transfer failure: handshake_setup_failed | Context: "), hs
    assert [o.verdict for o in by["0.34.0"].outcomes] == ["error"]
    assert "handshake_failed" in by["0.34.0"].outcomes[0].detail

