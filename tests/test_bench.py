"""transfer-bench: real rank processes, real NIXL agents (UCX), host memory, small shapes.

Every CLI test runs `python -m pdcheck transfer-bench` in a fresh interpreter, as a user would (the Ctrl-C
test through `python -m pdcheck.bench`, the README's other spelling of the same entry point).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pdcheck import envelope
from pdcheck.bench import measure, schema, tables
from pdcheck.bench import messages as bm
from pdcheck.bench.models import resolve_shape
from pdcheck.errors import BadInput
from pdcheck.geometry import ModelShape, read_source
from pdcheck.kvcache import KVCache, check_range, desc_ids

ROOT = Path(__file__).resolve().parent.parent
# 2 layers x K/V, 2 KV heads x 64 x bf16: 4 KiB blocks at 16 tokens; 4 requests of 256 tokens.
SMALL = ["--model", "custom", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--tokens", "256",
         "--requests", "4", "--iters", "40", "--min-time", "0.05"]


# Every pdcheck this module starts carries this mark in its environment, which its ranks and forkserver inherit:
# how rank_pids tells this run's processes from those of another test run on the same machine.
RUN_MARK = f"PDCHECK_TEST_RUN={uuid.uuid4().hex}".encode()


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), PDCHECK_TEST_RUN=RUN_MARK.decode().partition("=")[2], **extra)


def bench(*args: str, timeout: float = 120, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = _env(**env_extra)
    return subprocess.run([sys.executable, "-m", "pdcheck", "transfer-bench", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def rank_pids(forkserver: bool = False) -> list[int]:
    """Live transfer-bench processes this module started, from /proc (zombies excluded): ranks name
    themselves pdcheck-P0, pdcheck-D1 (/proc/PID/comm); with forkserver, their forkserver too. Another test
    run's processes on the same machine lack this module's RUN_MARK and are not ours to count."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text().strip()
            cmd = (d / "cmdline").read_bytes()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            ours = comm.startswith(("pdcheck-P", "pdcheck-D")) or (forkserver and b"forkserver" in cmd)
            env = (d / "environ").read_bytes() if ours else b""
        except OSError:
            continue
        if ours and state != "Z" and RUN_MARK + b"\0" in env + b"\0":
            out.append(int(d.name))
    return out


def test_json_follows_schema_and_every_block_arrives() -> None:
    p = bench(*SMALL, "--block-size", "16,32", "--json", "--min-bw", "0.001")
    assert p.returncode == 0, p.stderr
    report = msgspec.json.decode(p.stdout, type=schema.Report)  # strict: every field, every type
    doc = json.loads(p.stdout)
    assert doc["schema"] == envelope.SCHEMA and doc["ok"] is True and doc["exit_code"] == p.returncode
    assert [r["block_tokens"] for r in doc["rows"]] == [16, 32]
    for r, blocks in zip(doc["rows"], (16, 8), strict=True):
        for key in ("block_bytes", "bytes", "desc_count", "desc_count_merged", "gbps", "p50_us", "p99_us",
                    "p999_us", "wrong"):
            assert key in r
        assert r["wrong"] == 0 and r["first_wrong"] is None
        assert r["checked"] == 4 * 4 * blocks  # requests x regions x blocks: every block compared
        assert r["desc_count"] == 4 * blocks and r["bytes"] == r["desc_count"] * r["block_bytes"]
        assert r["block_bytes"] == r["block_tokens"] * 2 * 64 * 2
        assert 1 <= r["desc_count_merged"] <= r["desc_count"]
        assert r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["wire_gbps"] > 0
        assert r["p50_us"] <= r["p99_us"] <= r["p999_us"] <= r["max_us"]
        assert r["wire_wrong"] == 0 and r["cache_hot"] is True  # 256 KiB x 4 requests is far below the LLC
    assert doc["ceilings"]["memcpy_gbps"] > 0 and doc["ceilings"]["wire_gbps"] > 0
    assert report.transport.data, "the UCX transport that carried the READs was not identified"
    assert report.transport.progress_thread is False
    assert report.env.nixl != "not installed" and report.env.ucx != "unknown"
    assert set(report.env.pinning) == {"P0", "D0"}
    assert any("cache-hot" in w for w in report.warnings)


def test_contiguous_runs_are_merged_as_predicted() -> None:
    # 16 blocks per request in runs of 8 on both sides: NIXL must merge each run into one descriptor.
    p = bench(*SMALL, "--block-size", "16", "--run-length", "8", "--csv")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    head = lines[0].split(",")
    row = dict(zip(head, lines[1].split(","), strict=True))
    assert len(lines) == 2
    assert int(row["desc_count"]) == 64
    assert int(row["desc_runs"]) == 8  # 4 regions x 2 runs
    assert int(row["desc_count_merged"]) == 8
    assert int(row["wrong"]) == 0


