"""`transfer-bench`'s body below its typer command (pdcheck.commands.transfer_bench): flags -> BenchConfig ->
run -> report -> exit code.

Exit codes: 0 all good, 1 a floor failed or a block arrived wrong, 2 bad input, 3 the harness failed,
130 interrupted. Errors are PdcheckErrors; pdcheck's entry point (cli.run) prints each as one line.
Bounds are pdcheck.bounds', checked by the plan before any process starts.
"""

from __future__ import annotations

import sys
from typing import Any

from pdcheck import bounds, envelope, figure, progress, verdict
from pdcheck.bench import output, schema
from pdcheck.bench.models import resolve_shape
from pdcheck.bench.plan import BenchConfig, check_flags
from pdcheck.bench.transport import preset
from pdcheck.errors import EXIT_INTERRUPTED, BadInput, PdcheckError


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
    shape = resolve_shape(o["model"], layers=o["layers"], kv_heads=o["kv_heads"],
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
        envelope.write("transfer-bench", None, code, report)
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
