"""Hostile inputs on the surfaces added last: `pdcheck report`'s documents, output paths, stdout encodings,
COLUMNS, `list`, transfer-bench's memory, empty values, long words in error lines (docs/reliability.md).

Every case runs the real CLI in its own session (tests/test_hostile.py's `run`: the child's peak RSS from
wait4, its wall time, what is left in its session) and holds it to the contract: exit 2 (or the run's own code)
with one `pdcheck: error:` line, within its time and 1 GiB, nothing left running, nothing left on disk.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_hostile import ENV, contract, run

from pdcheck import bounds
from pdcheck.errors import BadInput

GiB_MB = 1024
ENVELOPE = {"tool": "pdcheck", "version": "0.1.0", "schema": "pdcheck/1", "command": "handshake",
            "framework": "vllm", "exit_code": 1}
SEED = Path(__file__).resolve().parent / "data" / "seed-19338-workers.log"


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, emptied at the end (pytest keeps the last runs' directories: a 64 MiB document would stay)."""
    yield tmp_path
    for p in sorted(tmp_path.rglob("*"), key=lambda x: len(x.parts), reverse=True):
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink()


def _doc(extra: bytes) -> bytes:
    return json.dumps(ENVELOPE)[:-1].encode() + b", " + extra + b"}"


# ------------------------------------------------------------------------------------------- pdcheck report
REPORTS = {
    "nested-500": (_doc(b'"x": ' + b"[" * 500 + b"]" * 500), "nested 501 levels deep"),
    "nested-100000": (_doc(b'"x": ' + b"[" * 100_000 + b"]" * 100_000), "nested 100001 levels deep"),
    "fails-5": (json.dumps({**ENVELOPE, "fail_spans": [{"fails": 5}]}).encode(), "$.fail_spans[0].fails"),
    "failures-true": (json.dumps({**ENVELOPE, "floors": {"failures": True}}).encode(), "$.floors.failures"),
    "null-verdict": (json.dumps({**ENVELOPE, "verdicts": [{"release": "0.9.1", "rank": "D0", "status": "ok"},
                                                          None]}).encode(), "$.verdicts[1]"),
    "objects-in-strings": (_doc(b'"x": "' + b"[{" * 2000 + b'", "y": [' + b'"[",' * 10 + b'"]"]'), None),
}


@pytest.mark.parametrize("name", list(REPORTS))
def test_report_refuses_a_hostile_document_in_one_line(scratch: Path, name: str) -> None:
    data, says = REPORTS[name]
    f = scratch / f"{name}.json"
    f.write_bytes(data)
    for fmt in ("markdown", "html"):
        r = run("report", str(f), "--format", fmt)
        if says is None:  # brackets inside strings are text: the document renders
            contract(r, 0, within_s=30, rss_mb=GiB_MB)
        else:
            contract(r, 2, within_s=30, rss_mb=GiB_MB, says=says)


