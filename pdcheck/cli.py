"""Thin typer CLI. Everything below it raises PdcheckError subclasses; main() maps them to exit codes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from pdcheck.cliopts import scenario_flags
from pdcheck.errors import EXIT_INTERRUPTED, BadInput, PdcheckError, one_line, usage_error_types

EPILOG = """[bold]Examples[/]
  [dim]# have logs? start here, then run what it wrote[/]
  pdcheck scenario from-logs prefill.log decode.log -o mine.toml
  pdcheck handshake mine.toml --vllm all
  [dim]# per-rank asserts and the transfer proof for one release[/]
  pdcheck handshake scenarios/seed-19338-tp8.toml --vllm 0.9.1
  [dim]# no scenario file: flags only[/]
  pdcheck handshake --prefill-tp 2 --decode-tp 2 \\
      --prefill-blocks 5808,5800 --decode-blocks 5800 --vllm 0.9.1
  pdcheck smoke scenarios --junit smoke.xml

Exit codes: 0 survives, 1 a hazard fires, 2 bad input, 3 harness failure, 130 interrupted.
Shell completion: pdcheck --install-completion (bash, zsh, fish, PowerShell)."""

# Commands whose modules are imported only when that command runs (or --help/completion lists it): `handshake`
# should not pay for probe's, serve's and transfer-bench's imports. Name -> (module, its register(app)).
LAZY = {"probe": "pdcheck.probe", "serve": "pdcheck.serve", "transfer-bench": "pdcheck.bench.command",
        "requests": "pdcheck.requests.command"}
_lazy_loaded: dict[str, Any] = {}  # name -> its click command, or None (transfer-bench not in this tree)


def _lazy_command(name: str) -> Any:
    if name not in _lazy_loaded:
        import importlib

        try:
            register = importlib.import_module(LAZY[name]).register
        except ImportError:  # transfer-bench not installed in this tree
            _lazy_loaded[name] = None
            return None
        # The module adds its command to a scratch app of the same settings, built into a click command here.
        scratch = typer.Typer(pretty_exceptions_enable=False, rich_markup_mode=app.rich_markup_mode)
        register(scratch)
        _lazy_loaded[name] = typer.main.get_group(scratch).commands.get(name)
    return _lazy_loaded[name]


class _LazyGroup(TyperGroup):
    """The root group: lists the lazy commands in their place (before the sub-groups) and imports one only
    when it is looked up."""

    def list_commands(self, ctx: Any) -> list[str]:
        names = [n for n, c in self.commands.items() if not isinstance(c, TyperGroup)]
        names += [n for n in LAZY if n not in names]
        return names + [n for n in self.commands if n not in names]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = self.commands.get(cmd_name)
        if cmd is None and cmd_name in LAZY:
            cmd = _lazy_command(cmd_name)
        return cmd

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and args[0] not in LAZY:
            # An unknown name: typer's "Did you mean ..." draws on self.commands, so load the lazy ones.
            for name in LAZY:
                cmd = _lazy_command(name)
                if cmd is not None:
                    self.commands.setdefault(name, cmd)
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=_LazyGroup, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode="rich",
                  epilog=EPILOG, help="Reproduce and diagnose vLLM NixlConnector P/D handshake and KV-transfer failures.")
scenario_app = typer.Typer(no_args_is_help=True, rich_markup_mode="rich",
                           help="Make scenarios: from-logs reads them out of vLLM start-up logs.")
app.add_typer(scenario_app, name="scenario")

Opt = typer.Option
RUN = "Run"
OUTPUT = "Output"
LIVE = "Live prefill"


def _console(**kw: Any) -> Any:
    """A rich Console, imported here: a --json run renders nothing and never imports rich."""
    from rich.console import Console

    return Console(**kw)


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
    version: Annotated[bool, Opt("--version", metavar="", callback=_version, is_eager=True,
                                 help="Print pdcheck's version and exit.")] = False,
) -> None:
    """Reproduce and diagnose vLLM NixlConnector P/D handshake and KV-transfer failures."""


def _logs_scenario(logs: tuple[Path, Path], overrides: dict[str, Any], dp_rank: int | None = None,
                   max_tp: int | None = None) -> Any:
    """(FromLogs, Scenario) for a pair of logs, flags merged in; the missing-field report goes to stderr."""
    from pdcheck import fromlogs
    from pdcheck.scenario import decode_scenario

    p_log, d_log = logs
    fl = fromlogs.from_files(p_log, d_log, dp_rank)
    fromlogs.require(fl, overrides, str(p_log), str(d_log))
    from pdcheck.bounds import MAX_TP

    sc = decode_scenario(fromlogs.scenario_doc(fl, overrides), f"scenario from {p_log} and {d_log}",
                         max_tp or MAX_TP)
    return fl, sc


def _report_missing(fl: Any, overrides: dict[str, Any]) -> None:
    from pdcheck import fromlogs

    lines = fromlogs.missing_report(fl, overrides)
    if lines:
        err = _console(stderr=True, highlight=False, soft_wrap=True)
        err.print("[yellow]not in the logs[/] (the scenario default is used):")
        for ln in lines:
            err.print(f"  {ln}", markup=False)


@app.command(epilog=EPILOG)
@scenario_flags
def handshake(
    scenario: Annotated[Path | None, typer.Argument(help="Scenario TOML file (flags override its keys).",
                                                    metavar="SCENARIO.toml", show_default=False)] = None,
    *,
    overrides: dict[str, Any],
    from_logs: Annotated[tuple[Path, Path] | None, Opt(
        "--from-logs", metavar="P.log D.log", rich_help_panel="Scenario", show_default=False,
        help="Read the scenario from the two instances' vLLM start-up logs (as `pdcheck scenario from-logs`); "
             "flags still override.")] = None,
    vllm: Annotated[str | None, Opt(metavar="RELEASES", rich_help_panel=RUN, show_default=False,
                                    help="Release(s) to model: 0.9.1, '0.9.1,0.9.2', or 'all' "
                                         "(default: the scenario's list).")] = None,
    transfer: Annotated[bool, Opt("--transfer/--no-transfer", metavar="", rich_help_panel=RUN,
                                  help="Prove verdicts with real NIXL READs.")] = True,
    device: Annotated[str, Opt(metavar="cpu|cuda", rich_help_panel=RUN,
                               help="Where KV caches live: cpu (host memory) or cuda (GPU memory).")] = "cpu",
    hang_timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                       help="Seconds before a reply-less handshake counts as a hang.")] = 3.0,
    timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                  help="Seconds the whole run may take before ranks count as hung.")] = 120.0,
    json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                  help="One JSON document on stdout instead of tables (no progress).")] = False,
    prefill_vllm: Annotated[str | None, Opt(metavar="RELEASE", rich_help_panel=LIVE, show_default=False,
                                            help="The release the prefill runs (prefill.vllm): a cross-release "
                                                 "pair, or the live P's release with --prefill-endpoint.")] = None,
    prefill_endpoint: Annotated[str | None, Opt(metavar="HOST:PORT", rich_help_panel=LIVE, show_default=False,
                                                help="A live P's side channel (e.g. pdcheck serve): no fake P; its "
                                                     "facts are probed, read-only.")] = None,
    inject: Annotated[list[str] | None, Opt(hidden=True, help="Test hooks: die:P1, mute:P1, corrupt:P0:1:17.")] = None,
    max_tp: Annotated[int, Opt(metavar="N", rich_help_panel=RUN,
                                help="Most ranks per side (one process each); up to 256.")] = 64,
    ray: Annotated[str | None, Opt(metavar="ADDRESS", rich_help_panel=RUN, show_default=False,
                                   help="Run each rank as a Ray actor on this Ray cluster ('auto': the one this "
                                        "node belongs to): P on nodes with the pdcheck_prefill resource, D on "
                                        "pdcheck_decode ones (needs pdcheck[ray]).")] = None,
) -> None:
    """Start fake P and D ranks, run the modelled release's handshake for real, report per D rank."""
    from pdcheck import bounds, progress, report
    from pdcheck import plan as pl
    from pdcheck.scenario import load

    # Every check before any process starts: flags, file, releases, port layout, device.
    bounds.check_timeouts(hang_timeout, timeout)
    bounds.check_max_tp(max_tp)
    if device not in ("cpu", "cuda"):
        raise BadInput(f"--device: expected cpu or cuda, got {device!r}")
    if from_logs is not None and scenario is not None:
        raise BadInput("give a scenario file or --from-logs, not both")
    if prefill_vllm is not None:
        overrides = {**overrides, "prefill": {**overrides.get("prefill", {}), "vllm": prefill_vllm}}
    tp_given = True
    if prefill_endpoint is not None and from_logs is None:
        from pdcheck.scenario import read_toml

        p_doc = read_toml(scenario).get("prefill", {}) if scenario is not None else {}
        p_over = overrides.get("prefill", {})
        tp_given = "tp_size" in p_over or "tp_size" in p_doc
        if "num_blocks" not in p_over and "num_blocks" not in p_doc:
            overrides = {**overrides, "prefill": {**p_over, "num_blocks": 1}}  # the live P's counts are probed
    if from_logs is not None:
        fl, sc = _logs_scenario(from_logs, overrides, max_tp=max_tp)
        _report_missing(fl, overrides)
    else:
        sc = load(scenario, overrides, max_tp)
    live = None
    if prefill_endpoint is not None:
        from pdcheck.probe import parse_endpoint

        live = pl.LiveP(*parse_endpoint(prefill_endpoint, "--prefill-endpoint"), tp_given=tp_given)
    options = pl.RunOptions(device=device, transfer=transfer, hang_timeout_ms=int(hang_timeout * 1000),
                            run_timeout_s=timeout, start_timeout_s=timeout,
                            inject=_parse_inject(inject or [], sc.prefill.tp_size), max_tp=max_tp)
    run_plan = pl.build(sc, vllm, options, live=live, ray=ray)  # releases resolved and ports laid out once
    bounds.check_device(device)
    if ray is not None:
        if prefill_endpoint is not None:
            raise BadInput("--ray places fake P and D ranks; with --prefill-endpoint there is no fake P (drop one)")
        from pdcheck.launcher import check_ray

        check_ray(ray)
    if live is not None:
        from pdcheck.live import run as runner
    else:
        from pdcheck.handshake import run as runner
    with progress.stderr_progress(enabled=not json_out) as tick:
        rep = report.build(runner(run_plan.with_progress(tick)))
    if json_out:
        sys.stdout.buffer.write(report.to_json(rep) + b"\n")
    elif len(run_plan.releases) > 2:
        console = _console()
        report.render_matrix(rep, console)
        report.render_live(rep, console)
        for e in rep.harness_errors:
            console.print(f"[red]harness:[/] {_escape(e)}")
        one = rep.fails[0] if rep.fails else rep.releases[0]
        console.print(f"[dim]{rep.timings.total_s:.2f} s; exit {rep.exit_code}. "
                      f"Per-rank asserts and transfer proof: --vllm {one}[/]")
    else:
        report.render(rep, _console())
    raise typer.Exit(rep.exit_code)


