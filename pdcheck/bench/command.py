"""The `transfer-bench` typer command: flags -> BenchConfig -> run -> report -> exit code.

Exit codes: 0 all good, 1 a floor failed or a block arrived wrong, 2 bad input, 3 the harness failed,
130 interrupted. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperCommand

from pdcheck.bench import output, schema
from pdcheck.bench.models import resolve_shape
from pdcheck.bench.plan import BenchConfig
from pdcheck.bench.transport import preset
from pdcheck.errors import EXIT_HAZARD, EXIT_OK, BadInput, PdcheckError, usage_error_types

Opt = typer.Option


def _fail(msg: str, code: int) -> typer.Exit:
    sys.stderr.write(f"pdcheck transfer-bench: error: {' '.join(msg.split())}\n")
    sys.stderr.flush()
    return typer.Exit(code)


USAGE_ERRORS = usage_error_types()


class _OneLineErrors(TyperCommand):
    """Usage errors (a non-integer where an integer goes) as one line and exit 2, like ours."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except USAGE_ERRORS as exc:
            raise _fail(exc.format_message(), exc.exit_code) from None  # type: ignore[attr-defined]


def parse_list(flag: str, text: str) -> list[int]:
    """'16,32,64' or '4k' (x1024) -> ints; anything else is bad input."""
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


# Upper bounds (README "Input bounds"): lower bounds and memory are checked by make_plan.
BENCH_BOUNDS: dict[str, tuple[str, int]] = {
    "layers": ("--layers", 1024), "kv_heads": ("--kv-heads", 1024), "head_dim": ("--head-dim", 8192),
    "run_length": ("--run-length", 1 << 20), "requests": ("--requests", 1 << 20),
    "prefill_tp": ("--prefill-tp", 64), "decode_tp": ("--decode-tp", 64), "iters": ("--iters", 10**7),
    "warmup": ("--warmup", 10**6), "seed": ("--seed", 2**32 - 1), "corrupt_block": ("--corrupt-block", 2**31),
}
MAX_TOKENS = 1 << 22  # per request; a list value or a block size beyond this is a typo
MAX_LIST = 64  # values in one sweep
SECONDS = {"min_time": ("--min-time", 3600.0), "timeout": ("--timeout", 86400.0)}


def check_bounds(o: dict[str, Any]) -> None:
    for key, (flag, hi) in BENCH_BOUNDS.items():
        v = o.get(key)
        if v is not None and v > hi:
            raise BadInput(f"{flag} must be <= {hi}, got {v}")
    if o.get("seed") is not None and o["seed"] < 0:
        raise BadInput(f"--seed must be >= 0, got {o['seed']}")
    for key, (flag, hi) in SECONDS.items():
        v = o.get(key)
        if v is not None and not (math.isfinite(v) and 0 < v <= hi):
            raise BadInput(f"{flag} must be a number of seconds in (0, {hi:g}], got {v}")


def parse_bounded(flag: str, text: str) -> list[int]:
    vals = parse_list(flag, text)
    if len(vals) > MAX_LIST:
        raise BadInput(f"{flag}: {len(vals)} values; a sweep has at most {MAX_LIST}")
    for v in vals:
        if v > MAX_TOKENS:
            raise BadInput(f"{flag} values must be <= {MAX_TOKENS}, got {v}")
    return vals


def _floor(flag: str, v: float | None) -> None:
    if v is not None and not (v >= 0 and math.isfinite(v)):
        raise BadInput(f"{flag} must be a non-negative number, got {v}")


def floors(rows: list[schema.Row], min_bw: float | None, max_p99: float | None) -> list[str]:
    out = []
    for r in rows:
        if min_bw is not None and r.gbps < min_bw:
            out.append(f"{r.label}: {r.gbps:.3g} GB/s < --min-bw {min_bw:g}")
        if max_p99 is not None and r.p99_us > max_p99:
            out.append(f"{r.label}: p99 {r.p99_us:.4g} us > --max-p99 {max_p99:g}")
    return out


