"""Pure tests of the request-path model: release lines, fault parsing, D's decisions and P's simulated blocks."""

from __future__ import annotations

import pytest

from pdcheck.errors import BadInput
from pdcheck.vllm.requests.faults import parse, parse_all
from pdcheck.vllm.requests.lines import CORRECTED, LINES, line_of
from pdcheck.vllm.requests.model import apply_bad, decide, params_for, simulate


def verdicts(version: str, faults: list[str], n: int = 8, lease: float | None = 0.5) -> list[str]:
    out, _acc = simulate(line_of(version), n, 10.0, 2, 8, lease, parse_all(faults, n))
    return [o.verdict for o in out]


def test_lines_in_order_and_facts() -> None:
    assert [ln.first for ln in LINES] == sorted(ln.first for ln in LINES)
    assert line_of("0.9.0").notification("r1") == b"r1"
    assert line_of("0.13.5").notification("r1", 2) == b"r1:2"
    assert line_of("0.10.1").expiry_s == 120 and line_of("0.11.1").expiry_s == 480
    assert line_of("0.11.0").expiry_s == 120
    assert line_of("0.9.2").expiry == "none" and line_of("0.24.0").expiry == "lease"
    assert "remote_request_id" not in line_of("0.12.0").keys and "remote_request_id" in line_of("0.13.0").keys
    assert "remote_registration_generation" in line_of("0.34.0").keys
    assert "remote_blocks_expiry_time" in line_of("0.28.0").keys and "tp_size" not in line_of("0.9.1").keys
    assert line_of("corrected") is CORRECTED
    with pytest.raises(ValueError):  # a 0.9.0 D's bare id at a 0.9.1 P
        line_of("0.9.1").parse_notification(b"req-1")


def test_params_carry_the_release_keys_only() -> None:
    p = params_for(line_of("0.9.1"), 3, [4, 5], "P", 5600, 2, None, [1, 1])
    assert set(p) == {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                      "remote_host", "remote_port"}
    p34 = params_for(line_of("0.34.0"), 3, [4, 5], "P", 5600, 2, 12.0, [1, 1])
    assert p34["remote_request_id"] == "req-3" and p34["remote_blocks_expiry_time"] is None  # vLLM's P: None
    assert params_for(CORRECTED, 3, [4, 5], "P", 5600, 2, 12.0, [1, 1])["remote_blocks_expiry_time"] == 12.0


@pytest.mark.parametrize(("text", "needle"), [
    ("nope", "unknown fault 'nope'"), ("slow-decode", "give the seconds"), ("slow-decode:0", "seconds must be"),
    ("slow-decode:inf", "seconds must be"), ("delay-notif:x", "must be a number"), ("bad-params:zap", "name the kind"),
    ("drop-notif:9", "request 9 does not exist"), ("drop-notif:1:2", "too many"),
    ("bad-params:reused-ids:0", "no earlier request"),
])
def test_bad_faults_are_one_line(text: str, needle: str) -> None:
    with pytest.raises(BadInput, match=needle):
        parse(text, 4)


def test_fault_round_trip() -> None:
    f = parse("bad-params:out-of-range:2", 4)
    assert (f.kind, f.request, f.text()) == ("out-of-range", 2, "bad-params:out-of-range:2")
    assert parse("slow-decode:1.5", 4).seconds == 1.5


def test_no_fault_everything_delivered_and_blocks_reused() -> None:
    for ln in (*LINES, CORRECTED):
        out, acc = simulate(ln, 8, 10.0, 2, 8, 0.5, ())
        assert {o.verdict for o in out} == {"delivered"}
        assert (acc.freed, acc.expired, acc.leaked, acc.reused) == (8, 0, 0, 8)


def test_slow_decode_under_a_short_lease() -> None:
    # Before 0.10 nothing frees unread blocks: slow but delivered. From 0.10 the timeout frees them and later
    # requests overwrite them: the early requests get another request's KV, the rest read freed blocks.
    assert set(verdicts("0.9.1", ["slow-decode:1.5"])) == {"delivered"}
    v = verdicts("0.11.1", ["slow-decode:1.5"])
    assert v[:4] == ["wrong"] * 4 and v[4:] == ["freed-early"] * 4
    assert verdicts("0.34.0", ["slow-decode:1.5"]) == v  # heartbeats start only once D tracks the request
    assert set(verdicts("corrected", ["slow-decode:1.5"])) == {"recomputed"}
    out, _ = simulate(line_of("0.11.1"), 8, 10.0, 2, 8, 0.5, parse_all(["slow-decode:1.5"], 8))
    assert out[0].found_request == 4 and "request 4's KV" in out[0].detail


def test_lost_notification_leaks_before_0_10() -> None:
    v = verdicts("0.9.1", ["drop-notif"])
    assert v[:4] == ["delivered"] * 4 and v[4:] == ["hang"] * 4  # P ran out of blocks
    _, acc = simulate(line_of("0.9.1"), 8, 10.0, 2, 8, 0.5, parse_all(["drop-notif"], 8))
    assert acc.leaked == 4 and acc.freed == 0
    _, acc = simulate(line_of("0.14.0"), 8, 10.0, 2, 8, 0.5, parse_all(["drop-notif"], 8))
    assert acc.leaked == 0 and acc.expired + acc.held == 8


