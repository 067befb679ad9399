"""Fake SGLang P against fake SGLang D on real processes: a real HTTP bootstrap server, real ZMQ frames in the
release's layout, real NIXL WRITEs of coordinate-tagged pages verified on D; the CLI and smoke over the bundled
SGLang scenarios. Kept to a few releases (each run is a fresh set of rank processes)."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIOS

from pdcheck.errors import HarnessError
from pdcheck.sglang import bootstrap as bs
from pdcheck.sglang import engine, runner
from pdcheck.sglang import plan as sp
from pdcheck.sglang.releases import resolve
from pdcheck.sglang.scenario import SgInstance, SgScenario

SG = SCENARIOS / "sglang"


# hang_s: how long D waits for what a release without a timeout never sends. A run where every release is
# expected to finish keeps the long default, so a completion a loaded machine delays is not read as a hang
# (1.5 s was not enough at load 28); a run expecting a hang names a short window, which cannot turn it into
# anything else.
HANG_S = 10.0


def _run(p: SgInstance, d: SgInstance, releases: str, hang_s: float = HANG_S) -> runner.SgRunResult:
    sc = SgScenario(prefill=p, decode=d, source="test")
    return runner.run(sp.build(sc, releases, sp.SgOptions(hang_timeout_s=hang_s)))


def test_same_release_pages_arrive_by_coordinate() -> None:
    res = _run(SgInstance(tp_size=2), SgInstance(tp_size=2), "0.5.8,0.5.23")
    for pair in res.pairs:
        assert [v.status for v in pair.observed] == ["ok", "ok"], pair.observed
        assert all(t is not None and t.status == "ok" and t.blocks == 2 * 4 * 4 for t in pair.transfers)
        assert [f.writes for f in pair.prefill] == [2, 2] and not any(f.listener_dead for f in pair.prefill)
        assert [v.status for v in pair.model] == ["ok", "ok"]


def test_page_size_mismatch_asserts_on_p_then_refused() -> None:
    res = _run(SgInstance(page_size=16), SgInstance(page_size=32), "0.5.3,0.5.8", hang_s=1.5)
    old, new = res.pairs
    # D allocated 2 pages of 32 for P's 4 of 16: P's add_transfer_request asserts, writes nothing, D waits
    assert old.observed[0].status == "hang" and old.model[0].status == "hang" and old.prefill[0].writes == 0
    assert old.prefill[0].errors[0].startswith("AssertionError: assert len(chunked_dst_kv_indice) == "
                                                "len(kv_indices) (add_transfer_request, room 1000: D offered 2 pages "
                                                "for P's 4)")
    assert (new.observed[0].status, new.observed[0].exception) == ("error", "RuntimeError")
    assert new.observed[0].message.startswith("Page size mismatch: prefill server has page_size=16, but decode")
    assert new.prefill[0].writes == 0  # D stopped before it sent a frame


def test_bootstrap_missing_fails_after_the_parallel_info_fetches() -> None:
    # 0.5.23's D scheduler: 15 fetches of P's parallel info (pdcheck runs them hang_s / 15 apart: only their
    # count decides), then the abort; 0.5.8 marks the room Failed at once
    # 6 s: the fetches share the window with D's own start on a loaded machine (1.5 s ran out at load 17)
    res = _run(SgInstance(), SgInstance(no_bootstrap=True), "0.5.8,0.5.23", hang_s=6.0)
    old, new = res.pairs
    assert old.observed[0].status == old.model[0].status == "error"
    v = new.observed[0]
    assert (v.status, v.stage, v.exception, v.timeout_s) == ("error", "bootstrap", "KVTransferError", 14.0)
    assert new.model[0].status == "error"
    assert "Could not fetch prefill parallel info from 127.0.0.1:" in v.message and "after 15 attempts" in v.message
    assert v.message.endswith("with exception KVTransferError(bootstrap_room=1000): Aborted by AbortReq.")


def test_frame_skew_kills_the_real_listener() -> None:
    res = _run(SgInstance(sglang="0.4.9.post2"), SgInstance(), "0.4.7", hang_s=1.5)
    v = res.pairs[0].observed[0]
    assert v.status == "hang" and v.stage == "register" and v.timeout_s is None
    assert res.pairs[0].prefill[0].listener_dead.startswith("UnicodeDecodeError: 'ascii' codec")
    assert res.pairs[0].model[0].status == "hang"


def test_bootstrap_server_answers_http() -> None:
    table = bs.Table(resolve("0.5.23"), 2)
    server = bs.Server(table)
    try:
        q = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/route?{q}", timeout=5)
        assert ei.value.code == 503 and b"(0 workers registered)" in ei.value.read()
        assert bs.http_put("127.0.0.1", server.port, {"attn_tp_size": 2})[0] == 500  # KeyError in the handler
        for r in range(2):
            body = bs.put_body(table.rel, rank=r, tp=2, pp_rank=0, pp=1, ip="127.0.0.1", port=7000 + r,
                               page_size=16, kv_cache_dtype="auto", agent_name="a")
            assert bs.http_put("127.0.0.1", server.port, body) == (200, "OK")
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/route?{q}", timeout=5) as r:
            info = json.loads(r.read())
        assert info["attn_tp_size"] == 2 and set(info) == set(table.rel.info_keys)
        found = bs.discover(table.rel, bs.http_get("127.0.0.1", server.port), tp_rank=1, tp_size=2, pp_size=1,
                            page_size=16, kv_cache_dtype="auto", mla=False)
        assert found.targets == [(1, "127.0.0.1", 7001)]
    finally:
        server.close()


def test_cli_json_and_table_agree(pdcheck, tmp_path) -> None:
    path = SG / "sglang-hetero-tp.toml"
    run = pdcheck("handshake", str(path), "--sglang", "0.4.7,0.5.13", "--json", "--hang-timeout", "1.5")
    assert run.code == 1, run.err
    doc = run.json()
    assert doc["framework"] == "sglang" and doc["matrix"] == {"0.4.7": ["assert"], "0.5.13": ["ok"]}
    assert doc["agree"] and doc["issue"].startswith("sgl-project/sglang#19043")
    table = pdcheck("handshake", str(path), "--sglang", "0.4.7,0.5.13", "--hang-timeout", "1.5")
    assert table.code == 1
    for release, statuses in doc["matrix"].items():  # the table's row of each release shows the JSON's verdict
        row = next(line for line in table.out.splitlines() if f" {release} " in line)
        assert [c.strip() for c in row.split("│")][3] == statuses[0]
    assert "Traceback" not in table.err


def test_cli_bad_input(pdcheck) -> None:
    path = str(SG / "sglang-hetero-tp.toml")
    for args, text in (((path, "--sglang", "0.5.8", "--vllm", "0.9.1"), "not both"),
                       ((path, "--vllm", "0.9.1"), "is an SGLang scenario"),
                       ((path, "--sglang", "0.3.1"), "is not modelled"),
                       ((str(SCENARIOS / "mla.toml"), "--sglang", "0.5.8"), "is a vLLM scenario; use --vllm"),
                       ((path, "--sglang", "0.5.8", "--ray", "auto"), "not available for SGLang"),
                       ((path, "--sglang", "0.5.8", "--prefill-endpoint", "ftp://h:1"), "plain HTTP")):
        run = pdcheck("handshake", *args)
        assert run.code == 2 and text in run.err and "Traceback" not in run.err, (args, run.err)
        assert len(run.err.strip().splitlines()) == 1
    run = pdcheck("handshake", path, "--sglang", "0.5.8", "--prefill-endpoint", "127.0.0.1:9", "--hang-timeout", "1")
    assert run.code == 3 and "no SGLang bootstrap server answers" in run.err and len(run.err.strip().splitlines()) == 1


def test_smoke_runs_sglang_scenarios(pdcheck, tmp_path) -> None:
    d = tmp_path / "sc"
    (d / "sglang").mkdir(parents=True)
    for name in ("sglang-frame-skew", "sglang-completion-skew"):
        shutil.copy(SG / f"{name}.toml", d / "sglang")
    shutil.copy(SCENARIOS / "decode-fewer-blocks.toml", d)
    junit = tmp_path / "out.xml"
    run = pdcheck("smoke", str(d), "--json", "--junit", str(junit), "--hang-timeout", "1.5")
    assert run.code == 0, run.err
    doc = run.json()
    sg = [c for c in doc["cases"] if c["framework"] == "sglang"]
    assert [(c["scenario"], c["got"]) for c in sg] == [("sglang-completion-skew", ["hang"]),
                                                        ("sglang-frame-skew", ["hang"])]
    assert 'name="sglang 0.5.23"' in junit.read_text()


class _Junk(http.server.BaseHTTPRequestHandler):
    body = b"hello"

    def log_message(self, format, *args):  # noqa: A002
        pass

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)


def _serve(handler) -> http.server.ThreadingHTTPServer:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_probe_reads_a_live_bootstrap_server_read_only(pdcheck) -> None:
    rel = resolve("0.5.8")
    table = engine.table_for(rel, engine.Side(tp_size=2, page_size=32))
    server = bs.Server(table)
    try:
        url = f"http://127.0.0.1:{server.port}"
        run = pdcheck("probe", url, "--sglang", "auto", "--decode-sglang", "0.5.3,0.5.8", "--json")
        assert run.code == 1, run.err
        doc = run.json()
        assert (doc["era"], doc["p_release"]) == ("B4", "0.5.8")
        assert doc["info"]["prefill_page_size"] == 32 and len(doc["ranks"]) == 2
        assert [(c["d_release"], c["status"]) for c in doc["decode"]] == [("0.5.3", "ok"), ("0.5.8", "error")]
        assert doc["decode"][1]["message"].startswith("Page size mismatch: prefill server has page_size=32")
        assert table.count == 2  # nothing was registered or changed by the probe
        table_run = pdcheck("probe", url, "--sglang", "0.5.8")
        assert table_run.code == 1 and "Page size mismatch" in table_run.out
    finally:
        server.close()


def test_probe_bad_input_and_junk(pdcheck) -> None:
    run = pdcheck("probe", "ftp://127.0.0.1:1", "--sglang", "auto")
    assert run.code == 2 and "plain HTTP" in run.err and len(run.err.strip().splitlines()) == 1
    run = pdcheck("probe", "127.0.0.1:1", "--sglang", "0.5.8", "--vllm", "0.9.1")
    assert run.code == 2 and "not both" in run.err
    junk = _serve(_Junk)
    big = _serve(type("Big", (_Junk,), {"body": b'{"attn_tp_size": ' + b"1" * (1 << 20) + b"}"}))
    try:
        for srv in (junk, big):
            run = pdcheck("probe", f"127.0.0.1:{srv.server_address[1]}", "--sglang", "auto", "--json", timeout=60)
            assert run.code == 3 and not run.out and "Traceback" not in run.err
            assert len(run.err.strip().splitlines()) == 1 and run.err.startswith("pdcheck: error: ")
    finally:
        for srv in (junk, big):
            srv.shutdown()
            srv.server_close()
    nobody = pdcheck("probe", "127.0.0.1:9", "--sglang", "auto", "--timeout", "1", "--json")
    assert nobody.code == 3 and "no SGLang bootstrap answer" in nobody.err and not nobody.out


def test_probe_of_a_half_registered_server_agrees_with_the_engine() -> None:
    # a real bootstrap server answering 503 to the parallel-info fetch (one of two P ranks registered): a 0.5.23
    # decode gives up after its 15 fetches (error), as engine.decide and the real D rank say
    from pdcheck.sglang import probe

    table = bs.Table(resolve("0.5.23"), 2)
    table.put(bs.put_body(table.rel, rank=0, tp=2, pp_rank=0, pp=1, ip="127.0.0.1", port=7000, page_size=16,
                          kv_cache_dtype="auto", agent_name="a"))
    server = bs.Server(table)
    try:
        rep = probe.run("127.0.0.1", server.port, "0.5.23", "0.5.23", engine.Side(), 2.0)
    finally:
        server.close()
    assert [c.status for c in rep.decode] == ["error"]
    assert f"Could not fetch prefill parallel info from 127.0.0.1:{server.port} after 15 attempts" in \
        str(rep.decode[0].message)


def test_probe_bounds_a_huge_rank_list() -> None:
    from pdcheck.sglang import probe

    class Huge(_Junk):
        body = json.dumps({"prefill_attn_tp_size": 10_000, "prefill_dp_size": 1, "prefill_pp_size": 1}).encode()

    srv = _serve(Huge)
    try:
        # No rank is walked and no list is built: the decode's discovery refuses the advertised size (exit 3).
        with pytest.raises(HarnessError, match="prefill_attn_tp_size = 10000"):
            probe.run("127.0.0.1", srv.server_address[1], None, None, engine.Side(), HANG_S)  # a ceiling only
    finally:
        srv.shutdown()
        srv.server_close()


def _pdcheck_serve(scenario: Path, release: str) -> subprocess.Popen[str]:
    """`pdcheck serve SCENARIO --sglang RELEASE --json` as a real CLI process; its first stdout line is the ready
    document."""
    return subprocess.Popen([sys.executable, "-m", "pdcheck", "serve", str(scenario), "--sglang", release, "--json",
                             "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_serve_and_prefill_endpoint(tmp_path) -> None:
    """`pdcheck serve --sglang` (a real CLI process: bootstrap server + fake P ranks) and fake D ranks against it
    with --prefill-endpoint: pages arrive by coordinate for the same release; an 0.5.13 D fails at the bootstrap
    (the live P's era is recognised from its answers, read-only)."""
    scen = tmp_path / "live.toml"
    scen.write_text('framework = "sglang"\n[prefill]\ntp_size = 2\n[decode]\ntp_size = 2\n')
    proc = _pdcheck_serve(scen, "0.5.23")
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["framework"] == "sglang" and ready["p_ranks"] == 2
        assert ready["event"] == "ready" and ready["pid"] == proc.pid  # the ready shape every framework shares
        from pdcheck.sglang.probe import parse_url
        from pdcheck.sglang.scenario import load

        live = sp.LiveBootstrap(*parse_url(ready["bootstrap_url"]))
        same = runner.run(sp.build(load(scen), "0.5.23", sp.SgOptions(hang_timeout_s=HANG_S), live)).pairs[0]
        old = runner.run(sp.build(load(scen), "0.5.13", sp.SgOptions(hang_timeout_s=1.5), live)).pairs[0]
        assert same.p_release == "0.5.23" and [v.status for v in same.observed] == ["ok", "ok"]
        assert all(t.status == "ok" and t.blocks > 0 for t in same.transfers)
        # PrefillServerInfo(**data) raises TypeError on 0.5.23's keys; 0.5.13's scheduler gives up after 15 fetches
        assert [v.status for v in old.observed] == ["error", "error"]
        assert old.observed[0].exception == "KVTransferError"
        assert "unexpected keyword argument" in old.observed[0].message
        assert [v.status for v in old.model] == ["error", "error"]
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err  # SIGTERM: 128 + 15, as every command
    assert "P rank 0: 2 WRITE requests" in err


def test_serve_holds_a_room_in_its_own_page_count(tmp_path) -> None:
    """`pdcheck serve --sglang 0.5.3` told D's page size (32, P's 16): a room D asks 2 pages for is 4 pages on P,
    whose add_transfer_request asserts and writes nothing; pdcheck's live D hangs, as the model says."""
    from pdcheck.sglang.probe import parse_url
    from pdcheck.sglang.scenario import load

    scen = tmp_path / "live.toml"
    scen.write_text('framework = "sglang"\n[prefill]\npage_size = 16\n[decode]\npage_size = 32\n')
    proc = _pdcheck_serve(scen, "0.5.3")
    try:
        live = sp.LiveBootstrap(*parse_url(json.loads(proc.stdout.readline())["bootstrap_url"]))
        pair = runner.run(sp.build(load(scen), "0.5.3", sp.SgOptions(hang_timeout_s=1.5), live)).pairs[0]
        assert [v.status for v in pair.observed] == [v.status for v in pair.model] == ["hang"], pair
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=30)
    assert "P rank 0: 0 WRITE requests" in err and "assert len(chunked_dst_kv_indice) == len(kv_indices)" in err, err


