"""The `transfer-bench` typer command: flags -> BenchConfig -> run -> report -> exit code.

Exit codes: 0 all good, 1 a floor failed or a block arrived wrong, 2 bad input, 3 the harness failed,
130 interrupted. Errors are PdcheckErrors; pdcheck's entry point (cli.run) prints each as one line.
Bounds are pdcheck.bounds', checked by the plan before any process starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from pdcheck import bounds, envelope, figure, progress, verdict
from pdcheck.bench import output, schema
from pdcheck.bench.models import resolve_shape
from pdcheck.bench.plan import BenchConfig, check_flags
from pdcheck.bench.transport import preset
from pdcheck.cliopts import Command, Device
from pdcheck.errors import EXIT_INTERRUPTED, BadInput, PdcheckError

Opt = typer.Option
SHAPE, SWEEP, TRANSPORT, RUN, OUTPUT, FLOORS = "Model and TP", "Sweep", "Transport", "Run", "Output", "CI floors"

EPILOG = """[bold]Examples[/]
  [dim]# Llama-3.1-8B's KV blocks, 1 prefill -> 1 decode rank, block sizes 16..128[/]
  pdcheck transfer-bench
  [dim]# a custom shape, TP 2 -> 4, fragmented block tables, JSON for CI with floors[/]
  pdcheck transfer-bench --model= --layers 4 --kv-heads 8 --head-dim 128 \\
      --prefill-tp 2 --decode-tp 4 --run-length 4 --json --min-bw 1 --max-p99 5000
  [dim]# DeepSeek-V3 (MLA) over the fastest host-memory transport, with a plot[/]
  pdcheck transfer-bench -m DeepSeek-V3 --transport best --plot bench.png

Exit codes: 0 all good, 1 a floor failed or a block arrived wrong, 2 bad input, 3 harness failure,
130 interrupted."""


class Interrupted(PdcheckError):
    """Ctrl-C or SIGTERM mid-run: the ranks were stopped; pdcheck's entry point prints the one line."""

    exit_code = EXIT_INTERRUPTED