def test_report_of_64_mib_of_empty_lists_is_refused_before_decoding(scratch: Path) -> None:
    """Under the 64 MiB cap, 22 million `[]` would decode to 3 GiB of lists: the shape is measured first."""
    f = scratch / "lists.json"
    with open(f, "wb") as out:
        out.write(json.dumps(ENVELOPE)[:-1].encode() + b', "x": [')
        n = ((bounds.MAX_DOC_BYTES - 200) // 3) - 1
        chunk = b"[]," * (1 << 20)
        for _ in range(n >> 20):
            out.write(chunk)
        out.write(b"[]," * (n & ((1 << 20) - 1)) + b"[]]}")
    assert bounds.MAX_DOC_BYTES - 1000 < f.stat().st_size <= bounds.MAX_DOC_BYTES
    r = run("report", str(f))
    contract(r, 2, within_s=60, rss_mb=GiB_MB, says=f"more than {bounds.MAX_DOC_VALUES} values")
    print(f"64 MiB of []: {r.wall_s:.2f} s, peak RSS {r.peak_rss_mb:.0f} MB")


def test_report_of_the_largest_document_allowed_renders_within_1_gib(scratch: Path) -> None:
    """Just under MAX_DOC_VALUES, in the shape that costs the decoder most (an object of small keys)."""
    f = scratch / "wide.json"
    n = bounds.MAX_DOC_VALUES - 1000
    f.write_bytes(_doc(b'"x": {' + b",".join(b'"k%d": %d' % (i, i) for i in range(n)) + b"}"))
    for fmt in ("markdown", "html"):
        r = run("report", str(f), "--format", fmt, limit_s=120)
        contract(r, 0, within_s=120, rss_mb=GiB_MB)
        assert f"{n - 100} more keys in the --json document" in r.out
        print(f"{n} keys, {fmt}: {r.wall_s:.2f} s, peak RSS {r.peak_rss_mb:.0f} MB")


# --------------------------------------------------------------------------------------------- output paths
def _page_commands(out: Path, tmp: Path) -> dict[str, tuple[str, ...]]:
    """Every kind of output path, each on a command that stops early when the path is refused."""
    doc = tmp / "doc.json"
    doc.write_text(json.dumps({**ENVELOPE, "command": "list", "framework": None, "exit_code": 0}))
    return {"--output": ("list", "--format", "markdown", "--output", str(out)),
            "report --output": ("report", str(doc), "--output", str(out)),
            "--junit": ("smoke", str(tmp / "nothing"), "--junit", str(out)),
            "-o": ("scenario", "from-logs", str(SEED), str(SEED), "-o", str(out)),
            "--plot": ("transfer-bench", "--plot", str(out) + ".png")}


@pytest.mark.parametrize("flag", ["--output", "report --output", "--junit", "-o", "--plot"])
def test_a_fifo_is_refused_before_anything_blocks(scratch: Path, flag: str) -> None:
    out = scratch / "out.fifo"
    cmd = _page_commands(out, scratch)[flag]
    os.mkfifo(out if flag != "--plot" else Path(str(out) + ".png"))
    r = run(*cmd, limit_s=30)
    contract(r, 2, within_s=20, rss_mb=GiB_MB)
    assert ("not a regular file" in r.err) or (flag == "-o" and "exists" in r.err), r.err
    if flag == "-o":  # from-logs: --force replaces a file, never a FIFO
        contract(run(*cmd, "--force", limit_s=30), 2, within_s=20, says="not a regular file")


@pytest.mark.parametrize("flag", ["--output", "report --output", "--junit", "-o", "--plot"])
def test_a_symlink_is_refused_unless_forced(scratch: Path, flag: str) -> None:
    out = scratch / "link"
    cmd = _page_commands(out, scratch)[flag]
    link = out if flag != "--plot" else Path(str(out) + ".png")
    target, missing = scratch / "target", scratch / "dangling-target"
    target.write_text("keep me")
    link.symlink_to(target)
    r = run(*cmd)
    contract(r, 2, within_s=20, says="exists" if flag == "-o" else "symbolic link")  # from-logs: --force to replace
    assert target.read_text() == "keep me"
    link.unlink()
    link.symlink_to(missing)  # dangling: never created
    contract(run(*cmd), 2, within_s=20)
    assert not missing.exists()


def test_force_writes_through_a_symlink(scratch: Path) -> None:
    out, target = scratch / "page.md", scratch / "target.md"
    target.write_text("old")
    out.symlink_to(target)
    r = run("list", "--format", "markdown", "--output", str(out), "--force")
    contract(r, 0, within_s=30)
    assert target.read_text().startswith("## pdcheck list") and out.is_symlink()


@pytest.mark.parametrize("where", ["/proc/x.md", "/nonexistent-dir/x.md", "/etc/passwd/x.md", "/dev/null"])
def test_an_unwritable_place_is_refused(where: str) -> None:
    contract(run("list", "--format", "markdown", "--output", where), 2, within_s=20, says="--output")
    contract(run("report", "nothing.json", "--output", where), 2, within_s=20, says="--output")


def test_the_write_itself_neither_follows_a_new_link_nor_blocks_on_a_fifo(scratch: Path) -> None:
    """open_out: what appeared between the check and the write (O_NOFOLLOW, O_NONBLOCK, fstat)."""
    target, link, fifo = scratch / "t", scratch / "l", scratch / "f"
    target.write_text("keep")
    link.symlink_to(target)
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="symbolic link"):
        bounds.write_out("--output", link, b"x")
    with pytest.raises(BadInput, match="--output"):
        bounds.write_out("--output", fifo, b"x")  # no reader: ENXIO at once
    assert target.read_text() == "keep" and stat.S_ISFIFO(fifo.stat().st_mode)
    bounds.write_out("--output", link, b"forced", force=True)
    assert target.read_bytes() == b"forced"


