"""`pdcheck requests` on real ranks: real P and D processes, real NIXL READs and notifications, verdicts per
request per release against the model, the bundled scenarios' expectations, --json vs table, bad input."""

from __future__ import annotations

import pytest
from conftest import SCENARIOS


def test_freed_early_scenario_real_outcomes_match_expectations(pdcheck):
    run = pdcheck("requests", str(SCENARIOS / "requests" / "requests-freed-early.toml"), "--json", timeout=120)
    assert run.code == 1, run.err  # 0.11.1 and 0.34.0 serve requests from freed blocks
    doc = run.json()
    assert [e["passed"] for e in doc["expectations"]] == [True] * 4, doc["expectations"]
    by = {r["release"]: r for r in doc["releases"]}
    assert by["0.9.1"]["survived"] and not by["0.34.0"]["survived"]
    wrong = [row for row in by["0.34.0"]["rows"] if row["verdict"] == "wrong"]
    # D's block check decoded the generation word; the parent named the request that owns it now
    assert [w["request"] for w in wrong] == [0, 1]
    assert all(w["found_request"] not in (None, w["request"]) and "'s KV (generation" in w["detail"] for w in wrong)
    assert by["0.34.0"]["served_from_freed"] == pytest.approx(3 / 12)
    # The three slow requests expired; a quick one's done notification may also reach P after its lease on a
    # loaded machine (its READ was in time: delivered, as the expectations say).
    assert by["0.34.0"]["accounting"]["expired"] >= 3 and by["0.34.0"]["accounting"]["reused"] > 0
    assert any("before lease expired" in x for x in by["0.34.0"]["expiry_log"])
    # the scenario's 0.5 s lease, as run (longer in slow motion: docs/requests.md)
    assert doc["lease_s"] == 0.5 * doc["time_scale"]
    # ... each line's own: a line the machine stalled ran again in slower motion (0.75 s for 0.5 s at x1.5)
    rel = by["0.11.1"]
    assert rel["expiry_s"] == 0.5 * rel["time_scale"]
    assert any(f"within {rel['expiry_s']:g} seconds" in x for x in rel["expiry_log"]), rel["expiry_log"]
    assert doc["corrected"]["survived"] and doc["corrected"]["counts"] == {"delivered": 9, "recomputed": 3}


def test_lost_notification_leaks_before_0_10_and_table_agrees_with_json(pdcheck):
    args = ("requests", "--vllm", "0.9.1,0.14.0", "--requests", "6", "--rate", "20", "--lease", "0.4",
            "--pool", "6", "--fault", "drop-notif")
    doc = pdcheck(*args, "--json", timeout=120).json()
    by = {r["release"]: r for r in doc["releases"]}
    assert [x["verdict"] for x in by["0.9.1"]["rows"]] == ["delivered"] * 3 + ["hang"] * 3
    assert by["0.9.1"]["accounting"]["leaked"] == 3 and by["0.9.1"]["accounting"]["freed"] == 0
    assert {x["verdict"] for x in by["0.14.0"]["rows"]} == {"delivered"}
    assert by["0.14.0"]["accounting"]["leaked"] == 0 and by["0.14.0"]["accounting"]["expired"] >= 5
    assert all(r["model_agrees"] for r in doc["releases"])
    table = pdcheck(*args, "--all", timeout=120)
    assert table.code == doc["exit_code"] == 1
    import re

    every = table.out.split("Every request")[1]
    row = re.compile(r"^\s*\S*\s+(\d+)\s+(delivered|wrong|freed-early|hang|error|recomputed|aborted)\b")
    verdicts = [m.group(2) for ln in every.splitlines() if (m := row.match(ln))]
    # --all: every request of every line in order, the corrected path's last
    assert verdicts == [x["verdict"] for r in [*doc["releases"], doc["corrected"]] for x in r["rows"]]
    assert "loses requests: 0.9.1 (3 hang, 3 leaked)" in table.out and "exit 1" in table.out
    default = pdcheck(*args, timeout=120)  # by default only the requests not delivered, folded: 0.9.1's 3-5
    assert re.search(r"0\.9\.1\s+3-5\s+hang", default.out) and "Every request" not in default.out
    # one handshake per line over P's side channel, the same in both
    shakes = [r["handshake"] for r in [*doc["releases"], doc["corrected"]]]
    assert [(h["handshakes"], h["wire"]) for h in shakes] == [(1, "B"), (1, "G"), (1, "H34")]
    line = next(ln for ln in table.out.splitlines() if "handshakes over P's side channel" in ln)
    assert shakes[0]["endpoint"].startswith("tcp://127.0.0.1:") and "side channel tcp://127.0.0.1:" in line
    assert "0.9.1 1 (era B), 0.14.0 1 (era G), corrected 1 (era H34)" in line