def test_bad_params() -> None:
    assert verdicts("0.9.1", ["bad-params:reused-ids:2"])[2] == "wrong"
    assert verdicts("corrected", ["bad-params:reused-ids:2"])[2] == "recomputed"
    assert verdicts("0.9.1", ["bad-params:out-of-range:1"])[1] == "error"
    assert verdicts("0.11.1", ["bad-params:out-of-range:1"])[1] == "recomputed"
    assert verdicts("0.34.0", ["bad-params:out-of-range:1"])[1] == "error"  # kv_load_failure_policy fail
    assert verdicts("0.9.2", ["bad-params:wrong-engine:1"])[1] == "delivered"  # not checked before 0.10
    assert verdicts("0.10.0", ["bad-params:wrong-engine:1"])[1] == "error"
    assert verdicts("0.13.0", ["bad-params:missing-request-id:1"])[1] == "hang"  # WAITING_FOR_REMOTE_KVS
    assert verdicts("0.34.0", ["bad-params:missing-request-id:1"])[1] == "hang"
    assert verdicts("corrected", ["bad-params:missing-request-id:1"])[1] == "recomputed"
    assert verdicts("0.9.1", ["bad-params:missing-request-id:1"])[1] == "delivered"  # no such key yet


def test_wrong_tp_is_ignored_by_every_release_and_refused_by_the_corrected_path() -> None:
    f = parse("bad-params:wrong-tp:2", 4)
    assert (f.kind, f.request, f.text()) == ("wrong-tp", 2, "bad-params:wrong-tp:2")
    for ln in LINES:  # D knows the engine from its handshake: the params' tp_size never reaches the READ
        v = verdicts(ln.line, ["bad-params:wrong-tp:1"])
        assert v == ["delivered"] * 8, (ln.line, v)
        p = apply_bad(params_for(ln, 1, [2, 3], "P", 5600, 1, None, [1, 1]), "wrong-tp", 8, None)
        assert p["tp_size"] == 2 and decide(ln, 1, p, "P", 8, 0.0) is None
    out, acc = simulate(CORRECTED, 8, 10.0, 2, 8, 0.5, parse_all(["bad-params:wrong-tp:1"], 8))
    assert [o.verdict for o in out] == ["delivered", "recomputed"] + ["delivered"] * 6
    assert out[1].detail == ("kv_transfer_params say tp_size 2, but engine P's handshake recorded TP 1: refused, "
                             "recomputed")
    assert acc.freed == 7 and acc.expired + acc.held == 1  # unread: P frees at the lease
    ok = params_for(CORRECTED, 1, [2, 3], "P", 5600, 1, None, [1, 1])
    assert decide(CORRECTED, 1, ok, "P", 8, 0.0) is None
    assert decide(CORRECTED, 1, ok, "P", 8, 0.0, p_tp=2) == (  # P's real TP differs from what P handed out
        "recomputed", "kv_transfer_params say tp_size 1, but engine P's handshake recorded TP 2: refused, recomputed")
    del ok["tp_size"]
    got = decide(CORRECTED, 1, ok, "P", 8, 0.0)
    assert got is not None and "lack tp_size" in got[1]  # H12's fix: required, never `.get("tp_size", 1)`


def test_dropped_params_recompute_and_p_holds_until_expiry() -> None:
    assert set(verdicts("0.34.0", ["drop-params"])) == {"recomputed"}
    _, acc = simulate(line_of("0.34.0"), 8, 10.0, 2, 8, 0.5, parse_all(["drop-params"], 8))
    assert acc.freed == 0 and acc.expired + acc.held == 8


def test_decide_corrected_refuses_expired_params() -> None:
    p = params_for(CORRECTED, 0, [1], "P", 5600, 1, 1.0, [1])
    assert decide(CORRECTED, 0, p, "P", 8, 2.0) is not None
    assert decide(CORRECTED, 0, p, "P", 8, 0.5) is None
    assert decide(line_of("0.34.0"), 0, None, "P", 8, 0.0) == (
        "recomputed", "no kv_transfer_params: D prefills the prompt itself")


def test_generation_word_keeps_gen0_bytes_and_names_the_generation() -> None:
    import numpy as np

    from pdcheck.pattern import CELL, coord_word, decode_cell, pattern

    blocks = np.arange(5)
    assert (pattern(7, 1, 2, blocks, 0, 64) == pattern(7, 1, 2, blocks, 0, 64, gen=0)).all()
    assert (coord_word(7, 1, 2, blocks) == coord_word(7, 1, 2, blocks, np.zeros(5, dtype=np.int64))).all()
    tagged = pattern(7, 1, 2, blocks, 0, 64, gen=np.array([1, 2, 3, 4, 255]))
    for b, g in enumerate([1, 2, 3, 4, 255]):
        f = decode_cell(tagged[b, :CELL])
        assert (f.valid, f.block, f.gen, f.region, f.p_rank, f.tag) == (True, b, g, 2, 1, 7)
        assert f"block {b} generation {g}" in f.describe()
    assert decode_cell(pattern(7, 1, 2, blocks, 0, 64)[3, :CELL]).gen == 0
    assert not (tagged == pattern(7, 1, 2, blocks, 0, 64)).all(axis=1).any()  # another generation: other bytes


