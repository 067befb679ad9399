"""Every command's --json against the one schema (docs/json.md): the real CLI in a fresh interpreter, its stdout
decoded with msgspec into the typed envelope and the command's typed body (decoding is the validation), the
envelope's exit_code equal to the process's, and per-rank verdicts of one shape whatever the framework."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

import pdcheck
from pdcheck import envelope, verdict
from pdcheck.bench import schema as bench_schema
from pdcheck.doctor.run import Report as DoctorReport
from pdcheck.sglang.probe import SgProbeReport
from pdcheck.sglang.report import SgReport
from pdcheck.sglang.serve import Served
from pdcheck.smoke import SmokeReport
from pdcheck.vllm.probe import ProbeReport
from pdcheck.vllm.report import Report
from pdcheck.vllm.requests.report import RequestsReport
from pdcheck.vllm.serve import Ready

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
SEED_LOG = ROOT / "tests" / "data" / "seed-19338-workers.log"
TINY = ("--prefill-tp", "1", "--decode-tp", "1", "--prefill-blocks", "64", "--decode-blocks", "64")


class FromLogsDoc(msgspec.Struct, forbid_unknown_fields=True):
    """`scenario from-logs --json` (vLLM logs): its body as docs/json.md gives it."""

    scenario: dict[str, Any]
    sources: dict[str, Any]
    missing: list[str]
    notes: dict[str, list[str]]  # per side
    output: str | None
    tool: str = ""
    version: str = ""
    schema: str = ""
    command: str = ""
    framework: str | None = None
    exit_code: int | None = None


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run([sys.executable, "-m", "pdcheck", *args], cwd=ROOT, env=ENV, capture_output=True,
                          timeout=timeout)
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()
    return proc


def checked(line: bytes, body: Any, command: str, framework: str | None, code: int | None) -> Any:
    """The envelope's fields, then the body decoded as its Struct; returns the body."""
    head = msgspec.json.decode(line, type=envelope.Envelope)
    assert (head.tool, head.version, head.schema) == ("pdcheck", pdcheck.__version__, envelope.SCHEMA)
    assert (head.command, head.framework, head.exit_code) == (command, framework, code)
    assert list(json.loads(line))[:len(envelope.ENVELOPE_KEYS)] == list(envelope.ENVELOPE_KEYS)  # envelope first
    return msgspec.json.decode(line, type=body)


def doc(proc: subprocess.CompletedProcess[bytes], body: Any, command: str, framework: str | None) -> Any:
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout.decode() + proc.stderr.decode()
    return checked(lines[0], body, command, framework, proc.returncode)


def one_shape(verdicts: list[verdict.RankVerdict]) -> None:
    """The common list: every entry the same Struct, a rank id, a status; no corrected rows."""
    assert verdicts
    for v in verdicts:
        assert type(v) is verdict.RankVerdict and v.rank.startswith(("D", "DP")) and v.status
        assert v.release != "corrected"


# ------------------------------------------------------------------------------------------------- handshake
def test_handshake_vllm() -> None:
    p = cli("handshake", *TINY, "--vllm", "0.9.1", "--json")
    rep = doc(p, Report, "handshake", "vllm")
    one_shape(rep.verdicts)
    assert [(v.release, v.rank, v.status) for v in rep.verdicts] == [("0.9.1", "D0", "ok")]
    assert rep.verdicts[0].proof is not None and rep.verdicts[0].proof.blocks > 0
    assert rep.exit_code == p.returncode == verdict.exit_code_of(rep.verdicts) == 0
    # the common list and the vLLM section tell one story
    assert [v.status for v in rep.verdicts] == rep.matrix["0.9.1"] == [d.verdicts["0.9.1"].status
                                                                       for d in rep.decode_ranks]


def test_handshake_vllm_dp_rank_ids() -> None:
    p = cli("handshake", "dp2-wrong-port-27083", "--vllm", "0.14.0", "--no-transfer", "--json")
    rep = doc(p, Report, "handshake", "vllm")
    one_shape(rep.verdicts)
    assert [(v.rank, v.status) for v in rep.verdicts] == [("DP0/D0", "ok"), ("DP0/D1", "ok"), ("DP1/D0", "error"),
                                                           ("DP1/D1", "error")]
    assert "engine ID mismatch" in rep.verdicts[2].detail and rep.verdicts[2].proof is None
    assert p.returncode == 1 == verdict.exit_code_of(rep.verdicts)


def test_handshake_sglang() -> None:
    p = cli("handshake", "sglang-kv-dtype-mismatch", "--sglang", "0.5.8,0.5.13", "--json")
    rep = doc(p, SgReport, "handshake", "sglang")
    one_shape(rep.verdicts)
    assert [(v.release, v.rank, v.status) for v in rep.verdicts] == [("0.5.8", "D0", "silent"),
                                                                      ("0.5.13", "D0", "error")]
    assert rep.verdicts[0].proof is not None and rep.verdicts[0].proof.wrong > 0
    assert p.returncode == 1 == verdict.exit_code_of(rep.verdicts)
    assert {r: [v.status for v in rep.verdicts if v.release == r] for r in rep.matrix} == rep.matrix


