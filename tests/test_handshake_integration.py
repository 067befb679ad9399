"""Real ranks: every P and D rank is a process with a NIXL agent, a registered cache and a ZMQ socket."""

from __future__ import annotations

from conftest import SCENARIOS
from portkit import free_run, is_free

SEED = str(SCENARIOS / "seed-19338-tp8.toml")


def _ranks(doc: dict, release: str) -> list[dict]:
    return [d["verdicts"][release] for d in doc["decode_ranks"]]


def test_seed_091_asserts_rank_by_rank_and_corrected_survives(pdcheck):
    run = pdcheck("handshake", SEED, "--vllm", "0.9.1", "--json")
    assert run.code == 1, run.err
    doc = run.json()
    v = _ranks(doc, "0.9.1")
    assert v[0]["status"] == "ok" and v[0]["recorded_num_blocks"] == 111680 and v[0]["contacted"] == [0]
    for r in (1, 2, 3, 4, 5, 7):  # 111488 < P rank 0's 111680 on the rank-0 pre-handshake
        assert v[r]["status"] == "assert"
        assert v[r]["assert_expr"] == "self.num_blocks >= nixl_agent_meta.num_blocks"
        assert v[r]["contacted"] == [0] and v[r]["handshake"] == 1
    assert v[6]["status"] == "assert" and v[6]["handshake"] == 2 and v[6]["contacted"] == [0, 6]
    assert v[6]["assert_expr"] == "self.dst_num_blocks[engine_id] == nixl_agent_meta.num_blocks"
    assert v[6]["recorded_num_blocks"] == 111680
    corrected = _ranks(doc, "corrected")
    assert [c["status"] for c in corrected] == ["ok"] * 8
    assert [c["recorded_num_blocks"] for c in corrected] == [111680, *[111488] * 5, 112448, 111488]
    # The transfer proof: the release's stride (asserts stripped) delivers wrong blocks, corrected none.
    for d in doc["decode_ranks"]:
        assert d["transfer"]["corrected"]["wrong"] == 0 and d["transfer"]["corrected"]["blocks"] > 0
        if d["tp_rank"] != 0:
            t = d["transfer"]["0.9.1"]
            assert t["wrong"] > 0 and t["wrong_regions"] == [1]
            assert t["first_mismatch"]["region"] == 1
            assert t["stride"] == 111680
    assert doc["survives"] == {"0.9.1": False}


def test_seed_092_survives(pdcheck):
    run = pdcheck("handshake", SEED, "--vllm", "0.9.2", "--json")
    assert run.code == 0, run.err
    doc = run.json()
    assert [v["status"] for v in _ranks(doc, "0.9.2")] == ["ok"] * 8
    assert [v["contacted"] for v in _ranks(doc, "0.9.2")] == [[r] for r in range(8)]
    assert all(d["transfer"]["0.9.2"]["wrong"] == 0 for d in doc["decode_ranks"])


def test_prefill_tp_greater_than_decode_tp(pdcheck):
    run = pdcheck("handshake", "--prefill-tp", "4", "--decode-tp", "2", "--prefill-blocks", "640,600,600,600",
                  "--decode-blocks", "700", "--vllm", "0.9.2", "--json")
    assert run.code == 1, run.err
    doc = run.json()
    for v in _ranks(doc, "0.9.2"):  # tp_ratio = 2 // 4 = 0, then tp_rank // 0 before any request
        assert v["status"] == "error" and v["exception"] == "ZeroDivisionError" and v["contacted"] == []
    c = _ranks(doc, "corrected")
    assert [x["contacted"] for x in c] == [[0, 1], [2, 3]]
    assert c[0]["rank_num_blocks"] == {"0": 640, "1": 600}
    assert all(d["transfer"]["corrected"]["wrong"] == 0 for d in doc["decode_ranks"])


def test_out_of_range_descriptor_ids_surface_nixl_error(pdcheck):
    # D rank 1 records P rank 0's 100 blocks; P rank 1's list holds 40 per region, so region 1 ids overflow.
    run = pdcheck("handshake", "--prefill-tp", "2", "--decode-tp", "2", "--prefill-blocks", "100,40",
                  "--decode-blocks", "100", "--vllm", "0.9.1", "--json")
    assert run.code == 1, run.err
    d1 = run.json()["decode_ranks"][1]
    assert d1["verdicts"]["0.9.1"]["status"] == "assert"
    t = d1["transfer"]["0.9.1"]
    assert t["status"] == "error" and "NIXL_ERR_INVALID_PARAM" in t["message"]
    assert "remote descriptors" not in t["message"] or "P rank 1" in t["message"]