def test_scenario_from_logs_cli(pdcheck, tmp_path) -> None:
    line = ("INFO engine.py:154: server_args=ServerArgs(model_path='m', kv_cache_dtype='auto', page_size={ps}, "
            "tp_size=1, pp_size=1, dp_size=1, disaggregation_mode='{mode}', disaggregation_transfer_backend='nixl', "
            "disaggregation_bootstrap_port=8998)\n")
    (tmp_path / "p.log").write_text(line.format(ps=16, mode="prefill"))
    (tmp_path / "d.log").write_text(line.format(ps=32, mode="decode"))
    out = tmp_path / "sc.toml"
    run = pdcheck("scenario", "from-logs", str(tmp_path / "p.log"), str(tmp_path / "d.log"), "--sglang", "0.5.3,0.5.8",
                  "-o", str(out), "--json")
    assert run.code == 0, run.err
    assert run.json()["prefill"]["side"]["page_size"] == 16
    res = pdcheck("handshake", str(out), "--json", "--hang-timeout", "1.5")
    assert res.code == 1, res.err
    # 0.5.3: D's 2 pages of 32 for P's 4 of 16, P asserts in add_transfer_request; 0.5.8 checks the page size
    assert res.json()["matrix"] == {"0.5.3": ["hang"], "0.5.8": ["error"]}


