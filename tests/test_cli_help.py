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
        cmd = cmd.get_command(None, name)  # type: ignore[attr-defined]  (commands load lazily)
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


@pytest.mark.parametrize("path", [(), ("handshake",), ("smoke",), ("probe",), ("serve",), ("transfer-bench",), ("requests",),
                                  ("scenario",), ("scenario", "from-logs")], ids=lambda p: " ".join(p) or "pdcheck")
def test_no_help_shows_a_type_label_for_an_option(pdcheck, path: tuple[str, ...]) -> None:
    """On/off flags (--help and the completion flags included) take no value: no `<bool>` column; every other
    option names its value (N, SECONDS, ...), not `<int>`/`<str>`/`<float>`."""
    run = pdcheck(*path, "--help")
    assert run.code == 0, run.err
    options = "\n".join(ln for ln in run.out.splitlines() if ln.lstrip("│ ").startswith("-"))
    for label in ("<bool>", "<int>", "<str>", "<float>"):
        assert label not in options, f"{' '.join(path)} --help shows {label}:\n{options}"


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


@pytest.mark.parametrize("args", [(), ("scenario",)], ids=["pdcheck", "pdcheck scenario"])
def test_a_bare_command_prints_its_help_and_exits_0(pdcheck, args: tuple[str, ...]) -> None:
    run = pdcheck(*args)
    assert run.code == 0, run.err
    assert "Usage:" in run.out and "Commands" in run.out
    assert run.err == ""  # help is not an error: no "pdcheck: error:" line, empty or not


def _params_with_brackets() -> list[tuple[str, str, str]]:
    """(command, option, help) for every help text with a [...] in it, lazy commands included."""
    from pdcheck.cli import LAZY, _lazy_command

    out = []
    root = typer.main.get_command(app)
    cmds = {**{n: c for n, c in root.commands.items() if n != "scenario"},  # type: ignore[attr-defined]
            **{n: _lazy_command(n) for n in LAZY},  # every command loads lazily
            "scenario from-logs": _command(("scenario", "from-logs"))}
    for name, cmd in cmds.items():
        for p in getattr(cmd, "params", []):
            if "[" in (getattr(p, "help", None) or "") and not getattr(p, "hidden", False):
                out.append((name, p.opts[0], p.help))
    return out


def test_help_shows_every_bracket_its_source_has() -> None:
    """rich markup would eat `pdcheck[ray]` or `[decode]`: every such help text is escaped."""
    import re

    found = _params_with_brackets()
    assert any("pdcheck\\[ray]" in h for _c, _o, h in found)  # the one that was eaten
    shown: dict[str, str] = {}
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="2000")
    for name, opt, text in found:
        if name not in shown:
            shown[name] = subprocess.run([sys.executable, "-m", "pdcheck", *name.split(), "--help"],
                                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=60).stdout
        for group in re.findall(r"\[[^\]]*\]", text.replace("\\[", "[")):
            assert group in shown[name], f"{name} {opt}: help shows no {group!r}"


def test_piped_report_is_not_wrapped_and_native_nixl_lines_stay_in_the_rank_logs(pdcheck) -> None:
    """Every release on hetero-p4-d2: some releases' READs fail inside NIXL, whose C++ logger writes an E-line.
    That line goes to the rank's log; the report says so, in one line per message; stderr stays empty."""
    run = pdcheck("handshake", "hetero-p4-d2", "--vllm", "all")
    assert run.code == 1, run.err
    assert run.err == ""
    fails = [ln for ln in run.out.splitlines() if ln.startswith("fails: ")]
    assert len(fails) == 1 and "0.9.0" in fails[0] and "0.34.0" in fails[0]  # one line, not cut at 80 columns
    note = run.out.split("NIXL's own error lines", 1)[1].splitlines()
    assert "--log-dir DIR keeps them" in note[0]
    assert any(ln.startswith("  D0") and "prepXferDlist" in ln and "nixl_agent.cpp" in ln for ln in note)


def test_log_dir_keeps_each_rank_log(pdcheck, tmp_path) -> None:
    logs = tmp_path / "logs"
    run = pdcheck("handshake", "attn-backend-mismatch", "--vllm", "0.9.1", "--log-dir", str(logs))
    assert run.code == 1, run.err
    assert sorted(p.name for p in logs.iterdir()) == ["D0.log", "D1.log", "P0.log", "P1.log"]
    assert "makeXferReq" in (logs / "D0.log").read_text() and "makeXferReq" not in run.err
    assert f"in {logs}" in run.out