# -------------------------------------------------------------------------------------------------- requests
def test_requests() -> None:
    p = cli("requests", "requests-read-failure", "--vllm", "0.13.0", "--json")
    rep = doc(p, RequestsReport, "requests", "vllm")
    one_shape(rep.verdicts)
    rows = [(row.request, row.verdict) for r in rep.releases for row in r.rows]
    assert [(v.request, v.status) for v in rep.verdicts] == rows and {v.rank for v in rep.verdicts} == {"D0"}
    assert rep.exit_code == p.returncode


# ------------------------------------------------------------------------------------------- serve and probe
@contextmanager
def serving(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], bytes]]:
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "serve", *args, "--json"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(60)
        assert got and got[0], proc.stderr.read().decode() if proc.poll() is not None else "no ready line"  # type: ignore[union-attr]
        yield proc, got[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_serve_and_probe_vllm() -> None:
    with serving(*TINY, "--vllm", "0.11.1") as (_proc, line):
        ready = checked(line, Ready, "serve", "vllm", None)  # written while serving: no exit code yet
        assert ready.event == "ready"
        p = cli("probe", f"{ready.host}:{ready.base_port}", "--vllm", "0.11.1", *TINY, "--json")
    rep = doc(p, ProbeReport, "probe", "vllm")
    one_shape(rep.verdicts)
    assert [(v.release, v.rank, v.status) for v in rep.verdicts] == [("0.11.1", "D0", "ok")]
    assert rep.decode_status == [v.status for v in rep.verdicts] and rep.exit_code == p.returncode == 0


def test_serve_and_probe_sglang() -> None:
    with serving("--sglang", "0.5.8") as (_proc, line):
        ready = checked(line, Served, "serve", "sglang", None)
        p = cli("probe", ready.bootstrap_url, "--sglang", "0.5.8", "--json")
    rep = doc(p, SgProbeReport, "probe", "sglang")
    one_shape(rep.verdicts)
    assert [(v.release, v.rank, v.status, v.stage) for v in rep.verdicts] == [("0.5.8", "D0", "ok", "bootstrap")]
    assert rep.exit_code == p.returncode == 0


# --------------------------------------------------------------------------------------- smoke and from-logs
def test_smoke(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(
        'name = "tiny"\nvllm = ["0.9.1"]\n[prefill]\ntp_size = 1\nnum_blocks = 64\n'
        '[decode]\ntp_size = 1\nnum_blocks = 64\n[expect]\n"0.9.1" = "ok"\n"corrected" = "assert"\n')
    p = cli("smoke", str(tmp_path), "--json")
    rep = doc(p, SmokeReport, "smoke", None)
    assert [(c.release, c.passed, c.got) for c in rep.cases] == [("0.9.1", True, ["ok"]),
                                                                  ("corrected", False, ["ok"])]
    assert rep.exit_code == p.returncode == 1 and rep.failed == 1


def test_scenario_from_logs() -> None:
    p = cli("scenario", "from-logs", str(SEED_LOG), str(SEED_LOG), "--json")
    rep = doc(p, FromLogsDoc, "scenario from-logs", "vllm")
    assert rep.scenario["prefill"]["tp_size"] == 8 and p.returncode == 0


# -------------------------------------------------------------------------------------------- transfer-bench
BENCH = ("transfer-bench", "--model", "custom", "--layers", "1", "--kv-heads", "1", "--head-dim", "64", "--tokens", "64",
         "--block-size", "16", "--requests", "2", "--iters", "2", "--min-time", "0.001")


@pytest.mark.parametrize("fmt", ["--json", "--jsonl"])
def test_transfer_bench(fmt: str) -> None:
    p = cli(*BENCH, fmt)
    if fmt == "--json":
        rep = doc(p, bench_schema.Report, "transfer-bench", None)
        assert rep.ok is (p.returncode == 0)
        return
    lines = p.stdout.splitlines()
    assert p.returncode in (0, 1), p.stderr.decode()
    kinds = bench_schema.Header | bench_schema.RowLine | bench_schema.SummaryLine
    got = [checked(x, kinds, "transfer-bench", None, p.returncode) for x in lines]  # the envelope on every line
    assert [type(x).__name__ for x in got] == ["Header", "RowLine", "SummaryLine"]


# ------------------------------------------------------------------------------------------------- doctor
def test_doctor() -> None:
    p = cli("doctor", "--json")
    rep = doc(p, DoctorReport, "doctor", None)
    assert rep.mode == "node" and rep.checks
    assert p.returncode == verdict.exit_code(c.status != "FAIL" for c in rep.checks)
    assert rep.transfers and rep.transfers[0].data and rep.transfers[0].blocks_wrong == 0  # UCX's own protocol


# ------------------------------------------------------------------------------------------------- list
def test_list() -> None:
    from pdcheck.catalog import Catalog

    p = cli("list", "--json")
    rep = doc(p, Catalog, "list", None)
    assert p.returncode == 0 and rep.scenarios and rep.releases
    assert {s.framework for s in rep.scenarios} >= {"vllm", "sglang"}
