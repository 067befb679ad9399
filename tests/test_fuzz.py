"""A seeded mutation fuzzer over scenario files, flags, smoke directories and transfer-bench flags.

The contract (README "Bad input, faults and security"): bad input is exit 2 with exactly one line on stderr,
`pdcheck: error: <where>: <what>`, no traceback, nothing started; good input starts ranks. Most cases run
in-process through pdcheck.cli.run with the point where ranks would start replaced by a marker, so hundreds
of cases take seconds; a representative subset runs through the real CLI in a subprocess, valid ones to the
end, each checked for exit code, one line, no traceback and nothing left running or in $TMPDIR.

Deterministic: one seed per case (FUZZ_SEED to vary). Violations are collected and reported together.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, SCENARIOS

BASE_SEED = int(os.environ.get("FUZZ_SEED", "7"))
BUNDLED = sorted(SCENARIOS.glob("*.toml"))


class WouldStart(BaseException):
    """Raised where the real command would start rank processes: the input passed every check. A BaseException:
    cli.run turns every Exception it did not expect into an exit 3 line."""


@dataclass
class Case:
    name: str
    argv: list[str]


# ---- hostile values ----------------------------------------------------------------------------------------
INTS: list[Any] = [-1, 0, 1, 2, 3, 63, 64, 65, 255, 256, 1000, 1023, 1024, 65530, 65536, 2**31, 2**32,
                   2**63, 2**64 + 1, 10**12, 10**30]
FLOATS: list[Any] = [math.nan, math.inf, -math.inf, 1e300, -1.5, 0.0, 0.5]
STRINGS: list[Any] = ["", "abc", "０", "0.9", "0.9.1.1", "9.9.9", "all", "::1", "localhost", "[expect]",
                      "[red]x[/red]", "x" * 300, "caf\u00e9", "\u202e", "a\tb", "HND", "NHD", "fp8", "int3",
                      "corrected", "0.13", "v0.34.0"]
OTHER: list[Any] = [True, [], {}, [1, 2, 3], [0], ["0.9.1"], {"a": 1}, [[1]]]
FLAG_VALUES = ["abc", "", "-1", "0", "1", "2", "3", "64", "65", "257", "1000", "99999999999999999999",
               "1e300", "nan", "inf", "-inf", "0.0", "３", "1,2,3", "0.9", "0.9.1.1", "9.9.9", "all", "::1",
               "''", "localhost", "[expect]", "x" * 3000, "0x10", "1_000", " 2", "5808,5800", "cuda", "gpu"]


def _value(rng: random.Random) -> Any:
    pool = rng.choice([INTS, INTS, FLOATS, STRINGS, OTHER])
    return rng.choice(pool)


# ---- a small TOML writer (tomllib only reads) ----------------------------------------------------------------
def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_scalar(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def dump(doc: dict[str, Any], prefix: str = "") -> str:
    lines = [f"{json.dumps(k)} = {_scalar(v)}" for k, v in doc.items() if not isinstance(v, dict) or not v]
    for k, v in doc.items():
        if isinstance(v, dict) and v:
            name = f"{prefix}.{json.dumps(k)}" if prefix else json.dumps(k)
            lines.append(f"\n[{name}]")
            lines.append(dump(v, name))
    return "\n".join(lines) + "\n"


def _paths(doc: dict[str, Any], pre: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for k, v in doc.items():
        yield (*pre, k)
        if isinstance(v, dict):
            yield from _paths(v, (*pre, k))


def mutate_doc(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))  # deep copy
    for _ in range(rng.choice([1, 1, 2, 3])):
        paths = list(_paths(doc))
        path = rng.choice(paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        op = rng.random()
        if op < 0.7:
            parent[path[-1]] = _value(rng)
        elif op < 0.85:
            del parent[path[-1]]
        else:
            parent[rng.choice(["bogus", "tp", "numblocks", "port"])] = _value(rng)
    return doc


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    op = rng.randrange(7)
    if op == 0:
        return data.decode().encode("utf-16")
    if op == 1:
        return data.replace(b"\"", "\"\u00e9".encode("latin-1"), 1)
    if op == 2:
        i = rng.randrange(len(data))
        return data[:i] + bytes([rng.randrange(256)]) + data[i + 1:]
    if op == 3:
        return data[: rng.randrange(len(data))]
    if op == 4:
        i = rng.randrange(len(data))
        return data[:i] + b"\x00\xff\xfe" + data[i:]
    if op == 5:
        return b"a = " + b"[" * rng.choice([50, 5000, 200000]) + b"\n"
    return data + b"\n[prefill]\nnum_blocks = 1\n"  # a duplicated table


# ---- case generation -----------------------------------------------------------------------------------------
def file_cases(tmp: Path, n: int) -> list[Case]:
    rng = random.Random(BASE_SEED)
    cases = []
    for i in range(n):
        src = rng.choice(BUNDLED)
        f = tmp / f"m{i}.toml"
        if rng.random() < 0.75:
            f.write_text(dump(mutate_doc(tomllib.loads(src.read_text()), rng)), encoding="utf-8")
        else:
            f.write_bytes(mutate_bytes(src.read_bytes(), rng))
        cases.append(Case(f"file{i}", ["handshake", str(f), "--no-transfer"]))
    special = tmp / "special"
    special.mkdir()
    fifo = special / "fifo.toml"
    os.mkfifo(fifo)
    big = special / "big.toml"
    big.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    empty = special / "empty.toml"
    empty.write_bytes(b"")
    link = special / "zero.toml"
    link.symlink_to("/dev/zero")
    for p in (fifo, big, empty, link, Path("/dev/zero"), special, special / "missing.toml"):
        cases.append(Case(f"special-{p.name}", ["handshake", str(p)]))
    return cases


HANDSHAKE_FLAGS = ["--prefill-tp", "--decode-tp", "--prefill-blocks", "--decode-blocks", "--block-size",
                   "--layers", "--kv-heads", "--head-dim", "--dtype", "--kv-cache-layout", "--attn-backend",
                   "--host", "--prefill-base-port", "--prefill-engine-id", "--vllm", "--device", "--hang-timeout",
                   "--timeout", "--max-tp", "--inject", "--prefill-layers", "--decode-head-dim"]
BASE = ["handshake", "--prefill-blocks", "64", "--decode-blocks", "64", "--no-transfer"]


def flag_cases(n: int) -> list[Case]:
    rng = random.Random(BASE_SEED + 1)
    cases = []
    for i in range(n):
        argv = list(BASE)
        for _ in range(rng.choice([1, 1, 2])):
            argv += [rng.choice(HANDSHAKE_FLAGS), rng.choice(FLAG_VALUES)]
        if rng.random() < 0.08:
            argv.insert(rng.randrange(1, len(argv) + 1), rng.choice(["--nope", "extra", "-x", "--json=3"]))
        cases.append(Case(f"flags{i}", argv))
    return cases


def smoke_cases(tmp: Path, n: int) -> list[Case]:
    rng = random.Random(BASE_SEED + 2)
    cases = []
    for i in range(n):
        d = tmp / f"smoke{i}"
        d.mkdir()
        src = rng.choice(BUNDLED)
        doc = tomllib.loads(src.read_text())
        if rng.random() < 0.8:
            doc = mutate_doc(doc, rng)
        (d / "a.toml").write_text(dump(doc), encoding="utf-8")
        if rng.random() < 0.2:
            os.mkfifo(d / "b.toml")
        cases.append(Case(f"smoke{i}", ["smoke", str(d), "--no-transfer", "--hang-timeout",
                                        rng.choice(["1", "0", "nan", "-2", "1e9"])]))
    plain = tmp / "plain.toml"
    plain.write_text("x = 1\n")
    cases += [Case("smoke-file", ["smoke", str(plain)]), Case("smoke-empty", ["smoke", str(tmp / "smoke-none")])]
    (tmp / "smoke-none").mkdir()
    return cases


BENCH_FLAGS = ["--tokens", "--block-size", "--layers", "--kv-heads", "--head-dim", "--requests", "--iters",
               "--warmup", "--min-time", "--timeout", "--seed", "--prefill-tp", "--decode-tp", "--run-length",
               "--dtype", "--transport", "--error-mode", "--min-bw", "--max-p99", "--device", "--corrupt-block"]
BENCH_BASE = ["transfer-bench", "--model", "custom", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--tokens",
              "256", "--requests", "4", "--block-size", "16", "--json"]


def bench_cases(n: int) -> list[Case]:
    rng = random.Random(BASE_SEED + 3)
    return [Case(f"bench{i}", [*BENCH_BASE, rng.choice(BENCH_FLAGS), rng.choice(FLAG_VALUES)]) for i in range(n)]


# probe and serve: numbers and forms from the command line (nan, inf, 1e300, bare IPv6, ...); the network and
# the ranks are where they would start.
PROBE_FLAGS = ["--timeout", "--tp-size", "--dp-rank", "--max-tp", "--vllm", "ENDPOINT"]
SERVE_FLAGS = ["--duration", "--port", "--tag-blocks", "--api-port", "--vllm", "--prefill-blocks"]
ENDPOINTS = ["::1", "[::1]", "[::1]:5600", "127.0.0.1:0", "127.0.0.1:65536", ":5600", "[]:1", "[127.0.0.1]:5600",
             "1.2.3.4:٣", "127.0.0.1:+1", "127.0.0.1: 1", "[::1]:99999"]


def probe_serve_cases(n: int) -> list[Case]:
    rng = random.Random(BASE_SEED + 4)
    out = []
    for i in range(n):
        value = rng.choice(FLAG_VALUES + ENDPOINTS)
        if i % 3 == 2:
            flag = rng.choice(SERVE_FLAGS)
            out.append(Case(f"serve{i}", ["serve", "--prefill-blocks", "64", "--vllm", "0.9.1", flag, value]))
            continue
        flag = rng.choice(PROBE_FLAGS)
        endpoint = value if flag == "ENDPOINT" else "127.0.0.1:5600"
        extra = [] if flag == "ENDPOINT" else [flag, value]
        out.append(Case(f"probe{i}", ["probe", endpoint, "--vllm", "0.11.1", "--json", *extra]))
    return out


# ---- the contract ------------------------------------------------------------------------------------------------
def check(case: Case, code: int | None, err: str, started: bool) -> str | None:
    """None if the outcome keeps the contract, else what broke."""
    if "Traceback" in err:
        return "traceback"
    if started:
        return None if code is None else f"exit {code} after starting"
    if code != 2:
        return f"exit {code}, expected 2 (or a start)"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if len(lines) != 1:
        return f"{len(lines)} stderr lines"
    if not lines[0].startswith("pdcheck: error: "):  # one entry point, one prefix, transfer-bench included
        return f"not an error line: {lines[0][:120]}"
    return None


def run_in_process(case: Case, capsys: pytest.CaptureFixture[str]) -> tuple[int | None, str, bool]:
    from pdcheck import cli

    capsys.readouterr()
    try:
        code: int | None = cli.run(case.argv)
        started = False
    except WouldStart:
        code, started = None, True
    except BaseException as exc:  # anything escaping run() is a contract break: make it visible as one
        import traceback

        return 99, "Traceback\n" + "".join(traceback.format_exception(exc)), False
    return code, capsys.readouterr().err, started


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdcheck.bench.command as bench_command
    import pdcheck.vllm.commands as commands
    import pdcheck.vllm.handshake as hs
    import pdcheck.vllm.probe as probe
    import pdcheck.vllm.serve as serve

    def stop(*_a: Any, **_k: Any) -> Any:
        raise WouldStart

    monkeypatch.setattr(hs, "run", stop)
    monkeypatch.setattr(bench_command, "_with_progress", stop)
    monkeypatch.setattr(probe, "run", stop)
    monkeypatch.setattr(commands, "release_from_url", stop)
    monkeypatch.setattr(serve, "run", stop)


def test_fuzz_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ranks: None) -> None:
    cases = [*file_cases(tmp_path, 160), *flag_cases(160), *smoke_cases(tmp_path, 40), *bench_cases(60),
             *probe_serve_cases(90)]
    violations, started = [], 0
    for case in cases:
        code, err, did_start = run_in_process(case, capsys)
        started += did_start
        why = check(case, code, err, did_start)
        if why:
            violations.append(f"{case.name} {case.argv[:6]}: {why}: {err.strip()[-300:]}")
    print(f"fuzz in-process: {len(cases)} cases, {started} would start, {len(violations)} violations")
    assert not violations, "\n".join(violations[:20])
    assert len(cases) >= 400 and 0 < started < len(cases) - 100  # both sides of the contract were exercised


# ---- through the real CLI ------------------------------------------------------------------------------------------
def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if rest[0] != "Z":
                kids.setdefault(int(rest[1]), []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def run_cli(argv: list[str], tmp: Path, timeout: float = 120) -> tuple[int, str, list[int]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)
    seen: set[int] = set()
    while proc.poll() is None:
        seen.update(_descendants(proc.pid))
        try:
            proc.wait(0.05)
        except subprocess.TimeoutExpired:
            pass
    _out, err = proc.communicate(timeout=timeout)
    alive = [p for p in seen if Path(f"/proc/{p}").exists()
             and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    return proc.returncode, err, alive


def test_fuzz_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_ranks: None) -> None:
    """A representative subset, chosen by kind: for every kind the first three bad-input cases, and two valid
    flag sets (which then really run, small and without transfers), go through a fresh interpreter."""
    pool = [*file_cases(tmp_path, 60), *flag_cases(60), *smoke_cases(tmp_path, 12), *bench_cases(20)]
    picked: dict[tuple[str, bool], list[Case]] = {}
    for case in pool:
        kind = "".join(c for c in case.name.split("-")[0] if c.isalpha())
        _code, _err, started = run_in_process(case, capsys)
        small = not any(a in case.argv for a in ("--max-tp", "--prefill-tp", "--decode-tp")) and kind in ("flags",)
        if not started or small:
            got = picked.setdefault((kind, started), [])
            if len(got) < (2 if started else 3):
                got.append(case)
    cases = [c for group in picked.values() for c in group]

    def one(i: int, case: Case) -> str | None:
        tmp = tmp_path / f"cli-{i}"  # each run its own TMPDIR: a left temp dir is that run's
        tmp.mkdir()
        argv = [*case.argv, "--hang-timeout", "0.5"] if case.argv[0] == "handshake" else case.argv
        code, err, alive = run_cli(argv, tmp)
        started = code in (0, 1)
        why = check(case, None if started else code, err, started)
        if alive:
            why = f"left running: {alive}"
        if list(tmp.glob("pymp-*")):
            why = "pymp temp dir left"
        return f"{case.name} {argv[:8]}: {why}: {err.strip()[-300:]}" if why else None

    # Side by side: each case is a fresh interpreter that mostly starts up and waits; the cases are independent.
    with ThreadPoolExecutor(4) as pool_:
        violations = [v for v in pool_.map(one, range(len(cases)), cases) if v]
    print(f"fuzz via CLI: {len(cases)} cases, {len(violations)} violations")
    assert not violations, "\n".join(violations)
    assert len(cases) >= 15
