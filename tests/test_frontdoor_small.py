"""The smaller front-door frictions of issue #35, each at its cause: one error voice for a value typer cannot read
(pdcheck's line naming the flag, not pydantic's words), bare `pdcheck handshake` pointing at the bundled
scenarios, a plain progress line on a pipe at least every progress.PIPED_EVERY_S, and no rank-death line when
Ctrl-C stops smoke's runs (pdcheck stopped those ranks itself)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIOS
from loadkit import time_scale
from test_faults import Watch, assert_clean, finish, start

from pdcheck.errors import usage_line


@pytest.mark.parametrize("args, line", [
    (["requests", "--requests", "abc"], "--requests: 'abc' is not a whole number"),
    (["requests", "--rate", "x"], "--rate: 'x' is not a number"),
    (["handshake", "--prefill-tp", "1.5"], "--prefill-tp: '1.5' is not a whole number"),
    (["transfer-bench", "--iters", "-"], "--iters: '-' is not a whole number"),
    (["handshake", "--hang-timeout", ""], "--hang-timeout: an empty value; give one, or leave the flag out"),
])
def test_a_value_typer_cannot_read_is_pdchecks_one_line(pdcheck, args: list[str], line: str) -> None:
    r = pdcheck(*args)
    assert r.code == 2 and r.err == f"pdcheck: error: {line}\n", r.err
    assert "Input should" not in r.err and "valid integer" not in r.err


def test_click_wording_is_translated_too() -> None:
    """typer before 0.29 reads values with click's own types: "'abc' is not a valid integer." (no pydantic)."""
    from pdcheck.errors import usage_error_types

    base = usage_error_types()[0]
    bad = type("BadParameter", (base,), {})("'abc' is not a valid integer.")
    bad.param = type("Opt", (), {"opts": ["-n", "--requests"]})()  # type: ignore[attr-defined]
    assert usage_line(bad) == "--requests: 'abc' is not a whole number"


def test_bare_handshake_points_at_the_bundled_scenarios(pdcheck) -> None:
    r = pdcheck("handshake")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert "prefill.num_blocks: required" in r.err and "`pdcheck list scenarios`" in r.err, r.err
    named = pdcheck("handshake", str(SCENARIOS / "seed-19338-tp8.toml"), "--prefill-tp", "x")
    assert "list scenarios" not in named.err  # a named scenario needs no pointer


def test_a_pipe_gets_a_progress_line_at_least_every_interval(tmp_path: Path) -> None:
    """The real CLI on a pipe, with the interval shortened to 1 s so that a few-second run shows several lines
    (the real interval is 10 s: a run shorter than that prints none, as the docs' transcripts rely on). The
    scenario waits out a real timeout in its side-channel stage (a 0.11.0 D with no receive timeout, stopped by
    the harness's deadline), so lines come while a stage and its count are shown, whatever the load: a run of a
    second or so (seed-19338-tp8 on two releases) could end with only "starting" printed."""
    every = 1.0
    code = (f"import sys; import pdcheck.progress as p; p.PIPED_EVERY_S = {every!r}; sys.argv[0] = 'pdcheck'; "
            "from pdcheck.__main__ import main; main()")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, "handshake", "cross-release-listener-death"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert lines and all(re.fullmatch(r"pdcheck: \d+ s: .+", ln) for ln in lines), proc.stderr
    assert "\x1b" not in proc.stderr  # no bars, no escape codes in a log
    seconds = [int(ln.split()[1]) for ln in lines]
    assert seconds == sorted(seconds) and len(seconds) >= int(wall / (every + time_scale())) - 1, (wall, lines)
    gaps = [b - a for a, b in zip([0, *seconds], seconds, strict=False)]
    assert max(gaps) <= every + 1 + time_scale(), lines  # the thread wakes on time, give or take a loaded core
    assert any(re.search(r" \d+/\d+", ln) for ln in lines), lines  # a stage and its count, not only "starting"


def test_ctrl_c_in_smoke_prints_no_rank_death(tmp_path: Path) -> None:
    """Ctrl-C while smoke runs its scenarios in worker threads: the main thread stops every thread's ranks
    (launcher.abort_all) and the worker threads see them end. pdcheck stopped them: exit 130 and no "P rank 2
    died during handshake: it was killed by SIGKILL; stopping the run" line."""
    d = tmp_path / "dir"
    d.mkdir()
    text = (SCENARIOS / "hetero-d4-p2.toml").read_text()
    for name in ("a", "b"):  # 0.9.0's D ranks 2-3 wait on ports nobody serves: the runs are in the handshake
        (d / f"{name}.toml").write_text(text.replace('name = "hetero-d4-p2"', f'name = "{name}"'))
    w = Watch(start(tmp_path, "smoke", str(d), "-j", "2", "--hang-timeout", "120", new_group=True))
    deadline = time.monotonic() + 240
    # smoke runs every part in a worker thread (the main thread only waits), so one part in its handshake is
    # enough; a loaded machine admits one part at a time (pdcheck.smoke's rank budget)
    while not any(comm.startswith("pdcheck-D2:hs") for comm, _c in w.poll().values()):
        assert time.monotonic() < deadline and w.proc.poll() is None, "no run reached the handshake"
        time.sleep(0.05)
    os.killpg(w.proc.pid, signal.SIGINT)
    code, _out, err = finish(w, timeout=60)
    assert code == 130, err[-2000:]
    assert "died" not in err and "stopping the run" not in err, err
    assert_clean(w, tmp_path, err)
