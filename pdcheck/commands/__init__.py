"""The command layer: one module per command, each a thin typer function (flags -> framework, picked through
pdcheck.frameworks -> plan -> run -> table or --json -> exit code). pdcheck.cli assembles them into the app and
imports a command's module only when that command runs (or help lists it)."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

Opt = typer.Option
RUN = "Run"
OUTPUT = "Output"
SCENARIO = "Scenario"

# Every command's epilog ends with its exit codes; the signal codes are the same everywhere (pdcheck.lifecycle).
SIGNALS = "130/143/129 interrupted (SIGINT/SIGTERM/SIGHUP)."
HARNESS_LINES = 5  # --json: the first harness errors, repeated on stderr


def exit_codes(ok: str, fail: str) -> str:
    """The epilog's exit-code paragraph, lines within 80 columns."""
    import textwrap

    return textwrap.fill(f"Exit codes: 0 {ok}, 1 {fail}, 2 bad input, 3 harness failure, {SIGNALS}", 80,
                         break_on_hyphens=False, break_long_words=False)


def console(stderr: bool = False, **kw: Any) -> Any:
    from pdcheck.console import console as make

    return make(stderr, **kw)


def emit(command: str, framework: str | None, outcome: Any, json_out: bool) -> None:
    """Print a command's outcome (pdcheck.seam.Outcome): one --json document through the envelope (or the
    --format page of that document), or its tables; then end with its exit code."""
    if json_out:
        from pdcheck.envelope import write

        write(command, framework, outcome.exit_code, outcome.body)
        # stdout is the document; a CI log that keeps only stderr still says why the run is exit 3
        from pdcheck.errors import error_line

        for text in (getattr(outcome.body, "harness_errors", None) or [])[:HARNESS_LINES]:
            print(f"pdcheck: harness error: {error_line(text)}", file=sys.stderr)
    else:
        outcome.render(console())
    raise typer.Exit(outcome.exit_code)


def framework_flags(ctx: typer.Context, own: Iterable[str]) -> list[tuple[str, str]]:
    """The flags of the running command (its typer context) given on the command line or from the environment,
    other than the command's own (`own`: parameter names every framework takes, e.g. --json) and the release
    flags: (parameter name, the flag as spelled), for pdcheck.frameworks.check_flags."""
    from pdcheck import frameworks

    skip = {*own, *frameworks.names(), "format_", "output"}
    given = ("COMMANDLINE", "ENVIRONMENT")

    def spelled(p: Any) -> str:  # --no-transfer where that is what was given
        off = p.secondary_opts and ctx.params.get(p.name) is False
        return max(p.secondary_opts if off else p.opts, key=len)

    return [(p.name, spelled(p)) for p in ctx.command.params
            if p.param_type_name == "option" and p.name not in skip
            and getattr(ctx.get_parameter_source(p.name), "name", None) in given]


F = TypeVar("F", bound=Callable[..., Any])


def output_flags(func: F) -> F:
    """Decorator: --format json|markdown|html, and --output FILE for the page unless the command has an --output
    of its own (from-logs' scenario file; its page goes to stdout). Any --format is machine output: the command
    runs as with --json (no progress, no tables) and its document is written in that format (pdcheck.render,
    through pdcheck.envelope.write). And --force, unless the command has its own (from-logs'): every output file
    of the command (--output, --junit, --plot) may then be a symbolic link, written through
    (pdcheck.bounds.check_out_file, the one check of every output path). Every flag is checked before the
    command runs."""
    sig = inspect.signature(func, eval_str=True)
    params = list(sig.parameters.values())
    names = [p.name for p in params]
    if "json_out" not in names:
        raise TypeError(f"{func.__qualname__}: @output_flags needs a `json_out` parameter")
    page_file = "output" not in names
    kind = inspect.Parameter.KEYWORD_ONLY
    added = [inspect.Parameter("format_", kind, default=None, annotation=Annotated[str | None, Opt(
        "--format", metavar="json|markdown|html", rich_help_panel=OUTPUT, show_default=False,
        help="json: as --json; markdown or html: the same document as a page to paste into an issue (a "
             "summary line, the tables, versions and environment collapsed, the command to reproduce).")])]
    if page_file:
        added.append(inspect.Parameter("output", kind, default=None, annotation=Annotated[Path | None, Opt(
            "--output", metavar="FILE", rich_help_panel=OUTPUT, show_default=False,
            help="With --format markdown|html: write the page here instead of stdout.")]))
    own_force = "force" in names
    if not own_force:
        added.append(inspect.Parameter("force", kind, default=False, annotation=Annotated[bool, Opt(
            "--force", metavar="", rich_help_panel=OUTPUT,
            help="Let an output file (--output, --junit, --plot) be a symbolic link, written through.")]))
    new_sig = sig.replace(parameters=[*params, *added])

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from pdcheck import bounds, render
        from pdcheck.errors import BadInput

        fmt = kwargs.pop("format_")
        path = kwargs.pop("output") if page_file else None
        force = kwargs["force"] if own_force else kwargs.pop("force")
        if fmt is None:
            if path is not None:
                raise BadInput("--output: only with --format markdown or --format html")
            with bounds.forced_output(force):
                return func(*args, **kwargs)
        if fmt not in render.FORMATS:
            raise BadInput(f"--format: {fmt!r} is not one of {', '.join(render.FORMATS)}")
        if kwargs["json_out"] and fmt != "json":
            raise BadInput(f"--json and --format {fmt}: pick one")
        if path is not None and fmt not in render.PAGES:
            raise BadInput("--output: only with --format markdown or --format html")
        with bounds.forced_output(force):
            bounds.check_out_file("--output", path)
            kwargs["json_out"] = True
            from pdcheck import frameworks

            fws = frameworks.all_frameworks()
            out = render.Output(fmt, path, tuple(fw.distribution for fw in fws if fw.distribution),
                                tuple(p for fw in fws for p in fw.env_prefixes))
            with render.selected(out):
                return func(*args, **kwargs)

    wrapper.__signature__ = new_sig  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in new_sig.parameters.values()
                               if p.annotation is not inspect.Parameter.empty}
    return wrapper  # type: ignore[return-value]
