from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"

# The CLI runs here as on a pipe (a CI log): no window width. pytest-xdist's workers set COLUMNS=80 LINES=24, which
# would wrap the reports the tests read; a test that wants a width sets its own.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)

# A shell's background job (`pytest &` in a script, a CI step) starts with SIGINT ignored, and an ignored signal is
# inherited by every child: the pdcheck processes the signal tests start would keep ignoring a Ctrl-C, as pdcheck
# rightly does when started that way. The tests model a terminal's Ctrl-C, so their children start with it live.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite runs on pytest-xdist (`-n`, `--dist loadgroup`): Ray clusters on loopback share host ports that
    `ray start` does not let us choose all of (its dashboard agent's, among others), so every Ray test runs on one
    worker, one cluster at a time."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group("ray"))


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self) -> dict:
        return json.loads(self.out)

    @property
    def said(self) -> str:
        """stderr and the end of stdout: why a run ended as it did (a --json run's cases and harness errors)."""
        return f"{self.err}\n--- stdout, last 4000 characters ---\n{self.out[-4000:]}"


@pytest.fixture(autouse=True, scope="session")
def _rank_logs_removed():
    """In-process runs (the runner tests) share one temporary rank-log directory, which the CLI removes at
    exit; the test session removes it at its end."""
    yield
    from pdcheck import lifecycle

    lifecycle.finish_rank_logs(0)


@pytest.fixture(autouse=True)
def _slow_motion_under_load(monkeypatch: pytest.MonkeyPatch) -> float:
    """Every request run of the test, in its process or a child, at the machine's slow motion (tests/loadkit.py)."""
    from loadkit import time_scale

    from pdcheck.vllm.requests.plan import TIME_SCALE_ENV

    k = time_scale()
    monkeypatch.setenv(TIME_SCALE_ENV, f"{k:g}")
    return k


@pytest.fixture
def pdcheck():
    """Run the real CLI in a fresh interpreter, as a user would."""

    def run(*args: str, timeout: float = 180) -> Run:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, "-m", "pdcheck", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=env)
        return Run(proc)

    return run