@scenario_app.command("from-logs", epilog=EPILOG)
@scenario_flags
def scenario_from_logs(
    prefill_log: Annotated[Path, typer.Argument(metavar="PREFILL.log", show_default=False,
                                                help="The prefill instance's vLLM start-up log (plain or .gz).")],
    decode_log: Annotated[Path, typer.Argument(metavar="DECODE.log", show_default=False,
                                               help="The decode instance's vLLM start-up log (plain or .gz).")],
    *,
    overrides: dict[str, Any],
    output: Annotated[Path | None, Opt("--output", "-o", metavar="SCENARIO.toml", rich_help_panel=OUTPUT,
                                       show_default=False,
                                       help="Write the scenario here (default: stdout).")] = None,
    dp_rank: Annotated[int | None, Opt(metavar="N", rich_help_panel=RUN, show_default=False,
                                       help="Data-parallel rank to read when a log has several (default: "
                                            "the lowest).")] = None,
    json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                  help="One JSON document on stdout: the scenario, where each value came "
                                       "from, and what is missing.")] = False,
) -> None:
    """Read P/D geometry and per-rank num_blocks out of vLLM start-up logs and write a commented scenario.

    Flags fill in or override what the logs lack; the scenario runs with `pdcheck handshake SCENARIO.toml`."""
    from pdcheck import fromlogs

    fl, _sc = _logs_scenario((prefill_log, decode_log), overrides, dp_rank)
    text = fromlogs.to_toml(fl, overrides)
    if output is not None:
        try:
            output.write_text(text)
        except OSError as exc:
            raise BadInput(f"--output: cannot write {output}: {exc.strerror}") from None
    if json_out:
        import msgspec

        doc = {"scenario": fromlogs.scenario_doc(fl, overrides), "sources": fl.sources,
               "missing": fromlogs.missing_report(fl, overrides), "notes": fl.notes,
               "output": str(output) if output is not None else None}
        sys.stdout.buffer.write(msgspec.json.encode(doc) + b"\n")
        return
    if output is None:
        sys.stdout.write(text)
    else:
        _console(stderr=True, highlight=False).print(f"wrote {output}; run it with: pdcheck handshake {output}")
    _report_missing(fl, overrides)