# ---- failure classes beyond the handshake, on real ranks (reference §11)
def _fault_run(releases: str, fault: str, requests: int = 2, p: SgInstance | None = None,
               d: SgInstance | None = None, hang_s: float = HANG_S) -> runner.SgRunResult:
    from pdcheck.sglang.scenario import SgTransfer

    sc = SgScenario(prefill=p or SgInstance(), decode=d or SgInstance(), source="test",
                    transfer=SgTransfer(requests=requests, fault=fault, heartbeat_s=0.2))
    return runner.run(sp.build(sc, releases, sp.SgOptions(hang_timeout_s=hang_s)))


def test_duplicate_room_merges_two_requests() -> None:
    res = _fault_run("0.4.7,0.5.8,0.5.23", "duplicate_room")
    kept, keyerror, cleared = res.pairs
    for pair in res.pairs:
        assert [v.status for v in pair.observed] == ["silent"] == [v.status for v in pair.model]
        assert pair.corrected.status == "error"
    # the first request's 16 pages (2 regions x 2 layers x 4) are never written; the second's hold the first's
    # KV unless P writes it again (0.4.7 keeps the room's entry)
    assert (kept.transfers[0].wrong, keyerror.transfers[0].wrong, cleared.transfers[0].wrong) == (16, 32, 32)
    assert keyerror.prefill[0].errors[0].startswith("KeyError: 1000 (add_transfer_request")
    assert keyerror.prefill[0].writes == 1 and kept.prefill[0].writes == 2
    assert "nothing sent" in cleared.prefill[0].logs[0] and "KeyError" in keyerror.observed[0].message


