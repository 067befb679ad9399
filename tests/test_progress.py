"""Progress on stderr when it is a terminal (python's pty), no bars on a pipe: requests (per release line),
handshake (from the start, before its first stage reports), transfer-bench."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SCENARIOS
from ptykit import Pty

BENCH = ["transfer-bench", "--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--tokens", "256", "--iters", "2",
         "--min-time", "0.01"]
REQUESTS = ["requests", str(SCENARIOS / "requests" / "requests-abort-mid-transfer.toml")]
HANDSHAKE = ["handshake", str(SCENARIOS / "decode-fewer-blocks.toml"), "--vllm", "0.9.1,0.9.2,0.10.0"]


@pytest.mark.parametrize(("args", "bar"), [(REQUESTS, "release lines"), (HANDSHAKE, "ranks up"),
                                           (BENCH, "transfer-bench rows")], ids=["requests", "handshake", "bench"])
def test_progress_on_a_terminal(tmp_path: Path, args: list[str], bar: str) -> None:
    t = Pty(tmp_path, *args)
    t.wait_for(bar, 120)
    code = t.finish(120)
    assert code in (0, 1), t.text[-3000:]
    assert "Traceback" not in t.text


def test_handshake_shows_progress_before_its_first_stage(tmp_path: Path) -> None:
    t = Pty(tmp_path, *HANDSHAKE)
    t.wait_for("ranks up", 120)
    assert "starting" in t.text and t.text.index("starting") < t.text.index("ranks up"), t.text[-3000:]
    assert t.finish(120) in (0, 1), t.text[-3000:]


@pytest.mark.parametrize("args", [REQUESTS, HANDSHAKE, BENCH], ids=["requests", "handshake", "bench"])
def test_no_bars_on_a_pipe(pdcheck, args: list[str]) -> None:
    """A pipe gets no bars: at most a plain line every progress.PIPED_EVERY_S (tests/test_frontdoor_small.py)."""
    run = pdcheck(*args)
    assert run.code in (0, 1), run.err
    assert all(re.fullmatch(r"pdcheck: \d+ s: .+", ln) for ln in run.err.splitlines()), run.err