def test_block_corrupted_at_the_source_is_caught() -> None:
    p = bench(*SMALL, "--block-size", "16", "--json", "--corrupt-block", "5")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is False
    row = doc["rows"][0]
    assert row["wrong"] == 1
    block = row["block_bytes"]
    assert "layer 0 K" in row["first_wrong"] and f"byte offset {block // 2};" in row["first_wrong"]
    assert "found untagged bytes" in row["first_wrong"]  # the flipped byte breaks its cell's check value


def test_floors_set_the_exit_code() -> None:
    slow = bench(*SMALL, "--block-size", "16", "--min-bw", "1e9")
    assert slow.returncode == 1, slow.stderr
    assert "FAILED" in slow.stdout and "--min-bw" in slow.stdout
    tail = bench(*SMALL, "--block-size", "16", "--max-p99", "0.001", "--jsonl")
    assert tail.returncode == 1, tail.stderr
    lines = [json.loads(x) for x in tail.stdout.splitlines()]
    assert [x["type"] for x in lines] == ["header", "row", "summary"]
    assert lines[-1]["ok"] is False and "--max-p99" in lines[-1]["floors"]["failures"][0]


def test_table_names_transport_progress_thread_and_ceilings() -> None:
    p = bench(*SMALL, "--block-size", "16")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for text in ("#wrong", "GB/s", "memcpy", "wire", "progress thread off", "transport:", "p999"):
        assert text in out
    assert not rank_pids(forkserver=True)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    # matplotlib is in the [test] extra; a tree installed without it (plain `pip install -e .`) skips.
    pytest.importorskip("matplotlib", reason="--plot needs the [plot] extra (matplotlib)")
    png = tmp_path / "bench.png"
    p = bench(*SMALL, "--block-size", "16", "--plot", str(png))
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_diagnosis_flags_tcp_fallback_and_a_spinning_progress_thread() -> None:
    # UCX restricted to TCP by the environment: what CMA-less containers get, silently.
    p = bench(*SMALL, "--block-size", "16", "--json", "--progress-thread", UCX_TLS="tcp,self")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert any(d.startswith("tcp/") for d in doc["transport"]["data"])
    warnings = " | ".join(doc["warnings"])
    assert "fell back to TCP" in warnings
    assert "progress thread enabled" in warnings and "CPU-s/s" in warnings
    assert doc["transport"]["progress_thread"] is True


def test_best_and_shm_transports_say_what_they_cost() -> None:
    best = bench(*SMALL, "--block-size", "16", "--json", "--transport", "best")
    assert best.returncode == 0, best.stderr
    doc = json.loads(best.stdout)
    t = doc["transport"]
    assert t["error_mode"] == "none" and t["preset"] == "best"
    assert any(d.startswith("cma/") for d in t["data"])
    # error mode none moves notifications off tcp/lo onto shared memory
    assert t["notifications"] and not any("tcp" in n for n in t["notifications"])
    assert any("peer-failure" in c for c in t["costs"])
    shm = bench(*SMALL, "--block-size", "16", "--json", "--transport", "shm")
    assert shm.returncode == 0, shm.stderr
    doc = json.loads(shm.stdout)
    t = doc["transport"]
    assert any("software emulation" in d for d in t["data"])
    assert any("busy core" in c for c in t["costs"])
    assert doc["env"]["ucx_env"]["UCX_TLS"] == "posix,sysv,self"
    assert doc["rows"][0]["wrong"] == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "Llama-9000"], "Llama-9000"),
        (["--tokens", "-5"], "--tokens"),
        (["--block-size", "16,abc"], "--block-size"),
        (["--dtype", "int3"], "--dtype"),
        (["--iters", "many"], "--iters"),
        (["--transport", "warp"], "--transport"),
        (["--prefill-tp", "2", "--decode-tp", "1"], "decode TP 1 < prefill TP 2"),
        (["--kv-heads", "3", "--decode-tp", "2"], "KV heads"),
        (["--json", "--csv"], "exclusive"),
        (["--model", "custom", "--layers", "2"], "--kv-heads"),
        (["--min-bw", "-1"], "--min-bw"),
        (["--corrupt-block", "-1"], "--corrupt-block"),
        (["--requests", "4097"], "--requests"),
        (["--layers", "1025"], "--layers"),
        (["--block-size", "16", "--timeout", "nan"], "--timeout"),
        (["--log-dir", "tests/test_bench.py"], "not a directory"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str) -> None:
    p = bench(*args, timeout=30)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert lines[0].startswith("pdcheck: error: ")  # the one entry point's prefix, as for every command
    assert "Traceback" not in p.stderr and p.stdout == ""


