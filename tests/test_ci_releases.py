"""The vLLM releases .ci/run hands the opt-in wheel suites: derived from pdcheck's release table, never written by
hand (a new line in the table is read by CI without touching .ci/run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdcheck.releaseline import version_tuple
from pdcheck.vllm.releases import SUITE_FROM, TABLE, resolve, suite_releases

ROOT = Path(__file__).resolve().parent.parent


def _ci_list(name: str) -> list[str]:
    """What .ci/run's NAME=... assignment evaluates to, run as the script runs it."""
    line = next(ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln.startswith(f"{name}="))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", "-c", f'{line}\necho "${name}"'], capture_output=True, text=True, check=True,
                         env={**env, "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"}, cwd=ROOT)
    return out.stdout.split()


def test_ci_reads_the_vllm_releases_from_the_table() -> None:
    assert _ci_list("VLLM_RELEASES") == suite_releases()


def test_suite_releases_cover_every_line_and_name_nothing_unknown() -> None:
    got = [version_tuple(v) for v in suite_releases()]
    assert got == sorted(set(got))
    assert all(TABLE.at(v) is not None for v in got)  # every one modelled
    for v in suite_releases():
        assert resolve(v).version == v
    firsts = [f for f in TABLE.firsts() if f >= SUITE_FROM]
    assert set(firsts) <= set(got)  # every modelled line from 0.9.1
    assert got[0] == SUITE_FROM and got[-1] == max(firsts)  # the newest line's first release: CI's "newest"
    minors = {v[1] for v in got}
    assert minors == set(range(SUITE_FROM[1], TABLE.last[1] + 1))  # one wheel at least for every minor