@pytest.mark.parametrize(("policy", "third"), [(None, "error"), ("recompute", "recomputed")])
def test_bad_params_real_nixl_error_and_reused_ids(pdcheck, policy, third):
    extra = ["--failure-policy", policy] if policy else []
    doc = pdcheck("requests", "--vllm", "0.34.0", "--requests", "4", "--fault", "bad-params:reused-ids:1",
                  "--fault", "bad-params:out-of-range:2", *extra, "--json", timeout=120).json()
    rows = doc["releases"][0]["rows"]
    assert [r["verdict"] for r in rows] == ["delivered", "wrong", third, "delivered"]
    assert rows[1]["found_request"] == 0 and "block" in rows[1]["detail"]
    assert "NIXL_ERR_INVALID_PARAM" in rows[2]["detail"]
    assert f"kv_load_failure_policy {policy or 'fail'}" in rows[2]["detail"]
    assert [r["corrected"] for r in rows] == ["delivered", "recomputed", "recomputed", "delivered"]


def test_wrong_tp_real_reads_with_the_handshakes_tp_corrected_refuses(pdcheck):
    # D handshook with P (TP 1) at the line's start; request 1's params say tp_size 2. The releases never look:
    # D's real READ of request 1 runs, its blocks check out, and its done notification frees P's blocks; no
    # second handshake. The corrected path refuses it before any READ, so P frees those blocks at the lease.
    doc = pdcheck("requests", "--vllm", "0.9.2,0.34.0", "--requests", "3", "--lease", "0.4", "--fault",
                  "bad-params:wrong-tp:1", "--json", timeout=120).json()
    for rel in doc["releases"]:
        assert [r["verdict"] for r in rel["rows"]] == ["delivered"] * 3 and rel["model_agrees"]
        assert rel["accounting"]["freed"] == 3 and rel["handshake"]["handshakes"] == 1
        assert rel["rows"][1]["corrected"] == "recomputed"
    cor = doc["corrected"]
    assert [r["verdict"] for r in cor["rows"]] == ["delivered", "recomputed", "delivered"]
    assert "tp_size 2, but engine pdcheck-req-P's handshake recorded TP 1" in cor["rows"][1]["detail"]
    assert cor["accounting"]["freed"] == 2 and cor["accounting"]["expired"] + cor["accounting"]["held"] == 1
    assert doc["exit_code"] == 0


@pytest.mark.parametrize(("args", "needle"), [
    (["--fault", "nope"], "unknown fault 'nope'"),
    (["--lease", "0"], "lease = 0"),
    (["--fault", "drop-notif:99"], "request 99 does not exist"),
    (["--rate", "-1"], "rate"),
    (["--pool", "1"], "pool"),
    (["--vllm", "0.1.0"], "not modelled"),
    (["--failure-policy", "maybe"], "fail or recompute"),
    (["--mode", "push", "--vllm", "0.14.0,0.34.0"], "vLLM 0.14.0 has no push mode"),
    (["--mode", "sideways"], "mode must be pull or push"),
    (["--fault", "restart-p:1:rank=2"], "P rank 2 does not exist"),
    (["--fault", "restart-p"], "name the request"),
    (["--fault", "heartbeat-loss:0"], "seconds must be"),
    (["--plot", "x.txt"], "name a .png"),
    (["--plot", "/nonexistent-dir/x.png"], "does not exist"),
])
def test_bad_input_exit_2_one_line(pdcheck, args, needle):
    run = pdcheck("requests", *(["--vllm", "0.34.0"] if "--vllm" not in args else []), *args)
    assert run.code == 2, (run.out, run.err)
    assert needle in run.err and "Traceback" not in run.err


