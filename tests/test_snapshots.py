"""Golden documents: every bundled scenario's report (the --json document `pdcheck handshake|requests NAME`
prints, as `pdcheck smoke --documents` writes it) and smoke's cases and JUnit, held against snapshots (syrupy)
normalized by tests/snapkit.py. A change of any verdict, text, count or model shows here as a diff; refresh on
purpose with `pytest tests/test_snapshots.py --snapshot-update` and read the diff.

One smoke run of the bundled scenarios feeds every test (one xdist worker). CI's .ci/run runs that smoke job
anyway: it hands its results over in $PDCHECK_SMOKE_RESULTS (smoke.json, smoke.xml, documents/) instead of a
second run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from conftest import ROOT, SCENARIOS
from snapkit import env, normalize, source
from syrupy.extensions.json import JSONSnapshotExtension

pytestmark = pytest.mark.xdist_group("snapshots")

NAMES = sorted(p.stem for p in SCENARIOS.rglob("*.toml"))


@pytest.fixture(scope="session")
def smoke_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("PDCHECK_SMOKE_RESULTS")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("smoke")
    run = subprocess.run([sys.executable, "-m", "pdcheck", "smoke", "--json", "--junit", str(out / "smoke.xml"),
                          "--documents", str(out / "documents")], cwd=out, capture_output=True, text=True,
                         env=dict(env(), PYTHONPATH=str(ROOT)), timeout=900)
    (out / "smoke.json").write_text(run.stdout)
    assert run.returncode in (0, 1), run.stderr
    return out


@pytest.fixture
def snapshot_json(snapshot):  # type: ignore[no-untyped-def]
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.mark.parametrize("name", NAMES)
def test_document(smoke_results: Path, snapshot_json, name: str) -> None:  # type: ignore[no-untyped-def]
    docs = sorted((smoke_results / "documents").glob(f"{name}.*json"))
    docs = [d for d in docs if d.name.split(".")[0] == name]
    assert docs, f"no document for {name} in {smoke_results / 'documents'}"
    got = {}
    for d in docs:
        doc = json.loads(d.read_text())
        if "source" in doc:
            doc["source"] = source(doc["source"])
        got[d.name] = normalize(doc)
    assert got == snapshot_json


def test_smoke_cases_and_junit(smoke_results: Path, snapshot_json) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads((smoke_results / "smoke.json").read_text())
    cases = [{**normalize(c), "file": source(c["file"])} for c in doc["cases"]]
    root = ET.parse(smoke_results / "smoke.xml").getroot()
    junit = [{"suite": s.get("name"), "tests": s.get("tests"), "failures": s.get("failures"),
              "cases": [{"classname": tc.get("classname"), "name": tc.get("name"), "file": source(tc.get("file", "")),
                         "failure": None if (f := tc.find("failure")) is None else
                         {"message": f.get("message"), "text": f.text}}
                        for tc in s.findall("testcase")]}
             for s in root.findall("testsuite")]
    assert {"exit_code": doc["exit_code"], "passed": doc["passed"], "failed": doc["failed"], "cases": cases,
            "junit": junit} == snapshot_json


@pytest.mark.parametrize(("phase", "name"), [("handshake", "hetero-d4-p2"), ("requests", "requests-abort-mid-transfer")])
def test_a_document_is_what_the_command_prints(smoke_results: Path, phase: str, name: str) -> None:
    """`smoke --documents` writes the document `pdcheck <phase> NAME --json` prints (same run options)."""
    run = subprocess.run([sys.executable, "-m", "pdcheck", phase, name, "--json"], capture_output=True, text=True,
                         env=dict(env(), PYTHONPATH=str(ROOT)), timeout=300)
    assert run.returncode in (0, 1), run.stderr
    by_command, by_smoke = (normalize({**d, "source": source(d.get("source", ""))}) for d in (
        json.loads(run.stdout), json.loads((smoke_results / "documents" / f"{name}.json").read_text())))
    assert by_command == by_smoke
