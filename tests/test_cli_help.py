"""The first screen: --help of every command, --version, shell completion, progress on stderr."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest
import typer
from conftest import ROOT, SCENARIOS

from pdcheck import __version__
from pdcheck.cli import app

COMMANDS = [("handshake",), ("smoke",), ("scenario", "from-logs")]


def _command(path: tuple[str, ...]):
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    return cmd


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_flag_has_help_a_panel_and_no_bare_type_metavar(path: tuple[str, ...]) -> None:
    cmd = _command(path)
    for p in cmd.params:
        if getattr(p, "hidden", False) or p.param_type_name != "option":
            continue
        assert p.help, f"{' '.join(path)} {p.opts}: no help text"
        assert p.rich_help_panel, f"{' '.join(path)} {p.opts}: no help panel"
        assert p.metavar is not None, f"{' '.join(path)} {p.opts}: would show <type>"
    assert cmd.epilog and "Examples" in cmd.epilog


def test_handshake_help_panels_and_examples(pdcheck) -> None:
    run = pdcheck("handshake", "--help")
    assert run.code == 0
    for panel in ("Scenario", "Per-side overrides", "Run", "Output"):
        assert f"─ {panel} " in run.out
    assert "Examples" in run.out and "pdcheck scenario from-logs" in run.out
    assert "<bool>" not in run.out.split("─ Options ")[0] + run.out.split("─ Scenario ")[1]
    assert "<str>" not in run.out and "--from-logs" in run.out


def test_version(pdcheck) -> None:
    run = pdcheck("--version")
    assert run.code == 0 and run.out.strip() == f"pdcheck {__version__}"


def test_shell_completion_completes_commands_and_flags() -> None:
    def complete(words: str) -> list[str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT), _PDCHECK_COMPLETE="complete_bash", COMP_WORDS=words,
                   COMP_CWORD=str(len(words.split()) - 1))
        proc = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'pdcheck'; "
                               "from pdcheck.cli import main; main()"], capture_output=True, text=True, env=env,
                              timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert complete("pdcheck scen") == ["scenario"]
    assert "--prefill-blocks" in complete("pdcheck handshake --prefill-b")


def _handshake_with_tty_stderr(*args: str) -> tuple[int, str, str]:
    """Run handshake with stderr on a pseudo-terminal (as a user's shell) and stdout on a pipe."""
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "pdcheck", "handshake", *args], stdout=subprocess.PIPE,
                            stderr=slave, cwd=ROOT, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO once the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read().decode() if proc.stdout else ""
    code = proc.wait(timeout=120)
    os.close(master)
    return code, out, b"".join(chunks).decode(errors="replace")


def test_progress_on_a_terminal_and_silent_otherwise(pdcheck) -> None:
    seed = str(SCENARIOS / "seed-19338-tp8.toml")
    code, out, err = _handshake_with_tty_stderr(seed, "--vllm", "0.9.2")
    assert code == 0 and "survives" in out
    assert "ranks up" in err and "handshakes + transfer proof" in err
    code, out, err = _handshake_with_tty_stderr(seed, "--vllm", "0.9.2", "--json")
    assert code == 0 and out.startswith("{") and err == ""
    run = pdcheck("handshake", seed, "--vllm", "0.9.2")  # stderr a pipe: nothing
    assert run.code == 0 and run.err == ""