def test_check_blocks_names_the_generation_found() -> None:
    import numpy as np

    from pdcheck.geometry import Geometry
    from pdcheck.kvcache import KVCache, check_blocks
    from pdcheck.pattern import pattern

    g = Geometry(tp_size=1, block_size=4, layers=1, total_kv_heads=1, head_dim=16, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False)
    kv = KVCache(g, 4)
    assert kv.blocks3 is not None
    for r in range(g.num_regions):  # block 1 holds generation 3; the reader expects generation 2
        kv.blocks3[r, [1]] = pattern(9, 0, r, np.array([1]), 0, kv.block_len, gen=3)
    ok = check_blocks(kv, [1], [1], 9, 0, read_len=kv.block_len, gens=[3])
    assert ok.wrong == 0 and ok.checked == g.num_regions
    bad = check_blocks(kv, [1], [1], 9, 0, read_len=kv.block_len, gens=[2])
    assert bad.wrong == g.num_regions and bad.first is not None
    assert (bad.first.found.block, bad.first.found.gen, bad.first.found.valid) == (1, 3, True)


def test_share_picks_the_same_requests_per_seed() -> None:
    a, b = parse("slow-decode:1:p=0.25", 400, seed=3), parse("slow-decode:1:p=0.25", 400, seed=3)
    picked = [i for i in range(400) if a.hits(i)]
    assert picked == [i for i in range(400) if b.hits(i)] and 60 < len(picked) < 140
    assert picked != [i for i in range(400) if parse("slow-decode:1:p=0.25", 400, seed=4).hits(i)]
    with pytest.raises(BadInput, match="fraction"):
        parse("drop-notif:p=0", 4)


def test_smoke_finds_the_bundled_request_scenarios_and_their_plans_build() -> None:
    from pathlib import Path

    from pdcheck.seam import SmokeOptions
    from pdcheck.vllm import smoke as fw

    scenarios = Path(__file__).resolve().parent.parent / "scenarios"
    files = fw.requests_files(scenarios)
    assert {f.name for f in files} == {"requests-freed-early.toml", "requests-lost-notification.toml",
                                       "requests-bad-params.toml", "requests-params-dropped.toml",
                                       "requests-push-lost-completion.toml", "requests-push-slow-decode.toml",
                                       "requests-prefill-restart.toml", "requests-heartbeat-loss.toml",
                                       "requests-read-failure.toml", "requests-abort-mid-transfer.toml",
                                       "requests-push-write-failure.toml", "requests-wrong-tp-52276.toml"} | {
        f"requests-{kind}-{c}.toml" for kind in ("tp2", "hetero")
        for c in ("abort-mid-transfer", "bad-params", "freed-early", "heartbeat-loss", "lost-notification",
                  "params-dropped", "prefill-restart", "read-failure", "wrong-tp-52276")} | {
        "requests-tp2-one-consumer-lost.toml", "requests-hetero-p2-prefill-restart.toml",
        "requests-dp2-lost-notification.toml", "requests-push-tp2-lost-completion.toml",
        "requests-push-hetero-write-failure.toml", "requests-tp2-one-p-worker-restart.toml",
        "requests-push-tp2-write-failure.toml", "requests-push-hetero-lost-completion.toml",
        "requests-push-tp2-slow-decode.toml", "requests-push-hetero-slow-decode.toml",
        "requests-push-tp2-one-p-worker-restart.toml", "requests-push-tp2-one-late-registration.toml",
        "requests-push-hetero-one-late-registration.toml", "requests-push-tp2-one-write-failure.toml"}
    assert fw.requests_files(scenarios / "requests") == files
    plans = [fw.plan(f, SmokeOptions()) for f in files]
    assert all(p.expect and p.issue and "corrected" in p.expect for p in plans)
    assert not any(f.parent.name == "requests" for f in scenarios.glob("*.toml"))  # handshake globs stay clean


def test_delayed_notification_past_the_lease_is_late_and_heartbeats_count() -> None:
    out, acc = simulate(line_of("0.34.0"), 4, 10.0, 2, 8, 0.3, parse_all(["delay-notif:0.8"], 4))
    assert {o.verdict for o in out} == {"delivered"}
    assert (acc.expired, acc.late_notifs, acc.freed, acc.heartbeats) == (4, 4, 0, 4)
    _, acc = simulate(line_of("0.14.0"), 4, 10.0, 2, 8, 0.3, parse_all(["delay-notif:0.8"], 4))
    assert acc.heartbeats == 0 and acc.late_notifs == 4


