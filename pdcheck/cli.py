"""Thin typer CLI. Everything below it raises PdcheckError subclasses; main() maps them to exit codes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from pdcheck.cliopts import scenario_flags
from pdcheck.errors import BadInput, PdcheckError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Reproduce and diagnose vLLM NixlConnector P/D handshake and KV-transfer failures.")

Opt = typer.Option


@app.callback()
def _root() -> None:
    """Keeps `pdcheck <command>` a command group even while only one command is registered."""


@app.command()
@scenario_flags
def handshake(
    scenario: Annotated[Path | None, typer.Argument(help="Scenario TOML file (flags override its keys).")] = None,
    *,
    overrides: dict[str, Any],
    vllm: Annotated[str | None, Opt(help="Release(s) to model: 0.9.1, '0.9.1,0.9.2', or 'all'.")] = None,
    json_out: Annotated[bool, Opt("--json", help="One JSON document on stdout instead of tables.")] = False,
    transfer: Annotated[bool, Opt("--transfer/--no-transfer", help="Prove verdicts with real NIXL READs.")] = True,
    device: Annotated[str, Opt(help="Where KV caches live: cpu (host memory) or cuda (GPU memory).")] = "cpu",
    hang_timeout: Annotated[float, Opt(help="Seconds before a reply-less handshake counts as a hang.")] = 3.0,
    timeout: Annotated[float, Opt(help="Seconds the whole run may take before ranks count as hung.")] = 120.0,
    prefill_vllm: Annotated[str | None, Opt(help="The release the prefill runs (prefill.vllm): a cross-release pair, "
                                              "or the live P's release with --prefill-endpoint.")] = None,
    prefill_endpoint: Annotated[str | None, Opt(help="HOST:PORT of a live P's side channel (e.g. pdcheck serve): "
                                                  "no fake P; its facts are probed.")] = None,
    inject: Annotated[list[str] | None, Opt(hidden=True, help="Test hooks: die:P1, mute:P1, corrupt:P0:1:17.")] = None,
) -> None:
    """Start fake P and D ranks, run the modelled release's handshake for real, report per D rank."""
    from pdcheck import handshake as hs
    from pdcheck import report
    from pdcheck.releases import resolve_many
    from pdcheck.scenario import load

    if prefill_vllm is not None:
        overrides = {**overrides, "prefill": {**overrides.get("prefill", {}), "vllm": prefill_vllm}}
    tp_given = True
    if prefill_endpoint is not None:
        from pdcheck.scenario import read_toml

        p_doc = read_toml(scenario).get("prefill", {}) if scenario is not None else {}
        p_over = overrides.get("prefill", {})
        tp_given = "tp_size" in p_over or "tp_size" in p_doc
        if "num_blocks" not in p_over and "num_blocks" not in p_doc:
            overrides = {**overrides, "prefill": {**p_over, "num_blocks": 1}}  # the live P's counts are probed
    sc = load(scenario, overrides)
    releases = resolve_many(vllm if vllm is not None else ",".join(sc.vllm))
    if device not in ("cpu", "cuda"):
        raise BadInput(f"--device: expected cpu or cuda, got {device!r}")
    if hang_timeout <= 0 or timeout <= 0:
        raise BadInput("--hang-timeout and --timeout must be positive")
    endpoint = None
    if prefill_endpoint is not None:
        from pdcheck.probe import parse_endpoint

        endpoint = parse_endpoint(prefill_endpoint, "--prefill-endpoint")
    rep = hs.run(sc, releases, hs.Options(
        device=device, transfer=transfer, hang_timeout_ms=int(hang_timeout * 1000), run_timeout_s=timeout,
        inject=_parse_inject(inject or []), prefill_endpoint=endpoint,
        prefill_tp_given=tp_given))
    if json_out:
        sys.stdout.buffer.write(report.to_json(rep) + b"\n")
    elif len(releases) > 2:
        console = Console()
        report.render_matrix(rep, console)
        for e in rep.harness_errors:
            console.print(f"[red]harness:[/] {e}")
        console.print(f"[dim]{rep.timings.total_s:.2f} s; exit {rep.exit_code}. "
                      "For the per-rank report (asserts, contacted ranks, transfer proof): --vllm <one release>[/]")
    else:
        report.render(rep, Console())
    raise typer.Exit(rep.exit_code)


@app.command()
def smoke(
    directory: Annotated[Path, typer.Argument(help="Directory of scenario TOML files with [expect] tables.")] = Path(
        "scenarios"),
    junit: Annotated[Path | None, Opt(help="Write JUnit XML here (GitHub/GitLab test reports).")] = None,
    json_out: Annotated[bool, Opt("--json", help="One JSON document on stdout instead of the table.")] = False,
    transfer: Annotated[bool, Opt("--transfer/--no-transfer", help="Prove verdicts with real NIXL READs.")] = True,
    hang_timeout: Annotated[float, Opt(help="Seconds before a reply-less handshake counts as a hang.")] = 2.0,
) -> None:
    """Run every scenario in DIRECTORY and check its expected outcome per release. Exit 0 only if all hold."""
    from pdcheck import handshake as hs
    from pdcheck import smoke as sm

    rep = sm.run(directory, hs.Options(transfer=transfer, hang_timeout_ms=int(hang_timeout * 1000)))
    if junit is not None:
        try:
            junit.write_bytes(sm.junit(rep))
        except OSError as exc:
            raise BadInput(f"--junit: cannot write {junit}: {exc.strerror}") from None
    if json_out:
        import msgspec

        sys.stdout.buffer.write(msgspec.json.encode(rep) + b"\n")
    else:
        sm.render(rep, Console())
    raise typer.Exit(rep.exit_code)


def _parse_inject(items: list[str]) -> Any:
    from pdcheck.messages import Inject

    die, mute, corrupt = [], [], []
    for item in items:
        parts = item.split(":")
        try:
            if parts[0] in ("die", "mute") and len(parts) == 2 and parts[1].startswith("P"):
                (die if parts[0] == "die" else mute).append(int(parts[1][1:]))
            elif parts[0] == "corrupt" and len(parts) == 4 and parts[1].startswith("P"):
                corrupt.append((int(parts[1][1:]), int(parts[2]), int(parts[3])))
            else:
                raise ValueError
        except ValueError:
            raise BadInput(f"--inject: {item!r} is not die:P<r>, mute:P<r> or corrupt:P<r>:<region>:<block>") from None
    return Inject(die_p=die, mute_p=mute, corrupt=corrupt)


def _register_live() -> None:
    """Commands that meet real deployments live in their own modules."""
    from pdcheck import probe, serve

    probe.register(app)
    serve.register(app)


_register_live()


def _register_optional() -> None:
    try:
        from pdcheck.bench.command import register
    except ImportError:  # transfer-bench not installed in this tree
        return
    register(app)


_register_optional()


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # click returns the exit code here instead of raising it
        sys.exit(rc if isinstance(rc, int) else 0)
    except PdcheckError as exc:
        Console(stderr=True).print(f"[red]pdcheck: error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # usage errors arrive here with standalone_mode=False
        import click

        try:  # typer >= 0.29 vendors its own click; catch both
            from typer._click.exceptions import ClickException as TyperClickException
        except ImportError:
            TyperClickException = click.exceptions.ClickException  # noqa: N806
        if isinstance(exc, (click.exceptions.ClickException, TyperClickException)):
            exc.show()
            sys.exit(exc.exit_code)
        raise
