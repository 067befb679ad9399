"""Slow motion (`--time-scale`, $PDCHECK_TIME_SCALE; docs/requests.md): every scenario length stretched, the same
verdicts. The model's side is pure (every bundled request-path scenario at K = 1 and K = 3); the CLI's side is a
real run at K = 2 whose report says the lengths as run. A line the machine stalls past a third of its shortest
length runs again in slower motion (pdcheck.vllm.requests.stall): a real line whose parent is held shows it."""

from __future__ import annotations

import os
import re
import threading

import msgspec
import pytest
from conftest import SCENARIOS
from loadkit import scaled

from pdcheck.errors import BadInput
from pdcheck.scenariofile import read_toml
from pdcheck.vllm.requests.faults import parse_all
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.plan import TIME_SCALE_ENV, build, time_scale
from pdcheck.vllm.requests.run import Options, expected, run
from pdcheck.vllm.requests.stall import AGAIN, SHARE, StallClock, Voided, shortest, void_note, voids

REQUEST_SCENARIOS = sorted((SCENARIOS / "requests").glob("*.toml"))


def test_scaled_stretches_every_scenario_length_and_nothing_else() -> None:
    o = Options(requests=5, rate=10.0, lease_s=0.5, faults=parse_all(["slow-decode:1.5:2", "drop-notif:3"], 5),
                settle_s=0.5)
    k = o.scaled(3.0)
    assert (k.rate, k.lease_s, k.settle_s, k.time_scale) == (pytest.approx(10 / 3), 1.5, 1.5, 3.0)
    assert [(f.name, f.seconds, f.request) for f in k.faults] == [("slow-decode", 4.5, 2), ("drop-notif", 0.0, 3)]
    assert (k.requests, k.pool, k.blocks_per_request) == (o.requests, o.pool, o.blocks_per_request)
    assert o.scaled(1.0) is o and Options(lease_s=None).scaled(2.0).lease_s is None  # the release's own default
    assert k.scaled(2.0).time_scale == 6.0
    # the lease extension's slow motion: the stretched lease's, never a release default's
    assert k.lease_scale == 3.0 and Options(lease_s=None).scaled(3.0).lease_scale == 1.0


def test_lease_extension_keeps_the_scenarios_whole_seconds() -> None:
    """vLLM's `kv_lease_duration * 2 // 3`: a 1 s lease is never extended, a 3 s one by 2 s, at any K."""
    line = line_of("0.34.0")
    assert line.lease_extension(1.0) == 0 and line.lease_extension(3.0) == 2
    assert line.lease_extension(3.0, 3.0) == 0  # a 1 s lease in slow motion
    assert line.lease_extension(9.0, 3.0) == 6  # a 3 s one
    assert line.lease_extension(1.5, 3.0) == pytest.approx(1.0)  # sub-second (0.5 s): its 2/3, stretched


@pytest.mark.parametrize("path", REQUEST_SCENARIOS, ids=[p.stem for p in REQUEST_SCENARIOS])
def test_every_bundled_scenario_has_the_same_verdicts_in_slow_motion(path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIME_SCALE_ENV)  # K = 1 as written, not the machine's slow motion
    doc = read_toml(path)
    one, three = build(path, doc, None, {}, []), build(path, doc, None, {"time_scale": 3.0}, [])
    assert three.options.time_scale == 3.0 and one.options.time_scale == 1.0
    for (name, line), _ in zip(one.releases, three.releases, strict=True):
        for ln in (line, line_of("corrected")):
            (a, acc_a), (b, acc_b) = expected(ln, one.options), expected(ln, three.options)
            # whose KV a `wrong` request finds may change with the order of equal-time events (float sums of
            # stretched gaps); the verdicts never do (docs/scenarios-and-flags.md, the freed-early scenarios)
            assert [(o.request, o.rank, o.verdict) for o in a] == [(o.request, o.rank, o.verdict) for o in b], \
                (path.stem, name)
            assert msgspec.structs.asdict(acc_a) == msgspec.structs.asdict(acc_b), (path.stem, name)


def test_flag_env_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIME_SCALE_ENV, raising=False)
    assert time_scale(None) == 1.0
    monkeypatch.setenv(TIME_SCALE_ENV, "2.5")
    assert time_scale(None) == 2.5 and time_scale(4.0) == 4.0  # the flag over the environment
    for bad, says in (("0.5", "out of range (>= 1, <= 20)"), ("abc", "give a number from 1 to 20"),
                      ("nan", "out of range")):
        monkeypatch.setenv(TIME_SCALE_ENV, bad)
        with pytest.raises(BadInput, match=re.escape(says)) as e:
            time_scale(None)
        assert TIME_SCALE_ENV in str(e.value)
    with pytest.raises(BadInput, match="--time-scale: time scale = 21"):
        time_scale(21.0)