def test_bad_scenario_file_exit_2(pdcheck, tmp_path):
    f = tmp_path / "requests-x.toml"
    f.write_text('[requests]\nlease = 0.5\nbogus = 1\n[expect]\n"0.34.0" = "delivered"\n')
    run = pdcheck("requests", str(f))
    assert run.code == 2 and "bogus" in run.err
    f.write_text('[faults]\nslow-decode = 3\n[expect]\n"0.34.0" = "delivered"\n')
    run = pdcheck("requests", str(f))
    assert run.code == 2 and "slow-decode" in run.err


def test_smoke_runs_request_scenarios(pdcheck, tmp_path):
    import shutil

    d = tmp_path / "sc"
    d.mkdir()
    shutil.copy(SCENARIOS / "requests" / "requests-params-dropped.toml", d)
    run = pdcheck("smoke", str(d), "--json", timeout=120)
    assert run.code == 0, run.said
    doc = run.json()
    assert doc["failed"] == 0 and {c["release"] for c in doc["cases"]} == {"0.9.1", "0.34.0", "corrected"}


def test_delayed_notification_and_real_heartbeats(pdcheck):
    doc = pdcheck("requests", "--vllm", "0.34.0", "--requests", "4", "--lease", "0.3", "--fault", "delay-notif:0.8",
                  "--json", timeout=120).json()
    rel = doc["releases"][0]
    assert rel["counts"] == {"delivered": 4} and rel["model_agrees"]
    acc = rel["accounting"]
    # P received D's real "HB:<ids>" notifications, then expired the blocks before the late done notification.
    # One notification names every request D took in its turn (vLLM's worker): one per request unless a loaded
    # machine hands D two requests in one turn.
    assert 1 <= acc["heartbeats"] <= 4
    assert (acc["expired"], acc["late_notifs"], acc["freed"]) == (4, 4, 0)
    # each late notification as 0.34.0's P logs it (the id P gave: a line the machine stalled ran again, as "req-2.0")
    rid = rel["rows"][0]["params"]["remote_request_id"]
    assert rel["notif_errors"][0] == (f"Potentially invalid KV blocks for unrecognized request {rid} were retrieved "
                                      "by a decode worker. They may have expired.")


def test_push_lost_completion_scenario_real_writes_and_table_agrees_with_json(pdcheck):
    path = str(SCENARIOS / "requests" / "requests-push-lost-completion.toml")
    run = pdcheck("requests", path, "--json", timeout=120)
    assert run.code == 1, run.err  # D hangs on requests 2 and 5
    doc = run.json()
    assert doc["mode"] == "push" and [e["passed"] for e in doc["expectations"]] == [True] * 4, doc["expectations"]
    assert [e["release"] for e in doc["expectations"]][:2] == ["0.24.0", "0.26.0"]  # 0.24: push mode too
    for rel in doc["releases"]:
        assert rel["model_agrees"] and "PUSH_REG" in rel["notification"]
        # P frees on its own WRITE (D's real PUSH_REG matched, real NIXL WRITE done), never at the lease
        assert (rel["accounting"]["freed"], rel["accounting"]["expired"], rel["accounting"]["leaked"]) == (8, 0, 0)
        assert "PR #50754" in rel["rows"][2]["detail"] and rel["rows"][2]["corrected"] == "recomputed"
    table = pdcheck("requests", path, "--all", timeout=120)  # every request, not only the lost ones
    got = []
    for ln in table.out.split("Every request", 1)[1].splitlines():
        cells = ln.split()
        if len(cells) >= 3 and not cells[0].isdigit() and cells[1].isdigit():
            cells = cells[1:]  # a line's first row starts with the line's name (a release, or corrected)
        if len(cells) >= 2 and cells[0].isdigit():
            got.append(cells[1])
    assert got == [x["verdict"] for r in [*doc["releases"], doc["corrected"]] for x in r["rows"]]
    assert "push mode" in table.out and "freed on P's WRITE done" in table.out and table.code == 1


