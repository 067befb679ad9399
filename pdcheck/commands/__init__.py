"""The command layer: one module per command, each a thin typer function (flags -> framework, picked through
pdcheck.frameworks -> plan -> run -> table or --json -> exit code). pdcheck.cli assembles them into the app and
imports a command's module only when that command runs (or help lists it)."""

from __future__ import annotations

from typing import Any

import typer

Opt = typer.Option
RUN = "Run"
OUTPUT = "Output"
SCENARIO = "Scenario"

# Every command's epilog ends with its exit codes; the signal codes are the same everywhere (pdcheck.lifecycle).
SIGNALS = "130/143/129 interrupted (SIGINT/SIGTERM/SIGHUP)."


def exit_codes(ok: str, fail: str) -> str:
    """The epilog's exit-code paragraph, lines within 80 columns."""
    import textwrap

    return textwrap.fill(f"Exit codes: 0 {ok}, 1 {fail}, 2 bad input, 3 harness failure, {SIGNALS}", 80,
                         break_on_hyphens=False, break_long_words=False)


def console(stderr: bool = False, **kw: Any) -> Any:
    from pdcheck.console import console as make

    return make(stderr, **kw)


def emit(command: str, framework: str | None, outcome: Any, json_out: bool) -> None:
    """Print a command's outcome (pdcheck.frameworks.Outcome): one --json document through the envelope, or
    its tables; then end with its exit code."""
    if json_out:
        from pdcheck.envelope import write_json

        write_json(command, framework, outcome.exit_code, outcome.body)
    else:
        outcome.render(console())
    raise typer.Exit(outcome.exit_code)