def test_a_real_run_in_slow_motion_says_its_lengths(pdcheck) -> None:
    # twice the machine's own slow motion (the flag wins over the environment; 1.0 on an idle machine): a
    # fixed K = 2 at load 20 let the router run 1.4 s late
    k = 2 * float(os.environ[TIME_SCALE_ENV])
    run = pdcheck("requests", "requests-freed-early", "--vllm", "0.34.0", "--time-scale", f"{k:g}", "--json")
    doc = run.json()
    assert run.code == 1 and not doc["harness_errors"], run.said  # 0.34.0 loses requests; the model agrees
    assert doc["time_scale"] == k and doc["lease_s"] == 0.5 * k and doc["rate"] == pytest.approx(10 / k)
    assert doc["faults"][:1] == [f"slow-decode:{1.5 * k:g}:0"]
    assert [e["passed"] for e in doc["expectations"]] == [True] * len(doc["expectations"])
    table = pdcheck("requests", "requests-wrong-tp-52276", "--vllm", "0.34.0", "--time-scale", "1.5")
    assert "every length x1.5 (--time-scale)" in table.out.splitlines()[0], table.out
    bad = pdcheck("requests", "requests-freed-early", "--time-scale", "0")
    assert bad.code == 2 and bad.err.strip() == \
        "pdcheck: error: --time-scale: time scale = 0.0 is out of range (>= 1, <= 20)", bad.err


def test_which_stall_voids_a_line() -> None:
    # the lengths a verdict rests on: the scenario's lease and each timed fault's seconds; none: nothing to void
    assert shortest(0.5, [1.5, 0.0]) == 0.5 and shortest(None, [0.8]) == 0.8 and shortest(None, [0.0]) is None
    assert voids(0.17, 0.5, 1.0, 0) and not voids(0.16, 0.5, 1.0, 0) and not voids(5.0, None, 1.0, 0)
    assert not voids(5.0, 0.5, 1.0, 3)  # three voided runs: the fourth stands
    assert not voids(0.5, 0.5, 14.0, 0) and voids(0.5, 0.5, 13.0, 0)  # the bound (20) stops the slowing
    assert void_note(Voided(1.0, 0.41, 0.5)) == ("the machine stalled the run 0.41 s at x1, over a third of its "
                                                 "shortest length (0.5 s): that run's timing is void, the line ran "
                                                 "again at x1.5")
    with StallClock() as clock:
        pass
    assert 0.0 <= clock.worst < 1.0


def test_a_line_the_machine_stalls_runs_again_in_slow_motion() -> None:
    # A real line whose parent stops for 0.8 s (a C call that keeps the GIL, as a process given no core): the
    # stall outgrows a third of the lease, the run is void, and the line runs again in slower motion.
    import ctypes

    held = threading.Event()

    def hold() -> None:
        ctypes.PyDLL(None).usleep(800_000)  # PyDLL: the GIL stays held for the call
        held.set()

    def tick(_stage: str, done: int, _total: int, note: str) -> None:
        if done == 0 and " again " not in note and not held.is_set():
            threading.Timer(0.2, hold).start()  # inside the first line's run (its handshake, its requests)

    opts = scaled(Options(requests=4, rate=10.0, lease_s=0.4))
    assert 0.8 > SHARE * opts.lease_s  # the held 0.8 s voids the first run at the suite's slow motion
    out = run([("0.34.0", line_of("0.34.0"))], opts, tick)
    assert held.is_set()
    line = out[0]
    assert line.voided[0].time_scale == opts.time_scale and line.voided[0].stall_s >= 0.75, line.voided
    assert line.voided[0].length_s == opts.lease_s
    assert line.time_scale >= AGAIN * opts.time_scale and line.stall_s <= SHARE * opts.lease_s * line.time_scale / \
        opts.time_scale
    # the verdicts are the steady run's, and the model (at its lengths) agrees with them
    assert [o.verdict for o in line.outcomes] == [e.verdict for e in line.expected] == ["delivered"] * 4


def test_a_prefill_the_machine_holds_past_the_schedule_is_waited_for() -> None:
    # P's loop stops before it takes the last request, for twice the schedule's length (its last arrival plus the
    # settle): the run ends only once P has taken every prefill sent to it (a ReqSync round trip through its pipe),
    # so the request is delivered as the model says, not judged a hang because P had not answered yet. A P stopped
    # 0.9 s at load 20 turned requests-abort-mid-transfer's request 3 into such a hang.
    opts = scaled(Options(requests=4, rate=10.0))
    opts = msgspec.structs.replace(opts, stall_p=((3, 2 * (3 / opts.rate + opts.settle_s)),))
    out = run([("0.14.0", line_of("0.14.0"))], opts)
    for line in out:
        assert [o.verdict for o in line.outcomes] == [e.verdict for e in line.expected] == ["delivered"] * 4, \
            (line.release, line.outcomes)
