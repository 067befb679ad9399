"""Thin typer CLI. Everything below it raises PdcheckError subclasses; main() maps them to exit codes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from pdcheck.cliopts import Command, Device, Group, scenario_flags
from pdcheck.errors import EXIT_HARNESS, EXIT_INTERRUPTED, BadInput, PdcheckError, one_line, usage_error_types

EPILOG = """[bold]Examples[/]
  [dim]# have logs? start here, then run what it wrote[/]
  pdcheck scenario from-logs prefill.log decode.log -o mine.toml
  pdcheck handshake mine.toml --vllm all
  [dim]# a bundled scenario by name; one release: the per-rank report[/]
  pdcheck handshake seed-19338-tp8 --vllm 0.9.1
  [dim]# no scenario file: flags only[/]
  pdcheck handshake --prefill-tp 2 --decode-tp 2 \\
      --prefill-blocks 5808,5800 --decode-blocks 5800 --vllm 0.9.1
  [dim]# CI: every bundled scenario against its expected outcome[/]
  pdcheck smoke --junit smoke.xml

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


class _LazyGroup(Group):
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
scenario_app = typer.Typer(cls=Group, no_args_is_help=True, rich_markup_mode="rich",
                           help="Make scenarios: from-logs reads them out of vLLM start-up logs.")
app.add_typer(scenario_app, name="scenario")

Opt = typer.Option
RUN = "Run"
OUTPUT = "Output"
LIVE = "Live prefill"


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


@app.command(cls=Command, epilog=EPILOG)
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
    device: Device = "cpu",
    hang_timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                       help="Seconds before a reply-less handshake counts as a hang.")] = 3.0,
    timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                  help="Seconds the whole run may take before ranks count as hung.")] = 120.0,
    json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                  help="One JSON document on stdout instead of tables (no progress).")] = False,
    log_dir: Annotated[Path | None, Opt(metavar="DIR", rich_help_panel=OUTPUT, show_default=False,
                                        help="Keep each rank's log (its stdout and stderr, NIXL's and UCX's own "
                                             "lines included) here as P0.log, D0.log, ... (default: a temporary "
                                             "directory, removed unless the harness fails).")] = None,
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
                                        "pdcheck_decode ones (needs pdcheck\\[ray]).")] = None,
    sglang: Annotated[str | None, Opt(metavar="RELEASES", rich_help_panel=RUN, show_default=False,
                                      help="SGLang release(s) to model instead of vLLM: 0.5.8, '0.4.7,0.5.23' or "
                                           "'all' (or framework = \"sglang\" in the scenario).")] = None,
) -> None:
    """Start fake P and D ranks, run the modelled release's handshake for real, report per D rank."""
    from pdcheck import bounds, progress, report
    from pdcheck import plan as pl
    from pdcheck.scenario import load

    # Every check before any process starts: flags, file, releases, port layout, device.
    bounds.check_timeouts(hang_timeout, timeout)
    if sglang is not None or (scenario is not None and from_logs is None):
        from pdcheck.scenario import read_toml

        declared = read_toml(scenario).get("framework") if scenario is not None else None
        if pl.framework_of(declared, vllm, sglang, str(scenario or "command line")) == "sglang":
            _sglang_handshake(scenario, sglang, overrides, hang_timeout, timeout, json_out,
                              unsupported={"--from-logs": from_logs, "--prefill-endpoint": prefill_endpoint,
                                           "--ray": ray, "--prefill-vllm": prefill_vllm, "--inject": inject})
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
    if log_dir is not None:
        from pdcheck import lifecycle

        lifecycle.keep_rank_logs(log_dir)
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
    if not json_out:
        _native_note(log_dir)
    raise typer.Exit(rep.exit_code)


def _sglang_handshake(scenario: Path | None, sglang: str | None, overrides: dict[str, Any], hang_timeout: float,
                      timeout: float, json_out: bool, unsupported: dict[str, Any]) -> None:
    """`handshake` for SGLang: plan (pdcheck.sglang.plan), run on real processes (runner), report."""
    from pdcheck.sglang import plan as sp
    from pdcheck.sglang import report as sr
    from pdcheck.sglang import runner
    from pdcheck.sglang.scenario import load as sg_load

    endpoint = unsupported.pop("--prefill-endpoint")
    for flag, val in unsupported.items():
        if val:
            raise BadInput(f"{flag}: not available for SGLang yet (see docs/sglang.md)")
    live = None
    if endpoint is not None:
        from pdcheck.sglang.probe import parse_url

        live = sp.LiveBootstrap(*parse_url(endpoint))
    plan = sp.build(sg_load(scenario, overrides), sglang,
                    sp.SgOptions(hang_timeout_s=hang_timeout, start_timeout_s=timeout, run_timeout_s=timeout), live)
    rep = sr.build(runner.run(plan))
    if json_out:
        sys.stdout.buffer.write(sr.to_json(rep) + b"\n")
    else:
        sr.render(rep, _console())
    raise typer.Exit(rep.exit_code)