def parse_list(flag: str, text: str) -> list[int]:
    """'16,32,64' or '4k' (x1024) -> ints; anything else is bad input (the bounds are the plan's)."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        mult = 1024 if p.endswith("k") else 1
        p = p[:-1] if p.endswith("k") else p
        try:
            if not p.isascii() or len(p) > 12:
                raise ValueError
            v = int(p) * mult
        except ValueError:
            raise BadInput(f"{flag} {text!r}: {part.strip()!r} is not an integer") from None
        if v <= 0:
            raise BadInput(f"{flag} values must be positive, got {part.strip()}")
        out.append(v)
    return out


def floors(rows: list[schema.Row], min_bw: float | None, max_p99: float | None) -> list[str]:
    out = []
    for r in rows:
        if min_bw is not None and r.gbps < min_bw:
            out.append(f"{r.label}: {r.gbps:.3g} GB/s < --min-bw {min_bw:g}")
        if max_p99 is not None and r.p99_us > max_p99:
            out.append(f"{r.label}: p99 {r.p99_us:.4g} us > --max-p99 {max_p99:g}")
    return out


def transfer_bench(
    model: Annotated[str | None, Opt("--model", "-m", metavar="NAME", rich_help_panel=SHAPE,
                                     help="Preset: Llama-3.1-8B, Llama-3.1-70B, Qwen3-8B, DeepSeek-V3 (MLA), ... "
                                          "Empty (--model=) to give --layers/--kv-heads/--head-dim.")]
    = "Llama-3.1-8B",
    layers: Annotated[int | None, Opt(metavar="N", rich_help_panel=SHAPE, show_default=False,
                                      help="Layers (overrides the preset).")] = None,
    kv_heads: Annotated[int | None, Opt(metavar="N", rich_help_panel=SHAPE, show_default=False,
                                        help="Total KV heads (overrides the preset).")] = None,
    head_dim: Annotated[int | None, Opt(metavar="N", rich_help_panel=SHAPE, show_default=False,
                                        help="Head dim; MLA: latent width per token (576 for DeepSeek-V3).")] = None,
    mla: Annotated[bool | None, Opt("--mla/--no-mla", metavar="", rich_help_panel=SHAPE, show_default=False,
                                    help="MLA: one replicated latent region per layer (default: the preset's).")]
    = None,
    dtype: Annotated[str | None, Opt(metavar="DTYPE", rich_help_panel=SHAPE, show_default=False,
                                     help="KV dtype: bf16, fp16, fp32, fp8 (default: the preset's, bf16).")] = None,
    block_size: Annotated[str, Opt(metavar="TOKENS[,TOKENS...]", rich_help_panel=SWEEP,
                                   help="Tokens per block; a list sweeps: 16,32,64,128.")] = "16,32,64,128",
    tokens: Annotated[str, Opt(metavar="N[,N...]", rich_help_panel=SWEEP,
                               help="Tokens per request; a list sweeps: 1k,4k.")] = "1024",
    run_length: Annotated[int, Opt(metavar="L", rich_help_panel=SWEEP,
                                   help="Fragmentation: blocks come in contiguous runs of L (1 = fully "
                                        "scattered).")] = 1,
    requests: Annotated[int, Opt(metavar="N", rich_help_panel=SWEEP,
                                 help="Distinct per-request block tables cycled through (0 = enough to cover 4x "
                                      "the LLC).")] = 0,
    prefill_tp: Annotated[int, Opt(metavar="N", rich_help_panel=SHAPE, help="Prefill ranks (targets).")] = 1,
    decode_tp: Annotated[int, Opt(metavar="N", rich_help_panel=SHAPE,
                                  help="Decode ranks (initiators that READ).")] = 1,
    transport: Annotated[str, Opt(metavar="PRESET", rich_help_panel=TRANSPORT,
                                  help="default (UCX's choice: CMA on one host), best (CMA with big segments and "
                                       "error mode none: fastest for host memory, costs listed in the output), shm "
                                       "(shared-memory RMA emulation, busy target), tcp.")] = "default",
    error_mode: Annotated[str | None, Opt(metavar="peer|none", rich_help_panel=TRANSPORT, show_default=False,
                                          help="UCX error handling mode (overrides --transport's).")] = None,
    progress_thread: Annotated[bool, Opt("--progress-thread/--no-progress-thread", metavar="",
                                         rich_help_panel=TRANSPORT,
                                         help="NIXL progress thread (off: it spins a core; the bench polls).")]
    = False,
    target_poll: Annotated[bool, Opt("--target-poll", metavar="", rich_help_panel=TRANSPORT,
                                     help="Poll the prefill worker every 1 ms instead of busy-progressing it "
                                          "(then notifications wait for the poll).")] = False,
    notif: Annotated[bool, Opt("--notif/--no-notif", metavar="", rich_help_panel=TRANSPORT,
                               help="Attach a notification to each READ, as vLLM does.")] = True,
    pin: Annotated[bool, Opt("--pin/--no-pin", metavar="", rich_help_panel=RUN,
                             help="Pin prefill and decode ranks to different cores.")] = True,
    device: Device = "cpu",
    iters: Annotated[int, Opt(metavar="N", rich_help_panel=RUN,
                              help="Timed transfers per row (0 = as many as fit in --min-time).")] = 0,
    warmup: Annotated[int, Opt(metavar="N", rich_help_panel=RUN,
                               help="Untimed transfers first (at least one per request).")] = 3,
    min_time: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                   help="Seconds of timed transfers per row when --iters is 0.")] = 0.3,
    seed: Annotated[int, Opt(metavar="N", rich_help_panel=SWEEP,
                             help="Seed of the block tables and the data pattern.")] = 0,
    timeout: Annotated[float, Opt(metavar="SECONDS", rich_help_panel=RUN,
                                  help="Seconds any one step may take before ranks count as hung.")] = 120.0,
    log_dir: Annotated[Path | None, Opt(metavar="DIR", rich_help_panel=RUN, show_default=False,
                                        help="Keep the ranks' logs (UCX protocol tables) in this directory, "
                                             "created with its parents if missing (default: a temporary "
                                             "directory, removed after the run).")] = None,
    json_out: Annotated[bool, Opt("--json", metavar="", rich_help_panel=OUTPUT,
                                  help="One JSON document on stdout (no progress).")] = False,
    jsonl: Annotated[bool, Opt("--jsonl", metavar="", rich_help_panel=OUTPUT,
                               help="JSON lines: header, one line per row, summary.")] = False,
    csv_out: Annotated[bool, Opt("--csv", metavar="", rich_help_panel=OUTPUT, help="CSV rows on stdout.")] = False,
    plot: Annotated[Path | None, Opt(metavar="FILE.png", rich_help_panel=OUTPUT, show_default=False,
                                     help="Also write bandwidth and p99 against size to this PNG (needs "
                                          "pdcheck\\[plot]).")] = None,
    min_bw: Annotated[float | None, Opt(metavar="GB/S", rich_help_panel=FLOORS, show_default=False,
                                        help="Exit 1 if any row is below this many GB/s.")] = None,
    max_p99: Annotated[float | None, Opt(metavar="US", rich_help_panel=FLOORS, show_default=False,
                                         help="Exit 1 if any row's p99 exceeds this many µs.")] = None,
    ray: Annotated[str | None, Opt(metavar="ADDRESS", rich_help_panel=RUN, show_default=False,
                                   help="Run the ranks as Ray actors on this Ray cluster (HOST:PORT or auto): "
                                        "P on pdcheck_prefill nodes, D on pdcheck_decode nodes (needs "
                                        "pdcheck\\[ray]).")] = None,
    corrupt_block: Annotated[int | None, Opt(hidden=True, help="Self-test: corrupt this descriptor of request 0 at "
                                             "the source; the run must report #wrong > 0.")] = None,
) -> None:
    """Benchmark KV-shaped NIXL READs between real prefill and decode rank processes.

    Per row: descriptors before/after NIXL merging, GB/s, p50..p999, #wrong (logical-coordinate check),
    next to a memcpy ceiling and a one-descriptor wire ceiling measured in the same run.
    """
    try:
        code = _run(locals())
    except KeyboardInterrupt:
        raise Interrupted("interrupted; every rank process was stopped") from None
    raise typer.Exit(code)


def _run(o: dict[str, Any]) -> int:
    if sum(bool(o[k]) for k in ("json_out", "jsonl", "csv_out")) > 1:
        raise BadInput("--json, --jsonl and --csv are exclusive: pick one")
    if o["ray"] is not None:
        from pdcheck.launcher import check_ray

        check_ray(o["ray"])
    for flag, key in (("--min-bw", "min_bw"), ("--max-p99", "max_p99")):
        if o[key] is not None:
            bounds.check_number(flag, o[key], 0)
    if o["plot"] is not None:
        figure.check(o["plot"])
    shape = resolve_shape(o["model"] if o["model"] else None, layers=o["layers"], kv_heads=o["kv_heads"],
                          head_dim=o["head_dim"], dtype=o["dtype"], mla=o["mla"])
    cfg = BenchConfig(
        shape=shape, block_sizes=parse_list("--block-size", o["block_size"]),
        tokens=parse_list("--tokens", o["tokens"]), transport=preset(o["transport"]),
        run_length=o["run_length"], requests=o["requests"], ptp=o["prefill_tp"], dtp=o["decode_tp"],
        iters=o["iters"], warmup=o["warmup"], min_time=o["min_time"], seed=o["seed"],
        error_mode=o["error_mode"].lower() if o["error_mode"] else None, progress_thread=o["progress_thread"],
        target_poll=o["target_poll"], notif=o["notif"], pin=o["pin"], device=o["device"].lower(),
        timeout=o["timeout"], corrupt=o["corrupt_block"], log_dir=o["log_dir"], ray=o["ray"],
    )
    check_flags(cfg)  # the plan checks them again; here they fail before a progress bar is drawn
    machine = o["json_out"] or o["jsonl"]
    outcome = _with_progress(cfg, quiet=machine)
    failures = floors(outcome.rows, o["min_bw"], o["max_p99"])
    wrong = sum(r.wrong for r in outcome.rows)
    report = schema.Report(
        ok=not failures and not wrong, config=outcome.config, env=outcome.env, transport=outcome.transport,
        rows=outcome.rows, ceilings=outcome.ceilings,
        floors=schema.Floors(min_bw_gbps=o["min_bw"], max_p99_us=o["max_p99"], failures=failures),
        warnings=outcome.warnings,
    )
    code = verdict.exit_code([report.ok])
    if o["json_out"]:
        envelope.write_json("transfer-bench", None, code, report)
    elif o["jsonl"]:
        envelope.write_jsonl("transfer-bench", None, code, output.jsonl_lines(report))
    elif o["csv_out"]:
        sys.stdout.write(output.to_csv(report))
    else:
        from pdcheck.console import console

        con = console()
        # nccl-tests style: wide rows that wrap in a narrow terminal rather than truncated cells; a pipe is
        # never wrapped (pdcheck.console).
        output.render(report, console(width=max(con.width, 170)) if con.is_terminal else con)
    sys.stdout.flush()
    if o["plot"] is not None:
        output.plot(report, o["plot"])
    return code


def _with_progress(cfg: BenchConfig, quiet: bool) -> Any:
    from pdcheck.bench.runner import run

    # Redrawn only when a row finishes: no refresh thread competing with the pinned ranks.
    with progress.stderr_progress(enabled=not quiet, refresh_thread=False) as tick:
        rows = len(cfg.block_sizes) * len(cfg.tokens)
        tick("transfer-bench rows", 0, rows, "starting ranks")
        return run(cfg, lambda done, total, label: tick("transfer-bench rows", done, total, label))


def register(app: typer.Typer) -> None:
    """Add `transfer-bench` to the pdcheck app."""
    app.command("transfer-bench", cls=Command, epilog=EPILOG)(transfer_bench)