def test_a_late_notification_kills_0_10_0s_engine_core() -> None:
    """0.10.0's P raises KeyError on a done notification for blocks the abort timeout freed: its engine core dies,
    so it frees and admits nothing after it (later requests hang, what it held stays held); 0.10.1 logs it."""
    faults = parse_all(["delay-notif:0.7:0", "slow-decode:0.6:1"], 4)  # request 1 read at 1.1 s, after the death
    out, acc = simulate(line_of("0.10.0"), 4, 2.0, 2, 4, 5.0, faults)
    assert (acc.late_notifs, acc.engine_died, acc.expired, acc.freed) == (0, 0, 0, 4)  # no expiry yet: nothing late
    out, acc = simulate(line_of("0.10.0"), 4, 2.0, 2, 4, 0.3, faults)
    assert (acc.late_notifs, acc.engine_died, acc.expired, acc.freed) == (1, 1, 1, 0)
    assert [o.verdict for o in out] == ["delivered", "delivered", "hang", "hang"]
    assert acc.held == 1  # request 1's blocks: its notification came after P died, its expiry never runs
    out, acc = simulate(line_of("0.10.1"), 4, 2.0, 2, 4, 0.3, faults)
    assert (acc.late_notifs, acc.engine_died) == (2, 0) and [o.verdict for o in out] == [
        "delivered", "freed-early", "delivered", "delivered"]
    assert line_of("0.10.0").late_notif == "raises" and line_of("0.10.1").late_notif == "logged"


def test_failure_policy_applies_from_0_13() -> None:
    from pdcheck.vllm.requests.lines import with_policy

    faults = parse_all(["bad-params:out-of-range:1"], 3)
    for version, policy, want in (("0.34.0", None, "error"), ("0.34.0", "recompute", "recomputed"),
                                  ("0.14.0", "fail", "error"), ("0.11.1", "fail", "recomputed")):
        out, _ = simulate(with_policy(line_of(version), policy), 3, 10.0, 2, 8, 0.5, faults)
        assert out[1].verdict == want, (version, policy)
    assert with_policy(CORRECTED, "fail") is CORRECTED


def test_failure_policy_default_turns_fail_at_0_17() -> None:
    # config/kv_transfer.py: "recompute" in 0.14.0, 0.15.0, 0.15.1, 0.16.0; "fail" in 0.17.0, 0.20.0, 0.24.0, 0.26.0
    faults = parse_all(["bad-params:out-of-range:1"], 3)
    for version, want in (("0.14.0", "recomputed"), ("0.16.0", "recomputed"), ("0.17.0", "error"),
                          ("0.23.0", "error"), ("0.26.0", "error")):
        out, _ = simulate(line_of(version), 3, 10.0, 2, 8, 0.5, faults)
        assert out[1].verdict == want, version


# Push mode (NixlPushConnector, 0.24+): pdcheck.vllm.requests.push


def push_verdicts(version: str, faults: list[str], n: int = 8, lease: float | None = 0.5) -> list[str]:
    from pdcheck.vllm.requests import push

    out, _acc = push.simulate(line_of(version), n, 10.0, 2, 8, lease, parse_all(faults, n))
    return [o.verdict for o in out]


def test_push_registration_and_completion_formats() -> None:
    import msgspec

    from pdcheck.vllm.requests import push

    p = push.params(line_of("0.34.0"), 0, [4, 5], "P", 5600, 1, None, [1, 1], "req-1.0")
    raw = push.registration(push.d_request_id("req-1.0"), "D", "127.0.0.1", 5601, [7, 9], p)
    assert raw.startswith(b"PUSH_REG:")
    reg = msgspec.msgpack.decode(raw[len(b"PUSH_REG:"):])
    assert set(reg) == {"request_id", "decode_engine_id", "decode_host", "decode_port", "decode_tp_size",
                        "local_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_tp_size",
                        "remote_pp_size"}
    assert reg["local_block_ids"] == [[7, 9]] and reg["remote_engine_id"] == "P"
    assert (reg["decode_host"], reg["decode_port"]) == ("127.0.0.1", 5601)  # D's side channel: P handshakes there
    got = push.parse_registration(raw)
    assert isinstance(got, push.Registration) and (got.engine_id, got.host, got.port) == ("D", "127.0.0.1", 5601)
    rid, blocks = got.request_id, got.blocks
    assert blocks == [7, 9] and rid != "req-1.0" and push.base_id(rid) == "req-1.0"  # vLLM's -<8 hex> suffix
    assert push.base_id("req-1.0") == "req-1.0"
    flat = push.parse_registration(b"PUSH_REG:" + msgspec.msgpack.encode({"request_id": "r", "local_block_ids":
                                                                          [1, 2]}))
    assert flat == push.Registration("r", [1, 2])  # flat: 1 group; no side channel named: P's handshake fails
    assert "decode" in push.parse_registration(b"PUSH_REG:\xc1")  # not msgpack: dropped, with vLLM's log line
    assert "missing request_id" in push.parse_registration(b"PUSH_REG:" + msgspec.msgpack.encode([1]))
    assert push.completion("req-1.0-0a1b2c3d") == b"req-1.0-0a1b2c3d:1"
    assert push.expected_notifs(p_tp=4, d_world=2, pp_size=2) == 4  # PP prefill (#45880): one per stage


