"""Thin typer CLI. Everything below it raises PdcheckError subclasses; main() maps them to exit codes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from pdcheck.errors import EXIT_INTERRUPTED, BadInput, PdcheckError, one_line, usage_error_types

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Reproduce and diagnose vLLM NixlConnector P/D handshake and KV-transfer failures.")

Opt = typer.Option
USAGE_ERRORS = usage_error_types()


@app.callback()
def _root() -> None:
    """Keeps `pdcheck <command>` a command group even while only one command is registered."""


def _side_overrides(opts: dict[str, Any]) -> dict[str, Any]:
    """Map flags to scenario keys. Shared flags set both sides; --prefill-X / --decode-X win over them."""
    from pdcheck.scenario import parse_counts

    out: dict[str, dict[str, Any]] = {"prefill": {}, "decode": {}}
    shared = {"block_size": "block_size", "layers": "layers", "kv_heads": "kv_heads", "head_dim": "head_dim",
              "dtype": "dtype", "kv_cache_layout": "kv_cache_layout", "attn_backend": "attn_backend",
              "use_mla": "use_mla", "host": "host"}
    for flag, key in shared.items():
        if opts.get(flag) is not None:
            out["prefill"][key] = out["decode"][key] = opts[flag]
    for side in ("prefill", "decode"):
        for key in ("tp", "block_size", "kv_heads", "head_dim", "dtype", "kv_cache_layout", "attn_backend",
                    "engine_id", "base_port", "layers"):
            val = opts.get(f"{side}_{key}")
            if val is not None:
                out[side]["tp_size" if key == "tp" else key] = val
        blocks = opts.get(f"{side}_blocks")
        if blocks is not None:
            out[side]["num_blocks"] = parse_counts(f"--{side}-blocks", blocks)
    return {k: v for k, v in out.items() if v}


@app.command()
def handshake(
    scenario: Annotated[Path | None, typer.Argument(help="Scenario TOML file (flags override its keys).")] = None,
    vllm: Annotated[str | None, Opt(help="Release(s) to model: 0.9.1, '0.9.1,0.9.2', or 'all'.")] = None,
    json_out: Annotated[bool, Opt("--json", help="One JSON document on stdout instead of tables.")] = False,
    transfer: Annotated[bool, Opt("--transfer/--no-transfer", help="Prove verdicts with real NIXL READs.")] = True,
    device: Annotated[str, Opt(help="Where KV caches live: cpu (host memory) or cuda (GPU memory).")] = "cpu",
    hang_timeout: Annotated[float, Opt(help="Seconds before a reply-less handshake counts as a hang.")] = 3.0,
    timeout: Annotated[float, Opt(help="Seconds the whole run may take before ranks count as hung.")] = 120.0,
    prefill_tp: Annotated[int | None, Opt(help="Prefill TP size.")] = None,
    decode_tp: Annotated[int | None, Opt(help="Decode TP size.")] = None,
    prefill_blocks: Annotated[str | None, Opt(help="Prefill num_blocks: one number or one per rank, e.g. 5808,5800.")] = None,
    decode_blocks: Annotated[str | None, Opt(help="Decode num_blocks: one number or one per rank.")] = None,
    block_size: Annotated[int | None, Opt(help="Tokens per block, both sides.")] = None,
    layers: Annotated[int | None, Opt(help="Layers, both sides.")] = None,
    kv_heads: Annotated[int | None, Opt(help="Total KV heads, both sides.")] = None,
    head_dim: Annotated[int | None, Opt(help="Head dim (MLA: latent dim), both sides.")] = None,
    dtype: Annotated[str | None, Opt(help="KV dtype, both sides: bfloat16, float16, float32, fp8.")] = None,
    kv_cache_layout: Annotated[str | None, Opt(help="HND or NHD (or a 0.31+ enum name), both sides.")] = None,
    attn_backend: Annotated[str | None, Opt(help="Attention backend name, both sides.")] = None,
    use_mla: Annotated[bool | None, Opt("--use-mla/--no-mla", help="MLA (replicated latent KV).")] = None,
    host: Annotated[str | None, Opt(help="Side-channel host (default 127.0.0.1, loopback).")] = None,
    prefill_block_size: Annotated[int | None, Opt()] = None,
    decode_block_size: Annotated[int | None, Opt()] = None,
    prefill_kv_heads: Annotated[int | None, Opt()] = None,
    decode_kv_heads: Annotated[int | None, Opt()] = None,
    prefill_head_dim: Annotated[int | None, Opt()] = None,
    decode_head_dim: Annotated[int | None, Opt()] = None,
    prefill_dtype: Annotated[str | None, Opt()] = None,
    decode_dtype: Annotated[str | None, Opt()] = None,
    prefill_kv_cache_layout: Annotated[str | None, Opt()] = None,
    decode_kv_cache_layout: Annotated[str | None, Opt()] = None,
    prefill_attn_backend: Annotated[str | None, Opt()] = None,
    decode_attn_backend: Annotated[str | None, Opt()] = None,
    prefill_layers: Annotated[int | None, Opt()] = None,
    decode_layers: Annotated[int | None, Opt()] = None,
    prefill_engine_id: Annotated[str | None, Opt()] = None,
    decode_engine_id: Annotated[str | None, Opt()] = None,
    prefill_base_port: Annotated[int | None, Opt(help="P side-channel base port (rank r listens on base + r).")] = None,
    inject: Annotated[list[str] | None, Opt(hidden=True, help="Test hooks: die:P1, mute:P1, corrupt:P0:1:17.")] = None,
    max_tp: Annotated[int, Opt(help="Most ranks per side (one process each); up to 256.")] = 64,
) -> None:
    """Start fake P and D ranks, run the modelled release's handshake for real, report per D rank."""
    from pdcheck import bounds, report
    from pdcheck import handshake as hs
    from pdcheck.releases import resolve_many
    from pdcheck.scenario import load

    opts = dict(locals())
    # Every check before any process starts: flags, file, releases, port layout, device.
    bounds.check_timeouts(hang_timeout, timeout)
    bounds.check_max_tp(max_tp)
    if device not in ("cpu", "cuda"):
        raise BadInput(f"--device: expected cpu or cuda, got {device!r}")
    sc = load(scenario, _side_overrides(opts), max_tp)
    releases = (resolve_many(vllm) if vllm is not None
                else resolve_many(",".join(sc.vllm), f"{sc.source}: vllm"))
    hs.plan_ports(sc, releases)
    inj = _parse_inject(inject or [], sc.prefill.tp_size)
    bounds.check_device(device)
    rep = hs.run(sc, releases, hs.Options(
        device=device, transfer=transfer, hang_timeout_ms=int(hang_timeout * 1000), run_timeout_s=timeout,
        start_timeout_s=timeout, inject=inj))
    if json_out:
        sys.stdout.buffer.write(report.to_json(rep) + b"\n")
    elif len(releases) > 2:
        console = Console()
        report.render_matrix(rep, console)
        for e in rep.harness_errors:
            console.print(f"[red]harness:[/] {escape(e)}")
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
    from pdcheck import bounds
    from pdcheck import handshake as hs
    from pdcheck import smoke as sm

    bounds.check_timeouts(hang_timeout)
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


def _register_optional() -> None:
    try:
        from pdcheck.bench.command import register
    except ImportError:  # transfer-bench not installed in this tree
        return
    register(app)


_register_optional()


def run(argv: list[str] | None = None) -> int:
    """The CLI without the process-wide parts of main(): parse, run, map every outcome to an exit code with
    at most one error line on stderr. The fuzz suite drives this in-process."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        rc = app(argv, standalone_mode=False)  # typer returns the exit code here instead of raising it
        return rc if isinstance(rc, int) else 0
    except PdcheckError as exc:
        err.print(f"[red]pdcheck: error:[/] {escape(one_line(str(exc)))}")
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except typer.Exit as exc:
        return exc.exit_code
    except USAGE_ERRORS as exc:  # usage errors arrive here with standalone_mode=False
        err.print(f"[red]pdcheck: error:[/] {escape(one_line(exc.format_message()))}")  # type: ignore[attr-defined]
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
