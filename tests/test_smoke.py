"""`pdcheck smoke` on real ranks: expectations, JUnit XML, exit codes."""

from __future__ import annotations

import shutil
from xml.etree import ElementTree as ET

from conftest import SCENARIOS


def test_smoke_passes_and_writes_valid_junit(pdcheck, tmp_path):
    d = tmp_path / "sc"
    d.mkdir()
    # attn-backend-mismatch: the releases' READs fail inside NIXL, which logs E-lines (makeXferReq: remote index
    # out of range) from C++; an expected failure, so they go to the rank logs, never to a CI log.
    names = ("decode-fewer-blocks", "hetero-p4-d2", "attn-backend-mismatch")
    for name in names:
        shutil.copy(SCENARIOS / f"{name}.toml", d)
    junit = tmp_path / "out.xml"
    run = pdcheck("smoke", str(d), "--junit", str(junit), "--json")
    assert run.code == 0, run.said
    assert "nixl_agent.cpp" not in run.err and run.err == "", run.err
    doc = run.json()
    assert doc["failed"] == 0 and doc["passed"] == len(doc["cases"]) > 0
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites" and int(root.get("failures")) == 0
    suites = root.findall("testsuite")
    assert {s.get("name") for s in suites} == set(names)
    cases = root.findall("testsuite/testcase")
    assert len(cases) == len(doc["cases"]) and all(c.find("failure") is None for c in cases)


def test_failing_expectation_exits_1_and_is_a_junit_failure(pdcheck, tmp_path):
    d = tmp_path / "sc"
    d.mkdir()
    text = (SCENARIOS / "decode-fewer-blocks.toml").read_text()
    # 0.9.1 really asserts `self.num_blocks >= nixl_agent_meta.num_blocks` here; claim it survives.
    (d / "wrong.toml").write_text(text.replace('"0.9.1" = "assert"', '"0.9.1" = "ok"'))
    junit = tmp_path / "out.xml"
    run = pdcheck("smoke", str(d), "--junit", str(junit))
    assert run.code == 1, run.said
    failures = ET.parse(junit).getroot().findall("testsuite/testcase/failure")
    assert len(failures) == 1 and "D0: assert (expected ok)" in failures[0].get("message")


def test_smoke_bad_input_exit_2(pdcheck, tmp_path):
    run = pdcheck("smoke", str(tmp_path / "missing"))
    assert run.code == 2 and "not a directory" in run.err and "Traceback" not in run.err
    (tmp_path / "x.toml").write_text('[prefill]\nnum_blocks = 4\n[decode]\nnum_blocks = 4\n')
    run = pdcheck("smoke", str(tmp_path))
    assert run.code == 2 and "x.toml" in run.err and "expect" in run.err


def test_a_scenario_that_cannot_run_fails_its_cases_and_the_job_goes_on(pdcheck, tmp_path):
    # One scenario's P side channel port is taken by another process (a harness error for that run); smoke
    # names it in that scenario's cases and still runs the next scenario.
    import socket

    d = tmp_path / "sc"
    d.mkdir()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    text = (SCENARIOS / "decode-fewer-blocks.toml").read_text()
    (d / "a-blocked.toml").write_text(text.replace('name = "decode-fewer-blocks"', 'name = "blocked"')
                                      .replace('engine_id = "prefill-5808"',
                                               f'engine_id = "prefill-5808"\nbase_port = {port}'))
    shutil.copy(SCENARIOS / "decode-fewer-blocks.toml", d / "b-good.toml")
    try:
        run = pdcheck("smoke", str(d), "--json")
    finally:
        taken.close()
    assert run.code == 1, run.said
    doc = run.json()
    blocked = [c for c in doc["cases"] if c["scenario"] == "blocked"]
    good = [c for c in doc["cases"] if c["scenario"] == "decode-fewer-blocks"]
    assert blocked and all(not c["passed"] and "harness error" in c["message"] and "in use" in c["message"]
                           for c in blocked), blocked
    assert good and all(c["passed"] for c in good), good