def test_a_late_notification_kills_0_10_0s_prefill_engine(pdcheck):
    """0.10.0's P raises KeyError on a done notification for blocks its abort timeout freed: the engine core dies
    (the release's log text), admits nothing more; the real ranks and the model agree."""
    doc = pdcheck("requests", "--vllm", "0.10.0", "--requests", "4", "--rate", "1", "--lease", "1.6", "--fault",
                  "delay-notif:2.2:0", "--json", timeout=120).json()
    rel = doc["releases"][0]
    assert [r["verdict"] for r in rel["rows"]] == ["delivered", "delivered", "delivered", "hang"]
    assert rel["model_agrees"] and "engine core died" in rel["rows"][3]["detail"]
    acc = rel["accounting"]
    assert (acc["freed"], acc["expired"], acc["late_notifs"], acc["engine_died"]) == (2, 1, 1, 1)
    assert any(e.startswith("EngineCore encountered a fatal error. KeyError: 'req-") for e in rel["notif_errors"])
    assert doc["corrected"]["accounting"]["engine_died"] == 0


def test_push_faults_on_real_ranks_match_the_model(pdcheck):
    # A 2 s lease: the line's first handshakes (both ways in push mode) fit in it on a loaded machine too (1 s
    # did not at load 17)
    doc = pdcheck("requests", "--vllm", "0.34.0", "--mode", "push", "--requests", "6", "--lease", "2.0",
                  "--fault", "slow-decode:4.0:1", "--fault", "bad-params:reused-ids:2", "--fault",
                  "bad-params:wrong-engine:3", "--fault", "delay-notif:0.3:4", "--json", timeout=120).json()
    rel = doc["releases"][0]
    # 1: the lease freed P's blocks before D's PUSH_REG (unmatched: hang, not wrong KV); 2: D never reads P's
    # block ids; 3: D's handshake refuses P's engine id; 4: the completion notification arrives late
    assert [r["verdict"] for r in rel["rows"]] == ["delivered", "hang", "delivered", "error", "delivered",
                                                  "delivered"]
    assert rel["model_agrees"] and "push_reg_handshake_failed" in rel["rows"][3]["detail"]
    acc = rel["accounting"]
    assert (acc["freed"], acc["expired"], acc["late_notifs"]) == (4, 2, 1)
    assert any("before lease expired" in x for x in rel["expiry_log"])
    assert [r["verdict"] for r in doc["corrected"]["rows"]] == ["delivered", "recomputed", "delivered",
                                                                "recomputed", "delivered", "delivered"]


def test_prefill_restart_real_new_process_and_agent(pdcheck):
    run = pdcheck("requests", str(SCENARIOS / "requests" / "requests-prefill-restart.toml"), "--json", timeout=180)
    assert run.code == 1, run.err  # 0.9.1 crashes and leaks, 0.34.0 fails requests
    doc = run.json()
    assert [e["passed"] for e in doc["expectations"]] == [True] * 4, doc["expectations"]
    by = {r["release"]: r for r in [*doc["releases"], doc["corrected"]]}
    for r in by.values():
        assert r["accounting"]["restarts"] == 1 and r["accounting"]["lost"] == 1 and r["model_agrees"]
    # D's READs went to the killed process's agent: NIXL's own answer, through each release's policy
    assert "NIXL_ERR_REMOTE_DISCONNECT" in by["0.34.0"]["rows"][3]["detail"]
    assert "kv_load_failure_policy fail" in by["0.34.0"]["rows"][3]["detail"]
    assert "engine crash" in by["0.9.1"]["rows"][2]["detail"] and by["0.9.1"]["accounting"]["leaked"] == 2
    # corrected: the new P's side channel served a new agent (a later registration generation); D loaded it
    assert "re-handshook (registration generation" in by["corrected"]["rows"][2]["detail"]
    assert by["corrected"]["accounting"]["freed"] == 4
    # D's handshakes went over P's side channel: one per line, and corrected's re-handshake a second, from the
    # replacement P on the port of the one it replaced, in each release's wire era
    shakes = {k: (r["handshake"]["handshakes"], r["handshake"]["wire"], r["handshake"]["failed"]) for k, r in by.items()}
    assert shakes == {"0.9.1": (1, "B", ""), "0.11.1": (1, "F", ""), "0.34.0": (1, "H34", ""),
                      "corrected": (2, "H34", "")}
    assert len({r["handshake"]["endpoint"] for r in by.values()}) == 1