def test_log_dir_is_created_with_its_parents(tmp_path: Path) -> None:
    logs = tmp_path / "a" / "b"
    p = bench(*SMALL, "--block-size", "16", "--json", "--log-dir", str(logs))
    assert p.returncode == 0, p.stderr
    assert (logs / "D0.log").is_file() and (logs / "P0.log").is_file()


def test_help_has_panels_examples_and_metavars() -> None:
    import typer

    from pdcheck.cli import app

    cmd = typer.main.get_command(app).get_command(None, "transfer-bench")  # type: ignore[attr-defined]
    for p in cmd.params:
        if getattr(p, "hidden", False) or p.param_type_name != "option":
            continue
        assert p.help and p.rich_help_panel and p.metavar is not None, p.opts
    assert cmd.epilog and "Examples" in cmd.epilog
    run = subprocess.run([sys.executable, "-m", "pdcheck", "transfer-bench", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env=_env(COLUMNS="120"))
    assert run.returncode == 0
    for panel in ("Model and TP", "Sweep", "Transport", "Run", "Output", "CI floors"):
        assert f"─ {panel} " in run.stdout
    assert "Examples" in run.stdout and "pdcheck[plot]" in run.stdout
    assert "<int>" not in run.stdout and "<str>" not in run.stdout and "<float>" not in run.stdout


def _default_sigint() -> None:
    # What a terminal gives the command it starts. pytest itself may run with SIGINT ignored (a background
    # job of a non-interactive shell, some CI runners); the child would inherit that, ignore our SIGINT as
    # POSIX tools do, finish the sweep and exit 0. That, not load, was why this test used to flake.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_reaps_every_rank() -> None:
    env = _env()
    # Long enough to be interrupted mid-sweep.
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck.bench", "transfer-bench", *SMALL, "--block-size",
                             "16,16,16,16,16,16", "--min-time", "1", "--iters", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 30
        ranks: list[int] = []
        while time.monotonic() < deadline and len(ranks) < 2:
            time.sleep(0.1)
            ranks = rank_pids()
        assert len(ranks) == 2, "the ranks never started"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err
    assert not rank_pids(forkserver=True)


def test_a_dead_rank_is_reported_at_once_and_logs_are_kept(tmp_path: Path) -> None:
    env = _env()
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "transfer-bench", *SMALL, "--block-size",
                             "16,16,16,16,16,16", "--min-time", "1", "--iters", "0", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 30
        victim = None
        while time.monotonic() < deadline and victim is None:
            time.sleep(0.1)
            victim = next((pid for pid in rank_pids() if Path(f"/proc/{pid}/comm").read_text().strip()
                           == "pdcheck-P0"), None) if (tmp_path / "D0.log").exists() else None
        assert victim is not None, "the ranks never started"
        time.sleep(1.0)  # mid-sweep
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, err
    line = err.strip().splitlines()[-1]
    assert "rank P0 was killed by SIGKILL" in line, err
    assert took < 10, f"reported {took:.1f} s after the kill"
    assert not rank_pids(forkserver=True)
    # each rank's fd 1/2 went to its own log: UCX's protocol tables are in the decode rank's
    assert "cfg#" in (tmp_path / "D0.log").read_text(errors="replace")
    assert (tmp_path / "P0.log").exists()


# --- pure functions: no processes -----------------------------------------------------------------


def test_presets_get_the_kv_shapes_right() -> None:
    ds = resolve_shape("DeepSeek-V3")
    assert (ds.mla, ds.layers, ds.regions, ds.head_dim) == (True, 61, 61, 576)
    # MLA latent KV is replicated: every TP rank holds the whole latent block.
    g = ds.geometry(8, 64)
    assert (g.local_kv_heads, g.head_start(5), g.block_len) == (1, 0, 64 * 576 * 2)
    l70 = resolve_shape("llama-3.1-70b")
    assert (l70.layers, l70.kv_heads, l70.head_dim, l70.regions) == (80, 8, 128, 160)
    q = resolve_shape("Qwen3-8B", dtype="fp8")
    assert (q.layers, q.kv_heads, q.dtype_bytes) == (36, 8, 1)
    assert l70.geometry(16, 16).head_start(3) == 1  # TP 16 > 8 heads: pairs of ranks share a head
    # decode rank 3 of 4 holds heads 6..7: the second half of prefill rank 1's heads-first block
    d = l70.geometry(4, 16)
    assert read_source(l70.geometry(2, 16), d, 3) == (1, 2 * 16 * 128 * 2) and d.local_kv_heads == 2
    assert read_source(l70.geometry(4, 16), l70.geometry(2, 16), 0) is None  # heads of two prefill ranks
    with pytest.raises(BadInput):
        resolve_shape("Llama-3.1-8B", dtype="int4")


def test_block_tables_come_in_runs_and_never_share_blocks() -> None:
    tbl, nb = tables.block_tables(5, 10, 4, np.random.default_rng(1))
    assert tbl.shape == (5, 10) and nb == 5 * 3 * 4
    assert len(set(tbl.ravel().tolist())) == 50
    for t in tbl:
        for start in (0, 4, 8):
            run = t[start:start + 4]
            assert (np.diff(run) == 1).all()
    ids = desc_ids(3, nb, tbl[0])
    assert ids[10] == nb + tbl[0][0]  # region-major: region * num_blocks + block


def test_check_names_the_block_that_arrived_instead() -> None:
    # One KV cache model and one coordinate pattern for both commands: P's cache tagged whole, D's holding
    # P blocks 1, 2, 3 of every region with 2 and 3 swapped in transit in region 1 (layer 0 V).
    shape = resolve_shape(None, layers=1, kv_heads=2, head_dim=64)
    g = shape.geometry(1, 16)
    p, d = KVCache(g, 8), KVCache(g, 8)
    p.fill(7, 0)
    p_ids, d_ids = np.array([1, 2, 3]), np.array([0, 1, 2])
    d.blocks3[:, d_ids] = p.blocks3[:, p_ids]
    d.blocks3[1, [1, 2]] = p.blocks3[1, [3, 2]]
    chk = measure.verify_requests(d, g, 7, 0, 0, p_ids[None, :], d_ids[None, :])
    assert (chk.checked, chk.wrong) == (6, 2)
    assert chk.first is not None and chk.first.startswith("layer 0 V, prefill block 2 -> decode block 1, byte offset 0")
    assert "found P rank 0 layer 0 V (region 1) block 3 +0" in chk.first
    d.blocks3[1, [1, 2]] = p.blocks3[1, [2, 3]]
    assert measure.verify_requests(d, g, 7, 0, 0, p_ids[None, :], d_ids[None, :]).wrong == 0
    # the wire ceiling's check over a contiguous run of P's cache, starting mid-block
    start = g.block_len + 48
    assert check_range(p.arena.arr[start:start + 3 * g.block_len].copy(), 7, 0, g, 8, start) == 0
    wrong = p.arena.arr[start:start + 3 * g.block_len].copy()
    wrong[100] ^= 1
    assert check_range(wrong, 7, 0, g, 8, start) == 1


def test_plot_checks_before_anything_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    from pdcheck import figure

    with pytest.raises(BadInput, match=r"name a \.png, \.svg, \.pdf file"):
        figure.check(tmp_path / "x.txt")
    with pytest.raises(BadInput, match="directory does not exist"):
        figure.check(tmp_path / "nowhere" / "x.png")
    figure.check(tmp_path / "x.png")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BadInput, match="matplotlib"):
        figure.check(tmp_path / "x.png")