# ----------------------------------------------------------------------------------------------- encodings
ENCODINGS = {"C": {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""},
             "latin-1": {"PYTHONIOENCODING": "latin-1"}, "ascii-strict": {"PYTHONIOENCODING": "ascii:strict"}}


@pytest.mark.parametrize("enc", list(ENCODINGS))
@pytest.mark.parametrize("args", [("list",), ("list", "releases"), ("report", "DOC"),
                                  ("report", "DOC", "--format", "html"), ("list", "sc\u00e9narios"),
                                  ("list", "--format", "markdown")])
def test_every_command_prints_under_any_encoding(scratch: Path, enc: str, args: tuple[str, ...]) -> None:
    doc = scratch / "doc.json"
    doc.write_text(json.dumps({**ENVELOPE, "summary": "fails: 0.9.1 · fixed in 0.9.2 — ünïcode…",
                               "verdicts": [{"release": "0.9.1", "rank": "D0", "status": "ok", "detail": "→ ×"}]},
                              ensure_ascii=False), encoding="utf-8")
    env = {k: v for k, v in {**ENV, **ENCODINGS[enc]}.items() if v != ""}
    r = run(*[str(doc) if a == "DOC" else a for a in args], env=env)
    contract(r, 2 if "sc\u00e9narios" in args else 0, within_s=30)
    assert r.out.strip() or r.code == 2


# ------------------------------------------------------------------------------------------------- COLUMNS
@pytest.mark.parametrize("columns", ["0", "-1", "abc", "1", "5", ""])
def test_columns_of_any_value_still_prints_the_list(columns: str) -> None:
    r = run("list", "releases", env={**ENV, "COLUMNS": columns})
    contract(r, 0, within_s=30)
    assert "0.9.1" in r.out and "0.5.23" in r.out
    assert max(len(x) for x in r.out.splitlines()) >= 40  # never one letter per line


# ----------------------------------------------------------------------------------------------------- list
def test_list_shows_whole_first_sentences() -> None:
    r = run("list", "scenarios", "--json")
    contract(r, 0, within_s=30)
    entries = {s["name"]: s["description"] for s in json.loads(r.out)["scenarios"]}
    assert entries["layout-mismatch"].startswith("P's KV cache is NHD (tokens before heads; e.g. "
                                                 "VLLM_KV_CACHE_LAYOUT=NHD), D's is HND")
    assert not [n for n, d in entries.items() if d.endswith(("e.g", "i.e", "…", "(", ":")) or d.count("(") != d.count(")")]
    narrow = run("list", "scenarios", env={**ENV, "COLUMNS": "80"})
    contract(narrow, 0, within_s=30)
    words = " ".join(narrow.out.split())
    assert "contiguous half of every P block as \"its two heads\"" in words  # wrapped, not cut


# ---------------------------------------------------------------------------------------------- error lines
def test_a_100_kb_word_is_cut_in_the_error_line() -> None:
    r = run("list", "x" * 100_000)
    contract(r, 2, within_s=30, says="x… (10000")  # the word as echoed ('x...':), cut after 200 characters
    assert len(r.err) < 2200 and "name scenarios or releases" in r.err


def test_control_characters_in_an_echoed_value_are_visible() -> None:
    r = run("list", "\x1b[31mred\x07\rscenarios")
    contract(r, 2, within_s=30, says="\\x1b[31mred\\x07\\rscenarios")
    assert "\x1b" not in r.err and "\r" not in r.err


# ----------------------------------------------------------------------------------- transfer-bench, empties
def test_transfer_bench_memory_is_computed_before_allocating() -> None:
    r = run("transfer-bench", "--tokens", "4194304", "--requests", "4096")
    contract(r, 2, within_s=30, rss_mb=300, says="--tokens 4194304 --requests 4096")
    assert "of host memory" in r.err and "TiB" in r.err


@pytest.mark.parametrize("args", [
    ("transfer-bench", "--model="), ("transfer-bench", "--error-mode="), ("transfer-bench", "--model", " "),
    ("report", ""), ("list", "--format", "markdown", "--output="), ("smoke", "-k", ""),
    ("scenario", "from-logs", str(SEED), str(SEED), "-o", ""), ("handshake", "--vllm="),
    ("probe", "127.0.0.1:1", "--vllm", "0.9.1", "--scenario", ""),
])
def test_empty_values_are_refused_naming_the_flag(args: tuple[str, ...]) -> None:
    r = run(*args)
    contract(r, 2, within_s=30, says="an empty value")
