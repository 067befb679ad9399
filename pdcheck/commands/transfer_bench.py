"""`pdcheck transfer-bench`: KV-shaped NIXL READs between real prefill and decode rank processes
(pdcheck.bench: flags -> BenchConfig -> run -> report)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pdcheck.cliopts import Command, Device
from pdcheck.commands import exit_codes, output_flags

Opt = typer.Option
SHAPE, SWEEP, TRANSPORT, RUN, OUTPUT, FLOORS = "Model and TP", "Sweep", "Transport", "Run", "Output", "CI floors"
# handshake's dtype spellings; the bench's presets name them short
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

EPILOG = f"""[bold]Examples[/]
  [dim]# Llama-3.1-8B's KV blocks, 1 prefill -> 1 decode rank, blocks 16..128[/]
  pdcheck transfer-bench
  [dim]# a custom shape, TP 2 -> 4, fragmented block tables, CI floors[/]
  pdcheck transfer-bench --model custom --layers 4 --kv-heads 8 --head-dim 128 \\
      --prefill-tp 2 --decode-tp 4 --run-length 4 --json \\
      --min-bw 1 --max-p99 5000
  [dim]# DeepSeek-V3 (MLA) over the fastest host-memory transport, plotted[/]
  pdcheck transfer-bench -m DeepSeek-V3 --transport best --plot bench.png

{exit_codes("all good", "a floor failed or a block arrived wrong")}"""


def register(app: typer.Typer) -> None:
    from pdcheck.bench.command import Interrupted, _run

    @app.command("transfer-bench", cls=Command, epilog=EPILOG)
    @output_flags
    def transfer_bench(
        model: Annotated[str | None, Opt("--model", "-m", metavar="NAME", rich_help_panel=SHAPE,
                                         help="Preset: Llama-3.1-8B, Llama-3.1-70B, Qwen3-8B, DeepSeek-V3 (MLA), ... "
                                              "custom: no preset, give --layers/--kv-heads/--head-dim.")]
        = "Llama-3.1-8B",
        layers: Annotated[int | None, Opt(metavar="N", rich_help_panel=SHAPE, show_default=False,
                                          help="Layers (overrides the preset).")] = None,
        kv_heads: Annotated[int | None, Opt(metavar="N", rich_help_panel=SHAPE, show_default=False,
                                            help="Total KV heads (overrides the preset).")] = None,
        head_dim: Annotated[int | None, Opt(metavar="N", rich_help_panel=SHAPE, show_default=False,
                                            help="Head dim; MLA: latent width per token (576 for DeepSeek-V3).")] = None,
        use_mla: Annotated[bool | None, Opt("--use-mla/--no-mla", metavar="", rich_help_panel=SHAPE,
                                            show_default=False,
                                            help="MLA: one replicated latent region per layer (default: the "
                                                 "preset's).")] = None,
        mla: Annotated[bool | None, Opt("--mla", hidden=True, help="The same as --use-mla (the older spelling).")
                       ] = None,
        dtype: Annotated[str | None, Opt(metavar="DTYPE", rich_help_panel=SHAPE, show_default=False,
                                         help="KV dtype: bfloat16, float16, float32 or fp8 (default: the preset's, "
                                              "bfloat16; bf16, fp16, fp32 also read).")] = None,
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
        o = dict(locals())
        o["mla"] = use_mla if use_mla is not None else mla
        o["dtype"] = DTYPE_ALIASES.get(dtype.lower(), dtype) if dtype is not None else None
        try:
            code = _run(o)
        except KeyboardInterrupt:
            raise Interrupted("interrupted; every rank process was stopped") from None
        raise typer.Exit(code)
