"""Thin typer CLI. Everything below it raises PdcheckError subclasses; main() maps them to exit codes."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from pdcheck.cliopts import Group
from pdcheck.errors import (
    EXIT_HARNESS,
    EXIT_INTERRUPTED,
    PdcheckError,
    error_line,
    usage_error_types,
    usage_line,
)

EPILOG = """[bold]Examples[/]
  [dim]# have logs? start here, then run what it wrote[/]
  pdcheck scenario from-logs prefill.log decode.log -o mine.toml
  pdcheck handshake mine.toml --vllm all
  [dim]# a bundled scenario by name; one release: the per-rank report[/]
  pdcheck handshake seed-19338-tp8 --vllm 0.9.1
  [dim]# CI: every bundled scenario against its expected outcome[/]
  pdcheck smoke --junit smoke.xml

Exit codes: 0 ok, 1 a hazard fires (or a check fails), 2 bad input,
3 harness failure, 130/143/129 interrupted (SIGINT/SIGTERM/SIGHUP).
Shell completion: pdcheck --install-completion (bash, zsh, fish, PowerShell)."""

# Every command lives in its own module of pdcheck.commands, imported only when that command runs (or --help or
# completion lists it): `handshake` does not pay for probe's, serve's and transfer-bench's imports.
# Name -> module (its register(app) adds the command).
LAZY = {"handshake": "pdcheck.commands.handshake", "smoke": "pdcheck.commands.smoke",
        "probe": "pdcheck.commands.probe", "serve": "pdcheck.commands.serve",
        "transfer-bench": "pdcheck.commands.transfer_bench", "requests": "pdcheck.commands.requests",
        "doctor": "pdcheck.commands.doctor", "report": "pdcheck.commands.report",
        "list": "pdcheck.commands.catalog_list"}
LAZY_SCENARIO = {"from-logs": "pdcheck.commands.fromlogs"}  # `pdcheck scenario ...`
# module -> its click command, or None (transfer-bench not in this tree). A command's release flags and the
# framework names in its help come from the framework registry (its entry points), fixed for the process.
_lazy_loaded: dict[str, Any] = {}


def _lazy_command(name: str, table: dict[str, str] | None = None) -> Any:
    module = (table or LAZY)[name]
    key = module
    if key not in _lazy_loaded:
        import importlib

        try:
            register = importlib.import_module(module).register
        except ImportError:  # transfer-bench not installed in this tree
            _lazy_loaded[key] = None
            return None
        # The module adds its command to a scratch app of the same settings, built into a click command here.
        scratch = typer.Typer(pretty_exceptions_enable=False, rich_markup_mode=app.rich_markup_mode)
        register(scratch)
        _lazy_loaded[key] = typer.main.get_group(scratch).commands.get(name)
    return _lazy_loaded[key]


class _LazyGroup(Group):
    """A group whose commands (LAZY) are listed in their place (before the sub-groups) and imported only when
    one is looked up."""

    lazy: dict[str, str] = LAZY

    def list_commands(self, ctx: Any) -> list[str]:
        names = [n for n, c in self.commands.items() if not isinstance(c, TyperGroup)]
        names += [n for n in self.lazy if n not in names]
        return names + [n for n in self.commands if n not in names]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = self.commands.get(cmd_name)
        if cmd is None and cmd_name in self.lazy:
            cmd = _lazy_command(cmd_name, self.lazy)
        return cmd

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and args[0] not in self.lazy:
            # An unknown name: typer's "Did you mean ..." draws on self.commands, so load the lazy ones.
            for name in self.lazy:
                cmd = _lazy_command(name, self.lazy)
                if cmd is not None:
                    self.commands.setdefault(name, cmd)
        return super().resolve_command(ctx, args)


class _LazyScenarioGroup(_LazyGroup):
    lazy = LAZY_SCENARIO


app = typer.Typer(cls=_LazyGroup, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode="rich",
                  epilog=EPILOG, help="Reproduce and diagnose vLLM NixlConnector P/D handshake and KV-transfer failures.")
scenario_app = typer.Typer(cls=_LazyScenarioGroup, no_args_is_help=True, rich_markup_mode="rich",
                           help="Make scenarios: from-logs reads them out of vLLM start-up logs.")
app.add_typer(scenario_app, name="scenario")

def _console(stderr: bool = False, **kw: Any) -> Any:
    from pdcheck.console import console

    return console(stderr, **kw)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _version(value: bool) -> None:
    if value:
        from pdcheck import __version__

        print(f"pdcheck {__version__}")
        raise typer.Exit(0)
USAGE_ERRORS = usage_error_types()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", metavar="", callback=_version, is_eager=True,
                                 help="Print pdcheck's version and exit.")] = False,
) -> None:
    """Reproduce and diagnose vLLM NixlConnector P/D handshake and KV-transfer failures."""


def run(argv: list[str] | None = None) -> int:
    """The CLI without the process-wide parts of main(): parse, run, map every outcome to an exit code with
    at most one error line on stderr. The fuzz suite drives this in-process."""
    def error(text: str) -> None:
        _console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]pdcheck: error:[/] {_escape(text)}")

    from pdcheck import render
    from pdcheck.console import fit_streams

    fit_streams()  # any stdout encoding: every command's output goes through sys.stdout/stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    render.ARGV.set(tuple(argv))  # the page of --format markdown|html shows the command line that wrote it
    try:
        rc = app(argv, standalone_mode=False)  # typer returns the exit code here instead of raising it
        return rc if isinstance(rc, int) else 0
    except PdcheckError as exc:
        error(error_line(str(exc)))
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except typer.Exit as exc:
        return exc.exit_code
    except USAGE_ERRORS as exc:  # usage errors arrive here with standalone_mode=False
        if type(exc).__name__ == "NoArgsIsHelpError":
            # Bare `pdcheck` / `pdcheck scenario`: asking for nothing gets the help (rich has printed it; plain
            # help is the message), exit 0, as click before 8.2 did. Not an error, so no error line.
            text = exc.format_message()  # type: ignore[attr-defined]
            if text.strip():
                print(text)
            return 0
        error(error_line(usage_line(exc)))
        return exc.exit_code  # type: ignore[attr-defined]
    except typer.Abort:  # EOF on a prompt
        return EXIT_INTERRUPTED
    except Exception:
        from pdcheck import lifecycle

        # The handler's KeyboardInterrupt can land inside C code that reports another error in its place (seen: a
        # TypeError out of an import typer started as the Ctrl-C came): after a signal, that error is the signal.
        if lifecycle.received() is not None:
            return EXIT_INTERRUPTED
        # An exception pdcheck did not expect is a harness failure, never a verdict (exit 1 would read as "a release
        # fails"): one line, and its traceback in the run's log directory, which exit 3 keeps (docs/reliability.md).
        import traceback

        exc = sys.exc_info()[1]
        path = f"{lifecycle.rank_log_dir()}/pdcheck.log"
        try:
            with open(path, "a") as f:
                traceback.print_exc(file=f)
        except OSError:
            path = ""
        kept = "" if not path else " (traceback in the run's log directory)"
        error(error_line(f"internal error, a bug in pdcheck: {type(exc).__name__}: {exc}{kept}"))
        return EXIT_HARNESS


def main() -> None:
    from pdcheck import lifecycle

    lifecycle.install_signal_handlers()
    lifecycle.guard_stdout()
    code = EXIT_HARNESS
    try:
        code = lifecycle.exit_code(run())
    finally:
        kept = lifecycle.shutdown(code)
    if kept is not None:
        print(f"pdcheck: the ranks' logs are kept in {kept}", file=sys.stderr)
    sys.exit(code)