# --- the rank skeleton's failure paths, with real rank processes -----------------------------------------
def _spec(role: str, **kw: object) -> bytes:

    fields: dict[str, object] = dict(
        role=role, tp_rank=0, agent_name=f"pdcheck-test-{role}0", arena_bytes=1 << 20, device="cpu", gpu=0,
        cores=[], error_mode=None, progress_thread=False, target_busy=False, ucx_env={},
        shape=ModelShape("t", 2, 2, 64, "bf16", False), ptp=1, dtp=1, iters=1, warmup=1, min_time=0.01,
        notif=False)
    return msgspec.msgpack.encode(bm.BenchSpec(**{**fields, **kw}))


def test_rank_that_cannot_start_or_fails_later_says_why_in_one_line() -> None:
    """Set-up failure: one Failed line, exit 0. A failure after Ready: one Failed line, its log, exit 1."""
    from pdcheck import messages as m
    from pdcheck import orchestrate as orc
    from pdcheck.bench.rank import bench_main
    from pdcheck.errors import HarnessError
    from pdcheck.launcher import launcher, stop_forkserver

    stage = orc.Stage("{rank} failed: {error}", "{rank} died: it {ended}", "{ranks} late", 60)
    try:
        with launcher() as lau:
            p0 = lau.start("P", 0, bench_main, _spec("P", cores=[1 << 20]))  # no such core
            with pytest.raises(HarnessError, match=r"^P rank 0 failed: OSError: \[Errno 22\] Invalid argument$"):
                orc.gather(lau, [p0], bm.BenchReady, 60, stage)
            assert p0.reap(10) == 0
            d0 = lau.start("D", 0, bench_main, _spec("D"))
            orc.gather(lau, [d0], bm.BenchReady, 60, stage)
            d0.send(bm.Peers([bm.PeerInfo(0, "p", b"not NIXL metadata", 0, 0)]))
            with pytest.raises(HarnessError, match=r"^D rank 0 failed: NIXL add_remote_agent failed"):
                orc.gather(lau, [d0], m.Ack, 60, stage)
            assert d0.reap(10) == 1
    finally:
        stop_forkserver()
