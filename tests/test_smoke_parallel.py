"""`pdcheck smoke -j N`: scenarios side by side give the cases and JUnit of one at a time; the filters; bad
input; progress on a terminal (a real pty), nothing on a pipe; Ctrl-C prints what finished (exit 130)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from conftest import ROOT, SCENARIOS
from ptykit import Pty


def _dir(tmp_path: Path) -> Path:
    """Two vLLM handshake scenarios, one SGLang scenario (split into one part per release pair) and one
    request-path scenario: every kind of part smoke schedules."""
    d = tmp_path / "sc"
    (d / "sglang").mkdir(parents=True)
    (d / "requests").mkdir()
    for name in ("decode-fewer-blocks", "hetero-p4-d2"):
        shutil.copy(SCENARIOS / f"{name}.toml", d)
    shutil.copy(SCENARIOS / "sglang" / "sglang-kv-dtype-mismatch.toml", d / "sglang")
    shutil.copy(SCENARIOS / "requests" / "requests-abort-mid-transfer.toml", d / "requests")
    return d


def _cases(doc: dict) -> list[tuple]:
    return [(c["framework"], c["scenario"], c["release"], c["expected"], c["got"], c["passed"])
            for c in doc["cases"]]


def _testcases(path: Path) -> list[tuple]:
    root = ET.parse(path).getroot()
    return [(s.get("name"), s.get("tests"), s.get("failures"), tc.get("classname"), tc.get("name"),
             tc.find("failure") is None) for s in root.findall("testsuite") for tc in s.findall("testcase")]


def test_side_by_side_gives_the_cases_and_junit_of_one_at_a_time(pdcheck, tmp_path: Path) -> None:
    d = _dir(tmp_path)
    par = pdcheck("smoke", str(d), "-j", "6", "--json", "--junit", str(tmp_path / "par.xml"))
    ser = pdcheck("smoke", str(d), "-j", "1", "--json", "--junit", str(tmp_path / "ser.xml"))
    assert par.code == 0 and ser.code == 0, par.said + ser.said
    assert par.err == "" and ser.err == "", par.err + ser.err  # a pipe: no progress
    assert _cases(par.json()) == _cases(ser.json())
    assert {c[1] for c in _cases(par.json())} == {"decode-fewer-blocks", "hetero-p4-d2", "sglang-kv-dtype-mismatch",
                                                   "requests-abort-mid-transfer"}
    assert _testcases(tmp_path / "par.xml") == _testcases(tmp_path / "ser.xml")
    # an SGLang scenario run in parts shares one time: the sum of its parts
    secs = {c["seconds"] for c in par.json()["cases"] if c["framework"] == "sglang"}
    assert len(secs) == 1 and secs.pop() > 0


def test_filters_select_by_framework_phase_and_name(pdcheck, tmp_path: Path) -> None:
    d = _dir(tmp_path)
    sg = pdcheck("smoke", str(d), "--framework", "sglang", "--json")
    assert sg.code == 0, sg.said
    assert {c["scenario"] for c in sg.json()["cases"]} == {"sglang-kv-dtype-mismatch"}
    # a flag a selected framework does not take is refused, naming it (SGLang always proves its pages)
    nt = pdcheck("smoke", str(d), "--framework", "sglang", "--no-transfer")
    assert nt.code == 2 and "--no-transfer: not available for SGLang" in nt.err, nt.said
    rq = pdcheck("smoke", str(d), "--phase", "requests", "--json")
    assert rq.code == 0, rq.said
    assert {c["scenario"] for c in rq.json()["cases"]} == {"requests-abort-mid-transfer"}
    k = pdcheck("smoke", str(d), "-k", "fewer", "-k", "p4", "--phase", "handshake", "--framework", "vllm", "--json")
    assert k.code == 0, k.said
    assert {c["scenario"] for c in k.json()["cases"]} == {"decode-fewer-blocks", "hetero-p4-d2"}


@pytest.mark.parametrize(("args", "where"), [
    (["--phase", "transfer"], "--phase: expected one of handshake, requests"),
    (["--framework", "nosuch"], "framework: expected one of "),
    (["-k", "no-such-scenario"], "no scenario matches the filters"),
    (["-j", "0"], "--jobs: expected 1 to"),
])
def test_bad_selection_is_one_line_exit_2(pdcheck, tmp_path: Path, args: list[str], where: str) -> None:
    run = pdcheck("smoke", str(_dir(tmp_path)), *args)
    assert run.code == 2, run.said
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdcheck: error:") and where in lines[0], run.err


def _family(pid: int) -> list[str]:
    """Processes of this session (pdcheck's forkserver and ranks) still alive."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == pid:  # session id
                out.append(d.name)
    return out


def test_smoke_on_a_terminal_shows_cases_and_ctrl_c_prints_what_finished(tmp_path: Path) -> None:
    d = tmp_path / "sc"
    d.mkdir()
    shutil.copy(SCENARIOS / "decode-fewer-blocks.toml", d)  # 5 cases, done in a second or two
    # 2 cases that wait out 0.10.0's and 0.11.0's hang: 60 s each here, so Ctrl-C comes first
    shutil.copy(SCENARIOS / "cross-release-listener-death.toml", d)
    t = Pty(tmp_path, "smoke", str(d), "-j", "2", "--hang-timeout", "60")
    t.wait_for("smoke cases", 60)
    t.wait_for("5/7", 90)  # decode-fewer-blocks finished; the other still hangs
    sigs = _signal_state(t.proc.pid)
    os.killpg(t.proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole foreground group
    t_sig = time.monotonic()
    try:
        code = t.finish(30)
    except AssertionError as exc:
        raise AssertionError(f"SIGINT at {sigs}: {exc}") from None
    assert code == 130, (sigs, t.text[-3000:])
    assert time.monotonic() - t_sig < 15
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", t.text)  # colours and cursor moves
    assert "(interrupted)" in out and "decode-fewer-blocks" in out.split("(interrupted)", 1)[1], out[-3000:]
    table = out.split("(interrupted)", 1)[1]
    assert "cross-release-listener-death" not in table and "5 passed, 0 failed" in table, table
    assert "Traceback" not in out, out
    deadline = time.monotonic() + 5
    while _family(t.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _family(t.proc.pid), f"left running: {_family(t.proc.pid)}"


def test_sequential_ctrl_c_prints_what_finished_as_json(tmp_path: Path) -> None:
    d = tmp_path / "sc"
    d.mkdir()
    shutil.copy(SCENARIOS / "decode-fewer-blocks.toml", d / "a.toml")
    shutil.copy(SCENARIOS / "cross-release-listener-death.toml", d / "b.toml")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "smoke", str(d), "-j", "1", "--hang-timeout", "60",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            start_new_session=True)
    # b.toml's D rank 1 (a.toml has only D0) starts once a.toml finished: one at a time, in file order
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not any(
            _comm(pid).startswith("pdcheck-D1") for pid in _family(proc.pid)):
        time.sleep(0.05)
    time.sleep(0.5)
    sigs = _signal_state(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"still running 30 s after SIGINT at {sigs}") from None
    assert proc.returncode == 130, (sigs, err[-3000:])
    import json

    doc = json.loads(out)
    assert doc["exit_code"] == 130 and {c["scenario"] for c in doc["cases"]} == {"decode-fewer-blocks"}, doc
    assert "Traceback" not in err and err.count("pdcheck: error:") <= 1, err


def _signal_state(pid: int) -> str:
    """The process's blocked and ignored signal masks (a Ctrl-C that does nothing shows why here)."""
    try:
        return " ".join(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if ln.startswith(("SigBlk", "SigIgn", "SigCgt")))
    except OSError:
        return "gone"


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_rank_budget_halves_on_a_machine_other_work_loads() -> None:
    from pdcheck import smoke

    cores = smoke._cores()
    full = smoke.rank_budget()
    assert full == 10 * cores == smoke.rank_budget(0.0) == smoke.rank_budget(smoke.LOADED_PER_CORE * cores)
    assert smoke.rank_budget(smoke.LOADED_PER_CORE * cores + 0.5) == full // 2