def test_missing_transfer_info_leaves_p_bootstrapping() -> None:
    res = _fault_run("0.4.9.post2,0.5.13", "no_transfer_info", requests=1, hang_s=2.0)
    old, new = res.pairs
    for pair in res.pairs:
        assert pair.prefill[0].bootstrapping == [1000] and pair.prefill[0].registered == ["sglang-d0"]
        assert pair.prefill[0].writes == 0 and not pair.harness
    assert (old.observed[0].status, old.observed[0].timeout_s) == ("hang", None)
    assert (new.observed[0].status, new.observed[0].timeout_s) == ("hang", 300.0)
    assert "Request 1000 timed out after 300s in KVPoll.Bootstrapping" in new.observed[0].message


def test_prefill_killed_mid_transfer() -> None:
    none = _fault_run("0.4.7", "kill_prefill", requests=1, hang_s=2.0).pairs[0]
    r4, r7 = _fault_run("0.5.3,0.5.23", "kill_prefill", requests=1).pairs  # their heartbeats fail the room
    for pair in (none, r4, r7):
        assert not pair.harness and pair.prefill == []  # every P rank was SIGKILLed: no final message
        assert [v.status for v in pair.observed] == [v.status for v in pair.model]
    assert (none.observed[0].status, none.observed[0].timeout_s) == ("hang", None)
    assert r4.observed[0].status == "error" and "1 transfers affected" in r4.observed[0].message
    assert r4.observed[0].message.endswith("Decode transfer failed for request rank=0 decode_req.req.rid='<rid>' "
                                           "decode_req.req.bootstrap_room=1000 with exception Fake KVReceiver "
                                           "Exception")
    assert "KVTransferError(bootstrap_room=1000): Lost connection with prefill instance" in r7.observed[0].message