def test_corrupted_block_is_caught(pdcheck):
    import msgspec

    from pdcheck.vllm.plan import make_requests
    from pdcheck.vllm.scenario import load

    sc = load(None, {"prefill": {"num_blocks": 256}, "decode": {"num_blocks": 256}})
    victim = make_requests(sc)[0].remote_block_ids[3]
    run = pdcheck("handshake", "--prefill-blocks", "256", "--decode-blocks", "256", "--vllm", "0.9.2", "--json",
                  "--inject", f"corrupt:P0:1:{victim}")
    assert run.code == 1, run.err
    d0 = run.json()["decode_ranks"][0]
    for name in ("0.9.2", "corrected"):
        t = d0["transfer"][name]
        assert t["wrong"] >= 1, msgspec.json.encode(t)
        assert t["first_mismatch"]["remote_block"] == victim and t["first_mismatch"]["region"] == 1
        assert "untagged" in t["first_mismatch"]["found"]
    assert d0["verdicts"]["0.9.2"]["status"] == "silent"


def test_rank_killed_mid_handshake_is_reported_and_reaped(pdcheck):
    base = free_run(2)
    run = pdcheck("handshake", "--prefill-tp", "2", "--decode-tp", "2", "--prefill-blocks", "64",
                  "--decode-blocks", "64", "--vllm", "0.9.2", "--prefill-base-port", str(base), "--inject", "die:P1",
                  "--hang-timeout", "1", "--json")
    assert run.code == 3, run.err
    doc = run.json()
    assert any("P rank 1" in e for e in doc["harness_errors"])
    v = _ranks(doc, "0.9.2")
    assert v[0]["status"] == "ok"
    assert v[1]["status"] == "hang" and v[1]["contacted"] == [1]  # 0.9.2 has no receive timeout
    assert _ranks(doc, "corrected")[1]["status"] == "error"
    assert is_free(base, 2, reuse=True)  # a TIME_WAIT of the killed rank's connection is no bound port


def test_bad_flags_exit_2_with_one_line(pdcheck):
    run = pdcheck("handshake", "--prefill-tp", "2", "--prefill-blocks", "1,2,3", "--decode-blocks", "4")
    assert run.code == 2
    assert "prefill.num_blocks" in run.err and "expected 2 entries" in run.err
    assert "Traceback" not in run.err and len(run.err.strip().splitlines()) == 1
    run = pdcheck("handshake", "--prefill-blocks", "12x", "--decode-blocks", "4")
    assert run.code == 2 and "--prefill-blocks" in run.err and "Traceback" not in run.err
    run = pdcheck("handshake", "--prefill-blocks", "8", "--decode-blocks", "4", "--vllm", "0.8.5")
    assert run.code == 2 and "not modelled" in run.err


def test_bad_scenario_file_exit_2(pdcheck, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[prefill]\nengine_id = "p"\nnum_blocks = 10\ntp_size = "two"\n[decode]\nnum_blocks = 5\n')
    run = pdcheck("handshake", str(bad))
    assert run.code == 2
    assert str(bad) in run.err and "prefill.tp_size" in run.err and "Traceback" not in run.err


def test_seed_version_matrix_all_releases(pdcheck):
    # Equal TP, one handshake per D rank from 0.9.2 on (reference §5): only 0.9.1's rank-0 pre-handshake fails.
    run = pdcheck("handshake", SEED, "--vllm", "all", "--no-transfer", "--json")
    assert run.code == 1, run.err
    doc = run.json()
    assert not doc["harness_errors"]
    rows = doc["matrix"]
    assert list(rows)[:4] == ["0.9.0", "0.9.1", "0.9.2", "0.10.0"] and "0.34.0" in rows and "corrected" in rows
    assert len(rows) == 24  # 23 release lines (one representative each) + corrected
    assert rows["0.9.1"] == ["ok", *["assert"] * 7]
    assert all(r == ["ok"] * 8 for k, r in rows.items() if k != "0.9.1")
    assert doc["first_surviving"] == "0.9.0"  # kept for compatibility; the summary uses fails / fixed_in
    assert doc["fails"] == ["0.9.1"] and doc["fixed_in"] == "0.9.2"
    assert doc["fail_spans"] == [{"fails": ["0.9.1"], "fixed_in": "0.9.2"}]
    assert doc["survives"]["0.9.1"] is False and doc["survives"]["0.34.0"] is True


def test_seed_matrix_at_80_columns_shows_whole_status_words():
    """The first screen: every status word whole at COLUMNS=80, and which release fails and which fixes it."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    for extra in ([], ["--vllm", "all"]):
        env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="80")
        proc = subprocess.run([sys.executable, "-m", "pdcheck", "handshake", SEED, "--no-transfer", *extra],
                              capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stdout.splitlines()
        assert "…" not in proc.stdout and max(len(ln) for ln in lines) <= 80
        row = next(ln for ln in lines if ln.startswith("vLLM 0.9.1 "))
        cells = row.split()[2:]
        assert cells[0] == "ok" and len(cells) == 8
        # whole words, or one-letter codes that the legend spells out
        assert cells[1:] == ["assert"] * 7 or (cells[1:] == ["A"] * 7 and "A = assert" in proc.stdout)
        assert "fails: 0.9.1 · fixed in 0.9.2" in proc.stdout
        assert "first release that survives" not in proc.stdout