def test_push_params_per_line() -> None:
    import msgspec

    from pdcheck.vllm.requests import push

    p26 = push.params(line_of("0.26.0"), 0, [1], "P", 5600, 1, 3.0, [1])
    assert "transfer_mode" not in p26 and "remote_blocks_expiry_time" not in p26 and p26["pp_size"] == 1
    p34 = push.params(line_of("0.34.0"), 0, [1], "P", 5600, 1, 3.0, [1])
    assert p34["transfer_mode"] == "push" and "dcp_size" in p34 and "remote_blocks_expiry_time" not in p34
    pc = push.params(CORRECTED, 0, [1], "P", 5600, 1, 3.0, [1])
    assert pc["remote_blocks_expiry_time"] == 3.0 and pc["block_generations"] == [1]
    assert not push.available((0, 23, 0)) and push.available((0, 24, 0))
    # 0.24/0.25: no pp_size in the params nor remote_pp_size in PUSH_REG; D done at P's first notification
    p24 = push.params(line_of("0.25.0"), 0, [1], "P", 5600, 1, 3.0, [1])
    assert set(p26) - set(p24) == {"pp_size"} and set(p24) <= set(p26)
    reg = {v: msgspec.msgpack.decode(push.registration("r", "D", "h", 1, [1], p, line_of(v))[len(b"PUSH_REG:"):])
           for v, p in (("0.25.0", p24), ("0.26.0", p26))}
    assert set(reg["0.26.0"]) - set(reg["0.25.0"]) == {"remote_pp_size"}
    assert [push.expected_notifs(4, 1, 2, line_of(v)) for v in ("0.24.0", "0.26.0")] == [1, 8]


def test_push_no_fault_delivered_and_p_frees_on_its_write() -> None:
    from pdcheck.vllm.requests import push

    for version in ("0.24.0", "0.26.0", "0.34.0", "corrected"):
        out, acc = push.simulate(line_of(version), 8, 10.0, 2, 8, 0.5, ())
        assert {o.verdict for o in out} == {"delivered"}
        assert (acc.freed, acc.expired, acc.late_notifs) == (8, 0, 0)


def test_push_lost_completion_hangs_d_not_p() -> None:
    from pdcheck.vllm.requests import push

    v = push_verdicts("0.34.0", ["drop-notif:2"])
    assert v == ["delivered"] * 2 + ["hang"] + ["delivered"] * 5
    out, acc = push.simulate(line_of("0.26.0"), 8, 10.0, 2, 8, 0.5, parse_all(["drop-notif"], 8))
    assert {o.verdict for o in out} == {"hang"} and "PR #50754" in out[0].detail
    assert (acc.freed, acc.expired, acc.leaked, acc.held) == (8, 0, 0, 0)  # P freed on its WRITE: clean
    assert push_verdicts("corrected", ["drop-notif:2"])[2] == "recomputed"
    assert set(push_verdicts("0.34.0", ["delay-notif:0.8"])) == {"delivered"}  # late, but P does not wait


def test_push_slow_decode_hangs_instead_of_wrong_kv() -> None:
    from pdcheck.vllm.requests import push

    assert verdicts("0.34.0", ["slow-decode:1.5:2"])[2] in ("wrong", "freed-early")  # pull
    v = push_verdicts("0.34.0", ["slow-decode:1.5:2"])
    assert v[2] == "hang" and v.count("delivered") == 7
    out, acc = push.simulate(line_of("0.34.0"), 8, 10.0, 2, 8, 0.5, parse_all(["slow-decode:1.5:2"], 8))
    assert "before D's PUSH_REG" in out[2].detail and (acc.expired, acc.late_notifs) == (1, 1)
    assert push_verdicts("corrected", ["slow-decode:1.5:2"])[2] == "recomputed"
    assert set(push_verdicts("0.34.0", ["slow-decode:0.2"])) == {"delivered"}  # within the lease


def test_push_bad_and_dropped_params() -> None:
    # D never reads P's blocks in push mode: P's block ids in the params do not matter
    assert push_verdicts("0.34.0", ["bad-params:reused-ids:1", "bad-params:out-of-range:2"])[1:3] == \
        ["delivered", "delivered"]
    assert push_verdicts("0.26.0", ["bad-params:missing-request-id:1"])[1] == "delivered"  # no heartbeat only
    assert push_verdicts("corrected", ["bad-params:missing-request-id:1"])[1] == "recomputed"
    assert push_verdicts("0.34.0", ["bad-params:wrong-engine:1"])[1] == "error"  # push_reg_handshake_failed
    # PUSH_REG's remote_tp_size only feeds a known engine's no-op _ensure_handshake; P WRITEs by decode_tp_size
    assert push_verdicts("0.26.0", ["bad-params:wrong-tp:1"])[1] == "delivered"
    assert push_verdicts("corrected", ["bad-params:wrong-tp:1"])[1] == "recomputed"
    from pdcheck.vllm.requests import push

    out, acc = push.simulate(line_of("0.34.0"), 8, 10.0, 2, 8, 0.5, parse_all(["drop-params"], 8))
    assert {o.verdict for o in out} == {"recomputed"} and acc.freed == 0 and acc.expired + acc.held == 8


