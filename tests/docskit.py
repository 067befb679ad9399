"""Docs as tests (sybil): every ```console block of README.md and docs/*.md is a transcript that runs.

A block holds steps: `$ pdcheck ARGS` (continued by a trailing backslash; a trailing `&` runs it in the
background until the block ends, as `pdcheck serve ... &`), followed by the output it prints, stdout and
stderr as a terminal shows them. The output is compared line by line with trailing spaces ignored; `...`
inside a line stands for any text, and a line that is only `...` for any number of lines (doctest's
ELLIPSIS, per line). pdcheck's progress lines on a pipe are not output. A step's exit code is 0 or 1 (a
verdict), or the N of an `exit N` in the step's own `#` comment.

Each block runs on its own, in a fresh directory that holds examples/logs/ (so `from-logs prefill.log
decode.log` reads the shipped example logs), with what an HTML comment right before the block asks for:

    <!-- docs-test: stand-in p-node:5600 = serve seed-19338-tp8 --vllm 0.11.1; file my-decode.toml =
         scenarios/seed-19338-tp8.toml -->

- `stand-in HOST:PORT = serve ARGS [; api HOST:PORT]`: a `pdcheck serve ARGS` started first (the project's
  stand-in for a live prefill) whose endpoint replaces HOST:PORT in the commands and back in the output;
  `api HOST:PORT` also serves vLLM's `GET /version` there (`--api-port`).
- `file NAME = PATH`: a copy of the repository's PATH under NAME.
- `not run: REASON`: the block needs what a test machine lacks (a GPU, a cluster, a real vLLM); the reason
  is checked to be there.
Ports a background `pdcheck serve --port N` names are replaced by free ones (tests/portkit.py) and mapped
back in the output, so parallel runs never share one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from portkit import free_run
from sybil import Document, Example, Region
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
LOGS = ROOT / "examples" / "logs"
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(?P<body>(?:(?!-->).)*?)\s*-->\s*\Z", re.S)
PROGRESS = re.compile(r"^pdcheck: \d+ s: ")  # progress.PIPED_EVERY_S lines of a long run on a pipe
STEP_TIMEOUT_S = 600.0
COMMAND_LINE = re.compile(r"^\s*(\$ )?pdcheck( |$)")


@dataclass
class Step:
    command: str  # as written after "$ ", continuation lines joined
    background: bool
    expected: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int | None:
        """The exit code its comment names (`# ... exit 2`), else None: a verdict, 0 or 1."""
        comment = self.command.split(" #", 1)[1] if " #" in self.command else ""
        m = re.search(r"\bexit (\d+)\b", comment)
        return int(m.group(1)) if m else None


@dataclass
class Block:
    steps: list[Step]
    not_run: str | None = None
    stand_ins: list[tuple[str, list[str], str | None]] = field(default_factory=list)  # (HOST:PORT, args, api)
    files: dict[str, str] = field(default_factory=dict)


def parse_directives(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {"stand_ins": [], "files": {}, "not_run": None}
    text, _sep, reason = " ".join(text.split()).partition("not run:")  # the reason runs to the comment's end
    if _sep:
        out["not_run"] = reason.strip()
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        if part.startswith("stand-in "):
            name, _eq, rest = part[len("stand-in "):].partition("=")
            args = shlex.split(rest)
            if not args or args[0] != "serve":
                raise ValueError(f"docs-test: a stand-in is a `serve ...`: {part!r}")
            out["stand_ins"].append([name.strip(), args[1:], None])
        elif part.startswith("api "):
            out["stand_ins"][-1][2] = part[len("api "):].strip()
        elif part.startswith("file "):
            name, _eq, path = part[len("file "):].partition("=")
            out["files"][name.strip()] = path.strip()
        else:
            raise ValueError(f"docs-test: unknown directive {part!r}")
    out["stand_ins"] = [tuple(s) for s in out["stand_ins"]]
    return out


def parse_steps(source: str) -> list[Step]:
    steps: list[Step] = []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            background = bool(re.search(r"\s&\s*(#.*)?$", cmd))
            if background:
                cmd = re.sub(r"\s&\s*(#.*)?$", "", cmd)
            steps.append(Step(cmd, background))
        elif steps:
            steps[-1].expected.append(line)
        elif line.strip() and not line.startswith("#"):  # a shell comment may stand before the first command
            raise ValueError(f"console block: output before the first `$ ` command: {line!r}")
        i += 1
    return steps


class ConsoleParser:
    """Sybil parser: each ```console fence is one Region whose parsed value is its Block."""

    def __init__(self) -> None:
        self.lexer = FencedCodeBlockLexer("console")

    def __call__(self, document: Document) -> Any:
        for lexed in self.lexer(document):
            before = document.text[:lexed.start]
            m = DIRECTIVE.search(before)
            directives = parse_directives(m.group("body")) if m else parse_directives("")
            block = Block(parse_steps(str(lexed.lexemes["source"])), **directives)
            yield Region(lexed.start, lexed.end, block, evaluate)


def documents() -> list[Document]:
    return [Document.parse(str(p), ConsoleParser()) for p in DOCS]


def examples() -> list[Example]:
    return [ex for doc in documents() for ex in doc.examples()]


# ---- running a block ----------------------------------------------------------------------------------------
def pattern(expected: list[str]) -> re.Pattern[str]:
    """The expected lines as one regular expression: `...` any text within a line, a line of `...` any lines."""
    parts = []
    for line in expected:
        line = line.rstrip()
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(p) for p in line.split("...")) + r"\n")
    return re.compile("".join(parts))


def normalise(text: str, mapping: dict[str, str]) -> str:
    for real, shown in mapping.items():
        text = text.replace(real, shown)
    lines = [ln.rstrip() for ln in text.splitlines() if not PROGRESS.match(ln)]
    while lines and not lines[-1]:
        lines.pop()
    return "".join(f"{ln}\n" for ln in lines)


def _env() -> dict[str, str]:
    # unbuffered: stdout and stderr interleave in the order they are written, as on a terminal
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")


def _argv(command: str, subs: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    for shown, real in subs.items():
        command = command.replace(shown, real)
    argv = shlex.split(command, comments=True)
    env_prefix = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        k, _eq, v = argv.pop(0).partition("=")
        env_prefix[k] = v
    if not argv or argv[0] != "pdcheck":
        raise AssertionError(f"a console example runs pdcheck, not {command!r}: mark the block `not run: ...`")
    return [sys.executable, "-m", "pdcheck", *argv[1:]], env_prefix


def _wait_listening(host: str, port: int, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the background step exited {proc.returncode} before it listened on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listened on {host}:{port} within {timeout_s} s")


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def run_block(block: Block, where: str) -> None:
    import pytest

    if block.not_run is not None:
        pytest.skip(f"not run: {block.not_run}")
    cwd = Path(tempfile.mkdtemp(prefix="pdcheck-docs-"))
    background: list[subprocess.Popen[Any]] = []
    subs: dict[str, str] = {}  # as the doc shows it -> as this run has it (commands)
    back: dict[str, str] = {}  # as this run has it -> as the doc shows it (output)
    try:
        if LOGS.is_dir():
            shutil.copytree(LOGS, cwd, dirs_exist_ok=True)
        for name, path in block.files.items():
            (cwd / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / path, cwd / name)
        for shown, args, api in block.stand_ins:
            extra = []
            if api is not None:
                port = free_run(1)
                extra = ["--api-port", str(port)]
                subs[api] = f"127.0.0.1:{port}"
                back[f"127.0.0.1:{port}"], back[str(port)] = api, api.rsplit(":", 1)[1]
            proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "serve", *args, *extra, "--json"], cwd=cwd,
                                    env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            background.append(proc)
            import json

            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, f"{where}: the stand-in `pdcheck serve {' '.join(args)}` printed no ready line"
            doc = json.loads(line)
            if "bootstrap_url" in doc:  # an SGLang prefill: its bootstrap server
                real = doc["bootstrap_url"].split("://", 1)[1]
            else:
                real = f"{doc['host']}:{doc['base_port']}"
            subs[shown] = real
            back[real], back[real.rsplit(":", 1)[1]] = shown, shown.rsplit(":", 1)[1]
        for step in block.steps:
            argv, env_prefix = _argv(step.command, subs)
            if step.background:
                if "--port" in argv:
                    i = argv.index("--port")
                    n = int(argv[i + 1])
                    real = free_run(8)
                    subs[f":{n}"] = f":{real}"
                    back[str(real)] = str(n)
                    argv[i + 1] = str(real)
                    proc = subprocess.Popen(argv, cwd=cwd, env={**_env(), **env_prefix}, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                    background.append(proc)
                    _wait_listening("127.0.0.1", real, proc, STEP_TIMEOUT_S)
                    time.sleep(0.5)  # every rank's listener, not only the first
                else:
                    background.append(subprocess.Popen(argv, cwd=cwd, env={**_env(), **env_prefix}))
                continue
            if ">" in argv:  # `pdcheck ... --json > run.json`: stdout to the file, the terminal shows stderr
                i = argv.index(">")
                with open(cwd / argv[i + 1], "w") as out:
                    proc = subprocess.run(argv[:i] + argv[i + 2:], cwd=cwd, env={**_env(), **env_prefix}, stdout=out,
                                          stderr=subprocess.PIPE, text=True, timeout=STEP_TIMEOUT_S)
                proc.stdout = proc.stderr
            else:
                proc = subprocess.run(argv, cwd=cwd, env={**_env(), **env_prefix}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=STEP_TIMEOUT_S)
            got = normalise(proc.stdout, back)
            want = list(step.expected)
            while want and not want[-1].strip():
                want.pop()
            codes = (0, 1) if step.exit_code is None else (step.exit_code,)
            assert proc.returncode in codes, (f"{where}: `{step.command}` exited {proc.returncode} (expected "
                                              f"{' or '.join(map(str, codes))}):\n{got}")
            if not pattern(want).fullmatch(got):
                raise AssertionError(f"{where}: `{step.command}` printed what the doc does not show.\n--- doc ---\n"
                                     + "\n".join(want) + "\n--- printed ---\n" + got)
    finally:
        for proc in reversed(background):
            _stop(proc)
        shutil.rmtree(cwd, ignore_errors=True)


def evaluate(example: Example) -> None:
    run_block(example.parsed, f"{Path(example.path).relative_to(ROOT)}:{example.line}")