def test_heartbeat_loss_frees_blocks_a_held_request_has_and_the_plot(pdcheck, tmp_path):
    png = tmp_path / "hb.png"
    run = pdcheck("requests", str(SCENARIOS / "requests" / "requests-heartbeat-loss.toml"), "--json", "--plot",
                  str(png), timeout=180)
    doc = run.json()
    assert [e["passed"] for e in doc["expectations"]] == [True] * 4, doc["expectations"]
    by = {r["release"]: r for r in doc["releases"]}
    # real "HB:<id>" notifications every lease/6 kept request 1's blocks; none for 0.14.0
    assert by["0.34.0"]["accounting"]["heartbeats"] > 6 and by["0.14.0"]["accounting"]["heartbeats"] == 0
    assert by["0.34.0"]["accounting"]["expired"] == 1 and by["0.14.0"]["accounting"]["expired"] == 2
    assert all(x is not None for x in by["0.34.0"]["latency_s"]) and by["0.34.0"]["latency_s"][1] > 1.1
    assert max(h for _t, h in by["0.34.0"]["timeline"]) >= 4 and by["0.34.0"]["timeline"][-1][1] == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_heartbeats_reach_p_while_d_only_holds_on_the_first_line(pdcheck):
    # D drives its UCX worker every turn (vLLM's get_finished on every engine step): the heartbeats of a request
    # it holds past the lease reach P on time, on the first line of the run too (its connection to P is new)
    doc = pdcheck("requests", "--vllm", "0.34.0,0.26.0", "--requests", "1", "--lease", "2", "--fault", "hold:5",
                  "--json", timeout=120).json()
    for rel in doc["releases"]:
        assert [x["verdict"] for x in rel["rows"]] == ["delivered"], (rel["release"], rel["rows"])
        acc = rel["accounting"]
        assert acc["freed"] == 1 and acc["expired"] == 0 and acc["late_notifs"] == 0 and acc["heartbeats"] >= 10
        assert rel["model_agrees"]


def test_read_fail_and_abort_mid_transfer(pdcheck):
    doc = pdcheck("requests", "--vllm", "0.14.0,0.34.0", "--requests", "4", "--lease", "0.5", "--fault",
                  "read-fail:1", "--fault", "abort-d:2", "--json", timeout=180).json()
    by = {r["release"]: r for r in doc["releases"]}
    assert [x["verdict"] for x in by["0.14.0"]["rows"]] == ["delivered", "recomputed", "aborted", "delivered"]
    assert [x["verdict"] for x in by["0.34.0"]["rows"]] == ["delivered", "error", "aborted", "delivered"]
    assert "NIXL_ERR_NOT_FOUND" in by["0.34.0"]["rows"][1]["detail"]
    # the release's own _log_failure line and context dict; 0.22+ also warns that it skips post-processing
    new, old = by["0.34.0"]["rows"][1]["detail"], by["0.14.0"]["rows"][1]["detail"]
    rid = by["0.34.0"]["rows"][1]["params"]["remote_request_id"]  # "req-2.1": the run's second line, request 1
    assert new.startswith("NIXL transfer failure: transfer_setup_failed. Deferring failure reporting until "
                          "outstanding transfers finish | Context: {'failure_type': 'transfer_setup_failed', "
                          f"'request_id': '{rid}', 'engine_id': 'pdcheck-req-D'")
    assert "'remote_rank': 0}" in new and f"Skipping KV post-processing for failed request {rid}" in new
    assert old.startswith("NIXL transfer failure: transfer_setup_failed. Marking blocks as invalid | Context: {")
    assert "Skipping" not in old and old.endswith("-> kv_load_failure_policy recompute")
    # 0.14.0 frees D's blocks under the READ it posted; the 0.24+ lines wait for it: only 0.14.0 fails on it
    assert by["0.14.0"]["accounting"]["d_freed_in_flight"] == 1 and by["0.34.0"]["accounting"]["d_freed_in_flight"] == 0
    assert all(r["model_agrees"] for r in doc["releases"])
    # the failed READ never notified P (vLLM's notification rides on the READ): its blocks expired at the lease
    assert by["0.34.0"]["accounting"]["expired"] == 1 and by["0.34.0"]["accounting"]["freed"] == 3