@app.command(epilog=EPILOG)
def smoke(
    directory: Annotated[Path, typer.Argument(metavar="[DIRECTORY]",
                                              help="Directory of scenario TOML files with expect tables.")] = Path(
        "scenarios"),
    junit: Annotated[Path | None, Opt(metavar="FILE.xml", rich_help_panel=OUTPUT, show_default=False,
                                      help="Write JUnit XML here (GitHub/GitLab test reports).")] = None,
    json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                  help="One JSON document on stdout instead of the table.")] = False,
    transfer: Annotated[bool, Opt("--transfer/--no-transfer", metavar="", rich_help_panel=RUN,
                                  help="Prove verdicts with real NIXL READs.")] = True,
    hang_timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                       help="Seconds before a reply-less handshake counts as a hang.")] = 2.0,
) -> None:
    """Run every scenario in DIRECTORY and check its expected outcome per release. Exit 0 only if all hold."""
    from pdcheck import bounds
    from pdcheck import smoke as sm
    from pdcheck.plan import RunOptions

    bounds.check_timeouts(hang_timeout)
    rep = sm.run(directory, RunOptions(transfer=transfer, hang_timeout_ms=int(hang_timeout * 1000)))
    if junit is not None:
        try:
            junit.write_bytes(sm.junit(rep))
        except OSError as exc:
            raise BadInput(f"--junit: cannot write {junit}: {exc.strerror}") from None
    if json_out:
        import msgspec

        sys.stdout.buffer.write(msgspec.json.encode(rep) + b"\n")
    else:
        sm.render(rep, _console())
    raise typer.Exit(rep.exit_code)