def transfer_bench(
    model: Annotated[str | None, Opt("--model", "-m", help="Preset: Llama-3.1-8B, Llama-3.1-70B, Qwen3-8B, "
                                     "DeepSeek-V3 (MLA), ... Omit to give --layers/--kv-heads/--head-dim.")]
    = "Llama-3.1-8B",
    layers: Annotated[int | None, Opt(help="Layers (overrides the preset).")] = None,
    kv_heads: Annotated[int | None, Opt(help="Total KV heads (overrides the preset).")] = None,
    head_dim: Annotated[int | None, Opt(help="Head dim; MLA: latent width per token (576 for DeepSeek-V3).")]
    = None,
    mla: Annotated[bool | None, Opt("--mla/--no-mla", help="MLA: one replicated latent region per layer.")]
    = None,
    dtype: Annotated[str | None, Opt(help="KV dtype: bf16, fp16, fp32, fp8.")] = None,
    block_size: Annotated[str, Opt(help="Tokens per block; a list sweeps: 16,32,64,128.")] = "16,32,64,128",
    tokens: Annotated[str, Opt(help="Tokens per request; a list sweeps: 1k,4k.")] = "1024",
    run_length: Annotated[int, Opt(help="Fragmentation: blocks come in contiguous runs of L (1 = fully "
                                   "scattered).")] = 1,
    requests: Annotated[int, Opt(help="Distinct per-request block tables cycled through (0 = enough to "
                                 "cover 4x the LLC).")] = 0,
    prefill_tp: Annotated[int, Opt(help="Prefill ranks (targets).")] = 1,
    decode_tp: Annotated[int, Opt(help="Decode ranks (initiators that READ).")] = 1,
    transport: Annotated[str, Opt(help="default (UCX's choice: CMA on one host), best (CMA with big segments "
                                  "and error mode none: fastest for host memory, costs listed in the output), "
                                  "shm (shared-memory RMA emulation, busy target), tcp.")] = "default",
    error_mode: Annotated[str | None, Opt(help="UCX error handling mode: peer or none (overrides --transport).")]
    = None,
    progress_thread: Annotated[bool, Opt("--progress-thread/--no-progress-thread",
                                         help="NIXL progress thread (off: it spins a core; the bench polls).")]
    = False,
    target_poll: Annotated[bool, Opt("--target-poll", help="Poll the prefill worker every 1 ms instead of "
                                     "busy-progressing it (then notifications wait for the poll).")] = False,
    notif: Annotated[bool, Opt("--notif/--no-notif", help="Attach a notification to each READ, as vLLM does.")]
    = True,
    pin: Annotated[bool, Opt("--pin/--no-pin", help="Pin prefill and decode ranks to different cores.")] = True,
    device: Annotated[str, Opt(help="cpu (host memory) or cuda (GPU memory, VRAM).")] = "cpu",
    iters: Annotated[int, Opt(help="Timed transfers per row (0 = as many as fit in --min-time).")] = 0,
    warmup: Annotated[int, Opt(help="Untimed transfers first (at least one per request).")] = 3,
    min_time: Annotated[float, Opt(help="Seconds of timed transfers per row when --iters is 0.")] = 0.3,
    seed: Annotated[int, Opt(help="Seed of the block tables and the data pattern.")] = 0,
    json_out: Annotated[bool, Opt("--json", help="One JSON document on stdout.")] = False,
    jsonl: Annotated[bool, Opt("--jsonl", help="JSON lines: header, one line per row, summary.")] = False,
    csv_out: Annotated[bool, Opt("--csv", help="CSV rows on stdout.")] = False,
    plot: Annotated[Path | None, Opt(help="Also write bandwidth and p99 against size to this PNG "
                                     "(needs matplotlib).")] = None,
    min_bw: Annotated[float | None, Opt(help="Exit 1 if any row is below this many GB/s (CI floor).")] = None,
    max_p99: Annotated[float | None, Opt(help="Exit 1 if any row's p99 exceeds this many µs (CI floor).")]
    = None,
    timeout: Annotated[float, Opt(help="Seconds any one step may take before ranks count as hung.")] = 120.0,
    log_dir: Annotated[Path | None, Opt(help="Keep the ranks' logs (UCX protocol tables) here.")] = None,
    ray: Annotated[str | None, Opt(help="Run the ranks as Ray actors on this Ray cluster (HOST:PORT or auto): "
                                   "P on pdcheck_prefill nodes, D on pdcheck_decode nodes (needs pdcheck\\[ray]).")]
    = None,
    corrupt_block: Annotated[int, Opt(hidden=True, help="Self-test: corrupt this descriptor of request 0 at "
                                      "the source; the run must report #wrong > 0.")] = -1,
) -> None:
    """Benchmark KV-shaped NIXL READs between real prefill and decode rank processes.

    Per row: descriptors before/after NIXL merging, GB/s, p50..p999, #wrong (logical-coordinate check),
    next to a memcpy ceiling and a one-descriptor wire ceiling measured in the same run.
    """
    try:
        code = _run(locals())
    except PdcheckError as exc:
        raise _fail(str(exc), exc.exit_code) from None
    except KeyboardInterrupt:
        raise _fail("interrupted; every rank process was stopped", 130) from None
    raise typer.Exit(code)