def test_aux_buffer_skew_on_real_metadata_buffers() -> None:
    first, shorter = _fault_run("0.5.3,0.5.23", "none", requests=2, d=SgInstance(aux_buffers=2)).pairs
    index_error = _fault_run("0.5.8", "none", requests=2, d=SgInstance(aux_buffers=2), hang_s=2.0).pairs[0]
    pairs = (first, index_error, shorter)
    assert [p.observed[0].status for p in pairs] == ["silent", "hang", "silent"]
    assert [p.model[0].status for p in pairs] == ["silent", "hang", "silent"]
    for pair in (first, shorter):  # KV right, D's second metadata buffer never written
        t = pair.transfers[0]
        assert t.wrong == 0 and t.status == "wrong" and "D buffer 1 slot 0: P has no buffer 1" in t.message
    assert index_error.prefill[0].errors[0].startswith("IndexError: list index out of range (send_aux")
    assert shorter.observed[0].warning.startswith("Decode sglang-d0 registered 2 metadata buffers but this prefill "
                                                  "has 1; only the first 1 are transferred")


def test_hybrid_state_written_from_0_5_13() -> None:
    res = _fault_run("0.5.8,0.5.13,0.5.23", "none", requests=2, p=SgInstance(hybrid=True), d=SgInstance(hybrid=True))
    assert [p.observed[0].status for p in res.pairs] == ["silent", "ok", "ok"]
    assert [p.model[0].status for p in res.pairs] == ["silent", "ok", "ok"]
    old = res.pairs[0].transfers[0]
    assert old.wrong == 0 and "D state slot 0: holds untagged bytes" in old.message  # KV right, state never sent
    res = _fault_run("0.5.13", "none", requests=1, d=SgInstance(hybrid=True), hang_s=2.0)  # P's model: no state
    v = res.pairs[0].observed[0]
    assert (v.status, v.stage, v.timeout_s) == ("hang", "completion", 300.0)