def _parse_inject(items: list[str], p_tp: int) -> Any:
    import re

    from pdcheck.messages import Inject

    die, mute, corrupt = [], [], []
    num = re.compile(r"[0-9]{1,9}", re.ASCII)
    for item in items:
        parts = item.split(":")
        try:
            if not all(num.fullmatch(x) for x in [parts[1][1:], *parts[2:]]) or int(parts[1][1:]) >= p_tp:
                raise ValueError
            if parts[0] in ("die", "mute") and len(parts) == 2 and parts[1].startswith("P"):
                (die if parts[0] == "die" else mute).append(int(parts[1][1:]))
            elif parts[0] == "corrupt" and len(parts) == 4 and parts[1].startswith("P"):
                corrupt.append((int(parts[1][1:]), int(parts[2]), int(parts[3])))
            else:
                raise ValueError
        except (ValueError, IndexError):
            raise BadInput(f"--inject: {item!r} is not die:P<r>, mute:P<r> or corrupt:P<r>:<region>:<block>") from None
    return Inject(die_p=die, mute_p=mute, corrupt=corrupt)


def run(argv: list[str] | None = None) -> int:
    """The CLI without the process-wide parts of main(): parse, run, map every outcome to an exit code with
    at most one error line on stderr. The fuzz suite drives this in-process."""
    def error(text: str) -> None:
        _console(stderr=True, highlight=False, soft_wrap=True).print(f"[red]pdcheck: error:[/] {_escape(text)}")

    try:
        rc = app(argv, standalone_mode=False)  # typer returns the exit code here instead of raising it
        return rc if isinstance(rc, int) else 0
    except PdcheckError as exc:
        error(one_line(str(exc)))
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except typer.Exit as exc:
        return exc.exit_code
    except USAGE_ERRORS as exc:  # usage errors arrive here with standalone_mode=False
        error(one_line(exc.format_message()))  # type: ignore[attr-defined]
        return exc.exit_code  # type: ignore[attr-defined]
    except typer.Abort:  # EOF on a prompt
        return EXIT_INTERRUPTED


def main() -> None:
    from pdcheck import lifecycle

    lifecycle.install_signal_handlers()
    try:
        code = run()
    finally:
        lifecycle.shutdown()
    sys.exit(lifecycle.exit_code(code))