def test_push_mode_plan_refuses_releases_before_0_24() -> None:
    from pdcheck.vllm.requests.plan import build

    with pytest.raises(BadInput, match=r"vLLM 0.23.0 has no push mode \(NixlPushConnector arrived in 0.24.0\); "
                                       r"name 0.24\+ releases"):
        build(None, {}, "0.23.0,0.34.0", {"mode": "push"}, [])
    assert [r for r, _ in build(None, {}, "0.24.0,0.25.0", {"mode": "push"}, []).releases] == ["0.24.0", "0.25.0"]
    with pytest.raises(BadInput, match="mode must be pull or push"):
        build(None, {"requests": {"mode": "both"}}, "0.34.0", {}, [])
    plan = build(None, {}, "all", {"mode": "push"}, [])  # 'all': every release that has push mode
    assert plan.options.mode == "push" and plan.releases[0][0] == "0.24.0"
    assert build(None, {}, "0.34.0", {}, []).options.mode == "pull"


def test_push_hung_requests_hold_d_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcheck.vllm.requests import push

    monkeypatch.setattr(push, "D_POOL_MAX", 4)  # D gets max(pool 8, 4) = 8 blocks: four requests' worth
    out, _ = push.simulate(line_of("0.34.0"), 6, 1.0, 2, 8, 0.5, parse_all(["drop-notif"], 6))
    assert [o.verdict for o in out] == ["hang"] * 6
    assert "PR #50754" in out[3].detail and "D's 8 KV blocks" in out[4].detail  # then D has none to register
    out, _ = push.simulate(CORRECTED, 6, 1.0, 2, 8, 0.5, parse_all(["drop-notif"], 6))
    assert {o.verdict for o in out} == {"recomputed"}  # the corrected D gives its blocks back at the lease
@pytest.mark.parametrize(("text", "needle"), [
    ("restart-p", "name the request"), ("restart-p:p=0.5", "name the request"), ("restart-p:7", "does not exist"),
    ("restart-p:1:rank=-1", "rank= takes a P TP rank"), ("restart-p:1:rank=x", "rank= takes a P TP rank"),
    ("restart-p:1:2", "too many"), ("hold", "give the seconds"), ("heartbeat-loss:0", "seconds must be"),
    ("read-fail:x", "must be an integer"), ("abort-d:9", "request 9 does not exist"),
])
def test_bad_new_faults_are_one_line(text: str, needle: str) -> None:
    with pytest.raises(BadInput, match=needle):
        parse(text, 4)


def test_restart_p_every_release_reads_from_the_dead_agent_corrected_rehandshakes() -> None:
    f = parse("restart-p:2:rank=0", 5)
    assert (f.request, f.rank, f.text()) == (2, 0, "restart-p:2:rank=0")
    want = {"0.9.1": ["delivered"] * 2 + ["error"] * 3, "0.11.1": ["delivered"] * 2 + ["recomputed"] * 3,
            "0.34.0": ["delivered"] * 2 + ["error"] * 3, "corrected": ["delivered"] * 2 + ["recomputed"]
            + ["delivered"] * 2}
    for version, verdicts_ in want.items():
        out, acc = simulate(line_of(version), 5, 10.0, 2, 8, None, parse_all(["restart-p:2"], 5))
        assert [o.verdict for o in out] == verdicts_, version
        assert (acc.restarts, acc.lost) == (1, 1)  # request 2's blocks died with the old P
    _, acc = simulate(line_of("0.9.1"), 5, 10.0, 2, 8, None, parse_all(["restart-p:2"], 5))
    assert acc.leaked == 2 and acc.freed == 2  # the new P's requests are never read or notified: a leak
    out, _ = simulate(line_of("0.34.0"), 5, 10.0, 2, 8, None, parse_all(["restart-p:2"], 5))
    assert "NIXL_ERR_REMOTE_DISCONNECT" in out[3].detail and "kv_load_failure_policy fail" in out[3].detail


def test_hold_renews_the_lease_from_0_22_heartbeat_loss_frees_under_it() -> None:
    faults = ["hold:1.2:1", "heartbeat-loss:1.2:3"]
    assert verdicts("0.14.0", faults, 6) == ["delivered", "freed-early", "delivered", "freed-early", "delivered",
                                              "delivered"]
    for version in ("0.22.0", "0.24.0", "0.34.0"):
        assert verdicts(version, faults, 6) == ["delivered"] * 3 + ["freed-early"] + ["delivered"] * 2
    assert verdicts("corrected", faults, 6) == ["delivered"] * 3 + ["recomputed"] + ["delivered"] * 2
    assert verdicts("0.9.1", faults, 6) == ["delivered"] * 6
    _, acc = simulate(line_of("0.34.0"), 6, 10.0, 2, 8, 0.6, parse_all(["hold:1.2:1"], 6))
    assert acc.heartbeats == 6 + 12  # one per request, plus one every lease/6 while request 1 is held