def _run(o: dict[str, Any]) -> int:
    if sum(bool(o[k]) for k in ("json_out", "jsonl", "csv_out")) > 1:
        raise BadInput("--json, --jsonl and --csv are exclusive: pick one")
    check_bounds(o)
    if o["ray"] is not None:
        from pdcheck.launcher import check_ray

        check_ray(o["ray"])
    _floor("--min-bw", o["min_bw"])
    _floor("--max-p99", o["max_p99"])
    if o["plot"] is not None:
        output.check_plot_available()
        if not o["plot"].resolve().parent.is_dir():
            raise BadInput(f"--plot {o['plot']}: directory does not exist")
    shape = resolve_shape(o["model"] if o["model"] else None, layers=o["layers"], kv_heads=o["kv_heads"],
                          head_dim=o["head_dim"], dtype=o["dtype"], mla=o["mla"])
    cfg = BenchConfig(
        shape=shape, block_sizes=parse_bounded("--block-size", o["block_size"]),
        tokens=parse_bounded("--tokens", o["tokens"]), transport=preset(o["transport"]),
        run_length=o["run_length"], requests=o["requests"], ptp=o["prefill_tp"], dtp=o["decode_tp"],
        iters=o["iters"], warmup=o["warmup"], min_time=o["min_time"], seed=o["seed"],
        error_mode=o["error_mode"].lower() if o["error_mode"] else None, progress_thread=o["progress_thread"],
        target_poll=o["target_poll"], notif=o["notif"], pin=o["pin"], device=o["device"].lower(),
        timeout=o["timeout"], corrupt=o["corrupt_block"], log_dir=o["log_dir"], ray=o["ray"],
    )
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
    if o["json_out"]:
        sys.stdout.buffer.write(output.to_json(report) + b"\n")
    elif o["jsonl"]:
        sys.stdout.buffer.write(output.to_jsonl(report))
    elif o["csv_out"]:
        sys.stdout.write(output.to_csv(report))
    else:
        con = Console()
        # nccl-tests style: wide rows that wrap in a narrow terminal rather than truncated cells.
        output.render(report, Console(width=max(con.width, 170), force_terminal=con.is_terminal))
    sys.stdout.flush()
    if o["plot"] is not None:
        output.plot(report, o["plot"])
    return EXIT_OK if report.ok else EXIT_HAZARD


def _with_progress(cfg: BenchConfig, quiet: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pdcheck.bench.runner import run

    err = Console(stderr=True)
    if quiet or not err.is_terminal:
        return run(cfg)
    # Refreshed only when a row finishes: no refresh thread competing with the pinned ranks.
    with Progress(TextColumn("transfer-bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=err, transient=True, auto_refresh=False) as bar:
        task = bar.add_task("starting ranks", total=len(cfg.block_sizes) * len(cfg.tokens))
        bar.refresh()

        def step(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, description=label)
            bar.refresh()

        return run(cfg, step)


def register(app: typer.Typer) -> None:
    """Add `transfer-bench` to the pdcheck app."""
    app.command("transfer-bench", cls=_OneLineErrors)(transfer_bench)