def _empty_logs(tmp_path) -> tuple[str, str]:
    p, d = tmp_path / "p.log", tmp_path / "d.log"
    p.write_text("INFO nothing here\n")
    d.write_text("INFO nothing here either\n")
    return str(p), str(d)


def test_from_logs_names_every_missing_flag_at_once(pdcheck, tmp_path) -> None:
    p, d = _empty_logs(tmp_path)
    run = pdcheck("scenario", "from-logs", p, d)
    assert run.code == 2 and len(run.err.strip().splitlines()) == 1, run.err
    assert "--prefill-blocks N --prefill-tp N --decode-blocks N --decode-tp N" in run.err
    # what it names is enough: a per-rank list and its TP size, both sides
    run = pdcheck("scenario", "from-logs", p, d, "--prefill-blocks", "64,70", "--prefill-tp", "2",
                  "--decode-blocks", "60", "--decode-tp", "2")
    assert run.code == 0, run.err


def test_from_logs_output_refuses_an_existing_file_unless_forced(pdcheck, tmp_path) -> None:
    p, d = _empty_logs(tmp_path)
    flags = ["--prefill-blocks", "64", "--decode-blocks", "64"]
    deep = tmp_path / ("a-rather-long-directory-name-" * 3) / "mine.toml"
    deep.parent.mkdir()
    deep.write_text("# mine\n")
    run = pdcheck("scenario", "from-logs", p, d, *flags, "-o", str(deep))
    assert run.code == 2 and len(run.err.strip().splitlines()) == 1 and "--force" in run.err, run.err
    assert deep.read_text() == "# mine\n"
    run = pdcheck("scenario", "from-logs", p, d, *flags, "-o", str(deep), "--force")
    assert run.code == 0, run.err
    assert "[prefill]" in deep.read_text()
    # the command to run it next is one line, the path whole
    assert f"run it with: pdcheck handshake {deep}\n" in run.err


ALL_COMMANDS = [("handshake",), ("smoke",), ("probe",), ("serve",), ("transfer-bench",), ("requests",),
                ("scenario", "from-logs")]


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=" ".join)
def test_every_epilog_has_its_own_examples_within_80_columns_and_the_exit_codes(path: tuple[str, ...]) -> None:
    import re

    epilog = _command(path).epilog
    plain = re.sub(r"\[/?(bold|dim)?\]", "", epilog).replace("\\[", "[")
    too_long = [ln for ln in plain.splitlines() if len(ln) > 80]
    assert not too_long, f"{' '.join(path)}: lines over 80 columns: {too_long}"
    examples = [ln.strip() for ln in plain.split("Examples", 1)[1].splitlines() if ln.strip().startswith("pdcheck ")]
    assert any(ex.startswith(f"pdcheck {' '.join(path)}") for ex in examples), examples  # its own, not another's
    flat = " ".join(plain.split())
    assert "130/143/129" in flat and "2 bad input" in flat
    assert ("0 written" if path == ("scenario", "from-logs") else "3 harness failure") in flat


def test_one_spelling_of_the_scenario_argument_and_flags() -> None:
    for path in [("handshake",), ("serve",), ("requests",)]:
        arg = next(p for p in _command(path).params if p.param_type_name == "argument")
        assert arg.metavar == "SCENARIO", path
    assert next(p for p in _command(("smoke",)).params if p.param_type_name == "argument").metavar == "DIRECTORY"
    assert next(p for p in _command(("probe",)).params if p.param_type_name == "argument").metavar == "HOST:PORT"
    hang = {path: next(p.default for p in _command(path).params if p.name == "hang_timeout")
            for path in [("handshake",), ("smoke",)]}
    assert set(hang.values()) == {3.0}, hang
    for path in [("handshake",), ("transfer-bench",)]:
        opts = {o for p in _command(path).params if not getattr(p, "hidden", False) for o in p.opts}
        assert "--use-mla" in opts and "--dtype" in opts and "--mla" not in opts, path
    probe_tp = {o for p in _command(("probe",)).params if not getattr(p, "hidden", False) for o in p.opts
                if "tp" in o}
    assert "--tp-size" not in probe_tp and "--prefill-tp" in probe_tp, probe_tp  # one P TP flag
