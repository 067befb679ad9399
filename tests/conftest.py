from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.code = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr

    def json(self) -> dict:
        return json.loads(self.out)


@pytest.fixture(autouse=True, scope="session")
def _rank_logs_removed():
    """In-process runs (the runner tests) share one temporary rank-log directory, which the CLI removes at
    exit; the test session removes it at its end."""
    yield
    from pdcheck import lifecycle

    lifecycle.finish_rank_logs(0)


@pytest.fixture
def pdcheck():
    """Run the real CLI in a fresh interpreter, as a user would."""

    def run(*args: str, timeout: float = 180) -> Run:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, "-m", "pdcheck", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT, env=env)
        return Run(proc)

    return run