def test_push_write_failure_scenario_real_nixl_error_on_p(pdcheck):
    run = pdcheck("requests", str(SCENARIOS / "requests" / "requests-push-write-failure.toml"), "--json", timeout=120)
    assert run.code == 1, run.err  # D hangs on requests 2 and 5 in both releases
    doc = run.json()
    assert [e["passed"] for e in doc["expectations"]] == [True] * 3, doc["expectations"]
    for rel in [*doc["releases"], doc["corrected"]]:
        assert rel["model_agrees"], rel["release"]
        # NIXL itself refused P's WRITE (memory D never registered); no handle: P's blocks wait for the lease. D's
        # heartbeats go on while it waits (a release's D for ever), but a 1 s lease is never extended
        # (kv_lease_duration * 2 // 3 = 0); the corrected path renews the whole lease until its D gives up
        assert sum("NIXL_ERR_NOT_FOUND" in e and "transfer_setup_failed" in e for e in rel["notif_errors"]) == 2
        assert rel["accounting"]["freed"] == 6 and rel["accounting"]["expired"] + rel["accounting"]["held"] == 2
        if rel["release"] != "corrected":
            # (past the PUSH_REG: several every lease)
            assert rel["accounting"]["expired"] == 2 and rel["accounting"]["heartbeats"] > 3, rel["accounting"]
    assert "never told" in doc["releases"][0]["rows"][2]["detail"]


def test_push_hold_and_heartbeat_loss_real_heartbeats(pdcheck):
    doc = pdcheck("requests", "--vllm", "0.34.0", "--mode", "push", "--requests", "6", "--lease", "0.5",
                  "--fault", "hold:1:1", "--fault", "heartbeat-loss:1:3", "--json", timeout=120).json()
    rel, corr = doc["releases"][0], doc["corrected"]
    # 1: D's real "HB:<id>" every lease/6 kept P's blocks through the hold; 3: none reached P, the lease freed
    # the blocks and D's later PUSH_REG matched nothing
    assert [r["verdict"] for r in rel["rows"]] == ["delivered"] * 3 + ["hang"] + ["delivered"] * 2
    assert rel["model_agrees"] and corr["model_agrees"]
    acc = rel["accounting"]
    assert acc["heartbeats"] > 6 and (acc["expired"], acc["late_notifs"], acc["freed"]) == (1, 1, 5)
    assert corr["rows"][3]["verdict"] == "recomputed" and "heartbeats were lost" in corr["rows"][3]["detail"]


def test_push_abort_after_registration_real_ranks(pdcheck):
    doc = pdcheck("requests", "--vllm", "0.26.0", "--mode", "push", "--requests", "4", "--lease", "0.5",
                  "--fault", "abort-d:1", "--json", timeout=120).json()
    rel, corr = doc["releases"][0], doc["corrected"]
    assert [r["verdict"] for r in rel["rows"]] == ["delivered", "aborted", "delivered", "delivered"]
    assert rel["model_agrees"] and corr["model_agrees"] and not rel["survived"] and corr["survived"]
    # D freed its blocks at the abort; P, never told, still matched the PUSH_REG and freed on its real WRITE
    assert (rel["accounting"]["d_freed_in_flight"], rel["accounting"]["freed"]) == (1, 4)
    assert (corr["accounting"]["d_freed_in_flight"], corr["accounting"]["freed"]) == (0, 4)