def test_dp_routing_per_room_and_its_conflict() -> None:
    # two attention DP ranks: each room's pages come from the DP rank room % 2 (follow_bootstrap_room)
    res = _fault_run("0.4.7,0.5.3,0.5.23", "none", requests=2, p=SgInstance(dp_size=2))
    for pair in res.pairs:
        assert [v.status for v in pair.observed] == ["ok"], pair.observed
        assert pair.transfers[0].blocks == 2 * 4 * 4 and sorted(f.writes for f in pair.prefill) == [1, 1]
    res = _fault_run("0.5.8,0.5.13", "dp_conflict", requests=1, p=SgInstance(dp_size=2), hang_s=2.0)
    old, new = res.pairs
    assert (old.observed[0].status, old.model[0].status, old.observed[0].timeout_s) == ("hang", "hang", 300.0)
    assert sorted(room for f in old.prefill for room in f.bootstrapping) == [1000]  # the DP rank that has it
    assert (new.observed[0].status, new.model[0].status) == ("error", "error")
    assert "follow_bootstrap_room conflict: dispatched to dp_rank 1 but bootstrap_room 1000 implies dp_rank 0" \
        in new.observed[0].message
    assert [f.errors for f in new.prefill if f.errors][0][0].startswith("follow_bootstrap_room conflict")