def _native_note(log_dir: Path | None) -> None:
    """One line per distinct NIXL error the ranks logged (their logs, not the terminal, get NIXL's C++ lines):
    these come from the READs the report shows refused."""
    from pdcheck import lifecycle

    found = lifecycle.native_errors(lifecycle.rank_log_dirs())
    if not found:
        return
    where = f"in {log_dir}" if log_dir is not None else "--log-dir DIR keeps them"
    console = _console(highlight=False)
    console.print(f"[dim]NIXL's own error lines in the rank logs ({_escape(where)}), from the refused READs "
                  "above:[/]")
    for msg, ranks in found.items():
        console.print(f"[dim]  {', '.join(ranks)}: {_escape(msg)}[/]")


def _write(output: Path | None, text: str) -> None:
    """from-logs -o: the scenario written (an existing file was refused before, unless --force)."""
    if output is None:
        return
    try:
        output.write_text(text)
    except OSError as exc:
        raise BadInput(f"--output: cannot write {output}: {exc.strerror}") from None


@scenario_app.command("from-logs", cls=Command, epilog=EPILOG)
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
                                       help="Write the scenario here (default: stdout); an existing file "
                                            "only with --force.")] = None,
    force: Annotated[bool, Opt("--force", metavar="", rich_help_panel=OUTPUT,
                               help="Let --output replace an existing file.")] = False,
    dp_rank: Annotated[int | None, Opt(metavar="N", rich_help_panel=RUN, show_default=False,
                                       help="Data-parallel rank to read when a log has several (default: "
                                            "the lowest).")] = None,
    json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                  help="One JSON document on stdout: the scenario, where each value came "
                                       "from, and what is missing.")] = False,
    sglang: Annotated[str | None, Opt(metavar="RELEASES", rich_help_panel=RUN, show_default=False,
                                      help="The logs are SGLang servers' (their server_args line): write an SGLang "
                                           "scenario for these releases.")] = None,
) -> None:
    """Read P/D geometry and per-rank num_blocks out of vLLM start-up logs and write a commented scenario.

    Flags fill in or override what the logs lack; the scenario runs with `pdcheck handshake SCENARIO.toml`."""
    from pdcheck import fromlogs

    if output is not None and not force and (output.exists() or output.is_symlink()):
        raise BadInput(f"--output: {output} exists; pass --force to replace it")

    if sglang is not None:  # SGLang's server_args line (pdcheck.sglang.fromlogs)
        from pdcheck.sglang import fromlogs as sgl
        from pdcheck.sglang.releases import resolve_many

        names = [r.name for r in resolve_many(sglang)]
        p_f, d_f = sgl.parse(prefill_log, "prefill"), sgl.parse(decode_log, "decode")
        text = sgl.to_toml(p_f, d_f, names)
        _write(output, text)
        if json_out:
            import msgspec

            doc = {"framework": "sglang", "prefill": p_f, "decode": d_f, "sglang": names,
                   "notes": p_f.notes + d_f.notes, "output": str(output) if output is not None else None}
            sys.stdout.buffer.write(msgspec.json.encode(doc) + b"\n")
        elif output is None:
            sys.stdout.write(text)
        for note in p_f.notes + d_f.notes:
            _console(stderr=True, highlight=False).print(f"note: {_escape(note)}")
        return

    fl, _sc = _logs_scenario((prefill_log, decode_log), overrides, dp_rank)
    text = fromlogs.to_toml(fl, overrides)
    _write(output, text)
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
        import shlex

        # soft_wrap: the command stays one line to copy, however narrow the terminal.
        _console(stderr=True, highlight=False, soft_wrap=True).print(
            f"wrote {output}; run it with: pdcheck handshake {shlex.quote(str(output))}", markup=False)
    _report_missing(fl, overrides)


@app.command(cls=Command, epilog=EPILOG)
def smoke(
    directory: Annotated[Path | None, typer.Argument(
        metavar="[DIRECTORY]", show_default=False,
        help="Directory of scenario TOML files with expect tables (default: the bundled scenarios).")] = None,
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
    from pdcheck.scenario import BUNDLED

    bounds.check_timeouts(hang_timeout)
    bounds.check_out_file("--junit", junit)
    rep = sm.run(directory if directory is not None else BUNDLED,
                 RunOptions(transfer=transfer, hang_timeout_ms=int(hang_timeout * 1000)))
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
        if type(exc).__name__ == "NoArgsIsHelpError":
            # Bare `pdcheck` / `pdcheck scenario`: asking for nothing gets the help (rich has printed it; plain
            # help is the message), exit 0, as click before 8.2 did. Not an error, so no error line.
            text = exc.format_message()  # type: ignore[attr-defined]
            if text.strip():
                print(text)
            return 0
        error(one_line(exc.format_message()))  # type: ignore[attr-defined]
        return exc.exit_code  # type: ignore[attr-defined]
    except typer.Abort:  # EOF on a prompt
        return EXIT_INTERRUPTED


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