def test_read_fail_per_release_policy_and_p_never_told() -> None:
    assert verdicts("0.9.1", ["read-fail:1"], 4) == ["delivered", "error", "delivered", "delivered"]
    assert verdicts("0.11.1", ["read-fail:1"], 4)[1] == "recomputed"
    assert verdicts("0.34.0", ["read-fail:1"], 4)[1] == "error"
    assert verdicts("corrected", ["read-fail:1"], 4)[1] == "recomputed"
    _, acc = simulate(line_of("0.9.1"), 4, 10.0, 2, 8, 0.5, parse_all(["read-fail:1"], 4))
    assert acc.leaked == 1  # the notification rides on the READ: nothing frees its blocks before 0.10


def test_abort_d_frees_under_the_read_before_0_16() -> None:
    from pdcheck.vllm.requests.lines import abort_waits_read

    for version, under in (("0.14.0", 1), ("0.15.0", 1), ("0.16.0", 0), ("0.24.0", 0), ("0.34.0", 0),
                           ("corrected", 0)):
        out, acc = simulate(line_of(version), 4, 10.0, 2, 8, None, parse_all(["abort-d:1"], 4))
        assert [o.verdict for o in out] == ["delivered", "aborted", "delivered", "delivered"]
        assert acc.d_freed_in_flight == under and acc.freed == 4, version  # P is notified either way
        assert abort_waits_read(line_of(version)) == (not under)


def test_push_failed_write_hangs_d_and_ds_heartbeats_keep_ps_blocks() -> None:
    from pdcheck.vllm.requests import push

    for version in ("0.26.0", "0.34.0"):
        out, acc = push.simulate(line_of(version), 8, 10.0, 2, 8, 0.5, parse_all(["read-fail:2"], 8))
        assert [o.verdict for o in out] == ["delivered"] * 2 + ["hang"] + ["delivered"] * 5, version
        assert "transfer_setup_failed" in out[2].detail and "never told" in out[2].detail
        # no handle kept: P's blocks wait for the lease, which D's heartbeats renew while it waits for the WRITE
        # (finished_recving never comes): still held at the run's end
        assert (acc.freed, acc.expired, acc.held, acc.late_notifs) == (7, 0, 1, 0)
        # without heartbeats (lost) the lease frees them
        _out, acc = push.simulate(line_of(version), 8, 10.0, 2, 8, 0.5,
                                  parse_all(["read-fail:2", "heartbeat-loss:0.01:2"], 8))
        assert (acc.freed, acc.expired, acc.held) == (7, 1, 0)
    assert push_verdicts("corrected", ["read-fail:2"])[2] == "recomputed"  # D's watchdog at the lease


