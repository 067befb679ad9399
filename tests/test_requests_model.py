"""Pure tests of the request-path model: release lines, fault parsing, D's decisions and P's simulated blocks."""

from __future__ import annotations

import pytest

from pdcheck.errors import BadInput
from pdcheck.requests.faults import parse, parse_all
from pdcheck.requests.lines import CORRECTED, LINES, line_of
from pdcheck.requests.model import decide, params_for, simulate


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
    assert verdicts("0.13.0", ["bad-params:missing-request-id:1"])[1] == "error"
    assert verdicts("0.34.0", ["bad-params:missing-request-id:1"])[1] == "recomputed"
    assert verdicts("0.9.1", ["bad-params:missing-request-id:1"])[1] == "delivered"  # no such key yet


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

    from pdcheck.kvcache import CELL, coord_word, decode_cell, pattern

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
    from pdcheck.kvcache import KVCache, check_blocks, pattern

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

    from pdcheck import smoke

    scenarios = Path(__file__).resolve().parent.parent / "scenarios"
    files = smoke.requests_files(scenarios)
    assert {f.name for f in files} == {"requests-freed-early.toml", "requests-lost-notification.toml",
                                       "requests-bad-params.toml", "requests-params-dropped.toml"}
    assert smoke.requests_files(scenarios / "requests") == files
    plans = smoke.requests_plans(scenarios)
    assert all(p.expect and p.issue and "corrected" in p.expect for p in plans)
    assert not any(f.parent.name == "requests" for f in scenarios.glob("*.toml"))  # handshake globs stay clean


def test_delayed_notification_past_the_lease_is_late_and_heartbeats_count() -> None:
    out, acc = simulate(line_of("0.34.0"), 4, 10.0, 2, 8, 0.3, parse_all(["delay-notif:0.8"], 4))
    assert {o.verdict for o in out} == {"delivered"}
    assert (acc.expired, acc.late_notifs, acc.freed, acc.heartbeats) == (4, 4, 0, 4)
    _, acc = simulate(line_of("0.14.0"), 4, 10.0, 2, 8, 0.3, parse_all(["delay-notif:0.8"], 4))
    assert acc.heartbeats == 0 and acc.late_notifs == 4


def test_failure_policy_applies_from_0_13() -> None:
    from pdcheck.requests.lines import with_policy

    faults = parse_all(["bad-params:out-of-range:1"], 3)
    for version, policy, want in (("0.34.0", None, "error"), ("0.34.0", "recompute", "recomputed"),
                                  ("0.14.0", "fail", "error"), ("0.11.1", "fail", "recomputed")):
        out, _ = simulate(with_policy(line_of(version), policy), 3, 10.0, 2, 8, 0.5, faults)
        assert out[1].verdict == want, (version, policy)
    assert with_policy(CORRECTED, "fail") is CORRECTED