def test_push_prefill_restart_registrations_hit_the_dead_agent(pdcheck):
    doc = pdcheck("requests", "--vllm", "0.34.0", "--mode", "push", "--requests", "5", "--lease", "0.5",
                  "--fault", "restart-p:2", "--json", timeout=180).json()
    rel, corr = doc["releases"][0], doc["corrected"]
    assert rel["model_agrees"] and corr["model_agrees"]
    assert [r["verdict"] for r in rel["rows"]] == ["delivered"] * 2 + ["hang"] * 3
    # a real new P process: D's real send_notif to the killed agent failed, the new P's blocks waited for the lease
    assert "push_reg_notif_failed" in rel["rows"][3]["detail"] and "NIXL_ERR_REMOTE_DISCONNECT" in rel["rows"][3]["detail"]
    acc = rel["accounting"]
    assert (acc["restarts"], acc["lost"], acc["freed"], acc["expired"]) == (1, 1, 2, 2)
    # corrected: D re-handshook on the disconnect, and the new P (given D's agent) WRITEs requests 3 and 4
    assert [r["verdict"] for r in corr["rows"]] == ["delivered"] * 2 + ["recomputed"] + ["delivered"] * 2
    assert (corr["accounting"]["freed"], corr["accounting"]["expired"]) == (4, 0)


def test_many_reads_in_flight_on_a_small_pool_every_block_checked(pdcheck):
    # 60 requests at once, 3 blocks each, on 8 blocks: P reuses every block many times, and D's ring of 8 blocks
    # wraps with a gap (3 does not divide 8) while up to 2 READs are in flight. Every request is delivered:
    # D checked each of its blocks by coordinate and generation after the block was reused.
    doc = pdcheck("requests", "--vllm", "0.34.0", "--requests", "60", "--rate", "10000", "--pool", "8",
                  "--blocks-per-request", "3", "--json", timeout=120).json()
    rel = doc["releases"][0]
    assert rel["counts"] == {"delivered": 60} and rel["model_agrees"]
    acc = rel["accounting"]
    assert (acc["allocated"], acc["freed"], acc["expired"]) == (180, 60, 0) and acc["reused"] >= 170
    assert doc["corrected"]["counts"] == {"delivered": 60}


def test_one_p_worker_restart_scenario_table_names_the_d_rank_and_agrees_with_json(pdcheck):
    import io
    import re

    import msgspec
    from rich.console import Console

    from pdcheck.vllm.requests.report import RequestsReport, render

    run = pdcheck("requests", str(SCENARIOS / "requests" / "requests-tp2-one-p-worker-restart.toml"), "--vllm",
                  "0.34.0", "--json", timeout=120)
    assert run.code == 1, run.said
    rep = msgspec.json.decode(run.out, type=RequestsReport)  # the schema --json promises
    assert [e.passed for e in rep.expectations] == [True, True], rep.expectations
    rows = [(row.request, row.rank, row.verdict) for r in [*rep.releases, rep.corrected] for row in r.rows]
    assert rows[:6] == [(0, "D0", "delivered"), (0, "D1", "delivered"), (1, "D0", "delivered"),
                        (1, "D1", "delivered"), (2, "D0", "delivered"), (2, "D1", "error")]
    assert [(v.request, v.rank, v.status) for v in rep.verdicts] == rows[:10]

    def table(every: bool) -> str:
        buf = io.StringIO()
        render(rep, Console(file=buf, width=160, color_system=None), every=every)
        return buf.getvalue()

    every = table(True).split("Every request")[1]
    assert re.search(r"requests\s+D rank\s+verdict", every)
    row = re.compile(r"^\s*\S*\s+(\d+)\s+(D\d)\s+(delivered|wrong|freed-early|hang|error|recomputed|aborted)\b")
    got = [(int(m.group(1)), m.group(2), m.group(3)) for ln in every.splitlines() if (m := row.match(ln))]
    assert got == rows  # --all: a row per (request, D rank), every line in order, the corrected path's last
    # by default the ones not delivered, folded per D rank
    assert re.search(r"0\.34\.0\s+2-4\s+D1\s+error", table(False))