def test_push_hold_heartbeats_keep_the_lease_lost_ones_leave_the_registration_unmatched() -> None:
    from pdcheck.vllm.requests import push

    faults = ["hold:1:2", "heartbeat-loss:1:4"]
    for version in ("0.26.0", "0.34.0"):
        out, acc = push.simulate(line_of(version), 8, 10.0, 2, 8, 0.5, parse_all(faults, 8))
        assert [o.verdict for o in out] == ["delivered"] * 4 + ["hang"] + ["delivered"] * 3, version
        assert "before D's PUSH_REG" in out[4].detail and acc.late_notifs == 1 and acc.expired == 1
        # one at on_new_request per request but 4 (lost), plus one every lease/6 while request 2 is held
        assert acc.heartbeats == 7 + int(1 // (0.5 / 6))
    out, acc = push.simulate(CORRECTED, 8, 10.0, 2, 8, 0.5, parse_all(faults, 8))
    assert [o.verdict for o in out][2:5] == ["delivered", "delivered", "recomputed"] and acc.late_notifs == 0
    assert "heartbeats were lost" in out[4].detail  # no PUSH_REG once the unrenewed lease passed


def test_push_abort_after_registration_frees_d_blocks_under_the_write() -> None:
    from pdcheck.vllm.requests import push

    for version, under in (("0.26.0", 1), ("0.34.0", 1), ("corrected", 0)):
        line = CORRECTED if version == "corrected" else line_of(version)
        out, acc = push.simulate(line, 4, 10.0, 2, 8, 0.5, parse_all(["abort-d:1"], 4))
        assert [o.verdict for o in out] == ["delivered", "aborted", "delivered", "delivered"], version
        # P is never told of the abort: it WRITEs into D's blocks and frees its own on its WRITE, as usual
        assert (acc.d_freed_in_flight, acc.freed, acc.expired) == (under, 4, 0), version
    assert "freed its blocks at once" in push.abort_detail(line_of("0.34.0"))


def test_push_mode_takes_every_fault() -> None:
    from pdcheck.vllm.requests.faults import NAMES
    from pdcheck.vllm.requests.plan import build

    items = ["read-fail:1", "hold:1:2", "heartbeat-loss:1:3", "abort-d:4", "restart-p:5", "slow-decode:1:6",
             "drop-notif:7", "delay-notif:1:0", "bad-params:wrong-engine:1", "drop-params:2"]
    assert {x.split(":")[0] for x in items} == set(NAMES)
    plan = build(None, {}, "0.34.0", {"mode": "push"}, items)
    assert plan.options.mode == "push" and len(plan.options.faults) == len(items)


def test_push_restart_p_registrations_go_to_the_dead_agent_corrected_rehandshakes() -> None:
    from pdcheck.vllm.requests import push

    for version in ("0.26.0", "0.34.0"):
        out, acc = push.simulate(line_of(version), 5, 10.0, 2, 8, 0.5, parse_all(["restart-p:2"], 5))
        assert [o.verdict for o in out] == ["delivered"] * 2 + ["hang"] * 3, version
        assert "push_reg_notif_failed" in out[3].detail and "NIXL_ERR_REMOTE_DISCONNECT" in out[3].detail
        # request 2's blocks died with P; the new P's never see a PUSH_REG and wait for the lease
        assert (acc.restarts, acc.lost, acc.freed, acc.expired) == (1, 1, 2, 2)
    out, acc = push.simulate(CORRECTED, 5, 10.0, 2, 8, 0.5, parse_all(["restart-p:2"], 5))
    assert [o.verdict for o in out] == ["delivered"] * 2 + ["recomputed"] + ["delivered"] * 2
    assert "re-handshakes" in out[2].detail and (acc.freed, acc.expired) == (4, 0)
    p = push.params(CORRECTED, 0, [1], "P", 5600, 1, 3.0, [1], "r", 2)
    assert p["remote_registration_generation"] == 2  # the corrected path counts P processes
    assert "remote_registration_generation" not in push.params(line_of("0.34.0"), 0, [1], "P", 5600, 1, None, [1])


def test_model_and_real_ranks_disagreeing_is_a_harness_error_naming_the_request() -> None:
    import io

    from rich.console import Console

    from pdcheck.vllm.requests import report
    from pdcheck.vllm.requests.model import Accounting, Outcome
    from pdcheck.vllm.requests.plan import RequestsPlan
    from pdcheck.vllm.requests.run import LineRun, Options

    def line_run(release: str, got: list[str], want: list[str]) -> LineRun:
        return LineRun(release, release, [Outcome(i, v) for i, v in enumerate(got)],
                       [Outcome(i, v) for i, v in enumerate(want)], Accounting(), Accounting(), 2.0, [], [], 1.0, 0.0)

    plan = RequestsPlan("flags", "flags", "", [("0.34.0", line_of("0.34.0"))], Options(requests=2), {})
    agree = report.build(plan, [line_run("0.34.0", ["delivered"] * 2, ["delivered"] * 2),
                                line_run("corrected", ["delivered"] * 2, ["delivered"] * 2)])
    assert agree.exit_code == 0 and agree.harness_errors == []
    rep = report.build(plan, [line_run("0.34.0", ["delivered", "freed-early"], ["delivered"] * 2),
                              line_run("corrected", ["delivered"] * 2, ["delivered"] * 2)])
    assert rep.exit_code == 3  # not 1: the run's own verdicts cannot be trusted
    assert rep.harness_errors == ["vLLM 0.34.0 request 1: the real ranks gave freed-early, the model delivered"]
    buf = io.StringIO()
    report.render(rep, Console(file=buf, width=200))
    assert "harness error: vLLM 0.34.0 request 1: the real ranks gave freed-early" in buf.getvalue()


def test_log_texts_start_where_the_wheels_print_them() -> None:
    from pdcheck.vllm.requests import texts

    ctx = {"request_id": "r", "engine_id": "D"}
    assert texts.failure_log("0.13.0", "transfer_setup_failed", ctx) is None  # free text before _log_failure
    assert texts.failure_log("0.29.0", "transfer_setup_failed", ctx) == (
        "NIXL transfer failure: transfer_setup_failed. Marking blocks as invalid | Context: "
        "{'failure_type': 'transfer_setup_failed', 'request_id': 'r', 'engine_id': 'D'}")
    assert "Deferring failure reporting until outstanding transfers finish |" in str(
        texts.failure_log("0.30.0", "transfer_setup_failed", ctx))
    assert texts.failure_log("0.26.0", "transfer_failed", ctx).startswith(  # type: ignore[union-attr]
        "NIXL transfer failure: transfer_failed. Marking blocks as invalid | Context: {'failure_type'")
    assert texts.failure_log("0.34.0", "transfer_failed", ctx).startswith(  # type: ignore[union-attr]
        "NIXL transfer failure: transfer_failed | Context:")
    assert texts.skipping("0.21.0", "r") is None and texts.skipping("0.22.0", "r") == (
        "Skipping KV post-processing for failed request r")
    assert texts.unrecognized("0.10.0", "r") is None  # 0.10.0's P raises KeyError instead: texts.engine_died
    assert texts.engine_deaths([texts.engine_died("r"), "other"]) == 1
    assert texts.unrecognized("0.9.2", "r") is None and texts.unrecognized("0.10.1", "r") == (
        "Potentially invalid KV blocks for unrecognized request r were retrieved by a decode worker. They may "
        "have expired.")
